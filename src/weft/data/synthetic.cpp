#include "weft/data/synthetic.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "weft/core/error.h"
#include "weft/core/hash.h"

namespace weft::data {

namespace {

constexpr uint64_t kSalt = 0x5717E71CULL;

// Uniform in [0, n) from one 64-bit draw (multiply-shift on the top 32 bits).
int64_t below(uint64_t bits, int64_t n) {
  return static_cast<int64_t>(((bits >> 32) * static_cast<uint64_t>(n)) >> 32);
}

// Uniform floats in [-1, 1): draw i of `key` for element i.
at::Tensor random_input(const std::vector<int64_t>& shape, uint64_t key) {
  auto t = torch::empty(shape, torch::kFloat);
  float* p = t.data_ptr<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t bits = draw(key, static_cast<uint64_t>(i)) >> 40;  // 24 bits
    p[i] = static_cast<float>(bits) * (2.0f / static_cast<float>(1 << 24)) - 1.0f;
  }
  return t;
}

std::string where(const Spec& spec) { return spec.source.empty() ? "config" : spec.source; }

}  // namespace

int64_t SyntheticDataset::resolved_seq_len(const Spec& spec) {
  return spec.data.seq_len != 0 ? spec.data.seq_len
                                : std::min(kDefaultSeqLen, spec.model.llm.max_seq);
}

SyntheticDataset::SyntheticDataset(const Spec& spec)
    : seed_(spec.data.seed),
      eval_samples_(spec.data.eval_samples),
      vocab_(spec.model.llm.vocab),
      seq_len_(resolved_seq_len(spec)),
      images_(spec.data.images),
      target_fraction_(spec.data.target_fraction) {
  const std::string src = where(spec);
  WEFT_CHECK(spec.data.kind == "synthetic", "synthetic dataset: data.kind is '", spec.data.kind,
             "'");
  WEFT_CHECK(eval_samples_ >= 0, src, ": data.eval_samples = ", eval_samples_, ": must be >= 0");
  WEFT_CHECK(images_ >= 0, src, ": data.images = ", images_, ": must be >= 0");
  WEFT_CHECK(target_fraction_ > 0 && target_fraction_ <= 1, src,
             ": data.target_fraction = ", target_fraction_, ": must be in (0, 1]");
  for (const EncoderSpec& e : spec.model.encoders) {
    EncoderInfo info;
    info.tokens = e.tokens_per_item();
    info.shape = e.kind == EncoderKind::kVit
                     ? std::vector<int64_t>{e.channels, e.image_size, e.image_size}
                     : std::vector<int64_t>{e.mels, e.frames};
    encoders_.push_back(std::move(info));
  }
  WEFT_CHECK(vocab_ > 0, src, ": model.llm.vocab = ", vocab_,
             ": must be set (> 0) for data.kind = \"synthetic\" (it has no tokenizer to take "
             "the size from)");
  WEFT_CHECK(vocab_ > first_text_id(), src, ": model.llm.vocab = ", vocab_,
             " leaves no text ids for data.kind = \"synthetic\": ids 0..", first_text_id() - 1,
             " are <pad>, <bos>, <eos> and one placeholder per encoder; it must be > ",
             first_text_id());
  WEFT_CHECK(seq_len_ > 0, src, ": data.seq_len = ", spec.data.seq_len,
             ": must be >= 0 (0 = min(256, model.llm.max_seq))");
  const int64_t need = 1 + placeholder_tokens() + 2;
  if (seq_len_ < need) {
    std::string spans;
    for (size_t e = 0; e < encoders_.size(); ++e)
      spans += (e ? " + " : "") + spec.model.encoders[e].name + " " +
               std::to_string(encoders_[e].tokens);
    WEFT_FAIL(src, ": data.seq_len = ", seq_len_, " cannot hold <bos>, data.images = ", images_,
              " x (", spans.empty() ? std::string("no encoders") : spans,
              ") placeholder tokens = ", placeholder_tokens(),
              " and at least 2 text tokens: it must be >= ", need);
  }
  WEFT_CHECK(seq_len_ <= spec.model.llm.max_seq, src, ": data.seq_len = ", seq_len_,
             " is larger than model.llm.max_seq = ", spec.model.llm.max_seq,
             ": raise model.llm.max_seq or lower data.seq_len");
}

int64_t SyntheticDataset::placeholder_tokens() const {
  int64_t per_image = 0;
  for (const EncoderInfo& e : encoders_) per_image += e.tokens;
  return images_ * per_image;
}

uint64_t SyntheticDataset::key(uint64_t stream, uint64_t step, uint64_t index) const {
  return derive(derive(derive(derive(kSalt, seed_), stream), step), index);
}

at::Tensor SyntheticDataset::item_input(uint64_t stream, uint64_t step, uint64_t index,
                                        int64_t k) const {
  WEFT_ASSERT(k >= 0 && k < items_per_sample());
  return random_input(encoders_[k % num_encoders()].shape,
                      derive(key(stream, step, index), 1 + static_cast<uint64_t>(k)));
}

Sample SyntheticDataset::sample(uint64_t stream, uint64_t step, uint64_t index) const {
  Sample s = layout(stream, step, index);
  for (size_t k = 0; k < s.items.size(); ++k)
    s.items[k].input = item_input(stream, step, index, static_cast<int64_t>(k));
  return s;
}

Sample SyntheticDataset::layout(uint64_t stream, uint64_t step, uint64_t index) const {
  const uint64_t key = this->key(stream, step, index);
  const uint64_t text_key = derive(key, 0);
  const int64_t m = items_per_sample();
  const int64_t T = text_tokens();
  const int64_t text_range = vocab_ - first_text_id();

  Sample s;
  s.record = static_cast<int64_t>(index);
  s.tokens.reserve(static_cast<size_t>(seq_len_));
  s.is_target.reserve(static_cast<size_t>(seq_len_));
  s.tokens.push_back(kBosId);
  s.is_target.push_back(0);
  uint64_t text_drawn = 0;
  bool first_text = true;
  // One text run of n tokens; the first of the sample is never a target.
  auto add_text = [&](int64_t n) {
    int64_t eligible = n;
    if (first_text && n > 0) --eligible;
    // ceil(fraction * eligible), at least 1; the slack keeps 0.3 * 10 at 3.
    const int64_t targets =
        eligible == 0
            ? 0
            : std::max<int64_t>(1, static_cast<int64_t>(std::ceil(
                                       target_fraction_ * static_cast<double>(eligible) - 1e-9)));
    for (int64_t i = 0; i < n; ++i) {
      s.tokens.push_back(first_text_id() + below(draw(text_key, text_drawn++), text_range));
      const int64_t j = i - (n - eligible);  // index among the run's eligible tokens
      s.is_target.push_back(j >= 0 && j < targets ? 1 : 0);
    }
    if (n > 0) first_text = false;
  };
  if (m == 0) add_text(T);
  for (int64_t k = 0; k < m; ++k) {
    const int e = static_cast<int>(k % num_encoders());
    ModalityItem item;
    item.encoder = e;
    item.start = static_cast<int64_t>(s.tokens.size());
    item.length = encoders_[e].tokens;
    s.tokens.insert(s.tokens.end(), static_cast<size_t>(item.length), placeholder_id(e));
    s.is_target.insert(s.is_target.end(), static_cast<size_t>(item.length), 0);
    s.items.push_back(std::move(item));
    add_text(T * (k + 1) / m - T * k / m);
  }
  WEFT_ASSERT(static_cast<int64_t>(s.tokens.size()) == seq_len_);
  const auto first_target = std::find(s.is_target.begin(), s.is_target.end(), 1);
  WEFT_ASSERT(first_target != s.is_target.end());
  s.prompt_length = first_target - s.is_target.begin();
  s.caption = decode(std::vector<int64_t>(s.tokens.begin() + s.prompt_length, s.tokens.end()));
  return s;
}

std::vector<Sample> SyntheticDataset::train_layout(int64_t step, int64_t batch) {
  WEFT_CHECK(step >= 0, "synthetic dataset: step must be >= 0, got ", step);
  WEFT_CHECK(batch >= 1, "synthetic dataset: batch must be >= 1, got ", batch);
  std::vector<Sample> out;
  out.reserve(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i)
    out.push_back(layout(kTrainStream, static_cast<uint64_t>(step), static_cast<uint64_t>(i)));
  return out;
}

std::vector<int64_t> SyntheticDataset::load_media(int64_t step, std::vector<Sample>& layout,
                                                  const std::vector<MediaRef>& wanted) {
  for (const MediaRef& r : wanted) {
    Sample& s = layout[r.sample];
    s.items[r.item].input = item_input(kTrainStream, static_cast<uint64_t>(step),
                                       static_cast<uint64_t>(s.record), r.item);
    ++media_loaded_;
  }
  return {};
}

std::vector<Sample> SyntheticDataset::eval_set() {
  std::vector<Sample> out;
  out.reserve(static_cast<size_t>(eval_samples_));
  for (int64_t i = 0; i < eval_samples_; ++i)
    out.push_back(sample(kEvalStream, 0, static_cast<uint64_t>(i)));
  return out;
}

std::string SyntheticDataset::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    if (id == kEosId) break;
    if (id < first_text_id()) continue;
    if (!out.empty()) out += ' ';
    out += std::to_string(id);
  }
  return out;
}

}  // namespace weft::data
