// The data's mean sample (plan/partition.h DataShape), measured on a config's own dataset: what
// `weft plan` and `weft simulate` price the FLOP model on instead of full rows of
// model.llm.max_seq tokens with one item per encoder.
//
// It takes the layouts of the first global batches (no media decoded: cheap), balances each into
// train.microbatches as the loader does for one data-parallel replica (data.balance), and lays
// each microbatch out in rows as collate does (one sample per row padded to the microbatch's
// longest, or packed under data.packing). Positions count that padding; a layout with more
// replicas or microbatches pads less (smaller microbatches), which the shape does not follow.
#pragma once

#include <cstdint>

#include "weft/core/spec.h"
#include "weft/plan/partition.h"

namespace weft::train {

struct MeasuredData {
  plan::DataShape shape;
  int64_t vocab = 0;  // the model's vocabulary with the dataset's tokenizer (model.llm.vocab = 0)
};

// Over at least `min_samples` samples (whole global batches; at most 64 of them). A dataset that
// cannot be read is the dataset's Error (naming the file).
MeasuredData measure_data_shape(Spec spec, int64_t min_samples = 1024);

}  // namespace weft::train
