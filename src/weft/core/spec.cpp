// Names of the Spec enums; these are also the spellings the config accepts and writes.
#include "weft/core/spec.h"

namespace weft {

const char* to_string(Activation a) {
  switch (a) {
    case Activation::kGelu:
      return "gelu";
    case Activation::kQuickGelu:
      return "quick_gelu";
    case Activation::kGeluTanh:
      return "gelu_tanh";
  }
  return "unknown";
}

const char* to_string(EncoderKind k) {
  switch (k) {
    case EncoderKind::kVit:
      return "vit";
    case EncoderKind::kWhisper:
      return "whisper";
  }
  return "unknown";
}

const char* to_string(ProjectorKind k) {
  switch (k) {
    case ProjectorKind::kLinear:
      return "linear";
    case ProjectorKind::kMlp:
      return "mlp";
  }
  return "unknown";
}

const char* to_string(NonFinite n) { return n == NonFinite::kStop ? "stop" : "skip"; }
const char* to_string(Device d) { return d == Device::kCpu ? "cpu" : "cuda"; }
const char* to_string(EvalGeneration g) {
  return g == EvalGeneration::kGather ? "gather" : "layout";
}

const char* to_string(Precision p) {
  switch (p) {
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp32:
      return "fp32";
  }
  return "unknown";
}

}  // namespace weft
