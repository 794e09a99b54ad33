#include "cli/inspect.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "weft/core/config.h"
#include "weft/core/error.h"
#include "weft/plan/cp_split.h"

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
  cp->add_option("--cp", args->cp, "context-parallel size")->check(CLI::PositiveNumber);
  cp->add_option("--block", args->block, "block size in tokens")->check(CLI::PositiveNumber);
  cp->add_option("--config", args->config, "take the cost model from this config's LLM");
  return [cp, args]() -> int {
    if (*cp) return run_cp_split(*args);
    return 1;
  };
}

}  // namespace weft::cli
