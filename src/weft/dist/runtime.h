// Runtime: executes a Plan on this rank — every module with its own layout.
//
// From the Plan it derives what this rank holds of each module (pipeline stage, tensor- and
// context-parallel shard), builds the c10d groups (created in the same order on every rank),
// and runs a training step:
//
//  1. encoders, forward: each encoder's ranks split the items of global microbatch m (every LLM
//     replica's m-th microbatch) over its data-parallel ranks and run its stages, passing
//     activations by point-to-point sends (under CP each rank holds a contiguous share of every
//     item's tokens, gathered back at the end); the last stage applies the projector;
//  2. bridge: encoder tp- and cp-rank 0 sends each item's features to the first-stage LLM ranks of
//  the
//     replica whose sample holds it (every TP and CP rank: TP replicates them, each CP rank
//     keeps the placeholder rows it owns) — fan-in, fan-out or equal DP, colocated or separate;
//  3. LLM: a 1F1B schedule over its stages (interleaved over each rank's chunks under virtual
//     stages, plan.h pipeline_schedule); under CP each rank holds its token blocks
//     (contiguous or zigzag) with original positions, attention gathers K/V, the loss is summed
//     over each rank's own targets;
//  4. bridge, backward: feature gradients go back the reverse way (from LLM tp-rank 0; CP ranks'
//     partial gradients summed at the encoder), then the encoders' backward in stage order.
//
// A module with nothing to train (frozen, nothing trainable upstream) runs forward only and
// keeps no activations; frozen modules send no gradients back. Gradients are then summed over
// each module's data- and context-parallel ranks (bucketed, overlapped with its last backward)
// and a tied embedding's two copies (first and last LLM stage) are summed.
//
// Sends never block (they are waited at the end of the step) and receives follow a fixed order
// on every rank, so any Plan runs without deadlock; a dead peer ends the step with an error.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "weft/core/spec.h"
#include "weft/dist/comm.h"
#include "weft/dist/data_parallel.h"
#include "weft/io/checkpoint.h"
#include "weft/model/multimodal.h"
#include "weft/plan/plan.h"

namespace weft::dist {

struct RuntimeOptions {
  int64_t bucket_bytes = 4 << 20;  // gradient reduction bucket size
  bool overlap_grad_reduce = true;
  bool zero1 = false;  // optimizer state sharded over each module's data-parallel ranks
  // ZeRO-1: the dtype stepped parameters are all-gathered in. The compute dtype (bf16) halves the
  // bytes: other ranks' shards are then held rounded as every use casts them (parameters used in
  // fp32, norms and routers, still travel in fp32), each rank's own shard stays exact, and
  // checkpoints and gather_parameters() take every shard from the rank that holds it exactly.
  at::ScalarType param_gather_dtype = at::kFloat;
  // ZeRO-1: the parameter all-gather left in flight after the optimizer step, each bucket
  // waited for where the next forward first reads it (GradSync::gather_params(true)).
  bool overlap_param_gather = true;
  bool cast_once = true;  // parameters cast to the compute dtype once per step (model::CastOnce)
  // What frozen modules' cast parameters are held in (model::Hosting::frozen_dtype).
  at::ScalarType frozen_dtype = at::kFloat;
  // Point-to-point messages through shared memory where the world group has it
  // (train.shared_memory_messages; Comm::subgroup's `messages`).
  bool shared_memory_messages = true;
  // Where parameters and activations live (the batch stays on the CPU: each rank moves its own
  // slices). With several ranks on CUDA, a Comm connected with device collectives runs them over
  // NCCL; without (ranks sharing a GPU in tests), they go through host memory over Gloo.
  c10::Device device = c10::kCPU;
};

struct StepTimes {
  double grad_sync_seconds = 0;  // exposed (not overlapped) gradient reduction
  // ZeRO-1 with the overlapped parameter gather: time this step waited for parameter values
  // still in flight from the last optimizer step (the gather's exposed part; with NCCL the
  // host's wait only, the device stream waiting instead).
  double param_wait_seconds = 0;
  int64_t buckets_overlapped = 0;
  double p2p_wait_seconds = 0;  // time blocked in receives (pipeline bubbles + transfers)
  // Time blocked in the TP / CP / EP / SP collectives of forward and backward (blocked_seconds():
  // Gloo's, on the thread that ran them; the gradient reduction is grad_sync_seconds).
  double collective_wait_seconds = 0;
  // LLM context parallelism: the largest over this step's microbatches (all replicas) of
  // (most-loaded CP rank's attention + linear work) / (mean rank work); 1 without CP.
  double cp_imbalance = 1;
};

// Mixture-of-experts routing over the last step, all ranks together (an MoE LLM only).
struct RoutingReport {
  std::vector<int64_t> layers;             // the MoE blocks
  std::vector<std::vector<int64_t>> load;  // per MoE block: token assignments each expert ran
  double balance_loss = 0;  // load-balancing loss, mean over rows and MoE blocks (1 = uniform)
  double z_loss = 0;        // router z-loss, mean over rows and MoE blocks
  int64_t routed = 0, dropped = 0;  // token-expert assignments chosen; dropped by capacity
  double imbalance = 1;  // the largest over blocks of (busiest expert's load) / (mean load)
};

class Runtime {
 public:
  Runtime(const ModelSpec& model, uint64_t seed, const plan::Plan& plan, Comm world,
          RuntimeOptions options = {});
  ~Runtime();

  model::MultimodalModel& model();
  const Comm& world() const;
  // This rank's trainable parameters (the optimizer's list), and what of them this rank steps
  // (train::AdamW's pieces, indices into trainable()): under ZeRO-1 its shards of the sharded
  // parameters (whose .grad is then valid on those pieces only; under bf16 the parameters
  // themselves held in bf16, the pieces' masters exact), every other one whole.
  const model::NamedTensors& trainable() const;
  const std::vector<ShardPiece>& optimizer_pieces() const;

  // Forward and backward of one step. batch[d][m] is LLM data-parallel replica d's microbatch m;
  // every rank passes the whole global batch. Gradients of (Σ loss over targets) / `targets`
  // end up summed and synchronised on this rank's parameters. Returns the step's loss, the same
  // on every rank.
  double step(const std::vector<std::vector<model::Inputs>>& batch, int64_t targets);
  // The same step, its loss as a 0-dim double tensor. With one rank the tensor is on the device
  // and nothing waits for the device: the work is queued, and the host reads the loss when it
  // needs it (a GPU keeps busy while the host prepares the next step). With several ranks it is
  // the ranks' sum, on the CPU.
  at::Tensor queue_step(const std::vector<std::vector<model::Inputs>>& batch, int64_t targets);
  // Forward only, each module in its layout: Σ loss over the targets of `batch` (arranged as for
  // step), the same on every rank. Nothing is kept for a backward and no gradient is touched;
  // times(), routing() and tracing stay as the last training step left them. Collective: every
  // rank calls it with the same batch. An evaluation, without gathering the model anywhere.
  double eval_loss_sum(const std::vector<std::vector<model::Inputs>>& batch);
  // Forward only, as eval_loss_sum: greedy decoding's next token at every target of `batch`, the
  // id in [0, vocab) whose logit is largest at the target's row (Llm::greedy), in the batch's
  // order of targets (replica, microbatch, then each microbatch's), the same on every rank;
  // with `logprob`, also each id's log-probability (the softmax over [0, vocab)) into it, at one
  // more sum over TP (so every rank passes it, or none). Collective. With one target after each
  // sample's last token, a step of generation through the layout.
  std::vector<int64_t> eval_next_tokens(const std::vector<std::vector<model::Inputs>>& batch,
                                        int64_t vocab, std::vector<double>* logprob = nullptr);
  // Generation through the layout with a KV cache. eval_prefill is eval_next_tokens over a batch
  // whose every row holds at most one target, at its last token (the sequence's end, whose next
  // token it predicts), and every LLM rank also keeps its blocks' keys and values of each
  // microbatch, with room for `room` more positions (under TP its heads', under CP every rank
  // the whole sequence's). Each eval_decode then appends ids[k] to the k-th target's sequence
  // (ids in the order returned, one per target) and returns the greedy id after it, the same on
  // every rank: one forward of one token per row through the LLM's stages, with no encoder and
  // no earlier position recomputed. Rows without a target decode an unused id. `logprob` as
  // for eval_next_tokens. Collective; at most `room` decodes per prefill. eval_release (or the
  // next prefill) frees the caches.
  std::vector<int64_t> eval_prefill(const std::vector<std::vector<model::Inputs>>& batch,
                                    int64_t vocab, int64_t room,
                                    std::vector<double>* logprob = nullptr);
  std::vector<int64_t> eval_decode(const std::vector<int64_t>& ids,
                                   std::vector<double>* logprob = nullptr);
  void eval_release();
  // The items of encoder e in one microbatch whose inputs this rank reads (its first stage of
  // e): [begin, end) of the microbatch's items of e over all LLM replicas in order, when
  // replica d has counts[d] of them; {0, 0} when it reads none. Only these need loading: every
  // other item's input may be left out (Inputs::encoder_first).
  std::pair<int64_t, int64_t> encoder_items_read(size_t e,
                                                 const std::vector<int64_t>& counts) const;
  const StepTimes& times() const;
  const RoutingReport& routing() const;
  // Records the timeline of the following steps (forward / backward ops without the time blocked
  // in receives, gradient reductions; seconds from the step's start on each rank).
  void set_tracing(bool on);
  // The last traced step of every rank as a Chrome / Perfetto trace (plan/trace.h) on `root`
  // ("" elsewhere). Collective.
  std::string gather_trace(int root = 0) const;

  // ‖g‖ over every trainable parameter of the model (each counted once however it is
  // replicated or split), all ranks together (clipping scales the update by
  // train::clip_scale(norm, max)). Collective.
  double grad_norm();
  // One rank only: per trainable parameter (trainable()'s order), Σ grad² as a double tensor
  // [n] on the device (0 for a parameter without a gradient), queued, not read: the gradient
  // norm is the square root of its sum, and a non-finite entry names the parameter.
  at::Tensor grad_squares() const;
  // After the optimizer stepped (ZeRO-1): every rank gets its parameters' updated values (the
  // all-gathers of the stepped shards; overlapped, they arrive as the next forward reads them,
  // and model(), gather_parameters() and checkpoint_shards() wait for them all).
  void after_optimizer_step();

  // Full (unsharded) tensors of the whole model on `root`, by parameter name: for each of this
  // rank's parameters k, local[k] is a tensor shaped like it (the parameter, its gradient, an
  // optimizer moment). Collective; other ranks get an empty list.
  model::NamedTensors gather_full(const std::vector<at::Tensor>& local, int root = 0) const;
  // Every parameter's exact value, at full shape on `root` (gather_full of the parameters, under a
  // narrow ZeRO-1 gather each shard from the rank that steps it). Collective.
  model::NamedTensors gather_parameters(int root = 0) const;
  // The same, each tensor handed to `sink` on `root` as it arrives (a host tensor it may keep),
  // so the root never holds more of them than `sink` keeps. Collective.
  using TensorSink = std::function<void(const std::string& name, at::Tensor value)>;
  void gather_parameters(int root, const TensorSink& sink) const;
  // Same for tensors shaped like the trainable parameters (gradients, optimizer moments): under
  // ZeRO-1 per_trainable[t] of a sharded parameter counts on this rank's pieces only (it may be
  // undefined where there are none); the group's pieces make the whole.
  model::NamedTensors gather_trainable(std::vector<at::Tensor> per_trainable, int root = 0) const;
  // This rank's part of a sharded checkpoint: "model/<name>" for every parameter whose shard
  // this rank holds canonically (each shard of each parameter is canonical on exactly one rank,
  // up to a tied embedding's copies) and "optimizer/<kind>.<name>" for each `moments` entry
  // (kind, one tensor per optimizer_pieces() entry, shaped as the piece). Under ZeRO-1 every
  // rank of a group writes its own pieces as flat ranges (io::TensorShard::shape), of the
  // moments and of the masters of parameters held in bf16: nothing is gathered, and no rank
  // holds more than its share. Local.
  std::vector<io::TensorShard> checkpoint_shards(
      const std::vector<std::pair<std::string, std::vector<at::Tensor>>>& moments) const;
  // Sets this rank's parameter k (model().parameters() order) to `value` (its shape, any
  // dtype), exactly: a parameter held in bf16 under ZeRO-1 takes the rounded value and the
  // optimizer's masters of its pieces the exact one. Local.
  void set_parameter(size_t k, const at::Tensor& value);
  // Index into the model's parameters of trainable parameter t.
  size_t param_index(size_t t) const;
  // This rank's shard of a full tensor of parameter k.
  at::Tensor shard_of(size_t k, const at::Tensor& full) const;
  // The same shard as a checkpoint reader takes it (io::CheckpointReader::read).
  io::ShardSplit shard_split(size_t k) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weft::dist
