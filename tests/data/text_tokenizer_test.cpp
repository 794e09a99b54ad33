// Tokenizers against their reference libraries. Fixtures and expected ids come from
// tests/data/fixtures/tokenizers/make_fixtures.py: sentencepiece 0.1.97 itself for the .model
// files and llama2/tokenizer.json (HF's conversion of the same model), an independent Python
// byte-level BPE (hand-written pre-tokenizer regexes, classic GPT-2 merge loop) for the
// llama3 / gpt2 tokenizer.json files.
#include "weft/data/text_tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "support/errors.h"
#include "weft/core/error.h"

namespace weft::data {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int64_t>;
using weft::testing::error_of;

const std::string kDir = std::string(WEFT_SOURCE_DIR) + "/tests/data/fixtures/tokenizers/";

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The texts of make_fixtures.py (TEXTS), in order.
const std::vector<std::string> kTexts = {
    "",
    "Hello world",
    " Hello  world ",
    "I can't believe it's 2024! We'll see what they've done.",
    "HE'S here, I'M sure",
    "Numbers: 1234567 and 3.14159, 1,000,000",
    "Café naïve résumé jalapeño",
    "東京は日本の首都です。",
    "Emoji 😀🎉 and → ©",
    "tabs\tand\n\nnewlines\r\n  indented\n",
    "   leading and trailing   ",
    "<|begin_of_text|>Hello<|eot_id|>",
    "<image>\nWhat is this?",
    "a  \n  b",
    "the xylophone",
};

// sentencepiece 0.1.97 on sp_bpe/tokenizer.model (also what llama2/tokenizer.json must give).
const std::vector<Ids> kSpBpe = {
    {},
    {342, 308, 293, 350, 339, 353, 351},
    {342, 342, 308, 293, 350, 342, 339, 353, 351, 342},
    {320, 271, 268, 365, 345, 330, 269, 343, 282, 264, 345, 365, 348, 342, 371, 366, 371, 373,
     378, 321, 343, 365, 293, 270, 343, 343, 302, 285, 263, 364, 365, 282, 278, 294, 355},
    {342, 375, 397, 365, 399, 342, 261, 262, 359, 320, 365, 80, 270, 354, 262},
    {342, 398, 275, 280, 317, 374, 342, 370, 371, 380, 373, 381, 57,  58,  267, 342, 380,
     355, 370, 373, 370, 381, 393, 359, 342, 370, 359, 366, 366, 366, 359, 366, 366, 366},
    {342, 395, 344, 362, 377, 342, 347, 344, 403, 282, 342,
     349, 377, 348, 275, 377, 323, 311, 344, 298, 404, 350},
    {342, 416, 387, 409, 413, 415, 408, 325, 407, 406, 386},
    {342, 397, 361, 350, 376, 346, 342, 419, 418, 267, 342, 405, 342, 401},
    {260, 309, 348, 12, 268, 351, 13,  13,  294, 358, 269,
     347, 274, 16,  13, 342, 279, 351, 312, 345, 289, 13},
    {342, 342, 342, 342, 314, 310, 303, 267, 260, 349, 288, 269, 347, 363, 342, 342, 342},
    {342, 63,  127, 280, 363, 291, 98,  350, 362, 98, 318, 372, 345, 127,
     65,  308, 293, 350, 63,  127, 343, 350, 345, 98, 346, 351, 127, 65},
    {342, 63, 346, 361, 344, 363, 343, 65, 13, 384, 285, 305, 260, 352, 292, 382},
    {259, 342, 342, 13, 342, 322},
    {263, 342, 372, 364, 353, 350, 357, 352, 350, 294},
};

// sentencepiece 0.1.97 on sp_unigram/tokenizer.model.
const std::vector<Ids> kSpUnigram = {
    {},
    {5, 105, 59, 17, 83, 37, 19},
    {5, 105, 59, 17, 83, 37, 19},
    {5,  68, 91, 14, 16, 9,  96,  111, 24, 5, 85, 16, 6,  95, 132, 57, 43,
     63, 69, 8,  16, 59, 21, 165, 109, 40, 9, 89, 16, 24, 25, 113, 7},
    {5, 108, 149, 16, 128, 5, 103, 20, 11, 5, 68, 16, 0, 21, 162, 8},
    {5,  148, 45, 75, 35, 6,  41, 94, 57,  65, 43, 66, 0,
     13, 5,   65, 7,  58, 43, 58, 66, 133, 11, 94, 64, 64},
    {5, 147, 15, 28, 42, 5, 14, 15, 138, 24, 159, 42, 6, 45, 42, 90, 52, 99, 8, 139, 17},
    {5, 0, 62, 124, 125, 126, 123, 71, 142, 141, 70},
    {5, 149, 39, 17, 119, 18, 5, 0, 13, 5, 140, 5, 136},
    {76, 151, 6, 0, 118, 0, 113, 112, 31, 113, 6, 0, 26, 163, 158, 46, 0},
    {5, 37, 8, 104, 38, 22, 13, 76, 35, 160, 31, 14, 22},
    {5, 0, 75, 22, 38, 0, 17, 28, 0, 155, 30, 9, 0, 105, 59, 17, 0, 8, 17, 9, 0, 18, 19, 0},
    {5, 4, 0, 176, 40, 9, 5, 61, 76, 179, 61, 67},
    {12, 5, 0, 60},
    {10, 5, 30, 29, 37, 17, 27, 179, 110, 8},
};

// The Python reference on llama3/tokenizer.json, special tokens parsed.
const std::vector<Ids> kLlama3 = {
    {},
    {308, 294, 78, 303, 295, 75, 67},
    {220, 308, 294, 78, 220, 303, 295, 75, 67, 220},
    {40, 269, 266, 6,  83, 220, 279, 267, 68, 282, 262, 83,  306, 220, 17,  15,  17,  19,
     0,  220, 54,  68, 6,  294, 268, 68,  68, 303, 280, 260, 88,  6,   282, 275, 325, 13},
    {39, 36, 339, 220, 257, 259, 11, 220, 40, 6, 44, 268, 84, 259},
    {45, 273, 279, 330, 25, 220, 338, 19,  20, 21, 22,  265, 220, 18,
     13, 16,  19,  16,  20, 24,  11,  220, 16, 11, 307, 11,  307},
    {34, 64,  69,  300, 220, 77,  312, 107, 282, 220, 81,  300,
     82, 273, 300, 220, 73,  311, 64,  79,  68,  127, 109, 78},
    {344, 160, 118, 105, 283, 107, 162, 245, 98,  162, 250, 105, 283, 106,
     165, 99,  244, 165, 225, 121, 283, 100, 283, 247, 159, 222, 224},
    {36, 76, 78, 73, 72, 220, 347, 345, 236, 231, 265, 220, 158, 228, 240, 220, 126, 102},
    {83,  309, 82,  197, 266, 67, 342, 325, 86,  267, 77,
     272, 201, 198, 220, 276, 67, 315, 83,  289, 198},
    {340, 220, 323, 310, 293, 265, 258, 81, 287, 267, 77, 70, 340, 220},
    {349, 308, 294, 78, 353},
    {356, 198, 54, 280, 304, 258, 71, 292, 30},
    {64, 340, 198, 220, 220, 65},
    {83, 257, 348},
};

// The Python reference on gpt2/tokenizer.json (same vocabulary, GPT-2 regex, no ignore_merges).
const std::vector<Ids> kGpt2 = {
    {},
    {308, 294, 78, 303, 295, 75, 67},
    {220, 308, 294, 78, 220, 303, 295, 75, 67, 220},
    {40, 269, 266, 6,  83, 220, 279, 267, 68, 282, 262, 83,  306, 220, 17,  15,  17,  19,
     0,  220, 54,  68, 6,  294, 268, 68,  68, 303, 280, 260, 88,  6,   282, 275, 325, 13},
    {39, 36, 6, 50, 220, 257, 259, 11, 220, 40, 6, 44, 268, 84, 259},
    {45, 273, 279, 330, 25, 220, 337, 336, 20, 21, 22,  265, 220, 18,
     13, 16,  19,  16,  20, 24,  11,  220, 16, 11, 307, 11,  307},
    {34, 64,  69,  300, 220, 77,  312, 107, 282, 220, 81,  300,
     82, 273, 300, 220, 73,  311, 64,  79,  68,  127, 109, 78},
    {344, 160, 118, 105, 283, 107, 162, 245, 98,  162, 250, 105, 283, 106,
     165, 99,  244, 165, 225, 121, 283, 100, 283, 247, 159, 222, 224},
    {36, 76, 78, 73, 72, 220, 347, 345, 236, 231, 265, 220, 158, 228, 240, 220, 126, 102},
    {83, 309, 82,  197, 266, 67,  198, 198, 325, 86,  267,
     77, 272, 201, 198, 220, 276, 67,  315, 83,  289, 198},
    {340, 220, 323, 310, 293, 265, 258, 81, 287, 267, 77, 70, 340, 220},
    {27,  91,  279, 70, 291, 62, 78, 69, 62, 334, 87, 83, 91, 29,
     308, 294, 78,  27, 91,  68, 78, 83, 62, 72,  67, 91, 29},
    {27, 72, 76, 64, 70, 68, 29, 198, 54, 280, 304, 258, 71, 292, 30},
    {64, 340, 198, 220, 220, 65},
    {83, 257, 220, 87, 88, 75, 78, 79, 71, 78, 325},
};

void expect_table(const TextTokenizer& tok, const std::vector<Ids>& want, bool round_trip) {
  ASSERT_EQ(want.size(), kTexts.size());
  for (size_t i = 0; i < kTexts.size(); ++i) {
    EXPECT_EQ(tok.encode(kTexts[i]), want[i]) << "text " << i << ": " << kTexts[i];
    if (round_trip) {
      EXPECT_EQ(tok.decode(want[i]), kTexts[i]) << "text " << i;
    }
  }
}

TEST(BpeTokenizer, Llama3StyleMatchesReference) {
  const auto tok = load_tokenizer(kDir + "llama3");
  expect_table(*tok, kLlama3, true);
  // Without parse_special the special strings are text (as the gpt2 file, which lacks them).
  EXPECT_EQ(tok->encode(kTexts[11], false), kGpt2[11]);
  EXPECT_EQ(tok->encode(kTexts[12], false), kGpt2[12]);
  EXPECT_EQ(tok->decode(tok->encode(kTexts[11], false)), kTexts[11]);
}

TEST(BpeTokenizer, Gpt2StyleMatchesReference) {
  const auto tok = load_tokenizer(kDir + "gpt2/tokenizer.json");
  expect_table(*tok, kGpt2, true);
  EXPECT_EQ(tok->encode("<|endoftext|>x"), (Ids{349, 87}));
  EXPECT_FALSE(tok->bos_id.has_value());
  EXPECT_FALSE(tok->add_bos);
}

TEST(BpeTokenizer, Llama2StyleMatchesSentencePiece) {
  const auto tok = load_tokenizer(kDir + "llama2/tokenizer.json");
  expect_table(*tok, kSpBpe, true);
  EXPECT_EQ(tok->bos_id, 1);  // from the post_processor template
  EXPECT_TRUE(tok->add_bos);
  EXPECT_EQ(tok->encode("<s>Hi</s>"), (Ids{1, 342, 375, 346, 2}));  // legacy: "▁" after <s>
  EXPECT_EQ(tok->decode({1, 342, 375, 346, 2}), "<s> Hi</s>");
  EXPECT_EQ(tok->decode({1, 342, 375, 346, 2}, true), "Hi");
}

TEST(BpeTokenizer, SpecialTokensAndConfig) {
  const auto tok = load_tokenizer(kDir + "llama3/tokenizer.json");
  EXPECT_EQ(tok->vocab_size(), 359);
  EXPECT_EQ(tok->bos_id, 349);  // tokenizer_config.json
  EXPECT_EQ(tok->eos_id, 353);
  EXPECT_EQ(tok->pad_id, 350);
  EXPECT_TRUE(tok->add_bos);
  EXPECT_EQ(tok->token_id("<|im_start|>"), 354);
  EXPECT_EQ(tok->token_id("Ġxylophone"), 348);
  EXPECT_EQ(tok->token_id("nope"), std::nullopt);
  EXPECT_EQ(tok->token(308), "He");
  EXPECT_TRUE(tok->is_special(353));
  EXPECT_FALSE(tok->is_special(358));  // <tool>: added, not special
  EXPECT_FALSE(tok->is_special(308));
  EXPECT_EQ(tok->decode({349, 308, 294, 78, 353}, true), "Hello");
  EXPECT_NE(error_of([&] { tok->decode({359}); }).find("359"), std::string::npos);
  EXPECT_NE(error_of([&] { tok->decode({-1}); }).find("-1"), std::string::npos);
  EXPECT_NE(error_of([&] { tok->token(1000); }).find("1000"), std::string::npos);
  // Same file without its tokenizer_config.json: BOS from the post_processor only.
  const auto bare = load_tokenizer_json(read(kDir + "llama3/tokenizer.json"), "bare");
  EXPECT_EQ(bare->bos_id, 349);
  EXPECT_FALSE(bare->eos_id.has_value());
}

TEST(BpeTokenizer, AddedTokenFlags) {
  const auto tok = load_tokenizer(kDir + "llama3");
  // <|mask|> has lstrip and rstrip: it takes the spaces around it.
  EXPECT_EQ(tok->encode("a  <|mask|>  b"), (Ids{64, 357, 65}));
  // <tool> is not special: matched whole even when special tokens are not parsed.
  EXPECT_EQ(tok->encode("x<tool>", false), (Ids{87, 358}));
  EXPECT_EQ(tok->encode("x<|mask|>", false), (Ids{87, 27, 91, 76, 64, 82, 74, 91, 29}));
}

TEST(BpeTokenizer, OffsetsCoverTheText) {
  const auto tok = load_tokenizer(kDir + "llama3");
  for (const std::string& text : kTexts) {
    int64_t at = 0;
    for (const TokenOffset& t : tok->encode_with_offsets(text)) {
      EXPECT_EQ(t.begin, at) << text;
      EXPECT_GT(t.end, t.begin) << text;
      at = t.end;
    }
    EXPECT_EQ(at, static_cast<int64_t>(text.size())) << text;
  }
  // A literal splits the text like a special token and keeps its id.
  const auto t = tok->encode_with_offsets("ab<x>cd", true, {{"<x>", -7}});
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[1].id, -7);
  EXPECT_EQ(t[1].begin, 2);
  EXPECT_EQ(t[1].end, 5);
}

TEST(BpeTokenizer, RejectsInvalidUtf8) {
  const auto tok = load_tokenizer(kDir + "gpt2");
  EXPECT_NE(error_of([&] { tok->encode("ok\xC3"); }).find("UTF-8"), std::string::npos);
}

// Naive BPE: repeatedly merge the leftmost adjacent pair of lowest rank (O(n^2) per merge).
Ids naive_bpe(const std::string& word,
              const std::map<std::pair<std::string, std::string>, int>& ranks,
              const TextTokenizer& tok) {
  std::vector<std::string> parts;
  for (char c : word) parts.emplace_back(1, c);
  for (;;) {
    int best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = ranks.find({parts[i], parts[i + 1]});
      if (it != ranks.end() && (best < 0 || it->second < best)) best = it->second, at = i;
    }
    if (best < 0) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + static_cast<long>(at) + 1);
  }
  Ids ids;
  for (const auto& p : parts) ids.push_back(*tok.token_id(p));
  return ids;
}

TEST(BpeTokenizer, LongWordsMatchNaiveMerging) {
  const auto tok = load_tokenizer(kDir + "gpt2");
  std::map<std::pair<std::string, std::string>, int> ranks;
  const auto merges = nlohmann::json::parse(read(kDir + "gpt2/tokenizer.json"))["model"]["merges"];
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string m = merges[i];
    ranks[{m.substr(0, m.find(' ')), m.substr(m.find(' ') + 1)}] = static_cast<int>(i);
  }
  std::mt19937 rng(7);
  const std::string letters = "thesandioruc";
  for (size_t len : {1u, 2u, 17u, 300u, 3000u}) {
    std::string word;
    for (size_t i = 0; i < len; ++i) word += letters[rng() % letters.size()];
    EXPECT_EQ(tok->encode(word), naive_bpe(word, ranks, *tok)) << word.substr(0, 40);
    EXPECT_EQ(tok->decode(tok->encode(word)), word);
  }
  // A very long run of one letter stays fast (no quadratic rescans) and round-trips.
  const std::string run(200000, 'e');
  EXPECT_EQ(tok->decode(tok->encode(run)), run);
}

TEST(SentencePiece, BpeMatchesLibrary) {
  const auto tok = load_tokenizer(kDir + "sp_bpe/tokenizer.model");
  expect_table(*tok, kSpBpe, true);
  EXPECT_EQ(tok->vocab_size(), 420);
  EXPECT_EQ(tok->bos_id, 1);
  EXPECT_EQ(tok->eos_id, 2);
  EXPECT_FALSE(tok->pad_id.has_value());
  EXPECT_TRUE(tok->add_bos);
  EXPECT_TRUE(tok->is_special(0));
  EXPECT_TRUE(tok->is_special(1));
  EXPECT_FALSE(tok->is_special(342));
  EXPECT_EQ(tok->token(342), "▁");
  EXPECT_EQ(tok->token_id("<0x41>"), 68);
  // Special tokens in the text: parsed, or text as the library does (with dummy prefix per
  // segment when parsed).
  EXPECT_EQ(tok->encode("<s>x</s>", true), (Ids{1, 342, 372, 2}));
  EXPECT_EQ(tok->encode("<s>x</s>", false), (Ids{342, 63, 348, 65, 372, 63, 50, 348, 65}));
}

TEST(SentencePiece, UnigramMatchesLibrary) {
  const auto tok = load_tokenizer(kDir + "sp_unigram");
  // Whitespace is squeezed, so only some texts round-trip; <unk> pieces never do.
  expect_table(*tok, kSpUnigram, false);
  // The model's own normalization rules (precompiled charsmap): fullwidth letters, ligature,
  // ideographic space, circled digit.
  EXPECT_EQ(tok->encode("ＡＢＣ ﬁne　①"), (Ids{5, 134, 0, 147, 48, 38, 8, 94}));
  EXPECT_EQ(tok->decode({5, 134, 0, 147, 48, 38, 8, 94}), "A ⁇ C fine 1");
  EXPECT_EQ(tok->encode("  a   b  "), (Ids{12, 60}));
  EXPECT_EQ(tok->encode("<ctrl>Hi<s>x</s>", false),
            (Ids{5, 0, 107, 9, 35, 37, 0, 108, 18, 0, 6, 0, 30, 0, 6, 0}));
  EXPECT_EQ(tok->encode("<ctrl>Hi<s>x</s>", true), (Ids{3, 5, 108, 18, 1, 5, 30, 2}));
  EXPECT_EQ(tok->token(4), "<image>");  // user-defined: always whole
  EXPECT_EQ(tok->encode("a<image>b", false), (Ids{12, 4, 172}));
}

TEST(SentencePiece, DecodesLikeLibrary) {
  const auto tok = load_tokenizer(kDir + "sp_bpe");
  const auto b = [&](int byte) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", byte);
    return *tok->token_id(name);
  };
  const int64_t a = *tok->token_id("a"), space_a = *tok->token_id("▁a"), space = 342;
  // Byte pieces are reassembled; a byte that is not part of a valid character becomes U+FFFD.
  EXPECT_EQ(tok->decode({b(0xE6), b(0x9D), b(0xB1), b(0xFF)}), "東\xEF\xBF\xBD");
  EXPECT_EQ(tok->decode({b(0xF0), b(0x9F), b(0x98)}), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tok->decode({b(0x41), b(0xE6), b(0x42)}),
            "A\xEF\xBF\xBD"
            "B");
  EXPECT_EQ(tok->decode({b(0xE6), b(0x9D), 1, b(0xB1)}),
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a control piece ends a byte run
  // The first visible piece loses its leading "▁" (control pieces are invisible).
  EXPECT_EQ(tok->decode({1, 1, space_a}), "a");
  EXPECT_EQ(tok->decode({space, 1, space_a}), " a");
  EXPECT_EQ(tok->decode({b(0x41), space_a}), "A a");
  EXPECT_EQ(tok->decode({0, space_a}), " \xE2\x81\x87  a");
  EXPECT_EQ(tok->decode({0, space_a}, true), "a");
  EXPECT_EQ(tok->decode({a, space_a}), "a a");
  EXPECT_NE(error_of([&] { tok->decode({420}); }).find("420"), std::string::npos);
}

TEST(TokenizerLoad, Dispatch) {
  EXPECT_EQ(load_tokenizer(kDir + "llama3")->vocab_size(), 359);      // dir: tokenizer.json
  EXPECT_EQ(load_tokenizer(kDir + "sp_unigram")->vocab_size(), 180);  // dir: tokenizer.model
  EXPECT_NE(error_of([&] { load_tokenizer(kDir); }).find("neither"), std::string::npos);
  EXPECT_NE(error_of([&] { load_tokenizer(kDir + "missing.json"); }).find("missing.json"),
            std::string::npos);
  // A tokenizer.json handed to the SentencePiece reader is a malformed protobuf, not a crash.
  EXPECT_NE(error_of([&] {
              load_sentencepiece(read(kDir + "gpt2/tokenizer.json"), "x.model");
            }).find("x.model"),
            std::string::npos);
}

// ---- bad files ---------------------------------------------------------------------------------

const char* kTinyJson = R"({
  "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false},
  "decoder": {"type": "ByteLevel"},
  "added_tokens": [{"id": 3, "content": "<s>", "special": true}]
})";

std::string json_error(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return error_of([&] { load_tokenizer_json(text, "tok.json"); });
}

TEST(TokenizerLoad, BadJsonNamesFileAndField) {
  EXPECT_EQ(load_tokenizer_json(kTinyJson, "tok.json")->encode("ab<s>ba"), (Ids{2, 3, 1, 0}));
  const auto has = [](const std::string& msg, std::initializer_list<const char*> parts) {
    for (const char* p : parts)
      if (msg.find(p) == std::string::npos) return ::testing::AssertionFailure() << msg;
    return ::testing::AssertionSuccess();
  };
  EXPECT_TRUE(
      has(json_error(kTinyJson, "\"merges\"", "\"merges\" ]"), {"tok.json", "invalid JSON"}));
  EXPECT_TRUE(
      has(json_error(kTinyJson, "\"vocab\"", "\"vocob\""), {"tok.json", "model.vocab", "missing"}));
  EXPECT_TRUE(has(json_error(kTinyJson, "[\"a b\"]", "[\"a c\"]"),
                  {"tok.json", "model.merges[0]", "\"c\""}));
  EXPECT_TRUE(
      has(json_error(kTinyJson, "\"ab\": 2", "\"ab\": 1"), {"tok.json", "model.vocab", "id 1"}));
  EXPECT_TRUE(
      has(json_error(kTinyJson, "\"ab\": 2", "\"ab\": -2"), {"model.vocab[\"ab\"]", "range"}));
  EXPECT_TRUE(
      has(json_error(kTinyJson, "\"ab\": 2", "\"ab\": 2.5"), {"model.vocab[\"ab\"]", "integer"}));
  EXPECT_TRUE(
      has(json_error(kTinyJson, "[\"a b\"]", "[\"ab\"]"), {"model.merges[0]", "left right"}));
  EXPECT_TRUE(has(json_error(kTinyJson, "\"special\": true}",
                             "\"special\": true}, {\"id\": 3, \"content\": \"x\"}"),
                  {"tok.json", "added_tokens[1].id", "id 3"}));
  EXPECT_TRUE(has(json_error(kTinyJson, "\"BPE\"", "\"WordPiece\""), {"model.type", "WordPiece"}));
  EXPECT_TRUE(
      has(json_error(kTinyJson, "\"type\": \"ByteLevel\", \"add", "\"type\": \"Bert\", \"add"),
          {"pre_tokenizer.type", "Bert"}));
  EXPECT_TRUE(has(json_error(kTinyJson, "{\"type\": \"ByteLevel\", \"add_prefix_space\": false}",
                             "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}}"),
                  {"pre_tokenizer.pattern.Regex", "invalid regex"}));
  EXPECT_TRUE(has(json_error(kTinyJson, "\"add_prefix_space\": false", "\"add_prefix_space\": 1"),
                  {"pre_tokenizer.add_prefix_space", "boolean"}));
  EXPECT_TRUE(has(error_of([] { load_tokenizer_json("[1, 2]", "tok.json"); }),
                  {"tok.json", "top level", "object"}));
}

// A protobuf writer for hand-made SentencePiece models.
std::string varint(uint64_t v) {
  std::string out;
  do {
    out += static_cast<char>((v & 0x7F) | (v >= 0x80 ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return out;
}
std::string field(int number, const std::string& bytes) {
  return varint(static_cast<uint64_t>(number) << 3 | 2) + varint(bytes.size()) + bytes;
}
std::string piece(const std::string& text, float score, int type) {
  std::string score_bytes(4, '\0');
  std::memcpy(score_bytes.data(), &score, 4);
  return field(1, field(1, text) + varint(2 << 3 | 5) + score_bytes + varint(3 << 3) +
                      varint(static_cast<uint64_t>(type)));
}
// <unk> <s> </s> ▁ a b ▁a ab, BPE.
std::string tiny_model() {
  std::string m = piece("<unk>", 0, 2) + piece("<s>", 0, 3) + piece("</s>", 0, 3);
  m += piece("\xE2\x96\x81", -1, 1) + piece("a", -2, 1) + piece("b", -3, 1) +
       piece(
           "\xE2\x96\x81"
           "a",
           -4, 1) +
       piece("ab", -5, 1);
  return m + field(2, varint(3 << 3) + varint(2));
}

TEST(TokenizerLoad, BadProtobufNamesFileAndField) {
  const auto tok = load_sentencepiece(tiny_model(), "tok.model");
  EXPECT_EQ(tok->encode("ab a"), (Ids{6, 5, 6}));  // ▁a b ▁a: higher scores merge first
  const std::string m = tiny_model();
  const auto err = [](const std::string& bytes) {
    return error_of([&] { load_sentencepiece(bytes, "tok.model"); });
  };
  EXPECT_NE(err(m.substr(0, m.size() - 1))
                .find("tok.model: ModelProto.trainer_spec: length 2 at byte 113 runs past the end"),
            std::string::npos)
      << err(m.substr(0, m.size() - 1));
  EXPECT_NE(err(m + "\x0A\x7F").find("length 127"), std::string::npos) << err(m + "\x0A\x7F");
  EXPECT_NE(err(m + "\x0A\xFF").find("truncated varint"), std::string::npos);
  EXPECT_NE(err(m + piece("a", 0, 1)).find("pieces[8].piece: \"a\" is already pieces[4]"),
            std::string::npos)
      << err(m + piece("a", 0, 1));
  EXPECT_NE(err(m + piece("x", 0, 9)).find("pieces[8].type: unknown piece type 9"),
            std::string::npos)
      << err(m + piece("x", 0, 9));
  EXPECT_NE(err(piece("a", 0, 1)).find("no UNKNOWN piece"), std::string::npos);
  EXPECT_NE(err("").find("no pieces"), std::string::npos);
  EXPECT_NE(err(m + varint(1 << 3 | 0) + varint(5)).find("pieces: wire type 0"), std::string::npos)
      << err(m + varint(1 << 3 | 0) + varint(5));
  EXPECT_NE(err(m + varint(7 << 3 | 3)).find("wire type 3"), std::string::npos);
  EXPECT_NE(err(m + field(2, varint(35 << 3) + varint(1))).find("byte_fallback"),
            std::string::npos);
  EXPECT_NE(err(m + piece("<0x4G>", 0, 6) + field(2, varint(35 << 3) + varint(1)))
                .find("invalid byte piece"),
            std::string::npos);
}

// Every input the fuzzer kept (tests/fuzz/tokenizer) loads or gives a weft::Error, and a loaded
// tokenizer encodes and decodes without crashing.
TEST(TokenizerFuzzRegression, ReplaysSavedInputs) {
  const fs::path dir = fs::path(WEFT_SOURCE_DIR) / "tests/fuzz/tokenizer";
  size_t count = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string bytes = read(e.path().string());
    for (int kind = 0; kind < 2; ++kind) {
      try {
        const auto tok = kind == 0 ? load_tokenizer_json(bytes, e.path().string())
                                   : load_sentencepiece(bytes, e.path().string());
        for (const std::string& text : {std::string("Hello <s> world 123 \xC3\xA9\xF0\x9F\x98\x80"),
                                        std::string(bytes.substr(0, 512))}) {
          try {
            const auto ids = tok->encode(text);
            tok->decode(ids, kind == 0);
          } catch (const Error&) {
          }
        }
      } catch (const Error&) {
      }
    }
    ++count;
  }
  EXPECT_GT(count, 0u);
}

}  // namespace
}  // namespace weft::data
