// Rows per chunk of the fused LM head and loss (model/cross_entropy.h), shared with the simulator
// (plan/simulate.cpp), which counts the vocab-parallel loss's two reductions per chunk.
#pragma once

#include <algorithm>
#include <cstdint>

namespace weft {

// Over `vocab_rows` rows of the vocabulary (a TP rank's): about 32 Mi logits per chunk, and at
// least `hidden` rows (the weight's gradient is summed over the chunks through an fp32 [V, H]
// buffer, which more chunks than that would make cost more than the logits they save).
inline int64_t loss_chunk_rows(int64_t hidden, int64_t vocab_rows) {
  constexpr int64_t kChunkLogits = int64_t{32} << 20;  // 128 MiB in fp32
  return std::max(std::max<int64_t>(1, hidden), kChunkLogits / std::max<int64_t>(1, vocab_rows));
}

}  // namespace weft
