// Fused kernels for the memory-bound tail of a step: the gradient norm and the AdamW update read
// each fp32 tensor once, where a sequence of ATen ops makes a pass (and often a temporary) per
// op. CPU fp32 contiguous tensors take the fused loops (parallel over chunks); anything else
// (device tensors, other dtypes) takes the equivalent ATen ops.
#pragma once

#include <ATen/core/Tensor.h>

namespace weft::model {

// Σ x² accumulated in double.
double sum_squares(const at::Tensor& x);

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

}  // namespace weft::model
