#include "weft/plan/balance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <tuple>
#include <utility>

#include "weft/core/error.h"
#include "weft/plan/partition.h"
#include "weft/plan/plan.h"

namespace weft::plan {

using Assignment = std::vector<std::vector<std::vector<int64_t>>>;

double SampleWork::encoder_total() const {
  return std::accumulate(encoder.begin(), encoder.end(), 0.0);
}

SampleWork& SampleWork::operator+=(const SampleWork& o) {
  if (encoder.empty()) encoder.assign(o.encoder.size(), 0.0);
  WEFT_CHECK(o.encoder.empty() || o.encoder.size() == encoder.size(), "[balance] adding work of ",
             o.encoder.size(), " encoders to work of ", encoder.size());
  for (size_t k = 0; k < o.encoder.size(); ++k) encoder[k] += o.encoder[k];
  llm += o.llm;
  return *this;
}

namespace {

// The combined cost of a load vector: K encoder sums, then the LLM's.
double combine(const BalanceCost& c, const double* load, size_t K) {
  double acc = 0;
  const auto add = [&](double x) { acc = c.concurrent ? std::max(acc, x) : acc + x; };
  for (size_t k = 0; k < K; ++k)
    add((c.encoder_weight.empty() ? 1.0 : c.encoder_weight[k]) * load[k]);
  add(c.llm_weight * load[K]);
  return acc;
}

}  // namespace

double BalanceCost::operator()(const SampleWork& w) const {
  WEFT_CHECK(encoder_weight.empty() || encoder_weight.size() == w.encoder.size(),
             "[balance] cost has ", encoder_weight.size(), " encoder weights, work has ",
             w.encoder.size(), " encoders");
  std::vector<double> load(w.encoder);
  load.push_back(w.llm);
  return combine(*this, load.data(), w.encoder.size());
}

// --- workload model ---------------------------------------------------------------------------

SampleWork WorkModel::work(const SampleShape& s, const std::string& where) const {
  WEFT_CHECK(s.tokens >= 0, where, ": tokens = ", s.tokens, " (expected >= 0)");
  WEFT_CHECK(s.items.size() <= encoder_per_item.size(), where, ": ", s.items.size(),
             " item counts for a model with ", encoder_per_item.size(), " encoders");
  SampleWork w;
  w.encoder.assign(encoder_per_item.size(), 0.0);
  for (size_t k = 0; k < s.items.size(); ++k) {
    WEFT_CHECK(s.items[k] >= 0, where, ": items of encoder '", encoder_names[k], "' = ", s.items[k],
               " (expected >= 0)");
    w.encoder[k] = static_cast<double>(s.items[k]) * encoder_per_item[k];
  }
  const double T = static_cast<double>(s.tokens);
  const double sum_sq = s.sum_sq_doc_len < 0 ? T * T : s.sum_sq_doc_len;
  const double targets = s.targets < 0 ? T : static_cast<double>(s.targets);
  w.llm = T * llm_per_token + targets * llm_per_target + sum_sq * llm_per_sum_sq;
  return w;
}

namespace {
double training_work(const ModuleCosts& c) {
  double t = layer_time(c.front, true, true) + layer_time(c.back, true, true);
  for (const LayerCost& b : c.blocks) t += layer_time(b, true, true);  // rules already applied
  return t;
}
}  // namespace

WorkModel make_work_model(const Spec& spec, const Plan& plan) {
  WorkModel w;
  const ModulePlan& llm = plan.module("llm");
  const bool separate = plan.placement == "separate";
  for (size_t k = 0; k < spec.model.encoders.size(); ++k) {
    const auto it = std::find_if(plan.modules.begin(), plan.modules.end(), [&](const auto& m) {
      return m.role == ModuleRole::kEncoder && m.encoder == static_cast<int>(k);
    });
    WEFT_CHECK(it != plan.modules.end(), "[balance] the plan has no module for encoder '",
               spec.model.encoders[k].name, "'");
    MicrobatchShape one_item;
    one_item.items = 1;
    w.encoder_names.push_back(spec.model.encoders[k].name);
    w.encoder_per_item.push_back(training_work(module_layer_costs(spec, *it, one_item)));
    w.cost.encoder_weight.push_back(separate ? static_cast<double>(llm.layout.size()) /
                                                   static_cast<double>(it->layout.size())
                                             : 1.0);
  }
  // The LLM's work is linear in tokens, loss rows and Σ L²: read off each coefficient.
  const auto llm_work = [&](int64_t tokens, int64_t rows, double sum_sq) {
    MicrobatchShape s;
    s.llm = LlmTokens{static_cast<double>(tokens), static_cast<double>(rows), sum_sq};
    return training_work(module_layer_costs(spec, llm, s));
  };
  w.llm_per_token = llm_work(1, 0, 0);
  w.llm_per_target = llm_work(0, 1, 0);
  w.llm_per_sum_sq = llm_work(0, 0, 1);
  w.cost.concurrent = separate;
  return w;
}

BalancePolicy parse_balance_policy(const std::string& name) {
  if (name == "in_order") return BalancePolicy::kInOrder;
  if (name == "balanced") return BalancePolicy::kBalanced;
  WEFT_FAIL("unknown balance policy '", name, "' (expected \"in_order\" or \"balanced\")");
}

const char* to_string(BalancePolicy p) {
  return p == BalancePolicy::kInOrder ? "in_order" : "balanced";
}

// --- the partitioner --------------------------------------------------------------------------

namespace {

// Per-sample work vectors, row-major [n][K + 1] (K encoders, then the LLM).
struct Flat {
  const BalanceCost* cost = nullptr;
  size_t K = 0;
  std::vector<double> v;
  const double* row(int64_t i) const { return v.data() + static_cast<size_t>(i) * (K + 1); }
  double combine(const double* load) const { return plan::combine(*cost, load, K); }
};

// Samples split into bins whose sizes differ by at most one, with their loads and costs.
struct Bins {
  std::vector<std::vector<int64_t>> items;
  std::vector<std::vector<double>> load;
  std::vector<double> cost;
};

Bins make_bins(const Flat& f, std::vector<std::vector<int64_t>> items) {
  Bins b;
  b.load.assign(items.size(), std::vector<double>(f.K + 1, 0.0));
  for (size_t i = 0; i < items.size(); ++i) {
    for (int64_t s : items[i])
      for (size_t d = 0; d <= f.K; ++d) b.load[i][d] += f.row(s)[d];
    b.cost.push_back(f.combine(b.load[i].data()));
  }
  b.items = std::move(items);
  return b;
}

// data::part_range: consecutive parts, the first n % parts one larger.
std::vector<std::vector<int64_t>> consecutive(const std::vector<int64_t>& items, int64_t parts) {
  const int64_t n = static_cast<int64_t>(items.size()), base = n / parts, extra = n % parts;
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(parts));
  for (int64_t p = 0, begin = 0; p < parts; ++p) {
    const int64_t end = begin + base + (p < extra ? 1 : 0);
    out[static_cast<size_t>(p)].assign(items.begin() + begin, items.begin() + end);
    begin = end;
  }
  return out;
}

// LPT under the size constraint: samples by cost descending, each to the bin with room whose cost
// after adding it is lowest. At most n % parts bins may reach size ⌊n/parts⌋ + 1.
std::vector<std::vector<int64_t>> lpt(const Flat& f, const std::vector<int64_t>& items,
                                      int64_t parts) {
  const int64_t n = static_cast<int64_t>(items.size()), base = n / parts;
  int64_t extra_left = n % parts;
  std::vector<double> own(items.size());
  for (size_t i = 0; i < items.size(); ++i) own[i] = f.combine(f.row(items[i]));
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return own[a] > own[b]; });
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(parts));
  std::vector<std::vector<double>> load(out.size(), std::vector<double>(f.K + 1, 0.0));
  std::vector<double> cost(out.size(), 0.0), trial(f.K + 1);
  for (size_t o : order) {
    const double* w = f.row(items[o]);
    size_t best = out.size();
    double best_cost = 0;
    for (size_t b = 0; b < out.size(); ++b) {
      const int64_t size = static_cast<int64_t>(out[b].size());
      if (size > base || (size == base && extra_left == 0)) continue;
      for (size_t d = 0; d <= f.K; ++d) trial[d] = load[b][d] + w[d];
      const double c = f.combine(trial.data());
      if (best == out.size() || c < best_cost || (c == best_cost && cost[b] < cost[best]))
        best = b, best_cost = c;
    }
    WEFT_ASSERT(best < out.size(), "no bin with room");
    if (static_cast<int64_t>(out[best].size()) == base) --extra_left;
    out[best].push_back(items[o]);
    for (size_t d = 0; d <= f.K; ++d) load[best][d] += w[d];
    cost[best] = best_cost;
  }
  return out;
}

// Moves sample bi of bin a to bin b, or swaps it with sample bj of b (bj < size of b), and
// updates both bins' loads and costs.
void exchange(const Flat& f, Bins& bins, size_t a, size_t b, size_t bi, size_t bj) {
  auto& A = bins.items[a];
  auto& Bv = bins.items[b];
  const int64_t s = A[bi];
  for (size_t d = 0; d <= f.K; ++d) {
    const double x = bj < Bv.size() ? f.row(Bv[bj])[d] : 0.0;
    bins.load[a][d] += x - f.row(s)[d];
    bins.load[b][d] += f.row(s)[d] - x;
  }
  if (bj < Bv.size()) {
    A[bi] = Bv[bj];
    Bv[bj] = s;
  } else {
    A.erase(A.begin() + static_cast<std::ptrdiff_t>(bi));
    Bv.push_back(s);
  }
  bins.cost[a] = f.combine(bins.load[a].data());
  bins.cost[b] = f.combine(bins.load[b].data());
}

// One descent on `score` (a function of a bin's load vector): moves and swaps between the bin with
// the highest score and the others (lowest score first) while the pair's highest score strictly
// drops below the old highest, and neither bin's combined cost exceeds `cap`. A move goes only from
// a larger bin to a smaller one, so sizes keep differing by at most one. Stops when no single move
// or swap lowers the top bin, when `budget` (candidate moves priced) runs out, or after a bounded
// number of rounds. Returns whether it changed anything.
template <typename Score>
bool descend(const Flat& f, Bins& bins, Score score, double cap, int64_t& budget) {
  const size_t B = bins.items.size(), dims = f.K + 1;
  size_t n = 0;
  for (const auto& b : bins.items) n += b.size();
  std::vector<double> na(dims), nb(dims), scores(B);
  std::vector<size_t> others(B);
  bool changed = false;
  for (size_t round = 0; B > 1 && round < 20 * n + 100; ++round) {
    for (size_t b = 0; b < B; ++b) scores[b] = score(bins.load[b].data());
    const size_t a =
        static_cast<size_t>(std::max_element(scores.begin(), scores.end()) - scores.begin());
    const double top = scores[a], tol = 1e-12 * std::abs(top);
    std::iota(others.begin(), others.end(), 0);
    std::stable_sort(others.begin(), others.end(),
                     [&](size_t x, size_t y) { return scores[x] < scores[y]; });
    bool applied = false;
    for (size_t b : others) {
      if (b == a || budget <= 0) continue;
      auto& A = bins.items[a];
      auto& Bv = bins.items[b];
      budget -= static_cast<int64_t>(A.size() * (Bv.size() + 1));
      double best = top - tol;
      size_t bi = A.size(), bj = 0;  // bj == Bv.size(): move A[bi] to b
      for (size_t i = 0; i < A.size(); ++i) {
        const double* wi = f.row(A[i]);
        for (size_t j = 0; j <= Bv.size(); ++j) {
          if (j == Bv.size() && A.size() <= Bv.size()) break;
          const double* wj = j < Bv.size() ? f.row(Bv[j]) : nullptr;
          for (size_t d = 0; d < dims; ++d) {
            const double x = wj ? wj[d] : 0.0;
            na[d] = bins.load[a][d] - wi[d] + x;
            nb[d] = bins.load[b][d] + wi[d] - x;
          }
          const double m = std::max(score(na.data()), score(nb.data()));
          if (m < best && f.combine(na.data()) <= cap && f.combine(nb.data()) <= cap)
            best = m, bi = i, bj = j;
        }
      }
      if (bi == A.size()) continue;
      exchange(f, bins, a, b, bi, bj);
      applied = changed = true;
      break;
    }
    if (!applied) break;
  }
  return changed;
}

// Applies the single move or swap between bins a and b that lowers Σ over the pair of
// Σ_d (load_d · inv_mean_d)² the most, keeping both bins' combined cost <= cap. Returns whether
// there was one.
bool smooth_pair(const Flat& f, Bins& bins, size_t a, size_t b, const std::vector<double>& inv_mean,
                 double cap, int64_t& budget) {
  if (budget <= 0) return false;
  const size_t dims = f.K + 1;
  const auto sq = [&](const double* load) {
    double t = 0;
    for (size_t d = 0; d < dims; ++d) t += (load[d] * inv_mean[d]) * (load[d] * inv_mean[d]);
    return t;
  };
  if (bins.items[a].size() < bins.items[b].size()) std::swap(a, b);  // moves go a -> b
  auto& A = bins.items[a];
  auto& Bv = bins.items[b];
  budget -= static_cast<int64_t>(A.size() * (Bv.size() + 1));
  const double before = sq(bins.load[a].data()) + sq(bins.load[b].data());
  double best = before * (1 - 1e-12);
  size_t bi = A.size(), bj = 0;
  std::vector<double> na(dims), nb(dims);
  for (size_t i = 0; i < A.size(); ++i)
    for (size_t j = 0; j <= Bv.size(); ++j) {
      if (j == Bv.size() && A.size() <= Bv.size()) break;
      const double* wi = f.row(A[i]);
      const double* wj = j < Bv.size() ? f.row(Bv[j]) : nullptr;
      for (size_t d = 0; d < dims; ++d) {
        const double x = wj ? wj[d] : 0.0;
        na[d] = bins.load[a][d] - wi[d] + x;
        nb[d] = bins.load[b][d] + wi[d] - x;
      }
      const double t = sq(na.data()) + sq(nb.data());
      if (t < best && f.combine(na.data()) <= cap && f.combine(nb.data()) <= cap)
        best = t, bi = i, bj = j;
    }
  if (bi == A.size()) return false;
  exchange(f, bins, a, b, bi, bj);
  return true;
}

// Lowers the most loaded bin's combined cost (descend); then, never letting a bin exceed that
// cost, evens out every module's own work at once (pairwise moves and swaps lowering the sum over
// bins of Σ_module (work / the module's mean per bin)²: Entrain's "encoders and LLM both
// balanced"), which can open new moves for the descent; a few alternations.
void improve(const Flat& f, Bins& bins, int64_t budget) {
  const size_t dims = f.K + 1, B = bins.items.size();
  std::vector<double> inv_mean(dims, 0.0);
  for (size_t d = 0; d < dims; ++d) {
    double total = 0;
    for (const auto& l : bins.load) total += l[d];
    if (total > 0) inv_mean[d] = static_cast<double>(B) / total;
  }
  const auto combined = [&](const double* load) { return f.combine(load); };
  constexpr double kNoCap = std::numeric_limits<double>::infinity();
  descend(f, bins, combined, kNoCap, budget);
  for (int round = 0; round < 8; ++round) {
    const double cap = *std::max_element(bins.cost.begin(), bins.cost.end());
    bool smoothed = false;
    for (int pass = 0; pass < 20; ++pass) {
      bool any = false;
      for (size_t a = 0; a < B; ++a)
        for (size_t b = a + 1; b < B; ++b)
          any = smooth_pair(f, bins, a, b, inv_mean, cap, budget) || any;
      if (!any) break;
      smoothed = true;
    }
    if (!smoothed || !descend(f, bins, combined, kNoCap, budget)) break;
  }
}

// Max bin cost, then Σ cost² (evenness of the rest): lower is better.
std::pair<double, double> bins_key(const Bins& b) {
  double sq = 0;
  for (double c : b.cost) sq += c * c;
  return {*std::max_element(b.cost.begin(), b.cost.end()), sq};
}

// The best of LPT and consecutive, each improved.
Bins split_balanced(const Flat& f, const std::vector<int64_t>& items, int64_t parts,
                    int64_t budget) {
  Bins from_lpt = make_bins(f, lpt(f, items, parts));
  improve(f, from_lpt, budget);
  Bins from_order = make_bins(f, consecutive(items, parts));
  improve(f, from_order, budget);
  return bins_key(from_order) < bins_key(from_lpt) ? from_order : from_lpt;
}

Assignment in_order_assignment(int64_t n, int64_t D, int64_t M) {
  std::vector<int64_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  Assignment out;
  for (const auto& replica : consecutive(all, D)) out.push_back(consecutive(replica, M));
  return out;
}

void check_samples(const std::vector<SampleWork>& samples, const BalanceCost& cost) {
  const size_t K = samples.empty() ? cost.encoder_weight.size() : samples[0].encoder.size();
  WEFT_CHECK(cost.encoder_weight.empty() || cost.encoder_weight.size() == K, "[balance] cost has ",
             cost.encoder_weight.size(), " encoder weights for samples with ", K, " encoders");
  for (double x : cost.encoder_weight)
    WEFT_CHECK(std::isfinite(x) && x >= 0, "[balance] encoder weight ", x, " (expected >= 0)");
  WEFT_CHECK(std::isfinite(cost.llm_weight) && cost.llm_weight >= 0, "[balance] llm weight ",
             cost.llm_weight, " (expected >= 0)");
  for (size_t i = 0; i < samples.size(); ++i) {
    const SampleWork& s = samples[i];
    WEFT_CHECK(s.encoder.size() == K, "[balance] sample ", i, " has work for ", s.encoder.size(),
               " encoders, sample 0 for ", K);
    bool ok = std::isfinite(s.llm) && s.llm >= 0;
    for (double x : s.encoder) ok = ok && std::isfinite(x) && x >= 0;
    WEFT_CHECK(ok, "[balance] sample ", i, ": work must be finite and >= 0");
  }
}

}  // namespace

// --- assignment and stats ---------------------------------------------------------------------

double BatchBalance::max_microbatch_cost() const {
  double m = 0;
  for (const auto& r : microbatch_cost)
    for (double c : r) m = std::max(m, c);
  return m;
}
double BatchBalance::max_replica_cost() const {
  return replica_cost.empty() ? 0.0 : *std::max_element(replica_cost.begin(), replica_cost.end());
}
double BatchBalance::max_makespan() const {
  return makespan.empty() ? 0.0 : *std::max_element(makespan.begin(), makespan.end());
}

BatchBalance evaluate_assignment(const std::vector<SampleWork>& samples, const BalanceCost& cost,
                                 Assignment assignment, int64_t stages, double forward_fraction,
                                 int64_t virtual_stages) {
  check_samples(samples, cost);
  const int64_t n = static_cast<int64_t>(samples.size());
  const size_t K = samples.empty() ? 0 : samples[0].encoder.size();
  std::vector<int> seen(samples.size(), 0);
  BatchBalance out;
  for (size_t r = 0; r < assignment.size(); ++r) {
    SampleWork replica;
    replica.encoder.assign(K, 0.0);
    out.microbatch_work.emplace_back();
    out.microbatch_cost.emplace_back();
    for (size_t m = 0; m < assignment[r].size(); ++m) {
      auto& mb = assignment[r][m];
      std::sort(mb.begin(), mb.end());
      SampleWork w;
      w.encoder.assign(K, 0.0);
      for (int64_t s : mb) {
        WEFT_CHECK(s >= 0 && s < n, "[balance] replica ", r, " microbatch ", m, ": sample ", s,
                   " is not in [0, ", n, ")");
        WEFT_CHECK(seen[static_cast<size_t>(s)]++ == 0, "[balance] sample ", s,
                   " is assigned twice");
        w += samples[static_cast<size_t>(s)];
      }
      replica += w;
      out.microbatch_cost.back().push_back(cost(w));
      out.microbatch_work.back().push_back(std::move(w));
    }
    out.replica_cost.push_back(cost(replica));
    out.replica_work.push_back(std::move(replica));
    out.makespan.push_back(
        one_f_one_b_makespan(out.microbatch_cost.back(), stages, forward_fraction, virtual_stages));
  }
  for (int64_t s = 0; s < n; ++s)
    WEFT_CHECK(seen[static_cast<size_t>(s)] == 1, "[balance] sample ", s, " is not assigned");
  out.assignment = std::move(assignment);
  return out;
}

BatchBalance balance_batch(const std::vector<SampleWork>& samples, const BalanceCost& cost,
                           const BalanceOptions& o) {
  const int64_t n = static_cast<int64_t>(samples.size()), D = o.replicas, M = o.microbatches;
  WEFT_CHECK(D >= 1 && M >= 1, "[balance] replicas = ", D, ", microbatches = ", M,
             " (expected >= 1)");
  WEFT_CHECK(n % D == 0, "[balance] a global batch of ", n, " samples does not split evenly over ",
             D, " data-parallel replicas (every replica gets batch / dp samples)");
  WEFT_CHECK(n / D >= M, "[balance] each replica gets ", n, " / ", D, " = ", n / D,
             " samples, fewer than its ", M, " microbatches");
  WEFT_CHECK(o.pipeline_stages >= 1, "[balance] pipeline_stages = ", o.pipeline_stages,
             " (expected >= 1)");
  check_samples(samples, cost);
  WEFT_CHECK(o.virtual_stages >= 1, "[balance] virtual_stages = ", o.virtual_stages,
             " (expected >= 1)");
  const auto evaluate = [&](Assignment a) {
    return evaluate_assignment(samples, cost, std::move(a), o.pipeline_stages, o.forward_fraction,
                               o.virtual_stages);
  };
  BatchBalance best = evaluate(in_order_assignment(n, D, M));
  best.policy = o.policy;
  if (o.policy == BalancePolicy::kInOrder) return best;

  Flat f;
  f.cost = &cost;
  f.K = samples.empty() ? 0 : samples[0].encoder.size();
  for (const SampleWork& s : samples) {
    f.v.insert(f.v.end(), s.encoder.begin(), s.encoder.end());
    f.v.push_back(s.llm);
  }
  std::vector<int64_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  // Replicas from LPT and from in_order, each improved; then each replica's microbatches.
  const auto key = [](const BatchBalance& b) {
    return std::make_pair(b.max_microbatch_cost(), b.max_replica_cost());
  };
  bool fallback = true;
  // Bounds on the candidate moves each improvement may price (~10 ns each): large batches stop
  // early with what they reached, deterministically.
  constexpr int64_t kReplicaBudget = 2'000'000;
  const int64_t microbatch_budget = std::max<int64_t>(200'000, 4'000'000 / D);
  for (auto replicas : {lpt(f, all, D), consecutive(all, D)}) {
    Bins r = make_bins(f, std::move(replicas));
    improve(f, r, kReplicaBudget);
    Assignment a;
    for (auto& items : r.items) {
      std::sort(items.begin(), items.end());
      a.push_back(split_balanced(f, items, M, microbatch_budget).items);
    }
    BatchBalance b = evaluate(std::move(a));
    if (key(b) < key(best)) best = std::move(b), fallback = false;
  }
  // Run order for 1F1B (the split stays what it is).
  if (o.pipeline_stages > 1) {
    Assignment ordered;
    for (size_t r = 0; r < best.assignment.size(); ++r) {
      ordered.emplace_back();
      for (int64_t i : order_for_1f1b(best.microbatch_cost[r], o.pipeline_stages,
                                      o.forward_fraction, o.virtual_stages))
        ordered.back().push_back(best.assignment[r][static_cast<size_t>(i)]);
    }
    best = evaluate(std::move(ordered));
  }
  best.policy = BalancePolicy::kBalanced;
  best.in_order_fallback = fallback;
  return best;
}

// --- 1F1B ---------------------------------------------------------------------------------------

namespace {

// one_f_one_b_makespan of checked costs, on the ranks' schedules `ops`.
double replay_makespan(const std::vector<std::vector<PipelineOp>>& ops,
                       const std::vector<double>& cost, int64_t P, int64_t vp, double ff) {
  const double V = static_cast<double>(P * vp);  // virtual stages; rank s runs s, s + P, ...
  const std::vector<double> ends = replay_schedule(
      ops, vp, static_cast<int64_t>(cost.size()), std::vector<double>(static_cast<size_t>(P), 0),
      [&](const PipelineOp& op, int64_t) {
        const double c = cost[static_cast<size_t>(op.microbatch)];
        return (op.forward ? ff : 1 - ff) * c / V;
      },
      [](int64_t, int64_t) { return 0.0; }, [](const PipelineOp&, int64_t) { return 0.0; },
      [](const PipelineOp&, int64_t) { return 0.0; }, nullptr, nullptr);
  return *std::max_element(ends.begin(), ends.end());
}

}  // namespace

double one_f_one_b_makespan(const std::vector<double>& cost, int64_t P, double ff, int64_t vp) {
  WEFT_CHECK(P >= 1, "[1f1b] stages = ", P, " (expected >= 1)");
  WEFT_CHECK(vp == 1 || (vp > 1 && P > 1), "[1f1b] virtual_stages = ", vp,
             " (expected 1, or more with stages > 1)");
  WEFT_CHECK(ff >= 0 && ff <= 1, "[1f1b] forward_fraction = ", ff, " (expected in [0, 1])");
  for (double c : cost)
    WEFT_CHECK(std::isfinite(c) && c >= 0, "[1f1b] microbatch cost ", c, " (expected >= 0)");
  const int64_t m = static_cast<int64_t>(cost.size());
  if (m == 0) return 0;
  return replay_makespan(pipeline_schedules(P, vp, m, true), cost, P, vp, ff);
}

std::vector<int64_t> order_for_1f1b(const std::vector<double>& cost, int64_t P, double ff,
                                    int64_t vp) {
  const int64_t m = static_cast<int64_t>(cost.size());
  std::vector<int64_t> best(static_cast<size_t>(m));
  std::iota(best.begin(), best.end(), 0);
  one_f_one_b_makespan(cost, P, ff, vp);  // validates
  if (m <= 1 || P == 1) return best;
  // The schedules depend on the microbatch count alone: built once for every order tried.
  const std::vector<std::vector<PipelineOp>> ops = pipeline_schedules(P, vp, m, true);
  const auto eval = [&](const std::vector<int64_t>& order) {
    std::vector<double> c;
    for (int64_t i : order) c.push_back(cost[static_cast<size_t>(i)]);
    return replay_makespan(ops, c, P, vp, ff);
  };
  double best_time = eval(best);
  const double tol = 1e-12 * best_time;
  const auto consider = [&](const std::vector<int64_t>& order) {
    const double t = eval(order);
    if (t < best_time - tol) best = order, best_time = t;
  };
  std::vector<int64_t> asc(best);
  std::stable_sort(asc.begin(), asc.end(), [&](int64_t a, int64_t b) {
    return cost[static_cast<size_t>(a)] < cost[static_cast<size_t>(b)];
  });
  // Lightest first, next lightest last; the middle alternates heavy and light (heavy first), or
  // runs descending, or ascending.
  {
    std::vector<int64_t> tent{asc[0]};
    for (size_t lo = 2, hi = asc.size() - 1, k = 0; lo <= hi; ++k)
      tent.push_back(k % 2 == 0 ? asc[hi--] : asc[lo++]);
    tent.push_back(asc[1]);
    consider(tent);
    std::vector<int64_t> desc{asc[0]};
    desc.insert(desc.end(), asc.rbegin(), asc.rend() - 2);
    desc.push_back(asc[1]);
    consider(desc);
    std::vector<int64_t> up{asc[0]};
    up.insert(up.end(), asc.begin() + 2, asc.end());
    up.push_back(asc[1]);
    consider(up);
  }
  // Swaps of two microbatches and moves of one to another position while the makespan strictly
  // drops (first improvement, bounded).
  int64_t evals = 0;
  const int64_t max_evals = std::max<int64_t>(2000, 4000000 / std::max<int64_t>(1, m * P * vp));
  for (bool improved = true; improved && evals < max_evals;) {
    improved = false;
    for (int64_t i = 0; i < m && evals < max_evals; ++i)
      for (int64_t j = 0; j < m && evals < max_evals; ++j) {
        if (i == j) continue;
        const double before = best_time;
        std::vector<int64_t> trial(best);
        if (i < j) {
          std::swap(trial[static_cast<size_t>(i)], trial[static_cast<size_t>(j)]);
          consider(trial), ++evals;
          trial = best;
        }
        if (best_time == before && std::abs(i - j) > 1) {  // adjacent moves are swaps
          const int64_t x = trial[static_cast<size_t>(i)];
          trial.erase(trial.begin() + i);
          trial.insert(trial.begin() + j, x);
          consider(trial), ++evals;
        }
        improved = improved || best_time < before;
      }
  }
  return best;
}

// --- reporting --------------------------------------------------------------------------------

Spread spread(const std::vector<double>& v) {
  if (v.empty()) return {};
  const double n = static_cast<double>(v.size());
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / n;
  if (mean == 0) return {};
  double var = 0;
  for (double x : v) var += (x - mean) * (x - mean);
  return {*std::max_element(v.begin(), v.end()) / mean, std::sqrt(var / n) / mean};
}

namespace {
nlohmann::ordered_json spread_json(const std::vector<double>& v) {
  const Spread s = spread(v);
  return {{"max_over_mean", s.max_over_mean}, {"cv", s.cv}};
}

// Spreads of the combined cost, the LLM, all encoders together and each encoder.
nlohmann::ordered_json spreads_json(const std::vector<const SampleWork*>& works,
                                    const std::vector<double>& costs,
                                    const std::vector<std::string>& names) {
  nlohmann::ordered_json j;
  j["combined"] = spread_json(costs);
  std::vector<double> llm, enc;
  for (const SampleWork* w : works) llm.push_back(w->llm), enc.push_back(w->encoder_total());
  j["llm"] = spread_json(llm);
  j["encoder"] = spread_json(enc);
  for (size_t k = 0; k < names.size(); ++k) {
    std::vector<double> one;
    for (const SampleWork* w : works) one.push_back(w->encoder[k]);
    j[names[k]] = spread_json(one);
  }
  return j;
}
}  // namespace

nlohmann::ordered_json balance_json(const BatchBalance& b,
                                    const std::vector<std::string>& encoder_names) {
  const size_t K = b.replica_work.empty() ? 0 : b.replica_work[0].encoder.size();
  std::vector<std::string> names = encoder_names;
  for (size_t k = names.size(); k < K; ++k) names.push_back("encoder" + std::to_string(k));
  names.resize(K);
  nlohmann::ordered_json j;
  j["policy"] = to_string(b.policy);
  j["in_order_fallback"] = b.in_order_fallback;
  j["replica_count"] = b.assignment.size();
  j["microbatches_per_replica"] = b.assignment.empty() ? 0 : b.assignment[0].size();
  j["objective"] = b.max_microbatch_cost();
  j["max_replica_cost"] = b.max_replica_cost();
  j["max_makespan"] = b.max_makespan();
  std::vector<const SampleWork*> mb_work, replica_work;
  std::vector<double> mb_cost;
  for (size_t r = 0; r < b.microbatch_work.size(); ++r)
    for (size_t m = 0; m < b.microbatch_work[r].size(); ++m)
      mb_work.push_back(&b.microbatch_work[r][m]), mb_cost.push_back(b.microbatch_cost[r][m]);
  for (const SampleWork& w : b.replica_work) replica_work.push_back(&w);
  j["microbatch_spread"] = spreads_json(mb_work, mb_cost, names);
  j["replica_spread"] = spreads_json(replica_work, b.replica_cost, names);
  nlohmann::ordered_json replicas = nlohmann::ordered_json::array();
  for (size_t r = 0; r < b.assignment.size(); ++r) {
    nlohmann::ordered_json mbs = nlohmann::ordered_json::array();
    for (size_t m = 0; m < b.assignment[r].size(); ++m)
      mbs.push_back({{"samples", b.assignment[r][m]},
                     {"cost", b.microbatch_cost[r][m]},
                     {"llm", b.microbatch_work[r][m].llm},
                     {"encoder", b.microbatch_work[r][m].encoder}});
    replicas.push_back({{"replica", r},
                        {"cost", b.replica_cost[r]},
                        {"llm", b.replica_work[r].llm},
                        {"encoder", b.replica_work[r].encoder},
                        {"makespan", b.makespan[r]},
                        {"microbatches", std::move(mbs)}});
  }
  j["replicas"] = std::move(replicas);
  return j;
}

}  // namespace weft::plan
