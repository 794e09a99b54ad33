#include "weft/data/tokenizer.h"

#include <cctype>

#include "weft/core/error.h"
#include "weft/data/shapes.h"

namespace weft::data {

namespace {

bool has_space(const std::string& s) {
  for (char c : s)
    if (std::isspace(static_cast<unsigned char>(c))) return true;
  return false;
}

}  // namespace

Tokenizer::Tokenizer(const std::vector<std::string>& placeholder_names,
                     const std::vector<std::string>& words)
    : num_placeholders_(static_cast<int64_t>(placeholder_names.size())) {
  id_to_token_ = {"<pad>", "<bos>", "<eos>"};
  for (const auto& name : placeholder_names) {
    WEFT_CHECK(!name.empty() && !has_space(name), "tokenizer: invalid placeholder name '", name,
               "'");
    std::string tok = "<" + name + ">";
    for (const auto& t : id_to_token_)
      WEFT_CHECK(t != tok, "tokenizer: duplicate placeholder token ", tok);
    id_to_token_.push_back(std::move(tok));
  }
  for (const auto& w : words) {
    WEFT_CHECK(!w.empty() && !has_space(w), "tokenizer: invalid word '", w, "'");
    WEFT_CHECK(w.front() != '<', "tokenizer: word '", w, "' looks like a special token");
    const auto id = static_cast<int64_t>(id_to_token_.size());
    WEFT_CHECK(word_to_id_.emplace(w, id).second, "tokenizer: duplicate word '", w, "'");
    id_to_token_.push_back(w);
  }
}

Tokenizer Tokenizer::for_shapes(const ModelSpec& model) {
  std::vector<std::string> names;
  bool with_audio = false;
  for (const auto& e : model.encoders) {
    names.push_back(e.name);
    with_audio = with_audio || e.kind == EncoderKind::kWhisper;
  }
  return Tokenizer(names, ShapesDataset::words(with_audio));
}

int64_t Tokenizer::placeholder_id(int encoder) const {
  WEFT_CHECK(encoder >= 0 && encoder < num_placeholders_, "tokenizer: encoder index ", encoder,
             " out of range (", num_placeholders_, " placeholder tokens)");
  return kNumSpecial + encoder;
}

const std::string& Tokenizer::token(int64_t id) const {
  WEFT_CHECK(id >= 0 && id < vocab_size(), "tokenizer: token id ", id, " out of range [0, ",
             vocab_size(), ")");
  return id_to_token_[static_cast<size_t>(id)];
}

std::vector<int64_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    while (i < n && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    size_t j = i;
    while (j < n && !std::isspace(static_cast<unsigned char>(text[j]))) ++j;
    if (j > i) {
      const std::string word = text.substr(i, j - i);
      auto it = word_to_id_.find(word);
      WEFT_CHECK(it != word_to_id_.end(), "tokenizer: unknown word '", word, "' in \"", text, "\"");
      ids.push_back(it->second);
    }
    i = j;
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    const std::string& tok = token(id);  // range check
    if (id == eos_id()) break;
    if (is_special(id)) continue;
    if (!out.empty()) out += ' ';
    out += tok;
  }
  return out;
}

}  // namespace weft::data
