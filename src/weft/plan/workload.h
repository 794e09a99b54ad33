// Synthetic workload mixes for balancing what-ifs: per-sample shapes (tokens, items per encoder,
// loss targets) drawn from a named distribution, with each item's placeholder tokens taken from
// the Spec's encoder. Deterministic for a seed.
//
//   llava        LLaVA-style instruction data: 25% text-only, 55% one image, 12% 2–4 images,
//                8% high-resolution (AnyRes: 5 image tiles); text 64–1536 tokens
//   video        50% clips of 8 frames, 25% one image, 25% text-only; text 32–1024 tokens
//   interleaved  0–8 images interleaved with 128–3072 text tokens
// Items go to the first vision encoder (kind vit); other encoders get none. A Spec without a
// vision encoder gives text-only samples. The loss is on the text tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/plan/balance.h"

namespace weft::plan {

const std::vector<std::string>& workload_mixes();

// `n` samples of mix `name` (one of workload_mixes(); anything else throws, listing them).
std::vector<SampleShape> sample_workload(const std::string& name, const Spec& spec, int64_t n,
                                         uint64_t seed);

}  // namespace weft::plan
