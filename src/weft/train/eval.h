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
  std::vector<std::string> captions;  // every sample's generated caption, in order
};

// Greedy continuation of prompts of equal length (no padding), up to `max_new` tokens each or
// their EOS: the ids generated per prompt. With `kv_cache` the prompt goes through the LLM once
// and each step runs the last token alone over the cached keys and values (model::KvCache);
// without, each step runs the whole sequence again (the reference it must equal).
std::vector<std::vector<int64_t>> generate_greedy(const model::MultimodalModel& model,
                                                  const std::vector<data::Sample>& prompts,
                                                  const data::Dataset& dataset, int64_t max_new,
                                                  bool kv_cache = true);

struct EvalOptions {
  int64_t batch = 64;  // prompts generated together (of one prompt length)
  at::ScalarType compute_dtype = at::kFloat;
  bool loss = true;      // false: the result's loss is NaN over 0 targets
  bool captions = true;  // false: caption accuracy -1, no captions
  bool kv_cache = true;  // generate_greedy's
};

EvalResult evaluate_captions(const model::MultimodalModel& model,
                             const std::vector<data::Sample>& samples, const data::Dataset& dataset,
                             const EvalOptions& options = {});

}  // namespace weft::train
