// The weft command line: `weft train`, `plan`, `launch`, `export`, `inspect`, `simulate`, `report`,
// `bench`. Errors from anywhere below end up here: printed as "weft: error: ..." with a
// non-zero exit status.

#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include "cli/example.h"
#include "cli/inspect.h"
#include "cli/plan.h"
#include "cli/report.h"
#include "cli/simulate.h"
#include "cli/validators.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/core/memory.h"
#include "weft/dist/comm.h"
#include "weft/dist/device.h"
#include "weft/dist/launch.h"
#include "weft/io/checkpoint.h"
#include "weft/io/hf.h"
#include "weft/model/multimodal.h"
#include "weft/plan/plan.h"
#include "weft/train/bench.h"
#include "weft/train/data_shape.h"
#include "weft/train/peak.h"
#include "weft/train/profile.h"
#include "weft/train/trainer.h"

namespace {

int cmd_train(const std::string& config, const std::vector<std::string>& sets,
              const std::string& out, const std::string& resume, bool quiet, double timeout_seconds,
              bool trace_ops) {
  std::string path = config;
  if (!resume.empty()) {
    WEFT_CHECK(std::filesystem::is_directory(resume), "--resume ", resume, ": not a run directory");
    if (path.empty()) path = (std::filesystem::path(resume) / "config.toml").string();
    WEFT_CHECK(std::filesystem::exists(path), "--resume ", resume,
               ": not a weft run directory (no config.toml)");
  }
  WEFT_CHECK(!path.empty(), "weft train: give a CONFIG file (or --resume RUN_DIR)");
  // Restarted by `weft launch --max-restarts` (attempt > 0): continue the run.
  const char* restart_env = std::getenv("WEFT_RESTART");
  const int restart = restart_env ? std::atoi(restart_env) : 0;
  weft::Spec spec;
  weft::plan::Plan plan;
  weft::dist::WorldInfo world;
  // Bad input, found before the rendezvous: an exit status `weft launch` does not restart on.
  try {
    spec = weft::load_spec(path, sets);
    world = weft::dist::world_from_env();
    plan = weft::train::default_plan(spec, world.world_size);  // as `weft plan` prints it
    // A fresh run never writes over another (every rank checks before the rendezvous, so before
    // rank 0 writes anything); a restart by `weft launch` continues its own, the first attempt
    // having checked.
    const std::string out_dir = !out.empty() ? out : spec.output.dir;
    if (resume.empty() && !out_dir.empty() && restart == 0) {
      const std::filesystem::path d(out_dir);
      for (const char* f : {"config.toml", "metrics.jsonl", "checkpoints"})
        WEFT_CHECK(!std::filesystem::exists(d / f), out_dir, ": already holds a run (", f,
                   "); continue it with `weft train --resume ", out_dir,
                   "`, or give another --out");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weft: error: %s\n", e.what());
    return weft::dist::kInputErrorExit;
  }
  weft::train::TrainerOptions opts;
  // A GPU rank takes its device before any NCCL group exists.
  const bool cuda = weft::dist::select_device(spec.train.device, world.local_rank).is_cuda();
  opts.local_rank = world.local_rank;
  opts.comm = weft::dist::Comm::connect(
      world, std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000)), cuda,
      spec.train.shared_memory_collectives);
  if (world.world_size > 1)
    std::fprintf(stderr, "weft: rank %d of %d connected (rendezvous %s:%d)\n", world.rank,
                 world.world_size, world.master_addr.c_str(), world.master_port);
  opts.out_dir = out;
  opts.resume_dir = resume;
  // A restart continues the run from its last checkpoint.
  if (restart > 0) {
    opts.restart = restart;
    const std::string dir = !out.empty() ? out : spec.output.dir;
    if (resume.empty() && !dir.empty() && !weft::io::latest_checkpoint(dir, false).empty())
      opts.resume_dir = dir;
    else if (resume.empty() && world.rank == 0) {
      if (!dir.empty()) weft::io::latest_checkpoint(dir, true);  // says which were damaged
      std::fprintf(stderr, "weft: restart %d: no checkpoint in %s; starting over\n", opts.restart,
                   dir.empty() ? "(no --out)" : dir.c_str());
    }
  }
  opts.progress = !quiet;
  WEFT_CHECK(!trace_ops || spec.output.trace_step > 0,
             "weft train --trace-ops: traces the step output.trace_step names, which is 0 (no "
             "trace); set it, e.g. --set output.trace_step=3");
  opts.trace_ops = trace_ops;
  weft::train::Trainer trainer(std::move(spec), std::move(plan), opts);
  weft::train::Summary s = trainer.run();
  if (world.rank != 0) return 0;
  std::printf("steps %lld  loss %.4f -> %.4f", static_cast<long long>(s.steps), s.loss_first,
              s.loss_last);
  if (s.eval_caption_accuracy >= 0)
    std::printf("  eval caption accuracy %.3f", s.eval_caption_accuracy);
  std::printf("  eval loss %.4f\n", s.eval_loss);
  std::printf("%.0f tokens/s  MFU %.1f%%  wall %.1f s\n", s.tokens_per_second, 100.0 * s.mfu,
              s.wall_seconds);
  std::printf("run directory: %s\n", s.run_dir.c_str());
  return 0;
}

// `weft bench peak`: the matmul peaks MFU is measured against, in one run, with the threads a
// training run uses (the cores shared among this machine's ranks, unless --threads).
int cmd_bench_peak(double seconds, int64_t size, int64_t threads) {
  at::set_num_threads(weft::dist::intra_op_threads(threads));
  const double bf16 = weft::train::measure_matmul_peak(at::kBFloat16, seconds, size);
  const double fp32 = weft::train::measure_matmul_peak(at::kFloat, seconds, size);
  std::printf(
      "{\n  \"matmul_size\": %lld,\n  \"threads\": %d,\n  \"bf16_flops\": %.4g,\n"
      "  \"fp32_flops\": %.4g,\n  \"bf16_over_fp32\": %.3f\n}\n",
      static_cast<long long>(size), at::get_num_threads(), bf16, fp32, bf16 / fp32);
  return 0;
}

// `weft bench step CONFIG`: JSON on stdout (and to --json FILE).
int cmd_bench_step(const std::string& config, const std::vector<std::string>& sets,
                   const weft::train::BenchOptions& opts, const std::string& json_path) {
  const std::string result = weft::train::bench_step(weft::load_spec(config, sets), opts);
  std::printf("%s\n", result.c_str());
  if (!json_path.empty()) {
    std::ofstream out(json_path, std::ios::trunc);
    out << result << "\n";
    WEFT_CHECK(out.flush(), "--json ", json_path, ": cannot write");
  }
  return 0;
}

// `weft bench profile CONFIG`: the measured cost profile, JSON on stdout (and to --out FILE).
int cmd_bench_profile(const std::string& config, const std::vector<std::string>& sets,
                      const weft::train::ProfileOptions& opts, const std::string& out_path) {
  const std::string result = weft::train::profile_config(weft::load_spec(config, sets), opts);
  std::printf("%s\n", result.c_str());
  if (!out_path.empty()) {
    std::ofstream out(out_path, std::ios::trunc);
    out << result << "\n";
    WEFT_CHECK(out.flush(), "--out ", out_path, ": cannot write");
  }
  return 0;
}

// `weft export RUN_DIR --hf OUT_DIR`: the newest checkpoint of a run in Hugging Face layouts.
int cmd_export(const std::string& run_dir, const std::string& out_dir, const std::string& dtype,
               double shard_mb) {
  namespace fs = std::filesystem;
  const std::string config = (fs::path(run_dir) / "config.toml").string();
  WEFT_CHECK(fs::exists(config), run_dir, ": not a weft run directory (no config.toml)");
  const weft::Spec spec = weft::load_spec(config);
  const std::string ckpt = weft::io::latest_checkpoint(run_dir);
  WEFT_CHECK(!ckpt.empty(), run_dir, ": no complete checkpoint to export");
  const weft::io::CheckpointReader reader(ckpt);
  // A config.toml edited after the run would otherwise export a wrong model or fail inside
  // LibTorch.
  weft::train::check_checkpoint_fits(reader.shapes("model/"), reader.shapes("optimizer/"),
                                     spec.model, ckpt, config);
  std::map<std::string, at::Tensor> full;  // the weights only: the moments stay on disk
  for (const auto& [name, shape] : reader.shapes("model/"))
    full.emplace(name, reader.read("model/" + name));
  const at::ScalarType type = dtype == "bf16"   ? at::kBFloat16
                              : dtype == "fp16" ? at::kHalf
                                                : at::kFloat;
  for (const std::string& dir : weft::io::export_hf(spec.model, full, out_dir, type,
                                                    static_cast<int64_t>(shard_mb * (1 << 20))))
    std::printf("wrote %s\n", dir.c_str());
  return 0;
}

// `weft version`: what this build can run on.
int cmd_version() {
#ifdef WEFT_CUDA
  const char* devices = "cpu cuda";
#else
  const char* devices = "cpu";
#endif
  std::printf("weft: LibTorch %s, devices: %s\n", TORCH_VERSION, devices);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  weft::retain_freed_memory();
  CLI::App app{"weft: multimodality-aware training of multimodal LLMs"};
  app.require_subcommand(1);
  std::string config, out, resume;
  std::vector<std::string> sets;
  bool quiet = false;

  CLI::App* version =
      app.add_subcommand("version", "the LibTorch weft is built against, and its devices");
  CLI::App* train = app.add_subcommand("train", "train a model from a TOML config");
  train->add_option("config", config, "config file (TOML)");
  train->add_option("--set", sets, "override a config key: section.key=value (repeatable)");
  train->add_option("--out", out, "run directory (default: runs/<timestamp>)");
  train->add_option("--resume", resume,
                    "continue the run in this directory from its newest "
                    "checkpoint");
  train->add_flag("--quiet", quiet, "no progress output");
  bool trace_ops = false;
  train->add_flag("--trace-ops", trace_ops,
                  "every rank also writes ops.rank<N>.json: its operators in step "
                  "output.trace_step (bench/trace_summary.py summarises one)");
  double timeout_seconds = 120;
  train
      ->add_option("--timeout", timeout_seconds,
                   "seconds to wait for the other ranks at rendezvous and in any collective")
      ->check(weft::cli::kPositive);

  std::function<int()> run_plan = weft::cli::add_plan(app);

  weft::dist::LaunchOptions launch_opts;
  CLI::App* launch = app.add_subcommand(
      "launch", "run N local ranks of a command: weft launch --nproc N -- weft train CONFIG");
  launch->add_option("--nproc", launch_opts.nproc, "ranks to start")
      ->required()
      ->check(weft::cli::kPositive);
  launch->add_option("--master-addr", launch_opts.master_addr, "rendezvous address (loopback)");
  launch->add_option("--master-port", launch_opts.master_port, "rendezvous port (0 = free port)")
      ->check(weft::cli::integer_in(0, 65535));
  launch
      ->add_option("--max-restarts", launch_opts.max_restarts,
                   "after a failure, start the job again up to this many times (weft train "
                   "resumes from its --out directory's last checkpoint)")
      ->check(weft::cli::kNonNegative);
  launch->add_option("command", launch_opts.command, "the command every rank runs (after --)")
      ->required();

  CLI::App* bench = app.add_subcommand("bench", "measure this machine");
  bench->require_subcommand(1);
  CLI::App* peak = bench->add_subcommand(
      "peak", "bf16 and fp32 matmul FLOP/s (the MFU denominator), measured in one run (JSON)");
  double peak_seconds = 0.6;
  int64_t peak_size = 2048, peak_threads = 0;
  peak->add_option("--seconds", peak_seconds, "time per precision")->check(weft::cli::kPositive);
  peak->add_option("--size", peak_size, "square matmul size")->check(weft::cli::kPositive);
  peak->add_option("--threads", peak_threads, "intra-op threads (0 = all cores)")
      ->check(weft::cli::kNonNegative);

  CLI::App* step = bench->add_subcommand(
      "step",
      "time real training steps of a config: tokens/s, MFU and peak memory (JSON); --dump "
      "writes the weights and batches for bench/eager_reference.py");
  weft::train::BenchOptions step_opts;
  std::string step_json;
  step->add_option("config", config, "config file (TOML)")->required();
  step->add_option("--set", sets, "override a config key: section.key=value (repeatable)");
  step->add_option("--steps", step_opts.steps, "timed steps")->check(weft::cli::kPositive);
  step->add_option("--warmup", step_opts.warmup, "untimed steps first")
      ->check(weft::cli::kNonNegative);
  step->add_option("--peak-flops", step_opts.peak_flops,
                   "MFU denominator in FLOP/s (default: measure the matmul peak)")
      ->check(weft::cli::kPositive);
  step->add_option("--dump", step_opts.dump_dir,
                   "write config.toml, model.safetensors, step-*.safetensors and bench.json here");
  step->add_option("--json", step_json, "also write the result to this file");
  step->add_option("--profile", step_opts.profile,
                   "write a Chrome trace of the last step's operators to this file (that step is "
                   "then slower; time without it)");

  CLI::App* gen = bench->add_subcommand(
      "generate",
      "time greedy captioning of a config's eval samples with the KV cache against rerunning "
      "the whole sequence for every token, in one run (JSON)");
  int64_t gen_samples = 64, gen_rounds = 1;
  gen->add_option("config", config, "config file (TOML)")->required();
  gen->add_option("--set", sets, "override a config key: section.key=value (repeatable)");
  gen->add_option("--samples", gen_samples, "eval samples captioned")->check(weft::cli::kPositive);
  gen->add_option("--rounds", gen_rounds, "times each way (median)")->check(weft::cli::kPositive);

  CLI::App* prof = bench->add_subcommand(
      "profile",
      "measure each layer's forward, input- and weight-gradient seconds, activation bytes and "
      "optimizer seconds at several microbatch shapes, the data preparation and the local "
      "transport: the cost profile `weft simulate --profile` uses (JSON)");
  weft::train::ProfileOptions prof_opts;
  std::string prof_out;
  bool prof_no_comm = false;
  prof->add_option("config", config, "config file (TOML)")->required();
  prof->add_option("--set", sets, "override a config key: section.key=value (repeatable)");
  prof->add_option("--out", prof_out, "also write the profile to this file");
  prof->add_option("--reps", prof_opts.reps, "timed repetitions per measurement (median)")
      ->check(weft::cli::kPositive);
  prof->add_option("--warmup", prof_opts.warmup, "untimed repetitions first")
      ->check(weft::cli::kNonNegative);
  prof->add_flag("--no-comm", prof_no_comm, "skip the transport measurement");
  bool prof_alone = false;
  prof->add_flag("--alone", prof_alone,
                 "measure layers alone only, not again while the other cores train");

  // The peer process of `weft bench profile`'s transport measurement (hidden: not for users).
  CLI::App* comm_peer = bench->add_subcommand("comm-peer", "");
  comm_peer->group("");
  int peer_port = 0;
  int64_t peer_reps = 5, peer_warmup = 2;
  std::string peer_dtype = "fp32";
  int peer_shared_memory = 1, peer_messages = 1;
  comm_peer->add_option("--port", peer_port)->required();
  comm_peer->add_option("--reps", peer_reps);
  comm_peer->add_option("--warmup", peer_warmup);
  comm_peer->add_option("--dtype", peer_dtype);
  comm_peer->add_option("--shared-memory", peer_shared_memory)->check(CLI::Range(0, 1));
  comm_peer->add_option("--messages", peer_messages)->check(CLI::Range(0, 1));

  CLI::App* exp = app.add_subcommand(
      "export", "write a run's newest checkpoint as Hugging Face checkpoints (safetensors)");
  std::string export_run, export_out, export_dtype = "fp32";
  double export_shard_mb = 4096;
  exp->add_option("run_dir", export_run, "run directory")->required();
  exp->add_option("--hf", export_out, "output directory (llm/, one per encoder)")->required();
  exp->add_option("--dtype", export_dtype, "fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  exp->add_option("--shard-mb", export_shard_mb, "largest safetensors shard (MiB)")
      ->check(weft::cli::kPositive);

  CLI::App* example = app.add_subcommand("example", "generate example data and checkpoints");
  example->require_subcommand(1);
  CLI::App* example_llava = example->add_subcommand(
      "llava",
      "a LLaVA-style dataset (PNG + JSON), tokenizer.json and HF-layout LLM + CLIP tower, for "
      "configs/llava-style.toml");
  std::string example_out;
  int64_t example_samples = 2048;
  uint64_t example_seed = 1234;
  example_llava->add_option("out_dir", example_out, "directory to write")->required();
  example_llava->add_option("--samples", example_samples, "records")->check(weft::cli::kPositive);
  example_llava->add_option("--seed", example_seed, "data and init seed");

  std::function<int()> run_inspect = weft::cli::add_inspect(app);
  std::function<int()> run_simulate = weft::cli::add_simulate(app);
  std::function<int()> run_report = weft::cli::add_report(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*version) return cmd_version();
    if (*train) return cmd_train(config, sets, out, resume, quiet, timeout_seconds, trace_ops);
    if (app.got_subcommand("plan")) return run_plan();
    if (*example_llava)
      return weft::cli::run_example_llava(example_out, example_samples, example_seed);
    if (*exp) return cmd_export(export_run, export_out, export_dtype, export_shard_mb);
    if (*launch) return weft::dist::launch(launch_opts);
    if (*peak) return cmd_bench_peak(peak_seconds, peak_size, peak_threads);
    if (*step) return cmd_bench_step(config, sets, step_opts, step_json);
    if (*gen) {
      const std::string result =
          weft::train::bench_generate(weft::load_spec(config, sets), gen_samples, gen_rounds);
      std::printf("%s\n", result.c_str());
      return 0;
    }
    if (*comm_peer) {
      weft::train::comm_peer(peer_port, peer_reps, peer_warmup, peer_dtype, peer_shared_memory != 0,
                             peer_messages != 0);
      return 0;
    }
    if (*prof) {
      prof_opts.comm = !prof_no_comm;
      prof_opts.shared = !prof_alone;
      return cmd_bench_profile(config, sets, prof_opts, prof_out);
    }
    if (app.got_subcommand("inspect")) return run_inspect();
    if (app.got_subcommand("simulate")) return run_simulate();
    if (app.got_subcommand("report")) return run_report();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\nweft: error: %s\n", e.what());
    return 1;
  }
  return 1;
}
