// Blocked attention for long sequences on the CPU: FlashAttention-2's algorithm (an online
// softmax over key blocks, the backward recomputing each block's probabilities from the saved
// log-sum-exp) with LibTorch matmuls per block. It never holds the S×S scores or probabilities
// (the dense path keeps them for backward: B·H·S² values per layer), and it skips every block
// of keys the mask hides from every query of the block (half of them under a causal mask).
//
// Same contract as compat::attention, the dense path it stands in for: q [B, H, S, D]; k, v
// [B, KV, Sk, D] with H a multiple of KV (query head h uses K/V head h / (H/KV)); visible bool
// [B, 1, S, Sk] (true = may attend; undefined = every key visible); every query sees a key.
// Softmax statistics and accumulators in fp32; matmuls in the inputs' dtype (fp32 or bf16).
// Returns [B, H, S, D] in q's dtype, laid out as [B, S, H, D] (so o.transpose(1, 2) is
// contiguous). Deterministic from run to run (every output block has one writer).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace weft::model {

// Queries and keys per block: a tile is [block positions × H/KV heads] rows by `block` keys
// (256 measured fastest of 128/256/512 on 2 cores).
constexpr int64_t kAttentionBlock = 256;

// Whether blocked_attention takes these tensors (CPU, fp32 or bf16) and pays off: more than two
// blocks of keys. (small-vlm, batch 2, 2 cores: the step 1.2x faster than with the dense path at
// 2048 tokens, with 41% less memory, 1.03x at 1024; at 512 and below the two measured even.)
bool blocked_attention_applies(const at::Tensor& q, const at::Tensor& k,
                               int64_t block = kAttentionBlock);

at::Tensor blocked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& visible, double scale,
                             int64_t block = kAttentionBlock);

}  // namespace weft::model
