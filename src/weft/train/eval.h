// Caption evaluation: greedy generation from each sample's prompt (BOS + modality
// placeholders), exact match of the decoded text against the sample's caption; and the
// teacher-forced loss of the whole samples' targets (the validation loss).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "weft/data/dataset.h"
#include "weft/data/sample.h"
#include "weft/model/multimodal.h"

namespace weft::train {

struct EvalResult {
  double caption_accuracy = 0;
  int64_t samples = 0;
  double loss = 0;      // mean cross-entropy per target token (NaN when there are none)
  int64_t targets = 0;  // target tokens the loss is over
  std::vector<std::pair<std::string, std::string>> examples;  // (generated, reference), a few
};

// Either part may be left out: without `loss` the result's loss is NaN over 0 targets, without
// `captions` its caption accuracy is -1 with no examples.
EvalResult evaluate_captions(const model::MultimodalModel& model,
                             const std::vector<data::Sample>& samples, const data::Dataset& dataset,
                             int64_t batch, at::ScalarType compute_dtype, bool loss = true,
                             bool captions = true);

}  // namespace weft::train
