// The data shape `weft plan` and `weft simulate` price the FLOP model on is the trainer's own:
// the positions, tokens, targets, documents and items of the microbatches it collates.
#include "weft/train/data_shape.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/plan/plan.h"
#include "weft/train/trainer.h"

namespace weft::train {
namespace {

// The per-sample means over the microbatches the trainer prepares for steps [0, steps).
plan::DataShape collated_shape(const Spec& spec, int64_t steps) {
  TrainerOptions o;
  o.out_dir = weft::testing::temp_dir("data_shape").string();
  o.progress = false;
  o.peak_flops = 1e12;
  o.eval = false;
  Trainer t(spec, plan::make_plan(spec), o);
  const Spec& s = t.spec();
  double positions = 0, tokens = 0, targets = 0, sum_sq = 0, samples = 0, longest_row = 0;
  std::vector<double> items(s.model.encoders.size(), 0);
  for (int64_t step = 0; step < steps; ++step)
    for (const data::Microbatch& mb : t.prepare_step(step).microbatches) {
      positions += static_cast<double>(mb.tokens.numel());
      longest_row = std::max(longest_row, static_cast<double>(mb.tokens.size(1)));
      tokens += static_cast<double>(mb.real_tokens);
      targets += static_cast<double>(mb.targets.numel());
      sum_sq += mb.sum_sq_doc_len;
      samples += static_cast<double>(mb.samples);
      for (size_t e = 0; e < items.size(); ++e)
        if (mb.encoder_rows[e].defined())
          items[e] += static_cast<double>(mb.encoder_rows[e].numel() /
                                          s.model.encoders[e].tokens_per_item());
    }
  plan::DataShape d;
  d.samples = static_cast<int64_t>(samples);
  d.positions = positions / samples;
  d.tokens = tokens / samples;
  d.targets = targets / samples;
  d.sum_sq_doc_len = sum_sq / samples;
  for (double v : items) d.items.push_back(v / samples);
  d.peak_positions = longest_row;  // padded: the longest sample's row
  return d;
}

TEST(DataShape, IsWhatTheTrainerCollates) {
  const std::vector<std::vector<std::string>> variants = {
      {},  // shapes, balanced, 2 microbatches
      {"data.balance=\"in_order\"", "train.microbatches=1"},
      {"data.packing=true"},  // several samples per row
      {"data.kind=\"synthetic\"", "model.llm.vocab=64", "model.llm.max_seq=64", "data.seq_len=48",
       "data.images=2", "data.target_fraction=0.5"}};
  for (const std::vector<std::string>& sets : variants) {
    const Spec spec = parse_spec(weft::testing::kTinyVlm, "tiny", sets);
    SCOPED_TRACE(sets.empty() ? std::string("default") : sets.front());
    const int64_t steps = 3;
    const MeasuredData m = measure_data_shape(spec, steps * spec.train.batch);
    const plan::DataShape want = collated_shape(spec, steps);
    const plan::DataShape& got = m.shape;
    EXPECT_EQ(got.samples, want.samples);
    EXPECT_DOUBLE_EQ(got.positions, want.positions);
    EXPECT_DOUBLE_EQ(got.tokens, want.tokens);
    EXPECT_DOUBLE_EQ(got.targets, want.targets);
    EXPECT_DOUBLE_EQ(got.sum_sq_doc_len, want.sum_sq_doc_len);
    EXPECT_EQ(got.items, want.items);
    // Activation memory's peak: a microbatch padded to the longest sample (packed: max_seq).
    if (spec.data.packing) {
      EXPECT_EQ(got.peak_positions, static_cast<double>(spec.model.llm.max_seq));
    } else {
      EXPECT_EQ(got.peak_positions, want.peak_positions);
    }
    EXPECT_GE(got.peak_targets, got.targets);
    for (size_t e = 0; e < got.items.size(); ++e) EXPECT_GE(got.peak_items[e], got.items[e]);
    EXPECT_GT(m.vocab, 0);
    // Real rows: shorter than max_seq, and padded (or packed) to at least their tokens.
    EXPECT_LT(got.positions, static_cast<double>(spec.model.llm.max_seq));
    EXPECT_GE(got.positions, got.tokens);
    EXPECT_LT(got.targets, got.tokens);
  }
}

// `weft train` and `weft plan` cut pipeline stages on the data's mean sample: on a large
// vocabulary the output head of full rows (a loss on each of max_seq tokens) weighs many blocks,
// of the data's few loss targets a few, and the cut moves; stages the config gives stay.
TEST(DataShape, DefaultPlanCutsOnTheData) {
  const Spec spec = parse_spec(
      weft::testing::kTinyVlm, "tiny",
      {"model.llm.layers=8", "model.llm.vocab=4096", "parallel.llm.pp=2", "train.microbatches=2"});
  const plan::Plan data = default_plan(spec, 2), full = default_plan(spec, 2, nullptr, true);
  const MeasuredData m = measure_data_shape(spec);
  const plan::Plan want = plan::make_plan(spec, 2, nullptr, &m.shape);
  EXPECT_EQ(data.module("llm").stage_boundaries, want.module("llm").stage_boundaries);
  EXPECT_EQ(full.module("llm").stage_boundaries,
            plan::make_plan(spec, 2).module("llm").stage_boundaries);
  EXPECT_LT(data.module("llm").stage_boundaries, full.module("llm").stage_boundaries)
      << "full rows' heavy head leaves the last stage fewer blocks";
  const Spec given = parse_spec(weft::testing::kTinyVlm, "tiny",
                                {"model.llm.layers=8", "model.llm.vocab=4096", "parallel.llm.pp=2",
                                 "parallel.llm.stages=[2]"});
  EXPECT_EQ(default_plan(given, 2).module("llm").stage_boundaries, std::vector<int64_t>{2});
  // Per-stage recomputation counts belong to the run's pipeline, not to the one replica the
  // data is measured on.
  const Spec counts = parse_spec(weft::testing::kTinyVlm, "tiny",
                                 {"model.llm.layers=8", "parallel.llm.pp=2",
                                  "model.llm.recompute=true", "model.llm.recompute_blocks=[2,0]"});
  EXPECT_EQ(default_plan(counts, 2).module("llm").stage_boundaries.size(), 1u);
}

}  // namespace
}  // namespace weft::train
