// AdamW over fp32 master parameters, the LR schedule (linear warm-up, cosine decay to min_lr),
// and global gradient-norm clipping.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/dist/comm.h"
#include "weft/dist/data_parallel.h"
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
// ZeRO-1: with `pieces` given, only those ranges of the parameters have state and are stepped
// here, each with the gradient its piece names (a whole-parameter piece without one reads
// .grad), and in its master where it has one (a parameter held in bf16); the other ranks of the
// group step the rest (dist::GradSync::pieces).
class AdamW {
 public:
  AdamW(model::NamedTensors params, AdamWOptions opts, std::vector<dist::ShardPiece> pieces = {});
  // One update at learning rate lr, with every gradient multiplied by grad_scale (clipping).
  // The fused CUDA path may leave the scaled gradient in .grad (the trainer resets grads after).
  void step(double lr, double grad_scale = 1.0);
  // The same update with its gradient factor and a skip flag as 0-dim tensors (double, bool),
  // which may still be computed on the device: the fused CUDA path reads both there (the host
  // does not wait); where `skip` is true it leaves parameters and moments untouched. Other
  // parameters read them on the host. steps() counts the step either way.
  void step(double lr, const at::Tensor& grad_scale, const at::Tensor& skip);
  int64_t steps() const { return steps_; }
  // Reads the flattened elements [begin, begin + length) of moment `key` ("exp_avg.<param>" or
  // "exp_avg_sq.<param>") of parameter `param` (this optimizer's index), as a 1-D tensor.
  using StateReader = std::function<at::Tensor(size_t param, const std::string& key, int64_t begin,
                                               int64_t length)>;
  // Takes each piece's state by reading just its range (a resume reads no more than it holds).
  void load_state(const StateReader& read, int64_t steps);
  // The moments per parameter, shaped as it: zeros outside this rank's pieces, undefined where
  // it has none.
  std::vector<at::Tensor> exp_avg() const { return whole(exp_avg_); }
  std::vector<at::Tensor> exp_avg_sq() const { return whole(exp_avg_sq_); }
  // The moments as held, one per piece (in the pieces' order): flat for a range of a parameter,
  // shaped as the parameter for a whole one.
  const std::vector<at::Tensor>& exp_avg_pieces() const { return exp_avg_; }
  const std::vector<at::Tensor>& exp_avg_sq_pieces() const { return exp_avg_sq_; }

 private:
  struct FusedGroup {  // one device's parameters of one decay group
    std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq;
  };
  // grad_scale: a double on the host or a 0-dim tensor on the device (then `skip` too).
  void fused_step(FusedGroup& f, double weight_decay, double lr, double grad_scale,
                  const at::Tensor& scale_on_device, const at::Tensor& skip_on_device);
  void update(double lr, double grad_scale, const at::Tensor& scale_t, const at::Tensor& skip_t);
  std::vector<at::Tensor> whole(const std::vector<at::Tensor>& per_piece) const;
  // The fp32 values a piece steps: its master, or the parameter's elements (flat), or the whole
  // parameter.
  at::Tensor stepped(const dist::ShardPiece& piece) const;

  model::NamedTensors params_;
  std::vector<dist::ShardPiece> pieces_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;  // per piece
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
