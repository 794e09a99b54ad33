#include "cli/plan.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/validators.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/profile.h"
#include "weft/plan/search.h"
#include "weft/train/data_shape.h"

namespace weft::cli {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct PlanArgs {
  std::string config, cluster, out, snippet, json;
  std::string profile;  // measured costs (weft bench profile); "" = the FLOP model
  std::vector<std::string> sets, placements;
  int64_t world = 0;  // without --cluster: ranks to plan for (default 1); with: devices to use
  int64_t top = 5, max_simulations = 400, threads = 0;
  double time_budget = 50, gap = 0.5;  // gap in percent
  bool partial_recompute = false;
  bool full_rows = false;  // price max_seq rows with one item per encoder, not the data's
};

void write_file(const std::string& path, const std::string& text, const char* what) {
  std::ofstream f(path, std::ios::trunc);
  WEFT_CHECK(f, path, ": cannot open the ", what, " for writing");
  f << text;
  WEFT_CHECK(f.flush(), path, ": writing the ", what, " failed");
}

double peak(const plan::SimResult& r) {
  double p = 0;
  for (const plan::RankReport& k : r.ranks) p = std::max(p, k.peak_memory_bytes);
  return p;
}

void check_rows(bool full_rows, bool profiled) {
  WEFT_CHECK(!(full_rows && profiled),
             "--full-rows prices the FLOP model; a --profile's costs are measured on its own rows");
}

// f(), whose errors reading the dataset say how to plan without it.
template <typename F>
auto reading_data(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    throw Error(std::string(e.what()) +
                " (reading the dataset for the data's mean sample, which the FLOP model prices; "
                "--full-rows prices max_seq rows instead, without the data)");
  }
}

}  // namespace

const plan::DataShape& price_on_data(const Spec& spec, bool full_rows, const plan::Profile* profile,
                                     plan::SimOptions* options) {
  check_rows(full_rows, profile != nullptr);
  if (profile) {  // the profile's recorded sample (what its simulations price)
    plan::check_profile(*profile, spec);
    options->data = plan::profile_data_shape(*profile, spec);
  }
  if (full_rows || profile) return options->data;
  const train::MeasuredData m = reading_data([&] { return train::measure_data_shape(spec); });
  options->data = m.shape;
  if (spec.model.llm.vocab == 0) options->unset_vocab = m.vocab;
  return options->data;
}

std::string data_shape_line(const Spec& spec, const plan::DataShape& d) {
  char buf[256];
  if (d.empty()) {
    std::snprintf(buf, sizeof buf,
                  "priced on full rows: %lld tokens per sample, loss on each, one item per encoder",
                  static_cast<long long>(spec.model.llm.max_seq));
    return buf;
  }
  std::snprintf(buf, sizeof buf,
                "priced on the data's mean sample (%lld samples): %.1f tokens in %.1f positions "
                "(max_seq %lld), %.1f loss targets",
                static_cast<long long>(d.samples), d.tokens, d.positions,
                static_cast<long long>(spec.model.llm.max_seq), d.targets);
  std::string line = buf;
  for (size_t e = 0; e < spec.model.encoders.size(); ++e) {
    std::snprintf(buf, sizeof buf, ", %.2f %s items", d.items[e],
                  spec.model.encoders[e].name.c_str());
    line += buf;
  }
  if (d.has_peak()) {
    std::snprintf(buf, sizeof buf, "; activation memory on %.0f positions per sample",
                  d.peak_positions);
    line += buf;
  }
  return line + " (--full-rows: max_seq rows)";
}

namespace {

int run_search(const PlanArgs& a) {
  const Spec spec = load_spec(a.config, a.sets);
  const plan::Cluster cluster = plan::load_cluster(a.cluster);
  std::unique_ptr<plan::Profile> profile;
  if (!a.profile.empty()) profile = std::make_unique<plan::Profile>(plan::load_profile(a.profile));
  plan::SearchOptions o;
  o.profile = profile.get();
  const plan::DataShape& data = price_on_data(spec, a.full_rows, profile.get(), &o.sim);
  o.max_ranks = a.world;
  if (!a.placements.empty()) o.placements = a.placements;
  o.top = a.top;
  o.max_simulations = a.max_simulations;
  o.time_budget_seconds = a.time_budget;
  o.gap = a.gap / 100;
  o.threads = a.threads;
  o.partial_recompute = a.partial_recompute;
  const plan::SearchResult r = plan::search(spec, cluster, o);
  const plan::SearchStats& st = r.stats;
  const int64_t devices = a.world > 0 ? a.world : cluster.world_size();
  const plan::Evaluation& win = r.best.front();

  std::printf("weft plan: %s on %s: %lld x %s (%.0f GiB)\n", a.config.c_str(), a.cluster.c_str(),
              static_cast<long long>(devices), cluster.device.name.c_str(),
              cluster.device.memory_bytes / kGiB);
  if (profile)
    std::printf("priced by the measured profile %s (%s)\n", a.profile.c_str(),
                profile->device.c_str());
  else
    std::printf("%s\n", data_shape_line(spec, data).c_str());
  char within[96];
  std::snprintf(within, sizeof within,
                "the winner is within %g%% of the simulator's optimum over the space", a.gap);
  const std::string verdict = !st.complete ? "stopped by the budget, the winner may not be optimal"
                              : a.gap > 0  ? within
                                           : "the winner is the simulator's optimum over the space";
  std::printf(
      "searched %lld candidates (%lld over memory by the analytic filter), simulated %lld in "
      "%.1f s: %s\n",
      static_cast<long long>(st.nodes), static_cast<long long>(st.memory_filtered),
      static_cast<long long>(st.simulated), st.seconds, verdict.c_str());
  std::printf("%3s %10s %7s %11s %7s %8s %6s  %s\n", "#", "step s", "MFU", "tokens/s", "bubble",
              "GiB/GPU", "GPUs", "layout");
  for (size_t i = 0; i < r.best.size(); ++i) {
    const plan::Evaluation& e = r.best[i];
    std::printf("%3zu %10.4g %6.1f%% %11.4g %6.1f%% %8.1f %6lld  %s\n", i + 1, e.sim.step_seconds,
                100 * e.sim.mfu, e.sim.tokens_per_second, 100 * e.sim.bubble_fraction,
                peak(e.sim) / kGiB, static_cast<long long>(e.candidate.world_size),
                plan::describe(spec, e.candidate).c_str());
  }
  const double cluster_mfu =
      win.sim.mfu * static_cast<double>(win.candidate.world_size) / static_cast<double>(devices);
  if (win.candidate.world_size < devices)
    std::printf("the winner uses %lld of the %lld devices: MFU over all of them %.1f%%\n",
                static_cast<long long>(win.candidate.world_size), static_cast<long long>(devices),
                100 * cluster_mfu);
  if (!st.complete)
    std::printf(
        "the budget stopped the search: no plan left is faster than %.4g s, so the winner is "
        "within %.1f%% of the optimum (--max-simulations, --time-budget)\n",
        st.open_bound, 100 * (1 - st.open_bound / win.sim.step_seconds));
  std::printf("why: %s\n", r.why.c_str());

  const std::string snippet = plan::config_snippet(spec, win.candidate);
  // The user's own overrides first, then the plan's (later ones win), each one shell word.
  std::vector<std::string> sets = a.sets;
  for (const std::string& s : plan::config_overrides(spec, win.candidate)) sets.push_back(s);
  // One shell word: as is when plain, else single-quoted.
  const auto word = [](const std::string& s) {
    if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                          "0123456789._=,:+-/") == std::string::npos)
      return s;
    std::string quoted = "'";
    for (char ch : s) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    return quoted + "'";
  };
  std::string flags;
  for (const std::string& s : sets) flags += " --set " + word(s);
  std::printf("\nconfig that reproduces it (merge into %s%s):\n%s\n", a.config.c_str(),
              a.sets.empty() ? "" : ", with your --set overrides", snippet.c_str());
  std::printf("or: weft plan %s --world-size %lld%s\n", word(a.config).c_str(),
              static_cast<long long>(win.candidate.world_size), flags.c_str());
  std::printf("run it on %lld ranks (weft launch --nproc %lld, or WORLD_SIZE=%lld)\n",
              static_cast<long long>(win.candidate.world_size),
              static_cast<long long>(win.candidate.world_size),
              static_cast<long long>(win.candidate.world_size));
  if (!a.out.empty()) {
    write_file(a.out, plan::to_json(win.plan) + "\n", "plan");
    std::printf("wrote the plan to %s\n", a.out.c_str());
  }
  if (!a.snippet.empty()) {
    write_file(a.snippet,
               "# weft plan " + a.config + " --cluster " + a.cluster + ": " +
                   plan::describe(spec, win.candidate) + "\n# on " +
                   std::to_string(win.candidate.world_size) + " ranks\n" + snippet,
               "config snippet");
    std::printf("wrote the config snippet to %s\n", a.snippet.c_str());
  }
  if (!a.json.empty()) {
    nlohmann::ordered_json j;
    j["config"] = a.config;
    j["cluster"] = a.cluster;
    if (profile) j["profile"] = a.profile;
    j["data_shape"] = plan::data_shape_json(spec, data);
    j["devices"] = devices;
    j["stats"] = {{"candidates", st.nodes},    {"memory_filtered", st.memory_filtered},
                  {"simulated", st.simulated}, {"simulated_over_memory", st.simulated_over_memory},
                  {"seconds", st.seconds},     {"complete", st.complete}};
    j["best"] = nlohmann::ordered_json::array();
    for (const plan::Evaluation& e : r.best)
      j["best"].push_back({{"layout", plan::describe(spec, e.candidate)},
                           {"world_size", e.candidate.world_size},
                           {"step_seconds", e.sim.step_seconds},
                           {"tokens_per_second", e.sim.tokens_per_second},
                           {"mfu", e.sim.mfu},
                           {"bubble_fraction", e.sim.bubble_fraction},
                           {"peak_memory_bytes", peak(e.sim)},
                           {"lower_bound_seconds", e.lower_bound},
                           {"overrides", plan::config_overrides(spec, e.candidate)}});
    j["mfu_all_devices"] = cluster_mfu;
    j["why"] = r.why;
    write_file(a.json, j.dump(2) + "\n", "search summary");
  }
  return 0;
}

}  // namespace

std::function<int()> add_plan(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "print the Plan a config resolves to (JSON); with --cluster, search the layouts, "
      "placement, microbatches, ZeRO-1 and recomputation for the fastest predicted step");
  cmd->add_option("config", args->config, "config file (TOML)")->required();
  cmd->add_option("--set", args->sets, "override a config key: section.key=value (repeatable)");
  cmd->add_option("--world-size", args->world,
                  "ranks to plan for (default 1); with --cluster: devices the plan may use "
                  "(default: every device of the cluster)")
      ->check(weft::cli::kPositive);
  cmd->add_option("--cluster", args->cluster,
                  "cluster file (TOML; see configs/clusters/): search for the best plan on it");
  cmd->add_option("--profile", args->profile,
                  "measured costs from `weft bench profile` instead of the FLOP model: the stage "
                  "boundaries, and with --cluster every bound and simulation of the search");
  cmd->add_flag("--full-rows", args->full_rows,
                "price every sample as one row of model.llm.max_seq tokens, loss on each, with "
                "one item per encoder, instead of the mean sample of the config's dataset (the "
                "FLOP model; for a dataset this machine cannot read)");
  cmd->add_option("--out", args->out, "with --cluster: write the chosen Plan here (JSON)");
  cmd->add_option("--snippet", args->snippet,
                  "with --cluster: write the config that reproduces it here (TOML)");
  cmd->add_option("--json", args->json,
                  "with --cluster: write the search summary here (JSON: the table, --set flags)");
  cmd->add_option("--placement", args->placements,
                  "with --cluster: placements to search (colocated, separate, megatron; "
                  "repeatable; default colocated and separate)")
      ->check(CLI::IsMember({"colocated", "separate", "megatron"}));
  cmd->add_option("--top", args->top, "with --cluster: distinct layouts to show")
      ->check(weft::cli::kPositive);
  cmd->add_option("--max-simulations", args->max_simulations,
                  "with --cluster: stop after this many simulations")
      ->check(weft::cli::kPositive);
  cmd->add_option("--time-budget", args->time_budget,
                  "with --cluster: stop after this many seconds, once a plan that fits is found")
      ->check(weft::cli::kPositive);
  cmd->add_option("--threads", args->threads,
                  "with --cluster: threads simulating candidates (default: every core, at most 8; "
                  "the plan found does not depend on it)")
      ->check(weft::cli::kPositive);
  cmd->add_flag("--partial-recompute", args->partial_recompute,
                "with --cluster: also recompute only each pipeline chunk's first blocks, "
                "as many per pipeline stage as its ranks need (recompute_blocks), where a layout "
                "needs some recomputation to fit (a slower search)");
  cmd->add_option("--gap", args->gap,
                  "with --cluster: optimality gap in percent: plans whose bound is within it of "
                  "the best are not simulated (default 0.5; 0 = the exact optimum)")
      ->check(CLI::Range(0.0, 100.0));
  return [cmd, args]() -> int {
    if (!*cmd) return 1;
    if (!args->cluster.empty()) return run_search(*args);
    for (const std::string* opt : {&args->out, &args->snippet, &args->json})
      WEFT_CHECK(opt->empty(),
                 "weft plan: --out, --snippet and --json need --cluster (the search)");
    const Spec spec = load_spec(args->config, args->sets);
    std::unique_ptr<plan::Profile> profile;
    if (!args->profile.empty())
      profile = std::make_unique<plan::Profile>(plan::load_profile(args->profile));
    check_rows(args->full_rows, profile != nullptr);
    // What `weft train` runs: the cuts on the data's sample (train/data_shape.h).
    const int64_t world = args->world > 0 ? args->world : 1;
    plan::make_plan(spec, world, profile.get());  // the config's own errors, without the hint
    const plan::Plan p = reading_data(
        [&] { return train::default_plan(spec, world, profile.get(), args->full_rows); });
    std::printf("%s\n", plan::to_json(p).c_str());
    return 0;
  };
}

}  // namespace weft::cli
