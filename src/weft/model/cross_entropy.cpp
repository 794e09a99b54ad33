#include "weft/model/cross_entropy.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <utility>

#include "weft/core/error.h"
#include "weft/core/loss_chunk.h"
#include "weft/model/fused.h"

namespace weft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Which gradients forward makes: those autograd will ask for (grad mode on, and the input
// requires grad; inside Function::forward grad mode is always off).
struct Needs {
  bool rows = false, weight = false;
};

// A chunk's loss and logit gradient by ATen ops (vocab-parallel, or tensors cross_entropy_rows
// does not take): adds the loss of fp32 logits [n, V] against targets t [n, 1] into `loss` and,
// with `grad`, returns softmax − one-hot over the logits in place. With `tp` the logits are this
// rank's block of the vocabulary from id `first`, combined over tp (two fp32 all-reduces).
at::Tensor loss_and_logit_grad(at::Tensor logits, const at::Tensor& t, at::Tensor& loss, bool grad,
                               const dist::Comm* tp, int64_t first) {
  const int64_t n = logits.size(0), V = logits.size(1);
  at::Tensor lse, local = t, hit;  // hit: 1 where this rank holds the target (vocab-parallel)
  if (!tp) {
    lse = at::logsumexp(logits, {1}, /*keepdim=*/true);
    loss.add_((lse - logits.gather(1, t)).sum());
  } else {
    at::Tensor max = std::get<0>(logits.max(1, /*keepdim=*/true));
    tp->all_reduce_max(max);
    hit = (t >= first).logical_and(t < first + V).to(at::kFloat);
    local = (t - first).clamp(0, V - 1);
    // Σ exp(l − max) and the target's logit (0 where another rank holds it), summed over tp.
    at::Tensor sums = at::cat(
        {(logits - max).exp().sum(1, /*keepdim=*/true), logits.gather(1, local).mul_(hit)}, 1);
    tp->all_reduce_sum(sums);
    lse = sums.narrow(1, 0, 1).log().add_(max);
    loss.add_((lse - sums.narrow(1, 1, 1)).sum());
  }
  if (!grad) return {};
  at::Tensor d = logits.sub_(lse).exp_();
  d.scatter_add_(1, local, tp ? hit.neg() : at::full({n, 1}, -1.0, d.options()));
  return d;
}

struct LinearCrossEntropyFn : torch::autograd::Function<LinearCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk, Needs need,
                            const dist::Comm* tp) {
    const int64_t N = rows.size(0);
    const bool split = tp->size() > 1;  // vocab-parallel: weight holds rows [first, first + V)
    const int64_t V = weight.size(0), first = tp->rank() * V;
    const at::Tensor wt = weight.t();
    at::Tensor loss = at::zeros({}, rows.options().dtype(at::kFloat));
    at::Tensor grad_rows = need.rows ? at::empty_like(rows) : at::Tensor();
    // The weight's gradient: the one chunk's product, or the chunks' sum in fp32 (each chunk's
    // product in the compute dtype into one reused buffer).
    at::Tensor grad_weight, product;
    const bool one_chunk = N <= chunk;
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t n = std::min(chunk, N - r0);
      const at::Tensor x = rows.narrow(0, r0, n);
      const at::Tensor t = targets.narrow(0, r0, n).unsqueeze(1);
      at::Tensor logits = at::mm(x, wt);  // [n, V] in the compute dtype
      const bool grads = need.rows || need.weight;
      // d(loss)/d(logits) = softmax − one-hot, rounded as the unfused backward rounds it into
      // the matmuls: on the CPU in one pass over the logits, in place (fused.h).
      at::Tensor dc;
      const at::Tensor fused =
          split ? at::Tensor() : cross_entropy_rows(logits, t.squeeze(1), grads);
      if (fused.defined()) {
        loss.add_(fused.sum());
        if (!grads) continue;
        dc = logits;
      } else {
        at::Tensor f = logits.to(at::kFloat);
        logits.reset();  // the compute-dtype logits go before the fp32 work
        const at::Tensor d =
            loss_and_logit_grad(std::move(f), t, loss, grads, split ? tp : nullptr, first);
        if (!grads) continue;
        dc = d.to(rows.scalar_type());  // the fp32 logits go before the matmuls' outputs come
      }
      if (need.rows) {
        at::Tensor out = grad_rows.narrow(0, r0, n);
        at::mm_out(out, dc, weight);
      }
      if (need.weight) {
        if (one_chunk) {
          grad_weight = at::mm(dc.t(), x);
        } else {
          if (!grad_weight.defined())
            grad_weight = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
          if (dc.scalar_type() == at::kFloat) {
            grad_weight.addmm_(dc.t(), x);
          } else {
            if (!product.defined()) product = at::empty(weight.sizes(), weight.options());
            at::mm_out(product, dc.t(), x);
            grad_weight.add_(product);
          }
        }
      }
    }
    product.reset();
    // Every rank's vocabulary's share; TP ranks hold the same rows, so all of them skip an empty
    // one (a CP rank without targets).
    if (split && need.rows && N > 0) tp->all_reduce_sum(grad_rows);
    if (need.weight && !grad_weight.defined())  // no rows: no loss, a zero gradient
      grad_weight = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
    if (grad_weight.defined()) grad_weight = grad_weight.to(weight.scalar_type());
    ctx->save_for_backward({grad_rows, grad_weight});  // freed after backward, as saved inputs
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor g = grad[0];
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& grad_rows = saved[0];
    const at::Tensor& grad_weight = saved[1];
    return {grad_rows.defined() ? grad_rows * g : at::Tensor(),
            grad_weight.defined() ? grad_weight * g : at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor linear_cross_entropy_sum(const at::Tensor& rows, const at::Tensor& weight,
                                    const at::Tensor& targets, int64_t chunk_rows,
                                    const dist::Comm& tp) {
  RECORD_FUNCTION("weft::linear_cross_entropy_sum",
                  std::vector<c10::IValue>({rows, weight, targets}));
  WEFT_ASSERT(rows.dim() == 2 && weight.dim() == 2 && rows.size(1) == weight.size(1) &&
                  targets.dim() == 1 && targets.size(0) == rows.size(0) &&
                  rows.scalar_type() == weight.scalar_type(),
              "linear_cross_entropy_sum: rows ", rows.sizes(), " ", rows.scalar_type(), ", weight ",
              weight.sizes(), " ", weight.scalar_type(), ", targets ", targets.sizes());
  const int64_t chunk =
      chunk_rows > 0 ? chunk_rows : loss_chunk_rows(weight.size(1), weight.size(0));
  const bool grad = at::GradMode::is_enabled();
  const Needs need{grad && rows.requires_grad(), grad && weight.requires_grad()};
  return LinearCrossEntropyFn::apply(rows, weight, targets.to(at::kLong), chunk, need, &tp);
}

}  // namespace weft::model
