// Spec: the parsed, validated configuration of a run. Everything downstream trusts it; all
// checks happen in parse_spec (core/config.h). Model shape (what a checkpoint fixes) lives in
// ModelSpec; what a run chooses lives in TrainSpec / DataSpec / OutputSpec / ParallelSpec.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace weft {

// Llama 3.1-style RoPE frequency scaling (Hugging Face rope_scaling {"rope_type": "llama3"}).
struct RopeScaling {
  bool llama3 = false;  // false: plain RoPE
  double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

// Mixture-of-experts feed-forward (Mixtral / Qwen-MoE / DeepSeek style) in place of the SwiGLU
// MLP of every `every`-th LLM block (block i is MoE iff i % every == 0, Megatron's
// moe_layer_freq). A router scores `experts` SwiGLU experts per token (softmax or sigmoid
// gating, in fp32), the token goes to its top_k (weights renormalised over the top k when
// norm_topk), and an optional always-on shared expert is added. Two auxiliary losses keep the
// router healthy, both per sequence (row) and averaged over the global batch's rows, so their
// value and gradients do not depend on the parallel layout:
//   load balancing  aux_loss · E · Σ_i f_i · P_i   (f_i: share of the row's routed slots that
//                   chose expert i, constant; P_i: mean normalised router score of expert i)
//   router z-loss   z_loss · mean_t (logsumexp_i logit_t,i)²
// capacity_factor > 0 drops tokens: expert i keeps at most ceil(cf · T · top_k / E) of a row's
// T tokens, first choices before second choices and earlier positions first; 0 = dropless.
struct MoeSpec {
  int64_t experts = 0;  // 0 = a dense model
  int64_t top_k = 2;
  int64_t ffn = 0;         // expert SwiGLU inner width; 0 = model.llm.ffn
  int64_t every = 1;       // MoE in blocks 0, every, 2·every, ...
  bool sigmoid = false;    // gating: softmax over experts (false) or per-expert sigmoid (true)
  bool norm_topk = true;   // renormalise the top-k weights to sum to 1
  int64_t shared_ffn = 0;  // width of the shared expert; 0 = none
  double aux_loss = 0.01;
  double z_loss = 0.001;
  double capacity_factor = 0;  // 0 = dropless

  bool enabled() const { return experts > 0; }
  bool is_moe_layer(int64_t i) const { return experts > 0 && i % every == 0; }
};

// How many of the first blocks of each chunk of virtual pipeline stage `stage` (chunk k of
// pipeline rank s is stage k·pp + s) a module recomputes in backward, under its `recompute` and
// `recompute_blocks` (LlmSpec, EncoderSpec): every block is kAllBlocks. A list of one count per
// pipeline stage (validated against pp by make_plan) is read at stage mod its length.
inline constexpr int64_t kAllBlocks = std::numeric_limits<int64_t>::max();
inline int64_t recomputed_blocks(bool recompute, const std::vector<int64_t>& recompute_blocks,
                                 int64_t stage) {
  if (!recompute) return 0;
  if (recompute_blocks.empty()) return kAllBlocks;
  return recompute_blocks[static_cast<size_t>(stage) % recompute_blocks.size()];
}
// A TOML list of integers, "[1, 2, 3]"; `sep` between the values (", " in a file, "," in one
// shell word).
inline std::string format_list(const std::vector<int64_t>& values, const char* sep = ", ") {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? sep : "") + std::to_string(values[i]);
  return out + "]";
}
// recompute_blocks as a config writes it: 0 (every block), one count, or a list (format_list).
inline std::string recompute_blocks_text(const std::vector<int64_t>& blocks,
                                         const char* sep = ", ") {
  if (blocks.size() <= 1) return std::to_string(blocks.empty() ? 0 : blocks[0]);
  return format_list(blocks, sep);
}
// Whether block `i` of such a chunk (0 = the chunk's first) is recomputed.
inline bool recomputes_block(bool recompute, const std::vector<int64_t>& recompute_blocks,
                             int64_t stage, int64_t i) {
  return i < recomputed_blocks(recompute, recompute_blocks, stage);
}

// Decoder LLM, Llama-style (Llama, Mistral, Qwen2). vocab = 0 means "take it from the tokenizer"
// (built-in dataset). `hf`: a Hugging Face checkpoint directory (config.json + safetensors) the
// shape is read from and the weights are initialised from; "" = random init.
struct LlmSpec {
  int64_t vocab = 0;
  int64_t hidden = 128;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t ffn = 384;  // SwiGLU inner width
  int64_t max_seq = 256;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = true;
  bool qkv_bias = false;  // Qwen2: biases on the Q, K and V projections
  RopeScaling rope_scaling;
  MoeSpec moe;  // [model.llm.moe]; experts = 0: every block has the dense SwiGLU MLP
  bool frozen = false;
  // Keep only each block's input in forward and recompute the block in backward (less
  // activation memory, about one more forward of compute).
  bool recompute = false;
  // With recompute, which blocks (recomputes_block): none set, every block; one count, the first
  // that many blocks of each pipeline chunk (Megatron-LM's --recompute-method block); one count
  // per pipeline stage, that stage's chunks' first blocks (0: none), so the early stages of 1F1B,
  // which hold the most microbatches, can recompute more than the late ones.
  std::vector<int64_t> recompute_blocks;
  // Attention in blocks over the tiles of keys they see (model/chunked_attention.h): queries of
  // one pattern in every row make one block, others blocks of at most this many queries over
  // tiles of as many keys; 0 = one attention over all keys. From LibTorch 2.3 on; LibTorch
  // 1.13's blocked attention skips hidden blocks on its own.
  int64_t attention_chunk = 512;
  std::string hf;

  int64_t head_dim() const { return hidden / heads; }
  int64_t expert_ffn() const { return moe.ffn > 0 ? moe.ffn : ffn; }
};

enum class EncoderKind { kVit, kWhisper };
// MLP activation of encoder blocks: exact GELU (Whisper), x*sigmoid(1.702x) (OpenAI CLIP),
// tanh-approximated GELU (SigLIP).
enum class Activation { kGelu, kQuickGelu, kGeluTanh };
enum class ProjectorKind { kLinear, kMlp };

struct ProjectorSpec {
  ProjectorKind kind = ProjectorKind::kMlp;
  bool frozen = false;
};

// One modality encoder. Fields that do not apply to its kind keep their defaults and are
// rejected if set in the config (e.g. `patch` on a whisper encoder).
struct EncoderSpec {
  std::string name;  // table name under [model], e.g. "vision", "audio"
  EncoderKind kind = EncoderKind::kVit;
  int64_t hidden = 128;
  int64_t layers = 3;
  int64_t heads = 4;
  int64_t ffn = 512;           // GELU MLP inner width
  int64_t feature_layer = -1;  // which block's output feeds the projector; -2 = LLaVA-style
  double norm_eps = 1e-5;
  Activation act = Activation::kGelu;
  bool frozen = false;
  // Keep only each block's input in forward and recompute the block in backward (less
  // activation memory, about one more forward of compute).
  bool recompute = false;
  // With recompute, which blocks (recomputes_block): none set, every block; one count, the first
  // that many blocks of each pipeline chunk (Megatron-LM's --recompute-method block); one count
  // per pipeline stage, that stage's chunks' first blocks (0: none), so the early stages of 1F1B,
  // which hold the most microbatches, can recompute more than the late ones.
  std::vector<int64_t> recompute_blocks;
  std::string hf;  // Hugging Face checkpoint to read the shape and initial weights from
  // vit
  bool class_token = false;  // CLIP: a learned [CLS] token first (dropped from the features)
  bool pre_norm = true;      // LayerNorm after the embeddings (CLIP's pre_layrnorm; not SigLIP)
  bool patch_bias = true;    // bias in the patch embedding (SigLIP; not CLIP)
  int64_t image_size = 64;
  int64_t channels = 3;
  int64_t patch = 16;
  int64_t stem_channels = 0;  // >0: a conv stem (stem_layers 3x3 stride-2 convs) before patches
  int64_t stem_layers = 1;
  // whisper
  int64_t mels = 40;
  int64_t frames = 64;  // log-mel frames per clip; tokens = frames / 2

  ProjectorSpec projector;

  // Number of output features (= placeholder tokens) per item.
  int64_t tokens_per_item() const {
    return kind == EncoderKind::kVit ? (image_size / patch) * (image_size / patch) : frames / 2;
  }
  // Tokens the blocks see per item: the features plus a [CLS] token (dropped after the last).
  int64_t block_tokens() const { return tokens_per_item() + (class_token ? 1 : 0); }
  // Whether sequence parallelism over `ranks` (cp * tp) can run: it splits every item's block
  // tokens evenly (plan.cpp's check, the search's filter).
  bool splits_evenly(int64_t ranks) const { return block_tokens() % ranks == 0; }
  // Number of blocks actually run (feature_layer resolved against layers).
  int64_t layers_used() const {
    return feature_layer < 0 ? layers + 1 + feature_layer : feature_layer;
  }
};

struct ModelSpec {
  LlmSpec llm;
  std::vector<EncoderSpec> encoders;  // in config order
};

struct DataSpec {
  // "shapes" (built-in procedural), "llava" (files on disk) or "synthetic" (random, for benchmarks)
  std::string kind = "shapes";  // data/shapes.h, data/llava.h, data/synthetic.h
  // Whether media is read from files, and can therefore be bad (the other kinds generate it):
  // then the ranks of a multi-rank job agree on each step's bad records (train/trainer.cpp), a
  // small all-reduce the simulator charges too.
  bool media_from_files() const { return kind == "llava"; }
  uint64_t seed = 1234;  // train stream seed; eval uses a disjoint stream
  int64_t eval_samples = 256;
  double noise = 0.08;   // pixel noise amplitude
  bool packing = false;  // pack several samples per row (document-isolated) instead of padding
  // How a global batch goes to data-parallel replicas and microbatches: "balanced" (encoder and
  // LLM work evened out, microbatches ordered for 1F1B; plan/balance.h) or "in_order".
  std::string balance = "balanced";
  // kind = "llava" (data/llava.h). Paths are absolute after parsing (relative ones are taken
  // from the config file's directory).
  std::string path;                     // JSON array or JSONL file of LLaVA-style records
  std::string root;                     // media paths are relative to it ("" = path's directory)
  std::string tokenizer;                // tokenizer.json / .model / directory ("" = model.llm.hf)
  std::string chat_template = "llava";  // llava, llama2, llama3, chatml or plain (data/chat.h)
  std::string image_processor;          // "clip" or "siglip" ("" = from the vit encoder's kind)
  bool pad_to_square = false;           // LLaVA-1.5's image_aspect_ratio = "pad"
  std::string on_error = "fail";        // "skip": a corrupt or missing record is replaced, counted
  int64_t workers = 2;                  // threads decoding media
  int64_t prefetch = 2;                 // global batches prepared ahead of the step
  // kind = "synthetic" (data/synthetic.h).
  int64_t seq_len = 0;           // tokens per sample, placeholders included; 0 = min(256, max_seq)
  int64_t images = 1;            // items per sample for every encoder of the model; 0 = text only
  double target_fraction = 1.0;  // fraction of the text tokens that are loss targets, in (0, 1]
};

enum class Precision { kBf16, kFp32 };
// What a step with a NaN/Inf loss or gradient does: stop the run naming the step and module, or
// skip the update (no optimizer step), count it, and go on.
enum class NonFinite { kStop, kSkip };
// Where parameters, activations and optimizer state live. kCuda: rank r uses GPU LOCAL_RANK (needs
// a build against CUDA LibTorch, WEFT_CUDA); collectives of device tensors go over NCCL.
enum class Device { kCpu, kCuda };
// Where evaluation's captions are generated when the layout spreads the model: on a copy
// gathered onto rank 0 (the KV cache, one token per step), or through the training layout
// itself (every rank its part, nothing gathered; the prompts once through the layout, then one
// token per step over each LLM rank's own KV cache).
enum class EvalGeneration { kGather, kLayout };

struct TrainSpec {
  int64_t steps = 600;
  int64_t batch = 64;  // global batch (samples per optimizer step)
  int64_t microbatches = 1;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup = 50;
  double weight_decay = 0.01;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // 0 disables
  Precision precision = Precision::kBf16;
  NonFinite nonfinite = NonFinite::kStop;
  uint64_t seed = 0;  // parameter init seed
  int64_t log_every = 10;
  int64_t eval_every = 0;  // 0 = only at the end
  // Evaluations generate captions (caption accuracy) besides the validation loss. Generation
  // runs on rank 0 with the whole model where it is whole there; where the layout spreads it,
  // as eval_generation says. false: the loss alone, computed in the layout.
  bool eval_captions = true;
  EvalGeneration eval_generation = EvalGeneration::kGather;
  int64_t checkpoint_every = 0;  // 0 = only at the end
  Device device = Device::kCpu;
  // Intra-op threads; 0 = the process's cores shared among this machine's ranks (launch.h).
  int64_t threads = 0;
  int64_t zero_stage = 0;           // 1 = ZeRO-1: optimizer state sharded over data parallel
  bool overlap_grad_reduce = true;  // DP: all-reduce gradient buckets during the last backward
  // ZeRO-1: the all-gather of the stepped parameters runs on into the next step, each bucket
  // waited for where forward first reads it (Megatron's overlap_param_gather); false waits for
  // all of it after the optimizer step.
  bool overlap_param_gather = true;
  // TP / SP: a column-parallel linear's backward runs its collectives during its matmuls
  // (dist::column_linear); false waits for each where it is issued (for measuring).
  bool overlap_tp_comm = true;
  double grad_bucket_mb = 4.0;  // DP: gradient bucket size (MiB of fp32)
  // Each parameter used with gradients cast to the compute dtype once per step, shared by every
  // microbatch and pipeline op (model::CastOnce); false casts it at every use (for measuring).
  bool cast_once = true;
  // Frozen modules' weights held in fp32 like trained ones; false (default) holds those that
  // forward passes cast (all but norms and routers) in the compute dtype, as they are used:
  // half the memory, no casts, the same results (model::ParamSet::hold_cast_params_in).
  bool frozen_fp32 = false;
  // Ranks of one host run their blocking CPU collectives (TP / SP / CP activations, the loss
  // and gradient-norm sums) through shared memory instead of Gloo's TCP loopback
  // (dist/comm.h); false keeps them on Gloo (for measuring).
  bool shared_memory_collectives = true;
  // With shared_memory_collectives, ranks of one host also send their point-to-point messages
  // (pipeline activations and gradients, encoder outputs to the LLM, generation in the layout)
  // through shared-memory rings (dist/messages.h); false keeps them on Gloo (for measuring).
  bool shared_memory_messages = true;
};

struct OutputSpec {
  std::string dir;  // empty = runs/<timestamp>
  int64_t keep_checkpoints = 2;
  // Step (1-based) whose timeline is written to trace.json (Chrome / Perfetto); 0 = none.
  int64_t trace_step = 3;
};

// Per-module parallel layout: the module's ranks form a grid [tp, cp, dp, pp], tp fastest
// (plan/plan.h). Shapes are checked against the model in plan::make_plan; single-process is
// every size 1.
//
// ep (expert parallelism, an MoE LLM only): the experts of each MoE block are sharded over ep
// ranks that hold different tokens, so the layout's size does not change. etp (expert tensor
// parallelism) is 1 or tp (0 = tp): with etp = tp the expert weights are split over tp like the
// dense MLP and the ep ranks are cp·dp ranks of the same tp rank (ep divides cp·dp); with etp = 1
// and tp > 1 every expert is whole, each tp rank routes 1/tp of the tokens, and the ep ranks
// range over tp·cp·dp (ep divides it). Expert gradients are summed over the expert-data-parallel
// ranks only (those holding the same experts). plan/plan.h ModulePlan::expert_groups.
//
// sp (sequence parallelism, Megatron-LM's, the LLM only; acts when tp > 1): between the
// tensor-parallel regions (norms, residual adds, pipeline messages) each tp rank holds 1/tp of
// the sequence instead of all of it; the all-reduce after each row-parallel linear becomes a
// reduce-scatter and the input of each column-parallel linear an all-gather (the same bytes).
//
// vp (virtual pipeline stages, the LLM only; Megatron-LM's interleaved 1F1B): each of the pp
// pipeline ranks holds vp chunks of blocks, virtual stages s, s + pp, ..., s + (vp - 1)·pp of
// pp·vp; a microbatch passes every rank vp times, so the fill and drain bubble shrinks vp-fold
// for vp times the pipeline messages. Needs pp > 1; any train.microbatches (the bubble is
// (pp - 1) / vp microbatches' time when it is at least pp).
struct LayoutSpec {
  int64_t dp = 1, tp = 1, pp = 1, cp = 1, ep = 1, etp = 0;
  bool sp = false;
  int64_t vp = 1;
  // First layer of each (virtual) pipeline stage after the first (pp·vp - 1 entries); empty =
  // chosen by the frozen-aware partitioner (plan/partition.h).
  std::vector<int64_t> stages;
};

struct ParallelSpec {
  std::string placement = "colocated";  // or "separate" (each module on its own ranks)
  // How the LLM sequence is split over CP ranks: "balanced" (weft's: exact mask work, best of
  // LPT/zigzag/MULTIFIT plus improvement), "zigzag", "contiguous" or "lpt".
  std::string cp_split = "balanced";
  std::map<std::string, LayoutSpec> modules;  // "llm", encoder names
};

struct Spec {
  std::string source;  // file the config came from (for messages)
  ModelSpec model;
  DataSpec data;
  TrainSpec train;
  OutputSpec output;
  ParallelSpec parallel;

  const EncoderSpec* encoder(const std::string& name) const {
    for (const auto& e : model.encoders)
      if (e.name == name) return &e;
    return nullptr;
  }
};

const char* to_string(EncoderKind k);
const char* to_string(Activation a);
const char* to_string(ProjectorKind k);
const char* to_string(Precision p);
const char* to_string(NonFinite n);
const char* to_string(Device d);
const char* to_string(EvalGeneration g);

}  // namespace weft
