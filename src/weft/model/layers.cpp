#include "weft/model/layers.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>

#include "weft/core/error.h"
#include "weft/dist/collectives.h"
#include "weft/model/chunked_attention.h"
#include "weft/model/fused.h"
#include "weft/model/recompute.h"
#include "weft/model/torch_compat.h"

namespace weft::model {

at::Tensor take_shard(const at::Tensor& full, const Split& split) {
  if (!split.sharded()) return full;
  const int64_t dim = split.dim;
  std::vector<int64_t> segs = split.segments;
  if (segs.empty()) segs = {full.size(dim)};
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (int64_t seg : segs) {
    WEFT_ASSERT(seg % split.size == 0, "segment of ", seg, " does not split over ", split.size);
    const int64_t chunk = seg / split.size;
    parts.push_back(full.narrow(dim, offset + split.rank * chunk, chunk));
    offset += seg;
  }
  WEFT_ASSERT(offset == full.size(dim), "segments do not cover dim ", dim);
  return parts.size() == 1 ? parts[0] : torch::cat(parts, dim);
}

at::Tensor join_shards(const std::vector<at::Tensor>& shards, const Split& split) {
  WEFT_ASSERT(static_cast<int64_t>(shards.size()) == split.size, "join_shards: ", shards.size(),
              " shards for a split over ", split.size);
  if (!split.sharded()) return shards[0];
  const int64_t dim = split.dim;
  const int64_t local = shards[0].size(dim);
  std::vector<int64_t> segs = split.segments;
  if (segs.empty()) segs = {local * split.size};
  std::vector<at::Tensor> parts;
  int64_t offset = 0;  // within each shard
  for (int64_t seg : segs) {
    const int64_t chunk = seg / split.size;
    for (const at::Tensor& s : shards) parts.push_back(s.narrow(dim, offset, chunk));
    offset += chunk;
  }
  return torch::cat(parts, dim);
}

at::Tensor ParamSet::add(const std::string& name, at::Tensor value, Split split, ParamUse use) {
  for (const auto& [n, _] : params_) WEFT_ASSERT(n != name, "duplicate parameter ", name);
  // Rounded from fp32, as to_compute rounds an fp32 master.
  at::Tensor p = take_shard(value, split)
                     .to(at::kFloat)
                     .to(use == ParamUse::kCast ? cast_dtype_ : at::kFloat)
                     .contiguous()
                     .detach()
                     .clone()
                     .to(device_)
                     .set_requires_grad(true);
  params_.emplace_back(name, p);
  splits_.push_back(std::move(split));
  uses_.push_back(use);
  return p;
}

namespace {
const Shard kNoShard;
}

const Shard& Scope::groups() const { return shard ? *shard : kNoShard; }

at::Tensor Scope::normal(const std::string& name, at::IntArrayRef shape, double std, Split split,
                         ParamUse use) const {
  // A meta-device model has shapes only: no values to draw.
  if (device().is_meta()) return add(name, torch::empty(shape, at::kMeta), std::move(split), use);
  if (!params->draws()) return add(name, torch::empty(shape), std::move(split), use);
  return add(name, init_normal(prefix + "." + name, shape, std), std::move(split), use);
}

namespace {
thread_local at::ScalarType t_compute_dtype = at::kFloat;
}

at::ScalarType compute_dtype() { return t_compute_dtype; }
ComputeDtypeGuard::ComputeDtypeGuard(at::ScalarType dtype) : saved_(t_compute_dtype) {
  t_compute_dtype = dtype;
}
ComputeDtypeGuard::~ComputeDtypeGuard() { t_compute_dtype = saved_; }

namespace {
// A kept cast handed to one use: its own autograd node, whose backward casts the gradient back
// to the parameter's dtype (what the cast's ToCopyBackward would do).
struct SharedCastFn : torch::autograd::Function<SharedCastFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& param,
                            const at::Tensor* cast) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(param.scalar_type());
    ctx->set_materialize_grads(false);  // an undefined gradient stays undefined, as ToCopy's
    return cast->detach();              // a new tensor on the cast's storage, for this node to own
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad[0].defined() ? grad[0].to(dtype) : grad[0], at::Tensor()};
  }
};

std::atomic<int64_t> g_shared_total{0};
}  // namespace

struct CastOnce::Cache {
  struct Entry {
    at::Tensor param;     // the registered parameter (its shape, strides, dtype and device)
    at::Tensor cast;      // undefined until kept
    int64_t version = 0;  // the parameter's version counter when cast
  };
  std::vector<Entry> entries;
  std::vector<std::pair<const void*, size_t>> by_address;  // sorted: data pointer, entry
  Keep keep = Keep::kForBackward;
  int64_t casts = 0, shared = 0;
  std::mutex mu;              // a recomputed block's backward may run on an autograd device thread
  std::weak_ptr<Cache> self;  // for current()

  // to_compute(t) from the cache; undefined when t is none of the parameters, or when its cast
  // is neither kept nor to be kept.
  at::Tensor find(const at::Tensor& t) {
    if (t.numel() == 0) return {};
    const void* address = t.data_ptr();
    std::lock_guard<std::mutex> lock(mu);
    auto it =
        std::lower_bound(by_address.begin(), by_address.end(), std::make_pair(address, size_t{0}));
    for (; it != by_address.end() && it->first == address; ++it) {
      Entry& e = entries[it->second];
      if (e.param.sizes() != t.sizes() || e.param.strides() != t.strides() ||
          e.param.scalar_type() != t.scalar_type() || e.param.device() != t.device())
        continue;
      const bool grad = at::GradMode::is_enabled() && t.requires_grad();
      // Cast again if the parameter was written since (the scope's contract says it is not;
      // the version counter, shared with its aliases, checks it).
      if (!e.cast.defined() || e.cast.scalar_type() != t_compute_dtype ||
          e.version != t._version()) {
        if (keep == Keep::kForBackward && (!at::GradMode::is_enabled() || recomputing())) return {};
        at::NoGradGuard no_grad;
        e.cast = t.detach().to(t_compute_dtype);
        e.version = t._version();
        ++casts;
      } else {
        ++shared;
        ++g_shared_total;
      }
      return grad ? SharedCastFn::apply(t, &e.cast) : e.cast.detach();
    }
    return {};
  }
};

namespace {
thread_local CastOnce::Cache* t_cast_once = nullptr;
}

CastOnce::CastOnce(const NamedTensors& params, Keep keep)
    : cache_(std::make_shared<Cache>()), saved_(t_cast_once) {
  cache_->keep = keep;
  cache_->self = cache_;
  for (const auto& [name, p] : params) {
    if (!p.defined() || p.numel() == 0 || !p.is_floating_point()) continue;
    cache_->by_address.emplace_back(p.data_ptr(), cache_->entries.size());
    cache_->entries.push_back({p, {}});
  }
  std::sort(cache_->by_address.begin(), cache_->by_address.end());
  t_cast_once = cache_.get();
}
CastOnce::~CastOnce() { t_cast_once = saved_; }

int64_t CastOnce::casts() const {
  std::lock_guard<std::mutex> lock(cache_->mu);
  return cache_->casts;
}
int64_t CastOnce::shared() const {
  std::lock_guard<std::mutex> lock(cache_->mu);
  return cache_->shared;
}

int64_t CastOnce::shared_total() { return g_shared_total; }

std::weak_ptr<CastOnce::Cache> CastOnce::current() {
  return t_cast_once ? t_cast_once->self : std::weak_ptr<Cache>();
}

CastOnce::Resume::Resume(const std::weak_ptr<Cache>& cache)
    : held_(cache.lock()), saved_(t_cast_once) {
  t_cast_once = held_.get();  // the scope's, or none when it has ended
}
CastOnce::Resume::~Resume() { t_cast_once = saved_; }

namespace {
// expect_values' registry: the byte ranges of the parameters of every group still expected.
struct Expected {
  std::mutex mu;
  struct Range {
    uintptr_t begin, end;
    ArrivalId id;
  };
  std::vector<Range> ranges;  // sorted by begin; parameters never overlap
  std::map<ArrivalId, std::shared_ptr<const std::function<void()>>> arrive;
  ArrivalId next = 1;
  std::atomic<size_t> groups{0};
};
Expected& expected() {
  static Expected* e = new Expected;  // never destroyed: GradSyncs may outlive static teardown
  return *e;
}
}  // namespace

ArrivalId expect_values(const std::vector<at::Tensor>& params, std::function<void()> arrive) {
  Expected& e = expected();
  std::lock_guard<std::mutex> lock(e.mu);
  const ArrivalId id = e.next++;
  for (const at::Tensor& p : params) {
    if (!p.defined() || p.numel() == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(p.data_ptr());
    e.ranges.push_back({begin, begin + p.numel() * p.element_size(), id});
  }
  std::sort(e.ranges.begin(), e.ranges.end(),
            [](const Expected::Range& a, const Expected::Range& b) { return a.begin < b.begin; });
  e.arrive.emplace(id, std::make_shared<const std::function<void()>>(std::move(arrive)));
  e.groups.store(e.arrive.size(), std::memory_order_release);
  return id;
}

void values_arrived(ArrivalId id) {
  Expected& e = expected();
  std::lock_guard<std::mutex> lock(e.mu);
  e.ranges.erase(std::remove_if(e.ranges.begin(), e.ranges.end(),
                                [id](const Expected::Range& r) { return r.id == id; }),
                 e.ranges.end());
  e.arrive.erase(id);
  e.groups.store(e.arrive.size(), std::memory_order_release);
}

const at::Tensor& arrived(const at::Tensor& t) {
  Expected& e = expected();
  if (e.groups.load(std::memory_order_acquire) == 0 || !t.defined() || t.numel() == 0) return t;
  std::shared_ptr<const std::function<void()>> arrive;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
    auto it = std::upper_bound(e.ranges.begin(), e.ranges.end(), address,
                               [](uintptr_t a, const Expected::Range& r) { return a < r.begin; });
    if (it == e.ranges.begin() || address >= std::prev(it)->end) return t;
    arrive = e.arrive.at(std::prev(it)->id);
  }
  (*arrive)();  // outside the registry's lock: it waits for a transfer, and calls values_arrived
  return t;
}

at::Tensor to_compute(const at::Tensor& t) {
  arrived(t);
  if (!t.defined() || t.scalar_type() == t_compute_dtype || !t.is_floating_point()) return t;
  if (t_cast_once) {
    at::Tensor cast = t_cast_once->find(t);
    if (cast.defined()) return cast;
  }
  return t.to(t_compute_dtype);
}

namespace {
thread_local uint64_t t_model_seed = 0;

uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

InitSeedGuard::InitSeedGuard(uint64_t seed) : saved_(t_model_seed) { t_model_seed = seed; }
InitSeedGuard::~InitSeedGuard() { t_model_seed = saved_; }

at::Tensor init_normal(const std::string& name, at::IntArrayRef shape, double std) {
  // splitmix64 of (seed, name) so nearby seeds and names give unrelated streams.
  uint64_t z = fnv1a(name, 1469598103934665603ull) + t_model_seed * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  at::Generator gen = at::detail::createCPUGenerator(z);
  return torch::randn(shape, gen, torch::kFloat).mul_(std);
}

Linear Linear::make(const Scope& s, int64_t in, int64_t out, bool bias, double std, Par par,
                    std::vector<int64_t> segments) {
  Linear l;
  const Shard& g = s.groups();
  l.par = par;
  l.tp = g.tp;
  l.sp = par != Par::kNone && g.sequence_parallel();
  if (par == Par::kColumn) {
    l.weight = s.normal("weight", {out, in}, std, g.split(0, segments));
    if (bias) l.bias = s.add("bias", torch::zeros({out}), g.split(0, segments));
  } else {
    l.weight = s.normal("weight", {out, in}, std, par == Par::kRow ? g.split(1) : Split{});
    if (bias) l.bias = s.add("bias", torch::zeros({out}), par == Par::kRow ? g.whole() : Split{});
  }
  return l;
}

at::Tensor Linear::operator()(const at::Tensor& x) const {
  switch (par) {
    case Par::kColumn:
      return dist::column_linear(x, to_compute(weight), to_compute(bias), tp, sp ? 1 : -1);
    case Par::kRow: {
      const at::Tensor partial = at::linear(x, to_compute(weight));
      at::Tensor y = sp ? dist::scatter_along(partial, tp, 1) : dist::reduce_from(partial, tp);
      return bias.defined() ? y + to_compute(bias) : y;
    }
    case Par::kNone:
      break;
  }
  return at::linear(x, to_compute(weight), to_compute(bias));
}

RmsNorm RmsNorm::make(const Scope& s, int64_t dim, double eps) {
  return {s.add("weight", torch::ones({dim}), s.groups().whole(), ParamUse::kFp32), eps};
}

at::Tensor RmsNorm::operator()(const at::Tensor& x) const { return rms_norm(x, weight, eps); }

LayerNorm LayerNorm::make(const Scope& s, int64_t dim, double eps) {
  return {s.add("weight", torch::ones({dim}), s.groups().whole(), ParamUse::kFp32),
          s.add("bias", torch::zeros({dim}), s.groups().whole(), ParamUse::kFp32), eps};
}

at::Tensor LayerNorm::operator()(const at::Tensor& x) const {
  return layer_norm(x, weight, bias, eps);
}

Rope Rope::make(const at::Tensor& positions, int64_t head_dim, double theta,
                const RopeScaling& scaling) {
  const int64_t half = head_dim / 2;
  at::Tensor inv_freq = torch::pow(
      theta,
      torch::arange(0, half, positions.options().dtype(torch::kDouble)).mul(-2.0 / head_dim));
  if (scaling.llama3) {  // transformers' _compute_llama3_parameters
    const double old_len = static_cast<double>(scaling.original_max_position);
    const double low_wavelen = old_len / scaling.low_freq_factor;
    const double high_wavelen = old_len / scaling.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor scaled = torch::where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq);
    at::Tensor smooth = (old_len / wavelen - scaling.low_freq_factor) /
                        (scaling.high_freq_factor - scaling.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    inv_freq = torch::where(medium, smoothed, scaled);
  }
  at::Tensor angle = positions.to(torch::kDouble).unsqueeze(-1) * inv_freq;  // [B, S, half]
  angle = torch::cat({angle, angle}, -1).unsqueeze(2);                       // [B, S, 1, D]
  at::Tensor sin = angle.sin().to(torch::kFloat);
  at::Tensor sign = torch::ones({head_dim}, sin.options());
  sign.narrow(0, 0, half).fill_(-1);
  return {angle.cos().to(torch::kFloat), sin, sin * sign};
}

at::Tensor apply_rope(const at::Tensor& x, const Rope& rope) {
  return model::rope(x, rope.cos, rope.rot_sin);  // fused.h
}

void KvCache::keep(const at::Tensor& k_in, const at::Tensor& v_in) {
  const int64_t B = k_in.size(0), S = k_in.size(1), heads = k_in.size(2), D = k_in.size(3);
  WEFT_ASSERT(S <= capacity, "KvCache::keep: ", S, " positions in a cache of ", capacity);
  WEFT_ASSERT(k.empty() || length == S, "KvCache::keep: ", S, " positions after layers of ",
              length);
  for (auto [from, to] : {std::make_pair(&k_in, &k), std::make_pair(&v_in, &v)}) {
    at::Tensor buffer = at::empty({B, heads, capacity, D}, from->options());
    buffer.narrow(2, 0, S).copy_(from->transpose(1, 2));
    to->push_back(std::move(buffer));
  }
  length = S;
}

Attention Attention::make(const Scope& s, int64_t hidden, int64_t heads, int64_t kv_heads,
                          bool qkv_bias, bool out_bias, double out_std) {
  const int64_t tp = s.groups().tp.size();
  WEFT_ASSERT(heads % tp == 0 && kv_heads % tp == 0, "heads ", heads, " and kv_heads ", kv_heads,
              " must divide over tp ", tp);
  Attention a;
  a.heads = heads / tp;
  a.kv_heads = kv_heads / tp;
  a.head_dim = hidden / heads;
  a.cp = s.groups().cp;
  const int64_t D = a.head_dim;
  a.qkv = Linear::make(s.sub("qkv"), hidden, (heads + 2 * kv_heads) * D, qkv_bias, 0.02,
                       Par::kColumn, {heads * D, kv_heads * D, kv_heads * D});
  a.out = Linear::make(s.sub("out"), heads * D, hidden, out_bias, out_std, Par::kRow);
  return a;
}

std::array<at::Tensor, 3> Attention::project(const at::Tensor& x, const Rope* rope) const {
  const at::Tensor qkv = this->qkv(x);  // under sequence parallelism: every position of x
  const int64_t B = qkv.size(0), S = qkv.size(1);
  // split, not narrow: the backward is one concatenation, not a zero-filled tensor per part.
  const std::vector<at::Tensor> parts = qkv.view({B, S, heads + 2 * kv_heads, head_dim})
                                            .split_with_sizes({heads, kv_heads, kv_heads}, 2);
  if (!rope) return {parts[0], parts[1], parts[2]};
  return {apply_rope(parts[0], *rope), apply_rope(parts[1], *rope), parts[2]};
}

at::Tensor Attention::operator()(const at::Tensor& x, const AttentionMask& mask,
                                 const Rope* rope) const {
  auto [q, k, v] = project(x, rope);
  const int64_t B = q.size(0), S = q.size(1), D = head_dim;
  if (cp.size() > 1) {  // every rank's keys, in original token order: K and V in one gather
    at::Tensor kv = dist::gather_along(at::cat({k, v}, 2), cp, 1);
    if (mask.kv_order.defined())  // undefined: the ranks hold contiguous chunks in order
      kv = kv.index_select(1, mask.kv_order);
    const std::vector<at::Tensor> halves = kv.split(kv_heads, 2);
    k = halves[0];
    v = halves[1];
  }
  if (mask.keep_kv) mask.keep_kv->keep(k, v);
  q = q.transpose(1, 2);  // [B, H, S, D]
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor o = !mask.chunks.empty()
                     ? chunked_attention(q, k, v, mask.chunks, mask.chunk_masks, scale)
                     : compat::attention(
                           q, k, v, mask.prepared.defined() ? mask.prepared : mask.visible, scale);
  return out(o.transpose(1, 2).reshape({B, S, heads * D}));
}

at::Tensor Attention::cached(const at::Tensor& x, const at::Tensor& visible, const Rope& rope,
                             const at::Tensor& k_cache, const at::Tensor& v_cache,
                             int64_t length) const {
  const auto [q, k, v] = project(x, &rope);
  const int64_t B = q.size(0), n = q.size(1), D = head_dim;
  WEFT_ASSERT(length + n <= k_cache.size(2), "Attention::cached: ", length + n,
              " positions in a cache of ", k_cache.size(2));
  k_cache.narrow(2, length, n).copy_(k.transpose(1, 2));
  v_cache.narrow(2, length, n).copy_(v.transpose(1, 2));
  const at::Tensor o = compat::attention(q.transpose(1, 2), k_cache.narrow(2, 0, length + n),
                                         v_cache.narrow(2, 0, length + n), visible,
                                         1.0 / std::sqrt(static_cast<double>(D)));
  return out(o.transpose(1, 2).reshape({B, n, heads * D}));
}

SwiGlu SwiGlu::make(const Scope& s, int64_t hidden, int64_t ffn, double out_std) {
  return {Linear::make(s.sub("gate_up"), hidden, 2 * ffn, false, 0.02, Par::kColumn, {ffn, ffn}),
          Linear::make(s.sub("down"), ffn, hidden, false, out_std, Par::kRow)};
}

at::Tensor SwiGlu::operator()(const at::Tensor& x) const { return down(swiglu(gate_up(x))); }

at::Tensor activate(const at::Tensor& x, Activation act) {
  switch (act) {
    case Activation::kQuickGelu:
      return x * at::sigmoid(x * 1.702);
    case Activation::kGeluTanh:
      return compat::gelu(x, "tanh");
    case Activation::kGelu:
      break;
  }
  return gelu_erf(x);
}

GeluMlp GeluMlp::make(const Scope& s, int64_t in, int64_t ffn, int64_t out, double out_std,
                      Activation act) {
  return {Linear::make(s.sub("fc1"), in, ffn, true, 0.02, Par::kColumn),
          Linear::make(s.sub("fc2"), ffn, out, true, out_std, Par::kRow), act};
}

at::Tensor GeluMlp::operator()(const at::Tensor& x) const { return fc2(activate(fc1(x), act)); }

EncoderBlock EncoderBlock::make(const Scope& s, int64_t hidden, int64_t heads, int64_t ffn,
                                double eps, int64_t layers, Activation act) {
  const double out_std = 0.02 / std::sqrt(2.0 * static_cast<double>(layers));
  EncoderBlock b;
  b.ln1 = LayerNorm::make(s.sub("ln1"), hidden, eps);
  b.attn = Attention::make(s.sub("attn"), hidden, heads, heads, true, true, out_std);
  b.ln2 = LayerNorm::make(s.sub("ln2"), hidden, eps);
  b.mlp = GeluMlp::make(s.sub("mlp"), hidden, ffn, hidden, out_std, act);
  return b;
}

at::Tensor EncoderBlock::operator()(const at::Tensor& x) const {
  at::Tensor h = x + attn(ln1(x), {}, nullptr);
  return h + mlp(ln2(h));
}

}  // namespace weft::model
