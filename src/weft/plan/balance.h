// Balanced global batches (REFERENCES.md: Entrain, DistTrain). A global batch of N samples goes
// to D data-parallel replicas (the LLM's dp) and, within each replica, to M microbatches that run
// under the 1F1B schedule. Every sample brings work to each module: its encoders' work grows with
// its items (images / clips), the LLM's with its tokens and, through attention, their square.
//
// Shape of an assignment (both policies): every replica gets exactly N / D samples (N % D == 0,
// as make_plan requires) so that collated tensors and DP gradient averaging stay as they are;
// within a replica the M microbatch sizes differ by at most one, like data::split (which sizes
// get the extra sample is the balancer's choice). N / D >= M: no empty microbatch.
//
// Objective: the largest combined cost of any (replica, microbatch). The combined cost of a set
// of samples adds up each module's work over the set and then combines the modules (BalanceCost):
// colocated modules take turns on the same devices (sum), separate modules run concurrently on
// their own devices (max of work / devices). Both encoder and LLM work count: balancing the LLM's
// tokens alone leaves the encoders imbalanced, and vice versa (Entrain's point).
//
// Policies:
//  in_order  what weft did before: replica d gets samples [d·N/D, (d+1)·N/D), then consecutive
//            microbatches as data::part_range cuts them, in that order.
//  balanced  hierarchical (Entrain): replicas first, then each replica's microbatches, each level
//            the same way: greedy LPT on the combined cost under the size constraint, then moves
//            and swaps between the most loaded bin and the others while that pair's maximum
//            strictly drops; then, never letting a bin exceed the resulting maximum, pairwise moves
//            and swaps that even out every module's own work (Σ over bins and modules of
//            (work / module mean)²), which can open further descent; the same from the in-order
//            split, the better kept. If the result is not strictly better than in_order on
//            (max microbatch cost, max replica cost), the in_order split is kept. With pipeline
//            stages > 1 each replica's microbatches are then ordered for 1F1B (order_for_1f1b).
//            Deterministic (ties go to the lower index; the search prices a bounded number of
//            candidate moves, ~0.1-0.3 s for 1-8k samples).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/plan/plan.h"

namespace weft::plan {

// What one sample brings to the LLM and the encoders.
struct SampleShape {
  int64_t tokens = 0;          // LLM sequence length: text + modality placeholders
  std::vector<int64_t> items;  // per encoder (spec order): images / clips; missing = 0
  double sum_sq_doc_len = -1;  // Σ over its documents of length²; < 0: tokens² (one document)
  int64_t targets = -1;        // tokens with a loss (output-head rows); < 0: all tokens
};

// Training work of a sample (or a set of samples: the sums) per module, in FLOPs: forward plus
// the backward the module really runs (flops.h convention, frozen rules of partition.h).
struct SampleWork {
  std::vector<double> encoder;  // per encoder, its projector included
  double llm = 0;

  double encoder_total() const;
  SampleWork& operator+=(const SampleWork& other);  // encoder sizes must match (or one empty)
};

// How module work combines into the time a set of samples keeps its replica busy.
//   concurrent = false: Σ_k encoder_weight[k]·encoder[k] + llm_weight·llm (modules share devices
//                       and take turns: colocated placement)
//   concurrent = true:  max(max_k encoder_weight[k]·encoder[k], llm_weight·llm) (each module on
//                       its own devices, pipelined: separate placement)
// Weights convert FLOPs to relative time (1 / devices); an empty encoder_weight means all 1. A
// weight of 0 ignores that module (e.g. an "LLM tokens only" balancer, for comparison).
struct BalanceCost {
  bool concurrent = false;
  std::vector<double> encoder_weight;
  double llm_weight = 1;

  double operator()(const SampleWork& work) const;
};

// Per-unit training FLOPs of the modules of a Plan, so that
//   encoder[k] = items[k] · encoder_per_item[k]
//   llm        = tokens · llm_per_token + targets · llm_per_target + sum_sq · llm_per_sum_sq.
// Taken from partition.h's module_layer_costs (flops.h forward FLOPs; each layer's backward under
// its module's frozen flags: frozen with nothing trainable upstream = forward only), so the
// balancer and the pipeline partitioner price work the same way. An LLM with vocab 0 (from the
// tokenizer, unknown here) has no head cost.
struct WorkModel {
  std::vector<std::string> encoder_names;
  std::vector<double> encoder_per_item;
  double llm_per_token = 0, llm_per_target = 0, llm_per_sum_sq = 0;
  // From the placement: colocated sums; separate takes the max with weight
  // llm ranks / encoder ranks for each encoder (its projector shares its ranks), 1 for the LLM.
  BalanceCost cost;

  // Throws on negative counts or more item counts than encoders, naming `where` (e.g. the
  // sample's source).
  SampleWork work(const SampleShape& shape, const std::string& where = "sample") const;
};

WorkModel make_work_model(const Spec& spec, const Plan& plan);

enum class BalancePolicy { kInOrder, kBalanced };
// "in_order", "balanced"; anything else throws, listing these.
BalancePolicy parse_balance_policy(const std::string& name);
const char* to_string(BalancePolicy policy);

struct BalanceOptions {
  int64_t replicas = 1;      // D: the LLM's data-parallel size
  int64_t microbatches = 1;  // M per replica
  BalancePolicy policy = BalancePolicy::kBalanced;
  // P uniform pipeline stages: > 1 orders each replica's microbatches for 1F1B (balanced only)
  // and is the P of BatchBalance::makespan. 1 = no pipeline (makespan = Σ microbatch costs).
  int64_t pipeline_stages = 1;
  int64_t virtual_stages = 1;         // vp chunks per pipeline rank: interleaved 1F1B when > 1
  double forward_fraction = 1.0 / 3;  // forward share of a microbatch's work (Megatron: 1 of 3)
};

// An assignment and what it achieves. Indices refer to the input samples.
struct BatchBalance {
  BalancePolicy policy = BalancePolicy::kBalanced;
  bool in_order_fallback = false;  // balanced was asked but the in_order split was not beaten
  // [replica][microbatch] = sample indices, ascending; microbatches in run order.
  std::vector<std::vector<std::vector<int64_t>>> assignment;
  std::vector<std::vector<SampleWork>> microbatch_work;  // [replica][microbatch]
  std::vector<std::vector<double>> microbatch_cost;      // combined, [replica][microbatch]
  std::vector<SampleWork> replica_work;
  std::vector<double> replica_cost;  // combined cost of the replica's whole share
  std::vector<double> makespan;      // per replica: (interleaved) 1F1B makespan of its microbatches

  double max_microbatch_cost() const;  // the objective
  double max_replica_cost() const;
  double max_makespan() const;
};

BatchBalance balance_batch(const std::vector<SampleWork>& samples, const BalanceCost& cost,
                           const BalanceOptions& options);

// The stats of a given assignment (any shape; it must use every sample exactly once), e.g. to
// price one balancer's assignment under another cost. Sorts each microbatch's indices.
BatchBalance evaluate_assignment(const std::vector<SampleWork>& samples, const BalanceCost& cost,
                                 std::vector<std::vector<std::vector<int64_t>>> assignment,
                                 int64_t pipeline_stages = 1, double forward_fraction = 1.0 / 3,
                                 int64_t virtual_stages = 1);

// 1F1B on P uniform pipeline ranks of vp chunks each (P·vp uniform virtual stages): microbatch i
// (in the given order) takes forward_fraction·cost[i]/(P·vp) forward and the rest backward on
// every virtual stage. Each rank runs its ops in plan.h pipeline_schedule's order (vp = 1: stage s
// runs min(P − s − 1, m) warm-up forwards, then alternates one forward and one backward, then
// drains the backwards); a forward needs the previous virtual stage's forward of that microbatch,
// a backward the next one's backward (the last stage's, its own forward). No communication time.
// Returns the time the last op ends. Uniform costs c give exactly (m + (P − 1)/vp)·c/P when
// m >= P; P = 1 gives Σ cost.
double one_f_one_b_makespan(const std::vector<double>& cost, int64_t stages,
                            double forward_fraction = 1.0 / 3, int64_t virtual_stages = 1);

// A microbatch order (a permutation of 0..m-1) for 1F1B. With per-stage times f_i, b_i the
// makespan is at least (P − 1)·f_first + Σ_i (f_i + b_i) + (P − 1)·b_last: the first
// microbatch's forward must cross the pipeline before the last stage starts its work, and the
// last one's backward must cross it back after the last stage ends. So (DistTrain's inter-batch
// reordering, Entrain's "defer excess work to the steady phase") the lightest microbatch goes
// first, the next lightest last, and the rest into the steady phase (tried: heavy and light
// alternating so that a heavy forward meets a light backward, descending, ascending); then moves
// of one microbatch and swaps of two while one_f_one_b_makespan strictly drops (a bounded number
// of evaluations). The best of all that and the given order: never worse than in-order.
// Deterministic.
std::vector<int64_t> order_for_1f1b(const std::vector<double>& cost, int64_t stages,
                                    double forward_fraction = 1.0 / 3, int64_t virtual_stages = 1);

// Spread of a set of values: max / mean and the coefficient of variation (population stddev /
// mean). Both are 1 and 0 for an empty set or a zero mean.
struct Spread {
  double max_over_mean = 1, cv = 0;
};
Spread spread(const std::vector<double>& values);

// {"policy", "in_order_fallback", "replica_count", "microbatches_per_replica", "objective",
//  "max_replica_cost", "max_makespan",
//  "microbatch_spread": {"combined", "llm", "encoder", "<encoder name>"...: {"max_over_mean",
//  "cv"}}, "replica_spread": {same keys},
//  "replicas": [{"replica", "cost", "llm", "encoder": [...], "makespan",
//                "microbatches": [{"samples": [...], "cost", "llm", "encoder": [...]}]}]}
// "encoder" in the spreads is the sum over encoders; names default to "encoder<k>".
nlohmann::ordered_json balance_json(const BatchBalance& balance,
                                    const std::vector<std::string>& encoder_names = {});

}  // namespace weft::plan
