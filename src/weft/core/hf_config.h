// Hugging Face config.json → weft model shapes. A checkpoint directory's config.json is read
// with the same defaults transformers applies to absent fields, so `[model.llm] hf = DIR`
// builds exactly the architecture the checkpoint was trained as. Supported:
//   LLM:      model_type llama, mistral, qwen2, mixtral (or llava's text_config). Mixtral sets
//             [model.llm.moe]: experts = num_local_experts, top_k = num_experts_per_tok,
//             ffn = intermediate_size, every = 1, softmax gating, norm_topk = true, no shared
//             expert, aux_loss = router_aux_loss_coef · top_k / layers (the same strength:
//             transformers' loss is one over all layers' tokens and top_k times weft's per-block
//             loss, which weft sums over the MoE blocks; export writes the inverse; weft always
//             trains with it, transformers only with output_router_logits), z_loss = 0,
//             capacity_factor = 0 (dropless); router_jitter_noise must be 0. Absent Mixtral fields
//             take MixtralConfig's defaults (8 experts, top-2, rope_theta 1e6, rms_norm_eps 1e-5, 8
//             KV heads, ...); rope_theta / rope scaling are read from transformers 5's
//             rope_parameters too;
//   vision:   clip / clip_vision_model, siglip / siglip_vision_model (or llava's vision_config,
//             with vision_feature_layer);
//   audio:    whisper (the encoder half).
// Anything weft cannot reproduce exactly (another activation, rope scaling type, attention
// bias layout, sliding window shorter than the run's sequence, router jitter...) is an Error
// naming the file and the field. Torch-free.
#pragma once

#include <string>
#include <vector>

#include "weft/core/spec.h"

namespace weft {

// The fields of an LLM spec a config.json fixes (llm.moe too for Mixtral). `sliding_window` is 0
// when the model attends to every earlier token (Mistral's and Mixtral's window must be >=
// max_seq; parse_spec checks).
struct HfLlmConfig {
  LlmSpec llm;
  int64_t sliding_window = 0;
  std::string model_type;
};

struct HfEncoderConfig {
  EncoderSpec encoder;     // kind, shape, act, class_token, pre_norm, patch_bias, feature_layer
  std::string model_type;  // "clip", "siglip" or "whisper" (of the tower itself)
  bool has_feature_layer = false;  // llava's vision_feature_layer was given
};

// `dir` is a checkpoint directory or a config.json path.
std::string hf_config_path(const std::string& dir);
HfLlmConfig read_hf_llm_config(const std::string& dir);
HfEncoderConfig read_hf_encoder_config(const std::string& dir);

// config.json text for a weft module, in the Hugging Face layout export writes
// (LlamaForCausalLM / Qwen2ForCausalLM, MixtralForCausalLM for an MoE LLM, CLIPVisionModel,
// SiglipVisionModel, WhisperModel). An MoE LLM that Mixtral cannot express (every > 1, sigmoid
// gating, norm_topk = false, a shared expert, Q/K/V biases) is an Error naming the key; z_loss
// and capacity_factor are training settings and are not written (Mixtral runs dropless).
std::string hf_llm_config_json(const LlmSpec& llm);
std::string hf_encoder_config_json(const EncoderSpec& encoder);

}  // namespace weft
