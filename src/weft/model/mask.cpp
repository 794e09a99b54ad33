#include "weft/model/mask.h"

#include <torch/torch.h>

#include <algorithm>
#include <unordered_map>

#include "weft/core/error.h"

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

std::vector<AttentionChunk> attention_chunks(const at::Tensor& doc_in, const at::Tensor& item_in,
                                             int64_t chunk, double most) {
  WEFT_ASSERT(chunk > 0 && doc_in.dim() == 2 && doc_in.sizes() == item_in.sizes());
  const int64_t B = doc_in.size(0), S = doc_in.size(1);
  if (S < 2 * chunk) return {};
  const at::Tensor doc = doc_in.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor item = item_in.to(at::kCPU, at::kLong).contiguous();
  const int64_t* dp = doc.data_ptr<int64_t>();
  const int64_t* ip = item.data_ptr<int64_t>();
  // Per query position (over the rows): the first and one past the last key it sees.
  std::vector<int64_t> first(static_cast<size_t>(S), S), end(static_cast<size_t>(S), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* d = dp + b * S;
    const int64_t* it = ip + b * S;
    // A document's first position, an item's last one (of the same document).
    std::unordered_map<int64_t, int64_t> doc_first, item_last;
    for (int64_t s = 0; s < S; ++s) {
      if (d[s] < 0) continue;
      doc_first.emplace(d[s], s);
      if (it[s] >= 0) item_last[it[s]] = s;
    }
    for (int64_t s = 0; s < S; ++s) {
      int64_t lo = s, hi = s + 1;  // every token sees itself
      if (d[s] >= 0) {
        lo = doc_first.at(d[s]);
        if (it[s] >= 0) hi = std::max(hi, item_last.at(it[s]) + 1);
      }
      first[s] = std::min(first[s], lo);
      end[s] = std::max(end[s], hi);
    }
  }
  std::vector<AttentionChunk> chunks;
  double area = 0;
  for (int64_t q0 = 0; q0 < S; q0 += chunk) {
    AttentionChunk c;
    c.q_begin = q0;
    c.q_end = std::min(S, q0 + chunk);
    c.k_begin = S;
    for (int64_t s = c.q_begin; s < c.q_end; ++s) {
      c.k_begin = std::min(c.k_begin, first[s]);
      c.k_end = std::max(c.k_end, end[s]);
    }
    c.k_begin = c.k_begin / 16 * 16;
    c.k_end = std::min(S, (c.k_end + 15) / 16 * 16);
    area += static_cast<double>(c.q_end - c.q_begin) * static_cast<double>(c.k_end - c.k_begin);
    chunks.push_back(c);
  }
  if (area > most * static_cast<double>(S) * static_cast<double>(S)) return {};
  return chunks;
}

}  // namespace weft::model
