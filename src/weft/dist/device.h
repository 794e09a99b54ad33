// The device a rank computes on (train.device). CUDA: rank r uses GPU LOCAL_RANK, made the
// current device before any NCCL group or device tensor exists.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>

#include "weft/core/spec.h"

namespace c10 {
struct Event;
}

namespace weft::dist {

// The CPU, or CUDA device `local_rank` made current. Errors, naming train.device, when this
// build has no CUDA, no GPU is visible, or local_rank is past the visible GPUs.
c10::Device select_device(Device device, int local_rank);

// Waits for the work queued on `device` (before reading a clock); nothing on the CPU.
void synchronize(c10::Device device);

// The most bytes the caching allocator held for tensors on a CUDA device since the last reset
// (0 on the CPU, where bench measures the resident set instead).
int64_t device_peak_bytes(c10::Device device);
void reset_device_peak(c10::Device device);

// A small tensor's copy to the host, queued behind the work that computes it: get() waits for
// that work only (an event on the stream), not for what was queued after it, so the host can
// queue the next step before it reads this one's loss. A CPU tensor is there at once.
class HostCopy {
 public:
  HostCopy() = default;
  explicit HostCopy(const at::Tensor& t);
  bool defined() const { return host_.defined(); }
  // Whether get() would return at once.
  bool ready() const;
  // The values, on the host (waits for the copy).
  const at::Tensor& get() const;

 private:
  at::Tensor host_;
  std::shared_ptr<c10::Event> done_;
};

}  // namespace weft::dist
