// Fused kernels for the memory-bound tail of a step: the gradient norm and the AdamW update read
// each fp32 tensor once, where a sequence of ATen ops makes a pass (and often a temporary) per
// op. CPU fp32 contiguous tensors take the fused loops (parallel over chunks); anything else
// (device tensors, other dtypes) takes the equivalent ATen ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

namespace weft::model {

// Σ x² accumulated in double.
double sum_squares(const at::Tensor& x);
// Σ x² over every defined tensor of `xs`, in double: squares_each on the first device tensor's
// device (else the CPU), summed there and read back once, so a GPU waits once for the whole
// gradient norm, not once per parameter. On the CPU the per-tensor sums are added in order.
double sum_squares(const std::vector<at::Tensor>& xs);
// Per tensor of `xs`, Σ x² in double (0 for an undefined tensor), as a [n] double tensor on
// `device`, queued there and never read back: nothing waits for the device. CPU fp32 tensors
// take the fused loop (each entry equals sum_squares of that tensor); CUDA fp32 tensors on
// `device` one multi-tensor norm (LibTorch 2.3 on; fp32 norms — relative error ~1e-7, a norm
// past fp32's range reads as infinite — squared in double); others their norm in double.
at::Tensor squares_each(const std::vector<at::Tensor>& xs, c10::Device device);
// √(Σ squares) as a 0-dim double tensor where `squares` lives, queued on a device; on the CPU
// summed in order, so it equals √sum_squares(xs) for the tensors squares_each took.
at::Tensor norm_of_squares(const at::Tensor& squares);

// One AdamW update of p with gradient g·grad_scale and moments m, v (all the same shape):
//   p ← p·decay;  m ← β1·m + (1−β1)·g';  v ← β2·v + (1−β2)·g'²;
//   p ← p − lr/bc1 · m / (√(v/bc2) + eps),  with g' = g·grad_scale.
struct AdamWUpdate {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double decay = 1;         // 1 − lr·weight_decay, or 1 without decay
  double bc1 = 1, bc2 = 1;  // bias corrections 1 − β^t
  double grad_scale = 1;    // gradient clipping's factor
};
void adamw_update(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                  const at::Tensor& v, const AdamWUpdate& u);

}  // namespace weft::model

namespace weft::model {

// Scaled masked softmax over the last dim as one autograd op (Megatron's fused
// scaled_masked_softmax): p = softmax(scale·s) over the visible keys, 0 elsewhere, computed in
// fp32 and returned in the scores' dtype; backward: scale·p·(g − Σ g·p), from p alone.
// scores: [B, X, R, Sk]; visible: bool [B, 1, Sq, Sk] with R a multiple of Sq, score row r using
// mask row r mod Sq (grouped-query heads stacked along R); undefined = every key visible. Every
// row must see at least one key. Non-CPU tensors take the equivalent ATen ops.
at::Tensor masked_softmax(const at::Tensor& scores, const at::Tensor& visible, double scale);

// Cross-entropy of each row of logits [n, V] against targets [n] (int64, in [0, V)), a row at a
// time in fp32 (linear_cross_entropy_sum's chunks): returns fp32 [n] of log Σ_v exp(l_v) − l_target
// and, with `grad`, overwrites the logits with softmax − one-hot(target), rounded to their dtype
// (the loss's gradient for an incoming 1). One pass over the logits, where the ATen sequence
// makes an fp32 copy, a log-sum-exp temporary and a rounded copy of the gradient. CPU tensors,
// fp32 or bf16, contiguous; for anything else it returns an undefined tensor and does nothing
// (the caller takes the ATen ops).
at::Tensor cross_entropy_rows(at::Tensor& logits, const at::Tensor& targets, bool grad);

}  // namespace weft::model

namespace weft::model {

// Fused layer kernels, each one autograd op with a hand-written backward (Megatron's and
// Apex's fused RMSNorm / LayerNorm / SwiGLU / GELU): one pass over the activations each way,
// math in fp32, results in the input's dtype, where the ATen op sequences they replace make a
// pass and a temporary per op (and LibTorch 1.13's bf16 element-wise ops are slow). Input grads
// and parameter grads are those of the op sequence in fp32, rounded once. CPU tensors in fp32 or
// bf16 take the fused loops, and CUDA ones weft's CUDA kernels for RMSNorm, SwiGLU and RoPE
// (fused_cuda.h, in builds with nvcc); anything else takes the equivalent ATen ops. Parameter
// gradients reduce over rows in a fixed order: the result does not depend on the thread count.

// RMSNorm over the last dim, in fp32: x·rsqrt(mean(x²) + eps)·weight, returned in x's dtype.
// weight: fp32 [n].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// LayerNorm over the last dim, in fp32 (biased variance, eps inside the square root, as
// at::layer_norm), returned in x's dtype. weight, bias: fp32 [n].
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      double eps);

// SwiGLU of a fused gate/up projection: gate_up [..., 2F] (gate the first F, up the last F)
// -> silu(gate)·up [..., F].
at::Tensor swiglu(const at::Tensor& gate_up);

// Exact GELU, x·Φ(x) = x/2·(1 + erf(x/√2)), erf to within 1e-6 (named apart from at::gelu,
// which argument-dependent lookup would make an ambiguous overload). LibTorch 1.13's GELU
// backward bug (wrong for a non-contiguous incoming gradient) does not arise here.
at::Tensor gelu_erf(const at::Tensor& x);

// The non-overlapping k×k patches of images [N, C, H, W] as rows [N, (H/k)·(W/k), C·k·k], each
// in (c, y, x) order, patches in row-major order: the input of a patch embedding (a convolution
// with stride == kernel) as one matmul. Pixels past the last whole patch are dropped (their
// gradient is 0), as by the convolution. One copy each way, where permute + reshape costs a
// strided copy in forward and another in backward. Any dtype; CPU tensors take the loop.
at::Tensor patchify(const at::Tensor& images, int64_t k);

// Rotary embedding, rotate-half convention: x·cos + rotate_half(x)·sin, in fp32, returned in
// x's dtype. x: [B, S, H, D] with a contiguous last dim (a view into a fused QKV projection is
// fine); cos, rot_sin: fp32 [B, S, 1, D], rot_sin being sin with its first half negated
// (rotate_half(x)·sin = roll(x, D/2)·rot_sin). No gradient for the tables. The fused result is
// laid out head-major (its transpose(1, 2) is contiguous, as attention wants it).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& rot_sin);

}  // namespace weft::model
