#include "weft/dist/collectives.h"

#include <torch/torch.h>

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

// The bias is added outside (an undefined tensor is no autograd Function input on LibTorch 1.13).
struct GatheredLinear : torch::autograd::Function<GatheredLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const Comm& group, int64_t dim) {
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    ctx->save_for_backward({x, w});
    return at::linear(gathered(x, group, dim), w);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const Comm& group = saved_group(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const at::Tensor gy = g[0].reshape({-1, g[0].size(-1)});  // [rows, out]
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      std::vector<int64_t> shape = g[0].sizes().vec();
      shape.back() = w.size(1);
      gx = scattered(gy.mm(w).view(shape), group, dim);
    }
    if (ctx->needs_input_grad(1)) {
      const at::Tensor xf = gathered(x, group, dim);
      gw = gy.t().mm(xf.reshape({-1, xf.size(-1)}));
    }
    return {gx, gw, at::Tensor(), at::Tensor()};
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
  if (group.size() == 1) return x;
  if (!x.requires_grad()) return group.all_to_all(x, send_counts, recv_counts);
  return AllToAll::apply(x, group, std::move(send_counts), std::move(recv_counts));
}

at::Tensor copy_to(const at::Tensor& x, const Comm& group) {
  if (group.size() == 1 || !x.requires_grad()) return x;
  return CopyTo::apply(x, group);
}

at::Tensor reduce_from(const at::Tensor& x, const Comm& group) {
  if (group.size() == 1) return x;
  if (!x.requires_grad()) return all_reduced(x, group);
  return ReduceFrom::apply(x, group);
}

at::Tensor gather_along(const at::Tensor& x, const Comm& group, int64_t dim) {
  if (group.size() == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  if (!x.requires_grad()) return gathered(x, group, dim);
  return GatherOrScatter<true>::apply(x, group, dim);
}

at::Tensor scatter_along(const at::Tensor& x, const Comm& group, int64_t dim) {
  if (group.size() == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  WEFT_CHECK(x.size(dim) % group.size() == 0, "scatter_along: dim ", dim, " of size ", x.size(dim),
             " over ", group.size(), " ranks");
  if (!x.requires_grad()) return scattered(x, group, dim);
  return GatherOrScatter<false>::apply(x, group, dim);
}

at::Tensor gathered_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                           const Comm& group, int64_t dim) {
  if (group.size() == 1) return at::linear(x, w, b);
  dim = dim < 0 ? dim + x.dim() : dim;
  if (!x.requires_grad() && !w.requires_grad()) return at::linear(gathered(x, group, dim), w, b);
  const at::Tensor y = GatheredLinear::apply(x, w, group, dim);
  return b.defined() ? y + b : y;
}

at::Tensor gather_replicated(const at::Tensor& x, const Comm& group, int64_t dim) {
  if (group.size() == 1) return x;
  dim = dim < 0 ? dim + x.dim() : dim;
  if (!x.requires_grad()) return gathered(x, group, dim);
  return GatherReplicated::apply(x, group, dim);
}

}  // namespace weft::dist
