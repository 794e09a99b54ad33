// Equivalence is the law: every layout of the Plan — tensor, pipeline and context parallelism,
// encoders on their own ranks, several encoders, frozen encoders, recomputation — trains exactly
// like one process. Each test runs 3 optimizer steps in fp32 on real Gloo ranks (one thread per
// rank) and compares with the single-process run: losses within 1e-5 relative, every gradient of
// the last step and every final parameter within 1e-4 relative (‖a−b‖/‖b‖), each tensor gathered
// to its full shape.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "support/equivalence.h"
#include "support/ranks.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/data/dataset.h"
#include "weft/dist/runtime.h"
#include "weft/io/checkpoint.h"
#include "weft/io/safetensors.h"
#include "weft/plan/partition.h"
#include "weft/plan/plan.h"
#include "weft/train/eval.h"
#include "weft/train/inputs.h"
#include "weft/train/trainer.h"

namespace fs = std::filesystem;

namespace weft::dist {
namespace {

using testing::expect_equivalent;
using testing::kTinyValm;
using testing::rel_diff;
using testing::RunResult;
using testing::train;

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

// Interleaved 1F1B: each pipeline rank holds vp chunks; microbatches pass every rank vp times
// (the chunk boundary from the last rank wraps to the first). 4 microbatches over pp = 2: warm-
// up, steady 1F1B and cool-down all run.
TEST(Layouts, LlmInterleavedPipeline) {
  expect_equivalent(
      2, {"parallel.llm.pp=2", "parallel.llm.vp=2", "model.llm.layers=4", "train.microbatches=4"},
      "llm_pp2_vp2");
}

// Microbatch counts that are not a multiple of pp: 5 over pp = 2 run as groups of 3 and 2
// microbatches; 2 over pp = 3 (fewer than pp) as every forward first.
TEST(Layouts, LlmInterleavedPipelineAnyMicrobatchCount) {
  expect_equivalent(2,
                    {"parallel.llm.pp=2", "parallel.llm.vp=2", "model.llm.layers=4",
                     "train.batch=10", "train.microbatches=5"},
                    "llm_pp2_vp2_m5");
  expect_equivalent(
      3, {"parallel.llm.pp=3", "parallel.llm.vp=2", "model.llm.layers=6", "train.microbatches=2"},
      "llm_pp3_vp2_m2");
}

// Chunks of different sizes, as `weft plan --cluster` writes them (explicit boundaries, cut by
// work): 6 blocks as 1, 2, 1 and 2 over pp = 2, so rank 0 holds blocks 0 and 3, rank 1 blocks
// 1-2 and 4-5.
TEST(Layouts, LlmInterleavedPipelineUnevenChunks) {
  expect_equivalent(2,
                    {"parallel.llm.pp=2", "parallel.llm.vp=2", "parallel.llm.stages=[1,3,4]",
                     "model.llm.layers=6", "train.microbatches=4"},
                    "llm_pp2_vp2_uneven");
}

// Data parallelism beside: each chunk's gradient buckets start reducing during its own last
// backward (GradSync::arm per chunk), and every bucket does so here.
TEST(Layouts, LlmInterleavedPipelineDp2OverlapsEachChunksReduction) {
  const std::string tag = "llm_dp2_pp2_vp2";
  expect_equivalent(4,
                    {"parallel.llm.pp=2", "parallel.llm.vp=2", "parallel.llm.dp=2",
                     "model.llm.layers=4", "train.microbatches=2"},
                    tag);
  const auto overlapped =
      testing::run_metric(fs::temp_directory_path() /
                              ("weft_test_" + std::to_string(::getpid()) + "_" + tag + "_parallel"),
                          "grad_buckets_overlapped");
  ASSERT_FALSE(overlapped.empty());
  for (const auto& n : overlapped) EXPECT_GT(n.get<int64_t>(), 0);
}

// Three chunks per rank, an untied head, tensor parallelism beside, the trained encoder's
// gradients coming back over the bridge; microbatches = pp (every forward first).
TEST(Layouts, LlmInterleavedPipelineTp2UntiedThreeChunks) {
  expect_equivalent(
      4,
      {"parallel.llm.pp=2", "parallel.llm.vp=3", "parallel.llm.tp=2", "model.llm.layers=6",
       "model.llm.tie_embeddings=false", "train.microbatches=2"},
      "llm_tp2_pp2_vp3");
}

// The default split: the planner's balanced assignment of blocks by exact mask work, ranks
// padded to equal token counts.
TEST(Layouts, LlmContextParallelMultimodalMask) {
  expect_equivalent(2, {"parallel.llm.cp=2", "parallel.vision.pp=2"}, "llm_cp2_vision_pp2");
  // The run's metrics record the CP balance it achieved (max / mean rank work).
  std::ifstream in(fs::temp_directory_path() / ("weft_test_" + std::to_string(::getpid()) +
                                                "_llm_cp2_vision_pp2_parallel/metrics.jsonl"));
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const size_t at = line.find("\"cp_imbalance\":");
  ASSERT_NE(at, std::string::npos) << line;
  const double imbalance = std::stod(line.substr(at + 15));
  EXPECT_GE(imbalance, 1.0);
  EXPECT_LT(imbalance, 2.0);
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

// Sequence parallelism (Megatron-LM's) under the LLM's TP: norms and residuals on half of the
// sequence (padded to an even length), the norms' gradients summed over TP after backward.
TEST(Layouts, LlmSequenceParallelTp2) {
  expect_equivalent(2, {"parallel.llm.tp=2", "parallel.llm.sp=true", "parallel.vision.tp=2"},
                    "llm_tp2_sp");
}

// With a pipeline (stage messages hold half the sequence), an untied head, DP, and every
// block recomputed in backward (its gathers and reduce-scatters run again).
TEST(Layouts, LlmSequenceParallelTp2Pp2Dp2Recomputed) {
  expect_equivalent(8,
                    {"parallel.llm.tp=2", "parallel.llm.sp=true", "parallel.llm.pp=2",
                     "parallel.llm.dp=2", "parallel.vision.dp=8", "model.llm.tie_embeddings=false"},
                    "llm_tp2_sp_pp2_dp2", testing::kTinyVlm, {"model.llm.recompute=true"});
}

// Under CP each rank's token share is padded to an even count, then split over TP.
TEST(Layouts, LlmSequenceParallelUnderCp2Tp2) {
  expect_equivalent(4, {"parallel.llm.cp=2", "parallel.llm.tp=2", "parallel.llm.sp=true"},
                    "llm_cp2_tp2_sp");
}

// A frozen LLM under TP 4 with sequence parallelism, feeding a trainable encoder's gradients
// back: its column-parallel linears skip the re-gather of their inputs (no weight gradients),
// the sequence is padded to a multiple of 4, and the first stage gathers its tokens' gradient
// for the features. The vision encoder runs TP 2 with SP over two DP replicas, under ZeRO-1.
TEST(Layouts, FrozenLlmSequenceParallelTp4ZeroOne) {
  expect_equivalent(
      4,
      {"model.llm.frozen=true", "model.llm.kv_heads=4", "parallel.llm.tp=4", "parallel.llm.sp=true",
       "parallel.vision.tp=2", "parallel.vision.sp=true", "parallel.vision.dp=2"},
      "frozen_llm_tp4_sp", testing::kTinyVlm, {"train.zero_stage=1"});
}

// Sequence parallelism in the encoders: between the TP regions each TP rank holds its share of
// every item's tokens (after the pre-LN and audio's positions, through the blocks' norms and
// residuals), and the last stage gathers them for the projector. Vision under CP x TP (a
// quarter of the tokens each), audio pipelined (stage messages hold half the tokens).
TEST(Layouts, EncoderSequenceParallelVisionCp2Tp2AudioTp2Pp2) {
  expect_equivalent(
      4,
      {"parallel.vision.cp=2", "parallel.vision.tp=2", "parallel.vision.sp=true",
       "parallel.audio.tp=2", "parallel.audio.pp=2", "parallel.audio.sp=true", "parallel.llm.tp=2",
       "parallel.llm.sp=true", "parallel.llm.dp=2", "model.llm.max_seq=48"},
      "enc_sp_vision_cp2_tp2_audio_tp2_pp2", kTinyValm);
}

// A [CLS] token (3 x 3 patches + 1 = 10 tokens, 5 per TP rank), dropped once the last stage has
// gathered the tokens; every block recomputed in backward.
TEST(Layouts, EncoderSequenceParallelWithClassTokenRecomputed) {
  expect_equivalent(2,
                    {"model.vision.class_token=true", "model.vision.image_size=24",
                     "parallel.vision.tp=2", "parallel.vision.sp=true"},
                    "enc_sp_vision_cls", testing::kTinyVlm, {"model.vision.recompute=true"});
}

// Activation recomputation, against a single process without it: each recomputed block runs
// its TP / CP collectives again in backward, and its parameter gradients reach the
// data-parallel gradient hooks once (vision DP2 here, LLM DP2 below).
TEST(Layouts, RecomputeUnderLlmTp2Pp2AndEncoderCp2Dp2) {
  expect_equivalent(
      4, {"parallel.llm.tp=2", "parallel.llm.pp=2", "parallel.vision.cp=2", "parallel.vision.dp=2"},
      "recompute_llm_tp2_pp2_vision_cp2_dp2", testing::kTinyVlm,
      {"model.llm.recompute=true", "model.vision.recompute=true"});
}

// Recomputing only the first blocks of the LLM's interleaved chunks (2 blocks each), as many per
// pipeline stage: both on stage 0's chunks, the first on stage 1's; and the first block of the
// data-parallel encoder.
TEST(Layouts, RecomputeFirstBlocksOfInterleavedChunks) {
  expect_equivalent(
      2, {"model.llm.layers=8", "parallel.llm.pp=2", "parallel.llm.vp=2", "parallel.vision.dp=2"},
      "recompute_blocks_llm_pp2_vp2", testing::kTinyVlm,
      {"model.llm.recompute=true", "model.llm.recompute_blocks=[2,1]",
       "model.vision.recompute=true", "model.vision.recompute_blocks=1"});
}

TEST(Layouts, RecomputeUnderLlmCp2Dp2AndEncoderTp2) {
  expect_equivalent(
      4, {"parallel.llm.cp=2", "parallel.llm.dp=2", "parallel.vision.tp=2", "parallel.vision.dp=2"},
      "recompute_llm_cp2_dp2_vision_tp2", testing::kTinyVlm,
      {"model.llm.recompute=true", "model.vision.recompute=true"});
}

TEST(Layouts, ZeroOneShardsStateWithinEachModulesDataParallelGroup) {
  expect_equivalent(
      4, {"parallel.vision.dp=4", "parallel.llm.tp=2", "parallel.llm.dp=2", "train.zero_stage=1"},
      "zero1_vision_dp4_llm_tp2_dp2");
}

// ZeRO-1 beside the gradient sums that follow the data-parallel one. The tied embedding's two
// copies (first and last pipeline stage, interleaved) are each sharded alone, so both copies'
// ranks hold the same range and sum just it; sequence parallelism's partial gradients (the
// LLM's norms under TP 2 with SP) are not sharded. The layout with ZeRO-1 against one process.
TEST(Layouts, ZeroOneWithTiedEmbeddingOverInterleavedPipeline) {
  expect_equivalent(4,
                    {"parallel.llm.pp=2", "parallel.llm.vp=2", "parallel.llm.dp=2",
                     "model.llm.layers=4", "parallel.vision.dp=4", "train.zero_stage=1"},
                    "zero1_tied_llm_pp2_vp2_dp2");
}

TEST(Layouts, ZeroOneWithSequenceParallelPartialGradients) {
  expect_equivalent(
      4,
      {"parallel.llm.tp=2", "parallel.llm.sp=true", "parallel.llm.dp=2", "parallel.vision.tp=2",
       "parallel.vision.sp=true", "parallel.vision.dp=2", "train.zero_stage=1"},
      "zero1_llm_tp2_sp_dp2");
}

// Each rank writes its own shards (TP halves here, ZeRO-1 moments as the flat ranges each DP rank
// holds, a tensor TP replicates once); one process reads them whole and continues exactly like
// an uninterrupted run.
// Constant learning rate after warm-up, so a 2-step run is the first half of a 4-step one.
Spec resume_spec(std::vector<std::string> sets) {
  for (const char* s : {"train.warmup=1", "train.min_lr=3e-3", "model.llm.vocab=64"})
    sets.push_back(s);
  return parse_spec(weft::testing::kTinyVlm, "tiny", sets);
}

TEST(Layouts, ShardedCheckpointOfTp2Zero1ResumesInOneProcess) {
  const auto& spec_with = resume_spec;
  const RunResult ref =
      train(spec_with({"train.steps=4"}), Comm(), weft::testing::temp_dir("shards_single"));
  const fs::path out = weft::testing::temp_dir("shards");
  const Spec first = spec_with(
      {"train.steps=2", "parallel.llm.tp=2", "parallel.vision.dp=2", "train.zero_stage=1"});
  testing::run_ranks(2, [&](const Comm& comm) { train(first, comm, out); });
  const fs::path ckpt = io::latest_checkpoint(out.string());
  const io::SafetensorsFile r0 = io::load_safetensors((ckpt / "rank-00000.safetensors").string());
  const io::SafetensorsFile r1 = io::load_safetensors((ckpt / "rank-00001.safetensors").string());
  auto find = [](const io::SafetensorsFile& f, const std::string& name) {
    for (const auto& [n, t] : f.tensors)
      if (n == name) return t;
    return at::Tensor();
  };
  auto has = [&](const io::SafetensorsFile& f, const std::string& name) {
    return find(f, name).defined();
  };
  // Both TP ranks write their half of the LLM; vision (DP2) is written once.
  EXPECT_TRUE(has(r0, "model/llm.layers.0.mlp.down.weight"));
  EXPECT_TRUE(has(r1, "model/llm.layers.0.mlp.down.weight"));
  EXPECT_TRUE(has(r0, "model/vision.patch.weight") != has(r1, "model/vision.patch.weight"));
  // A norm both TP ranks hold whole is written by one of them, weights and moments.
  for (const char* name :
       {"model/llm.final_norm.weight", "optimizer/exp_avg.llm.final_norm.weight"})
    EXPECT_TRUE(has(r0, name) != has(r1, name)) << name;
  // Its moments (ZeRO-1 over the vision DP2) are written by the two ranks as the flat ranges they
  // hold, which tile it.
  int64_t written = 0;
  for (const io::SafetensorsFile* f : {&r0, &r1}) {
    const at::Tensor t = find(*f, "optimizer/exp_avg.vision.patch.weight");
    if (!t.defined()) continue;
    EXPECT_EQ(t.dim(), 1);
    written += t.numel();
  }
  EXPECT_EQ(
      written,
      find(has(r0, "model/vision.patch.weight") ? r0 : r1, "model/vision.patch.weight").numel());
  const RunResult got = train(spec_with({"train.steps=4"}), Comm(), out, /*resume=*/true);
  ASSERT_EQ(got.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i])) << "step " << i + 1;
  for (const auto& [name, p] : ref.params)
    EXPECT_LT(rel_diff(got.params.at(name), p), 1e-4) << name;
}

// A run of 2 steps under `first` (2 ranks), resumed for steps 3-4 under `second` (2 ranks),
// matches an uninterrupted 4-step single-process run: losses and final parameters. `model`
// applies to all three runs.
void expect_resumes(const std::string& tag, const std::vector<std::string>& model,
                    const std::vector<std::string>& first_sets,
                    const std::vector<std::string>& second_sets) {
  const auto spec_with = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), model.begin(), model.end());
    return resume_spec(sets);
  };
  const RunResult ref =
      train(spec_with({"train.steps=4"}), Comm(), weft::testing::temp_dir(tag + "_single"));
  const fs::path out = weft::testing::temp_dir(tag);
  std::vector<std::string> sets = first_sets;
  sets.push_back("train.steps=2");
  const Spec first = spec_with(sets);
  testing::run_ranks(2, [&](const Comm& comm) { train(first, comm, out); });
  sets = second_sets;
  sets.push_back("train.steps=4");
  const Spec second = spec_with(sets);
  std::vector<RunResult> ranks(2);
  testing::run_ranks(
      2, [&](const Comm& comm) { ranks[comm.rank()] = train(second, comm, out, /*resume=*/true); });
  const RunResult& got = ranks[0];
  ASSERT_EQ(ref.losses.size(), 4u) << tag;
  ASSERT_EQ(got.losses.size(), 4u) << tag;  // steps 1-2 kept from the first run, 3-4 resumed
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i]))
        << tag << " step " << i + 1;
  for (const auto& [name, p] : ref.params)
    EXPECT_LT(rel_diff(got.params.at(name), p), 1e-4) << tag << " " << name;
}

// The single-process run of `sets` (with evaluation), then the same weights (its checkpoint,
// resumed with no step left to train) evaluated under `layout` on `ranks` ranks: both summaries.
std::pair<nlohmann::json, nlohmann::json> evaluate_both(const std::string& tag,
                                                        const std::vector<std::string>& sets,
                                                        const std::vector<std::string>& layout,
                                                        int ranks) {
  const fs::path single = weft::testing::temp_dir(tag + "_single");
  const Spec spec = parse_spec(weft::testing::kTinyVlm, "tiny", sets);
  train::TrainerOptions o = testing::run_options(single, Comm());
  o.eval = true;
  train::Trainer(spec, plan::make_plan(spec), o).run();
  const fs::path spread = weft::testing::temp_dir(tag);
  fs::remove_all(spread);
  fs::copy(single, spread, fs::copy_options::recursive);
  std::vector<std::string> all = sets;
  all.insert(all.end(), layout.begin(), layout.end());
  const Spec spread_spec = parse_spec(weft::testing::kTinyVlm, "tiny", all);
  testing::run_ranks(ranks, [&](const Comm& comm) {
    train::TrainerOptions r = testing::run_options(spread, comm, /*resume=*/true);
    r.eval = true;
    train::Trainer(spread_spec, plan::make_plan(spread_spec, ranks), r).run();
  });
  const auto summary = [](const fs::path& run) {
    std::ifstream in(run / "summary.json");
    return nlohmann::json::parse(in);
  };
  return {summary(single), summary(spread)};
}

// Where no rank holds the model whole (here LLM TP2 x vision TP2), rank 0 generates the
// captions on a copy gathered for the evaluation, every module held in the compute dtype. From
// the same weights it generates exactly what the single-process model generates from its fp32
// masters, in bf16 and in fp32. The validation loss is computed in the layout: equal within the
// TP sums' rounding.
TEST(Layouts, GatheredEvaluationCopyGeneratesWhatTheWholeModelDoes) {
  std::map<std::string, double> spread_loss;
  for (const char* precision : {"bf16", "fp32"}) {
    SCOPED_TRACE(precision);
    // A learning rate that leaves the weights near their random start, where greedy decoding
    // gives each sample its own tokens (trained 3 steps, every caption decodes alike).
    const auto [a, b] =
        evaluate_both(std::string("eval_copy_") + precision,
                      {"train.steps=3", "train.warmup=1", "train.lr=1e-6", "train.min_lr=1e-6",
                       "train.precision=\"" + std::string(precision) + "\""},
                      {"parallel.llm.tp=2", "parallel.vision.tp=2"}, 2);
    EXPECT_EQ(b["resumed_from_step"], 3);
    ASSERT_FALSE(a["eval_examples"].empty());
    ASSERT_TRUE(a["eval_loss"].is_number()) << a.dump();
    ASSERT_TRUE(b["eval_loss"].is_number()) << b.dump();
    EXPECT_GT(a["eval_loss"].get<double>(), 0.0);
    const double tol = std::string(precision) == "fp32" ? 1e-5 : 1e-3;
    EXPECT_NEAR(b["eval_loss"].get<double>(), a["eval_loss"].get<double>(),
                tol * a["eval_loss"].get<double>());
    spread_loss[precision] = b["eval_loss"].get<double>();
    // Bit for bit: the accuracy and the captions generated.
    EXPECT_EQ(a["eval_caption_accuracy"], b["eval_caption_accuracy"]);
    EXPECT_EQ(a["eval_examples"], b["eval_examples"]);
  }
  // At this learning rate both runs end on the same weights: the layout's validation loss
  // differs between them only by computing in bf16, as training does, or in fp32.
  EXPECT_NE(spread_loss["bf16"], spread_loss["fp32"]);
}

// The validation loss in the layout (train.eval_captions = false: no copy, nothing gathered)
// equals the single process's, through a pipeline (forwards only), context parallelism with the
// vision encoder pipelined, TP x DP, whose last batch of 17 eval samples (one) is topped up for
// the second replica with a copy that has no targets, and an MoE LLM's experts over EP ranks.
TEST(Layouts, ValidationLossInTheLayoutMatchesOneProcess) {
  struct Case {
    std::vector<std::string> model, layout;
    int ranks;
  };
  const std::vector<Case> cases = {
      {{}, {"parallel.llm.pp=2"}, 2},
      {{}, {"parallel.llm.cp=2", "parallel.vision.pp=2"}, 2},
      {{}, {"parallel.llm.tp=2", "parallel.llm.dp=2", "parallel.vision.dp=4"}, 4},
      {{"model.llm.moe.experts=4", "model.llm.moe.top_k=2", "model.llm.moe.ffn=32"},
       {"parallel.llm.dp=2", "parallel.llm.ep=2", "parallel.vision.dp=2"},
       2}};
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    std::vector<std::string> sets = {"train.steps=2", "train.warmup=1", "data.eval_samples=17",
                                     "train.eval_captions=false"};
    sets.insert(sets.end(), cases[i].model.begin(), cases[i].model.end());
    const auto [a, b] =
        evaluate_both("eval_layout_" + std::to_string(i), sets, cases[i].layout, cases[i].ranks);
    ASSERT_TRUE(a["eval_loss"].is_number()) << a.dump();
    ASSERT_TRUE(b["eval_loss"].is_number()) << b.dump();
    EXPECT_NEAR(b["eval_loss"].get<double>(), a["eval_loss"].get<double>(),
                1e-5 * a["eval_loss"].get<double>());
    EXPECT_TRUE(b["eval_caption_accuracy"].get<double>() < 0) << b.dump();
    EXPECT_TRUE(b["eval_examples"].empty());
    // The loss is over the same targets (not the padding copy's).
    const auto last_eval = [](const std::string& tag) {
      std::ifstream in(fs::temp_directory_path() /
                       ("weft_test_" + std::to_string(::getpid()) + "_" + tag) / "eval.jsonl");
      std::string line, last;
      while (std::getline(in, line)) last = line;
      return nlohmann::json::parse(last);
    };
    const nlohmann::json ea = last_eval("eval_layout_" + std::to_string(i) + "_single");
    const nlohmann::json eb = last_eval("eval_layout_" + std::to_string(i));
    EXPECT_EQ(ea["targets"], eb["targets"]);
    EXPECT_EQ(eb["samples"], 17);
    EXPECT_TRUE(eb["caption_accuracy"].is_null()) << eb.dump();
  }
}

// Layouts for generation in the layout: a pipeline of interleaved stages; the head's vocabulary
// split over TP, tied and untied; CP with the vision encoder pipelined; TP x DP; an MoE LLM's
// experts over EP ranks; TP with sequence parallelism (decoding one token per row runs the
// blocks without it); an MoE LLM under CP whose experts drop choices over capacity (a prefill's
// over each whole row, gathered from the CP ranks; a decoded token's over itself alone); PP x
// TP with the vision encoder on separate ranks (not every rank holds the LLM). The model's
// vocabulary is 24 (the tokenizer's 22 and 2 unused ids), so
// that under TP2 each rank holds ids the tokenizer has (0-11 and 12-21) and the second some it
// does not (22, 23).
struct GenerationCase {
  std::vector<std::string> model, layout;
  int ranks;
};
const std::vector<GenerationCase>& generation_cases() {
  static const std::vector<GenerationCase> cases = [] {
    std::vector<GenerationCase> c = {
        {{"model.llm.layers=4"}, {"parallel.llm.pp=2", "parallel.llm.vp=2"}, 2},
        {{}, {"parallel.llm.tp=2", "parallel.vision.tp=2"}, 2},
        {{"model.llm.tie_embeddings=false"}, {"parallel.llm.tp=2", "parallel.vision.tp=2"}, 2},
        {{}, {"parallel.llm.cp=2", "parallel.vision.pp=2"}, 2},
        {{}, {"parallel.llm.tp=2", "parallel.llm.dp=2", "parallel.vision.dp=4"}, 4},
        {{"model.llm.moe.experts=4", "model.llm.moe.top_k=2", "model.llm.moe.ffn=32"},
         {"parallel.llm.dp=2", "parallel.llm.ep=2", "parallel.vision.dp=2"},
         2},
        {{}, {"parallel.llm.tp=2", "parallel.llm.sp=true"}, 2},
        {{"model.llm.moe.experts=4", "model.llm.moe.top_k=2", "model.llm.moe.ffn=32",
          "model.llm.moe.capacity_factor=1"},
         {"parallel.llm.cp=2"},
         2},
        {{}, {"parallel.placement=\"separate\"", "parallel.llm.pp=2", "parallel.llm.tp=2"}, 5}};
    for (GenerationCase& one : c) one.model.push_back("model.llm.vocab=24");
    return c;
  }();
  return cases;
}

// A generation case's two sides, from the same initial weights: the tiny model with `model` set
// whole on one process (`whole`), and in case c's layout (its spec and plan); and the dataset
// whose eval set both generate from.
struct GenerationSides {
  Spec one, spread;
  plan::Plan spread_plan;
  std::unique_ptr<train::Trainer> whole;
  std::unique_ptr<data::Dataset> dataset;
  GenerationSides(std::vector<std::string> model, const GenerationCase& c, const std::string& tag)
      : one(parse_spec(weft::testing::kTinyVlm, "tiny", model)) {
    model.insert(model.end(), c.layout.begin(), c.layout.end());
    spread = parse_spec(weft::testing::kTinyVlm, "tiny", model);
    spread_plan = plan::make_plan(spread, c.ranks);
    whole = std::make_unique<train::Trainer>(
        one, plan::make_plan(one),
        testing::run_options(weft::testing::temp_dir(tag + "_one"), Comm()));
    Spec data_spec = one;
    dataset = data::make_dataset(&data_spec);
  }
};

// Runtime::eval_next_tokens, one step of generation in the layout: at every position of the eval
// samples (teacher-forced, so that the contexts, and the ids, vary), the greedy id agrees with the
// argmax of the whole model's logits on one process from the same initial weights, in the
// batch's order of targets (replicas, then microbatches).
TEST(Layouts, GreedyIdsInTheLayoutMatchTheWholeModel) {
  for (size_t i = 0; i < generation_cases().size(); ++i) {
    SCOPED_TRACE(i);
    const GenerationCase& c = generation_cases()[i];
    const std::string tag = "greedy_ids_" + std::to_string(i);
    const GenerationSides sides(c.model, c, tag);
    const Spec& spread = sides.spread;
    const plan::Plan& spread_plan = sides.spread_plan;
    train::Trainer& whole = *sides.whole;
    data::Dataset* dataset = sides.dataset.get();
    std::vector<data::Sample> samples = dataset->eval_set();
    const int64_t vocab = dataset->vocab_size();
    ASSERT_EQ(vocab, 22);
    // Every token but the first a target: rows on every CP rank, in every context.
    for (data::Sample& s : samples) s.is_target.assign(s.tokens.size(), 1);
    // 16 samples over the LLM's replicas, two microbatches each, a sample per row.
    data::CollateOptions how;
    how.num_encoders = 1;
    how.pad_id = dataset->pad_id();
    const int64_t replicas = spread_plan.module("llm").layout.dp, n = samples.size();
    std::vector<std::vector<model::Inputs>> batch(replicas);
    for (int64_t d = 0; d < replicas; ++d)
      for (int64_t k = 0; k < 2; ++k) {
        const auto [a, z] = data::part_range(n, 2 * replicas, 2 * d + k);
        batch[d].push_back(train::to_inputs(data::collate(
            std::vector<data::Sample>(samples.begin() + a, samples.begin() + z), how)));
      }
    std::vector<int64_t> want;
    {
      torch::NoGradGuard no_grad;
      const model::MultimodalModel& m = whole.model();
      for (const auto& replica : batch)
        for (const model::Inputs& in : replica) {
          const at::Tensor h = m.hidden(m.embed(in), in);
          const at::Tensor rows = h.reshape({-1, h.size(2)}).index_select(0, in.target_rows);
          const at::Tensor ids = m.llm().logits(rows).narrow(-1, 0, vocab).argmax(-1);
          want.insert(want.end(), ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
        }
    }
    ASSERT_GT(want.size(), 200u);
    const std::set<int64_t> ids(want.begin(), want.end());
    EXPECT_GT(ids.size(), 5u);
    EXPECT_TRUE(*ids.begin() < 12 && *ids.rbegin() >= 12);  // on both TP ranks' halves
    std::vector<std::vector<int64_t>> got(c.ranks);
    testing::run_ranks(c.ranks, [&](const Comm& comm) {
      train::Trainer t(spread, spread_plan,
                       testing::run_options(
                           weft::testing::temp_dir(tag + "_" + std::to_string(comm.rank())), comm));
      got[comm.rank()] = t.runtime().eval_next_tokens(batch, vocab);
    });
    for (int r = 0; r < c.ranks; ++r) EXPECT_EQ(got[r], want) << "rank " << r;
  }
}

// Runtime::eval_prefill and eval_decode, generation with a KV cache in the layout. Prompts of
// different lengths (some run into their caption, so a microbatch's rows are padded to its
// longest and continue from different positions) are prefilled, then each decode appends the
// sample's own next token (teacher-forced: contexts and ids vary, as with a trained model):
// every id equals the argmax of the whole model's logits at that position of the whole sample
// on one process (each position the whole sequence, no cache), and its log-probability that
// model's within 1e-4: at the initial weights greedy ids seldom move when a token is decoded at
// a wrong position or over keys it should not see, its log-probability does. The last row
// has no target. One decode past the room the prefill left is refused on every rank, as are a
// negative id and a prefill whose target is not at its row's last token.
TEST(Layouts, DecodingInTheLayoutMatchesTheWholeModel) {
  for (size_t i = 0; i < generation_cases().size(); ++i) {
    SCOPED_TRACE(i);
    const GenerationCase& c = generation_cases()[i];
    const std::string tag = "decode_" + std::to_string(i);
    // No expert drops tokens: capacity depends on the tokens one forward holds, and a prefill
    // and one-token decodes drop other choices than a forward over the whole sample does.
    // (CaptionsGeneratedInTheLayoutMatchOneProcess compares them with the whole model's own
    // cached decoding, which drops as the layout's does.)
    std::vector<std::string> model_sets = c.model;
    for (std::string& set : model_sets)
      if (set.rfind("model.llm.moe.capacity_factor=", 0) == 0)
        set = "model.llm.moe.capacity_factor=0";
    const GenerationSides sides(model_sets, c, tag);
    const Spec& spread = sides.spread;
    const plan::Plan& spread_plan = sides.spread_plan;
    train::Trainer& whole = *sides.whole;
    data::Dataset* dataset = sides.dataset.get();
    const std::vector<data::Sample> samples = dataset->eval_set();
    const int64_t vocab = dataset->vocab_size(), n = static_cast<int64_t>(samples.size());
    std::vector<data::Sample> prompts;
    int64_t steps = 8;  // ids per sample: the prefill's, then decodes
    for (int64_t k = 0; k < n; ++k) {
      data::Sample s = samples[k];
      s.prompt_length += k % 3;
      steps = std::min<int64_t>(steps, s.tokens.size() - s.prompt_length + 1);
      prompts.push_back(train::prompt_of(s));
    }
    ASSERT_GE(steps, 4);
    // want[k][t]: the whole model's argmax after the first P_k + t tokens of sample k, and its
    // log-probability.
    std::vector<std::vector<int64_t>> want;
    std::vector<std::vector<double>> want_lp;
    {
      torch::NoGradGuard no_grad;
      model::ComputeDtypeGuard dtype(at::kFloat);
      data::CollateOptions how;
      how.num_encoders = 1;
      how.pad_id = dataset->pad_id();
      const model::MultimodalModel& m = whole.model();
      for (int64_t k = 0; k < n; ++k) {
        const model::Inputs in = train::to_inputs(data::collate({samples[k]}, how));
        const at::Tensor h = m.hidden(m.embed(in), in)[0].narrow(
            0, static_cast<int64_t>(prompts[k].tokens.size()) - 1, steps);
        const at::Tensor lp = m.llm().logits(h).narrow(-1, 0, vocab).log_softmax(-1);
        const auto [top, ids] = lp.to(at::kDouble).max(-1);
        want.emplace_back(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + steps);
        want_lp.emplace_back(top.data_ptr<double>(), top.data_ptr<double>() + steps);
      }
    }
    std::set<int64_t> distinct;
    for (const auto& w : want) distinct.insert(w.begin(), w.end());
    EXPECT_GT(distinct.size(), 4u);
    // The prompts over the replicas, two microbatches each, a prompt per row, a target at each
    // row's last token; the last row of all a prompt's copy without one.
    data::CollateOptions how;
    how.num_encoders = 1;
    how.pad_id = dataset->pad_id();
    const int64_t replicas = spread_plan.module("llm").layout.dp;
    std::vector<std::vector<model::Inputs>> batch(replicas);
    for (int64_t d = 0; d < replicas; ++d)
      for (int64_t k = 0; k < 2; ++k) {
        auto [a, z] = data::part_range(n + 1, 2 * replicas, 2 * d + k);
        std::vector<data::Sample> rows(prompts.begin() + a, prompts.begin() + std::min(z, n));
        if (z > n) rows.push_back(prompts[0]);
        model::Inputs in = train::to_inputs(data::collate(rows, how));
        const int64_t S = in.tokens.size(1), own = std::min(z, n) - a;
        const at::Tensor last = (in.doc >= 0).sum(1).to(at::kLong).narrow(0, 0, own) - 1;
        in.target_rows = torch::arange(own, torch::kLong) * S + last;
        in.targets = torch::zeros({own}, torch::kLong);
        batch[d].push_back(std::move(in));
      }
    std::vector<std::vector<std::vector<int64_t>>> got(c.ranks);  // [rank][step][sample]
    std::vector<std::vector<std::vector<double>>> got_lp(c.ranks);
    std::vector<std::string> refused(c.ranks);
    testing::run_ranks(c.ranks, [&](const Comm& comm) {
      train::Trainer t(spread, spread_plan,
                       testing::run_options(
                           weft::testing::temp_dir(tag + "_" + std::to_string(comm.rank())), comm));
      model::ComputeDtypeGuard dtype(at::kFloat);
      dist::Runtime& rt = t.runtime();
      std::vector<std::vector<int64_t>>& out = got[comm.rank()];
      std::vector<std::vector<double>>& out_lp = got_lp[comm.rank()];
      out_lp.emplace_back();
      out.push_back(rt.eval_prefill(batch, vocab, steps - 1, &out_lp.back()));
      std::vector<int64_t> next(n);
      while (static_cast<int64_t>(out.size()) < steps) {
        for (int64_t k = 0; k < n; ++k)  // each sample's own next token
          next[k] = samples[k].tokens.at(prompts[k].tokens.size() + out.size() - 1);
        out_lp.emplace_back();
        out.push_back(rt.eval_decode(next, &out_lp.back()));
      }
      try {
        rt.eval_decode(next);
      } catch (const std::exception& e) {
        refused[comm.rank()] = e.what();
      }
      try {
        std::vector<int64_t> bad = next;
        bad[0] = -1;
        rt.eval_prefill(batch, vocab, 1);
        rt.eval_decode(bad);
        refused[comm.rank()] += " | bad id accepted";
      } catch (const std::exception& e) {
        refused[comm.rank()] += std::string(" | ") + e.what();
      }
      std::vector<std::vector<model::Inputs>> wrong = batch;
      wrong[0][0].target_rows = wrong[0][0].target_rows - 1;
      try {
        rt.eval_prefill(wrong, vocab, 1);
        refused[comm.rank()] += " | prefill accepted";
      } catch (const std::exception& e) {
        refused[comm.rank()] += std::string(" | ") + e.what();
      }
    });
    for (int r = 0; r < c.ranks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_EQ(got[r].size(), static_cast<size_t>(steps));
      for (int64_t k = 0; k < n; ++k) {
        std::vector<int64_t> ids;
        for (int64_t t = 0; t < steps; ++t) {
          ASSERT_EQ(got[r][t].size(), static_cast<size_t>(n));
          ASSERT_EQ(got_lp[r][t].size(), static_cast<size_t>(n));
          ids.push_back(got[r][t][k]);
          EXPECT_NEAR(got_lp[r][t][k], want_lp[k][t], 2e-6) << "sample " << k << ", id " << t;
        }
        EXPECT_EQ(ids, want[k]) << "sample " << k;
      }
      const std::string room = "room for " + std::to_string(steps - 1) + " new positions";
      EXPECT_NE(refused[r].find(room), std::string::npos) << refused[r];
      EXPECT_NE(refused[r].find("at the last token of its document"), std::string::npos)
          << refused[r];
      EXPECT_NE(refused[r].find("id -1 of target 0"), std::string::npos) << refused[r];
    }
  }
}

// The trainer's generation in the layout (train.eval_generation = "layout": nothing gathered,
// each token a forward pass through the layout) gives every sample the single process's caption
// and accuracy; under TP x DP its 5 eval samples, in batches of 4, leave a last batch topped up
// with a copy that has no target.
TEST(Layouts, CaptionsGeneratedInTheLayoutMatchOneProcess) {
  const auto captions = [](const std::string& tag) {
    std::ifstream in(fs::temp_directory_path() /
                     ("weft_test_" + std::to_string(::getpid()) + "_" + tag) / "captions.jsonl");
    std::vector<nlohmann::json> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
    return lines;
  };
  for (size_t i = 0; i < generation_cases().size(); ++i) {
    SCOPED_TRACE(i);
    const GenerationCase& c = generation_cases()[i];
    // A learning rate that leaves the weights near their random start, where greedy decoding
    // gives samples tokens of their own.
    std::vector<std::string> sets = {"train.steps=2",
                                     "train.warmup=1",
                                     "train.lr=1e-6",
                                     "train.min_lr=1e-6",
                                     "data.eval_samples=5",
                                     "train.batch=4",
                                     "train.eval_generation=\"layout\""};
    sets.insert(sets.end(), c.model.begin(), c.model.end());
    const std::string tag = "gen_layout_" + std::to_string(i);
    const auto [a, b] = evaluate_both(tag, sets, c.layout, c.ranks);
    EXPECT_EQ(b["resumed_from_step"], 2);
    EXPECT_EQ(a["eval_caption_accuracy"], b["eval_caption_accuracy"]);
    EXPECT_EQ(a["eval_examples"], b["eval_examples"]);
    const std::vector<nlohmann::json> ca = captions(tag + "_single"), cb = captions(tag);
    ASSERT_EQ(ca.size(), 5u);
    ASSERT_EQ(cb.size(), 5u);
    for (size_t k = 0; k < ca.size(); ++k) {
      EXPECT_EQ(cb[k]["generated"], ca[k]["generated"]) << "sample " << k;
      EXPECT_EQ(cb[k]["reference"], ca[k]["reference"]) << "sample " << k;
    }
  }
}

// A checkpoint holds full tensors: a run saved under DP2 resumes under LLM TP2 x vision TP2
// and continues with the losses and parameters of an uninterrupted single-process run.
TEST(Layouts, ResumesUnderAnotherLayout) {
  expect_resumes("reshard", {}, {}, {"parallel.llm.tp=2", "parallel.vision.tp=2"});
}

// A checkpoint written by interleaved pipeline ranks (two chunks of blocks each, the tied
// embedding's copy on the last) resumes under tensor parallelism like an uninterrupted
// single-process run.
TEST(Layouts, InterleavedCheckpointResumesUnderAnotherLayout) {
  expect_resumes("vp_reshard", {"model.llm.layers=4"}, {"parallel.llm.pp=2", "parallel.llm.vp=2"},
                 {"parallel.llm.tp=2", "parallel.vision.tp=2"});
}

// ZeRO-1 on both sides: moments written from DP2's shards (each parameter's range split over the
// two ranks), read back into other shards (vision DP2 beside LLM TP2).
TEST(Layouts, ZeroOneCheckpointResumesIntoOtherShards) {
  expect_resumes("zero1_reshard", {"train.zero_stage=1"}, {},
                 {"parallel.llm.tp=2", "parallel.vision.dp=2"});
}

// A bf16 ZeRO-1 run holds its sharded parameters in bf16 and their exact values only in each
// rank's optimizer masters: the checkpoint saves the masters, and a resume sets them (and the
// bf16 parameters from them), so 2 steps resumed for 2 more continue bit for bit as an
// uninterrupted 4-step run. (A checkpoint of the rounded parameters, or masters left at their
// initial values, would part from it at step 3.)
TEST(Layouts, Bf16ZeroOneCheckpointResumesBitForBit) {
  const auto spec_with = [](std::vector<std::string> sets) {
    sets.push_back("train.precision=\"bf16\"");
    sets.push_back("train.zero_stage=1");
    return resume_spec(sets);
  };
  const auto run = [&](const std::string& steps, const fs::path& out, bool resume) {
    std::vector<RunResult> ranks(2);
    const Spec spec = spec_with({"train.steps=" + steps});
    testing::run_ranks(
        2, [&](const Comm& comm) { ranks[comm.rank()] = train(spec, comm, out, resume); });
    return ranks[0];
  };
  const RunResult ref = run("4", weft::testing::temp_dir("bf16_zero1_whole"), false);
  const fs::path out = weft::testing::temp_dir("bf16_zero1_resumed");
  run("2", out, false);
  const RunResult got = run("4", out, true);
  ASSERT_EQ(ref.losses.size(), 4u);
  ASSERT_EQ(got.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(got.losses[i], ref.losses[i]) << "step " << i + 1;
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (const auto& [name, p] : ref.params) {
    EXPECT_EQ(p.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(torch::equal(got.params.at(name), p)) << name;
  }
}

// Under sequence parallelism the runtime sums the gradients of the parameters every TP rank
// holds whole but applies to its part of the sequence (model::Split::partial_grad) over TP at
// the end of the step; the simulator charges that all-reduce on the plan's count of them
// (plan::LayerCost::partial_grad_params). The two counts agree, module by module: a ViT with and
// without its pre-LayerNorm, a Whisper encoder (its final LayerNorm), the LLM, a frozen encoder.
TEST(Layouts, SequenceParallelPartialGradientsAreThePlansCount) {
  const std::vector<std::vector<std::string>> cases = {
      {"parallel.vision.tp=2", "parallel.vision.sp=true", "parallel.audio.tp=2",
       "parallel.audio.sp=true", "parallel.llm.tp=2", "parallel.llm.sp=true"},
      {"parallel.vision.tp=2", "parallel.vision.sp=true", "model.vision.pre_norm=false",
       "model.audio.frozen=true", "parallel.audio.tp=2", "parallel.audio.sp=true",
       "parallel.llm.tp=2", "parallel.llm.sp=true"},
  };
  for (const auto& sets : cases) {
    std::vector<std::string> all = {"model.llm.vocab=64"};
    all.insert(all.end(), sets.begin(), sets.end());
    const Spec spec = parse_spec(kTinyValm, "tiny", all);
    const plan::Plan p = plan::make_plan(spec, 2);
    std::map<std::string, double> want;
    for (const plan::ModulePlan& m : p.modules) {
      if (m.role == plan::ModuleRole::kProjector) continue;
      const plan::ModuleCosts c = plan::sample_costs(spec, m);
      double n = c.front.partial_grad_params + c.back.partial_grad_params;
      for (const plan::LayerCost& b : c.blocks) n += b.partial_grad_params;
      want[m.name] = n;
    }
    EXPECT_GT(want.at("vision"), 0);
    EXPECT_GT(want.at("llm"), 0);
    testing::run_ranks(2, [&](const Comm& comm) {
      Runtime rt(spec.model, 0, p, comm);
      const model::ParamSet& ps = rt.model().param_set();
      std::map<std::string, double> got;
      for (const auto& [name, _] : want) got[name] = 0;
      for (size_t k = 0; k < ps.all().size(); ++k) {
        const auto& [name, t] = ps.all()[k];
        if (ps.split(k).partial_grad && t.requires_grad())
          got[model::MultimodalModel::module_of(name)] += static_cast<double>(t.numel());
      }
      EXPECT_EQ(got, want) << sets[2];
    });
  }
}

}  // namespace
}  // namespace weft::dist
