// Dataset: what the trainer trains on — a deterministic sequence of global batches (a pure
// function of the config and the step, so a resumed run sees the same data), a held-out eval
// set, and the tokenizer facts training and evaluation need. make_dataset picks the
// implementation from data.kind: "shapes" (the built-in procedural set, data/shapes.h),
// "llava" (LLaVA-style JSON/JSONL with images and audio on disk, data/llava.h) or "synthetic"
// (random samples of a chosen length and item count, for benchmarks, data/synthetic.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/data/sample.h"

namespace weft::data {

class Dataset {
 public:
  virtual ~Dataset() = default;
  // The global batch of `step` (batch samples). Called with increasing steps from one thread;
  // an implementation may prefetch the following steps in the background.
  virtual std::vector<Sample> train_batch(int64_t step, int64_t batch) = 0;
  // Held-out samples for caption evaluation (prompt = tokens before the first target).
  virtual std::vector<Sample> eval_set() = 0;

  virtual int64_t vocab_size() const = 0;  // the tokenizer's (the model's vocab may be padded)
  virtual int64_t pad_id() const = 0;
  virtual int64_t eos_id() const = 0;
  // Generated ids as text comparable with Sample::caption (stops at eos, no special tokens).
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  // Records skipped so far under data.on_error = "skip" (corrupt or missing items).
  virtual int64_t skipped() const { return 0; }
};

// The dataset of `spec.data.kind`. Sets spec->model.llm.vocab when it is 0 (the tokenizer's
// size, padded to a multiple of 64) and checks it is large enough otherwise ("synthetic": it
// must be set; data.seq_len = 0 is set to the length used).
std::unique_ptr<Dataset> make_dataset(Spec* spec);

}  // namespace weft::data
