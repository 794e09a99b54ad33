#include "weft/plan/cp_split.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <unordered_map>

#include "weft/core/error.h"
#include "weft/plan/flops.h"

namespace weft::plan {

SequenceDesc make_sequence(int64_t length, const std::vector<Span>& modality_spans,
                           const std::vector<int64_t>& doc_starts, int64_t padding_from) {
  WEFT_CHECK(length >= 1, "[make_sequence] length must be >= 1, got ", length);
  const int64_t valid = padding_from < 0 ? length : padding_from;
  WEFT_CHECK(padding_from == -1 || (padding_from >= 1 && padding_from <= length),
             "[make_sequence] padding_from must be -1 (no padding) or in [1, ", length, "], got ",
             padding_from);

  SequenceDesc seq;
  seq.tokens.assign(static_cast<size_t>(length), TokenDesc{});
  // Documents.
  std::vector<int64_t> starts{0};
  for (size_t i = 0; i < doc_starts.size(); ++i) {
    const int64_t s = doc_starts[i];
    if (i == 0 && s == 0) continue;
    WEFT_CHECK(s > starts.back() && s < valid, "[make_sequence] doc_starts[", i, "] = ", s,
               " must be greater than the previous start ", starts.back(),
               " and below the first padding position ", valid);
    starts.push_back(s);
  }
  starts.push_back(valid);
  for (size_t d = 0; d + 1 < starts.size(); ++d)
    for (int64_t p = starts[d]; p < starts[d + 1]; ++p)
      seq.tokens[static_cast<size_t>(p)].doc = static_cast<int32_t>(d);
  for (int64_t p = valid; p < length; ++p) seq.tokens[static_cast<size_t>(p)].doc = -1;

  // Items, numbered in position order.
  std::vector<size_t> order(modality_spans.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return modality_spans[a].begin < modality_spans[b].begin;
  });
  int64_t prev_end = 0;
  for (size_t n = 0; n < order.size(); ++n) {
    const size_t i = order[n];
    const Span& s = modality_spans[i];
    WEFT_CHECK(s.begin >= 0 && s.begin < s.end && s.end <= valid, "[make_sequence] modality span ",
               i, " [", s.begin, ", ", s.end, ") must be non-empty and inside [0, ", valid, ")");
    WEFT_CHECK(s.begin >= prev_end, "[make_sequence] modality span ", i, " [", s.begin, ", ", s.end,
               ") overlaps the previous span, which ends at ", prev_end);
    const int32_t doc = seq.tokens[static_cast<size_t>(s.begin)].doc;
    WEFT_CHECK(seq.tokens[static_cast<size_t>(s.end - 1)].doc == doc,
               "[make_sequence] modality span ", i, " [", s.begin, ", ", s.end,
               ") crosses a document start (an item belongs to one document)");
    for (int64_t p = s.begin; p < s.end; ++p)
      seq.tokens[static_cast<size_t>(p)].item = static_cast<int32_t>(n);
    prev_end = s.end;
  }
  return seq;
}

std::vector<int64_t> visible_pairs_per_token(const SequenceDesc& seq) {
  const size_t S = seq.tokens.size();
  std::vector<int64_t> pairs(S, 1);
  // Keys of q's document at or before q: a running count per document.
  std::unordered_map<int32_t, int64_t> doc_seen;
  // Keys of q's item after q: the item's total in q's document minus those seen so far.
  auto key = [](const TokenDesc& t) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(t.doc)) << 32) |
           static_cast<uint32_t>(t.item);
  };
  std::unordered_map<uint64_t, int64_t> item_total, item_seen;
  for (const TokenDesc& t : seq.tokens)
    if (t.doc >= 0 && t.item >= 0) ++item_total[key(t)];
  for (size_t q = 0; q < S; ++q) {
    const TokenDesc& t = seq.tokens[q];
    if (t.doc < 0) continue;  // padding sees only itself
    pairs[q] = ++doc_seen[t.doc];
    if (t.item >= 0) {
      const uint64_t k = key(t);
      pairs[q] += item_total[k] - ++item_seen[k];
    }
  }
  return pairs;
}

std::vector<int64_t> attention_pairs_per_block(const SequenceDesc& seq, int64_t block_size) {
  WEFT_CHECK(block_size >= 1, "[cp_split] block_size must be >= 1, got ", block_size);
  const std::vector<int64_t> pairs = visible_pairs_per_token(seq);
  const int64_t S = seq.size();
  std::vector<int64_t> blocks(static_cast<size_t>((S + block_size - 1) / block_size), 0);
  for (int64_t q = 0; q < S; ++q)
    blocks[static_cast<size_t>(q / block_size)] += pairs[static_cast<size_t>(q)];
  return blocks;
}

CpCostModel make_cp_cost_model(const LlmSpec& llm) {
  CpCostModel c;
  // flops.h prices attention as 2·q·L·ΣL_i² for ≈ ΣL_i²/2 causal pairs: 2x that per pair.
  c.attn_cost_per_pair = 2.0 * llm_forward_flops(llm, LlmTokens{0, 0, 1.0});
  c.linear_cost_per_token = llm_forward_flops(llm, LlmTokens{1, 0, 0.0});
  return c;
}

std::vector<double> block_work(const SequenceDesc& seq, int64_t block_size,
                               const CpCostModel& cost) {
  const std::vector<int64_t> pairs = attention_pairs_per_block(seq, block_size);
  const int64_t S = seq.size();
  std::vector<double> work(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    const int64_t b = static_cast<int64_t>(i) * block_size;
    const int64_t tokens = std::min(b + block_size, S) - b;
    work[i] = static_cast<double>(pairs[i]) * cost.attn_cost_per_pair +
              static_cast<double>(tokens) * cost.linear_cost_per_token;
  }
  return work;
}

// --- policies ------------------------------------------------------------------------------

namespace {

constexpr CpPolicy kPolicies[] = {CpPolicy::kContiguous, CpPolicy::kZigzag, CpPolicy::kLpt,
                                  CpPolicy::kBalanced};
// Exact search is tried up to this size; kExactNodeBudget bounds its worst case (it then keeps
// the best assignment found, still never worse than its seed).
constexpr int64_t kExactMaxBlocks = 16;
constexpr int64_t kExactMaxRanks = 4;
constexpr int64_t kExactNodeBudget = 2'000'000;

using Assignment = std::vector<int64_t>;  // block -> rank

std::vector<double> loads_of(const std::vector<double>& work, const Assignment& a, int64_t cp) {
  std::vector<double> load(static_cast<size_t>(cp), 0.0);
  for (size_t b = 0; b < work.size(); ++b) load[static_cast<size_t>(a[b])] += work[b];
  return load;
}

double makespan_of(const std::vector<double>& work, const Assignment& a, int64_t cp) {
  const std::vector<double> load = loads_of(work, a, cp);
  return *std::max_element(load.begin(), load.end());
}

// Rank r of `parts` equal-as-possible slices over n items gets [⌊r·n/parts⌋, ⌊(r+1)·n/parts⌋).
int64_t slice_begin(int64_t r, int64_t n, int64_t parts) { return r * n / parts; }

Assignment contiguous(int64_t n, int64_t cp) {
  Assignment a(static_cast<size_t>(n));
  for (int64_t r = 0; r < cp; ++r)
    for (int64_t b = slice_begin(r, n, cp); b < slice_begin(r + 1, n, cp); ++b)
      a[static_cast<size_t>(b)] = r;
  return a;
}

Assignment zigzag(int64_t n, int64_t cp) {
  Assignment a(static_cast<size_t>(n));
  const int64_t chunks = 2 * cp;
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t b = slice_begin(c, n, chunks); b < slice_begin(c + 1, n, chunks); ++b)
      a[static_cast<size_t>(b)] = c < cp ? c : chunks - 1 - c;
  return a;
}

// Block indices by work, largest first (ties keep index order).
std::vector<size_t> by_work_descending(const std::vector<double>& work) {
  std::vector<size_t> order(work.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return work[x] > work[y]; });
  return order;
}

Assignment lpt(const std::vector<double>& work, int64_t cp) {
  const std::vector<size_t> order = by_work_descending(work);
  Assignment a(work.size());
  std::vector<double> load(static_cast<size_t>(cp), 0.0);
  for (size_t b : order) {
    const size_t r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    a[b] = static_cast<int64_t>(r);
    load[r] += work[b];
  }
  return a;
}

// Local search: take the most-loaded rank M; among all moves of one of its blocks to another
// rank r and all swaps of one of its blocks with a lighter block of r, apply the one with the
// smallest max(load[M], load[r]) afterwards, if that is strictly below load[M]. Each step
// strictly decreases the sorted load vector, so the makespan never increases and it terminates.
void improve(const std::vector<double>& work, int64_t cp, Assignment& a) {
  const size_t n = work.size();
  std::vector<double> load = loads_of(work, a, cp);
  const int64_t max_steps = 100 * static_cast<int64_t>(n) * cp + 100;
  for (int64_t step = 0; step < max_steps; ++step) {
    const int64_t M = std::max_element(load.begin(), load.end()) - load.begin();
    const double lm = load[static_cast<size_t>(M)];
    const double eps = 1e-12 * lm;
    double best = lm - eps;
    int64_t best_b = -1, best_b2 = -1, best_r = -1;  // best_b2 < 0: a move
    for (size_t b = 0; b < n; ++b) {
      if (a[b] != M) continue;
      const double wb = work[b];
      for (int64_t r = 0; r < cp; ++r) {
        if (r == M) continue;
        const double lr = load[static_cast<size_t>(r)];
        const double moved = std::max(lm - wb, lr + wb);
        if (moved < best) best = moved, best_b = static_cast<int64_t>(b), best_b2 = -1, best_r = r;
      }
      for (size_t b2 = 0; b2 < n; ++b2) {
        if (a[b2] == M || work[b2] >= wb) continue;
        const double d = wb - work[b2];
        const double swapped = std::max(lm - d, load[static_cast<size_t>(a[b2])] + d);
        if (swapped < best)
          best = swapped, best_b = static_cast<int64_t>(b), best_b2 = static_cast<int64_t>(b2),
          best_r = a[b2];
      }
    }
    if (best_b < 0) return;
    const double wb = work[static_cast<size_t>(best_b)];
    const double w2 = best_b2 < 0 ? 0.0 : work[static_cast<size_t>(best_b2)];
    a[static_cast<size_t>(best_b)] = best_r;
    if (best_b2 >= 0) a[static_cast<size_t>(best_b2)] = M;
    load[static_cast<size_t>(M)] -= wb - w2;
    load[static_cast<size_t>(best_r)] += wb - w2;
  }
}

// Branch and bound over blocks in descending work order. Only strictly better complete
// assignments replace the incumbent; ranks with equal loads are interchangeable, so only the
// first of them is tried; stops at the lower bound max(max work, total/cp).
void exact(const std::vector<double>& work, int64_t cp, Assignment& a) {
  const size_t n = work.size();
  const std::vector<size_t> order = by_work_descending(work);
  const double total = std::accumulate(work.begin(), work.end(), 0.0);
  const double lower = std::max(work[order[0]], total / static_cast<double>(cp));
  double best = makespan_of(work, a, cp);
  const double tol = 1e-12 * std::max(best, 1e-300);
  if (best <= lower + tol) return;

  std::vector<double> remaining(n + 1, 0.0);  // work of order[k..n)
  for (size_t k = n; k-- > 0;) remaining[k] = remaining[k + 1] + work[order[k]];
  std::vector<double> load(static_cast<size_t>(cp), 0.0);
  Assignment cur(n, 0);
  int64_t nodes = 0;
  bool done = false;
  std::function<void(size_t, double)> dfs = [&](size_t k, double cur_max) {
    if (done || ++nodes > kExactNodeBudget) return;
    if (k == n) {
      if (cur_max < best - tol) {
        best = cur_max;
        a = cur;
        if (best <= lower + tol) done = true;
      }
      return;
    }
    // Every remaining block must land on a rank that stays below `best`; a rank whose slack is
    // no larger than the smallest block can take none.
    double capacity = 0;
    for (double l : load)
      if (best - tol - l > work[order[n - 1]]) capacity += best - tol - l;
    if (remaining[k] > capacity) return;
    const size_t b = order[k];
    const double w = work[b];
    // Try ranks from least to most loaded; skip a rank whose load equals one already tried.
    std::vector<int64_t> ranks(static_cast<size_t>(cp));
    std::iota(ranks.begin(), ranks.end(), int64_t{0});
    std::stable_sort(ranks.begin(), ranks.end(), [&](int64_t x, int64_t y) {
      return load[static_cast<size_t>(x)] < load[static_cast<size_t>(y)];
    });
    for (size_t i = 0; i < ranks.size() && !done; ++i) {
      const size_t r = static_cast<size_t>(ranks[i]);
      if (i > 0 && load[r] == load[static_cast<size_t>(ranks[i - 1])]) continue;
      const double nl = load[r] + w;
      if (nl >= best - tol) break;  // ranks are sorted: every later one is at least as bad
      load[r] = nl;
      cur[b] = static_cast<int64_t>(r);
      dfs(k + 1, std::max(cur_max, nl));
      load[r] -= w;
    }
  };
  dfs(0, 0.0);
}

// MULTIFIT (Coffman, Garey, Johnson): binary search on a capacity T for which first-fit
// decreasing packs all blocks into cp bins; returns the best packing found (empty if none).
Assignment multifit(const std::vector<double>& work, int64_t cp) {
  const size_t n = work.size();
  const std::vector<size_t> order = by_work_descending(work);
  const double total = std::accumulate(work.begin(), work.end(), 0.0);
  double lo = std::max(work[order[0]], total / static_cast<double>(cp));
  double hi = std::max(work[order[0]], 2.0 * total / static_cast<double>(cp));
  Assignment best, a(n);
  double best_makespan = std::numeric_limits<double>::infinity();
  std::vector<double> load(static_cast<size_t>(cp));
  for (int it = 0; it < 24; ++it) {
    const double T = it == 0 ? hi : 0.5 * (lo + hi);
    std::fill(load.begin(), load.end(), 0.0);
    bool fits = true;
    for (size_t b : order) {
      size_t r = 0;
      while (r < load.size() && load[r] + work[b] > T) ++r;
      if (r == load.size()) {
        fits = false;
        break;
      }
      load[r] += work[b];
      a[b] = static_cast<int64_t>(r);
    }
    if (fits) {
      const double m = *std::max_element(load.begin(), load.end());
      if (m < best_makespan) best_makespan = m, best = a;
      hi = T;
    } else {
      lo = T;
    }
  }
  return best;
}

Assignment balanced(const std::vector<double>& work, int64_t cp) {
  Assignment best = lpt(work, cp);
  improve(work, cp, best);
  double best_makespan = makespan_of(work, best, cp);
  for (Assignment a : {zigzag(static_cast<int64_t>(work.size()), cp), multifit(work, cp)}) {
    if (a.empty()) continue;
    improve(work, cp, a);
    const double m = makespan_of(work, a, cp);
    if (m < best_makespan) best_makespan = m, best = std::move(a);
  }
  if (static_cast<int64_t>(work.size()) <= kExactMaxBlocks && cp <= kExactMaxRanks)
    exact(work, cp, best);
  return best;
}

}  // namespace

CpPolicy parse_cp_policy(const std::string& name) {
  for (CpPolicy p : kPolicies)
    if (name == to_string(p)) return p;
  WEFT_FAIL("[cp_split] unknown policy '", name,
            "' (expected one of: contiguous, zigzag, lpt, balanced)");
}

const char* to_string(CpPolicy policy) {
  switch (policy) {
    case CpPolicy::kContiguous:
      return "contiguous";
    case CpPolicy::kZigzag:
      return "zigzag";
    case CpPolicy::kLpt:
      return "lpt";
    case CpPolicy::kBalanced:
      return "balanced";
  }
  return "?";
}

const std::vector<CpPolicy>& all_cp_policies() {
  static const std::vector<CpPolicy> all(std::begin(kPolicies), std::end(kPolicies));
  return all;
}

std::vector<std::vector<int64_t>> assign_blocks(const std::vector<double>& work, int64_t cp,
                                                CpPolicy policy) {
  WEFT_CHECK(cp >= 1, "[cp_split] cp must be >= 1, got ", cp);
  WEFT_CHECK(!work.empty(), "[cp_split] nothing to split: no blocks");
  for (size_t b = 0; b < work.size(); ++b)
    WEFT_CHECK(std::isfinite(work[b]) && work[b] >= 0, "[cp_split] block ", b, " has invalid work ",
               work[b], " (expected a finite value >= 0)");
  const int64_t n = static_cast<int64_t>(work.size());
  Assignment a;
  switch (policy) {
    case CpPolicy::kContiguous:
      a = contiguous(n, cp);
      break;
    case CpPolicy::kZigzag:
      a = zigzag(n, cp);
      break;
    case CpPolicy::kLpt:
      a = lpt(work, cp);
      break;
    case CpPolicy::kBalanced:
      a = balanced(work, cp);
      break;
  }
  std::vector<std::vector<int64_t>> per_rank(static_cast<size_t>(cp));
  for (int64_t b = 0; b < n; ++b)
    per_rank[static_cast<size_t>(a[static_cast<size_t>(b)])].push_back(b);
  return per_rank;
}

double CpSplit::makespan() const {
  return work_per_rank.empty() ? 0.0
                               : *std::max_element(work_per_rank.begin(), work_per_rank.end());
}

CpSplit split_sequence(const SequenceDesc& seq, const CpSplitOptions& opts) {
  WEFT_CHECK(opts.cp >= 1, "[cp_split] cp must be >= 1, got ", opts.cp);
  WEFT_CHECK(opts.block_size >= 1, "[cp_split] block_size must be >= 1, got ", opts.block_size);
  WEFT_CHECK(seq.size() >= 1, "[cp_split] empty sequence (0 tokens): nothing to split");
  const std::vector<double> work = block_work(seq, opts.block_size, opts.cost);

  CpSplit s;
  s.policy = opts.policy;
  s.block_size = opts.block_size;
  s.tokens = seq.size();
  s.total_work = std::accumulate(work.begin(), work.end(), 0.0);
  s.blocks_per_rank = assign_blocks(work, opts.cp, opts.policy);
  for (const auto& blocks : s.blocks_per_rank) {
    double w = 0;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t b : blocks) {
      w += work[static_cast<size_t>(b)];
      const int64_t begin = b * opts.block_size;
      const int64_t end = std::min(begin + opts.block_size, s.tokens);
      if (!ranges.empty() && ranges.back().second == begin)
        ranges.back().second = end;
      else
        ranges.emplace_back(begin, end);
    }
    s.work_per_rank.push_back(w);
    s.token_ranges_per_rank.push_back(std::move(ranges));
  }
  return s;
}

nlohmann::ordered_json cp_split_json(const CpSplit& split) {
  nlohmann::ordered_json j;
  j["policy"] = to_string(split.policy);
  j["cp"] = split.cp();
  j["block_size"] = split.block_size;
  j["tokens"] = split.tokens;
  j["total_work"] = split.total_work;
  j["ideal"] = split.ideal();
  j["makespan"] = split.makespan();
  j["imbalance"] = split.ideal() > 0 ? split.makespan() / split.ideal() : 1.0;
  auto& ranks = j["ranks"] = nlohmann::ordered_json::array();
  for (int64_t r = 0; r < split.cp(); ++r) {
    nlohmann::ordered_json rj;
    rj["rank"] = r;
    rj["work"] = split.work_per_rank[static_cast<size_t>(r)];
    const auto& token_ranges = split.token_ranges_per_rank[static_cast<size_t>(r)];
    int64_t tokens = 0;
    for (const auto& [b, e] : token_ranges) tokens += e - b;
    rj["tokens"] = tokens;
    auto& ranges = rj["token_ranges"] = nlohmann::ordered_json::array();
    for (const auto& [b, e] : token_ranges) ranges.push_back({b, e});
    ranks.push_back(std::move(rj));
  }
  return j;
}

std::string to_json(const CpSplit& split) { return cp_split_json(split).dump(2); }

}  // namespace weft::plan
