// Test support: the equivalence harness of the distributed runtime. A Spec trained for 3 steps
// in fp32 on `world` real Gloo ranks (one thread per rank) is compared with the same model
// trained by one process: losses within 1e-5 relative, every gradient of the last step and
// every final parameter within 1e-4 relative (‖a−b‖/‖b‖), each tensor gathered to full shape.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/ranks.h"
#include "support/tiny_run.h"
#include "weft/core/config.h"
#include "weft/dist/runtime.h"
#include "weft/plan/plan.h"
#include "weft/train/trainer.h"

namespace weft::testing {

inline double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-30);
}

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params, grads;  // full tensors (rank 0)
};

// A test run's options: no progress bar, no peak measurement, no evaluation.
inline train::TrainerOptions run_options(const std::filesystem::path& out, const dist::Comm& comm,
                                         bool resume = false) {
  train::TrainerOptions o;
  (resume ? o.resume_dir : o.out_dir) = out.string();
  o.progress = false;
  o.peak_flops = 1e12;
  o.eval = false;
  o.comm = comm;
  return o;
}

inline RunResult train(const Spec& spec, const dist::Comm& comm, const std::filesystem::path& out,
                       bool resume = false) {
  train::Trainer t(spec, plan::make_plan(spec, comm.size()), run_options(out, comm, resume));
  RunResult r;
  // Under ZeRO-1 a rank's .grad of a sharded parameter is the sum on its own pieces only, and
  // under a bf16 parameter gather its copies of other ranks' pieces are rounded: gradients and
  // parameters are gathered through the runtime, which takes each piece from its rank.
  auto gather = [&](bool grads) {
    std::vector<at::Tensor> local;
    for (const auto& [name, p] : t.runtime().trainable()) local.push_back(p.grad());
    std::map<std::string, at::Tensor> full;
    for (auto& [name, v] :
         grads ? t.runtime().gather_trainable(local) : t.runtime().gather_parameters())
      full[name] = v.clone();
    return full;
  };
  t.after_backward = [&](int64_t step) {
    if (step + 1 == spec.train.steps) r.grads = gather(true);
  };
  t.run();
  r.params = gather(false);
  if (comm.rank() == 0) r.losses = run_losses(out);
  return r;
}

// Vision + audio: the tiny VLM with a small Whisper-style encoder.
inline const std::string kTinyValm = std::string(kTinyVlm) + R"(
[model.audio]
kind = "whisper"
mels = 16
frames = 16
hidden = 32
layers = 2
heads = 2
ffn = 64
)";

// Every step's value of `key` in a run's metrics.jsonl (absent keys give no entry).
inline std::vector<nlohmann::json> run_metric(const std::filesystem::path& run,
                                              const std::string& key) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains(key)) out.push_back(j[key]);
  }
  return out;
}

// `sets` apply to both runs except parallel.* (the layout); `parallel_only` to the parallel run
// only (a setting that must not change the numbers, such as recomputation).
inline void expect_equivalent(int world, const std::vector<std::string>& sets,
                              const std::string& tag, const std::string& config = kTinyVlm,
                              const std::vector<std::string>& parallel_only = {}) {
  // vocab: a multiple of every TP size used below (the tokenizer has fewer tokens).
  std::vector<std::string> base = {"train.steps=3", "train.warmup=1", "model.llm.vocab=64"};
  std::vector<std::string> model_sets = base;  // the same model, one process
  for (const auto& s : sets)
    if (s.rfind("parallel.", 0) != 0) model_sets.push_back(s);
  const Spec single = parse_spec(config, "tiny", model_sets);
  base.insert(base.end(), sets.begin(), sets.end());
  base.insert(base.end(), parallel_only.begin(), parallel_only.end());
  const Spec spec = parse_spec(config, "tiny", base);
  const std::filesystem::path ref_dir = temp_dir(tag + "_single");
  const RunResult ref = train(single, dist::Comm(), ref_dir);
  std::vector<RunResult> ranks(static_cast<size_t>(world));
  const std::filesystem::path out = temp_dir(tag + "_parallel");
  run_ranks(world, [&](const dist::Comm& comm) { ranks[comm.rank()] = train(spec, comm, out); });
  const RunResult& got = ranks[0];

  ASSERT_EQ(ref.losses.size(), 3u);
  ASSERT_EQ(got.losses.size(), 3u);
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i]))
        << tag << " step " << i + 1;
  // An MoE LLM: the auxiliary losses agree, and every expert ran the same tokens.
  for (const char* key : {"moe_balance_loss", "moe_z_loss"}) {
    const auto want = run_metric(ref_dir, key), have = run_metric(out, key);
    ASSERT_EQ(have.size(), want.size()) << tag << " " << key;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(have[i].get<double>(), want[i].get<double>(),
                  1e-5 * std::abs(want[i].get<double>()))
          << tag << " " << key << " step " << i + 1;
  }
  EXPECT_EQ(run_metric(out, "moe_expert_load"), run_metric(ref_dir, "moe_expert_load")) << tag;
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

}  // namespace weft::testing
