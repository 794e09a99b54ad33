// The search's building blocks that turn a Candidate into a config, a Plan, costs and a
// simulation (search.h), and back into text: describe, the TOML snippet, --set overrides.
#include <algorithm>
#include <functional>
#include <sstream>

#include "weft/core/error.h"
#include "weft/plan/partition.h"
#include "weft/plan/profile.h"
#include "weft/plan/search.h"

namespace weft::plan {

namespace {

std::vector<std::string> module_names(const Spec& spec) {
  std::vector<std::string> names;
  for (const EncoderSpec& e : spec.model.encoders) names.push_back(e.name);
  names.push_back("llm");
  return names;
}

void check_shape(const Spec& spec, const Candidate& c) {
  WEFT_CHECK(
      c.layouts.size() == spec.model.encoders.size() + 1 && c.recompute.size() == c.layouts.size(),
      "[search] a candidate needs one layout and one recompute flag per encoder and the "
      "LLM (",
      spec.model.encoders.size() + 1, "), got ", c.layouts.size(), " and ", c.recompute.size());
  WEFT_CHECK(c.recompute_blocks.empty() || c.recompute_blocks.size() == c.layouts.size(),
             "[search] a candidate's recompute_blocks: none or one per module (", c.layouts.size(),
             "), got ", c.recompute_blocks.size());
  for (size_t k = 0; k < c.recompute_blocks.size(); ++k) {
    const std::vector<int64_t>& v = c.recompute_blocks[k];
    WEFT_CHECK(v.size() <= 1 || static_cast<int64_t>(v.size()) == c.layouts[k].pp,
               "[search] a candidate's recompute_blocks: none, one, or one per pipeline stage (",
               c.layouts[k].pp, "), got ", recompute_blocks_text(v));
    for (int64_t b : v)
      WEFT_CHECK(b >= 0, "[search] a candidate's recompute_blocks must be >= 0, got ",
                 recompute_blocks_text(v));
  }
  WEFT_CHECK(c.placement == "colocated" || c.placement == "separate" || c.placement == "megatron",
             "[search] unknown placement \"", c.placement,
             "\" (expected colocated, separate or megatron)");
}

// Candidate c's recompute_blocks of module k (empty: every block).
std::vector<int64_t> candidate_blocks(const Candidate& c, size_t k) {
  if (k < c.recompute_blocks.size() && c.recompute[k]) return c.recompute_blocks[k];
  return {};
}

}  // namespace

void add_recompute_costs(const Spec& spec, const ModulePlan& m, std::vector<StageCost>* stages,
                         const std::vector<int64_t>& blocks, const DataShape& data) {
  const MicrobatchShape unit = single_sample_microbatch(spec, data, m.encoder);  // as stage_costs
  const ModuleCosts costs = sample_costs(spec, m, data);
  const double act = spec.train.precision == Precision::kBf16 ? 2.0 : 4.0;
  double input_bytes = 0;  // what a recomputed block keeps: its input, tokens × width
  if (m.role == ModuleRole::kLlm) {
    input_bytes = act * unit.llm.tokens * static_cast<double>(spec.model.llm.hidden);
  } else {
    const EncoderSpec& e = spec.model.encoders[static_cast<size_t>(m.encoder)];
    input_bytes = act * unit.items * static_cast<double>(e.tokens_per_item() * e.hidden);
  }
  for (int64_t s = 0; s < static_cast<int64_t>(stages->size()); ++s) {
    const auto [begin, end] = m.stage_layers(s);
    StageCost& sc = (*stages)[static_cast<size_t>(s)];
    for (int64_t b = begin; b < end && recomputes_block(true, blocks, s, b - begin); ++b) {
      const LayerCost& l = costs.blocks[static_cast<size_t>(b)];
      if (l.activation_bytes <= 0) continue;  // runs no backward: nothing to recompute
      sc.backward_flops += l.forward;         // the block's forward once more, in backward
      sc.recompute_flops += l.forward;
      sc.recompute = true;
      ++sc.recompute_blocks;
      if (m.role == ModuleRole::kLlm && spec.model.llm.moe.is_moe_layer(b))
        ++sc.recompute_moe_blocks;
      const double kept = std::min(l.activation_bytes, input_bytes);
      const double dropped = l.activation_bytes - kept;
      sc.activation_bytes -= dropped;
      // Of what it keeps, its input is whole on each TP rank, but under sequence parallelism.
      const bool sp = m.layout.sequence_parallel();
      const double dropped_whole =
          std::clamp((sp ? l.sp_whole_bytes : l.tp_whole_bytes - kept), 0.0, dropped);
      sc.whole_activation_bytes -= dropped_whole;
      if (dropped > sc.recompute_peak_bytes) {
        sc.recompute_peak_bytes = dropped;
        sc.recompute_peak_whole_bytes = dropped_whole;
      }
      sc.copy_bytes -= l.copy_bytes;  // cast at each use, in forward and again in backward
      sc.expert_copy_bytes -= l.expert_copy_bytes;
      sc.trained_cast_bytes -= l.trained_cast_bytes;
      sc.expert_trained_cast_bytes -= l.expert_trained_cast_bytes;
    }
  }
}

CostTable planner_costs(const Spec& spec_in, const Plan& plan, const SimOptions& options) {
  Spec spec = spec_in;
  if (spec.model.llm.vocab == 0) spec.model.llm.vocab = options.unset_vocab;
  // Time on the data's mean sample, activation memory on its peak (DataShape).
  const auto priced = [&](const DataShape& data) {
    CostTable table = stage_costs(spec, plan, data);
    for (size_t i = 0; i < plan.modules.size(); ++i) {
      const ModulePlan& m = plan.modules[i];
      if (m.role == ModuleRole::kProjector) continue;
      const bool llm = m.role == ModuleRole::kLlm;
      const EncoderSpec* e = llm ? nullptr : &spec.model.encoders[static_cast<size_t>(m.encoder)];
      if (llm ? spec.model.llm.recompute : e->recompute)
        add_recompute_costs(spec, m, &table[i],
                            llm ? spec.model.llm.recompute_blocks : e->recompute_blocks, data);
    }
    return table;
  };
  CostTable table = priced(options.data.mean());
  if (options.data.distinct_peak()) take_activation_bytes(&table, priced(options.data.peak()));
  return table;
}

Spec apply_candidate(const Spec& spec_in, const Candidate& c) {
  check_shape(spec_in, c);
  Spec spec = spec_in;
  const bool megatron = c.placement == "megatron";
  spec.parallel.placement = megatron ? "colocated" : c.placement;
  const auto names = module_names(spec);
  for (size_t k = 0; k < names.size(); ++k) {
    LayoutSpec l = c.layouts[k];
    if (megatron && k + 1 < names.size()) {  // make_plan's colocated stand-in (candidate_plan)
      l.dp = c.world_size / l.tp;
      l.stages.clear();
    }
    spec.parallel.modules[names[k]] = l;
    if (k + 1 < names.size()) {
      spec.model.encoders[k].recompute = c.recompute[k];
      spec.model.encoders[k].recompute_blocks = candidate_blocks(c, k);
    } else {
      spec.model.llm.recompute = c.recompute[k];
      spec.model.llm.recompute_blocks = candidate_blocks(c, k);
    }
  }
  spec.train.microbatches = c.microbatches;
  spec.train.zero_stage = c.zero_stage;
  return spec;
}

Plan candidate_plan(const Spec& spec, const Candidate& c) {
  Plan plan = make_plan(apply_candidate(spec, c), c.world_size);
  if (c.placement != "megatron") return plan;
  // Every encoder (and its projector) on the ranks of the LLM's first stage: [0, tp·cp·dp).
  for (ModulePlan& m : plan.modules) {
    if (m.role == ModuleRole::kLlm) continue;
    const LayoutSpec& l = c.layouts[static_cast<size_t>(m.encoder)];
    m.layout = Layout{};
    m.layout.dp = l.dp;
    m.layout.tp = l.tp;
    m.first_rank = 0;
    m.stage_boundaries.clear();
  }
  return plan;
}

Evaluation evaluate(const Spec& spec, const Cluster& cluster, const Candidate& c,
                    const SimOptions& options, const Profile* profile) {
  Evaluation e;
  e.candidate = c;
  e.plan = candidate_plan(spec, c);
  const Spec applied = apply_candidate(spec, c);
  SimOptions o = options;
  o.trace = false;
  e.sim = profile ? simulate(applied, e.plan, cluster, *profile, o)
                  : simulate(applied, e.plan, cluster, planner_costs(applied, e.plan, o), o);
  return e;
}

namespace {
// Per pipeline stage of module m, its longest chunk's blocks.
std::vector<int64_t> stage_blocks(const ModulePlan& m) {
  return longest_chunks(m.stage_boundaries, m.layers, m.layout.pp);
}

}  // namespace

Evaluation refine_recompute(const Spec& spec, const Cluster& cluster, Evaluation e,
                            const SimOptions& options, int64_t* simulations,
                            const Profile* profile) {
  const auto names = module_names(spec);
  const auto simulate_one = [&](const Candidate& c) {
    if (simulations) ++*simulations;
    return evaluate(spec, cluster, c, options, profile);
  };
  // Too few blocks for the simulated peak (counts fitted by a bound): one more on each stage
  // whose ranks are over memory, of each module recomputing per stage, until it fits or no such
  // stage has a block left to recompute.
  if (!e.sim.memory_fits) {
    Evaluation raised = e;
    while (!raised.sim.memory_fits) {
      Candidate c = raised.candidate;
      bool more = false;
      for (size_t k = 0; k < names.size() && k < c.recompute_blocks.size(); ++k) {
        std::vector<int64_t>& now = c.recompute_blocks[k];
        if (!c.recompute[k] || now.size() < 2) continue;
        const std::vector<int64_t> most = stage_blocks(raised.plan.module(names[k]));
        const std::vector<double> peak =
            stage_peak_bytes(raised.sim, names[k], static_cast<int64_t>(most.size()));
        for (size_t s = 0; s < now.size() && s < most.size(); ++s)
          if (peak[s] > cluster.device.usable_memory_bytes() && now[s] < most[s])
            ++now[s], more = true;
        if (now == most) now.clear();  // every block
      }
      if (!more) return e;
      raised = simulate_one(c);
      raised.lower_bound = e.lower_bound;
    }
    e = std::move(raised);
  }
  Candidate c = e.candidate;
  if (c.recompute_blocks.empty()) c.recompute_blocks.resize(c.layouts.size());
  bool changed = false;
  for (size_t k = 0; k < names.size(); ++k) {
    if (!c.recompute[k]) continue;
    const std::vector<int64_t> most = stage_blocks(e.plan.module(names[k]));
    const std::vector<int64_t> was = c.recompute_blocks[k];
    std::vector<int64_t> now(most.size());
    for (size_t s = 0; s < most.size(); ++s)
      now[s] = std::min(recomputed_blocks(true, was, static_cast<int64_t>(s)), most[s]);
    for (size_t s = 0; s < most.size(); ++s) {
      int64_t lo = 0, hi = now[s];
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        std::vector<int64_t> trial = now;
        trial[s] = mid;
        Candidate t = c;
        t.recompute[k] = *std::max_element(trial.begin(), trial.end()) > 0;
        t.recompute_blocks[k] = t.recompute[k] ? trial : std::vector<int64_t>{};
        if (simulate_one(t).sim.memory_fits)
          hi = mid;
        else
          lo = mid + 1;
      }
      now[s] = lo;
    }
    if (now == most) continue;  // every block still: as it was
    c.recompute[k] = *std::max_element(now.begin(), now.end()) > 0;
    if (std::adjacent_find(now.begin(), now.end(), std::not_equal_to<>()) == now.end())
      now.resize(1);  // one count for every stage
    c.recompute_blocks[k] = c.recompute[k] ? now : std::vector<int64_t>{};
    changed =
        changed || !c.recompute[k] || candidate_blocks(c, k) != candidate_blocks(e.candidate, k);
  }
  if (!changed) return e;
  Evaluation r = simulate_one(c);
  if (!r.sim.memory_fits || r.sim.step_seconds > e.sim.step_seconds) return e;
  r.lower_bound = std::min(e.lower_bound, r.sim.step_seconds);
  return r;
}

std::string describe(const Spec& spec, const Candidate& c) {
  check_shape(spec, c);
  const auto names = module_names(spec);
  std::ostringstream os;
  os << c.placement;
  for (size_t k = 0; k < names.size(); ++k) {
    const LayoutSpec& l = c.layouts[k];
    os << " | " << names[k] << " tp" << l.tp;
    if (l.sp && l.tp > 1) os << " sp";
    if (l.cp > 1) os << " cp" << l.cp;
    if (l.ep > 1) os << " ep" << l.ep;
    if (l.etp > 0) os << " etp" << l.etp;
    os << " pp" << l.pp;
    if (l.vp > 1) os << " vp" << l.vp;
    os << " dp" << l.dp;
  }
  os << " | mb " << c.microbatches;
  if (c.zero_stage > 0) os << " zero" << c.zero_stage;
  std::string rc;
  for (size_t k = 0; k < names.size(); ++k) {
    if (!c.recompute[k]) continue;
    rc += (rc.empty() ? "" : ",") + names[k];
    const std::vector<int64_t> blocks = candidate_blocks(c, k);
    if (blocks.empty()) continue;
    std::string text = recompute_blocks_text(blocks, "/");
    const LayoutSpec& l = c.layouts[k];
    if (blocks.size() > 1 && l.vp <= 1 && l.stages.size() + 1 == blocks.size()) {
      // Per stage, of how many blocks (the search may move the boundaries with the counts).
      const int64_t layers =
          k < spec.model.encoders.size() ? spec.model.encoders[k].layers : spec.model.llm.layers;
      const std::vector<int64_t> sizes =
          longest_chunks(l.stages, layers, static_cast<int64_t>(blocks.size()));
      text.pop_back();
      text += " of " + format_list(sizes, "/").substr(1);
    }
    rc += ":" + text;
  }
  if (!rc.empty()) os << " recompute " << rc;
  return os.str();
}

std::vector<std::string> config_overrides(const Spec& spec, const Candidate& c) {
  check_shape(spec, c);
  WEFT_CHECK(c.placement != "megatron",
             "[search] the megatron baseline puts encoders on the LLM's first-stage ranks, which "
             "no config can express");
  std::vector<std::string> out = {"parallel.placement=" + c.placement};
  const auto names = module_names(spec);
  for (size_t k = 0; k < names.size(); ++k) {
    const LayoutSpec& l = c.layouts[k];
    const std::string p = "parallel." + names[k] + ".";
    out.push_back(p + "dp=" + std::to_string(l.dp));
    out.push_back(p + "tp=" + std::to_string(l.tp));
    out.push_back(p + "pp=" + std::to_string(l.pp));
    out.push_back(p + "cp=" + std::to_string(l.cp));
    if (l.ep > 1) out.push_back(p + "ep=" + std::to_string(l.ep));
    if (l.etp > 0) out.push_back(p + "etp=" + std::to_string(l.etp));
    if (l.sp) out.push_back(p + "sp=true");
    out.push_back(p + "vp=" + std::to_string(l.vp));  // always: the config may set another
    out.push_back(p + "stages=" + format_list(l.stages, ","));
  }
  out.push_back("train.microbatches=" + std::to_string(c.microbatches));
  out.push_back("train.zero_stage=" + std::to_string(c.zero_stage));
  for (size_t k = 0; k < names.size(); ++k) {
    out.push_back("model." + names[k] + ".recompute=" + (c.recompute[k] ? "true" : "false"));
    out.push_back("model." + names[k] + ".recompute_blocks=" +  // always: as vp
                  recompute_blocks_text(candidate_blocks(c, k), ","));
  }
  return out;
}

std::string config_snippet(const Spec& spec, const Candidate& c) {
  config_overrides(spec, c);  // the same checks
  const auto names = module_names(spec);
  std::ostringstream os;
  os << "[parallel]\nplacement = \"" << c.placement << "\"\n";
  for (size_t k = 0; k < names.size(); ++k) {
    const LayoutSpec& l = c.layouts[k];
    os << "\n[parallel." << names[k] << "]\ndp = " << l.dp << "\ntp = " << l.tp << "\npp = " << l.pp
       << "\ncp = " << l.cp << "\n";
    if (l.ep > 1) os << "ep = " << l.ep << "\n";
    if (l.etp > 0) os << "etp = " << l.etp << "\n";
    if (l.sp) os << "sp = true\n";
    os << "vp = " << l.vp << "\n";
    os << "stages = " << format_list(l.stages) << "\n";
  }
  os << "\n[train]\nmicrobatches = " << c.microbatches << "\nzero_stage = " << c.zero_stage << "\n";
  for (size_t k = 0; k < names.size(); ++k)
    os << "\n[model." << names[k] << "]\nrecompute = " << (c.recompute[k] ? "true" : "false")
       << "\nrecompute_blocks = " << recompute_blocks_text(candidate_blocks(c, k)) << "\n";
  return os.str();
}

}  // namespace weft::plan
