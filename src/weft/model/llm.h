// Decoder LLM, Llama-style: token embedding, pre-RMSNorm blocks with RoPE grouped-query
// attention and a SwiGLU MLP, final RMSNorm, output head (optionally tied to the embedding).
//
// A pipeline stage builds only its blocks: the first stage the embedding, the last the final
// norm and the head (a tied head is a copy of the embedding on the last stage, whose gradient
// the runtime sums with the first stage's). Under virtual pipeline stages a rank builds several
// chunks of blocks (plan.h Layout::vp) and runs one chunk at a time. Under tensor parallelism the
// embedding and the head are split over the vocabulary and the loss is a vocab-parallel
// cross-entropy.
//
// Under sequence parallelism (Shard::sp) the blocks' input and output, and the final norm's,
// hold this rank's S/tp positions of the sequence; embed() and loss_sum() take every position
// (the runtime splits after the embedding and gathers before the loss).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "weft/core/spec.h"
#include "weft/model/layers.h"
#include "weft/model/moe.h"

namespace weft::model {

// Pre-RMSNorm block: x + attn(norm1(x)), then + mlp(norm2(·)), the MLP a SwiGLU or, in the
// blocks spec.moe picks, a mixture of experts (moe.h). Under sequence parallelism x holds this
// rank's part of the sequence; an MoE block gathers it whole over TP (as its router and its
// token slices under etp = 1 expect) and keeps its part of the output.
struct LlmBlock {
  RmsNorm norm1, norm2;
  Attention attn;
  SwiGlu mlp;  // dense blocks
  MoeMlp moe;  // MoE blocks
  at::Tensor operator()(const at::Tensor& x, const AttentionMask& mask, const Rope& rope,
                        const TokenInfo& tokens = {}) const;
  // Incremental decoding (Attention::cached): x holds the same few positions on every TP and CP
  // rank, so under sequence parallelism the block runs as without it, and an MoE block routes
  // x without its CP group (whose ranks hold the same tokens here, not parts of a row).
  at::Tensor cached(const at::Tensor& x, const at::Tensor& visible, const Rope& rope,
                    const at::Tensor& k, const at::Tensor& v, int64_t length) const;
  // The block's second half: x + MLP (or MoE) of norm2(x); under SP the MoE routes the gathered
  // sequence.
  at::Tensor feed_forward(const at::Tensor& x, const TokenInfo& tokens) const;
};

// Which part of the LLM a rank builds.
struct StageRange {
  int64_t first_layer = 0, last_layer = -1;  // blocks [first, last); -1 = to the end
  bool first_stage = true, last_stage = true;
  // Its virtual pipeline stage (chunk k of pipeline rank s: k·pp + s), which picks the module's
  // recompute_blocks count.
  int64_t stage = 0;
};

// What every block of a microbatch shares: its RoPE tables and its attention mask, converted
// once (Llm::context); a rank's chunks of one microbatch (interleaved 1F1B) can share one.
struct LlmContext {
  Rope rope;
  AttentionMask mask;
};

struct Llm {
  LlmSpec spec;
  std::vector<StageRange> chunks;   // what this rank runs, in block order (one stage: one chunk)
  std::vector<size_t> chunk_begin;  // per chunk: its first block in `blocks`; then blocks.size()
  dist::Comm tp;
  at::Tensor embedding;  // [vocab/tp, hidden] (first stage; last stage too when tied)
  std::vector<LlmBlock> blocks;
  RmsNorm final_norm;
  at::Tensor head;  // [vocab/tp, hidden]; undefined when tied to the embedding

  // While alive on this thread, embed() is called in a graph whose loss also reads the table
  // through the tied head (one rank running the whole LLM, or the model whole): the lookup's
  // backward then gives autograd a sparse gradient (its rows' gradients at their ids), which
  // autograd adds into the head's dense one in place, instead of a zero-filled dense table
  // summed with it. Nowhere else: alone, a sparse gradient would become the table's .grad.
  class TiedHeadInGraph {
   public:
    TiedHeadInGraph();
    ~TiedHeadInGraph();
    TiedHeadInGraph(const TiedHeadInGraph&) = delete;
    TiedHeadInGraph& operator=(const TiedHeadInGraph&) = delete;

   private:
    bool saved_;
  };

  static Llm make(const Scope& s, const LlmSpec& spec, StageRange range = {});
  static Llm make(const Scope& s, const LlmSpec& spec, std::vector<StageRange> chunks);
  // tokens [B, S] → embeddings [B, S, hidden] in the compute dtype (first stage).
  at::Tensor embed(const at::Tensor& tokens) const;
  // x [B, S, hidden] through the blocks of this rank's chunk `chunk`; positions [B, S] drive
  // RoPE; `tokens` tells MoE blocks which tokens are real and how to weigh their auxiliary
  // losses. With spec.recompute the blocks recomputes_block picks for the chunk's stage are
  // recomputed in backward (recompute.h).
  at::Tensor blocks_forward(const at::Tensor& x, const at::Tensor& positions,
                            const AttentionMask& mask, const TokenInfo& tokens = {},
                            size_t chunk = 0) const;
  at::Tensor blocks_forward(const at::Tensor& x, const LlmContext& context,
                            const TokenInfo& tokens = {}, size_t chunk = 0) const;
  // RoPE tables for positions [B, S] and the mask prepared for hidden states like `x` (its
  // dtype and device): the additive form SDPA takes, the tiles' masks.
  LlmContext context(const at::Tensor& positions, const AttentionMask& mask,
                     const at::Tensor& x) const;
  // A chunk's blocks, then the final norm when it is the last stage.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const AttentionMask& mask,
                     const TokenInfo& tokens = {}, size_t chunk = 0) const;
  at::Tensor forward(const at::Tensor& x, const LlmContext& context, const TokenInfo& tokens = {},
                     size_t chunk = 0) const;
  // Incremental decoding through this rank's chunk `chunk`: x [B, n, hidden] (embedded, or the
  // previous stage's output) for the n positions after the cache's, at `positions` [B, n],
  // through the chunk's blocks (then the final norm on the last stage), each block's attention
  // over the cached keys and values and x's own, which join the cache; after this rank's last
  // chunk the cache holds n more positions. `visible` [B, 1, n, length + n] (bool), or
  // undefined: every cached and earlier position. Equal to forward() over the whole sequence at
  // these positions, without recomputing the earlier ones: a prompt goes in once (or a prefill
  // kept its keys, AttentionMask::keep_kv), then one token per step. Under TP each rank holds
  // its heads' keys; under CP every rank the whole cache, and every rank runs the same x.
  at::Tensor decode(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& visible,
                    KvCache& cache, size_t chunk = 0) const;
  // rows [N, hidden] → logits [N, vocab] in fp32 (unsplit vocabulary only).
  at::Tensor logits(const at::Tensor& rows) const;
  // Greedy decoding's choice for each of rows [N, hidden]: the id in [0, vocab) with the largest
  // logit, the first where several tie (argmax's), as int64 [N]. Vocab-parallel under TP: each
  // rank's best of its ids, the winner agreed over TP (collective; every TP rank passes the same
  // rows), so no rank sees the whole vocabulary. With `logprob`, also each choice's
  // log-probability under the softmax over [0, vocab), fp32 [N] (one more sum over TP).
  at::Tensor greedy(const at::Tensor& rows, int64_t vocab, at::Tensor* logprob = nullptr) const;
  // Σ cross-entropy of final-normed rows [N, hidden] against targets [N] (fp32 scalar): the head
  // and the loss fused a chunk of rows at a time (cross_entropy.h), or with `fused` false as
  // linear then cross-entropy (the profiler's pricing); vocab-parallel under TP, fused or not.
  at::Tensor loss_sum(const at::Tensor& rows, const at::Tensor& targets, bool fused = true) const;
};

}  // namespace weft::model
