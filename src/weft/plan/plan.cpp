#include "weft/plan/plan.h"

#include <nlohmann/json.hpp>

#include "weft/core/error.h"

namespace weft::plan {

const ModulePlan& Plan::module(const std::string& name) const {
  for (const auto& m : modules)
    if (m.name == name) return m;
  WEFT_FAIL("plan has no module named '", name, "'");
}

namespace {

Layout layout_of(const Spec& spec, const std::string& name) {
  auto it = spec.parallel.modules.find(name);
  if (it == spec.parallel.modules.end()) return {};
  const LayoutSpec& l = it->second;
  return {l.dp, l.tp, l.pp, l.cp};
}

const char* role_name(ModuleRole r) {
  switch (r) {
    case ModuleRole::kEncoder:
      return "encoder";
    case ModuleRole::kProjector:
      return "projector";
    case ModuleRole::kLlm:
      return "llm";
  }
  return "?";
}

}  // namespace

Plan make_plan(const Spec& spec, int64_t world_size) {
  WEFT_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  Plan plan;
  plan.global_batch = spec.train.batch;
  plan.microbatches = spec.train.microbatches;
  bool any_encoder_side_trains = false;
  for (size_t i = 0; i < spec.model.encoders.size(); ++i) {
    const EncoderSpec& e = spec.model.encoders[i];
    ModulePlan enc;
    enc.name = e.name;
    enc.role = ModuleRole::kEncoder;
    enc.encoder = static_cast<int>(i);
    enc.layout = layout_of(spec, e.name);
    enc.frozen = e.frozen;
    enc.weight_grads = !e.frozen;
    enc.input_grads = false;  // inputs are data
    ModulePlan proj;
    proj.name = e.name + ".projector";
    proj.role = ModuleRole::kProjector;
    proj.encoder = static_cast<int>(i);
    proj.layout = enc.layout;
    proj.frozen = e.projector.frozen;
    proj.weight_grads = !e.projector.frozen;
    proj.input_grads = enc.weight_grads;
    any_encoder_side_trains = any_encoder_side_trains || enc.weight_grads || proj.weight_grads;
    plan.modules.push_back(enc);
    plan.modules.push_back(proj);
  }
  ModulePlan llm;
  llm.name = "llm";
  llm.role = ModuleRole::kLlm;
  llm.layout = layout_of(spec, "llm");
  llm.frozen = spec.model.llm.frozen;
  llm.weight_grads = !llm.frozen;
  llm.input_grads = any_encoder_side_trains;
  plan.modules.push_back(llm);

  for (auto& m : plan.modules) {
    const std::string key =
        m.role == ModuleRole::kProjector ? m.name.substr(0, m.name.find('.')) : m.name;
    if (m.layout.size() == 1) m.layout.dp = world_size;  // unset: data parallel over the world
    const Layout& l = m.layout;
    WEFT_CHECK(l.tp == 1 && l.pp == 1 && l.cp == 1, spec.source, ": parallel.", key,
               " = {dp=", l.dp, ", tp=", l.tp, ", pp=", l.pp, ", cp=", l.cp,
               "}: this build executes data parallelism only (tp, pp and cp must be 1)");
    WEFT_CHECK(l.size() == world_size, spec.source, ": parallel.", key, ".dp = ", l.dp,
               ": the job has ", world_size, " rank", world_size == 1 ? "" : "s",
               " and modules are colocated, so dp*tp*pp*cp must equal ", world_size);
  }
  plan.world_size = world_size;
  WEFT_CHECK(spec.train.batch % world_size == 0, spec.source, ": train.batch = ", spec.train.batch,
             ": must be divisible by the data-parallel size ", world_size);
  return plan;
}

std::string to_json(const Plan& plan) {
  nlohmann::ordered_json j;
  j["world_size"] = plan.world_size;
  j["placement"] = plan.placement;
  j["global_batch"] = plan.global_batch;
  j["microbatches"] = plan.microbatches;
  j["schedule"] = plan.schedule;
  j["cp_split"] = plan.cp_split;
  j["balance"] = plan.balance;
  auto& mods = j["modules"] = nlohmann::ordered_json::array();
  for (const auto& m : plan.modules) {
    nlohmann::ordered_json mj;
    mj["name"] = m.name;
    mj["role"] = role_name(m.role);
    mj["layout"] = {
        {"dp", m.layout.dp}, {"tp", m.layout.tp}, {"pp", m.layout.pp}, {"cp", m.layout.cp}};
    mj["ranks"] = {m.first_rank, m.first_rank + m.layout.size()};
    mj["stage_boundaries"] = m.stage_boundaries;
    mj["frozen"] = m.frozen;
    mj["weight_grads"] = m.weight_grads;
    mj["input_grads"] = m.input_grads;
    mods.push_back(mj);
  }
  return j.dump(2);
}

}  // namespace weft::plan
