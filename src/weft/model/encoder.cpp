#include "weft/model/encoder.h"

#include <torch/torch.h>

#include <cmath>
#include <string>

#include "weft/model/torch_compat.h"

namespace weft::model {

namespace {
std::vector<EncoderBlock> make_blocks(const Scope& s, const EncoderSpec& e) {
  std::vector<EncoderBlock> blocks;
  for (int64_t i = 0; i < e.layers; ++i)
    blocks.push_back(EncoderBlock::make(s.sub("layers." + std::to_string(i)), e.hidden, e.heads,
                                        e.ffn, e.norm_eps, e.layers));
  return blocks;
}
}  // namespace

VisionEncoder::VisionEncoder(const Scope& s, const EncoderSpec& spec) : spec_(spec) {
  int64_t in_ch = spec.channels, kernel = spec.patch;
  for (int64_t i = 0; spec.stem_channels > 0 && i < spec.stem_layers; ++i) {
    const std::string name = "stem." + std::to_string(i);
    const double std = std::sqrt(2.0 / static_cast<double>(in_ch * 9));
    stem_w_.push_back(s.add(name + ".weight", init_normal({spec.stem_channels, in_ch, 3, 3}, std)));
    stem_b_.push_back(s.add(name + ".bias", torch::zeros({spec.stem_channels})));
    in_ch = spec.stem_channels;
    kernel /= 2;
  }
  const double std = 1.0 / std::sqrt(static_cast<double>(in_ch * kernel * kernel));
  patch_w_ = s.add("patch.weight", init_normal({spec.hidden, in_ch, kernel, kernel}, std));
  patch_b_ = s.add("patch.bias", torch::zeros({spec.hidden}));
  // Learned positions start on the scale of the patch embeddings (not 0.02): where a thing is
  // in the image must be visible to attention from the first step.
  pos_ = s.add("position", init_normal({spec.tokens_per_item(), spec.hidden}, 0.5));
  pre_ln_ = LayerNorm::make(s.sub("pre_ln"), spec.hidden, spec.norm_eps);
  blocks_ = make_blocks(s, spec);
}

at::Tensor VisionEncoder::operator()(const at::Tensor& images) const {
  at::Tensor x = to_compute(images);
  for (size_t i = 0; i < stem_w_.size(); ++i)
    x = compat::gelu(at::conv2d(x, to_compute(stem_w_[i]), to_compute(stem_b_[i]), 2, 1));
  const int64_t k = patch_w_.size(-1);
  x = at::conv2d(x, to_compute(patch_w_), to_compute(patch_b_), k);  // [N, h, g, g]
  x = x.flatten(2).transpose(1, 2) + to_compute(pos_);               // [N, T, h]
  x = pre_ln_(x);
  const int64_t used = spec_.layers_used();
  for (int64_t i = 0; i < used; ++i) x = blocks_[i](x);
  return x;
}

at::Tensor sinusoids(int64_t length, int64_t dim) {
  const int64_t half = dim / 2;
  const double step = std::log(10000.0) / static_cast<double>(std::max<int64_t>(half - 1, 1));
  at::Tensor inv = torch::exp(torch::arange(half, torch::kDouble) * -step);
  at::Tensor t = torch::arange(length, torch::kDouble).unsqueeze(1) * inv.unsqueeze(0);
  return torch::cat({t.sin(), t.cos()}, 1).to(torch::kFloat);
}

AudioEncoder::AudioEncoder(const Scope& s, const EncoderSpec& spec) : spec_(spec) {
  const double std1 = 1.0 / std::sqrt(static_cast<double>(spec.mels * 3));
  const double std2 = 1.0 / std::sqrt(static_cast<double>(spec.hidden * 3));
  conv1_w_ = s.add("conv1.weight", init_normal({spec.hidden, spec.mels, 3}, std1));
  conv1_b_ = s.add("conv1.bias", torch::zeros({spec.hidden}));
  conv2_w_ = s.add("conv2.weight", init_normal({spec.hidden, spec.hidden, 3}, std2));
  conv2_b_ = s.add("conv2.bias", torch::zeros({spec.hidden}));
  pos_ = sinusoids(spec.tokens_per_item(), spec.hidden);
  blocks_ = make_blocks(s, spec);
  final_ln_ = LayerNorm::make(s.sub("final_ln"), spec.hidden, spec.norm_eps);
}

at::Tensor AudioEncoder::operator()(const at::Tensor& mels) const {
  at::Tensor x = to_compute(mels);
  x = compat::gelu(at::conv1d(x, to_compute(conv1_w_), to_compute(conv1_b_), 1, 1));
  x = compat::gelu(at::conv1d(x, to_compute(conv2_w_), to_compute(conv2_b_), 2, 1));
  x = x.transpose(1, 2) + to_compute(pos_);  // [N, T, h]
  const int64_t used = spec_.layers_used();
  for (int64_t i = 0; i < used; ++i) x = blocks_[i](x);
  return final_ln_(x);
}

std::unique_ptr<Encoder> make_encoder(const Scope& s, const EncoderSpec& spec) {
  if (spec.kind == EncoderKind::kVit) return std::make_unique<VisionEncoder>(s, spec);
  return std::make_unique<AudioEncoder>(s, spec);
}

Projector Projector::make(const Scope& s, const ProjectorSpec& spec, int64_t in, int64_t out) {
  Projector p;
  p.kind = spec.kind;
  if (spec.kind == ProjectorKind::kLinear)
    p.linear = Linear::make(s.sub("linear"), in, out, true);
  else
    p.mlp = GeluMlp::make(s, in, out, out, 0.02);
  return p;
}

at::Tensor Projector::operator()(const at::Tensor& x) const {
  return kind == ProjectorKind::kLinear ? linear(x) : mlp(x);
}

}  // namespace weft::model
