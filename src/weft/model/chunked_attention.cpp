#include "weft/model/chunked_attention.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <array>
#include <atomic>
#include <limits>
#include <utility>

#include "weft/core/error.h"
#include "weft/model/torch_compat.h"

#ifdef WEFT_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace weft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// LibTorch's private SDPA kernels that return the log-sum-exp: the CPU's flash attention takes a
// mask from 2.3 on; CUDA's flash and memory-efficient ones (with a bias) are older.
constexpr bool kKernels = WEFT_TORCH_AT_LEAST(2, 3);

enum class Kernel { kMath, kCpuFlash, kCudaFlash, kCudaEfficient };

// The kernel for a tile of `kind` with queries on `device` in `dtype` and heads of D: the
// fused ones within LibTorch's own limits for them (sdp_utils), else the fp32 reference.
Kernel kernel_for(c10::Device device, at::ScalarType dtype, int64_t D, TileKind kind,
                  TileKernels kernels) {
  if (!kKernels || kernels == TileKernels::kMath) return Kernel::kMath;
  if (device.is_cpu()) return Kernel::kCpuFlash;
#ifdef WEFT_CUDA
  if (device.is_cuda() && D % 8 == 0) {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device.index());
    const int sm = prop->major * 10 + prop->minor;
    const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
    // Flash: sm80 on, heads up to 256 (over 192 its backward only on sm80 and sm90).
    if (kind != TileKind::kMasked && half && sm >= 80 &&
        (D <= 192 || (D <= 256 && (sm == 80 || sm == 90))))
      return Kernel::kCudaFlash;
    // Memory-efficient: bf16 from sm80, fp16 and fp32 from sm50.
    if (dtype == at::kFloat || dtype == at::kHalf || (dtype == at::kBFloat16 && sm >= 80))
      return Kernel::kCudaEfficient;
  }
#else
  (void)dtype;
  (void)D;
  (void)kind;
#endif
  return Kernel::kMath;
}

Kernel kernel_for(const at::Tensor& q, TileKind kind, TileKernels kernels) {
  return kernel_for(q.device(), q.scalar_type(), q.size(3), kind, kernels);
}

// Whether the kernel takes a causal tile longer than its queries (lower-right aligned: query i of
// n sees keys up to i + nk - n). CUDA's flash attention does (FlashAttention-2's is_causal, as
// PyTorch's causal_lower_right uses it); LibTorch's CPU flash and CUDA memory-efficient kernels
// align is_causal to the upper left.
bool lower_right_causal(Kernel kernel) {
  return kernel == Kernel::kMath || kernel == Kernel::kCudaFlash;
}

// CUDA's flash attention maps query head h to K/V head h / (H / KV) itself (forward and
// backward, whose dk / dv come back per K/V head); the other kernels take K/V expanded to H heads.
bool takes_kv_heads(Kernel kernel) { return kernel == Kernel::kCudaFlash; }

// K or V [B, KV, S, D] as each tile's kernel takes it. Expanded to H heads ([B, H, S, D]) once
// for all the tiles that need it when they cover more than S keys between them, else per tile.
struct Heads {
  at::Tensor kv, once;
  int64_t H = 1;

  Heads(const at::Tensor& t, int64_t heads, int64_t expanded_keys) : kv(t), H(heads) {
    if (H != kv.size(1) && expanded_keys > kv.size(2)) once = expand(kv);
  }
  at::Tensor expand(const at::Tensor& t) const {
    const int64_t B = t.size(0), KV = t.size(1), n = t.size(2), D = t.size(3);
    return t.unsqueeze(2).expand({B, KV, H / KV, n, D}).reshape({B, H, n, D});
  }
  bool expands(Kernel kernel) const { return H != kv.size(1) && !takes_kv_heads(kernel); }
  at::Tensor tile(int64_t k0, int64_t nk, Kernel kernel) const {
    if (!expands(kernel)) return kv.narrow(2, k0, nk);
    return once.defined() ? once.narrow(2, k0, nk) : expand(kv.narrow(2, k0, nk));
  }
};

// A gradient per query head [B, H, n, D] summed to its K/V head: [B, KV, n, D].
at::Tensor per_kv_head(const at::Tensor& g, int64_t KV) {
  return g.reshape({g.size(0), KV, g.size(1) / KV, g.size(2), g.size(3)}).sum(2);
}

// One tile's attention: its output [B, H, queries, D], fp32 log-sum-exp [B, H, queries] and what
// its backward needs besides (the kernel's random-number state, unused without dropout).
struct TileOut {
  at::Tensor out, lse, seed, offset;
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// Scores of q against k in fp32, the tile's pattern applied.
at::Tensor math_scores(const at::Tensor& q, const at::Tensor& k, bool causal,
                       const at::Tensor& bias, double scale) {
  at::Tensor s = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)).mul_(scale);
  const int64_t nq = s.size(-2), nk = s.size(-1);
  if (causal)  // lower-right aligned
    s.masked_fill_(at::ones({nq, nk}, s.options().dtype(at::kBool)).triu_(1 + nk - nq), -kInf);
  if (bias.defined()) s.add_(bias.to(at::kFloat));
  return s;
}

TileOut tile_forward(Kernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     bool causal, const at::Tensor& bias, double scale) {
  switch (kernel) {
    case Kernel::kMath: {
      const at::Tensor s = math_scores(q, k, causal, bias, scale);
      at::Tensor lse = s.logsumexp(-1);
      // A row that sees no key: output 0, as the kernels give (not 0/0).
      const at::Tensor finite = lse.masked_fill(lse.isinf(), 0);
      at::Tensor p = (s - finite.unsqueeze(-1)).exp_();
      return {at::matmul(p, v.to(at::kFloat)).to(q.scalar_type()), lse, {}, {}};
    }
#if WEFT_TORCH_AT_LEAST(2, 3)
    case Kernel::kCpuFlash: {
      c10::optional<at::Tensor> mask;
      if (bias.defined()) mask = bias;
      auto r = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, mask, scale);
      return {std::get<0>(r), std::get<1>(r), {}, {}};
    }
    case Kernel::kCudaFlash: {
      auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal, false, scale);
      return {std::get<0>(r), std::get<1>(r), std::get<6>(r), std::get<7>(r)};
    }
    case Kernel::kCudaEfficient: {
      c10::optional<at::Tensor> attn_bias;
      if (bias.defined()) attn_bias = bias.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
      auto r =
          at::_scaled_dot_product_efficient_attention(q, k, v, attn_bias, true, 0.0, causal, scale);
      // Its log-sum-exp is padded to a multiple of 32 queries. A row that sees no key of the
      // tile gets some value there: the merge ignores the row by the tile's `sees`.
      return {std::get<0>(r), std::get<1>(r).narrow(2, 0, q.size(2)), std::get<2>(r),
              std::get<3>(r)};
    }
#endif
    default:
      WEFT_FAIL("chunked_attention: no such kernel in this LibTorch");
  }
}

// dq, dk, dv of one tile, given the block's merged output and log-sum-exp.
std::array<at::Tensor, 3> tile_backward(Kernel kernel, const at::Tensor& dout, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& out, const at::Tensor& lse, bool causal,
                                        const at::Tensor& bias, const TileOut& fwd, double scale) {
  switch (kernel) {
    case Kernel::kMath: {
      const at::ScalarType dt = q.scalar_type();
      const at::Tensor s = math_scores(q, k, causal, bias, scale);
      const at::Tensor p = (s - lse.unsqueeze(-1)).exp_();
      const at::Tensor g = dout.to(at::kFloat);
      const at::Tensor delta = (g * out.to(at::kFloat)).sum(-1, true);
      at::Tensor ds = at::matmul(g, v.to(at::kFloat).transpose(-2, -1)).sub_(delta).mul_(p);
      ds.mul_(scale);
      return {at::matmul(ds, k.to(at::kFloat)).to(dt),
              at::matmul(ds.transpose(-2, -1), q.to(at::kFloat)).to(dt),
              at::matmul(p.transpose(-2, -1), g).to(dt)};
    }
#if WEFT_TORCH_AT_LEAST(2, 3)
    case Kernel::kCpuFlash: {
      c10::optional<at::Tensor> mask;
      if (bias.defined()) mask = bias;
      auto r = at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse,
                                                                        0.0, causal, mask, scale);
      return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
    }
    case Kernel::kCudaFlash: {
      auto r = at::_scaled_dot_product_flash_attention_backward(
          dout, q, k, v, out, lse, at::Tensor(), at::Tensor(), q.size(2), k.size(2), 0.0, causal,
          fwd.seed, fwd.offset, scale);
      return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
    }
    case Kernel::kCudaEfficient: {
      const int64_t B = q.size(0), H = q.size(1), L = q.size(2);
      // It reads the log-sum-exp as its forward wrote it: rows padded to 32 queries with +inf.
      at::Tensor padded = at::full({B, H, (L + 31) / 32 * 32}, kInf, lse.options());
      padded.narrow(2, 0, L).copy_(lse);
      at::Tensor attn_bias;
      if (bias.defined()) attn_bias = bias.expand({B, H, L, k.size(2)});
      auto r = at::_scaled_dot_product_efficient_attention_backward(
          dout, q, k, v, attn_bias, out, padded, fwd.seed, fwd.offset, 0.0,
          {true, true, true, false}, causal, scale);
      return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
    }
#endif
    default:
      WEFT_FAIL("chunked_attention: no such kernel in this LibTorch");
  }
}

// What backward needs beyond the saved tensors: the tiles, their masks and kernels, and each
// block's merged log-sum-exp and each tile's kernel state.
struct Tiles : torch::CustomClassHolder {
  std::vector<AttentionChunk> chunks;
  ChunkMasks masks;
  TileKernels kernels = TileKernels::kFastest;
  double scale = 1;
  std::vector<at::Tensor> lse;               // per chunk
  std::vector<std::vector<TileOut>> states;  // per chunk and tile (out and lse dropped)
  int64_t expanded = 0;                      // expanded_keys(), as forward found it

  // How many keys the tiles whose kernels take K/V per query head read between them.
  int64_t expanded_keys(const at::Tensor& q, bool grouped) const {
    int64_t n = 0;
    for (const AttentionChunk& c : chunks)
      for (const AttentionTile& t : c.tiles)
        if (grouped && !takes_kv_heads(kernel_for(q, t.kind, kernels))) n += t.k_end - t.k_begin;
    return n;
  }
};

std::atomic<int64_t> g_calls{0};

struct TiledAttentionFn : torch::autograd::Function<TiledAttentionFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, c10::intrusive_ptr<Tiles> tiles) {
    at::NoGradGuard no_grad;
    const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
    at::Tensor out = at::empty({B, S, H, D}, q.options()).transpose(1, 2);
    tiles->expanded = tiles->expanded_keys(q, H != k.size(1));
    const Heads ks(k, H, tiles->expanded), vs(v, H, tiles->expanded);
    size_t masked = 0;  // masked tiles so far (their masks, in order)
    for (const AttentionChunk& c : tiles->chunks) {
      const int64_t q0 = c.q_begin, nq = c.q_end - c.q_begin;
      const at::Tensor qc = q.narrow(2, q0, nq);
      std::vector<TileOut> parts;
      std::vector<at::Tensor> sees;
      for (const AttentionTile& t : c.tiles) {
        const bool is_masked = t.kind == TileKind::kMasked;
        const at::Tensor bias = is_masked ? tiles->masks.bias.at(masked) : at::Tensor();
        sees.push_back(is_masked ? tiles->masks.sees.at(masked++) : at::Tensor());
        const int64_t nk = t.k_end - t.k_begin;
        const Kernel kernel = kernel_for(q, t.kind, tiles->kernels);
        parts.push_back(tile_forward(kernel, qc, ks.tile(t.k_begin, nk, kernel),
                                     vs.tile(t.k_begin, nk, kernel), t.kind == TileKind::kCausal,
                                     bias, tiles->scale));
      }
      at::Tensor lse;
      if (parts.size() == 1) {  // a block's only tile holds its diagonal: every row sees a key
        out.narrow(2, q0, nq).copy_(parts[0].out);
        lse = parts[0].lse.contiguous();
      } else {
        // A masked tile's rows that see none of its keys weigh nothing: their log-sum-exp is
        // -inf (kernels differ in what they return there, log-sum-exp and output alike).
        std::vector<at::Tensor> lses;
        for (size_t i = 0; i < parts.size(); ++i) {
          lses.push_back(sees[i].defined() ? parts[i].lse.masked_fill(sees[i].logical_not(), -kInf)
                                           : parts[i].lse);
          lse = i == 0 ? lses[0] : at::logaddexp(lse, lses[i]);
        }
        // Σ exp(lse_i − lse)·out_i in fp32: one pass over each tile's output, one to store. A
        // masked tile's rows that see none of its keys add 0 whatever the kernel left there.
        at::Tensor sum;
        for (size_t i = 0; i < parts.size(); ++i) {
          const at::Tensor w = (lses[i] - lse).exp_().unsqueeze(-1);
          if (sees[i].defined()) {
            const at::Tensor part =
                (parts[i].out * w).masked_fill_(sees[i].logical_not().unsqueeze(-1), 0);
            sum = i == 0 ? part : sum.add_(part);
          } else {
            sum = i == 0 ? parts[0].out * w : sum.addcmul_(parts[i].out, w);
          }
        }
        out.narrow(2, q0, nq).copy_(sum);
        lse = lse.contiguous();  // as the kernels' backward reads it
      }
      tiles->lse.push_back(std::move(lse));
      for (TileOut& p : parts) p.out = p.lse = at::Tensor();
      tiles->states.push_back(std::move(parts));
    }
    ctx->save_for_backward({q, k, v, out});
    ctx->saved_data["tiles"] = c10::IValue::make_capsule(std::move(tiles));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    at::NoGradGuard no_grad;
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const auto capsule = ctx->saved_data["tiles"].toCapsule();
    const Tiles& tiles = *static_cast<const Tiles*>(capsule.get());
    at::Tensor g = grad[0];
    if (g.stride(-1) != 1) g = g.contiguous();
    // Sums of the tiles' gradients, in fp32 for 16-bit inputs (rounded once at the end, as one
    // kernel's would be); [B, H, S, D] laid out as [B, S, H, D]. A block of one tile writes its
    // dq as the kernel gave it: when every block has one, dq needs no fp32 copy.
    const at::ScalarType sum_type =
        at::elementSize(q.scalar_type()) < 4 ? at::kFloat : q.scalar_type();
    auto like = [&](const at::Tensor& t, at::ScalarType dtype) {
      const std::vector<int64_t> shape = {t.size(0), t.size(2), t.size(1), t.size(3)};
      return at::empty(shape, t.options().dtype(dtype)).transpose(1, 2);
    };
    bool one_tile = true;
    for (const AttentionChunk& c : tiles.chunks) one_tile = one_tile && c.tiles.size() == 1;
    const int64_t H = q.size(1), KV = k.size(1), S = k.size(2);
    const Heads ks(k, H, tiles.expanded), vs(v, H, tiles.expanded);
    at::Tensor dq = like(q, one_tile ? q.scalar_type() : sum_type);  // each block's: its tiles
    at::Tensor dk = like(k, sum_type), dv = like(v, sum_type);
    // Gradients of the K/V expanded once, per query head, summed per K/V head at the end.
    at::Tensor dk_once = ks.once.defined() ? like(ks.once, sum_type) : at::Tensor();
    at::Tensor dv_once = ks.once.defined() ? like(vs.once, sum_type) : at::Tensor();
    // Key gradients go into uninitialised sums: the first tile to reach a key copies its
    // gradient there, later ones add (no zeroing pass, and a copy where a key has one tile);
    // keys no tile reached are zeroed at the end.
    std::vector<char> written(static_cast<size_t>(S), 0), written_once;
    if (dk_once.defined()) written_once.assign(static_cast<size_t>(S), 0);
    auto accumulate = [](at::Tensor& sk, at::Tensor& sv, std::vector<char>& done, int64_t k0,
                         const at::Tensor& gk, const at::Tensor& gv) {
      const int64_t n = gk.size(2);
      for (int64_t i = 0; i < n;) {
        const char seen = done[static_cast<size_t>(k0 + i)];
        int64_t j = i + 1;
        while (j < n && done[static_cast<size_t>(k0 + j)] == seen) ++j;
        at::Tensor pk = sk.narrow(2, k0 + i, j - i), pv = sv.narrow(2, k0 + i, j - i);
        if (seen) {
          pk.add_(gk.narrow(2, i, j - i));
          pv.add_(gv.narrow(2, i, j - i));
        } else {
          pk.copy_(gk.narrow(2, i, j - i));
          pv.copy_(gv.narrow(2, i, j - i));
        }
        std::fill(done.begin() + k0 + i, done.begin() + k0 + j, 1);
        i = j;
      }
    };
    auto zero_unwritten = [](at::Tensor& sk, at::Tensor& sv, const std::vector<char>& done) {
      for (size_t i = 0; i < done.size();) {
        size_t j = i;
        while (j < done.size() && !done[j]) ++j;
        if (j > i) {
          sk.narrow(2, static_cast<int64_t>(i), static_cast<int64_t>(j - i)).zero_();
          sv.narrow(2, static_cast<int64_t>(i), static_cast<int64_t>(j - i)).zero_();
        }
        i = j + 1;
      }
    };
    size_t masked = 0;
    for (size_t ci = 0; ci < tiles.chunks.size(); ++ci) {
      const AttentionChunk& c = tiles.chunks[ci];
      const int64_t q0 = c.q_begin, nq = c.q_end - c.q_begin;
      const at::Tensor qc = q.narrow(2, q0, nq), gc = g.narrow(2, q0, nq);
      const at::Tensor oc = out.narrow(2, q0, nq);
      at::Tensor dqc = dq.narrow(2, q0, nq);
      for (size_t ti = 0; ti < c.tiles.size(); ++ti) {
        const AttentionTile& t = c.tiles[ti];
        const bool is_masked = t.kind == TileKind::kMasked;
        const at::Tensor bias = is_masked ? tiles.masks.bias.at(masked++) : at::Tensor();
        const int64_t nk = t.k_end - t.k_begin;
        const Kernel kernel = kernel_for(q, t.kind, tiles.kernels);
        const std::array<at::Tensor, 3> d = tile_backward(
            kernel, gc, qc, ks.tile(t.k_begin, nk, kernel), vs.tile(t.k_begin, nk, kernel), oc,
            tiles.lse[ci], t.kind == TileKind::kCausal, bias, tiles.states[ci][ti], tiles.scale);
        ti == 0 ? dqc.copy_(d[0]) : dqc.add_(d[0]);
        if (!ks.expands(kernel))
          accumulate(dk, dv, written, t.k_begin, d[1], d[2]);
        else if (dk_once.defined())
          accumulate(dk_once, dv_once, written_once, t.k_begin, d[1], d[2]);
        else
          accumulate(dk, dv, written, t.k_begin, per_kv_head(d[1].to(sum_type), KV),
                     per_kv_head(d[2].to(sum_type), KV));
      }
    }
    if (dk_once.defined()) {
      zero_unwritten(dk_once, dv_once, written_once);
      accumulate(dk, dv, written, 0, per_kv_head(dk_once, KV), per_kv_head(dv_once, KV));
    }
    zero_unwritten(dk, dv, written);
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), at::Tensor()};
  }
};

}  // namespace

ChunkMasks chunk_masks(const at::Tensor& mask, const std::vector<AttentionChunk>& chunks,
                       at::ScalarType dtype) {
  ChunkMasks out;
  for (const AttentionChunk& c : chunks)
    for (const AttentionTile& t : c.tiles) {
      if (t.kind != TileKind::kMasked) continue;
      const int64_t nq = c.q_end - c.q_begin, nk = t.k_end - t.k_begin;
      const at::Tensor part = mask.narrow(2, c.q_begin, nq).narrow(3, t.k_begin, nk);
      // Rows padded to a multiple of 16 keys on CUDA: its memory-efficient kernel reads the bias
      // in aligned rows (SDPA pads it the same way).
      const int64_t row = mask.is_cuda() ? (nk + 15) / 16 * 16 : nk;
      at::Tensor bias =
          at::empty({part.size(0), 1, nq, row}, part.options().dtype(dtype)).narrow(3, 0, nk);
      if (mask.scalar_type() == at::kBool)
        bias.fill_(0).masked_fill_(part.logical_not(), -kInf);
      else
        bias.copy_(part);
      out.sees.push_back(bias.isfinite().any(-1));
      out.bias.push_back(std::move(bias));
    }
  return out;
}

at::Tensor chunked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<AttentionChunk>& chunks, const ChunkMasks& masks,
                             double scale, TileKernels kernels) {
  RECORD_FUNCTION("weft::chunked_attention", std::vector<c10::IValue>({q, k, v}));
  WEFT_ASSERT(!chunks.empty(), "chunked_attention: no chunks");
  int64_t next = 0;  // the blocks tile the queries in order
  size_t masked = 0;
  const bool long_causal = lower_right_causal(kernel_for(q, TileKind::kCausal, kernels));
  for (const AttentionChunk& c : chunks) {
    WEFT_ASSERT(c.q_begin == next && c.q_end > c.q_begin && !c.tiles.empty(),
                "chunked_attention: blocks must tile the queries in order");
    next = c.q_end;
    int64_t k_next = 0;  // a block's tiles in key order, apart
    for (const AttentionTile& t : c.tiles) {
      WEFT_ASSERT(t.k_begin >= k_next && t.k_begin < t.k_end && t.k_end <= k.size(2),
                  "chunked_attention: tiles must be ranges of keys in order, apart");
      k_next = t.k_end;
      WEFT_ASSERT(t.kind != TileKind::kCausal || (t.k_begin <= c.q_begin && t.k_end == c.q_end),
                  "chunked_attention: a causal tile must end with its block's diagonal");
      WEFT_ASSERT(t.kind != TileKind::kCausal || t.k_begin == c.q_begin || long_causal,
                  "chunked_attention: a causal tile longer than its block, for a kernel that "
                  "aligns causal masks to the upper left");
      masked += t.kind == TileKind::kMasked;
    }
  }
  WEFT_ASSERT(q.size(2) == k.size(2) && next == q.size(2),
              "chunked_attention: chunks for self-attention over all ", q.size(2), " positions");
  WEFT_ASSERT(masks.bias.size() == masked && masks.sees.size() == masked,
              "chunked_attention: ", masks.bias.size(), " masks for ", masked, " masked tiles");
  size_t m = 0;  // each mask the shape of its tile
  for (const AttentionChunk& c : chunks)
    for (const AttentionTile& t : c.tiles) {
      if (t.kind != TileKind::kMasked) continue;
      const at::Tensor& bias = masks.bias[m++];
      WEFT_ASSERT(bias.dim() == 4 && bias.size(2) == c.q_end - c.q_begin &&
                      bias.size(3) == t.k_end - t.k_begin,
                  "chunked_attention: the mask of the tile of queries ", c.q_begin, "-", c.q_end,
                  " over keys ", t.k_begin, "-", t.k_end, " is shaped ", bias.sizes());
    }
  g_calls.fetch_add(1, std::memory_order_relaxed);
  WEFT_ASSERT(q.size(1) % k.size(1) == 0, "chunked_attention: ", q.size(1), " query heads over ",
              k.size(1), " K/V heads");
  auto tiles = c10::make_intrusive<Tiles>();
  // Fewer, larger tiles where the kernels of unmasked and causal tiles take long causal ones.
  const bool joins = long_causal && lower_right_causal(kernel_for(q, TileKind::kAll, kernels));
  tiles->chunks = joins ? join_causal_tiles(chunks) : chunks;
  tiles->masks = masks;
  tiles->kernels = kernels;
  tiles->scale = scale;
  return TiledAttentionFn::apply(q, k, v, tiles);
}

bool chunked_attention_has_kernels(c10::Device device, at::ScalarType dtype, int64_t head_dim) {
  for (TileKind kind : {TileKind::kAll, TileKind::kCausal, TileKind::kMasked})
    if (kernel_for(device, dtype, head_dim, kind, TileKernels::kFastest) == Kernel::kMath)
      return false;
  return true;
}

int64_t chunked_attention_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace weft::model
