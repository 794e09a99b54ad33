// TextTokenizer: the tokenizers real checkpoints ship, loaded from their own files with no
// conversion step. Two formats:
//   - Hugging Face tokenizer.json with a BPE model (GPT-2 / Llama-3 / Qwen2 byte-level BPE, and
//     Llama-2 / Mistral style BPE with byte fallback), encoded like the `tokenizers` library:
//     added tokens, normalizer, pre-tokenizer, BPE merges by rank, decoder.
//   - SentencePiece .model files (ModelProto, BPE / unigram / char / word models), encoded like
//     the `sentencepiece` library.
// Plain C++ (no LibTorch), so that the loaders can be fuzzed on their own.
//
// Limits and deliberate differences from the reference libraries (ICU is not linked):
//   - tokenizer.json: model BPE only (not WordPiece / Unigram / WordLevel). Normalizers NFC /
//     NFD / NFKC / NFKD are the identity (text already in that form, i.e. almost all text,
//     encodes identically); Lowercase lowercases ASCII only; Precompiled is not supported.
//     Pre-tokenizers: ByteLevel, Split, Metaspace, Digits, Whitespace, WhitespaceSplit,
//     Sequence. Decoders: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, BPEDecoder,
//     Sequence. Anything else is a weft::Error naming the field. Text must be valid UTF-8.
//     BPE dropout is ignored (encoding is deterministic).
//   - SentencePiece: a model's precompiled normalization map (nmt_nfkc models) is applied
//     exactly; malformed UTF-8 becomes U+FFFD as in the library; decoding follows 0.1.97.
//     treat_whitespace_as_suffix models are rejected.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace weft::data {

// One token of TextTokenizer::encode_with_offsets(): its id and the bytes [begin, end) of the
// input text it stands for. A token made only of text the tokenizer inserted (e.g. a lone
// SentencePiece dummy-prefix "▁") has begin == end.
struct TokenOffset {
  int64_t id = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// A literal string found in the text before anything else and emitted as the single token `id`
// (chat markers such as "<image>"). It splits the text exactly like a special token does.
struct LiteralToken {
  std::string text;
  int64_t id = 0;
};

// A text tokenizer loaded from a file. Thread-safe after construction (const methods only; the
// BPE word cache is internally synchronised).
class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;

  // Encodes text. parse_special: special tokens written literally in the text (e.g.
  // "<|im_start|>", "<s>", "<image>" when the file declares it special) become their ids;
  // otherwise they are ordinary text. Non-special added tokens (tokenizer.json) and
  // user-defined pieces (SentencePiece) are always matched whole, as in the reference libraries.
  // No BOS/EOS is added. Text around a special token is encoded as a separate segment, as the
  // `tokenizers` library does; for SentencePiece (whose library never parses special tokens)
  // each segment then gets its own dummy prefix, like HF's "legacy" Llama tokenizers and Meta's
  // Llama-2 reference code. With parse_special = false SentencePiece encodes exactly as the
  // library.
  // (Virtual with a default that drops the offsets of encode_with_offsets().)
  virtual std::vector<int64_t> encode(std::string_view text, bool parse_special = true) const;

  // encode() with the source bytes of every token. `literals` are matched first (longest first)
  // and take precedence over added/special tokens.
  virtual std::vector<TokenOffset> encode_with_offsets(
      std::string_view text, bool parse_special = true,
      const std::vector<LiteralToken>& literals = {}) const = 0;

  // Decodes ids (out-of-range id -> weft::Error). skip_special drops special tokens.
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special = false) const = 0;
  virtual int64_t vocab_size() const = 0;  // largest id + 1, added tokens included
  // Exact vocabulary / added-token lookup.
  virtual std::optional<int64_t> token_id(std::string_view token) const = 0;
  virtual std::string token(int64_t id) const = 0;  // out-of-range id -> weft::Error
  virtual bool is_special(int64_t id) const = 0;

  // From the file: tokenizer.json post_processor (TemplateProcessing / RobertaProcessing /
  // BertProcessing special tokens), then tokenizer_config.json beside it (bos_token, eos_token,
  // pad_token, add_bos_token, add_eos_token); SentencePiece: the <s>, </s>, <pad> pieces (as
  // the trainer_spec names them) when they are control pieces.
  std::optional<int64_t> bos_id, eos_id, pad_id;
  // Whether the model was trained with BOS / EOS added around each text (post_processor
  // template; SentencePiece: BOS yes, EOS no, as Llama-2). Informational: encode() never adds
  // them; encode_chat() adds BOS when add_bos is set.
  bool add_bos = false;
  bool add_eos = false;
};

// Dispatches on the file: *.json -> tokenizer.json BPE; otherwise a SentencePiece model proto.
// A directory means "<dir>/tokenizer.json, else <dir>/tokenizer.model". For a tokenizer.json,
// tokenizer_config.json in the same directory is read when present. Errors name the file and
// what is wrong (field, index).
std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& path);
// Same from bytes (for the fuzzer and tests); `name` is used in messages.
std::unique_ptr<TextTokenizer> load_tokenizer_json(std::string_view bytes, const std::string& name);
std::unique_ptr<TextTokenizer> load_sentencepiece(std::string_view bytes, const std::string& name);
// Applies a tokenizer_config.json (bytes) to a loaded tokenizer: bos/eos/pad tokens (a string or
// an {"content": ...} object) and add_bos_token / add_eos_token. An unknown token is an error.
void apply_tokenizer_config(TextTokenizer& tok, std::string_view bytes, const std::string& name);

namespace detail {

// Internal helpers shared by the two loaders (text_tokenizer.cpp).

// Byte length of the UTF-8 character starting with `lead` as SentencePiece counts it (from the
// lead byte alone: 1 for ASCII and stray continuation bytes, 2, 3 or 4).
size_t utf8_lead_len(unsigned char lead);
// Length of the valid UTF-8 character at s[pos], or 0 when the bytes there are malformed.
size_t utf8_valid_len(std::string_view s, size_t pos);
// Offset of the first malformed UTF-8 byte in s, or npos.
size_t utf8_first_invalid(std::string_view s);
void append_utf8(std::string& out, uint32_t code_point);
// Appends bytes, replacing each maximal malformed subsequence by U+FFFD (Rust's
// String::from_utf8_lossy, which Hugging Face decoders use).
void append_utf8_lossy(std::string& out, std::string_view bytes);

// A set of literal byte strings for leftmost-longest matching (a byte trie).
class LiteralTrie {
 public:
  // Adds s (non-empty) with a value >= 0; adding s again replaces its value.
  void add(std::string_view s, int32_t value);
  // The longest string that starts at text[pos]: {length, value}, or {0, -1}.
  std::pair<size_t, int32_t> longest_at(std::string_view text, size_t pos) const;
  // Every string that starts at text[pos], shortest first: {length, value} pairs into out.
  void prefixes_at(std::string_view text, size_t pos,
                   std::vector<std::pair<size_t, int32_t>>& out) const;
  bool empty() const { return nodes_.size() <= 1; }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;  // sorted by byte
    int32_t value = -1;
  };
  std::vector<Node> nodes_{Node{}};
  // Calls visit(length, value) for every string starting at text[pos], shortest first.
  template <typename Visit>
  void walk(std::string_view text, size_t pos, Visit&& visit) const;
};

// A span of the text: [begin, end), plus the literal index when it is a literal match (-1 for
// ordinary text).
struct TextSpan {
  size_t begin = 0;
  size_t end = 0;
  int32_t literal = -1;
};
// Splits text into ordinary spans and matches of the literals (leftmost-longest), in order.
// Empty ordinary spans are left out.
std::vector<TextSpan> split_on_literals(std::string_view text,
                                        const std::vector<LiteralToken>& literals);

}  // namespace detail
}  // namespace weft::data
