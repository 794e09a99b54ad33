// ShapesDataset: the built-in procedural dataset. Each sample is one filled shape (6 colours x
// 4 shapes x 9 grid positions) on a noisy dark background, captioned "a <colour> <shape> in the
// <position>"; if the model has a whisper encoder, also a sine tone (3 pitches x 2 lengths) as
// a log-mel spectrogram, and the caption ends "with a <pitch> <length> tone".
//
// sample(stream, index) is a pure function of (data.seed, stream, index): it uses a
// counter-based hash, never shared or global RNG state, so samples can be generated in any
// order, on any thread, and are identical across runs. Stream 0 is training, stream 1 eval.
// Thread-safe: all methods are const and touch no mutable state.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/data/sample.h"
#include "weft/data/tokenizer.h"

namespace weft::data {

class ShapesDataset {
 public:
  static constexpr uint64_t kTrainStream = 0;
  static constexpr uint64_t kEvalStream = 1;

  // Checks the model fits the dataset (a vit encoder exists, max_seq and vocab are large
  // enough, the tokenizer matches the encoders) and precomputes the audio front end.
  ShapesDataset(const Spec& spec, const Tokenizer& tok);

  // Every word a caption can contain, in the tokenizer's fixed order.
  static std::vector<std::string> words(bool with_audio);

  Sample sample(uint64_t stream, uint64_t index) const;
  // The sample without its items' inputs (record = index), and one item's input: sample() is
  // both.
  Sample layout(uint64_t stream, uint64_t index) const;
  at::Tensor item_input(uint64_t stream, uint64_t index, int encoder) const;
  // Stream 0, indices [step * batch, step * batch + batch).
  std::vector<Sample> train_batch(int64_t step, int64_t batch) const;
  // Only part `part` of `parts` of that batch (split as data::split does): what one data-
  // parallel rank trains on, without generating the other ranks' samples.
  std::vector<Sample> train_batch(int64_t step, int64_t batch, int64_t part, int64_t parts) const;
  // train_batch(step, batch) without the items' inputs (layout()).
  std::vector<Sample> train_layout(int64_t step, int64_t batch) const;
  // data.eval_samples samples from stream 1, indices 0.. in order.
  std::vector<Sample> eval_set() const;

  // Length of the longest sequence any sample can have (captions vary by a word or two).
  int64_t sequence_length() const;
  // Tokens before the caption: <bos> and the placeholder spans (same for every sample).
  int64_t prompt_length() const { return prompt_length_; }
  bool with_audio() const { return with_audio_; }
  const Tokenizer& tokenizer() const { return tok_; }

 private:
  struct Scene;
  struct EncoderInfo {
    EncoderKind kind = EncoderKind::kVit;
    int64_t tokens = 0;
    int64_t image_size = 0;  // vit
    int64_t mels = 0;        // whisper
    int64_t frames = 0;      // whisper
    at::Tensor mel_filters;  // whisper: float [mels, n_fft / 2 + 1]
  };

  std::vector<Sample> train_samples(int64_t step, int64_t batch, int64_t part, int64_t parts,
                                    bool media) const;
  Scene make_scene(uint64_t key) const;
  at::Tensor render_image(const Scene& scene, int64_t size, uint64_t key) const;
  at::Tensor render_audio(const Scene& scene, const EncoderInfo& enc, uint64_t key) const;

  uint64_t seed_ = 0;
  double noise_ = 0.0;
  int64_t eval_samples_ = 0;
  bool with_audio_ = false;
  int64_t prompt_length_ = 0;
  Tokenizer tok_;
  std::vector<EncoderInfo> encoders_;  // spec order
  at::Tensor window_;                  // periodic Hann, n_fft samples
};

}  // namespace weft::data
