// The one place where LibTorch 1.13 (Debian) and 2.x (pip, CUDA machines) differ for weft's
// model code. Include from .cpp files only (it pulls in ATen ops).
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>

namespace weft::compat {

constexpr bool kHasSdpa = TORCH_VERSION_MAJOR >= 2;

// Attention with a boolean "may attend" mask [B, 1, S, S] (true = visible). q, k, v are
// [B, H, S, D] with k/v already expanded to H heads. Every row must have a visible key.
// An undefined mask means every key is visible.
inline at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& visible, double scale) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(
      q, k, v, visible.defined() ? c10::optional<at::Tensor>(visible) : c10::nullopt, 0.0, false,
      scale);
#else
  // Exact masked matmul-softmax; softmax in fp32 whatever the compute dtype.
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).to(at::kFloat).mul_(scale);
  if (visible.defined())
    scores.masked_fill_(visible.logical_not(), -std::numeric_limits<float>::infinity());
  at::Tensor p = at::softmax(scores, -1).to(v.scalar_type());
  return at::matmul(p, v);
#endif
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
