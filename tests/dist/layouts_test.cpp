// Equivalence is the law: every layout of the Plan — tensor, pipeline and context parallelism,
// encoders on their own ranks, several encoders, frozen encoders — trains exactly like one
// process. Each test runs 3 optimizer steps in fp32 on real Gloo ranks (one thread per rank)
// and compares with the single-process run: losses within 1e-5 relative, every gradient of the
// last step and every final parameter within 1e-4 relative (‖a−b‖/‖b‖), each tensor gathered to
// its full shape.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>

#include "support/ranks.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/dist/runtime.h"
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
  std::map<std::string, at::Tensor> params, grads;  // full tensors (rank 0)
};

RunResult train(const Spec& spec, const Comm& comm, const fs::path& out, bool resume = false) {
  train::TrainerOptions o;
  (resume ? o.resume_dir : o.out_dir) = out.string();
  o.progress = false;
  o.peak_flops = 1e12;
  o.eval = false;
  o.comm = comm;
  train::Trainer t(spec, plan::make_plan(spec, comm.size()), o);
  RunResult r;
  auto gather = [&](bool grads) {
    std::vector<at::Tensor> local;
    for (const auto& [name, p] : t.model().parameters())
      local.push_back(grads ? p.grad() : p.detach());
    std::map<std::string, at::Tensor> full;
    for (auto& [name, v] : t.runtime().gather_full(local)) full[name] = v.clone();
    return full;
  };
  t.after_backward = [&](int64_t step) {
    if (step + 1 == spec.train.steps) r.grads = gather(true);
  };
  t.run();
  r.params = gather(false);
  if (comm.rank() == 0) r.losses = weft::testing::run_losses(out);
  return r;
}

// Vision + audio: the tiny VLM with a small Whisper-style encoder.
const std::string kTinyValm = std::string(weft::testing::kTinyVlm) + R"(
[model.audio]
kind = "whisper"
mels = 16
frames = 16
hidden = 32
layers = 2
heads = 2
ffn = 64
)";

void expect_equivalent(int world, const std::vector<std::string>& sets, const std::string& tag,
                       const std::string& config = weft::testing::kTinyVlm) {
  // vocab: a multiple of every TP size used below (the tokenizer has fewer tokens).
  std::vector<std::string> base = {"train.steps=3", "train.warmup=1", "model.llm.vocab=64"};
  std::vector<std::string> model_sets = base;  // the same model, one process
  for (const auto& s : sets)
    if (s.rfind("parallel.", 0) != 0) model_sets.push_back(s);
  const Spec single = parse_spec(config, "tiny", model_sets);
  base.insert(base.end(), sets.begin(), sets.end());
  const Spec spec = parse_spec(config, "tiny", base);
  const RunResult ref = train(single, Comm(), weft::testing::temp_dir(tag + "_single"));
  std::vector<RunResult> ranks(static_cast<size_t>(world));
  const fs::path out = weft::testing::temp_dir(tag + "_parallel");
  testing::run_ranks(world, [&](const Comm& comm) { ranks[comm.rank()] = train(spec, comm, out); });
  const RunResult& got = ranks[0];

  ASSERT_EQ(ref.losses.size(), 3u);
  ASSERT_EQ(got.losses.size(), 3u);
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i]))
        << tag << " step " << i + 1;
  double worst_param = 0, worst_grad = 0;
  EXPECT_EQ(got.params.size(), ref.params.size()) << tag;
  for (const auto& [name, p] : ref.params) {
    ASSERT_TRUE(got.params.count(name)) << tag << " missing parameter " << name;
    ASSERT_EQ(got.params.at(name).sizes(), p.sizes()) << name;
    const double d = rel_diff(got.params.at(name), p);
    worst_param = std::max(worst_param, d);
    EXPECT_LT(d, 1e-4) << tag << " param " << name;
  }
  ASSERT_FALSE(ref.grads.empty());
  for (const auto& [name, g] : ref.grads) {
    ASSERT_TRUE(got.grads.count(name)) << tag << " missing gradient " << name;
    const double d = rel_diff(got.grads.at(name), g);
    worst_grad = std::max(worst_grad, d);
    EXPECT_LT(d, 1e-4) << tag << " grad " << name;
  }
  std::printf("[%s] %d ranks, max relative difference: params %.2e, grads %.2e\n", tag.c_str(),
              world, worst_param, worst_grad);
}

TEST(Layouts, TensorParallelEverywhere) {
  expect_equivalent(2, {"parallel.llm.tp=2", "parallel.vision.tp=2"}, "tp2");
}

TEST(Layouts, LlmTensorParallelUntiedHead) {
  expect_equivalent(2,
                    {"parallel.llm.tp=2", "parallel.vision.tp=2", "model.llm.tie_embeddings=false"},
                    "tp2_untied");
}

TEST(Layouts, EncoderDp2ToLlmTp2Colocated) {
  expect_equivalent(2, {"parallel.llm.tp=2"}, "vision_dp2_llm_tp2");
}

TEST(Layouts, LlmPipelineParallel) { expect_equivalent(2, {"parallel.llm.pp=2"}, "llm_pp2"); }

// The default split: the planner's balanced assignment of blocks by exact mask work, ranks
// padded to equal token counts.
TEST(Layouts, LlmContextParallelMultimodalMask) {
  expect_equivalent(2, {"parallel.llm.cp=2", "parallel.vision.pp=2"}, "llm_cp2_vision_pp2");
}

TEST(Layouts, LlmContextParallelZigzagAndLpt) {
  expect_equivalent(2, {"parallel.llm.cp=2", "parallel.cp_split=\"zigzag\""}, "llm_cp2_zigzag");
  expect_equivalent(2, {"parallel.llm.cp=2", "parallel.cp_split=\"lpt\""}, "llm_cp2_lpt");
}

TEST(Layouts, EncoderDp2ToLlmCp2Contiguous) {
  expect_equivalent(2, {"parallel.llm.cp=2", "parallel.cp_split=\"contiguous\""},
                    "vision_dp2_llm_cp2");
}

TEST(Layouts, EncoderDp4ToLlmCp2Tp2) {
  expect_equivalent(4, {"parallel.vision.dp=4", "parallel.llm.cp=2", "parallel.llm.tp=2"},
                    "vision_dp4_llm_cp2_tp2");
}

// One encoder rank fans out to two LLM replicas, each split over two CP ranks.
TEST(Layouts, SeparateEncoderFansOutToLlmCp2Dp2) {
  expect_equivalent(5,
                    {"parallel.placement=\"separate\"", "parallel.llm.cp=2", "parallel.llm.dp=2"},
                    "separate_vision_llm_cp2_dp2");
}

// Encoders use context parallelism too: each rank runs half of every item's tokens.
TEST(Layouts, EncoderCp2ToLlmTp2) {
  expect_equivalent(2, {"parallel.vision.cp=2", "parallel.llm.tp=2"}, "vision_cp2_llm_tp2");
}

TEST(Layouts, EncoderCp2Pp2AndAudioCp2ToLlmPp2) {
  expect_equivalent(
      4,
      {"parallel.vision.cp=2", "parallel.vision.pp=2", "parallel.audio.cp=2", "parallel.audio.dp=2",
       "parallel.llm.pp=2", "parallel.llm.dp=2", "model.llm.max_seq=48"},
      "vision_cp2_pp2_audio_cp2_llm_pp2", kTinyValm);
}

// Encoder DP 3 against LLM DP 2: neither divides the other, so encoder ranks take even slices
// of the global microbatch's items, some straddling two LLM replicas.
TEST(Layouts, EncoderDp3Tp2ToLlmDp2Cp3) {
  expect_equivalent(
      6, {"parallel.vision.dp=3", "parallel.vision.tp=2", "parallel.llm.dp=2", "parallel.llm.cp=3"},
      "vision_dp3_tp2_llm_dp2_cp3");
}

TEST(Layouts, LlmTp2Pp2) {
  expect_equivalent(4, {"parallel.llm.tp=2", "parallel.llm.pp=2"}, "llm_tp2_pp2");
}

TEST(Layouts, EncoderOnItsOwnRankToLlmPp2Separate) {
  expect_equivalent(3, {"parallel.placement=\"separate\"", "parallel.llm.pp=2"},
                    "separate_vision_llm_pp2");
}

TEST(Layouts, FrozenEncoderOnItsOwnRankToLlmPp2Separate) {
  expect_equivalent(
      3, {"parallel.placement=\"separate\"", "parallel.llm.pp=2", "model.vision.frozen=true"},
      "separate_frozen_vision_llm_pp2");
}

TEST(Layouts, FrozenEncoderDp2ToLlmTp2Colocated) {
  expect_equivalent(2, {"parallel.llm.tp=2", "model.vision.frozen=true"},
                    "frozen_vision_dp2_llm_tp2");
}

TEST(Layouts, VisionAndAudioOnSeparateRanksToLlmPp2) {
  expect_equivalent(
      4, {"parallel.placement=\"separate\"", "parallel.llm.pp=2", "model.llm.max_seq=48"},
      "separate_vision_audio_llm_pp2", kTinyValm);
}

TEST(Layouts, EncoderTp2AndLlmTp2Pp2OnEightRanks) {
  expect_equivalent(8,
                    {"parallel.vision.tp=2", "parallel.vision.dp=4", "parallel.llm.tp=2",
                     "parallel.llm.pp=2", "parallel.llm.dp=2"},
                    "vision_tp2_dp4_llm_tp2_pp2_dp2");
}

TEST(Layouts, ZeroOneShardsStateWithinEachModulesDataParallelGroup) {
  expect_equivalent(
      4, {"parallel.vision.dp=4", "parallel.llm.tp=2", "parallel.llm.dp=2", "train.zero_stage=1"},
      "zero1_vision_dp4_llm_tp2_dp2");
}

// A checkpoint holds full tensors: a run saved under DP2 resumes under LLM TP2 x vision TP2
// and continues with the losses and parameters of an uninterrupted single-process run.
TEST(Layouts, ResumesUnderAnotherLayout) {
  // Constant learning rate after warm-up, so a 2-step run is the first half of a 4-step one.
  const std::vector<std::string> base = {"train.warmup=1", "train.min_lr=3e-3",
                                         "model.llm.vocab=64"};
  auto spec_with = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), base.begin(), base.end());
    return parse_spec(weft::testing::kTinyVlm, "tiny", sets);
  };
  const RunResult ref =
      train(spec_with({"train.steps=4"}), Comm(), weft::testing::temp_dir("reshard_single"));
  const fs::path out = weft::testing::temp_dir("reshard");
  const Spec first = spec_with({"train.steps=2"});
  testing::run_ranks(2, [&](const Comm& comm) { train(first, comm, out); });
  const Spec second = spec_with({"train.steps=4", "parallel.llm.tp=2", "parallel.vision.tp=2"});
  std::vector<RunResult> ranks(2);
  testing::run_ranks(
      2, [&](const Comm& comm) { ranks[comm.rank()] = train(second, comm, out, /*resume=*/true); });
  const RunResult& got = ranks[0];
  ASSERT_EQ(ref.losses.size(), 4u);
  ASSERT_EQ(got.losses.size(), 4u);  // steps 1-2 kept from the DP2 run, 3-4 under TP2
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i])) << "step " << i + 1;
  for (const auto& [name, p] : ref.params)
    EXPECT_LT(rel_diff(got.params.at(name), p), 1e-4) << name;
}

}  // namespace
}  // namespace weft::dist
