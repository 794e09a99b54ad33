// `weft example llava OUT_DIR`: a small LLaVA-style dataset, tokenizer and Hugging Face
// checkpoints, generated locally (what configs/llava-style.toml trains on).
#pragma once

#include <cstdint>
#include <string>

namespace weft::cli {

int run_example_llava(const std::string& out_dir, int64_t samples, uint64_t seed);

}  // namespace weft::cli
