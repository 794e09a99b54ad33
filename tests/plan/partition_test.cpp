// Pipeline partition: the frozen rules on layer costs, the FLOP cost model against flops.h, the
// DP against brute force over every contiguous partition (bottleneck, earliest-boundary ties,
// memory limits, infeasibility), and make_plan's default stage boundaries.
#include "weft/plan/partition.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/plan_specs.h"
#include "weft/core/error.h"
#include "weft/core/spec.h"
#include "weft/plan/flops.h"
#include "weft/plan/plan.h"
#include "weft/plan/search.h"
#include "weft/plan/simulate.h"

namespace weft::plan {
namespace {

using testing::vlm_spec;

constexpr double kInf = std::numeric_limits<double>::infinity();

LayerCost cost(double forward, double input_grad, double weight_grad, double activation = 0,
               double params = 0, double state = 0) {
  LayerCost c;
  c.forward = forward, c.input_grad = input_grad, c.weight_grad = weight_grad;
  c.activation_bytes = activation, c.param_bytes = params, c.train_state_bytes = state;
  return c;
}

double total(const LayerCost& c) { return c.forward + c.input_grad + c.weight_grad; }

TEST(Partition, FrozenRulesOnOneLayer) {
  const LayerCost c = cost(2, 3, 5, 7, 11, 13);
  const ParamHolding fp32{1, 0}, bf16{0.5, 0.5}, bf16_masters{1, 0.5};
  // Trainable: all three, activations, params + state (whatever upstream does); under bf16 the
  // fp32 masters and their bf16 casts.
  EXPECT_EQ(layer_time(c, true, false), 10);
  EXPECT_EQ(layer_time(c, true, true), 10);
  EXPECT_EQ(layer_memory(c, true, false, 3, fp32), 11 + 13 + 3 * 7);
  EXPECT_EQ(layer_memory(c, true, false, 3, bf16), 11 + 5.5 + 13 + 3 * 7);
  // Frozen with trainable upstream: forward + input grad, activations, params only: in bf16
  // half the bytes and nothing cast, or fp32 copies and their casts.
  EXPECT_EQ(layer_time(c, false, true), 5);
  EXPECT_EQ(layer_memory(c, false, true, 3, fp32), 11 + 3 * 7);
  EXPECT_EQ(layer_memory(c, false, true, 3, bf16), 5.5 + 3 * 7);
  EXPECT_EQ(layer_memory(c, false, true, 3, bf16_masters), 11 + 5.5 + 3 * 7);
  // Frozen, nothing upstream trains: forward only, no activations, no casts kept.
  EXPECT_EQ(layer_time(c, false, false), 2);
  EXPECT_EQ(layer_memory(c, false, false, 3, fp32), 11);
  EXPECT_EQ(layer_memory(c, false, false, 3, bf16_masters), 11);
  const LayerCost f = apply_frozen_rules(c, false, false, fp32);
  EXPECT_EQ(f.input_grad + f.weight_grad + f.activation_bytes + f.train_state_bytes, 0);
  EXPECT_EQ(f.forward, 2);
  EXPECT_EQ(f.param_bytes, 11);
  EXPECT_EQ(apply_frozen_rules(c, false, false, bf16).param_bytes, 5.5);
  EXPECT_EQ(apply_frozen_rules(c, false, false, bf16).copy_bytes, 0);
}

// How parameters are held under each precision setting, per module, in the FLOP model.
TEST(Partition, ParameterBytesFollowPrecisionAndFreezing) {
  Spec s = vlm_spec();
  s.model.encoders[0].frozen = true;  // vision frozen; its projector and the LLM train
  const Plan plan = make_plan(s);
  const ModulePlan& enc = plan.module("vision");
  const ModulePlan& llm = plan.module("llm");
  const MicrobatchShape unit = single_sample_microbatch(s);
  const ParamHolding d = param_holding(s);  // bf16 compute, frozen_fp32 = false (the defaults)
  EXPECT_EQ(d.frozen, 0.5);
  EXPECT_EQ(d.casts, 0.5);
  const ModuleCosts bf16 = module_layer_costs(s, enc, unit);
  const ModuleCosts bf16_llm = module_layer_costs(s, llm, unit);
  s.train.frozen_fp32 = true;
  EXPECT_EQ(param_holding(s).frozen, 1);
  const ModuleCosts masters = module_layer_costs(s, enc, unit);
  s.train.precision = Precision::kFp32;
  EXPECT_EQ(param_holding(s).frozen, 1);
  EXPECT_EQ(param_holding(s).casts, 0);
  const ModuleCosts fp32 = module_layer_costs(s, enc, unit);
  const ModuleCosts fp32_llm = module_layer_costs(s, llm, unit);
  // The frozen encoder (nothing upstream trains: it runs no backward, keeps no casts): bf16
  // copies of its weights, or fp32 ones.
  for (const LayerCost* c : {&bf16.front, &bf16.blocks[0]}) EXPECT_EQ(c->copy_bytes, 0);
  EXPECT_DOUBLE_EQ(bf16.blocks[0].param_bytes, fp32.blocks[0].param_bytes / 2);
  EXPECT_DOUBLE_EQ(bf16.front.param_bytes, fp32.front.param_bytes / 2);
  EXPECT_DOUBLE_EQ(masters.blocks[0].param_bytes, fp32.blocks[0].param_bytes);
  EXPECT_EQ(masters.blocks[0].copy_bytes, 0);
  EXPECT_EQ(bf16.blocks[0].train_state_bytes, 0);
  // Its trained projector: fp32 masters, and under bf16 their casts too.
  EXPECT_DOUBLE_EQ(bf16.back.param_bytes, fp32.back.param_bytes);
  EXPECT_DOUBLE_EQ(bf16.back.copy_bytes, bf16.back.param_bytes / 2);
  EXPECT_EQ(fp32.back.copy_bytes, 0);
  // The trained LLM: fp32 masters either way, casts under bf16; its embedding table is looked up
  // in fp32 unless a tied head on its stage multiplies by it (vlm_spec ties: cast).
  EXPECT_DOUBLE_EQ(bf16_llm.blocks[0].param_bytes, fp32_llm.blocks[0].param_bytes);
  EXPECT_DOUBLE_EQ(bf16_llm.blocks[0].copy_bytes, bf16_llm.blocks[0].param_bytes / 2);
  EXPECT_EQ(fp32_llm.blocks[0].copy_bytes, 0);
  ASSERT_TRUE(s.model.llm.tie_embeddings);
  EXPECT_DOUBLE_EQ(bf16_llm.front.copy_bytes, bf16_llm.front.param_bytes / 2);
  Spec untied = vlm_spec();
  untied.model.llm.tie_embeddings = false;
  const ModuleCosts u = module_layer_costs(untied, make_plan(untied).module("llm"), unit);
  EXPECT_EQ(u.front.copy_bytes, 0);
  EXPECT_GT(u.back.copy_bytes, 0);
}

// The head's loss: fused (tp = 1) it keeps the rows' gradient per sample and the weight's once,
// in bf16, not fp32 logits; vocab-parallel (tp = 2) the rows it multiplies and the fp32 logits.
TEST(Partition, TheFusedLossKeepsItsGradientsNotTheLogits) {
  Spec s = vlm_spec();
  s.model.llm.tie_embeddings = false;
  s.model.llm.vocab = 4096;
  const MicrobatchShape unit = single_sample_microbatch(s);
  const double h = static_cast<double>(s.model.llm.hidden), V = 4096;
  const double T = static_cast<double>(unit.llm.tokens),
               rows = static_cast<double>(unit.llm.logit_rows);
  const ModuleCosts fused = module_layer_costs(s, make_plan(s).module("llm"), unit);
  EXPECT_DOUBLE_EQ(fused.back.activation_bytes, 2 * 2 * T * h + 2 * rows * h);
  EXPECT_DOUBLE_EQ(fused.back.copy_bytes, (h + V * h) * 4 / 2 + 2 * V * h);  // cast + dW
  s.parallel.modules["llm"].tp = 2;
  s.parallel.modules["vision"].tp = 2;
  const ModuleCosts parallel = module_layer_costs(s, make_plan(s, 2).module("llm"), unit);
  EXPECT_DOUBLE_EQ(parallel.back.activation_bytes, 2 * 2 * T * h + 2 * rows * h + 4 * rows * V);
  // Whole on each TP rank: the rows, and without sequence parallelism the final norm's tensors.
  EXPECT_DOUBLE_EQ(parallel.back.sp_whole_bytes, 2 * rows * h);
  EXPECT_DOUBLE_EQ(parallel.back.tp_whole_bytes, 2 * 2 * T * h + 2 * rows * h);
  EXPECT_DOUBLE_EQ(parallel.back.copy_bytes, (h + V * h) * 4 / 2);
  s = vlm_spec();  // a frozen LLM makes no weight gradient
  s.model.llm.tie_embeddings = false;
  s.model.llm.frozen = true;
  EXPECT_EQ(module_layer_costs(s, make_plan(s).module("llm"), unit).back.copy_bytes, 0);
}

// Recomputed blocks keep no casts (made without grad mode, and again in backward, per block).
TEST(Partition, RecomputedBlocksKeepNoCasts) {
  Spec s = vlm_spec();
  const Plan plan = make_plan(s);
  const CostTable kept = planner_costs(s, plan);
  s.model.llm.recompute = true;
  const CostTable recomputed = planner_costs(s, plan);
  const size_t llm = plan.modules.size() - 1;
  const ModuleCosts c = module_layer_costs(s, plan.module("llm"), single_sample_microbatch(s));
  double blocks = 0;
  for (const LayerCost& b : c.blocks) blocks += b.copy_bytes;
  EXPECT_GT(blocks, 0);
  EXPECT_DOUBLE_EQ(kept[llm][0].copy_bytes - recomputed[llm][0].copy_bytes, blocks);
  EXPECT_DOUBLE_EQ(recomputed[llm][0].copy_bytes, c.front.copy_bytes + c.back.copy_bytes);
}

TEST(Partition, CostsAddUpToTheFlopModel) {
  const Spec s = vlm_spec();
  const Plan p = make_plan(s);
  const MicrobatchShape shape = single_sample_microbatch(s);
  EXPECT_EQ(shape.llm.tokens, s.model.llm.max_seq);
  const ModuleCosts llm = module_layer_costs(s, p.module("llm"), shape);
  EXPECT_EQ(llm.module, "llm");
  ASSERT_EQ(llm.blocks.size(), 4u);
  EXPECT_EQ(llm.front.name, "llm.embed");
  EXPECT_EQ(llm.blocks[3].name, "llm.layers.3");
  EXPECT_EQ(llm.back.name, "llm.head");
  double forward = llm.front.forward + llm.back.forward;
  for (const auto& b : llm.blocks) forward += b.forward;
  EXPECT_DOUBLE_EQ(forward, llm_forward_flops(s.model.llm, shape.llm));
  // Trainable LLM: 3x forward per block and for the head; the embedding has no FLOPs and no
  // input gradient, but holds its parameters, gradients and moments.
  EXPECT_EQ(total(llm.blocks[0]), 3 * llm.blocks[0].forward);
  EXPECT_EQ(total(llm.back), 3 * llm.back.forward);
  EXPECT_EQ(total(llm.front), 0);
  EXPECT_EQ(llm.front.param_bytes, 4.0 * 256 * 128);
  EXPECT_EQ(llm.front.train_state_bytes, 12.0 * 256 * 128);
  EXPECT_GT(llm.blocks[0].activation_bytes, 0);
  // Tied head: no copy of the embedding unless pipelined.
  EXPECT_EQ(llm.back.param_bytes, 4.0 * 128);

  const ModuleCosts enc = module_layer_costs(s, p.module("vision"), shape);
  ASSERT_EQ(enc.blocks.size(), 3u);
  EXPECT_EQ(enc.front.name, "vision.front");
  EXPECT_EQ(enc.back.name, "vision.projector");
  EXPECT_DOUBLE_EQ(enc.front.forward + 3 * enc.blocks[0].forward,
                   encoder_forward_flops(s.model.encoders[0]));
  EXPECT_DOUBLE_EQ(enc.back.forward, projector_forward_flops(s.model.encoders[0], s.model.llm));
  EXPECT_EQ(enc.front.input_grad, 0);  // its input is data
  EXPECT_EQ(total(enc.blocks[2]), 3 * enc.blocks[2].forward);
  EXPECT_EQ(total(enc.back), 3 * enc.back.forward);  // the encoder trains: projector input grads
  EXPECT_THROW(module_layer_costs(s, p.module("vision.projector"), shape), Error);

  // Items scale an encoder linearly.
  MicrobatchShape three = shape;
  three.items = 3;
  EXPECT_DOUBLE_EQ(module_layer_costs(s, p.module("vision"), three).blocks[1].forward,
                   3 * enc.blocks[1].forward);
}

TEST(Partition, FrozenEncoderRunsForwardOnlyAndKeepsNothing) {
  Spec s = vlm_spec();
  s.model.encoders[0].frozen = true;  // its projector trains
  s.model.llm.frozen = true;          // frozen LLM with a trainable projector upstream
  const Plan p = make_plan(s);
  const MicrobatchShape shape = single_sample_microbatch(s);
  const ModuleCosts enc = module_layer_costs(s, p.module("vision"), shape);
  for (const LayerCost* c : {&enc.front, &enc.blocks[0], &enc.blocks[1], &enc.blocks[2]}) {
    EXPECT_GT(c->forward, 0) << c->name;
    EXPECT_EQ(c->input_grad, 0) << c->name;
    EXPECT_EQ(c->weight_grad, 0) << c->name;
    EXPECT_EQ(c->activation_bytes, 0) << c->name;
    EXPECT_EQ(c->train_state_bytes, 0) << c->name;
    EXPECT_GT(c->param_bytes, 0) << c->name;
  }
  // The trainable projector after a frozen encoder: weight grads, no input grads, activations.
  EXPECT_EQ(enc.back.weight_grad, enc.back.forward);
  EXPECT_EQ(enc.back.input_grad, 0);
  EXPECT_GT(enc.back.activation_bytes, 0);
  EXPECT_GT(enc.back.train_state_bytes, 0);

  const ModuleCosts llm = module_layer_costs(s, p.module("llm"), shape);
  for (const auto& b : llm.blocks) {
    EXPECT_EQ(total(b), 2 * b.forward) << b.name;  // forward + input grad
    EXPECT_GT(b.activation_bytes, 0) << b.name;
    EXPECT_EQ(b.train_state_bytes, 0) << b.name;
  }
  EXPECT_EQ(total(llm.back), 2 * llm.back.forward);

  // Everything frozen: nothing but forward work anywhere.
  s.model.encoders[0].projector.frozen = true;
  const Plan q = make_plan(s);
  const ModuleCosts proj = module_layer_costs(s, q.module("vision"), shape);
  EXPECT_EQ(total(proj.back), proj.back.forward);
  EXPECT_EQ(proj.back.activation_bytes, 0);
  for (const auto& b : module_layer_costs(s, q.module("llm"), shape).blocks) {
    EXPECT_EQ(total(b), b.forward);
    EXPECT_EQ(b.activation_bytes, 0);
  }
}

// Every contiguous partition, lexicographically by boundaries; the first with the smallest
// bottleneck among those fitting the limit. Sums run front, blocks, back as the DP's do.
struct Brute {
  bool feasible = false;
  StagePartition best;
  double min_peak = kInf;
};

Brute brute_force(const ModuleCosts& c, const PartitionOptions& o) {
  const int64_t n = static_cast<int64_t>(c.blocks.size()), P = o.stages;
  Brute out;
  std::vector<int64_t> cuts(static_cast<size_t>(P - 1));
  for (int64_t i = 0; i < P - 1; ++i) cuts[static_cast<size_t>(i)] = i + 1;
  while (true) {
    StagePartition sp;
    sp.boundaries = cuts;
    double peak = 0, bottleneck = 0;
    bool fits = true;
    for (int64_t s = 0; s < P; ++s) {
      const int64_t begin = s == 0 ? 0 : cuts[static_cast<size_t>(s - 1)];
      const int64_t end = s == P - 1 ? n : cuts[static_cast<size_t>(s)];
      double time = 0, held = 0, act = 0;
      const auto add = [&](const LayerCost& l) {
        time += l.forward + l.input_grad + l.weight_grad;
        held += l.param_bytes + l.train_state_bytes;
        act += l.activation_bytes;
      };
      if (s == 0) add(c.front);
      for (int64_t b = begin; b < end; ++b) add(c.blocks[static_cast<size_t>(b)]);
      if (s == P - 1) add(c.back);
      const double memory = held + static_cast<double>(std::min(P - s, o.microbatches)) * act;
      sp.stage_time.push_back(time);
      sp.stage_memory.push_back(memory);
      bottleneck = std::max(bottleneck, time);
      peak = std::max(peak, memory);
      fits = fits && memory <= o.memory_limit_bytes;
    }
    sp.bottleneck = bottleneck;
    out.min_peak = std::min(out.min_peak, peak);
    if (fits && (!out.feasible || bottleneck < out.best.bottleneck)) {
      out.feasible = true;
      out.best = sp;
    }
    // Next combination of P-1 cuts from [1, n-1], in lexicographic order.
    int64_t i = P - 2;
    while (i >= 0 && cuts[static_cast<size_t>(i)] == n - (P - 1 - i)) --i;
    if (i < 0) break;
    ++cuts[static_cast<size_t>(i)];
    for (int64_t k = i + 1; k < P - 1; ++k)
      cuts[static_cast<size_t>(k)] = cuts[static_cast<size_t>(k - 1)] + 1;
  }
  return out;
}

std::string partition_error(const ModuleCosts& c, const PartitionOptions& o) {
  try {
    partition_stages(c, o);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no weft::Error thrown)";
}

bool has(const std::string& message, const std::string& needle) {
  return message.find(needle) != std::string::npos;
}

// Integer costs (exact sums, many ties: checks the earliest-boundary rule) or real ones.
void check_against_brute_force(bool integers, uint32_t seed) {
  std::mt19937 rng(seed);
  const auto draw = [&](double hi) {
    return integers ? static_cast<double>(std::uniform_int_distribution<int>(0, 9)(rng))
                    : std::uniform_real_distribution<double>(0, hi)(rng);
  };
  int feasible = 0, infeasible = 0, limited = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n = std::uniform_int_distribution<int64_t>(1, 10)(rng);
    PartitionOptions o;
    o.stages = std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(4, n))(rng);
    o.microbatches = std::uniform_int_distribution<int64_t>(1, 5)(rng);
    const auto layer = [&] { return cost(draw(9), draw(9), draw(9), draw(9), draw(9), draw(9)); };
    ModuleCosts c;
    c.module = "m";
    c.front = trial % 3 == 0 ? LayerCost{} : layer();
    for (int64_t b = 0; b < n; ++b) c.blocks.push_back(layer());
    c.back = trial % 3 == 1 ? LayerCost{} : layer();
    if (trial % 2 == 1) {
      o.memory_limit_bytes = static_cast<double>(std::uniform_int_distribution<int>(20, 300)(rng));
      ++limited;
    }
    const Brute want = brute_force(c, o);
    const std::string at = "trial " + std::to_string(trial) + ": n=" + std::to_string(n) +
                           " P=" + std::to_string(o.stages);
    if (!want.feasible) {
      ++infeasible;
      const std::string e = partition_error(c, o);
      EXPECT_TRUE(has(e, "no split of " + std::to_string(n) + " blocks")) << at << ": " << e;
      if (integers) {  // all bytes below 1 KiB: printed exactly
        char peak[64];
        std::snprintf(peak, sizeof peak, "smallest achievable peak stage memory is %.0f B",
                      want.min_peak);
        EXPECT_TRUE(has(e, peak)) << at << ": " << e;
      }
      continue;
    }
    ++feasible;
    const StagePartition got = partition_stages(c, o);
    EXPECT_EQ(got.boundaries, want.best.boundaries) << at;
    EXPECT_EQ(got.bottleneck, want.best.bottleneck) << at;
    EXPECT_EQ(got.stage_time, want.best.stage_time) << at;
    EXPECT_EQ(got.stage_memory, want.best.stage_memory) << at;
    EXPECT_EQ(got.bottleneck, *std::max_element(got.stage_time.begin(), got.stage_time.end()));
  }
  // The mix exercised every branch.
  EXPECT_GT(feasible, 100);
  EXPECT_GT(infeasible, 10);
  EXPECT_EQ(limited, 100);
}

TEST(Partition, DpMatchesBruteForceWithIntegerCostsAndTies) { check_against_brute_force(true, 1); }

TEST(Partition, DpMatchesBruteForceWithRealCosts) { check_against_brute_force(false, 2); }

ModuleCosts uniform(int64_t n, double time = 3, double activation = 0, double params = 0) {
  ModuleCosts c;
  c.module = "llm";
  for (int64_t b = 0; b < n; ++b)
    c.blocks.push_back(cost(time / 3, time / 3, time / 3, activation, params));
  return c;
}

TEST(Partition, UniformLayersSplitEvenly) {
  for (int64_t P : {1, 2, 3, 4, 6}) {
    for (int64_t per : {1, 2, 5}) {
      PartitionOptions o;
      o.stages = P;
      const StagePartition sp = partition_stages(uniform(P * per), o);
      std::vector<int64_t> even;
      for (int64_t s = 1; s < P; ++s) even.push_back(s * per);
      EXPECT_EQ(sp.boundaries, even) << P << "x" << per;
      EXPECT_EQ(sp.bottleneck, 3.0 * per);
      EXPECT_EQ(sp.stage_time, std::vector<double>(static_cast<size_t>(P), 3.0 * per));
    }
  }
  // 10 blocks on 4 stages: at most 3 per stage; ties go to the earliest cuts.
  PartitionOptions o;
  o.stages = 4;
  const StagePartition sp = partition_stages(uniform(10), o);
  EXPECT_EQ(sp.boundaries, (std::vector<int64_t>{1, 4, 7}));
  EXPECT_EQ(sp.bottleneck, 9.0);
}

TEST(Partition, MemoryUnderOneFOneB) {
  // 4 blocks of 100 B params, 10 B activations; P = 2, 4 microbatches: stage 0 keeps 2
  // microbatches alive, stage 1 one. [2|2]: 200 + 2·10·2 = 240 and 200 + 20 = 220.
  PartitionOptions o;
  o.stages = 2;
  o.microbatches = 4;
  ModuleCosts c = uniform(4, 3, 10, 100);
  c.back = cost(3, 3, 3);  // time wants the cut late: [3|1]
  EXPECT_EQ(partition_stages(c, o).boundaries, (std::vector<int64_t>{3}));
  o.memory_limit_bytes = 240;  // [3|1] needs 360 on stage 0
  StagePartition sp = partition_stages(c, o);
  EXPECT_EQ(sp.boundaries, (std::vector<int64_t>{2}));
  EXPECT_EQ(sp.stage_memory, (std::vector<double>{240, 220}));
  EXPECT_EQ(sp.stage_time, (std::vector<double>{6, 15}));
  EXPECT_EQ(sp.bottleneck, 15);
  o.microbatches = 1;  // one microbatch in flight anywhere: [3|1] needs 300 + 30 on stage 0
  o.memory_limit_bytes = 330;
  EXPECT_EQ(partition_stages(c, o).boundaries, (std::vector<int64_t>{3}));
}

TEST(Partition, InfeasibleMemoryLimitNamesModuleLimitAndPeak) {
  PartitionOptions o;
  o.stages = 2;
  o.microbatches = 4;
  o.memory_limit_bytes = 150;
  const std::string e = partition_error(uniform(4, 3, 10, 100), o);
  EXPECT_TRUE(has(e, "module 'llm'")) << e;
  EXPECT_TRUE(has(e, "no split of 4 blocks into 2 stages fits the memory limit of 150 B")) << e;
  EXPECT_TRUE(has(e, "smallest achievable peak stage memory is 240 B")) << e;
  // Large numbers print in binary units.
  const double gib = 1024.0 * 1024 * 1024;
  o.memory_limit_bytes = 1.5 * gib;
  const std::string big = partition_error(uniform(4, 3, 0.5 * gib, gib), o);
  EXPECT_TRUE(has(big, "memory limit of 1.50 GiB")) << big;
  EXPECT_TRUE(has(big, "peak stage memory is 4.00 GiB")) << big;  // [2|2]: 2 + 2·2·0.5 GiB

  o.memory_limit_bytes = kInf;
  o.stages = 5;
  const std::string many = partition_error(uniform(4), o);
  EXPECT_TRUE(has(many, "5 pipeline stages for 4 blocks")) << many;
  o.stages = 2;
  o.microbatches = 0;
  EXPECT_THROW(partition_stages(uniform(4), o), Error);
}

TEST(Partition, FrozenRulesMoveLayersOntoFrozenStages) {
  // A frozen encoder (nothing upstream trains) of 6 blocks whose trainable projector sits on the
  // last stage. Under the rules a block costs 1 (forward only) and the projector 4 (forward +
  // weight grads): cut at 5 gives 5 | 1 + 4. Ignoring them (3 per block, 6 for the projector)
  // cuts at 4, which really runs 4 | 2 + 4 = 6.
  const LayerCost block = cost(1, 1, 1, 8, 4, 12), projector = cost(2, 2, 2, 8, 4, 12);
  ModuleCosts aware, unaware;
  aware.module = unaware.module = "vision";
  for (int b = 0; b < 6; ++b) {
    aware.blocks.push_back(apply_frozen_rules(block, false, false, {}));
    unaware.blocks.push_back(block);
  }
  aware.back = apply_frozen_rules(projector, true, false, {});
  aware.back.input_grad = 0;  // nothing before the projector trains
  unaware.back = projector;
  PartitionOptions o;
  o.stages = 2;
  const StagePartition a = partition_stages(aware, o), u = partition_stages(unaware, o);
  EXPECT_EQ(a.boundaries, (std::vector<int64_t>{5}));
  EXPECT_EQ(a.bottleneck, 5);
  EXPECT_EQ(a.stage_memory[0], 5 * 4);  // frozen blocks keep params only
  EXPECT_EQ(u.boundaries, (std::vector<int64_t>{4}));
}

TEST(Partition, MakePlanMovesLayersOffAnExpensiveHead) {
  Spec s = vlm_spec();
  s.model.llm.layers = 8;
  s.model.llm.vocab = 8192;  // head ≈ 4.6 blocks of forward work per token
  s.parallel.modules["llm"].pp = 2;
  const Plan p = make_plan(s, 2);
  const ModulePlan& llm = p.module("llm");
  // Even split [4]: 4 | 4 + 4.6 blocks; optimal [6]: 6 | 2 + 4.6.
  EXPECT_EQ(llm.stage_boundaries, (std::vector<int64_t>{6}));
  const auto first = llm.stage_layers(0), last = llm.stage_layers(1);
  EXPECT_GT(first.second - first.first, last.second - last.first);
  // The boundaries are the partitioner's, and beat the even split under the cost model.
  PartitionOptions o;
  o.stages = 2;
  o.microbatches = s.train.microbatches;
  const ModuleCosts c = module_layer_costs(s, llm, single_sample_microbatch(s));
  EXPECT_EQ(partition_stages(c, o).boundaries, llm.stage_boundaries);
  double even_last = total(c.back), even_first = 0;
  for (int b = 0; b < 8; ++b) (b < 4 ? even_first : even_last) += total(c.blocks[b]);
  EXPECT_LT(partition_stages(c, o).bottleneck, std::max(even_first, even_last));
  // The tied head keeps its own embedding copy once pipelined.
  EXPECT_EQ(c.back.param_bytes, 4.0 * (128 + 8192 * 128));

  // Explicit stages are kept as given.
  s.parallel.modules["llm"].stages = {4};
  EXPECT_EQ(make_plan(s, 2).module("llm").stage_boundaries, (std::vector<int64_t>{4}));
}

// ---- joint partition -----------------------------------------------------------------------

// Every module's stage times and memory under given boundaries (sums front, blocks, back).
struct Evaluated {
  std::vector<double> time, memory;
};
Evaluated evaluate(const JointModule& m, const std::vector<int64_t>& cuts, int64_t M) {
  const int64_t n = static_cast<int64_t>(m.costs.blocks.size()), P = m.stages;
  Evaluated e;
  for (int64_t s = 0; s < P; ++s) {
    const int64_t begin = s == 0 ? 0 : cuts[static_cast<size_t>(s - 1)];
    const int64_t end = s == P - 1 ? n : cuts[static_cast<size_t>(s)];
    double time = 0, held = 0, act = 0;
    const auto add = [&](const LayerCost& l) {
      time += l.forward + l.input_grad + l.weight_grad;
      held += l.param_bytes + l.train_state_bytes;
      act += l.activation_bytes;
    };
    if (s == 0) add(m.costs.front);
    for (int64_t b = begin; b < end; ++b) add(m.costs.blocks[static_cast<size_t>(b)]);
    if (s == P - 1) add(m.costs.back);
    const int64_t in_flight = m.all_in_flight ? M : std::min(P - s, M);
    e.time.push_back(time);
    e.memory.push_back(held + static_cast<double>(in_flight) * act);
  }
  return e;
}

// Every split of n blocks into P stages (the P - 1 cuts), lexicographically.
std::vector<std::vector<int64_t>> all_cuts(int64_t n, int64_t P) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> cuts(static_cast<size_t>(P - 1));
  for (int64_t i = 0; i < P - 1; ++i) cuts[static_cast<size_t>(i)] = i + 1;
  while (true) {
    out.push_back(cuts);
    int64_t i = P - 2;
    while (i >= 0 && cuts[static_cast<size_t>(i)] == n - (P - 1 - i)) --i;
    if (i < 0) return out;
    ++cuts[static_cast<size_t>(i)];
    for (int64_t k = i + 1; k < P - 1; ++k)
      cuts[static_cast<size_t>(k)] = cuts[static_cast<size_t>(k - 1)] + 1;
  }
}

// The joint objective of one choice of boundaries per module: the largest rank-class time
// (colocated: class c of lcm(pp) hosts stage c·P/L of each module, loads add up; separate: each
// stage alone), +inf when a class exceeds the memory limit.
double joint_objective(const std::vector<JointModule>& ms,
                       const std::vector<std::vector<int64_t>>& cuts, const JointOptions& o,
                       double* peak) {
  std::vector<Evaluated> e;
  for (size_t k = 0; k < ms.size(); ++k) e.push_back(evaluate(ms[k], cuts[k], o.microbatches));
  double worst = 0;
  *peak = 0;
  bool fits = true;
  const auto account = [&](double t, double mem) {
    worst = std::max(worst, t);
    *peak = std::max(*peak, mem);
    fits = fits && mem <= o.memory_limit_bytes;
  };
  if (!o.colocated) {
    for (const Evaluated& x : e)
      for (size_t s = 0; s < x.time.size(); ++s) account(x.time[s], x.memory[s]);
  } else {
    int64_t L = 1;
    for (const JointModule& m : ms) L = std::lcm(L, m.stages);
    for (int64_t c = 0; c < L; ++c) {
      double t = 0, mem = 0;
      for (size_t k = 0; k < ms.size(); ++k) {
        const size_t s = static_cast<size_t>(c * ms[k].stages / L);
        t += e[k].time[s], mem += e[k].memory[s];
      }
      account(t, mem);
    }
  }
  return fits ? worst : kInf;
}

// The optimum over every combination of every free module's splits.
struct JointBrute {
  double best = kInf, min_peak = kInf;
};
JointBrute joint_brute_force(const std::vector<JointModule>& ms, const JointOptions& o) {
  std::vector<std::vector<std::vector<int64_t>>> options;
  for (const JointModule& m : ms)
    options.push_back(m.stages > 1 && m.boundaries.empty()
                          ? all_cuts(static_cast<int64_t>(m.costs.blocks.size()), m.stages)
                          : std::vector<std::vector<int64_t>>{m.boundaries});
  JointBrute out;
  std::vector<size_t> pick(ms.size(), 0);
  while (true) {
    std::vector<std::vector<int64_t>> cuts;
    for (size_t k = 0; k < ms.size(); ++k) cuts.push_back(options[k][pick[k]]);
    double peak = 0;
    out.best = std::min(out.best, joint_objective(ms, cuts, o, &peak));
    out.min_peak = std::min(out.min_peak, peak);
    size_t k = ms.size();
    while (k > 0 && pick[k - 1] + 1 == options[k - 1].size()) pick[k - 1] = 0, --k;
    if (k == 0) return out;
    ++pick[k - 1];
  }
}

std::string joint_error(const std::vector<JointModule>& ms, const JointOptions& o) {
  try {
    partition_joint(ms, o);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no weft::Error thrown)";
}

// Random modules: integer costs (exact sums) and memory limits; the pipelined ones of a
// colocated case share one pp (`aligned`) or not.
void check_joint(bool colocated, bool aligned, uint32_t seed) {
  std::mt19937 rng(seed);
  const auto draw = [&](int hi) {
    return static_cast<double>(std::uniform_int_distribution<int>(0, hi)(rng));
  };
  int feasible = 0, infeasible = 0, inexact = 0, optimal_inexact = 0;
  for (int trial = 0; trial < 150; ++trial) {
    const int count = std::uniform_int_distribution<int>(1, 3)(rng);
    const int64_t shared_pp = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    JointOptions o;
    o.colocated = colocated;
    o.microbatches = std::uniform_int_distribution<int64_t>(1, 4)(rng);
    std::vector<JointModule> ms;
    for (int k = 0; k < count; ++k) {
      JointModule m;
      m.costs.module = "m" + std::to_string(k);
      const int64_t n = std::uniform_int_distribution<int64_t>(1, 5)(rng);
      const auto layer = [&] { return cost(draw(9), draw(9), draw(9), draw(9), draw(9), draw(9)); };
      m.costs.front = layer();
      for (int64_t b = 0; b < n; ++b) m.costs.blocks.push_back(layer());
      m.costs.back = layer();
      int64_t pp = aligned ? shared_pp : std::uniform_int_distribution<int64_t>(1, 4)(rng);
      if (rng() % 4 == 0) pp = 1;
      m.stages = std::min(pp, n);
      if (aligned && m.stages != shared_pp && m.stages > 1) m.stages = 1;
      m.all_in_flight = rng() % 2 == 0;
      if (m.stages > 1 && rng() % 4 == 0) m.boundaries = all_cuts(n, m.stages).back();
      ms.push_back(std::move(m));
    }
    if (trial % 2 == 1) o.memory_limit_bytes = draw(400) + 40;
    const JointBrute want = joint_brute_force(ms, o);
    const std::string at = "trial " + std::to_string(trial);
    if (want.best == kInf) {
      ++infeasible;
      const std::string e = joint_error(ms, o);
      EXPECT_TRUE(has(e, "memory limit")) << at << ": " << e;
      continue;
    }
    const JointPartition got = partition_joint(ms, o);
    std::vector<std::vector<int64_t>> cuts;
    for (size_t k = 0; k < ms.size(); ++k) {
      cuts.push_back(got.modules[k].boundaries);
      if (!ms[k].boundaries.empty()) {
        EXPECT_EQ(cuts.back(), ms[k].boundaries) << at;
      }
      EXPECT_EQ(cuts.back().size(), static_cast<size_t>(ms[k].stages - 1)) << at;
    }
    double peak = 0;
    const double value = joint_objective(ms, cuts, o, &peak);
    EXPECT_EQ(value, got.bottleneck) << at;  // what it reports is what its split does
    EXPECT_LE(peak, o.memory_limit_bytes) << at;
    if (got.exact) {
      ++feasible;
      EXPECT_EQ(got.bottleneck, want.best) << at;
    } else {
      ++inexact;
      optimal_inexact += got.bottleneck == want.best;
      EXPECT_GE(got.bottleneck, want.best) << at;
      EXPECT_FALSE(aligned) << at;
    }
  }
  EXPECT_GT(feasible + inexact, 50);
  EXPECT_GT(infeasible, 5);
  if (aligned || !colocated) {
    EXPECT_EQ(inexact, 0);
  } else {  // coordinate descent: mostly the optimum anyway
    EXPECT_GT(inexact, 5);
    EXPECT_GE(optimal_inexact, inexact * 3 / 4) << optimal_inexact << " of " << inexact;
  }
}

TEST(JointPartition, ColocatedDpMatchesBruteForce) { check_joint(true, true, 3); }
TEST(JointPartition, SeparateMatchesBruteForce) { check_joint(false, false, 4); }
TEST(JointPartition, ColocatedUnequalStagesIsValidAndNeverBeatsBruteForce) {
  check_joint(true, false, 5);
}

// Two colocated pipelines whose own optima stack their heavy stages on the same ranks: the joint
// split shifts them apart.
TEST(JointPartition, ColocatedSplitsTogetherNotEachAlone) {
  JointModule vision, llm;
  vision.costs.module = "vision";
  vision.stages = llm.stages = 2;
  for (int b = 0; b < 4; ++b) vision.costs.blocks.push_back(cost(1, 0, 0));
  vision.costs.back = cost(6, 0, 0);  // a heavy projector: alone, vision cuts at 3 (3 | 7)
  llm.costs.module = "llm";
  llm.costs.front = cost(3, 0, 0);  // a heavy embedding: alone, cut at 1 (6 | 9; 9 | 6 ties)
  for (int b = 0; b < 4; ++b) llm.costs.blocks.push_back(cost(1, 1, 1));
  JointOptions o;
  o.microbatches = 4;
  PartitionOptions po;
  po.stages = 2;
  const auto alone_v = partition_stages(vision.costs, po),
             alone_l = partition_stages(llm.costs, po);
  EXPECT_EQ(alone_v.boundaries, (std::vector<int64_t>{3}));
  EXPECT_EQ(alone_l.boundaries, (std::vector<int64_t>{1}));
  const double alone = std::max(alone_v.stage_time[0] + alone_l.stage_time[0],
                                alone_v.stage_time[1] + alone_l.stage_time[1]);
  EXPECT_EQ(alone, 7 + 9);
  // Together the ranks carry 25: the best is 13 | 12, the earliest such cuts vision [1], llm [3].
  const JointPartition joint = partition_joint({vision, llm}, o);
  EXPECT_TRUE(joint.exact);
  EXPECT_EQ(joint.bottleneck, 13);
  EXPECT_EQ(joint.rank_time, (std::vector<double>{13, 12}));
  EXPECT_EQ(joint.modules[0].boundaries, (std::vector<int64_t>{1}));
  EXPECT_EQ(joint.modules[1].boundaries, (std::vector<int64_t>{3}));
  // Separate placement: each alone.
  o.colocated = false;
  const JointPartition sep = partition_joint({vision, llm}, o);
  EXPECT_EQ(sep.modules[0].boundaries, alone_v.boundaries);
  EXPECT_EQ(sep.modules[1].boundaries, alone_l.boundaries);
  EXPECT_EQ(sep.rank_time, (std::vector<double>{3, 7, 6, 9}));
  EXPECT_EQ(sep.bottleneck, 9);
}

TEST(JointPartition, EncodersKeepEveryMicrobatchInFlight) {
  JointModule enc;
  enc.costs.module = "vision";
  enc.stages = 2;
  for (int b = 0; b < 2; ++b) enc.costs.blocks.push_back(cost(1, 1, 1, 10, 100));
  JointOptions o;
  o.microbatches = 4;
  o.colocated = false;
  EXPECT_EQ(partition_joint({enc}, o).modules[0].stage_memory, (std::vector<double>{120, 110}));
  enc.all_in_flight = true;  // all four microbatches' activations on both stages
  EXPECT_EQ(partition_joint({enc}, o).modules[0].stage_memory, (std::vector<double>{140, 140}));
  o.memory_limit_bytes = 130;
  const std::string e = joint_error({enc}, o);
  EXPECT_TRUE(has(e, "module 'vision'")) << e;
  EXPECT_TRUE(has(e, "memory limit of 130 B")) << e;
  // Bad input: stages past the blocks, given boundaries that are not a split.
  enc.stages = 3;
  EXPECT_TRUE(has(joint_error({enc}, o), "3 pipeline stages for 2 blocks"));
  enc.stages = 2;
  enc.boundaries = {2};
  EXPECT_TRUE(has(joint_error({enc}, o), "strictly increasing block indices in [1, 1]"));
}

// make_plan's default boundaries of colocated pipelines: the joint optimum of the FLOP costs
// (both modules on every rank with dp = tp = cp = 1 scale alike, so single-sample costs rank
// every split the same way).
TEST(JointPartition, MakePlanPartitionsColocatedModulesJointly) {
  Spec s = vlm_spec();
  s.model.llm.layers = 6;
  s.model.llm.vocab = 4096;  // a heavy head
  s.model.encoders[0].layers = 6;
  s.model.encoders[0].image_size = 256;  // 256 tokens per image: comparable to the LLM
  s.parallel.modules["llm"].pp = 2;
  s.parallel.modules["vision"].pp = 2;
  const Plan p = make_plan(s, 2);
  std::vector<JointModule> ms(2);
  const MicrobatchShape shape = single_sample_microbatch(s);
  ms[0].costs = module_layer_costs(s, p.module("vision"), shape);
  ms[1].costs = module_layer_costs(s, p.module("llm"), shape);
  ms[0].stages = ms[1].stages = 2;
  ms[0].all_in_flight = true;
  JointOptions o;
  o.microbatches = s.train.microbatches;
  const JointBrute want = joint_brute_force(ms, o);
  double peak = 0;
  const double got = joint_objective(
      ms, {p.module("vision").stage_boundaries, p.module("llm").stage_boundaries}, o, &peak);
  EXPECT_NEAR(got, want.best, 1e-9 * want.best);
  EXPECT_EQ(p.module("vision.projector").stage_boundaries, p.module("vision").stage_boundaries);
  // Splitting each alone is never better.
  PartitionOptions po;
  po.stages = 2;
  const double alone = joint_objective(
      ms,
      {partition_stages(ms[0].costs, po).boundaries, partition_stages(ms[1].costs, po).boundaries},
      o, &peak);
  EXPECT_LE(got, alone);
}

}  // namespace
}  // namespace weft::plan
