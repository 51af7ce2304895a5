// Backward data on sm_90a with the BN/ReLU backward in the epilogue — no fp32 `da` tensor:
//
//   da   = dgrad(dy, w)                                  (accumulators, fp32, never stored)
//   dz   = relu(z) <= 0 ? 0 : da,  z = x·scale + shift    (ReLU backward as eager's threshold_backward,
//                                                          mask recomputed from x, fp32; NaN passes)
//   out  = dz (training) or scale·dz = dx (eval), stored in x's dtype (NHWC)
//   Σdz, Σdz·x̂ per channel, x̂ = (x − mean)·invstd         (per-CTA-row-of-tiles partials, fp32)
//
// Kernel: CUTLASS 3.x `ConvUniversal`, non-persistent warp-specialized TMA + wgmma kernel, with
//   mainloop: CUTLASS's own dgrad collective from its conv CollectiveBuilder (TMA im2col load of dy,
//             filter tile MN-major, SS wgmma) — unit stride and dilation only (CUTLASS's sm90 dgrad is
//             tested for unit stride; other geometries stay on the sm80 kernels);
//   epilogue: CUTLASS's TMA warp-specialized epilogue with an epilogue visitor tree
//             (Sm90SplitTreeVisitor): the input tree computes dz from the accumulators, x (loaded as
//             the epilogue's C operand) and row-broadcast scale/shift; an auxiliary tree reduces
//             dz·x̂ over the CTA's rows (Sm90RowReduction, x̂ from x and row-broadcast mean/invstd);
//             the output tree reduces dz the same way and stores dz·s (s = 1 in training, scale in
//             eval; a row broadcast whose nullptr default is 1).
// The row reductions are not final (FinalReduction = false): each CTA row of tiles writes its partial
// sums to an fp32 (ceil(M / 128), round_up(C, 64)) buffer, summed in order in double by
// bn_kernels.cu (launch_sum_partials): deterministic, no atomics.
// GEMM: M = N·H·W positions of x, N = C, K = (K, S, R). Tile 128 x 64 x 64: per thread, each of the
// five row broadcasts and two row reductions of the tree holds one register per column it touches
// (tile N / 4); with N = 128 the kernel spilled 1.5 KB, with 64 it fits.
#include "launchers.h"

#if defined(FUSED_PREACT_SM90)

#include "sm90_common.cuh"

#include "cute/tensor.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/functional.h"

namespace fused_preact {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

constexpr int kTileM = 128;
constexpr int kTileN = 64;
using DgradTile = Shape<Int<kTileM>, Int<kTileN>, Shape<_64>>;
using Cluster = Shape<_1, _1, _1>;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// ------------------------------------------------------------------ elementwise epilogue functions
// Each is applied by Sm90Compute to cutlass::Array<float, N> fragments (and must also be
// instantiable for a scalar, which CUTLASS probes for an Arguments member).
template <class A>
struct ForEach {
  template <class F, class... Args>
  CUTLASS_HOST_DEVICE static A apply(F f, Args const &...args) {
    if constexpr (cute::is_same_v<A, float>) {
      return f(args...);
    } else {
      A out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < A::kElements; ++i) {
        out[i] = f(args[i]...);
      }
      return out;
    }
  }
};

// dz = relu(z) <= 0 ? 0 : da with z = x·scale + shift: eager's threshold_backward(da, relu(z), 0).
template <class A>
struct ReluBackward {
  CUTLASS_HOST_DEVICE A operator()(A const &da, A const &x, A const &scale, A const &shift) const {
    return ForEach<A>::apply(
        [](float g, float xv, float s, float b) { return fmaf(xv, s, b) <= 0.f ? 0.f : g; }, da, x, scale, shift);
  }
};

// dz·x̂ with x̂ = (x − mean)·invstd.
template <class A>
struct TimesNormalized {
  CUTLASS_HOST_DEVICE A operator()(A const &dz, A const &x, A const &mean, A const &invstd) const {
    return ForEach<A>::apply([](float g, float xv, float mu, float rs) { return g * ((xv - mu) * rs); }, dz, x, mean,
                             invstd);
  }
};

// The stored output: dz·s (s = 1 exactly in training).
template <class A>
struct Scaled {
  CUTLASS_HOST_DEVICE A operator()(A const &dz, A const &s) const {
    return ForEach<A>::apply([](float g, float sv) { return g * sv; }, dz, s);
  }
};

// ------------------------------------------------------------------------ epilogue visitor tree
template <class ElementIn>
using RowVector = fusion::Sm90RowBroadcast<0, DgradTile, ElementIn, float, Stride<_0, _1, int64_t>, 4>;

// Per-CTA partial column sums, written (not atomically added) to a compact (m-tiles, N) buffer.
using PartialColumnSum = fusion::Sm90RowReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, DgradTile, float,
                                                  float, kRound, Stride<_0, _1, _0>, 4, /*EnableNullptr=*/false,
                                                  /*FinalReduction=*/false>;

template <class T>
using DzTree = fusion::Sm90EVT<fusion::Sm90Compute<ReluBackward, float, float, kRound>,  // dz
                               fusion::Sm90AccFetch,                                     // da
                               fusion::Sm90SrcFetch<T>,                                  // x
                               RowVector<float>,                                         // scale
                               RowVector<float>>;                                        // shift

template <class T>
using DzXhatSumTree = fusion::Sm90EVT<PartialColumnSum,
                                      fusion::Sm90EVT<fusion::Sm90Compute<TimesNormalized, float, float, kRound>,
                                                      fusion::Sm90AccFetch,  // dz (the input tree's result)
                                                      fusion::Sm90SrcFetch<T>, RowVector<float>,  // x, mean
                                                      RowVector<float>>>;                         // invstd

template <class T>
using OutputTree = fusion::Sm90EVT<fusion::Sm90Compute<Scaled, T, float, kRound>,
                                   fusion::Sm90EVT<PartialColumnSum, fusion::Sm90AccFetch>,  // Σdz, passes dz
                                   RowVector<float>>;                                        // s

template <class T>
using DgradCallbacks = fusion::Sm90SplitTreeVisitor<DzTree<T>, OutputTree<T>, DzXhatSumTree<T>>;

template <class T>
using DgradEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, DgradTile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    T, cutlass::layout::TensorNHWC, 8,  // C: x (N,H,W,C)
    T, cutlass::layout::TensorNHWC, 8,  // D: dz or dx (N,H,W,C)
    cutlass::epilogue::TmaWarpSpecialized, DgradCallbacks<T>>::CollectiveOp;

template <class T>
using DgradMainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kDgrad,
    T, cutlass::layout::TensorNHWC, 8,  // dy (N,P,Q,K)
    T, cutlass::layout::TensorNHWC, 8,  // w (K,R,S,C)
    float, DgradTile, Cluster,
    cutlass::conv::collective::StageCountAutoCarveout<int(sizeof(typename DgradEpilogue<T>::SharedStorage))>,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;

template <class T>
using DgradKernel = cutlass::conv::kernel::ConvUniversal<cutlass::conv::ConvProblemShape<cutlass::conv::Operator::kDgrad, 2>,
                                                         DgradMainloop<T>, DgradEpilogue<T>>;

template <class T>
using Dgrad = cutlass::conv::device::ConvUniversalAdapter<DgradKernel<T>>;

template <class T>
char const *run_dgrad(ConvGeometry const &g, void const *dy, void const *w, void const *x, float const *scale,
                      float const *shift, float const *mean, float const *invstd, bool eval_dx, void *out,
                      float *partial_dz, float *partial_dzx, cudaStream_t stream) {
  using Operation = Dgrad<T>;
  using Kernel = DgradKernel<T>;
  if (g.stride_h != 1 || g.stride_w != 1 || g.dilation_h != 1 || g.dilation_w != 1) {
    return kSm90Unsupported;  // strided/dilated dgrad stays on the CUTLASS 2.x kernels
  }
  auto const problem = sm90::problem_shape<cutlass::conv::Operator::kDgrad>(g);

  typename DgradMainloop<T>::Arguments mainloop{static_cast<T const *>(dy), static_cast<T const *>(w)};

  // x and the output: GEMM-M modes (w, h, n) of a packed (N,H,W,C) tensor.
  auto const stride_c = sm90::nhwc_epilogue_stride<typename Kernel::StrideC>(g.C, g.W, g.H);
  auto const stride_d = sm90::nhwc_epilogue_stride<typename Kernel::StrideD>(g.C, g.W, g.H);

  typename Kernel::EpilogueArguments epilogue{{}, static_cast<T const *>(x), stride_c, static_cast<T *>(out), stride_d};
  auto &callbacks = epilogue.thread;  // {input tree, aux tree, output tree}
  // Input tree: {acc, x, scale, shift, compute}.
  callbacks = {
      {{}, {}, {scale, 0.f, {}}, {shift, 0.f, {}}, {}},
      {{{}, {}, {mean, 0.f, {}}, {invstd, 0.f, {}}, {}}, {partial_dzx, 0.f, {}}},
      {{{}, {partial_dz, 0.f, {}}}, {eval_dx ? scale : nullptr, 1.f, {}}, {}},
  };

  typename Operation::Arguments args(problem, mainloop, epilogue);
  return initialize_and_run<Operation>(args, nullptr, stream, kSm90Unsupported);
}

}  // namespace

void sm90_dgrad_partials_shape(ConvGeometry const &g, int *rows, int *ld) {
  int64_t const M = int64_t(g.N) * g.H * g.W;
  *rows = int((M + kTileM - 1) / kTileM);
  *ld = (g.C + kTileN - 1) / kTileN * kTileN;
}

char const *launch_dgrad_bn_sm90(DType dtype, ConvGeometry const &g, void const *dy, void const *w, void const *x,
                                 float const *scale, float const *shift, float const *mean, float const *invstd,
                                 bool eval_dx, void *out, float *partial_dz, float *partial_dzx, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16:
      return run_dgrad<cutlass::half_t>(g, dy, w, x, scale, shift, mean, invstd, eval_dx, out, partial_dz, partial_dzx,
                                        stream);
    case DType::kBFloat16:
      return run_dgrad<cutlass::bfloat16_t>(g, dy, w, x, scale, shift, mean, invstd, eval_dx, out, partial_dz,
                                            partial_dzx, stream);
    default:
      return "sm90 dgrad: only float16 and bfloat16 are supported";
  }
}

}  // namespace fused_preact

#else  // !FUSED_PREACT_SM90

namespace fused_preact {

void sm90_dgrad_partials_shape(ConvGeometry const &, int *rows, int *ld) {
  *rows = 0;
  *ld = 0;
}

char const *launch_dgrad_bn_sm90(DType, ConvGeometry const &, void const *, void const *, void const *, float const *,
                                 float const *, float const *, float const *, bool, void *, float *, float *,
                                 cudaStream_t) {
  return "the sm90 kernels were not built (no 9.0 architecture in FUSED_PREACT_CUDA_ARCHS)";
}

}  // namespace fused_preact

#endif
