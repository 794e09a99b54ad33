// Mixture of experts on the torch-free side: [model.llm.moe] parsing and its errors, expert
// parallelism in make_plan (validation, EP and expert-data-parallel groups, JSON), the FLOP
// model of MoE blocks, and how the simulator prices expert parallelism (expert memory over
// ep · etp, the all-to-alls, the expert-data-parallel gradient reduction).
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/errors.h"
#include "weft/core/config.h"
#include "weft/plan/cluster.h"
#include "weft/plan/flops.h"
#include "weft/plan/plan.h"
#include "weft/plan/search.h"
#include "weft/plan/simulate.h"

namespace weft::plan {
namespace {

using testing::error_of;

constexpr const char* kConfig = R"(
[model.llm]
vocab = 64
hidden = 32
layers = 4
heads = 4
kv_heads = 2
ffn = 64
[model.llm.moe]
experts = 8
top_k = 2
ffn = 32
every = 2
shared_ffn = 16
[model.vision]
kind = "vit"
image_size = 32
patch = 8
hidden = 32
layers = 2
heads = 2
ffn = 64
[train]
batch = 8
)";

Spec spec_with(const std::vector<std::string>& sets) {
  return parse_spec(kConfig, "moe.toml", sets);
}

TEST(MoeConfig, ParsesTheTableAndWritesItBack) {
  const Spec s = spec_with({"model.llm.moe.gating=\"sigmoid\"", "model.llm.moe.z_loss=0"});
  const MoeSpec& m = s.model.llm.moe;
  EXPECT_EQ(m.experts, 8);
  EXPECT_EQ(m.top_k, 2);
  EXPECT_EQ(s.model.llm.expert_ffn(), 32);
  EXPECT_TRUE(m.sigmoid);
  EXPECT_EQ(m.z_loss, 0.0);
  EXPECT_TRUE(m.is_moe_layer(0));
  EXPECT_FALSE(m.is_moe_layer(1));
  EXPECT_TRUE(m.is_moe_layer(2));
  // The resolved config (a run directory's config.toml) parses to the same MoE block.
  const Spec again = parse_spec(spec_to_toml(s), "again.toml");
  EXPECT_EQ(again.model.llm.moe.experts, 8);
  EXPECT_EQ(again.model.llm.moe.every, 2);
  EXPECT_EQ(again.model.llm.moe.shared_ffn, 16);
  EXPECT_TRUE(again.model.llm.moe.sigmoid);
}

TEST(MoeConfig, BadKeysNameTheFieldAndWhatWasExpected) {
  EXPECT_NE(error_of([] {
              spec_with({"model.llm.moe.top_k=9"});
            }).find("moe.toml: model.llm.moe.top_k = 9: must be <= experts (8)"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { spec_with({"model.llm.moe.gating=\"relu\""}); }).find("model.llm.moe.gating"),
      std::string::npos);
  EXPECT_NE(error_of([] {
              spec_with({"model.llm.moe.experts=0"});
            }).find("model.llm.moe.experts = 0: must be > 0"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              spec_with({"model.llm.moe.aux_loss=-1"});
            }).find("model.llm.moe.aux_loss = -1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              spec_with({"model.llm.moe.topk=2"});
            }).find("model.llm.moe.topk = 2: unknown key"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              spec_with({"model.llm.moe.top_k=1", "model.llm.moe.norm_topk=true"});
            }).find("model.llm.moe.norm_topk"),
            std::string::npos);
  // Top-1 softmax keeps the raw probability by default (Switch).
  EXPECT_FALSE(spec_with({"model.llm.moe.top_k=1"}).model.llm.moe.norm_topk);
}

TEST(MoePlan, ExpertParallelismIsValidatedUpFront) {
  EXPECT_NE(error_of([] {
              make_plan(spec_with({"parallel.llm.ep=3"}), 3);
            }).find("parallel.llm.ep = 3: must divide model.llm.moe.experts = 8"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_plan(spec_with({"parallel.llm.tp=2", "parallel.llm.ep=2"}), 2);
            }).find("parallel.llm.ep = 2: must divide cp * dp = 1 * 1 = 1"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_plan(spec_with({"parallel.vision.ep=2"}), 2); })
                .find("parallel.vision.ep = 2: expert parallelism applies to a "
                      "mixture-of-experts LLM only"),
            std::string::npos);
  Spec dense = spec_with({"parallel.llm.ep=2"});
  dense.model.llm.moe = {};
  EXPECT_NE(error_of([&] {
              make_plan(dense, 2);
            }).find("parallel.llm.ep = 2: expert parallelism needs a mixture-of-experts LLM"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_plan(spec_with({"parallel.llm.tp=3", "parallel.llm.dp=1"}), 3);
            }).find("parallel.llm.tp = 3"),
            std::string::npos);
}

TEST(MoePlan, ExpertGroupsSplitTheDataAndContextRanksOfEachTpRankAndStage) {
  // tp2 × cp2 × dp2 × pp2 = 16 ranks, ep = 2: at each (tp, pp) the cp·dp ranks in order
  // i = cp + 2·dp form EP groups {i0, i1}, {i2, i3} and expert-data-parallel groups {i0, i2},
  // {i1, i3}.
  const Plan p =
      make_plan(spec_with({"parallel.llm.tp=2", "parallel.llm.cp=2", "parallel.llm.dp=2",
                           "parallel.llm.pp=2", "parallel.llm.ep=2", "parallel.vision.dp=16"}),
                16);
  const ModulePlan& llm = p.module("llm");
  const auto ep = llm.expert_groups(false), edp = llm.expert_groups(true);
  ASSERT_EQ(ep.size(), 8u);
  ASSERT_EQ(edp.size(), 8u);
  // rank = tp + 2·(cp + 2·(dp + 2·pp)).
  EXPECT_EQ(ep[0], (std::vector<int64_t>{0, 2}));   // tp0 pp0: (cp0,dp0), (cp1,dp0)
  EXPECT_EQ(ep[1], (std::vector<int64_t>{1, 3}));   // tp1 pp0
  EXPECT_EQ(ep[2], (std::vector<int64_t>{4, 6}));   // tp0 pp0: (cp0,dp1), (cp1,dp1)
  EXPECT_EQ(edp[0], (std::vector<int64_t>{0, 4}));  // tp0 pp0 EP rank 0: dp0, dp1
  EXPECT_EQ(edp[1], (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(edp[2], (std::vector<int64_t>{2, 6}));
  // Every rank of the module is in exactly one EP group and one expert-data-parallel group.
  std::vector<int> seen_ep(16, 0), seen_edp(16, 0);
  for (const auto& g : ep)
    for (int64_t r : g) ++seen_ep[r];
  for (const auto& g : edp)
    for (int64_t r : g) ++seen_edp[r];
  EXPECT_EQ(seen_ep, std::vector<int>(16, 1));
  EXPECT_EQ(seen_edp, std::vector<int>(16, 1));
  const Coord c = llm.coord(6);  // tp0, cp1, dp1, pp0: i = 3
  EXPECT_EQ(llm.ep_rank(c), 1);
  EXPECT_EQ(llm.edp_rank(c), 1);
  const auto j = nlohmann::json::parse(to_json(p));
  EXPECT_EQ(j["modules"].back()["layout"]["ep"], 2);
}

TEST(MoePlan, WholeExpertsSpreadTheExpertGroupsOverTensorParallelRanks) {
  // etp = 1 under tp2 × dp2: token index i = tp + 2·dp, so ep = 4 spans all four ranks.
  const Plan p =
      make_plan(spec_with({"parallel.llm.tp=2", "parallel.llm.dp=2", "parallel.llm.etp=1",
                           "parallel.llm.ep=4", "parallel.vision.dp=4"}),
                4);
  const ModulePlan& llm = p.module("llm");
  EXPECT_EQ(llm.layout.expert_tp(), 1);
  EXPECT_EQ(llm.expert_groups(false), (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}}));
  EXPECT_EQ(llm.expert_groups(true), (std::vector<std::vector<int64_t>>{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(llm.ep_rank(llm.coord(2)), 2);  // tp0, dp1
  // Unset etp is tp: the experts split like the dense MLP.
  EXPECT_EQ(make_plan(spec_with({"parallel.llm.tp=2"}), 2).module("llm").layout.expert_tp(), 2);
  EXPECT_NE(
      error_of([] {
        make_plan(spec_with({"parallel.llm.tp=2", "parallel.llm.etp=3"}), 2);
      }).find("parallel.llm.etp = 3: must be 1 (whole experts, tokens split over tp) or tp = 2"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        make_plan(spec_with({"parallel.llm.tp=2", "parallel.llm.etp=1", "parallel.llm.ep=8"}), 2);
      }).find("parallel.llm.ep = 8: must divide tp * cp * dp = 2"),
      std::string::npos);
  EXPECT_NE(error_of([] {
              make_plan(spec_with({"parallel.vision.etp=1", "parallel.vision.tp=2"}), 2);
            })
                .find("parallel.vision.etp = 1: expert parallelism applies to a mixture-of-experts "
                      "LLM only"),
            std::string::npos);
  // An encoder's sequence parallelism splits each item's 16 patches and [CLS] token evenly.
  EXPECT_NE(error_of([] {
              make_plan(spec_with({"parallel.vision.sp=true", "parallel.vision.tp=2",
                                   "model.vision.class_token=true"}),
                        2);
            })
                .find("parallel.vision.sp = true: cp * tp = 2 must divide the 17 tokens each "
                      "vision block runs on (its patches and the [CLS] token)"),
            std::string::npos);
  EXPECT_NO_THROW(make_plan(spec_with({"parallel.vision.sp=true", "parallel.vision.tp=2"}), 2));
  // Sequence parallelism without tensor parallelism would do nothing: said, not ignored.
  EXPECT_NE(error_of([] { make_plan(spec_with({"parallel.llm.sp=true"}), 1); })
                .find("parallel.llm.sp = true: sequence parallelism splits the tokens over the "
                      "tensor-parallel ranks, so it needs tp > 1 (tp = 1)"),
            std::string::npos);
}

TEST(MoeFlops, MoeBlocksCountRouterActiveExpertsAndSharedExpert) {
  const Spec s = spec_with({});
  const LlmSpec& l = s.model.llm;
  LlmTokens t;
  t.tokens = 10;
  t.logit_rows = 10;
  t.sum_sq_doc_len = 100;
  LlmSpec dense = l;
  dense.moe = {};
  const double attn = llm_block_forward_flops(dense, t, 0) - 2.0 * 10 * 3 * 32 * 64;
  // Block 0 (MoE): router 32·8 + 2 experts · 3·32·32 + shared 3·32·16 multiply-adds per token.
  EXPECT_DOUBLE_EQ(llm_block_forward_flops(l, t, 0),
                   attn + 2.0 * 10 * (32.0 * 8 + 2 * 3 * 32 * 32 + 3 * 32 * 16));
  EXPECT_DOUBLE_EQ(llm_block_forward_flops(l, t, 1), llm_block_forward_flops(dense, t, 1));
  // Parameters: 8 experts of 3·32·32, the router and the shared expert; block 1 is dense.
  const double attention = 32.0 * (32 + 2 * 16) + 32 * 32 + 2 * 32;
  EXPECT_DOUBLE_EQ(llm_block_params(l, 0).experts, 8 * 3 * 32.0 * 32);
  EXPECT_DOUBLE_EQ(llm_block_params(l, 0).total,
                   attention + 8 * 3 * 32.0 * 32 + 32 * 8 + 3 * 32 * 16);
  EXPECT_DOUBLE_EQ(llm_block_params(l, 1).total, attention + 3 * 32.0 * 64);
  EXPECT_EQ(llm_block_params(l, 1).experts, 0);
  EXPECT_DOUBLE_EQ(moe_all_to_all_bytes(l, t, 0, 2), 2.0 * 10 * 2 * 32 * 2);
  EXPECT_EQ(moe_all_to_all_bytes(l, t, 1, 2), 0);
  // The mean block makes the total the sum over blocks.
  double sum = 0;
  for (int64_t i = 0; i < l.layers; ++i) sum += llm_block_forward_flops(l, t, i);
  EXPECT_DOUBLE_EQ(llm_forward_flops(l, t), sum + llm_head_forward_flops(l, t));
}

// ---- The simulator's expert parallelism --------------------------------------------------

Cluster one_node() {
  return parse_cluster(
      "nodes = 1\ngpus_per_node = 8\n[device]\nbase = \"h100\"\n"
      "[intra_node]\nbandwidth_gbs = 450\nlatency_us = 3\n"
      "[inter_node]\nbandwidth_gbs = 50\nlatency_us = 8\n",
      "node.toml");
}

// Simulates the spec on `world` ranks, LLM and vision data-parallel over all of them.
SimResult simulate_on(int64_t world, std::vector<std::string> sets) {
  sets.push_back("parallel.vision.dp=" + std::to_string(world));
  sets.push_back("train.microbatches=1");
  const Spec s = spec_with(sets);
  return simulate(s, make_plan(s, world), one_node());
}

// Σ over the LLM's blocks of the parameters its experts hold.
double expert_params(const Spec& s) {
  double n = 0;
  for (int64_t b = 0; b < s.model.llm.layers; ++b) n += llm_block_params(s.model.llm, b).experts;
  return n;
}

TEST(MoeSim, ExpertStateIsDividedOverTheExpertParallelRanks) {
  // Per expert parameter, a rank holds 4 B of fp32 weights, 2 B of their bf16 cast, 4 B of
  // gradient and 8 B of moments when it holds the expert: 18 B / ep. ZeRO-1 shards the moments
  // over the expert-data-parallel group (dp4 / ep2 = 2 ranks), the dense weights' over all four.
  const double E = expert_params(spec_with({}));
  const auto bytes = [](const SimResult& r) { return r.ranks[0].static_bytes; };
  const double ep1 = bytes(simulate_on(4, {"parallel.llm.dp=4"}));
  const double ep2 = bytes(simulate_on(4, {"parallel.llm.dp=4", "parallel.llm.ep=2"}));
  const double ep4 = bytes(simulate_on(4, {"parallel.llm.dp=4", "parallel.llm.ep=4"}));
  EXPECT_NEAR(ep1 - ep2, 18 * E / 2, 1e-6 * ep1);
  EXPECT_NEAR(ep1 - ep4, 18 * E * 3 / 4, 1e-6 * ep1);
  const double z1 =
      bytes(simulate_on(4, {"parallel.llm.dp=4", "train.zero_stage=1"}));  // moments / 4
  const double z2 =
      bytes(simulate_on(4, {"parallel.llm.dp=4", "parallel.llm.ep=2", "train.zero_stage=1"}));
  // Experts under bf16 ZeRO-1 (held in bf16, fp32 masters sharded with the moments): ep1 holds
  // 2E + 4E of gradient + 12E/4, ep2 2E/2 + 4E/2 + 12E/2/2.
  EXPECT_NEAR(z1 - z2, (2 * E + 4 * E + 12 * E / 4) - (2 * E / 2 + 4 * E / 2 + 12 * E / 2 / 2),
              1e-6 * z1);
  // etp = 1 under tp2: whole experts on each TP rank (dense weights halved, experts not), then
  // ep = 2 across the TP ranks halves them.
  const double tp2 = bytes(simulate_on(2, {"parallel.llm.tp=2"}));
  const double tp2_etp1 = bytes(simulate_on(2, {"parallel.llm.tp=2", "parallel.llm.etp=1"}));
  const double tp2_etp1_ep2 =
      bytes(simulate_on(2, {"parallel.llm.tp=2", "parallel.llm.etp=1", "parallel.llm.ep=2"}));
  EXPECT_NEAR(tp2_etp1 - tp2, 18 * E / 2, 1e-6 * tp2);
  EXPECT_NEAR(tp2_etp1_ep2, tp2, 1e-6 * tp2);
}

TEST(MoeSim, EachMoeBlockExchangesItsTokenRowsByTwoAllToAllsEachWay) {
  // tp = cp = 1: the only collectives inside the ops are the all-to-alls. Blocks 0 and 2 are MoE
  // (every = 2); a rank's 4 samples of max_seq tokens send top_k rows of hidden bf16 values.
  const Spec s = spec_with({});
  const double rows = 4.0 * static_cast<double>(s.model.llm.max_seq) * 2;
  const double a2a = all_to_all_seconds(one_node(), {0, 1}, rows * 32 * 2);
  const SimResult ep1 = simulate_on(2, {"parallel.llm.dp=2"});
  const SimResult ep2 = simulate_on(2, {"parallel.llm.dp=2", "parallel.llm.ep=2"});
  EXPECT_EQ(ep1.ranks[0].comm_seconds, 0);
  // 2 MoE blocks × 2 all-to-alls × (forward + backward).
  EXPECT_NEAR(ep2.ranks[0].comm_seconds, 2 * 2 * 2 * a2a, 1e-12);
  // ... inside the rank's forward and backward ops (the step itself also changes: the experts'
  // gradients are no longer reduced over the two ranks).
  EXPECT_NEAR(ep2.ranks[0].busy_seconds - ep1.ranks[0].busy_seconds, 8 * a2a, 1e-12);
  // With a pipeline, each stage pays for its own MoE blocks: one each.
  const SimResult pp2 =
      simulate_on(4, {"parallel.llm.dp=2", "parallel.llm.pp=2", "parallel.llm.ep=2"});
  for (const RankReport& r : pp2.ranks) EXPECT_NEAR(r.comm_seconds, 4 * a2a, 1e-12);
  // Recomputed MoE blocks exchange their tokens again in backward (planner_costs prices it).
  const Spec rc = spec_with({"parallel.llm.dp=2", "parallel.llm.ep=2", "parallel.vision.dp=2",
                             "train.microbatches=1", "model.llm.recompute=true"});
  const Plan rp = make_plan(rc, 2);
  const SimResult again = simulate(rc, rp, one_node(), planner_costs(rc, rp));
  EXPECT_NEAR(again.ranks[0].comm_seconds, 3 * 2 * 2 * a2a, 1e-12);
}

TEST(MoeSim, ExpertGradientsAreReducedOverTheExpertDataParallelGroupOnly) {
  const auto collectives = [](const SimResult& r) {
    std::vector<std::string> names;
    for (const TraceEvent& e : r.trace)
      if (e.category == "collective" && e.rank == 0) names.push_back(e.name);
    return names;
  };
  const std::vector<std::string> serial = {"train.overlap_grad_reduce=false"};
  // ep = 1: the experts are plain data-parallel weights, reduced with the rest.
  const auto ep1 = collectives(simulate_on(4, {"parallel.llm.dp=4", serial[0]}));
  EXPECT_EQ(std::count(ep1.begin(), ep1.end(), "llm expert grad all-reduce"), 0);
  const SimResult r = simulate_on(4, {"parallel.llm.dp=4", "parallel.llm.ep=2", serial[0]});
  const auto ep2 = collectives(r);
  EXPECT_EQ(std::count(ep2.begin(), ep2.end(), "llm grad all-reduce"), 1);
  EXPECT_EQ(std::count(ep2.begin(), ep2.end(), "llm expert grad all-reduce"), 1);
  // ep = 4 over dp = 4: every rank holds its own experts, nothing to reduce.
  const auto ep4 =
      collectives(simulate_on(4, {"parallel.llm.dp=4", "parallel.llm.ep=4", serial[0]}));
  EXPECT_EQ(std::count(ep4.begin(), ep4.end(), "llm expert grad all-reduce"), 0);
  // What is reduced apart: the gradients of the rank's experts, half of them under ep = 2.
  const Spec s = spec_with({"parallel.llm.dp=4", "parallel.llm.ep=2"});
  const Plan p = make_plan(s, 4);
  const CostTable costs = stage_costs(s, p);
  const Holding h = rank_holding(costs.back()[0], p.module("llm").layout, false);
  EXPECT_NEAR(h.expert_grads, 4 * expert_params(s) / 2, 1e-6);
}

}  // namespace
}  // namespace weft::plan
