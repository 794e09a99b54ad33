#include "weft/io/hf.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "weft/core/error.h"
#include "weft/core/hf_config.h"
#include "weft/io/files.h"
#include "weft/io/safetensors.h"
#include "weft/model/encoder.h"

namespace weft::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, path, ": cannot read");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// One weft parameter as Hugging Face tensors: the weft tensor is the concatenation along `dim`
// of `parts` (HF names relative to the module's prefix; "" = a block of zeros HF does not
// store) with `sizes` rows each. `select` >= 0: each part is entry `select` along dim 0 of the
// HF tensor (one expert of a stacked [experts, ...] tensor).
struct MapEntry {
  std::string weft;
  std::vector<std::string> parts;
  std::vector<int64_t> sizes;  // empty = one part, the whole tensor
  int64_t dim = 0;
  int64_t select = -1;
};

// How a Mixtral checkpoint stores its MoE blocks: per-expert w1/w2/w3 under block_sparse_moe
// (every checkpoint on the Hub, and what export writes), or transformers 5's in-memory layout
// (conversion_mapping.py "mixtral"): mlp.gate, and stacked mlp.experts.gate_up_proj
// [experts, 2·ffn, hidden] (gate rows, then up) and mlp.experts.down_proj [experts, hidden, ffn].
enum class MoeLayout { kPerExpert, kStacked };

std::string layer(int64_t i) { return std::to_string(i); }

// The LLM's map; HF names relative to the body prefix ("model."), except "lm_head.weight",
// which is marked with a leading '@' (relative to the checkpoint's head prefix).
std::vector<MapEntry> llm_map(const LlmSpec& l, MoeLayout moe = MoeLayout::kPerExpert) {
  const int64_t D = l.head_dim();
  const std::vector<int64_t> qkv = {l.heads * D, l.kv_heads * D, l.kv_heads * D};
  std::vector<MapEntry> m = {{"llm.embedding", {"embed_tokens.weight"}, {}, 0}};
  for (int64_t i = 0; i < l.layers; ++i) {
    const std::string w = "llm.layers." + layer(i) + ".", h = "layers." + layer(i) + ".";
    m.push_back({w + "norm1.weight", {h + "input_layernorm.weight"}, {}, 0});
    m.push_back({w + "attn.qkv.weight",
                 {h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight",
                  h + "self_attn.v_proj.weight"},
                 qkv,
                 0});
    if (l.qkv_bias)
      m.push_back(
          {w + "attn.qkv.bias",
           {h + "self_attn.q_proj.bias", h + "self_attn.k_proj.bias", h + "self_attn.v_proj.bias"},
           qkv,
           0});
    m.push_back({w + "attn.out.weight", {h + "self_attn.o_proj.weight"}, {}, 0});
    m.push_back({w + "norm2.weight", {h + "post_attention_layernorm.weight"}, {}, 0});
    if (l.moe.is_moe_layer(i)) {
      const std::string x = w + "moe.experts.";
      if (moe == MoeLayout::kStacked) {
        m.push_back({w + "moe.router.weight", {h + "mlp.gate.weight"}, {}, 0});
        for (int64_t j = 0; j < l.moe.experts; ++j) {
          m.push_back(
              {x + layer(j) + ".gate_up.weight", {h + "mlp.experts.gate_up_proj"}, {}, 0, j});
          m.push_back({x + layer(j) + ".down.weight", {h + "mlp.experts.down_proj"}, {}, 0, j});
        }
      } else {
        const std::string b = h + "block_sparse_moe.";
        m.push_back({w + "moe.router.weight", {b + "gate.weight"}, {}, 0});
        for (int64_t j = 0; j < l.moe.experts; ++j) {
          const std::string e = b + "experts." + layer(j) + ".";
          const int64_t F = l.expert_ffn();
          m.push_back(
              {x + layer(j) + ".gate_up.weight", {e + "w1.weight", e + "w3.weight"}, {F, F}, 0});
          m.push_back({x + layer(j) + ".down.weight", {e + "w2.weight"}, {}, 0});
        }
      }
      continue;
    }
    m.push_back({w + "mlp.gate_up.weight",
                 {h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"},
                 {l.ffn, l.ffn},
                 0});
    m.push_back({w + "mlp.down.weight", {h + "mlp.down_proj.weight"}, {}, 0});
  }
  m.push_back({"llm.final_norm.weight", {"norm.weight"}, {}, 0});
  if (!l.tie_embeddings) m.push_back({"llm.head", {"@lm_head.weight"}, {}, 0});
  return m;
}

void add_linear(std::vector<MapEntry>* m, const std::string& w, const std::string& h,
                bool bias = true) {
  m->push_back({w + ".weight", {h + ".weight"}, {}, 0});
  if (bias) m->push_back({w + ".bias", {h + ".bias"}, {}, 0});
}

// Encoder blocks: ViT and Whisper name them differently.
std::vector<MapEntry> encoder_map(const EncoderSpec& e) {
  const std::string n = e.name + ".";
  const bool vit = e.kind == EncoderKind::kVit;
  std::vector<MapEntry> m;
  if (vit) {
    add_linear(&m, n + "patch", "embeddings.patch_embedding", e.patch_bias);
    if (e.class_token) m.push_back({n + "class", {"embeddings.class_embedding"}, {}, 0});
    m.push_back({n + "position", {"embeddings.position_embedding.weight"}, {}, 0});
    if (e.pre_norm) add_linear(&m, n + "pre_ln", "pre_layrnorm");
  } else {
    add_linear(&m, n + "conv1", "conv1");
    add_linear(&m, n + "conv2", "conv2");
  }
  const std::vector<int64_t> qkv(3, e.hidden);
  for (int64_t i = 0; i < e.layers; ++i) {
    const std::string w = n + "layers." + layer(i) + ".";
    const std::string h = (vit ? "encoder.layers." : "layers.") + layer(i) + ".";
    add_linear(&m, w + "ln1", h + (vit ? "layer_norm1" : "self_attn_layer_norm"));
    const std::string a = h + "self_attn.";
    m.push_back({w + "attn.qkv.weight",
                 {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
                 qkv,
                 0});
    m.push_back({w + "attn.qkv.bias",
                 {a + "q_proj.bias", vit ? a + "k_proj.bias" : "", a + "v_proj.bias"},
                 qkv,
                 0});
    add_linear(&m, w + "attn.out", a + "out_proj");
    add_linear(&m, w + "ln2", h + (vit ? "layer_norm2" : "final_layer_norm"));
    add_linear(&m, w + "mlp.fc1", h + (vit ? "mlp.fc1" : "fc1"));
    add_linear(&m, w + "mlp.fc2", h + (vit ? "mlp.fc2" : "fc2"));
  }
  if (!vit) add_linear(&m, n + "final_ln", "layer_norm");
  return m;
}

std::vector<MapEntry> projector_map(const EncoderSpec& e) {
  const std::string w = e.name + ".projector.";
  std::vector<MapEntry> m;
  if (e.projector.kind == ProjectorKind::kMlp) {
    add_linear(&m, w + "fc1", "linear_1");
    add_linear(&m, w + "fc2", "linear_2");
  } else {
    add_linear(&m, w + "linear", "linear");
  }
  return m;
}

// The first of `candidates` (prefixes) under which `probe` exists in the checkpoint.
std::string find_prefix(const HfCheckpoint& ck, const std::vector<std::string>& candidates,
                        const std::string& probe, const std::string& what) {
  for (const std::string& p : candidates)
    if (ck.contains(p + probe)) return p;
  std::string tried;
  for (const std::string& p : candidates) tried += (tried.empty() ? "" : ", ") + p + probe;
  WEFT_FAIL(ck.dir(), ": no ", what, " weights found (looked for ", tried, ")");
}

// The weft tensor's full shape: a part's shape with the concatenated dim summed over parts.
std::vector<int64_t> expected_shape(const std::vector<int64_t>& part_shape, const MapEntry& entry) {
  std::vector<int64_t> s = part_shape;
  if (!entry.sizes.empty()) {
    int64_t total = 0;
    for (int64_t v : entry.sizes) total += v;
    s[entry.dim] = total;
  }
  return s;
}

}  // namespace

// --- HfCheckpoint -------------------------------------------------------------------------------

HfCheckpoint::HfCheckpoint(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  WEFT_CHECK(fs::is_directory(dir, ec), dir, ": not a Hugging Face checkpoint directory");
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  std::vector<std::string> files;
  std::map<std::string, std::string> expected;  // tensor -> file, from the index
  if (fs::exists(index, ec)) {
    json j = json::parse(read_text(index.string()), nullptr, false);
    WEFT_CHECK(!j.is_discarded() && j.is_object() && j.contains("weight_map") &&
                   j["weight_map"].is_object(),
               index.string(), ": expected a JSON object with a \"weight_map\" object");
    std::set<std::string> seen;
    for (const auto& [name, file] : j["weight_map"].items()) {
      WEFT_CHECK(file.is_string(), index.string(), ": weight_map.", name, ": expected a file name");
      const std::string f = file.get<std::string>();
      WEFT_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
                 index.string(), ": weight_map.", name, " = \"", f,
                 "\": must be a file name in the checkpoint directory");
      expected[name] = f;
      if (seen.insert(f).second) files.push_back(f);
    }
  } else {
    WEFT_CHECK(fs::exists(single, ec), dir,
               ": no model.safetensors or model.safetensors.index.json");
    files.push_back("model.safetensors");
  }
  for (const std::string& f : files) {
    files_.push_back(std::make_unique<SafetensorsReader>((fs::path(dir) / f).string()));
    for (const std::string& name : files_.back()->names()) {
      WEFT_CHECK(where_.emplace(name, files_.size() - 1).second, dir, "/", f, ": tensor '", name,
                 "' is also in ", files_[where_[name]]->path());
    }
  }
  for (const auto& [name, f] : expected) {
    auto it = where_.find(name);
    WEFT_CHECK(it != where_.end(), dir, "/model.safetensors.index.json: tensor '", name,
               "' is not in ", f);
    WEFT_CHECK(fs::path(files_[it->second]->path()).filename() == f, dir,
               "/model.safetensors.index.json: tensor '", name, "' is listed in ", f,
               " but stored in ", files_[it->second]->path());
  }
}

HfCheckpoint::~HfCheckpoint() = default;

std::vector<int64_t> HfCheckpoint::shape(const std::string& name) const {
  auto it = where_.find(name);
  WEFT_CHECK(it != where_.end(), dir_, ": no tensor '", name, "'");
  return files_[it->second]->shape(name);
}

at::Tensor HfCheckpoint::read(const std::string& name) const {
  auto it = where_.find(name);
  WEFT_CHECK(it != where_.end(), dir_, ": no tensor '", name, "'");
  at::Tensor t = files_[it->second]->read(name, at::kFloat);
  WEFT_CHECK(t.is_floating_point(), files_[it->second]->path(), ": tensor '", name,
             "' is not floating point");
  return t;
}

at::Tensor HfCheckpoint::read_row(const std::string& name, int64_t row) const {
  return read_rows(name, row, 1).squeeze(0);
}

at::Tensor HfCheckpoint::read_rows(const std::string& name, int64_t begin, int64_t count) const {
  auto it = where_.find(name);
  WEFT_CHECK(it != where_.end(), dir_, ": no tensor '", name, "'");
  at::Tensor t = files_[it->second]->read_rows(name, begin, count, at::kFloat);
  WEFT_CHECK(t.is_floating_point(), files_[it->second]->path(), ": tensor '", name,
             "' is not floating point");
  return t;
}

std::vector<std::string> HfCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, f] : where_) out.push_back(name);
  return out;
}

// --- HfWeights ----------------------------------------------------------------------------------

struct HfWeights::Rule {
  std::shared_ptr<HfCheckpoint> ckpt;
  std::vector<std::string> parts;  // full HF names; "" = zeros
  std::vector<int64_t> sizes;
  int64_t dim = 0;
  int64_t select = -1;         // MapEntry::select
  std::vector<int64_t> shape;  // of the whole weft tensor
};

HfWeights::HfWeights(const ModelSpec& spec) {
  auto open = [&](const std::string& dir) {
    auto& c = checkpoints_[dir];
    if (!c) c = std::make_shared<HfCheckpoint>(dir);
    return c;
  };
  std::map<std::string, std::set<std::string>> used;  // dir -> HF names mapped
  // Adds the rules of `map` with HF names under `prefix` (and '@' names under `head`).
  auto add = [&](const std::shared_ptr<HfCheckpoint>& ck, const std::vector<MapEntry>& map,
                 const std::string& prefix, const std::string& head, const std::string& module) {
    for (const MapEntry& e : map) {
      auto r = std::make_unique<Rule>();
      r->ckpt = ck;
      r->sizes = e.sizes;
      r->dim = e.dim;
      r->select = e.select;
      for (size_t k = 0; k < e.parts.size(); ++k) {
        const std::string& p = e.parts[k];
        const std::string full = p.empty() ? "" : p[0] == '@' ? head + p.substr(1) : prefix + p;
        r->parts.push_back(full);
        if (full.empty()) continue;
        WEFT_CHECK(ck->contains(full), ck->dir(), ": missing tensor '", full, "' (for ", module,
                   " parameter ", e.weft, ")");
        used[ck->dir()].insert(full);
        std::vector<int64_t> s = ck->shape(full);
        if (e.select >= 0) {
          WEFT_CHECK(s.size() >= 2 && s[0] > e.select, ck->dir(), ": tensor '", full,
                     "' has shape ", at::IntArrayRef(s), "; ", module, " parameter ", e.weft,
                     " needs entry ", e.select, " along dim 0");
          s.erase(s.begin());
        }
        if (!e.sizes.empty())
          WEFT_CHECK(static_cast<int64_t>(s.size()) > e.dim && s[e.dim] == e.sizes[k], ck->dir(),
                     ": tensor '", full, "' has shape ", at::IntArrayRef(s), "; ", module,
                     " needs ", e.sizes[k], " along dim ", e.dim);
        if (r->shape.empty()) r->shape = expected_shape(s, e);
      }
      rules_[e.weft] = std::move(r);
    }
  };

  if (!spec.llm.hf.empty()) {
    auto ck = open(spec.llm.hf);
    const std::string body =
        find_prefix(*ck, {"model.", "language_model.model.", "model.language_model.", ""},
                    "embed_tokens.weight", "LLM");
    const std::string head = body == "language_model.model." ? "language_model." : "";
    MoeLayout moe = MoeLayout::kPerExpert;
    if (spec.llm.moe.enabled()) {
      const std::string per_expert = body + "layers.0.block_sparse_moe.gate.weight";
      const std::string stacked = body + "layers.0.mlp.experts.gate_up_proj";
      if (!ck->contains(per_expert) && ck->contains(stacked)) moe = MoeLayout::kStacked;
      WEFT_CHECK(ck->contains(per_expert) || ck->contains(stacked), ck->dir(),
                 ": no mixture-of-experts weights found for model.llm (looked for '", per_expert,
                 "' and '", stacked, "'; a Mixtral checkpoint has one of them)");
    }
    add(ck, llm_map(spec.llm, moe), body, head, "model.llm");
  }
  for (const EncoderSpec& e : spec.encoders) {
    if (e.hf.empty()) continue;
    auto ck = open(e.hf);
    const bool vit = e.kind == EncoderKind::kVit;
    const std::string prefix =
        vit ? find_prefix(*ck,
                          {"vision_model.", "vision_tower.vision_model.",
                           "model.vision_tower.vision_model.", ""},
                          "embeddings.patch_embedding.weight", "vision tower")
            : find_prefix(*ck, {"model.encoder.", "encoder.", ""}, "conv1.weight",
                          "whisper encoder");
    add(ck, encoder_map(e), prefix, "", "model." + e.name);
    // Whisper's positions are fixed sinusoids in weft: the checkpoint's must be the same.
    if (!vit && ck->contains(prefix + "embed_positions.weight")) {
      used[ck->dir()].insert(prefix + "embed_positions.weight");
      const at::Tensor pos = ck->read(prefix + "embed_positions.weight");
      const int64_t T = e.tokens_per_item();
      WEFT_CHECK(pos.dim() == 2 && pos.size(0) >= T && pos.size(1) == e.hidden, ck->dir(),
                 ": embed_positions.weight has shape ", pos.sizes(), "; expected at least [", T,
                 ", ", e.hidden, "]");
      const double diff =
          (pos.narrow(0, 0, T) - model::sinusoids(T, e.hidden)).abs().max().item<double>();
      WEFT_CHECK(diff < 1e-2, ck->dir(),  // bf16 checkpoints round to ~4e-3 ":
                                          // embed_positions.weight differs from Whisper's ",
                 "sinusoids by up to ", diff, " (learned positions are not supported)");
    }
    // A LLaVA checkpoint (or weft's export) carries the projector.
    for (const std::string p : {"multi_modal_projector.", "model.multi_modal_projector."}) {
      const std::vector<MapEntry> pm = projector_map(e);
      if (ck->contains(p + pm[0].parts[0])) {
        add(ck, pm, p, "", "model." + e.name + ".projector");
        break;
      }
    }
  }
  for (const auto& [dir, ck] : checkpoints_) {
    size_t unused = 0;
    std::string example;
    for (const std::string& n : ck->names())
      if (!used[dir].count(n)) {
        ++unused;
        if (example.empty()) example = n;
      }
    summary_.push_back(
        dir + ": " + std::to_string(used[dir].size()) + " tensors used" +
        (unused ? ", " + std::to_string(unused) + " not used by weft (e.g. " + example + ")" : ""));
  }
}

HfWeights::~HfWeights() = default;

at::Tensor HfWeights::full(const std::string& name) const {
  auto it = rules_.find(name);
  WEFT_CHECK(it != rules_.end(), "no Hugging Face checkpoint provides parameter ", name);
  const Rule& r = *it->second;
  std::vector<at::Tensor> parts;
  for (size_t k = 0; k < r.parts.size(); ++k) {
    if (!r.parts[k].empty()) {
      parts.push_back(r.select >= 0 ? r.ckpt->read_row(r.parts[k], r.select)
                                    : r.ckpt->read(r.parts[k]));
    } else {
      std::vector<int64_t> s = r.shape;
      s[r.dim] = r.sizes[k];
      parts.push_back(torch::zeros(s, torch::kFloat));
    }
  }
  return parts.size() == 1 ? parts[0] : torch::cat(parts, r.dim);
}

at::Tensor HfWeights::shard(const std::string& name, const ShardSplit& split) const {
  auto it = rules_.find(name);
  WEFT_CHECK(it != rules_.end(), "no Hugging Face checkpoint provides parameter ", name);
  const Rule& r = *it->second;
  if (split.size <= 1 || split.dim != 0 || r.dim != 0 || r.select >= 0) return {};
  // Only a split of exactly these rows into even chunks; anything else (a checkpoint whose rows
  // differ from the model's) takes the whole tensor's path, which says what does not fit.
  int64_t total = 0;
  for (int64_t seg : split.segments.empty() ? std::vector<int64_t>{r.shape[0]} : split.segments) {
    if (seg <= 0 || seg % split.size != 0) return {};
    total += seg;
  }
  if (total != r.shape[0]) return {};
  // The parts stacked along dim 0; the shard's rows of each segment, from the parts they fall in.
  const std::vector<int64_t> sizes = r.sizes.empty() ? std::vector<int64_t>{r.shape[0]} : r.sizes;
  std::vector<at::Tensor> rows;
  int64_t count = 0;
  for (const ShardSplit::Interval& chunk : split.intervals(r.shape[0])) {
    const int64_t a = chunk.full, b = a + chunk.len;
    int64_t offset = 0;  // part k's first row
    for (size_t k = 0; k < r.parts.size(); offset += sizes[k], ++k) {
      const int64_t lo = std::max(a, offset), hi = std::min(b, offset + sizes[k]);
      if (lo >= hi) continue;
      if (r.parts[k].empty()) {
        std::vector<int64_t> shape = r.shape;
        shape[0] = hi - lo;
        rows.push_back(torch::zeros(shape, torch::kFloat));
      } else {
        rows.push_back(r.ckpt->read_rows(r.parts[k], lo - offset, hi - lo));
      }
    }
    count += chunk.len;
  }
  const at::Tensor out = rows.size() == 1 ? rows[0] : torch::cat(rows, 0);
  WEFT_ASSERT(out.size(0) == count, "HfWeights::shard: ", out.size(0), " rows for ", count);
  return out;
}

std::vector<std::string> HfWeights::summary() const { return summary_; }

// --- export -------------------------------------------------------------------------------------

void save_hf_tensors(const std::string& dir,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     int64_t shard_bytes) {
  WEFT_CHECK(shard_bytes > 0, "save_hf_tensors: shard_bytes must be > 0");
  fs::create_directories(dir);
  std::vector<TensorMap> shards(1);
  int64_t bytes = 0, total = 0;
  for (const auto& nt : tensors) {
    const int64_t n = static_cast<int64_t>(nt.second.nbytes());
    if (!shards.back().empty() && bytes + n > shard_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(nt);
    bytes += n;
    total += n;
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (shards.size() == 1) {
    save_safetensors((fs::path(dir) / "model.safetensors").string(), shards[0], meta);
    return;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", json::object()}};
  for (size_t k = 0; k < shards.size(); ++k) {
    char file[64];
    std::snprintf(file, sizeof(file), "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    save_safetensors((fs::path(dir) / file).string(), shards[k], meta);
    for (const auto& [name, t] : shards[k]) index["weight_map"][name] = file;
  }
  write_text_file((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
}

namespace {
// The HF tensors of `map` from weft's full tensors, HF names under `prefix`.
void export_map(const std::vector<MapEntry>& map, const std::map<std::string, at::Tensor>& full,
                const std::string& prefix, const std::string& head, at::ScalarType dtype,
                std::vector<std::pair<std::string, at::Tensor>>* out) {
  for (const MapEntry& e : map) {
    auto it = full.find(e.weft);
    WEFT_CHECK(it != full.end(), "export: the checkpoint has no parameter '", e.weft, "'");
    std::vector<at::Tensor> pieces = {it->second};
    if (!e.sizes.empty()) pieces = it->second.split_with_sizes(e.sizes, e.dim);
    for (size_t k = 0; k < e.parts.size(); ++k) {
      const std::string& p = e.parts[k];
      if (p.empty()) continue;  // zeros HF does not store
      const std::string name = p[0] == '@' ? head + p.substr(1) : prefix + p;
      out->emplace_back(name, pieces[k].to(dtype).contiguous());
    }
  }
}
}  // namespace

std::vector<std::string> export_hf(const ModelSpec& spec,
                                   const std::map<std::string, at::Tensor>& full,
                                   const std::string& out_dir, at::ScalarType dtype,
                                   int64_t shard_bytes) {
  WEFT_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
             "export: dtype must be fp32, bf16 or fp16");
  // Every config first: a model without a Hugging Face layout is an error before anything is
  // written.
  const std::string llm_config = hf_llm_config_json(spec.llm);
  std::vector<std::string> encoder_configs;
  for (const EncoderSpec& e : spec.encoders) encoder_configs.push_back(hf_encoder_config_json(e));
  std::vector<std::string> dirs;
  auto write = [&](const std::string& name, const std::string& config,
                   const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
    const std::string dir = (fs::path(out_dir) / name).string();
    save_hf_tensors(dir, tensors, shard_bytes);
    if (!config.empty()) write_text_file((fs::path(dir) / "config.json").string(), config);
    dirs.push_back(dir);
  };
  {
    std::vector<std::pair<std::string, at::Tensor>> t;
    export_map(llm_map(spec.llm), full, "model.", "", dtype, &t);
    write("llm", llm_config, t);
  }
  for (size_t k = 0; k < spec.encoders.size(); ++k) {
    const EncoderSpec& e = spec.encoders[k];
    std::vector<std::pair<std::string, at::Tensor>> t;
    const bool vit = e.kind == EncoderKind::kVit;
    export_map(encoder_map(e), full, vit ? "vision_model." : "model.encoder.", "", dtype, &t);
    if (!vit)  // HF stores Whisper's fixed positions
      t.emplace_back("model.encoder.embed_positions.weight",
                     model::sinusoids(e.frames / 2, e.hidden).to(dtype));
    export_map(projector_map(e), full, "multi_modal_projector.", "", dtype, &t);
    write(e.name, encoder_configs[k], t);
  }
  return dirs;
}

}  // namespace weft::io
