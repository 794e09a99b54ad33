// AdamW over fp32 master parameters, the LR schedule (linear warm-up, cosine decay to min_lr),
// and global gradient-norm clipping.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "weft/core/spec.h"
#include "weft/dist/comm.h"
#include "weft/model/layers.h"

namespace weft::train {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.01;
};

// Owns the moment estimates of `params` (parameters that require grad). Weight decay applies
// to matrices only (dim >= 2), not to norms and biases. A parameter without a grad this step is
// left untouched (its moments too). CPU tensors take model::adamw_update; CUDA fp32 tensors
// LibTorch's multi-tensor fused AdamW (LibTorch 2), the same update.
//
// ZeRO-1: with `owned` given, only parameters with owned[k] have state and are stepped here;
// the others are stepped by their owner rank (see dist::partition_parameters).
class AdamW {
 public:
  AdamW(model::NamedTensors params, AdamWOptions opts, std::vector<bool> owned = {});
  // One update at learning rate lr, with every gradient multiplied by grad_scale (clipping).
  // The fused CUDA path may leave the scaled gradient in .grad (the trainer resets grads after).
  void step(double lr, double grad_scale = 1.0);
  // The same update with its gradient factor and a skip flag as 0-dim tensors (double, bool),
  // which may still be computed on the device: the fused CUDA path reads both there (the host
  // does not wait); where `skip` is true it leaves parameters and moments untouched. Other
  // parameters read them on the host. steps() counts the step either way.
  void step(double lr, const at::Tensor& grad_scale, const at::Tensor& skip);
  int64_t steps() const { return steps_; }
  bool owns(size_t k) const { return owned_[k]; }
  // State of the owned parameters as named tensors ("exp_avg.<param>", "exp_avg_sq.<param>").
  model::NamedTensors state() const;
  // Takes the owned parameters' state from a full (or owned-only) state; a tensor that names no
  // parameter of this optimizer, or a missing owned one, is an error.
  void load_state(const model::NamedTensors& state, int64_t steps);
  // The moments per parameter (undefined where not owned).
  const std::vector<at::Tensor>& exp_avg() const { return exp_avg_; }
  const std::vector<at::Tensor>& exp_avg_sq() const { return exp_avg_sq_; }

 private:
  struct FusedGroup {  // one device's parameters of one decay group
    std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq;
  };
  // grad_scale: a double on the host or a 0-dim tensor on the device (then `skip` too).
  void fused_step(FusedGroup& f, double weight_decay, double lr, double grad_scale,
                  const at::Tensor& scale_on_device, const at::Tensor& skip_on_device);
  void update(double lr, double grad_scale, const at::Tensor& scale_t, const at::Tensor& skip_t);

  model::NamedTensors params_;
  std::vector<bool> owned_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  AdamWOptions opts_;
  int64_t steps_ = 0;
};

// Learning rate for optimizer step `step` (0-based).
double lr_at(const TrainSpec& t, int64_t step);

// Global gradient-norm clipping: the factor max_norm / (norm + 1e-6) when norm > max_norm > 0,
// else 1 (the optimizer applies it while it reads the gradients).
double clip_scale(double norm, double max_norm);
// The same on a 0-dim double tensor where it lives (a device: queued, not read).
at::Tensor clip_scale(const at::Tensor& norm, double max_norm);

}  // namespace weft::train
