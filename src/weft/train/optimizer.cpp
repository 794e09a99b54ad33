#include "weft/train/optimizer.h"

#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <map>
#include <utility>

#include "weft/core/error.h"
#include "weft/model/fused.h"

namespace weft::train {

namespace {
constexpr bool kHasFusedAdamW = TORCH_VERSION_MAJOR >= 2;
constexpr const char* kMomentKinds[2] = {"exp_avg.", "exp_avg_sq."};  // as checkpoints name them
}  // namespace

AdamW::AdamW(model::NamedTensors params, AdamWOptions opts, std::vector<dist::ShardPiece> pieces)
    : params_(std::move(params)), pieces_(std::move(pieces)), opts_(opts) {
  if (pieces_.empty())
    for (size_t k = 0; k < params_.size(); ++k)
      pieces_.push_back({k, 0, params_[k].second.numel(), {}, {}});
  for (const dist::ShardPiece& p : pieces_) {
    WEFT_ASSERT(p.param < params_.size());
    const at::Tensor like = stepped(p);
    WEFT_ASSERT(like.scalar_type() == at::kFloat, "AdamW: '", params_[p.param].first,
                "' is held in ", like.scalar_type(), " without an fp32 master");
    exp_avg_.push_back(torch::zeros_like(like));
    exp_avg_sq_.push_back(torch::zeros_like(like));
  }
}

at::Tensor AdamW::stepped(const dist::ShardPiece& piece) const {
  if (piece.master.defined()) return piece.master;
  const at::Tensor& param = params_[piece.param].second;
  if (!piece.grad.defined()) return param;  // a whole parameter
  return param.detach().view({-1}).narrow(0, piece.begin, piece.length);
}

void AdamW::step(double lr, double grad_scale) { update(lr, grad_scale, {}, {}); }

void AdamW::step(double lr, const at::Tensor& grad_scale, const at::Tensor& skip) {
  WEFT_ASSERT(grad_scale.defined() && skip.defined());
  update(lr, 1.0, grad_scale, skip);
}

void AdamW::update(double lr, double grad_scale, const at::Tensor& scale_t,
                   const at::Tensor& skip_t) {
  ++steps_;
  model::AdamWUpdate u;
  u.lr = lr;
  u.beta1 = opts_.beta1;
  u.beta2 = opts_.beta2;
  u.eps = opts_.eps;
  u.bc1 = 1.0 - std::pow(opts_.beta1, static_cast<double>(steps_));
  u.bc2 = 1.0 - std::pow(opts_.beta2, static_cast<double>(steps_));
  torch::NoGradGuard no_grad;
  // CUDA fp32 tensors: LibTorch's multi-tensor fused AdamW (one kernel family per device and
  // decay group, as torch.optim.AdamW(fused=True)), the same update as model::adamw_update.
  std::map<std::pair<int, bool>, FusedGroup> fused;
  // Each piece's parameter elements and gradient (a part of a parameter: flat views).
  std::vector<at::Tensor> ps(pieces_.size()), gs(pieces_.size());
  std::vector<size_t> rest;  // the others: model::adamw_update
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const dist::ShardPiece& piece = pieces_[i];
    const at::Tensor& param = params_[piece.param].second;
    const at::Tensor& p = ps[i] = stepped(piece);
    const at::Tensor& g = gs[i] = piece.grad.defined() ? piece.grad : param.grad();
    if (!g.defined()) continue;
    WEFT_ASSERT(exp_avg_[i].sizes() == p.sizes() && g.numel() == p.numel(), "AdamW: piece of '",
                params_[piece.param].first, "' shaped ", p.sizes(), ", its moments ",
                exp_avg_[i].sizes(), ", its gradient ", g.sizes());
    const bool decays = opts_.weight_decay > 0 && param.dim() >= 2;
    if (kHasFusedAdamW && p.is_cuda() && p.scalar_type() == at::kFloat &&
        g.scalar_type() == at::kFloat && g.device() == p.device() && p.is_contiguous() &&
        !g.is_sparse() && g.strides() == p.strides() && exp_avg_[i].strides() == p.strides() &&
        exp_avg_sq_[i].strides() == p.strides()) {
      FusedGroup& f = fused[{p.device().index(), decays}];
      f.params.push_back(p);
      f.grads.push_back(g);
      f.exp_avg.push_back(exp_avg_[i]);
      f.exp_avg_sq.push_back(exp_avg_sq_[i]);
      continue;
    }
    rest.push_back(i);
  }
  if (!rest.empty() && scale_t.defined()) {  // these read the factor and the flag on the host
    if (skip_t.item<bool>()) rest.clear();
    grad_scale = scale_t.item<double>();
  }
  u.grad_scale = grad_scale;
  for (size_t i : rest) {
    const bool decays = opts_.weight_decay > 0 && params_[pieces_[i].param].second.dim() >= 2;
    u.decay = decays ? 1.0 - lr * opts_.weight_decay : 1.0;
    model::adamw_update(ps[i], gs[i], exp_avg_[i], exp_avg_sq_[i], u);
  }
  for (auto& [key, f] : fused)
    fused_step(f, key.second ? opts_.weight_decay : 0.0, lr, grad_scale, scale_t, skip_t);
}

void AdamW::fused_step(FusedGroup& f, double weight_decay, double lr, double grad_scale,
                       const at::Tensor& scale_t, const at::Tensor& skip_t) {
#if TORCH_VERSION_MAJOR >= 2
  const at::TensorOptions on = f.params[0].options().dtype(at::kFloat);
  // The kernel reads the step count (for the bias corrections) from device memory, and divides
  // the gradients by grad_scale (AMP's unscaling): clipping's factor goes in as its inverse.
  // found_inf = 1 (AMP's overflow flag) makes it leave everything as it was.
  const at::Tensor step = at::scalar_tensor(static_cast<double>(steps_), on);
  const std::vector<at::Tensor> steps(f.params.size(), step);
  c10::optional<at::Tensor> unscale, found_inf;
  if (scale_t.defined()) {
    unscale = scale_t.reciprocal().to(on);
    found_inf = skip_t.to(on);
  } else if (grad_scale != 1.0) {
    unscale = at::scalar_tensor(1.0 / grad_scale, on);
  }
  at::_fused_adamw_(f.params, f.grads, f.exp_avg, f.exp_avg_sq, {}, steps, lr, opts_.beta1,
                    opts_.beta2, weight_decay, opts_.eps, /*amsgrad=*/false, /*maximize=*/false,
                    unscale, found_inf);
#else
  WEFT_ASSERT(false, "fused AdamW needs LibTorch 2");
#endif
}

std::vector<at::Tensor> AdamW::whole(const std::vector<at::Tensor>& per_piece) const {
  std::vector<at::Tensor> out(params_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const dist::ShardPiece& p = pieces_[i];
    at::Tensor& t = out[p.param];
    if (!t.defined()) t = torch::zeros_like(params_[p.param].second, at::kFloat);
    t.view({-1}).narrow(0, p.begin, p.length).copy_(per_piece[i].reshape({-1}));
  }
  return out;
}

void AdamW::load_state(const StateReader& read, int64_t steps) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const dist::ShardPiece& p = pieces_[i];
    std::vector<at::Tensor>* held[2] = {&exp_avg_, &exp_avg_sq_};
    for (int j = 0; j < 2; ++j) {
      const std::string key = kMomentKinds[j] + params_[p.param].first;
      const at::Tensor value = read(p.param, key, p.begin, p.length);
      WEFT_CHECK(value.numel() == p.length, "optimizer state: '", key, "' gave ", value.numel(),
                 " elements for a piece of ", p.length);
      (*held[j])[i].view({-1}).copy_(value.reshape({-1}));
    }
  }
  steps_ = steps;
}

double lr_at(const TrainSpec& t, int64_t step) {
  if (t.warmup > 0 && step < t.warmup)
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup);
  const double span = static_cast<double>(std::max<int64_t>(t.steps - t.warmup, 1));
  const double progress = std::min(1.0, static_cast<double>(step - t.warmup) / span);
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * progress));
}

double clip_scale(double norm, double max_norm) {
  return max_norm > 0 && std::isfinite(norm) && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
}

at::Tensor clip_scale(const at::Tensor& norm, double max_norm) {
  const at::Tensor one = at::ones_like(norm);
  if (!(max_norm > 0)) return one;
  const at::Tensor clipped = at::full_like(norm, max_norm).div(norm + 1e-6);
  return at::where(at::isfinite(norm).logical_and(norm > max_norm), clipped, one);
}

}  // namespace weft::train
