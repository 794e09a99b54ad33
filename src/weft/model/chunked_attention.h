// Attention by blocks of queries over tiles of the keys they see (model::attention_chunks), each
// tile by the fastest kernel its pattern allows, the tiles of a block merged by their
// log-sum-exps (as ring attention merges its steps). Under a causal mask one fused attention with
// a mask computes every score and reads the mask; here the keys before a block take an unmasked
// kernel, the diagonal a causal one that skips its upper half, and only the tiles where an image
// (bidirectional) or a document boundary cuts through take the mask: half the scores of the
// square, most of them without a mask. Where LibTorch 1.13's own path (blocked_attention) skips
// hidden key blocks itself, it is not needed.
//
// Kernels per tile, by device: on CUDA, flash attention for unmasked and causal tiles (bf16 /
// fp16, head dim a multiple of 8 up to 256, sm80 and later), memory-efficient attention with a
// bias otherwise; on the CPU LibTorch's flash attention (2.3 on, masks included); and a reference
// in fp32 ATen ops (kMath: LibTorch before 2.3, head dims no kernel takes, and tests).
//
// Backward runs each tile's kernel backward with the block's merged output and log-sum-exp, which
// gives that tile's exact share of dq, dk and dv; key and value gradients are summed into their
// ranges in place. Saves q, k, v, the output and one fp32 log-sum-exp per query: no per-tile
// activations.
#pragma once

#include <ATen/core/Tensor.h>

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

// `mask`: [B, 1, S, S], boolean (true = visible) or compat::attention_mask's additive form. The
// bias keeps an additive mask's dtype (a boolean one becomes fp32).
ChunkMasks chunk_masks(const at::Tensor& mask, const std::vector<AttentionChunk>& chunks);

enum class TileKernels { kFastest, kMath };

// Same contract as compat::attention (q [B, H, S, D]; k, v [B, KV, S, D], self-attention), with
// the mask given as `chunks` and their `masks`. CUDA's flash attention takes grouped K/V heads
// as they are; for the other kernels they are expanded to H heads (once, or per tile when the
// tiles that need it read fewer than S keys). Output [B, H, S, D], laid out as [B, S, H, D] so
// the caller's transpose back is free.
at::Tensor chunked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<AttentionChunk>& chunks, const ChunkMasks& masks,
                             double scale, TileKernels kernels = TileKernels::kFastest);

// Whether this LibTorch has a fused kernel for every tile on the CPU and on CUDA (2.3 on);
// before, tiles take kMath, which is slower than one attention over all keys.
bool chunked_attention_has_kernels();

// How many chunked_attention calls this process made (tests check that the path runs).
int64_t chunked_attention_calls();

}  // namespace weft::model
