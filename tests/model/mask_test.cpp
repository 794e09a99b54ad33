// Attention-mask semantics (core/mask.h) on hand-built sequences with the expected visibility
// written out row by row, and the dense mask (model/mask.h) against weft::visible.
#include "weft/model/mask.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "weft/core/mask.h"

namespace weft::model {
namespace {

using Grid = std::vector<std::string>;  // row q, column k: '1' = q sees k, '.' = not

// Token descriptors from a compact spelling: one entry per token, {doc, item}.
std::vector<TokenDesc> tokens(std::initializer_list<std::pair<int32_t, int32_t>> spec) {
  std::vector<TokenDesc> out;
  for (const auto& [d, i] : spec) out.push_back({d, i});
  return out;
}

Grid grid_of_visible(const std::vector<TokenDesc>& t) {
  const int64_t S = static_cast<int64_t>(t.size());
  Grid g(S, std::string(S, '.'));
  for (int64_t q = 0; q < S; ++q)
    for (int64_t k = 0; k < S; ++k)
      if (visible(t[q], q, t[k], k)) g[q][k] = '1';
  return g;
}

Grid grid_of_dense(const std::vector<TokenDesc>& t) {
  const int64_t S = static_cast<int64_t>(t.size());
  at::Tensor doc = torch::empty({1, S}, torch::kInt), item = torch::empty({1, S}, torch::kInt);
  for (int64_t i = 0; i < S; ++i) {
    doc[0][i] = t[i].doc;
    item[0][i] = t[i].item;
  }
  at::Tensor m = visible_mask(doc, item);
  EXPECT_EQ(m.scalar_type(), torch::kBool);
  EXPECT_EQ(m.sizes(), (std::vector<int64_t>{1, 1, S, S}));
  auto M = m.accessor<bool, 4>();
  Grid g(S, std::string(S, '.'));
  for (int64_t q = 0; q < S; ++q)
    for (int64_t k = 0; k < S; ++k)
      if (M[0][0][q][k]) g[q][k] = '1';
  return g;
}

// Both implementations must give exactly `expected`.
void expect_grid(const std::vector<TokenDesc>& t, const Grid& expected) {
  EXPECT_EQ(grid_of_visible(t), expected) << "weft::visible";
  EXPECT_EQ(grid_of_dense(t), expected) << "model::visible_mask";
}

TEST(Mask, TextIsCausal) {
  const auto t = tokens({{0, -1}, {0, -1}, {0, -1}, {0, -1}});
  const Grid expected = {
      "1...",  // q=0
      "11..",  // q=1
      "111.",  // q=2
      "1111",  // q=3
  };
  expect_grid(t, expected);
}

// text, image (3 tokens), text, text: the image sees the text before it and all of itself,
// never the text after it; text after the image sees the whole image causally.
TEST(Mask, ImageSpanIsBidirectionalWithinItselfOnly) {
  const auto t = tokens({{0, -1}, {0, 0}, {0, 0}, {0, 0}, {0, -1}, {0, -1}});
  const Grid expected = {
      "1.....",  // q=0
      "1111..",  // q=1
      "1111..",  // q=2
      "1111..",  // q=3
      "11111.",  // q=4
      "111111",  // q=5
  };
  expect_grid(t, expected);
}

// text, image A (2), text, image B (2), text. The rule is "causal, or same item": B's tokens see
// A's tokens because A comes earlier (k <= q), exactly as text after A does — a later image is
// conditioned on everything before it. The isolation is in the other direction: A never sees
// B (nor the text between them), although A and B are both images of the same modality.
TEST(Mask, TwoImagesInOneRowAreIsolatedBeyondCausality) {
  const auto t = tokens({{0, -1}, {0, 0}, {0, 0}, {0, -1}, {0, 1}, {0, 1}, {0, -1}});
  const Grid expected = {
      "1......",  // q=0
      "111....",  // q=1
      "111....",  // q=2
      "1111...",  // q=3
      "111111.",  // q=4
      "111111.",  // q=5
      "1111111",  // q=6
  };
  expect_grid(t, expected);
}

// Two packed documents: [text, img, img] and [img, img, text]. Nothing crosses the boundary,
// also not when both documents reuse the same item id (the document check comes first).
TEST(Mask, PackedDocumentsNeverSeeEachOther) {
  const Grid expected = {
      "1.....",  // q=0
      "111...",  // q=1
      "111...",  // q=2
      "...11.",  // q=3
      "...11.",  // q=4
      "...111",  // q=5
  };
  expect_grid(tokens({{0, -1}, {0, 0}, {0, 0}, {1, 1}, {1, 1}, {1, -1}}), expected);
  expect_grid(tokens({{0, -1}, {0, 0}, {0, 0}, {1, 0}, {1, 0}, {1, -1}}), expected);
  // Text only: the second document's causal triangle restarts at its first token.
  const Grid text_only = {
      "1....",  // q=0
      "11...",  // q=1
      "..1..",  // q=2
      "..11.",  // q=3
      "..111",  // q=4
  };
  expect_grid(tokens({{0, -1}, {0, -1}, {1, -1}, {1, -1}, {1, -1}}), text_only);
}

// Padding (doc -1) sees only itself — not even other padding — and nobody sees padding, even a
// padding token that (wrongly) carries the same item id as a real image.
TEST(Mask, PaddingSeesOnlyItselfAndIsSeenByNobody) {
  const auto t = tokens({{0, -1}, {0, 0}, {0, 0}, {-1, -1}, {-1, -1}, {-1, 0}});
  const Grid expected = {
      "1.....",  // q=0
      "111...",  // q=1
      "111...",  // q=2
      "...1..",  // q=3
      "....1.",  // q=4
      ".....1",  // q=5
  };
  expect_grid(t, expected);
}

TEST(Mask, DenseMaskEqualsVisibleOnRandomDescriptors) {
  torch::manual_seed(11);
  const int64_t B = 3, S = 40;
  // Unsorted random descriptors: docs in {-1, 0, 1, 2}, items in {-1, 0, 1, 2, 3}.
  at::Tensor doc = torch::randint(-1, 3, {B, S}, torch::kInt);
  at::Tensor item = torch::randint(-1, 4, {B, S}, torch::kInt);
  at::Tensor m = visible_mask(doc, item);
  ASSERT_EQ(m.sizes(), (std::vector<int64_t>{B, 1, S, S}));
  ASSERT_EQ(m.scalar_type(), torch::kBool);
  auto M = m.accessor<bool, 4>();
  auto D = doc.accessor<int32_t, 2>();
  auto I = item.accessor<int32_t, 2>();
  int64_t mismatches = 0, visible_count = 0, bidirectional = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t q = 0; q < S; ++q) {
      int64_t row = 0;
      for (int64_t k = 0; k < S; ++k) {
        const bool want = visible({D[b][q], I[b][q]}, q, {D[b][k], I[b][k]}, k);
        mismatches += M[b][0][q][k] != want;
        row += want;
        bidirectional += want && k > q;
      }
      EXPECT_GE(row, 1) << "row " << b << "/" << q << " sees nothing";
      EXPECT_TRUE(M[b][0][q][q]);
      visible_count += row;
    }
  EXPECT_EQ(mismatches, 0);
  // The random case exercises every branch: more than the diagonal, and some k > q.
  EXPECT_GT(visible_count, B * S);
  EXPECT_GT(bidirectional, 0);
}

// Chunks partition the queries, and every key any of a chunk's queries sees (in any row) lies in
// its key range: on random descriptors (documents and items scattered, padding).
TEST(AttentionChunks, CoverEveryVisibleKey) {
  torch::manual_seed(11);
  const int64_t B = 3, S = 96;
  at::Tensor doc = torch::randint(-1, 3, {B, S}, torch::kInt);
  at::Tensor item = torch::randint(-1, 4, {B, S}, torch::kInt);
  const std::vector<AttentionChunk> chunks = attention_chunks(doc, item, 16, /*most=*/1.0);
  ASSERT_EQ(chunks.size(), 6u);
  auto D = doc.accessor<int32_t, 2>();
  auto I = item.accessor<int32_t, 2>();
  int64_t next = 0;
  for (const AttentionChunk& c : chunks) {
    EXPECT_EQ(c.q_begin, next);
    next = c.q_end;
    EXPECT_EQ(c.k_begin % 16, 0);
    EXPECT_TRUE(c.k_end % 16 == 0 || c.k_end == S);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t q = c.q_begin; q < c.q_end; ++q)
        for (int64_t k = 0; k < S; ++k)
          if (visible({D[b][q], I[b][q]}, q, {D[b][k], I[b][k]}, k))
            EXPECT_TRUE(k >= c.k_begin && k < c.k_end) << b << " " << q << " sees " << k;
  }
  EXPECT_EQ(next, S);
}

// A causal row: each block of queries sees the keys up to its end (5/8 of the square with four
// blocks); an image makes the block holding its start see to its end; a second document starts
// its blocks' keys at its own start. Nothing to skip, or too short: no chunks.
TEST(AttentionChunks, SkipWhatTheMaskHides) {
  const int64_t S = 64;
  at::Tensor doc = torch::zeros({1, S}, torch::kInt), item = torch::full({1, S}, -1, torch::kInt);
  auto ranges = [](const std::vector<AttentionChunk>& cs) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const AttentionChunk& c : cs) out.emplace_back(c.k_begin, c.k_end);
    return out;
  };
  using R = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(ranges(attention_chunks(doc, item, 16)), (R{{0, 16}, {0, 32}, {0, 48}, {0, 64}}));
  item.narrow(1, 20, 20).fill_(0);  // an image at [20, 40)
  EXPECT_EQ(ranges(attention_chunks(doc, item, 16)), (R{{0, 16}, {0, 48}, {0, 48}, {0, 64}}));
  item.fill_(-1);
  doc.narrow(1, 32, 32).fill_(1);  // a second document from 32
  EXPECT_EQ(ranges(attention_chunks(doc, item, 16)), (R{{0, 16}, {0, 32}, {32, 48}, {32, 64}}));
  EXPECT_TRUE(attention_chunks(doc, item, 33).empty());  // fewer than two blocks
  item.fill_(0);
  doc.fill_(0);  // one item over the whole row: everything visible
  EXPECT_TRUE(attention_chunks(doc, item, 16).empty());
}

}  // namespace
}  // namespace weft::model
