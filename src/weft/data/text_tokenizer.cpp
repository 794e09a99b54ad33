#include "weft/data/text_tokenizer.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "weft/core/error.h"

namespace weft::data {

std::vector<int64_t> TextTokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<int64_t> ids;
  for (const TokenOffset& t : encode_with_offsets(text, parse_special)) ids.push_back(t.id);
  return ids;
}

namespace detail {

size_t utf8_lead_len(unsigned char lead) {
  static constexpr unsigned char kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[lead >> 4];
}

namespace {
// A well-formed UTF-8 lead byte (RFC 3629): the sequence's length (0 = not a lead byte of a
// multi-byte sequence) and the allowed range of its second byte.
struct Utf8Lead {
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;
};
Utf8Lead utf8_lead(unsigned char b) {
  Utf8Lead l;
  if (b >= 0xC2 && b <= 0xDF) {
    l.len = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    l.len = 3;
    if (b == 0xE0) l.lo = 0xA0;
    if (b == 0xED) l.hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    l.len = 4;
    if (b == 0xF0) l.lo = 0x90;
    if (b == 0xF4) l.hi = 0x8F;
  }
  return l;
}
}  // namespace

size_t utf8_valid_len(std::string_view s, size_t pos) {
  const auto at = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const size_t n = s.size();
  if (pos >= n) return 0;
  const unsigned char b = at(pos);
  if (b < 0x80) return 1;
  const auto [len, lo, hi] = utf8_lead(b);
  if (len == 0) return 0;
  if (pos + len > n) return 0;
  if (at(pos + 1) < lo || at(pos + 1) > hi) return 0;
  for (size_t i = 2; i < len; ++i)
    if (at(pos + i) < 0x80 || at(pos + i) > 0xBF) return 0;
  return len;
}

size_t utf8_first_invalid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t len = utf8_valid_len(s, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

void append_utf8_lossy(std::string& out, std::string_view s) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  size_t i = 0;
  while (i < s.size()) {
    const size_t len = utf8_valid_len(s, i);
    if (len > 0) {
      out.append(s.substr(i, len));
      i += len;
      continue;
    }
    // The maximal prefix of a well-formed sequence starting at i is replaced by one U+FFFD.
    const auto [want, lo, hi] = utf8_lead(static_cast<unsigned char>(s[i]));
    size_t k = 1;
    if (want > 0) {
      while (k < want && i + k < s.size()) {
        const unsigned char c = static_cast<unsigned char>(s[i + k]);
        const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (c < l || c > h) break;
        ++k;
      }
    }
    out.append(kReplacement);
    i += k;
  }
}

void LiteralTrie::add(std::string_view s, int32_t value) {
  WEFT_ASSERT(!s.empty() && value >= 0);
  int32_t node = 0;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    auto& next = nodes_[static_cast<size_t>(node)].next;
    auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(c, int32_t{-1}));
    if (it != next.end() && it->first == c) {
      node = it->second;
    } else {
      const auto child = static_cast<int32_t>(nodes_.size());
      next.insert(it, {c, child});
      nodes_.emplace_back();  // invalidates `next`; not used after this
      node = child;
    }
  }
  nodes_[static_cast<size_t>(node)].value = value;
}

template <typename Visit>
void LiteralTrie::walk(std::string_view text, size_t pos, Visit&& visit) const {
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    const auto& next = nodes_[static_cast<size_t>(node)].next;
    auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(c, int32_t{-1}));
    if (it == next.end() || it->first != c) break;
    node = it->second;
    const int32_t v = nodes_[static_cast<size_t>(node)].value;
    if (v >= 0) visit(i + 1 - pos, v);
  }
}

std::pair<size_t, int32_t> LiteralTrie::longest_at(std::string_view text, size_t pos) const {
  std::pair<size_t, int32_t> best{0, -1};
  walk(text, pos, [&](size_t len, int32_t v) { best = {len, v}; });
  return best;
}

void LiteralTrie::prefixes_at(std::string_view text, size_t pos,
                              std::vector<std::pair<size_t, int32_t>>& out) const {
  out.clear();
  walk(text, pos, [&](size_t len, int32_t v) { out.emplace_back(len, v); });
}

std::vector<TextSpan> split_on_literals(std::string_view text,
                                        const std::vector<LiteralToken>& literals) {
  std::vector<TextSpan> spans;
  if (literals.empty()) {
    if (!text.empty()) spans.push_back({0, text.size(), -1});
    return spans;
  }
  LiteralTrie trie;
  for (size_t i = 0; i < literals.size(); ++i) {
    WEFT_CHECK(!literals[i].text.empty(), "tokenizer: literal token ", i, " is empty");
    trie.add(literals[i].text, static_cast<int32_t>(i));
  }
  size_t start = 0;
  for (size_t pos = 0; pos < text.size();) {
    const auto [len, index] = trie.longest_at(text, pos);
    if (len == 0) {
      ++pos;
      continue;
    }
    if (start < pos) spans.push_back({start, pos, -1});
    spans.push_back({pos, pos + len, index});
    pos += len;
    start = pos;
  }
  if (start < text.size()) spans.push_back({start, text.size(), -1});
  return spans;
}

}  // namespace detail

namespace {

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, "tokenizer: cannot open ", path);
  std::ostringstream os;
  os << in.rdbuf();
  WEFT_CHECK(!in.bad(), "tokenizer: cannot read ", path);
  return os.str();
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix.data(), suffix.size()) == 0;
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

// The content of a tokenizer_config.json token field: a string, an AddedToken object
// ({"content": ...}) or null (nullopt).
std::optional<std::string> config_token(const nlohmann::json& config, const char* key,
                                        const std::string& name) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    WEFT_CHECK(c != it->end() && c->is_string(), name, ": ", key,
               ": expected a string or an object with a string \"content\"");
    return c->get<std::string>();
  }
  WEFT_FAIL(name, ": ", key, ": expected a string or an object with a string \"content\"");
}

}  // namespace

void apply_tokenizer_config(TextTokenizer& tok, std::string_view bytes, const std::string& name) {
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    WEFT_FAIL(name, ": invalid JSON: ", e.what());
  }
  WEFT_CHECK(config.is_object(), name, ": expected a JSON object");
  const struct {
    const char* key;
    std::optional<int64_t>* id;
  } fields[] = {{"bos_token", &tok.bos_id}, {"eos_token", &tok.eos_id}, {"pad_token", &tok.pad_id}};
  for (const auto& f : fields) {
    const auto content = config_token(config, f.key, name);
    if (!content) continue;
    const auto id = tok.token_id(*content);
    WEFT_CHECK(id.has_value(), name, ": ", f.key, " \"", *content,
               "\" is not a token of the tokenizer");
    *f.id = id;
  }
  const struct {
    const char* key;
    bool* flag;
  } flags[] = {{"add_bos_token", &tok.add_bos}, {"add_eos_token", &tok.add_eos}};
  for (const auto& f : flags) {
    auto it = config.find(f.key);
    if (it == config.end() || it->is_null()) continue;
    WEFT_CHECK(it->is_boolean(), name, ": ", f.key, ": expected a boolean");
    *f.flag = it->get<bool>();
  }
}

std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& path) {
  std::string file = path;
  if (is_directory(path)) {
    if (is_file(path + "/tokenizer.json")) {
      file = path + "/tokenizer.json";
    } else if (is_file(path + "/tokenizer.model")) {
      file = path + "/tokenizer.model";
    } else {
      WEFT_FAIL("tokenizer: directory ", path, " has neither tokenizer.json nor tokenizer.model");
    }
  }
  const std::string bytes = read_file(file);
  if (!ends_with(file, ".json")) return load_sentencepiece(bytes, file);
  auto tok = load_tokenizer_json(bytes, file);
  const std::string config = dir_of(file) + "/tokenizer_config.json";
  if (is_file(config)) apply_tokenizer_config(*tok, read_file(config), config);
  return tok;
}

}  // namespace weft::data
