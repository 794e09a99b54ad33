#include "cli/simulate.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/simulate.h"

namespace weft::cli {

namespace {

struct SimulateArgs {
  std::string config, cluster, trace;
  std::vector<std::string> sets;
  int64_t world = 0;  // 0 = every device of the cluster
};

int run_simulate(const SimulateArgs& a) {
  const Spec spec = load_spec(a.config, a.sets);
  const plan::Cluster cluster = plan::load_cluster(a.cluster);
  const int64_t world = a.world > 0 ? a.world : cluster.world_size();
  const plan::Plan p = plan::make_plan(spec, world);
  plan::SimOptions options;
  options.trace = !a.trace.empty();
  const plan::SimResult r = plan::simulate(spec, p, cluster, options);
  nlohmann::ordered_json out;
  out["config"] = a.config;
  out["cluster"] = a.cluster;
  out["device"] = cluster.device.name;
  out["world_size"] = world;
  out.update(nlohmann::ordered_json::parse(plan::to_json(r)));
  if (!a.trace.empty()) {
    std::ofstream f(a.trace);
    WEFT_CHECK(f, a.trace, ": cannot open the trace file for writing");
    f << plan::chrome_trace(r) << '\n';
    WEFT_CHECK(f.good(), a.trace, ": writing the trace failed");
    out["trace"] = a.trace;
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace

std::function<int()> add_simulate(CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  CLI::App* sim = app.add_subcommand(
      "simulate",
      "predict one training step of a config's plan on a cluster: step time, tokens/s, MFU, "
      "bubbles, memory (JSON), and a Chrome trace of the timeline");
  sim->add_option("config", args->config, "config file (TOML)")->required();
  sim->add_option("--cluster", args->cluster, "cluster file (TOML; see configs/clusters/)")
      ->required();
  sim->add_option("--world-size", args->world, "ranks to plan for (default: every device)")
      ->check(CLI::PositiveNumber);
  sim->add_option("--set", args->sets, "override a config key: section.key=value (repeatable)");
  sim->add_option("--trace", args->trace, "write the timeline here (Chrome/Perfetto JSON)");
  return [sim, args]() -> int {
    if (*sim) return run_simulate(*args);
    return 1;
  };
}

}  // namespace weft::cli
