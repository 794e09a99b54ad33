#include "weft/model/moe.h"

#include <torch/torch.h>

#include <cmath>
#include <string>

#include "weft/core/error.h"
#include "weft/dist/collectives.h"
#include "weft/model/fused.h"
#include "weft/model/recompute.h"

namespace weft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Identity on the block's output whose backward also seeds d(objective)/d(aux) = 1: the
// auxiliary losses join the objective wherever this block's output goes.
struct AttachAux : torch::autograd::Function<AttachAux> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& y, const at::Tensor& aux) {
    return y.view_as(y);
  }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {g[0], torch::ones({}, g[0].options().dtype(torch::kFloat))};
  }
};

// Rows `idx` of x along dim 0, where idx == x.size(0) selects a zero row.
at::Tensor take_rows(const at::Tensor& x, const at::Tensor& idx) {
  if (idx.numel() == 0 || idx.max().item<int64_t>() < x.size(0)) return x.index_select(0, idx);
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = 1;
  return torch::cat({x, torch::zeros(shape, x.options())}).index_select(0, idx);
}

// y = take_rows(x, idx) for an idx without repeats, differentiated by gathering too:
// dx = take_rows(dy, inverse) (inverse[i]: where row i of x went, or idx.numel() when nowhere).
// With group > 1, idx and inverse address x expanded `group` times (row r of x as rows r·group ...
// r·group + group - 1): y reads rows idx / group, and dx sums each row's `group` gradients.
// Index-select's own backward is a scatter-add, which LibTorch runs slowly on CPU in bf16.
struct GatherRows : torch::autograd::Function<GatherRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& idx,
                            const at::Tensor& inverse, int64_t group) {
    ctx->saved_data["inverse"] = inverse;
    ctx->saved_data["group"] = group;
    return group > 1 ? x.index_select(0, idx.div(group, "floor")) : take_rows(x, idx);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    at::Tensor dx = take_rows(g[0], ctx->saved_data["inverse"].toTensor());
    const int64_t group = ctx->saved_data["group"].toInt();
    if (group > 1) {
      std::vector<int64_t> shape = dx.sizes().vec();
      shape[0] /= group;
      shape.insert(shape.begin() + 1, group);
      dx = dx.view(shape).sum(1);
    }
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& inverse,
                       int64_t group = 1) {
  if (!x.requires_grad() || !at::GradMode::is_enabled()) {
    if (group == 1) return take_rows(x, idx);
    return x.index_select(0, idx.div(group, "floor"));
  }
  return GatherRows::apply(x, idx, inverse, group);
}

// A device tensor's values on the host (one synchronisation).
std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

// Along dim 1 over the CP group (rank order); the tensor itself without CP.
at::Tensor gather_tokens(const at::Tensor& t, const dist::Comm& cp) {
  if (cp.size() == 1) return t;
  return cp.all_gather(t.transpose(0, 1).contiguous()).transpose(0, 1);
}

// Capacity: which of this rank's assignments [B, S_l, K] its experts keep. Per row, expert e
// keeps the first `capacity[b]` assignments in priority order (slot, then index in the row);
// invalid tokens are never kept. The choices of the whole row are gathered over CP.
at::Tensor capacity_keep(const at::Tensor& experts, const at::Tensor& valid,
                         const at::Tensor& index, const at::Tensor& capacity, int64_t E,
                         int64_t row_length, const dist::Comm& cp) {
  const int64_t B = experts.size(0), Sl = experts.size(1), K = experts.size(2);
  const at::Tensor e_all = gather_tokens(experts, cp);                            // [B, S, K]
  const at::Tensor v_all = gather_tokens(valid.to(at::kByte), cp).to(at::kBool);  // [B, S]
  const at::Tensor i_all = cp.size() == 1 ? index : cp.all_gather(index);         // [S]
  const int64_t S = e_all.size(1), L = row_length;
  // Priority key per assignment (b, t, s): rows apart, then slot, then index in the row;
  // invalid tokens after every row (row B, a dummy expert E).
  const at::TensorOptions longs = experts.options().dtype(torch::kLong);
  const at::Tensor b = torch::arange(B, longs).view({B, 1, 1});
  const at::Tensor s = torch::arange(K, longs).view({1, 1, K});
  const at::Tensor v = v_all.unsqueeze(-1).expand({B, S, K});
  const at::Tensor row = torch::where(v, b.expand({B, S, K}), torch::full({}, B, longs));
  const at::Tensor key = (row * K + s) * L + i_all.view({1, S, 1});
  const at::Tensor expert = torch::where(v, e_all, torch::full({}, E, longs));
  const at::Tensor order = key.reshape({-1}).argsort();
  const at::Tensor e_sorted = expert.reshape({-1}).index_select(0, order);
  const at::Tensor r_sorted = row.reshape({-1}).index_select(0, order);
  const at::Tensor onehot = torch::one_hot(e_sorted, E + 1);  // [A, E + 1]
  const at::Tensor before = onehot.cumsum(0) - onehot;        // earlier, any row
  at::Tensor per_row = torch::zeros({B + 1, E + 1}, longs);   // per row, per expert
  per_row.index_add_(0, r_sorted, onehot);
  const at::Tensor row_base = per_row.cumsum(0) - per_row;  // in earlier rows
  const at::Tensor rank_in_expert =
      (before - row_base.index_select(0, r_sorted)).gather(1, e_sorted.unsqueeze(1)).squeeze(1);
  const at::Tensor cap = torch::cat({capacity, torch::zeros({1}, capacity.options())});
  const at::Tensor keep_sorted = rank_in_expert < cap.index_select(0, r_sorted);
  at::Tensor keep = torch::zeros({B * S * K}, experts.options().dtype(torch::kBool));
  keep.index_put_({order}, keep_sorted);
  return keep.view({B, S, K}).narrow(1, cp.rank() * Sl, Sl);
}

}  // namespace

MoeMlp MoeMlp::make(const Scope& s, const LlmSpec& llm, int64_t layer, double out_std) {
  MoeMlp m;
  m.spec = llm.moe;
  m.layer = layer;
  const Shard& g = s.groups();
  m.tp = g.tp;
  m.cp = g.cp;
  m.ep = g.ep;
  m.etp = g.etp;
  const int64_t E = m.spec.experts, P = m.ep.size(), F = llm.expert_ffn(), H = llm.hidden;
  WEFT_ASSERT(E % P == 0, "experts ", E, " over ", P, " expert-parallel ranks");
  m.router = s.normal("router.weight", {E, H}, 0.02, {}, ParamUse::kFp32);
  const int64_t local = E / P;
  m.first_expert = m.ep.rank() * local;
  // Expert weights are split over the expert-TP group (whole when it is a single rank).
  const Shard expert_shard{m.etp, m.cp, m.ep, m.etp};
  const Scope experts{s.params, s.prefix, &expert_shard};
  for (int64_t j = m.first_expert; j < m.first_expert + local; ++j) {
    const Scope x = experts.sub("experts." + std::to_string(j));
    m.gate_up.push_back(
        Linear::make(x.sub("gate_up"), H, 2 * F, false, 0.02, Par::kColumn, {F, F}));
    m.down.push_back(Linear::make(x.sub("down"), F, H, false, out_std, Par::kRow));
  }
  if (m.spec.shared_ffn > 0) {
    m.has_shared = true;
    const Shard dense = g.without_sp();  // the block's tokens are gathered whole over TP
    const Scope shared{s.params, s.prefix, &dense};
    m.shared = SwiGlu::make(shared.sub("shared"), H, m.spec.shared_ffn, out_std);
  }
  return m;
}

namespace {

// Step 3 of the forward (moe.h): dispatch over EP, the local experts, combine, for the tokens
// `flat` [n, H] with their choices top_e / weights top_w [n, K] and which of those the experts
// keep [n, K] (`chosen`: the real tokens' choices before capacity, for the statistics).
// Returns the routed experts' weighted sum per token, [n, H] in the compute dtype.
at::Tensor route(const MoeMlp& m, const at::Tensor& flat, const at::Tensor& keep,
                 const at::Tensor& top_w, const at::Tensor& top_e, int64_t chosen,
                 const TokenInfo& info, bool counting) {
  const int64_t N = flat.size(0), H = flat.size(1);
  const int64_t E = m.spec.experts, K = m.spec.top_k, P = m.ep.size(), local = E / P;
  // Kept assignments, as slots t·K + s of the [N·K] (token, choice) grid, sorted by expert
  // (then token); `where` maps every slot to its assignment (A: dropped or padding).
  const at::Tensor kept = keep.reshape({-1}).nonzero().squeeze(1);
  const at::Tensor exp0 = top_e.reshape({-1}).index_select(0, kept);
  const at::Tensor order = (exp0 * N + kept.div(K, "floor")).argsort();
  const at::Tensor slot = kept.index_select(0, order), exp = exp0.index_select(0, order);
  const int64_t A = slot.numel();
  at::Tensor where = torch::full({N * K}, A, kept.options());
  where.index_put_({slot}, torch::arange(A, kept.options()));
  const at::Tensor w = gather_rows(top_w.reshape({-1}), slot, where);  // [A]
  const at::Tensor per_expert = torch::bincount(exp, {}, E);           // [E] int64
  if (counting) {
    std::vector<int64_t>& load = info.stats->load[m.layer];
    if (load.empty()) load.assign(static_cast<size_t>(E), 0);
    const std::vector<int64_t> c = to_vector(per_expert);
    for (int64_t e = 0; e < E; ++e) load[e] += c[e];
    info.stats->routed += chosen;
    info.stats->dropped += chosen - A;
  }
  // Dispatch: counts first (row r of `from`: what rank r sends to each of my experts).
  const at::Tensor to_ranks = per_expert.view({P, local});
  const at::Tensor from = P == 1
                              ? to_ranks
                              : m.ep.all_to_all(to_ranks.contiguous(), std::vector<int64_t>(P, 1),
                                                std::vector<int64_t>(P, 1));
  const std::vector<int64_t> send = to_vector(to_ranks.sum(1)), recv = to_vector(from.sum(1));
  // Expanded view of the tokens as slots: slot t·K + s reads token t.
  const at::Tensor x_recv = dist::all_to_all(gather_rows(flat, slot, where, K), m.ep, send, recv);
  // Received rows come by (source, expert): group them by expert.
  const int64_t R = x_recv.size(0);
  const at::Tensor expert_of_row =
      torch::arange(local, from.options()).repeat({P}).repeat_interleave(from.reshape({-1}));
  const at::Tensor perm = (expert_of_row * R + torch::arange(R, from.options())).argsort();
  const at::Tensor unperm = perm.argsort();
  const at::Tensor x_e = dist::copy_to(gather_rows(x_recv, perm, unperm), m.etp);
  const std::vector<int64_t> rows = to_vector(from.sum(0));
  const std::vector<at::Tensor> parts = x_e.split_with_sizes(rows);
  std::vector<at::Tensor> ys;
  for (int64_t j = 0; j < local; ++j) {
    const at::Tensor gu = at::linear(parts[j], to_compute(m.gate_up[j].weight));
    ys.push_back(at::linear(swiglu(gu), to_compute(m.down[j].weight)));
  }
  // One reduction of every expert's partial output over expert TP, back to (source, expert) order,
  // and home by the reverse all-to-all.
  const at::Tensor y_e = dist::reduce_from(torch::cat(ys, 0), m.etp);
  const at::Tensor y_back =
      dist::all_to_all(gather_rows(y_e, unperm, perm), m.ep, recv, send);  // [A, H]
  // Each token's weighted sum over its slots (dropped slots read a zero row), in fp32.
  const at::Tensor weighted = y_back.to(at::kFloat) * w.unsqueeze(1);
  const at::Tensor out = gather_rows(weighted, where, slot).view({N, K, H}).sum(1);
  return to_compute(out);
}

}  // namespace

at::Tensor MoeMlp::operator()(const at::Tensor& x, const TokenInfo& info) const {
  const int64_t B = x.size(0), Sl = x.size(1), H = x.size(2), N = B * Sl;
  const int64_t E = spec.experts, K = spec.top_k;
  const at::Tensor flat = x.reshape({N, H});
  const at::Tensor valid = info.valid.defined()
                               ? info.valid.reshape({B, Sl})
                               : torch::ones({B, Sl}, x.options().dtype(torch::kBool));
  const at::Tensor vf = valid.to(at::kFloat);

  // 1. Router (fp32) and top-k.
  const at::Tensor logits = at::linear(flat.to(at::kFloat), router);  // [N, E]
  const at::Tensor scores = spec.sigmoid ? logits.sigmoid() : logits.softmax(-1);
  auto [top_w, top_e] = scores.topk(K, -1);  // [N, K]
  if (spec.norm_topk) top_w = top_w / (top_w.sum(-1, true) + 1e-20);
  // Real tokens per row, over the whole row (CP ranks hold parts of it).
  at::Tensor T = vf.sum(1).contiguous();
  cp.all_reduce_sum(T);
  const at::Tensor inv_T = torch::where(T > 0, 1.0 / T.clamp_min(1), torch::zeros_like(T));
  const bool counting = info.stats && tp.rank() == 0 && !recomputing();  // replicated over TP
  const bool training = info.aux_scale > 0 && router.requires_grad() &&
                        at::GradMode::is_enabled() && (spec.aux_loss > 0 || spec.z_loss > 0);

  // Auxiliary losses of this rank's tokens, Σ over rows (moe.h).
  at::Tensor aux;
  if (training || counting) {
    // f: share of the row's top-k slots that chose each expert (a constant, as in Switch).
    at::Tensor counts = torch::zeros({B, E}, logits.options());
    counts.scatter_add_(1, top_e.reshape({B, Sl * K}),
                        vf.unsqueeze(-1).expand({B, Sl, K}).reshape({B, Sl * K}));
    cp.all_reduce_sum(counts);
    const at::Tensor f = counts * inv_T.unsqueeze(1) / static_cast<double>(K);
    // P: the row's mean (normalised) router score per expert; this rank's tokens' part.
    const at::Tensor probs = spec.sigmoid ? scores / scores.sum(-1, true) : scores;
    const at::Tensor p_part = (probs.view({B, Sl, E}) * vf.unsqueeze(-1)).sum(1);  // [B, E]
    const at::Tensor balance = static_cast<double>(E) * ((f * p_part).sum(1) * inv_T).sum();
    const at::Tensor lse = logits.logsumexp(-1).view({B, Sl});
    const at::Tensor z = ((lse.square() * vf).sum(1) * inv_T).sum();
    if (counting) {
      info.stats->balance += info.aux_scale * balance.item<double>();
      info.stats->z += info.aux_scale * z.item<double>();
    }
    if (training) aux = info.aux_scale * (spec.aux_loss * balance + spec.z_loss * z);
  }

  // 2. Capacity: which choices the experts keep.
  at::Tensor keep = valid.unsqueeze(-1).expand({B, Sl, K});
  if (spec.capacity_factor > 0) {
    const at::Tensor capacity =
        (T * (spec.capacity_factor * static_cast<double>(K) / static_cast<double>(E)))
            .ceil()
            .to(at::kLong);
    const at::Tensor index =
        info.index.defined() ? info.index : torch::arange(Sl, x.options().dtype(torch::kLong));
    const int64_t L = info.row_length > 0 ? info.row_length : Sl;
    keep =
        keep.logical_and(capacity_keep(top_e.view({B, Sl, K}), valid, index, capacity, E, L, cp));
  }
  keep = keep.reshape({N, K});
  // 3. Routed experts. With whole experts under TP (etp = 1 < tp) each TP rank routes its
  // slice of the (replicated) tokens, and the slices are gathered back.
  const int64_t slices = tp.size() / etp.size();
  const bool count_load = info.stats && !recomputing() && (slices > 1 || tp.rank() == 0);
  at::Tensor out;
  if (slices == 1) {
    const int64_t chosen = count_load ? valid.sum().item<int64_t>() * K : 0;  // a statistic
    out = route(*this, flat, keep, top_w, top_e, chosen, info, count_load);
  } else {
    const int64_t n = (N + slices - 1) / slices, pad = n * slices - N;
    auto padded = [&](const at::Tensor& t) {
      std::vector<int64_t> shape = t.sizes().vec();
      shape[0] = pad;
      return pad == 0 ? t : torch::cat({t, torch::zeros(shape, t.options())});
    };
    auto mine = [&](const at::Tensor& t) { return padded(t).narrow(0, tp.rank() * n, n); };
    const int64_t chosen = count_load ? mine(valid.reshape({N})).sum().item<int64_t>() * K : 0;
    const at::Tensor part =
        route(*this, dist::split_replicated(padded(flat), tp, 0), mine(keep),
              dist::split_replicated(padded(top_w), tp, 0), mine(top_e), chosen, info, count_load);
    out = dist::gather_replicated(part, tp, 0).narrow(0, 0, N);
  }
  if (has_shared) out = out + shared(flat);
  if (aux.defined() && aux.requires_grad()) out = AttachAux::apply(out, aux);
  return out.view({B, Sl, H});
}

}  // namespace weft::model
