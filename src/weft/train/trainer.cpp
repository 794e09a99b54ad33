#include "weft/train/trainer.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/core/progress.h"
#include "weft/data/collate.h"
#include "weft/data/dataset.h"
#include "weft/dist/collectives.h"
#include "weft/dist/device.h"
#include "weft/dist/launch.h"
#include "weft/dist/runtime.h"
#include "weft/io/checkpoint.h"
#include "weft/io/files.h"
#include "weft/io/hf.h"
#include "weft/model/fused.h"
#include "weft/plan/balance.h"
#include "weft/plan/flops.h"
#include "weft/train/bench.h"
#include "weft/train/eval.h"
#include "weft/train/inputs.h"
#include "weft/train/op_trace.h"
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
  j["eval_loss"] = eval_loss;  // null when not evaluated
  j["tokens_per_second"] = tokens_per_second;
  j["mfu"] = mfu;
  j["wall_seconds"] = wall_seconds;
  return j.dump(2);
}

namespace {

// `v` with `digits` decimals.
std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string fresh_run_dir() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&t));
  std::string dir = std::string("runs/") + buf;
  for (int i = 2; fs::exists(dir); ++i) dir = std::string("runs/") + buf + "-" + std::to_string(i);
  return dir;
}

void write_text(const fs::path& path, const std::string& text) {
  io::write_text_file(path.string(), text + "\n");
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

// Every rank must run the same resolved config: otherwise their collectives disagree on sizes
// (Gloo aborts) or, where sizes agree (a seed, a learning rate), the replicas silently diverge.
// All ranks gather all configs, so every rank fails alike, naming the first difference. What
// only says where this host keeps things, or how it uses its own cores, may differ: paths (data,
// media, tokenizer, Hugging Face checkpoints, run directory), data workers and prefetch, threads.
void check_same_config(const dist::Comm& comm, const Spec& spec) {
  if (comm.size() == 1) return;
  Spec shared = spec;
  shared.data.path = shared.data.root = shared.data.tokenizer = shared.output.dir = "";
  shared.model.llm.hf = "";
  for (EncoderSpec& e : shared.model.encoders) e.hf = "";
  shared.data.workers = shared.data.prefetch = shared.train.threads = 0;
  const std::string mine = spec_to_toml(shared);
  const std::vector<std::string> all = comm.all_gather_strings(mine);
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    std::istringstream a(all[0]), b(all[r]);
    std::string la, lb, table;
    for (;;) {
      const bool more_a = static_cast<bool>(std::getline(a, la));
      const bool more_b = static_cast<bool>(std::getline(b, lb));
      if (!more_a) la.clear();
      if (!more_b) lb.clear();
      if (la != lb || (!more_a && !more_b)) break;
      if (!la.empty() && la[0] == '[') table = la;
    }
    WEFT_FAIL(spec.source, ": rank ", r, " runs another config than rank 0",
              table.empty() ? "" : " (in " + table + ")", ": rank 0 has `", la, "`, rank ", r,
              " has `", lb, "`; every rank must be given the same config and --set overrides");
  }
}

}  // namespace

struct Trainer::Impl {
  Spec spec;
  plan::Plan plan;
  TrainerOptions opts;
  std::unique_ptr<data::Dataset> dataset;
  std::unique_ptr<dist::Runtime> runtime;
  std::unique_ptr<AdamW> optimizer;
  c10::Device device = c10::kCPU;  // train.device, resolved for this rank
  at::ScalarType compute = at::kBFloat16;
  data::CollateOptions collate;
  plan::WorkModel work_model;  // each sample's encoder and LLM work, for balancing
  fs::path run_dir;

  // Steps' layouts, balanced, planned ahead for prefetching; valid while the dataset has found
  // no new bad record (its skipped() count).
  struct Layout {  // one step's samples without media, as balanced, and what this rank loads
    std::vector<data::Sample> samples;
    plan::BatchBalance balance;
    std::vector<data::MediaRef> wanted;
  };
  Layout layout_of(int64_t step);
  const Layout& planned(int64_t step);
  std::map<int64_t, Layout> layouts;
  int64_t layouts_skipped = 0;

  // Progress carried across resumes (from state.json).
  int64_t start_step = 0;
  double loss_first = NAN;
  bool defer = false;  // steps leave their loss and norm on the device (queue_step)
  double prior_wall_seconds = 0;
  // What this rank's resume read: tensor data copied out, bytes proved against the manifest,
  // and the checkpoint's data files in all (summary.json, rank 0's).
  json resume_read;

  Impl(Spec s, plan::Plan p, TrainerOptions o)
      : spec(std::move(s)), plan(std::move(p)), opts(std::move(o)) {
    dataset = data::make_dataset(&spec);  // sets model.llm.vocab = 0 from the tokenizer
    const LlmSpec& llm = spec.model.llm;
    const int64_t tp = plan.module("llm").layout.tp;
    WEFT_CHECK(llm.vocab % tp == 0, spec.source, ": model.llm.vocab = ", llm.vocab,
               " must be divisible by parallel.llm.tp = ", tp,
               " for the vocab-parallel embedding: set model.llm.vocab to a multiple of ", tp,
               " no smaller than ", dataset->vocab_size());
    compute = spec.train.precision == Precision::kBf16 ? at::kBFloat16 : at::kFloat;
    collate.num_encoders = static_cast<int>(spec.model.encoders.size());
    collate.pad_id = dataset->pad_id();
    collate.packing = spec.data.packing;
    collate.max_seq = llm.max_seq;
    work_model = plan::make_work_model(spec, plan);
    dist::RuntimeOptions ro;
    ro.bucket_bytes = static_cast<int64_t>(spec.train.grad_bucket_mb * (1 << 20));
    ro.overlap_grad_reduce = spec.train.overlap_grad_reduce;
    ro.overlap_param_gather = spec.train.overlap_param_gather;
    dist::set_overlap_tp_comm(spec.train.overlap_tp_comm);
    ro.zero1 = spec.train.zero_stage == 1;
    ro.param_gather_dtype = compute;
    ro.cast_once = spec.train.cast_once;
    ro.frozen_dtype = spec.train.frozen_fp32 ? at::kFloat : compute;
    ro.shared_memory_messages = spec.train.shared_memory_messages;
    device = dist::select_device(spec.train.device, opts.local_rank);
    ro.device = device;
    check_same_config(opts.comm, spec);  // before the first collective that sizes by it
    runtime = std::make_unique<dist::Runtime>(spec.model, spec.train.seed, plan, opts.comm, ro);
    // Deferred reads need the loss and the norm on this rank alone, and no host decision
    // between backward and the update (train.nonfinite = "skip" reads the norm first).
    const bool may_defer = opts.comm.size() == 1 && spec.train.nonfinite == NonFinite::kStop;
    WEFT_CHECK(opts.defer != DeferReads::kAlways || may_defer,
               "deferred reads need one rank and train.nonfinite = \"stop\"");
    defer = may_defer && (opts.defer == DeferReads::kAlways ||
                          (opts.defer == DeferReads::kAuto && device.is_cuda()));
    AdamWOptions ao{spec.train.beta1, spec.train.beta2, spec.train.eps, spec.train.weight_decay};
    optimizer = std::make_unique<AdamW>(runtime->trainable(), ao, runtime->optimizer_pieces());
    run_dir = !opts.resume_dir.empty()   ? fs::path(opts.resume_dir)
              : !opts.out_dir.empty()    ? fs::path(opts.out_dir)
              : !spec.output.dir.empty() ? fs::path(spec.output.dir)
                                         : fs::path(fresh_run_dir());
    // Every rank's files (checkpoint shards, operator traces) go to rank 0's directory: a fresh
    // one's name is rank 0's.
    if (opts.comm.size() > 1) run_dir = opts.comm.all_gather_strings(run_dir.string())[0];
    if (!opts.resume_dir.empty())
      resume();
    else
      init_from_hf();
  }

  // Fresh runs: parameters of modules that name a Hugging Face checkpoint (model.llm.hf,
  // model.<encoder>.hf) start from it; each rank reads only the tensors it holds, and of a
  // tensor split by rows only its rows (else the whole tensor, one at a time, to take its shard).
  void init_from_hf() {
    bool any = !spec.model.llm.hf.empty();
    for (const EncoderSpec& e : spec.model.encoders) any = any || !e.hf.empty();
    if (!any) return;
    const io::HfWeights hf(spec.model);
    torch::NoGradGuard no_grad;
    const model::NamedTensors& params = model().parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      const auto& [name, p] = params[k];
      if (!hf.provides(name)) continue;
      at::Tensor shard = hf.shard(name, runtime->shard_split(k));  // its rows only, where it can
      if (!shard.defined()) shard = runtime->shard_of(k, hf.full(name));
      WEFT_CHECK(shard.sizes() == p.sizes(), "Hugging Face weights for '", name, "' have shape ",
                 shard.sizes(), " on this rank; the model needs ", p.sizes());
      runtime->set_parameter(k, shard);
    }
    if (opts.comm.rank() == 0 && opts.progress)
      for (const std::string& line : hf.summary()) std::fprintf(stderr, "weft: %s\n", line.c_str());
  }

  model::MultimodalModel& model() { return runtime->model(); }

  // Every module whole on every rank (data parallelism only, no expert parallelism): rank 0 can
  // evaluate its own model.
  bool whole_model() const {
    for (const auto& m : plan.modules)
      if (m.layout.tp != 1 || m.layout.pp != 1 || m.layout.cp != 1 || m.layout.ep != 1 ||
          m.first_rank != 0)
        return false;
    return true;
  }

  // Loads the newest checkpoint: each rank reads its own shards of the weights, and its
  // optimizer pieces' ranges of the moments, whatever layout wrote them (io::CheckpointReader):
  // a run saved under one layout resumes under another, and no rank holds the whole model.
  void resume() {
    const std::string dir = io::latest_checkpoint(run_dir.string(), opts.comm.rank() == 0);
    WEFT_CHECK(!dir.empty(), run_dir.string(), ": no complete checkpoint to resume from");
    const io::CheckpointReader ckpt(dir);
    for (const std::string& name : ckpt.names())
      WEFT_CHECK(name.rfind("model/", 0) == 0 || name.rfind("optimizer/", 0) == 0, dir,
                 ": unexpected tensor '", name, "' (expected model/... or optimizer/...)");
    // Every rank reads every header, so each checks the whole model before taking shards.
    check_checkpoint_fits(ckpt.shapes("model/"), ckpt.shapes("optimizer/"), spec.model, dir,
                          "this run's config");
    torch::NoGradGuard no_grad;
    const model::NamedTensors& params = model().parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      const auto& [name, p] = params[k];
      const at::Tensor shard = ckpt.read("model/" + name, runtime->shard_split(k));
      WEFT_ASSERT(shard.sizes() == p.sizes(), dir, ": shard of '", name, "' is ", shard.sizes(),
                  ", this rank holds ", p.sizes());
      runtime->set_parameter(k, shard);
    }
    json state = json::parse(ckpt.state_json(), nullptr, false);
    WEFT_CHECK(!state.is_discarded() && state.contains("step") &&
                   state["step"].is_number_integer() && state["step"].get<int64_t>() >= 0,
               dir,
               "/state.json: not valid trainer state (expected {\"step\": a count >= 0, ...})");
    start_step = state["step"].get<int64_t>();
    const auto number = [&](const char* key, double otherwise) {
      return state.contains(key) && state[key].is_number() ? state[key].get<double>() : otherwise;
    };
    loss_first = number("loss_first", NAN);
    prior_wall_seconds = number("wall_seconds", 0.0);
    // Every moment of this rank's trainable parameters must be there; moments of parameters
    // that no rank trains are ones checkpoints from before unused encoder blocks stopped
    // training hold, and are passed over.
    std::set<std::string> moments;
    for (const auto& [key, shape] : ckpt.shapes("optimizer/")) moments.insert(key);
    const model::NamedTensors& trainable = runtime->trainable();
    for (size_t t = 0; t < trainable.size(); ++t)
      for (const char* kind : {"exp_avg.", "exp_avg_sq."}) {
        const std::string key = kind + trainable[t].first;
        const bool present = moments.erase(key) > 0;
        WEFT_CHECK(present, dir, ": missing optimizer tensor '", key, "'");
      }
    for (auto it = moments.begin(); it != moments.end();)
      it = model().unused(it->substr(it->find('.') + 1)) ? moments.erase(it) : std::next(it);
    if (opts.comm.size() == 1)
      WEFT_CHECK(moments.empty(), dir, ": unexpected optimizer tensor '",
                 moments.empty() ? "" : *moments.begin(),
                 "' (a checkpoint of another model or freezing setup?)");
    // This rank's pieces of its own parameters' moments, each read as the range it holds.
    optimizer->load_state(
        [&](size_t t, const std::string& key, int64_t begin, int64_t length) {
          return ckpt.read("optimizer/" + key, runtime->shard_split(runtime->param_index(t)), begin,
                           length);
        },
        state.value("optimizer_steps", start_step));
    WEFT_CHECK(start_step <= spec.train.steps, dir, ": checkpoint is at step ", start_step,
               ", beyond train.steps = ", spec.train.steps, " (raise it with --set train.steps=N)");
    resume_read = {{"checkpoint", dir},
                   {"bytes_read", ckpt.bytes_read()},
                   {"bytes_verified", ckpt.bytes_verified()},
                   {"checkpoint_bytes", ckpt.file_bytes()}};
  }

  // What a save wrote (rank 0's view; zeros elsewhere).
  struct Saved {
    std::string dir;
    uint64_t bytes = 0;  // every rank's data files together
    double seconds = 0;  // from opening the checkpoint to sealing it
  };
  // Collective: every rank writes its shards of the weights and optimizer moments into the
  // checkpoint rank 0 opened; rank 0 then seals it (manifest, state, rename).
  Saved save(int64_t step, double wall_seconds) {
    const double t0 = now_seconds();
    const dist::Comm& comm = opts.comm;
    std::string tmp;
    if (comm.rank() == 0) tmp = io::begin_sharded_checkpoint(run_dir.string(), step);
    tmp = comm.all_gather_strings(tmp)[0];
    const std::vector<std::pair<std::string, std::vector<at::Tensor>>> moments = {
        {"exp_avg", optimizer->exp_avg_pieces()}, {"exp_avg_sq", optimizer->exp_avg_sq_pieces()}};
    // Every rank's file complete, with its checksums (each rank sums its own file).
    const std::vector<std::string> sums = comm.all_gather_strings(
        io::write_checkpoint_shards(tmp, comm.rank(), runtime->checkpoint_shards(moments)));
    if (comm.rank() != 0) return {};
    json state;
    state["step"] = step;
    state["optimizer_steps"] = optimizer->steps();
    state["loss_first"] = loss_first;
    state["wall_seconds"] = wall_seconds;
    state["next_sample"] = step * spec.train.batch;  // data position: the stream is indexed
    state["world_size"] = comm.size();
    Saved out;
    out.dir = io::finish_sharded_checkpoint(run_dir.string(), step, state.dump(2),
                                            spec.output.keep_checkpoints, sums);
    for (const std::string& text : sums)  // one file's entry each, checked by finish
      out.bytes += json::parse(text).begin().value().at("bytes").get<uint64_t>();
    out.seconds = now_seconds() - t0;
    return out;
  }

  // Runs `evaluate` on rank 0 with the whole model (collective). Where every module is whole on
  // rank 0 that is the training model itself. Otherwise it is a copy gathered onto rank 0 for
  // this evaluation only: built without drawing values, every module held as a frozen one (its
  // cast parameters in the compute dtype, rounded as each forward pass rounds the masters, so it
  // generates what the training model would), filled parameter by parameter as the gather
  // delivers them, and freed when `evaluate` returns. Rank 0 thus holds one copy of the weights
  // in the compute dtype during an evaluation, and nothing between evaluations.
  void evaluate_on_root(const std::function<void(const model::MultimodalModel&)>& evaluate) {
    const bool root = opts.comm.rank() == 0;
    if (whole_model()) {
      if (root) evaluate(model());
      return;
    }
    std::unique_ptr<model::MultimodalModel> copy;
    std::map<std::string, at::Tensor> unfilled;
    if (root) {
      model::Hosting whole;
      whole.device = device;
      whole.frozen_dtype = compute;
      whole.inference = true;
      copy = std::make_unique<model::MultimodalModel>(spec.model, 0, whole);
      for (const auto& [name, p] : copy->parameters()) unfilled.emplace(name, p);
    }
    torch::NoGradGuard no_grad;
    runtime->gather_parameters(0, [&](const std::string& name, at::Tensor value) {
      const auto it = unfilled.find(name);
      WEFT_ASSERT(it != unfilled.end(), "evaluation copy: parameter '", name,
                  "' gathered twice or not in the model");
      it->second.copy_(value);
      unfilled.erase(it);
    });
    if (!root) return;
    WEFT_ASSERT(unfilled.empty(), "evaluation copy: ", unfilled.size(),
                " parameters not gathered (", unfilled.empty() ? "" : unfilled.begin()->first,
                " first)");
    evaluate(*copy);
  }

  // Samples arranged as a global batch for the layout: split over the LLM's data-parallel
  // replicas, then over up to train.microbatches (or `microbatches`) microbatches, as evenly as
  // they go; with fewer samples than replicas, topped up with copies of the last whose tokens
  // are not targets.
  // Collated as training collates, or with `pack` false a sample per row, so that the batch's
  // targets come in the samples' order.
  std::vector<std::vector<model::Inputs>> layout_batch(std::vector<data::Sample> part,
                                                       bool pack = true,
                                                       int64_t microbatches = 0) const {
    data::CollateOptions how = collate;
    how.packing = how.packing && pack;
    const int64_t replicas = plan.module("llm").layout.dp;
    while (static_cast<int64_t>(part.size()) < replicas) {
      data::Sample pad = part.back();
      pad.is_target.assign(pad.is_target.size(), 0);
      part.push_back(std::move(pad));
    }
    const int64_t count = static_cast<int64_t>(part.size());
    const int64_t micro =
        std::min(microbatches > 0 ? microbatches : spec.train.microbatches, count / replicas);
    std::vector<std::vector<model::Inputs>> batch(static_cast<size_t>(replicas));
    for (int64_t d = 0; d < replicas; ++d) {
      const int64_t r0 = count * d / replicas, r1 = count * (d + 1) / replicas;
      for (int64_t k = 0; k < micro; ++k) {
        const int64_t a = r0 + (r1 - r0) * k / micro, z = r0 + (r1 - r0) * (k + 1) / micro;
        batch[static_cast<size_t>(d)].push_back(to_inputs(
            data::collate(std::vector<data::Sample>(part.begin() + a, part.begin() + z), how)));
      }
    }
    return batch;
  }
  // How many samples the layout evaluates at a time: a training batch, at least one per replica.
  int64_t layout_eval_batch() const {
    return std::max<int64_t>(spec.train.batch, plan.module("llm").layout.dp);
  }

  // The validation loss of `samples` in the training layout (collective): Σ loss over their
  // targets and the targets' count, on every rank, with nothing gathered; layout_batch's batches
  // of layout_eval_batch() samples.
  std::pair<double, int64_t> layout_eval_loss(const std::vector<data::Sample>& samples) {
    model::ComputeDtypeGuard dtype(compute);  // as training computes
    const int64_t n = static_cast<int64_t>(samples.size()), per_batch = layout_eval_batch();
    double sum = 0;
    int64_t targets = 0;
    for (int64_t b0 = 0; b0 < n; b0 += per_batch) {
      const std::vector<std::vector<model::Inputs>> batch = layout_batch(std::vector<data::Sample>(
          samples.begin() + b0, samples.begin() + std::min(n, b0 + per_batch)));
      for (const auto& replica : batch)
        for (const model::Inputs& in : replica) targets += in.targets.numel();
      sum += runtime->eval_loss_sum(batch);
    }
    return {sum, targets};
  }

  // Prompts generated together, on the gathered copy and in the layout alike.
  int64_t generation_batch() const { return std::max<int64_t>(spec.train.batch, 64); }

  // Greedy generation from each sample's prompt in the training layout (collective; every rank
  // gets every sample's ids), generation_batch() samples at a time (at least one per replica),
  // in as many microbatches as pipeline stages (forwards only: a microbatch's transient
  // activations are a layer's, and each rank caches the keys and values of its own blocks and
  // heads only). The prompts go through the layout once (Runtime::eval_prefill, encoders
  // included, a target at each prompt's last token), then each new token is one
  // Runtime::eval_decode over the LLM's cached keys and values, until each sample has its EOS,
  // its generation_budget() or max_seq. No rank holds more than its part of the model.
  std::vector<std::vector<int64_t>> layout_generate(const std::vector<data::Sample>& samples) {
    model::ComputeDtypeGuard dtype(compute);
    // Each weight cast to the compute dtype once for the generation, not at every token.
    model::CastOnce casts(runtime->model().parameters(), model::CastOnce::Keep::kEverything);
    const size_t n = samples.size();
    const size_t per_batch =
        static_cast<size_t>(std::max(generation_batch(), plan.module("llm").layout.dp));
    const int64_t max_seq = spec.model.llm.max_seq, eos = dataset->eos_id();
    std::vector<std::vector<int64_t>> out(n);
    for (size_t b0 = 0; b0 < n; b0 += per_batch) {
      const size_t b1 = std::min(n, b0 + per_batch);
      std::vector<data::Sample> prompts;
      std::vector<int64_t> budget;  // new tokens each sample may take
      for (size_t i = b0; i < b1; ++i) {
        prompts.push_back(prompt_of(samples[i]));
        const int64_t P = samples[i].prompt_length;
        budget.push_back(
            std::max<int64_t>(0, std::min(P + generation_budget(samples[i]), max_seq) - P));
      }
      const int64_t most = *std::max_element(budget.begin(), budget.end());
      if (most == 0) continue;
      // As many microbatches as pipeline stages: each decoded token is a collective pass per
      // microbatch (TP sums in every block), and more than the stages only adds passes.
      std::vector<std::vector<model::Inputs>> batch =
          layout_batch(std::move(prompts), false, plan.module("llm").layout.pp);
      // A target at each prompt's last token (the topping-up copies after them have none).
      int64_t row = 0;
      for (auto& replica : batch)
        for (model::Inputs& in : replica) {
          const at::Tensor real = (in.doc >= 0).sum(1).to(at::kLong);  // a prompt per row
          const int64_t B = in.tokens.size(0), S = in.tokens.size(1);
          const int64_t own = std::clamp<int64_t>(static_cast<int64_t>(b1 - b0) - row, 0, B);
          in.target_rows =
              (torch::arange(own, torch::kLong) * S + real.narrow(0, 0, own) - 1).contiguous();
          in.targets = torch::full({own}, eos, torch::kLong);
          row += B;
        }
      std::vector<int64_t> next =
          runtime->eval_prefill(batch, dataset->vocab_size(), /*room=*/most - 1);
      WEFT_ASSERT(next.size() == b1 - b0, "layout generation: ", next.size(), " ids for ", b1 - b0,
                  " samples");
      for (int64_t t = 0;; ++t) {
        bool more = false;
        for (size_t k = 0; k < next.size(); ++k) {
          std::vector<int64_t>& ids = out[b0 + k];
          const bool done = t >= budget[k] || (!ids.empty() && ids.back() == eos);
          if (!done) ids.push_back(next[k]);
          more = more || (!done && next[k] != eos && t + 1 < budget[k]);
        }
        if (!more) break;
        next = runtime->eval_decode(next);
      }
      runtime->eval_release();
    }
    return out;
  }

  // FLOPs of one step, all modules and LLM only (Megatron accounting, frozen-aware).
  std::pair<double, double> flops_of(const std::vector<data::Microbatch>& mbs) const {
    double llm = 0, rest = 0;
    const plan::ModulePlan& lp = plan.module("llm");
    for (const data::Microbatch& mb : mbs) {
      plan::LlmTokens t{static_cast<double>(mb.real_tokens),
                        static_cast<double>(mb.targets.numel()), mb.sum_sq_doc_len};
      llm += plan::llm_forward_flops(spec.model.llm, t) *
             plan::training_multiplier(lp.weight_grads, lp.input_grads);
      for (size_t e = 0; e < spec.model.encoders.size(); ++e) {
        const EncoderSpec& es = spec.model.encoders[e];
        const at::Tensor& rows = mb.encoder_rows[e];
        const double items =
            rows.defined() ? static_cast<double>(rows.numel() / es.tokens_per_item()) : 0;
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

  // Module whose gradient holds a NaN/Inf, for the error message: from the gradients, or from
  // their squared norms when the gradients are gone (a deferred step).
  std::string non_finite_grad_module(const at::Tensor& squares = {}) const {
    const model::NamedTensors& trainable = runtime->trainable();
    const at::Tensor sq = squares.defined() ? squares.to(at::kCPU) : at::Tensor();
    for (size_t t = 0; t < trainable.size(); ++t) {
      const auto& [name, p] = trainable[t];
      const bool bad = sq.defined()
                           ? !std::isfinite(sq[static_cast<int64_t>(t)].item<double>())
                           : p.grad().defined() && !torch::isfinite(p.grad()).all().item<bool>();
      if (bad) return model::MultimodalModel::module_of(name) + "' (parameter " + name + ")";
    }
    return "?' (on another rank)";
  }
};

void check_checkpoint_fits(const io::NamedShapes& full_model, const io::NamedShapes& full_optimizer,
                           const ModelSpec& spec, const std::string& ckpt,
                           const std::string& model_of) {
  const char* hint = " (a checkpoint of another model, or a config changed after it was written?)";
  model::Hosting shapes;
  shapes.device = c10::Device(c10::kMeta);
  const model::MultimodalModel expected(spec, 0, shapes);
  std::map<std::string, at::IntArrayRef> want;
  for (const auto& [name, p] : expected.parameters()) want.emplace(name, p.sizes());
  std::set<std::string> have;
  for (const auto& [name, shape] : full_model) {
    auto it = want.find(name);
    WEFT_CHECK(it != want.end(), ckpt, ": tensor '", name, "' is not part of the model of ",
               model_of, hint);
    WEFT_CHECK(at::IntArrayRef(shape) == it->second, ckpt, ": tensor '", name, "' has shape ",
               at::IntArrayRef(shape), ", but the model of ", model_of, " has ", it->second, hint);
    have.insert(name);
  }
  for (const auto& [name, sizes] : want)
    WEFT_CHECK(have.count(name), ckpt, ": no tensor '", name, "', which the model of ", model_of,
               " has", hint);
  for (const auto& [key, shape] : full_optimizer) {
    const size_t dot = key.find('.');
    const std::string kind = key.substr(0, dot);
    auto it = dot == std::string::npos ? want.end() : want.find(key.substr(dot + 1));
    WEFT_CHECK((kind == "exp_avg" || kind == "exp_avg_sq") && it != want.end(), ckpt,
               ": optimizer tensor '", key, "' is not a moment of a parameter of the model of ",
               model_of, hint);
    WEFT_CHECK(at::IntArrayRef(shape) == it->second, ckpt, ": optimizer tensor '", key,
               "' has shape ", at::IntArrayRef(shape), ", but its parameter has ", it->second,
               hint);
  }
}

Trainer::Trainer(Spec spec, plan::Plan plan, TrainerOptions options)
    : impl_(std::make_unique<Impl>(std::move(spec), std::move(plan), std::move(options))) {}
Trainer::~Trainer() = default;
const Spec& Trainer::spec() const { return impl_->spec; }
model::MultimodalModel& Trainer::model() { return impl_->model(); }
dist::Runtime& Trainer::runtime() { return *impl_->runtime; }
c10::Device Trainer::device() const { return impl_->device; }
const data::Dataset& Trainer::dataset() const { return *impl_->dataset; }

Trainer::Impl::Layout Trainer::Impl::layout_of(int64_t step) {
  Layout l;
  // The global batch (every rank sees its text: encoders and LLM split it differently), as each
  // LLM data-parallel replica's microbatches; balancing weighs each sample's encoder and LLM
  // work.
  l.samples = dataset->train_layout(step, spec.train.batch);
  std::vector<plan::SampleWork> work;
  for (const data::Sample& sample : l.samples)
    work.push_back(work_model.work(shape_of(sample, spec.model.encoders.size())));
  plan::BalanceOptions bo;
  bo.replicas = plan.module("llm").layout.dp;
  bo.microbatches = spec.train.microbatches;
  bo.policy = plan::parse_balance_policy(plan.balance);
  bo.pipeline_stages = plan.module("llm").layout.pp;
  bo.virtual_stages = plan.module("llm").layout.vp;
  l.balance = plan::balance_batch(work, work_model.cost, bo);
  // Media: only the items this rank's encoder stages read, microbatch by microbatch (the
  // replicas' items of one encoder in order, as the runtime concatenates them).
  const size_t E = spec.model.encoders.size();
  const size_t replicas = l.balance.assignment.size();
  const size_t M = replicas == 0 ? 0 : l.balance.assignment[0].size();
  for (size_t m = 0; m < M; ++m)
    for (size_t e = 0; e < E; ++e) {
      std::vector<data::MediaRef> items;  // replica-major, in collated order (row by row)
      std::vector<int64_t> counts(replicas, 0);
      for (size_t d = 0; d < replicas; ++d) {
        const std::vector<int64_t>& part = l.balance.assignment[d][m];
        std::vector<int64_t> lengths;
        for (int64_t i : part) lengths.push_back(static_cast<int64_t>(l.samples[i].tokens.size()));
        for (const std::vector<size_t>& row : data::pack_rows(lengths, collate))
          for (size_t k : row) {
            const int64_t i = part[k];
            for (size_t j = 0; j < l.samples[i].items.size(); ++j)
              if (l.samples[i].items[j].encoder == static_cast<int>(e)) {
                items.push_back({i, static_cast<int64_t>(j)});
                ++counts[d];
              }
          }
      }
      const auto [begin, end] = runtime->encoder_items_read(e, counts);
      l.wanted.insert(l.wanted.end(), items.begin() + begin, items.begin() + end);
    }
  return l;
}

const Trainer::Impl::Layout& Trainer::Impl::planned(int64_t step) {
  if (dataset->skipped() != layouts_skipped) {  // records found bad: replanned
    layouts.clear();
    layouts_skipped = dataset->skipped();
  }
  auto it = layouts.find(step);
  if (it == layouts.end()) it = layouts.emplace(step, layout_of(step)).first;
  return it->second;
}

StepBatch Trainer::prepare_step(int64_t step) {
  Impl& m = *impl_;
  const Spec& spec = m.spec;
  const dist::Comm& comm = m.opts.comm;
  // With media read from files, every rank learns which records the others could not load (one
  // small all-reduce a step): under data.on_error = "skip" all replace the same ones; under
  // "fail" all stop, not only the rank that found it. Generated media cannot be bad.
  const bool skip = spec.data.on_error == "skip";
  Impl::Layout l;
  std::map<std::pair<int64_t, int64_t>, at::Tensor> loaded;  // (record, item) across rounds
  for (int round = 0;; ++round) {
    WEFT_CHECK(round < 1000, "step ", step + 1, ": the dataset keeps finding bad media");
    for (int64_t ahead = 1; ahead <= spec.data.prefetch; ++ahead) {
      const int64_t next_step = step + ahead;
      if (next_step >= spec.train.steps || m.layouts.count(next_step)) continue;
      try {  // newly planned: its items decode in the background
        const Impl::Layout& next = m.planned(next_step);
        m.dataset->prefetch_media(next_step, next.samples, next.wanted);
      } catch (const Error&) {
        // A bad record of a later step: that step's own layout reports or replaces it.
      }
    }
    l = m.planned(step);
    std::vector<data::MediaRef> wanted;  // what earlier rounds did not load
    for (const data::MediaRef& r : l.wanted) {
      data::Sample& s = l.samples[r.sample];
      const auto it = loaded.find({s.record, r.item});
      if (it != loaded.end())
        s.items[r.item].input = it->second;
      else
        wanted.push_back(r);
    }
    std::vector<int64_t> bad;
    std::string failure;  // under "fail": this rank's error
    const bool agree = comm.size() > 1 && spec.data.media_from_files();
    try {
      bad = m.dataset->load_media(step, l.samples, wanted);
    } catch (const std::exception& e) {
      if (!agree) throw;
      failure = e.what();
    }
    if (agree) {
      // Per sample: 1 = its media is bad (skip); one more slot: a rank failed (fail).
      at::Tensor flags = torch::zeros({static_cast<int64_t>(l.samples.size()) + 1}, torch::kInt);
      int32_t* f = flags.data_ptr<int32_t>();
      for (int64_t i : bad) f[i] = 1;
      if (!failure.empty()) f[l.samples.size()] = 1;
      comm.all_reduce_max(flags);
      f = flags.data_ptr<int32_t>();
      WEFT_CHECK(failure.empty(), failure);
      WEFT_CHECK(f[l.samples.size()] == 0, "step ", step + 1,
                 ": another rank could not load the media of its items (data.on_error = "
                 "\"fail\"); its error names the file and record");
      bad.clear();
      for (int64_t i = 0; i < static_cast<int64_t>(l.samples.size()); ++i)
        if (f[i] != 0) bad.push_back(i);
    }
    WEFT_ASSERT(agree || comm.size() == 1 || bad.empty(),
                "bad media from generated data (the ranks would diverge)");
    if (bad.empty()) break;
    WEFT_ASSERT(skip, "bad media reported under data.on_error = \"fail\"");
    std::vector<data::Sample> marked;
    for (int64_t i : bad) marked.push_back(l.samples[i]);
    for (const data::MediaRef& r : l.wanted) {  // keep the good items for the next layout
      const data::Sample& s = l.samples[r.sample];
      if (s.items[r.item].input.defined()) loaded[{s.record, r.item}] = s.items[r.item].input;
    }
    m.dataset->mark_bad(marked);
  }
  m.layouts.erase(m.layouts.begin(), m.layouts.upper_bound(step));
  const int64_t replicas = m.plan.module("llm").layout.dp;
  StepBatch b;
  b.balance = std::move(l.balance);
  b.inputs.resize(static_cast<size_t>(replicas));
  for (int64_t d = 0; d < replicas; ++d)
    for (const std::vector<int64_t>& indices : b.balance.assignment[d]) {
      std::vector<data::Sample> part;
      for (int64_t i : indices) part.push_back(std::move(l.samples[i]));
      b.microbatches.push_back(data::collate(part, m.collate));
      b.inputs[d].push_back(to_inputs(b.microbatches.back()));
      b.targets += b.microbatches.back().targets.numel();
      b.tokens += b.microbatches.back().real_tokens;
    }
  // The loss is a mean over the global batch's targets.
  WEFT_CHECK(b.targets > 0, "step ", step + 1, ": the batch has no target tokens");
  return b;
}

namespace {

// A NaN prints as "nan" whatever its sign bit (which differs between kernels).
double unsigned_nan(double v) { return std::isnan(v) ? std::fabs(v) : v; }

std::string diverged(int64_t step, double loss) {
  std::ostringstream o;
  o << "step " << step + 1 << ": loss is " << unsigned_nan(loss)
    << "; training diverged (lower train.lr, keep train.grad_clip > 0, try "
       "train.precision = \"fp32\", or skip such steps with train.nonfinite = \"skip\")";
  return o.str();
}

std::string bad_gradient(int64_t step, double norm, const std::string& module) {
  std::ostringstream o;
  o << "step " << step + 1 << ": gradient norm is " << unsigned_nan(norm)
    << " — non-finite gradient in module '" << module
    << " (skip such steps with train.nonfinite = \"skip\")";
  return o.str();
}

}  // namespace

StepOutcome Trainer::train_step(const StepBatch& batch, int64_t step) {
  QueuedStep q = queue_step(batch, step);
  return finish_step(q);
}

bool Trainer::defers() const { return impl_->defer; }

QueuedStep Trainer::queue_step(const StepBatch& batch, int64_t step) {
  Impl& m = *impl_;
  const TrainSpec& ts = m.spec.train;
  QueuedStep q;
  q.step = step;
  StepOutcome& out = q.out;
  double t = now_seconds();
  auto lap = [&t] {
    const double t0 = std::exchange(t, now_seconds());
    return t - t0;
  };
  out.lr = lr_at(ts, step);
  at::Tensor loss;
  {
    model::ComputeDtypeGuard dtype(m.compute);
    loss = m.runtime->queue_step(batch.inputs, batch.targets);
  }
  out.compute_seconds = lap();
  q.times = m.runtime->times();
  q.routing = m.runtime->routing();
  const std::vector<std::pair<std::string, at::Tensor>>& trainable = m.runtime->trainable();
  if (m.defer) {
    // Nothing below reads the device: the norm, the clipping factor and the skip flag stay
    // there, and the optimizer takes them there (the fused CUDA AdamW).
    if (after_backward) after_backward(step);
    lap();
    torch::NoGradGuard no_grad;
    q.squares = m.runtime->grad_squares();
    const at::Tensor norm = model::norm_of_squares(q.squares).to(loss.device());
    out.norm_seconds = lap();
    const at::Tensor skip = at::logical_not(at::isfinite(loss).logical_and(at::isfinite(norm)));
    m.optimizer->step(out.lr, clip_scale(norm, ts.grad_clip), skip);
    m.runtime->after_optimizer_step();
    out.optimizer_seconds = lap();
    for (const auto& [name, p] : trainable) p.mutable_grad().reset();
    q.scalars = dist::HostCopy(at::stack({loss, norm}));
    return q;
  }
  out.loss = loss.item<double>();
  // Loss and gradient norm are the same on every rank, so every rank takes the same branch.
  const bool may_skip = ts.nonfinite == NonFinite::kSkip;
  WEFT_CHECK(may_skip || std::isfinite(out.loss), diverged(step, out.loss));
  if (after_backward) after_backward(step);
  lap();
  out.grad_norm = std::isfinite(out.loss) ? m.runtime->grad_norm() : static_cast<double>(NAN);
  out.norm_seconds = lap();
  WEFT_CHECK(may_skip || std::isfinite(out.grad_norm),
             bad_gradient(step, out.grad_norm, m.non_finite_grad_module()));
  out.skipped = !std::isfinite(out.loss) || !std::isfinite(out.grad_norm);
  if (!out.skipped) {
    m.optimizer->step(out.lr, clip_scale(out.grad_norm, ts.grad_clip));
    m.runtime->after_optimizer_step();
    out.optimizer_seconds = lap();
  }
  for (const auto& [name, p] : trainable) p.mutable_grad().reset();
  q.finished = true;
  return q;
}

StepOutcome Trainer::finish_step(QueuedStep& q) {
  if (q.finished) return q.out;
  const at::Tensor v = q.scalars.get();
  q.out.loss = v[0].item<double>();
  q.out.grad_norm = v[1].item<double>();
  WEFT_CHECK(std::isfinite(q.out.loss), diverged(q.step, q.out.loss));
  WEFT_CHECK(std::isfinite(q.out.grad_norm),
             bad_gradient(q.step, q.out.grad_norm, impl_->non_finite_grad_module(q.squares)));
  q.finished = true;
  return q.out;
}

std::pair<double, double> Trainer::step_flops(const StepBatch& batch) const {
  return impl_->flops_of(batch.microbatches);
}

Summary Trainer::run() {
  Impl& m = *impl_;
  const Spec& spec = m.spec;
  const TrainSpec& ts = spec.train;
  at::set_num_threads(dist::intra_op_threads(ts.threads));

  const dist::Comm& comm = m.opts.comm;
  WEFT_CHECK(comm.size() == m.plan.world_size, "the plan is for ", m.plan.world_size,
             " ranks but the job has ", comm.size());
  const bool writer = comm.rank() == 0;
  std::ofstream metrics, evals;  // a line per step; a line per evaluation
  if (writer) {
    fs::create_directories(m.run_dir);
    write_text(m.run_dir / "config.toml", spec_to_toml(spec));
    write_text(m.run_dir / "plan.json", plan::to_json(m.plan));
    // A resumed run keeps the lines of the steps up to its checkpoint; a fresh one starts empty.
    const auto open_log = [&](const char* name, std::ofstream& out) {
      const fs::path path = m.run_dir / name;
      if (m.start_step > 0)
        truncate_metrics(path, m.start_step);
      else
        std::ofstream(path, std::ios::trunc);
      out.open(path, std::ios::app);
      WEFT_CHECK(out, "cannot write ", path.string());
    };
    open_log("metrics.jsonl", metrics);
    open_log("eval.jsonl", evals);
  }

  const double peak = m.opts.peak_flops > 0 ? m.opts.peak_flops
                                            : measure_matmul_peak(m.compute, 0.6, 2048, m.device);
  const bool show = m.opts.progress && writer;
  Progress progress(m.start_step, ts.steps, ts.log_every, show && Progress::stderr_is_tty());
  if (show)
    progress.message("weft: training " + std::to_string(ts.steps) + " steps, run directory " +
                     m.run_dir.string());
  if (show && m.start_step > 0) {
    const auto bytes = [&](const char* key) {
      return format_bytes(static_cast<double>(m.resume_read[key].get<uint64_t>()));
    };
    progress.message("weft: resumed at step " + std::to_string(m.start_step) + " from " +
                     m.resume_read["checkpoint"].get<std::string>() + ": this rank read " +
                     bytes("bytes_read") + " of tensor data and proved " + bytes("bytes_verified") +
                     " against the manifest, of its " + bytes("checkpoint_bytes"));
  }

  double train_seconds = 0, total_flops = 0, total_llm_flops = 0;
  std::map<std::string, double> time_parts;  // summed over this session's steps (summary.json)
  json saves = json::array();  // this session's checkpoints: step, bytes, seconds (rank 0's)
  int64_t total_tokens = 0;
  double loss_last = NAN;
  double accuracy = -1, eval_loss = NAN;
  std::vector<std::pair<std::string, std::string>> examples;
  int64_t eval_step = 0;
  bool last_eval = false;
  int64_t skipped_steps = 0;
  const double wall_start = now_seconds();

  // Collective. Where the layout spreads the model, the validation loss is computed in it
  // (every rank its part, nothing gathered) and, unless train.eval_captions is off, the captions
  // are generated by rank 0 on a copy gathered for it (train.eval_generation = "gather") or in
  // the layout ("layout"); where rank 0 holds the model whole, it evaluates both there.
  auto run_eval = [&]() {
    const double eval_start = now_seconds();
    const bool spread = !m.whole_model();
    // Every rank runs its part of the layout's loss; only rank 0 evaluates a whole model.
    const std::vector<data::Sample> eval_set =
        spread || comm.rank() == 0 ? m.dataset->eval_set() : std::vector<data::Sample>();
    EvalResult r;
    r.samples = static_cast<int64_t>(eval_set.size());
    r.caption_accuracy = -1;
    if (spread) {
      const auto [sum, targets] = m.layout_eval_loss(eval_set);
      r.targets = targets;
      r.loss = targets > 0 ? sum / static_cast<double>(targets) : NAN;
    }
    const bool in_layout = spread && ts.eval_generation == EvalGeneration::kLayout;
    const double captions_start = now_seconds();  // in the layout, or gathered (and the loss)
    if (ts.eval_captions && in_layout) {
      const std::vector<std::vector<int64_t>> ids = m.layout_generate(eval_set);
      if (comm.rank() == 0) {
        EvalResult got;
        add_captions(got, ids, eval_set, *m.dataset);
        r.caption_accuracy = caption_accuracy(got.captions, eval_set);
        r.examples = got.examples;
        r.captions = got.captions;
      }
    } else if (ts.eval_captions || !spread) {
      m.evaluate_on_root([&](const model::MultimodalModel& eval_model) {
        // The weights cast once for the whole evaluation, not again for every generated token
        // (a copy gathered for it holds them in the compute dtype already).
        std::optional<model::CastOnce> casts;
        if (!spread) casts.emplace(eval_model.parameters(), model::CastOnce::Keep::kEverything);
        EvalOptions eo;
        eo.batch = m.generation_batch();
        eo.compute_dtype = m.compute;
        eo.loss = !spread;  // else computed in the layout
        eo.captions = ts.eval_captions;
        const EvalResult got = evaluate_captions(eval_model, eval_set, *m.dataset, eo);
        r.caption_accuracy = got.caption_accuracy;
        r.examples = got.examples;
        r.captions = got.captions;
        if (!spread) r.loss = got.loss, r.targets = got.targets;
      });
    }
    if (comm.rank() != 0) return;
    accuracy = r.caption_accuracy;
    eval_loss = r.loss;
    examples = r.examples;
    json line;
    line["step"] = eval_step;
    line["caption_accuracy"] = r.caption_accuracy >= 0 ? json(r.caption_accuracy) : json();
    line["loss"] = r.loss;
    line["samples"] = r.samples;
    line["targets"] = r.targets;
    // Rank 0's: the whole evaluation, and from the end of the layout's loss on (the captions,
    // with the loss too where a whole model on rank 0 computes both).
    const double eval_end = now_seconds();
    line["seconds"] = eval_end - eval_start;
    line["caption_seconds"] = eval_end - captions_start;
    if (!r.captions.empty()) {  // the latest evaluation's captions, every sample's
      std::string text;
      for (size_t i = 0; i < r.captions.size(); ++i)
        text += json{{"step", eval_step},
                     {"sample", i},
                     {"generated", r.captions[i]},
                     {"reference", eval_set[i].caption}}
                    .dump(-1, ' ', false, json::error_handler_t::replace) +
                (i + 1 < r.captions.size() ? "\n" : "");
      write_text(m.run_dir / "captions.jsonl", text);
    }
    evals << line.dump() << "\n";
    evals.flush();
    if (show && !last_eval) {
      std::string text = "step " + std::to_string(eval_step) + ": eval loss " + fixed(r.loss, 4);
      if (r.caption_accuracy >= 0) text += ", caption accuracy " + fixed(r.caption_accuracy, 3);
      progress.message(text);
    }
  };

  // A step is finished (its loss read, its metrics written) after the next one is queued when
  // reads are deferred (a GPU then runs step t while the host prepares step t + 1), at once
  // otherwise. step_seconds runs to this step's finish from the previous one's: from its finish
  // when a step was in flight during its bookkeeping (the device's pace), from the end of its
  // bookkeeping (metrics, evaluation, checkpoint) when none was.
  struct Pending {
    QueuedStep q;
    StepBatch batch;
    double data_seconds = 0;
    // Bad records found by the time this step was prepared: its own, and any of the next
    // data.prefetch steps' that planning them found invalid (not those of steps queued later).
    int64_t data_skipped = 0;
  };
  double last_done = now_seconds();
  // The traced step's operators (TrainerOptions::trace_ops): recorded from its queueing to its
  // finish, the device idle at both ends (it runs alone).
  std::unique_ptr<OpTrace> op_trace;
  const auto ops_traced = [&](int64_t step) {
    return m.opts.trace_ops && step + 1 == spec.output.trace_step;
  };
  auto complete = [&](Pending& p, bool next_in_flight) {
    const StepOutcome out = finish_step(p.q);
    const bool trace_done = op_trace && ops_traced(p.q.step);
    if (trace_done) dist::synchronize(m.device);
    const double finished = now_seconds();
    if (trace_done) op_trace.reset();  // written outside the step's time (it runs alone)
    const StepBatch& batch = p.batch;
    const int64_t step = p.q.step;
    const double data_seconds = p.data_seconds;
    const double loss = out.loss, grad_norm = out.grad_norm, lr = out.lr;
    const bool skipped = out.skipped;
    const dist::StepTimes& times = p.q.times;
    if (skipped) {
      ++skipped_steps;
      if (show)
        progress.message("step " + std::to_string(step + 1) + ": non-finite " +
                         (std::isfinite(loss) ? "gradient" : "loss") +
                         ", update skipped (train.nonfinite = \"skip\")");
    }
    const double step_seconds = finished - last_done;

    const int64_t tokens = batch.tokens;
    // MFU is per device: the job's FLOPs over (seconds x devices x peak).
    const auto [job_flops, job_llm_flops] = step_flops(batch);
    const double flops = job_flops / comm.size(), llm_flops = job_llm_flops / comm.size();
    train_seconds += step_seconds;
    total_flops += flops;
    total_llm_flops += llm_flops;
    total_tokens += tokens;
    if (std::isnan(m.loss_first) && std::isfinite(loss)) m.loss_first = loss;
    loss_last = loss;

    json line;
    line["step"] = step + 1;
    line["loss"] = loss;
    line["lr"] = lr;
    line["grad_norm"] = grad_norm;
    line["tokens"] = tokens;
    line["step_seconds"] = step_seconds;
    line["data_seconds"] = data_seconds;
    line["compute_seconds"] = out.compute_seconds;
    line["norm_seconds"] = out.norm_seconds;
    line["optimizer_seconds"] = out.optimizer_seconds;
    time_parts["data"] += data_seconds;
    time_parts["compute"] += out.compute_seconds;
    time_parts["norm"] += out.norm_seconds;
    time_parts["optimizer"] += out.optimizer_seconds;
    line["tokens_per_second"] = static_cast<double>(tokens) / step_seconds;
    line["mfu"] = flops / step_seconds / peak;
    std::vector<double> mb_costs;
    for (const auto& replica : batch.balance.microbatch_cost)
      mb_costs.insert(mb_costs.end(), replica.begin(), replica.end());
    line["microbatch_imbalance"] = plan::spread(mb_costs).max_over_mean;  // max / mean work
    if (m.plan.module("llm").layout.cp > 1) line["cp_imbalance"] = times.cp_imbalance;
    if (m.spec.model.llm.moe.enabled()) {  // expert routing (dist::RoutingReport)
      const dist::RoutingReport& r = p.q.routing;
      line["moe_balance_loss"] = r.balance_loss;
      line["moe_z_loss"] = r.z_loss;
      line["moe_expert_imbalance"] = r.imbalance;
      line["moe_dropped_fraction"] =
          r.routed > 0 ? static_cast<double>(r.dropped) / static_cast<double>(r.routed) : 0.0;
      line["moe_expert_load"] = r.load;
    }
    // This process's peak memory so far: the device's peak allocated bytes, or on the CPU the
    // peak resident set (written before this step's checkpoint, which it does not count).
    const int64_t peak_bytes =
        m.device.is_cuda() ? dist::device_peak_bytes(m.device) : peak_rss_bytes();
    line["peak_memory_mib"] = static_cast<double>(peak_bytes) / (1 << 20);
    if (skipped) line["skipped"] = true;
    if (p.data_skipped > 0) line["data_skipped"] = p.data_skipped;  // bad records
    if (m.opts.restart > 0 && step == m.start_step) line["restart"] = m.opts.restart;
    if (comm.size() > 1) {
      line["grad_sync_seconds"] = times.grad_sync_seconds;  // exposed reduction time
      line["grad_buckets_overlapped"] = times.buckets_overlapped;
      line["p2p_wait_seconds"] = times.p2p_wait_seconds;
      line["collective_wait_seconds"] = times.collective_wait_seconds;
      if (m.spec.train.zero_stage == 1) {  // exposed wait for the parameters' all-gather
        line["param_wait_seconds"] = times.param_wait_seconds;
        time_parts["param_wait"] += times.param_wait_seconds;
      }
      time_parts["collective_wait"] += times.collective_wait_seconds;
      time_parts["grad_sync"] += times.grad_sync_seconds;
      time_parts["p2p_wait"] += times.p2p_wait_seconds;
    }
    if (writer) {
      metrics << line.dump() << "\n";
      metrics.flush();
    }
    if (show) progress.update(step + 1, loss, static_cast<double>(tokens) / step_seconds, lr);

    const bool last = step + 1 == ts.steps;
    if (m.opts.eval && ts.eval_every > 0 && (step + 1) % ts.eval_every == 0 && !last) {
      eval_step = step + 1;
      run_eval();
    }
    if (last || (ts.checkpoint_every > 0 && (step + 1) % ts.checkpoint_every == 0)) {
      const Impl::Saved saved = m.save(step + 1, m.prior_wall_seconds + now_seconds() - wall_start);
      saves.push_back({{"step", step + 1}, {"bytes", saved.bytes}, {"seconds", saved.seconds}});
      if (show)
        progress.message("weft: checkpoint " + saved.dir + ": " +
                         format_bytes(static_cast<double>(saved.bytes)) + " from " +
                         std::to_string(comm.size()) + (comm.size() == 1 ? " rank" : " ranks") +
                         " in " + fixed(saved.seconds, 2) + " s");
    }
    last_done = next_in_flight ? finished : now_seconds();
  };

  const auto queue = [&](int64_t step) {
    const double t0 = now_seconds();
    Pending current;
    current.batch = prepare_step(step);
    current.data_seconds = now_seconds() - t0;
    current.data_skipped = m.dataset->skipped();
    const bool traced = step + 1 == spec.output.trace_step;
    m.runtime->set_tracing(traced);
    if (ops_traced(step)) {
      dist::synchronize(m.device);
      op_trace = std::make_unique<OpTrace>(
          (m.run_dir / ("ops.rank" + std::to_string(m.opts.comm.rank()) + ".json")).string());
    }
    current.q = queue_step(current.batch, step);
    if (traced) {  // collective; rank 0 writes the step's timeline
      const std::string trace = m.runtime->gather_trace();
      if (writer) write_text(m.run_dir / "trace.json", trace);
    }
    return current;
  };
  // Evaluation and checkpoints read the parameters: their step finishes first.
  const auto reads_model = [&](int64_t step) {
    return (m.opts.eval && ts.eval_every > 0 && (step + 1) % ts.eval_every == 0) ||
           (ts.checkpoint_every > 0 && (step + 1) % ts.checkpoint_every == 0);
  };
  run_steps<Pending>(m.start_step, ts.steps, queue, complete, reads_model, ops_traced);
  progress.finish();
  last_eval = true;
  eval_step = ts.steps;
  if (m.opts.eval) run_eval();

  Summary s;
  s.run_dir = m.run_dir.string();
  s.steps = ts.steps;
  s.loss_first = m.loss_first;
  s.loss_last = loss_last;
  s.eval_caption_accuracy = accuracy;
  s.eval_loss = eval_loss;
  s.tokens_per_second = train_seconds > 0 ? static_cast<double>(total_tokens) / train_seconds : 0;
  s.mfu = train_seconds > 0 ? total_flops / train_seconds / peak : 0;
  s.wall_seconds = m.prior_wall_seconds + now_seconds() - wall_start;

  json j = json::parse(s.to_json());
  j["mfu_llm_only"] = train_seconds > 0 ? total_llm_flops / train_seconds / peak : 0;
  j["peak_flops"] = peak;
  j["precision"] = to_string(ts.precision);
  j["train_seconds"] = train_seconds;
  j["time_seconds"] = time_parts;  // rank 0's parts of train_seconds (metrics.jsonl's, summed)
  j["checkpoints_written"] = saves;
  j["resumed_from_step"] = m.start_step;
  if (m.start_step > 0) j["resume_read"] = m.resume_read;  // rank 0's
  j["skipped_steps"] = skipped_steps;
  j["restarts"] = m.opts.restart;
  j["eval_examples"] = json::array();
  j["world_size"] = comm.size();
  j["threads"] = at::get_num_threads();  // rank 0's intra-op threads
  for (const auto& [gen, ref] : examples)
    j["eval_examples"].push_back({{"generated", gen}, {"reference", ref}});
  if (writer) write_text(m.run_dir / "summary.json", j.dump(2));
  return s;
}

}  // namespace weft::train
