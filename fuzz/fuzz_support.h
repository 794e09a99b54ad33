// What every libFuzzer target shares: a weft::Error is the expected answer to bad input, but one
// from WEFT_ASSERT ("internal error at ...") is a bug the input found, so the target aborts on it
// (libFuzzer then saves the input).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "weft/core/error.h"

namespace weft_fuzz {

inline void no_internal_error(const weft::Error& e) {
  if (std::strncmp(e.what(), "internal error", 14) != 0) return;
  std::fprintf(stderr, "%s\n", e.what());
  std::abort();
}

}  // namespace weft_fuzz
