// MultimodalModel: named encoders, each with its projector, feeding one decoder LLM. Text
// carries one placeholder token per encoder output feature; projected features replace the
// embeddings at those positions. The loss is next-token cross-entropy on target tokens only.
//
// Parameters are named "<encoder>.*", "<encoder>.projector.*" and "llm.*" — the module names
// of the Plan. Frozen modules' parameters do not require grad: autograd then records nothing
// for a frozen module with nothing trainable upstream (forward only, no activations kept) and
// only input gradients for one with trainable modules upstream.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "weft/core/spec.h"
#include "weft/model/encoder.h"
#include "weft/model/layers.h"
#include "weft/model/llm.h"

namespace weft::model {

// What one forward pass consumes (CPU or device tensors).
struct Inputs {
  at::Tensor tokens;     // int64 [B, S]
  at::Tensor positions;  // int64 [B, S] (restart per packed document)
  at::Tensor doc;        // int32 [B, S]; -1 = padding
  at::Tensor item;       // int32 [B, S]; -1 = text, else a modality item id unique in its row
  // Per encoder: the inputs of items [encoder_first[e], encoder_first[e] + n) of its N_e
  // (undefined when n = 0); a rank loads only the items its encoder stages read. Empty
  // encoder_first = all from 0, which the whole model (embed) needs.
  std::vector<at::Tensor> encoder_inputs;
  std::vector<int64_t> encoder_first;
  std::vector<at::Tensor> encoder_rows;  // per encoder: int64 [N_e * T_e] rows of B*S
  at::Tensor target_rows;                // int64 [N]: rows of B*S whose next token is a target
  at::Tensor targets;                    // int64 [N]: the target token of each such row
};

// `in` with every tensor on `device` (no copies when they are there already).
Inputs to_device(const Inputs& in, c10::Device device);
// A host tensor on `device`. To a GPU the copy is queued from pinned memory and the host does
// not wait for it (nor for the work queued before it); elsewhere it is Tensor::to.
at::Tensor to_device(const at::Tensor& t, c10::Device device);

// What of one module this rank builds: its pipeline stage's range and its TP/CP groups.
struct ModuleHosting {
  bool hosted = true;
  StageRange range;
  // The LLM under virtual pipeline stages: every chunk this rank builds, in block order (then
  // `range` is unused); empty = `range` alone.
  std::vector<StageRange> chunks;
  Shard shard;
};
// Per encoder (its projector lives on the encoder's last stage) and for the LLM. An empty
// `encoders` hosts every encoder whole.
struct Hosting {
  std::vector<ModuleHosting> encoders;
  ModuleHosting llm;
  c10::Device device = c10::kCPU;  // where the parameters live
  // What frozen modules' cast parameters (ParamUse::kCast) are held in: the compute dtype holds
  // them as forward passes use them (no fp32 masters, no casts); fp32 (default) as trained ones.
  at::ScalarType frozen_dtype = at::kFloat;
  // An evaluation copy: every module held as a frozen one (its cast parameters in
  // frozen_dtype, nothing trainable), and no values drawn: the caller copies them all in.
  bool inference = false;
};

class MultimodalModel {
 public:
  // Builds this rank's part of the model (default: all of it), every parameter initialised
  // from (`seed`, its name) — the same values whichever layout builds it.
  explicit MultimodalModel(const ModelSpec& spec, uint64_t seed = 0, Hosting hosting = {});

  const ModelSpec& spec() const { return spec_; }
  const NamedTensors& parameters() const { return params_.all(); }
  const ParamSet& param_set() const { return params_; }
  // Module a parameter belongs to: "llm", "<encoder>" or "<encoder>.projector".
  static std::string module_of(const std::string& param_name);
  // Sets requires_grad on every parameter of `module` (frozen = false); unused parameters never
  // train. A module held in Hosting::frozen_dtype other than fp32 cannot be made trainable.
  void set_trainable(const std::string& module, bool trainable);
  // An encoder block past its feature_layer: built (checkpoints hold it, exports write it back)
  // but never run, so it gets no gradient, no optimizer state and no weight decay.
  bool unused(const std::string& param_name) const;

  // Modules this rank built (null when not hosted / not on this stage).
  const Encoder* encoder(size_t e) const { return encoders_[e].get(); }
  const Projector* projector(size_t e) const;
  bool hosts_llm() const { return hosting_.llm.hosted; }
  const Hosting& hosting() const { return hosting_; }

  // Token embeddings [B, S, hidden] with features[e] ([N_e * T_e, hidden] or undefined when
  // N_e = 0) copied into the rows encoder_rows[e] of B*S (first LLM stage).
  at::Tensor embed_with(const at::Tensor& tokens, const std::vector<at::Tensor>& features,
                        const std::vector<at::Tensor>& encoder_rows) const;
  // Embeddings [B, S, hidden] with encoder features scattered into placeholder rows (a model
  // built whole on one rank).
  at::Tensor embed(const Inputs& in) const;
  // Final hidden states of the LLM for embeddings x.
  at::Tensor hidden(const at::Tensor& x, const Inputs& in) const;
  // Σ cross-entropy over the targets (fp32 scalar); divide by the global target count.
  at::Tensor loss_sum(const Inputs& in) const;
  const Llm& llm() const { return llm_; }

 private:
  ModelSpec spec_;
  Hosting hosting_;
  ParamSet params_;
  std::vector<std::unique_ptr<Encoder>> encoders_;
  std::vector<Projector> projectors_;
  std::vector<bool> has_projector_;
  Llm llm_;
};

}  // namespace weft::model
