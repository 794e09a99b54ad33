// Comm: one thin wrapper over c10d process groups, hiding the LibTorch 1.13 / 2.x differences and
// the 1.13 Gloo gaps (bf16 is reduced in fp32; reduce-scatter is emulated). CPU tensors go over
// Gloo. In a CUDA build connected with device collectives, CUDA tensors' collectives go over
// NCCL, and their point-to-point messages over Gloo through host memory.
//
// Between ranks of one host, the blocking collectives of CPU tensors (all_reduce_sum,
// all_reduce_max, all_gather, reduce_scatter_sum) go through shared memory (dist/shm.h) rather
// than Gloo's TCP loopback, unless the group was connected without (shared_memory = false); the
// *_async variants always use Gloo, whose transport threads let them run on while the caller
// computes. Point-to-point messages go through shared memory too in groups made to carry them
// (subgroup's `messages`, dist/messages.h), else over Gloo.
//
// Contract (as c10d's): every rank of a group calls its collectives in the same order with
// tensors of the same shape and dtype; calls block until the collective completes or the
// group's timeout expires, which throws weft::Error naming the operation. Comm objects are
// cheap handles; copies share the group. A default-constructed Comm is the trivial group of
// one rank (every collective is the identity), so single-process code needs no special case.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace weft::dist {

// Where this process sits in the job, read from the launcher's environment: RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun / weft launch); else OMPI_COMM_WORLD_RANK,
// OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK (mpirun); else SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID (srun). Absent variables mean a single process. Malformed values are errors
// naming the variable.
struct WorldInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};
WorldInfo world_from_env();

// A collective in flight (from an *_async call). wait() blocks until it completes and throws
// like the blocking calls; it must be called exactly once, before the tensor is read.
class Pending {
 public:
  Pending() = default;
  explicit Pending(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait() {
    if (wait_) std::exchange(wait_, nullptr)();
  }

 private:
  std::function<void()> wait_;
};

// A collective's result in flight: wait() blocks until it is complete and returns it (the same
// tensor if called again).
class PendingTensor {
 public:
  explicit PendingTensor(at::Tensor ready) : value_(std::move(ready)) {}
  explicit PendingTensor(std::function<at::Tensor()> finish) : finish_(std::move(finish)) {}
  at::Tensor wait() {
    if (finish_) value_ = std::exchange(finish_, nullptr)();
    return value_;
  }

 private:
  std::function<at::Tensor()> finish_;
  at::Tensor value_;
};

class Comm {
 public:
  Comm();  // the single-rank group

  // Rendezvous over a TCP store hosted by rank 0 at master_addr:master_port. A rank that does
  // not arrive within `timeout` ends every waiting rank with an error. device_collectives: this
  // group and its subgroups also get an NCCL group for CUDA tensors (a CUDA build only; the
  // caller has set this process's device). Without one, CUDA tensors' collectives go through
  // host memory over Gloo (as point-to-point messages always do).
  // shared_memory: blocking CPU collectives through shared memory where every rank of a group
  // (and of its subgroups) is on one host (train.shared_memory_collectives).
  static Comm connect(const WorldInfo& world, std::chrono::milliseconds timeout,
                      bool device_collectives = false, bool shared_memory = true);
  // In-process groups for tests: one thread per rank, all calling with the same `store_key`.
  static Comm in_memory(const std::string& store_key, int rank, int size,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60),
                        bool shared_memory = true);

  int rank() const;
  int size() const;
  // Whether this group's blocking CPU collectives go through shared memory (the same on every
  // rank of the group).
  bool shared_memory() const;

  // Whether this group's point-to-point messages go through shared memory (the same on every
  // rank of the group).
  bool shared_memory_messages() const;

  // A group of the given ranks of this group (ascending, unique). Collective over *this* group:
  // every rank calls it with the same list; non-members get the single-rank group back.
  // messages: where the group's blocking collectives go through shared memory, its point-to-point
  // messages do too (each ordered pair of ranks gets a ring; 16 MiB of /dev/shm in all).
  Comm subgroup(const std::vector<int>& ranks, bool messages = false) const;

  void all_reduce_sum(at::Tensor& t) const;  // in place; contiguous
  // Non-blocking variant (overlapping communication with compute): `t` holds the sum once the
  // Pending is waited. 2-byte floats go through an fp32 copy on Gloo, copied back at wait.
  Pending all_reduce_sum_async(at::Tensor& t) const;
  void all_reduce_max(at::Tensor& t) const;
  void broadcast(at::Tensor& t, int root) const;  // in place
  // Concatenation of every rank's tensor along dim 0 (same shape on every rank).
  at::Tensor all_gather(const at::Tensor& t) const;
  PendingTensor all_gather_async(const at::Tensor& t) const;
  // Every rank's string, in rank order (lengths may differ).
  std::vector<std::string> all_gather_strings(const std::string& s) const;
  // Sum over ranks, then rank r keeps chunk r of dim 0 (dim 0 divisible by size()): NCCL's own
  // reduce-scatter for a device tensor, else (Gloo has none in LibTorch 1.13) an all-to-all that
  // brings chunk r of every rank to rank r, summed there at wait().
  at::Tensor reduce_scatter_sum(const at::Tensor& t) const;
  PendingTensor reduce_scatter_sum_async(const at::Tensor& t) const;
  // Whether reduce_scatter_sum_async(t) holds a receive buffer as large as t until waited for
  // (the all-to-all's, not NCCL's).
  bool reduce_scatter_buffers_whole(const at::Tensor& t) const;
  // All-to-all with uneven splits along dim 0: the first send_counts[0] rows of `t` go to rank 0,
  // the next send_counts[1] to rank 1, ...; returns the rows received, in source-rank order
  // (recv_counts[r] of them from rank r). Every rank's recv_counts[r] must equal rank r's
  // send_counts[this rank] (exchange the counts first). Any dtype (moved as bytes).
  at::Tensor all_to_all(const at::Tensor& t, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts) const;
  void barrier() const;

  // Point-to-point between ranks of this group. send() does not block: the Pending holds the
  // tensor and must be waited (before the job's next step at the latest). recv() blocks until a
  // matching send (same tag) from `src` fills `t`, which must be contiguous and of the sent
  // shape and dtype. Messages with the same (src, tag) arrive in order.
  Pending send(const at::Tensor& t, int dst, int tag) const;
  void recv(at::Tensor& t, int src, int tag) const;
  // recv() posted now, filled by the time the Pending is waited (it must be, before `t` is read).
  // Posting a receive before its send arrives matters on Gloo: a send whose receive is not yet
  // posted waits for the receiver's "ready" notice, which the sender's transport thread answers
  // only when it gets a core — on a busy machine a scheduler time slice later.
  Pending irecv(at::Tensor& t, int src, int tag) const;

  struct Impl;  // defined in comm.cpp (holds the c10d store and process group)

 private:
  std::shared_ptr<Impl> impl_;
};

// Seconds the calling thread has spent blocked in collectives (all-reduce, all-gather,
// reduce-scatter, broadcast, all-to-all) since it started: a host clock. With Gloo that is the
// collectives' time as the rank saw it (transfer and waiting for peers); a NCCL collective
// blocks no host thread.
double blocked_seconds();

}  // namespace weft::dist
