// libFuzzer target: the PNG and JPEG decoders (data/image_decode.h) and the WAV reader
// (data/wav.h), fed the same bytes. Any input must decode or give a weft::Error -- never a crash,
// an out-of-range read, undefined behaviour, an exit() from libjpeg or a longjmp gone astray.
// No LibTorch needed:
//   clang++ -std=c++17 -O1 -g -DNDEBUG -fsanitize=fuzzer,address,undefined
//     -fno-sanitize-recover=undefined -Isrc fuzz/media_fuzz.cpp src/weft/data/image_decode.cpp
//     src/weft/data/wav.cpp -lpng -ljpeg -o media_fuzz
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_support.h"
#include "weft/core/error.h"
#include "weft/data/image_decode.h"
#include "weft/data/wav.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const weft::data::DecodedImage img = weft::data::decode_image(bytes, "fuzz");
    if (img.pixels.size() != static_cast<size_t>(img.width) * img.height * 3) __builtin_trap();
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  try {
    const weft::data::WavAudio wav = weft::data::decode_wav(bytes, "fuzz");
    if (wav.channels < 1 || wav.samples.size() % wav.channels != 0) __builtin_trap();
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
