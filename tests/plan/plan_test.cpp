// make_plan (frozen-aware backward flags, placement, layout validation, stages, JSON), the
// module rank grid (coordinates, groups) and the FLOP model, against
// numbers worked out by hand from REFERENCES.md.
#include "weft/plan/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "support/errors.h"
#include "weft/core/error.h"
#include "weft/core/spec.h"
#include "weft/plan/flops.h"

namespace weft::plan {
namespace {

Spec two_encoder_spec() {
  Spec s;
  s.source = "test.toml";
  EncoderSpec v;
  v.name = "vision";
  v.kind = EncoderKind::kVit;
  EncoderSpec a;
  a.name = "audio";
  a.kind = EncoderKind::kWhisper;
  s.model.encoders = {v, a};
  s.train.batch = 32;
  s.train.microbatches = 4;
  return s;
}

struct Flags {
  bool frozen, weight_grads, input_grads;
};

void expect_flags(const Plan& p, const std::string& name, Flags f) {
  const ModulePlan& m = p.module(name);
  EXPECT_EQ(m.frozen, f.frozen) << name;
  EXPECT_EQ(m.weight_grads, f.weight_grads) << name;
  EXPECT_EQ(m.input_grads, f.input_grads) << name;
  EXPECT_EQ(m.needs_backward(), f.weight_grads || f.input_grads) << name;
}

TEST(Plan, ModulesInSpecOrderWithUnitLayouts) {
  const Plan p = make_plan(two_encoder_spec());
  std::vector<std::string> names;
  for (const auto& m : p.modules) names.push_back(m.name);
  EXPECT_EQ(names, (std::vector<std::string>{"vision", "vision.projector", "audio",
                                             "audio.projector", "llm"}));
  EXPECT_EQ(p.module("vision").role, ModuleRole::kEncoder);
  EXPECT_EQ(p.module("audio.projector").role, ModuleRole::kProjector);
  EXPECT_EQ(p.module("audio.projector").encoder, 1);
  EXPECT_EQ(p.module("llm").role, ModuleRole::kLlm);
  EXPECT_EQ(p.module("llm").encoder, -1);
  EXPECT_EQ(p.world_size, 1);
  EXPECT_EQ(p.global_batch, 32);
  EXPECT_EQ(p.microbatches, 4);
  for (const auto& m : p.modules) EXPECT_EQ(m.layout.size(), 1) << m.name;
  EXPECT_THROW(p.module("video"), Error);
}

TEST(Plan, AllTrainable) {
  const Plan p = make_plan(two_encoder_spec());
  expect_flags(p, "vision", {false, true, false});  // inputs are data: never input grads
  expect_flags(p, "vision.projector", {false, true, true});
  expect_flags(p, "audio", {false, true, false});
  expect_flags(p, "audio.projector", {false, true, true});
  expect_flags(p, "llm", {false, true, true});
}

TEST(Plan, FrozenEncoderSideNeedsNoBackward) {
  Spec s = two_encoder_spec();
  for (auto& e : s.model.encoders) {
    e.frozen = true;
    e.projector.frozen = true;
  }
  const Plan p = make_plan(s);
  for (const char* m : {"vision", "vision.projector", "audio", "audio.projector"})
    expect_flags(p, m, {true, false, false});
  // Nothing upstream of the LLM trains: no input gradients for it.
  expect_flags(p, "llm", {false, true, false});
}

TEST(Plan, FrozenProjectorAfterTrainableEncoderNeedsInputGradsOnly) {
  Spec s = two_encoder_spec();
  s.model.encoders[0].projector.frozen = true;  // vision trains, its projector does not
  s.model.encoders[1].frozen = true;            // audio frozen, its projector trains
  s.model.llm.frozen = true;
  const Plan p = make_plan(s);
  expect_flags(p, "vision", {false, true, false});
  expect_flags(p, "vision.projector", {true, false, true});
  expect_flags(p, "audio", {true, false, false});
  expect_flags(p, "audio.projector", {false, true, false});
  // A frozen LLM with trainable modules upstream still passes gradients back.
  expect_flags(p, "llm", {true, false, true});
}

TEST(Plan, LlmInputGradsIffSomethingUpstreamTrains) {
  // Only one thing upstream trains, in turn: each alone turns the LLM's input grads on.
  for (int which = 0; which < 4; ++which) {
    Spec s = two_encoder_spec();
    for (auto& e : s.model.encoders) e.frozen = e.projector.frozen = true;
    auto& e = s.model.encoders[which / 2];
    (which % 2 == 0 ? e.frozen : e.projector.frozen) = false;
    EXPECT_TRUE(make_plan(s).module("llm").input_grads) << which;
  }
  Spec text_only;
  EXPECT_FALSE(make_plan(text_only).module("llm").input_grads);
  ASSERT_EQ(make_plan(text_only).modules.size(), 1u);
}

LayoutSpec layout(int64_t dp, int64_t tp, int64_t pp = 1, int64_t cp = 1,
                  std::vector<int64_t> stages = {}) {
  LayoutSpec l;
  l.dp = dp, l.tp = tp, l.pp = pp, l.cp = cp, l.stages = std::move(stages);
  return l;
}

// The message make_plan throws, or a note that it threw none.
std::string plan_error(const Spec& s, int64_t world_size) {
  try {
    make_plan(s, world_size);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no weft::Error thrown)";
}

std::string layout_error(const std::string& module, LayoutSpec l, int64_t world_size = 1) {
  Spec s = two_encoder_spec();
  s.parallel.modules[module] = l;
  return plan_error(s, world_size);
}

bool has(const std::string& message, const std::string& needle) {
  return message.find(needle) != std::string::npos;
}

TEST(Plan, ColocatedLayoutMustFillTheWorld) {
  const std::string llm = layout_error("llm", layout(1, 2));
  EXPECT_TRUE(has(llm, "test.toml: parallel.llm = {dp=1, tp=2, pp=1, cp=1}")) << llm;
  EXPECT_TRUE(has(llm, "dp*tp*pp*cp = 2 but the job has 1 rank and")) << llm;
  EXPECT_TRUE(has(llm, "colocated")) << llm;
  const std::string vision = layout_error("vision", layout(2, 1), 4);
  EXPECT_TRUE(has(vision, "parallel.vision = {dp=2,")) << vision;
  EXPECT_TRUE(has(vision, "the job has 4 ranks")) << vision;
  EXPECT_FALSE(has(vision, "projector")) << vision;
  // An explicit all-ones layout is fine: it fills the world like an unset one.
  Spec s = two_encoder_spec();
  s.parallel.modules["llm"] = LayoutSpec{};
  EXPECT_NO_THROW(make_plan(s));
  EXPECT_EQ(make_plan(s, 4).module("llm").layout.dp, 4);
}

TEST(Plan, ColocatedModulesShareTheWorld) {
  Spec s = two_encoder_spec();
  s.parallel.modules["llm"] = layout(1, 2, 2, 2);
  s.parallel.modules["vision"] = layout(2, 2, 2);
  const Plan p = make_plan(s, 8);
  EXPECT_EQ(p.placement, "colocated");
  EXPECT_EQ(p.cp_split, "balanced");
  for (const auto& m : p.modules) {
    EXPECT_EQ(m.first_rank, 0) << m.name;
    EXPECT_EQ(m.layout.size(), 8) << m.name;
  }
  EXPECT_EQ(p.module("audio").layout.dp, 8);  // unset: data parallel over the world
  EXPECT_EQ(p.module("audio.projector").layout.dp, 8);
  EXPECT_EQ(p.module("vision.projector").layout.tp, 2);
  EXPECT_EQ(p.module("llm").layout.cp, 2);
  EXPECT_EQ(p.schedule, "1f1b");
}

TEST(Plan, SeparatePlacementTilesTheWorld) {
  Spec s = two_encoder_spec();
  s.parallel.placement = "separate";
  s.parallel.cp_split = "contiguous";
  s.parallel.modules["llm"] = layout(1, 1, 2);
  const Plan p = make_plan(s, 4);
  EXPECT_EQ(p.placement, "separate");
  EXPECT_EQ(p.cp_split, "contiguous");
  EXPECT_EQ(p.schedule, "1f1b");
  const std::pair<const char*, int64_t> first[] = {
      {"vision", 0}, {"vision.projector", 0}, {"audio", 1}, {"audio.projector", 1}, {"llm", 2}};
  for (const auto& [name, rank] : first) EXPECT_EQ(p.module(name).first_rank, rank) << name;
  EXPECT_EQ(p.module("vision").layout.size(), 1);  // unset: one rank, not the world
  EXPECT_EQ(p.module("audio.projector").layout.size(), 1);
  EXPECT_EQ(p.module("llm").layout.dp, 1);
  EXPECT_EQ(p.module("llm").layout.pp, 2);
  EXPECT_FALSE(p.module("llm").hosts(1));
  EXPECT_TRUE(p.module("llm").hosts(3));
  EXPECT_EQ(p.module("llm").group(2, {Axis::kPp}), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(p.module("llm").stage_boundaries, (std::vector<int64_t>{1}));

  const auto j = nlohmann::json::parse(to_json(p));
  EXPECT_EQ(j.at("placement"), "separate");
  EXPECT_EQ(j.at("modules")[2].at("ranks"), (nlohmann::json{1, 2}));
  EXPECT_EQ(j.at("modules")[4].at("ranks"), (nlohmann::json{2, 4}));

  // Spans follow spec order, whatever their sizes.
  s.parallel.modules["vision"] = layout(2, 1);
  const Plan q = make_plan(s, 5);
  EXPECT_EQ(q.module("audio").first_rank, 2);
  EXPECT_EQ(q.module("llm").first_rank, 3);

  const std::string e = plan_error(s, 6);
  EXPECT_TRUE(has(e,
                  "test.toml: parallel.placement = \"separate\": the modules need 2 (vision) + "
                  "1 (audio) + 2 (llm) = 5 ranks but the job has 6"))
      << e;
  Spec text_only;
  text_only.parallel.placement = "separate";
  text_only.train.batch = 4;
  EXPECT_EQ(make_plan(text_only).module("llm").layout.size(), 1);
  const std::string t = plan_error(text_only, 2);
  EXPECT_TRUE(has(t, "the modules need 1 (llm) ranks but the job has 2")) << t;
}

// A grid with unequal sides, so a stride mix-up shows.
ModulePlan grid(int64_t tp, int64_t cp, int64_t dp, int64_t pp, int64_t first_rank) {
  ModulePlan m;
  m.name = "m";
  m.layout.tp = tp, m.layout.cp = cp, m.layout.dp = dp, m.layout.pp = pp;
  m.first_rank = first_rank;
  return m;
}

TEST(Grid, CoordinatesRoundTrip) {
  const ModulePlan m = grid(2, 3, 2, 2, 5);  // ranks [5, 29)
  EXPECT_FALSE(m.hosts(4));
  EXPECT_TRUE(m.hosts(5));
  EXPECT_TRUE(m.hosts(28));
  EXPECT_FALSE(m.hosts(29));
  // rank = 5 + tp + 2 * (cp + 3 * (dp + 2 * pp))
  EXPECT_EQ(m.rank_of({1, 2, 1, 1}), 5 + 1 + 2 * (2 + 3 * (1 + 2 * 1)));
  EXPECT_EQ(m.rank_of({0, 0, 0, 0}), 5);
  EXPECT_EQ(m.rank_of({0, 1, 0, 0}), 7);
  EXPECT_EQ(m.rank_of({0, 0, 1, 0}), 11);
  EXPECT_EQ(m.rank_of({0, 0, 0, 1}), 17);
  for (int64_t r = 5; r < 29; ++r) {
    const Coord c = m.coord(r);
    EXPECT_EQ(m.rank_of(c), r);
    EXPECT_TRUE(c.tp < 2 && c.cp < 3 && c.dp < 2 && c.pp < 2) << r;
  }
  const Coord c = m.coord(28);
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.cp, 2);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 1);
  EXPECT_THROW(m.coord(4), Error);
  EXPECT_THROW(m.rank_of({2, 0, 0, 0}), Error);
}

using Groups = std::vector<std::vector<int64_t>>;

TEST(Grid, GroupsOfATwoByTwoByTwoGrid) {
  const ModulePlan m = grid(2, 1, 2, 2, 4);  // ranks [4, 12): rank = 4 + tp + 2 * (dp + 2 * pp)
  EXPECT_EQ(m.groups({Axis::kTp}), (Groups{{4, 5}, {6, 7}, {8, 9}, {10, 11}}));
  EXPECT_EQ(m.groups({Axis::kDp}), (Groups{{4, 6}, {5, 7}, {8, 10}, {9, 11}}));
  EXPECT_EQ(m.groups({Axis::kPp}), (Groups{{4, 8}, {5, 9}, {6, 10}, {7, 11}}));
  EXPECT_EQ(m.groups({Axis::kCp}), (Groups{{4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}}));
  EXPECT_EQ(m.groups({}), m.groups({Axis::kCp}));
  EXPECT_EQ(m.groups({Axis::kTp, Axis::kDp}), (Groups{{4, 5, 6, 7}, {8, 9, 10, 11}}));
  EXPECT_EQ(m.groups({Axis::kDp, Axis::kPp}), (Groups{{4, 6, 8, 10}, {5, 7, 9, 11}}));
  EXPECT_EQ(m.groups({Axis::kPp, Axis::kTp}), (Groups{{4, 5, 8, 9}, {6, 7, 10, 11}}));
  EXPECT_EQ(m.groups({Axis::kTp, Axis::kCp, Axis::kDp, Axis::kPp}),
            (Groups{{4, 5, 6, 7, 8, 9, 10, 11}}));
  EXPECT_EQ(m.group(7, {Axis::kTp}), (std::vector<int64_t>{6, 7}));
  EXPECT_EQ(m.group(9, {Axis::kPp, Axis::kTp}), (std::vector<int64_t>{4, 5, 8, 9}));
  EXPECT_EQ(m.group(10, {Axis::kDp}), (std::vector<int64_t>{8, 10}));
  EXPECT_EQ(m.group(10, {}), (std::vector<int64_t>{10}));
  EXPECT_THROW(m.group(12, {Axis::kTp}), Error);
}

// Calls f with the axes whose bit is set in `mask` (bit i = Axis i), as an initializer_list.
template <typename F>
auto with_axes(int mask, F f) {
  std::vector<Axis> a;
  for (int i = 0; i < 4; ++i)
    if (mask & (1 << i)) a.push_back(static_cast<Axis>(i));
  switch (a.size()) {
    case 0:
      return f({});
    case 1:
      return f({a[0]});
    case 2:
      return f({a[0], a[1]});
    case 3:
      return f({a[0], a[1], a[2]});
    default:
      return f({a[0], a[1], a[2], a[3]});
  }
}

TEST(Grid, GroupsPartitionTheModuleForEveryAxisSet) {
  const ModulePlan m = grid(2, 3, 2, 2, 3);  // ranks [3, 27)
  const int64_t side[] = {2, 3, 2, 2};
  const auto at = [](const Coord& c, int i) {
    return i == 0 ? c.tp : i == 1 ? c.cp : i == 2 ? c.dp : c.pp;
  };
  for (int mask = 0; mask < 16; ++mask) {
    int64_t size = 1;
    for (int i = 0; i < 4; ++i) size *= (mask & (1 << i)) ? side[i] : 1;
    const Groups gs = with_axes(mask, [&](std::initializer_list<Axis> a) { return m.groups(a); });
    EXPECT_EQ(static_cast<int64_t>(gs.size()) * size, 24) << mask;
    std::vector<int> seen(24, 0);
    for (size_t g = 0; g < gs.size(); ++g) {
      const std::vector<int64_t>& ranks = gs[g];
      ASSERT_EQ(static_cast<int64_t>(ranks.size()), size) << mask;
      EXPECT_TRUE(std::is_sorted(ranks.begin(), ranks.end())) << mask;
      if (g > 0) {
        EXPECT_LT(gs[g - 1].front(), ranks.front()) << mask;
      }
      for (int64_t r : ranks) {
        ++seen[r - 3];
        for (int i = 0; i < 4; ++i) {  // coordinates off the group's axes agree
          if (!(mask & (1 << i))) {
            EXPECT_EQ(at(m.coord(r), i), at(m.coord(ranks[0]), i)) << mask;
          }
        }
        EXPECT_EQ(with_axes(mask, [&](std::initializer_list<Axis> a) { return m.group(r, a); }),
                  ranks)
            << mask << " " << r;
      }
    }
    for (int n : seen) EXPECT_EQ(n, 1) << mask;
  }
}

TEST(Plan, StageLayers) {
  Spec s = two_encoder_spec();
  s.model.llm.layers = 10;
  s.model.encoders[0].feature_layer = -2;  // vision runs 2 of its 3 blocks
  s.parallel.modules["llm"] = layout(1, 1, 4);
  s.parallel.modules["vision"] = layout(2, 1, 2);
  Plan p = make_plan(s, 4);
  const ModulePlan& llm = p.module("llm");
  EXPECT_EQ(llm.layers, 10);
  // The joint partition's default (partition.h; vocab 0: a free head, equal blocks): colocated,
  // LLM stages 0 and 1 share ranks 0 and 1 with vision stage 0 (its front end and a block),
  // stages 2 and 3 ranks 2 and 3 with vision stage 1 (a block and the projector), so the LLM's
  // first two stages take 2 blocks each and the last two 3 (alone, the LLM would split 1/3/3/3).
  EXPECT_EQ(llm.stage_boundaries, (std::vector<int64_t>{2, 4, 7}));
  const std::pair<int64_t, int64_t> balanced[] = {{0, 2}, {2, 4}, {4, 7}, {7, 10}};
  for (int64_t st = 0; st < 4; ++st) EXPECT_EQ(llm.stage_layers(st), balanced[st]) << st;
  EXPECT_THROW(llm.stage_layers(4), Error);
  const ModulePlan& vision = p.module("vision");
  EXPECT_EQ(vision.layers, 2);
  EXPECT_EQ(vision.stage_boundaries, (std::vector<int64_t>{1}));
  EXPECT_EQ(vision.stage_layers(1), (std::pair<int64_t, int64_t>{1, 2}));
  const ModulePlan& proj = p.module("vision.projector");
  EXPECT_EQ(proj.layers, 0);
  EXPECT_EQ(proj.layout.pp, 2);
  EXPECT_EQ(proj.stage_boundaries, vision.stage_boundaries);
  EXPECT_EQ(proj.stage_layers(1), (std::pair<int64_t, int64_t>{0, 0}));
  EXPECT_EQ(p.module("audio").layers, 3);
  EXPECT_TRUE(p.module("audio").stage_boundaries.empty());
  EXPECT_EQ(p.module("audio").stage_layers(0), (std::pair<int64_t, int64_t>{0, 3}));

  s.parallel.modules["llm"].stages = {1, 8, 9};
  p = make_plan(s, 4);
  const std::pair<int64_t, int64_t> given[] = {{0, 1}, {1, 8}, {8, 9}, {9, 10}};
  for (int64_t st = 0; st < 4; ++st) EXPECT_EQ(p.module("llm").stage_layers(st), given[st]) << st;
  const auto j = nlohmann::json::parse(to_json(p));
  EXPECT_EQ(j.at("modules")[4].at("layers"), 10);
  EXPECT_EQ(j.at("modules")[4].at("stage_boundaries"), (nlohmann::json{1, 8, 9}));
  EXPECT_EQ(j.at("schedule"), "1f1b");
}

struct ErrorCase {
  const char* what;
  Spec spec;
  int64_t world_size;
  std::vector<std::string> needles;
};

// Interleaved 1F1B (parallel.llm.vp): pp·vp virtual stages of contiguous blocks, pipeline rank s
// running stages s, s + pp, ...
TEST(Plan, VirtualStages) {
  Spec s = two_encoder_spec();
  s.model.llm.layers = 8;
  s.parallel.modules["llm"] = layout(1, 1, 2);
  s.parallel.modules["llm"].vp = 2;
  const Plan p = make_plan(s, 2);
  EXPECT_EQ(p.schedule, "interleaved-1f1b");
  const ModulePlan& llm = p.module("llm");
  EXPECT_EQ(llm.layout.stages(), 4);
  ASSERT_EQ(llm.stage_boundaries.size(), 3u);
  int64_t next = 0;  // the chunks tile the blocks in order
  for (int64_t st = 0; st < 4; ++st) {
    const auto [b, e] = llm.stage_layers(st);
    EXPECT_EQ(b, next) << st;
    EXPECT_GT(e, b) << st;
    next = e;
  }
  EXPECT_EQ(next, 8);
  EXPECT_THROW(llm.stage_layers(4), Error);
  // The chunks follow the cumulative work, so the pipeline ranks (each the sum of its chunks)
  // are even: 80 equal blocks over pp 8 · vp 3 give every rank 10 (smallest-largest-chunk cuts
  // with earliest ties would give ranks 9 to 12).
  Spec big = s;
  big.model.llm.layers = 80;
  big.train.batch = 64;
  big.train.microbatches = 8;
  big.parallel.modules["llm"] = layout(1, 1, 8);
  big.parallel.modules["llm"].vp = 3;
  const Plan bp = make_plan(big, 8);
  std::vector<int64_t> per_rank(8, 0);
  for (int64_t st = 0; st < 24; ++st) {
    const auto [b, e] = bp.module("llm").stage_layers(st);
    per_rank[static_cast<size_t>(st % 8)] += e - b;
  }
  EXPECT_EQ(per_rank, std::vector<int64_t>(8, 10));
  // Given boundaries, and the JSON round trip.
  s.parallel.modules["llm"].stages = {1, 4, 6};
  const Plan given = make_plan(s, 2);
  EXPECT_EQ(given.module("llm").stage_layers(2), (std::pair<int64_t, int64_t>{4, 6}));
  const auto j = nlohmann::json::parse(to_json(given));
  EXPECT_EQ(j.at("modules")[4].at("layout").at("vp"), 2);
  EXPECT_EQ(j.at("schedule"), "interleaved-1f1b");
  const Plan back = plan_from_json(to_json(given), "plan.json", s);
  EXPECT_EQ(back.module("llm").layout.vp, 2);
  EXPECT_EQ(back.module("llm").stage_boundaries, (std::vector<int64_t>{1, 4, 6}));
  auto edited = nlohmann::json::parse(to_json(given));  // a hand-edited vp
  edited["modules"][4]["layout"]["vp"] = 3;
  const std::string e = testing::error_of([&] { plan_from_json(edited.dump(), "plan.json", s); });
  EXPECT_TRUE(has(e,
                  "plan.json: modules[4].stage_boundaries = [1, 4, 6]: expected pp * vp - 1 = "
                  "5 entries"))
      << e;

  const auto with_vp = [](const std::string& module, int64_t pp, int64_t vp) {
    Spec x = two_encoder_spec();
    x.model.llm.layers = 8;
    x.parallel.modules[module] = layout(1, 1, pp);
    x.parallel.modules[module].vp = vp;
    return x;
  };
  std::vector<ErrorCase> cases;
  cases.push_back({"encoder",
                   with_vp("vision", 1, 2),
                   1,
                   {"test.toml: parallel.vision.vp = 2: virtual pipeline stages (interleaved "
                    "1F1B) apply to the LLM only"}});
  cases.push_back(
      {"no pipeline", with_vp("llm", 1, 2), 1, {"parallel.llm.vp = 2:", "need pp > 1 (pp = 1)"}});
  cases.push_back({"too many",
                   with_vp("llm", 2, 5),
                   2,
                   {"parallel.llm.vp = 5: pp * vp = 2 * 5 = 10 virtual stages, more than blocks "
                    "(model.llm.layers = 8)"}});
  Spec x = with_vp("llm", 2, 2);
  x.parallel.modules["llm"].stages = {4};
  cases.push_back({"stages", x, 2, {"parallel.llm.stages = [4]: needs pp * vp - 1 = 3 entries"}});
  for (const ErrorCase& c : cases) {
    const std::string msg = plan_error(c.spec, c.world_size);
    for (const std::string& needle : c.needles)
      EXPECT_TRUE(has(msg, needle)) << c.what << ": " << msg;
  }
}

// Every (microbatch, chunk) runs forward once and backward once on each pipeline rank, in an
// order that cannot deadlock when sends never block: replaying every rank's list, some rank can
// always run its next op (its input from the previous stage, its gradient from the next).
TEST(Plan, PipelineScheduleRunsEveryOpOnceWithoutDeadlock) {
  for (int64_t P = 1; P <= 9; ++P)
    for (int64_t vp = 1; vp <= 4; ++vp)
      for (int64_t M = 1; M <= 40; ++M)
        for (bool backward : {true, false}) {
          if (vp > 1 && P == 1) continue;
          const std::string at = "P " + std::to_string(P) + " vp " + std::to_string(vp) + " M " +
                                 std::to_string(M) + (backward ? "" : " forward only");
          const int64_t stages = P * vp;
          std::vector<std::vector<PipelineOp>> ops;
          for (int64_t s = 0; s < P; ++s) {
            ops.push_back(pipeline_schedule(P, vp, M, s, backward));
            std::vector<int> seen(static_cast<size_t>(2 * M * vp), 0);
            for (const PipelineOp& op : ops.back()) {
              ASSERT_TRUE(op.microbatch >= 0 && op.microbatch < M && op.chunk >= 0 && op.chunk < vp)
                  << at;
              ++seen[static_cast<size_t>((op.forward ? 0 : M * vp) + op.chunk * M + op.microbatch)];
            }
            for (size_t k = 0; k < seen.size(); ++k)
              EXPECT_EQ(seen[k], k < static_cast<size_t>(M * vp) || backward ? 1 : 0) << at;
          }
          // done[f/b][stage][microbatch]
          std::vector<std::vector<std::vector<bool>>> done(
              2, std::vector<std::vector<bool>>(static_cast<size_t>(stages),
                                                std::vector<bool>(static_cast<size_t>(M))));
          std::vector<size_t> next(static_cast<size_t>(P), 0);
          for (bool progress = true; progress;) {
            progress = false;
            for (int64_t s = 0; s < P; ++s) {
              while (next[s] < ops[s].size()) {
                const PipelineOp& op = ops[s][next[s]];
                const int64_t k = op.chunk * P + s;
                const size_t mb = static_cast<size_t>(op.microbatch);
                const bool ready = op.forward
                                       ? k == 0 || done[0][k - 1][mb]
                                       : done[0][k][mb] && (k == stages - 1 || done[1][k + 1][mb]);
                if (!ready) break;
                done[op.forward ? 0 : 1][k][mb] = true;
                ++next[s];
                progress = true;
              }
            }
          }
          for (int64_t s = 0; s < P; ++s) EXPECT_EQ(next[s], ops[s].size()) << at << " rank " << s;
        }
}

// The warm-up: 2·(pp − 1 − s) + (vp − 1)·(first group's size) forwards before the first
// backward. 9 microbatches over pp = 4 form groups of 5 and 4.
TEST(Plan, InterleavedWarmUpFollowsTheFirstGroup) {
  for (int64_t s = 0; s < 4; ++s) {
    const std::vector<PipelineOp> ops = pipeline_schedule(4, 2, 9, s, true);
    size_t leading = 0;  // the warm-up, then the steady phase's first forward
    while (leading < ops.size() && ops[leading].forward) ++leading;
    EXPECT_EQ(leading, static_cast<size_t>(2 * (3 - s) + 5 + 1)) << "rank " << s;
    EXPECT_EQ(ops[5].microbatch, 0);  // the first group's 5 microbatches through chunk 0 ...
    EXPECT_EQ(ops[5].chunk, 1);       // ... then chunk 1
  }
  // Fewer microbatches than pp: every forward first.
  const std::vector<PipelineOp> few = pipeline_schedule(4, 2, 3, 2, true);
  for (size_t k = 0; k < few.size(); ++k) EXPECT_EQ(few[k].forward, k < 6) << k;
}

TEST(Plan, ScheduleIsSequentialWithoutPipelines) {
  Spec s = two_encoder_spec();
  s.parallel.modules["llm"] = layout(1, 2, 1, 2);
  EXPECT_EQ(make_plan(s, 4).schedule, "sequential");
  s.parallel.modules["audio"] = layout(2, 1, 2);  // any module's pipeline turns on 1f1b
  EXPECT_EQ(make_plan(s, 4).schedule, "1f1b");
}

TEST(Plan, LayoutValidationNamesTheKey) {
  std::vector<ErrorCase> cases;
  const auto with = [](const std::string& module, LayoutSpec l) {
    Spec s = two_encoder_spec();
    s.parallel.modules[module] = l;
    return s;
  };
  cases.push_back({"llm tp vs heads",
                   with("llm", layout(1, 3)),
                   3,
                   {"test.toml: parallel.llm.tp = 3: must divide model.llm.heads = 4"}});
  cases.push_back({"llm tp vs kv_heads",
                   with("llm", layout(1, 4)),
                   4,
                   {"parallel.llm.tp = 4: must divide model.llm.kv_heads = 2"}});
  Spec s = with("llm", layout(1, 2));
  s.model.llm.ffn = 385;
  cases.push_back(
      {"llm tp vs ffn", s, 2, {"parallel.llm.tp = 2: must divide model.llm.ffn = 385"}});
  s = with("llm", layout(1, 2));
  s.model.llm.vocab = 101;
  cases.push_back(
      {"llm tp vs vocab", s, 2, {"parallel.llm.tp = 2: must divide model.llm.vocab = 101"}});
  cases.push_back({"encoder tp vs heads",
                   with("vision", layout(1, 3)),
                   3,
                   {"parallel.vision.tp = 3: must divide model.vision.heads = 4"}});
  s = with("audio", layout(1, 2));
  s.model.encoders[1].ffn = 511;
  cases.push_back(
      {"encoder tp vs ffn", s, 2, {"parallel.audio.tp = 2: must divide model.audio.ffn = 511"}});
  s = with("vision", layout(1, 8));
  s.model.encoders[0].heads = 8;
  s.model.llm.hidden = 132;
  cases.push_back(
      {"encoder tp vs mlp projector",
       s,
       8,
       {"parallel.vision.tp = 8: must divide model.llm.hidden", "= 132", "mlp projector"}});
  cases.push_back({"encoder cp",
                   with("audio", layout(1, 1, 1, 3)),
                   3,
                   {"parallel.audio.cp = 3: must divide the 32 tokens of each audio item"}});
  cases.push_back(
      {"llm pp vs layers",
       with("llm", layout(1, 1, 3)),
       3,
       {"parallel.llm.pp = 3: more pipeline stages than blocks (model.llm.layers = 2)"}});
  s = with("vision", layout(1, 1, 3));
  s.model.encoders[0].feature_layer = -2;
  cases.push_back({"encoder pp vs layers used",
                   s,
                   3,
                   {"parallel.vision.pp = 3: more pipeline stages than blocks",
                    "model.vision.layers = 3 with feature_layer = -2 runs 2 blocks"}});
  cases.push_back(
      {"pp zero", with("llm", layout(1, 1, 0)), 1, {"parallel.llm.pp = 0: must be >= 1"}});
  cases.push_back(
      {"dp negative", with("audio", layout(-2, 1)), 1, {"parallel.audio.dp = -2: must be >= 1"}});
  s = with("llm", layout(1, 1, 2, 1, {1, 2}));
  s.model.llm.layers = 4;
  cases.push_back(
      {"stage count", s, 2, {"parallel.llm.stages = [1, 2]: needs pp - 1 = 1 entries", "got 2"}});
  s = with("llm", layout(1, 1, 3, 1, {2, 2}));
  s.model.llm.layers = 4;
  cases.push_back({"stages not increasing",
                   s,
                   3,
                   {"parallel.llm.stages = [2, 2]: must be strictly increasing", "in [1, 3]"}});
  s = with("llm", layout(1, 1, 3, 1, {1, 4}));
  s.model.llm.layers = 4;
  cases.push_back({"stage past the end", s, 3, {"parallel.llm.stages = [1, 4]", "in [1, 3]"}});
  s = with("llm", layout(1, 1, 2, 1, {0}));
  cases.push_back({"stage zero", s, 2, {"parallel.llm.stages = [0]", "in [1, 1]"}});
  s = with("vision", layout(1, 1, 1, 1, {1}));
  cases.push_back({"stages without pp", s, 1, {"parallel.vision.stages = [1]: needs pp - 1 = 0"}});
  cases.push_back({"batch vs llm dp",
                   with("llm", layout(3, 1)),
                   3,
                   {"test.toml: train.batch = 32: must be divisible by the LLM's data-parallel "
                    "size (parallel.llm.dp = 3)"}});
  cases.push_back({"batch vs unset dp", two_encoder_spec(), 3, {"train.batch = 32", "dp = 3"}});
  cases.push_back({"microbatches per rank",
                   two_encoder_spec(),
                   16,
                   {"train.microbatches = 4", "32 / 16 = 2 samples", "lower train.microbatches"}});
  s = two_encoder_spec();
  s.parallel.placement = "apart";
  cases.push_back(
      {"placement", s, 1, {"parallel.placement = \"apart\": must be \"colocated\" or"}});
  s = two_encoder_spec();
  s.parallel.cp_split = "striped";
  cases.push_back(
      {"cp_split", s, 1, {"parallel.cp_split = \"striped\": must be \"balanced\", \"zigzag\""}});
  cases.push_back({"world", two_encoder_spec(), 0, {"world size must be >= 1, got 0"}});
  s = with("llm", layout(1, 1, 2));
  s.model.llm.recompute = true;
  s.model.llm.recompute_blocks = {1, 1, 0};
  cases.push_back({"recompute_blocks per stage",
                   s,
                   2,
                   {"test.toml: model.llm.recompute_blocks = [1, 1, 0]: needs one count per "
                    "pipeline stage of parallel.llm (pp = 2) or one for every stage, got 3"}});
  for (const ErrorCase& c : cases) {
    const std::string e = plan_error(c.spec, c.world_size);
    for (const std::string& needle : c.needles) EXPECT_TRUE(has(e, needle)) << c.what << ": " << e;
  }
}

TEST(Plan, ValidLayoutsPass) {
  Spec s = two_encoder_spec();
  s.model.llm.vocab = 100;
  s.parallel.modules["llm"] = layout(1, 2, 2, 2);  // tp 2 divides heads 4, kv 2, ffn 384, vocab 100
  EXPECT_NO_THROW(make_plan(s, 8));
  s.model.encoders[0].projector.kind = ProjectorKind::kLinear;  // no llm.hidden constraint
  s.model.encoders[0].heads = 8;
  s.model.llm.hidden = 132;
  s.parallel.modules["vision"] = layout(1, 8);
  EXPECT_NO_THROW(make_plan(s, 8));
  s.model.llm.vocab = 0;  // taken from the tokenizer: not checked here
  s.parallel.modules["llm"] = layout(1, 4, 2);
  s.model.llm.kv_heads = 4;
  EXPECT_NO_THROW(make_plan(s, 8));
  // batch / dp == microbatches is the smallest that works.
  Spec b = two_encoder_spec();
  EXPECT_NO_THROW(make_plan(b, 8));
}

TEST(Plan, JsonListsEveryModule) {
  Spec s = two_encoder_spec();
  s.model.encoders[1].frozen = true;
  const auto j = nlohmann::json::parse(to_json(make_plan(s)));
  EXPECT_EQ(j.at("world_size"), 1);
  EXPECT_EQ(j.at("microbatches"), 4);
  EXPECT_EQ(j.at("global_batch"), 32);
  const auto& mods = j.at("modules");
  ASSERT_EQ(mods.size(), 5u);
  EXPECT_EQ(mods[0].at("name"), "vision");
  EXPECT_EQ(mods[1].at("name"), "vision.projector");
  EXPECT_EQ(mods[1].at("role"), "projector");
  EXPECT_EQ(mods[2].at("name"), "audio");
  EXPECT_EQ(mods[2].at("frozen"), true);
  EXPECT_EQ(mods[2].at("weight_grads"), false);
  EXPECT_EQ(mods[2].at("input_grads"), false);
  EXPECT_EQ(mods[3].at("input_grads"), false);  // frozen audio: its projector needs none
  EXPECT_EQ(mods[4].at("name"), "llm");
  EXPECT_EQ(mods[4].at("role"), "llm");
  EXPECT_EQ(mods[4].at("input_grads"), true);
  EXPECT_EQ(mods[4].at("layout").at("tp"), 1);
  EXPECT_EQ(mods[4].at("ranks"), (nlohmann::json{0, 1}));
  EXPECT_EQ(mods[4].at("layers"), 2);
  EXPECT_EQ(mods[0].at("layers"), 3);
  EXPECT_EQ(mods[1].at("layers"), 0);
  EXPECT_EQ(j.at("schedule"), "sequential");
  EXPECT_EQ(j.at("cp_split"), "balanced");
}

// h = 64, 4 heads (head_dim 16, q = 64), 2 kv heads (kv = 32), F = 128, L = 2, V = 100;
// 10 tokens in documents of 6 and 4 → S2 = 36 + 16 = 52.
LlmSpec small_llm() {
  LlmSpec l;
  l.hidden = 64;
  l.heads = 4;
  l.kv_heads = 2;
  l.ffn = 128;
  l.layers = 2;
  l.vocab = 100;
  return l;
}

TEST(Flops, LlmForwardMatchesReferenceFormula) {
  // REFERENCES.md, training FLOPs: 6·T·[L·(h·(q+2kv) + q·h + f·h·F) + h·V] + 6·q·L·S2
  //   = 6·10·[2·(64·(64+64) + 64·64 + 3·64·128) + 64·100] + 6·64·2·52
  //   = 60·[2·(8192 + 4096 + 24576) + 6400] + 39936
  //   = 60·80128 + 39936 = 4807680 + 39936 = 4847616.
  // Forward is one third of it (2 of the 6): 1615872.
  const double training =
      6.0 * 10 * (2 * (64 * (64 + 64) + 64 * 64 + 3 * 64 * 128) + 64 * 100) + 6.0 * 64 * 2 * 52;
  ASSERT_EQ(training, 4847616.0);
  LlmTokens t;
  t.tokens = 10;
  t.logit_rows = 10;  // the reference puts the head on every token
  t.sum_sq_doc_len = 36 + 16;
  EXPECT_DOUBLE_EQ(llm_forward_flops(small_llm(), t), 1615872.0);
  EXPECT_DOUBLE_EQ(3.0 * llm_forward_flops(small_llm(), t), training);

  // The head runs on loss rows only: 3 rows instead of 10 save 2·7·64·100 = 89600.
  t.logit_rows = 3;
  EXPECT_DOUBLE_EQ(llm_forward_flops(small_llm(), t), 1615872.0 - 89600.0);

  // One document of 10 tokens instead (S2 = 100): attention grows by 2·64·2·48 = 12288.
  t.logit_rows = 10;
  t.sum_sq_doc_len = 100;
  EXPECT_DOUBLE_EQ(llm_forward_flops(small_llm(), t), 1615872.0 + 12288.0);
}

TEST(Flops, TrainingMultiplier) {
  EXPECT_EQ(training_multiplier(true, true), 3.0);
  EXPECT_EQ(training_multiplier(true, false), 3.0);  // a trainable module's inner layers
  EXPECT_EQ(training_multiplier(false, true), 2.0);
  EXPECT_EQ(training_multiplier(false, false), 1.0);
}

TEST(Flops, VitWithoutStemMatchesHandFormula) {
  EncoderSpec e;
  e.kind = EncoderKind::kVit;
  e.image_size = 32;
  e.patch = 8;  // T = (32/8)² = 16 tokens
  e.channels = 3;
  e.hidden = 16;
  e.ffn = 64;
  e.layers = 3;
  e.feature_layer = -2;  // LLaVA-style: 2 of the 3 blocks run
  // Patch embedding, per token C·p²·h MACs: 2·16·3·64·16 = 98304.
  // Per block, per token: qkv 3h² + out h² + MLP 2hF MACs; attention T·h for QKᵀ and for PV
  // (bidirectional, no halving): 2·16·(4·256 + 2·16·64) + 2·2·16·16·16 = 98304 + 16384 = 114688.
  // Total: 98304 + 2·114688 = 327680.
  EXPECT_DOUBLE_EQ(encoder_forward_flops(e), 327680.0);
  e.feature_layer = -1;  // all 3 blocks
  EXPECT_DOUBLE_EQ(encoder_forward_flops(e), 98304.0 + 3 * 114688.0);
}

TEST(Flops, WhisperAndProjectorsMatchHandFormula) {
  EncoderSpec e;
  e.kind = EncoderKind::kWhisper;
  e.mels = 8;
  e.frames = 8;  // T = 4
  e.hidden = 16;
  e.ffn = 32;
  e.layers = 1;
  // conv1 (k3, 8 frames out): 2·8·(8·3)·16 = 6144; conv2 (k3, stride 2, 4 out): 2·4·(16·3)·16
  // = 6144; block: 2·4·(4·256 + 2·16·32) + 4·16·16 = 16384 + 1024 = 17408.
  EXPECT_DOUBLE_EQ(encoder_forward_flops(e), 6144.0 + 6144.0 + 17408.0);

  LlmSpec llm;
  llm.hidden = 32;
  e.projector.kind = ProjectorKind::kLinear;  // 16 → 32 per token: 2·4·16·32 = 4096
  EXPECT_DOUBLE_EQ(projector_forward_flops(e, llm), 4096.0);
  e.projector.kind = ProjectorKind::kMlp;  // 16 → 32 → 32: 2·4·(16·32 + 32·32) = 12288
  EXPECT_DOUBLE_EQ(projector_forward_flops(e, llm), 12288.0);
}

}  // namespace
}  // namespace weft::plan
