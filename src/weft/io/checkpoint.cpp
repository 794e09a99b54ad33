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
constexpr const char* kShardsKey = "weft.shards";  // safetensors metadata of a rank file

// Every chunk written as flat ranges (TensorShard::shape), from whichever rank files, joined into
// one shard of the whole chunk; the ranges must tile it exactly.
std::vector<TensorShard> join_ranges(std::vector<TensorShard> shards, const std::string& dir) {
  std::vector<TensorShard> out;
  std::map<std::pair<std::string, int64_t>, std::vector<TensorShard>> ranges;
  for (TensorShard& s : shards) {
    if (s.shape.empty())
      out.push_back(std::move(s));
    else
      ranges[{s.name, s.rank}].push_back(std::move(s));
  }
  for (const TensorShard& s : out)
    WEFT_CHECK(!ranges.count({s.name, s.rank}), dir, ": tensor '", s.name, "': chunk ", s.rank,
               " is written both whole and as ranges");
  for (auto& [key, parts] : ranges) {
    const auto& [name, rank] = key;
    std::sort(parts.begin(), parts.end(),
              [](const TensorShard& a, const TensorShard& b) { return a.begin < b.begin; });
    const TensorShard& first = parts.front();
    at::Tensor chunk = torch::empty(first.shape, first.value.options());
    const at::Tensor flat = chunk.view({-1});
    int64_t covered = 0;
    for (const TensorShard& p : parts) {
      WEFT_CHECK(p.shape == first.shape && p.dim == first.dim && p.segments == first.segments &&
                     p.size == first.size && p.value.scalar_type() == first.value.scalar_type(),
                 dir, ": tensor '", name, "': its ranges of chunk ", rank,
                 " disagree on the chunk's shape, split or dtype");
      WEFT_CHECK(p.begin == covered, dir, ": tensor '", name, "': chunk ", rank, " has ",
                 p.begin > covered ? "no range for" : "two ranges over", " its elements from ",
                 std::min(p.begin, covered), " (a rank file missing or written twice?)");
      flat.narrow(0, p.begin, p.value.numel()).copy_(p.value);
      covered += p.value.numel();
    }
    WEFT_CHECK(covered == flat.numel(), dir, ": tensor '", name, "': chunk ", rank,
               " has no range for its elements from ", covered, " of ", flat.numel(),
               " (a rank file missing?)");
    out.push_back({name, chunk, first.dim, first.segments, rank, first.size, {}, 0});
  }
  return out;
}

// The data files of a checkpoint directory: *.safetensors, sorted.
std::vector<std::string> data_files(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".safetensors")
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A 64-bit checksum of a file's bytes (8 bytes per step, multiply-xorshift mixing): detects
// truncation and corruption; not a cryptographic hash.
std::pair<uint64_t, uint64_t> checksum_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in, "cannot read ", path.string());
  std::vector<char> buf(1 << 20);
  uint64_t h = 0x9e3779b97f4a7c15ull, bytes = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const size_t n = static_cast<size_t>(in.gcount());
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, buf.data() + i, 8);
      h = (h ^ w) * 0xff51afd7ed558ccdull;
      h ^= h >> 32;
    }
    for (; i < n; ++i) h = (h ^ static_cast<unsigned char>(buf[i])) * 0x100000001b3ull;
    bytes += n;
  }
  h ^= bytes;
  h = (h ^ (h >> 33)) * 0xc4ceb9fe1a85ec53ull;
  return {h ^ (h >> 33), bytes};
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// manifest.json: every data file's size and checksum, so a load can prove the files whole.
std::string manifest_of(const fs::path& dir) {
  nlohmann::ordered_json j;
  for (const std::string& f : data_files(dir)) {
    const auto [sum, bytes] = checksum_file(dir / f);
    j["files"][f] = {{"bytes", bytes}, {"checksum", hex(sum)}};
  }
  return j.dump(2);
}

void verify_manifest(const fs::path& dir) {
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
  for (const auto& [f, e] : j["files"].items()) {
    WEFT_CHECK(e.is_object(), path.string(), ": bad entry for ", f);
    WEFT_CHECK(fs::exists(dir / f), (dir / f).string(), ": missing (the manifest lists it)");
    const auto [sum, bytes] = checksum_file(dir / f);
    WEFT_CHECK(bytes == e.value("bytes", uint64_t{0}), (dir / f).string(), ": ", bytes,
               " bytes, the manifest says ", e.value("bytes", uint64_t{0}),
               " (truncated or overwritten)");
    WEFT_CHECK(hex(sum) == e.value("checksum", std::string()), (dir / f).string(), ": checksum ",
               hex(sum), " does not match the manifest's ", e.value("checksum", std::string()),
               " (the file is damaged)");
  }
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
                   const std::string& state_json, int64_t keep_last) {
  const fs::path final_dir = root / step_name(step);
  write_file_synced(tmp / kManifestFile, manifest_of(tmp));
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

void write_checkpoint_shards(const std::string& tmp_dir, int rank,
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
  save_safetensors((fs::path(tmp_dir) / name).string(), tensors, {{kShardsKey, layout.dump()}});
}

std::string finish_sharded_checkpoint(const std::string& run_dir, int64_t step,
                                      const std::string& state_json, int64_t keep_last) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  return commit(root, root / (".tmp-" + step_name(step)), step, state_json, keep_last);
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

Checkpoint load_checkpoint(const std::string& dir) {
  const fs::path d(dir);
  WEFT_CHECK(fs::exists(d / kStateFile), dir, ": not a complete checkpoint (no ", kStateFile, ")");
  verify_manifest(d);
  Checkpoint c;
  if (fs::exists(d / "model.safetensors")) {
    c.model = load_safetensors((d / "model.safetensors").string()).tensors;
    c.optimizer = load_safetensors((d / "optimizer.safetensors").string()).tensors;
  }
  for (const std::string& f : data_files(d)) {
    if (f.rfind("rank-", 0) != 0) continue;
    const std::string path = (d / f).string();
    SafetensorsFile file = load_safetensors(path);
    auto meta = file.metadata.find(kShardsKey);
    WEFT_CHECK(meta != file.metadata.end(), path, ": no \"", kShardsKey, "\" metadata");
    const nlohmann::json layout = nlohmann::json::parse(meta->second, nullptr, false);
    WEFT_CHECK(layout.is_object(), path, ": bad \"", kShardsKey, "\" metadata");
    for (auto& [name, t] : file.tensors) {
      WEFT_CHECK(layout.contains(name), path, ": tensor '", name, "' has no shard layout");
      const nlohmann::json& l = layout[name];
      TensorShard s{name, t, 0, {}, 0, 1, {}, 0};
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
      const bool range = l.contains("shape");
      const int64_t chunk_dims = range ? static_cast<int64_t>(s.shape.size()) : t.dim();
      int64_t chunk_numel = 1;  // -1: not a shape
      for (int64_t d : s.shape)
        chunk_numel = d < 0 || chunk_numel < 0 || (d > 0 && chunk_numel > (int64_t{1} << 62) / d)
                          ? -1
                          : chunk_numel * d;
      WEFT_CHECK(s.size >= 1 && s.rank >= 0 && s.rank < s.size && s.dim >= 0 && s.dim < chunk_dims,
                 path, ": tensor '", name, "': bad shard layout ", l.dump());
      WEFT_CHECK(!range || (t.dim() == 1 && chunk_numel >= 0 && s.begin >= 0 &&
                            s.begin + t.numel() <= chunk_numel),
                 path, ": tensor '", name, "' of shape ", t.sizes(), ": bad range layout ",
                 l.dump(), " (expected a flat range inside a chunk of that shape)");
      c.shards.push_back(std::move(s));
    }
  }
  c.shards = join_ranges(std::move(c.shards), dir);
  WEFT_CHECK(!c.model.empty() || !c.shards.empty(), dir, ": no model.safetensors or rank files");
  std::ifstream in(d / kStateFile);
  std::stringstream ss;
  ss << in.rdbuf();
  c.state_json = ss.str();
  return c;
}

}  // namespace weft::io
