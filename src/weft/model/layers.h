// Building blocks shared by the LLM and the encoders. Parameters are fp32 leaves held in a
// ParamSet; forward passes cast them to the thread's compute dtype on use (bf16 compute with
// fp32 master weights), so gradients land on the fp32 masters in fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace weft::model {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Owns the parameters of a model, in creation order, with hierarchical names
// ("llm.layers.0.attn.qkv.weight"). Not thread-safe while being built.
class ParamSet {
 public:
  // Registers `value` (made fp32, contiguous, requires_grad) under `name`; returns it.
  at::Tensor add(const std::string& name, at::Tensor value);
  const NamedTensors& all() const { return params_; }

 private:
  NamedTensors params_;
};

// Builder context: parameters go into `params`, named under `prefix`.
struct Scope {
  ParamSet* params;
  std::string prefix;
  Scope sub(const std::string& name) const { return {params, prefix + "." + name}; }
  at::Tensor add(const std::string& name, at::Tensor v) const {
    return params->add(prefix + "." + name, std::move(v));
  }
};

// The dtype forward passes compute in on this thread (kFloat or kBFloat16).
at::ScalarType compute_dtype();
class ComputeDtypeGuard {
 public:
  explicit ComputeDtypeGuard(at::ScalarType dtype);
  ~ComputeDtypeGuard();
  ComputeDtypeGuard(const ComputeDtypeGuard&) = delete;
  ComputeDtypeGuard& operator=(const ComputeDtypeGuard&) = delete;

 private:
  at::ScalarType saved_;
};
// A floating tensor cast to the compute dtype (no-op when it already is).
at::Tensor to_compute(const at::Tensor& t);

// Initialisation: weights ~ N(0, std), drawn from the current thread's InitSeedGuard
// generator if one is active, else from torch's global generator.
at::Tensor init_normal(at::IntArrayRef shape, double std);

// Gives this thread a private initialisation generator seeded with `seed` for the guard's
// lifetime, so building a model is deterministic whatever other threads draw.
class InitSeedGuard {
 public:
  explicit InitSeedGuard(uint64_t seed);
  ~InitSeedGuard();
  InitSeedGuard(const InitSeedGuard&) = delete;
  InitSeedGuard& operator=(const InitSeedGuard&) = delete;
};

struct Linear {
  at::Tensor weight, bias;  // [out, in], [out] or undefined
  static Linear make(const Scope& s, int64_t in, int64_t out, bool bias, double std = 0.02);
  at::Tensor operator()(const at::Tensor& x) const;
};

struct RmsNorm {
  at::Tensor weight;
  double eps = 1e-5;
  static RmsNorm make(const Scope& s, int64_t dim, double eps);
  at::Tensor operator()(const at::Tensor& x) const;  // computed in fp32, returned in x's dtype
};

struct LayerNorm {
  at::Tensor weight, bias;
  double eps = 1e-5;
  static LayerNorm make(const Scope& s, int64_t dim, double eps);
  at::Tensor operator()(const at::Tensor& x) const;
};

// Rotary embedding tables for positions [B, S]: cos/sin of shape [B, S, 1, head_dim]
// (rotate-half convention, as in Llama / Hugging Face).
struct Rope {
  at::Tensor cos, sin;
  static Rope make(const at::Tensor& positions, int64_t head_dim, double theta);
};
// x: [B, S, H, D].
at::Tensor apply_rope(const at::Tensor& x, const Rope& rope);

// Multi-head self-attention with grouped K/V heads and one fused QKV projection.
// `visible` is the boolean mask [B, 1, S, S] (true = may attend); rope may be null.
struct Attention {
  Linear qkv, out;
  int64_t heads = 1, kv_heads = 1, head_dim = 1;
  static Attention make(const Scope& s, int64_t hidden, int64_t heads, int64_t kv_heads, bool bias,
                        double out_std);
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& visible, const Rope* rope) const;
};

// SwiGLU MLP (fused gate/up): down(silu(gate(x)) * up(x)).
struct SwiGlu {
  Linear gate_up, down;
  static SwiGlu make(const Scope& s, int64_t hidden, int64_t ffn, double out_std);
  at::Tensor operator()(const at::Tensor& x) const;
};

// GELU MLP: fc2(gelu(fc1(x))).
struct GeluMlp {
  Linear fc1, fc2;
  static GeluMlp make(const Scope& s, int64_t in, int64_t ffn, int64_t out, double out_std);
  at::Tensor operator()(const at::Tensor& x) const;
};

// Pre-LN transformer block with a GELU MLP (ViT / Whisper encoders): bidirectional within
// whatever `visible` allows (nullptr = everything visible).
struct EncoderBlock {
  LayerNorm ln1, ln2;
  Attention attn;
  GeluMlp mlp;
  static EncoderBlock make(const Scope& s, int64_t hidden, int64_t heads, int64_t ffn, double eps,
                           int64_t layers);
  at::Tensor operator()(const at::Tensor& x) const;
};

}  // namespace weft::model
