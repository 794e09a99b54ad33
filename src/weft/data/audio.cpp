#include "weft/data/audio.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "weft/core/error.h"
#include "weft/data/wav.h"

namespace weft::data {

namespace {

constexpr double kPi = 3.14159265358979323846;

// --- resampling ------------------------------------------------------------------------------

constexpr double kZeroCrossings = 32.0;  // of the lowpass sinc, each side
constexpr double kKaiserBeta = 9.0;
constexpr double kRolloff = 0.94;  // cutoff / lower Nyquist
constexpr int64_t kMaxPhases = 4096;
constexpr int64_t kMaxTableEntries = int64_t{1} << 22;

// Modified Bessel function of the first kind, order 0 (power series).
double bessel_i0(double x) {
  double sum = 1.0, term = 1.0;
  const double q = x * x / 4.0;
  for (int k = 1; k < 200 && term > 1e-17 * sum; ++k) {
    term *= q / (static_cast<double>(k) * k);
    sum += term;
  }
  return sum;
}

double sinc(double x) { return x == 0.0 ? 1.0 : std::sin(kPi * x) / (kPi * x); }

// Round-half-to-even of num / den (both >= 0), like Python's round(num / den).
int64_t round_div(int64_t num, int64_t den) {
  const int64_t q = num / den, r2 = 2 * (num % den);
  return r2 > den || (r2 == den && (q & 1)) ? q + 1 : q;
}

// --- mel filters -----------------------------------------------------------------------------

// Slaney mel scale (librosa's default, as used by Whisper).
double hz_to_mel(double hz) {
  constexpr double f_sp = 200.0 / 3.0, min_log_hz = 1000.0, min_log_mel = 15.0;
  const double logstep = std::log(6.4) / 27.0;
  return hz >= min_log_hz ? min_log_mel + std::log(hz / min_log_hz) / logstep : hz / f_sp;
}

double mel_to_hz(double mel) {
  constexpr double f_sp = 200.0 / 3.0, min_log_hz = 1000.0, min_log_mel = 15.0;
  const double logstep = std::log(6.4) / 27.0;
  return mel >= min_log_mel ? min_log_hz * std::exp(logstep * (mel - min_log_mel)) : mel * f_sp;
}

// Row-major [mels][n_fft / 2 + 1], float64.
std::vector<double> mel_weights(int64_t mels, int64_t n_fft, int64_t sample_rate) {
  WEFT_CHECK(mels >= 1 && mels <= 1024, "mel filterbank: mels = ", mels, " (expected 1 to 1024)");
  WEFT_CHECK(n_fft >= 2 && n_fft <= 65536, "mel filterbank: n_fft = ", n_fft,
             " (expected 2 to 65536)");
  WEFT_CHECK(sample_rate >= 1, "mel filterbank: sample_rate = ", sample_rate, " (expected >= 1)");
  const int64_t bins = n_fft / 2 + 1;
  const double fmax = static_cast<double>(sample_rate) / 2.0;
  std::vector<double> mel_f(static_cast<size_t>(mels + 2));
  const double mel_lo = hz_to_mel(0.0), mel_hi = hz_to_mel(fmax);
  for (int64_t i = 0; i < mels + 2; ++i)
    mel_f[i] = mel_to_hz(mel_lo + (mel_hi - mel_lo) * static_cast<double>(i) /
                                      static_cast<double>(mels + 1));
  std::vector<double> w(static_cast<size_t>(mels * bins));
  for (int64_t m = 0; m < mels; ++m) {
    const double enorm = 2.0 / (mel_f[m + 2] - mel_f[m]);
    double sum = 0.0;
    for (int64_t k = 0; k < bins; ++k) {
      const double f = fmax * static_cast<double>(k) / static_cast<double>(bins - 1);
      const double lower = (f - mel_f[m]) / (mel_f[m + 1] - mel_f[m]);
      const double upper = (mel_f[m + 2] - f) / (mel_f[m + 2] - mel_f[m + 1]);
      w[m * bins + k] = std::max(0.0, std::min(lower, upper)) * enorm;
      sum += w[m * bins + k];
    }
    WEFT_CHECK(sum > 0.0, "mel filterbank: ", mels, " mel bands are too many for n_fft ", n_fft,
               " at ", sample_rate, " Hz: band ", m, " covers no FFT bin");
  }
  return w;
}

}  // namespace

std::vector<float> resample(const std::vector<float>& x, int from_hz, int to_hz) {
  WEFT_CHECK(from_hz >= kMinWavRate && from_hz <= kMaxWavRate && to_hz >= kMinWavRate &&
                 to_hz <= kMaxWavRate,
             "resample: rates ", from_hz, " -> ", to_hz, " Hz (each must be in [", kMinWavRate,
             ", ", kMaxWavRate, "])");
  if (from_hz == to_hz) return x;
  const int64_t g = std::gcd(from_hz, to_hz);
  const int64_t up = to_hz / g, down = from_hz / g;  // output n sits at input time n * down / up
  const double cutoff = kRolloff * 0.5 * std::min(1.0, static_cast<double>(to_hz) / from_hz);
  const double half_width = kZeroCrossings / (2.0 * cutoff);  // input samples
  const auto half = static_cast<int64_t>(std::ceil(half_width));
  const int64_t taps = 2 * half;  // input offsets -half + 1 .. half around floor(t)
  const int64_t phases = std::min({up, kMaxPhases, std::max<int64_t>(64, kMaxTableEntries / taps)});

  // table[p][j]: weight of x[floor(t) + j - half + 1] when t - floor(t) = p / phases, normalised
  // to sum 1 (unit DC gain).
  std::vector<double> table(static_cast<size_t>(phases * taps));
  const double i0_beta = bessel_i0(kKaiserBeta);
  for (int64_t p = 0; p < phases; ++p) {
    double* w = table.data() + p * taps;
    const double frac = static_cast<double>(p) / static_cast<double>(phases);
    double sum = 0.0;
    for (int64_t j = 0; j < taps; ++j) {
      const double d = static_cast<double>(j - half + 1) - frac;
      const double r = d / half_width;
      w[j] = std::abs(r) >= 1.0 ? 0.0
                                : 2.0 * cutoff * sinc(2.0 * cutoff * d) *
                                      bessel_i0(kKaiserBeta * std::sqrt(1.0 - r * r)) / i0_beta;
      sum += w[j];
    }
    for (int64_t j = 0; j < taps; ++j) w[j] /= sum;
  }

  const auto n_in = static_cast<int64_t>(x.size());
  const int64_t n_out = round_div(n_in * to_hz, from_hz);
  std::vector<float> y(static_cast<size_t>(n_out));
  for (int64_t n = 0; n < n_out; ++n) {
    const int64_t pos = n * down;
    int64_t base = pos / up;
    int64_t p = pos % up;
    if (phases != up) {  // round the time to the nearest of `phases` steps
      p = (p * phases * 2 + up) / (2 * up);
      if (p == phases) p = 0, ++base;
    }
    const double* w = table.data() + p * taps;
    const int64_t first = base - half + 1;  // input index of w[0]
    const int64_t j0 = std::max<int64_t>(0, -first), j1 = std::min(taps, n_in - first);
    double acc = 0.0;
    for (int64_t j = j0; j < j1; ++j) acc += w[j] * x[first + j];
    y[n] = static_cast<float>(acc);
  }
  return y;
}

std::vector<float> load_audio_mono(const std::string& path, int sample_rate) {
  const WavAudio wav = load_wav(path);
  return resample(mix_to_mono(wav), wav.sample_rate, sample_rate);
}

at::Tensor mel_filterbank(int64_t mels, int64_t n_fft, int64_t sample_rate) {
  const std::vector<double> w = mel_weights(mels, n_fft, sample_rate);
  return torch::tensor(at::ArrayRef<double>(w), torch::kDouble)
      .view({mels, n_fft / 2 + 1})
      .to(torch::kFloat);
}

at::Tensor whisper_log_mel(const std::vector<float>& audio16k, int64_t mels, int64_t frames) {
  WEFT_CHECK(frames >= 2 && frames <= 100000, "whisper_log_mel: frames = ", frames,
             " (expected 2 to 100000; 3000 is 30 s)");
  const std::vector<double> w = mel_weights(mels, kWhisperNfft, kWhisperSampleRate);
  const int64_t bins = kWhisperNfft / 2 + 1;
  auto filters = torch::from_blob(const_cast<double*>(w.data()), {mels, bins}, torch::kDouble);

  const int64_t n = frames * kWhisperHop;  // HF pads / truncates to n_samples
  auto wave = torch::zeros({n}, torch::kDouble);
  double* wp = wave.data_ptr<double>();
  const int64_t keep = std::min<int64_t>(n, static_cast<int64_t>(audio16k.size()));
  for (int64_t i = 0; i < keep; ++i) wp[i] = audio16k[i];

  const auto window = torch::hann_window(kWhisperNfft, /*periodic=*/true,
                                         torch::TensorOptions().dtype(torch::kDouble));
  auto spec = torch::stft(wave, kWhisperNfft, kWhisperHop, kWhisperNfft, window, /*center=*/true,
                          c10::string_view("reflect"), /*normalized=*/false,
                          /*onesided=*/true, /*return_complex=*/true);  // [bins, frames + 1]
  auto power = torch::view_as_real(spec.narrow(1, 0, frames)).square().sum(-1);
  auto logmel = filters.matmul(power).clamp_min(1e-10).log10();
  logmel = torch::maximum(logmel, logmel.max() - 8.0);
  return ((logmel + 4.0) / 4.0).to(torch::kFloat).contiguous();
}

}  // namespace weft::data
