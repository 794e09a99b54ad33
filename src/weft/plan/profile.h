// Measured cost profile: what each layer of a config's modules really costs on one device, as
// `weft bench profile` measures it (train/profile.h), read here without LibTorch and rescaled
// to the microbatches a Plan runs, for the simulator (simulate.h) and the partitioner
// (partition.h) in place of the FLOP model.
//
// Layers measured per module: the LLM's embedding ("front": lookup and the scatter of encoder
// features), one block (and for an MoE LLM one mixture-of-experts block, "moe_block": routing
// with its auxiliary losses, the experts of the real routing, the shared expert), its final norm
// + head + loss ("back"), and the "stage" work every LLM
// pipeline stage repeats per microbatch (building the attention mask and the RoPE tables); per
// encoder its front end (ViT stem / patch embedding / positions, Whisper convolutions), one
// block, and its projector ("back"; with a Whisper encoder's final LayerNorm). Every block is
// measured twice, whatever the profiled config recomputes: as it runs without recomputation
// ("block", "moe_block") and recomputed (model/recompute.h: "block_recompute",
// "moe_block_recompute": its forward keeps only its input, its backward runs it again), so a
// profile prices any recompute / recompute_blocks setting, block by block; a recomputed block is
// never priced below its plain one (where noise makes the two fits say so, each coefficient of
// its forward + backward is raised to the plain block's, on its input gradient). For each:
//   forward           seconds of the forward, autograd recording
//   input_grad        seconds of the backward with the layer's parameters not requiring grad
//                     (input gradients only); 0 where the input is data (encoder front end)
//   weight_grad       seconds of the full backward minus input_grad (clamped at 0); timed
//                     directly where there is no input gradient
//   activation_bytes  bytes the forward allocated that are still alive when it returns (what
//                     autograd keeps for backward, compute-dtype weight copies, the output)
//   param_bytes, params, tensors   the layer's fp32 parameters
//   optimizer         seconds per step of AdamW and the gradient-norm reduction over them
// Each quantity q is measured at several microbatch shapes — n rows of S tokens for the LLM
// (S = the profiled data's padded row length, and S/2), n items for an encoder — and fitted with
// non-negative coefficients (fit_cost):
//   LLM block, stage work    q(n, S) = fixed + n · (linear · S + quadratic · S²)
//                            (attention materialises S × S scores per row: the quadratic part)
//   LLM embedding, head      q(n, S) = fixed + n · linear · S          (per token)
//   encoder layers           q(n)    = fixed + n · linear              (per item, S = 1)
// `fixed` is the per-call overhead (operator dispatch, autograd bookkeeping) that a FLOP model
// misses and that dominates small microbatches on a CPU. Every timed run starts with cold caches
// (the profiler first streams through what the rest of a step touches: "cache_evict_bytes"), as
// a layer runs in a step. Encoder costs hold for the profiled
// item shape only: a spec whose encoder differs is rejected (re-profile), as is any other
// difference in the model's widths, heads, vocabulary or precision; layer counts may differ.
//
// Rescaling to a plan: an op of a stage on a microbatch of n units (LLM samples; encoder items
// = samples · units_per_sample, the data's mean items per sample) on a rank holding 1/split of
// the work (split = tp · cp) costs fixed + n · per_unit(S) / split seconds, S being the profiled
// row length when the spec's model.llm.max_seq is the profiled one (the same data) and max_seq
// otherwise (rows assumed full, as the FLOP model does). Activation bytes scale the same way;
// parameters are split over tp only. Frozen rules apply as in partition.h.
//
// Contention: every layer is also measured while the machine's other cores train copies of the
// model ("shared"); the simulator charges that cost for the share of an op's time during which
// another rank of its node computes, and make_plan partitions multi-rank plans on it.
//
// Step-level measurements: the seconds per sample to lay out and collate the global batch
// (every rank does it for the whole global batch at the start of each step), the seconds per
// sample to decode each encoder's media (only the ranks whose first encoder stage reads an item
// decode it), and the local transport's alpha-beta (point-to-point and two-rank all-reduce over
// Gloo, between this process and a peer process, as between the ranks of a job) for the
// cluster file.
//
// File (JSON): {"format": "weft-profile-2" (weft-profile-1, whose blocks were measured as its
//  config recomputed them, is refused: profile again), "device", "threads", "precision", "torch",
//  "config", "reps", "cache_evict_bytes" (informational), "shape": {"samples", "seq", "max_seq",
//  "tokens_per_sample"}, "data": {"seconds_per_sample", "media_seconds_per_sample": {encoder name:
//  seconds}
//           (optional)},
//  "data_shape": the data's mean sample, as data_shape_json writes it (optional: older profiles
//           price rows of "seq" positions with a loss on each),
//  "comm": {"p2p": {"latency_us", "bandwidth_gbs"}, "all_reduce": {...},
//           "all_reduce_compute": {...}, "all_reduce_blocking": {...} (optional), "on_compute":
//           true, "activation_transport": "shared memory" | "gloo" (optional: where the
//           compute-dtype curve was measured; the experts' all-to-all, always Gloo's, takes
//           all_reduce's curve when it was shared memory), "message_transport": "shared
//           memory" | "gloo" (informational: what carried p2p), "points": [{"bytes", "p2p",
//           "all_reduce", "compute_bytes", "all_reduce_compute", "all_reduce_blocking" (optional:
//           older profiles)}]}
//          (optional; the simulator uses the points, the fits are for cluster files;
//          all_reduce: fp32 waited for later, as the gradient buckets are, over Gloo;
//          all_reduce_blocking: fp32 waited for where issued, as the loss's, through shared
//          memory where the ranks had it; all_reduce_compute: the same in the compute dtype),
//  "modules": [{"name", "role": "llm"|"encoder", "unit": "sample"|"item", "units_per_sample",
//     "model": {shape fields}, "layers": [{"name",
//     "part": "front"|"block"|"block_recompute"|"back"|"stage"|"moe_block"|
//             "moe_block_recompute" (the last three LLM only),
//     "forward", "input_grad", "weight_grad", "activation_bytes" (at the profiled shape),
//     "param_bytes", "params", "tensors", "optimizer",
//     "fit": {"forward": [fixed, linear, quadratic], "input_grad": [...], "weight_grad": [...],
//             "activation_bytes": [...], "shared": {"forward", "input_grad", "weight_grad"}
//             (optional: measured while the other cores train)}, "points": [...]}]}]}
// Errors name the file and the field.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/plan/cluster.h"
#include "weft/plan/partition.h"
#include "weft/plan/plan.h"
#include "weft/plan/simulate.h"

namespace weft::plan {

// q(n, S) = fixed + n · (linear · S + quadratic · S²).
struct CostFit {
  double fixed = 0, linear = 0, quadratic = 0;
  double per_unit(double seq) const { return linear * seq + quadratic * seq * seq; }
  double at(double units, double seq) const { return fixed + units * per_unit(seq); }
};

// One measurement: q at a microbatch of `units` (rows / items) of `seq` tokens (1 for encoders).
struct CostPoint {
  double units = 1, seq = 1, value = 0;
};

// Least squares fit of the points with every coefficient >= 0 (an exact active-set search over
// which coefficients are free); quadratic stays 0 unless `quadratic`. `relative`: minimise
// relative errors (each point weighted by 1 / value), for values spanning orders of magnitude
// (message sizes). Needs at least one point.
CostFit fit_cost(const std::vector<CostPoint>& points, bool quadratic, bool relative = false);

struct LayerProfile {
  std::string name;
  CostFit forward, input_grad, weight_grad, activation_bytes;
  // Measured again while the machine's other cores trained too (`fit.shared`; absent = not
  // measured, the same as alone).
  bool shared = false;
  CostFit forward_shared, input_grad_shared, weight_grad_shared;
  double param_bytes = 0, params = 0, tensors = 0;
  double optimizer_seconds = 0;  // per step, when the layer trains
};

struct ModuleProfile {
  std::string name;             // "llm" or the encoder's name
  bool llm = false;             // role
  double units_per_sample = 1;  // encoders: items per sample in the profiled data
  LayerProfile front, block, back;
  LayerProfile stage;  // LLM only: per pipeline stage and microbatch (forward)
  // LLM with [model.llm.moe]: one mixture-of-experts block ("moe_block"); `block` is then a dense
  // block of the same width. Costs use it for the blocks model.llm.moe makes MoE.
  bool has_moe_block = false;
  LayerProfile moe_block;
  // The same blocks recomputed.
  LayerProfile block_recompute, moe_block_recompute;
  // LLM block `layer`'s layer (dense or MoE), recomputed or not.
  const LayerProfile& block_at(const LlmSpec& llm, int64_t layer, bool recomputed = false) const {
    if (has_moe_block && llm.moe.is_moe_layer(layer))
      return recomputed ? moe_block_recompute : moe_block;
    return recomputed ? block_recompute : block;
  }
  std::vector<std::pair<std::string, double>> model;  // shape fields the costs hold for
};

struct Profile {
  std::string source;  // the file, for messages
  std::string device, precision, config;
  int64_t threads = 0;
  double samples = 0;  // samples of the profiled microbatch
  double seq = 0;      // its padded LLM row length
  int64_t max_seq = 0;
  double data_seconds_per_sample = 0;
  std::map<std::string, double> media_seconds_per_sample;  // per encoder name
  // Measured alpha-beta of the local transport (bytes_per_second 0 = not measured): one-way
  // point-to-point, and per-hop figures of a two-rank all-reduce of fp32 (gradients) and of
  // compute-dtype (activations: TP / CP) tensors.
  Link p2p, all_reduce, all_reduce_compute;
  // The measured mean seconds behind those fits, per size (empty = not measured).
  CommCurve p2p_curve, all_reduce_curve, all_reduce_compute_curve;
  CommCurve all_reduce_blocking_curve;  // empty in older profiles
  bool comm_on_compute = false;         // the transport runs on the profiled cores (CPU ranks)
  bool activations_in_shared_memory = false;  // "activation_transport": "shared memory"
  std::vector<ModuleProfile> modules;
  // The data's mean sample ("data_shape"; positions 0 = absent): its items and peak items are
  // per encoder name (profile_data_shape orders them as a spec's encoders).
  DataShape data;
  std::map<std::string, double> data_items, data_peak_items;

  // The module named `name`; an Error naming the file when absent.
  const ModuleProfile& module(const std::string& name) const;
};

Profile parse_profile(const std::string& json_text, const std::string& source);
// Reads and parses a profile file; a missing or unreadable file is an Error naming it.
Profile load_profile(const std::string& path);

// The shape fields a module's costs depend on ("hidden", "heads", ..., for `module` = "llm" or
// an encoder's name): what `weft bench profile` records and check_profile compares.
std::vector<std::pair<std::string, double>> profile_model_fields(const Spec& spec,
                                                                 const std::string& module);

// Checks that `profile` was measured for `spec`'s model and precision (every module present,
// every shape field equal; the LLM vocabulary only where the spec sets one); an Error naming the
// file, the module, the field and both values.
void check_profile(const Profile& profile, const Spec& spec);

// LLM row length the profile's costs are evaluated at for this spec (see above).
double profile_seq(const Profile& profile, const Spec& spec);
// The sample the profile's costs are per (SimOptions::data): the data's mean sample the profile
// recorded ("data_shape"), where the spec's max_seq is the profiled one; else (an older profile,
// or rows rescaled to another max_seq) rows of profile_seq positions, loss on every one (the
// FLOP fields count the head on each), and each encoder's items per sample (units_per_sample:
// its costs per sample hold them). The recorded shape is the profiled config's: its padding
// follows that config's microbatches (a spec with others pads more or less), and under packing
// its positions are per sample while the LLM's costs are per packed row of profile_seq. A
// recorded shape that does not fit the spec, or whose items are not units_per_sample, is an
// Error naming the file.
DataShape profile_data_shape(const Profile& profile, const Spec& spec);

// A data shape as JSON, per sample (`weft plan` / `weft simulate` outputs, a profile's
// "data_shape"): samples, positions, tokens, targets, sum_sq_doc_len, items {encoder name: n},
// and, when it has one, peak {positions, targets, items}; without a shape {"rows": "full",
// "positions": max_seq}.
nlohmann::ordered_json data_shape_json(const Spec& spec, const DataShape& shape);

// The module's per-layer costs (seconds, bytes) for one microbatch of `samples` samples on a rank
// of a tp × cp group (work per unit and activations divided over tp · cp, parameters over tp, but
// an encoder's front end's, which every rank runs whole; what each TP rank keeps whole is the
// caller's: plan.cpp keep_whole),
// under the frozen rules, like module_layer_costs, each block plain or recomputed as the spec
// says (before the module has its boundaries: recomputed when it recomputes every block, else
// plain); `shared`: the seconds measured under load
// where measured (ranks computing side by side). The LLM's per-stage work is left out: every
// stage does it once per microbatch, so it does not move the partitioner's optimum.
ModuleCosts profile_module_costs(const Profile& profile, const Spec& spec, const ModulePlan& module,
                                 double samples, int64_t tp = 1, int64_t cp = 1,
                                 bool shared = false);

// The simulator's per-stage costs from the profile: measured seconds per unit and per op, the
// per-step optimizer seconds, measured activation and parameter bytes, each block plain or
// recomputed as the spec's recompute / recompute_blocks say (with StageCost::recompute_blocks and
// recompute_peak_bytes: what a recomputed block's plain forward keeps beyond its recomputed one);
// the FLOP fields stay the FLOP model's (they count toward MFU only, recomputation excluded).
CostTable profile_stage_costs(const Profile& profile, const Spec& spec, const Plan& plan);

// The simulator options a profile implies for `spec`: its data preparation and media decoding
// seconds, its sample (profile_data_shape), its measured transport for ranks on one node
// (SimOptions::p2p_curve, grad_curve, activation_curve, comm_occupies_rank), and its vocabulary
// for a spec that leaves model.llm.vocab unset (unset_vocab).
SimOptions profile_sim_options(const Profile& profile, const Spec& spec, SimOptions options = {});

// simulate() with the profile's costs and profile_sim_options.
SimResult simulate(const Spec& spec, const Plan& plan, const Cluster& cluster,
                   const Profile& profile, SimOptions options = {});

}  // namespace weft::plan
