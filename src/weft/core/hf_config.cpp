#include "weft/core/hf_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "weft/core/error.h"

namespace weft {

namespace {
using json = nlohmann::json;
namespace fs = std::filesystem;

json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, path, ": cannot read Hugging Face config (",
             errno ? std::strerror(errno) : "open failed", ")");
  std::ostringstream text;
  text << in.rdbuf();
  json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  WEFT_CHECK(!j.is_discarded() && j.is_object(), path, ": not a JSON object");
  return j;
}

// Typed field access with the file and the field's path in every message.
class Fields {
 public:
  Fields(const json& j, std::string file, std::string prefix)
      : j_(j), file_(std::move(file)), prefix_(std::move(prefix)) {}
  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  [[noreturn]] void fail(const char* key, const std::string& what) const {
    const std::string value = j_.contains(key) ? " = " + j_[key].dump() : "";
    WEFT_FAIL(file_, ": ", prefix_, key, value, ": ", what);
  }
  int64_t integer(const char* key) const {
    if (!has(key)) fail(key, "missing (expected an integer)");
    if (!j_[key].is_number_integer()) fail(key, "expected an integer");
    const int64_t v = j_[key].get<int64_t>();
    if (v <= 0) fail(key, "must be > 0");
    return v;
  }
  int64_t integer(const char* key, int64_t fallback) const {
    return has(key) ? integer(key) : fallback;
  }
  double number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_number() || !std::isfinite(j_[key].get<double>()))
      fail(key, "expected a finite number");
    return j_[key].get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_boolean()) fail(key, "expected true or false");
    return j_[key].get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_string()) fail(key, "expected a string");
    return j_[key].get<std::string>();
  }
  Fields sub(const char* key) const {
    if (!has(key) || !j_[key].is_object()) fail(key, "expected an object");
    return Fields(j_[key], file_, prefix_ + key + ".");
  }
  const json& raw() const { return j_; }

 private:
  const json& j_;
  std::string file_, prefix_;
};

// transformers' defaults for the LLM fields a config.json leaves out (0: required; weft does not
// guess the shape of a Llama, Mistral or Qwen2 checkpoint).
struct LlmDefaults {
  int64_t vocab = 0, hidden = 0, layers = 0, heads = 0, ffn = 0;
  int64_t kv_heads = 0;  // 0 = num_attention_heads
  double rope_theta = 10000.0, norm_eps = 1e-6;
};

LlmDefaults defaults_of(const std::string& model_type) {
  if (model_type == "mixtral") return {32000, 4096, 32, 32, 14336, 8, 1e6, 1e-5};  // MixtralConfig
  // An absent num_key_value_heads is MistralConfig's 8 and Qwen2Config's 32, not the head count.
  if (model_type == "mistral") return {0, 0, 0, 0, 0, 8};
  if (model_type == "qwen2") return {0, 0, 0, 0, 0, 32};
  return {};
}

LlmSpec llm_from(const Fields& f, const std::string& model_type) {
  const LlmDefaults d = defaults_of(model_type);
  auto count = [&](const char* key, int64_t fallback) {
    return fallback > 0 ? f.integer(key, fallback) : f.integer(key);
  };
  LlmSpec l;
  l.vocab = count("vocab_size", d.vocab);
  l.hidden = count("hidden_size", d.hidden);
  l.layers = count("num_hidden_layers", d.layers);
  l.heads = count("num_attention_heads", d.heads);
  l.kv_heads = f.integer("num_key_value_heads", d.kv_heads > 0 ? d.kv_heads : l.heads);
  l.ffn = count("intermediate_size", d.ffn);
  l.rope_theta = f.number("rope_theta", d.rope_theta);
  l.norm_eps = f.number("rms_norm_eps", d.norm_eps);
  l.tie_embeddings = f.boolean("tie_word_embeddings", false);
  l.qkv_bias = model_type == "qwen2";
  if (f.string("hidden_act", "silu") != "silu")
    f.fail("hidden_act", "weft's LLM MLP is SwiGLU with silu");
  if (f.boolean("attention_bias", false))
    f.fail("attention_bias", "biases on every attention projection are not supported");
  if (f.boolean("mlp_bias", false)) f.fail("mlp_bias", "MLP biases are not supported");
  if (l.hidden % l.heads != 0)
    f.fail("num_attention_heads", "must divide hidden_size = " + std::to_string(l.hidden));
  if (l.heads % l.kv_heads != 0)
    f.fail("num_key_value_heads", "must divide num_attention_heads = " + std::to_string(l.heads));
  if (f.has("head_dim") && f.integer("head_dim") != l.hidden / l.heads)
    f.fail("head_dim", "must be hidden_size / num_attention_heads = " +
                           std::to_string(l.hidden / l.heads) + " (weft derives it)");
  // transformers >= 5 writes rope_theta and the scaling together as rope_parameters (rope_type
  // "default" when unscaled); earlier versions rope_theta and rope_scaling at the top level.
  const bool parameters = f.has("rope_parameters");
  if (parameters || f.has("rope_scaling")) {
    const Fields r = f.sub(parameters ? "rope_parameters" : "rope_scaling");
    l.rope_theta = r.number("rope_theta", l.rope_theta);
    const std::string type = r.string("rope_type", r.string("type", parameters ? "default" : ""));
    if (type != "llama3" && type != "default")
      r.fail("rope_type", "only \"llama3\" rope scaling is supported");
    if (type == "llama3") {
      l.rope_scaling.llama3 = true;
      l.rope_scaling.factor = r.number("factor", 8.0);
      l.rope_scaling.low_freq_factor = r.number("low_freq_factor", 1.0);
      l.rope_scaling.high_freq_factor = r.number("high_freq_factor", 4.0);
      l.rope_scaling.original_max_position = r.integer("original_max_position_embeddings", 8192);
      if (!(l.rope_scaling.high_freq_factor > l.rope_scaling.low_freq_factor))
        r.fail("high_freq_factor", "must be > low_freq_factor");
    }
  }
  if (!(l.rope_theta > 0)) f.fail("rope_theta", "must be > 0");
  return l;
}

// Mixtral's sparse MoE block (transformers' MixtralSparseMoeBlock) in weft's terms: every block,
// softmax over all experts in fp32, top-k, the k weights renormalised to sum to 1, no shared
// expert, dropless; the z-loss is off. The load-balancing loss keeps transformers' strength:
// transformers computes one loss over every layer's tokens, E·Σ_e (Σ_k f_ke)·P_e, which is
// top_k times weft's per-block E·Σ_e f_e·P_e (f normalised over the top-k slots), while weft sums
// its loss over the MoE blocks; so router_aux_loss_coef c becomes aux_loss = c · top_k / layers
// (and export writes aux_loss · layers / top_k). transformers adds the loss only with
// output_router_logits; weft always trains with it.
double mixtral_aux_scale(const LlmSpec& l) {
  return static_cast<double>(l.moe.top_k) / static_cast<double>(std::max<int64_t>(l.layers, 1));
}

void mixtral_moe(const Fields& f, LlmSpec* l) {
  MoeSpec& m = l->moe;
  m.experts = f.integer("num_local_experts", 8);
  m.top_k = f.integer("num_experts_per_tok", 2);
  if (m.top_k > m.experts)
    f.fail("num_experts_per_tok", "must be <= num_local_experts = " + std::to_string(m.experts));
  m.ffn = l->ffn;
  m.every = 1;
  m.sigmoid = false;
  m.norm_topk = true;
  m.shared_ffn = 0;
  const double coef = f.number("router_aux_loss_coef", 0.001);
  if (coef < 0) f.fail("router_aux_loss_coef", "must be >= 0");
  m.aux_loss = coef * mixtral_aux_scale(*l);
  m.z_loss = 0;
  m.capacity_factor = 0;
  if (f.number("router_jitter_noise", 0.0) != 0)
    f.fail("router_jitter_noise",
           "weft does not implement router jitter (training-time noise on the router's input); "
           "expected 0");
}

// transformers' CLIPVisionConfig / SiglipVisionConfig defaults for absent fields.
EncoderSpec vit_from(const Fields& f, bool siglip) {
  EncoderSpec e;
  e.kind = EncoderKind::kVit;
  e.hidden = f.integer("hidden_size", 768);
  e.ffn = f.integer("intermediate_size", 3072);
  e.layers = f.integer("num_hidden_layers", 12);
  e.heads = f.integer("num_attention_heads", 12);
  e.channels = f.integer("num_channels", 3);
  e.image_size = f.integer("image_size", 224);
  e.patch = f.integer("patch_size", siglip ? 16 : 32);
  e.norm_eps = f.number("layer_norm_eps", siglip ? 1e-6 : 1e-5);
  e.stem_channels = 0;
  const std::string act = f.string("hidden_act", siglip ? "gelu_pytorch_tanh" : "quick_gelu");
  if (act == "quick_gelu")
    e.act = Activation::kQuickGelu;
  else if (act == "gelu")
    e.act = Activation::kGelu;
  else if (act == "gelu_pytorch_tanh" || act == "gelu_new")
    e.act = Activation::kGeluTanh;
  else
    f.fail("hidden_act", "expected quick_gelu, gelu, gelu_new or gelu_pytorch_tanh");
  e.class_token = !siglip;
  e.pre_norm = !siglip;
  e.patch_bias = siglip;
  e.feature_layer = -1;
  if (e.image_size % e.patch != 0) f.fail("patch_size", "must divide image_size");
  if (e.hidden % e.heads != 0) f.fail("num_attention_heads", "must divide hidden_size");
  return e;
}

EncoderSpec whisper_from(const Fields& f) {
  EncoderSpec e;
  e.kind = EncoderKind::kWhisper;
  e.hidden = f.integer("d_model", 384);
  e.layers = f.integer("encoder_layers", 4);
  e.heads = f.integer("encoder_attention_heads", 6);
  e.ffn = f.integer("encoder_ffn_dim", 1536);
  e.mels = f.integer("num_mel_bins", 80);
  e.frames = 2 * f.integer("max_source_positions", 1500);
  e.norm_eps = 1e-5;
  e.act = Activation::kGelu;
  e.feature_layer = -1;
  if (f.string("activation_function", "gelu") != "gelu")
    f.fail("activation_function", "weft's whisper encoder uses exact gelu");
  if (e.hidden % e.heads != 0) f.fail("encoder_attention_heads", "must divide d_model");
  return e;
}
bool known_llm(const std::string& type) {
  return type == "llama" || type == "mistral" || type == "mixtral" || type == "qwen2";
}
}  // namespace

std::string hf_config_path(const std::string& dir) {
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return (fs::path(dir) / "config.json").string();
  return dir;
}

HfLlmConfig read_hf_llm_config(const std::string& dir) {
  const std::string path = hf_config_path(dir);
  const json j = read_json(path);
  Fields f(j, path, "");
  std::string type = f.string("model_type", "");
  if (type == "llava") {
    const Fields t = f.sub("text_config");
    HfLlmConfig c;
    c.model_type = t.string("model_type", "llama");
    if (!known_llm(c.model_type)) t.fail("model_type", "expected llama, mistral, mixtral or qwen2");
    c.llm = llm_from(t, c.model_type);
    if (c.model_type == "mixtral") mixtral_moe(t, &c.llm);
    if ((c.model_type == "mistral" || c.model_type == "mixtral") && t.has("sliding_window"))
      c.sliding_window = t.integer("sliding_window");
    return c;
  }
  if (!known_llm(type))
    f.fail("model_type", "expected llama, mistral, mixtral, qwen2 or llava (an LLM checkpoint)");
  HfLlmConfig c;
  c.model_type = type;
  c.llm = llm_from(f, type);
  if (type == "mixtral") mixtral_moe(f, &c.llm);
  if (type != "llama" && f.has("sliding_window") &&
      (type == "mistral" || type == "mixtral" || f.boolean("use_sliding_window", false)))
    c.sliding_window = f.integer("sliding_window");
  return c;
}

HfEncoderConfig read_hf_encoder_config(const std::string& dir) {
  const std::string path = hf_config_path(dir);
  const json j = read_json(path);
  Fields f(j, path, "");
  const std::string type = f.string("model_type", "");
  HfEncoderConfig c;
  if (type == "llava") {
    const Fields v = f.sub("vision_config");
    const std::string vt = v.string("model_type", "clip_vision_model");
    const bool siglip = vt.rfind("siglip", 0) == 0;
    if (!siglip && vt.rfind("clip", 0) != 0)
      v.fail("model_type", "expected a clip or siglip vision tower");
    c.encoder = vit_from(v, siglip);
    c.model_type = siglip ? "siglip" : "clip";
    if (f.has("vision_feature_layer")) {
      if (!f.raw()["vision_feature_layer"].is_number_integer())
        f.fail("vision_feature_layer", "expected one integer (several layers are not supported)");
      const int64_t layer = f.raw()["vision_feature_layer"].get<int64_t>();
      // HF indexes hidden_states: 0 = embeddings, k = after k blocks, -1 = last block.
      if (layer == 0 || layer < -c.encoder.layers || layer > c.encoder.layers)
        f.fail("vision_feature_layer", "must name a block's output");
      c.encoder.feature_layer = layer;
      c.has_feature_layer = true;
    } else {
      c.encoder.feature_layer = -2;
      c.has_feature_layer = true;
    }
    // weft's features are the patch tokens: CLIP's [CLS] dropped ("default"), SigLIP's all.
    const std::string strategy = f.string("vision_feature_select_strategy", "default");
    if (strategy != (siglip ? "full" : "default"))
      f.fail("vision_feature_select_strategy",
             siglip ? "a siglip tower has no [CLS] token: expected \"full\""
                    : "expected \"default\" (the patch tokens, [CLS] dropped)");
    if (f.string("projector_hidden_act", "gelu") != "gelu")
      f.fail("projector_hidden_act", "weft's mlp projector uses exact gelu");
    return c;
  }
  if (type == "clip" || type == "siglip") {
    c.encoder = vit_from(f.sub("vision_config"), type == "siglip");
    c.model_type = type;
  } else if (type == "clip_vision_model" || type == "siglip_vision_model") {
    c.encoder = vit_from(f, type == "siglip_vision_model");
    c.model_type = type == "siglip_vision_model" ? "siglip" : "clip";
  } else if (type == "whisper") {
    c.encoder = whisper_from(f);
    c.model_type = "whisper";
  } else {
    f.fail("model_type",
           "expected clip, clip_vision_model, siglip, siglip_vision_model, whisper or llava (an "
           "encoder checkpoint)");
  }
  return c;
}

namespace {
// An MoE LLM exports as Mixtral only if it is one.
void check_mixtral_shaped(const LlmSpec& l) {
  const MoeSpec& m = l.moe;
  const char* what = "export: model.llm.moe.";
  const char* why = " cannot be written as a Hugging Face Mixtral (MixtralForCausalLM) checkpoint";
  WEFT_CHECK(m.every == 1 || l.layers == 1, what, "every = ", m.every, why,
             ", which has experts in every block (expected every = 1)");
  WEFT_CHECK(!m.sigmoid, what, "gating = \"sigmoid\"", why,
             ", whose router is a softmax (expected gating = \"softmax\")");
  WEFT_CHECK(m.norm_topk, what, "norm_topk = false", why,
             ", which renormalises the top-k weights (expected norm_topk = true)");
  WEFT_CHECK(m.shared_ffn == 0, what, "shared_ffn = ", m.shared_ffn, why,
             ", which has no shared expert (expected shared_ffn = 0)");
  WEFT_CHECK(!l.qkv_bias, "export: model.llm.qkv_bias = true", why,
             ", which has no Q/K/V biases (expected qkv_bias = false)");
}
}  // namespace

std::string hf_llm_config_json(const LlmSpec& l) {
  const bool mixtral = l.moe.enabled();
  if (mixtral) check_mixtral_shaped(l);
  const bool qwen = l.qkv_bias;
  json j = {{"architectures",
             {mixtral ? "MixtralForCausalLM"
              : qwen  ? "Qwen2ForCausalLM"
                      : "LlamaForCausalLM"}},
            {"model_type", mixtral ? "mixtral"
                           : qwen  ? "qwen2"
                                   : "llama"},
            {"vocab_size", l.vocab},
            {"hidden_size", l.hidden},
            {"intermediate_size", mixtral ? l.expert_ffn() : l.ffn},
            {"num_hidden_layers", l.layers},
            {"num_attention_heads", l.heads},
            {"num_key_value_heads", l.kv_heads},
            {"hidden_act", "silu"},
            {"max_position_embeddings", l.max_seq},
            {"rms_norm_eps", l.norm_eps},
            {"rope_theta", l.rope_theta},
            {"tie_word_embeddings", l.tie_embeddings},
            {"torch_dtype", "float32"}};
  if (mixtral) {
    // Training-only settings without a Mixtral field (z_loss, capacity_factor) are not written.
    j["num_local_experts"] = l.moe.experts;
    j["num_experts_per_tok"] = l.moe.top_k;
    j["router_aux_loss_coef"] = l.moe.aux_loss / mixtral_aux_scale(l);
    j["router_jitter_noise"] = 0.0;
    j["output_router_logits"] = false;
    j["sliding_window"] = nullptr;
  } else if (!qwen) {
    j["attention_bias"] = false;
  }
  if (l.rope_scaling.llama3)
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", l.rope_scaling.factor},
        {"low_freq_factor", l.rope_scaling.low_freq_factor},
        {"high_freq_factor", l.rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", l.rope_scaling.original_max_position}};
  return j.dump(2) + "\n";
}

std::string hf_encoder_config_json(const EncoderSpec& e) {
  if (e.kind == EncoderKind::kWhisper) {
    WEFT_CHECK(e.act == Activation::kGelu, "model.", e.name,
               ": a whisper encoder exports with act = \"gelu\" only");
    json j = {{"architectures", {"WhisperModel"}},
              {"model_type", "whisper"},
              {"d_model", e.hidden},
              {"encoder_layers", e.layers},
              {"encoder_attention_heads", e.heads},
              {"encoder_ffn_dim", e.ffn},
              {"num_mel_bins", e.mels},
              {"max_source_positions", e.frames / 2},
              {"activation_function", "gelu"},
              {"torch_dtype", "float32"}};
    return j.dump(2) + "\n";
  }
  const bool clip = e.class_token && e.pre_norm && !e.patch_bias;
  const bool siglip = !e.class_token && !e.pre_norm && e.patch_bias;
  WEFT_CHECK(e.stem_channels == 0 && (clip || siglip), "model.", e.name,
             ": no Hugging Face layout for this vit (CLIP is class_token = true, pre_norm = true, "
             "patch_bias = false; SigLIP the opposite; neither has a conv stem)");
  const char* act = e.act == Activation::kQuickGelu ? "quick_gelu"
                    : e.act == Activation::kGelu    ? "gelu"
                                                    : "gelu_pytorch_tanh";
  json j = {{"architectures", {clip ? "CLIPVisionModel" : "SiglipVisionModel"}},
            {"model_type", clip ? "clip_vision_model" : "siglip_vision_model"},
            {"hidden_size", e.hidden},
            {"intermediate_size", e.ffn},
            {"num_hidden_layers", e.layers},
            {"num_attention_heads", e.heads},
            {"num_channels", e.channels},
            {"image_size", e.image_size},
            {"patch_size", e.patch},
            {"hidden_act", act},
            {"layer_norm_eps", e.norm_eps},
            {"torch_dtype", "float32"}};
  return j.dump(2) + "\n";
}

}  // namespace weft
