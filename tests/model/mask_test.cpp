// Attention-mask semantics (core/mask.h) on hand-built sequences with the expected visibility
// written out row by row, and the dense mask (model/mask.h) against weft::visible.
#include "weft/model/mask.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <initializer_list>
#include <random>
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

// Rows of packed documents of random lengths, each with images (contiguous items) inside and
// padding at the end, as the collator lays them out.
std::pair<at::Tensor, at::Tensor> random_rows(int64_t B, int64_t S, uint64_t seed) {
  at::Tensor doc = torch::full({B, S}, -1, torch::kInt),
             item = torch::full({B, S}, -1, torch::kInt);
  auto D = doc.accessor<int32_t, 2>();
  auto I = item.accessor<int32_t, 2>();
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = uniform(S / 2, S);  // then padding
    int32_t d = 0, it = 0;
    for (int64_t s = 0; s < used; ++d) {
      const int64_t len = std::min(used - s, uniform(4, S / 2));
      for (int64_t j = 0; j < len; ++j) D[b][s + j] = d;
      for (int64_t images = uniform(0, 2); images > 0; --images) {
        const int64_t n = uniform(1, std::max<int64_t>(1, len / 3));
        const int64_t at = s + uniform(0, len - n);
        if (I[b][at] >= 0 || I[b][at + n - 1] >= 0) continue;  // no overlap with another image
        bool free = true;
        for (int64_t j = 0; j < n; ++j) free = free && I[b][at + j] < 0;
        if (!free) continue;
        for (int64_t j = 0; j < n; ++j) I[b][at + j] = it;
        ++it;
      }
      s += len;
    }
  }
  return {doc, item};
}

// Chunks partition the queries; a key in no tile is hidden from all of the block's queries in
// every row, an unmasked tile's keys are seen by all of them, a causal tile is exactly the
// triangle; tiles are in key order, one call per run of a kind; blocks with masked tiles hold
// at most `chunk` queries (8 or 16). On random packed rows, and (every second seed) on rows all
// laid out as the first, where blocks of one pattern run longer (half of those with row 1's items
// removed: its image tokens see causally where the others see the whole image).
TEST(AttentionChunks, TilesSayExactlyWhatEveryRowSees) {
  const int64_t B = 3, S = 96;
  int64_t kinds[3] = {0, 0, 0}, long_blocks = 0, long_causal = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    auto [doc, item] = random_rows(B, S, seed);
    if (seed % 2 == 0) {
      doc = doc[0].unsqueeze(0).repeat({B, 1});
      item = item[0].unsqueeze(0).repeat({B, 1});
      if (seed % 4 == 0) item[1].fill_(-1);  // row 1 the same documents, without items
    }
    const int64_t chunk = seed % 3 == 0 ? 8 : 16;
    const std::vector<AttentionChunk> planned = attention_chunks(doc, item, chunk, /*most=*/1.0);
    auto D = doc.accessor<int32_t, 2>();
    auto I = item.accessor<int32_t, 2>();
    // The plan, and the same joined for kernels with long causal tiles (query q of a causal tile
    // sees its keys up to q, wherever the tile begins).
    for (bool joined : {false, true}) {
      SCOPED_TRACE(joined ? "joined" : "planned");
      const std::vector<AttentionChunk> chunks = joined ? join_causal_tiles(planned) : planned;
      int64_t next = 0;
      for (const AttentionChunk& c : chunks) {
        EXPECT_EQ(c.q_begin, next);
        next = c.q_end;
        bool masked = false;
        for (const AttentionTile& t : c.tiles) masked = masked || t.kind == TileKind::kMasked;
        if (masked) {
          EXPECT_LE(c.q_end - c.q_begin, chunk);
        }
        long_blocks += c.q_end - c.q_begin > 16;
        int64_t k_next = 0;
        for (size_t i = 0; i < c.tiles.size(); ++i) {
          const AttentionTile& t = c.tiles[i];
          EXPECT_GE(t.k_begin, k_next);
          k_next = t.k_end;
          ++kinds[static_cast<int>(t.kind)];
          if (i > 0 && c.tiles[i - 1].k_end == t.k_begin) {
            EXPECT_TRUE(t.kind == TileKind::kCausal || c.tiles[i - 1].kind != t.kind);
          }
          if (t.kind == TileKind::kCausal) {
            EXPECT_EQ(t.k_end, c.q_end);
            if (!joined) {
              EXPECT_EQ(t.k_begin, c.q_begin);
            }
            EXPECT_LE(t.k_begin, c.q_begin);
            long_causal += t.k_begin < c.q_begin;
          }
        }
        for (int64_t b = 0; b < B; ++b)
          for (int64_t q = c.q_begin; q < c.q_end; ++q)
            for (int64_t k = 0; k < S; ++k) {
              const bool sees = visible({D[b][q], I[b][q]}, q, {D[b][k], I[b][k]}, k);
              const AttentionTile* in = nullptr;
              for (const AttentionTile& t : c.tiles)
                if (k >= t.k_begin && k < t.k_end) in = &t;
              if (!in) {
                EXPECT_FALSE(sees) << seed << ": " << b << " " << q << " sees " << k;
              } else if (in->kind == TileKind::kAll) {
                EXPECT_TRUE(sees) << seed << ": " << b << " " << q << " misses " << k;
              } else if (in->kind == TileKind::kCausal) {
                EXPECT_EQ(sees, k <= q) << seed << ": " << b << " " << q << ", " << k;
              }
            }
      }
      EXPECT_EQ(next, S);
    }
  }
  for (int kind = 0; kind < 3; ++kind) EXPECT_GT(kinds[kind], 0) << kind;  // every kind met
  EXPECT_GT(long_blocks, 0);
  EXPECT_GT(long_causal, 0);  // the join made some
}

// Runs of one pattern shorter than a quarter of a block stay in blocks of `chunk`: rows of
// 24-token images every 48 tokens, alike in every row, take S / chunk blocks, not one per run.
// An image run of 195 queries (as gpu-1b-vlm's) is a block of its own.
TEST(AttentionChunks, ShortRunsStayInBlocks) {
  const int64_t B = 4, S = 4096;
  at::Tensor doc = torch::zeros({B, S}, torch::kInt), item = torch::full({B, S}, -1, torch::kInt);
  for (int64_t s = 24, n = 0; s + 24 <= S; s += 48, ++n) item.narrow(1, s, 24).fill_(n);
  EXPECT_EQ(attention_chunks(doc, item, 512, /*most=*/1.0).size(), 8u);
  item.fill_(-1);
  item.narrow(1, 1, 196).fill_(0);
  EXPECT_EQ(describe(join_causal_tiles(attention_chunks(doc, item, 512))),
            "0-1A | 0-197A | 0-4096C | ");
}

// A causal row: each block is its causal diagonal after one unmasked tile of the keys before it;
// an image makes the tiles it cuts through masked; a second document starts its blocks' keys at
// its own start. A lone block, causal, is one causal tile. Nothing to skip, or descriptors
// that are not spans (a document resumed after another): no chunks.
TEST(AttentionChunks, SkipWhatTheMaskHides) {
  const int64_t S = 64;
  at::Tensor doc = torch::zeros({1, S}, torch::kInt), item = torch::full({1, S}, -1, torch::kInt);
  EXPECT_EQ(describe(attention_chunks(doc, item, 16)), "0-64C | ");
  EXPECT_EQ(describe(attention_chunks(doc, item, 64)), "0-64C | ");
  item.narrow(1, 20, 20).fill_(0);  // an image at [20, 40)
  EXPECT_EQ(describe(attention_chunks(doc, item, 16)), "0-20C | 0-40A | 0-39A 39-64C | ");
  {  // the image at [20, 40) in one row, [24, 44) in the other: blocks of 16 with masks there
    at::Tensor doc2 = torch::zeros({2, S}, torch::kInt);
    at::Tensor item2 = torch::full({2, S}, -1, torch::kInt);
    item2[0].narrow(0, 20, 20).fill_(0);
    item2[1].narrow(0, 24, 20).fill_(0);
    EXPECT_EQ(describe(attention_chunks(doc2, item2, 16)),
              "0-20C | 0-20A 20-48M | 0-36A 36-48M | 0-43A 43-64C | ");
  }
  item.fill_(-1);
  doc.narrow(1, 32, 32).fill_(1);  // a second document from 32
  EXPECT_EQ(describe(attention_chunks(doc, item, 16)), "0-32C | 32-64C | ");
  doc.narrow(1, 48, 8).fill_(0);  // document 0 resumed after document 1
  EXPECT_TRUE(attention_chunks(doc, item, 16).empty());
  item.fill_(0);
  doc.fill_(0);  // one item over the whole row: everything visible
  EXPECT_TRUE(attention_chunks(doc, item, 16).empty());
}

// For kernels that take long causal tiles: a block's unmasked keys before its diagonal join the
// diagonal, and blocks of one causal tile from the same key join, so a causal row is one block;
// blocks with a masked tile stay as they were (their masks are made per block); a second
// document's blocks join among themselves.
TEST(AttentionChunks, JoinCausalTiles) {
  const int64_t S = 64;
  at::Tensor doc = torch::zeros({1, S}, torch::kInt), item = torch::full({1, S}, -1, torch::kInt);
  auto joined = [&] { return describe(join_causal_tiles(attention_chunks(doc, item, 16))); };
  EXPECT_EQ(joined(), "0-64C | ");
  const std::vector<AttentionChunk> one = join_causal_tiles(attention_chunks(doc, item, 16));
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].q_begin, 0);
  EXPECT_EQ(one[0].q_end, S);
  item.narrow(1, 20, 20).fill_(0);  // an image at [20, 40)
  EXPECT_EQ(joined(), "0-20C | 0-40A | 0-64C | ");
  item.narrow(1, 20, 20).fill_(-1);
  item.narrow(1, 2, 12).fill_(0);  // an image inside the first block: the rest is one block
  EXPECT_EQ(joined(), "0-16M | 0-64C | ");
  item.fill_(-1);
  doc.narrow(1, 32, 32).fill_(1);  // a second document from 32
  EXPECT_EQ(joined(), "0-32C | 32-64C | ");
}

}  // namespace
}  // namespace weft::model
