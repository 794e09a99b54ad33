#include "weft/data/llava.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "weft/core/error.h"
#include "weft/core/hash.h"
#include "weft/data/audio.h"
#include "weft/data/image_decode.h"
#include "weft/data/llava_records.h"
#include "weft/data/loader.h"

namespace weft::data {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string trim(std::string s) {
  const auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  while (!s.empty() && space(s.back())) s.pop_back();
  size_t i = 0;
  while (i < s.size() && space(s[i])) ++i;
  return s.substr(i);
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + what.size()))
    ++n;
  return n;
}

}  // namespace

std::string LlavaDataset::resolve_media(const std::string& root, const std::string& relative) {
  WEFT_CHECK(!relative.empty(), "empty media path");
  const fs::path rel(relative);
  WEFT_CHECK(rel.is_relative(), "media path \"", relative,
             "\" is absolute; paths must be relative to data.root");
  const fs::path base = fs::path(root).lexically_normal();
  const fs::path full = (base / rel).lexically_normal();
  const auto inside = [](const fs::path& p, const fs::path& dir) {
    const fs::path r = p.lexically_relative(dir);
    return !r.empty() && *r.begin() != "..";
  };
  WEFT_CHECK(inside(full, base), "media path \"", relative, "\" leaves data.root (", root, ")");
  std::error_code ec;  // symlinks must not lead outside either
  const fs::path real = fs::weakly_canonical(full, ec), real_root = fs::weakly_canonical(base, ec);
  WEFT_CHECK(ec || inside(real, real_root), "media path \"", relative,
             "\" resolves outside data.root (", root, ") through a symbolic link");
  return full.string();
}

LlavaDataset::LlavaDataset(Spec* spec) : spec_(*spec), file_(spec->data.path) {
  const DataSpec& d = spec->data;
  root_ = d.root.empty() ? fs::path(file_).parent_path().string() : d.root;
  const std::string tok_path = !d.tokenizer.empty() ? d.tokenizer : spec->model.llm.hf;
  WEFT_CHECK(!tok_path.empty(), spec->source,
             ": data.tokenizer: missing (a tokenizer.json / tokenizer.model, or set "
             "model.llm.hf to a checkpoint directory that has one)");
  tok_ = load_tokenizer(tok_path);
  WEFT_CHECK(tok_->eos_id.has_value(), tok_path,
             ": the tokenizer names no EOS token (evaluation stops at it)");
  eos_id_ = *tok_->eos_id;
  pad_id_ = tok_->pad_id.value_or(eos_id_);

  LlmSpec& llm = spec->model.llm;
  if (llm.vocab == 0) llm.vocab = (tok_->vocab_size() + 63) / 64 * 64;
  WEFT_CHECK(llm.vocab >= tok_->vocab_size(), spec->source, ": model.llm.vocab = ", llm.vocab,
             " is smaller than the tokenizer's ", tok_->vocab_size(), " tokens (", tok_path, ")");
  spec_.model.llm.vocab = llm.vocab;

  for (size_t e = 0; e < spec->model.encoders.size(); ++e) {
    const EncoderSpec& enc = spec->model.encoders[e];
    const std::string marker = enc.kind == EncoderKind::kVit ? "<image>" : "<audio>";
    for (const ChatMarker& m : markers_)
      WEFT_CHECK(m.text != marker, spec->source, ": model.", enc.name, ": a second ",
                 to_string(enc.kind), " encoder; LLaVA-style data has one ", marker,
                 " marker per kind of item");
    const std::optional<int64_t> id = tok_->token_id(marker);
    WEFT_CHECK(id.has_value(), tok_path, ": the tokenizer has no ", marker,
               " token (the placeholder of model.", enc.name, "); add it as an added token");
    markers_.push_back({marker, *id, enc.tokens_per_item()});
    marker_encoder_.push_back(static_cast<int>(e));
    if (enc.kind == EncoderKind::kVit) {
      const bool siglip =
          d.image_processor.empty() ? !enc.class_token : d.image_processor == "siglip";
      image_processor_ = siglip ? ImageProcessor::siglip(enc.image_size) : ImageProcessor{};
      image_processor_.size = image_processor_.crop = enc.image_size;
      image_processor_.pad_to_square = d.pad_to_square;
    }
  }
  std::ifstream in(file_, std::ios::binary);
  WEFT_CHECK(in, file_, ": cannot read the dataset (data.path)");
  std::ostringstream text;
  text << in.rdbuf();
  records_ = parse_llava_records(text.str(), file_);
  eval_count_ = d.eval_samples;
  WEFT_CHECK(eval_count_ < static_cast<int64_t>(records_.size()), spec->source,
             ": data.eval_samples = ", eval_count_, " leaves no training records (", file_, " has ",
             records_.size(), ")");
  skip_bad_ = d.on_error == "skip";
  prefetcher_ =
      std::make_unique<Prefetcher>(static_cast<int>(d.workers), [this](const Prefetcher::Key& k) {
        return media(std::get<0>(k), static_cast<int>(std::get<1>(k)), std::get<2>(k));
      });
}

LlavaDataset::~LlavaDataset() = default;

int64_t LlavaDataset::train_index(int64_t position) const {
  const int64_t n = train_records();
  const int64_t epoch = position / n, k = position % n;
  // Element k of a seeded Fisher-Yates shuffle of [0, n), one per epoch (the workers of a step
  // share it; at most two epochs are kept).
  std::lock_guard<std::mutex> lock(perm_mu_);
  auto it = perms_.find(epoch);
  if (it == perms_.end()) {
    std::vector<int64_t> perm(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) perm[i] = i;
    const uint64_t key = derive(spec_.data.seed, static_cast<uint64_t>(epoch));
    for (int64_t i = n - 1; i > 0; --i) {
      const uint64_t j = draw(key, static_cast<uint64_t>(i)) % static_cast<uint64_t>(i + 1);
      std::swap(perm[i], perm[static_cast<int64_t>(j)]);
    }
    if (perms_.size() >= 2) perms_.erase(perms_.begin());
    it = perms_.emplace(epoch, std::move(perm)).first;
  }
  return it->second[k];
}

Sample LlavaDataset::layout(int64_t index) const {
  const LlavaRecord& r = records_[index];
  try {
    std::vector<ChatTurn> turns = r.turns;
    for (size_t m = 0; m < markers_.size(); ++m) {
      const bool image = markers_[m].text == "<image>";
      const size_t items = image ? r.images.size() : r.audios.size();
      size_t written = 0;
      for (const ChatTurn& t : turns) written += count_of(t.text, markers_[m].text);
      if (items > 0 && written == 0)  // LLaVA: the item goes before the first question
        for (ChatTurn& t : turns)
          if (t.role == "user") {
            t.text = markers_[m].text + "\n" + t.text;
            written = 1;
            break;
          }
      WEFT_CHECK(items == written, "has ", items, image ? " image(s)" : " audio clip(s)", " but ",
                 written, " ", markers_[m].text, " marker(s)");
    }
    const auto has = [&](const char* marker) {
      return std::any_of(markers_.begin(), markers_.end(),
                         [&](const ChatMarker& m) { return m.text == marker; });
    };
    WEFT_CHECK(r.images.empty() || has("<image>"), "has images but the model has no vit encoder");
    WEFT_CHECK(r.audios.empty() || has("<audio>"),
               "has audio but the model has no whisper encoder");
    const EncodedChat c = encode_chat(*tok_, spec_.data.chat_template, turns, markers_);
    const int64_t S = static_cast<int64_t>(c.ids.size());
    WEFT_CHECK(S <= spec_.model.llm.max_seq, "is ", S,
               " tokens long, more than model.llm.max_seq = ", spec_.model.llm.max_seq);
    Sample s;
    s.record = index;
    s.tokens = c.ids;
    s.is_target = c.is_target;
    const auto first = std::find(s.is_target.begin(), s.is_target.end(), 1);
    WEFT_CHECK(first != s.is_target.end(), "has no assistant reply to learn");
    s.prompt_length = first - s.is_target.begin();
    for (const ChatTurn& t : turns)
      if (t.role == "assistant") {
        s.caption = trim(t.text);
        break;
      }
    size_t next_image = 0, next_audio = 0;
    for (const MarkerSpan& span : c.spans) {
      const int e = marker_encoder_[span.marker];
      const bool image = spec_.model.encoders[e].kind == EncoderKind::kVit;
      resolve_media(root_, image ? r.images[next_image++] : r.audios[next_audio++]);  // checked
      s.items.push_back(ModalityItem{e, span.start, span.length, {}});
    }
    return s;
  } catch (const std::exception& e) {
    WEFT_FAIL(file_, ": record ", index, ": ", e.what());
  }
}

at::Tensor LlavaDataset::media(int64_t index, int encoder, int64_t nth) const {
  const LlavaRecord& r = records_[index];
  const EncoderSpec& enc = spec_.model.encoders[encoder];
  const bool image = enc.kind == EncoderKind::kVit;
  try {
    const std::vector<std::string>& paths = image ? r.images : r.audios;
    WEFT_ASSERT(nth >= 0 && nth < static_cast<int64_t>(paths.size()));
    const std::string path = resolve_media(root_, paths[nth]);
    return image ? preprocess_image(load_image(path), image_processor_)
                 : whisper_log_mel(load_audio_mono(path), enc.mels, enc.frames);
  } catch (const std::exception& e) {
    WEFT_FAIL(file_, ": record ", index, ": ", e.what());
  }
}

namespace {
// Item j of a layout as a media key: items follow the markers in text order, so the nth item of
// an encoder is the nth path of its kind.
Prefetcher::Key key_of(const Sample& s, int64_t j) {
  const int encoder = s.items[j].encoder;
  int64_t nth = 0;
  for (int64_t k = 0; k < j; ++k) nth += s.items[k].encoder == encoder ? 1 : 0;
  return {s.record, encoder, nth};
}
}  // namespace

Sample LlavaDataset::sample(int64_t index) const {
  Sample s = layout(index);
  for (size_t j = 0; j < s.items.size(); ++j) {
    const auto [record, encoder, nth] = key_of(s, static_cast<int64_t>(j));
    s.items[j].input = media(record, static_cast<int>(encoder), nth);
  }
  return s;
}

Sample LlavaDataset::good_layout(int64_t position) {
  constexpr int kTries = 64;
  for (int k = 0; k < kTries; ++k) {
    // Replacements step through the epoch's order with a stride coprime to most sizes.
    const int64_t index = train_index(position + static_cast<int64_t>(k) * 7919);
    {
      std::lock_guard<std::mutex> lock(bad_mu_);
      if (bad_.count(index)) continue;
    }
    try {
      return layout(index);
    } catch (const Error&) {
      if (!skip_bad_) throw;
      std::lock_guard<std::mutex> lock(bad_mu_);
      bad_.insert(index);
    }
  }
  WEFT_FAIL(file_, ": ", kTries, " bad records in a row around training position ", position,
            " (data.on_error = \"skip\"); is data.root right?");
}

std::vector<Sample> LlavaDataset::train_layout(int64_t step, int64_t batch) {
  WEFT_CHECK(step >= 0 && batch >= 1, file_, ": step ", step, ", batch ", batch,
             ": expected step >= 0 and batch >= 1");
  std::vector<Sample> out;
  out.reserve(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) out.push_back(good_layout(step * batch + i));
  return out;
}

namespace {
std::vector<Prefetcher::Key> keys_of(const std::vector<Sample>& layout,
                                     const std::vector<MediaRef>& wanted) {
  std::vector<Prefetcher::Key> keys;
  for (const MediaRef& r : wanted) keys.push_back(key_of(layout[r.sample], r.item));
  return keys;
}
}  // namespace

void LlavaDataset::prefetch_media(int64_t step, const std::vector<Sample>& layout,
                                  const std::vector<MediaRef>& wanted) {
  prefetcher_->schedule(keys_of(layout, wanted), step);
}

std::vector<int64_t> LlavaDataset::load_media(int64_t step, std::vector<Sample>& layout,
                                              const std::vector<MediaRef>& wanted) {
  const std::vector<Prefetcher::Key> keys = keys_of(layout, wanted);
  prefetcher_->schedule(keys, step);  // what was not prefetched starts now, on every worker
  std::vector<int64_t> bad;
  for (size_t k = 0; k < wanted.size(); ++k) {
    const MediaRef& r = wanted[k];
    try {
      layout[r.sample].items[r.item].input = prefetcher_->take(keys[k]);
      ++media_loaded_;
    } catch (const Error&) {
      if (!skip_bad_) throw;
      bad.push_back(r.sample);
    }
  }
  std::sort(bad.begin(), bad.end());
  bad.erase(std::unique(bad.begin(), bad.end()), bad.end());
  prefetcher_->forget_before(step + 1);  // this step's items are taken; stale ones dropped
  return bad;
}

void LlavaDataset::mark_bad(const std::vector<Sample>& samples) {
  std::lock_guard<std::mutex> lock(bad_mu_);
  for (const Sample& s : samples) bad_.insert(s.record);
}

int64_t LlavaDataset::skipped() const {
  std::lock_guard<std::mutex> lock(bad_mu_);
  return static_cast<int64_t>(bad_.size());
}

std::vector<Sample> LlavaDataset::eval_set() {
  std::vector<Sample> out;
  const int64_t n = static_cast<int64_t>(records_.size());
  for (int64_t i = n - eval_count_; i < n; ++i) {
    try {
      out.push_back(sample(i));
    } catch (const Error&) {
      if (!skip_bad_) throw;
      std::lock_guard<std::mutex> lock(bad_mu_);
      bad_.insert(i);
    }
  }
  return out;
}

std::string LlavaDataset::decode(const std::vector<int64_t>& ids) const {
  std::vector<int64_t> kept;
  for (int64_t id : ids) {
    if (id == eos_id_) break;
    if (id >= 0 && id < tok_->vocab_size()) kept.push_back(id);
  }
  return trim(tok_->decode(kept, /*skip_special=*/true));
}

}  // namespace weft::data
