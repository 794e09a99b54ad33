// SyntheticDataset (data.kind = "synthetic"): random samples of a chosen shape, so `weft bench
// step` can measure how step time grows with the sequence length and the number of items per
// sample. Nothing in it can be learned; caption accuracy is meaningless (and stays 0).
//
// Sample layout, exactly data.seq_len tokens:
//   <bos> [item 0][text run 0] [item 1][text run 1] ... [item m-1][text run m-1]
// with m = data.images x (number of encoders) items, ordered image by image and, within one,
// by encoder (spec order): item k is encoder k % E. Item k's placeholder span has the
// encoder's tokens_per_item() tokens; the text tokens left over are split as evenly as possible
// between the runs (run k has floor(T(k+1)/m) - floor(Tk/m) of the T), so items are spread
// evenly through the sequence. With data.images = 0 the sample is <bos> and one text run.
// Text ids are uniform in [first_text_id(), model.llm.vocab); item inputs are uniform in
// [-1, 1] (vit: float [channels, image_size, image_size]; whisper: float [mels, frames]).
//
// Targets: text tokens only, never <bos> or placeholders, and never the sample's first text
// token (it is the prompt eval generates from). Of each run's remaining n text tokens the first
// ceil(data.target_fraction * n) are targets (target_fraction = 1: every text token after the
// first).
//
// Token ids (fixed): 0 <pad>, 1 <bos>, 2 <eos> (never in a sample; generation stops at it),
// 3 + e the placeholder of encoder e, then ordinary text ids up to model.llm.vocab, which must
// be set in the config (the dataset has no tokenizer to take it from).
//
// sample(stream, step, index) is a pure function of (data.seed, stream, step, index) through
// the counter-based hash of core/hash.h. Stream 0 is training (train_layout(step, batch) is
// indices 0..batch-1 of `step`), stream 1 eval (data.eval_samples samples of step 0).
// Its const methods are thread-safe (they touch no mutable state).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/data/dataset.h"

namespace weft::data {

class SyntheticDataset final : public Dataset {
 public:
  static constexpr uint64_t kTrainStream = 0;
  static constexpr uint64_t kEvalStream = 1;
  static constexpr int64_t kPadId = 0;
  static constexpr int64_t kBosId = 1;
  static constexpr int64_t kEosId = 2;
  static constexpr int64_t kFirstPlaceholderId = 3;
  static constexpr int64_t kDefaultSeqLen = 256;  // data.seq_len = 0: min(this, max_seq)

  // Checks data.kind, model.llm.vocab (> 0, with room for text ids), data.seq_len (room for
  // <bos>, every placeholder span and 2 text tokens; at most model.llm.max_seq), data.images and
  // data.target_fraction; errors name the config file, the keys and the numbers.
  explicit SyntheticDataset(const Spec& spec);

  // data.seq_len with 0 resolved against model.llm.max_seq.
  static int64_t resolved_seq_len(const Spec& spec);

  Sample sample(uint64_t stream, uint64_t step, uint64_t index) const;
  // sample() without its items' inputs (record = index), and input k of it.
  Sample layout(uint64_t stream, uint64_t step, uint64_t index) const;
  at::Tensor item_input(uint64_t stream, uint64_t step, uint64_t index, int64_t k) const;

  std::vector<Sample> train_layout(int64_t step, int64_t batch) override;
  std::vector<int64_t> load_media(int64_t step, std::vector<Sample>& layout,
                                  const std::vector<MediaRef>& wanted) override;
  std::vector<Sample> eval_set() override;
  int64_t vocab_size() const override { return vocab_; }
  int64_t pad_id() const override { return kPadId; }
  int64_t eos_id() const override { return kEosId; }
  // Ordinary ids as decimal numbers separated by single spaces; special and placeholder ids are
  // skipped; stops at <eos>.
  std::string decode(const std::vector<int64_t>& ids) const override;

  int64_t seq_len() const { return seq_len_; }
  int64_t first_text_id() const { return kFirstPlaceholderId + num_encoders(); }
  int64_t placeholder_id(int encoder) const { return kFirstPlaceholderId + encoder; }
  int64_t num_encoders() const { return static_cast<int64_t>(encoders_.size()); }
  int64_t items_per_sample() const { return images_ * num_encoders(); }
  int64_t placeholder_tokens() const;  // per sample, all items
  int64_t text_tokens() const { return seq_len_ - 1 - placeholder_tokens(); }

 private:
  uint64_t key(uint64_t stream, uint64_t step, uint64_t index) const;

  struct EncoderInfo {
    int64_t tokens = 0;          // tokens_per_item()
    std::vector<int64_t> shape;  // of one item's input
  };

  uint64_t seed_ = 0;
  int64_t eval_samples_ = 0;
  int64_t vocab_ = 0;
  int64_t seq_len_ = 0;
  int64_t images_ = 0;
  double target_fraction_ = 1.0;
  std::vector<EncoderInfo> encoders_;  // spec order
};

}  // namespace weft::data
