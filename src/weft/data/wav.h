// WAV reading without LibTorch: RIFF/WAVE bytes -> float samples in [-1, 1].
// Supported: PCM 8 (unsigned), 16, 24, 32 bits and IEEE float 32/64, plain or
// WAVE_FORMAT_EXTENSIBLE; other encodings (ADPCM, A-law, ...) are a weft::Error naming the file
// and the field. Integers are scaled as soundfile/libsndfile do: x / 2^(bits-1) (8-bit:
// (x - 128) / 128). Unknown chunks are skipped (odd sizes padded). A RIFF size larger than the
// file is tolerated (streaming writers leave it wrong); a data chunk running past the end of the
// file is an error, as are zero channels, more than kMaxWavChannels, and sample rates outside
// [kMinWavRate, kMaxWavRate]. A trailing partial frame is dropped. Thread-safe.
// This header and wav.cpp use no LibTorch (the fuzzer builds them alone).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace weft::data {

struct WavAudio {
  int sample_rate = 0;
  int channels = 0;
  std::vector<float> samples;  // interleaved: samples[frame * channels + channel]

  int64_t frames() const { return channels ? static_cast<int64_t>(samples.size()) / channels : 0; }
};

constexpr int kMaxWavChannels = 64;
constexpr int kMinWavRate = 1000;
constexpr int kMaxWavRate = 768000;

// Parses a WAV file held in memory; `name` is only used in error messages.
WavAudio decode_wav(std::string_view bytes, const std::string& name);

// Reads and parses a file.
WavAudio load_wav(const std::string& path);

// Mono by averaging the channels of each frame.
std::vector<float> mix_to_mono(const WavAudio& audio);

}  // namespace weft::data
