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

// ------------------------------------------------------------- CUTLASS 3.x convolutions (sm_90a)
// Built from the sm90_*.cu sources for sm_90a only; without a 9.0 target they are stubs that return
// an error and sm90_kernels_built() is false. The op layer uses them on compute capability 9.0.
bool sm90_kernels_built();

// The sm90 launchers return exactly this pointer when CUTLASS's can_implement declines the problem
// (nothing was launched); the op layer then runs the CUTLASS 2.x kernels instead.
extern const char kSm90Unsupported[];

// y = conv(relu(x*scale + shift), w) + bias + residual with fp32 scale/shift (C,); `bias` (K,) in
// `dtype` and `residual` (N,P,Q,K) in `dtype` may be nullptr.
const char* launch_fprop_fused_sm90(DType dtype, const ConvGeometry& g, const void* x, const void* w,
                                    const void* bias, const void* residual, const float* scale,
                                    const float* shift, void* y, cudaStream_t stream);

// dgrad with the BN/ReLU backward in the epilogue (unit stride and dilation only): out (N,H,W,C) in
// `dtype` = dz = (x*scale + shift <= 0 ? 0 : dgrad(dy, w)), or scale*dz when eval_dx; per-CTA partial
// column sums of dz and dz*(x - mean)*invstd into partial_dz / partial_dzx, each a row-major fp32
// (rows, ld) buffer with (rows, ld) from sm90_dgrad_partials_shape (columns >= C are padding).
void sm90_dgrad_partials_shape(const ConvGeometry& g, int* rows, int* ld);
const char* launch_dgrad_bn_sm90(DType dtype, const ConvGeometry& g, const void* dy, const void* w, const void* x,
                                 const float* scale, const float* shift, const float* mean, const float* invstd,
                                 bool eval_dx, void* out, float* partial_dz, float* partial_dzx, cudaStream_t stream);

// dw(K,R,S,C) fp32 = wgrad(dy, relu(x*scale + shift)) with fp32 scale/shift, over `splits` slices of
// the N*P*Q reduction (each CTA slice writes an fp32 partial into `workspace`, then the partials are
// summed in slice order into dw). `workspace` holds sm90_wgrad_workspace_bytes(g, splits) bytes.
int sm90_wgrad_splits(const ConvGeometry& g, int sm_count);
size_t sm90_wgrad_workspace_bytes(const ConvGeometry& g, int splits);
const char* launch_wgrad_fused_sm90(DType dtype, const ConvGeometry& g, const void* dy, const void* x,
                                    const float* scale, const float* shift, float* dw, int splits, void* workspace,
                                    cudaStream_t stream);

// ------------------------------------------------------------------ statistics and BN backward
// Rows are the M = N*H*W positions, columns the C channels of an (M, C) row-major view.
// Number of row chunks of the deterministic two-level reductions; depends on M only.
int reduction_chunks(int64_t M);

// Per-channel mean and biased variance (fp32) of x; `partials` holds 3*chunks*C floats.
const char* launch_batch_stats(DType dtype, const void* x, int64_t M, int C, float* partials,
                               float* mean, float* var, cudaStream_t stream);

// dz = (x*scale + shift <= 0 ? 0 : da) with the fp32 scale/shift (eager's ReLU backward,
// threshold_backward on relu(z): a NaN z passes da), Σdz and Σdz·x̂ per channel with
// x̂ = (x - mean)*invstd. Writes `out` in `dtype`: dz, or dx = scale*dz when write_dx (eval); da is
// read only. `partials` holds 2*chunks*C floats.
const char* launch_dgrad_reduce(DType dtype, const float* da, const void* x, const float* scale, const float* shift,
                                const float* mean, const float* invstd, int64_t M, int C, bool write_dx,
                                void* out, float* partials, float* sum_dz, float* sum_dzx, cudaStream_t stream);

// sum_a[c] = Σ_r partial_a[r*ld + c], sum_b likewise, for c < C, summed in row order in double.
const char* launch_sum_partials(const float* partial_a, const float* partial_b, int rows, int ld, int C,
                                float* sum_a, float* sum_b, cudaStream_t stream);

// dx = scale*(dz - Σdz/M - x̂·Σdz·x̂/M) in `dtype`; dz is `dz_dtype` (x's dtype or float32).
const char* launch_bn_dx(DType dtype, DType dz_dtype, const void* dz, const void* x, const float* scale,
                         const float* mean, const float* invstd, const float* sum_dz,
                         const float* sum_dzx, int64_t M, int C, void* dx, cudaStream_t stream);

// The architectures this library was compiled for (nvcc's __CUDA_ARCH_LIST__), e.g. "800,900".
const char* compiled_arch_list();

// The CUTLASS version the convolutions were built against, e.g. "4.2.0".
const char* cutlass_version();

}  // namespace fused_preact
