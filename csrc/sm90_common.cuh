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
#include <cstring>

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

// Two 16-bit activations (channel c in the low half, c + 1 in the high half) to fp32, exactly:
// bf16 is the upper half of an fp32 (two integer ops), fp16 converts per half (HADD2.F32).
template <typename T>
CUTLASS_HOST_DEVICE float2 unpack_pair(uint32_t v);

CUTLASS_HOST_DEVICE float float_from_bits(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
#endif
}

template <>
CUTLASS_HOST_DEVICE float2 unpack_pair<cutlass::bfloat16_t>(uint32_t v) {
  return make_float2(float_from_bits(v << 16), float_from_bits(v & 0xffff0000u));
}

template <>
CUTLASS_HOST_DEVICE float2 unpack_pair<cutlass::half_t>(uint32_t v) {
#if defined(__CUDA_ARCH__)
  __half2 h;
  static_assert(sizeof(h) == sizeof(v));
  memcpy(&h, &v, sizeof(v));
  return __half22float2(h);
#else
  return make_float2(float(cutlass::half_t::bitcast(uint16_t(v & 0xffffu))),
                     float(cutlass::half_t::bitcast(uint16_t(v >> 16))));
#endif
}

// relu(x·scale + shift) of channels (c, c + 1) of one pixel, fp32 math, packed like the input:
// x as unpack_pair, t = {scale[c], scale[c+1], shift[c], shift[c+1]}. About five instructions per
// pair on sm_90 (unpack 2, FFMA 2, F2FP.RELU 1); NaN and ±inf as relu_pack.
template <typename T>
CUTLASS_HOST_DEVICE uint32_t bn_relu_pair(uint32_t x, float4 const &t) {
  float2 const f = unpack_pair<T>(x);
  return relu_pack<T>(fmaf(f.y, t.y, t.w), fmaf(f.x, t.x, t.z));
}

// ------------------------------------------------------------ fprop: the RS wgmma's A fragment
// Where the fprop transform finds the row and the channels of each 32-bit register of a k-block,
// from the static layout `CoordLayout` of the thread's partitioned identity tensor (fragment index
// -> (m, k) offset from the thread's first element, tCcA(0)). Pair j (elements 2j, 2j+1) of k-block
// b is register j + kPairs·b of a compact fragment; its row is the thread's first row + row_off[j]
// for every k-block and its channels the thread's first channel + chan_off[j] + 16·b (what
// FpropBnReluMainloop checks at compile time and checks/sm90_layout_checks.cu for every thread).
// Rows and channels repeat across pairs: the padding test runs once per distinct row ("row slot")
// and the scale/shift table is read once per distinct channel pair ("channel slot") and k-block.
template <int kPairs>
struct PairSlots {
  int row_off[kPairs] = {};
  int chan_off[kPairs] = {};
  int row_slot[kPairs] = {};   // slot of pair j
  int chan_slot[kPairs] = {};
  int row_rep[kPairs] = {};    // a pair of slot s
  int chan_rep[kPairs] = {};
  int rows = 0, chans = 0;     // slot counts
};

template <class CoordLayout, int kPairs>
constexpr PairSlots<kPairs> pair_slots() {
  PairSlots<kPairs> p;
  cute::for_each(cute::make_int_sequence<kPairs>{}, [&](auto j) {
    constexpr auto c = CoordLayout{}(cute::Int<2 * decltype(j)::value>{});
    p.row_off[j] = int(cute::get<0>(c));
    p.chan_off[j] = int(cute::get<1>(c));
  });
  for (int j = 0; j < kPairs; ++j) {
    p.row_slot[j] = -1;
    for (int s = 0; s < p.rows; ++s) {
      if (p.row_off[p.row_rep[s]] == p.row_off[j]) p.row_slot[j] = s;
    }
    if (p.row_slot[j] < 0) {
      p.row_rep[p.rows] = j;
      p.row_slot[j] = p.rows++;
    }
    p.chan_slot[j] = -1;
    for (int s = 0; s < p.chans; ++s) {
      if (p.chan_off[p.chan_rep[s]] == p.chan_off[j]) p.chan_slot[j] = s;
    }
    if (p.chan_slot[j] < 0) {
      p.chan_rep[p.chans] = j;
      p.chan_slot[j] = p.chans++;
    }
  }
  return p;
}

// The same as compile-time scalars (usable in device code without materializing the arrays).
template <class CoordLayout, int kPairs>
struct PairSlotsOf {
  static constexpr int rows = pair_slots<CoordLayout, kPairs>().rows;
  static constexpr int chans = pair_slots<CoordLayout, kPairs>().chans;
  static constexpr int row_slot(int j) { return pair_slots<CoordLayout, kPairs>().row_slot[j]; }
  static constexpr int chan_slot(int j) { return pair_slots<CoordLayout, kPairs>().chan_slot[j]; }
  static constexpr int row_off(int j) { return pair_slots<CoordLayout, kPairs>().row_off[j]; }
  static constexpr int chan_off(int j) { return pair_slots<CoordLayout, kPairs>().chan_off[j]; }
  // offsets of the row / channel pair of slot s
  static constexpr int slot_row_off(int s) {
    return pair_slots<CoordLayout, kPairs>().row_off[pair_slots<CoordLayout, kPairs>().row_rep[s]];
  }
  static constexpr int slot_chan_off(int s) {
    return pair_slots<CoordLayout, kPairs>().chan_off[pair_slots<CoordLayout, kPairs>().chan_rep[s]];
  }
};

// Whether the fragment's registers are in element order (register offset of element i is i), so
// pair j of k-block b is 32-bit register j + kPairs·b.
template <class FragLayout, int kSize>
constexpr bool fragment_is_compact() {
  bool ok = true;
  cute::for_each(cute::make_int_sequence<kSize>{}, [&](auto i) {
    ok = ok && int(FragLayout{}(cute::Int<decltype(i)::value>{})) == int(decltype(i)::value);
  });
  return ok;
}

template <class FragLayout>
constexpr bool fragment_is_compact_v = fragment_is_compact<FragLayout, int(decltype(cute::size(FragLayout{}))::value)>();

// -------------------------------------------------------------------------------------------

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
  int H_out = 1, W_out = 1;    // P, Q: extent of the output
  cutlass::FastDivmod divmod_PQ;  // m -> (n, p*Q + q)
  cutlass::FastDivmod divmod_Q;   // p*Q + q -> (p, q)
};

// Where FpropBnReluMainloop reads a channel pair in that table: the k-tile's base entry (channel
// block cb, the thread's first channel k0, even) plus a per-k-block offset (the pair's channel offset
// from k0 — even — and 16 channels per k-block).
CUTLASS_HOST_DEVICE int fprop_table_tile_base(int cb, int k0, int tile_k) { return cb * (tile_k / 2) + (k0 >> 1); }
constexpr int fprop_table_block_offset(int chan_off, int k_block) { return (chan_off + 16 * k_block) / 2; }

// Entry i of the fprop's per-CTA scale/shift table: {scale[2i], scale[2i+1], shift[2i], shift[2i+1]},
// zeros for channels >= C (the TMA zero-fills x there, so those channels contribute relu(0) = 0).
// C % 8 == 0, so a pair is all in or all out.
CUTLASS_HOST_DEVICE float4 act_table_entry(ActivationTransform const &t, int i) {
  if (2 * i >= t.C) {
    return make_float4(0.f, 0.f, 0.f, 0.f);
  }
#if defined(__CUDA_ARCH__)
  float2 const sc = __ldg(reinterpret_cast<float2 const *>(t.scale) + i);
  float2 const sh = __ldg(reinterpret_cast<float2 const *>(t.shift) + i);
  return make_float4(sc.x, sc.y, sh.x, sh.y);
#else
  return make_float4(t.scale[2 * i], t.scale[2 * i + 1], t.shift[2 * i], t.shift[2 * i + 1]);
#endif
}

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

// ------------------------------------------------------------ wgrad: padding mask by ballot
// The wgrad transform's 16-byte copy gives thread t (of the consumer warpgroup) the pixels
// t/16 + 8·i (i < 8) of the k-tile's 64: a warp's 32 threads share 16 pixels. Each lane tests one
// of them and a ballot hands the results round: lane `wgrad_lane_pixel(warp, lane)` (lanes 16..31
// repeat lanes 0..15), pixel i of thread t at ballot bit `wgrad_ballot_bit(t, i)`.
CUTLASS_HOST_DEVICE int wgrad_lane_pixel(int warp, int lane) { return 2 * warp + ((lane >> 3) & 1) + 8 * (lane & 7); }
CUTLASS_HOST_DEVICE int wgrad_ballot_bit(int wg_thread, int i) { return 8 * ((wg_thread >> 4) & 1) + i; }

// Output position m of a GEMM row or column walked in steps of `step` positions (the wgrad's
// pixels: one step per k-tile), with its (p, q) kept by carries instead of two divisions per
// step: valid() is the padding test of tap (r, s) (false for m >= M, like output_row_origin).
struct PixelWalk {
  int m = 0, p = 0, q = 0;
  int dp = 0, dq = 0;  // step = (step / Q / P)·P·Q + dp·Q + dq, dp < P, dq < Q

  CUTLASS_HOST_DEVICE PixelWalk(ActivationTransform const &t, int m0, int step) : m(m0) {
    int n, pq;
    t.divmod_PQ(n, pq, m0 < 0 ? 0 : m0);
    t.divmod_Q(p, q, pq);
    int step_n, step_pq;
    t.divmod_PQ(step_n, step_pq, step);
    t.divmod_Q(dp, dq, step_pq);
  }
  CUTLASS_HOST_DEVICE void advance(ActivationTransform const &t, int step) {
    m += step;
    q += dq;
    int const carry = q >= t.W_out ? 1 : 0;
    q -= carry * t.W_out;
    p += dp + carry;
    p -= p >= t.H_out ? t.H_out : 0;
  }
  CUTLASS_HOST_DEVICE bool valid(ActivationTransform const &t, int r, int s) const {
    return m >= 0 && m < t.M && tap_in_bounds(t, p * t.stride_h - t.pad_h, q * t.stride_w - t.pad_w, r, s);
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
  t.H_out = g.P;
  t.W_out = g.Q;
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
