// Measured matmul peak of this machine (the MFU denominator): square matmuls in `dtype`
// timed for about `seconds`; returns FLOP/s.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace weft::train {

double measure_matmul_peak(at::ScalarType dtype, double seconds = 0.6, int64_t n = 2048,
                           c10::Device device = c10::kCPU);

}  // namespace weft::train
