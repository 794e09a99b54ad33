// weft_bench_scenarios: the planner on Cornstarch-like scenarios (configs/scenarios/*.toml) on
// simulated H100 clusters of 64-1172 GPUs. For each model and cluster size it runs the layout
// search (plan/search.h) four times and prints one markdown row:
//   weft        the full search (placement, per-module layouts, GPU split, microbatches, ZeRO-1,
//               recomputation); its wall time is the "plan s" column
//   Megatron    Megatron-LM's multimodal baseline: every encoder on the ranks of the LLM's first
//               pipeline stage with the LLM's tp (or its largest divisor the encoder allows),
//               pp = cp = 1, data parallel over those ranks; the LLM's layers split evenly over
//               its stages; its own best tp / pp / dp / microbatches / ZeRO-1 / recomputation
//               (and interleaved 1F1B, tried on its best layouts as on weft's)
//               (search placement "megatron")
//   colocated   the best plan with every module on every rank (search placement "colocated")
//   separate    the best plan with disjoint rank spans (search placement "separate")
// All figures are simulator predictions (plan/simulate.h) on the same cluster model; MFU is over
// every device of the cluster (a plan may leave some idle). `--write` replaces its section of
// bench/RESULTS.md, between the markers <!-- bench/scenarios begin --> and ... end -->.
//
// `--tight-memory` instead runs some scenarios on H100s with less usable memory, where plans
// must recompute, and compares per row (section <!-- bench/recompute begin -->):
//   none/all    the search recomputing a module's every block or none
//   per stage   the search with partial recomputation (--partial-recompute: each pipeline
//               stage's first blocks, as many as its ranks need, fitted by the simulator, and
//               the stage boundaries moved with them, SearchOptions::move_boundaries)
//   same cuts   that search keeping the boundaries it cuts without recomputation
//               (move_boundaries off)
//   uniform     the per-stage winner with each module's largest count on every stage (what
//               one recompute_blocks count for the module needs to fit the same layout)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/search.h"

namespace {

using namespace weft;

// H100 SXM nodes of 8: NVLink 4 (450 GB/s per direction per GPU), one 400 Gb/s NDR NIC per GPU;
// `gib` > 0: that much usable memory per GPU instead of 80 GiB.
plan::Cluster h100_cluster(int64_t gpus, int64_t gib = 0) {
  const int64_t nodes = (gpus + 7) / 8;
  const std::string device =
      gib > 0 ? "[device]\nbase = \"h100\"\nmemory_gib = " + std::to_string(gib) + "\n"
              : "device = \"h100\"\n";
  return plan::parse_cluster("nodes = " + std::to_string(nodes) + "\ngpus_per_node = 8\n" + device +
                                 "[intra_node]\nbandwidth_gbs = 450\nlatency_us = 3\n"
                                 "[inter_node]\nbandwidth_gbs = 50\nlatency_us = 8\n",
                             "h100 x " + std::to_string(gpus));
}

struct Scenario {
  std::string label, config;
  std::vector<std::string> sets;
  std::vector<int64_t> gpus;
};

struct Outcome {
  double step = 0, mfu = 0;  // MFU over every device
  std::string layout;
  plan::Candidate candidate;
  double seconds = 0;
  bool complete = true, found = false;
};

// --partial-recompute: every search, weft's and the baselines', also tries recomputing each
// chunk's first blocks (SearchOptions::partial_recompute).
bool g_partial = false;

// The best plan of `placements`; `table`: with the five-row table `weft plan` prints (its
// runner-ups simulated too), else the winner only.
Outcome run(const Spec& spec, const plan::Cluster& cluster, int64_t gpus,
            const std::vector<std::string>& placements, bool table = false,
            bool partial = g_partial, bool move_boundaries = true) {
  plan::SearchOptions o;
  o.partial_recompute = partial;
  o.move_boundaries = move_boundaries;
  o.max_ranks = gpus;
  o.placements = placements;
  if (!table) o.top = 1, o.report_slack = 0;
  o.time_budget_seconds = 120;
  o.max_simulations = 1000;
  Outcome out;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    const plan::SearchResult r = plan::search(spec, cluster, o);
    const plan::Evaluation& e = r.best.front();
    out.step = e.sim.step_seconds;
    out.mfu = e.sim.mfu * static_cast<double>(e.candidate.world_size) / static_cast<double>(gpus);
    out.layout = plan::describe(spec, e.candidate);
    out.candidate = e.candidate;
    out.complete = r.stats.complete;
    out.found = true;
  } catch (const Error& e) {
    out.layout = e.what();
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

std::string pct(const Outcome& o) {
  if (!o.found) return "does not fit";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%%s", 100 * o.mfu, o.complete ? "" : "*");
  return buf;
}

// A table cell: the layout's '|' separators escaped for markdown.
std::string cell(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '|' ? std::string("\\|") : std::string(1, c);
  return out;
}

// Replaces bench/RESULTS.md's section `name` (between <!-- bench/NAME begin --> and ... end -->,
// which `section` carries) with `section`, or appends it.
int replace_section(const std::string& root, const std::string& name, const std::string& section) {
  const std::string path = root + "/bench/RESULTS.md";
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string all = text.str();
  const std::string begin = "<!-- bench/" + name + " begin -->",
                    end = "<!-- bench/" + name + " end -->";
  const size_t a = all.find(begin), b = all.find(end);
  if (a != std::string::npos && b != std::string::npos && b > a) {
    all.replace(a, b + end.size() + 1 - a, section);
  } else {
    all += "\n" + section;
  }
  std::ofstream out(path, std::ios::trunc);
  out << all;
  if (!out.flush()) {
    std::fprintf(stderr, "%s: cannot write\n", path.c_str());
    return 1;
  }
  std::fprintf(stderr, "wrote %s\n", path.c_str());
  return 0;
}

// --tight-memory: see the top of this file.
int tight_memory(const std::string& root, bool write) {
  struct Case {
    std::string label, config;
    int64_t gpus, gib;
  };
  const std::vector<Case> cases = {
      {"ViT-22B + Qwen2-72B", "vit22b-qwen2-72b.toml", 256, 24},
      {"ViT-22B + Qwen2-72B", "vit22b-qwen2-72b.toml", 128, 40},
      {"EVA-CLIP-18B + Whisper-1.5B + Llama-3-70B", "evaclip18b-whisper-llama70b.toml", 128, 40},
      {"LLaVA-1.5-7B (CLIP-L/336 + Vicuna-7B)", "llava15-7b.toml", 16, 16},
      {"SigLIP-878M + Mistral-7B", "siglip-mistral7b.toml", 8, 24},
  };
  std::ostringstream md;
  md << "| scenario | GPUs | GiB | none/all: plan | MFU | per stage: plan | MFU | vs none/all | "
        "same cuts MFU | vs same cuts | uniform MFU | vs uniform | plan s (none/all, same cuts, "
        "per stage) |\n"
        "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Case& c : cases) {
    const Spec spec = load_spec(root + "/configs/scenarios/" + c.config);
    const plan::Cluster cluster = h100_cluster(c.gpus, c.gib);
    const std::vector<std::string> both = {"colocated", "separate"};
    const Outcome whole = run(spec, cluster, c.gpus, both, false, false);
    const Outcome fixed = run(spec, cluster, c.gpus, both, false, true, false);
    const Outcome staged = run(spec, cluster, c.gpus, both, false, true);
    std::string uniform = "n/a", vs_whole = "n/a", vs_uniform = "n/a", vs_fixed = "n/a";
    char buf[64];
    if (whole.found && staged.found) {
      std::snprintf(buf, sizeof buf, "%.3fx", whole.step / staged.step);
      vs_whole = buf;
    }
    if (fixed.found && staged.found) {
      std::snprintf(buf, sizeof buf, "%.3fx", fixed.step / staged.step);
      vs_fixed = buf;
    }
    if (staged.found) {
      plan::Candidate even = staged.candidate;
      for (std::vector<int64_t>& v : even.recompute_blocks)
        if (v.size() > 1) v = {*std::max_element(v.begin(), v.end())};
      const plan::Evaluation e = plan::evaluate(spec, cluster, even);
      if (e.sim.memory_fits) {
        const double mfu =
            e.sim.mfu * static_cast<double>(even.world_size) / static_cast<double>(c.gpus);
        std::snprintf(buf, sizeof buf, "%.1f%%", 100 * mfu);
        uniform = buf;
        std::snprintf(buf, sizeof buf, "%.3fx", e.sim.step_seconds / staged.step);
        vs_uniform = buf;
      } else {
        uniform = "does not fit";
      }
    }
    std::snprintf(buf, sizeof buf, "%.1f, %.1f, %.1f", whole.seconds, fixed.seconds,
                  staged.seconds);
    std::ostringstream row;
    row << "| " << c.label << " | " << c.gpus << " | " << c.gib << " | "
        << cell(whole.found ? whole.layout : "does not fit") << " | " << pct(whole) << " | "
        << cell(staged.found ? staged.layout : "does not fit") << " | " << pct(staged) << " | "
        << vs_whole << " | " << pct(fixed) << " | " << vs_fixed << " | " << uniform << " | "
        << vs_uniform << " | " << buf << " |\n";
    md << row.str();
    std::fprintf(stderr, "%s", row.str().c_str());
  }
  std::ostringstream section;
  section << "<!-- bench/recompute begin -->\n"
          << "## Recomputation under tight memory: per pipeline stage vs every block or none "
             "(simulated H100 clusters with less usable memory)\n\n"
          << "Reproduce: `ninja -C build weft_bench_scenarios && build/weft_bench_scenarios "
             "--tight-memory --write`. The scenarios above on H100s whose usable memory is cut "
             "to `GiB` (as where other work shares the GPUs), so that plans must recompute. "
             "none/all: weft's search recomputing a module's every block or none; per stage: "
             "with `--partial-recompute`, each pipeline stage recomputing the first blocks of "
             "its chunks, as many as its own ranks need (`recompute_blocks = [n0, n1, ...]`; "
             "`describe` writes `module:[n0/n1/... of m0/m1/...]`: n0 of stage 0's m0 blocks), "
             "fitted by the simulator, with each pipelined module's stage boundaries moved "
             "with its counts (AdaPipe's co-optimisation: a stage that would recompute much "
             "gives blocks to one that recomputes little); same cuts: that search keeping the "
             "boundaries it cuts without recomputation (`SearchOptions::move_boundaries` off); "
             "uniform: the per-stage plan with each module's largest count on every stage (one "
             "`recompute_blocks` count, the fewest that fits the same layout). Ratios are "
             "step-time speed-ups of the per-stage plan, predicted by weft's simulator, "
             "measured in the same run. `plan s`: the three searches' wall time on this 2-core "
             "machine.\n\n"
          << md.str() << "<!-- bench/recompute end -->\n";
  std::printf("%s", section.str().c_str());
  return write ? replace_section(root, "recompute", section.str()) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string root = WEFT_SOURCE_DIR;
  bool write = false, quick = false, tight = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--write")) {
      write = true;
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--partial-recompute")) {
      g_partial = true;
    } else if (!std::strcmp(argv[i], "--tight-memory")) {
      tight = true;
    } else if (!std::strcmp(argv[i], "--root") && i + 1 < argc) {
      root = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: weft_bench_scenarios [--quick] [--partial-recompute] "
                   "[--tight-memory] [--write] [--root SOURCE_DIR]\n"
                   "  --quick  the smallest cluster of each scenario only\n"
                   "  --partial-recompute  also search recompute_blocks (weft plan's flag)\n"
                   "  --tight-memory  recomputation per stage vs every block or none, on GPUs "
                   "with less memory\n"
                   "  --write  replace the section of bench/RESULTS.md\n");
      return 2;
    }
  }
  if (tight) return tight_memory(root, write);
  const std::vector<Scenario> scenarios = {
      {"ViT-22B + Qwen2-72B", "vit22b-qwen2-72b.toml", {}, {256, 1024}},
      {"ViT-22B (frozen) + Qwen2-72B",
       "vit22b-qwen2-72b.toml",
       {"model.vision.frozen=true"},
       {256, 1024}},
      {"EVA-CLIP-18B + Whisper-1.5B + Llama-3-70B",
       "evaclip18b-whisper-llama70b.toml",
       {},
       {256, 1024}},
      {"SigLIP-878M + Mistral-7B", "siglip-mistral7b.toml", {}, {64, 256}},
      {"SigLIP-878M (frozen) + Mistral-7B",
       "siglip-mistral7b.toml",
       {"model.vision.frozen=true"},
       {64, 256}},
      {"LLaVA-1.5-7B (CLIP-L/336 + Vicuna-7B)", "llava15-7b.toml", {}, {64, 256}},
      {"LLaVA-style CLIP-L/336 + Mixtral-8x7B (MoE)", "clip-mixtral-8x7b.toml", {}, {64, 256}},
      {"DistTrain MLLM-72B scale (InternViT-6B + Qwen2-72B)", "disttrain-72b.toml", {}, {1172}},
  };
  std::ostringstream md;
  md << "| scenario | GPUs | weft plan (predicted) | weft MFU | Megatron-style MFU | speed-up | "
        "best colocated MFU | best separate MFU | plan s |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|\n";
  std::string disttrain;
  for (const Scenario& s : scenarios) {
    const Spec spec = load_spec(root + "/configs/scenarios/" + s.config, s.sets);
    for (size_t g = 0; g < s.gpus.size() && (!quick || g == 0); ++g) {
      const int64_t gpus = s.gpus[g];
      const plan::Cluster cluster = h100_cluster(gpus);
      const Outcome weft = run(spec, cluster, gpus, {"colocated", "separate"});
      const Outcome megatron = run(spec, cluster, gpus, {"megatron"});
      const Outcome colocated = run(spec, cluster, gpus, {"colocated"});
      const Outcome separate = run(spec, cluster, gpus, {"separate"});
      char speedup[32] = "n/a";
      if (weft.found && megatron.found)
        std::snprintf(speedup, sizeof speedup, "%.2fx", megatron.step / weft.step);
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", weft.seconds);
      std::ostringstream row;
      row << "| " << s.label << " | " << gpus << " | " << cell(weft.layout) << " | " << pct(weft)
          << " | " << pct(megatron) << " | " << speedup << " | " << pct(colocated) << " | "
          << pct(separate) << " | " << secs << " |\n";
      md << row.str();
      std::fprintf(stderr, "%s", row.str().c_str());
      if (s.config == "disttrain-72b.toml") {
        const Outcome cli = run(spec, cluster, gpus, {"colocated", "separate"}, true);
        char buf[640];
        std::snprintf(buf, sizeof buf,
                      "DistTrain reports 54.7%% MFU for its 72B MLLM on 1172 GPUs (arXiv "
                      "2408.04275); weft's plan for a model of that scale is predicted at %.1f%% "
                      "MFU over all 1172 GPUs (%.3f s per step of %lld samples). The search "
                      "takes %.1f s on this machine for the winner alone, %.1f s with the "
                      "five-row table `weft plan` prints (its runner-ups are simulated too).\n",
                      100 * weft.mfu, weft.step, static_cast<long long>(spec.train.batch),
                      weft.seconds, cli.seconds);
        disttrain = buf;
      }
    }
  }
  std::ostringstream section;
  section << "<!-- bench/scenarios begin -->\n"
          << "## Planner scenarios: weft's plan vs Megatron-LM-style and single-placement plans "
             "(simulated H100 clusters)\n\n"
          << "Reproduce: `ninja -C build weft_bench_scenarios && build/weft_bench_scenarios "
          << (g_partial ? "--partial-recompute " : "")
          << "--write`. Every figure is a prediction of weft's simulator (FLOP model at 70% of "
             "the H100's 989 TFLOP/s bf16 peak, NVLink 450 GB/s and 50 GB/s per GPU between "
             "nodes, alpha-beta collectives; full `max_seq` rows with a loss on every token, as "
             "`weft plan --full-rows`), not a measurement; MFU is over every GPU of the "
             "cluster. Megatron-style: the encoders on the ranks of the LLM's first pipeline "
             "stage with the LLM's tensor parallelism (or its largest divisor the encoder "
             "allows), no pipeline, context or sequence parallelism for them (Megatron-LM's "
             "examples/multimodal: its vision model does not use SP or CP), the LLM's layers "
             "split evenly, its own best tp / pp / dp / sp, microbatches, ZeRO-1 and "
             "recomputation. Memory: tensor parallelism without SP keeps the residual stream "
             "(norms' inputs and outputs, a recomputed block's input) whole on every TP rank. "
             "Both weft's and the Megatron-style plans hide TP's backward collectives behind "
             "the column-parallel linears' own matmuls, up to those matmuls' time, as "
             "Megatron-LM's asynchronous TP communication does. Both search interleaved 1F1B "
             "(`vp` 1 to 4 chunks per LLM pipeline rank, Megatron-LM's virtual pipeline; "
             "weft's chunks cut evenly by work, Megatron's by block count, and only with at "
             "least pp microbatches) as part of the space the bound covers. "
             "Colocated / separate: the best plan with that placement only (separate includes "
             "the DistTrain-style split of the GPUs). `*`: the search budget ran out before "
             "the bound closed (1000 simulations or 120 s). `plan s` is the wall time of weft's "
             "search on this 2-core machine, simulating candidates on both cores. Model shapes and "
             "their sources are in `configs/scenarios/`.\n\n"
          << md.str() << "\n"
          << disttrain << "<!-- bench/scenarios end -->\n";
  std::printf("%s", section.str().c_str());
  return write ? replace_section(root, "scenarios", section.str()) : 0;
}
