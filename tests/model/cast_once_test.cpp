// model::CastOnce (layers.h): a parameter's cast to the compute dtype made once per scope and
// shared by every use, with the gradients of casting at every use, bit for bit: across
// microbatches run one after the other or interleaved as 1F1B runs them, through recomputed
// blocks (whose detached parameter aliases find the casts); frozen parameters in grad mode
// (kept), casts without grad mode (not kept), inputs and views (never looked up), parameters
// written in place (cast again), another thread, and the scope's end.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/model_specs.h"
#include "weft/data/collate.h"
#include "weft/model/layers.h"
#include "weft/model/multimodal.h"
#include "weft/model/recompute.h"
#include "weft/train/inputs.h"

namespace weft::model {
namespace {

constexpr int64_t kPad = 0, kBos = 1, kImage = 2, kAudio = 3;

// Two microbatches of the tiny multimodal model's inputs (image, audio and text).
std::vector<Inputs> microbatches() {
  torch::manual_seed(3);
  std::vector<Inputs> out;
  for (int m = 0; m < 2; ++m) {
    data::Sample s0;
    s0.tokens = {kBos, kImage, kImage, kImage, kImage, 5 + m, 6, 7};
    s0.is_target = {0, 0, 0, 0, 0, 0, 1, 1};
    s0.items = {{0, 1, 4, torch::randn({3, 16, 16})}};
    data::Sample s1;
    s1.tokens = {kBos, kAudio, kAudio, kAudio, kAudio, 8, 9, 10 + m};
    s1.is_target = {0, 0, 0, 0, 0, 1, 1, 1};
    s1.items = {{1, 1, 4, torch::randn({8, 8})}};
    data::CollateOptions o;
    o.num_encoders = 2;
    o.pad_id = kPad;
    o.max_seq = 32;
    out.push_back(train::to_inputs(data::collate({s0, s1}, o)));
  }
  return out;
}

struct Result {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> grads;
  int64_t casts = -1, shared = -1;  // with a scope
};

enum class Order { kInTurn, kInterleaved };  // f0 b0 f1 b1, or f0 f1 b0 b1 (1F1B's warm-up)

// Losses and gradients of both microbatches in bf16, in a CastOnce scope or without.
Result run(const ModelSpec& spec, Order order, std::optional<CastOnce::Keep> keep) {
  MultimodalModel model(spec, /*seed=*/11);
  const std::vector<Inputs> mbs = microbatches();
  ComputeDtypeGuard dtype(at::kBFloat16);
  std::optional<CastOnce> casts;
  if (keep) casts.emplace(model.parameters(), *keep);
  Result r;
  std::vector<at::Tensor> losses;
  for (const Inputs& in : mbs) {
    losses.push_back(model.loss_sum(in));
    if (order == Order::kInTurn) losses.back().backward();
  }
  if (order == Order::kInterleaved)
    for (at::Tensor& l : losses) l.backward();
  for (const at::Tensor& l : losses) r.losses.push_back(l.item<double>());
  for (const auto& [name, p] : model.parameters())
    if (p.grad().defined()) r.grads[name] = p.grad().clone();
  if (casts) {
    r.casts = casts->casts();
    r.shared = casts->shared();
  }
  return r;
}

void expect_bitwise(const Result& got, const Result& ref) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_EQ(got.losses[i], ref.losses[i]) << i;
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (const auto& [name, g] : ref.grads) {
    ASSERT_TRUE(got.grads.count(name)) << "no gradient for " << name;
    EXPECT_TRUE(got.grads.at(name).equal(g)) << name;
  }
}

// Floating parameters of the model that require grad.
int64_t trained_params(const ModelSpec& spec) {
  MultimodalModel model(spec, 11);
  int64_t n = 0;
  for (const auto& [name, p] : model.parameters()) n += p.requires_grad() ? 1 : 0;
  return n;
}

TEST(CastOnce, MicrobatchesShareOneCastWithTheSameGradients) {
  const ModelSpec spec = testing::tiny_multimodal_spec();
  for (Order order : {Order::kInTurn, Order::kInterleaved}) {
    SCOPED_TRACE(order == Order::kInTurn ? "in turn" : "interleaved");
    const Result ref = run(spec, order, std::nullopt);
    const Result got = run(spec, order, CastOnce::Keep::kForBackward);
    expect_bitwise(got, ref);
    // Every trained parameter is cast once (norm weights are used in fp32: no cast), and the
    // second microbatch uses every cast again.
    EXPECT_GT(got.casts, 0);
    EXPECT_LE(got.casts, trained_params(spec));
    EXPECT_GE(got.shared, got.casts);
  }
}

TEST(CastOnce, RecomputedBlocksFindTheirCasts) {
  ModelSpec spec = testing::tiny_multimodal_spec();
  spec.llm.recompute = true;
  for (EncoderSpec& e : spec.encoders) e.recompute = true;
  const Result ref = run(spec, Order::kInTurn, std::nullopt);
  // kForBackward keeps no cast made inside a recomputed block (without grad mode in forward,
  // recomputing in backward): those stay transient, as without a scope. What lies outside the
  // blocks is kept.
  const Result trained = run(spec, Order::kInTurn, CastOnce::Keep::kForBackward);
  expect_bitwise(trained, ref);
  EXPECT_GT(trained.casts, 0);
  // kEverything keeps the blocks' casts too: their recomputation in backward, on detached
  // aliases of the parameters, finds them, and the gradients are still the same.
  const Result all = run(spec, Order::kInTurn, CastOnce::Keep::kEverything);
  expect_bitwise(all, ref);
  EXPECT_GT(all.casts, trained.casts);
  // A block's parameter is used four times (each microbatch's forward and recomputation), one
  // outside the blocks twice: three shared uses per block cast, one per other cast. Without the
  // aliases found, the recomputations would cast again and only one use per cast be shared.
  const int64_t in_blocks = all.casts - trained.casts;
  EXPECT_GE(all.shared, all.casts + 2 * in_blocks);
}

TEST(CastOnce, KeepsOnlyWhatItShould) {
  ComputeDtypeGuard dtype(at::kBFloat16);
  const at::Tensor w = torch::randn({4, 3}).set_requires_grad(true);
  const at::Tensor frozen = torch::randn({4, 3});  // used in grad mode: kept
  const at::Tensor cold = torch::randn({4, 3});    // used without grad mode only: not kept
  const at::Tensor x = torch::randn({4, 3});       // an input: not a parameter
  const NamedTensors params = {{"w", w}, {"frozen", frozen}, {"cold", cold}};
  const at::Tensor a = torch::randn({4, 3}), b = torch::randn({4, 3});
  auto loss_of = [&] {
    return (to_compute(w).to(at::kFloat) * a).sum() + (to_compute(w).to(at::kFloat) * b).sum();
  };
  at::Tensor ref_grad;
  {
    loss_of().backward();
    ref_grad = w.grad().clone();
    w.mutable_grad().reset();
  }
  at::Tensor kept;
  {
    CastOnce casts(params, CastOnce::Keep::kForBackward);
    loss_of().backward();
    EXPECT_TRUE(w.grad().equal(ref_grad));
    EXPECT_EQ(casts.casts(), 1);
    EXPECT_EQ(casts.shared(), 1);
    kept = to_compute(w);
    EXPECT_TRUE(kept.requires_grad());
    EXPECT_EQ(casts.shared(), 2);
    {  // without grad mode, a kept cast is still shared, and nothing new is kept
      at::NoGradGuard no_grad;
      EXPECT_EQ(to_compute(w).data_ptr(), kept.data_ptr());
      EXPECT_NE(to_compute(cold).data_ptr(), to_compute(cold).data_ptr());
      EXPECT_TRUE(to_compute(cold).equal(cold.to(at::kBFloat16)));
    }
    EXPECT_EQ(casts.shared(), 3);
    // A frozen parameter in grad mode is kept, without a gradient edge.
    EXPECT_EQ(to_compute(frozen).data_ptr(), to_compute(frozen).data_ptr());
    EXPECT_FALSE(to_compute(frozen).requires_grad());
    EXPECT_TRUE(to_compute(frozen).equal(frozen.to(at::kBFloat16)));
    EXPECT_EQ(casts.casts(), 2);
    // Inputs and views of a parameter are cast at each use.
    EXPECT_TRUE(to_compute(x).equal(x.to(at::kBFloat16)));
    EXPECT_NE(to_compute(w.view({12})).data_ptr(), kept.data_ptr());
    EXPECT_EQ(casts.casts(), 2);
    // Another thread finds the scope through Resume.
    const std::weak_ptr<CastOnce::Cache> current = CastOnce::current();
    const void* there = nullptr;
    std::thread([&] {
      ComputeDtypeGuard dtype_there(at::kBFloat16);
      CastOnce::Resume resume(current);
      there = to_compute(w).data_ptr();
    }).join();
    EXPECT_EQ(there, kept.data_ptr());
  }
  // After the scope: a cast at every use again.
  EXPECT_EQ(CastOnce::current().lock(), nullptr);
  EXPECT_NE(to_compute(w).data_ptr(), kept.data_ptr());
  {
    CastOnce casts(params, CastOnce::Keep::kEverything);
    const std::weak_ptr<CastOnce::Cache> ended = [&] {
      CastOnce inner(params, CastOnce::Keep::kEverything);
      return CastOnce::current();
    }();
    EXPECT_NE(CastOnce::current().lock(), nullptr);  // the outer scope again
    {  // work resumed for an ended scope runs without one
      CastOnce::Resume resume(ended);
      EXPECT_EQ(CastOnce::current().lock(), nullptr);
    }
    EXPECT_NE(CastOnce::current().lock(), nullptr);
    // kEverything keeps casts made without grad mode too.
    at::NoGradGuard no_grad;
    EXPECT_EQ(to_compute(cold).data_ptr(), to_compute(cold).data_ptr());
    EXPECT_EQ(to_compute(w).data_ptr(), to_compute(w).data_ptr());
    EXPECT_EQ(casts.casts(), 2);
    EXPECT_EQ(casts.shared(), 2);
    // A parameter written in place is cast again, not served its old cast.
    const at::Tensor before = to_compute(cold);
    cold.add_(1);
    const at::Tensor after = to_compute(cold);
    EXPECT_NE(after.data_ptr(), before.data_ptr());
    EXPECT_TRUE(after.equal(cold.to(at::kBFloat16)));
    EXPECT_EQ(casts.casts(), 3);
    EXPECT_EQ(to_compute(cold).data_ptr(), after.data_ptr());
  }
}

}  // namespace
}  // namespace weft::model
