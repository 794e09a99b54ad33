// The fused kernels (model/fused.h) against the ATen ops they replace, computed in double:
// the scaled masked softmax forward and backward (fp32 and bf16, with and without a mask,
// grouped-query rows), the one-pass AdamW update, the sum of squares, and the fused layer ops
// (RMSNorm, LayerNorm, SwiGLU, GELU, RoPE: outputs and every gradient; patchify against the
// convolution it stands for).
#include "weft/model/fused.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
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
  // Over a list: fused and ATen tensors together, undefined ones skipped.
  const at::Tensor a = torch::randn({1000}), b = torch::randn({30, 7}, torch::kBFloat16);
  const double want = dbl(a).pow(2).sum().item<double>() + dbl(b).pow(2).sum().item<double>() +
                      dbl(strided).pow(2).sum().item<double>();
  EXPECT_NEAR(sum_squares(std::vector<at::Tensor>{a, b, at::Tensor(), strided}), want, 1e-9 * want);
  EXPECT_EQ(sum_squares(std::vector<at::Tensor>{}), 0.0);
}

// Per tensor, on the CPU: each entry is that tensor's sum_squares, and their norm is the list's
// (summed in the same order, so the two agree bit for bit).
TEST(Fused, SquaresEachAndTheirNormMatchSumSquares) {
  torch::manual_seed(3);
  const std::vector<at::Tensor> xs = {torch::randn({70000}), at::Tensor(), torch::randn({9, 4}),
                                      torch::randn({5, 6}).t(),
                                      torch::randn({11}, torch::kBFloat16)};
  const at::Tensor each = squares_each(xs, c10::Device(c10::kCPU));
  ASSERT_EQ(each.scalar_type(), at::kDouble);
  ASSERT_EQ(each.numel(), 5);
  for (int64_t i = 0; i < 5; ++i)
    EXPECT_EQ(each[i].item<double>(), xs[i].defined() ? sum_squares(xs[i]) : 0.0) << i;
  const std::vector<at::Tensor> fp32 = {xs[0], xs[1], xs[2]};
  EXPECT_EQ(norm_of_squares(squares_each(fp32, c10::Device(c10::kCPU))).item<double>(),
            std::sqrt(sum_squares(fp32)));
  EXPECT_EQ(squares_each({}, c10::Device(c10::kCPU)).numel(), 0);
  EXPECT_EQ(norm_of_squares(squares_each({}, c10::Device(c10::kCPU))).item<double>(), 0.0);
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

// ---- Fused layer ops --------------------------------------------------------------------------

// A fused op and its definition in ATen ops, on the same inputs.
using Op = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

struct Grads {
  at::Tensor out;
  std::vector<at::Tensor> grads;
};

// out = op(inputs) and the gradients of Σ out·g with respect to every input.
Grads run_op(const Op& op, const std::vector<at::Tensor>& inputs, const at::Tensor& g) {
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& t : inputs) leaves.push_back(t.detach().requires_grad_(true));
  at::Tensor out = op(leaves);
  return {out.detach(), torch::autograd::grad({out}, leaves, {g.to(out.scalar_type())})};
}

// The fused op on inputs of `dtype` (parameters stay fp32) against the definition in double;
// errors relative to the largest reference value, per tensor.
void expect_matches(const Op& fused, const Op& reference, std::vector<at::Tensor> inputs,
                    size_t activations, at::ScalarType dtype, double tol, const char* what) {
  const at::Tensor g0 = torch::randn(reference(inputs).sizes());
  std::vector<at::Tensor> low = inputs, high = inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i < activations) low[i] = inputs[i].to(dtype);
    high[i] = dbl(low[i]);  // the same values the fused op sees
  }
  const Grads got = run_op(fused, low, g0.to(dtype));
  const Grads want = run_op(reference, high, dbl(g0.to(dtype)));
  ASSERT_EQ(got.out.scalar_type(), dtype) << what;
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return max_abs_diff(a, b) / std::max(dbl(b).abs().max().item<double>(), 1e-30);
  };
  EXPECT_LT(rel(got.out, want.out), tol) << what << " output, " << dtype;
  for (size_t i = 0; i < inputs.size(); ++i) {
    ASSERT_EQ(got.grads[i].scalar_type(), low[i].scalar_type()) << what << " grad " << i;
    EXPECT_LT(rel(got.grads[i], want.grads[i]), tol) << what << " grad " << i << ", " << dtype;
  }
}

// bf16 values carry 8 bits: outputs and input gradients are rounded once to bf16.
double tolerance(at::ScalarType dtype) { return dtype == at::kFloat ? 2e-6 : 1e-2; }

class FusedLayersTest : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(FusedLayersTest, RmsNormMatchesDefinition) {
  torch::manual_seed(4);
  const double eps = 1e-5;
  const Op fused = [&](const std::vector<at::Tensor>& t) { return rms_norm(t[0], t[1], eps); };
  const Op ref = [&](const std::vector<at::Tensor>& t) {
    at::Tensor x = t[0].to(t[1].scalar_type());
    return x * at::rsqrt(x.pow(2).mean(-1, true) + eps) * t[1];
  };
  // Rows of 37 (ragged against the vector width) and of 64 in several parameter-grad blocks.
  for (auto shape : {std::vector<int64_t>{3, 67, 37}, std::vector<int64_t>{2, 300, 64}}) {
    const int64_t n = shape.back();
    expect_matches(fused, ref, {torch::randn(shape) * 3, torch::rand({n}) + 0.5}, 1, GetParam(),
                   tolerance(GetParam()), "rms_norm");
  }
}

TEST_P(FusedLayersTest, LayerNormMatchesDefinition) {
  torch::manual_seed(5);
  const double eps = 1e-5;
  const Op fused = [&](const std::vector<at::Tensor>& t) {
    return layer_norm(t[0], t[1], t[2], eps);
  };
  const Op ref = [&](const std::vector<at::Tensor>& t) {
    return at::layer_norm(t[0].to(t[1].scalar_type()), {t[0].size(-1)}, t[1], t[2], eps);
  };
  for (auto shape : {std::vector<int64_t>{3, 67, 37}, std::vector<int64_t>{2, 300, 64}}) {
    const int64_t n = shape.back();
    // An offset mean: the variance is taken about it, not from E[x²] − E[x]².
    expect_matches(fused, ref,
                   {torch::randn(shape) * 2 + 5, torch::rand({n}) + 0.5, torch::randn({n})}, 1,
                   GetParam(), tolerance(GetParam()), "layer_norm");
  }
}

TEST_P(FusedLayersTest, SwiGluMatchesDefinition) {
  torch::manual_seed(6);
  const Op ref = [](const std::vector<at::Tensor>& t) {
    const std::vector<at::Tensor> gu = t[0].chunk(2, -1);
    return at::silu(gu[0]) * gu[1];
  };
  const Op fused = [](const std::vector<at::Tensor>& t) { return swiglu(t[0]); };
  // Large |gate| on both sides: the sigmoid saturates without overflow.
  expect_matches(fused, ref, {torch::randn({5, 7, 2 * 45}) * 6}, 1, GetParam(),
                 tolerance(GetParam()), "swiglu");
}

TEST_P(FusedLayersTest, GeluMatchesDefinition) {
  torch::manual_seed(7);
  const Op ref = [](const std::vector<at::Tensor>& t) { return at::gelu(t[0]); };
  const Op fused = [](const std::vector<at::Tensor>& t) { return gelu_erf(t[0]); };
  expect_matches(fused, ref, {torch::randn({4, 3, 33, 17}) * 4}, 1, GetParam(),
                 tolerance(GetParam()), "gelu");
  // A non-contiguous incoming gradient (LibTorch 1.13's own GELU gets this one wrong).
  at::Tensor x = torch::randn({6, 40, 8}).to(GetParam()).requires_grad_(true);
  at::Tensor g = torch::randn({6, 8, 40}).to(GetParam());
  at::Tensor got = torch::autograd::grad({gelu_erf(x).transpose(1, 2)}, {x}, {g})[0];
  at::Tensor xd = dbl(x).requires_grad_(true);
  at::Tensor want = torch::autograd::grad({at::gelu(xd).transpose(1, 2)}, {xd}, {dbl(g)})[0];
  EXPECT_LT(max_abs_diff(got, want), tolerance(GetParam()) * dbl(want).abs().max().item<double>());
}

TEST_P(FusedLayersTest, RopeMatchesDefinitionOnAStridedView) {
  torch::manual_seed(10);
  const int64_t B = 2, S = 9, H = 3, KV = 2, D = 12;
  at::Tensor angle = torch::rand({B, S, 1, D / 2}) * 6;
  angle = torch::cat({angle, angle}, -1);
  at::Tensor sign = torch::ones({D});
  sign.narrow(0, 0, D / 2).fill_(-1);
  const at::Tensor cos = angle.cos(), rot_sin = angle.sin() * sign;
  // q as the first H heads of a fused [B, S, H + 2·KV, D] projection: a non-contiguous view.
  const Op fused = [&](const std::vector<at::Tensor>& t) {
    return rope(t[0].view({B, S, H + 2 * KV, D}).narrow(2, 0, H), cos, rot_sin);
  };
  const Op ref = [&](const std::vector<at::Tensor>& t) {  // x·cos + rotate_half(x)·sin
    at::Tensor x = t[0].view({B, S, H + 2 * KV, D}).narrow(2, 0, H);
    const std::vector<at::Tensor> h = x.chunk(2, -1);
    return x * dbl(cos) + torch::cat({-h[1], h[0]}, -1) * dbl(angle.sin());
  };
  expect_matches(fused, ref, {torch::randn({B, S, (H + 2 * KV) * D})}, 1, GetParam(),
                 tolerance(GetParam()), "rope");
}

INSTANTIATE_TEST_SUITE_P(Fused, FusedLayersTest, ::testing::Values(at::kFloat, at::kBFloat16));

TEST(Fused, NormParameterGradientsDoNotDependOnTheThreadCount) {
  torch::manual_seed(8);
  at::Tensor x = torch::randn({4, 500, 64}).to(at::kBFloat16);
  at::Tensor w = torch::rand({64}) + 0.5, b = torch::randn({64});
  at::Tensor g = torch::randn({4, 500, 64}).to(at::kBFloat16);
  const int threads = at::get_num_threads();
  std::vector<std::vector<at::Tensor>> runs;
  for (int t : {1, 2, 3}) {
    at::set_num_threads(t);
    at::Tensor wl = w.clone().requires_grad_(true), bl = b.clone().requires_grad_(true);
    std::vector<at::Tensor> r = torch::autograd::grad(
        {rms_norm(x, wl, 1e-5), layer_norm(x, wl, bl, 1e-5)}, {wl, bl}, {g, g});
    runs.push_back(r);
  }
  at::set_num_threads(threads);
  for (size_t i = 1; i < runs.size(); ++i)
    for (size_t k = 0; k < 2; ++k) EXPECT_TRUE(torch::equal(runs[i][k], runs[0][k])) << i << k;
}

TEST(Fused, PatchifyIsTheStrideKernelConvolution) {
  torch::manual_seed(9);
  const int64_t k = 4, C = 3, out = 5;
  // 18 x 13: the last 2 rows and 1 column are no whole patch and are dropped, as by conv2d.
  at::Tensor x = torch::randn({2, C, 18, 13}, torch::kDouble).requires_grad_(true);
  at::Tensor w = torch::randn({out, C, k, k}, torch::kDouble);
  at::Tensor p = patchify(x, k);
  ASSERT_EQ(p.sizes(), (std::vector<int64_t>{2, 4 * 3, C * k * k}));
  at::Tensor y = at::linear(p, w.reshape({out, -1}));  // [N, T, out]
  at::Tensor conv = at::conv2d(x, w, {}, k).flatten(2).transpose(1, 2);
  EXPECT_LT(max_abs_diff(y, conv), 1e-12);
  at::Tensor g = torch::randn(y.sizes(), torch::kDouble);
  at::Tensor got = torch::autograd::grad({y}, {x}, {g})[0];
  at::Tensor want = torch::autograd::grad({conv}, {x}, {g})[0];
  EXPECT_LT(max_abs_diff(got, want), 1e-12);
  EXPECT_EQ(got.narrow(2, 16, 2).abs().max().item<double>(), 0.0);  // dropped rows
  // bf16: a pure copy, exact.
  at::Tensor xb = torch::randn({3, 2, 8, 8}).to(at::kBFloat16);
  at::Tensor ref = xb.reshape({3, 2, 2, 4, 2, 4}).permute({0, 2, 4, 1, 3, 5}).reshape({3, 4, 32});
  EXPECT_TRUE(torch::equal(patchify(xb, 4), ref));
}

}  // namespace
}  // namespace weft::model
