// Hugging Face checkpoints: weft → HF layout → weft is bit-identical for Llama/Qwen2 LLMs,
// CLIP/SigLIP towers, the Whisper encoder and LLaVA projectors (single file and sharded, fp32
// and bf16); the loaded model's logits equal the native model's; config.json drives the spec;
// wrong checkpoints fail naming the file and the tensor. Also the HF-compatibility model
// variants (quick/tanh GELU, Llama-3.1 RoPE scaling, [CLS] token).
#include "weft/io/hf.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/errors.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/core/hf_config.h"
#include "weft/data/collate.h"
#include "weft/io/safetensors.h"
#include "weft/model/layers.h"
#include "weft/model/multimodal.h"
#include "weft/train/inputs.h"

namespace weft::io {
namespace {

namespace fs = std::filesystem;
using model::MultimodalModel;
using testing::error_of;

EncoderSpec vit(const std::string& name, bool clip) {
  EncoderSpec v;
  v.name = name;
  v.kind = EncoderKind::kVit;
  v.image_size = 16;
  v.patch = 8;
  v.hidden = 16;
  v.layers = 2;
  v.heads = 2;
  v.ffn = 32;
  v.feature_layer = clip ? -2 : -1;
  v.stem_channels = 0;
  v.class_token = clip;
  v.pre_norm = clip;
  v.patch_bias = !clip;
  v.act = clip ? Activation::kQuickGelu : Activation::kGeluTanh;
  v.projector.kind = clip ? ProjectorKind::kMlp : ProjectorKind::kLinear;
  return v;
}

// Llama-style LLM, CLIP-like tower with an mlp projector, Whisper encoder with a linear one.
ModelSpec llama_clip_whisper() {
  ModelSpec m;
  m.llm.vocab = 20;
  m.llm.hidden = 32;
  m.llm.layers = 2;
  m.llm.heads = 4;
  m.llm.kv_heads = 2;
  m.llm.ffn = 64;
  m.llm.max_seq = 32;
  EncoderSpec a;
  a.name = "audio";
  a.kind = EncoderKind::kWhisper;
  a.mels = 8;
  a.frames = 8;
  a.hidden = 16;
  a.layers = 2;
  a.heads = 2;
  a.ffn = 32;
  a.projector.kind = ProjectorKind::kLinear;
  m.encoders = {vit("vision", true), a};
  return m;
}

// Qwen2-style LLM (QKV biases, untied head, Llama-3.1 RoPE scaling) with a SigLIP-like tower.
ModelSpec qwen_siglip() {
  ModelSpec m = llama_clip_whisper();
  m.llm.qkv_bias = true;
  m.llm.tie_embeddings = false;
  m.llm.rope_scaling.llama3 = true;
  m.llm.rope_scaling.factor = 4.0;
  m.llm.rope_scaling.original_max_position = 16;
  m.encoders = {vit("vision", false)};
  return m;
}

// A model whose every parameter (norm weights and biases included, which init to 1 and 0 and
// would hide a swapped mapping) holds distinct random values.
std::map<std::string, at::Tensor> randomised(MultimodalModel& m) {
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  std::map<std::string, at::Tensor> full;
  for (const auto& [name, p] : m.parameters()) {
    p.copy_(at::normal(0.0, 0.5, p.sizes(), gen));
    // Whisper has no K bias (it cannot change attention): HF stores none, weft keeps zeros.
    if (name.rfind("audio.", 0) == 0 && name.find("attn.qkv.bias") != std::string::npos)
      p.narrow(0, p.size(0) / 3, p.size(0) / 3).zero_();
    full[name] = p.detach().clone();
  }
  return full;
}

ModelSpec with_hf(ModelSpec spec, const fs::path& dir) {
  spec.llm.hf = (dir / "llm").string();
  for (EncoderSpec& e : spec.encoders) e.hf = (dir / e.name).string();
  return spec;
}

// Logits at every position of a small multimodal batch (items for every encoder of `m`).
at::Tensor logits_of(const MultimodalModel& m) {
  const ModelSpec& spec = m.spec();
  data::Sample s;
  s.tokens = {1};
  torch::manual_seed(5);
  for (size_t e = 0; e < spec.encoders.size(); ++e) {
    const EncoderSpec& es = spec.encoders[e];
    const int64_t T = es.tokens_per_item(), start = static_cast<int64_t>(s.tokens.size());
    for (int64_t t = 0; t < T; ++t) s.tokens.push_back(2 + static_cast<int64_t>(e));
    s.items.push_back({static_cast<int>(e), start, T,
                       es.kind == EncoderKind::kVit ? torch::randn({3, 16, 16})
                                                    : torch::randn({es.mels, es.frames})});
  }
  for (int64_t t : {5, 6, 7}) s.tokens.push_back(t);
  s.is_target.assign(s.tokens.size(), 0);
  s.is_target.back() = 1;
  data::CollateOptions o;
  o.num_encoders = static_cast<int>(spec.encoders.size());
  o.max_seq = 32;
  const model::Inputs in = train::to_inputs(data::collate({s}, o));
  torch::NoGradGuard no_grad;
  const at::Tensor h = m.hidden(m.embed(in), in);
  return m.llm().logits(h.reshape({-1, h.size(-1)}));
}

std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void expect_round_trip(const ModelSpec& spec, const std::string& tag, int64_t shard_bytes) {
  MultimodalModel native(spec, 7);
  const std::map<std::string, at::Tensor> full = randomised(native);
  const fs::path dir = testing::temp_dir("hf_" + tag);
  export_hf(spec, full, dir.string(), at::kFloat, shard_bytes);

  const ModelSpec loaded_spec = with_hf(spec, dir);
  const HfWeights weights(loaded_spec);
  MultimodalModel loaded(loaded_spec, 99);
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : loaded.parameters()) {
      ASSERT_TRUE(weights.provides(name)) << tag << ": " << name;
      const at::Tensor t = weights.full(name);
      ASSERT_TRUE(torch::equal(t, full.at(name))) << tag << ": " << name << " differs";
      p.copy_(t);
    }
  }
  EXPECT_TRUE(torch::equal(logits_of(loaded), logits_of(native))) << tag;

  // Load -> save -> load: the second export is byte-identical to the first.
  std::map<std::string, at::Tensor> again;
  for (const auto& [name, p] : loaded.parameters()) again[name] = p.detach();
  const fs::path dir2 = testing::temp_dir("hf_" + tag + "_again");
  export_hf(spec, again, dir2.string(), at::kFloat, shard_bytes);
  size_t files = 0;
  for (const auto& f : fs::recursive_directory_iterator(dir)) {
    if (!f.is_regular_file()) continue;
    ++files;
    EXPECT_EQ(bytes_of(f.path()), bytes_of(dir2 / fs::relative(f.path(), dir)))
        << fs::relative(f.path(), dir);
  }
  EXPECT_GE(files, 2 * (1 + spec.encoders.size()));
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

TEST(HfCheckpoint, LlamaClipWhisperRoundTripIsBitIdentical) {
  expect_round_trip(llama_clip_whisper(), "llama", int64_t{1} << 30);
}

TEST(HfCheckpoint, Qwen2SiglipRoundTripIsBitIdentical) {
  expect_round_trip(qwen_siglip(), "qwen", int64_t{1} << 30);
}

TEST(HfCheckpoint, ShardedCheckpointRoundTrips) {
  expect_round_trip(llama_clip_whisper(), "sharded", 8 << 10);
  // The shards and their index.
  const ModelSpec spec = llama_clip_whisper();
  MultimodalModel native(spec, 7);
  const fs::path dir = testing::temp_dir("hf_shards");
  export_hf(spec, randomised(native), dir.string(), at::kFloat, 8 << 10);
  EXPECT_TRUE(fs::exists(dir / "llm" / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "llm" / "model.safetensors"));
  int shards = 0;
  for (const auto& f : fs::directory_iterator(dir / "llm"))
    shards += f.path().filename().string().rfind("model-000", 0) == 0;
  EXPECT_GE(shards, 2);
  fs::remove_all(dir);
}

TEST(HfCheckpoint, Bf16CheckpointLoadsAsFp32) {
  const ModelSpec spec = llama_clip_whisper();
  MultimodalModel native(spec, 7);
  const std::map<std::string, at::Tensor> full = randomised(native);
  const fs::path dir = testing::temp_dir("hf_bf16");
  export_hf(spec, full, dir.string(), at::kBFloat16);
  const SafetensorsFile f = load_safetensors((dir / "llm" / "model.safetensors").string());
  EXPECT_EQ(f.tensors[0].second.scalar_type(), at::kBFloat16);
  const HfWeights weights(with_hf(spec, dir));
  for (const auto& [name, t] : full) {
    const at::Tensor got = weights.full(name);
    EXPECT_EQ(got.scalar_type(), at::kFloat);
    EXPECT_TRUE(torch::equal(got, t.to(at::kBFloat16).to(at::kFloat))) << name;
  }
  fs::remove_all(dir);
}

TEST(HfCheckpoint, ConfigJsonDrivesTheSpec) {
  const ModelSpec spec = qwen_siglip();
  MultimodalModel native(spec, 7);
  const fs::path dir = testing::temp_dir("hf_config");
  export_hf(spec, randomised(native), dir.string());
  const std::string toml = "[model.llm]\nhf = \"" + (dir / "llm").string() +
                           "\"\nmax_seq = 32\n[model.vision]\nkind = \"vit\"\nhf = \"" +
                           (dir / "vision").string() +
                           "\"\n[model.vision.projector]\nkind = \"linear\"\n";
  const Spec parsed = parse_spec(toml, "<string>");
  const LlmSpec& l = parsed.model.llm;
  EXPECT_EQ(l.vocab, 20);
  EXPECT_EQ(l.hidden, 32);
  EXPECT_EQ(l.kv_heads, 2);
  EXPECT_TRUE(l.qkv_bias);
  EXPECT_FALSE(l.tie_embeddings);
  EXPECT_TRUE(l.rope_scaling.llama3);
  EXPECT_EQ(l.rope_scaling.factor, 4.0);
  EXPECT_EQ(l.rope_scaling.original_max_position, 16);
  const EncoderSpec& v = parsed.model.encoders.at(0);
  EXPECT_FALSE(v.class_token);
  EXPECT_FALSE(v.pre_norm);
  EXPECT_TRUE(v.patch_bias);
  EXPECT_EQ(v.act, Activation::kGeluTanh);
  EXPECT_EQ(v.image_size, 16);
  EXPECT_EQ(v.patch, 8);
  EXPECT_EQ(v.norm_eps, spec.encoders[0].norm_eps);
  // The saved run config round-trips through config.json again.
  EXPECT_EQ(spec_to_toml(parse_spec(spec_to_toml(parsed), "<string>")), spec_to_toml(parsed));

  // A key that disagrees with config.json names both.
  const std::string e =
      error_of([&] { parse_spec(toml + "", "<string>", {"model.llm.hidden=64"}); });
  EXPECT_NE(e.find("model.llm.hidden = 64: disagrees with"), std::string::npos) << e;
  EXPECT_NE(e.find("config.json (which says 32)"), std::string::npos) << e;
  fs::remove_all(dir);
}

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

TEST(HfConfig, LlavaConfigWithTransformersDefaults) {
  // The shape of llava-hf/llava-1.5-7b-hf's config.json (absent fields take the defaults).
  const fs::path dir = testing::temp_dir("hf_llava_config");
  write(dir / "config.json", R"({
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
    "image_token_index": 32000, "projector_hidden_act": "gelu",
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "text_config": {"model_type": "llama", "vocab_size": 32064, "hidden_size": 4096,
      "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
      "rms_norm_eps": 1e-05},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
      "image_size": 336, "intermediate_size": 4096, "num_attention_heads": 16,
      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768}})");
  const HfLlmConfig l = read_hf_llm_config(dir.string());
  EXPECT_EQ(l.llm.vocab, 32064);
  EXPECT_EQ(l.llm.kv_heads, 32);
  EXPECT_FALSE(l.llm.tie_embeddings);
  EXPECT_EQ(l.llm.rope_theta, 10000.0);
  const HfEncoderConfig v = read_hf_encoder_config(dir.string());
  EXPECT_EQ(v.encoder.feature_layer, -2);
  EXPECT_EQ(v.encoder.tokens_per_item(), 576);
  EXPECT_EQ(v.encoder.act, Activation::kQuickGelu);
  EXPECT_TRUE(v.encoder.class_token);
  EXPECT_EQ(v.encoder.norm_eps, 1e-5);
  fs::remove_all(dir);
}

TEST(HfConfig, UnsupportedConfigsNameFileAndField) {
  const fs::path dir = testing::temp_dir("hf_bad_config");
  auto err = [&](const std::string& json, bool llm) {
    write(dir / "config.json", json);
    return error_of([&] {
      if (llm)
        read_hf_llm_config(dir.string());
      else
        read_hf_encoder_config(dir.string());
    });
  };
  const std::string base =
      R"("vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2)";
  std::string e = err(R"({"model_type": "gpt2"})", true);
  EXPECT_NE(e.find("config.json: model_type = \"gpt2\": expected llama"), std::string::npos) << e;
  e = err(R"({"model_type": "llama", "hidden_act": "gelu", )" + base + "}", true);
  EXPECT_NE(e.find("hidden_act = \"gelu\""), std::string::npos) << e;
  e = err(R"({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}, )" + base + "}", true);
  EXPECT_NE(e.find("rope_scaling.rope_type"), std::string::npos) << e;
  e = err(R"({"model_type": "llama", "vocab_size": 10})", true);
  EXPECT_NE(e.find("hidden_size: missing"), std::string::npos) << e;
  e = err(R"({"model_type": "clip_vision_model", "image_size": 30, "patch_size": 14})", false);
  EXPECT_NE(e.find("patch_size = 14: must divide image_size"), std::string::npos) << e;
  e = err("{not json", true);
  EXPECT_NE(e.find("config.json: not a JSON object"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(HfCheckpoint, WrongCheckpointsNameFileAndTensor) {
  const ModelSpec spec = llama_clip_whisper();
  MultimodalModel native(spec, 7);
  const std::map<std::string, at::Tensor> full = randomised(native);
  const fs::path dir = testing::temp_dir("hf_wrong");
  export_hf(spec, full, dir.string());
  const fs::path llm = dir / "llm" / "model.safetensors";
  SafetensorsFile f = load_safetensors(llm.string());

  // A missing tensor.
  TensorMap fewer;
  for (const auto& nt : f.tensors)
    if (nt.first != "model.layers.1.mlp.up_proj.weight") fewer.push_back(nt);
  save_safetensors(llm.string(), fewer);
  std::string e = error_of([&] { HfWeights w(with_hf(spec, dir)); });
  EXPECT_NE(e.find("missing tensor 'model.layers.1.mlp.up_proj.weight' (for model.llm parameter "
                   "llm.layers.1.mlp.gate_up.weight)"),
            std::string::npos)
      << e;

  // A tensor of the wrong shape.
  TensorMap wrong = f.tensors;
  for (auto& nt : wrong)
    if (nt.first == "model.layers.0.self_attn.k_proj.weight") nt.second = torch::zeros({4, 32});
  save_safetensors(llm.string(), wrong);
  e = error_of([&] { HfWeights w(with_hf(spec, dir)); });
  EXPECT_NE(e.find("'model.layers.0.self_attn.k_proj.weight' has shape [4, 32]"), std::string::npos)
      << e;

  // An index that points outside the directory, and one naming a missing tensor.
  fs::remove(llm);
  write(dir / "llm" / "model.safetensors.index.json",
        R"({"weight_map": {"model.norm.weight": "../secret.safetensors"}})");
  e = error_of([&] { HfCheckpoint c((dir / "llm").string()); });
  EXPECT_NE(e.find("must be a file name in the checkpoint directory"), std::string::npos) << e;
  save_safetensors((dir / "llm" / "a.safetensors").string(), f.tensors);
  write(
      dir / "llm" / "model.safetensors.index.json",
      R"({"weight_map": {"model.norm.weight": "a.safetensors", "lm_head.weight": "a.safetensors"}})");
  e = error_of([&] { HfCheckpoint c((dir / "llm").string()); });
  EXPECT_NE(e.find("tensor 'lm_head.weight' is not in a.safetensors"), std::string::npos) << e;

  // No weights at all.
  e = error_of([&] { HfCheckpoint c(dir.string()); });
  EXPECT_NE(e.find("no model.safetensors or model.safetensors.index.json"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(HfVariants, ActivationsMatchTheirFormulas) {
  const at::Tensor x = torch::linspace(-4, 4, 101, torch::kDouble);
  const at::Tensor quick = model::activate(x, Activation::kQuickGelu);
  EXPECT_TRUE(torch::allclose(quick, x / (1 + torch::exp(-1.702 * x)), 1e-12, 1e-12));
  const at::Tensor tanh = model::activate(x, Activation::kGeluTanh);
  const at::Tensor ref =
      0.5 * x * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
  EXPECT_TRUE(torch::allclose(tanh, ref, 1e-12, 1e-12));
  const at::Tensor exact = model::activate(x, Activation::kGelu);
  EXPECT_TRUE(torch::allclose(exact, 0.5 * x * (1 + torch::erf(x / std::sqrt(2.0))), 1e-12, 1e-12));
}

TEST(HfVariants, Llama3RopeScalingMatchesTransformers) {
  // transformers' _compute_llama3_parameters, written out per frequency.
  RopeScaling s;
  s.llama3 = true;
  s.factor = 8;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position = 64;
  const int64_t D = 32;
  const double theta = 500000.0;
  const at::Tensor pos = torch::arange(0, 100, torch::kLong).unsqueeze(0);
  const model::Rope rope = model::Rope::make(pos, D, theta, s);
  for (int64_t i = 0; i < D / 2; ++i) {
    const double f = std::pow(theta, -2.0 * i / D), wavelen = 2 * M_PI / f;
    const double low = 64.0 / 1, high = 64.0 / 4;
    double g = f;
    if (wavelen > low) {
      g = f / 8;
    } else if (wavelen >= high) {
      const double smooth = (64.0 / wavelen - 1) / (4 - 1);
      g = (1 - smooth) * f / 8 + smooth * f;
    }
    for (int64_t p : {1, 37, 99}) {
      EXPECT_NEAR(rope.cos[0][p][0][i].item<double>(), std::cos(p * g), 1e-6) << i << " " << p;
      EXPECT_NEAR(rope.sin[0][p][0][i + D / 2].item<double>(), std::sin(p * g), 1e-6);
    }
  }
}

TEST(HfVariants, ClipTowerDropsItsClassToken) {
  ModelSpec spec = llama_clip_whisper();
  MultimodalModel m(spec, 3);
  const at::Tensor y = (*m.encoder(0))(torch::randn({2, 3, 16, 16}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 4, 16}));
  bool has_class = false;
  for (const auto& [name, p] : m.parameters()) has_class = has_class || name == "vision.class";
  EXPECT_TRUE(has_class);
}

}  // namespace
}  // namespace weft::io
