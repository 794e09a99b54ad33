// The one place where LibTorch 1.13 (Debian) and 2.x (pip, CUDA machines) differ for weft's
// model code. Include from .cpp files only (it pulls in ATen ops).
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>

#include <limits>

#include "weft/model/blocked_attention.h"
#include "weft/model/fused.h"

// LibTorch at least M.m.
#define WEFT_TORCH_AT_LEAST(M, m) \
  (TORCH_VERSION_MAJOR > (M) || (TORCH_VERSION_MAJOR == (M) && TORCH_VERSION_MINOR >= (m)))

namespace weft::compat {

// scaled_dot_product_attention with a `scale` argument: 2.1 on.
constexpr bool kHasSdpa = WEFT_TORCH_AT_LEAST(2, 1);

// Attention with a boolean "may attend" mask [B, 1, S, Sk] (true = visible; undefined = all
// visible). q is [B, H, S, D]; k, v are [B, KV, Sk, D] with H a multiple of KV, query head h using
// K/V head h / (H / KV) (grouped-query). Every row must have a visible key. The mask may also be
// attention_mask()'s prepared form of one.
inline at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& visible, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  const int64_t KV = k.size(1), rep = H / KV;
#if WEFT_TORCH_AT_LEAST(2, 1)
  const int64_t Sk = k.size(2);
  at::Tensor ke = k, ve = v;
  if (rep > 1) {
    ke = k.unsqueeze(2).expand({B, KV, rep, Sk, D}).reshape({B, H, Sk, D});
    ve = v.unsqueeze(2).expand({B, KV, rep, Sk, D}).reshape({B, H, Sk, D});
  }
  c10::optional<at::Tensor> mask;  // boolean, or additive (attention_mask)
  if (visible.defined())
    mask = visible.scalar_type() == at::kBool ? visible : visible.to(q.scalar_type());
  return at::scaled_dot_product_attention(q, ke, ve, mask, 0.0, false, scale);
#else
  // Long sequences: blocks of keys with an online softmax, never the S×S scores.
  if (model::blocked_attention_applies(q, k))
    return model::blocked_attention(q, k, v, visible, scale);
  // Each K/V head's query heads stacked along the rows ([B, KV, rep * S, D]): no K/V copies;
  // one fused scaled masked softmax (fp32 inside) between two matmuls.
  const int64_t S = q.size(2);
  at::Tensor qg = q.reshape({B, KV, rep * S, D});
  at::Tensor p = model::masked_softmax(at::matmul(qg, k.transpose(-2, -1)), visible, scale);
  return at::matmul(p, v).view({B, H, S, D});
#endif
}

// The boolean mask as attention() takes it for queries of `dtype`. SDPA turns a boolean mask
// into an additive one (0 visible, -inf hidden) in the queries' dtype on every call, and keeps
// that copy for backward: converted once here, every block shares one tensor (the same values:
// SDPA's own conversion). Elsewhere (LibTorch 1.13's own attention) the boolean mask itself.
inline at::Tensor attention_mask(const at::Tensor& visible, at::ScalarType dtype) {
  if (!kHasSdpa || !visible.defined() || visible.scalar_type() != at::kBool) return visible;
  return at::zeros(visible.sizes(), visible.options().dtype(dtype))
      .masked_fill_(visible.logical_not(), -std::numeric_limits<double>::infinity());
}

// GELU. LibTorch 1.13's CPU GELU backward is wrong when the incoming gradient is not contiguous
// (it arrives through a transpose, as in the Whisper front end): all zeros in fp32, NaN in bf16.
// A hook hands it a contiguous gradient (a copy only when needed), which is exact.
inline at::Tensor gelu(const at::Tensor& x, c10::string_view approximate = "none") {
  at::Tensor y = at::gelu(x, approximate);
#if TORCH_VERSION_MAJOR < 2
  if (y.requires_grad())
    y.register_hook(
        [](const at::Tensor& g) { return g.is_contiguous() ? at::Tensor() : g.contiguous(); });
#endif
  return y;
}

}  // namespace weft::compat
