// Test support for the torch-free plan tests: small Specs built in code.
#pragma once

#include "weft/core/spec.h"

namespace weft::testing {

// A 4-layer LLM (vocab 256) with one 3-layer "vision" encoder; batch 8 in 2 microbatches.
inline Spec vlm_spec() {
  Spec s;
  s.source = "test.toml";
  s.model.llm.layers = 4;
  s.model.llm.vocab = 256;
  EncoderSpec v;
  v.name = "vision";
  v.layers = 3;
  s.model.encoders = {v};
  s.train.batch = 8;
  s.train.microbatches = 2;
  return s;
}

}  // namespace weft::testing
