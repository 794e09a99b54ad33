// Timeline events, in one format for the simulator (plan/simulate.h) and the runtime (a real
// step's trace in a run directory), so predicted and measured timelines can be laid side by side
// in Perfetto / chrome://tracing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft::plan {

// One interval of one rank's timeline.
struct TraceEvent {
  std::string name;      // "vision fwd mb2 s0", "llm bwd mb0 s1", "llm grad all-reduce", ...
  std::string category;  // "forward", "backward", "collective", "optimizer"
  int64_t rank = 0;
  double start_seconds = 0, seconds = 0;
};

// Chrome / Perfetto trace: a JSON array of {"name", "cat", "ph": "X", "ts", "dur", "pid": 0,
// "tid": rank}, times in microseconds.
std::string chrome_trace(const std::vector<TraceEvent>& events);

}  // namespace weft::plan
