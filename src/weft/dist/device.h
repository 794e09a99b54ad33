// The device a rank computes on (train.device). CUDA: rank r uses GPU LOCAL_RANK, made the
// current device before any NCCL group or device tensor exists.
#pragma once

#include <c10/core/Device.h>

#include "weft/core/spec.h"

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

}  // namespace weft::dist
