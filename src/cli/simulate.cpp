#include "cli/simulate.h"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/plan.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/profile.h"
#include "weft/plan/search.h"
#include "weft/plan/simulate.h"

namespace weft::cli {

namespace {

struct SimulateArgs {
  std::string config, cluster, trace;
  std::string plan;     // a Plan JSON (weft plan --out) instead of the config's own plan
  std::string profile;  // measured costs (weft bench profile); "" = the FLOP model
  std::vector<std::string> sets;
  int64_t world = 0;       // 0 = every device of the cluster
  bool full_rows = false;  // price max_seq rows with one item per encoder, not the data's
};

int run_simulate(const SimulateArgs& a) {
  const Spec spec = load_spec(a.config, a.sets);
  const plan::Cluster cluster = plan::load_cluster(a.cluster);
  std::unique_ptr<plan::Profile> profile;
  if (!a.profile.empty()) profile = std::make_unique<plan::Profile>(plan::load_profile(a.profile));
  plan::SimOptions options;
  options.trace = !a.trace.empty();
  const plan::DataShape& data = price_on_data(spec, a.full_rows, profile.get(), &options);
  plan::Plan p;
  if (!a.plan.empty()) {
    std::ifstream in(a.plan);
    WEFT_CHECK(in, a.plan, ": cannot read the plan file");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    p = plan::plan_from_json(text, a.plan, spec);
    WEFT_CHECK(a.world == 0 || a.world == p.world_size, "--world-size ", a.world, ": ", a.plan,
               " is a plan for ", p.world_size, " ranks");
  } else {
    Spec priced = spec;  // the output head at the data's vocabulary (as weft train cuts)
    if (!data.empty() && priced.model.llm.vocab == 0) priced.model.llm.vocab = options.unset_vocab;
    p = plan::make_plan(priced, a.world > 0 ? a.world : cluster.world_size(), profile.get(), &data);
  }
  const int64_t world = p.world_size;
  // FLOP model: the planner's costs (activation recomputation priced, as `weft plan` does).
  const plan::SimResult r =
      profile ? plan::simulate(spec, p, cluster, *profile, options)
              : plan::simulate(spec, p, cluster, plan::planner_costs(spec, p, options), options);
  nlohmann::ordered_json out;
  out["config"] = a.config;
  out["cluster"] = a.cluster;
  out["device"] = cluster.device.name;
  out["world_size"] = world;
  if (profile) out["profile"] = a.profile;
  out["data_shape"] = plan::data_shape_json(spec, data);
  if (!a.plan.empty()) out["plan_file"] = a.plan;
  nlohmann::ordered_json stages;  // the plan's pipeline stages (chosen on the costs used)
  for (const plan::ModulePlan& m : p.modules)
    if (m.role != plan::ModuleRole::kProjector && m.layout.pp > 1)
      stages[m.name] = m.stage_boundaries;
  if (!stages.empty()) out["stage_boundaries"] = stages;
  out.update(nlohmann::ordered_json::parse(plan::to_json(r)));
  out["plan"] = nlohmann::ordered_json::parse(plan::to_json(p));
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
  sim->add_option("--plan", args->plan,
                  "simulate this Plan (JSON from `weft plan --out`), checked against the config, "
                  "instead of the config's own");
  sim->add_flag("--full-rows", args->full_rows,
                "price every sample as one row of model.llm.max_seq tokens, loss on each, with "
                "one item per encoder, instead of the mean sample of the config's dataset");
  sim->add_option("--profile", args->profile,
                  "measured costs from `weft bench profile` instead of the FLOP model (stage "
                  "boundaries and step)");
  return [sim, args]() -> int {
    if (*sim) return run_simulate(*args);
    return 1;
  };
}

}  // namespace weft::cli
