#include "weft/model/mask.h"

#include <torch/torch.h>

namespace weft::model {

at::Tensor visible_mask(const at::Tensor& doc, const at::Tensor& item) {
  const int64_t S = doc.size(1);
  at::Tensor pos = torch::arange(S, doc.options().dtype(torch::kLong));
  at::Tensor causal = pos.view({S, 1}) >= pos.view({1, S});  // [S, S]: k <= q
  at::Tensor self = pos.view({S, 1}) == pos.view({1, S});
  at::Tensor dq = doc.unsqueeze(2), dk = doc.unsqueeze(1);
  at::Tensor iq = item.unsqueeze(2), ik = item.unsqueeze(1);
  at::Tensor same_doc = (dq == dk) & (dq >= 0);
  at::Tensor same_item = (iq == ik) & (iq >= 0);
  return ((same_doc & (causal | same_item)) | self).unsqueeze(1);
}

}  // namespace weft::model
