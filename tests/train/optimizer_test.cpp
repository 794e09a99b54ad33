// AdamW over pieces (ZeRO-1's shards of parameters): stepping ranges of the parameters, each
// with its own gradient view, is the update of the whole parameters; weight decay follows the
// parameter (matrices only), not the flat piece; moments come out whole and load into any other
// split.
#include "weft/train/optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

namespace weft::train {
namespace {

TEST(AdamW, PiecesStepLikeTheWholeParameters) {
  torch::manual_seed(3);
  const at::Tensor w0 = torch::randn({4, 5}), b0 = torch::randn({7});
  const model::NamedTensors whole = {{"w", w0.clone()}, {"b", b0.clone()}};
  const model::NamedTensors split = {{"w", w0.clone()}, {"b", b0.clone()}};
  AdamWOptions opts;
  opts.weight_decay = 0.1;
  AdamW a(whole, opts);
  // Where each piece's summed gradient lands (as a GradSync bucket's shard): flat buffers.
  const at::Tensor gw = torch::zeros({20}), gb = torch::zeros({7});
  AdamW b(split, opts,
          {{0, 0, 8, gw.narrow(0, 0, 8), {}},
           {0, 8, 12, gw.narrow(0, 8, 12), {}},
           {1, 0, 3, gb.narrow(0, 0, 3), {}},
           {1, 3, 4, gb.narrow(0, 3, 4), {}}});
  for (int step = 0; step < 3; ++step) {
    const at::Tensor g1 = torch::randn({4, 5}), g2 = torch::randn({7});
    whole[0].second.mutable_grad() = g1.clone();
    whole[1].second.mutable_grad() = g2.clone();
    gw.copy_(g1.view({-1}));
    gb.copy_(g2);
    a.step(1e-2, 0.5);
    b.step(1e-2, 0.5);
  }
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_TRUE(torch::allclose(split[k].second, whole[k].second, 0, 1e-7)) << whole[k].first;
    EXPECT_TRUE(torch::allclose(b.exp_avg()[k], a.exp_avg()[k], 0, 1e-7)) << whole[k].first;
    EXPECT_TRUE(torch::allclose(b.exp_avg_sq()[k], a.exp_avg_sq()[k], 0, 1e-7)) << whole[k].first;
  }
  EXPECT_FALSE(torch::allclose(whole[0].second, w0));

  // The whole state loads into another split, which then steps like the whole optimizer.
  const model::NamedTensors other = {{"w", whole[0].second.clone()},
                                     {"b", whole[1].second.clone()}};
  const at::Tensor hw = torch::zeros({20});
  AdamW c(other, opts, {{0, 13, 7, hw.narrow(0, 13, 7), {}}});  // a rank holding w's tail only
  std::map<std::string, at::Tensor> state;  // as a checkpoint holds them, read by range
  for (size_t k = 0; k < 2; ++k) {
    state["exp_avg." + whole[k].first] = a.exp_avg()[k];
    state["exp_avg_sq." + whole[k].first] = a.exp_avg_sq()[k];
  }
  std::vector<std::string> reads;
  c.load_state(
      [&](size_t param, const std::string& key, int64_t begin, int64_t length) {
        reads.push_back(key + "@" + std::to_string(param) + ":" + std::to_string(begin) + "+" +
                        std::to_string(length));
        return state.at(key).reshape({-1}).narrow(0, begin, length);
      },
      a.steps());
  // Only w's piece is read, its range alone.
  EXPECT_EQ(reads, (std::vector<std::string>{"exp_avg.w@0:13+7", "exp_avg_sq.w@0:13+7"}));
  const std::vector<at::Tensor> m = c.exp_avg();
  EXPECT_FALSE(m[1].defined());  // no piece of b here
  EXPECT_TRUE(
      torch::equal(m[0].view({-1}).narrow(0, 13, 7), a.exp_avg()[0].view({-1}).narrow(0, 13, 7)));
  EXPECT_TRUE(torch::equal(m[0].view({-1}).narrow(0, 0, 13), torch::zeros({13})));
  const at::Tensor g = torch::randn({4, 5});
  whole[0].second.mutable_grad() = g.clone();
  whole[1].second.mutable_grad() = torch::zeros({7});
  hw.copy_(g.view({-1}));
  a.step(1e-2);
  c.step(1e-2);
  EXPECT_TRUE(torch::allclose(other[0].second.view({-1}).narrow(0, 13, 7),
                              whole[0].second.view({-1}).narrow(0, 13, 7), 0, 1e-7));
  // Outside its piece, c left the parameter alone.
  EXPECT_FALSE(torch::allclose(other[0].second.view({-1}).narrow(0, 0, 13),
                               whole[0].second.view({-1}).narrow(0, 0, 13)));
}

// A parameter held in bf16 (ZeRO-1 under bf16): its pieces step their fp32 masters exactly as
// fp32 parameters would be stepped, the moments come out fp32, and the bf16 parameter itself is
// left for the gather to write.
TEST(AdamW, PiecesWithMastersStepTheMastersNotTheParameter) {
  torch::manual_seed(5);
  const at::Tensor w0 = torch::randn({4, 5});
  const model::NamedTensors whole = {{"w", w0.clone()}};
  const model::NamedTensors held = {{"w", w0.to(at::kBFloat16)}};
  AdamWOptions opts;
  opts.weight_decay = 0.1;
  AdamW a(whole, opts);
  const at::Tensor gw = torch::zeros({20});
  const at::Tensor m0 = w0.view({-1}).narrow(0, 0, 12).clone(),
                   m1 = w0.view({-1}).narrow(0, 12, 8).clone();
  AdamW b(held, opts, {{0, 0, 12, gw.narrow(0, 0, 12), m0}, {0, 12, 8, gw.narrow(0, 12, 8), m1}});
  for (int step = 0; step < 3; ++step) {
    const at::Tensor g = torch::randn({4, 5});
    whole[0].second.mutable_grad() = g.clone();
    gw.copy_(g.view({-1}));
    a.step(1e-2, 0.5);
    b.step(1e-2, 0.5);
  }
  EXPECT_TRUE(torch::equal(torch::cat({m0, m1}), whole[0].second.view({-1})));
  EXPECT_EQ(b.exp_avg()[0].scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(b.exp_avg()[0], a.exp_avg()[0]));
  EXPECT_TRUE(torch::equal(held[0].second, w0.to(at::kBFloat16)));
}

}  // namespace
}  // namespace weft::train
