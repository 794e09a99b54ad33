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

Plan make_plan(const Spec& spec) {
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

  for (const auto& m : plan.modules) {
    const std::string key =
        m.role == ModuleRole::kProjector ? m.name.substr(0, m.name.find('.')) : m.name;
    WEFT_CHECK(m.layout.size() == 1, spec.source, ": parallel.", key, " = {dp=", m.layout.dp,
               ", tp=", m.layout.tp, ", pp=", m.layout.pp, ", cp=", m.layout.cp,
               "}: this build runs single-process layouts only (every size 1); the distributed "
               "runtime is not available yet");
  }
  plan.world_size = 1;
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
