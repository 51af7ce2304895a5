// Backward data: da = dgrad(dy, w) with CUTLASS's implicit-GEMM dgrad (no fusion), fp16/bf16 operands,
// fp32 da so that the BN-backward reductions that follow read unrounded values. Unit stride uses the
// optimized unity-stride kernel (any dilation); larger strides the strided-dgrad kernel
// (dilation 1), which writes zeros where no filter tap lands.
#include "cutlass_conv.cuh"

#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/conv/kernel/default_conv2d_dgrad.h"
#include "cutlass/conv/threadblock/threadblock_swizzle.h"

namespace fused_preact {
namespace {

using namespace conv_config;

constexpr int kDgradStages = 3;

template <typename T, cutlass::conv::StrideSupport kStride, typename Swizzle>
using DgradKernel = typename cutlass::conv::kernel::DefaultConv2dDgrad<
    T, NHWC,          // dy (N,P,Q,K)
    T, NHWC,          // filter (K,R,S,C)
    float, NHWC,      // da (N,H,W,C)
    float,            // accumulator
    cutlass::arch::OpClassTensorOp, Arch, ThreadblockShape, WarpShape, InstructionShape, Epilogue<float>,
    Swizzle, kDgradStages, cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized,
    kStride>::Kernel;

template <typename T>
using DgradUnity = cutlass::conv::device::ImplicitGemmConvolution<DgradKernel<
    T, cutlass::conv::StrideSupport::kUnity, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<4>>>;

template <typename T>
using DgradStrided = cutlass::conv::device::ImplicitGemmConvolution<DgradKernel<
    T, cutlass::conv::StrideSupport::kStrided, cutlass::conv::threadblock::StridedDgradIdentityThreadblockSwizzle<1>>>;

template <typename Operation, typename T>
char const *run_dgrad_with(ConvGeometry const &g, void const *dy, void const *w, float *da, cudaStream_t stream) {
  auto const da_ref = nhwc_ref<float>(da, g.N, g.H, g.W, g.C);
  typename Operation::Arguments args(problem_size(g), nhwc_ref<T>(dy, g.N, g.P, g.Q, g.K),
                                     nhwc_ref<T>(w, g.K, g.R, g.S, g.C), da_ref, da_ref, {1.0f, 0.0f});
  return initialize_and_run<Operation>(args, nullptr, stream);
}

template <typename T>
char const *run_dgrad(ConvGeometry const &g, void const *dy, void const *w, float *da, cudaStream_t stream) {
  if (g.stride_h == 1 && g.stride_w == 1) {
    return run_dgrad_with<DgradUnity<T>, T>(g, dy, w, da, stream);
  }
  return run_dgrad_with<DgradStrided<T>, T>(g, dy, w, da, stream);
}

}  // namespace

char const *launch_dgrad(DType dtype, ConvGeometry const &g, void const *dy, void const *w, float *da,
                         cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return run_dgrad<cutlass::half_t>(g, dy, w, da, stream);
    case DType::kBFloat16:
      return run_dgrad<cutlass::bfloat16_t>(g, dy, w, da, stream);
    default:
      return "dgrad: only float16 and bfloat16 are supported";
  }
}

}  // namespace fused_preact
