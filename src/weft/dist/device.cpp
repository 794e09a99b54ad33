#include "weft/dist/device.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <chrono>
#include <thread>

#include "weft/core/error.h"

#ifdef WEFT_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace weft::dist {

c10::Device select_device(Device device, int local_rank) {
  if (device == Device::kCpu) return c10::Device(c10::kCPU);
#ifndef WEFT_CUDA
  WEFT_FAIL(
      "train.device = \"cuda\": this weft is built against a CPU-only LibTorch; build it "
      "against a CUDA LibTorch (README, \"On a GPU\") or set train.device = \"cpu\"");
#endif
  WEFT_CHECK(torch::cuda::is_available(),
             "train.device = \"cuda\": no CUDA device is visible to this process (check "
             "nvidia-smi and CUDA_VISIBLE_DEVICES)");
  const int count = static_cast<int>(torch::cuda::device_count());
  WEFT_CHECK(local_rank < count, "train.device = \"cuda\": LOCAL_RANK ", local_rank, " but only ",
             count, " CUDA device(s) are visible: start at most ", count, " ranks per node");
  const c10::Device d(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(d);
  return d;
}

void synchronize(c10::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

int64_t device_peak_bytes(c10::Device device) {
#ifdef WEFT_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[0].peak;  // [0]: every pool together
  }
#endif
  return 0;
}

void reset_device_peak(c10::Device device) {
#ifdef WEFT_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

HostCopy::HostCopy(const at::Tensor& t) {
  if (!t.defined()) return;
  if (t.is_cpu()) {
    host_ = t;
    return;
  }
  host_ = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  host_.copy_(t, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  done_ = std::make_shared<c10::Event>(t.device().type());
  done_->record(impl.getStream(t.device()));
}

bool HostCopy::ready() const { return !done_ || done_->query(); }

const at::Tensor& HostCopy::get() const {
  WEFT_ASSERT(defined(), "HostCopy::get of nothing");
  // LibTorch 1.13's c10::Event cannot block; a poll every 20 us costs nothing beside a step.
  while (!ready()) std::this_thread::sleep_for(std::chrono::microseconds(20));
  return host_;
}

}  // namespace weft::dist
