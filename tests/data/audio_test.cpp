// WAV reading, resampling and the Whisper log-mel front end (data/wav.h, data/audio.h), against
// references made by tests/data/fixtures/media/make_fixtures.py (numpy port of HF's
// WhisperFeatureExtractor).
#include "weft/data/audio.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "support/errors.h"
#include "weft/data/wav.h"

namespace weft::data {
namespace {

namespace fs = std::filesystem;
using weft::testing::error_of;

const std::string kMediaDir = std::string(WEFT_SOURCE_DIR) + "/tests/data/fixtures/media/";
constexpr double kPi = 3.14159265358979323846;

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f) << path;
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<float> read_f32(const std::string& path) {
  const std::string b = read_bytes(path);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

// --- WAV -------------------------------------------------------------------------------------

std::string le(uint32_t v, int bytes) {
  std::string s;
  for (int i = 0; i < bytes; ++i) s += static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

std::string chunk(const std::string& id, const std::string& data) {
  return id + le(static_cast<uint32_t>(data.size()), 4) + data + std::string(data.size() % 2, '\0');
}

std::string fmt(uint32_t tag, uint32_t channels, uint32_t rate, uint32_t bits) {
  const uint32_t block = channels * bits / 8;
  return chunk("fmt ", le(tag, 2) + le(channels, 2) + le(rate, 4) + le(rate * block, 4) +
                           le(block, 2) + le(bits, 2));
}

std::string riff(const std::string& chunks) {
  return "RIFF" + le(static_cast<uint32_t>(4 + chunks.size()), 4) + "WAVE" + chunks;
}

// wav.txt: "name rate channels frames sum sumsq", then 16 "index value" pairs.
TEST(WavDecode, FixturesMatchTheirWriter) {
  std::ifstream f(kMediaDir + "ref/wav.txt");
  ASSERT_TRUE(f);
  std::string name;
  int files = 0;
  while (f >> name) {
    int rate = 0, channels = 0;
    int64_t frames = 0;
    double sum = 0, sumsq = 0;
    f >> rate >> channels >> frames >> sum >> sumsq;
    const WavAudio a = load_wav(kMediaDir + name);
    EXPECT_EQ(a.sample_rate, rate) << name;
    EXPECT_EQ(a.channels, channels) << name;
    EXPECT_EQ(a.frames(), frames) << name;
    double s = 0, s2 = 0;
    for (float v : a.samples) s += v, s2 += static_cast<double>(v) * v;
    EXPECT_NEAR(s, sum, 1e-6 * (1 + std::abs(sum))) << name;
    EXPECT_NEAR(s2, sumsq, 1e-6 * sumsq) << name;
    for (int k = 0; k < 16; ++k) {
      size_t i = 0;
      float v = 0;
      f >> i >> v;
      ASSERT_LT(i, a.samples.size()) << name;
      EXPECT_EQ(a.samples[i], v) << name << " sample " << i;
    }
    ++files;
  }
  EXPECT_EQ(files, 5);
}

TEST(WavDecode, MixesChannelsToMono) {
  const WavAudio a = load_wav(kMediaDir + "stereo44k_pcm16.wav");
  const std::vector<float> m = mix_to_mono(a);
  ASSERT_EQ(static_cast<int64_t>(m.size()), a.frames());
  for (size_t t = 0; t < m.size(); t += 97)
    EXPECT_FLOAT_EQ(m[t], (a.samples[2 * t] + a.samples[2 * t + 1]) / 2) << t;
  const WavAudio mono = load_wav(kMediaDir + "mono16k_pcm16.wav");
  EXPECT_EQ(mix_to_mono(mono), mono.samples);
}

TEST(WavDecode, Pcm32AndFloat64) {
  const std::string p32 =
      riff(fmt(1, 1, 16000, 32) + chunk("data", le(0x80000000u, 4) + le(0x40000000u, 4)));
  const WavAudio a = decode_wav(p32, "p32.wav");
  EXPECT_EQ(a.samples, (std::vector<float>{-1.0f, 0.5f}));
  double d = -0.25;
  uint64_t u = 0;
  std::memcpy(&u, &d, 8);
  const std::string f64 =
      riff(fmt(3, 1, 48000, 64) + chunk("data", le(static_cast<uint32_t>(u), 4) + le(u >> 32, 4)));
  EXPECT_EQ(decode_wav(f64, "f64.wav").samples, (std::vector<float>{-0.25f}));
  // A partial trailing frame is dropped; fmt may come after data.
  const std::string odd =
      riff(chunk("data", le(0x7FFF, 2) + le(0x8000, 2) + "\x01") + fmt(1, 2, 16000, 16));
  const WavAudio o = decode_wav(odd, "odd.wav");
  EXPECT_EQ(o.frames(), 1);
  EXPECT_EQ(o.samples[1], -1.0f);
}

TEST(WavDecode, ErrorsNameTheFileAndField) {
  const std::string data = chunk("data", std::string(8, '\0'));
  struct Case {
    std::string bytes, expect;
  };
  const Case cases[] = {
      {"RIFF", "too short"},
      {riff(fmt(1, 1, 16000, 16)).replace(8, 4, "AVI "), "not a RIFF/WAVE"},
      {riff(fmt(1, 0, 16000, 16) + data), "channels = 0"},
      {riff(fmt(1, 1, 0, 16) + data), "sample rate = 0"},
      {riff(fmt(1, 1, 4000000, 16) + data), "sample rate = 4000000"},
      {riff(fmt(2, 1, 16000, 4) + data), "format tag 2 (Microsoft ADPCM)"},
      {riff(fmt(1, 1, 16000, 12) + data), "bits per sample = 12"},
      {riff(fmt(3, 1, 16000, 16) + data), "bits per sample = 16 for IEEE float"},
      {riff(fmt(1, 1, 16000, 16)), "no data chunk"},
      {riff(data), "no fmt chunk"},
      {riff(fmt(1, 1, 16000, 16) + "data" + le(1000, 4) + std::string(10, '\0')),
       "data chunk of 1000 bytes at offset 36 runs past the end"},
      {riff(fmt(3, 1, 16000, 32) + chunk("data", le(0x7FC00000u, 4))), "not a finite number"},
      {riff(chunk("fmt ", le(0xFFFE, 2) + std::string(14, '\0')) + data), "too short (40 needed)"},
  };
  for (const Case& c : cases) {
    const std::string e = error_of([&] { decode_wav(c.bytes, "clip7.wav"); });
    EXPECT_NE(e.find("clip7.wav"), std::string::npos) << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << e << "\n  expected: " << c.expect;
  }
  const std::string m = error_of([] { load_wav("/nonexistent/a.wav"); });
  EXPECT_NE(m.find("/nonexistent/a.wav"), std::string::npos) << m;
}

// Every input saved by the fuzzer (fuzz/media_fuzz.cpp) parses or throws weft::Error.
TEST(WavDecode, ReplaysFuzzInputs) {
  int files = 0;
  for (const auto& e : fs::directory_iterator(fs::path(WEFT_SOURCE_DIR) / "tests/fuzz/media")) {
    try {
      const WavAudio a = decode_wav(read_bytes(e.path().string()), e.path().filename().string());
      EXPECT_EQ(a.samples.size() % a.channels, 0u);
    } catch (const Error&) {
    }
    ++files;
  }
  EXPECT_GT(files, 0);
}

// --- resampling ------------------------------------------------------------------------------

std::vector<float> sine(double hz, int rate, int64_t n, double amplitude = 1.0) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    x[i] = static_cast<float>(amplitude * std::sin(2 * kPi * hz * static_cast<double>(i) / rate));
  return x;
}

// Max |y - amplitude * sin(2 pi hz t)| over y, skipping `edge` samples at both ends.
double sine_error(const std::vector<float>& y, double hz, int rate, double amplitude, int edge) {
  double err = 0;
  for (size_t i = edge; i + edge < y.size(); ++i)
    err = std::max(err, std::abs(y[i] - amplitude * std::sin(2 * kPi * hz * i / rate)));
  return err;
}

// Amplitude of the best-fitting sinusoid at `hz` (projection), skipping the edges.
double amplitude_at(const std::vector<float>& y, double hz, int rate, int edge) {
  double s = 0, c = 0;
  int64_t n = 0;
  for (size_t i = edge; i + edge < y.size(); ++i, ++n) {
    s += y[i] * std::sin(2 * kPi * hz * i / rate);
    c += y[i] * std::cos(2 * kPi * hz * i / rate);
  }
  return 2 * std::sqrt(s * s + c * c) / static_cast<double>(n);
}

double rms(const std::vector<float>& y, int edge) {
  double s = 0;
  int64_t n = 0;
  for (size_t i = edge; i + edge < y.size(); ++i, ++n) s += static_cast<double>(y[i]) * y[i];
  return std::sqrt(s / static_cast<double>(n));
}

TEST(AudioResample, KeepsAOneKilohertzSine) {
  const std::vector<float> y = resample(sine(1000, 44100, 44100), 44100, 16000);
  ASSERT_EQ(y.size(), 16000u);
  const double err = sine_error(y, 1000, 16000, 1.0, 400);
  std::printf("[ resample ] 1 kHz, 44.1 -> 16 kHz: max error %.2e\n", err);
  EXPECT_LT(err, 1e-3);
  // Upsampling, and a ratio with more than 4096 phases (times rounded to 1/4096 sample).
  EXPECT_LT(sine_error(resample(sine(1000, 16000, 16000), 16000, 44100), 1000, 44100, 1, 1000),
            1e-3);
  EXPECT_LT(sine_error(resample(sine(1000, 44100, 44100), 44100, 16001), 1000, 16001, 1, 400),
            1e-3);
  EXPECT_LT(sine_error(resample(sine(440, 48000, 24000, 0.5), 48000, 16000), 440, 16000, 0.5, 400),
            1e-3);
}

TEST(AudioResample, RemovesWhatIsAboveTheNewNyquist) {
  // 12 kHz at 44.1 kHz would alias to 4 kHz at 16 kHz: it must be gone.
  const std::vector<float> high = resample(sine(12000, 44100, 44100), 44100, 16000);
  const double high_rms = rms(high, 400);
  // 7.5 kHz is inside the transition band (cutoff 0.94 * 8 kHz): attenuated, not removed.
  const double a75 =
      amplitude_at(resample(sine(7500, 44100, 44100), 44100, 16000), 7500, 16000, 400);
  const double a6 =
      amplitude_at(resample(sine(6000, 44100, 44100), 44100, 16000), 6000, 16000, 400);
  std::printf("[ resample ] 44.1 -> 16 kHz: 6 kHz x%.6f, 7.5 kHz x%.3f, 12 kHz rms %.2e\n", a6, a75,
              high_rms);
  EXPECT_LT(high_rms * std::sqrt(2.0), 1e-2);
  EXPECT_LT(high_rms, 1e-4);
  EXPECT_GT(a75, 0.05);
  EXPECT_LT(a75, 0.9);
  EXPECT_NEAR(a6, 1.0, 1e-3);
}

TEST(AudioResample, LengthsAndEdgeCases) {
  EXPECT_EQ(resample(std::vector<float>(1000), 44100, 16000).size(), 363u);  // 362.8
  EXPECT_EQ(resample(std::vector<float>(3), 44100, 16000).size(), 1u);       // 1.09
  EXPECT_EQ(resample(std::vector<float>(1), 32000, 16000).size(), 0u);       // 0.5: to even
  EXPECT_EQ(resample(std::vector<float>(3), 32000, 16000).size(), 2u);       // 1.5: to even
  EXPECT_EQ(resample(std::vector<float>(), 8000, 16000).size(), 0u);
  const std::vector<float> x = sine(100, 16000, 50);
  EXPECT_EQ(resample(x, 16000, 16000), x);
  // A constant stays constant away from the (zero-padded) edges.
  const std::vector<float> y = resample(std::vector<float>(5000, 0.25f), 22050, 16000);
  for (size_t i = 300; i + 300 < y.size(); ++i) ASSERT_NEAR(y[i], 0.25, 1e-6) << i;
  EXPECT_NE(error_of([] { resample({1.0f}, 0, 16000); }).find("rates 0 -> 16000"),
            std::string::npos);
}

// --- Whisper log-mel -------------------------------------------------------------------------

TEST(AudioWhisper, LogMelMatchesHfWithEightyMels) {
  const std::vector<float> x = load_audio_mono(kMediaDir + "mono16k_pcm16.wav");
  ASSERT_EQ(x.size(), 16000u);
  const at::Tensor got = whisper_log_mel(x, 80, 100);
  ASSERT_EQ(got.sizes(), (at::IntArrayRef{80, 100}));
  const std::vector<float> ref = read_f32(kMediaDir + "ref/mono16k.logmel80.f32");
  ASSERT_EQ(ref.size(), 8000u);
  const at::Tensor want = torch::from_blob(const_cast<float*>(ref.data()), {80, 100});
  const double max_diff = (got - want).abs().max().item<double>();
  std::printf("[ whisper ] 80 mels x 100 frames: max |diff| vs HF numpy %.2e (range %.3f..%.3f)\n",
              max_diff, want.min().item<double>(), want.max().item<double>());
  EXPECT_LE(max_diff, 1e-3);
  EXPECT_LE((got - want).abs().mean().item<double>(), 1e-5);
}

TEST(AudioWhisper, LogMelMatchesHfWith128MelsAndThirtySeconds) {
  const std::vector<float> x = mix_to_mono(load_wav(kMediaDir + "mono16k_pcm16.wav"));
  const at::Tensor got = whisper_log_mel(x, 128, 3000);
  ASSERT_EQ(got.sizes(), (at::IntArrayRef{128, 3000}));
  const std::vector<float> ref = read_f32(kMediaDir + "ref/mono16k.logmel128.f32");
  ASSERT_EQ(ref.size(), 128u * 128u);
  const at::Tensor want = torch::from_blob(const_cast<float*>(ref.data()), {128, 128});
  const double max_diff = (got.narrow(1, 0, 128) - want).abs().max().item<double>();
  std::printf("[ whisper ] 128 mels, first 128 of 3000 frames: max |diff| vs HF numpy %.2e\n",
              max_diff);
  EXPECT_LE(max_diff, 1e-3);
  // Past the audio, every frame is padding: floored at max - 8.
  const float floor = want.min().item<float>();
  const at::Tensor tail = got.narrow(1, 128, 3000 - 128);
  EXPECT_NEAR(tail.min().item<float>(), floor, 1e-5);
  EXPECT_NEAR(tail.max().item<float>(), floor, 1e-5);
}

TEST(AudioWhisper, PadsAndTruncatesToTheFrameCount) {
  const std::vector<float> x = load_audio_mono(kMediaDir + "mono16k_pcm16.wav");
  const std::vector<float> head(x.begin(), x.begin() + 50 * 160);
  EXPECT_TRUE(whisper_log_mel(x, 40, 50).equal(whisper_log_mel(head, 40, 50)));
  std::vector<float> padded = head;
  padded.resize(16000, 0.0f);
  EXPECT_TRUE(whisper_log_mel(head, 40, 100).equal(whisper_log_mel(padded, 40, 100)));
  // Silence: log10(1e-10) everywhere, (-10 + 4) / 4.
  const at::Tensor s = whisper_log_mel({}, 80, 10);
  EXPECT_FLOAT_EQ(s.min().item<float>(), -1.5f);
  EXPECT_FLOAT_EQ(s.max().item<float>(), -1.5f);
}

TEST(AudioWhisper, MelFilterbankIsSlaneyNormalised) {
  const at::Tensor fb = mel_filterbank(80);
  ASSERT_EQ(fb.sizes(), (at::IntArrayRef{80, 201}));
  // Slaney: each triangle has area ~1 in Hz (height 2 / width), i.e. sum * 40 Hz per bin ~ 1.
  const at::Tensor area = fb.sum(1) * 40.0;
  EXPECT_NEAR(area.narrow(0, 10, 70).mean().item<double>(), 1.0, 0.05);
  EXPECT_GT(fb.min().item<float>(), -1e-12f);
  const std::string e = error_of([] { mel_filterbank(300); });
  EXPECT_NE(e.find("covers no FFT bin"), std::string::npos) << e;
  EXPECT_NE(error_of([] { whisper_log_mel({}, 80, 1); }).find("frames = 1"), std::string::npos);
  EXPECT_NE(error_of([] { whisper_log_mel({}, 0, 10); }).find("mels = 0"), std::string::npos);
}

}  // namespace
}  // namespace weft::data
