// SentencePiece .model files: a hand-written reader of the ModelProto protobuf wire format and
// the library's normalizer (including a model's precompiled character map), BPE, unigram
// (Viterbi, as EncodeOptimized), char and word models, byte fallback and decoding, following
// sentencepiece 0.1.97.
#include <algorithm>
#include <cctype>
#include <cfloat>
#include <cstring>
#include <queue>
#include <string>
#include <unordered_map>
#include <vector>

#include "weft/core/error.h"
#include "weft/data/text_tokenizer.h"

namespace weft::data {
namespace {

using weft::detail::str_cat;

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581
constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";
constexpr float kUnkPenalty = 10.0f;
constexpr size_t kMaxPieceSize = 8000;

enum PieceType {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6
};
enum ModelType { kUnigram = 1, kBpe = 2, kWord = 3, kChar = 4 };

// ---- protobuf wire format ----------------------------------------------------------------------

// Reads one message; errors name the file, the field path and the byte offset in the file.
class Wire {
 public:
  Wire(std::string_view data, size_t base, const std::string& name, std::string where)
      : data_(data), base_(base), name_(name), where_(std::move(where)) {}

  bool done() const { return pos_ >= data_.size(); }
  size_t offset() const { return base_ + pos_; }
  const std::string& where() const { return where_; }
  const std::string& name() const { return name_; }

  // The next field's number and wire type.
  std::pair<uint64_t, int> key() {
    const uint64_t k = varint("field key");
    const uint64_t field = k >> 3;
    WEFT_CHECK(field != 0, name_, ": ", where_, ": field number 0 at byte ", offset());
    return {field, static_cast<int>(k & 7)};
  }
  uint64_t varint(const std::string& field) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      WEFT_CHECK(pos_ < data_.size(), name_, ": ", where_, ".", field,
                 ": truncated varint at byte ", offset());
      const auto b = static_cast<unsigned char>(data_[pos_++]);
      if (shift < 64) v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    WEFT_FAIL(name_, ": ", where_, ".", field, ": varint longer than 10 bytes at byte ", offset());
  }
  std::string_view bytes(const std::string& field, size_t* start = nullptr) {
    const uint64_t len = varint(field);
    WEFT_CHECK(len <= data_.size() - pos_, name_, ": ", where_, ".", field, ": length ", len,
               " at byte ", offset(), " runs past the end (", data_.size() - pos_, " bytes left)");
    if (start) *start = base_ + pos_;
    std::string_view out = data_.substr(pos_, len);
    pos_ += len;
    return out;
  }
  uint32_t fixed32(const std::string& field) {
    WEFT_CHECK(data_.size() - pos_ >= 4, name_, ": ", where_, ".", field,
               ": truncated fixed32 at byte ", offset());
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(data_[pos_ + i]);
    pos_ += 4;
    return v;
  }
  void skip(uint64_t field, int wire_type) {
    const std::string f = str_cat("field ", field);
    switch (wire_type) {
      case 0:
        varint(f);
        break;
      case 1:
        WEFT_CHECK(data_.size() - pos_ >= 8, name_, ": ", where_, ".", f,
                   ": truncated fixed64 at byte ", offset());
        pos_ += 8;
        break;
      case 2:
        bytes(f);
        break;
      case 5:
        fixed32(f);
        break;
      default:
        WEFT_FAIL(name_, ": ", where_, ".", f, ": unsupported wire type ", wire_type, " at byte ",
                  offset());
    }
  }
  void expect(int wire_type, int want, const std::string& field) const {
    WEFT_CHECK(wire_type == want, name_, ": ", where_, ".", field, ": wire type ", wire_type,
               " (expected ", want, ") at byte ", offset());
  }

 private:
  std::string_view data_;
  size_t base_;
  size_t pos_ = 0;
  const std::string& name_;
  std::string where_;
};

struct SpPiece {
  std::string piece;
  float score = 0;
  int type = kNormal;
};

struct Spec {
  int model_type = kUnigram;
  bool byte_fallback = false, treat_ws_as_suffix = false, allow_ws_only_pieces = false;
  std::string unk_surface = " \xE2\x81\x87 ";
  std::string unk_piece = "<unk>", bos_piece = "<s>", eos_piece = "</s>", pad_piece = "<pad>";
  std::string charsmap;
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
};

void read_piece(Wire w, SpPiece& p) {
  while (!w.done()) {
    const auto [field, type] = w.key();
    if (field == 1) {
      w.expect(type, 2, "piece");
      p.piece = std::string(w.bytes("piece"));
    } else if (field == 2) {
      w.expect(type, 5, "score");
      const uint32_t bits = w.fixed32("score");
      std::memcpy(&p.score, &bits, sizeof(bits));
    } else if (field == 3) {
      w.expect(type, 0, "type");
      const uint64_t t = w.varint("type");
      WEFT_CHECK(t >= kNormal && t <= kByte, w.name(), ": ", w.where(),
                 ".type: unknown piece type ", t);
      p.type = static_cast<int>(t);
    } else {
      w.skip(field, type);
    }
  }
}

void read_trainer_spec(Wire w, Spec& s) {
  while (!w.done()) {
    const auto [field, type] = w.key();
    const auto flag = [&, type = type](const char* f) {
      w.expect(type, 0, f);
      return w.varint(f) != 0;
    };
    const auto text = [&, type = type](const char* f) {
      w.expect(type, 2, f);
      return std::string(w.bytes(f));
    };
    switch (field) {
      case 3: {
        w.expect(type, 0, "model_type");
        const uint64_t t = w.varint("model_type");
        WEFT_CHECK(t >= kUnigram && t <= kChar, w.name(), ": ", w.where(),
                   ".model_type: unknown model type ", t);
        s.model_type = static_cast<int>(t);
        break;
      }
      case 24:
        s.treat_ws_as_suffix = flag("treat_whitespace_as_suffix");
        break;
      case 26:
        s.allow_ws_only_pieces = flag("allow_whitespace_only_pieces");
        break;
      case 35:
        s.byte_fallback = flag("byte_fallback");
        break;
      case 44:
        s.unk_surface = text("unk_surface");
        break;
      case 45:
        s.unk_piece = text("unk_piece");
        break;
      case 46:
        s.bos_piece = text("bos_piece");
        break;
      case 47:
        s.eos_piece = text("eos_piece");
        break;
      case 48:
        s.pad_piece = text("pad_piece");
        break;
      default:
        w.skip(field, type);
    }
  }
}

void read_normalizer_spec(Wire w, Spec& s) {
  while (!w.done()) {
    const auto [field, type] = w.key();
    const auto flag = [&, type = type](const char* f) {
      w.expect(type, 0, f);
      return w.varint(f) != 0;
    };
    if (field == 2) {
      w.expect(type, 2, "precompiled_charsmap");
      s.charsmap = std::string(w.bytes("precompiled_charsmap"));
    } else if (field == 3) {
      s.add_dummy_prefix = flag("add_dummy_prefix");
    } else if (field == 4) {
      s.remove_extra_whitespaces = flag("remove_extra_whitespaces");
    } else if (field == 5) {
      s.escape_whitespaces = flag("escape_whitespaces");
    } else {
      w.skip(field, type);  // name, normalization_rule_tsv, ...
    }
  }
}

// ---- the precompiled character map (a darts-clone double array + normalized strings) -----------

class CharsMap {
 public:
  void load(std::string_view blob, const std::string& name) {
    if (blob.empty()) return;
    WEFT_CHECK(blob.size() > 4, name, ": normalizer_spec.precompiled_charsmap: blob too short");
    uint32_t trie_size = 0;
    for (int i = 3; i >= 0; --i) trie_size = (trie_size << 8) | static_cast<unsigned char>(blob[i]);
    WEFT_CHECK(trie_size <= blob.size() - 4, name,
               ": normalizer_spec.precompiled_charsmap: trie size ", trie_size,
               " exceeds the blob (", blob.size(), " bytes)");
    units_.resize(trie_size / 4);
    for (size_t i = 0; i < units_.size(); ++i) {
      uint32_t u = 0;
      for (int k = 3; k >= 0; --k) u = (u << 8) | static_cast<unsigned char>(blob[4 + 4 * i + k]);
      units_[i] = u;
    }
    normalized_ = std::string(blob.substr(4 + trie_size));
  }
  bool empty() const { return units_.empty(); }

  // Longest rule matching a prefix of s: {consumed bytes, replacement}; {0, ""} when none.
  std::pair<size_t, std::string_view> longest(std::string_view s) const {
    std::pair<size_t, std::string_view> best{0, {}};
    if (units_.empty()) return best;
    size_t id = 0;
    uint32_t unit = units_[0];
    id ^= offset(unit);
    for (size_t i = 0; i < s.size(); ++i) {
      const auto c = static_cast<unsigned char>(s[i]);
      id ^= c;
      if (id >= units_.size()) break;
      unit = units_[id];
      if ((unit & ((1u << 31) | 0xFF)) != c) break;  // label
      id ^= offset(unit);
      if (id >= units_.size()) break;
      if ((unit >> 8) & 1) {  // has leaf
        const uint32_t value = units_[id] & ((1u << 31) - 1);
        if (value < normalized_.size()) {
          const size_t end = normalized_.find('\0', value);
          best = {i + 1, std::string_view(normalized_)
                             .substr(value, (end == std::string::npos ? normalized_.size() : end) -
                                                value)};
        }
      }
    }
    return best;
  }

 private:
  static size_t offset(uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); }
  std::vector<uint32_t> units_;
  std::string normalized_;
};

// ---- the tokenizer -----------------------------------------------------------------------------

struct Src {
  uint32_t begin, end;
};

// Normalized text with, per byte, the source range of the input.
struct Normalized {
  std::string text;
  std::vector<Src> src;
};

struct Token {
  size_t begin, end;  // in Normalized::text
  int32_t id;
};

class SentencePieceTokenizer final : public TextTokenizer {
 public:
  SentencePieceTokenizer(std::string_view bytes, const std::string& name);

  std::vector<TokenOffset> encode_with_offsets(
      std::string_view text, bool parse_special,
      const std::vector<LiteralToken>& literals) const override;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  std::optional<int64_t> token_id(std::string_view token) const override {
    const int32_t id = find(token);
    return id < 0 ? std::nullopt : std::optional<int64_t>(id);
  }
  std::string token(int64_t id) const override { return piece(id).piece; }
  bool is_special(int64_t id) const override {
    if (id < 0 || id >= vocab_size()) return false;
    const int t = piece(id).type;
    return t == kControl || t == kUnknown;
  }

 private:
  const SpPiece& piece(int64_t id) const {
    WEFT_CHECK(id >= 0 && id < vocab_size(), name_, ": token id ", id, " is out of range [0, ",
               vocab_size(), ")");
    return pieces_[static_cast<size_t>(id)];
  }
  int32_t find(std::string_view s) const {  // exact lookup, -1 when absent
    const std::string k(s);
    if (auto it = reserved_.find(k); it != reserved_.end()) return it->second;
    if (auto it = normal_.find(k); it != normal_.end()) return it->second;
    return -1;
  }
  int32_t piece_to_id(std::string_view s) const {  // SentencePiece's PieceToId
    const int32_t id = find(s);
    return id < 0 ? unk_id_ : id;
  }
  std::pair<std::string_view, size_t> normalize_prefix(std::string_view s) const;
  Normalized normalize(std::string_view text, size_t base) const;
  std::vector<Token> encode_bpe(const std::string& s) const;
  std::vector<Token> encode_unigram(const std::string& s) const;
  std::vector<Token> encode_char_or_word(const std::string& s) const;
  void encode_segment(std::string_view text, size_t base, std::vector<TokenOffset>& out) const;

  std::string name_;
  Spec spec_;
  std::vector<SpPiece> pieces_;
  std::unordered_map<std::string, int32_t> normal_;    // NORMAL, USER_DEFINED, UNUSED
  std::unordered_map<std::string, int32_t> reserved_;  // CONTROL, UNKNOWN, BYTE
  int32_t unk_id_ = -1;
  int32_t byte_ids_[256];
  detail::LiteralTrie user_defined_, specials_, vocab_trie_;
  std::vector<int32_t> special_ids_;
  CharsMap charsmap_;
  float min_score_ = FLT_MAX, max_score_ = FLT_MIN;  // over NORMAL pieces, as SentencePiece
};

SentencePieceTokenizer::SentencePieceTokenizer(std::string_view bytes, const std::string& name)
    : name_(name) {
  Wire w(bytes, 0, name_, "ModelProto");
  while (!w.done()) {
    const auto [field, type] = w.key();
    if (field == 1) {
      w.expect(type, 2, "pieces");
      size_t start = 0;
      const std::string where = str_cat("pieces[", pieces_.size(), "]");
      std::string_view msg = w.bytes("pieces", &start);
      pieces_.emplace_back();
      read_piece(Wire(msg, start, name_, where), pieces_.back());
    } else if (field == 2 || field == 3) {
      const char* f = field == 2 ? "trainer_spec" : "normalizer_spec";
      w.expect(type, 2, f);
      size_t start = 0;
      std::string_view msg = w.bytes(f, &start);
      if (field == 2)
        read_trainer_spec(Wire(msg, start, name_, f), spec_);
      else
        read_normalizer_spec(Wire(msg, start, name_, f), spec_);
    } else {
      w.skip(field, type);
    }
  }
  WEFT_CHECK(!pieces_.empty(), name_,
             ": ModelProto.pieces: no pieces (not a SentencePiece model?)");
  WEFT_CHECK(pieces_.size() < (size_t{1} << 30), name_, ": too many pieces");
  WEFT_CHECK(!spec_.treat_ws_as_suffix, name_,
             ": trainer_spec.treat_whitespace_as_suffix is not supported");
  charsmap_.load(spec_.charsmap, name_);

  bool byte_found[256] = {};
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const SpPiece& p = pieces_[i];
    const auto id = static_cast<int32_t>(i);
    const std::string where = str_cat(name_, ": pieces[", i, "]");
    WEFT_CHECK(!p.piece.empty(), where, ".piece: empty");
    WEFT_CHECK(p.piece.size() < kMaxPieceSize, where, ".piece: too long (", p.piece.size(),
               " bytes)");
    WEFT_CHECK(p.piece.find('\0') == std::string::npos, where, ".piece: contains a NUL byte");
    const bool normal = p.type == kNormal || p.type == kUserDefined || p.type == kUnused;
    auto [it, fresh] = (normal ? normal_ : reserved_).emplace(p.piece, id);
    WEFT_CHECK(fresh, where, ".piece: \"", p.piece, "\" is already pieces[", it->second, "]");
    if (normal) vocab_trie_.add(p.piece, id);
    if (p.type == kUserDefined) user_defined_.add(p.piece, id);
    if (p.type == kNormal) {
      min_score_ = std::min(min_score_, p.score);
      max_score_ = std::max(max_score_, p.score);
    }
    if (p.type == kUnknown) {
      WEFT_CHECK(unk_id_ < 0, where, ": a second UNKNOWN piece (the first is pieces[", unk_id_,
                 "])");
      unk_id_ = id;
    }
    if (p.type == kControl || p.type == kUnknown) {
      specials_.add(p.piece, static_cast<int32_t>(special_ids_.size()));
      special_ids_.push_back(id);
    }
    if (p.type == kByte) {
      WEFT_CHECK(spec_.byte_fallback, where, ": byte piece \"", p.piece,
                 "\" although trainer_spec.byte_fallback is false");
      int b = -1;
      if (p.piece.size() == 6 && p.piece.compare(0, 3, "<0x") == 0 && p.piece[5] == '>') {
        const std::string hex = p.piece.substr(3, 2);
        if (std::isxdigit(static_cast<unsigned char>(hex[0])) &&
            std::isxdigit(static_cast<unsigned char>(hex[1])) &&
            !std::islower(static_cast<unsigned char>(hex[0])) &&
            !std::islower(static_cast<unsigned char>(hex[1])))
          b = std::stoi(hex, nullptr, 16);
      }
      WEFT_CHECK(b >= 0, where, ": invalid byte piece \"", p.piece, "\" (expected <0xXX>)");
      byte_found[b] = true;
      byte_ids_[b] = id;
    }
  }
  WEFT_CHECK(unk_id_ >= 0, name_, ": pieces: no UNKNOWN piece");
  if (spec_.byte_fallback)
    for (int b = 0; b < 256; ++b)
      WEFT_CHECK(byte_found[b], name_,
                 ": trainer_spec.byte_fallback is set but there is no byte piece for byte ", b);

  const auto control_id = [&](const std::string& s) -> std::optional<int64_t> {
    const int32_t id = find(s);
    if (id >= 0 && pieces_[static_cast<size_t>(id)].type == kControl) return id;
    return std::nullopt;
  };
  bos_id = control_id(spec_.bos_piece);
  eos_id = control_id(spec_.eos_piece);
  pad_id = control_id(spec_.pad_piece);
  add_bos = bos_id.has_value();
}

std::pair<std::string_view, size_t> SentencePieceTokenizer::normalize_prefix(
    std::string_view s) const {
  if (const auto [len, v] = user_defined_.longest_at(s, 0); len > 0) return {s.substr(0, len), len};
  if (const auto [len, rep] = charsmap_.longest(s); len > 0) return {rep, len};
  const size_t len = detail::utf8_valid_len(s, 0);
  if (len == 0) return {kReplacementChar, 1};
  return {s.substr(0, len), len};
}

Normalized SentencePieceTokenizer::normalize(std::string_view input, size_t base) const {
  Normalized out;
  size_t consumed = 0;
  if (spec_.remove_extra_whitespaces) {
    while (!input.empty()) {
      const auto [sp, len] = normalize_prefix(input);
      if (sp != " ") break;
      input.remove_prefix(len);
      consumed += len;
    }
  }
  if (input.empty()) return out;
  const auto at = [&](size_t a, size_t b) {
    return Src{static_cast<uint32_t>(base + a), static_cast<uint32_t>(base + b)};
  };
  const std::string_view space = spec_.escape_whitespaces ? kSpaceSymbol : " ";
  if (spec_.add_dummy_prefix) {
    out.text += space;
    out.src.insert(out.src.end(), space.size(), at(consumed, consumed));
  }
  bool is_prev_space = spec_.remove_extra_whitespaces;
  while (!input.empty()) {
    auto [sp, len] = normalize_prefix(input);
    while (is_prev_space && !sp.empty() && sp.front() == ' ') sp.remove_prefix(1);
    if (!sp.empty()) {
      for (const char c : sp) {
        if (spec_.escape_whitespaces && c == ' ') {
          out.text += kSpaceSymbol;
          out.src.insert(out.src.end(), kSpaceSymbol.size(), at(consumed, consumed + len));
        } else {
          out.text += c;
          out.src.push_back(at(consumed, consumed + len));
        }
      }
      is_prev_space = sp.back() == ' ';
    }
    consumed += len;
    input.remove_prefix(len);
    if (!spec_.remove_extra_whitespaces) is_prev_space = false;
  }
  if (spec_.remove_extra_whitespaces) {
    while (out.text.size() >= space.size() &&
           out.text.compare(out.text.size() - space.size(), space.size(), space) == 0) {
      out.text.resize(out.text.size() - space.size());
      out.src.resize(out.text.size());
    }
  }
  return out;
}

std::vector<Token> SentencePieceTokenizer::encode_bpe(const std::string& s) const {
  struct Symbol {
    int32_t prev, next;
    size_t begin, len;
    bool freeze;
  };
  struct Pair {
    int32_t left, right;
    float score;
    size_t size;
    bool operator<(const Pair& o) const {  // priority_queue top: highest score, then leftmost
      return score < o.score || (score == o.score && left > o.left);
    }
  };
  std::vector<Symbol> symbols;
  for (size_t pos = 0; pos < s.size();) {
    auto [len, v] = user_defined_.longest_at(s, pos);
    const bool freeze = len > 0;
    if (!freeze)
      len = std::min(detail::utf8_lead_len(static_cast<unsigned char>(s[pos])), s.size() - pos);
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({n - 1, pos + len < s.size() ? n + 1 : -1, pos, len, freeze});
    pos += len;
  }
  std::priority_queue<Pair> agenda;
  std::unordered_map<std::string, std::pair<std::string, std::string>> rev_merge;
  const auto view = [&](const Symbol& x) { return std::string_view(s).substr(x.begin, x.len); };
  const auto maybe_add = [&](int32_t left, int32_t right) {
    if (left == -1 || right == -1) return;
    const Symbol& l = symbols[static_cast<size_t>(left)];
    const Symbol& r = symbols[static_cast<size_t>(right)];
    if (l.freeze || r.freeze) return;
    const std::string_view merged = std::string_view(s).substr(l.begin, l.len + r.len);
    auto it = normal_.find(std::string(merged));
    if (it == normal_.end()) return;
    const SpPiece& p = pieces_[static_cast<size_t>(it->second)];
    agenda.push({left, right, p.score, merged.size()});
    if (p.type == kUnused)
      rev_merge[std::string(merged)] = {std::string(view(l)), std::string(view(r))};
  };
  for (size_t i = 1; i < symbols.size(); ++i)
    maybe_add(static_cast<int32_t>(i - 1), static_cast<int32_t>(i));
  while (!agenda.empty()) {
    const Pair top = agenda.top();
    agenda.pop();
    Symbol& l = symbols[static_cast<size_t>(top.left)];
    Symbol& r = symbols[static_cast<size_t>(top.right)];
    if (l.len == 0 || r.len == 0 || l.len + r.len != top.size) continue;
    l.len += r.len;
    l.next = r.next;
    if (r.next >= 0) symbols[static_cast<size_t>(r.next)].prev = top.left;
    r.len = 0;
    maybe_add(l.prev, top.left);
    maybe_add(top.left, l.next);
  }
  std::vector<Token> out;
  if (symbols.empty()) return out;
  // Resegments UNUSED pieces into the pieces they were merged from.
  std::vector<std::pair<size_t, size_t>> stack;
  for (int32_t i = 0; i != -1; i = symbols[static_cast<size_t>(i)].next) {
    stack.emplace_back(symbols[static_cast<size_t>(i)].begin, symbols[static_cast<size_t>(i)].len);
    while (!stack.empty()) {
      const auto [b, len] = stack.back();
      stack.pop_back();
      const std::string w = s.substr(b, len);
      const int32_t id = piece_to_id(w);
      auto it =
          pieces_[static_cast<size_t>(id)].type == kUnused ? rev_merge.find(w) : rev_merge.end();
      if (it == rev_merge.end()) {
        out.push_back({b, b + len, id});
        continue;
      }
      const size_t left = it->second.first.size();
      stack.emplace_back(b + left, len - left);  // right half, popped second
      stack.emplace_back(b, left);
    }
  }
  return out;
}

std::vector<Token> SentencePieceTokenizer::encode_unigram(const std::string& s) const {
  struct Node {
    int32_t id = -1;
    float score = 0;
    int64_t starts_at = -1;
  };
  const size_t size = s.size();
  const float unk_score = min_score_ - kUnkPenalty;
  std::vector<Node> best(size + 1);
  std::vector<std::pair<size_t, int32_t>> matches;
  for (size_t starts_at = 0; starts_at < size;) {
    const float score_here = best[starts_at].score;
    const size_t mblen =
        std::min(detail::utf8_lead_len(static_cast<unsigned char>(s[starts_at])), size - starts_at);
    bool has_single_node = false;
    vocab_trie_.prefixes_at(s, starts_at, matches);
    for (const auto& [length, id] : matches) {
      const SpPiece& p = pieces_[static_cast<size_t>(id)];
      if (p.type == kUnused) continue;
      Node& target = best[starts_at + length];
      // Same mixed float/double arithmetic as SentencePiece (ties must break the same way).
      const double score = p.type == kUserDefined ? (length * max_score_ - 0.1) : p.score;
      const double candidate = score + score_here;
      if (target.starts_at == -1 || candidate > target.score) {
        target.score = static_cast<float>(candidate);
        target.starts_at = static_cast<int64_t>(starts_at);
        target.id = id;
      }
      if (length == mblen) has_single_node = true;
    }
    if (!has_single_node) {
      Node& target = best[starts_at + mblen];
      const float candidate = unk_score + score_here;
      if (target.starts_at == -1 || candidate > target.score) {
        target.score = candidate;
        target.starts_at = static_cast<int64_t>(starts_at);
        target.id = unk_id_;
      }
    }
    starts_at += mblen;
  }
  std::vector<Token> out;
  for (size_t end = size; end > 0;) {
    const Node& n = best[end];
    WEFT_ASSERT(n.starts_at >= 0 && static_cast<size_t>(n.starts_at) < end);
    out.push_back({static_cast<size_t>(n.starts_at), end, n.id});
    end = static_cast<size_t>(n.starts_at);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<Token> SentencePieceTokenizer::encode_char_or_word(const std::string& s) const {
  std::vector<Token> out;
  if (spec_.model_type == kChar) {
    for (size_t pos = 0; pos < s.size();) {
      size_t len = user_defined_.longest_at(s, pos).first;
      if (len == 0)
        len = std::min(detail::utf8_lead_len(static_cast<unsigned char>(s[pos])), s.size() - pos);
      out.push_back({pos, pos + len, piece_to_id(s.substr(pos, len))});
      pos += len;
    }
    return out;
  }
  // Word model: SplitIntoWords (a word starts at each space symbol).
  bool in_ws = false;
  for (size_t pos = 0; pos < s.size();) {
    const size_t len =
        std::min(detail::utf8_lead_len(static_cast<unsigned char>(s[pos])), s.size() - pos);
    const bool is_ws = s.compare(pos, len, kSpaceSymbol) == 0;
    if (pos == 0 || (is_ws && (!in_ws || !spec_.allow_ws_only_pieces))) {
      out.push_back({pos, pos, 0});
      in_ws = true;
    }
    if (in_ws && !is_ws) in_ws = false;
    out.back().end += len;
    pos += len;
  }
  for (Token& t : out) t.id = piece_to_id(s.substr(t.begin, t.end - t.begin));
  return out;
}

void SentencePieceTokenizer::encode_segment(std::string_view text, size_t base,
                                            std::vector<TokenOffset>& out) const {
  const Normalized n = normalize(text, base);
  if (n.text.empty()) return;
  const std::vector<Token> tokens = spec_.model_type == kBpe       ? encode_bpe(n.text)
                                    : spec_.model_type == kUnigram ? encode_unigram(n.text)
                                                                   : encode_char_or_word(n.text);
  bool prev_unk = false;
  for (const Token& t : tokens) {
    const bool unk = t.id == unk_id_;
    const int64_t b = n.src[t.begin].begin, e = n.src[t.end - 1].end;
    if (unk && spec_.byte_fallback) {
      for (size_t i = t.begin; i < t.end; ++i)
        out.push_back(
            {byte_ids_[static_cast<unsigned char>(n.text[i])], n.src[i].begin, n.src[i].end});
    } else if (unk && prev_unk) {
      out.back().end = e;  // consecutive unknowns become one <unk>
    } else {
      out.push_back({t.id, b, e});
    }
    prev_unk = unk;
  }
}

std::vector<TokenOffset> SentencePieceTokenizer::encode_with_offsets(
    std::string_view text, bool parse_special, const std::vector<LiteralToken>& literals) const {
  WEFT_CHECK(text.size() < (size_t{1} << 31), name_, ": text too long (", text.size(), " bytes)");
  std::vector<TokenOffset> out;
  for (const auto& span : detail::split_on_literals(text, literals)) {
    const auto b = static_cast<int64_t>(span.begin), e = static_cast<int64_t>(span.end);
    if (span.literal >= 0) {
      out.push_back({literals[static_cast<size_t>(span.literal)].id, b, e});
      continue;
    }
    const std::string_view part = text.substr(span.begin, span.end - span.begin);
    if (!parse_special || specials_.empty()) {
      encode_segment(part, span.begin, out);
      continue;
    }
    size_t start = 0;
    for (size_t pos = 0; pos < part.size();) {
      const auto [len, index] = specials_.longest_at(part, pos);
      if (len == 0) {
        ++pos;
        continue;
      }
      if (start < pos) encode_segment(part.substr(start, pos - start), span.begin + start, out);
      out.push_back({special_ids_[static_cast<size_t>(index)], b + static_cast<int64_t>(pos),
                     b + static_cast<int64_t>(pos + len)});
      pos += len;
      start = pos;
    }
    if (start < part.size()) encode_segment(part.substr(start), span.begin + start, out);
  }
  return out;
}

std::string SentencePieceTokenizer::decode(const std::vector<int64_t>& ids,
                                           bool skip_special) const {
  std::string out, bytes;
  bool first = true;  // no visible piece yet: a leading "▁" is dropped
  const auto flush = [&] {
    for (size_t i = 0; i < bytes.size();) {
      const size_t len = detail::utf8_valid_len(bytes, i);
      if (len == 0) {
        out += kReplacementChar;
        ++i;
      } else {
        out.append(bytes, i, len);
        i += len;
      }
    }
    bytes.clear();
  };
  for (const int64_t id : ids) {
    const SpPiece& p = piece(id);
    if (p.type == kByte) {
      bytes += static_cast<char>(std::stoi(p.piece.substr(3, 2), nullptr, 16));
      first = false;
      continue;
    }
    flush();
    if (p.type == kControl) continue;
    if (p.type == kUnknown) {
      if (skip_special) continue;
      out += spec_.unk_surface;
      first = false;
      continue;
    }
    std::string_view w = p.piece;
    if (first && w.compare(0, kSpaceSymbol.size(), kSpaceSymbol) == 0)
      w.remove_prefix(kSpaceSymbol.size());
    first = false;
    for (size_t pos = 0; pos < w.size();) {
      if (w.compare(pos, kSpaceSymbol.size(), kSpaceSymbol) == 0) {
        out += ' ';
        pos += kSpaceSymbol.size();
      } else {
        out += w[pos++];
      }
    }
  }
  flush();
  return out;
}

}  // namespace

std::unique_ptr<TextTokenizer> load_sentencepiece(std::string_view bytes, const std::string& name) {
  return std::make_unique<SentencePieceTokenizer>(bytes, name);
}

}  // namespace weft::data
