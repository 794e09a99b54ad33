// Attention by blocks of queries, each over only the range of keys its queries can see
// (model::attention_chunks): under a causal or multimodal mask it skips the scores the mask
// hides from a whole block (3/8 of them with four blocks under a causal mask), where one fused
// attention call with a mask computes every score. For LibTorch's scaled_dot_product_attention,
// which skips nothing under an arbitrary mask (LibTorch 1.13's path, blocked_attention, skips
// hidden key blocks itself).
//
// Same contract as compat::attention; `masks[c]` is the mask of chunk c alone ([B, 1, queries,
// keys] of that chunk, boolean or compat::attention_mask's form), prepared once per forward
// (chunk_masks). K/V heads are expanded once for all chunks. The backward runs each chunk's
// attention backward in turn and sums its key and value gradients into their ranges in place (no
// zero-filled full-size gradient per chunk). Output [B, H, S, D].
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "weft/model/mask.h"

namespace weft::model {

// Each chunk's part of a [B, 1, S, S] mask, contiguous.
std::vector<at::Tensor> chunk_masks(const at::Tensor& mask,
                                    const std::vector<AttentionChunk>& chunks);

at::Tensor chunked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<AttentionChunk>& chunks,
                             const std::vector<at::Tensor>& masks, double scale);

// How many chunked_attention calls this process made (tests check that the path runs).
int64_t chunked_attention_calls();

}  // namespace weft::model
