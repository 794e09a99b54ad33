#include "weft/data/collate.h"

#include <torch/torch.h>

#include "weft/core/error.h"

namespace weft::data {

std::vector<std::vector<size_t>> pack_rows(const std::vector<int64_t>& lengths,
                                           const CollateOptions& opts) {
  std::vector<std::vector<size_t>> rows;
  std::vector<int64_t> row_len;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t len = lengths[i];
    WEFT_CHECK(opts.max_seq <= 0 || len <= opts.max_seq, "sample ", i, " has ", len,
               " tokens, more than model.llm.max_seq = ", opts.max_seq);
    size_t r = rows.size();
    if (opts.packing)
      for (size_t j = 0; j < rows.size(); ++j)
        if (row_len[j] + len <= opts.max_seq) {
          r = j;
          break;
        }
    if (r == rows.size()) {
      rows.emplace_back();
      row_len.push_back(0);
    }
    rows[r].push_back(i);
    row_len[r] += len;
  }
  return rows;
}

Microbatch collate(const std::vector<Sample>& samples, const CollateOptions& opts) {
  WEFT_CHECK(!samples.empty(), "collate: empty microbatch");
  std::vector<int64_t> lengths;
  for (const Sample& s : samples) lengths.push_back(static_cast<int64_t>(s.tokens.size()));
  const std::vector<std::vector<size_t>> rows = pack_rows(lengths, opts);
  std::vector<int64_t> row_len;
  for (const auto& row : rows) {
    row_len.push_back(0);
    for (size_t i : row) row_len.back() += lengths[i];
  }
  const int64_t B = static_cast<int64_t>(rows.size());
  const int64_t S = *std::max_element(row_len.begin(), row_len.end());

  Microbatch mb;
  mb.samples = static_cast<int64_t>(samples.size());
  mb.tokens = torch::full({B, S}, opts.pad_id, torch::kLong);
  mb.positions = torch::zeros({B, S}, torch::kLong);
  mb.doc = torch::full({B, S}, -1, torch::kInt);
  mb.item = torch::full({B, S}, -1, torch::kInt);
  auto tok = mb.tokens.accessor<int64_t, 2>();
  auto pos = mb.positions.accessor<int64_t, 2>();
  auto doc = mb.doc.accessor<int32_t, 2>();
  auto item = mb.item.accessor<int32_t, 2>();

  std::vector<int64_t> target_rows, targets;
  std::vector<std::vector<at::Tensor>> enc_inputs(opts.num_encoders);
  std::vector<int64_t> enc_items(opts.num_encoders, 0), enc_first(opts.num_encoders, -1);
  std::vector<std::vector<int64_t>> enc_rows(opts.num_encoders);
  for (int64_t r = 0; r < B; ++r) {
    int64_t offset = 0;
    int32_t next_item = 0;
    for (size_t d = 0; d < rows[r].size(); ++d) {
      const Sample& s = samples[rows[r][d]];
      const int64_t len = static_cast<int64_t>(s.tokens.size());
      WEFT_CHECK(s.is_target.size() == s.tokens.size(), "sample ", rows[r][d], ": is_target has ",
                 s.is_target.size(), " entries for ", len, " tokens");
      for (int64_t t = 0; t < len; ++t) {
        tok[r][offset + t] = s.tokens[t];
        pos[r][offset + t] = t;
        doc[r][offset + t] = static_cast<int32_t>(d);
        if (t + 1 < len && s.is_target[t + 1]) {
          target_rows.push_back(r * S + offset + t);
          targets.push_back(s.tokens[t + 1]);
        }
      }
      for (const ModalityItem& it : s.items) {
        WEFT_CHECK(it.encoder >= 0 && it.encoder < opts.num_encoders, "sample ", rows[r][d],
                   ": item for encoder ", it.encoder, " but the model has ", opts.num_encoders);
        WEFT_CHECK(it.start >= 0 && it.start + it.length <= len, "sample ", rows[r][d],
                   ": placeholder span [", it.start, ", ", it.start + it.length,
                   ") outside the sequence of ", len, " tokens");
        for (int64_t t = 0; t < it.length; ++t) {
          item[r][offset + it.start + t] = next_item;
          enc_rows[it.encoder].push_back(r * S + offset + it.start + t);
        }
        if (it.input.defined()) {  // loaded here: the loaded items of an encoder are consecutive
          std::vector<at::Tensor>& loaded = enc_inputs[it.encoder];
          int64_t& first = enc_first[it.encoder];
          if (first < 0) first = enc_items[it.encoder];
          WEFT_CHECK(first + static_cast<int64_t>(loaded.size()) == enc_items[it.encoder],
                     "sample ", rows[r][d], ": the loaded items of encoder ", it.encoder,
                     " are not consecutive");
          loaded.push_back(it.input);
        }
        ++enc_items[it.encoder];
        ++next_item;
      }
      mb.real_tokens += len;
      mb.sum_sq_doc_len += static_cast<double>(len) * static_cast<double>(len);
      offset += len;
    }
  }
  for (int e = 0; e < opts.num_encoders; ++e) {
    mb.encoder_inputs.push_back(enc_inputs[e].empty() ? at::Tensor() : torch::stack(enc_inputs[e]));
    mb.encoder_first.push_back(std::max<int64_t>(enc_first[e], 0));
    mb.encoder_rows.push_back(torch::tensor(enc_rows[e], torch::kLong));
  }
  mb.target_rows = torch::tensor(target_rows, torch::kLong);
  mb.targets = torch::tensor(targets, torch::kLong);
  return mb;
}

std::pair<int64_t, int64_t> part_range(int64_t n, int64_t parts, int64_t part) {
  WEFT_CHECK(parts > 0 && part >= 0 && part < parts, "part ", part, " of ", parts,
             ": expected 0 <= part < parts");
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = part * base + std::min(part, extra);
  return {begin, begin + base + (part < extra ? 1 : 0)};
}

std::vector<std::vector<Sample>> split(const std::vector<Sample>& samples, int64_t parts) {
  WEFT_CHECK(parts > 0, "split: parts must be positive");
  std::vector<std::vector<Sample>> out(static_cast<size_t>(parts));
  for (int64_t i = 0; i < parts; ++i) {
    const auto [begin, end] = part_range(static_cast<int64_t>(samples.size()), parts, i);
    out[static_cast<size_t>(i)].assign(samples.begin() + begin, samples.begin() + end);
  }
  return out;
}

}  // namespace weft::data
