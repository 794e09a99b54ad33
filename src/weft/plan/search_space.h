// Internal to the layout search (search.h): its tree — a node is the LLM's choice and the
// encoders' chosen so far, in spec order; a leaf is a complete Candidate — and the analytic lower
// bound and memory of a node that prune it (search_space.cpp). search.cpp runs the branch and
// bound over it. Not a public interface.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "weft/plan/search.h"

namespace weft::plan::search_space {

enum PlacementKind { kColocated = 0, kSeparate = 1, kMegatron = 2 };
inline constexpr const char* kPlacementNames[] = {"colocated", "separate", "megatron"};

// One module's stage costs at `pp` stages with its boundaries (cached per module, pp, recompute
// and its blocks, even split, given cut).
struct Staged {
  std::vector<int64_t> boundaries;
  std::vector<StageCost> stages;
  // Σ over stages of one unit's forward + backward at the FLOP rate (measured: each the cheaper
  // of alone and under load)
  double unit_seconds = 0;
};

// What the search knows about a module (encoders in spec order, then the LLM).
struct ModuleInfo {
  size_t plan_index = 0;  // in the base plan's modules
  bool llm = false;
  const EncoderSpec* enc = nullptr;
  double items = 1;       // encoder: items per unit of data (a sample; SimOptions::data)
  double peak_items = 1;  // the most of any sample (activation memory: the peak's share)
  std::vector<int64_t> tps, cps;
  std::vector<int64_t> eps;  // MoE LLM: expert-parallel sizes (divisors of the experts)
  int64_t max_pp = 1;
  bool weight_grads = false;
  bool backward = false;  // LLM: needs backward; encoder: its last stage (the projector) does
  bool keeps_activations = false;
  // The least unit_seconds of any cut without recomputation (measured: Space::least_unit_seconds)
  double min_unit_seconds = 0;
};

// One module's choice in a search node.
struct Choice {
  int64_t tp = 1, cp = 1, pp = 1, dp = 1, first_rank = 0;
  bool recompute = false;
  std::vector<int64_t> recompute_blocks;  // with recompute: recomputed_blocks' (empty = all)
  const Staged* staged = nullptr;
  int64_t ep = 1, etp = 0;  // the LLM's expert parallelism (etp 0 = tp)
  bool sp = false;          // sequence parallelism
  // The LLM's interleaved 1F1B: vp chunks per pipeline rank, cut as `chunks` (pp · vp virtual
  // stages, rank s running chunks s, s + pp, ...); staged stays the plain pp-stage cut.
  int64_t vp = 1;
  const Staged* chunks = nullptr;
  // Boundaries the search moved (Space::rebalance; vp = 1): staged is cut there. Empty: the
  // default cut.
  std::vector<int64_t> cut = {};
  int64_t size() const { return tp * cp * pp * dp; }
  Layout layout() const { return {dp, tp, pp, cp, ep, etp, sp, vp}; }
};

// A node of the search tree: the LLM's choice and the encoders' chosen so far (spec order).
struct Node {
  int placement = kColocated;
  int64_t D = 1, M = 1, zero = 0;
  Choice llm;
  std::vector<Choice> enc;
  // A module (E_: the LLM) whose choice, here without recomputation, stands for that and its
  // partial recomputations, not expanded yet (Space::children); -1: none.
  int64_t partial = -1;
  // A pending node's choices (expand_partial), once its bound has made them, for children to
  // emit again (none of them holds any: no cycle).
  mutable std::shared_ptr<const std::vector<Node>> choices;
};

// One rank's share of one module stage over a step.
struct Work {
  double fwd = 0, bwd = 0;              // Σ forward / backward op seconds
  double first_fwd = 0, first_bwd = 0;  // microbatch 0's forward and backward
  double last_fwd = 0, last_bwd = 0;    // the last microbatch's
  // Point-to-point time of microbatch 0's / the last one's activations to the next stage (the
  // encoder's last stage: its features over the bridge), over the cheapest possible link.
  double hop_first = 0, hop_last = 0;
  double act = 0;                         // peak activation bytes it holds
  double act_first = 0, act_last = 0;     // LLM: one microbatch's (the first's, the last's)
  double static_bytes = 0;                // parameters, gradients, optimizer state
  double opt_bytes = 0, opt_seconds = 0;  // optimizer: gradient bytes stepped, measured seconds
  double tail = 0;  // gradient reduction still running after its last backward, at least
  double full = 0;  // the whole gradient all-reduce
  double reduce_full[2] = {0, 0}, reduce_tail[2] = {0, 0};  // full and tail: dense, experts'
  double gather = 0;  // ZeRO-1: the parameter all-gathers after the optimizer
  bool backward = false;
};

struct Bound {
  double seconds = 0, memory = 0;
  bool feasible = true;
  // Space::bound's `watch` module: per pipeline stage, the most memory one of its ranks needs,
  // and the most seconds of ops one of them runs in the step (its ops back to back).
  std::vector<double> stage_memory, stage_seconds;
};

class Space {
 public:
  Space(const Spec& spec, const Cluster& cluster, const SearchOptions& options);

  // The analytic bound of every completion of `n` and the per-rank memory it certainly needs
  // (and per stage of module `watch`, E_: the LLM, when >= 0). Where a cheaper, weaker bound
  // already reaches fits_limit (its memory fits the device) or over_limit (it does not), that one.
  Bound bound(const Node& n, double fits_limit = kNoLimit, double over_limit = kNoLimit,
              int64_t watch = -1) const;
  static constexpr double kNoLimit = std::numeric_limits<double>::infinity();
  // A leaf whose ZeRO-1 shards nothing: the same plan as with zero_stage = 0.
  bool redundant(const Node& n) const;
  // The LLM's choices (the roots), and a node's children (the next encoder's choices, or those
  // its pending module stands for).
  void roots(const std::function<void(Node&&)>& emit);
  void children(const Node& n, const std::function<void(Node&&)>& emit);
  // A complete candidate: every module chosen, nothing pending.
  bool leaf(const Node& n) const {
    return static_cast<int64_t>(n.enc.size()) == E_ && n.partial < 0;
  }
  // n with its pending module's choice as it stands (no recomputation), nothing pending.
  Node settled(const Node& n) const { return n.partial < 0 ? n : recomputing(n, n.partial, false); }
  Candidate to_candidate(const Node& n) const;
  // The leaf a candidate of this space stands for (its stage boundaries as cuts).
  Node node_of(const Candidate& c) const;
  // A simulated candidate with the stage boundaries of each module that recomputes over pipeline
  // stages (vp = 1) moved by rebalance on the whole leaf, each stage's memory limit lowered by
  // what the simulated peak of its ranks adds to the bound's (the timing of what shares them),
  // with the counts fitted there under those limits (refine_recompute then fits them by the
  // simulator, raising any that fall short); nullopt when no module's move lowered the bound.
  std::optional<Candidate> rebalanced(const Evaluation& e) const;
  int64_t encoders() const { return E_; }
  int64_t max_ranks() const { return max_ranks_; }
  // What the bound's work not yet placed rests on, for tests: module k's least seconds per unit
  // of data (ModuleInfo::min_unit_seconds), which no cut of it may undercut, and its seconds per
  // unit at pp stages cut at `cut` (pp - 1 boundaries), nothing recomputed (Staged::unit_seconds).
  double min_unit_seconds(int64_t k) const { return info(k).min_unit_seconds; }
  double unit_seconds(int64_t k, int64_t pp, const std::vector<int64_t>& cut) const {
    return staged(static_cast<int>(k), pp, false, false, false, false, 1, {}, cut).unit_seconds;
  }

 private:
  const Spec& spec_;
  Spec costed_;  // model.llm.vocab set
  const Cluster& cl_;
  SearchOptions o_;
  std::vector<int> placements_;
  Plan base_;
  std::vector<ModuleInfo> info_;
  int64_t E_ = 0, B_ = 1, max_ranks_ = 1, gpn_ = 1;
  double flops_ = 1, act_ = 2, data_ = 0, S_ = 1, H_ = 1, kvw_ = 1;
  bool trains_ = true;
  mutable std::map<std::tuple<int, int64_t, int64_t, bool, bool, bool, bool, std::vector<int64_t>,
                              std::vector<int64_t>>,
                   std::unique_ptr<Staged>>
      staged_;  // a cache
  // pipeline_schedule of every pipeline rank, by {pp, vp, M, backward}.
  mutable std::map<std::tuple<int64_t, int64_t, int64_t, bool>,
                   std::vector<std::vector<PipelineOp>>>
      schedules_;
  mutable std::map<std::pair<int64_t, bool>, std::vector<int64_t>> groups_;

  const ModuleInfo& info(int64_t k) const { return info_[static_cast<size_t>(k)]; }

  // Module k's stages over pp; vocab_parallel: the LLM at tp > 1, whose loss keeps its logits
  // instead of the fused head's gradients (partition.h module_layer_costs); sp: with sequence
  // parallelism (what each TP rank keeps whole, StageCost::whole_activation_bytes). vp > 1: the
  // LLM's pp · vp interleaved chunks, cut evenly by work (make_plan's cut) or, even, by blocks.
  // blocks: with recompute, the blocks recomputed (recomputed_blocks: empty = every block; then
  // pp stages not cut evenly are cut by the recompute-aware costs, else as without). cut: the
  // boundaries to take instead (vp = 1; empty: as above).
  const Staged& staged(int k, int64_t pp, bool recompute, bool even, bool vocab_parallel,
                       bool sp = false, int64_t vp = 1, const std::vector<int64_t>& blocks = {},
                       const std::vector<int64_t>& cut = {}) const;
  // An all-gather here stands for a reduce-scatter too (the cheaper of the two: a bound).
  static constexpr CollectiveKind kAllReduce = CollectiveKind::kAllReduce,
                                  kAllGather = CollectiveKind::kAllGather;
  // What a collective carries, and so how it goes: TP's and CP's activations (waited for where
  // issued; the experts' all-to-all among them), gradient buckets and ZeRO-1's gathers (Gloo's or
  // NCCL's, waited for later), or the loss's and the gradient norm's fp32 sums (waited for).
  enum Traffic { kActivations, kGradients, kReductions };
  double collective(CollectiveKind kind, int64_t n, int64_t span, double bytes, Traffic traffic,
                    CollectiveAlgo algo = CollectiveAlgo::kRing) const;
  double hop(double bytes, int64_t stride) const;
  double least_unit_seconds(int64_t k) const;
  // Gradient reductions overlapped with backward, as the simulator runs them: not where the
  // transport runs on the ranks' cores (SimOptions::comm_occupies_rank).
  bool overlap_grads() const {
    return spec_.train.overlap_grad_reduce && !o_.sim.comm_occupies_rank;
  }
  double op_seconds(const StageCost& sc, bool forward, double n, double split) const;
  Work work(int64_t k, const Choice& c, int64_t s, int64_t i, const Node& n) const;
  // Per pipeline rank of module k (the LLM interleaved: the sums over each rank's chunks, its
  // activations the peak its schedule holds); chunks: the LLM's per virtual stage (vp = 1: the
  // same as the ranks').
  std::vector<Work> works(int64_t k, const Choice& c, const Node& n,
                          std::vector<Work>* chunks = nullptr) const;
  const std::vector<std::vector<PipelineOp>>& schedules(int64_t pp, int64_t vp, int64_t M,
                                                        bool backward) const;
  double optimizer_seconds(double bytes, double measured) const;
  Holding hold(Work* w, const StageCost& sc, const Choice& c, const Node& n) const;
  struct Rank;
  Rank rank_at(const Node& n, const std::vector<std::vector<Work>>& w, int64_t r) const;
  std::vector<int64_t> zero_stages() const;
  std::vector<bool> recompute_options(int64_t k) const;
  // Partial recomputation (SearchOptions::partial_recompute). Module k's choice in n without
  // recomputation may stand for its partial ones too (Node::partial) when there are some: two
  // pipeline stages or a chunk of >= 2 blocks (chunk_blocks: per pipeline stage, the longest of
  // its chunks). recomputing: n with module k's recomputation `on` over `blocks`
  // (recomputed_blocks'), on its choice's cut, nothing pending. expand_partial: the choices n's
  // pending module stands for: n without recomputation, and where that does not fit the device
  // but every block does (by the memory bound), fit_stages' counts, the most of those on every
  // stage, and each halfway to every block (room for what the bound does not see yet: encoders
  // still to choose, the simulator's exact peak); then rebalance's cut with its counts and
  // halfway to every block.
  bool partial_applies(int64_t k, const Node& n) const;
  std::vector<int64_t> chunk_blocks(const Node& n, int64_t k) const;
  Node recomputing(const Node& n, int64_t k, bool on,
                   const std::vector<int64_t>& blocks = {}) const;
  void expand_partial(const Node& n, const std::function<void(Node&&)>& emit) const;
  // expand_partial's choices of pending node n, made once (Node::choices).
  const std::vector<Node>& pending_choices(const Node& n) const;
  // Per pipeline stage of module k in n, the fewest first blocks of each chunk that make its
  // ranks fit the device by the memory bound (bisected for every stage at once: a rank's memory
  // falls as its own stage recomputes more and no other stage's count moves it); empty when some
  // stage does not fit even recomputing every block.
  // headroom: per stage, memory the bound does not see (empty: none).
  std::vector<int64_t> fit_stages(const Node& n, int64_t k,
                                  const std::vector<double>& headroom = {}) const;
  // Module k of n (recomputing nothing, vp = 1) cut at `cut`, recomputing fit_stages' counts
  // there (none anywhere: recomputation off; all: every block), with its bound watching k (full:
  // the schedule replayed, else the quick bound); nullopt when nothing fits.
  struct Fitted {
    Node node;
    Bound bound;
    std::vector<int64_t> blocks;  // per stage
  };
  std::optional<Fitted> fit_cut(const Node& n, int64_t k, const std::vector<int64_t>& cut,
                                const std::vector<double>& headroom = {}, bool full = true) const;
  // AdaPipe's co-optimisation of stage boundaries and per-stage recomputation, priced by the
  // bound: from `n`'s cut with fit_stages' counts, move one block at a time from the stage whose
  // ranks are busiest to another (the stages between each pass one block on), re-fitting every
  // stage's count (under `headroom`), the move the quick bound ranks best, while the full bound
  // falls by more than kMinGain (relative); the cut and counts reached, or nullopt when no move
  // lowered the bound.
  std::optional<Fitted> rebalance(const Node& n, int64_t k,
                                  const std::vector<double>& headroom = {}) const;
  static constexpr double kMinGain = 1e-4;
  // Sequence parallelism for module k (E_: the LLM) at tp × cp × pp.
  std::vector<bool> sequence_options(int64_t tp, int64_t k, int64_t cp, int64_t pp) const;
  std::vector<std::pair<int64_t, int64_t>> expert_layouts(int64_t tp, int64_t cp_dp) const;
  int64_t max_vp(int64_t pp, int64_t M, int placement) const;
};

}  // namespace weft::plan::search_space
