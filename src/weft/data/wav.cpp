#include "weft/data/wav.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "weft/core/error.h"

namespace weft::data {

namespace {

uint32_t le16(const uint8_t* p) { return p[0] | (p[1] << 8); }
uint32_t le32(const uint8_t* p) {
  return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t le64(const uint8_t* p) { return le32(p) | (static_cast<uint64_t>(le32(p + 4)) << 32); }

constexpr uint32_t kPcm = 1;
constexpr uint32_t kFloat = 3;
constexpr uint32_t kExtensible = 0xFFFE;
// KSDATAFORMAT_SUBTYPE_*: the format tag followed by these 14 bytes.
constexpr uint8_t kGuidTail[14] = {0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x80,
                                   0x00, 0x00, 0xAA, 0x00, 0x38, 0x9B, 0x71};

const char* encoding_name(uint32_t tag) {
  switch (tag) {
    case 2:
      return "Microsoft ADPCM";
    case 6:
      return "A-law";
    case 7:
      return "mu-law";
    case 0x11:
      return "IMA ADPCM";
    case 0x55:
      return "MP3";
    default:
      return "unknown";
  }
}

struct Format {
  uint32_t tag = 0, channels = 0, rate = 0, block_align = 0, bits = 0;
};

Format parse_fmt(const uint8_t* p, uint32_t size, const std::string& name) {
  WEFT_CHECK(size >= 16, "audio ", name, ": fmt chunk of ", size,
             " bytes is too short (16 needed)");
  Format f;
  f.tag = le16(p);
  f.channels = le16(p + 2);
  f.rate = le32(p + 4);
  f.block_align = le16(p + 12);
  f.bits = le16(p + 14);
  if (f.tag == kExtensible) {
    WEFT_CHECK(size >= 40, "audio ", name, ": WAVE_FORMAT_EXTENSIBLE fmt chunk of ", size,
               " bytes is too short (40 needed)");
    WEFT_CHECK(std::memcmp(p + 26, kGuidTail, sizeof(kGuidTail)) == 0, "audio ", name,
               ": WAVE_FORMAT_EXTENSIBLE sub-format is not a standard PCM/float GUID");
    f.tag = le16(p + 24);  // valid bits (p + 18) <= container bits: samples are left-justified
  }
  WEFT_CHECK(f.channels >= 1 && f.channels <= static_cast<uint32_t>(kMaxWavChannels), "audio ",
             name, ": fmt channels = ", f.channels, " (expected 1 to ", kMaxWavChannels, ")");
  WEFT_CHECK(
      f.rate >= static_cast<uint32_t>(kMinWavRate) && f.rate <= static_cast<uint32_t>(kMaxWavRate),
      "audio ", name, ": fmt sample rate = ", f.rate, " Hz (expected ", kMinWavRate, " to ",
      kMaxWavRate, ")");
  WEFT_CHECK(f.tag == kPcm || f.tag == kFloat, "audio ", name,
             ": unsupported encoding, fmt format ", "tag ", f.tag, " (", encoding_name(f.tag),
             "); supported: PCM (1) and IEEE float (3), also inside WAVE_FORMAT_EXTENSIBLE");
  if (f.tag == kPcm)
    WEFT_CHECK(f.bits == 8 || f.bits == 16 || f.bits == 24 || f.bits == 32, "audio ", name,
               ": fmt bits per sample = ", f.bits, " for PCM (supported: 8, 16, 24, 32)");
  else
    WEFT_CHECK(f.bits == 32 || f.bits == 64, "audio ", name, ": fmt bits per sample = ", f.bits,
               " for IEEE float (supported: 32, 64)");
  WEFT_CHECK(f.block_align == f.channels * f.bits / 8, "audio ", name,
             ": fmt block align = ", f.block_align,
             " (expected channels * bits / 8 = ", f.channels * f.bits / 8, ")");
  return f;
}

float decode_sample(const uint8_t* p, const Format& f) {
  if (f.tag == kFloat) {
    if (f.bits == 32) {
      const uint32_t u = le32(p);
      float v;
      std::memcpy(&v, &u, 4);
      return v;
    }
    const uint64_t u = le64(p);
    double v;
    std::memcpy(&v, &u, 8);
    return static_cast<float>(v);
  }
  switch (f.bits) {
    case 8:
      return static_cast<float>(static_cast<int>(p[0]) - 128) / 128.0f;
    case 16:
      return static_cast<float>(static_cast<int16_t>(le16(p))) / 32768.0f;
    case 24: {  // the 3 bytes at the top of a 32-bit word, shifted back with the sign
      const uint32_t u = (p[0] << 8) | (p[1] << 16) | (static_cast<uint32_t>(p[2]) << 24);
      return static_cast<float>(static_cast<int32_t>(u) >> 8) / 8388608.0f;
    }
    default:
      return static_cast<float>(static_cast<int32_t>(le32(p)) / 2147483648.0);
  }
}

}  // namespace

WavAudio decode_wav(std::string_view bytes, const std::string& name) {
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  const uint64_t n = bytes.size();
  WEFT_CHECK(n >= 12, "audio ", name, ": ", n, " bytes is too short for a WAV file (truncated?)");
  WEFT_CHECK(std::memcmp(b, "RIFF", 4) == 0 && std::memcmp(b + 8, "WAVE", 4) == 0, "audio ", name,
             ": not a RIFF/WAVE file (the supported audio format is WAV)");
  bool have_fmt = false, have_data = false;
  Format fmt;
  uint64_t data_pos = 0, data_size = 0;
  for (uint64_t pos = 12; pos + 8 <= n && !(have_fmt && have_data);) {
    const uint8_t* id = b + pos;
    const uint64_t size = le32(b + pos + 4), body = pos + 8;
    if (std::memcmp(id, "fmt ", 4) == 0 && !have_fmt) {
      WEFT_CHECK(size <= n - body, "audio ", name, ": fmt chunk of ", size,
                 " bytes runs past the end of the file (truncated?)");
      fmt = parse_fmt(b + body, static_cast<uint32_t>(size), name);
      have_fmt = true;
    } else if (std::memcmp(id, "data", 4) == 0 && !have_data) {
      WEFT_CHECK(size <= n - body, "audio ", name, ": data chunk of ", size, " bytes at offset ",
                 pos, " runs past the end of the file (", n - body, " bytes left; truncated?)");
      data_pos = body;
      data_size = size;
      have_data = true;
    }
    pos = body + size + (size & 1);  // chunks are padded to even sizes
  }
  WEFT_CHECK(have_fmt, "audio ", name, ": no fmt chunk before the end of the file");
  WEFT_CHECK(have_data, "audio ", name, ": no data chunk before the end of the file");

  WavAudio out;
  out.sample_rate = static_cast<int>(fmt.rate);
  out.channels = static_cast<int>(fmt.channels);
  const uint64_t frames = data_size / fmt.block_align;
  const uint64_t count = frames * fmt.channels;
  const uint32_t width = fmt.bits / 8;
  out.samples.resize(count);
  for (uint64_t i = 0; i < count; ++i) {
    const float v = decode_sample(b + data_pos + i * width, fmt);
    WEFT_CHECK(std::isfinite(v), "audio ", name, ": sample ", i / fmt.channels, " of channel ",
               i % fmt.channels, " is not a finite number");
    out.samples[i] = v;
  }
  return out;
}

WavAudio load_wav(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  WEFT_CHECK(f, "audio ", path, ": cannot open the file");
  std::ostringstream ss;
  ss << f.rdbuf();
  WEFT_CHECK(!f.bad(), "audio ", path, ": read error");
  return decode_wav(ss.str(), path);
}

std::vector<float> mix_to_mono(const WavAudio& audio) {
  if (audio.channels == 1) return audio.samples;
  WEFT_CHECK(audio.channels >= 1, "mix_to_mono: audio has ", audio.channels, " channels");
  const int64_t frames = audio.frames();
  std::vector<float> mono(static_cast<size_t>(frames));
  for (int64_t t = 0; t < frames; ++t) {
    float sum = 0.0f;
    for (int c = 0; c < audio.channels; ++c) sum += audio.samples[t * audio.channels + c];
    mono[t] = sum / static_cast<float>(audio.channels);
  }
  return mono;
}

}  // namespace weft::data
