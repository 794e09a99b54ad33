// Attention by blocks of queries over tiles of the keys they see (model::attention_chunks), each
// tile by the fastest kernel its pattern allows, the tiles of a block merged by their
// log-sum-exps (as ring attention merges its steps). Under a causal mask one fused attention with
// a mask computes every score and reads the mask; here the keys before a block take an unmasked
// kernel, the diagonal a causal one that skips its upper half, and only the tiles where an image
// (bidirectional) or a document boundary cuts through take the mask: half the scores of the
// square, most of them without a mask. Where the kernel takes causal tiles longer than their
// queries (CUDA's flash attention, and the fp32 reference), the tiles are joined first
// (join_causal_tiles): a block's unmasked keys and its diagonal become one causal call, and the
// blocks past the masked ones one block, so under a causal mask with an image near the start
// attention is two calls with nothing to merge. Used from LibTorch 2.3 on (LibTorch 1.13's own
// path, blocked_attention, skips hidden key blocks itself).
//
// Kernels per tile, by device, within LibTorch's own limits for them: on CUDA, flash attention for
// unmasked and causal tiles (bf16 / fp16 from sm80, head dim a multiple of 8 up to 192, 256 on
// sm80 and sm90), memory-efficient attention with a bias otherwise (bf16 from sm80); on the CPU
// LibTorch's flash attention (2.3 on, masks included); and a reference in fp32 ATen ops (kMath:
// for tests; Llm::blocks_forward does not tile where a kind of tile would fall to it).
//
// Backward runs each tile's kernel backward with the block's merged output and log-sum-exp, which
// gives that tile's exact share of dq, dk and dv; key and value gradients are summed into their
// ranges in place. Saves q, k, v, the output and one fp32 log-sum-exp per query and head: no
// per-tile activations. Backward sums the gradients of 16-bit inputs in fp32 buffers of dq, dk
// and dv (of K/V expanded to H heads, when expanded once).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "weft/model/mask.h"

namespace weft::model {

// The mask's part for each masked tile of `chunks` (chunk by chunk, tile by tile, in order),
// made once per forward and shared by every block.
struct ChunkMasks {
  std::vector<at::Tensor> bias;  // [B, 1, queries, keys]: 0 visible, -inf hidden
  std::vector<at::Tensor> sees;  // bool [B, 1, queries]: the query sees some key of the tile
  bool empty() const { return sees.empty(); }
};

// `mask`: [B, 1, S, S], boolean (true = visible) or compat::attention_mask's additive form; the
// bias in `dtype`, the queries' (CUDA's memory-efficient kernel takes no other).
ChunkMasks chunk_masks(const at::Tensor& mask, const std::vector<AttentionChunk>& chunks,
                       at::ScalarType dtype);

enum class TileKernels { kFastest, kMath };

// Same contract as compat::attention (q [B, H, S, D]; k, v [B, KV, S, D], self-attention), with
// the mask given as `chunks` and their `masks`. CUDA's flash attention takes grouped K/V heads
// as they are; for the other kernels they are expanded to H heads (once, or per tile when the
// tiles that need it read at most S keys between them). Output [B, H, S, D], laid out as [B, S, H,
// D] so the caller's transpose back is free.
at::Tensor chunked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<AttentionChunk>& chunks, const ChunkMasks& masks,
                             double scale, TileKernels kernels = TileKernels::kFastest);

// Whether LibTorch has a fused kernel for every kind of tile for queries on `device` in `dtype`
// with heads of `head_dim` (from 2.3 on; on CUDA within the kernels' limits of GPU, dtype and
// head size). Where it has not, tiles would take kMath, slower than one attention over all keys.
bool chunked_attention_has_kernels(c10::Device device, at::ScalarType dtype, int64_t head_dim);

// How many chunked_attention calls this process made (tests check that the path runs).
int64_t chunked_attention_calls();

}  // namespace weft::model
