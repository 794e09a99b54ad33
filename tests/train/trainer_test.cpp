// Trainer behaviour on a tiny model: freezing, exact resume, divergence errors, checkpoints.
#include "weft/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "support/errors.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/data/dataset.h"
#include "weft/io/checkpoint.h"
#include "weft/model/chunked_attention.h"
#include "weft/model/layers.h"
#include "weft/model/mask.h"
#include "weft/model/torch_compat.h"
#include "weft/plan/plan.h"
#include "weft/train/eval.h"

namespace fs = std::filesystem;

namespace weft::train {
namespace {

using weft::testing::run_losses;
using weft::testing::temp_dir;

Spec tiny_spec(const std::vector<std::string>& sets = {}) {
  return parse_spec(weft::testing::kTinyVlm, "tiny", sets);
}

TrainerOptions quiet_options(const fs::path& out) {
  TrainerOptions o;
  o.out_dir = out.string();
  o.progress = false;
  o.peak_flops = 1e12;  // skip measuring the peak
  o.eval = false;
  return o;
}

std::map<std::string, at::Tensor> snapshot(model::MultimodalModel& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, p] : m.parameters()) out[name] = p.detach().clone();
  return out;
}

// Runs a spec and checks which modules changed: frozen ones must be bit-identical and hold no
// gradient storage; all others must have moved.
void check_frozen(const std::vector<std::string>& sets, const std::vector<std::string>& frozen) {
  Spec spec = tiny_spec(sets);
  Trainer t(spec, plan::make_plan(spec), quiet_options(temp_dir("frozen")));
  auto before = snapshot(t.model());
  t.run();
  for (const auto& [name, p] : t.model().parameters()) {
    const std::string module = model::MultimodalModel::module_of(name);
    const bool is_frozen = std::find(frozen.begin(), frozen.end(), module) != frozen.end();
    EXPECT_FALSE(p.grad().defined()) << name;  // grads are released after every step
    if (is_frozen) {
      EXPECT_FALSE(p.requires_grad()) << name;
      EXPECT_TRUE(torch::equal(p, before[name])) << name << " changed although frozen";
    } else {
      EXPECT_FALSE(torch::equal(p, before[name])) << name << " did not train";
    }
  }
}

TEST(Trainer, FrozenEncoderStaysBitIdentical) {
  check_frozen({"model.vision.frozen=true"}, {"vision"});
}

TEST(Trainer, FrozenEncoderAndProjectorStayBitIdentical) {
  check_frozen({"model.vision.frozen=true", "model.vision.projector.frozen=true"},
               {"vision", "vision.projector"});
}

TEST(Trainer, FrozenLlmStillTrainsTheEncoderThroughIt) {
  check_frozen({"model.llm.frozen=true"}, {"llm"});
}

TEST(Trainer, FrozenModulesGetNoOptimizerState) {
  Spec spec = tiny_spec({"model.vision.frozen=true", "train.steps=1", "train.warmup=0"});
  const fs::path out = temp_dir("frozen_state");
  Trainer(spec, plan::make_plan(spec), quiet_options(out)).run();
  const auto [weights, optimizer, weights_state] =
      io::load_checkpoint(io::latest_checkpoint(out.string()));
  bool projector_state = false;
  EXPECT_FALSE(optimizer.empty());
  for (const auto& [name, t] : optimizer) {
    const std::string param = name.substr(name.find('.') + 1);  // drop exp_avg / exp_avg_sq
    EXPECT_NE(model::MultimodalModel::module_of(param), "vision") << name;
    projector_state = projector_state || param.rfind("vision.projector.", 0) == 0;
  }
  EXPECT_TRUE(projector_state);  // the projector after the frozen encoder still trains
}

// fp32: 20 straight steps == 10 steps, a crash, and a resume for the remaining 10 — bitwise.
TEST(Trainer, ResumeIsBitwiseExact) {
  const std::vector<std::string> sets = {"train.steps=20", "train.checkpoint_every=10"};
  const fs::path straight = temp_dir("straight"), resumed = temp_dir("resumed");
  Spec spec = tiny_spec(sets);
  Trainer a(spec, plan::make_plan(spec), quiet_options(straight));
  a.run();

  {
    Trainer b(spec, plan::make_plan(spec), quiet_options(resumed));
    b.after_backward = [](int64_t step) {
      if (step == 13) throw std::runtime_error("simulated crash");
    };
    EXPECT_THROW(b.run(), std::runtime_error);
  }
  ASSERT_NE(io::latest_checkpoint(resumed.string()), "");
  TrainerOptions o = quiet_options(resumed);
  o.resume_dir = resumed.string();
  Trainer c(load_spec((resumed / "config.toml").string()), plan::make_plan(spec), o);
  c.run();

  for (size_t i = 0; i < a.model().parameters().size(); ++i) {
    const auto& [name, pa] = a.model().parameters()[i];
    EXPECT_TRUE(torch::equal(pa, c.model().parameters()[i].second)) << name;
  }
  const std::vector<double> la = run_losses(straight), lc = run_losses(resumed);
  ASSERT_EQ(la.size(), 20u);
  ASSERT_EQ(lc.size(), 20u);  // metrics after the checkpoint were rewritten, not duplicated
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lc[i]) << "step " << i + 1;
  // summary.json says what the resume read: one process reads every tensor of the checkpoint
  // (moments of parameters it does not train aside) and proves every byte it read.
  std::ifstream in(resumed / "summary.json");
  const nlohmann::json summary = nlohmann::json::parse(in);
  EXPECT_EQ(summary["resumed_from_step"], 10);
  const nlohmann::json& r = summary.at("resume_read");
  EXPECT_NE(r["checkpoint"].get<std::string>().find("step_00000010"), std::string::npos) << r;
  const uint64_t files = r["checkpoint_bytes"].get<uint64_t>();
  EXPECT_GT(r["bytes_read"].get<uint64_t>(), files / 2) << r;
  EXPECT_LT(r["bytes_read"].get<uint64_t>(), files) << r;
  EXPECT_EQ(r["bytes_verified"].get<uint64_t>(), files) << r;
}

TEST(Trainer, NanLossIsAClearError) {
  Spec spec = tiny_spec();
  Trainer t(spec, plan::make_plan(spec), quiet_options(temp_dir("nan")));
  {
    torch::NoGradGuard g;
    t.model().parameters().front().second.fill_(NAN);
  }
  try {
    t.run();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 1: loss is nan"), std::string::npos) << e.what();
  }
}

TEST(Trainer, NonFiniteGradientNamesTheModule) {
  Spec spec = tiny_spec();
  Trainer t(spec, plan::make_plan(spec), quiet_options(temp_dir("nangrad")));
  t.after_backward = [&t](int64_t step) {
    for (const auto& [name, p] : t.model().parameters())
      if (name == "vision.projector.fc1.weight") p.mutable_grad().view(-1)[0] = INFINITY;
  };
  try {
    t.run();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("module 'vision.projector'"), std::string::npos) << what;
  }
}

// train.nonfinite = "skip": a step with a non-finite gradient leaves the parameters and the
// optimizer alone, is counted and marked, and training goes on.
TEST(Trainer, NonFiniteStepIsSkippedWhenAsked) {
  const fs::path out = temp_dir("nanskip");
  Spec spec = tiny_spec({"train.steps=3", "train.nonfinite=\"skip\""});
  Trainer t(spec, plan::make_plan(spec), quiet_options(out));
  std::map<std::string, at::Tensor> before;
  bool unchanged = false;
  t.after_backward = [&](int64_t step) {
    if (step == 1) {  // poison the second step's gradient
      for (const auto& [name, p] : t.model().parameters()) {
        before[name] = p.detach().clone();
        if (name == "llm.layers.0.mlp.down.weight") p.mutable_grad().view(-1)[0] = NAN;
      }
    } else if (step == 2) {  // the skipped update changed nothing
      unchanged = true;
      for (const auto& [name, p] : t.model().parameters())
        unchanged = unchanged && torch::equal(p.detach(), before.at(name));
    }
  };
  const Summary s = t.run();
  EXPECT_TRUE(unchanged);
  EXPECT_EQ(s.steps, 3);
  std::ifstream in(out / "metrics.jsonl");
  std::string line;
  std::vector<bool> skipped;
  while (std::getline(in, line))
    skipped.push_back(line.find("\"skipped\":true") != std::string::npos);
  EXPECT_EQ(skipped, (std::vector<bool>{false, true, false}));
  std::ifstream summary(out / "summary.json");
  const std::string text((std::istreambuf_iterator<char>(summary)), {});
  EXPECT_NE(text.find("\"skipped_steps\": 1"), std::string::npos) << text;
  for (const auto& [name, p] : t.model().parameters())
    EXPECT_TRUE(torch::isfinite(p).all().item<bool>()) << name;
}

// model.llm.attention_chunk: attention by blocks of 8 queries over tiles of the keys they see
// trains as one attention over all keys (fp32; 64-token synthetic sequences with an image each).
// Where LibTorch 1.13's own attention runs, the knob has nothing to do and the runs are the same.
TEST(Trainer, AttentionInQueryBlocksTrainsLikeOneAttention) {
  const std::vector<std::vector<std::string>> variants = {
      {"model.llm.attention_chunk=0"},
      {"model.llm.attention_chunk=8"},
      {"model.llm.attention_chunk=8", "model.llm.recompute=true"}};  // blocks inside recompute
  std::vector<std::vector<double>> losses;
  std::vector<std::map<std::string, at::Tensor>> params;
  for (const std::vector<std::string>& variant : variants) {
    std::vector<std::string> sets = {"data.kind=synthetic",  "model.llm.vocab=64",
                                     "model.llm.max_seq=64", "data.seq_len=64",
                                     "data.images=1",        "train.steps=3",
                                     "train.warmup=0",       "train.precision=\"fp32\""};
    sets.insert(sets.end(), variant.begin(), variant.end());
    Spec spec = tiny_spec(sets);
    const fs::path out = temp_dir("attention_chunk");
    Trainer t(spec, plan::make_plan(spec), quiet_options(out));
    {  // the batches do split into blocks that skip keys
      const StepBatch b = t.prepare_step(0);
      EXPECT_GE(model::attention_chunks(b.inputs[0][0].doc, b.inputs[0][0].item, 8).size(), 2u);
    }
    const int64_t calls = model::chunked_attention_calls();
    t.run();
    // The tiles run where LibTorch has their kernels (2.3 on), and only when asked for.
    const bool chunked = variant[0] != "model.llm.attention_chunk=0" &&
                         model::chunked_attention_has_kernels(c10::Device(at::kCPU), at::kFloat, 8);
    EXPECT_EQ(model::chunked_attention_calls() > calls, chunked) << variant[0];
    losses.push_back(run_losses(out));
    params.push_back(snapshot(t.model()));
  }
  ASSERT_EQ(losses[0].size(), 3u);
  for (size_t v = 1; v < variants.size(); ++v) {
    SCOPED_TRACE("variant " + std::to_string(v));
    for (size_t i = 0; i < 3; ++i)
      EXPECT_NEAR(losses[v][i], losses[0][i], 1e-6 * losses[0][i]) << "step " << i + 1;
    // Relative to the tensor, plus 1e-6 per element: AdamW steps an element whose gradient is
    // near zero by up to lr whatever its size, so an fp32 rounding difference in attention (the
    // tiles sum in another order) shows in a small bias's elements.
    for (const auto& [name, p] : params[0])
      EXPECT_LT((params[v].at(name) - p).norm().item<double>(),
                1e-5 * p.norm().item<double>() + 1e-6 * std::sqrt(static_cast<double>(p.numel())))
          << name;
  }
}

// Casting each parameter once per step (model::CastOnce) trains exactly as casting it at every
// use: bf16, two microbatches, the vision encoder frozen (it runs without grad mode: its casts are
// not kept); again with the LLM recomputed; and with the LLM frozen instead (its casts are kept:
// the gradient passes through it to the projector).
TEST(Trainer, CastOnceTrainsExactlyAsCastingAtEveryUse) {
  const std::vector<std::vector<std::string>> variants = {
      {"model.vision.frozen=true"},
      {"model.vision.frozen=true", "model.llm.recompute=true"},
      {"model.llm.frozen=true"}};
  for (const std::vector<std::string>& variant : variants) {
    SCOPED_TRACE(variant.back());
    std::vector<std::vector<double>> losses;
    std::vector<std::map<std::string, at::Tensor>> params;
    for (const char* once : {"true", "false"}) {
      std::vector<std::string> sets = {"train.steps=3", "train.warmup=0", "train.microbatches=2",
                                       "train.precision=\"bf16\"",
                                       std::string("train.cast_once=") + once};
      sets.insert(sets.end(), variant.begin(), variant.end());
      Spec spec = tiny_spec(sets);
      const fs::path out = temp_dir("cast_once");
      Trainer t(spec, plan::make_plan(spec), quiet_options(out));
      const int64_t shared = model::CastOnce::shared_total();
      t.run();
      EXPECT_EQ(model::CastOnce::shared_total() > shared, std::string(once) == "true") << once;
      losses.push_back(run_losses(out));
      params.push_back(snapshot(t.model()));
    }
    ASSERT_EQ(losses[0].size(), 3u);
    EXPECT_EQ(losses[0], losses[1]);
    for (const auto& [name, p] : params[1]) EXPECT_TRUE(params[0].at(name).equal(p)) << name;
  }
}

// Frozen modules held in bf16 (train.frozen_fp32 = false, the default) train exactly as with
// fp32 masters: bf16, two microbatches, the same losses and trained parameters bit for bit, and
// frozen weights that are the fp32 ones rounded. Checkpoints move between the two: each run's
// last checkpoint resumes under the other setting, and both resumed steps agree.
TEST(Trainer, FrozenModulesHeldInBf16TrainExactlyAsFp32Masters) {
  const std::vector<std::vector<std::string>> variants = {
      {"model.vision.frozen=true"},
      {"model.llm.frozen=true", "model.vision.projector.frozen=true"}};
  for (const std::vector<std::string>& variant : variants) {
    SCOPED_TRACE(variant.back());
    std::vector<std::vector<double>> losses;
    std::vector<std::map<std::string, at::Tensor>> params;
    std::vector<fs::path> runs;
    for (const char* fp32 : {"true", "false"}) {
      std::vector<std::string> sets = {"train.steps=3", "train.warmup=0", "train.microbatches=2",
                                       "train.precision=\"bf16\"",
                                       std::string("train.frozen_fp32=") + fp32};
      sets.insert(sets.end(), variant.begin(), variant.end());
      Spec spec = tiny_spec(sets);
      runs.push_back(temp_dir(std::string("frozen_bf16_") + fp32));
      Trainer t(spec, plan::make_plan(spec), quiet_options(runs.back()));
      t.run();
      losses.push_back(run_losses(runs.back()));
      params.push_back(snapshot(t.model()));
    }
    ASSERT_EQ(losses[0].size(), 3u);
    EXPECT_EQ(losses[0], losses[1]);
    int64_t held = 0;
    for (const auto& [name, p] : params[1]) {
      const at::Tensor& master = params[0].at(name);
      if (p.scalar_type() == at::kBFloat16) {
        EXPECT_TRUE(master.to(at::kBFloat16).equal(p)) << name;
        ++held;
      } else {
        EXPECT_TRUE(master.equal(p)) << name;
      }
    }
    EXPECT_GT(held, 5);
    // The bf16 run's checkpoint holds the frozen weights in bf16.
    const auto [weights, moments, weights_state] =
        io::load_checkpoint(io::latest_checkpoint(runs[1].string()));
    int64_t bf16_saved = 0;
    for (const auto& [name, t] : weights) bf16_saved += t.scalar_type() == at::kBFloat16 ? 1 : 0;
    EXPECT_EQ(bf16_saved, held);
    // Crossed resumes: fp32 masters from the bf16 run's weights, bf16 from the fp32 run's.
    std::vector<double> fourth;
    for (size_t r = 0; r < 2; ++r) {
      std::vector<std::string> sets = {"train.steps=4", "train.warmup=0", "train.microbatches=2",
                                       "train.precision=\"bf16\"",
                                       std::string("train.frozen_fp32=") + (r ? "true" : "false")};
      sets.insert(sets.end(), variant.begin(), variant.end());
      Spec spec = tiny_spec(sets);
      TrainerOptions o = quiet_options(runs[r]);
      o.resume_dir = runs[r].string();
      Trainer(spec, plan::make_plan(spec), o).run();
      const std::vector<double> l = run_losses(runs[r]);
      ASSERT_EQ(l.size(), 4u);
      fourth.push_back(l.back());
    }
    EXPECT_EQ(fourth[0], fourth[1]);
  }
}

// A checkpoint written before encoder blocks past feature_layer stopped training holds AdamW
// moments for them: a resume ignores those (and only those) and continues as from a checkpoint
// without them.
TEST(Trainer, ResumeIgnoresMomentsOfUnusedBlocks) {
  const std::vector<std::string> sets = {"model.vision.feature_layer=-2", "train.warmup=0"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), sets.begin(), sets.end());
    return tiny_spec(more);
  };
  const fs::path base = temp_dir("unused_base");
  {
    Spec spec = with({"train.steps=1"});
    Trainer(spec, plan::make_plan(spec), quiet_options(base)).run();
  }
  const io::Checkpoint ckpt = io::load_checkpoint(io::latest_checkpoint(base.string()));
  const auto& [weights, moments, state] = ckpt;
  // Rewrites the checkpoint as a one-file checkpoint in a run of its own, with `extra` moments.
  auto copy_with = [&](const std::string& name, const model::NamedTensors& extra) {
    const fs::path run = temp_dir(name);
    io::Checkpoint c;
    c.model = weights;
    c.optimizer = moments;
    c.optimizer.insert(c.optimizer.end(), extra.begin(), extra.end());
    c.state_json = ckpt.state_json;
    io::save_checkpoint(run.string(), 1, c, 1);
    return run;
  };
  model::NamedTensors unused;
  for (const auto& [name, t] : weights)
    if (name.rfind("vision.layers.1.", 0) == 0)  // past feature_layer = -2 of 2 blocks
      for (const char* kind : {"exp_avg.", "exp_avg_sq."})
        unused.emplace_back(kind + name, torch::ones_like(t));
  ASSERT_FALSE(unused.empty());
  for (const auto& [name, t] : moments)
    EXPECT_EQ(name.find("vision.layers.1."), std::string::npos) << name;  // not written now

  Spec two = with({"train.steps=2"});
  std::vector<double> second;
  for (const auto& [name, extra] : std::vector<std::pair<std::string, model::NamedTensors>>{
           {"unused_plain", {}}, {"unused_old", unused}}) {
    const fs::path run = copy_with(name, extra);
    TrainerOptions o = quiet_options(run);
    o.resume_dir = run.string();
    Trainer(two, plan::make_plan(two), o).run();
    const std::vector<double> l = run_losses(run);
    ASSERT_EQ(l.size(), 1u) << name;  // the resumed run's own metrics: step 2
    second.push_back(l.back());
  }
  EXPECT_EQ(second[0], second[1]);
  // A moment of a parameter the model does not have is still an error.
  const fs::path bad =
      copy_with("unused_bad", {{"exp_avg.vision.layers.0.bogus", torch::zeros({2})}});
  TrainerOptions o = quiet_options(bad);
  o.resume_dir = bad.string();
  const std::string e = weft::testing::error_of([&] { Trainer t(two, plan::make_plan(two), o); });
  EXPECT_NE(e.find("optimizer tensor 'exp_avg.vision.layers.0.bogus' is not a moment of a "
                   "parameter of the model of this run's config"),
            std::string::npos)
      << e;
}

// Greedy decoding with the KV cache generates exactly what rerunning the whole sequence for
// every token does (fp32), from the tiny VLM's eval prompts (an image, then text), at random
// weights whose continuations differ from prompt to prompt.
TEST(Eval, CachedGreedyDecodingGeneratesWhatTheWholeSequenceDoes) {
  Spec spec = tiny_spec({});
  const std::unique_ptr<data::Dataset> dataset = data::make_dataset(&spec);
  const model::MultimodalModel m(spec.model, 7);
  std::vector<data::Sample> prompts;
  for (data::Sample s : dataset->eval_set()) {
    if (!prompts.empty() && s.prompt_length != prompts[0].prompt_length) continue;
    s.tokens.resize(static_cast<size_t>(s.prompt_length));
    s.is_target.assign(s.tokens.size(), 0);
    prompts.push_back(std::move(s));
  }
  ASSERT_GE(prompts.size(), 2u);
  torch::NoGradGuard no_grad;
  const model::ComputeDtypeGuard fp32(at::kFloat);
  const auto cached = generate_greedy(m, prompts, *dataset, 10, true);
  const auto whole = generate_greedy(m, prompts, *dataset, 10, false);
  EXPECT_EQ(cached, whole);
  std::set<std::vector<int64_t>> distinct(cached.begin(), cached.end());
  EXPECT_GT(distinct.size(), 1u);
  EXPECT_GT(cached[0].size(), 2u);
}

// A checkpoint is checked against the whole model it should hold, before any rank takes its
// shards: each error names the checkpoint, the tensor and what was expected.
TEST(Trainer, CheckpointFitsItsModel) {
  const Spec spec = tiny_spec({});
  const model::MultimodalModel m(spec.model);
  const model::NamedTensors weights = m.parameters();
  model::NamedTensors moments;
  for (const auto& [name, p] : weights)
    if (name.rfind("llm.", 0) == 0) moments.emplace_back("exp_avg." + name, torch::zeros_like(p));
  const auto shapes = [](const model::NamedTensors& tensors) {
    io::NamedShapes out;
    for (const auto& [name, t] : tensors) out.emplace_back(name, t.sizes().vec());
    return out;
  };
  EXPECT_NO_THROW(check_checkpoint_fits(shapes(weights), shapes(moments), spec.model, "ck", "cfg"));
  auto error = [&](const model::NamedTensors& w, const model::NamedTensors& o) {
    return weft::testing::error_of(
        [&] { check_checkpoint_fits(shapes(w), shapes(o), spec.model, "ck", "cfg"); });
  };
  const std::string first = weights[0].first;
  model::NamedTensors fewer(weights.begin() + 1, weights.end());
  EXPECT_NE(error(fewer, moments).find("ck: no tensor '" + first + "', which the model of cfg has"),
            std::string::npos);
  model::NamedTensors more = weights;
  more.emplace_back("llm.layers.9.attn.q.weight", torch::zeros({2, 2}));
  EXPECT_NE(error(more, moments)
                .find("ck: tensor 'llm.layers.9.attn.q.weight' is not part of the model of cfg"),
            std::string::npos);
  model::NamedTensors reshaped = weights;
  reshaped[0].second = torch::zeros({3, 5});
  EXPECT_NE(error(reshaped, moments).find("ck: tensor '" + first + "' has shape [3, 5], but"),
            std::string::npos);
  model::NamedTensors bad_moment = moments;
  bad_moment[0].second = torch::zeros({7});
  EXPECT_NE(error(weights, bad_moment)
                .find("ck: optimizer tensor '" + moments[0].first + "' has shape [7], but"),
            std::string::npos);
  EXPECT_NE(error(weights, {{"momentum." + first, torch::zeros({1})}})
                .find("optimizer tensor 'momentum." + first + "' is not a moment"),
            std::string::npos);
}

TEST(Trainer, WritesRunDirectory) {
  const fs::path out = temp_dir("rundir");
  Spec spec = tiny_spec({"train.steps=3", "train.checkpoint_every=1", "output.keep_checkpoints=2"});
  TrainerOptions o = quiet_options(out);
  o.eval = true;
  Summary s = Trainer(spec, plan::make_plan(spec), o).run();
  EXPECT_EQ(s.steps, 3);
  EXPECT_GE(s.eval_caption_accuracy, 0.0);
  EXPECT_GT(s.eval_loss, 0.0);
  EXPECT_GT(s.tokens_per_second, 0.0);
  for (const char* f : {"config.toml", "plan.json", "metrics.jsonl", "eval.jsonl", "summary.json"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  {  // the evaluation at the end: its step, the summary's figures, what they are over
    std::ifstream in(out / "eval.jsonl");
    std::string text;
    std::vector<nlohmann::json> evals;
    while (std::getline(in, text)) evals.push_back(nlohmann::json::parse(text));
    ASSERT_EQ(evals.size(), 1u);
    EXPECT_EQ(evals[0]["step"], 3);
    EXPECT_EQ(evals[0]["loss"].get<double>(), s.eval_loss);
    EXPECT_EQ(evals[0]["caption_accuracy"].get<double>(), s.eval_caption_accuracy);
    EXPECT_EQ(evals[0]["samples"], spec.data.eval_samples);
    EXPECT_GT(evals[0]["targets"].get<int64_t>(), evals[0]["samples"].get<int64_t>());
    // Its time, of which the captions' (here with the loss: one process holds the model).
    EXPECT_GT(evals[0]["caption_seconds"].get<double>(), 0.0);
    EXPECT_LE(evals[0]["caption_seconds"].get<double>(), evals[0]["seconds"].get<double>());
    EXPECT_LT(evals[0]["seconds"].get<double>(), s.wall_seconds);
  }
  EXPECT_EQ(run_losses(out).size(), 3u);
  {  // each line splits the step's time into its phases
    std::ifstream in(out / "metrics.jsonl");
    std::string text;
    while (std::getline(in, text)) {
      const nlohmann::json line = nlohmann::json::parse(text);
      double parts = 0;
      for (const char* f :
           {"data_seconds", "compute_seconds", "norm_seconds", "optimizer_seconds"}) {
        ASSERT_TRUE(line.contains(f)) << f << " in " << text;
        EXPECT_GT(line[f].get<double>(), 0.0) << f;
        parts += line[f].get<double>();
      }
      EXPECT_LE(parts, line["step_seconds"].get<double>()) << text;
    }
    std::ifstream summary(out / "summary.json");
    const nlohmann::json j = nlohmann::json::parse(summary);
    double parts = 0;
    for (const auto& [part, seconds] : j.at("time_seconds").items()) parts += seconds.get<double>();
    EXPECT_GT(j["time_seconds"].at("compute").get<double>(), 0.0);
    EXPECT_LE(parts, j["train_seconds"].get<double>());
  }
  // keep-last-2: steps 2 and 3 remain.
  EXPECT_FALSE(fs::exists(out / "checkpoints/step_00000001"));
  EXPECT_TRUE(fs::exists(out / "checkpoints/step_00000002/rank-00000.safetensors"));
  EXPECT_EQ(io::latest_checkpoint(out.string()), (out / "checkpoints/step_00000003").string());
  // An interrupted save (a leftover temporary directory) is never taken for a checkpoint.
  fs::create_directories(out / "checkpoints/.tmp-step_00000009");
  fs::create_directories(out / "checkpoints/step_00000010");  // no state.json: incomplete
  EXPECT_EQ(io::latest_checkpoint(out.string()), (out / "checkpoints/step_00000003").string());
}

// Synthetic data (data/synthetic.h) puts the second image after the first target, outside the
// prompt evaluation generates from: the eval prompt must drop it rather than fail to collate.
TEST(Trainer, SyntheticDataTrainsAndEvaluatesWithItemsAfterThePrompt) {
  const fs::path out = temp_dir("synthetic");
  Spec spec = tiny_spec({"data.kind=synthetic", "model.llm.vocab=64", "model.llm.max_seq=48",
                         "data.seq_len=48", "data.images=2", "data.eval_samples=3", "train.steps=2",
                         "train.warmup=0"});
  TrainerOptions o = quiet_options(out);
  o.eval = true;
  Summary s = Trainer(spec, plan::make_plan(spec), o).run();
  EXPECT_EQ(s.steps, 2);
  EXPECT_GE(s.eval_caption_accuracy, 0.0);
  EXPECT_TRUE(std::isfinite(s.loss_last));
}

TEST(Trainer, ResumeRejectsAnotherModel) {
  const fs::path out = temp_dir("othermodel");
  Spec spec = tiny_spec({"train.steps=1", "train.warmup=0"});
  Trainer(spec, plan::make_plan(spec), quiet_options(out)).run();
  Spec other = tiny_spec({"train.steps=2", "model.llm.ffn=48"});
  TrainerOptions o = quiet_options(out);
  o.resume_dir = out.string();
  try {
    Trainer t(other, plan::make_plan(other), o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("llm.layers.0.mlp"), std::string::npos) << e.what();
  }
}

// A damaged rank file of a sharded checkpoint: the resume names the file and the checksum.
TEST(Trainer, ResumeRejectsADamagedRankFile) {
  const fs::path out = temp_dir("damaged");
  Spec spec = tiny_spec({"train.steps=1", "train.warmup=0"});
  Trainer(spec, plan::make_plan(spec), quiet_options(out)).run();
  const fs::path file = fs::path(io::latest_checkpoint(out.string())) / "rank-00000.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(file) / 2));
    f.put('\x5a');
  }
  Spec more = tiny_spec({"train.steps=2", "train.warmup=0"});
  TrainerOptions o = quiet_options(out);
  o.resume_dir = out.string();
  const std::string e = weft::testing::error_of([&] { Trainer t(more, plan::make_plan(more), o); });
  EXPECT_NE(e.find("rank-00000.safetensors: checksum"), std::string::npos) << e;
}

}  // namespace
}  // namespace weft::train
