// Activation recomputation (gradient checkpointing), block by block: forward keeps only a
// block's input; backward runs the block again with grad enabled and differentiates that.
// Less activation memory (one [B, S, hidden] input per block instead of every intermediate)
// for about one more forward of compute.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "weft/model/layers.h"
#include "weft/model/llm.h"

namespace weft::model {

// A block as a function of its input and of its parameter tensors.
using BlockFn =
    std::function<at::Tensor(const at::Tensor& x, const std::vector<at::Tensor>& params)>;

// block(x, params), keeping only x (and references to params) for backward, where the block runs
// again. The recompute sees detached aliases of x and of params (requiring grad as they do), so
// gradients leave it only through this node: each parameter's AccumulateGrad and its hooks (the
// data-parallel gradient sync) run once, as without recomputation. `params` must hold every
// tensor the block takes a gradient for (block_params below), and `block` must use them, not
// tensors it captured: a captured parameter would get no gradient.
//
// Contract: `block` is deterministic (no dropout) and holds its captures by value (it runs
// again after the caller returns). Backward may run on another thread: the forward's compute
// dtype is re-established there. Collectives inside the block (TP, CP) run again in backward;
// every rank of a group recomputes the same blocks in the same order, as it runs the same
// backward graph. Without grad mode, or when neither x nor any parameter requires grad, this is
// block(x, params).
at::Tensor recompute(const BlockFn& block, const at::Tensor& x,
                     const std::vector<at::Tensor>& params);

// True while backward runs a block again (on this thread): code that counts statistics in
// forward skips the second pass.
bool recomputing();

// A block's defined parameter tensors in a fixed order, and a copy of the block holding
// `params` (in that order) instead.
std::vector<at::Tensor> block_params(const LlmBlock& b);
std::vector<at::Tensor> block_params(const EncoderBlock& b);
LlmBlock with_params(LlmBlock b, const std::vector<at::Tensor>& params);
EncoderBlock with_params(EncoderBlock b, const std::vector<at::Tensor>& params);

}  // namespace weft::model
