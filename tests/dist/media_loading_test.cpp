// Each rank decodes only the media its encoder stages read: the trainer takes a step's layout
// (text only, the same everywhere), balances it, and loads the items this rank's first encoder
// stage runs. Equivalence of every layout with one process is in layouts_test.cpp; this checks
// how much each rank loaded.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/equivalence.h"
#include "support/ranks.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/data/dataset.h"
#include "weft/plan/plan.h"
#include "weft/train/trainer.h"

namespace weft::dist {
namespace {

// Items loaded by each rank over 2 steps of the tiny VLM (8 samples of one image a step).
std::vector<int64_t> loaded_per_rank(int world, const std::vector<std::string>& sets,
                                     const std::string& tag) {
  std::vector<std::string> all = {"train.steps=2", "train.warmup=1", "model.llm.vocab=64"};
  all.insert(all.end(), sets.begin(), sets.end());
  const Spec spec = parse_spec(testing::kTinyVlm, "tiny", all);
  std::vector<int64_t> loaded(static_cast<size_t>(world), -1);
  const auto out = testing::temp_dir("media_" + tag);
  testing::run_ranks(world, [&](const Comm& comm) {
    train::Trainer t(spec, plan::make_plan(spec, comm.size()), testing::run_options(out, comm));
    t.run();
    loaded[static_cast<size_t>(comm.rank())] = t.dataset().media_loaded();
  });
  return loaded;
}

TEST(MediaLoading, OneProcessLoadsEverything) {
  EXPECT_EQ(loaded_per_rank(1, {}, "single"), (std::vector<int64_t>{16}));
}

TEST(MediaLoading, EncoderDataParallelRanksSplitTheItems) {
  EXPECT_EQ(loaded_per_rank(2, {}, "dp2"), (std::vector<int64_t>{8, 8}));
}

TEST(MediaLoading, EncoderTensorParallelRanksBothReadTheirItems) {
  EXPECT_EQ(loaded_per_rank(2, {"parallel.vision.tp=2", "parallel.llm.tp=2"}, "tp2"),
            (std::vector<int64_t>{16, 16}));
}

TEST(MediaLoading, OnlyTheFirstEncoderStageLoads) {
  EXPECT_EQ(loaded_per_rank(2, {"parallel.vision.pp=2", "parallel.llm.dp=2"}, "pp2"),
            (std::vector<int64_t>{16, 0}));
}

TEST(MediaLoading, LlmRanksOfASeparatePlacementLoadNothing) {
  EXPECT_EQ(loaded_per_rank(3, {"parallel.placement=\"separate\"", "parallel.llm.pp=2"}, "sep"),
            (std::vector<int64_t>{16, 0, 0}));
}

}  // namespace
}  // namespace weft::dist
