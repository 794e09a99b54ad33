// Trainer: executes a Plan for a Spec — the training loop (gradient accumulation over
// microbatches, clipping, AdamW, LR schedule), metrics, checkpoints, resume and evaluation.
// A single-process run is the Plan with every size 1; the distributed runtime plugs in here.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "weft/core/spec.h"
#include "weft/data/collate.h"
#include "weft/dist/comm.h"
#include "weft/dist/device.h"
#include "weft/dist/runtime.h"
#include "weft/io/checkpoint.h"
#include "weft/model/multimodal.h"
#include "weft/plan/balance.h"
#include "weft/plan/plan.h"

namespace weft::data {
class Dataset;
}

namespace weft::train {

// Whether a step leaves its loss and gradient norm on the device for the host to read later
// (Trainer::queue_step): kAuto on a GPU when the run allows it (one rank, train.nonfinite =
// "stop"), so the GPU never waits for the host between steps; kAlways forces it where the run
// allows it, on the CPU too (tests); kNever reads them inside each step.
enum class DeferReads { kAuto, kAlways, kNever };

struct TrainerOptions {
  std::string out_dir;     // run directory ("" = runs/<timestamp>)
  std::string resume_dir;  // continue this run from its newest checkpoint ("" = fresh)
  bool progress = true;    // progress bar / log lines on stderr
  double peak_flops = 0;   // MFU denominator; 0 = measure the matmul peak at start
  bool eval = true;        // caption evaluation at eval_every and at the end
  int restart = 0;         // how many times the launcher restarted this job (metrics record it)
  int local_rank = 0;      // this rank's GPU under train.device = "cuda" (LOCAL_RANK)
  DeferReads defer = DeferReads::kAuto;
  // Every rank records its operators in step output.trace_step (which then runs alone) and
  // writes them to ops.rank<N>.json in the run directory (train/op_trace.h).
  bool trace_ops = false;
  // The job's ranks (default: this process alone). Its size must equal the plan's world size.
  // Rank 0 writes the run directory and evaluates (where the layout spreads the model, on a copy
  // gathered onto it for the evaluation, in the compute dtype, and freed after); every rank
  // trains.
  dist::Comm comm;
};

struct Summary {
  std::string run_dir;
  int64_t steps = 0;
  double loss_first = 0, loss_last = 0;
  double eval_caption_accuracy = -1;  // -1 when not evaluated
  double eval_loss = NAN;             // validation loss per target token; NaN when not evaluated
  double tokens_per_second = 0;
  double mfu = 0;
  double wall_seconds = 0;  // training wall time of this and earlier (resumed) sessions
  std::string to_json() const;
};

// Errors unless a checkpoint's whole tensors (io::CheckpointReader::shapes) are those of the
// model `spec` describes: every parameter, each at its full shape, nothing else, and each
// optimizer moment ("exp_avg.<name>" / "exp_avg_sq.<name>") at its parameter's shape. `ckpt`
// names the checkpoint and `model_of` the config in errors. Checked on a meta-device model:
// nothing is allocated.
void check_checkpoint_fits(const io::NamedShapes& model, const io::NamedShapes& optimizer,
                           const ModelSpec& spec, const std::string& ckpt,
                           const std::string& model_of);

// One step's global batch, assigned to LLM data-parallel replicas and microbatches (balanced per
// the plan) and collated.
struct StepBatch {
  std::vector<data::Microbatch> microbatches;      // replica-major
  std::vector<std::vector<model::Inputs>> inputs;  // [replica][microbatch]
  plan::BatchBalance balance;
  int64_t targets = 0;  // target tokens of the global batch (the loss is their mean)
  int64_t tokens = 0;   // real (non-padding) tokens
};

// What a training step did.
struct StepOutcome {
  double loss = 0, grad_norm = 0, lr = 0;
  bool skipped = false;  // non-finite loss or gradient, update skipped (train.nonfinite = "skip")
  // Where the step's time went on this rank: the runtime's forward / backward / gradient
  // reduction (Runtime::step), the gradient norm, and the optimizer update.
  double compute_seconds = 0, norm_seconds = 0, optimizer_seconds = 0;
};

// A step queued by Trainer::queue_step whose loss and gradient norm the host may not have read.
struct QueuedStep {
  int64_t step = 0;
  StepOutcome out;  // lr and host times at once; loss and grad_norm once finished
  bool finished = false;
  dist::HostCopy scalars;       // [loss, gradient norm] on their way to the host (deferred)
  at::Tensor squares;           // per trainable parameter, Σ grad² (names a non-finite one)
  dist::StepTimes times;        // the runtime's, of this step
  dist::RoutingReport routing;  // the runtime's, of this step
};

class Trainer {
 public:
  Trainer(Spec spec, plan::Plan plan, TrainerOptions options);
  ~Trainer();
  Summary run();

  // The pieces of a step, as run() uses them (and `weft bench step`): the global batch of step
  // `step` (0-based) drawn and collated — with the media of only the items this rank's encoder
  // stages read, and under data.on_error = "skip" the records any rank found bad replaced on
  // every rank (collective then); then forward, backward, gradient clipping and the
  // optimizer update on it (collective over the job's ranks).
  StepBatch prepare_step(int64_t step);
  StepOutcome train_step(const StepBatch& batch, int64_t step);
  // train_step in two halves. queue_step runs the step; where reads are deferred (defers()) it
  // clips and updates on the device with the loss and gradient norm left there, and returns
  // without waiting for the device, so the host can prepare and queue the next step while the
  // device works. finish_step reads them (waiting for this step's work only) and raises a
  // non-finite loss or gradient as train_step does (the update of such a step is skipped on
  // the device; the error comes when the step is finished).
  QueuedStep queue_step(const StepBatch& batch, int64_t step);
  StepOutcome finish_step(QueuedStep& q);
  bool defers() const;
  // The job's model FLOPs of a step, all modules and LLM only (frozen-aware).
  std::pair<double, double> step_flops(const StepBatch& batch) const;

  // The spec as trained (model.llm.vocab resolved from the tokenizer).
  const Spec& spec() const;
  // The model being trained (initialised, or loaded from the resumed checkpoint).
  model::MultimodalModel& model();
  // Where this rank computes (train.device resolved: the CPU, or its GPU).
  c10::Device device() const;
  // This rank's share of the Plan (gathering full tensors, groups).
  dist::Runtime& runtime();
  // This rank's dataset (what it has loaded, what it skipped).
  const data::Dataset& dataset() const;
  // Called after the gradients of a step are accumulated, before clipping and the optimizer
  // (tests use it to inspect or poison gradients).
  std::function<void(int64_t step)> after_backward;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The step loop of `weft train` (Trainer::run) and `weft bench step`. Steps [begin, end) are
// queued in order by queue(i), which returns a State holding its QueuedStep as `q`; finish(state,
// next_in_flight) finishes one. Where reads are deferred (a GPU) step i is finished after step
// i + 1 is queued, so the device runs step i + 1 while the host does step i's bookkeeping;
// next_in_flight says whether step i + 1 is then still running. Step i is finished at once,
// before the next is queued, when it is the last, when finish_now(i) (its model is read:
// evaluation, a checkpoint) or alone(i); alone(i) also finishes the step before it first, so it
// runs on its own (a profiled step). When a step throws, the one still unread is finished
// first (its own error, if any, dropped for the first).
template <class State, class Queue, class Finish, class FinishNow, class Alone>
void run_steps(int64_t begin, int64_t end, Queue&& queue, Finish&& finish, FinishNow&& finish_now,
               Alone&& alone) {
  std::optional<State> pending;
  const auto finish_pending = [&](bool next_in_flight) {
    if (!pending) return;
    State previous = std::move(*pending);
    pending.reset();
    finish(previous, next_in_flight);
  };
  try {
    for (int64_t i = begin; i < end; ++i) {
      if (alone(i)) finish_pending(false);
      State current = queue(i);
      finish_pending(!current.q.finished);
      if (current.q.finished || i + 1 == end || finish_now(i) || alone(i))
        finish(current, false);
      else
        pending = std::move(current);
    }
  } catch (...) {
    // A later step failed while one was still unread: keep that one's metrics if it went well.
    try {
      finish_pending(false);
    } catch (...) {  // the later step's error is the one reported
    }
    throw;
  }
}

}  // namespace weft::train
