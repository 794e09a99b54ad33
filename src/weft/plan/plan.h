// Plan: a plain, serialisable description that fully decides a run — for every module its
// layout {dp, tp, pp, cp}, its rank span, stage boundaries, and whether it is frozen and what
// backward it needs; the microbatching. The simulator replays a Plan; the runtime executes it.
// Single-process training is the Plan with every size 1.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/core/spec.h"

namespace weft::plan {

struct Layout {
  int64_t dp = 1, tp = 1, pp = 1, cp = 1;
  int64_t size() const { return dp * tp * pp * cp; }
};

enum class ModuleRole { kEncoder, kProjector, kLlm };

struct ModulePlan {
  std::string name;  // "llm", "<encoder>", "<encoder>.projector"
  ModuleRole role = ModuleRole::kLlm;
  int encoder = -1;  // index into ModelSpec::encoders for encoders and projectors
  Layout layout;
  int64_t first_rank = 0;                 // ranks [first_rank, first_rank + layout.size())
  std::vector<int64_t> stage_boundaries;  // first layer of each stage after the first (pp-1)
  bool frozen = false;
  // Backward work this module must do: weight grads iff trainable; input grads iff something
  // upstream trains. A module with neither runs forward only and keeps no activations.
  bool weight_grads = true;
  bool input_grads = false;
  bool needs_backward() const { return weight_grads || input_grads; }
};

struct Plan {
  int64_t world_size = 1;
  std::string placement = "colocated";
  std::vector<ModulePlan> modules;  // encoders and their projectors in spec order, then "llm"
  int64_t global_batch = 1;
  int64_t microbatches = 1;
  std::string schedule = "sequential";  // microbatch schedule; 1f1b arrives with pp > 1
  std::string cp_split = "contiguous";
  std::string balance = "in_order";  // how samples are assigned to microbatches

  const ModulePlan& module(const std::string& name) const;
};

// Builds the Plan a Spec asks for on `world_size` ranks (colocated: every module spans all
// ranks). A module whose layout is left all-ones fills the world with data parallelism.
// Rejects layouts the runtime cannot execute yet with a message naming `parallel.<module>`.
Plan make_plan(const Spec& spec, int64_t world_size = 1);

std::string to_json(const Plan& plan);

}  // namespace weft::plan
