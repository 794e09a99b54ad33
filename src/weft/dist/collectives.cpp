#include "weft/dist/collectives.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <atomic>
#include <optional>

#include "weft/core/error.h"

namespace weft::dist {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(Comm g) : group(std::move(g)) {}
  Comm group;
};

void save_group(AutogradContext* ctx, const Comm& group) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
}
const Comm& saved_group(AutogradContext* ctx) {
  auto holder = ctx->saved_data["group"].toCapsule();
  return static_cast<GroupHolder*>(holder.get())->group;
}

at::Tensor all_reduced(const at::Tensor& x, const Comm& group) {
  at::Tensor y = x.contiguous().clone();
  group.all_reduce_sum(y);
  return y;
}

// all-gather / reduce-scatter along `dim` (the Comm primitives work along dim 0).
at::Tensor gathered(const at::Tensor& x, const Comm& group, int64_t dim) {
  return group.all_gather(x.transpose(0, dim).contiguous()).transpose(0, dim);
}
at::Tensor scattered(const at::Tensor& x, const Comm& group, int64_t dim) {
  return group.reduce_scatter_sum(x.transpose(0, dim).contiguous()).transpose(0, dim);
}

struct CopyTo : torch::autograd::Function<CopyTo> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Comm& group) {
    save_group(ctx, group);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduced(g[0], saved_group(ctx)), at::Tensor()};
  }
};

struct ReduceFrom : torch::autograd::Function<ReduceFrom> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const Comm& group) {
    return all_reduced(x, group);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

// kGather: all-gather along dim in forward, reduce-scatter the gradient in backward (gather_along);
// otherwise the reverse (scatter_along).
template <bool kGather>
struct GatherOrScatter : torch::autograd::Function<GatherOrScatter<kGather>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Comm& group,
                            int64_t dim) {
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    return kGather ? gathered(x, group, dim) : scattered(x, group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const Comm& group = saved_group(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {kGather ? scattered(g[0], group, dim) : gathered(g[0], group, dim), at::Tensor(),
            at::Tensor()};
  }
};

struct GatherReplicated : torch::autograd::Function<GatherReplicated> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Comm& group,
                            int64_t dim) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["rank"] = static_cast<int64_t>(group.rank());
    ctx->saved_data["size"] = static_cast<int64_t>(group.size());
    return gathered(x, group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const int64_t chunk = g[0].size(dim) / ctx->saved_data["size"].toInt();
    return {g[0].narrow(dim, ctx->saved_data["rank"].toInt() * chunk, chunk), at::Tensor(),
            at::Tensor()};
  }
};

struct SplitReplicated : torch::autograd::Function<SplitReplicated> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Comm& group,
                            int64_t dim) {
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    const int64_t chunk = x.size(dim) / group.size();
    return x.narrow(dim, group.rank() * chunk, chunk);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gathered(g[0], saved_group(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

// column_linear's autograd functions, with and without a bias (an undefined tensor is no
// autograd Function input on LibTorch 1.13). `dim` < 0: no sequence parallelism.
at::Tensor column_forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                          const at::Tensor& b, const Comm& group, int64_t dim) {
  save_group(ctx, group);
  ctx->saved_data["dim"] = dim;
  ctx->save_for_backward({x, w});
  return at::linear(dim >= 0 ? gathered(x, group, dim) : x, w, b);
}

std::atomic<bool> g_overlap_tp_comm{true};

variable_list column_backward(AutogradContext* ctx, const at::Tensor& g, bool bias) {
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor &x = saved[0], &w = saved[1];
  const Comm& group = saved_group(ctx);
  const int64_t dim = ctx->saved_data["dim"].toInt();
  const bool sp = dim >= 0;
  const at::Tensor gy = g.reshape({-1, g.size(-1)});  // [rows, out]
  // Each collective starts as soon as its operand exists and is waited only when its result is
  // needed, so that the matmuls between run while it is in flight (every rank issues them in the
  // same order): x's all-gather during the input gradient's matmul, the input gradient's
  // reduction during the weight gradient's.
  // Through shared memory (CPU ranks of one host) the copies are the computing core's own work:
  // nothing runs on meanwhile, and the blocking calls take that path.
  std::optional<PendingTensor> gathered_x;
  const bool overlap = g_overlap_tp_comm.load(std::memory_order_relaxed) && !group.shared_memory();
  if (sp && ctx->needs_input_grad(1)) {
    const at::Tensor xt = x.transpose(0, dim).contiguous();
    gathered_x = overlap ? group.all_gather_async(xt) : PendingTensor(group.all_gather(xt));
  }
  std::optional<PendingTensor> scattered_gx;
  at::Tensor gx, gw, gb;
  Pending reduced_gx;
  if (ctx->needs_input_grad(0)) {
    std::vector<int64_t> shape = g.sizes().vec();
    shape.back() = w.size(1);
    gx = gy.mm(w).view(shape);  // this rank's output features' share
    if (sp) {
      const at::Tensor gxt = gx.transpose(0, dim).contiguous();
      scattered_gx = overlap ? group.reduce_scatter_sum_async(gxt)
                             : PendingTensor(group.reduce_scatter_sum(gxt));
    } else if (overlap) {
      reduced_gx = group.all_reduce_sum_async(gx);
    } else {
      group.all_reduce_sum(gx);
    }
  }
  if (ctx->needs_input_grad(1)) {
    const at::Tensor xf = sp ? gathered_x->wait().transpose(0, dim) : x;
    gw = gy.t().mm(xf.reshape({-1, xf.size(-1)}));
  }
  if (bias && ctx->needs_input_grad(2)) gb = gy.sum(0);
  if (scattered_gx) gx = scattered_gx->wait().transpose(0, dim);
  reduced_gx.wait();
  variable_list out{gx, gw};
  if (bias) out.push_back(gb);
  out.insert(out.end(), {at::Tensor(), at::Tensor()});
  return out;
}

struct ColumnLinear : torch::autograd::Function<ColumnLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const Comm& group, int64_t dim) {
    return column_forward(ctx, x, w, at::Tensor(), group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return column_backward(ctx, g[0], false);
  }
};

struct ColumnLinearBias : torch::autograd::Function<ColumnLinearBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b, const Comm& group, int64_t dim) {
    return column_forward(ctx, x, w, b, group, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return column_backward(ctx, g[0], true);
  }
};

struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Comm& group,
                            std::vector<int64_t> send, std::vector<int64_t> recv) {
    save_group(ctx, group);
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return group.all_to_all(x, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector();
    const std::vector<int64_t> recv = ctx->saved_data["recv"].toIntVector();
    return {saved_group(ctx).all_to_all(g[0], recv, send), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor split_replicated(const at::Tensor& x, const Comm& group, int64_t dim) {
  RECORD_FUNCTION("weft::split_replicated", std::vector<c10::IValue>({x}));
  if (group.size() == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  WEFT_CHECK(x.size(dim) % group.size() == 0, "split_replicated: dim ", dim, " of size ",
             x.size(dim), " over ", group.size(), " ranks");
  if (!x.requires_grad()) {
    const int64_t chunk = x.size(dim) / group.size();
    return x.narrow(dim, group.rank() * chunk, chunk);
  }
  return SplitReplicated::apply(x, group, dim);
}

at::Tensor all_to_all(const at::Tensor& x, const Comm& group, std::vector<int64_t> send_counts,
                      std::vector<int64_t> recv_counts) {
  RECORD_FUNCTION("weft::all_to_all", std::vector<c10::IValue>({x}));
  if (group.size() == 1) return x;
  if (!x.requires_grad()) return group.all_to_all(x, send_counts, recv_counts);
  return AllToAll::apply(x, group, std::move(send_counts), std::move(recv_counts));
}

at::Tensor copy_to(const at::Tensor& x, const Comm& group) {
  RECORD_FUNCTION("weft::copy_to", std::vector<c10::IValue>({x}));
  if (group.size() == 1 || !x.requires_grad()) return x;
  return CopyTo::apply(x, group);
}

at::Tensor reduce_from(const at::Tensor& x, const Comm& group) {
  RECORD_FUNCTION("weft::reduce_from", std::vector<c10::IValue>({x}));
  if (group.size() == 1) return x;
  if (!x.requires_grad()) return all_reduced(x, group);
  return ReduceFrom::apply(x, group);
}

at::Tensor gather_along(const at::Tensor& x, const Comm& group, int64_t dim) {
  RECORD_FUNCTION("weft::gather_along", std::vector<c10::IValue>({x}));
  if (group.size() == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  if (!x.requires_grad()) return gathered(x, group, dim);
  return GatherOrScatter<true>::apply(x, group, dim);
}

at::Tensor scatter_along(const at::Tensor& x, const Comm& group, int64_t dim) {
  RECORD_FUNCTION("weft::scatter_along", std::vector<c10::IValue>({x}));
  if (group.size() == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  WEFT_CHECK(x.size(dim) % group.size() == 0, "scatter_along: dim ", dim, " of size ", x.size(dim),
             " over ", group.size(), " ranks");
  if (!x.requires_grad()) return scattered(x, group, dim);
  return GatherOrScatter<false>::apply(x, group, dim);
}

void set_overlap_tp_comm(bool overlap) { g_overlap_tp_comm = overlap; }

at::Tensor column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                         const Comm& group, int64_t sequence_dim) {
  RECORD_FUNCTION("weft::column_linear", std::vector<c10::IValue>({x, w, b}));
  if (group.size() == 1) return at::linear(x, w, b);
  const bool sp = sequence_dim >= 0;
  // No collective in backward: x's gradient is not wanted, nor (under SP) the weight's.
  if (!x.requires_grad() && (!sp || !w.requires_grad()))
    return at::linear(sp ? gathered(x, group, sequence_dim) : x, w, b);
  return b.defined() ? ColumnLinearBias::apply(x, w, b, group, sequence_dim)
                     : ColumnLinear::apply(x, w, group, sequence_dim);
}

at::Tensor gather_replicated(const at::Tensor& x, const Comm& group, int64_t dim) {
  RECORD_FUNCTION("weft::gather_replicated", std::vector<c10::IValue>({x}));
  if (group.size() == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  if (!x.requires_grad()) return gathered(x, group, dim);
  return GatherReplicated::apply(x, group, dim);
}

}  // namespace weft::dist
