// The LM head and its cross-entropy as one autograd op, a chunk of rows at a time (the fused
// linear cross-entropy of Liger-Kernel and Apple's Cut Cross-Entropy): the [rows, vocab] logits
// are never held whole, neither in forward nor for backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "weft/dist/comm.h"

namespace weft::model {

// Σ_i cross-entropy(rows_i · weightᵀ, targets_i) as an fp32 scalar: rows [N, H] and weight
// [V, H] in the compute dtype, targets [N] in [0, V) (no ignored index: pass only real targets).
// Each chunk of `chunk_rows` rows (0: as many as make about 32 Mi logits, and at least H) gets
// its logits from one matmul, rounded to the compute dtype and then taken to fp32 (as
// linear(...).to(float) would), its loss (log-sum-exp less the target's logit), and, where
// autograd will want them (grad mode on, rows or weight requiring grad), its gradients
// (softmax − one-hot, rounded to the compute dtype, times the weight and times the rows) — in
// forward, since they need the logits. On the CPU the loss and softmax − one-hot take one pass
// per row over the logits, in place (fused.h cross_entropy_rows); elsewhere ATen ops. Backward
// scales what forward kept by the incoming gradient: [N, H] for the rows and [V, H] for the weight,
// in their dtypes, where the unfused loss keeps [N, V] fp32. The weight's gradient sums its chunks
// in fp32. Results equal cross_entropy(linear(rows, weight).float(), targets, sum) to rounding: the
// incoming gradient scales the rounded chunk gradients, not the fp32 logit gradients. No rows: a
// zero loss and zero gradients. Not twice differentiable. The per-layer profiler prices the head
// unfused (Llm::loss_sum's `fused`): the classic forward / backward split.
//
// Vocab-parallel (`tp` of more than one rank): weight is this rank's rows of the vocabulary,
// [V/tp, H], the tp.rank()-th block of them; targets stay global ids. Each chunk's max, sum of
// exponentials and target logit are combined over `tp` (two fp32 all-reduces of [n] per chunk),
// so every rank returns the whole loss; the rows' gradient, a partial sum over this rank's
// vocabulary, is all-reduced over `tp` once; the weight's is this rank's block. Every rank of
// `tp` must call it with the same rows and targets.
at::Tensor linear_cross_entropy_sum(const at::Tensor& rows, const at::Tensor& weight,
                                    const at::Tensor& targets, int64_t chunk_rows = 0,
                                    const dist::Comm& tp = dist::Comm());

}  // namespace weft::model
