// libFuzzer target: the tokenizer loaders (data/text_tokenizer.h), fed whole files. The bytes go
// to both the tokenizer.json and the SentencePiece reader; a tokenizer that loads encodes fixed
// texts and the input itself, then decodes. Any input must give results or a weft::Error —
// never a crash, an out-of-range read, undefined behaviour or a runaway loop.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_support.h"
#include "weft/core/error.h"
#include "weft/data/text_tokenizer.h"

namespace {

void exercise(const weft::data::TextTokenizer& tok, std::string_view input) {
  static const std::string kTexts[] = {
      "Hello world, it's 2024!  \t\n x",
      "<s>[INST] caf\xC3\xA9 \xE6\x9D\xB1 \xF0\x9F\x98\x80 [/INST]</s><|im_start|><image>",
      std::string(300, 'a') + " " + std::string(100, ' ') + "end",
  };
  for (int parse_special = 0; parse_special < 2; ++parse_special) {
    for (const std::string& text : kTexts) {
      try {
        const auto ids = tok.encode(text, parse_special != 0);
        tok.decode(ids, parse_special != 0);
      } catch (const weft::Error& e) {
        weft_fuzz::no_internal_error(e);
      }
    }
    try {
      const auto t =
          tok.encode_with_offsets(input.substr(0, 1024), parse_special != 0, {{"<image>", -1}});
      for (const auto& o : t) {
        if (o.begin < 0 || o.end < o.begin || o.end > 1024) __builtin_trap();
        if (o.id >= 0) tok.token(o.id);
      }
    } catch (const weft::Error& e) {
      weft_fuzz::no_internal_error(e);
    }
  }
  const int64_t n = tok.vocab_size();
  for (int64_t id : {int64_t{0}, n / 2, n - 1, n, int64_t{-1}}) {
    try {
      tok.decode({id, id});
      tok.is_special(id);
    } catch (const weft::Error& e) {
      weft_fuzz::no_internal_error(e);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    exercise(*weft::data::load_tokenizer_json(bytes, "fuzz.json"), bytes);
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  try {
    exercise(*weft::data::load_sentencepiece(bytes, "fuzz.model"), bytes);
  } catch (const weft::Error& e) {
    weft_fuzz::no_internal_error(e);
  }
  return 0;
}
