// CUDA kernels of fused.h's RMSNorm, SwiGLU and RoPE (fused_cuda.h): fp32 math, bf16 or fp32
// storage, the formulas of fused_layers.cpp's CPU loops. Each kernel moves V values per access:
// 16 bytes (V = 8 bf16, 4 fp32) where rows are whole vectors at aligned addresses (the model's
// tensors are), one value (V = 1) for any other shape; the same code either way.
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

// V consecutive values of T, loaded and stored as one access.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Pack `vector` of p (p + vector·V must be aligned to the pack).
template <int V, typename T>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p, int64_t vector) {
  return reinterpret_cast<const Pack<T, V>*>(p)[vector];
}
template <int V, typename T>
__device__ __forceinline__ void store_pack(T* p, int64_t vector, const Pack<T, V>& v) {
  reinterpret_cast<Pack<T, V>*>(p)[vector] = v;
}

// The widest pack: 16 bytes.
template <typename T>
constexpr int kWide = 16 / static_cast<int>(sizeof(T));

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

// One block per row.
template <typename T, int V>
__global__ void rms_norm_forward_kernel(const T* __restrict x, const float* __restrict w,
                                        T* __restrict y, float* __restrict rstd, int64_t n,
                                        float eps) {
  __shared__ float shared[kWarps];
  const int64_t row = blockIdx.x, nv = n / V;
  const T* xr = x + row * n;
  T* yr = y + row * n;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) {
    const Pack<T, V> p = load_pack<V>(xr, c);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float v = load(p.v, j);
      ss += v * v;
    }
  }
  const float s = rsqrtf(block_sum(ss, shared) / static_cast<float>(n) + eps);
  if (threadIdx.x == 0) rstd[row] = s;
  for (int64_t c = threadIdx.x; c < nv; c += kThreads) {
    const Pack<T, V> p = load_pack<V>(xr, c);
    Pack<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) store(o.v, j, load(p.v, j) * s * w[c * V + j]);
    store_pack<V>(yr, c, o);
  }
}

// Each block takes rows blockIdx.x, blockIdx.x + gridDim.x, ...; thread t takes vectors t,
// t + kThreads, ... of each (kCols / V of them) and keeps their Σ g·x̂ in registers (kCols per
// thread: n ≤ kThreads·kCols), written to its block's row of dw_partial at the end.
constexpr int kCols = 32;
constexpr int64_t kMaxRmsNormWidth = static_cast<int64_t>(kThreads) * kCols;

template <typename T, int V>
__global__ void rms_norm_backward_kernel(const T* __restrict x, const T* __restrict g,
                                         const float* __restrict w, const float* __restrict rstd,
                                         T* __restrict dx, float* __restrict dw_partial,
                                         int64_t rows, int64_t n) {
  constexpr int C = kCols / V;
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
        const Pack<T, V> xp = load_pack<V>(xr, cv), gp = load_pack<V>(gr, cv);
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
        const Pack<T, V> xp = load_pack<V>(xr, cv), gp = load_pack<V>(gr, cv);
        Pack<T, V> o;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float xh = load(xp.v, j) * s;
          store(o.v, j, s * (load(gp.v, j) * w[cv * V + j] - xh * mean));
        }
        store_pack<V>(dr, cv, o);
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

// blockIdx.y walks the rows (no division per element), x the vectors of a row.
template <typename T, int V>
__global__ void swiglu_forward_kernel(const T* __restrict gu, T* __restrict h, int64_t rows,
                                      int64_t f) {
  const int64_t fv = f / V, c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= fv) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = gu + r * 2 * f;
    const Pack<T, V> gp = load_pack<V>(row, c), up = load_pack<V>(row, fv + c);
    Pack<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = load(gp.v, j);
      store(o.v, j, g * sigmoid(g) * load(up.v, j));
    }
    store_pack<V>(h + r * f, c, o);
  }
}

// d gate = dh·up·σ(g)·(1 + g·(1 − σ(g))), d up = dh·g·σ(g).
template <typename T, int V>
__global__ void swiglu_backward_kernel(const T* __restrict gu, const T* __restrict dh,
                                       T* __restrict dgu, int64_t rows, int64_t f) {
  const int64_t fv = f / V, c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= fv) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = gu + r * 2 * f;
    const Pack<T, V> gp = load_pack<V>(row, c), up = load_pack<V>(row, fv + c);
    const Pack<T, V> dp = load_pack<V>(dh + r * f, c);
    Pack<T, V> dg, du;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = load(gp.v, j), u = load(up.v, j), d = load(dp.v, j);
      const float sg = sigmoid(g);
      store(dg.v, j, d * u * sg * (1.0f + g * (1.0f - sg)));
      store(du.v, j, d * g * sg);
    }
    T* out = dgu + r * 2 * f;
    store_pack<V>(out, c, dg);
    store_pack<V>(out, fv + c, du);
  }
}

// ---- RoPE ----------------------------------------------------------------------------------

// One thread per (head row, vector of V consecutive i < D/2): y[i] = x[i]·c[i] + x[i+h]·r[i],
// y[i+h] = x[i+h]·c[i+h] + x[i]·r[i+h]; backward reads the partner's r at the other half (the
// adjoint). I: the index type of the thread's position (32-bit where B·S·H·(D/2)/V fits).
template <typename T, int V, typename I>
__global__ void rope_kernel(const T* __restrict x, const float* __restrict cos,
                            const float* __restrict rot_sin, T* __restrict y, I S, I H, I hv,
                            int64_t D, int64_t xs0, int64_t xs1, int64_t xs2, int64_t ys0,
                            int64_t ys1, int64_t ys2, I total, bool backward) {
  const int64_t h = D / 2;
  const int64_t lo = backward ? h : 0, hi = backward ? 0 : h;
  for (I t = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<I>(gridDim.x) * blockDim.x) {
    const I row = t / hv, iv = t - row * hv;
    const I bs = row / H, hh = row - bs * H, b = bs / S, s = bs - b * S;
    const T* xr = x + b * xs0 + s * xs1 + hh * xs2;
    T* yr = y + b * ys0 + s * ys1 + hh * ys2;
    const float* c = cos + static_cast<int64_t>(bs) * D;
    const float* r = rot_sin + static_cast<int64_t>(bs) * D;
    const int64_t i0 = static_cast<int64_t>(iv) * V;
    const Pack<T, V> ap = load_pack<V>(xr + i0, 0), vp = load_pack<V>(xr + i0 + h, 0);
    Pack<T, V> ya, yv;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t i = i0 + j;
      const float a = load(ap.v, j), v = load(vp.v, j);
      store(ya.v, j, a * c[i] + v * r[i + lo]);
      store(yv.v, j, v * c[i + h] + a * r[i + hi]);
    }
    store_pack<V>(yr + i0, 0, ya);
    store_pack<V>(yr + i0 + h, 0, yv);
  }
}

int elementwise_blocks(int64_t total) {
  return static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65536));
}

// Blocks of kThreads vectors across a row (x) and rows (y, at most 65535; kernels stride over
// the rest).
dim3 row_grid(int64_t rows, int64_t vectors) {
  return dim3(static_cast<unsigned>((vectors + kThreads - 1) / kThreads),
              static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
}

// f(T*, std::integral_constant<int, V>) with T the storage type and V the widest pack that
// `whole(V)` allows: kWide<T>, else 1.
template <typename W, typename F>
void dispatch(bool bf16, const W& whole, const F& f) {
  auto as = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (whole(kWide<T>))
      f(tag, std::integral_constant<int, kWide<T>>());
    else
      f(tag, std::integral_constant<int, 1>());
  };
  if (bf16)
    as(static_cast<__nv_bfloat16*>(nullptr));
  else
    as(static_cast<float*>(nullptr));
}

}  // namespace

int64_t rms_norm_grad_blocks(int64_t rows) { return std::min<int64_t>(rows, 512); }
int64_t rms_norm_max_width() { return kMaxRmsNormWidth; }

void rms_norm_forward(bool bf16, const void* x, const float* w, void* y, float* rstd, int64_t rows,
                      int64_t n, float eps, void* stream) {
  if (rows == 0) return;
  auto whole = [&](int v) { return n % v == 0 && aligned(x) && aligned(y); };
  dispatch(bf16, whole, [&](auto* tag, auto width) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_forward_kernel<T, width()>
        <<<static_cast<unsigned>(rows), kThreads, 0, as_stream(stream)>>>(
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
  auto whole = [&](int v) {
    return n % v == 0 && aligned(x) && aligned(g) && (dx == nullptr || aligned(dx));
  };
  dispatch(bf16, whole, [&](auto* tag, auto width) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_backward_kernel<T, width()>
        <<<static_cast<unsigned>(rms_norm_grad_blocks(rows)), kThreads, 0, as_stream(stream)>>>(
            static_cast<const T*>(x), static_cast<const T*>(g), w, rstd, static_cast<T*>(dx),
            dw_partial, rows, n);
  });
  check_launch("rms_norm_backward");
}

void swiglu_forward(bool bf16, const void* gu, void* h, int64_t rows, int64_t f, void* stream) {
  if (rows * f == 0) return;
  auto whole = [&](int v) { return f % v == 0 && aligned(gu) && aligned(h); };
  dispatch(bf16, whole, [&](auto* tag, auto width) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_forward_kernel<T, width()>
        <<<row_grid(rows, f / width()), kThreads, 0, as_stream(stream)>>>(
            static_cast<const T*>(gu), static_cast<T*>(h), rows, f);
  });
  check_launch("swiglu_forward");
}

void swiglu_backward(bool bf16, const void* gu, const void* dh, void* dgu, int64_t rows, int64_t f,
                     void* stream) {
  if (rows * f == 0) return;
  auto whole = [&](int v) { return f % v == 0 && aligned(gu) && aligned(dh) && aligned(dgu); };
  dispatch(bf16, whole, [&](auto* tag, auto width) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_backward_kernel<T, width()>
        <<<row_grid(rows, f / width()), kThreads, 0, as_stream(stream)>>>(
            static_cast<const T*>(gu), static_cast<const T*>(dh), static_cast<T*>(dgu), rows, f);
  });
  check_launch("swiglu_backward");
}

void rope(bool bf16, const void* x, const int64_t* xs, const float* cos, const float* rot_sin,
          void* y, const int64_t* ys, int64_t B, int64_t S, int64_t H, int64_t D, bool backward,
          void* stream) {
  if (B * S * H * (D / 2) == 0) return;
  auto whole = [&](int v) {
    bool ok = (D / 2) % v == 0 && aligned(x) && aligned(y);
    for (int d = 0; d < 3; ++d) ok = ok && xs[d] % v == 0 && ys[d] % v == 0;
    return ok;
  };
  dispatch(bf16, whole, [&](auto* tag, auto width) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = width();
    const int64_t hv = D / 2 / V, total = B * S * H * hv;
    auto launch = [&](auto index) {
      using I = decltype(index);
      rope_kernel<T, V, I><<<elementwise_blocks(total), kThreads, 0, as_stream(stream)>>>(
          static_cast<const T*>(x), cos, rot_sin, static_cast<T*>(y), static_cast<I>(S),
          static_cast<I>(H), static_cast<I>(hv), D, xs[0], xs[1], xs[2], ys[0], ys[1], ys[2],
          static_cast<I>(total), backward);
    };
    if (total < (int64_t{1} << 31))
      launch(uint32_t{0});
    else
      launch(int64_t{0});
  });
  check_launch("rope");
}

}  // namespace weft::model::cuda
