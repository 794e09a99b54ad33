#include "weft/dist/data_parallel.h"

#include <torch/torch.h>

namespace weft::dist {

GradSync::GradSync(Comm group, model::NamedTensors params, int64_t bucket_bytes)
    : group_(std::move(group)), params_(std::move(params)) {
  // Reverse creation order approximates the order in which backward produces gradients.
  int64_t bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    if (buckets_.empty() || bytes >= bucket_bytes) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().push_back(k);
    bytes += params_[k].second.numel() * static_cast<int64_t>(sizeof(float));
  }
}

void GradSync::sync() {
  if (group_.size() == 1) return;
  torch::NoGradGuard no_grad;
  for (const auto& bucket : buckets_) {
    std::vector<at::Tensor> flat;
    for (size_t k : bucket) {
      const at::Tensor& p = params_[k].second;
      flat.push_back(p.grad().defined() ? p.grad().reshape(-1).to(at::kFloat)
                                        : torch::zeros({p.numel()}, torch::kFloat));
    }
    at::Tensor buffer = torch::cat(flat);
    group_.all_reduce_sum(buffer);
    int64_t offset = 0;
    for (size_t k : bucket) {
      const at::Tensor& p = params_[k].second;
      at::Tensor summed = buffer.narrow(0, offset, p.numel()).view(p.sizes());
      if (p.grad().defined())
        p.mutable_grad().copy_(summed);
      else
        p.mutable_grad() = summed.clone();
      offset += p.numel();
    }
  }
}

void GradSync::broadcast_parameters(const Comm& group, const model::NamedTensors& params) {
  if (group.size() == 1) return;
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : params) {
    at::Tensor t = p.detach();
    group.broadcast(t, 0);
  }
}

}  // namespace weft::dist
