// The boundary between data/ and model/ (and plan/): a collated microbatch becomes model
// inputs; a sample becomes the shape balancing weighs.
#pragma once

#include <algorithm>

#include "weft/data/collate.h"
#include "weft/model/multimodal.h"
#include "weft/plan/balance.h"

namespace weft::train {

// A sample's LLM tokens, items per encoder (of `encoders`) and loss targets.
inline plan::SampleShape shape_of(const data::Sample& sample, size_t encoders) {
  plan::SampleShape shape;
  shape.tokens = static_cast<int64_t>(sample.tokens.size());
  shape.items.assign(encoders, 0);
  for (const data::ModalityItem& item : sample.items) ++shape.items[item.encoder];
  shape.targets = std::count(sample.is_target.begin(), sample.is_target.end(), 1);
  return shape;
}

inline model::Inputs to_inputs(const data::Microbatch& mb) {
  return {mb.tokens,        mb.positions,    mb.doc,         mb.item,   mb.encoder_inputs,
          mb.encoder_first, mb.encoder_rows, mb.target_rows, mb.targets};
}

}  // namespace weft::train
