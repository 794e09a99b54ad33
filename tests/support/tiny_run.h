// Test support shared by the trainer and data-parallel tests: a tiny vision-language config
// (fp32, a few hundred milliseconds per step), a fresh per-process temporary directory, and the
// per-step losses a run wrote to metrics.jsonl.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "weft/io/files.h"

namespace weft::testing {

inline constexpr const char* kTinyVlm = R"(
[model.llm]
hidden = 32
layers = 2
heads = 4
kv_heads = 2
ffn = 64
max_seq = 32
[model.vision]
kind = "vit"
image_size = 32
patch = 8
stem_channels = 8
hidden = 32
layers = 2
heads = 2
ffn = 64
[data]
eval_samples = 16
[train]
steps = 6
batch = 8
microbatches = 2
warmup = 2
lr = 3e-3
precision = "fp32"
log_every = 1
)";

inline std::filesystem::path temp_dir(const std::string& name) {
  std::filesystem::path d = std::filesystem::temp_directory_path() /
                            ("weft_test_" + std::to_string(::getpid()) + "_" + name);
  weft::io::remove_tree(d);
  return d;
}

inline std::vector<double> run_losses(const std::filesystem::path& run) {
  std::vector<double> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(std::stod(line.substr(line.find("\"loss\":") + 7)));
  return out;
}

}  // namespace weft::testing
