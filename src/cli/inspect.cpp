#include "cli/inspect.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/validators.h"
#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/data/shapes.h"
#include "weft/data/tokenizer.h"
#include "weft/plan/balance.h"
#include "weft/plan/cp_split.h"
#include "weft/plan/workload.h"
#include "weft/train/inputs.h"

namespace weft::cli {

namespace {

struct CpSplitArgs {
  std::string
      file;  // JSON: {"length": N, "spans": [[b, e], ...], "docs": [...], "padding_from": P}
  int64_t length = 0;
  std::vector<std::string> spans;  // "begin:end"
  std::vector<int64_t> docs;
  int64_t padding_from = -1;
  int64_t cp = 2;
  int64_t block = 128;
  std::string config;  // cost model from this config's LLM (default: attention pairs only)
};

plan::Span parse_span(const std::string& text) {
  const size_t colon = text.find(':');
  WEFT_CHECK(colon != std::string::npos, "--span ", text, ": expected BEGIN:END");
  try {
    return {std::stoll(text.substr(0, colon)), std::stoll(text.substr(colon + 1))};
  } catch (const std::exception&) {
    WEFT_FAIL("--span ", text, ": expected BEGIN:END with integer positions");
  }
}

int run_cp_split(CpSplitArgs a) {
  std::vector<plan::Span> spans;
  if (!a.file.empty()) {
    std::ifstream in(a.file);
    WEFT_CHECK(in, a.file, ": cannot read sequence file");
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    WEFT_CHECK(j.is_object() && j.contains("length") && j["length"].is_number_integer(), a.file,
               ": expected a JSON object with an integer \"length\" (and optional \"spans\": "
               "[[begin, end], ...], \"docs\": [start, ...], \"padding_from\": N)");
    a.length = j["length"].get<int64_t>();
    try {
      for (const auto& s : j.value("spans", nlohmann::json::array()))
        spans.push_back({s.at(0).get<int64_t>(), s.at(1).get<int64_t>()});
      a.docs = j.value("docs", std::vector<int64_t>{});
      a.padding_from = j.value("padding_from", int64_t{-1});
    } catch (const nlohmann::json::exception& e) {
      WEFT_FAIL(a.file,
                ": spans must be [[begin, end], ...], docs a list of integers and "
                "padding_from an integer (",
                e.what(), ")");
    }
  }
  for (const auto& s : a.spans) spans.push_back(parse_span(s));
  WEFT_CHECK(a.length > 0, "weft inspect cp-split: give --length N (or --file SEQ.json)");
  const plan::SequenceDesc seq = plan::make_sequence(a.length, spans, a.docs, a.padding_from);
  plan::CpSplitOptions opts;
  opts.cp = a.cp;
  opts.block_size = a.block;
  std::string cost = "attention pairs only";
  opts.cost = plan::CpCostModel{1.0, 0.0};
  if (!a.config.empty()) {
    opts.cost = plan::make_cp_cost_model(load_spec(a.config).model.llm);
    cost = "FLOPs of model.llm in " + a.config;
  }
  nlohmann::ordered_json out;
  out["tokens"] = a.length;
  out["cp"] = a.cp;
  out["block_size"] = a.block;
  out["cost"] = cost;
  out["default_policy"] = plan::to_string(opts.policy);
  for (plan::CpPolicy p : plan::all_cp_policies()) {
    opts.policy = p;
    out["policies"][plan::to_string(p)] = plan::cp_split_json(plan::split_sequence(seq, opts));
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

struct BalanceArgs {
  std::string config;
  std::vector<std::string> sets;
  std::string mix = "llava";  // a plan/workload.h mix, or "shapes" (the config's dataset)
  int64_t batch = 0;          // 0 = train.batch
  int64_t replicas = 1;
  int64_t microbatches = 0;  // 0 = train.microbatches
  int64_t stages = 1;
  int64_t vp = 1;  // chunks per pipeline rank
  uint64_t seed = 0;
};

int run_balance(const BalanceArgs& a) {
  const auto& mixes = plan::workload_mixes();
  WEFT_CHECK(a.mix == "shapes" || std::find(mixes.begin(), mixes.end(), a.mix) != mixes.end(),
             "weft inspect balance: --mix ", a.mix,
             ": expected llava, video, interleaved or shapes (the config's dataset)");
  Spec spec = load_spec(a.config, a.sets);
  const int64_t batch = a.batch > 0 ? a.batch : spec.train.batch;
  // The balancer's work grows a little faster than the batch (a million samples: about a minute).
  WEFT_CHECK(batch <= 1000000, "weft inspect balance: a batch of ", batch,
             " samples: at most 1000000 (--batch, or train.batch of ", a.config, ")");
  spec.train.batch = batch;
  if (a.microbatches > 0) spec.train.microbatches = a.microbatches;
  for (auto& [name, layout] : spec.parallel.modules) {
    layout = LayoutSpec{};
    layout.dp = a.replicas;
  }
  const plan::Plan p = plan::make_plan(spec, a.replicas);
  std::vector<plan::SampleShape> shapes;
  if (a.mix == "shapes") {
    const data::Tokenizer tok = data::Tokenizer::for_shapes(spec.model);
    if (spec.model.llm.vocab == 0) spec.model.llm.vocab = (tok.vocab_size() + 63) / 64 * 64;
    const data::ShapesDataset dataset(spec, tok);
    for (const data::Sample& sample : dataset.train_layout(static_cast<int64_t>(a.seed), batch))
      shapes.push_back(train::shape_of(sample, spec.model.encoders.size()));
  } else {
    shapes = plan::sample_workload(a.mix, spec, batch, a.seed);
  }
  const plan::WorkModel model = plan::make_work_model(spec, p);
  std::vector<plan::SampleWork> work;
  for (const auto& s : shapes) work.push_back(model.work(s));
  plan::BalanceOptions opts;
  opts.replicas = a.replicas;
  opts.microbatches = spec.train.microbatches;
  WEFT_CHECK(a.vp == 1 || a.stages > 1, "--vp = ", a.vp,
             ": interleaved 1F1B needs more than one pipeline stage (--pp)");
  opts.pipeline_stages = a.stages;
  opts.virtual_stages = a.vp;
  nlohmann::ordered_json out;
  out["config"] = a.config;
  out["mix"] = a.mix;
  out["samples"] = batch;
  out["replicas"] = a.replicas;
  out["microbatches_per_replica"] = opts.microbatches;
  out["pipeline_stages"] = a.stages;
  out["virtual_stages"] = a.vp;
  std::vector<plan::Spread> spreads;
  for (plan::BalancePolicy policy :
       {plan::BalancePolicy::kInOrder, plan::BalancePolicy::kBalanced}) {
    opts.policy = policy;
    const plan::BatchBalance b = plan::balance_batch(work, model.cost, opts);
    std::vector<double> costs;
    for (const auto& r : b.microbatch_cost) costs.insert(costs.end(), r.begin(), r.end());
    spreads.push_back(plan::spread(costs));
    out["policies"][plan::to_string(policy)] = plan::balance_json(b, model.encoder_names);
  }
  out["summary"] = {{"microbatch_cv_in_order", spreads[0].cv},
                    {"microbatch_cv_balanced", spreads[1].cv},
                    {"cv_reduction", spreads[1].cv > 0 ? spreads[0].cv / spreads[1].cv : 0.0},
                    {"max_over_mean_in_order", spreads[0].max_over_mean},
                    {"max_over_mean_balanced", spreads[1].max_over_mean}};
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace

std::function<int()> add_inspect(CLI::App& app) {
  CLI::App* inspect = app.add_subcommand("inspect", "look inside what weft would do");
  inspect->require_subcommand(1);
  auto args = std::make_shared<CpSplitArgs>();
  CLI::App* cp = inspect->add_subcommand(
      "cp-split",
      "context-parallel token split of a sequence under every policy (JSON: token ranges and "
      "work per rank)");
  cp->add_option("--file", args->file, "sequence description (JSON)");
  cp->add_option("--length", args->length, "sequence length in tokens");
  cp->add_option("--span", args->spans, "modality item span BEGIN:END (repeatable)");
  cp->add_option("--doc", args->docs, "start of a packed document (repeatable)");
  cp->add_option("--padding-from", args->padding_from, "first padding position");
  cp->add_option("--cp", args->cp, "context-parallel size")->check(weft::cli::kPositive);
  cp->add_option("--block", args->block, "block size in tokens")->check(weft::cli::kPositive);
  cp->add_option("--config", args->config, "take the cost model from this config's LLM");
  auto bargs = std::make_shared<BalanceArgs>();
  CLI::App* bal = inspect->add_subcommand(
      "balance",
      "per-microbatch encoder and LLM work of a global batch, in order vs balanced (JSON: "
      "assignment, work, CV and max/mean)");
  bal->add_option("config", bargs->config, "config file (TOML): the model and train.batch")
      ->required();
  bal->add_option("--set", bargs->sets, "override a config key: section.key=value (repeatable)");
  bal->add_option("--mix", bargs->mix,
                  "workload: llava, video, interleaved (synthetic), or shapes (the config's "
                  "dataset)");
  bal->add_option("--batch", bargs->batch, "samples in the global batch (default train.batch)")
      ->check(weft::cli::kPositive);
  bal->add_option("--replicas", bargs->replicas, "LLM data-parallel replicas")
      ->check(weft::cli::kPositive);
  bal->add_option("--microbatches", bargs->microbatches,
                  "microbatches per replica (default train.microbatches)")
      ->check(weft::cli::kPositive);
  bal->add_option("--pp", bargs->stages, "pipeline stages (orders microbatches for 1F1B)")
      ->check(weft::cli::kPositive);
  bal->add_option("--vp", bargs->vp, "chunks per pipeline rank (interleaved 1F1B; with --pp)")
      ->check(weft::cli::kPositive);
  bal->add_option("--seed", bargs->seed, "workload seed (shapes: the training step)");
  return [cp, args, bal, bargs]() -> int {
    if (*cp) return run_cp_split(*args);
    if (*bal) return run_balance(*bargs);
    return 1;
  };
}

}  // namespace weft::cli
