// Plan: a plain, serialisable description that fully decides a run — for every module its
// layout {dp, tp, pp, cp}, its rank span, stage boundaries, and whether it is frozen and what
// backward it needs; the microbatching. The simulator replays a Plan; the runtime executes it.
// Single-process training is the Plan with every size 1.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "weft/core/error.h"
#include "weft/core/spec.h"

namespace weft::plan {

// ep (expert parallelism, MoE LLM only) does not add ranks: it groups ranks of each pipeline
// stage that hold different tokens, see ModulePlan::expert_groups. etp: the expert weights'
// tensor parallelism, 1 or tp; 0 = tp (core/spec.h LayoutSpec).
// sp: sequence parallelism (core/spec.h LayoutSpec), in effect where tp > 1 (sequence_parallel()).
// vp: virtual pipeline stages (the LLM only): pipeline rank s holds the vp chunks of blocks that
// are virtual stages s, s + pp, ..., s + (vp - 1)·pp of stages() = pp·vp (core/spec.h LayoutSpec).
struct Layout {
  int64_t dp = 1, tp = 1, pp = 1, cp = 1, ep = 1, etp = 0;
  bool sp = false;
  int64_t vp = 1;
  bool sequence_parallel() const { return sp && tp > 1; }
  int64_t size() const { return dp * tp * pp * cp; }
  int64_t stages() const { return pp * vp; }  // (virtual) pipeline stages
  int64_t expert_tp() const { return etp > 0 ? etp : tp; }
};

enum class ModuleRole { kEncoder, kProjector, kLlm };

// Axes of a module's rank grid, fastest first.
enum class Axis { kTp, kCp, kDp, kPp };

// A rank's position in its module's grid.
struct Coord {
  int64_t tp = 0, cp = 0, dp = 0, pp = 0;
};

struct ModulePlan {
  std::string name;  // "llm", "<encoder>", "<encoder>.projector"
  ModuleRole role = ModuleRole::kLlm;
  int encoder = -1;  // index into ModelSpec::encoders for encoders and projectors
  Layout layout;
  int64_t first_rank = 0;  // ranks [first_rank, first_rank + layout.size())
  // First layer of each (virtual) stage after the first (layout.stages() - 1 entries).
  std::vector<int64_t> stage_boundaries;
  int64_t layers = 0;  // blocks this module runs: LLM layers, encoder layers_used(), projector 0
  bool frozen = false;
  // Backward work this module must do: weight grads iff trainable; input grads iff something
  // upstream trains. A module with neither runs forward only and keeps no activations.
  bool weight_grads = true;
  bool input_grads = false;
  bool needs_backward() const { return weight_grads || input_grads; }

  // The module's ranks form a grid [tp, cp, dp, pp], tp fastest:
  //   rank = first_rank + tp + layout.tp * (cp + layout.cp * (dp + layout.dp * pp)).
  bool hosts(int64_t rank) const { return rank >= first_rank && rank < first_rank + layout.size(); }
  Coord coord(int64_t rank) const;  // rank must be hosted
  int64_t rank_of(const Coord& c) const;
  // Ranks of the group through `rank` that vary along `axes` (other coordinates fixed),
  // ascending. {} is {rank}; {kTp, kCp, kDp, kPp} is every rank of the module.
  std::vector<int64_t> group(int64_t rank, std::initializer_list<Axis> axes) const;
  // Every distinct such group of this module, ordered by first rank: every process can create
  // its communicators by walking this list, in the same order on all ranks.
  std::vector<std::vector<int64_t>> groups(std::initializer_list<Axis> axes) const;
  // Expert parallelism. A rank's tokens are its (cp, dp) share and, with etp = 1 < tp, the
  // tp-th slice of them: its token index is i = tp / etp + (tp / etp) · (cp + layout.cp · dp)
  // (the first tp is the coordinate, the second the layout's). At each pipeline stage and
  // expert-TP rank (tp % etp) the ranks in order of i form groups of ep consecutive ranks (EP rank
  // i % ep shards the experts; i / ep is the expert-data-parallel rank). expert_groups(false):
  // every EP group; expert_groups(true): every expert-data-parallel group (the ranks holding the
  // same experts, over which their gradients are summed). Ordered by first rank, like groups().
  std::vector<std::vector<int64_t>> expert_groups(bool data_parallel) const;
  int64_t token_index(const Coord& c) const {
    const int64_t etp = layout.expert_tp(), slices = layout.tp / etp;
    return c.tp / etp + slices * (c.cp + layout.cp * c.dp);
  }
  int64_t ep_rank(const Coord& c) const { return token_index(c) % layout.ep; }
  int64_t edp_rank(const Coord& c) const { return token_index(c) / layout.ep; }
  // Blocks [begin, end) that (virtual) pipeline stage `stage` (0 <= stage < layout.stages())
  // runs; {0, 0} for a projector (no blocks; it runs on its encoder's last stage). Pipeline rank
  // c.pp runs the stages c.pp + k·pp, k < vp (its chunks).
  std::pair<int64_t, int64_t> stage_layers(int64_t stage) const;
};

// Per pipeline rank of `pp` (virtual stage v runs on rank v % pp), the blocks of its longest chunk
// when `layers` blocks are cut at `boundaries` (the first block of each virtual stage after the
// first; vp = 1: each rank's own blocks).
std::vector<int64_t> longest_chunks(const std::vector<int64_t>& boundaries, int64_t layers,
                                    int64_t pp);

// One op of a pipeline rank's schedule: the forward or backward of one microbatch through one of
// the rank's chunks (virtual stage chunk·pp + rank).
struct PipelineOp {
  bool forward = true;
  int64_t microbatch = 0, chunk = 0;
};

// The order in which pipeline rank s of pp, holding vp chunks, runs M microbatches — the one order
// the runtime runs and the simulator replays. vp = 1: 1F1B (min(pp - 1 - s, M) warm-up forwards,
// then one forward / one backward, then the remaining backwards). vp > 1: Megatron-LM's
// interleaved 1F1B for any M. The microbatches form max(1, M / pp) groups whose sizes differ by at
// most one (the larger first), so each group holds at least pp unless M < pp; the forwards take
// each group through chunks 0, 1, ..., vp - 1 and the backwards through vp - 1, ..., 0. Warm-up:
// 2·(pp - 1 - s) + (vp - 1)·(first group's size) forwards, or all of them when M <= pp. Forward
// only (no backward): every forward in that order.
std::vector<PipelineOp> pipeline_schedule(int64_t pp, int64_t vp, int64_t M, int64_t s,
                                          bool backward);
// Every rank's pipeline_schedule, rank 0 first.
std::vector<std::vector<PipelineOp>> pipeline_schedules(int64_t pp, int64_t vp, int64_t M,
                                                        bool backward);

// Replays the pipeline ranks' schedules `ops` (pipeline_schedule of each of the pp ranks) over
// pp · vp virtual stages and M microbatches with every constraint but the schedule's dropped:
// rank s runs its ops in order from start[s], each after the rank's previous op and after the
// message it waits for: a forward the previous virtual stage's forward of its microbatch, a
// backward the next virtual stage's backward (the last virtual stage: its own forward), plus
// link(v, microbatch) for a message between virtual stages v and v + 1 (either way); ready(op,
// v) may hold an op later still. seconds(op, v) is its duration; it ends no sooner than done(op,
// v) (what it waits for while it runs: an overlapped parameter gather). Fills the ends of every
// forward and backward ((v, microbatch) at v · M + microbatch; may be null) and returns each rank's
// end. (The layout search's bound and batch balancing's makespan; the simulator adds the rest.)
template <class Seconds, class Link, class Ready, class Done>
std::vector<double> replay_schedule(const std::vector<std::vector<PipelineOp>>& ops, int64_t vp,
                                    int64_t M, std::vector<double> start, Seconds seconds,
                                    Link link, Ready ready, Done done,
                                    std::vector<double>* forward_end,
                                    std::vector<double>* backward_end) {
  const int64_t P = static_cast<int64_t>(ops.size()), V = P * vp;
  constexpr double kNotYet = -1;
  std::vector<double> own_f, own_b;
  std::vector<double>& tf = forward_end ? *forward_end : own_f;
  std::vector<double>& tb = backward_end ? *backward_end : own_b;
  tf.assign(static_cast<size_t>(V * M), kNotYet);
  tb.assign(static_cast<size_t>(V * M), kNotYet);
  const auto at = [M](int64_t v, int64_t mb) { return static_cast<size_t>(v * M + mb); };
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  std::vector<double>& clock = start;  // per rank: the end of its last op so far
  for (bool left = true; left;) {
    left = false;
    bool progress = false;
    for (int64_t s = 0; s < P; ++s) {
      const std::vector<PipelineOp>& q = ops[static_cast<size_t>(s)];
      for (size_t& k = next[static_cast<size_t>(s)]; k < q.size(); ++k) {
        const PipelineOp& op = q[k];
        const int64_t v = op.chunk * P + s, mb = op.microbatch;
        double t = std::max(clock[static_cast<size_t>(s)], static_cast<double>(ready(op, v)));
        if (op.forward && v > 0) {
          const double sent = tf[at(v - 1, mb)];
          if (sent == kNotYet) break;
          t = std::max(t, sent + link(v - 1, mb));
        } else if (!op.forward) {
          const double sent = v + 1 < V ? tb[at(v + 1, mb)] : tf[at(v, mb)];
          if (sent == kNotYet) break;
          t = std::max(t, sent + (v + 1 < V ? link(v, mb) : 0.0));
        }
        t = std::max(t + seconds(op, v), static_cast<double>(done(op, v)));
        (op.forward ? tf : tb)[at(v, mb)] = clock[static_cast<size_t>(s)] = t;
        progress = true;
      }
      left = left || next[static_cast<size_t>(s)] < q.size();
    }
    WEFT_ASSERT(progress || !left, "pipeline schedule replay deadlocks");
  }
  return clock;
}

struct Plan {
  int64_t world_size = 1;
  std::string placement = "colocated";
  std::vector<ModulePlan> modules;  // encoders and their projectors in spec order, then "llm"
  int64_t global_batch = 1;
  int64_t microbatches = 1;
  // Microbatch schedule: "1f1b" when any module has pp > 1, "interleaved-1f1b" when the LLM also
  // has vp > 1 (pipeline_schedule).
  std::string schedule = "sequential";
  std::string cp_split = "balanced";  // LLM sequence split over CP ranks (ParallelSpec)
  std::string balance = "in_order";   // how samples are assigned to microbatches

  const ModulePlan& module(const std::string& name) const;
};

// Builds the Plan a Spec asks for on `world_size` ranks. Colocated: every module spans all
// ranks, and a layout left all-ones fills them with data parallelism. Separate: encoders in spec
// order, then the LLM, tile [0, world_size) with disjoint spans (an all-ones layout is 1 rank);
// projectors share their encoder's ranks. Rejects layouts that do not fit the model, the world
// or the batch with a message naming the config, `parallel.<module>.<key>` and the numbers.
// Pipelined modules without parallel.<module>.stages get the joint partition of all modules
// (partition.h partition_joint) on the FLOP model — of the data's mean sample where `data` is
// given (partition.h DataShape), of max_seq rows with one item per encoder otherwise — or on a
// measured `profile` when given.
struct Profile;    // plan/profile.h
struct DataShape;  // plan/partition.h
Plan make_plan(const Spec& spec, int64_t world_size = 1, const Profile* profile = nullptr,
               const DataShape* data = nullptr);

// `spec` as one process runs it, whatever layout it asks for: colocated, every module's layout
// cleared, and no per-stage recompute_blocks (counts for stages it no longer has); the modules'
// recompute flags stay.
Spec one_process(Spec spec);

std::string to_json(const Plan& plan);

// Reads to_json's output back (plan_json.cpp). The first form checks the JSON on its own (types,
// every field present, no unknown key, rank spans matching layouts); the second also checks the
// Plan against `spec`: it must be the Plan make_plan builds from the spec with the file's
// placement, layouts, stage boundaries and microbatches, so a hand-edited file cannot describe a
// run the config cannot. Errors name `source`, the field (`modules[2].layout.tp`) and what was
// expected.
Plan plan_from_json(const std::string& text, const std::string& source);
Plan plan_from_json(const std::string& text, const std::string& source, const Spec& spec);

}  // namespace weft::plan
