#include "weft/model/chunked_attention.h"

#include <torch/torch.h>

#include <array>
#include <atomic>
#include <utility>

#include "weft/core/error.h"
#include "weft/model/torch_compat.h"

namespace weft::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Each chunk's own little graph, built in forward on detached slices of q, k and v and run
// backward by the outer node: its inputs (leaves) and its output.
struct ChunkGraphs : torch::CustomClassHolder {
  std::vector<AttentionChunk> chunks;
  std::vector<std::array<at::Tensor, 3>> inputs;  // q, k, v slices (leaves requiring grad)
  std::vector<at::Tensor> outputs;
  int64_t keys = 0;  // k's length
  bool spent = false;
};

std::atomic<int64_t> g_calls{0};

struct ChunkedAttentionFn : torch::autograd::Function<ChunkedAttentionFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::vector<AttentionChunk>& chunks,
                            const std::vector<at::Tensor>& masks, double scale) {
    auto graphs = c10::make_intrusive<ChunkGraphs>();
    graphs->chunks = chunks;
    graphs->keys = k.size(2);
    const bool grad = q.requires_grad() || k.requires_grad() || v.requires_grad();
    torch::AutoGradMode grad_mode(grad);
    std::vector<at::Tensor> parts;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const AttentionChunk& ch = chunks[c];
      auto slice = [&](const at::Tensor& t, int64_t from, int64_t to) {
        at::Tensor s = t.narrow(2, from, to - from).detach();
        return grad ? s.requires_grad_(t.requires_grad()) : s;
      };
      std::array<at::Tensor, 3> in = {slice(q, ch.q_begin, ch.q_end),
                                      slice(k, ch.k_begin, ch.k_end),
                                      slice(v, ch.k_begin, ch.k_end)};
      at::Tensor o = compat::attention(in[0], in[1], in[2], masks[c], scale);
      parts.push_back(o.detach().transpose(1, 2));  // [B, queries, H, D]
      if (grad) {
        graphs->inputs.push_back(std::move(in));
        graphs->outputs.push_back(std::move(o));
      }
    }
    ctx->saved_data["graphs"] = c10::IValue::make_capsule(graphs);
    // Laid out as [B, S, H, D] (as SDPA's own output), so the caller's transpose back is free.
    return at::cat(parts, 1).transpose(1, 2);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto capsule = ctx->saved_data["graphs"].toCapsule();
    auto* graphs = static_cast<ChunkGraphs*>(capsule.get());
    WEFT_CHECK(!graphs->spent,
               "chunked attention: a second backward through the same forward (retain_graph) is "
               "not supported; set model.llm.attention_chunk = 0");
    const at::Tensor& g = grad[0];
    at::Tensor dq, dk, dv;
    torch::AutoGradMode grad_mode(true);
    for (size_t c = 0; c < graphs->outputs.size(); ++c) {
      const AttentionChunk& ch = graphs->chunks[c];
      const std::array<at::Tensor, 3>& in = graphs->inputs[c];
      std::vector<at::Tensor> wrt;
      for (const at::Tensor& t : in)
        if (t.requires_grad()) wrt.push_back(t);
      if (wrt.empty()) continue;
      const variable_list d = torch::autograd::grad(
          {graphs->outputs[c]}, wrt, {g.narrow(2, ch.q_begin, ch.q_end - ch.q_begin)},
          /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
      torch::NoGradGuard no_grad;
      size_t j = 0;
      auto take = [&](const at::Tensor& leaf, at::Tensor& full, int64_t from, int64_t to,
                      bool overlap) {
        if (!leaf.requires_grad()) return;
        const at::Tensor& part = d[j++];
        if (!part.defined()) return;
        if (!full.defined()) {
          std::vector<int64_t> shape = part.sizes().vec();
          shape[2] = graphs->keys;  // q and k have the same length (self-attention)
          full = overlap ? at::zeros(shape, part.options()) : at::empty(shape, part.options());
        }
        at::Tensor dst = full.narrow(2, from, to - from);
        overlap ? dst.add_(part) : dst.copy_(part);
      };
      take(in[0], dq, ch.q_begin, ch.q_end, false);  // query blocks do not overlap
      take(in[1], dk, ch.k_begin, ch.k_end, true);
      take(in[2], dv, ch.k_begin, ch.k_end, true);
    }
    graphs->inputs.clear();  // the chunk graphs are spent
    graphs->outputs.clear();
    graphs->spent = true;
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::vector<at::Tensor> chunk_masks(const at::Tensor& mask,
                                    const std::vector<AttentionChunk>& chunks) {
  std::vector<at::Tensor> out;
  for (const AttentionChunk& c : chunks)
    out.push_back(mask.narrow(2, c.q_begin, c.q_end - c.q_begin)
                      .narrow(3, c.k_begin, c.k_end - c.k_begin)
                      .contiguous());
  return out;
}

at::Tensor chunked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::vector<AttentionChunk>& chunks,
                             const std::vector<at::Tensor>& masks, double scale) {
  WEFT_ASSERT(masks.size() == chunks.size() && !chunks.empty(), "chunked_attention: ", masks.size(),
              " masks for ", chunks.size(), " chunks");
  int64_t next = 0;  // the blocks tile the queries (dq is written block by block)
  for (const AttentionChunk& c : chunks) {
    WEFT_ASSERT(c.q_begin == next && c.q_end > c.q_begin && c.k_begin < c.k_end,
                "chunked_attention: blocks must tile the queries in order");
    next = c.q_end;
  }
  WEFT_ASSERT(q.size(2) == k.size(2) && next == q.size(2),
              "chunked_attention: chunks for self-attention over all ", q.size(2), " positions");
  g_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t B = q.size(0), H = q.size(1), KV = k.size(1), Sk = k.size(2), D = k.size(3);
  at::Tensor ke = k, ve = v;
  if (H != KV) {  // once here, not once per chunk
    ke = k.unsqueeze(2).expand({B, KV, H / KV, Sk, D}).reshape({B, H, Sk, D});
    ve = v.unsqueeze(2).expand({B, KV, H / KV, Sk, D}).reshape({B, H, Sk, D});
  }
  return ChunkedAttentionFn::apply(q, ke, ve, chunks, masks, scale);
}

int64_t chunked_attention_calls() { return g_calls.load(std::memory_order_relaxed); }

}  // namespace weft::model
