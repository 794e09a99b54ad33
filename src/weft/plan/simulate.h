// Simulator: replays one training step of a Plan on a Cluster as a discrete-event timeline, in
// exactly the order the runtime (dist/runtime.h) runs it on every rank:
//
//  1. every hosted encoder stage runs forward on every microbatch (spec order, then microbatch
//     order); a stage's forward of microbatch m waits for the previous stage's activations, and
//     the last stage (tp = cp = 0) sends each item's features over the bridge to the first LLM
//     stage ranks of the replica that holds it (every TP and CP rank);
//  2. the LLM's stages run 1F1B (warm-up min(P - 1 - s, M) forwards on stage s, then one
//     forward / one backward, then the remaining backwards; forward only when the LLM needs no
//     backward), or under virtual stages (parallel.llm.vp) interleaved 1F1B over each rank's
//     chunks — plan.h pipeline_schedule, the runtime's order; its first stage waits for every
//     bridge message of the microbatch and, in backward, sends feature gradients back (from
//     tp-rank 0 of each CP rank);
//  3. encoder stages run backward in microbatch order (the last stage iff its projector needs
//     backward, earlier stages iff the encoder trains), waiting for the gradients;
//  4. each module's gradients are all-reduced (ZeRO-1: reduce-scattered) over its CP × DP group
//     (started with the last backward when train.overlap_grad_reduce, its last bucket after the
//     backward ends; under interleaved 1F1B each chunk's with that chunk's own last backward, as
//     the runtime arms them, one chunk's reduction after the other's on the group), a tied
//     embedding's first/last-stage copies are summed, the loss and the gradient norm are
//     all-reduced over the world, and the optimizer steps (AdamW's memory traffic).
//
// Each rank runs its ops one at a time. Sends never block (an isend); a message arrives
// message_seconds after its op ends; a collective starts when all its ranks reach it. Links are not
// contended. Compute is the frozen-aware per-layer FLOP cost (partition.h: work a frozen layer
// skips is not charged) for the microbatch's data, divided over the module's tp × cp ranks and
// charged at the device's effective FLOP/s; TP all-reduces (2 per block and direction, 1 for the
// embedding) and CP K/V all-gathers / dK,dV reduce-scatters (1 per block and direction) are
// added to the op that issues them. Activation memory: what a forward keeps (partition.h's
// activation_bytes, split over tp × cp) is held until its backward.
//
// Mixture of experts (model.llm.moe, parallel.llm.ep / etp): an MoE block's FLOPs count its
// router, top_k experts per token and shared expert (flops.h); routing is taken as balanced, so
// each rank's expert work is its own tokens' share. Each MoE block adds two all-to-alls of the
// rank's token rows (top_k per token) over its EP group per direction, and with whole experts
// under TP (etp = 1 < tp) the rank routes 1/tp of them and gathers the block's output over TP
// instead of all-reducing it. The experts' parameters, gradients and moments are divided over
// ep · etp ranks (rank_holding), and their gradients are reduced over the expert-data-parallel
// group (plan.h ModulePlan::expert_groups), beside the CP × DP group's reduction.
//
// Data: each sample is the data's mean sample (SimOptions::data: its padded row positions, loss
// targets, documents and items per encoder, measured from the config's dataset by `weft plan`
// and `weft simulate`), or without one model.llm.max_seq tokens (one document, loss on every
// token) with one item per encoder; train.batch samples go to the LLM's DP replicas evenly, each
// replica's split into train.microbatches as the loader does (sizes differ by at most one, larger
// first), and encoder DP ranks take a global microbatch's items as the runtime does (fan-in,
// fan-out or even split).
//
// Measured costs (plan/profile.h: simulate(spec, plan, cluster, profile)). Checked against real
// 2-rank runs on a 2-core CPU (bench/validate_sim.py), the FLOP model above misses what follows;
// each is modelled from a measurement, none by a global factor:
//  - per-call overhead: an op costs fixed + n · per-unit seconds, the fixed part (operator
//    dispatch, autograd bookkeeping; most of a small microbatch on a CPU) not divided over TP / CP;
//  - real rows: the data's padded row length, not max_seq (SimOptions::data), for messages and
//    tokens/s; attention's quadratic part from a fit over two row lengths;
//  - per-stage work: every LLM stage builds the attention mask and RoPE tables per microbatch;
//  - data preparation: every rank lays out and collates the whole global batch at the start of
//    the step (SimOptions::data_seconds_per_sample) and decodes the media of the items its first
//    encoder stages read (SimOptions::media_seconds_per_sample); an op of its own, not pipeline
//    idle time; with media read from files (data.kind = "llava") the ranks then agree on the
//    step's bad records, a small all-reduce over the world;
//  - the optimizer: measured AdamW + gradient-norm seconds of the rank's trainable layers (the
//    FLOP model charges 7 fp32 passes over memory);
//  - the transport: measured cost curves in place of the cluster's intra-node link —
//    point-to-point, fp32 reductions, and activation collectives in the compute dtype, which Gloo
//    1.13 reduces in fp32 (twice the bytes, plus conversions); mean times, since a fraction of
//    Gloo's collectives wait a scheduler time slice on a small machine (SimOptions::*_curve);
//  - no free overlap on CPU ranks: Gloo's work runs on the core that computes, so a gradient
//    reduction overlapped with backward only delays that backward (SimOptions::comm_occupies_rank);
//  - contention: ranks of one node that compute at the same time share caches and memory
//    bandwidth; each op is charged its cost measured under load for the share of its time during
//    which another rank of its node computes, from the previous pass's timeline (3 passes).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/plan/cluster.h"
#include "weft/plan/flops.h"
#include "weft/plan/partition.h"
#include "weft/plan/plan.h"
#include "weft/plan/trace.h"

namespace weft::plan {

// One pipeline stage of a module, per unit of data (LLM: one sample; encoder: one item), for the
// whole stage (tp = cp = 1), under the frozen rules. An encoder's last stage includes its
// projector, the LLM's first the embedding and its last the head.
struct StageCost {
  double forward_flops = 0;
  double backward_flops = 0;  // input + weight gradients (and recomputed forwards)
  // Of backward_flops, the forwards activation recomputation runs again (search.h
  // add_recompute_costs): charged as time, not counted as model FLOPs in MFU.
  double recompute_flops = 0;
  bool recompute = false;  // its blocks' forwards, collectives included, run again in backward
  // Of `blocks` and `moe_blocks`, those recomputed (all of them, or a chunk's first few: the
  // collectives of their forwards run again).
  int64_t recompute_blocks = 0, recompute_moe_blocks = 0;
  double activation_bytes = 0;
  // Of activation_bytes, what each TP rank keeps whole rather than 1/tp of under the module's
  // layout (partition.h LayerCost::tp_whole_bytes / sp_whole_bytes): kept_activation_bytes.
  double whole_activation_bytes = 0;
  // Recomputation: the most one block holds again in backward beyond what it kept (its forward
  // run again), per unit of data like activation_bytes, during that backward only.
  double recompute_peak_bytes = 0;
  double recompute_peak_whole_bytes = 0;  // of which whole on each TP rank (as above)
  double param_bytes = 0;
  double copy_bytes = 0;          // casts of the parameters and the like (partition.h LayerCost)
  double trained_cast_bytes = 0;  // of which casts of trainable parameters
  double train_state_bytes = 0;   // gradients + optimizer state of the trainable parameters
  double grad_bytes = 0;          // fp32 gradients of the trainable parameters (what DP reduces)
  // Of grad_bytes, those of partition.h LayerCost::partial_grad_params: summed over TP at the
  // end of the step under sequence parallelism.
  double partial_grad_bytes = 0;
  int64_t blocks = 0;           // transformer blocks (each issues TP / CP collectives)
  int64_t backward_blocks = 0;  // of those, the ones with a backward (gradients to compute)
  // MoE blocks (LLM), and the experts' part of param_bytes / train_state_bytes / grad_bytes /
  // copy_bytes, which ep · etp ranks share instead of tp.
  int64_t moe_blocks = 0;
  double expert_param_bytes = 0, expert_train_state_bytes = 0, expert_grad_bytes = 0;
  double expert_copy_bytes = 0, expert_trained_cast_bytes = 0;
  // Measured costs (plan/profile.h). When `measured`, an op on n units takes fixed + n · per-unit
  // seconds, the per-unit part divided over tp × cp, and the FLOPs above count toward MFU only;
  // the optimizer takes optimizer_seconds (divided over tp, and the CP × DP group under ZeRO-1).
  bool measured = false;
  double forward_seconds = 0, backward_seconds = 0;              // per unit of data
  double forward_fixed_seconds = 0, backward_fixed_seconds = 0;  // per op
  double activation_fixed_bytes = 0;                             // per op, on top of the above
  // The same seconds with the node's other ranks computing throughout (measured under load,
  // plan/profile.h): an op is charged them for the share of its time during which another
  // rank of its node runs forward, backward or data work.
  bool shared_measured = false;
  double forward_seconds_shared = 0, backward_seconds_shared = 0;
  double forward_fixed_seconds_shared = 0, backward_fixed_seconds_shared = 0;
  double optimizer_seconds = 0;  // per step: AdamW + gradient norm of the trainable parameters
  // Of the per-unit work above, what every TP and CP rank of the stage runs whole instead of
  // 1/(tp·cp) of: an encoder's front end (conv stem, patch embedding, positions), which runs on
  // all of an item's tokens before they are split. FLOPs, and a measured stage's seconds (alone
  // and shared).
  double replicated_forward_flops = 0, replicated_backward_flops = 0;
  double replicated_forward_seconds = 0, replicated_backward_seconds = 0;
  double replicated_forward_seconds_shared = 0, replicated_backward_seconds_shared = 0;
  // Of activation_bytes, what that front end keeps: whole on every TP and CP rank.
  double replicated_activation_bytes = 0;
};

// Per plan module (aligned with Plan::modules), per stage; projectors have no entry of their own.
using CostTable = std::vector<std::vector<StageCost>>;

// Activation bytes a forward of n units of data keeps on one rank of a stage under `layout`:
// 1/(tp·cp) of the stage's, but 1/cp of its whole part (StageCost::whole_activation_bytes) and all
// of its replicated part (StageCost::replicated_activation_bytes), plus a measured stage's fixed
// bytes.
double kept_activation_bytes(const StageCost& sc, double n, const Layout& layout);

// Seconds a forward or backward of n units of data takes on one rank of a stage whose work splits
// over `split` (= tp·cp) ranks, its replicated part whole: measured (fixed + per unit; `shared`:
// the seconds under load) or from the FLOPs at flops_per_second, plus block_overhead_seconds
// (DeviceProfile) per block (backward: per block with a backward, a recomputed one's twice).
double compute_seconds(const StageCost& sc, bool forward, double n, double split,
                       double flops_per_second, bool shared = false,
                       double block_overhead_seconds = 0);
// The seconds a backward op's TP collectives take when its column-parallel linears hide them
// behind their own matmuls (dist::column_linear, train.overlap_tp_comm): each linear's input-
// gradient reduction (`reduce`: all-reduce, or reduce-scatter under SP) behind its weight
// gradient's matmul, and under SP the re-gather of its input (`regather`) behind its input
// gradient's matmul, each exposed only past that matmul's seconds. `blocks` blocks, each with
// the linears `columns` (forward FLOPs per token, whole; mlp_in 0 for an MoE block) on `tokens`
// per rank split over `tp`, whose backward runs at the op's mean `seconds_per_flop`. Monotone in
// the collectives' seconds, so a bound from cheaper collectives stays a bound.
double column_backward_comm(double blocks, double reduce, double regather,
                            const ColumnFlops& columns, double tokens, double tp,
                            double seconds_per_flop);
CostTable stage_costs(const Spec& spec, const Plan& plan, const DataShape& data = {});
// Activation memory per unit from `memory` (the same plan's stages priced on the data's peak
// sample, DataShape::peak) into `time` (priced on its mean): activation, whole, replicated and
// recompute-peak bytes. stage_costs and planner_costs price a data shape so.
void take_activation_bytes(CostTable* time, const CostTable& memory);

// What one rank of a module with `layout` holds of a stage (bytes): parameters (with their
// compute-dtype copies), fp32 gradients and AdamW moments, the dense part divided over tp and an
// MoE block's experts over ep · etp.
// ZeRO-1 (zero1) shards the moments over the ranks that hold the same parameters: the CP × DP
// group, and for experts the expert-data-parallel group (plan.h ModulePlan::expert_groups).
// `expert_grads` is the part of `grads` reduced over that group rather than the CP × DP group
// (0 when the experts are replicated exactly like the dense weights: ep = 1, etp = tp).
// bf16_params: a bf16 run's ZeRO-1 holds the trainable parameters it shards (where the group has
// several ranks) in bf16, with fp32 masters of this rank's shard only and no casts, as Megatron's
// distributed optimizer (dist/data_parallel.h): 2 + 4/group bytes per parameter for the 4 of an
// fp32 parameter and the 2 of its cast.
struct Holding {
  double params = 0, grads = 0, moments = 0;
  double expert_grads = 0;
  double step_fraction = 1;  // of the stage's whole optimizer work, what this rank steps
  double total() const { return params + grads + moments; }
};
Holding rank_holding(const StageCost& stage, const Layout& layout, bool zero1,
                     bool bf16_params = false);
// Whether `spec`'s ZeRO-1 holds sharded parameters in bf16 (rank_holding's bf16_params).
bool zero1_bf16_params(const Spec& spec);
// ZeRO-1's parameter all-gather moves the compute dtype: its bytes over the fp32 gradients'.
double zero1_gather_fraction(const Spec& spec);
// What pipeline rank s holds of a module whose `stages` are its pp · vp (virtual) stages: its
// stage, or under virtual stages its chunks s, s + pp, ... summed (parameters, gradients,
// optimizer state and measured optimizer seconds; the rest is chunk s's).
StageCost rank_chunks(const std::vector<StageCost>& stages, int64_t pp, int64_t vp, int64_t s);

// A measured cost curve on one node (plan/profile.h): seconds of a point-to-point message, or of
// a two-rank collective, at increasing sizes in bytes; linear between the points, extrapolated
// along the last two, the first point's below it.
struct CommCurve {
  std::vector<double> bytes, seconds;
  bool empty() const { return bytes.empty(); }
  double at(double bytes) const;
};

struct SimOptions {
  CollectiveAlgo grad_reduce_algo = CollectiveAlgo::kRing;
  bool tp_cp_comm = true;      // charge TP and CP collectives inside the ops
  bool optimizer_step = true;  // charge the optimizer's memory traffic (needs hbm bandwidth)
  // model.llm.vocab = 0 takes the tokenizer's size padded to a multiple of 64 (train/trainer):
  // the vocabulary the simulator assumes then.
  int64_t unset_vocab = 64;
  bool trace = true;  // keep the timeline (SimResult::trace)
  // Every rank lays out and collates the whole global batch at the start of a step: seconds per
  // sample (a measured profile's; 0 = not modelled). And per encoder name, the seconds to decode
  // one sample's items, charged to the ranks of the encoder's first stage for the items each
  // reads (missing = 0).
  double data_seconds_per_sample = 0;
  std::map<std::string, double> media_seconds_per_sample;
  // The data's mean sample (partition.h): the FLOP model's costs (stage_costs, planner_costs),
  // the LLM's messages and tokens/s take its positions; empty = rows of model.llm.max_seq
  // tokens, loss on every one, and one item per encoder. A profile's costs are measured on its
  // own rows, which profile_sim_options puts here.
  DataShape data;
  // Measured costs between ranks of one node, in place of the cluster's intra_node link where
  // given: point-to-point messages (pipeline, bridge), fp32 reductions (gradients, loss, norm)
  // and the TP / CP collectives of activations in the compute dtype. A group of n ranks runs a
  // ring: an all-reduce is 2(n − 1) steps of bytes / n, (n − 1) · curve(2 · bytes / n), an
  // all-gather or a reduce-scatter half of that (two ranks: the curve, and half of it).
  CommCurve p2p_curve, grad_curve, activation_curve;
  // fp32 reductions a rank waits for where it issues them (the loss's, the gradient norm's, SP's
  // partial gradients', a tied embedding's), which go through shared memory on CPU ranks of one
  // host (dist/comm.h) while gradient buckets stay on Gloo; empty: grad_curve.
  CommCurve blocking_curve;
  // The experts' all-to-all, which no host runs through shared memory: where the activations'
  // curve was measured there, Gloo's (a profile's all_reduce); empty: activation_curve.
  CommCurve all_to_all_curve;
  // The transport runs on the ranks' own cores (Gloo over TCP on CPU ranks of one core each):
  // a gradient reduction overlapped with backward would take the core the backward runs on, so
  // it starts after the backward instead, as without train.overlap_grad_reduce.
  bool comm_occupies_rank = false;
};

// The seconds per FLOP at which a backward of n units hides its column-parallel linears'
// collectives (column_backward_comm's seconds_per_flop): the op's mean, compute_seconds over its
// FLOPs; 0 where nothing hides: train.overlap_tp_comm off, no weight gradients follow the
// reductions, CPU ranks (SimOptions::comm_occupies_rank: Gloo works on the matmuls' core), or
// collectives through shared memory (cluster.h: dist::column_linear waits for them where issued).
double hiding_seconds_per_flop(const Spec& spec, const Cluster& cluster, const SimOptions& o,
                               bool weight_grads, const StageCost& sc, double n, double split,
                               double flops_per_second);

struct RankReport {
  int64_t rank = 0;
  std::vector<std::string> stages;  // "vision s0", "llm s1": what the rank hosts
  double busy_seconds = 0;          // forward / backward ops, their TP / CP collectives included
  double comm_seconds = 0;          // of busy_seconds: TP / CP collectives inside the ops
  double collective_seconds = 0;    // exposed step-end collectives (gradients, loss, norm)
  double optimizer_seconds = 0;
  double data_seconds = 0;  // laying out and collating the global batch, decoding its media
  double static_bytes = 0;  // parameters + gradients + optimizer state
  double peak_activation_bytes = 0;
  // ZeRO-1 with overlapped parameter gathers: every module's gathered parameters in flight at the
  // step's start (the wire dtype's bytes), freed as forward reads them, before activations grow.
  double gather_buffer_bytes = 0;
  double peak_memory_bytes = 0;  // static + the larger of peak activations and gather buffers
};

struct SimResult {
  double step_seconds = 0;
  double tokens_per_step = 0;  // LLM row positions: train.batch × the data's (or max_seq)
  double tokens_per_second = 0;
  double model_flops = 0, llm_flops = 0;  // per step, under the frozen rules, no recomputation
  // flops / (step_seconds · world · the device's peak for train.precision)
  double mfu = 0, mfu_llm_only = 0;
  // Idle time of the LLM's ranks while its pipeline runs: Σ (T - busy) / (ranks · T), T = end of
  // the LLM's last forward / backward, busy = any module's forward / backward ops before T
  // (waiting for encoders counts as idle; step-end collectives and the optimizer come after T).
  double bubble_fraction = 0;
  bool memory_fits = true;  // every rank's peak within the device memory
  std::vector<RankReport> ranks;
  std::vector<TraceEvent> trace;  // in execution order per rank
};

// Simulates one step. The plan must fit the cluster (world_size <= its devices); model.llm.vocab
// = 0 is taken as options.unset_vocab. The second form takes the per-stage costs (e.g. from a
// measured profile, or made uniform for a textbook check) instead of stage_costs(spec, plan).
SimResult simulate(const Spec& spec, const Plan& plan, const Cluster& cluster,
                   const SimOptions& options = {});
SimResult simulate(const Spec& spec, const Plan& plan, const Cluster& cluster,
                   const CostTable& costs, const SimOptions& options = {});

// {"step_seconds", "tokens_per_second", "mfu", "mfu_llm_only", "bubble_fraction", ..., "ranks"}.
std::string to_json(const SimResult& result);
// Per pipeline stage of `module` (of `pp`; virtual stage v on rank v % pp), the largest
// peak_memory_bytes of the ranks hosting it (RankReport::stages), 0 where none does.
std::vector<double> stage_peak_bytes(const SimResult& result, const std::string& module,
                                     int64_t pp);
// The timeline as a Chrome / Perfetto trace (plan/trace.h).
std::string chrome_trace(const SimResult& result);

}  // namespace weft::plan
