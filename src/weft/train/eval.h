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

// What generation is given of `sample`: its first prompt_length tokens, none of them a target,
// with the items inside them (a later image of an interleaved sample is not part of it).
data::Sample prompt_of(const data::Sample& sample);
// How many tokens generation may add after `sample`'s prompt: its targets' span and 2 more.
int64_t generation_budget(const data::Sample& sample);
// Appends the captions decoded from `generated` (the ids generated for the samples after the
// r.captions.size() already there, in order) to r.captions and the first few to r.examples.
void add_captions(EvalResult& r, const std::vector<std::vector<int64_t>>& generated,
                  const std::vector<data::Sample>& samples, const data::Dataset& dataset);
// The share of `captions` equal to their sample's caption (0 for none).
double caption_accuracy(const std::vector<std::string>& captions,
                        const std::vector<data::Sample>& samples);

EvalResult evaluate_captions(const model::MultimodalModel& model,
                             const std::vector<data::Sample>& samples, const data::Dataset& dataset,
                             const EvalOptions& options = {});

}  // namespace weft::train
