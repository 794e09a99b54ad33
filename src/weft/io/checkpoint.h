// Run checkpoints: a directory per step under <run>/checkpoints/, holding either one
// model.safetensors (the weights as held: fp32 masters, and bf16 for frozen modules held in bf16)
// and optimizer.safetensors, or — as training writes
// them — one rank-NNNNN.safetensors per rank with that rank's shards of the weights and
// optimizer moments (each shard of each tensor written once, by the rank holding its canonical
// copy); plus manifest.json (every data file's size and 64-bit checksum, verified on load) and
// state.json (trainer state: step, data position, ...). A checkpoint is written under a
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

// A piece of a tensor written by one rank: along `dim` the full tensor is the concatenation of
// `segments` (empty = one), each split evenly over `size` ranks; `value` is chunk `rank` of
// every segment (model::Split's layout). size == 1: the whole tensor.
// With `shape` given, `value` is only a range of that chunk: its flat elements [begin, begin +
// value.numel()) of a chunk shaped `shape` (ZeRO-1: each data-parallel rank writes the part of
// the optimizer state and of the fp32 masters it holds, and nothing is gathered to write it).
// load_checkpoint joins a chunk's ranges, from any rank files, back into the chunk.
struct TensorShard {
  std::string name;
  at::Tensor value;
  int64_t dim = 0;
  std::vector<int64_t> segments;
  int64_t rank = 0, size = 1;
  std::vector<int64_t> shape;  // empty: `value` is the whole chunk
  int64_t begin = 0;
};

struct Checkpoint {
  TensorList model;
  TensorList optimizer;
  std::string state_json;
  std::vector<TensorShard> shards;  // sharded checkpoints: every rank file's pieces
};

// Writes <run_dir>/checkpoints/step_<step>; keeps the newest `keep_last` (>= 1). Returns its path.
std::string save_checkpoint(const std::string& run_dir, int64_t step, const Checkpoint& ckpt,
                            int64_t keep_last);
// Sharded save, in three collective steps: rank 0 calls begin (an empty temporary directory,
// whose path it shares), every rank writes its shards there, then — after all have written —
// rank 0 calls finish, which writes manifest.json and state.json and renames the directory
// into place (keeping the newest `keep_last`). A crash before finish leaves only a temporary
// directory, which is never loaded.
std::string begin_sharded_checkpoint(const std::string& run_dir, int64_t step);
void write_checkpoint_shards(const std::string& tmp_dir, int rank,
                             const std::vector<TensorShard>& shards);
std::string finish_sharded_checkpoint(const std::string& run_dir, int64_t step,
                                      const std::string& state_json, int64_t keep_last);

// Newest complete checkpoint directory of a run, or "" when there is none. With `warn`, says on
// stderr which newer step directories it passed over as damaged (one rank of a job says it).
std::string latest_checkpoint(const std::string& run_dir, bool warn = true);
// Loads a checkpoint directory; errors name the file and what is wrong.
Checkpoint load_checkpoint(const std::string& dir);

}  // namespace weft::io
