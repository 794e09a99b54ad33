#include "weft/dist/runtime.h"

#include <ATen/record_function.h>
#include <c10/util/accumulate.h>  // c10::multiply_integers
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <tuple>

#include "weft/core/error.h"
#include "weft/dist/collectives.h"
#include "weft/dist/data_parallel.h"
#include "weft/model/chunked_attention.h"
#include "weft/model/fused.h"
#include "weft/model/mask.h"
#include "weft/plan/cp_split.h"
#include "weft/plan/encoder_share.h"
#include "weft/plan/trace.h"

namespace weft::dist {

namespace {

using plan::Axis;
using plan::Coord;
using plan::ModulePlan;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using plan::even_part;  // sizes differ by at most one, larger parts first

// Message tags: kind | module | microbatch | stage, unique per (sender, receiver) within a step.
enum Kind { kEncAct = 1, kEncGrad, kBridge, kBridgeGrad, kLlmAct, kLlmGrad };
int tag_of(Kind kind, int64_t module, int64_t mb, int64_t stage) {
  WEFT_ASSERT(module < 16 && mb < 4096 && stage < 4096, "tag space exceeded");
  return static_cast<int>((kind << 28) | (module << 24) | (mb << 12) | stage);
}

std::vector<int> to_int(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

// This rank's coordinates in a module's grid, if it hosts it.
struct Role {
  bool hosted = false;
  Coord c;
  bool first = false, last = false;  // pipeline stage
};

Role role_of(const ModulePlan& m, int64_t rank) {
  Role r;
  if (!m.hosts(rank)) return r;
  r.hosted = true;
  r.c = m.coord(rank);
  r.first = r.c.pp == 0;
  r.last = r.c.pp == m.layout.pp - 1;
  return r;
}

}  // namespace

struct Runtime::Impl {
  ModelSpec spec;
  plan::Plan plan;
  Comm world, p2p;
  RuntimeOptions opts;
  int64_t rank = 0;
  std::unique_ptr<model::MultimodalModel> model;

  // Per encoder e: its plan (encoder and projector), this rank's role, groups.
  std::vector<const ModulePlan*> enc_plan, proj_plan;
  std::vector<Role> enc_role;
  const ModulePlan* llm_plan = nullptr;
  Role llm_role;

  // Gradient synchronisation: one group (data x context parallel ranks) per hosted module.
  struct SyncGroup {
    Comm group;
    std::vector<size_t> params;      // indices into trainable
    std::unique_ptr<GradSync> sync;  // its parameters in `params`' order
  };
  std::vector<SyncGroup> enc_sync;  // per encoder (with its projector)
  SyncGroup llm_sync;
  // MoE LLM whose experts are not held like the dense weights (ep > 1, or whole experts under
  // TP: etp = 1 < tp): expert parameters, summed over the expert-data-parallel group only.
  SyncGroup expert_sync;
  bool expert_parallel = false;
  // Interleaved 1F1B: per chunk of this rank, which of llm_sync's (expert_sync's) parameters
  // it holds; armed before the chunk's last backward (GradSync::arm).
  std::vector<std::vector<bool>> llm_chunk_params, expert_chunk_params;
  model::MoeStats moe_stats;  // this rank's, during a step
  RoutingReport routing;
  Comm tied;  // first and last LLM stage with the same (tp, cp, dp): the tied embedding's copies
  int64_t tied_index = -1;  // index into trainable of this rank's embedding, when tied over PP
  // Sequence parallelism: per module (the encoders in spec order, then the LLM), its TP group and
  // its trainable parameters used on this rank's part of the sequence only
  // (model::Split::partial_grad), whose gradients are summed over that group.
  struct PartialGrads {
    Comm tp;
    std::vector<size_t> params;
  };
  std::vector<PartialGrads> sequence_partial;
  int64_t seq_split = 1;  // the LLM's sequence positions per microbatch divide by this (tp or 1)

  model::NamedTensors trainable;
  std::vector<size_t> trainable_param;  // index into model->parameters()
  std::vector<bool> counted;  // per trainable: counts toward norms (one copy of each value)
  // Per trainable: under ZeRO-1 each rank of its sync group counts its own pieces (the copy
  // condition without the data- and context-parallel one).
  std::vector<bool> counted_pieces;
  // What this rank's optimizer steps (trainable indices): ZeRO-1 pieces of sharded parameters,
  // every other trainable parameter whole.
  std::vector<ShardPiece> pieces;
  // Per model parameter: the TP group that splits or replicates it; canonical = the copy that
  // represents it in checkpoints (dp = cp = 0, not the tied copy).
  std::vector<Comm> param_tp;
  std::vector<bool> param_canonical;

  StepTimes times;
  // An evaluation pass (eval_loss_sum): forwards only, nothing kept for a backward, no gradient.
  bool forward_only = false;
  // eval_next_tokens: the LLM's last stage takes greedy ids (over [0, predict_vocab)) at the
  // target rows instead of the loss, as (index among the batch's targets, id) pairs; each
  // microbatch's first target's index is target_offsets[d][m].
  int64_t predict_vocab = 0;
  std::vector<std::vector<int64_t>> target_offsets;
  struct Prediction {
    at::Tensor index, id, logprob;  // [n] each: target indices, greedy ids, their log-probabilities
  };
  std::vector<Prediction> predictions;
  bool want_logprob = false;  // the caller asked for the log-probabilities (a sum over TP more)
  // A forward-only step (predict > 0: eval_next_tokens's), leaving times and trace as they were.
  at::Tensor evaluate(const std::vector<std::vector<model::Inputs>>& batch, int64_t predict);
  // The ids `predictions` hold, in target order (each target's from the one rank that holds it),
  // on every rank (collective), and into `logprob` (when given) their log-probabilities;
  // `predictions` cleared.
  std::vector<int64_t> shared_predictions(int64_t targets, std::vector<double>* logprob);
  // Generation with a KV cache in the layout (eval_prefill, eval_decode): what this rank keeps
  // of each microbatch of its LLM replica.
  struct Decoding {
    model::KvCache cache;  // this rank's blocks, every chunk's
    at::Tensor visible;    // bool [B, 1, 1, S]: the prefill's positions each row's new tokens see
    at::Tensor position;   // int64 [B, 1]: each row's first new position
    std::vector<int64_t> target;  // per row: its target's index among the batch's, or -1
  };
  std::map<int64_t, Decoding> decoding;
  bool prefilling = false;  // eval_prefill's step: microbatches start their Decoding
  int64_t decode_room = 0, decode_vocab = 0, decode_targets = 0, decode_steps = 0;
  model::KvCache& start_decoding(int64_t m, const model::Inputs& host, int64_t S);
  void decode_step(const std::vector<int64_t>& ids);
  bool grads(bool wanted) const { return wanted && !forward_only; }
  // Timeline of the step (when tracing): compute intervals exclude the time blocked in receives.
  bool tracing = false;
  double step_t0 = 0;
  std::vector<plan::TraceEvent> trace;
  // A traced op of the step; also a user-scope range in operator traces (train/op_trace.h).
  struct Span {
    Span(Impl* runtime, std::string op, std::string cat)
        : rt(runtime), name(std::move(op)), category(std::move(cat)) {
      if (record.isActive()) record.before(name);
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;
    Impl* rt;
    std::string name, category;
    double t0 = now(), wait0 = rt->times.p2p_wait_seconds;
    at::RecordFunction record{at::RecordScope::USER_SCOPE};
    ~Span() {
      if (!rt->tracing) return;
      const double wait = rt->times.p2p_wait_seconds - wait0;
      rt->trace.push_back({name, category, rt->rank, t0 + wait - rt->step_t0, now() - t0 - wait});
    }
  };
  std::string op_name(const std::string& module, const char* kind, int64_t m, int64_t stage) {
    return module + " " + kind + " mb" + std::to_string(m) + " s" + std::to_string(stage);
  }
  std::map<int, at::Tensor> mailbox;  // self-addressed messages (colocated encoder → LLM)
  std::vector<Pending> sends;
  // Receives posted ahead of the op that reads them (Comm::irecv: on Gloo a send that finds its
  // receive posted goes out at once), by (source, tag).
  struct Posted {
    at::Tensor t;
    Pending done;
  };
  std::map<std::pair<int64_t, int>, Posted> posted;

  // ---- set-up -------------------------------------------------------------------------------

  // A c10d group of these world ranks (every rank calls with the same lists in the same order).
  // Each use gets its own group, so a bucket all-reduce in flight never shares a Gloo context
  // with another module's collectives.
  Comm group(const std::vector<int64_t>& ranks) { return world.subgroup(to_int(ranks)); }
  // This rank's group along `axes` of module m (built for every group of m, on every rank).
  Comm module_group(const ModulePlan& m, std::initializer_list<Axis> axes) {
    Comm mine;
    for (const auto& ranks : m.groups(axes)) {
      Comm g = group(ranks);
      if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) mine = g;
    }
    return mine;
  }

  Impl(const ModelSpec& s, uint64_t seed, const plan::Plan& p, Comm w, RuntimeOptions o)
      : spec(s), plan(p), world(std::move(w)), opts(o), rank(world.rank()) {
    WEFT_CHECK(world.size() == plan.world_size, "the plan is for ", plan.world_size,
               " ranks but the job has ", world.size());
    std::vector<int64_t> all(static_cast<size_t>(world.size()));
    for (int64_t r = 0; r < world.size(); ++r) all[r] = r;
    p2p = world.subgroup(to_int(all), opts.shared_memory_messages);

    model::Hosting hosting;
    for (size_t e = 0; e < spec.encoders.size(); ++e) {
      const ModulePlan& m = plan.module(spec.encoders[e].name);
      enc_plan.push_back(&m);
      proj_plan.push_back(&plan.module(spec.encoders[e].name + ".projector"));
      enc_role.push_back(role_of(m, rank));
      model::ModuleHosting h;
      h.shard.tp = module_group(m, {Axis::kTp});
      h.shard.cp = module_group(m, {Axis::kCp});
      h.shard.sp = m.layout.sp;
      enc_sync.push_back({module_group(m, {Axis::kCp, Axis::kDp}), {}, nullptr});
      h.hosted = enc_role[e].hosted;
      if (h.hosted) {
        const auto [b, end] = m.stage_layers(enc_role[e].c.pp);
        h.range = {b, end, enc_role[e].first, enc_role[e].last, enc_role[e].c.pp};
      }
      hosting.encoders.push_back(h);
    }
    llm_plan = &plan.module("llm");
    llm_role = role_of(*llm_plan, rank);
    hosting.llm.shard.tp = module_group(*llm_plan, {Axis::kTp});
    hosting.llm.shard.cp = module_group(*llm_plan, {Axis::kCp});
    hosting.llm.shard.sp = llm_plan->layout.sp;
    if (llm_plan->layout.sequence_parallel()) seq_split = llm_plan->layout.tp;
    llm_sync.group = module_group(*llm_plan, {Axis::kCp, Axis::kDp});
    expert_parallel =
        llm_plan->layout.ep > 1 || llm_plan->layout.expert_tp() != llm_plan->layout.tp;
    // Expert weights split like the dense MLP (etp = tp) or whole (etp = 1).
    if (llm_plan->layout.expert_tp() == llm_plan->layout.tp)
      hosting.llm.shard.etp = hosting.llm.shard.tp;
    if (expert_parallel) {
      for (bool edp : {false, true})
        for (const auto& ranks : llm_plan->expert_groups(edp)) {
          Comm g = group(ranks);
          if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end())
            (edp ? expert_sync.group : hosting.llm.shard.ep) = g;
        }
    }
    hosting.llm.hosted = llm_role.hosted;
    if (llm_role.hosted) {  // chunk k: virtual stage k·pp + this pipeline rank
      const plan::Layout& l = llm_plan->layout;
      for (int64_t k = 0; k < l.vp; ++k) {
        const int64_t stage = k * l.pp + llm_role.c.pp;
        const auto [b, end] = llm_plan->stage_layers(stage);
        hosting.llm.chunks.push_back({b, end, stage == 0, stage == l.stages() - 1, stage});
      }
      hosting.llm.range = hosting.llm.chunks[0];
    }
    const bool tied_pp = spec.llm.tie_embeddings && llm_plan->layout.pp > 1;
    if (tied_pp) {  // pairs (first stage, last stage) of equal (tp, cp, dp)
      const plan::Layout& l = llm_plan->layout;
      for (int64_t dp = 0; dp < l.dp; ++dp)
        for (int64_t cp = 0; cp < l.cp; ++cp)
          for (int64_t tp = 0; tp < l.tp; ++tp) {
            const std::vector<int64_t> pair = {llm_plan->rank_of({tp, cp, dp, 0}),
                                               llm_plan->rank_of({tp, cp, dp, l.pp - 1})};
            Comm g = group(pair);
            if (pair[0] == rank || pair[1] == rank) tied = g;
          }
    }
    hosting.device = opts.device;
    hosting.frozen_dtype = opts.frozen_dtype;
    model = std::make_unique<model::MultimodalModel>(spec, seed, hosting);

    // Parameters: TP group, canonical copy, trainable list, sync groups.
    for (const model::ModuleHosting& h : hosting.encoders)
      sequence_partial.push_back({h.shard.tp, {}});
    sequence_partial.push_back({hosting.llm.shard.tp, {}});
    const model::NamedTensors& params = model->parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      const std::string& name = params[k].first;
      const std::string module = model::MultimodalModel::module_of(name);
      const bool is_llm = module == "llm";
      size_t e = 0;
      while (!is_llm && spec.encoders[e].name != module.substr(0, module.find('.'))) ++e;
      const Role& role = is_llm ? llm_role : enc_role[e];
      const bool moe_expert = is_llm && name.find(".moe.experts.") != std::string::npos;
      const Comm& tp = moe_expert ? hosting.llm.shard.etp
                       : is_llm   ? hosting.llm.shard.tp
                                  : hosting.encoders[e].shard.tp;
      const bool tied_copy = is_llm && tied_pp && name == "llm.embedding" && !role.first;
      // An expert lives on one EP rank of each expert-data-parallel group: the copy of
      // expert-data-parallel rank 0 represents it.
      const bool expert = expert_parallel && moe_expert;
      const bool canonical =
          (expert ? llm_plan->edp_rank(role.c) == 0 : role.c.dp == 0 && role.c.cp == 0) &&
          !tied_copy;
      param_tp.push_back(tp);
      param_canonical.push_back(canonical);
      if (!params[k].second.requires_grad()) continue;
      const size_t t = trainable.size();
      trainable.push_back(params[k]);
      trainable_param.push_back(k);
      counted_pieces.push_back(!tied_copy &&
                               (model->param_set().split(k).sharded() || tp.rank() == 0));
      counted.push_back(canonical && counted_pieces.back());
      (expert ? expert_sync : is_llm ? llm_sync : enc_sync[e]).params.push_back(t);
      if (is_llm && tied_pp && name == "llm.embedding") tied_index = static_cast<int64_t>(t);
      if (model->param_set().split(k).partial_grad)
        sequence_partial[is_llm ? spec.encoders.size() : e].params.push_back(t);
    }
    // ZeRO-1 shards every parameter over its sync group but those whose gradients are summed
    // again after it: sequence parallelism's partial ones (over TP; small: norms and biases), and
    // a tied embedding's copies (over its pair: each copy in a bucket of its own, so both pair
    // ranks hold the same range and sum just that).
    std::vector<uint8_t> sharded(trainable.size(), 0);
    auto make_sync = [&](SyncGroup& g) {
      model::NamedTensors ps;
      std::vector<Reduce> how;
      std::vector<at::ScalarType> wire;
      std::vector<model::ParamUse> use;
      for (size_t t : g.params) {
        ps.push_back(trainable[t]);
        const size_t k = trainable_param[t];
        how.push_back(!opts.zero1 || model->param_set().split(k).partial_grad ? Reduce::kAllReduce
                      : static_cast<int64_t>(t) == tied_index ? Reduce::kScatterAlone
                                                              : Reduce::kScatter);
        use.push_back(model->param_set().use(k));
        wire.push_back(use.back() == model::ParamUse::kCast ? opts.param_gather_dtype : at::kFloat);
      }
      g.sync = std::make_unique<GradSync>(g.group, ps, opts.bucket_bytes, how, wire, use);
      for (size_t i = 0; i < g.params.size(); ++i) sharded[g.params[i]] = g.sync->sharded(i);
      for (ShardPiece p : g.sync->pieces()) {
        p.param = g.params[p.param];
        pieces.push_back(std::move(p));
      }
    };
    for (auto& g : enc_sync) make_sync(g);
    make_sync(llm_sync);
    if (expert_parallel) make_sync(expert_sync);
    for (size_t t = 0; t < trainable.size(); ++t)
      if (!sharded[t]) pieces.push_back({t, 0, trainable[t].second.numel(), {}, {}});
    // The chunk of each LLM parameter: its block's; the embedding the first chunk's (a tied
    // copy on the last stage the last chunk's); the final norm and head the last chunk's.
    const std::vector<model::StageRange>& chunks = hosting.llm.chunks;
    const auto chunk_of = [&](const std::string& name) -> size_t {
      const std::string layers = "llm.layers.";
      if (name.rfind(layers, 0) == 0) {
        const int64_t i = std::stoll(name.substr(layers.size()));
        for (size_t k = 0; k < chunks.size(); ++k)
          if (i >= chunks[k].first_layer && i < chunks[k].last_layer) return k;
      }
      if (name == "llm.embedding" && chunks.front().first_stage) return 0;
      return chunks.size() - 1;
    };
    const auto per_chunk = [&](const SyncGroup& g) {
      std::vector<std::vector<bool>> out(chunks.size(), std::vector<bool>(g.params.size()));
      for (size_t i = 0; i < g.params.size(); ++i)
        out[chunk_of(trainable[g.params[i]].first)][i] = true;
      return out;
    };
    if (llm_role.hosted && chunks.size() > 1) {
      llm_chunk_params = per_chunk(llm_sync);
      if (expert_parallel) expert_chunk_params = per_chunk(expert_sync);
    }
    if (spec.llm.moe.enabled())
      for (int64_t i = 0; i < spec.llm.layers; ++i)
        if (spec.llm.moe.is_moe_layer(i)) routing.layers.push_back(i);
  }

  // ---- messages -----------------------------------------------------------------------------

  // Empty messages are skipped on both sides (both know the shape).
  void send(const at::Tensor& t, int64_t dst, int tag) {
    if (t.numel() == 0) return;
    if (dst == rank) {
      mailbox[tag] = t;
      return;
    }
    sends.push_back(p2p.send(t.contiguous(), static_cast<int>(dst), tag));
  }
  // A message this rank expects: its shape and dtype (both sides know them), source and tag.
  struct Msg {
    std::vector<int64_t> shape;
    at::ScalarType dtype = at::kFloat;
    int64_t src = -1;  // -1: no message
    int tag = 0;
    bool none() const { return src < 0 || c10::multiply_integers(shape) == 0; }
  };
  at::Tensor recv(const Msg& msg) {
    const at::TensorOptions options = torch::TensorOptions().dtype(msg.dtype).device(opts.device);
    if (msg.none()) return torch::empty(msg.shape, options);
    if (msg.src == rank) {
      auto it = mailbox.find(msg.tag);
      WEFT_ASSERT(it != mailbox.end(), "self message ", msg.tag, " missing");
      at::Tensor t = it->second;
      mailbox.erase(it);
      return t;
    }
    post(msg);
    auto it = posted.find({msg.src, msg.tag});
    Posted p = std::move(it->second);
    posted.erase(it);
    WEFT_ASSERT(p.t.sizes() == at::IntArrayRef(msg.shape) && p.t.scalar_type() == msg.dtype,
                "message ", msg.tag, " from rank ", msg.src, " was posted with another shape");
    const double t0 = now();
    p.done.wait();
    times.p2p_wait_seconds += now() - t0;
    return p.t;
  }
  // Posts the receive of `msg` now (once; nothing for self-addressed or empty messages).
  template <typename Part>
  void post(const std::vector<Part>& parts) {
    for (const Part& p : parts) post(p.msg);
  }
  void post(const Msg& msg) {
    if (msg.none() || msg.src == rank || posted.count({msg.src, msg.tag})) return;
    at::Tensor t =
        torch::empty(msg.shape, torch::TensorOptions().dtype(msg.dtype).device(opts.device));
    Pending done = p2p.irecv(t, static_cast<int>(msg.src), msg.tag);
    posted.emplace(std::make_pair(msg.src, msg.tag), Posted{t, std::move(done)});
  }

  // ---- the step -----------------------------------------------------------------------------

  // Items of encoder e in global microbatch m: per replica d its count, and offsets.
  struct ItemLayout {
    std::vector<int64_t> count, offset;
    int64_t total = 0;
  };
  ItemLayout items_of(const std::vector<std::vector<model::Inputs>>& batch, size_t e,
                      int64_t m) const {
    std::vector<int64_t> counts;
    for (const auto& replica : batch) {
      const at::Tensor& rows = replica[m].encoder_rows[e];
      counts.push_back(rows.defined() ? rows.numel() / enc_tokens(e) : 0);
    }
    return layout_of(counts);
  }
  static ItemLayout layout_of(const std::vector<int64_t>& counts) {
    ItemLayout l;
    for (int64_t c : counts) {
      l.offset.push_back(l.total);
      l.count.push_back(c);
      l.total += c;
    }
    return l;
  }

  // How the LLM's sequence of one microbatch is split over CP ranks. The planner's splitter
  // (plan/cp_split) prices token blocks by their exact attention work under this microbatch's
  // mask (summed over its rows) plus linear work, and assigns them with parallel.cp_split
  // (contiguous and zigzag over 2·cp blocks; lpt and balanced over 4·cp). Ranks then hold
  // equal token counts, topped up with padding positions appended after the sequence (a
  // padding token sees only itself and nobody sees it, so this changes nothing).
  struct CpLayout {
    int64_t S = 0;                // sequence length with the padding positions
    std::vector<at::Tensor> own;  // per CP rank: its token positions (equal counts)
    std::vector<int64_t> owner;   // per position < S: its CP rank
    at::Tensor order;             // per position: its index in the rank-order concatenation
  };
  std::map<const model::Inputs*, CpLayout> cp_layouts;  // this step's, per microbatch

  const CpLayout& cp_layout(const model::Inputs& in) {
    auto it = cp_layouts.find(&in);
    if (it != cp_layouts.end()) return it->second;
    const int64_t cp = llm_plan->layout.cp, S0 = in.tokens.size(1);
    const plan::CpPolicy policy = plan::parse_cp_policy(plan.cp_split);
    const bool simple = policy == plan::CpPolicy::kContiguous || policy == plan::CpPolicy::kZigzag;
    const int64_t blocks = (simple ? 2 : 4) * cp,
                  block = std::max<int64_t>(1, (S0 + blocks - 1) / blocks);
    const plan::CpCostModel cost = plan::make_cp_cost_model(spec.llm);
    std::vector<double> work;
    const auto doc = in.doc.accessor<int32_t, 2>();
    const auto item = in.item.accessor<int32_t, 2>();
    for (int64_t b = 0; b < in.doc.size(0); ++b) {
      plan::SequenceDesc seq;
      for (int64_t j = 0; j < S0; ++j) seq.tokens.push_back({doc[b][j], item[b][j]});
      const std::vector<double> w = plan::block_work(seq, block, cost);
      if (work.empty()) work.assign(w.size(), 0.0);
      for (size_t k = 0; k < w.size(); ++k) work[k] += w[k];
    }
    const auto assigned = plan::assign_blocks(work, cp, policy);
    double total = 0, most_work = 0;
    for (const auto& blocks : assigned) {
      double w = 0;
      for (int64_t k : blocks) w += work[k];
      total += w;
      most_work = std::max(most_work, w);
    }
    if (total > 0) times.cp_imbalance = std::max(times.cp_imbalance, most_work * cp / total);
    CpLayout l;
    std::vector<std::vector<int64_t>> own(static_cast<size_t>(cp));
    size_t most = 0;
    for (int64_t r = 0; r < cp; ++r) {
      for (int64_t k : assigned[r])
        for (int64_t j = k * block; j < std::min((k + 1) * block, S0); ++j) own[r].push_back(j);
      most = std::max(most, own[r].size());
    }
    most = (most + seq_split - 1) / seq_split * seq_split;  // sequence parallelism splits it again
    int64_t next = S0;
    for (auto& o : own)
      while (o.size() < most) o.push_back(next++);
    l.S = next;
    l.owner.assign(static_cast<size_t>(l.S), 0);
    for (int64_t r = 0; r < cp; ++r) {
      for (int64_t j : own[r]) l.owner[j] = r;
      l.own.push_back(torch::tensor(own[r], torch::kLong).to(opts.device));
    }
    l.order = torch::argsort(torch::cat(l.own));
    return cp_layouts.emplace(&in, std::move(l)).first->second;
  }

  // Under CP the bridge sends each LLM CP rank only the features of the placeholder positions
  // it owns: of feature rows [r0, r1) of encoder e in `in` (one replica's microbatch), the
  // indices (relative to r0) that CP rank c owns. Undefined without CP (every row).
  std::map<std::tuple<const model::Inputs*, size_t, int64_t, int64_t, int64_t>, at::Tensor>
      bridge_rows_cache;  // this step's (posting ahead asks again)
  at::Tensor bridge_rows(const model::Inputs& in, size_t e, int64_t r0, int64_t r1, int64_t c) {
    if (llm_plan->layout.cp == 1) return {};
    at::Tensor& cached = bridge_rows_cache[{&in, e, r0, r1, c}];
    if (!cached.defined()) cached = compute_bridge_rows(in, e, r0, r1, c);
    return cached;
  }
  at::Tensor compute_bridge_rows(const model::Inputs& in, size_t e, int64_t r0, int64_t r1,
                                 int64_t c) {
    const int64_t S0 = in.tokens.size(1);
    const CpLayout& layout = cp_layout(in);
    const at::Tensor rows = in.encoder_rows[e].narrow(0, r0, r1 - r0);
    const auto acc = rows.accessor<int64_t, 1>();
    std::vector<int64_t> keep;
    for (int64_t r = 0; r < rows.numel(); ++r)
      if (layout.owner[acc[r] % S0] == c) keep.push_back(r);
    return torch::tensor(keep, torch::kLong).to(opts.device);
  }
  static at::Tensor select_rows(const at::Tensor& t, const at::Tensor& idx) {
    return idx.defined() ? t.index_select(0, idx) : t;
  }

  // Per encoder and microbatch: what backward needs.
  struct EncoderSaved {
    at::Tensor input, output;  // input requires grad on later stages when the encoder trains
  };

  int64_t enc_tokens(size_t e) const { return spec.encoders[e].tokens_per_item(); }

  // The global items [begin, end) of microbatch m that encoder e's data-parallel rank i runs.
  // When one DP size divides the other, whole replicas map to encoder ranks (fan-in) or a
  // replica's items split over several (fan-out), so equal DP exchanges nothing; otherwise
  // the items are split evenly. (plan::encoder_share prices this split for the simulator.)
  std::pair<int64_t, int64_t> encoder_range(const ItemLayout& items, size_t e, int64_t i) const {
    const int64_t edp = enc_plan[e]->layout.dp, D = static_cast<int64_t>(items.count.size());
    if (D % edp == 0) {
      const int64_t k = D / edp;
      return {items.offset[i * k], items.offset[(i + 1) * k - 1] + items.count[(i + 1) * k - 1]};
    }
    if (edp % D == 0) {
      const int64_t k = edp / D, d = i / k;
      const auto [a, b] = even_part(items.count[d], k, i % k);
      return {items.offset[d] + a, items.offset[d] + b};
    }
    return even_part(items.total, edp, i);
  }

  // ---- pipeline messages: what each op receives, so it can be posted ahead ------------------

  // Activations into encoder e's stage (not the first) for microbatch m.
  Msg encoder_input_msg(size_t e, int64_t m, const std::vector<std::vector<model::Inputs>>& batch) {
    const ModulePlan& mp = *enc_plan[e];
    const Role& role = enc_role[e];
    if (!role.hosted || role.first) return {};
    const auto [a, b] = encoder_range(items_of(batch, e, m), e, role.c.dp);
    const int64_t split = mp.layout.cp * (mp.layout.sequence_parallel() ? mp.layout.tp : 1);
    return {{b - a, spec.encoders[e].block_tokens() / split, spec.encoders[e].hidden},
            model::compute_dtype(),
            mp.rank_of({role.c.tp, role.c.cp, role.c.dp, role.c.pp - 1}),
            tag_of(kEncAct, static_cast<int64_t>(e), m, role.c.pp)};
  }
  // Gradients into encoder e's stage (not the last) for microbatch m, after its forward.
  Msg encoder_grad_msg(size_t e, int64_t m, const EncoderSaved& saved) {
    const ModulePlan& mp = *enc_plan[e];
    const Role& role = enc_role[e];
    if (!role.hosted || role.last || !saved.output.defined()) return {};
    return {saved.output.sizes().vec(), saved.output.scalar_type(),
            mp.rank_of({role.c.tp, role.c.cp, role.c.dp, role.c.pp + 1}),
            tag_of(kEncGrad, static_cast<int64_t>(e), m, role.c.pp)};
  }
  // The LLM's sequence length for microbatch `in`, with the padding positions that make it divide
  // over CP and sequence parallelism.
  int64_t llm_tokens(const model::Inputs& in) {
    if (llm_plan->layout.cp > 1) return cp_layout(in).S;
    const int64_t S0 = in.tokens.size(1);
    return (S0 + seq_split - 1) / seq_split * seq_split;
  }
  // This CP rank's share of them (under sequence parallelism split again over TP).
  int64_t llm_local_tokens(const model::Inputs& in) {
    return llm_plan->layout.cp > 1 ? cp_layout(in).own[llm_role.c.cp].numel() : llm_tokens(in);
  }

  // The LLM's (virtual) stage of this rank's chunk `chunk` (plan.h Layout::vp), and the rank of
  // the same (tp, cp, dp) that runs (virtual) stage `stage`.
  int64_t llm_stage(int64_t chunk) const { return chunk * llm_plan->layout.pp + llm_role.c.pp; }
  bool llm_last_stage(int64_t stage) const { return stage == llm_plan->layout.stages() - 1; }
  int64_t llm_rank_of_stage(int64_t stage) const {
    const Coord& c = llm_role.c;
    return llm_plan->rank_of({c.tp, c.cp, c.dp, stage % llm_plan->layout.pp});
  }
  // Activations into the LLM's chunk (not the first stage) for microbatch m: this CP rank's
  // tokens (under sequence parallelism, this TP rank's part of them).
  Msg llm_input_msg(int64_t m, int64_t chunk,
                    const std::vector<std::vector<model::Inputs>>& batch) {
    const int64_t stage = llm_stage(chunk);
    if (!llm_role.hosted || stage == 0) return {};
    const model::Inputs& in = batch[llm_role.c.dp][m];
    return {{in.tokens.size(0), llm_local_tokens(in) / seq_split, spec.llm.hidden},
            model::compute_dtype(),
            llm_rank_of_stage(stage - 1),
            tag_of(kLlmAct, 0, m, stage)};
  }

  // One message of the bridge: feature rows [r0, r1) of an encoder's items of one replica's
  // microbatch (under LLM CP: of those, the rows idx that one CP rank owns).
  struct BridgePart {
    Msg msg;
    int64_t r0 = 0, r1 = 0;
    at::Tensor idx;             // undefined: every row
    bool replica_done = false;  // bridge_grad_in: the last message of its replica
  };
  // What the LLM's first stage receives of encoder e's features for microbatch m: from every
  // encoder DP rank holding some of its replica's items, in order; under CP only the rows of the
  // placeholders this CP rank owns.
  std::vector<BridgePart> bridge_in(size_t e, int64_t m,
                                    const std::vector<std::vector<model::Inputs>>& batch) {
    std::vector<BridgePart> out;
    const Role& role = llm_role;
    if (!role.hosted || !role.first) return out;
    const int64_t d = role.c.dp, T = enc_tokens(e);
    const ItemLayout items = items_of(batch, e, m);
    const ModulePlan& mp = *enc_plan[e];
    for (int64_t i = 0; i < mp.layout.dp; ++i) {
      const auto [a, b] = encoder_range(items, e, i);
      const int64_t lo = std::max(a, items.offset[d]);
      const int64_t hi = std::min(b, items.offset[d] + items.count[d]);
      if (lo >= hi) continue;
      BridgePart p;
      p.r0 = (lo - items.offset[d]) * T, p.r1 = (hi - items.offset[d]) * T;
      p.idx = bridge_rows(batch[d][m], e, p.r0, p.r1, role.c.cp);
      p.msg = {{p.idx.defined() ? p.idx.numel() : p.r1 - p.r0, spec.llm.hidden},
               model::compute_dtype(),
               mp.rank_of({0, 0, i, mp.layout.pp - 1}),
               tag_of(kBridge, static_cast<int64_t>(e), m, 0)};
      out.push_back(std::move(p));
    }
    return out;
  }
  // What encoder e's last stage receives of its features' gradients for microbatch m (after its
  // forward): per replica holding some of its items, from tp-rank 0 of each LLM CP rank.
  std::vector<BridgePart> bridge_grad_in(size_t e, int64_t m,
                                         const std::vector<std::vector<model::Inputs>>& batch,
                                         const EncoderSaved& saved) {
    std::vector<BridgePart> out;
    const Role& role = enc_role[e];
    if (!role.hosted || !role.last || !saved.output.defined()) return out;
    const ItemLayout items = items_of(batch, e, m);
    const auto [a, b] = encoder_range(items, e, role.c.dp);
    const int64_t T = enc_tokens(e);
    for (size_t d = 0; d < items.count.size(); ++d) {
      const int64_t lo = std::max(a, items.offset[d]);
      const int64_t hi = std::min(b, items.offset[d] + items.count[d]);
      if (lo >= hi) continue;
      for (int64_t cp = 0; cp < llm_plan->layout.cp; ++cp) {
        BridgePart p;
        p.r0 = (lo - items.offset[d]) * T, p.r1 = (hi - items.offset[d]) * T;
        p.idx = bridge_rows(batch[d][m], e, p.r0, p.r1, cp);
        p.msg = {{p.idx.defined() ? p.idx.numel() : p.r1 - p.r0, spec.llm.hidden},
                 saved.output.scalar_type(),
                 llm_plan->rank_of({0, cp, static_cast<int64_t>(d), 0}),
                 tag_of(kBridgeGrad, static_cast<int64_t>(e), m, 0)};
        p.replica_done = cp + 1 == llm_plan->layout.cp;
        out.push_back(std::move(p));
      }
    }
    return out;
  }

  // Forward of encoder e's stage on this rank for microbatch m.
  EncoderSaved encoder_forward(size_t e, int64_t m,
                               const std::vector<std::vector<model::Inputs>>& batch) {
    const ModulePlan& mp = *enc_plan[e];
    const ModulePlan& pp = *proj_plan[e];
    const Role& role = enc_role[e];
    const ItemLayout items = items_of(batch, e, m);
    const auto [a, b] = encoder_range(items, e, role.c.dp);
    EncoderSaved saved;
    if (a == b) return saved;
    Span span{this, op_name(spec.encoders[e].name, "fwd", m, role.c.pp), "forward"};
    const int64_t T = enc_tokens(e);
    at::Tensor x;
    if (role.first) {  // items [a, b) from the replicas' loaded inputs
      std::vector<at::Tensor> parts;
      for (size_t d = 0; d < batch.size(); ++d) {
        const int64_t lo = std::max(a, items.offset[d]);
        const int64_t hi = std::min(b, items.offset[d] + items.count[d]);
        if (lo >= hi) continue;
        const model::Inputs& in = batch[d][m];
        const at::Tensor& loaded = in.encoder_inputs[e];
        const int64_t first = in.encoder_first.empty() ? 0 : in.encoder_first[e];
        const int64_t from = lo - items.offset[d] - first;
        WEFT_CHECK(loaded.defined() && from >= 0 && from + (hi - lo) <= loaded.size(0), "encoder '",
                   spec.encoders[e].name, "', microbatch ", m, ": replica ", d, "'s items [",
                   lo - items.offset[d], ", ", hi - items.offset[d], ") are not loaded on rank ",
                   world.rank());
        parts.push_back(loaded.narrow(0, from, hi - lo));
      }
      x = model::to_device(parts.size() == 1 ? parts[0] : torch::cat(parts, 0), opts.device);
    } else {
      x = recv(encoder_input_msg(e, m, batch));
      if (grads(mp.weight_grads)) x.set_requires_grad(true);
    }
    at::Tensor y;
    {
      torch::AutoGradMode grad(grads(mp.weight_grads));
      y = (*model->encoder(e))(x);
    }
    if (role.last) {  // projector per token, then every item's tokens from the CP ranks
      torch::AutoGradMode grad(grads(pp.needs_backward()));
      y = gather_replicated((*model->projector(e))(y), model->hosting().encoders[e].shard.cp, 1);
    }
    saved.input = x;
    saved.output = y;
    if (!role.last) {
      send(y, mp.rank_of({role.c.tp, role.c.cp, role.c.dp, role.c.pp + 1}),
           tag_of(kEncAct, static_cast<int64_t>(e), m, role.c.pp + 1));
    } else if (role.c.tp == 0 && role.c.cp == 0) {  // bridge: items to their first LLM stage
      const at::Tensor flat = y.reshape({(b - a) * T, spec.llm.hidden});
      for (size_t d = 0; d < items.count.size(); ++d) {
        const int64_t lo = std::max(a, items.offset[d]);
        const int64_t hi = std::min(b, items.offset[d] + items.count[d]);
        if (lo >= hi) continue;
        const at::Tensor part = flat.narrow(0, (lo - a) * T, (hi - lo) * T).detach();
        const int64_t r0 = (lo - items.offset[d]) * T, r1 = (hi - items.offset[d]) * T;
        for (int64_t cp = 0; cp < llm_plan->layout.cp; ++cp) {
          const at::Tensor mine = select_rows(part, bridge_rows(batch[d][m], e, r0, r1, cp));
          for (int64_t tp = 0; tp < llm_plan->layout.tp; ++tp)
            send(mine, llm_plan->rank_of({tp, cp, static_cast<int64_t>(d), 0}),
                 tag_of(kBridge, static_cast<int64_t>(e), m, 0));
        }
      }
    }
    return saved;
  }

  // Backward of encoder e's stage for microbatch m.
  void encoder_backward(size_t e, int64_t m, const std::vector<std::vector<model::Inputs>>& batch,
                        EncoderSaved& saved) {
    const ModulePlan& mp = *enc_plan[e];
    const Role& role = enc_role[e];
    const ItemLayout items = items_of(batch, e, m);
    const auto [a, b] = encoder_range(items, e, role.c.dp);
    if (a == b) return;
    Span span{this, op_name(spec.encoders[e].name, "bwd", m, role.c.pp), "backward"};
    at::Tensor grad;
    if (role.last) {  // from the first LLM stage: tp-rank 0 of each CP rank, its own rows
      std::vector<at::Tensor> parts;
      at::Tensor part;  // of one replica, from its CP ranks in order
      for (const BridgePart& from : bridge_grad_in(e, m, batch, saved)) {
        at::Tensor g = recv(from.msg);
        if (!from.idx.defined()) {
          part = g;
        } else {
          if (!part.defined())
            part = torch::zeros({from.r1 - from.r0, spec.llm.hidden}, g.options());
          part.index_copy_(0, from.idx, g);
        }
        if (from.replica_done) parts.push_back(std::exchange(part, {}));
      }
      grad = torch::cat(parts, 0).view(saved.output.sizes());
    } else {
      grad = recv(encoder_grad_msg(e, m, saved));
    }
    if (saved.output.requires_grad()) saved.output.backward(grad);
    if (!role.first && mp.weight_grads) {
      at::Tensor g = saved.input.grad();
      if (!g.defined()) g = torch::zeros_like(saved.input);
      send(g, mp.rank_of({role.c.tp, role.c.cp, role.c.dp, role.c.pp - 1}),
           tag_of(kEncGrad, static_cast<int64_t>(e), m, role.c.pp - 1));
    }
    saved = {};
  }

  // The LLM's view of one microbatch on this CP rank.
  struct LlmSaved {
    at::Tensor input;                  // received activations (later stages) or undefined
    std::vector<at::Tensor> features;  // first stage: per encoder, received features (leaves)
    at::Tensor output;                 // activations sent on, or the loss on the last stage
  };
  // Gradients into the LLM's chunk (not the last stage) for microbatch m, after its forward.
  Msg llm_grad_msg(int64_t m, int64_t chunk, const LlmSaved& saved) {
    const int64_t stage = llm_stage(chunk);
    if (!llm_role.hosted || llm_last_stage(stage) || !saved.output.defined()) return {};
    return {saved.output.sizes().vec(), saved.output.scalar_type(), llm_rank_of_stage(stage + 1),
            tag_of(kLlmGrad, 0, m, stage)};
  }

  // Pads a microbatch's token dimension to `S` (padding tokens see only themselves).
  static model::Inputs padded(const model::Inputs& in, int64_t S) {
    const int64_t s = in.tokens.size(1);
    if (s == S) return in;
    model::Inputs out = in;
    auto pad = [&](const at::Tensor& t, int64_t v) {
      return torch::constant_pad_nd(t, {0, S - s}, static_cast<double>(v));
    };
    out.tokens = pad(in.tokens, 0);
    out.positions = pad(in.positions, 0);
    out.doc = pad(in.doc, -1);
    out.item = pad(in.item, -1);
    const int64_t B = in.tokens.size(0);
    auto remap = [&](const at::Tensor& rows) {  // b*s + j → b*S + j
      return rows.defined() ? (rows.div(s, "floor") * S + rows.remainder(s)) : rows;
    };
    for (auto& r : out.encoder_rows) r = remap(r);
    out.target_rows = remap(in.target_rows);
    (void)B;
    return out;
  }

  // Forward of microbatch m through this rank's LLM chunk `chunk`.
  // What a rank's chunks share for one microbatch: its padded inputs on the device, its CP
  // share, and the LLM context (RoPE tables, prepared mask, attention tiles), built by the
  // microbatch's first forward here (its chunk 0) and dropped after its last chunk's forward
  // (autograd keeps what the backwards need).
  struct LlmMicrobatch {
    model::Inputs in;
    at::Tensor own;  // CP: this rank's token positions; undefined without CP
    int64_t S = 0, Sl = 0;
    model::LlmContext context;
    model::TokenInfo tokens;  // for MoE blocks
  };
  std::map<int64_t, LlmMicrobatch> llm_microbatches;

  const LlmMicrobatch& llm_microbatch(int64_t m, const model::Inputs& inputs, int64_t batch_rows) {
    auto it = llm_microbatches.find(m);
    if (it != llm_microbatches.end()) return it->second;
    const ModulePlan& lp = *llm_plan;
    const int64_t cp = lp.layout.cp;
    const CpLayout* layout = cp > 1 ? &cp_layout(inputs) : nullptr;
    LlmMicrobatch mb;
    mb.S = llm_tokens(inputs);
    const model::Inputs host = padded(inputs, mb.S);
    mb.in = model::to_device(host, opts.device);
    model::AttentionMask mask{model::visible_mask(mb.in.doc, mb.in.item), {}};
    // Query blocks and key tiles (model/chunked_attention.h), from the host's descriptors: no
    // device read. Not under CP, nor where LibTorch has no kernel for some kind of tile here
    // (1.13, whose own attention skips hidden blocks itself; GPUs, dtypes or head sizes beyond
    // the kernels' limits).
    if (!layout && spec.llm.attention_chunk > 0 &&
        model::chunked_attention_has_kernels(opts.device, model::compute_dtype(),
                                             spec.llm.head_dim()))
      mask.chunks = model::attention_chunks(host.doc, host.item, spec.llm.attention_chunk);
    at::Tensor positions = mb.in.positions;
    if (layout) {
      mb.own = layout->own[llm_role.c.cp];
      mask.visible = mask.visible.index_select(2, mb.own);
      mask.kv_order = layout->order;
      positions = positions.index_select(1, mb.own);
    }
    mb.Sl = mb.own.defined() ? mb.own.numel() : mb.S;
    if (spec.llm.moe.enabled()) {
      mb.tokens.valid = mb.in.doc >= 0;
      if (mb.own.defined()) mb.tokens.valid = mb.tokens.valid.index_select(1, mb.own);
      mb.tokens.index = mb.own;
      mb.tokens.row_length = mb.S;
      mb.tokens.aux_scale = 1.0 / static_cast<double>(batch_rows);
      mb.tokens.stats = &moe_stats;
    }
    if (prefilling) mask.keep_kv = &start_decoding(m, host, mb.S);
    const at::Tensor like =
        at::empty({0}, at::TensorOptions().dtype(model::compute_dtype()).device(opts.device));
    mb.context = model->llm().context(positions, mask, like);
    return llm_microbatches.emplace(m, std::move(mb)).first->second;
  }

  LlmSaved llm_forward(int64_t m, int64_t chunk,
                       const std::vector<std::vector<model::Inputs>>& batch, int64_t targets,
                       int64_t batch_rows, at::Tensor* loss_out) {
    const ModulePlan& lp = *llm_plan;
    const Role& role = llm_role;
    const int64_t stage = llm_stage(chunk);
    const bool first = stage == 0, last = llm_last_stage(stage);
    Span span{this, op_name("llm", "fwd", m, stage), "forward"};
    const int64_t d = role.c.dp;
    const LlmMicrobatch& mb = llm_microbatch(m, batch[d][m], batch_rows);
    // Its last chunk here: later ops of this microbatch on this rank are backwards.
    struct Drop {
      std::map<int64_t, LlmMicrobatch>* all;
      int64_t m;
      bool now;
      ~Drop() {
        if (now) all->erase(m);
      }
    } drop{&llm_microbatches, m, chunk + 1 == static_cast<int64_t>(model->llm().chunks.size())};
    const model::Inputs& in = mb.in;
    const at::Tensor& own = mb.own;
    const int64_t S = mb.S, Sl = mb.Sl, B = in.tokens.size(0), H = spec.llm.hidden;
    const model::TokenInfo& tokens = mb.tokens;
    torch::AutoGradMode grad(grads(lp.needs_backward()));
    LlmSaved saved;
    at::Tensor x;
    if (first) {
      std::vector<at::Tensor> rows = in.encoder_rows;
      for (size_t e = 0; e < spec.encoders.size(); ++e) {
        saved.features.emplace_back();
        const std::vector<BridgePart> in_parts = bridge_in(e, m, batch);
        if (in_parts.empty()) continue;
        std::vector<at::Tensor> parts, part_rows;
        for (const BridgePart& part : in_parts) {
          parts.push_back(recv(part.msg));
          part_rows.push_back(select_rows(rows[e].narrow(0, part.r0, part.r1 - part.r0), part.idx));
        }
        rows[e] = torch::cat(part_rows, 0);
        at::Tensor f = parts.size() == 1 ? parts[0] : torch::cat(parts, 0);
        if (grads(proj_plan[e]->needs_backward())) f = f.detach().set_requires_grad(true);
        saved.features.back() = f;
      }
      {
        // One stage: the loss below reads a tied table through the head in this same graph.
        std::optional<model::Llm::TiedHeadInGraph> tied;
        if (last) tied.emplace();
        x = model->embed_with(in.tokens, saved.features, rows);
      }
      if (own.defined()) x = x.index_select(1, own);
      if (seq_split > 1) x = dist::split_replicated(x, model->llm().tp, 1);
    } else {
      x = recv(llm_input_msg(m, chunk, batch));
      WEFT_ASSERT(x.size(0) == B && x.size(1) == Sl / seq_split, "llm input of microbatch ", m);
      if (grads(lp.needs_backward())) x.set_requires_grad(true);
      saved.input = x;
    }
    at::Tensor h = model->llm().forward(x, mb.context, tokens, static_cast<size_t>(chunk));
    if (!last) {
      send(h, llm_rank_of_stage(stage + 1), tag_of(kLlmAct, 0, m, stage + 1));
      saved.output = h;
      return saved;
    }
    // Loss on this rank's own target rows (every TP rank's: the loss is vocab-parallel).
    if (seq_split > 1) h = dist::gather_replicated(h, model->llm().tp, 1);
    at::Tensor rows = in.target_rows, tgt = in.targets, keep;
    if (own.defined()) {
      at::Tensor local = torch::full({S}, -1, own.options());
      local.index_put_({own}, torch::arange(Sl, own.options()));
      at::Tensor pos = local.index_select(0, rows.remainder(S));
      keep = pos >= 0;
      rows = (rows.div(S, "floor") * Sl + pos).masked_select(keep);
      tgt = tgt.masked_select(keep);
    }
    at::Tensor flat = h.reshape({B * Sl, H}).index_select(0, rows);
    if (predict_vocab > 0) {  // eval_next_tokens (every TP rank: the vocabulary is split)
      at::Tensor logprob;
      const at::Tensor ids =
          model->llm().greedy(flat, predict_vocab, want_logprob ? &logprob : nullptr);
      if (role.c.tp == 0) {
        at::Tensor index = torch::arange(in.targets.numel(), in.targets.options().dtype(at::kLong));
        if (keep.defined()) index = index.masked_select(keep);
        predictions.push_back({index + target_offsets[d][m], ids, logprob});
      }
      return saved;
    }
    at::Tensor loss = model->llm().loss_sum(flat, tgt) / static_cast<double>(targets);
    if (role.c.tp ==
        0) {  // summed in double where it is: one host read per step, not per microbatch
      const at::Tensor l = loss.detach().to(at::kDouble);
      *loss_out = loss_out->defined() ? *loss_out + l : l;
    }
    saved.output = loss;
    return saved;
  }

  // Backward of microbatch m through this rank's LLM chunk `chunk`.
  void llm_backward(int64_t m, int64_t chunk, const std::vector<std::vector<model::Inputs>>& batch,
                    LlmSaved& saved) {
    const Role& role = llm_role;
    const int64_t stage = llm_stage(chunk);
    Span span{this, op_name("llm", "bwd", m, stage), "backward"};
    const int64_t d = role.c.dp;
    if (llm_last_stage(stage)) {
      if (saved.output.requires_grad()) saved.output.backward();
    } else {
      at::Tensor g = recv(llm_grad_msg(m, chunk, saved));
      if (saved.output.requires_grad()) saved.output.backward(g);
    }
    if (stage > 0) {
      at::Tensor g = saved.input.grad();
      if (!g.defined()) g = torch::zeros_like(saved.input);
      send(g, llm_rank_of_stage(stage - 1), tag_of(kLlmGrad, 0, m, stage - 1));
    } else if (role.c.tp == 0) {  // bridge backward: feature gradients to the encoder ranks
      for (size_t e = 0; e < spec.encoders.size(); ++e) {
        const at::Tensor& f = saved.features[e];
        if (!f.defined() || !f.requires_grad()) continue;
        at::Tensor g = f.grad().defined() ? f.grad() : torch::zeros_like(f);
        const ItemLayout items = items_of(batch, e, m);
        const ModulePlan& mp = *enc_plan[e];
        const int64_t T = enc_tokens(e);
        int64_t offset = 0;  // this rank's rows come in encoder-rank order
        for (int64_t i = 0; i < mp.layout.dp; ++i) {
          const auto [a, b] = encoder_range(items, e, i);
          const int64_t lo = std::max(a, items.offset[d]);
          const int64_t hi = std::min(b, items.offset[d] + items.count[d]);
          if (lo >= hi) continue;
          const int64_t r0 = (lo - items.offset[d]) * T, r1 = (hi - items.offset[d]) * T;
          const at::Tensor idx = bridge_rows(batch[d][m], e, r0, r1, role.c.cp);
          const int64_t n = idx.defined() ? idx.numel() : r1 - r0;
          const at::Tensor part = g.narrow(0, offset, n);
          offset += n;
          for (int64_t cp = 0; cp < mp.layout.cp; ++cp)
            for (int64_t tp = 0; tp < mp.layout.tp; ++tp)
              send(part, mp.rank_of({tp, cp, i, mp.layout.pp - 1}),
                   tag_of(kBridgeGrad, static_cast<int64_t>(e), m, 0));
        }
      }
    }
    saved = {};
  }

  at::Tensor step(const std::vector<std::vector<model::Inputs>>& batch, int64_t targets) {
    const int64_t M = static_cast<int64_t>(batch.at(0).size());
    WEFT_CHECK(static_cast<int64_t>(batch.size()) == llm_plan->layout.dp, "step: ", batch.size(),
               " data-parallel parts for an LLM with dp = ", llm_plan->layout.dp);
    // After a step that failed part way (its error went up to the caller): self messages are
    // dropped, but receives or sends still in flight with other ranks cannot be taken back.
    mailbox.clear();
    WEFT_CHECK(posted.empty() && sends.empty(), "rank ", rank,
               ": a step cannot start while messages of a failed earlier step are in flight");
    times = {};
    trace.clear();
    step_t0 = now();
    const double blocked0 = blocked_seconds();
    cp_layouts.clear();
    bridge_rows_cache.clear();
    if (llm_plan->layout.cp > 1)  // every microbatch's split, so every rank knows the balance
      for (const auto& replica : batch)
        for (const model::Inputs& in : replica) cp_layout(in);
    at::Tensor loss;  // this rank's share of the loss (double, on the device)
    // One cast of each parameter for all microbatches and pipeline ops of the step, made at its
    // first use in grad mode, and dropped when the last backward is done (before the gradient
    // reductions). One microbatch has nothing to share: without a scope each cast goes as soon
    // as its backward has passed, while the gradients are being allocated.
    std::optional<model::CastOnce> casts;
    if (opts.cast_once && M > 1 && !forward_only)
      casts.emplace(model->parameters(), model::CastOnce::Keep::kForBackward);
    // Data-parallel gradients accumulate straight into their all-reduce buckets.
    if (!forward_only) {
      for (size_t e = 0; e < enc_sync.size(); ++e)
        if (enc_role[e].hosted) enc_sync[e].sync->attach();
      if (llm_role.hosted) llm_sync.sync->attach();
      if (llm_role.hosted && expert_parallel) expert_sync.sync->attach();
    }
    const size_t E = spec.encoders.size();
    int64_t rows = 0;  // of the global batch (MoE auxiliary losses are a mean over rows)
    for (const auto& replica : batch)
      for (const model::Inputs& in : replica) rows += in.tokens.size(0);
    moe_stats.clear();
    // Receives are posted up to kAhead ops before the op that reads them (see `posted`).
    constexpr int64_t kAhead = 2;
    auto post_llm_input = [&](int64_t m, int64_t chunk) {  // activations, or features
      post(llm_input_msg(m, chunk, batch));
      if (chunk == 0)
        for (size_t e = 0; e < E; ++e) post(bridge_in(e, m, batch));
    };
    std::vector<std::vector<EncoderSaved>> enc_saved(E);
    // Whether encoder e's stage here runs backward: the last stage gets gradients when the
    // projector needs backward; earlier stages only when the encoder itself trains.
    auto encoder_backward_runs = [&](size_t e) {
      return enc_role[e].hosted && !forward_only &&
             (enc_role[e].last ? proj_plan[e]->needs_backward() : enc_plan[e]->weight_grads);
    };
    auto post_encoder_grad = [&](size_t e, int64_t m) {
      if (!encoder_backward_runs(e) || m >= static_cast<int64_t>(enc_saved[e].size())) return;
      post(encoder_grad_msg(e, m, enc_saved[e][m]));
      post(bridge_grad_in(e, m, batch, enc_saved[e][m]));
    };
    // 1. Encoders forward (every microbatch), features over the bridge.
    for (int64_t m = 0; m < std::min(M, kAhead); ++m) {
      post_llm_input(m, 0);
      for (size_t e = 0; e < E; ++e) post(encoder_input_msg(e, m, batch));
    }
    for (size_t e = 0; e < E; ++e) {
      if (!enc_role[e].hosted) continue;
      for (int64_t m = 0; m < M; ++m) {
        if (m + kAhead < M) post(encoder_input_msg(e, m + kAhead, batch));
        enc_saved[e].push_back(encoder_forward(e, m, batch));
      }
    }
    // The first encoder gradients can arrive while this rank runs the LLM.
    for (size_t e = 0; e < E; ++e)
      for (int64_t m = 0; m < std::min(M, kAhead); ++m) post_encoder_grad(e, m);
    // 2. LLM: 1F1B over its stages, interleaved over its chunks under virtual stages
    // (plan::pipeline_schedule; forwards only when the LLM needs no backward).
    if (llm_role.hosted) {
      const plan::Layout& l = llm_plan->layout;
      const std::vector<plan::PipelineOp> ops =
          plan::pipeline_schedule(l.pp, l.vp, M, llm_role.c.pp, grads(llm_plan->needs_backward()));
      llm_microbatches.clear();  // nothing left from a step that failed part-way
      std::vector<LlmSaved> saved(static_cast<size_t>(M * l.vp));  // [chunk · M + microbatch]
      const auto saved_of = [&](const plan::PipelineOp& op) -> LlmSaved& {
        return saved[static_cast<size_t>(op.chunk * M + op.microbatch)];
      };
      for (size_t i = 0; i < ops.size(); ++i) {
        for (size_t j = i; j < std::min(ops.size(), i + kAhead + 1); ++j) {
          if (ops[j].forward)
            post_llm_input(ops[j].microbatch, ops[j].chunk);
          else
            post(llm_grad_msg(ops[j].microbatch, ops[j].chunk, saved_of(ops[j])));
        }
        const plan::PipelineOp& op = ops[i];
        if (op.forward) {
          saved_of(op) = llm_forward(op.microbatch, op.chunk, batch, targets, rows, &loss);
          continue;
        }
        // A chunk's last backward completes its parameters' gradients: their buckets start
        // as they fill (in bucket order), while backward goes on.
        if (op.microbatch == M - 1 && opts.overlap_grad_reduce) {
          if (llm_chunk_params.empty()) {
            llm_sync.sync->arm();
            if (expert_parallel) expert_sync.sync->arm();
          } else {
            llm_sync.sync->arm(llm_chunk_params[static_cast<size_t>(op.chunk)]);
            if (expert_parallel)
              expert_sync.sync->arm(expert_chunk_params[static_cast<size_t>(op.chunk)]);
          }
        }
        llm_backward(op.microbatch, op.chunk, batch, saved_of(op));
      }
    }
    // 3. Encoders backward, in microbatch order.
    for (size_t e = 0; e < E; ++e) {
      if (!encoder_backward_runs(e)) continue;
      for (int64_t m = 0; m < M; ++m) {
        post_encoder_grad(e, m + kAhead);
        if (m == M - 1 && opts.overlap_grad_reduce) enc_sync[e].sync->arm();
        encoder_backward(e, m, batch, enc_saved[e][m]);
      }
    }
    casts.reset();
    // ZeRO-1: the parameter values no forward read (a module without items), before the gradient
    // reductions.
    finish_param_gathers();
    for (const SyncGroup* g : syncs())
      times.param_wait_seconds += g->sync->take_gather_wait_seconds();
    for (Pending& p : sends) p.wait();
    sends.clear();
    WEFT_ASSERT(mailbox.empty(), "undelivered self messages");
    WEFT_ASSERT(posted.empty(), posted.size(), " posted receives not read");
    // (Less the waits for parameters in flight, which Comm counts too: param_wait_seconds.)
    times.collective_wait_seconds =
        std::max(0.0, blocked_seconds() - blocked0 - times.param_wait_seconds);
    // 4. Gradients: data x context parallel sums per module (ZeRO-1: reduce-scatters), then tied
    // embedding copies.
    if (forward_only) return loss_sum_of(loss);
    const double t0 = now();
    const std::string reduction = opts.zero1 ? " grad reduce-scatter" : " grad all-reduce";
    for (size_t e = 0; e < enc_sync.size(); ++e) {
      if (!enc_role[e].hosted) continue;
      Span span{this, spec.encoders[e].name + reduction, "collective"};
      enc_sync[e].sync->finish();
      times.buckets_overlapped += enc_sync[e].sync->buckets_overlapped();
    }
    if (llm_role.hosted) {
      Span span{this, "llm" + reduction, "collective"};
      llm_sync.sync->finish();
      times.buckets_overlapped += llm_sync.sync->buckets_overlapped();
      if (expert_parallel) {
        expert_sync.sync->finish();
        times.buckets_overlapped += expert_sync.sync->buckets_overlapped();
      }
    }
    if (tied_index >= 0) {
      // Whole, or under ZeRO-1 the range both copies' ranks hold (none on either: nothing).
      const auto it = std::find_if(pieces.begin(), pieces.end(), [&](const ShardPiece& p) {
        return p.param == static_cast<size_t>(tied_index);
      });
      if (it != pieces.end() && it->grad.defined()) {
        tied.all_reduce_sum(it->grad);
      } else if (it != pieces.end()) {
        at::Tensor& g = trainable[tied_index].second.mutable_grad();
        if (!g.defined()) g = torch::zeros_like(trainable[tied_index].second);
        tied.all_reduce_sum(g);
      }
    }
    for (size_t k = 0; k < sequence_partial.size(); ++k) {  // after the DP sums (they commute)
      const PartialGrads& p = sequence_partial[k];
      if (p.params.empty()) continue;
      const std::string& module = k < spec.encoders.size() ? spec.encoders[k].name : "llm";
      Span span{this, module + " sequence-parallel grad all-reduce", "collective"};
      std::vector<at::Tensor> grads;
      for (size_t t : p.params) {
        at::Tensor& g = trainable[t].second.mutable_grad();
        if (!g.defined()) g = torch::zeros_like(trainable[t].second);
        grads.push_back(g.reshape({-1}));
      }
      at::Tensor flat = torch::cat(grads);
      p.tp.all_reduce_sum(flat);
      int64_t offset = 0;
      for (size_t t : p.params) {
        at::Tensor& g = trainable[t].second.mutable_grad();
        g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
        offset += g.numel();
      }
    }
    times.grad_sync_seconds = now() - t0;
    // The loss, and the routing statistics of an MoE LLM, summed over ranks in one reduction.
    // One rank alone keeps its loss on the device: nothing here waits for the device.
    const bool alone = world.size() == 1;
    const int64_t experts = spec.llm.moe.experts;
    std::vector<double> sums = {
        alone || !loss.defined() ? 0.0 : loss.item<double>(), moe_stats.balance, moe_stats.z,
        static_cast<double>(moe_stats.routed), static_cast<double>(moe_stats.dropped)};
    for (int64_t layer : routing.layers) {
      const auto it = moe_stats.load.find(layer);
      for (int64_t e = 0; e < experts; ++e)
        sums.push_back(it == moe_stats.load.end() ? 0.0 : static_cast<double>(it->second[e]));
    }
    at::Tensor total = torch::tensor(sums, torch::kDouble);
    if (!alone) world.all_reduce_sum(total);
    const auto v = total.accessor<double, 1>();
    if (!routing.layers.empty()) {
      const double blocks = static_cast<double>(routing.layers.size());
      routing.balance_loss = v[1] / blocks;
      routing.z_loss = v[2] / blocks;
      routing.routed = static_cast<int64_t>(v[3]);
      routing.dropped = static_cast<int64_t>(v[4]);
      routing.load.assign(routing.layers.size(), std::vector<int64_t>(experts));
      routing.imbalance = 1;
      for (size_t l = 0; l < routing.layers.size(); ++l) {
        double most = 0, sum = 0;
        for (int64_t e = 0; e < experts; ++e) {
          routing.load[l][e] = static_cast<int64_t>(v[5 + l * experts + e]);
          most = std::max(most, v[5 + l * experts + e]);
          sum += v[5 + l * experts + e];
        }
        if (sum > 0) routing.imbalance = std::max(routing.imbalance, most * experts / sum);
      }
    }
    if (!alone) return torch::scalar_tensor(v[0], torch::kDouble);
    if (!loss.defined())
      return torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(opts.device));
    return loss.detach().to(torch::kDouble);
  }

  // The loss sums of this rank's microbatches (defined on the LLM's last-stage TP-rank-0 ranks
  // only) summed over every rank, as a 0-dim double tensor: on the device with one rank.
  at::Tensor loss_sum_of(const at::Tensor& loss) const {
    if (world.size() == 1)
      return loss.defined()
                 ? loss.detach().to(torch::kDouble)
                 : torch::zeros({},
                                torch::TensorOptions().dtype(torch::kDouble).device(opts.device));
    at::Tensor total = torch::tensor({loss.defined() ? loss.item<double>() : 0.0}, torch::kDouble);
    world.all_reduce_sum(total);
    return total[0];
  }

  at::Tensor grad_squares() const {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const auto& [name, p] : trainable) grads.push_back(p.grad());
    return model::squares_each(grads, opts.device);
  }

  double grad_norm() {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const ShardPiece& p : pieces) {
      if (!p.grad.defined() && counted[p.param])
        grads.push_back(trainable[p.param].second.grad());
      else if (p.grad.defined() && counted_pieces[p.param])
        grads.push_back(p.grad);
    }
    at::Tensor total = torch::tensor({model::sum_squares(grads)}, torch::kDouble);
    world.all_reduce_sum(total);
    return std::sqrt(total.item<double>());
  }

  // Every sync group of this rank's modules.
  std::vector<const SyncGroup*> syncs() const {
    std::vector<const SyncGroup*> out;
    for (const auto& g : enc_sync) out.push_back(&g);
    out.push_back(&llm_sync);
    if (expert_parallel) out.push_back(&expert_sync);
    return out;
  }

  void after_optimizer_step() {
    for (const SyncGroup* g : syncs()) g->sync->gather_params(opts.overlap_param_gather);
  }

  // Waits for the parameter values still in flight (local).
  void finish_param_gathers() const {
    for (const SyncGroup* g : syncs()) g->sync->finish_gather();
  }

  // ZeRO-1: each per-trainable tensor of a sharded parameter (a gradient, an optimizer moment),
  // valid on this rank's pieces only (or undefined where it has none), becomes the whole on
  // every rank of its sync group: the pieces are summed over the group, everything else zero.
  // Collective.
  void whole_from_pieces(std::vector<at::Tensor>& values) const {
    WEFT_ASSERT(values.size() == trainable.size());
    torch::NoGradGuard no_grad;
    auto one = [&](const SyncGroup& g) {
      std::vector<int64_t> offset(g.params.size(), -1);
      int64_t total = 0;
      for (size_t i = 0; i < g.params.size(); ++i)
        if (g.sync->sharded(i))
          offset[i] = std::exchange(total, total + trainable[g.params[i]].second.numel());
      if (total == 0) return;
      at::Tensor flat =
          torch::zeros({total}, trainable[g.params[0]].second.options().dtype(at::kFloat));
      for (const ShardPiece& p : g.sync->pieces()) {
        const at::Tensor& v = values[g.params[p.param]];
        if (v.defined())
          flat.narrow(0, offset[p.param] + p.begin, p.length)
              .copy_(v.reshape({-1}).narrow(0, p.begin, p.length));
      }
      g.group.all_reduce_sum(flat);
      for (size_t i = 0; i < g.params.size(); ++i) {
        if (offset[i] < 0) continue;
        const at::Tensor& param = trainable[g.params[i]].second;
        values[g.params[i]] = flat.narrow(0, offset[i], param.numel()).view(param.sizes());
      }
    };
    for (const auto& g : enc_sync) one(g);
    one(llm_sync);
    if (expert_parallel) one(expert_sync);
  }

  // Every parameter's value (detached), exact: under a narrow ZeRO-1 gather the sharded ones
  // (held in bf16) made whole in fp32 from each rank's masters. Collective then.
  std::vector<at::Tensor> exact_parameters() const {
    finish_param_gathers();
    const model::NamedTensors& params = model->parameters();
    std::vector<at::Tensor> out;
    for (const auto& [name, p] : params) out.push_back(p.detach());
    if (!opts.zero1 || opts.param_gather_dtype == at::kFloat) return out;
    std::vector<at::Tensor> values(trainable.size());  // whole_from_pieces reads the pieces only
    for (const ShardPiece& p : pieces) {
      if (!p.master.defined()) continue;
      at::Tensor& v = values[p.param];
      if (!v.defined()) v = torch::empty(trainable[p.param].second.sizes(), p.master.options());
      v.view({-1}).narrow(0, p.begin, p.length).copy_(p.master);
    }
    for (size_t t = 0; t < trainable.size(); ++t)
      if (!values[t].defined()) values[t] = out[trainable_param[t]];
    whole_from_pieces(values);
    for (size_t t = 0; t < trainable.size(); ++t) out[trainable_param[t]] = values[t];
    return out;
  }

  void gather_full(const std::vector<at::Tensor>& local, int root,
                   const Runtime::TensorSink& sink) const {
    const model::NamedTensors& params = model->parameters();
    WEFT_ASSERT(local.size() == params.size(), "gather_full: ", local.size(), " tensors for ",
                params.size(), " parameters");
    // 1. Canonical copies assembled over TP (every TP rank of a canonical group takes part).
    model::NamedTensors mine;
    for (size_t k = 0; k < params.size(); ++k) {
      if (!param_canonical[k] || !local[k].defined()) continue;
      const model::Split& split = model->param_set().split(k);
      at::Tensor full = local[k];
      if (split.sharded()) {
        at::Tensor all = param_tp[k].all_gather(local[k].contiguous().unsqueeze(0));
        std::vector<at::Tensor> shards;
        for (int64_t r = 0; r < split.size; ++r) shards.push_back(all[r]);
        full = model::join_shards(shards, split);
      }
      if (local[k].defined() && param_tp[k].rank() == 0)
        mine.emplace_back(params[k].first, full.to(at::kCPU).contiguous());
    }
    // 2. Names and shapes to everyone, then tensors to the root.
    std::ostringstream header;
    for (const auto& [name, t] : mine) {
      header << name << ' ' << static_cast<int>(t.scalar_type()) << ' ' << t.dim();
      for (int64_t s : t.sizes()) header << ' ' << s;
      header << '\n';
    }
    const std::vector<std::string> headers = world.all_gather_strings(header.str());
    for (int r = 0; r < world.size(); ++r) {
      std::istringstream in(headers[r]);
      std::string name;
      int dtype = 0, dim = 0;
      for (size_t i = 0; in >> name >> dtype >> dim; ++i) {
        std::vector<int64_t> shape(static_cast<size_t>(dim));
        for (auto& s : shape) in >> s;
        const int tag = static_cast<int>(i);
        if (r == rank && r == root) {
          sink(name, std::move(mine[i].second));
        } else if (r == rank) {
          p2p.send(mine[i].second, root, tag).wait();
        } else if (rank == root) {
          at::Tensor t =
              torch::empty(shape, torch::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)));
          p2p.recv(t, r, tag);
          sink(name, std::move(t));
        }
      }
    }
  }
};

namespace {
// A sink that keeps what it is given.
Runtime::TensorSink into(model::NamedTensors& out) {
  return [&out](const std::string& name, at::Tensor t) { out.emplace_back(name, std::move(t)); };
}
}  // namespace

model::NamedTensors Runtime::gather_parameters(int root) const {
  model::NamedTensors out;
  gather_parameters(root, into(out));
  return out;
}

void Runtime::gather_parameters(int root, const TensorSink& sink) const {
  impl_->gather_full(impl_->exact_parameters(), root, sink);
}

model::NamedTensors Runtime::gather_trainable(std::vector<at::Tensor> per_trainable,
                                              int root) const {
  Impl& m = *impl_;
  m.whole_from_pieces(per_trainable);
  std::vector<at::Tensor> local(m.model->parameters().size());
  for (size_t t = 0; t < per_trainable.size(); ++t) local[m.trainable_param[t]] = per_trainable[t];
  model::NamedTensors out;
  m.gather_full(local, root, into(out));
  return out;
}

std::vector<io::TensorShard> Runtime::checkpoint_shards(
    const std::vector<std::pair<std::string, std::vector<at::Tensor>>>& moments) const {
  Impl& m = *impl_;
  WEFT_ASSERT(std::all_of(moments.begin(), moments.end(),
                          [&](const auto& kind) { return kind.second.size() == m.pieces.size(); }),
              "checkpoint_shards: moments of ", m.pieces.size(), " pieces expected");
  m.finish_param_gathers();
  const model::NamedTensors& params = m.model->parameters();
  // `value` of parameter k whole (this rank's TP chunk), or the flat range of it a ZeRO-1 piece
  // holds.
  auto shard = [&](const std::string& name, size_t k, const at::Tensor& value,
                   const ShardPiece* piece = nullptr) {
    const model::Split& split = m.model->param_set().split(k);
    io::TensorShard s{name,       value.detach().to(at::kCPU).contiguous(),
                      split.dim,  split.segments,
                      split.rank, split.size,
                      {},         0};
    if (piece) {
      s.value = s.value.view({-1});
      s.shape = params[k].second.sizes().vec();
      s.begin = piece->begin;
    }
    return s;
  };
  std::vector<io::TensorShard> out;
  // Whole values are written by the canonical copy's TP ranks, one of them for a parameter TP
  // replicates.
  const auto writes_whole = [&](size_t k) {
    return m.param_canonical[k] &&
           (m.model->param_set().split(k).sharded() || m.param_tp[k].rank() == 0);
  };
  // A parameter held in bf16 under ZeRO-1 has its exact values in the pieces' masters only.
  std::vector<uint8_t> in_masters(params.size(), 0);
  for (size_t t = 0; t < m.trainable.size(); ++t)
    in_masters[m.trainable_param[t]] = m.trainable[t].second.scalar_type() != at::kFloat;
  for (size_t k = 0; k < params.size(); ++k)
    if (writes_whole(k) && !in_masters[k])
      out.push_back(shard("model/" + params[k].first, k, params[k].second));
  // ZeRO-1 pieces are written by each rank of their group (one TP rank for a parameter TP
  // replicates; not the tied copy): the optimizer state and the masters as ranges.
  for (size_t i = 0; i < m.pieces.size(); ++i) {
    const ShardPiece& p = m.pieces[i];
    const size_t k = m.trainable_param[p.param];
    const bool range = p.grad.defined();
    if (!(range ? m.counted_pieces[p.param] : writes_whole(k))) continue;
    const ShardPiece* piece = range ? &p : nullptr;
    if (p.master.defined()) out.push_back(shard("model/" + params[k].first, k, p.master, piece));
    for (const auto& [kind, per_piece] : moments)
      out.push_back(shard("optimizer/" + kind + "." + params[k].first, k, per_piece[i], piece));
  }
  return out;
}

size_t Runtime::param_index(size_t t) const { return impl_->trainable_param[t]; }

void Runtime::set_parameter(size_t k, const at::Tensor& value) {
  Impl& m = *impl_;
  m.finish_param_gathers();  // nothing in flight may land on it after
  const auto& [name, p] = m.model->parameters().at(k);
  WEFT_CHECK(value.sizes() == p.sizes(), "parameter '", name, "': a value of shape ", value.sizes(),
             " for a parameter of shape ", p.sizes(), " on this rank");
  torch::NoGradGuard no_grad;
  p.copy_(value);
  const auto it = std::find(m.trainable_param.begin(), m.trainable_param.end(), k);
  if (it == m.trainable_param.end()) return;
  const auto t = static_cast<size_t>(it - m.trainable_param.begin());
  const at::Tensor flat = value.reshape({-1});
  for (const ShardPiece& piece : m.pieces)
    if (piece.param == t && piece.master.defined())
      piece.master.copy_(flat.narrow(0, piece.begin, piece.length));
}

Runtime::Runtime(const ModelSpec& model, uint64_t seed, const plan::Plan& plan, Comm world,
                 RuntimeOptions options)
    : impl_(std::make_unique<Impl>(model, seed, plan, std::move(world), options)) {}
Runtime::~Runtime() = default;
model::MultimodalModel& Runtime::model() {
  impl_->finish_param_gathers();  // whatever the caller reads
  return *impl_->model;
}
const Comm& Runtime::world() const { return impl_->world; }
const model::NamedTensors& Runtime::trainable() const { return impl_->trainable; }
const std::vector<ShardPiece>& Runtime::optimizer_pieces() const { return impl_->pieces; }
std::pair<int64_t, int64_t> Runtime::encoder_items_read(size_t e,
                                                        const std::vector<int64_t>& counts) const {
  const Impl& m = *impl_;
  WEFT_ASSERT(e < m.enc_role.size());
  WEFT_ASSERT(static_cast<int64_t>(counts.size()) == m.llm_plan->layout.dp);
  if (!m.enc_role[e].first) return {0, 0};
  return m.encoder_range(Impl::layout_of(counts), e, m.enc_role[e].c.dp);
}

double Runtime::step(const std::vector<std::vector<model::Inputs>>& batch, int64_t targets) {
  return impl_->step(batch, targets).item<double>();
}
at::Tensor Runtime::queue_step(const std::vector<std::vector<model::Inputs>>& batch,
                               int64_t targets) {
  return impl_->step(batch, targets);
}
// A forward-only pass of `batch` through the layout (eval_loss_sum, eval_next_tokens): the
// training step's times and trace stay as they were (the trainer reports them).
at::Tensor Runtime::Impl::evaluate(const std::vector<std::vector<model::Inputs>>& batch,
                                   int64_t predict) {
  struct Restore {
    Impl& m;
    StepTimes times;
    std::vector<plan::TraceEvent> trace;
    bool tracing;
    ~Restore() {
      m.forward_only = false;
      m.predict_vocab = 0;
      m.tracing = tracing;
      m.times = times;
      m.trace = std::move(trace);
    }
  } restore{*this, times, std::move(trace), tracing};
  forward_only = true;
  predict_vocab = predict;
  tracing = false;
  return step(batch, /*targets=*/1);
}

namespace {
// Per row of `in` (host tensors): the index among its targets of the row's target, or -1. Every
// row may hold one target at most, at the last token of its document.
std::vector<int64_t> row_targets(const model::Inputs& in, size_t replica, size_t microbatch) {
  const int64_t B = in.tokens.size(0), S = in.tokens.size(1);
  const at::Tensor doc = in.doc.to(at::kInt).contiguous();
  const at::Tensor rows = in.target_rows.to(at::kLong).contiguous();
  const auto da = doc.accessor<int32_t, 2>();
  std::vector<int64_t> target(static_cast<size_t>(B), -1);
  for (int64_t k = 0; k < rows.numel(); ++k) {
    const int64_t r = rows.data_ptr<int64_t>()[k], b = r / S, j = r % S;
    WEFT_CHECK(r >= 0 && b < B && target[b] < 0 && da[b][j] >= 0 &&
                   (j + 1 == S || da[b][j + 1] != da[b][j]),
               "generation in the layout: replica ", replica, ", microbatch ", microbatch,
               ": a target at row ", r, " (expected at most one per row of ", S,
               " positions, at the last token of its document)");
    target[b] = k;
  }
  return target;
}
}  // namespace

// Microbatch m's decoding, from its padded host inputs (S positions per row): each row's target
// is where its new tokens continue, seeing the positions of the target's document.
model::KvCache& Runtime::Impl::start_decoding(int64_t m, const model::Inputs& host, int64_t S) {
  const int64_t d = llm_role.c.dp, B = host.tokens.size(0);
  Decoding& dec = decoding[m];
  dec = {};
  dec.cache.capacity = S + decode_room;
  dec.target = row_targets(host, static_cast<size_t>(d), static_cast<size_t>(m));
  const at::Tensor doc = host.doc.to(at::kInt).contiguous();
  const at::Tensor pos = host.positions.to(at::kLong).contiguous();
  const at::Tensor rows = host.target_rows.to(at::kLong).contiguous();
  at::Tensor visible = torch::zeros({B, S}, torch::kBool);
  at::Tensor position = torch::zeros({B}, torch::kLong);
  for (int64_t b = 0; b < B; ++b) {
    if (dec.target[b] < 0) continue;
    const int64_t j = rows.data_ptr<int64_t>()[dec.target[b]] % S;
    visible[b] = doc[b] == doc[b][j];
    position[b] = pos[b][j] + 1;
    dec.target[b] += target_offsets[d][m];
  }
  dec.visible = visible.view({B, 1, 1, S}).to(opts.device);
  dec.position = position.view({B, 1}).to(opts.device);
  return dec.cache;
}

// One new token of every row of every microbatch through this rank's LLM chunks, in chunk then
// microbatch order on every rank, each stage's output sent on as in a forward: under virtual
// stages a rank runs its first chunk for every microbatch before its later chunks, whose inputs
// the other ranks sent meanwhile (microbatch then chunk order would wait out each microbatch's
// round trip through the other ranks). The last stage's greedy ids of rows with a target go to
// `predictions` (from TP and CP rank 0).
void Runtime::Impl::decode_step(const std::vector<int64_t>& ids) {
  if (!llm_role.hosted) return;
  const model::Llm& llm = model->llm();
  std::map<int64_t, std::pair<at::Tensor, at::Tensor>> step;  // per microbatch: mask, positions
  for (auto& [m, dec] : decoding) {
    const int64_t B = static_cast<int64_t>(dec.target.size());
    step[m] = {
        torch::cat({dec.visible, torch::ones({B, 1, 1, decode_steps + 1}, dec.visible.options())},
                   3),
        dec.position + decode_steps};
  }
  for (size_t chunk = 0; chunk < llm.chunks.size(); ++chunk)
    for (auto& [m, dec] : decoding) {
      const int64_t B = static_cast<int64_t>(dec.target.size());
      const auto& [visible, positions] = step.at(m);
      const int64_t stage = llm_stage(static_cast<int64_t>(chunk));
      at::Tensor x;
      if (stage == 0) {
        std::vector<int64_t> next(static_cast<size_t>(B), 0);  // a row without target: any id
        for (int64_t b = 0; b < B; ++b)
          if (dec.target[b] >= 0) next[b] = ids.at(static_cast<size_t>(dec.target[b]));
        x = llm.embed(torch::tensor(next, torch::kLong).view({B, 1}).to(opts.device));
      } else {
        x = recv({{B, 1, spec.llm.hidden},
                  model::compute_dtype(),
                  llm_rank_of_stage(stage - 1),
                  tag_of(kLlmAct, 0, m, stage)});
      }
      const at::Tensor h = llm.decode(x, positions, visible, dec.cache, chunk);
      if (!llm_last_stage(stage)) {
        send(h, llm_rank_of_stage(stage + 1), tag_of(kLlmAct, 0, m, stage + 1));
        continue;
      }
      at::Tensor logprob;
      const at::Tensor next =  // collective over TP
          llm.greedy(h.select(1, 0), decode_vocab, want_logprob ? &logprob : nullptr);
      if (llm_role.c.tp != 0 || llm_role.c.cp != 0) continue;
      std::vector<int64_t> rows, index;
      for (int64_t b = 0; b < B; ++b)
        if (dec.target[b] >= 0) {
          rows.push_back(b);
          index.push_back(dec.target[b]);
        }
      const at::Tensor own = torch::tensor(rows, torch::kLong).to(next.device());
      predictions.push_back({torch::tensor(index, torch::kLong), next.index_select(0, own),
                             logprob.defined() ? logprob.index_select(0, own) : logprob});
    }
  for (Pending& p : sends) p.wait();
  sends.clear();
  WEFT_ASSERT(mailbox.empty(), "undelivered self messages");
}

std::vector<int64_t> Runtime::Impl::shared_predictions(int64_t targets,
                                                       std::vector<double>* logprob) {
  // Each target's id and log-probability come from one rank (its last-stage, TP-rank-0 holder):
  // one sum gathers them (ids are exact in double).
  at::Tensor all = torch::zeros({2, targets}, torch::kDouble);
  for (const Prediction& p : predictions) {
    const at::Tensor index = p.index.cpu();
    all[0].index_put_({index}, p.id.cpu().to(torch::kDouble));
    if (p.logprob.defined()) all[1].index_put_({index}, p.logprob.cpu().to(torch::kDouble));
  }
  predictions.clear();
  if (world.size() > 1) world.all_reduce_sum(all);
  const at::Tensor ids = all[0].to(torch::kLong).contiguous();
  if (logprob) {
    const at::Tensor lp = all[1].contiguous();
    logprob->assign(lp.data_ptr<double>(), lp.data_ptr<double>() + targets);
  }
  return std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + targets);
}

double Runtime::eval_loss_sum(const std::vector<std::vector<model::Inputs>>& batch) {
  return impl_->evaluate(batch, /*predict=*/0).item<double>();
}

std::vector<int64_t> Runtime::eval_next_tokens(const std::vector<std::vector<model::Inputs>>& batch,
                                               int64_t vocab, std::vector<double>* logprob) {
  WEFT_CHECK(vocab > 0, "eval_next_tokens: vocab ", vocab, " (expected at least 1)");
  Impl& m = *impl_;
  int64_t total = 0;
  m.target_offsets.assign(batch.size(), {});
  for (size_t d = 0; d < batch.size(); ++d)
    for (const model::Inputs& in : batch[d]) {
      m.target_offsets[d].push_back(total);
      total += in.targets.numel();
    }
  m.predictions.clear();
  m.want_logprob = logprob != nullptr;
  m.evaluate(batch, vocab);
  return m.shared_predictions(total, logprob);
}

std::vector<int64_t> Runtime::eval_prefill(const std::vector<std::vector<model::Inputs>>& batch,
                                           int64_t vocab, int64_t room,
                                           std::vector<double>* logprob) {
  WEFT_CHECK(room >= 0, "eval_prefill: room for ", room, " positions (expected at least 0)");
  for (size_t d = 0; d < batch.size(); ++d)  // on every rank, before any collective
    for (size_t k = 0; k < batch[d].size(); ++k) row_targets(batch[d][k], d, k);
  Impl& m = *impl_;
  eval_release();
  struct Reset {
    bool& prefilling;
    ~Reset() { prefilling = false; }
  } reset{m.prefilling};
  m.prefilling = true;
  m.decode_room = room;
  std::vector<int64_t> ids = eval_next_tokens(batch, vocab, logprob);
  m.decode_vocab = vocab;
  m.decode_targets = static_cast<int64_t>(ids.size());
  return ids;
}

std::vector<int64_t> Runtime::eval_decode(const std::vector<int64_t>& ids,
                                          std::vector<double>* logprob) {
  Impl& m = *impl_;
  WEFT_CHECK(m.decode_targets > 0,
             "eval_decode: nothing to continue (no eval_prefill since the "
             "last eval_release)");
  WEFT_CHECK(static_cast<int64_t>(ids.size()) == m.decode_targets, "eval_decode: ", ids.size(),
             " ids for the prefill's ", m.decode_targets, " targets");
  WEFT_CHECK(m.decode_steps < m.decode_room, "eval_decode: the caches hold room for ",
             m.decode_room, " new positions, all used");
  for (size_t k = 0; k < ids.size(); ++k)  // on every rank, before any collective
    WEFT_CHECK(ids[k] >= 0 && ids[k] < m.spec.llm.vocab, "eval_decode: id ", ids[k], " of target ",
               k, " (expected one in [0, ", m.spec.llm.vocab, "))");
  torch::NoGradGuard no_grad;
  m.predictions.clear();
  m.want_logprob = logprob != nullptr;
  m.decode_step(ids);
  ++m.decode_steps;
  return m.shared_predictions(m.decode_targets, logprob);
}

void Runtime::eval_release() {
  Impl& m = *impl_;
  m.decoding.clear();
  m.decode_targets = m.decode_steps = 0;
}
at::Tensor Runtime::grad_squares() const {
  WEFT_CHECK(impl_->world.size() == 1, "Runtime::grad_squares: one rank only (",
             impl_->world.size(), " here): use grad_norm()");
  return impl_->grad_squares();
}
const StepTimes& Runtime::times() const { return impl_->times; }
const RoutingReport& Runtime::routing() const { return impl_->routing; }
void Runtime::set_tracing(bool on) { impl_->tracing = on; }
std::string Runtime::gather_trace(int root) const {
  nlohmann::json mine = nlohmann::json::array();
  for (const plan::TraceEvent& e : impl_->trace)
    mine.push_back({e.name, e.category, e.rank, e.start_seconds, e.seconds});
  const std::vector<std::string> all = impl_->world.all_gather_strings(mine.dump());
  if (impl_->world.rank() != root) return "";
  std::vector<plan::TraceEvent> events;
  for (const std::string& text : all)
    for (const auto& e : nlohmann::json::parse(text))
      events.push_back({e[0].get<std::string>(), e[1].get<std::string>(), e[2].get<int64_t>(),
                        e[3].get<double>(), e[4].get<double>()});
  return plan::chrome_trace(events);
}
double Runtime::grad_norm() { return impl_->grad_norm(); }
void Runtime::after_optimizer_step() { impl_->after_optimizer_step(); }
model::NamedTensors Runtime::gather_full(const std::vector<at::Tensor>& local, int root) const {
  model::NamedTensors out;
  impl_->gather_full(local, root, into(out));
  return out;
}
at::Tensor Runtime::shard_of(size_t k, const at::Tensor& full) const {
  return model::take_shard(full, impl_->model->param_set().split(k));
}
io::ShardSplit Runtime::shard_split(size_t k) const {
  const model::Split& s = impl_->model->param_set().split(k);
  return {s.dim, s.segments, s.rank, s.size};
}

}  // namespace weft::dist
