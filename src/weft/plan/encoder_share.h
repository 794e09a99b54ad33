// How a global microbatch's encoder items split over an encoder's data-parallel ranks: the
// runtime's rule (dist/runtime.cpp encoder_range), for the simulator and the search to price.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

namespace weft::plan {

// [begin, end) of part `part` when n things are split into `parts`, larger parts first (the
// loader's data::split and the runtime's).
inline std::pair<int64_t, int64_t> even_part(int64_t n, int64_t parts, int64_t part) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = part * base + std::min(part, extra);
  return {begin, begin + base + (part < extra ? 1 : 0)};
}

// What encoder data-parallel rank i of edp runs of a global microbatch of D LLM replicas × n
// samples, `items` items per sample (the data's mean): [begin, end) in samples of the global
// microbatch, replica d's being [d·n, (d + 1)·n). When one DP size divides the other, whole
// replicas map to encoder ranks (fan-in) or a replica's items split over several (fan-out), else
// every item splits evenly over the ranks — items, not samples, as the runtime splits them: a
// sample's items can go to several ranks, so a share can end inside a sample. Whole items (an
// integral count to split) split as even_part does; a fractional mean count evenly.
struct EncoderShare {
  double begin = 0, end = 0;
  double samples() const { return end - begin; }
  // Of replica d's samples [d·n, (d + 1)·n): how many are in this share.
  double overlap(int64_t d, int64_t n) const {
    const double lo = static_cast<double>(d * n), hi = static_cast<double>((d + 1) * n);
    return std::max(0.0, std::min(end, hi) - std::max(begin, lo));
  }
};

inline EncoderShare encoder_share(int64_t n, double items, int64_t D, int64_t edp, int64_t i) {
  if (D % edp == 0) {
    const int64_t k = D / edp;
    return {static_cast<double>(i * k * n), static_cast<double>((i + 1) * k * n)};
  }
  // `samples` samples from `first` on, split into `parts`: part `part`.
  const auto split = [&](int64_t first, int64_t samples, int64_t parts, int64_t part) {
    const double at = static_cast<double>(first);
    const double total = static_cast<double>(samples) * items, whole = std::round(total);
    if (items > 0 && std::abs(total - whole) < 1e-9) {
      const auto [a, b] = even_part(static_cast<int64_t>(whole), parts, part);
      return EncoderShare{at + static_cast<double>(a) / items, at + static_cast<double>(b) / items};
    }
    const double per = static_cast<double>(samples) / static_cast<double>(parts);
    return EncoderShare{at + per * static_cast<double>(part),
                        at + per * static_cast<double>(part + 1)};
  };
  if (edp % D == 0) {
    const int64_t k = edp / D, d = i / k;
    return split(d * n, n, k, i % k);
  }
  return split(0, n * D, edp, i);
}

}  // namespace weft::plan
