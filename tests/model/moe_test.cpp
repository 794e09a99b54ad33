// The MoE block (model/moe.h) against a per-token reference written independently in double
// precision: routing, renormalised top-k weights, capacity dropping in priority order, padding,
// the shared expert, and the auxiliary losses' values and router gradients.
#include "weft/model/moe.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

namespace weft::model {
namespace {

struct Fixture {
  LlmSpec llm;
  ParamSet params;
  MoeMlp moe;
  explicit Fixture(MoeSpec m) {
    llm.hidden = 16;
    llm.ffn = 24;
    llm.moe = m;
    InitSeedGuard seed(7);
    moe = MoeMlp::make(Scope{&params, "moe", nullptr}, llm, 0, 0.05);
  }
};

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down) {
  const int64_t F = gate_up.size(0) / 2;
  const at::Tensor g = x.matmul(gate_up.narrow(0, 0, F).t());
  const at::Tensor u = x.matmul(gate_up.narrow(0, F, F).t());
  return (g * g.sigmoid() * u).matmul(down.t());
}

// The block's output for x [B, S, H], one token at a time, in double; `valid` [B, S].
at::Tensor reference(const MoeMlp& m, const at::Tensor& x, const at::Tensor& valid) {
  const MoeSpec& s = m.spec;
  const int64_t B = x.size(0), S = x.size(1), E = s.experts, K = s.top_k;
  const at::Tensor xd = x.to(at::kDouble), router = m.router.detach().to(at::kDouble);
  at::Tensor out = torch::zeros(xd.sizes(), torch::kDouble);
  for (int64_t b = 0; b < B; ++b) {
    int64_t T = 0;
    for (int64_t t = 0; t < S; ++t) T += valid[b][t].item<bool>();
    const int64_t capacity =
        s.capacity_factor > 0
            ? static_cast<int64_t>(std::ceil(s.capacity_factor * static_cast<double>(T * K) /
                                             static_cast<double>(E)))
            : INT64_MAX;
    // Choices of every token, then capacity in priority order: slot-major, position-minor.
    std::vector<std::vector<int64_t>> choice(S);
    std::vector<std::vector<double>> weight(S);
    for (int64_t t = 0; t < S; ++t) {
      if (!valid[b][t].item<bool>()) continue;
      const at::Tensor logits = router.matmul(xd[b][t]);
      const at::Tensor sc = s.sigmoid ? logits.sigmoid() : logits.softmax(0);
      std::vector<std::pair<double, int64_t>> ranked;
      for (int64_t e = 0; e < E; ++e) ranked.emplace_back(-sc[e].item<double>(), e);
      std::sort(ranked.begin(), ranked.end());
      double sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += -ranked[k].first;
      for (int64_t k = 0; k < K; ++k) {
        choice[t].push_back(ranked[k].second);
        weight[t].push_back(-ranked[k].first / (s.norm_topk ? sum : 1.0));
      }
    }
    std::vector<int64_t> used(E, 0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t t = 0; t < S; ++t) {
        if (choice[t].empty()) continue;
        const int64_t e = choice[t][k];
        if (used[e]++ >= capacity) continue;
        const size_t j = static_cast<size_t>(e);
        out[b][t] += weight[t][k] * swiglu(xd[b][t].unsqueeze(0),
                                           m.gate_up[j].weight.detach().to(at::kDouble),
                                           m.down[j].weight.detach().to(at::kDouble))[0];
      }
    if (m.has_shared)
      out[b] += swiglu(xd[b], m.shared.gate_up.weight.detach().to(at::kDouble),
                       m.shared.down.weight.detach().to(at::kDouble));
  }
  return out;
}

// The auxiliary objective Σ_rows (aux_loss · balance + z_loss · z) / rows, in double, from the
// router weights `w` (so that autograd gives the reference router gradient).
std::pair<at::Tensor, at::Tensor> reference_aux(const MoeSpec& s, const at::Tensor& w,
                                                const at::Tensor& x, const at::Tensor& valid) {
  const int64_t B = x.size(0), S = x.size(1), E = s.experts, K = s.top_k;
  at::Tensor balance = torch::zeros({}, torch::kDouble), z = torch::zeros({}, torch::kDouble);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> f(E, 0.0);
    at::Tensor P = torch::zeros({E}, torch::kDouble);
    double T = 0;
    at::Tensor zb = torch::zeros({}, torch::kDouble);
    for (int64_t t = 0; t < S; ++t) {
      if (!valid[b][t].item<bool>()) continue;
      T += 1;
      const at::Tensor logits = w.matmul(x[b][t].to(at::kDouble));
      at::Tensor p = s.sigmoid ? logits.sigmoid() : logits.softmax(0);
      const at::Tensor top = std::get<1>(p.detach().topk(K));
      for (int64_t k = 0; k < K; ++k) f[top[k].item<int64_t>()] += 1;
      if (s.sigmoid) p = p / p.sum();
      P = P + p;
      zb = zb + logits.logsumexp(0).square();
    }
    for (int64_t e = 0; e < E; ++e)
      balance = balance + static_cast<double>(E) * (f[e] / (T * K)) * P[e] / T;
    z = z + zb / T;
  }
  return {balance / static_cast<double>(B), z / static_cast<double>(B)};
}

void expect_matches_reference(MoeSpec spec, bool padding) {
  Fixture f(spec);
  torch::manual_seed(3);
  const at::Tensor x = torch::randn({3, 10, 16});
  at::Tensor valid = torch::ones({3, 10}, torch::kBool);
  if (padding) valid.narrow(1, 7, 3)[1].fill_(false);
  TokenInfo info;
  info.valid = valid;
  const at::Tensor y = f.moe(x, info);
  const at::Tensor want = reference(f.moe, x, valid);
  EXPECT_LT((y.to(at::kDouble) - want).abs().max().item<double>(), 1e-5);
}

MoeSpec base_spec() {
  MoeSpec m;
  m.experts = 4;
  m.top_k = 2;
  return m;
}

TEST(Moe, DroplessSoftmaxTop2MatchesPerTokenReference) {
  expect_matches_reference(base_spec(), false);
}

TEST(Moe, SharedExpertSigmoidGatingAndPadding) {
  MoeSpec m = base_spec();
  m.sigmoid = true;
  m.shared_ffn = 12;
  m.top_k = 3;
  expect_matches_reference(m, true);
}

TEST(Moe, CapacityKeepsFirstChoicesThenEarlierPositions) {
  MoeSpec m = base_spec();
  m.capacity_factor = 0.75;  // ceil(0.75 · 10 · 2 / 4) = 4 per expert per row: drops happen
  expect_matches_reference(m, true);
  m.top_k = 1;
  m.norm_topk = false;
  m.capacity_factor = 1.0;
  expect_matches_reference(m, false);
}

TEST(Moe, PaddingIsNotRoutedAndCountsNowhere) {
  MoeSpec spec = base_spec();
  Fixture f(spec);
  torch::manual_seed(5);
  const at::Tensor x = torch::randn({2, 6, 16});
  at::Tensor valid = torch::ones({2, 6}, torch::kBool);
  valid[0].narrow(0, 4, 2).fill_(false);
  MoeStats stats;
  TokenInfo info;
  info.valid = valid;
  info.stats = &stats;
  const at::Tensor y = f.moe(x, info);
  EXPECT_EQ(y[0].narrow(0, 4, 2).abs().max().item<double>(), 0.0);  // no shared expert
  int64_t assignments = 0;
  for (int64_t c : stats.load.at(0)) assignments += c;
  EXPECT_EQ(assignments, 10 * spec.top_k);
  EXPECT_EQ(stats.routed, 10 * spec.top_k);
  EXPECT_EQ(stats.dropped, 0);
}

void expect_aux_matches(MoeSpec spec) {
  spec.aux_loss = 0.3;
  spec.z_loss = 0.05;
  Fixture f(spec);
  torch::manual_seed(11);
  const at::Tensor x = torch::randn({3, 8, 16});
  at::Tensor valid = torch::ones({3, 8}, torch::kBool);
  valid[2].narrow(0, 5, 3).fill_(false);
  MoeStats stats;
  TokenInfo info;
  info.valid = valid;
  info.aux_scale = 1.0 / 3;  // three rows in the "global batch"
  info.stats = &stats;
  // Only the auxiliary losses reach the router: the output's own gradient is zero.
  (f.moe(x, info) * 0).sum().backward();
  const at::Tensor w = f.moe.router.detach().to(at::kDouble).requires_grad_(true);
  const auto [balance, z] = reference_aux(spec, w, x, valid);
  EXPECT_NEAR(stats.balance, balance.item<double>(), 1e-6);
  EXPECT_NEAR(stats.z, z.item<double>(), 1e-5);
  (spec.aux_loss * balance + spec.z_loss * z).backward();
  const at::Tensor got = f.moe.router.grad().to(at::kDouble);
  ASSERT_TRUE(got.defined());
  EXPECT_LT((got - w.grad()).norm().item<double>() / w.grad().norm().item<double>(), 1e-5);
}

TEST(Moe, AuxiliaryLossesAndTheirRouterGradients) {
  expect_aux_matches(base_spec());
  MoeSpec sig = base_spec();
  sig.sigmoid = true;
  expect_aux_matches(sig);
}

TEST(Moe, NoAuxiliaryGradientWithoutAScale) {
  Fixture f(base_spec());
  const at::Tensor x = torch::randn({2, 5, 16});
  (f.moe(x, TokenInfo{}) * 0).sum().backward();
  const at::Tensor g = f.moe.router.grad();
  EXPECT_TRUE(!g.defined() || g.abs().max().item<double>() == 0.0);
}

}  // namespace
}  // namespace weft::model
