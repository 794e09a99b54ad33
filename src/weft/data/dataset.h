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

// One modality item of a batch: items[item] of sample `sample`.
struct MediaRef {
  int64_t sample = 0;
  int64_t item = 0;
  bool operator==(const MediaRef& o) const { return sample == o.sample && item == o.item; }
};

// A step's batch is made in two phases, so that no rank decodes media it does not run:
//   1. train_layout: the samples without media (tokens, targets, item spans). Cheap, and the
//      same on every rank, so balancing and the plan's split agree everywhere.
//   2. load_media: each rank decodes only the items its encoder stages read.
// A record whose media turns out bad (under data.on_error = "skip") is reported by the rank that
// decoded it; every rank then marks it bad alike (mark_bad) and takes the layout again, which
// replaces it. train_batch does both phases for one process.
class Dataset {
 public:
  virtual ~Dataset() = default;
  // The global batch of `step` (batch samples) without media: every ModalityItem::input is
  // undefined. A pure function of the config, the step and the records marked bad so far.
  virtual std::vector<Sample> train_layout(int64_t step, int64_t batch) = 0;
  // Loads the inputs of the `wanted` items of `layout` (train_layout(step, ...)) in place.
  // Returns the samples (indices into layout, ascending) whose media could not be loaded under
  // data.on_error = "skip"; under "fail" a bad item is an Error naming the file and record.
  virtual std::vector<int64_t> load_media(int64_t step, std::vector<Sample>& layout,
                                          const std::vector<MediaRef>& wanted) = 0;
  // A hint: this rank will want these items of a later step's layout (decoded ahead, in the
  // background, by datasets that decode on worker threads).
  virtual void prefetch_media(int64_t /*step*/, const std::vector<Sample>& /*layout*/,
                              const std::vector<MediaRef>& /*wanted*/) {}
  // From now on train_layout replaces these samples' records (their media is bad).
  virtual void mark_bad(const std::vector<Sample>& /*samples*/) {}
  // Held-out samples for caption evaluation (prompt = tokens before the first target), media
  // loaded.
  virtual std::vector<Sample> eval_set() = 0;

  // The global batch of `step` with every item loaded (layout, load, and again without the
  // records found bad): what one process trains on.
  std::vector<Sample> train_batch(int64_t step, int64_t batch);

  virtual int64_t vocab_size() const = 0;  // the tokenizer's (the model's vocab may be padded)
  virtual int64_t pad_id() const = 0;
  virtual int64_t eos_id() const = 0;
  // Generated ids as text comparable with Sample::caption (stops at eos, no special tokens).
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  // Distinct records found bad so far under data.on_error = "skip" (corrupt or missing items).
  virtual int64_t skipped() const { return 0; }
  // Items whose media this process has decoded (or rendered) so far.
  int64_t media_loaded() const { return media_loaded_; }

 protected:
  int64_t media_loaded_ = 0;  // load_media implementations count what they load
};

// Every item of every sample of `layout`.
std::vector<MediaRef> all_media(const std::vector<Sample>& layout);

// The dataset of `spec.data.kind`. Sets spec->model.llm.vocab when it is 0 (the tokenizer's
// size, padded to a multiple of 64) and checks it is large enough otherwise ("synthetic": it
// must be set; data.seq_len = 0 is set to the length used).
std::unique_ptr<Dataset> make_dataset(Spec* spec);

}  // namespace weft::data
