// The text pipeline of a tokenizer.json around its BPE model (tokenizer_json.h): PCRE2 patterns,
// normalizers, pre-tokenizers and decoders, as Hugging Face `tokenizers` runs them.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "weft/data/tokenizer_json.h"

#include <pcre2.h>

#include <algorithm>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "weft/core/error.h"
#include "weft/data/text_tokenizer.h"

namespace weft::data::tokenizer_json {

using detail::utf8_lead_len;
using weft::detail::str_cat;

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- PCRE2 -------------------------------------------------------------------------------------

namespace {
pcre2_code* as_code(void* p) { return static_cast<pcre2_code*>(p); }
}  // namespace

Regex::Regex(const std::string& pattern, const std::string& where) {
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  pcre2_code* const code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                    PCRE2_UTF | PCRE2_UCP, &err, &err_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    WEFT_FAIL(where, ": invalid regex at offset ", err_offset, ": ", reinterpret_cast<char*>(msg));
  }
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(as_code(code_)); }

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  pcre2_code* const code = as_code(code_);
  std::vector<std::pair<size_t, size_t>> out;
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
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
    int rc = pcre2_match(code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md.get(), context.get());
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && jit_)
      rc = pcre2_match(code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md.get(),
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

// ---- text with source offsets ------------------------------------------------------------------

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

int64_t Reader::integer(const json& v, const std::string& where, int64_t lo, int64_t hi) const {
  if (!v.is_number_integer()) fail(where, "expected an integer");
  const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)
                        ? INT64_MAX
                        : v.get<int64_t>();
  if (x < lo || x > hi) fail(where, str_cat(x, " is out of range [", lo, ", ", hi, "]"));
  return x;
}

std::string Reader::type(const json& v, const std::string& where) const {
  object(v, where);
  // `where` names the path: one '[' per level of Sequence nesting. Bounded, so that a hostile
  // file cannot exhaust the stack.
  if (std::count(where.begin(), where.end(), '[') > 16) fail(where, "nested too deeply");
  const json* t = get(v, "type");
  if (!t) fail(where, "missing \"type\"");
  return str(*t, where + ".type");
}

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

// ---- the pipeline ------------------------------------------------------------------------------

TextPipeline::TextPipeline() = default;
TextPipeline::~TextPipeline() = default;

void TextPipeline::read(const Reader& r, const json& root) {
  if (const json* v = r.get(root, "normalizer")) read_normalizer(r, *v, "normalizer", normalizers_);
  if (const json* v = r.get(root, "pre_tokenizer"))
    read_pre_tokenizer(r, *v, "pre_tokenizer", pre_tokenizers_);
  if (const json* v = r.get(root, "decoder")) {
    read_decoder(r, *v, "decoder", decoders_);
    has_decoder_ = true;
  }
}

void TextPipeline::normalize(Piece& p) const {
  for (const Normalizer& n : normalizers_) n.apply(p);
}

void TextPipeline::pre_tokenize(std::vector<Piece>& pieces) const {
  for (const PreTokenizer& p : pre_tokenizers_) p.apply(pieces);
}

bool TextPipeline::decode(std::vector<std::string>& tokens) const {
  if (!has_decoder_) return false;
  for (const Decoder& d : decoders_) d.apply(tokens);
  return true;
}

}  // namespace weft::data::tokenizer_json
