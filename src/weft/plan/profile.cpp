#include "weft/plan/profile.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "weft/core/error.h"

namespace weft::plan {

namespace {

using json = nlohmann::json;

// Solves the normal equations of the columns `cols` (Gaussian elimination with partial
// pivoting); false when they are singular.
bool least_squares(const std::vector<std::vector<double>>& x, const std::vector<double>& y,
                   const std::vector<int>& cols, std::vector<double>* coef) {
  const size_t k = cols.size();
  std::vector<std::vector<double>> a(k, std::vector<double>(k + 1, 0));
  for (size_t i = 0; i < k; ++i) {
    for (size_t j = 0; j < k; ++j)
      for (size_t p = 0; p < x.size(); ++p) a[i][j] += x[p][cols[i]] * x[p][cols[j]];
    for (size_t p = 0; p < x.size(); ++p) a[i][k] += x[p][cols[i]] * y[p];
  }
  for (size_t c = 0; c < k; ++c) {
    size_t pivot = c;
    for (size_t r = c + 1; r < k; ++r)
      if (std::abs(a[r][c]) > std::abs(a[pivot][c])) pivot = r;
    if (std::abs(a[pivot][c]) < 1e-12) return false;
    std::swap(a[c], a[pivot]);
    for (size_t r = 0; r < k; ++r) {
      if (r == c) continue;
      const double f = a[r][c] / a[c][c];
      for (size_t j = c; j <= k; ++j) a[r][j] -= f * a[c][j];
    }
  }
  coef->assign(k, 0);
  for (size_t i = 0; i < k; ++i) (*coef)[i] = a[i][k] / a[i][i];
  return true;
}

// ---- reading ------------------------------------------------------------------------------

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  const json& at(const json& j, const std::string& key, const std::string& where) const {
    WEFT_CHECK(j.is_object() && j.contains(key), source_, ": ", path(where, key),
               ": missing (see plan/profile.h for the format)");
    return j.at(key);
  }
  double number(const json& j, const std::string& key, const std::string& where,
                bool positive = false) const {
    const json& v = at(j, key, where);
    WEFT_CHECK(v.is_number(), source_, ": ", path(where, key), " = ", v.dump(),
               ": expected a number");
    const double d = v.get<double>();
    WEFT_CHECK(std::isfinite(d) && d >= 0 && (!positive || d > 0), source_, ": ", path(where, key),
               " = ", v.dump(), ": must be a finite number ", positive ? "> 0" : ">= 0");
    return d;
  }
  // A whole number (of threads, tokens, samples) that fits an int64_t.
  int64_t integer(const json& j, const std::string& key, const std::string& where,
                  bool positive = false) const {
    const double d = number(j, key, where, positive);
    WEFT_CHECK(d == std::floor(d) && d < 9.0e18, source_, ": ", path(where, key), " = ",
               at(j, key, where).dump(), ": expected a whole number below 9e18");
    return static_cast<int64_t>(d);
  }
  std::string string(const json& j, const std::string& key, const std::string& where) const {
    const json& v = at(j, key, where);
    WEFT_CHECK(v.is_string(), source_, ": ", path(where, key), " = ", v.dump(),
               ": expected a string");
    return v.get<std::string>();
  }
  CostFit fit(const json& j, const std::string& key, const std::string& where) const {
    const json& v = at(j, key, where);
    WEFT_CHECK(v.is_array() && v.size() == 3, source_, ": ", path(where, key), " = ", v.dump(),
               ": expected [fixed, linear, quadratic]");
    double c[3];
    for (size_t i = 0; i < 3; ++i) {
      WEFT_CHECK(v[i].is_number() && std::isfinite(v[i].get<double>()) && v[i].get<double>() >= 0,
                 source_, ": ", path(where, key), " = ", v.dump(),
                 ": coefficients must be finite numbers >= 0");
      c[i] = v[i].get<double>();
    }
    return {c[0], c[1], c[2]};
  }
  LayerProfile layer(const json& j, const std::string& where) const {
    LayerProfile l;
    l.name = string(j, "name", where);
    const json& f = at(j, "fit", where);
    const std::string w = where + ".fit";
    l.forward = fit(f, "forward", w);
    l.input_grad = fit(f, "input_grad", w);
    l.weight_grad = fit(f, "weight_grad", w);
    l.activation_bytes = fit(f, "activation_bytes", w);
    if (f.contains("shared")) {
      const json& sh = f["shared"];
      const std::string ws = w + ".shared";
      l.shared = true;
      l.forward_shared = fit(sh, "forward", ws);
      l.input_grad_shared = fit(sh, "input_grad", ws);
      l.weight_grad_shared = fit(sh, "weight_grad", ws);
    }
    l.param_bytes = number(j, "param_bytes", where);
    l.params = number(j, "params", where);
    l.tensors = number(j, "tensors", where);
    l.optimizer_seconds = number(j, "optimizer", where);
    return l;
  }
  const std::string& source() const { return source_; }

 private:
  static std::string path(const std::string& where, const std::string& key) {
    return where.empty() ? key : where + "." + key;
  }
  std::string source_;
};

Link link(const Reader& r, const json& j, const std::string& where) {
  Link l;
  l.latency_seconds = r.number(j, "latency_us", where) * 1e-6;
  l.bytes_per_second = r.number(j, "bandwidth_gbs", where, true) * 1e9;
  return l;
}

// ---- rescaling ----------------------------------------------------------------------------

constexpr double kTrainStatePerParamByte = 3;  // fp32 gradient + AdamW's two fp32 moments

// A layer at `units` of `seq` tokens on a rank holding 1/(tp·cp) of the work (raw: no rules);
// `shared`: its seconds under load, where measured.
LayerCost layer_cost(const LayerProfile& p, double units, double seq, int64_t tp, int64_t cp,
                     bool shared = false) {
  const double u = units / static_cast<double>(tp * cp);
  const bool s = shared && p.shared;
  LayerCost c;
  c.name = p.name;
  c.forward = (s ? p.forward_shared : p.forward).at(u, seq);
  c.input_grad = (s ? p.input_grad_shared : p.input_grad).at(u, seq);
  c.weight_grad = (s ? p.weight_grad_shared : p.weight_grad).at(u, seq);
  c.activation_bytes = p.activation_bytes.at(u, seq);
  c.param_bytes = p.param_bytes / static_cast<double>(tp);
  c.train_state_bytes = kTrainStatePerParamByte * c.param_bytes;
  return c;
}

const EncoderSpec& encoder_of(const Spec& spec, const ModulePlan& m) {
  return spec.model.encoders[static_cast<size_t>(m.encoder)];
}

// Which of a module's parts train (weight gradients), for the optimizer: the back of an
// encoder is its projector, with its own flag.
bool back_trains(const Spec& spec, const ModulePlan& m) {
  return m.role == ModuleRole::kLlm ? m.weight_grads : !encoder_of(spec, m).projector.frozen;
}

// The vocabulary the profile's LLM was measured with (0: not recorded).
int64_t profiled_vocab(const Profile& p) {
  for (const auto& [key, v] : p.module("llm").model)
    if (key == "vocab") {
      WEFT_CHECK(v == std::floor(v) && v < 9.0e18, p.source, ": model.vocab = ", v,
                 " (module 'llm'): expected a whole number below 9e18");
      return static_cast<int64_t>(v);
    }
  return 0;
}

// A recomputed block runs its whole plain forward and backward, and its forward once more
// without autograd: its seconds are never below the plain block's. Where the two separately timed
// fits say otherwise (noise over a few short ops), each coefficient of its forward + input
// gradient (+ weight gradient: with or without the weights training) is raised to the plain
// one's, on the input gradient (where the recomputation runs); alone and, where both were
// measured, under load.
void no_cheaper(LayerProfile* recomputed, const LayerProfile& plain) {
  const auto floor = [](CostFit* f, CostFit* in, CostFit* w, const CostFit& pf, const CostFit& pin,
                        const CostFit& pw) {
    double CostFit::*coefficients[] = {&CostFit::fixed, &CostFit::linear, &CostFit::quadratic};
    for (double CostFit::*c : coefficients) {
      const double frozen = (pf.*c + pin.*c) - (f->*c + in->*c);
      const double trained = frozen + pw.*c - w->*c;
      in->*c += std::max({0.0, frozen, trained});
    }
  };
  LayerProfile& r = *recomputed;
  floor(&r.forward, &r.input_grad, &r.weight_grad, plain.forward, plain.input_grad,
        plain.weight_grad);
  if (r.shared && plain.shared)
    floor(&r.forward_shared, &r.input_grad_shared, &r.weight_grad_shared, plain.forward_shared,
          plain.input_grad_shared, plain.weight_grad_shared);
}

// Whether module m's block b runs recomputed: the first recomputed_blocks of its chunk (spec.h).
// Before the plan has its boundaries (make_plan partitioning), every block when the module
// recomputes them all, else none: the partition cuts plain blocks, as the FLOP model's does.
bool block_recomputed(const Spec& spec, const ModulePlan& m, int64_t b) {
  const bool llm = m.role == ModuleRole::kLlm;
  const bool on = llm ? spec.model.llm.recompute : encoder_of(spec, m).recompute;
  const std::vector<int64_t>& blocks =
      llm ? spec.model.llm.recompute_blocks : encoder_of(spec, m).recompute_blocks;
  if (!on || blocks.empty()) return on;
  const int64_t stages = m.layout.stages();
  if (stages > 1 && static_cast<int64_t>(m.stage_boundaries.size()) != stages - 1) return false;
  for (int64_t v = 0; v < stages; ++v) {
    const auto [begin, end] = m.stage_layers(v);
    if (b >= begin && b < end) return recomputes_block(true, blocks, v, b - begin);
  }
  return false;
}

}  // namespace

CostFit fit_cost(const std::vector<CostPoint>& points, bool quadratic, bool relative) {
  WEFT_CHECK(!points.empty(), "fit_cost: no measurements to fit");
  // Columns scaled to a maximum of 1 so the normal equations stay well conditioned; relative
  // errors: every row divided by its value (rows of value 0 keep weight 1).
  const int K = quadratic ? 3 : 2;
  std::vector<std::vector<double>> x;
  std::vector<double> y, scale(static_cast<size_t>(K), 0);
  for (const CostPoint& p : points) {
    const double w = relative && p.value > 0 ? 1 / p.value : 1;
    x.push_back({w, w * p.units * p.seq, w * p.units * p.seq * p.seq});
    y.push_back(w * p.value);
    for (int c = 0; c < K; ++c) scale[c] = std::max(scale[c], std::abs(x.back()[c]));
  }
  for (auto& row : x)
    for (int c = 0; c < K; ++c) row[c] = scale[c] > 0 ? row[c] / scale[c] : 0;
  // Every subset of free coefficients (the others 0); the feasible one with the least residual
  // is the non-negative least-squares optimum.
  std::vector<double> best(3, 0);
  double best_residual = 0;
  for (double v : y) best_residual += v * v;  // all zero
  for (int mask = 1; mask < (1 << K); ++mask) {
    std::vector<int> cols;
    for (int c = 0; c < K; ++c)
      if (mask & (1 << c)) cols.push_back(c);
    std::vector<double> coef;
    if (!least_squares(x, y, cols, &coef)) continue;
    if (*std::min_element(coef.begin(), coef.end()) < 0) continue;
    std::vector<double> full(3, 0);
    for (size_t i = 0; i < cols.size(); ++i) full[cols[i]] = coef[i];
    double residual = 0;
    for (size_t p = 0; p < x.size(); ++p) {
      double e = y[p];
      for (int c = 0; c < K; ++c) e -= full[c] * x[p][c];
      residual += e * e;
    }
    if (residual < best_residual * (1 - 1e-12)) best_residual = residual, best = full;
  }
  CostFit f;
  f.fixed = scale[0] > 0 ? best[0] / scale[0] : 0;
  f.linear = scale[1] > 0 ? best[1] / scale[1] : 0;
  f.quadratic = K > 2 && scale[2] > 0 ? best[2] / scale[2] : 0;
  return f;
}

const ModuleProfile& Profile::module(const std::string& name) const {
  for (const ModuleProfile& m : modules)
    if (m.name == name) return m;
  std::string names;
  for (const ModuleProfile& m : modules) names += (names.empty() ? "" : ", ") + m.name;
  WEFT_FAIL(source, ": the profile has no module '", name, "' (it has ", names,
            "); profile this config with `weft bench profile`");
}

Profile parse_profile(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, out_of_range (a number too large)
    WEFT_FAIL(source, ": not valid JSON: ", e.what());
  }
  const Reader r(source);
  WEFT_CHECK(j.is_object(), source, ": expected a JSON object (a weft profile)");
  const std::string format = r.string(j, "format", "");
  WEFT_CHECK(format != "weft-profile-1", source,
             ": format = \"weft-profile-1\": an older profile, whose blocks were measured only as "
             "its config recomputed them; profile again with `weft bench profile` "
             "(weft-profile-2 measures each block plain and recomputed)");
  WEFT_CHECK(format == "weft-profile-2", source, ": format = \"", format,
             "\": expected \"weft-profile-2\"");
  Profile p;
  p.source = source;
  p.device = r.string(j, "device", "");
  p.precision = r.string(j, "precision", "");
  WEFT_CHECK(p.precision == "bf16" || p.precision == "fp32", source, ": precision = \"",
             p.precision, "\": expected \"bf16\" or \"fp32\"");
  p.config = j.contains("config") && j["config"].is_string() ? j["config"].get<std::string>() : "";
  p.threads = r.integer(j, "threads", "", true);
  const json& shape = r.at(j, "shape", "");
  p.samples = r.number(shape, "samples", "shape", true);
  p.seq = r.number(shape, "seq", "shape", true);
  p.max_seq = r.integer(shape, "max_seq", "shape", true);
  const json& data = r.at(j, "data", "");
  p.data_seconds_per_sample = r.number(data, "seconds_per_sample", "data");
  if (data.contains("media_seconds_per_sample")) {  // per encoder (optional: older profiles)
    const json& media = data["media_seconds_per_sample"];
    WEFT_CHECK(media.is_object(), source, ": data.media_seconds_per_sample = ", media.dump(),
               ": expected an object of encoder name -> seconds");
    for (const auto& [name, v] : media.items())
      p.media_seconds_per_sample[name] = r.number(media, name, "data.media_seconds_per_sample");
  }
  if (j.contains("comm")) {
    const json& c = j["comm"];
    if (c.contains("p2p")) p.p2p = link(r, c["p2p"], "comm.p2p");
    if (c.contains("all_reduce")) p.all_reduce = link(r, c["all_reduce"], "comm.all_reduce");
    if (c.contains("all_reduce_compute"))
      p.all_reduce_compute = link(r, c["all_reduce_compute"], "comm.all_reduce_compute");
    if (c.contains("points")) {
      const json& pts = c["points"];
      WEFT_CHECK(pts.is_array() && !pts.empty(), source,
                 ": comm.points: expected a non-empty array");
      for (size_t k = 0; k < pts.size(); ++k) {
        const std::string w = "comm.points[" + std::to_string(k) + "]";
        const auto add = [&](CommCurve* curve, const char* size, const char* seconds) {
          const double b = r.number(pts[k], size, w), t = r.number(pts[k], seconds, w);
          WEFT_CHECK(curve->bytes.empty() || b > curve->bytes.back(), source, ": ", w, ".", size,
                     " = ", b, ": sizes must increase");
          curve->bytes.push_back(b);
          curve->seconds.push_back(t);
        };
        add(&p.p2p_curve, "bytes", "p2p");
        add(&p.all_reduce_curve, "bytes", "all_reduce");
        add(&p.all_reduce_compute_curve, "compute_bytes", "all_reduce_compute");
        if (pts[0].contains("all_reduce_blocking"))  // on every point, or none (older profiles)
          add(&p.all_reduce_blocking_curve, "bytes", "all_reduce_blocking");
      }
    }
    if (c.contains("on_compute")) {
      WEFT_CHECK(c["on_compute"].is_boolean(), source,
                 ": comm.on_compute = ", c["on_compute"].dump(), ": expected true or false");
      p.comm_on_compute = c["on_compute"].get<bool>();
    }
    if (c.contains("activation_transport")) {
      const json& t = c["activation_transport"];
      WEFT_CHECK(t == "shared memory" || t == "gloo", source,
                 ": comm.activation_transport = ", t.dump(),
                 ": expected \"shared memory\" or \"gloo\"");
      p.activations_in_shared_memory = t == "shared memory";
    }
  }
  if (j.contains("data_shape")) {  // optional: older profiles have none
    const json& d = j["data_shape"];
    const std::string w = "data_shape";
    p.data.samples = r.integer(d, "samples", w, true);
    p.data.positions = r.number(d, "positions", w, true);
    p.data.tokens = r.number(d, "tokens", w);
    p.data.targets = r.number(d, "targets", w);
    p.data.sum_sq_doc_len = r.number(d, "sum_sq_doc_len", w);
    const auto items = [&](const json& parent, const std::string& where,
                           std::map<std::string, double>* out) {
      const json& v = r.at(parent, "items", where);
      WEFT_CHECK(v.is_object(), source, ": ", where, ".items = ", v.dump(),
                 ": expected an object of encoder name -> items per sample");
      for (const auto& [name, n] : v.items()) (*out)[name] = r.number(v, name, where + ".items");
    };
    items(d, w, &p.data_items);
    if (d.contains("peak")) {
      const json& pk = d["peak"];
      p.data.peak_positions = r.number(pk, "positions", w + ".peak", true);
      p.data.peak_targets = r.number(pk, "targets", w + ".peak");
      items(pk, w + ".peak", &p.data_peak_items);
    }
  }
  const json& mods = r.at(j, "modules", "");
  WEFT_CHECK(mods.is_array() && !mods.empty(), source, ": modules: expected a non-empty array");
  for (size_t i = 0; i < mods.size(); ++i) {
    const std::string where = "modules[" + std::to_string(i) + "]";
    const json& mj = mods[i];
    ModuleProfile m;
    m.name = r.string(mj, "name", where);
    const std::string role = r.string(mj, "role", where);
    WEFT_CHECK(role == "llm" || role == "encoder", source, ": ", where, ".role = \"", role,
               "\": expected \"llm\" or \"encoder\"");
    m.llm = role == "llm";
    m.units_per_sample = m.llm ? 1 : r.number(mj, "units_per_sample", where);
    const json& model = r.at(mj, "model", where);
    WEFT_CHECK(model.is_object(), source, ": ", where, ".model: expected an object");
    for (const auto& [key, value] : model.items())
      m.model.emplace_back(key, r.number(model, key, where + ".model"));
    const json& layers = r.at(mj, "layers", where);
    WEFT_CHECK(layers.is_array(), source, ": ", where, ".layers: expected an array");
    constexpr int kParts = 7;
    bool seen[kParts] = {};
    const char* parts[kParts] = {
        "front", "block", "back", "block_recompute", "stage", "moe_block", "moe_block_recompute"};
    const auto llm_only = [](const std::string& part) {
      return part == "stage" || part == "moe_block" || part == "moe_block_recompute";
    };
    for (size_t k = 0; k < layers.size(); ++k) {
      const std::string lw = where + ".layers[" + std::to_string(k) + "]";
      const std::string part = r.string(layers[k], "part", lw);
      const auto it = std::find(parts, parts + kParts, part);
      WEFT_CHECK(it != parts + kParts && (m.llm || !llm_only(part)), source, ": ", lw, ".part = \"",
                 part, "\": expected \"front\", \"block\", \"block_recompute\", \"back\"",
                 m.llm ? ", \"stage\", \"moe_block\" or \"moe_block_recompute\""
                       : " (\"stage\", \"moe_block\" and \"moe_block_recompute\" are the LLM's)");
      const int idx = static_cast<int>(it - parts);
      WEFT_CHECK(!seen[idx], source, ": ", lw, ": a second \"", part, "\" layer in module '",
                 m.name, "'");
      seen[idx] = true;
      LayerProfile* dst[kParts] = {&m.front,
                                   &m.block,
                                   &m.back,
                                   &m.block_recompute,
                                   &m.stage,
                                   &m.moe_block,
                                   &m.moe_block_recompute};
      *dst[idx] = r.layer(layers[k], lw);
    }
    no_cheaper(&m.block_recompute, m.block);
    if (seen[5] && seen[6]) no_cheaper(&m.moe_block_recompute, m.moe_block);
    m.has_moe_block = seen[5];
    for (int k = 0; k < 4; ++k)
      WEFT_CHECK(seen[k], source, ": ", where, " ('", m.name, "'): no \"", parts[k], "\" layer");
    WEFT_CHECK(seen[5] == seen[6], source, ": ", where, " ('", m.name, "'): \"",
               seen[5] ? parts[5] : parts[6], "\" without \"", seen[5] ? parts[6] : parts[5],
               "\": an MoE block is measured plain and recomputed");
    p.modules.push_back(std::move(m));
  }
  return p;
}

Profile load_profile(const std::string& path) {
  std::ifstream in(path);
  WEFT_CHECK(in, path, ": cannot read profile file");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_profile(text.str(), path);
}

std::vector<std::pair<std::string, double>> profile_model_fields(const Spec& spec,
                                                                 const std::string& module) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  if (module == "llm") {
    const LlmSpec& l = spec.model.llm;
    std::vector<std::pair<std::string, double>> f = {
        {"hidden", d(l.hidden)}, {"heads", d(l.heads)}, {"kv_heads", d(l.kv_heads)},
        {"ffn", d(l.ffn)},       {"vocab", d(l.vocab)}, {"tied", l.tie_embeddings ? 1.0 : 0}};
    if (l.moe.enabled())  // what an MoE block's costs depend on (not which blocks are MoE)
      f.insert(f.end(), {{"moe_experts", d(l.moe.experts)},
                         {"moe_top_k", d(l.moe.top_k)},
                         {"moe_ffn", d(l.expert_ffn())},
                         {"moe_shared_ffn", d(l.moe.shared_ffn)},
                         {"moe_sigmoid", l.moe.sigmoid ? 1.0 : 0},
                         {"moe_capacity_factor", l.moe.capacity_factor}});
    return f;
  }
  const EncoderSpec* e = spec.encoder(module);
  WEFT_CHECK(e, spec.source, ": the model has no module '", module, "'");
  std::vector<std::pair<std::string, double>> f = {
      {"vit", e->kind == EncoderKind::kVit ? 1.0 : 0},
      {"hidden", d(e->hidden)},
      {"heads", d(e->heads)},
      {"ffn", d(e->ffn)},
      {"block_tokens", d(e->block_tokens())},
      {"mlp_projector", e->projector.kind == ProjectorKind::kMlp ? 1.0 : 0},
      {"llm_hidden", d(spec.model.llm.hidden)}};
  if (e->kind == EncoderKind::kVit) {
    f.insert(f.end(), {{"image_size", d(e->image_size)},
                       {"channels", d(e->channels)},
                       {"patch", d(e->patch)},
                       {"stem_channels", d(e->stem_channels)},
                       {"stem_layers", d(e->stem_layers)}});
  } else {
    f.insert(f.end(), {{"mels", d(e->mels)}, {"frames", d(e->frames)}});
  }
  return f;
}

void check_profile(const Profile& p, const Spec& spec) {
  WEFT_CHECK(p.precision == to_string(spec.train.precision), p.source, ": measured in ",
             p.precision, " but ", spec.source, " trains in ", to_string(spec.train.precision),
             " (train.precision); profile it in that precision");
  std::vector<std::string> names = {"llm"};
  for (const EncoderSpec& e : spec.model.encoders) names.push_back(e.name);
  for (const std::string& name : names) {
    const ModuleProfile& m = p.module(name);
    WEFT_CHECK(m.llm == (name == "llm"), p.source, ": module '", name, "' is profiled as ",
               m.llm ? "an LLM" : "an encoder");
    for (const auto& field : profile_model_fields(spec, name)) {
      const std::string& key = field.first;
      const double want = field.second;
      if (name == "llm" && key == "vocab" && want == 0) continue;  // taken from the tokenizer
      const auto it = std::find_if(m.model.begin(), m.model.end(),
                                   [&](const auto& kv) { return kv.first == key; });
      WEFT_CHECK(it != m.model.end(), p.source, ": module '", name, "': model.", key,
                 " missing (the costs' shape is unknown)");
      WEFT_CHECK(it->second == want, p.source, ": module '", name, "' was profiled with ", key,
                 " = ", it->second, " but ", spec.source, " has ", want,
                 "; profile this config with `weft bench profile`");
    }
  }
  WEFT_CHECK(!spec.model.llm.moe.enabled() || p.module("llm").has_moe_block, p.source,
             ": has no \"moe_block\" layer for the mixture-of-experts blocks of ", spec.source,
             " (model.llm.moe); profile this config with `weft bench profile`");
}

double profile_seq(const Profile& p, const Spec& spec) {
  return spec.model.llm.max_seq == p.max_seq ? p.seq : static_cast<double>(spec.model.llm.max_seq);
}

ModuleCosts profile_module_costs(const Profile& profile, const Spec& spec, const ModulePlan& m,
                                 double samples, int64_t tp, int64_t cp, bool shared) {
  WEFT_CHECK(m.role != ModuleRole::kProjector, "profile_module_costs: ", m.name,
             " is a projector; it is costed as the last layer of its encoder");
  const bool llm = m.role == ModuleRole::kLlm;
  const ModuleProfile& mp = profile.module(m.name);
  const double seq = llm ? profile_seq(profile, spec) : 1;
  const double units = samples * mp.units_per_sample;
  // Saved casts are measured with the activations.
  const ParamHolding holding{param_holding(spec).frozen, 0};
  const auto rules = [&](LayerCost c) {
    return apply_frozen_rules(std::move(c), m.weight_grads, m.input_grads, holding);
  };
  ModuleCosts out;
  out.module = m.name;
  // An encoder's front end runs whole, on its whole parameters, on every TP and CP rank.
  LayerCost front = llm ? layer_cost(mp.front, units, seq, tp, cp, shared)
                        : layer_cost(mp.front, units, seq, 1, 1, shared);
  // Encoder front ends take data; the LLM embedding routes feature gradients only when
  // something before it trains.
  if (!llm || !m.input_grads) front.input_grad = 0;
  out.front = rules(front);
  for (int64_t b = 0; b < m.layers; ++b) {
    const bool rc = block_recomputed(spec, m, b);
    LayerCost c = layer_cost(llm  ? mp.block_at(spec.model.llm, b, rc)
                             : rc ? mp.block_recompute
                                  : mp.block,
                             units, seq, tp, cp, shared);
    c.name = m.name + ".layers." + std::to_string(b);
    if (llm && spec.model.llm.moe.enabled()) {  // the experts' share of the block's parameters
      const BlockParams p = llm_block_params(spec.model.llm, b);
      c.expert_param_bytes = c.param_bytes * p.experts / p.total;
      c.expert_train_state_bytes = c.train_state_bytes * p.experts / p.total;
    }
    out.blocks.push_back(rules(c));
  }
  LayerCost back = layer_cost(mp.back, units, seq, tp, cp, shared);
  if (llm) {
    // A tied head keeps its own copy of the embedding once pipelined.
    if (spec.model.llm.tie_embeddings && m.layout.pp > 1) {
      back.param_bytes += mp.front.param_bytes / static_cast<double>(tp);
      back.train_state_bytes = kTrainStatePerParamByte * back.param_bytes;
    }
    out.back = rules(back);
  } else {  // the projector, with its own flags (as module_layer_costs)
    if (!m.weight_grads) back.input_grad = 0;
    out.back = apply_frozen_rules(back, back_trains(spec, m), m.weight_grads, holding);
  }
  return out;
}

CostTable profile_stage_costs(const Profile& profile, const Spec& spec, const Plan& plan) {
  check_profile(profile, spec);
  const double seq = profile_seq(profile, spec);
  // The FLOP fields (MFU) with the profiled vocabulary, of the samples the costs are for: the
  // profiled data's padded rows and items, not max_seq.
  Spec flops_spec = spec;
  if (flops_spec.model.llm.vocab == 0) flops_spec.model.llm.vocab = profiled_vocab(profile);
  CostTable table = stage_costs(flops_spec, plan, profile_data_shape(profile, spec));
  Spec plain = spec;  // recomputing nothing
  plain.model.llm.recompute = false;
  for (EncoderSpec& e : plain.model.encoders) e.recompute = false;
  for (size_t i = 0; i < plan.modules.size(); ++i) {
    const ModulePlan& m = plan.modules[i];
    if (m.role == ModuleRole::kProjector) continue;
    const bool llm = m.role == ModuleRole::kLlm;
    const ModuleProfile& mp = profile.module(m.name);
    // Whole-module costs at 0 and 1 sample: the per-op part and the per-sample part (alone and
    // under load).
    const ModuleCosts c0 = profile_module_costs(profile, spec, m, 0);
    const ModuleCosts c1 = profile_module_costs(profile, spec, m, 1);
    const ModuleCosts s0 = profile_module_costs(profile, spec, m, 0, 1, 1, true);
    const ModuleCosts s1 = profile_module_costs(profile, spec, m, 1, 1, 1, true);
    // Its costs with nothing recomputed: in backward a recomputed block holds its plain
    // forward's bytes again.
    const ModuleCosts p0 = profile_module_costs(profile, plain, m, 0);
    const ModuleCosts p1 = profile_module_costs(profile, plain, m, 1);
    const bool shared =
        mp.front.shared && mp.block.shared && mp.block_recompute.shared && mp.back.shared &&
        (!mp.has_moe_block || (mp.moe_block.shared && mp.moe_block_recompute.shared));
    const auto layers_of = [&](const ModuleCosts& c, int64_t s) {
      const auto [begin, end] = m.stage_layers(s);
      std::vector<const LayerCost*> out;
      if (s == 0) out.push_back(&c.front);
      for (int64_t k = begin; k < end; ++k) out.push_back(&c.blocks[static_cast<size_t>(k)]);
      if (s == m.layout.stages() - 1) out.push_back(&c.back);
      return out;
    };
    for (int64_t s = 0; s < m.layout.stages(); ++s) {
      StageCost& sc = table[i][static_cast<size_t>(s)];
      const auto [begin, end] = m.stage_layers(s);
      StageCost fresh;
      fresh.forward_flops = sc.forward_flops;
      fresh.backward_flops = sc.backward_flops;
      fresh.blocks = sc.blocks;
      fresh.backward_blocks = sc.backward_blocks;
      // The model's structure: what the experts hold and move (from the spec, not measured).
      fresh.moe_blocks = sc.moe_blocks;
      fresh.expert_param_bytes = sc.expert_param_bytes;
      fresh.expert_train_state_bytes = sc.expert_train_state_bytes;
      fresh.expert_grad_bytes = sc.expert_grad_bytes;
      fresh.measured = true;
      fresh.partial_grad_bytes = sc.partial_grad_bytes;  // the model's structure too
      fresh.replicated_forward_flops = sc.replicated_forward_flops;
      fresh.replicated_backward_flops = sc.replicated_backward_flops;
      // What each TP rank keeps whole: the FLOP model's share of the activations (set below).
      const double whole_share =
          sc.activation_bytes > 0 ? sc.whole_activation_bytes / sc.activation_bytes : 0;
      sc = fresh;
      const std::vector<const LayerCost*> l0 = layers_of(c0, s), l1 = layers_of(c1, s);
      const std::vector<const LayerCost*> h0 = layers_of(s0, s), h1 = layers_of(s1, s);
      sc.shared_measured = shared;
      // An encoder's front end runs whole on every TP and CP rank (StageCost::replicated_*).
      const bool replicated_front = !llm && s == 0;
      for (size_t k = 0; shared && k < h0.size(); ++k) {
        const LayerCost &a = *h0[k], &b = *h1[k];
        const double f = b.forward - a.forward;
        const double g = b.input_grad + b.weight_grad - a.input_grad - a.weight_grad;
        sc.forward_fixed_seconds_shared += a.forward;
        sc.forward_seconds_shared += f;
        sc.backward_fixed_seconds_shared += a.input_grad + a.weight_grad;
        sc.backward_seconds_shared += g;
        if (replicated_front && k == 0)
          sc.replicated_forward_seconds_shared = f, sc.replicated_backward_seconds_shared = g;
      }
      for (size_t k = 0; k < l0.size(); ++k) {
        const LayerCost &a = *l0[k], &b = *l1[k];
        const double f = b.forward - a.forward;
        const double g = b.input_grad + b.weight_grad - a.input_grad - a.weight_grad;
        sc.forward_fixed_seconds += a.forward;
        sc.forward_seconds += f;
        sc.backward_fixed_seconds += a.input_grad + a.weight_grad;
        sc.backward_seconds += g;
        if (replicated_front && k == 0) {
          sc.replicated_forward_seconds = f, sc.replicated_backward_seconds = g;
          sc.replicated_activation_bytes = b.activation_bytes - a.activation_bytes;
        }
        sc.activation_fixed_bytes += a.activation_bytes;
        sc.activation_bytes += b.activation_bytes - a.activation_bytes;
        sc.param_bytes += a.param_bytes;
        sc.train_state_bytes += a.train_state_bytes;
        sc.grad_bytes += a.train_state_bytes / kTrainStatePerParamByte;
      }
      // Optimizer seconds of the stage's trainable parts (a tied head's embedding copy too).
      if (m.weight_grads) {
        if (s == 0) sc.optimizer_seconds += mp.front.optimizer_seconds;
        for (int64_t b = begin; b < end; ++b)
          sc.optimizer_seconds +=
              (llm ? mp.block_at(spec.model.llm, b) : mp.block).optimizer_seconds;
      }
      if (s == m.layout.stages() - 1 && back_trains(spec, m)) {
        sc.optimizer_seconds += mp.back.optimizer_seconds;
        if (llm && spec.model.llm.tie_embeddings && m.layout.pp > 1)
          sc.optimizer_seconds += mp.front.optimizer_seconds;
      }
      // Every LLM pipeline rank builds the mask and RoPE tables once per microbatch (its first
      // chunk's forward; its other chunks share them, dist/runtime.cpp LlmMicrobatch), and keeps
      // the mask while its microbatch is in flight.
      const bool first_chunk = s < m.layout.pp;
      if (llm && first_chunk) {
        sc.forward_fixed_seconds += mp.stage.forward.fixed;
        sc.forward_seconds += mp.stage.forward.per_unit(seq);
        const CostFit& f = mp.stage.shared ? mp.stage.forward_shared : mp.stage.forward;
        sc.forward_fixed_seconds_shared += f.fixed;
        sc.forward_seconds_shared += f.per_unit(seq);
      }
      if (llm && first_chunk && m.needs_backward()) {
        sc.activation_fixed_bytes += mp.stage.activation_bytes.fixed;
        sc.activation_bytes += mp.stage.activation_bytes.per_unit(seq);
      }
      // Recomputed blocks: their forwards' collectives run again in backward, where a block
      // holds again what its plain forward keeps beyond its recomputed one (the peak: the most
      // of those, per unit).
      for (int64_t b = begin; b < end; ++b) {
        if (!block_recomputed(spec, m, b)) continue;
        const size_t i = static_cast<size_t>(b);
        const double full = p1.blocks[i].activation_bytes - p0.blocks[i].activation_bytes;
        const double kept = c1.blocks[i].activation_bytes - c0.blocks[i].activation_bytes;
        if (p1.blocks[i].activation_bytes <= 0) continue;  // runs no backward: nothing again
        sc.recompute = true;
        ++sc.recompute_blocks;
        if (llm && spec.model.llm.moe.is_moe_layer(b)) ++sc.recompute_moe_blocks;
        sc.recompute_peak_bytes = std::max(sc.recompute_peak_bytes, full - kept);
      }
      sc.recompute_peak_whole_bytes = whole_share * sc.recompute_peak_bytes;
      sc.whole_activation_bytes = whole_share * sc.activation_bytes;
    }
  }
  return table;
}

DataShape profile_data_shape(const Profile& profile, const Spec& spec) {
  if (!profile.data.empty() && spec.model.llm.max_seq == profile.max_seq) {
    DataShape d = profile.data;
    const auto per_encoder = [&](const std::map<std::string, double>& by_name,
                                 const std::string& where) {
      std::vector<double> out;
      for (const EncoderSpec& e : spec.model.encoders) {
        const auto it = by_name.find(e.name);
        WEFT_CHECK(it != by_name.end(), profile.source, ": ", where, ": no items of encoder '",
                   e.name, "' (the profile is of another model; profile this config again)");
        out.push_back(it->second);
      }
      return out;
    };
    d.items = per_encoder(profile.data_items, "data_shape.items");
    for (size_t e = 0; e < d.items.size(); ++e) {  // the items the costs per sample hold
      const std::string& name = spec.model.encoders[e].name;
      const double per = profile.module(name).units_per_sample;
      WEFT_CHECK(std::abs(d.items[e] - per) <= 1e-9 * std::max(1.0, per), profile.source,
                 ": data_shape.items.", name, " = ", d.items[e], " but module '", name,
                 "' has units_per_sample = ", per, " (its costs per sample hold that many)");
    }
    if (d.has_peak()) d.peak_items = per_encoder(profile.data_peak_items, "data_shape.peak.items");
    check_data_shape(spec, d, profile.source);
    return d;
  }
  DataShape d;
  d.positions = d.tokens = d.targets = profile_seq(profile, spec);
  d.sum_sq_doc_len = d.positions * d.positions;
  for (const EncoderSpec& e : spec.model.encoders)
    d.items.push_back(profile.module(e.name).units_per_sample);
  d.samples = std::llround(profile.samples);
  return d;
}

SimOptions profile_sim_options(const Profile& profile, const Spec& spec, SimOptions options) {
  options.data_seconds_per_sample = profile.data_seconds_per_sample;
  options.media_seconds_per_sample = profile.media_seconds_per_sample;
  options.data = profile_data_shape(profile, spec);
  options.p2p_curve = profile.p2p_curve;
  options.grad_curve = profile.all_reduce_curve;
  options.blocking_curve = profile.all_reduce_blocking_curve;
  options.activation_curve = profile.all_reduce_compute_curve;
  if (profile.activations_in_shared_memory) options.all_to_all_curve = profile.all_reduce_curve;
  options.comm_occupies_rank = profile.comm_on_compute;
  if (const int64_t vocab = profiled_vocab(profile); vocab > 0) options.unset_vocab = vocab;
  return options;
}

SimResult simulate(const Spec& spec, const Plan& plan, const Cluster& cluster,
                   const Profile& profile, SimOptions options) {
  const CostTable costs = profile_stage_costs(profile, spec, plan);
  // model.llm.vocab = 0 is the profile's (options.unset_vocab).
  return simulate(spec, plan, cluster, costs, profile_sim_options(profile, spec, options));
}

nlohmann::ordered_json data_shape_json(const Spec& spec, const DataShape& d) {
  nlohmann::ordered_json j;
  if (d.empty()) {
    j["rows"] = "full";
    j["positions"] = spec.model.llm.max_seq;
    return j;
  }
  j["samples"] = d.samples;
  j["positions"] = d.positions;
  j["tokens"] = d.tokens;
  j["targets"] = d.targets;
  j["sum_sq_doc_len"] = d.sum_sq_doc_len;
  const auto per_encoder = [&](const std::vector<double>& v) {  // by encoder name
    nlohmann::ordered_json out = nlohmann::ordered_json::object();
    for (size_t e = 0; e < spec.model.encoders.size(); ++e) out[spec.model.encoders[e].name] = v[e];
    return out;
  };
  j["items"] = per_encoder(d.items);
  if (d.has_peak())  // what activation memory is priced on
    j["peak"] = {{"positions", d.peak_positions},
                 {"targets", d.peak_targets},
                 {"items", per_encoder(d.peak_items)}};
  return j;
}

}  // namespace weft::plan
