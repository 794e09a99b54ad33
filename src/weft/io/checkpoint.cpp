#include "weft/io/checkpoint.h"

#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "weft/core/error.h"
#include "weft/io/safetensors.h"

namespace fs = std::filesystem;

namespace weft::io {

namespace {

constexpr const char* kStateFile = "state.json";

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

// Complete checkpoints of a run, oldest first.
std::vector<fs::path> complete_checkpoints(const fs::path& root) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.rfind("step_", 0) == 0 &&
        fs::exists(entry.path() / kStateFile))
      out.push_back(entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, int64_t step, const Checkpoint& ckpt,
                            int64_t keep_last) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  fs::create_directories(root);
  const fs::path final_dir = root / step_name(step);
  const fs::path tmp = root / (".tmp-" + step_name(step));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  save_safetensors((tmp / "model.safetensors").string(), ckpt.model);
  save_safetensors((tmp / "optimizer.safetensors").string(), ckpt.optimizer);
  write_file_synced(tmp / kStateFile, ckpt.state_json);  // written last: marks completeness
  fsync_path(tmp);
  if (fs::exists(final_dir)) {  // re-saving a step (after a resume): swap atomically-ish
    const fs::path old = root / (".old-" + step_name(step));
    fs::remove_all(old);
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(tmp, final_dir);
  }
  fsync_path(root);
  std::vector<fs::path> all = complete_checkpoints(root);
  const size_t keep = static_cast<size_t>(std::max<int64_t>(keep_last, 1));
  for (size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i]);
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& run_dir) {
  std::vector<fs::path> all = complete_checkpoints(fs::path(run_dir) / "checkpoints");
  return all.empty() ? std::string() : all.back().string();
}

Checkpoint load_checkpoint(const std::string& dir) {
  const fs::path d(dir);
  WEFT_CHECK(fs::exists(d / kStateFile), dir, ": not a complete checkpoint (no ", kStateFile, ")");
  Checkpoint c;
  c.model = load_safetensors((d / "model.safetensors").string()).tensors;
  c.optimizer = load_safetensors((d / "optimizer.safetensors").string()).tensors;
  std::ifstream in(d / kStateFile);
  std::stringstream ss;
  ss << in.rdbuf();
  c.state_json = ss.str();
  return c;
}

}  // namespace weft::io
