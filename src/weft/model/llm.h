// Decoder LLM, Llama-style: token embedding, pre-RMSNorm blocks with RoPE grouped-query
// attention and a SwiGLU MLP, final RMSNorm, output head (optionally tied to the embedding).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "weft/core/spec.h"
#include "weft/model/layers.h"

namespace weft::model {

struct LlmBlock {
  RmsNorm norm1, norm2;
  Attention attn;
  SwiGlu mlp;
};

struct Llm {
  LlmSpec spec;
  at::Tensor embedding;  // [vocab, hidden]
  std::vector<LlmBlock> blocks;
  RmsNorm final_norm;
  at::Tensor head;  // [vocab, hidden]; undefined when tied to the embedding

  static Llm make(const Scope& s, const LlmSpec& spec);
  // tokens [B, S] → embeddings [B, S, hidden] in the compute dtype.
  at::Tensor embed(const at::Tensor& tokens) const;
  // x [B, S, hidden] → final-normed hidden states; positions [B, S] drive RoPE.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions,
                     const at::Tensor& visible) const;
  // rows [N, hidden] → logits [N, vocab] in fp32.
  at::Tensor logits(const at::Tensor& rows) const;
};

}  // namespace weft::model
