// Data-parallel gradient synchronisation: after backward, every gradient is summed over the
// DP group in flat buckets of about `bucket_bytes` (few large collectives instead of one per
// parameter). Every rank of the group must call sync() once per step with the same parameter
// list. Parameters without a gradient this step contribute zeros (every rank must agree on the
// bucket layout), so they come out with a defined, summed gradient.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "weft/dist/comm.h"
#include "weft/model/layers.h"

namespace weft::dist {

class GradSync {
 public:
  GradSync(Comm group, model::NamedTensors params, int64_t bucket_bytes = 8 << 20);
  void sync();
  int64_t bucket_count() const { return static_cast<int64_t>(buckets_.size()); }

  // Makes every rank's parameters equal to rank 0's (start of training).
  static void broadcast_parameters(const Comm& group, const model::NamedTensors& params);

 private:
  Comm group_;
  model::NamedTensors params_;
  std::vector<std::vector<size_t>> buckets_;  // indices into params_, in reverse creation order
};

}  // namespace weft::dist
