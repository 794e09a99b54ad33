// Hugging Face tokenizer.json with a BPE model, following the `tokenizers` library: added tokens
// are split out first (raw text, then normalized text), then normalizer, pre-tokenizer, BPE by
// merge rank (HF's Word::merge_all) and, for decoding, the decoder chain.
//
// Text is carried through the pipeline as a Piece: bytes plus, per byte, the range of the
// original text it came from, so every token knows its source bytes.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

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

namespace weft::data {
namespace {

using json = nlohmann::json;
using detail::utf8_lead_len;
using weft::detail::str_cat;

constexpr int64_t kMaxTokenId = int64_t{1} << 26;  // far above any real vocabulary
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr size_t kCacheMaxWordBytes = 256;
constexpr size_t kCacheMaxEntries = 1 << 16;

// ---- PCRE2 -------------------------------------------------------------------------------------

// A compiled pattern (UTF + Unicode properties). Matching is thread-safe.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &err, &err_offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      WEFT_FAIL(where, ": invalid regex at offset ", err_offset, ": ",
                reinterpret_cast<char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches [begin, end) in s (valid UTF-8), left to right; after an empty match
  // the search resumes one character further (as Oniguruma's find_iter).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    // Work limits linear in the text: real patterns need a few steps per character, a
    // catastrophically backtracking one (from a hostile file) fails fast instead of hanging.
    std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> context(
        pcre2_match_context_create(nullptr), &pcre2_match_context_free);
    WEFT_CHECK(md != nullptr && context != nullptr, "tokenizer: out of memory for a regex match");
    const auto limit = static_cast<uint32_t>(std::min<size_t>(100000 + 64 * s.size(), 1u << 30));
    pcre2_set_match_limit(context.get(), limit);
    pcre2_set_heap_limit(context.get(), 256 * 1024);  // KiB
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t pos = 0;
    while (pos <= s.size()) {
      int rc =
          pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md.get(), context.get());
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT && jit_)
        rc = pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md.get(),
                         context.get());
      if (rc == PCRE2_ERROR_NOMATCH) break;
      WEFT_CHECK(rc >= 0, "tokenizer: regex match failed (", rc,
                 "): the pattern is too expensive for this text");
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const size_t b = ov[0], e = ov[1];
      if (b > e || e > s.size()) break;  // \K tricks; never in tokenizer patterns
      out.emplace_back(b, e);
      if (e > pos) {
        pos = e;
      } else {
        if (pos >= s.size()) break;
        pos += std::min(utf8_lead_len(static_cast<unsigned char>(s[pos])), s.size() - pos);
      }
    }
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// ---- text with source offsets ------------------------------------------------------------------

struct Src {
  uint32_t begin, end;
};

struct Piece {
  std::string text;
  std::vector<Src> src;  // per byte of text
};

Piece slice(const Piece& p, size_t a, size_t b) {
  return {p.text.substr(a, b - a), std::vector<Src>(p.src.begin() + a, p.src.begin() + b)};
}

void prepend(Piece& p, std::string_view s) {
  if (p.text.empty() || s.empty()) return;
  const Src at{p.src.front().begin, p.src.front().begin};
  p.text.insert(0, s);
  p.src.insert(p.src.begin(), s.size(), at);
}

// Replaces each [begin, end) of `matches` (sorted, disjoint) by `content`; its bytes take the
// source range of what they replace.
Piece replace_ranges(const Piece& p, const std::vector<std::pair<size_t, size_t>>& matches,
                     std::string_view content) {
  Piece out;
  size_t at = 0;
  for (const auto& [b, e] : matches) {
    if (b < at || e <= b) continue;
    out.text.append(p.text, at, b - at);
    out.src.insert(out.src.end(), p.src.begin() + at, p.src.begin() + b);
    out.text.append(content);
    out.src.insert(out.src.end(), content.size(), Src{p.src[b].begin, p.src[e - 1].end});
    at = e;
  }
  out.text.append(p.text, at, std::string::npos);
  out.src.insert(out.src.end(), p.src.begin() + at, p.src.end());
  return out;
}

std::vector<std::pair<size_t, size_t>> find_literal(std::string_view s, std::string_view pat) {
  std::vector<std::pair<size_t, size_t>> out;
  if (pat.empty()) return out;
  for (size_t pos = s.find(pat); pos != std::string_view::npos; pos = s.find(pat, pos + pat.size()))
    out.emplace_back(pos, pos + pat.size());
  return out;
}

bool is_whitespace(uint32_t c) {
  return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Code point of the valid UTF-8 character at s[pos] of length len.
uint32_t code_point(std::string_view s, size_t pos, size_t len) {
  const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i])); };
  if (len == 1) return b(pos);
  uint32_t cp = b(pos) & (0xFF >> (len + 1));
  for (size_t i = 1; i < len; ++i) cp = (cp << 6) | (b(pos + i) & 0x3F);
  return cp;
}

// Byte length of the whitespace run at the start / end of s (valid UTF-8).
size_t leading_space(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const size_t len = utf8_lead_len(static_cast<unsigned char>(s[i]));
    if (i + len > s.size() || !is_whitespace(code_point(s, i, len))) break;
    i += len;
  }
  return i;
}
size_t trailing_space(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t b = end - 1;
    while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
    if (!is_whitespace(code_point(s, b, end - b))) break;
    end = b;
  }
  return s.size() - end;
}

// GPT-2's reversible byte <-> printable character table.
const std::vector<std::string>& byte_to_char() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      detail::append_utf8(t[b], printable ? static_cast<uint32_t>(b) : 256u + n++);
    }
    return t;
  }();
  return table;
}
const std::unordered_map<std::string, unsigned char>& char_to_byte() {
  static const std::unordered_map<std::string, unsigned char> table = [] {
    std::unordered_map<std::string, unsigned char> t;
    for (int b = 0; b < 256; ++b) t[byte_to_char()[b]] = static_cast<unsigned char>(b);
    return t;
  }();
  return table;
}

// ---- JSON access -------------------------------------------------------------------------------

// Reads fields of the file `name` with errors naming the field.
struct Reader {
  const std::string& name;

  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    WEFT_FAIL(name, ": ", where, ": ", what);
  }
  const json* get(const json& obj, const char* key) const {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  const json& object(const json& v, const std::string& where) const {
    if (!v.is_object()) fail(where, "expected an object");
    return v;
  }
  std::string str(const json& v, const std::string& where) const {
    if (!v.is_string()) fail(where, "expected a string");
    return v.get<std::string>();
  }
  std::string str(const json& obj, const char* key, const std::string& where,
                  const std::string& fallback) const {
    const json* v = get(obj, key);
    return v ? str(*v, where + "." + key) : fallback;
  }
  bool flag(const json& obj, const char* key, const std::string& where, bool fallback) const {
    const json* v = get(obj, key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(where + "." + key, "expected a boolean");
    return v->get<bool>();
  }
  int64_t integer(const json& v, const std::string& where, int64_t lo, int64_t hi) const {
    if (!v.is_number_integer()) fail(where, "expected an integer");
    const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)
                          ? INT64_MAX
                          : v.get<int64_t>();
    if (x < lo || x > hi) fail(where, str_cat(x, " is out of range [", lo, ", ", hi, "]"));
    return x;
  }
  std::string type(const json& v, const std::string& where) const {
    object(v, where);
    // `where` names the path: one '[' per level of Sequence nesting. Bounded, so that a hostile
    // file cannot exhaust the stack.
    if (std::count(where.begin(), where.end(), '[') > 16) fail(where, "nested too deeply");
    const json* t = get(v, "type");
    if (!t) fail(where, "missing \"type\"");
    return str(*t, where + ".type");
  }
};

// A {"String": s} or {"Regex": r} pattern.
struct Pattern {
  std::string literal;
  std::shared_ptr<Regex> regex;

  std::vector<std::pair<size_t, size_t>> find(std::string_view s) const {
    return regex ? regex->find_all(s) : find_literal(s, literal);
  }
};

Pattern read_pattern(const Reader& r, const json& obj, const std::string& where) {
  const json* p = r.get(r.object(obj, where), "pattern");
  if (!p) r.fail(where, "missing \"pattern\"");
  const std::string w = where + ".pattern";
  r.object(*p, w);
  if (const json* s = r.get(*p, "String")) return {r.str(*s, w + ".String"), nullptr};
  if (const json* s = r.get(*p, "Regex"))
    return {"", std::make_shared<Regex>(r.str(*s, w + ".Regex"), r.name + ": " + w + ".Regex")};
  r.fail(w, "expected {\"String\": ...} or {\"Regex\": ...}");
}

// ---- normalizers -------------------------------------------------------------------------------

struct Normalizer {
  enum Kind { kReplace, kPrepend, kAppend, kLowercase, kStrip } kind;
  Pattern pattern;
  std::string content;
  bool left = false, right = false;

  void apply(Piece& p) const {
    switch (kind) {
      case kReplace:
        p = replace_ranges(p, pattern.find(p.text), content);
        break;
      case kPrepend:
        prepend(p, content);
        break;
      case kAppend:
        if (!p.text.empty()) {
          p.text += content;
          p.src.insert(p.src.end(), content.size(), Src{p.src.back().end, p.src.back().end});
        }
        break;
      case kLowercase:  // ASCII only (no ICU)
        for (char& c : p.text)
          if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
        break;
      case kStrip: {
        const size_t a = left ? leading_space(p.text) : 0;
        const size_t b = p.text.size() - (right ? trailing_space(p.text) : 0);
        p = slice(p, a, std::max(a, b));
        break;
      }
    }
  }
};

void read_normalizer(const Reader& r, const json& v, const std::string& where,
                     std::vector<Normalizer>& out) {
  const std::string type = r.type(v, where);
  if (type == "Sequence") {
    const json* list = r.get(v, "normalizers");
    if (!list || !list->is_array()) r.fail(where + ".normalizers", "expected an array");
    for (size_t i = 0; i < list->size(); ++i)
      read_normalizer(r, (*list)[i], str_cat(where, ".normalizers[", i, "]"), out);
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    // Identity: ICU is not linked (see text_tokenizer.h).
  } else if (type == "Replace") {
    out.push_back({Normalizer::kReplace, read_pattern(r, v, where), r.str(v, "content", where, ""),
                   false, false});
  } else if (type == "Prepend" || type == "Append") {
    const char* key = type == "Prepend" ? "prepend" : "append";
    const json* s = r.get(v, key);
    if (!s) r.fail(where, str_cat("missing \"", key, "\""));
    out.push_back({type == "Prepend" ? Normalizer::kPrepend : Normalizer::kAppend,
                   {},
                   r.str(*s, where + "." + key),
                   false,
                   false});
  } else if (type == "Lowercase") {
    out.push_back({Normalizer::kLowercase, {}, "", false, false});
  } else if (type == "Strip") {
    out.push_back({Normalizer::kStrip,
                   {},
                   "",
                   r.flag(v, "strip_left", where, true),
                   r.flag(v, "strip_right", where, true)});
  } else {
    r.fail(where + ".type", "unsupported normalizer \"" + type + "\"");
  }
}

// ---- pre-tokenizers ----------------------------------------------------------------------------

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Splits p at `matches` like NormalizedString::split; empty pieces are dropped.
void split_piece(const Piece& p, const std::vector<std::pair<size_t, size_t>>& matches,
                 Behavior behavior, bool invert, std::vector<Piece>& out) {
  // (begin, end, is_match) covering the whole text.
  std::vector<std::tuple<size_t, size_t, bool>> parts;
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) parts.emplace_back(prev, b, invert);
    parts.emplace_back(b, e, !invert);
    prev = e;
  }
  if (prev != p.text.size()) parts.emplace_back(prev, p.text.size(), invert);

  std::vector<std::pair<size_t, size_t>> pieces;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const auto& [b, e, m] : parts)
        if (!m) pieces.emplace_back(b, e);
      break;
    case Behavior::kIsolated:
      for (const auto& [b, e, m] : parts) pieces.emplace_back(b, e);
      break;
    case Behavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (const auto& [b, e, m] : parts) {
        if (m && !prev_match && !pieces.empty())
          pieces.back().second = e;
        else
          pieces.emplace_back(b, e);
        prev_match = m;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        const auto& [b, e, m] = *it;
        if (m && !prev_match && !pieces.empty())
          pieces.back().first = b;
        else
          pieces.emplace_back(b, e);
        prev_match = m;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
    case Behavior::kContiguous: {
      bool prev_match = false;
      for (const auto& [b, e, m] : parts) {
        if (m == prev_match && !pieces.empty())
          pieces.back().second = e;
        else
          pieces.emplace_back(b, e);
        prev_match = m;
      }
      break;
    }
  }
  for (const auto& [b, e] : pieces)
    if (e > b) out.push_back(slice(p, b, e));
}

struct PreTokenizer {
  enum Kind { kByteLevel, kSplit, kMetaspace } kind = kSplit;
  Pattern pattern;  // kSplit; kByteLevel with use_regex (GPT-2 pattern)
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool prefix_space = false;  // ByteLevel add_prefix_space
  bool use_regex = false;     // ByteLevel
  std::string replacement;    // Metaspace
  enum Prepend { kAlways, kFirst, kNever } prepend_scheme = kAlways;
  bool split = true;  // Metaspace

  void apply(std::vector<Piece>& pieces) const {
    std::vector<Piece> out;
    for (Piece& p : pieces) {
      switch (kind) {
        case kSplit:
          split_piece(p, pattern.find(p.text), behavior, invert, out);
          break;
        case kByteLevel: {
          if (prefix_space && !p.text.empty() && p.text[0] != ' ') prepend(p, " ");
          const size_t first = out.size();
          if (use_regex)
            split_piece(p, pattern.find(p.text), Behavior::kIsolated, false, out);
          else
            out.push_back(std::move(p));
          for (size_t i = first; i < out.size(); ++i) {
            Piece mapped;
            for (size_t j = 0; j < out[i].text.size(); ++j) {
              const std::string& c = byte_to_char()[static_cast<unsigned char>(out[i].text[j])];
              mapped.text += c;
              mapped.src.insert(mapped.src.end(), c.size(), out[i].src[j]);
            }
            out[i] = std::move(mapped);
          }
          break;
        }
        case kMetaspace: {
          Piece q = replace_ranges(p, find_literal(p.text, " "), replacement);
          const bool starts = q.text.compare(0, replacement.size(), replacement) == 0;
          if (!starts && !q.text.empty() &&
              (prepend_scheme == kAlways || (prepend_scheme == kFirst && q.src.front().begin == 0)))
            prepend(q, replacement);
          if (split)
            split_piece(q, find_literal(q.text, replacement), Behavior::kMergedWithNext, false,
                        out);
          else
            out.push_back(std::move(q));
          break;
        }
      }
    }
    pieces = std::move(out);
  }
};

Behavior read_behavior(const Reader& r, const json& v, const std::string& where) {
  const std::string b = r.str(v, "behavior", where, "Isolated");
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  r.fail(where + ".behavior", "unknown behavior \"" + b + "\"");
}

void read_pre_tokenizer(const Reader& r, const json& v, const std::string& where,
                        std::vector<PreTokenizer>& out) {
  const std::string type = r.type(v, where);
  PreTokenizer p;
  if (type == "Sequence") {
    const json* list = r.get(v, "pretokenizers");
    if (!list || !list->is_array()) r.fail(where + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < list->size(); ++i)
      read_pre_tokenizer(r, (*list)[i], str_cat(where, ".pretokenizers[", i, "]"), out);
    return;
  } else if (type == "ByteLevel") {
    static const auto gpt2 = std::make_shared<Regex>(kGpt2Pattern, "GPT-2 pattern");
    p.kind = PreTokenizer::kByteLevel;
    p.prefix_space = r.flag(v, "add_prefix_space", where, true);
    p.use_regex = r.flag(v, "use_regex", where, true);
    p.pattern.regex = gpt2;
  } else if (type == "Split") {
    p.pattern = read_pattern(r, v, where);
    p.behavior = read_behavior(r, v, where);
    p.invert = r.flag(v, "invert", where, false);
  } else if (type == "Metaspace") {
    p.kind = PreTokenizer::kMetaspace;
    const std::string rep = r.str(v, "replacement", where, "\xE2\x96\x81");
    if (rep.empty() || detail::utf8_valid_len(rep, 0) != rep.size())
      r.fail(where + ".replacement", "expected one character");
    p.replacement = rep;
    const std::string scheme =
        r.str(v, "prepend_scheme", where,
              r.flag(v, "add_prefix_space", where, true) ? "always" : "never");
    if (scheme == "always") {
      p.prepend_scheme = PreTokenizer::kAlways;
    } else if (scheme == "first") {
      p.prepend_scheme = PreTokenizer::kFirst;
    } else if (scheme == "never") {
      p.prepend_scheme = PreTokenizer::kNever;
    } else {
      r.fail(where + ".prepend_scheme", "unknown scheme \"" + scheme + "\"");
    }
    p.split = r.flag(v, "split", where, true);
  } else if (type == "Digits") {
    p.pattern.regex = std::make_shared<Regex>(
        r.flag(v, "individual_digits", where, false) ? R"(\p{N})" : R"(\p{N}+)", where);
  } else if (type == "Whitespace") {
    p.pattern.regex = std::make_shared<Regex>(R"(\w+|[^\w\s]+)", where);
    p.behavior = Behavior::kRemoved;
    p.invert = true;
  } else if (type == "WhitespaceSplit") {
    p.pattern.regex = std::make_shared<Regex>(R"(\s+)", where);
    p.behavior = Behavior::kRemoved;
  } else {
    r.fail(where + ".type", "unsupported pre_tokenizer \"" + type + "\"");
  }
  out.push_back(std::move(p));
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// ---- decoders ----------------------------------------------------------------------------------

struct Decoder {
  enum Kind {
    kByteLevel,
    kMetaspace,
    kReplace,
    kByteFallback,
    kFuse,
    kStrip,
    kBpeSuffix
  } kind = kFuse;
  Pattern pattern;
  std::string content;  // Replace content; Metaspace replacement; Strip char; BPEDecoder suffix
  bool prepend = true;  // Metaspace: a prefix was added (drop it from the first token)
  size_t start = 0, stop = 0;

  void apply(std::vector<std::string>& tokens) const {
    switch (kind) {
      case kByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) {
          std::string mapped;
          bool all = true;
          for (size_t i = 0; i < t.size() && all;) {
            const size_t len =
                std::min(utf8_lead_len(static_cast<unsigned char>(t[i])), t.size() - i);
            auto it = char_to_byte().find(t.substr(i, len));
            if (it == char_to_byte().end())
              all = false;
            else
              mapped += static_cast<char>(it->second);
            i += len;
          }
          bytes += all ? mapped : t;
        }
        tokens.assign(1, "");
        detail::append_utf8_lossy(tokens[0], bytes);
        break;
      }
      case kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          std::string out;
          const std::string& t = tokens[i];
          for (size_t pos = 0; pos < t.size();) {
            if (t.compare(pos, content.size(), content) == 0) {
              if (!(i == 0 && prepend)) out += ' ';
              pos += content.size();
            } else {
              out += t[pos++];
            }
          }
          tokens[i] = std::move(out);
        }
        break;
      case kReplace:
        for (std::string& t : tokens) {
          Piece p{t, std::vector<Src>(t.size(), Src{0, 0})};
          t = replace_ranges(p, pattern.find(t), content).text;
        }
        break;
      case kByteFallback: {
        std::vector<std::string> out;
        std::string bytes;
        size_t count = 0;
        const auto flush = [&] {
          if (count == 0) return;
          if (detail::utf8_first_invalid(bytes) == std::string::npos)
            out.push_back(bytes);
          else
            for (size_t i = 0; i < count; ++i) out.push_back("\xEF\xBF\xBD");
          bytes.clear();
          count = 0;
        };
        for (std::string& t : tokens) {
          // "<0xXX>" (Rust's u8::from_str_radix also takes "+X").
          int byte = -1;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
            const int hi = hex_digit(t[3]), lo = hex_digit(t[4]);
            if (hi >= 0 && lo >= 0) byte = hi * 16 + lo;
            if (t[3] == '+' && lo >= 0) byte = lo;
          }
          if (byte >= 0) {
            bytes += static_cast<char>(byte);
            ++count;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case kStrip:
        for (std::string& t : tokens) {
          size_t a = 0, b = t.size();
          for (size_t i = 0; i < start && t.compare(a, content.size(), content) == 0; ++i)
            a += content.size();
          for (size_t i = 0; i < stop && b >= a + content.size() &&
                             t.compare(b - content.size(), content.size(), content) == 0;
               ++i)
            b -= content.size();
          t = t.substr(a, b - a);
        }
        break;
      case kBpeSuffix:
        for (size_t i = 0; i < tokens.size(); ++i) {
          Piece p{tokens[i], std::vector<Src>(tokens[i].size(), Src{0, 0})};
          tokens[i] =
              replace_ranges(p, find_literal(tokens[i], content), i + 1 == tokens.size() ? "" : " ")
                  .text;
        }
        break;
    }
  }
};

void read_decoder(const Reader& r, const json& v, const std::string& where,
                  std::vector<Decoder>& out) {
  const std::string type = r.type(v, where);
  Decoder d;
  if (type == "Sequence") {
    const json* list = r.get(v, "decoders");
    if (!list || !list->is_array()) r.fail(where + ".decoders", "expected an array");
    for (size_t i = 0; i < list->size(); ++i)
      read_decoder(r, (*list)[i], str_cat(where, ".decoders[", i, "]"), out);
    return;
  } else if (type == "ByteLevel") {
    d.kind = Decoder::kByteLevel;
  } else if (type == "Metaspace") {
    d.kind = Decoder::kMetaspace;
    d.content = r.str(v, "replacement", where, "\xE2\x96\x81");
    if (d.content.empty()) r.fail(where + ".replacement", "expected one character");
    const std::string scheme =
        r.str(v, "prepend_scheme", where,
              r.flag(v, "add_prefix_space", where, true) ? "always" : "never");
    d.prepend = scheme != "never";
  } else if (type == "Replace") {
    d.kind = Decoder::kReplace;
    d.pattern = read_pattern(r, v, where);
    d.content = r.str(v, "content", where, "");
  } else if (type == "ByteFallback") {
    d.kind = Decoder::kByteFallback;
  } else if (type == "Fuse") {
    d.kind = Decoder::kFuse;
  } else if (type == "Strip") {
    d.kind = Decoder::kStrip;
    d.content = r.str(v, "content", where, " ");
    if (d.content.empty()) r.fail(where + ".content", "expected one character");
    const json* a = r.get(v, "start");
    const json* b = r.get(v, "stop");
    d.start = a ? static_cast<size_t>(r.integer(*a, where + ".start", 0, 1 << 20)) : 0;
    d.stop = b ? static_cast<size_t>(r.integer(*b, where + ".stop", 0, 1 << 20)) : 0;
  } else if (type == "BPEDecoder") {
    d.kind = Decoder::kBpeSuffix;
    d.content = r.str(v, "suffix", where, "</w>");
  } else {
    r.fail(where + ".type", "unsupported decoder \"" + type + "\"");
  }
  out.push_back(std::move(d));
}

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
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  std::vector<Decoder> decoders_;
  bool has_decoder_ = false;
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
  if (const json* v = r.get(root, "normalizer")) read_normalizer(r, *v, "normalizer", normalizers_);
  if (const json* v = r.get(root, "pre_tokenizer"))
    read_pre_tokenizer(r, *v, "pre_tokenizer", pre_tokenizers_);
  if (const json* v = r.get(root, "decoder")) {
    read_decoder(r, *v, "decoder", decoders_);
    has_decoder_ = true;
  }
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
      for (const Normalizer& n : normalizers_) n.apply(p);
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
  for (const Normalizer& n : normalizers_) n.apply(seg);
  for (const auto& s : split_added(seg.text, normalized_trie_, parse_special)) {
    if (s.literal >= 0) {
      out.push_back({added_[static_cast<size_t>(s.literal)].id, seg.src[s.begin].begin,
                     seg.src[s.end - 1].end});
      continue;
    }
    std::vector<Piece> pieces{slice(seg, s.begin, s.end)};
    for (const PreTokenizer& p : pre_tokenizers_) p.apply(pieces);
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
  if (!has_decoder_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (const Decoder& d : decoders_) d.apply(tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

}  // namespace

std::unique_ptr<TextTokenizer> load_tokenizer_json(std::string_view bytes,
                                                   const std::string& name) {
  return std::make_unique<HfBpeTokenizer>(bytes, name);
}

}  // namespace weft::data
