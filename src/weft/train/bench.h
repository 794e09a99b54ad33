// `weft bench step`: the time of real training steps — the Trainer's own step (forward,
// backward, clipping, AdamW) on batches drawn and collated before the clock starts — with
// tokens/s, MFU against the measured matmul peak, and the memory the steps add to the process.
// It can also dump the model's initial weights and the batches, so a reference implementation
// (bench/eager_reference.py) runs the very same steps.
#pragma once

#include <cstdint>
#include <string>

#include "weft/core/spec.h"

namespace weft::train {

struct BenchOptions {
  int64_t warmup = 2;     // untimed steps first (allocator, kernel selection)
  int64_t steps = 5;      // timed steps
  double peak_flops = 0;  // MFU denominator; 0 = measure the matmul peak in the compute dtype
  std::string dump_dir;   // "" = no dump; else config.toml, model.safetensors, step-*.safetensors
  std::string profile;    // "" = none; else a Chrome trace of the last step's ATen operators
};

// Runs warmup + steps single-process training steps of `spec` and returns the result as JSON:
// losses, per-step seconds, median, tokens/s, MFU (all modules and LLM only), peak memory.
std::string bench_step(Spec spec, const BenchOptions& options);

// Greedy captions of the first `samples` eval samples of `spec`'s data from its model at its
// initial weights, generated with the KV cache and by rerunning the whole sequence for every
// token, alternately `rounds` times: the median seconds of each and their ratio, and how many
// captions differ between the two (JSON).
std::string bench_generate(Spec spec, int64_t samples, int64_t rounds);

// Resident memory of this process (Linux /proc/self/status): now, and the peak since start or
// since the last reset_peak_rss().
int64_t rss_bytes();
int64_t peak_rss_bytes();
void reset_peak_rss();

}  // namespace weft::train
