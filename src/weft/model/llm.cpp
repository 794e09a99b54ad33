#include "weft/model/llm.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "weft/core/error.h"
#include "weft/dist/collectives.h"
#include "weft/model/chunked_attention.h"
#include "weft/model/cross_entropy.h"
#include "weft/model/recompute.h"
#include "weft/model/torch_compat.h"

namespace weft::model {

Llm Llm::make(const Scope& s, const LlmSpec& spec, StageRange range) {
  return make(s, spec, std::vector<StageRange>{range});
}

Llm Llm::make(const Scope& s, const LlmSpec& spec, std::vector<StageRange> chunks) {
  WEFT_ASSERT(!chunks.empty(), "an LLM stage of no chunks");
  Llm m;
  m.spec = spec;
  bool first = false, last = false;
  for (StageRange& c : chunks) {
    if (c.last_layer < 0) c.last_layer = spec.layers;
    first = first || c.first_stage;
    last = last || c.last_stage;
  }
  m.chunks = chunks;
  m.tp = s.groups().tp;
  const Split vocab_split = s.groups().split(0);
  if (first || (last && spec.tie_embeddings))
    m.embedding = s.normal("embedding", {spec.vocab, spec.hidden}, 0.02, vocab_split);
  const double out_std = 0.02 / std::sqrt(2.0 * static_cast<double>(spec.layers));
  for (const StageRange& c : chunks) {
    m.chunk_begin.push_back(m.blocks.size());
    for (int64_t i = c.first_layer; i < c.last_layer; ++i) {
      Scope b = s.sub("layers." + std::to_string(i));
      LlmBlock blk;
      blk.norm1 = RmsNorm::make(b.sub("norm1"), spec.hidden, spec.norm_eps);
      blk.attn = Attention::make(b.sub("attn"), spec.hidden, spec.heads, spec.kv_heads,
                                 spec.qkv_bias, false, out_std);
      blk.norm2 = RmsNorm::make(b.sub("norm2"), spec.hidden, spec.norm_eps);
      if (spec.moe.is_moe_layer(i))
        blk.moe = MoeMlp::make(b.sub("moe"), spec, i, out_std);
      else
        blk.mlp = SwiGlu::make(b.sub("mlp"), spec.hidden, spec.ffn, out_std);
      m.blocks.push_back(blk);
    }
  }
  m.chunk_begin.push_back(m.blocks.size());
  if (last) {
    m.final_norm = RmsNorm::make(s.sub("final_norm"), spec.hidden, spec.norm_eps);
    if (!spec.tie_embeddings)
      m.head = s.normal("head", {spec.vocab, spec.hidden}, 0.02, vocab_split);
  }
  return m;
}

namespace {
// index_select of a trained table, with a backward of its own for the table's gradient:
//  - kFp32Sum, a table held narrower than fp32 (ZeRO-1 holds a bf16 run's embedding in bf16, its
//    .grad in fp32): each row's gradients summed in fp32 and the sum rounded once, where
//    index_select's backward would add them up in the table's dtype;
//  - kSparse, an fp32 table whose tied head is in the same graph (TiedHeadInGraph): the rows'
//    gradients as a sparse [rows, hidden] tensor at their ids (summed where an id repeats), which
//    autograd adds into the head's dense gradient, in place where it holds that one alone: no
//    zero-filled table, no second pass over it.
enum class RowsGrad : int64_t { kFp32Sum, kSparse };

struct RowsFn : torch::autograd::Function<RowsFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& table,
                            const at::Tensor& ids, RowsGrad how) {
    ctx->save_for_backward({ids});
    ctx->saved_data["rows"] = table.size(0);
    ctx->saved_data["how"] = static_cast<int64_t>(how);
    return table.index_select(0, ids);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const at::Tensor ids = ctx->get_saved_variables()[0];
    const at::Tensor& g = grad[0];
    const int64_t rows = ctx->saved_data["rows"].toInt();
    if (static_cast<RowsGrad>(ctx->saved_data["how"].toInt()) == RowsGrad::kSparse)
      // Unchecked: the forward's index_select proved the ids in range (a check would read them
      // on the host, a device sync on a GPU).
      return {at::_sparse_coo_tensor_unsafe(ids.unsqueeze(0), g.contiguous(), {rows, g.size(1)}),
              at::Tensor(), at::Tensor()};
    at::Tensor sum = torch::zeros({rows, g.size(1)}, g.options().dtype(at::kFloat));
    sum.index_add_(0, ids, g.to(at::kFloat));
    return {sum.to(g.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

thread_local bool t_tied_head_in_graph = false;

// Rows of `table` for `ids` [B, S] -> [B, S, hidden]. index_select, not at::embedding: its
// backward is an index_add into the gradient, where LibTorch's CPU embedding backward sorts.
at::Tensor lookup(const at::Tensor& table, const at::Tensor& ids, bool tied_head) {
  const at::Tensor flat = ids.reshape({-1});
  at::Tensor rows;
  if (!table.requires_grad() || !at::GradMode::is_enabled())
    rows = table.index_select(0, flat);
  else if (table.scalar_type() != at::kFloat)
    rows = RowsFn::apply(table, flat, RowsGrad::kFp32Sum);
  else if (tied_head && t_tied_head_in_graph)
    rows = RowsFn::apply(table, flat, RowsGrad::kSparse);
  else
    rows = table.index_select(0, flat);
  return rows.view({ids.size(0), ids.size(1), table.size(1)});
}
}  // namespace

Llm::TiedHeadInGraph::TiedHeadInGraph() : saved_(t_tied_head_in_graph) {
  t_tied_head_in_graph = true;
}
Llm::TiedHeadInGraph::~TiedHeadInGraph() { t_tied_head_in_graph = saved_; }

at::Tensor Llm::embed(const at::Tensor& tokens) const {
  // The rows are read from the parameter itself (and cast): not through to_compute.
  arrived(embedding);
  // The head reads this very table: the whole LLM here, tied.
  const bool tied_head = spec.tie_embeddings && !head.defined() && chunks.size() == 1 &&
                         chunks[0].first_stage && chunks[0].last_stage;
  if (tp.size() == 1) return to_compute(lookup(embedding, tokens, tied_head));
  // Vocab-parallel: each rank looks up the tokens of its vocabulary slice, zeros elsewhere,
  // and the sum over TP assembles every embedding.
  const int64_t per = embedding.size(0), first = tp.rank() * per;
  at::Tensor outside = (tokens < first).logical_or(tokens >= first + per);
  at::Tensor local = (tokens - first).masked_fill(outside, 0);
  at::Tensor e = lookup(embedding, local, tied_head).masked_fill(outside.unsqueeze(-1), 0);
  return dist::reduce_from(to_compute(e), tp);
}

LlmContext Llm::context(const at::Tensor& positions, const AttentionMask& mask_in,
                        const at::Tensor& x) const {
  LlmContext c{Rope::make(positions, spec.head_dim(), spec.rope_theta, spec.rope_scaling), mask_in};
  AttentionMask& mask = c.mask;  // the mask converted once here, not in every block
  if (!mask.prepared.defined())
    mask.prepared = compat::attention_mask(mask.visible, x.scalar_type());
  // Blocks of queries over tiles of the keys they see (the runtime fills `chunks`, never under
  // CP, where a rank's queries are its share of the keys).
  if (!chunked_attention_has_kernels(x.device(), x.scalar_type(), spec.head_dim()) ||
      mask.kv_order.defined() || !mask.prepared.defined())
    mask.chunks.clear();
  if (!mask.chunks.empty() && mask.chunk_masks.empty())
    mask.chunk_masks = chunk_masks(mask.prepared, mask.chunks, x.scalar_type());
  return c;
}

at::Tensor Llm::blocks_forward(const at::Tensor& x, const at::Tensor& positions,
                               const AttentionMask& mask, const TokenInfo& tokens,
                               size_t chunk) const {
  return blocks_forward(x, context(positions, mask, x), tokens, chunk);
}

at::Tensor Llm::blocks_forward(const at::Tensor& x_in, const LlmContext& context,
                               const TokenInfo& tokens, size_t chunk) const {
  WEFT_ASSERT(chunk + 1 < chunk_begin.size(), "chunk ", chunk, " of ", chunks.size());
  const Rope& rope = context.rope;
  const AttentionMask& mask = context.mask;
  at::Tensor x = x_in;
  for (size_t i = chunk_begin[chunk]; i < chunk_begin[chunk + 1]; ++i) {
    const LlmBlock& b = blocks[i];
    if (!recomputes_block(spec.recompute, spec.recompute_blocks, chunks[chunk].stage,
                          static_cast<int64_t>(i - chunk_begin[chunk]))) {
      x = b(x, mask, rope, tokens);
      continue;
    }
    x = recompute(
        [b, mask, rope, tokens](const at::Tensor& h, const std::vector<at::Tensor>& p) {
          return with_params(b, p)(h, mask, rope, tokens);
        },
        x, block_params(b));
  }
  return x;
}

at::Tensor LlmBlock::operator()(const at::Tensor& x_in, const AttentionMask& mask, const Rope& rope,
                                const TokenInfo& tokens) const {
  return feed_forward(x_in + attn(norm1(x_in), mask, &rope), tokens);
}

at::Tensor LlmBlock::feed_forward(const at::Tensor& x, const TokenInfo& tokens) const {
  if (!moe.enabled()) return x + mlp(norm2(x));
  const Linear& column = attn.qkv;  // its TP group, and whether the sequence is split over it
  if (!column.sp) return x + moe(norm2(x), tokens);
  const dist::Comm& tp = column.tp;
  return x + dist::split_replicated(moe(dist::gather_replicated(norm2(x), tp, 1), tokens), tp, 1);
}

at::Tensor LlmBlock::cached(const at::Tensor& x_in, const at::Tensor& visible, const Rope& rope,
                            const at::Tensor& k, const at::Tensor& v, int64_t length) const {
  if (attn.qkv.sp || moe.cp.size() > 1) {  // the same block without them (shares the weights)
    LlmBlock b = *this;
    for (Linear* l : {&b.attn.qkv, &b.attn.out, &b.mlp.gate_up, &b.mlp.down}) l->sp = false;
    b.moe.cp = dist::Comm();
    return b.cached(x_in, visible, rope, k, v, length);
  }
  return feed_forward(x_in + attn.cached(norm1(x_in), visible, rope, k, v, length), {});
}

at::Tensor Llm::decode(const at::Tensor& x_in, const at::Tensor& positions,
                       const at::Tensor& visible, KvCache& cache, size_t chunk) const {
  WEFT_ASSERT(chunk + 1 < chunk_begin.size(), "Llm::decode: chunk ", chunk, " of ", chunks.size());
  const int64_t B = x_in.size(0), n = x_in.size(1);
  WEFT_CHECK(cache.length + n <= cache.capacity, "Llm::decode: ", cache.length, " + ", n,
             " positions exceed the cache's capacity of ", cache.capacity);
  if (cache.k.empty())
    for (const LlmBlock& b : blocks) {
      const at::TensorOptions o = x_in.options();
      cache.k.push_back(at::empty({B, b.attn.kv_heads, cache.capacity, b.attn.head_dim}, o));
      cache.v.push_back(at::empty_like(cache.k.back()));
    }
  WEFT_CHECK(cache.k.size() == blocks.size() && cache.k[0].size(0) == B, "Llm::decode: a batch of ",
             B, " rows on a cache of ", cache.k[0].size(0), " rows and ", cache.k.size(),
             " layers (", blocks.size(), " here)");
  const Rope rope = Rope::make(positions, spec.head_dim(), spec.rope_theta, spec.rope_scaling);
  const at::Tensor mask = compat::attention_mask(visible.defined() ? visible.contiguous() : visible,
                                                 x_in.scalar_type());
  at::Tensor x = x_in;
  for (size_t i = chunk_begin[chunk]; i < chunk_begin[chunk + 1]; ++i)
    x = blocks[i].cached(x, mask, rope, cache.k[i], cache.v[i], cache.length);
  if (chunk + 1 == chunks.size()) cache.length += n;
  return chunks[chunk].last_stage ? final_norm(x) : x;
}

at::Tensor Llm::forward(const at::Tensor& x, const at::Tensor& positions, const AttentionMask& mask,
                        const TokenInfo& tokens, size_t chunk) const {
  return forward(x, context(positions, mask, x), tokens, chunk);
}

at::Tensor Llm::forward(const at::Tensor& x, const LlmContext& context, const TokenInfo& tokens,
                        size_t chunk) const {
  at::Tensor h = blocks_forward(x, context, tokens, chunk);
  return chunks[chunk].last_stage ? final_norm(h) : h;
}

at::Tensor Llm::logits(const at::Tensor& rows) const {
  WEFT_ASSERT(tp.size() == 1, "Llm::logits needs the whole vocabulary on one rank");
  const at::Tensor& w = head.defined() ? head : embedding;
  return at::linear(rows, to_compute(w)).to(at::kFloat);
}

at::Tensor Llm::greedy(const at::Tensor& rows, int64_t vocab, at::Tensor* logprob) const {
  const at::Tensor& w = head.defined() ? head : embedding;
  const int64_t per = w.size(0), first = tp.rank() * per, N = rows.size(0);
  WEFT_ASSERT(vocab > 0 && vocab <= per * tp.size(), "Llm::greedy: vocab ", vocab, " for ",
              per * tp.size(), " logits");
  if (tp.size() == 1) {
    const at::Tensor l = logits(rows).narrow(-1, 0, vocab);
    if (logprob) *logprob = std::get<0>(l.max(-1)) - l.logsumexp(-1);
    return l.argmax(-1);
  }
  // TP ranks hold the same rows: all of them skip an empty set (a CP rank without targets).
  if (N == 0) {
    if (logprob) *logprob = at::empty({0}, rows.options().dtype(at::kFloat));
    return at::empty({0}, rows.options().dtype(at::kLong));
  }
  // This rank's ids below `vocab`, then the largest logit over TP and the smallest id holding it.
  const int64_t own = std::clamp<int64_t>(vocab - first, 0, per);
  const at::TensorOptions f32 = rows.options().dtype(at::kFloat);
  at::Tensor best = at::full({N}, -std::numeric_limits<float>::infinity(), f32);
  at::Tensor id = at::full({N}, vocab, f32.dtype(at::kLong));
  at::Tensor l;
  if (own > 0) {
    l = at::linear(rows, to_compute(w)).to(at::kFloat).narrow(-1, 0, own);
    const at::Tensor arg = l.argmax(-1);
    best = l.gather(1, arg.unsqueeze(1)).squeeze(1);
    id = arg + first;
  }
  at::Tensor top = best.clone();
  tp.all_reduce_max(top);
  at::Tensor neg = id.masked_fill(best != top, vocab).neg();  // the smallest id: max of -id
  tp.all_reduce_max(neg);
  if (logprob) {  // the top logit less the log-sum-exp: -log Σ_v exp(l_v - top)
    at::Tensor sum = own > 0 ? (l - top.unsqueeze(1)).exp().sum(-1) : at::zeros({N}, f32);
    tp.all_reduce_sum(sum);
    *logprob = sum.log().neg();
  }
  return neg.neg();
}

at::Tensor Llm::loss_sum(const at::Tensor& rows, const at::Tensor& targets, bool fused) const {
  const at::Tensor& w = head.defined() ? head : embedding;
  if (fused) return linear_cross_entropy_sum(rows, to_compute(w), targets, 0, tp);
  if (tp.size() == 1)
    return at::cross_entropy_loss(at::linear(rows, to_compute(w)).to(at::kFloat), targets, {},
                                  at::Reduction::Sum);
  // Vocab-parallel cross-entropy: log Σ_v exp(l_v) − l_target with the max, the sum of
  // exponentials and the target logit each combined over TP; no rank sees the whole vocabulary.
  at::Tensor logits = dist::column_linear(rows, to_compute(w), at::Tensor(), tp).to(at::kFloat);
  at::Tensor max = std::get<0>(logits.detach().max(-1));
  tp.all_reduce_max(max);
  at::Tensor sum_exp = dist::reduce_from((logits - max.unsqueeze(-1)).exp().sum(-1), tp);
  const int64_t per = w.size(0), first = tp.rank() * per;
  at::Tensor outside = (targets < first).logical_or(targets >= first + per);
  at::Tensor local = (targets - first).masked_fill(outside, 0);
  at::Tensor target_logit = dist::reduce_from(
      logits.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0), tp);
  return (sum_exp.log() + max - target_logit).sum();
}

}  // namespace weft::model
