#include "weft/train/op_trace.h"

#include <ATen/record_function.h>
#include <sys/mman.h>
#ifdef WEFT_CUDA
#include <torch/csrc/autograd/profiler_kineto.h>
#endif
#include <torch/torch.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>

#include "weft/core/error.h"
#include "weft/io/files.h"

namespace weft::train {

namespace {

#ifndef WEFT_CUDA
// The CPU recorder: a RecordFunction callback writing each operator's start, end, thread and
// input shapes into memory mapped apart from the heap, with no allocation while it records.
// LibTorch's autograd profiler allocates its events as it goes, on the heap: those small blocks
// land in the free space a step's large tensors reuse, so each large tensor then takes fresh
// pages at the heap's top and faults them in. Measured on tiny-vlm here: its traced step took
// 2.0x the untraced one (now 1.15x), the ViT stem's convolution backward 46 ms (now 5); a buffer
// reserved on the heap before the step did as badly, taking that free space itself.

// A fixed-capacity array in its own anonymous mapping: pages are taken as they are first written
// and handed back, zero again, by clear().
template <typename T>
class Mapped {
 public:
  explicit Mapped(size_t capacity) : capacity_(capacity) {
    void* p = mmap(nullptr, bytes(), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    WEFT_CHECK(p != MAP_FAILED, "operator trace: could not map ", bytes(),
               " bytes: ", std::strerror(errno));
    data_ = static_cast<T*>(p);
  }
  ~Mapped() { munmap(data_, bytes()); }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;

  size_t size() const { return size_; }
  bool full() const { return size_ == capacity_; }
  bool push(const T& v) {
    if (full()) return false;
    data_[size_++] = v;
    return true;
  }
  void truncate(size_t n) { size_ = n; }
  void erase(size_t i) {  // order kept
    std::memmove(data_ + i, data_ + i + 1, (size_ - i - 1) * sizeof(T));
    --size_;
  }
  T& operator[](size_t i) { return data_[i]; }  // any i below the capacity (unwritten: zero)
  const T& operator[](size_t i) const { return data_[i]; }
  void clear() {
    madvise(data_, bytes(), MADV_DONTNEED);
    size_ = 0;
  }

 private:
  size_t bytes() const { return capacity_ * sizeof(T); }
  T* data_ = nullptr;
  size_t capacity_, size_ = 0;
};

struct Recorder {
  struct Op {
    uint32_t name;  // offset in `chars`
    uint32_t name_length;
    uint64_t thread;
    double start, end;  // seconds; end < 0: still running when the trace stopped
    uint32_t dims;      // shapes: per input, its rank then its sizes (rank -1: not a tensor)
    uint32_t ndims;
    bool async;
    bool user;  // a user-scope range (the runtime's step ops)
  };
  struct Open {                    // an operator started and not ended
    const at::RecordFunction* fn;  // its record (unset handles are all 0), alive until its end
    size_t op;
  };
  static constexpr size_t kSlots = size_t{1} << 14;  // distinct operator names, at most
  std::mutex mu;
  bool active = false;
  at::CallbackHandle callback = 0;
  Mapped<Op> ops{size_t{1} << 20};
  Mapped<int64_t> dims{size_t{1} << 23};
  Mapped<char> chars{size_t{1} << 22};
  Mapped<uint64_t> slots{kSlots};  // open addressing: (offset in chars + 1) << 32 | length
  Mapped<Open> open{size_t{1} << 14};
  size_t dropped = 0;

  // The name's offset in `chars`, stored on first sight; false when the tables are full.
  bool intern(std::string_view name, uint32_t* offset) {
    size_t i = std::hash<std::string_view>{}(name) % kSlots;
    for (size_t probe = 0; probe < kSlots; ++probe, i = (i + 1) % kSlots) {
      const uint64_t slot = slots[i];
      if (slot == 0) {
        const size_t at = chars.size();
        for (char c : name)
          if (!chars.push(c)) {
            chars.truncate(at);
            return false;
          }
        slots[i] = (static_cast<uint64_t>(at) + 1) << 32 | name.size();
        *offset = static_cast<uint32_t>(at);
        return true;
      }
      const size_t at = (slot >> 32) - 1, length = slot & 0xffffffffu;
      if (length == name.size() && std::memcmp(&chars[at], name.data(), length) == 0) {
        *offset = static_cast<uint32_t>(at);
        return true;
      }
    }
    return false;
  }
  void clear() {
    ops.clear();
    dims.clear();
    chars.clear();
    slots.clear();
    open.clear();
    dropped = 0;
  }
};

// Callbacks are plain function pointers: the one recorder lives for the process (one OpTrace at
// a time), never destroyed, as an asynchronous operator (a Gloo collective) may end after it.
Recorder& recorder() {
  static Recorder* r = new Recorder;
  return *r;
}

double clock_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::unique_ptr<at::ObserverContext> op_started(const at::RecordFunction& fn) {
  const double t = clock_seconds();
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.active) return nullptr;
  Recorder::Op op{};
  const std::string_view name = fn.name();
  bool room = !r.ops.full() && !r.open.full() && r.intern(name, &op.name);
  op.name_length = static_cast<uint32_t>(name.size());
  op.thread = fn.threadId();
  op.start = t;
  op.end = -1;
  op.async = fn.isAsync();
  op.user = fn.scope() == at::RecordScope::USER_SCOPE;
  op.dims = static_cast<uint32_t>(r.dims.size());
  for (const c10::IValue& v : fn.inputs()) {
    if (!room) break;
    if (!v.isTensor() || !v.toTensor().defined()) {
      room = r.dims.push(-1);
      continue;
    }
    const at::IntArrayRef sizes = v.toTensor().sizes();
    room = r.dims.push(static_cast<int64_t>(sizes.size()));
    for (int64_t d : sizes) room = room && r.dims.push(d);
  }
  if (!room) {
    r.dims.truncate(op.dims);
    ++r.dropped;
    return nullptr;
  }
  op.ndims = static_cast<uint32_t>(r.dims.size()) - op.dims;
  r.open.push({&fn, r.ops.size()});
  r.ops.push(op);
  return nullptr;  // no context: nothing allocated per operator
}

void op_ended(const at::RecordFunction& fn, at::ObserverContext*) {
  const double t = clock_seconds();
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.active) return;
  for (size_t i = r.open.size(); i-- > 0;)  // the innermost first: nested operators end in order
    if (r.open[i].fn == &fn) {
      Recorder::Op& op = r.ops[r.open[i].op];
      op.end = t;
      op.async = op.async || fn.isAsync();  // c10d marks its work asynchronous after the start
      r.open.erase(i);
      return;
    }
}

// The recorded operators as complete ("X") events, times in microseconds from the first start.
// Asynchronous ones (in flight while other work runs: Gloo's collectives) are in category
// "async", apart from the "cpu_op" nesting, and user-scope ranges in "user_annotation" (as Kineto
// puts them); one still running at the end ends there.
nlohmann::json recorded_events(const Recorder& r, double stopped) {
  using nlohmann::json;
  double t0 = stopped;
  for (size_t i = 0; i < r.ops.size(); ++i) t0 = std::min(t0, r.ops[i].start);
  json events = json::array();
  for (size_t i = 0; i < r.ops.size(); ++i) {
    const Recorder::Op& op = r.ops[i];
    json shapes = json::array();
    for (size_t k = op.dims; k < op.dims + op.ndims;) {
      const int64_t rank = r.dims[k++];
      json shape = json::array();
      for (int64_t d = 0; d < rank; ++d) shape.push_back(r.dims[k++]);
      shapes.push_back(std::move(shape));
    }
    const double end = op.end < 0 ? stopped : op.end;
    events.push_back({{"ph", "X"},
                      {"cat", op.async  ? "async"
                              : op.user ? "user_annotation"
                                        : "cpu_op"},
                      {"name", std::string(&r.chars[op.name], op.name_length)},
                      {"pid", 0},
                      {"tid", op.thread},
                      {"ts", (op.start - t0) * 1e6},
                      {"dur", (end - op.start) * 1e6},
                      {"args", {{"Input Dims", std::move(shapes)}}}});
  }
  return events;
}
#endif

}  // namespace

OpTrace::OpTrace(std::string path) : path_(std::move(path)) {
#ifdef WEFT_CUDA
  namespace impl = torch::profiler::impl;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/true);
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU, impl::ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
#else
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  WEFT_CHECK(!r.active, "an operator trace is already recording (one at a time per process)");
  r.active = true;
  r.callback = at::addThreadLocalCallback(
      at::RecordFunctionCallback(op_started, op_ended).needsInputs(true));
#endif
}

OpTrace::~OpTrace() {
  try {  // a destructor: a failed save is reported, not thrown
#ifdef WEFT_CUDA
    const auto result = torch::autograd::profiler::disableProfiler();
#else
    Recorder& r = recorder();
    at::removeCallback(r.callback);
    nlohmann::json events;
    size_t dropped = 0;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      r.active = false;
      events = recorded_events(r, clock_seconds());
      dropped = r.dropped;
      r.clear();
    }
    if (dropped > 0)
      std::fprintf(stderr,
                   "weft: the operator trace %s left out %zu operators (over its capacity)\n",
                   path_.c_str(), dropped);
#endif
    const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
#ifdef WEFT_CUDA
    result->save(path_);
#else
    io::write_text_file(path_, nlohmann::json{{"traceEvents", std::move(events)}}.dump());
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weft: could not write the operator trace %s: %s\n", path_.c_str(),
                 e.what());
  }
}

}  // namespace weft::train
