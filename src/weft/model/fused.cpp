#include "weft/model/fused.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "weft/model/fused_math.h"

namespace weft::model {

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per parallel task
// at::_foreach_norm on CUDA tensors: from LibTorch 2.3 (earlier ones got empty tensors wrong).
constexpr bool kForeachNorm = TORCH_VERSION_MAJOR > 2 ||
                              (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3);

bool fusable(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

}  // namespace

double sum_squares(const at::Tensor& x) {
  if (!fusable(x)) return x.to(at::kDouble).pow(2).sum().item<double>();
  const float* data = x.data_ptr<float>();
  const int64_t n = x.numel();
  // Per-task partial sums in a fixed chunking, added in order: the result does not depend on
  // the thread count.
  const int64_t tasks = (n + kGrain - 1) / kGrain;
  std::vector<double> partial(static_cast<size_t>(tasks), 0.0);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t lo = t * kGrain, hi = std::min(n, lo + kGrain);
      double acc[4] = {0, 0, 0, 0};
      int64_t i = lo;
      for (; i + 4 <= hi; i += 4)
        for (int k = 0; k < 4; ++k) acc[k] += static_cast<double>(data[i + k]) * data[i + k];
      for (; i < hi; ++i) acc[0] += static_cast<double>(data[i]) * data[i];
      partial[t] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  });
  double sum = 0;
  for (double s : partial) sum += s;
  return sum;
}

at::Tensor squares_each(const std::vector<at::Tensor>& xs, c10::Device device) {
  RECORD_FUNCTION("weft::squares_each", std::vector<c10::IValue>());
  const at::TensorOptions dbl = at::TensorOptions().dtype(at::kDouble).device(device);
  if (device.is_cpu()) {
    at::Tensor out = at::zeros({static_cast<int64_t>(xs.size())}, dbl);
    double* o = out.data_ptr<double>();
    for (size_t i = 0; i < xs.size(); ++i)
      if (xs[i].defined()) o[i] = sum_squares(xs[i].to(at::kCPU));
    return out;
  }
  if (xs.empty()) return at::zeros({0}, dbl);
  // One 0-dim entry per tensor, stacked once at the end; the CUDA fp32 ones (typically all) from
  // one multi-tensor norm.
  const at::Tensor zero = at::zeros({}, dbl);
  std::vector<at::Tensor> parts(xs.size(), zero);
  std::vector<size_t> where;
  std::vector<at::Tensor> listed;  // for the multi-tensor norm
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& x = xs[i];
    if (!x.defined()) continue;
    if (kForeachNorm && x.device() == device && x.scalar_type() == at::kFloat) {
      where.push_back(i);
      listed.push_back(x);
      continue;
    }
    const at::Tensor norm = at::linalg_vector_norm(x, 2, c10::nullopt, false, at::kDouble);
    parts[i] = (norm * norm).to(device);
  }
  // A handful of kernels for all the tensors, where a norm per tensor costs the GPU a wait for
  // each launch: each tensor's norm in fp32, squared in double.
  if (!listed.empty()) {
    const at::Tensor norms = at::stack(at::_foreach_norm(listed, 2)).to(at::kDouble);
    const std::vector<at::Tensor> sq = (norms * norms).unbind(0);
    for (size_t j = 0; j < where.size(); ++j) parts[where[j]] = sq[j];
  }
  return at::stack(parts);
}

namespace {

// Σ squares as a 0-dim double tensor where they live; on the CPU added in order.
at::Tensor total_of(const at::Tensor& squares) {
  if (!squares.is_cpu()) return squares.sum();
  const at::Tensor s = squares.to(at::kDouble).contiguous();
  const double* v = s.data_ptr<double>();
  double sum = 0;
  for (int64_t i = 0; i < s.numel(); ++i) sum += v[i];
  return at::scalar_tensor(sum, at::kDouble);
}

}  // namespace

double sum_squares(const std::vector<at::Tensor>& xs) {
  c10::Device device(c10::kCPU);  // the first device tensor's device, else the CPU
  for (const at::Tensor& x : xs)
    if (x.defined() && !x.is_cpu()) {
      device = x.device();
      break;
    }
  return total_of(squares_each(xs, device)).item<double>();  // one read back
}

at::Tensor norm_of_squares(const at::Tensor& squares) { return total_of(squares).sqrt(); }

void adamw_update(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                  const at::Tensor& v, const AdamWUpdate& u) {
  RECORD_FUNCTION("weft::adamw_update", std::vector<c10::IValue>({p, g, m, v}));
  if (!(fusable(p) && fusable(g) && fusable(m) && fusable(v))) {
    torch::NoGradGuard no_grad;
    const at::Tensor gs = u.grad_scale == 1 ? g : g * u.grad_scale;
    if (u.decay != 1) p.mul_(u.decay);
    m.mul_(u.beta1).add_(gs, 1.0 - u.beta1);
    v.mul_(u.beta2).addcmul_(gs, gs, 1.0 - u.beta2);
    p.addcdiv_(m, (v / u.bc2).sqrt_().add_(u.eps), -u.lr / u.bc1);
    return;
  }
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float decay = static_cast<float>(u.decay), scale = static_cast<float>(u.grad_scale);
  const float b1 = static_cast<float>(u.beta1), c1 = static_cast<float>(1.0 - u.beta1);
  const float b2 = static_cast<float>(u.beta2), c2 = static_cast<float>(1.0 - u.beta2);
  const float inv_bc2 = static_cast<float>(1.0 / u.bc2), eps = static_cast<float>(u.eps);
  const float step = static_cast<float>(-u.lr / u.bc1);
  at::parallel_for(0, p.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float gi = gp[i] * scale;
      const float mi = b1 * mp[i] + c1 * gi;
      const float vi = b2 * vp[i] + c2 * gi * gi;
      mp[i] = mi;
      vp[i] = vi;
      pp[i] = pp[i] * decay + step * mi / (std::sqrt(vi * inv_bc2) + eps);
    }
  });
}

}  // namespace weft::model

namespace weft::model {

namespace {

using simd::dispatch_float_bf16;
using simd::exp_nonpositive;
using simd::lane_max;
using simd::lane_sum;
using simd::load;
using simd::store;

// One row: p = softmax(scale * s) over visible keys. `e` is fp32 scratch of n.
template <typename T>
WEFT_VECTOR_CLONES void softmax_row(const T* s, const uint8_t* vis, T* p, float* e, int64_t n,
                                    float scale) {
  const float hidden = -std::numeric_limits<float>::infinity();
  if (vis)
    for (int64_t k = 0; k < n; ++k) e[k] = vis[k] != 0 ? load(s, k) * scale : hidden;
  else
    for (int64_t k = 0; k < n; ++k) e[k] = load(s, k) * scale;
  const float max = lane_max(e, n);
  for (int64_t k = 0; k < n; ++k) e[k] = exp_nonpositive(e[k] - max);
  const float inv = 1.0f / lane_sum(e, n);
  for (int64_t k = 0; k < n; ++k) store(p, k, e[k] * inv);
}

// One row of the backward: ds = scale * p * (g - Σ g·p). `e` is fp32 scratch of n.
template <typename T>
WEFT_VECTOR_CLONES void softmax_grad_row(const T* p, const T* g, T* ds, float* e, int64_t n,
                                         float scale) {
  for (int64_t k = 0; k < n; ++k) e[k] = load(g, k) * load(p, k);
  const float dot = lane_sum(e, n);
  for (int64_t k = 0; k < n; ++k) store(ds, k, scale * load(p, k) * (load(g, k) - dot));
}

bool softmax_fusable(const at::Tensor& s) {
  return s.device().is_cpu() && s.dim() == 4 &&
         (s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16);
}

// The mask row for score row `row` of the flattened [B * X * R] rows.
struct MaskRows {
  const uint8_t* data = nullptr;  // bool, read as bytes: GCC vectorises no loads of bool
  int64_t per_batch_rows = 1, sq = 1, sk = 0;  // score rows per batch (X * R), mask rows, keys
  const uint8_t* row(int64_t r) const {
    if (!data) return nullptr;
    const int64_t b = r / per_batch_rows, q = (r % per_batch_rows) % sq;
    return data + (b * sq + q) * sk;
  }
};

MaskRows mask_rows(const at::Tensor& scores, const at::Tensor& visible) {
  MaskRows m;
  m.per_batch_rows = scores.size(1) * scores.size(2);
  m.sk = scores.size(3);
  if (!visible.defined()) return m;
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.dim() == 4 && visible.size(1) == 1 &&
                  visible.size(0) == scores.size(0) && visible.size(3) == scores.size(3) &&
                  scores.size(2) % visible.size(2) == 0 && visible.is_contiguous(),
              "masked_softmax: mask ", visible.sizes(), " does not fit scores ", scores.sizes());
  m.data = reinterpret_cast<const uint8_t*>(visible.data_ptr<bool>());
  m.sq = visible.size(2);
  return m;
}

at::Tensor softmax_forward(const at::Tensor& scores_in, const at::Tensor& visible, double scale) {
  const at::Tensor scores = scores_in.contiguous();
  at::Tensor p = at::empty_like(scores);
  const MaskRows mask = mask_rows(scores, visible);
  const int64_t n = scores.size(3), rows = scores.numel() / std::max<int64_t>(n, 1);
  const float sc = static_cast<float>(scale);
  dispatch_float_bf16(scores.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* s = scores.data_ptr<scalar_t>();
    scalar_t* out = p.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)),
                     [&](int64_t begin, int64_t end) {
                       std::vector<float> e(static_cast<size_t>(n));
                       for (int64_t r = begin; r < end; ++r)
                         softmax_row(s + r * n, mask.row(r), out + r * n, e.data(), n, sc);
                     });
  });
  return p;
}

at::Tensor softmax_backward(const at::Tensor& p, const at::Tensor& grad_in, double scale) {
  const at::Tensor g = grad_in.contiguous();
  at::Tensor ds = at::empty_like(p);
  const int64_t n = p.size(3), rows = p.numel() / std::max<int64_t>(n, 1);
  const float sc = static_cast<float>(scale);
  dispatch_float_bf16(p.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* pp = p.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* out = ds.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)),
                     [&](int64_t begin, int64_t end) {
                       std::vector<float> e(static_cast<size_t>(n));
                       for (int64_t r = begin; r < end; ++r)
                         softmax_grad_row(pp + r * n, gp + r * n, out + r * n, e.data(), n, sc);
                     });
  });
  return ds;
}

// One row of cross_entropy_rows: its loss, and with `grad` softmax − one-hot over the logits.
// `e` is fp32 scratch of n.
template <typename T>
WEFT_VECTOR_CLONES float cross_entropy_row(T* l, int64_t target, float* e, int64_t n, bool grad) {
  for (int64_t k = 0; k < n; ++k) e[k] = load(l, k);
  const float max = lane_max(e, n), picked = e[target];
  for (int64_t k = 0; k < n; ++k) e[k] = exp_nonpositive(e[k] - max);
  const float sum = lane_sum(e, n);
  if (grad) {
    const float inv = 1.0f / sum;
    for (int64_t k = 0; k < n; ++k) store(l, k, e[k] * inv);
    store(l, target, e[target] * inv - 1.0f);
  }
  return max + std::log(sum) - picked;
}

struct MaskedSoftmax : torch::autograd::Function<MaskedSoftmax> {
  // The mask comes by pointer: it is not differentiable, and may be undefined.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& scores,
                            const at::Tensor* visible, double scale) {
    at::Tensor p = softmax_forward(scores, *visible, scale);
    ctx->save_for_backward({p});
    ctx->saved_data["scale"] = scale;
    return p;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor p = ctx->get_saved_variables()[0];
    return {softmax_backward(p, grads[0], ctx->saved_data["scale"].toDouble()), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor cross_entropy_rows(at::Tensor& logits, const at::Tensor& targets, bool grad) {
  RECORD_FUNCTION("weft::cross_entropy_rows", std::vector<c10::IValue>({logits, targets}));
  if (!logits.device().is_cpu() || logits.dim() != 2 || !logits.is_contiguous() ||
      (logits.scalar_type() != at::kFloat && logits.scalar_type() != at::kBFloat16))
    return {};
  const int64_t n = logits.size(0), V = logits.size(1);
  const at::Tensor t = targets.to(at::kCPU, at::kLong).contiguous();
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "cross_entropy_rows: targets ", t.sizes(),
              " for logits ", logits.sizes());
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "cross_entropy_rows: target ", tp[r], " of row ", r,
                " outside the vocabulary [0, ", V, ")");
  at::Tensor loss = at::empty({n}, logits.options().dtype(at::kFloat));
  float* out = loss.data_ptr<float>();
  dispatch_float_bf16(logits.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* l = logits.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> e(static_cast<size_t>(V));
      for (int64_t r = begin; r < end; ++r)
        out[r] = cross_entropy_row(l + r * V, tp[r], e.data(), V, grad);
    });
  });
  return loss;
}

at::Tensor masked_softmax(const at::Tensor& scores, const at::Tensor& visible, double scale) {
  RECORD_FUNCTION("weft::masked_softmax", std::vector<c10::IValue>({scores, visible}));
  if (softmax_fusable(scores)) return MaskedSoftmax::apply(scores, &visible, scale);
  // Reference ops: fp32 softmax over the visible keys.
  at::Tensor s = scores.to(at::kFloat).mul(scale);
  if (visible.defined()) {
    const int64_t rep = scores.size(2) / visible.size(2);
    at::Tensor v = rep == 1 ? visible : visible.repeat({1, 1, rep, 1});
    s = s.masked_fill(v.logical_not(), -std::numeric_limits<float>::infinity());
  }
  return at::softmax(s, -1).to(scores.scalar_type());
}

}  // namespace weft::model
