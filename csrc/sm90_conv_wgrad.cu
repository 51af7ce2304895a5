// Backward weights on sm_90a with the activation recomputed from x:
//
//   dw(K,R,S,C) = Σ_{n,p,q} dy[n,p,q,k] · a[n, p·sh − ph + r·dh, q·sw − pw + s·dw, c],
//   a = relu(x·scale + shift) (fp32 math, NaN kept), padded taps zeros of a,
//
// fp16/bf16 dy (NHWC) and x (NHWC), fp32 scale/shift/accumulation, fp32 dw (KRSC).
//
// GEMM (CUTLASS 3.x wgrad): D(M = K, N = (C,S,R)) = A(K, N·P·Q) · B((C,S,R), N·P·Q)ᵀ with A = dy (TMA
// tiled load) and B = im2col(x) (TMA im2col load), both MN-major in smem. wgmma reads registers only
// for A, and the operand to transform here is B, so the transform runs in shared memory: once a stage
// has landed, the consumer warpgroup reads its x tile (16-byte vectors of 8 channels of one pixel),
// applies the transform and the padding mask, writes it back, fences the generic-proxy writes for
// the async proxy (`fence.proxy.async.shared::cta`) and meets at a named barrier before the SS
// wgmma reads the stage — the pattern of CUTLASS's in-smem operand transposition
// (`cutlass/transform/collective/sm90_wgmma_transpose.hpp`). The transform of stage t+1 overlaps the
// wgmma of stage t.
//
// Kernel (this file): a non-persistent warp-specialized kernel modelled on CUTLASS's
// `sm90_gemm_tma_warpspecialized.hpp` — warpgroup 0 is the producer (CUTLASS's wgrad collective
// `load()`, built by its conv CollectiveBuilder, which also provides the TMA descriptors, smem
// layouts, pipeline and SS TiledMMA), warpgroup 1 the consumer below. Its grid is
// (K tiles, (C,S,R) tiles, splits): CUTLASS 3.x has no split-K for sm90 convolutions, and the
// GEMM-K N·P·Q is long while dw is small, so blockIdx.z takes a contiguous range of k-tiles and
// writes an fp32 partial dw; sum_splits_kernel adds the partials in split order (deterministic).
// Epilogue: each consumer thread stores its accumulator pairs (two consecutive channels) with
// bounds checks — dw is small next to the GEMM-K work.
#include "launchers.h"

#if defined(FUSED_PREACT_SM90)

#include "sm90_common.cuh"

#include "cute/tensor.hpp"
#include "cute/atom/copy_atom.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/device_kernel.h"
#include "cutlass/pipeline/pipeline.hpp"

#include <algorithm>

namespace fused_preact {
namespace {

using namespace cute;

constexpr int kTileM = 128;  // output channels K
constexpr int kTileN = 128;  // input channels per (r, s) tap
constexpr int kTileK = 64;   // pixels (N·P·Q)
constexpr int kStages = 5;
using WgradTile = Shape<Int<kTileM>, Shape<Int<kTileN>>, Shape<Int<kTileK>>>;
using Cluster = Shape<_1, _1, _1>;

template <class T>
using WgradCollective = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kWgrad,
    T, cutlass::layout::TensorNHWC, 8,  // dy (N,P,Q,K)
    T, cutlass::layout::TensorNHWC, 8,  // x (N,H,W,C)
    float, WgradTile, Cluster, cutlass::conv::collective::StageCount<kStages>,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;

// Per-CTA information of the transform of B (x) and of the epilogue.
struct WgradExtra {
  sm90::ActivationTransform act;  // scale/shift, x extent, padding/stride/dilation; M = N·P·Q pixels
  int K = 0;                      // output channels
  int S = 1;                      // filter width
  int k_tiles = 0;                // GEMM-K tiles in all
  int k_tiles_per_split = 0;
  float *dw = nullptr;            // (splits, K, R, S, C) fp32
  int64_t split_stride = 0;       // K·R·S·C
};

template <class T>
struct WgradKernel {
  using Collective = WgradCollective<T>;
  using TiledMma = typename Collective::TiledMma;
  using SmemLayoutB = typename Collective::SmemLayoutB;
  using SmemLayoutA = typename Collective::SmemLayoutA;
  using MainloopPipeline = typename Collective::MainloopPipeline;
  using PipelineState = typename Collective::PipelineState;
  using ProblemShape = typename Collective::ProblemShape;

  static constexpr uint32_t MaxThreadsPerBlock = 2 * cutlass::NumThreadsPerWarpGroup;
  static constexpr uint32_t MinBlocksPerMultiprocessor = 1;

  struct SharedStorage {
    typename Collective::TensorStorage tensors;
    typename Collective::PipelineStorage pipeline;
  };
  static constexpr int SharedStorageSize = sizeof(SharedStorage);

  struct Params {
    typename Collective::Params mainloop;
    decltype(Collective::get_problem_shape_MNKL(ProblemShape{})) problem_shape;
    WgradExtra extra;
  };

  static_assert(cute::size(TiledMma{}) == cutlass::NumThreadsPerWarpGroup, "one consumer warpgroup");
  static_assert(cute::sizeof_bits_v<T> == 16);

  // x tile transform: 16 threads x 8 channels across the 128 channels, 8 threads across pixels,
  // 16-byte vectors (the copy fails to compile if 8 channels are not contiguous in the swizzled tile).
  using TransformCopy = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, T>{},
                                                 Layout<Shape<_16, _8>>{}, Layout<Shape<_8, _1>>{}));
  static_assert(16 * 8 == kTileN && cute::size(TransformCopy{}) == cutlass::NumThreadsPerWarpGroup);

  // 16 bytes to shared memory: `v` if `keep`, else zeros (two predicated st.shared.v4, one of
  // which stores).
  CUTLASS_DEVICE static void store_or_zero(T *smem, uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3, uint32_t keep) {
    uint32_t const addr = cute::cast_smem_ptr_to_uint(smem);
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "setp.ne.b32 p, %5, 0;\n\t"
        "@p st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n\t"
        "@!p st.shared.v4.b32 [%0], {%6, %6, %6, %6};\n\t}"
        :
        : "r"(addr), "r"(v0), "r"(v1), "r"(v2), "r"(v3), "r"(keep), "r"(0u)
        : "memory");
  }

  CUTLASS_DEVICE void operator()(Params const &params, char *smem_buf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    SharedStorage &shared = *reinterpret_cast<SharedStorage *>(smem_buf);
    int const thread_idx = int(threadIdx.x);
    int const warp_group = cutlass::canonical_warp_group_idx();
    int const warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    int const wg_thread = thread_idx % cutlass::NumThreadsPerWarpGroup;
    int const lane = cutlass::canonical_lane_idx();

    if (cutlass::canonical_warp_idx_sync() == 0 && cute::elect_one_sync()) {
      Collective::prefetch_tma_descriptors(params.mainloop);
    }

    typename MainloopPipeline::Params pipeline_params;
    if (warp_group == 0 && warp_in_group == 0) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    }
    if (warp_group == 1) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    }
    pipeline_params.is_leader = wg_thread == 0;
    pipeline_params.num_consumers = cutlass::NumThreadsPerWarpGroup;
    pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline pipeline(shared.pipeline, pipeline_params, Cluster{});
    __syncthreads();

    Collective collective;
    auto problem_shape_MNKL = append<4>(params.problem_shape, Int<1>{});
    auto load_inputs = collective.load_init(problem_shape_MNKL, params.mainloop);
    Tensor gA_mkl = get<0>(load_inputs);  // (BLK_M, BLK_K, m, k)
    Tensor gB_nkl = get<1>(load_inputs);  // (BLK_N, BLK_K, n, k), n = (channel block, s, r)
    auto m_coord = idx2crd(int(blockIdx.x), shape<2>(gA_mkl));
    auto n_coord = idx2crd(int(blockIdx.y), shape<2>(gB_nkl));
    auto blk_coord = make_coord(m_coord, n_coord, _, Int<0>{});

    WgradExtra const &extra = params.extra;
    int const k_begin = int(blockIdx.z) * extra.k_tiles_per_split;
    int const k_count = min(extra.k_tiles_per_split, extra.k_tiles - k_begin);
    if (k_count <= 0) {
      return;  // the host never launches empty splits; kept for safety (no barrier is waited on yet)
    }

    if (warp_group == 0) {
      if (warp_in_group == 0) {
        PipelineState producer_state = cutlass::make_producer_start_state<MainloopPipeline>();
        auto k_tile_iter = make_coord_iterator(idx2crd(k_begin, shape<3>(gA_mkl)), shape<3>(gA_mkl));
        collective.load(params.mainloop, pipeline, producer_state, load_inputs, blk_coord, k_tile_iter, k_count, lane,
                        cute::block_rank_in_cluster(), shared.tensors);
        producer_state.advance(k_count);
        collective.load_tail(pipeline, producer_state);
      }
    } else {
      consume(params, shared, pipeline, wg_thread, k_begin, k_count, n_coord);
    }
#else
    CUTLASS_UNUSED(params);
    CUTLASS_UNUSED(smem_buf);
#endif
  }

  template <class NCoord>
  CUTLASS_DEVICE static void consume(Params const &params, SharedStorage &shared, MainloopPipeline pipeline,
                                     int wg_thread, int k_begin, int k_count, NCoord const &n_coord) {
    WgradExtra const &extra = params.extra;
    sm90::ActivationTransform const &act = extra.act;
    int const cb = int(get<0>(n_coord));
    int const s = int(get<1>(n_coord));
    int const r = int(get<2>(n_coord));

    Tensor sA = make_tensor(make_smem_ptr(shared.tensors.smem_A.data()), SmemLayoutA{});   // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared.tensors.smem_B.data()), SmemLayoutB{});   // (BLK_N,BLK_K,PIPE)
    Tensor sB_rw = as_position_independent_swizzle_tensor(sB);

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(wg_thread);
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // descriptors
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
    Tensor accum = partition_fragment_C(tiled_mma, make_shape(Int<kTileM>{}, Int<kTileN>{}));

    // The transform's view of the x tile and the (channel, pixel) of each element.
    auto thr_copy = TransformCopy{}.get_thread_slice(wg_thread);
    Tensor tXs = thr_copy.partition_S(sB_rw);                         // (CPY, CPY_N, CPY_K, PIPE)
    Tensor tXd = thr_copy.partition_D(sB_rw);
    Tensor tXc = thr_copy.partition_S(make_identity_tensor(make_shape(Int<kTileN>{}, Int<kTileK>{})));
    Tensor tXr = make_fragment_like(tXs(_, _, _, 0));                 // (CPY, CPY_N, CPY_K)
    static_assert(size<0>(decltype(tXr){}) == 8 && size<1>(decltype(tXr){}) == 1, "one 8-channel vector per pixel");
    constexpr int kPixels = size<2>(decltype(tXr){});

    // This thread's 8 channels are the same for every pixel and k-tile of the CTA: their
    // {scale[c], scale[c+1], shift[c], shift[c+1]} per channel pair, zeros past C.
    int const c0 = cb * kTileN + int(get<0>(tXc(0, 0, 0)));
    float4 sc_sh[4];
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < 4; ++q) {
      sc_sh[q] = sm90::act_table_entry(act, c0 / 2 + q);  // C % 8 == 0: all 8 channels in or all out
    }

    // Padding mask of the k-tile's pixels: each lane tests one pixel of its warp's 16, a ballot
    // gives thread t the bits of its 8 pixels (sm90::wgrad_lane_pixel, sm90::wgrad_ballot_bit). The
    // lane's pixel advances by one k-tile (kTileK positions) per stage.
    sm90::PixelWalk walk(act, k_begin * kTileK + sm90::wgrad_lane_pixel(wg_thread / 32, wg_thread % 32), kTileK);
    int const ballot_shift = sm90::wgrad_ballot_bit(wg_thread, 0);
    static_assert(sm90::fragment_is_compact_v<decltype(tXr.layout())>, "transform vector: register offset = element index");
    // The stores go to &tXd(0, 0, px, stage) as 16 bytes: the same elements, in the same order, as
    // the 128-bit loads of tXs (the copy of tXs into tXr compiles only as 16-byte vectors).
    static_assert(cute::is_same_v<decltype(tXs.layout()), decltype(tXd.layout())>);
    Tensor tXr32 = recast<uint32_t>(tXr);  // pixel px: registers 4·px .. 4·px + 3, channel pairs in order

    // Transform the x tile of `stage` (the k-tile the walk is at) in place, then advance the walk.
    // A padded pixel's vector is stored as zeros by a second, complementary predicated store
    // (two STS per pixel instead of a select per register).
    auto transform_stage = [&](int stage) {
      copy(TransformCopy{}, tXs(_, _, _, stage), tXr);
      uint32_t const valid = __ballot_sync(0xffffffffu, walk.valid(act, r, s)) >> ballot_shift;
      walk.advance(act, kTileK);
      CUTLASS_PRAGMA_UNROLL
      for (int px = 0; px < kPixels; ++px) {
        CUTLASS_PRAGMA_UNROLL
        for (int q = 0; q < 4; ++q) {
          tXr32(4 * px + q) = sm90::bn_relu_pair<T>(tXr32(4 * px + q), sc_sh[q]);
        }
        store_or_zero(&tXd(0, 0, px, stage), tXr32(4 * px), tXr32(4 * px + 1), tXr32(4 * px + 2), tXr32(4 * px + 3),
                      valid & (1u << px));
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy smem writes -> wgmma (async proxy)
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, 0);
    };

    PipelineState read_state;
    PipelineState release_state;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);

    pipeline.consumer_wait(read_state);
    transform_stage(read_state.index());
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < k_count; ++t) {
      int const stage = read_state.index();
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      ++read_state;
      if (t + 1 < k_count) {
        pipeline.consumer_wait(read_state);
        transform_stage(read_state.index());  // overlaps the wgmma of stage t
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      pipeline.consumer_release(release_state);
      ++release_state;
    }

    // Epilogue: accumulator (k, n_local) -> dw[split][k][r][s][cb·128 + n_local], two channels per store.
    Tensor tCc = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
    static_assert(decltype(size(tCc) == size(accum))::value);
    int const k_base = int(blockIdx.x) * kTileM;
    float *out = extra.dw + int64_t(blockIdx.z) * extra.split_stride;
    int64_t const tap_offset = (int64_t(r) * extra.S + s) * act.C;
    int64_t const ld = int64_t(extra.split_stride / extra.K);  // R·S·C
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
      int const k = k_base + int(get<0>(tCc(i)));
      int const c = cb * kTileN + int(get<1>(tCc(i)));  // even; c + 1 is element i + 1 (static check below)
      if (k < extra.K && c < act.C) {
        *reinterpret_cast<float2 *>(out + int64_t(k) * ld + tap_offset + c) = make_float2(accum(i), accum(i + 1));
      }
    }
  }
};

// Compile-time check of the accumulator fragment the epilogue stores in pairs: elements 2j and
// 2j+1 are columns n, n+1 of one row.
template <class CoordLayout, int kSize>
constexpr bool accumulator_pairs_are_adjacent_columns() {
  bool ok = true;
  cute::for_each(cute::make_int_sequence<kSize / 2>{}, [&](auto j) {
    constexpr auto c0 = CoordLayout{}(cute::Int<2 * decltype(j)::value>{});
    constexpr auto c1 = CoordLayout{}(cute::Int<2 * decltype(j)::value + 1>{});
    ok = ok && int(get<0>(c0)) == int(get<0>(c1)) && int(get<1>(c1)) == int(get<1>(c0)) + 1 && int(get<1>(c0)) % 2 == 0;
  });
  return ok;
}

template <class T>
struct AccumulatorCheck {
  using TiledMma = typename WgradKernel<T>::TiledMma;
  using CoordLayout = decltype(TiledMma{}.get_thread_slice(0).partition_C(
      make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{}))).layout());
  static_assert(is_static<CoordLayout>::value);
  static_assert(accumulator_pairs_are_adjacent_columns<CoordLayout, cute::size(CoordLayout{})>(),
                "wgrad epilogue: accumulator pairs must be adjacent channels of one output channel row");
};
template struct AccumulatorCheck<cutlass::half_t>;
template struct AccumulatorCheck<cutlass::bfloat16_t>;

// dw = Σ_split partial[split] in split order.
__global__ void sum_splits_kernel(float const *__restrict__ partial, int splits, int64_t n, float *__restrict__ dw) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float acc = partial[i];
    for (int z = 1; z < splits; ++z) {
      acc += partial[int64_t(z) * n + i];
    }
    dw[i] = acc;
  }
}

template <class T>
char const *run_wgrad(ConvGeometry const &g, void const *dy, void const *x, float const *scale, float const *shift,
                      float *dw, int splits, float *workspace, cudaStream_t stream) {
  using Kernel = WgradKernel<T>;
  using Collective = typename Kernel::Collective;
  auto const problem = sm90::problem_shape<cutlass::conv::Operator::kWgrad>(g);
  typename Collective::Arguments mainloop_args{static_cast<T const *>(dy), static_cast<T const *>(x)};
  bool const vectors_aligned = reinterpret_cast<uintptr_t>(scale) % 8 == 0 && reinterpret_cast<uintptr_t>(shift) % 8 == 0;
  if (!Collective::can_implement(problem, mainloop_args) || g.C % 8 != 0 || g.K % 8 != 0 || !vectors_aligned) {
    return kSm90Unsupported;
  }
  int64_t const pixels = int64_t(g.N) * g.P * g.Q;
  typename Kernel::Params params;
  params.mainloop = Collective::to_underlying_arguments(problem, mainloop_args, nullptr);
  params.problem_shape = Collective::get_problem_shape_MNKL(problem);
  WgradExtra &extra = params.extra;
  extra.act = sm90::make_activation_transform(g, scale, shift, kTileN);
  extra.K = g.K;
  extra.S = g.S;
  extra.k_tiles = int((pixels + kTileK - 1) / kTileK);
  splits = std::max(1, std::min(splits, extra.k_tiles));
  extra.k_tiles_per_split = (extra.k_tiles + splits - 1) / splits;
  splits = (extra.k_tiles + extra.k_tiles_per_split - 1) / extra.k_tiles_per_split;  // no empty split
  extra.split_stride = int64_t(g.K) * g.R * g.S * g.C;
  extra.dw = splits == 1 ? dw : workspace;

  dim3 const grid(unsigned((g.K + kTileM - 1) / kTileM),
                  unsigned(extra.act.channel_blocks * g.S * g.R), unsigned(splits));
  int const smem = Kernel::SharedStorageSize;
  auto kernel = cutlass::device_kernel<Kernel>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    return cudaGetErrorString(cudaGetLastError());
  }
  kernel<<<grid, Kernel::MaxThreadsPerBlock, smem, stream>>>(params);
  if (splits > 1) {
    int64_t const n = extra.split_stride;
    int const blocks = int(std::min<int64_t>((n + 255) / 256, 4096));
    sum_splits_kernel<<<blocks, 256, 0, stream>>>(workspace, splits, n, dw);
  }
  cudaError_t const error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace

int sm90_wgrad_splits(ConvGeometry const &g, int sm_count) {
  int64_t const tiles = int64_t((g.K + kTileM - 1) / kTileM) * ((g.C + kTileN - 1) / kTileN) * g.R * g.S;
  int64_t const k_tiles = (int64_t(g.N) * g.P * g.Q + kTileK - 1) / kTileK;
  // About one wave of CTAs (one CTA per SM: ~190 KB of smem), at least 8 k-tiles per split.
  int64_t const split = std::min<int64_t>({(sm_count + tiles - 1) / std::max<int64_t>(tiles, 1), k_tiles / 8, 64});
  return int(std::max<int64_t>(split, 1));
}

size_t sm90_wgrad_workspace_bytes(ConvGeometry const &g, int splits) {
  return splits > 1 ? size_t(splits) * size_t(g.K) * g.R * g.S * g.C * sizeof(float) : 0;
}

char const *launch_wgrad_fused_sm90(DType dtype, ConvGeometry const &g, void const *dy, void const *x,
                                    float const *scale, float const *shift, float *dw, int splits, void *workspace,
                                    cudaStream_t stream) {
  float *ws = static_cast<float *>(workspace);
  switch (dtype) {
    case DType::kFloat16:
      return run_wgrad<cutlass::half_t>(g, dy, x, scale, shift, dw, splits, ws, stream);
    case DType::kBFloat16:
      return run_wgrad<cutlass::bfloat16_t>(g, dy, x, scale, shift, dw, splits, ws, stream);
    default:
      return "sm90 wgrad: only float16 and bfloat16 are supported";
  }
}

}  // namespace fused_preact

#else  // !FUSED_PREACT_SM90

namespace fused_preact {

int sm90_wgrad_splits(ConvGeometry const &, int) { return 1; }
size_t sm90_wgrad_workspace_bytes(ConvGeometry const &, int) { return 0; }
char const *launch_wgrad_fused_sm90(DType, ConvGeometry const &, void const *, void const *, float const *,
                                    float const *, float *, int, void *, cudaStream_t) {
  return "the sm90 kernels were not built (no 9.0 architecture in FUSED_PREACT_CUDA_ARCHS)";
}

}  // namespace fused_preact

#endif
