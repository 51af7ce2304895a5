// CUTLASS 3.x collective mainloop for the fused forward on sm_90a:
//
//   y = conv(a, w),  a = relu(x·scale + shift) with padded taps zeros of a,
//
// an implicit GEMM  D(M = N·P·Q, N = K) = A(M, (C,S,R)) · B(K, (C,S,R))ᵀ  over NHWC x, KRSC w.
//
// Producer side (one warp): unchanged from CUTLASS's conv collective
// `cutlass/conv/collective/sm90_implicit_gemm_gmma_ss_warpspecialized.hpp` (TMA im2col load of the
// x tile, TMA tiled load of the filter tile into a multistage smem pipeline); this class derives
// from that collective, built by CUTLASS's conv CollectiveBuilder, and reuses its Params/TMA setup,
// load_init, load, load_tail and can_implement.
//
// Consumer side (one warpgroup, 128 threads): the activation operand goes to registers and wgmma
// reads it from there (register-sourced A, "RS"), as CUTLASS's mixed-input GEMM mainloop
// `cutlass/gemm/collective/sm90_mma_tma_gmma_rs_warpspecialized_mixed_input.hpp`, whose k-block
// pipelining this follows step for step: per k-block an smem->register copy (ldmatrix, two blocks
// ahead), the transform of the next block into the MMA fragment after `warpgroup_wait<K_BLOCKS-1>`
// has retired the wgmma that last read it, and the smem stage released one k-tile later. The
// transform of a pair of channels (c, c+1) of one output row, one 32-bit register:
//
//   z = x·scale[c] + shift[c]  in fp32 (fmaf),  a = cvt.rn.relu.{f16x2,bf16x2}.f32(z)   (NaN kept)
//   a = 0 where tap (r, s) of that row lies in the padding,
//
// (bn_relu_pair in sm90_common.cuh: unpack, two FFMA, one F2FP.RELU, then an AND with the row's
// mask) with the padding decided from coordinates (row -> (n, p, q), k-tile -> (channel block, s,
// r)), not from the values: the TMA fills out-of-bounds taps with zeros of x, and relu(0·scale +
// shift) is not a zero of a. The per-thread work is hoisted out of the k-loop: a thread's registers
// cover 4 distinct rows and, per k-block, 2 distinct channel pairs (PairSlots), so the receptive-field
// origins of the 4 rows are computed once per CTA, their padding masks once per k-tile, and
// scale/shift come from a table in shared memory, {scale[c], scale[c+1], shift[c], shift[c+1]} per
// channel pair of all channel blocks, filled once per CTA by the consumer warpgroup and read with
// two 16-byte loads per k-block. Channels past C read zeros there (and the TMA zero-fills x), so
// they contribute relu(0) = 0 · w = 0.
//
// Kernel contract (checked where it can be): the kernel layer is CUTLASS's non-persistent
// `KernelImplicitTmaWarpSpecializedSm90` (`cutlass/gemm/kernel/sm90_gemm_tma_warpspecialized.hpp`)
// with a 1x1x1 cluster, which computes one output tile per CTA with m-tile = blockIdx.x and calls
// mma() with the warpgroup-local thread index; mma() reads blockIdx.x for the rows of its tile.
#pragma once

#include "sm90_common.cuh"

#include "cute/tensor.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/atom/copy_atom.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/pipeline/pipeline.hpp"

namespace fused_preact {
namespace sm90 {

// CUTLASS's own fprop collective (SS: both operands from smem) for the same tile and stage count:
// the base whose producer side and parameters the fused mainloop reuses.
// StageCountType: cutlass::conv::collective::StageCount<n> or StageCountAutoCarveout<epilogue bytes>.
template <class T, class TileShape, class StageCountType>
using FpropSsCollective = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop,
    T, cutlass::layout::TensorNHWC, 8,  // x: NHWC, 16-byte aligned channel vectors
    T, cutlass::layout::TensorNHWC, 8,  // w: KRSC
    float, TileShape, cute::Shape<cute::_1, cute::_1, cute::_1>, StageCountType,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;

namespace detail {

// Compile-time checks of the register fragment the transform works on (the A operand of the RS
// wgmma, as partitioned by CUTLASS's TiledMMA): `Coord` maps fragment index -> (m, k) offset in the
// tile (a partitioned identity tensor), `Frag` maps fragment index -> register offset.
//   1. elements 2j and 2j+1 are channels k, k+1 of the same row m, stored in adjacent 16-bit
//      halves of one 32-bit register (2j even): one packed cvt and one mask per register;
//   2. element i of k-block b has the row of element i of block 0 and the channel 16·b further, so
//      the padding test of block 0's rows serves every block (the flat index of (i, b) is
//      i + elements-per-block · b: colexicographic over (MMA, MMA_M, MMA_K)).
template <class CoordLayout, class FragLayout, int kBlock, int kPerBlock>
constexpr bool pairs_share_row_and_register() {
  bool ok = true;
  cute::for_each(cute::make_int_sequence<kPerBlock / 2>{}, [&](auto j) {
    constexpr int i = 2 * decltype(j)::value;
    constexpr int at = i + kPerBlock * kBlock;  // flat (colexicographic) index of (i, k-block)
    constexpr auto c0 = CoordLayout{}(cute::Int<at>{});
    constexpr auto c1 = CoordLayout{}(cute::Int<at + 1>{});
    constexpr auto r0 = CoordLayout{}(cute::Int<i>{});
    constexpr int f0 = FragLayout{}(cute::Int<at>{});
    constexpr int f1 = FragLayout{}(cute::Int<at + 1>{});
    ok = ok && int(cute::get<0>(c1)) == int(cute::get<0>(c0)) && int(cute::get<1>(c1)) == int(cute::get<1>(c0)) + 1 &&
         f1 == f0 + 1 && f0 % 2 == 0 && int(cute::get<0>(c0)) == int(cute::get<0>(r0)) &&
         int(cute::get<1>(c0)) == int(cute::get<1>(r0)) + 16 * kBlock;
  });
  return ok;
}

}  // namespace detail

// Channels the per-CTA scale/shift table of FpropBnReluMainloop holds (can_implement refuses larger
// C), and its smem bytes (to carve out of the stage count). 32 KiB: with the six 32 KiB stages of
// the 128x128x64 tile the kernel stays under sm_90's 227 KiB (CUTLASS's non-persistent kernel puts
// the epilogue's smem in a union with the mainloop's).
constexpr int kFpropTableChannels = 4096;
constexpr int kFpropTableBytes = kFpropTableChannels / 2 * 16;

template <class T, class TileShape_, class StageCountType>
struct FpropBnReluMainloop : FpropSsCollective<T, TileShape_, StageCountType> {
  using Base = FpropSsCollective<T, TileShape_, StageCountType>;
  using ElementA = typename Base::ElementA;
  using ElementB = typename Base::ElementB;
  using TileShape = typename Base::TileShape;
  using SmemLayoutA = typename Base::SmemLayoutA;
  using SmemLayoutB = typename Base::SmemLayoutB;
  using MainloopPipeline = typename Base::MainloopPipeline;
  using PipelineState = typename Base::PipelineState;
  static constexpr int kMaxChannels = kFpropTableChannels;
  // The collective's smem plus the table: entry i = {scale[2i], scale[2i+1], shift[2i], shift[2i+1]},
  // zeros for channels >= C up to the last channel block's end. The consumer warpgroup fills it once
  // per CTA; the producer (CUTLASS's load(), which takes the base type) never touches it.
  struct TensorStorage : Base::TensorStorage {
    alignas(16) float4 act_table[kMaxChannels / 2];
  };
  static_assert(int(sizeof(float4)) * (kMaxChannels / 2) == kFpropTableBytes);
  static constexpr uint32_t kTableBarrier = 0;  // user named barrier id (CUTLASS offsets it past its own)
  using ProblemShape = typename Base::ProblemShape;
  using DispatchPolicy = typename Base::DispatchPolicy;

  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});

  // wgmma with A from registers (RS), B from smem; both K-major as CUTLASS's fprop (channels are the
  // contiguous GEMM-K of both x and w).
  using TiledMma = decltype(cute::make_tiled_mma(cute::GMMA::rs_op_selector<
      T, T, float, cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>, cute::GMMA::Major::K,
      cute::GMMA::Major::K>()));
  // smem -> register copy of A in the wgmma register layout: ldmatrix .x4 (a warp's 16 rows x 16
  // channels of a k-block in one instruction, four registers per thread) from the swizzled K-major
  // tile; make_tiled_copy_A tiles it to the RS TiledMMA's A layout (checked against the PTX
  // definition of ldmatrix in checks/sm90_layout_checks.cu).
  using SmemCopyAtomA = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, T>;

  static_assert(cute::is_same_v<typename DispatchPolicy::Schedule, cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>,
                "mma() takes its m-tile from blockIdx.x: only the non-persistent schedule computes one tile per CTA");
  static_assert(cute::size(typename DispatchPolicy::ClusterShape{}) == 1, "1x1x1 cluster (m-tile = blockIdx.x)");
  static_assert(cute::size(TiledMma{}) == cutlass::NumThreadsPerWarpGroup, "one consumer warpgroup");
  static_assert(cute::size(typename Base::TiledMma{}) == cute::size(TiledMma{}), "same thread count as CUTLASS's collective");
  // The kernel and the epilogue partition the accumulators with this TiledMma: the C layout must be
  // that of CUTLASS's SS collective.
  static_assert(cute::is_same_v<typename TiledMma::Atom::LayoutC_TV, typename Base::TiledMma::Atom::LayoutC_TV> &&
                    cute::is_same_v<typename TiledMma::Atom::Shape_MNK, typename Base::TiledMma::Atom::Shape_MNK>,
                "RS and SS atoms must share the accumulator layout");
  static_assert(!cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value &&
                    cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeB>::value,
                "A from registers, B from smem descriptors");
  static_assert(cute::sizeof_bits_v<T> == 16, "16-bit operands: two channels per 32-bit register");

  struct Arguments : Base::Arguments {
    ActivationTransform act;
  };
  struct Params : Base::Params {
    ActivationTransform act;
  };

  static Params to_underlying_arguments(ProblemShape const &problem_shape, Arguments const &args, void *workspace) {
    Params params;
    static_cast<typename Base::Params &>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.act = args.act;
    return params;
  }

  template <class ProblemShapeT>
  static bool can_implement(ProblemShapeT const &problem_shape, Arguments const &args) {
    ActivationTransform const &t = args.act;
    bool ok = Base::can_implement(problem_shape, args);
    ok = ok && t.scale != nullptr && t.shift != nullptr && t.C % 8 == 0;
    ok = ok && reinterpret_cast<uintptr_t>(t.scale) % 8 == 0 && reinterpret_cast<uintptr_t>(t.shift) % 8 == 0;
    ok = ok && t.channel_blocks == (t.C + kTileK - 1) / kTileK && t.M > 0;
    ok = ok && t.channel_blocks * kTileK <= kMaxChannels;
    return ok;
  }

  // Consumer: accumulate the tile. Same pipeline contract as CUTLASS's RS mainloops: all smem
  // stages but the last are released here, the last one by mma_tail.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC &accum, int k_tile_count,
                          int thread_idx, TensorStorage &shared_tensors, Params const &params) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");

    Tensor sA_ = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sA = as_position_independent_swizzle_tensor(sA_);
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});   // (BLK_N,BLK_K,PIPE)

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCsA = thr_mma.partition_A(sA);                                 // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrA_mma = thr_mma.partition_fragment_A(sA(_, _, Int<0>{}));    // (MMA,MMA_M,MMA_K) fed to wgmma
    Tensor tCrA_load = make_fragment_like(tCrA_mma);                       // raw x, same layout
    Tensor tCsB = thr_mma.partition_B(sB);                                 // (MMA,MMA_N,MMA_K,PIPE)
    Tensor tCrB = thr_mma.make_fragment_B(tCsB);                           // smem descriptors

    auto smem_tiled_copy_A = make_tiled_copy_A(SmemCopyAtomA{}, tiled_mma);
    auto smem_thr_copy_A = smem_tiled_copy_A.get_thread_slice(thread_idx);
    Tensor tCsA_copy = smem_thr_copy_A.partition_S(sA);                    // (CPY,CPY_M,CPY_K,PIPE)
    Tensor tCrA_copy = smem_thr_copy_A.retile_D(tCrA_load);                // (CPY,CPY_M,CPY_K)

    // (m, k) of every fragment element within the (BLK_M, BLK_K) tile: the identity tensor
    // partitioned exactly as the smem tile the fragment was made from.
    Tensor cA = make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileK>{}));
    Tensor tCcA = thr_mma.partition_A(cA);                                 // (MMA,MMA_M,MMA_K)

    CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(tCrA_copy));             // CPY_M
    CUTE_STATIC_ASSERT_V(size<2>(tCsA) == size<2>(tCrA_copy));             // CPY_K
    CUTE_STATIC_ASSERT_V(size<1>(tCrA_mma) == size<1>(accum));             // MMA_M
    CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<2>(accum));                 // MMA_N
    CUTE_STATIC_ASSERT_V(size<2>(tCsA) == size<2>(tCsB));                  // MMA_K
    CUTE_STATIC_ASSERT_V(size<3>(tCsA) == size<3>(tCsB));                  // PIPE
    CUTE_STATIC_ASSERT_V(size<0>(tCcA) == size<0>(tCrA_mma) && size<1>(tCcA) == size<1>(tCrA_mma) &&
                         size<2>(tCcA) == size<2>(tCrA_mma));
    CUTE_STATIC_ASSERT_V(Int<DispatchPolicy::Stages>{} == size<2>(sA));

    constexpr int K_BLOCK_MAX = size<2>(tCrA_mma);
    constexpr int K_WAIT_MAX = cute::min(K_BLOCK_MAX - 1, 7);
    static_assert(K_BLOCK_MAX >= 4, "the k-block pipeline below needs at least 4 k-blocks per tile");
    constexpr int kPerBlock = size(tCrA_mma(_, _, 0));
    constexpr int kPairs = kPerBlock / 2;
    {
      // Static layout checks of the fragment (see detail::pairs_share_row_and_register).
      using CoordL = decltype(tCcA.layout());
      using FragL = decltype(tCrA_mma.layout());
      static_assert(is_static<CoordL>::value && is_static<FragL>::value, "static fragment layouts");
      cute::for_each(make_int_sequence<K_BLOCK_MAX>{}, [](auto b) {
        static_assert(detail::pairs_share_row_and_register<CoordL, FragL, decltype(b)::value, kPerBlock>(),
                      "A fragment: a 32-bit register must hold channels (k, k+1) of one row, rows independent of k-block");
      });
    }

    static_assert(fragment_is_compact<decltype(tCrA_mma.layout()), decltype(size(tCrA_mma))::value>() &&
                      fragment_is_compact<decltype(tCrA_load.layout()), decltype(size(tCrA_load))::value>(),
                  "A fragments: register offset = element index");
    using Slots = PairSlotsOf<decltype(tCcA.layout()), kPairs>;
    constexpr int kRowSlots = Slots::rows;
    constexpr int kChanSlots = Slots::chans;
    static_assert(
        [] {
          for (int j = 0; j < kPairs; ++j) {
            if (Slots::chan_off(j) % 2 != 0) return false;
          }
          return true;
        }(),
        "pairs start at even channel offsets (table entries are channel pairs)");

    ActivationTransform const &act = params.act;

    // Scale/shift table of all channel blocks, built once per CTA by the consumer warpgroup.
    float4 *table = shared_tensors.act_table;
    for (int i = thread_idx; i < act.channel_blocks * (kTileK / 2); i += cutlass::NumThreadsPerWarpGroup) {
      table[i] = act_table_entry(act, i);
    }
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, kTableBarrier);

    // The thread's first element (row m0, channel k0; k0 even) and the receptive-field origin of
    // each of its distinct rows.
    int const m0 = int(blockIdx.x) * kTileM + int(get<0>(tCcA(0)));
    int const k0 = int(get<1>(tCcA(0)));
    int row_h0[kRowSlots];
    int row_w0[kRowSlots];
    cute::for_each(make_int_sequence<kRowSlots>{}, [&](auto r) {
      constexpr int kOffset = Slots::slot_row_off(decltype(r)::value);
      output_row_origin(act, m0 + kOffset, row_h0[r], row_w0[r]);
    });

    // Per k-tile: the padding test of each distinct row at the tile's tap, and the tile's part of
    // the table (channel block cb, from the thread's first channel pair).
    uint32_t row_mask[kRowSlots];  // all ones where the row's tap is inside x, zero in the padding
    float4 const *tile_table = table;
    auto prepare_tile = [&](KTileTap const &tap) {
      cute::for_each(make_int_sequence<kRowSlots>{}, [&](auto r) {
        row_mask[r] = tap_in_bounds(act, row_h0[r], row_w0[r], tap.r, tap.s) ? ~0u : 0u;
      });
      tile_table = table + fprop_table_tile_base(tap.cb, k0, kTileK);
    };

    // Transform k-block `b` of the current k-tile: tCrA_load(_,_,b) -> tCrA_mma(_,_,b), a 32-bit
    // register (channel pair of one row) at a time.
    Tensor load32 = recast<uint32_t>(tCrA_load);
    Tensor mma32 = recast<uint32_t>(tCrA_mma);
    static_assert(decltype(size(load32))::value == kPairs * K_BLOCK_MAX && decltype(size(mma32))::value == kPairs * K_BLOCK_MAX);
    auto transform_block = [&](auto b) {
      constexpr int kB = decltype(b)::value;
      float4 t[kChanSlots];
      cute::for_each(make_int_sequence<kChanSlots>{}, [&](auto c) {
        constexpr int kEntry = fprop_table_block_offset(Slots::slot_chan_off(decltype(c)::value), kB);
        t[c] = tile_table[kEntry];
      });
      cute::for_each(make_int_sequence<kPairs>{}, [&](auto j) {
        constexpr int kJ = decltype(j)::value;
        constexpr int kReg = kJ + kPairs * kB;
        uint32_t const a = bn_relu_pair<T>(load32(kReg), t[Slots::chan_slot(kJ)]);
        mma32(kReg) = a & row_mask[Slots::row_slot(kJ)];
      });
    };
    auto copy_block = [&](int b, int stage) { copy(smem_tiled_copy_A, tCsA_copy(_, _, b, stage), tCrA_copy(_, _, b)); };

    PipelineState smem_pipe_release = smem_pipe_read;
    // After the first k-tile: issue the wgmma of one k-block and retire all but the last K_WAIT_MAX;
    // once the last k-block of a tile is issued, every wgmma of the previous tile is done and its
    // smem stage is released.
    auto mma_block = [&](int k_block, int read_stage) {
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA_mma(_, _, k_block), tCrB(_, _, k_block, read_stage), accum);
      warpgroup_commit_batch();
      warpgroup_wait<K_WAIT_MAX>();
      if (k_block == K_BLOCK_MAX - 1) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
    };
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    KTileTap tap;  // filter tap of the k-tile whose blocks are being transformed
    prepare_tile(tap);

    warpgroup_fence_operand(accum);

    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    // ------------------------------------------------------------------------------ first k-tile
    {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int const read_stage = smem_pipe_read.index();
      ++smem_pipe_read;
      barrier_token = pipeline.consumer_try_wait(smem_pipe_read);

      copy_block(0, read_stage);
      copy_block(1, read_stage);
      transform_block(Int<0>{});

      cute::for_each(make_int_sequence<K_BLOCK_MAX>{}, [&](auto kb) {
        constexpr int k_block = decltype(kb)::value;
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA_mma(_, _, k_block), tCrB(_, _, k_block, read_stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
        if constexpr (k_block < K_BLOCK_MAX - 2) {
          copy_block(k_block + 2, read_stage);
        }
        if constexpr (k_block < K_BLOCK_MAX - 1) {
          transform_block(Int<k_block + 1>{});
        }
      });

      --k_tile_count;
      if (k_tile_count > 0) {
        pipeline.consumer_wait(smem_pipe_read, barrier_token);
        copy_block(0, smem_pipe_read.index());
        copy_block(1, smem_pipe_read.index());
        // The wgmma that read block 0 of this tile must be done before block 0 is overwritten.
        warpgroup_wait<K_WAIT_MAX>();
        tap.advance(act);
        prepare_tile(tap);
        transform_block(Int<0>{});
      }
    }
    if (k_tile_count == 0) {
      warpgroup_fence_operand(accum);
      return;
    }

    // ------------------------------------------------------------------------- middle k-tiles
    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 1; --k_tile_count) {
      int const read_stage = smem_pipe_read.index();
      ++smem_pipe_read;
      warpgroup_fence_operand(accum);
      cute::for_each(make_int_sequence<K_BLOCK_MAX>{}, [&](auto kb) {
        constexpr int k_block = decltype(kb)::value;
        mma_block(k_block, read_stage);
        if constexpr (k_block == 0) {
          barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
        }
        if constexpr (k_block == K_BLOCK_MAX - 1) {
          pipeline.consumer_wait(smem_pipe_read, barrier_token);
          copy_block(0, smem_pipe_read.index());
          copy_block(1, smem_pipe_read.index());
          tap.advance(act);
          prepare_tile(tap);
          transform_block(Int<0>{});
        } else {
          if constexpr (k_block < K_BLOCK_MAX - 2) {
            copy_block(k_block + 2, read_stage);
          }
          transform_block(Int<k_block + 1>{});
        }
      });
      warpgroup_fence_operand(accum);
    }

    // --------------------------------------------------------------------------- last k-tile
    warpgroup_fence_operand(accum);
    {
      int const read_stage = smem_pipe_read.index();
      warpgroup_fence_operand(accum);
      cute::for_each(make_int_sequence<K_BLOCK_MAX>{}, [&](auto kb) {
        constexpr int k_block = decltype(kb)::value;
        mma_block(k_block, read_stage);
        if constexpr (k_block < K_BLOCK_MAX - 2) {
          copy_block(k_block + 2, read_stage);
        }
        if constexpr (k_block < K_BLOCK_MAX - 1) {
          transform_block(Int<k_block + 1>{});
        }
      });
    }
    warpgroup_fence_operand(accum);
  }

  // Wait for the last wgmmas and release the last smem stage (the one mma() keeps).
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release, int k_tile_count) {
    smem_pipe_release.advance(k_tile_count - 1);
    cute::warpgroup_wait<0>();
    pipeline.consumer_release(smem_pipe_release);
  }
};

}  // namespace sm90
}  // namespace fused_preact
