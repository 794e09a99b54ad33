// Test support: the message of the weft::Error a call throws.
#pragma once

#include <string>

#include "weft/core/error.h"

namespace weft::testing {

// What f() throws as weft::Error, or "no error" when it returns.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace weft::testing
