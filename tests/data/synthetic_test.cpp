// Tests for the synthetic benchmark dataset (data/synthetic.h).
#include "weft/data/synthetic.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "weft/core/error.h"
#include "weft/core/spec.h"
#include "weft/data/collate.h"
#include "weft/data/dataset.h"

namespace weft::data {
namespace {

// vit 16 tokens per item (64 / 16 squared) + whisper 8 (frames / 2).
Spec av_spec() {
  Spec s;
  s.source = "bench.toml";
  s.data.kind = "synthetic";
  s.data.seq_len = 128;
  s.data.images = 2;
  s.data.eval_samples = 3;
  s.model.llm.vocab = 100;
  s.model.llm.max_seq = 256;
  EncoderSpec v;
  v.name = "vision";
  v.kind = EncoderKind::kVit;
  v.image_size = 64;
  v.patch = 16;
  v.channels = 3;
  EncoderSpec a;
  a.name = "audio";
  a.kind = EncoderKind::kWhisper;
  a.mels = 20;
  a.frames = 16;
  s.model.encoders = {v, a};
  return s;
}

// Success when building the dataset throws a weft::Error containing every needle.
::testing::AssertionResult fails_with(const Spec& spec, const std::vector<std::string>& needles) {
  try {
    SyntheticDataset d(spec);
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& needle : needles)
      if (msg.find(needle) == std::string::npos)
        return ::testing::AssertionFailure() << "message lacks \"" << needle << "\": " << msg;
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "built without error";
}

void expect_same(const Sample& a, const Sample& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.is_target, b.is_target);
  EXPECT_EQ(a.prompt_length, b.prompt_length);
  ASSERT_EQ(a.items.size(), b.items.size());
  for (size_t i = 0; i < a.items.size(); ++i) {
    EXPECT_EQ(a.items[i].encoder, b.items[i].encoder);
    EXPECT_EQ(a.items[i].start, b.items[i].start);
    EXPECT_TRUE(torch::equal(a.items[i].input, b.items[i].input));
  }
}

TEST(Synthetic, SamplesAreAPureFunctionOfSeedStepAndIndex) {
  const Spec spec = av_spec();
  SyntheticDataset d(spec);
  expect_same(d.sample(0, 5, 2), d.sample(0, 5, 2));
  expect_same(d.sample(0, 5, 2), SyntheticDataset(spec).sample(0, 5, 2));
  const auto a = d.train_batch(3, 4), b = d.train_batch(3, 4);
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) expect_same(a[i], b[i]);
  expect_same(a[1], d.sample(SyntheticDataset::kTrainStream, 3, 1));
}

TEST(Synthetic, DifferentStepsIndicesStreamsAndSeedsDiffer) {
  Spec spec = av_spec();
  SyntheticDataset d(spec);
  const Sample s = d.sample(0, 0, 0);
  EXPECT_NE(s.tokens, d.sample(0, 1, 0).tokens);
  EXPECT_NE(s.tokens, d.sample(0, 0, 1).tokens);
  EXPECT_NE(s.tokens, d.sample(1, 0, 0).tokens);
  EXPECT_FALSE(torch::equal(s.items[0].input, d.sample(0, 1, 0).items[0].input));
  EXPECT_FALSE(torch::equal(s.items[0].input, s.items[2].input));  // two images of one sample
  spec.data.seed += 1;
  EXPECT_NE(s.tokens, SyntheticDataset(spec).sample(0, 0, 0).tokens);
  // Eval comes from its own stream.
  const auto eval = d.eval_set();
  ASSERT_EQ(eval.size(), 3u);
  expect_same(eval[2], d.sample(SyntheticDataset::kEvalStream, 0, 2));
  EXPECT_NE(eval[0].tokens, d.train_batch(0, 1)[0].tokens);
}

TEST(Synthetic, LayoutItemsAndTargets) {
  Spec spec = av_spec();
  for (int64_t images : {0, 1, 2, 3}) {
    for (double fraction : {1.0, 0.5, 0.001}) {
      spec.data.images = images;
      spec.data.target_fraction = fraction;
      SyntheticDataset d(spec);
      const Sample s = d.sample(0, 7, 1);
      SCOPED_TRACE("images " + std::to_string(images) + " fraction " + std::to_string(fraction));
      ASSERT_EQ(static_cast<int64_t>(s.tokens.size()), 128);
      ASSERT_EQ(s.is_target.size(), s.tokens.size());
      EXPECT_EQ(s.tokens[0], SyntheticDataset::kBosId);
      EXPECT_EQ(s.is_target[0], 0);

      // Items: `images` per encoder, alternating vision / audio, spans of the encoder's tokens.
      ASSERT_EQ(static_cast<int64_t>(s.items.size()), 2 * images);
      std::vector<int> role(s.tokens.size(), -1);  // encoder of a placeholder, -1 text
      role[0] = -2;                                // <bos>
      int64_t prev_end = 1;
      for (size_t k = 0; k < s.items.size(); ++k) {
        const ModalityItem& it = s.items[k];
        const int e = static_cast<int>(k % 2);
        EXPECT_EQ(it.encoder, e);
        EXPECT_EQ(it.length, spec.model.encoders[e].tokens_per_item());
        EXPECT_GE(it.start, prev_end);  // in order, not overlapping
        prev_end = it.start + it.length;
        const std::vector<int64_t> shape =
            e == 0 ? std::vector<int64_t>{3, 64, 64} : std::vector<int64_t>{20, 16};
        EXPECT_EQ(it.input.sizes().vec(), shape);
        EXPECT_EQ(it.input.scalar_type(), torch::kFloat);
        EXPECT_LE(it.input.max().item<float>(), 1.0f);
        EXPECT_GE(it.input.min().item<float>(), -1.0f);
        for (int64_t t = it.start; t < it.start + it.length; ++t) {
          EXPECT_EQ(s.tokens[t], d.placeholder_id(e)) << t;
          role[t] = e;
        }
      }
      if (images > 0) {
        EXPECT_EQ(s.items[0].start, 1);  // <bos>, then the first item
      }

      // Text runs after each item are as even as possible.
      std::vector<int64_t> runs;
      for (size_t k = 0; k < s.items.size(); ++k) {
        const int64_t next = k + 1 < s.items.size() ? s.items[k + 1].start : 128;
        runs.push_back(next - s.items[k].start - s.items[k].length);
      }
      if (runs.empty()) runs.push_back(127);
      int64_t text = 0, targets = 0;
      for (size_t t = 1; t < s.tokens.size(); ++t) {
        if (role[t] >= 0) {
          EXPECT_EQ(s.is_target[t], 0) << "placeholder target at " << t;
          continue;
        }
        ++text;
        targets += s.is_target[t];
        EXPECT_GE(s.tokens[t], d.first_text_id());
        EXPECT_LT(s.tokens[t], 100);
      }
      EXPECT_EQ(text, d.text_tokens());
      EXPECT_EQ(text, 128 - 1 - images * (16 + 8));
      ASSERT_EQ(static_cast<int64_t>(runs.size()), std::max<int64_t>(1, 2 * images));
      for (int64_t r : runs) {
        EXPECT_GE(r, text / static_cast<int64_t>(runs.size()));
        EXPECT_LE(r, text / static_cast<int64_t>(runs.size()) + 1);
      }

      // The first text token is the prompt; fraction 1: every other text token is a target.
      const int64_t first_text = images > 0 ? 1 + 16 : 1;
      EXPECT_EQ(s.is_target[first_text], 0);
      EXPECT_EQ(s.prompt_length, first_text + 1);
      EXPECT_EQ(s.is_target[first_text + 1], 1);
      if (fraction == 1.0) {
        EXPECT_EQ(targets, text - 1);
      } else if (fraction == 0.001) {
        EXPECT_EQ(targets, static_cast<int64_t>(runs.size()));  // at least one per run
      } else {
        EXPECT_GE(targets, (text - 1) / 2);
        EXPECT_LE(targets, (text - 1) / 2 + static_cast<int64_t>(runs.size()));
      }
    }
  }
}

TEST(Synthetic, DefaultSeqLenIsCappedByMaxSeq) {
  Spec spec = av_spec();
  spec.data.seq_len = 0;
  spec.data.images = 1;
  spec.model.llm.max_seq = 64;
  EXPECT_EQ(SyntheticDataset(spec).seq_len(), 64);
  spec.model.llm.max_seq = 1024;
  EXPECT_EQ(SyntheticDataset(spec).seq_len(), 256);
  // make_dataset writes the length used back into the spec.
  auto d = make_dataset(&spec);
  EXPECT_EQ(spec.data.seq_len, 256);
  EXPECT_EQ(d->vocab_size(), 100);
  EXPECT_EQ(d->pad_id(), 0);
  EXPECT_EQ(d->eos_id(), 2);
}

TEST(Synthetic, DecodeWritesTextIdsAndStopsAtEos) {
  SyntheticDataset d(av_spec());
  EXPECT_EQ(d.first_text_id(), 5);
  EXPECT_EQ(d.decode({1, 3, 4, 17, 5, 99, 2, 42}), "17 5 99");
  EXPECT_EQ(d.decode({}), "");
  const Sample s = d.sample(0, 0, 0);
  std::vector<int64_t> tail(s.tokens.begin() + s.prompt_length, s.tokens.end());
  EXPECT_EQ(s.caption, d.decode(tail));
}

TEST(Synthetic, CollatesIntoAMicrobatch) {
  SyntheticDataset d(av_spec());
  CollateOptions opts;
  opts.num_encoders = 2;
  opts.max_seq = 256;
  const Microbatch mb = collate(d.train_batch(0, 3), opts);
  EXPECT_EQ(mb.tokens.sizes().vec(), (std::vector<int64_t>{3, 128}));
  EXPECT_EQ(mb.encoder_inputs[0].sizes().vec(), (std::vector<int64_t>{6, 3, 64, 64}));
  EXPECT_EQ(mb.encoder_inputs[1].sizes().vec(), (std::vector<int64_t>{6, 20, 16}));
  EXPECT_EQ(mb.targets.numel(), 3 * (128 - 1 - 2 * 24 - 1));
}

TEST(Synthetic, BadSettingsAreErrorsNamingTheKeys) {
  Spec spec = av_spec();
  spec.model.llm.vocab = 0;
  EXPECT_TRUE(fails_with(spec, {"bench.toml", "model.llm.vocab = 0: must be set (> 0)"}));
  spec.model.llm.vocab = 5;  // 0..4 are special
  EXPECT_TRUE(fails_with(spec, {"bench.toml", "model.llm.vocab = 5", "must be > 5"}));

  spec = av_spec();
  spec.data.seq_len = 50;  // 1 + 2 x 24 + 2 = 51
  EXPECT_TRUE(fails_with(spec, {"bench.toml", "data.seq_len = 50", "data.images = 2",
                                "vision 16 + audio 8", "= 48", "must be >= 51"}));
  spec.data.seq_len = 51;
  EXPECT_NO_THROW(SyntheticDataset{spec});

  spec = av_spec();
  spec.data.seq_len = 300;
  EXPECT_TRUE(fails_with(spec, {"bench.toml", "data.seq_len = 300", "model.llm.max_seq = 256"}));
  spec.data.seq_len = -1;
  EXPECT_TRUE(fails_with(spec, {"data.seq_len = -1", "must be >= 0"}));

  spec = av_spec();
  spec.data.images = -1;
  EXPECT_TRUE(fails_with(spec, {"data.images = -1", "must be >= 0"}));
  spec = av_spec();
  spec.data.target_fraction = 0;
  EXPECT_TRUE(fails_with(spec, {"data.target_fraction = 0", "must be in (0, 1]"}));
  spec.data.target_fraction = 1.5;
  EXPECT_TRUE(fails_with(spec, {"data.target_fraction = 1.5", "must be in (0, 1]"}));
}

}  // namespace
}  // namespace weft::data
