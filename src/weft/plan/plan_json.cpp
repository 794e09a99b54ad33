// Plan JSON reader (plan.h plan_from_json): to_json's format back into a Plan, checked field by
// field, and against a Spec by rebuilding the Plan with make_plan.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "weft/core/error.h"
#include "weft/plan/balance.h"
#include "weft/plan/plan.h"

namespace weft::plan {

namespace {

using json = nlohmann::json;

std::string show(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// One JSON object being read; every message names the source and the field's path.
class Fields {
 public:
  Fields(const std::string& source, const json& object, std::string path)
      : source_(source), j_(object), path_(std::move(path)) {
    WEFT_CHECK(j_.is_object(), source_, ": ", path_.empty() ? "the plan" : path_, " = ", show(j_),
               ": expected an object");
  }
  std::string at(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  bool has(const std::string& key) const { return j_.contains(key); }
  const json& get(const std::string& key) const {
    auto it = j_.find(key);
    WEFT_CHECK(it != j_.end(), source_, ": ", at(key), ": missing");
    return *it;
  }
  void only(const std::vector<std::string>& keys) const {
    std::string allowed;
    for (const auto& k : keys) allowed += (allowed.empty() ? "" : ", ") + k;
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      bool known = false;
      for (const auto& k : keys) known = known || k == it.key();
      WEFT_CHECK(known, source_, ": ", at(it.key()), ": unknown field (allowed: ", allowed, ")");
    }
  }
  int64_t integer(const std::string& key, int64_t min) const {
    const json& v = get(key);
    WEFT_CHECK(v.is_number_integer() && v.get<int64_t>() >= min, source_, ": ", at(key), " = ",
               show(v), ": expected an integer >= ", min);
    return v.get<int64_t>();
  }
  std::string string(const std::string& key) const {
    const json& v = get(key);
    WEFT_CHECK(v.is_string(), source_, ": ", at(key), " = ", show(v), ": expected a string");
    return v.get<std::string>();
  }
  bool boolean(const std::string& key) const {
    const json& v = get(key);
    WEFT_CHECK(v.is_boolean(), source_, ": ", at(key), " = ", show(v), ": expected true or false");
    return v.get<bool>();
  }
  std::vector<int64_t> integers(const std::string& key) const {
    const json& v = get(key);
    bool ok = v.is_array();
    for (const json& e : v) ok = ok && e.is_number_integer();
    WEFT_CHECK(ok, source_, ": ", at(key), " = ", show(v), ": expected an array of integers");
    return v.get<std::vector<int64_t>>();
  }

 private:
  const std::string& source_;
  const json& j_;
  std::string path_;
};

const char* role_name(ModuleRole r) {
  return r == ModuleRole::kEncoder ? "encoder" : r == ModuleRole::kProjector ? "projector" : "llm";
}

}  // namespace

Plan plan_from_json(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, out_of_range (a number too large)
    WEFT_FAIL(source, ": not valid JSON (", e.what(), ")");
  }
  const Fields top(source, root, "");
  top.only({"world_size", "placement", "global_batch", "microbatches", "schedule", "cp_split",
            "balance", "modules"});
  Plan plan;
  plan.world_size = top.integer("world_size", 1);
  plan.placement = top.string("placement");
  plan.global_batch = top.integer("global_batch", 1);
  plan.microbatches = top.integer("microbatches", 1);
  plan.schedule = top.string("schedule");
  plan.cp_split = top.string("cp_split");
  plan.balance = top.string("balance");
  WEFT_CHECK(plan.schedule == "sequential" || plan.schedule == "1f1b" ||
                 plan.schedule == "interleaved-1f1b",
             source, ": schedule = \"", plan.schedule,
             "\": expected \"sequential\", \"1f1b\" or \"interleaved-1f1b\"");
  const json& modules = top.get("modules");
  WEFT_CHECK(modules.is_array() && !modules.empty(), source, ": modules = ", show(modules),
             ": expected a non-empty array of modules");
  int encoders = 0;
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string at = "modules[" + std::to_string(i) + "]";
    const Fields f(source, modules[i], at);
    f.only({"name", "role", "layout", "ranks", "layers", "stage_boundaries", "frozen",
            "weight_grads", "input_grads"});
    ModulePlan m;
    m.name = f.string("name");
    const std::string role = f.string("role");
    WEFT_CHECK(role == "encoder" || role == "projector" || role == "llm", source, ": ", at,
               ".role = \"", role, "\": expected \"encoder\", \"projector\" or \"llm\"");
    m.role = role == "encoder"     ? ModuleRole::kEncoder
             : role == "projector" ? ModuleRole::kProjector
                                   : ModuleRole::kLlm;
    const bool last = i + 1 == modules.size();
    WEFT_CHECK((m.role == ModuleRole::kLlm) == last, source, ": ", at, ".role = \"", role,
               "\": the LLM is the last module, and only the last");
    if (m.role == ModuleRole::kEncoder) m.encoder = encoders++;
    if (m.role == ModuleRole::kProjector) {
      WEFT_CHECK(i > 0 && plan.modules.back().role == ModuleRole::kEncoder, source, ": ", at,
                 ": a projector follows its encoder");
      m.encoder = plan.modules.back().encoder;
    }
    const Fields l(source, f.get("layout"), at + ".layout");
    l.only({"dp", "tp", "pp", "cp", "ep", "etp", "vp", "sp"});
    m.layout.dp = l.integer("dp", 1);
    m.layout.tp = l.integer("tp", 1);
    m.layout.pp = l.integer("pp", 1);
    m.layout.cp = l.integer("cp", 1);
    if (l.has("ep")) m.layout.ep = l.integer("ep", 1);
    if (l.has("etp")) {  // written resolved (Layout::expert_tp); "= tp" is etp 0
      const int64_t etp = l.integer("etp", 1);
      m.layout.etp = etp == m.layout.tp ? 0 : etp;
    }
    if (l.has("vp")) m.layout.vp = l.integer("vp", 1);
    if (l.has("sp")) m.layout.sp = l.boolean("sp");
    const std::vector<int64_t> ranks = f.integers("ranks");
    WEFT_CHECK(ranks.size() == 2 && ranks[0] >= 0 && ranks[1] - ranks[0] == m.layout.size() &&
                   ranks[1] <= plan.world_size,
               source, ": ", at, ".ranks = ", format_list(ranks),
               ": expected [first, first + dp*tp*pp*cp", " = first + ", m.layout.size(),
               "] within world_size = ", plan.world_size);
    m.first_rank = ranks[0];
    m.layers = f.integer("layers", 0);
    m.stage_boundaries = f.integers("stage_boundaries");
    const bool staged = m.layers > 0 || m.role == ModuleRole::kProjector;
    const int64_t stages = m.layout.stages();
    WEFT_CHECK(
        !staged || static_cast<int64_t>(m.stage_boundaries.size()) == (stages > 1 ? stages - 1 : 0),
        source, ": ", at, ".stage_boundaries = ", format_list(m.stage_boundaries), ": expected ",
        m.layout.vp > 1 ? "pp * vp - 1 = " : "pp - 1 = ", stages - 1, " entries");
    m.frozen = f.boolean("frozen");
    m.weight_grads = f.boolean("weight_grads");
    m.input_grads = f.boolean("input_grads");
    plan.modules.push_back(m);
  }
  return plan;
}

Plan plan_from_json(const std::string& text, const std::string& source, const Spec& spec) {
  const Plan file = plan_from_json(text, source);
  // The modules the spec has, in order: every encoder and its projector, then the LLM.
  std::vector<std::string> names;
  for (const EncoderSpec& e : spec.model.encoders) {
    names.push_back(e.name);
    names.push_back(e.name + ".projector");
  }
  names.push_back("llm");
  std::string expected;
  for (const auto& n : names) expected += (expected.empty() ? "" : ", ") + n;
  WEFT_CHECK(file.modules.size() == names.size(), source, ": modules: ", file.modules.size(),
             " modules, but ", spec.source, " has ", names.size(), " (", expected, ")");
  Spec s = spec;
  s.parallel.placement = file.placement;
  s.parallel.cp_split = file.cp_split;
  s.train.microbatches = file.microbatches;
  WEFT_CHECK(file.global_batch == spec.train.batch, source, ": global_batch = ", file.global_batch,
             ": ", spec.source, " has train.batch = ", spec.train.batch);
  try {
    s.data.balance = to_string(parse_balance_policy(file.balance));
  } catch (const Error& e) {
    WEFT_FAIL(source, ": balance = \"", file.balance, "\": ", e.what());
  }
  for (size_t i = 0; i < names.size(); ++i) {
    const ModulePlan& m = file.modules[i];
    WEFT_CHECK(m.name == names[i], source, ": modules[", i, "].name = \"", m.name,
               "\": ", spec.source, " has \"", names[i], "\" there (modules in order: ", expected,
               ")");
    if (m.role == ModuleRole::kProjector) continue;
    LayoutSpec& l = s.parallel.modules[m.name];
    l = LayoutSpec{};
    l.dp = m.layout.dp, l.tp = m.layout.tp, l.pp = m.layout.pp, l.cp = m.layout.cp;
    l.ep = m.layout.ep;
    l.etp = m.layout.etp;
    l.vp = m.layout.vp;
    l.sp = m.layout.sp;
    l.stages = m.stage_boundaries;
  }
  Plan built;
  try {
    built = make_plan(s, file.world_size);
  } catch (const Error& e) {
    WEFT_FAIL(source, ": the plan does not fit ", spec.source, ": ", e.what());
  }
  const auto mismatch = [&](const std::string& field, const std::string& got,
                            const std::string& want) {
    WEFT_FAIL(source, ": ", field, " = ", got, ": ", spec.source, " gives ", want);
  };
  const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  if (built.schedule != file.schedule)
    mismatch("schedule", "\"" + file.schedule + "\"", "\"" + built.schedule + "\"");
  for (size_t i = 0; i < names.size(); ++i) {
    const ModulePlan &a = file.modules[i], &b = built.modules[i];
    const std::string at = "modules[" + std::to_string(i) + "]";
    if (a.role != b.role)
      mismatch(at + ".role", std::string("\"") + role_name(a.role) + "\"",
               std::string("\"") + role_name(b.role) + "\"");
    if (a.layout.size() != b.layout.size() || a.layout.dp != b.layout.dp ||
        a.layout.tp != b.layout.tp || a.layout.pp != b.layout.pp || a.layout.cp != b.layout.cp ||
        a.layout.ep != b.layout.ep || a.layout.expert_tp() != b.layout.expert_tp() ||
        a.layout.vp != b.layout.vp) {
      const auto show = [](const Layout& l) {
        return "{dp " + std::to_string(l.dp) + ", tp " + std::to_string(l.tp) + ", pp " +
               std::to_string(l.pp) + ", cp " + std::to_string(l.cp) +
               (l.vp > 1 ? ", vp " + std::to_string(l.vp) : "") + "}";
      };
      mismatch(at + ".layout", show(a.layout),
               show(b.layout) + " (a projector takes its encoder's)");
    }
    if (a.first_rank != b.first_rank)
      mismatch(at + ".ranks", format_list({a.first_rank, a.first_rank + a.layout.size()}),
               format_list({b.first_rank, b.first_rank + b.layout.size()}) + " (placement \"" +
                   file.placement + "\")");
    if (a.layers != b.layers)
      mismatch(at + ".layers", std::to_string(a.layers), std::to_string(b.layers));
    if (a.stage_boundaries != b.stage_boundaries)
      mismatch(at + ".stage_boundaries", format_list(a.stage_boundaries),
               format_list(b.stage_boundaries) + " (a projector takes its encoder's)");
    if (a.frozen != b.frozen) mismatch(at + ".frozen", flag(a.frozen), flag(b.frozen));
    if (a.weight_grads != b.weight_grads)
      mismatch(at + ".weight_grads", flag(a.weight_grads), flag(b.weight_grads));
    if (a.input_grads != b.input_grads)
      mismatch(at + ".input_grads", flag(a.input_grads), flag(b.input_grads));
  }
  return built;
}

}  // namespace weft::plan
