#include "weft/plan/simulate.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <string>
#include <tuple>
#include <utility>

#include "weft/core/error.h"
#include "weft/core/loss_chunk.h"
#include "weft/plan/encoder_share.h"
#include "weft/plan/partition.h"

namespace weft::plan {

namespace {

void add(StageCost* s, const LayerCost& c, const Layout& layout) {
  s->forward_flops += c.forward;
  s->backward_flops += c.input_grad + c.weight_grad;
  s->activation_bytes += c.activation_bytes;
  s->whole_activation_bytes += layout.sequence_parallel() ? c.sp_whole_bytes : c.tp_whole_bytes;
  s->param_bytes += c.param_bytes;
  s->copy_bytes += c.copy_bytes;
  s->trained_cast_bytes += c.trained_cast_bytes;
  s->train_state_bytes += c.train_state_bytes;
  // partition.h charges 12 train-state bytes per trainable parameter: the fp32 gradient (4) and
  // AdamW's two fp32 moments.
  s->grad_bytes += c.train_state_bytes / 3;
  s->partial_grad_bytes += 4 * c.partial_grad_params;
  s->expert_param_bytes += c.expert_param_bytes;
  s->expert_train_state_bytes += c.expert_train_state_bytes;
  s->expert_copy_bytes += c.expert_copy_bytes;
  s->expert_trained_cast_bytes += c.expert_trained_cast_bytes;
  s->expert_grad_bytes += c.expert_train_state_bytes / 3;
}

Spec with_vocab(Spec spec, const SimOptions& o) {
  if (spec.model.llm.vocab == 0) spec.model.llm.vocab = o.unset_vocab;
  return spec;
}

// Message identity: kind, module index (the LLM's messages: the receiving (virtual) stage),
// microbatch, sender, receiver.
enum MsgKind { kEncAct, kEncGrad, kBridge, kBridgeGrad, kLlmAct, kLlmGrad };
using MsgKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t>;

std::string to_string(const MsgKey& k) {
  static const char* const kinds[] = {"encoder activation", "encoder gradient", "bridge",
                                      "bridge gradient",    "LLM activation",   "LLM gradient"};
  return std::string(kinds[std::get<0>(k)]) + " (module/stage " + std::to_string(std::get<1>(k)) +
         ", mb " + std::to_string(std::get<2>(k)) + ", rank " + std::to_string(std::get<3>(k)) +
         " -> " + std::to_string(std::get<4>(k)) + ")";
}

struct Send {
  MsgKey key;  // its receiver: std::get<4>(key)
  double bytes = 0;
  int64_t slot = -1;  // the wait it satisfies, its index in Engine::waits_ (-1: none; link)
};

enum class Cat { kForward, kBackward, kCollective, kData, kOptimizer };
const char* to_string(Cat c) {
  switch (c) {
    case Cat::kForward:
      return "forward";
    case Cat::kBackward:
      return "backward";
    case Cat::kCollective:
      return "collective";
    case Cat::kData:
      return "data";
    case Cat::kOptimizer:
      return "optimizer";
  }
  return "?";
}

struct Op {
  // A forward's / backward's name is made only where needed (Engine::name_of, from module, mb and
  // stage): a step has hundreds of thousands of them. Other ops carry theirs.
  std::string name;
  Cat cat = Cat::kForward;
  int64_t mb = -1, stage = -1;
  double seconds = 0, comm_seconds = 0;  // duration; of which TP / CP collectives
  // Its messages, in the Engine's flat arrays: waits [wait_begin, + waits) of Engine::waits_ (a
  // wait's index there is its slot), sends [send_begin, + sends) of Engine::sends_.
  int64_t wait_begin = 0, waits = 0, send_begin = 0, sends = 0;
  int64_t slot = -1;                      // a collective: this rank's place among its ranks
  double keep_bytes = 0, free_bytes = 0;  // activations kept by a forward / freed by a backward
  int64_t arms = -1;        // the gradient reduction (Engine::arm_key) this last backward starts
  int64_t collective = -1;  // index into Engine::collectives; a step-end collective
  bool llm = false;         // a forward / backward of the LLM
  int64_t module = -1;      // a forward's / backward's module
  // ZeRO-1's overlapped parameter gather, in flight from the step's start: a module's first
  // forward on a rank starts once its first bucket is there and ends no sooner than the last.
  double gather_first = 0, gather_last = 0;
  std::string gather_name;
  // Measured contention: seconds the op's compute takes on top of `base` while another rank of
  // its node computes throughout (0 = none); `seconds` = base + the share of it that applies.
  double base = 0, shared_extra = 0;
  double last_start = 0, last_end = 0;  // where the last pass ran it
};

struct Collective {
  std::string name;
  std::vector<int64_t> ranks;
  double seconds = 0, last_bucket_seconds = 0;
  int64_t armed_by = -1;  // a gradient reduction: may start when armed (Engine::arm_key)
  int64_t after = -1;     // the collective it queues behind (the module's previous chunk's)
  double last_end = 0;    // where the last pass ended it
  std::vector<bool> arrived;
  int64_t count = 0;
};

class Engine {
 public:
  Engine(const Spec& spec, const Plan& plan, const Cluster& cluster, const CostTable& costs,
         const SimOptions& o)
      : spec_(spec), plan_(plan), cl_(cluster), costs_(costs), o_(o) {
    const Precision p = spec.train.precision;
    flops_per_second_ = cluster.device.effective_flops(p);
    act_ = p == Precision::kBf16 ? 2.0 : 4.0;
    WEFT_CHECK(flops_per_second_ > 0, cluster.source, ": device \"", cluster.device.name,
               "\" has no ", to_string(p), " FLOP/s");
    seq_ = o.data.empty() ? static_cast<double>(spec.model.llm.max_seq) : o.data.positions;
    targets_ = o.data.empty() ? seq_ : o.data.targets;
    llm_ = static_cast<int64_t>(plan.modules.size()) - 1;
    WEFT_ASSERT(plan.modules[llm_].role == ModuleRole::kLlm, "the LLM is the last plan module");
    D_ = plan.modules[llm_].layout.dp;
    M_ = plan.microbatches;
    const int64_t per = plan.global_batch / D_;
    for (int64_t m = 0; m < M_; ++m) {
      const auto [a, b] = even_part(per, M_, m);
      mb_samples_.push_back(b - a);
    }
    ops_.resize(static_cast<size_t>(plan.world_size));
    result_.ranks.resize(static_cast<size_t>(plan.world_size));
    for (int64_t r = 0; r < plan.world_size; ++r) result_.ranks[r].rank = r;
  }

  SimResult run() {
    for (int64_t r = 0; r < plan_.world_size; ++r) build_rank(r);
    link();
    execute();
    // Contention: an op is charged its shared cost for the part of it during which another rank
    // of its node computes, taken from the previous pass's timeline (a few passes settle it).
    bool shared = false;
    for (const auto& ops : ops_)
      for (const Op& op : ops) shared = shared || op.shared_extra != 0;
    for (int pass = 0; shared && pass < kContentionPasses; ++pass) {
      apply_contention();
      execute();
    }
    summarise();
    return std::move(result_);
  }

 private:
  const Spec& spec_;
  const Plan& plan_;
  const Cluster& cl_;
  const CostTable& costs_;
  const SimOptions& o_;
  double flops_per_second_ = 0, act_ = 2;
  double seq_ = 0;      // tokens per LLM row
  double targets_ = 0;  // of them loss targets (the head's rows)
  int64_t llm_ = 0, D_ = 1, M_ = 1;
  std::vector<int64_t> mb_samples_;  // per microbatch: samples of each LLM replica
  std::vector<std::vector<Op>> ops_;
  std::vector<MsgKey> waits_;  // every op's waits, an op's together (Op::wait_begin)
  std::vector<Send> sends_;    // every op's sends, an op's together (Op::send_begin)
  std::vector<Collective> collectives_;
  std::map<std::pair<std::string, int64_t>, int64_t> collective_index_;  // (name, first rank)
  SimResult result_;

  // ---- building each rank's op list --------------------------------------------------------

  const ModulePlan& mod(int64_t i) const { return plan_.modules[static_cast<size_t>(i)]; }
  const EncoderSpec& enc_spec(int64_t i) const { return spec_.model.encoders[mod(i).encoder]; }
  bool stage_backward(int64_t i, int64_t stage) const {
    const ModulePlan& m = mod(i);
    if (m.role == ModuleRole::kLlm) return m.needs_backward();
    return stage == m.layout.pp - 1 ? mod(i + 1).needs_backward() : m.weight_grads;
  }
  // TP's and CP's collectives of activations, waited for where issued.
  double all_reduce(const std::vector<int64_t>& g, double bytes) const {
    return o_.tp_cp_comm ? blocking(o_.activation_curve, g, bytes, CollectiveKind::kAllReduce) : 0;
  }
  double all_gather(const std::vector<int64_t>& g, double bytes) const {
    return o_.tp_cp_comm ? blocking(o_.activation_curve, g, bytes, CollectiveKind::kAllGather) : 0;
  }
  double reduce_scatter(const std::vector<int64_t>& g, double bytes) const {
    return o_.tp_cp_comm ? blocking(o_.activation_curve, g, bytes, CollectiveKind::kReduceScatter)
                         : 0;
  }
  // The forward's TP collectives of `blocks` transformer blocks over `bytes` of activations (a
  // rank's tokens, whole): two all-reduces per block. Under sequence parallelism (a rank holds
  // 1/tp of its tokens between the TP regions) each all-reduce becomes an all-gather of the
  // column-parallel input and a reduce-scatter of the row-parallel output (the same bytes).
  // Backward (tp_blocks_backward_comm) reduces the column-parallel inputs' gradients, under SP
  // gathers the row-parallel outputs' and, where the weights train, gathers each column-parallel
  // input again (its shard was kept) for the weight gradient (dist::column_linear).
  double tp_blocks_forward_comm(const std::vector<int64_t>& tp, double blocks, double bytes,
                                bool sp) const {
    if (!sp) return 2 * blocks * all_reduce(tp, bytes);
    return 2 * blocks * (all_gather(tp, bytes) + reduce_scatter(tp, bytes));
  }
  // Every rank sends `bytes` in all, evenly over the group: the pairwise exchange costs what a
  // ring all-gather of `bytes` does (cluster.h all_to_all_seconds).
  // Gloo's (or NCCL's) on every host: never through shared memory (dist/comm.h).
  double all_to_all(const std::vector<int64_t>& g, double bytes) const {
    const CommCurve& curve =
        o_.all_to_all_curve.empty() ? o_.activation_curve : o_.all_to_all_curve;
    return o_.tp_cp_comm ? ring(curve, g, bytes, false, CollectiveAlgo::kRing) : 0;
  }
  // The LLM's expert-parallel group through rank r (data_parallel: its expert-data-parallel
  // group), from ModulePlan::expert_groups, computed once.
  const std::vector<int64_t>& expert_group(int64_t r, bool data_parallel) {
    auto& index = expert_group_index_[data_parallel ? 1 : 0];
    auto& groups = expert_groups_[data_parallel ? 1 : 0];
    if (index.empty()) {
      groups = mod(llm_).expert_groups(data_parallel);
      index.assign(static_cast<size_t>(plan_.world_size), -1);
      for (size_t g = 0; g < groups.size(); ++g)
        for (int64_t q : groups[g]) index[static_cast<size_t>(q)] = static_cast<int64_t>(g);
    }
    const int64_t g = index[static_cast<size_t>(r)];
    WEFT_ASSERT(g >= 0, "rank ", r, " holds none of the LLM's experts");
    return groups[static_cast<size_t>(g)];
  }
  std::vector<std::vector<int64_t>> expert_groups_[2];
  std::vector<int64_t> expert_group_index_[2];
  // A collective over group g: an all-reduce, or an all-gather / reduce-scatter (the same cost);
  // on a measured curve when the group sits on one node (SimOptions), else the cluster's links.
  double ring(const CommCurve& curve, const std::vector<int64_t>& g, double bytes, bool reduce,
              CollectiveAlgo algo) const {
    const double n = static_cast<double>(g.size());
    if (g.size() <= 1) return 0;
    if (curve.empty() || cl_.node_of(g.front()) != cl_.node_of(g.back()))
      return reduce ? all_reduce_seconds(cl_, g, bytes, algo) : all_gather_seconds(cl_, g, bytes);
    return (reduce ? 1.0 : 0.5) * (n - 1) * curve.at(2 * bytes / n);
  }
  // A collective waited for where it is issued: on the measured curve as ring() where the group
  // sits on one node, else the cluster's (through shared memory where it has that link).
  double blocking(const CommCurve& curve, const std::vector<int64_t>& g, double bytes,
                  CollectiveKind kind) const {
    if (!curve.empty() && cl_.node_of(g.front()) == cl_.node_of(g.back()))
      return ring(curve, g, bytes, kind == CollectiveKind::kAllReduce, CollectiveAlgo::kRing);
    return blocking_collective_seconds(spec_, cl_, g, kind, bytes);
  }
  double message(int64_t src, int64_t dst, double bytes) const {
    if (src == dst) return 0;
    if (o_.p2p_curve.empty() || cl_.node_of(src) != cl_.node_of(dst))
      return message_seconds(spec_, cl_, src, dst, bytes);
    return o_.p2p_curve.at(bytes);
  }
  // fp32 reductions waited for where issued (SimOptions::blocking_curve).
  const CommCurve& blocking_curve() const {
    return o_.blocking_curve.empty() ? o_.grad_curve : o_.blocking_curve;
  }
  // An fp32 reduction inside an op (the vocab-parallel loss's).
  double loss_all_reduce(const std::vector<int64_t>& g, double bytes) const {
    return o_.tp_cp_comm ? blocking(blocking_curve(), g, bytes, CollectiveKind::kAllReduce) : 0;
  }
  // The vocab-parallel loss's fp32 reductions over `rows` rows: per chunk of rows
  // (loss_chunk_rows), the max, then the sum of exponentials with the target logit.
  double loss_reductions(const std::vector<int64_t>& tp, double rows) const {
    if (tp.size() <= 1 || rows <= 0) return 0;
    const LlmSpec& l = spec_.model.llm;
    const double chunk =
        static_cast<double>(loss_chunk_rows(l.hidden, l.vocab / static_cast<int64_t>(tp.size())));
    const double chunks = std::ceil(rows / chunk), per = rows / chunks;
    return chunks * (loss_all_reduce(tp, per * 4) + loss_all_reduce(tp, per * 8));
  }
  // Encoder e's DP rank i's share of microbatch m (encoder_share); `peak`: split as the data's
  // peak sample's items would be (activation memory, which the peak's bytes per sample price).
  EncoderShare share_of(int64_t e, int64_t m, int64_t i, bool peak = false) const {
    const ModulePlan& em = mod(e);
    const double items = peak ? o_.data.peak_items_of(em.encoder) : o_.data.items_of(em.encoder);
    return encoder_share(mb_samples_[m], items, D_, em.layout.dp, i);
  }
  // Encoder DP ranks i holding items of replica d in microbatch m: {i, the samples of d they
  // hold items of}.
  std::vector<std::pair<int64_t, double>> encoder_ranks_of(int64_t e, int64_t m, int64_t d) const {
    std::vector<std::pair<int64_t, double>> out;
    for (int64_t i = 0; i < mod(e).layout.dp; ++i) {
      const double overlap = share_of(e, m, i).overlap(d, mb_samples_[m]);
      if (overlap > 0) out.push_back({i, overlap});
    }
    return out;
  }

  // The backward's TP collectives of `blocks` blocks (column_backward_comm): under SP the two
  // all-gathers of the row-parallel outputs' gradients, then per column-parallel linear its
  // input gradient's reduction and, where the weights train (`regather`), its input's re-gather,
  // each hidden behind a matmul at `seconds_per_flop` (0: nothing hidden).
  double tp_blocks_backward_comm(const std::vector<int64_t>& tp, double blocks, double bytes,
                                 bool sp, bool regather, const ColumnFlops& columns, double tokens,
                                 double seconds_per_flop) const {
    const double n = static_cast<double>(tp.size());
    if (!sp)
      return column_backward_comm(blocks, all_reduce(tp, bytes), 0, columns, tokens, n,
                                  seconds_per_flop);
    const double ag = all_gather(tp, bytes);
    return 2 * blocks * ag + column_backward_comm(blocks, reduce_scatter(tp, bytes),
                                                  regather ? ag : 0, columns, tokens, n,
                                                  seconds_per_flop);
  }
  // A forward / backward op of a stage on n units of data, the per-unit work divided over
  // `split` (tp × cp) ranks: measured seconds when the stage has them, else FLOPs at the
  // device's effective rate; plus the op's TP / CP collectives.
  Op compute(int64_t module, bool forward, int64_t mb, int64_t stage, const StageCost& sc, double n,
             double split, double comm) const {
    Op op;
    op.cat = forward ? Cat::kForward : Cat::kBackward;
    op.module = module, op.mb = mb, op.stage = stage;
    const double seconds = compute_seconds(sc, forward, n, split, flops_per_second_, false,
                                           cl_.device.block_overhead_seconds);
    op.seconds = op.base = seconds + comm;
    op.comm_seconds = comm;
    if (sc.measured && sc.shared_measured)
      op.shared_extra = compute_seconds(sc, forward, n, split, flops_per_second_, true) - seconds;
    return op;
  }
  // A backward op's activations: what its forward kept is freed, after a recomputed block's
  // activations held on top of it during the op.
  static void backward_bytes(Op* op, const StageCost& sc, double n, const Layout& layout) {
    const double whole = sc.recompute_peak_whole_bytes;
    op->keep_bytes = n *
                     ((sc.recompute_peak_bytes - whole) / static_cast<double>(layout.tp) + whole) /
                     static_cast<double>(layout.cp);
    op->free_bytes = kept_activation_bytes(sc, n, layout) + op->keep_bytes;
  }

  // The key of a module's chunk's gradient reduction, armed by that chunk's last backward (every
  // module but an interleaved LLM has one chunk).
  int64_t arm_key(int64_t module, int64_t chunk) const {
    return chunk * static_cast<int64_t>(plan_.modules.size()) + module;
  }

  // Op `op`, being built, waits for message `key` / sends `s` (after its others).
  void wait_for(Op* op, const MsgKey& key) {
    if (op->waits == 0) op->wait_begin = static_cast<int64_t>(waits_.size());
    WEFT_ASSERT(op->wait_begin + op->waits == static_cast<int64_t>(waits_.size()),
                "an op's waits are added together");
    waits_.push_back(key);
    ++op->waits;
  }
  void send(Op* op, Send s) {
    if (op->sends == 0) op->send_begin = static_cast<int64_t>(sends_.size());
    WEFT_ASSERT(op->send_begin + op->sends == static_cast<int64_t>(sends_.size()),
                "an op's sends are added together");
    sends_.push_back(std::move(s));
    ++op->sends;
  }

  // Adds a step-end collective to rank r's ops; returns its index (-1: none, a single rank or no
  // time).
  int64_t add_collective(int64_t r, std::string name, const std::vector<int64_t>& ranks,
                         double seconds, double last_bucket = 0, int64_t armed_by = -1,
                         int64_t after = -1) {
    if (ranks.size() <= 1 || seconds <= 0) return -1;
    const auto key = std::make_pair(name, ranks.front());
    auto it = collective_index_.find(key);
    if (it == collective_index_.end()) {
      Collective c;
      c.name = name;
      c.ranks = ranks;
      c.seconds = seconds;
      c.last_bucket_seconds = last_bucket;
      c.armed_by = armed_by;
      c.after = after;
      c.arrived.assign(ranks.size(), false);
      it = collective_index_.emplace(key, static_cast<int64_t>(collectives_.size())).first;
      collectives_.push_back(std::move(c));
    }
    Op op;
    op.name = std::move(name);
    op.cat = Cat::kCollective;
    op.collective = it->second;
    ops_[r].push_back(std::move(op));
    return it->second;
  }

  void build_encoder(int64_t r, int64_t e, bool forward_pass) {
    const ModulePlan& m = mod(e);
    const ModulePlan& llm = mod(llm_);
    const Coord c = m.coord(r);
    const int64_t s = c.pp, P = m.layout.pp, tp = m.layout.tp, cp = m.layout.cp;
    const bool first = s == 0, last = s == P - 1;
    const StageCost& sc = costs_[e][s];
    const EncoderSpec& es = enc_spec(e);
    // Tokens per unit of data (a sample: its items').
    const double T = static_cast<double>(es.tokens_per_item()) * o_.data.items_of(m.encoder),
                 h = static_cast<double>(es.hidden);
    const double H = static_cast<double>(spec_.model.llm.hidden);
    const auto tp_group = m.group(r, {Axis::kTp}), cp_group = m.group(r, {Axis::kCp});
    const auto neighbour = [&](int64_t stage) { return m.rank_of({c.tp, c.cp, c.dp, stage}); };
    const bool sp = m.layout.sequence_parallel();
    const double seq_split = sp ? static_cast<double>(tp) : 1;
    if (forward_pass) result_.ranks[r].stages.push_back(m.name + " s" + std::to_string(s));
    if (!forward_pass && !stage_backward(e, s)) return;
    for (int64_t mb = 0; mb < M_; ++mb) {
      const EncoderShare share = share_of(e, mb, c.dp);
      if (share.samples() <= 0) continue;
      const double n = share.samples();
      const double tokens = n * T / static_cast<double>(cp);  // this rank's
      // Memory's share: the peak's, whose bytes per sample the FLOP model's table holds; a
      // profile's bytes are per mean sample (its items per sample), so its share the mean's.
      const double n_peak = sc.measured ? n : share_of(e, mb, c.dp, true).samples();
      const double act_bytes = kept_activation_bytes(sc, n_peak, m.layout);
      const double kv = n * T * 2 * h / static_cast<double>(tp) * act_;  // gathered K and V
      const double blocks = static_cast<double>(sc.blocks), bytes = tokens * h * act_;
      if (forward_pass) {
        // TP (tp_blocks_forward_comm), CP's K/V all-gather per block, the last stage's all-gather
        // of the projected features over CP (under sequence parallelism, of the encoder's output
        // over TP first).
        const double comm =
            tp_blocks_forward_comm(tp_group, blocks, bytes, sp) +
            blocks * all_gather(cp_group, kv) +
            (last ? all_gather(cp_group, n * T * H * act_) + (sp ? all_gather(tp_group, bytes) : 0)
                  : 0);
        Op op = compute(e, true, mb, s, sc, n, static_cast<double>(tp * cp), comm);
        if (!first) wait_for(&op, {kEncAct, e, mb, neighbour(s - 1), r});
        if (!last) {
          send(&op, {{kEncAct, e, mb, r, neighbour(s + 1)}, bytes / seq_split});
        } else if (c.tp == 0 && c.cp == 0) {  // bridge: items to the replicas' first LLM stage
          for (int64_t d = 0; d < D_; ++d) {
            const double of_d = share.overlap(d, mb_samples_[mb]);
            if (of_d <= 0) continue;
            const double bytes = of_d * T * H * act_ / static_cast<double>(llm.layout.cp);
            for (int64_t lcp = 0; lcp < llm.layout.cp; ++lcp)
              for (int64_t ltp = 0; ltp < llm.layout.tp; ++ltp) {
                const int64_t dst = llm.rank_of({ltp, lcp, d, 0});
                send(&op, {{kBridge, e, mb, r, dst}, bytes});
              }
          }
        }
        if (stage_backward(e, s)) op.keep_bytes = act_bytes;
        ops_[r].push_back(std::move(op));
        continue;
      }
      // (A recomputed block runs its forward's collectives again. Under sequence parallelism
      // the first stage gathers its tokens' gradient over TP for the front end, run whole.)
      const double blocks_back = m.weight_grads ? blocks : 0;
      const double again = static_cast<double>(sc.recompute_blocks);
      const double rate = hiding_seconds_per_flop(spec_, cl_, o_, m.weight_grads, sc, n,
                                                  static_cast<double>(tp * cp), flops_per_second_);
      const double comm = tp_blocks_backward_comm(tp_group, blocks_back, bytes, sp, true,
                                                  encoder_column_flops(es), tokens, rate) +
                          blocks_back * reduce_scatter(cp_group, kv) +
                          (sc.recompute ? tp_blocks_forward_comm(tp_group, again, bytes, sp) +
                                              again * all_gather(cp_group, kv)
                                        : 0) +
                          (first && sp && m.weight_grads ? all_gather(tp_group, bytes) : 0);
      Op op = compute(e, false, mb, s, sc, n, static_cast<double>(tp * cp), comm);
      if (last) {  // from tp-rank 0 of every CP rank of the first LLM stage of each replica
        for (int64_t d = 0; d < D_; ++d) {
          if (share.overlap(d, mb_samples_[mb]) <= 0) continue;
          for (int64_t lcp = 0; lcp < llm.layout.cp; ++lcp)
            wait_for(&op, {kBridgeGrad, e, mb, llm.rank_of({0, lcp, d, 0}), r});
        }
      } else {
        wait_for(&op, {kEncGrad, e, mb, neighbour(s + 1), r});
      }
      if (!first && m.weight_grads)
        send(&op, {{kEncGrad, e, mb, r, neighbour(s - 1)}, bytes / seq_split});
      backward_bytes(&op, sc, n_peak, m.layout);
      if (mb == M_ - 1) op.arms = arm_key(e, 0);
      ops_[r].push_back(std::move(op));
    }
  }

  void build_llm(int64_t r) {
    const ModulePlan& m = mod(llm_);
    const Coord c = m.coord(r);
    const int64_t P = m.layout.pp, V = m.layout.vp;
    for (int64_t k = 0; k < V; ++k)
      result_.ranks[r].stages.push_back(m.name + " s" + std::to_string(k * P + c.pp));
    // The rank's collective groups, the same for each of its ops.
    LlmGroups g{m.group(r, {Axis::kTp}), m.group(r, {Axis::kCp}), {r}};
    if (spec_.model.llm.moe.enabled()) g.ep = expert_group(r, false);
    for (const PipelineOp& op : pipeline_schedule(P, V, M_, c.pp, m.needs_backward()))
      build_llm_op(r, op.chunk * P + c.pp, op.forward, op.microbatch, g);
  }

  struct LlmGroups {
    std::vector<int64_t> tp, cp, ep;
  };

  // The forward or backward of microbatch `mb` through the LLM's (virtual) stage s on rank r.
  void build_llm_op(int64_t r, int64_t s, bool fwd, int64_t mb, const LlmGroups& groups) {
    const ModulePlan& m = mod(llm_);
    const LlmSpec& l = spec_.model.llm;
    const Coord c = m.coord(r);
    const int64_t P = m.layout.pp, tp = m.layout.tp, cp = m.layout.cp, d = c.dp;
    const bool first = s == 0, last = s == m.layout.stages() - 1;
    const StageCost& sc = costs_[llm_][s];
    const double S = seq_, H = static_cast<double>(l.hidden);
    const double kv_width = static_cast<double>(l.head_dim() * l.kv_heads);
    const std::vector<int64_t>& tp_group = groups.tp;
    const std::vector<int64_t>& cp_group = groups.cp;
    // The rank of (virtual) stage `stage` beside this one: pipeline rank stage mod pp.
    const auto neighbour = [&](int64_t stage) { return m.rank_of({c.tp, c.cp, d, stage % P}); };
    const auto sizes = [&](int64_t mb, double* n, double* tokens, double* kv) {
      *n = static_cast<double>(mb_samples_[mb]);
      *tokens = *n * S / static_cast<double>(cp);
      *kv = *n * S * 2 * kv_width / static_cast<double>(tp) * act_;
    };
    const double blocks = static_cast<double>(sc.blocks);
    // MoE blocks: a dispatch and a combine all-to-all over the EP group each way, of the rank's
    // token rows (1/slices of them with expert TP 1 < tp: then each such block gathers its
    // output over TP instead of all-reducing it, and its backward gathers the input gradient).
    const double moe = static_cast<double>(sc.moe_blocks);
    // Recomputed blocks, whose forwards' collectives run again in backward.
    const double again = static_cast<double>(sc.recompute_blocks),
                 again_moe = static_cast<double>(sc.recompute_moe_blocks);
    const int64_t slices = tp / m.layout.expert_tp();
    const std::vector<int64_t>& ep_group = groups.ep;
    // One exchange moves top_k rows per token (flops.h moe_all_to_all_bytes is both).
    const double a2a_per_token = moe_all_to_all_bytes(l, LlmTokens{1, 1, 1}, 0, act_) / 2;
    // Of `of` MoE blocks (default: all the stage's).
    const bool sp = m.layout.sequence_parallel();
    const auto moe_comm = [&](double tokens, double of = -1) {
      const double k = of < 0 ? moe : of;
      if (k == 0) return 0.0;
      const double bytes = a2a_per_token * tokens / static_cast<double>(slices);
      if (slices == 1) return 2 * k * all_to_all(ep_group, bytes);
      // The experts' output gathered (an all-gather) in place of the MLP's all-reduce, or under
      // SP of its reduce-scatter (the block gathered its tokens whole for the router: block_comm).
      const double full = tokens * H * act_;
      return 2 * k * all_to_all(ep_group, bytes) +
             k * (sp ? -reduce_scatter(tp_group, full)
                     : all_gather(tp_group, full) - all_reduce(tp_group, full));
    };
    // Sequence parallelism (tp_blocks_forward_comm): besides, an MoE block gathers its tokens whole
    // each way (in backward in place of re-gathering its MLP's input, which its experts kept
    // whole), the last stage gathers the final hidden states for the loss, and the first stage's
    // backward gathers its tokens' gradient for the embedding and the features.
    const double seq_split = sp ? static_cast<double>(tp) : 1;
    const ColumnFlops columns = llm_column_flops(l), moe_columns{columns.qkv, 0};
    // A forward's (fwd) or a backward's TP collectives; a forward's over `of` blocks, `of_moe` of
    // them MoE (default: the stage's).
    const auto block_comm = [&](double tokens, bool fwd, double n, double of = -1,
                                double of_moe = -1) {
      const double bytes = tokens * H * act_;
      const double k = of < 0 ? blocks : of, k_moe = of_moe < 0 ? moe : of_moe;
      if (fwd)
        return tp_blocks_forward_comm(tp_group, k, bytes, sp) +
               (sp ? k_moe * all_gather(tp_group, bytes) : 0);
      const double moe_gather = sp && !m.weight_grads ? moe * all_gather(tp_group, bytes) : 0;
      const double rate = hiding_seconds_per_flop(spec_, cl_, o_, m.weight_grads, sc, n,
                                                  static_cast<double>(tp * cp), flops_per_second_);
      return tp_blocks_backward_comm(tp_group, blocks - moe, bytes, sp, m.weight_grads, columns,
                                     tokens, rate) +
             tp_blocks_backward_comm(tp_group, moe, bytes, sp, m.weight_grads, moe_columns, tokens,
                                     rate) +
             moe_gather;
    };
    const auto forward = [&](int64_t mb) {
      double n, tokens, kv;
      sizes(mb, &n, &tokens, &kv);
      // TP: 2 all-reduces per block (block_comm), the vocab-parallel embedding's, and the fused
      // vocab-parallel loss's two fp32 reductions over its rows, the loss targets (the max; the
      // sum of exponentials with the target logit) and, where backward follows, its rows'
      // gradient's all-reduce (made in forward, model/cross_entropy.h); CP: one all-gather of K
      // and V together per block; EP: see moe_comm.
      const double rows = n * targets_ / static_cast<double>(cp);
      const double comm =
          block_comm(tokens, true, n) + (first ? all_reduce(tp_group, tokens * H * act_) : 0) +
          (last && sp ? all_gather(tp_group, tokens * H * act_) : 0) +
          (last ? loss_reductions(tp_group, rows) +
                      (m.needs_backward() ? all_reduce(tp_group, rows * H * act_) : 0)
                : 0) +
          blocks * all_gather(cp_group, kv) + moe_comm(tokens);
      Op op = compute(llm_, true, mb, s, sc, n, static_cast<double>(tp * cp), comm);
      op.llm = true;
      if (first) {
        for (int64_t e = 0; e < llm_; ++e) {
          if (mod(e).role != ModuleRole::kEncoder) continue;
          const ModulePlan& em = mod(e);
          for (const auto& [i, items] : encoder_ranks_of(e, mb, d))
            wait_for(&op, {kBridge, e, mb, em.rank_of({0, 0, i, em.layout.pp - 1}), r});
        }
      } else {
        wait_for(&op, {kLlmAct, s, mb, neighbour(s - 1), r});
      }
      if (!last)
        send(&op, {{kLlmAct, s + 1, mb, r, neighbour(s + 1)}, tokens * H * act_ / seq_split});
      if (m.needs_backward()) op.keep_bytes = kept_activation_bytes(sc, n, m.layout);
      ops_[r].push_back(std::move(op));
    };
    const auto backward = [&](int64_t mb) {
      double n, tokens, kv;
      sizes(mb, &n, &tokens, &kv);
      // TP: the column-parallel inputs' gradients (2 per block; the loss's rows' went in
      // forward); CP: the K and V gradients' reduce-scatter (one per block).
      const double comm =
          block_comm(tokens, false, n) +
          (first && sp ? all_gather(tp_group, tokens * H * act_) : 0) +
          blocks * reduce_scatter(cp_group, kv) + moe_comm(tokens) +
          (sc.recompute ? block_comm(tokens, true, n, again, again_moe) +
                              again * all_gather(cp_group, kv) + moe_comm(tokens, again_moe)
                        : 0);
      Op op = compute(llm_, false, mb, s, sc, n, static_cast<double>(tp * cp), comm);
      op.llm = true;
      if (!last) wait_for(&op, {kLlmGrad, s, mb, neighbour(s + 1), r});
      if (!first) {
        send(&op, {{kLlmGrad, s - 1, mb, r, neighbour(s - 1)}, tokens * H * act_ / seq_split});
      } else if (c.tp == 0) {  // bridge backward: feature gradients to the encoder ranks
        for (int64_t e = 0; e < llm_; ++e) {
          if (mod(e).role != ModuleRole::kEncoder || !mod(e + 1).needs_backward()) continue;
          const ModulePlan& em = mod(e);
          const double T =
              static_cast<double>(enc_spec(e).tokens_per_item()) * o_.data.items_of(em.encoder);
          for (const auto& [i, items] : encoder_ranks_of(e, mb, d))
            for (int64_t ecp = 0; ecp < em.layout.cp; ++ecp)
              for (int64_t etp = 0; etp < em.layout.tp; ++etp) {
                const int64_t dst = em.rank_of({etp, ecp, i, em.layout.pp - 1});
                send(&op, {{kBridgeGrad, e, mb, r, dst},
                           items * T * H * act_ / static_cast<double>(cp)});
              }
        }
      }
      backward_bytes(&op, sc, n, m.layout);
      if (mb == M_ - 1) op.arms = arm_key(llm_, s / P);  // the last backward of its chunk
      ops_[r].push_back(std::move(op));
    };
    if (fwd)
      forward(mb);
    else
      backward(mb);
  }

  // What rank r holds of module i for the step (rank_chunks).
  StageCost rank_cost(int64_t i, int64_t r) const {
    const ModulePlan& m = mod(i);
    return rank_chunks(costs_[i], m.layout.pp, m.layout.vp, m.coord(r).pp);
  }

  // Static memory and the step-end collectives of module i's stage on rank r.
  void build_module_end(int64_t r, int64_t i) {
    const ModulePlan& m = mod(i);
    const Holding held = rank_holding(rank_cost(i, r), m.layout, spec_.train.zero_stage == 1,
                                      zero1_bf16_params(spec_));
    result_.ranks[r].static_bytes += held.total();
    // Gradients are summed over the CP × DP group, experts apart over their expert-data-parallel
    // group; under ZeRO-1 by a reduce-scatter (each rank gets its shard's sums: the bytes of an
    // all-gather). When overlapped, each chunk's reduction starts with its own last backward (the
    // runtime arms each chunk's buckets then), the last chunk's first (backward order), each
    // queueing behind the one before on the module's group.
    const double bucket = spec_.train.grad_bucket_mb * 1024 * 1024;
    const bool overlap = spec_.train.overlap_grad_reduce;
    const bool zero1 = spec_.train.zero_stage == 1;
    const auto seconds = [&](const std::vector<int64_t>& g, double bytes) {
      return zero1 ? ring(o_.grad_curve, g, bytes, false, CollectiveAlgo::kRing)
                   : ring(o_.grad_curve, g, bytes, true, o_.grad_reduce_algo);
    };
    const int64_t P = m.layout.pp, s = m.coord(r).pp, V = m.layout.vp;
    int64_t after = -1, expert_after = -1;
    for (int64_t k = V - 1; k >= 0; --k) {
      const Holding chunk =
          rank_holding(costs_[i][k * P + s], m.layout, spec_.train.zero_stage == 1);
      const std::string of = V > 1 ? " (chunk " + std::to_string(k) + ")" : "";
      const auto reduce = [&](const std::string& name, const std::vector<int64_t>& g, double bytes,
                              int64_t* prev) {
        if (bytes <= 0) return;
        const int64_t c =
            add_collective(r, name + of, g, seconds(g, bytes), seconds(g, std::min(bytes, bucket)),
                           overlap ? arm_key(i, k) : -1, overlap ? *prev : -1);
        if (c >= 0) *prev = c;
      };
      const std::string kind = zero1 ? " grad reduce-scatter" : " grad all-reduce";
      reduce(m.name + kind, m.group(r, {Axis::kCp, Axis::kDp}), chunk.grads - chunk.expert_grads,
             &after);
      if (chunk.expert_grads > 0)  // (only the LLM's ranks have an expert group)
        reduce(m.name + " expert" + kind, expert_group(r, true), chunk.expert_grads, &expert_after);
    }
  }

  void sequence_partial_reduce(int64_t r, int64_t i) {
    const ModulePlan& m = mod(i);
    const double bytes = rank_cost(i, r).partial_grad_bytes;
    if (!m.layout.sequence_parallel() || bytes <= 0) return;
    const std::vector<int64_t> tp = m.group(r, {Axis::kTp});
    add_collective(r, m.name + " sequence-parallel grad all-reduce", tp,
                   blocking(blocking_curve(), tp, bytes, CollectiveKind::kAllReduce));
  }

  void build_rank(int64_t r) {
    // Room for its forwards and backwards (per microbatch: each chunk of the LLM, each encoder
    // stage it hosts) and a few more.
    int64_t passes = 0;
    for (int64_t i = 0; i <= llm_; ++i)
      if (mod(i).hosts(r)) passes += i == llm_ ? mod(i).layout.vp : 1;
    ops_[r].reserve(static_cast<size_t>(2 * M_ * passes + 16));
    // The whole global batch's layout on every rank, and the media of the items this rank's
    // first encoder stages read.
    double data = static_cast<double>(plan_.global_batch) * o_.data_seconds_per_sample;
    for (int64_t e = 0; e < llm_; ++e) {
      const ModulePlan& m = mod(e);
      const auto media = o_.media_seconds_per_sample.find(m.name);
      if (m.role != ModuleRole::kEncoder || !m.hosts(r) || m.coord(r).pp != 0 ||
          media == o_.media_seconds_per_sample.end())
        continue;
      for (int64_t mb = 0; mb < M_; ++mb)
        data += share_of(e, mb, m.coord(r).dp).samples() * media->second;
    }
    if (data > 0) {
      Op op;
      op.name = "data";
      op.cat = Cat::kData;
      op.seconds = data;
      ops_[r].push_back(std::move(op));
    }
    std::vector<int64_t> world(static_cast<size_t>(plan_.world_size));
    for (int64_t k = 0; k < plan_.world_size; ++k) world[k] = k;
    // Media read from files can be bad: the ranks then agree on the bad records of the step
    // (one int32 per sample and one flag, a maximum over the world) before it runs.
    if (spec_.data.media_from_files())
      add_collective(
          r, "bad-media agreement", world,
          blocking(blocking_curve(), world, 4.0 * static_cast<double>(plan_.global_batch + 1),
                   CollectiveKind::kAllReduce));
    std::vector<int64_t> encoders;
    for (int64_t i = 0; i < llm_; ++i)
      if (mod(i).role == ModuleRole::kEncoder && mod(i).hosts(r)) encoders.push_back(i);
    const ModulePlan& llm = mod(llm_);
    for (int64_t e : encoders) build_encoder(r, e, true);
    if (llm.hosts(r)) build_llm(r);
    for (int64_t e : encoders) build_encoder(r, e, false);
    for (int64_t e : encoders) build_module_end(r, e);
    if (llm.hosts(r)) {
      build_module_end(r, llm_);
      const Coord c = llm.coord(r);
      const int64_t P = llm.layout.pp;
      if (spec_.model.llm.tie_embeddings && P > 1 && llm.weight_grads &&
          (c.pp == 0 || c.pp == P - 1)) {
        const std::vector<int64_t> pair = {llm.rank_of({c.tp, c.cp, c.dp, 0}),
                                           llm.rank_of({c.tp, c.cp, c.dp, P - 1})};
        // Under ZeRO-1 the pair sums only their shard of it (of the CP × DP group's).
        const double shards =
            spec_.train.zero_stage == 1 ? static_cast<double>(llm.layout.cp * llm.layout.dp) : 1;
        const double bytes = 4.0 * static_cast<double>(spec_.model.llm.vocab) *
                             static_cast<double>(spec_.model.llm.hidden) /
                             static_cast<double>(llm.layout.tp) / shards;
        add_collective(r, "llm tied embedding all-reduce", pair,
                       blocking(blocking_curve(), pair, bytes, CollectiveKind::kAllReduce));
      }
    }
    // Under sequence parallelism the gradients of the parameters every TP rank holds whole but
    // applies to its part of the sequence (norms, row-parallel biases) are summed over TP, after
    // the DP sums, one module at a time (encoders, then the LLM), fp32 and never sharded.
    for (int64_t i : encoders) sequence_partial_reduce(r, i);
    if (llm.hosts(r)) sequence_partial_reduce(r, llm_);
    add_collective(r, "loss and grad-norm all-reduce", world,
                   2 * blocking(blocking_curve(), world, 8, CollectiveKind::kAllReduce));
    // AdamW reads parameter, gradient and two moments and writes three: 7 fp32 per parameter.
    // Under ZeRO-1 a rank steps only its share of the CP × DP group's parameters.
    // Measured stages charge their measured optimizer seconds instead.
    double grad_bytes = 0, measured_seconds = 0;
    for (size_t i = 0; i < plan_.modules.size(); ++i) {
      const ModulePlan& m = plan_.modules[i];
      if (m.role == ModuleRole::kProjector || !m.hosts(r)) continue;
      const StageCost sc = rank_cost(static_cast<int64_t>(i), r);
      const Holding held = rank_holding(sc, m.layout, spec_.train.zero_stage == 1);
      if (sc.measured)
        measured_seconds += sc.optimizer_seconds * held.step_fraction;
      else
        grad_bytes += sc.grad_bytes * held.step_fraction;
    }
    const double hbm = cl_.device.hbm_bytes_per_second;
    const double seconds = measured_seconds + (hbm > 0 ? 7 * grad_bytes / hbm : 0);
    if (o_.optimizer_step && seconds > 0) {
      Op op;
      op.name = "optimizer";
      op.cat = Cat::kOptimizer;
      op.seconds = seconds;
      ops_[r].push_back(std::move(op));
    }
    // ZeRO-1: every rank then takes the parameters the others stepped: an all-gather of the
    // trainable parameters over each group that shards their moments, module by module, in the
    // compute dtype (bf16: half the fp32 bytes). Overlapped (train.overlap_param_gather), the
    // gathers run from the step's start, one after another in the runtime's launch order
    // (encoders, LLM, experts), and each module's first forward on this rank waits for its first
    // bucket and ends no sooner than its last (simplified: later layers' buckets arrive while
    // the earlier ones compute). Not on CPU ranks, where Gloo's work takes the computing core
    // (comm_occupies_rank): there the gathers follow the optimizer step.
    if (spec_.train.zero_stage != 1) return;
    const double wire = zero1_gather_fraction(spec_);
    const bool overlap = spec_.train.overlap_param_gather && !o_.comm_occupies_rank;
    const double bucket = wire * spec_.train.grad_bucket_mb * 1024 * 1024;
    double launched = 0;  // overlapped: where this rank's gathers so far end
    for (size_t i = 0; i < plan_.modules.size(); ++i) {
      const ModulePlan& m = plan_.modules[i];
      if (m.role == ModuleRole::kProjector || !m.hosts(r)) continue;
      const Holding held = rank_holding(rank_cost(static_cast<int64_t>(i), r), m.layout, true);
      Op* first_forward = nullptr;
      for (Op& op : ops_[r])
        if (op.module == static_cast<int64_t>(i) && op.cat == Cat::kForward) {
          first_forward = &op;
          break;
        }
      const auto gather = [&](const std::string& name, const std::vector<int64_t>& g,
                              double bytes) {
        if (bytes <= 0 || g.size() <= 1) return;
        const double seconds = ring(o_.grad_curve, g, bytes, false, CollectiveAlgo::kRing);
        if (!overlap) {
          add_collective(r, name, g, seconds);
          return;
        }
        launched += seconds;  // whether or not a forward here waits for it: in launch order
        result_.ranks[r].gather_buffer_bytes += bytes;
        if (first_forward == nullptr) return;  // no items: it lands while the rank waits
        const double first =
            ring(o_.grad_curve, g, std::min(bytes, bucket), false, CollectiveAlgo::kRing);
        const double begin = launched - seconds;
        first_forward->gather_first = std::max(first_forward->gather_first, begin + first);
        first_forward->gather_last = std::max(first_forward->gather_last, launched);
        first_forward->gather_name = name;
      };
      gather(m.name + " ZeRO-1 parameter all-gather", m.group(r, {Axis::kCp, Axis::kDp}),
             wire * (held.grads - held.expert_grads));
      if (held.expert_grads > 0)
        gather(m.name + " ZeRO-1 expert parameter all-gather", expert_group(r, true),
               wire * held.expert_grads);
    }
  }

  // ---- the event loop ------------------------------------------------------------------------

  // An op's name: a forward's or backward's made from its module, microbatch and stage.
  std::string name_of(const Op& op) const {
    if (op.cat != Cat::kForward && op.cat != Cat::kBackward) return op.name;
    return (op.module == llm_ ? std::string("llm") : mod(op.module).name) +
           (op.cat == Cat::kForward ? " fwd mb" : " bwd mb") + std::to_string(op.mb) + " s" +
           std::to_string(op.stage);
  }

  // A trace event (SimOptions::trace); `name` is only called then.
  template <typename Name>
  void record(int64_t r, const Name& name, Cat cat, double start, double seconds) {
    if (o_.trace && seconds > 0)
      result_.trace.push_back({name(), to_string(cat), r, start, seconds});
  }

  static constexpr int kContentionPasses = 3;

  // Each op's share of its time during which another rank on its node ran forward / backward /
  // data work in the last pass, and its duration from it.
  void apply_contention() {
    const size_t R = ops_.size();
    for (size_t r = 0; r < R; ++r) {
      std::vector<std::pair<double, double>> others;  // busy intervals of the node's other ranks
      for (size_t q = 0; q < R; ++q)
        if (q != r && cl_.node_of(static_cast<int64_t>(q)) == cl_.node_of(static_cast<int64_t>(r)))
          for (const Op& op : ops_[q])
            if (op.cat == Cat::kForward || op.cat == Cat::kBackward || op.cat == Cat::kData)
              others.push_back({op.last_start, op.last_end});
      std::sort(others.begin(), others.end());
      std::vector<std::pair<double, double>> merged;
      for (const auto& iv : others) {
        if (!merged.empty() && iv.first <= merged.back().second)
          merged.back().second = std::max(merged.back().second, iv.second);
        else
          merged.push_back(iv);
      }
      for (Op& op : ops_[r]) {
        if (op.shared_extra == 0) continue;
        const double len = op.last_end - op.last_start;
        double overlap = 0;
        for (const auto& [a, b] : merged)
          overlap += std::max(0.0, std::min(b, op.last_end) - std::max(a, op.last_start));
        const double f = len > 0 ? overlap / len : 0;
        op.seconds = op.base + f * op.shared_extra;
      }
    }
  }

  // Clears what a pass accumulates.
  void reset_pass() {
    for (RankReport& rep : result_.ranks) {
      rep.busy_seconds = rep.comm_seconds = rep.collective_seconds = 0;
      rep.optimizer_seconds = rep.data_seconds = rep.peak_activation_bytes = 0;
    }
    for (Collective& c : collectives_) c.arrived.assign(c.ranks.size(), false), c.count = 0;
    result_.trace.clear();
    result_.step_seconds = 0;
    llm_compute_end_ = 0;
  }

  // Each wait's slot is its index in waits_. Each send finds its receiver's slot by key among
  // that rank's waits (sorted: a few hundred keys, not a table of every message), once. A send
  // no op waits for gets none; a wait no op sends never arrives (execute reports the deadlock).
  // Each collective op learns its rank's place in the collective.
  void link() {
    using Expected = std::pair<MsgKey, int64_t>;  // key, slot
    std::vector<std::vector<Expected>> expected(ops_.size());
    for (size_t r = 0; r < ops_.size(); ++r) {
      for (Op& op : ops_[r]) {
        for (int64_t j = op.wait_begin; j < op.wait_begin + op.waits; ++j)
          expected[r].push_back({waits_[static_cast<size_t>(j)], j});
        if (op.collective >= 0) {
          const std::vector<int64_t>& ranks = collectives_[op.collective].ranks;
          op.slot = std::find(ranks.begin(), ranks.end(), static_cast<int64_t>(r)) - ranks.begin();
          WEFT_ASSERT(op.slot < static_cast<int64_t>(ranks.size()), "rank ", r,
                      " is not in collective ", name_of(op));
        }
      }
      std::sort(expected[r].begin(), expected[r].end());
      for (size_t i = 1; i < expected[r].size(); ++i)
        WEFT_ASSERT(expected[r][i - 1].first != expected[r][i].first, "rank ", r,
                    " waits twice for ", to_string(expected[r][i].first));
    }
    std::vector<char> sent(waits_.size(), 0);
    std::vector<MsgKey> unwaited;
    for (Send& s : sends_) {
      const std::vector<Expected>& at = expected[static_cast<size_t>(std::get<4>(s.key))];
      const auto it =
          std::lower_bound(at.begin(), at.end(), s.key,
                           [](const Expected& e, const MsgKey& k) { return e.first < k; });
      s.slot = it != at.end() && it->first == s.key ? it->second : -1;
      if (s.slot < 0) {
        unwaited.push_back(s.key);
        continue;
      }
      WEFT_ASSERT(!sent[static_cast<size_t>(s.slot)], to_string(s.key), " sent twice");
      sent[static_cast<size_t>(s.slot)] = 1;
    }
    std::sort(unwaited.begin(), unwaited.end());
    for (size_t i = 1; i < unwaited.size(); ++i)
      WEFT_ASSERT(unwaited[i - 1] != unwaited[i], to_string(unwaited[i]), " sent twice");
  }

  // One pass over the ops: each rank runs its ops in order, an op once its messages are there
  // (and a collective once every rank of it reached it). Event-driven: a rank that blocks is
  // taken up again only when what it waits for happens (the message sent, the collective's last
  // rank arrived), lowest rank first, so a pass costs time linear in the ops.
  void execute() {
    reset_pass();
    const size_t R = ops_.size();
    std::vector<size_t> cursor(R, 0);
    std::vector<double> free_at(R, 0), activations(R, 0);
    std::vector<double> arrival(waits_.size(),
                                -1);  // when each wait's message is there (< 0: not yet)
    std::vector<int64_t> waiter(waits_.size(), -1);                      // the rank blocked on it
    std::vector<std::map<int64_t, std::pair<double, double>>> armed(R);  // module → [start, end)
    busy_.assign(R, {});
    window_start_.assign(R, 0);
    std::priority_queue<size_t, std::vector<size_t>, std::greater<size_t>> ready;
    std::vector<char> queued(R, 1);
    for (size_t r = 0; r < R; ++r) ready.push(r);
    const auto wake = [&](size_t q) {
      if (!queued[q]) queued[q] = 1, ready.push(q);
    };
    while (!ready.empty()) {
      const size_t r = ready.top();
      ready.pop();
      queued[r] = 0;
      RankReport& rep = result_.ranks[r];
      while (cursor[r] < ops_[r].size()) {
        const Op& op = ops_[r][cursor[r]];
        if (op.collective >= 0) {
          Collective& c = collectives_[op.collective];
          const size_t me = static_cast<size_t>(op.slot);
          if (!c.arrived[me]) c.arrived[me] = true, ++c.count;
          if (c.count < static_cast<int64_t>(c.ranks.size())) break;
          run_collective(c, &cursor, &free_at, armed);
          for (int64_t q : c.ranks) wake(static_cast<size_t>(q));
          continue;
        }
        double start = free_at[r];
        bool ready_now = true;
        for (int64_t id = op.wait_begin; id < op.wait_begin + op.waits; ++id) {
          if (arrival[static_cast<size_t>(id)] < 0) {
            waiter[static_cast<size_t>(id)] = static_cast<int64_t>(r);
            ready_now = false;
            break;
          }
          start = std::max(start, arrival[static_cast<size_t>(id)]);
        }
        if (!ready_now) break;
        // The exposed part of an overlapped parameter gather: before the op, and after it.
        if (op.gather_first > start) {
          rep.collective_seconds += op.gather_first - start;
          record(
              static_cast<int64_t>(r), [&] { return op.gather_name + " (wait)"; }, Cat::kCollective,
              start, op.gather_first - start);
          start = op.gather_first;
        }
        const double compute_end = start + op.seconds;
        const double end = std::max(compute_end, op.gather_last);
        if (end > compute_end) {
          rep.collective_seconds += end - compute_end;
          record(
              static_cast<int64_t>(r), [&] { return op.gather_name + " (wait)"; }, Cat::kCollective,
              compute_end, end - compute_end);
        }
        ops_[r][cursor[r]].last_start = start;
        ops_[r][cursor[r]].last_end = compute_end;
        for (int64_t j = op.send_begin; j < op.send_begin + op.sends; ++j) {
          const Send& s = sends_[static_cast<size_t>(j)];
          if (s.slot < 0) continue;  // nobody waits for it
          const size_t slot = static_cast<size_t>(s.slot);
          arrival[slot] = end + message(static_cast<int64_t>(r), std::get<4>(s.key), s.bytes);
          if (waiter[slot] >= 0) wake(static_cast<size_t>(waiter[slot]));
        }
        if (op.arms >= 0 && !o_.comm_occupies_rank) armed[r][op.arms] = {start, compute_end};
        activations[r] += op.keep_bytes;
        rep.peak_activation_bytes = std::max(rep.peak_activation_bytes, activations[r]);
        activations[r] -= op.free_bytes;
        if (op.cat == Cat::kOptimizer) {
          rep.optimizer_seconds += op.seconds;
        } else if (op.cat == Cat::kData) {
          rep.data_seconds += op.seconds;
          window_start_[r] = end;
        } else {
          rep.busy_seconds += op.seconds;
          rep.comm_seconds += op.comm_seconds;
          busy_[r].push_back({start, compute_end});
        }
        if (op.llm) llm_compute_end_ = std::max(llm_compute_end_, end);
        record(
            static_cast<int64_t>(r), [&] { return name_of(op); }, op.cat, start, op.seconds);
        free_at[r] = end;
        ++cursor[r];
      }
    }
    for (size_t r = 0; r < R; ++r) {
      WEFT_ASSERT(cursor[r] == ops_[r].size(), "the simulated step deadlocks: rank ", r,
                  " cannot run ", name_of(ops_[r][cursor[r]]));
      result_.step_seconds = std::max(result_.step_seconds, free_at[r]);
    }
  }

  void run_collective(Collective& c, std::vector<size_t>* cursor, std::vector<double>* free_at,
                      const std::vector<std::map<int64_t, std::pair<double, double>>>& armed) {
    // Without overlap it starts when every rank reached it; with overlap a rank is ready from
    // the start of the last backward that arms it, and the last bucket follows its end; behind
    // the collective it queues after, on the same group.
    double start = c.after >= 0 ? collectives_[c.after].last_end : 0, backward_end = 0;
    for (int64_t r : c.ranks) {
      double ready = (*free_at)[r], end = (*free_at)[r];
      auto it = c.armed_by >= 0 ? armed[r].find(c.armed_by) : armed[r].end();
      if (it != armed[r].end()) ready = it->second.first, end = it->second.second;
      start = std::max(start, ready);
      backward_end = std::max(backward_end, end);
    }
    const double end = c.armed_by >= 0
                           ? std::max(start + c.seconds, backward_end + c.last_bucket_seconds)
                           : start + c.seconds;
    c.last_end = end;
    for (int64_t r : c.ranks) {
      double& f = (*free_at)[r];
      if (end > f) {
        const double from = std::max(f, start);
        result_.ranks[r].collective_seconds += end - from;
        record(
            r, [&] { return c.name; }, Cat::kCollective, from, end - from);
        f = end;
      }
      ++(*cursor)[r];
    }
  }

  double llm_compute_end_ = 0;                                // end of the last LLM op
  std::vector<std::vector<std::pair<double, double>>> busy_;  // per rank: forward / backward ops
  std::vector<double> window_start_;  // per rank: where its pipeline work may start (after data)

  void summarise() {
    SimResult& res = result_;
    const int64_t B = plan_.global_batch;
    res.tokens_per_step = static_cast<double>(B) * seq_;
    res.tokens_per_second = res.step_seconds > 0 ? res.tokens_per_step / res.step_seconds : 0;
    for (size_t i = 0; i < plan_.modules.size(); ++i) {
      double per_unit = 0;
      for (const StageCost& sc : costs_[i])
        per_unit += sc.forward_flops + sc.backward_flops - sc.recompute_flops;
      res.model_flops += per_unit * static_cast<double>(B);
      if (static_cast<int64_t>(i) == llm_) res.llm_flops = per_unit * static_cast<double>(B);
    }
    const double peak = cl_.device.peak_flops(spec_.train.precision) *
                        static_cast<double>(plan_.world_size) * res.step_seconds;
    res.mfu = peak > 0 ? res.model_flops / peak : 0;
    res.mfu_llm_only = peak > 0 ? res.llm_flops / peak : 0;
    double idle = 0, total = 0;
    for (RankReport& rep : res.ranks) {
      rep.peak_memory_bytes =
          rep.static_bytes + std::max(rep.peak_activation_bytes, rep.gather_buffer_bytes);
      res.memory_fits =
          res.memory_fits && rep.peak_memory_bytes <= cl_.device.usable_memory_bytes();
      if (!mod(llm_).hosts(rep.rank) || llm_compute_end_ <= 0) continue;
      double busy = 0;  // within [start, llm_compute_end_)
      const double start = window_start_[rep.rank];
      for (const auto& [a, b] : busy_[rep.rank])
        busy += std::max(0.0, std::min(b, llm_compute_end_) - a);
      idle += llm_compute_end_ - start - busy;
      total += llm_compute_end_ - start;
    }
    res.bubble_fraction = total > 0 ? idle / total : 0;
  }
};

}  // namespace

StageCost rank_chunks(const std::vector<StageCost>& stages, int64_t pp, int64_t vp, int64_t s) {
  StageCost sum = stages[static_cast<size_t>(s)];
  for (int64_t k = 1; k < vp; ++k) {
    const StageCost& x = stages[static_cast<size_t>(k * pp + s)];
    sum.param_bytes += x.param_bytes;
    sum.copy_bytes += x.copy_bytes;
    sum.trained_cast_bytes += x.trained_cast_bytes;
    sum.train_state_bytes += x.train_state_bytes;
    sum.grad_bytes += x.grad_bytes;
    sum.partial_grad_bytes += x.partial_grad_bytes;
    sum.expert_param_bytes += x.expert_param_bytes;
    sum.expert_train_state_bytes += x.expert_train_state_bytes;
    sum.expert_grad_bytes += x.expert_grad_bytes;
    sum.expert_copy_bytes += x.expert_copy_bytes;
    sum.expert_trained_cast_bytes += x.expert_trained_cast_bytes;
    sum.optimizer_seconds += x.optimizer_seconds;
  }
  return sum;
}

double zero1_gather_fraction(const Spec& spec) {
  return spec.train.precision == Precision::kBf16 ? 0.5 : 1.0;
}

bool zero1_bf16_params(const Spec& spec) {
  return spec.train.zero_stage == 1 && zero1_gather_fraction(spec) < 1;
}

Holding rank_holding(const StageCost& sc, const Layout& l, bool zero1, bool bf16_params) {
  const int64_t etp = l.expert_tp();
  const double tp = static_cast<double>(l.tp), experts = static_cast<double>(l.ep * etp);
  const double group = static_cast<double>(l.cp * l.dp);                    // CP × DP
  const double edp = static_cast<double>(l.tp / etp * l.cp * l.dp / l.ep);  // expert DP
  const double dense_grad = (sc.grad_bytes - sc.expert_grad_bytes) / tp;
  const double expert_grad = sc.expert_grad_bytes / experts;
  const double expert_moments = sc.expert_train_state_bytes - sc.expert_grad_bytes;
  const double dense_moments = sc.train_state_bytes - sc.grad_bytes - expert_moments;
  const double dense_share = zero1 ? 1 / group : 1, expert_share = zero1 ? 1 / edp : 1;
  Holding h;
  h.params = (sc.param_bytes + sc.copy_bytes - sc.expert_param_bytes - sc.expert_copy_bytes) / tp +
             (sc.expert_param_bytes + sc.expert_copy_bytes) / experts;
  h.grads = dense_grad + expert_grad;
  h.moments = dense_moments / tp * dense_share + expert_moments / experts * expert_share;
  h.expert_grads = l.ep > 1 || etp != l.tp ? expert_grad : 0;
  if (zero1 && bf16_params) {
    // The trainable parameters' fp32 bytes are their gradients': each sharded one held in bf16
    // (half of them), its casts gone, and this rank's share of them as fp32 masters.
    const auto narrow = [&](double grad, double casts, double share) {
      h.params -= grad / 2 + casts;
      h.moments += grad * share;
    };
    if (group > 1)
      narrow(dense_grad, (sc.trained_cast_bytes - sc.expert_trained_cast_bytes) / tp, dense_share);
    if (edp > 1) narrow(expert_grad, sc.expert_trained_cast_bytes / experts, expert_share);
  }
  const double stepped = dense_grad * dense_share + expert_grad * expert_share;
  h.step_fraction = sc.grad_bytes > 0 ? stepped / sc.grad_bytes : 0;
  return h;
}

double CommCurve::at(double b) const {
  WEFT_ASSERT(!bytes.empty() && bytes.size() == seconds.size(), "an empty cost curve");
  if (bytes.size() == 1 || b <= bytes.front()) return seconds.front();
  size_t k = 1;
  while (k + 1 < bytes.size() && bytes[k] < b) ++k;
  const double t = (b - bytes[k - 1]) / (bytes[k] - bytes[k - 1]);
  return std::max(0.0, seconds[k - 1] + t * (seconds[k] - seconds[k - 1]));
}

double compute_seconds(const StageCost& sc, bool forward, double n, double split,
                       double flops_per_second, bool shared, double block_overhead_seconds) {
  const auto part = [&](double total, double replicated) {
    return n * ((total - replicated) / split + replicated);
  };
  if (!sc.measured) {
    const double blocks =
        static_cast<double>(forward ? sc.blocks : sc.backward_blocks + sc.recompute_blocks);
    return block_overhead_seconds * blocks +
           (forward ? part(sc.forward_flops, sc.replicated_forward_flops)
                    : part(sc.backward_flops, sc.replicated_backward_flops)) /
               flops_per_second;
  }
  if (shared)
    return forward ? sc.forward_fixed_seconds_shared +
                         part(sc.forward_seconds_shared, sc.replicated_forward_seconds_shared)
                   : sc.backward_fixed_seconds_shared +
                         part(sc.backward_seconds_shared, sc.replicated_backward_seconds_shared);
  return forward
             ? sc.forward_fixed_seconds + part(sc.forward_seconds, sc.replicated_forward_seconds)
             : sc.backward_fixed_seconds +
                   part(sc.backward_seconds, sc.replicated_backward_seconds);
}

double hiding_seconds_per_flop(const Spec& spec, const Cluster& cluster, const SimOptions& o,
                               bool weight_grads, const StageCost& sc, double n, double split,
                               double flops_per_second) {
  if (!spec.train.overlap_tp_comm || o.comm_occupies_rank || !weight_grads ||
      shared_memory_collectives(spec, cluster))
    return 0;
  const double flops = n * ((sc.backward_flops - sc.replicated_backward_flops) / split +
                            sc.replicated_backward_flops);
  return flops > 0 ? compute_seconds(sc, false, n, split, flops_per_second) / flops : 0;
}

double column_backward_comm(double blocks, double reduce, double regather,
                            const ColumnFlops& columns, double tokens, double tp,
                            double seconds_per_flop) {
  double exposed = 0;
  for (double f : {columns.qkv, columns.mlp_in}) {
    const double matmul = f > 0 ? seconds_per_flop * tokens * f / tp : 0;
    exposed += std::max(0.0, reduce - matmul) + std::max(0.0, regather - matmul);
  }
  return blocks * exposed;
}

double kept_activation_bytes(const StageCost& sc, double n, const Layout& layout) {
  const double replicated = std::min(sc.replicated_activation_bytes, sc.activation_bytes);
  const double split = sc.activation_bytes - replicated;
  const double whole = std::min(sc.whole_activation_bytes, split);
  const double tp = static_cast<double>(layout.tp), cp = static_cast<double>(layout.cp);
  return n * (((split - whole) / tp + whole) / cp + replicated) +
         (sc.measured ? sc.activation_fixed_bytes : 0);
}

void take_activation_bytes(CostTable* time, const CostTable& memory) {
  WEFT_ASSERT(time->size() == memory.size(), "take_activation_bytes: tables of other plans");
  for (size_t i = 0; i < time->size(); ++i) {
    WEFT_ASSERT((*time)[i].size() == memory[i].size(), "take_activation_bytes: other stages");
    for (size_t s = 0; s < memory[i].size(); ++s) {
      StageCost& t = (*time)[i][s];
      const StageCost& m = memory[i][s];
      t.activation_bytes = m.activation_bytes;
      t.whole_activation_bytes = m.whole_activation_bytes;
      t.replicated_activation_bytes = m.replicated_activation_bytes;
      t.recompute_peak_bytes = m.recompute_peak_bytes;
      t.recompute_peak_whole_bytes = m.recompute_peak_whole_bytes;
    }
  }
}

namespace {

CostTable flop_stage_costs(const Spec& spec, const Plan& plan, const DataShape& data) {
  CostTable table(plan.modules.size());
  for (size_t i = 0; i < plan.modules.size(); ++i) {
    const ModulePlan& m = plan.modules[i];
    if (m.role == ModuleRole::kProjector) continue;
    const ModuleCosts costs = sample_costs(spec, m, data);
    for (int64_t s = 0; s < m.layout.stages(); ++s) {
      StageCost sc;
      const auto [begin, end] = m.stage_layers(s);
      if (s == 0) add(&sc, costs.front, m.layout);
      if (s == 0 && m.role == ModuleRole::kEncoder) {  // before the tokens split over tp·cp
        sc.replicated_forward_flops = costs.front.forward;
        sc.replicated_backward_flops = costs.front.input_grad + costs.front.weight_grad;
        sc.replicated_activation_bytes = costs.front.activation_bytes;
      }
      for (int64_t b = begin; b < end; ++b) {
        const LayerCost& l = costs.blocks[static_cast<size_t>(b)];
        add(&sc, l, m.layout);
        if (l.input_grad + l.weight_grad > 0) ++sc.backward_blocks;
        if (m.role == ModuleRole::kLlm && spec.model.llm.moe.is_moe_layer(b)) ++sc.moe_blocks;
      }
      if (s == m.layout.stages() - 1) add(&sc, costs.back, m.layout);
      sc.blocks = end - begin;
      table[i].push_back(sc);
    }
  }
  return table;
}

}  // namespace

CostTable stage_costs(const Spec& spec, const Plan& plan, const DataShape& data) {
  CostTable table = flop_stage_costs(spec, plan, data.mean());
  if (data.distinct_peak())
    take_activation_bytes(&table, flop_stage_costs(spec, plan, data.peak()));
  return table;
}

SimResult simulate(const Spec& spec, const Plan& plan, const Cluster& cluster,
                   const SimOptions& options) {
  const Spec s = with_vocab(spec, options);
  return simulate(s, plan, cluster, stage_costs(s, plan, options.data), options);
}

SimResult simulate(const Spec& spec, const Plan& plan, const Cluster& cluster,
                   const CostTable& costs, const SimOptions& options) {
  check_data_shape(spec, options.data, spec.source);
  WEFT_CHECK(plan.world_size <= cluster.world_size(), "[simulate] the plan needs ", plan.world_size,
             " ranks but the cluster ", cluster.source, " has ", cluster.nodes, " x ",
             cluster.gpus_per_node, " = ", cluster.world_size(), " devices");
  WEFT_CHECK(costs.size() == plan.modules.size(), "[simulate] cost table for ", costs.size(),
             " modules, plan has ", plan.modules.size());
  for (size_t i = 0; i < plan.modules.size(); ++i) {
    const ModulePlan& m = plan.modules[i];
    const size_t want =
        m.role == ModuleRole::kProjector ? 0 : static_cast<size_t>(m.layout.stages());
    WEFT_CHECK(costs[i].size() == want, "[simulate] cost table of module '", m.name, "' has ",
               costs[i].size(), " stages (expected ", want, ")");
  }
  const Spec s = with_vocab(spec, options);
  return Engine(s, plan, cluster, costs, options).run();
}

std::string to_json(const SimResult& r) {
  nlohmann::ordered_json j;
  j["step_seconds"] = r.step_seconds;
  j["tokens_per_step"] = r.tokens_per_step;
  j["tokens_per_second"] = r.tokens_per_second;
  j["model_flops"] = r.model_flops;
  j["llm_flops"] = r.llm_flops;
  j["mfu"] = r.mfu;
  j["mfu_llm_only"] = r.mfu_llm_only;
  j["bubble_fraction"] = r.bubble_fraction;
  j["memory_fits"] = r.memory_fits;
  auto& ranks = j["ranks"] = nlohmann::ordered_json::array();
  for (const RankReport& k : r.ranks)
    ranks.push_back({{"rank", k.rank},
                     {"stages", k.stages},
                     {"busy_seconds", k.busy_seconds},
                     {"comm_seconds", k.comm_seconds},
                     {"collective_seconds", k.collective_seconds},
                     {"optimizer_seconds", k.optimizer_seconds},
                     {"data_seconds", k.data_seconds},
                     {"static_bytes", k.static_bytes},
                     {"peak_activation_bytes", k.peak_activation_bytes},
                     {"gather_buffer_bytes", k.gather_buffer_bytes},
                     {"peak_memory_bytes", k.peak_memory_bytes}});
  return j.dump(2);
}

std::string chrome_trace(const SimResult& r) { return chrome_trace(r.trace); }

std::vector<double> stage_peak_bytes(const SimResult& r, const std::string& module, int64_t pp) {
  std::vector<double> peak(static_cast<size_t>(pp), 0.0);
  const std::string prefix = module + " s";
  for (const RankReport& k : r.ranks)
    for (const std::string& stage : k.stages)
      if (stage.compare(0, prefix.size(), prefix) == 0) {
        double& p = peak[std::stoul(stage.substr(prefix.size())) % peak.size()];
        p = std::max(p, k.peak_memory_bytes);
      }
  return peak;
}

}  // namespace weft::plan
