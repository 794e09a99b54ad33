// The layout search against brute force: on spaces small enough to simulate every candidate, the
// analytic bound is a true lower bound of the simulated step (and the analytic memory of the
// simulated peak), branch and bound finds the simulator's optimum, the memory filter keeps the
// plan within the device when the fastest layout does not fit, and the result is no slower than
// the fixed baselines. Also: recomputation pricing, and the config the search writes reproduces
// its plan.
#include "weft/plan/search.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "support/errors.h"
#include "support/plan_profiles.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/profile.h"
#include "weft/plan/search_space.h"
#include "weft/plan/simulate.h"

namespace weft::plan {
namespace {

// A ~1B-parameter LLM behind a ViT-B-like encoder: big enough that tensor, pipeline and data
// parallelism trade off on H100s, small enough to simulate every layout of 8-16 GPUs.
Spec small_vlm(bool frozen_vision = false) {
  Spec s = parse_spec(R"(
[model.llm]
vocab = 32000
hidden = 2048
layers = 8
heads = 16
kv_heads = 8
ffn = 5632
max_seq = 1024
tie_embeddings = false

[model.vision]
kind = "vit"
hidden = 768
layers = 6
heads = 12
ffn = 3072
image_size = 224
patch = 16

[train]
batch = 32
)",
                      "small.toml");
  s.model.encoders[0].frozen = frozen_vision;
  return s;
}

// `nodes` × 8 H100s: NVLink inside a node, 50 GB/s per GPU between nodes.
Cluster h100(int64_t nodes, double memory_gib = 80) {
  return parse_cluster("nodes = " + std::to_string(nodes) +
                           "\ngpus_per_node = 8\n[device]\nbase = \"h100\"\nmemory_gib = " +
                           std::to_string(memory_gib) +
                           "\n[intra_node]\nbandwidth_gbs = 450\nlatency_us = 3\n"
                           "[inter_node]\nbandwidth_gbs = 50\nlatency_us = 8\n",
                       "h100.toml");
}

// A space small enough to simulate exhaustively.
SearchOptions small_space() {
  SearchOptions o;
  o.max_pp = 4;
  o.max_encoder_pp = 2;
  o.max_cp = 2;
  o.max_microbatches = 8;
  o.top = 3;
  o.max_simulations = 100000;
  o.time_budget_seconds = 1e9;
  o.gap = 0;  // the exact optimum, to compare with brute force
  return o;
}

double peak_memory(const SimResult& r) {
  double peak = 0;
  for (const RankReport& k : r.ranks) peak = std::max(peak, k.peak_memory_bytes);
  return peak;
}

// One H100 node with `fraction` of the memory the smallest peak of any layout of the space `o`
// needs without recomputation: layouts must recompute to fit.
Cluster tight_node(const Spec& spec, SearchOptions o, double fraction) {
  o.recompute = false;
  double least = 1e30;
  for (const BoundedCandidate& b : enumerate_candidates(spec, h100(1, 1000), o))
    least = std::min(least, peak_memory(evaluate(spec, h100(1, 1000), b.candidate).sim));
  return h100(1, least * fraction / (1024.0 * 1024 * 1024));
}

// Simulates every candidate: checks the bound (its own and those of the search nodes above it)
// and the analytic memory against the simulator and returns the fastest candidate that fits.
Evaluation brute_force(const Spec& spec, const Cluster& cluster, const SearchOptions& o,
                       int64_t* count) {
  const std::vector<BoundedCandidate> all = enumerate_candidates(spec, cluster, o);
  Evaluation best;
  best.sim.step_seconds = 1e30;
  *count = 0;
  for (const BoundedCandidate& b : all) {
    const Evaluation e = evaluate(spec, cluster, b.candidate, o.sim, o.profile);
    ++*count;
    const std::string what = describe(spec, b.candidate);
    EXPECT_LE(b.lower_bound, e.sim.step_seconds * (1 + 1e-9)) << what;
    for (size_t k = 0; k < b.ancestor_bounds.size(); ++k) {
      EXPECT_LE(b.ancestor_bounds[k], e.sim.step_seconds * (1 + 1e-9))
          << what << " (the bound of its search node at depth " << k << ")";
      EXPECT_LE(b.ancestor_memory[k], peak_memory(e.sim) * (1 + 1e-9) + 1)
          << what << " (the memory of its search node at depth " << k << ")";
    }
    EXPECT_LE(b.memory_bytes, peak_memory(e.sim) * (1 + 1e-9) + 1) << what;
    if (!b.fits_memory) {
      EXPECT_FALSE(e.sim.memory_fits) << what;
    }
    if (e.sim.memory_fits && e.sim.step_seconds < best.sim.step_seconds) best = e;
  }
  return best;
}

TEST(Search, BoundIsALowerBoundAndPruningKeepsTheOptimum) {
  struct Case {
    const char* name;
    Spec spec;
    int64_t nodes;
    bool interleaved;
  };
  const Case cases[] = {{"trainable vision, 8 GPUs", small_vlm(), 1, false},
                        {"frozen vision, 16 GPUs on 2 nodes", small_vlm(true), 2, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Cluster cluster = h100(c.nodes);
    SearchOptions o = small_space();
    int64_t count = 0;
    const Evaluation best = brute_force(c.spec, cluster, o, &count);
    // The space includes interleaved 1F1B; on two nodes its optimum is interleaved (pp2 vp2).
    EXPECT_EQ(best.candidate.layouts.back().vp > 1, c.interleaved)
        << describe(c.spec, best.candidate);
    ASSERT_GT(count, 500) << "the space should be large enough to prune";
    const SearchResult r = search(c.spec, cluster, o);
    ASSERT_FALSE(r.best.empty());
    EXPECT_TRUE(r.stats.complete);
    EXPECT_NEAR(r.best.front().sim.step_seconds, best.sim.step_seconds,
                1e-12 * best.sim.step_seconds)
        << "search: " << describe(c.spec, r.best.front().candidate)
        << "\nbrute force: " << describe(c.spec, best.candidate);
    EXPECT_LT(r.stats.simulated * 5, count) << "branch and bound should simulate far fewer";
    // With an optimality gap it simulates no more, and its winner is within the gap.
    SearchOptions g = o;
    g.gap = 0.02;
    const SearchResult within = search(c.spec, cluster, g);
    EXPECT_TRUE(within.stats.complete);
    EXPECT_LE(within.best.front().sim.step_seconds, best.sim.step_seconds * 1.02);
    EXPECT_LE(within.stats.simulated, r.stats.simulated);
    for (size_t i = 1; i < r.best.size(); ++i)
      EXPECT_LE(r.best[i - 1].sim.step_seconds, r.best[i].sim.step_seconds);
    EXPECT_FALSE(r.why.empty());
  }
}

// Candidates are simulated in batches on several threads: the threads change nothing, and a
// batch of one (each candidate pruned against every simulation before it) finds the same
// optimum.
TEST(Search, BatchedSimulationDoesNotDependOnTheThreads) {
  const Spec spec = small_vlm(true);
  const Cluster cluster = h100(2);
  SearchOptions o = small_space();
  o.batch = 3;
  o.threads = 1;
  const SearchResult one = search(spec, cluster, o);
  o.threads = 3;
  const SearchResult three = search(spec, cluster, o);
  ASSERT_TRUE(one.stats.complete);
  ASSERT_TRUE(three.stats.complete);
  EXPECT_EQ(one.stats.simulated, three.stats.simulated);
  EXPECT_EQ(one.stats.nodes, three.stats.nodes);
  ASSERT_EQ(one.best.size(), three.best.size());
  for (size_t i = 0; i < one.best.size(); ++i) {
    EXPECT_EQ(describe(spec, one.best[i].candidate), describe(spec, three.best[i].candidate));
    EXPECT_EQ(one.best[i].sim.step_seconds, three.best[i].sim.step_seconds);
    EXPECT_EQ(one.best[i].lower_bound, three.best[i].lower_bound);
  }
  EXPECT_GT(one.stats.simulated, o.batch) << "more than one batch";
  o.batch = 1;
  const SearchResult serial = search(spec, cluster, o);
  ASSERT_TRUE(serial.stats.complete);
  EXPECT_EQ(serial.best.front().sim.step_seconds, one.best.front().sim.step_seconds);
  o.batch = 0;
  EXPECT_THROW(search(spec, cluster, o), Error);
}

TEST(Search, BoundHoldsForTheMegatronBaseline) {
  const Spec spec = small_vlm();
  const Cluster cluster = h100(2);
  SearchOptions o = small_space();
  o.placements = {"megatron"};
  int64_t count = 0;
  brute_force(spec, cluster, o, &count);  // bound and memory checks inside
  EXPECT_GT(count, 100);
}

// A per-block overhead (kernel launches, dispatch): the bound still holds, the search still finds
// brute force's optimum, and it takes fewer, larger microbatches than without (there: LLM pp2
// vp2 over 4 microbatches; with 2 ms per block: LLM tp2, one microbatch).
TEST(Search, BoundHoldsWithBlockOverhead) {
  const Spec spec = small_vlm(true);
  Cluster cluster = h100(2);  // the optimum pipelines the LLM (pp2 vp2) over 4 microbatches
  SearchOptions o = small_space();
  const int64_t without = search(spec, cluster, o).best.front().candidate.microbatches;
  cluster.device.block_overhead_seconds = 2e-3;
  int64_t count = 0;
  const Evaluation best = brute_force(spec, cluster, o, &count);
  const SearchResult r = search(spec, cluster, o);
  EXPECT_NEAR(r.best.front().sim.step_seconds, best.sim.step_seconds,
              1e-12 * best.sim.step_seconds);
  EXPECT_LT(r.best.front().candidate.microbatches, without)
      << describe(spec, r.best.front().candidate);
}

// Blocking collectives through shared memory on each node (cluster.h; here cheaper than the
// node's link, and nothing hidden behind the column-parallel matmuls): the bound and the memory
// bound still hold over every candidate, with groups on one node and across two, and the search
// finds brute force's optimum.
TEST(Search, BoundHoldsThroughSharedMemory) {
  const Spec spec = small_vlm();
  Cluster cluster = h100(2);
  cluster.shared_memory = {900e9, 1e-6};
  SearchOptions o = small_space();
  int64_t count = 0;
  const Evaluation best = brute_force(spec, cluster, o, &count);
  EXPECT_GT(count, 500);
  const SearchResult r = search(spec, cluster, o);
  ASSERT_FALSE(r.best.empty());
  EXPECT_NEAR(r.best.front().sim.step_seconds, best.sim.step_seconds,
              1e-12 * best.sim.step_seconds);
  // Its TP collectives cost less than over NVLink: the optimum is no slower than without.
  EXPECT_LE(best.sim.step_seconds, search(spec, h100(2), o).best.front().sim.step_seconds);
}

// Priced on the data's mean sample (SimOptions::data) — rows a quarter of max_seq, a third of
// them loss targets, and four images each; activation memory on a peak of full rows and six
// images — the bound and the memory bound still hold over every candidate, the search finds
// brute force's optimum, and that optimum is another layout than the full rows' one, which is
// slower on this data.
TEST(Search, PricesTheDataShape) {
  const Spec spec = small_vlm();
  const Cluster cluster = h100(1);
  SearchOptions o = small_space();
  const Candidate full_rows = search(spec, cluster, o).best.front().candidate;
  DataShape& d = o.sim.data;
  d.positions = 256;
  d.tokens = 240;
  d.targets = 80;
  d.sum_sq_doc_len = 240.0 * 240.0;
  d.items = {4};
  d.peak_positions = 1024;  // activation memory: a microbatch padded to a full row
  d.peak_targets = 600;
  d.peak_items = {6};
  check_data_shape(spec, d, "test");
  int64_t count = 0;
  const Evaluation best = brute_force(spec, cluster, o, &count);
  const SearchResult r = search(spec, cluster, o);
  ASSERT_TRUE(r.stats.complete);
  EXPECT_NEAR(r.best.front().sim.step_seconds, best.sim.step_seconds, 1e-12 * best.sim.step_seconds)
      << "search: " << describe(spec, r.best.front().candidate)
      << "\nbrute force: " << describe(spec, best.candidate);
  EXPECT_DOUBLE_EQ(r.best.front().sim.tokens_per_step, 256.0 * spec.train.batch);
  EXPECT_NE(describe(spec, best.candidate), describe(spec, full_rows))
      << "the data's shape should move the optimum";
  EXPECT_GT(evaluate(spec, cluster, full_rows, o.sim).sim.step_seconds,
            best.sim.step_seconds * 1.05)
      << "full rows' choice: " << describe(spec, full_rows);
}

// The time budget stops the search once it has a plan that fits, not before: a budget spent
// before the first simulation (a slow or busy machine) still gets the first batch's best.
TEST(Search, TimeBudgetStopsOnceAPlanFits) {
  const Spec spec = small_vlm();
  SearchOptions o = small_space();
  o.time_budget_seconds = 1e-9;
  const SearchResult r = search(spec, h100(2), o);
  ASSERT_FALSE(r.best.empty());
  EXPECT_GE(r.stats.simulated, 1);
  EXPECT_LE(r.stats.simulated, o.batch);
}

// A data shape that does not fit the model is refused, naming where it came from and the field.
TEST(Search, RejectsABadDataShape) {
  const Spec spec = small_vlm();
  DataShape d;
  d.positions = 100;
  d.targets = 50;
  d.items = {1};
  check_data_shape(spec, d, "data.json");
  DataShape more = d;
  more.targets = 101;
  const std::string targets = testing::error_of([&] { check_data_shape(spec, more, "data.json"); });
  EXPECT_NE(targets.find("data.json"), std::string::npos) << targets;
  EXPECT_NE(targets.find("targets"), std::string::npos) << targets;
  DataShape two = d;
  two.items = {1, 1};
  const std::string items = testing::error_of([&] { check_data_shape(spec, two, "data.json"); });
  EXPECT_NE(items.find("2 item counts for the model's 1 encoders"), std::string::npos) << items;
  DataShape negative = d;
  negative.items = {-1};
  const std::string vision =
      testing::error_of([&] { check_data_shape(spec, negative, "data.json"); });
  EXPECT_NE(vision.find("encoder 'vision'"), std::string::npos) << vision;
  DataShape low = d;  // a peak below the mean
  low.peak_positions = 50;
  low.peak_targets = 10;
  low.peak_items = {1};
  const std::string peak = testing::error_of([&] { check_data_shape(spec, low, "data.json"); });
  EXPECT_NE(peak.find("the peak sample (50 positions"), std::string::npos) << peak;
  // The search and the simulator check the shape they are given.
  SearchOptions o;
  o.sim.data = two;
  const std::string searched = testing::error_of([&] { search(spec, h100(1), o); });
  EXPECT_NE(searched.find("2 item counts"), std::string::npos) << searched;
}

TEST(Search, MemoryFilterRejectsTheFastestLayoutWhenItDoesNotFit) {
  const Spec spec = small_vlm();
  SearchOptions o = small_space();
  o.zero = false;
  o.recompute = false;
  const SearchResult roomy = search(spec, h100(1, 1000), o);
  const Evaluation& fastest = roomy.best.front();
  const double need = peak_memory(fastest.sim);
  // A device just too small for the unconstrained optimum.
  const double gib = need * 0.95 / (1024.0 * 1024 * 1024);
  const Cluster tight = h100(1, gib);
  const SearchResult r = search(spec, tight, o);
  const Evaluation& win = r.best.front();
  EXPECT_TRUE(win.sim.memory_fits);
  EXPECT_LE(peak_memory(win.sim), tight.device.memory_bytes);
  EXPECT_GT(win.sim.step_seconds, fastest.sim.step_seconds);
  EXPECT_GT(r.stats.memory_filtered + r.stats.simulated_over_memory, 0);
  ASSERT_EQ(r.over_memory.size(), 1u) << "the faster layout that does not fit is reported";
  EXPECT_LT(r.over_memory.front().sim.step_seconds, win.sim.step_seconds);
  EXPECT_NE(r.why.find("over memory"), std::string::npos) << r.why;
  // Memory the device keeps for itself ([device] reserved_gib) is memory plans cannot use: the
  // roomy optimum with the same shortfall reserved is the tight device's plan, and so is its
  // simulated verdict.
  Cluster reserved = h100(1, need * 1.0001 / (1024.0 * 1024 * 1024));
  reserved.device.reserved_bytes = need * 0.0501;
  EXPECT_FALSE(evaluate(spec, reserved, fastest.candidate).sim.memory_fits);
  const SearchResult rr = search(spec, reserved, o);
  EXPECT_EQ(describe(spec, rr.best.front().candidate), describe(spec, win.candidate));
  EXPECT_NE(rr.why.find("reserved)"), std::string::npos) << rr.why;
  reserved.device.reserved_bytes = 0;
  EXPECT_TRUE(evaluate(spec, reserved, fastest.candidate).sim.memory_fits);
  // Nothing fits a device smaller than the model's parameters: a clear error.
  const std::string err = testing::error_of([&] { search(spec, h100(1, 0.01), o); });
  EXPECT_NE(err.find("small.toml: no layout fits 8 h100 devices"), std::string::npos) << err;
}

// Memory just too small for every layout without recomputation: the search also tries
// recomputing each chunk's first blocks (per pipeline stage the fewest that fit by the memory
// bound, as many on every stage, and halfway from those to every block); the bound holds for
// those candidates too, and branch and bound still finds the brute-force optimum, which the
// simulator's refinement (refine_recompute) then makes faster still, per stage: each count it
// leaves is the fewest that fits, and some module's stages recompute different counts.
TEST(Search, PartialRecomputationWhereMemoryIsTight) {
  const Spec spec = small_vlm();
  SearchOptions o = small_space();
  o.zero = false;
  const Cluster tight = tight_node(spec, o, 0.98);
  o.recompute = o.partial_recompute = true;
  int64_t count = 0;
  const Evaluation brute = brute_force(spec, tight, o, &count);
  const SearchResult partial = search(spec, tight, o);
  o.partial_recompute = false;
  int64_t whole_count = 0;
  const Evaluation whole = brute_force(spec, tight, o, &whole_count);
  EXPECT_GT(count, whole_count);  // the partial candidates
  EXPECT_LT(brute.sim.step_seconds, whole.sim.step_seconds);
  const Evaluation& win = partial.best.front();
  const Evaluation refined = refine_recompute(spec, tight, brute);
  EXPECT_LT(refined.sim.step_seconds, brute.sim.step_seconds);
  EXPECT_LE(win.sim.step_seconds, refined.sim.step_seconds * (1 + 1e-9));
  EXPECT_TRUE(win.sim.memory_fits);
  const std::string what = describe(spec, win.candidate);
  bool uneven = false;
  const Candidate& c = win.candidate;
  for (size_t k = 0; k < c.recompute.size(); ++k) {
    if (!c.recompute[k] || c.recompute_blocks[k].empty()) continue;
    const std::vector<int64_t>& v = c.recompute_blocks[k];
    uneven =
        uneven || *std::min_element(v.begin(), v.end()) < *std::max_element(v.begin(), v.end());
    for (size_t s = 0; s < v.size(); ++s) {  // one block fewer on any stage: over memory
      if (v[s] == 0) continue;
      Candidate fewer = c;
      fewer.recompute_blocks[k][s] -= 1;
      if (*std::max_element(fewer.recompute_blocks[k].begin(), fewer.recompute_blocks[k].end()) ==
          0)
        fewer.recompute[k] = false, fewer.recompute_blocks[k].clear();
      EXPECT_FALSE(evaluate(spec, tight, fewer).sim.memory_fits)
          << what << " module " << k << " stage " << s;
    }
  }
  EXPECT_TRUE(uneven) << what;
  EXPECT_NE(what.find("recompute "), std::string::npos) << what;
  // Its config sets the blocks, and reads back to the same plan and step.
  const Spec applied = apply_candidate(spec, win.candidate);
  const std::string snippet = config_snippet(spec, win.candidate);
  EXPECT_NE(snippet.find("recompute_blocks = ["), std::string::npos) << snippet;
  std::printf(
      "tight memory: %s %.4f s; fitted by the bound: %s %.4f s; every block or none: %s "
      "%.4f s\n",
      what.c_str(), win.sim.step_seconds, describe(spec, brute.candidate).c_str(),
      brute.sim.step_seconds, describe(spec, whole.candidate).c_str(), whole.sim.step_seconds);
  EXPECT_NEAR(evaluate(applied, tight, win.candidate).sim.step_seconds, win.sim.step_seconds,
              1e-9 * win.sim.step_seconds);
}

TEST(Search, NoSlowerThanFixedBaselines) {
  for (int64_t nodes : {1, 2}) {
    SCOPED_TRACE(std::to_string(nodes) + " node(s)");
    const Spec spec = small_vlm();
    const Cluster cluster = h100(nodes);
    SearchOptions o;
    o.top = 2;
    o.gap = 0;  // exact optima, to compare
    const SearchResult weft = search(spec, cluster, o);
    const double best = weft.best.front().sim.step_seconds;
    for (const char* placement : {"megatron", "colocated", "separate"}) {
      SearchOptions b = o;
      b.placements = {placement};
      const SearchResult baseline = search(spec, cluster, b);
      EXPECT_LE(best, baseline.best.front().sim.step_seconds * (1 + 1e-12)) << placement;
    }
    // Hand-written layouts: pure data parallelism, and the LLM pipelined over the nodes with the
    // encoder data-parallel, colocated.
    const int64_t world = cluster.world_size();
    Candidate dp;
    dp.world_size = world;
    dp.layouts.resize(2);
    dp.recompute = {false, false};
    dp.layouts[0].dp = dp.layouts[1].dp = world;
    dp.microbatches = 1;
    Candidate pipe = dp;
    pipe.layouts[1].dp = world / (2 * nodes);
    pipe.layouts[1].pp = 2 * nodes;
    pipe.microbatches = 4;
    for (Candidate c : {dp, pipe}) {
      c.layouts[1].stages = candidate_plan(spec, c).modules.back().stage_boundaries;
      const Evaluation e = evaluate(spec, cluster, c);
      if (e.sim.memory_fits) {
        EXPECT_LE(best, e.sim.step_seconds) << describe(spec, c);
      }
    }
  }
}

TEST(Search, RecomputationTradesComputeForActivationMemory) {
  Spec spec = small_vlm();
  Candidate c;
  c.world_size = 2;
  c.layouts.resize(2);
  c.layouts[0].dp = 2;
  c.layouts[1].pp = 2;
  c.layouts[1].stages = {4};
  c.recompute = {false, false};
  c.microbatches = 4;
  const Plan plan = candidate_plan(spec, c);
  const CostTable off = planner_costs(apply_candidate(spec, c), plan);
  Candidate rc = c;
  rc.recompute = {true, true};
  const CostTable on = planner_costs(apply_candidate(spec, rc), plan);
  for (size_t m : {size_t{0}, plan.modules.size() - 1})
    for (size_t s = 0; s < off[m].size(); ++s) {
      EXPECT_GT(on[m][s].backward_flops, off[m][s].backward_flops);
      EXPECT_EQ(on[m][s].forward_flops, off[m][s].forward_flops);
      EXPECT_LT(on[m][s].activation_bytes, off[m][s].activation_bytes / 2);
    }
  // One more forward of every LLM block: backward grows by exactly the blocks' forward FLOPs.
  const StageCost& a = off.back()[0];
  const StageCost& b = on.back()[0];
  EXPECT_NEAR(b.backward_flops - a.backward_flops, a.forward_flops, 1e-6 * a.forward_flops);
  const Cluster cluster = h100(1);
  const Evaluation e_off = evaluate(spec, cluster, c), e_on = evaluate(spec, cluster, rc);
  EXPECT_GT(e_on.sim.step_seconds, e_off.sim.step_seconds);
  EXPECT_LT(peak_memory(e_on.sim), peak_memory(e_off.sim));
}

// Sequence parallelism is searched per module, the LLM's and each encoder's (not in the Megatron
// baseline, whose vision model runs without it), wherever tp > 1; it never raises a candidate's
// analytic memory (what TP ranks keep whole is split) and lowers it somewhere.
TEST(Search, SequenceParallelismIsSearchedPerModuleAndSavesMemory) {
  const Spec spec = small_vlm();
  const std::vector<BoundedCandidate> all = enumerate_candidates(spec, h100(1), small_space());
  std::map<std::string, double> without;  // memory of each candidate without sp
  for (const BoundedCandidate& b : all) {
    bool any = false;
    for (const LayoutSpec& l : b.candidate.layouts) any = any || l.sp;
    if (!any) without[describe(spec, b.candidate)] = b.memory_bytes;
  }
  int64_t llm = 0, encoder = 0, lower = 0;
  for (const BoundedCandidate& b : all) {
    Candidate plain = b.candidate;
    for (LayoutSpec& l : plain.layouts) {
      if (l.sp) {
        EXPECT_GT(l.tp, 1) << describe(spec, b.candidate);
      }
      l.sp = false;
    }
    if (b.candidate.layouts.back().sp) ++llm;
    if (!b.candidate.layouts[0].sp) continue;
    ++encoder;
    EXPECT_NE(b.candidate.placement, "megatron");
    const auto it = without.find(describe(spec, plain));
    ASSERT_NE(it, without.end()) << describe(spec, b.candidate);
    EXPECT_LE(b.memory_bytes, it->second) << describe(spec, b.candidate);
    if (b.memory_bytes < it->second) ++lower;
  }
  EXPECT_GT(llm, 0);
  EXPECT_GT(encoder, 0);
  EXPECT_GT(lower, 0);
}

// The LLM as a mixture of experts: 8 experts of the dense width, top-2, in every block.
Spec moe_vlm() {
  Spec s = small_vlm();
  s.model.llm.moe.experts = 8;
  s.model.llm.moe.top_k = 2;
  return s;
}

TEST(Search, BoundHoldsWithExpertParallelism) {
  const Spec spec = moe_vlm();
  const Cluster cluster = h100(1);
  SearchOptions o = small_space();
  o.max_pp = 2;
  int64_t count = 0;
  const Evaluation best = brute_force(spec, cluster, o, &count);  // bound and memory checks
  // The space has expert layouts of both kinds: ep over the data ranks, and whole experts.
  bool ep = false, whole = false;
  for (const BoundedCandidate& b : enumerate_candidates(spec, cluster, o)) {
    ep = ep || (b.candidate.layouts.back().ep > 1 && b.candidate.layouts.back().etp == 0);
    whole = whole || b.candidate.layouts.back().etp == 1;
  }
  EXPECT_TRUE(ep && whole);
  const SearchResult r = search(spec, cluster, o);
  ASSERT_FALSE(r.best.empty());
  EXPECT_NEAR(r.best.front().sim.step_seconds, best.sim.step_seconds, 1e-12 * best.sim.step_seconds)
      << "search: " << describe(spec, r.best.front().candidate)
      << "\nbrute force: " << describe(spec, best.candidate);
  // Through shared memory (whole experts under SP gather their output in place of a
  // reduce-scatter, priced apart from the all-reduce there): the checks hold too.
  Cluster shm = cluster;
  shm.shared_memory = {900e9, 1e-6};
  brute_force(spec, shm, o, &count);
}

TEST(Search, ExpertParallelismWhenTheExpertsDoNotFitOneDevice) {
  // 2.2B expert parameters (35 GB of weights, gradients and moments) on 24 GiB devices, with
  // only data and expert parallelism allowed: the experts must be split over ep >= 2 ranks.
  const Spec spec = moe_vlm();
  SearchOptions o = small_space();
  o.max_tp = 1, o.max_pp = 1, o.max_cp = 1, o.max_encoder_pp = 1;
  o.zero = o.recompute = false;
  const Cluster tight = h100(1, 24);
  const SearchResult r = search(spec, tight, o);
  const Evaluation& win = r.best.front();
  EXPECT_TRUE(win.sim.memory_fits);
  EXPECT_GE(win.candidate.layouts.back().ep, 2) << describe(spec, win.candidate);
  EXPECT_EQ(win.plan.module("llm").layout.ep, win.candidate.layouts.back().ep);
  o.max_ep = 1;
  const std::string err = testing::error_of([&] { search(spec, tight, o); });
  EXPECT_NE(err.find("no layout fits"), std::string::npos) << err;
}

// Interleaved 1F1B is part of the searched space: on a 72B LLM over 256 GPUs (the scenario
// benchmark's frozen ViT-22B + Qwen2-72B) the winner interleaves, is faster than the best plan
// without it, and its config snippet (the chunks' boundaries explicit) reproduces it.
TEST(Search, InterleavingIsSearched) {
  const Spec spec = load_spec(WEFT_SOURCE_DIR "/configs/scenarios/vit22b-qwen2-72b.toml",
                              {"model.vision.frozen=true"});
  const Cluster cluster = h100(32);
  SearchOptions o;
  o.top = 1;
  o.report_slack = 0;
  o.placements = {"colocated"};
  o.max_simulations = 1000;
  const SearchResult r = search(spec, cluster, o);
  const Evaluation& win = r.best.front();
  const LayoutSpec& llm = win.candidate.layouts.back();
  ASSERT_GT(llm.vp, 1) << describe(spec, win.candidate);
  EXPECT_EQ(win.plan.module("llm").layout.vp, llm.vp);
  EXPECT_EQ(win.plan.schedule, "interleaved-1f1b");
  EXPECT_NE(describe(spec, win.candidate).find(" vp" + std::to_string(llm.vp)), std::string::npos);
  EXPECT_DOUBLE_EQ(evaluate(spec, cluster, win.candidate, o.sim).sim.step_seconds,
                   win.sim.step_seconds);
  o.max_vp = 1;  // the same search without interleaving
  const SearchResult plain = search(spec, cluster, o);
  EXPECT_EQ(plain.best.front().candidate.layouts.back().vp, 1);
  EXPECT_LT(win.sim.step_seconds, plain.best.front().sim.step_seconds);
  const Spec again =
      parse_spec(spec_to_toml(spec), "again.toml", config_overrides(spec, win.candidate));
  EXPECT_EQ(to_json(make_plan(again, win.candidate.world_size)), to_json(win.plan));
  EXPECT_NE(config_snippet(spec, win.candidate).find("vp = " + std::to_string(llm.vp)),
            std::string::npos);
}

TEST(Search, ConfigSnippetReproducesThePlan) {
  const Spec spec = small_vlm();
  const Cluster cluster = h100(2);
  SearchOptions o;
  o.top = 1;
  for (const char* placement : {"colocated", "separate"}) {
    o.placements = {placement};
    const SearchResult r = search(spec, cluster, o);
    const Evaluation& win = r.best.front();
    const Spec again =
        parse_spec(spec_to_toml(spec), "again.toml", config_overrides(spec, win.candidate));
    EXPECT_EQ(to_json(make_plan(again, win.candidate.world_size)), to_json(win.plan)) << placement;
    const std::string snippet = config_snippet(spec, win.candidate);
    EXPECT_NE(snippet.find(std::string("placement = \"") + placement + "\""), std::string::npos);
    EXPECT_NE(snippet.find("[parallel.llm]"), std::string::npos);
    EXPECT_NE(snippet.find("microbatches = "), std::string::npos);
  }
  Candidate m;
  m.placement = "megatron";
  m.layouts.resize(2);
  m.recompute = {false, false};
  const std::string err = testing::error_of([&] { config_overrides(spec, m); });
  EXPECT_NE(err.find("no config can express"), std::string::npos) << err;
}

// AdaPipe's co-optimisation (SearchOptions::move_boundaries): where memory is tight, moving the
// stage boundaries with the per-stage recomputation finds a faster plan than the same search on
// the cuts it makes without recomputation, and never a slower one.
TEST(Search, MovesStageBoundariesWithRecomputation) {
  const Spec spec = small_vlm();
  SearchOptions o = small_space();
  o.zero = false;
  for (double f : {0.98, 0.9}) {
    SCOPED_TRACE(f);
    const Cluster tight = tight_node(spec, o, f);
    SearchOptions p = small_space();
    p.partial_recompute = true;
    p.move_boundaries = false;
    const Evaluation fixed = search(spec, tight, p).best.front();
    p.move_boundaries = true;
    const Evaluation moved = search(spec, tight, p).best.front();
    const std::string what = describe(spec, moved.candidate);
    std::printf("%.2f of the least peak: same cuts %s %.5f s; moved %s (llm stages %s) %.5f s\n", f,
                describe(spec, fixed.candidate).c_str(), fixed.sim.step_seconds, what.c_str(),
                format_list(moved.candidate.layouts.back().stages).c_str(), moved.sim.step_seconds);
    EXPECT_TRUE(moved.sim.memory_fits) << what;
    EXPECT_LE(moved.sim.step_seconds, fixed.sim.step_seconds * (1 + 1e-9)) << what;
    if (f == 0.98) {  // here the LLM's cut moves: [5] (its head is heavy) to [4]
      EXPECT_LT(moved.sim.step_seconds, fixed.sim.step_seconds * 0.995) << what;
      Candidate plain = moved.candidate;
      plain.layouts.back().stages.clear();
      EXPECT_NE(candidate_plan(spec, plain).modules.back().stage_boundaries,
                moved.candidate.layouts.back().stages)
          << what;
    }
    // Its config (stages and blocks) reads back to the same step.
    EXPECT_NEAR(
        evaluate(apply_candidate(spec, moved.candidate), tight, moved.candidate).sim.step_seconds,
        moved.sim.step_seconds, 1e-9 * moved.sim.step_seconds);
  }
}

// refine_recompute raises counts too few for the simulated peak (as a bound fits them) until the
// plan fits, then fits them down again.
TEST(Search, RefineRecomputeRaisesCountsThatDoNotFit) {
  const Spec spec = small_vlm();
  SearchOptions o = small_space();
  o.zero = false;
  const Cluster tight = tight_node(spec, o, 0.98);
  SearchOptions p = small_space();
  p.partial_recompute = true;
  const Evaluation win = search(spec, tight, p).best.front();
  Candidate low = win.candidate;
  bool lowered = false;
  for (size_t k = 0; k < low.recompute.size(); ++k)
    for (int64_t& n : low.recompute_blocks[k])
      if (low.recompute_blocks[k].size() > 1 && n > 0) --n, lowered = true;
  ASSERT_TRUE(lowered) << describe(spec, win.candidate);
  const Evaluation under = evaluate(spec, tight, low);
  ASSERT_FALSE(under.sim.memory_fits) << describe(spec, low);
  int64_t simulations = 0;
  const Evaluation raised = refine_recompute(spec, tight, under, {}, &simulations);
  EXPECT_TRUE(raised.sim.memory_fits) << describe(spec, raised.candidate);
  EXPECT_EQ(raised.candidate.recompute_blocks, win.candidate.recompute_blocks)
      << describe(spec, raised.candidate);
  EXPECT_GT(simulations, 0);
  // Nothing to raise (every block already): returned as it was.
  Candidate all = low;
  for (size_t k = 0; k < all.recompute.size(); ++k) all.recompute_blocks[k].clear();
  const Evaluation whole = evaluate(spec, h100(1, 0.01), all);
  ASSERT_FALSE(whole.sim.memory_fits);
  EXPECT_EQ(refine_recompute(spec, h100(1, 0.01), whole).candidate.recompute_blocks,
            all.recompute_blocks);
}

// A measured profile prices the whole search. On 2 nodes of 2 CPU ranks (the profile's transport
// curves on one node, running on the ranks' cores, the blocking reductions' cheaper than the
// gradients'; layers measured under load, the blocks
// faster than alone, as noise can make it, the other layers slower; a costly per-stage mask, which
// interleaved chunks build once per rank), the bound stays below every simulation and the memory
// bound below every peak, branch and bound finds brute force's optimum, its step is the profile's
// simulation of its plan, and the plan the FLOP model picks is slower under the profile.
testing::json loaded_profile(const Spec& spec) {
  using testing::json;
  json j = testing::with_comm_points(testing::tiny_profile(spec), {8, 1e5, 1e7}, {1e-4, 2e-9},
                                     {2e-4, 4e-9}, {1.5e-4, 3e-9}, {5e-5, 1e-9});
  for (json& layer : j["modules"][0]["layers"])  // the per-stage work: the first chunk's only
    if (layer["part"] == "stage") {
      layer["fit"]["forward"] = {2e-3, 1e-5, 0};
      layer["fit"]["activation_bytes"] = {1e5, 2e3, 0};
    }
  for (json& module : j["modules"])
    for (json& layer : module["layers"]) {
      const double f = layer["part"] == "block" ? 0.8 : 1.3;  // blocks faster under load
      json shared;
      for (const char* q : {"forward", "input_grad", "weight_grad"}) {
        shared[q] = layer["fit"][q];
        for (json& v : shared[q]) v = v.get<double>() * f;
      }
      layer["fit"]["shared"] = shared;
    }
  return j;
}

const char* const kTwoCpuNodes = R"(
nodes = 2
gpus_per_node = 2
device = "cpu-core"
[intra_node]
bandwidth_gbs = 2
latency_us = 50
[inter_node]
bandwidth_gbs = 1
latency_us = 100
)";

TEST(Search, PricesLayoutsOnAMeasuredProfile) {
  Spec spec = testing::profiled_spec();
  spec.model.llm.layers = 6;
  const Profile profile = parse_profile(loaded_profile(spec).dump(), "tiny.json");
  const Cluster cluster = parse_cluster(kTwoCpuNodes, "cpu.toml");
  SearchOptions o = small_space();
  o.profile = &profile;
  int64_t count = 0;
  const Evaluation best = brute_force(spec, cluster, o, &count);
  ASSERT_GT(count, 50);
  const SearchResult r = search(spec, cluster, o);
  ASSERT_FALSE(r.best.empty());
  EXPECT_TRUE(r.stats.complete);
  const Evaluation& win = r.best.front();
  EXPECT_NEAR(win.sim.step_seconds, best.sim.step_seconds, 1e-12 * best.sim.step_seconds)
      << "search: " << describe(spec, win.candidate)
      << "\nbrute force: " << describe(spec, best.candidate);
  EXPECT_LT(r.stats.simulated, count) << "the bound prunes";
  const Spec applied = apply_candidate(spec, win.candidate);
  EXPECT_DOUBLE_EQ(simulate(applied, win.plan, cluster, profile).step_seconds,
                   win.sim.step_seconds);
  // The FLOP model's choice (interleaved PP2 over 4 microbatches), priced by the profile: its
  // per-op overheads make it slower than the profile's (DP4, one microbatch).
  const SearchResult f = search(spec, cluster, small_space());
  const Evaluation f_measured = evaluate(spec, cluster, f.best.front().candidate, {}, &profile);
  EXPECT_LT(win.sim.step_seconds * 1.1, f_measured.sim.step_seconds)
      << describe(spec, f.best.front().candidate);
  // A profile of another model is refused, naming the file.
  Spec other = spec;
  other.model.llm.hidden *= 2;
  EXPECT_TRUE(testing::error_of([&] { search(other, cluster, o); }).find("tiny.json") !=
              std::string::npos);
}

// The bound spreads the work of modules not yet placed at their least seconds per unit of data,
// which must not exceed any cut's. Each stage's ops take the cheaper of alone and under load: on
// a profile whose blocks take half under load and whose front and back layers, each about 2.5
// blocks' work, take 1.3x, the first and last stages of a cut with one block each are cheaper
// alone and the stages between under load, below the whole module on one stage (cheaper under
// load). Every cut of every pp stays at or above the least.
TEST(Search, LeastUnitSecondsIsBelowEveryCut) {
  Spec spec = testing::profiled_spec();
  spec.model.llm.layers = 6;
  testing::json j = loaded_profile(spec);
  const std::map<std::string, double> heavier = {
      {"llm.embed", 60}, {"llm.head", 9}, {"vision.front", 20}, {"vision.projector", 15}};
  for (testing::json& module : j["modules"])
    for (testing::json& layer : module["layers"]) {
      const auto it = heavier.find(layer["name"].get<std::string>());
      const double scale = it == heavier.end() ? 1 : it->second;
      const double load = it == heavier.end() ? 0.5 : 1.3;
      for (const char* q : {"forward", "input_grad", "weight_grad"})
        for (size_t c = 0; c < 3; ++c) {
          testing::json& v = layer["fit"][q][c];
          v = v.get<double>() * scale;
          layer["fit"]["shared"][q][c] = v.get<double>() * load;
        }
    }
  const Profile profile = parse_profile(j.dump(), "tiny.json");
  const Cluster cluster = parse_cluster(kTwoCpuNodes, "cpu.toml");
  SearchOptions o = small_space();
  o.profile = &profile;
  const search_space::Space space(spec, cluster, o);
  for (int64_t k = 0; k <= space.encoders(); ++k) {
    const int64_t layers = k < space.encoders() ? spec.model.encoders[0].layers : 6;
    const double least = space.min_unit_seconds(k);
    SCOPED_TRACE("module " + std::to_string(k));
    EXPECT_GT(least, 0);
    EXPECT_LT(least, space.unit_seconds(k, 1, {}) * (1 - 1e-6));
    // Every cut: the boundaries as a bit mask over the layers' inner edges.
    for (int64_t mask = 0; mask < (int64_t{1} << (layers - 1)); ++mask) {
      std::vector<int64_t> cut;
      for (int64_t b = 1; b < layers; ++b)
        if (mask & (int64_t{1} << (b - 1))) cut.push_back(b);
      const int64_t pp = static_cast<int64_t>(cut.size()) + 1;
      EXPECT_LE(least, space.unit_seconds(k, pp, cut) * (1 + 1e-12)) << "cut " << mask;
    }
  }
}

}  // namespace
}  // namespace weft::plan
