// The boundary between data/ and model/: a collated microbatch becomes model inputs.
#pragma once

#include "weft/data/collate.h"
#include "weft/model/multimodal.h"

namespace weft::train {

inline model::Inputs to_inputs(const data::Microbatch& mb) {
  return {mb.tokens,        mb.positions,    mb.doc,         mb.item,   mb.encoder_inputs,
          mb.encoder_first, mb.encoder_rows, mb.target_rows, mb.targets};
}

}  // namespace weft::train
