// Plan JSON round trip (to_json → plan_from_json gives the same Plan, on its own and checked
// against the spec) and bad Plan files: every error names the file and the field.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "support/errors.h"
#include "support/plan_specs.h"
#include "weft/core/error.h"
#include "weft/plan/plan.h"

namespace weft::plan {
namespace {

using testing::error_of;
using json = nlohmann::ordered_json;

Spec with(Spec s, const std::string& placement, LayoutSpec vision, LayoutSpec llm) {
  s.parallel.placement = placement;
  s.parallel.modules["vision"] = vision;
  s.parallel.modules["llm"] = llm;
  return s;
}

LayoutSpec layout(int64_t dp, int64_t tp, int64_t pp, int64_t cp = 1) {
  LayoutSpec l;
  l.dp = dp, l.tp = tp, l.pp = pp, l.cp = cp;
  return l;
}

void expect_same(const Plan& a, const Plan& b) {
  EXPECT_EQ(to_json(a), to_json(b));
  ASSERT_EQ(a.modules.size(), b.modules.size());
  for (size_t i = 0; i < a.modules.size(); ++i) {
    EXPECT_EQ(a.modules[i].encoder, b.modules[i].encoder);
    EXPECT_EQ(a.modules[i].role, b.modules[i].role);
  }
}

TEST(PlanJson, RoundTrip) {
  Spec frozen = testing::vlm_spec();
  frozen.model.encoders[0].frozen = true;
  Spec moe = testing::vlm_spec();  // expert parallelism: ep 2 over whole experts (etp 1)
  moe.model.llm.moe.experts = 4;
  LayoutSpec experts = layout(2, 2, 1);
  experts.ep = 2;
  experts.etp = 1;
  LayoutSpec sequence = layout(1, 2, 2);  // sequence parallelism under tp 2
  sequence.sp = true;
  const std::pair<Spec, int64_t> cases[] = {
      {testing::vlm_spec(), 1},
      {with(testing::vlm_spec(), "colocated", layout(4, 1, 1), layout(1, 2, 2)), 4},
      {with(testing::vlm_spec(), "separate", layout(2, 1, 1), layout(2, 2, 2)), 10},
      {with(frozen, "separate", layout(1, 1, 3), layout(1, 1, 4)), 7},
      {with(testing::vlm_spec(), "colocated", layout(2, 1, 1), layout(1, 1, 1, 2)), 2},
      {with(moe, "colocated", layout(4, 1, 1), experts), 4},
      {with(testing::vlm_spec(), "colocated", layout(4, 1, 1), sequence), 4}};
  for (const auto& [spec, world] : cases) {
    const Plan p = make_plan(spec, world);
    const std::string text = to_json(p);
    SCOPED_TRACE(text);
    expect_same(plan_from_json(text, "p.json"), p);
    expect_same(plan_from_json(text, "p.json", spec), p);
    // The checked form takes the layouts from the file, not from the config.
    Spec bare = spec;
    bare.parallel = ParallelSpec{};
    expect_same(plan_from_json(text, "p.json", bare), p);
    EXPECT_EQ(plan_from_json(text, "p.json", bare).module("llm").layout.sp,
              p.module("llm").layout.sp);
  }
}

// The plan file of a separate layout, edited by `edit`; the error reading it against the spec.
std::string error_after(const std::function<void(json&)>& edit, bool against_spec = true) {
  const Spec spec = with(testing::vlm_spec(), "separate", layout(2, 1, 1), layout(2, 2, 2));
  json j = json::parse(to_json(make_plan(spec, 10)));
  edit(j);
  const std::string text = j.dump();
  return against_spec ? error_of([&] { plan_from_json(text, "plan.json", spec); })
                      : error_of([&] { plan_from_json(text, "plan.json"); });
}

TEST(PlanJson, BadFilesNameTheFileAndTheField) {
  EXPECT_NE(error_of([] {
              plan_from_json("{\"world_size\": ", "plan.json");
            }).find("plan.json: not valid JSON"),
            std::string::npos);
  const std::pair<std::function<void(json&)>, std::string> cases[] = {
      {[](json& j) { j["modules"][2]["layout"].erase("tp"); },
       "plan.json: modules[2].layout.tp: missing"},
      {[](json& j) { j["modules"][2]["layout"]["tp"] = "two"; },
       "plan.json: modules[2].layout.tp = \"two\": expected an integer >= 1"},
      {[](json& j) { j["modules"][0]["layout"]["dp"] = 0; },
       "plan.json: modules[0].layout.dp = 0: expected an integer >= 1"},
      {[](json& j) { j["microbatches"] = 2.5; },
       "plan.json: microbatches = 2.5: expected an integer >= 1"},
      {[](json& j) { j["modules"][1]["colour"] = "red"; },
       "plan.json: modules[1].colour: unknown field"},
      {[](json& j) {
         j["modules"][2]["ranks"] = {2, 6};
       },
       "plan.json: modules[2].ranks = [2, 6]: expected [first, first + dp*tp*pp*cp = first + 8]"},
      {[](json& j) {
         j["modules"][2]["stage_boundaries"] = {1, 2};
       },
       "plan.json: modules[2].stage_boundaries = [1, 2]: expected pp - 1 = 1 entries"},
      {[](json& j) { j["modules"][0]["role"] = "llm"; },
       "plan.json: modules[0].role = \"llm\": the LLM is the last module"},
      {[](json& j) { j["schedule"] = "gpipe"; }, "plan.json: schedule = \"gpipe\""}};
  for (const auto& [edit, want] : cases) {
    const std::string err = error_after(edit, false);
    EXPECT_NE(err.find(want), std::string::npos) << err;
  }
  // Against the config.
  const std::pair<std::function<void(json&)>, std::string> checked[] = {
      {[](json& j) { j["modules"][0]["name"] = "audio"; },
       "plan.json: modules[0].name = \"audio\": test.toml has \"vision\" there"},
      {[](json& j) { j["global_batch"] = 16; },
       "plan.json: global_batch = 16: test.toml has train.batch = 8"},
      {[](json& j) {
         j["modules"][2]["layout"]["tp"] = 3;
         j["modules"][2]["ranks"] = {2, 14};
         j["world_size"] = 14;
       },
       "plan.json: the plan does not fit test.toml: test.toml: parallel.llm.tp = 3: must divide"},
      {[](json& j) { j["modules"][2]["stage_boundaries"] = {9}; },
       "plan.json: the plan does not fit test.toml: test.toml: parallel.llm.stages = [9]"},
      {[](json& j) { j["modules"][0]["frozen"] = true; },
       "plan.json: modules[0].frozen = true: test.toml gives false"},
      {[](json& j) {
         j["modules"][1]["ranks"] = {4, 6};
       },
       "plan.json: modules[1].ranks = [4, 6]: test.toml gives [0, 2]"},
      {[](json& j) { j["schedule"] = "sequential"; },
       "plan.json: schedule = \"sequential\": test.toml gives \"1f1b\""},
      {[](json& j) { j["modules"].erase(1); },
       "plan.json: modules: 2 modules, but test.toml has 3"}};
  for (const auto& [edit, want] : checked) {
    const std::string err = error_after(edit);
    EXPECT_NE(err.find(want), std::string::npos) << err;
  }
}

}  // namespace
}  // namespace weft::plan
