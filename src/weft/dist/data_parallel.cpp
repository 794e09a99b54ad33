#include "weft/dist/data_parallel.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "weft/core/error.h"

namespace weft::dist {
namespace {

// Runs `f` after its AccumulateGrad node has added a backward's gradient into .grad.
struct PostHook final : torch::autograd::FunctionPostHook {
  explicit PostHook(std::function<void()> f) : f(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    f();
    return outputs;
  }
  std::function<void()> f;
};

}  // namespace

GradSync::GradSync(Comm group, model::NamedTensors params, int64_t bucket_bytes)
    : group_(std::move(group)), params_(std::move(params)) {
  bucket_of_.resize(params_.size());
  offset_of_.resize(params_.size());
  filled_.assign(params_.size(), 0);
  armed_of_.assign(params_.size(), 0);
  int64_t bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    if (buckets_.empty() || bytes >= bucket_bytes) {
      buckets_.emplace_back();
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    b.params.push_back(k);
    bucket_of_[k] = buckets_.size() - 1;
    offset_of_[k] = bytes / static_cast<int64_t>(sizeof(float));
    bytes += params_[k].second.numel() * static_cast<int64_t>(sizeof(float));
  }
  if (group_.size() == 1) return;
  for (Bucket& b : buckets_) {
    int64_t numel = 0;
    for (size_t k : b.params) numel += params_[k].second.numel();
    b.buffer = torch::zeros({numel}, params_[b.params[0]].second.options().dtype(torch::kFloat));
  }
  for (size_t k = 0; k < params_.size(); ++k) {
    accumulators_.push_back(torch::autograd::impl::grad_accumulator(params_[k].second));
    hooks_.push_back(accumulators_.back()->add_post_hook(std::make_unique<PostHook>([this, k] {
      if (armed_of_[k]) on_accumulated(k);
    })));
  }
}

GradSync::~GradSync() {
  for (size_t k = 0; k < hooks_.size(); ++k) accumulators_[k]->del_post_hook(hooks_[k]);
}

at::Tensor GradSync::slice(size_t k) const {
  const at::Tensor& p = params_[k].second;
  return buckets_[bucket_of_[k]].buffer.narrow(0, offset_of_[k], p.numel()).view(p.sizes());
}

bool GradSync::attached(size_t k) const {
  const at::Tensor& g = params_[k].second.grad();
  return g.defined() && g.data_ptr() == slice(k).data_ptr() && g.is_contiguous();
}

void GradSync::attach() {
  if (group_.size() == 1) return;
  torch::NoGradGuard no_grad;
  for (Bucket& b : buckets_) b.buffer.zero_();
  for (size_t k = 0; k < params_.size(); ++k) {
    if (attached(k)) continue;
    at::Tensor view = slice(k);
    const at::Tensor& p = params_[k].second;
    if (p.grad().defined()) view.copy_(p.grad());
    p.mutable_grad() = view;
  }
}

void GradSync::arm() { arm(std::vector<bool>(params_.size(), true)); }

void GradSync::arm(const std::vector<bool>& which) {
  WEFT_ASSERT(which.size() == params_.size(), "arm: ", which.size(), " flags for ", params_.size(),
              " parameters");
  if (group_.size() == 1) return;
  if (!armed_) overlapped_ = 0;
  armed_ = true;
  for (size_t k = 0; k < which.size(); ++k)
    if (which[k]) armed_of_[k] = 1;
}

void GradSync::on_accumulated(size_t k) {
  torch::NoGradGuard no_grad;
  // .grad holds every microbatch's sum now: in the bucket already when attached.
  if (!attached(k)) slice(k).copy_(params_[k].second.grad());
  Bucket& b = buckets_[bucket_of_[k]];
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
    for (size_t k : b.params) {
      if (filled_[k] || attached(k)) continue;
      const at::Tensor& p = params_[k].second;
      if (p.grad().defined())
        slice(k).copy_(p.grad());
      else
        slice(k).zero_();
    }
    launch(b);
  }
  for (Bucket& b : buckets_) {
    b.pending.wait();
    for (size_t k : b.params) {
      if (attached(k)) continue;
      at::Tensor& g = params_[k].second.mutable_grad();
      if (g.defined())
        g.copy_(slice(k));
      else
        g = slice(k).clone();
    }
    b.ready = 0;
    b.launched = false;
  }
  std::fill(filled_.begin(), filled_.end(), 0);
  std::fill(armed_of_.begin(), armed_of_.end(), 0);
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
