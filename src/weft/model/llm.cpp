#include "weft/model/llm.h"

#include <torch/torch.h>

#include <cmath>
#include <string>

namespace weft::model {

Llm Llm::make(const Scope& s, const LlmSpec& spec) {
  Llm m;
  m.spec = spec;
  m.embedding = s.add("embedding", init_normal({spec.vocab, spec.hidden}, 0.02));
  const double out_std = 0.02 / std::sqrt(2.0 * static_cast<double>(spec.layers));
  for (int64_t i = 0; i < spec.layers; ++i) {
    Scope b = s.sub("layers." + std::to_string(i));
    LlmBlock blk;
    blk.norm1 = RmsNorm::make(b.sub("norm1"), spec.hidden, spec.norm_eps);
    blk.attn =
        Attention::make(b.sub("attn"), spec.hidden, spec.heads, spec.kv_heads, false, out_std);
    blk.norm2 = RmsNorm::make(b.sub("norm2"), spec.hidden, spec.norm_eps);
    blk.mlp = SwiGlu::make(b.sub("mlp"), spec.hidden, spec.ffn, out_std);
    m.blocks.push_back(blk);
  }
  m.final_norm = RmsNorm::make(s.sub("final_norm"), spec.hidden, spec.norm_eps);
  if (!spec.tie_embeddings) m.head = s.add("head", init_normal({spec.vocab, spec.hidden}, 0.02));
  return m;
}

at::Tensor Llm::embed(const at::Tensor& tokens) const {
  return to_compute(at::embedding(embedding, tokens));
}

at::Tensor Llm::forward(const at::Tensor& x_in, const at::Tensor& positions,
                        const at::Tensor& visible) const {
  const Rope rope = Rope::make(positions, spec.head_dim(), spec.rope_theta);
  at::Tensor x = x_in;
  for (const LlmBlock& b : blocks) {
    x = x + b.attn(b.norm1(x), visible, &rope);
    x = x + b.mlp(b.norm2(x));
  }
  return final_norm(x);
}

at::Tensor Llm::logits(const at::Tensor& rows) const {
  const at::Tensor& w = head.defined() ? head : embedding;
  return at::linear(rows, to_compute(w)).to(at::kFloat);
}

}  // namespace weft::model
