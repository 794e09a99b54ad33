#include "weft/model/multimodal.h"

#include <torch/torch.h>

#include "weft/core/error.h"
#include "weft/model/mask.h"

namespace weft::model {

MultimodalModel::MultimodalModel(const ModelSpec& spec) : spec_(spec) { build(); }

MultimodalModel::MultimodalModel(const ModelSpec& spec, uint64_t seed) : spec_(spec) {
  InitSeedGuard init(seed);
  build();
}

void MultimodalModel::build() {
  const ModelSpec& spec = spec_;
  for (const EncoderSpec& e : spec.encoders) {
    Scope s{&params_, e.name};
    encoders_.push_back(make_encoder(s, e));
    projectors_.push_back(
        Projector::make(s.sub("projector"), e.projector, e.hidden, spec.llm.hidden));
  }
  llm_ = Llm::make(Scope{&params_, "llm"}, spec.llm);
  for (const EncoderSpec& e : spec.encoders) {
    set_trainable(e.name, !e.frozen);
    set_trainable(e.name + ".projector", !e.projector.frozen);
  }
  set_trainable("llm", !spec.llm.frozen);
}

std::string MultimodalModel::module_of(const std::string& name) {
  const size_t dot = name.find('.');
  const std::string head = name.substr(0, dot);
  if (head != "llm" && name.compare(dot + 1, 10, "projector.") == 0) return head + ".projector";
  return head;
}

void MultimodalModel::set_trainable(const std::string& module, bool trainable) {
  bool found = false;
  for (const auto& [name, p] : params_.all()) {
    if (module_of(name) != module) continue;
    p.set_requires_grad(trainable);
    found = true;
  }
  WEFT_CHECK(found, "no parameters belong to module '", module, "'");
}

at::Tensor MultimodalModel::embed(const Inputs& in) const {
  at::Tensor x = llm_.embed(in.tokens);
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2);
  WEFT_CHECK(
      in.encoder_inputs.size() == encoders_.size() && in.encoder_rows.size() == encoders_.size(),
      "model inputs carry ", in.encoder_inputs.size(), " encoder inputs; the model has ",
      encoders_.size(), " encoders");
  at::Tensor flat = x.reshape({B * S, H});
  for (size_t e = 0; e < encoders_.size(); ++e) {
    const at::Tensor& input = in.encoder_inputs[e];
    const at::Tensor& rows = in.encoder_rows[e];
    const int64_t items = input.defined() ? input.size(0) : 0;
    const int64_t per_item = spec_.encoders[e].tokens_per_item();
    const int64_t placeholders = rows.defined() ? rows.numel() : 0;
    WEFT_CHECK(placeholders == items * per_item, "encoder '", spec_.encoders[e].name, "': ", items,
               " items produce ", items * per_item, " features but the text has ", placeholders,
               " placeholder tokens");
    if (items == 0) continue;
    at::Tensor features = projectors_[e]((*encoders_[e])(input));  // [N, T, H]
    flat = flat.index_copy(0, rows, features.reshape({items * per_item, H}).to(flat.dtype()));
  }
  return flat.view({B, S, H});
}

at::Tensor MultimodalModel::hidden(const at::Tensor& x, const Inputs& in) const {
  return llm_.forward(x, in.positions, visible_mask(in.doc, in.item));
}

at::Tensor MultimodalModel::loss_sum(const Inputs& in) const {
  at::Tensor h = hidden(embed(in), in);
  at::Tensor rows = h.reshape({-1, h.size(-1)}).index_select(0, in.target_rows);
  at::Tensor logits = llm_.logits(rows);
  return at::cross_entropy_loss(logits, in.targets, {}, at::Reduction::Sum);
}

}  // namespace weft::model
