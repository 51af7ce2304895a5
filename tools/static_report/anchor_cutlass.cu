// Anchors of the static report (tools/static_report/anchors.py): two stock CUTLASS 3 GEMMs for sm_90a,
// built with CUTLASS's CollectiveBuilder and nothing else, so their main loops show what the library's
// TMA warp-specialized kernels issue per K step.
//
//   D (M×N, bf16, row-major) = A (M×K, bf16, row-major) · B (K×N, bf16, column-major: "TN"), fp32 accumulation
//   pingpong:    tile 128x64x64, cluster 1x1x1, KernelTmaWarpSpecializedPingpong, epilogue TmaWarpSpecialized
//   cooperative: tile 128x128x64, cluster 1x1x1, KernelTmaWarpSpecializedCooperative, epilogue
//                TmaWarpSpecializedCooperative
// Stage count: as many as fit beside the epilogue's shared memory (StageCountAutoCarveout).
//
// Compiled, never run: nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -arch=sm_90a -cubin
// -I<cutlass>/include -I<cutlass>/tools/util/include (anchors.py builds the command).

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

namespace anchor {

using namespace cute;

template <class TileShape, class MainloopSchedule, class EpilogueSchedule>
struct Gemm {
  using Element = cutlass::bfloat16_t;
  using Accumulator = float;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows
  using ClusterShape = Shape<_1, _1, _1>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, Accumulator,
      Element, cutlass::layout::RowMajor, kAlignment,   // C
      Element, cutlass::layout::RowMajor, kAlignment,   // D
      EpilogueSchedule>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, kAlignment,     // A
      Element, cutlass::layout::ColumnMajor, kAlignment,  // B
      Accumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
};

using Pingpong = Gemm<Shape<_128, _64, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                      cutlass::epilogue::TmaWarpSpecialized>;
using Cooperative = Gemm<Shape<_128, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecializedCooperative>;

}  // namespace anchor

// A cubin holds the kernels its translation unit uses: take both kernels' addresses.
void* anchor_kernels[] = {
    reinterpret_cast<void*>(&cutlass::device_kernel<anchor::Pingpong::Kernel>),
    reinterpret_cast<void*>(&cutlass::device_kernel<anchor::Cooperative::Kernel>),
};
