// Building blocks shared by the LLM and the encoders. Parameters are fp32 leaves held in a
// ParamSet; forward passes cast them to the thread's compute dtype on use (bf16 compute with
// fp32 master weights), so gradients land on the fp32 masters in fp32. A frozen module's cast
// parameters may instead be held in the compute dtype itself (ParamSet::hold_cast_params_in):
// the values forward passes use, with no fp32 master to keep and nothing to cast. ZeRO-1 under
// bf16 holds trained parameters so too, their fp32 masters sharded (dist::GradSync).
//
// Tensor parallelism (Megatron): a Scope may carry a Shard (this rank's tensor- and context-
// parallel groups). Column-parallel linears keep a slice of the output features, row-parallel
// ones a slice of the input features and all-reduce their partial outputs; attention keeps
// heads/tp query heads and kv_heads/tp K/V heads. Every parameter is initialised from its full
// shape with a generator seeded by (model seed, parameter name), then sliced: any layout holds
// exactly the values of the single-process model, whichever parameters a rank builds.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "weft/core/spec.h"
#include "weft/dist/comm.h"
#include "weft/model/chunked_attention.h"
#include "weft/model/mask.h"

namespace weft::model {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// How forward passes read a parameter: kCast ones through to_compute (matmul and convolution
// weights, biases, embeddings, positions, class tokens), kFp32 ones as they are (norms' weights
// and biases, MoE routers).
enum class ParamUse { kCast, kFp32 };

// How a tensor-parallel rank holds a parameter: along `dim` the full tensor is the concatenation
// of `segments` (sizes; empty = one segment, the whole dim), each split evenly over `size`
// ranks, and this rank keeps chunk `rank` of every segment (a fused QKV keeps its share of Q,
// of K and of V). size == 1: the whole tensor.
//
// partial_grad: whole on every TP rank, but used on this rank's part of the sequence only
// (sequence parallelism: norms, a row-parallel linear's bias), so each rank's gradient is a
// partial sum that the runtime sums over TP after backward.
struct Split {
  int64_t dim = 0;
  std::vector<int64_t> segments;
  int64_t rank = 0, size = 1;
  bool partial_grad = false;
  bool sharded() const { return size > 1; }
};
at::Tensor take_shard(const at::Tensor& full, const Split& split);
// The full tensor from every rank's shard, in rank order (the inverse of take_shard).
at::Tensor join_shards(const std::vector<at::Tensor>& shards, const Split& split);

// Owns the parameters of a model, in creation order, with hierarchical names
// ("llm.layers.0.attn.qkv.weight"), and how each is split. Not thread-safe while being built.
class ParamSet {
 public:
  // Parameters live on `device`; their values are made on the CPU (the same on every device).
  // draw = false: Scope::normal draws nothing and leaves the values unset, for a set whose
  // values are all copied in after (an evaluation copy of a model being trained).
  explicit ParamSet(c10::Device device = c10::kCPU, bool draw = true)
      : device_(device), draw_(draw) {}
  // Registers this rank's shard of the full `value` (made fp32, or the held dtype for a kCast
  // parameter; contiguous, requires_grad, on the set's device) under `name`; returns it.
  at::Tensor add(const std::string& name, at::Tensor value, Split split = {},
                 ParamUse use = ParamUse::kCast);
  // kCast parameters added from now on are held in `dtype` (default fp32). A frozen module's,
  // held in the compute dtype: rounded exactly as every use would cast them, so forward and
  // backward compute the same values as with fp32 masters, in half the memory and without the
  // casts. Such parameters train only where something else keeps their fp32 masters (ZeRO-1
  // under bf16 holds the parameters it shards in bf16 the same way: dist::GradSync).
  void hold_cast_params_in(at::ScalarType dtype) { cast_dtype_ = dtype; }
  const NamedTensors& all() const { return params_; }
  const Split& split(size_t k) const { return splits_[k]; }
  ParamUse use(size_t k) const { return uses_[k]; }
  c10::Device device() const { return device_; }
  bool draws() const { return draw_; }

 private:
  c10::Device device_;
  bool draw_;
  at::ScalarType cast_dtype_ = at::kFloat;
  NamedTensors params_;
  std::vector<Split> splits_;
  std::vector<ParamUse> uses_;
};

// This rank's groups for the module being built (default: one rank each, no parallelism).
struct Shard {
  dist::Comm tp;   // tensor parallel: heads, MLP features and vocabulary are split over it
  dist::Comm cp;   // context parallel (LLM): the sequence is split over it
  dist::Comm ep;   // expert parallel (MoE LLM): the experts are split over it
  dist::Comm etp;  // expert tensor parallel: expert weights are split over it (a subgroup of tp)
  // Sequence parallelism: outside the TP regions, activations [B, S, hidden] hold this rank's
  // S/tp positions along dim 1 (in tp-rank order); acts where tp > 1.
  bool sp = false;
  bool sequence_parallel() const { return sp && tp.size() > 1; }
  Split split(int64_t dim, std::vector<int64_t> segments = {}) const {
    return {dim, std::move(segments), tp.rank(), tp.size()};
  }
  // A parameter used whole between the TP regions (norms, row-parallel biases).
  Split whole() const {
    Split s;
    s.partial_grad = sequence_parallel();
    return s;
  }
  // These groups for layers whose tokens enter whole over TP (sp off): an MoE block's shared
  // expert, an encoder's projector.
  Shard without_sp() const {
    Shard g = *this;
    g.sp = false;
    return g;
  }
};

// Builder context: parameters go into `params`, named under `prefix`, sharded per `shard`.
struct Scope {
  ParamSet* params;
  std::string prefix;
  const Shard* shard = nullptr;  // null = unsharded
  Scope sub(const std::string& name) const { return {params, prefix + "." + name, shard}; }
  c10::Device device() const { return params->device(); }
  at::Tensor add(const std::string& name, at::Tensor v, Split split = {},
                 ParamUse use = ParamUse::kCast) const {
    return params->add(prefix + "." + name, std::move(v), std::move(split), use);
  }
  // A parameter ~ N(0, std) of full shape `shape` (see init_normal), this rank's shard of it.
  at::Tensor normal(const std::string& name, at::IntArrayRef shape, double std, Split split = {},
                    ParamUse use = ParamUse::kCast) const;
  const Shard& groups() const;
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
// A floating tensor cast to the compute dtype (no-op when it already is). Inside a CastOnce
// scope, a parameter's cast is made once and shared. A parameter whose value is still on its
// way (expect_values) is waited for first.
at::Tensor to_compute(const at::Tensor& t);

// Parameter values still on their way: ZeRO-1's all-gather of the stepped parameters, left in
// flight into the next step's forward (dist::GradSync). expect_values(params, arrive) registers
// a group of parameters whose storage will be written when `arrive` runs; arrive() must make
// them current and call values_arrived(id) (it may be called again, or from two threads at
// once, before that takes effect: it must be idempotent and thread-safe). Until then, a read of
// any of them through arrived() — and so through to_compute, which every forward read of a
// kCast parameter goes through — runs arrive() first. Reads are matched by address range, so
// views and slices of a parameter count. A forward that reads a kCast parameter's value
// otherwise (an embedding's rows) must pass it through arrived(). Thread-safe; while nothing is
// expected it costs an atomic load.
using ArrivalId = uint64_t;
ArrivalId expect_values(const std::vector<at::Tensor>& params, std::function<void()> arrive);
void values_arrived(ArrivalId id);
// `t`, once its value is current: runs the arrive() of the group holding it, if any.
const at::Tensor& arrived(const at::Tensor& t);

// Parameters cast to the compute dtype once per scope (the microbatches of a training step, an
// evaluation) instead of at every use. Without it, every microbatch and every pipeline op casts
// each fp32 master again, and 1F1B keeps one bf16 copy of a stage's weights alive per microbatch
// in flight (each forward's cast is saved for its backward). With it, one cast per parameter and
// scope, shared; every use still has its own gradient edge to the parameter (the gradient cast
// back to its dtype, as the cast's own backward does), so gradients, hooks and their order are
// unchanged.
//
// Only `params` are looked up (by storage address, shape, strides, dtype and device, so the
// detached aliases a recomputed block sees match too): inputs and activations, whose memory the
// allocator reuses, never are. `keep` says which casts are kept:
//   kForBackward casts made in grad mode, outside a recomputed block, trained parameters' and
//                frozen ones' alike (a frozen LLM that passes gradients back to a projector):
//                autograd saves nearly all of those for backward anyway (a linear layer keeps its
//                weight to pass the gradient to its input; not biases, nor the weights of a
//                layer whose input needs no gradient), so with several microbatches they are
//                held at the peak anyway. Casts made without grad mode (a module that needs no
//                backward, a recomputed block's forward) or recomputing in backward are made at
//                each use, as without a scope. End the scope when the last backward is done.
//   kEverything  every parameter's cast, for the scope (evaluation and generation: the weights
//                do not change, and every generated token would cast them all again).
// The parameters must not change while the scope lives (one that does, by an in-place op, is
// cast again). One scope per thread at a time (the innermost counts).
class CastOnce {
 public:
  enum class Keep { kForBackward, kEverything };
  CastOnce(const NamedTensors& params, Keep keep);
  ~CastOnce();
  CastOnce(const CastOnce&) = delete;
  CastOnce& operator=(const CastOnce&) = delete;

  int64_t casts() const;          // casts made and kept so far
  int64_t shared() const;         // uses served by a kept cast
  static int64_t shared_total();  // uses served by a kept cast, every scope of the process

  // The scope's state, for work of the scope that runs on another thread (a recomputed block's
  // backward on an autograd device thread): current() on the scope's thread, then a Resume
  // there. A Resume of a scope that has ended means no scope until the Resume ends.
  struct Cache;
  static std::weak_ptr<Cache> current();
  class Resume {
   public:
    explicit Resume(const std::weak_ptr<Cache>& cache);
    ~Resume();
    Resume(const Resume&) = delete;
    Resume& operator=(const Resume&) = delete;

   private:
    std::shared_ptr<Cache> held_;
    Cache* saved_;
  };

 private:
  std::shared_ptr<Cache> cache_;
  Cache* saved_;
};

// Initialisation: the full tensor ~ N(0, std), drawn from a generator seeded by this thread's
// model seed (InitSeedGuard; 0 without one) and `name`: deterministic, independent of other
// threads and of which other parameters were built.
at::Tensor init_normal(const std::string& name, at::IntArrayRef shape, double std);

// Sets this thread's model seed for the guard's lifetime.
class InitSeedGuard {
 public:
  explicit InitSeedGuard(uint64_t seed);
  ~InitSeedGuard();
  InitSeedGuard(const InitSeedGuard&) = delete;
  InitSeedGuard& operator=(const InitSeedGuard&) = delete;

 private:
  uint64_t saved_;
};

// Column-parallel: output features split over TP, the input's gradient all-reduced
// (dist::column_linear); row-parallel: input features split, partial outputs all-reduced, bias
// added once after. Under sequence parallelism the input of a column-parallel linear is
// all-gathered along the sequence and a row-parallel one's output reduce-scattered
// (dist::column_linear, dist::scatter_along).
enum class Par { kNone, kColumn, kRow };

struct Linear {
  at::Tensor weight, bias;  // [out, in], [out] or undefined (this rank's shards)
  Par par = Par::kNone;
  dist::Comm tp;
  bool sp = false;  // Shard::sequence_parallel()
  // `segments`: the fused output blocks of a column-parallel weight (each split on its own).
  static Linear make(const Scope& s, int64_t in, int64_t out, bool bias, double std = 0.02,
                     Par par = Par::kNone, std::vector<int64_t> segments = {});
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
// (rotate-half convention, as in Llama / Hugging Face), with optional Llama-3.1 frequency
// scaling.
struct Rope {
  at::Tensor cos, sin;
  at::Tensor rot_sin;  // sin with its first half negated: rotate_half(x)·sin = roll(x, D/2)·rot_sin
  static Rope make(const at::Tensor& positions, int64_t head_dim, double theta,
                   const RopeScaling& scaling = {});
};
// x: [B, S, H, D].
at::Tensor apply_rope(const at::Tensor& x, const Rope& rope);

// Keys and values of the positions decoded so far, per attention layer, for greedy or sampled
// decoding one token at a time (Llm::decode): buffers of `capacity` positions, RoPE applied.
// Filled by the first Llm::decode call, or by a forward whose mask has `keep_kv` (a prefill in
// the training layout: each of a rank's attention layers in turn, under CP every rank's keys).
struct KvCache {
  int64_t capacity = 0;
  int64_t length = 0;            // positions held
  std::vector<at::Tensor> k, v;  // per layer: [B, kv_heads, capacity, head_dim]
  // Keeps the next layer's keys and values k, v [B, S, kv_heads, head_dim] (then length = S).
  void keep(const at::Tensor& k, const at::Tensor& v);
};

// Context parallelism: this rank holds S_local of the sequence's S tokens. Attention gathers
// K/V from every CP rank (dK/dV return to their owners) and reorders them with `kv_order`
// (int64 [S]: for each original position, its index in the rank-order concatenation of every
// rank's local tokens; undefined when that concatenation is already in order), so `visible`
// [B, 1, S_local, S] addresses keys by original position.
struct AttentionMask {
  AttentionMask() = default;
  AttentionMask(at::Tensor visible, at::Tensor kv_order = {})  // NOLINT: implicit by design
      : visible(std::move(visible)), kv_order(std::move(kv_order)) {}
  at::Tensor visible;   // bool [B, 1, S_q, S_k], true = may attend; undefined = all visible
  at::Tensor kv_order;  // undefined without context parallelism
  // `visible` as attention takes it (compat::attention_mask): made once for all the blocks
  // of a forward (Llm::blocks_forward); undefined = take `visible`.
  at::Tensor prepared;
  // Blocks of queries and the tiles of keys they see (model::attention_chunks; empty = one
  // attention over all keys), and the masked tiles' parts of the mask, made once per forward
  // (Llm::blocks_forward) where LibTorch has the tile kernels (model::chunked_attention).
  std::vector<AttentionChunk> chunks;
  ChunkMasks chunk_masks;
  // Where each attention run with this mask keeps its keys and values (KvCache::keep, in the
  // order the layers run); null = nowhere.
  KvCache* keep_kv = nullptr;
};

// Multi-head self-attention with grouped K/V heads and one fused QKV projection (column-
// parallel; heads and kv_heads split over TP) and a row-parallel output projection, each with
// or without a bias (Llama: none; Qwen2: QKV only; ViT / Whisper: both).
struct Attention {
  Linear qkv, out;
  int64_t heads = 1, kv_heads = 1, head_dim = 1;  // heads and kv_heads on this rank
  dist::Comm cp;
  static Attention make(const Scope& s, int64_t hidden, int64_t heads, int64_t kv_heads,
                        bool qkv_bias, bool out_bias, double out_std);
  // rope may be null.
  at::Tensor operator()(const at::Tensor& x, const AttentionMask& mask, const Rope* rope) const;
  // Incremental decoding (this rank's heads): x [B, n, hidden] holds the positions after the
  // `length` ones whose keys and values `k` and `v` ([B, kv_heads, capacity, D], RoPE applied)
  // already hold; theirs are written after them, and x's queries attend over all length + n.
  // `visible`: [B, 1, n, length + n] as attention takes it, or undefined (all). No CP
  // collective: under CP the cache holds every rank's keys, and every rank decodes the same x.
  at::Tensor cached(const at::Tensor& x, const at::Tensor& visible, const Rope& rope,
                    const at::Tensor& k, const at::Tensor& v, int64_t length) const;
  // q, k, v [B, S, heads | kv_heads, D] of x, RoPE applied to q and k when given.
  std::array<at::Tensor, 3> project(const at::Tensor& x, const Rope* rope) const;
};

// SwiGLU MLP (fused gate/up, column-parallel; down row-parallel): down(silu(gate(x)) * up(x)).
struct SwiGlu {
  Linear gate_up, down;
  static SwiGlu make(const Scope& s, int64_t hidden, int64_t ffn, double out_std);
  at::Tensor operator()(const at::Tensor& x) const;
};

// The activation of an encoder MLP (exact GELU, quick GELU, tanh GELU).
at::Tensor activate(const at::Tensor& x, Activation act);

// GELU MLP: fc2(act(fc1(x))); fc1 column-parallel, fc2 row-parallel.
struct GeluMlp {
  Linear fc1, fc2;
  Activation act = Activation::kGelu;
  static GeluMlp make(const Scope& s, int64_t in, int64_t ffn, int64_t out, double out_std,
                      Activation act = Activation::kGelu);
  at::Tensor operator()(const at::Tensor& x) const;
};

// Pre-LN transformer block with a GELU MLP (ViT / Whisper encoders): bidirectional within
// whatever `visible` allows (nullptr = everything visible).
struct EncoderBlock {
  LayerNorm ln1, ln2;
  Attention attn;
  GeluMlp mlp;
  static EncoderBlock make(const Scope& s, int64_t hidden, int64_t heads, int64_t ffn, double eps,
                           int64_t layers, Activation act = Activation::kGelu);
  at::Tensor operator()(const at::Tensor& x) const;
};

}  // namespace weft::model
