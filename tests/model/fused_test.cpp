// The fused kernels (model/fused.h) against the ATen ops they replace, computed in double:
// the scaled masked softmax forward and backward (fp32 and bf16, with and without a mask,
// grouped-query rows), the one-pass AdamW update and the sum of squares.
#include "weft/model/fused.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace weft::model {
namespace {

at::Tensor dbl(const at::Tensor& t) { return t.detach().to(torch::kDouble); }

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (dbl(a) - dbl(b)).abs().max().item<double>();
}

// softmax(scale·s) over visible keys in double; mask row of score row r is r mod Sq.
at::Tensor reference_softmax(const at::Tensor& s, const at::Tensor& visible, double scale) {
  at::Tensor x = dbl(s) * scale;
  if (visible.defined()) {
    const int64_t rep = s.size(2) / visible.size(2);
    x = x.masked_fill(visible.repeat({1, 1, rep, 1}).logical_not(),
                      -std::numeric_limits<double>::infinity());
  }
  return at::softmax(x, -1);
}

// A causal mask with some extra visible pairs (an image span seeing itself both ways).
at::Tensor test_mask(int64_t B, int64_t S) {
  at::Tensor pos = torch::arange(S);
  at::Tensor m = (pos.view({S, 1}) >= pos.view({1, S}));
  m.slice(0, 2, 6).slice(1, 2, 6).fill_(true);
  return m.view({1, 1, S, S}).expand({B, 1, S, S}).contiguous();
}

struct SoftmaxCase {
  at::ScalarType dtype;
  bool masked;
  int64_t rep;  // grouped-query heads stacked along the rows
};

class MaskedSoftmaxTest : public ::testing::TestWithParam<SoftmaxCase> {};

TEST_P(MaskedSoftmaxTest, MatchesSoftmaxForwardAndBackward) {
  const SoftmaxCase c = GetParam();
  const int64_t B = 2, X = 3, S = 37;
  torch::manual_seed(1);
  at::Tensor visible = c.masked ? test_mask(B, S) : at::Tensor();
  at::Tensor s = (torch::randn({B, X, c.rep * S, S}) * 4).to(c.dtype).set_requires_grad(true);
  const double scale = 0.125;
  at::Tensor p = masked_softmax(s, visible, scale);
  ASSERT_EQ(p.scalar_type(), c.dtype);
  const at::Tensor expected = reference_softmax(s, visible, scale);
  const double tol = c.dtype == at::kFloat ? 2e-6 : 4e-3;  // bf16 output rounding
  EXPECT_LT(max_abs_diff(p, expected), tol);
  if (c.masked) {  // hidden keys get exactly zero
    at::Tensor hidden = visible.repeat({1, X, c.rep, 1}).logical_not();
    EXPECT_EQ(p.detach().masked_select(hidden).abs().max().item<double>(), 0.0);
  }

  at::Tensor g = torch::randn(p.sizes()).to(c.dtype);
  p.backward(g);
  // d/ds of Σ g·softmax(scale·s) = scale·p·(g − Σ g·p), from the double reference.
  at::Tensor pd = expected, gd = dbl(g);
  at::Tensor want = scale * pd * (gd - (gd * pd).sum(-1, true));
  EXPECT_LT(max_abs_diff(s.grad(), want), c.dtype == at::kFloat ? 2e-6 : 2e-2);
}

INSTANTIATE_TEST_SUITE_P(
    Fused, MaskedSoftmaxTest,
    ::testing::Values(SoftmaxCase{at::kFloat, true, 1}, SoftmaxCase{at::kFloat, false, 1},
                      SoftmaxCase{at::kFloat, true, 3}, SoftmaxCase{at::kBFloat16, true, 1},
                      SoftmaxCase{at::kBFloat16, true, 2}, SoftmaxCase{at::kBFloat16, false, 1}));

TEST(Fused, MaskedSoftmaxRejectsAMaskOfAnotherShape) {
  at::Tensor s = torch::randn({2, 1, 5, 5});
  at::Tensor bad = torch::ones({2, 1, 4, 5}, torch::kBool);
  EXPECT_THROW(masked_softmax(s, bad, 1.0), c10::Error);
}

TEST(Fused, SumOfSquaresIsExactInDouble) {
  torch::manual_seed(2);
  for (int64_t n : {1, 7, 65536, 65537, 300001}) {
    at::Tensor x = torch::randn({n});
    const double want = dbl(x).pow(2).sum().item<double>();
    EXPECT_NEAR(sum_squares(x), want, 1e-12 * want) << n;
  }
  at::Tensor strided = torch::randn({64, 64}).t();  // not contiguous: the ATen path
  EXPECT_NEAR(sum_squares(strided), dbl(strided).pow(2).sum().item<double>(), 1e-9);
}

// The update as the ATen ops weft used before fusing, in double.
void reference_adamw(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v,
                     const AdamWUpdate& u) {
  const at::Tensor gs = g * u.grad_scale;
  p = p * u.decay;
  m = m * u.beta1 + gs * (1 - u.beta1);
  v = v * u.beta2 + gs * gs * (1 - u.beta2);
  p = p - u.lr / u.bc1 * m / ((v / u.bc2).sqrt() + u.eps);
}

TEST(Fused, AdamWUpdateMatchesTheOpSequence) {
  torch::manual_seed(3);
  const int64_t n = 200003;  // several parallel chunks and a ragged end
  at::Tensor p = torch::randn({n}), g = torch::randn({n}) * 0.1;
  at::Tensor m = torch::randn({n}) * 0.01, v = torch::rand({n}) * 1e-3;
  AdamWUpdate u;
  u.lr = 1e-3;
  u.decay = 1 - 1e-3 * 0.1;
  u.bc1 = 1 - std::pow(0.9, 3);
  u.bc2 = 1 - std::pow(0.95, 3);
  u.grad_scale = 0.5;
  at::Tensor pd = dbl(p), md = dbl(m), vd = dbl(v);
  reference_adamw(pd, dbl(g), md, vd, u);
  adamw_update(p, g, m, v, u);
  EXPECT_LT(max_abs_diff(p, pd), 1e-6);
  EXPECT_LT(max_abs_diff(m, md), 1e-7);
  EXPECT_LT(max_abs_diff(v, vd), 1e-9);
  // A strided parameter takes the ATen path and agrees.
  at::Tensor p2 = torch::randn({40, 30}), g2 = torch::randn({30, 40}).t();
  at::Tensor m2 = torch::zeros({40, 30}), v2 = torch::zeros({40, 30});
  at::Tensor p2d = dbl(p2), m2d = dbl(m2), v2d = dbl(v2);
  reference_adamw(p2d, dbl(g2), m2d, v2d, u);
  adamw_update(p2, g2, m2, v2, u);
  EXPECT_LT(max_abs_diff(p2, p2d), 1e-6);
}

}  // namespace
}  // namespace weft::model
