// Chat templates on the tiny tokenizers of tests/data/fixtures/tokenizers. The expected ids and
// targets come from make_fixtures.py (print_chat): an independent Python rendering of each
// template, sentencepiece 0.1.97 or the Python byte-level reference for the text between special
// tokens and markers, and the overlap rule for targets.
#include "weft/data/chat.h"

#include <gtest/gtest.h>

#include "support/errors.h"
#include "weft/core/error.h"

namespace weft::data {
namespace {

using Ids = std::vector<int64_t>;
using Flags = std::vector<uint8_t>;
using weft::testing::error_of;

const std::string kDir = std::string(WEFT_SOURCE_DIR) + "/tests/data/fixtures/tokenizers/";

const std::vector<ChatTurn> kTurns = {{"human", "<image>\nWhat is in the image?"},
                                      {"gpt", "A cat on the table."},
                                      {"user", "What color is it?"},
                                      {"assistant", "It is red."}};
const std::vector<ChatMarker> kImage = {{"<image>", 999, 3}};

void expect_chat(const EncodedChat& got, const Ids& ids, const Flags& flags, int64_t marker_at) {
  EXPECT_EQ(got.ids, ids);
  EXPECT_EQ(got.is_target, flags);
  ASSERT_EQ(got.spans.size(), 1u);
  EXPECT_EQ(got.spans[0].marker, 0);
  EXPECT_EQ(got.spans[0].start, marker_at);
  EXPECT_EQ(got.spans[0].length, 3);
}

// The target tokens, decoded.
std::string targets(const TextTokenizer& tok, const EncodedChat& c) {
  Ids ids;
  for (size_t i = 0; i < c.ids.size(); ++i)
    if (c.is_target[i]) ids.push_back(c.ids[i]);
  return tok.decode(ids);
}

TEST(ChatTemplate, LlavaWithSentencePiece) {
  EXPECT_EQ(render_chat("llava", kTurns),
            "A chat between a curious human and an artificial intelligence assistant. The "
            "assistant gives helpful, detailed, and polite answers to the human's questions. "
            "USER: <image>\nWhat is in the image? ASSISTANT: A cat on the table.</s>USER: What "
            "color is it? ASSISTANT: It is red.</s>");
  const auto tok = load_tokenizer(kDir + "sp_bpe");
  const EncodedChat c = encode_chat(*tok, "llava", kTurns, kImage);
  const Ids ids = {
      1,   342, 394, 271, 285, 330, 345, 276, 312, 259, 271, 354, 316, 296, 348, 300, 337, 267,
      265, 259, 349, 319, 362, 281, 346, 311, 279, 318, 353, 269, 363, 312, 356, 343, 329, 336,
      327, 355, 286, 329, 336, 327, 342, 363, 346, 369, 274, 342, 261, 353, 357, 362, 354, 353,
      359, 338, 326, 289, 359, 267, 284, 350, 269, 318, 265, 348, 276, 317, 307, 263, 300, 337,
      365, 348, 333, 274, 319, 350, 347, 348, 355, 342, 88,  399, 397, 85,  374, 342, 999, 999,
      999, 342, 13,  384, 285, 305, 279, 263, 264, 361, 344, 363, 343, 382, 342, 394, 399, 399,
      383, 399, 367, 394, 398, 367, 374, 342, 394, 271, 273, 301, 347, 263, 260, 309, 314, 355,
      2,   342, 88,  399, 397, 85,  374, 321, 285, 271, 350, 353, 295, 305, 264, 345, 382, 342,
      394, 399, 399, 383, 399, 367, 394, 398, 367, 374, 320, 345, 305, 306, 351, 355, 2};
  Flags flags(ids.size(), 0);
  for (size_t i = 116; i < 127; ++i) flags[i] = 1;
  for (size_t i = 154; i < 161; ++i) flags[i] = 1;
  expect_chat(c, ids, flags, 88);
  EXPECT_EQ(targets(*tok, c), "A cat on the table. It is red.");  // </s> decodes to nothing
}

TEST(ChatTemplate, PlainWithUnigram) {
  const std::vector<ChatTurn> turns(kTurns.begin(), kTurns.begin() + 2);
  EXPECT_EQ(render_chat("plain", turns, kImage), "<image>A cat on the table.\n");
  const auto tok = load_tokenizer(kDir + "sp_unigram");
  expect_chat(encode_chat(*tok, "plain", turns, kImage),
              {1, 999, 999, 999, 5, 134, 91, 9, 5, 110, 10, 76, 15, 82, 7, 0},
              {0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 1);
}

TEST(ChatTemplate, Llama2WithTokenizerJson) {
  std::vector<ChatTurn> turns = {{"system", "Be brief."}};
  turns.insert(turns.end(), kTurns.begin(), kTurns.end());
  EXPECT_EQ(render_chat("llama2", turns),
            "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n<image>\nWhat is in the image? [/INST] A "
            "cat on the table. </s><s>[INST] What color is it? [/INST] It is red. </s>");
  const auto tok = load_tokenizer(kDir + "llama2/tokenizer.json");
  const Ids ids = {1,   342, 94,  383, 398, 399, 367, 96,  342, 63,  63,  399, 92,  399, 65,  65,
                   13,  69,  343, 322, 316, 343, 362, 355, 13,  63,  63,  50,  399, 92,  399, 65,
                   65,  13,  13,  999, 999, 999, 342, 13,  384, 285, 305, 279, 263, 264, 361, 344,
                   363, 343, 382, 342, 94,  50,  383, 398, 399, 367, 96,  342, 394, 271, 273, 301,
                   347, 263, 260, 309, 314, 355, 342, 2,   1,   342, 94,  383, 398, 399, 367, 96,
                   321, 285, 271, 350, 353, 295, 305, 264, 345, 382, 342, 94,  50,  383, 398, 399,
                   367, 96,  320, 345, 305, 306, 351, 355, 342, 2};
  Flags flags(ids.size(), 0);
  for (size_t i = 60; i < 72; ++i) flags[i] = 1;
  for (size_t i = 98; i < 106; ++i) flags[i] = 1;
  expect_chat(encode_chat(*tok, "llama2", turns, kImage), ids, flags, 35);
  // The same conversation with the SentencePiece model the tokenizer.json was converted from.
  expect_chat(encode_chat(*load_tokenizer(kDir + "sp_bpe"), "llama2", turns, kImage), ids, flags,
              35);
}

TEST(ChatTemplate, Llama3) {
  const auto tok = load_tokenizer(kDir + "llama3");
  const EncodedChat c = encode_chat(*tok, "llama3", kTurns, kImage);
  const Ids ids = {349, 351, 84,  82,  68,  81,  352, 342, 999, 999, 999, 198, 54,  280,
                   304, 276, 260, 262, 76,  64,  70,  68,  30,  353, 351, 64,  333, 352,
                   342, 32,  269, 271, 301, 77,  260, 258, 309, 323, 13,  353, 351, 84,
                   82,  68,  81,  352, 342, 54,  280, 269, 78,  75,  295, 304, 262, 83,
                   30,  353, 351, 64,  333, 352, 342, 40,  83,  304, 302, 67,  13,  353};
  Flags flags(ids.size(), 0);
  for (size_t i = 29; i < 40; ++i) flags[i] = 1;
  for (size_t i = 63; i < 70; ++i) flags[i] = 1;
  expect_chat(c, ids, flags, 8);
  EXPECT_EQ(targets(*tok, c), "A cat on the table.<|eot_id|>It is red.<|eot_id|>");
}

TEST(ChatTemplate, ChatmlQwenStyle) {
  EXPECT_EQ(render_chat("chatml", kTurns),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "<image>\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\nA cat on the "
            "table.<|im_end|>\n<|im_start|>user\nWhat color is it?<|im_end|>\n<|im_start|>"
            "assistant\nIt is red.<|im_end|>\n");
  const auto tok = load_tokenizer(kDir + "llama3");
  const EncodedChat c = encode_chat(*tok, "chatml", kTurns, kImage);
  const Ids ids = {354, 82,  88,  82,  334, 76,  198, 56,  296, 286, 256, 220, 257, 75,  79,  69,
                   84,  75,  256, 333, 13,  355, 198, 354, 84,  82,  68,  81,  198, 999, 999, 999,
                   198, 54,  280, 304, 276, 260, 262, 76,  64,  70,  68,  30,  355, 198, 354, 64,
                   333, 198, 32,  269, 271, 301, 77,  260, 258, 309, 323, 13,  355, 198, 354, 84,
                   82,  68,  81,  198, 54,  280, 269, 78,  75,  295, 304, 262, 83,  30,  355, 198,
                   354, 64,  333, 198, 40,  83,  304, 302, 67,  13,  355, 198};
  Flags flags(ids.size(), 0);
  for (size_t i = 50; i < 61; ++i) flags[i] = 1;
  for (size_t i = 84; i < 91; ++i) flags[i] = 1;
  expect_chat(c, ids, flags, 29);
  EXPECT_EQ(targets(*tok, c), "A cat on the table.<|im_end|>It is red.<|im_end|>");
}

TEST(ChatTemplate, MarkersAndSystemTurns) {
  const auto tok = load_tokenizer(kDir + "llama3");
  // Two markers, a custom system turn (chatml then has no default system turn).
  const std::vector<ChatTurn> turns = {
      {"system", "Look."}, {"user", "<image><video>?"}, {"assistant", "Yes."}};
  const EncodedChat c = encode_chat(*tok, "chatml", turns, {{"<image>", 7, 2}, {"<video>", 9, 1}});
  ASSERT_EQ(c.spans.size(), 2u);
  EXPECT_EQ(c.spans[0].marker, 0);
  EXPECT_EQ(c.spans[1].marker, 1);
  EXPECT_EQ(c.spans[1].start, c.spans[0].start + 2);
  EXPECT_EQ(c.ids[static_cast<size_t>(c.spans[0].start)], 7);
  EXPECT_EQ(c.ids[static_cast<size_t>(c.spans[1].start)], 9);
  EXPECT_EQ(c.ids.front(), 354);
  EXPECT_EQ(targets(*tok, c), "Yes.<|im_end|>");
  // A conversation ending with a user turn has no targets.
  const EncodedChat prompt = encode_chat(*tok, "llama3", {{"user", "Hi"}}, {});
  EXPECT_EQ(std::count(prompt.is_target.begin(), prompt.is_target.end(), 1), 0);
}

TEST(ChatTemplate, Errors) {
  const auto tok = load_tokenizer(kDir + "llama3");
  const auto err = [&](const std::string& name, const std::vector<ChatTurn>& turns,
                       const std::vector<ChatMarker>& markers = {}) {
    return error_of([&] { encode_chat(*tok, name, turns, markers); });
  };
  EXPECT_NE(err("vicuna", kTurns).find("unknown template \"vicuna\""), std::string::npos);
  EXPECT_NE(err("chatml", {}).find("no turns"), std::string::npos);
  EXPECT_NE(err("chatml", {{"user", "a"}, {"user", "b"}}).find("turn 1"), std::string::npos);
  EXPECT_NE(err("chatml", {{"assistant", "a"}}).find("turn 0"), std::string::npos);
  EXPECT_NE(err("chatml", {{"user", "a"}, {"system", "b"}}).find("turn 1"), std::string::npos);
  EXPECT_NE(err("chatml", {{"bot", "a"}}).find("unknown role \"bot\""), std::string::npos);
  EXPECT_NE(err("chatml", {{"user", "a"}, {"assistant", "see <image>"}}, kImage)
                .find("turn 1 (assistant) contains the marker \"<image>\""),
            std::string::npos);
  EXPECT_NE(err("plain", {{"user", "no image"}, {"assistant", "x"}}, kImage).find("no marker"),
            std::string::npos);
  EXPECT_NE(err("plain", kTurns, kImage).find("exactly one user"), std::string::npos);
  // The llava template needs </s>, which this tokenizer lacks.
  EXPECT_NE(err("llava", kTurns, kImage).find("\"</s>\""), std::string::npos);
  EXPECT_NE(err("chatml", {{"user", "a"}}, {{"<image>", 1, 0}}).find("count 0"), std::string::npos);
}

}  // namespace
}  // namespace weft::data
