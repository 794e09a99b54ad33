// Fused RMSNorm, LayerNorm, SwiGLU, GELU, RoPE and patchify (fused.h): autograd ops over rows of
// the last dim, math in fp32 (fused_math.h), parallel over rows or elements.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "weft/model/fused.h"
#include "weft/model/fused_math.h"
#include "weft/model/torch_compat.h"

#ifdef WEFT_CUDA_KERNELS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "weft/model/fused_cuda.h"
#endif

namespace weft::model {

namespace {

using simd::dispatch_float_bf16;
using simd::lane_dot;
using simd::lane_sum;
using simd::load;
using simd::store;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kTaskElements = 16384;  // elements per parallel task

bool fusable(const at::Tensor& x) {
  return x.device().is_cpu() && x.dim() >= 1 && x.numel() > 0 &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// A norm's fp32 [n] parameter (weight or bias).
bool fusable_param(const at::Tensor& p, int64_t n) {
  return p.defined() && p.device().is_cpu() && p.scalar_type() == at::kFloat && p.dim() == 1 &&
         p.size(0) == n && p.is_contiguous();
}

// Rows per task (and per parameter-gradient block) for rows of n elements. Depends on the
// shape only, so the block sums below do not depend on the thread count.
int64_t rows_per_task(int64_t n) { return std::max<int64_t>(1, kTaskElements / n); }
int64_t row_blocks(int64_t rows, int64_t n) {
  return (rows + rows_per_task(n) - 1) / rows_per_task(n);
}

// f(block, begin, end) over the row_blocks(rows, n) blocks of rows, in parallel.
template <typename F>
void for_row_blocks(int64_t rows, int64_t n, const F& f) {
  const int64_t per = rows_per_task(n);
  at::parallel_for(0, row_blocks(rows, n), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f(b, b * per, std::min(rows, (b + 1) * per));
  });
}

// The parameter gradients of a norm: every block of rows adds its contribution to its own
// partial row; the blocks are then summed in order (deterministic).
struct ParamGrads {
  int64_t n = 0, count = 0;  // parameters, and how many (weight; weight and bias)
  std::vector<float> partial;
  ParamGrads(int64_t n, int64_t count, int64_t blocks)
      : n(n), count(count), partial(static_cast<size_t>(blocks * count * n), 0.0f) {}
  float* block(int64_t b, int64_t which) { return partial.data() + (b * count + which) * n; }
  at::Tensor total(int64_t which, int64_t blocks) {
    at::Tensor out = at::zeros({n}, at::kFloat);
    float* o = out.data_ptr<float>();
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = block(b, which);
      for (int64_t k = 0; k < n; ++k) o[k] += p[k];
    }
    return out;
  }
};

// ---- RMSNorm -------------------------------------------------------------------------------

template <typename T>
WEFT_VECTOR_CLONES void rms_norm_rows(const T* x, const float* w, T* y, float* rstd, int64_t begin,
                                      int64_t end, int64_t n, float eps) {
  std::vector<float> e(static_cast<size_t>(n));
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    for (int64_t k = 0; k < n; ++k) e[k] = load(xr, k);
    const float s = 1.0f / std::sqrt(lane_dot(e.data(), e.data(), n) / static_cast<float>(n) + eps);
    T* yr = y + r * n;
    for (int64_t k = 0; k < n; ++k) store(yr, k, e[k] * s * w[k]);
    rstd[r] = s;
  }
}

// dx = rstd·(g·w − x̂·mean(g·w·x̂)), dw += g·x̂ with x̂ = x·rstd.
template <typename T>
WEFT_VECTOR_CLONES void rms_norm_grad_rows(const T* x, const T* g, const float* w,
                                           const float* rstd, T* dx, float* dw, int64_t begin,
                                           int64_t end, int64_t n) {
  std::vector<float> xh(static_cast<size_t>(n)), gw(static_cast<size_t>(n));
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    const T* gr = g + r * n;
    const float s = rstd[r];
    for (int64_t k = 0; k < n; ++k) {
      xh[k] = load(xr, k) * s;
      gw[k] = load(gr, k) * w[k];
    }
    if (dw)
      for (int64_t k = 0; k < n; ++k) dw[k] += load(gr, k) * xh[k];
    if (!dx) continue;
    const float c = lane_dot(gw.data(), xh.data(), n) * inv_n;
    T* dr = dx + r * n;
    for (int64_t k = 0; k < n; ++k) store(dr, k, s * (gw[k] - xh[k] * c));
  }
}

struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& w,
                            double eps) {
    const at::Tensor x = x_in.contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    at::Tensor y = at::empty_like(x);
    at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    dispatch_float_bf16(x.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data_ptr<T>();
      T* yp = y.data_ptr<T>();
      const float* wp = w.data_ptr<float>();
      float* sp = rstd.data_ptr<float>();
      at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
        rms_norm_rows(xp, wp, yp, sp, begin, end, n, static_cast<float>(eps));
      });
    });
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor g = grads[0].contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n, blocks = row_blocks(rows, n);
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1);
    at::Tensor dx = need_dx ? at::empty_like(x) : at::Tensor();
    ParamGrads pg(n, 1, need_dw ? blocks : 0);
    dispatch_float_bf16(x.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data_ptr<T>();
      const T* gp = g.data_ptr<T>();
      T* dp = need_dx ? dx.data_ptr<T>() : nullptr;
      for_row_blocks(rows, n, [&](int64_t b, int64_t begin, int64_t end) {
        rms_norm_grad_rows(xp, gp, w.data_ptr<float>(), rstd.data_ptr<float>(), dp,
                           need_dw ? pg.block(b, 0) : nullptr, begin, end, n);
      });
    });
    return {dx, need_dw ? pg.total(0, blocks) : at::Tensor(), at::Tensor()};
  }
};

// ---- LayerNorm -----------------------------------------------------------------------------

template <typename T>
WEFT_VECTOR_CLONES void layer_norm_rows(const T* x, const float* w, const float* b, T* y,
                                        float* mean, float* rstd, int64_t begin, int64_t end,
                                        int64_t n, float eps) {
  std::vector<float> e(static_cast<size_t>(n));
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    for (int64_t k = 0; k < n; ++k) e[k] = load(xr, k);
    const float mu = lane_sum(e.data(), n) * inv_n;
    for (int64_t k = 0; k < n; ++k) e[k] -= mu;
    const float s = 1.0f / std::sqrt(lane_dot(e.data(), e.data(), n) * inv_n + eps);
    T* yr = y + r * n;
    for (int64_t k = 0; k < n; ++k) store(yr, k, e[k] * s * w[k] + b[k]);
    mean[r] = mu;
    rstd[r] = s;
  }
}

// dx = rstd·(g·w − mean(g·w) − x̂·mean(g·w·x̂)), dw += g·x̂, db += g with x̂ = (x − mean)·rstd.
template <typename T>
WEFT_VECTOR_CLONES void layer_norm_grad_rows(const T* x, const T* g, const float* w,
                                             const float* mean, const float* rstd, T* dx, float* dw,
                                             float* db, int64_t begin, int64_t end, int64_t n) {
  std::vector<float> xh(static_cast<size_t>(n)), gw(static_cast<size_t>(n));
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * n;
    const T* gr = g + r * n;
    const float mu = mean[r], s = rstd[r];
    for (int64_t k = 0; k < n; ++k) {
      xh[k] = (load(xr, k) - mu) * s;
      gw[k] = load(gr, k) * w[k];
    }
    if (dw)
      for (int64_t k = 0; k < n; ++k) dw[k] += load(gr, k) * xh[k];
    if (db)
      for (int64_t k = 0; k < n; ++k) db[k] += load(gr, k);
    if (!dx) continue;
    const float a = lane_sum(gw.data(), n) * inv_n;
    const float c = lane_dot(gw.data(), xh.data(), n) * inv_n;
    T* dr = dx + r * n;
    for (int64_t k = 0; k < n; ++k) store(dr, k, s * (gw[k] - a - xh[k] * c));
  }
}

struct LayerNormFn : torch::autograd::Function<LayerNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& w,
                            const at::Tensor& b, double eps) {
    const at::Tensor x = x_in.contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    at::Tensor y = at::empty_like(x);
    at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
    at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    dispatch_float_bf16(x.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data_ptr<T>();
      T* yp = y.data_ptr<T>();
      at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
        layer_norm_rows(xp, w.data_ptr<float>(), b.data_ptr<float>(), yp, mean.data_ptr<float>(),
                        rstd.data_ptr<float>(), begin, end, n, static_cast<float>(eps));
      });
    });
    ctx->save_for_backward({x, w, mean, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &mean = saved[2], &rstd = saved[3];
    const at::Tensor g = grads[0].contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n, blocks = row_blocks(rows, n);
    const bool need_dx = ctx->needs_input_grad(0);
    const bool need_dw = ctx->needs_input_grad(1), need_db = ctx->needs_input_grad(2);
    at::Tensor dx = need_dx ? at::empty_like(x) : at::Tensor();
    ParamGrads pg(n, 2, need_dw || need_db ? blocks : 0);
    dispatch_float_bf16(x.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data_ptr<T>();
      const T* gp = g.data_ptr<T>();
      T* dp = need_dx ? dx.data_ptr<T>() : nullptr;
      for_row_blocks(rows, n, [&](int64_t b, int64_t begin, int64_t end) {
        layer_norm_grad_rows(xp, gp, w.data_ptr<float>(), mean.data_ptr<float>(),
                             rstd.data_ptr<float>(), dp, need_dw ? pg.block(b, 0) : nullptr,
                             need_db ? pg.block(b, 1) : nullptr, begin, end, n);
      });
    });
    return {dx, need_dw ? pg.total(0, blocks) : at::Tensor(),
            need_db ? pg.total(1, blocks) : at::Tensor(), at::Tensor()};
  }
};

// ---- SwiGLU --------------------------------------------------------------------------------

template <typename T>
WEFT_VECTOR_CLONES void swiglu_rows(const T* gu, T* h, int64_t begin, int64_t end, int64_t f) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gr = gu + r * 2 * f;
    const T* ur = gr + f;
    T* hr = h + r * f;
    for (int64_t k = 0; k < f; ++k) {
      const float g = load(gr, k);
      store(hr, k, g * simd::sigmoid(g) * load(ur, k));
    }
  }
}

// d gate = dh·up·σ(g)·(1 + g·(1 − σ(g))), d up = dh·g·σ(g). One row; restrict: the two outputs
// are halves of one row, which the vectoriser cannot tell apart otherwise.
template <typename T>
WEFT_SIMD_INLINE void swiglu_grad_row(const T* __restrict gate, const T* __restrict up,
                                      const T* __restrict dh, T* __restrict d_gate,
                                      T* __restrict d_up, int64_t f) {
  for (int64_t k = 0; k < f; ++k) {
    const float g = load(gate, k), d = load(dh, k);
    const float s = simd::sigmoid(g);
    store(d_gate, k, d * load(up, k) * s * (1.0f + g * (1.0f - s)));
    store(d_up, k, d * g * s);
  }
}

template <typename T>
WEFT_VECTOR_CLONES void swiglu_grad_rows(const T* gu, const T* dh, T* dgu, int64_t begin,
                                         int64_t end, int64_t f) {
  for (int64_t r = begin; r < end; ++r)
    swiglu_grad_row(gu + r * 2 * f, gu + r * 2 * f + f, dh + r * f, dgu + r * 2 * f,
                    dgu + r * 2 * f + f, f);
}

struct SwiGluFn : torch::autograd::Function<SwiGluFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gu_in) {
    const at::Tensor gu = gu_in.contiguous();
    const int64_t f = gu.size(-1) / 2, rows = gu.numel() / (2 * f);
    std::vector<int64_t> shape = gu.sizes().vec();
    shape.back() = f;
    at::Tensor h = at::empty(shape, gu.options());
    dispatch_float_bf16(gu.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* gp = gu.data_ptr<T>();
      T* hp = h.data_ptr<T>();
      at::parallel_for(0, rows, rows_per_task(2 * f),
                       [&](int64_t begin, int64_t end) { swiglu_rows(gp, hp, begin, end, f); });
    });
    ctx->save_for_backward({gu});
    return h;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor gu = ctx->get_saved_variables()[0];
    const at::Tensor dh = grads[0].contiguous();
    const int64_t f = gu.size(-1) / 2, rows = gu.numel() / (2 * f);
    at::Tensor dgu = at::empty_like(gu);
    dispatch_float_bf16(gu.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* gp = gu.data_ptr<T>();
      const T* dp = dh.data_ptr<T>();
      T* op = dgu.data_ptr<T>();
      at::parallel_for(0, rows, rows_per_task(2 * f), [&](int64_t begin, int64_t end) {
        swiglu_grad_rows(gp, dp, op, begin, end, f);
      });
    });
    return {dgu};
  }
};

// ---- GELU ----------------------------------------------------------------------------------

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

template <typename T>
WEFT_VECTOR_CLONES void gelu_range(const T* x, T* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = load(x, i);
    store(y, i, 0.5f * v * (1.0f + simd::erf(v * kSqrtHalf)));
  }
}

// GELU'(x) = Φ(x) + x·φ(x).
template <typename T>
WEFT_VECTOR_CLONES void gelu_grad_range(const T* x, const T* g, T* dx, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = load(x, i);
    const float cdf = 0.5f * (1.0f + simd::erf(v * kSqrtHalf));
    const float pdf = kInvSqrt2Pi * simd::exp_nonpositive(-0.5f * v * v);
    store(dx, i, load(g, i) * (cdf + v * pdf));
  }
}

struct GeluFn : torch::autograd::Function<GeluFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in) {
    const at::Tensor x = x_in.contiguous();
    at::Tensor y = at::empty_like(x);
    dispatch_float_bf16(x.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data_ptr<T>();
      T* yp = y.data_ptr<T>();
      at::parallel_for(0, x.numel(), kTaskElements,
                       [&](int64_t begin, int64_t end) { gelu_range(xp, yp, begin, end); });
    });
    ctx->save_for_backward({x});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].contiguous();
    at::Tensor dx = at::empty_like(x);
    dispatch_float_bf16(x.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* xp = x.data_ptr<T>();
      const T* gp = g.data_ptr<T>();
      T* dp = dx.data_ptr<T>();
      at::parallel_for(0, x.numel(), kTaskElements, [&](int64_t begin, int64_t end) {
        gelu_grad_range(xp, gp, dp, begin, end);
      });
    });
    return {dx};
  }
};

// ---- RoPE ----------------------------------------------------------------------------------

// y = x·cos + roll(x, D/2)·rot_sin over one head row of D (h = D/2):
//   y[i] = x[i]·c[i] + x[i + h]·r[i],  y[i + h] = x[i + h]·c[i + h] + x[i]·r[i + h]  (i < h).
// Backward (the adjoint; roll by D/2 is its own inverse):
//   dx[i] = g[i]·c[i] + g[i + h]·r[i + h],  dx[i + h] = g[i + h]·c[i + h] + g[i]·r[i].
template <typename T>
WEFT_SIMD_INLINE void rope_row(const T* __restrict x, const float* __restrict c,
                               const float* __restrict r, T* __restrict y, int64_t h,
                               bool backward) {
  const int64_t lo = backward ? h : 0, hi = backward ? 0 : h;  // where the partner's r is read
  for (int64_t i = 0; i < h; ++i) {
    const float a = load(x, i), b = load(x, i + h);
    store(y, i, a * c[i] + b * r[i + lo]);
    store(y, i + h, b * c[i + h] + a * r[i + hi]);
  }
}

// Rows [begin, end) of the B·S·H head rows; x and y strided by (b, s, h), tables by (b, s).
template <typename T>
WEFT_VECTOR_CLONES void rope_rows(const T* x, const float* cos, const float* rot_sin, T* y,
                                  int64_t begin, int64_t end, int64_t S, int64_t H, int64_t D,
                                  const int64_t* xs, const int64_t* ys, bool backward) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t bs = row / H, hh = row % H, b = bs / S, s = bs % S;
    rope_row(x + b * xs[0] + s * xs[1] + hh * xs[2], cos + bs * D, rot_sin + bs * D,
             y + b * ys[0] + s * ys[1] + hh * ys[2], D / 2, backward);
  }
}

// x, y: [B, S, H, D], any strides but a contiguous last dim.
template <typename T>
void rope_apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& rot_sin,
                const at::Tensor& y, bool backward) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  const int64_t xs[3] = {x.stride(0), x.stride(1), x.stride(2)};
  const int64_t ys[3] = {y.stride(0), y.stride(1), y.stride(2)};
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* rp = rot_sin.data_ptr<float>();
  at::parallel_for(0, B * S * H, rows_per_task(D), [&](int64_t begin, int64_t end) {
    rope_rows(xp, cp, rp, yp, begin, end, S, H, D, xs, ys, backward);
  });
}

// The output is laid out head-major ([B, H, S, D] memory, [B, S, H, D] shape): attention
// transposes it to exactly that, so its matmuls take it without a copy, and its gradient comes
// back in that layout, which the backward reads as it is.
struct RopeFn : torch::autograd::Function<RopeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& rot_sin) {
    const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
    at::Tensor y = at::empty_strided({B, S, H, D}, {H * S * D, D, S * D, 1}, x.options());
    dispatch_float_bf16(x.scalar_type(),
                        [&](auto zero) { rope_apply<decltype(zero)>(x, cos, rot_sin, y, false); });
    ctx->save_for_backward({cos, rot_sin});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor g = grads[0].stride(3) == 1 ? grads[0] : grads[0].contiguous();
    at::Tensor dx = at::empty(g.sizes(), g.options());
    dispatch_float_bf16(g.scalar_type(), [&](auto zero) {
      rope_apply<decltype(zero)>(g, saved[0], saved[1], dx, true);
    });
    return {dx, at::Tensor(), at::Tensor()};
  }
};

// ---- Patches -------------------------------------------------------------------------------

// Between images [N, C, H, W] and patch rows [N, gh, gw, C, k, k]: element type only matters by
// its size (U: an unsigned integer of that size). to_patches = true gathers, else scatters.
template <typename U>
void copy_patches(U* images, U* patches, int64_t N, int64_t C, int64_t H, int64_t W, int64_t k,
                  bool to_patches) {
  const int64_t gh = H / k, gw = W / k;
  at::parallel_for(0, N * gh, std::max<int64_t>(1, kTaskElements / (gw * C * k * k)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) {
                       const int64_t n = t / gh, py = t % gh;
                       U* row = patches + t * gw * C * k * k;
                       for (int64_t px = 0; px < gw; ++px)
                         for (int64_t c = 0; c < C; ++c)
                           for (int64_t ky = 0; ky < k; ++ky) {
                             U* img = images + ((n * C + c) * H + py * k + ky) * W + px * k;
                             U* pat = row + ((px * C + c) * k + ky) * k;
                             if (to_patches)
                               for (int64_t kx = 0; kx < k; ++kx) pat[kx] = img[kx];
                             else
                               for (int64_t kx = 0; kx < k; ++kx) img[kx] = pat[kx];
                           }
                     }
                   });
}

template <typename F>
void dispatch_element_size(int64_t size, const F& f) {
  switch (size) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    default:
      TORCH_CHECK(size == 8, "patchify: element size ", size);
      return f(uint64_t{});
  }
}

struct PatchifyFn : torch::autograd::Function<PatchifyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, int64_t k) {
    const at::Tensor x = x_in.contiguous();
    const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    at::Tensor out = at::empty({N, (H / k) * (W / k), C * k * k}, x.options());
    dispatch_element_size(x.element_size(), [&](auto zero) {
      using U = decltype(zero);
      copy_patches(static_cast<U*>(x.data_ptr()), static_cast<U*>(out.data_ptr()), N, C, H, W, k,
                   true);
    });
    ctx->saved_data["k"] = k;
    ctx->saved_data["shape"] = x.sizes().vec();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t k = ctx->saved_data["k"].toInt();
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    const at::Tensor g = grads[0].contiguous();
    const int64_t N = shape[0], C = shape[1], H = shape[2], W = shape[3];
    // Whole patches cover every pixel unless H or W is not a multiple of k.
    at::Tensor dx =
        H % k == 0 && W % k == 0 ? at::empty(shape, g.options()) : at::zeros(shape, g.options());
    dispatch_element_size(g.element_size(), [&](auto zero) {
      using U = decltype(zero);
      copy_patches(static_cast<U*>(dx.data_ptr()), static_cast<U*>(g.data_ptr()), N, C, H, W, k,
                   false);
    });
    return {dx, at::Tensor()};
  }
};

#ifdef WEFT_CUDA_KERNELS
// ---- The same ops on CUDA tensors (fused_cuda.cu) ------------------------------------------

bool cuda_fusable(const at::Tensor& x) {
  return x.is_cuda() && x.dim() >= 1 && x.numel() > 0 &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

bool cuda_fusable_param(const at::Tensor& p, const at::Tensor& x) {
  return p.defined() && p.device() == x.device() && p.scalar_type() == at::kFloat && p.dim() == 1 &&
         p.size(0) == x.size(-1) && p.is_contiguous();
}

void* stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

struct RmsNormCudaFn : torch::autograd::Function<RmsNormCudaFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& w,
                            double eps) {
    const c10::cuda::CUDAGuard guard(x_in.device());
    const at::Tensor x = x_in.contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    at::Tensor y = at::empty_like(x);
    at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    cuda::rms_norm_forward(is_bf16(x), x.data_ptr(), w.data_ptr<float>(), y.data_ptr(),
                           rstd.data_ptr<float>(), rows, n, static_cast<float>(eps), stream_of(x));
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const c10::cuda::CUDAGuard guard(x.device());
    const at::Tensor g = grads[0].to(x.scalar_type()).contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1);
    at::Tensor dx = need_dx ? at::empty_like(x) : at::Tensor();
    at::Tensor partial =
        need_dw ? at::empty({cuda::rms_norm_grad_blocks(rows), n}, x.options().dtype(at::kFloat))
                : at::Tensor();
    cuda::rms_norm_backward(is_bf16(x), x.data_ptr(), g.data_ptr(), w.data_ptr<float>(),
                            rstd.data_ptr<float>(), need_dx ? dx.data_ptr() : nullptr,
                            need_dw ? partial.data_ptr<float>() : nullptr, rows, n, stream_of(x));
    return {dx, need_dw ? partial.sum(0) : at::Tensor(), at::Tensor()};
  }
};

struct SwiGluCudaFn : torch::autograd::Function<SwiGluCudaFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gu_in) {
    const c10::cuda::CUDAGuard guard(gu_in.device());
    const at::Tensor gu = gu_in.contiguous();
    const int64_t f = gu.size(-1) / 2, rows = gu.numel() / (2 * f);
    std::vector<int64_t> shape = gu.sizes().vec();
    shape.back() = f;
    at::Tensor h = at::empty(shape, gu.options());
    cuda::swiglu_forward(is_bf16(gu), gu.data_ptr(), h.data_ptr(), rows, f, stream_of(gu));
    ctx->save_for_backward({gu});
    return h;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor gu = ctx->get_saved_variables()[0];
    const c10::cuda::CUDAGuard guard(gu.device());
    const at::Tensor dh = grads[0].to(gu.scalar_type()).contiguous();
    const int64_t f = gu.size(-1) / 2, rows = gu.numel() / (2 * f);
    at::Tensor dgu = at::empty_like(gu);
    cuda::swiglu_backward(is_bf16(gu), gu.data_ptr(), dh.data_ptr(), dgu.data_ptr(), rows, f,
                          stream_of(gu));
    return {dgu};
  }
};

void rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& rot_sin,
               const at::Tensor& y, bool backward) {
  const int64_t xs[3] = {x.stride(0), x.stride(1), x.stride(2)};
  const int64_t ys[3] = {y.stride(0), y.stride(1), y.stride(2)};
  cuda::rope(is_bf16(x), x.data_ptr(), xs, cos.data_ptr<float>(), rot_sin.data_ptr<float>(),
             y.data_ptr(), ys, x.size(0), x.size(1), x.size(2), x.size(3), backward, stream_of(x));
}

// Laid out as RopeFn's output: head-major memory, [B, S, H, D] shape.
struct RopeCudaFn : torch::autograd::Function<RopeCudaFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& rot_sin) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
    at::Tensor y = at::empty_strided({B, S, H, D}, {H * S * D, D, S * D, 1}, x.options());
    rope_cuda(x, cos, rot_sin, y, false);
    ctx->save_for_backward({cos, rot_sin});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const c10::cuda::CUDAGuard guard(grads[0].device());
    const at::Tensor g = grads[0].stride(3) == 1 ? grads[0] : grads[0].contiguous();
    at::Tensor dx = at::empty(g.sizes(), g.options());
    rope_cuda(g, saved[0], saved[1], dx, true);
    return {dx, at::Tensor(), at::Tensor()};
  }
};
#endif  // WEFT_CUDA_KERNELS

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("weft::rms_norm", std::vector<c10::IValue>({x, weight}));
  if (fusable(x) && fusable_param(weight, x.size(-1))) return RmsNormFn::apply(x, weight, eps);
#ifdef WEFT_CUDA_KERNELS
  if (cuda_fusable(x) && cuda_fusable_param(weight, x) && x.size(-1) <= cuda::rms_norm_max_width())
    return RmsNormCudaFn::apply(x, weight, eps);
#endif
  const at::Tensor xf = x.to(at::kFloat);
  return (xf * at::rsqrt(xf.pow(2).mean(-1, true).add(eps)) * weight).to(x.scalar_type());
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      double eps) {
  RECORD_FUNCTION("weft::layer_norm", std::vector<c10::IValue>({x, weight, bias}));
  const int64_t n = x.size(-1);
  if (fusable(x) && fusable_param(weight, n) && fusable_param(bias, n))
    return LayerNormFn::apply(x, weight, bias, eps);
  return at::layer_norm(x.to(at::kFloat), {n}, weight, bias, eps).to(x.scalar_type());
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  RECORD_FUNCTION("weft::swiglu", std::vector<c10::IValue>({gate_up}));
  if (fusable(gate_up) && gate_up.size(-1) % 2 == 0) return SwiGluFn::apply(gate_up);
#ifdef WEFT_CUDA_KERNELS
  if (cuda_fusable(gate_up) && gate_up.size(-1) % 2 == 0) return SwiGluCudaFn::apply(gate_up);
#endif
  const std::vector<at::Tensor> gu = gate_up.chunk(2, -1);
  return at::silu(gu[0]) * gu[1];
}

at::Tensor gelu_erf(const at::Tensor& x) {
  RECORD_FUNCTION("weft::gelu_erf", std::vector<c10::IValue>({x}));
  if (fusable(x)) return GeluFn::apply(x);
  return compat::gelu(x);
}

at::Tensor patchify(const at::Tensor& images, int64_t k) {
  RECORD_FUNCTION("weft::patchify", std::vector<c10::IValue>({images, k}));
  TORCH_CHECK(images.dim() == 4 && k >= 1 && images.size(2) >= k && images.size(3) >= k,
              "patchify: images ", images.sizes(), " have no whole ", k, "x", k, " patch");
  if (images.device().is_cpu()) return PatchifyFn::apply(images, k);
  const int64_t N = images.size(0), C = images.size(1);
  const int64_t gh = images.size(2) / k, gw = images.size(3) / k;
  return images.narrow(2, 0, gh * k)
      .narrow(3, 0, gw * k)
      .reshape({N, C, gh, k, gw, k})
      .permute({0, 2, 4, 1, 3, 5})
      .reshape({N, gh * gw, C * k * k});
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& rot_sin) {
  RECORD_FUNCTION("weft::rope", std::vector<c10::IValue>({x, cos, rot_sin}));
  auto table_fits = [&](const at::Tensor& t) {
    return t.device() == x.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
           t.dim() == 4 && t.size(0) == x.size(0) && t.size(1) == x.size(1) && t.size(2) == 1 &&
           t.size(3) == x.size(3);
  };
  const bool fits = x.dim() == 4 && x.size(3) % 2 == 0 && x.stride(3) == 1 && table_fits(cos) &&
                    table_fits(rot_sin);
  if (fits && fusable(x)) return RopeFn::apply(x, cos, rot_sin);
#ifdef WEFT_CUDA_KERNELS
  if (fits && cuda_fusable(x)) return RopeCudaFn::apply(x, cos, rot_sin);
#endif
  const at::Tensor rolled = x.roll(x.size(-1) / 2, -1);
  return x * cos.to(x.scalar_type()) + rolled * rot_sin.to(x.scalar_type());
}

}  // namespace weft::model
