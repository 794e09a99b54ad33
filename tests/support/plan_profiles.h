// Test support for the torch-free plan tests: a measured cost profile (plan/profile.h) of
// profiled_spec with simple numbers, as JSON.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/plan_specs.h"
#include "weft/core/spec.h"
#include "weft/plan/profile.h"

namespace weft::testing {

using json = nlohmann::json;

// A profile of vlm_spec (LLM hidden 128, vocab 256; one ViT "vision") with simple numbers.
inline nlohmann::json layer(const std::string& name, const std::string& part, double fwd, double in,
                            double wg, double act, double params, double opt) {
  return {{"name", name},
          {"part", part},
          {"forward", fwd},
          {"input_grad", in},
          {"weight_grad", wg},
          {"activation_bytes", act},
          {"param_bytes", 4 * params},
          {"params", params},
          {"tensors", 2},
          {"optimizer", opt},
          {"fit",
           {{"forward", {fwd, 0, 0}},
            {"input_grad", {in, 0, 0}},
            {"weight_grad", {wg, 0, 0}},
            {"activation_bytes", {act, 0, 0}}}}};
}

inline nlohmann::json model_fields(const Spec& s, const std::string& module) {
  json m;
  for (const auto& [k, v] : plan::profile_model_fields(s, module)) m[k] = v;
  return m;
}

// Per sample: LLM block 1 ms forward + 1 (input) + 1 (weight), embed / head small; the LLM is
// profiled at 64-token rows (max_seq 64 → seq 40). Vision per item: 0.5 ms a block.
inline nlohmann::json tiny_profile(const Spec& s) {
  json llm_layers = json::array();
  json embed = layer("llm.embed", "front", 0, 0, 0, 0, 256 * 128, 1e-4);
  embed["fit"]["forward"] = {1e-4, 1e-6, 0};  // per token
  embed["fit"]["weight_grad"] = {0, 2e-6, 0};
  llm_layers.push_back(embed);
  json block = layer("llm.block", "block", 0, 0, 0, 0, 200000, 2e-4);
  block["fit"]["forward"] = {1e-4, 2e-5, 1e-7};  // + n (2e-5 S + 1e-7 S²)
  block["fit"]["input_grad"] = {0, 2e-5, 1e-7};
  block["fit"]["weight_grad"] = {0, 2e-5, 0};
  block["fit"]["activation_bytes"] = {1000, 5000, 0};
  llm_layers.push_back(block);
  json head = layer("llm.head", "back", 0, 0, 0, 0, 128, 1e-5);
  head["fit"]["forward"] = {0, 1e-5, 0};
  head["fit"]["weight_grad"] = {0, 1e-5, 0};
  llm_layers.push_back(head);
  json stage = layer("llm.stage", "stage", 0, 0, 0, 0, 0, 0);
  stage["fit"]["forward"] = {3e-5, 0, 1e-8};
  llm_layers.push_back(stage);
  // Recomputed: the forward again in the input gradient's time; keeps a tenth.
  json again = block;
  again["name"] = "llm.block.recompute";
  again["part"] = "block_recompute";
  again["fit"]["input_grad"] = {1e-4, 4e-5, 2e-7};
  again["fit"]["activation_bytes"] = {100, 500, 0};
  llm_layers.push_back(again);
  json vis = json::array();
  vis.push_back(layer("vision.front", "front", 0, 0, 0, 0, 1000, 1e-5));
  vis.back()["fit"]["forward"] = {0, 1e-4, 0};
  vis.back()["fit"]["weight_grad"] = {0, 1e-4, 0};
  vis.push_back(layer("vision.block", "block", 0, 0, 0, 0, 3000, 3e-5));
  vis.back()["fit"]["forward"] = {5e-5, 5e-4, 0};
  vis.back()["fit"]["input_grad"] = {0, 5e-4, 0};
  vis.back()["fit"]["weight_grad"] = {0, 5e-4, 0};
  vis.push_back(layer("vision.projector", "back", 0, 0, 0, 0, 500, 1e-5));
  vis.back()["fit"]["forward"] = {0, 1e-4, 0};
  vis.back()["fit"]["input_grad"] = {0, 1e-4, 0};
  vis.back()["fit"]["weight_grad"] = {0, 1e-4, 0};
  vis.push_back(vis[1]);
  vis.back()["name"] = "vision.block.recompute";
  vis.back()["part"] = "block_recompute";
  vis.back()["fit"]["input_grad"] = {5e-5, 1e-3, 0};
  json j;
  j["format"] = "weft-profile-2";
  j["device"] = "test cpu (1 thread)";
  j["threads"] = 1;
  j["precision"] = "bf16";
  j["shape"] = {{"samples", 8}, {"seq", 40}, {"max_seq", 64}, {"tokens_per_sample", 33}};
  j["data"] = {{"seconds_per_sample", 1e-3}};
  j["comm"] = {{"p2p", {{"latency_us", 80}, {"bandwidth_gbs", 1.5}}},
               {"all_reduce", {{"latency_us", 120}, {"bandwidth_gbs", 1.0}}}};
  j["modules"] = {{{"name", "llm"},
                   {"role", "llm"},
                   {"unit", "sample"},
                   {"model", model_fields(s, "llm")},
                   {"layers", llm_layers}},
                  {{"name", "vision"},
                   {"role", "encoder"},
                   {"unit", "item"},
                   {"units_per_sample", 2},
                   {"model", model_fields(s, "vision")},
                   {"layers", vis}}};
  return j;
}

inline Spec profiled_spec() {
  Spec s = vlm_spec();
  s.model.llm.max_seq = 64;
  return s;
}

// Seconds of a message of `bytes`: latency + bytes · per_byte.
struct AlphaBeta {
  double latency = 0, per_byte = 0;
  double at(double bytes) const { return latency + bytes * per_byte; }
};

// `j` with measured transport points (`comm.points`) at `sizes` bytes: point-to-point, the fp32
// two-rank all-reduce and the compute-dtype one (of half the bytes), running on the ranks' cores;
// with `blocking` (latency > 0), the fp32 all-reduce waited for where issued too.
inline json with_comm_points(json j, const std::vector<double>& sizes, AlphaBeta p2p,
                             AlphaBeta all_reduce, AlphaBeta compute, AlphaBeta blocking = {}) {
  j["comm"]["points"] = json::array();
  for (double b : sizes) {
    j["comm"]["points"].push_back({{"bytes", b},
                                   {"p2p", p2p.at(b)},
                                   {"all_reduce", all_reduce.at(b)},
                                   {"compute_bytes", b / 2},
                                   {"all_reduce_compute", compute.at(b)}});
    if (blocking.latency > 0) j["comm"]["points"].back()["all_reduce_blocking"] = blocking.at(b);
  }
  j["comm"]["on_compute"] = true;
  return j;
}

}  // namespace weft::testing
