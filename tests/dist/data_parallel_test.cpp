// Data parallelism is exact: DP2 (two Gloo ranks as threads) reproduces the single-process
// losses, gradients and parameters (fp32, 3 optimizer steps).
#include "weft/dist/data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "support/ranks.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/plan/plan.h"
#include "weft/train/trainer.h"

namespace fs = std::filesystem;

namespace weft::dist {
namespace {

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-30);
}

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params, grads;
};

// Trains on `comm`; records per-step losses (from metrics, rank 0) and the final parameters and
// the last step's synchronised gradients.
RunResult train(const Spec& spec, const Comm& comm, const fs::path& out) {
  train::TrainerOptions o;
  o.out_dir = out.string();
  o.progress = false;
  o.peak_flops = 1e12;
  o.eval = false;
  o.comm = comm;
  train::Trainer t(spec, plan::make_plan(spec, comm.size()), o);
  RunResult r;
  t.after_backward = [&](int64_t step) {
    if (step + 1 != spec.train.steps) return;
    for (const auto& [name, p] : t.model().parameters())
      if (p.grad().defined()) r.grads[name] = p.grad().clone();
  };
  t.run();
  for (const auto& [name, p] : t.model().parameters()) r.params[name] = p.detach().clone();
  if (comm.rank() == 0) r.losses = weft::testing::run_losses(out);
  return r;
}

using weft::testing::temp_dir;

void expect_equivalent(const std::vector<std::string>& sets, const std::string& tag) {
  std::vector<std::string> all = {"train.steps=3", "train.warmup=1"};
  all.insert(all.end(), sets.begin(), sets.end());
  const Spec spec = parse_spec(weft::testing::kTinyVlm, "tiny", all);
  const RunResult ref = train(spec, Comm(), temp_dir(tag + "_single"));
  std::vector<RunResult> ranks(2);
  const fs::path out = temp_dir(tag + "_dp2");  // once: temp_dir empties the directory
  testing::run_ranks(2, [&](const Comm& comm) { ranks[comm.rank()] = train(spec, comm, out); });

  ASSERT_EQ(ref.losses.size(), 3u);
  ASSERT_EQ(ranks[0].losses.size(), 3u);
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(ranks[0].losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i]))
        << "step " << i + 1;
  double worst_param = 0, worst_grad = 0;
  for (const auto& [name, p] : ref.params)
    for (int r = 0; r < 2; ++r) {
      const double d = rel_diff(ranks[r].params.at(name), p);
      worst_param = std::max(worst_param, d);
      EXPECT_LT(d, 1e-4) << tag << " rank " << r << " param " << name;
    }
  for (const auto& [name, g] : ref.grads)
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(ranks[r].grads.count(name)) << name;
      const double d = rel_diff(ranks[r].grads.at(name), g);
      worst_grad = std::max(worst_grad, d);
      EXPECT_LT(d, 1e-4) << tag << " rank " << r << " grad " << name;
    }
  std::printf("[%s] max relative difference: params %.2e, grads %.2e\n", tag.c_str(), worst_param,
              worst_grad);
}

TEST(DataParallel, Dp2MatchesSingleProcess) { expect_equivalent({}, "dp2"); }

TEST(DataParallel, Dp2WithFrozenVisionEncoderMatchesSingleProcess) {
  expect_equivalent({"model.vision.frozen=true"}, "dp2_frozen");
}

TEST(DataParallel, Dp2ZeroOneMatchesSingleProcess) {
  expect_equivalent({"train.zero_stage=1"}, "dp2_zero1");
}

// Overlap: gradients produced by the armed backward are reduced bucket by bucket during it; a
// parameter without a gradient joins its bucket with zeros; every rank ends with the sum.
TEST(DataParallel, ArmedBackwardReducesBucketsDuringBackward) {
  testing::run_ranks(2, [](const Comm& comm) {
    const int r = comm.rank();
    model::ParamSet ps;
    at::Tensor a = ps.add("a", torch::full({300}, 1.0));
    at::Tensor b = ps.add("b", torch::full({300}, 2.0));
    at::Tensor unused = ps.add("unused", torch::ones({10}));
    GradSync sync(comm, ps.all(), /*bucket_bytes=*/1000);
    ASSERT_EQ(sync.bucket_count(), 2);  // [unused, b], [a]
    // Two microbatches: the first accumulates normally, the second is armed.
    ((a * b).sum() * (r + 1)).backward();
    sync.arm();
    ((a * a).sum() * (r + 1)).backward();
    sync.finish();
    // d/da: rank-weighted (b + 2a) summed over ranks (1 + 2) = 3 * (2 + 2) = 12.
    EXPECT_TRUE(torch::allclose(a.grad(), torch::full({300}, 12.0))) << a.grad()[0];
    EXPECT_TRUE(torch::allclose(b.grad(), torch::full({300}, 3.0)));  // 3 * a
    ASSERT_TRUE(unused.grad().defined());
    EXPECT_TRUE(torch::equal(unused.grad(), torch::zeros({10})));
    EXPECT_EQ(sync.buckets_overlapped(), 1);  // [a] filled during backward; [unused, b] not
  });
}

TEST(DataParallel, ZeroOnePartitionIsBalancedAndComplete) {
  model::ParamSet ps;
  for (int i = 0; i < 7; ++i) ps.add("p" + std::to_string(i), torch::zeros({100 * (i + 1)}));
  const std::vector<int> owner = partition_parameters(ps.all(), 2);
  int64_t load[2] = {0, 0};
  for (size_t k = 0; k < owner.size(); ++k) load[owner[k]] += ps.all()[k].second.numel();
  EXPECT_EQ(load[0] + load[1], 2800);
  EXPECT_LE(std::abs(load[0] - load[1]), 100);
}

TEST(DataParallel, BucketsCoverEveryParameterOnce) {
  model::ParamSet ps;
  ps.add("a", torch::zeros({1000}));
  ps.add("b", torch::zeros({10}));
  ps.add("c", torch::zeros({3000}));
  GradSync small(Comm(), ps.all(), /*bucket_bytes=*/4000);
  EXPECT_EQ(small.bucket_count(), 2);  // [c], [b, a]
  GradSync big(Comm(), ps.all(), 1 << 20);
  EXPECT_EQ(big.bucket_count(), 1);
}

}  // namespace
}  // namespace weft::dist
