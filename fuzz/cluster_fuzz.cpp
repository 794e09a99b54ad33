// libFuzzer target: the cluster file parser (plan/cluster.h). Any input must give a Cluster or a
// weft::Error — never a crash, undefined behaviour or another exception.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "weft/core/error.h"
#include "weft/plan/cluster.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    weft::plan::parse_cluster(std::string(reinterpret_cast<const char*>(data), size), "fuzz.toml");
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
