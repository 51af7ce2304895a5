// Backward weights: dw = wgrad(dy, relu(x*scale + shift)) with the activation recomputed in CUTLASS's
// mainloop (DefaultConv2dWgradFusion) from the saved x, so the forward never stores it. fp16/bf16
// operands, fp32 dw in KRSC. The GEMM-K extent N*P*Q is long and the output small, so the reduction
// is split over `split_k` serial slices: each slice adds into dw in a fixed order (CUTLASS's
// semaphore), which keeps the result deterministic.
#include "cutlass_conv.cuh"

#include "cutlass/conv/device/implicit_gemm_convolution_fusion.h"
#include "cutlass/conv/kernel/default_conv2d_wgrad_fusion.h"

namespace fused_preact {
namespace {

using namespace conv_config;

constexpr int kWgradStages = 3;

template <typename T>
using WgradKernel = typename cutlass::conv::kernel::DefaultConv2dWgradFusion<
    T, NHWC,          // dy (N,P,Q,K)
    T, NHWC,          // activation x (N,H,W,C)
    T, RowMajor,      // per-channel scale and shift, 1 x C
    float, NHWC,      // dw (K,R,S,C)
    float,            // accumulator
    cutlass::arch::OpClassTensorOp, Arch, ThreadblockShape, WarpShape, InstructionShape, Epilogue<float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, kWgradStages, cutlass::arch::OpMultiplyAdd,
    cutlass::conv::IteratorAlgorithm::kOptimized>::Kernel;

template <typename T>
using Wgrad = cutlass::conv::device::ImplicitGemmConvolutionFusion<WgradKernel<T>>;

static_assert(cutlass::conv::warp::WgradScaleBiasReluTransform<
                  typename WgradKernel<cutlass::bfloat16_t>::Mma::Operator::TransformedFragmentB,
                  cutlass::Array<cutlass::bfloat16_t, 8>>::kIsBFloat16Transform,
              "the bf16 wgrad mainloop must use the bf16 scale/bias/ReLU transform");

template <typename T>
typename Wgrad<T>::Arguments wgrad_arguments(ConvGeometry const &g, void const *dy, void const *x,
                                             void const *scale, void const *shift, float *dw, int split_k) {
  auto const dw_ref = nhwc_ref<float>(dw, g.K, g.R, g.S, g.C);
  return typename Wgrad<T>::Arguments(problem_size(g, split_k), nhwc_ref<T>(dy, g.N, g.P, g.Q, g.K),
                                      nhwc_ref<T>(x, g.N, g.H, g.W, g.C), vector_ref<T>(scale, g.C),
                                      vector_ref<T>(shift, g.C), dw_ref, dw_ref, {1.0f, 0.0f},
                                      cutlass::conv::SplitKMode::kSerial);
}

template <typename T>
char const *run_wgrad(ConvGeometry const &g, void const *dy, void const *x, void const *scale,
                      void const *shift, float *dw, int split_k, void *workspace, cudaStream_t stream) {
  return initialize_and_run<Wgrad<T>>(wgrad_arguments<T>(g, dy, x, scale, shift, dw, split_k), workspace, stream);
}

}  // namespace

size_t wgrad_workspace_bytes(ConvGeometry const &g, int split_k) {
  // The semaphore array depends only on the tile grid, identical for both element types.
  return Wgrad<cutlass::half_t>::get_workspace_size(
      wgrad_arguments<cutlass::half_t>(g, nullptr, nullptr, nullptr, nullptr, nullptr, split_k));
}

char const *launch_wgrad_fused(DType dtype, ConvGeometry const &g, void const *dy, void const *x,
                               void const *scale, void const *shift, float *dw, int split_k,
                               void *workspace, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return run_wgrad<cutlass::half_t>(g, dy, x, scale, shift, dw, split_k, workspace, stream);
    case DType::kBFloat16:
      return run_wgrad<cutlass::bfloat16_t>(g, dy, x, scale, shift, dw, split_k, workspace, stream);
    default:
      return "wgrad: only float16 and bfloat16 are supported";
  }
}

}  // namespace fused_preact
