// `weft example llava OUT_DIR`: writes a small LLaVA-style training set in the formats people
// bring — PNG images, a LLaVA JSON file, a byte-level BPE tokenizer.json (+
// tokenizer_config.json), and freshly initialised Hugging Face checkpoints of a Llama-style LLM
// and a CLIP-style vision tower with its LLaVA projector — so configs/llava-style.toml trains
// end to end with nothing downloaded. The pictures and captions are the built-in shapes
// dataset's ("a red circle in the top left"), rendered at 96x96 so the CLIP processor resizes.
#include "cli/example.h"

#include <png.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "weft/core/error.h"
#include "weft/core/spec.h"
#include "weft/data/bpe_builder.h"
#include "weft/data/shapes.h"
#include "weft/data/tokenizer.h"
#include "weft/io/files.h"
#include "weft/io/hf.h"
#include "weft/model/multimodal.h"

namespace weft::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kSystem =
    "A chat between a curious human and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the human's questions.";
constexpr const char* kQuestion = "What is in the picture?";

void write_file(const fs::path& p, const std::string& text) {
  weft::io::write_text_file(p.string(), text);
}

// float [3, H, W] in [0, 1] -> 8-bit RGB PNG.
void write_png(const fs::path& p, const at::Tensor& chw) {
  const at::Tensor hwc =
      chw.mul(255).round().clamp(0, 255).to(at::kByte).permute({1, 2, 0}).contiguous();
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(hwc.size(1));
  image.height = static_cast<png_uint_32>(hwc.size(0));
  image.format = PNG_FORMAT_RGB;
  const int ok = png_image_write_to_file(&image, p.c_str(), 0, hwc.data_ptr<uint8_t>(), 0, nullptr);
  WEFT_CHECK(ok, p.string(), ": cannot write PNG: ", image.message);
}

std::set<std::string> words_of(const std::string& text) {
  std::set<std::string> out;
  std::string w;
  for (char c : text + " ") {
    if (std::isalpha(static_cast<unsigned char>(c))) {
      w += c;
    } else if (!w.empty()) {
      out.insert(w);
      w.clear();
    }
  }
  return out;
}

}  // namespace

int run_example_llava(const std::string& out_dir, int64_t samples, uint64_t seed) {
  WEFT_CHECK(samples > 0, "weft example llava: --samples must be > 0");
  const fs::path out(out_dir);
  fs::create_directories(out / "images");

  // The shapes dataset, rendered at 96x96.
  Spec shapes;
  shapes.data.seed = seed;
  EncoderSpec render;
  render.name = "vision";
  render.image_size = 96;
  render.patch = 16;
  shapes.model.encoders = {render};
  shapes.model.llm.vocab = 64;
  const data::Tokenizer shape_tok = data::Tokenizer::for_shapes(shapes.model);
  const data::ShapesDataset dataset(shapes, shape_tok);

  std::set<std::string> words =
      words_of(std::string(kSystem) + " " + kQuestion + " USER ASSISTANT");
  for (const std::string& w : data::ShapesDataset::words(false)) words.insert(w);
  const json tokenizer = data::byte_level_bpe(words, {"<pad>", "<s>", "</s>", "<image>"});
  write_file(out / "tokenizer.json", tokenizer.dump(1) + "\n");
  write_file(out / "tokenizer_config.json", json{{"bos_token", "<s>"},
                                                 {"eos_token", "</s>"},
                                                 {"pad_token", "<pad>"},
                                                 {"add_bos_token", true},
                                                 {"add_eos_token", false}}
                                                    .dump(2) +
                                                "\n");

  json records = json::array();
  for (int64_t i = 0; i < samples; ++i) {
    const data::Sample s =
        dataset.sample(data::ShapesDataset::kTrainStream, static_cast<uint64_t>(i));
    char name[32];
    std::snprintf(name, sizeof(name), "images/%06lld.png", static_cast<long long>(i));
    write_png(out / name, s.items.at(0).input);
    records.push_back({{"id", std::to_string(i)},
                       {"image", name},
                       {"conversations",
                        {{{"from", "human"}, {"value", std::string("<image>\n") + kQuestion}},
                         {{"from", "gpt"}, {"value", s.caption}}}}});
  }
  write_file(out / "data.json", records.dump(1) + "\n");

  // Hugging Face checkpoints of a freshly initialised Llama-style LLM and CLIP-style tower.
  ModelSpec m;
  const int64_t vocab = static_cast<int64_t>(tokenizer["model"]["vocab"].size());
  m.llm.vocab = (vocab + 63) / 64 * 64;
  m.llm.hidden = 128;
  m.llm.layers = 2;
  m.llm.heads = 4;
  m.llm.kv_heads = 2;
  m.llm.ffn = 384;
  m.llm.max_seq = 128;
  m.llm.tie_embeddings = true;
  EncoderSpec v;
  v.name = "vision";
  v.kind = EncoderKind::kVit;
  v.image_size = 64;
  v.patch = 16;
  v.stem_channels = 0;
  v.hidden = 128;
  v.layers = 2;
  v.heads = 4;
  v.ffn = 256;
  v.act = Activation::kQuickGelu;
  v.class_token = true;
  v.pre_norm = true;
  v.patch_bias = false;
  v.projector.kind = ProjectorKind::kMlp;
  m.encoders = {v};
  const model::MultimodalModel model(m, seed);
  std::map<std::string, at::Tensor> full;
  for (const auto& [name, p] : model.parameters()) full[name] = p.detach();
  io::export_hf(m, full, out.string());
  std::printf("wrote %lld LLaVA-style records, tokenizer.json, llm/ and vision/ to %s\n",
              static_cast<long long>(samples), out.string().c_str());
  return 0;
}

}  // namespace weft::cli
