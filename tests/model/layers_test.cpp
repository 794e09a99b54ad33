// Layers checked against straightforward double-precision loops written here (not against the
// helpers they test): RMSNorm, RoPE, grouped-query attention with an arbitrary mask, SwiGLU,
// GELU MLP; and bf16 compute with fp32 master weights.
#include "weft/model/layers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "weft/model/torch_compat.h"

namespace weft::model {
namespace {

at::Tensor dbl(const at::Tensor& t) { return t.detach().to(torch::kDouble).contiguous(); }

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (dbl(a) - dbl(b)).abs().max().item<double>();
}

// ‖a − b‖ / ‖b‖.
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (dbl(a) - dbl(b)).norm().item<double>() / dbl(b).norm().item<double>();
}

// Overwrites a parameter with N(0, std) values, so activations are O(1) and mistakes show.
void fill(const at::Tensor& p, double std) {
  torch::NoGradGuard no_grad;
  p.normal_(0.0, std);
}

// x [N, in] · W[out, in]ᵀ + b, by loops, in double.
at::Tensor naive_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  at::Tensor xd = dbl(x), wd = dbl(w);
  const int64_t n = xd.size(0), in = xd.size(1), out = wd.size(0);
  at::Tensor y = torch::zeros({n, out}, torch::kDouble);
  auto X = xd.accessor<double, 2>();
  auto W = wd.accessor<double, 2>();
  auto Y = y.accessor<double, 2>();
  at::Tensor bd = b.defined() ? dbl(b) : torch::zeros({out}, torch::kDouble);
  auto Bv = bd.accessor<double, 1>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = Bv[o];
      for (int64_t i = 0; i < in; ++i) acc += X[r][i] * W[o][i];
      Y[r][o] = acc;
    }
  return y;
}

// Rotate-half RoPE on x [B, S, H, D]: pair (i, i + D/2) rotated by pos · theta^(-2i/D).
at::Tensor naive_rope(const at::Tensor& x, const at::Tensor& positions, double theta) {
  at::Tensor xd = dbl(x);
  at::Tensor y = torch::zeros_like(xd);
  auto X = xd.accessor<double, 4>();
  auto Y = y.accessor<double, 4>();
  auto P = positions.accessor<int64_t, 2>();
  const int64_t B = xd.size(0), S = xd.size(1), H = xd.size(2), D = xd.size(3), half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const double angle =
              static_cast<double>(P[b][s]) *
              std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
          const double c = std::cos(angle), sn = std::sin(angle);
          const double a = X[b][s][h][i], bb = X[b][s][h][i + half];
          Y[b][s][h][i] = a * c - bb * sn;
          Y[b][s][h][i + half] = a * sn + bb * c;
        }
  return y;
}

TEST(Layers, RmsNormMatchesDefinition) {
  torch::manual_seed(1);
  ParamSet ps;
  RmsNorm norm = RmsNorm::make(Scope{&ps, "n"}, 8, 1e-5);
  ASSERT_EQ(ps.all().size(), 1u);
  EXPECT_EQ(ps.all()[0].first, "n.weight");
  EXPECT_TRUE(torch::equal(norm.weight, torch::ones({8})));  // initialised to ones
  fill(norm.weight, 1.0);
  at::Tensor x = torch::randn({2, 3, 8}) * 3.0;
  at::Tensor y = norm(x);
  ASSERT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(y.scalar_type(), torch::kFloat);

  at::Tensor xd = dbl(x), wd = dbl(norm.weight), expected = torch::zeros_like(xd);
  auto X = xd.accessor<double, 3>();
  auto W = wd.accessor<double, 1>();
  auto E = expected.accessor<double, 3>();
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t s = 0; s < 3; ++s) {
      double ms = 0;
      for (int64_t i = 0; i < 8; ++i) ms += X[b][s][i] * X[b][s][i];
      ms /= 8.0;
      for (int64_t i = 0; i < 8; ++i) E[b][s][i] = X[b][s][i] / std::sqrt(ms + 1e-5) * W[i];
    }
  EXPECT_LT(max_abs_diff(y, expected), 1e-5);

  // eps matters for a near-zero row: x = 1e-3 everywhere, weight 1 → 1e-3 / sqrt(1e-6 + 1e-5).
  RmsNorm unit{torch::ones({4}), 1e-5};
  at::Tensor small = unit(torch::full({1, 4}, 1e-3));
  EXPECT_NEAR(small[0][0].item<double>(), 1e-3 / std::sqrt(1e-6 + 1e-5), 1e-6);
}

TEST(Layers, RopeRotatesPairsHalfApartAtArbitraryPositions) {
  torch::manual_seed(2);
  const int64_t B = 2, S = 5, H = 3, D = 8;
  const double theta = 500.0;
  // Non-contiguous, repeated and out-of-order positions (as in packed / CP-split rows).
  at::Tensor positions =
      torch::tensor({0, 7, 3, 3, 250, 1, 0, 42, 9, 2}, torch::kLong).view({B, S});
  at::Tensor x = torch::randn({B, S, H, D});
  Rope rope = Rope::make(positions, D, theta);
  EXPECT_EQ(rope.cos.sizes(), (std::vector<int64_t>{B, S, 1, D}));
  at::Tensor y = apply_rope(x, rope);
  EXPECT_LT(max_abs_diff(y, naive_rope(x, positions, theta)), 1e-5);
  // Position 0 is the identity; rotation preserves the norm of every pair.
  EXPECT_LT(max_abs_diff(y[0][0], x[0][0]), 1e-7);
  EXPECT_LT(max_abs_diff(y.norm(2, -1), x.norm(2, -1)), 1e-5);
  // Same position, same rotation: rows 0·2 and 0·3 share position 3.
  at::Tensor same = torch::randn({1, 1, H, D});
  at::Tensor x2 = x.clone();
  x2.slice(1, 2, 4).copy_(same.expand({1, 2, H, D}));
  at::Tensor y2 = apply_rope(x2, rope);
  EXPECT_LT(max_abs_diff(y2[0][2], y2[0][3]), 1e-7);
}

// Grouped-query attention (4 query heads, 2 K/V heads) with an arbitrary boolean mask and RoPE,
// against a loop over b, h, q, k with the fused QKV weight sliced by hand.
at::Tensor naive_attention(const Attention& a, const at::Tensor& x, const at::Tensor& mask,
                           const at::Tensor* positions, double theta) {
  const int64_t B = x.size(0), S = x.size(1), hid = x.size(2);
  const int64_t H = a.heads, KV = a.kv_heads, D = a.head_dim;
  at::Tensor proj = naive_linear(x.reshape({B * S, hid}), a.qkv.weight, a.qkv.bias)
                        .view({B, S, (H + 2 * KV) * D});
  // Slices by hand: q head h = columns [h·D, h·D + D); k head j at (H + j)·D; v at (H+KV+j)·D.
  at::Tensor q = torch::zeros({B, S, H, D}, torch::kDouble);
  at::Tensor k = torch::zeros({B, S, KV, D}, torch::kDouble);
  at::Tensor v = torch::zeros({B, S, KV, D}, torch::kDouble);
  {
    auto P = proj.accessor<double, 3>();
    auto Q = q.accessor<double, 4>();
    auto K = k.accessor<double, 4>();
    auto V = v.accessor<double, 4>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < D; ++d) {
          for (int64_t h = 0; h < H; ++h) Q[b][s][h][d] = P[b][s][h * D + d];
          for (int64_t j = 0; j < KV; ++j) {
            K[b][s][j][d] = P[b][s][(H + j) * D + d];
            V[b][s][j][d] = P[b][s][(H + KV + j) * D + d];
          }
        }
  }
  if (positions) {
    q = naive_rope(q, *positions, theta);
    k = naive_rope(k, *positions, theta);
  }
  auto Q = q.accessor<double, 4>();
  auto K = k.accessor<double, 4>();
  auto V = v.accessor<double, 4>();
  auto M = mask.accessor<bool, 4>();
  at::Tensor o = torch::zeros({B * S, H * D}, torch::kDouble);
  auto O = o.accessor<double, 2>();
  const int64_t group = H / KV;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t j = h / group;  // query heads 0,1 → kv head 0; 2,3 → kv head 1
      for (int64_t qi = 0; qi < S; ++qi) {
        std::vector<double> score(S, 0.0);
        double mx = -1e300;
        for (int64_t ki = 0; ki < S; ++ki) {
          if (!M[b][0][qi][ki]) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += Q[b][qi][h][d] * K[b][ki][j][d];
          score[ki] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, score[ki]);
        }
        double z = 0;
        for (int64_t ki = 0; ki < S; ++ki) {
          score[ki] = M[b][0][qi][ki] ? std::exp(score[ki] - mx) : 0.0;
          z += score[ki];
        }
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t ki = 0; ki < S; ++ki) acc += score[ki] / z * V[b][ki][j][d];
          O[b * S + qi][h * D + d] = acc;
        }
      }
    }
  return naive_linear(o, a.out.weight, a.out.bias).view({B, S, hid});
}

Attention make_gqa(ParamSet& ps, int64_t hidden, bool bias) {
  Attention a = Attention::make(Scope{&ps, "attn"}, hidden, 4, 2, bias, bias, 0.02);
  fill(a.qkv.weight, 0.4);
  fill(a.out.weight, 0.4);
  if (bias) {
    fill(a.qkv.bias, 0.3);
    fill(a.out.bias, 0.3);
  }
  return a;
}

// Random visibility with the diagonal always visible, plus one row that sees only itself.
at::Tensor random_mask(int64_t B, int64_t S) {
  at::Tensor m = torch::rand({B, 1, S, S}) < 0.5;
  m = m | torch::eye(S, torch::kBool).view({1, 1, S, S});
  m[1][0][2].fill_(false);
  m[1][0][2][2] = true;
  return m;
}

TEST(Layers, AttentionGqaWithMaskMatchesNaiveLoop) {
  torch::manual_seed(3);
  const int64_t B = 2, S = 6, hid = 16;
  ParamSet ps;
  Attention a = make_gqa(ps, hid, /*bias=*/true);
  EXPECT_EQ(a.head_dim, 4);
  EXPECT_EQ(a.qkv.weight.sizes(), (std::vector<int64_t>{(4 + 2 * 2) * 4, hid}));
  EXPECT_EQ(a.out.weight.sizes(), (std::vector<int64_t>{hid, 16}));
  at::Tensor x = torch::randn({B, S, hid});
  at::Tensor mask = random_mask(B, S);
  at::Tensor y = a(x, mask, nullptr);
  ASSERT_EQ(y.sizes(), x.sizes());
  const at::Tensor expected = naive_attention(a, x, mask, nullptr, 0.0);
  EXPECT_LT(max_abs_diff(y, expected), 1e-5) << "max |y| = " << y.abs().max().item<double>();

  // The mask is honoured: a full mask gives a different answer.
  at::Tensor full = torch::ones({B, 1, S, S}, torch::kBool);
  EXPECT_GT(max_abs_diff(a(x, full, nullptr), expected), 1e-3);
  // An undefined mask means everything visible.
  EXPECT_LT(max_abs_diff(a(x, at::Tensor(), nullptr), naive_attention(a, x, full, nullptr, 0.0)),
            1e-5);
}

TEST(Layers, AttentionWithRopeMatchesNaiveLoop) {
  torch::manual_seed(4);
  const int64_t B = 2, S = 6, hid = 16;
  const double theta = 100.0;
  ParamSet ps;
  Attention a = make_gqa(ps, hid, /*bias=*/false);
  EXPECT_FALSE(a.qkv.bias.defined());
  at::Tensor x = torch::randn({B, S, hid});
  at::Tensor mask = random_mask(B, S);
  at::Tensor positions =
      torch::tensor({0, 1, 2, 0, 1, 2, 5, 9, 13, 2, 30, 3}, torch::kLong).view({B, S});
  Rope rope = Rope::make(positions, a.head_dim, theta);
  at::Tensor y = a(x, mask, &rope);
  EXPECT_LT(max_abs_diff(y, naive_attention(a, x, mask, &positions, theta)), 1e-5);
}

TEST(Layers, SwiGluMatchesDefinition) {
  torch::manual_seed(5);
  const int64_t hid = 8, F = 12;
  ParamSet ps;
  SwiGlu mlp = SwiGlu::make(Scope{&ps, "mlp"}, hid, F, 0.02);
  ASSERT_EQ(mlp.gate_up.weight.sizes(), (std::vector<int64_t>{2 * F, hid}));
  EXPECT_FALSE(mlp.gate_up.bias.defined());
  fill(mlp.gate_up.weight, 0.5);
  fill(mlp.down.weight, 0.5);
  at::Tensor x = torch::randn({3, 4, hid});
  at::Tensor y = mlp(x);
  ASSERT_EQ(y.sizes(), x.sizes());

  // gate = rows [0, F) of the fused weight, up = rows [F, 2F).
  at::Tensor xd = dbl(x).view({12, hid}), w = dbl(mlp.gate_up.weight), wd = dbl(mlp.down.weight);
  auto X = xd.accessor<double, 2>();
  auto W = w.accessor<double, 2>();
  auto Wd = wd.accessor<double, 2>();
  at::Tensor expected = torch::zeros({12, hid}, torch::kDouble);
  auto E = expected.accessor<double, 2>();
  for (int64_t r = 0; r < 12; ++r) {
    std::vector<double> act(F);
    for (int64_t f = 0; f < F; ++f) {
      double g = 0, u = 0;
      for (int64_t i = 0; i < hid; ++i) {
        g += X[r][i] * W[f][i];
        u += X[r][i] * W[F + f][i];
      }
      act[f] = g / (1.0 + std::exp(-g)) * u;  // silu(g) · u
    }
    for (int64_t o = 0; o < hid; ++o) {
      double acc = 0;
      for (int64_t f = 0; f < F; ++f) acc += act[f] * Wd[o][f];
      E[r][o] = acc;
    }
  }
  EXPECT_LT(max_abs_diff(y.view({12, hid}), expected), 1e-5);
}

TEST(Layers, GeluMlpMatchesDefinition) {
  torch::manual_seed(6);
  const int64_t in = 6, F = 10, out = 5;
  ParamSet ps;
  GeluMlp mlp = GeluMlp::make(Scope{&ps, "p"}, in, F, out, 0.02);
  std::vector<std::string> names;
  for (const auto& [n, _] : ps.all()) names.push_back(n);
  EXPECT_EQ(names,
            (std::vector<std::string>{"p.fc1.weight", "p.fc1.bias", "p.fc2.weight", "p.fc2.bias"}));
  for (const auto& [n, p] : ps.all()) fill(p, 0.5);
  at::Tensor x = torch::randn({7, in});
  at::Tensor y = mlp(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{7, out}));
  at::Tensor h = naive_linear(x, mlp.fc1.weight, mlp.fc1.bias);
  h = h * 0.5 * (1.0 + torch::erf(h / std::sqrt(2.0)));  // exact (erf) GELU
  EXPECT_LT(max_abs_diff(y, naive_linear(h, mlp.fc2.weight, mlp.fc2.bias)), 1e-5);
}

TEST(Layers, ParamSetRejectsDuplicatesAndStoresFp32Leaves) {
  ParamSet ps;
  at::Tensor p = ps.add("a.w", torch::ones({2, 3}, torch::kDouble).t());
  EXPECT_EQ(p.scalar_type(), torch::kFloat);
  EXPECT_TRUE(p.is_contiguous());
  EXPECT_TRUE(p.requires_grad());
  EXPECT_TRUE(p.is_leaf());
  EXPECT_THROW(ps.add("a.w", torch::ones({1})), std::exception);
}

// bf16 compute: outputs come back in bf16, close to fp32; gradients land on the fp32 masters.
TEST(Layers, Bf16ComputeIsCloseToFp32AndGradsStayFp32) {
  torch::manual_seed(7);
  const int64_t B = 2, S = 6, hid = 16;
  ParamSet ps;
  Attention attn = make_gqa(ps, hid, true);
  SwiGlu mlp = SwiGlu::make(Scope{&ps, "mlp"}, hid, 24, 0.02);
  RmsNorm norm = RmsNorm::make(Scope{&ps, "norm"}, hid, 1e-5);
  fill(mlp.gate_up.weight, 0.3);
  fill(mlp.down.weight, 0.3);
  at::Tensor x = torch::randn({B, S, hid});
  at::Tensor mask = random_mask(B, S);
  at::Tensor positions = torch::arange(S).repeat({B, 1});
  Rope rope = Rope::make(positions, attn.head_dim, 10000.0);
  auto forward = [&](const at::Tensor& in) {
    at::Tensor h = in + attn(norm(in), mask, &rope);
    return h + mlp(norm(h));
  };

  at::Tensor y32 = forward(x);
  y32.pow(2).sum().backward();
  std::vector<at::Tensor> g32;
  for (const auto& [n, p] : ps.all()) {
    ASSERT_TRUE(p.grad().defined()) << n;
    g32.push_back(p.grad().clone());
    p.mutable_grad().zero_();
  }

  ASSERT_EQ(compute_dtype(), torch::kFloat);
  at::Tensor ybf;
  {
    ComputeDtypeGuard guard(torch::kBFloat16);
    EXPECT_EQ(compute_dtype(), torch::kBFloat16);
    at::Tensor xb = to_compute(x);
    EXPECT_EQ(xb.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(to_compute(positions).scalar_type(), torch::kLong);  // integers untouched
    ybf = forward(xb);
    EXPECT_EQ(norm(xb).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(compute_dtype(), torch::kFloat);  // the guard restores the thread's dtype
  EXPECT_EQ(ybf.scalar_type(), torch::kBFloat16);
  const double err = rel_err(ybf, y32);
  EXPECT_LT(err, 1e-2);
  EXPECT_GT(err, 0.0);  // really computed in bf16

  ybf.to(torch::kFloat).pow(2).sum().backward();
  size_t i = 0;
  for (const auto& [n, p] : ps.all()) {
    ASSERT_TRUE(p.grad().defined()) << n;
    EXPECT_EQ(p.scalar_type(), torch::kFloat) << n;
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat) << n;
    EXPECT_LT(rel_err(p.grad(), g32[i]), 5e-2) << n;
    ++i;
  }
}

}  // namespace
}  // namespace weft::model

namespace weft::model {
namespace {

// LibTorch 1.13's GELU backward is wrong for a non-contiguous incoming gradient (as in the
// Whisper front end, where it arrives through a transpose): zeros in fp32, NaN in bf16.
// compat::gelu must match GELU'(x) * g computed from the closed form, in both dtypes.
TEST(Layers, GeluBackwardThroughTransposeIsExact) {
  torch::manual_seed(3);
  at::Tensor x = torch::randn({8, 96, 16});
  at::Tensor g = torch::randn({8, 16, 96});
  // d/dx [x Φ(x)] = Φ(x) + x φ(x)
  at::Tensor cdf = 0.5 * (1 + torch::erf(x / std::sqrt(2.0)));
  at::Tensor pdf = torch::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
  at::Tensor expected = (cdf + x * pdf) * g.transpose(1, 2);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    at::Tensor xd = x.to(dtype).requires_grad_(true);
    at::Tensor got =
        torch::autograd::grad({compat::gelu(xd).transpose(1, 2)}, {xd}, {g.to(dtype)})[0];
    ASSERT_TRUE(torch::isfinite(got).all().item<bool>()) << dtype;
    const double tol = dtype == torch::kFloat ? 1e-5 : 0.03;
    EXPECT_LT((got.to(torch::kFloat) - expected).abs().max().item<double>(),
              tol * expected.abs().max().item<double>())
        << dtype;
  }
}

}  // namespace
}  // namespace weft::model
