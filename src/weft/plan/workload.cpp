#include "weft/plan/workload.h"

#include <algorithm>
#include <random>

#include "weft/core/error.h"

namespace weft::plan {

const std::vector<std::string>& workload_mixes() {
  static const std::vector<std::string> names = {"llava", "video", "interleaved"};
  return names;
}

std::vector<SampleShape> sample_workload(const std::string& name, const Spec& spec, int64_t n,
                                         uint64_t seed) {
  const auto& names = workload_mixes();
  WEFT_CHECK(std::find(names.begin(), names.end(), name) != names.end(), "workload mix '", name,
             "': expected one of llava, video, interleaved");
  WEFT_CHECK(n >= 0, "workload: sample count must be >= 0, got ", n);
  int vision = -1;
  for (size_t e = 0; e < spec.model.encoders.size() && vision < 0; ++e)
    if (spec.model.encoders[e].kind == EncoderKind::kVit) vision = static_cast<int>(e);
  const int64_t per_item = vision >= 0 ? spec.model.encoders[vision].tokens_per_item() : 0;
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::vector<SampleShape> out;
  for (int64_t i = 0; i < n; ++i) {
    int64_t items = 0, text = 0;
    const int64_t pick = uniform(0, 99);
    if (name == "llava") {
      items = pick < 25 ? 0 : pick < 80 ? 1 : pick < 92 ? uniform(2, 4) : 5;
      text = uniform(64, 1536);
    } else if (name == "video") {
      items = pick < 50 ? 8 : pick < 75 ? 1 : 0;
      text = uniform(32, 1024);
    } else {
      items = uniform(0, 8);
      text = uniform(128, 3072);
    }
    if (vision < 0) items = 0;
    SampleShape s;
    s.items.assign(spec.model.encoders.size(), 0);
    if (vision >= 0) s.items[vision] = items;
    s.tokens = items * per_item + text;
    s.targets = text;
    out.push_back(s);
  }
  return out;
}

}  // namespace weft::plan
