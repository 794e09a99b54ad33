// libFuzzer target: the LLaVA-style record parser (data/llava_records.h), fed whole files (JSON
// arrays and JSONL). Any input must parse or give a weft::Error — never a crash or UB.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "weft/core/error.h"
#include "weft/data/llava_records.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    weft::data::parse_llava_records(text, "fuzz.json");
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
