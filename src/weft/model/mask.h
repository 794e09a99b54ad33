// Dense boolean attention masks from the O(S) token descriptors of core/mask.h.
#pragma once

#include <ATen/core/Tensor.h>

namespace weft::model {

// doc, item: int [B, S] (see weft::TokenDesc). Returns bool [B, 1, S, S], true = may attend,
// following weft::visible exactly.
at::Tensor visible_mask(const at::Tensor& doc, const at::Tensor& item);

}  // namespace weft::model
