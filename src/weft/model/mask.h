// Dense boolean attention masks from the O(S) token descriptors of core/mask.h, and the key
// ranges each block of queries can see.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weft::model {

// doc, item: int [B, S] (see weft::TokenDesc). Returns bool [B, 1, S, S], true = may attend,
// following weft::visible exactly.
at::Tensor visible_mask(const at::Tensor& doc, const at::Tensor& item);

// How a tile of the score matrix (a block of queries against a range of keys) is seen, in every
// row of the batch: every key by every query; causally (query i sees the tile's keys up to i: the
// tile ends where its block ends, so its triangle is aligned to the lower right; attention_chunks
// makes square ones on the diagonal, join_causal_tiles longer ones); or some other pattern, which
// needs the mask.
enum class TileKind : uint8_t { kAll, kCausal, kMasked };

struct AttentionTile {
  int64_t k_begin = 0, k_end = 0;
  TileKind kind = TileKind::kMasked;
};

// Queries [q_begin, q_end) and the tiles of keys they see, in key order: every key any of them
// sees (in any row, by weft::visible) lies in a tile; keys in no tile are hidden from them all.
struct AttentionChunk {
  int64_t q_begin = 0, q_end = 0;
  std::vector<AttentionTile> tiles;
};

// Blocks of queries and their tiles, from host doc / item [B, S]. Queries whose keys follow one
// pattern in every row make one block, however long: causal from one key (an unmasked tile of
// the keys before the block, then its causal diagonal) or one span of keys for them all (one
// unmasked tile), as when images and documents sit at the same places in every row. The other
// queries, and such runs shorter than max(16, chunk / 4) queries (at most `chunk`), go in blocks
// of at most `chunk`, over key blocks of `chunk` on the grid from 0 and their own diagonal;
// adjacent tiles of one kind are merged and hidden ones dropped. Empty when tiling saves too
// little: when the tiles' work (a causal tile counting half) is more than `most` of the S×S
// square, or when the descriptors are not contiguous spans (a document or an item resumed after
// another; such rows take the whole mask). Causal text is one causal block, half the square
// without a mask; an image at one place in every row adds an unmasked block for its tokens.
std::vector<AttentionChunk> attention_chunks(const at::Tensor& doc, const at::Tensor& item,
                                             int64_t chunk, double most = 0.8);

// The same attention in fewer, larger tiles, for kernels whose causal tiles may be longer than
// their block (lower-right aligned, as CUDA's flash attention takes is_causal): in each block an
// unmasked run of keys that ends where its causal diagonal begins joins the diagonal (query i
// sees keys [k, i]: one causal tile from k), and consecutive blocks without masked tiles whose
// tiles are the same but for a causal tile from the same key join into one block. Under a causal
// mask every block past the masked ones becomes one: one kernel call, no log-sum-exp merge.
std::vector<AttentionChunk> join_causal_tiles(const std::vector<AttentionChunk>& chunks);

// The chunks as text: per block, each tile's keys and kind (A unmasked, C causal, M masked),
// blocks ended by "| ": "0-16C | 0-16A 16-32C | ".
std::string describe(const std::vector<AttentionChunk>& chunks);

}  // namespace weft::model
