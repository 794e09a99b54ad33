// Collation of hand-made samples, padded and packed, against tensors written out by hand.
#include "weft/data/collate.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "support/errors.h"
#include "weft/core/error.h"

namespace weft::data {
namespace {

using Rows = std::vector<std::vector<int64_t>>;

Rows rows_of(const at::Tensor& t) {
  at::Tensor l = t.to(torch::kLong).contiguous();
  Rows out(l.size(0));
  auto a = l.accessor<int64_t, 2>();
  for (int64_t r = 0; r < l.size(0); ++r)
    for (int64_t c = 0; c < l.size(1); ++c) out[r].push_back(a[r][c]);
  return out;
}

std::vector<int64_t> vec_of(const at::Tensor& t) {
  at::Tensor l = t.to(torch::kLong).contiguous();
  return std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
}

// Encoder 0 ("vision") placeholders are token 2, encoder 1 ("audio") token 3; 2 tokens each.
// Inputs are constant-filled so their order in the stacked batch can be read back.
ModalityItem image(int64_t start, float fill) {
  return {0, start, 2, torch::full({3, 4, 4}, fill)};
}
ModalityItem clip(int64_t start, float fill) { return {1, start, 2, torch::full({5, 4}, fill)}; }

// A: <bos> img img 5 6      targets 5 6
// B: <bos> 7 8              target 8
// C: <bos> img img aud aud 9  target 9
Sample sample_a() { return {{1, 2, 2, 5, 6}, {0, 0, 0, 1, 1}, {image(1, 10.f)}, 3, "5 6"}; }
Sample sample_b() { return {{1, 7, 8}, {0, 0, 1}, {}, 2, "8"}; }
Sample sample_c() {
  return {{1, 2, 2, 3, 3, 9}, {0, 0, 0, 0, 0, 1}, {image(1, 20.f), clip(3, 30.f)}, 5, "9"};
}

CollateOptions options(bool packing, int64_t max_seq) {
  CollateOptions o;
  o.num_encoders = 2;
  o.pad_id = 0;
  o.packing = packing;
  o.max_seq = max_seq;
  return o;
}

TEST(Collate, PaddedOneSamplePerRow) {
  const Microbatch mb = collate({sample_a(), sample_b(), sample_c()}, options(false, 16));
  EXPECT_EQ(mb.samples, 3);
  EXPECT_EQ(mb.real_tokens, 5 + 3 + 6);
  EXPECT_EQ(mb.sum_sq_doc_len, 25.0 + 9.0 + 36.0);
  EXPECT_EQ(mb.tokens.scalar_type(), torch::kLong);
  EXPECT_EQ(mb.doc.scalar_type(), torch::kInt);
  EXPECT_EQ(mb.item.scalar_type(), torch::kInt);
  EXPECT_EQ(rows_of(mb.tokens), (Rows{{1, 2, 2, 5, 6, 0},  //
                                      {1, 7, 8, 0, 0, 0},
                                      {1, 2, 2, 3, 3, 9}}));
  EXPECT_EQ(rows_of(mb.positions), (Rows{{0, 1, 2, 3, 4, 0},  //
                                         {0, 1, 2, 0, 0, 0},
                                         {0, 1, 2, 3, 4, 5}}));
  EXPECT_EQ(rows_of(mb.doc), (Rows{{0, 0, 0, 0, 0, -1},  //
                                   {0, 0, 0, -1, -1, -1},
                                   {0, 0, 0, 0, 0, 0}}));
  EXPECT_EQ(rows_of(mb.item), (Rows{{-1, 0, 0, -1, -1, -1},  //
                                    {-1, -1, -1, -1, -1, -1},
                                    {-1, 0, 0, 1, 1, -1}}));
  // Row r·S + t predicts token t+1 when that token is a target (S = 6).
  EXPECT_EQ(vec_of(mb.target_rows), (std::vector<int64_t>{2, 3, 6 + 1, 12 + 4}));
  EXPECT_EQ(vec_of(mb.targets), (std::vector<int64_t>{5, 6, 8, 9}));
  ASSERT_EQ(mb.encoder_rows.size(), 2u);
  EXPECT_EQ(vec_of(mb.encoder_rows[0]), (std::vector<int64_t>{1, 2, 12 + 1, 12 + 2}));
  EXPECT_EQ(vec_of(mb.encoder_rows[1]), (std::vector<int64_t>{12 + 3, 12 + 4}));
  ASSERT_EQ(mb.encoder_inputs.size(), 2u);
  EXPECT_EQ(mb.encoder_inputs[0].sizes(), (std::vector<int64_t>{2, 3, 4, 4}));
  EXPECT_EQ(mb.encoder_inputs[1].sizes(), (std::vector<int64_t>{1, 5, 4}));
  EXPECT_TRUE(torch::equal(mb.encoder_inputs[0][0], torch::full({3, 4, 4}, 10.f)));
  EXPECT_TRUE(torch::equal(mb.encoder_inputs[0][1], torch::full({3, 4, 4}, 20.f)));
  EXPECT_TRUE(torch::equal(mb.encoder_inputs[1][0], torch::full({5, 4}, 30.f)));
}

TEST(Collate, PackedDocumentsRestartPositionsAndKeepItemIdsUnique) {
  // First fit in order with max_seq 11: A (5) + C (6) fill row 0 exactly; B opens row 1.
  const Microbatch mb = collate({sample_a(), sample_c(), sample_b()}, options(true, 11));
  EXPECT_EQ(mb.samples, 3);
  EXPECT_EQ(mb.real_tokens, 14);
  EXPECT_EQ(mb.sum_sq_doc_len, 70.0);
  EXPECT_EQ(rows_of(mb.tokens), (Rows{{1, 2, 2, 5, 6, 1, 2, 2, 3, 3, 9},  //
                                      {1, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0}}));
  EXPECT_EQ(rows_of(mb.positions), (Rows{{0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5},  //
                                         {0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0}}));
  EXPECT_EQ(rows_of(mb.doc), (Rows{{0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1},  //
                                   {0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1}}));
  // A's image is item 0, C's image and clip are items 1 and 2: unique within the row.
  EXPECT_EQ(rows_of(mb.item), (Rows{{-1, 0, 0, -1, -1, -1, 1, 1, 2, 2, -1},  //
                                    {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}}));
  // S = 11: A's targets at rows 2, 3; C (offset 5) predicts 9 from t=4 → 9; B in row 1 → 11 + 1.
  EXPECT_EQ(vec_of(mb.target_rows), (std::vector<int64_t>{2, 3, 9, 12}));
  EXPECT_EQ(vec_of(mb.targets), (std::vector<int64_t>{5, 6, 9, 8}));
  EXPECT_EQ(vec_of(mb.encoder_rows[0]), (std::vector<int64_t>{1, 2, 6, 7}));
  EXPECT_EQ(vec_of(mb.encoder_rows[1]), (std::vector<int64_t>{8, 9}));
  EXPECT_TRUE(torch::equal(mb.encoder_inputs[0][1], torch::full({3, 4, 4}, 20.f)));

  // Encoder rows point at placeholder tokens, carrying an item id; targets are what the tokens
  // one row later hold.
  at::Tensor flat_tok = mb.tokens.reshape(-1), flat_item = mb.item.reshape(-1);
  EXPECT_TRUE(flat_tok.index_select(0, mb.encoder_rows[0]).eq(2).all().item<bool>());
  EXPECT_TRUE(flat_tok.index_select(0, mb.encoder_rows[1]).eq(3).all().item<bool>());
  EXPECT_TRUE(flat_item.index_select(0, mb.encoder_rows[0]).ge(0).all().item<bool>());
  EXPECT_TRUE(torch::equal(flat_tok.index_select(0, mb.target_rows + 1), mb.targets));
}

// A target on a document's first token has no preceding token of its own document: packing must
// not let the previous document's last token predict it.
TEST(Collate, NoTargetAcrossPackedDocumentBoundary) {
  Sample first = sample_b();   // <bos> 7 8
  Sample second = sample_b();  // 4 7 8 with every token a target
  second.tokens = {4, 7, 8};
  second.is_target = {1, 1, 1};
  const Microbatch mb = collate({first, second}, options(true, 6));
  ASSERT_EQ(mb.tokens.size(0), 1);
  EXPECT_EQ(vec_of(mb.target_rows), (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(vec_of(mb.targets), (std::vector<int64_t>{8, 7, 8}));
}

TEST(Collate, EmptyEncoderHasNoInputAndNoRows) {
  const Microbatch mb = collate({sample_b()}, options(false, 0));
  ASSERT_EQ(mb.encoder_inputs.size(), 2u);
  EXPECT_FALSE(mb.encoder_inputs[0].defined());
  EXPECT_FALSE(mb.encoder_inputs[1].defined());
  EXPECT_EQ(mb.encoder_rows[0].numel(), 0);
  EXPECT_EQ(mb.encoder_rows[0].scalar_type(), torch::kLong);
  EXPECT_EQ(mb.tokens.sizes(), (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(mb.doc.eq(0).all().item<bool>());  // no padding in a lone sample
}

// A rank loads only the items its encoder stages read: the microbatch holds those inputs and
// where they start; the rows still place every item.
TEST(Collate, PartlyLoadedItemsKeepTheirPlace) {
  Sample a = sample_a(), c = sample_c(), a2 = sample_a();
  a.items[0].input = at::Tensor();  // vision items: [-, 20, 10] -> loaded from item 1
  a2.items[0].input = torch::full({3, 4, 4}, 40.f);
  c.items[1].input = at::Tensor();  // the one audio item: none loaded
  const Microbatch mb = collate({a, c, a2}, options(false, 16));
  ASSERT_EQ(mb.encoder_first.size(), 2u);
  EXPECT_EQ(mb.encoder_first[0], 1);
  ASSERT_EQ(mb.encoder_inputs[0].size(0), 2);
  EXPECT_TRUE(torch::equal(mb.encoder_inputs[0][0], torch::full({3, 4, 4}, 20.f)));
  EXPECT_TRUE(torch::equal(mb.encoder_inputs[0][1], torch::full({3, 4, 4}, 40.f)));
  EXPECT_EQ(mb.encoder_rows[0].numel(), 3 * 2);  // every item's placeholders
  EXPECT_FALSE(mb.encoder_inputs[1].defined());
  EXPECT_EQ(mb.encoder_first[1], 0);
  EXPECT_EQ(mb.encoder_rows[1].numel(), 2);
  // Loaded items with a gap between them are an error, not a silent shift.
  Sample gap = sample_c();
  gap.items[0].input = at::Tensor();
  const std::string e = testing::error_of([&] {
    collate({sample_a(), gap, sample_a()}, options(false, 16));
  });
  EXPECT_NE(e.find("sample 2: the loaded items of encoder 0 are not consecutive"),
            std::string::npos)
      << e;
}

TEST(Collate, PadIdFillsPadding) {
  CollateOptions o = options(false, 0);
  o.pad_id = 19;
  const Microbatch mb = collate({sample_a(), sample_b()}, o);
  EXPECT_EQ(rows_of(mb.tokens), (Rows{{1, 2, 2, 5, 6}, {1, 7, 8, 19, 19}}));
}

std::string error_of(const std::vector<Sample>& s, const CollateOptions& o) {
  try {
    collate(s, o);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no weft::Error thrown)";
}

TEST(Collate, RejectsBadSamples) {
  // C has 6 tokens; max_seq 5 rejects it, packed or padded, naming the sample and the key.
  for (bool packing : {true, false}) {
    const std::string m = error_of({sample_a(), sample_c()}, options(packing, 5));
    EXPECT_NE(m.find("sample 1"), std::string::npos) << m;
    EXPECT_NE(m.find("max_seq"), std::string::npos) << m;
  }
  EXPECT_NE(error_of({}, options(false, 0)).find("empty"), std::string::npos);
  Sample bad_targets = sample_a();
  bad_targets.is_target.pop_back();
  EXPECT_NE(error_of({bad_targets}, options(false, 0)).find("is_target"), std::string::npos);
  Sample bad_span = sample_a();
  bad_span.items[0].start = 4;  // [4, 6) runs past 5 tokens
  EXPECT_NE(error_of({bad_span}, options(false, 0)).find("placeholder span"), std::string::npos);
  Sample bad_encoder = sample_a();
  bad_encoder.items[0].encoder = 2;
  EXPECT_NE(error_of({bad_encoder}, options(false, 0)).find("encoder 2"), std::string::npos);
}

TEST(Collate, SplitIsConsecutiveAndBalanced) {
  std::vector<Sample> s;
  for (int64_t i = 0; i < 7; ++i) s.push_back({{100 + i}, {0}, {}, 1, ""});
  const auto parts = split(s, 3);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].size(), 3u);
  EXPECT_EQ(parts[1].size(), 2u);
  EXPECT_EQ(parts[2].size(), 2u);
  std::vector<int64_t> order;
  for (const auto& p : parts)
    for (const auto& x : p) order.push_back(x.tokens[0]);
  EXPECT_EQ(order, (std::vector<int64_t>{100, 101, 102, 103, 104, 105, 106}));

  const auto more_parts = split({s[0], s[1]}, 3);
  ASSERT_EQ(more_parts.size(), 3u);
  EXPECT_EQ(more_parts[0].size(), 1u);
  EXPECT_EQ(more_parts[1].size(), 1u);
  EXPECT_EQ(more_parts[2].size(), 0u);
  EXPECT_EQ(split(s, 1)[0].size(), 7u);
  EXPECT_THROW(split(s, 0), Error);
}

}  // namespace
}  // namespace weft::data
