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
  std::vector<at::Tensor> encoder_inputs;  // per encoder: [N_e, ...] or undefined when N_e = 0
  std::vector<at::Tensor> encoder_rows;    // per encoder: int64 [N_e * T_e] rows of B*S
  at::Tensor target_rows;                  // int64 [N]: rows of B*S whose next token is a target
  at::Tensor targets;                      // int64 [N]: the target token of each such row
};

class MultimodalModel {
 public:
  // Builds and initialises every parameter from the current torch generator state.
  explicit MultimodalModel(const ModelSpec& spec);
  // Same, from a private generator seeded with `seed` (thread-independent; what runs use).
  MultimodalModel(const ModelSpec& spec, uint64_t seed);

  const ModelSpec& spec() const { return spec_; }
  const NamedTensors& parameters() const { return params_.all(); }
  // Module a parameter belongs to: "llm", "<encoder>" or "<encoder>.projector".
  static std::string module_of(const std::string& param_name);
  // Sets requires_grad on every parameter of `module` (frozen = false).
  void set_trainable(const std::string& module, bool trainable);

  // Embeddings [B, S, hidden] with encoder features scattered into placeholder rows.
  at::Tensor embed(const Inputs& in) const;
  // Final hidden states of the LLM for embeddings x.
  at::Tensor hidden(const at::Tensor& x, const Inputs& in) const;
  // Σ cross-entropy over the targets (fp32 scalar); divide by the global target count.
  at::Tensor loss_sum(const Inputs& in) const;
  const Llm& llm() const { return llm_; }

 private:
  void build();

  ModelSpec spec_;
  ParamSet params_;
  std::vector<std::unique_ptr<Encoder>> encoders_;
  std::vector<Projector> projectors_;
  Llm llm_;
};

}  // namespace weft::model
