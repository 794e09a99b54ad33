// Blocked attention (model/blocked_attention.h) against masked softmax attention computed in
// double: outputs and the gradients of q, k and v, in fp32 and bf16, with weft's multimodal mask
// (packed documents, image spans seen both ways, padding), grouped-query heads, sequences that
// are no multiple of the block, fewer queries than keys (a context-parallel rank), no mask; and
// blocks of keys hidden from every query are never read.
#include "weft/model/blocked_attention.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

#include "weft/core/error.h"
#include "weft/model/chunked_attention.h"
#include "weft/model/mask.h"
#include "weft/model/torch_compat.h"

namespace weft::model {
namespace {

at::Tensor dbl(const at::Tensor& t) { return t.detach().to(torch::kDouble); }

double rel_diff(const at::Tensor& got, const at::Tensor& want) {
  return (dbl(got) - dbl(want)).abs().max().item<double>() /
         std::max(dbl(want).abs().max().item<double>(), 1e-30);
}

// softmax(scale·q·kᵀ over visible keys)·v in double; K/V head h / (H / KV) for query head h.
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& visible, double scale) {
  const int64_t rep = q.size(1) / k.size(1);
  const at::Tensor ke = k.repeat_interleave(rep, 1), ve = v.repeat_interleave(rep, 1);
  at::Tensor s = at::matmul(q, ke.transpose(-2, -1)) * scale;
  if (visible.defined())
    s = s.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(s, -1), ve);
}

// Two packed documents per row, each a text span with an image span inside (bidirectional), and
// padding at the end of row 1 (doc = item = -1: sees only itself).
at::Tensor multimodal_mask(int64_t B, int64_t S) {
  at::Tensor doc = torch::zeros({B, S}, torch::kInt), item = torch::full({B, S}, -1, torch::kInt);
  doc.narrow(1, S / 2, S - S / 2).fill_(1);
  item[0].narrow(0, 2, 6).fill_(0);
  item[0].narrow(0, S / 2 + 1, 5).fill_(1);
  item[1].narrow(0, 1, 9).fill_(0);
  doc[1].narrow(0, S - 4, 4).fill_(-1);
  return visible_mask(doc, item);
}

struct Case {
  at::ScalarType dtype;
  int64_t heads, kv_heads, queries, keys, block;
  bool masked;
};

class BlockedAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(BlockedAttentionTest, MatchesSoftmaxAttentionForwardAndBackward) {
  const Case c = GetParam();
  torch::manual_seed(11);
  const int64_t B = 2, D = 16;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor visible;
  if (c.masked) {  // fewer queries than keys: the last `queries` rows of the full mask
    visible = multimodal_mask(B, c.keys).narrow(2, c.keys - c.queries, c.queries).contiguous();
  }
  at::Tensor q = (torch::randn({B, c.heads, c.queries, D}) * 2).to(c.dtype).requires_grad_(true);
  at::Tensor k = (torch::randn({B, c.kv_heads, c.keys, D}) * 2).to(c.dtype).requires_grad_(true);
  at::Tensor v = torch::randn({B, c.kv_heads, c.keys, D}).to(c.dtype).requires_grad_(true);
  at::Tensor o = blocked_attention(q, k, v, visible, scale, c.block);
  ASSERT_EQ(o.sizes(), q.sizes());
  ASSERT_EQ(o.scalar_type(), c.dtype);

  at::Tensor qd = dbl(q).requires_grad_(true), kd = dbl(k).requires_grad_(true);
  at::Tensor vd = dbl(v).requires_grad_(true);
  at::Tensor want = reference(qd, kd, vd, visible, scale);
  const double tol = c.dtype == at::kFloat ? 2e-5 : 2e-2;
  EXPECT_LT(rel_diff(o, want), tol);

  at::Tensor g = torch::randn(o.sizes()).to(c.dtype);
  const std::vector<at::Tensor> got = torch::autograd::grad({o}, {q, k, v}, {g});
  const std::vector<at::Tensor> ref = torch::autograd::grad({want}, {qd, kd, vd}, {dbl(g)});
  const char* names[] = {"dq", "dk", "dv"};
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_EQ(got[i].sizes(), ref[i].sizes()) << names[i];
    EXPECT_EQ(got[i].scalar_type(), c.dtype) << names[i];
    EXPECT_LT(rel_diff(got[i], ref[i]), 2 * tol) << names[i];
  }
}

INSTANTIATE_TEST_SUITE_P(
    Blocked, BlockedAttentionTest,
    ::testing::Values(Case{at::kFloat, 6, 2, 23, 23, 5, true},   // GQA, ragged blocks
                      Case{at::kFloat, 4, 4, 30, 30, 8, true},   // one K/V head per query head
                      Case{at::kFloat, 6, 3, 12, 31, 7, true},   // fewer queries than keys
                      Case{at::kFloat, 4, 2, 17, 17, 4, false},  // no mask
                      Case{at::kBFloat16, 6, 2, 23, 23, 5, true},
                      Case{at::kBFloat16, 4, 1, 40, 40, 16, true}));

TEST(BlockedAttention, KeysNoQuerySeesAreNeverRead) {
  torch::manual_seed(12);
  const int64_t B = 2, H = 4, KV = 2, S = 24, D = 8, block = 8;
  // Causal: the block of keys 16..23 is hidden from queries 0..7, so that tile is skipped.
  // Queries 0..7 only: keys 8..23 are hidden from every query, NaN there must not leak.
  at::Tensor pos = torch::arange(S);
  at::Tensor causal =
      (pos.view({S, 1}) >= pos.view({1, S})).view({1, 1, S, S}).expand({B, 1, S, S});
  at::Tensor visible = causal.narrow(2, 0, block).contiguous();
  at::Tensor q = torch::randn({B, H, block, D});
  at::Tensor k = torch::randn({B, KV, S, D}), v = torch::randn({B, KV, S, D});
  at::Tensor k_nan = k.clone(), v_nan = v.clone();
  k_nan.narrow(2, block, S - block).fill_(std::numeric_limits<float>::quiet_NaN());
  v_nan.narrow(2, block, S - block).fill_(std::numeric_limits<float>::quiet_NaN());
  const double scale = 0.3;
  at::Tensor o = blocked_attention(q, k_nan, v_nan, visible, scale, block);
  EXPECT_TRUE(torch::isfinite(o).all().item<bool>());
  EXPECT_LT(rel_diff(o, reference(dbl(q), dbl(k), dbl(v), visible, scale)), 2e-5);
}

TEST(BlockedAttention, TakesOverFromTheDensePathForLongKeys) {
  at::Tensor q = torch::randn({1, 2, 4, 8}), k = torch::randn({1, 1, 2 * kAttentionBlock + 1, 8});
  EXPECT_TRUE(blocked_attention_applies(q, k));
  EXPECT_FALSE(blocked_attention_applies(q, k.narrow(2, 0, 2 * kAttentionBlock)));
  EXPECT_FALSE(blocked_attention_applies(q.to(torch::kDouble), k.to(torch::kDouble)));
  // compat::attention (the dense path below one block) agrees with it.
  torch::manual_seed(13);
  const int64_t S = 40;
  at::Tensor visible = multimodal_mask(2, S);
  at::Tensor qs = torch::randn({2, 4, S, 8}), ks = torch::randn({2, 2, S, 8});
  at::Tensor vs = torch::randn({2, 2, S, 8});
  EXPECT_LT(rel_diff(blocked_attention(qs, ks, vs, visible, 0.35, 16),
                     compat::attention(qs, ks, vs, visible, 0.35)),
            2e-5);
}

// The mask prepared once for all blocks (compat::attention_mask: additive on the SDPA path, the
// boolean one elsewhere) gives exactly what the boolean mask gives, outputs and gradients, in
// fp32 and bf16.
TEST(BlockedAttention, PreparedMaskGivesWhatTheBooleanOneGives) {
  torch::manual_seed(17);
  const int64_t S = 40;
  const at::Tensor visible = multimodal_mask(2, S);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(dt == at::kFloat ? "fp32" : "bf16");
    const at::Tensor prepared = compat::attention_mask(visible, dt);
    EXPECT_EQ(prepared.scalar_type(), compat::kHasSdpa ? dt : at::kBool);
    std::vector<at::Tensor> outs, grads;
    for (const at::Tensor& mask : {visible, prepared}) {
      torch::manual_seed(18);
      at::Tensor q = torch::randn({2, 4, S, 8}).to(dt).requires_grad_(true);
      at::Tensor k = torch::randn({2, 2, S, 8}).to(dt).requires_grad_(true);
      at::Tensor v = torch::randn({2, 2, S, 8}).to(dt).requires_grad_(true);
      at::Tensor o = compat::attention(q, k, v, mask, 0.35);
      o.backward(torch::ones_like(o));
      outs.push_back(o.detach());
      grads.insert(grads.end(), {q.grad(), k.grad(), v.grad()});
    }
    EXPECT_TRUE(torch::equal(outs[0], outs[1]));
    for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(grads[i], grads[i + 3])) << i;
  }
  EXPECT_FALSE(compat::attention_mask(at::Tensor(), at::kFloat).defined());
}

// Attention by query blocks over tiles of their keys (model::chunked_attention), the tiles merged
// by their log-sum-exps, gives what one attention over all keys gives: outputs and the gradients
// of q, k and v; with LibTorch's kernels and with the fp32 reference tiles; grouped-query heads;
// fp32 and bf16. The layouts: documents, images and padding mixed over the rows (most tiles
// masked); causal rows with an image (unmasked and causal tiles, unmasked and masked ones in a
// block); causal text in one causal tile (K/V expanded for that tile alone); a block of three
// tiles, a masked one where a row sees none of its keys (its second document starts later); and
// blocks that do not divide the row (the last one shorter).
TEST(ChunkedAttention, MatchesOneAttentionOverAllKeys) {
  const int64_t B = 2, H = 4, KV = 2, S = 48, D = 8;
  struct Case {
    std::string name;
    at::Tensor doc, item;
    int64_t chunk;
    std::string tiles;  // expected: per block, each tile's keys and kind (A, C, M)
  };
  auto zeros = [&] { return torch::zeros({B, S}, torch::kInt); };
  auto text = [&] { return torch::full({B, S}, -1, torch::kInt); };
  std::vector<Case> cases;
  {
    Case c{"mixed rows", zeros(), text(), 16, ""};
    c.item[0].narrow(0, 18, 10).fill_(0);  // an image across two blocks
    c.doc[1].narrow(0, 30, 18).fill_(1);   // a second document
    c.item[1].narrow(0, 33, 6).fill_(0);
    c.doc[1].narrow(0, S - 3, 3).fill_(-1);  // padding
    c.tiles = "0-18C | 0-48M | 0-48M | ";
    cases.push_back(c);
  }
  {
    Case c{"causal rows with an image", zeros(), text(), 16, "0-36C | 0-36A 36-48M | "};
    c.item.narrow(1, 36, 6).fill_(0);  // the same image in both rows, inside the last block
    cases.push_back(c);
  }
  cases.push_back({"causal text, one tile", zeros(), text(), S, "0-48C | "});
  {
    Case c{"a row that sees none of a masked tile", zeros(), text(), 16,
           "0-16C | 0-16M 16-32C | 0-16M 16-32A 32-48M | "};
    c.item[0].narrow(0, 36, 4).fill_(0);
    c.doc[1].narrow(0, 16, 32).fill_(1);  // row 1: a second document from 16
    cases.push_back(c);
  }
  {
    Case c{"an image at one place in every row", zeros(), text(), 8,
           "0-20C | 0-36A | 0-35A 35-48C | "};
    c.item.narrow(1, 20, 16).fill_(0);
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const at::Tensor visible = visible_mask(c.doc, c.item);
    const std::vector<AttentionChunk> chunks =
        attention_chunks(c.doc, c.item, c.chunk, /*most=*/1.0);
    EXPECT_EQ(describe(chunks), c.tiles);
    for (TileKernels kernels : {TileKernels::kFastest, TileKernels::kMath})
      for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
        SCOPED_TRACE(
            std::string(kernels == TileKernels::kMath ? "fp32 reference tiles" : "kernels") +
            (dt == at::kFloat ? ", fp32" : ", bf16"));
        const double tol = dt == at::kFloat ? 1e-5 : 2e-2;
        const at::Tensor prepared = compat::attention_mask(visible, dt);
        std::vector<at::Tensor> got, want;
        for (bool chunked : {false, true}) {
          torch::manual_seed(21);
          at::Tensor q = torch::randn({B, H, S, D}).to(dt).requires_grad_(true);
          at::Tensor k = torch::randn({B, KV, S, D}).to(dt).requires_grad_(true);
          at::Tensor v = torch::randn({B, KV, S, D}).to(dt).requires_grad_(true);
          at::Tensor o = chunked
                             ? chunked_attention(q, k, v, chunks, chunk_masks(prepared, chunks, dt),
                                                 0.3, kernels)
                             : reference(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble),
                                         visible, 0.3);
          EXPECT_EQ(o.sizes(), q.sizes());
          o.backward(torch::randn(o.sizes()).to(dt).to(o.scalar_type()));
          (chunked ? got : want)
              .insert((chunked ? got : want).end(), {o.detach(), q.grad(), k.grad(), v.grad()});
        }
        const char* names[] = {"output", "dq", "dk", "dv"};
        for (size_t i = 0; i < 4; ++i) EXPECT_LT(rel_diff(got[i], want[i]), tol) << names[i];
      }
  }
}

// The graph keeps no per-tile state that a backward spends: a second backward through the same
// forward (retain_graph) gives the same gradients again.
TEST(ChunkedAttention, ASecondBackwardGivesTheSameGradients) {
  const int64_t S = 32;
  at::Tensor doc = torch::zeros({1, S}, torch::kInt), item = torch::full({1, S}, -1, torch::kInt);
  item.narrow(1, 4, 8).fill_(0);
  const std::vector<AttentionChunk> chunks = attention_chunks(doc, item, 8);
  ASSERT_FALSE(chunks.empty());
  const at::Tensor masks = compat::attention_mask(visible_mask(doc, item), at::kFloat);
  at::Tensor q = torch::randn({1, 2, S, 4}).requires_grad_(true);
  at::Tensor o =
      chunked_attention(q, q, q, chunks, chunk_masks(masks, chunks, at::kFloat), 0.5).sum();
  o.backward({}, /*retain_graph=*/true);
  const at::Tensor first = q.grad().clone();
  q.grad().zero_();
  o.backward();
  EXPECT_TRUE(torch::allclose(q.grad(), first, 1e-6, 1e-6));
}

// Long causal tiles (join_causal_tiles) in the fp32 reference give softmax attention; a
// kernel that aligns is_causal to the upper left (LibTorch's CPU flash attention) refuses them
// rather than computing another mask.
TEST(ChunkedAttention, LongCausalTilesOnlyWhereTheKernelTakesThem) {
  const int64_t S = 48;
  at::Tensor doc = torch::zeros({2, S}, torch::kInt), item = torch::full({2, S}, -1, torch::kInt);
  item.narrow(1, 3, 9).fill_(0);
  doc[1].narrow(0, 40, 8).fill_(1);
  const std::vector<AttentionChunk> chunks = attention_chunks(doc, item, 8, /*most=*/1.0);
  const std::vector<AttentionChunk> joined = join_causal_tiles(chunks);
  bool longer = false;  // some causal tile now starts before its block
  for (const AttentionChunk& c : joined)
    for (const AttentionTile& t : c.tiles)
      longer = longer || (t.kind == TileKind::kCausal && t.k_begin < c.q_begin);
  ASSERT_TRUE(longer);
  const at::Tensor masks = compat::attention_mask(visible_mask(doc, item), at::kFloat);
  torch::manual_seed(3);
  const at::Tensor q = torch::randn({2, 4, S, 8}), k = torch::randn({2, 2, S, 8});
  const at::Tensor v = torch::randn({2, 2, S, 8});
  auto run = [&](const std::vector<AttentionChunk>& c, TileKernels kernels) {
    return chunked_attention(q, k, v, c, chunk_masks(masks, c, at::kFloat), 0.4, kernels);
  };
  const at::Tensor want = reference(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble),
                                    visible_mask(doc, item), 0.4);
  EXPECT_LT(rel_diff(run(joined, TileKernels::kMath), want), 1e-5);
#if WEFT_TORCH_AT_LEAST(2, 3)
  EXPECT_THROW(run(joined, TileKernels::kFastest), weft::Error);
#endif
}

TEST(BlockedAttention, RejectsAMaskOfAnotherShape) {
  at::Tensor q = torch::randn({1, 2, 4, 8}), k = torch::randn({1, 1, 6, 8});
  at::Tensor bad = torch::ones({1, 1, 4, 5}, torch::kBool);
  EXPECT_THROW(blocked_attention(q, k, k, bad, 1.0, 2), c10::Error);
}

}  // namespace
}  // namespace weft::model
