#include "weft/train/trainer.h"

#include <torch/torch.h>

#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/core/progress.h"
#include "weft/data/collate.h"
#include "weft/data/shapes.h"
#include "weft/data/tokenizer.h"
#include "weft/dist/data_parallel.h"
#include "weft/io/checkpoint.h"
#include "weft/plan/flops.h"
#include "weft/train/eval.h"
#include "weft/train/inputs.h"
#include "weft/train/optimizer.h"
#include "weft/train/peak.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace weft::train {

std::string Summary::to_json() const {
  json j;
  j["run_dir"] = run_dir;
  j["steps"] = steps;
  j["loss_first"] = loss_first;
  j["loss_last"] = loss_last;
  j["eval_caption_accuracy"] = eval_caption_accuracy;
  j["tokens_per_second"] = tokens_per_second;
  j["mfu"] = mfu;
  j["wall_seconds"] = wall_seconds;
  return j.dump(2);
}

namespace {

std::string fresh_run_dir() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&t));
  std::string dir = std::string("runs/") + buf;
  for (int i = 2; fs::exists(dir); ++i) dir = std::string("runs/") + buf + "-" + std::to_string(i);
  return dir;
}

void write_text(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    WEFT_CHECK(out, "cannot write ", tmp.string());
    out << text << "\n";
    WEFT_CHECK(out.flush(), "write to ", tmp.string(), " failed");
  }
  fs::rename(tmp, path);
}

// Keeps the metrics lines with step <= last_step (a resumed run rewrites what follows).
void truncate_metrics(const fs::path& path, int64_t last_step) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("step") && j["step"].get<int64_t>() <= last_step)
      kept += line + "\n";
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  out << kept;
}

}  // namespace

struct Trainer::Impl {
  Spec spec;
  plan::Plan plan;
  TrainerOptions opts;
  data::Tokenizer tokenizer;
  std::unique_ptr<data::ShapesDataset> dataset;
  std::unique_ptr<model::MultimodalModel> model;
  model::NamedTensors trainable;
  std::unique_ptr<AdamW> optimizer;
  std::vector<int> owner;  // ZeRO-1: DP rank that steps each trainable parameter (else empty)
  at::ScalarType compute = at::kBFloat16;
  fs::path run_dir;

  // Progress carried across resumes (from state.json).
  int64_t start_step = 0;
  double loss_first = NAN;
  double prior_wall_seconds = 0;

  Impl(Spec s, plan::Plan p, TrainerOptions o)
      : spec(std::move(s)),
        plan(std::move(p)),
        opts(std::move(o)),
        tokenizer(data::Tokenizer::for_shapes(spec.model)) {
    LlmSpec& llm = spec.model.llm;
    WEFT_CHECK(llm.vocab == 0 || llm.vocab >= tokenizer.vocab_size(), spec.source,
               ": model.llm.vocab = ", llm.vocab, " is smaller than the tokenizer's ",
               tokenizer.vocab_size(), " tokens (use 0 to take the tokenizer's size)");
    if (llm.vocab == 0) llm.vocab = tokenizer.vocab_size();
    dataset = std::make_unique<data::ShapesDataset>(spec, tokenizer);
    compute = spec.train.precision == Precision::kBf16 ? at::kBFloat16 : at::kFloat;
    model = std::make_unique<model::MultimodalModel>(spec.model, spec.train.seed);
    for (const auto& [name, p] : model->parameters())
      if (p.requires_grad()) trainable.emplace_back(name, p);
    AdamWOptions ao{spec.train.beta1, spec.train.beta2, spec.train.eps, spec.train.weight_decay};
    std::vector<bool> owned(trainable.size(), true);
    if (spec.train.zero_stage == 1 && opts.comm.size() > 1) {
      owner = dist::partition_parameters(trainable, opts.comm.size());
      for (size_t k = 0; k < owned.size(); ++k) owned[k] = owner[k] == opts.comm.rank();
    }
    optimizer = std::make_unique<AdamW>(trainable, ao, owned);
    run_dir = !opts.resume_dir.empty()   ? fs::path(opts.resume_dir)
              : !opts.out_dir.empty()    ? fs::path(opts.out_dir)
              : !spec.output.dir.empty() ? fs::path(spec.output.dir)
                                         : fs::path(fresh_run_dir());
    if (!opts.resume_dir.empty()) resume();
  }

  void resume() {
    const std::string dir = io::latest_checkpoint(run_dir.string());
    WEFT_CHECK(!dir.empty(), run_dir.string(), ": no complete checkpoint to resume from");
    io::Checkpoint ckpt = io::load_checkpoint(dir);
    std::map<std::string, at::Tensor> by_name(ckpt.model.begin(), ckpt.model.end());
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : model->parameters()) {
      auto it = by_name.find(name);
      WEFT_CHECK(it != by_name.end(), dir, "/model.safetensors: missing tensor '", name, "'");
      WEFT_CHECK(it->second.sizes() == p.sizes(), dir, "/model.safetensors: tensor '", name,
                 "' has shape ", it->second.sizes(), ", the model expects ", p.sizes());
      p.copy_(it->second);
      by_name.erase(it);
    }
    WEFT_CHECK(by_name.empty(), dir, "/model.safetensors: tensor '",
               by_name.empty() ? "" : by_name.begin()->first, "' does not belong to this model");
    json state = json::parse(ckpt.state_json, nullptr, false);
    WEFT_CHECK(!state.is_discarded() && state.contains("step"), dir,
               "/state.json: not valid trainer state");
    start_step = state["step"].get<int64_t>();
    loss_first = state.value("loss_first", NAN);
    prior_wall_seconds = state.value("wall_seconds", 0.0);
    optimizer->load_state(ckpt.optimizer, state.value("optimizer_steps", start_step));
    WEFT_CHECK(start_step <= spec.train.steps, dir, ": checkpoint is at step ", start_step,
               ", beyond train.steps = ", spec.train.steps, " (raise it with --set train.steps=N)");
  }

  // Collective when the optimizer state is sharded (every rank calls); rank 0 writes.
  void save(int64_t step, double wall_seconds) {
    model::NamedTensors optim_state = optimizer->gather_state(opts.comm, owner);
    if (opts.comm.rank() != 0) return;
    json state;
    state["step"] = step;
    state["optimizer_steps"] = optimizer->steps();
    state["loss_first"] = loss_first;
    state["wall_seconds"] = wall_seconds;
    state["next_sample"] = step * spec.train.batch;  // data position: the stream is indexed
    io::Checkpoint ckpt{model->parameters(), optim_state, state.dump(2)};
    io::save_checkpoint(run_dir.string(), step, ckpt, spec.output.keep_checkpoints);
  }

  // FLOPs of one step, all modules and LLM only (Megatron accounting, frozen-aware).
  std::pair<double, double> step_flops(const std::vector<data::Microbatch>& mbs) const {
    double llm = 0, rest = 0;
    const plan::ModulePlan& lp = plan.module("llm");
    for (const data::Microbatch& mb : mbs) {
      plan::LlmTokens t{mb.real_tokens, mb.targets.numel(), mb.sum_sq_doc_len};
      llm += plan::llm_forward_flops(spec.model.llm, t) *
             plan::training_multiplier(lp.weight_grads, lp.input_grads);
      for (size_t e = 0; e < spec.model.encoders.size(); ++e) {
        const EncoderSpec& es = spec.model.encoders[e];
        const double items = mb.encoder_inputs[e].defined() ? mb.encoder_inputs[e].size(0) : 0;
        const plan::ModulePlan& ep = plan.module(es.name);
        const plan::ModulePlan& pp = plan.module(es.name + ".projector");
        rest += items * plan::encoder_forward_flops(es) *
                plan::training_multiplier(ep.weight_grads, ep.input_grads);
        rest += items * plan::projector_forward_flops(es, spec.model.llm) *
                plan::training_multiplier(pp.weight_grads, pp.input_grads);
      }
    }
    return {llm + rest, llm};
  }

  // Module whose gradient holds a NaN/Inf, for the error message.
  std::string non_finite_grad_module() const {
    for (const auto& [name, p] : trainable)
      if (p.grad().defined() && !torch::isfinite(p.grad()).all().item<bool>())
        return model::MultimodalModel::module_of(name) + "' (parameter " + name + ")";
    return "?'";
  }
};

Trainer::Trainer(Spec spec, plan::Plan plan, TrainerOptions options)
    : impl_(std::make_unique<Impl>(std::move(spec), std::move(plan), std::move(options))) {}
Trainer::~Trainer() = default;
model::MultimodalModel& Trainer::model() { return *impl_->model; }

Summary Trainer::run() {
  Impl& m = *impl_;
  const Spec& spec = m.spec;
  const TrainSpec& ts = spec.train;
  at::set_num_threads(ts.threads > 0 ? static_cast<int>(ts.threads)
                                     : static_cast<int>(std::thread::hardware_concurrency()));

  const dist::Comm& comm = m.opts.comm;
  WEFT_CHECK(comm.size() == m.plan.world_size, "the plan is for ", m.plan.world_size,
             " ranks but the job has ", comm.size());
  const bool writer = comm.rank() == 0;
  std::ofstream metrics;
  if (writer) {
    fs::create_directories(m.run_dir);
    write_text(m.run_dir / "config.toml", spec_to_toml(spec));
    write_text(m.run_dir / "plan.json", plan::to_json(m.plan));
    const fs::path metrics_path = m.run_dir / "metrics.jsonl";
    if (m.start_step > 0)
      truncate_metrics(metrics_path, m.start_step);
    else
      std::ofstream(metrics_path, std::ios::trunc);
    metrics.open(metrics_path, std::ios::app);
    WEFT_CHECK(metrics, "cannot write ", metrics_path.string());
  }

  dist::GradSync grad_sync(comm, m.trainable, static_cast<int64_t>(ts.grad_bucket_mb * (1 << 20)));
  dist::GradSync::broadcast_parameters(comm, m.model->parameters());
  const double peak = m.opts.peak_flops > 0 ? m.opts.peak_flops : measure_matmul_peak(m.compute);
  const bool show = m.opts.progress && writer;
  Progress progress(m.start_step, ts.steps, ts.log_every, show && Progress::stderr_is_tty());
  if (show)
    progress.message("weft: training " + std::to_string(ts.steps) + " steps, run directory " +
                     m.run_dir.string());
  data::CollateOptions copts;
  copts.num_encoders = static_cast<int>(spec.model.encoders.size());
  copts.pad_id = m.tokenizer.pad_id();
  copts.packing = spec.data.packing;
  copts.max_seq = spec.model.llm.max_seq;

  double train_seconds = 0, total_flops = 0, total_llm_flops = 0;
  int64_t total_tokens = 0;
  double loss_last = NAN;
  double accuracy = -1;
  std::vector<std::pair<std::string, std::string>> examples;
  const double wall_start = now_seconds();

  auto run_eval = [&]() {
    EvalResult r = evaluate_captions(*m.model, m.dataset->eval_set(), m.tokenizer,
                                     std::max<int64_t>(ts.batch, 64), m.compute);
    accuracy = r.caption_accuracy;
    examples = r.examples;
    return r;
  };

  for (int64_t step = m.start_step; step < ts.steps; ++step) {
    const double t0 = now_seconds();
    std::vector<data::Microbatch> mbs;
    int64_t targets = 0;
    // This rank's slice of the global batch (data parallel), then its microbatches.
    const std::vector<data::Sample> local =
        m.dataset->train_batch(step, ts.batch, comm.rank(), comm.size());
    for (const auto& part : data::split(local, ts.microbatches)) {
      mbs.push_back(data::collate(part, copts));
      targets += mbs.back().targets.numel();
    }
    // The loss is a mean over the global batch's targets, so every rank divides by their total.
    at::Tensor counts = torch::tensor({targets}, torch::kLong);
    comm.all_reduce_sum(counts);
    targets = counts.item<int64_t>();
    WEFT_CHECK(targets > 0, "step ", step + 1, ": the batch has no target tokens");
    double loss = 0;
    {
      model::ComputeDtypeGuard dtype(m.compute);
      for (const data::Microbatch& mb : mbs) {
        // Reduce gradient buckets while the last backward of the step runs.
        if (&mb == &mbs.back() && ts.overlap_grad_reduce) grad_sync.arm();
        at::Tensor l = m.model->loss_sum(to_inputs(mb)) / static_cast<double>(targets);
        l.backward();
        loss += l.item<double>();
      }
    }
    const double sync_start = now_seconds();
    grad_sync.finish();
    const double grad_sync_seconds = now_seconds() - sync_start;
    at::Tensor loss_sum = torch::tensor({loss}, torch::kDouble);
    comm.all_reduce_sum(loss_sum);
    loss = loss_sum.item<double>();
    WEFT_CHECK(std::isfinite(loss), "step ", step + 1, ": loss is ", loss,
               "; training diverged (lower train.lr, keep train.grad_clip > 0, or try "
               "train.precision = \"fp32\")");
    if (after_backward) after_backward(step);
    const double grad_norm = clip_grad_norm(m.trainable, ts.grad_clip);
    WEFT_CHECK(std::isfinite(grad_norm), "step ", step + 1, ": gradient norm is ", grad_norm,
               " — non-finite gradient in module '", m.non_finite_grad_module());
    const double lr = lr_at(ts, step);
    m.optimizer->step(lr);
    if (!m.owner.empty()) dist::broadcast_from_owners(comm, m.trainable, m.owner);
    for (auto& [name, p] : m.trainable) p.mutable_grad().reset();
    const double step_seconds = now_seconds() - t0;

    int64_t local_tokens = 0;
    for (const auto& mb : mbs) local_tokens += mb.real_tokens;
    const auto [local_flops, local_llm_flops] = m.step_flops(mbs);
    at::Tensor stats = torch::tensor(
        {static_cast<double>(local_tokens), local_flops, local_llm_flops}, torch::kDouble);
    comm.all_reduce_sum(stats);
    const int64_t tokens = static_cast<int64_t>(stats[0].item<double>());
    // MFU is per device: the job's FLOPs over (seconds x devices x peak).
    const double flops = stats[1].item<double>() / comm.size();
    const double llm_flops = stats[2].item<double>() / comm.size();
    train_seconds += step_seconds;
    total_flops += flops;
    total_llm_flops += llm_flops;
    total_tokens += tokens;
    if (std::isnan(m.loss_first)) m.loss_first = loss;
    loss_last = loss;

    json line;
    line["step"] = step + 1;
    line["loss"] = loss;
    line["lr"] = lr;
    line["grad_norm"] = grad_norm;
    line["tokens"] = tokens;
    line["step_seconds"] = step_seconds;
    line["tokens_per_second"] = static_cast<double>(tokens) / step_seconds;
    line["mfu"] = flops / step_seconds / peak;
    if (comm.size() > 1) {
      line["grad_sync_seconds"] = grad_sync_seconds;  // exposed (not overlapped) reduction time
      line["grad_buckets_overlapped"] = grad_sync.buckets_overlapped();
    }
    if (writer) {
      metrics << line.dump() << "\n";
      metrics.flush();
    }
    if (show) progress.update(step + 1, loss, static_cast<double>(tokens) / step_seconds, lr);

    const bool last = step + 1 == ts.steps;
    if (writer && m.opts.eval && ts.eval_every > 0 && (step + 1) % ts.eval_every == 0 && !last) {
      EvalResult r = run_eval();
      if (show)
        progress.message("step " + std::to_string(step + 1) + ": eval caption accuracy " +
                         std::to_string(r.caption_accuracy));
    }
    if (last || (ts.checkpoint_every > 0 && (step + 1) % ts.checkpoint_every == 0))
      m.save(step + 1, m.prior_wall_seconds + now_seconds() - wall_start);
  }
  progress.finish();
  if (writer && m.opts.eval) run_eval();

  Summary s;
  s.run_dir = m.run_dir.string();
  s.steps = ts.steps;
  s.loss_first = m.loss_first;
  s.loss_last = loss_last;
  s.eval_caption_accuracy = accuracy;
  s.tokens_per_second = train_seconds > 0 ? static_cast<double>(total_tokens) / train_seconds : 0;
  s.mfu = train_seconds > 0 ? total_flops / train_seconds / peak : 0;
  s.wall_seconds = m.prior_wall_seconds + now_seconds() - wall_start;

  json j = json::parse(s.to_json());
  j["mfu_llm_only"] = train_seconds > 0 ? total_llm_flops / train_seconds / peak : 0;
  j["peak_flops"] = peak;
  j["precision"] = to_string(ts.precision);
  j["train_seconds"] = train_seconds;
  j["resumed_from_step"] = m.start_step;
  j["eval_examples"] = json::array();
  j["world_size"] = comm.size();
  for (const auto& [gen, ref] : examples)
    j["eval_examples"].push_back({{"generated", gen}, {"reference", ref}});
  if (writer) write_text(m.run_dir / "summary.json", j.dump(2));
  return s;
}

}  // namespace weft::train
