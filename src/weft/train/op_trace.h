// The operators of a stretch of work as a Chrome / Perfetto trace, each with its input shapes
// ("Input Dims", as Kineto writes them): `weft bench step --profile` and `weft train
// --trace-ops` (every rank's operators in the traced step). bench/trace_summary.py summarises one.
// Besides LibTorch's operators it holds every RecordFunction range: the runtime's step ops
// (dist/runtime.cpp's spans, "llm fwd mb0 s0") and weft's own kernels, collectives and waits
// ("weft::rms_norm", "weft::reduce_from", "weft::wait all_reduce_sum").
#pragma once

#include <string>

namespace weft::train {

// Records from construction to destruction, then writes `path` (through a temporary file; its
// directory made if missing). CUDA builds record through Kineto (CUPTI): the operators and the
// GPU kernels they launched, with their device times (synchronise the device before the end).
// CPU builds record through weft's own RecordFunction callback: the operators' CPU times, with
// asynchronous ones (Gloo's collectives) in category "async", kept in memory mapped apart from the
// heap so that the traced work allocates as it does untraced (op_trace.cpp). One at a time per
// process (a second is an Error). A failed write is reported on stderr, not thrown.
class OpTrace {
 public:
  explicit OpTrace(std::string path);
  ~OpTrace();
  OpTrace(const OpTrace&) = delete;
  OpTrace& operator=(const OpTrace&) = delete;

 private:
  std::string path_;
};

}  // namespace weft::train
