// Torch-free launcher interface between the op layer (ops.cu) and the kernels (CUTLASS convolutions
// in conv_*.cu, statistics / BN-backward kernels in bn_kernels.cu).
//
// Every tensor is an NHWC view (N, H, W, C contiguous, i.e. a channels_last torch tensor), filters
// are KRSC (a channels_last (K, C, R, S) weight). Launchers only enqueue work on `stream` and return
// nullptr on success or a static message describing why CUTLASS refused the problem.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace fused_preact {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// Geometry of one 2-D convolution x(N,H,W,C) * w(K,R,S,C) -> y(N,P,Q,K).
struct ConvGeometry {
  int N, H, W, C;
  int K, R, S;
  int P, Q;
  int pad_h, pad_w;
  int stride_h, stride_w;
  int dilation_h, dilation_w;
};

// ---------------------------------------------------------------- CUTLASS convolutions (sm80+)
// y = conv(relu(x*scale + shift), w) + bias, scale/shift/bias in the operand dtype, y in `dtype`.
// `bias` may be nullptr. Padded positions contribute zeros of the activated tensor.
const char* launch_fprop_fused(DType dtype, const ConvGeometry& g, const void* x, const void* w,
                               const void* bias, const void* scale, const void* shift, void* y,
                               cudaStream_t stream);

// da(N,H,W,C) fp32 = dgrad(dy(N,P,Q,K), w); every element of da is written.
const char* launch_dgrad(DType dtype, const ConvGeometry& g, const void* dy, const void* w, float* da,
                         cudaStream_t stream);

// Workspace (bytes) launch_wgrad_fused needs for `split_k` serial K-slices (0 when split_k == 1).
size_t wgrad_workspace_bytes(const ConvGeometry& g, int split_k);

// dw(K,R,S,C) fp32 = wgrad(dy, relu(x*scale + shift)), reduced over `split_k` serial slices.
// `workspace` holds wgrad_workspace_bytes(g, split_k) bytes (nullptr when 0); it is cleared on
// `stream` before use.
const char* launch_wgrad_fused(DType dtype, const ConvGeometry& g, const void* dy, const void* x,
                               const void* scale, const void* shift, float* dw, int split_k,
                               void* workspace, cudaStream_t stream);

// ------------------------------------------------------------------ statistics and BN backward
// Rows are the M = N*H*W positions, columns the C channels of an (M, C) row-major view.
// Number of row chunks of the deterministic two-level reductions; depends on M only.
int reduction_chunks(int64_t M);

// Per-channel mean and biased variance (fp32) of x; `partials` holds 3*chunks*C floats.
const char* launch_batch_stats(DType dtype, const void* x, int64_t M, int C, float* partials,
                               float* mean, float* var, cudaStream_t stream);

// dz = da*[x*scale + shift > 0] with the fp32 scale/shift (the specified function's ReLU mask, as the
// Triton backend evaluates it), Σdz and Σdz·x̂ per channel with x̂ = (x - mean)*invstd.
// write_dx == false: dz (fp32) overwrites da in place.  write_dx == true (eval): dx = scale*dz is
// written to `dx` in `dtype` and da is left unchanged. `partials` holds 2*chunks*C floats.
const char* launch_dgrad_reduce(DType dtype, float* da, const void* x, const float* scale, const float* shift,
                                const float* mean, const float* invstd, int64_t M, int C, bool write_dx,
                                void* dx, float* partials, float* sum_dz, float* sum_dzx, cudaStream_t stream);

// dx = scale*(dz - Σdz/M - x̂·Σdz·x̂/M) in `dtype`.
const char* launch_bn_dx(DType dtype, const float* dz, const void* x, const float* scale,
                         const float* mean, const float* invstd, const float* sum_dz,
                         const float* sum_dzx, int64_t M, int C, void* dx, cudaStream_t stream);

// The architectures this library was compiled for (nvcc's __CUDA_ARCH_LIST__), e.g. "800,900".
const char* compiled_arch_list();

// The CUTLASS version the convolutions were built against, e.g. "4.2.0".
const char* cutlass_version();

}  // namespace fused_preact
