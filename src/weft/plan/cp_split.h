// Context-parallel (CP) split of one sequence: cut it into token blocks, price every block by its
// exact attention work under the multimodal mask (weft::visible) plus its linear work, and assign
// blocks to cp ranks so that the slowest rank is as fast as possible.
//
// Everything here runs on the O(S) per-token descriptors (core/mask.h); nothing materialises the
// S×S mask. Position ids follow the original token positions, so a rank's blocks need not be
// contiguous: the runtime all-gathers K/V and reduce-scatters dK/dV (REFERENCES.md, Cornstarch).
// Ranks may end up holding different token counts; only work is balanced.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "weft/core/mask.h"
#include "weft/core/spec.h"

namespace weft::plan {

// The mask of one row: one descriptor per token position.
struct SequenceDesc {
  std::vector<TokenDesc> tokens;
  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
};

// Token positions [begin, end).
struct Span {
  int64_t begin = 0, end = 0;
};

// Builds a row of `length` tokens from compact spans:
//  - documents start at 0 and at every position in `doc_starts` (strictly increasing, in
//    (0, padding_from); a leading 0 is accepted and means the same thing). Document d covers
//    [start_d, start_{d+1}); the last one runs up to `padding_from`. Doc ids are 0, 1, 2, ...
//  - tokens at positions >= `padding_from` are padding (doc -1); padding_from = -1 means
//    `length` (no padding). 0 < padding_from <= length.
//  - each modality span is one item (an image or a clip), ids 0, 1, ... in position order. Spans
//    must not overlap, must lie before `padding_from`, and must not cross a document start (an
//    item belongs to one document). All other tokens are text (item -1).
// Violations throw weft::Error naming the offending span or position.
SequenceDesc make_sequence(int64_t length, const std::vector<Span>& modality_spans,
                           const std::vector<int64_t>& doc_starts = {}, int64_t padding_from = -1);

// For every query position q, the number of keys k with visible(q, q, k, k): the keys of its
// document at or before q, plus the keys of its own item after q; 1 for a padding query. Exact
// for any descriptor (items need not be contiguous), O(S) expected time.
std::vector<int64_t> visible_pairs_per_token(const SequenceDesc& seq);
// The same summed over query blocks [i·block_size, min((i+1)·block_size, S)); the last block may
// be partial.
std::vector<int64_t> attention_pairs_per_block(const SequenceDesc& seq, int64_t block_size);

// Work of a block = attention_pairs · attn_cost_per_pair + tokens · linear_cost_per_token.
// Padding tokens count as tokens: the runtime computes their rows all the same.
struct CpCostModel {
  double attn_cost_per_pair = 1.0;
  double linear_cost_per_token = 0.0;
};
// Forward FLOPs of `llm` (flops.h): 4·q_dim·layers per visible pair (QK^T and PV), and the
// per-token QKV/O/MLP term; the output head is left out (it runs on loss rows only). Training
// scales both terms by the same 3x (flops.h convention), so the split does not depend on it.
CpCostModel make_cp_cost_model(const LlmSpec& llm);

std::vector<double> block_work(const SequenceDesc& seq, int64_t block_size,
                               const CpCostModel& cost);

// How blocks go to ranks. With n blocks:
//  contiguous  rank r gets blocks [⌊r·n/cp⌋, ⌊(r+1)·n/cp⌋).
//  zigzag      2·cp chunks of blocks cut the same way; rank r gets chunks r and 2cp−1−r
//              (balances a pure causal mask only).
//  lpt         Cornstarch makespan_min: blocks by work descending (ties: lower index first),
//              each to the least-loaded rank (ties: lower rank).
//  balanced    weft's default: the best of lpt, zigzag and MULTIFIT (first-fit decreasing
//              under a binary-searched capacity), each improved by moves and swaps between the
//              most-loaded rank and the others while the pair's maximum strictly drops; then, when
//              n <= 16 and cp <= 4, an exact branch and bound seeded with that result (capped at 2M
//              search nodes, then the best found; random 16-block inputs finish far below the cap,
//              in < 40 ms). Its makespan is never above lpt's.
// More ranks than blocks is allowed: the extra ranks get no blocks (and zero work).
enum class CpPolicy { kContiguous, kZigzag, kLpt, kBalanced };

// "contiguous", "zigzag", "lpt", "balanced"; anything else throws, listing these.
CpPolicy parse_cp_policy(const std::string& name);
const char* to_string(CpPolicy policy);
const std::vector<CpPolicy>& all_cp_policies();

// Blocks per rank (ascending indices) for blocks with the given work (finite, >= 0, non-empty).
std::vector<std::vector<int64_t>> assign_blocks(const std::vector<double>& work, int64_t cp,
                                                CpPolicy policy);

struct CpSplitOptions {
  int64_t cp = 1;
  int64_t block_size = 128;
  CpPolicy policy = CpPolicy::kBalanced;
  CpCostModel cost = make_cp_cost_model(LlmSpec{});
};

struct CpSplit {
  CpPolicy policy = CpPolicy::kBalanced;
  int64_t block_size = 0;
  int64_t tokens = 0;                                 // sequence length S
  double total_work = 0;                              // sum over all blocks
  std::vector<std::vector<int64_t>> blocks_per_rank;  // ascending block indices
  std::vector<double> work_per_rank;
  // Token ranges [begin, end) per rank, ascending; adjacent blocks are merged into one range.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> token_ranges_per_rank;

  int64_t cp() const { return static_cast<int64_t>(work_per_rank.size()); }
  double makespan() const;  // the most-loaded rank's work
  double ideal() const { return cp() > 0 ? total_work / static_cast<double>(cp()) : 0.0; }
};

// Splits `seq` into blocks of opts.block_size and assigns them with opts.policy. Throws on
// cp < 1, block_size < 1 or an empty sequence.
CpSplit split_sequence(const SequenceDesc& seq, const CpSplitOptions& opts);

// {"policy", "cp", "block_size", "tokens", "total_work", "ideal", "makespan", "imbalance",
//  "ranks": [{"rank", "work", "tokens", "token_ranges": [[begin, end], ...]}]}
// imbalance = makespan / ideal (max/mean rank work).
nlohmann::ordered_json cp_split_json(const CpSplit& split);
std::string to_json(const CpSplit& split);

}  // namespace weft::plan
