// Modality encoders and projectors. An Encoder maps a batch of items to features
// [N, tokens_per_item, hidden]; a Projector maps those to the LLM's hidden size.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "weft/core/spec.h"
#include "weft/model/layers.h"
#include "weft/model/llm.h"

namespace weft::model {

class Encoder {
 public:
  virtual ~Encoder() = default;
  // inputs: vit [N, C, H, W]; whisper [N, mels, frames] (fp32). Returns compute-dtype features.
  virtual at::Tensor operator()(const at::Tensor& inputs) const = 0;
};

// A pipeline stage of an encoder builds its blocks of `range` (the first stage also the front
// end: stem, patch embedding, positions; the last stage the back end and any unused blocks past
// feature_layer, so the parameter set of all stages is the single-process one). A later
// stage's input is the previous stage's output [N, T, hidden].
//
// Parallelism (the Shard of the scope): under CP a rank's blocks run its contiguous share of
// every item's tokens, T/cp; under sequence parallelism (Shard::sp, tp > 1) that share is split
// again over TP between the tensor-parallel regions, so a stage's input and output hold T/(cp·tp)
// tokens, and the last stage gathers them over TP (before dropping a [CLS] token) for the
// projector, which runs on every token of the CP share.
//
// ViT (CLIP/SigLIP): optional conv stem (stem_layers 3x3 stride-2 convs + GELU), conv patch
// embedding (kernel = stride = patch / 2^stem_layers), an optional [CLS] token (CLIP), learned
// positions, an optional LayerNorm (CLIP's pre_layrnorm), pre-LN blocks; features are the patch
// tokens of block `feature_layer` (LLaVA takes -2), [CLS] dropped.
class VisionEncoder final : public Encoder {
 public:
  VisionEncoder(const Scope& s, const EncoderSpec& spec, StageRange range = {});
  at::Tensor operator()(const at::Tensor& images) const override;

 private:
  at::Tensor front(const at::Tensor& images) const;  // stem, patches, positions

  EncoderSpec spec_;
  StageRange range_;
  Shard groups_;
  std::vector<at::Tensor> stem_w_, stem_b_;
  at::Tensor patch_w_, patch_b_, cls_, pos_;
  LayerNorm pre_ln_;
  std::vector<EncoderBlock> blocks_;
};

// Whisper-style: conv1d(k3) + GELU, conv1d(k3, stride 2) + GELU, sinusoidal positions,
// pre-LN GELU blocks, final LayerNorm.
class AudioEncoder final : public Encoder {
 public:
  AudioEncoder(const Scope& s, const EncoderSpec& spec, StageRange range = {});
  at::Tensor operator()(const at::Tensor& mels) const override;

 private:
  EncoderSpec spec_;
  StageRange range_;
  Shard groups_;
  at::Tensor conv1_w_, conv1_b_, conv2_w_, conv2_b_, pos_;
  std::vector<EncoderBlock> blocks_;
  LayerNorm final_ln_;
};

std::unique_ptr<Encoder> make_encoder(const Scope& s, const EncoderSpec& spec,
                                      StageRange range = {});

// Linear (replicated under TP), or 2-layer MLP with GELU (LLaVA-1.5; column then row parallel).
struct Projector {
  ProjectorKind kind = ProjectorKind::kMlp;
  Linear linear;
  GeluMlp mlp;
  static Projector make(const Scope& s, const ProjectorSpec& spec, int64_t in, int64_t out);
  at::Tensor operator()(const at::Tensor& x) const;
};

// Fixed sinusoidal position table [length, dim] (Whisper's).
at::Tensor sinusoids(int64_t length, int64_t dim);

}  // namespace weft::model
