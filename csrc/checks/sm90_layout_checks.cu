// Host-side checks of the thread -> element mappings and the padding/tap arithmetic of the sm90
// kernels, runnable without a GPU (CuTe's layout algebra and the sm90_common.cuh helpers are host
// code too). Built and run by .ci/compile_csrc.sh and tests/test_csrc.py; exits non-zero on the
// first failure. What it checks:
//   1. fprop (sm90_fprop_mainloop.cuh): the register-sourced A fragment of the RS TiledMMA, located
//      with a partitioned identity tensor, covers the 128x64 x tile exactly once over the 128 threads;
//      each 32-bit register holds channels (k, k+1) of one row; rows do not depend on the k-block.
//      The ldmatrix copy into that fragment, simulated per the PTX definition of ldmatrix .x4,
//      delivers each element to the register the wgmma expects it in. The row/channel slots
//      (PairSlotsOf) give every register's row and channels, and the scale/shift table (filled
//      with act_table_entry, read at fprop_table_tile_base + fprop_table_block_offset) holds that
//      channel pair's scale/shift, zeros past C, for partial channel blocks.
//   2. bn_relu_pair / unpack_pair (sm90_common.cuh) against the definition for fp16 and bf16,
//      NaN, ±inf, ±0, subnormal and large values, scale/shift beyond fp16's range.
//   3. wgrad (sm90_conv_wgrad.cu): the 16-byte transform copy covers the 128x64 x tile exactly once,
//      a thread's vector is 8 consecutive channels of one pixel and its channels do not change with
//      the pixel; the padding ballot (wgrad_lane_pixel, wgrad_ballot_bit) gives each thread its own
//      pixels' bits; the accumulator pairs the epilogue stores are adjacent output columns; the
//      n-tile coordinate gives the channel block and filter tap the transform and the epilogue use.
//   4. KTileTap walks k-tiles in CUTLASS's fprop GEMM-K order (channel block, s, r) — checked against
//      CuTe's own tiling of the (C, S, R) mode as CUTLASS's collective and kernel do it — and
//      output_row_origin + tap_in_bounds decide padding exactly as the definition of the
//      convolution, for strided, dilated and padded geometries (brute force); so does PixelWalk
//      (the wgrad's per-lane pixel advanced by carries, one k-tile per step) from every start.
#include "sm90_common.cuh"

#include "cute/tensor.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/atom/copy_atom.hpp"
#include "cutlass/gemm/collective/builders/sm90_common.inl"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace cute;
using fused_preact::ConvGeometry;
namespace sm90 = fused_preact::sm90;

static int failures = 0;
#define CHECK(cond, ...)                        \
  do {                                          \
    if (!(cond)) {                              \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                 \
      std::printf("\n");                        \
      if (++failures > 20) std::exit(1);        \
    }                                           \
  } while (0)

template <class T>
void check_fprop_fragment() {
  constexpr int M = 128, K = 64;
  // The TiledMMA of FpropBnReluMainloop (same selector and tile).
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<T, T, float, Shape<Int<M>, _128, Int<K>>, GMMA::Major::K, GMMA::Major::K>()));
  std::vector<int> hits(M * K, 0);
  for (int t = 0; t < 128; ++t) {
    auto thr = TiledMma{}.get_thread_slice(t);
    Tensor c = thr.partition_A(make_identity_tensor(make_shape(Int<M>{}, Int<K>{})));  // (MMA, MMA_M, MMA_K)
    int const per_block = size<0>(c) * size<1>(c);
    for (int b = 0; b < size<2>(c); ++b) {
      for (int i = 0; i < per_block; ++i) {
        int const m = get<0>(c(i + per_block * b)), k = get<1>(c(i + per_block * b));
        hits[m * K + k] += 1;
        CHECK(m == int(get<0>(c(i))), "fprop: row of element %d changes with k-block %d (thread %d)", i, b, t);
        CHECK(k == int(get<1>(c(i))) + 16 * b, "fprop: k-block %d is not 16 channels further (thread %d)", b, t);
        if (i % 2 == 1) {
          int const m0 = get<0>(c(i - 1 + per_block * b)), k0 = get<1>(c(i - 1 + per_block * b));
          CHECK(m0 == m && k0 + 1 == k && k0 % 2 == 0, "fprop: elements %d,%d are not a channel pair (thread %d)",
                i - 1, i, t);
        }
      }
    }
  }
  for (int i = 0; i < M * K; ++i) {
    CHECK(hits[i] == 1, "fprop: element (%d, %d) covered %d times", i / K, i % K, hits[i]);
  }
}

// The smem -> register copy of the fprop A operand (ldmatrix .x4, tiled by make_tiled_copy_A on the
// RS TiledMMA) simulated per the PTX definition of ldmatrix: in each .x4 the lanes 8i..8i+7 give the
// row addresses of 8x8 matrix i, and lane t receives in register i the elements (t/4, 2(t%4)) and
// (t/4, 2(t%4)+1) of matrix i. Every register must receive the (m, k) the wgmma expects there.
template <class T>
void check_fprop_ldmatrix_copy() {
  constexpr int M = 128, K = 64;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<T, T, float, Shape<Int<M>, _128, Int<K>>, GMMA::Major::K, GMMA::Major::K>()));
  auto tiled_copy = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, T>{}, TiledMma{});
  auto cA = make_identity_tensor(make_shape(Int<M>{}, Int<K>{}));
  for (int warp = 0; warp < 4; ++warp) {
    // Source rows and expected destinations of every lane, per copy instruction (CPY_M, CPY_K).
    using Src = decltype(tiled_copy.get_thread_slice(0).partition_S(cA));
    using Dst = decltype(tiled_copy.get_thread_slice(0).retile_D(TiledMma{}.get_thread_slice(0).partition_A(cA)));
    std::vector<Src> src;
    std::vector<Dst> dst;
    for (int lane = 0; lane < 32; ++lane) {
      int const t = 32 * warp + lane;
      src.push_back(tiled_copy.get_thread_slice(t).partition_S(cA));
      dst.push_back(tiled_copy.get_thread_slice(t).retile_D(TiledMma{}.get_thread_slice(t).partition_A(cA)));
    }
    CHECK(size<0>(src[0]) == 8 && size<0>(dst[0]) == 8, "ldmatrix: 8 values per lane and instruction");
    for (int cm = 0; cm < size<1>(src[0]); ++cm) {
      for (int ck = 0; ck < size<2>(src[0]); ++ck) {
        for (int lane = 0; lane < 32; ++lane) {
          // The row this lane addresses: 8 consecutive channels of one row.
          for (int v = 1; v < 8; ++v) {
            CHECK(get<0>(src[lane](v, cm, ck)) == get<0>(src[lane](0, cm, ck)) &&
                      int(get<1>(src[lane](v, cm, ck))) == int(get<1>(src[lane](0, cm, ck))) + v,
                  "ldmatrix: lane %d of warp %d does not address 8 consecutive channels", lane, warp);
          }
          for (int i = 0; i < 4; ++i) {
            auto const row = src[8 * i + lane / 4](0, cm, ck);  // matrix i, row lane/4
            for (int h = 0; h < 2; ++h) {
              auto const got = dst[lane](2 * i + h, cm, ck);
              int const m = get<0>(row), k = int(get<1>(row)) + 2 * (lane % 4) + h;
              CHECK(int(get<0>(got)) == m && int(get<1>(got)) == k,
                    "ldmatrix: warp %d lane %d reg %d.%d gets (%d, %d), the wgmma expects (%d, %d)", warp, lane, i, h, m,
                    k, int(get<0>(got)), int(get<1>(got)));
            }
          }
        }
      }
    }
  }
}

// The transform's row and channel slots (sm90::PairSlotsOf) and the scale/shift table lookup of
// FpropBnReluMainloop, for every thread, k-block, pair and channel block, C with partial blocks:
// pair j of k-block b is (m0 + slot_row_off(row_slot(j)), k0 + slot_chan_off(chan_slot(j)) + 16b) and
// the table entry it reads holds that channel pair's scale/shift (zeros past C).
template <class T>
void check_fprop_slots_and_table(int C) {
  constexpr int M = 128, K = 64;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<T, T, float, Shape<Int<M>, _128, Int<K>>, GMMA::Major::K, GMMA::Major::K>()));
  auto cA = make_identity_tensor(make_shape(Int<M>{}, Int<K>{}));
  using CoordL = decltype(TiledMma{}.get_thread_slice(0).partition_A(cA).layout());
  constexpr int kPerBlock = decltype(size<0>(CoordL{}) * size<1>(CoordL{}))::value;
  constexpr int kPairs = kPerBlock / 2;
  using Slots = sm90::PairSlotsOf<CoordL, kPairs>;
  CHECK(Slots::rows == 4 && Slots::chans == 2, "fprop slots: %d rows, %d channel pairs per k-block", Slots::rows,
        Slots::chans);

  ConvGeometry g = {};
  g.C = C;
  g.N = g.H = g.W = g.P = g.Q = g.R = g.S = g.K = 1;
  std::vector<float> scale(C), shift(C);
  for (int c = 0; c < C; ++c) {
    scale[c] = 1.0f + c;
    shift[c] = -0.5f - c;
  }
  sm90::ActivationTransform const act = sm90::make_activation_transform(g, scale.data(), shift.data(), K);
  std::vector<float4> table(act.channel_blocks * K / 2);
  for (int i = 0; i < int(table.size()); ++i) {
    table[i] = sm90::act_table_entry(act, i);
  }
  for (int t = 0; t < 128; ++t) {
    auto c = TiledMma{}.get_thread_slice(t).partition_A(cA);
    int const m0 = get<0>(c(0)), k0 = get<1>(c(0));
    CHECK(k0 % 2 == 0, "fprop: first channel of thread %d is odd", t);
    for (int b = 0; b < size<2>(c); ++b) {
      for (int j = 0; j < kPairs; ++j) {
        auto const e = c(2 * j + kPerBlock * b);
        int const m = m0 + Slots::slot_row_off(Slots::row_slot(j));
        int const k = k0 + Slots::slot_chan_off(Slots::chan_slot(j)) + 16 * b;
        CHECK(int(get<0>(e)) == m && int(get<1>(e)) == k, "fprop slots: thread %d block %d pair %d", t, b, j);
        for (int cb = 0; cb < act.channel_blocks; ++cb) {
          float4 const got = table[sm90::fprop_table_tile_base(cb, k0, K) +
                                   sm90::fprop_table_block_offset(Slots::slot_chan_off(Slots::chan_slot(j)), b)];
          int const ch = cb * K + k;
          bool const in = ch < C;
          CHECK(got.x == (in ? scale[ch] : 0.f) && got.y == (in ? scale[ch + 1] : 0.f) &&
                    got.z == (in ? shift[ch] : 0.f) && got.w == (in ? shift[ch + 1] : 0.f),
                "fprop table: channel %d (C = %d)", ch, C);
        }
      }
    }
  }
}

// bn_relu_pair against the definition, value by value: x -> fp32 exactly, fmaf(x, scale, shift),
// relu with NaN kept and -inf -> 0, rounded to the operand type (round to nearest even).
template <class T>
void check_bn_relu_pair() {
  std::vector<float> const xs = {0.f, -0.f, 1.f, -1.f, 3.25f, -7.5f, 1e-3f, 6e4f, -6e4f, 1e30f,
                                 INFINITY, -INFINITY, NAN, 5.96e-8f, 0.1f};
  std::vector<float4> const ts = {make_float4(1.f, 2.f, 0.f, -1.f), make_float4(9e4f, -9e4f, 1e5f, 3.f),
                                  make_float4(0.f, 0.f, 2.f, -2.f), make_float4(-1.f, 0.5f, 0.f, 0.25f)};
  auto bits = [](T v) { return uint32_t(v.raw()); };
  for (float lo : xs) {
    for (float hi : xs) {
      T const xl(lo), xh(hi);
      uint32_t const packed = bits(xl) | (bits(xh) << 16);
      float2 const f = sm90::unpack_pair<T>(packed);
      CHECK((std::isnan(f.x) && std::isnan(float(xl))) || f.x == float(xl), "unpack lo %g", double(lo));
      CHECK((std::isnan(f.y) && std::isnan(float(xh))) || f.y == float(xh), "unpack hi %g", double(hi));
      for (float4 const &t : ts) {
        uint32_t const got = sm90::bn_relu_pair<T>(packed, t);
        float const z[2] = {std::fmaf(float(xl), t.x, t.z), std::fmaf(float(xh), t.y, t.w)};
        for (int h = 0; h < 2; ++h) {
          T const out = T::bitcast(uint16_t(got >> (16 * h)));
          float const ref = std::isnan(z[h]) ? NAN : (z[h] < 0.f ? 0.f : z[h]);
          bool const ok = std::isnan(ref) ? std::isnan(float(out)) : bits(out) == bits(T(ref)) ||
                                                                        (ref == 0.f && float(out) == 0.f);
          CHECK(ok, "bn_relu_pair: x=%g scale=%g shift=%g gives %g, expected %g", double(h ? hi : lo),
                double(h ? t.y : t.x), double(h ? t.w : t.z), double(float(out)), double(T(ref)));
        }
      }
    }
  }
}

template <class T>
void check_wgrad_mappings() {
  constexpr int N = 128, K = 64;
  using Copy = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, T>{}, Layout<Shape<_16, _8>>{},
                                        Layout<Shape<_8, _1>>{}));
  std::vector<int> hits(N * K, 0);
  for (int t = 0; t < 128; ++t) {
    Tensor c = Copy{}.get_thread_slice(t).partition_S(make_identity_tensor(make_shape(Int<N>{}, Int<K>{})));
    CHECK(size<0>(c) == 8 && size<1>(c) == 1, "wgrad: unexpected copy partition");
    int const n0 = get<0>(c(0, 0, 0));
    for (int px = 0; px < size<2>(c); ++px) {
      int const k = get<1>(c(0, 0, px));
      CHECK(int(get<0>(c(0, 0, px))) == n0, "wgrad: channel chunk changes with the pixel (thread %d)", t);
      for (int v = 0; v < 8; ++v) {
        int const n = get<0>(c(v, 0, px)), kv = get<1>(c(v, 0, px));
        CHECK(n == n0 + v && kv == k, "wgrad: vector of thread %d is not 8 channels of one pixel", t);
        hits[n * K + kv] += 1;
      }
    }
  }
  for (int i = 0; i < N * K; ++i) {
    CHECK(hits[i] == 1, "wgrad: x tile element (%d, %d) covered %d times", i / K, i % K, hits[i]);
  }
  // The padding ballot: pixel px of thread t is the one lane wgrad_ballot_bit(t, px) of t's warp
  // tests (sm90::wgrad_lane_pixel), and lanes 16..31 repeat lanes 0..15.
  for (int t = 0; t < 128; ++t) {
    Tensor c = Copy{}.get_thread_slice(t).partition_S(make_identity_tensor(make_shape(Int<N>{}, Int<K>{})));
    for (int px = 0; px < size<2>(c); ++px) {
      int const bit = sm90::wgrad_ballot_bit(t, px);
      CHECK(bit >= 0 && bit < 16 && sm90::wgrad_lane_pixel(t / 32, bit) == int(get<1>(c(0, 0, px))) &&
                sm90::wgrad_lane_pixel(t / 32, bit + 16) == int(get<1>(c(0, 0, px))),
            "wgrad ballot: thread %d pixel %d (bit %d)", t, px, bit);
    }
  }
  // Accumulator pairs of the SS TiledMMA of CUTLASS's wgrad collective (128 x 128 tile, one warpgroup).
  using TiledMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<T, T, float, Shape<_128, _128, _64>, GMMA::Major::MN, GMMA::Major::MN>()));
  std::vector<int> acc_hits(128 * 128, 0);
  for (int t = 0; t < 128; ++t) {
    Tensor c = TiledMma{}.get_thread_slice(t).partition_C(make_identity_tensor(make_shape(_128{}, _128{})));
    for (int i = 0; i < size(c); ++i) {
      acc_hits[int(get<0>(c(i))) * 128 + int(get<1>(c(i)))] += 1;
      if (i % 2 == 1) {
        CHECK(get<0>(c(i)) == get<0>(c(i - 1)) && int(get<1>(c(i))) == int(get<1>(c(i - 1))) + 1,
              "wgrad epilogue: accumulators %d,%d of thread %d are not adjacent columns", i - 1, i, t);
      }
    }
  }
  for (int i = 0; i < 128 * 128; ++i) {
    CHECK(acc_hits[i] == 1, "wgrad: accumulator (%d, %d) covered %d times", i / 128, i % 128, acc_hits[i]);
  }
}

// Brute force: output position m, filter tap (r, s) -> in bounds per the definition of the conv.
void check_padding_and_taps(ConvGeometry const &g, int tile_k) {
  sm90::ActivationTransform const t = sm90::make_activation_transform(g, nullptr, nullptr, tile_k);
  int const cb_count = (g.C + tile_k - 1) / tile_k;
  CHECK(t.channel_blocks == cb_count, "channel blocks");
  // k-tile order: channel block fastest, then s, then r (CUTLASS's (C, S, R) GEMM-K of fprop).
  sm90::KTileTap tap;
  for (int kt = 0; kt < cb_count * g.S * g.R; ++kt) {
    CHECK(tap.cb == kt % cb_count && tap.s == (kt / cb_count) % g.S && tap.r == kt / (cb_count * g.S),
          "k-tile %d: tap (%d, %d, %d)", kt, tap.cb, tap.s, tap.r);
    tap.advance(t);
  }
  for (int m = -1; m <= g.N * g.P * g.Q; ++m) {
    int h0, w0;
    sm90::output_row_origin(t, m, h0, w0);
    bool const row_exists = m >= 0 && m < g.N * g.P * g.Q;
    int const q = row_exists ? m % g.Q : 0, p = row_exists ? (m / g.Q) % g.P : 0;
    for (int r = 0; r < g.R; ++r) {
      for (int s = 0; s < g.S; ++s) {
        int const h = p * g.stride_h - g.pad_h + r * g.dilation_h;
        int const w = q * g.stride_w - g.pad_w + s * g.dilation_w;
        bool const expect = row_exists && h >= 0 && h < g.H && w >= 0 && w < g.W;
        CHECK(sm90::tap_in_bounds(t, h0, w0, r, s) == expect, "padding test: m=%d r=%d s=%d", m, r, s);
      }
    }
  }
}

// PixelWalk (the wgrad's per-lane pixel, one k-tile of 64 positions per step) against the
// definition, from every start position of the first k-tiles, through M and past it.
void check_pixel_walk(ConvGeometry const &g) {
  sm90::ActivationTransform const t = sm90::make_activation_transform(g, nullptr, nullptr, 128);
  int const M = g.N * g.P * g.Q;
  for (int m0 = 0; m0 < 64 * 3; ++m0) {
    sm90::PixelWalk walk(t, m0, 64);
    for (int m = m0; m < M + 128; m += 64, walk.advance(t, 64)) {
      int const q = m % g.Q, p = (m / g.Q) % g.P;
      CHECK(walk.m == m && (m >= M || (walk.p == p && walk.q == q)), "pixel walk from %d at %d", m0, m);
      for (int r = 0; r < g.R; ++r) {
        for (int s = 0; s < g.S; ++s) {
          int const h = p * g.stride_h - g.pad_h + r * g.dilation_h;
          int const w = q * g.stride_w - g.pad_w + s * g.dilation_w;
          bool const expect = m < M && h >= 0 && h < g.H && w >= 0 && w < g.W;
          CHECK(walk.valid(t, r, s) == expect, "pixel walk from %d: m=%d r=%d s=%d", m0, m, r, s);
        }
      }
    }
  }
}

// CUTLASS's fprop collective tiles the GEMM-K mode (C, S, R) of its operands with the tile shape
// (BLK_M, BLK_N, Shape<BLK_K>) and Step<_1, X, _1> (load_init) and walks the k-tiles with a colex
// coordinate iterator (the kernel): the k-tile t, element k_local must be channel cb·BLK_K + k_local
// of tap (s, r) with (cb, s, r) the colex decomposition of t — what KTileTap assumes.
template <int kTileK>
void check_fprop_k_tiling(int C, int S, int R) {
  auto mK = make_identity_tensor(make_shape(256, make_shape(C, S, R)));  // (M, (C, S, R))
  auto gK = local_tile(mK, Shape<_128, _128, Shape<Int<kTileK>>>{}, make_coord(_, _, _), Step<_1, X, _1>{});
  auto tiles = shape<3>(gK);
  int const cb_count = (C + kTileK - 1) / kTileK;
  CHECK(int(size(tiles)) == cb_count * S * R, "k-tiles: %d, expected %d", int(size(tiles)), cb_count * S * R);
  sm90::ActivationTransform t;
  t.channel_blocks = cb_count;
  t.S = S;
  sm90::KTileTap tap;
  auto it = make_coord_iterator(tiles);
  for (int kt = 0; kt < int(size(tiles)); ++kt, ++it, tap.advance(t)) {
    for (int k = 0; k < kTileK; k += 7) {
      auto c = gK(0, k, 0, *it);  // (m, (c, s, r))
      CHECK(int(get<1, 0>(c)) == tap.cb * kTileK + k && int(get<1, 1>(c)) == tap.s && int(get<1, 2>(c)) == tap.r,
            "k-tile %d element %d: CUTLASS tiling gives (%d, %d, %d), KTileTap (%d, %d, %d)", kt, k,
            int(get<1, 0>(c)), int(get<1, 1>(c)), int(get<1, 2>(c)), tap.cb * kTileK + k, tap.s, tap.r);
    }
  }
}

// The wgrad kernel reads its filter tap and channel block from the n-tile coordinate, idx2crd of
// blockIdx.y over the tiled (C, S, R) mode of operand B: element n_local of tile (cb, s, r) must be
// channel cb·128 + n_local of tap (s, r).
void check_wgrad_n_tiling(int C, int S, int R) {
  auto mB = make_identity_tensor(make_shape(make_shape(C, S, R), 1024));  // ((C, S, R), N·P·Q)
  auto gB = local_tile(mB, Shape<_128, Shape<_128>, Shape<_64>>{}, make_coord(_, _, _), Step<X, _1, _1>{});
  int const tiles = int(size(shape<2>(gB)));
  CHECK(tiles == (C + 127) / 128 * S * R, "wgrad n-tiles %d", tiles);
  for (int y = 0; y < tiles; ++y) {
    auto n = idx2crd(y, shape<2>(gB));
    int const cb = get<0>(n), s = get<1>(n), r = get<2>(n);
    for (int nl = 0; nl < 128; nl += 9) {
      auto c = gB(nl, 0, n, 0);
      CHECK(int(get<0, 0>(c)) == cb * 128 + nl && int(get<0, 1>(c)) == s && int(get<0, 2>(c)) == r,
            "wgrad n-tile %d element %d", y, nl);
    }
  }
}

ConvGeometry geometry(int N, int H, int W, int C, int K, int R, int S, int pad, int stride, int dil) {
  ConvGeometry g{};
  g.N = N; g.H = H; g.W = W; g.C = C; g.K = K; g.R = R; g.S = S;
  g.pad_h = g.pad_w = pad; g.stride_h = g.stride_w = stride; g.dilation_h = g.dilation_w = dil;
  g.P = (H + 2 * pad - dil * (R - 1) - 1) / stride + 1;
  g.Q = (W + 2 * pad - dil * (S - 1) - 1) / stride + 1;
  return g;
}

int main() {
  check_fprop_fragment<cutlass::half_t>();
  check_fprop_fragment<cutlass::bfloat16_t>();
  check_fprop_ldmatrix_copy<cutlass::half_t>();
  check_fprop_ldmatrix_copy<cutlass::bfloat16_t>();
  for (int C : {8, 24, 64, 136, 200}) {
    check_fprop_slots_and_table<cutlass::half_t>(C);
    check_fprop_slots_and_table<cutlass::bfloat16_t>(C);
  }
  check_bn_relu_pair<cutlass::half_t>();
  check_bn_relu_pair<cutlass::bfloat16_t>();
  check_wgrad_mappings<cutlass::half_t>();
  check_wgrad_mappings<cutlass::bfloat16_t>();
  ConvGeometry const cases[] = {
      geometry(2, 9, 11, 24, 16, 3, 3, 1, 1, 1),  geometry(3, 10, 10, 72, 40, 3, 3, 1, 2, 1),
      geometry(2, 13, 13, 16, 16, 3, 3, 2, 1, 2), geometry(2, 9, 11, 32, 16, 1, 1, 0, 2, 1),
      geometry(1, 7, 7, 136, 64, 5, 3, 2, 1, 1),  geometry(4, 6, 5, 8, 8, 7, 7, 3, 2, 1),
      geometry(2, 17, 3, 40, 8, 3, 1, 4, 3, 2),
  };
  check_fprop_k_tiling<64>(64, 3, 3);
  check_fprop_k_tiling<64>(24, 3, 3);
  check_fprop_k_tiling<64>(136, 5, 3);
  check_fprop_k_tiling<64>(256, 1, 1);
  check_wgrad_n_tiling(64, 3, 3);
  check_wgrad_n_tiling(200, 3, 5);
  for (ConvGeometry const &g : cases) {
    check_padding_and_taps(g, 64);
    check_padding_and_taps(g, 128);
    check_pixel_walk(g);
  }
  if (failures == 0) {
    std::printf("sm90 layout checks: all passed\n");
  }
  return failures == 0 ? 0 : 1;
}
