#include "weft/plan/flops.h"

#include <algorithm>

namespace weft::plan {

namespace {
// Multiply-adds per token of block `layer`'s feed-forward: a SwiGLU (3·h·F), or for an MoE
// block the router (h·E), top_k experts and the shared expert.
double ffn_macs(const LlmSpec& llm, int64_t layer) {
  const double h = static_cast<double>(llm.hidden);
  const MoeSpec& moe = llm.moe;
  if (!moe.is_moe_layer(layer)) return 3.0 * h * static_cast<double>(llm.ffn);
  return h * static_cast<double>(moe.experts) +
         3.0 * h *
             (static_cast<double>(moe.top_k * llm.expert_ffn()) +
              static_cast<double>(moe.shared_ffn));
}
}  // namespace

double llm_block_forward_flops(const LlmSpec& llm, const LlmTokens& t, int64_t layer) {
  const double h = static_cast<double>(llm.hidden);
  const double q = static_cast<double>(llm.head_dim() * llm.heads);
  const double kv = static_cast<double>(llm.head_dim() * llm.kv_heads);
  double ffn = 0;
  if (layer >= 0) {
    ffn = ffn_macs(llm, layer);
  } else {  // the mean block
    for (int64_t i = 0; i < llm.layers; ++i) ffn += ffn_macs(llm, i);
    ffn /= static_cast<double>(std::max<int64_t>(llm.layers, 1));
  }
  const double linear = 2.0 * t.tokens * (h * (q + 2 * kv) + q * h + ffn);
  // QK^T and PV are 2·q·S² each in full; the causal mask halves them: 2·q·ΣL_i².
  return linear + 2.0 * q * t.sum_sq_doc_len;
}

BlockParams llm_block_params(const LlmSpec& llm, int64_t layer) {
  const double h = static_cast<double>(llm.hidden);
  const double q = static_cast<double>(llm.head_dim() * llm.heads);
  const double kv = static_cast<double>(llm.head_dim() * llm.kv_heads);
  BlockParams p;
  p.total = h * (q + 2 * kv) + q * h + 2 * h + (llm.qkv_bias ? q + 2 * kv : 0.0);
  const MoeSpec& moe = llm.moe;
  if (!moe.is_moe_layer(layer)) {
    p.total += 3 * h * static_cast<double>(llm.ffn);
    return p;
  }
  p.experts = static_cast<double>(moe.experts) * 3 * h * static_cast<double>(llm.expert_ffn());
  p.total += p.experts + h * static_cast<double>(moe.experts) +
             3 * h * static_cast<double>(moe.shared_ffn);
  return p;
}

double moe_all_to_all_bytes(const LlmSpec& llm, const LlmTokens& t, int64_t layer,
                            double bytes_per_value) {
  if (!llm.moe.is_moe_layer(layer)) return 0;
  return 2.0 * t.tokens * static_cast<double>(llm.moe.top_k * llm.hidden) * bytes_per_value;
}

double llm_head_forward_flops(const LlmSpec& llm, const LlmTokens& t) {
  return 2.0 * t.logit_rows * static_cast<double>(llm.hidden) * static_cast<double>(llm.vocab);
}

double llm_forward_flops(const LlmSpec& llm, const LlmTokens& t) {
  return static_cast<double>(llm.layers) * llm_block_forward_flops(llm, t) +
         llm_head_forward_flops(llm, t);
}

namespace {
// Forward FLOPs of one pre-LN transformer block with a GELU MLP over T tokens, full attention.
double block_flops(double T, double h, double F) {
  return 2.0 * T * (4.0 * h * h + 2.0 * h * F) + 4.0 * T * T * h;
}
}  // namespace

double encoder_front_forward_flops(const EncoderSpec& e) {
  const double h = static_cast<double>(e.hidden);
  const double T = static_cast<double>(e.tokens_per_item());
  if (e.kind == EncoderKind::kWhisper) {
    const double frames = static_cast<double>(e.frames);
    return 2.0 * frames * static_cast<double>(e.mels) * h * 3.0 + 2.0 * T * h * h * 3.0;
  }
  if (e.stem_channels <= 0) {
    const double p = static_cast<double>(e.patch);
    return 2.0 * T * static_cast<double>(e.channels) * p * p * h;
  }
  const double c = static_cast<double>(e.stem_channels);
  double in = static_cast<double>(e.channels), side = static_cast<double>(e.image_size);
  double stem = 0;
  for (int64_t i = 0; i < e.stem_layers; ++i) {
    side /= 2;
    stem += 2.0 * side * side * c * in * 9.0;
    in = c;
  }
  const double k = static_cast<double>(e.patch >> e.stem_layers);
  return stem + 2.0 * T * c * k * k * h;
}

double encoder_block_forward_flops(const EncoderSpec& e) {
  return block_flops(static_cast<double>(e.tokens_per_item()), static_cast<double>(e.hidden),
                     static_cast<double>(e.ffn));
}

ColumnFlops llm_column_flops(const LlmSpec& llm) {
  const double h = static_cast<double>(llm.hidden);
  const double q = static_cast<double>(llm.head_dim() * llm.heads);
  const double kv = static_cast<double>(llm.head_dim() * llm.kv_heads);
  return {2 * h * (q + 2 * kv), 2 * h * 2 * static_cast<double>(llm.ffn)};
}

ColumnFlops encoder_column_flops(const EncoderSpec& e) {
  const double h = static_cast<double>(e.hidden);
  return {2 * h * 3 * h, 2 * h * static_cast<double>(e.ffn)};
}

double encoder_forward_flops(const EncoderSpec& e) {
  return encoder_front_forward_flops(e) +
         static_cast<double>(e.layers_used()) * encoder_block_forward_flops(e);
}

double projector_forward_flops(const EncoderSpec& e, const LlmSpec& llm) {
  const double T = static_cast<double>(e.tokens_per_item());
  const double a = static_cast<double>(e.hidden), b = static_cast<double>(llm.hidden);
  return e.projector.kind == ProjectorKind::kLinear ? 2.0 * T * a * b : 2.0 * T * (a * b + b * b);
}

}  // namespace weft::plan
