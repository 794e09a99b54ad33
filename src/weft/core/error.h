// Errors: WEFT_CHECK for bad input and misuse (throws weft::Error with a message built from
// its arguments); WEFT_ASSERT for internal invariants (also throws, marked as a bug).
// Library code never exits; the CLI catches std::exception at the top.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace weft {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
// One argument of a message; a NaN reads "nan" whatever its sign bit (the C library writes a
// negative NaN as "-nan").
template <typename T>
void put(std::ostream& os, T&& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_floating_point_v<U>) {
    if (v != v) {
      os << "nan";
      return;
    }
  }
  os << std::forward<T>(v);
}
template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (put(os, std::forward<Args>(args)), ...);
  return os.str();
}
}  // namespace detail

}  // namespace weft

#define WEFT_CHECK(cond, ...)                                               \
  do {                                                                      \
    if (!(cond)) throw ::weft::Error(::weft::detail::str_cat(__VA_ARGS__)); \
  } while (0)

#define WEFT_FAIL(...) throw ::weft::Error(::weft::detail::str_cat(__VA_ARGS__))

#define WEFT_ASSERT(cond, ...)                                                                   \
  do {                                                                                           \
    if (!(cond))                                                                                 \
      throw ::weft::Error(::weft::detail::str_cat("internal error at ", __FILE__, ":", __LINE__, \
                                                  ": ", #cond, " ", ##__VA_ARGS__));             \
  } while (0)
