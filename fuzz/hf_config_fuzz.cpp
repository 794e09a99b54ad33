// libFuzzer target: the Hugging Face config.json reader (core/hf_config.h), as an LLM and as an
// encoder. Any input must give a config or a weft::Error — never a crash, undefined behaviour or
// another exception. The input is written to a config.json in a temporary directory of this
// process (the reader takes a checkpoint directory or a path).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "fuzz_support.h"
#include "weft/core/error.h"
#include "weft/core/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    char dir[] = "/tmp/weft-hf-fuzz-XXXXXX";
    if (!mkdtemp(dir)) std::abort();
    return std::string(dir) + "/config.json";
  }();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    weft::read_hf_llm_config(path);
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  try {
    weft::read_hf_encoder_config(path);
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
