// Run checkpoints: a directory per step under <run>/checkpoints/, holding either one
// model.safetensors (the weights as held: fp32 masters, and bf16 for frozen modules held in bf16)
// and optimizer.safetensors, or — as training writes
// them — one rank-NNNNN.safetensors per rank with that rank's shards of the weights and
// optimizer moments (each shard of each tensor written once, by the rank holding its canonical
// copy, one TP rank for a tensor TP replicates); plus manifest.json (every data file's size and
// 64-bit checksums, of the whole file and of each 4 MiB block of it, verified on load) and
// state.json (trainer state: step, data position, ...). A checkpoint is written under a temporary
// name and renamed only when complete, so a crash mid-save leaves the previous checkpoints intact;
// only complete checkpoints are ever found or loaded, and a damaged or truncated file is an error
// naming it. CheckpointReader reads any shard of any tensor from either form, copying only the
// bytes that shard needs and verifying only the blocks they lie in: a rank that resumes holds its
// own shards and never the whole model, and reads little more than its share.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
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
// A chunk's ranges may lie in any rank files; together they must tile it.
struct TensorShard {
  std::string name;
  at::Tensor value;
  int64_t dim = 0;
  std::vector<int64_t> segments;
  int64_t rank = 0, size = 1;
  std::vector<int64_t> shape;  // empty: `value` is the whole chunk
  int64_t begin = 0;
};

// A whole checkpoint in memory: what save_checkpoint writes and load_checkpoint returns.
struct Checkpoint {
  TensorList model;      // parameter name -> whole tensor
  TensorList optimizer;  // "exp_avg.<parameter>" / "exp_avg_sq.<parameter>" -> whole tensor
  std::string state_json;
};

// The part of a tensor a reader asks for, in model::Split's layout: along `dim` the tensor is
// the concatenation of `segments` (empty = one), each split evenly over `size`; chunk `rank` of
// every segment, concatenated. The default is the whole tensor.
struct ShardSplit {
  int64_t dim = 0;
  std::vector<int64_t> segments;
  int64_t rank = 0, size = 1;

  // One segment's chunk along `dim`: `len` entries at `full` in the whole tensor and at `local`
  // in the shard.
  struct Interval {
    int64_t full, local, len;
  };
  // This rank's chunks of a dim of `extent` entries, segment by segment (size 1: the whole dim).
  std::vector<Interval> intervals(int64_t extent) const;
};

using NamedShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// A complete checkpoint directory opened for reading. The constructor reads state.json, the
// manifest (every data file listed, at its size) and every data file's header and shard layout,
// and checks that each tensor's pieces tile it exactly (a chunk written whole by several files,
// as older checkpoints wrote tensors TP replicates, is read from the first); it reads no tensor
// data. Checksums are verified as bytes are first read: each file's header as it is opened,
// then each 4 MiB block of data a read lies in (a whole file, under a manifest from before block
// checksums). Tensors are named "model/<parameter>" and "optimizer/exp_avg[_sq].<parameter>"
// whichever form wrote them.
// Errors name the file (or the directory) and what is wrong. Not thread-safe.
class CheckpointReader {
 public:
  // max_span: the most elements one read copies out of a file beyond twice what it fills.
  explicit CheckpointReader(const std::string& dir, int64_t max_span = int64_t{1} << 22);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& dir() const;
  const std::string& state_json() const;
  const std::vector<std::string>& names() const;  // in the order first found, files by name
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;  // of the whole tensor
  // The tensors under `prefix` ("model/", "optimizer/"), the prefix dropped, with their shapes.
  NamedShapes shapes(const std::string& prefix) const;
  // `split`'s shard of tensor `name`, in the dtype it was written in; with length >= 0 only the
  // shard's flattened elements [begin, begin + length), as a 1-D tensor (a ZeRO-1 piece). Reads
  // only from the pieces that overlap it, a contiguous span of elements at a time: exactly the
  // shard's bytes where it is whole rows of what was written, else spans of at most twice what
  // they fill or max_span. Errors name the tensor when the split or range does not fit.
  at::Tensor read(const std::string& name, const ShardSplit& split = {}, int64_t begin = 0,
                  int64_t length = -1) const;
  // Tensor data bytes copied out of the files so far (checksums not counted).
  uint64_t bytes_read() const;
  // Bytes read to verify checksums so far: the blocks of the headers and of the data read (the
  // whole file, for a checkpoint whose manifest has no blocks).
  uint64_t bytes_verified() const;
  // The data files' size, all together.
  uint64_t file_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes <run_dir>/checkpoints/step_<step>; keeps the newest `keep_last` (>= 1). Returns its path.
std::string save_checkpoint(const std::string& run_dir, int64_t step, const Checkpoint& ckpt,
                            int64_t keep_last);
// Sharded save, in three collective steps: rank 0 calls begin (an empty temporary directory,
// whose path it shares), every rank writes its shards there, then — after all have written —
// rank 0 calls finish, which writes manifest.json and state.json and renames the directory
// into place (keeping the newest `keep_last`). A crash before finish leaves only a temporary
// directory, which is never loaded. write_checkpoint_shards returns its file's manifest entry
// (size, checksums of the whole and of every 4 MiB block, summed from the bytes as they are
// written: no file is read back); given every rank's to finish, rank 0 reads no data file (a
// file without one is read and summed).
std::string begin_sharded_checkpoint(const std::string& run_dir, int64_t step);
std::string write_checkpoint_shards(const std::string& tmp_dir, int rank,
                                    const std::vector<TensorShard>& shards);
std::string finish_sharded_checkpoint(const std::string& run_dir, int64_t step,
                                      const std::string& state_json, int64_t keep_last,
                                      const std::vector<std::string>& sums = {});

// Newest complete checkpoint directory of a run, or "" when there is none. With `warn`, says on
// stderr which newer step directories it passed over as damaged (one rank of a job says it).
std::string latest_checkpoint(const std::string& run_dir, bool warn = true);
// Loads a whole checkpoint directory (every tensor whole, however it was sharded); errors name
// the file and what is wrong.
Checkpoint load_checkpoint(const std::string& dir);

}  // namespace weft::io
