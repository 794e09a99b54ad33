#include "weft/data/bpe_builder.h"

#include <cctype>

namespace weft::data {

using json = nlohmann::json;

namespace {

// GPT-2's byte -> printable character map (bytes_to_unicode), as UTF-8 strings.
std::vector<std::string> byte_symbols() {
  std::vector<std::string> out(256);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    const int cp = printable ? b : 256 + extra++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    out[b] = s;
  }
  return out;
}

}  // namespace

json byte_level_bpe(const std::set<std::string>& words, const std::vector<std::string>& special) {
  const std::vector<std::string> sym = byte_symbols();
  json vocab = json::object();
  int64_t next = 0;
  for (const std::string& s : special) vocab[s] = next++;
  for (int b = 0; b < 256; ++b) vocab[sym[b]] = next++;
  json merges = json::array();
  for (const std::string& w : words)
    for (const std::string& word : {w, sym[' '] + w}) {
      // Left-to-right merges: "Ġ"+"r" -> "Ġr", "Ġr"+"e" -> "Ġre", ...
      std::string left = word.rfind(sym[' '], 0) == 0 ? sym[' '] : sym[static_cast<uint8_t>(w[0])];
      const size_t start = word.rfind(sym[' '], 0) == 0 ? 0 : 1;
      for (size_t i = start; i < w.size(); ++i) {
        const std::string right = sym[static_cast<uint8_t>(w[i])];
        const std::string merged = left + right;
        if (!vocab.contains(merged)) {
          merges.push_back(left + " " + right);
          vocab[merged] = next++;
        }
        left = merged;
      }
    }
  json added = json::array();
  for (size_t i = 0; i < special.size(); ++i)
    added.push_back({{"id", i},
                     {"content", special[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  const json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"vocab", vocab},
            {"merges", merges}}}};
}

}  // namespace weft::data
