// Tokenizer: word-level vocabulary for the built-in datasets. Ids are fixed by construction:
// 0 <pad>, 1 <bos>, 2 <eos>, then one placeholder token <NAME> per encoder (spec order), then the
// dataset words in the order given. Text is split on whitespace; every word must be known.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "weft/core/spec.h"

namespace weft::data {

class Tokenizer {
 public:
  // placeholder_names: encoder names (spec order); words: the dataset vocabulary, no duplicates.
  Tokenizer(const std::vector<std::string>& placeholder_names,
            const std::vector<std::string>& words);

  // The tokenizer of the built-in shapes dataset for this model (audio words iff the model has
  // a whisper encoder).
  static Tokenizer for_shapes(const ModelSpec& model);

  int64_t vocab_size() const { return static_cast<int64_t>(id_to_token_.size()); }
  int64_t pad_id() const { return 0; }
  int64_t bos_id() const { return 1; }
  int64_t eos_id() const { return 2; }
  int64_t num_placeholders() const { return num_placeholders_; }
  // Id of the placeholder token of encoder `encoder` (index into ModelSpec::encoders).
  int64_t placeholder_id(int encoder) const;
  // True for <pad>, <bos>, <eos> and placeholder tokens.
  bool is_special(int64_t id) const { return id >= 0 && id < kNumSpecial + num_placeholders_; }
  // The token's string (<pad>, <NAME>, or the word). Out-of-range id is an Error.
  const std::string& token(int64_t id) const;

  // Words only (special and placeholder tokens are not accepted as text). Unknown word: Error.
  std::vector<int64_t> encode(const std::string& text) const;
  // Words joined by single spaces; special and placeholder tokens are skipped; stops at <eos>.
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  static constexpr int64_t kNumSpecial = 3;

  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int64_t> word_to_id_;
  int64_t num_placeholders_ = 0;
};

}  // namespace weft::data
