// Internal to the tokenizer.json BPE tokenizer (bpe_tokenizer.cpp): the text pipeline around the
// BPE model, following Hugging Face `tokenizers` — normalizers (Replace, Prepend, Append,
// Lowercase, Strip, Sequence), pre-tokenizers (ByteLevel, Split, Metaspace, Digits, Sequence)
// and decoders (ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, BPEDecoder, Sequence),
// the PCRE2 patterns they use, and field access into the file with errors naming the field.
//
// Text is carried through the pipeline as a Piece: bytes plus, per byte, the range of the
// original text it came from, so every token knows its source bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weft/core/error.h"

namespace weft::data::tokenizer_json {

using json = nlohmann::json;

// A compiled pattern (UTF + Unicode properties). Matching is thread-safe.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where);  // throws naming `where`
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches [begin, end) in s (valid UTF-8), left to right; after an empty match
  // the search resumes one character further (as Oniguruma's find_iter).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;

 private:
  void* code_ = nullptr;  // pcre2_code
  bool jit_ = false;
};

struct Src {
  uint32_t begin, end;
};

struct Piece {
  std::string text;
  std::vector<Src> src;  // per byte of text
};

Piece slice(const Piece& p, size_t a, size_t b);  // bytes [a, b)
// Bytes of Unicode white space at the start / end of s.
size_t leading_space(std::string_view s);
size_t trailing_space(std::string_view s);

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
  int64_t integer(const json& v, const std::string& where, int64_t lo, int64_t hi) const;
  // The "type" of an object; `where` nested too deeply (hostile Sequence nesting) is an error.
  std::string type(const json& v, const std::string& where) const;
};

struct Normalizer;
struct PreTokenizer;
struct Decoder;

// The normalizer, pre-tokenizer and decoder chains of one tokenizer.json.
class TextPipeline {
 public:
  TextPipeline();
  ~TextPipeline();
  // From the file's top-level "normalizer", "pre_tokenizer" and "decoder" (each optional).
  void read(const Reader& r, const json& root);
  void normalize(Piece& p) const;
  void pre_tokenize(std::vector<Piece>& pieces) const;
  // Tokens to text pieces in place; false when the file has no decoder (nothing was done).
  bool decode(std::vector<std::string>& tokens) const;

 private:
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  std::vector<Decoder> decoders_;
  bool has_decoder_ = false;
};

}  // namespace weft::data::tokenizer_json
