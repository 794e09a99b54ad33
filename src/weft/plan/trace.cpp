#include "weft/plan/trace.h"

#include <nlohmann/json.hpp>

namespace weft::plan {

std::string chrome_trace(const std::vector<TraceEvent>& events) {
  nlohmann::json out = nlohmann::json::array();
  for (const TraceEvent& e : events)
    out.push_back({{"name", e.name},
                   {"cat", e.category},
                   {"ph", "X"},
                   {"ts", e.start_seconds * 1e6},
                   {"dur", e.seconds * 1e6},
                   {"pid", 0},
                   {"tid", e.rank}});
  return out.dump();
}

}  // namespace weft::plan
