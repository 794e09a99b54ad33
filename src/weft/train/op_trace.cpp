#include "weft/train/op_trace.h"

#include <torch/csrc/autograd/profiler_legacy.h>
#ifdef WEFT_CUDA
#include <torch/csrc/autograd/profiler_kineto.h>
#endif
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>
#include <utility>

#include "weft/io/files.h"

namespace weft::train {

namespace {

// The autograd profiler's push and pop events, paired by handle (a range may end on another
// thread), as complete ("X") events; written through a temporary file and renamed.
void write_legacy(const std::string& path,
                  const torch::autograd::profiler::thread_event_lists& lists) {
  using nlohmann::json;
  using torch::autograd::profiler::EventKind;
  using torch::autograd::profiler::LegacyEvent;
  std::unordered_map<uint64_t, const LegacyEvent*> open;
  double t0 = -1;
  json events = json::array();
  for (const auto& list : lists)
    for (const LegacyEvent& e : list) {
      if (e.kind() == EventKind::PushRange) {
        open[e.handle()] = &e;
        if (t0 < 0 || e.cpuUs() < t0) t0 = e.cpuUs();
        continue;
      }
      if (e.kind() != EventKind::PopRange) continue;
      const auto it = open.find(e.handle());
      if (it == open.end()) continue;
      const LegacyEvent& push = *it->second;
      events.push_back({{"ph", "X"},
                        {"cat", "cpu_op"},
                        {"name", push.name()},
                        {"pid", 0},
                        {"tid", push.threadId()},
                        {"ts", push.cpuUs()},
                        {"dur", push.cpuElapsedUs(e)},
                        {"args", {{"Input Dims", push.shapes()}}}});
      open.erase(it);
    }
  for (json& e : events) e["ts"] = e["ts"].get<double>() - t0;
  io::write_text_file(path, json{{"traceEvents", std::move(events)}}.dump());
}

}  // namespace

OpTrace::OpTrace(std::string path) : path_(std::move(path)) {
  namespace impl = torch::profiler::impl;
#ifdef WEFT_CUDA
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/true);
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU, impl::ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
#else
  torch::autograd::profiler::enableProfilerLegacy(
      impl::ProfilerConfig(impl::ProfilerState::CPU, /*report_input_shapes=*/true));
#endif
}

OpTrace::~OpTrace() {
  try {  // a destructor: a failed save is reported, not thrown
#ifdef WEFT_CUDA
    const auto result = torch::autograd::profiler::disableProfiler();
#else
    const auto lists = torch::autograd::profiler::disableProfilerLegacy();
#endif
    const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
#ifdef WEFT_CUDA
    result->save(path_);
#else
    write_legacy(path_, lists);
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weft: could not write the operator trace %s: %s\n", path_.c_str(),
                 e.what());
  }
}

}  // namespace weft::train
