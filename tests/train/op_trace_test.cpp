// OpTrace on a CPU build (a CUDA build records through Kineto): every operator with its input
// shapes, nested inside its caller on its thread, one trace at a time, and nothing left on the
// heap while it records. LibTorch's autograd profiler, which it replaced, kept its events there:
// they took the free space a step's large tensors reuse, and the traced step ran ~2x slower.
#ifndef WEFT_CUDA

#include "weft/train/op_trace.h"

#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/tiny_run.h"
#include "weft/core/error.h"
#include "weft/model/fused.h"

namespace weft::train {
namespace {

using nlohmann::json;

std::vector<json> events_of(const std::filesystem::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  const json j = json::parse(in);
  return j.at("traceEvents").get<std::vector<json>>();
}

std::vector<json> named(const std::vector<json>& events, const std::string& name) {
  std::vector<json> out;
  for (const json& e : events)
    if (e.at("name") == name) out.push_back(e);
  return out;
}

// A linear layer's forward and backward.
void work(const at::Tensor& w) {
  const at::Tensor x = torch::ones({2, 3});
  at::linear(x, w).sum().backward();
}

TEST(OpTrace, RecordsOperatorsWithShapesInsideTheirCallers) {
  const at::Tensor w = torch::ones({4, 3}).set_requires_grad(true);
  const std::filesystem::path path = weft::testing::temp_dir("op_trace") / "sub" / "ops.json";
  {
    OpTrace trace(path.string());
    work(w);
    model::rms_norm(torch::ones({2, 4}), torch::ones({4}), 1e-5);
  }
  const std::vector<json> events = events_of(path);  // its directory made
  for (const json& e : events) {
    EXPECT_EQ(e.at("ph"), "X");
    EXPECT_GE(e.at("dur").get<double>(), 0.0) << e.dump();
    EXPECT_GE(e.at("ts").get<double>(), 0.0) << e.dump();
  }
  const std::vector<json> linear = named(events, "aten::linear");
  ASSERT_EQ(linear.size(), 1u);
  EXPECT_EQ(linear[0].at("cat"), "cpu_op");
  // input [2, 3], weight [4, 3], no bias (not a tensor: no dims)
  EXPECT_EQ(linear[0].at("args").at("Input Dims"), json::parse("[[2, 3], [4, 3], []]"));
  // Its matmul runs inside it, on its thread.
  const double begin = linear[0].at("ts"), end = begin + linear[0].at("dur").get<double>();
  bool nested = false;
  for (const json& e : events) {
    const std::string name = e.at("name");
    if ((name == "aten::matmul" || name == "aten::mm" || name == "aten::addmm") &&
        e.at("tid") == linear[0].at("tid"))
      nested = nested || (e.at("ts").get<double>() >= begin &&
                          e.at("ts").get<double>() + e.at("dur").get<double>() <= end);
  }
  EXPECT_TRUE(nested) << "no matmul inside aten::linear";
  // weft's own kernels are ranges too, with their inputs' shapes.
  const std::vector<json> norm = named(events, "weft::rms_norm");
  ASSERT_EQ(norm.size(), 1u);
  EXPECT_EQ(norm[0].at("args").at("Input Dims"), json::parse("[[2, 4], [4]]"));
  bool backward = false;
  for (const json& e : events)
    backward = backward || e.at("name").get<std::string>().find("Backward") != std::string::npos;
  EXPECT_TRUE(backward) << "no backward node recorded";
}

TEST(OpTrace, OneAtATimeAndEachTraceHoldsOnlyItsOwnOperators) {
  const at::Tensor w = torch::ones({4, 3}).set_requires_grad(true);
  const std::filesystem::path dir = weft::testing::temp_dir("op_trace_twice");
  {
    OpTrace first((dir / "first.json").string());
    EXPECT_THROW(OpTrace((dir / "second.json").string()), Error);
    work(w);
  }
  {
    OpTrace again((dir / "again.json").string());
    at::Tensor y = torch::ones({5}) + torch::ones({5});
  }
  EXPECT_EQ(named(events_of(dir / "first.json"), "aten::linear").size(), 1u);
  const std::vector<json> again = events_of(dir / "again.json");
  EXPECT_TRUE(named(again, "aten::linear").empty());
  const std::vector<json> add = named(again, "aten::add");
  ASSERT_EQ(add.size(), 1u);
  EXPECT_EQ(add[0].at("args").at("Input Dims"), json::parse("[[5], [5], []]"));
  EXPECT_FALSE(std::filesystem::exists(dir / "second.json"));
}

TEST(OpTrace, RecordingLeavesNothingOnTheHeap) {
  const at::Tensor w = torch::ones({4, 3}).set_requires_grad(true);
  const std::filesystem::path path = weft::testing::temp_dir("op_trace_heap") / "ops.json";
  size_t before = 0, after = 0;
  {
    OpTrace trace(path.string());
    for (int i = 0; i < 20; ++i) work(w);  // LibTorch's own first-use allocations first
    before = mallinfo2().uordblks;
    for (int i = 0; i < 200; ++i) work(w);  // ~4000 operators recorded
    after = mallinfo2().uordblks;
  }
  // The autograd profiler's events held ~7 KB per step here (1.4 MB over the 200).
  EXPECT_LE(after, before + 16384)
      << "the heap holds " << after - before << " more bytes after recording 200 more steps";
  EXPECT_EQ(named(events_of(path), "aten::linear").size(), 220u);
}

}  // namespace
}  // namespace weft::train

#endif  // WEFT_CUDA
