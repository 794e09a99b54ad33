// Mixture of experts on the torch-free side: [model.llm.moe] parsing and its errors, expert
// parallelism in make_plan (validation, EP and expert-data-parallel groups, JSON), and the FLOP
// model of MoE blocks.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/errors.h"
#include "weft/core/config.h"
#include "weft/plan/flops.h"
#include "weft/plan/plan.h"

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

}  // namespace
}  // namespace weft::plan
