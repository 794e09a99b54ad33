#include "weft/plan/partition.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "weft/core/error.h"
#include "weft/core/progress.h"

namespace weft::plan {

LayerCost apply_frozen_rules(LayerCost c, bool weight_grads, bool input_grads,
                             const ParamHolding& holding) {
  const bool held_as_used = !weight_grads && holding.frozen < 1;  // nothing to cast
  const double casts = (weight_grads || input_grads) && !held_as_used ? holding.casts : 0;
  c.copy_bytes = casts * c.param_bytes;
  c.expert_copy_bytes = casts * c.expert_param_bytes;
  c.trained_cast_bytes = weight_grads ? c.copy_bytes : 0;
  c.expert_trained_cast_bytes = weight_grads ? c.expert_copy_bytes : 0;
  if (!weight_grads) {
    c.weight_grad = c.train_state_bytes = c.expert_train_state_bytes = 0;
    c.partial_grad_params = 0;
    c.param_bytes *= holding.frozen;
    c.expert_param_bytes *= holding.frozen;
  }
  if (!weight_grads && !input_grads)
    c.input_grad = c.activation_bytes = c.tp_whole_bytes = c.sp_whole_bytes = 0;
  return c;
}

ParamHolding param_holding(const Spec& spec) {
  if (spec.train.precision != Precision::kBf16) return {1, 0};
  return {spec.train.frozen_fp32 ? 1.0 : 0.5, 0.5};
}

double layer_time(const LayerCost& raw, bool weight_grads, bool input_grads) {
  const LayerCost c = apply_frozen_rules(raw, weight_grads, input_grads, {});
  return c.forward + c.input_grad + c.weight_grad;
}

double layer_memory(const LayerCost& raw, bool weight_grads, bool input_grads, int64_t in_flight,
                    const ParamHolding& holding) {
  const LayerCost c = apply_frozen_rules(raw, weight_grads, input_grads, holding);
  return c.param_bytes + c.copy_bytes + c.train_state_bytes +
         static_cast<double>(in_flight) * c.activation_bytes;
}

void shard_experts(LayerCost* c, const Layout& layout) {
  const double f = static_cast<double>(layout.tp) /
                   static_cast<double>(layout.ep * layout.expert_tp());  // from 1/tp to 1/(ep·etp)
  c->param_bytes += (f - 1) * c->expert_param_bytes;
  c->train_state_bytes += (f - 1) * c->expert_train_state_bytes;
  c->copy_bytes += (f - 1) * c->expert_copy_bytes;
  c->trained_cast_bytes += (f - 1) * c->expert_trained_cast_bytes;
  c->expert_param_bytes *= f;
  c->expert_train_state_bytes *= f;
  c->expert_copy_bytes *= f;
  c->expert_trained_cast_bytes *= f;
}

MicrobatchShape single_sample_microbatch(const Spec& spec, const DataShape& data, int64_t encoder) {
  MicrobatchShape shape;
  if (data.empty()) {
    const double s = static_cast<double>(spec.model.llm.max_seq);
    shape.llm = LlmTokens{s, s, s * s};
    return shape;
  }
  shape.llm = LlmTokens{data.positions, data.targets, data.sum_sq_doc_len};
  if (encoder >= 0) shape.items = data.items_of(encoder);
  return shape;
}

DataShape DataShape::mean() const {
  DataShape d = *this;
  d.peak_positions = d.peak_targets = 0;
  d.peak_items.clear();
  return d;
}

DataShape DataShape::peak() const {
  if (!has_peak()) return mean();
  DataShape d;
  d.positions = d.tokens = peak_positions;
  d.targets = peak_targets;
  d.sum_sq_doc_len = peak_positions * peak_positions;
  d.items = peak_items;
  d.samples = samples;
  return d;
}

void check_data_shape(const Spec& spec, const DataShape& d, const std::string& where) {
  if (d.empty() && d.samples == 0) return;
  WEFT_CHECK(d.positions > 0 && std::isfinite(d.positions), where,
             ": data shape: positions per sample must be positive, got ", d.positions);
  WEFT_CHECK(d.targets >= 0 && d.targets <= d.positions, where, ": data shape: targets per ",
             "sample must be in [0, positions = ", d.positions, "], got ", d.targets);
  WEFT_CHECK(d.sum_sq_doc_len >= 0 && std::isfinite(d.sum_sq_doc_len), where,
             ": data shape: the sum of squared document lengths must be non-negative, got ",
             d.sum_sq_doc_len);
  WEFT_CHECK(d.items.size() == spec.model.encoders.size(), where, ": data shape: ", d.items.size(),
             " item counts for the model's ", spec.model.encoders.size(), " encoders");
  for (size_t e = 0; e < d.items.size(); ++e)
    WEFT_CHECK(d.items[e] >= 0 && std::isfinite(d.items[e]), where, ": data shape: items of ",
               "encoder '", spec.model.encoders[e].name, "' per sample must be non-negative, got ",
               d.items[e]);
  if (!d.has_peak()) return;
  WEFT_CHECK(std::isfinite(d.peak_positions) && d.peak_positions >= d.positions &&
                 d.peak_targets >= d.targets && d.peak_targets <= d.peak_positions,
             where, ": data shape: the peak sample (", d.peak_positions, " positions, ",
             d.peak_targets, " targets) must be at least the mean (", d.positions, ", ", d.targets,
             ") with no more targets than positions");
  WEFT_CHECK(d.peak_items.size() == d.items.size(), where, ": data shape: ", d.peak_items.size(),
             " peak item counts for the model's ", d.items.size(), " encoders");
  for (size_t e = 0; e < d.items.size(); ++e)
    WEFT_CHECK(d.peak_items[e] >= d.items[e] && std::isfinite(d.peak_items[e]), where,
               ": data shape: the peak items of encoder '", spec.model.encoders[e].name, "' (",
               d.peak_items[e], ") must be at least the mean (", d.items[e], ")");
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
  const double V = static_cast<double>(l.vocab), T = t.tokens;
  const double rows = t.logit_rows;
  const auto rules = [&](LayerCost c) {
    return apply_frozen_rules(std::move(c), m.weight_grads, m.input_grads, param_holding(spec));
  };
  ModuleCosts out;
  out.module = m.name;
  // The embedding is a lookup: no FLOPs, no input gradient (its inputs are ids).
  out.front = rules(matmul_layer("llm.embed", 0, V * h, 0));
  out.front.input_grad = 0;
  // Kept per token: both norms' inputs and outputs, q/k/v, the attention output, and the
  // feed-forward's tensors — a dense MLP's gate, up, activation and product; an MoE block's
  // top_k routed rows with their SwiGLU tensors, the shared expert's, and the fp32 router
  // logits and probabilities. Each block has its own FLOPs and parameters (flops.h).
  const MoeSpec& moe = l.moe;
  const double k = static_cast<double>(moe.top_k), Fe = static_cast<double>(l.expert_ffn());
  const double moe_ffn_act = k * (h + 4 * Fe) + 4 * static_cast<double>(moe.shared_ffn) +
                             2 * static_cast<double>(moe.experts) * 4 / act;
  for (int64_t b = 0; b < m.layers; ++b) {
    const bool is_moe = moe.is_moe_layer(b);
    const BlockParams p = llm_block_params(l, b);
    const double block_act = act * T * (4 * h + 2 * q + 2 * kv + (is_moe ? moe_ffn_act : 4 * F));
    LayerCost c = matmul_layer("llm.layers." + std::to_string(b), llm_block_forward_flops(l, t, b),
                               p.total, block_act);
    c.tp_whole_bytes = act * T * 4 * h;
    c.partial_grad_params = 2 * h;  // the two RMSNorms
    if (is_moe) c.sp_whole_bytes = act * T * h;
    c.expert_param_bytes = kParamBytes * p.experts;
    c.expert_train_state_bytes = kTrainStateBytes * p.experts;
    out.blocks.push_back(rules(std::move(c)));
  }
  // Final norm + head; a tied head keeps its own copy of the embedding when pipelined. The loss,
  // with the vocabulary whole on a rank (tp = 1), is fused with the head (model/cross_entropy.h):
  // it keeps the gradients it makes in forward, the rows' and, when the head trains, the
  // weight's (held once: the head's stage has one microbatch in flight), in the compute dtype.
  // Vocab-parallel (tp > 1), it keeps the target rows it multiplies and fp32 logits.
  const bool own_weight = !l.tie_embeddings || m.layout.pp > 1;
  const bool fused = m.layout.tp == 1;
  LayerCost head =
      matmul_layer("llm.head", llm_head_forward_flops(l, t), h + (own_weight ? V * h : 0),
                   act * 2 * T * h + act * rows * h + (fused ? 0 : 4 * rows * V));
  head.partial_grad_params = h;  // the final norm
  out.back = rules(std::move(head));
  if (fused && m.weight_grads) out.back.copy_bytes += act * V * h;
  // Whole on each TP rank: the target rows, and without sequence parallelism the final norm's
  // input and output too.
  if (out.back.activation_bytes > 0) {
    out.back.sp_whole_bytes = act * rows * h;
    out.back.tp_whole_bytes = act * 2 * T * h + out.back.sp_whole_bytes;
  }
  // The embedding is looked up in fp32 (the rows are cast): its table is cast only for a tied
  // head on the same stage.
  if (own_weight) out.front.copy_bytes = 0;
  return out;
}

ModuleCosts encoder_costs(const Spec& spec, const ModulePlan& m, double items) {
  const EncoderSpec& e = spec.model.encoders[static_cast<size_t>(m.encoder)];
  const double act = spec.train.precision == Precision::kBf16 ? 2.0 : 4.0;
  const double h = static_cast<double>(e.hidden), F = static_cast<double>(e.ffn);
  const double T = static_cast<double>(e.tokens_per_item());
  const auto rules = [&](LayerCost c) {
    return apply_frozen_rules(std::move(c), m.weight_grads, m.input_grads, param_holding(spec));
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
  LayerCost front = matmul_layer(e.name + ".front", items * encoder_front_forward_flops(e),
                                 front_params, act * items * front_act);
  if (e.kind == EncoderKind::kVit && e.pre_norm) front.partial_grad_params = 2 * h;  // pre-LN
  out.front = rules(std::move(front));
  out.front.input_grad = 0;
  // Pre-LN block with a GELU MLP; kept per token: x, LN1 out, q/k/v, attention out, the residual,
  // LN2 out, fc1 out, GELU out.
  const double block_params = 4 * h * h + 2 * h * F + 9 * h + F;
  // Of those, x, LN1 out, the residual and LN2 out are whole on every tensor-parallel rank.
  const double block_act = act * items * T * (8 * h + 2 * F);
  const double block = items * encoder_block_forward_flops(e);
  for (int64_t b = 0; b < m.layers; ++b) {
    LayerCost c =
        matmul_layer(e.name + ".layers." + std::to_string(b), block, block_params, block_act);
    c.tp_whole_bytes = act * items * T * 4 * h;
    c.partial_grad_params = 6 * h;  // two LayerNorms, the biases of the attention output and fc2
    out.blocks.push_back(rules(std::move(c)));
  }
  // The projector (a module of its own, on this encoder's last stage) with its own flags.
  const double a = h, d = static_cast<double>(spec.model.llm.hidden);
  const bool mlp = e.projector.kind == ProjectorKind::kMlp;
  LayerCost proj =
      matmul_layer(e.name + ".projector", items * projector_forward_flops(e, spec.model.llm),
                   a * d + d + (mlp ? d * d + d : 0), act * items * T * (mlp ? a + 2 * d : a));
  if (!m.weight_grads) proj.input_grad = 0;  // nothing before it trains: no input gradient
  out.back = apply_frozen_rules(proj, !e.projector.frozen, m.weight_grads, param_holding(spec));
  if (e.kind == EncoderKind::kWhisper) {  // the final LayerNorm runs on the last stage too
    out.back.param_bytes += kParamBytes * 2 * h;
    if (m.weight_grads) {
      out.back.train_state_bytes += kTrainStateBytes * 2 * h;
      out.back.partial_grad_params += 2 * h;
    }
  }
  return out;
}

// Sums over a stage's layers (memory split into what is held once and what every in-flight
// microbatch keeps).
struct StageSums {
  double time = 0, held_bytes = 0, activation_bytes = 0;
  void add(const LayerCost& c) {
    time += c.forward + c.input_grad + c.weight_grad;
    held_bytes += c.param_bytes + c.copy_bytes + c.train_state_bytes;
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

}  // namespace

ModuleCosts module_layer_costs(const Spec& spec, const ModulePlan& module,
                               const MicrobatchShape& shape) {
  WEFT_CHECK(module.role != ModuleRole::kProjector, "module_layer_costs: ", module.name,
             " is a projector; it is costed as the last layer of its encoder");
  return module.role == ModuleRole::kLlm ? llm_costs(spec, module, shape.llm)
                                         : encoder_costs(spec, module, shape.items);
}

ModuleCosts sample_costs(const Spec& spec, const ModulePlan& module, const DataShape& data) {
  return module_layer_costs(
      spec, module,
      single_sample_microbatch(spec, data, module.role == ModuleRole::kLlm ? -1 : module.encoder));
}

std::vector<int64_t> even_cuts(const ModuleCosts& c, int64_t n) {
  const auto work = [](const LayerCost& l) { return l.forward + l.input_grad + l.weight_grad; };
  const int64_t blocks = static_cast<int64_t>(c.blocks.size());
  std::vector<double> before(static_cast<size_t>(blocks + 1), work(c.front));  // work before b
  for (int64_t b = 0; b < blocks; ++b)
    before[static_cast<size_t>(b + 1)] = before[static_cast<size_t>(b)] + work(c.blocks[b]);
  const double total = before.back() + work(c.back);
  std::vector<int64_t> cuts;
  for (int64_t k = 1; k < n; ++k) {
    const double target = total * static_cast<double>(k) / static_cast<double>(n);
    const int64_t lo = cuts.empty() ? 1 : cuts.back() + 1, hi = blocks - (n - k);  // non-empty
    int64_t best = lo;
    for (int64_t b = lo; b <= hi; ++b)
      if (std::abs(before[static_cast<size_t>(b)] - target) <
          std::abs(before[static_cast<size_t>(best)] - target))
        best = b;
    cuts.push_back(best);
  }
  return cuts;
}

StagePartition partition_stages(const ModuleCosts& costs, const PartitionOptions& o) {
  const int64_t n = static_cast<int64_t>(costs.blocks.size()), P = o.stages;
  WEFT_CHECK(P >= 1 && P <= n, "[partition] module '", costs.module, "': ", P,
             " pipeline stages for ", n, " blocks (expected 1 <= stages <= blocks)");
  WEFT_CHECK(o.microbatches >= 1, "[partition] module '", costs.module,
             "': microbatches = ", o.microbatches, " (expected >= 1)");
  const auto offsets_ok = [&](const std::vector<double>& v) {
    return v.empty() || static_cast<int64_t>(v.size()) == P;
  };
  WEFT_ASSERT(offsets_ok(o.time_offset) && offsets_ok(o.memory_offset), "stage offsets of ",
              costs.module);
  const auto offset = [](const std::vector<double>& v, int64_t s) {
    return v.empty() ? 0.0 : v[static_cast<size_t>(s)];
  };
  const auto in_flight = [&](int64_t s) {
    return o.all_in_flight ? o.microbatches : std::min(P - s, o.microbatches);
  };
  const auto memory = [&](int64_t s, const StageSums& sums) {
    return sums.memory(in_flight(s)) + offset(o.memory_offset, s);
  };
  const auto time_if_fits = [&](int64_t s, const StageSums& sums) {
    return memory(s, sums) <= o.memory_limit_bytes ? sums.time + offset(o.time_offset, s) : kInf;
  };
  const auto best = suffix_minmax(costs, P, time_if_fits);
  const double bottleneck = best[0][0];
  if (bottleneck == kInf) {
    const auto peak = suffix_minmax(costs, P, memory);
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

// ---- joint partition ----------------------------------------------------------------------

namespace {

// One module of a joint partition, with the sums of every stage it can form.
struct JointState {
  const JointModule* m = nullptr;
  int64_t n = 0, P = 1;
  bool free = false;  // boundaries to choose
  // range[i][j - i - 1]: the stage covering blocks [i, j), front / back included at the ends,
  // accumulated left to right as for_each_stage does.
  std::vector<std::vector<StageSums>> range;
  std::vector<int64_t> boundaries;  // current: given, or chosen

  const StageSums& sums(int64_t i, int64_t j) const {
    return range[static_cast<size_t>(i)][static_cast<size_t>(j - i - 1)];
  }
  int64_t in_flight(int64_t s, int64_t M) const {
    return m->all_in_flight ? M : std::min(P - s, M);
  }
  StagePartition evaluate(int64_t M) const {
    StagePartition out;
    out.boundaries = boundaries;
    for (int64_t s = 0; s < P; ++s) {
      const int64_t i = s == 0 ? 0 : boundaries[static_cast<size_t>(s - 1)];
      const int64_t j = s == P - 1 ? n : boundaries[static_cast<size_t>(s)];
      const StageSums& x = sums(i, j);
      out.stage_time.push_back(x.time);
      out.stage_memory.push_back(x.memory(in_flight(s, M)));
      out.bottleneck = std::max(out.bottleneck, x.time);
    }
    return out;
  }
};

JointState joint_state(const JointModule& m) {
  JointState st;
  st.m = &m;
  st.n = static_cast<int64_t>(m.costs.blocks.size());
  st.P = m.stages;
  const std::string at = "[partition] module '" + m.costs.module + "': ";
  WEFT_CHECK(st.P >= 1 && st.P <= st.n, at, st.P, " pipeline stages for ", st.n,
             " blocks (expected 1 <= stages <= blocks)");
  st.free = st.P > 1 && m.boundaries.empty();
  if (!st.free) {
    bool ok = static_cast<int64_t>(m.boundaries.size()) == st.P - 1;
    for (size_t k = 0; ok && k < m.boundaries.size(); ++k)
      ok = m.boundaries[k] >= 1 && m.boundaries[k] <= st.n - 1 &&
           (k == 0 || m.boundaries[k] > m.boundaries[k - 1]);
    WEFT_CHECK(ok, at, "given boundaries are not ", st.P - 1,
               " strictly increasing block indices in [1, ", st.n - 1, "]");
    st.boundaries = m.boundaries;
  }
  st.range.resize(static_cast<size_t>(st.n));
  for (int64_t i = 0; i < st.n; ++i) {
    StageSums sums;
    if (i == 0) sums.add(m.costs.front);
    for (int64_t j = i + 1; j <= st.n; ++j) {
      sums.add(m.costs.blocks[static_cast<size_t>(j - 1)]);
      StageSums x = sums;
      if (j == st.n) x.add(m.costs.back);
      st.range[static_cast<size_t>(i)].push_back(x);
    }
  }
  return st;
}

int64_t lcm(int64_t a, int64_t b) {
  int64_t x = a, y = b;
  while (y != 0) x = std::exchange(y, x % y);
  return a / x * b;
}

// Odometer over tuples v with lo_k <= v_k <= hi_k, the last entry fastest (lexicographic).
template <typename F>
void odometer(const std::vector<int64_t>& lo, const std::vector<int64_t>& hi, F f) {
  for (size_t k = 0; k < lo.size(); ++k)
    if (lo[k] > hi[k]) return;
  std::vector<int64_t> v = lo;
  while (true) {
    f(v);
    size_t k = v.size();
    while (k > 0 && v[k - 1] == hi[k - 1]) v[k - 1] = lo[k - 1], --k;
    if (k == 0) return;
    ++v[k - 1];
  }
}

// Exact DP for colocated modules whose pipelines all have P stages: over stages × the next block
// of every free module (`free`), the fixed modules' per-stage time and memory added.
class JointDp {
 public:
  JointDp(std::vector<JointState>* states, std::vector<size_t> free, int64_t P, int64_t M,
          std::vector<double> fixed_time, std::vector<double> fixed_memory)
      : st_(*states),
        free_(std::move(free)),
        P_(P),
        M_(M),
        fixed_time_(std::move(fixed_time)),
        fixed_memory_(std::move(fixed_memory)) {
    for (size_t f : free_) {
      radix_.push_back(states_);
      states_ *= st_[f].n + 1;
    }
  }
  // Transitions the DP makes, at most: P · Π (n + 1)².
  double work() const {
    double w = static_cast<double>(P_);
    for (size_t f : free_) w *= static_cast<double>((st_[f].n + 1) * (st_[f].n + 1));
    return w;
  }

  // best[s][starts] = the smallest max over stages s..P-1 of value(s, time, memory) (+inf = not
  // allowed), as suffix_minmax for one module.
  template <typename Value>
  std::vector<std::vector<double>> solve(Value value) const {
    std::vector<std::vector<double>> best(static_cast<size_t>(P_ + 1),
                                          std::vector<double>(static_cast<size_t>(states_), kInf));
    std::vector<int64_t> ends;
    for (size_t f : free_) ends.push_back(st_[f].n);
    best[static_cast<size_t>(P_)][static_cast<size_t>(index(ends))] = -kInf;
    for (int64_t s = P_ - 1; s >= 0; --s) {
      std::vector<int64_t> lo, hi;
      for (size_t f : free_) lo.push_back(s), hi.push_back(s == 0 ? 0 : st_[f].n - (P_ - s));
      odometer(lo, hi, [&](const std::vector<int64_t>& b) {
        double& slot = best[static_cast<size_t>(s)][static_cast<size_t>(index(b))];
        transitions(s, b, [&](const std::vector<int64_t>& e, double t, double mem) {
          slot = std::min(slot, std::max(value(s, t, mem), next(best, s, e)));
        });
      });
    }
    return best;
  }

  // Stage by stage, the earliest ends (modules in order) that still allow the optimum; written
  // into the free modules' boundaries.
  template <typename Value>
  void recover(const std::vector<std::vector<double>>& best, Value value) {
    const double optimum = best[0][0];
    for (size_t f : free_) st_[f].boundaries.clear();
    std::vector<int64_t> b(free_.size(), 0);
    for (int64_t s = 0; s < P_; ++s) {
      std::vector<int64_t> chosen;
      transitions(s, b, [&](const std::vector<int64_t>& e, double t, double mem) {
        if (chosen.empty() && value(s, t, mem) <= optimum && next(best, s, e) <= optimum)
          chosen = e;
      });
      WEFT_ASSERT(!chosen.empty(), "no optimal joint stage ", s);
      if (s + 1 < P_)
        for (size_t k = 0; k < free_.size(); ++k) st_[free_[k]].boundaries.push_back(chosen[k]);
      b = chosen;
    }
  }

 private:
  std::vector<JointState>& st_;
  std::vector<size_t> free_;
  int64_t P_, M_;
  std::vector<double> fixed_time_, fixed_memory_;
  std::vector<int64_t> radix_;
  int64_t states_ = 1;

  int64_t index(const std::vector<int64_t>& v) const {
    int64_t i = 0;
    for (size_t k = 0; k < v.size(); ++k) i += v[k] * radix_[k];
    return i;
  }
  double next(const std::vector<std::vector<double>>& best, int64_t s,
              const std::vector<int64_t>& e) const {
    return best[static_cast<size_t>(s + 1)][static_cast<size_t>(index(e))];
  }
  // f(ends, time, memory) for every end tuple stage s can have from starts b (each module leaves
  // a block for every later stage; the last stage ends at n).
  template <typename F>
  void transitions(int64_t s, const std::vector<int64_t>& b, F f) const {
    std::vector<int64_t> lo, hi;
    for (size_t k = 0; k < free_.size(); ++k) {
      const int64_t n = st_[free_[k]].n;
      lo.push_back(s == P_ - 1 ? n : b[k] + 1);
      hi.push_back(s == P_ - 1 ? n : n - (P_ - 1 - s));
    }
    odometer(lo, hi, [&](const std::vector<int64_t>& e) {
      double t = fixed_time_[static_cast<size_t>(s)], mem = fixed_memory_[static_cast<size_t>(s)];
      for (size_t k = 0; k < free_.size(); ++k) {
        const JointState& x = st_[free_[k]];
        const StageSums& sums = x.sums(b[k], e[k]);
        t += sums.time;
        mem += sums.memory(x.in_flight(s, M_));
      }
      f(e, t, mem);
    });
  }
};

std::string module_list(const std::vector<JointState>& states) {
  std::string out;
  for (const JointState& s : states) out += (out.empty() ? "'" : ", '") + s.m->costs.module + "'";
  return out;
}

}  // namespace

JointPartition partition_joint(const std::vector<JointModule>& modules, const JointOptions& o) {
  WEFT_CHECK(!modules.empty(), "[partition] no modules to partition");
  WEFT_CHECK(o.microbatches >= 1, "[partition] microbatches = ", o.microbatches,
             " (expected >= 1)");
  const int64_t M = o.microbatches;
  const double limit = o.memory_limit_bytes;
  std::vector<JointState> st;
  for (const JointModule& m : modules) st.push_back(joint_state(m));
  const auto options_of = [&](const JointState& s) {
    PartitionOptions po;
    po.stages = s.P;
    po.microbatches = M;
    po.memory_limit_bytes = limit;
    po.all_in_flight = s.m->all_in_flight;
    return po;
  };
  JointPartition out;
  if (!o.colocated) {  // independent pipelines: each module's own optimum
    for (JointState& s : st) {
      if (s.free) s.boundaries = partition_stages(s.m->costs, options_of(s)).boundaries;
      const StagePartition sp = s.evaluate(M);
      for (size_t k = 0; k < sp.stage_memory.size(); ++k)
        WEFT_CHECK(sp.stage_memory[k] <= limit, "[partition] module '", s.m->costs.module,
                   "': stage ", k, " of the given stages needs ", format_bytes(sp.stage_memory[k]),
                   ", over the memory limit of ", format_bytes(limit), " per rank");
      out.rank_time.insert(out.rank_time.end(), sp.stage_time.begin(), sp.stage_time.end());
      out.rank_memory.insert(out.rank_memory.end(), sp.stage_memory.begin(), sp.stage_memory.end());
      out.modules.push_back(sp);
    }
    out.bottleneck = *std::max_element(out.rank_time.begin(), out.rank_time.end());
    return out;
  }

  // Colocated: rank class c of L hosts stage c · P_k / L of module k.
  int64_t L = 1, pipelined = 0;
  bool aligned = true;
  std::vector<size_t> free;
  for (size_t k = 0; k < st.size(); ++k) {
    L = lcm(L, st[k].P);
    if (st[k].P > 1) {
      aligned = aligned && (pipelined == 0 || st[k].P == pipelined);
      pipelined = st[k].P;
    }
    if (st[k].free) free.push_back(k);
  }
  const auto stage_of = [&](size_t k, int64_t c) { return static_cast<size_t>(c * st[k].P / L); };
  // Per rank class: the time and memory of every module but `skip` (and, with `fixed_only`, but
  // every free module).
  const auto others = [&](size_t skip, bool fixed_only) {
    std::vector<double> t(static_cast<size_t>(L), 0), mem(static_cast<size_t>(L), 0);
    for (size_t k = 0; k < st.size(); ++k) {
      if (k == skip || (fixed_only && st[k].free)) continue;
      const StagePartition sp = st[k].evaluate(M);
      for (int64_t c = 0; c < L; ++c) {
        t[static_cast<size_t>(c)] += sp.stage_time[stage_of(k, c)];
        mem[static_cast<size_t>(c)] += sp.stage_memory[stage_of(k, c)];
      }
    }
    return std::make_pair(t, mem);
  };
  const auto finish = [&](bool exact) {
    JointPartition jp;
    jp.exact = exact;
    for (const JointState& s : st) jp.modules.push_back(s.evaluate(M));
    const auto [t, mem] = others(st.size(), false);
    jp.rank_time = t;
    jp.rank_memory = mem;
    jp.bottleneck = *std::max_element(t.begin(), t.end());
    for (int64_t c = 0; c < L; ++c)
      WEFT_CHECK(mem[static_cast<size_t>(c)] <= limit, "[partition] modules ", module_list(st),
                 " (colocated): no joint split fits the memory limit of ", format_bytes(limit),
                 " per rank; the best split found needs ",
                 format_bytes(mem[static_cast<size_t>(c)]), " on the ranks of stage ", c, " (", M,
                 " microbatches; raise the limit, add stages or shard more)");
    return jp;
  };
  if (free.empty()) return finish(true);

  if (aligned) {  // every pipelined module has L stages: exact DP when small enough
    const auto [fixed_time, fixed_memory] = others(st.size(), true);
    JointDp dp(&st, free, L, M, fixed_time, fixed_memory);
    if (dp.work() <= 4e7) {
      const auto time_if_fits = [&](int64_t, double t, double mem) {
        return mem <= limit ? t : kInf;
      };
      const auto best = dp.solve(time_if_fits);
      if (best[0][0] == kInf) {
        const auto peak = dp.solve([](int64_t, double, double mem) { return mem; });
        WEFT_FAIL("[partition] modules ", module_list(st), " (colocated, ", L,
                  " stages): no joint split fits the memory limit of ", format_bytes(limit),
                  " per rank; the smallest achievable peak is ", format_bytes(peak[0][0]), " (", M,
                  " microbatches; raise the limit, add stages or shard more)");
      }
      dp.recover(best, time_if_fits);
      return finish(true);
    }
  }

  // Coordinate descent: each free module's exact optimum given the others' load on its ranks.
  const auto solve_one = [&](size_t k, bool fixed_only) {
    const auto [t, mem] = others(k, fixed_only);
    PartitionOptions po = options_of(st[k]);
    po.time_offset.assign(static_cast<size_t>(st[k].P), 0);
    po.memory_offset.assign(static_cast<size_t>(st[k].P), 0);
    for (int64_t c = 0; c < L; ++c) {  // a stage's ranks: the worst class among them
      const size_t s = stage_of(k, c);
      po.time_offset[s] = std::max(po.time_offset[s], t[static_cast<size_t>(c)]);
      po.memory_offset[s] = std::max(po.memory_offset[s], mem[static_cast<size_t>(c)]);
    }
    return partition_stages(st[k].m->costs, po);
  };
  const auto bottleneck = [&] {
    const auto [t, mem] = others(st.size(), false);
    double worst = 0;
    for (int64_t c = 0; c < L; ++c)
      worst =
          std::max(worst, mem[static_cast<size_t>(c)] <= limit ? t[static_cast<size_t>(c)] : kInf);
    return worst;
  };
  for (size_t k : free) st[k].boundaries = solve_one(k, true).boundaries;
  double current = bottleneck();
  for (int round = 0; round < 64; ++round) {
    bool improved = false;
    for (size_t k : free) {
      const std::vector<int64_t> keep = st[k].boundaries;
      try {
        st[k].boundaries = solve_one(k, false).boundaries;
      } catch (const Error&) {  // no split of this module fits beside the others: keep it
        continue;
      }
      const double now = bottleneck();
      if (now < current) {
        current = now, improved = true;
      } else {
        st[k].boundaries = keep;
      }
    }
    if (!improved) break;
  }
  return finish(free.size() == 1);
}

}  // namespace weft::plan
