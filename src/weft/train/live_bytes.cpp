#include "weft/train/live_bytes.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>

namespace weft::train {
namespace {

// The type of the hook's running totals: int64_t on LibTorch 1.13, size_t on 2.x (read off c10's
// own reporting function, so no version number is guessed).
template <class>
struct TotalsArg;
template <class R, class A0, class A1, class A2, class A3, class A4>
struct TotalsArg<R (*)(A0, A1, A2, A3, A4)> {
  using type = A2;
};
using TotalBytes = TotalsArg<decltype(&c10::reportMemoryUsageToProfiler)>::type;

class Meter final : public c10::MemoryReportingInfoBase {
 public:
  explicit Meter(c10::Device device) : device_(device) {}
  void reportMemoryUsage(void*, int64_t alloc_size, TotalBytes, TotalBytes,
                         c10::Device device) override {
    if (device.type() != device_.type()) return;
    live_ += alloc_size;
    peak_ = std::max(peak_, live_);
  }
  bool memoryProfilingEnabled() const override { return true; }

  c10::Device device_;
  int64_t live_ = 0, peak_ = 0;
};

}  // namespace

struct LiveBytes::Impl {
  std::shared_ptr<Meter> meter;
  c10::DebugInfoGuard guard;
  explicit Impl(std::shared_ptr<Meter> m)
      : meter(m), guard(c10::DebugInfoKind::PROFILER_STATE, std::move(m)) {}
};

LiveBytes::LiveBytes(c10::Device device)
    : impl_(std::make_unique<Impl>(std::make_shared<Meter>(device))) {}
LiveBytes::~LiveBytes() = default;
int64_t LiveBytes::live() const { return impl_->meter->live_; }
int64_t LiveBytes::peak() const { return impl_->meter->peak_; }
void LiveBytes::reset_peak() { impl_->meter->peak_ = impl_->meter->live_; }

}  // namespace weft::train
