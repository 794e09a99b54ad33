#include "weft/plan/partition.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "weft/core/error.h"

namespace weft::plan {

LayerCost apply_frozen_rules(LayerCost c, bool weight_grads, bool input_grads) {
  if (!weight_grads) c.weight_grad = c.train_state_bytes = 0;
  if (!weight_grads && !input_grads) c.input_grad = c.activation_bytes = 0;
  return c;
}

double layer_time(const LayerCost& raw, bool weight_grads, bool input_grads) {
  const LayerCost c = apply_frozen_rules(raw, weight_grads, input_grads);
  return c.forward + c.input_grad + c.weight_grad;
}

double layer_memory(const LayerCost& raw, bool weight_grads, bool input_grads, int64_t in_flight) {
  const LayerCost c = apply_frozen_rules(raw, weight_grads, input_grads);
  return c.param_bytes + c.train_state_bytes + static_cast<double>(in_flight) * c.activation_bytes;
}

MicrobatchShape single_sample_microbatch(const Spec& spec) {
  const int64_t s = spec.model.llm.max_seq;
  MicrobatchShape shape;
  shape.llm = LlmTokens{s, s, static_cast<double>(s) * static_cast<double>(s)};
  shape.items = 1;
  return shape;
}

namespace {

constexpr double kParamBytes = 4;        // fp32 parameters
constexpr double kTrainStateBytes = 12;  // fp32 gradient + AdamW's two fp32 moments
constexpr double kInf = std::numeric_limits<double>::infinity();

// A layer whose backward, where it runs, costs 1x forward for each gradient (matmul layers).
LayerCost matmul_layer(std::string name, double forward, double params, double activation_bytes) {
  LayerCost c;
  c.name = std::move(name);
  c.forward = c.input_grad = c.weight_grad = forward;
  c.activation_bytes = activation_bytes;
  c.param_bytes = kParamBytes * params;
  c.train_state_bytes = kTrainStateBytes * params;
  return c;
}

ModuleCosts llm_costs(const Spec& spec, const ModulePlan& m, const LlmTokens& t) {
  const LlmSpec& l = spec.model.llm;
  const double act = spec.train.precision == Precision::kBf16 ? 2.0 : 4.0;
  const double h = static_cast<double>(l.hidden), F = static_cast<double>(l.ffn);
  const double q = static_cast<double>(l.head_dim() * l.heads);
  const double kv = static_cast<double>(l.head_dim() * l.kv_heads);
  const double V = static_cast<double>(l.vocab), T = static_cast<double>(t.tokens);
  const double rows = static_cast<double>(t.logit_rows);
  const auto rules = [&](LayerCost c) {
    return apply_frozen_rules(std::move(c), m.weight_grads, m.input_grads);
  };
  ModuleCosts out;
  out.module = m.name;
  // The embedding is a lookup: no FLOPs, no input gradient (its inputs are ids).
  out.front = rules(matmul_layer("llm.embed", 0, V * h, 0));
  out.front.input_grad = 0;
  // Kept per token: both norms' inputs and outputs, q/k/v, the attention output, the MLP's
  // gate, up, activation and product.
  const double block_params = h * (q + 2 * kv) + q * h + 3 * h * F + 2 * h;
  const double block_act = act * T * (4 * h + 2 * q + 2 * kv + 4 * F);
  const double block = llm_block_forward_flops(l, t);
  for (int64_t b = 0; b < m.layers; ++b)
    out.blocks.push_back(
        rules(matmul_layer("llm.layers." + std::to_string(b), block, block_params, block_act)));
  // Final norm + head; a tied head keeps its own copy of the embedding when pipelined. Logits
  // are fp32.
  const bool own_weight = !l.tie_embeddings || m.layout.pp > 1;
  out.back = rules(matmul_layer("llm.head", llm_head_forward_flops(l, t),
                                h + (own_weight ? V * h : 0), act * 2 * T * h + 4 * rows * V));
  return out;
}

ModuleCosts encoder_costs(const Spec& spec, const ModulePlan& m, double items) {
  const EncoderSpec& e = spec.model.encoders[static_cast<size_t>(m.encoder)];
  const double act = spec.train.precision == Precision::kBf16 ? 2.0 : 4.0;
  const double h = static_cast<double>(e.hidden), F = static_cast<double>(e.ffn);
  const double T = static_cast<double>(e.tokens_per_item());
  const auto rules = [&](LayerCost c) {
    return apply_frozen_rules(std::move(c), m.weight_grads, m.input_grads);
  };
  ModuleCosts out;
  out.module = m.name;
  // Front end: its inputs are data, so no input gradient.
  double front_params = 0, front_act = 0;
  if (e.kind == EncoderKind::kVit) {
    double in = static_cast<double>(e.channels), side = static_cast<double>(e.image_size);
    double kernel = static_cast<double>(e.patch);
    front_act = in * side * side;  // the image
    for (int64_t i = 0; e.stem_channels > 0 && i < e.stem_layers; ++i) {
      const double c = static_cast<double>(e.stem_channels);
      side /= 2, kernel /= 2;
      front_params += c * in * 9 + c;
      front_act += 2 * c * side * side;  // conv output, GELU output
      in = c;
    }
    front_params += h * in * kernel * kernel + h + T * h + 2 * h;  // patch, positions, pre-LN
    front_act += 3 * T * h;
  } else {
    const double mels = static_cast<double>(e.mels), frames = static_cast<double>(e.frames);
    front_params = h * mels * 3 + h + h * h * 3 + h;
    front_act = mels * frames + 2 * frames * h + 3 * T * h;
  }
  out.front = rules(matmul_layer(e.name + ".front", items * encoder_front_forward_flops(e),
                                 front_params, act * items * front_act));
  out.front.input_grad = 0;
  // Pre-LN block with a GELU MLP; kept per token: x, LN1 out, q/k/v, attention out, the residual,
  // LN2 out, fc1 out, GELU out.
  const double block_params = 4 * h * h + 2 * h * F + 9 * h + F;
  const double block_act = act * items * T * (8 * h + 2 * F);
  const double block = items * encoder_block_forward_flops(e);
  for (int64_t b = 0; b < m.layers; ++b)
    out.blocks.push_back(rules(
        matmul_layer(e.name + ".layers." + std::to_string(b), block, block_params, block_act)));
  // The projector (a module of its own, on this encoder's last stage) with its own flags.
  const double a = h, d = static_cast<double>(spec.model.llm.hidden);
  const bool mlp = e.projector.kind == ProjectorKind::kMlp;
  LayerCost proj =
      matmul_layer(e.name + ".projector", items * projector_forward_flops(e, spec.model.llm),
                   a * d + d + (mlp ? d * d + d : 0), act * items * T * (mlp ? a + 2 * d : a));
  if (!m.weight_grads) proj.input_grad = 0;  // nothing before it trains: no input gradient
  out.back = apply_frozen_rules(proj, !e.projector.frozen, m.weight_grads);
  if (e.kind == EncoderKind::kWhisper) {  // the final LayerNorm runs on the last stage too
    out.back.param_bytes += kParamBytes * 2 * h;
    if (m.weight_grads) out.back.train_state_bytes += kTrainStateBytes * 2 * h;
  }
  return out;
}

// Sums over a stage's layers (memory split into what is held once and what every in-flight
// microbatch keeps).
struct StageSums {
  double time = 0, held_bytes = 0, activation_bytes = 0;
  void add(const LayerCost& c) {
    time += c.forward + c.input_grad + c.weight_grad;
    held_bytes += c.param_bytes + c.train_state_bytes;
    activation_bytes += c.activation_bytes;
  }
  double memory(int64_t in_flight) const {
    return held_bytes + static_cast<double>(in_flight) * activation_bytes;
  }
};

// Calls f(end, sums) for every stage `s` of `stages` starting at block `begin` can form: blocks
// [begin, end), leaving at least one block per later stage, with the front / back layers on the
// first / last block's stage. Sums accumulate left to right, the same way for every caller.
template <typename F>
void for_each_stage(const ModuleCosts& c, int64_t stages, int64_t s, int64_t begin, F f) {
  const int64_t n = static_cast<int64_t>(c.blocks.size());
  StageSums sums;
  if (begin == 0) sums.add(c.front);
  for (int64_t end = begin + 1; end <= n - (stages - 1 - s); ++end) {
    sums.add(c.blocks[static_cast<size_t>(end - 1)]);
    if (end < n) {
      if (s < stages - 1) f(end, sums);
      continue;
    }
    StageSums last = sums;
    last.add(c.back);
    f(end, last);
  }
}

// best[s][i]: the smallest max over stages s..P-1 of value(s, sums) covering blocks [i, n);
// +inf where no split is allowed (value +inf marks a stage as not allowed).
template <typename Value>
std::vector<std::vector<double>> suffix_minmax(const ModuleCosts& c, int64_t stages, Value value) {
  const int64_t n = static_cast<int64_t>(c.blocks.size());
  std::vector<std::vector<double>> best(static_cast<size_t>(stages + 1),
                                        std::vector<double>(static_cast<size_t>(n + 1), kInf));
  best[static_cast<size_t>(stages)][static_cast<size_t>(n)] = -kInf;
  for (int64_t s = stages - 1; s >= 0; --s)
    for (int64_t i = s; i <= n - (stages - s); ++i) {
      double& b = best[static_cast<size_t>(s)][static_cast<size_t>(i)];
      for_each_stage(c, stages, s, i, [&](int64_t end, const StageSums& sums) {
        b = std::min(b, std::max(value(s, sums),
                                 best[static_cast<size_t>(s + 1)][static_cast<size_t>(end)]));
      });
    }
  return best;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = bytes;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace

ModuleCosts module_layer_costs(const Spec& spec, const ModulePlan& module,
                               const MicrobatchShape& shape) {
  WEFT_CHECK(module.role != ModuleRole::kProjector, "module_layer_costs: ", module.name,
             " is a projector; it is costed as the last layer of its encoder");
  return module.role == ModuleRole::kLlm ? llm_costs(spec, module, shape.llm)
                                         : encoder_costs(spec, module, shape.items);
}

StagePartition partition_stages(const ModuleCosts& costs, const PartitionOptions& o) {
  const int64_t n = static_cast<int64_t>(costs.blocks.size()), P = o.stages;
  WEFT_CHECK(P >= 1 && P <= n, "[partition] module '", costs.module, "': ", P,
             " pipeline stages for ", n, " blocks (expected 1 <= stages <= blocks)");
  WEFT_CHECK(o.microbatches >= 1, "[partition] module '", costs.module,
             "': microbatches = ", o.microbatches, " (expected >= 1)");
  const auto in_flight = [&](int64_t s) { return std::min(P - s, o.microbatches); };
  const auto time_if_fits = [&](int64_t s, const StageSums& sums) {
    return sums.memory(in_flight(s)) <= o.memory_limit_bytes ? sums.time : kInf;
  };
  const auto best = suffix_minmax(costs, P, time_if_fits);
  const double bottleneck = best[0][0];
  if (bottleneck == kInf) {
    const auto peak = suffix_minmax(
        costs, P, [&](int64_t s, const StageSums& sums) { return sums.memory(in_flight(s)); });
    WEFT_FAIL("[partition] module '", costs.module, "': no split of ", n, " blocks into ", P,
              " stages fits the memory limit of ", format_bytes(o.memory_limit_bytes),
              " per stage; the smallest achievable peak stage memory is ", format_bytes(peak[0][0]),
              " (", o.microbatches,
              " microbatches in flight at most; raise the limit, add stages or shard more)");
  }
  // Walk forward taking the earliest end that still allows an optimal completion: the
  // lexicographically smallest optimal boundaries.
  StagePartition out;
  out.bottleneck = bottleneck;
  int64_t begin = 0;
  for (int64_t s = 0; s < P; ++s) {
    int64_t chosen = -1;
    StageSums chosen_sums;
    for_each_stage(costs, P, s, begin, [&](int64_t end, const StageSums& sums) {
      if (chosen < 0 && time_if_fits(s, sums) <= bottleneck &&
          best[static_cast<size_t>(s + 1)][static_cast<size_t>(end)] <= bottleneck)
        chosen = end, chosen_sums = sums;
    });
    WEFT_ASSERT(chosen > begin, "no optimal stage ", s, " of ", costs.module);
    if (s + 1 < P) out.boundaries.push_back(chosen);
    out.stage_time.push_back(chosen_sums.time);
    out.stage_memory.push_back(chosen_sums.memory(in_flight(s)));
    begin = chosen;
  }
  WEFT_ASSERT(begin == n, "partition of ", costs.module, " does not cover its blocks");
  return out;
}

}  // namespace weft::plan
