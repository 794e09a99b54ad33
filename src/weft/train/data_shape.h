// The data's mean sample (plan/partition.h DataShape), measured on a config's own dataset: what
// `weft plan` and `weft simulate` price the FLOP model on instead of full rows of
// model.llm.max_seq tokens with one item per encoder.
//
// It takes the layouts of the first global batches (no media decoded: cheap), balances each into
// train.microbatches as the loader does for one data-parallel replica (data.balance), and lays
// each microbatch out in rows as collate does (one sample per row padded to the microbatch's
// longest, or packed under data.packing). Positions count that padding; a layout with more
// replicas or microbatches pads less (smaller microbatches), and a separate placement balances
// with other weights, which the mean does not follow. The peak (activation memory) holds for any
// split: the longest sample's positions (packed: max_seq), the most targets and items of any.
// Encoder ranks split each microbatch's mean items as the runtime splits its items
// (plan/encoder_share.h).
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

// The Plan `weft train` runs on `world_size` ranks and `weft plan` prints: make_plan, whose
// pipeline cuts where the config leaves them to the partitioner (a pipelined module without
// parallel.<module>.stages) are made on the data's mean sample — measured only then — or on
// `profile` when given, or with `full_rows` on max_seq rows with one item per encoder.
plan::Plan default_plan(const Spec& spec, int64_t world_size,
                        const plan::Profile* profile = nullptr, bool full_rows = false);

}  // namespace weft::train
