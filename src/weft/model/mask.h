// Dense boolean attention masks from the O(S) token descriptors of core/mask.h, and the key
// ranges each block of queries can see.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace weft::model {

// doc, item: int [B, S] (see weft::TokenDesc). Returns bool [B, 1, S, S], true = may attend,
// following weft::visible exactly.
at::Tensor visible_mask(const at::Tensor& doc, const at::Tensor& item);

// Queries [q_begin, q_end) and a range of keys [k_begin, k_end) holding every key that any of
// them sees in any row (by weft::visible): attention of those queries over these keys alone is
// their attention over all keys.
struct AttentionChunk {
  int64_t q_begin = 0, q_end = 0, k_begin = 0, k_end = 0;
};

// Blocks of `chunk` queries and their key ranges (ends rounded out to multiples of 16), from
// host doc / item [B, S]. Empty when the blocks would still cover more than `most` of the S×S
// scores (every key visible, short rows): then one attention over all keys is as cheap. Under a
// causal mask with S = 4·chunk they cover 5/8.
std::vector<AttentionChunk> attention_chunks(const at::Tensor& doc, const at::Tensor& item,
                                             int64_t chunk, double most = 0.8);

}  // namespace weft::model
