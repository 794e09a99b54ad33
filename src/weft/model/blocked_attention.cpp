// Blocked attention (blocked_attention.h). Rows: the queries of K/V head g of batch item b are
// stacked as rows (b·KV + g, s·rep + r) for query position s of head g·rep + r, so one tile of
// `block` query positions is rep·block contiguous rows that share their keys. Threads split the
// (group, query block) pairs in forward and the groups in backward, each running its tiles in
// order with single-threaded matmuls: one parallel region per call (a region per tile op would
// cost a barrier each, and stall whenever another process holds a core), and every gradient
// has one writer (no atomics; the same result run to run). Row kernels written for
// the vectoriser (fused_math.h).
#include "weft/model/blocked_attention.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "weft/model/fused_math.h"

namespace weft::model {

namespace {

using simd::dispatch_float_bf16;
using simd::exp_nonpositive;
using simd::lane_max;
using simd::lane_sum;
using simd::load;
using simd::store;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr float kHidden = -std::numeric_limits<float>::infinity();
constexpr int64_t kTaskElements = 16384;  // elements per parallel task

struct Geometry {
  int64_t B = 0, H = 0, KV = 0, rep = 1, S = 0, Sk = 0, D = 0, block = 1;
  int64_t groups() const { return B * KV; }
  int64_t rows() const { return S * rep; }  // per group
  int64_t query_blocks() const { return (S + block - 1) / block; }
  int64_t key_blocks() const { return (Sk + block - 1) / block; }
};

Geometry geometry_of(const at::Tensor& q, const at::Tensor& k, int64_t block) {
  Geometry g;
  g.B = q.size(0);
  g.H = q.size(1);
  g.S = q.size(2);
  g.D = q.size(3);
  g.KV = k.size(1);
  g.rep = g.H / g.KV;
  g.Sk = k.size(2);
  g.block = block;
  return g;
}

// One tile of one group: query positions [s0, s0 + R / rep) against keys [k0, k0 + C).
struct Tile {
  const Geometry* g;
  int64_t group = 0, s0 = 0, k0 = 0, R = 0, C = 0;
  // Tile row t as a row of the whole [groups, rows] layout.
  int64_t row(int64_t t) const { return group * g->rows() + s0 * g->rep + t; }
  // Its mask row (C keys from k0), or null when every key is visible.
  const uint8_t* mask(const uint8_t* visible, int64_t t) const {
    if (!visible) return nullptr;
    const int64_t b = group / g->KV, s = s0 + t / g->rep;
    return visible + (b * g->S + s) * g->Sk + k0;
  }
};

int64_t rows_per_task(int64_t n) {
  return std::max<int64_t>(1, kTaskElements / std::max<int64_t>(n, 1));
}

// Per (query block, key block): does any batch item's query in the one see any key in the
// other? Blocks nothing sees are skipped.
std::vector<uint8_t> live_blocks(const at::Tensor& visible, const Geometry& g) {
  const int64_t nq = g.query_blocks(), nk = g.key_blocks();
  std::vector<uint8_t> live(static_cast<size_t>(nq * nk), visible.defined() ? 0 : 1);
  if (!visible.defined()) return live;
  const bool* m = visible.data_ptr<bool>();
  at::parallel_for(0, nq, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t s = i * g.block; s < std::min(g.S, (i + 1) * g.block); ++s) {
          const bool* row = m + (b * g.S + s) * g.Sk;
          for (int64_t j = 0; j < nk; ++j) {
            const int64_t k0 = j * g.block, n = std::min(g.Sk, k0 + g.block) - k0;
            if (!live[i * nk + j] && std::memchr(row + k0, 1, static_cast<size_t>(n)))
              live[i * nk + j] = 1;
          }
        }
  });
  return live;
}

// ---- Row kernels ---------------------------------------------------------------------------

// Forward, one tile: the scores s become p = exp(scale·s − m') over visible keys (0 elsewhere),
// in place; the running max m and sum l of each row move on to m' and l·α + Σp with
// α = exp(m − m') (α goes out per tile row for the accumulator).
template <typename T>
WEFT_VECTOR_CLONES void online_softmax_rows(T* s, const uint8_t* visible, float* m, float* l,
                                            float* alpha, int64_t begin, int64_t end, const Tile& t,
                                            float scale) {
  const int64_t C = t.C;
  std::vector<float> e(static_cast<size_t>(C));
  for (int64_t r = begin; r < end; ++r) {
    T* sr = s + r * C;
    const uint8_t* vis = t.mask(visible, r);
    if (vis)
      for (int64_t k = 0; k < C; ++k) e[k] = vis[k] != 0 ? load(sr, k) * scale : kHidden;
    else
      for (int64_t k = 0; k < C; ++k) e[k] = load(sr, k) * scale;
    const int64_t row = t.row(r);
    const float m_old = m[row], m_new = std::max(m_old, lane_max(e.data(), C));
    if (m_new == kHidden) {  // no key of this row visible so far
      for (int64_t k = 0; k < C; ++k) store(sr, k, 0.0f);
      alpha[r] = 1.0f;
      continue;
    }
    for (int64_t k = 0; k < C; ++k) e[k] = exp_nonpositive(e[k] - m_new);
    const float a = exp_nonpositive(m_old - m_new);
    l[row] = l[row] * a + lane_sum(e.data(), C);
    m[row] = m_new;
    alpha[r] = a;
    for (int64_t k = 0; k < C; ++k) store(sr, k, e[k]);
  }
}

// acc ← acc·α + p·v for the tile's rows (acc fp32 [groups · rows, D], pv [tile rows, D]).
template <typename T>
WEFT_VECTOR_CLONES void accumulate_rows(float* acc, const T* pv, const float* alpha, int64_t begin,
                                        int64_t end, const Tile& t) {
  const int64_t D = t.g->D;
  for (int64_t r = begin; r < end; ++r) {
    float* a = acc + t.row(r) * D;
    const T* p = pv + r * D;
    const float al = alpha[r];
    for (int64_t d = 0; d < D; ++d) a[d] = a[d] * al + load(p, d);
  }
}

// dst ← dst + src over n floats (a gradient block into its fp32 accumulator).
template <typename T>
WEFT_VECTOR_CLONES void add_into(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += load(src, i);
}

// o = acc / l into [B, S, H, D]; lse = m + log l.
template <typename T>
WEFT_VECTOR_CLONES void finalize_rows(const float* acc, const float* m, const float* l, T* o,
                                      float* lse, int64_t begin, int64_t end, const Geometry& g) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t group = row / g.rows(), within = row % g.rows();
    const int64_t b = group / g.KV, s = within / g.rep;
    const int64_t h = (group % g.KV) * g.rep + within % g.rep;
    T* out = o + ((b * g.S + s) * g.H + h) * g.D;
    const float* a = acc + row * g.D;
    const float inv = 1.0f / l[row];
    for (int64_t d = 0; d < g.D; ++d) store(out, d, a[d] * inv);
    lse[row] = m[row] + std::log(l[row]);
  }
}

// Backward, one tile: p = exp(scale·s − lse) over visible keys (0 elsewhere), in place.
template <typename T>
WEFT_VECTOR_CLONES void probability_rows(T* s, const uint8_t* visible, const float* lse,
                                         int64_t begin, int64_t end, const Tile& t, float scale) {
  const int64_t C = t.C;
  for (int64_t r = begin; r < end; ++r) {
    T* sr = s + r * C;
    const uint8_t* vis = t.mask(visible, r);
    const float shift = lse[t.row(r)];
    if (vis)  // exp of every key (clamped: a hidden one may score above the row's max), then 0
      for (int64_t k = 0; k < C; ++k) {
        const float p = exp_nonpositive(std::min(load(sr, k) * scale - shift, 0.0f));
        store(sr, k, vis[k] != 0 ? p : 0.0f);
      }
    else
      for (int64_t k = 0; k < C; ++k) store(sr, k, exp_nonpositive(load(sr, k) * scale - shift));
  }
}

// ds = scale·p·(dp − δ) with δ = Σ dO·O of the row, in place in dp.
template <typename T>
WEFT_VECTOR_CLONES void score_grad_rows(const T* p, T* dp, const float* delta, int64_t begin,
                                        int64_t end, const Tile& t, float scale) {
  const int64_t C = t.C;
  for (int64_t r = begin; r < end; ++r) {
    const T* pr = p + r * C;
    T* dr = dp + r * C;
    const float dl = delta[t.row(r)];
    for (int64_t k = 0; k < C; ++k) store(dr, k, scale * load(pr, k) * (load(dr, k) - dl));
  }
}

// ---- Tile loops ----------------------------------------------------------------------------

Tile tile_of(const Geometry& g, int64_t group, int64_t i, int64_t j) {
  Tile t;
  t.g = &g;
  t.group = group;
  t.s0 = i * g.block;
  t.k0 = j * g.block;
  t.R = (std::min(g.S, t.s0 + g.block) - t.s0) * g.rep;
  t.C = std::min(g.Sk, t.k0 + g.block) - t.k0;
  return t;
}

// qr [groups, rows, D], kr, vr [groups, Sk, D] -> o ([B, S, H, D] memory), lse [groups · rows].
template <typename T>
void forward_tiles(const at::Tensor& qr, const at::Tensor& kr, const at::Tensor& vr,
                   const at::Tensor& visible, const Geometry& g, float scale, const at::Tensor& o,
                   const at::Tensor& lse) {
  const at::TensorOptions f32 = qr.options().dtype(at::kFloat);
  at::Tensor acc = at::zeros({g.groups() * g.rows(), g.D}, f32);
  at::Tensor m = at::full({g.groups() * g.rows()}, kHidden, f32);
  at::Tensor l = at::zeros({g.groups() * g.rows()}, f32);
  // bool read as bytes: GCC vectorises no loads of bool.
  const uint8_t* vis =
      visible.defined() ? reinterpret_cast<const uint8_t*>(visible.data_ptr<bool>()) : nullptr;
  const std::vector<uint8_t> live = live_blocks(visible, g);
  const int64_t nq = g.query_blocks(), nk = g.key_blocks();
  float* accp = acc.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* lp = l.data_ptr<float>();
  at::parallel_for(0, g.groups() * nq, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> alpha;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t group = w / nq, i = w % nq;
      const Tile first = tile_of(g, group, i, 0);
      const at::Tensor qi = qr[group].narrow(0, first.s0 * g.rep, first.R);
      for (int64_t j = 0; j < nk; ++j) {
        if (!live[i * nk + j]) continue;
        const Tile t = tile_of(g, group, i, j);
        at::Tensor s = at::mm(qi, kr[group].narrow(0, t.k0, t.C).t());  // [R, C]
        alpha.resize(static_cast<size_t>(t.R));
        online_softmax_rows(s.data_ptr<T>(), vis, mp, lp, alpha.data(), 0, t.R, t, scale);
        const at::Tensor pv = at::mm(s, vr[group].narrow(0, t.k0, t.C));  // [R, D]
        accumulate_rows(accp, pv.data_ptr<T>(), alpha.data(), 0, t.R, t);
      }
    }
  });
  at::parallel_for(0, g.groups() * g.rows(), rows_per_task(g.D), [&](int64_t begin, int64_t end) {
    finalize_rows(accp, mp, lp, o.data_ptr<T>(), lse.data_ptr<float>(), begin, end, g);
  });
}

// dq [groups, rows, D], dk, dv [groups, Sk, D] (fp32) from dO (rows layout) and δ.
template <typename T>
void backward_tiles(const at::Tensor& qr, const at::Tensor& kr, const at::Tensor& vr,
                    const at::Tensor& visible, const Geometry& g, float scale,
                    const at::Tensor& lse, const at::Tensor& dor, const at::Tensor& delta,
                    const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
  // bool read as bytes: GCC vectorises no loads of bool.
  const uint8_t* vis =
      visible.defined() ? reinterpret_cast<const uint8_t*>(visible.data_ptr<bool>()) : nullptr;
  const std::vector<uint8_t> live = live_blocks(visible, g);
  const int64_t nq = g.query_blocks(), nk = g.key_blocks(), D = g.D;
  const float* lsep = lse.data_ptr<float>();
  const float* deltap = delta.data_ptr<float>();
  at::parallel_for(0, g.groups(), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t group = g0; group < g1; ++group) {
      const at::Tensor q = qr[group], k = kr[group], v = vr[group], d_o = dor[group];
      float* dqp = dq[group].data_ptr<float>();
      float* dkp = dk[group].data_ptr<float>();
      float* dvp = dv[group].data_ptr<float>();
      for (int64_t i = 0; i < nq; ++i) {
        const Tile first = tile_of(g, group, i, 0);
        const at::Tensor qi = q.narrow(0, first.s0 * g.rep, first.R);
        const at::Tensor doi = d_o.narrow(0, first.s0 * g.rep, first.R);
        for (int64_t j = 0; j < nk; ++j) {
          if (!live[i * nk + j]) continue;
          const Tile t = tile_of(g, group, i, j);
          const at::Tensor kj = k.narrow(0, t.k0, t.C), vj = v.narrow(0, t.k0, t.C);
          at::Tensor p = at::mm(qi, kj.t());  // scores, then probabilities [R, C]
          probability_rows(p.data_ptr<T>(), vis, lsep, 0, t.R, t, scale);
          add_into(dvp + t.k0 * D, at::mm(p.t(), doi).data_ptr<T>(), t.C * D);
          at::Tensor ds = at::mm(doi, vj.t());  // dP, then dS [R, C]
          score_grad_rows(p.data_ptr<T>(), ds.data_ptr<T>(), deltap, 0, t.R, t, scale);
          add_into(dqp + t.s0 * g.rep * D, at::mm(ds, kj).data_ptr<T>(), t.R * D);
          add_into(dkp + t.k0 * D, at::mm(ds.t(), qi).data_ptr<T>(), t.C * D);
        }
      }
    }
  });
}

// [B, H, S, D] -> rows layout [groups, S·rep, D] (a copy), and back.
at::Tensor to_rows(const at::Tensor& x, const Geometry& g) {
  return x.reshape({g.B, g.KV, g.rep, x.size(2), g.D})
      .permute({0, 1, 3, 2, 4})
      .contiguous()
      .view({g.groups(), x.size(2) * g.rep, g.D});
}
at::Tensor from_rows(const at::Tensor& rows, const Geometry& g) {
  return rows.view({g.B, g.KV, g.S, g.rep, g.D})
      .permute({0, 1, 3, 2, 4})
      .reshape({g.B, g.H, g.S, g.D});
}

struct BlockedAttentionFn : torch::autograd::Function<BlockedAttentionFn> {
  // The mask comes by pointer: it is not differentiable, and may be undefined.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor* visible_in, double scale,
                            int64_t block) {
    const Geometry g = geometry_of(q, k, block);
    const at::Tensor visible = visible_in->defined() ? visible_in->contiguous() : at::Tensor();
    const at::Tensor qr = to_rows(q, g);
    const at::Tensor kr = k.contiguous().view({g.groups(), g.Sk, g.D});
    const at::Tensor vr = v.contiguous().view({g.groups(), g.Sk, g.D});
    // [B, H, S, D] over [B, S, H, D] memory.
    at::Tensor o =
        at::empty_strided({g.B, g.H, g.S, g.D}, {g.S * g.H * g.D, g.D, g.H * g.D, 1}, q.options());
    at::Tensor lse = at::empty({g.groups() * g.rows()}, q.options().dtype(at::kFloat));
    dispatch_float_bf16(q.scalar_type(), [&](auto zero) {
      forward_tiles<decltype(zero)>(qr, kr, vr, visible, g, static_cast<float>(scale), o, lse);
    });
    ctx->save_for_backward({qr, kr, vr, o, lse});
    ctx->saved_data["visible"] = visible;
    ctx->saved_data["masked"] = visible.defined();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["block"] = block;
    ctx->saved_data["kv_heads"] = g.KV;
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &qr = saved[0], &kr = saved[1], &vr = saved[2], &o = saved[3];
    const at::Tensor& lse = saved[4];
    const at::Tensor visible =
        ctx->saved_data["masked"].toBool() ? ctx->saved_data["visible"].toTensor() : at::Tensor();
    const double scale = ctx->saved_data["scale"].toDouble();
    Geometry g;
    g.B = o.size(0);
    g.H = o.size(1);
    g.S = o.size(2);
    g.D = o.size(3);
    g.KV = ctx->saved_data["kv_heads"].toInt();
    g.rep = g.H / g.KV;
    g.Sk = kr.size(1);
    g.block = ctx->saved_data["block"].toInt();
    const at::Tensor& d_o = grads[0];
    // δ = Σ_d dO·O per query row (FlashAttention-2's D), in the rows layout.
    const at::Tensor delta = (d_o.to(at::kFloat) * o.to(at::kFloat))
                                 .sum(-1)
                                 .view({g.B, g.KV, g.rep, g.S})
                                 .permute({0, 1, 3, 2})
                                 .contiguous();
    const at::Tensor dor = to_rows(d_o, g);
    const at::TensorOptions f32 = qr.options().dtype(at::kFloat);
    at::Tensor dq = at::zeros({g.groups(), g.rows(), g.D}, f32);
    at::Tensor dk = at::zeros({g.groups(), g.Sk, g.D}, f32);
    at::Tensor dv = at::zeros({g.groups(), g.Sk, g.D}, f32);
    dispatch_float_bf16(qr.scalar_type(), [&](auto zero) {
      backward_tiles<decltype(zero)>(qr, kr, vr, visible, g, static_cast<float>(scale), lse, dor,
                                     delta, dq, dk, dv);
    });
    const at::ScalarType dtype = qr.scalar_type();
    return {from_rows(dq.to(dtype), g),
            dk.view({g.B, g.KV, g.Sk, g.D}).to(dtype),
            dv.view({g.B, g.KV, g.Sk, g.D}).to(dtype),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

bool blocked_attention_applies(const at::Tensor& q, const at::Tensor& k, int64_t block) {
  const at::ScalarType t = q.scalar_type();
  return q.device().is_cpu() && k.device().is_cpu() && q.dim() == 4 && k.dim() == 4 &&
         (t == at::kFloat || t == at::kBFloat16) && k.scalar_type() == t && k.size(2) > 2 * block &&
         q.size(1) % k.size(1) == 0;
}

at::Tensor blocked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& visible, double scale, int64_t block) {
  RECORD_FUNCTION("weft::blocked_attention", std::vector<c10::IValue>({q, k, v, visible}));
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "blocked_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(!visible.defined() || (visible.scalar_type() == at::kBool && visible.dim() == 4 &&
                                     visible.size(0) == q.size(0) && visible.size(1) == 1 &&
                                     visible.size(2) == q.size(2) && visible.size(3) == k.size(2)),
              "blocked_attention: mask ", visible.sizes(), " does not fit q ", q.sizes(), ", k ",
              k.sizes());
  TORCH_CHECK(block >= 1, "blocked_attention: block ", block);
  return BlockedAttentionFn::apply(q, k, v, &visible, scale, block);
}

}  // namespace weft::model
