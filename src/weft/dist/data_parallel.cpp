#include "weft/dist/data_parallel.h"

#include <torch/torch.h>

#include <numeric>

#include "weft/core/error.h"

namespace weft::dist {

GradSync::GradSync(Comm group, model::NamedTensors params, int64_t bucket_bytes)
    : group_(std::move(group)), params_(std::move(params)) {
  bucket_of_.resize(params_.size());
  filled_.assign(params_.size(), 0);
  int64_t bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    if (buckets_.empty() || bytes >= bucket_bytes) {
      buckets_.emplace_back();
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    b.offsets.push_back(bytes / static_cast<int64_t>(sizeof(float)));
    b.params.push_back(k);
    bucket_of_[k] = buckets_.size() - 1;
    bytes += params_[k].second.numel() * static_cast<int64_t>(sizeof(float));
  }
  if (group_.size() == 1) return;
  for (Bucket& b : buckets_) {
    int64_t numel = 0;
    for (size_t k : b.params) numel += params_[k].second.numel();
    b.buffer = torch::zeros({numel}, params_[b.params[0]].second.options().dtype(torch::kFloat));
  }
  for (size_t k = 0; k < params_.size(); ++k)
    hooks_.push_back(params_[k].second.register_hook([this, k](const at::Tensor& g) {
      if (armed_) on_grad(k, g);
      return at::Tensor();  // leave the gradient as it is
    }));
}

GradSync::~GradSync() {
  for (size_t k = 0; k < hooks_.size(); ++k) params_[k].second.remove_hook(hooks_[k]);
}

void GradSync::arm() {
  armed_ = group_.size() > 1;
  overlapped_ = 0;
}

void GradSync::on_grad(size_t k, const at::Tensor& incoming) {
  torch::NoGradGuard no_grad;
  Bucket& b = buckets_[bucket_of_[k]];
  const at::Tensor& p = params_[k].second;
  const size_t slot = std::find(b.params.begin(), b.params.end(), k) - b.params.begin();
  at::Tensor dst = b.buffer.narrow(0, b.offsets[slot], p.numel());
  // .grad still holds the earlier microbatches' sum; autograd adds `incoming` after this hook.
  if (p.grad().defined())
    torch::add_out(dst, p.grad().reshape(-1), incoming.reshape(-1));
  else
    dst.copy_(incoming.reshape(-1));
  if (!filled_[k]) {
    filled_[k] = 1;
    ++b.ready;
    // Buckets launch in index order only, as DDP's reducer does: a rank where some parameter
    // got no gradient (an encoder skipped for a microbatch without items, a block built but
    // unused) launches the rest in finish(), and every rank must issue the same sequence of
    // collectives.
    while (next_ < buckets_.size() &&
           buckets_[next_].ready == static_cast<int64_t>(buckets_[next_].params.size())) {
      launch(buckets_[next_++]);
      ++overlapped_;
    }
  }
}

void GradSync::launch(Bucket& b) {
  b.launched = true;
  b.pending = group_.all_reduce_sum_async(b.buffer);
}

void GradSync::finish() {
  if (group_.size() == 1) return;
  torch::NoGradGuard no_grad;
  if (!armed_) overlapped_ = 0;               // nothing could start during backward
  for (; next_ < buckets_.size(); ++next_) {  // the rest, in index order
    Bucket& b = buckets_[next_];
    WEFT_ASSERT(!b.launched);
    for (size_t slot = 0; slot < b.params.size(); ++slot) {
      const size_t k = b.params[slot];
      if (filled_[k]) continue;
      const at::Tensor& p = params_[k].second;
      at::Tensor dst = b.buffer.narrow(0, b.offsets[slot], p.numel());
      if (p.grad().defined())
        dst.copy_(p.grad().reshape(-1));
      else
        dst.zero_();
    }
    launch(b);
  }
  for (Bucket& b : buckets_) {
    b.pending.wait();
    for (size_t slot = 0; slot < b.params.size(); ++slot) {
      const at::Tensor& p = params_[b.params[slot]].second;
      at::Tensor summed = b.buffer.narrow(0, b.offsets[slot], p.numel()).view(p.sizes());
      if (p.grad().defined())
        p.mutable_grad().copy_(summed);
      else
        p.mutable_grad() = summed.clone();
    }
    b.ready = 0;
    b.launched = false;
  }
  std::fill(filled_.begin(), filled_.end(), 0);
  next_ = 0;
  armed_ = false;
}

std::vector<int> partition_parameters(const model::NamedTensors& params, int ranks) {
  WEFT_CHECK(ranks >= 1, "partition_parameters: ranks must be >= 1");
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return params[a].second.numel() > params[b].second.numel();
  });
  std::vector<int64_t> load(static_cast<size_t>(ranks), 0);
  std::vector<int> owner(params.size(), 0);
  for (size_t k : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[k] = r;
    load[r] += params[k].second.numel();
  }
  return owner;
}

void broadcast_from_owners(const Comm& group, const model::NamedTensors& params,
                           const std::vector<int>& owner) {
  if (group.size() == 1) return;
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor t = params[k].second.detach();
    group.broadcast(t, owner[k]);
  }
}

}  // namespace weft::dist
