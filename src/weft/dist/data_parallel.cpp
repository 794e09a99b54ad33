#include "weft/dist/data_parallel.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>

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

GradSync::GradSync(Comm group, model::NamedTensors params, int64_t bucket_bytes,
                   std::vector<Reduce> how, std::vector<at::ScalarType> wire,
                   std::vector<model::ParamUse> use)
    : group_(std::move(group)), params_(std::move(params)) {
  if (how.empty()) how.assign(params_.size(), Reduce::kAllReduce);
  if (wire.empty()) wire.assign(params_.size(), at::kFloat);
  if (use.empty()) use.assign(params_.size(), model::ParamUse::kCast);
  WEFT_ASSERT(
      how.size() == params_.size() && wire.size() == params_.size() && use.size() == params_.size(),
      "GradSync: ", how.size(), " reductions, ", wire.size(), " dtypes and ", use.size(),
      " uses for ", params_.size(), " parameters");
  for (size_t k = 0; k < params_.size(); ++k)  // a narrow wire holds the parameter so: read cast
    WEFT_ASSERT(wire[k] == at::kFloat || use[k] == model::ParamUse::kCast, "GradSync: '",
                params_[k].first, "' is read in fp32 but gathered in ", wire[k]);
  bucket_of_.resize(params_.size());
  offset_of_.resize(params_.size());
  filled_.assign(params_.size(), 0);
  armed_of_.assign(params_.size(), 0);
  // Buckets fill in reverse creation order (roughly backward's); all-reduced parameters and
  // reduce-scattered ones of each wire dtype and use fill their own, and a kScatterAlone one
  // gets a bucket to itself.
  std::map<std::tuple<bool, at::ScalarType, bool>, int64_t> open;
  const int64_t bucket_numel = bucket_bytes / static_cast<int64_t>(sizeof(float));
  for (size_t k = params_.size(); k-- > 0;) {
    const bool sharded = how[k] != Reduce::kAllReduce, alone = how[k] == Reduce::kScatterAlone;
    const bool fp32_use = sharded && use[k] == model::ParamUse::kFp32;
    const std::tuple<bool, at::ScalarType, bool> kind = {sharded, sharded ? wire[k] : at::kFloat,
                                                         fp32_use};
    const auto it = open.find(kind);
    int64_t b = alone || it == open.end() ? -1 : it->second;
    if (b < 0 || buckets_[b].numel >= bucket_numel) {
      buckets_.emplace_back();
      buckets_.back().sharded = sharded;
      buckets_.back().wire = std::get<1>(kind);
      buckets_.back().fp32_use = fp32_use;
      b = static_cast<int64_t>(buckets_.size()) - 1;
      if (!alone) open[kind] = b;
    }
    Bucket& bucket = buckets_[b];
    bucket.params.push_back(k);
    bucket_of_[k] = static_cast<size_t>(b);
    offset_of_[k] = bucket.numel;
    bucket.numel += params_[k].second.numel();
  }
  // Buckets launch in index order, so index them in the order they can fill: by their
  // earliest-created parameter, which backward reaches last. A bucket of the other kind whose
  // parameters span the module (sequence parallelism's norms under ZeRO-1) then comes after the
  // buckets it would otherwise hold back.
  std::vector<size_t> order(buckets_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return buckets_[a].params.back() > buckets_[b].params.back();
  });
  std::vector<Bucket> sorted;
  std::vector<size_t> index_of(buckets_.size());
  for (size_t i = 0; i < order.size(); ++i) {
    index_of[order[i]] = i;
    sorted.push_back(std::move(buckets_[order[i]]));
  }
  buckets_ = std::move(sorted);
  for (size_t& b : bucket_of_) b = index_of[b];
  if (group_.size() == 1) return;
  const int64_t n = group_.size(), rank = group_.rank();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    b.shard = b.sharded ? (b.numel + n - 1) / n : 0;
    const int64_t numel = b.sharded ? b.shard * n : b.numel;
    b.buffer = torch::zeros({numel}, params_[b.params[0]].second.options().dtype(torch::kFloat));
    if (!b.sharded) continue;
    const int64_t lo = rank * b.shard, hi = lo + b.shard;  // this rank's shard of the bucket
    for (size_t k : b.params) {
      WEFT_CHECK(params_[k].second.is_contiguous(), "ZeRO-1: parameter '", params_[k].first,
                 "' is not contiguous");
      const int64_t begin = std::max(lo, offset_of_[k]);
      const int64_t end = std::min(hi, offset_of_[k] + params_[k].second.numel());
      if (begin >= end) continue;
      b.pieces.push_back(pieces_.size());
      pieces_.push_back(
          {k, begin - offset_of_[k], end - begin, b.buffer.narrow(0, begin, end - begin), {}});
    }
  }
  // Parameters gathered narrower than fp32 are held in that dtype: the exact values of this
  // rank's pieces become their masters first. Before the accumulators exist (set_data drops a
  // parameter's accumulator when its dtype changes).
  torch::NoGradGuard no_grad;
  for (const Bucket& b : buckets_) {
    if (!b.sharded || b.wire == at::kFloat) continue;
    for (size_t i : b.pieces) {
      ShardPiece& p = pieces_[i];
      const at::Tensor values = params_[p.param].second.detach().view({-1});
      p.master = values.narrow(0, p.begin, p.length).to(at::kFloat).clone();
    }
    for (size_t k : b.params) {
      const at::Tensor& p = params_[k].second;
      if (p.scalar_type() != b.wire) p.set_data(p.detach().to(b.wire));
    }
  }
  for (size_t k = 0; k < params_.size(); ++k) {
    accumulators_.push_back(torch::autograd::impl::grad_accumulator(params_[k].second));
    hooks_.push_back(accumulators_.back()->add_post_hook(std::make_unique<PostHook>([this, k] {
      if (armed_of_[k]) on_accumulated(k);
    })));
  }
}

GradSync::~GradSync() {
  try {
    finish_gather();  // nothing may stay registered, nor in flight into freed parameters
  } catch (const std::exception&) {  // a failed peer: the run is ending with its own error
  }
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
  if (!b.sharded) {
    b.pending = group_.all_reduce_sum_async(b.buffer);
    return;
  }
  auto sum = std::make_shared<PendingTensor>(group_.reduce_scatter_sum_async(b.buffer));
  const at::Tensor mine = b.buffer.narrow(0, group_.rank() * b.shard, b.shard);
  b.pending = Pending([sum, mine] { mine.copy_(sum->wait()); });
  // A reduce-scatter that receives a whole bucket (Gloo's all-to-all) frees it when waited for:
  // at most kScatterBuffers of them in flight, not a second copy of every gradient at the end
  // of backward.
  if (!group_.reduce_scatter_buffers_whole(b.buffer)) return;
  scattering_.push_back(&b);
  while (scattering_.size() > kScatterBuffers) {
    scattering_.front()->pending.wait();
    scattering_.pop_front();
  }
}

void GradSync::finish() {
  if (group_.size() == 1) return;
  finish_gather();  // values no forward read this step, before anything steps them
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
  scattering_.clear();
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

PendingTensor GradSync::start_gather(const Bucket& b) {
  const int64_t lo = group_.rank() * b.shard;
  at::Tensor mine = torch::zeros({b.shard}, b.buffer.options().dtype(b.wire));
  for (size_t i : b.pieces) {
    const ShardPiece& p = pieces_[i];
    mine.narrow(0, offset_of_[p.param] + p.begin - lo, p.length)
        .copy_(p.master.defined()
                   ? p.master
                   : params_[p.param].second.detach().view({-1}).narrow(0, p.begin, p.length));
  }
  return group_.all_gather_async(mine);
}

void GradSync::take_gathered(const Bucket& b, const at::Tensor& all) {
  torch::NoGradGuard no_grad;  // into leaves that require grad, maybe from inside a forward
  // Every shard, this rank's own too: in fp32 it is the parameter's value, and a parameter held
  // in the wire dtype takes its own masters rounded.
  for (size_t k : b.params) {
    const at::Tensor flat = params_[k].second.detach().view({-1});
    flat.copy_(all.narrow(0, offset_of_[k], flat.numel()));
  }
}

void GradSync::gather_params(bool overlap) {
  if (group_.size() == 1) return;
  finish_gather();  // a step that never finished (an error mid-step) may have left some
  torch::NoGradGuard no_grad;
  // Sharded buckets in the order forward reads them (buckets are indexed in backward's), those
  // read in fp32 (waited for at once when overlapped) first.
  std::vector<size_t> order;
  for (bool fp32_use : {true, false})
    for (size_t i = buckets_.size(); i-- > 0;)
      if (buckets_[i].sharded && buckets_[i].fp32_use == fp32_use) order.push_back(i);
  std::lock_guard<std::mutex> lock(gather_mu_);
  if (!overlap) {
    // Two buckets' all-gathers in flight at a time: the next one's transfer overlaps this one's
    // copies, and the gathered copies held at once stay two buckets' worth.
    std::deque<PendingTensor> gathers;
    for (size_t i = 0; i < order.size(); ++i) {
      while (gathers.size() < 2 && i + gathers.size() < order.size())
        gathers.push_back(start_gather(buckets_[order[i + gathers.size()]]));
      take_gathered(buckets_[order[i]], gathers.front().wait());
      gathers.pop_front();
    }
    return;
  }
  // Every bucket's gather at once: the wire copies held meanwhile (half the parameters' fp32
  // bytes under bf16) are freed as forward reads each bucket, before activations build up.
  for (size_t i : order)
    buckets_[i].gathering = std::make_unique<PendingTensor>(start_gather(buckets_[i]));
  for (size_t i : order) {
    Bucket& b = buckets_[i];
    if (b.fp32_use) {
      take_gathered(b, b.gathering->wait());
      b.gathering.reset();
      continue;
    }
    std::vector<at::Tensor> params;
    for (size_t k : b.params) params.push_back(params_[k].second);
    b.arrival = model::expect_values(params, [this, i] { arrive(i); });
  }
}

void GradSync::arrive(size_t i) {
  std::lock_guard<std::mutex> lock(gather_mu_);
  Bucket& b = buckets_[i];
  if (!b.gathering) return;  // taken already
  // Out of the registry and out of flight first: if the wait throws (a failed peer), nothing
  // is left to wait for again.
  if (b.arrival) model::values_arrived(std::exchange(b.arrival, 0));
  std::unique_ptr<PendingTensor> gathering = std::move(b.gathering);
  const auto t0 = std::chrono::steady_clock::now();
  const at::Tensor all = gathering->wait();
  gather_wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  take_gathered(b, all);
}

void GradSync::finish_gather() {
  // In the order they started. A failed wait (a dead peer) leaves the others to be taken out of
  // the registry and waited for all the same; the first error goes up after.
  std::exception_ptr error;
  for (size_t i = buckets_.size(); i-- > 0;) {
    try {
      arrive(i);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

double GradSync::take_gather_wait_seconds() {
  std::lock_guard<std::mutex> lock(gather_mu_);
  return std::exchange(gather_wait_seconds_, 0.0);
}

int64_t GradSync::gathers_in_flight() const {
  std::lock_guard<std::mutex> lock(gather_mu_);
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += b.gathering != nullptr;
  return n;
}

}  // namespace weft::dist
