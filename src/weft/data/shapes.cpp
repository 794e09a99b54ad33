#include "weft/data/shapes.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "weft/core/error.h"
#include "weft/core/hash.h"
#include "weft/data/audio.h"
#include "weft/data/collate.h"

namespace weft::data {

namespace {

// --- counter-based randomness ----------------------------------------------------------------

constexpr double kPi = 3.14159265358979323846;

// Draw number i of a key: splitmix64 indexed directly by its counter, so no state is carried.
class Draws {
 public:
  explicit Draws(uint64_t key) : key_(key) {}
  uint64_t u64(uint64_t i) const { return draw(key_, i); }
  double uniform(uint64_t i) const { return static_cast<double>(u64(i) >> 11) * 0x1.0p-53; }
  double uniform(uint64_t i, double lo, double hi) const { return lo + (hi - lo) * uniform(i); }
  // Uniform in [0, n).
  int choice(uint64_t i, int n) const {
    return static_cast<int>(((u64(i) >> 32) * static_cast<uint64_t>(n)) >> 32);
  }

 private:
  uint64_t key_;
};

// --- vocabulary ------------------------------------------------------------------------------

constexpr int kNumColours = 6;
constexpr int kNumShapes = 4;
constexpr int kNumPositions = 9;
constexpr int kNumPitches = 3;
constexpr int kNumLengths = 2;

const std::array<const char*, kNumColours> kColourNames = {"red",    "green",  "blue",
                                                           "yellow", "purple", "cyan"};
const std::array<std::array<float, 3>, kNumColours> kColourRgb = {{{0.90f, 0.15f, 0.15f},
                                                                   {0.15f, 0.80f, 0.20f},
                                                                   {0.20f, 0.30f, 0.95f},
                                                                   {0.95f, 0.90f, 0.15f},
                                                                   {0.60f, 0.20f, 0.85f},
                                                                   {0.15f, 0.85f, 0.90f}}};
const std::array<const char*, kNumShapes> kShapeNames = {"circle", "square", "triangle", "cross"};
// Row-major over the 3x3 grid, row 0 at the top.
const std::array<const char*, kNumPositions> kPositionNames = {
    "top left", "top",         "top right", "left",        "center",
    "right",    "bottom left", "bottom",    "bottom right"};
const std::array<const char*, kNumPitches> kPitchNames = {"low", "mid", "high"};
const std::array<double, kNumPitches> kPitchHz = {300.0, 800.0, 2000.0};
const std::array<const char*, kNumLengths> kLengthNames = {"short", "long"};
// Tone duration as a fraction of the clip (0.3 s / 0.6 s of the default 0.64 s clip), +-0.04.
const std::array<double, kNumLengths> kLengthFraction = {0.46, 0.90};

constexpr float kBackground = 0.2f;
constexpr double kMinSize = 0.18;  // shape extent, fraction of the image side
constexpr double kMaxSize = 0.26;
constexpr int64_t kMaxCaptionWordsImage = 7;  // "a purple triangle in the bottom right"
constexpr int64_t kCaptionWordsAudio = 5;     // "with a high short tone"

// --- audio front end (Whisper's) -------------------------------------------------------------

constexpr int64_t kSampleRate = 16000;
constexpr int64_t kNfft = 400;
constexpr int64_t kHop = 160;
constexpr int64_t kFadeSamples = 80;  // 5 ms linear fade in / out

// Whisper's mel filters (data/audio.h), with the encoder named in the error.
at::Tensor shapes_mel_filters(int64_t mels, const std::string& encoder) {
  try {
    return mel_filterbank(mels, kNfft, kSampleRate);
  } catch (const Error& e) {
    WEFT_FAIL("shapes dataset: model.", encoder, ".mels = ", mels, ": ", e.what());
  }
}

}  // namespace

// Everything random about one sample. Geometry is in fractions of the image side, y downward.
struct ShapesDataset::Scene {
  int colour = 0, shape = 0, position = 0;
  std::array<float, 3> rgb{};
  double cx = 0.5, cy = 0.5, half = 0.1;
  // audio
  int pitch = 0, length = 0;
  double freq_hz = 0.0, amplitude = 0.0, phase = 0.0, start = 0.0, duration = 0.0;

  std::string caption(bool with_audio) const {
    std::string c = std::string("a ") + kColourNames[colour] + " " + kShapeNames[shape] +
                    " in the " + kPositionNames[position];
    if (with_audio)
      c += std::string(" with a ") + kPitchNames[pitch] + " " + kLengthNames[length] + " tone";
    return c;
  }

  bool contains(double u, double v) const {
    const double dx = u - cx, dy = v - cy, h = half;
    switch (shape) {
      case 0:  // circle
        return dx * dx + dy * dy <= h * h;
      case 1:  // square
        return std::abs(dx) <= 0.9 * h && std::abs(dy) <= 0.9 * h;
      case 2:  // triangle, apex up, base at the bottom of the box
        return dy >= -h && dy <= h && std::abs(dx) <= 0.5 * (dy + h);
      default:  // cross (plus sign)
        return (std::abs(dx) <= 0.35 * h && std::abs(dy) <= h) ||
               (std::abs(dy) <= 0.35 * h && std::abs(dx) <= h);
    }
  }
};

ShapesDataset::ShapesDataset(const Spec& spec, const Tokenizer& tok)
    : seed_(spec.data.seed),
      noise_(spec.data.noise),
      eval_samples_(spec.data.eval_samples),
      tok_(tok) {
  WEFT_CHECK(spec.data.kind == "shapes", "shapes dataset: data.kind is '", spec.data.kind, "'");
  WEFT_CHECK(eval_samples_ >= 0, "data.eval_samples must be >= 0, got ", eval_samples_);
  WEFT_CHECK(noise_ >= 0.0, "data.noise must be >= 0, got ", noise_);
  const auto& encs = spec.model.encoders;
  bool has_vit = false;
  for (const auto& e : encs) {
    EncoderInfo info;
    info.kind = e.kind;
    info.tokens = e.tokens_per_item();
    if (e.kind == EncoderKind::kVit) {
      has_vit = true;
      WEFT_CHECK(e.channels == 3, "shapes dataset: model.", e.name,
                 ".channels must be 3 (RGB images), got ", e.channels);
      WEFT_CHECK(e.image_size >= 8, "shapes dataset: model.", e.name,
                 ".image_size must be >= 8, got ", e.image_size);
      info.image_size = e.image_size;
    } else {
      with_audio_ = true;
      WEFT_CHECK(e.frames >= 2, "shapes dataset: model.", e.name, ".frames must be >= 2, got ",
                 e.frames);
      WEFT_CHECK(e.mels >= 1, "shapes dataset: model.", e.name, ".mels must be >= 1, got ", e.mels);
      info.mels = e.mels;
      info.frames = e.frames;
      info.mel_filters = shapes_mel_filters(e.mels, e.name);
    }
    encoders_.push_back(std::move(info));
  }
  WEFT_CHECK(has_vit, "shapes dataset: the model needs a vit encoder (images), but ",
             spec.source.empty() ? std::string("the config") : spec.source, " has none");
  WEFT_CHECK(tok_.num_placeholders() == static_cast<int64_t>(encs.size()),
             "shapes dataset: tokenizer has ", tok_.num_placeholders(),
             " placeholder tokens but the model has ", encs.size(), " encoders");
  for (const auto& w : words(with_audio_)) tok_.encode(w);  // throws on a missing word
  if (with_audio_) window_ = torch::hann_window(kNfft, torch::TensorOptions().dtype(torch::kFloat));

  prompt_length_ = 1;
  for (const auto& e : encoders_) prompt_length_ += e.tokens;
  const int64_t need = sequence_length();
  WEFT_CHECK(spec.model.llm.max_seq >= need, "model.llm.max_seq = ", spec.model.llm.max_seq,
             " is too small for the shapes dataset: its sequences need ", need, " tokens (<bos>, ",
             prompt_length_ - 1, " placeholder tokens, caption, <eos>)");
  WEFT_CHECK(spec.model.llm.vocab == 0 || spec.model.llm.vocab >= tok_.vocab_size(),
             "model.llm.vocab = ", spec.model.llm.vocab,
             " is smaller than the shapes tokenizer's vocabulary (", tok_.vocab_size(),
             "); set it to 0 to take it from the tokenizer");
}

std::vector<std::string> ShapesDataset::words(bool with_audio) {
  std::vector<std::string> w = {"a", "in", "the"};
  for (const char* c : kColourNames) w.emplace_back(c);
  for (const char* s : kShapeNames) w.emplace_back(s);
  for (const char* p : {"top", "bottom", "left", "right", "center"}) w.emplace_back(p);
  if (with_audio) {
    w.emplace_back("with");
    for (const char* p : kPitchNames) w.emplace_back(p);
    for (const char* l : kLengthNames) w.emplace_back(l);
    w.emplace_back("tone");
  }
  return w;
}

int64_t ShapesDataset::sequence_length() const {
  return prompt_length_ + kMaxCaptionWordsImage + (with_audio_ ? kCaptionWordsAudio : 0) + 1;
}

ShapesDataset::Scene ShapesDataset::make_scene(uint64_t key) const {
  const Draws d(key);
  Scene s;
  s.colour = d.choice(0, kNumColours);
  s.shape = d.choice(1, kNumShapes);
  s.position = d.choice(2, kNumPositions);
  for (int c = 0; c < 3; ++c)
    s.rgb[c] = kColourRgb[s.colour][c] + static_cast<float>(d.uniform(3 + c, -0.05, 0.05));
  s.half = 0.5 * d.uniform(6, kMinSize, kMaxSize);
  // Jitter the centre, keeping the shape's box inside its cell (half-width 1/6).
  const double slack = (1.0 / 6.0 - s.half) * 0.9;
  s.cx = ((s.position % 3) + 0.5) / 3.0 + d.uniform(7, -slack, slack);
  s.cy = ((s.position / 3) + 0.5) / 3.0 + d.uniform(8, -slack, slack);
  if (with_audio_) {
    s.pitch = d.choice(9, kNumPitches);
    s.length = d.choice(10, kNumLengths);
    s.freq_hz = kPitchHz[s.pitch] * d.uniform(11, 0.97, 1.03);
    s.amplitude = d.uniform(12, 0.3, 0.6);
    s.phase = d.uniform(13, 0.0, 2.0 * kPi);
    s.duration = kLengthFraction[s.length] + d.uniform(14, -0.04, 0.04);
    s.start = d.uniform(15, 0.0, 1.0 - s.duration);
  }
  return s;
}

at::Tensor ShapesDataset::render_image(const Scene& scene, int64_t size, uint64_t key) const {
  const Draws d(key);
  auto img = torch::empty({3, size, size}, torch::kFloat);
  float* p = img.data_ptr<float>();
  const int64_t plane = size * size;
  const auto noise = static_cast<float>(noise_);
  const double inv = 1.0 / static_cast<double>(size);
  for (int64_t y = 0; y < size; ++y) {
    const double v = (static_cast<double>(y) + 0.5) * inv;
    for (int64_t x = 0; x < size; ++x) {
      const double u = (static_cast<double>(x) + 0.5) * inv;
      const bool inside = scene.contains(u, v);
      const int64_t i = y * size + x;
      // One 64-bit draw gives the noise of all three channels (21 bits each).
      const uint64_t r = d.u64(static_cast<uint64_t>(i));
      for (int c = 0; c < 3; ++c) {
        const auto bits = static_cast<float>((r >> (21 * c)) & ((1u << 21) - 1));
        const float n = noise * (bits * (2.0f / static_cast<float>(1u << 21)) - 1.0f);
        const float val = std::clamp((inside ? scene.rgb[c] : kBackground) + n, 0.0f, 1.0f);
        p[c * plane + i] = (val - 0.5f) * 2.0f;
      }
    }
  }
  return img;
}

at::Tensor ShapesDataset::render_audio(const Scene& scene, const EncoderInfo& enc,
                                       uint64_t key) const {
  const Draws d(key);
  const int64_t n = enc.frames * kHop;  // centred STFT: frames + 1 columns, last one dropped
  auto wave = torch::empty({n}, torch::kFloat);
  float* w = wave.data_ptr<float>();
  const auto noise = static_cast<float>(0.25 * noise_);
  for (int64_t i = 0; i < n; ++i)
    w[i] = noise * static_cast<float>(2.0 * d.uniform(static_cast<uint64_t>(i)) - 1.0);

  const auto t0 = static_cast<int64_t>(scene.start * static_cast<double>(n));
  const int64_t len =
      std::min(n - t0, static_cast<int64_t>(scene.duration * static_cast<double>(n)));
  const double step = 2.0 * kPi * scene.freq_hz / static_cast<double>(kSampleRate);
  const double cs = std::cos(step), sn = std::sin(step);
  double re = std::cos(scene.phase), im = std::sin(scene.phase);  // rotating phasor
  const int64_t fade = std::max<int64_t>(1, std::min(kFadeSamples, len / 4));
  for (int64_t j = 0; j < len; ++j) {
    const double env =
        std::min({1.0, static_cast<double>(j + 1) / fade, static_cast<double>(len - j) / fade});
    w[t0 + j] += static_cast<float>(scene.amplitude * env * im);
    const double re2 = re * cs - im * sn;
    im = im * cs + re * sn;
    re = re2;
  }

  auto spec = torch::stft(wave, kNfft, kHop, kNfft, window_, /*center=*/true,
                          c10::string_view("reflect"), /*normalized=*/false,
                          /*onesided=*/true, /*return_complex=*/true);  // [bins, frames + 1]
  auto power = torch::view_as_real(spec.narrow(1, 0, enc.frames)).square().sum(-1);
  auto logmel = enc.mel_filters.matmul(power).clamp_min(1e-10).log10();
  logmel = torch::maximum(logmel, logmel.max() - 8.0);
  return (logmel + 4.0) / 4.0;
}

namespace {
uint64_t sample_key(uint64_t seed, uint64_t stream, uint64_t index) {
  return derive(derive(derive(0x5EEDF00DULL, seed), stream), index);
}
}  // namespace

Sample ShapesDataset::layout(uint64_t stream, uint64_t index) const {
  const Scene scene = make_scene(derive(sample_key(seed_, stream, index), 0));
  Sample s;
  s.record = static_cast<int64_t>(index);
  s.caption = scene.caption(with_audio_);
  s.tokens.reserve(static_cast<size_t>(sequence_length()));
  s.tokens.push_back(tok_.bos_id());
  for (size_t e = 0; e < encoders_.size(); ++e) {
    ModalityItem item;
    item.encoder = static_cast<int>(e);
    item.start = static_cast<int64_t>(s.tokens.size());
    item.length = encoders_[e].tokens;
    s.tokens.insert(s.tokens.end(), static_cast<size_t>(item.length),
                    tok_.placeholder_id(static_cast<int>(e)));
    s.items.push_back(std::move(item));
  }
  s.prompt_length = static_cast<int64_t>(s.tokens.size());
  for (int64_t id : tok_.encode(s.caption)) s.tokens.push_back(id);
  s.tokens.push_back(tok_.eos_id());
  s.is_target.assign(s.tokens.size(), 0);
  std::fill(s.is_target.begin() + s.prompt_length, s.is_target.end(), 1);
  WEFT_ASSERT(static_cast<int64_t>(s.tokens.size()) <= sequence_length());
  return s;
}

at::Tensor ShapesDataset::item_input(uint64_t stream, uint64_t index, int encoder) const {
  WEFT_ASSERT(encoder >= 0 && encoder < static_cast<int>(encoders_.size()));
  const uint64_t key = sample_key(seed_, stream, index);
  const Scene scene = make_scene(derive(key, 0));
  const EncoderInfo& enc = encoders_[encoder];
  const uint64_t item_key = derive(key, 1 + static_cast<uint64_t>(encoder));
  return enc.kind == EncoderKind::kVit ? render_image(scene, enc.image_size, item_key)
                                       : render_audio(scene, enc, item_key);
}

Sample ShapesDataset::sample(uint64_t stream, uint64_t index) const {
  Sample s = layout(stream, index);
  for (ModalityItem& item : s.items) item.input = item_input(stream, index, item.encoder);
  return s;
}

std::vector<Sample> ShapesDataset::train_batch(int64_t step, int64_t batch) const {
  return train_samples(step, batch, 0, 1, /*media=*/true);
}

std::vector<Sample> ShapesDataset::train_batch(int64_t step, int64_t batch, int64_t part,
                                               int64_t parts) const {
  return train_samples(step, batch, part, parts, /*media=*/true);
}

std::vector<Sample> ShapesDataset::train_layout(int64_t step, int64_t batch) const {
  return train_samples(step, batch, 0, 1, /*media=*/false);
}

std::vector<Sample> ShapesDataset::train_samples(int64_t step, int64_t batch, int64_t part,
                                                 int64_t parts, bool media) const {
  WEFT_CHECK(step >= 0, "shapes dataset: step must be >= 0, got ", step);
  WEFT_CHECK(batch >= 1, "shapes dataset: batch must be >= 1, got ", batch);
  const auto [begin, end] = part_range(batch, parts, part);
  std::vector<Sample> out;
  out.reserve(static_cast<size_t>(end - begin));
  const auto first = static_cast<uint64_t>(step) * static_cast<uint64_t>(batch);
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t index = first + static_cast<uint64_t>(i);
    out.push_back(media ? sample(kTrainStream, index) : layout(kTrainStream, index));
  }
  return out;
}

std::vector<Sample> ShapesDataset::eval_set() const {
  std::vector<Sample> out;
  out.reserve(static_cast<size_t>(eval_samples_));
  for (int64_t i = 0; i < eval_samples_; ++i)
    out.push_back(sample(kEvalStream, static_cast<uint64_t>(i)));
  return out;
}

}  // namespace weft::data
