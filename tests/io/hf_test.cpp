// Hugging Face checkpoints: weft → HF layout → weft is bit-identical for Llama/Qwen2/Mixtral
// LLMs, CLIP/SigLIP towers, the Whisper encoder and LLaVA projectors (single file and sharded,
// fp32 and bf16); the loaded model's logits equal the native model's; config.json drives the
// spec; wrong checkpoints fail naming the file and the tensor. Mixtral's MoE block is checked
// against transformers' formula on the exported tensors, and its stacked (transformers 5)
// expert layout loads too. Also the HF-compatibility model variants (quick/tanh GELU, Llama-3.1
// RoPE scaling, [CLS] token).
#include "weft/io/hf.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "support/errors.h"
#include "support/model_specs.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/core/hf_config.h"
#include "weft/data/collate.h"
#include "weft/io/files.h"
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
  ModelSpec m = testing::tiny_multimodal_spec();
  m.encoders[0] = vit("vision", true);
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

// Mixtral-shaped MoE LLM (every block: 4 experts, top-2, experts narrower than `ffn`, untied
// head, Mixtral's RoPE base) with the CLIP-like tower.
ModelSpec mixtral_clip() {
  ModelSpec m = llama_clip_whisper();
  m.llm.tie_embeddings = false;
  m.llm.rope_theta = 1e6;
  m.llm.moe.experts = 4;
  m.llm.moe.top_k = 2;
  m.llm.moe.ffn = 48;
  m.llm.moe.aux_loss = 0.02;
  m.encoders = {vit("vision", true)};
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
      // A split along dim 0 (in two uneven segments where they split evenly) reads its rows
      // only, across the parts a fused parameter is stacked from.
      const int64_t rows = t.dim() > 0 ? t.size(0) : 0;
      for (const int64_t n : {2, 4}) {
        if (rows == 0 || rows % n != 0) continue;
        std::vector<int64_t> segments;
        if (rows % (2 * n) == 0 && rows > 2 * n) segments = {rows / 2 - n, rows / 2 + n};
        // Rows that are not the checkpoint's: left to full(), whose path says what does not fit.
        EXPECT_FALSE(weights.shard(name, {0, {rows + n}, 0, n}).defined()) << name;
        for (int64_t r = 0; r < n; ++r) {
          const at::Tensor got = weights.shard(name, {0, segments, r, n});
          if (!got.defined()) continue;  // not stored as rows (an expert of a stacked tensor)
          EXPECT_TRUE(torch::equal(got, model::take_shard(t, model::Split{0, segments, r, n})))
              << tag << ": " << name << " rank " << r << " of " << n;
        }
      }
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
  weft::io::remove_tree(dir);
  weft::io::remove_tree(dir2);
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
  weft::io::remove_tree(dir);
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
  weft::io::remove_tree(dir);
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
  weft::io::remove_tree(dir);
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
  weft::io::remove_tree(dir);
}

TEST(HfConfig, AbsentKvHeadsTakeEachArchitecturesDefault) {
  // LlamaConfig: the head count; MistralConfig: 8; Qwen2Config: 32.
  const fs::path dir = testing::temp_dir("hf_kv_defaults");
  for (const auto& [type, kv] :
       {std::pair<const char*, int64_t>{"llama", 64}, {"mistral", 8}, {"qwen2", 32}}) {
    write(dir / "config.json",
          std::string(R"({"model_type": ")") + type +
              R"(", "vocab_size": 256, "hidden_size": 4096, "intermediate_size": 11008,
                 "num_hidden_layers": 2, "num_attention_heads": 64})");
    EXPECT_EQ(read_hf_llm_config(dir.string()).llm.kv_heads, kv) << type;
  }
  weft::io::remove_tree(dir);
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
  weft::io::remove_tree(dir);
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
  weft::io::remove_tree(dir);
}

// --- Mixtral (an MoE LLM) ----------------------------------------------------------------------

TEST(HfCheckpoint, MixtralRoundTripIsBitIdentical) {
  expect_round_trip(mixtral_clip(), "mixtral", int64_t{1} << 30);
  expect_round_trip(mixtral_clip(), "mixtral_sharded", 8 << 10);
}

std::map<std::string, at::Tensor> hf_tensors(const fs::path& dir) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : load_safetensors((dir / "model.safetensors").string()).tensors)
    out[name] = t;
  return out;
}

TEST(HfCheckpoint, MixtralBlockMatchesTransformersFormula) {
  // transformers' MixtralSparseMoeBlock on the exported tensors, in double: router logits
  // x·gateᵀ, softmax over all experts, top-k, the k weights divided by their sum, and
  // Σ_k w_k · w2(silu(w1 x) · w3 x). A swapped w1/w3 or a wrong expert order fails here (a round
  // trip alone would not see it).
  const ModelSpec spec = mixtral_clip();
  MultimodalModel native(spec, 7);
  const std::map<std::string, at::Tensor> full = randomised(native);
  const fs::path dir = testing::temp_dir("hf_mixtral_formula");
  export_hf(spec, full, dir.string());
  const std::map<std::string, at::Tensor> hf = hf_tensors(dir / "llm");
  const int64_t H = spec.llm.hidden, E = spec.llm.moe.experts, K = spec.llm.moe.top_k;
  EXPECT_EQ(hf.at("model.layers.0.block_sparse_moe.experts.3.w1.weight").sizes(),
            (std::vector<int64_t>{spec.llm.moe.ffn, H}));
  EXPECT_EQ(hf.at("model.layers.0.block_sparse_moe.experts.3.w2.weight").sizes(),
            (std::vector<int64_t>{H, spec.llm.moe.ffn}));
  torch::manual_seed(3);
  const at::Tensor x = torch::randn({2, 5, H}) * 0.3;
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < spec.llm.layers; ++i) {
    const at::Tensor got = native.llm().blocks[i].moe(x, {}).to(at::kDouble).reshape({-1, H});
    const std::string b = "model.layers." + std::to_string(i) + ".block_sparse_moe.";
    const at::Tensor xs = x.to(at::kDouble).reshape({-1, H});
    const at::Tensor probs = xs.matmul(hf.at(b + "gate.weight").to(at::kDouble).t()).softmax(-1);
    auto [top_w, top_e] = probs.topk(K, -1);
    top_w = top_w / top_w.sum(-1, true);
    at::Tensor want = torch::zeros_like(xs);
    for (int64_t t = 0; t < xs.size(0); ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = top_e[t][k].item<int64_t>();
        ASSERT_LT(e, E);
        auto w = [&](const char* n) {
          return hf.at(b + "experts." + std::to_string(e) + "." + n + ".weight").to(at::kDouble);
        };
        const at::Tensor xt = xs[t];
        want[t] += top_w[t][k] * w("w2").matmul(at::silu(w("w1").matmul(xt)) * w("w3").matmul(xt));
      }
    const double err = (got - want).abs().max().item<double>();
    EXPECT_LT(err, 1e-4 * std::max(1.0, want.abs().max().item<double>())) << "layer " << i;
  }
  weft::io::remove_tree(dir);
}

TEST(HfCheckpoint, MixtralStackedExpertLayoutLoads) {
  // transformers 5 keeps a Mixtral's experts stacked (conversion_mapping.py): mlp.gate, and
  // mlp.experts.gate_up_proj [E, 2F, H] = cat(w1, w3) per expert, down_proj [E, H, F] = w2.
  const ModelSpec spec = mixtral_clip();
  MultimodalModel native(spec, 7);
  const std::map<std::string, at::Tensor> full = randomised(native);
  const fs::path dir = testing::temp_dir("hf_mixtral_stacked");
  export_hf(spec, full, dir.string(), at::kBFloat16);
  const std::map<std::string, at::Tensor> hf = hf_tensors(dir / "llm");
  TensorMap stacked;
  for (const auto& [name, t] : hf)
    if (name.find(".block_sparse_moe.") == std::string::npos) stacked.emplace_back(name, t);
  for (int64_t i = 0; i < spec.llm.layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    std::vector<at::Tensor> gate_up, down;
    for (int64_t j = 0; j < spec.llm.moe.experts; ++j) {
      const std::string e = l + "block_sparse_moe.experts." + std::to_string(j) + ".";
      gate_up.push_back(torch::cat({hf.at(e + "w1.weight"), hf.at(e + "w3.weight")}, 0));
      down.push_back(hf.at(e + "w2.weight"));
    }
    stacked.emplace_back(l + "mlp.gate.weight", hf.at(l + "block_sparse_moe.gate.weight"));
    stacked.emplace_back(l + "mlp.experts.gate_up_proj", torch::stack(gate_up));
    stacked.emplace_back(l + "mlp.experts.down_proj", torch::stack(down));
  }
  save_safetensors((dir / "llm" / "model.safetensors").string(), stacked);
  const HfWeights weights(with_hf(spec, dir));
  for (const auto& [name, t] : full) {
    ASSERT_TRUE(weights.provides(name)) << name;
    EXPECT_TRUE(torch::equal(weights.full(name), t.to(at::kBFloat16).to(at::kFloat))) << name;
  }
  const std::string summary = weights.summary().at(0);
  EXPECT_EQ(summary.find("not used"), std::string::npos) << summary;
  weft::io::remove_tree(dir);
}

TEST(HfConfig, MixtralConfigDrivesTheMoeSpec) {
  const ModelSpec spec = mixtral_clip();
  MultimodalModel native(spec, 7);
  const fs::path dir = testing::temp_dir("hf_mixtral_config");
  export_hf(spec, randomised(native), dir.string());
  std::ifstream config(dir / "llm" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(config);
  EXPECT_EQ(j["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(j["model_type"], "mixtral");
  EXPECT_EQ(j["intermediate_size"], 48);
  EXPECT_EQ(j["num_local_experts"], 4);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_EQ(j["router_aux_loss_coef"], 0.02);  // 2 layers, top-2: the same number
  {  // 4 layers, top-2: weft's per-block weight is half transformers' coefficient
    LlmSpec four = spec.llm;
    four.layers = 4;
    four.moe.aux_loss = 0.01;
    EXPECT_DOUBLE_EQ(nlohmann::json::parse(hf_llm_config_json(four))["router_aux_loss_coef"], 0.02);
  }
  EXPECT_EQ(j["router_jitter_noise"], 0.0);
  EXPECT_TRUE(j["sliding_window"].is_null());

  const std::string toml = "[model.llm]\nhf = \"" + (dir / "llm").string() + "\"\nmax_seq = 32\n";
  const Spec parsed = parse_spec(toml, "<string>");
  const LlmSpec& l = parsed.model.llm;
  EXPECT_EQ(l.hidden, 32);
  EXPECT_EQ(l.ffn, 48);
  EXPECT_EQ(l.rope_theta, 1e6);
  EXPECT_FALSE(l.tie_embeddings);
  EXPECT_FALSE(l.qkv_bias);
  const MoeSpec& m = l.moe;
  EXPECT_EQ(m.experts, 4);
  EXPECT_EQ(m.top_k, 2);
  EXPECT_EQ(l.expert_ffn(), 48);
  EXPECT_EQ(m.every, 1);
  EXPECT_FALSE(m.sigmoid);
  EXPECT_TRUE(m.norm_topk);
  EXPECT_EQ(m.shared_ffn, 0);
  EXPECT_EQ(m.aux_loss, 0.02);
  EXPECT_EQ(m.z_loss, 0);
  EXPECT_EQ(m.capacity_factor, 0);
  // The saved run config (it writes the whole [model.llm.moe] table) reads back the same.
  EXPECT_EQ(spec_to_toml(parse_spec(spec_to_toml(parsed), "<string>")), spec_to_toml(parsed));

  // Training settings are the run's; architecture keys may repeat config.json's values.
  const Spec tuned = parse_spec(toml +
                                    "[model.llm.moe]\nexperts = 4\ntop_k = 2\nffn = 0\nevery = 1\n"
                                    "gating = \"softmax\"\naux_loss = 0.05\nz_loss = 0.01\n"
                                    "capacity_factor = 1.25\n",
                                "<string>");
  EXPECT_EQ(tuned.model.llm.moe.experts, 4);
  EXPECT_EQ(tuned.model.llm.expert_ffn(), 48);
  EXPECT_EQ(tuned.model.llm.moe.aux_loss, 0.05);
  EXPECT_EQ(tuned.model.llm.moe.z_loss, 0.01);
  EXPECT_EQ(tuned.model.llm.moe.capacity_factor, 1.25);
  // ... and must not change the architecture.
  auto disagrees = [&](const std::string& set, const std::string& want) {
    const std::string e = error_of([&] { parse_spec(toml, "<string>", {set}); });
    EXPECT_NE(e.find(want), std::string::npos) << set << ": " << e;
    EXPECT_NE(e.find("config.json (which says"), std::string::npos) << set << ": " << e;
  };
  disagrees("model.llm.moe.experts=8", "model.llm.moe.experts = 8: disagrees with");
  disagrees("model.llm.moe.top_k=1", "model.llm.moe.top_k = 1: disagrees with");
  disagrees("model.llm.moe.ffn=64", "model.llm.moe.ffn = 64: disagrees with");
  disagrees("model.llm.moe.every=2", "model.llm.moe.every = 2: disagrees with");
  disagrees("model.llm.moe.gating=\"sigmoid\"", "model.llm.moe.gating = \"sigmoid\": disagrees");
  disagrees("model.llm.moe.norm_topk=false", "model.llm.moe.norm_topk = false: disagrees");
  disagrees("model.llm.moe.shared_ffn=16", "model.llm.moe.shared_ffn = 16: disagrees with");

  // A dense checkpoint takes no [model.llm.moe].
  const fs::path dense = testing::temp_dir("hf_dense_with_moe");
  MultimodalModel llama(llama_clip_whisper(), 7);
  export_hf(llama_clip_whisper(), randomised(llama), dense.string());
  const std::string e = error_of([&] {
    parse_spec("[model.llm]\nhf = \"" + (dense / "llm").string() + "\"\n", "<string>",
               {"model.llm.moe.experts=4"});
  });
  EXPECT_NE(e.find("model.llm.moe: mixture-of-experts layers need a Mixtral checkpoint"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("is a dense llama one"), std::string::npos) << e;
  weft::io::remove_tree(dir);
  weft::io::remove_tree(dense);
}

TEST(HfConfig, MixtralConfigWithTransformersDefaults) {
  const fs::path dir = testing::temp_dir("hf_mixtral_defaults");
  // Every absent field takes MixtralConfig's default.
  write(dir / "config.json",
        R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})");
  HfLlmConfig c = read_hf_llm_config(dir.string());
  EXPECT_EQ(c.model_type, "mixtral");
  EXPECT_EQ(c.llm.vocab, 32000);
  EXPECT_EQ(c.llm.hidden, 4096);
  EXPECT_EQ(c.llm.layers, 32);
  EXPECT_EQ(c.llm.heads, 32);
  EXPECT_EQ(c.llm.kv_heads, 8);
  EXPECT_EQ(c.llm.ffn, 14336);
  EXPECT_EQ(c.llm.rope_theta, 1e6);
  EXPECT_EQ(c.llm.norm_eps, 1e-5);
  EXPECT_FALSE(c.llm.tie_embeddings);
  EXPECT_FALSE(c.llm.rope_scaling.llama3);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.llm.moe.experts, 8);
  EXPECT_EQ(c.llm.moe.top_k, 2);
  EXPECT_EQ(c.llm.expert_ffn(), 14336);
  EXPECT_EQ(c.llm.moe.every, 1);
  EXPECT_TRUE(c.llm.moe.norm_topk);
  EXPECT_FALSE(c.llm.moe.sigmoid);
  EXPECT_DOUBLE_EQ(c.llm.moe.aux_loss, 0.001 * 2 / 32);  // transformers' strength (top_k / layers)
  EXPECT_EQ(c.llm.moe.z_loss, 0);
  EXPECT_EQ(c.llm.moe.capacity_factor, 0);

  // The shape of mistralai/Mixtral-8x22B-v0.1's config.json.
  write(dir / "config.json", R"({
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 6144, "initializer_range": 0.02,
    "intermediate_size": 16384, "max_position_embeddings": 65536, "model_type": "mixtral",
    "num_attention_heads": 48, "num_experts_per_tok": 2, "num_hidden_layers": 56,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "sliding_window": null, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 32768})");
  c = read_hf_llm_config(dir.string());
  EXPECT_EQ(c.llm.vocab, 32768);
  EXPECT_EQ(c.llm.hidden, 6144);
  EXPECT_EQ(c.llm.layers, 56);
  EXPECT_EQ(c.llm.heads, 48);
  EXPECT_EQ(c.llm.expert_ffn(), 16384);
  EXPECT_EQ(c.sliding_window, 0);

  // transformers 5 writes rope_parameters; a sliding window is kept as for Mistral; a top-1
  // Mixtral keeps transformers' renormalisation (a weight of 1).
  write(dir / "config.json", R"({"model_type": "mixtral", "num_local_experts": 4,
    "num_experts_per_tok": 1, "sliding_window": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})");
  c = read_hf_llm_config(dir.string());
  EXPECT_EQ(c.llm.rope_theta, 500000.0);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.llm.moe.experts, 4);
  EXPECT_EQ(c.llm.moe.top_k, 1);
  EXPECT_TRUE(c.llm.moe.norm_topk);
  weft::io::remove_tree(dir);
}

TEST(HfConfig, UnsupportedMixtralConfigsNameFileAndField) {
  const fs::path dir = testing::temp_dir("hf_bad_mixtral");
  auto err = [&](const std::string& json) {
    write(dir / "config.json", json);
    return error_of([&] { read_hf_llm_config(dir.string()); });
  };
  std::string e = err(R"({"model_type": "mixtral", "router_jitter_noise": 0.01})");
  EXPECT_NE(e.find("config.json: router_jitter_noise = 0.01: weft does not implement router "
                   "jitter"),
            std::string::npos)
      << e;
  e = err(R"({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3})");
  EXPECT_NE(e.find("num_experts_per_tok = 3: must be <= num_local_experts = 2"), std::string::npos)
      << e;
  e = err(R"({"model_type": "mixtral", "router_aux_loss_coef": -1})");
  EXPECT_NE(e.find("router_aux_loss_coef = -1: must be >= 0"), std::string::npos) << e;
  e = err(R"({"model_type": "mixtral", "hidden_act": "gelu"})");
  EXPECT_NE(e.find("hidden_act = \"gelu\""), std::string::npos) << e;
  e = err(R"({"model_type": "mixtral", "rope_parameters": {"rope_type": "yarn"}})");
  EXPECT_NE(e.find("rope_parameters.rope_type = \"yarn\""), std::string::npos) << e;
  weft::io::remove_tree(dir);
}

TEST(HfCheckpoint, NonMixtralMoeExportNamesWhatMixtralCannotExpress) {
  const fs::path dir = testing::temp_dir("hf_not_mixtral");
  auto err = [&](const std::function<void(ModelSpec*)>& change) {
    ModelSpec spec = mixtral_clip();
    change(&spec);
    return error_of([&] { export_hf(spec, {}, dir.string()); });
  };
  std::string e = err([](ModelSpec* s) { s->llm.moe.every = 2; });
  EXPECT_NE(e.find("export: model.llm.moe.every = 2 cannot be written as a Hugging Face Mixtral "
                   "(MixtralForCausalLM) checkpoint, which has experts in every block"),
            std::string::npos)
      << e;
  e = err([](ModelSpec* s) { s->llm.moe.sigmoid = true; });
  EXPECT_NE(e.find("model.llm.moe.gating = \"sigmoid\" cannot be written"), std::string::npos) << e;
  e = err([](ModelSpec* s) { s->llm.moe.norm_topk = false; });
  EXPECT_NE(e.find("model.llm.moe.norm_topk = false cannot be written"), std::string::npos) << e;
  e = err([](ModelSpec* s) { s->llm.moe.shared_ffn = 16; });
  EXPECT_NE(e.find("model.llm.moe.shared_ffn = 16 cannot be written"), std::string::npos) << e;
  e = err([](ModelSpec* s) { s->llm.qkv_bias = true; });
  EXPECT_NE(e.find("model.llm.qkv_bias = true cannot be written"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir));  // nothing was written
}

TEST(HfCheckpoint, MixtralMissingExpertTensorIsNamed) {
  const ModelSpec spec = mixtral_clip();
  MultimodalModel native(spec, 7);
  const fs::path dir = testing::temp_dir("hf_mixtral_missing");
  export_hf(spec, randomised(native), dir.string());
  const fs::path llm = dir / "llm" / "model.safetensors";
  const SafetensorsFile f = load_safetensors(llm.string());
  TensorMap fewer;
  for (const auto& nt : f.tensors)
    if (nt.first != "model.layers.1.block_sparse_moe.experts.3.w3.weight") fewer.push_back(nt);
  save_safetensors(llm.string(), fewer);
  std::string e = error_of([&] { HfWeights w(with_hf(spec, dir)); });
  EXPECT_NE(e.find("missing tensor 'model.layers.1.block_sparse_moe.experts.3.w3.weight' (for "
                   "model.llm parameter llm.layers.1.moe.experts.3.gate_up.weight)"),
            std::string::npos)
      << e;

  // A dense checkpoint's tensors under a Mixtral config: no expert weights at all.
  TensorMap dense;
  for (const auto& nt : f.tensors)
    if (nt.first.find(".block_sparse_moe.") == std::string::npos) dense.push_back(nt);
  save_safetensors(llm.string(), dense);
  e = error_of([&] { HfWeights w(with_hf(spec, dir)); });
  EXPECT_NE(e.find("no mixture-of-experts weights found for model.llm (looked for "
                   "'model.layers.0.block_sparse_moe.gate.weight' and "
                   "'model.layers.0.mlp.experts.gate_up_proj'"),
            std::string::npos)
      << e;

  // A stacked tensor with fewer experts than the model.
  TensorMap stacked = dense;
  for (int64_t i = 0; i < spec.llm.layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    stacked.emplace_back(l + "mlp.gate.weight", torch::zeros({4, 32}));
    stacked.emplace_back(l + "mlp.experts.gate_up_proj", torch::zeros({3, 96, 32}));
    stacked.emplace_back(l + "mlp.experts.down_proj", torch::zeros({4, 32, 48}));
  }
  save_safetensors(llm.string(), stacked);
  e = error_of([&] { HfWeights w(with_hf(spec, dir)); });
  EXPECT_NE(e.find("tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape [3, 96, 32]; "
                   "model.llm parameter llm.layers.0.moe.experts.3.gate_up.weight needs entry 3 "
                   "along dim 0"),
            std::string::npos)
      << e;
  weft::io::remove_tree(dir);
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
