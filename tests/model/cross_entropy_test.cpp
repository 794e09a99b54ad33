// model::linear_cross_entropy_sum (cross_entropy.h): the head and its cross-entropy a chunk of
// rows at a time give the loss and gradients of cross_entropy(linear(rows, w).float(), targets,
// sum), in fp32 and bf16, in one chunk, in several with a partial last one, and one row at a
// time; with only the rows, only the weight or neither requiring grad; no rows, a transposed
// weight, int32 targets, no grad mode; and twice with retain_graph; vocab-parallel over 2 and 3
// ranks against the whole vocabulary.
#include "weft/model/cross_entropy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <string>
#include <vector>

#include "support/ranks.h"
#include "weft/model/fused.h"

namespace weft::model {
namespace {

struct Result {
  double loss = 0;
  at::Tensor grad_rows, grad_weight;  // fp32, undefined where not required
};

// loss·g backpropagated (g ≠ 1: backward must scale what forward kept).
Result run(bool fused, at::ScalarType dtype, int64_t chunk, bool rows_grad, bool weight_grad) {
  torch::manual_seed(5);
  const int64_t N = 10, H = 8, V = 37;
  const at::Tensor rows = torch::randn({N, H}).to(dtype).set_requires_grad(rows_grad);
  const at::Tensor weight = torch::randn({V, H}).to(dtype).set_requires_grad(weight_grad);
  const at::Tensor targets = torch::randint(V, {N}, torch::kLong);
  const at::Tensor loss = fused ? linear_cross_entropy_sum(rows, weight, targets, chunk)
                                : at::cross_entropy_loss(at::linear(rows, weight).to(at::kFloat),
                                                         targets, {}, at::Reduction::Sum);
  Result r;
  r.loss = loss.item<double>();
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  if (rows_grad || weight_grad) {
    (loss * 0.37).backward();
    if (rows_grad) r.grad_rows = rows.grad().to(at::kFloat);
    if (weight_grad) r.grad_weight = weight.grad().to(at::kFloat);
  }
  return r;
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / b.norm().item<double>();
}

TEST(LinearCrossEntropy, MatchesTheUnfusedLossAndGradients) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    // fp32: the sums' order; bf16: the logit gradients rounded before the incoming gradient
    // scales them, instead of after.
    const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
    const Result ref = run(false, dtype, 0, true, true);
    for (int64_t chunk : {0, 3, 1}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " chunk " + std::to_string(chunk));
      const Result got = run(true, dtype, chunk, true, true);
      EXPECT_NEAR(got.loss, ref.loss, (dtype == at::kFloat ? 1e-6 : 1e-3) * ref.loss);
      EXPECT_LT(rel_diff(got.grad_rows, ref.grad_rows), tol);
      EXPECT_LT(rel_diff(got.grad_weight, ref.grad_weight), tol);
    }
  }
}

// model::cross_entropy_rows (fused.h), the CPU pass linear_cross_entropy_sum's chunks take:
// each row's loss and, in place, softmax − one-hot rounded to the logits' dtype, as the ATen
// sequence (fp32 log-sum-exp, exp, scatter, rounding) gives them, on rows wider than the vector
// lanes with a partial tail; the loss alone, logits untouched, without `grad`; a target outside
// the vocabulary an error; strided logits left to the caller.
TEST(LinearCrossEntropy, FusedRowsMatchTheAtenSequence) {
  torch::manual_seed(3);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const int64_t n = 6, V = 1013;
    const at::Tensor logits = (torch::randn({n, V}) * 4).to(dtype);
    const at::Tensor targets = torch::randint(V, {n}, torch::kLong);
    const at::Tensor f = logits.to(at::kFloat), t = targets.unsqueeze(1);
    const at::Tensor lse = at::logsumexp(f, {1}, /*keepdim=*/true);
    const at::Tensor want_loss = (lse - f.gather(1, t)).squeeze(1);
    const at::Tensor want_grad =
        (f - lse).exp().scatter_add(1, t, at::full({n, 1}, -1.0)).to(dtype).to(at::kFloat);
    at::Tensor got = logits.clone();
    const at::Tensor loss = cross_entropy_rows(got, targets, /*grad=*/true);
    ASSERT_TRUE(loss.defined());
    EXPECT_EQ(loss.scalar_type(), at::kFloat);
    EXPECT_LT(rel_diff(loss, want_loss), 1e-6);
    // fp32: the sums' order; bf16: a last bit where the fp32 values round apart.
    EXPECT_LT(rel_diff(got.to(at::kFloat), want_grad), dtype == at::kFloat ? 1e-6 : 1e-2);
    EXPECT_LT(got.to(at::kFloat).sum(1).abs().max().item<double>(), 0.05);  // Σ softmax − 1
    at::Tensor untouched = logits.clone();
    EXPECT_TRUE(cross_entropy_rows(untouched, targets, /*grad=*/false).equal(loss));
    EXPECT_TRUE(untouched.equal(logits));
  }
  at::Tensor small = torch::randn({2, 7});
  EXPECT_THROW(cross_entropy_rows(small, torch::tensor({0, 7}, torch::kLong), true), c10::Error);
  at::Tensor strided = torch::randn({7, 2}).t();
  EXPECT_FALSE(cross_entropy_rows(strided, torch::tensor({0, 1}, torch::kLong), true).defined());
}

TEST(LinearCrossEntropy, OnlyWhatRequiresGradGetsAGradient) {
  const Result ref = run(false, at::kFloat, 0, true, true);
  const Result rows_only = run(true, at::kFloat, 4, true, false);
  EXPECT_LT(rel_diff(rows_only.grad_rows, ref.grad_rows), 1e-6);
  EXPECT_FALSE(rows_only.grad_weight.defined());
  const Result weight_only = run(true, at::kFloat, 4, false, true);
  EXPECT_LT(rel_diff(weight_only.grad_weight, ref.grad_weight), 1e-6);
  const Result neither = run(true, at::kFloat, 4, false, false);
  EXPECT_NEAR(neither.loss, ref.loss, 1e-6 * ref.loss);
}

TEST(LinearCrossEntropy, EdgeCases) {
  torch::manual_seed(9);
  {  // no rows: a zero loss, and a zero (not a missing) gradient for the weight
    const at::Tensor rows = torch::randn({0, 4}).set_requires_grad(true);
    const at::Tensor weight = torch::randn({9, 4}).set_requires_grad(true);
    const at::Tensor loss = linear_cross_entropy_sum(rows, weight, torch::zeros({0}, at::kLong));
    EXPECT_EQ(loss.item<double>(), 0.0);
    loss.backward();
    ASSERT_TRUE(weight.grad().defined());
    EXPECT_EQ(weight.grad().abs().sum().item<double>(), 0.0);
  }
  // A transposed view of a weight, int32 targets, several chunks: as the unfused loss.
  const at::Tensor stored = torch::randn({4, 9});
  const at::Tensor weight = stored.t();  // [9, 4], not contiguous
  const at::Tensor rows = torch::randn({7, 4}).set_requires_grad(true);
  const at::Tensor targets = torch::randint(9, {7}, at::kInt);
  const at::Tensor ref = at::cross_entropy_loss(at::linear(rows, weight), targets.to(at::kLong), {},
                                                at::Reduction::Sum);
  ref.backward();
  const at::Tensor ref_grad = rows.grad().clone();
  rows.mutable_grad().reset();
  const at::Tensor loss = linear_cross_entropy_sum(rows, weight, targets, 3);
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-6 * ref.item<double>());
  loss.backward();
  EXPECT_LT(rel_diff(rows.grad(), ref_grad), 1e-6);
  {  // without grad mode: the loss alone, no graph
    at::NoGradGuard no_grad;
    const at::Tensor l = linear_cross_entropy_sum(rows, weight, targets, 3);
    EXPECT_FALSE(l.requires_grad());
    EXPECT_NEAR(l.item<double>(), ref.item<double>(), 1e-6 * ref.item<double>());
  }
}

TEST(LinearCrossEntropy, ASecondBackwardGivesTheSameGradients) {
  const at::Tensor rows = torch::randn({6, 4}).set_requires_grad(true);
  const at::Tensor weight = torch::randn({9, 4}).set_requires_grad(true);
  const at::Tensor targets = torch::randint(9, {6}, torch::kLong);
  const at::Tensor loss = linear_cross_entropy_sum(rows, weight, targets, 4);
  loss.backward({}, /*retain_graph=*/true);
  const at::Tensor g1 = rows.grad().clone(), w1 = weight.grad().clone();
  loss.backward();
  EXPECT_TRUE(rows.grad().equal(2 * g1));
  EXPECT_TRUE(weight.grad().equal(2 * w1));
}

// Vocab-parallel: each rank holds a block of the vocabulary's rows; the loss, the rows' gradient
// and the weight's blocks are those of the whole vocabulary, in chunks of rows whose targets fall
// on every rank (several chunks, a partial last one), also where a rank holds no chunk's target.
TEST(LinearCrossEntropy, VocabParallelMatchesTheWholeVocabulary) {
  torch::manual_seed(9);
  const int64_t N = 10, H = 8, V = 36;
  const at::Tensor rows0 = torch::randn({N, H}), weight0 = torch::randn({V, H});
  at::Tensor targets = torch::randint(V, {N}, torch::kLong);
  targets[0] = 0, targets[1] = V - 1;
  for (int tp : {2, 3}) {
    for (const at::Tensor& t : {targets, torch::full({N}, V - 1, torch::kLong)}) {
      SCOPED_TRACE("tp " + std::to_string(tp));
      at::Tensor rows = rows0.clone().set_requires_grad(true);
      at::Tensor weight = weight0.clone().set_requires_grad(true);
      const at::Tensor ref = linear_cross_entropy_sum(rows, weight, t);
      (ref * 0.37).backward();
      std::mutex mu;
      testing::run_ranks(tp, [&](const dist::Comm& g) {
        const int64_t v = V / tp;
        at::Tensor r = rows0.clone().set_requires_grad(true);
        at::Tensor w = weight0.narrow(0, g.rank() * v, v).clone().set_requires_grad(true);
        const at::Tensor loss = linear_cross_entropy_sum(r, w, t, 3, g);
        (loss * 0.37).backward();
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5 * ref.item<double>());
        EXPECT_LT(rel_diff(r.grad(), rows.grad()), 1e-5);
        EXPECT_LT(rel_diff(w.grad(), weight.grad().narrow(0, g.rank() * v, v)), 1e-5);
      });
    }
  }
  // No rows (a CP rank without targets): no collective, a zero loss and zero gradients.
  testing::run_ranks(2, [&](const dist::Comm& g) {
    at::Tensor r = torch::zeros({0, H}).set_requires_grad(true);
    at::Tensor w = weight0.narrow(0, g.rank() * V / 2, V / 2).clone().set_requires_grad(true);
    const at::Tensor loss = linear_cross_entropy_sum(r, w, torch::zeros({0}, torch::kLong), 0, g);
    loss.backward();
    EXPECT_EQ(loss.item<double>(), 0);
    EXPECT_EQ(r.grad().sizes(), r.sizes());
    EXPECT_EQ(w.grad().abs().sum().item<double>(), 0);
  });
}

}  // namespace
}  // namespace weft::model
