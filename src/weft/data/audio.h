// Audio front end for Whisper-style encoders: resampling and the log-mel features of Hugging
// Face's WhisperFeatureExtractor (16 kHz, n_fft 400, hop 160, periodic Hann window, centred STFT
// with reflect padding, power spectrum, Slaney mel filters, log10(max(x, 1e-10)), floor at
// max - 8, then (x + 4) / 4; the last STFT frame dropped). WAV reading is in wav.h.
// All functions are pure and thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weft::data {

constexpr int kWhisperSampleRate = 16000;
constexpr int64_t kWhisperNfft = 400;
constexpr int64_t kWhisperHop = 160;

// Band-limited resampling: a Kaiser-windowed sinc (32 zero crossings each side, beta 9) with its
// cutoff at 0.94 x the lower Nyquist frequency. Gain (44.1 -> 16 kHz): 1 within 1e-4 up to
// 0.85 x Nyquist (6.8 kHz), 0.53 at 7.5 kHz, -39 dB at Nyquist, below -90 dB from 1.025 x
// Nyquist, so nothing aliases audibly. Samples outside the input count as zero. Output length
// round(n * to / from) (ties to even). Exact polyphase when to / gcd(from, to) <= 4096 (160
// phases for 44.1 -> 16 kHz); beyond that the output times are rounded to 1/4096 input sample.
std::vector<float> resample(const std::vector<float>& x, int from_hz, int to_hz);

// load_wav + mix_to_mono + resample to `sample_rate`.
std::vector<float> load_audio_mono(const std::string& path, int sample_rate = kWhisperSampleRate);

// Slaney-scale, Slaney-normalised triangular mel filters over the n_fft / 2 + 1 FFT bins from 0
// to sample_rate / 2: librosa.filters.mel(htk=False, norm="slaney") and HF's
// mel_filter_bank(norm="slaney", mel_scale="slaney"). float32 [mels, n_fft / 2 + 1]. Throws
// weft::Error when a band covers no FFT bin (too many mels for n_fft).
at::Tensor mel_filterbank(int64_t mels, int64_t n_fft = kWhisperNfft,
                          int64_t sample_rate = kWhisperSampleRate);

// WhisperFeatureExtractor on 16 kHz mono audio: the audio is zero-padded or truncated to
// frames * 160 samples (3000 frames = 30 s for real Whisper), giving float32 [mels, frames].
// Computed in float64 (HF's numpy path; its torch path is float32, within ~1e-5 of it).
at::Tensor whisper_log_mel(const std::vector<float>& audio16k, int64_t mels, int64_t frames);

}  // namespace weft::data
