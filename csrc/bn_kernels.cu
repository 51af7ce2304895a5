// Plain CUDA kernels around the convolutions: per-channel batch statistics, the BN-backward
// reduction after the sm80 dgrad (ReLU mask, Σdz, Σdz·x̂), the sum of the sm90 dgrad epilogue's
// per-tile partials, and the final dx pass. Torch-free; fp32 arithmetic
// for every storage type. Reductions are two-level and deterministic: a fixed grid of row chunks
// writes per-(chunk, channel) partials (combined within a block in a fixed order), and one thread
// per channel combines the chunks in order — no atomics, so results depend only on (M, C).
#include "launchers.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace fused_preact {
namespace {

constexpr int kThreadsC = 32;   // channels per block: one warp reads 32 consecutive channels of a row
constexpr int kThreadsM = 8;    // rows handled concurrently per block
constexpr int kRowsPerChunk = 256;
constexpr int kMaxChunks = 1024;
constexpr int kFinalizeThreads = 128;
constexpr int kElementwiseThreads = 256;

template <typename T>
struct Storage;
template <>
struct Storage<__half> {
  static __device__ __forceinline__ float load(__half const *p) { return __half2float(*p); }
  static __device__ __forceinline__ void store(__half *p, float v) { *p = __float2half_rn(v); }
};
template <>
struct Storage<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 const *p) { return __bfloat162float(*p); }
  static __device__ __forceinline__ void store(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
};
template <>
struct Storage<float> {
  static __device__ __forceinline__ float load(float const *p) { return *p; }
  static __device__ __forceinline__ void store(float *p, float v) { *p = v; }
};

int64_t rows_per_chunk(int64_t M) {
  int const chunks = reduction_chunks(M);
  return (M + chunks - 1) / chunks;
}

// NaN/Inf semantics of the statistics (those of torch.mean / torch.var over the batch, i.e. of the
// float64 reference): a channel holding a NaN has mean = var = NaN; one holding +inf (or -inf) and
// otherwise finite values has mean = +inf (-inf) and var = NaN; +inf together with -inf gives a NaN
// mean. Welford's update alone would turn an infinite running mean into NaN at the next finite value
// (inf + (v - inf)/n), so once a value or a partial mean is non-finite the mean is carried as a plain
// sum (inf + finite = inf, inf - inf = NaN) and M2 becomes NaN. (Eager PyTorch's CUDA batch norm uses
// Welford and may report NaN where this reports ±inf; its normalized output is NaN either way.)

// Welford: add value v to (n, mean, m2).
__device__ __forceinline__ void welford_add(float &n, float &mean, float &m2, float v) {
  n += 1.f;
  if (isfinite(v) && isfinite(mean)) {
    float const delta = v - mean;
    mean += delta / n;
    m2 += delta * (v - mean);
  } else {
    mean = n == 1.f ? v : mean + v;
    m2 = __int_as_float(0x7fc00000);  // NaN
  }
}

// Chan et al.: merge (nb, mean_b, m2_b) into (n, mean, m2). An empty side contributes nothing (also
// no delta^2 * 0 term, which would be NaN for an infinite mean).
template <typename F>
__device__ __forceinline__ void chan_merge(F &n, F &mean, F &m2, F nb, F mean_b, F m2_b) {
  if (nb == F(0)) {
    return;
  }
  if (n == F(0)) {
    n = nb;
    mean = mean_b;
    m2 = m2_b;
    return;
  }
  F const total = n + nb;
  if (!isfinite(mean) || !isfinite(mean_b)) {
    mean = mean + mean_b;
    m2 = F(__int_as_float(0x7fc00000));
    n = total;
    return;
  }
  F const delta = mean_b - mean;
  mean += delta * (nb / total);
  m2 += m2_b + delta * delta * (n * nb / total);
  n = total;
}

// ------------------------------------------------------------------------------- statistics
template <typename T>
__global__ void stats_partial_kernel(T const *__restrict__ x, int64_t M, int C, int64_t chunk_rows,
                                     float *__restrict__ partials) {
  __shared__ float s_n[kThreadsM][kThreadsC];
  __shared__ float s_mean[kThreadsM][kThreadsC];
  __shared__ float s_m2[kThreadsM][kThreadsC];
  int const c = blockIdx.x * kThreadsC + threadIdx.x;
  int64_t const begin = int64_t(blockIdx.y) * chunk_rows;
  int64_t const end = min(M, begin + chunk_rows);
  float n = 0.f, mean = 0.f, m2 = 0.f;
  if (c < C) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kThreadsM) {
      welford_add(n, mean, m2, Storage<T>::load(x + r * C + c));
    }
  }
  s_n[threadIdx.y][threadIdx.x] = n;
  s_mean[threadIdx.y][threadIdx.x] = mean;
  s_m2[threadIdx.y][threadIdx.x] = m2;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int j = 1; j < kThreadsM; ++j) {
      chan_merge(n, mean, m2, s_n[j][threadIdx.x], s_mean[j][threadIdx.x], s_m2[j][threadIdx.x]);
    }
    int64_t const chunks = gridDim.y;
    int64_t const at = int64_t(blockIdx.y) * C + c;
    partials[at] = n;
    partials[chunks * C + at] = mean;
    partials[2 * chunks * C + at] = m2;
  }
}

__global__ void stats_finalize_kernel(float const *__restrict__ partials, int chunks, int C,
                                      float *__restrict__ mean_out, float *__restrict__ var_out) {
  int const c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) {
    return;
  }
  int64_t const plane = int64_t(chunks) * C;
  double n = 0.0, mean = 0.0, m2 = 0.0;
  for (int k = 0; k < chunks; ++k) {
    int64_t const at = int64_t(k) * C + c;
    chan_merge<double>(n, mean, m2, partials[at], partials[plane + at], partials[2 * plane + at]);
  }
  // An empty batch has no statistics: NaN, as a mean over zero elements is in PyTorch.
  mean_out[c] = n > 0.0 ? float(mean) : __int_as_float(0x7fc00000);
  var_out[c] = n > 0.0 ? float(m2 / n) : __int_as_float(0x7fc00000);
}

// ---------------------------------------------------------------------------- BN backward
// ReLU's backward as eager PyTorch computes it, threshold_backward(grad, relu(z), 0) =
// relu(z) <= 0 ? 0 : grad, evaluated on z = x*scale + shift with the fp32 scale/shift (as the Triton
// backend and the float64 reference; not the 16-bit copies CUTLASS 2.x's fprop transform used, which
// would flip the mask wherever |z| is below their rounding error). A NaN z (NaN in x, or a NaN
// statistic) passes the gradient, as relu(NaN) = NaN does in eager; z = -inf blocks it.
__device__ __forceinline__ float relu_backward(float z, float grad) { return z <= 0.f ? 0.f : grad; }

template <typename T>
__global__ void dgrad_reduce_kernel(float const *__restrict__ da, T const *__restrict__ x,
                                    float const *__restrict__ scale, float const *__restrict__ shift,
                                    float const *__restrict__ mean,
                                    float const *__restrict__ invstd, int64_t M, int C, int64_t chunk_rows,
                                    bool write_dx, T *__restrict__ out, float *__restrict__ partials) {
  __shared__ float s_dz[kThreadsM][kThreadsC];
  __shared__ float s_dzx[kThreadsM][kThreadsC];
  int const c = blockIdx.x * kThreadsC + threadIdx.x;
  int64_t const begin = int64_t(blockIdx.y) * chunk_rows;
  int64_t const end = min(M, begin + chunk_rows);
  float sum_dz = 0.f, sum_dzx = 0.f;
  if (c < C) {
    float const s = scale[c];
    float const b = shift[c];
    float const mu = mean[c];
    float const rstd = invstd[c];
    for (int64_t r = begin + threadIdx.y; r < end; r += kThreadsM) {
      int64_t const at = r * C + c;
      float const xv = Storage<T>::load(x + at);
      float const dz = relu_backward(fmaf(xv, s, b), da[at]);
      sum_dz += dz;
      sum_dzx += dz * ((xv - mu) * rstd);
      Storage<T>::store(out + at, write_dx ? s * dz : dz);
    }
  }
  s_dz[threadIdx.y][threadIdx.x] = sum_dz;
  s_dzx[threadIdx.y][threadIdx.x] = sum_dzx;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int j = 1; j < kThreadsM; ++j) {
      sum_dz += s_dz[j][threadIdx.x];
      sum_dzx += s_dzx[j][threadIdx.x];
    }
    int64_t const at = int64_t(blockIdx.y) * C + c;
    partials[at] = sum_dz;
    partials[int64_t(gridDim.y) * C + at] = sum_dzx;
  }
}

// sum_a[c] = Σ_r a[r*ld + c], sum_b[c] likewise, rows in order, in double: deterministic.
__global__ void sum_rows_kernel(float const *__restrict__ a, float const *__restrict__ b, int rows, int64_t ld, int C,
                                float *__restrict__ sum_a, float *__restrict__ sum_b) {
  int const c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) {
    return;
  }
  double sa = 0.0, sb = 0.0;
  for (int k = 0; k < rows; ++k) {
    sa += a[int64_t(k) * ld + c];
    sb += b[int64_t(k) * ld + c];
  }
  sum_a[c] = float(sa);
  sum_b[c] = float(sb);
}

template <typename T, typename DZ>
__global__ void bn_dx_kernel(DZ const *__restrict__ dz, T const *__restrict__ x,
                             float const *__restrict__ scale, float const *__restrict__ mean,
                             float const *__restrict__ invstd, float const *__restrict__ sum_dz,
                             float const *__restrict__ sum_dzx, int64_t M, int C, T *__restrict__ dx) {
  int64_t const total = M * C;
  float const inv_m = 1.f / float(M);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int const c = int(i % C);
    float const xhat = (Storage<T>::load(x + i) - mean[c]) * invstd[c];
    float const v = scale[c] * (Storage<DZ>::load(dz + i) - sum_dz[c] * inv_m - xhat * sum_dzx[c] * inv_m);
    Storage<T>::store(dx + i, v);
  }
}

char const *launch_status() {
  cudaError_t const error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

dim3 reduction_grid(int64_t M, int C) {
  return dim3(unsigned((C + kThreadsC - 1) / kThreadsC), unsigned(reduction_chunks(M)));
}

template <typename T>
char const *batch_stats_impl(void const *x, int64_t M, int C, float *partials, float *mean, float *var,
                             cudaStream_t stream) {
  stats_partial_kernel<T><<<reduction_grid(M, C), dim3(kThreadsC, kThreadsM), 0, stream>>>(
      static_cast<T const *>(x), M, C, rows_per_chunk(M), partials);
  stats_finalize_kernel<<<(C + kFinalizeThreads - 1) / kFinalizeThreads, kFinalizeThreads, 0, stream>>>(
      partials, reduction_chunks(M), C, mean, var);
  return launch_status();
}

void launch_sum_rows(float const *a, float const *b, int rows, int64_t ld, int C, float *sum_a, float *sum_b,
                     cudaStream_t stream) {
  sum_rows_kernel<<<(C + kFinalizeThreads - 1) / kFinalizeThreads, kFinalizeThreads, 0, stream>>>(a, b, rows, ld, C,
                                                                                                   sum_a, sum_b);
}

template <typename T>
char const *dgrad_reduce_impl(float const *da, void const *x, float const *scale, float const *shift,
                              float const *mean, float const *invstd, int64_t M, int C,
                              bool write_dx, void *out, float *partials, float *sum_dz, float *sum_dzx,
                              cudaStream_t stream) {
  dgrad_reduce_kernel<T><<<reduction_grid(M, C), dim3(kThreadsC, kThreadsM), 0, stream>>>(
      da, static_cast<T const *>(x), scale, shift, mean, invstd, M, C, rows_per_chunk(M), write_dx,
      static_cast<T *>(out), partials);
  int const chunks = reduction_chunks(M);
  launch_sum_rows(partials, partials + int64_t(chunks) * C, chunks, C, C, sum_dz, sum_dzx, stream);
  return launch_status();
}

template <typename T, typename DZ>
char const *bn_dx_impl(void const *dz, void const *x, float const *scale, float const *mean,
                       float const *invstd, float const *sum_dz, float const *sum_dzx, int64_t M, int C,
                       void *dx, cudaStream_t stream) {
  int64_t const blocks = std::min<int64_t>((M * C + kElementwiseThreads - 1) / kElementwiseThreads, 65535 * 8);
  bn_dx_kernel<T, DZ><<<unsigned(blocks), kElementwiseThreads, 0, stream>>>(
      static_cast<DZ const *>(dz), static_cast<T const *>(x), scale, mean, invstd, sum_dz, sum_dzx, M, C,
      static_cast<T *>(dx));
  return launch_status();
}

template <typename T>
char const *bn_dx_dispatch(DType dz_dtype, void const *dz, void const *x, float const *scale, float const *mean,
                           float const *invstd, float const *sum_dz, float const *sum_dzx, int64_t M, int C,
                           void *dx, cudaStream_t stream) {
  if (dz_dtype == DType::kFloat32) {
    return bn_dx_impl<T, float>(dz, x, scale, mean, invstd, sum_dz, sum_dzx, M, C, dx, stream);
  }
  return bn_dx_impl<T, T>(dz, x, scale, mean, invstd, sum_dz, sum_dzx, M, C, dx, stream);
}

}  // namespace

int reduction_chunks(int64_t M) {
  int64_t const chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
  return int(std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, chunks)));
}

char const *launch_batch_stats(DType dtype, void const *x, int64_t M, int C, float *partials, float *mean,
                               float *var, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return batch_stats_impl<__half>(x, M, C, partials, mean, var, stream);
    case DType::kBFloat16:
      return batch_stats_impl<__nv_bfloat16>(x, M, C, partials, mean, var, stream);
    case DType::kFloat32:
      return batch_stats_impl<float>(x, M, C, partials, mean, var, stream);
  }
  return "batch_stats: unsupported dtype";
}

char const *launch_dgrad_reduce(DType dtype, float const *da, void const *x, float const *scale, float const *shift,
                                float const *mean, float const *invstd, int64_t M, int C,
                                bool write_dx, void *out, float *partials, float *sum_dz, float *sum_dzx,
                                cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return dgrad_reduce_impl<__half>(da, x, scale, shift, mean, invstd, M, C, write_dx, out,
                                       partials, sum_dz, sum_dzx, stream);
    case DType::kBFloat16:
      return dgrad_reduce_impl<__nv_bfloat16>(da, x, scale, shift, mean, invstd, M, C, write_dx,
                                              out, partials, sum_dz, sum_dzx, stream);
    case DType::kFloat32:
      return dgrad_reduce_impl<float>(da, x, scale, shift, mean, invstd, M, C, write_dx, out,
                                      partials, sum_dz, sum_dzx, stream);
  }
  return "dgrad_reduce: unsupported dtype";
}

char const *launch_sum_partials(float const *partial_a, float const *partial_b, int rows, int ld, int C,
                                float *sum_a, float *sum_b, cudaStream_t stream) {
  launch_sum_rows(partial_a, partial_b, rows, ld, C, sum_a, sum_b, stream);
  return launch_status();
}

char const *launch_bn_dx(DType dtype, DType dz_dtype, void const *dz, void const *x, float const *scale,
                         float const *mean, float const *invstd, float const *sum_dz, float const *sum_dzx, int64_t M,
                         int C, void *dx, cudaStream_t stream) {
  if (dz_dtype != dtype && dz_dtype != DType::kFloat32) {
    return "bn_dx: dz must be float32 or x's dtype";
  }
  switch (dtype) {
    case DType::kFloat16:
      return bn_dx_dispatch<__half>(dz_dtype, dz, x, scale, mean, invstd, sum_dz, sum_dzx, M, C, dx, stream);
    case DType::kBFloat16:
      return bn_dx_dispatch<__nv_bfloat16>(dz_dtype, dz, x, scale, mean, invstd, sum_dz, sum_dzx, M, C, dx, stream);
    case DType::kFloat32:
      return bn_dx_impl<float, float>(dz, x, scale, mean, invstd, sum_dz, sum_dzx, M, C, dx, stream);
  }
  return "bn_dx: unsupported dtype";
}

#define FUSED_PREACT_STRINGIFY_IMPL(...) #__VA_ARGS__
#define FUSED_PREACT_STRINGIFY(...) FUSED_PREACT_STRINGIFY_IMPL(__VA_ARGS__)

char const *compiled_arch_list() {
#ifdef __CUDA_ARCH_LIST__
  return FUSED_PREACT_STRINGIFY(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

}  // namespace fused_preact
