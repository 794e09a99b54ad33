// Image decoding without LibTorch: PNG and JPEG bytes -> 8-bit RGB pixels, converted the way
// PIL's Image.open(f).convert("RGB") does (what the Hugging Face image processors start from):
//   - grayscale is replicated to R = G = B; palette images are looked up (tRNS ignored);
//   - alpha is dropped, not composited (PIL's RGBA -> RGB);
//   - 16-bit samples keep their high byte (PIL does this for 16-bit RGB, RGBA and gray+alpha;
//     for 16-bit *grayscale* PIL clips values above 255 to 255 instead, which we do not copy);
//   - JPEG: libjpeg defaults (islow DCT, fancy upsampling), as PIL; CMYK/YCCK JPEGs are taken as
//     Adobe-inverted CMYK and converted with PIL's formula;
//   - gamma, colour profiles and EXIF orientation are ignored (so are they in PIL and in the HF
//     processors unless the caller transposes the image).
// Errors (a weft::Error naming the file): other formats, truncated files (PNG and JPEG, as PIL),
// malformed headers or data libpng/libjpeg refuse, more than kMaxImageBytes of RGB output or
// kMaxJpegScans progressive scans. JPEG corrupt-data warnings are ignored, as in PIL. Thread-safe.
// This header and image_decode.cpp use no LibTorch, so the fuzzer (fuzz/media_fuzz.cpp) can
// build them with the sanitizers alone.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace weft::data {

// Pixels row-major, interleaved: pixels[(y * width + x) * channels + c].
struct DecodedImage {
  int width = 0;
  int height = 0;
  int channels = 3;
  std::vector<uint8_t> pixels;
};

constexpr int64_t kMaxImageBytes = int64_t{1} << 28;  // 256 MiB of RGB (~89 M pixels, PIL's
                                                      // decompression-bomb warning threshold)
constexpr int kMaxJpegScans = 1000;  // progressive scans per JPEG (a scan bomb has thousands)

// Decodes PNG or JPEG (sniffed from the magic bytes, not the name) to RGB. `name` is only used
// in error messages.
DecodedImage decode_image(std::string_view bytes, const std::string& name);

// Reads and decodes a file.
DecodedImage load_image(const std::string& path);

}  // namespace weft::data
