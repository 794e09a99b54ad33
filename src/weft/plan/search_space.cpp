// The layout search's tree and its analytic bound (search_space.h).
#include "weft/plan/search_space.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "weft/core/error.h"
#include "weft/plan/encoder_share.h"
#include "weft/plan/partition.h"
#include "weft/plan/profile.h"

namespace weft::plan::search_space {

namespace {
std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d * d <= n; ++d)
    if (n % d == 0) {
      out.push_back(d);
      if (d * d != n) out.push_back(n / d);
    }
  std::sort(out.begin(), out.end());
  return out;
}

// `spec` with module m recomputing `on`, over `blocks` (recompute_blocks').
Spec with_recompute(Spec spec, const ModulePlan& m, bool on, const std::vector<int64_t>& blocks) {
  if (m.role == ModuleRole::kLlm) {
    spec.model.llm.recompute = on;
    spec.model.llm.recompute_blocks = blocks;
  } else {
    EncoderSpec& e = spec.model.encoders[static_cast<size_t>(m.encoder)];
    e.recompute = on;
    e.recompute_blocks = blocks;
  }
  return spec;
}

// Microbatch sizes of one LLM replica as runs of equal sizes: {samples, count}, in order.
std::vector<std::pair<int64_t, int64_t>> microbatch_runs(int64_t per, int64_t M) {
  const int64_t base = per / M, extra = per % M;
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (extra > 0) runs.push_back({base + 1, extra});
  if (M - extra > 0) runs.push_back({base, M - extra});
  return runs;
}

// How many of M microbatches have the first (larger) size.
int64_t first_run(int64_t per, int64_t M) { return microbatch_runs(per, M).front().second; }

}  // namespace

Space::Space(const Spec& spec, const Cluster& cluster, const SearchOptions& options)
    : spec_(spec), cl_(cluster), o_(options) {
  costed_ = spec;
  if (costed_.model.llm.vocab == 0) costed_.model.llm.vocab = o_.sim.unset_vocab;
  // Candidates recompute a module's every block or none (apply_candidate).
  costed_.model.llm.recompute_blocks.clear();
  for (EncoderSpec& e : costed_.model.encoders) e.recompute_blocks.clear();
  E_ = static_cast<int64_t>(spec.model.encoders.size());
  B_ = spec.train.batch;
  max_ranks_ = o_.max_ranks > 0 ? o_.max_ranks : cluster.world_size();
  WEFT_CHECK(max_ranks_ <= cluster.world_size(), "[plan] --world-size ", max_ranks_,
             " is more than the ", cluster.world_size(), " devices of ", cluster.source);
  gpn_ = cluster.gpus_per_node;
  const int64_t max_tp = o_.max_tp > 0 ? o_.max_tp : gpn_;
  flops_ = cluster.device.effective_flops(spec.train.precision);
  WEFT_CHECK(flops_ > 0, cluster.source, ": device \"", cluster.device.name, "\" has no ",
             to_string(spec.train.precision), " FLOP/s");
  act_ = spec.train.precision == Precision::kBf16 ? 2.0 : 4.0;
  data_ = o_.sim.data_seconds_per_sample * static_cast<double>(B_);
  const LlmSpec& l = spec.model.llm;
  S_ = o_.sim.data.empty() ? static_cast<double>(l.max_seq) : o_.sim.data.positions;
  H_ = static_cast<double>(l.hidden);
  kvw_ = static_cast<double>(l.head_dim() * l.kv_heads);
  for (const std::string& p : o_.placements) {
    const auto* it = std::find(std::begin(kPlacementNames), std::end(kPlacementNames), p);
    WEFT_CHECK(it != std::end(kPlacementNames), "[plan] unknown placement \"", p,
               "\" (expected colocated, separate or megatron)");
    const int kind = static_cast<int>(it - std::begin(kPlacementNames));
    if (std::find(placements_.begin(), placements_.end(), kind) == placements_.end())
      placements_.push_back(kind);
  }
  // Without encoders every placement is the same plan: search it once.
  if (E_ == 0 && placements_.size() > 1) placements_.resize(1);

  // The modules' flags (frozen rules) from the config's own plan on one rank.
  Spec base = costed_;
  base.parallel.placement = "colocated";
  for (auto& [name, layout] : base.parallel.modules) layout = LayoutSpec{};
  base.train.microbatches = 1;
  base_ = make_plan(base, 1);
  const auto pow2_upto = [](int64_t limit, auto ok) {
    std::vector<int64_t> out;
    for (int64_t v = 1; v <= limit; v *= 2)
      if (v == 1 || ok(v)) out.push_back(v);
    return out;
  };
  for (int64_t k = 0; k <= E_; ++k) {
    ModuleInfo mi;
    mi.llm = k == E_;
    mi.plan_index = static_cast<size_t>(mi.llm ? 2 * E_ : 2 * k);
    const ModulePlan& m = base_.modules[mi.plan_index];
    mi.weight_grads = m.weight_grads;
    if (mi.llm) {
      mi.backward = m.needs_backward();
      mi.keeps_activations = mi.backward;
      for (int64_t t = 1; t <= max_tp; ++t) {
        bool ok = l.heads % t == 0 && l.kv_heads % t == 0 && l.ffn % t == 0 &&
                  (l.vocab == 0 || l.vocab % t == 0);
        if (l.moe.enabled())
          ok =
              ok && l.expert_ffn() % t == 0 && (l.moe.shared_ffn == 0 || l.moe.shared_ffn % t == 0);
        if (ok) mi.tps.push_back(t);
      }
      mi.cps = pow2_upto(o_.max_cp, [&](int64_t c) {
        return static_cast<double>(l.max_seq) / static_cast<double>(c) >=
               static_cast<double>(o_.min_cp_tokens);
      });
      mi.max_pp = std::min(l.layers, o_.max_pp);
      if (l.moe.enabled())
        for (int64_t e : divisors(l.moe.experts))
          if (o_.max_ep <= 0 || e <= o_.max_ep) mi.eps.push_back(e);
    } else {
      const EncoderSpec& e = spec.model.encoders[static_cast<size_t>(k)];
      mi.enc = &e;
      mi.items = o_.sim.data.items_of(k);
      mi.peak_items = o_.sim.data.peak_items_of(k);
      mi.backward = base_.modules[mi.plan_index + 1].needs_backward();  // its projector
      mi.keeps_activations = m.weight_grads;
      for (int64_t t = 1; t <= max_tp; ++t)
        if (e.heads % t == 0 && e.ffn % t == 0 &&
            (e.projector.kind != ProjectorKind::kMlp || l.hidden % t == 0))
          mi.tps.push_back(t);
      mi.cps = pow2_upto(o_.max_cp,
                         [&](int64_t c) { return !e.class_token && e.tokens_per_item() % c == 0; });
      mi.max_pp = std::min(m.layers, o_.max_encoder_pp);
    }
    info_.push_back(mi);
  }
  for (int64_t k = 0; k <= E_; ++k)
    info_[static_cast<size_t>(k)].min_unit_seconds =
        o_.profile ? least_unit_seconds(k)
                   : staged(static_cast<int>(k), 1, false, false, false).unit_seconds;
  trains_ = false;
  for (const ModulePlan& m : base_.modules) trains_ = trains_ || m.weight_grads;
}

// ---- costs --------------------------------------------------------------------------------

const Staged& Space::staged(int k, int64_t pp, bool recompute, bool even, bool vocab_parallel,
                            bool sp, int64_t vp, const std::vector<int64_t>& blocks_in,
                            const std::vector<int64_t>& cut) const {
  const std::vector<int64_t> blocks = recompute ? blocks_in : std::vector<int64_t>{};
  auto& slot = staged_[{k, pp, vp, recompute, even, vocab_parallel, sp, blocks, cut}];
  if (slot) return *slot;
  auto st = std::make_unique<Staged>();
  ModulePlan m = base_.modules[info(k).plan_index];
  m.layout = Layout{};
  m.layout.pp = pp * vp;  // an interleaved LLM's chunks priced as stages of their own
  pp *= vp;
  // Costs are for the whole stage; tp picks the loss, and lets sp take effect.
  m.layout.tp = vocab_parallel || sp ? 2 : 1;
  m.layout.sp = sp;
  if (!cut.empty()) {
    WEFT_CHECK(vp == 1 && static_cast<int64_t>(cut.size()) == pp - 1,
               "search: a given cut of module ", m.name, " needs pp - 1 = ", pp - 1,
               " boundaries and vp = 1");
    st->boundaries = cut;
  } else if (pp > 1 && even) {  // Megatron: layers split evenly over the stages
    for (int64_t i = 1; i < pp; ++i) st->boundaries.push_back((2 * i * m.layers + pp) / (2 * pp));
  } else if (pp > 1 && vp > 1) {  // interleaved chunks: make_plan's default cut
    st->boundaries = even_cuts(o_.profile ? profile_module_costs(*o_.profile, costed_, m, 1)
                                          : sample_costs(costed_, m, o_.sim.data),
                               pp);
  } else if (pp > 1 && o_.profile) {  // the measured split, every block recomputed or none
    PartitionOptions po;
    po.stages = pp;
    const Spec priced = with_recompute(costed_, m, recompute && blocks.empty(), {});
    st->boundaries =
        partition_stages(profile_module_costs(*o_.profile, priced, m, 1), po).boundaries;
  } else if (pp > 1) {  // the exact FLOP-balanced split of the recompute-aware layer costs
    ModuleCosts costs = sample_costs(costed_, m, o_.sim.data);
    if (recompute && blocks.empty()) {
      std::vector<StageCost> one(static_cast<size_t>(m.layers));
      ModulePlan per_block = m;  // one "stage" per block, to price each block's recompute
      per_block.layout.pp = m.layers;
      per_block.stage_boundaries.clear();
      for (int64_t b = 1; b < m.layers; ++b) per_block.stage_boundaries.push_back(b);
      add_recompute_costs(costed_, per_block, &one, {}, o_.sim.data);
      for (size_t b = 0; b < one.size(); ++b) {
        costs.blocks[b].input_grad += one[b].backward_flops;
        costs.blocks[b].activation_bytes += one[b].activation_bytes;  // <= 0: the saving
        costs.blocks[b].copy_bytes += one[b].copy_bytes;              // <= 0: none kept
      }
    }
    PartitionOptions po;
    po.stages = pp;
    st->boundaries = partition_stages(costs, po).boundaries;
  }
  m.stage_boundaries = st->boundaries;
  Plan one;
  one.modules = {m};
  if (o_.profile) {
    // Measured, with the real interleaved layout: the LLM's per-stage work (mask, RoPE tables) is
    // its first chunk's only.
    one.modules[0].layout.pp = pp / vp;
    one.modules[0].layout.vp = vp;
    st->stages =
        profile_stage_costs(*o_.profile, with_recompute(costed_, m, recompute, blocks), one)[0];
  } else {
    // planner_costs: time on the data's mean sample, activation memory on its peak.
    st->stages = planner_costs(with_recompute(costed_, m, recompute, blocks), one, o_.sim)[0];
  }
  for (const StageCost& sc : st->stages) {
    const bool shared = sc.measured && sc.shared_measured;  // each op the cheaper of the two
    st->unit_seconds += !sc.measured
                            ? (sc.forward_flops + sc.backward_flops) / flops_
                            : std::min(sc.forward_seconds,
                                       shared ? sc.forward_seconds_shared : sc.forward_seconds) +
                                  std::min(sc.backward_seconds, shared ? sc.backward_seconds_shared
                                                                       : sc.backward_seconds);
  }
  slot = std::move(st);
  return *slot;
}

// Profile: module k's seconds per unit of data, summed over its layers, each layer's forward and
// backward (separate ops) each the cheaper of alone and under load (a sum of per-stage minimums
// can be below the minimum of the sums: this is below every cut's), nothing recomputed.
double Space::least_unit_seconds(int64_t k) const {
  ModulePlan m = base_.modules[info(k).plan_index];
  m.layout = Layout{};
  const Spec plain = with_recompute(costed_, m, false, {});
  ModuleCosts c[2][2];  // [shared][units]
  for (int shared = 0; shared < 2; ++shared)
    for (int units = 0; units < 2; ++units)
      c[shared][units] = profile_module_costs(*o_.profile, plain, m, units, 1, 1, shared == 1);
  const auto layer_of = [](const ModuleCosts& mc, size_t i) -> const LayerCost& {
    if (i == 0) return mc.front;
    return i <= mc.blocks.size() ? mc.blocks[i - 1] : mc.back;
  };
  const auto per_unit = [&](int shared, size_t i, bool forward) {
    const LayerCost &one = layer_of(c[shared][1], i), &none = layer_of(c[shared][0], i);
    return forward ? one.forward - none.forward
                   : one.input_grad + one.weight_grad - none.input_grad - none.weight_grad;
  };
  double total = 0;
  for (size_t i = 0; i < c[0][0].blocks.size() + 2; ++i)
    for (bool forward : {true, false})
      total += std::max(0.0, std::min(per_unit(0, i, forward), per_unit(1, i, forward)));
  return total;
}

// A collective over n ranks spanning `span` consecutive ranks, over the cheapest link such a
// group can have (one node when span <= gpus_per_node). Activations and the fp32 sums may go
// through shared memory (cluster.h blocking_collective_seconds), gradients never. On one node a
// measured curve (SimOptions: the activations' for them, else the fp32 one) prices it as the
// simulator's ring does where the group sits on one node; the cluster's links where it straddles
// two: the cheaper. Where the simulator may take either of two prices (the fp32 sums' curve; the
// experts' all-to-all, which stays on Gloo), the cheaper keeps the bound a bound.
double Space::collective(CollectiveKind kind, int64_t n, int64_t span, double bytes,
                         Traffic traffic, CollectiveAlgo algo) const {
  if (n <= 1 || (traffic == kActivations && !o_.sim.tp_cp_comm)) return 0;
  const bool inter = span > gpn_;
  auto& ranks = groups_[{n, inter}];
  if (ranks.empty()) {  // a stand-in group on one node, or spanning two
    for (int64_t r = 0; r < n; ++r) ranks.push_back(inter && r > 0 ? gpn_ + r - 1 : r);
  }
  double link = kind == kAllReduce ? all_reduce_seconds(cl_, ranks, bytes, algo)
                                   : all_gather_seconds(cl_, ranks, bytes);
  if (traffic != kGradients) {
    link = std::min(link, blocking_collective_seconds(spec_, cl_, ranks, kind, bytes));
  }
  const CommCurve& curve = traffic == kActivations ? o_.sim.activation_curve : o_.sim.grad_curve;
  if (inter || curve.empty()) return link;
  const double m = static_cast<double>(n);
  double at = curve.at(2 * bytes / m);
  if (traffic == kReductions && !o_.sim.blocking_curve.empty())
    at = std::min(at, o_.sim.blocking_curve.at(2 * bytes / m));
  return std::min(link, (kind == kAllReduce ? 1.0 : 0.5) * (m - 1) * at);
}

// A message between ranks `stride` apart (0: unknown, at best on one node; there a measured
// curve or the link, the cheaper).
double Space::hop(double bytes, int64_t stride) const {
  const double link = message_seconds(spec_, cl_, 0, stride >= gpn_ ? gpn_ : 1, bytes);
  if (stride >= gpn_ || o_.sim.p2p_curve.empty()) return link;
  return std::min(link, o_.sim.p2p_curve.at(bytes));
}

// A measured op costs between its seconds alone and under load in the simulator (by the share of
// it another rank of its node computes beside): the cheaper of the two.
double Space::op_seconds(const StageCost& sc, bool forward, double n, double split) const {
  const double overhead = cl_.device.block_overhead_seconds;
  const double alone = compute_seconds(sc, forward, n, split, flops_, false, overhead);
  if (!sc.measured || !sc.shared_measured) return alone;
  return std::min(alone, compute_seconds(sc, forward, n, split, flops_, true, overhead));
}

// Module k's stage s on the rank with data-parallel index i, mirroring the simulator's ops.
Work Space::work(int64_t k, const Choice& c, int64_t s, int64_t i, const Node& n) const {
  const ModuleInfo& mi = info(k);
  const StageCost& sc = c.staged->stages[static_cast<size_t>(s)];
  const double tp = static_cast<double>(c.tp), cp = static_cast<double>(c.cp);
  const double split = tp * cp, blocks = static_cast<double>(sc.blocks);
  const bool first = s == 0, last = s == c.pp - 1;
  const int64_t span_cp = c.tp * (c.cp - 1) + 1;
  Work w;
  const int64_t group = c.cp * c.dp;
  const Layout layout = c.layout();
  const Holding held = hold(&w, sc, c, n);
  // The gradient reductions: the CP × DP group's, and the experts' over their expert-data-
  // parallel group (ranks ep · etp apart in token order). Overlapped, both start with the last
  // backward and run side by side; otherwise one after the other.
  const bool overlap = overlap_grads();
  // ZeRO-1 reduce-scatters (the bytes of an all-gather).
  const auto seconds = [&](int64_t ranks, int64_t span, double bytes) {
    return n.zero == 1
               ? collective(kAllGather, ranks, span, bytes, kGradients)
               : collective(kAllReduce, ranks, span, bytes, kGradients, o_.sim.grad_reduce_algo);
  };
  const auto reduce = [&](int64_t ranks, int64_t span, double bytes, size_t kind) {
    if (bytes <= 0 || ranks <= 1) return;
    const double bucket = spec_.train.grad_bucket_mb * 1024 * 1024;
    const double full = seconds(ranks, span, bytes);
    const double tail = overlap ? seconds(ranks, span, std::min(bytes, bucket)) : full;
    w.full = overlap ? std::max(w.full, full) : w.full + full;
    w.tail = overlap ? std::max(w.tail, tail) : w.tail + tail;
    w.reduce_full[kind] = full, w.reduce_tail[kind] = tail;
  };
  const int64_t etp = layout.expert_tp(), edp = c.tp / etp * group / c.ep;
  const int64_t span = c.tp * (group - 1) + 1, expert_span = etp * c.ep * (edp - 1) + 1;
  reduce(group, span, held.grads - held.expert_grads, 0);
  reduce(edp, expert_span, held.expert_grads, 1);
  const auto runs = microbatch_runs(B_ / n.D, n.M);
  // The backward's TP collectives of `blocks` blocks (the simulator's tp_blocks_backward_comm),
  // with its column-parallel linears' reductions and re-gathers hidden behind their matmuls.
  const bool sp = layout.sequence_parallel();
  const auto tp_backward = [&](double blocks, const ColumnFlops& columns, double units,
                               double tokens, double tp_ar, double tp_ag) {
    const double rate =
        hiding_seconds_per_flop(spec_, cl_, o_.sim, mi.weight_grads, sc, units, split, flops_);
    if (!sp) return column_backward_comm(blocks, tp_ar, 0, columns, tokens, tp, rate);
    return 2 * blocks * tp_ag + column_backward_comm(blocks, tp_ag, mi.weight_grads ? tp_ag : 0,
                                                     columns, tokens, tp, rate);
  };
  if (mi.llm) {
    const ColumnFlops columns = llm_column_flops(spec_.model.llm), moe_columns{columns.qkv, 0};
    w.backward = mi.backward;
    // MoE blocks (the simulator's moe_comm): two all-to-alls each way over the EP group (token
    // indices consecutive, ranks etp apart), and with etp = 1 < tp a TP all-gather in place of
    // the block's second all-reduce.
    const double moe = static_cast<double>(sc.moe_blocks);
    const int64_t etp = layout.expert_tp(), slices = c.tp / etp;
    for (size_t r = 0; r < runs.size(); ++r) {
      const double m = static_cast<double>(runs[r].first),
                   count = static_cast<double>(runs[r].second);
      const double tokens = m * S_ / cp, kv = m * S_ * 2 * kvw_ / tp * act_;
      const double tp_ar = collective(kAllReduce, c.tp, c.tp, tokens * H_ * act_, kActivations);
      const double cp_ag = collective(kAllGather, c.cp, span_cp, kv, kActivations);
      // Of k MoE blocks.
      const auto moe_comm_of = [&](double k) {
        if (k == 0) return 0.0;
        const double bytes = moe_all_to_all_bytes(spec_.model.llm, LlmTokens{1, 1, 1}, 0, act_) /
                             2 * tokens / static_cast<double>(slices);
        // The substitution as the simulator's moe_comm: under SP less a reduce-scatter, at least
        // the all-gather's price (cluster.h).
        const double ag = collective(kAllGather, c.tp, c.tp, tokens * H_ * act_, kActivations);
        return 2 * k * collective(kAllGather, c.ep, etp * (c.ep - 1) + 1, bytes, kActivations) +
               (slices > 1 ? k : 0) * (sp ? -ag : ag - tp_ar);
      };
      const double moe_comm = moe_comm_of(moe);
      // Sequence parallelism (the simulator's block_comm): a block's all-gather and reduce-
      // scatter cost at least two all-gathers (on a ring their all-reduce; through shared memory
      // less than it: cluster.h), tp_block; backward gathers the column-parallel inputs again where
      // the weights train (an MoE block its tokens instead), an MoE block gathers its tokens going
      // forward, the last stage its hidden states for the loss, the first stage's backward its
      // tokens' gradient.
      const double tp_ag =
          sp ? collective(kAllGather, c.tp, c.tp, tokens * H_ * act_, kActivations) : 0;
      const double tp_block = sp ? 2 * tp_ag : tp_ar;
      const double f = op_seconds(sc, true, m, split) + 2 * blocks * tp_block +
                       (first ? tp_ar : 0) + blocks * cp_ag + moe_comm +
                       (moe + (last ? 1 : 0)) * tp_ag;
      w.fwd += count * f;
      const double to_next = last ? 0 : hop(tokens * H_ * act_ / (sp ? tp : 1), c.size() / c.pp);
      if (r == 0) w.first_fwd = f, w.hop_first = to_next;
      w.last_fwd = f, w.hop_last = to_next;
      if (!w.backward) continue;
      const double rb = static_cast<double>(sc.recompute_blocks),
                   rmoe = static_cast<double>(sc.recompute_moe_blocks);
      const double again =
          sc.recompute ? 2 * rb * tp_block + rb * cp_ag + moe_comm_of(rmoe) + rmoe * tp_ag : 0;
      const double b = op_seconds(sc, false, m, split) +
                       tp_backward(blocks - moe, columns, m, tokens, tp_ar, tp_ag) +
                       tp_backward(moe, moe_columns, m, tokens, tp_ar, tp_ag) + blocks * cp_ag +
                       moe_comm + ((mi.weight_grads ? 0 : moe) + (first ? 1 : 0)) * tp_ag + again;
      w.bwd += count * b;
      if (r == 0) w.first_bwd = b;
      w.last_bwd = b;
    }
    if (w.backward) {  // per microbatch kept; what a rank holds: works()
      w.act_first = kept_activation_bytes(sc, static_cast<double>(runs.front().first), layout);
      w.act_last = kept_activation_bytes(sc, static_cast<double>(runs.back().first), layout);
    }
    return w;
  }
  const EncoderSpec& e = *mi.enc;
  w.backward = last ? mi.backward : mi.weight_grads;
  const double T = static_cast<double>(e.tokens_per_item()) * mi.items,  // per unit (sample)
      h = static_cast<double>(e.hidden);
  for (size_t r = 0; r < runs.size(); ++r) {
    // Samples' worth of items (encoder_share).
    const double items = encoder_share(runs[r].first, mi.items, n.D, c.dp, i).samples();
    const double count = static_cast<double>(runs[r].second);
    if (items <= 0) continue;
    const double tokens = items * T / cp, kv = items * T * 2 * h / tp * act_;
    const double tp_ar = collective(kAllReduce, c.tp, c.tp, tokens * h * act_, kActivations);
    const double cp_ag = collective(kAllGather, c.cp, span_cp, kv, kActivations);
    // Sequence parallelism as for the LLM; the last stage gathers its output over TP.
    const double tp_ag =
        sp ? collective(kAllGather, c.tp, c.tp, tokens * h * act_, kActivations) : 0;
    const double tp_block = sp ? 2 * tp_ag : tp_ar;
    const double f =
        op_seconds(sc, true, items, split) + blocks * (2 * tp_block + cp_ag) +
        (last ? collective(kAllGather, c.cp, span_cp, items * T * H_ * act_, kActivations) + tp_ag
              : 0);
    w.fwd += count * f;
    // The last stage sends replica 0's items (data-parallel rank 0 holds the first) over the
    // bridge, one message per LLM replica.
    const double replica0 = std::min(items, static_cast<double>(runs[r].first));
    const double to_next = last ? hop(replica0 * T * H_ * act_ / static_cast<double>(n.llm.cp), 0)
                                : hop(tokens * h * act_ / (sp ? tp : 1), c.size() / c.pp);
    if (r == 0) w.first_fwd = f, w.hop_first = to_next;
    w.last_fwd = f, w.hop_last = to_next;
    if (!w.backward) continue;
    const double b =
        op_seconds(sc, false, items, split) +
        (mi.weight_grads
             ? tp_backward(blocks, encoder_column_flops(e), items, tokens, tp_ar, tp_ag) +
                   blocks * cp_ag + (first ? tp_ag : 0)
             : 0) +
        static_cast<double>(sc.recompute ? sc.recompute_blocks : 0) * (2 * tp_block + cp_ag);
    w.bwd += count * b;
    if (r == 0) w.first_bwd = b;
    w.last_bwd = b;
    // The FLOP model's bytes per sample are the peak's (take_activation_bytes): on the peak's
    // share of the items; a profile's per mean sample: on this share (as the simulator).
    const double held =
        sc.measured ? items : encoder_share(runs[r].first, mi.peak_items, n.D, c.dp, i).samples();
    w.act += count * kept_activation_bytes(sc, held, layout);
  }
  return w;
}

std::vector<Work> Space::works(int64_t k, const Choice& c, const Node& n,
                               std::vector<Work>* chunks) const {
  std::vector<Work> out;
  const int64_t P = c.pp, V = c.pp * c.vp;
  // The LLM's activations on rank s: what its schedule holds before its first backward (its
  // peak is no less; 1F1B: min(P - s, M) microbatches, the largest first), from the chunks' per
  // microbatch.
  const auto activations = [&](Work* r, const std::vector<Work>& cw, int64_t s) {
    if (!info(k).llm) return;  // (an encoder's: work())
    r->act = 0;
    if (!r->backward) return;
    const int64_t big = first_run(B_ / n.D, n.M);
    for (const PipelineOp& op : schedules(P, c.vp, n.M, true)[static_cast<size_t>(s)]) {
      if (!op.forward) break;
      const Work& x = cw[static_cast<size_t>(op.chunk * P + s)];
      r->act += op.microbatch < big ? x.act_first : x.act_last;
    }
  };
  if (c.vp == 1) {
    for (int64_t s = 0; s < P; ++s) out.push_back(work(k, c, s, 0, n));
    for (int64_t s = 0; s < P; ++s) activations(&out[static_cast<size_t>(s)], out, s);
    if (chunks) *chunks = out;
    return out;
  }
  // Interleaved: chunk v = j · P + s is virtual stage v of a pp · vp pipeline (its first and
  // last hold the embedding and the head; each hops to the next, the last of a round back to
  // rank 0), priced as a stage of its own.
  Choice virt = c;
  virt.pp = V, virt.vp = 1, virt.staged = c.chunks;
  std::vector<Work> cw;
  for (int64_t v = 0; v < V; ++v) cw.push_back(work(k, virt, v, 0, n));
  const bool overlap = overlap_grads();
  for (int64_t s = 0; s < P; ++s) {
    Work r = cw[static_cast<size_t>(s)];  // chunk 0: the rank's first forward and last backward
    r.fwd = r.bwd = 0;
    if (!overlap) r.full = r.tail = 0;
    for (int64_t j = 0; j < c.vp; ++j) {
      const Work& x = cw[static_cast<size_t>(j * P + s)];
      r.fwd += x.fwd, r.bwd += x.bwd;
      // Each chunk's reduction queues behind the one before (the runtime's GradSync per chunk):
      // chunk 0's, armed by the rank's last backward, ends it. Not overlapped: all of them.
      if (!overlap) r.full += x.full, r.tail += x.tail;
    }
    hold(&r, rank_chunks(c.chunks->stages, P, c.vp, s), c, n);  // one optimizer, one gather
    activations(&r, cw, s);
    out.push_back(r);
  }
  if (chunks) *chunks = std::move(cw);
  return out;
}

const std::vector<std::vector<PipelineOp>>& Space::schedules(int64_t pp, int64_t vp, int64_t M,
                                                             bool backward) const {
  auto& slot = schedules_[{pp, vp, M, backward}];
  if (slot.empty()) slot = pipeline_schedules(pp, vp, M, backward);
  return slot;
}

// What a rank of `c` holding `sc` (its stage, or its chunks summed) keeps and steps: its
// static bytes, optimizer work and (ZeRO-1) the all-gathers of its stepped parameters over its
// CP × DP group and its experts' expert-data-parallel group, as the simulator charges them.
Holding Space::hold(Work* w, const StageCost& sc, const Choice& c, const Node& n) const {
  const Layout layout = c.layout();
  const Holding held =
      rank_holding(sc, layout, n.zero == 1, n.zero == 1 && zero1_gather_fraction(spec_) < 1);
  w->static_bytes = held.total();
  w->opt_seconds = w->opt_bytes = w->gather = 0;
  if (sc.measured)
    w->opt_seconds = sc.optimizer_seconds * held.step_fraction;
  else
    w->opt_bytes = sc.grad_bytes * held.step_fraction;
  if (n.zero == 1) {
    const int64_t group = c.cp * c.dp, etp = layout.expert_tp(), edp = c.tp / etp * group / c.ep;
    const int64_t span = c.tp * (group - 1) + 1, expert_span = etp * c.ep * (edp - 1) + 1;
    const auto gather = [&](int64_t ranks, int64_t span_of, double b) {
      return b > 0 ? collective(kAllGather, ranks, span_of, b, kGradients) : 0.0;
    };
    const double wire = zero1_gather_fraction(spec_);
    w->gather = gather(group, span, wire * (held.grads - held.expert_grads)) +
                gather(edp, expert_span, wire * held.expert_grads);
  }
  return held;
}

double Space::optimizer_seconds(double bytes, double measured) const {
  if (!o_.sim.optimizer_step) return 0;
  const double hbm = cl_.device.hbm_bytes_per_second;
  return measured + (hbm > 0 ? 7 * bytes / hbm : 0);
}

// A representative rank: the modules it hosts in its op order (its encoders' forwards, the
// LLM, its encoders' backwards) and whether it is on the LLM's fill / drain chain (replica 0).
struct Space::Rank {
  std::vector<std::pair<int64_t, Work>> enc;  // {encoder, its stage's work}
  std::vector<int64_t> enc_stages;            // aligned with enc: each one's stage here
  int64_t enc_stage = -1;                     // separate placement: that encoder's stage
  std::optional<Work> llm;
  int64_t llm_stage = -1;
  bool chain = false;
  // Shared placements: per encoder, the time its microbatch 0 needs to reach this rank's stage
  // (through the encoder's earlier stages, on the ranks of the same data-parallel index); its
  // encoders' forwards end no earlier than enc_ready.
  std::vector<double> fill;
  double enc_ready = 0;
};

Space::Rank Space::rank_at(const Node& n, const std::vector<std::vector<Work>>& w,
                           int64_t r) const {
  Rank x;
  const auto at = [&](int64_t k, const Choice& c, int64_t* stage) -> std::optional<Work> {
    if (r < c.first_rank || r >= c.first_rank + c.size()) return std::nullopt;
    const int64_t q = (r - c.first_rank) / (c.tp * c.cp);
    const int64_t dp = q % c.dp;
    *stage = q / c.dp;
    if (dp != 0 && !info(k).llm) return work(k, c, *stage, dp, n);
    return w[static_cast<size_t>(k)][static_cast<size_t>(*stage)];
  };
  int64_t stage = 0;
  x.enc_ready = data_;
  for (size_t k = 0; k < n.enc.size(); ++k)
    if (auto wk = at(static_cast<int64_t>(k), n.enc[k], &stage)) {
      const Choice& c = n.enc[k];
      const int64_t dp = (r - c.first_rank) / (c.tp * c.cp) % c.dp;
      double fill = 0;
      for (int64_t j = 0; j < stage; ++j) {
        const Work below =
            dp == 0 ? w[k][static_cast<size_t>(j)] : work(static_cast<int64_t>(k), c, j, dp, n);
        fill += below.first_fwd + below.hop_first;
      }
      x.enc_ready = std::max(x.enc_ready, data_ + fill) + wk->fwd;
      x.enc.push_back({static_cast<int64_t>(k), *wk});
      x.enc_stages.push_back(stage);
      x.fill.push_back(fill);
    }
  x.llm = at(E_, n.llm, &x.llm_stage);
  x.chain = x.llm && r == x.llm_stage * (n.llm.size() / n.llm.pp);
  return x;
}

// The analytic lower bound of a node's (every completion's) simulated step, and the largest
// per-rank memory it certainly needs.
Bound Space::bound(const Node& n, double fits_limit, double over_limit, int64_t watch) const {
  if (n.partial >= 0) {
    // A pending node stands for its choices (expand_partial): the least of their bounds, time
    // and memory. Not the choice without recomputation alone: those whose cut moved with their
    // counts (rebalance) can be faster than the default cut, and need less memory than every
    // block recomputed on it.
    Bound out;
    out.feasible = false;
    for (const Node& c : pending_choices(n)) {
      const Bound b = bound(c, fits_limit, over_limit, watch);
      if (!b.feasible) continue;
      if (!out.feasible) {
        out = b;
        continue;
      }
      out.seconds = std::min(out.seconds, b.seconds);
      out.memory = std::min(out.memory, b.memory);
    }
    return out;
  }
  const bool shared = n.placement != kSeparate;
  const bool overlap = overlap_grads();
  const bool gather_overlapped = spec_.train.overlap_param_gather && !o_.sim.comm_occupies_rank;
  std::vector<std::vector<Work>> w(static_cast<size_t>(E_ + 1));
  for (size_t k = 0; k < n.enc.size(); ++k) w[k] = works(static_cast<int64_t>(k), n.enc[k], n);
  std::vector<Work> cw;  // the LLM's per virtual stage v = chunk · P + s (vp = 1: lw)
  const std::vector<Work>& lw = w[static_cast<size_t>(E_)] = works(E_, n.llm, n, &cw);
  const int64_t P = n.llm.pp;

  std::vector<Rank> ranks;
  if (shared) {  // the first rank of every stage of every module
    std::vector<int64_t> reps;
    for (size_t k = 0; k < n.enc.size(); ++k)
      for (int64_t s = 0; s < n.enc[k].pp; ++s)
        reps.push_back(n.enc[k].first_rank + s * n.enc[k].size() / n.enc[k].pp);
    for (int64_t s = 0; s < P; ++s) reps.push_back(s * n.llm.size() / P);
    std::sort(reps.begin(), reps.end());
    reps.erase(std::unique(reps.begin(), reps.end()), reps.end());
    for (int64_t r : reps) ranks.push_back(rank_at(n, w, r));
  } else {  // every module stage on its own ranks (data-parallel rank 0: the most items)
    for (size_t k = 0; k < n.enc.size(); ++k)
      for (size_t s = 0; s < w[k].size(); ++s) {
        Rank x;
        x.enc.push_back({static_cast<int64_t>(k), w[k][s]});
        x.enc_stages.push_back(static_cast<int64_t>(s));
        x.enc_stage = static_cast<int64_t>(s);
        ranks.push_back(std::move(x));
      }
    for (int64_t s = 0; s < P; ++s) {
      Rank x;
      x.llm = lw[static_cast<size_t>(s)];
      x.llm_stage = s;
      x.chain = true;
      ranks.push_back(std::move(x));
    }
  }

  // 1F1B fill and drain through the LLM's stages (replica 0): start[s] bounds the start of
  // stage s's first LLM op, end[s] the end of its last. The first waits for the encoders' first
  // microbatch: on its own rank (shared) or through every encoder's stages (separate).
  std::vector<double> enc_ready(static_cast<size_t>(P), data_), start(static_cast<size_t>(P)),
      end(static_cast<size_t>(P));
  // The end of the encoders' forward of the LLM's first / last microbatch (through their stages,
  // to their last one), at least; E0 from the end of the data op.
  double E0 = 0, enc_done = 0;
  for (const Rank& x : ranks)
    if (x.chain) enc_ready[static_cast<size_t>(x.llm_stage)] = x.enc_ready;
  if (shared)  // the LLM's microbatch m waits for every encoder's last stage to forward it
    for (size_t k = 0; k < n.enc.size(); ++k) {
      const Choice& c = n.enc[k];
      const Rank x = rank_at(n, w, c.first_rank + (c.pp - 1) * (c.size() / c.pp));
      double t = data_;
      for (size_t i = 0; i < x.enc.size(); ++i) {
        const Work& e = x.enc[i].second;
        const double begin = std::max(t, data_ + x.fill[i]);
        if (x.enc[i].first == static_cast<int64_t>(k)) {  // (the bridge may be rank-local)
          E0 = std::max(E0, begin + e.first_fwd - data_);
          enc_done = std::max(enc_done, begin + e.fwd);
          break;
        }
        t = begin + e.fwd;
      }
    }
  else
    for (size_t k = 0; k < n.enc.size(); ++k) {
      const std::vector<Work>& ew = w[k];
      // Microbatch 0 through the stages, in step time: each stage's first forward ends no
      // sooner than its rank's overlapped ZeRO-1 gather (launched at the step's start).
      const auto gate = [&](const Work& x) { return gather_overlapped ? x.gather : 0.0; };
      std::vector<double> reach(ew.size() + 1, data_);  // reach[s]: microbatch 0 at stage s
      for (size_t s = 0; s < ew.size(); ++s)
        reach[s + 1] = std::max(reach[s] + ew[s].first_fwd, gate(ew[s])) + ew[s].hop_first;
      E0 = std::max(E0, reach.back() - data_);
      for (size_t s = 0; s < ew.size(); ++s) {  // microbatch 0 up to s, all on s, the last on
        double done = std::max(reach[s] + ew[s].fwd, gate(ew[s]) + ew[s].fwd - ew[s].first_fwd) +
                      ew[s].hop_last;
        for (size_t j = s + 1; j < ew.size(); ++j) done += ew[j].last_fwd + ew[j].hop_last;
        enc_done = std::max(enc_done, done);
      }
    }
  for (int64_t s = 0; s < P; ++s) {  // microbatch 0 through chunk 0 of the stages below
    const size_t i = static_cast<size_t>(s);
    start[i] =
        s == 0 ? std::max(enc_ready[0], data_ + E0)
               : std::max(start[i - 1] + cw[i - 1].first_fwd + cw[i - 1].hop_first, enc_ready[i]);
  }
  const int64_t M = n.M, big = first_run(B_ / n.D, M);
  const bool backward = lw.front().backward;
  const auto& order = schedules(P, n.llm.vp, M, backward);
  const auto at = [M](int64_t v, int64_t mb) { return static_cast<size_t>(v * M + mb); };
  // First without the replay below (each stage's ops back to back from start[s], microbatch
  // 0's gradient through chunk 0 of every stage, the reductions from each rank's last
  // backward): a weaker bound, returned when it already reaches the limit for the node's memory
  // (the search drops the node either way).
  for (int64_t s = 0; s < P; ++s)
    end[static_cast<size_t>(s)] = start[static_cast<size_t>(s)] + lw[static_cast<size_t>(s)].fwd +
                                  lw[static_cast<size_t>(s)].bwd;
  double bwd0 = start[static_cast<size_t>(P - 1)] + cw[static_cast<size_t>(P - 1)].first_fwd;
  for (int64_t s = 0; s < P; ++s)
    bwd0 += cw[static_cast<size_t>(s)].first_bwd + cw[static_cast<size_t>(s)].hop_first;
  std::vector<double> reduced(static_cast<size_t>(P), 0);
  const auto finish = [&] {
    Bound out;
    if (watch >= 0) {
      const size_t stages = static_cast<size_t>(watch == E_ ? n.llm.pp : n.enc[watch].pp);
      out.stage_memory.assign(stages, 0.0);
      out.stage_seconds.assign(stages, 0.0);
    }
    double arrival = 0, opt = 0;  // at the loss all-reduce; the optimizer after it
    for (const Rank& x : ranks) {
      double fwd = 0, bytes = 0, measured = 0, static_bytes = 0, act = 0, gather = 0;
      for (const auto& e : x.enc) {
        fwd += e.second.fwd, bytes += e.second.opt_bytes, measured += e.second.opt_seconds;
        static_bytes += e.second.static_bytes, act += e.second.act, gather += e.second.gather;
      }
      if (x.llm) {
        bytes += x.llm->opt_bytes, measured += x.llm->opt_seconds;
        static_bytes += x.llm->static_bytes, act += x.llm->act, gather += x.llm->gather;
      }
      out.memory = std::max(out.memory, static_bytes + act);
      const auto watched = [&](int64_t stage) {
        double busy = x.llm ? x.llm->fwd + x.llm->bwd : 0;
        for (const auto& e : x.enc) busy += e.second.fwd + e.second.bwd;
        double& m = out.stage_memory[static_cast<size_t>(stage)];
        double& t = out.stage_seconds[static_cast<size_t>(stage)];
        m = std::max(m, static_bytes + act);
        t = std::max(t, busy);
      };
      if (watch == E_ && x.llm) watched(x.llm_stage);
      for (size_t i = 0; watch >= 0 && watch < E_ && i < x.enc.size(); ++i)
        if (x.enc[i].first == watch) watched(x.enc_stages[i]);
      // ZeRO-1's parameter gather follows the optimizer step, or overlapped runs from the
      // step's start and the rank's first forwards end no sooner than it (the simulator's).
      opt = std::max(opt, optimizer_seconds(bytes, measured) + (gather_overlapped ? 0 : gather));
      double bound = 0, full = 0, tail = 0, t = 0;
      if (x.enc_stage >= 0) {  // an encoder stage of its own; its last backward follows the LLM's
        const int64_t k = x.enc.front().first;
        const Work& e = x.enc.front().second;
        t = data_ + e.fwd + e.bwd;
        // Overlapped ZeRO-1 gather: its first forward ends no sooner than it.
        if (gather_overlapped && e.fwd > 0) t = std::max(t, gather + e.fwd - e.first_fwd + e.bwd);
        if (e.backward && info(k).backward) {
          const std::vector<Work>& ew = w[static_cast<size_t>(k)];
          double last = end[0], first = bwd0 + e.bwd;
          for (size_t s = static_cast<size_t>(x.enc_stage); s < ew.size(); ++s)
            if (ew[s].backward) {
              last += ew[s].last_bwd;
              if (s > static_cast<size_t>(x.enc_stage)) first += ew[s].first_bwd;
            }
          t = std::max({t, last, first});
        }
        if (overlap && e.full > 0) bound = std::max(bound, t - e.last_bwd + e.full);
        full = e.full;
        tail = e.backward ? e.tail : 0;
      } else {  // its encoders' forwards, its LLM stage, its encoders' backwards
        t = std::max(data_ + fwd, x.enc_ready) + (x.llm ? x.llm->fwd + x.llm->bwd : 0);
        // Overlapped ZeRO-1 gathers: the LLM's first forward ends no sooner than all of them.
        if (gather_overlapped && x.llm)
          t = std::max(t, gather + x.llm->fwd - x.llm->first_fwd + x.llm->bwd);
        if (x.chain) {
          t = std::max(t, end[static_cast<size_t>(x.llm_stage)]);
          bound = std::max(bound, reduced[static_cast<size_t>(x.llm_stage)]);
        }
        if (x.llm) {
          if (overlap && x.llm->full > 0)
            bound = std::max(bound, t - x.llm->last_bwd + x.llm->full);
          full += x.llm->full;
          tail = x.llm->backward ? x.llm->tail : 0;
        }
        for (const auto& e : x.enc) {
          t += e.second.bwd;
          if (e.second.backward) tail = e.second.tail;
          if (overlap && e.second.full > 0)
            bound = std::max(bound, t - e.second.last_bwd + e.second.full);
          full += e.second.full;
        }
      }
      bound = std::max(bound, t + (overlap ? tail : full));
      // (A rank whose only encoder runs no forward waits for nothing; on one with an LLM its first
      // forward waits for every gather of the rank, launched before or with it.)
      if (gather_overlapped && (x.llm || (x.enc_stage >= 0 && fwd > 0)))
        bound = std::max(bound, gather);
      arrival = std::max(arrival, bound);
    }

    // Work not yet placed: spread over every rank it could get.
    double unknown = 0;
    for (int64_t k = static_cast<int64_t>(n.enc.size()); k < E_; ++k)
      unknown += static_cast<double>(B_) * info(k).min_unit_seconds;
    int64_t world = 0;
    if (shared) {
      world = n.llm.size();
      double total = unknown;
      for (const Work& x : lw) total += (x.fwd + x.bwd) * static_cast<double>(n.llm.size() / P);
      for (const Choice& c : n.enc) total += static_cast<double>(B_) * c.staged->unit_seconds;
      arrival = std::max(arrival, data_ + total / static_cast<double>(world));
    } else {
      world = n.llm.size();
      for (const Choice& c : n.enc) world += c.size();
      const int64_t open = E_ - static_cast<int64_t>(n.enc.size());
      const int64_t left = max_ranks_ - world;
      if (left < open) {
        out.feasible = false;
        return out;
      }
      if (open > 0) arrival = std::max(arrival, data_ + unknown / static_cast<double>(left));
      world += open;
    }
    const double loss = 2 * collective(kAllReduce, world, world, 8, kReductions);
    out.seconds = arrival + loss + opt;
    return out;
  };
  const Bound quick = finish();
  if (!quick.feasible ||
      quick.seconds >= (quick.memory > cl_.device.usable_memory_bytes() ? over_limit : fits_limit))
    return quick;

  // The LLM's schedule of replica 0 (pipeline_schedule: 1F1B, or interleaved 1F1B over the
  // P · vp virtual stages), replayed with these op durations: every stage runs its ops in the
  // runtime's order from start[s], a forward after the virtual stage before sent it (the last
  // microbatch's first also after the encoders' forward of it, enc_done), a backward after the
  // virtual stage after sent its gradient. This is the simulator's schedule of those ranks with
  // every other constraint dropped, so its ends are lower bounds; it sees the fill and drain,
  // the bubbles of uneven stages and microbatch sizes, and the hops in every cycle.
  std::vector<double> tf, tb;
  const auto first = [&](int64_t mb) { return mb < big; };  // of the first microbatches' size
  // Overlapped ZeRO-1 gathers: stage s's first forward (chunk 0, microbatch 0) ends no sooner
  // than every gather of the stage's rank, launched before the LLM's or with it (the simulator).
  std::vector<double> gathered(static_cast<size_t>(P), 0);
  if (gather_overlapped)
    for (const Rank& x : ranks) {
      if (!x.chain) continue;
      double g = x.llm->gather;
      for (const auto& e : x.enc) g += e.second.gather;
      gathered[static_cast<size_t>(x.llm_stage)] = g;
    }
  end = replay_schedule(
      order, n.llm.vp, M, start,
      [&](const PipelineOp& op, int64_t v) {
        const Work& x = cw[static_cast<size_t>(v)];
        const bool f = first(op.microbatch);
        return op.forward ? (f ? x.first_fwd : x.last_fwd) : (f ? x.first_bwd : x.last_bwd);
      },
      [&](int64_t v, int64_t mb) {
        const Work& x = cw[static_cast<size_t>(v)];
        return first(mb) ? x.hop_first : x.hop_last;
      },
      [&](const PipelineOp& op, int64_t v) {
        return op.forward && v == 0 && op.microbatch == M - 1 ? enc_done : 0.0;
      },
      [&](const PipelineOp& op, int64_t v) {
        return op.forward && v < P && op.microbatch == 0 ? gathered[static_cast<size_t>(v)] : 0.0;
      },
      &tf, &tb);  // (each end includes its stage's own op time: start[s] + fwd + bwd at least)
  // Microbatch 0's gradient reaches the encoders at bwd0 (separate), at least.
  if (backward) bwd0 = std::max(bwd0, tb[at(0, 0)]);
  // Overlapped, the LLM's gradient reductions on replica 0's stages: each chunk's (the last
  // chunk's first) starts no earlier than its last backward and than the one before it on the
  // same group (dense and experts' apart), and ends no earlier than its last bucket after that
  // backward (the simulator's armed, chained reductions).
  if (overlap && backward)
    for (int64_t s = 0; s < P; ++s)
      for (size_t kind = 0; kind < 2; ++kind) {
        double e = 0;
        for (int64_t j = n.llm.vp - 1; j >= 0; --j) {
          const int64_t v = j * P + s;
          const Work& x = cw[static_cast<size_t>(v)];
          if (x.reduce_full[kind] <= 0) continue;
          const double end_bwd = tb[at(v, M - 1)];
          const double start_bwd = end_bwd - (M - 1 < big ? x.first_bwd : x.last_bwd);
          e = std::max(std::max(e, start_bwd) + x.reduce_full[kind], end_bwd + x.reduce_tail[kind]);
        }
        reduced[static_cast<size_t>(s)] = std::max(reduced[static_cast<size_t>(s)], e);
      }

  return finish();
}

// ---- the tree ------------------------------------------------------------------------------

std::vector<int64_t> Space::zero_stages() const {
  if (o_.zero && trains_ && max_ranks_ > 1) return {0, 1};
  return {0};
}
std::vector<bool> Space::sequence_options(int64_t tp, int64_t k, int64_t cp, int64_t pp) const {
  if (tp == 1 || !o_.sequence_parallel) return {false};
  if (k < E_ && !info(k).enc->splits_evenly(tp * cp)) return {false};
  // An unpipelined encoder that keeps no activations (frozen: forward only) would gain no
  // memory from SP, only its output's all-gather: the plan without it is never slower.
  // (Pipelined, SP also cuts its stages' messages tp-fold.)
  if (k < E_ && !info(k).keeps_activations && pp == 1) return {false};
  return {false, true};
}
std::vector<bool> Space::recompute_options(int64_t k) const {
  if (o_.recompute && info(k).keeps_activations) return {false, true};
  return {false};
}

bool Space::partial_applies(int64_t k, const Node& n) const {
  if (!o_.recompute || !o_.partial_recompute || !info(k).keeps_activations) return false;
  const std::vector<int64_t> most = chunk_blocks(n, k);
  return std::accumulate(most.begin(), most.end(), int64_t{0}) >= 2;  // something in between
}

std::vector<int64_t> Space::chunk_blocks(const Node& n, int64_t k) const {
  const Choice& c = k == E_ ? n.llm : n.enc[static_cast<size_t>(k)];
  const Staged& cut = c.vp > 1 ? *c.chunks : *c.staged;
  return longest_chunks(cut.boundaries, base_.modules[info(k).plan_index].layers, c.pp);
}

Node Space::recomputing(const Node& n, int64_t k, bool on,
                        const std::vector<int64_t>& blocks) const {
  Node out = n;
  out.partial = -1;
  out.choices.reset();
  const bool llm = k == E_;
  Choice& c = llm ? out.llm : out.enc[static_cast<size_t>(k)];
  c.recompute = on;
  c.recompute_blocks = on ? blocks : std::vector<int64_t>{};
  const bool even = llm && n.placement == kMegatron;
  const bool vocab_parallel = llm && c.tp > 1;
  c.staged = &staged(static_cast<int>(k), c.pp, c.recompute, even, vocab_parallel, c.sp, 1,
                     c.recompute_blocks, c.cut);
  if (c.vp > 1)
    c.chunks = &staged(static_cast<int>(k), c.pp, c.recompute, even, vocab_parallel, c.sp, c.vp,
                       c.recompute_blocks);
  return out;
}

std::vector<int64_t> Space::fit_stages(const Node& n, int64_t k,
                                       const std::vector<double>& headroom) const {
  const std::vector<int64_t> most = chunk_blocks(n, k);
  const double mem = cl_.device.usable_memory_bytes();
  // Memory only: the quick bound's (limits 0), which the schedule's replay does not change.
  const auto fits = [&](const Bound& b, size_t s) {
    return b.stage_memory[s] + (headroom.empty() ? 0 : headroom[s]) <= mem;
  };
  const Bound all = bound(recomputing(n, k, true, most), 0, 0, k);
  if (all.memory > mem) return {};
  for (size_t s = 0; s < most.size(); ++s)
    if (!fits(all, s)) return {};
  std::vector<int64_t> lo(most.size(), 0), hi = most;
  for (;;) {
    std::vector<int64_t> mid(most.size());
    bool open = false;
    for (size_t s = 0; s < most.size(); ++s) {
      mid[s] = (lo[s] + hi[s]) / 2;
      open = open || lo[s] < hi[s];
    }
    if (!open) return lo;
    const Bound b = bound(recomputing(n, k, true, mid), 0, 0, k);
    for (size_t s = 0; s < most.size(); ++s) {
      if (lo[s] == hi[s]) continue;
      if (fits(b, s))
        hi[s] = mid[s];
      else
        lo[s] = mid[s] + 1;
    }
  }
}

std::optional<Space::Fitted> Space::fit_cut(const Node& n, int64_t k,
                                            const std::vector<int64_t>& cut,
                                            const std::vector<double>& headroom, bool full) const {
  Node at = n;
  (k == E_ ? at.llm : at.enc[static_cast<size_t>(k)]).cut = cut;
  at = recomputing(at, k, false);
  Fitted f;
  f.blocks = fit_stages(at, k, headroom);
  if (f.blocks.empty()) return std::nullopt;
  const bool any = *std::max_element(f.blocks.begin(), f.blocks.end()) > 0;
  const bool all = f.blocks == chunk_blocks(at, k);
  f.node = any ? recomputing(at, k, true, all ? std::vector<int64_t>{} : f.blocks) : at;
  f.bound = full ? bound(f.node, kNoLimit, kNoLimit, k) : bound(f.node, 0, 0, k);
  return f;
}

std::optional<Space::Fitted> Space::rebalance(const Node& n, int64_t k,
                                              const std::vector<double>& headroom) const {
  const Choice& c = k == E_ ? n.llm : n.enc[static_cast<size_t>(k)];
  if (c.pp < 2 || c.vp > 1 || (k == E_ && n.placement == kMegatron)) return std::nullopt;
  const int64_t layers = base_.modules[info(k).plan_index].layers;
  std::vector<int64_t> cut = c.staged->boundaries;
  std::optional<Fitted> now = fit_cut(n, k, cut, headroom);
  if (!now) return std::nullopt;
  bool moved = false;
  for (int64_t step = 0; step < layers; ++step) {
    const std::vector<double>& busy = now->bound.stage_seconds;
    const size_t from =
        static_cast<size_t>(std::max_element(busy.begin(), busy.end()) - busy.begin());
    if (longest_chunks(cut, layers, c.pp)[from] < 2) break;
    // The moves ranked by the quick bound (without the schedule's replay), the best of them
    // taken when its full bound gains more than rounding.
    std::optional<Fitted> best;
    std::vector<int64_t> best_cut;
    for (size_t to = 0; to < busy.size(); ++to) {
      if (to == from) continue;
      // One block from `from` to `to`: every boundary between them moves one block towards it.
      std::vector<int64_t> moved_cut = cut;
      for (size_t b = std::min(from, to); b < std::max(from, to); ++b)
        moved_cut[b] += to < from ? 1 : -1;
      std::optional<Fitted> f = fit_cut(n, k, moved_cut, headroom, false);
      if (f && (!best || f->bound.seconds < best->bound.seconds)) {
        best = std::move(f);
        best_cut = std::move(moved_cut);
      }
    }
    if (best) {
      best->bound = bound(best->node, kNoLimit, kNoLimit, k);
      if (best->bound.seconds >= now->bound.seconds * (1 - kMinGain)) best.reset();
    }
    if (!best) break;
    now = std::move(best);
    cut = std::move(best_cut);
    moved = true;
  }
  if (!moved) return std::nullopt;
  return now;
}

void Space::expand_partial(const Node& n, const std::function<void(Node&&)>& emit) const {
  const int64_t k = n.partial;
  const std::vector<int64_t> most = chunk_blocks(n, k);
  const double mem = cl_.device.usable_memory_bytes();
  Node off = recomputing(n, k, false);
  const bool fits = bound(off, 0, 0).memory <= mem;
  emit(std::move(off));
  if (fits) return;
  const std::vector<int64_t> lo = fit_stages(n, k);
  if (lo.empty()) return;  // nothing partial fits (every block, if anything: its own node)
  // Those counts, and as many on every stage (the most any stage needs: the same fit by the
  // bound, with room on the others for what it does not see); each also halfway to every block.
  const int64_t longest = *std::max_element(most.begin(), most.end());
  const int64_t even = *std::max_element(lo.begin(), lo.end());
  if (even == 0) return;  // none anywhere: the node without
  std::vector<std::vector<int64_t>> picks = {lo, {}, {even}, {even + (longest - even) / 2}};
  for (size_t s = 0; s < most.size(); ++s) picks[1].push_back(lo[s] + (most[s] - lo[s]) / 2);
  std::vector<std::vector<int64_t>> done;
  for (const std::vector<int64_t>& p : picks) {
    std::vector<int64_t> per(most.size());  // what each stage recomputes, to compare
    for (size_t s = 0; s < most.size(); ++s) per[s] = std::min(p[p.size() == 1 ? 0 : s], most[s]);
    // Every block of every stage is the recomputing node of its own.
    if (per == most || std::find(done.begin(), done.end(), per) != done.end()) continue;
    done.push_back(per);
    emit(recomputing(n, k, true, p));
  }
  // The cut moved with the counts, and halfway to every block of it.
  if (!o_.move_boundaries) return;
  std::optional<Fitted> moved = rebalance(n, k);
  if (!moved) return;
  const Node& at = moved->node;
  const std::vector<int64_t> whole = chunk_blocks(at, k);
  std::vector<int64_t> half(whole.size());
  for (size_t s = 0; s < whole.size(); ++s)
    half[s] = moved->blocks[s] + (whole[s] - moved->blocks[s]) / 2;
  emit(Node(at));
  if (half != moved->blocks && half != whole) emit(recomputing(at, k, true, half));
}

// A leaf whose ZeRO-1 shards nothing is the same plan as with zero_stage = 0.
bool Space::redundant(const Node& n) const {
  if (n.zero == 0) return false;
  const auto shards = [&](int64_t k, const Choice& c) {
    const int64_t experts = c.tp / c.layout().expert_tp() * c.cp * c.dp / c.ep;  // expert DP
    return (c.cp * c.dp > 1 || (info(k).llm && info(k).eps.size() > 0 && experts > 1)) &&
           (info(k).weight_grads || (!info(k).llm && info(k).backward));
  };
  bool any = shards(E_, n.llm);
  for (size_t k = 0; k < n.enc.size(); ++k) any = any || shards(static_cast<int64_t>(k), n.enc[k]);
  return !any;
}

// The LLM's expert layouts {ep, etp} at this tp and cp · dp: {1, 0} for a dense LLM; for an MoE
// LLM every ep of the space dividing the cp · dp ranks (etp = tp, written 0), and with tp > 1
// also expert TP 1 (experts whole, each TP rank routing 1/tp of the tokens): ep | tp · cp · dp.
std::vector<std::pair<int64_t, int64_t>> Space::expert_layouts(int64_t tp, int64_t cp_dp) const {
  const ModuleInfo& li = info(E_);
  if (li.eps.empty()) return {{1, 0}};
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t ep : li.eps)
    if (cp_dp % ep == 0) out.push_back({ep, 0});
  if (tp > 1 && o_.expert_tp_one)
    for (int64_t ep : li.eps)
      if ((tp * cp_dp) % ep == 0) out.push_back({ep, 1});
  return out;
}

// Interleaved 1F1B's chunks per rank: up to max_vp with pp · vp at most the LLM's blocks; the
// Megatron-LM baseline only with at least pp microbatches, which Megatron-LM needs (it runs
// weft's groups, which its microbatch_group_size_per_vp_stage can express for some M).
int64_t Space::max_vp(int64_t pp, int64_t M, int placement) const {
  if (pp < 2 || (placement == kMegatron && M < pp)) return 1;
  return std::max<int64_t>(1, std::min(o_.max_vp, spec_.model.llm.layers / pp));
}

void Space::roots(const std::function<void(Node&&)>& emit) {
  const ModuleInfo& li = info(E_);
  for (int p : placements_)
    for (int64_t tp : li.tps)
      for (int64_t cp : li.cps) {
        if (p == kMegatron && cp > 1) continue;
        for (int64_t pp = 1; pp <= li.max_pp; ++pp)
          for (int64_t D : divisors(B_)) {
            const int64_t ranks = tp * cp * pp * D;
            if (ranks + (p == kSeparate ? E_ : 0) > max_ranks_) continue;
            for (int64_t M : divisors(B_)) {
              if (M > B_ / D || M > o_.max_microbatches) continue;
              for (const auto& [ep, etp] : expert_layouts(tp, cp * D))
                for (int64_t zero : zero_stages())
                  for (bool rc : recompute_options(E_))
                    for (bool sp : sequence_options(tp, E_, cp, pp))
                      for (int64_t vp = 1; vp <= max_vp(pp, M, p); ++vp) {
                        const int k = static_cast<int>(E_);
                        const bool even = p == kMegatron;
                        Node n;
                        n.placement = p;
                        n.D = D, n.M = M, n.zero = zero;
                        n.llm =
                            Choice{tp, cp,  pp, D, 0, rc, {}, &staged(k, pp, rc, even, tp > 1, sp),
                                   ep, etp, sp};
                        n.llm.vp = vp;
                        if (vp > 1) n.llm.chunks = &staged(k, pp, rc, even, tp > 1, sp, vp);
                        if (!rc && partial_applies(E_, n)) n.partial = E_;
                        emit(std::move(n));
                      }
            }
          }
      }
}

const std::vector<Node>& Space::pending_choices(const Node& n) const {
  if (!n.choices) {
    auto all = std::make_shared<std::vector<Node>>();
    expand_partial(n, [&](Node&& c) {
      c.choices.reset();
      all->push_back(std::move(c));
    });
    n.choices = std::move(all);
  }
  return *n.choices;
}

void Space::children(const Node& n, const std::function<void(Node&&)>& emit) {
  if (n.partial >= 0) {
    for (const Node& c : pending_choices(n)) emit(Node(c));
    return;
  }
  const int64_t k = static_cast<int64_t>(n.enc.size());
  const ModuleInfo& mi = info(k);
  const auto push = [&](Choice c, bool megatron = false) {
    for (bool rc : recompute_options(k))
      for (bool sp : megatron ? std::vector<bool>{false} : sequence_options(c.tp, k, c.cp, c.pp)) {
        c.recompute = rc;
        c.sp = sp;
        c.staged = &staged(static_cast<int>(k), c.pp, rc, false, false, sp);
        Node child = n;
        child.enc.push_back(c);
        if (!rc && partial_applies(k, child)) child.partial = k;
        emit(std::move(child));
      }
  };
  // Megatron: the LLM's tp (or its largest divisor the encoder allows); its vision model runs
  // without sequence or context parallelism (examples/multimodal: "do not use SP/CP yet").
  if (n.placement == kMegatron) {
    Choice c;
    for (int64_t t : mi.tps)
      if (n.llm.tp % t == 0) c.tp = t;
    c.dp = n.llm.size() / n.llm.pp / c.tp;
    push(c, true);
    return;
  }
  int64_t used = n.llm.size();
  for (const Choice& c : n.enc) used += c.size();
  const int64_t per_microbatch = (B_ / n.D + n.M - 1) / n.M * n.D;  // samples, at most
  // Its items (encoder_share: ranks split items, so more ranks than samples can help).
  const int64_t items = std::max(
      per_microbatch,
      static_cast<int64_t>(std::ceil(static_cast<double>(per_microbatch) * mi.items - 1e-9)));
  const auto grid_choice = [](int64_t tp, int64_t cp, int64_t pp, int64_t dp) {
    Choice c;
    c.tp = tp, c.cp = cp, c.pp = pp, c.dp = dp;
    return c;
  };
  for (int64_t tp : mi.tps)
    for (int64_t cp : mi.cps)
      for (int64_t pp = 1; pp <= mi.max_pp; ++pp) {
        const int64_t grid = tp * cp * pp;
        if (n.placement == kColocated) {
          if (n.llm.size() % grid == 0) push(grid_choice(tp, cp, pp, n.llm.size() / grid));
          continue;
        }
        std::vector<int64_t> dps = divisors(n.D);
        for (int64_t m = 2 * n.D; m <= items; m += n.D) dps.push_back(m);
        for (int64_t dp : dps)
          if (used + grid * dp + (E_ - k - 1) <= max_ranks_) push(grid_choice(tp, cp, pp, dp));
      }
}

Candidate Space::to_candidate(const Node& n) const {
  Candidate c;
  c.placement = kPlacementNames[n.placement];
  c.microbatches = n.M;
  c.zero_stage = n.zero;
  int64_t next = 0;
  const auto add = [&](const Choice& x) {
    LayoutSpec l;
    l.dp = x.dp, l.tp = x.tp, l.pp = x.pp, l.cp = x.cp, l.ep = x.ep, l.etp = x.etp, l.sp = x.sp;
    l.vp = x.vp;
    l.stages = (x.vp > 1 ? x.chunks : x.staged)->boundaries;
    c.layouts.push_back(l);
    c.recompute.push_back(x.recompute);
    c.recompute_blocks.push_back(x.recompute_blocks);
    next += x.size();
  };
  for (const Choice& x : n.enc) add(x);
  add(n.llm);
  c.world_size = n.placement == kSeparate ? next : n.llm.size();
  return c;
}

Node Space::node_of(const Candidate& c) const {
  WEFT_CHECK(static_cast<int64_t>(c.layouts.size()) == E_ + 1, "search: a candidate of ",
             c.layouts.size(), " modules for a space of ", E_ + 1);
  Node n;
  n.placement = static_cast<int>(
      std::find(std::begin(kPlacementNames), std::end(kPlacementNames), c.placement) -
      std::begin(kPlacementNames));
  WEFT_CHECK(n.placement < kMegatron + 1, "search: unknown placement \"", c.placement, "\"");
  n.M = c.microbatches;
  n.zero = c.zero_stage;
  const auto choice = [&](size_t k) {
    const LayoutSpec& l = c.layouts[k];
    Choice x;
    x.tp = l.tp, x.cp = l.cp, x.pp = l.pp, x.dp = l.dp, x.ep = l.ep, x.etp = l.etp, x.sp = l.sp;
    x.vp = l.vp;
    if (x.vp == 1 && x.pp > 1) x.cut = l.stages;
    return x;
  };
  for (size_t k = 0; k < static_cast<size_t>(E_); ++k) n.enc.push_back(choice(k));
  n.llm = choice(static_cast<size_t>(E_));
  n.D = n.llm.dp;
  for (int64_t k = 0; k <= E_; ++k) {
    const size_t i = static_cast<size_t>(k);
    n = recomputing(n, k, c.recompute[i],
                    c.recompute_blocks.empty() ? std::vector<int64_t>{} : c.recompute_blocks[i]);
  }
  return n;
}

std::optional<Candidate> Space::rebalanced(const Evaluation& e) const {
  Node n = node_of(e.candidate);
  bool moved = false;
  for (int64_t k = E_; k >= 0; --k) {  // the LLM first
    const Choice& x = k == E_ ? n.llm : n.enc[static_cast<size_t>(k)];
    if (!x.recompute || x.pp < 2 || x.vp > 1) continue;
    // What the simulated peak of each stage's ranks adds to the bound's.
    const std::string& name = base_.modules[info(k).plan_index].name;
    const Bound b = bound(n, 0, 0, k);
    std::vector<double> headroom = stage_peak_bytes(e.sim, name, x.pp);
    for (size_t s = 0; s < headroom.size(); ++s)
      headroom[s] = std::max(0.0, headroom[s] - b.stage_memory[s]);
    std::optional<Fitted> f = rebalance(n, k, headroom);
    if (!f) continue;
    n = f->node;  // the counts fitted there (refine_recompute fits them by the simulator)
    moved = true;
  }
  if (!moved) return std::nullopt;
  return to_candidate(n);
}

}  // namespace weft::plan::search_space
