// Collation: a list of samples → one microbatch of tensors, padded (one sample per row) or
// packed (several samples per row as isolated documents, positions restarting per document).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "weft/data/sample.h"

namespace weft::data {

struct Microbatch {
  at::Tensor tokens;     // int64 [B, S]
  at::Tensor positions;  // int64 [B, S]
  at::Tensor doc;        // int32 [B, S]; -1 = padding
  at::Tensor item;       // int32 [B, S]; -1 = text
  // Per encoder: the inputs of items [encoder_first[e], encoder_first[e] + n) of its N_e items
  // (undefined when n = 0): the loaded ones, which must be consecutive (all, on one process).
  std::vector<at::Tensor> encoder_inputs;
  std::vector<int64_t> encoder_first;
  std::vector<at::Tensor> encoder_rows;  // per encoder int64 [N_e * T_e]
  at::Tensor target_rows;                // int64 [N]
  at::Tensor targets;                    // int64 [N]
  int64_t samples = 0;
  int64_t real_tokens = 0;    // non-padding tokens
  double sum_sq_doc_len = 0;  // Σ over documents of length²
};

struct CollateOptions {
  int num_encoders = 0;
  int64_t pad_id = 0;
  bool packing = false;
  int64_t max_seq = 0;  // row capacity when packing; a longer sample is an error
};

Microbatch collate(const std::vector<Sample>& samples, const CollateOptions& opts);

// The rows collate() puts samples of these lengths in (indices, in order): one per row padded,
// first fit in order packed. A microbatch's items are numbered row by row, then in sample order.
std::vector<std::vector<size_t>> pack_rows(const std::vector<int64_t>& lengths,
                                           const CollateOptions& opts);

// Splits a global batch into `parts` microbatches of consecutive samples (sizes differ by at
// most one).
std::vector<std::vector<Sample>> split(const std::vector<Sample>& samples, int64_t parts);

// The [begin, end) of part `part` when n items are split as split() does.
std::pair<int64_t, int64_t> part_range(int64_t n, int64_t parts, int64_t part);

}  // namespace weft::data
