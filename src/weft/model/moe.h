// Mixture-of-experts feed-forward block (core/spec.h MoeSpec): a router, SwiGLU experts sharded
// over the expert-parallel group, an optional shared expert, and the auxiliary losses.
//
// Forward on this rank's tokens x [B, S_l, hidden]:
//   1. router logits in fp32, softmax (or sigmoid) scores, top_k experts per token, weights
//      renormalised over the top k (norm_topk);
//   2. capacity (capacity_factor > 0): per row, expert e keeps its first
//      ceil(cf · T · top_k / E) assignments in priority order (all first choices by position,
//      then all second choices, ...); under context parallelism the row's choices are gathered
//      over CP so every rank decides exactly as one process would;
//   3. dispatch: assignments sorted by expert, token rows sent to the expert's EP rank by an
//      all-to-all (uneven splits), each local expert runs on its rows (expert weights are split
//      over TP like the dense MLP: copy in, one reduction of all expert outputs), the outputs go
//      back by the reverse all-to-all, and each token sums weight · output over its kept slots
//      (in fp32); padding tokens are not routed; with whole experts under tensor parallelism
//      (etp = 1 < tp) each TP rank routes its 1/tp slice of the replicated tokens and the
//      slices are gathered back (their gradients flow back whole to every TP rank);
//   4. the shared expert (if any) is added for every token.
// Backward is autograd's: the all-to-alls differentiate into the reverse exchange
// (dist/collectives.h), and the weights carry the router's gradient.
//
// Auxiliary losses (MoeSpec) are computed per row from the row's statistics, summed over CP
// ranks as linear terms (each rank adds its tokens' share with the row's global routing
// fractions), and enter the objective with weight TokenInfo::aux_scale (1 / rows of the global
// batch) through an identity node on the block's output whose backward adds their gradient, as
// Megatron's MoEAuxLossAutoScaler does: no extra loss travels through the pipeline.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <vector>

#include "weft/core/spec.h"
#include "weft/dist/comm.h"
#include "weft/model/layers.h"

namespace weft::model {

// Routing statistics of the MoE blocks this rank ran since clear(), counted so that a sum over
// all ranks counts every token once (tp-rank 0 only, except loads of TP token slices).
struct MoeStats {
  std::map<int64_t, std::vector<int64_t>> load;  // per MoE block: assignments kept per expert
  double balance = 0;   // Σ over blocks of this rank's part of the mean-over-rows balance loss
  double z = 0;         // same for the router z-loss (both unweighted)
  int64_t routed = 0;   // token-expert assignments chosen (before capacity)
  int64_t dropped = 0;  // of those, dropped by capacity
  void clear() { *this = MoeStats{}; }
};

// What an MoE block needs to know about this rank's [B, S_l] tokens of a microbatch.
struct TokenInfo {
  at::Tensor valid;        // bool [B, S_l]: real tokens (not padding); undefined = all real
  at::Tensor index;        // int64 [S_l]: each token's index in its full row; undefined = 0..S_l-1
  int64_t row_length = 0;  // tokens of a full row (CP); 0 = S_l
  double aux_scale = 0;    // objective weight of one row's auxiliary losses; 0 = none (eval)
  MoeStats* stats = nullptr;  // where to count routing statistics; null = nowhere
};

struct MoeMlp {
  MoeSpec spec;
  int64_t layer = 0;
  at::Tensor router;         // [experts, hidden], replicated over TP and EP
  int64_t first_expert = 0;  // this EP rank holds experts [first_expert, first_expert + local)
  std::vector<Linear> gate_up, down;  // per local expert: [2·ffn/tp, hidden], [hidden, ffn/tp]
  bool has_shared = false;
  SwiGlu shared;
  dist::Comm tp, cp, ep, etp;  // etp: expert tensor parallel (tp, or one rank)

  static MoeMlp make(const Scope& s, const LlmSpec& llm, int64_t layer, double out_std);
  bool enabled() const { return spec.experts > 0; }
  at::Tensor operator()(const at::Tensor& x, const TokenInfo& tokens) const;
};

}  // namespace weft::model
