#include "weft/model/recompute.h"

#include <torch/torch.h>

#include <utility>
#include <vector>

#include "weft/core/error.h"

namespace weft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

thread_local bool g_recomputing = false;
struct RecomputingGuard {
  bool saved = std::exchange(g_recomputing, true);
  ~RecomputingGuard() { g_recomputing = saved; }
};

// What backward needs besides the saved tensors: the block, the forward's compute dtype and its
// CastOnce scope (backward may run on another thread).
struct BlockHolder : torch::CustomClassHolder {
  BlockHolder(BlockFn f, at::ScalarType d, std::weak_ptr<CastOnce::Cache> c)
      : block(std::move(f)), dtype(d), casts(std::move(c)) {}
  BlockFn block;
  at::ScalarType dtype;
  std::weak_ptr<CastOnce::Cache> casts;
};

// Autograd inputs: x, then each parameter. A variable number of tensors reaches a C++ Function
// as an at::TensorList argument, flattened into one input per element (a std::vector argument
// would count as a non-tensor); backward returns one gradient per tensor, then one (undefined)
// for the non-tensor `block`.
struct Recompute : torch::autograd::Function<Recompute> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                            const BlockFn& block) {
    ctx->saved_data["block"] = c10::IValue::make_capsule(
        c10::make_intrusive<BlockHolder>(block, compute_dtype(), CastOnce::current()));
    variable_list saved = {x};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    return block(x, params.vec());  // apply() runs forward with grad mode off: nothing is kept
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    auto holder = ctx->saved_data["block"].toCapsule();
    const auto& h = *static_cast<BlockHolder*>(holder.get());
    ComputeDtypeGuard dtype(h.dtype);
    CastOnce::Resume casts(h.casts);
    torch::AutoGradMode grad_mode(true);
    // Detached aliases (no copies): gradients w.r.t. them stay inside this node.
    std::vector<at::Tensor> inputs;  // in saved order: x, params
    std::vector<at::Tensor> wrt;     // those requiring grad
    std::vector<size_t> wrt_index;   // their index in saved
    for (size_t k = 0; k < saved.size(); ++k) {
      at::Tensor a = saved[k].detach();
      if (saved[k].requires_grad()) {
        a.set_requires_grad(true);
        wrt.push_back(a);
        wrt_index.push_back(k);
      }
      inputs.push_back(a);
    }
    const std::vector<at::Tensor> params(inputs.begin() + 1, inputs.end());
    RecomputingGuard recomputing_now;
    const at::Tensor y = h.block(inputs[0], params);
    variable_list result(saved.size() + 1);
    if (wrt.empty() || !y.requires_grad()) return result;
    const variable_list g = torch::autograd::grad({y}, wrt, {grad[0]}, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t i = 0; i < wrt.size(); ++i) result[wrt_index[i]] = g[i];
    return result;
  }
};

// Visits a layer's parameter slots (undefined ones included) in a fixed order.
template <typename F>
void visit(Linear& l, F& f) {
  f(l.weight);
  f(l.bias);
}
template <typename F>
void visit(RmsNorm& n, F& f) {
  f(n.weight);
}
template <typename F>
void visit(LayerNorm& n, F& f) {
  f(n.weight);
  f(n.bias);
}
template <typename F>
void visit(Attention& a, F& f) {
  visit(a.qkv, f);
  visit(a.out, f);
}
template <typename F>
void visit(SwiGlu& m, F& f) {
  visit(m.gate_up, f);
  visit(m.down, f);
}
template <typename F>
void visit(GeluMlp& m, F& f) {
  visit(m.fc1, f);
  visit(m.fc2, f);
}
template <typename F>
void visit(MoeMlp& m, F& f) {
  f(m.router);
  for (size_t j = 0; j < m.gate_up.size(); ++j) {
    visit(m.gate_up[j], f);
    visit(m.down[j], f);
  }
  visit(m.shared, f);
}
template <typename F>
void visit(LlmBlock& b, F& f) {
  visit(b.norm1, f);
  visit(b.attn, f);
  visit(b.norm2, f);
  visit(b.mlp, f);  // undefined in an MoE block
  visit(b.moe, f);  // empty in a dense block
}
template <typename F>
void visit(EncoderBlock& b, F& f) {
  visit(b.ln1, f);
  visit(b.attn, f);
  visit(b.ln2, f);
  visit(b.mlp, f);
}

template <typename Block>
std::vector<at::Tensor> gather_params(Block b) {
  std::vector<at::Tensor> out;
  auto f = [&](at::Tensor& t) {
    if (t.defined()) out.push_back(t);
  };
  visit(b, f);
  return out;
}

template <typename Block>
Block replace_params(Block b, const std::vector<at::Tensor>& params) {
  size_t k = 0;
  auto f = [&](at::Tensor& t) {
    if (!t.defined()) return;
    WEFT_ASSERT(k < params.size(), "with_params: ", params.size(), " tensors for more slots");
    t = params[k++];
  };
  visit(b, f);
  WEFT_ASSERT(k == params.size(), "with_params: ", params.size(), " tensors for ", k, " slots");
  return b;
}

}  // namespace

bool recomputing() { return g_recomputing; }

at::Tensor recompute(const BlockFn& block, const at::Tensor& x,
                     const std::vector<at::Tensor>& params) {
  bool any_grad = x.requires_grad();
  for (const at::Tensor& p : params) any_grad = any_grad || p.requires_grad();
  if (!at::GradMode::is_enabled() || !any_grad) return block(x, params);
  return Recompute::apply(x, at::TensorList(params), block);
}

std::vector<at::Tensor> block_params(const LlmBlock& b) { return gather_params(b); }
std::vector<at::Tensor> block_params(const EncoderBlock& b) { return gather_params(b); }
LlmBlock with_params(LlmBlock b, const std::vector<at::Tensor>& params) {
  return replace_params(std::move(b), params);
}
EncoderBlock with_params(EncoderBlock b, const std::vector<at::Tensor>& params) {
  return replace_params(std::move(b), params);
}

}  // namespace weft::model
