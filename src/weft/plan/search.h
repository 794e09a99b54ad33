// Layout search: the planner behind `weft plan CONFIG --cluster CLUSTER`. It chooses, for a Spec
// on a Cluster, everything of a run the config leaves open — each module's layout {dp, tp, pp,
// cp}, the placement (colocated: every module on every rank; separate: disjoint rank spans, the
// DistTrain-style split of the GPUs between the encoders and the LLM), the stage boundaries
// (each module's exact frozen-aware FLOP-balanced split, partition.h), the microbatch count,
// ZeRO-1 and activation recomputation per module — and predicts its step with the simulator.
//
// The search space (SearchOptions narrows it):
//   llm       tp | heads, kv_heads, ffn, vocab (tp <= max_tp, default a node); cp a power of two
//             <= max_cp with at least min_cp_tokens tokens per CP rank; pp <= min(layers,
//             max_pp); dp | train.batch; an MoE LLM also ep | experts (ep <= max_ep) with
//             expert TP = tp and ep | cp · dp, or (tp > 1, expert_tp_one) expert TP 1 and
//             ep | tp · cp · dp
//   encoder   tp | heads, ffn (and llm.hidden for an mlp projector); cp a power of two dividing
//             its tokens per item (no [CLS] token); pp <= min(blocks, max_encoder_pp);
//             colocated: dp fills the LLM's ranks; separate: dp divides the LLM's dp or is a
//             multiple of it, at most the items of one global microbatch (its samples times
//             the data's items per sample)
//   ranks     at most the cluster's devices (a plan may leave some idle: the step time, not the
//             device count, is what is minimised)
//   microbatches  M | train.batch, M <= batch / llm dp, M <= max_microbatches
//   vp        the LLM's interleaved 1F1B chunks per pipeline rank (pp >= 2): 1 .. max_vp with
//             pp · vp <= layers, the chunks cut evenly by work (Megatron-style: by blocks, and
//             only with M >= pp, as Megatron-LM needs)
//   zero_stage    0 or 1; recompute per module that keeps activations: off or every block;
//             with partial_recompute also, where the node does not fit the device without it
//             but does with every block (by its memory bound), per pipeline stage the fewest
//             first blocks of each chunk that make its ranks fit, the most of those on every
//             stage, and each halfway to every block (model.<module>.recompute_blocks: one
//             count per stage, so the early stages of 1F1B, which hold more microbatches,
//             recompute more than the late ones); the plans reported are then fitted to the
//             simulator's peaks stage by stage (refine_recompute)
//   boundaries  with partial_recompute (and move_boundaries), a pipelined module's stage cut
//             moved with its counts, as AdaPipe co-optimises them: from the partial node's cut,
//             one block at a time leaves the busiest stage for another while the bound falls,
//             every stage's count re-fitted to its memory; and again after the search on the
//             fastest plans, each stage's memory limit lowered by what its simulated peak adds to
//             the bound's (the timing of the modules sharing its ranks), before refine_recompute
//
// Branch and bound over a tree (the LLM's choice first, then each encoder's; search_space.h):
// every node has an analytic lower bound on the simulated step time, built from the same op
// durations the simulator charges (forward / backward with their TP / CP collectives, and
// point-to-point hops, priced at the cheapest link the group can use):
//   - each representative rank's own ops, then its gradient reduction (the whole all-reduce, or
//     ZeRO-1's reduce-scatter, from the start of its last backward when overlapped, its last
//     bucket after it) — the loss all-reduce and the optimizer follow on every rank (under
//     ZeRO-1, then the parameter all-gathers; overlapped with the next forward, those run from
//     the step's start and each rank's first LLM forward ends no sooner than its last);
//   - the LLM's schedule (1F1B, or interleaved 1F1B over its pp · vp chunks) replayed on its
//     stages with every other constraint dropped: the fill chain before each stage's first op
//     (after the encoders' first microbatch; each stage's first forward ending no sooner than
//     its rank's overlapped parameter gathers), every op after the one it waits for (exact for a
//     uniform pipeline; it sees the bubbles of uneven stages and microbatch sizes), the drain;
//     separate encoders' last forward before the LLM's last microbatch and their backwards
//     after the LLM's;
//   - encoders not chosen yet: their FLOPs spread over every rank they could get.
// Nodes whose per-rank memory (parameters, gradients, optimizer state sharded by ZeRO-1, peak
// activations under the schedule) exceeds the device are dropped before any simulation.
// Complete candidates are simulated in bound order until the bound reaches the best simulated
// step time (less SearchOptions::gap, 0.5% by default), so the winner is the simulator's
// optimum over the space (within the gap) unless the simulation budget ran out first
// (SearchStats::complete says which); tests check on exhaustive spaces that the bound never
// exceeds the simulated step, interleaved schedules included, and find the exact optimum with
// gap = 0. The report
// keeps each layout's fastest schedule (M, vp, recomputation, ZeRO). The search itself runs on
// the calling thread; candidates are simulated in batches on several (SearchOptions::batch,
// threads), with SimOptions::trace = false.
//
// Expert parallelism is priced as the simulator does (simulate.h): the experts' parameters,
// gradients and moments over ep · etp ranks (ZeRO-1: moments over the expert-data-parallel
// group), their gradients reduced over that group, two all-to-alls per MoE block and direction
// over the EP group, routing assumed balanced.
//
// Activation recomputation (model.<module>.recompute) is priced by planner_costs(), which the
// search and `weft simulate` use: one more forward of each recomputed block in its backward
// (its TP / CP collectives and expert all-to-alls again too: StageCost::recompute), only each
// block's input (bf16: 2 bytes per element) kept as its activations, and the repeated FLOPs
// left out of MFU.
//
// Measured costs (SearchOptions::profile, `weft plan --profile`): a profile from `weft bench
// profile` (plan/profile.h) replaces the FLOP model everywhere — the stage cuts (partitioned on
// the measured layer costs), the bound (each op fixed + per-unit seconds as measured, the cheaper
// of alone and under load; the transport's measured curves on one node where cheaper than the
// link; gradient reductions after the backward where the transport runs on the ranks' cores),
// the memory filter (measured activation bytes) and every simulation (profile.h simulate). It is
// checked against the spec first (an Error naming the file, module and field).
//
// Ties: of plans simulated equally fast (within a relative 1e-9), the one with fewer
// microbatches wins — larger microbatches run their kernels more efficiently than a FLOP model
// sees, and pay each op's fixed overhead fewer times.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/plan/cluster.h"
#include "weft/plan/plan.h"
#include "weft/plan/simulate.h"

namespace weft::plan {

// One point of the search space.
struct Candidate {
  // "colocated", "separate", or "megatron": Megatron-LM's multimodal baseline — every encoder
  // runs on the ranks of the LLM's first pipeline stage with the LLM's tp (or the largest
  // divisor of it the encoder allows), pp = cp = 1, data parallel over the rest of those ranks;
  // the LLM's layers split evenly over its stages (not a placement make_plan can build).
  std::string placement = "colocated";
  // Per encoder in spec order, then the LLM (last): layout and stage boundaries (pp - 1).
  std::vector<LayoutSpec> layouts;
  std::vector<bool> recompute;  // aligned with layouts
  // Aligned with layouts where set (empty: every block of each): of a recomputed module, which
  // blocks (model.<module>.recompute_blocks: none = every block, one count for every pipeline
  // stage, or one per stage).
  std::vector<std::vector<int64_t>> recompute_blocks;
  int64_t world_size = 1;  // ranks the plan uses (<= the cluster's devices)
  int64_t microbatches = 1;
  int64_t zero_stage = 0;
};

struct SearchOptions {
  int64_t max_ranks = 0;  // devices to plan for; 0 = every device of the cluster
  // Placements to search: any of "colocated", "separate", "megatron" (the baseline above).
  std::vector<std::string> placements = {"colocated", "separate"};
  int64_t max_tp = 0;  // 0 = the cluster's gpus_per_node
  int64_t max_pp = 32, max_encoder_pp = 8;
  // Interleaved 1F1B: up to this many chunks per LLM pipeline rank; 1 = never.
  int64_t max_vp = 4;
  int64_t max_cp = 16;
  int64_t max_ep = 0;         // MoE LLM: largest ep to try; 0 = the number of experts
  bool expert_tp_one = true;  // MoE LLM with tp > 1: also try expert TP 1 (parallel.llm.etp)
  bool sequence_parallel =
      true;                     // LLM with tp > 1: also try sequence parallelism (parallel.llm.sp)
  int64_t min_cp_tokens = 512;  // LLM tokens per CP rank at least
  int64_t max_microbatches = 128;
  bool zero = true;       // also try ZeRO-1 (train.zero_stage = 1)
  bool recompute = true;  // also try activation recomputation per module
  // With recompute: also a module's first blocks of each chunk where memory needs some (above).
  // Off by default: it slows the search (2-5x; 23.5 s to 46.2 s at DistTrain's 72B scale) and
  // changed no scenario's MFU in bench/RESULTS.md; it pays where memory is tight (up to 1.20x,
  // with move_boundaries, in its "Recomputation under tight memory" table).
  bool partial_recompute = false;
  // With partial_recompute: also move a pipelined module's stage boundaries (vp = 1) with its
  // per-stage counts, as AdaPipe co-optimises them: a stage that would recompute much gives blocks
  // to one that recomputes little (Space::rebalance, search_space.h). Off: make_plan's cuts.
  bool move_boundaries = true;
  int64_t top = 5;  // distinct layouts to report (the winner first)
  // Also simulate candidates whose bound is within this fraction of the best step time, so the
  // runner-ups in the table are searched like the winner (within `gap`).
  double report_slack = 0.15;
  // Relative optimality gap: candidates whose bound is within this fraction below the step
  // times to beat are not simulated, so the winner is within it of the simulator's optimum
  // (0: exact). Many layouts differ only off the critical path (a small encoder's), tie, and
  // would each need a simulation to be told apart.
  double gap = 0.005;
  int64_t max_simulations = 400;  // stop (SearchStats::complete = false) after this many
  // Wall seconds after which the search stops once it has a plan that fits (a slow or busy
  // machine still gets one: until then only max_simulations stops it).
  double time_budget_seconds = 50;
  // Candidates are simulated `batch` at a time (the next ones the search would take, bounds
  // below the step time to beat when the batch is formed), on up to `threads` threads (0: the
  // machine's cores, at most `batch`). The result depends on the batch, never on the threads:
  // any machine finds the same plan (unless time_budget_seconds runs out first). batch = 1
  // simulates one candidate at a time, each pruned against every simulation before it.
  int64_t batch = 8;
  int64_t threads = 0;
  // How candidates are simulated (trace is ignored); sim.data, the data's mean sample, also
  // prices the bound, the memory filter and the stage cuts of the FLOP model.
  SimOptions sim;
  // Measured costs (`weft bench profile`, plan/profile.h) in place of the FLOP model: the bound,
  // the memory filter, the stage cuts and every simulation price each layer as measured (fixed
  // per-op overhead and per-unit seconds, measured activation bytes, optimizer seconds, the
  // transport's curves on one node; `sim` takes profile_sim_options). Not owned; must outlive
  // the search. Null: the FLOP model.
  const Profile* profile = nullptr;
};

struct Evaluation {
  Candidate candidate;
  Plan plan;
  SimResult sim;  // without the trace
  double lower_bound = 0;
};

struct SearchStats {
  int64_t nodes = 0;            // partial and complete candidates bounded
  int64_t memory_filtered = 0;  // of those, dropped by the analytic memory filter
  int64_t simulated = 0;
  int64_t simulated_over_memory = 0;  // simulated, but a rank's peak exceeds the device
  double seconds = 0;
  // True when every candidate left had a bound at least the winner's step time / (1 + gap):
  // the winner is the optimum of the space within the gap. False when max_simulations or the
  // time budget stopped the search; `open_bound` is then the smallest bound not yet simulated.
  bool complete = true;
  double open_bound = 0;
};

struct SearchResult {
  std::vector<Evaluation> best;  // distinct layouts, fastest first; best[0] is the plan
  // The fastest simulated candidate that did not fit the device memory, when it beats best[0]
  // (what the memory limit costs); empty otherwise.
  std::vector<Evaluation> over_memory;
  SearchStats stats;
  std::string why;  // one line: why best[0] beat the runner-up
};

// Searches `spec` on `cluster`. Throws weft::Error naming the config when no candidate fits
// (e.g. the model does not fit the devices' memory however it is sharded).
SearchResult search(const Spec& spec, const Cluster& cluster, const SearchOptions& options = {});

// ---- Building blocks (the CLI, the scenario benchmark and the tests use them) --------------

// The spec with a candidate's choices written into it: parallel.placement and
// parallel.<module>.{dp,tp,pp,cp,stages}, train.microbatches, train.zero_stage and
// model.<module>.recompute and recompute_blocks ("megatron" is written as colocated;
// candidate_plan moves the encoders).
Spec apply_candidate(const Spec& spec, const Candidate& candidate);
Plan candidate_plan(const Spec& spec, const Candidate& candidate);
// The simulator's stage costs (stage_costs of options.data) with the spec's activation
// recomputation priced in (see above); model.llm.vocab = 0 is taken as options.unset_vocab like
// the simulator does.
CostTable planner_costs(const Spec& spec, const Plan& plan, const SimOptions& options = {});
// The recomputation pricing of one module's stages (as planner_costs applies it): stage s's first
// recomputed_blocks(true, blocks, s) blocks recomputed (empty: every block), on `data`'s sample.
void add_recompute_costs(const Spec& spec, const ModulePlan& module, std::vector<StageCost>* stages,
                         const std::vector<int64_t>& blocks = {}, const DataShape& data = {});
// Simulates a candidate (planner_costs, or the `profile`'s measured costs; options.trace off).
Evaluation evaluate(const Spec& spec, const Cluster& cluster, const Candidate& candidate,
                    const SimOptions& options = {}, const Profile* profile = nullptr);
// Partial recomputation fitted by the simulator (search applies it to the plans it reports
// under partial_recompute): each pipeline stage of every recomputing module of a candidate that
// fits recomputes the fewest first blocks of each chunk for the simulated step to still fit the
// device, bisected stage by stage (a stage's count moves its own ranks' peak, the others' only
// through the timing of the ops they share ranks with); none anywhere turns the module's
// recomputation off. A candidate that does not fit (counts fitted by a bound) first gets one more
// block on each stage whose ranks are over memory, of each module recomputing per stage, until it
// fits (or those stages recompute every block). The faster of that and `e`, or `e` when nothing
// fits; `simulations` counts the candidates simulated; `profile` as evaluate's.
Evaluation refine_recompute(const Spec& spec, const Cluster& cluster, Evaluation e,
                            const SimOptions& options = {}, int64_t* simulations = nullptr,
                            const Profile* profile = nullptr);

// Every complete candidate of the space, in enumeration order, with its analytic bound — what
// the branch and bound prunes (for tests; large spaces are large).
struct BoundedCandidate {
  Candidate candidate;
  double lower_bound = 0;   // seconds
  double memory_bytes = 0;  // analytic per-rank peak (a lower bound of the simulated one)
  bool fits_memory = true;  // memory_bytes <= the device's
  // The bounds of the search nodes it completes (the LLM's choice, then each encoder's added in
  // spec order, a pending partial-recompute choice a node of its own before it is expanded),
  // where the search prunes them: each a lower bound of its step and of its per-rank peak memory
  // too.
  std::vector<double> ancestor_bounds, ancestor_memory;
};
std::vector<BoundedCandidate> enumerate_candidates(const Spec& spec, const Cluster& cluster,
                                                   const SearchOptions& options = {});

// "separate | vision tp1 dp16 | llm tp8 pp4 dp2 | mb 8 zero1 recompute vision,llm:4" (llm:4: its
// first 4 blocks of each chunk; per stage, "llm:[9/6/0/0 of 18/20/21/21]": 9 of stage 0's 18
// blocks, ...; interleaved, "llm:[3/2]" per stage of its chunks).
std::string describe(const Spec& spec, const Candidate& candidate);
// The config that reproduces a candidate: TOML ([parallel], [parallel.<module>], [train],
// [model.<module>] recompute, recompute_blocks) and the same as --set overrides (no spaces: each
// one shell word).
std::string config_snippet(const Spec& spec, const Candidate& candidate);
std::vector<std::string> config_overrides(const Spec& spec, const Candidate& candidate);

}  // namespace weft::plan
