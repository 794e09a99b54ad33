// Builds small byte-level BPE tokenizers in the Hugging Face tokenizer.json format (GPT-2 byte
// alphabet, ByteLevel pre-tokenizer and decoder): for generated examples and test fixtures.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace weft::data {

// A tokenizer.json whose merges spell every word of `words` (ASCII letters; alone and after a
// space) as one token; any other text falls back to byte tokens. `special` become ids 0, 1, ...
// (added, special tokens); the 256 byte symbols follow, then the merged words.
nlohmann::json byte_level_bpe(const std::set<std::string>& words,
                              const std::vector<std::string>& special);

}  // namespace weft::data
