// Deferred reads (Trainer::queue_step): a step that leaves its loss and gradient norm on the
// device, clips and updates there and is finished only after the next step is queued, trains
// exactly like one that reads them at once. On a GPU this is what keeps the device busy between
// steps; here it is forced on the CPU, so the bookkeeping (metrics a step late, clipping and
// skipping as tensors, checkpoints and errors at the right step) is checked without one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "support/errors.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/io/checkpoint.h"
#include "weft/plan/plan.h"
#include "weft/train/optimizer.h"
#include "weft/train/trainer.h"

namespace fs = std::filesystem;

namespace weft::train {
namespace {

using weft::testing::error_of;
using weft::testing::temp_dir;

TrainerOptions options(const fs::path& out, DeferReads defer) {
  TrainerOptions o;
  o.out_dir = out.string();
  o.progress = false;
  o.peak_flops = 1e12;
  o.eval = false;
  o.defer = defer;
  return o;
}

std::vector<nlohmann::json> metrics(const fs::path& run) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Clipping active (a small grad_clip), checkpoints between and at the end, fp32.
TEST(DeferredReads, TrainExactlyLikeStepByStep) {
  const Spec spec = parse_spec(weft::testing::kTinyVlm, "tiny",
                               {"train.steps=7", "train.checkpoint_every=3", "train.grad_clip=0.05",
                                "train.precision=\"fp32\""});
  const fs::path a_dir = temp_dir("deferred_off"), b_dir = temp_dir("deferred_on");
  Trainer a(spec, plan::make_plan(spec), options(a_dir, DeferReads::kNever));
  Trainer b(spec, plan::make_plan(spec), options(b_dir, DeferReads::kAlways));
  EXPECT_FALSE(a.defers());
  EXPECT_TRUE(b.defers());
  a.run();
  b.run();
  const auto ma = metrics(a_dir), mb = metrics(b_dir);
  ASSERT_EQ(ma.size(), 7u);
  ASSERT_EQ(mb.size(), 7u);
  int clipped = 0;
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(mb[i]["step"], static_cast<int>(i + 1));
    EXPECT_EQ(ma[i]["loss"].get<double>(), mb[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(ma[i]["grad_norm"].get<double>(), mb[i]["grad_norm"].get<double>()) << i + 1;
    EXPECT_EQ(ma[i]["lr"].get<double>(), mb[i]["lr"].get<double>()) << i + 1;
    EXPECT_GT(mb[i]["step_seconds"].get<double>(), 0.0);
    clipped += ma[i]["grad_norm"].get<double>() > 0.05;
  }
  EXPECT_GT(clipped, 0) << "the test should exercise clipping";
  for (size_t k = 0; k < a.model().parameters().size(); ++k)
    EXPECT_TRUE(torch::equal(a.model().parameters()[k].second, b.model().parameters()[k].second))
        << a.model().parameters()[k].first;
  // The checkpoints were written at the same steps and hold the same state.
  auto written = [](const fs::path& run) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(run / "checkpoints"))
      names.insert(e.path().filename().string());
    return names;
  };
  EXPECT_EQ(written(a_dir), written(b_dir));
  EXPECT_FALSE(written(b_dir).empty());
  const auto [wa, oa, wa_state] = io::load_checkpoint(io::latest_checkpoint(a_dir.string()));
  const auto [wb, ob, wb_state] = io::load_checkpoint(io::latest_checkpoint(b_dir.string()));
  ASSERT_EQ(wa.size(), wb.size());
  for (size_t k = 0; k < wa.size(); ++k) EXPECT_TRUE(torch::equal(wa[k].second, wb[k].second));
  ASSERT_EQ(oa.size(), ob.size());
  for (size_t k = 0; k < oa.size(); ++k) EXPECT_TRUE(torch::equal(oa[k].second, ob[k].second));
}

// A poisoned gradient in step 2: step 3 is already queued when step 2 is read, so the error
// comes then, naming step 2 and the module; the update of step 2 was skipped on the device
// (step 3 ran on step 1's parameters), and step 3 is never reported.
TEST(DeferredReads, NonFiniteGradientStopsAtItsStepWithItsUpdateSkipped) {
  const Spec spec = parse_spec(weft::testing::kTinyVlm, "tiny", {"train.steps=5"});
  const fs::path out = temp_dir("deferred_nan");
  Trainer t(spec, plan::make_plan(spec), options(out, DeferReads::kAlways));
  std::map<std::string, at::Tensor> before;
  bool third = false, unchanged = false;
  t.after_backward = [&](int64_t step) {
    if (step == 1) {
      for (const auto& [name, p] : t.model().parameters()) {
        before[name] = p.detach().clone();
        if (name == "vision.projector.fc1.weight") p.mutable_grad().view(-1)[0] = INFINITY;
      }
    } else if (step == 2) {
      third = unchanged = true;
      for (const auto& [name, p] : t.model().parameters())
        unchanged = unchanged && torch::equal(p.detach(), before.at(name));
    }
  };
  const std::string what = error_of([&] { t.run(); });
  EXPECT_NE(what.find("step 2: gradient norm is inf"), std::string::npos) << what;
  EXPECT_NE(what.find("module 'vision.projector' (parameter vision.projector.fc1.weight)"),
            std::string::npos)
      << what;
  EXPECT_TRUE(third) << "step 3 should have been queued before step 2 was read";
  EXPECT_TRUE(unchanged) << "the non-finite step's update was applied";
  EXPECT_EQ(metrics(out).size(), 1u);
}

TEST(DeferredReads, NanLossIsAClearError) {
  const Spec spec = parse_spec(weft::testing::kTinyVlm, "tiny", {});
  Trainer t(spec, plan::make_plan(spec),
            options(temp_dir("deferred_nanloss"), DeferReads::kAlways));
  {
    torch::NoGradGuard g;
    t.model().parameters().front().second.fill_(NAN);
  }
  const std::string what = error_of([&] { t.run(); });
  EXPECT_NE(what.find("step 1: loss is nan"), std::string::npos) << what;
}

TEST(DeferredReads, NeedStopOnNonFinite) {
  const Spec spec = parse_spec(weft::testing::kTinyVlm, "tiny", {"train.nonfinite=\"skip\""});
  const std::string what = error_of([&] {
    Trainer(spec, plan::make_plan(spec), options(temp_dir("deferred_skip"), DeferReads::kAlways));
  });
  EXPECT_NE(what.find("train.nonfinite = \"stop\""), std::string::npos) << what;
  // kAuto on the CPU reads at once.
  Trainer t(spec, plan::make_plan(spec), options(temp_dir("deferred_auto"), DeferReads::kAuto));
  EXPECT_FALSE(t.defers());
}

// The optimizer with its factor and skip flag as tensors: the same update as with doubles, and
// nothing at all when the flag is set.
TEST(DeferredReads, OptimizerTakesScaleAndSkipAsTensors) {
  torch::manual_seed(5);
  auto make = [] {
    model::NamedTensors ps = {{"w", torch::randn({8, 3})}, {"b", torch::randn({3})}};
    for (auto& [n, p] : ps) {
      p.set_requires_grad(true);
      p.mutable_grad() = torch::randn_like(p);
    }
    return ps;
  };
  torch::manual_seed(6);
  model::NamedTensors a = make();
  torch::manual_seed(6);
  model::NamedTensors b = make();
  AdamW oa(a, {}), ob(b, {});
  const double scale = clip_scale(4.0, 1.0);
  oa.step(1e-2, scale);
  ob.step(1e-2, clip_scale(at::scalar_tensor(4.0, at::kDouble), 1.0),
          at::scalar_tensor(false, at::kBool));
  EXPECT_EQ(clip_scale(at::scalar_tensor(4.0, at::kDouble), 1.0).item<double>(), scale);
  EXPECT_EQ(clip_scale(at::scalar_tensor(0.5, at::kDouble), 1.0).item<double>(), 1.0);
  EXPECT_EQ(clip_scale(at::scalar_tensor(NAN, at::kDouble), 1.0).item<double>(), 1.0);
  EXPECT_EQ(clip_scale(at::scalar_tensor(4.0, at::kDouble), 0.0).item<double>(), 1.0);
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(torch::equal(a[k].second, b[k].second));
  std::vector<at::Tensor> kept;
  for (const auto& [n, p] : b) kept.push_back(p.detach().clone());
  ob.step(1e-2, at::scalar_tensor(1.0, at::kDouble), at::scalar_tensor(true, at::kBool));
  for (size_t k = 0; k < b.size(); ++k) EXPECT_TRUE(torch::equal(b[k].second, kept[k]));
  EXPECT_TRUE(torch::equal(ob.exp_avg()[0], oa.exp_avg()[0]));
}

}  // namespace
}  // namespace weft::train
