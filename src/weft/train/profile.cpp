#include "weft/train/profile.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "weft/core/error.h"
#include "weft/core/progress.h"
#include "weft/data/dataset.h"
#include "weft/dist/comm.h"
#include "weft/dist/launch.h"
#include "weft/model/encoder.h"
#include "weft/model/fused.h"
#include "weft/model/layers.h"
#include "weft/model/llm.h"
#include "weft/model/mask.h"
#include "weft/model/recompute.h"
#include "weft/plan/plan.h"
#include "weft/plan/profile.h"
#include "weft/train/data_shape.h"
#include "weft/train/live_bytes.h"
#include "weft/train/optimizer.h"
#include "weft/train/trainer.h"

using json = nlohmann::ordered_json;

namespace weft::train {

namespace {

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  return "unknown CPU";
}

// Bytes of the CPU's largest cache (sysfs), 32 MiB when the system does not say.
int64_t last_level_cache_bytes() {
  int64_t best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    std::string size;
    if (!(in >> size) || size.empty()) continue;
    int64_t v = std::atoll(size.c_str());
    const char unit = size.back();
    if (unit == 'K') v <<= 10;
    if (unit == 'M') v <<= 20;
    best = std::max(best, v);
  }
  return best > 0 ? best : int64_t{32} << 20;
}

// One microbatch shape: `units` rows of `seq` tokens (LLM), or `units` items (seq = 1).
struct Shape {
  int64_t units = 1, seq = 1;
};

// A layer's forward on the inputs of one shape: `leaves` are the inputs that carry an input
// gradient (activations from the previous layer, encoder features).
struct Prepared {
  std::function<at::Tensor()> forward;
  std::vector<at::Tensor> leaves;
  std::function<void()> release;  // frees what a forward keeps besides its output (or empty)
};

// A layer to measure: its parameters, whether its input gets a gradient, whether it has a
// backward at all (the LLM's per-stage work has none), and how to set up a shape.
struct Layer {
  std::string name, part;
  model::NamedTensors params;  // its weight gradients land on these
  model::NamedTensors own;     // the parameters it holds (bytes, optimizer); empty = params
  bool input_grad = true, backward = true;
  std::vector<Shape> shapes;  // the first is the profiled shape
  std::function<Prepared(const Shape&)> prepare;
};

struct Sample {
  double forward = 0, input_grad = 0, weight_grad = 0, activation = 0;
};

// Training steps of other copies of the model on background threads, one per other core (at
// `threads` intra-op threads a rank): the load the other ranks of a multi-rank run put on the
// machine (shared caches and memory bandwidth) while a layer is measured. Exceptions in a
// background step are ignored (its numbers do not matter, only its work).
class BackgroundLoad {
 public:
  BackgroundLoad(const Spec& spec, int64_t copies, int64_t steps) {
    Spec s = spec;
    s.train.nonfinite = NonFinite::kSkip;
    for (int64_t i = 0; i < copies; ++i) {
      TrainerOptions to;
      to.progress = false;
      to.eval = false;
      trainers_.push_back(std::make_unique<Trainer>(s, plan::make_plan(s, 1), to));
      batches_.emplace_back();
      for (int64_t k = 0; k < steps; ++k)
        batches_.back().push_back(trainers_.back()->prepare_step(k));
    }
    for (size_t i = 0; i < trainers_.size(); ++i) threads_.emplace_back([this, i] { loop(i); });
  }
  ~BackgroundLoad() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  bool empty() const { return trainers_.empty(); }
  // On: the threads train; off: returns once every thread is idle.
  void run(bool on) {
    std::unique_lock<std::mutex> lock(mu_);
    on_ = on;
    cv_.notify_all();
    if (!on) cv_.wait(lock, [&] { return busy_ == 0; });
  }

 private:
  void loop(size_t i) {
    std::unique_lock<std::mutex> lock(mu_);
    for (int64_t k = 0;; ++k) {
      cv_.wait(lock, [&] { return on_ || quit_; });
      if (quit_) return;
      ++busy_;
      lock.unlock();
      try {
        const std::vector<StepBatch>& b = batches_[i];
        trainers_[i]->train_step(b[static_cast<size_t>(k) % b.size()], k);
      } catch (const std::exception&) {
      }
      lock.lock();
      --busy_;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool on_ = false, quit_ = false;
  int busy_ = 0;
  std::vector<std::unique_ptr<Trainer>> trainers_;
  std::vector<std::vector<StepBatch>> batches_;
  std::vector<std::thread> threads_;
};

class Profiler {
 public:
  // evict_bytes: streamed through before every timed run (see evict).
  Profiler(const ProfileOptions& o, at::ScalarType compute, BackgroundLoad* load,
           int64_t evict_bytes)
      : o_(o), compute_(compute), load_(load), evict_(static_cast<size_t>(evict_bytes)) {}

  // In a training step a layer does not find its weights and inputs where its previous run left
  // them: the rest of the step (other layers, the optimizer's pass over every parameter's
  // weight, gradient and moments) went through the caches in between. Timed back to back, a
  // small layer ran up to a third faster than in a step. So every timed run starts after
  // streaming through as many bytes as that pass (16 per parameter of the model, at most twice
  // the largest cache).
  void evict() const {
    volatile char* p = evict_.data();
    for (size_t i = 0; i < evict_.size(); i += 64) p[i] = static_cast<char>(p[i] + 1);
  }

  Sample measure(const Layer& layer, const Shape& shape) const {
    const LiveBytes meter(layer.params.empty() ? c10::Device(c10::kCPU)
                                               : layer.params.front().second.device());
    const Prepared p = layer.prepare(shape);
    const auto set_params = [&](bool on) {
      for (const auto& [name, t] : layer.params) t.set_requires_grad(on);
    };
    const auto clear = [&] {
      for (const auto& [name, t] : layer.params) t.mutable_grad().reset();
      for (const at::Tensor& t : p.leaves) t.mutable_grad().reset();
    };
    std::vector<double> fwd, full, input, act;
    for (int64_t i = 0; i < o_.warmup + o_.reps; ++i) {
      const bool timed = i >= o_.warmup;
      // Parameters and inputs requiring grad: the forward a trainable layer runs, then its full
      // backward.
      set_params(layer.backward);
      for (const at::Tensor& t : p.leaves) t.set_requires_grad(layer.backward && layer.input_grad);
      const int64_t before = meter.live();
      evict();
      const double t0 = now_seconds();
      at::Tensor y = p.forward();
      const double t1 = now_seconds();
      if (timed) fwd.push_back(t1 - t0), act.push_back(static_cast<double>(meter.live() - before));
      if (layer.backward) {
        const at::Tensor g = y.dim() == 0 ? at::Tensor() : torch::ones_like(y);
        evict();
        const double t2 = now_seconds();
        y.backward(g);
        if (timed) full.push_back(now_seconds() - t2);
      }
      y.reset();
      if (p.release) p.release();
      clear();
      if (!layer.backward || !layer.input_grad) continue;
      // Input gradients only.
      set_params(false);
      y = p.forward();
      const at::Tensor g = y.dim() == 0 ? at::Tensor() : torch::ones_like(y);
      evict();
      const double t3 = now_seconds();
      y.backward(g);
      if (timed) input.push_back(now_seconds() - t3);
      y.reset();
      clear();
    }
    set_params(true);
    Sample s;
    s.forward = median(fwd);
    s.activation = median(act);
    if (layer.backward) {
      s.input_grad = layer.input_grad ? median(input) : 0;
      s.weight_grad = std::max(0.0, median(full) - s.input_grad);
    }
    return s;
  }

  // AdamW's step and the gradient norm's sum of squares over the parameters, per step.
  double optimizer_seconds(const model::NamedTensors& params, const TrainSpec& t) const {
    if (params.empty()) return 0;
    for (const auto& [name, p] : params) p.mutable_grad() = torch::randn_like(p) * 1e-3;
    AdamW opt(params, AdamWOptions{t.beta1, t.beta2, t.eps, t.weight_decay});
    std::vector<double> seconds;
    for (int64_t i = 0; i < o_.warmup + o_.reps; ++i) {
      const double t0 = now_seconds();
      double sq = 0;
      for (const auto& [name, p] : params) sq += model::sum_squares(p.grad());
      opt.step(1e-6, sq > 0 ? 1.0 : 0.0);
      if (i >= o_.warmup) seconds.push_back(now_seconds() - t0);
    }
    for (const auto& [name, p] : params) p.mutable_grad().reset();
    return median(seconds);
  }

  json layer_json(const Layer& layer, const TrainSpec& t) const {
    std::vector<plan::CostPoint> pts[4], shared_pts[3];
    json points = json::array();
    Sample main, main_shared;
    const bool shared = load_ && !load_->empty();
    for (size_t k = 0; k < layer.shapes.size(); ++k) {
      const Shape& sh = layer.shapes[k];
      const Sample s = measure(layer, sh);
      Sample c;
      if (shared) {  // again, with the other cores training
        load_->run(true);
        c = measure(layer, sh);
        load_->run(false);
      }
      if (k == 0) main = s, main_shared = c;
      const double u = static_cast<double>(sh.units), q = static_cast<double>(sh.seq);
      const double v[4] = {s.forward, s.input_grad, s.weight_grad, s.activation};
      for (int i = 0; i < 4; ++i) pts[i].push_back({u, q, v[i]});
      const double w[3] = {c.forward, c.input_grad, c.weight_grad};
      for (int i = 0; i < 3; ++i) shared_pts[i].push_back({u, q, w[i]});
      json point = {{"units", sh.units},
                    {"seq", sh.seq},
                    {"forward", s.forward},
                    {"input_grad", s.input_grad},
                    {"weight_grad", s.weight_grad},
                    {"activation_bytes", s.activation}};
      if (shared)
        point["shared"] = {
            {"forward", c.forward}, {"input_grad", c.input_grad}, {"weight_grad", c.weight_grad}};
      points.push_back(point);
    }
    const bool quadratic =
        layer.part == "block" || layer.part == "block_recompute" || layer.part == "stage";
    json fit;
    const char* names[4] = {"forward", "input_grad", "weight_grad", "activation_bytes"};
    for (int i = 0; i < 4; ++i) {
      // An LLM layer measured at one sequence length cannot separate S from S²: linear only.
      const plan::CostFit f = plan::fit_cost(pts[i], quadratic);
      fit[names[i]] = {f.fixed, f.linear, f.quadratic};
    }
    if (shared) {
      json fs;
      for (int i = 0; i < 3; ++i) {
        const plan::CostFit f = plan::fit_cost(shared_pts[i], quadratic);
        fs[names[i]] = {f.fixed, f.linear, f.quadratic};
      }
      fit["shared"] = fs;
    }
    const model::NamedTensors& own = layer.own.empty() ? layer.params : layer.own;
    double param_bytes = 0, params = 0;
    for (const auto& [name, p] : own) {
      params += static_cast<double>(p.numel());
      param_bytes += static_cast<double>(p.numel() * p.element_size());
    }
    json j;
    j["name"] = layer.name;
    j["part"] = layer.part;
    j["forward"] = main.forward;
    j["input_grad"] = main.input_grad;
    j["weight_grad"] = main.weight_grad;
    j["activation_bytes"] = main.activation;
    if (shared)
      j["shared"] = {{"forward", main_shared.forward},
                     {"input_grad", main_shared.input_grad},
                     {"weight_grad", main_shared.weight_grad}};
    j["param_bytes"] = param_bytes;
    j["params"] = params;
    j["tensors"] = own.size();
    j["optimizer"] = layer.backward ? optimizer_seconds(own, t) : 0.0;
    j["fit"] = fit;
    j["points"] = points;
    return j;
  }

  at::ScalarType compute() const { return compute_; }

 private:
  ProfileOptions o_;
  at::ScalarType compute_;
  BackgroundLoad* load_;  // null: measured alone only
  mutable std::vector<char> evict_;
};

// Parameters of `set` whose names start with one of `prefixes`.
model::NamedTensors params_of(const model::ParamSet& set, std::vector<std::string> prefixes) {
  model::NamedTensors out;
  for (const auto& [name, p] : set.all())
    for (const std::string& pre : prefixes)
      if (name.rfind(pre, 0) == 0) {
        out.emplace_back(name, p);
        break;
      }
  return out;
}

// Unit counts n, n/2, n/4, n/8 (distinct, >= 1): down to the microbatches of pipelined plans.
std::vector<int64_t> unit_counts(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d : {1, 2, 4, 8}) {
    const int64_t u = std::max<int64_t>(1, n / d);
    if (std::find(out.begin(), out.end(), u) == out.end()) out.push_back(u);
  }
  return out;
}

// Rows of a flat [B·S] index whose row b < n and column j < s, renumbered for [n·s]; `keep`
// gets their positions in `rows`.
at::Tensor crop_rows(const at::Tensor& rows, int64_t S, int64_t n, int64_t s, at::Tensor* keep) {
  const at::Tensor b = rows.div(S, "floor"), j = rows.remainder(S);
  const at::Tensor mask = b.lt(n).logical_and(j.lt(s));
  *keep = mask.nonzero().reshape({-1});
  return (b * s + j).index_select(0, *keep);
}

json llm_module(const Profiler& prof, const Spec& spec, const model::Inputs& in,
                const TrainSpec& t) {
  const LlmSpec& l = spec.model.llm;
  // Block 0, and for an MoE LLM a dense block too: block 1 when it is dense, else one of a
  // dense copy of the LLM (the same widths).
  const bool moe = l.moe.enabled();
  const bool dense_second = moe && l.layers > 1 && !l.moe.is_moe_layer(1);
  model::ParamSet set, dense_set;
  model::Llm llm, dense_llm;
  {
    model::InitSeedGuard seed(spec.train.seed);
    llm = model::Llm::make(model::Scope{&set, "llm", nullptr}, l,
                           model::StageRange{0, dense_second ? 2 : 1, true, true});
    if (moe && !dense_second) {
      LlmSpec dense = l;
      dense.moe = MoeSpec{};
      dense_llm = model::Llm::make(model::Scope{&dense_set, "llm", nullptr}, dense,
                                   model::StageRange{0, 1, false, false});
    }
  }
  const int64_t B = in.tokens.size(0), S = in.tokens.size(1), H = l.hidden;
  std::vector<Shape> shapes, full_seq;
  for (int64_t s : {S, std::max<int64_t>(1, S / 2)})
    for (int64_t n : unit_counts(B)) {
      if (s == S) full_seq.push_back({n, s});
      shapes.push_back({n, s});
    }
  const at::ScalarType dt = prof.compute();
  const auto randn = [&](std::vector<int64_t> shape) { return (torch::randn(shape) * 0.5).to(dt); };
  const auto cropped = [&](const at::Tensor& x, const Shape& sh) {
    return x.narrow(0, 0, sh.units).narrow(1, 0, sh.seq).contiguous();
  };

  std::vector<Layer> layers;
  Layer front;
  front.name = "llm.embed";
  front.part = "front";
  front.params = params_of(set, {"llm.embedding"});
  front.input_grad = !spec.model.encoders.empty();  // feature gradients to the encoders
  front.shapes = shapes;
  front.prepare = [&, H](const Shape& sh) {
    Prepared p;
    const at::Tensor tokens = cropped(in.tokens, sh);
    std::vector<at::Tensor> rows;
    for (const at::Tensor& r : in.encoder_rows) {
      at::Tensor keep;
      if (!r.defined() || r.numel() == 0) continue;
      rows.push_back(crop_rows(r, S, sh.units, sh.seq, &keep));
      p.leaves.push_back(randn({rows.back().numel(), H}));
    }
    const std::vector<at::Tensor> leaves = p.leaves;
    p.forward = [&llm, tokens, rows, leaves, H] {
      at::Tensor x = llm.embed(tokens);
      at::Tensor flat = x.reshape({-1, H});
      for (size_t e = 0; e < rows.size(); ++e)
        if (rows[e].numel() > 0) flat = flat.index_copy(0, rows[e], leaves[e].to(flat.dtype()));
      return flat.view(x.sizes());
    };
    return p;
  };
  layers.push_back(front);

  Layer stage;
  stage.name = "llm.stage";
  stage.part = "stage";
  stage.backward = false;
  stage.shapes = shapes;
  stage.prepare = [&](const Shape& sh) {
    Prepared p;
    const at::Tensor doc = cropped(in.doc, sh), item = cropped(in.item, sh);
    const at::Tensor pos = cropped(in.positions, sh);
    auto rope = std::make_shared<model::Rope>();  // kept, as the blocks' graph keeps it
    p.forward = [doc, item, pos, rope, &l] {
      torch::NoGradGuard no_grad;
      *rope = model::Rope::make(pos, l.head_dim(), l.rope_theta, l.rope_scaling);
      return model::visible_mask(doc, item);
    };
    p.release = [rope] { *rope = model::Rope{}; };
    return p;
  };
  layers.push_back(stage);

  // A block's layer: its forward on random inputs under the data's mask; an MoE block routes the
  // real tokens (padding excluded) and adds its auxiliary losses as training does.
  const auto block_layer = [&, H](std::string name, std::string part, const model::LlmBlock* b,
                                  model::NamedTensors params, bool recompute) {
    Layer layer;
    layer.name = std::move(name);
    layer.part = std::move(part);
    layer.params = std::move(params);
    layer.shapes = shapes;
    layer.prepare = [&, b, H, recompute](const Shape& sh) {
      Prepared p;
      const at::Tensor doc = cropped(in.doc, sh);
      const model::AttentionMask mask{model::visible_mask(doc, cropped(in.item, sh))};
      const model::Rope rope =
          model::Rope::make(cropped(in.positions, sh), l.head_dim(), l.rope_theta, l.rope_scaling);
      model::TokenInfo tokens;
      tokens.valid = doc.ge(0);
      tokens.aux_scale = 1.0 / static_cast<double>(sh.units);
      p.leaves.push_back(randn({sh.units, sh.seq, H}));
      const at::Tensor x = p.leaves[0];
      p.forward = [b, x, mask, rope, tokens, recompute] {
        if (!recompute) return (*b)(x, mask, rope, tokens);
        return model::recompute(
            [b, mask, rope, tokens](const at::Tensor& h, const std::vector<at::Tensor>& ps) {
              return model::with_params(*b, ps)(h, mask, rope, tokens);
            },
            x, model::block_params(*b));
      };
      return p;
    };
    return layer;
  };
  // Each block as it runs plain and recomputed (whatever the config recomputes: a profile prices
  // any setting).
  const auto both = [&](const std::string& name, const std::string& part, const model::LlmBlock* b,
                        const model::NamedTensors& params) {
    layers.push_back(block_layer(name, part, b, params, false));
    layers.push_back(block_layer(name + ".recompute", part + "_recompute", b, params, true));
  };
  if (!moe) {
    both("llm.block", "block", &llm.blocks[0], params_of(set, {"llm.layers.0."}));
  } else {
    both(
        "llm.block", "block", dense_second ? &llm.blocks[1] : &dense_llm.blocks[0],
        dense_second ? params_of(set, {"llm.layers.1."}) : params_of(dense_set, {"llm.layers.0."}));
    both("llm.moe_block", "moe_block", &llm.blocks[0], params_of(set, {"llm.layers.0."}));
  }

  Layer back;
  back.name = "llm.head";
  back.part = "back";
  // A tied head's weight is the embedding (the front holds it): its gradient lands there.
  back.own = params_of(set, {"llm.final_norm", "llm.head"});
  back.params = l.tie_embeddings ? params_of(set, {"llm.final_norm", "llm.embedding"}) : back.own;
  back.shapes = full_seq;  // targets sit anywhere in a row: crop the batch, not the sequence
  back.prepare = [&, H](const Shape& sh) {
    Prepared p;
    at::Tensor keep;
    const at::Tensor rows = crop_rows(in.target_rows, S, sh.units, sh.seq, &keep);
    const at::Tensor targets = in.targets.index_select(0, keep);
    p.leaves.push_back(randn({sh.units, sh.seq, H}));
    const at::Tensor h = p.leaves[0];
    const double count = std::max<double>(1, static_cast<double>(rows.numel()));
    p.forward = [&llm, h, rows, targets, count, H] {
      const at::Tensor y = llm.final_norm(h).reshape({-1, H}).index_select(0, rows);
      // Unfused: the fused loss makes its gradients in forward, which would book the backward's
      // matmuls as forward. The unfused loss holds its fp32 logits for backward, which the fused
      // one (whole or vocab-parallel) does not: the head's measured activations are an upper
      // bound.
      return llm.loss_sum(y, targets, /*fused=*/false) / count;
    };
    return p;
  };
  layers.push_back(back);

  json out = json::array();
  for (const Layer& layer : layers) out.push_back(prof.layer_json(layer, t));
  return out;
}

json encoder_module(const Profiler& prof, const Spec& spec, size_t e, const at::Tensor& inputs,
                    const TrainSpec& t) {
  // Its block plain and recomputed (another copy, in a set of its own), whatever the config
  // recomputes.
  EncoderSpec es = spec.model.encoders[e], recomputed;
  es.recompute = false;
  es.recompute_blocks.clear();
  recomputed = es;
  recomputed.recompute = true;
  model::ParamSet set, recomputed_set;
  const model::Scope scope{&set, es.name, nullptr};
  std::unique_ptr<model::Encoder> front_enc, block_enc, recomputed_enc, back_enc;
  model::Projector projector;
  {
    model::InitSeedGuard seed(spec.train.seed);
    front_enc = model::make_encoder(scope, es, model::StageRange{0, 0, true, false});
    block_enc = model::make_encoder(scope, es, model::StageRange{0, 1, false, false});
    recomputed_enc = model::make_encoder(model::Scope{&recomputed_set, es.name, nullptr},
                                         recomputed, model::StageRange{0, 1, false, false});
    if (es.kind == EncoderKind::kWhisper)  // its final LayerNorm runs on the last stage
      back_enc = model::make_encoder(scope, es, {es.layers, es.layers, false, true});
    projector = model::Projector::make(scope.sub("projector"), es.projector, es.hidden,
                                       spec.model.llm.hidden);
  }
  const int64_t N = inputs.size(0);
  std::vector<Shape> shapes;
  for (int64_t n : unit_counts(N)) shapes.push_back({n, 1});
  const at::ScalarType dt = prof.compute();
  const int64_t T = es.block_tokens(), h = es.hidden;

  Layer front;
  front.name = es.name + ".front";
  front.part = "front";
  front.input_grad = false;  // its input is data
  front.shapes = shapes;
  front.prepare = [&](const Shape& sh) {
    const at::Tensor x = inputs.narrow(0, 0, sh.units).contiguous();
    return Prepared{[&front_enc, x] { return (*front_enc)(x); }, {}, {}};
  };
  const auto block_layer = [&](const std::string& name, const std::string& part,
                               const std::unique_ptr<model::Encoder>& enc) {
    Layer block;
    block.name = name;
    block.part = part;
    block.shapes = shapes;
    block.prepare = [&enc, dt, T, h](const Shape& sh) {
      const at::Tensor x = (torch::randn({sh.units, T, h}) * 0.5).to(dt);
      return Prepared{[&enc, x] { return (*enc)(x); }, {x}, {}};
    };
    return block;
  };
  Layer block = block_layer(es.name + ".block", "block", block_enc);
  Layer block_recompute =
      block_layer(es.name + ".block.recompute", "block_recompute", recomputed_enc);
  Layer back;
  back.name = es.name + ".projector";
  back.part = "back";
  back.shapes = shapes;
  back.prepare = [&](const Shape& sh) {
    const at::Tensor x = (torch::randn({sh.units, es.tokens_per_item(), h}) * 0.5).to(dt);
    return Prepared{
        [&back_enc, &projector, x] { return projector(back_enc ? (*back_enc)(x) : x); }, {x}, {}};
  };
  // Parameters by part: the front end is whatever the first stage builds besides block 0.
  std::vector<std::string> front_names;
  for (const auto& [name, p] : set.all())
    if (name.find(".layers.") == std::string::npos &&
        name.find(".projector.") == std::string::npos &&
        name.find(".final_ln.") == std::string::npos)
      front_names.push_back(name);
  front.params = params_of(set, front_names);
  block.params = params_of(set, {es.name + ".layers.0."});
  block_recompute.params = params_of(recomputed_set, {es.name + ".layers.0."});
  back.params = params_of(set, {es.name + ".projector.", es.name + ".final_ln."});
  json out = json::array();
  for (const Layer* layer : {&front, &block, &block_recompute, &back})
    out.push_back(prof.layer_json(*layer, t));
  return out;
}

// The transport between two ranks of a job on this machine: rank 0 is this process, rank 1 a
// peer process it starts (`weft bench comm-peer`, the same executable), over a TCP store on
// loopback, exactly like `weft launch`'s ranks (threads of one process shared a scheduler and
// measured Gloo faster than a real job saw). Per size: one-way point-to-point (half a ping-pong,
// on a group that carries messages as the runtime's does: through shared memory where it can),
// and a two-rank all-reduce of fp32 (gradients) and of the compute dtype (activations under TP /
// CP; Gloo 1.13 reduces bf16 in fp32, conversions included); fitted to latency + bytes /
// bandwidth with relative errors. Means, not medians: on a small machine a fraction of the
// collectives waits a scheduler time slice for a Gloo thread, a real cost that a step of many
// collectives pays in proportion.
const std::vector<int64_t> kCommSizes = {1, 1024, 16384, 262144, 1048576};  // elements

struct CommTimes {
  // per size, rank 0's; all_reduce: as the gradient buckets' (Gloo), all_reduce_blocking: as the
  // loss's and the gradient norm's (through shared memory where the ranks have it)
  std::vector<double> p2p, all_reduce, all_reduce_compute, all_reduce_blocking;
  bool messages_in_shared_memory = false;  // what carried p2p
};

CommTimes comm_rounds(const dist::Comm& c, const ProfileOptions& o, at::ScalarType compute,
                      bool shared_memory_messages) {
  at::set_num_threads(1);
  const int rank = c.rank();
  const int64_t reps = std::max<int64_t>(40, 4 * o.reps);  // a mean over a heavy tail
  CommTimes out;
  const dist::Comm messages = c.subgroup({0, 1}, shared_memory_messages);  // as the runtime's
  out.messages_in_shared_memory = messages.shared_memory_messages();
  for (int64_t n : kCommSizes) {
    at::Tensor x = torch::ones({n});
    at::Tensor xc = torch::ones({n}, torch::TensorOptions().dtype(compute));
    std::vector<double> one_way, reduce, reduce_compute, reduce_blocking;
    for (int64_t i = 0; i < o.warmup + reps; ++i) {
      x.fill_(1), xc.fill_(1);  // each sum doubles them: kept finite
      c.barrier();
      const double t0 = now_seconds();
      if (rank == 0) {  // ping-pong: half the round trip
        messages.send(x, 1, 1).wait();
        messages.recv(x, 1, 2);
      } else {
        messages.recv(x, 0, 1);
        messages.send(x, 0, 2).wait();
      }
      const double t1 = now_seconds();
      c.barrier();
      const double t2 = now_seconds();
      c.all_reduce_sum_async(x).wait();  // as data parallelism's gradient buckets: over Gloo
      const double t3 = now_seconds();
      c.barrier();
      const double t4 = now_seconds();
      c.all_reduce_sum(xc);  // as TP's activations: blocking (through shared memory if it can)
      const double t5 = now_seconds();
      c.barrier();
      const double t6 = now_seconds();
      c.all_reduce_sum(x);
      const double t7 = now_seconds();
      if (i >= o.warmup)
        one_way.push_back((t1 - t0) / 2), reduce.push_back(t3 - t2),
            reduce_compute.push_back(t5 - t4), reduce_blocking.push_back(t7 - t6);
    }
    out.p2p.push_back(mean(one_way));
    out.all_reduce.push_back(mean(reduce));
    out.all_reduce_compute.push_back(mean(reduce_compute));
    out.all_reduce_blocking.push_back(mean(reduce_blocking));
  }
  return out;
}

constexpr auto kCommTimeout = std::chrono::seconds(30);  // the peer starts in about a second

json measure_comm(const ProfileOptions& o, at::ScalarType compute, bool shared_memory,
                  bool shared_memory_messages) {
  const int port = dist::free_port();
  const std::vector<std::string> args = {"weft",
                                         "bench",
                                         "comm-peer",
                                         "--port",
                                         std::to_string(port),
                                         "--reps",
                                         std::to_string(o.reps),
                                         "--warmup",
                                         std::to_string(o.warmup),
                                         "--dtype",
                                         compute == at::kBFloat16 ? "bf16" : "fp32",
                                         "--shared-memory",
                                         shared_memory ? "1" : "0",
                                         "--messages",
                                         shared_memory_messages ? "1" : "0"};
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  WEFT_CHECK(pid >= 0, "weft bench profile: fork() failed: ", std::strerror(errno));
  if (pid == 0) {  // the peer: dies with this process
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::execv("/proc/self/exe", argv.data());
    std::fprintf(stderr, "weft bench profile: cannot start the transport peer: %s\n",
                 std::strerror(errno));
    ::_exit(127);
  }
  CommTimes t;
  std::string failure;
  try {
    dist::WorldInfo w;
    w.rank = 0, w.world_size = 2, w.master_port = port;
    dist::Comm c = dist::Comm::connect(w, kCommTimeout, false, shared_memory);
    shared_memory = c.shared_memory();
    t = comm_rounds(c, o, compute, shared_memory_messages);
    shared_memory_messages = t.messages_in_shared_memory;
  } catch (const std::exception& e) {
    failure = e.what();
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  WEFT_CHECK(failure.empty(),
             "weft bench profile: measuring the transport with a peer process: ", failure);
  WEFT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
             "weft bench profile: the transport peer process (weft bench comm-peer) failed; its "
             "error is above");
  std::vector<plan::CostPoint> pp, pa, pc, pb;
  json points = json::array();
  const double compute_bytes = static_cast<double>(c10::elementSize(compute));
  for (size_t k = 0; k < kCommSizes.size(); ++k) {
    const double bytes = 4.0 * static_cast<double>(kCommSizes[k]);
    const double cbytes = compute_bytes * static_cast<double>(kCommSizes[k]);
    pp.push_back({bytes, 1, t.p2p[k]});
    pa.push_back({bytes, 1, t.all_reduce[k]});
    pc.push_back({cbytes, 1, t.all_reduce_compute[k]});
    pb.push_back({bytes, 1, t.all_reduce_blocking[k]});
    points.push_back({{"bytes", bytes},
                      {"p2p", t.p2p[k]},
                      {"all_reduce", t.all_reduce[k]},
                      {"compute_bytes", cbytes},
                      {"all_reduce_compute", t.all_reduce_compute[k]},
                      {"all_reduce_blocking", t.all_reduce_blocking[k]}});
  }
  const plan::CostFit fp = plan::fit_cost(pp, false, true), fa = plan::fit_cost(pa, false, true);
  const plan::CostFit fc = plan::fit_cost(pc, false, true), fb = plan::fit_cost(pb, false, true);
  // A two-rank ring all-reduce costs 2·α + bytes / B (plan/cluster.h).
  const auto link = [](double latency, double per_byte) {
    return json{{"latency_us", latency * 1e6},
                {"bandwidth_gbs", per_byte > 0 ? 1e-9 / per_byte : 1e3}};
  };
  json j;
  j["p2p"] = link(fp.fixed, fp.linear);
  j["all_reduce"] = link(fa.fixed / 2, fa.linear);
  j["all_reduce_compute"] = link(fc.fixed / 2, fc.linear);
  j["all_reduce_blocking"] = link(fb.fixed / 2, fb.linear);
  j["on_compute"] = true;  // Gloo over TCP: its work runs on the CPU cores that compute
  // What carried the blocking activation collectives (all_reduce_compute).
  j["activation_transport"] = shared_memory ? "shared memory" : "gloo";
  j["message_transport"] = shared_memory_messages ? "shared memory" : "gloo";  // p2p's
  j["points"] = points;
  return j;
}

}  // namespace

void comm_peer(int port, int64_t reps, int64_t warmup, const std::string& dtype, bool shared_memory,
               bool messages) {
  WEFT_CHECK(dtype == "bf16" || dtype == "fp32", "weft bench comm-peer: --dtype ", dtype,
             ": expected bf16 or fp32");
  ProfileOptions o;
  o.reps = reps;
  o.warmup = warmup;
  dist::WorldInfo w;
  w.rank = 1, w.world_size = 2, w.master_port = port;
  comm_rounds(dist::Comm::connect(w, kCommTimeout, false, shared_memory), o,
              dtype == "bf16" ? at::kBFloat16 : at::kFloat, messages);
}

std::string profile_config(Spec spec, const ProfileOptions& o) {
  WEFT_CHECK(o.reps >= 1, "weft bench profile: --reps must be at least 1");
  WEFT_CHECK(o.warmup >= 0, "weft bench profile: --warmup must be non-negative");
  TrainSpec& ts = spec.train;
  const int threads = dist::intra_op_threads(ts.threads);
  at::set_num_threads(threads);
  // One process, whatever layout the config asks for: the costs are per layer (every block
  // measured plain and recomputed, whatever the config recomputes).
  spec = plan::one_process(std::move(spec));
  const int64_t steps = o.warmup + o.reps;
  ts.steps = std::max(ts.steps, steps);
  ts.warmup = std::min(ts.warmup, ts.steps);
  TrainerOptions to;
  to.progress = false;
  to.eval = false;
  Trainer trainer(spec, plan::make_plan(spec, 1), to);
  const Spec& resolved = trainer.spec();  // model.llm.vocab from the tokenizer

  // The batches the layers are measured on.
  std::vector<StepBatch> batches;
  for (int64_t i = 0; i < steps; ++i) batches.push_back(trainer.prepare_step(i));
  // Data, per sample, on a second dataset: laying out and collating the global batch (every
  // rank does it), and decoding each encoder's media (only the ranks reading an item do).
  Spec data_spec = resolved;
  const std::unique_ptr<data::Dataset> media_data = data::make_dataset(&data_spec);
  data::CollateOptions co;
  co.num_encoders = static_cast<int>(resolved.model.encoders.size());
  co.pad_id = media_data->pad_id();
  co.packing = resolved.data.packing;
  co.max_seq = resolved.model.llm.max_seq;
  std::vector<double> data;
  std::vector<std::vector<double>> media(resolved.model.encoders.size());
  const double per = 1.0 / static_cast<double>(ts.batch);
  for (int64_t i = 0; i < steps; ++i) {
    const double t0 = now_seconds();
    std::vector<data::Sample> layout = media_data->train_layout(i, ts.batch);
    const double laid_out = now_seconds() - t0;
    const std::vector<data::MediaRef> all = data::all_media(layout);
    for (size_t e = 0; e < media.size(); ++e) {
      std::vector<data::MediaRef> mine;
      for (const data::MediaRef& r : all)
        if (layout[r.sample].items[r.item].encoder == static_cast<int>(e)) mine.push_back(r);
      const double t1 = now_seconds();
      media_data->load_media(i, layout, mine);
      if (i >= o.warmup) media[e].push_back((now_seconds() - t1) * per);
    }
    const double t2 = now_seconds();
    data::collate(layout, co);
    if (i >= o.warmup) data.push_back((laid_out + now_seconds() - t2) * per);
  }
  // The profiled rows' mean padded length (the costs are per row of it), and the data's mean
  // sample (what the FLOP fields, the messages and each encoder's items per sample are priced
  // on; measured as `weft plan` measures it).
  double rows = 0, padded = 0;
  for (const StepBatch& b : batches)
    for (const data::Microbatch& mb : b.microbatches) {
      rows += static_cast<double>(mb.tokens.size(0));
      padded += static_cast<double>(mb.tokens.numel());
    }
  const plan::DataShape shape = measure_data_shape(spec).shape;
  const model::Inputs& in = batches.front().inputs.front().front();

  const at::ScalarType compute = ts.precision == Precision::kBf16 ? at::kBFloat16 : at::kFloat;
  model::ComputeDtypeGuard dtype(compute);
  // The other cores' ranks: one background trainer per further group of `threads` cores.
  const int64_t cores = static_cast<int64_t>(std::thread::hardware_concurrency());
  const int64_t copies = o.shared ? std::max<int64_t>(0, cores / threads - 1) : 0;
  BackgroundLoad load(spec, copies, std::min<int64_t>(steps, 4));
  int64_t model_params = 0;
  for (const auto& [name, p] : trainer.model().parameters()) model_params += p.numel();
  const int64_t evict_bytes = std::min(2 * last_level_cache_bytes(), 16 * model_params);
  const Profiler prof(o, compute, &load, evict_bytes);
  json modules = json::array();
  {
    json m;
    m["name"] = "llm";
    m["role"] = "llm";
    m["unit"] = "sample";
    m["units_per_sample"] = 1;
    json model;
    for (const auto& [key, v] : plan::profile_model_fields(resolved, "llm")) model[key] = v;
    m["model"] = model;
    m["layers"] = llm_module(prof, resolved, in, ts);
    modules.push_back(m);
  }
  for (size_t e = 0; e < resolved.model.encoders.size(); ++e) {
    const EncoderSpec& es = resolved.model.encoders[e];
    const at::Tensor& inputs = in.encoder_inputs[e];
    WEFT_CHECK(inputs.defined() && inputs.size(0) > 0, resolved.source, ": encoder '", es.name,
               "' gets no items in the first microbatch of the data; nothing to profile");
    json m;
    m["name"] = es.name;
    m["role"] = "encoder";
    m["unit"] = "item";
    m["units_per_sample"] = shape.items[e];
    json model;
    for (const auto& [key, v] : plan::profile_model_fields(resolved, es.name)) model[key] = v;
    m["model"] = model;
    m["layers"] = encoder_module(prof, resolved, e, inputs, ts);
    modules.push_back(m);
  }

  json j;
  j["format"] = "weft-profile-2";
  j["device"] =
      cpu_name() + " (" + std::to_string(threads) + " thread" + (threads == 1 ? "" : "s") + ")";
  j["threads"] = threads;
  j["precision"] = to_string(ts.precision);
  j["torch"] = TORCH_VERSION;
  j["config"] = spec.source;
  j["reps"] = o.reps;
  j["cache_evict_bytes"] = evict_bytes;
  j["shape"] = {{"samples", in.tokens.size(0)},
                {"seq", padded / rows},
                {"profiled_seq", in.tokens.size(1)},
                {"max_seq", resolved.model.llm.max_seq},
                {"tokens_per_sample", shape.tokens}};
  j["data_shape"] = plan::data_shape_json(resolved, shape);
  json media_json = json::object();
  for (size_t e = 0; e < media.size(); ++e)
    media_json[resolved.model.encoders[e].name] = median(media[e]);
  j["data"] = {{"seconds_per_sample", median(data)}, {"media_seconds_per_sample", media_json}};
  if (o.comm)
    j["comm"] = measure_comm(o, compute, ts.shared_memory_collectives, ts.shared_memory_messages);
  j["modules"] = modules;
  return j.dump(2);
}

}  // namespace weft::train
