#include "weft/plan/plan.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "weft/core/error.h"
#include "weft/plan/balance.h"
#include "weft/plan/partition.h"
#include "weft/plan/profile.h"

namespace weft::plan {

const ModulePlan& Plan::module(const std::string& name) const {
  for (const auto& m : modules)
    if (m.name == name) return m;
  WEFT_FAIL("plan has no module named '", name, "'");
}

Coord ModulePlan::coord(int64_t rank) const {
  WEFT_ASSERT(hosts(rank), "rank ", rank, " is not a rank of module ", name);
  int64_t r = rank - first_rank;
  Coord c;
  c.tp = r % layout.tp, r /= layout.tp;
  c.cp = r % layout.cp, r /= layout.cp;
  c.dp = r % layout.dp, c.pp = r / layout.dp;
  return c;
}

int64_t ModulePlan::rank_of(const Coord& c) const {
  WEFT_ASSERT(c.tp >= 0 && c.tp < layout.tp && c.cp >= 0 && c.cp < layout.cp && c.dp >= 0 &&
                  c.dp < layout.dp && c.pp >= 0 && c.pp < layout.pp,
              "coordinate outside the grid of module ", name);
  return first_rank + c.tp + layout.tp * (c.cp + layout.cp * (c.dp + layout.dp * c.pp));
}

namespace {

// Ranks of the grid box lo <= coordinate < hi (indexed by Axis), ascending.
std::vector<int64_t> box(const ModulePlan& m, const int64_t (&lo)[4], const int64_t (&hi)[4]) {
  std::vector<int64_t> ranks;
  for (int64_t pp = lo[3]; pp < hi[3]; ++pp)
    for (int64_t dp = lo[2]; dp < hi[2]; ++dp)
      for (int64_t cp = lo[1]; cp < hi[1]; ++cp)
        for (int64_t tp = lo[0]; tp < hi[0]; ++tp) ranks.push_back(m.rank_of({tp, cp, dp, pp}));
  return ranks;
}

}  // namespace

std::vector<int64_t> ModulePlan::group(int64_t rank, std::initializer_list<Axis> axes) const {
  const Coord c = coord(rank);
  const int64_t size[4] = {layout.tp, layout.cp, layout.dp, layout.pp};
  int64_t lo[4] = {c.tp, c.cp, c.dp, c.pp}, hi[4];
  for (int i = 0; i < 4; ++i) hi[i] = lo[i] + 1;
  for (Axis a : axes)
    lo[static_cast<int>(a)] = 0, hi[static_cast<int>(a)] = size[static_cast<int>(a)];
  return box(*this, lo, hi);
}

std::vector<std::vector<int64_t>> ModulePlan::groups(std::initializer_list<Axis> axes) const {
  // One group per grid point whose coordinates along `axes` are 0 (the group's first rank).
  int64_t lo[4] = {0, 0, 0, 0}, hi[4] = {layout.tp, layout.cp, layout.dp, layout.pp};
  for (Axis a : axes) hi[static_cast<int>(a)] = 1;
  std::vector<std::vector<int64_t>> out;
  for (int64_t first : box(*this, lo, hi)) out.push_back(group(first, axes));
  return out;
}

std::vector<std::vector<int64_t>> ModulePlan::expert_groups(bool data_parallel) const {
  const int64_t etp = layout.expert_tp(), slices = layout.tp / etp;
  const int64_t n = slices * layout.cp * layout.dp, ep = layout.ep;
  std::vector<std::vector<int64_t>> out;
  for (int64_t pp = 0; pp < layout.pp; ++pp)
    for (int64_t r = 0; r < etp; ++r)  // expert-TP rank
      for (int64_t g = 0; g < (data_parallel ? ep : n / ep); ++g) {
        std::vector<int64_t> ranks;
        for (int64_t j = 0; j < (data_parallel ? n / ep : ep); ++j) {
          const int64_t i = data_parallel ? g + j * ep : g * ep + j;  // token index
          const int64_t rest = i / slices;
          ranks.push_back(
              rank_of({(i % slices) * etp + r, rest % layout.cp, rest / layout.cp, pp}));
        }
        std::sort(ranks.begin(), ranks.end());
        out.push_back(ranks);
      }
  std::sort(out.begin(), out.end());
  return out;
}

std::pair<int64_t, int64_t> ModulePlan::stage_layers(int64_t stage) const {
  const int64_t n = layout.stages();
  WEFT_ASSERT(stage >= 0 && stage < n, "stage ", stage, " of module ", name);
  if (layers == 0) return {0, 0};
  const auto& b = stage_boundaries;
  WEFT_ASSERT(static_cast<int64_t>(b.size()) == n - 1, "stage boundaries of ", name);
  return {stage == 0 ? 0 : b[stage - 1], stage == n - 1 ? layers : b[stage]};
}

std::vector<int64_t> longest_chunks(const std::vector<int64_t>& boundaries, int64_t layers,
                                    int64_t pp) {
  std::vector<int64_t> most(static_cast<size_t>(pp), 0);
  int64_t begin = 0;
  for (size_t v = 0; v <= boundaries.size(); ++v) {
    const int64_t end = v < boundaries.size() ? boundaries[v] : layers;
    int64_t& m = most[v % most.size()];
    m = std::max(m, end - begin);
    begin = end;
  }
  return most;
}

std::vector<PipelineOp> pipeline_schedule(int64_t pp, int64_t vp, int64_t M, int64_t s,
                                          bool backward) {
  WEFT_ASSERT(pp >= 1 && vp >= 1 && M >= 1 && s >= 0 && s < pp, "pipeline_schedule(", pp, ", ", vp,
              ", ", M, ", ", s, ")");
  std::vector<PipelineOp> ops;
  if (vp == 1) {
    const int64_t warmup = backward ? std::min(pp - 1 - s, M) : M;
    int64_t nf = 0, nb = 0;
    while (nf < warmup) ops.push_back({true, nf++, 0});
    while (nf < M) {
      ops.push_back({true, nf++, 0});
      ops.push_back({false, nb++, 0});
    }
    while (nb < M && backward) ops.push_back({false, nb++, 0});
    return ops;
  }
  // Groups of at least pp microbatches (max(1, M / pp) groups, their sizes differing by at most
  // one, the larger first): a microbatch's next chunk is never waited for while the group's
  // others pass the ring. The k-th forward (backward) takes them through chunk 0, 1, ... (vp - 1,
  // vp - 2, ...), group by group.
  std::vector<PipelineOp> order;  // the forwards, in order
  const int64_t groups = std::max<int64_t>(1, M / pp);
  const int64_t first_group = M / groups + (M % groups != 0 ? 1 : 0);
  for (int64_t g = 0, begin = 0; g < groups; ++g) {
    const int64_t size = M / groups + (g < M % groups ? 1 : 0);
    for (int64_t chunk = 0; chunk < vp; ++chunk)
      for (int64_t mb = begin; mb < begin + size; ++mb) order.push_back({true, mb, chunk});
    begin += size;
  }
  const int64_t total = M * vp;
  const auto op = [&](bool forward, int64_t k) {
    const PipelineOp& f = order[static_cast<size_t>(k)];
    return PipelineOp{forward, f.microbatch, forward ? f.chunk : vp - 1 - f.chunk};
  };
  const int64_t warmup =
      !backward || M <= pp ? total : std::min(total, 2 * (pp - 1 - s) + (vp - 1) * first_group);
  for (int64_t k = 0; k < warmup; ++k) ops.push_back(op(true, k));
  for (int64_t k = 0; k + warmup < total; ++k) {
    ops.push_back(op(true, k + warmup));
    if (backward) ops.push_back(op(false, k));
  }
  if (backward)
    for (int64_t k = std::max<int64_t>(0, total - warmup); k < total; ++k)
      ops.push_back(op(false, k));
  return ops;
}

std::vector<std::vector<PipelineOp>> pipeline_schedules(int64_t pp, int64_t vp, int64_t M,
                                                        bool backward) {
  std::vector<std::vector<PipelineOp>> ops;
  for (int64_t s = 0; s < pp; ++s) ops.push_back(pipeline_schedule(pp, vp, M, s, backward));
  return ops;
}

namespace {

// Checks a module's layout against its model shape and fills its stage boundaries.
void check_layout(const Spec& spec, const std::vector<int64_t>& stages, ModulePlan* m) {
  const Layout& l = m->layout;
  const std::string at = spec.source + ": parallel." + m->name + ".";
  const std::pair<const char*, int64_t> sizes[] = {
      {"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}, {"cp", l.cp}, {"ep", l.ep}};
  for (const auto& [key, v] : sizes) WEFT_CHECK(v >= 1, at, key, " = ", v, ": must be >= 1");
  WEFT_CHECK(!l.sp || l.tp > 1, at, "sp = true: sequence parallelism splits the tokens over the ",
             "tensor-parallel ranks, so it needs tp > 1 (tp = ", l.tp, ")");
  const auto divides = [&](const std::string& field, int64_t n) {
    WEFT_CHECK(n % l.tp == 0, at, "tp = ", l.tp, ": must divide ", field, " = ", n);
  };
  std::string blocks;  // where `layers` comes from, for messages
  if (m->role == ModuleRole::kLlm) {
    const LlmSpec& x = spec.model.llm;
    divides("model.llm.heads", x.heads);
    divides("model.llm.kv_heads", x.kv_heads);
    divides("model.llm.ffn", x.ffn);
    if (x.vocab > 0) divides("model.llm.vocab", x.vocab);
    const int64_t etp = l.expert_tp();
    WEFT_CHECK(etp == 1 || etp == l.tp, at, "etp = ", etp, ": must be 1 (whole experts, ",
               "tokens split over tp) or tp = ", l.tp, " (experts split like the dense MLP)");
    if (x.moe.enabled()) {
      WEFT_CHECK(x.expert_ffn() % etp == 0, at, "etp = ", etp,
                 ": must divide the expert width (model.llm.moe.ffn, or model.llm.ffn when 0) = ",
                 x.expert_ffn());
      if (x.moe.shared_ffn > 0) divides("model.llm.moe.shared_ffn", x.moe.shared_ffn);
      WEFT_CHECK(x.moe.experts % l.ep == 0, at, "ep = ", l.ep,
                 ": must divide model.llm.moe.experts = ", x.moe.experts,
                 " (every expert-parallel rank holds the same number of experts)");
    }
    WEFT_CHECK(l.ep == 1 || x.moe.enabled(), at, "ep = ", l.ep,
               ": expert parallelism needs a mixture-of-experts LLM ([model.llm.moe] experts)");
    if (etp == l.tp)
      WEFT_CHECK((l.cp * l.dp) % l.ep == 0, at, "ep = ", l.ep, ": must divide cp * dp = ", l.cp,
                 " * ", l.dp, " = ", l.cp * l.dp,
                 " (with etp = tp, expert-parallel ranks are data- or context-parallel ranks of "
                 "the same tp rank and pipeline stage)");
    else
      WEFT_CHECK((l.tp * l.cp * l.dp) % l.ep == 0, at, "ep = ", l.ep,
                 ": must divide tp * cp * dp = ", l.tp * l.cp * l.dp,
                 " (with etp = 1, expert-parallel ranks are any ranks of a pipeline stage)");
    blocks = "model.llm.layers = " + std::to_string(x.layers);
  } else {
    const EncoderSpec& e = spec.model.encoders[m->encoder];
    const std::string model = "model." + e.name;
    WEFT_CHECK(l.ep == 1 && l.etp == 0, at,
               l.ep != 1 ? "ep = " : "etp = ", l.ep != 1 ? l.ep : l.etp,
               ": expert parallelism applies to a mixture-of-experts LLM only (", model,
               " is an encoder)");
    divides(model + ".heads", e.heads);
    divides(model + ".ffn", e.ffn);
    if (e.projector.kind == ProjectorKind::kMlp)
      divides("model.llm.hidden (the inner width of the mlp projector)", spec.model.llm.hidden);
    WEFT_CHECK(l.cp == 1 || !e.class_token, at, "cp = ", l.cp, ": model.", e.name,
               " has a [CLS] token (class_token = true); context parallelism over its tokens is "
               "not supported, use dp or tp");
    WEFT_CHECK(e.tokens_per_item() % l.cp == 0, at, "cp = ", l.cp, ": must divide the ",
               e.tokens_per_item(), " tokens of each ", e.name,
               " item (context parallelism splits every item's tokens evenly)");
    WEFT_CHECK(!l.sequence_parallel() || e.splits_evenly(l.cp * l.tp), at,
               "sp = true: cp * tp = ", l.cp * l.tp, " must divide the ", e.block_tokens(),
               " tokens each ", e.name, " block runs on",
               e.class_token ? " (its patches and the [CLS] token)" : "",
               " (sequence parallelism splits every item's tokens evenly over tp)");
    blocks = model + ".layers = " + std::to_string(e.layers) +
             " with feature_layer = " + std::to_string(e.feature_layer) + " runs " +
             std::to_string(m->layers) + " blocks";
  }
  WEFT_CHECK(l.pp <= m->layers, at, "pp = ", l.pp, ": more pipeline stages than blocks (", blocks,
             ")");
  if (l.vp != 1) {
    WEFT_CHECK(l.vp >= 1, at, "vp = ", l.vp, ": must be >= 1");
    WEFT_CHECK(m->role == ModuleRole::kLlm, at, "vp = ", l.vp,
               ": virtual pipeline stages (interleaved 1F1B) apply to the LLM only");
    WEFT_CHECK(l.pp > 1, at, "vp = ", l.vp,
               ": virtual pipeline stages interleave the chunks of pipeline ranks, so they need "
               "pp > 1 (pp = ",
               l.pp, ")");
    WEFT_CHECK(l.stages() <= m->layers, at, "vp = ", l.vp, ": pp * vp = ", l.pp, " * ", l.vp, " = ",
               l.stages(), " virtual stages, more than blocks (", blocks, ")");
  }
  if (m->role != ModuleRole::kProjector) {
    const std::vector<int64_t>& rb = m->role == ModuleRole::kLlm
                                         ? spec.model.llm.recompute_blocks
                                         : spec.model.encoders[m->encoder].recompute_blocks;
    WEFT_CHECK(rb.size() <= 1 || static_cast<int64_t>(rb.size()) == l.pp, spec.source, ": model.",
               m->name, ".recompute_blocks = ", recompute_blocks_text(rb),
               ": needs one count per pipeline stage of parallel.", m->name, " (pp = ", l.pp,
               ") or one for every stage, got ", rb.size());
  }
  m->stage_boundaries.clear();
  if (stages.empty()) return;  // chosen by choose_boundaries once every layout is known
  const int64_t want = l.stages() - 1;
  WEFT_CHECK(static_cast<int64_t>(stages.size()) == want, at, "stages = ", format_list(stages),
             ": needs ", l.vp > 1 ? "pp * vp - 1 = " : "pp - 1 = ", want,
             " entries (the first block of each stage after the first), got ", stages.size());
  for (size_t i = 0; i < stages.size(); ++i)
    WEFT_CHECK(
        stages[i] >= 1 && stages[i] <= m->layers - 1 && (i == 0 || stages[i] > stages[i - 1]), at,
        "stages = ", format_list(stages), ": must be strictly increasing block indices in [1, ",
        m->layers - 1, "] (", blocks, ")");
  m->stage_boundaries = stages;
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

const LayoutSpec& layout_spec(const Spec& spec, const std::string& name) {
  static const LayoutSpec kUnset;
  auto it = spec.parallel.modules.find(name);
  return it == spec.parallel.modules.end() ? kUnset : it->second;
}

Layout layout_of(const Spec& spec, const std::string& name) {
  const LayoutSpec& l = layout_spec(spec, name);
  return {l.dp, l.tp, l.pp, l.cp, l.ep, l.etp, l.sp, l.vp};
}

// A layer's activations on one rank of `layout`, `c` holding 1/(tp·cp) of them: each TP rank
// keeps the whole of the part the FLOP model's `flop` says it does (LayerCost::tp_whole_bytes /
// sp_whole_bytes), which is then divided over cp only (simulate.h kept_activation_bytes).
void keep_whole(LayerCost* c, const LayerCost& flop, const Layout& layout) {
  if (flop.activation_bytes <= 0) return;
  const double whole = layout.sequence_parallel() ? flop.sp_whole_bytes : flop.tp_whole_bytes;
  const double share = std::min(whole / flop.activation_bytes, 1.0);
  c->activation_bytes *= 1 + share * static_cast<double>(layout.tp - 1);
}

// FLOP-model costs of module m for the microbatch one of its ranks runs: `samples` samples of
// `data` (without a shape: max_seq rows, one item each for an encoder), work and activations
// divided over tp × cp, parameters over tp (an MoE block's experts over ep · etp), but an encoder's
// front end, which every TP and CP rank runs whole on its whole parameters.
ModuleCosts flop_costs(const Spec& spec, const ModulePlan& m, double samples,
                       const DataShape& data) {
  ModuleCosts c = sample_costs(spec, m, data);
  const double work = samples / static_cast<double>(m.layout.tp * m.layout.cp);
  const double params = 1.0 / static_cast<double>(m.layout.tp);
  const auto scale = [&](LayerCost& l, double work, double params) {
    const LayerCost flop = l;
    l.activation_bytes *= work;
    keep_whole(&l, flop, m.layout);
    l.forward *= work, l.input_grad *= work, l.weight_grad *= work;
    l.param_bytes *= params, l.train_state_bytes *= params, l.copy_bytes *= params;
    l.trained_cast_bytes *= params, l.expert_trained_cast_bytes *= params;
    l.expert_param_bytes *= params, l.expert_train_state_bytes *= params;
    l.expert_copy_bytes *= params;
    shard_experts(&l, m.layout);
  };
  if (m.role == ModuleRole::kEncoder)
    scale(c.front, samples, 1);
  else
    scale(c.front, work, params);
  for (LayerCost& l : c.blocks) scale(l, work, params);
  scale(c.back, work, params);
  return c;
}

// The default stage boundaries of every pipelined module without parallel.<m>.stages: the joint
// partition (partition.h) of what one rank of each module does per LLM microbatch — its share of
// the global microbatch's samples over its data-parallel ranks.
void choose_boundaries(const Spec& spec, const Profile* profile, const DataShape& data,
                       Plan* plan) {
  std::vector<JointModule> modules;
  std::vector<size_t> index;
  bool any = false;
  const double per_microbatch = static_cast<double>(plan->global_batch) /
                                static_cast<double>(std::max<int64_t>(plan->microbatches, 1));
  for (size_t i = 0; i < plan->modules.size(); ++i) {
    const ModulePlan& m = plan->modules[i];
    if (m.role == ModuleRole::kProjector) continue;
    JointModule j;
    j.stages = m.layout.stages();
    j.boundaries = m.stage_boundaries;
    j.all_in_flight = m.role == ModuleRole::kEncoder;
    const double samples = per_microbatch / static_cast<double>(m.layout.dp);
    // Ranks of a multi-rank plan compute side by side: their costs measured under load.
    if (profile) {
      j.costs = profile_module_costs(*profile, spec, m, samples, m.layout.tp, m.layout.cp,
                                     plan->world_size > 1);
      const ModuleCosts flop = sample_costs(spec, m);
      for (size_t b = 0; b < j.costs.blocks.size(); ++b) {
        shard_experts(&j.costs.blocks[b], m.layout);
        keep_whole(&j.costs.blocks[b], flop.blocks[b], m.layout);
      }
      keep_whole(&j.costs.back, flop.back, m.layout);
      if (m.role == ModuleRole::kLlm) keep_whole(&j.costs.front, flop.front, m.layout);
    } else {
      j.costs = flop_costs(spec, m, samples, data);
    }
    // An interleaved LLM's chunks are cut alone, evenly by work: the busiest pipeline rank
    // (the sum of its vp chunks) sets the pace, so the chunks follow the cumulative work (the
    // embedding's in the first, the head's in the last) rather than the smallest largest chunk,
    // whose earliest-cut ties could leave one rank several blocks more than another. The other
    // modules' joint split then sees about the same LLM load on every rank.
    if (m.layout.vp > 1) {
      if (m.stage_boundaries.empty())
        plan->modules[i].stage_boundaries = even_cuts(j.costs, m.layout.stages());
      continue;
    }
    any = any || (m.layout.pp > 1 && m.stage_boundaries.empty());
    modules.push_back(std::move(j));
    index.push_back(i);
  }
  if (!any || modules.empty()) return;
  JointOptions o;
  o.colocated = plan->placement == "colocated";
  o.microbatches = std::max<int64_t>(plan->microbatches, 1);
  const JointPartition jp = partition_joint(modules, o);
  for (size_t k = 0; k < index.size(); ++k) {
    ModulePlan& m = plan->modules[index[k]];
    m.stage_boundaries = jp.modules[k].boundaries;
    if (m.role == ModuleRole::kEncoder)  // its projector (next in the list) follows it
      plan->modules[index[k] + 1].stage_boundaries = m.stage_boundaries;
  }
}

}  // namespace

Spec one_process(Spec spec) {
  spec.parallel.modules.clear();
  spec.parallel.placement = "colocated";
  spec.model.llm.recompute_blocks.clear();
  for (EncoderSpec& e : spec.model.encoders) e.recompute_blocks.clear();
  return spec;
}

Plan make_plan(const Spec& spec, int64_t world_size, const Profile* profile,
               const DataShape* data) {
  if (profile) check_profile(*profile, spec);
  WEFT_CHECK(world_size >= 1, "world size must be >= 1, got ", world_size);
  const ParallelSpec& par = spec.parallel;
  WEFT_CHECK(par.placement == "colocated" || par.placement == "separate", spec.source,
             ": parallel.placement = \"", par.placement,
             "\": must be \"colocated\" or \"separate\"");
  WEFT_CHECK(par.cp_split == "balanced" || par.cp_split == "zigzag" ||
                 par.cp_split == "contiguous" || par.cp_split == "lpt",
             spec.source, ": parallel.cp_split = \"", par.cp_split,
             "\": must be \"balanced\", \"zigzag\", \"contiguous\" or \"lpt\"");
  const bool separate = par.placement == "separate";
  Plan plan;
  plan.world_size = world_size;
  plan.placement = par.placement;
  plan.cp_split = par.cp_split;
  plan.balance = to_string(parse_balance_policy(spec.data.balance));
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
    enc.layers = e.layers_used();
    enc.frozen = e.frozen;
    enc.weight_grads = !e.frozen;
    enc.input_grads = false;  // inputs are data
    ModulePlan proj;
    proj.name = e.name + ".projector";
    proj.role = ModuleRole::kProjector;
    proj.encoder = static_cast<int>(i);
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
  llm.layers = spec.model.llm.layers;
  llm.frozen = spec.model.llm.frozen;
  llm.weight_grads = !llm.frozen;
  llm.input_grads = any_encoder_side_trains;
  plan.modules.push_back(llm);

  // Layouts and rank spans of encoders and the LLM; a projector copies its encoder's (just
  // before it in the list).
  int64_t next_rank = 0, spans = 0;
  std::string needs;  // "1 (vision) + 2 (llm)"
  for (size_t i = 0; i < plan.modules.size(); ++i) {
    ModulePlan& m = plan.modules[i];
    if (m.role == ModuleRole::kProjector) {
      const ModulePlan& enc = plan.modules[i - 1];
      m.layout = enc.layout;
      m.first_rank = enc.first_rank;
      m.stage_boundaries = enc.stage_boundaries;
      continue;
    }
    if (!separate && m.layout.size() == 1) m.layout.dp = world_size;  // unset: fill the world
    check_layout(spec, layout_spec(spec, m.name).stages, &m);
    const Layout& l = m.layout;
    if (separate) {
      m.first_rank = next_rank;
      next_rank += l.size();
      needs += (spans++ ? " + " : "") + std::to_string(l.size()) + " (" + m.name + ")";
      continue;
    }
    WEFT_CHECK(l.size() == world_size, spec.source, ": parallel.", m.name, " = {dp=", l.dp,
               ", tp=", l.tp, ", pp=", l.pp, ", cp=", l.cp, "}: dp*tp*pp*cp = ", l.size(),
               " but the job has ", world_size, " rank", world_size == 1 ? "" : "s",
               " and parallel.placement = \"colocated\" puts every module on all of them");
  }
  WEFT_CHECK(!separate || next_rank == world_size, spec.source,
             ": parallel.placement = \"separate\": the modules need ", needs,
             spans > 1 ? " = " + std::to_string(next_rank) : "", " ranks but the job has ",
             world_size);

  for (const auto& m : plan.modules)
    if (m.layout.pp > 1) plan.schedule = m.layout.vp > 1 ? "interleaved-1f1b" : "1f1b";
  const TrainSpec& t = spec.train;
  const int64_t dp = plan.modules.back().layout.dp;  // the LLM's
  WEFT_CHECK(t.batch % dp == 0, spec.source, ": train.batch = ", t.batch,
             ": must be divisible by the LLM's data-parallel size (parallel.llm.dp = ", dp, ")");
  WEFT_CHECK(t.batch / dp >= t.microbatches, spec.source, ": train.microbatches = ", t.microbatches,
             ": each LLM data-parallel rank gets train.batch / parallel.llm.dp = ", t.batch, " / ",
             dp, " = ", t.batch / dp,
             " samples, fewer than its microbatches; lower train.microbatches or raise "
             "train.batch");
  choose_boundaries(spec, profile, data ? *data : DataShape{}, &plan);
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
    mj["layout"] = {{"dp", m.layout.dp}, {"tp", m.layout.tp}, {"pp", m.layout.pp},
                    {"cp", m.layout.cp}, {"ep", m.layout.ep}, {"etp", m.layout.expert_tp()},
                    {"vp", m.layout.vp}, {"sp", m.layout.sp}};
    mj["ranks"] = {m.first_rank, m.first_rank + m.layout.size()};
    mj["layers"] = m.layers;
    mj["stage_boundaries"] = m.stage_boundaries;
    mj["frozen"] = m.frozen;
    mj["weight_grads"] = m.weight_grads;
    mj["input_grads"] = m.input_grads;
    mods.push_back(mj);
  }
  return j.dump(2);
}

}  // namespace weft::plan
