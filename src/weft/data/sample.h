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
  // vit: float [C, H, W]; whisper: float [mels, frames]. Undefined until loaded: a step's
  // layout (Dataset::train_layout) carries none, and each rank loads only the items its
  // encoder stages read (Dataset::load_media).
  at::Tensor input;
};

struct Sample {
  std::vector<int64_t> tokens;     // full sequence, <bos> first
  std::vector<uint8_t> is_target;  // per token: 1 if the model must predict it (caption, <eos>)
  std::vector<ModalityItem> items;
  int64_t prompt_length = 0;  // tokens before the first target (what generation is given)
  std::string caption;        // reference text of the targets (without <eos>), for eval
  int64_t record = -1;        // the dataset's id of the record it came from (load_media, mark_bad)
};

}  // namespace weft::data
