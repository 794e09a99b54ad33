#include "weft/model/layers.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>

#include "weft/core/error.h"
#include "weft/model/torch_compat.h"

namespace weft::model {

at::Tensor ParamSet::add(const std::string& name, at::Tensor value) {
  for (const auto& [n, _] : params_) WEFT_ASSERT(n != name, "duplicate parameter ", name);
  at::Tensor p = value.to(at::kFloat).contiguous().detach().set_requires_grad(true);
  params_.emplace_back(name, p);
  return p;
}

namespace {
thread_local at::ScalarType t_compute_dtype = at::kFloat;
}

at::ScalarType compute_dtype() { return t_compute_dtype; }
ComputeDtypeGuard::ComputeDtypeGuard(at::ScalarType dtype) : saved_(t_compute_dtype) {
  t_compute_dtype = dtype;
}
ComputeDtypeGuard::~ComputeDtypeGuard() { t_compute_dtype = saved_; }

at::Tensor to_compute(const at::Tensor& t) {
  if (!t.defined() || t.scalar_type() == t_compute_dtype || !t.is_floating_point()) return t;
  return t.to(t_compute_dtype);
}

namespace {
thread_local c10::optional<at::Generator> t_init_generator;
}

InitSeedGuard::InitSeedGuard(uint64_t seed) {
  WEFT_ASSERT(!t_init_generator.has_value(), "nested InitSeedGuard");
  t_init_generator = at::detail::createCPUGenerator(seed);
}
InitSeedGuard::~InitSeedGuard() { t_init_generator.reset(); }

at::Tensor init_normal(at::IntArrayRef shape, double std) {
  return torch::randn(shape, t_init_generator, torch::kFloat).mul_(std);
}

Linear Linear::make(const Scope& s, int64_t in, int64_t out, bool bias, double std) {
  Linear l;
  l.weight = s.add("weight", init_normal({out, in}, std));
  if (bias) l.bias = s.add("bias", torch::zeros({out}));
  return l;
}

at::Tensor Linear::operator()(const at::Tensor& x) const {
  return at::linear(x, to_compute(weight), to_compute(bias));
}

RmsNorm RmsNorm::make(const Scope& s, int64_t dim, double eps) {
  return {s.add("weight", torch::ones({dim})), eps};
}

at::Tensor RmsNorm::operator()(const at::Tensor& x) const {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, true).add(eps)) * weight;
  return y.to(x.scalar_type());
}

LayerNorm LayerNorm::make(const Scope& s, int64_t dim, double eps) {
  return {s.add("weight", torch::ones({dim})), s.add("bias", torch::zeros({dim})), eps};
}

at::Tensor LayerNorm::operator()(const at::Tensor& x) const {
  return at::layer_norm(x.to(at::kFloat), {weight.size(0)}, weight, bias, eps).to(x.scalar_type());
}

Rope Rope::make(const at::Tensor& positions, int64_t head_dim, double theta) {
  const int64_t half = head_dim / 2;
  at::Tensor inv_freq =
      torch::pow(theta, torch::arange(0, half, torch::kDouble).mul(-2.0 / head_dim));
  at::Tensor angle = positions.to(torch::kDouble).unsqueeze(-1) * inv_freq;  // [B, S, half]
  angle = torch::cat({angle, angle}, -1).unsqueeze(2);                       // [B, S, 1, D]
  return {angle.cos().to(torch::kFloat), angle.sin().to(torch::kFloat)};
}

at::Tensor apply_rope(const at::Tensor& x, const Rope& rope) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  at::Tensor rotated = torch::cat({x2.neg(), x1}, -1);
  return x * rope.cos.to(x.scalar_type()) + rotated * rope.sin.to(x.scalar_type());
}

Attention Attention::make(const Scope& s, int64_t hidden, int64_t heads, int64_t kv_heads,
                          bool bias, double out_std) {
  Attention a;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = hidden / heads;
  a.qkv = Linear::make(s.sub("qkv"), hidden, (heads + 2 * kv_heads) * a.head_dim, bias);
  a.out = Linear::make(s.sub("out"), heads * a.head_dim, hidden, bias, out_std);
  return a;
}

at::Tensor Attention::operator()(const at::Tensor& x, const at::Tensor& visible,
                                 const Rope* rope) const {
  const int64_t B = x.size(0), S = x.size(1), D = head_dim;
  at::Tensor qkv = this->qkv(x).view({B, S, heads + 2 * kv_heads, D});
  at::Tensor q = qkv.narrow(2, 0, heads);
  at::Tensor k = qkv.narrow(2, heads, kv_heads);
  at::Tensor v = qkv.narrow(2, heads + kv_heads, kv_heads);
  if (rope) {
    q = apply_rope(q, *rope);
    k = apply_rope(k, *rope);
  }
  q = q.transpose(1, 2);  // [B, H, S, D]
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  if (kv_heads != heads) {  // grouped-query: each K/V head serves heads/kv_heads query heads
    const int64_t rep = heads / kv_heads;
    k = k.unsqueeze(2).expand({B, kv_heads, rep, S, D}).reshape({B, heads, S, D});
    v = v.unsqueeze(2).expand({B, kv_heads, rep, S, D}).reshape({B, heads, S, D});
  }
  at::Tensor o = compat::attention(q, k, v, visible, 1.0 / std::sqrt(static_cast<double>(D)));
  return out(o.transpose(1, 2).reshape({B, S, heads * D}));
}

SwiGlu SwiGlu::make(const Scope& s, int64_t hidden, int64_t ffn, double out_std) {
  return {Linear::make(s.sub("gate_up"), hidden, 2 * ffn, false),
          Linear::make(s.sub("down"), ffn, hidden, false, out_std)};
}

at::Tensor SwiGlu::operator()(const at::Tensor& x) const {
  at::Tensor gu = gate_up(x);
  const int64_t f = gu.size(-1) / 2;
  return down(at::silu(gu.narrow(-1, 0, f)) * gu.narrow(-1, f, f));
}

GeluMlp GeluMlp::make(const Scope& s, int64_t in, int64_t ffn, int64_t out, double out_std) {
  return {Linear::make(s.sub("fc1"), in, ffn, true),
          Linear::make(s.sub("fc2"), ffn, out, true, out_std)};
}

at::Tensor GeluMlp::operator()(const at::Tensor& x) const { return fc2(compat::gelu(fc1(x))); }

EncoderBlock EncoderBlock::make(const Scope& s, int64_t hidden, int64_t heads, int64_t ffn,
                                double eps, int64_t layers) {
  const double out_std = 0.02 / std::sqrt(2.0 * static_cast<double>(layers));
  EncoderBlock b;
  b.ln1 = LayerNorm::make(s.sub("ln1"), hidden, eps);
  b.attn = Attention::make(s.sub("attn"), hidden, heads, heads, true, out_std);
  b.ln2 = LayerNorm::make(s.sub("ln2"), hidden, eps);
  b.mlp = GeluMlp::make(s.sub("mlp"), hidden, ffn, hidden, out_std);
  return b;
}

at::Tensor EncoderBlock::operator()(const at::Tensor& x) const {
  at::Tensor h = x + attn(ln1(x), at::Tensor(), nullptr);
  return h + mlp(ln2(h));
}

}  // namespace weft::model
