// Hugging Face checkpoints in and out, with no conversion step. A checkpoint is a directory
// holding config.json (read by core/hf_config.h) and model.safetensors, or shards listed in
// model.safetensors.index.json. Tensors are read one at a time from memory-mapped files, in
// fp32 whatever dtype they were stored in (bf16, fp16, fp32).
//
// Name maps (weft name <- Hugging Face name; weft fuses Q/K/V and gate/up):
//   LLM (Llama, Mistral, Qwen2, Mixtral):  llm.embedding <- model.embed_tokens.weight,
//     llm.layers.i.attn.qkv.{weight,bias} <- cat(self_attn.{q,k,v}_proj), .out <- o_proj,
//     norm1 <- input_layernorm, norm2 <- post_attention_layernorm,
//     mlp.gate_up <- cat(mlp.gate_proj, mlp.up_proj), mlp.down <- down_proj,
//     llm.final_norm <- model.norm, llm.head <- lm_head (untied).
//   Mixtral (an MoE LLM, every block): layers.i.moe.router <- block_sparse_moe.gate,
//     moe.experts.j.gate_up <- cat(block_sparse_moe.experts.j.w1, .w3), .down <- .w2; or, in
//     transformers 5's stacked layout, router <- mlp.gate, gate_up <- mlp.experts.gate_up_proj[j],
//     down <- mlp.experts.down_proj[j] (import only; export writes the per-expert layout). Each
//     rank reads only the experts it holds (expert parallelism), one expert's rows of a stacked
//     tensor at a time.
//   CLIP / SigLIP vision: patch <- embeddings.patch_embedding, class <- class_embedding,
//     position <- position_embedding, pre_ln <- pre_layrnorm, layers.i.{ln1,ln2} <-
//     layer_norm{1,2}, attn.qkv <- cat(self_attn.{q,k,v}_proj), attn.out <- out_proj, mlp.fc{1,2}.
//     post_layernorm and SigLIP's pooling head are not used by LLaVA-style features: ignored.
//   Whisper encoder: conv1, conv2, layers.i.ln1 <- self_attn_layer_norm, ln2 <-
//     final_layer_norm, attn.qkv <- cat(q,k,v) (K has no bias in Whisper: zeros, which cannot
//     change attention), final_ln <- layer_norm; embed_positions must equal the sinusoids.
//   LLaVA projector: <enc>.projector.fc{1,2} <- multi_modal_projector.linear_{1,2}.
// Prefixes are found from the file: a bare model, a *ForCausalLM / *VisionModel, or a LLaVA
// checkpoint (old "language_model.model." / "vision_tower." or new "model.language_model." ...).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "weft/core/spec.h"
#include "weft/io/checkpoint.h"

namespace weft::io {

class SafetensorsReader;

// The tensors of a checkpoint directory (single file or index.json shards), opened and
// validated up front. Thread-safe reads.
class HfCheckpoint {
 public:
  explicit HfCheckpoint(const std::string& dir);
  ~HfCheckpoint();
  const std::string& dir() const { return dir_; }
  bool contains(const std::string& name) const { return where_.count(name) > 0; }
  std::vector<int64_t> shape(const std::string& name) const;
  at::Tensor read(const std::string& name) const;  // fp32
  // Entry `row` along dim 0 of tensor `name` (one expert of a stacked tensor), fp32; reads only
  // its bytes.
  at::Tensor read_row(const std::string& name, int64_t row) const;
  // Entries [begin, begin + count) along dim 0 of tensor `name`, fp32; reads only their bytes.
  at::Tensor read_rows(const std::string& name, int64_t begin, int64_t count) const;
  std::vector<std::string> names() const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, size_t> where_;  // tensor -> file
};

// Initial weights for the modules of `spec` that name a checkpoint (model.llm.hf,
// model.<encoder>.hf; a LLaVA checkpoint named by an encoder also provides its projector).
// Construction opens every checkpoint and checks that each mapped tensor exists with the shape
// the model needs — before any weight is read — so a wrong checkpoint fails at once, naming the
// file and tensor. full() then reads one parameter at its full (unsharded) shape.
class HfWeights {
 public:
  explicit HfWeights(const ModelSpec& spec);
  ~HfWeights();
  // True if a checkpoint provides weft parameter `name`.
  bool provides(const std::string& name) const { return rules_.count(name) > 0; }
  at::Tensor full(const std::string& name) const;  // fp32; Error if !provides(name)
  // `split`'s shard of parameter `name` (fp32), reading only its rows, where the shard is rows of
  // the checkpoint's tensors (a split along dim 0 of a tensor stored along dim 0: vocabulary-
  // and column-parallel weights, a fused QKV's or gate/up's parts); undefined where it is not
  // (take it from full()).
  at::Tensor shard(const std::string& name, const ShardSplit& split) const;
  // One line per checkpoint: what it provides and which of its tensors weft does not use.
  std::vector<std::string> summary() const;

 private:
  struct Rule;
  std::map<std::string, std::shared_ptr<HfCheckpoint>> checkpoints_;  // by dir
  std::map<std::string, std::unique_ptr<Rule>> rules_;                // by weft name
  std::vector<std::string> summary_;
};

// Writes `full` (every weft parameter of `spec` at full shape, fp32) as Hugging Face
// checkpoints under out_dir: llm/ (LlamaForCausalLM, Qwen2ForCausalLM with qkv_bias, or
// MixtralForCausalLM for an MoE LLM; an MoE that Mixtral cannot express is an Error before
// anything is written, see core/hf_config.h) and one directory per encoder (CLIPVisionModel /
// SiglipVisionModel / WhisperModel's encoder) that also holds the encoder's projector as
// LLaVA's multi_modal_projector.* (linear_1/linear_2 for mlp; "linear" for a linear
// projector), so the directory loads back with its projector. Each gets config.json and
// model.safetensors, or shards of at most `shard_bytes` with model.safetensors.index.json.
// `dtype`: kFloat, kBFloat16 or kHalf. Returns the directories.
std::vector<std::string> export_hf(const ModelSpec& spec,
                                   const std::map<std::string, at::Tensor>& full,
                                   const std::string& out_dir, at::ScalarType dtype = at::kFloat,
                                   int64_t shard_bytes = int64_t{4} << 30);

// Writes `tensors` as model.safetensors, or as model-0000k-of-0000n.safetensors shards plus
// model.safetensors.index.json when they exceed `shard_bytes`, into `dir` (created).
void save_hf_tensors(const std::string& dir,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     int64_t shard_bytes);

}  // namespace weft::io
