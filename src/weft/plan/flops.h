// FLOP accounting (Megatron's convention, see REFERENCES.md): forward = 2 FLOPs per
// multiply-add; a module that computes weight and input gradients costs 3x its forward, one
// that computes input gradients only 2x, one that runs forward only 1x.
#pragma once

#include <cstdint>
#include <vector>

#include "weft/core/spec.h"

namespace weft::plan {

// Token statistics of one batch for the LLM (a mean sample's may be fractional).
struct LlmTokens {
  double tokens = 0;          // positions the blocks run on: real tokens (and any padding)
  double logit_rows = 0;      // rows on which the output head runs (loss targets)
  double sum_sq_doc_len = 0;  // Σ_i L_i² over documents (the causal attention term)
};

double llm_forward_flops(const LlmSpec& llm, const LlmTokens& t);
// Forward FLOPs of one item (an image or a clip) through the encoder, up to its feature layer.
double encoder_forward_flops(const EncoderSpec& enc);

// The per-layer pieces of the two totals above (the pipeline partitioner's cost model):
//   llm_forward_flops = layers · llm_block_forward_flops + llm_head_forward_flops
//   encoder_forward_flops = encoder_front_forward_flops
//                           + layers_used() · encoder_block_forward_flops
// The LLM embedding is a lookup (0 FLOPs); its final norm is counted as 0 too.
// Block `layer` (linear + causal attention; an MoE block counts its router, top_k experts per
// token and shared expert); layer = -1: the mean over the LLM's blocks.
double llm_block_forward_flops(const LlmSpec& llm, const LlmTokens& t, int64_t layer = -1);
double llm_head_forward_flops(const LlmSpec& llm, const LlmTokens& t);  // on t.logit_rows

// Parameters of LLM block `layer`: attention, norms, and its SwiGLU or MoE feed-forward. For an
// MoE block, `experts` is the part held by its experts (all of them), which expert parallelism
// divides over ep ranks; 0 for a dense block.
struct BlockParams {
  double total = 0, experts = 0;
};
BlockParams llm_block_params(const LlmSpec& llm, int64_t layer);
// Bytes one MoE block's expert-parallel all-to-alls move for `t` tokens in forward (token rows
// out to the experts and back, top_k rows per token, `bytes_per_value` each); backward moves the
// same. 0 for a dense block.
double moe_all_to_all_bytes(const LlmSpec& llm, const LlmTokens& t, int64_t layer,
                            double bytes_per_value);
// Patch embedding (and conv stem) of a ViT, the two convolutions of a Whisper front end.
double encoder_front_forward_flops(const EncoderSpec& enc);
double encoder_block_forward_flops(const EncoderSpec& enc);
// Forward FLOPs per token of a block's column-parallel linears, whole: {QKV, the MLP's input
// projection} (gate and up of the LLM's SwiGLU — not in an MoE block, whose experts are no
// column-parallel linear —, fc1 of an encoder's MLP).
struct ColumnFlops {
  double qkv = 0, mlp_in = 0;
};
ColumnFlops llm_column_flops(const LlmSpec& llm);
ColumnFlops encoder_column_flops(const EncoderSpec& enc);
// Forward FLOPs of the projector on one item.
double projector_forward_flops(const EncoderSpec& enc, const LlmSpec& llm);

// 3 (weights + inputs), 2 (inputs only), 1 (forward only).
inline double training_multiplier(bool weight_grads, bool input_grads) {
  return 1.0 + (weight_grads ? 1.0 : 0.0) + (input_grads || weight_grads ? 1.0 : 0.0);
}

}  // namespace weft::plan
