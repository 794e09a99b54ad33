// Config → Spec: TOML parsing (toml++), --set overrides, validation, and the canonical dump.
// Every error names the source, the key path, the offending value and what is allowed.
#include "weft/core/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "weft/core/error.h"
#include "weft/core/hf_config.h"
#include "weft/core/toml.h"

namespace weft {
namespace {

using Keys = std::vector<std::string_view>;

template <size_t N>
Keys keys(const std::string_view (&list)[N]) {
  return Keys(list, list + N);
}

constexpr std::string_view kTopKeys[] = {"model", "data", "train", "output", "parallel"};
constexpr std::string_view kLlmKeys[] = {"vocab",
                                         "hidden",
                                         "layers",
                                         "heads",
                                         "kv_heads",
                                         "ffn",
                                         "max_seq",
                                         "rope_theta",
                                         "norm_eps",
                                         "tie_embeddings",
                                         "frozen",
                                         "recompute",
                                         "recompute_blocks",
                                         "attention_chunk",
                                         "qkv_bias",
                                         "rope_scaling",
                                         "rope_scaling_factor",
                                         "rope_low_freq_factor",
                                         "rope_high_freq_factor",
                                         "rope_original_max_position",
                                         "moe",
                                         "hf"};
constexpr std::string_view kMoeKeys[] = {"experts", "top_k",          "ffn",        "every",
                                         "gating",  "norm_topk",      "shared_ffn", "aux_loss",
                                         "z_loss",  "capacity_factor"};
constexpr std::string_view kGatings[] = {"softmax", "sigmoid"};
constexpr std::string_view kEncoderCommonKeys[] = {
    "kind",          "hidden",   "layers", "heads",     "ffn",
    "feature_layer", "norm_eps", "frozen", "recompute", "recompute_blocks",
    "projector",     "act",      "hf"};
constexpr std::string_view kVitKeys[] = {"image_size",  "channels",    "patch",    "stem_channels",
                                         "stem_layers", "class_token", "pre_norm", "patch_bias"};
constexpr std::string_view kRopeScalings[] = {"none", "llama3"};
constexpr std::string_view kWhisperKeys[] = {"mels", "frames"};
constexpr std::string_view kProjectorKeys[] = {"kind", "frozen"};
constexpr std::string_view kDataKeys[] = {
    "kind",     "seed",    "eval_samples", "noise",         "packing",         "balance",
    "path",     "root",    "tokenizer",    "chat_template", "image_processor", "pad_to_square",
    "on_error", "workers", "prefetch",     "seq_len",       "images",          "target_fraction"};
constexpr std::string_view kDataKinds[] = {"shapes", "llava", "synthetic"};
constexpr std::string_view kChatTemplates[] = {"llava", "llama2", "llama3", "chatml", "plain"};
constexpr std::string_view kImageProcessors[] = {"clip", "siglip"};
constexpr std::string_view kOnError[] = {"fail", "skip"};
constexpr std::string_view kBalancePolicies[] = {"balanced", "in_order"};
constexpr std::string_view kTrainKeys[] = {"steps",
                                           "batch",
                                           "microbatches",
                                           "lr",
                                           "min_lr",
                                           "warmup",
                                           "weight_decay",
                                           "beta1",
                                           "beta2",
                                           "eps",
                                           "grad_clip",
                                           "precision",
                                           "nonfinite",
                                           "seed",
                                           "log_every",
                                           "eval_every",
                                           "eval_captions",
                                           "eval_generation",
                                           "checkpoint_every",
                                           "device",
                                           "threads",
                                           "zero_stage",
                                           "overlap_grad_reduce",
                                           "overlap_param_gather",
                                           "overlap_tp_comm",
                                           "grad_bucket_mb",
                                           "cast_once",
                                           "frozen_fp32",
                                           "shared_memory_collectives",
                                           "shared_memory_messages"};
constexpr std::string_view kOutputKeys[] = {"dir", "keep_checkpoints", "trace_step"};
constexpr std::string_view kLayoutKeys[] = {"dp",  "tp", "pp", "cp",    "ep",
                                            "etp", "vp", "sp", "stages"};
constexpr std::string_view kParallelKeys[] = {"placement", "cp_split"};  // besides module tables
constexpr std::string_view kPlacements[] = {"colocated", "separate"};
constexpr std::string_view kCpSplits[] = {"balanced", "zigzag", "contiguous", "lpt"};

template <typename Range>
std::string join(const Range& items) {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) out += ", ";
    out += item;
  }
  return out;
}

template <typename Range>
bool contains(const Range& keys, std::string_view key) {
  return std::find(std::begin(keys), std::end(keys), key) != std::end(keys);
}

// Shortest decimal text that reads back to exactly `v`, always in TOML float syntax.
std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  // Shortest digits that round-trip; plain notation for everyday magnitudes (0.0003, 10000.0).
  const double mag = std::fabs(v);
  const bool fixed = mag == 0 || (mag >= 1e-4 && mag < 1e16);
  char buf[400];
  const std::to_chars_result r = std::to_chars(
      buf, buf + sizeof(buf), v, fixed ? std::chars_format::fixed : std::chars_format::scientific);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// A TOML basic string literal.
std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (u < 0x20 || u == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04X", static_cast<unsigned>(u));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// A node's value as it would appear in TOML (tables and arrays abbreviated).
std::string describe(const toml::node& n) {
  if (const auto* v = n.as_string()) return quote(v->get());
  if (const auto* v = n.as_integer()) return std::to_string(v->get());
  if (const auto* v = n.as_floating_point()) return format_double(v->get());
  if (const auto* v = n.as_boolean()) return v->get() ? "true" : "false";
  if (n.is_table()) return "{...}";
  if (n.is_array()) return "[...]";
  std::ostringstream os;  // dates and times
  n.visit([&](const auto& x) { os << x; });
  return os.str();
}

std::string trim(std::string_view s) {
  const char* ws = " \t\r\n";
  const size_t begin = s.find_first_not_of(ws);
  if (begin == std::string_view::npos) return "";
  const size_t end = s.find_last_not_of(ws);
  return std::string(s.substr(begin, end - begin + 1));
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t pos = s.find(sep, start);
    parts.push_back(trim(std::string_view(s).substr(start, pos - start)));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return parts;
}

bool is_identifier(std::string_view s) {
  if (s.empty() || s[0] < 'a' || s[0] > 'z') return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

// One TOML table being read. Knows its key path, so every message can name the full key.
class Section {
 public:
  Section(const std::string& source, const toml::table& table, std::string path)
      : source_(source), table_(table), path_(std::move(path)) {}

  const toml::table& table() const { return table_; }
  const std::string& source() const { return source_; }
  std::string path(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }
  const toml::node* find(std::string_view key) const { return table_.get(key); }

  // Throws `<source>: <path.key> = <value>: <what>`; no " = <value>" when `value` is empty.
  [[noreturn]] void fail_value(std::string_view key, const std::string& value,
                               const std::string& what) const {
    if (value.empty()) WEFT_FAIL(source_, ": ", path(key), ": ", what);
    WEFT_FAIL(source_, ": ", path(key), " = ", value, ": ", what);
  }
  // Same, showing the key's value from the config (omitted for tables and absent keys).
  [[noreturn]] void fail(std::string_view key, const std::string& what) const {
    const toml::node* n = find(key);
    fail_value(key, n && !n->is_table() ? describe(*n) : "", what);
  }

  // Rejects any key not in `allowed`.
  void only(const Keys& allowed) const {
    for (auto&& [key, node] : table_) {
      if (contains(allowed, key.str())) continue;
      fail(key.str(), std::string(node.is_table() ? "unknown table" : "unknown key") +
                          " (allowed: " + join(allowed) + ")");
    }
  }

  // The typed readers leave *out untouched and return false when the key is absent.
  bool read(std::string_view key, int64_t* out) const {
    const toml::node* n = find(key);
    if (!n) return false;
    if (const auto* v = n->as_integer()) {
      *out = v->get();
      return true;
    }
    fail(key, n->is_floating_point() ? "expected an integer, not a float" : "expected an integer");
  }
  bool read(std::string_view key, uint64_t* out) const {
    int64_t v = 0;
    if (!read(key, &v)) return false;
    if (v < 0) fail(key, "must be >= 0");
    *out = static_cast<uint64_t>(v);
    return true;
  }
  bool read(std::string_view key, double* out) const {  // integers are accepted
    const toml::node* n = find(key);
    if (!n) return false;
    if (const auto* v = n->as_integer()) {
      *out = static_cast<double>(v->get());
    } else if (const auto* f = n->as_floating_point()) {
      if (!std::isfinite(f->get())) fail(key, "must be a finite number");
      *out = f->get();
    } else {
      fail(key, "expected a number");
    }
    return true;
  }
  bool read(std::string_view key, bool* out) const {
    const toml::node* n = find(key);
    if (!n) return false;
    if (const auto* v = n->as_boolean()) {
      *out = v->get();
      return true;
    }
    fail(key, "expected a boolean (true or false)");
  }
  bool read(std::string_view key, std::string* out) const {
    const toml::node* n = find(key);
    if (!n) return false;
    if (const auto* v = n->as_string()) {
      *out = v->get();
      return true;
    }
    fail(key, "expected a string");
  }
  bool read(std::string_view key, std::vector<int64_t>* out) const {
    const toml::node* n = find(key);
    if (!n) return false;
    const toml::array* a = n->as_array();
    if (!a) fail(key, "expected an array of integers");
    std::vector<int64_t> values;
    for (const toml::node& e : *a) {
      if (!e.is_integer()) fail(key, "expected an array of integers, not " + describe(e));
      values.push_back(e.as_integer()->get());
    }
    *out = std::move(values);
    return true;
  }
  // A sub-table, or null when absent.
  const toml::table* table(std::string_view key) const {
    const toml::node* n = find(key);
    if (!n) return nullptr;
    if (!n->is_table()) fail(key, "expected a table");
    return n->as_table();
  }

  // Reads an integer that must be > 0 (`positive`) or >= 0.
  void count(std::string_view key, int64_t* out, bool positive = true) const {
    read(key, out);
    if (positive && *out <= 0) fail_value(key, std::to_string(*out), "must be > 0");
    if (!positive && *out < 0) fail_value(key, std::to_string(*out), "must be >= 0");
  }
  // Reads a number that must be > 0 (`positive`) or >= 0.
  void amount(std::string_view key, double* out, bool positive = true) const {
    read(key, out);
    if (positive && !(*out > 0)) fail_value(key, format_double(*out), "must be > 0");
    if (!positive && !(*out >= 0)) fail_value(key, format_double(*out), "must be >= 0");
  }
  // Reads a string naming one of `options` (spelled as to_string(option)).
  template <typename E>
  void choice(std::string_view key, std::initializer_list<E> options, E* out) const {
    std::string text;
    if (!read(key, &text)) return;
    std::vector<std::string> names;
    for (E e : options) {
      if (text == to_string(e)) {
        *out = e;
        return;
      }
      names.push_back(quote(to_string(e)));
    }
    fail(key, "must be one of " + join(names));
  }
  // Reads a string that must be one of `options`.
  void choice(std::string_view key, const Keys& options, std::string* out) const {
    std::string text;
    if (!read(key, &text)) return;
    std::vector<std::string> names;
    for (std::string_view o : options) names.push_back(quote(o));
    if (!contains(options, text)) fail(key, "must be one of " + join(names));
    *out = text;
  }

 private:
  const std::string& source_;
  const toml::table& table_;
  std::string path_;
};

// A checkpoint path in a config: relative to the config file's directory (when the config is
// a file), made absolute so a saved run config means the same from anywhere.
std::string resolve_path(const std::string& source, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p(path);
  if (p.is_relative() && fs::is_regular_file(source, ec)) p = fs::path(source).parent_path() / p;
  return fs::absolute(p, ec).lexically_normal().string();
}

// Reads `key` when the config sets it; with a Hugging Face checkpoint the value must agree with
// the checkpoint's config.json (`hf_file`), which has already set *out.
template <typename T>
void read_or_agree(const Section& s, std::string_view key, T* out, const std::string& hf_file) {
  if (hf_file.empty()) {
    s.read(key, out);
    return;
  }
  T v = *out;
  if (s.read(key, &v) && !(v == *out)) {
    std::ostringstream expected;
    expected << std::boolalpha << *out;
    s.fail(key, "disagrees with " + hf_file + " (which says " + expected.str() +
                    "); leave it out to take the checkpoint's value");
  }
}

// A module's recompute_blocks (after its recompute and layers): one count (0 = every block, the
// default) or one per pipeline stage (0: none on that stage; make_plan checks there are pp), each
// at most the module's blocks, and only with recompute on.
void read_recompute_blocks(const Section& s, bool recompute, int64_t layers,
                           std::vector<int64_t>* blocks) {
  const char* key = "recompute_blocks";
  const toml::node* n = s.find(key);
  if (!n) return;
  if (!n->is_integer() && !n->is_array())
    s.fail(key, "expected an integer, or a list of one per pipeline stage");
  std::vector<int64_t> v;
  const bool list = n->is_array();
  if (list) {
    s.read(key, &v);
    if (v.empty()) s.fail_value(key, "[]", "expected one count per pipeline stage, or one count");
  } else {
    int64_t one = 0;
    s.read(key, &one);
    v = {one};
  }
  const std::string text = list ? format_list(v) : std::to_string(v[0]);
  bool any = false;
  for (int64_t b : v) {
    if (b < 0) s.fail_value(key, text, list ? "counts must be >= 0" : "must be >= 0");
    if (b > layers)
      s.fail_value(key, text,
                   "must be at most the module's " + std::to_string(layers) + " blocks" +
                       (list ? "" : " (0 = every block)"));
    any = any || b > 0;
  }
  if (list && !any)
    s.fail_value(key, text, "recomputes no block on any stage: set recompute = false instead");
  if (any && !recompute) s.fail_value(key, text, "needs recompute = true");
  if (!list && v[0] == 0) v.clear();  // 0: every block
  *blocks = std::move(v);
}

// With a Mixtral checkpoint (`hf_file`, which has already set *m) the architecture keys must
// agree with its config.json; the training settings (aux_loss, z_loss, capacity_factor) are the
// run's to choose.
void read_moe(const Section& s, MoeSpec* m, const std::string& hf_file) {
  s.only(keys(kMoeKeys));
  std::string gating = m->sigmoid ? "sigmoid" : "softmax";
  if (hf_file.empty()) {
    s.count("experts", &m->experts);
    s.count("top_k", &m->top_k);
    s.count("ffn", &m->ffn, /*positive=*/false);
    s.count("every", &m->every);
    s.choice("gating", keys(kGatings), &gating);
    s.read("norm_topk", &m->norm_topk);
    s.count("shared_ffn", &m->shared_ffn, /*positive=*/false);
  } else {
    read_or_agree(s, "experts", &m->experts, hf_file);
    read_or_agree(s, "top_k", &m->top_k, hf_file);
    int64_t ffn = m->ffn;  // 0 (= model.llm.ffn, also config.json's intermediate_size) agrees
    if (s.read("ffn", &ffn) && ffn != 0 && ffn != m->ffn)
      s.fail("ffn", "disagrees with " + hf_file + " (which says " + std::to_string(m->ffn) +
                        "); leave it out to take the checkpoint's value");
    read_or_agree(s, "every", &m->every, hf_file);
    read_or_agree(s, "gating", &gating, hf_file);
    read_or_agree(s, "norm_topk", &m->norm_topk, hf_file);
    read_or_agree(s, "shared_ffn", &m->shared_ffn, hf_file);
  }
  m->sigmoid = gating == "sigmoid";
  const std::pair<const char*, double*> weights[] = {
      {"aux_loss", &m->aux_loss}, {"z_loss", &m->z_loss}, {"capacity_factor", &m->capacity_factor}};
  for (const auto& [k, v] : weights)
    if (s.read(k, v) && *v < 0) s.fail(k, "must be >= 0");
  if (!hf_file.empty()) return;  // config.json's top_k and norm_topk, as transformers runs them
  if (m->top_k > m->experts)
    s.fail("top_k", "must be <= experts (" + std::to_string(m->experts) + ")");
  // Top-1 softmax renormalised is a weight of 1 for every token: the router would learn from the
  // auxiliary losses only. Switch-style top-1 keeps the raw probability.
  if (m->top_k == 1 && !m->sigmoid) {
    if (m->norm_topk && s.find("norm_topk"))
      s.fail("norm_topk",
             "with top_k = 1 and softmax gating every weight would be 1 (the router would get no "
             "gradient from the loss); use norm_topk = false");
    m->norm_topk = false;
  }
}

void read_llm(const Section& s, LlmSpec* l) {
  if (s.find("kind"))
    s.fail("kind", "[model.llm] is the decoder; \"llm\" is reserved and cannot name an encoder");
  s.only(keys(kLlmKeys));
  std::string hf_file, hf_type;
  int64_t sliding_window = 0;
  if (s.read("hf", &l->hf)) {
    l->hf = resolve_path(s.source(), l->hf);
    const HfLlmConfig c = read_hf_llm_config(l->hf);
    hf_file = hf_config_path(l->hf);
    hf_type = c.model_type;
    const LlmSpec keep = *l;
    *l = c.llm;
    l->hf = keep.hf;
    l->max_seq = keep.max_seq;
    sliding_window = c.sliding_window;
  }
  read_or_agree(s, "vocab", &l->vocab, hf_file);
  read_or_agree(s, "hidden", &l->hidden, hf_file);
  read_or_agree(s, "layers", &l->layers, hf_file);
  read_or_agree(s, "heads", &l->heads, hf_file);
  read_or_agree(s, "kv_heads", &l->kv_heads, hf_file);
  read_or_agree(s, "ffn", &l->ffn, hf_file);
  read_or_agree(s, "rope_theta", &l->rope_theta, hf_file);
  read_or_agree(s, "norm_eps", &l->norm_eps, hf_file);
  read_or_agree(s, "tie_embeddings", &l->tie_embeddings, hf_file);
  read_or_agree(s, "qkv_bias", &l->qkv_bias, hf_file);
  std::string scaling = l->rope_scaling.llama3 ? "llama3" : "none";
  if (hf_file.empty()) s.choice("rope_scaling", keys(kRopeScalings), &scaling);
  read_or_agree(s, "rope_scaling", &scaling, hf_file);
  l->rope_scaling.llama3 = scaling == "llama3";
  read_or_agree(s, "rope_scaling_factor", &l->rope_scaling.factor, hf_file);
  read_or_agree(s, "rope_low_freq_factor", &l->rope_scaling.low_freq_factor, hf_file);
  read_or_agree(s, "rope_high_freq_factor", &l->rope_scaling.high_freq_factor, hf_file);
  read_or_agree(s, "rope_original_max_position", &l->rope_scaling.original_max_position, hf_file);
  s.count("vocab", &l->vocab, /*positive=*/false);
  s.count("hidden", &l->hidden);
  s.count("layers", &l->layers);
  s.count("heads", &l->heads);
  s.count("kv_heads", &l->kv_heads);
  s.count("ffn", &l->ffn);
  s.count("max_seq", &l->max_seq);
  s.amount("rope_theta", &l->rope_theta);
  s.amount("norm_eps", &l->norm_eps);
  s.amount("rope_scaling_factor", &l->rope_scaling.factor);
  s.count("rope_original_max_position", &l->rope_scaling.original_max_position);
  s.read("frozen", &l->frozen);
  s.read("recompute", &l->recompute);
  read_recompute_blocks(s, l->recompute, l->layers, &l->recompute_blocks);
  s.count("attention_chunk", &l->attention_chunk, /*positive=*/false);
  if (const toml::table* t = s.table("moe")) {
    WEFT_CHECK(hf_file.empty() || l->moe.enabled(), s.source(), ": ", s.path("moe"),
               ": mixture-of-experts layers need a Mixtral checkpoint, and ", hf_file,
               " is a dense ", hf_type, " one (leave [", s.path("moe"), "] out)");
    read_moe(Section(s.source(), *t, s.path("moe")), &l->moe, hf_file);
  }
  if (l->rope_scaling.llama3 &&
      !(l->rope_scaling.high_freq_factor > l->rope_scaling.low_freq_factor))
    s.fail("rope_high_freq_factor", "must be > rope_low_freq_factor");
  if (sliding_window > 0 && sliding_window < l->max_seq)
    s.fail("max_seq",
           "exceeds the checkpoint's sliding_window = " + std::to_string(sliding_window) +
               " (sliding-window attention is not supported; use max_seq <= " +
               std::to_string(sliding_window) + ")");

  if (l->hidden % l->heads != 0)
    s.fail_value("heads", std::to_string(l->heads),
                 "hidden (" + std::to_string(l->hidden) + ") must be divisible by heads");
  if (l->heads % l->kv_heads != 0)
    s.fail_value("kv_heads", std::to_string(l->kv_heads),
                 "heads (" + std::to_string(l->heads) + ") must be divisible by kv_heads");
  if (l->head_dim() % 2 != 0)
    s.fail_value("heads", std::to_string(l->heads),
                 "head_dim = hidden / heads = " + std::to_string(l->head_dim()) +
                     " must be even (RoPE rotates pairs of dims)");
}

void read_projector(const Section& s, ProjectorSpec* p) {
  s.only(keys(kProjectorKeys));
  s.choice("kind", {ProjectorKind::kLinear, ProjectorKind::kMlp}, &p->kind);
  s.read("frozen", &p->frozen);
}

void read_encoder(const Section& s, EncoderSpec* e) {
  if (!s.find("kind")) s.fail("kind", "missing; every encoder needs kind = \"vit\" or \"whisper\"");
  s.choice("kind", {EncoderKind::kVit, EncoderKind::kWhisper}, &e->kind);
  const bool vit = e->kind == EncoderKind::kVit;
  Keys allowed = keys(kEncoderCommonKeys);
  const Keys own = vit ? keys(kVitKeys) : keys(kWhisperKeys);
  const Keys other = vit ? keys(kWhisperKeys) : keys(kVitKeys);
  allowed.insert(allowed.end(), own.begin(), own.end());
  for (auto&& [key, node] : s.table()) {
    if (contains(other, key.str()))
      s.fail(key.str(), std::string("not a key of a ") + to_string(e->kind) +
                            " encoder (allowed: " + join(allowed) + ")");
  }
  s.only(allowed);

  std::string hf_file;
  bool hf_feature_layer = false;
  if (s.read("hf", &e->hf)) {
    e->hf = resolve_path(s.source(), e->hf);
    const HfEncoderConfig c = read_hf_encoder_config(e->hf);
    hf_file = hf_config_path(e->hf);
    if (c.encoder.kind != e->kind)
      s.fail("kind", std::string("disagrees with ") + hf_file + " (a " + c.model_type +
                         " checkpoint is kind = \"" + to_string(c.encoder.kind) + "\")");
    const EncoderSpec keep = *e;
    *e = c.encoder;
    e->name = keep.name;
    e->hf = keep.hf;
    e->projector = keep.projector;
    hf_feature_layer = c.has_feature_layer;
    if (e->kind == EncoderKind::kWhisper) e->frames = keep.frames;  // a run choice (<= 2 * 1500)
  }
  read_or_agree(s, "hidden", &e->hidden, hf_file);
  read_or_agree(s, "layers", &e->layers, hf_file);
  read_or_agree(s, "heads", &e->heads, hf_file);
  read_or_agree(s, "ffn", &e->ffn, hf_file);
  read_or_agree(s, "norm_eps", &e->norm_eps, hf_file);
  read_or_agree(s, "feature_layer", &e->feature_layer, hf_feature_layer ? hf_file : "");
  if (hf_file.empty())
    s.choice("act", {Activation::kGelu, Activation::kQuickGelu, Activation::kGeluTanh}, &e->act);
  else if (s.find("act")) {
    Activation a = e->act;
    s.choice("act", {Activation::kGelu, Activation::kQuickGelu, Activation::kGeluTanh}, &a);
    if (a != e->act)
      s.fail("act", "disagrees with " + hf_file + " (which says " + to_string(e->act) + ")");
  }
  s.count("hidden", &e->hidden);
  s.count("layers", &e->layers);
  s.count("heads", &e->heads);
  s.count("ffn", &e->ffn);
  s.amount("norm_eps", &e->norm_eps);
  s.read("frozen", &e->frozen);
  s.read("recompute", &e->recompute);
  read_recompute_blocks(s, e->recompute, e->layers, &e->recompute_blocks);
  if (vit) {
    read_or_agree(s, "image_size", &e->image_size, hf_file);
    read_or_agree(s, "channels", &e->channels, hf_file);
    read_or_agree(s, "patch", &e->patch, hf_file);
    read_or_agree(s, "stem_channels", &e->stem_channels, hf_file);
    read_or_agree(s, "class_token", &e->class_token, hf_file);
    read_or_agree(s, "pre_norm", &e->pre_norm, hf_file);
    read_or_agree(s, "patch_bias", &e->patch_bias, hf_file);
    s.count("image_size", &e->image_size);
    s.count("channels", &e->channels);
    s.count("patch", &e->patch);
    s.count("stem_channels", &e->stem_channels, /*positive=*/false);
    s.count("stem_layers", &e->stem_layers);
  } else {
    read_or_agree(s, "mels", &e->mels, hf_file);
    s.count("mels", &e->mels);
    s.count("frames", &e->frames);
    if (!hf_file.empty()) {
      const HfEncoderConfig c = read_hf_encoder_config(e->hf);
      if (e->frames > c.encoder.frames)
        s.fail("frames", "exceeds the checkpoint's " + std::to_string(c.encoder.frames) +
                             " frames (2 x max_source_positions in " + hf_file + ")");
    }
  }
  if (const toml::table* p = s.table("projector"))
    read_projector(Section(s.source(), *p, s.path("projector")), &e->projector);

  const int64_t fl = e->feature_layer, layers = e->layers;
  if (fl == 0 || fl < -layers || fl > layers) {
    const std::string l = std::to_string(layers);
    s.fail_value("feature_layer", std::to_string(fl),
                 "must be in [-" + l + ", -1] or [1, " + l + "] (layers = " + l +
                     "; negative counts from the last block, 0 is not a block)");
  }
  if (e->hidden % e->heads != 0)
    s.fail_value("heads", std::to_string(e->heads),
                 "hidden (" + std::to_string(e->hidden) + ") must be divisible by heads");
  if (vit) {
    if (e->image_size % e->patch != 0)
      s.fail_value("patch", std::to_string(e->patch),
                   "image_size (" + std::to_string(e->image_size) + ") must be divisible by patch");
    const int64_t stem_stride = int64_t{1} << std::min<int64_t>(e->stem_layers, 20);
    if (e->stem_channels > 0 && e->patch % stem_stride != 0)
      s.fail_value("patch", std::to_string(e->patch),
                   e->stem_layers == 1
                       ? std::string("must be even when stem_channels > 0 (the stem halves the "
                                     "resolution)")
                       : "must be divisible by " + std::to_string(stem_stride) +
                             " when stem_channels > 0 (each of the " +
                             std::to_string(e->stem_layers) +
                             " stem layers halves the resolution)");
  } else if (e->frames % 2 != 0) {
    s.fail_value("frames", std::to_string(e->frames),
                 "must be even (the conv front end halves it)");
  }
}

// Encoders are the tables under [model] other than llm, in the order they first appear in the
// file (tables added only by --set have no position and come last, by name).
void read_encoders(const Section& model, std::vector<EncoderSpec>* encoders) {
  struct Entry {
    std::string name;
    const toml::table* table;
    uint64_t line, column;
  };
  std::vector<Entry> entries;
  for (auto&& [key, node] : model.table()) {
    const std::string name(key.str());
    if (name == "llm") continue;
    if (contains(kParallelKeys, name))
      model.fail(name,
                 "\"" + name + "\" is reserved (a key of [parallel]) and cannot name an encoder");
    if (!is_identifier(name))
      model.fail(name,
                 "encoder name must match [a-z][a-z0-9_]* (every table under [model] "
                 "other than llm is an encoder)");
    const toml::table* t = model.table(name);  // non-null: the key exists
    toml::source_position pos = key.source().begin;
    if (!pos) pos = node.source().begin;
    const uint64_t never = std::numeric_limits<uint64_t>::max();
    entries.push_back({name, t, pos ? pos.line : never, pos ? pos.column : never});
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.line, a.column) < std::tie(b.line, b.column);
  });
  for (const Entry& entry : entries) {
    EncoderSpec e;
    e.name = entry.name;
    read_encoder(Section(model.source(), *entry.table, model.path(entry.name)), &e);
    encoders->push_back(std::move(e));
  }
}

void read_data(const Section& s, DataSpec* d) {
  s.only(keys(kDataKeys));
  s.choice("kind", keys(kDataKinds), &d->kind);
  s.read("seed", &d->seed);
  const bool llava = d->kind == "llava";
  for (const char* key : {"path", "root", "tokenizer", "chat_template", "image_processor",
                          "pad_to_square", "on_error", "workers", "prefetch"})
    if (!llava && s.find(key)) s.fail(key, "only applies to kind = \"llava\"");
  if (llava) {
    if (!s.read("path", &d->path))
      s.fail_value("path", "", "missing: the records file of kind = \"llava\"");
    d->path = resolve_path(s.source(), d->path);
    if (s.read("root", &d->root)) d->root = resolve_path(s.source(), d->root);
    if (s.read("tokenizer", &d->tokenizer)) d->tokenizer = resolve_path(s.source(), d->tokenizer);
    s.choice("chat_template", keys(kChatTemplates), &d->chat_template);
    s.choice("image_processor", keys(kImageProcessors), &d->image_processor);
    s.read("pad_to_square", &d->pad_to_square);
    s.choice("on_error", keys(kOnError), &d->on_error);
    s.count("workers", &d->workers);
    s.count("prefetch", &d->prefetch, /*positive=*/false);
  }
  const bool synthetic = d->kind == "synthetic";
  for (const char* key : {"seq_len", "images", "target_fraction"})
    if (!synthetic && s.find(key)) s.fail(key, "only applies to kind = \"synthetic\"");
  if (synthetic) {
    s.count("seq_len", &d->seq_len, /*positive=*/false);
    s.count("images", &d->images, /*positive=*/false);
    s.read("target_fraction", &d->target_fraction);
    if (!(d->target_fraction > 0 && d->target_fraction <= 1))
      s.fail_value("target_fraction", format_double(d->target_fraction), "must be in (0, 1]");
  }
  s.count("eval_samples", &d->eval_samples);
  s.amount("noise", &d->noise, /*positive=*/false);
  s.read("packing", &d->packing);
  s.choice("balance", keys(kBalancePolicies), &d->balance);
}

void read_train(const Section& s, TrainSpec* t) {
  s.only(keys(kTrainKeys));
  s.count("steps", &t->steps);
  s.count("batch", &t->batch);
  s.count("microbatches", &t->microbatches);
  s.amount("lr", &t->lr);
  s.amount("min_lr", &t->min_lr, /*positive=*/false);
  s.count("warmup", &t->warmup, /*positive=*/false);
  s.amount("weight_decay", &t->weight_decay, /*positive=*/false);
  const std::pair<const char*, double*> betas[] = {{"beta1", &t->beta1}, {"beta2", &t->beta2}};
  for (const auto& [key, beta] : betas) {
    s.read(key, beta);
    if (!(*beta >= 0 && *beta < 1)) s.fail_value(key, format_double(*beta), "must be in [0, 1)");
  }
  s.amount("eps", &t->eps);
  s.amount("grad_clip", &t->grad_clip, /*positive=*/false);
  s.choice("precision", {Precision::kBf16, Precision::kFp32}, &t->precision);
  s.choice("nonfinite", {NonFinite::kStop, NonFinite::kSkip}, &t->nonfinite);
  s.read("seed", &t->seed);
  s.count("log_every", &t->log_every);
  s.count("eval_every", &t->eval_every, /*positive=*/false);
  s.read("eval_captions", &t->eval_captions);
  s.choice("eval_generation", {EvalGeneration::kGather, EvalGeneration::kLayout},
           &t->eval_generation);
  s.count("checkpoint_every", &t->checkpoint_every, /*positive=*/false);
  s.choice("device", {Device::kCpu, Device::kCuda}, &t->device);
  s.count("threads", &t->threads, /*positive=*/false);
  if (t->threads > 1024)  // each one a real thread per rank, spawned at start
    s.fail_value("threads", std::to_string(t->threads),
                 "must be at most 1024 intra-op threads per rank (0 = one per core)");
  s.count("zero_stage", &t->zero_stage, /*positive=*/false);
  s.read("overlap_grad_reduce", &t->overlap_grad_reduce);
  s.read("overlap_param_gather", &t->overlap_param_gather);
  s.read("overlap_tp_comm", &t->overlap_tp_comm);
  s.amount("grad_bucket_mb", &t->grad_bucket_mb);
  s.read("cast_once", &t->cast_once);
  s.read("frozen_fp32", &t->frozen_fp32);
  s.read("shared_memory_collectives", &t->shared_memory_collectives);
  s.read("shared_memory_messages", &t->shared_memory_messages);
  if (t->zero_stage > 1)
    s.fail_value("zero_stage", std::to_string(t->zero_stage),
                 "must be 0 (replicated optimizer state) or 1 (sharded over data parallel)");

  if (t->min_lr > t->lr)
    s.fail_value("min_lr", format_double(t->min_lr),
                 "must be in [0, lr] (lr = " + format_double(t->lr) + ")");
  if (t->batch % t->microbatches != 0)
    s.fail_value("microbatches", std::to_string(t->microbatches),
                 "batch (" + std::to_string(t->batch) + ") must be divisible by microbatches");
  if (t->warmup > t->steps)
    s.fail_value("warmup", std::to_string(t->warmup),
                 "must be <= steps (" + std::to_string(t->steps) + ")");
}

void read_output(const Section& s, OutputSpec* o) {
  s.only(keys(kOutputKeys));
  s.read("dir", &o->dir);
  s.count("keep_checkpoints", &o->keep_checkpoints);
  s.read("trace_step", &o->trace_step);
  if (o->trace_step < 0) s.fail_value("trace_step", std::to_string(o->trace_step), "must be >= 0");
}

// Every module gets a layout (all ones unless [parallel.<module>] says otherwise).
void read_parallel(const Section* s, const ModelSpec& model, ParallelSpec* p) {
  std::vector<std::string> modules = {"llm"};
  for (const EncoderSpec& e : model.encoders) modules.push_back(e.name);
  for (const std::string& m : modules) p->modules[m] = LayoutSpec{};
  if (!s) return;
  s->choice("placement", keys(kPlacements), &p->placement);
  s->choice("cp_split", keys(kCpSplits), &p->cp_split);
  for (auto&& [key, node] : s->table()) {
    const std::string name(key.str());
    if (contains(kParallelKeys, name)) continue;
    if (std::find(modules.begin(), modules.end(), name) == modules.end())
      s->fail(name, "unknown module (modules: " + join(modules) +
                        "); the other keys of [parallel] are " + join(kParallelKeys));
    const Section ls(s->source(), *s->table(name), s->path(name));
    ls.only(keys(kLayoutKeys));
    LayoutSpec& l = p->modules[name];
    const std::pair<const char*, int64_t*> sizes[] = {{"dp", &l.dp}, {"tp", &l.tp}, {"pp", &l.pp},
                                                      {"cp", &l.cp}, {"ep", &l.ep}, {"vp", &l.vp}};
    for (const auto& [k, v] : sizes) {
      ls.read(k, v);
      if (*v < 1) ls.fail_value(k, std::to_string(*v), "must be >= 1");
    }
    ls.count("etp", &l.etp, /*positive=*/false);
    ls.read("sp", &l.sp);
    ls.read("stages", &l.stages);  // ranges against the layer count: plan::make_plan
    for (int64_t first : l.stages)
      if (first < 1)
        ls.fail_value("stages", format_list(l.stages),
                      "entries must be >= 1 (the first block of each pipeline stage after the "
                      "first), got " +
                          std::to_string(first));
  }
}

// Applies one --set "a.b.c=value" to the parsed document, creating intermediate tables.
void apply_override(const std::string& text, const std::string& source, toml::table* root) {
  const size_t eq = text.find('=');
  WEFT_CHECK(eq != std::string::npos, source, ": --set ", text, ": expected section.key=value");
  const std::vector<std::string> parts = split(text.substr(0, eq), '.');
  bool ok = parts.size() >= 2;
  for (const std::string& part : parts) ok = ok && !part.empty();
  WEFT_CHECK(ok, source, ": --set ", text, ": expected section.key=value");

  toml::table* table = root;
  std::string path;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    path += (i ? "." : "") + parts[i];
    if (!table->get(parts[i])) table->insert(parts[i], toml::table{});
    toml::node* n = table->get(parts[i]);
    WEFT_CHECK(n->is_table(), source, ": --set ", text, ": ", path, " = ", describe(*n),
               " is a value, not a table");
    table = n->as_table();
  }
  // The value as TOML if it is one (3e-4, true, "x", [1, 2]); otherwise the raw text.
  const std::string value = trim(std::string_view(text).substr(eq + 1));
  std::optional<toml::table> parsed;
  try {
    parsed = parse_toml("v = " + value, source);
  } catch (const Error&) {
  }
  toml::node* v = parsed && parsed->size() == 1 ? parsed->get("v") : nullptr;
  if (v) {
    v->visit([&](auto& node) { table->insert_or_assign(parts.back(), std::move(node)); });
  } else {
    table->insert_or_assign(parts.back(), value);
  }
}

// Writes `key = value` lines in canonical TOML.
class Writer {
 public:
  void header(const std::string& name) {
    if (os_.tellp() > 0) os_ << "\n";
    os_ << "[" << name << "]\n";
  }
  void put(const char* key, int64_t v) { os_ << key << " = " << v << "\n"; }
  void put(const char* key, uint64_t v) { os_ << key << " = " << v << "\n"; }
  void put(const char* key, double v) { os_ << key << " = " << format_double(v) << "\n"; }
  void put(const char* key, bool v) { os_ << key << " = " << (v ? "true" : "false") << "\n"; }
  void put(const char* key, const std::string& v) { os_ << key << " = " << quote(v) << "\n"; }
  void put(const char* key, const std::vector<int64_t>& v) {
    os_ << key << " = " << format_list(v) << "\n";
  }
  void put_raw(const char* key, const std::string& toml) { os_ << key << " = " << toml << "\n"; }
  void put(const char* key, const char* v) = delete;  // would silently pick the bool overload
  std::string str() const { return os_.str(); }

 private:
  std::ostringstream os_;
};

}  // namespace

Spec parse_spec(const std::string& toml_text, const std::string& source,
                const std::vector<std::string>& overrides) {
  toml::table root = parse_toml(toml_text, source);
  for (const std::string& o : overrides) apply_override(o, source, &root);

  Spec spec;
  spec.source = source;
  const Section top(source, root, "");
  top.only(keys(kTopKeys));

  const toml::table* model = top.table("model");
  const std::string missing_llm = "missing; the decoder table [model.llm] is required";
  if (!model) top.fail_value("model.llm", "", missing_llm);
  const Section ms(source, *model, "model");
  const toml::table* llm = ms.table("llm");
  if (!llm) ms.fail("llm", missing_llm);
  read_llm(Section(source, *llm, "model.llm"), &spec.model.llm);
  read_encoders(ms, &spec.model.encoders);

  if (const toml::table* t = top.table("data")) read_data(Section(source, *t, "data"), &spec.data);
  if (const toml::table* t = top.table("train"))
    read_train(Section(source, *t, "train"), &spec.train);
  if (const toml::table* t = top.table("output"))
    read_output(Section(source, *t, "output"), &spec.output);
  if (const toml::table* t = top.table("parallel")) {
    const Section ps(source, *t, "parallel");
    read_parallel(&ps, spec.model, &spec.parallel);
  } else {
    read_parallel(nullptr, spec.model, &spec.parallel);
  }
  return spec;
}

Spec load_spec(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  WEFT_CHECK(!std::filesystem::is_directory(path, ec), path,
             ": cannot read config file: it is a directory");
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, path, ": cannot read config file (", errno ? std::strerror(errno) : "open failed",
             ")");
  std::ostringstream text;
  text << in.rdbuf();
  WEFT_CHECK(!in.bad(), path, ": error while reading config file");
  return parse_spec(text.str(), path, overrides);
}

std::string spec_to_toml(const Spec& spec) {
  Writer w;
  const LlmSpec& l = spec.model.llm;
  w.header("model.llm");
  w.put("vocab", l.vocab);
  w.put("hidden", l.hidden);
  w.put("layers", l.layers);
  w.put("heads", l.heads);
  w.put("kv_heads", l.kv_heads);
  w.put("ffn", l.ffn);
  w.put("max_seq", l.max_seq);
  w.put("rope_theta", l.rope_theta);
  w.put("norm_eps", l.norm_eps);
  w.put("tie_embeddings", l.tie_embeddings);
  w.put("qkv_bias", l.qkv_bias);
  w.put("rope_scaling", std::string(l.rope_scaling.llama3 ? "llama3" : "none"));
  w.put("rope_scaling_factor", l.rope_scaling.factor);
  w.put("rope_low_freq_factor", l.rope_scaling.low_freq_factor);
  w.put("rope_high_freq_factor", l.rope_scaling.high_freq_factor);
  w.put("rope_original_max_position", l.rope_scaling.original_max_position);
  w.put("frozen", l.frozen);
  w.put("recompute", l.recompute);
  w.put_raw("recompute_blocks", recompute_blocks_text(l.recompute_blocks));
  w.put("attention_chunk", l.attention_chunk);
  if (!l.hf.empty()) w.put("hf", l.hf);
  if (l.moe.enabled()) {
    const MoeSpec& m = l.moe;
    w.header("model.llm.moe");
    w.put("experts", m.experts);
    w.put("top_k", m.top_k);
    w.put("ffn", m.ffn);
    w.put("every", m.every);
    w.put("gating", std::string(m.sigmoid ? "sigmoid" : "softmax"));
    w.put("norm_topk", m.norm_topk);
    w.put("shared_ffn", m.shared_ffn);
    w.put("aux_loss", m.aux_loss);
    w.put("z_loss", m.z_loss);
    w.put("capacity_factor", m.capacity_factor);
  }

  for (const EncoderSpec& e : spec.model.encoders) {
    w.header("model." + e.name);
    w.put("kind", std::string(to_string(e.kind)));
    w.put("hidden", e.hidden);
    w.put("layers", e.layers);
    w.put("heads", e.heads);
    w.put("ffn", e.ffn);
    w.put("feature_layer", e.feature_layer);
    w.put("norm_eps", e.norm_eps);
    w.put("act", std::string(to_string(e.act)));
    w.put("frozen", e.frozen);
    w.put("recompute", e.recompute);
    w.put_raw("recompute_blocks", recompute_blocks_text(e.recompute_blocks));
    if (!e.hf.empty()) w.put("hf", e.hf);
    if (e.kind == EncoderKind::kVit) {
      w.put("class_token", e.class_token);
      w.put("pre_norm", e.pre_norm);
      w.put("patch_bias", e.patch_bias);
      w.put("image_size", e.image_size);
      w.put("channels", e.channels);
      w.put("patch", e.patch);
      w.put("stem_channels", e.stem_channels);
      w.put("stem_layers", e.stem_layers);
    } else {
      w.put("mels", e.mels);
      w.put("frames", e.frames);
    }
    w.header("model." + e.name + ".projector");
    w.put("kind", std::string(to_string(e.projector.kind)));
    w.put("frozen", e.projector.frozen);
  }

  const DataSpec& d = spec.data;
  w.header("data");
  w.put("kind", d.kind);
  w.put("seed", d.seed);
  w.put("eval_samples", d.eval_samples);
  w.put("noise", d.noise);
  w.put("packing", d.packing);
  w.put("balance", d.balance);
  if (d.kind == "llava") {
    w.put("path", d.path);
    if (!d.root.empty()) w.put("root", d.root);
    if (!d.tokenizer.empty()) w.put("tokenizer", d.tokenizer);
    w.put("chat_template", d.chat_template);
    if (!d.image_processor.empty()) w.put("image_processor", d.image_processor);
    w.put("pad_to_square", d.pad_to_square);
    w.put("on_error", d.on_error);
    w.put("workers", d.workers);
    w.put("prefetch", d.prefetch);
  }
  if (d.kind == "synthetic") {
    w.put("seq_len", d.seq_len);
    w.put("images", d.images);
    w.put("target_fraction", d.target_fraction);
  }

  const TrainSpec& t = spec.train;
  w.header("train");
  w.put("steps", t.steps);
  w.put("batch", t.batch);
  w.put("microbatches", t.microbatches);
  w.put("lr", t.lr);
  w.put("min_lr", t.min_lr);
  w.put("warmup", t.warmup);
  w.put("weight_decay", t.weight_decay);
  w.put("beta1", t.beta1);
  w.put("beta2", t.beta2);
  w.put("eps", t.eps);
  w.put("grad_clip", t.grad_clip);
  w.put("precision", std::string(to_string(t.precision)));
  w.put("nonfinite", std::string(to_string(t.nonfinite)));
  w.put("seed", t.seed);
  w.put("log_every", t.log_every);
  w.put("eval_every", t.eval_every);
  w.put("eval_captions", t.eval_captions);
  w.put("eval_generation", std::string(to_string(t.eval_generation)));
  w.put("checkpoint_every", t.checkpoint_every);
  w.put("device", std::string(to_string(t.device)));
  w.put("threads", t.threads);
  w.put("zero_stage", t.zero_stage);
  w.put("overlap_grad_reduce", t.overlap_grad_reduce);
  w.put("overlap_param_gather", t.overlap_param_gather);
  w.put("overlap_tp_comm", t.overlap_tp_comm);
  w.put("grad_bucket_mb", t.grad_bucket_mb);
  w.put("cast_once", t.cast_once);
  w.put("frozen_fp32", t.frozen_fp32);
  w.put("shared_memory_collectives", t.shared_memory_collectives);
  w.put("shared_memory_messages", t.shared_memory_messages);

  w.header("output");
  w.put("dir", spec.output.dir);
  w.put("keep_checkpoints", spec.output.keep_checkpoints);
  w.put("trace_step", spec.output.trace_step);

  w.header("parallel");
  w.put("placement", spec.parallel.placement);
  w.put("cp_split", spec.parallel.cp_split);
  for (const auto& [name, layout] : spec.parallel.modules) {
    w.header("parallel." + name);
    w.put("dp", layout.dp);
    w.put("tp", layout.tp);
    w.put("pp", layout.pp);
    w.put("cp", layout.cp);
    w.put("ep", layout.ep);
    w.put("etp", layout.etp);
    w.put("vp", layout.vp);
    w.put("sp", layout.sp);
    w.put("stages", layout.stages);
  }
  return w.str();
}

}  // namespace weft
