// Test support: the small multimodal ModelSpec the model and checkpoint tests build on.
#pragma once

#include "weft/core/spec.h"

namespace weft::testing {

// A Whisper encoder on 8 mel bins × 8 frames (4 tokens per clip), hidden 16, with a linear
// projector.
inline EncoderSpec tiny_whisper(const char* name = "audio") {
  EncoderSpec a;
  a.name = name;
  a.kind = EncoderKind::kWhisper;
  a.mels = 8;
  a.frames = 8;
  a.hidden = 16;
  a.layers = 2;
  a.heads = 2;
  a.ffn = 32;
  a.projector.kind = ProjectorKind::kLinear;
  return a;
}

// An LLM of vocab 20, hidden 32, 2 blocks of 4 heads over 2 KV heads, ffn 64, max_seq 32; a ViT
// "vision" on 16-pixel images in 8-pixel patches (4 tokens per image), hidden 16; and
// tiny_whisper(). Tests change what they need.
inline ModelSpec tiny_multimodal_spec() {
  ModelSpec m;
  m.llm.vocab = 20;
  m.llm.hidden = 32;
  m.llm.layers = 2;
  m.llm.heads = 4;
  m.llm.kv_heads = 2;
  m.llm.ffn = 64;
  m.llm.max_seq = 32;
  EncoderSpec v;
  v.name = "vision";
  v.kind = EncoderKind::kVit;
  v.image_size = 16;
  v.patch = 8;
  v.channels = 3;
  v.hidden = 16;
  v.layers = 2;
  v.heads = 2;
  v.ffn = 32;
  m.encoders = {v, tiny_whisper()};
  return m;
}

}  // namespace weft::testing
