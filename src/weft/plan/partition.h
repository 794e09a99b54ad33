// Frozen-aware pipeline partition: a per-layer cost model (forward, input-gradient and
// weight-gradient work, activation and parameter memory; FLOPs here, or measured seconds from a
// profile, profile.h), an exact partitioner that cuts one module's blocks into contiguous
// pipeline stages minimising the slowest stage (the 1F1B steady state runs at the pace of the
// bottleneck stage) under a per-stage memory limit, and a joint partitioner of every module
// together (encoders and LLM, colocated or on separate ranks; below), make_plan's default.
//
// Frozen rules (REFERENCES.md, "Pipelines with frozen modules"), per layer, from its module's
// backward flags (plan.h ModulePlan):
//   trainable (weight_grads)                 forward + input_grad + weight_grad, keeps activations,
//                                            holds params + grads + optimizer state
//   frozen, something trainable upstream     forward + input_grad, keeps activations, params only
//   frozen, nothing trainable upstream       forward only, keeps no activations, params only
// A partitioner that ignores them puts too few layers on frozen stages.
//
// Memory of stage s of P under 1F1B, which keeps in_flight(s) = min(P - s, microbatches)
// microbatches alive on stage s:
//   Σ (param_bytes + train_state_bytes) + in_flight(s) · Σ activation_bytes.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/plan/flops.h"
#include "weft/plan/plan.h"

namespace weft::plan {

// Cost of one layer for one microbatch. Work is in any consistent unit (FLOPs from flops.h, or
// seconds from a measured profile); memory in bytes.
struct LayerCost {
  std::string name;             // "llm.embed", "llm.layers.3", "llm.head", "vision.front", ...
  double forward = 0;           // forward work
  double input_grad = 0;        // backward work producing the input gradient
  double weight_grad = 0;       // backward work producing the weight gradients
  double activation_bytes = 0;  // kept from forward to backward
  // Of activation_bytes, what each tensor-parallel rank keeps whole rather than 1/tp of, without
  // sequence parallelism (the norms' inputs and outputs: the residual stream between the TP
  // regions) and with it (an MoE block's tokens, gathered whole over TP).
  double tp_whole_bytes = 0, sp_whole_bytes = 0;
  double param_bytes = 0;        // the parameters themselves (held frozen or not)
  double train_state_bytes = 0;  // gradients + optimizer state, held only when trainable
  // Trainable parameters every TP rank holds whole and, under sequence parallelism, applies to
  // its part of the sequence only (norms, row-parallel biases: model::Shard::whole()), whose
  // gradients are summed over TP at the end of the step; 0 when frozen.
  double partial_grad_params = 0;
  // Parameter-shaped tensors besides the parameters held at the step's peak, once per stage like
  // the parameters: their compute-dtype casts (ParamHolding::casts), and the weight gradient a
  // fused head and loss makes in forward (model/cross_entropy.h).
  double copy_bytes = 0;
  // Of copy_bytes, the casts of trainable parameters: under a bf16 run's ZeRO-1 the parameters a
  // rank shards are held in bf16 and need none (simulate.h rank_holding).
  double trained_cast_bytes = 0;
  // MoE blocks (flops.h llm_block_params): the part of param_bytes / train_state_bytes /
  // copy_bytes / trained_cast_bytes held by the experts, which expert parallelism divides over
  // ep · etp ranks instead of tp; 0 elsewhere.
  double expert_param_bytes = 0, expert_train_state_bytes = 0, expert_copy_bytes = 0;
  double expert_trained_cast_bytes = 0;
};

// How the runtime holds parameters, in fractions of their fp32 bytes (param_holding(spec)):
//   frozen  what a frozen layer holds: 1/2 under bf16 compute, where frozen modules' weights are
//           held in bf16 (train.frozen_fp32 = false; their norms' few fp32 parameters are
//           neglected); else 1.
//   casts   the compute-dtype copies a layer that runs backward holds at the step's peak: 1/2
//           under bf16 compute (autograd saves each use's cast for backward, and CastOnce keeps
//           one per step), 0 in fp32 and for a frozen layer held in bf16 (nothing is cast). A
//           recomputed block keeps none (search.h add_recompute_costs). Measured costs take 0:
//           the profiler measures saved casts with the activations.
struct ParamHolding {
  double frozen = 1, casts = 0;
};
ParamHolding param_holding(const Spec& spec);

// The layer under the frozen rules: the work it skips and the memory it does not keep are zeroed;
// its parameters (raw: fp32 bytes) held as `holding` says.
LayerCost apply_frozen_rules(LayerCost raw, bool weight_grads, bool input_grads,
                             const ParamHolding& holding);
// Work per microbatch, and memory with `in_flight` microbatches alive, under the frozen rules.
double layer_time(const LayerCost& raw, bool weight_grads, bool input_grads);
double layer_memory(const LayerCost& raw, bool weight_grads, bool input_grads, int64_t in_flight,
                    const ParamHolding& holding);

// `c` costed with all its parameters divided over the module's tp ranks, as one rank of
// `layout` holds it: an MoE block's experts divided over ep · etp ranks instead.
void shard_experts(LayerCost* c, const Layout& layout);

// One module as the partitioner sees it. `front` runs before block 0 and always sits on the first
// stage (LLM embedding; encoder patch embedding / conv stem / Whisper convs); `back` runs after
// the last block and sits on the last stage (LLM final norm + head; the encoder's projector).
// Costs are those a layer really has under its frozen rules (apply_frozen_rules done).
struct ModuleCosts {
  std::string module;  // for messages
  LayerCost front;
  std::vector<LayerCost> blocks;  // block 0 first (ModulePlan block numbering)
  LayerCost back;
};

// What one microbatch brings to a module.
struct MicrobatchShape {
  LlmTokens llm;     // the LLM's tokens (flops.h)
  double items = 1;  // items (images / clips) of the encoder being costed
};
// The data a step reads, as its mean sample: what the FLOP model costs in place of one row of
// model.llm.max_seq tokens (one document, loss on every token) with one item per encoder.
// Measured from a config's dataset (train/data_shape.h: weft plan, weft simulate), or a
// profile's rows (profile.h profile_data_shape).
struct DataShape {
  double positions = 0;       // LLM row positions the blocks run on per sample, padding included
  double tokens = 0;          // of them real tokens (reported; the blocks run on positions)
  double targets = 0;         // loss targets: the output head's rows
  double sum_sq_doc_len = 0;  // Σ over the sample's documents of length² (causal attention)
  std::vector<double> items;  // per encoder (spec order): items per sample
  int64_t samples = 0;        // measured over (reported)
  // What a microbatch keeps per sample at most (0 / empty: the mean above), for activation
  // memory, which the largest microbatch sets: padded rows are as long as their longest sample,
  // so a microbatch holding the data's longest keeps that many positions for each of its samples
  // (packed rows: max_seq); loss targets and items, the most of any sample. Time is priced on
  // the mean, activation memory on this (stage_costs, planner_costs).
  double peak_positions = 0, peak_targets = 0;
  std::vector<double> peak_items;
  bool empty() const { return positions <= 0; }
  // Items of encoder `e` (spec order) per sample: 1 without a shape.
  double items_of(int64_t e) const { return empty() ? 1.0 : items.at(static_cast<size_t>(e)); }
  // The most items of encoder `e` of any sample (items_of without a peak).
  double peak_items_of(int64_t e) const {
    return has_peak() ? peak_items.at(static_cast<size_t>(e)) : items_of(e);
  }
  bool has_peak() const { return !empty() && peak_positions > 0; }
  // A peak other than the mean (fixed-length data has none): memory is priced apart only then.
  bool distinct_peak() const {
    return has_peak() &&
           (peak_positions != positions || peak_targets != targets || peak_items != items);
  }
  DataShape mean() const;  // without the peak
  DataShape peak() const;  // the peak as a shape of its own (one document per sample)
};

// One sample: without a data shape, model.llm.max_seq tokens (one document, loss on every token)
// and one item; with one, its mean sample, with the items of encoder `encoder` (spec order; -1:
// one). Partitions are scale-invariant in the batch, so make_plan partitions with this.
MicrobatchShape single_sample_microbatch(const Spec& spec, const DataShape& data = {},
                                         int64_t encoder = -1);
// A data shape that fits the spec: positive positions, targets no more than them, one item count
// per encoder, none negative, a peak no less than the mean; errors name `where` and the field.
void check_data_shape(const Spec& spec, const DataShape& data, const std::string& where);

// FLOP-based costs of an encoder or the LLM (a projector is costed as its encoder's `back`):
// forward from flops.h; matmul layers cost 1x forward for input grads and 1x for weight grads
// (Megatron's 3x), the embedding and the encoder front end have no input grad (their inputs are
// ids / data). Memory: fp32 params (4 B), fp32 grads + AdamW moments (12 B) when trainable,
// activations in the compute precision (bf16: 2 B) from the tensors autograd keeps (no S×S
// attention scores). A tied LLM head holds its own copy of the embedding only when pipelined
// (pp > 1). Numbers are for one microbatch of the whole module (tp = cp = 1); shard them for
// per-rank figures. The encoder's projector takes its own flags from the spec (frozen projector,
// input grads iff the encoder trains).
ModuleCosts module_layer_costs(const Spec& spec, const ModulePlan& module,
                               const MicrobatchShape& shape);
// module_layer_costs of one sample of `data` (single_sample_microbatch with the module's items).
ModuleCosts sample_costs(const Spec& spec, const ModulePlan& module, const DataShape& data = {});

struct PartitionOptions {
  int64_t stages = 1;                                                   // P
  int64_t microbatches = 1;                                             // per step, per pipeline
  double memory_limit_bytes = std::numeric_limits<double>::infinity();  // per stage
  // Every stage keeps all microbatches' activations, not min(P - s, M): an encoder, whose
  // forwards all run before the LLM and whose backwards all run after it (dist/runtime.h).
  bool all_in_flight = false;
  // Per stage (P entries, or empty = none): work and memory other modules put on the same ranks
  // (the joint partition below); the bottleneck and the memory limit count them.
  std::vector<double> time_offset, memory_offset;
};

struct StagePartition {
  std::vector<int64_t> boundaries;  // first block of each stage after the first (P - 1 entries)
  std::vector<double> stage_time, stage_memory;  // per stage, this module's, under the rules
  double bottleneck = 0;                         // max over stages of offset + stage_time
};

// The exact contiguous partition (dynamic programming over blocks × stages, O(P · n²)) of the
// module's n blocks into P non-empty stages with the smallest bottleneck whose every stage fits
// the memory limit. Among equally good partitions it returns the lexicographically smallest
// boundaries (earliest cuts). Throws weft::Error when P is outside [1, n] or no partition fits,
// naming the module, the limit and the smallest peak stage memory any partition reaches.
StagePartition partition_stages(const ModuleCosts& costs, const PartitionOptions& options);

// Boundaries cutting a module's blocks into `n` contiguous non-empty stages of about equal work
// (forward + backward; the front in the first stage, the back in the last): the first block of
// stage k is where the work before it comes closest to k/n of the total. An interleaved LLM's
// chunks (make_plan's default for vp > 1, the layout search's).
std::vector<int64_t> even_cuts(const ModuleCosts& costs, int64_t n);

// ---- Joint partition: every module's stage boundaries together (make_plan's default) ------
//
// Each module's costs are the work one of its ranks does per LLM microbatch (its data-parallel
// share, divided over its tp × cp ranks: the caller scales them), so the work of modules that
// share a rank adds up. Objective: the largest per-rank work per microbatch under a per-rank
// memory limit — 1F1B runs at the pace of its slowest stage, and with the total work fixed the
// flow-shop makespan Σ t + (M − 1) · max t of a chain of stages is minimised by the same split.
//   separate   each module's stages sit on ranks of their own; encoder stages feed the LLM's
//              first stage, so the step is bounded by the slowest stage of any module and the
//              joint optimum is every module's own optimum (exact).
//   colocated  the modules share the ranks, pipeline stages being the slowest grid axis: rank
//              class c of L = lcm(pp) hosts stage floor(c · pp / L) of each module, and its time
//              (memory) is the sum over modules of their stage's. Exact dynamic programming over
//              stages × every chosen module's next block when all pipelined modules have the
//              same pp and the state space is small (O(P · Π n_i²)); otherwise coordinate
//              descent — each module in turn gets its exact optimum given the others' loads as
//              per-stage offsets, until a round improves nothing (a local optimum, exact = false).
// Ties go to the earliest cuts, modules in order. Modules with given boundaries (parallel.<m>.
// stages) or one stage are kept as they are and count as fixed load.
struct JointModule {
  ModuleCosts costs;
  int64_t stages = 1;
  std::vector<int64_t> boundaries;  // given (kept), or empty: chosen when stages > 1
  bool all_in_flight = false;       // see PartitionOptions
};

struct JointOptions {
  bool colocated = true;
  int64_t microbatches = 1;
  double memory_limit_bytes = std::numeric_limits<double>::infinity();  // per rank
};

struct JointPartition {
  std::vector<StagePartition> modules;  // per module: its boundaries, stage times and memory
  // Per rank class: colocated, the L classes in rank order; separate, every module's stages.
  std::vector<double> rank_time, rank_memory;
  double bottleneck = 0;  // max rank_time
  bool exact = true;      // false: coordinate descent (see above)
};

// Throws weft::Error when a module's stages are outside [1, blocks], given boundaries are not a
// valid split, or no split fits the memory limit (naming the modules and the limit).
JointPartition partition_joint(const std::vector<JointModule>& modules,
                               const JointOptions& options);

}  // namespace weft::plan
