// Hugging Face config.json → weft model shapes. A checkpoint directory's config.json is read
// with the same defaults transformers applies to absent fields, so `[model.llm] hf = DIR`
// builds exactly the architecture the checkpoint was trained as. Supported:
//   LLM:      model_type llama, mistral, qwen2 (or llava's text_config);
//   vision:   clip / clip_vision_model, siglip / siglip_vision_model (or llava's vision_config,
//             with vision_feature_layer);
//   audio:    whisper (the encoder half).
// Anything weft cannot reproduce exactly (another activation, rope scaling type, attention
// bias layout, sliding window shorter than the run's sequence...) is an Error naming the file
// and the field. Torch-free.
#pragma once

#include <string>
#include <vector>

#include "weft/core/spec.h"

namespace weft {

// The fields of an LLM spec a config.json fixes. `sliding_window` is 0 when the model attends
// to every earlier token (Mistral's window must be >= max_seq; parse_spec checks).
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
// (LlamaForCausalLM / Qwen2ForCausalLM, CLIPVisionModel, SiglipVisionModel, WhisperModel).
std::string hf_llm_config_json(const LlmSpec& llm);
std::string hf_encoder_config_json(const EncoderSpec& encoder);

}  // namespace weft
