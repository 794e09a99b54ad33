// Run checkpoints: a directory per step under <run>/checkpoints/, holding model.safetensors
// (fp32 master weights), optimizer.safetensors, manifest.json (each file's size and 64-bit
// checksum, verified on load) and state.json (trainer state). A checkpoint is written under a
// temporary name and renamed only when complete, so a crash mid-save leaves the previous
// checkpoints intact; only complete checkpoints are ever found or loaded, and a damaged or
// truncated file is an error naming it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace weft::io {

using TensorList = std::vector<std::pair<std::string, at::Tensor>>;

struct Checkpoint {
  TensorList model;
  TensorList optimizer;
  std::string state_json;
};

// Writes <run_dir>/checkpoints/step_<step>; keeps the newest `keep_last` (>= 1). Returns its path.
std::string save_checkpoint(const std::string& run_dir, int64_t step, const Checkpoint& ckpt,
                            int64_t keep_last);
// Newest complete checkpoint directory of a run, or "" when there is none.
std::string latest_checkpoint(const std::string& run_dir);
// Loads a checkpoint directory; errors name the file and what is wrong.
Checkpoint load_checkpoint(const std::string& dir);

}  // namespace weft::io
