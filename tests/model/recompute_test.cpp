// Activation recomputation (model/recompute.h): a small multimodal model (ViT with a conv stem
// and a [CLS] token, Whisper-style audio encoder, LLM with QKV biases) gives the same loss and
// per-parameter gradients with every module recomputed as without, in fp32 and bf16 compute,
// with frozen modules; recompute() itself: gradients reach each leaf once (its hooks fire once),
// frozen parameters and inputs without grad, eval mode, the compute dtype in backward; and the
// block parameter lists cover every parameter of a block.
#include "weft/model/recompute.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include "support/model_specs.h"
#include "weft/data/collate.h"
#include "weft/model/multimodal.h"
#include "weft/train/inputs.h"

namespace weft::model {
namespace {

constexpr int64_t kPad = 0, kBos = 1, kImage = 2, kAudio = 3;

// tiny_multimodal_spec with QKV biases, and a ViT with a conv stem, a [CLS] token and LLaVA-style
// features (the last of 3 blocks built but not run).
ModelSpec tiny_spec(bool recompute) {
  ModelSpec m = testing::tiny_multimodal_spec();
  m.llm.qkv_bias = true;
  m.llm.recompute = recompute;
  EncoderSpec& v = m.encoders[0];
  v.stem_channels = 4;
  v.class_token = true;
  v.layers = 3;
  v.feature_layer = -2;
  for (EncoderSpec& e : m.encoders) e.recompute = recompute;
  return m;
}

// Sample 0: <bos> [img×4] 5 6 7; sample 1: <bos> [aud×4] [img×4] 8 9 10 (fixed random media).
Inputs tiny_inputs(bool packing) {
  torch::manual_seed(7);
  data::Sample s0;
  s0.tokens = {kBos, kImage, kImage, kImage, kImage, 5, 6, 7};
  s0.is_target = {0, 0, 0, 0, 0, 0, 1, 1};
  s0.items = {{0, 1, 4, torch::randn({3, 16, 16})}};
  data::Sample s1;
  s1.tokens = {kBos, kAudio, kAudio, kAudio, kAudio, kImage, kImage, kImage, kImage, 8, 9, 10};
  s1.is_target = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1};
  s1.items = {{1, 1, 4, torch::randn({8, 8})}, {0, 5, 4, torch::randn({3, 16, 16})}};
  data::CollateOptions o;
  o.num_encoders = 2;
  o.pad_id = kPad;
  o.packing = packing;
  o.max_seq = 32;
  return train::to_inputs(data::collate({s0, s1}, o));
}

// Autograd nodes reachable from t whose name contains `needle`.
int count_nodes(const at::Tensor& t, const std::string& needle) {
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  if (t.grad_fn()) stack.push_back(t.grad_fn().get());
  int n = 0;
  while (!stack.empty()) {
    torch::autograd::Node* f = stack.back();
    stack.pop_back();
    if (!seen.insert(f).second) continue;
    if (f->name().find(needle) != std::string::npos) ++n;
    for (const auto& e : f->next_edges())
      if (e.function) stack.push_back(e.function.get());
  }
  return n;
}

struct LossAndGrads {
  double loss = 0;
  int recomputed_blocks = 0;
  std::map<std::string, at::Tensor> grads;  // parameters that received one
};

LossAndGrads loss_and_grads(const ModelSpec& spec, const Inputs& in, at::ScalarType dtype) {
  MultimodalModel model(spec, /*seed=*/5);
  at::Tensor loss;
  {
    ComputeDtypeGuard compute(dtype);
    loss = model.loss_sum(in);
  }
  LossAndGrads r;
  r.recomputed_blocks = count_nodes(loss, "Recompute");
  loss.backward();  // outside the guard: recomputation must bring back the forward's dtype
  r.loss = loss.item<double>();
  for (const auto& [name, p] : model.parameters())
    if (p.grad().defined()) r.grads[name] = p.grad().clone();
  return r;
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-30);
}

// Same loss and the same set of gradients, each within `tol` relative (‖a−b‖/‖b‖).
void expect_same(const LossAndGrads& got, const LossAndGrads& ref, double tol,
                 const std::string& tag) {
  EXPECT_NEAR(got.loss, ref.loss, tol * std::abs(ref.loss)) << tag;
  ASSERT_EQ(got.grads.size(), ref.grads.size()) << tag;
  double worst = 0;
  int bitwise = 0;
  for (const auto& [name, g] : ref.grads) {
    ASSERT_TRUE(got.grads.count(name)) << tag << ": no gradient for " << name;
    const at::Tensor& a = got.grads.at(name);
    const double d = rel_diff(a, g);
    worst = std::max(worst, d);
    bitwise += a.equal(g) ? 1 : 0;
    EXPECT_LT(d, tol) << tag << ": " << name;
  }
  std::printf("[%s] loss %.6f vs %.6f, %zu gradients: %d bitwise equal, max relative diff %.2e\n",
              tag.c_str(), got.loss, ref.loss, ref.grads.size(), bitwise, worst);
}

TEST(Recompute, EveryModuleRecomputedMatchesFp32) {
  const Inputs in = tiny_inputs(/*packing=*/false);
  const LossAndGrads ref = loss_and_grads(tiny_spec(false), in, at::kFloat);
  const LossAndGrads got = loss_and_grads(tiny_spec(true), in, at::kFloat);
  EXPECT_EQ(ref.recomputed_blocks, 0);
  EXPECT_EQ(got.recomputed_blocks, 2 + 2 + 2);  // LLM, vision (2 of 3 run), audio
  // Every parameter but the vision block past feature_layer gets a gradient.
  EXPECT_EQ(ref.grads.count("vision.layers.2.ln1.weight"), 0u);
  EXPECT_EQ(ref.grads.count("vision.layers.0.ln1.weight"), 1u);
  EXPECT_EQ(ref.grads.count("vision.stem.0.weight"), 1u);
  expect_same(got, ref, 1e-6, "fp32");
}

TEST(Recompute, EveryModuleRecomputedMatchesBf16Packed) {
  const Inputs in = tiny_inputs(/*packing=*/true);  // document mask in the LLM
  const LossAndGrads ref = loss_and_grads(tiny_spec(false), in, at::kBFloat16);
  const LossAndGrads got = loss_and_grads(tiny_spec(true), in, at::kBFloat16);
  EXPECT_EQ(got.recomputed_blocks, 6);
  expect_same(got, ref, 1e-3, "bf16");
}

// recompute_blocks: only the first blocks of each module's chunk are recomputed (here 1 of the
// LLM's 2, 1 of the vision encoder's 2 that run, 1 of the audio encoder's 2), the numbers as
// without recomputation.
TEST(Recompute, FirstBlocksOnlyMatchFp32) {
  const Inputs in = tiny_inputs(/*packing=*/false);
  ModelSpec some = tiny_spec(true);
  some.llm.recompute_blocks = {1};
  for (EncoderSpec& e : some.encoders) e.recompute_blocks = {1};
  const LossAndGrads ref = loss_and_grads(tiny_spec(false), in, at::kFloat);
  const LossAndGrads got = loss_and_grads(some, in, at::kFloat);
  EXPECT_EQ(got.recomputed_blocks, 1 + 1 + 1);
  expect_same(got, ref, 1e-6, "first blocks");
  // As many as the module has: every block.
  some.llm.recompute_blocks = {2};
  EXPECT_EQ(loss_and_grads(some, in, at::kFloat).recomputed_blocks, 2 + 1 + 1);
}

// Each pipeline chunk counts its own first blocks: an LLM of 5 blocks in chunks of 3 and 2 (the
// stages of pp = 2), with recompute_blocks = 2, recomputes blocks 0, 1 and 3, 4 (2 + 2 nodes);
// with one count per stage, [2, 0] blocks 0, 1 only and [1, 2] blocks 0 and 3, 4. Each chunk's
// output and input gradient are those of the same chunk without recomputation.
TEST(Recompute, FirstBlocksOfEachChunk) {
  LlmSpec l = tiny_spec(false).llm;
  l.layers = 5;
  const std::vector<StageRange> chunks = {{0, 3, true, false, 0}, {3, 5, false, true, 1}};
  ParamSet plain_ps;
  const Llm plain = Llm::make(Scope{&plain_ps, "llm"}, l, chunks);
  ASSERT_EQ(plain.blocks.size(), 5u);
  torch::manual_seed(3);
  const int64_t B = 2, S = 6;
  const at::Tensor x0 = torch::randn({B, S, l.hidden});
  const at::Tensor positions = torch::arange(S).unsqueeze(0).expand({B, S}).contiguous();
  const AttentionMask mask{
      visible_mask(torch::zeros({B, S}, torch::kLong), torch::full({B, S}, -1, torch::kLong))};
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases = {
      {{2}, {2, 2}}, {{2, 0}, {2, 0}}, {{1, 2}, {1, 2}}};
  for (const auto& [blocks, nodes] : cases) {
    LlmSpec on = l;
    on.recompute = true;
    on.recompute_blocks = blocks;
    ParamSet on_ps;
    const Llm some = Llm::make(Scope{&on_ps, "llm"}, on, chunks);  // the same seeded weights
    for (size_t c = 0; c < chunks.size(); ++c) {
      SCOPED_TRACE(recompute_blocks_text(blocks) + " chunk " + std::to_string(c));
      const at::Tensor a = x0.clone().requires_grad_(true), b = x0.clone().requires_grad_(true);
      const at::Tensor ya = plain.blocks_forward(a, positions, mask, {}, c);
      const at::Tensor yb = some.blocks_forward(b, positions, mask, {}, c);
      EXPECT_EQ(count_nodes(ya, "Recompute"), 0);
      EXPECT_EQ(count_nodes(yb, "Recompute"), nodes[c]);
      EXPECT_TRUE(yb.allclose(ya, 1e-6, 1e-6));
      const at::Tensor g = torch::randn_like(ya);
      ya.backward(g);
      yb.backward(g);
      EXPECT_LT(rel_diff(b.grad(), a.grad()), 1e-6);
    }
  }
}

// A frozen encoder records nothing (no recompute node: nothing in it needs a gradient); a frozen
// LLM still passes input gradients back to the trainable encoders through its recomputed blocks.
TEST(Recompute, FrozenModules) {
  const Inputs in = tiny_inputs(/*packing=*/false);
  ModelSpec off = tiny_spec(false), on = tiny_spec(true);
  off.encoders[0].frozen = on.encoders[0].frozen = true;
  const LossAndGrads ref = loss_and_grads(off, in, at::kFloat);
  const LossAndGrads got = loss_and_grads(on, in, at::kFloat);
  EXPECT_EQ(got.recomputed_blocks, 2 + 2);
  for (const auto& [name, g] : got.grads)
    EXPECT_NE(MultimodalModel::module_of(name), "vision") << name << " is frozen";
  EXPECT_TRUE(got.grads.count("vision.projector.fc1.weight"));  // its projector is not
  EXPECT_TRUE(got.grads.count("llm.layers.0.attn.qkv.weight"));
  expect_same(got, ref, 1e-6, "frozen vision");

  off = tiny_spec(false), on = tiny_spec(true);
  off.llm.frozen = on.llm.frozen = true;
  const LossAndGrads ref_llm = loss_and_grads(off, in, at::kFloat);
  const LossAndGrads got_llm = loss_and_grads(on, in, at::kFloat);
  EXPECT_EQ(got_llm.recomputed_blocks, 6);
  for (const auto& [name, g] : got_llm.grads)
    EXPECT_NE(MultimodalModel::module_of(name), "llm") << name << " is frozen";
  EXPECT_TRUE(got_llm.grads.count("vision.layers.0.attn.qkv.weight"));
  EXPECT_TRUE(got_llm.grads.count("audio.conv1.weight"));
  expect_same(got_llm, ref_llm, 1e-6, "frozen llm");
}

// --- recompute() itself ---------------------------------------------------------------------

// y = tanh(x W^T + b) * s: a block of three parameters.
at::Tensor toy_block(const at::Tensor& x, const std::vector<at::Tensor>& p) {
  return torch::tanh(at::linear(x, to_compute(p[0]), to_compute(p[1]))) * to_compute(p[2]);
}

TEST(Recompute, GradientsReachEachLeafOnceThroughItsHooks) {
  torch::manual_seed(3);
  const at::Tensor w = torch::randn({6, 5}).requires_grad_();
  const at::Tensor b = torch::randn({6}).requires_grad_();
  const at::Tensor s = torch::randn({6});  // frozen
  const at::Tensor x = torch::randn({4, 5}).requires_grad_();
  int w_hooks = 0, b_hooks = 0, calls = 0;
  w.register_hook([&](const at::Tensor&) { ++w_hooks; });
  b.register_hook([&](const at::Tensor&) { ++b_hooks; });
  const BlockFn block = [&](const at::Tensor& h, const std::vector<at::Tensor>& p) {
    ++calls;
    return toy_block(h, p);
  };
  const at::Tensor y = recompute(block, x, {w, b, s});
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(count_nodes(y, "Recompute"), 1);
  (y * y).sum().backward();
  EXPECT_EQ(calls, 2);  // once more in backward
  EXPECT_EQ(w_hooks, 1);
  EXPECT_EQ(b_hooks, 1);
  EXPECT_FALSE(s.grad().defined());

  const at::Tensor w2 = w.detach().clone().requires_grad_();
  const at::Tensor b2 = b.detach().clone().requires_grad_();
  const at::Tensor x2 = x.detach().clone().requires_grad_();
  const at::Tensor y2 = toy_block(x2, {w2, b2, s});
  (y2 * y2).sum().backward();
  EXPECT_TRUE(y.equal(y2));
  EXPECT_LT(rel_diff(w.grad(), w2.grad()), 1e-6);
  EXPECT_LT(rel_diff(b.grad(), b2.grad()), 1e-6);
  EXPECT_LT(rel_diff(x.grad(), x2.grad()), 1e-6);
}

// The first block of an encoder fed by pixels: the input needs no gradient, the parameters do.
TEST(Recompute, InputWithoutGrad) {
  torch::manual_seed(4);
  const at::Tensor w = torch::randn({6, 5}).requires_grad_();
  const at::Tensor b = torch::randn({6}).requires_grad_();
  const at::Tensor s = torch::randn({6}).requires_grad_();
  const at::Tensor x = torch::randn({4, 5});
  recompute(toy_block, x, {w, b, s}).sum().backward();
  const at::Tensor w2 = w.detach().clone().requires_grad_();
  toy_block(x, {w2, b.detach(), s.detach()}).sum().backward();
  EXPECT_LT(rel_diff(w.grad(), w2.grad()), 1e-6);
  EXPECT_TRUE(b.grad().defined());
  EXPECT_TRUE(s.grad().defined());
}

TEST(Recompute, NothingToDifferentiateOrEvalIsAPlainCall) {
  const at::Tensor w = torch::randn({6, 5}), b = torch::randn({6}), s = torch::randn({6});
  const at::Tensor x = torch::randn({4, 5});
  int calls = 0;
  const BlockFn block = [&](const at::Tensor& h, const std::vector<at::Tensor>& p) {
    ++calls;
    return toy_block(h, p);
  };
  EXPECT_FALSE(recompute(block, x, {w, b, s}).requires_grad());  // nothing requires grad
  const at::Tensor wg = w.clone().requires_grad_();
  {
    torch::NoGradGuard eval;
    const at::Tensor y = recompute(block, x, {wg, b, s});
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(y.allclose(toy_block(x, {w, b, s})));
  }
  EXPECT_EQ(calls, 2);
}

// Backward runs the block in the forward's compute dtype, whatever the backward thread's is.
TEST(Recompute, RecomputesInTheForwardsComputeDtype) {
  torch::manual_seed(5);
  const at::Tensor w = torch::randn({6, 5}).requires_grad_();
  const at::Tensor b = torch::randn({6}).requires_grad_();
  const at::Tensor s = torch::randn({6}).requires_grad_();
  const at::Tensor x = torch::randn({4, 5}).to(at::kBFloat16).requires_grad_();
  std::vector<at::ScalarType> seen;
  const BlockFn block = [&](const at::Tensor& h, const std::vector<at::Tensor>& p) {
    seen.push_back(compute_dtype());
    return toy_block(h, p);
  };
  at::Tensor y;
  {
    ComputeDtypeGuard bf16(at::kBFloat16);
    y = recompute(block, x, {w, b, s});
  }
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  y.sum().backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], at::kBFloat16);
  EXPECT_EQ(seen[1], at::kBFloat16);
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);  // fp32 masters get fp32 gradients
  EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
}

// --- block parameter lists ------------------------------------------------------------------

// The TensorImpls of the ParamSet's parameters named `prefix`*.
std::set<const void*> params_named(const ParamSet& ps, const std::string& prefix) {
  std::set<const void*> out;
  for (const auto& [name, p] : ps.all())
    if (name.rfind(prefix, 0) == 0) out.insert(p.unsafeGetTensorImpl());
  return out;
}

std::set<const void*> impls(const std::vector<at::Tensor>& ts) {
  std::set<const void*> out;
  for (const at::Tensor& t : ts) out.insert(t.unsafeGetTensorImpl());
  return out;
}

TEST(Recompute, BlockParamsListEveryParameterOfTheBlock) {
  ParamSet ps;
  LlmSpec l = tiny_spec(false).llm;
  const Llm llm = Llm::make(Scope{&ps, "llm"}, l);
  ASSERT_EQ(llm.blocks.size(), 2u);
  for (size_t i = 0; i < llm.blocks.size(); ++i) {
    const std::vector<at::Tensor> p = block_params(llm.blocks[i]);
    EXPECT_EQ(p.size(), 7u);  // 2 norms, qkv weight + bias, out, gate_up, down
    EXPECT_EQ(impls(p), params_named(ps, "llm.layers." + std::to_string(i) + "."));
  }
  const EncoderBlock eb = EncoderBlock::make(Scope{&ps, "enc"}, 16, 2, 32, 1e-5, 1);
  const std::vector<at::Tensor> p = block_params(eb);
  EXPECT_EQ(p.size(), 12u);  // every layer with its bias
  EXPECT_EQ(impls(p), params_named(ps, "enc."));

  // with_params: the block computes with the tensors it is given.
  const at::Tensor x = torch::randn({2, 3, 16});
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(with_params(eb, p)(x).equal(eb(x)));
  std::vector<at::Tensor> doubled;
  for (const at::Tensor& t : p) doubled.push_back(t * 2);
  EXPECT_FALSE(with_params(eb, doubled)(x).allclose(eb(x)));
}

}  // namespace
}  // namespace weft::model
