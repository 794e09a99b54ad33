// Data parallelism: gradient synchronisation and ZeRO-1 parameter ownership.
//
// GradSync sums every gradient over the DP group in flat fp32 buckets of about `bucket_bytes`,
// in reverse creation order (roughly the order backward produces them). attach() at the start
// of a step makes every .grad a view of its bucket (DDP's gradient_as_bucket_view, Megatron's
// contiguous gradient buffer): backward accumulates straight into the buckets, and no second
// fp32 copy of the gradients exists. Overlapped use: call arm() before the last backward of a
// step (the one that completes the gradients); as each parameter's gradient is accumulated
// (a post-hook of its AccumulateGrad node), it is in its bucket (or copied there, when .grad is
// not the bucket's view), and a bucket's all-reduce starts once it and every bucket before it
// are full (buckets start in index order on every rank, whichever parameters got gradients
// there), while backward goes on. finish() starts whatever is left (parameters that got no
// gradient contribute their .grad or zeros), waits, and leaves the sums in .grad. Without arm(),
// finish() does all the work after backward. arm(which) arms some parameters only (the rest keep
// accumulating): interleaved 1F1B arms each LLM chunk's parameters before its own last backward,
// and the buckets still launch in index order. Every rank of the group calls attach()/arm()/
// finish() in the same steps with the same parameter list. Not thread-safe; hooks run on the
// backward thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "weft/dist/comm.h"
#include "weft/model/layers.h"

namespace torch::autograd {
struct Node;
}

namespace weft::dist {

class GradSync {
 public:
  GradSync(Comm group, model::NamedTensors params, int64_t bucket_bytes = 4 << 20);
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Every parameter's .grad a zeroed view of its bucket (a .grad already defined is copied in).
  // The views stay valid until .grad is reset; no-op for a group of one rank.
  void attach();
  void arm();
  void arm(const std::vector<bool>& which);  // per parameter (aligned with the constructor's list)
  void finish();
  int64_t bucket_count() const { return static_cast<int64_t>(buckets_.size()); }
  // Buckets whose all-reduce started during backward in the last step (overlap achieved).
  int64_t buckets_overlapped() const { return overlapped_; }

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    at::Tensor buffer;           // fp32, flat
    int64_t ready = 0;
    bool launched = false;
    Pending pending;
  };
  void on_accumulated(size_t k);
  void launch(Bucket& b);
  at::Tensor slice(size_t k) const;  // parameter k's part of its bucket, shaped as the parameter
  bool attached(size_t k) const;     // .grad is that part

  Comm group_;
  model::NamedTensors params_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;   // per parameter
  std::vector<int64_t> offset_of_;  // per parameter: where its slice starts in its bucket
  std::vector<uint8_t> filled_;     // per parameter: its bucket slice holds this step's gradient
  size_t next_ = 0;                 // the next bucket to launch (they launch in index order)
  // Per parameter: its AccumulateGrad node (held, so the hook lives as long as this object; the
  // parameter keeps only a weak reference) and the key of the hook on it.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hooks_;
  bool armed_ = false;             // any parameter armed this step
  std::vector<uint8_t> armed_of_;  // per parameter: its next accumulation completes its gradient
  int64_t overlapped_ = 0;
};

// ZeRO-1 ownership: parameter k's optimizer state lives on rank owner[k] of the DP group.
// Greedy by size (largest first, to the least-loaded rank): balanced, deterministic.
std::vector<int> partition_parameters(const model::NamedTensors& params, int ranks);

// After each owner stepped its parameters, gives every rank the updated values.
void broadcast_from_owners(const Comm& group, const model::NamedTensors& params,
                           const std::vector<int>& owner);

}  // namespace weft::dist
