// Layout search (search.h): branch and bound over the search space (search_space.h), simulating
// what the bound cannot rule out, and the report of why the winner won.
#include "weft/plan/search.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "weft/core/error.h"
#include "weft/plan/profile.h"
#include "weft/plan/search_space.h"

namespace weft::plan {

namespace {

using Clock = std::chrono::steady_clock;
using search_space::Bound;
using search_space::Node;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Under partial recomputation, the fastest layouts whose counts (and cuts) are fitted after the
// search, however few it reports.
constexpr int64_t kRefined = 5;

// ---- reporting -------------------------------------------------------------------------------

struct Breakdown {
  double compute = 0, comm = 0, collective = 0, optimizer = 0, idle = 0, peak = 0;
};

Breakdown breakdown(const SimResult& r) {
  Breakdown b;
  for (const RankReport& k : r.ranks) {
    b.compute += k.busy_seconds - k.comm_seconds;
    b.comm += k.comm_seconds;
    b.collective += k.collective_seconds;
    b.optimizer += k.optimizer_seconds;
    b.idle += r.step_seconds - k.busy_seconds - k.collective_seconds - k.optimizer_seconds -
              k.data_seconds;
    b.peak = std::max(b.peak, k.peak_memory_bytes);
  }
  const double n = static_cast<double>(std::max<size_t>(r.ranks.size(), 1));
  b.compute /= n, b.comm /= n, b.collective /= n, b.optimizer /= n, b.idle /= n;
  return b;
}

std::string fixed(double v, int digits) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(digits);
  os << v;
  return os.str();
}

// A duration with a unit that keeps 3-4 significant digits: "4.77 s", "12.3 ms", "850 us".
std::string duration(double seconds) {
  const double a = std::fabs(seconds);
  if (a == 0) return "0";
  if (a >= 1) return fixed(seconds, a >= 100 ? 1 : 3) + " s";
  if (a >= 1e-3) return fixed(seconds * 1e3, a >= 0.1 ? 1 : 3) + " ms";
  return fixed(seconds * 1e6, 1) + " us";
}

std::string explain(const Spec& spec, const Cluster& cluster, const SearchResult& r) {
  std::ostringstream os;
  const Evaluation& win = r.best.front();
  if (r.best.size() < 2) {
    os << "the only layout of the space that fits";
  } else {
    const Evaluation& run = r.best[1];
    const Breakdown a = breakdown(win.sim), b = breakdown(run.sim);
    const double slower = run.sim.step_seconds / win.sim.step_seconds - 1;
    struct Part {
      const char* what;
      double mine, theirs;
    };
    const Part parts[] = {{"compute per GPU", a.compute, b.compute},
                          {"tensor/context-parallel communication", a.comm, b.comm},
                          {"exposed gradient reduction", a.collective, b.collective},
                          {"the optimizer step", a.optimizer, b.optimizer},
                          {"pipeline bubbles and waiting", a.idle, b.idle}};
    const Part* worst = &parts[0];
    for (const Part& p : parts)
      if (p.theirs - p.mine > worst->theirs - worst->mine) worst = &p;
    os << "the runner-up (" << describe(spec, run.candidate) << ") is " << fixed(100 * slower, 1)
       << "% slower; it loses most on " << worst->what << ": " << duration(worst->theirs) << " vs "
       << duration(worst->mine) << " per GPU";
    if (worst == &parts[4])
      os << " (LLM bubble " << fixed(100 * run.sim.bubble_fraction, 1) << "% vs "
         << fixed(100 * win.sim.bubble_fraction, 1) << "%)";
    if (run.candidate.world_size != win.candidate.world_size)
      os << "; it uses " << run.candidate.world_size << " GPUs, the winner "
         << win.candidate.world_size;
  }
  if (!r.over_memory.empty()) {
    const Evaluation& m = r.over_memory.front();
    os << "; faster but over memory: " << describe(spec, m.candidate) << " ("
       << duration(m.sim.step_seconds) << ") needs " << fixed(breakdown(m.sim).peak / kGiB, 1)
       << " GiB per GPU > " << fixed(cluster.device.usable_memory_bytes() / kGiB, 1) << " GiB";
    if (cluster.device.reserved_bytes > 0)
      os << " (" << fixed(cluster.device.memory_bytes / kGiB, 1) << " less "
         << fixed(cluster.device.reserved_bytes / kGiB, 1) << " reserved)";
  }
  return os.str();
}

// Faster, or as fast (within rounding) with fewer microbatches: larger ones run their kernels more
// efficiently, and pay each op's fixed overhead fewer times, than a FLOP model sees (on this
// machine's CPU ranks 3.5x, bench/RESULTS.md "Layout search on a measured profile").
// Step times are compared in steps of a relative 1e-9 (a key, so that this stays an ordering).
bool preferred(const Evaluation& a, const Evaluation& b) {
  const auto key = [](const Evaluation& e) {
    const double t = e.sim.step_seconds;
    return std::make_pair(
        t > 0 ? std::llround(std::log(t) * 1e9) : std::numeric_limits<long long>::min(),
        e.candidate.microbatches);
  };
  return key(a) < key(b);
}

// The layout part of a candidate (placement and module layouts): table rows are distinct in it.
std::string layout_key(const Candidate& c) {
  std::ostringstream os;
  os << c.placement;
  for (const LayoutSpec& l : c.layouts)
    os << '|' << l.tp << ',' << l.cp << ',' << l.pp << ',' << l.dp << ',' << l.ep << ',' << l.etp;
  return os.str();
}

class Searcher {
 public:
  Searcher(const Spec& spec, const Cluster& cluster, const SearchOptions& options)
      : spec_(spec), cl_(cluster), o_(options), space_(spec, cluster, options) {
    WEFT_CHECK(o_.gap >= 0, "[plan] the optimality gap must be >= 0, got ", o_.gap);
    WEFT_CHECK(o_.batch >= 1, "[plan] the simulation batch must be >= 1, got ", o_.batch);
    WEFT_CHECK(o_.threads >= 0, "[plan] threads must be >= 0 (0: every core), got ", o_.threads);
  }
  SearchResult run();
  std::vector<BoundedCandidate> enumerate();

 private:
  const Spec& spec_;
  const Cluster& cl_;
  const SearchOptions& o_;
  search_space::Space space_;
  const int64_t E_ = space_.encoders();
  const int64_t max_ranks_ = space_.max_ranks();

  Bound bound(const Node& n) const { return space_.bound(n); }
  bool redundant(const Node& n) const { return space_.redundant(n); }
  bool leaf(const Node& n) const { return space_.leaf(n); }
  Candidate to_candidate(const Node& n) const { return space_.to_candidate(n); }
  void roots(const std::function<void(Node&&)>& emit) { space_.roots(emit); }
  void children(const Node& n, const std::function<void(Node&&)>& emit) {
    space_.children(n, emit);
  }
  // The leaves batch[i] = (index into nodes, bound) simulated, on up to o_.threads threads; in
  // batch order.
  std::vector<Evaluation> evaluate_all(const std::vector<std::pair<size_t, double>>& batch,
                                       const std::vector<Node>& nodes) const;
};

std::vector<Evaluation> Searcher::evaluate_all(const std::vector<std::pair<size_t, double>>& batch,
                                               const std::vector<Node>& nodes) const {
  std::vector<Candidate> candidates;
  for (const auto& [index, bound] : batch) candidates.push_back(to_candidate(nodes[index]));
  std::vector<Evaluation> out(batch.size());
  std::vector<std::exception_ptr> failed(batch.size());
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t i = next++; i < batch.size(); i = next++) {
      try {
        out[i] = evaluate(spec_, cl_, candidates[i], o_.sim, o_.profile);
        out[i].lower_bound = batch[i].second;
      } catch (...) {
        failed[i] = std::current_exception();
      }
    }
  };
  int64_t threads =
      o_.threads > 0 ? o_.threads : static_cast<int64_t>(std::thread::hardware_concurrency());
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, static_cast<int64_t>(batch.size())));
  std::vector<std::thread> pool;
  try {
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  } catch (const std::system_error&) {  // no more threads: the ones started and this one do it
  }
  work();
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
  return out;
}

}  // namespace

std::vector<BoundedCandidate> Searcher::enumerate() {
  std::vector<BoundedCandidate> out;
  const double mem = cl_.device.usable_memory_bytes();
  // Each node with the bounds of the nodes above it (the search prunes on them too).
  struct Open {
    Node node;
    std::vector<double> seconds, memory;
  };
  std::vector<Open> stack;
  roots([&](Node&& n) { stack.push_back({std::move(n), {}, {}}); });
  std::reverse(stack.begin(), stack.end());
  while (!stack.empty()) {
    Open o = std::move(stack.back());
    stack.pop_back();
    const Node& n = o.node;
    if (leaf(n)) {
      if (redundant(n)) continue;
      const Bound b = bound(n);
      if (!b.feasible) continue;
      out.push_back({to_candidate(n), b.seconds, b.memory, b.memory <= mem, std::move(o.seconds),
                     std::move(o.memory)});
      continue;
    }
    // Infeasible (the search drops it): no completion of it may be feasible either.
    const Bound b = bound(n);
    const double inf = std::numeric_limits<double>::infinity();
    o.seconds.push_back(b.feasible ? b.seconds : inf);
    o.memory.push_back(b.feasible ? b.memory : inf);
    std::vector<Node> kids;
    children(n, [&](Node&& c) { kids.push_back(std::move(c)); });
    for (auto it = kids.rbegin(); it != kids.rend(); ++it)
      stack.push_back({std::move(*it), o.seconds, o.memory});
  }
  return out;
}

SearchResult Searcher::run() {
  const auto start = Clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  SearchResult result;
  SearchStats& st = result.stats;
  const double mem = cl_.device.usable_memory_bytes();
  std::vector<Node> nodes;
  using Entry = std::pair<double, size_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> open;
  std::map<std::string, size_t> distinct;  // layout key → index in result.best
  std::vector<Evaluation> over;            // simulated, over memory
  double over_bound = kInf, min_memory = kInf;
  Node over_node;
  std::string min_memory_what;

  const auto threshold = [&] {
    if (result.best.empty()) return kInf;
    const double best = result.best.front().sim.step_seconds;
    double t = best * (1 + o_.report_slack);
    if (static_cast<int64_t>(result.best.size()) >= o_.top)
      t = std::min(t, result.best[static_cast<size_t>(o_.top - 1)].sim.step_seconds);
    return std::max(t, best);
  };
  const auto consider = [&](Node&& n) {
    const bool is_leaf = leaf(n);
    if (is_leaf && redundant(n)) return;
    const Bound b = space_.bound(n, threshold() / (1 + o_.gap), over_bound);
    ++st.nodes;
    if (!b.feasible) return;
    if (b.memory > mem) {
      ++st.memory_filtered;
      if (is_leaf && b.memory < min_memory)
        min_memory = b.memory, min_memory_what = describe(spec_, to_candidate(n));
      if (b.seconds < over_bound) over_bound = b.seconds, over_node = space_.settled(n);
      return;
    }
    if (b.seconds * (1 + o_.gap) >= threshold()) return;
    nodes.push_back(std::move(n));
    open.push({b.seconds, nodes.size() - 1});
  };
  roots(consider);

  bool stopped = false;  // by the simulation or time budget
  while (!open.empty() && !stopped) {
    // The next leaves the search would take, up to a batch, simulated together (interior nodes
    // met on the way are expanded as they would be).
    std::vector<std::pair<size_t, double>> batch;
    while (!open.empty() && static_cast<int64_t>(batch.size()) < o_.batch) {
      const auto [b, index] = open.top();
      st.open_bound = b;
      if (b * (1 + o_.gap) >= threshold()) break;
      if (st.simulated + static_cast<int64_t>(batch.size()) >= o_.max_simulations ||
          (elapsed() > o_.time_budget_seconds && !result.best.empty())) {
        stopped = true;
        break;
      }
      open.pop();
      if (!leaf(nodes[index])) {
        const Node n = nodes[index];
        children(n, consider);
      } else {
        batch.push_back({index, b});
      }
    }
    if (batch.empty()) break;
    std::vector<Evaluation> evaluated = evaluate_all(batch, nodes);
    for (Evaluation& e : evaluated) {
      ++st.simulated;
      if (!e.sim.memory_fits) {
        ++st.simulated_over_memory;
        over.push_back(std::move(e));
        continue;
      }
      const std::string key = layout_key(e.candidate);
      auto it = distinct.find(key);
      if (it != distinct.end()) {
        if (!preferred(e, result.best[it->second])) continue;
        result.best.erase(result.best.begin() + static_cast<std::ptrdiff_t>(it->second));
      }
      result.best.push_back(std::move(e));
      std::stable_sort(result.best.begin(), result.best.end(), preferred);
      distinct.clear();
      for (size_t i = 0; i < result.best.size(); ++i)
        distinct[layout_key(result.best[i].candidate)] = i;
    }
  }
  if (stopped)
    st.complete = !result.best.empty() &&
                  st.open_bound * (1 + o_.gap) >= result.best.front().sim.step_seconds;
  if (open.empty()) st.open_bound = kInf;
  if (result.best.empty()) {
    std::ostringstream why;
    why << spec_.source << ": no layout fits " << max_ranks_ << " " << cl_.device.name
        << " devices of " << fixed(mem / kGiB, 1) << " GiB";
    if (min_memory < kInf)
      why << "; the smallest per-device peak found is " << fixed(min_memory / kGiB, 1) << " GiB ("
          << min_memory_what << ")";
    if (!st.complete) why << " within the search budget (" << st.simulated << " simulations)";
    WEFT_FAIL("[plan] ", why.str());
  }
  if (o_.recompute && o_.partial_recompute) {
    // Each stage recomputing what its peak needs, on the plan's cut and on the cut the bound
    // moves with the counts (Space::rebalanced), the faster, for the fastest layouts (at least
    // kRefined: a runner-up may win once refined).
    const size_t refined =
        std::min(result.best.size(), static_cast<size_t>(std::max<int64_t>(o_.top, kRefined)));
    for (size_t i = 0; i < refined; ++i) {
      Evaluation& e = result.best[i];
      Evaluation fitted = refine_recompute(spec_, cl_, e, o_.sim, &st.simulated, o_.profile);
      std::optional<Candidate> moved;
      if (o_.move_boundaries) moved = space_.rebalanced(e);
      if (moved) {
        Evaluation r = evaluate(spec_, cl_, *moved, o_.sim, o_.profile);
        ++st.simulated;
        r = refine_recompute(spec_, cl_, std::move(r), o_.sim, &st.simulated, o_.profile);
        if (r.sim.memory_fits && r.sim.step_seconds < fitted.sim.step_seconds) {
          r.lower_bound = std::min(e.lower_bound, r.sim.step_seconds);
          fitted = std::move(r);
        }
      }
      e = std::move(fitted);
    }
    result.best.resize(refined);
    std::stable_sort(result.best.begin(), result.best.end(), preferred);
  }
  if (static_cast<int64_t>(result.best.size()) > o_.top)
    result.best.resize(static_cast<size_t>(o_.top));
  // What the memory limit costs: the fastest candidate over memory, when it beats the winner.
  const double win = result.best.front().sim.step_seconds;
  if (over_bound < win && o_.max_simulations > st.simulated) {
    Node leaf = over_node;  // completed the way the bound prefers, memory ignored
    while (!space_.leaf(leaf)) {
      Node next;
      double next_bound = kInf;
      children(leaf, [&](Node&& c) {
        const Bound cb = bound(c);
        if (cb.feasible && cb.seconds < next_bound) next_bound = cb.seconds, next = std::move(c);
      });
      if (next_bound == kInf) break;
      leaf = space_.settled(next);  // a pending choice at its fastest
    }
    if (space_.leaf(leaf)) {
      Evaluation e = evaluate(spec_, cl_, to_candidate(leaf), o_.sim, o_.profile);
      e.lower_bound = over_bound;
      ++st.simulated;
      over.push_back(std::move(e));
    }
  }
  for (Evaluation& e : over)
    if (e.sim.step_seconds < win &&
        (result.over_memory.empty() ||
         e.sim.step_seconds < result.over_memory.front().sim.step_seconds))
      result.over_memory = {std::move(e)};
  st.seconds = elapsed();
  result.why = explain(spec_, cl_, result);
  return result;
}

namespace {
// The options as the search runs them: with a profile (checked against the spec), the simulator
// options it implies.
SearchOptions prepared(const Spec& spec, SearchOptions o) {
  if (o.profile) {
    check_profile(*o.profile, spec);
    o.sim = profile_sim_options(*o.profile, spec, o.sim);
  }
  check_data_shape(spec, o.sim.data, spec.source);
  return o;
}
}  // namespace

SearchResult search(const Spec& spec, const Cluster& cluster, const SearchOptions& options) {
  const SearchOptions o = prepared(spec, options);
  Searcher s(spec, cluster, o);
  return s.run();
}

std::vector<BoundedCandidate> enumerate_candidates(const Spec& spec, const Cluster& cluster,
                                                   const SearchOptions& options) {
  const SearchOptions o = prepared(spec, options);
  Searcher s(spec, cluster, o);
  return s.enumerate();
}

}  // namespace weft::plan
