// Command-line number checks with plain messages ("--steps: must be > 0, got 0"), instead of
// CLI11's range validators, which print their bounds as 300-digit doubles.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <string>

namespace weft::cli {

// A validator for numbers > 0 (`positive`) or >= 0.
inline CLI::Validator number_at_least_zero(bool positive) {
  return CLI::Validator(
      [positive](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end == nullptr || *end != '\0')
          return "expected a number, got '" + text + "'";
        if (positive && !(v > 0)) return "must be > 0, got " + text;
        if (!positive && !(v >= 0)) return "must be >= 0, got " + text;
        return "";
      },
      positive ? "POSITIVE" : "NONNEGATIVE");
}

inline const CLI::Validator kPositive = number_at_least_zero(true);
inline const CLI::Validator kNonNegative = number_at_least_zero(false);

// A validator for whole numbers in [lo, hi] (CLI11's Range words its message differently from
// version to version).
inline CLI::Validator integer_in(long lo, long hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        char* end = nullptr;
        const long v = std::strtol(text.c_str(), &end, 10);
        if (text.empty() || end == nullptr || *end != '\0')
          return "expected a whole number, got '" + text + "'";
        if (v < lo || v > hi)
          return "must be in " + std::to_string(lo) + ".." + std::to_string(hi) + ", got " + text;
        return "";
      },
      "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

}  // namespace weft::cli
