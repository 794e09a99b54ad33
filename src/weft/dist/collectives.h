// Collectives as autograd functions (Megatron's mappings): each backward is the adjoint of its
// forward, so tensor- and context-parallel layers differentiate exactly like one process.
// A group of one rank makes each of them the identity (no autograd node is added).
//
// Every rank of the group must call the same functions in the same order, in forward and in
// backward (as with any c10d collective). The group is held by the autograd graph.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "weft/dist/comm.h"

namespace weft::dist {

// Forward identity, backward all-reduce (sum): a replicated tensor enters a parallel region.
at::Tensor copy_to(const at::Tensor& x, const Comm& group);
// Forward all-reduce (sum), backward identity: partial sums leave a row-parallel region.
at::Tensor reduce_from(const at::Tensor& x, const Comm& group);
// Forward all-gather along `dim` (rank order), backward reduce-scatter (sum, own chunk back):
// context parallelism's K/V exchange, whose dK/dV return to the ranks that own the tokens.
at::Tensor gather_along(const at::Tensor& x, const Comm& group, int64_t dim);

// Forward all-gather along `dim`, backward this rank's chunk of the gradient (no sum): for a
// gathered tensor every rank then uses identically (replicated downstream), such as an
// encoder's context-parallel output going on to the projector and the bridge.
at::Tensor gather_replicated(const at::Tensor& x, const Comm& group, int64_t dim);

// The inverse of gather_replicated: forward this rank's chunk along `dim` (divisible by the group
// size), backward the all-gather of every rank's chunk gradient (the input is replicated, so
// each rank gets the whole gradient).
at::Tensor split_replicated(const at::Tensor& x, const Comm& group, int64_t dim);

// Sequence parallelism (Megatron-LM's), between a module's tensor-parallel regions, where each
// rank holds 1/tp of the sequence along `dim`:
// Forward reduce-scatter along `dim` (sum of the partial outputs, this rank's chunk), backward
// all-gather: a row-parallel linear's output returning to the sequence-split region.
at::Tensor scatter_along(const at::Tensor& x, const Comm& group, int64_t dim);
// A column-parallel linear: at::linear(x, w, b) on this rank's output features (b may be
// undefined). Without sequence parallelism (sequence_dim < 0) x is replicated over the group and
// its gradient, each rank's a partial sum over its output features, is all-reduced. With it, x is
// this rank's chunk of the sequence along `sequence_dim` (>= 0), all-gathered first; backward
// all-gathers it again for the weight gradient (only the chunk is kept) and reduce-scatters the
// input gradient. Backward overlaps each collective with a matmul, as Megatron-LM's
// LinearWithGradAccumulationAndAsyncCommunication: x's all-gather with the input gradient's
// matmul, the input gradient's reduction with the weight gradient's.
at::Tensor column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                         const Comm& group, int64_t sequence_dim = -1);
// Whether column_linear's backward overlaps (default true; train.overlap_tp_comm). Off, it waits
// for each collective where it is issued: the same results, for measuring what overlap gains.
// A group whose blocking collectives go through shared memory (Comm::shared_memory()) does not
// overlap: the copies are the computing core's own work.
// Process-wide: backward may run on another thread (an autograd device thread).
void set_overlap_tp_comm(bool overlap);

// Forward all-to-all of rows (Comm::all_to_all: send_counts[r] rows to rank r, recv_counts[r]
// from it), backward the all-to-all of the gradient rows back to where they came from (counts
// swapped): expert parallelism's token dispatch and combine.
at::Tensor all_to_all(const at::Tensor& x, const Comm& group, std::vector<int64_t> send_counts,
                      std::vector<int64_t> recv_counts);

}  // namespace weft::dist
