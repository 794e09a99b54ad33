// make_plan (frozen-aware backward flags, layout validation, JSON) and the FLOP model, against
// numbers worked out by hand from REFERENCES.md.
#include "weft/plan/plan.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "weft/core/error.h"
#include "weft/core/spec.h"
#include "weft/plan/flops.h"

namespace weft::plan {
namespace {

Spec two_encoder_spec() {
  Spec s;
  s.source = "test.toml";
  EncoderSpec v;
  v.name = "vision";
  v.kind = EncoderKind::kVit;
  EncoderSpec a;
  a.name = "audio";
  a.kind = EncoderKind::kWhisper;
  s.model.encoders = {v, a};
  s.train.batch = 32;
  s.train.microbatches = 4;
  return s;
}

struct Flags {
  bool frozen, weight_grads, input_grads;
};

void expect_flags(const Plan& p, const std::string& name, Flags f) {
  const ModulePlan& m = p.module(name);
  EXPECT_EQ(m.frozen, f.frozen) << name;
  EXPECT_EQ(m.weight_grads, f.weight_grads) << name;
  EXPECT_EQ(m.input_grads, f.input_grads) << name;
  EXPECT_EQ(m.needs_backward(), f.weight_grads || f.input_grads) << name;
}

TEST(Plan, ModulesInSpecOrderWithUnitLayouts) {
  const Plan p = make_plan(two_encoder_spec());
  std::vector<std::string> names;
  for (const auto& m : p.modules) names.push_back(m.name);
  EXPECT_EQ(names, (std::vector<std::string>{"vision", "vision.projector", "audio",
                                             "audio.projector", "llm"}));
  EXPECT_EQ(p.module("vision").role, ModuleRole::kEncoder);
  EXPECT_EQ(p.module("audio.projector").role, ModuleRole::kProjector);
  EXPECT_EQ(p.module("audio.projector").encoder, 1);
  EXPECT_EQ(p.module("llm").role, ModuleRole::kLlm);
  EXPECT_EQ(p.module("llm").encoder, -1);
  EXPECT_EQ(p.world_size, 1);
  EXPECT_EQ(p.global_batch, 32);
  EXPECT_EQ(p.microbatches, 4);
  for (const auto& m : p.modules) EXPECT_EQ(m.layout.size(), 1) << m.name;
  EXPECT_THROW(p.module("video"), Error);
}

TEST(Plan, AllTrainable) {
  const Plan p = make_plan(two_encoder_spec());
  expect_flags(p, "vision", {false, true, false});  // inputs are data: never input grads
  expect_flags(p, "vision.projector", {false, true, true});
  expect_flags(p, "audio", {false, true, false});
  expect_flags(p, "audio.projector", {false, true, true});
  expect_flags(p, "llm", {false, true, true});
}

TEST(Plan, FrozenEncoderSideNeedsNoBackward) {
  Spec s = two_encoder_spec();
  for (auto& e : s.model.encoders) {
    e.frozen = true;
    e.projector.frozen = true;
  }
  const Plan p = make_plan(s);
  for (const char* m : {"vision", "vision.projector", "audio", "audio.projector"})
    expect_flags(p, m, {true, false, false});
  // Nothing upstream of the LLM trains: no input gradients for it.
  expect_flags(p, "llm", {false, true, false});
}

TEST(Plan, FrozenProjectorAfterTrainableEncoderNeedsInputGradsOnly) {
  Spec s = two_encoder_spec();
  s.model.encoders[0].projector.frozen = true;  // vision trains, its projector does not
  s.model.encoders[1].frozen = true;            // audio frozen, its projector trains
  s.model.llm.frozen = true;
  const Plan p = make_plan(s);
  expect_flags(p, "vision", {false, true, false});
  expect_flags(p, "vision.projector", {true, false, true});
  expect_flags(p, "audio", {true, false, false});
  expect_flags(p, "audio.projector", {false, true, false});
  // A frozen LLM with trainable modules upstream still passes gradients back.
  expect_flags(p, "llm", {true, false, true});
}

TEST(Plan, LlmInputGradsIffSomethingUpstreamTrains) {
  // Only one thing upstream trains, in turn: each alone turns the LLM's input grads on.
  for (int which = 0; which < 4; ++which) {
    Spec s = two_encoder_spec();
    for (auto& e : s.model.encoders) e.frozen = e.projector.frozen = true;
    auto& e = s.model.encoders[which / 2];
    (which % 2 == 0 ? e.frozen : e.projector.frozen) = false;
    EXPECT_TRUE(make_plan(s).module("llm").input_grads) << which;
  }
  Spec text_only;
  EXPECT_FALSE(make_plan(text_only).module("llm").input_grads);
  ASSERT_EQ(make_plan(text_only).modules.size(), 1u);
}

std::string layout_error(const std::string& module, LayoutSpec l) {
  Spec s = two_encoder_spec();
  s.parallel.modules[module] = l;
  try {
    make_plan(s);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no weft::Error thrown)";
}

TEST(Plan, NonUnitLayoutRejectedNamingTheKey) {
  LayoutSpec dp2;
  dp2.dp = 2;
  LayoutSpec tp2;
  tp2.tp = 2;
  LayoutSpec cp4;
  cp4.cp = 4;
  const std::string llm = layout_error("llm", tp2);
  EXPECT_NE(llm.find("parallel.llm"), std::string::npos) << llm;
  EXPECT_NE(llm.find("tp=2"), std::string::npos) << llm;
  EXPECT_NE(llm.find("test.toml"), std::string::npos) << llm;
  const std::string audio = layout_error("audio", cp4);
  EXPECT_NE(audio.find("parallel.audio"), std::string::npos) << audio;
  EXPECT_EQ(audio.find("parallel.audio.projector"), std::string::npos) << audio;
  EXPECT_NE(layout_error("vision", dp2).find("parallel.vision"), std::string::npos);
  // An explicit all-ones layout is fine.
  Spec s = two_encoder_spec();
  s.parallel.modules["llm"] = LayoutSpec{};
  EXPECT_NO_THROW(make_plan(s));
}

TEST(Plan, JsonListsEveryModule) {
  Spec s = two_encoder_spec();
  s.model.encoders[1].frozen = true;
  const auto j = nlohmann::json::parse(to_json(make_plan(s)));
  EXPECT_EQ(j.at("world_size"), 1);
  EXPECT_EQ(j.at("microbatches"), 4);
  EXPECT_EQ(j.at("global_batch"), 32);
  const auto& mods = j.at("modules");
  ASSERT_EQ(mods.size(), 5u);
  EXPECT_EQ(mods[0].at("name"), "vision");
  EXPECT_EQ(mods[1].at("name"), "vision.projector");
  EXPECT_EQ(mods[1].at("role"), "projector");
  EXPECT_EQ(mods[2].at("name"), "audio");
  EXPECT_EQ(mods[2].at("frozen"), true);
  EXPECT_EQ(mods[2].at("weight_grads"), false);
  EXPECT_EQ(mods[2].at("input_grads"), false);
  EXPECT_EQ(mods[3].at("input_grads"), false);  // frozen audio: its projector needs none
  EXPECT_EQ(mods[4].at("name"), "llm");
  EXPECT_EQ(mods[4].at("role"), "llm");
  EXPECT_EQ(mods[4].at("input_grads"), true);
  EXPECT_EQ(mods[4].at("layout").at("tp"), 1);
  EXPECT_EQ(mods[4].at("ranks"), (nlohmann::json{0, 1}));
}

// h = 64, 4 heads (head_dim 16, q = 64), 2 kv heads (kv = 32), F = 128, L = 2, V = 100;
// 10 tokens in documents of 6 and 4 → S2 = 36 + 16 = 52.
LlmSpec small_llm() {
  LlmSpec l;
  l.hidden = 64;
  l.heads = 4;
  l.kv_heads = 2;
  l.ffn = 128;
  l.layers = 2;
  l.vocab = 100;
  return l;
}

TEST(Flops, LlmForwardMatchesReferenceFormula) {
  // REFERENCES.md, training FLOPs: 6·T·[L·(h·(q+2kv) + q·h + f·h·F) + h·V] + 6·q·L·S2
  //   = 6·10·[2·(64·(64+64) + 64·64 + 3·64·128) + 64·100] + 6·64·2·52
  //   = 60·[2·(8192 + 4096 + 24576) + 6400] + 39936
  //   = 60·80128 + 39936 = 4807680 + 39936 = 4847616.
  // Forward is one third of it (2 of the 6): 1615872.
  const double training =
      6.0 * 10 * (2 * (64 * (64 + 64) + 64 * 64 + 3 * 64 * 128) + 64 * 100) + 6.0 * 64 * 2 * 52;
  ASSERT_EQ(training, 4847616.0);
  LlmTokens t;
  t.tokens = 10;
  t.logit_rows = 10;  // the reference puts the head on every token
  t.sum_sq_doc_len = 36 + 16;
  EXPECT_DOUBLE_EQ(llm_forward_flops(small_llm(), t), 1615872.0);
  EXPECT_DOUBLE_EQ(3.0 * llm_forward_flops(small_llm(), t), training);

  // The head runs on loss rows only: 3 rows instead of 10 save 2·7·64·100 = 89600.
  t.logit_rows = 3;
  EXPECT_DOUBLE_EQ(llm_forward_flops(small_llm(), t), 1615872.0 - 89600.0);

  // One document of 10 tokens instead (S2 = 100): attention grows by 2·64·2·48 = 12288.
  t.logit_rows = 10;
  t.sum_sq_doc_len = 100;
  EXPECT_DOUBLE_EQ(llm_forward_flops(small_llm(), t), 1615872.0 + 12288.0);
}

TEST(Flops, TrainingMultiplier) {
  EXPECT_EQ(training_multiplier(true, true), 3.0);
  EXPECT_EQ(training_multiplier(true, false), 3.0);  // a trainable module's inner layers
  EXPECT_EQ(training_multiplier(false, true), 2.0);
  EXPECT_EQ(training_multiplier(false, false), 1.0);
}

TEST(Flops, VitWithoutStemMatchesHandFormula) {
  EncoderSpec e;
  e.kind = EncoderKind::kVit;
  e.image_size = 32;
  e.patch = 8;  // T = (32/8)² = 16 tokens
  e.channels = 3;
  e.hidden = 16;
  e.ffn = 64;
  e.layers = 3;
  e.feature_layer = -2;  // LLaVA-style: 2 of the 3 blocks run
  // Patch embedding, per token C·p²·h MACs: 2·16·3·64·16 = 98304.
  // Per block, per token: qkv 3h² + out h² + MLP 2hF MACs; attention T·h for QKᵀ and for PV
  // (bidirectional, no halving): 2·16·(4·256 + 2·16·64) + 2·2·16·16·16 = 98304 + 16384 = 114688.
  // Total: 98304 + 2·114688 = 327680.
  EXPECT_DOUBLE_EQ(encoder_forward_flops(e), 327680.0);
  e.feature_layer = -1;  // all 3 blocks
  EXPECT_DOUBLE_EQ(encoder_forward_flops(e), 98304.0 + 3 * 114688.0);
}

TEST(Flops, WhisperAndProjectorsMatchHandFormula) {
  EncoderSpec e;
  e.kind = EncoderKind::kWhisper;
  e.mels = 8;
  e.frames = 8;  // T = 4
  e.hidden = 16;
  e.ffn = 32;
  e.layers = 1;
  // conv1 (k3, 8 frames out): 2·8·(8·3)·16 = 6144; conv2 (k3, stride 2, 4 out): 2·4·(16·3)·16
  // = 6144; block: 2·4·(4·256 + 2·16·32) + 4·16·16 = 16384 + 1024 = 17408.
  EXPECT_DOUBLE_EQ(encoder_forward_flops(e), 6144.0 + 6144.0 + 17408.0);

  LlmSpec llm;
  llm.hidden = 32;
  e.projector.kind = ProjectorKind::kLinear;  // 16 → 32 per token: 2·4·16·32 = 4096
  EXPECT_DOUBLE_EQ(projector_forward_flops(e, llm), 4096.0);
  e.projector.kind = ProjectorKind::kMlp;  // 16 → 32 → 32: 2·4·(16·32 + 32·32) = 12288
  EXPECT_DOUBLE_EQ(projector_forward_flops(e, llm), 12288.0);
}

}  // namespace
}  // namespace weft::plan
