// LlavaDataset: LLaVA-style records from a JSON array or JSONL file, as LLaVA's training data
// ships them:
//   {"id": "...", "image": "coco/0001.jpg" (or a list of paths, or absent),
//    "audio": "clips/1.wav" (weft's extension; or a list),
//    "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
//                      {"from": "gpt", "value": "A red square."}, ...]}
// Each "<image>" marker becomes the vit encoder's placeholder tokens (its tokens_per_item), each
// "<audio>" the whisper encoder's; a record with images but no marker gets "<image>\n" before
// its first user turn (as LLaVA does). The conversation is rendered with data.chat_template
// (data/chat.h) and tokenized; only assistant replies (and their end-of-turn tokens) are loss
// targets. Images are decoded and preprocessed like the CLIP / SigLIP processors
// (data/image.h), audio resampled to 16 kHz and turned into Whisper log-mels (data/audio.h).
//
// Records are read and validated when the dataset is built (text only); media is decoded by
// data.workers threads, data.prefetch global batches ahead of the step, and only the items
// this rank's encoder stages read (Dataset's two phases). Media paths are
// resolved under data.root; an absolute path or one escaping the root (.., symlinks) is
// rejected. A bad record — missing or corrupt media, markers not matching the media, a
// sequence longer than model.llm.max_seq — is an Error naming the file, the record index and
// the problem (data.on_error = "fail"), or is replaced by the next good record in the epoch's
// order and counted (data.on_error = "skip"; a record with bad media is replaced once the rank
// that decoded it has told the others, see Dataset).
//
// Order: the last data.eval_samples records are held out for evaluation; the others are
// visited in a fresh seeded permutation each epoch, so step s's batch is a pure function of
// (data.seed, s) and resumes exactly.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/data/chat.h"
#include "weft/data/dataset.h"
#include "weft/data/image.h"
#include "weft/data/llava_records.h"
#include "weft/data/text_tokenizer.h"

namespace weft::data {

class Prefetcher;

class LlavaDataset final : public Dataset {
 public:
  // spec->model.llm.vocab == 0 is set from the tokenizer (padded to a multiple of 64).
  explicit LlavaDataset(Spec* spec);
  ~LlavaDataset() override;

  std::vector<Sample> train_layout(int64_t step, int64_t batch) override;
  std::vector<int64_t> load_media(int64_t step, std::vector<Sample>& layout,
                                  const std::vector<MediaRef>& wanted) override;
  void prefetch_media(int64_t step, const std::vector<Sample>& layout,
                      const std::vector<MediaRef>& wanted) override;
  void mark_bad(const std::vector<Sample>& samples) override;
  std::vector<Sample> eval_set() override;
  int64_t vocab_size() const override { return tok_->vocab_size(); }
  int64_t pad_id() const override { return pad_id_; }
  int64_t eos_id() const override { return eos_id_; }
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t skipped() const override;

  int64_t train_records() const { return static_cast<int64_t>(records_.size()) - eval_count_; }
  // Record `index` as a sample; Error (naming file and record) when it is bad. Thread-safe.
  Sample sample(int64_t index) const;
  // The same without decoding media (the text checked, media paths resolved), and the input of
  // the record's nth item for `encoder`. Thread-safe.
  Sample layout(int64_t index) const;
  at::Tensor media(int64_t index, int encoder, int64_t nth) const;
  // The record index at position `position` of the training order (epochs of permutations).
  int64_t train_index(int64_t position) const;
  // `root`/`relative`, rejecting absolute paths and paths that leave the root.
  static std::string resolve_media(const std::string& root, const std::string& relative);

 private:
  // The layout at `position`, or ("skip") the next good record's.
  Sample good_layout(int64_t position);

  Spec spec_;
  std::string file_;  // records file (for messages)
  std::string root_;
  std::unique_ptr<TextTokenizer> tok_;
  std::vector<LlavaRecord> records_;
  int64_t eval_count_ = 0;
  int64_t pad_id_ = 0, eos_id_ = 0;
  std::vector<ChatMarker> markers_;  // "<image>", "<audio>" (those the model has)
  std::vector<int> marker_encoder_;  // encoder index per marker
  ImageProcessor image_processor_;
  bool skip_bad_ = false;
  mutable std::mutex bad_mu_;
  std::set<int64_t> bad_;  // records found bad (text here, media by agreement: mark_bad)
  mutable std::mutex perm_mu_;
  mutable std::map<int64_t, std::vector<int64_t>> perms_;  // epoch -> training order
  std::unique_ptr<Prefetcher> prefetcher_;
};

}  // namespace weft::data
