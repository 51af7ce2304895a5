// bfloat16 versions of CUTLASS's warp-level per-channel scale + bias + ReLU transforms.
//
// CUTLASS's mainloop-fused convolutions (ImplicitGemmFpropFusionMultistage and
// ImplicitGemmWgradFusionMultistage) apply `cutlass::conv::warp::FpropScaleBiasReluTransform` /
// `WgradScaleBiasReluTransform` to the activation fragments right before the tensor-core MMA. The
// library's versions hard-code f16x2 arithmetic, so for bfloat16 operands we provide partial
// specializations selected by the fragment's element type. They keep the fragment layout contract
// of the library's scale/bias iterators (2 operand elements per 32-bit register; the scale/bias
// fragment holds {scale pair, bias pair} per register) and only swap the arithmetic:
// `fma.rn.relu.bf16x2` (sm_80+).
//
// NaN/Inf: `fma.rn.relu.{f16x2,bf16x2}` clamps a negative result to 0 and converts a NaN result to
// the canonical NaN (PTX ISA, `.relu` modifier), so relu(NaN) = NaN, relu(+inf) = +inf and
// relu(-inf) = 0, as eager PyTorch's ReLU.
//
// Out-of-bounds (padding) positions are filled by CUTLASS's cp_async_nan with the 16-bit pattern
// 0x7eff and zeroed after the FMA. In fp16 that pattern is a quiet NaN (payload 0xff), in bfloat16
// the finite value ~1.6947e38: an input holding exactly that bit pattern is taken for padding and
// contributes 0 (fprop: when both channels of an aligned pair hold it). The fp16 NaN of a float
// conversion (0x7e00) and the canonical NaN of GPU arithmetic (0x7fff) are not affected. See README.
//
// This header must be included before any fused CUTLASS kernel is instantiated.
#pragma once

#include "cutlass/array.h"
#include "cutlass/arch/memory_sm80.h"
#include "cutlass/conv/warp/scale_bias_relu_transform.h"
#include "cutlass/numeric_types.h"

namespace cutlass {
namespace conv {
namespace warp {

namespace detail {

// relu(scale*act + bias) on a bf16x2 register.
CUTLASS_DEVICE
uint32_t bf16x2_fma_relu(uint32_t scale, uint32_t act, uint32_t bias) {
  uint32_t out = 0;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
  asm("fma.rn.relu.bf16x2 %0, %1, %2, %3;\n" : "=r"(out) : "r"(scale), "r"(act), "r"(bias));
#else
  CUTLASS_UNUSED(scale);
  CUTLASS_UNUSED(act);
  CUTLASS_UNUSED(bias);
#endif
  return out;
}

}  // namespace detail

// Fprop: the activation is operand A; a register holds two consecutive channels of one position,
// so both halves are in or out of bounds together (C is a multiple of 8).
template <int kElements, bool kRegisterSized, typename FragmentScaleBias>
struct FpropScaleBiasReluTransform<Array<bfloat16_t, kElements, kRegisterSized>, FragmentScaleBias> {
  using FragmentActivations = Array<bfloat16_t, kElements, kRegisterSized>;
  // Lets the instantiating code assert that this specialization, not the f16 one, was selected.
  static bool const kIsBFloat16Transform = true;

  static int const kRegisters = kElements / 2;
  // A warp-level A fragment of the 16x8x16 MMA holds, per thread, two column (channel) pairs; each
  // pair of registers shares one {scale pair, bias pair} entry of the scale/bias fragment.
  static int const kRegistersPerScaleBias = 2;
  static int const kScaleBiasColumns = 2;

  static_assert(kElements % 2 == 0, "bf16 activations are transformed in pairs");
  static_assert(sizeof(FragmentScaleBias) % 8 == 0, "scale/bias fragment holds {scale2, bias2} pairs");

  CUTLASS_DEVICE
  void operator()(FragmentActivations &activations, FragmentScaleBias const &scale_bias) {
    uint32_t *act = reinterpret_cast<uint32_t *>(&activations);
    uint32_t const *sb = reinterpret_cast<uint32_t const *>(&scale_bias);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRegisters; ++i) {
      int const entry = (i / kRegistersPerScaleBias) % kScaleBiasColumns;
      uint32_t const value = act[i];
      uint32_t const fused = detail::bf16x2_fma_relu(sb[2 * entry], value, sb[2 * entry + 1]);
      act[i] = (value == cutlass::arch::OOB_NAN_F16x2) ? 0u : fused;
    }
  }
};

// Wgrad: the activation is operand B; a register holds two positions (GEMM-K = N*P*Q) of one channel,
// which may straddle the padding border, so each half is checked on its own.
template <int kElements, bool kRegisterSized, typename FragmentScaleBias>
struct WgradScaleBiasReluTransform<Array<bfloat16_t, kElements, kRegisterSized>, FragmentScaleBias> {
  using FragmentActivations = Array<bfloat16_t, kElements, kRegisterSized>;
  // Lets the instantiating code assert that this specialization, not the f16 one, was selected.
  static bool const kIsBFloat16Transform = true;

  static int const kRegisters = kElements / 2;
  // Consecutive register pairs (the two rows of the 16x8x16 B fragment) share one scale/bias entry.
  static int const kRegistersPerScaleBias = 2;

  static_assert(kElements % 2 == 0, "bf16 activations are transformed in pairs");

  CUTLASS_DEVICE
  void operator()(FragmentActivations &activations, FragmentScaleBias const &scale_bias) {
    uint32_t *act = reinterpret_cast<uint32_t *>(&activations);
    uint32_t const *sb = reinterpret_cast<uint32_t const *>(&scale_bias);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRegisters; ++i) {
      int const entry = i / kRegistersPerScaleBias;
      uint32_t const value = act[i];
      uint32_t fused = detail::bf16x2_fma_relu(sb[2 * entry], value, sb[2 * entry + 1]);
      if ((value & 0xffffu) == cutlass::arch::OOB_NAN_F16) {
        fused &= 0xffff0000u;
      }
      if ((value >> 16) == cutlass::arch::OOB_NAN_F16) {
        fused &= 0x0000ffffu;
      }
      act[i] = fused;
    }
  }
};

}  // namespace warp
}  // namespace conv
}  // namespace cutlass
