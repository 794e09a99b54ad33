// The weft command line: `weft train`, `weft plan`. Errors from anywhere below end up here:
// printed as "weft: error: ..." with a non-zero exit status.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/plan.h"
#include "weft/train/trainer.h"

namespace {

int cmd_train(const std::string& config, const std::vector<std::string>& sets,
              const std::string& out, const std::string& resume, bool quiet) {
  std::string path = config;
  if (!resume.empty()) {
    WEFT_CHECK(std::filesystem::is_directory(resume), "--resume ", resume, ": not a run directory");
    if (path.empty()) path = (std::filesystem::path(resume) / "config.toml").string();
    WEFT_CHECK(std::filesystem::exists(path), "--resume ", resume,
               ": not a weft run directory (no config.toml)");
  }
  WEFT_CHECK(!path.empty(), "weft train: give a CONFIG file (or --resume RUN_DIR)");
  weft::Spec spec = weft::load_spec(path, sets);
  weft::plan::Plan plan = weft::plan::make_plan(spec);
  weft::train::TrainerOptions opts;
  opts.out_dir = out;
  opts.resume_dir = resume;
  opts.progress = !quiet;
  weft::train::Trainer trainer(std::move(spec), std::move(plan), opts);
  weft::train::Summary s = trainer.run();
  std::printf("steps %lld  loss %.4f -> %.4f  eval caption accuracy %.3f\n",
              static_cast<long long>(s.steps), s.loss_first, s.loss_last, s.eval_caption_accuracy);
  std::printf("%.0f tokens/s  MFU %.1f%%  wall %.1f s\n", s.tokens_per_second, 100.0 * s.mfu,
              s.wall_seconds);
  std::printf("run directory: %s\n", s.run_dir.c_str());
  return 0;
}

int cmd_plan(const std::string& config, const std::vector<std::string>& sets) {
  weft::Spec spec = weft::load_spec(config, sets);
  std::printf("%s\n", weft::plan::to_json(weft::plan::make_plan(spec)).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"weft: multimodality-aware training of multimodal LLMs"};
  app.require_subcommand(1);
  std::string config, out, resume;
  std::vector<std::string> sets;
  bool quiet = false;

  CLI::App* train = app.add_subcommand("train", "train a model from a TOML config");
  train->add_option("config", config, "config file (TOML)");
  train->add_option("--set", sets, "override a config key: section.key=value (repeatable)");
  train->add_option("--out", out, "run directory (default: runs/<timestamp>)");
  train->add_option("--resume", resume,
                    "continue the run in this directory from its newest "
                    "checkpoint");
  train->add_flag("--quiet", quiet, "no progress output");

  CLI::App* plan = app.add_subcommand("plan", "print the Plan a config resolves to (JSON)");
  plan->add_option("config", config, "config file (TOML)")->required();
  plan->add_option("--set", sets, "override a config key: section.key=value (repeatable)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*train) return cmd_train(config, sets, out, resume, quiet);
    if (*plan) return cmd_plan(config, sets);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\nweft: error: %s\n", e.what());
    return 1;
  }
  return 1;
}
