#include "weft/train/bench.h"

#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/core/progress.h"
#include "weft/data/dataset.h"
#include "weft/dist/device.h"
#include "weft/dist/launch.h"
#include "weft/io/files.h"
#include "weft/io/safetensors.h"
#include "weft/plan/plan.h"
#include "weft/train/eval.h"
#include "weft/train/live_bytes.h"
#include "weft/train/op_trace.h"
#include "weft/train/peak.h"
#include "weft/train/trainer.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace weft::train {

namespace {

// A "VmRSS:   1234 kB" style field of /proc/self/status, in bytes (0 where unavailable).
int64_t status_field(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(in, line))
    if (line.compare(0, n, key) == 0) return std::stoll(line.substr(n + 1)) * 1024;
  return 0;
}

std::string step_file(const fs::path& dir, int64_t step) {
  char name[48];
  std::snprintf(name, sizeof name, "step-%05lld.safetensors", static_cast<long long>(step));
  return (dir / name).string();
}

// Every microbatch of a step, under "mb<m>.<field>" (see bench/eager_reference.py).
void dump_step(const std::string& path, const StepBatch& b) {
  io::TensorMap t;
  for (size_t m = 0; m < b.microbatches.size(); ++m) {
    const data::Microbatch& mb = b.microbatches[m];
    const std::string p = "mb" + std::to_string(m) + ".";
    t.emplace_back(p + "tokens", mb.tokens);
    t.emplace_back(p + "positions", mb.positions);
    t.emplace_back(p + "doc", mb.doc);
    t.emplace_back(p + "item", mb.item);
    t.emplace_back(p + "target_rows", mb.target_rows);
    t.emplace_back(p + "targets", mb.targets);
    for (size_t e = 0; e < mb.encoder_inputs.size(); ++e) {
      if (!mb.encoder_inputs[e].defined() || mb.encoder_inputs[e].size(0) == 0) continue;
      const std::string q = p + "enc" + std::to_string(e) + ".";
      t.emplace_back(q + "inputs", mb.encoder_inputs[e].to(at::kFloat));
      t.emplace_back(q + "rows", mb.encoder_rows[e]);
    }
  }
  io::save_safetensors(path, t);
}

// Sets and returns the intra-op threads of `ts` (0: dist::intra_op_threads' share of the cores).
int use_threads(const TrainSpec& ts) {
  const int threads = dist::intra_op_threads(ts.threads);
  at::set_num_threads(threads);
  return threads;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int64_t rss_bytes() { return status_field("VmRSS:"); }
int64_t peak_rss_bytes() { return status_field("VmHWM:"); }
void reset_peak_rss() {
  // "5" resets the peak resident set size to the current one (Linux >= 4.0).
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
}

std::string bench_step(Spec spec, const BenchOptions& o) {
  WEFT_CHECK(o.steps >= 1, "weft bench step: --steps must be at least 1");
  WEFT_CHECK(o.warmup >= 0, "weft bench step: --warmup must be non-negative");
  const int64_t total = o.warmup + o.steps;
  TrainSpec& ts = spec.train;
  ts.steps = std::max(ts.steps, total);
  ts.warmup = std::min(ts.warmup, ts.steps);
  ts.checkpoint_every = 0;
  ts.eval_every = 0;
  const int threads = use_threads(ts);

  const int64_t baseline = rss_bytes();  // the process before the model exists
  // Tensor bytes from before the model exists (parameters, optimizer state, the prepared batches
  // and every step's tensors). Not with --profile: the profiler needs the hook.
  std::optional<LiveBytes> live;
  if (o.profile.empty()) live.emplace(ts.device == Device::kCuda ? c10::kCUDA : c10::kCPU);
  TrainerOptions to;
  to.progress = false;
  to.eval = false;
  Trainer trainer(spec, plan::make_plan(spec, 1), to);
  const at::ScalarType compute = ts.precision == Precision::kBf16 ? at::kBFloat16 : at::kFloat;
  const c10::Device device = trainer.device();
  const double peak =
      o.peak_flops > 0 ? o.peak_flops : measure_matmul_peak(compute, 0.6, 2048, device);

  std::vector<StepBatch> batches;
  for (int64_t i = 0; i < total; ++i) batches.push_back(trainer.prepare_step(i));
  int64_t params = 0, trainable = 0;
  for (const auto& [name, p] : trainer.model().parameters()) {
    params += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  const fs::path dump = o.dump_dir;
  if (!dump.empty()) {
    fs::create_directories(dump);
    io::write_text_file((dump / "config.toml").string(), spec_to_toml(trainer.spec()));
    io::TensorMap weights;
    for (const auto& [name, p] : trainer.model().parameters())
      weights.emplace_back(name, p.detach().to(at::kCPU));
    io::save_safetensors((dump / "model.safetensors").string(), weights);
    for (int64_t i = 0; i < total; ++i) dump_step(step_file(dump, i), batches[i]);
  }

  reset_peak_rss();
  const int64_t live_before = live ? live->live() : 0;
  if (live) live->reset_peak();
  dist::reset_device_peak(device);
  std::vector<double> losses, grad_norms, seconds;
  double flops = 0, llm_flops = 0, timed = 0;
  int64_t tokens = 0;
  json steps = json::array();
  // Step i's time runs from the previous step's finish to its own. Where the trainer defers its
  // reads (a GPU), step i + 1 is queued before step i is finished, as in `weft train`: the time
  // is then the device's pace, the host's launches hidden behind the device's work. Otherwise
  // each step runs alone, bracketed by device synchronisations. The timed steps start on an idle
  // device, the clock started after the warm-up's last step is done: were it started when that
  // step is read, after the first timed step is queued (as between timed steps), the device
  // would have run most of that step already, and the timed total would miss it.
  dist::synchronize(device);
  double last = now_seconds();
  struct Queued {
    QueuedStep q;
  };
  std::unique_ptr<OpTrace> profiler;
  const auto profiled = [&](int64_t i) { return !o.profile.empty() && i + 1 == total; };
  // next_in_flight: a step runs on the device during this one's bookkeeping, whose time then
  // belongs to the next step's (finish to finish); otherwise the bookkeeping counts toward none.
  const auto finish = [&](Queued& queued, bool next_in_flight) {
    QueuedStep& q = queued.q;
    const StepOutcome out = trainer.finish_step(q);
    if (!trainer.defers()) dist::synchronize(device);
    const double finished = now_seconds(), dt = finished - last;
    const int64_t i = q.step;
    losses.push_back(out.loss);
    grad_norms.push_back(out.grad_norm);
    const auto [f, lf] = trainer.step_flops(batches[i]);
    steps.push_back({{"lr", out.lr},
                     {"targets", batches[i].targets},
                     {"tokens", batches[i].tokens},
                     {"flops", f}});
    if (i >= o.warmup) {
      seconds.push_back(dt);
      timed += dt;
      flops += f;
      llm_flops += lf;
      tokens += batches[i].tokens;
    }
    last = next_in_flight ? finished : now_seconds();
    if (profiled(i)) profiler.reset();
  };
  const auto queue = [&](int64_t i) {
    if (profiled(i)) {  // it runs alone (run_steps finished the one before)
      profiler = std::make_unique<OpTrace>(o.profile);
      dist::synchronize(device);
      last = now_seconds();
    }
    return Queued{trainer.queue_step(batches[i], i)};
  };
  const auto never = [](int64_t) { return false; };
  run_steps<Queued>(0, o.warmup, queue, finish, never, profiled);
  dist::synchronize(device);
  last = now_seconds();
  run_steps<Queued>(o.warmup, total, queue, finish, never, profiled);
  const int64_t peak_rss = peak_rss_bytes();

  json j;
  j["impl"] = "weft";
  j["torch"] = TORCH_VERSION;
  j["config"] = spec.source;
  j["precision"] = to_string(ts.precision);
  j["threads"] = threads;
  j["params"] = params;
  j["trainable_params"] = trainable;
  j["batch"] = ts.batch;
  j["microbatches"] = ts.microbatches;
  j["warmup"] = o.warmup;
  j["steps"] = o.steps;
  j["tokens_per_step"] = static_cast<double>(tokens) / static_cast<double>(o.steps);
  j["losses"] = losses;
  j["grad_norms"] = grad_norms;
  j["step_seconds"] = seconds;
  j["median_step_seconds"] = median(seconds);
  j["tokens_per_second"] = static_cast<double>(tokens) / timed;
  j["mfu"] = flops / timed / peak;
  j["mfu_llm_only"] = llm_flops / timed / peak;
  j["peak_flops"] = peak;
  j["peak_rss_bytes"] = peak_rss;
  j["baseline_rss_bytes"] = baseline;
  j["step_peak_bytes"] = peak_rss - baseline;
  if (live) {
    j["live_before_steps_bytes"] = live_before;
    j["step_peak_live_bytes"] = live->peak();
  }
  j["device"] = device.str();
  if (device.is_cuda()) j["device_peak_bytes"] = dist::device_peak_bytes(device);
  if (!dump.empty()) {
    json b;
    b["warmup"] = o.warmup;
    b["steps"] = o.steps;
    b["threads"] = threads;
    b["precision"] = to_string(ts.precision);
    b["microbatches"] = ts.microbatches;
    b["step"] = steps;
    b["weft"] = {{"losses", losses}, {"grad_norms", grad_norms}};
    b["peak_flops"] = peak;
    io::write_text_file((dump / "bench.json").string(), b.dump(2) + "\n");
  }
  return j.dump(2);
}

std::string bench_generate(Spec spec, int64_t samples, int64_t rounds) {
  WEFT_CHECK(samples >= 1, "weft bench generate: --samples must be at least 1");
  WEFT_CHECK(rounds >= 1, "weft bench generate: --rounds must be at least 1");
  const TrainSpec& ts = spec.train;
  use_threads(ts);
  const std::unique_ptr<data::Dataset> dataset = data::make_dataset(&spec);
  TrainerOptions to;
  to.progress = false;
  to.eval = false;
  Trainer trainer(spec, plan::make_plan(spec, 1), to);
  std::vector<data::Sample> set = dataset->eval_set();
  if (static_cast<int64_t>(set.size()) > samples) set.resize(static_cast<size_t>(samples));
  EvalOptions eo;
  eo.compute_dtype = ts.precision == Precision::kBf16 ? at::kBFloat16 : at::kFloat;
  eo.loss = false;
  const c10::Device device = trainer.device();
  // The weights cast once for all of it, as the trainer's evaluation holds them.
  const model::CastOnce casts(trainer.model().parameters(), model::CastOnce::Keep::kEverything);
  // A few prompts first (kernel selection, allocator), then the two ways in turn each round.
  {
    std::vector<data::Sample> few(set.begin(), set.begin() + std::min<size_t>(set.size(), 4));
    evaluate_captions(trainer.model(), few, *dataset, eo);
  }
  std::vector<double> cached, whole;
  EvalResult with, without;
  for (int64_t r = 0; r < rounds; ++r)
    for (const bool kv : {true, false}) {
      eo.kv_cache = kv;
      dist::synchronize(device);
      const double t0 = now_seconds();
      EvalResult got = evaluate_captions(trainer.model(), set, *dataset, eo);
      dist::synchronize(device);
      (kv ? cached : whole).push_back(now_seconds() - t0);
      (kv ? with : without) = std::move(got);
    }
  int64_t differing = 0;
  for (size_t i = 0; i < with.captions.size(); ++i)
    differing += with.captions[i] != without.captions[i] ? 1 : 0;
  json j;
  j["samples"] = static_cast<int64_t>(set.size());
  j["rounds"] = rounds;
  j["precision"] = to_string(ts.precision);
  j["device"] = device.str();
  j["seconds_kv_cache"] = median(cached);
  j["seconds_whole_sequence"] = median(whole);
  j["speedup"] = median(whole) / median(cached);
  j["captions_differing"] = differing;  // near-ties in bf16 may part greedy decoding
  j["caption_accuracy"] = with.caption_accuracy;
  return j.dump(2);
}

}  // namespace weft::train
