// CUDA kernels of fused.h's RMSNorm, SwiGLU and RoPE (fused_cuda.h): fp32 math, bf16 or fp32
// storage, the formulas of fused_layers.cpp's CPU loops. Each has a scalar form for any shape and
// a vector form (16-byte accesses) for rows of whole vectors at aligned addresses.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "weft/model/fused_cuda.h"

namespace weft::model::cuda {

namespace {

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16(v);
}

// 16 bytes of T, loaded and stored as one vector (V values: 8 bf16, 4 fp32). The kernels below
// have a vector form, taken when rows are whole vectors and pointers 16-byte aligned (the
// model's tensors are): one 16-byte access where the scalar form makes eight (bf16).
template <typename T>
struct alignas(16) Pack {
  static constexpr int V = 16 / static_cast<int>(sizeof(T));
  T v[V];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p, int64_t vector) {
  return reinterpret_cast<const Pack<T>*>(p)[vector];
}
template <typename T>
__device__ __forceinline__ void store_pack(T* p, int64_t vector, const Pack<T>& v) {
  reinterpret_cast<Pack<T>*>(p)[vector] = v;
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaErrorNoKernelImageForDevice)
    throw std::runtime_error(std::string("weft CUDA kernel ") + what +
                             ": not built for this GPU's architecture; rebuild weft with "
                             "-DWEFT_CUDA_ARCHITECTURES=native (scripts/gpu does)");
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("weft CUDA kernel ") + what + ": " +
                             cudaGetErrorString(e));
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The sum of v over the block (every thread gets it). `shared`: kWarps floats.
__device__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read from the last call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float t = 0;
  for (int w = 0; w < kWarps; ++w) t += shared[w];
  return t;
}

// ---- RMSNorm -------------------------------------------------------------------------------

template <typename T>
__global__ void rms_norm_forward_kernel(const T* __restrict x, const float* __restrict w,
                                        T* __restrict y, float* __restrict rstd, int64_t n,
                                        float eps) {
  __shared__ float shared[kWarps];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * n;
  T* yr = y + row * n;
  float ss = 0;
  for (int64_t k = threadIdx.x; k < n; k += kThreads) {
    const float v = load(xr, k);
    ss += v * v;
  }
  const float s = rsqrtf(block_sum(ss, shared) / static_cast<float>(n) + eps);
  if (threadIdx.x == 0) rstd[row] = s;
  for (int64_t k = threadIdx.x; k < n; k += kThreads) store(yr, k, load(xr, k) * s * w[k]);
}

template <typename T>
__global__ void rms_norm_forward_vec_kernel(const T* __restrict x, const float* __restrict w,
                                            T* __restrict y, float* __restrict rstd, int64_t n,
                                            float eps) {
  constexpr int V = Pack<T>::V;
  __shared__ float shared[kWarps];
  const int64_t row = blockIdx.x, nv = n / V;
  const T* xr = x + row * n;
  T* yr = y + row * n;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) {
    const Pack<T> p = load_pack(xr, c);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float v = load(p.v, j);
      ss += v * v;
    }
  }
  const float s = rsqrtf(block_sum(ss, shared) / static_cast<float>(n) + eps);
  if (threadIdx.x == 0) rstd[row] = s;
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) {
    const Pack<T> p = load_pack(xr, c);
    Pack<T> o;
#pragma unroll
    for (int j = 0; j < V; ++j) store(o.v, j, load(p.v, j) * s * w[c * V + j]);
    store_pack(yr, c, o);
  }
}

// Each block takes rows blockIdx.x, blockIdx.x + gridDim.x, ...; each thread keeps its columns'
// Σ g·x̂ in registers (kCols per thread: n ≤ kThreads·kCols) and writes them to its block's row
// of dw_partial at the end.
constexpr int kCols = 32;
constexpr int64_t kMaxRmsNormWidth = static_cast<int64_t>(kThreads) * kCols;

template <typename T>
__global__ void rms_norm_backward_kernel(const T* __restrict x, const T* __restrict g,
                                         const float* __restrict w, const float* __restrict rstd,
                                         T* __restrict dx, float* __restrict dw_partial,
                                         int64_t rows, int64_t n) {
  __shared__ float shared[kWarps];
  float dw[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) dw[c] = 0;
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * n;
    const T* gr = g + row * n;
    const float s = rstd[row];
    float dot = 0;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int64_t k = threadIdx.x + static_cast<int64_t>(c) * kThreads;
      if (k < n) {
        const float xh = load(xr, k) * s, gk = load(gr, k);
        dot += gk * w[k] * xh;
        dw[c] += gk * xh;
      }
    }
    if (dx == nullptr) continue;
    const float mean = block_sum(dot, shared) * inv_n;
    T* dr = dx + row * n;
    for (int64_t k = threadIdx.x; k < n; k += kThreads) {
      const float xh = load(xr, k) * s;
      store(dr, k, s * (load(gr, k) * w[k] - xh * mean));
    }
  }
  if (dw_partial == nullptr) return;
  float* out = dw_partial + static_cast<int64_t>(blockIdx.x) * n;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t k = threadIdx.x + static_cast<int64_t>(c) * kThreads;
    if (k < n) out[k] = dw[c];
  }
}

// The same by vectors: thread t takes vectors t, t + kThreads, ... (kCols / V of them, the same
// kCols registers of Σ g·x̂).
template <typename T>
__global__ void rms_norm_backward_vec_kernel(const T* __restrict x, const T* __restrict g,
                                             const float* __restrict w,
                                             const float* __restrict rstd, T* __restrict dx,
                                             float* __restrict dw_partial, int64_t rows,
                                             int64_t n) {
  constexpr int V = Pack<T>::V, C = kCols / V;
  __shared__ float shared[kWarps];
  float dw[C][V];
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int j = 0; j < V; ++j) dw[c][j] = 0;
  const float inv_n = 1.0f / static_cast<float>(n);
  const int64_t nv = n / V;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * n;
    const T* gr = g + row * n;
    const float s = rstd[row];
    float dot = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t cv = threadIdx.x + static_cast<int64_t>(c) * kThreads;
      if (cv < nv) {
        const Pack<T> xp = load_pack(xr, cv), gp = load_pack(gr, cv);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float xh = load(xp.v, j) * s, gk = load(gp.v, j);
          dot += gk * w[cv * V + j] * xh;
          dw[c][j] += gk * xh;
        }
      }
    }
    if (dx == nullptr) continue;
    const float mean = block_sum(dot, shared) * inv_n;
    T* dr = dx + row * n;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t cv = threadIdx.x + static_cast<int64_t>(c) * kThreads;
      if (cv < nv) {
        const Pack<T> xp = load_pack(xr, cv), gp = load_pack(gr, cv);
        Pack<T> o;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float xh = load(xp.v, j) * s;
          store(o.v, j, s * (load(gp.v, j) * w[cv * V + j] - xh * mean));
        }
        store_pack(dr, cv, o);
      }
    }
  }
  if (dw_partial == nullptr) return;
  float* out = dw_partial + static_cast<int64_t>(blockIdx.x) * n;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int64_t cv = threadIdx.x + static_cast<int64_t>(c) * kThreads;
    if (cv < nv) {
#pragma unroll
      for (int j = 0; j < V; ++j) out[cv * V + j] = dw[c][j];
    }
  }
}

// ---- SwiGLU --------------------------------------------------------------------------------

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + __expf(-v)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict gu, T* __restrict h, int64_t rows,
                                      int64_t f) {
  const int64_t total = rows * f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / f, k = i - r * f;
    const float g = load(gu, r * 2 * f + k), u = load(gu, r * 2 * f + f + k);
    store(h, i, g * sigmoid(g) * u);
  }
}

// d gate = dh·up·σ(g)·(1 + g·(1 − σ(g))), d up = dh·g·σ(g).
template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict gu, const T* __restrict dh,
                                       T* __restrict dgu, int64_t rows, int64_t f) {
  const int64_t total = rows * f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / f, k = i - r * f;
    const int64_t gi = r * 2 * f + k, ui = gi + f;
    const float g = load(gu, gi), u = load(gu, ui), d = load(dh, i);
    const float s = sigmoid(g);
    store(dgu, gi, d * u * s * (1.0f + g * (1.0f - s)));
    store(dgu, ui, d * g * s);
  }
}

// By vectors: blockIdx.y walks the rows (no division per element), x the row's vectors.
template <typename T>
__global__ void swiglu_forward_vec_kernel(const T* __restrict gu, T* __restrict h, int64_t rows,
                                          int64_t f) {
  constexpr int V = Pack<T>::V;
  const int64_t fv = f / V, c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= fv) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = gu + r * 2 * f;
    const Pack<T> gp = load_pack(row, c), up = load_pack(row, fv + c);
    Pack<T> o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = load(gp.v, j);
      store(o.v, j, g * sigmoid(g) * load(up.v, j));
    }
    store_pack(h + r * f, c, o);
  }
}

template <typename T>
__global__ void swiglu_backward_vec_kernel(const T* __restrict gu, const T* __restrict dh,
                                           T* __restrict dgu, int64_t rows, int64_t f) {
  constexpr int V = Pack<T>::V;
  const int64_t fv = f / V, c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= fv) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = gu + r * 2 * f;
    const Pack<T> gp = load_pack(row, c), up = load_pack(row, fv + c);
    const Pack<T> dp = load_pack(dh + r * f, c);
    Pack<T> dg, du;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = load(gp.v, j), u = load(up.v, j), d = load(dp.v, j);
      const float sg = sigmoid(g);
      store(dg.v, j, d * u * sg * (1.0f + g * (1.0f - sg)));
      store(du.v, j, d * g * sg);
    }
    T* out = dgu + r * 2 * f;
    store_pack(out, c, dg);
    store_pack(out, fv + c, du);
  }
}

// ---- RoPE ----------------------------------------------------------------------------------

// One thread per (head row, i < D/2): y[i] = x[i]·c[i] + x[i+h]·r[i], y[i+h] = x[i+h]·c[i+h] +
// x[i]·r[i+h]; backward reads the partner's r at the other half (the adjoint).
template <typename T>
__global__ void rope_kernel(const T* __restrict x, const float* __restrict cos,
                            const float* __restrict rot_sin, T* __restrict y, int64_t S, int64_t H,
                            int64_t D, int64_t xs0, int64_t xs1, int64_t xs2, int64_t ys0,
                            int64_t ys1, int64_t ys2, int64_t total, bool backward) {
  const int64_t h = D / 2;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = t / h, i = t - row * h;
    const int64_t bs = row / H, hh = row - bs * H, b = bs / S, s = bs - b * S;
    const T* xr = x + b * xs0 + s * xs1 + hh * xs2;
    T* yr = y + b * ys0 + s * ys1 + hh * ys2;
    const float* c = cos + bs * D;
    const float* r = rot_sin + bs * D;
    const float a = load(xr, i), v = load(xr, i + h);
    const int64_t lo = backward ? h : 0, hi = backward ? 0 : h;
    store(yr, i, a * c[i] + v * r[i + lo]);
    store(yr, i + h, v * c[i + h] + a * r[i + hi]);
  }
}

// By vectors of V consecutive i (hv = D/2 / V of them per head row), with 32-bit index math
// (the caller checks B·S·H·hv < 2^31).
template <typename T>
__global__ void rope_vec_kernel(const T* __restrict x, const float* __restrict cos,
                                const float* __restrict rot_sin, T* __restrict y, uint32_t S,
                                uint32_t H, uint32_t hv, int64_t D, int64_t xs0, int64_t xs1,
                                int64_t xs2, int64_t ys0, int64_t ys1, int64_t ys2, uint32_t total,
                                bool backward) {
  constexpr int V = Pack<T>::V;
  const int64_t h = D / 2;
  const int64_t lo = backward ? h : 0, hi = backward ? 0 : h;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    const uint32_t row = t / hv, iv = t - row * hv;
    const uint32_t bs = row / H, hh = row - bs * H, b = bs / S, s = bs - b * S;
    const T* xr = x + b * xs0 + s * xs1 + hh * xs2;
    T* yr = y + b * ys0 + s * ys1 + hh * ys2;
    const float* c = cos + static_cast<int64_t>(bs) * D;
    const float* r = rot_sin + static_cast<int64_t>(bs) * D;
    const int64_t i0 = static_cast<int64_t>(iv) * V;
    const Pack<T> ap = load_pack(xr + i0, 0), vp = load_pack(xr + i0 + h, 0);
    Pack<T> ya, yv;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t i = i0 + j;
      const float a = load(ap.v, j), v = load(vp.v, j);
      store(ya.v, j, a * c[i] + v * r[i + lo]);
      store(yv.v, j, v * c[i + h] + a * r[i + hi]);
    }
    store_pack(yr + i0, 0, ya);
    store_pack(yr + i0 + h, 0, yv);
  }
}

int elementwise_blocks(int64_t total) {
  return static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65536));
}

// Blocks of kThreads vectors across a row (x) and rows (y, at most 65535; kernels stride over
// the rest).
dim3 vector_grid(int64_t rows, int64_t vectors) {
  return dim3(static_cast<unsigned>((vectors + kThreads - 1) / kThreads),
              static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
}

template <typename F>
void dispatch(bool bf16, const F& f) {
  if (bf16)
    f(static_cast<__nv_bfloat16*>(nullptr));
  else
    f(static_cast<float*>(nullptr));
}

}  // namespace

int64_t rms_norm_grad_blocks(int64_t rows) { return std::min<int64_t>(rows, 512); }
int64_t rms_norm_max_width() { return kMaxRmsNormWidth; }

void rms_norm_forward(bool bf16, const void* x, const float* w, void* y, float* rstd, int64_t rows,
                      int64_t n, float eps, void* stream) {
  if (rows == 0) return;
  dispatch(bf16, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (n % Pack<T>::V == 0 && aligned(x) && aligned(y))
      rms_norm_forward_vec_kernel<T>
          <<<static_cast<unsigned>(rows), kThreads, 0, as_stream(stream)>>>(
              static_cast<const T*>(x), w, static_cast<T*>(y), rstd, n, eps);
    else
      rms_norm_forward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, as_stream(stream)>>>(
          static_cast<const T*>(x), w, static_cast<T*>(y), rstd, n, eps);
  });
  check_launch("rms_norm_forward");
}

void rms_norm_backward(bool bf16, const void* x, const void* g, const float* w, const float* rstd,
                       void* dx, float* dw_partial, int64_t rows, int64_t n, void* stream) {
  if (n > kMaxRmsNormWidth)
    throw std::runtime_error("weft CUDA rms_norm_backward: rows of " + std::to_string(n) + " > " +
                             std::to_string(kMaxRmsNormWidth));
  if (rows == 0) return;
  dispatch(bf16, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const unsigned blocks = static_cast<unsigned>(rms_norm_grad_blocks(rows));
    if (n % Pack<T>::V == 0 && aligned(x) && aligned(g) && (dx == nullptr || aligned(dx)))
      rms_norm_backward_vec_kernel<T><<<blocks, kThreads, 0, as_stream(stream)>>>(
          static_cast<const T*>(x), static_cast<const T*>(g), w, rstd, static_cast<T*>(dx),
          dw_partial, rows, n);
    else
      rms_norm_backward_kernel<T><<<blocks, kThreads, 0, as_stream(stream)>>>(
          static_cast<const T*>(x), static_cast<const T*>(g), w, rstd, static_cast<T*>(dx),
          dw_partial, rows, n);
  });
  check_launch("rms_norm_backward");
}

void swiglu_forward(bool bf16, const void* gu, void* h, int64_t rows, int64_t f, void* stream) {
  if (rows * f == 0) return;
  dispatch(bf16, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (f % Pack<T>::V == 0 && aligned(gu) && aligned(h))
      swiglu_forward_vec_kernel<T>
          <<<vector_grid(rows, f / Pack<T>::V), kThreads, 0, as_stream(stream)>>>(
              static_cast<const T*>(gu), static_cast<T*>(h), rows, f);
    else
      swiglu_forward_kernel<T><<<elementwise_blocks(rows * f), kThreads, 0, as_stream(stream)>>>(
          static_cast<const T*>(gu), static_cast<T*>(h), rows, f);
  });
  check_launch("swiglu_forward");
}

void swiglu_backward(bool bf16, const void* gu, const void* dh, void* dgu, int64_t rows, int64_t f,
                     void* stream) {
  if (rows * f == 0) return;
  dispatch(bf16, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (f % Pack<T>::V == 0 && aligned(gu) && aligned(dh) && aligned(dgu))
      swiglu_backward_vec_kernel<T>
          <<<vector_grid(rows, f / Pack<T>::V), kThreads, 0, as_stream(stream)>>>(
              static_cast<const T*>(gu), static_cast<const T*>(dh), static_cast<T*>(dgu), rows, f);
    else
      swiglu_backward_kernel<T><<<elementwise_blocks(rows * f), kThreads, 0, as_stream(stream)>>>(
          static_cast<const T*>(gu), static_cast<const T*>(dh), static_cast<T*>(dgu), rows, f);
  });
  check_launch("swiglu_backward");
}

void rope(bool bf16, const void* x, const int64_t* xs, const float* cos, const float* rot_sin,
          void* y, const int64_t* ys, int64_t B, int64_t S, int64_t H, int64_t D, bool backward,
          void* stream) {
  const int64_t total = B * S * H * (D / 2);
  if (total == 0) return;
  dispatch(bf16, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = Pack<T>::V;
    const int64_t hv = D / 2 / V, vectors = B * S * H * hv;
    bool whole = (D / 2) % V == 0 && aligned(x) && aligned(y) && vectors < (int64_t{1} << 31);
    for (int d = 0; d < 3; ++d) whole = whole && xs[d] % V == 0 && ys[d] % V == 0;
    if (whole)
      rope_vec_kernel<T><<<elementwise_blocks(vectors), kThreads, 0, as_stream(stream)>>>(
          static_cast<const T*>(x), cos, rot_sin, static_cast<T*>(y), static_cast<uint32_t>(S),
          static_cast<uint32_t>(H), static_cast<uint32_t>(hv), D, xs[0], xs[1], xs[2], ys[0], ys[1],
          ys[2], static_cast<uint32_t>(vectors), backward);
    else
      rope_kernel<T><<<elementwise_blocks(total), kThreads, 0, as_stream(stream)>>>(
          static_cast<const T*>(x), cos, rot_sin, static_cast<T*>(y), S, H, D, xs[0], xs[1], xs[2],
          ys[0], ys[1], ys[2], total, backward);
  });
  check_launch("rope");
}

}  // namespace weft::model::cuda
