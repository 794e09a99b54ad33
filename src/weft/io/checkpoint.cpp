#include "weft/io/checkpoint.h"

#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "weft/core/error.h"
#include "weft/io/files.h"
#include "weft/io/safetensors.h"

namespace fs = std::filesystem;

namespace weft::io {

namespace {

constexpr const char* kStateFile = "state.json";
constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kShardsKey = "weft.shards";    // safetensors metadata of a rank file
constexpr uint64_t kBlockBytes = uint64_t{4} << 20;  // the manifest's checksum blocks

// The data files of a checkpoint directory: *.safetensors, sorted.
std::vector<std::string> data_files(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".safetensors")
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The 64-bit checksum of a run of bytes (8 bytes per step, multiply-xorshift mixing, the bytes
// after the last whole word one at a time): detects truncation and corruption; not a
// cryptographic hash. Fed in pieces of any size.
class Checksum {
 public:
  void add(const uint8_t* p, size_t n) {
    bytes_ += n;
    if (tail_n_ > 0) {  // complete the word a previous piece began
      const size_t take = std::min(n, 8 - tail_n_);
      std::memcpy(tail_ + tail_n_, p, take);
      tail_n_ += take, p += take, n -= take;
      if (tail_n_ < 8) return;
      mix(tail_);
      tail_n_ = 0;
    }
    for (; n >= 8; p += 8, n -= 8) mix(p);
    std::memcpy(tail_, p, n);
    tail_n_ = n;
  }
  void add(const char* p, size_t n) { add(reinterpret_cast<const uint8_t*>(p), n); }
  uint64_t value() const {
    uint64_t h = h_;
    for (size_t i = 0; i < tail_n_; ++i) h = (h ^ tail_[i]) * 0x100000001b3ull;
    h ^= bytes_;
    h = (h ^ (h >> 33)) * 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
  }
  uint64_t bytes() const { return bytes_; }

 private:
  void mix(const uint8_t* p) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h_ = (h_ ^ w) * 0xff51afd7ed558ccdull;
    h_ ^= h_ >> 32;
  }
  uint64_t h_ = 0x9e3779b97f4a7c15ull, bytes_ = 0;
  uint8_t tail_[8] = {};
  size_t tail_n_ = 0;
};

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

constexpr uint64_t kReadBytes = uint64_t{1} << 20;  // a multiple of 8, dividing kBlockBytes

// What manifest.json says of one data file: its size, the checksum of all of it, and the
// checksum of each block, so that a reader can prove the bytes it reads without reading the rest
// of the file. Block 0 is the header (the 8-byte header size and the JSON it counts); the data
// follow in blocks of block_bytes, the last one shorter. Older manifests have no blocks.
struct FileSums {
  uint64_t bytes = 0;
  std::string checksum;
  uint64_t header_bytes = 0, block_bytes = 0;
  std::vector<std::string> blocks;

  size_t block_count() const {
    return bytes <= header_bytes ? 1 : 1 + (bytes - header_bytes + block_bytes - 1) / block_bytes;
  }
  size_t block_of(uint64_t byte) const {
    return byte < header_bytes ? 0 : 1 + (byte - header_bytes) / block_bytes;
  }
  uint64_t block_begin(size_t b) const { return b == 0 ? 0 : header_bytes + (b - 1) * block_bytes; }
  uint64_t block_end(size_t b) const {
    return std::min(bytes, b == 0 ? header_bytes : header_bytes + b * block_bytes);
  }
};

// A file's sums, from its bytes fed in order in pieces of any size: the header's extent comes
// from its first 8 bytes, as a reader finds it.
class FileSummer {
 public:
  FileSummer(std::string path, uint64_t file_bytes, uint64_t block_bytes) : path_(std::move(path)) {
    out_.bytes = file_bytes;
    out_.block_bytes = block_bytes;
    out_.header_bytes = file_bytes;  // until the header size is known: every byte is block 0's
  }
  void add(const uint8_t* p, size_t n) {
    WEFT_CHECK(n <= out_.bytes - fed_, path_, ": more than its ", out_.bytes,
               " bytes (changed while being read?)");
    whole_.add(p, n);
    while (n > 0) {    // the part of the piece in the current block
      if (fed_ < 8) {  // the header size: always block 0
        const size_t take = static_cast<size_t>(std::min<uint64_t>(n, 8 - fed_));
        std::memcpy(size_ + fed_, p, take);
        if (fed_ + take == 8) {
          uint64_t h = 0;
          for (int i = 0; i < 8; ++i) h |= uint64_t{size_[i]} << (8 * i);
          if (h <= out_.bytes - 8) out_.header_bytes = 8 + h;  // else the whole file, damaged
        }
        feed_block(p, take);
        p += take, n -= take;
        continue;
      }
      const size_t take =
          static_cast<size_t>(std::min<uint64_t>(n, out_.block_end(out_.blocks.size()) - fed_));
      feed_block(p, take);
      p += take, n -= take;
    }
  }
  FileSums finish() {
    WEFT_CHECK(whole_.bytes() == out_.bytes, path_, ": summed ", whole_.bytes(), " of its ",
               out_.bytes, " bytes (changed while being read?)");
    if (out_.blocks.empty()) out_.blocks.push_back(hex(block_.value()));  // an empty file
    out_.checksum = hex(whole_.value());
    return std::move(out_);
  }

 private:
  void feed_block(const uint8_t* p, size_t n) {
    block_.add(p, n);
    fed_ += n;
    if (fed_ >= 8 && fed_ == out_.block_end(out_.blocks.size())) {
      out_.blocks.push_back(hex(block_.value()));
      block_ = Checksum();
    }
  }
  std::string path_;
  FileSums out_;
  Checksum whole_, block_;
  uint64_t fed_ = 0;
  uint8_t size_[8] = {};
};

// A file's sums, read in one pass.
FileSums sum_file(const fs::path& path, uint64_t block_bytes = kBlockBytes) {
  FileSummer summer(path.string(), fs::file_size(path), block_bytes);
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, "cannot read ", path.string());
  std::vector<char> buf(kReadBytes);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    summer.add(reinterpret_cast<const uint8_t*>(buf.data()), static_cast<size_t>(in.gcount()));
  }
  return summer.finish();
}

// The checksum of bytes [offset, offset + n) of a file.
uint64_t sum_range(const fs::path& path, uint64_t offset, uint64_t n) {
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, "cannot read ", path.string());
  in.seekg(static_cast<std::streamoff>(offset));
  std::vector<char> buf(static_cast<size_t>(std::min(n, kReadBytes)));
  Checksum sum;
  while (sum.bytes() < n) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(n - sum.bytes(), buf.size()));
    in.read(buf.data(), static_cast<std::streamsize>(want));
    WEFT_CHECK(static_cast<size_t>(in.gcount()) == want, path.string(), ": cannot read bytes [",
               offset, ", ", offset + n, ") (truncated?)");
    sum.add(buf.data(), want);
  }
  return sum.value();
}

nlohmann::ordered_json to_json(const FileSums& f) {
  return {{"bytes", f.bytes},
          {"checksum", f.checksum},
          {"header_bytes", f.header_bytes},
          {"block_bytes", f.block_bytes},
          {"blocks", f.blocks}};
}

// manifest.json: every data file's size and checksums, so a load can prove the files whole.
// `known`: entries the writers made as they wrote (file name -> entry); the other files are read
// here.
std::string manifest_of(const fs::path& dir,
                        const nlohmann::json& known = nlohmann::json::object()) {
  nlohmann::ordered_json j;
  j["files"] = nlohmann::ordered_json::object();
  for (const std::string& f : data_files(dir)) {
    if (!known.contains(f)) {
      j["files"][f] = to_json(sum_file(dir / f));
      continue;
    }
    const nlohmann::json& e = known[f];
    const uint64_t size = fs::file_size(dir / f);
    WEFT_CHECK(e.value("bytes", uint64_t{0}) == size, (dir / f).string(), ": ", size,
               " bytes, but its writer summed ", e.value("bytes", uint64_t{0}),
               " (written again since?)");
    j["files"][f] = e;
  }
  return j.dump(2);
}

// manifest.json's entries by file name. Every data file must have one, at its size; the
// checksums are compared as the file's bytes are first read (CheckpointReader).
using Manifest = std::map<std::string, FileSums>;

Manifest read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifestFile;
  // Every checkpoint is written with one: without it nothing proves the files whole.
  WEFT_CHECK(fs::exists(path), path.string(),
             ": missing (every checkpoint is written with its manifest: this one was damaged, or "
             "written by a weft from before manifests)");
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  WEFT_CHECK(!j.is_discarded() && j.contains("files") && j["files"].is_object(), path.string(),
             ": not a valid manifest");
  for (const std::string& f : data_files(dir))
    WEFT_CHECK(j["files"].contains(f), path.string(), ": no entry for ", f);
  Manifest out;
  for (const auto& [f, e] : j["files"].items()) {
    WEFT_CHECK(e.is_object(), path.string(), ": bad entry for ", f);
    WEFT_CHECK(fs::exists(dir / f), (dir / f).string(), ": missing (the manifest lists it)");
    FileSums sums;
    try {
      sums.bytes = e.value("bytes", uint64_t{0});
      sums.checksum = e.value("checksum", std::string());
      sums.header_bytes = e.value("header_bytes", uint64_t{0});
      sums.block_bytes = e.value("block_bytes", uint64_t{0});
      sums.blocks = e.value("blocks", std::vector<std::string>());
    } catch (const nlohmann::json::exception&) {
      WEFT_FAIL(path.string(), ": bad entry for ", f, ": ", e.dump());
    }
    const uint64_t size = fs::file_size(dir / f);
    WEFT_CHECK(size == sums.bytes, (dir / f).string(), ": ", size, " bytes, the manifest says ",
               sums.bytes, " (truncated or overwritten)");
    WEFT_CHECK(sums.blocks.empty() || (sums.block_bytes > 0 && sums.header_bytes <= sums.bytes &&
                                       sums.blocks.size() == sums.block_count()),
               path.string(), ": the entry for ", f, " has ", sums.blocks.size(),
               " block checksums, which do not fit ", sums.bytes, " bytes as a header of ",
               sums.header_bytes, " and blocks of ", sums.block_bytes);
    out[f] = std::move(sums);
  }
  return out;
}

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_file_synced(const fs::path& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    WEFT_CHECK(out, "cannot write ", path.string());
    out << text;
    out.flush();
    WEFT_CHECK(out, "write to ", path.string(), " failed (disk full?)");
  }
  fsync_path(path);
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

// Complete checkpoints of a run, oldest first; `damaged`, if given, gets the step directories
// without their state.json (a checkpoint is renamed into place whole, so they were damaged since).
std::vector<fs::path> complete_checkpoints(const fs::path& root,
                                           std::vector<fs::path>* damaged = nullptr) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step_", 0) != 0) continue;
    if (fs::exists(entry.path() / kStateFile))
      out.push_back(entry.path());
    else if (damaged)
      damaged->push_back(entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Manifest, state.json (last: marks completeness), rename into place, keep the newest.
std::string commit(const fs::path& root, const fs::path& tmp, int64_t step,
                   const std::string& state_json, int64_t keep_last,
                   const nlohmann::json& known_sums = nlohmann::json::object()) {
  const fs::path final_dir = root / step_name(step);
  write_file_synced(tmp / kManifestFile, manifest_of(tmp, known_sums));
  write_file_synced(tmp / kStateFile, state_json);
  fsync_path(tmp);
  if (fs::exists(final_dir)) {  // re-saving a step (after a resume): swap atomically-ish
    const fs::path old = root / (".old-" + step_name(step));
    remove_tree(old.string());
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    remove_tree(old.string());
  } else {
    fs::rename(tmp, final_dir);
  }
  fsync_path(root);
  std::vector<fs::path> all = complete_checkpoints(root);
  const size_t keep = static_cast<size_t>(std::max<int64_t>(keep_last, 1));
  for (size_t i = 0; i + keep < all.size(); ++i) remove_tree(all[i].string());
  return final_dir.string();
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, int64_t step, const Checkpoint& ckpt,
                            int64_t keep_last) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const fs::path tmp = begin_sharded_checkpoint(run_dir, step);
  save_safetensors((tmp / "model.safetensors").string(), ckpt.model);
  save_safetensors((tmp / "optimizer.safetensors").string(), ckpt.optimizer);
  return commit(root, tmp, step, ckpt.state_json, keep_last);
}

std::string begin_sharded_checkpoint(const std::string& run_dir, int64_t step) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  fs::create_directories(root);
  const fs::path tmp = root / (".tmp-" + step_name(step));
  remove_tree(tmp.string());
  fs::create_directories(tmp);
  return tmp.string();
}

std::string write_checkpoint_shards(const std::string& tmp_dir, int rank,
                                    const std::vector<TensorShard>& shards) {
  TensorMap tensors;
  nlohmann::json layout = nlohmann::json::object();
  for (const TensorShard& s : shards) {
    if (layout.contains(s.name)) continue;  // a tied copy: written once
    tensors.emplace_back(s.name, s.value);
    layout[s.name] = {{"dim", s.dim}, {"segments", s.segments}, {"rank", s.rank}, {"size", s.size}};
    if (!s.shape.empty()) {
      layout[s.name]["shape"] = s.shape;
      layout[s.name]["begin"] = s.begin;
    }
  }
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", rank);
  const fs::path path = fs::path(tmp_dir) / name;
  // Summed as written, so that no rank reads its file back, nor another's.
  std::unique_ptr<FileSummer> summer;
  save_safetensors(path.string(), tensors, {{kShardsKey, layout.dump()}},
                   [&](const uint8_t* p, size_t n, uint64_t file_bytes) {
                     if (!summer)
                       summer =
                           std::make_unique<FileSummer>(path.string(), file_bytes, kBlockBytes);
                     summer->add(p, n);
                   });
  nlohmann::ordered_json entry;
  entry[name] = to_json(summer->finish());
  return entry.dump();
}

std::string finish_sharded_checkpoint(const std::string& run_dir, int64_t step,
                                      const std::string& state_json, int64_t keep_last,
                                      const std::vector<std::string>& sums) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const fs::path tmp = root / (".tmp-" + step_name(step));
  nlohmann::json known = nlohmann::json::object();
  for (const std::string& text : sums) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    WEFT_CHECK(j.is_object() && j.size() == 1 && j.begin().value().is_object(), tmp.string(),
               ": a writer's checksums are not one file's entry: ", text);
    known[j.begin().key()] = j.begin().value();
  }
  return commit(root, tmp, step, state_json, keep_last, known);
}

std::string latest_checkpoint(const std::string& run_dir, bool warn) {
  std::vector<fs::path> damaged;
  const std::vector<fs::path> all =
      complete_checkpoints(fs::path(run_dir) / "checkpoints", warn ? &damaged : nullptr);
  for (const fs::path& d : damaged)  // said when a newer one is passed over
    if (all.empty() || d > all.back())
      std::fprintf(stderr, "weft: warning: %s: no %s, so not a complete checkpoint; %s\n",
                   d.c_str(), kStateFile,
                   all.empty() ? "none is left to use"
                               : ("using the older " + all.back().filename().string()).c_str());
  return all.empty() ? std::string() : all.back().string();
}

// ---- CheckpointReader -----------------------------------------------------------------------

namespace {

int64_t product(const std::vector<int64_t>& v, size_t from = 0) {
  int64_t n = 1;
  for (size_t k = from; k < v.size(); ++k) n *= v[k];
  return n;
}

// A box of a tensor: [start[d], start[d] + len[d]) along every dim d.
struct Box {
  std::vector<int64_t> start, len;
};

using Interval = ShardSplit::Interval;

// The parts of `box` along dim d that fall in each of `segments` (full coordinates to the
// shard's when to_shard, else back), each as a box in those coordinates: f(box, where it starts
// along d in `box`).
template <typename F>
void each_part(const Box& box, int64_t d, const std::vector<Interval>& segments, bool to_shard,
               const F& f) {
  for (const Interval& s : segments) {
    const int64_t from = to_shard ? s.full : s.local, to = to_shard ? s.local : s.full;
    const int64_t a = std::max(box.start[d], from);
    const int64_t b = std::min(box.start[d] + box.len[d], from + s.len);
    if (a >= b) continue;
    Box part = box;
    part.start[d] = to + a - from;
    part.len[d] = b - a;
    f(part, a - box.start[d]);
  }
}

// [begin, begin + length) of a tensor of `shape`, flattened, as boxes in flat order, each one
// contiguous (a partial row, whole rows, a partial row, recursively).
void flat_boxes(const std::vector<int64_t>& shape, size_t d, const Box& prefix, int64_t b,
                int64_t e, std::vector<Box>& out) {
  if (b >= e) return;
  const auto with = [&](int64_t start, int64_t len) {
    Box x = prefix;
    x.start.push_back(start);
    x.len.push_back(len);
    return x;
  };
  if (d + 1 == shape.size()) {
    out.push_back(with(b, e - b));
    return;
  }
  const int64_t inner = product(shape, d + 1);
  const int64_t first = (b + inner - 1) / inner, last = e / inner;  // whole rows [first, last)
  if (first > last) {                                               // inside one row
    const int64_t row = b / inner;
    flat_boxes(shape, d + 1, with(row, 1), b - row * inner, e - row * inner, out);
    return;
  }
  if (b < first * inner) flat_boxes(shape, d + 1, with(first - 1, 1), b % inner, inner, out);
  if (last > first) {
    Box whole = with(first, last - first);
    for (size_t k = d + 1; k < shape.size(); ++k) {
      whole.start.push_back(0);
      whole.len.push_back(shape[k]);
    }
    out.push_back(std::move(whole));
  }
  if (e > last * inner) flat_boxes(shape, d + 1, with(last, 1), 0, e - last * inner, out);
}

}  // namespace

struct CheckpointReader::Impl {
  struct File {
    std::string name;
    std::unique_ptr<SafetensorsReader> reader;
    FileSums sums;
    bool verified = false;       // all of it
    std::vector<char> block_ok;  // per block of sums.block_bytes
  };
  // A flat range [begin, begin + numel) of one chunk, stored as tensor `key` of file `file`.
  struct Piece {
    size_t file;
    std::string key;
    int64_t begin, numel;
    bool whole;
  };
  struct Stored {
    int64_t dim = 0;
    std::vector<int64_t> segments;
    int64_t size = 1;
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> chunk_shape;  // a 0-dim tensor as [1]
    std::map<int64_t, std::vector<Piece>> chunks;
    std::vector<int64_t> shape;  // the whole tensor's; a 0-dim tensor as [1]
    bool scalar = false;
  };

  fs::path dir;
  std::string state;
  std::vector<File> files;
  std::map<std::string, Stored> tensors;
  std::vector<std::string> order;
  uint64_t bytes_read = 0, bytes_verified = 0;
  int64_t max_span = 0;

  std::string where(size_t file) const { return (dir / files[file].name).string(); }

  const Stored& stored(const std::string& name) const {
    auto it = tensors.find(name);
    WEFT_CHECK(it != tensors.end(), dir.string(), ": no tensor '", name, "'");
    return it->second;
  }

  void add(const std::string& name, size_t file, const std::string& key, const TensorShard& s,
           const std::vector<int64_t>& value_shape, at::ScalarType dtype) {
    const bool whole = s.shape.empty();
    std::vector<int64_t> chunk = whole ? value_shape : s.shape;
    const bool scalar = chunk.empty();
    if (scalar) chunk = {1};
    auto [it, fresh] = tensors.try_emplace(name);
    Stored& t = it->second;
    if (fresh) {
      order.push_back(name);
      t.dim = s.dim;
      t.segments = s.segments;
      t.size = s.size;
      t.dtype = dtype;
      t.chunk_shape = chunk;
      t.scalar = scalar;
    }
    WEFT_CHECK(t.dim == s.dim && t.segments == s.segments && t.size == s.size && t.dtype == dtype &&
                   t.chunk_shape == chunk,
               where(file), ": tensor '", name,
               "' disagrees with its other pieces on the chunk's shape, split or dtype");
    t.chunks[s.rank].push_back({file, key, whole ? 0 : s.begin, product(value_shape), whole});
  }

  // Every chunk present and tiled exactly by its pieces; the whole tensor's shape.
  void finish() {
    for (auto& [name, t] : tensors) {
      WEFT_CHECK(static_cast<int64_t>(t.chunks.size()) == t.size, dir.string(), ": tensor '", name,
                 "' has ", t.chunks.size(), " of its ", t.size, " shards (a rank file missing?)");
      const int64_t numel = product(t.chunk_shape);
      for (auto& [rank, pieces] : t.chunks) {
        std::stable_sort(pieces.begin(), pieces.end(),
                         [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
        bool any_whole = false, any_range = false;
        for (const Piece& p : pieces) (p.whole ? any_whole : any_range) = true;
        WEFT_CHECK(!(any_whole && any_range), dir.string(), ": tensor '", name, "': chunk ", rank,
                   " is written both whole and as ranges");
        // Copies of a whole chunk (a tensor TP replicates, in checkpoints that wrote it from
        // every TP rank): the first file's is read.
        if (any_whole) pieces.erase(pieces.begin() + 1, pieces.end());
        int64_t covered = 0;
        for (const Piece& p : pieces) {
          WEFT_CHECK(p.begin == covered, dir.string(), ": tensor '", name, "': chunk ", rank,
                     " has ", p.begin > covered ? "no range for" : "two ranges over",
                     " its elements from ", std::min(p.begin, covered),
                     " (a rank file missing or written twice?)");
          covered += p.numel;
        }
        WEFT_CHECK(covered == numel, dir.string(), ": tensor '", name, "': chunk ", rank,
                   " has no range for its elements from ", covered, " of ", numel,
                   " (a rank file missing?)");
      }
      // Segments, whatever the split's size, must tile the dim: reads map through them.
      const int64_t extent = t.chunk_shape[t.dim] * t.size;
      int64_t sum = 0;
      bool even = true;
      for (int64_t seg : t.segments) {
        sum += seg;
        even = even && seg > 0 && seg % t.size == 0;
      }
      WEFT_CHECK(t.segments.empty() || (even && sum == extent), dir.string(), ": tensor '", name,
                 "': segments ", at::IntArrayRef(t.segments), " do not split ", extent,
                 " entries over ", t.size, " chunks");
      t.shape = t.chunk_shape;
      t.shape[t.dim] = extent;
    }
  }

  // The headers and layouts of every data file of `manifest`, and how they tile each tensor.
  void open_files(const Manifest& manifest) {
    for (const std::string& f : data_files(dir)) {
      const bool whole = f == "model.safetensors" || f == "optimizer.safetensors";
      if (!whole && f.rfind("rank-", 0) != 0) continue;
      files.push_back({f, nullptr, manifest.at(f), false, {}});
      const size_t file = files.size() - 1;
      const std::string path = where(file);
      files[file].block_ok.assign(files[file].sums.blocks.size(), 0);
      files[file].reader = std::make_unique<SafetensorsReader>(path);
      const SafetensorsReader& r = *files[file].reader;
      verify(file, 0, r.header_bytes());  // what the layout is read from
      if (whole) {
        const std::string prefix = f == "model.safetensors" ? "model/" : "optimizer/";
        for (const std::string& key : r.names())
          add(prefix + key, file, key, TensorShard{key, {}, 0, {}, 0, 1, {}, 0}, r.shape(key),
              r.dtype(key));
        continue;
      }
      auto meta = r.metadata().find(kShardsKey);
      WEFT_CHECK(meta != r.metadata().end(), path, ": no \"", kShardsKey, "\" metadata");
      const nlohmann::json layout = nlohmann::json::parse(meta->second, nullptr, false);
      WEFT_CHECK(layout.is_object(), path, ": bad \"", kShardsKey, "\" metadata");
      for (const std::string& name : r.names()) {
        WEFT_CHECK(layout.contains(name), path, ": tensor '", name, "' has no shard layout");
        const nlohmann::json& l = layout[name];
        TensorShard s{name, {}, 0, {}, 0, 1, {}, 0};
        try {
          s.dim = l.at("dim").get<int64_t>();
          s.segments = l.at("segments").get<std::vector<int64_t>>();
          s.rank = l.at("rank").get<int64_t>();
          s.size = l.at("size").get<int64_t>();
          if (l.contains("shape")) {
            s.shape = l.at("shape").get<std::vector<int64_t>>();
            s.begin = l.at("begin").get<int64_t>();
          }
        } catch (const nlohmann::json::exception&) {
          WEFT_FAIL(path, ": tensor '", name, "': bad shard layout ", l.dump());
        }
        const std::vector<int64_t> shape = r.shape(name);
        const bool range = l.contains("shape");
        const int64_t chunk_dims = static_cast<int64_t>(range ? s.shape.size() : shape.size());
        int64_t chunk_numel = 1;  // -1: not a shape
        for (int64_t d : s.shape)
          chunk_numel = d < 0 || chunk_numel < 0 || (d > 0 && chunk_numel > (int64_t{1} << 62) / d)
                            ? -1
                            : chunk_numel * d;
        WEFT_CHECK(
            s.size >= 1 && s.rank >= 0 && s.rank < s.size && s.dim >= 0 && s.dim < chunk_dims, path,
            ": tensor '", name, "': bad shard layout ", l.dump());
        WEFT_CHECK(!range || (shape.size() == 1 && chunk_numel >= 0 && s.begin >= 0 &&
                              s.begin + shape[0] <= chunk_numel),
                   path, ": tensor '", name, "' of shape ", at::IntArrayRef(shape),
                   ": bad range layout ", l.dump(),
                   " (expected a flat range inside a chunk of that shape)");
        add(name, file, name, s, shape, r.dtype(name));
      }
    }
    finish();
  }

  // The checksum of bytes [begin, end) of the file: from its mapping, where it opened, else
  // read through a stream.
  uint64_t sum_of(size_t file, uint64_t begin, uint64_t end) const {
    const File& f = files[file];
    if (!f.reader) return sum_range(dir / f.name, begin, end - begin);
    Checksum sum;
    f.reader->visit_bytes(begin, end - begin, [&](const uint8_t* p, size_t n) { sum.add(p, n); });
    return sum.value();
  }
  // The whole file proved against the manifest.
  void verify(size_t file) {
    File& f = files[file];
    if (f.verified) return;
    if (f.sums.blocks.empty()) {
      const std::string sum = hex(sum_of(file, 0, f.sums.bytes));
      WEFT_CHECK(sum == f.sums.checksum, where(file), ": checksum ", sum,
                 " does not match the manifest's ", f.sums.checksum, " (the file is damaged)");
      bytes_verified += f.sums.bytes;
    } else {
      verify(file, 0, f.sums.bytes);
    }
    f.verified = true;
  }
  // Bytes [lo, hi) of the file proved: the blocks they lie in, each once (the whole file where
  // the manifest has no blocks).
  void verify(size_t file, uint64_t lo, uint64_t hi) {
    File& f = files[file];
    if (f.verified || lo >= hi) return;
    if (f.sums.blocks.empty()) return verify(file);
    for (size_t b = f.sums.block_of(lo); b <= f.sums.block_of(hi - 1) && b < f.block_ok.size();
         ++b) {
      if (f.block_ok[b]) continue;
      const uint64_t begin = f.sums.block_begin(b), end = f.sums.block_end(b);
      const std::string sum = hex(sum_of(file, begin, end));
      WEFT_CHECK(sum == f.sums.blocks[b], where(file), ": checksum ", sum, " of bytes [", begin,
                 ", ", end, ") does not match the manifest's ", f.sums.blocks[b],
                 " (the file is damaged)");
      f.block_ok[b] = 1;
      bytes_verified += end - begin;
    }
  }

  // Box `box` of chunk `rank` of `t` into `dst` (shaped as the box): the contiguous span of the
  // chunk's elements that holds it, from the pieces that overlap it; in parts when that span
  // would be much more than the box.
  void read_chunk_box(const Stored& t, int64_t rank, const Box& box, at::Tensor dst) {
    const size_t n = box.len.size();
    std::vector<int64_t> strides(n, 1);
    for (size_t k = n - 1; k > 0; --k) strides[k - 1] = strides[k] * t.chunk_shape[k];
    int64_t volume = 1, lo = 0, span = 1;  // the span: elements [lo, lo + span) of the chunk
    for (size_t k = 0; k < n; ++k) {
      volume *= box.len[k];
      lo += box.start[k] * strides[k];
      span += (box.len[k] - 1) * strides[k];
    }
    if (volume == 0) return;
    if (span > std::max(2 * volume, max_span)) {
      size_t k = 0;
      while (box.len[k] == 1) ++k;  // span > volume: some dim has more than one entry
      const int64_t half = box.len[k] / 2;
      Box a = box, b = box;
      a.len[k] = half;
      b.start[k] += half;
      b.len[k] -= half;
      read_chunk_box(t, rank, a, dst.narrow(static_cast<int64_t>(k), 0, half));
      read_chunk_box(t, rank, b, dst.narrow(static_cast<int64_t>(k), half, b.len[k]));
      return;
    }
    const int64_t hi = lo + span;
    const at::Tensor values = at::empty({span}, at::TensorOptions().dtype(t.dtype));
    for (const Piece& p : t.chunks.at(rank)) {
      const int64_t from = std::max(lo, p.begin), to = std::min(hi, p.begin + p.numel);
      if (from >= to) continue;
      const int64_t count = to - from;
      const SafetensorsReader& r = *files[p.file].reader;
      verify(p.file, r.file_offset(p.key, from - p.begin), r.file_offset(p.key, to - p.begin));
      r.copy_flat(p.key, from - p.begin, values.narrow(0, from - lo, count));
      bytes_read += static_cast<uint64_t>(count) * c10::elementSize(t.dtype);
    }
    dst.copy_(values.as_strided(box.len, strides, 0));
  }

  // Box `box` of the whole tensor into `dst`, from the chunks that hold parts of it.
  void read_box(const Stored& t, const Box& box, const at::Tensor& dst) {
    const int64_t d = t.dim;
    for (const auto& [rank, pieces] : t.chunks)
      each_part(box, d, ShardSplit{d, t.segments, rank, t.size}.intervals(t.shape[d]), true,
                [&, r = rank](const Box& in_chunk, int64_t offset) {
                  read_chunk_box(t, r, in_chunk, dst.narrow(d, offset, in_chunk.len[d]));
                });
  }
};

CheckpointReader::CheckpointReader(const std::string& dir, int64_t max_span)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.dir = fs::path(dir);
  m.max_span = std::max<int64_t>(max_span, 1);
  WEFT_CHECK(fs::exists(m.dir / kStateFile), dir, ": not a complete checkpoint (no ", kStateFile,
             ")");
  const auto manifest = read_manifest(m.dir);
  // A file that fails to open or to fit the others is named as damaged where its checksum says
  // so (what the damage broke would mislead), else the error stands.
  try {
    m.open_files(manifest);
  } catch (const Error&) {
    for (size_t file = 0; file < m.files.size(); ++file) m.verify(file);
    throw;
  }
  WEFT_CHECK(!m.tensors.empty(), dir, ": no model.safetensors or rank files");
  std::ifstream in(m.dir / kStateFile);
  std::stringstream ss;
  ss << in.rdbuf();
  m.state = ss.str();
}

CheckpointReader::~CheckpointReader() = default;

const std::string& CheckpointReader::dir() const { return impl_->dir.native(); }
const std::string& CheckpointReader::state_json() const { return impl_->state; }
const std::vector<std::string>& CheckpointReader::names() const { return impl_->order; }
bool CheckpointReader::contains(const std::string& name) const {
  return impl_->tensors.count(name) > 0;
}
std::vector<int64_t> CheckpointReader::shape(const std::string& name) const {
  const Impl::Stored& t = impl_->stored(name);
  return t.scalar ? std::vector<int64_t>{} : t.shape;
}
NamedShapes CheckpointReader::shapes(const std::string& prefix) const {
  NamedShapes out;
  for (const std::string& name : impl_->order)
    if (name.rfind(prefix, 0) == 0) out.emplace_back(name.substr(prefix.size()), shape(name));
  return out;
}
uint64_t CheckpointReader::bytes_read() const { return impl_->bytes_read; }
uint64_t CheckpointReader::bytes_verified() const { return impl_->bytes_verified; }
uint64_t CheckpointReader::file_bytes() const {
  uint64_t n = 0;
  for (const Impl::File& f : impl_->files) n += f.sums.bytes;
  return n;
}

at::Tensor CheckpointReader::read(const std::string& name, const ShardSplit& split, int64_t begin,
                                  int64_t length) const {
  Impl& m = *impl_;
  const Impl::Stored& t = m.stored(name);
  const int64_t dims = static_cast<int64_t>(t.shape.size());
  std::vector<int64_t> shard = t.shape;  // the shard's shape
  bool fits = split.size >= 1 && split.rank >= 0 && split.rank < split.size && split.dim >= 0 &&
              split.dim < dims && (split.size == 1 || !t.scalar);
  if (fits && split.size > 1) {
    int64_t sum = 0;
    for (int64_t seg : split.segments) {
      sum += seg;
      fits = fits && seg > 0 && seg % split.size == 0;
    }
    const int64_t extent = t.shape[split.dim];
    fits = fits && (split.segments.empty() ? extent % split.size == 0 : sum == extent);
    shard[split.dim] = extent / split.size;
  }
  WEFT_CHECK(fits, m.dir.string(), ": tensor '", name, "' of shape ", at::IntArrayRef(t.shape),
             " has no chunk ", split.rank, " of ", split.size, " along dim ", split.dim,
             split.segments.empty() ? "" : " in segments ", at::IntArrayRef(split.segments));
  const int64_t numel = product(shard);
  const bool ranged = length >= 0;
  if (!ranged) length = numel;
  WEFT_CHECK(begin >= 0 && begin + length <= numel, m.dir.string(), ": tensor '", name,
             "': elements [", begin, ", ", begin + length, ") are outside its shard of ", numel);
  at::Tensor out =
      at::empty(ranged ? std::vector<int64_t>{length} : shard, at::TensorOptions().dtype(t.dtype));
  const at::Tensor flat = out.view({-1});
  std::vector<Box> boxes;
  flat_boxes(shard, 0, Box{}, begin, begin + length, boxes);
  const int64_t d = split.dim;
  int64_t offset = 0;
  for (const Box& box : boxes) {
    const int64_t volume = product(box.len);
    const at::Tensor dst = flat.narrow(0, offset, volume).view(box.len);
    offset += volume;
    each_part(box, d, split.intervals(t.shape[d]), false, [&](const Box& whole, int64_t start) {
      m.read_box(t, whole, dst.narrow(d, start, whole.len[d]));
    });
  }
  return t.scalar && !ranged ? out.view({}) : out;
}

std::vector<ShardSplit::Interval> ShardSplit::intervals(int64_t extent) const {
  std::vector<Interval> out;
  int64_t full = 0, local = 0;
  for (int64_t seg : size > 1 && !segments.empty() ? segments : std::vector<int64_t>{extent}) {
    const int64_t n = seg / size;
    out.push_back({full + rank * n, local, n});
    full += seg;
    local += n;
  }
  return out;
}

Checkpoint load_checkpoint(const std::string& dir) {
  const CheckpointReader r(dir);
  Checkpoint c;
  for (const std::string& name : r.names()) {
    if (name.rfind("model/", 0) == 0)
      c.model.emplace_back(name.substr(6), r.read(name));
    else if (name.rfind("optimizer/", 0) == 0)
      c.optimizer.emplace_back(name.substr(10), r.read(name));
    else
      WEFT_FAIL(dir, ": unexpected tensor '", name, "' (expected model/... or optimizer/...)");
  }
  c.state_json = r.state_json();
  return c;
}

}  // namespace weft::io
