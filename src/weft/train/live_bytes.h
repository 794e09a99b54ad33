// Tensor bytes alive on one device, as its allocator reports them (c10's memory-reporting hook,
// the one the PyTorch profiler uses): what the step's tensors really hold, which the process's
// resident set only bounds (the C allocator keeps freed pages, libraries reserve workspaces).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

namespace weft::train {

// Counts, while alive, the bytes allocated and freed on this thread for `device` (allocations of
// other threads, such as intra-op worker threads, are not seen). Not nestable with the PyTorch
// profiler's memory profiling on the same thread.
class LiveBytes {
 public:
  explicit LiveBytes(c10::Device device = c10::kCPU);
  ~LiveBytes();
  LiveBytes(const LiveBytes&) = delete;
  LiveBytes& operator=(const LiveBytes&) = delete;

  int64_t live() const;  // allocated minus freed since construction (may be negative)
  int64_t peak() const;  // the most live() has been since construction or reset_peak()
  void reset_peak();     // peak() = live()

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weft::train
