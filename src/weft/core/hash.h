// Counter-based randomness: splitmix64's finaliser as a pure function, so draws can be made in
// any order, on any thread, and reproduce exactly (datasets, shuffles).
#pragma once

#include <cstdint>

namespace weft {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// splitmix64 finaliser: a bijective 64-bit mix.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Key of a sub-domain `a` of `key` (sample within stream, epoch within seed, ...).
inline uint64_t derive(uint64_t key, uint64_t a) { return mix64(key ^ mix64(a * kGolden + 1)); }

// Draw number i of a key.
inline uint64_t draw(uint64_t key, uint64_t i) { return mix64(key + (i + 1) * kGolden); }

}  // namespace weft
