// libFuzzer target: the config parser (TOML → Spec, then the Plan). Any input must give a Spec
// or a weft::Error — never a crash, a hang, undefined behaviour or another exception.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const weft::Spec spec = weft::parse_spec(text, "fuzz.toml", {});
    weft::plan::make_plan(spec, 1);
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
