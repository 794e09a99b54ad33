// A training sample: token ids with placeholder spans for modality items, and which tokens are
// loss targets. Collation (data/collate.h) turns a list of samples into a microbatch.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weft::data {

// One modality item (an image, an audio clip) and the placeholder span it fills.
struct ModalityItem {
  int encoder = 0;     // index into ModelSpec::encoders
  int64_t start = 0;   // index in Sample::tokens of the first placeholder token
  int64_t length = 0;  // number of placeholder tokens (= encoder tokens_per_item())
  at::Tensor input;    // vit: float [C, H, W]; whisper: float [mels, frames]
};

struct Sample {
  std::vector<int64_t> tokens;     // full sequence, <bos> first
  std::vector<uint8_t> is_target;  // per token: 1 if the model must predict it (caption, <eos>)
  std::vector<ModalityItem> items;
  int64_t prompt_length = 0;  // tokens before the first target (what generation is given)
  std::string caption;        // reference text of the targets (without <eos>), for eval
};

}  // namespace weft::data
