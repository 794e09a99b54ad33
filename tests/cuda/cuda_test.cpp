// On a GPU (built only against a CUDA LibTorch: CMakeLists.txt adds tests/cuda there, and these
// tests then need a CUDA device): weft's CUDA kernels match the CPU's fused loops, the fused
// AdamW matches the CPU update, training on the GPU reproduces training on the CPU, and
// multi-rank layouts on one GPU reproduce one process.
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "support/equivalence.h"
#include "support/tiny_run.h"
#include "weft/model/chunked_attention.h"
#include "weft/model/fused.h"
#include "weft/model/mask.h"
#include "weft/model/torch_compat.h"
#include "weft/train/optimizer.h"
#include "weft/train/trainer.h"

namespace weft {
namespace {

using testing::rel_diff;

const c10::Device kGpu(c10::kCUDA, 0);

// The device result against the CPU's, both taken to fp32 on the CPU.
double gap(const at::Tensor& gpu, const at::Tensor& cpu) {
  return rel_diff(gpu.to(at::kCPU, at::kFloat), cpu.to(at::kFloat));
}

// f on CPU copies and on GPU copies of `inputs` (the first `with_grad` of them leaves that
// require grad), with the same upstream gradient: the outputs and those inputs' gradients agree
// within `tol`, and on the GPU the op is weft's CUDA kernel (its autograd node), not an ATen
// fallback.
// `layout` (optional) lays the upstream gradient out as it arrives in a model (same values).
template <typename F>
void expect_same_on_gpu(const std::vector<at::Tensor>& inputs, size_t with_grad, const F& f,
                        double tol, const std::string& what,
                        const std::function<at::Tensor(const at::Tensor&)>& layout = nullptr) {
  SCOPED_TRACE(what);
  std::vector<at::Tensor> cpu, gpu;
  for (size_t i = 0; i < inputs.size(); ++i) {
    cpu.push_back(inputs[i].clone().requires_grad_(i < with_grad));
    gpu.push_back(inputs[i].to(kGpu).requires_grad_(i < with_grad));
  }
  const at::Tensor yc = f(cpu), yg = f(gpu);
  ASSERT_TRUE(yg.is_cuda());
  ASSERT_EQ(yg.sizes(), yc.sizes());
#ifdef WEFT_CUDA_KERNELS
  ASSERT_TRUE(yg.grad_fn());
  EXPECT_NE(yg.grad_fn()->name().find("CudaFn"), std::string::npos) << yg.grad_fn()->name();
#endif
  EXPECT_LT(gap(yg, yc), tol) << "output";
  at::Tensor up = torch::randn(yc.sizes(), torch::dtype(at::kFloat)).to(yc.scalar_type());
  if (layout) up = layout(up);
  yc.backward(up);
  yg.backward(layout ? layout(up.to(kGpu)) : up.to(kGpu));
  for (size_t i = 0; i < with_grad; ++i) {
    ASSERT_TRUE(gpu[i].grad().defined()) << "input " << i;
    EXPECT_LT(gap(gpu[i].grad(), cpu[i].grad()), tol) << "gradient of input " << i;
  }
}

class CudaKernels : public ::testing::TestWithParam<at::ScalarType> {};

// fp32: the same formulas in another summation order; bf16: one rounding of each result.
double tolerance(at::ScalarType t) { return t == at::kFloat ? 1e-5 : 1e-2; }

TEST_P(CudaKernels, RmsNormMatchesTheCpu) {
  torch::manual_seed(1);
  const at::ScalarType dt = GetParam();
  // 5000: not a multiple of the block; 1200 rows: several rows per block in the backward; 30:
  // rows of no whole 16-byte vectors (the scalar kernels), the others vectors.
  for (const auto& [rows, n] : std::vector<std::pair<int64_t, int64_t>>{
           {111, 32}, {111, 2048}, {111, 5000}, {1200, 256}, {111, 30}}) {
    const at::Tensor x = torch::randn({3, rows / 3, n}).to(dt);
    const at::Tensor w = torch::rand({n}) + 0.5;
    const std::string what = "rms_norm rows=" + std::to_string(rows) + " n=" + std::to_string(n);
    expect_same_on_gpu(
        {x, w}, 2,
        [](const std::vector<at::Tensor>& v) { return model::rms_norm(v[0], v[1], 1e-5); },
        tolerance(dt), what);
    expect_same_on_gpu(  // only the weight needs a gradient (a frozen input)
        {w, x}, 1,
        [](const std::vector<at::Tensor>& v) { return model::rms_norm(v[1], v[0], 1e-5); },
        tolerance(dt), what + ", weight gradient only");
  }
}

TEST_P(CudaKernels, SwigluMatchesTheCpu) {
  torch::manual_seed(2);
  const at::ScalarType dt = GetParam();
  for (int64_t f : {96, 10}) {  // rows of whole 16-byte vectors (the vector kernels), and not
    const at::Tensor gu = torch::randn({5, 19, 2 * f}).to(dt);
    expect_same_on_gpu(
        {gu}, 1, [](const std::vector<at::Tensor>& v) { return model::swiglu(v[0]); },
        tolerance(dt), "swiglu f=" + std::to_string(f));
  }
}

TEST_P(CudaKernels, RopeOfAStridedViewMatchesTheCpu) {
  torch::manual_seed(3);
  const at::ScalarType dt = GetParam();
  const int64_t B = 2, S = 7, H = 3;
  // D = 16: the vector kernel (q at the row's start, k after q's heads); D = 12: half rows of 6,
  // no whole 16-byte vectors (the scalar kernel).
  for (const auto& [D, first] :
       std::vector<std::pair<int64_t, int64_t>>{{16, 0}, {16, 1}, {12, 0}}) {
    // q (or k) as a view into a fused projection [B, S, 2·H·D], the way attention hands it over.
    const at::Tensor qk = torch::randn({B, S, 2 * H * D}).to(dt);
    const at::Tensor angle = torch::rand({B, S, 1, D / 2}) * 6.0;
    const at::Tensor cos = torch::cat({angle.cos(), angle.cos()}, -1).contiguous();
    const at::Tensor rot_sin = torch::cat({-angle.sin(), angle.sin()}, -1).contiguous();
    const int64_t d = D, offset = first * H * D;
    expect_same_on_gpu(
        {qk, cos, rot_sin}, 1,
        [&](const std::vector<at::Tensor>& v) {
          return model::rope(v[0].narrow(2, offset, H * d).view({B, S, H, d}), v[1], v[2]);
        },
        tolerance(dt), "rope D=" + std::to_string(D) + (first ? ", k" : ", q"),
        // the gradient comes back from attention head-major: [B, S, H, D] with strides of [B,
        // H, S, D]
        [](const at::Tensor& g) { return g.transpose(1, 2).contiguous().transpose(1, 2); });
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaKernels, ::testing::Values(at::kFloat, at::kBFloat16),
                         [](const auto& info) {
                           return std::string(info.param == at::kFloat ? "fp32" : "bf16");
                         });

// The fused multi-tensor AdamW on the GPU against the CPU's fused loop: with and without weight
// decay (matrices and vectors), gradient clipping's scale, three steps.
TEST(Cuda, FusedAdamWMatchesTheCpu) {
  torch::manual_seed(4);
  model::NamedTensors cpu, gpu;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{17, 33}, {33}, {4, 5, 6}}) {
    const at::Tensor p = torch::randn(shape);
    cpu.emplace_back("p" + std::to_string(cpu.size()), p.clone());
    gpu.emplace_back("p" + std::to_string(gpu.size()), p.to(kGpu));
  }
  train::AdamWOptions opts;
  opts.weight_decay = 0.1;
  train::AdamW a(cpu, opts), b(gpu, opts);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < cpu.size(); ++i) {
      const at::Tensor g = torch::randn(cpu[i].second.sizes());
      cpu[i].second.mutable_grad() = g.clone();
      gpu[i].second.mutable_grad() = g.to(kGpu);
    }
    const double scale = step == 1 ? 0.25 : 1.0;
    a.step(1e-2, scale);
    b.step(1e-2, scale);
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_LT(gap(gpu[i].second, cpu[i].second), 1e-6) << cpu[i].first;
    EXPECT_LT(gap(b.exp_avg()[i], a.exp_avg()[i]), 1e-6) << cpu[i].first;
    EXPECT_LT(gap(b.exp_avg_sq()[i], a.exp_avg_sq()[i]), 1e-6) << cpu[i].first;
  }
}

// The gradient norm's Σ x² over device tensors: CUDA fp32 ones through one multi-tensor norm,
// others (bf16, strided) one by one, undefined ones skipped; against the CPU's exact double sum.
TEST(Cuda, SumOfSquaresOfDeviceTensors) {
  torch::manual_seed(5);
  std::vector<at::Tensor> cpu = {torch::randn({1000, 37}),
                                 torch::randn({3}) * 1e3,
                                 torch::randn({0}),
                                 torch::randn({64, 64}).t(),
                                 torch::randn({513}).to(at::kBFloat16),
                                 at::Tensor()};
  std::vector<at::Tensor> gpu;
  double want = 0;
  for (const at::Tensor& t : cpu) {
    gpu.push_back(t.defined() ? t.to(kGpu) : at::Tensor());
    if (t.defined()) want += t.to(at::kDouble).pow(2).sum().item<double>();
  }
  EXPECT_NEAR(model::sum_squares(gpu), want, 1e-6 * want);
  // Per tensor on the device (the deferred gradient norm), each against the CPU's.
  const at::Tensor each = model::squares_each(gpu, kGpu);
  ASSERT_TRUE(each.is_cuda());
  ASSERT_EQ(each.numel(), static_cast<int64_t>(cpu.size()));
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double w = cpu[i].defined() ? cpu[i].to(at::kDouble).pow(2).sum().item<double>() : 0.0;
    EXPECT_NEAR(each[static_cast<int64_t>(i)].item<double>(), w, 1e-6 * w + 1e-30) << i;
  }
  EXPECT_NEAR(model::norm_of_squares(each).item<double>(), std::sqrt(want), 1e-6 * std::sqrt(want));
}

// Attention in tiles on the GPU (model::chunked_attention: flash attention for unmasked and
// causal tiles in bf16, with grouped K/V heads as they are; memory-efficient attention with the
// mask's bias for masked tiles and for fp32) against softmax attention in double on the CPU:
// outputs and dq, dk, dv. 4 query heads over 2 K/V heads, head dim 64, 200 positions, blocks of
// at most 64 queries where the rows differ; row 0 one document with two images, row 1 a second
// document from 64, so its queries see none of the masked tiles of keys 0-64 beside their
// unmasked and causal tiles; the first 20 queries and queries 29-64 are causal in both rows
// (blocks of their own); the last block's masked tile is 8 keys wide. In bf16 flash attention
// takes the causal tiles after unmasked ones as one causal tile (lower-right aligned,
// join_causal_tiles: keys 0-64 for 35 queries, 64-192 for 64); fp32's memory-efficient kernel
// takes them apart. The same tiles through the fp32 reference kernels too.
TEST(CudaAttention, TilesMatchOneAttention) {
  const int64_t B = 2, H = 4, KV = 2, S = 200, D = 64;
  at::Tensor doc = torch::zeros({B, S}, torch::kInt), item = torch::full({B, S}, -1, torch::kInt);
  item[0].narrow(0, 20, 10).fill_(0);
  item[0].narrow(0, 195, 4).fill_(1);
  doc[1].narrow(0, 64, S - 64).fill_(1);
  const std::vector<model::AttentionChunk> chunks =
      model::attention_chunks(doc, item, 64, /*most=*/1.0);
  ASSERT_EQ(model::describe(chunks),
            "0-20C | 0-20A 20-64M | 0-29A 29-64C | 0-64M 64-128C | 0-64M 64-128A 128-192C | "
            "0-64M 64-192A 192-200M | ");
  ASSERT_EQ(model::describe(model::join_causal_tiles(chunks)),
            "0-20C | 0-20A 20-64M | 0-64C | 0-64M 64-128C | 0-64M 64-192C | "
            "0-64M 64-192A 192-200M | ");
  const at::Tensor visible = model::visible_mask(doc, item).to(kGpu);
  torch::manual_seed(5);
  const at::Tensor q0 = torch::randn({B, H, S, D}), k0 = torch::randn({B, KV, S, D});
  const at::Tensor v0 = torch::randn({B, KV, S, D}), up = torch::randn({B, H, S, D});
  // The reference: double on the CPU.
  std::vector<at::Tensor> want;
  {
    at::Tensor q = q0.to(at::kDouble).requires_grad_(true);
    at::Tensor k = k0.to(at::kDouble).requires_grad_(true);
    at::Tensor v = v0.to(at::kDouble).requires_grad_(true);
    at::Tensor s = at::matmul(q, k.repeat_interleave(H / KV, 1).transpose(-2, -1)) * 0.125;
    s = s.masked_fill(visible.cpu().logical_not(), -INFINITY);
    at::Tensor o = at::matmul(at::softmax(s, -1), v.repeat_interleave(H / KV, 1));
    o.backward(up.to(at::kDouble));
    want = {o.detach(), q.grad(), k.grad(), v.grad()};
  }
  for (model::TileKernels kernels : {model::TileKernels::kFastest, model::TileKernels::kMath})
    for (at::ScalarType dt : {at::kBFloat16, at::kFloat}) {
      SCOPED_TRACE(
          std::string(kernels == model::TileKernels::kMath ? "reference tiles" : "kernels") +
          (dt == at::kFloat ? ", fp32" : ", bf16"));
      // Laid out as the model lays them out: [B, S, heads, D] memory.
      auto on_gpu = [&](const at::Tensor& t) {
        return t.transpose(1, 2).contiguous().to(kGpu, dt).transpose(1, 2).requires_grad_(true);
      };
      at::Tensor q = on_gpu(q0), k = on_gpu(k0), v = on_gpu(v0);
      const model::ChunkMasks masks =
          model::chunk_masks(compat::attention_mask(visible, dt), chunks, dt);
      at::Tensor o = model::chunked_attention(q, k, v, chunks, masks, 0.125, kernels);
      ASSERT_TRUE(o.is_cuda());
      o.backward(up.to(kGpu, dt));
      const std::vector<at::Tensor> got = {o, q.grad(), k.grad(), v.grad()};
      const double tol = dt == at::kFloat ? 1e-4 : 3e-2;
      const char* names[] = {"output", "dq", "dk", "dv"};
      for (size_t i = 0; i < 4; ++i) {
        ASSERT_TRUE(got[i].defined()) << names[i];
        EXPECT_LT(gap(got[i].detach(), want[i]), tol) << names[i];
      }
    }
}

// A queued step never waits for the GPU: under CUDA's sync debug mode "error", any host
// synchronisation inside Trainer::queue_step (an .item(), a pageable or blocking copy, a
// stream synchronisation) throws. After two warm-up steps (allocations, library handles).
TEST(CudaTrainer, QueuedStepNeverWaitsForTheGpu) {
  const Spec spec = parse_spec(testing::kTinyVlm, "tiny", {"train.steps=4", "train.device=cuda"});
  train::TrainerOptions o;
  o.out_dir = testing::temp_dir("cuda_nosync").string();
  o.progress = false;
  o.peak_flops = 1e12;
  o.eval = false;
  train::Trainer t(spec, plan::make_plan(spec), o);
  ASSERT_TRUE(t.defers());
  std::vector<train::StepBatch> batches;
  for (int64_t i = 0; i < 4; ++i) batches.push_back(t.prepare_step(i));
  for (int64_t i = 0; i < 2; ++i) {
    train::QueuedStep q = t.queue_step(batches[i], i);
    t.finish_step(q);
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  std::string error;
  train::QueuedStep q2, q3;
  try {
    q2 = t.queue_step(batches[2], 2);
    q3 = t.queue_step(batches[3], 3);  // two steps in flight
  } catch (const std::exception& e) {
    error = e.what();
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  ASSERT_EQ(error, "") << "a queued step synchronised with the GPU";
  const train::StepOutcome a = t.finish_step(q2), b = t.finish_step(q3);
  EXPECT_TRUE(std::isfinite(a.loss) && std::isfinite(b.loss));
  EXPECT_TRUE(std::isfinite(a.grad_norm) && a.grad_norm > 0);
}

// The tiny VLM trained with `sets` by one process on the CPU (first) and on the GPU (second).
std::pair<testing::RunResult, testing::RunResult> train_on_cpu_and_gpu(
    std::vector<std::string> sets, const std::string& tag) {
  const Spec cpu_spec = parse_spec(testing::kTinyVlm, "tiny", sets);
  sets.push_back("train.device=cuda");
  const Spec gpu_spec = parse_spec(testing::kTinyVlm, "tiny", sets);
  return {testing::train(cpu_spec, dist::Comm(), testing::temp_dir(tag + "_cpu")),
          testing::train(gpu_spec, dist::Comm(), testing::temp_dir(tag + "_gpu"))};
}

// The tiny VLM trained 3 steps on the GPU against the CPU (fp32): the same losses, gradients
// and parameters, up to the summation orders of two devices' kernels.
TEST(Cuda, Fp32TrainingMatchesTheCpu) {
  const auto [ref, got] = train_on_cpu_and_gpu(
      {"train.steps=3", "train.warmup=1", "train.precision=fp32"}, "cuda_fp32");
  ASSERT_EQ(got.losses.size(), 3u);
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * ref.losses[i]) << "step " << i + 1;
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (const auto& [name, p] : ref.params)
    EXPECT_LT(gap(got.params.at(name), p), 1e-4) << "param " << name;
  for (const auto& [name, g] : ref.grads) EXPECT_LT(gap(got.grads.at(name), g), 1e-4) << name;
}

// bf16 on the GPU (SDPA, the CUDA kernels, the fused AdamW) follows the CPU's bf16 run within
// bf16's precision, step by step, and learns.
TEST(Cuda, Bf16TrainingTracksTheCpu) {
  const auto [ref, got] = train_on_cpu_and_gpu(
      {"train.steps=8", "train.warmup=2", "train.precision=bf16"}, "cuda_bf16");
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 3e-2 * ref.losses[i]) << "step " << i + 1;
  EXPECT_LT(got.losses.back(), got.losses.front());
}

// Collectives of CUDA tensors on a group without NCCL go through host memory (dist::Comm's staged
// path), in fp32 and bf16 (Gloo reduces 2-byte floats in fp32 on the host): each result is on
// the GPU and equals the CPU's.
TEST(CudaComm, StagedCollectivesMatchTheCpu) {
  testing::run_ranks(2, [](const dist::Comm& comm) {
    const int r = comm.rank();
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(dt == at::kFloat ? "fp32" : "bf16");
      // Small integers: exact in bf16, so every result is exact.
      auto of = [&](int rank) { return (torch::arange(8, torch::kFloat) + 10 * rank).to(dt); };
      auto expect_on_gpu = [&](const at::Tensor& got, const at::Tensor& want, const char* op) {
        EXPECT_TRUE(got.is_cuda()) << op;
        EXPECT_EQ(got.scalar_type(), dt) << op;
        EXPECT_TRUE(torch::equal(got.cpu().to(at::kFloat), want.to(at::kFloat))) << op;
      };
      at::Tensor t = of(r).to(kGpu);
      comm.all_reduce_sum(t);
      expect_on_gpu(t, of(0) + of(1), "all_reduce_sum");
      t = of(r).to(kGpu);
      dist::Pending pending = comm.all_reduce_sum_async(t);
      pending.wait();
      expect_on_gpu(t, of(0) + of(1), "all_reduce_sum_async");
      t = of(r).to(kGpu);
      comm.all_reduce_max(t);
      expect_on_gpu(t, of(1), "all_reduce_max");
      t = of(r).to(kGpu);
      comm.broadcast(t, 1);
      expect_on_gpu(t, of(1), "broadcast");
      expect_on_gpu(comm.all_gather(of(r).to(kGpu)), torch::cat({of(0), of(1)}), "all_gather");
      expect_on_gpu(comm.reduce_scatter_sum(of(r).to(kGpu)), (of(0) + of(1)).narrow(0, 4 * r, 4),
                    "reduce_scatter_sum");
      expect_on_gpu(comm.all_to_all(of(r).to(kGpu), {4, 4}, {4, 4}),
                    torch::cat({of(0).narrow(0, 4 * r, 4), of(1).narrow(0, 4 * r, 4)}),
                    "all_to_all");
    }
  });
}

// Several ranks on one GPU, one thread each: in-process groups have no NCCL backend, so their
// collectives of device tensors go through host memory over Gloo. What runs on the GPU is the
// distributed runtime's device side — the bridge's buffers, pipeline messages, TP and CP
// collectives, the DP gradient reduction (overlapped, and ZeRO-1's) — held to the equivalence
// law against one process on the same GPU (fp32: losses 1e-5, gradients and parameters 1e-4).
// NCCL itself needs one GPU per rank.
void expect_equivalent_on_gpu(int world, std::vector<std::string> sets, const std::string& tag) {
  sets.push_back("train.device=cuda");
  testing::expect_equivalent(world, sets, tag);
}

TEST(CudaLayouts, Dp2) { expect_equivalent_on_gpu(2, {}, "cuda_dp2"); }
TEST(CudaLayouts, Dp2ZeroOne) { expect_equivalent_on_gpu(2, {"train.zero_stage=1"}, "cuda_zero1"); }
TEST(CudaLayouts, Tp2) {
  expect_equivalent_on_gpu(2, {"parallel.llm.tp=2", "parallel.vision.tp=2"}, "cuda_tp2");
}
TEST(CudaLayouts, LlmPp2) { expect_equivalent_on_gpu(2, {"parallel.llm.pp=2"}, "cuda_pp2"); }
TEST(CudaLayouts, LlmCp2) { expect_equivalent_on_gpu(2, {"parallel.llm.cp=2"}, "cuda_cp2"); }
TEST(CudaLayouts, EncoderOnItsOwnRankToLlmPp2Separate) {
  expect_equivalent_on_gpu(3, {"parallel.placement=\"separate\"", "parallel.llm.pp=2"},
                           "cuda_separate_pp2");
}

}  // namespace
}  // namespace weft
