// Attention-mask semantics of a multimodal sequence, from O(S) per-token descriptors.
//
// Each token carries `doc` (packed-document id; -1 = padding) and `item` (modality item id,
// unique within the row; -1 = text). A query q may see key k when
//   - both are in the same document (doc >= 0), and
//   - k is not after q (causal), or q and k belong to the same modality item (an image or a
//     clip attends to itself bidirectionally);
// and every token sees itself (so a padding row is never empty and softmax never yields NaN).
// Nothing ever sees padding except the padding token itself. This is the one definition: the
// dense mask in model/ and the attention-work model in plan/ both follow it.
#pragma once

#include <cstdint>

namespace weft {

struct TokenDesc {
  int32_t doc = 0;
  int32_t item = -1;
};

inline bool visible(const TokenDesc& q, int64_t q_pos, const TokenDesc& k, int64_t k_pos) {
  if (q_pos == k_pos) return true;
  if (q.doc < 0 || q.doc != k.doc) return false;
  return k_pos <= q_pos || (q.item >= 0 && q.item == k.item);
}

}  // namespace weft
