// Hugging Face tokenizer.json with a BPE model, following the `tokenizers` library: added tokens
// are split out first (raw text, then normalized text), then normalizer, pre-tokenizer, BPE by
// merge rank (HF's Word::merge_all) and, for decoding, the decoder chain (the text pipeline is in
// tokenizer_json.h). Every token keeps the source bytes it came from.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "weft/core/error.h"
#include "weft/data/text_tokenizer.h"
#include "weft/data/tokenizer_json.h"

namespace weft::data {
namespace {

using json = nlohmann::json;
using detail::utf8_lead_len;
using tokenizer_json::leading_space;
using tokenizer_json::Piece;
using tokenizer_json::Reader;
using tokenizer_json::Regex;
using tokenizer_json::slice;
using tokenizer_json::Src;
using tokenizer_json::TextPipeline;
using tokenizer_json::trailing_space;
using weft::detail::str_cat;

constexpr int64_t kMaxTokenId = int64_t{1} << 26;  // far above any real vocabulary
constexpr size_t kCacheMaxWordBytes = 256;
constexpr size_t kCacheMaxEntries = 1 << 16;

// ---- the tokenizer -----------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  int64_t id = 0;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = true;
};

struct Symbol {
  int32_t id;
  int32_t prev, next;
  uint32_t len;  // bytes; 0 once merged into its left neighbour
};

class HfBpeTokenizer final : public TextTokenizer {
 public:
  HfBpeTokenizer(std::string_view bytes, const std::string& name);

  std::vector<TokenOffset> encode_with_offsets(
      std::string_view text, bool parse_special,
      const std::vector<LiteralToken>& literals) const override;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  std::optional<int64_t> token_id(std::string_view token) const override;
  std::string token(int64_t id) const override;
  bool is_special(int64_t id) const override {
    return id >= 0 && id < vocab_size() && special_[static_cast<size_t>(id)];
  }

 private:
  using Word = std::vector<std::pair<int32_t, uint32_t>>;  // (id, bytes)
  struct Merge {
    int32_t rank, new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void read_model(const Reader& r, const json& model);
  void read_added_tokens(const Reader& r, const json& list);
  void read_post_processor(const Reader& r, const json& v, const std::string& where);
  // Splits [0, s.size()) at added tokens of `trie` (indices into added_).
  std::vector<detail::TextSpan> split_added(std::string_view s, const detail::LiteralTrie& trie,
                                            bool parse_special) const;
  void encode_segment(Piece seg, bool parse_special, std::vector<TokenOffset>& out) const;
  Word bpe(const std::string& word) const;
  Word merge_word(const std::string& word) const;

  std::string name_;
  // Model.
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<std::string> unk_token_;
  std::string prefix_, suffix_;  // continuing_subword_prefix, end_of_word_suffix
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  int32_t byte_ids_[256];
  // Pipeline.
  TextPipeline pipeline_;
  std::vector<AddedToken> added_;
  std::unordered_map<std::string, int64_t> added_ids_;
  detail::LiteralTrie raw_trie_, normalized_trie_;
  // Id table (vocab and added tokens).
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> has_token_, special_;
  // Word cache.
  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, Word> cache_;
};

HfBpeTokenizer::HfBpeTokenizer(std::string_view bytes, const std::string& name) : name_(name) {
  json root;
  try {
    root = json::parse(bytes.begin(), bytes.end());
  } catch (const json::exception& e) {
    WEFT_FAIL(name, ": invalid JSON: ", e.what());
  }
  const Reader r{name_};
  r.object(root, "top level");
  const json* model = r.get(root, "model");
  if (!model) r.fail("model", "missing");
  read_model(r, r.object(*model, "model"));
  pipeline_.read(r, root);
  if (const json* v = r.get(root, "added_tokens")) read_added_tokens(r, *v);
  special_.resize(id_to_token_.size(), 0);
  if (const json* v = r.get(root, "post_processor")) read_post_processor(r, *v, "post_processor");
}

void HfBpeTokenizer::read_model(const Reader& r, const json& model) {
  const std::string type = r.str(model, "type", "model", "BPE");
  if (type != "BPE") r.fail("model.type", "unsupported model \"" + type + "\" (only BPE)");
  const json* vocab = r.get(model, "vocab");
  if (!vocab) r.fail("model.vocab", "missing");
  r.object(*vocab, "model.vocab");
  std::unordered_map<int64_t, const std::string*> by_id;
  int64_t max_id = -1;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const std::string where = "model.vocab[\"" + it.key() + "\"]";
    const int64_t id = r.integer(it.value(), where, 0, kMaxTokenId - 1);
    auto [pos, fresh] = by_id.emplace(id, &it.key());
    if (!fresh) r.fail(where, str_cat("id ", id, " is also the id of \"", *pos->second, "\""));
    vocab_.emplace(it.key(), static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
  }
  WEFT_CHECK(max_id < 2 * static_cast<int64_t>(vocab_.size()) + 65536, name_,
             ": model.vocab: ids are too sparse (largest ", max_id, " for ", vocab_.size(),
             " tokens)");
  id_to_token_.resize(static_cast<size_t>(max_id + 1));
  has_token_.assign(id_to_token_.size(), 0);
  for (const auto& [tok, id] : vocab_) {
    id_to_token_[static_cast<size_t>(id)] = tok;
    has_token_[static_cast<size_t>(id)] = 1;
  }

  if (const json* v = r.get(model, "unk_token")) unk_token_ = r.str(*v, "model.unk_token");
  prefix_ = r.str(model, "continuing_subword_prefix", "model", "");
  suffix_ = r.str(model, "end_of_word_suffix", "model", "");
  byte_fallback_ = r.flag(model, "byte_fallback", "model", false);
  fuse_unk_ = r.flag(model, "fuse_unk", "model", false);
  ignore_merges_ = r.flag(model, "ignore_merges", "model", false);
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof(hex), "<0x%02X>", b);
    auto it = vocab_.find(hex);
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }

  const json* merges = r.get(model, "merges");
  if (!merges) return;
  if (!merges->is_array()) r.fail("model.merges", "expected an array");
  for (size_t i = 0; i < merges->size(); ++i) {
    const json& m = (*merges)[i];
    const std::string where = str_cat("model.merges[", i, "]");
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos) r.fail(where, "expected \"left right\", got \"" + s + "\"");
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2) {
      a = r.str(m[0], where + "[0]");
      b = r.str(m[1], where + "[1]");
    } else {
      r.fail(where, "expected \"left right\" or [\"left\", \"right\"]");
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b);
    if (ia == vocab_.end()) r.fail(where, "token \"" + a + "\" is not in model.vocab");
    if (ib == vocab_.end()) r.fail(where, "token \"" + b + "\" is not in model.vocab");
    std::string merged = a;
    merged += !prefix_.empty() && b.compare(0, prefix_.size(), prefix_) == 0
                  ? b.substr(prefix_.size())
                  : b;
    auto im = vocab_.find(merged);
    if (im == vocab_.end()) r.fail(where, "merged token \"" + merged + "\" is not in model.vocab");
    merges_[pair_key(ia->second, ib->second)] = {static_cast<int32_t>(i), im->second};
  }
}

void HfBpeTokenizer::read_added_tokens(const Reader& r, const json& list) {
  if (!list.is_array()) r.fail("added_tokens", "expected an array");
  std::unordered_map<int64_t, size_t> seen;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = str_cat("added_tokens[", i, "]");
    const json& v = r.object(list[i], where);
    AddedToken t;
    const json* id = r.get(v, "id");
    const json* content = r.get(v, "content");
    if (!id) r.fail(where + ".id", "missing");
    if (!content) r.fail(where + ".content", "missing");
    t.id = r.integer(*id, where + ".id", 0, kMaxTokenId - 1);
    t.content = r.str(*content, where + ".content");
    if (t.content.empty()) r.fail(where + ".content", "empty token");
    t.special = r.flag(v, "special", where, false);
    t.lstrip = r.flag(v, "lstrip", where, false);
    t.rstrip = r.flag(v, "rstrip", where, false);
    t.single_word = r.flag(v, "single_word", where, false);
    t.normalized = r.flag(v, "normalized", where, !t.special);
    auto [pos, fresh] = seen.emplace(t.id, i);
    if (!fresh)
      r.fail(where + ".id",
             str_cat("id ", t.id, " is also the id of added_tokens[", pos->second, "]"));
    added_ids_[t.content] = t.id;
    added_.push_back(std::move(t));
  }
  int64_t max_id = static_cast<int64_t>(id_to_token_.size()) - 1;
  for (const AddedToken& t : added_) max_id = std::max(max_id, t.id);
  WEFT_CHECK(max_id < 2 * static_cast<int64_t>(vocab_.size() + added_.size()) + 65536, name_,
             ": added_tokens: ids are too sparse (largest ", max_id, ")");
  id_to_token_.resize(static_cast<size_t>(max_id + 1));
  has_token_.resize(id_to_token_.size(), 0);
  special_.resize(id_to_token_.size(), 0);
  for (size_t i = 0; i < added_.size(); ++i) {
    const AddedToken& t = added_[i];
    id_to_token_[static_cast<size_t>(t.id)] = t.content;
    has_token_[static_cast<size_t>(t.id)] = 1;
    special_[static_cast<size_t>(t.id)] = t.special;
    if (!t.normalized) {
      raw_trie_.add(t.content, static_cast<int32_t>(i));
    } else {
      Piece p{t.content, std::vector<Src>(t.content.size(), Src{0, 0})};
      pipeline_.normalize(p);
      if (!p.text.empty()) normalized_trie_.add(p.text, static_cast<int32_t>(i));
    }
  }
}

void HfBpeTokenizer::read_post_processor(const Reader& r, const json& v, const std::string& where) {
  const std::string type = r.type(v, where);
  const auto special_id = [&](const std::string& tok, const std::string& w) -> int64_t {
    auto id = token_id(tok);
    if (!id) r.fail(w, "token \"" + tok + "\" is not in the vocabulary");
    return *id;
  };
  if (type == "Sequence") {
    const json* list = r.get(v, "processors");
    if (!list || !list->is_array()) r.fail(where + ".processors", "expected an array");
    for (size_t i = 0; i < list->size(); ++i)
      read_post_processor(r, (*list)[i], str_cat(where, ".processors[", i, "]"));
  } else if (type == "TemplateProcessing") {
    const json* single = r.get(v, "single");
    if (!single || !single->is_array()) r.fail(where + ".single", "expected an array");
    const auto special_of = [&](const json& item, const std::string& w) -> std::optional<int64_t> {
      const json* st = r.get(r.object(item, w), "SpecialToken");
      if (!st) return std::nullopt;
      const std::string tok = r.str(r.object(*st, w).value("id", json()), w + ".SpecialToken.id");
      if (const json* table = r.get(v, "special_tokens"))
        if (const json* entry = r.get(r.object(*table, where + ".special_tokens"), tok.c_str()))
          if (const json* ids = r.get(r.object(*entry, w), "ids"))
            if (ids->is_array() && !ids->empty())
              return r.integer((*ids)[0], where + ".special_tokens." + tok + ".ids[0]", 0,
                               kMaxTokenId - 1);
      return special_id(tok, w);
    };
    if (!single->empty()) {
      if (auto id = special_of(single->front(), where + ".single[0]")) {
        add_bos = true;
        if (!bos_id) bos_id = id;
      }
      if (single->size() > 1)
        if (auto id = special_of(single->back(), where + ".single[-1]")) {
          add_eos = true;
          if (!eos_id) eos_id = id;
        }
    }
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const json* p = r.get(v, key);
      if (!p || !p->is_array() || p->size() != 2) r.fail(where + "." + key, "expected [token, id]");
      const int64_t id = r.integer((*p)[1], where + "." + key + "[1]", 0, kMaxTokenId - 1);
      (key[0] == 'c' ? add_bos : add_eos) = true;
      auto& slot = key[0] == 'c' ? bos_id : eos_id;
      if (!slot) slot = id;
    }
  }
  // ByteLevel and others add nothing.
}

std::optional<int64_t> HfBpeTokenizer::token_id(std::string_view token) const {
  const std::string t(token);
  if (auto it = added_ids_.find(t); it != added_ids_.end()) return it->second;
  if (auto it = vocab_.find(t); it != vocab_.end()) return it->second;
  return std::nullopt;
}

std::string HfBpeTokenizer::token(int64_t id) const {
  WEFT_CHECK(id >= 0 && id < vocab_size() && has_token_[static_cast<size_t>(id)], name_,
             ": token id ", id, " is not in the vocabulary (size ", vocab_size(), ")");
  return id_to_token_[static_cast<size_t>(id)];
}

std::vector<detail::TextSpan> HfBpeTokenizer::split_added(std::string_view s,
                                                          const detail::LiteralTrie& trie,
                                                          bool parse_special) const {
  static const Regex word_end(R"(\w\z)", "word pattern"), word_start(R"(\A\w)", "word pattern");
  std::vector<detail::TextSpan> out;
  size_t start_offset = 0;
  for (size_t pos = 0; pos < s.size();) {
    const auto [len, index] = trie.longest_at(s, pos);
    if (len == 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + len;
    pos = stop;
    const AddedToken& t = added_[static_cast<size_t>(index)];
    if (t.special && !parse_special) continue;
    if (t.single_word) {
      const bool word_before = start > 0 && !word_end.find_all(s.substr(0, start)).empty();
      const bool word_after = stop < s.size() && !word_start.find_all(s.substr(stop)).empty();
      if (word_before || word_after) continue;
    }
    if (t.lstrip) start = std::max(start - trailing_space(s.substr(0, start)), start_offset);
    if (t.rstrip) stop += leading_space(s.substr(stop));
    pos = stop;
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, index});
    start_offset = stop;
  }
  if (start_offset < s.size()) out.push_back({start_offset, s.size(), -1});
  return out;
}

std::vector<TokenOffset> HfBpeTokenizer::encode_with_offsets(
    std::string_view text, bool parse_special, const std::vector<LiteralToken>& literals) const {
  WEFT_CHECK(text.size() < (size_t{1} << 31), name_, ": text too long (", text.size(), " bytes)");
  const size_t bad = detail::utf8_first_invalid(text);
  WEFT_CHECK(bad == std::string_view::npos, name_, ": text is not valid UTF-8 (byte ", bad, ")");
  std::vector<TokenOffset> out;
  for (const auto& span : detail::split_on_literals(text, literals)) {
    if (span.literal >= 0) {
      out.push_back({literals[static_cast<size_t>(span.literal)].id,
                     static_cast<int64_t>(span.begin), static_cast<int64_t>(span.end)});
      continue;
    }
    const std::string_view part = text.substr(span.begin, span.end - span.begin);
    for (const auto& s : split_added(part, raw_trie_, parse_special)) {
      const int64_t b = static_cast<int64_t>(span.begin + s.begin);
      const int64_t e = static_cast<int64_t>(span.begin + s.end);
      if (s.literal >= 0) {
        out.push_back({added_[static_cast<size_t>(s.literal)].id, b, e});
        continue;
      }
      Piece seg;
      seg.text = std::string(part.substr(s.begin, s.end - s.begin));
      for (int64_t i = b; i < e; ++i)
        seg.src.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(i + 1)});
      encode_segment(std::move(seg), parse_special, out);
    }
  }
  return out;
}

void HfBpeTokenizer::encode_segment(Piece seg, bool parse_special,
                                    std::vector<TokenOffset>& out) const {
  pipeline_.normalize(seg);
  for (const auto& s : split_added(seg.text, normalized_trie_, parse_special)) {
    if (s.literal >= 0) {
      out.push_back({added_[static_cast<size_t>(s.literal)].id, seg.src[s.begin].begin,
                     seg.src[s.end - 1].end});
      continue;
    }
    std::vector<Piece> pieces{slice(seg, s.begin, s.end)};
    pipeline_.pre_tokenize(pieces);
    for (const Piece& p : pieces) {
      // Byte-fallback tokens of a continuing_subword_prefix count one byte each (as in HF), so
      // the byte count can exceed the piece: clamp.
      const size_t n = p.text.size();
      size_t at = 0;
      for (const auto& [id, len] : bpe(p.text)) {
        const size_t a = std::min(at, n - 1), z = std::max(a + 1, std::min(at + len, n));
        out.push_back({id, p.src[a].begin, p.src[z - 1].end});
        at += len;
      }
    }
  }
}

HfBpeTokenizer::Word HfBpeTokenizer::bpe(const std::string& word) const {
  if (word.empty()) return {};
  if (ignore_merges_) {
    auto it = vocab_.find(word);
    if (it != vocab_.end()) return {{it->second, static_cast<uint32_t>(word.size())}};
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    auto it = cache_.find(word);
    if (it != cache_.end()) return it->second;
  }
  Word w = merge_word(word);
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() < kCacheMaxEntries) cache_.emplace(word, w);
  }
  return w;
}

HfBpeTokenizer::Word HfBpeTokenizer::merge_word(const std::string& w) const {
  std::vector<Symbol> symbols;
  int32_t unk_id = -1;  // pending unknown: id and bytes
  uint32_t unk_len = 0;
  const auto add = [&](int32_t id, uint32_t len) {
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, n + 1, len});
  };
  for (size_t i = 0; i < w.size();) {
    const size_t len = std::min(utf8_lead_len(static_cast<unsigned char>(w[i])), w.size() - i);
    std::string s = w.substr(i, len);
    if (i > 0) s = prefix_ + s;
    if (i + len == w.size()) s += suffix_;
    i += len;
    if (auto it = vocab_.find(s); it != vocab_.end()) {
      if (unk_id >= 0) add(unk_id, unk_len);
      unk_id = -1;
      add(it->second, static_cast<uint32_t>(len));
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (const char c : s) all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        // HF gives every byte token a length of one byte, even for prefix/suffix bytes.
        for (const char c : s) add(byte_ids_[static_cast<unsigned char>(c)], 1);
        continue;
      }
    }
    if (!unk_token_) continue;  // HF drops the character
    auto uit = vocab_.find(*unk_token_);
    WEFT_CHECK(uit != vocab_.end(), name_, ": model.unk_token \"", *unk_token_,
               "\" is not in model.vocab");
    if (unk_id >= 0 && fuse_unk_) {
      unk_len += static_cast<uint32_t>(len);
    } else {
      if (unk_id >= 0) add(unk_id, unk_len);
      unk_id = uit->second;
      unk_len = static_cast<uint32_t>(len);
    }
  }
  if (unk_id >= 0) add(unk_id, unk_len);
  if (symbols.empty()) return {};
  symbols.back().next = -1;

  // Lowest rank first, then leftmost (HF Word::merge_all, with its stale-entry check).
  struct Entry {
    int32_t rank, pos, new_id;
    bool operator<(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Entry> queue;
  const auto find_merge = [&](int32_t a, int32_t b) -> const Merge* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i)
    if (const Merge* m = find_merge(symbols[i].id, symbols[i + 1].id))
      queue.push({m->rank, static_cast<int32_t>(i), m->new_id});
  while (!queue.empty()) {
    const Entry top = queue.top();
    queue.pop();
    Symbol& cur = symbols[static_cast<size_t>(top.pos)];
    if (cur.len == 0 || cur.next == -1) continue;
    const Symbol right = symbols[static_cast<size_t>(cur.next)];
    const Merge* m = find_merge(cur.id, right.id);
    if (m == nullptr || m->new_id != top.new_id) continue;
    symbols[static_cast<size_t>(cur.next)].len = 0;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    if (cur.prev >= 0)
      if (const Merge* pm = find_merge(symbols[static_cast<size_t>(cur.prev)].id, cur.id))
        queue.push({pm->rank, cur.prev, pm->new_id});
    if (cur.next >= 0)
      if (const Merge* nm = find_merge(cur.id, symbols[static_cast<size_t>(cur.next)].id))
        queue.push({nm->rank, top.pos, nm->new_id});
  }
  Word out;
  for (const Symbol& s : symbols)
    if (s.len != 0) out.emplace_back(s.id, s.len);
  return out;
}

std::string HfBpeTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int64_t id : ids) {
    std::string t = token(id);
    if (skip_special && is_special(id)) continue;
    tokens.push_back(std::move(t));
  }
  std::string out;
  if (!pipeline_.decode(tokens)) {
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (const std::string& t : tokens) out += t;
  return out;
}

}  // namespace

std::unique_ptr<TextTokenizer> load_tokenizer_json(std::string_view bytes,
                                                   const std::string& name) {
  return std::make_unique<HfBpeTokenizer>(bytes, name);
}

}  // namespace weft::data
