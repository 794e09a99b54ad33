// Safetensors: the checkpoint tensor format (https://github.com/huggingface/safetensors).
// Layout: u64 little-endian header size N, N bytes of JSON header (tensor name -> {dtype, shape,
// data_offsets}, plus an optional "__metadata__" string map), then the raw data buffer. Saving
// is atomic (tmp file, fsync, rename); loading validates the whole header and every tensor range
// before it returns anything, throwing weft::Error naming the file and tensor on any problem.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace weft::io {

// Named tensors in a meaningful order (the order they are written and read back in).
using TensorMap = std::vector<std::pair<std::string, at::Tensor>>;

// Writes `tensors` (dtypes F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL; CPU, strided; made
// contiguous) to `path` in the given order, atomically: writes `path + ".tmp"`, fsyncs it, renames
// it over `path`, then fsyncs the directory. `metadata` goes to "__metadata__". Names must be
// non-empty, unique and not "__metadata__". Throws weft::Error (naming the tensor where one is to
// blame) before touching the file system for bad input, and on any I/O failure (no .tmp is left).
// `tap`, when given, sees every byte in file order just before it is written (in pieces of at
// most 4 MiB, with the file's final size): what a checksum of the file needs, without reading
// it back.
using WriteTap = std::function<void(const uint8_t* p, size_t n, uint64_t file_bytes)>;
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {},
                      const WriteTap& tap = {});

// Everything a safetensors file holds.
struct SafetensorsFile {
  TensorMap tensors;  // in data-buffer order (== write order for files from save_safetensors)
  std::map<std::string, std::string> metadata;
};

// A safetensors file opened for reading tensor by tensor: the file is memory-mapped and the
// whole header and every range validated on construction (weft::Error naming the file and the
// tensor otherwise); read() copies one tensor out, and the mapping's pages of what was copied are
// released from this process. Const methods are thread-safe.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const;
  std::vector<std::string> names() const;  // data-buffer order
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const;
  // A fresh CPU copy of tensor `name`; floating tensors converted to `float_dtype` when given.
  at::Tensor read(const std::string& name,
                  c10::optional<at::ScalarType> float_dtype = c10::nullopt) const;
  // Entries [begin, begin + count) of tensor `name` along dim 0 (a tensor of rank >= 1), copying
  // only those bytes; Error naming the file and tensor when out of range.
  at::Tensor read_rows(const std::string& name, int64_t begin, int64_t count,
                       c10::optional<at::ScalarType> float_dtype = c10::nullopt) const;
  // Elements [begin, begin + dst.numel()) of tensor `name`, flattened, copied into `dst` (a
  // contiguous CPU tensor of the tensor's dtype), reading only those bytes; Error naming the
  // file and tensor when out of range or of another dtype.
  void copy_flat(const std::string& name, int64_t begin, const at::Tensor& dst) const;
  // Where element `element` of tensor `name` (flattened; its element count for the end) lies in
  // the file: a byte offset from the file's start.
  uint64_t file_offset(const std::string& name, int64_t element) const;
  // The bytes before the data: the 8-byte header size and the JSON header.
  uint64_t header_bytes() const;
  // The file's size.
  uint64_t file_bytes() const;
  // Calls `f` with the file's bytes [offset, offset + n), straight from the mapping, in pieces,
  // then releases the mapping's pages of them as read() does; Error naming the file when the
  // range is out of it.
  void visit_bytes(uint64_t offset, uint64_t n,
                   const std::function<void(const uint8_t* p, size_t n)>& f) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Reads a whole safetensors file: mmaps it, validates the header and all ranges, and copies each
// tensor into freshly owned CPU memory (the mapping is gone on return). If `float_dtype` is set
// (it must be a floating type), floating-point tensors are converted to it; others are kept.
// Throws weft::Error naming the file (and the tensor, where one is to blame) on malformed input.
SafetensorsFile load_safetensors(const std::string& path,
                                 c10::optional<at::ScalarType> float_dtype = c10::nullopt);

}  // namespace weft::io
