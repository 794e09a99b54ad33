#include "weft/model/multimodal.h"

#include <torch/torch.h>

#include "weft/core/error.h"
#include "weft/model/mask.h"

namespace weft::model {

at::Tensor to_device(const at::Tensor& t, c10::Device device) {
  if (!t.defined() || t.device() == device) return t;
  if (!device.is_cuda() || !t.is_cpu()) return t.to(device);
  // A pageable copy would wait for the whole stream; the caching host allocator keeps the
  // pinned buffer until the copy has run.
  return t.pin_memory().to(t.options().device(device), /*non_blocking=*/true);
}

Inputs to_device(const Inputs& in, c10::Device device) {
  auto move = [&](const at::Tensor& t) { return to_device(t, device); };
  Inputs out;
  out.tokens = move(in.tokens);
  out.positions = move(in.positions);
  out.doc = move(in.doc);
  out.item = move(in.item);
  for (const at::Tensor& t : in.encoder_inputs) out.encoder_inputs.push_back(move(t));
  out.encoder_first = in.encoder_first;
  for (const at::Tensor& t : in.encoder_rows) out.encoder_rows.push_back(move(t));
  out.target_rows = move(in.target_rows);
  out.targets = move(in.targets);
  return out;
}

MultimodalModel::MultimodalModel(const ModelSpec& spec, uint64_t seed, Hosting hosting)
    : spec_(spec), hosting_(std::move(hosting)), params_(hosting_.device, !hosting_.inference) {
  if (hosting_.encoders.empty()) hosting_.encoders.resize(spec.encoders.size());
  WEFT_ASSERT(hosting_.encoders.size() == spec.encoders.size(), "hosting covers ",
              hosting_.encoders.size(), " encoders; the model has ", spec.encoders.size());
  InitSeedGuard init(seed);
  const bool inference = hosting_.inference;
  const auto held_in = [&](bool frozen) {
    return frozen || inference ? hosting_.frozen_dtype : at::kFloat;
  };
  for (size_t i = 0; i < spec.encoders.size(); ++i) {
    const EncoderSpec& e = spec.encoders[i];
    const ModuleHosting& h = hosting_.encoders[i];
    Scope s{&params_, e.name, &h.shard};
    const bool projector = h.hosted && h.range.last_stage;
    params_.hold_cast_params_in(held_in(e.frozen));
    encoders_.push_back(h.hosted ? make_encoder(s, e, h.range) : nullptr);
    params_.hold_cast_params_in(held_in(e.projector.frozen));
    const Shard whole = h.shard.without_sp();  // the encoder's last stage gathers its tokens
    const Scope ps{&params_, e.name, &whole};
    projectors_.push_back(
        projector ? Projector::make(ps.sub("projector"), e.projector, e.hidden, spec.llm.hidden)
                  : Projector{});
    has_projector_.push_back(projector);
    if (h.hosted) set_trainable(e.name, !e.frozen && !inference);
    if (projector) set_trainable(e.name + ".projector", !e.projector.frozen && !inference);
  }
  if (hosting_.llm.hosted) {
    params_.hold_cast_params_in(held_in(spec.llm.frozen));
    const ModuleHosting& h = hosting_.llm;
    llm_ = Llm::make(Scope{&params_, "llm", &h.shard}, spec.llm,
                     h.chunks.empty() ? std::vector<StageRange>{h.range} : h.chunks);
    set_trainable("llm", !spec.llm.frozen && !inference);
  }
  params_.hold_cast_params_in(at::kFloat);
}

const Projector* MultimodalModel::projector(size_t e) const {
  return has_projector_[e] ? &projectors_[e] : nullptr;
}

std::string MultimodalModel::module_of(const std::string& name) {
  const size_t dot = name.find('.');
  const std::string head = name.substr(0, dot);
  if (head != "llm" && name.compare(dot + 1, 10, "projector.") == 0) return head + ".projector";
  return head;
}

void MultimodalModel::set_trainable(const std::string& module, bool trainable) {
  bool found = false;
  for (const auto& [name, p] : params_.all())
    WEFT_CHECK(!trainable || module_of(name) != module || p.scalar_type() == at::kFloat, "module '",
               module, "' was built frozen, held in ", p.scalar_type(),
               " without fp32 master weights (parameter ", name, "): it cannot train");
  for (const auto& [name, p] : params_.all()) {
    if (module_of(name) != module) continue;
    p.set_requires_grad(trainable && !unused(name));
    found = true;
  }
  WEFT_CHECK(found, "no parameters belong to module '", module, "'");
}

bool MultimodalModel::unused(const std::string& param_name) const {
  for (const EncoderSpec& e : spec_.encoders) {
    const std::string blocks = e.name + ".layers.";
    if (param_name.compare(0, blocks.size(), blocks) != 0) continue;
    const size_t end = param_name.find('.', blocks.size());
    if (end == std::string::npos) return false;
    return std::stoll(param_name.substr(blocks.size(), end - blocks.size())) >= e.layers_used();
  }
  return false;
}

at::Tensor MultimodalModel::embed_with(const at::Tensor& tokens,
                                       const std::vector<at::Tensor>& features,
                                       const std::vector<at::Tensor>& encoder_rows) const {
  at::Tensor x = llm_.embed(tokens);
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2);
  at::Tensor flat = x.reshape({B * S, H});
  for (size_t e = 0; e < features.size(); ++e) {
    const at::Tensor& rows = encoder_rows[e];
    const int64_t n = features[e].defined() ? features[e].size(0) : 0;
    const int64_t placeholders = rows.defined() ? rows.numel() : 0;
    WEFT_CHECK(placeholders == n, "encoder '", spec_.encoders[e].name, "': ", n, " features for ",
               placeholders, " placeholder tokens");
    if (n > 0) flat = flat.index_copy(0, rows, features[e].to(flat.dtype()));
  }
  return flat.view({B, S, H});
}

at::Tensor MultimodalModel::embed(const Inputs& in) const {
  WEFT_CHECK(
      in.encoder_inputs.size() == encoders_.size() && in.encoder_rows.size() == encoders_.size(),
      "model inputs carry ", in.encoder_inputs.size(), " encoder inputs; the model has ",
      encoders_.size(), " encoders");
  std::vector<at::Tensor> features(encoders_.size());
  for (size_t e = 0; e < encoders_.size(); ++e) {
    const at::Tensor& input = in.encoder_inputs[e];
    const int64_t items = input.defined() ? input.size(0) : 0;
    const int64_t per_item = spec_.encoders[e].tokens_per_item();
    const int64_t placeholders = in.encoder_rows[e].defined() ? in.encoder_rows[e].numel() : 0;
    WEFT_CHECK(in.encoder_first.empty() || in.encoder_first[e] == 0, "encoder '",
               spec_.encoders[e].name, "': the inputs start at item ", in.encoder_first[e],
               "; the whole model needs every item loaded");
    WEFT_CHECK(placeholders == items * per_item, "encoder '", spec_.encoders[e].name, "': ", items,
               " items produce ", items * per_item, " features but the text has ", placeholders,
               " placeholder tokens");
    if (items == 0) continue;
    WEFT_ASSERT(encoders_[e] && has_projector_[e], "embed needs every encoder on this rank");
    features[e] = projectors_[e]((*encoders_[e])(input)).reshape({items * per_item, -1});
  }
  return embed_with(in.tokens, features, in.encoder_rows);
}

at::Tensor MultimodalModel::hidden(const at::Tensor& x, const Inputs& in) const {
  TokenInfo tokens;
  tokens.valid = in.doc >= 0;
  return llm_.forward(x, in.positions, {visible_mask(in.doc, in.item)}, tokens);
}

at::Tensor MultimodalModel::loss_sum(const Inputs& in) const {
  at::Tensor x;
  {
    const Llm::TiedHeadInGraph tied;  // the loss below reads a tied table through the head
    x = embed(in);
  }
  at::Tensor h = hidden(x, in);
  at::Tensor rows = h.reshape({-1, h.size(-1)}).index_select(0, in.target_rows);
  return llm_.loss_sum(rows, in.targets);
}

}  // namespace weft::model
