#include "weft/train/peak.h"

#include <torch/torch.h>

#include "weft/core/progress.h"
#include "weft/dist/device.h"

namespace weft::train {

double measure_matmul_peak(at::ScalarType dtype, double seconds, int64_t n, c10::Device device) {
  torch::NoGradGuard no_grad;
  at::Tensor a = torch::randn({n, n}).to(device, dtype), b = torch::randn({n, n}).to(device, dtype);
  at::Tensor c = at::mm(a, b);  // warm-up (oneDNN/BLAS/cuBLAS kernel selection)
  dist::synchronize(device);
  double best = 0;
  const double until = now_seconds() + seconds;
  do {
    const double t0 = now_seconds();
    at::mm_out(c, a, b);
    dist::synchronize(device);
    const double dt = now_seconds() - t0;
    best = std::max(best, 2.0 * static_cast<double>(n * n * n) / dt);
  } while (now_seconds() < until);
  return best;
}

}  // namespace weft::train
