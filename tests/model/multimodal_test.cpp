// MultimodalModel on a tiny two-encoder model: the loss counts target tokens only, features
// replace placeholder embeddings, placeholder-count errors, frozen modules, parameter names.
#include "weft/model/multimodal.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "support/errors.h"
#include "support/model_specs.h"
#include "weft/core/error.h"
#include "weft/data/collate.h"
#include "weft/model/mask.h"
#include "weft/train/inputs.h"

namespace weft::model {
namespace {

constexpr int64_t kPad = 0, kBos = 1, kImage = 2, kAudio = 3;

ModelSpec tiny_spec() {
  ModelSpec m = testing::tiny_multimodal_spec();
  m.llm.tie_embeddings = false;  // so the embedding gradient shows which rows were looked up
  return m;
}

data::ModalityItem image_at(int64_t start) { return {0, start, 4, torch::randn({3, 16, 16})}; }
data::ModalityItem clip_at(int64_t start) { return {1, start, 4, torch::randn({8, 8})}; }

// Sample 0: <bos> [img×4] 5 6 7, targets 6 7.
// Sample 1: <bos> [aud×4] [img×4] 8 9 10, targets 9 10.
std::vector<data::Sample> samples() {
  data::Sample s0;
  s0.tokens = {kBos, kImage, kImage, kImage, kImage, 5, 6, 7};
  s0.is_target = {0, 0, 0, 0, 0, 0, 1, 1};
  s0.items = {image_at(1)};
  data::Sample s1;
  s1.tokens = {kBos, kAudio, kAudio, kAudio, kAudio, kImage, kImage, kImage, kImage, 8, 9, 10};
  s1.is_target = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1};
  s1.items = {clip_at(1), image_at(5)};
  return {s0, s1};
}

Inputs collate(const std::vector<data::Sample>& s, bool packing) {
  data::CollateOptions o;
  o.num_encoders = 2;
  o.pad_id = kPad;
  o.packing = packing;
  o.max_seq = 32;
  return train::to_inputs(data::collate(s, o));
}

float loss_of(const MultimodalModel& m, const Inputs& in) {
  torch::NoGradGuard no_grad;
  return m.loss_sum(in).item<float>();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no weft::Error thrown)";
}

TEST(Multimodal, LossIsCrossEntropyOnTargetTokensOnly) {
  torch::manual_seed(21);
  MultimodalModel model(tiny_spec());
  const Inputs in = collate(samples(), /*packing=*/false);
  ASSERT_EQ(in.tokens.sizes(), (std::vector<int64_t>{2, 12}));

  at::Tensor loss = model.loss_sum(in);
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);

  torch::NoGradGuard no_grad;
  at::Tensor h = model.hidden(model.embed(in), in);
  ASSERT_EQ(h.sizes(), (std::vector<int64_t>{2, 12, 32}));
  at::Tensor logits = model.llm().logits(h.reshape({24, 32})).to(torch::kDouble);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{24, 20}));
  auto L = logits.accessor<double, 2>();
  // (row of B·S, next token) for every target, written out: row 0 = sample 0 (S = 12),
  // tokens 5→6 at t=5 and 6→7 at t=6; row 1 = sample 1, 8→9 at t=9 and 9→10 at t=10.
  const std::vector<std::pair<int64_t, int64_t>> pairs = {
      {5, 6}, {6, 7}, {12 + 9, 9}, {12 + 10, 10}};
  double expected = 0;
  for (const auto& [row, target] : pairs) {
    double mx = -1e300, z = 0;
    for (int64_t v = 0; v < 20; ++v) mx = std::max(mx, L[row][v]);
    for (int64_t v = 0; v < 20; ++v) z += std::exp(L[row][v] - mx);
    expected += mx + std::log(z) - L[row][target];
  }
  EXPECT_NEAR(loss.item<double>(), expected, 1e-5 * expected);
  // Near-uniform logits at init: each target costs about log(20).
  EXPECT_NEAR(expected / 4.0, std::log(20.0), 0.5);
}

// Packing two samples in one row (isolated documents, positions restarting) gives the same loss
// as padding them into separate rows.
TEST(Multimodal, PackedLossEqualsPaddedLoss) {
  torch::manual_seed(22);
  MultimodalModel model(tiny_spec());
  const auto s = samples();
  const Inputs padded = collate(s, false), packed = collate(s, true);
  ASSERT_EQ(packed.tokens.size(0), 1);
  EXPECT_NEAR(loss_of(model, packed), loss_of(model, padded), 1e-4);
}

TEST(Multimodal, FeaturesReplacePlaceholderTokens) {
  torch::manual_seed(23);
  MultimodalModel model(tiny_spec());
  const Inputs in = collate(samples(), false);
  const float base = loss_of(model, in);

  // Another token id at an image placeholder and at an audio placeholder: bit-identical loss.
  Inputs placeholder = in;
  placeholder.tokens = in.tokens.clone();
  placeholder.tokens[0][2] = 17;
  placeholder.tokens[1][3] = 17;
  EXPECT_EQ(loss_of(model, placeholder), base);

  // The same change at a text position does change it (so the check above can fail).
  Inputs text = in;
  text.tokens = in.tokens.clone();
  text.tokens[0][5] = 17;
  EXPECT_NE(loss_of(model, text), base);

  // A different image changes the loss; so does a different clip.
  Inputs image = in;
  image.encoder_inputs = in.encoder_inputs;
  image.encoder_inputs[0] = in.encoder_inputs[0] + torch::randn_like(in.encoder_inputs[0]);
  EXPECT_GT(std::abs(loss_of(model, image) - base), 1e-6);
  Inputs clip = in;
  clip.encoder_inputs = in.encoder_inputs;
  clip.encoder_inputs[1] = in.encoder_inputs[1] + torch::randn_like(in.encoder_inputs[1]);
  EXPECT_GT(std::abs(loss_of(model, clip) - base), 1e-6);

  // A batch without any audio item (undefined input, no rows) runs.
  const Inputs vision_only = collate({samples()[0]}, false);
  EXPECT_FALSE(vision_only.encoder_inputs[1].defined());
  EXPECT_TRUE(std::isfinite(loss_of(model, vision_only)));
}

TEST(Multimodal, PlaceholderCountMismatchNamesTheEncoder) {
  torch::manual_seed(24);
  MultimodalModel model(tiny_spec());
  const Inputs in = collate(samples(), false);
  ASSERT_EQ(in.encoder_rows[0].numel(), 8);  // two images × 4 tokens

  Inputs fewer = in;
  fewer.encoder_rows = in.encoder_rows;
  fewer.encoder_rows[0] = in.encoder_rows[0].narrow(0, 0, 7);
  const std::string m1 = error_of([&] { model.loss_sum(fewer); });
  EXPECT_NE(m1.find("'vision'"), std::string::npos) << m1;
  EXPECT_NE(m1.find("7 placeholder"), std::string::npos) << m1;

  Inputs no_clip = in;
  no_clip.encoder_inputs = in.encoder_inputs;
  no_clip.encoder_inputs[1] = at::Tensor();
  const std::string m2 = error_of([&] { model.loss_sum(no_clip); });
  EXPECT_NE(m2.find("'audio'"), std::string::npos) << m2;

  Inputs one_encoder = in;
  one_encoder.encoder_inputs = {in.encoder_inputs[0]};
  one_encoder.encoder_rows = {in.encoder_rows[0]};
  EXPECT_THROW(model.loss_sum(one_encoder), Error);
}

// Encoder blocks past feature_layer are built but never run: they do not train (no gradient to
// wait for in a bucket, no optimizer state, no weight decay), even when their module is made
// trainable again; every other parameter gets its gradient.
TEST(Multimodal, BlocksPastTheFeatureLayerDoNotTrain) {
  torch::manual_seed(26);
  ModelSpec spec = tiny_spec();
  spec.encoders[0].layers = 3;
  spec.encoders[0].feature_layer = -2;  // runs blocks 0 and 1
  MultimodalModel model(spec);
  model.set_trainable("vision", true);
  model.loss_sum(collate(samples(), false)).backward();
  int64_t unused = 0;
  for (const auto& [name, p] : model.parameters()) {
    const bool past = name.rfind("vision.layers.2.", 0) == 0;
    EXPECT_EQ(model.unused(name), past) << name;
    EXPECT_EQ(p.requires_grad(), !past) << name;
    EXPECT_EQ(p.grad().defined(), !past) << name;
    unused += past ? 1 : 0;
  }
  EXPECT_GT(unused, 0);
  EXPECT_FALSE(model.unused("vision.layers.1.attn.qkv.weight"));
  EXPECT_FALSE(model.unused("llm.layers.2.attn.qkv.weight"));
}

TEST(Multimodal, FrozenModuleGetsNoGradientsOthersDo) {
  torch::manual_seed(25);
  MultimodalModel model(tiny_spec());
  model.set_trainable("vision", false);
  const Inputs in = collate(samples(), false);
  model.loss_sum(in).backward();
  int64_t frozen = 0, trained = 0;
  for (const auto& [name, p] : model.parameters()) {
    if (MultimodalModel::module_of(name) == "vision") {
      EXPECT_FALSE(p.requires_grad()) << name;
      EXPECT_FALSE(p.grad().defined()) << name;
      ++frozen;
    } else {
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat) << name;
      ++trained;
    }
  }
  EXPECT_GT(frozen, 0);
  EXPECT_GT(trained, 0);
  // The projector right after the frozen encoder still learns.
  bool projector_moved = false;
  for (const auto& [name, p] : model.parameters())
    if (name.rfind("vision.projector.", 0) == 0 && p.grad().abs().sum().item<double>() > 0)
      projector_moved = true;
  EXPECT_TRUE(projector_moved);
  EXPECT_THROW(model.set_trainable("visoin", false), Error);
}

TEST(Multimodal, FrozenEncoderAndProjectorRecordNoGraph) {
  torch::manual_seed(26);
  MultimodalModel model(tiny_spec());
  for (const char* m : {"audio", "audio.projector"}) model.set_trainable(m, false);
  const Inputs in = collate(samples(), false);
  model.loss_sum(in).backward();
  for (const auto& [name, p] : model.parameters()) {
    const std::string mod = MultimodalModel::module_of(name);
    if (mod == "audio" || mod == "audio.projector")
      EXPECT_FALSE(p.grad().defined()) << name;
    else
      EXPECT_TRUE(p.grad().defined()) << name;
  }
  // The loss still backprops into the LLM; the embedding rows of placeholder tokens get no
  // gradient (features replaced them), the rows of text tokens do.
  at::Tensor g;
  for (const auto& [name, p] : model.parameters())
    if (name == "llm.embedding") g = p.grad();
  ASSERT_TRUE(g.defined());
  EXPECT_EQ(g[kImage].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(g[kAudio].abs().sum().item<double>(), 0.0);
  EXPECT_GT(g[kBos].abs().sum().item<double>(), 0.0);
  EXPECT_GT(g[5].abs().sum().item<double>(), 0.0);

  // With every module frozen, no autograd graph exists at all: the embeddings, with the audio
  // and image features scattered in, and the loss do not require grad.
  for (const char* m : {"vision", "vision.projector", "llm"}) model.set_trainable(m, false);
  at::Tensor x = model.embed(in);
  EXPECT_FALSE(x.requires_grad());
  EXPECT_FALSE(model.loss_sum(in).requires_grad());
  // Unfreezing only the vision projector brings a graph back.
  model.set_trainable("vision.projector", true);
  EXPECT_TRUE(model.embed(in).requires_grad());
}

TEST(Multimodal, FrozenFlagsInTheSpecApply) {
  ModelSpec spec = tiny_spec();
  spec.encoders[0].frozen = true;
  spec.encoders[1].projector.frozen = true;
  spec.llm.frozen = true;
  torch::manual_seed(27);
  MultimodalModel model(spec);
  for (const auto& [name, p] : model.parameters()) {
    const std::string mod = MultimodalModel::module_of(name);
    const bool trainable = mod == "vision.projector" || mod == "audio";
    EXPECT_EQ(p.requires_grad(), trainable) << name;
  }
}

// Frozen modules held in bf16 (Hosting::frozen_dtype) hold what every use would cast their fp32
// masters to: under bf16 compute the loss and every trained gradient are bit-identical to fp32
// masters'. Norms and MoE routers, read in fp32, stay fp32; such a module cannot train.
TEST(Multimodal, FrozenModulesHeldInBf16ComputeExactlyAsFp32Masters) {
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "MoE LLM" : "dense LLM");
    ModelSpec spec = tiny_spec();
    spec.encoders[0].frozen = true;            // vision frozen, its projector trains
    spec.encoders[1].projector.frozen = true;  // audio trains through its frozen projector
    spec.llm.frozen = true;                    // and through the frozen LLM
    if (moe) spec.llm.moe.experts = 4, spec.llm.moe.shared_ffn = 16;
    const MultimodalModel fp32(spec, 31);
    Hosting held;
    held.frozen_dtype = at::kBFloat16;
    const MultimodalModel bf16(spec, 31, held);
    ASSERT_EQ(fp32.parameters().size(), bf16.parameters().size());
    int64_t halved = 0, kept = 0;
    for (size_t k = 0; k < fp32.parameters().size(); ++k) {
      const auto& [name, a] = fp32.parameters()[k];
      const at::Tensor& b = bf16.parameters()[k].second;
      const std::string mod = MultimodalModel::module_of(name);
      const bool frozen = mod == "vision" || mod == "audio.projector" || mod == "llm";
      const bool read_in_fp32 = name.find("norm") != std::string::npos ||
                                name.find("ln") != std::string::npos ||
                                name.find("router") != std::string::npos;
      EXPECT_EQ(b.requires_grad(), a.requires_grad()) << name;
      if (frozen && !read_in_fp32) {
        EXPECT_EQ(b.scalar_type(), at::kBFloat16) << name;
        EXPECT_TRUE(b.equal(a.detach().to(at::kBFloat16))) << name;
        ++halved;
      } else {
        EXPECT_EQ(b.scalar_type(), at::kFloat) << name;
        EXPECT_TRUE(b.equal(a)) << name;
        kept += frozen ? 1 : 0;
      }
    }
    EXPECT_GT(halved, 10);
    EXPECT_GT(kept, 3);  // norms (and routers)

    const Inputs in = collate(samples(), false);
    const ComputeDtypeGuard compute(at::kBFloat16);
    const at::Tensor la = fp32.loss_sum(in), lb = bf16.loss_sum(in);
    EXPECT_TRUE(la.equal(lb)) << la.item<double>() << " vs " << lb.item<double>();
    la.backward();
    lb.backward();
    int64_t trained = 0;
    for (size_t k = 0; k < fp32.parameters().size(); ++k) {
      const auto& [name, a] = fp32.parameters()[k];
      const at::Tensor& b = bf16.parameters()[k].second;
      ASSERT_EQ(a.grad().defined(), b.grad().defined()) << name;
      if (!a.grad().defined()) continue;
      EXPECT_TRUE(a.grad().equal(b.grad())) << name;
      ++trained;
    }
    EXPECT_GT(trained, 10);  // vision.projector and audio
  }
  ModelSpec spec = tiny_spec();
  spec.llm.frozen = true;
  Hosting held;
  held.frozen_dtype = at::kBFloat16;
  MultimodalModel model(spec, 0, held);
  const std::string err = error_of([&] { model.set_trainable("llm", true); });
  EXPECT_NE(err.find("module 'llm'"), std::string::npos) << err;
  EXPECT_NE(err.find("cannot train"), std::string::npos) << err;
  for (const auto& [name, p] : model.parameters()) {  // nothing of the llm was made trainable
    if (MultimodalModel::module_of(name) == "llm") {
      EXPECT_FALSE(p.requires_grad()) << name;
    }
  }
  model.set_trainable("llm", false);
  model.set_trainable("vision", true);  // held in fp32: trainable
}

TEST(Multimodal, ParameterNamesFollowModules) {
  torch::manual_seed(28);
  MultimodalModel model(tiny_spec());
  std::vector<std::string> order;  // modules in order of first appearance
  std::set<std::string> names;
  for (const auto& [name, p] : model.parameters()) {
    names.insert(name);
    const std::string mod = MultimodalModel::module_of(name);
    EXPECT_EQ(name.rfind(mod + ".", 0), 0u) << name << " → " << mod;
    if (order.empty() || order.back() != mod) order.push_back(mod);
    EXPECT_EQ(p.scalar_type(), torch::kFloat);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"vision", "vision.projector", "audio",
                                             "audio.projector", "llm"}));
  for (const char* n :
       {"llm.embedding", "llm.head", "llm.layers.1.attn.qkv.weight", "llm.layers.0.mlp.down.weight",
        "llm.final_norm.weight", "vision.patch.weight", "vision.position",
        "vision.layers.1.mlp.fc1.weight", "vision.projector.fc1.weight",
        "vision.projector.fc2.bias", "audio.conv1.weight", "audio.final_ln.weight",
        "audio.projector.linear.weight"})
    EXPECT_TRUE(names.count(n)) << n;

  EXPECT_EQ(MultimodalModel::module_of("llm.layers.0.attn.qkv.weight"), "llm");
  EXPECT_EQ(MultimodalModel::module_of("vision.layers.0.attn.qkv.weight"), "vision");
  EXPECT_EQ(MultimodalModel::module_of("vision.projector.fc1.weight"), "vision.projector");
  EXPECT_EQ(MultimodalModel::module_of("audio.projector.linear.bias"), "audio.projector");
  EXPECT_EQ(MultimodalModel::module_of("audio.conv1.weight"), "audio");
}

// A trained embedding held in bf16 (ZeRO-1 under bf16; its .grad an fp32 bucket view): the
// lookup's backward sums each row's gradients in fp32 and rounds the sum once. index_select's own
// backward adds them up in bf16: 300 gradients of 1/3 come to 104 there, to 100.2 in fp32 (100
// in bf16).
TEST(Llm, Bf16TrainedEmbeddingSumsItsRowGradientsInFp32) {
  ParamSet ps;
  const Llm llm = Llm::make(Scope{&ps, "llm"}, testing::tiny_multimodal_spec().llm);
  const at::Tensor& table = llm.embedding;
  {
    torch::NoGradGuard no_grad;
    table.set_data(table.detach().to(at::kBFloat16));
  }
  table.mutable_grad() = torch::zeros(table.sizes());
  ComputeDtypeGuard bf16(at::kBFloat16);
  const at::Tensor e = llm.embed(torch::full({3, 100}, 1, torch::kLong));
  ASSERT_EQ(e.scalar_type(), at::kBFloat16);
  e.backward(torch::full_like(e, 1.0 / 3));
  const double third = at::scalar_tensor(1.0 / 3, at::kBFloat16).item<double>();
  const double sum = at::scalar_tensor(300 * third, at::kFloat).to(at::kBFloat16).item<double>();
  EXPECT_EQ(sum, 100.0);
  EXPECT_EQ(table.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(table.grad()[1], torch::full({table.size(1)}, sum))) << table.grad()[1];
  EXPECT_TRUE(torch::equal(table.grad()[0], torch::zeros({table.size(1)})));
}

// A tied table that the lookup and the head read in one graph (Llm::TiedHeadInGraph): the
// lookup's gradient reaches autograd sparse and is summed into the head's dense one, so the
// table's .grad is dense and that of the dense path (in fp32, up to the order of the sums).
// Without the guard the lookup's gradient stays dense: a lookup alone never leaves a sparse .grad.
TEST(Llm, TiedTableTakesTheLookupGradientIntoTheHeads) {
  ParamSet ps;
  const Llm llm = Llm::make(Scope{&ps, "llm"}, testing::tiny_multimodal_spec().llm);
  ASSERT_FALSE(llm.head.defined());
  const at::Tensor& table = llm.embedding;
  torch::manual_seed(3);
  const at::Tensor tokens = torch::randint(0, 8, {2, 30});  // ids repeat
  const at::Tensor rows = torch::arange(0, 60, 3);
  const at::Tensor targets = torch::randint(0, table.size(0), {rows.size(0)});
  // Whether the graph below `f` has the lookup of our own (the sparse one, for an fp32 table).
  std::function<bool(const torch::autograd::Node*, int)> sparse_below =
      [&](const torch::autograd::Node* f, int depth) {
        if (f == nullptr || depth > 4) return false;
        if (f->name().find("::RowsFn>") != std::string::npos) return true;
        for (const auto& edge : f->next_edges())
          if (sparse_below(edge.function.get(), depth + 1)) return true;
        return false;
      };
  const auto grad_of = [&](bool tied, bool head) {
    table.mutable_grad().reset();
    at::Tensor x;
    {
      std::optional<Llm::TiedHeadInGraph> guard;
      if (tied) guard.emplace();
      x = llm.embed(tokens);
    }
    EXPECT_EQ(sparse_below(x.grad_fn().get(), 0), tied);
    at::Tensor loss = x.pow(2).sum() * 0.01;  // every row looked up gets a gradient
    if (head) {
      const at::Tensor h = x.tanh().reshape({-1, x.size(-1)}).index_select(0, rows);
      loss = loss + llm.loss_sum(h, targets);
    }
    loss.backward();
    EXPECT_FALSE(table.grad().is_sparse());
    return table.grad().clone();
  };
  const at::Tensor dense = grad_of(false, true), tied = grad_of(true, true);
  EXPECT_LT((tied - dense).norm().item<double>(), 1e-6 * dense.norm().item<double>());
  EXPECT_GT(dense.abs().sum().item<double>(), 0.0);
  grad_of(false, false);  // the lookup alone, unguarded: dense
}

// Decoding with the cache (Llm::decode): a prompt whose image block sees itself both ways, then
// tokens one at a time, then three at once under their causal mask, gives what forward() gives
// over the whole sequence at those positions; dense and MoE blocks. Past its capacity the cache
// refuses, naming it.
TEST(Llm, DecodingWithTheCacheEqualsTheWholeSequence) {
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    LlmSpec spec = testing::tiny_multimodal_spec().llm;
    if (moe) {
      spec.moe.experts = 4;
      spec.moe.top_k = 2;
      spec.moe.ffn = 32;
    }
    ParamSet ps;
    const Llm llm = Llm::make(Scope{&ps, "llm"}, spec);
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    const int64_t B = 2, S = 15;
    const at::Tensor tokens = torch::randint(0, spec.vocab, {B, S});
    const at::Tensor positions = torch::arange(S).unsqueeze(0).expand({B, S}).contiguous();
    const at::Tensor doc = torch::zeros({B, S}, torch::kLong);
    at::Tensor item = torch::full({B, S}, -1, torch::kLong);
    item.narrow(1, 1, 4).fill_(0);  // an image at positions 1-4
    const at::Tensor x = llm.embed(tokens);
    const at::Tensor whole = llm.forward(x, positions, {visible_mask(doc, item)});
    KvCache cache;
    cache.capacity = S;
    const auto part = [](const at::Tensor& t, int64_t a, int64_t n) { return t.narrow(1, a, n); };
    std::vector<at::Tensor> got;
    got.push_back(llm.decode(part(x, 0, 8), part(positions, 0, 8),
                             visible_mask(part(doc, 0, 8), part(item, 0, 8)), cache));
    for (int64_t t = 8; t < 12; ++t)
      got.push_back(llm.decode(part(x, t, 1), part(positions, t, 1), at::Tensor(), cache));
    got.push_back(llm.decode(part(x, 12, 3), part(positions, 12, 3),
                             visible_mask(doc, item).narrow(2, 12, 3), cache));
    EXPECT_EQ(cache.length, S);
    const at::Tensor joined = torch::cat(got, 1);
    EXPECT_LT((joined - whole).abs().max().item<double>(), 1e-5)
        << (joined - whole).abs().amax({0, 2});
    const std::string e = testing::error_of(
        [&] { llm.decode(part(x, 0, 1), part(positions, 0, 1), at::Tensor(), cache); });
    EXPECT_NE(e.find("exceed the cache's capacity of 15"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace weft::model
