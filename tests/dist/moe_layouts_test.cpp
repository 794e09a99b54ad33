// Expert parallelism: an MoE LLM under each layout trains exactly like one process — losses,
// the auxiliary losses, per-expert loads, every gradient and parameter (support/equivalence.h).
// A Hugging Face Mixtral checkpoint initialises the LLM under expert and tensor parallelism,
// each rank with only its experts.
#include "support/equivalence.h"
#include "weft/io/files.h"
#include "weft/io/hf.h"
#include "weft/model/multimodal.h"

namespace weft::testing {
namespace {

// Both LLM blocks MoE, 4 experts, top-2, with both auxiliary losses weighted high enough to
// matter in the gradients. AdamW's eps is raised to 1e-6: the auxiliary losses' router
// gradients have elements where large terms cancel, and Adam's first updates (about lr ·
// sign(g)) turn their round-off (step-1 gradients agree within 3e-7 in every layout) into
// parameter differences of ±lr that the 1e-4 bound on 3 steps then sees; it does so for plain DP
// too, with or without expert parallelism.
const std::vector<std::string> kMoe = {"model.llm.moe.experts=4",   "model.llm.moe.top_k=2",
                                       "model.llm.moe.ffn=32",      "model.llm.moe.aux_loss=0.1",
                                       "model.llm.moe.z_loss=0.01", "train.eps=1e-6"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(MoeLayouts, Ep2WithSharedExpertAndEncoderTp2) {
  expect_equivalent(2,
                    with(kMoe, {"model.llm.moe.shared_ffn=16", "parallel.llm.dp=2",
                                "parallel.llm.ep=2", "parallel.vision.tp=2"}),
                    "moe_ep2");
}

TEST(MoeLayouts, EncoderDp2ToMoeLlmEp2ColocatedWithCapacity) {
  expect_equivalent(2,
                    with(kMoe, {"model.llm.moe.capacity_factor=1.0", "parallel.vision.dp=2",
                                "parallel.llm.dp=2", "parallel.llm.ep=2"}),
                    "moe_enc_dp2_ep2");
}

TEST(MoeLayouts, Ep2TimesDp2) {
  expect_equivalent(4, with(kMoe, {"parallel.llm.dp=4", "parallel.llm.ep=2"}), "moe_ep2_dp2");
}

TEST(MoeLayouts, Ep2WithLlmPp2EveryOtherBlock) {
  // Block 0 MoE on the first stage, block 1 dense on the second.
  expect_equivalent(4,
                    with(kMoe, {"model.llm.moe.every=2", "parallel.llm.dp=2", "parallel.llm.pp=2",
                                "parallel.llm.ep=2"}),
                    "moe_ep2_pp2");
}

TEST(MoeLayouts, Ep2OverContextParallelRanksWithCapacityAndSigmoid) {
  // EP over the two CP ranks: each row's tokens (and its capacity decisions) span both.
  expect_equivalent(
      2,
      with(kMoe, {"model.llm.moe.capacity_factor=0.75", "model.llm.moe.gating=\"sigmoid\"",
                  "parallel.llm.cp=2", "parallel.llm.ep=2"}),
      "moe_cp2_ep2");
}

TEST(MoeLayouts, Ep2UnderLlmTp2WithRecompute) {
  expect_equivalent(4, with(kMoe, {"parallel.llm.tp=2", "parallel.llm.dp=2", "parallel.llm.ep=2"}),
                    "moe_tp2_ep2", kTinyVlm, {"model.llm.recompute=true"});
}

TEST(MoeLayouts, WholeExpertsOverTheTp2RanksEp2) {
  // etp = 1: each TP rank routes half of the tokens to whole experts, split over its two ranks.
  expect_equivalent(2,
                    with(kMoe, {"model.llm.moe.capacity_factor=1.0", "parallel.llm.tp=2",
                                "parallel.llm.etp=1", "parallel.llm.ep=2", "parallel.vision.dp=2"}),
                    "moe_tp2_etp1_ep2");
}

TEST(MoeLayouts, WholeExpertsReplicatedOverTp2WithoutEp) {
  // etp = 1, ep = 1: every TP rank holds every expert and routes its half of the tokens, so the
  // experts' gradients are summed over the TP ranks too (their expert-data-parallel group).
  expect_equivalent(2, with(kMoe, {"parallel.llm.tp=2", "parallel.llm.etp=1"}), "moe_tp2_etp1");
}

// Sequence parallelism: an MoE block gathers its half of the sequence whole over TP (router,
// shared expert, token slices of etp = 1) and keeps its half of the output.
TEST(MoeLayouts, SequenceParallelTp2WithSharedExpertEtp2AndEtp1) {
  expect_equivalent(
      2, with(kMoe, {"model.llm.moe.shared_ffn=16", "parallel.llm.tp=2", "parallel.llm.sp=true"}),
      "moe_tp2_sp");
  expect_equivalent(2,
                    with(kMoe, {"model.llm.moe.capacity_factor=1.0", "parallel.llm.tp=2",
                                "parallel.llm.sp=true", "parallel.llm.etp=1", "parallel.llm.ep=2"}),
                    "moe_tp2_sp_etp1_ep2");
}

// Every axis at once under sequence parallelism: CP 2 x TP 2 with SP over a pipeline of two
// stages whose first and last hold the tied embedding's two copies, an MoE block on each stage,
// every block recomputed in backward (its gathers and all-to-alls run again).
TEST(MoeLayouts, SequenceParallelUnderCp2Tp2Pp2TiedRecomputed) {
  expect_equivalent(
      8,
      with(kMoe, {"parallel.llm.tp=2", "parallel.llm.sp=true", "parallel.llm.cp=2",
                  "parallel.llm.pp=2", "parallel.vision.dp=8", "model.llm.tie_embeddings=true"}),
      "moe_cp2_tp2_sp_pp2", kTinyVlm, {"model.llm.recompute=true"});
}

TEST(MoeLayouts, WholeExpertsEp4AcrossTp2Dp2) {
  expect_equivalent(4,
                    with(kMoe, {"parallel.llm.tp=2", "parallel.llm.dp=2", "parallel.llm.etp=1",
                                "parallel.llm.ep=4"}),
                    "moe_tp2_dp2_etp1_ep4");
}

TEST(MoeLayouts, FrozenEncoderAndZeroOneUnderEp2Dp2) {
  expect_equivalent(4,
                    with(kMoe, {"model.vision.frozen=true", "parallel.llm.dp=4",
                                "parallel.llm.ep=2", "train.zero_stage=1"}),
                    "moe_frozen_zero1");
}

TEST(MoeLayouts, MixtralCheckpointInitialisesTp2Ep2Dp2) {
  // Export the tiny VLM's MoE LLM (4 experts, top-2) as Mixtral with random weights, then start
  // a 4-rank run from it: tp = 2, dp = 2, ep = 2 (each rank two of the four experts, each split
  // over its TP pair).
  const std::vector<std::string> moe = {"model.llm.vocab=64", "model.llm.moe.experts=4",
                                        "model.llm.moe.top_k=2"};
  const Spec native = parse_spec(kTinyVlm, "tiny", moe);
  model::MultimodalModel m(native.model, 7);
  std::map<std::string, at::Tensor> full;
  {
    torch::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
    for (const auto& [name, p] : m.parameters()) {
      p.copy_(at::normal(0.0, 0.5, p.sizes(), gen));
      full[name] = p.detach().clone();
    }
  }
  const std::filesystem::path dir = temp_dir("mixtral_tp2_ep2");
  ModelSpec llm_only = native.model;  // the tower (a conv stem) has no Hugging Face layout
  llm_only.encoders.clear();
  io::export_hf(llm_only, full, dir.string());

  const Spec spec = parse_spec(kTinyVlm, "tiny",
                               {"model.llm.hf=\"" + (dir / "llm").string() + "\"",
                                "parallel.llm.tp=2", "parallel.llm.dp=2", "parallel.llm.ep=2"});
  ASSERT_EQ(spec.model.llm.moe.experts, 4);
  std::vector<std::map<std::string, at::Tensor>> gathered(4);
  run_ranks(4, [&](const dist::Comm& comm) {
    train::Trainer t(spec, plan::make_plan(spec, comm.size()), run_options(dir / "run", comm));
    std::vector<at::Tensor> local;
    int64_t experts = 0;
    for (const auto& [name, p] : t.model().parameters()) {
      local.push_back(p.detach());
      experts += name.find(".moe.experts.") != std::string::npos;
    }
    EXPECT_EQ(experts, 2 * 2 * 2) << "rank " << comm.rank();  // layers x local experts x 2
    for (auto& [name, v] : t.runtime().gather_full(local)) gathered[comm.rank()][name] = v.clone();
  });
  int64_t compared = 0;
  for (const auto& [name, t] : full) {
    if (name.rfind("llm.", 0) != 0) continue;  // only the LLM comes from the checkpoint
    ASSERT_TRUE(gathered[0].count(name)) << name;
    EXPECT_TRUE(torch::equal(gathered[0].at(name), t)) << name;
    ++compared;
  }
  EXPECT_EQ(compared, 1 + 2 * (4 + 1 + 2 * 4) + 1);  // embedding, blocks, final norm (tied head)
  weft::io::remove_tree(dir);
}

}  // namespace
}  // namespace weft::testing
