#include "weft/model/encoder.h"

#include <torch/torch.h>

#include <cmath>
#include <string>

#include "weft/dist/collectives.h"
#include "weft/model/fused.h"
#include "weft/model/recompute.h"

namespace weft::model {

namespace {
// Resolves the range's -1 end to the blocks the encoder runs.
StageRange resolve(StageRange r, const EncoderSpec& e) {
  if (r.last_layer < 0) r.last_layer = e.layers_used();
  return r;
}

// The blocks of the range; the last stage also holds the unused ones past feature_layer.
std::vector<EncoderBlock> make_blocks(const Scope& s, const EncoderSpec& e, const StageRange& r) {
  std::vector<EncoderBlock> blocks;
  const int64_t end = r.last_stage ? e.layers : r.last_layer;
  for (int64_t i = r.first_layer; i < end; ++i)
    blocks.push_back(EncoderBlock::make(s.sub("layers." + std::to_string(i)), e.hidden, e.heads,
                                        e.ffn, e.norm_eps, e.layers, e.act));
  return blocks;
}

// The blocks the range runs; under the spec's recompute (and recompute_blocks) they are
// recomputed in backward (recompute.h).
at::Tensor run_blocks(const std::vector<EncoderBlock>& blocks, const StageRange& r, at::Tensor x,
                      const EncoderSpec& spec) {
  for (int64_t i = 0; i < r.last_layer - r.first_layer; ++i) {
    const EncoderBlock& b = blocks[i];
    if (!recomputes_block(spec.recompute, spec.recompute_blocks, r.stage, i)) {
      x = b(x);
      continue;
    }
    x = recompute(
        [b](const at::Tensor& h, const std::vector<at::Tensor>& p) { return with_params(b, p)(h); },
        x, block_params(b));
  }
  return x;
}

// Context parallelism: this rank's contiguous share of every item's tokens [N, T, h]; under
// sequence parallelism split again over TP (whose backward gathers the gradient whole).
at::Tensor own_tokens(const at::Tensor& x, const Shard& g) {
  at::Tensor mine = x;
  if (g.cp.size() > 1) {
    const int64_t chunk = x.size(1) / g.cp.size();
    mine = x.narrow(1, g.cp.rank() * chunk, chunk);
  }
  return g.sequence_parallel() ? dist::split_replicated(mine, g.tp, 1) : mine;
}

// The last stage's features: every token of this CP rank's share, gathered over TP under
// sequence parallelism.
at::Tensor whole_tokens(const at::Tensor& x, const Shard& g) {
  return g.sequence_parallel() ? dist::gather_replicated(x, g.tp, 1) : x;
}
}  // namespace

VisionEncoder::VisionEncoder(const Scope& s, const EncoderSpec& spec, StageRange range)
    : spec_(spec), range_(resolve(range, spec)), groups_(s.groups()) {
  if (range_.first_stage) {
    int64_t in_ch = spec.channels, kernel = spec.patch;
    for (int64_t i = 0; spec.stem_channels > 0 && i < spec.stem_layers; ++i) {
      const std::string name = "stem." + std::to_string(i);
      const double std = std::sqrt(2.0 / static_cast<double>(in_ch * 9));
      stem_w_.push_back(s.normal(name + ".weight", {spec.stem_channels, in_ch, 3, 3}, std));
      stem_b_.push_back(s.add(name + ".bias", torch::zeros({spec.stem_channels})));
      in_ch = spec.stem_channels;
      kernel /= 2;
    }
    const double std = 1.0 / std::sqrt(static_cast<double>(in_ch * kernel * kernel));
    patch_w_ = s.normal("patch.weight", {spec.hidden, in_ch, kernel, kernel}, std);
    if (spec.patch_bias) patch_b_ = s.add("patch.bias", torch::zeros({spec.hidden}));
    if (spec.class_token) cls_ = s.normal("class", {spec.hidden}, 0.5);
    // Learned positions start on the scale of the patch embeddings (not 0.02): where a thing is
    // in the image must be visible to attention from the first step.
    pos_ = s.normal("position", {spec.block_tokens(), spec.hidden}, 0.5);
    if (spec.pre_norm) pre_ln_ = LayerNorm::make(s.sub("pre_ln"), spec.hidden, spec.norm_eps);
  }
  blocks_ = make_blocks(s, spec, range_);
}

at::Tensor VisionEncoder::operator()(const at::Tensor& input) const {
  at::Tensor x = input;
  if (range_.first_stage) {
    x = own_tokens(front(input), groups_);
    if (pre_ln_.weight.defined()) x = pre_ln_(x);  // on this rank's tokens (a whole() weight)
  }
  x = run_blocks(blocks_, range_, x, spec_);
  if (!range_.last_stage) return x;
  x = whole_tokens(x, groups_);
  return spec_.class_token ? x.narrow(1, 1, x.size(1) - 1) : x;
}

at::Tensor VisionEncoder::front(const at::Tensor& images) const {
  at::Tensor x = to_compute(images);
  for (size_t i = 0; i < stem_w_.size(); ++i)
    x = gelu_erf(at::conv2d(x, to_compute(stem_w_[i]), to_compute(stem_b_[i]), 2, 1));
  // The patch embedding, a convolution with stride == kernel, as what it is: one matmul over
  // the patches (faster than LibTorch's bf16 convolution, forward and backward) -> [N, T, h].
  const int64_t k = patch_w_.size(-1);
  x = at::linear(patchify(x, k), to_compute(patch_w_).reshape({patch_w_.size(0), -1}),
                 patch_b_.defined() ? to_compute(patch_b_) : at::Tensor());
  if (cls_.defined()) x = at::cat({to_compute(cls_).expand({x.size(0), 1, x.size(2)}), x}, 1);
  return x + to_compute(pos_);
}

at::Tensor sinusoids(int64_t length, int64_t dim) {
  const int64_t half = dim / 2;
  const double step = std::log(10000.0) / static_cast<double>(std::max<int64_t>(half - 1, 1));
  at::Tensor inv = torch::exp(torch::arange(half, torch::kDouble) * -step);
  at::Tensor t = torch::arange(length, torch::kDouble).unsqueeze(1) * inv.unsqueeze(0);
  return torch::cat({t.sin(), t.cos()}, 1).to(torch::kFloat);
}

AudioEncoder::AudioEncoder(const Scope& s, const EncoderSpec& spec, StageRange range)
    : spec_(spec), range_(resolve(range, spec)), groups_(s.groups()) {
  if (range_.first_stage) {
    const double std1 = 1.0 / std::sqrt(static_cast<double>(spec.mels * 3));
    const double std2 = 1.0 / std::sqrt(static_cast<double>(spec.hidden * 3));
    conv1_w_ = s.normal("conv1.weight", {spec.hidden, spec.mels, 3}, std1);
    conv1_b_ = s.add("conv1.bias", torch::zeros({spec.hidden}));
    conv2_w_ = s.normal("conv2.weight", {spec.hidden, spec.hidden, 3}, std2);
    conv2_b_ = s.add("conv2.bias", torch::zeros({spec.hidden}));
    pos_ = sinusoids(spec.tokens_per_item(), spec.hidden).to(s.device());
  }
  blocks_ = make_blocks(s, spec, range_);
  if (range_.last_stage) final_ln_ = LayerNorm::make(s.sub("final_ln"), spec.hidden, spec.norm_eps);
}

at::Tensor AudioEncoder::operator()(const at::Tensor& input) const {
  at::Tensor x = to_compute(input);
  if (range_.first_stage) {
    x = gelu_erf(at::conv1d(x, to_compute(conv1_w_), to_compute(conv1_b_), 1, 1));
    x = gelu_erf(at::conv1d(x, to_compute(conv2_w_), to_compute(conv2_b_), 2, 1));
    x = own_tokens(x.transpose(1, 2) + to_compute(pos_), groups_);  // [N, T/cp(/tp), h]
  }
  x = run_blocks(blocks_, range_, x, spec_);
  return range_.last_stage ? whole_tokens(final_ln_(x), groups_) : x;
}

std::unique_ptr<Encoder> make_encoder(const Scope& s, const EncoderSpec& spec, StageRange range) {
  if (spec.kind == EncoderKind::kVit) return std::make_unique<VisionEncoder>(s, spec, range);
  return std::make_unique<AudioEncoder>(s, spec, range);
}

Projector Projector::make(const Scope& s, const ProjectorSpec& spec, int64_t in, int64_t out) {
  Projector p;
  p.kind = spec.kind;
  if (spec.kind == ProjectorKind::kLinear)
    p.linear = Linear::make(s.sub("linear"), in, out, true);
  else
    p.mlp = GeluMlp::make(s, in, out, out, 0.02);  // LLaVA's projector: exact GELU
  return p;
}

at::Tensor Projector::operator()(const at::Tensor& x) const {
  return kind == ProjectorKind::kLinear ? linear(x) : mlp(x);
}

}  // namespace weft::model
