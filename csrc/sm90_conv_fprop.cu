// Forward on sm_90a: y = conv(relu(x·scale + shift), w) + bias [+ residual], fp16/bf16 NHWC x, KRSC w,
// NHWC y, fp32 scale/shift/accumulation.
//
// Kernel: CUTLASS 3.x `ConvUniversal` on the non-persistent warp-specialized TMA + wgmma kernel
// (`KernelImplicitTmaWarpSpecializedSm90`), with
//   mainloop: FpropBnReluMainloop (sm90_fprop_mainloop.cuh) — CUTLASS's im2col TMA producer, the BN +
//             ReLU transform applied in registers to the activation operand, register-sourced wgmma;
//   epilogue: CUTLASS's TMA warp-specialized epilogue with the `LinCombPerColBias` fusion, an epilogue
//             visitor tree computing  y = 1·acc + bias[k] + beta·C  in fp32 (bias a per-output-channel
//             row broadcast, nullptr = no bias; C the residual, read only when beta != 0).
// Tile 128 (output positions) x 128 (output channels) x 64 (input channels), one consumer warpgroup.
#include "launchers.h"

#if defined(FUSED_PREACT_SM90)

#include "sm90_fprop_mainloop.cuh"

#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"

namespace fused_preact {
namespace {

using namespace cute;

using FpropTile = Shape<_128, _128, Shape<_64>>;  // (M, N, K): K tiled over channels only
using Cluster = Shape<_1, _1, _1>;

template <typename T>
using FpropEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, FpropTile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    T, cutlass::layout::TensorNHWC, 8,  // C: residual (N,P,Q,K)
    T, cutlass::layout::TensorNHWC, 8,  // D: y (N,P,Q,K)
    cutlass::epilogue::TmaWarpSpecialized,
    cutlass::epilogue::fusion::LinCombPerColBias<T, float, T, T, float>>::CollectiveOp;

// Stages: as many as fit next to the mainloop's scale/shift table and the kernel's pipeline
// barriers (1 KiB); the epilogue's smem is a union with the mainloop's (CUTLASS's non-persistent
// kernel), so it needs no carve-out of its own.
template <typename T>
using FpropMainloop = sm90::FpropBnReluMainloop<
    T, FpropTile, cutlass::conv::collective::StageCountAutoCarveout<sm90::kFpropTableBytes + 1024>>;

template <typename T>
using FpropKernel = cutlass::conv::kernel::ConvUniversal<cutlass::conv::ConvProblemShape<cutlass::conv::Operator::kFprop, 2>,
                                                         FpropMainloop<T>, FpropEpilogue<T>>;

template <typename T>
using Fprop = cutlass::conv::device::ConvUniversalAdapter<FpropKernel<T>>;

template <typename T>
struct SmemCheck {
  static_assert(FpropKernel<T>::SharedStorageSize <= cutlass::gemm::collective::detail::sm90_smem_capacity_bytes,
                "fprop: stages + scale/shift table exceed sm_90's shared memory");
  static_assert(FpropMainloop<T>::DispatchPolicy::Stages >= 6, "fprop: fewer stages than the tile was tuned for");
};
template struct SmemCheck<cutlass::half_t>;
template struct SmemCheck<cutlass::bfloat16_t>;

template <typename T>
char const *run_fprop(ConvGeometry const &g, void const *x, void const *w, void const *bias, void const *residual,
                      float const *scale, float const *shift, void *y, cudaStream_t stream) {
  using Operation = Fprop<T>;
  using Kernel = FpropKernel<T>;
  auto const problem = sm90::problem_shape<cutlass::conv::Operator::kFprop>(g);

  typename FpropMainloop<T>::Arguments mainloop{};
  mainloop.ptr_A = static_cast<T const *>(x);
  mainloop.ptr_B = static_cast<T const *>(w);
  mainloop.act = sm90::make_activation_transform(g, scale, shift, FpropMainloop<T>::kTileK);

  // y and the residual: GEMM-M modes (q, p, n) of a packed (N,P,Q,K) tensor.
  auto const stride_d = sm90::nhwc_epilogue_stride<typename Kernel::StrideD>(g.K, g.Q, g.P);
  auto const stride_c = sm90::nhwc_epilogue_stride<typename Kernel::StrideC>(g.K, g.Q, g.P);

  // Without a residual C points at y and is never read (beta = 0).
  T const *c_ptr = residual != nullptr ? static_cast<T const *>(residual) : static_cast<T const *>(y);
  typename Kernel::EpilogueArguments epilogue{{}, c_ptr, stride_c, static_cast<T *>(y), stride_d};
  epilogue.thread.alpha = 1.0f;
  epilogue.thread.beta = residual != nullptr ? 1.0f : 0.0f;
  epilogue.thread.bias_ptr = static_cast<T const *>(bias);

  typename Operation::Arguments args(problem, mainloop, epilogue);
  return initialize_and_run<Operation>(args, nullptr, stream, kSm90Unsupported);
}

}  // namespace

const char kSm90Unsupported[] = "the sm90 kernel does not implement this problem";

bool sm90_kernels_built() { return true; }

char const *launch_fprop_fused_sm90(DType dtype, ConvGeometry const &g, void const *x, void const *w,
                                    void const *bias, void const *residual, float const *scale, float const *shift,
                                    void *y, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return run_fprop<cutlass::half_t>(g, x, w, bias, residual, scale, shift, y, stream);
    case DType::kBFloat16:
      return run_fprop<cutlass::bfloat16_t>(g, x, w, bias, residual, scale, shift, y, stream);
    default:
      return "sm90 fprop: only float16 and bfloat16 are supported";
  }
}

}  // namespace fused_preact

#else  // !FUSED_PREACT_SM90: the build has no sm_90a target

namespace fused_preact {

const char kSm90Unsupported[] = "the sm90 kernel does not implement this problem";

bool sm90_kernels_built() { return false; }

char const *launch_fprop_fused_sm90(DType, ConvGeometry const &, void const *, void const *, void const *,
                                    void const *, float const *, float const *, void *, cudaStream_t) {
  return "the sm90 kernels were not built (no 9.0 architecture in FUSED_PREACT_CUDA_ARCHS)";
}

}  // namespace fused_preact

#endif
