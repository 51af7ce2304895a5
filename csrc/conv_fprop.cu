// Forward: y = conv(relu(x*scale + shift), w) + bias with the per-channel scale/shift/ReLU applied to
// the activation operand inside CUTLASS's multistage mainloop (DefaultConv2dFpropFusion), fp16 and
// bf16, NHWC x / KRSC w / NHWC y.
#include "cutlass_conv.cuh"

#include "cutlass/conv/device/implicit_gemm_convolution_fusion.h"
#include "cutlass/conv/kernel/default_conv2d_fprop_fusion.h"
#include "cutlass/version.h"

namespace fused_preact {
namespace {

using namespace conv_config;

template <typename T>
using FpropKernel = typename cutlass::conv::kernel::DefaultConv2dFpropFusion<
    T, NHWC,                 // activation x
    T, NHWC,                 // filter (KRSC)
    T, RowMajor,             // per-channel scale and shift, 1 x C
    T, NHWC,                 // output y (and the broadcast bias as the epilogue source)
    float,                   // accumulator
    cutlass::arch::OpClassTensorOp, Arch, ThreadblockShape, WarpShape, InstructionShape,
    Epilogue<T>, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<4>, kStages,
    cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized>::Kernel;

template <typename T>
using Fprop = cutlass::conv::device::ImplicitGemmConvolutionFusion<FpropKernel<T>>;

static_assert(cutlass::conv::warp::FpropScaleBiasReluTransform<
                  typename FpropKernel<cutlass::bfloat16_t>::Mma::Operator::TransformedFragmentA,
                  cutlass::Array<cutlass::bfloat16_t, 8>>::kIsBFloat16Transform,
              "the bf16 fprop mainloop must use the bf16 scale/bias/ReLU transform");

template <typename T>
char const *run_fprop(ConvGeometry const &g, void const *x, void const *w, void const *bias,
                      void const *scale, void const *shift, void *y, cudaStream_t stream) {
  using Operation = Fprop<T>;
  // With a bias, the epilogue source is the (K,) bias broadcast over N, P, Q by zero strides.
  cutlass::TensorRef<T, NHWC> source =
      bias != nullptr ? cutlass::TensorRef<T, NHWC>(static_cast<T *>(const_cast<void *>(bias)),
                                                    NHWC(NHWC::Stride(0)))
                      : nhwc_ref<T>(y, g.N, g.P, g.Q, g.K);
  typename Operation::Arguments args(problem_size(g), nhwc_ref<T>(x, g.N, g.H, g.W, g.C),
                                     nhwc_ref<T>(w, g.K, g.R, g.S, g.C), vector_ref<T>(scale, g.C),
                                     vector_ref<T>(shift, g.C), source, nhwc_ref<T>(y, g.N, g.P, g.Q, g.K),
                                     {1.0f, bias != nullptr ? 1.0f : 0.0f});
  return initialize_and_run<Operation>(args, nullptr, stream);
}

}  // namespace

char const *launch_fprop_fused(DType dtype, ConvGeometry const &g, void const *x, void const *w,
                               void const *bias, void const *scale, void const *shift, void *y,
                               cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return run_fprop<cutlass::half_t>(g, x, w, bias, scale, shift, y, stream);
    case DType::kBFloat16:
      return run_fprop<cutlass::bfloat16_t>(g, x, w, bias, scale, shift, y, stream);
    default:
      return "fprop: only float16 and bfloat16 are supported";
  }
}

#define FUSED_PREACT_VERSION_STRING_IMPL(a, b, c) #a "." #b "." #c
#define FUSED_PREACT_VERSION_STRING(a, b, c) FUSED_PREACT_VERSION_STRING_IMPL(a, b, c)

char const *cutlass_version() {
  return FUSED_PREACT_VERSION_STRING(CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH);
}

}  // namespace fused_preact
