// Cluster files and the alpha-beta model against hand-computed numbers; the simulator against
// textbook results: a uniform p-stage 1F1B pipeline with m microbatches idles (p-1)/(m+p-1) of
// the time, a single-rank plan takes exactly its layer costs, DP2 adds exactly its gradient
// all-reduce, a frozen encoder runs no backward; bridge timing, activation memory, the trace.
#include "weft/plan/simulate.h"

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/errors.h"
#include "support/plan_specs.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/partition.h"
#include "weft/plan/plan.h"
#include "weft/plan/search.h"

namespace weft::plan {
namespace {

using testing::error_of;

// 2 nodes × 4: intra 100 GB/s, 2 us; inter 10 GB/s, 10 us.
Cluster two_nodes() {
  return parse_cluster(R"(
nodes = 2
gpus_per_node = 4
device = "h100"
[intra_node]
bandwidth_gbs = 100
latency_us = 2
[inter_node]
bandwidth_gbs = 10
latency_us = 10
)",
                       "two.toml");
}

TEST(Cluster, ShippedFilesLoad) {
  const Cluster h100 = load_cluster(WEFT_SOURCE_DIR "/configs/clusters/h100-8x1.toml");
  EXPECT_EQ(h100.world_size(), 8);
  EXPECT_EQ(h100.device.name, "h100");
  EXPECT_DOUBLE_EQ(h100.device.peak_bf16_flops, 989e12);
  EXPECT_DOUBLE_EQ(h100.intra_node.bytes_per_second, 450e9);
  EXPECT_DOUBLE_EQ(h100.intra_node.latency_seconds, 3e-6);
  const Cluster h200 = load_cluster(WEFT_SOURCE_DIR "/configs/clusters/h200-8x4.toml");
  EXPECT_EQ(h200.world_size(), 32);
  EXPECT_EQ(h200.node_of(7), 0);
  EXPECT_EQ(h200.node_of(8), 1);
  EXPECT_GT(h200.device.memory_bytes, h100.device.memory_bytes);
  EXPECT_DOUBLE_EQ(h200.inter_node.bytes_per_second, 50e9);
  const Cluster cpu = load_cluster(WEFT_SOURCE_DIR "/configs/clusters/cpu-local.toml");
  EXPECT_EQ(cpu.world_size(), 2);
  EXPECT_EQ(cpu.device.name, "cpu-core");
  EXPECT_DOUBLE_EQ(cpu.device.effective_flops(Precision::kBf16), 0.21e12 * 0.35);  // measured
  EXPECT_DOUBLE_EQ(cpu.intra_node.latency_seconds, 190e-6);
  EXPECT_DOUBLE_EQ(cpu.device.block_overhead_seconds, 350e-6);
  EXPECT_GT(cpu.shared_memory.bytes_per_second, cpu.intra_node.bytes_per_second);
  EXPECT_LT(cpu.shared_memory.latency_seconds, cpu.intra_node.latency_seconds);
  EXPECT_EQ(h100.shared_memory.bytes_per_second, 0);  // NCCL carries a GPU run's collectives
  EXPECT_NE(to_json(cpu).find("\"shared_memory\""), std::string::npos);
  EXPECT_EQ(to_json(h100).find("\"shared_memory\""), std::string::npos);
}

TEST(Cluster, InlineDevice) {
  const Cluster c = parse_cluster(R"(
nodes = 1
gpus_per_node = 2
[device]
name = "toy"
bf16_tflops = 2
memory_gib = 1
matmul_efficiency = 0.5
block_overhead_us = 250
reserved_gib = 0.25
[intra_node]
bandwidth_gbs = 1
latency_us = 0
)",
                                  "toy.toml");
  EXPECT_EQ(c.device.name, "toy");
  EXPECT_DOUBLE_EQ(c.device.peak_bf16_flops, 2e12);
  EXPECT_DOUBLE_EQ(c.device.peak_fp32_flops, 2e12);  // no fp32 figure: the bf16 rate
  EXPECT_DOUBLE_EQ(c.device.memory_bytes, 1024.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(c.device.hbm_bytes_per_second, 0);
  EXPECT_DOUBLE_EQ(c.device.effective_flops(Precision::kBf16), 1e12);
  EXPECT_DOUBLE_EQ(c.device.block_overhead_seconds, 250e-6);
  EXPECT_DOUBLE_EQ(c.device.usable_memory_bytes(), 0.75 * 1024 * 1024 * 1024);
  EXPECT_NE(to_json(c).find("\"reserved_bytes\""), std::string::npos);
}

TEST(Cluster, ErrorsNameFileKeyValue) {
  const std::string link = "\n[intra_node]\nbandwidth_gbs = 1\nlatency_us = 1\n";
  auto err = [&](const std::string& text) {
    return error_of([&] { parse_cluster(text, "c.toml"); });
  };
  EXPECT_EQ(err("nodes = 1\ngpus_per_node = 0\ndevice = \"h100\"" + link),
            "c.toml: gpus_per_node = 0: must be >= 1");
  EXPECT_NE(err("nodes = 1\ngpus_per_node = 1\ndevice = \"a100\"" + link)
                .find("c.toml: device = \"a100\": unknown device profile (shipped: \"h100\""),
            std::string::npos);
  EXPECT_NE(err("nodes = 1\ngpus_per_node = 1\ndevice = \"h100\"\ngpus = 3" + link)
                .find("c.toml: gpus = 3: unknown key (allowed: nodes, gpus_per_node"),
            std::string::npos);
  EXPECT_EQ(err("nodes = 2\ngpus_per_node = 1\ndevice = \"h100\"" + link),
            "c.toml: [inter_node]: missing table (expected bandwidth_gbs and latency_us)");
  EXPECT_EQ(err("nodes = 1\ngpus_per_node = 1\ndevice = \"h100\"\n[intra_node]\n"
                "bandwidth_gbs = \"fast\"\nlatency_us = 1\n"),
            "c.toml: intra_node.bandwidth_gbs = \"fast\": expected a number");
  EXPECT_EQ(err("nodes = 1\ngpus_per_node = 1\n[device]\nbase = \"h100\"\nmatmul_efficiency = 1.5" +
                link),
            "c.toml: device.matmul_efficiency = 1.5: must be in (0, 1] (a fraction of the peak)");
  EXPECT_EQ(
      err("nodes = 1\ngpus_per_node = 1\n[device]\nbase = \"h100\"\nblock_overhead_us = -1" + link),
      "c.toml: device.block_overhead_us = -1: must be a finite number >= 0");
  EXPECT_EQ(
      err("nodes = 1\ngpus_per_node = 1\n[device]\nbase = \"h100\"\nreserved_gib = 80" + link),
      "c.toml: device.reserved_gib = 80: must be less than the device's memory (80 GiB)");
  EXPECT_NE(err("nodes = 1\ngpus_per_node = 1\n[device]\nname = \"x\"\nmemory_gib = 1" + link)
                .find("c.toml: device.bf16_tflops: missing"),
            std::string::npos);
  EXPECT_EQ(err("nodes = 1\ngpus_per_node = 1\ndevice = \"h100\"" + link +
                "[shared_memory]\nbandwidth_gbs = 0\nlatency_us = 1\n"),
            "c.toml: shared_memory.bandwidth_gbs = 0: must be a finite number > 0");
  EXPECT_EQ(err("nodes = 1\ngpus_per_node = 1\ndevice = \"h100\"" + link +
                "[shared_memory]\nbandwidth_gbs = 1\n"),
            "c.toml: shared_memory.latency_us: missing (expected a number)");
  EXPECT_NE(error_of([] { load_cluster("/nonexistent/c.toml"); }).find("cannot read"),
            std::string::npos);
}

TEST(CommModel, HandComputed) {
  const Cluster c = two_nodes();
  EXPECT_DOUBLE_EQ(p2p_seconds(c, 0, 1, 1e9), 2e-6 + 0.01);
  EXPECT_DOUBLE_EQ(p2p_seconds(c, 3, 4, 1e9), 10e-6 + 0.1);  // across the node boundary
  EXPECT_EQ(p2p_seconds(c, 5, 5, 1e9), 0);
  // Ring all-reduce, 4 ranks on one node: 2·3·α + 2·3/4·bytes/B.
  EXPECT_DOUBLE_EQ(all_reduce_seconds(c, {0, 1, 2, 3}, 4e9), 12e-6 + 0.06);
  // Two ranks on two nodes: the inter-node link.
  EXPECT_DOUBLE_EQ(all_reduce_seconds(c, {0, 4}, 1e9), 20e-6 + 0.1);
  EXPECT_EQ(&bottleneck_link(c, {4, 5, 6}), &c.intra_node);
  EXPECT_EQ(&bottleneck_link(c, {2, 5}), &c.inter_node);
  // Tree all-reduce, 8 ranks: 2·⌈log2 8⌉·α + 2·bytes/B; 5 ranks take ⌈log2 5⌉ = 3 steps too.
  const std::vector<int64_t> all = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_DOUBLE_EQ(all_reduce_seconds(c, all, 1e9, CollectiveAlgo::kTree), 60e-6 + 0.2);
  EXPECT_DOUBLE_EQ(all_reduce_seconds(c, {0, 1, 2, 3, 4}, 1e9, CollectiveAlgo::kTree), 60e-6 + 0.2);
  EXPECT_DOUBLE_EQ(all_reduce_seconds(c, {0, 1}, 1e9, CollectiveAlgo::kTree), 4e-6 + 0.02);
  // Ring all-gather / reduce-scatter: (n-1)·α + (n-1)/n·bytes/B.
  EXPECT_DOUBLE_EQ(all_gather_seconds(c, {0, 1, 2, 3}, 4e9), 6e-6 + 0.03);
  EXPECT_DOUBLE_EQ(reduce_scatter_seconds(c, {0, 1, 2, 3}, 4e9), 6e-6 + 0.03);
  EXPECT_DOUBLE_EQ(all_reduce_seconds(c, {0, 1, 2, 3}, 4e9),
                   all_gather_seconds(c, {0, 1, 2, 3}, 4e9) * 2);
  // One rank: free.
  EXPECT_EQ(all_reduce_seconds(c, {3}, 1e9), 0);
  EXPECT_EQ(all_gather_seconds(c, {3}, 1e9), 0);
}

// Blocking collectives through shared memory (20 GB/s copies, 1 us per wait): every rank writes
// its piece and reads what it needs once. Without the link, with the setting off or across
// nodes: the ring.
TEST(CommModel, BlockingCollectivesThroughSharedMemory) {
  Cluster c = two_nodes();
  Spec s = testing::vlm_spec();
  const std::vector<int64_t> four = {0, 1, 2, 3}, across = {2, 5};
  using K = CollectiveKind;
  EXPECT_FALSE(shared_memory_collectives(s, c));
  EXPECT_DOUBLE_EQ(blocking_collective_seconds(s, c, four, K::kAllReduce, 4e9),
                   all_reduce_seconds(c, four, 4e9));
  EXPECT_DOUBLE_EQ(blocking_collective_seconds(s, c, four, K::kReduceScatter, 4e9),
                   reduce_scatter_seconds(c, four, 4e9));
  c.shared_memory = {20e9, 1e-6};
  EXPECT_TRUE(shared_memory_collectives(s, c));
  // All-reduce: writes 4 GB, reads 4 x 4 GB. All-gather of 4 GB: writes 1, reads 4.
  // Reduce-scatter of 4 GB: writes 4, reads its 1 GB row of each of the 4.
  EXPECT_DOUBLE_EQ(blocking_collective_seconds(s, c, four, K::kAllReduce, 4e9), 1e-6 + 1.0);
  EXPECT_DOUBLE_EQ(blocking_collective_seconds(s, c, four, K::kAllGather, 4e9), 1e-6 + 0.25);
  EXPECT_DOUBLE_EQ(blocking_collective_seconds(s, c, four, K::kReduceScatter, 4e9), 1e-6 + 0.4);
  EXPECT_EQ(blocking_collective_seconds(s, c, {3}, K::kAllReduce, 4e9), 0);
  EXPECT_DOUBLE_EQ(blocking_collective_seconds(s, c, across, K::kAllReduce, 1e9),
                   all_reduce_seconds(c, across, 1e9));
  EXPECT_DOUBLE_EQ(blocking_collective_seconds(s, c, across, K::kAllGather, 1e9),
                   all_gather_seconds(c, across, 1e9));
  s.train.shared_memory_collectives = false;
  EXPECT_FALSE(shared_memory_collectives(s, c));
  EXPECT_DOUBLE_EQ(blocking_collective_seconds(s, c, four, K::kAllGather, 4e9),
                   all_gather_seconds(c, four, 4e9));
  s.train.shared_memory_collectives = true;
  // Messages: α + bytes/B. Across nodes, to oneself, or with the setting (or the collectives'
  // setting) off: as before.
  EXPECT_TRUE(shared_memory_messages(s, c));
  EXPECT_DOUBLE_EQ(message_seconds(s, c, 0, 1, 1e9), 1e-6 + 0.05);
  EXPECT_DOUBLE_EQ(message_seconds(s, c, 3, 4, 1e9), p2p_seconds(c, 3, 4, 1e9));
  EXPECT_EQ(message_seconds(s, c, 2, 2, 1e9), 0);
  s.train.shared_memory_messages = false;
  EXPECT_FALSE(shared_memory_messages(s, c));
  EXPECT_DOUBLE_EQ(message_seconds(s, c, 0, 1, 1e9), p2p_seconds(c, 0, 1, 1e9));
  s.train.shared_memory_messages = true;
  s.train.shared_memory_collectives = false;
  EXPECT_DOUBLE_EQ(message_seconds(s, c, 0, 1, 1e9), p2p_seconds(c, 0, 1, 1e9));
  const Cluster parsed = parse_cluster(
      "nodes = 1\ngpus_per_node = 2\ndevice = \"cpu-core\"\n[intra_node]\n"
      "bandwidth_gbs = 1\nlatency_us = 190\n[shared_memory]\n"
      "bandwidth_gbs = 9\nlatency_us = 20\n",
      "s.toml");
  EXPECT_DOUBLE_EQ(parsed.shared_memory.bytes_per_second, 9e9);
  EXPECT_DOUBLE_EQ(parsed.shared_memory.latency_seconds, 20e-6);
}

// ---- the simulator ---------------------------------------------------------------------------

// A cluster whose links cost nothing measurable and whose device runs 1e12 FLOP/s effective.
Cluster ideal(int64_t devices, double latency = 0, double bandwidth_gbs = 1e12) {
  Cluster c;
  c.source = "ideal";
  c.gpus_per_node = devices;
  c.device.name = "ideal";
  c.device.peak_bf16_flops = c.device.peak_fp32_flops = 2e12;
  c.device.matmul_efficiency = 0.5;
  c.device.memory_bytes = 1e12;
  c.device.hbm_bytes_per_second = 1e12;
  c.intra_node = c.inter_node = {bandwidth_gbs * 1e9, latency};
  return c;
}

// The shared test VLM (4 LLM layers, 3 vision layers, batch 8 in 2 microbatches) with 64-token
// samples, gradients reduced after the backward.
Spec vlm_spec() {
  Spec s = testing::vlm_spec();
  s.model.llm.max_seq = 64;
  s.train.overlap_grad_reduce = false;
  return s;
}

SimOptions no_optimizer() {
  SimOptions o;
  o.optimizer_step = false;
  return o;
}

// Work of a module's layers for one unit of data (module_layer_costs applied the frozen rules,
// an encoder's projector with its own flags).
double module_time(const Spec& spec, const ModulePlan& m) {
  const ModuleCosts c = module_layer_costs(spec, m, single_sample_microbatch(spec));
  const auto work = [](const LayerCost& l) { return l.forward + l.input_grad + l.weight_grad; };
  double t = work(c.front) + work(c.back);
  for (const auto& b : c.blocks) t += work(b);
  return t;
}

const TraceEvent* find_event(const SimResult& r, const std::string& name) {
  for (const auto& e : r.trace)
    if (e.name == name) return &e;
  return nullptr;
}

int count_events(const SimResult& r, const std::string& part) {
  int n = 0;
  for (const auto& e : r.trace) n += e.name.find(part) != std::string::npos;
  return n;
}

TEST(Simulate, SingleRankIsTheSumOfLayerCosts) {
  for (bool frozen : {false, true}) {
    Spec s = vlm_spec();
    s.model.encoders[0].frozen = frozen;
    const Plan p = make_plan(s, 1);
    const Cluster c = ideal(1, 1e-3, 1);  // slow links: none may be used
    const SimResult r = simulate(s, p, c, no_optimizer());
    // Layer costs already apply the frozen rules (the projector is the encoder's `back`).
    const double flops = (module_time(s, p.module("vision")) + module_time(s, p.module("llm"))) *
                         static_cast<double>(s.train.batch);
    EXPECT_NEAR(r.step_seconds, flops / 1e12, 1e-15) << frozen;
    EXPECT_DOUBLE_EQ(r.model_flops, flops);
    EXPECT_DOUBLE_EQ(r.llm_flops, module_time(s, p.module("llm")) * s.train.batch);
    EXPECT_NEAR(r.mfu, 0.5, 1e-12);  // nothing but compute at the device's efficiency
    EXPECT_DOUBLE_EQ(r.tokens_per_step, 8.0 * 64);
    EXPECT_DOUBLE_EQ(r.tokens_per_second, r.tokens_per_step / r.step_seconds);
    EXPECT_NEAR(r.bubble_fraction, 0, 1e-12);
    EXPECT_EQ(r.ranks.at(0).collective_seconds, 0);
    EXPECT_EQ(r.ranks[0].stages, (std::vector<std::string>{"vision s0", "llm s0"}));
  }
}

// The device's per-block overhead: every block's forward and, where it has one, its backward
// cost that much more per microbatch (a recomputed block's backward twice), whatever its size.
TEST(Simulate, BlockOverheadIsChargedPerBlockAndMicrobatch) {
  struct Case {
    bool frozen, recompute;
    double per_microbatch;  // overhead units: 4 LLM blocks, 3 vision blocks
  };
  for (const Case& k : {Case{false, false, 2 * 4 + 2 * 3}, Case{true, false, 2 * 4 + 3},
                        Case{false, true, 3 * 4 + 2 * 3}}) {
    Spec s = vlm_spec();
    s.model.encoders[0].frozen = k.frozen;
    s.model.llm.recompute = k.recompute;
    const Plan p = make_plan(s, 1);
    Cluster c = ideal(1, 1e-3, 1);
    const double plain = simulate(s, p, c, planner_costs(s, p), no_optimizer()).step_seconds;
    c.device.block_overhead_seconds = 1e-3;
    const SimResult r = simulate(s, p, c, planner_costs(s, p), no_optimizer());
    EXPECT_NEAR(r.step_seconds - plain, 2 * k.per_microbatch * 1e-3, 1e-12)
        << "frozen " << k.frozen << ", recompute " << k.recompute;  // 2 microbatches
    EXPECT_LT(r.mfu, simulate(s, p, ideal(1, 1e-3, 1), planner_costs(s, p), no_optimizer()).mfu);
  }
}

// An LLM-only spec (vocab 64) of `layers` blocks, `batch` samples in `microbatches`, pipelined
// over `pp` stages.
Spec llm_only(const char* source, int64_t layers, int64_t batch, int64_t microbatches,
              int64_t pp = 1) {
  Spec s;
  s.source = source;
  s.model.llm.vocab = 64;
  s.model.llm.layers = layers;
  s.train.batch = batch;
  s.train.microbatches = microbatches;
  s.parallel.modules["llm"].pp = pp;
  return s;
}

// A pure-LLM plan with uniform stages: forward f, backward b seconds per microbatch and pipeline
// rank (under vp virtual stages, f / vp and b / vp per chunk).
SimResult uniform_pipeline(int64_t p, int64_t m, double f, double b, int64_t vp = 1) {
  Spec s = llm_only("pipe.toml", p * vp, m, m, p);
  s.parallel.modules["llm"].vp = vp;
  const Plan plan = make_plan(s, p);
  CostTable costs = stage_costs(s, plan);
  const double v = static_cast<double>(vp);
  for (StageCost& sc : costs.back())
    sc.forward_flops = f / v * 1e12, sc.backward_flops = b / v * 1e12;
  return simulate(s, plan, ideal(p), costs, no_optimizer());
}

TEST(Simulate, OneFOneBBubbleIsTextbook) {
  for (auto [p, m] :
       std::vector<std::pair<int64_t, int64_t>>{{2, 4}, {4, 8}, {4, 4}, {4, 2}, {3, 1}, {8, 16}}) {
    for (double b : {1.0, 2.0}) {
      const SimResult r = uniform_pipeline(p, m, 1.0, b);
      const double pm = static_cast<double>(p), mm = static_cast<double>(m);
      EXPECT_NEAR(r.bubble_fraction, (pm - 1) / (mm + pm - 1), 1e-9) << p << " " << m << " " << b;
      EXPECT_NEAR(r.step_seconds, (mm + pm - 1) * (1 + b), 1e-6) << p << " " << m << " " << b;
      for (const auto& rank : r.ranks) EXPECT_NEAR(rank.busy_seconds, mm * (1 + b), 1e-9);
    }
  }
  // The 1F1B order on a middle stage: warm-up forwards, then alternate, then drain.
  const SimResult r = uniform_pipeline(4, 6, 1, 2);
  std::vector<std::string> stage1;
  for (const auto& e : r.trace)
    if (e.rank == 1 && e.category != "collective") stage1.push_back(e.name.substr(4, 7));
  EXPECT_EQ(stage1, (std::vector<std::string>{"fwd mb0", "fwd mb1", "fwd mb2", "bwd mb0", "fwd mb3",
                                              "bwd mb1", "fwd mb4", "bwd mb2", "fwd mb5", "bwd mb3",
                                              "bwd mb4", "bwd mb5"}));
}

// Interleaved 1F1B: the fill and drain shrink vp-fold, (P - 1) / vp of a microbatch's time
// (Narayanan et al. 2021), on the same work; also for microbatch counts that are not a multiple of
// P (groups of at least P microbatches).
TEST(Simulate, InterleavedPipelineShrinksTheBubble) {
  for (auto [p, m] : std::vector<std::pair<int64_t, int64_t>>{
           {2, 4}, {4, 8}, {4, 4}, {2, 2}, {4, 6}, {4, 10}, {3, 7}, {2, 5}}) {
    for (int64_t vp : {2, 3}) {
      const SimResult r = uniform_pipeline(p, m, 1.0, 2.0, vp);
      const double pm = static_cast<double>(p), mm = static_cast<double>(m);
      const double v = static_cast<double>(vp);
      EXPECT_NEAR(r.step_seconds, (mm + (pm - 1) / v) * 3, 1e-6) << p << " " << m << " " << vp;
      EXPECT_NEAR(r.bubble_fraction, (pm - 1) / v / (mm + (pm - 1) / v), 1e-9)
          << p << " " << m << " " << vp;
      for (const auto& rank : r.ranks) EXPECT_NEAR(rank.busy_seconds, mm * 3, 1e-9);
      ASSERT_EQ(r.ranks[0].stages.size(), static_cast<size_t>(vp));
      EXPECT_EQ(r.ranks[0].stages[1], "llm s" + std::to_string(p));  // rank 0's second chunk
    }
  }
}

// Interleaved 1F1B with the reduction overlapped: each chunk's gradients start reducing with that
// chunk's own last backward, one chunk after the other. Here chunk 1's (armed two chunk-backwards
// before the rank's last) hides entirely, and only chunk 0's last bucket shows; reducing both
// chunks from the rank's last backward would expose a whole chunk's reduction (1 s). With chunk
// 1's reduction 3 s long, chunk 0's queues behind it and ends about 1 s after the rank's last
// backward (the rank waits on its neighbour between them for a moment).
TEST(Simulate, InterleavedChunksReduceFromTheirOwnLastBackward) {
  const auto run = [](int64_t dp, double chunk1_bytes = 1e9) {
    Spec s;
    s.source = "pipe.toml";
    s.model.llm.vocab = 64;
    s.model.llm.layers = 4;
    s.model.llm.tie_embeddings = false;
    s.train.batch = 2 * dp;
    s.train.microbatches = 2;
    s.train.overlap_grad_reduce = true;
    s.parallel.modules["llm"].pp = 2;
    s.parallel.modules["llm"].vp = 2;
    s.parallel.modules["llm"].dp = dp;
    const Plan plan = make_plan(s, 2 * dp);
    CostTable costs = stage_costs(s, plan);
    for (size_t v = 0; v < costs.back().size(); ++v) {  // forward 0.5 s, backward 1 s per chunk
      StageCost& sc = costs.back()[v];
      sc.forward_flops = 0.5e12, sc.backward_flops = 1e12;
      sc.grad_bytes = v >= 2 ? chunk1_bytes : 1e9;  // virtual stages 2, 3: the ranks' chunk 1
    }
    return std::make_pair(s, simulate(s, plan, ideal(2 * dp, 0, 1), costs, no_optimizer()));
  };
  const auto [s, two] = run(2);
  const SimResult one = run(1).second;
  const Cluster c = ideal(4, 0, 1);
  const std::vector<int64_t> pair = {0, 2};
  EXPECT_NEAR(all_reduce_seconds(c, pair, 1e9), 1.0, 1e-12);
  const double last_bucket = all_reduce_seconds(c, pair, s.train.grad_bucket_mb * 1024 * 1024);
  EXPECT_NEAR(two.step_seconds, one.step_seconds + last_bucket, 1e-6);
  EXPECT_NEAR(run(2, 3e9).second.step_seconds, one.step_seconds + 1.0, 1e-3);
}

TEST(Simulate, ActivationsInFlightFollow1F1B) {
  const SimResult r = uniform_pipeline(4, 8, 1, 2);
  const Spec s = llm_only("", 4, 8, 8, 4);
  const CostTable costs = stage_costs(s, make_plan(s, 4));
  for (int64_t st = 0; st < 4; ++st)  // stage s holds P - s microbatches at its peak
    EXPECT_DOUBLE_EQ(r.ranks[st].peak_activation_bytes,
                     static_cast<double>(4 - st) * costs.back()[st].activation_bytes)
        << st;
  EXPECT_DOUBLE_EQ(
      r.ranks[0].static_bytes,
      costs.back()[0].param_bytes + costs.back()[0].copy_bytes + costs.back()[0].train_state_bytes);
  EXPECT_GT(costs.back()[0].copy_bytes, 0);  // bf16: the fp32 masters' casts
}

// Recomputation: a stage keeps only its blocks' inputs per microbatch in flight, and during a
// backward one block's activations again on top (its forward run again).
TEST(Simulate, RecomputedBlocksHoldOneBlockAgainDuringBackward) {
  Spec s = llm_only("pipe.toml", 4, 8, 4, 2);
  s.model.llm.recompute = true;
  const Plan plan = make_plan(s, 2);
  const CostTable costs = planner_costs(s, plan);
  const SimResult r = simulate(s, plan, ideal(2), costs, no_optimizer());
  for (int64_t st = 0; st < 2; ++st) {  // stage s holds P - s microbatches of 2 samples
    const StageCost& sc = costs.back()[static_cast<size_t>(st)];
    EXPECT_GT(sc.recompute_peak_bytes, sc.activation_bytes / 100) << st;
    EXPECT_DOUBLE_EQ(
        r.ranks[st].peak_activation_bytes,
        2 * (static_cast<double>(2 - st) * sc.activation_bytes + sc.recompute_peak_bytes))
        << st;
  }
}

// recompute_blocks: a stage's first blocks are priced as recomputed, the others as not. Each
// stage of 3 blocks with recompute_blocks = 1 drops a third of what recomputing all 3 drops and
// runs a third of their extra forward: peak memory and step time fall between none and all.
TEST(Simulate, RecomputingTheFirstBlocksOfEachStage) {
  Spec s = llm_only("pipe.toml", 6, 8, 4, 2);
  s.parallel.modules["llm"].stages = {3};
  const Plan plan = make_plan(s, 2);
  ASSERT_EQ(plan.module("llm").stage_layers(1), (std::pair<int64_t, int64_t>{3, 6}));
  std::vector<CostTable> costs;
  std::vector<SimResult> sims;
  for (int64_t blocks : {-1, 1, 0}) {  // -1: no recomputation
    s.model.llm.recompute = blocks >= 0;
    s.model.llm.recompute_blocks.clear();
    if (blocks > 0) s.model.llm.recompute_blocks = {blocks};
    costs.push_back(planner_costs(s, plan));
    sims.push_back(simulate(s, plan, ideal(2), costs.back(), no_optimizer()));
  }
  for (size_t st = 0; st < 2; ++st) {
    const StageCost &none = costs[0].back()[st], &one = costs[1].back()[st],
                    &all = costs[2].back()[st];
    EXPECT_TRUE(one.recompute && all.recompute && !none.recompute) << st;
    EXPECT_NEAR(3 * one.recompute_flops, all.recompute_flops, 1e-9 * all.recompute_flops) << st;
    EXPECT_NEAR(3 * (none.activation_bytes - one.activation_bytes),
                none.activation_bytes - all.activation_bytes, 1e-6 * none.activation_bytes)
        << st;
    EXPECT_DOUBLE_EQ(one.recompute_peak_bytes, all.recompute_peak_bytes) << st;  // one block
    // Stage st holds 2 - st microbatches of 2 samples, and one recomputed block in backward.
    for (size_t k = 0; k < 3; ++k) {
      const StageCost& sc = costs[k].back()[st];
      EXPECT_DOUBLE_EQ(
          sims[k].ranks[st].peak_activation_bytes,
          2 * (static_cast<double>(2 - st) * sc.activation_bytes + sc.recompute_peak_bytes))
          << st << " " << k;
    }
  }
  // The first stage: the less kept per microbatch in flight, the lower. The last stage holds one
  // microbatch: recomputing one block saves what the block run again in backward holds.
  EXPECT_LT(sims[2].ranks[0].peak_activation_bytes, sims[1].ranks[0].peak_activation_bytes);
  EXPECT_LT(sims[1].ranks[0].peak_activation_bytes, sims[0].ranks[0].peak_activation_bytes);
  EXPECT_DOUBLE_EQ(sims[1].ranks[1].peak_activation_bytes, sims[0].ranks[1].peak_activation_bytes);
  EXPECT_LT(sims[0].step_seconds, sims[1].step_seconds);
  EXPECT_LT(sims[1].step_seconds, sims[2].step_seconds);
}

// One count per pipeline stage: [3, 0] prices stage 0 (which holds two microbatches under 1F1B)
// as recomputing its 3 blocks and stage 1 (one microbatch) as recomputing none, so each rank
// costs and peaks as its stage would with every block recomputed or none; the step falls between.
TEST(Simulate, RecomputingPerStageCounts) {
  Spec s = llm_only("pipe.toml", 6, 8, 4, 2);
  s.parallel.modules["llm"].stages = {3};
  const Plan plan = make_plan(s, 2);
  std::vector<CostTable> costs;
  std::vector<SimResult> sims;
  for (const std::vector<int64_t>& blocks :
       std::vector<std::vector<int64_t>>{{-1}, {}, {3, 0}}) {  // {-1}: no recomputation
    s.model.llm.recompute = blocks != std::vector<int64_t>{-1};
    s.model.llm.recompute_blocks = s.model.llm.recompute ? blocks : std::vector<int64_t>{};
    costs.push_back(planner_costs(s, plan));
    sims.push_back(simulate(s, plan, ideal(2), costs.back(), no_optimizer()));
  }
  const auto same = [](const StageCost& a, const StageCost& b) {
    return a.recompute == b.recompute && a.recompute_blocks == b.recompute_blocks &&
           a.activation_bytes == b.activation_bytes && a.backward_flops == b.backward_flops &&
           a.recompute_peak_bytes == b.recompute_peak_bytes;
  };
  EXPECT_TRUE(same(costs[2].back()[0], costs[1].back()[0]));  // stage 0: every block
  EXPECT_TRUE(same(costs[2].back()[1], costs[0].back()[1]));  // stage 1: none
  EXPECT_EQ(costs[2].back()[0].recompute_blocks, 3);
  EXPECT_DOUBLE_EQ(sims[2].ranks[0].peak_activation_bytes, sims[1].ranks[0].peak_activation_bytes);
  EXPECT_DOUBLE_EQ(sims[2].ranks[1].peak_activation_bytes, sims[0].ranks[1].peak_activation_bytes);
  EXPECT_LT(sims[2].ranks[0].peak_activation_bytes, sims[0].ranks[0].peak_activation_bytes);
  EXPECT_LT(sims[0].step_seconds, sims[2].step_seconds);
  EXPECT_LT(sims[2].step_seconds, sims[1].step_seconds);
}

// Tensor parallelism keeps the residual stream (the norms' inputs and outputs) whole on every TP
// rank; sequence parallelism splits it as well, for a second all-gather of each column-parallel
// input in backward.
TEST(Simulate, SequenceParallelSplitsTheResidualStreamOverTp) {
  Spec s = llm_only("sp.toml", 4, 4, 2);
  s.parallel.modules["llm"].tp = 2;
  const Plan plain = make_plan(s, 2);
  s.parallel.modules["llm"].sp = true;
  const Plan seq = make_plan(s, 2);
  EXPECT_TRUE(seq.module("llm").layout.sequence_parallel());
  const CostTable c0 = planner_costs(s, plain), c1 = planner_costs(s, seq);
  const StageCost &a = c0.back()[0], &b = c1.back()[0];
  EXPECT_DOUBLE_EQ(a.activation_bytes, b.activation_bytes);  // the stage's, whole
  const double S = 256, h = 128, act = 2;                    // bf16
  // Per sample: each block's norms' inputs and outputs, the final norm's input and output, and
  // the rows the head multiplies, gathered (in the planner's unit sample every position is a
  // target row), which are all that stays whole under sequence parallelism.
  const double gathered = act * S * h, whole = 4 * act * S * 4 * h + act * 2 * S * h + gathered;
  EXPECT_DOUBLE_EQ(a.whole_activation_bytes, whole);
  EXPECT_DOUBLE_EQ(b.whole_activation_bytes, gathered);
  EXPECT_DOUBLE_EQ(kept_activation_bytes(a, 2, plain.module("llm").layout),
                   2 * ((a.activation_bytes - whole) / 2 + whole));
  EXPECT_DOUBLE_EQ(kept_activation_bytes(b, 2, seq.module("llm").layout),
                   2 * ((a.activation_bytes - gathered) / 2 + gathered));
  const Cluster c = ideal(2, 5e-6, 10);
  const SimResult r0 = simulate(s, plain, c, c0, no_optimizer());
  const SimResult r1 = simulate(s, seq, c, c1, no_optimizer());
  // One microbatch of 2 samples alive at a time (one stage).
  EXPECT_DOUBLE_EQ(r0.ranks[0].peak_activation_bytes - r1.ranks[0].peak_activation_bytes,
                   2 * (whole - gathered) / 2);
  EXPECT_GT(r1.step_seconds, r0.step_seconds);  // the re-gathers in backward
  // Recomputed blocks keep only their input (whole without sequence parallelism); the block
  // run again in backward holds its norms' other three tensors whole, or nothing whole with SP.
  s.model.llm.recompute = true;
  const CostTable r0c = planner_costs(s, plain), r1c = planner_costs(s, seq);
  EXPECT_DOUBLE_EQ(r0c.back()[0].whole_activation_bytes,
                   4 * act * S * h + act * 2 * S * h + gathered);
  EXPECT_DOUBLE_EQ(r1c.back()[0].whole_activation_bytes, gathered);
  EXPECT_DOUBLE_EQ(r0c.back()[0].recompute_peak_whole_bytes, 3 * act * S * h);
  EXPECT_DOUBLE_EQ(r1c.back()[0].recompute_peak_whole_bytes, 0);
}

// An encoder's sequence parallelism: its blocks' residual stream splits over TP too, at the
// price of the re-gathers in backward and the last stage's gather of its output.
TEST(Simulate, EncoderSequenceParallelSplitsItsResidualStreamOverTp) {
  Spec s = vlm_spec();
  s.parallel.modules["vision"].tp = 2;
  const Plan plain = make_plan(s, 2);
  s.parallel.modules["vision"].sp = true;
  const Plan seq = make_plan(s, 2);
  const CostTable c0 = planner_costs(s, plain), c1 = planner_costs(s, seq);
  const StageCost &a = c0[0][0], &b = c1[0][0];
  const double T = 16, h = 128, act = 2;                            // one item, bf16
  EXPECT_DOUBLE_EQ(a.whole_activation_bytes, 3 * 4 * act * T * h);  // 3 blocks' norms
  EXPECT_DOUBLE_EQ(b.whole_activation_bytes, 0);
  // The front end (patch embedding, positions) runs whole on every TP rank, and keeps so.
  MicrobatchShape unit = single_sample_microbatch(s);
  unit.items = 1;
  const double front = module_layer_costs(s, seq.module("vision"), unit).front.activation_bytes;
  EXPECT_GT(front, 0);
  EXPECT_DOUBLE_EQ(b.replicated_activation_bytes, front);
  EXPECT_DOUBLE_EQ(kept_activation_bytes(b, 4, seq.module("vision").layout),
                   4 * ((a.activation_bytes - front) / 2 + front));
  const Cluster c = ideal(2, 5e-6, 10);
  const SimResult r0 = simulate(s, plain, c, c0, no_optimizer());
  const SimResult r1 = simulate(s, seq, c, c1, no_optimizer());
  EXPECT_LT(r1.ranks[0].peak_activation_bytes, r0.ranks[0].peak_activation_bytes);
  EXPECT_GT(r1.step_seconds, r0.step_seconds);
}

TEST(Simulate, DataParallelAddsExactlyTheAllReduce) {
  Spec s = vlm_spec();
  const Cluster c = ideal(2, 5e-6, 10);
  const SimResult two = simulate(s, make_plan(s, 2), c, no_optimizer());
  Spec half = s;
  half.train.batch = 4;  // what each replica computes
  const SimResult one = simulate(half, make_plan(half, 1), c, no_optimizer());
  const CostTable costs = stage_costs(s, make_plan(s, 2));
  const std::vector<int64_t> pair = {0, 1};
  const double grads = all_reduce_seconds(c, pair, costs[0][0].grad_bytes) +
                       all_reduce_seconds(c, pair, costs[2][0].grad_bytes);
  EXPECT_DOUBLE_EQ(costs[2][0].grad_bytes, costs[2][0].param_bytes);  // all trainable, fp32
  EXPECT_NEAR(two.step_seconds, one.step_seconds + grads + 2 * all_reduce_seconds(c, pair, 8),
              1e-12);
  EXPECT_NEAR(two.ranks[0].collective_seconds, two.step_seconds - one.step_seconds, 1e-12);
  // With a shared-memory link the loss's and the norm's sums take it; the gradient buckets
  // (Gloo's async all-reduces) stay on the ring.
  Cluster shm = c;
  shm.shared_memory = {20e9, 1e-6};
  EXPECT_NEAR(simulate(s, make_plan(s, 2), shm, no_optimizer()).step_seconds,
              one.step_seconds + grads + 2 * (1e-6 + 3 * 8 / 20e9), 1e-12);
  // Overlapped with the last backward, the exposed part shrinks but the last bucket remains.
  s.train.overlap_grad_reduce = true;
  const SimResult overlapped = simulate(s, make_plan(s, 2), c, no_optimizer());
  EXPECT_LT(overlapped.step_seconds, two.step_seconds);
  EXPECT_GT(overlapped.step_seconds, one.step_seconds);
}

// ZeRO-1 sums the gradients by a reduce-scatter (each rank its shard) and all-gathers the
// stepped parameters after the optimizer: in fp32, on a ring, the bytes of DP's one all-reduce;
// under bf16 the parameters travel in bf16, half those bytes. Overlapped with the next step's
// forward (train.overlap_param_gather), less of the gather shows.
TEST(Simulate, ZeroOneReduceScattersAndAllGathersInsteadOfAllReducing) {
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    Spec s = vlm_spec();
    s.train.precision = precision;
    s.train.overlap_param_gather = false;
    const Cluster c = ideal(2, 5e-6, 10);
    const SimResult dp = simulate(s, make_plan(s, 2), c, no_optimizer());
    s.train.zero_stage = 1;
    const SimResult zero = simulate(s, make_plan(s, 2), c, no_optimizer());
    const CostTable costs = stage_costs(s, make_plan(s, 2));
    const std::vector<int64_t> pair = {0, 1};
    const double vision = costs[0][0].grad_bytes, llm = costs[2][0].grad_bytes;
    const double all_reduce =
        all_reduce_seconds(c, pair, vision) + all_reduce_seconds(c, pair, llm);
    const double scatter = all_gather_seconds(c, pair, vision) + all_gather_seconds(c, pair, llm);
    const double wire = precision == Precision::kBf16 ? 0.5 : 1.0;
    EXPECT_EQ(zero1_gather_fraction(s), wire);
    const double gather =
        all_gather_seconds(c, pair, wire * vision) + all_gather_seconds(c, pair, wire * llm);
    EXPECT_EQ(count_events(zero, "vision grad reduce-scatter"), 2);
    EXPECT_EQ(count_events(zero, "llm grad all-reduce"), 0);
    EXPECT_EQ(count_events(zero, "llm ZeRO-1 parameter all-gather"), 2);
    EXPECT_NEAR(zero.step_seconds, dp.step_seconds - all_reduce + scatter + gather, 1e-12);
    EXPECT_NEAR(scatter + gather, (1 + wire) / 2 * all_reduce, 0.01 * all_reduce);
    // Overlapped: the gathers run from the step's start; each module's first forward waits for
    // its first bucket and ends no sooner than its last. Here the vision encoder's gather is one
    // bucket, waited for before its first forward; the LLM's then runs during the encoder's
    // forwards, and shows only where it outlasts them.
    s.train.overlap_param_gather = true;
    const SimResult overlapped = simulate(s, make_plan(s, 2), c, no_optimizer());
    EXPECT_EQ(count_events(overlapped, "ZeRO-1 parameter all-gather"),
              count_events(overlapped, "ZeRO-1 parameter all-gather (wait)"));
    EXPECT_EQ(count_events(overlapped, "vision ZeRO-1 parameter all-gather (wait)"), 2);
    EXPECT_LT(overlapped.step_seconds, zero.step_seconds - 1e-3 * gather);
    EXPECT_GT(overlapped.step_seconds, dp.step_seconds - all_reduce + scatter);
    // On CPU ranks (Gloo's work takes the computing core) nothing overlaps: as without.
    SimOptions cpu = no_optimizer();
    cpu.comm_occupies_rank = true;
    s.train.overlap_param_gather = false;
    const double waited = simulate(s, make_plan(s, 2), c, cpu).step_seconds;
    s.train.overlap_param_gather = true;
    EXPECT_DOUBLE_EQ(simulate(s, make_plan(s, 2), c, cpu).step_seconds, waited);
  }
}

// ZeRO-1's static memory per trainable parameter of fp32 size G (its gradient's bytes), over a
// group of n ranks: the moments 2G/n instead of 2G; under bf16 also the parameter held in bf16
// (G/2, no cast of G/2 beside it) with its fp32 master G/n, as Megatron's distributed optimizer.
// Its overlapped parameter gathers hold their buffers until forward reads them.
TEST(Simulate, ZeroOneShardsMomentsAndUnderBf16HoldsParametersInBf16) {
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    Spec s = vlm_spec();
    s.train.precision = precision;
    const int64_t n = 4;
    const Cluster c = ideal(n);
    const double dp = simulate(s, make_plan(s, n), c, no_optimizer()).ranks[0].static_bytes;
    s.train.zero_stage = 1;
    EXPECT_EQ(zero1_bf16_params(s), precision == Precision::kBf16);
    const SimResult sim = simulate(s, make_plan(s, n), c, no_optimizer());
    const double zero = sim.ranks[0].static_bytes;
    double grads = 0, gathered = 0;  // gathered: all but the projector's, gathered with the LLM
    const Plan plan = make_plan(s, n);
    const CostTable costs = stage_costs(s, plan);
    for (size_t i = 0; i < costs.size(); ++i)
      for (const StageCost& sc : costs[i]) {
        grads += sc.grad_bytes;
        if (plan.modules[i].role != ModuleRole::kProjector) gathered += sc.grad_bytes;
      }
    ASSERT_GT(grads, 0);
    const double moments = 2 * grads * (1 - 1.0 / n);
    const double held = precision == Precision::kBf16 ? grads / 2 + grads / 2 - grads / n : 0;
    EXPECT_NEAR(dp - zero, moments + held, 1e-6 * dp);
    // Overlapped with the next forward (the default), every module's gather is in flight at the
    // step's start: its whole parameters in the wire dtype, before activations grow (here the
    // larger of the two).
    const RankReport& r = sim.ranks[0];
    EXPECT_NEAR(r.gather_buffer_bytes, zero1_gather_fraction(s) * gathered, 1e-6 * gathered);
    EXPECT_DOUBLE_EQ(r.peak_memory_bytes,
                     r.static_bytes + std::max(r.peak_activation_bytes, r.gather_buffer_bytes));
    s.train.overlap_param_gather = false;  // two buckets at a time, after the optimizer
    EXPECT_EQ(simulate(s, make_plan(s, n), c, no_optimizer()).ranks[0].gather_buffer_bytes, 0);
  }
}

TEST(Simulate, FrozenEncoderRunsNoBackward) {
  Spec s = vlm_spec();
  s.parallel.placement = "separate";
  s.parallel.modules["vision"].pp = 2;
  s.model.encoders[0].frozen = true;
  {  // trainable projector: only the encoder's last stage (the projector) runs backward
    const SimResult r = simulate(s, make_plan(s, 3), ideal(3), no_optimizer());
    EXPECT_EQ(count_events(r, "vision fwd"), 4);  // 2 stages × 2 microbatches
    EXPECT_EQ(count_events(r, "vision bwd"), 2);
    EXPECT_NE(find_event(r, "vision bwd mb1 s1"), nullptr);
    EXPECT_EQ(r.ranks[0].peak_activation_bytes, 0);  // frozen stage keeps nothing
    EXPECT_GT(r.ranks[1].peak_activation_bytes, 0);  // the projector's
  }
  s.model.encoders[0].projector.frozen = true;
  const Plan p = make_plan(s, 3);
  EXPECT_FALSE(p.module("llm").input_grads);
  const SimResult r = simulate(s, p, ideal(3), no_optimizer());
  EXPECT_EQ(count_events(r, "vision bwd"), 0);
  EXPECT_EQ(count_events(r, "vision grad all-reduce"), 0);
  EXPECT_EQ(r.ranks[0].static_bytes, stage_costs(s, p)[0][0].param_bytes);  // params only
  // With nothing to send back, the encoders finish with their forwards.
  const TraceEvent* last = find_event(r, "vision fwd mb1 s1");
  ASSERT_NE(last, nullptr);
  EXPECT_NEAR(r.ranks[1].busy_seconds, 2 * last->seconds, 1e-12);
}

// The bridge carries a microbatch's items: one per sample, or the data shape's items per sample
// (SimOptions::data); through shared memory where the cluster has that link.
TEST(Simulate, BridgeDelaysTheLlmByTheTransfer) {
  Spec s = vlm_spec();
  s.parallel.placement = "separate";
  Cluster shm = ideal(2, 1e-4, 1);
  shm.shared_memory = {4e9, 5e-6};
  for (const Cluster& c : {ideal(2, 1e-4, 1), shm})
    for (const double items : {1.0, 3.0}) {
      SCOPED_TRACE(items);
      SimOptions o = no_optimizer();
      if (items != 1) {
        o.data.positions = o.data.tokens = o.data.targets = 100;
        o.data.sum_sq_doc_len = 100 * 100;
        o.data.items = {items};
      }
      const SimResult r = simulate(s, make_plan(s, 2), c, o);
      const TraceEvent* enc = find_event(r, "vision fwd mb0 s0");
      const TraceEvent* llm = find_event(r, "llm fwd mb0 s0");
      ASSERT_TRUE(enc && llm);
      EXPECT_EQ(enc->rank, 0);
      EXPECT_EQ(llm->rank, 1);
      // 4 samples (a microbatch) × items × 16 tokens × hidden 128 × bf16.
      const double bytes = 4.0 * items * 16 * 128 * 2;
      const double link =
          c.shared_memory.bytes_per_second > 0 ? 5e-6 + bytes / 4e9 : p2p_seconds(c, 0, 1, bytes);
      EXPECT_DOUBLE_EQ(message_seconds(s, c, 0, 1, bytes), link);
      EXPECT_NEAR(llm->start_seconds, enc->start_seconds + enc->seconds + link, 1e-12);
      // The encoder's backward waits for the LLM's first-stage backward and its gradients.
      const TraceEvent* llm_bwd = find_event(r, "llm bwd mb0 s0");
      const TraceEvent* enc_bwd = find_event(r, "vision bwd mb0 s0");
      ASSERT_TRUE(llm_bwd && enc_bwd);
      EXPECT_NEAR(enc_bwd->start_seconds, llm_bwd->start_seconds + llm_bwd->seconds + link, 1e-12);
      EXPECT_GT(r.bubble_fraction, 0);  // the LLM waits for the encoder
    }
}

// Encoder ranks split a microbatch's items, as the runtime does, not its samples: 2 samples of
// 2.5 images on 4 vision ranks are 5 images, 2 / 1 / 1 / 1 (their forwards, activations and
// bridge messages in proportion); of 2 images each, 1 / 1 / 1 / 1. By samples, two ranks would
// run a sample each and two nothing. Activation memory splits the peak sample's images.
TEST(Simulate, EncoderRanksSplitItemsNotSamples) {
  Spec s = vlm_spec();
  s.parallel.placement = "separate";
  s.parallel.modules["vision"].dp = 4;
  s.train.batch = 2;
  s.train.microbatches = 1;
  const Plan p = make_plan(s, 5);
  ASSERT_EQ(p.module("vision").layout.dp, 4);
  const Cluster c = ideal(5, 1e-4, 1);
  for (const double items : {2.5, 2.0}) {
    SCOPED_TRACE(items);
    SimOptions o = no_optimizer();
    o.data.positions = o.data.tokens = o.data.targets = 64;
    o.data.sum_sq_doc_len = 64 * 64;
    o.data.items = {items};
    const SimResult r = simulate(s, p, c, o);
    const std::vector<double> want =
        items == 2.5 ? std::vector<double>{2, 1, 1, 1} : std::vector<double>{1, 1, 1, 1};
    double forward[4] = {}, backward[4] = {};
    for (const TraceEvent& e : r.trace) {
      if (e.rank >= 4) continue;
      if (e.name == "vision fwd mb0 s0") forward[e.rank] = e.seconds;
      if (e.name == "vision bwd mb0 s0") backward[e.rank] = e.seconds;
    }
    for (int64_t k = 0; k < 4; ++k) {
      SCOPED_TRACE(k);
      EXPECT_NEAR(forward[k], forward[3] * want[k], 1e-12 * forward[3]);
      EXPECT_NEAR(backward[k], backward[3] * want[k], 1e-12 * backward[3]);
      EXPECT_NEAR(r.ranks[k].peak_activation_bytes, r.ranks[3].peak_activation_bytes * want[k],
                  1e-6 * r.ranks[3].peak_activation_bytes);
    }
    EXPECT_GT(forward[3], 0);
    // The LLM's forward starts once the largest share's images have crossed the bridge: rank 0's
    // (its forward and its message of 2 or 1 images × 16 tokens × hidden 128 × bf16).
    const TraceEvent* llm = find_event(r, "llm fwd mb0 s0");
    ASSERT_NE(llm, nullptr);
    EXPECT_NEAR(llm->start_seconds, forward[0] + p2p_seconds(c, 0, 4, want[0] * 16 * 128 * 2),
                1e-12);
  }
  // With a peak of 3 images a sample, activation memory takes the peak's split, 6 images as
  // 2 / 2 / 1 / 1 (the peak's bytes per sample, per 3 images), the time the mean's 2 / 1 / 1 / 1.
  SimOptions o = no_optimizer();
  o.data.positions = o.data.tokens = o.data.targets = 64;
  o.data.sum_sq_doc_len = 64 * 64;
  o.data.items = {2.5};
  o.data.peak_positions = o.data.peak_targets = 64;
  o.data.peak_items = {3};
  const SimResult r = simulate(s, p, c, o);
  SimOptions alone = o;
  alone.data = o.data.peak();
  const SimResult q = simulate(s, p, c, alone);  // 3 images every sample: 2 / 2 / 1 / 1 too
  const double held[4] = {2, 2, 1, 1};
  for (int64_t k = 0; k < 4; ++k) {
    SCOPED_TRACE(k);
    EXPECT_NEAR(r.ranks[k].peak_activation_bytes, r.ranks[3].peak_activation_bytes * held[k],
                1e-6 * r.ranks[3].peak_activation_bytes);
    EXPECT_NEAR(r.ranks[k].peak_activation_bytes, q.ranks[k].peak_activation_bytes,
                1e-6 * q.ranks[k].peak_activation_bytes);
  }
}

// A data shape of full rows — max_seq positions, each a loss target, one document, one item per
// encoder — is what the simulator assumes without one: the same step, FLOPs and memory, on
// layouts that send every kind of message. The data's own shape prices its positions, targets,
// documents and items: the LLM's FLOPs are those of flops.h on them, the encoder's scale with
// the items.
TEST(Simulate, PricesTheDataShape) {
  struct Case {
    std::string placement;
    std::vector<int64_t> l;  // vision tp cp pp dp, llm tp cp pp dp
    int64_t world;
  };
  const std::vector<Case> cases = {{"colocated", {1, 1, 1, 2, 1, 1, 2, 1}, 2},
                                   {"colocated", {1, 1, 1, 4, 2, 1, 1, 2}, 4},
                                   {"colocated", {1, 2, 1, 2, 1, 2, 1, 2}, 4},
                                   {"separate", {1, 1, 1, 2, 2, 1, 2, 1}, 6}};
  for (const auto& [placement, l, world] : cases) {
    Spec s = vlm_spec();
    s.parallel.placement = placement;
    s.parallel.modules["vision"] = LayoutSpec{};
    s.parallel.modules["vision"].tp = l[0], s.parallel.modules["vision"].cp = l[1];
    s.parallel.modules["vision"].pp = l[2], s.parallel.modules["vision"].dp = l[3];
    s.parallel.modules["llm"] = LayoutSpec{};
    s.parallel.modules["llm"].tp = l[4], s.parallel.modules["llm"].cp = l[5];
    s.parallel.modules["llm"].pp = l[6], s.parallel.modules["llm"].dp = l[7];
    const Plan p = make_plan(s, world);
    const Cluster c = ideal(world, 1e-5, 10);
    SCOPED_TRACE(placement + " on " + std::to_string(world) + " ranks, llm tp " +
                 std::to_string(l[4]) + " cp " + std::to_string(l[5]) + " pp " +
                 std::to_string(l[6]));
    SimOptions full;
    const double S = static_cast<double>(s.model.llm.max_seq);
    full.data.positions = full.data.tokens = full.data.targets = S;
    full.data.sum_sq_doc_len = S * S;
    full.data.items = {1};
    const SimResult a = simulate(s, p, c), b = simulate(s, p, c, full);
    EXPECT_EQ(a.step_seconds, b.step_seconds);
    EXPECT_EQ(a.model_flops, b.model_flops);
    EXPECT_EQ(a.tokens_per_step, b.tokens_per_step);
    for (size_t r = 0; r < a.ranks.size(); ++r)
      EXPECT_EQ(a.ranks[r].peak_memory_bytes, b.ranks[r].peak_memory_bytes);

    SimOptions data;
    data.data.positions = 40;
    data.data.tokens = 36;
    data.data.targets = 12;
    data.data.sum_sq_doc_len = 36 * 36;
    data.data.items = {2.5};
    const SimResult d = simulate(s, p, c, data);
    const double B = static_cast<double>(s.train.batch);
    EXPECT_DOUBLE_EQ(d.tokens_per_step, 40 * B);
    const LlmSpec& llm = s.model.llm;
    const double llm_forward = llm_forward_flops(llm, LlmTokens{40, 12, 36 * 36});
    EXPECT_NEAR(d.llm_flops, 3 * B * llm_forward, 1e-9 * d.llm_flops);  // trainable: 3x
    const double vision = a.model_flops - a.llm_flops;
    EXPECT_NEAR(d.model_flops - d.llm_flops, 2.5 * vision, 1e-9 * vision);

    // A peak sample prices activation memory and nothing else: the mean's step and FLOPs, the
    // peak's activations (planner_costs, with recomputation, likewise).
    SimOptions peaked = data;
    peaked.data.peak_positions = 64;
    peaked.data.peak_targets = 30;
    peaked.data.peak_items = {4};
    check_data_shape(s, peaked.data, "test");
    SimOptions peak_alone;
    peak_alone.data = peaked.data.peak();
    const SimResult q = simulate(s, p, c, peaked), alone = simulate(s, p, c, peak_alone);
    EXPECT_EQ(q.step_seconds, d.step_seconds);
    EXPECT_EQ(q.model_flops, d.model_flops);
    double most = 0;
    for (size_t r = 0; r < q.ranks.size(); ++r) {
      EXPECT_EQ(q.ranks[r].peak_activation_bytes, alone.ranks[r].peak_activation_bytes);
      EXPECT_GE(q.ranks[r].peak_activation_bytes, d.ranks[r].peak_activation_bytes);
      most = std::max(most, q.ranks[r].peak_activation_bytes - d.ranks[r].peak_activation_bytes);
    }
    EXPECT_GT(most, 0);
    Spec rs = s;
    rs.model.llm.recompute = true;
    const CostTable mean = planner_costs(rs, p, data), both = planner_costs(rs, p, peaked),
                    peak = planner_costs(rs, p, peak_alone);
    for (size_t i = 0; i < both.size(); ++i)
      for (size_t k = 0; k < both[i].size(); ++k) {
        EXPECT_EQ(both[i][k].backward_flops, mean[i][k].backward_flops);
        EXPECT_EQ(both[i][k].activation_bytes, peak[i][k].activation_bytes);
        EXPECT_EQ(both[i][k].recompute_peak_bytes, peak[i][k].recompute_peak_bytes);
      }
  }
}

// make_plan cuts pipeline stages on the data's sample: with a large vocabulary the output head
// of full rows (a loss on every token) weighs several blocks, and the cut leaves the last stage
// fewer; on data with few loss targets per sample it weighs less than one, the cut moves, and
// that plan is faster on this data than the full rows' plan.
TEST(Simulate, MakePlanCutsOnTheDataShape) {
  Spec s = vlm_spec();
  s.model.llm.layers = 8;
  s.model.llm.vocab = 32000;
  s.parallel.modules["llm"] = LayoutSpec{};
  s.parallel.modules["llm"].pp = 2;
  SimOptions o = no_optimizer();
  o.data.positions = o.data.tokens = 16;
  o.data.targets = 1;
  o.data.sum_sq_doc_len = 16 * 16;
  o.data.items = {6};
  const Plan full = make_plan(s, 2), data = make_plan(s, 2, nullptr, &o.data);
  const auto cuts = [](const Plan& p) {
    std::vector<std::vector<int64_t>> out;
    for (const ModulePlan& m : p.modules)
      if (m.role != ModuleRole::kProjector) out.push_back(m.stage_boundaries);
    return out;
  };
  EXPECT_NE(cuts(full), cuts(data));
  const Cluster c = ideal(2, 1e-5, 10);
  EXPECT_LT(simulate(s, data, c, o).step_seconds, simulate(s, full, c, o).step_seconds);
}

// Every layout runs without deadlock and does each unit of work exactly once: with TP / CP
// collectives off, busy time summed over ranks is the step's FLOPs at the device's rate.
TEST(Simulate, EveryLayoutConservesWork) {
  struct Case {
    std::string name, placement;
    Layout vision, llm;
    int64_t world;
    bool llm_frozen;
  };
  const std::vector<Case> cases = {
      {"colocated pp2", "colocated", {1, 1, 2, 1}, {1, 1, 2, 1}, 2, false},
      {"colocated tp2 x dp2", "colocated", {4, 1, 1, 1}, {2, 2, 1, 1}, 4, false},
      {"colocated cp2", "colocated", {1, 1, 1, 2}, {1, 1, 1, 2}, 2, false},
      {"frozen llm pp2", "colocated", {2, 1, 1, 1}, {1, 1, 2, 1}, 2, true},
      {"separate fan-in 1:2", "separate", {1, 1, 1, 1}, {2, 1, 1, 1}, 3, false},
      {"separate uneven 3:2", "separate", {3, 1, 1, 1}, {2, 1, 1, 1}, 5, false},
      {"separate fan-out 4:2 pp2", "separate", {4, 1, 1, 1}, {2, 1, 2, 1}, 8, false},
  };
  SimOptions o = no_optimizer();
  o.tp_cp_comm = false;
  for (const Case& c : cases) {
    Spec s = vlm_spec();
    s.model.llm.frozen = c.llm_frozen;
    s.parallel.placement = c.placement;
    const auto layout = [](const Layout& l) {
      LayoutSpec x;
      x.dp = l.dp, x.tp = l.tp, x.pp = l.pp, x.cp = l.cp;
      return x;
    };
    s.parallel.modules["vision"] = layout(c.vision);
    s.parallel.modules["llm"] = layout(c.llm);
    const Cluster cl = ideal(c.world, 1e-5, 10);
    const SimResult r = simulate(s, make_plan(s, c.world), cl, o);
    double busy = 0;
    for (const auto& k : r.ranks) busy += k.busy_seconds;
    // But for the encoder's front end, which each of its tp·cp ranks runs whole on every item
    // (one image per sample).
    const CostTable table = stage_costs(s, make_plan(s, c.world));
    const StageCost& front = table[0][0];
    const double again = static_cast<double>(c.vision.tp * c.vision.cp - 1) *
                         static_cast<double>(s.train.batch) *
                         (front.replicated_forward_flops + front.replicated_backward_flops);
    if (c.vision.cp > 1) {
      EXPECT_GT(again, 0) << c.name;
    }
    EXPECT_NEAR(busy, (r.model_flops + again) / 1e12, 1e-12) << c.name;
    EXPECT_GT(r.step_seconds, r.model_flops / 1e12 / static_cast<double>(c.world)) << c.name;
    if (c.llm_frozen) {  // input gradients only: backward costs what forward does
      double forward = 0;
      const CostTable costs = stage_costs(s, make_plan(s, c.world));
      for (const StageCost& sc : costs.back())
        forward += sc.forward_flops * static_cast<double>(s.train.batch);
      EXPECT_NEAR(r.llm_flops, 2 * forward, 1e-6 * forward);
      EXPECT_GT(count_events(r, "llm bwd"), 0);
    }
  }
}

TEST(Simulate, TraceIsChromeJson) {
  const SimResult r = uniform_pipeline(2, 3, 1, 2);
  const nlohmann::json j = nlohmann::json::parse(chrome_trace(r));
  ASSERT_TRUE(j.is_array());
  size_t ops = 0;
  for (const auto& e : j) {
    ops += e.at("cat") == "forward" || e.at("cat") == "backward";
    EXPECT_EQ(e.at("ph"), "X");
    EXPECT_EQ(e.at("pid"), 0);
    EXPECT_TRUE(e.at("tid") == 0 || e.at("tid") == 1);
    EXPECT_GT(e.at("dur").get<double>(), 0);
    EXPECT_TRUE(e.at("name").is_string() && e.at("ts").is_number());
  }
  EXPECT_EQ(ops, 2u * 3 * 2);  // 3 forwards and 3 backwards on each of 2 stages
  EXPECT_DOUBLE_EQ(j[0].at("dur").get<double>(), 1e6);  // 1 s forward, in microseconds
  const nlohmann::json out = nlohmann::json::parse(to_json(r));
  EXPECT_DOUBLE_EQ(out.at("step_seconds").get<double>(), r.step_seconds);
  EXPECT_EQ(out.at("ranks").size(), 2u);
  EXPECT_TRUE(out.at("ranks")[0].contains("peak_memory_bytes"));
}

TEST(Simulate, TensorParallelChargesItsAllReduces) {
  Spec s = vlm_spec();
  s.parallel.modules["llm"].tp = 2;
  s.parallel.modules["vision"].dp = 2;
  s.train.overlap_tp_comm = false;  // each collective charged whole (see the test after next)
  const Cluster c = ideal(2, 1e-5, 10);
  const SimResult r = simulate(s, make_plan(s, 2), c, no_optimizer());
  SimOptions free = no_optimizer();
  free.tp_cp_comm = false;
  const SimResult r0 = simulate(s, make_plan(s, 2), c, free);
  // Per LLM microbatch of 4 samples: 2 all-reduces per block (4), the embedding's and the loss
  // rows' gradient's in forward, 2 per block in backward, of [4·64 tokens × 128] bf16; the fused
  // vocab-parallel loss's 2 fp32 reductions over its 4·64 rows in forward (max; sum of
  // exponentials and target logit).
  const double ar = all_reduce_seconds(c, {0, 1}, 4.0 * 64 * 128 * 2);
  const double loss =
      all_reduce_seconds(c, {0, 1}, 4.0 * 64 * 4) + all_reduce_seconds(c, {0, 1}, 4.0 * 64 * 8);
  const double per_microbatch = (10 + 8) * ar + loss;
  EXPECT_NEAR(r.ranks[0].comm_seconds, 2 * per_microbatch, 1e-12);
  EXPECT_NEAR(r.step_seconds - r0.step_seconds, 2 * per_microbatch, 1e-12);

  // The loss reduces per chunk of rows (model::linear_cross_entropy_sum): a vocabulary of 2^20
  // over tp 2 makes chunks of max(hidden, 32 Mi / 2^19) = 128 rows, so each microbatch's 4·64
  // rows make 2 chunks of 2 reductions each.
  Spec big = s;
  big.model.llm.vocab = int64_t{1} << 20;
  const double chunked =
      2 * (all_reduce_seconds(c, {0, 1}, 128.0 * 4) + all_reduce_seconds(c, {0, 1}, 128.0 * 8));
  EXPECT_NEAR(simulate(big, make_plan(big, 2), c, no_optimizer()).ranks[0].comm_seconds,
              2 * ((10 + 8) * ar + chunked), 1e-12);

  // On the data's sample (40 positions, 12 loss targets): the blocks' and the embedding's
  // collectives over the positions, the loss's over its rows, the targets.
  SimOptions data = no_optimizer();
  data.data.positions = 40;
  data.data.tokens = 36;
  data.data.targets = 12;
  data.data.sum_sq_doc_len = 36 * 36;
  data.data.items = {1};
  const SimResult d = simulate(s, make_plan(s, 2), c, data);
  const double on_data = 17 * all_reduce_seconds(c, {0, 1}, 4.0 * 40 * 128 * 2) +
                         all_reduce_seconds(c, {0, 1}, 4.0 * 12 * 128 * 2) +
                         all_reduce_seconds(c, {0, 1}, 4.0 * 12 * 4) +
                         all_reduce_seconds(c, {0, 1}, 4.0 * 12 * 8);
  EXPECT_NEAR(d.ranks[0].comm_seconds, 2 * on_data, 1e-12);

  // Through shared memory (cluster.h): the same collectives at its price; none are hidden.
  Cluster shm = c;
  shm.shared_memory = {20e9, 1e-6};
  const auto through = [&](double bytes) {
    return blocking_collective_seconds(s, shm, {0, 1}, CollectiveKind::kAllReduce, bytes);
  };
  EXPECT_DOUBLE_EQ(through(4.0 * 64 * 128 * 2), 1e-6 + 3 * 4.0 * 64 * 128 * 2 / 20e9);
  const double shm_loss = through(4.0 * 64 * 4) + through(4.0 * 64 * 8);
  EXPECT_NEAR(simulate(s, make_plan(s, 2), shm, no_optimizer()).ranks[0].comm_seconds,
              2 * ((10 + 8) * through(4.0 * 64 * 128 * 2) + shm_loss), 1e-12);
  Spec overlapped = s;
  overlapped.train.overlap_tp_comm = true;
  EXPECT_NEAR(simulate(overlapped, make_plan(s, 2), shm, no_optimizer()).ranks[0].comm_seconds,
              2 * ((10 + 8) * through(4.0 * 64 * 128 * 2) + shm_loss), 1e-12);
}

// Sequence parallelism's collectives, one by one as the runtime issues them (dist/collectives.h).
// Per block going forward: an all-gather before each column-parallel linear, a reduce-scatter
// after each row-parallel one. Backward: the reverse of each, and where the weights train the
// column-parallel inputs gathered again for their gradients. Besides: the embedding's all-reduce,
// the last stage's gather of its hidden states, the loss's reductions and its rows' gradient's
// all-reduce going forward; the first stage's gather of its tokens' gradient in backward.
TEST(Simulate, SequenceParallelChargesItsGathersAndScatters) {
  Spec s = vlm_spec();
  s.parallel.modules["llm"].tp = 2;
  s.parallel.modules["llm"].sp = true;
  s.parallel.modules["vision"].dp = 2;
  s.train.overlap_tp_comm = false;  // each collective charged whole (see the next test)
  const Cluster c = ideal(2, 1e-5, 10);
  SimOptions free = no_optimizer();
  free.tp_cp_comm = false;
  // Per LLM microbatch of 4 samples: [4·64 tokens × 128] bf16, 4 blocks.
  const double bytes = 4.0 * 64 * 128 * 2, blocks = 4;
  const double ar = all_reduce_seconds(c, {0, 1}, bytes), ag = all_gather_seconds(c, {0, 1}, bytes),
               rs = reduce_scatter_seconds(c, {0, 1}, bytes);
  const double loss =
      all_reduce_seconds(c, {0, 1}, 4.0 * 64 * 4) + all_reduce_seconds(c, {0, 1}, 4.0 * 64 * 8);
  for (bool frozen : {false, true}) {
    SCOPED_TRACE(frozen ? "frozen LLM" : "trained LLM");
    s.model.llm.frozen = frozen;
    const Plan plan = make_plan(s, 2);
    const SimResult r = simulate(s, plan, c, no_optimizer());
    const SimResult r0 = simulate(s, plan, c, free);
    // The loss rows' gradient's all-reduce in forward (model/cross_entropy.h).
    const double forward = blocks * 2 * (ag + rs) + ar + ag + loss + ar;
    const double backward = blocks * (2 * (ag + rs) + (frozen ? 0 : 2 * ag)) + ag;
    EXPECT_NEAR(r.ranks[0].comm_seconds, 2 * (forward + backward), 1e-12);
    EXPECT_NEAR(r.step_seconds - r0.step_seconds, 2 * (forward + backward), 1e-12);
    // At the end of the step the norms' gradients, partial on each rank's positions, are summed
    // over TP in fp32 (4 blocks' two RMSNorms and the final one: 9 · 128); on both TP ranks,
    // once; none where nothing trains, nor for the vision encoder (no SP).
    const double partial = all_reduce_seconds(c, {0, 1}, 4.0 * 9 * 128);
    EXPECT_EQ(count_events(r, "sequence-parallel grad all-reduce"), frozen ? 0 : 2);
    for (const TraceEvent& e : r.trace)
      if (e.name == "llm sequence-parallel grad all-reduce") {
        EXPECT_NEAR(e.seconds, partial, 1e-15);
      }
  }
  // Through shared memory: an all-gather reads the gathered tensor, a reduce-scatter its row of
  // both ranks' tensors (cluster.h); the norms' partial sums take it too.
  s.model.llm.frozen = false;
  Cluster shm = c;
  shm.shared_memory = {20e9, 1e-6};
  const double sag = 1e-6 + 1.5 * bytes / 20e9, srs = 1e-6 + 2 * bytes / 20e9,
               sar = 1e-6 + 3 * bytes / 20e9;
  const double shm_loss = 2e-6 + 3 * (4.0 * 64 * 4 + 4.0 * 64 * 8) / 20e9;
  const SimResult r = simulate(s, make_plan(s, 2), shm, no_optimizer());
  const double forward = blocks * 2 * (sag + srs) + sar + sag + shm_loss + sar;
  const double backward = blocks * (2 * (sag + srs) + 2 * sag) + sag;
  EXPECT_NEAR(r.ranks[0].comm_seconds, 2 * (forward + backward), 1e-12);
  for (const TraceEvent& e : r.trace)
    if (e.name == "llm sequence-parallel grad all-reduce") {
      EXPECT_NEAR(e.seconds, 1e-6 + 3 * 4.0 * 9 * 128 / 20e9, 1e-15);
    }
}

// With train.overlap_tp_comm (the default) a column-parallel linear's backward hides its input
// gradient's reduction behind its weight gradient's matmul and, under SP, the re-gather of its
// input behind its input gradient's matmul (dist::column_linear): each up to that matmul's
// seconds. Only where the weights train; not on CPU ranks, where Gloo takes the matmuls' core.
TEST(Simulate, ColumnParallelBackwardHidesItsCollectives) {
  Spec s = vlm_spec();
  s.parallel.modules["llm"].tp = 2;
  s.parallel.modules["vision"].dp = 2;
  // Per microbatch 4·64 tokens over tp 2, at 1e12 FLOP/s (2e12 peak x 0.5 efficiency); per
  // block the QKV projection (128 -> 128 + 2·64) and SwiGLU's gate and up (128 -> 2·384).
  const double per_flop = 4.0 * 64 / 2 / 1e12;
  const double matmuls = 4 * (2 * 128 * (128 + 2 * 64) + 2 * 128 * 2 * 384) * per_flop;
  const double ar = all_reduce_seconds(ideal(2, 0, 1e6), {0, 1}, 4.0 * 64 * 128 * 2);
  const auto hidden = [&](const Cluster& c, const SimOptions& o) {
    s.train.overlap_tp_comm = true;
    const SimResult on = simulate(s, make_plan(s, 2), c, o);
    s.train.overlap_tp_comm = false;
    const SimResult off = simulate(s, make_plan(s, 2), c, o);
    EXPECT_NEAR(off.step_seconds - on.step_seconds,
                off.ranks[0].comm_seconds - on.ranks[0].comm_seconds, 1e-12);
    return off.ranks[0].comm_seconds - on.ranks[0].comm_seconds;
  };
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sp" : "tp");
    s.parallel.modules["llm"].sp = sp;
    s.model.llm.frozen = false;
    // Slow links: every collective outlasts its matmul, which it hides whole (two per linear
    // under SP), in each of the 2 microbatches.
    EXPECT_NEAR(hidden(ideal(2, 1e-4, 10), no_optimizer()), 2 * (sp ? 2 : 1) * matmuls, 1e-15);
    // Fast links: every hidable collective hides whole: 2 linears x 4 blocks of all-reduces (of
    // reduce-scatters and all-gathers, each half an all-reduce, under SP).
    if (!sp) {
      EXPECT_NEAR(hidden(ideal(2, 0, 1e6), no_optimizer()), 2 * 8 * ar, 1e-15);
    }
    SimOptions cpu = no_optimizer();
    cpu.comm_occupies_rank = true;
    EXPECT_EQ(hidden(ideal(2, 1e-5, 10), cpu), 0);
    Cluster shm = ideal(2, 1e-5, 10);  // waited for where issued (dist::column_linear)
    shm.shared_memory = {1e9, 1e-5};
    EXPECT_EQ(hidden(shm, no_optimizer()), 0);
    s.model.llm.frozen = true;  // no weight gradients: nothing follows the reductions
    EXPECT_EQ(hidden(ideal(2, 1e-5, 10), no_optimizer()), 0);
  }
}

TEST(Simulate, TinyVlmOnThisMachine) {
  const Spec s = load_spec(WEFT_SOURCE_DIR "/configs/tiny-vlm.toml");
  const Cluster c = load_cluster(WEFT_SOURCE_DIR "/configs/clusters/cpu-local.toml");
  for (int64_t world : {1, 2}) {
    const SimResult r = simulate(s, make_plan(s, world), c);
    EXPECT_GT(r.step_seconds, 0);
    EXPECT_GT(r.mfu, 0);
    EXPECT_LT(r.mfu, 0.7);
    EXPECT_TRUE(r.memory_fits);
    EXPECT_EQ(static_cast<int64_t>(r.ranks.size()), world);
  }
  EXPECT_NE(error_of([&] {
              simulate(s, make_plan(s, 4), c);
            }).find("the plan needs 4 ranks but the cluster"),
            std::string::npos);
}

}  // namespace
}  // namespace weft::plan
