// Measured cost profiles: the non-negative fit against known coefficients, reading a profile
// (and the errors that name the file and field), the rescaling to microbatches, TP/CP shards and
// the frozen rules, the simulator on measured costs against hand-computed step times, and
// make_plan's boundaries from a profile.
#include "weft/plan/profile.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/errors.h"
#include "support/plan_profiles.h"
#include "support/plan_specs.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/simulate.h"

namespace weft::plan {
namespace {

// One node of `ranks` CPU cores, 1 GB/s and 100 us apart.
Cluster cpu_node(int64_t ranks) {
  return parse_cluster("nodes = 1\ngpus_per_node = " + std::to_string(ranks) +
                           "\ndevice = \"cpu-core\"\n[intra_node]\nbandwidth_gbs = 1\n"
                           "latency_us = 100\n",
                       "c.toml");
}

using json = nlohmann::json;
using testing::error_of;
using testing::layer;
using testing::profiled_spec;
using testing::tiny_profile;
using testing::vlm_spec;

bool has(const std::string& message, const std::string& needle) {
  return message.find(needle) != std::string::npos;
}

TEST(ProfileFit, RecoversExactCoefficients) {
  // q = 2e-4 + n · (3e-6 · S + 5e-9 · S²), measured at n ∈ {4, 8, 16}, S ∈ {32, 64}.
  std::vector<CostPoint> pts;
  for (double s : {32.0, 64.0})
    for (double n : {4.0, 8.0, 16.0}) pts.push_back({n, s, 2e-4 + n * (3e-6 * s + 5e-9 * s * s)});
  const CostFit f = fit_cost(pts, true);
  EXPECT_NEAR(f.fixed, 2e-4, 1e-12);
  EXPECT_NEAR(f.linear, 3e-6, 1e-14);
  EXPECT_NEAR(f.quadratic, 5e-9, 1e-16);
  EXPECT_NEAR(f.at(10, 48), 2e-4 + 10 * (3e-6 * 48 + 5e-9 * 48 * 48), 1e-12);
  // Linear model (encoders: S = 1): fixed + n · per item.
  const CostFit g = fit_cost({{1, 1, 7}, {2, 1, 9}, {4, 1, 13}}, false);
  EXPECT_NEAR(g.fixed, 5, 1e-12);
  EXPECT_NEAR(g.linear, 2, 1e-12);
  EXPECT_EQ(g.quadratic, 0);
  EXPECT_THROW(fit_cost({}, false), Error);
}

TEST(ProfileFit, CoefficientsStayNonNegative) {
  // Costs that fall with n (noise): unconstrained least squares gives a negative slope; the
  // fit keeps every coefficient >= 0 and takes the best such (the mean as fixed cost).
  const CostFit f = fit_cost({{1, 1, 6}, {2, 1, 5}, {4, 1, 4}}, false);
  EXPECT_EQ(f.linear, 0);
  EXPECT_NEAR(f.fixed, 5, 1e-12);
  // Pure per-unit cost without overhead: fixed is 0, not slightly negative.
  const CostFit g = fit_cost({{1, 10, 10}, {2, 10, 20}, {4, 10, 40}}, true);
  EXPECT_GE(g.fixed, 0);
  EXPECT_GE(g.quadratic, 0);
  EXPECT_NEAR(g.at(3, 10), 30, 1e-9);
  // A point at n = 0 (nothing) that costs something: all of it fixed.
  const CostFit h = fit_cost({{0, 1, 3}}, false);
  EXPECT_NEAR(h.fixed, 3, 1e-12);
}

TEST(ProfileFit, RelativeErrorsKeepTheLatency) {
  // Message times: 100 us latency, 1 GB/s, from 4 B to 4 MB. Absolute least squares is ruled by
  // the big messages; relative errors honour the small ones too.
  std::vector<CostPoint> pts;
  for (double b : {4.0, 4096.0, 65536.0, 1048576.0, 4194304.0})
    pts.push_back({b, 1, 1e-4 + b / 1e9});
  pts[3].value *= 1.1;  // one noisy point
  const CostFit rel = fit_cost(pts, false, true), abs = fit_cost(pts, false);
  EXPECT_NEAR(rel.fixed, 1e-4, 1e-5);
  EXPECT_LT(std::abs(rel.at(4, 1) - 1e-4), std::abs(abs.at(4, 1) - 1e-4));
}

TEST(ProfileFit, CommCurveInterpolates) {
  CommCurve c;
  c.bytes = {4, 1000, 3000};
  c.seconds = {1e-4, 2e-4, 6e-4};
  EXPECT_DOUBLE_EQ(c.at(1), 1e-4);  // below the first point: the first
  EXPECT_DOUBLE_EQ(c.at(4), 1e-4);
  EXPECT_NEAR(c.at(2000), 4e-4, 1e-15);  // between points: linear
  EXPECT_NEAR(c.at(5000), 1e-3, 1e-15);  // past the end: along the last two
  EXPECT_TRUE(CommCurve{}.empty());
}

TEST(Profile, ParsesEveryField) {
  const Spec s = profiled_spec();
  const Profile p = parse_profile(tiny_profile(s).dump(), "tiny.json");
  EXPECT_EQ(p.source, "tiny.json");
  EXPECT_EQ(p.device, "test cpu (1 thread)");
  EXPECT_EQ(p.threads, 1);
  EXPECT_EQ(p.precision, "bf16");
  EXPECT_EQ(p.samples, 8);
  EXPECT_EQ(p.seq, 40);
  EXPECT_EQ(p.max_seq, 64);
  EXPECT_DOUBLE_EQ(p.data_seconds_per_sample, 1e-3);
  EXPECT_DOUBLE_EQ(p.p2p.latency_seconds, 80e-6);
  EXPECT_DOUBLE_EQ(p.all_reduce.bytes_per_second, 1e9);
  ASSERT_EQ(p.modules.size(), 2u);
  const ModuleProfile& llm = p.module("llm");
  EXPECT_TRUE(llm.llm);
  EXPECT_DOUBLE_EQ(llm.block.forward.linear, 2e-5);
  EXPECT_DOUBLE_EQ(llm.block.forward.quadratic, 1e-7);
  EXPECT_DOUBLE_EQ(llm.stage.forward.fixed, 3e-5);
  EXPECT_DOUBLE_EQ(llm.front.param_bytes, 4.0 * 256 * 128);
  EXPECT_DOUBLE_EQ(p.module("vision").units_per_sample, 2);
  EXPECT_DOUBLE_EQ(p.module("vision").back.optimizer_seconds, 1e-5);
  EXPECT_NO_THROW(check_profile(p, s));
  EXPECT_TRUE(has(error_of([&] { p.module("audio"); }),
                  "tiny.json: the profile has no module "
                  "'audio' (it has llm, vision)"));
}

TEST(Profile, BadFilesNameTheFileAndField) {
  const Spec s = profiled_spec();
  const auto fails = [&](const std::function<void(json&)>& edit, const std::string& want) {
    json j = tiny_profile(s);
    edit(j);
    const std::string e = error_of([&] { parse_profile(j.dump(), "bad.json"); });
    EXPECT_TRUE(has(e, want)) << e << "\n(expected: " << want << ")";
  };
  fails([](json& j) { j["format"] = "other"; }, "bad.json: format = \"other\"");
  fails([](json& j) { j.erase("data"); }, "bad.json: data: missing");
  fails([](json& j) { j["shape"]["seq"] = -1; }, "bad.json: shape.seq = -1: must be a finite");
  fails([](json& j) { j["shape"]["max_seq"] = 1e30; },
        "bad.json: shape.max_seq = 1e+30: expected a whole number below 9e18");
  fails([](json& j) { j["threads"] = 1.5; }, "bad.json: threads = 1.5: expected a whole number");
  fails([](json& j) { j["shape"]["samples"] = "eight"; },
        "shape.samples = \"eight\": expected a number");
  fails([](json& j) { j["precision"] = "fp8"; }, "precision = \"fp8\"");
  fails([](json& j) { j["modules"][0]["layers"][1]["fit"].erase("input_grad"); },
        "bad.json: modules[0].layers[1].fit.input_grad: missing");
  fails(
      [](json& j) {
        j["modules"][0]["layers"][1]["fit"]["forward"] = {1, -2, 0};
      },
      "modules[0].layers[1].fit.forward = [1,-2,0]: coefficients must be finite numbers >= 0");
  fails([](json& j) { j["modules"][0]["layers"][1]["part"] = "middle"; },
        "modules[0].layers[1].part = \"middle\"");
  fails([](json& j) { j["modules"][1]["layers"].erase(1); },
        "modules[1] ('vision'): no \"block\" layer");
  fails([](json& j) { j["modules"][1]["layers"].erase(3); },
        "modules[1] ('vision'): no \"block_recompute\" layer");
  fails([](json& j) { j["modules"][1]["layers"][3]["part"] = "moe_block_recompute"; },
        "modules[1].layers[3].part = \"moe_block_recompute\": expected");
  fails([](json& j) { j["format"] = "weft-profile-1"; },
        "bad.json: format = \"weft-profile-1\": an older profile, whose blocks were measured "
        "only as its config recomputed them; profile again with `weft bench profile`");
  fails([](json& j) { j["comm"]["p2p"]["bandwidth_gbs"] = 0; },
        "comm.p2p.bandwidth_gbs = 0: must be a finite number > 0");
  EXPECT_TRUE(
      has(error_of([] { parse_profile("{not json", "x.json"); }), "x.json: not valid JSON"));
  EXPECT_TRUE(has(error_of([] { load_profile("/nonexistent/p.json"); }),
                  "/nonexistent/p.json: cannot read profile file"));

  // A profile of another model or precision.
  const Profile p = parse_profile(tiny_profile(s).dump(), "tiny.json");
  Spec other = s;
  other.model.llm.hidden = 256;
  EXPECT_TRUE(has(error_of([&] { check_profile(p, other); }),
                  "tiny.json: module 'llm' was profiled with hidden = 128 but test.toml has 256"));
  other = s;
  other.model.encoders[0].image_size = 128;
  EXPECT_TRUE(has(error_of([&] { check_profile(p, other); }), "module 'vision' was profiled with"));
  other = s;
  other.train.precision = Precision::kFp32;
  EXPECT_TRUE(has(error_of([&] { check_profile(p, other); }),
                  "tiny.json: measured in bf16 but test.toml trains in fp32"));
  other = s;
  other.model.llm.layers = 12;  // layer counts may differ
  EXPECT_NO_THROW(check_profile(p, other));
  other.model.llm.vocab = 0;  // taken from the tokenizer: not compared
  EXPECT_NO_THROW(check_profile(p, other));
}

TEST(Profile, RescalesToMicrobatchesShardsAndFrozenRules) {
  const Spec s = profiled_spec();
  const Profile p = parse_profile(tiny_profile(s).dump(), "tiny.json");
  const Plan plan = make_plan(s);
  const ModulePlan& llm = plan.module("llm");
  EXPECT_EQ(profile_seq(p, s), 40);  // the profiled data's rows
  const double S = 40, per = 2e-5 * S + 1e-7 * S * S;
  const ModuleCosts c = profile_module_costs(p, s, llm, 6);
  ASSERT_EQ(c.blocks.size(), 4u);
  EXPECT_NEAR(c.blocks[2].forward, 1e-4 + 6 * per, 1e-15);
  EXPECT_NEAR(c.blocks[2].input_grad, 6 * per, 1e-15);
  EXPECT_NEAR(c.blocks[2].weight_grad, 6 * 2e-5 * S, 1e-15);
  EXPECT_NEAR(c.blocks[0].activation_bytes, 1000 + 6 * 5000 * S, 1e-6);
  EXPECT_EQ(c.blocks[0].param_bytes, 800000);
  EXPECT_EQ(c.blocks[0].train_state_bytes, 3 * 800000);
  EXPECT_NEAR(c.front.forward, 1e-4 + 6 * 1e-6 * S, 1e-15);
  EXPECT_EQ(c.front.input_grad, 0);        // the encoder trains but nothing flows to it here
  EXPECT_EQ(c.back.param_bytes, 4 * 128);  // tied head, not pipelined: no embedding copy
  // tp = 2, cp = 2: per-unit work and activations over 4, parameters over 2, fixed kept.
  const ModuleCosts sh = profile_module_costs(p, s, llm, 6, 2, 2);
  EXPECT_NEAR(sh.blocks[1].forward, 1e-4 + 6 * per / 4, 1e-15);
  EXPECT_EQ(sh.blocks[1].param_bytes, 400000);
  // Another max_seq: rows assumed full.
  Spec longer = s;
  longer.model.llm.max_seq = 128;
  EXPECT_EQ(profile_seq(p, longer), 128);
  EXPECT_NEAR(profile_module_costs(p, longer, make_plan(longer).module("llm"), 1).blocks[0].forward,
              1e-4 + 2e-5 * 128 + 1e-7 * 128 * 128, 1e-15);
  // Encoders: items per sample from the profile.
  const ModuleCosts v = profile_module_costs(p, s, plan.module("vision"), 3);
  EXPECT_NEAR(v.blocks[0].forward, 5e-5 + 6 * 5e-4, 1e-15);
  EXPECT_EQ(v.front.input_grad, 0);
  EXPECT_NEAR(v.front.weight_grad, 6 * 1e-4, 1e-15);
  // On a rank of tp = 2, cp = 2 its blocks take a quarter of the per-unit work, but its front
  // end runs whole there, on its whole parameters.
  const ModuleCosts vs = profile_module_costs(p, s, plan.module("vision"), 3, 2, 2);
  EXPECT_NEAR(vs.blocks[0].forward, 5e-5 + 6 * 5e-4 / 4, 1e-15);
  EXPECT_DOUBLE_EQ(vs.front.forward, v.front.forward);
  EXPECT_DOUBLE_EQ(vs.front.weight_grad, v.front.weight_grad);
  EXPECT_DOUBLE_EQ(vs.front.activation_bytes, v.front.activation_bytes);
  EXPECT_DOUBLE_EQ(vs.front.param_bytes, v.front.param_bytes);
  // Frozen LLM with a trainable encoder: input gradients only, and the embedding routes the
  // feature gradients; frozen encoder with nothing upstream: forward only.
  Spec frozen = s;
  frozen.model.llm.frozen = true;
  const ModuleCosts f = profile_module_costs(p, frozen, make_plan(frozen).module("llm"), 6);
  EXPECT_EQ(f.blocks[0].weight_grad, 0);
  EXPECT_NEAR(f.blocks[0].input_grad, 6 * per, 1e-15);
  EXPECT_EQ(f.blocks[0].train_state_bytes, 0);
  frozen = s;
  frozen.model.encoders[0].frozen = true;
  const Plan fp = make_plan(frozen);
  const ModuleCosts fv = profile_module_costs(p, frozen, fp.module("vision"), 3);
  EXPECT_EQ(fv.blocks[0].input_grad + fv.blocks[0].weight_grad + fv.blocks[0].activation_bytes, 0);
  EXPECT_EQ(fv.back.input_grad, 0);  // the trainable projector after a frozen encoder
  EXPECT_NEAR(fv.back.weight_grad, 6 * 1e-4, 1e-15);
}

// An MoE LLM (blocks 0 and 2 MoE): those blocks take the "moe_block" layer's costs, the others
// the dense block's; the experts' share of the measured parameters is split off for expert
// parallelism; a dense profile, or one without the MoE block, is rejected naming what is missing.
TEST(Profile, MoeBlocksTakeTheMoeBlockCosts) {
  Spec s = profiled_spec();
  s.model.llm.moe.experts = 4;
  s.model.llm.moe.top_k = 2;
  s.model.llm.moe.every = 2;
  json j = tiny_profile(s);
  json moe = layer("llm.moe_block", "moe_block", 0, 0, 0, 0, 500000, 5e-4);
  moe["fit"]["forward"] = {3e-4, 7e-5, 0};
  j["modules"][0]["layers"].push_back(moe);
  // Measured plain and recomputed, or the profile is refused.
  const std::string alone = testing::error_of([&] { parse_profile(j.dump(), "moe.json"); });
  EXPECT_NE(alone.find("moe.json: modules[0] ('llm'): \"moe_block\" without "
                       "\"moe_block_recompute\""),
            std::string::npos)
      << alone;
  moe["name"] = "llm.moe_block.recompute";
  moe["part"] = "moe_block_recompute";
  moe["fit"]["input_grad"] = {3e-4, 7e-5, 0};
  j["modules"][0]["layers"].push_back(moe);
  const Profile p = parse_profile(j.dump(), "moe.json");
  // Recomputed, an MoE block takes the recomputed MoE block's costs.
  Spec rc = s;
  rc.model.llm.recompute = true;
  const ModuleCosts r = profile_module_costs(p, rc, make_plan(rc).module("llm"), 1);
  EXPECT_NEAR(r.blocks[0].input_grad, 3e-4 + 7e-5 * 40, 1e-15);
  EXPECT_NEAR(r.blocks[1].input_grad, 1e-4 + 4e-5 * 40 + 2e-7 * 40 * 40, 1e-15);
  EXPECT_TRUE(p.module("llm").has_moe_block);
  const ModuleCosts c = profile_module_costs(p, s, make_plan(s).module("llm"), 1);
  ASSERT_EQ(c.blocks.size(), 4u);
  const double S = 40;
  EXPECT_NEAR(c.blocks[0].forward, 3e-4 + 7e-5 * S, 1e-15);
  EXPECT_NEAR(c.blocks[2].forward, 3e-4 + 7e-5 * S, 1e-15);
  EXPECT_NEAR(c.blocks[1].forward, 1e-4 + 2e-5 * S + 1e-7 * S * S, 1e-15);
  EXPECT_EQ(c.blocks[0].param_bytes, 2000000);
  const BlockParams bp = llm_block_params(s.model.llm, 0);
  EXPECT_NEAR(c.blocks[0].expert_param_bytes, 2000000 * bp.experts / bp.total, 1e-6);
  EXPECT_EQ(c.blocks[1].expert_param_bytes, 0);
  // The optimizer: two MoE and two dense blocks' measured seconds.
  const CostTable t = profile_stage_costs(p, s, make_plan(s));
  EXPECT_NEAR(t.back()[0].optimizer_seconds, 1e-4 + 2 * 2e-4 + 2 * 5e-4 + 1e-5, 1e-15);
  // A profile of the dense model lacks the MoE fields; one without "moe_block" says so.
  const std::string dense = testing::error_of(
      [&] { check_profile(parse_profile(tiny_profile(profiled_spec()).dump(), "dense.json"), s); });
  EXPECT_NE(dense.find("dense.json: module 'llm': model.moe_experts missing"), std::string::npos)
      << dense;
  const std::string none =
      testing::error_of([&] { check_profile(parse_profile(tiny_profile(s).dump(), "n.json"), s); });
  EXPECT_NE(none.find("n.json: has no \"moe_block\" layer"), std::string::npos) << none;
  // The dense model may use an MoE profile's dense block.
  EXPECT_NO_THROW(check_profile(p, profiled_spec()));
}

// Recomputation is priced block by block from the "block_recompute" layer, whatever the profiled
// config recomputed: recompute_blocks = [1, 0] over two LLM stages recomputes block 0 of stage 0
// only (its backward takes the recomputed input gradient; it keeps the recomputed activations,
// and holds the plain ones again in backward), and the step and peak fall between none and all.
// Timed apart, a recomputed block's fits can come out below the plain block's (noise over a few
// short ops); it runs the plain forward and backward and its forward again, so each coefficient
// of its forward + input gradient (frozen weights) and of its total is raised to the plain one's,
// on its input gradient. A costlier one is kept.
TEST(Profile, RecomputedBlockIsNeverCheaperThanPlain) {
  const Spec s = profiled_spec();
  json j = tiny_profile(s);
  json& llm_layers = j["modules"][0]["layers"];
  json* again = nullptr;
  for (json& l : llm_layers)
    if (l["part"] == "block_recompute") again = &l;
  ASSERT_NE(again, nullptr);
  // Plain: forward {1e-4, 2e-5, 1e-7}, input {0, 2e-5, 1e-7}, weight {0, 2e-5, 0}.
  (*again)["fit"]["forward"] = {5e-5, 1e-5, 1e-7};
  (*again)["fit"]["input_grad"] = {1e-4, 1e-5, 0};
  (*again)["fit"]["weight_grad"] = {0, 1e-4, 0};  // its total's linear term is not short
  const Profile p = parse_profile(j.dump(), "noisy.json");
  const LayerProfile& r = p.module("llm").block_recompute;
  EXPECT_DOUBLE_EQ(r.forward.fixed, 5e-5);  // forward and weight gradient as measured
  EXPECT_DOUBLE_EQ(r.weight_grad.linear, 1e-4);
  EXPECT_DOUBLE_EQ(r.input_grad.fixed, 1e-4);  // 1.5e-4 already >= the plain 1e-4
  // Forward + input gradient 2e-5, short of the plain 4e-5 (the total 1.2e-4 is not).
  EXPECT_NEAR(r.input_grad.linear, 1e-5 + 2e-5, 1e-18);
  EXPECT_NEAR(r.input_grad.quadratic, 1e-7, 1e-20);  // 1e-7 short of 2e-7
  const Profile fine = parse_profile(tiny_profile(s).dump(), "tiny.json");
  EXPECT_DOUBLE_EQ(fine.module("llm").block_recompute.input_grad.linear, 4e-5);  // as measured
}

TEST(Profile, PricesRecomputationBlockByBlock) {
  Spec s = profiled_spec();
  s.train.microbatches = 2;
  s.parallel.modules["llm"].pp = 2;
  s.parallel.modules["llm"].stages = {2};
  const Profile p = parse_profile(tiny_profile(s).dump(), "tiny.json");
  const auto table = [&](bool on, std::vector<int64_t> blocks) {
    Spec x = s;
    x.model.llm.recompute = on;
    x.model.llm.recompute_blocks = std::move(blocks);
    return profile_stage_costs(p, x, make_plan(x, 2, &p)).back();
  };
  const std::vector<StageCost> off = table(false, {}), some = table(true, {1, 0}),
                               all = table(true, {});
  ASSERT_EQ(off.size(), 2u);
  const double S = 40;
  EXPECT_FALSE(off[0].recompute);
  EXPECT_TRUE(some[0].recompute);
  EXPECT_EQ(some[0].recompute_blocks, 1);
  EXPECT_FALSE(some[1].recompute);
  EXPECT_EQ(all[0].recompute_blocks, 2);
  EXPECT_EQ(all[1].recompute_blocks, 2);
  // Stage 0: one block's backward is the recomputed one's (per unit and fixed).
  EXPECT_NEAR(some[0].backward_seconds - off[0].backward_seconds, 2e-5 * S + 1e-7 * S * S, 1e-15);
  EXPECT_NEAR(some[0].backward_fixed_seconds - off[0].backward_fixed_seconds, 1e-4, 1e-15);
  EXPECT_NEAR(some[0].activation_bytes - off[0].activation_bytes, (500 - 5000) * S, 1e-6);
  EXPECT_NEAR(some[0].activation_fixed_bytes - off[0].activation_fixed_bytes, 100 - 1000, 1e-9);
  EXPECT_NEAR(some[0].recompute_peak_bytes, (5000 - 500) * S, 1e-6);
  EXPECT_EQ(some[1].backward_seconds, off[1].backward_seconds);
  EXPECT_EQ(some[1].recompute_peak_bytes, 0);
  // FLOPs (MFU) are the model's, recomputed or not.
  EXPECT_EQ(some[0].backward_flops, off[0].backward_flops);
  EXPECT_EQ(some[0].recompute_flops, 0);
  // Simulated: slower and smaller with each recomputed block.
  const Cluster c = parse_cluster(
      "nodes = 1\ngpus_per_node = 2\ndevice = \"cpu-core\"\n[intra_node]\nbandwidth_gbs = "
      "1\nlatency_us = 100\n",
      "c.toml");
  std::vector<double> step, peak;
  for (const auto& [on, blocks] : std::vector<std::pair<bool, std::vector<int64_t>>>{
           {false, {}}, {true, {1, 0}}, {true, {}}}) {
    Spec x = s;
    x.model.llm.recompute = on;
    x.model.llm.recompute_blocks = blocks;
    const SimResult r = simulate(x, make_plan(x, 2, &p), c, p, SimOptions{});
    step.push_back(r.step_seconds);
    peak.push_back(r.ranks[0].peak_activation_bytes);
  }
  EXPECT_LT(step[0], step[1]);
  EXPECT_LT(step[1], step[2]);
  EXPECT_GT(peak[0], peak[1]);
  EXPECT_GT(peak[1], peak[2]);
}

// One rank, one microbatch of 8 samples: the step is data + vision + LLM + optimizer, each the
// profile's numbers; two ranks (DP2) add the measured all-reduce of the gradients.
TEST(Profile, SimulatorUsesMeasuredCosts) {
  Spec s = profiled_spec();
  s.train.microbatches = 1;
  const Profile p = parse_profile(tiny_profile(s).dump(), "tiny.json");
  const Cluster c = cpu_node(2);
  const Plan one = make_plan(s, 1, &p);
  SimOptions o;
  const SimResult r = simulate(s, one, c, p, o);
  const double S = 40, n = 8, items = 16;
  const double llm_fixed = 1e-4 + 4 * 1e-4 + 3e-5;  // embed, blocks, stage forward
  const double llm_per = 1e-6 * S + 4 * (2e-5 * S + 1e-7 * S * S) + 1e-5 * S + 1e-8 * S * S;
  const double llm_bwd = 2e-6 * S + 4 * (2e-5 * S + 1e-7 * S * S + 2e-5 * S) + 1e-5 * S;
  const double vis = 3 * 5e-5 + items * (1e-4 + 3 * 5e-4 + 1e-4);
  const double vis_bwd = items * (1e-4 + 3 * 1e-3 + 2e-4);
  const double opt = 1e-4 + 4 * 2e-4 + 1e-5 + 1e-5 + 3 * 3e-5 + 1e-5;
  const double want = 8 * 1e-3 + vis + llm_fixed + n * llm_per + n * llm_bwd + vis_bwd + opt;
  EXPECT_NEAR(r.step_seconds, want, 1e-12);
  EXPECT_NEAR(r.ranks[0].data_seconds, 8e-3, 1e-15);
  EXPECT_NEAR(r.ranks[0].optimizer_seconds, opt, 1e-15);
  EXPECT_DOUBLE_EQ(r.tokens_per_step, 8 * S);
  // Measured activation memory: 4 blocks of 1000 + 8 · 40 · 5000 bytes.
  EXPECT_DOUBLE_EQ(r.ranks[0].peak_activation_bytes, 4 * (1000 + 8 * S * 5000));
  // The FLOP model gives another step. MFU counts the FLOPs of the samples the costs are for:
  // the profiled rows of 40 tokens, not max_seq's 64, with the profiled 2 images each.
  EXPECT_NE(simulate(s, one, c).step_seconds, r.step_seconds);
  SimOptions rows;
  rows.data.positions = rows.data.targets = S;
  rows.data.sum_sq_doc_len = S * S;
  rows.data.items = {items / n};
  EXPECT_EQ(profile_data_shape(p, s).items, rows.data.items);
  EXPECT_DOUBLE_EQ(r.model_flops, simulate(s, one, c, rows).model_flops);
  rows.data.items = {1};
  EXPECT_GT(r.model_flops, simulate(s, one, c, rows).model_flops);

  // DP2: each rank half the samples (fixed costs stay), plus the gradient all-reduce.
  s.train.overlap_grad_reduce = false;
  const Plan two = make_plan(s, 2, &p);
  const SimResult r2 = simulate(s, two, c, p, o);
  EXPECT_LT(r2.step_seconds, r.step_seconds);
  EXPECT_GT(r2.ranks[0].collective_seconds, 0);
  const double half = 8 * 1e-3 + 3 * 5e-5 + 8 * (1e-4 + 3 * 5e-4 + 1e-4) + llm_fixed + 4 * llm_per +
                      4 * llm_bwd + 8 * (1e-4 + 3 * 1e-3 + 2e-4) + opt;
  EXPECT_NEAR(r2.step_seconds - r2.ranks[0].collective_seconds, half, 1e-12);

  // Measured curves replace the cluster's link on one node: every all-reduce of the step (the
  // two modules' gradients, the loss and the norm) costs the curve's value at its size, and the
  // reductions start after the backward (the transport runs on the ranks' cores).
  const json with_points =
      testing::with_comm_points(tiny_profile(s), {8, 1e6, 1e7}, {1e-4, 1e-9}, {2e-3, 1e-9}, {3e-3});
  const Profile pc = parse_profile(with_points.dump(), "points.json");
  ASSERT_EQ(pc.all_reduce_curve.bytes.size(), 3u);
  EXPECT_TRUE(pc.comm_on_compute);
  s.train.overlap_grad_reduce = true;  // has no effect: nothing overlaps on CPU ranks
  const SimResult r3 = simulate(s, make_plan(s, 2, &pc), c, pc, o);
  const CostTable t = profile_stage_costs(pc, s, make_plan(s, 2, &pc));
  double reductions = 2 * pc.all_reduce_curve.at(8);  // loss and norm
  for (const auto& module : t)
    for (const StageCost& sc : module) reductions += pc.all_reduce_curve.at(sc.grad_bytes);
  EXPECT_NEAR(r3.ranks[0].collective_seconds, reductions, 1e-12);
  EXPECT_NEAR(r3.step_seconds, half + reductions, 1e-12);
  json bad = with_points;
  bad["comm"]["points"][1]["bytes"] = 4;
  EXPECT_TRUE(has(error_of([&] { parse_profile(bad.dump(), "b.json"); }),
                  "b.json: comm.points[1].bytes = 4: sizes must increase"));

  // The fp32 all-reduce waited for where issued measured apart (through shared memory on CPU
  // ranks of one host): the loss and the norm cost that curve, the gradients still Gloo's.
  const json blocking = testing::with_comm_points(tiny_profile(s), {8, 1e6, 1e7}, {1e-4, 1e-9},
                                                  {2e-3, 1e-9}, {3e-3}, {5e-5, 1e-10});
  const Profile pb = parse_profile(blocking.dump(), "blocking.json");
  ASSERT_EQ(pb.all_reduce_blocking_curve.bytes.size(), 3u);
  const SimResult r4 = simulate(s, make_plan(s, 2, &pb), c, pb, o);
  const double loss_norm = 2 * pb.all_reduce_blocking_curve.at(8);
  EXPECT_NEAR(loss_norm, 2 * (5e-5 + 8e-10), 1e-15);
  EXPECT_NEAR(r4.ranks[0].collective_seconds,
              reductions - 2 * pc.all_reduce_curve.at(8) + loss_norm, 1e-12);
  json partial = blocking;
  partial["comm"]["points"][2].erase("all_reduce_blocking");
  EXPECT_TRUE(
      has(error_of([&] { parse_profile(partial.dump(), "p.json"); }), "all_reduce_blocking"));
}

// Where the compute-dtype curve went through shared memory, the experts' all-to-all (Gloo's on
// every host) is priced on Gloo's measured curve instead; a transport the file cannot have is an
// error naming it.
TEST(Profile, ActivationTransportPricesTheAllToAll) {
  const Spec s = profiled_spec();
  json j = testing::with_comm_points(tiny_profile(s), {8, 1e6, 1e7}, {1e-4, 1e-9}, {2e-3, 1e-9},
                                     {3e-3}, {5e-5, 1e-10});
  const Profile plain = parse_profile(j.dump(), "p.json");  // older profiles: no transport
  EXPECT_FALSE(plain.activations_in_shared_memory);
  EXPECT_TRUE(profile_sim_options(plain, s, SimOptions{}).all_to_all_curve.empty());
  j["comm"]["activation_transport"] = "gloo";
  EXPECT_FALSE(parse_profile(j.dump(), "p.json").activations_in_shared_memory);
  j["comm"]["activation_transport"] = "shared memory";
  const Profile shm = parse_profile(j.dump(), "p.json");
  EXPECT_TRUE(shm.activations_in_shared_memory);
  const SimOptions o = profile_sim_options(shm, s, SimOptions{});
  EXPECT_EQ(o.all_to_all_curve.seconds, shm.all_reduce_curve.seconds);
  EXPECT_EQ(o.activation_curve.seconds, shm.all_reduce_compute_curve.seconds);
  j["comm"]["activation_transport"] = "tcp";
  EXPECT_EQ(error_of([&] { parse_profile(j.dump(), "p.json"); }),
            "p.json: comm.activation_transport = \"tcp\": expected \"shared memory\" or \"gloo\"");
}

// A profile that recorded the data's mean sample ("data_shape", as `weft bench profile` writes
// it) prices its FLOP fields, messages and TP rank's whole share on it: here 12 loss targets of
// 40 positions, not a loss on every position.
TEST(Profile, PricesTheRecordedDataShape) {
  Spec s = profiled_spec();
  s.train.microbatches = 1;
  DataShape d;
  d.samples = 512;
  d.positions = 40;
  d.tokens = 33;
  d.targets = 12;
  d.sum_sq_doc_len = 33 * 33;
  d.items = {2};
  d.peak_positions = 64;
  d.peak_targets = 20;
  d.peak_items = {3};
  json j = tiny_profile(s);
  j["data_shape"] = json::parse(data_shape_json(s, d).dump());
  const Profile p = parse_profile(j.dump(), "shape.json");
  const DataShape got = profile_data_shape(p, s);
  EXPECT_EQ(got.samples, 512);
  EXPECT_DOUBLE_EQ(got.positions, 40);
  EXPECT_DOUBLE_EQ(got.targets, 12);
  EXPECT_DOUBLE_EQ(got.sum_sq_doc_len, 33 * 33);
  EXPECT_EQ(got.items, d.items);
  EXPECT_DOUBLE_EQ(got.peak_positions, 64);
  EXPECT_EQ(got.peak_items, d.peak_items);
  // The time is the profile's either way; the FLOPs (MFU) are the FLOP model's on the shape.
  const Cluster c = cpu_node(1);
  const Plan one = make_plan(s, 1, &p);
  const Profile without = parse_profile(tiny_profile(s).dump(), "tiny.json");
  const SimResult r = simulate(s, one, c, p), old = simulate(s, one, c, without);
  EXPECT_DOUBLE_EQ(r.step_seconds, old.step_seconds);
  SimOptions on;
  on.data = d;
  EXPECT_DOUBLE_EQ(r.model_flops, simulate(s, one, c, on).model_flops);
  EXPECT_LT(r.model_flops, old.model_flops) << "the head on 12 targets, not on 40 positions";
  // Rescaled to another max_seq, the rows are full again.
  Spec longer = s;
  longer.model.llm.max_seq = 128;
  EXPECT_DOUBLE_EQ(profile_data_shape(p, longer).targets, 128);

  // Bad shapes name the file and the field.
  const auto fails = [&](const std::function<void(json&)>& edit, const std::string& want) {
    json bad = j;
    edit(bad);
    const std::string e =
        error_of([&] { profile_data_shape(parse_profile(bad.dump(), "bad.json"), s); });
    EXPECT_TRUE(has(e, want)) << e << "\n(expected: " << want << ")";
  };
  fails([](json& b) { b["data_shape"]["targets"] = -1; },
        "bad.json: data_shape.targets = -1: must be a finite number >= 0");
  fails([](json& b) { b["data_shape"].erase("positions"); },
        "bad.json: data_shape.positions: missing");
  fails([](json& b) { b["data_shape"]["items"] = 2; },
        "bad.json: data_shape.items = 2: expected an object of encoder name -> items per sample");
  fails(
      [](json& b) {
        b["data_shape"]["items"] = {{"audio", 1}};
      },
      "bad.json: data_shape.items: no items of encoder 'vision'");
  fails([](json& b) { b["data_shape"]["peak"]["items"] = json::object(); },
        "bad.json: data_shape.peak.items: no items of encoder 'vision'");
  fails([](json& b) { b["data_shape"]["targets"] = 41; }, "bad.json: data shape: targets per");
  fails([](json& b) { b["data_shape"]["items"]["vision"] = 3; },
        "bad.json: data_shape.items.vision = 3 but module 'vision' has units_per_sample = 2");
  // The profiled vocabulary, which a spec without one (model.llm.vocab = 0) takes.
  Spec unset = s;
  unset.model.llm.vocab = 0;
  json big = j;
  big["modules"][0]["model"]["vocab"] = 1e30;
  const Profile pb = parse_profile(big.dump(), "big.json");
  EXPECT_TRUE(has(error_of([&] { simulate(unset, make_plan(unset, 1, &pb), c, pb); }),
                  "big.json: model.vocab = 1e+30 (module 'llm'): expected a whole number"));
}

// An encoder's front end runs whole on each TP rank: only its blocks and back end split.
TEST(Profile, EncoderFrontEndRunsWholeOnEveryTensorParallelRank) {
  Spec s = profiled_spec();
  s.parallel.modules["vision"].tp = 2;
  const Profile p = parse_profile(tiny_profile(s).dump(), "tiny.json");
  const Plan plan = make_plan(s, 2, &p);
  const CostTable measured = profile_stage_costs(p, s, plan);
  const StageCost& sc = measured[0][0];
  // The front's 1e-4 s per item each way, per unit of 2 items (units_per_sample).
  EXPECT_DOUBLE_EQ(sc.replicated_forward_seconds, 2e-4);
  EXPECT_DOUBLE_EQ(sc.replicated_backward_seconds, 2e-4);
  // Per unit: blocks 3 · 5e-4 and projector 1e-4 forward (twice backward), 2 items each.
  const double n = 8;
  EXPECT_NEAR(compute_seconds(sc, true, n, 2, 1), 3 * 5e-5 + n * (2e-4 + (3e-3 + 2e-4) / 2), 1e-15);
  EXPECT_NEAR(compute_seconds(sc, false, n, 2, 1), n * (2e-4 + (6e-3 + 4e-4) / 2), 1e-15);
  // The FLOP model likewise.
  const CostTable model = stage_costs(s, plan);
  const StageCost& flops = model[0][0];
  EXPECT_GT(flops.replicated_forward_flops, 0);
  EXPECT_LT(flops.replicated_forward_flops, flops.forward_flops);
}

// Layers measured 1.5x slower while the other cores train: DP2's ranks compute side by side all
// step, so every op is charged its shared cost; encoder and LLM on separate ranks take turns, so
// none is.
TEST(Profile, ContentionWhereRanksComputeTogether) {
  Spec s = profiled_spec();
  s.train.microbatches = 1;
  json j = tiny_profile(s);
  for (auto& m : j["modules"])
    for (auto& l : m["layers"]) {
      json shared;
      for (const char* q : {"forward", "input_grad", "weight_grad"}) {
        json f = l["fit"][q];
        for (auto& x : f) x = 1.5 * x.get<double>();
        shared[q] = f;
      }
      l["fit"]["shared"] = shared;
    }
  const Profile alone = parse_profile(tiny_profile(s).dump(), "alone.json");
  const Profile loaded = parse_profile(j.dump(), "loaded.json");
  EXPECT_TRUE(loaded.module("llm").block.shared);
  EXPECT_FALSE(alone.module("llm").block.shared);
  const Cluster c = parse_cluster(
      "nodes = 1\ngpus_per_node = 2\ndevice = \"cpu-core\"\n"
      "[intra_node]\nbandwidth_gbs = 1\nlatency_us = 100\n",
      "c.toml");
  const Plan dp = make_plan(s, 2, &alone);
  const SimResult a = simulate(s, dp, c, alone), b = simulate(s, dp, c, loaded);
  for (int r = 0; r < 2; ++r)
    EXPECT_NEAR(b.ranks[r].busy_seconds, 1.5 * a.ranks[r].busy_seconds, 1e-12) << r;
  s.parallel.placement = "separate";
  const Plan sep = make_plan(s, 2, &alone);
  const SimResult x = simulate(s, sep, c, alone), y = simulate(s, sep, c, loaded);
  for (int r = 0; r < 2; ++r) EXPECT_NEAR(y.ranks[r].busy_seconds, x.ranks[r].busy_seconds, 1e-12);
  EXPECT_NEAR(y.step_seconds, x.step_seconds, 1e-12);
}

// Media decoding is charged to the ranks whose first encoder stage reads the items: all of
// them on one process, half on each of DP2's, and none on the LLM rank of a separate placement.
// Every rank still lays out the whole batch.
TEST(Profile, MediaDecodingIsChargedToTheRanksThatReadTheItems) {
  Spec s = profiled_spec();  // a global batch of 8 samples of one image
  json j = tiny_profile(s);
  j["data"]["media_seconds_per_sample"] = {{"vision", 2e-3}};
  const Profile p = parse_profile(j.dump(), "media.json");
  EXPECT_DOUBLE_EQ(p.media_seconds_per_sample.at("vision"), 2e-3);
  const Cluster c = parse_cluster(
      "nodes = 1\ngpus_per_node = 2\ndevice = \"cpu-core\"\n"
      "[intra_node]\nbandwidth_gbs = 1\nlatency_us = 100\n",
      "c.toml");
  const double layout = 8 * 1e-3;
  EXPECT_NEAR(simulate(s, make_plan(s, 1, &p), c, p).ranks[0].data_seconds, layout + 8 * 2e-3,
              1e-15);
  const SimResult dp = simulate(s, make_plan(s, 2, &p), c, p);
  for (int r = 0; r < 2; ++r) EXPECT_NEAR(dp.ranks[r].data_seconds, layout + 4 * 2e-3, 1e-15);
  s.parallel.placement = "separate";
  const SimResult sep = simulate(s, make_plan(s, 2, &p), c, p);
  EXPECT_NEAR(sep.ranks[0].data_seconds, layout + 8 * 2e-3, 1e-15);  // the vision rank
  EXPECT_NEAR(sep.ranks[1].data_seconds, layout, 1e-15);             // the LLM rank
  // Media read from files: the ranks agree on bad records every step, one world all-reduce.
  auto agreement = [&](const SimResult& r) {
    int n = 0;
    for (const TraceEvent& ev : r.trace) n += ev.name == "bad-media agreement";
    return n;
  };
  EXPECT_EQ(agreement(sep), 0);  // generated media
  s.data.kind = "llava";
  const SimResult files = simulate(s, make_plan(s, 2, &p), c, p);
  EXPECT_EQ(agreement(files), 2);
  EXPECT_GT(files.step_seconds, sep.step_seconds);
  s.parallel.placement = "colocated";
  EXPECT_EQ(agreement(simulate(s, make_plan(s, 1, &p), c, p)), 0);  // one process
  j["data"]["media_seconds_per_sample"] = {{"vision", "fast"}};
  const std::string e = error_of([&] { parse_profile(j.dump(), "media.json"); });
  EXPECT_TRUE(
      has(e, "media.json: data.media_seconds_per_sample.vision = \"fast\": expected a number"))
      << e;
}

TEST(Profile, MakePlanPartitionsOnMeasuredCosts) {
  Spec s = profiled_spec();
  s.parallel.modules["llm"].pp = 2;
  json j = tiny_profile(s);
  const Profile flat = parse_profile(j.dump(), "flat.json");
  // A head with the forward of three blocks moves the cut toward the end.
  j["modules"][0]["layers"][2]["fit"]["forward"] = {0, 3 * 2e-5, 3 * 1e-7};
  j["modules"][0]["layers"][2]["fit"]["input_grad"] =
      j["modules"][0]["layers"][1]["fit"]["input_grad"];
  const Profile heavy = parse_profile(j.dump(), "heavy.json");
  const Plan a = make_plan(s, 2, &flat), b = make_plan(s, 2, &heavy);
  EXPECT_EQ(a.module("llm").stage_boundaries, (std::vector<int64_t>{2}));
  EXPECT_EQ(b.module("llm").stage_boundaries, (std::vector<int64_t>{3}));
  Spec other = s;
  other.model.llm.heads = 8;
  EXPECT_TRUE(has(error_of([&] { make_plan(other, 2, &flat); }), "was profiled with heads = 4"));
}

}  // namespace
}  // namespace weft::plan
