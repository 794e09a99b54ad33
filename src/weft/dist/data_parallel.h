// Data parallelism: gradient synchronisation and ZeRO-1 parameter ownership.
//
// GradSync sums every gradient over the DP group in flat fp32 buckets of about `bucket_bytes`,
// in reverse creation order (roughly the order backward produces them). Overlapped use: call
// arm() before the last backward of a step (the one that completes the gradients); hooks then
// copy each finished gradient into its bucket and start the bucket's all-reduce once it and
// every bucket before it are full (buckets start in index order on every rank, whichever
// parameters got gradients there), while backward goes on. finish() starts whatever is left
// (parameters that got no gradient contribute .grad or zeros), waits, and writes the sums to
// .grad. Without arm(), finish()
// does all the work after backward. Every rank of the group calls arm()/finish() in the same
// steps with the same parameter list. Not thread-safe; hooks run on the backward thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "weft/dist/comm.h"
#include "weft/model/layers.h"

namespace weft::dist {

class GradSync {
 public:
  GradSync(Comm group, model::NamedTensors params, int64_t bucket_bytes = 4 << 20);
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  void arm();
  void finish();
  int64_t bucket_count() const { return static_cast<int64_t>(buckets_.size()); }
  // Buckets whose all-reduce started during backward in the last step (overlap achieved).
  int64_t buckets_overlapped() const { return overlapped_; }

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    std::vector<int64_t> offsets;
    at::Tensor buffer;  // fp32, flat
    int64_t ready = 0;
    bool launched = false;
    Pending pending;
  };
  void on_grad(size_t k, const at::Tensor& incoming);
  void launch(Bucket& b);

  Comm group_;
  model::NamedTensors params_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // per parameter
  std::vector<uint8_t> filled_;    // per parameter: its bucket slice holds this step's gradient
  size_t next_ = 0;                // the next bucket to launch (they launch in index order)
  std::vector<unsigned> hooks_;
  bool armed_ = false;
  int64_t overlapped_ = 0;
};

// ZeRO-1 ownership: parameter k's optimizer state lives on rank owner[k] of the DP group.
// Greedy by size (largest first, to the least-loaded rank): balanced, deterministic.
std::vector<int> partition_parameters(const model::NamedTensors& params, int ranks);

// After each owner stepped its parameters, gives every rank the updated values.
void broadcast_from_owners(const Comm& group, const model::NamedTensors& params,
                           const std::vector<int>& owner);

}  // namespace weft::dist
