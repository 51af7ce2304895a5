// Shared pieces of the sm_90a kernels (sm90_conv_fprop.cu, sm90_conv_dgrad.cu, sm90_conv_wgrad.cu):
// element types, the fp32 BN+ReLU transform of one pair of 16-bit activations, the padding test
// of an output row, CUTLASS 3.x problem shapes and epilogue strides from a ConvGeometry. Torch-free. Compiled only into the sm90_*.cu translation units, which
// build_config.py compiles for sm_90a alone (FUSED_PREACT_SM90 defined); everything here is also
// valid host code, so the coordinate helpers can be exercised on the CPU.
#pragma once

#include "cutlass_run.cuh"
#include "launchers.h"

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"  // before the conv problem shape, which uses cute without including it
#include "cutlass/fast_math.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/convolution.h"

#include <cstdint>

namespace fused_preact {
namespace sm90 {

// ---------------------------------------------------------------- activation transform, fp32
// relu(hi), relu(lo) rounded to the operand type and packed as {hi: upper 16 bits, lo: lower}.
// `cvt.rn.relu.{f16x2,bf16x2}.f32` (sm_80+): per the PTX ISA `.relu` clamps a negative result to 0
// and converts a NaN result to the canonical NaN, so relu(NaN) = NaN, relu(+inf) = +inf and
// relu(-inf) = 0 as in eager PyTorch (fmaxf(v, 0) would drop the NaN). The operand order
// `cvt d, a, b` puts a in the upper half of d.
template <typename T>
CUTLASS_HOST_DEVICE uint32_t relu_pack(float hi, float lo);

template <>
CUTLASS_HOST_DEVICE uint32_t relu_pack<cutlass::half_t>(float hi, float lo) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  auto relu = [](float v) { return v < 0.f ? 0.f : v; };  // NaN < 0 is false: NaN passes
  return uint32_t(cutlass::half_t(relu(lo)).raw()) | (uint32_t(cutlass::half_t(relu(hi)).raw()) << 16);
#endif
}

template <>
CUTLASS_HOST_DEVICE uint32_t relu_pack<cutlass::bfloat16_t>(float hi, float lo) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  auto relu = [](float v) { return v < 0.f ? 0.f : v; };
  return uint32_t(cutlass::bfloat16_t(relu(lo)).raw()) | (uint32_t(cutlass::bfloat16_t(relu(hi)).raw()) << 16);
#endif
}

// Per-channel scale/shift of the BN and the geometry the padding test needs, as the kernels get
// it (by value in their Params). scale and shift are fp32 (C,) vectors; channels >= C read as 0, so
// the activation of a channel the TMA zero-filled past C is relu(0·0 + 0) = 0.
struct ActivationTransform {
  float const *scale = nullptr;
  float const *shift = nullptr;
  int C = 0;                   // channels of x
  int H = 0, W = 0;            // extent of x
  int M = 0;                   // rows of the GEMM operand holding x (fprop: N·P·Q output positions)
  int pad_h = 0, pad_w = 0;
  int stride_h = 1, stride_w = 1;
  int dilation_h = 1, dilation_w = 1;
  int channel_blocks = 1;      // ceil(C / tile K): k-tiles per filter tap
  int S = 1;                   // filter width (taps per filter row)
  cutlass::FastDivmod divmod_PQ;  // m -> (n, p*Q + q)
  cutlass::FastDivmod divmod_Q;   // p*Q + q -> (p, q)
};

// A row index far outside any extent: `row + r·dilation` stays negative, so the unsigned bound
// test below fails for every tap.
constexpr int kInvalidRow = -(1 << 28);

// Origin (h0, w0) = (p·stride − pad, q·stride − pad) of the receptive field of output position m,
// or kInvalidRow for m >= M (rows past the GEMM extent; their results are never stored).
CUTLASS_HOST_DEVICE void output_row_origin(ActivationTransform const &t, int m, int &h0, int &w0) {
  if (m < 0 || m >= t.M) {
    h0 = kInvalidRow;
    w0 = kInvalidRow;
    return;
  }
  int n, pq, p, q;
  t.divmod_PQ(n, pq, m);
  t.divmod_Q(p, q, pq);
  h0 = p * t.stride_h - t.pad_h;
  w0 = q * t.stride_w - t.pad_w;
}

// Whether tap (r, s) of the receptive field starting at (h0, w0) lies inside x (not padding).
CUTLASS_HOST_DEVICE bool tap_in_bounds(ActivationTransform const &t, int h0, int w0, int r, int s) {
  return unsigned(h0 + r * t.dilation_h) < unsigned(t.H) && unsigned(w0 + s * t.dilation_w) < unsigned(t.W);
}

// The filter tap and channel block of a k-tile of the fprop GEMM. CUTLASS 3.x orders the GEMM-K
// mode of fprop as (C, S, R) (conv/detail.hpp, get_transformed_problem_shape_MNKL) and tiles it
// with the tile's K extent on C only, so k-tiles run channel block fastest, then s, then r.
struct KTileTap {
  int cb = 0, s = 0, r = 0;
  CUTLASS_HOST_DEVICE void advance(ActivationTransform const &t) {
    if (++cb == t.channel_blocks) {
      cb = 0;
      if (++s == t.S) {
        s = 0;
        ++r;
      }
    }
  }
};

inline ActivationTransform make_activation_transform(ConvGeometry const &g, float const *scale, float const *shift,
                                                     int tile_k) {
  ActivationTransform t;
  t.scale = scale;
  t.shift = shift;
  t.C = g.C;
  t.H = g.H;
  t.W = g.W;
  t.M = g.N * g.P * g.Q;
  t.pad_h = g.pad_h;
  t.pad_w = g.pad_w;
  t.stride_h = g.stride_h;
  t.stride_w = g.stride_w;
  t.dilation_h = g.dilation_h;
  t.dilation_w = g.dilation_w;
  t.channel_blocks = (g.C + tile_k - 1) / tile_k;
  t.S = g.S;
  t.divmod_PQ = cutlass::FastDivmod(g.P * g.Q);
  t.divmod_Q = cutlass::FastDivmod(g.Q);
  return t;
}

// ------------------------------------------------------------------------------ problem shapes
// CUTLASS 3.x problem shape of the 2-D convolution: activation [N,H,W,C], filter [K,R,S,C], both
// packed (channels_last torch tensors), symmetric padding as torch's.
template <cutlass::conv::Operator kOp>
cutlass::conv::ConvProblemShape<kOp, 2> problem_shape(ConvGeometry const &g) {
  return cutlass::conv::ConvProblemShape<kOp, 2>(cutlass::conv::Mode::kCrossCorrelation, {g.N, g.H, g.W, g.C},
                                                 {g.K, g.R, g.S, g.C}, {g.pad_h, g.pad_w}, {g.pad_h, g.pad_w},
                                                 {g.stride_h, g.stride_w}, {g.dilation_h, g.dilation_w}, 1);
}

// Stride of a packed NHWC tensor over the hierarchical GEMM-M modes (inner, middle, outer) =
// (w, h, n) or (q, p, n) that CUTLASS 3.x fprop/dgrad epilogues use for C and D: (C, W·C, H·W·C).
template <class StrideMNL>
StrideMNL nhwc_epilogue_stride(int64_t channels, int64_t inner, int64_t middle) {
  StrideMNL stride{};
  cute::get<0, 0>(stride) = channels;
  cute::get<0, 1>(stride) = inner * channels;
  cute::get<0, 2>(stride) = middle * inner * channels;
  return stride;
}

}  // namespace sm90
}  // namespace fused_preact
