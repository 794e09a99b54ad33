// The CUDA kernels behind fused.h's RMSNorm, SwiGLU and RoPE (fused_cuda.cu, built only against
// a CUDA LibTorch): the same math as the CPU loops of fused_layers.cpp (fp32 inside, one pass
// over the activations each way), on raw device pointers and a stream, so this header and the
// .cu file need no LibTorch header. T is float or bf16 (`bf16` = true); pointers are device
// memory; `stream` is a cudaStream_t. A failed launch throws std::runtime_error.
#pragma once

#include <cstdint>

namespace weft::model::cuda {

// y = x·rsqrt(mean(x²) + eps)·w over rows of n; rstd[r] = that rsqrt. w: fp32 [n].
void rms_norm_forward(bool bf16, const void* x, const float* w, void* y, float* rstd, int64_t rows,
                      int64_t n, float eps, void* stream);
// dx = rstd·(g·w − x̂·mean(g·w·x̂)) (dx may be null); dw_partial (may be null): fp32
// [rms_norm_grad_blocks(rows), n], each block of rows' Σ g·x̂ (the caller sums over dim 0: a fixed
// order, so the result is deterministic).
int64_t rms_norm_grad_blocks(int64_t rows);
// The widest row the backward takes (its per-thread parameter-gradient registers).
int64_t rms_norm_max_width();
void rms_norm_backward(bool bf16, const void* x, const void* g, const float* w, const float* rstd,
                       void* dx, float* dw_partial, int64_t rows, int64_t n, void* stream);

// h = silu(gate)·up over rows of gate_up [2f] (gate first), h [f]; and its gradient into
// dgu [2f].
void swiglu_forward(bool bf16, const void* gu, void* h, int64_t rows, int64_t f, void* stream);
void swiglu_backward(bool bf16, const void* gu, const void* dh, void* dgu, int64_t rows, int64_t f,
                     void* stream);

// RoPE over B·S·H head rows of D: y = x·cos + roll(x, D/2)·rot_sin (backward: its adjoint).
// x and y strided by (b, s, h) with a contiguous last dim (xs, ys: 3 strides each); cos and
// rot_sin fp32 [B, S, D] contiguous.
void rope(bool bf16, const void* x, const int64_t* xs, const float* cos, const float* rot_sin,
          void* y, const int64_t* ys, int64_t B, int64_t S, int64_t H, int64_t D, bool backward,
          void* stream);

}  // namespace weft::model::cuda
