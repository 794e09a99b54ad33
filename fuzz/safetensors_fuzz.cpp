// libFuzzer target: the safetensors reader (io/safetensors.h), fed whole files. Any input must
// load or give a weft::Error — never a crash, an out-of-range read or undefined behaviour.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "fuzz_support.h"
#include "weft/core/error.h"
#include "weft/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/weft_fuzz_" + std::to_string(::getpid()) + ".safetensors";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    weft::io::load_safetensors(path);
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
