// Data parallelism: gradient synchronisation and the ZeRO-1 shards of the optimizer.
//
// GradSync sums every gradient over the DP group in flat fp32 buckets of about `bucket_bytes`,
// filled in reverse creation order (roughly the order backward produces them) and indexed by
// when they can be full (their earliest-created parameter, which backward reaches last). attach()
// at the start of a step makes every .grad a view of its bucket (DDP's gradient_as_bucket_view,
// Megatron's contiguous gradient buffer): backward accumulates straight into the buckets, and no
// second fp32 copy of the gradients exists. Overlapped use: call arm() before the last backward of
// a step (the one that completes the gradients); as each parameter's gradient is accumulated (a
// post-hook of its AccumulateGrad node), it is in its bucket (or copied there, when .grad is not
// the bucket's view), and a bucket's reduction starts once it and every bucket before it are full
// (buckets start in index order on every rank, whichever parameters got gradients there), while
// backward goes on. finish() starts whatever is left (parameters that got no gradient contribute
// their .grad or zeros), waits, and leaves the sums in .grad (ZeRO-1: below). Without arm(),
// finish() does all the work after backward. arm(which) arms some parameters only (the rest keep
// accumulating): interleaved 1F1B arms each LLM chunk's parameters before its own last backward,
// and the buckets still launch in index order. Every rank of the group calls attach()/arm()/
// finish() in the same steps with the same parameter list. Not thread-safe; hooks run on the
// backward thread.
//
// ZeRO-1 (Megatron's distributed optimizer): parameters marked Reduce::kScatter go into buckets
// padded to a multiple of the group's size and split into equal contiguous shards, shard r
// rank r's. Their reduction is a reduce-scatter: after finish() rank r holds the sum of its
// shard only (in its part of the bucket; the rest of such a .grad keeps this rank's own
// contribution), and steps the parameter elements in it (pieces()). gather_params() then
// all-gathers the stepped shards into every rank's parameters: a reduce-scatter and an
// all-gather move the bytes of one all-reduce, and each rank keeps 1/n of the moments.
// A parameter gathered in a dtype narrower than fp32 (bf16, the compute dtype, for parameters
// forward only reads cast to it) is held in that dtype from construction on, as Megatron's
// distributed optimizer holds bf16 parameters: the exact fp32 values live in this rank's
// pieces only (ShardPiece::master, what the optimizer steps), the parameter's .grad is still
// its fp32 bucket view (backward adds each bf16 gradient into it in fp32), and nothing casts
// it. Per parameter that is 2 + 4/n bytes of values instead of 4, and no per-step cast.
// gather_params(overlap = true) is Megatron's overlapped parameter gather: every bucket's
// all-gather starts at once (in the order forward reads them), those of parameters read in fp32
// (norms, routers: model::ParamUse::kFp32) are waited for there, and the rest are left in
// flight: a bucket's values are copied in when the next forward first reads one of its
// parameters (model::expect_values; to_compute waits for them), so the transfer overlaps the
// data loading, the encoders' forward, pipeline warm-up and the layers before. finish() (and
// finish_gather()) wait for whatever no forward read.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "weft/dist/comm.h"
#include "weft/model/layers.h"

namespace torch::autograd {
struct Node;
}

namespace weft::dist {

// How a parameter's gradient is summed over the group.
enum class Reduce : uint8_t {
  kAllReduce,     // every rank gets the whole sum
  kScatter,       // ZeRO-1: each rank gets the sum of its shard of the bucket
  kScatterAlone,  // the same, in a bucket of its own: its shard ranges then depend on its size
                  // only, and equal those of a copy in another group (a tied embedding's)
};

// ZeRO-1: a contiguous range of a sharded parameter's elements that this rank steps.
struct ShardPiece {
  size_t param = 0;               // index into the parameter list
  int64_t begin = 0, length = 0;  // of the parameter's elements, flattened
  // [length] fp32: where finish() leaves their summed gradient. Undefined in a whole-parameter
  // piece (train::AdamW's, and the runtime's for parameters not sharded), which reads .grad.
  at::Tensor grad;
  // [length] fp32: the exact values of these elements when the parameter is held narrower than
  // fp32 (the optimizer steps them here, gather_params() sends them rounded); undefined when the
  // parameter holds them itself.
  at::Tensor master;
};

class GradSync {
 public:
  // `how`: per parameter (empty: every one kAllReduce). `wire`: per sharded parameter, the dtype
  // gather_params() sends it in (empty: fp32); a narrower one (for parameters only ever used
  // cast to it) is the dtype the parameter is then held in, its exact values kept in this
  // rank's pieces' masters (the parameters are converted here, in place: every holder of the
  // tensor sees it). `use`: per parameter, how forward reads it (empty: every one kCast,
  // through to_compute); an overlapped gather waits for kFp32 ones at once. A group of one rank
  // reduces nothing and shards nothing.
  GradSync(Comm group, model::NamedTensors params, int64_t bucket_bytes = 4 << 20,
           std::vector<Reduce> how = {}, std::vector<at::ScalarType> wire = {},
           std::vector<model::ParamUse> use = {});
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
  // Buckets whose reduction started during backward in the last step (overlap achieved).
  int64_t buckets_overlapped() const { return overlapped_; }
  // Reduce-scatters in flight that hold a receive buffer of their whole bucket (Gloo's
  // all-to-all): at most kScatterBuffers.
  int64_t scatters_in_flight() const { return static_cast<int64_t>(scattering_.size()); }
  static constexpr size_t kScatterBuffers = 2;
  // ZeRO-1: whether parameter k is sharded, this rank's pieces (in bucket order; a parameter may
  // have none, or span two ranks' shards), and after the optimizer stepped them, every rank's
  // stepped pieces into every rank's parameters (two buckets' all-gathers in flight at a time).
  // Collective.
  bool sharded(size_t k) const { return group_.size() > 1 && buckets_[bucket_of_[k]].sharded; }
  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  void gather_params(bool overlap = false);
  // Waits for the gathers left in flight (local: no collective). Thread-safe.
  void finish_gather();
  // Seconds the host spent waiting for overlapped gathers' values since the last call (in
  // forward, and in finish_gather(): what the overlap did not hide; with NCCL only the host's
  // wait, as the device stream waits instead), and the buckets in flight.
  double take_gather_wait_seconds();
  int64_t gathers_in_flight() const;

 private:
  struct Bucket {
    std::vector<size_t> params;        // indices into params_
    int64_t numel = 0;                 // of its parameters
    bool sharded = false;              // reduce-scattered (ZeRO-1)
    at::ScalarType wire = at::kFloat;  // sharded: the dtype its parameters are gathered in
    int64_t shard = 0;                 // sharded: each rank's share of the (padded) buffer
    at::Tensor buffer;                 // fp32, flat (sharded: padded to `shard` x group size)
    std::vector<size_t> pieces;        // sharded: this rank's, indices into pieces_
    bool fp32_use = false;             // its parameters are read in fp32, not via to_compute
    int64_t ready = 0;
    bool launched = false;
    Pending pending;
    // Overlapped parameter gather: the all-gather in flight, and its model::expect_values entry.
    std::unique_ptr<PendingTensor> gathering;
    uint64_t arrival = 0;
  };
  void on_accumulated(size_t k);
  void launch(Bucket& b);
  PendingTensor start_gather(const Bucket& b);
  void take_gathered(const Bucket& b, const at::Tensor& all);  // every shard into the parameters
  void arrive(size_t bucket);        // waits for its gather in flight, if any, and takes it
  at::Tensor slice(size_t k) const;  // parameter k's part of its bucket, shaped as the parameter
  bool attached(size_t k) const;     // .grad is that part

  Comm group_;
  model::NamedTensors params_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;   // per parameter
  std::vector<int64_t> offset_of_;  // per parameter: where its slice starts in its bucket
  std::vector<uint8_t> filled_;     // per parameter: its bucket slice holds this step's gradient
  std::vector<ShardPiece> pieces_;
  size_t next_ = 0;  // the next bucket to launch (they launch in index order)
  // Per parameter: its AccumulateGrad node (held, so the hook lives as long as this object; the
  // parameter keeps only a weak reference) and the key of the hook on it.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hooks_;
  bool armed_ = false;             // any parameter armed this step
  std::vector<uint8_t> armed_of_;  // per parameter: its next accumulation completes its gradient
  int64_t overlapped_ = 0;
  std::deque<Bucket*> scattering_;  // launched, not waited for: see scatters_in_flight()
  // The overlapped gather's state: arrive() runs on whichever thread reads a parameter first.
  mutable std::mutex gather_mu_;
  double gather_wait_seconds_ = 0;
};

}  // namespace weft::dist
