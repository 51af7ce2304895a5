// Shared CUTLASS configuration for the implicit-GEMM convolutions (conv_fprop.cu, conv_dgrad.cu,
// conv_wgrad.cu): element types, tile shapes, problem-size and tensor-reference construction
// (the checked initialize + run is cutlass_run.cuh's). Torch-free; see launchers.h for the interface.
#pragma once

#include "cutlass_run.cuh"
#include "launchers.h"

// The bfloat16 transforms must be visible before any fused kernel is instantiated.
#include "bf16_scale_bias_relu.cuh"

#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/convolution.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "cutlass/layout/matrix.h"
#include "cutlass/layout/tensor.h"
#include "cutlass/numeric_types.h"
#include "cutlass/tensor_ref.h"

namespace fused_preact {
namespace conv_config {

template <DType kDType>
struct Element;
template <>
struct Element<DType::kFloat16> {
  using type = cutlass::half_t;
};
template <>
struct Element<DType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};

using Arch = cutlass::arch::Sm80;  // sm_80 tensor-core kernels; they also run on sm_86/89/90.
using NHWC = cutlass::layout::TensorNHWC;
using RowMajor = cutlass::layout::RowMajor;

// 128x128x32 threadblock tile of 2x2 warps, each 64x64x32, on the 16x8x16 bf16/f16 MMA.
using ThreadblockShape = cutlass::gemm::GemmShape<128, 128, 32>;
using WarpShape = cutlass::gemm::GemmShape<64, 64, 32>;
using InstructionShape = cutlass::gemm::GemmShape<16, 8, 16>;
constexpr int kStages = 4;

// Elements per 128-bit access of a 16-bit operand: channels must be multiples of this.
constexpr int kAlignment16 = 8;

template <typename ElementOut>
using Epilogue = cutlass::epilogue::thread::LinearCombination<
    ElementOut, 128 / cutlass::sizeof_bits<ElementOut>::value, float, float>;

inline cutlass::conv::Conv2dProblemSize problem_size(ConvGeometry const &g, int split_k = 1) {
  return cutlass::conv::Conv2dProblemSize(g.N, g.H, g.W, g.C, g.K, g.R, g.S, g.P, g.Q, g.pad_h, g.pad_w,
                                          g.stride_h, g.stride_w, g.dilation_h, g.dilation_w,
                                          cutlass::conv::Mode::kCrossCorrelation, split_k);
}

template <typename T>
cutlass::TensorRef<T, NHWC> nhwc_ref(void const *ptr, int n, int h, int w, int c) {
  return cutlass::TensorRef<T, NHWC>(static_cast<T *>(const_cast<void *>(ptr)),
                                     NHWC::packed(cutlass::Tensor4DCoord(n, h, w, c)));
}

// A per-channel vector of length c viewed as a 1 x c row-major matrix.
template <typename T>
cutlass::TensorRef<T, RowMajor> vector_ref(void const *ptr, int c) {
  return cutlass::TensorRef<T, RowMajor>(static_cast<T *>(const_cast<void *>(ptr)), RowMajor(c));
}

using fused_preact::initialize_and_run;

}  // namespace conv_config
}  // namespace fused_preact
