// Batch balancing: the workload model against flops.h under the frozen rules; assignments are
// partitions of the right shape, balanced never loses to in_order on random skewed batches and
// wins clearly on average, a hand-made case where image-heavy samples must be split up (and an
// LLM-tokens-only balancer leaves them together); the 1F1B evaluator against the closed form and
// hand-worked cases; microbatch reordering never worse than in-order and against brute force.
#include "weft/plan/balance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <vector>

#include "support/plan_specs.h"
#include "weft/core/error.h"
#include "weft/plan/flops.h"
#include "weft/plan/plan.h"
#include "weft/plan/workload.h"

namespace weft::plan {
namespace {

using testing::vlm_spec;

// LLaVA-1.5-7B-like: CLIP ViT-L/14 at 336 px (576 tokens, second-to-last layer), Llama-2-7B.
Spec llava_spec() {
  Spec s;
  s.source = "llava.toml";
  LlmSpec& l = s.model.llm;
  l.hidden = 4096, l.layers = 32, l.heads = 32, l.kv_heads = 32, l.ffn = 11008, l.vocab = 32000;
  l.max_seq = 4096;
  EncoderSpec v;
  v.name = "vision";
  v.hidden = 1024, v.layers = 24, v.heads = 16, v.ffn = 4096, v.feature_layer = -2;
  v.image_size = 336, v.patch = 14;
  s.model.encoders = {v};
  return s;
}

TEST(Balance, WorkModelMatchesTheFlopModel) {
  const Spec s = vlm_spec();
  const EncoderSpec& e = s.model.encoders[0];
  const WorkModel w = make_work_model(s, make_plan(s));
  ASSERT_EQ(w.encoder_per_item.size(), 1u);
  EXPECT_EQ(w.encoder_names[0], "vision");
  // Trainable: the front end has no input gradient (2x), blocks and projector 3x.
  EXPECT_DOUBLE_EQ(w.encoder_per_item[0],
                   2 * encoder_front_forward_flops(e) +
                       3 * static_cast<double>(e.layers_used()) * encoder_block_forward_flops(e) +
                       3 * projector_forward_flops(e, s.model.llm));
  SampleShape shape;
  shape.tokens = 100;
  shape.items = {3};
  shape.sum_sq_doc_len = 60 * 60 + 40 * 40;
  shape.targets = 30;
  const SampleWork work = w.work(shape);
  EXPECT_DOUBLE_EQ(work.encoder[0], 3 * w.encoder_per_item[0]);
  EXPECT_DOUBLE_EQ(work.llm, 3 * llm_forward_flops(s.model.llm, {100, 30, 60 * 60 + 40 * 40}));
  // Defaults: one document, a loss on every token; no items.
  SampleShape text;
  text.tokens = 100;
  const SampleWork t = w.work(text);
  EXPECT_EQ(t.encoder, std::vector<double>{0.0});
  EXPECT_DOUBLE_EQ(t.llm, 3 * llm_forward_flops(s.model.llm, {100, 100, 100.0 * 100}));
  EXPECT_FALSE(w.cost.concurrent);
  EXPECT_EQ(w.cost(work), work.encoder[0] + work.llm);

  SampleShape bad = shape;
  bad.items = {1, 1};
  EXPECT_THROW(w.work(bad), Error);
  bad.items = {-1};
  EXPECT_THROW(w.work(bad, "data.jsonl:7"), Error);
  try {
    w.work(bad, "data.jsonl:7");
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("data.jsonl:7"), std::string::npos) << err.what();
  }
}

TEST(Balance, WorkModelIsFrozenAware) {
  Spec s = vlm_spec();
  s.model.encoders[0].frozen = true;  // its projector trains
  s.model.llm.frozen = true;          // forward + input grads (the projector upstream trains)
  const EncoderSpec& e = s.model.encoders[0];
  WorkModel w = make_work_model(s, make_plan(s));
  EXPECT_DOUBLE_EQ(w.encoder_per_item[0],
                   encoder_forward_flops(e) + 2 * projector_forward_flops(e, s.model.llm));
  SampleShape shape;
  shape.tokens = 64;
  EXPECT_DOUBLE_EQ(w.work(shape).llm, 2 * llm_forward_flops(s.model.llm, {64, 64, 64.0 * 64}));
  s.model.encoders[0].projector.frozen = true;  // nothing trains: forward only everywhere
  w = make_work_model(s, make_plan(s));
  EXPECT_DOUBLE_EQ(w.encoder_per_item[0],
                   encoder_forward_flops(e) + projector_forward_flops(e, s.model.llm));
  EXPECT_DOUBLE_EQ(w.work(shape).llm, llm_forward_flops(s.model.llm, {64, 64, 64.0 * 64}));
}

TEST(Balance, SeparatePlacementTakesTheSlowerModule) {
  Spec s = vlm_spec();
  s.parallel.placement = "separate";
  s.parallel.modules["vision"].dp = 1;  // 1 rank
  s.parallel.modules["llm"].dp = 2;     // 2 ranks
  const WorkModel w = make_work_model(s, make_plan(s, 3));
  EXPECT_TRUE(w.cost.concurrent);
  ASSERT_EQ(w.cost.encoder_weight.size(), 1u);
  EXPECT_EQ(w.cost.encoder_weight[0], 2.0);  // llm ranks / encoder ranks
  SampleWork x{{5.0}, 7.0};
  EXPECT_EQ(w.cost(x), 10.0);
  x.llm = 11;
  EXPECT_EQ(w.cost(x), 11.0);
}

TEST(Balance, PolicyNames) {
  EXPECT_EQ(parse_balance_policy("in_order"), BalancePolicy::kInOrder);
  EXPECT_EQ(parse_balance_policy("balanced"), BalancePolicy::kBalanced);
  EXPECT_STREQ(to_string(BalancePolicy::kBalanced), "balanced");
  EXPECT_THROW(parse_balance_policy("lpt"), Error);
}

// A skewed multimodal mix: text-only, one image, several images; lengths spread over 50..3000.
std::vector<SampleWork> random_batch(std::mt19937_64& rng, const WorkModel& w, int64_t n) {
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<SampleWork> out;
  for (int64_t i = 0; i < n; ++i) {
    const double r = u(rng);
    SampleShape s;
    const int64_t images = r < 0.35 ? 0 : r < 0.8 ? 1 : 2 + static_cast<int64_t>(u(rng) * 6);
    s.items = {images};
    s.tokens = images * 576 + static_cast<int64_t>(50 * std::pow(60.0, u(rng)));
    out.push_back(w.work(s));
  }
  return out;
}

void expect_shape(const BatchBalance& b, int64_t n, int64_t D, int64_t M) {
  ASSERT_EQ(static_cast<int64_t>(b.assignment.size()), D);
  std::vector<int> seen(static_cast<size_t>(n), 0);
  for (const auto& replica : b.assignment) {
    ASSERT_EQ(static_cast<int64_t>(replica.size()), M);
    int64_t count = 0, lo = n, hi = 0;
    for (const auto& mb : replica) {
      EXPECT_TRUE(std::is_sorted(mb.begin(), mb.end()));
      count += static_cast<int64_t>(mb.size());
      lo = std::min<int64_t>(lo, static_cast<int64_t>(mb.size()));
      hi = std::max<int64_t>(hi, static_cast<int64_t>(mb.size()));
      for (int64_t s : mb) ++seen[static_cast<size_t>(s)];
    }
    EXPECT_EQ(count, n / D);
    EXPECT_LE(hi - lo, 1);
    EXPECT_GE(lo, 1);
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
}

TEST(Balance, InOrderIsWhatWeftDidBefore) {
  std::vector<SampleWork> samples(14, SampleWork{{1.0}, 1.0});
  BalanceOptions o;
  o.replicas = 2, o.microbatches = 3, o.policy = BalancePolicy::kInOrder;
  const BatchBalance b = balance_batch(samples, BalanceCost{}, o);
  using V = std::vector<int64_t>;
  EXPECT_EQ(b.assignment[0], (std::vector<V>{{0, 1, 2}, {3, 4}, {5, 6}}));
  EXPECT_EQ(b.assignment[1], (std::vector<V>{{7, 8, 9}, {10, 11}, {12, 13}}));
  EXPECT_EQ(b.policy, BalancePolicy::kInOrder);
}

TEST(Balance, BalancedNeverLosesToInOrderOnRandomBatches) {
  const Spec spec = llava_spec();
  const WorkModel w = make_work_model(spec, make_plan(spec));
  std::mt19937_64 rng(7);
  double ratio_sum = 0;
  int fallbacks = 0;
  const int kTrials = 500;
  for (int t = 0; t < kTrials; ++t) {
    const int64_t D = int64_t{1} << (t % 4), M = 1 + t % 7;
    const int64_t per_replica = M * (1 + t % 3) + t % 2;  // not always a multiple of M
    const int64_t n = D * per_replica;
    const std::vector<SampleWork> samples = random_batch(rng, w, n);
    BalanceOptions o;
    o.replicas = D, o.microbatches = M, o.pipeline_stages = 1 + t % 4;
    o.policy = BalancePolicy::kInOrder;
    const BatchBalance base = balance_batch(samples, w.cost, o);
    o.policy = BalancePolicy::kBalanced;
    const BatchBalance b = balance_batch(samples, w.cost, o);
    expect_shape(b, n, D, M);
    expect_shape(base, n, D, M);
    ASSERT_LE(b.max_microbatch_cost(), base.max_microbatch_cost()) << "trial " << t;
    ratio_sum += b.max_microbatch_cost() / base.max_microbatch_cost();
    fallbacks += b.in_order_fallback;
    // Deterministic.
    const BatchBalance again = balance_batch(samples, w.cost, o);
    ASSERT_EQ(again.assignment, b.assignment);
  }
  const double mean_ratio = ratio_sum / kTrials;
  std::printf("balanced / in_order max microbatch cost: mean %.3f, %d fallbacks in %d\n",
              mean_ratio, fallbacks, kTrials);
  EXPECT_LT(mean_ratio, 0.85);
}

TEST(Balance, ImageHeavySamplesAreSplitUp) {
  // Two image-heavy samples first, then two text samples with the same LLM work: in_order puts
  // both image-heavy ones on replica 0. An LLM-tokens-only cost sees nothing to fix; the combined
  // cost must move them apart.
  const std::vector<SampleWork> samples = {
      {{10.0}, 5.0}, {{10.0}, 5.0}, {{0.0}, 5.0}, {{0.0}, 5.0}};
  BalanceOptions o;
  o.replicas = 2;
  const BatchBalance b = balance_batch(samples, BalanceCost{}, o);
  EXPECT_FALSE(b.in_order_fallback);
  EXPECT_EQ(b.replica_cost, (std::vector<double>{20.0, 20.0}));
  EXPECT_EQ(b.replica_work[0].encoder[0], 10.0);
  EXPECT_EQ(b.replica_work[1].encoder[0], 10.0);

  BalanceCost llm_only;
  llm_only.encoder_weight = {0.0};
  const BatchBalance l = balance_batch(samples, llm_only, o);
  EXPECT_TRUE(l.in_order_fallback);
  const BatchBalance priced = evaluate_assignment(samples, BalanceCost{}, l.assignment);
  EXPECT_EQ(priced.max_replica_cost(), 30.0);
  std::vector<double> enc;
  for (const auto& r : priced.replica_work) enc.push_back(r.encoder[0]);
  EXPECT_EQ(spread(enc).max_over_mean, 2.0);

  // The same within one replica, across its microbatches; and with separate placement (max).
  o.replicas = 1, o.microbatches = 2;
  const BatchBalance m = balance_batch(samples, BalanceCost{}, o);
  EXPECT_EQ(m.microbatch_cost[0], (std::vector<double>{20.0, 20.0}));
  BalanceCost separate;
  separate.concurrent = true;
  const BatchBalance s = balance_batch(samples, separate, o);
  EXPECT_EQ(s.max_microbatch_cost(), 10.0);  // in_order: max(20, 10) = 20
}

TEST(Balance, TextOnlyModels) {
  // No encoders: only the LLM's work; the two long samples go to different replicas.
  std::vector<SampleWork> samples = {{{}, 9}, {{}, 9}, {{}, 1}, {{}, 1}, {{}, 1}, {{}, 1}};
  BalanceOptions o;
  o.replicas = 2;
  const BatchBalance b = balance_batch(samples, BalanceCost{}, o);
  expect_shape(b, 6, 2, 1);
  EXPECT_FALSE(b.in_order_fallback);
  EXPECT_EQ(b.replica_cost, (std::vector<double>{11.0, 11.0}));  // in_order: 19 and 3
  EXPECT_EQ(balance_json(b)["microbatch_spread"].size(), 3u);    // combined, llm, encoder
}

TEST(Balance, RejectsBadShapes) {
  std::vector<SampleWork> samples(6, SampleWork{{1.0}, 1.0});
  BalanceOptions o;
  o.replicas = 4;  // 6 % 4 != 0
  EXPECT_THROW(balance_batch(samples, BalanceCost{}, o), Error);
  o.replicas = 2, o.microbatches = 4;  // 3 samples per replica, 4 microbatches
  EXPECT_THROW(balance_batch(samples, BalanceCost{}, o), Error);
  o.microbatches = 3;
  samples[2].llm = -1;
  EXPECT_THROW(balance_batch(samples, BalanceCost{}, o), Error);
  samples[2] = SampleWork{{1.0, 2.0}, 1.0};  // encoder count differs
  EXPECT_THROW(balance_batch(samples, BalanceCost{}, o), Error);
  samples[2] = SampleWork{{1.0}, 1.0};
  EXPECT_THROW(evaluate_assignment(samples, BalanceCost{}, {{{0, 1, 2}, {2, 3, 4, 5}}}), Error);
  EXPECT_THROW(evaluate_assignment(samples, BalanceCost{}, {{{0, 1, 2}, {3, 4}}}), Error);
}

TEST(Balance, JsonReportsSpreads) {
  const std::vector<SampleWork> samples = {
      {{10.0}, 5.0}, {{10.0}, 5.0}, {{0.0}, 5.0}, {{0.0}, 5.0}};
  BalanceOptions o;
  o.replicas = 2;
  const nlohmann::ordered_json j = balance_json(balance_batch(samples, BalanceCost{}, o), {"vit"});
  EXPECT_EQ(j["policy"], "balanced");
  EXPECT_EQ(j["replica_count"], 2);
  EXPECT_EQ(j["objective"], 20.0);
  EXPECT_EQ(j["replica_spread"]["vit"]["max_over_mean"], 1.0);
  EXPECT_EQ(j["replica_spread"]["combined"]["cv"], 0.0);
  EXPECT_EQ(j["replicas"][0]["microbatches"][0]["samples"].size(), 2u);
}

TEST(Balance, SpreadIsMaxOverMeanAndCv) {
  const Spread s = spread({1, 2, 3, 6});
  EXPECT_DOUBLE_EQ(s.max_over_mean, 2.0);
  EXPECT_DOUBLE_EQ(s.cv, std::sqrt((4.0 + 1 + 0 + 9) / 4) / 3);
  EXPECT_EQ(spread({}).max_over_mean, 1.0);
  EXPECT_EQ(spread({0, 0}).cv, 0.0);
}

// --- 1F1B
// -----------------------------------------------------------------------------------------

TEST(OneFOneB, UniformMicrobatchesGiveTheClosedForm) {
  // Per stage a microbatch takes c/P; the first forward reaches the last stage after (P−1)
  // forwards, the last stage then works without a gap for m·c/P, and the last backward needs
  // (P−1) more backwards to drain: (P−1)(f+b) + m(f+b) = (m + P − 1)·c/P. Exact in binary
  // fractions.
  for (int64_t P = 1; P <= 6; ++P)
    for (int64_t m = 1; m <= 10; ++m) {
      const double c = 8.0 * static_cast<double>(P);  // f + b = 8 per stage
      const std::vector<double> cost(static_cast<size_t>(m), c);
      for (double ff : {0.25, 0.5, 0.125})
        EXPECT_EQ(one_f_one_b_makespan(cost, P, ff), 8.0 * static_cast<double>(m + P - 1))
            << "P=" << P << " m=" << m << " ff=" << ff;
      EXPECT_NEAR(one_f_one_b_makespan(cost, P), 8.0 * static_cast<double>(m + P - 1), 1e-9);
    }
  EXPECT_EQ(one_f_one_b_makespan({}, 4), 0.0);
}

// Interleaved (vp chunks per rank, P·vp virtual stages of c/(P·vp) each): the fill and drain
// shrink vp-fold, (m + (P − 1)/vp)·c/P, for any m >= P (the runtime's pipeline_schedule order);
// with every chunk equal it matches the simulator's textbook bubble.
TEST(OneFOneB, InterleavedMakespanIsTextbook) {
  for (int64_t P = 2; P <= 5; ++P)
    for (int64_t vp = 2; vp <= 4; ++vp)
      for (int64_t m = P; m <= 11; ++m) {
        const double c = 8.0 * static_cast<double>(P * vp);  // f + b = 8 per virtual stage
        const std::vector<double> cost(static_cast<size_t>(m), c);
        EXPECT_NEAR(one_f_one_b_makespan(cost, P, 0.25, vp),
                    8.0 * static_cast<double>(m * vp + P - 1), 1e-9)
            << "P=" << P << " vp=" << vp << " m=" << m;
      }
  EXPECT_THROW(one_f_one_b_makespan({1, 1}, 1, 0.25, 2), Error);  // vp needs P > 1
  // Balancing orders each replica's microbatches by the interleaved makespan: never worse than
  // in order.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(0, 1);
  for (int t = 0; t < 40; ++t) {
    const int64_t P = 2 + t % 3, vp = 2 + t % 2, m = P + t % 7;
    std::vector<double> cost;
    for (int64_t i = 0; i < m; ++i) cost.push_back(u(rng) < 0.3 ? 1 + 9 * u(rng) : 1 + u(rng));
    const std::vector<int64_t> order = order_for_1f1b(cost, P, 1.0 / 3, vp);
    std::vector<double> reordered;
    for (int64_t i : order) reordered.push_back(cost[static_cast<size_t>(i)]);
    EXPECT_LE(one_f_one_b_makespan(reordered, P, 1.0 / 3, vp),
              one_f_one_b_makespan(cost, P, 1.0 / 3, vp))
        << "trial " << t;
  }
}

TEST(OneFOneB, HandWorkedCases) {
  // P = 2, f = b = c/4: mb0 takes 0.5 + 0.5 per stage, mb1 1 + 1.
  //   s0: F0 [0, .5]  F1 [.5, 1.5]               B0 [1.5, 2]      B1 [3.5, 4.5]
  //   s1:     F0 [.5, 1]  B0 [1, 1.5]  F1 [1.5, 2.5]  B1 [2.5, 3.5]
  EXPECT_EQ(one_f_one_b_makespan({2, 4}, 2, 0.5), 4.5);
  // One stage: sequential.
  EXPECT_EQ(one_f_one_b_makespan({1, 2, 3.5}, 1), 6.5);
  // P = 4, m = 2 < P (uniform 1 + 1 per stage): (2 + 4 − 1)·2 = 10.
  EXPECT_EQ(one_f_one_b_makespan({8, 8}, 4, 0.5), 10.0);
  EXPECT_THROW(one_f_one_b_makespan({1, -1}, 2), Error);
  EXPECT_THROW(one_f_one_b_makespan({1}, 0), Error);
}

TEST(OneFOneB, ReorderingMovesTheHeavyMicrobatchIntoTheSteadyPhase) {
  const std::vector<double> cost = {8, 1, 1, 1, 1, 1, 1, 1};
  const std::vector<int64_t> order = order_for_1f1b(cost, 4);
  ASSERT_EQ(order.size(), cost.size());
  EXPECT_NE(order.front(), 0);
  EXPECT_NE(order.back(), 0);
  std::vector<double> reordered;
  for (int64_t i : order) reordered.push_back(cost[static_cast<size_t>(i)]);
  EXPECT_LT(one_f_one_b_makespan(reordered, 4), one_f_one_b_makespan(cost, 4));
}

std::vector<double> permuted(const std::vector<double>& c, const std::vector<int64_t>& order) {
  std::vector<double> out;
  for (int64_t i : order) out.push_back(c[static_cast<size_t>(i)]);
  return out;
}

TEST(OneFOneB, ReorderingNeverHurtsAndIsNearTheOptimum) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(0, 1);
  int optimal = 0, small = 0;
  double gap_sum = 0;
  for (int t = 0; t < 300; ++t) {
    const int64_t P = 2 + t % 5, m = 1 + t % 12;
    std::vector<double> cost;
    for (int64_t i = 0; i < m; ++i) cost.push_back(u(rng) < 0.3 ? 1 + 9 * u(rng) : 1 + u(rng));
    const std::vector<int64_t> order = order_for_1f1b(cost, P);
    std::vector<int64_t> sorted(order);
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> ids(static_cast<size_t>(m));
    std::iota(ids.begin(), ids.end(), 0);
    ASSERT_EQ(sorted, ids);
    const double mine = one_f_one_b_makespan(permuted(cost, order), P);
    ASSERT_LE(mine, one_f_one_b_makespan(cost, P)) << "trial " << t;
    if (m > 7) continue;
    double best = mine;  // brute force over every order
    do best = std::min(best, one_f_one_b_makespan(permuted(cost, ids), P));
    while (std::next_permutation(ids.begin(), ids.end()));
    ASSERT_GE(mine, best * (1 - 1e-12));
    ++small, gap_sum += mine / best - 1;
    optimal += mine <= best * (1 + 1e-12);
  }
  std::printf("reordering: optimal in %d of %d small cases, mean gap %.5f\n", optimal, small,
              gap_sum / small);
  EXPECT_GE(optimal, small * 3 / 4);
  EXPECT_LT(gap_sum / small, 0.01);
}

}  // namespace
}  // namespace weft::plan

namespace weft::plan {
namespace {

TEST(Workload, MixesAreDeterministicAndShapedAsDocumented) {
  const Spec spec = testing::vlm_spec();
  const int64_t per_item = spec.model.encoders[0].tokens_per_item();
  const auto a = sample_workload("llava", spec, 10000, 3);
  const auto b = sample_workload("llava", spec, 10000, 3);
  int64_t text_only = 0, hires = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens);
    ASSERT_EQ(a[i].items.size(), 1u);
    EXPECT_EQ(a[i].tokens, a[i].items[0] * per_item + a[i].targets);
    EXPECT_GE(a[i].targets, 64);
    text_only += a[i].items[0] == 0;
    hires += a[i].items[0] == 5;
  }
  EXPECT_NEAR(text_only / 10000.0, 0.25, 0.02);
  EXPECT_NEAR(hires / 10000.0, 0.08, 0.015);
  for (const auto& s : sample_workload("video", spec, 200, 1))
    EXPECT_TRUE(s.items[0] == 0 || s.items[0] == 1 || s.items[0] == 8);
  EXPECT_THROW(sample_workload("podcasts", spec, 1, 0), Error);
}

}  // namespace
}  // namespace weft::plan
