// M-grouped FP8 GEMM without padding: D[rows of group g] = A[rows of g] . B[g]^T, BF16 out.
//
// Forward (B = W [G, N, K]) and dgrad (B = W^T [G, K, N]) are the same kernel. Numerics (docs/design.md §3):
// per 128-wide K block the tensor cores form the FP8 partial sum p in a zeroed FP32 fragment (four
// m64n{BLOCK_N}k32 wgmma), then the CUDA cores promote acc = fma(sa * sb, p, acc); BF16 RNE at the end.
// Every output row depends only on its own A row, so valid rows equal the padded path bit for bit.
//
// Structure: persistent grid; warpgroup 0 = one TMA producer thread (registers given away with
// setmaxnreg), warpgroups 1..W = math, each owning 64 rows of the tile: W = 2 for 128-row tiles, W = 3 for
// 192 x 128 ones (the host picks; see the config's note on the four tile shapes). A STAGES-deep mbarrier ring of
// 128B-swizzled A/B tiles plus a scale slot per stage: the tile's A scales (TMA) and the weight scale(s) of the
// K block (cp.async, tracked by the same barrier), so the math loop reads every scale from shared memory and
// has no global load. wgmma descriptors live in uniform registers (common/wgmma.cuh, KmajorSw128Desc).
// TMA needs the innermost start coordinate of a box 16-byte aligned, and a group's first row is arbitrary, so
// the A scales (M-contiguous FP32) are fetched from the row rounded down to a multiple of 4 with 4 extra floats,
// and read at the remainder (the paper's alignment-aware scale load). A rows are the outer TMA dimension and
// load from the exact first row.
// Beyond the paper: only real tiles are scheduled, and a math warpgroup whose 64 rows hold no valid row
// skips its wgmma, promotion and epilogue (it only releases the pipeline stages).
// Output: the paper's descriptor pool and two-phase residual store (common/residual_store.cuh), per warpgroup.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>

#include "megatron_tma/common/groups.cuh"
#include "megatron_tma/common/mbarrier.cuh"
#include "megatron_tma/common/cluster.cuh"
#include "megatron_tma/common/pipeline.cuh"
#include "megatron_tma/common/promotion.cuh"
#include "megatron_tma/common/residual_store.cuh"
#include "megatron_tma/common/tma.cuh"
#include "megatron_tma/common/wgmma.cuh"
#include "megatron_tma/scheduler/m_grouped_pair_scheduler.cuh"
#include "megatron_tma/scheduler/m_grouped_scheduler.cuh"

// Build option: the serial kernels' fixed-stage K loop (mainloop_fixed below), on by default since its A/B on an H100
// (bits identical on every tile; each build's time over DeepGEMM's in the same process x1.03-1.06 better on every
// reference row); =0 builds the general loop alone, for A/B runs.
#ifndef MEGATRON_TMA_MG_FIXED_STAGE
#define MEGATRON_TMA_MG_FIXED_STAGE 1
#endif
// Build option: the serial kernels (192 x 128, 128 x 192) in 2-CTA clusters that share the weight tile (Config::
// kCluster); off until measured on a GPU. DeepGEMM runs its 128 x 192 tiles so on every grid row.
#ifndef MEGATRON_TMA_MG_CLUSTER
#define MEGATRON_TMA_MG_CLUSTER 0
#endif

namespace megatron_tma {

constexpr int kStorePoolSize = 7;  // box heights 1, 2, ..., 64 rows (one math warpgroup's half tile)

struct MGroupedGemmParams {
  CUtensorMap a;                        // e4m3 [M_total, K]: dims (K, M_total), box (128, 128), SW128
  CUtensorMap b;                        // e4m3 [G, N, K]: dims (K, N, G), box (128, B_BOX_N, 1), SW128
  CUtensorMap a_scales;                 // fp32 storage [K/128, ld]: dims (M_total, K/128), box (132, 1)
  CUtensorMap d_pool[kStorePoolSize];   // bf16 [M_total, N]: dims (N, M_total), box (64, 2^k), SW128
  const float* b_scales;                // fp32 [G, ceil(N/128), K/128]
  GroupsArg groups;
  int m_total, n, k;
};

template <int BLOCK_N_, int STAGES_, int MATH_WG_ = 2>
struct MGroupedGemmConfig {
  // MATH_WG math warpgroups of 64 rows each: BLOCK_M = 128 (two) or 192 (three; BLOCK_N 128 only)
  static constexpr int kMathWarpgroups = MATH_WG_, kThreads = 128 * (1 + kMathWarpgroups);
  static constexpr int BLOCK_M = 64 * kMathWarpgroups, BLOCK_N = BLOCK_N_, BLOCK_K = 128, STAGES = STAGES_;
  // (The three-warpgroup producer in a cluster gets 32: at 24 its tile loop spilled; 32 fills the pool exactly.)
  static constexpr int kProducerRegs = kMathWarpgroups == 3 ? (MEGATRON_TMA_MG_CLUSTER ? 32 : 24) : 40;
  static constexpr int kMathRegs = kMathWarpgroups == 3 ? 160 : 232;
  // setmaxnreg.inc takes its registers from the CTA pool, which holds only what setmaxnreg.dec released
  // (the launch gives every thread 64K / kThreads rounded down to 8: 168, or 128 for 512 threads): a split over
  // that budget hangs.
  static_assert(128 * kProducerRegs + 128 * kMathWarpgroups * kMathRegs <= kThreads * ((65536 / kThreads) & ~7),
                "the math warpgroups' setmaxnreg.inc must be covered by the producer's dec");
  static constexpr int A_BYTES = BLOCK_M * BLOCK_K;  // e4m3
  static constexpr int B_BYTES = BLOCK_N * BLOCK_K;
  static constexpr int SA_BOX = BLOCK_M + 4;          // floats fetched per K block (aligned over-fetch)
  static constexpr int SA_BYTES = SA_BOX * 4;         // TMA transaction bytes
  // The stage's weight scales follow the A scales in the slot: one per 128-column weight block the tile touches.
  static constexpr int kBScales = BLOCK_N > 128 ? 2 : 1, SB_OFF = SA_BYTES;
  static constexpr int SA_SLOT = (SA_BYTES + 4 * kBScales + 127) / 128 * 128;  // per stage, 128-byte aligned
  static constexpr int D_HALVES = BLOCK_N / 64;      // 128-byte column chunks of the BF16 tile
  static constexpr int D_BYTES = BLOCK_M * BLOCK_N * 2;
  // shared memory map (offsets from a 1024-aligned base)
  static constexpr int OFF_A = 0;
  static constexpr int OFF_B = OFF_A + STAGES * A_BYTES;
  static constexpr int OFF_D = OFF_B + STAGES * B_BYTES;
  static constexpr int OFF_SA = OFF_D + D_BYTES;
  static constexpr int OFF_BAR = OFF_SA + STAGES * SA_SLOT;
  static constexpr int OFF_SCRATCH = OFF_BAR + 2 * STAGES * 8;
  static constexpr int OFF_GROUPS = OFF_SCRATCH + 256;
  static constexpr int kMaxGroups = 2048;
  static size_t smem_bytes(int num_groups) { return 1024 + OFF_GROUPS + 2 * (num_groups + 1) * sizeof(int); }
  // Four tile shapes (the same bits from each). Three ways of spending two warpgroups' 232 math registers:
  // - 128: one m64n128 wgmma per k32 step and two 64-register partial fragments, so block kb+1 runs on the
  //   tensor cores while block kb is promoted (acc 64 + 2 x 64).
  // - 192: one m64n192 wgmma per k32 step into a single 96-register partial (acc 96 + 96), retired and
  //   promoted after each block as DeepGEMM does; the two warpgroups' blocks interleave on the tensor cores.
  //   Fewer bytes per MAC (shared memory: 1/64 + 1/192 of wgmma operand reads, 1/128 + 1/192 of TMA writes).
  //   The tile straddles two 128-wide weight-scale blocks (promote_row_scaled_split).
  // - 256: two 128-column halves, each with its own B scale, sharing one 64-register partial (no overlap).
  // And 192 x 128 with three math warpgroups at 160 registers (acc 64 + one 64-register partial each), promoted
  // after each block: while one warpgroup promotes, the other two keep the tensor cores busy, and the B tile
  // serves 192 rows. 4-10% ahead of the two-fragment 128 x 128 pipeline where groups are large; behind it where
  // a group's last 192-row tile leaves one or two warpgroups idle (a lone warpgroup cannot hide its promotion).
  // The host picks between the two from M_total / G (instantiations/m_grouped_fp8_gemm.cu).
  static constexpr int N_INSTR = BLOCK_N == 192 ? 192 : 128;  // N of one wgmma instruction
  static constexpr int N_HALVES = BLOCK_N / N_INSTR;
  static constexpr bool kSerial = BLOCK_N == 192 || kMathWarpgroups == 3;  // one partial, promoted per block
  // 2: 2-CTA clusters along M (MEGATRON_TMA_MG_CLUSTER, serial tiles only). A cluster takes two neighbouring row
  // tiles with one column block (scheduler/m_grouped_pair_scheduler.cuh); when both lie in one group they share the
  // weight tile, of which each CTA loads one half (B_BOX_N rows) and multicasts it into both: per K block a CTA
  // reads BLOCK_M + BLOCK_N / 2 rows from L2 instead of BLOCK_M + BLOCK_N. Across a group boundary each CTA loads
  // its own weight tile (two half boxes); a CTA without a row tile (odd tile count) only walks the ring.
  static constexpr int kCluster = (MEGATRON_TMA_MG_CLUSTER && kSerial) ? 2 : 1;
  static constexpr int B_BOX_N = BLOCK_N / kCluster;  // rows of the weight tensor map's box
  static_assert(BLOCK_N == 128 || BLOCK_N == 192 || BLOCK_N == 256, "BLOCK_N is 128, 192 or 256");
  static_assert(kMathWarpgroups == 2 || (kMathWarpgroups == 3 && BLOCK_N == 128), "three warpgroups: 192 x 128");
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) m_grouped_fp8_gemm_kernel(const __grid_constant__ MGroupedGemmParams p) {
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment (128B-swizzle atoms), derived from the __shared__ array so that the compiler keeps
  // shared-memory instructions (STS/LDS) instead of generic ones.
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Cfg::OFF_BAR);
  uint64_t* empty_bar = full_bar + Cfg::STAGES;
  int* scratch = reinterpret_cast<int*>(smem + Cfg::OFF_SCRATCH);
  const int G = p.groups.num_groups;
  int* row_off = reinterpret_cast<int*>(smem + Cfg::OFF_GROUPS);
  int* mtile_off = row_off + G + 1;

  const Pipeline<Cfg::STAGES, Cfg::kCluster> pipe{full_bar, empty_bar};
  if (threadIdx.x == 0) {
    pipe.init(Cfg::kMathWarpgroups * 4 * Cfg::kCluster);  // one release per math warp of the cluster
    tma_prefetch_descriptor(&p.a);
    tma_prefetch_descriptor(&p.b);
    tma_prefetch_descriptor(&p.a_scales);
  }
  // Group offsets and row-tile offsets, built by this CTA from the device tensor (no prep launch).
  block_exclusive_scan(G, [&](int i) { return groups_size(p.groups, i); }, row_off, p.m_total, scratch);
  block_exclusive_scan(
      G, [&](int i) { return (row_off[i + 1] - row_off[i] + Cfg::BLOCK_M - 1) / Cfg::BLOCK_M; }, mtile_off,
      0x7fffffff, scratch);
  // The peer's barriers are initialised before this CTA multicasts into its slots or arrives on them.
  if constexpr (Cfg::kCluster == 2) cluster_sync();

  const int num_kb = p.k / Cfg::BLOCK_K;
  const int n_blocks = (p.n + Cfg::BLOCK_N - 1) / Cfg::BLOCK_N;
  MGroupedScheduler<Cfg::BLOCK_M> sched{row_off, mtile_off, G, n_blocks};
  const MGroupedPairScheduler<Cfg::BLOCK_M> pairs{row_off, mtile_off, G, n_blocks};  // kCluster == 2
  // In clusters each role reads the tile count after its setmaxnreg: held across it (and across the cluster
  // barrier), ptxas spilled it.
  const int num_tiles_here = Cfg::kCluster == 1 ? sched.num_tiles() : 0;
  auto tile_count = [&] { return Cfg::kCluster == 1 ? num_tiles_here : pairs.num_tiles(); };
  // A cluster walks the scheduler's tiles as one CTA would (tile blockIdx.x / kCluster, stride gridDim.x /
  // kCluster). The rank is read where it is used, not held across setmaxnreg (held, it was spilled).
  auto cta_rank = [] { return Cfg::kCluster == 2 ? static_cast<int>(cluster_ctarank()) : 0; };
  // This CTA's row tile of tile t (rows = 0: none), and whether the cluster's two row tiles share the weight tile.
  auto next_tile = [&](int t, bool& shared) {
    if constexpr (Cfg::kCluster == 2) {
      return pairs.get(t, cta_rank(), shared);
    } else {
      shared = false;
      return sched.get(t);
    }
  };
  // Broadcast from lane 0: the compiler then knows the warpgroup index (and all derived from it: the stage
  // descriptors) is warp-uniform and keeps it in uniform registers, which is where wgmma reads descriptors.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      // Each stage carries its weight scales: cp.async copies them into the stage's scale slot, and the stage's
      // barrier waits for those copies too, so the math warps read them from shared memory with the A scales.
      // Loaded by the math warps, the global load sat on their critical path (ncu, 192 x 128: 3.4% of all
      // stall samples on moving it to a uniform register); loaded into the producer's registers, its latency
      // delayed the next stage's TMA issue (-3.6% on the 128 x 128 kernel, whose ring runs nearly empty).
      const int n_b128 = (p.n + 127) / 128;
      PipelineState<Cfg::STAGES> st;
      const int num_tiles = tile_count();
      for (int t = blockIdx.x / Cfg::kCluster; t < num_tiles; t += gridDim.x / Cfg::kCluster) {
        bool shared_b;
        const MTile tile = next_tile(t, shared_b);
        // Cluster: a CTA without a row tile loads nothing (its ring turns on the producer's arrival alone); the
        // weight tile is multicast when the two row tiles share it, else each CTA loads its own whole.
        const bool has_rows = Cfg::kCluster == 1 || tile.rows > 0;
        const int b = tile.n_block * Cfg::BLOCK_N / 128;  // first 128-column weight block under the tile
        const float* bs = p.b_scales + (static_cast<size_t>(tile.group) * n_b128 + b) * num_kb;
        const int hi = b + 1 < n_b128 ? num_kb : 0;  // a 192/256-wide tile at the edge: clamped (never promoted)
        for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
          pipe.producer_wait(st);
          uint8_t* slot = smem + Cfg::OFF_SA + st.stage * Cfg::SA_SLOT;
          if (has_rows) {
            cp_async_4(slot + Cfg::SB_OFF, bs + kb);
            if (Cfg::kBScales == 2) cp_async_4(slot + Cfg::SB_OFF + 4, bs + hi + kb);
            mbar_arrive_on_cp_async(&full_bar[st.stage]);
          }
          uint64_t* bar = pipe.producer_arrive(st, has_rows ? Cfg::A_BYTES + Cfg::B_BYTES + Cfg::SA_BYTES : 0);
          if (!has_rows) continue;
          tma_load_2d(&p.a, bar, smem + Cfg::OFF_A + st.stage * Cfg::A_BYTES, kb * Cfg::BLOCK_K, tile.row_start);
          uint8_t* b_stage = smem + Cfg::OFF_B + st.stage * Cfg::B_BYTES;
          if constexpr (Cfg::kCluster == 2) {
            constexpr int kHalf = Cfg::B_BOX_N * Cfg::BLOCK_K;  // bytes of one half (a multiple of 1024)
            if (shared_b) {
              tma_load_3d_multicast(&p.b, bar, b_stage + cta_rank() * kHalf, kb * Cfg::BLOCK_K,
                                    tile.n_block * Cfg::BLOCK_N + cta_rank() * Cfg::B_BOX_N, tile.group, 0b11);
            } else {
              tma_load_3d(&p.b, bar, b_stage, kb * Cfg::BLOCK_K, tile.n_block * Cfg::BLOCK_N, tile.group);
              tma_load_3d(&p.b, bar, b_stage + kHalf, kb * Cfg::BLOCK_K, tile.n_block * Cfg::BLOCK_N + Cfg::B_BOX_N,
                          tile.group);
            }
          } else {
            tma_load_3d(&p.b, bar, b_stage, kb * Cfg::BLOCK_K, tile.n_block * Cfg::BLOCK_N, tile.group);
          }
          tma_load_2d(&p.a_scales, bar, slot, tile.row_start & ~3, kb);
        }
      }
    }
  } else {
    // ---------------------------------------------------------------- math
    setmaxnreg_inc<Cfg::kMathRegs>();
    const int mwg = warpgroup - 1;  // rows [64*mwg, 64*mwg + 64) of the tile
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int r0 = 16 * warp + lane / 4;  // this thread's fragment rows: r0 and r0 + 8 (within the half)
    using Mma = WgmmaFp8<Cfg::N_INSTR>;
    constexpr int H = Cfg::N_HALVES;
    float acc[H][Mma::kRegs], part[Mma::kRegs];
    PipelineState<Cfg::STAGES> st;

    // 128-wide tiles keep a second partial fragment (64 registers) so that block kb+1's wgmma runs on the
    // tensor cores while this warpgroup promotes block kb: the promotion no longer leaves them idle.
    float part2[Mma::kRegs];
    // A stage's descriptors are stage 0's plus stage * bytes / 16 in the 14-bit start-address field (shared
    // memory is below 256 KB: no carry out of it). Rebuilding them from the address every block cost ~5%
    // (lab/ceiling/m_tile_ceiling.cu, variants prod-like and prod-like-fd). Stage 0's low words pass
    // through a shfl so that ptxas holds them in uniform registers instead of recomputing them every block.
    const KmajorSw128Desc da0{__shfl_sync(0xffffffffu, KmajorSw128Desc::at(smem + Cfg::OFF_A + mwg * 64 * 128).lo, 0)};
    const KmajorSw128Desc db0{__shfl_sync(0xffffffffu, KmajorSw128Desc::at(smem + Cfg::OFF_B).lo, 0)};
    auto issue = [&](float(&frag)[Mma::kRegs], const PipelineState<Cfg::STAGES>& at) {
      const KmajorSw128Desc da = da0.plus_units(at.stage * (Cfg::A_BYTES >> 4));
      const KmajorSw128Desc db = db0.plus_units(at.stage * (Cfg::B_BYTES >> 4));
      fence_regs(frag);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) Mma::mma(da.plus_bytes(32 * k).value(), db.plus_bytes(32 * k).value(), frag, k > 0);
      wgmma_commit();
    };
    // A stage's scales, from its slot: this thread's two rows' A scales and the weight scale(s).
    auto stage_scales = [&](const PipelineState<Cfg::STAGES>& at, int row_start, float& sa0, float& sa1,
                            float (&sb)[Cfg::kBScales]) {
      const uint8_t* slot = smem + Cfg::OFF_SA + at.stage * Cfg::SA_SLOT;
      const float* sa = reinterpret_cast<const float*>(slot) + (row_start & 3) + 64 * mwg;
      sa0 = sa[r0];
      sa1 = sa[r0 + 8];
#pragma unroll
      for (int j = 0; j < Cfg::kBScales; ++j) sb[j] = reinterpret_cast<const float*>(slot + Cfg::SB_OFF)[j];
    };
    // A warpgroup whose 64 rows hold no valid row only hands the tile's stages back.
    auto release_tile = [&]() {
      for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
        pipe.consumer_wait(st);
        pipe.consumer_release(st, lane);
      }
    };
    auto mainloop_pipelined = [&](const MTile& tile, bool active, float(&accum)[Mma::kRegs], float(&p0)[Mma::kRegs]) {
      if (!active) return release_tile();
      float sa0, sa1, sb[Cfg::kBScales];
      pipe.consumer_wait(st);
      stage_scales(st, tile.row_start, sa0, sa1, sb);
      issue(p0, st);
      // One step: launch block kb+1 into `nxt`, then retire block kb from `cur`. The wgmma issue sits in
      // straight-line code (no branch around it) so that ptxas keeps the two groups in flight.
      auto step = [&](int kb, float(&cur)[Mma::kRegs], float(&nxt)[Mma::kRegs]) {
        PipelineState<Cfg::STAGES> next = st;
        next.advance();
        float nsa0, nsa1, nsb[Cfg::kBScales];
        pipe.consumer_wait(next);
        issue(nxt, next);
        stage_scales(next, tile.row_start, nsa0, nsa1, nsb);  // after the issue: its fence need not wait for them
        wgmma_wait<1>();  // block kb's group is complete; kb+1's may still run
        fence_regs(cur);
        pipe.consumer_release(st, lane);
        promote_row_scaled(accum, cur, sa0, sa1, sb[0]);
        sa0 = nsa0, sa1 = nsa1, sb[0] = nsb[0];
        st.advance();
      };
      auto last = [&](float(&cur)[Mma::kRegs]) {
        wgmma_wait<0>();
        fence_regs(cur);
        pipe.consumer_release(st, lane);
        promote_row_scaled(accum, cur, sa0, sa1, sb[0]);
        st.advance();
      };
      two_fragment_pipeline(num_kb, p0, part2, step, last);
    };

    // The serial kernels (192 x 128 with three warpgroups, 128 x 192 with two): one partial fragment, retired
    // and promoted after each block. 192-wide tiles: columns [0, 8 * split_j) of
    // the tile lie in weight-scale block b_lo, the rest in b_lo + 1 (clamped at the edge: columns past N are
    // never stored). No scale may be waited for between a block's wgmma issues (a warp issues in order, and
    // ptxas hoists the scale products up to the last issue): so the scales of block kb+1 are read from its stage
    // while block kb runs, once that stage has landed. (Fetched at the top of the block instead, each block's
    // last wgmma waited on a global load: -14%.)
    // One block of a serial loop: launch block `cur` into `part`, read the next block's scales once its stage has
    // landed (has_next), retire `cur` and promote it with this block's scales (sa0, sa1, sb), which then take the
    // next block's. split16: the 192-wide tiles' weight-scale split (promote_row_scaled_split), a bool or a
    // std::integral_constant.
    auto serial_block = [&](const MTile& tile, const PipelineState<Cfg::STAGES>& cur,
                            const PipelineState<Cfg::STAGES>& nxt, bool has_next, auto split16,
                            float(&accum)[Mma::kRegs], float& sa0, float& sa1, float(&sb)[Cfg::kBScales]) {
      issue(part, cur);
      float nsa0 = 0.f, nsa1 = 0.f, nsb[Cfg::kBScales] = {};
      if (has_next) {
        pipe.consumer_wait(nxt);
        stage_scales(nxt, tile.row_start, nsa0, nsa1, nsb);
      }
      wgmma_wait<0>();
      fence_regs(part);
      pipe.consumer_release(cur, lane);
      if constexpr (Cfg::BLOCK_N == 128)
        promote_row_scaled(accum, part, sa0, sa1, sb[0]);
      else if (split16)
        promote_row_scaled_split<16>(accum, part, sa0, sa1, sb[0], sb[Cfg::kBScales - 1]);
      else
        promote_row_scaled_split<8>(accum, part, sa0, sa1, sb[0], sb[Cfg::kBScales - 1]);
      sa0 = nsa0, sa1 = nsa1;
#pragma unroll
      for (int j = 0; j < Cfg::kBScales; ++j) sb[j] = nsb[j];
    };
    auto mainloop_single = [&](const MTile& tile, bool active, float(&accum)[Mma::kRegs]) {
      if (!active) return release_tile();
      const bool split16 = tile.n_block * Cfg::BLOCK_N % 128 == 0;  // else the tile starts mid-block: 64 columns
      float sa0, sa1, sb[Cfg::kBScales];
      pipe.consumer_wait(st);
      stage_scales(st, tile.row_start, sa0, sa1, sb);
      for (int kb = 0; kb < num_kb; ++kb) {
        PipelineState<Cfg::STAGES> next = st;
        next.advance();
        serial_block(tile, st, next, kb + 1 < num_kb, split16, accum, sa0, sa1, sb);
        st = next;
      }
    };

    // The serial loop with compile-time pipeline stages (MEGATRON_TMA_MG_FIXED_STAGE, on by default). When num_kb is
    // a multiple of STAGES every tile starts at stage 0 (each tile, active or not, walks num_kb stages of the ring),
    // so the K loop unrolled STAGES times gets immediate descriptor, barrier and scale-slot addresses and carries
    // only the phase bit; the 192-wide tiles' choice of weight-scale split is made once per tile, not per block.
    // Why: per K block and math warp the serial loop issued 123 (192 x 128) instructions, 59 of them not FFMA, where
    // DeepGEMM's (stage indices constant: SHAPE_K is compiled in) issues 38-42 non-FFMA ones (benchmarks/NOTES.md,
    // the M-grouped table); now 101.25 (37.25 not FFMA). Measured on an H100: the same bits, x1.04 geomean on the
    // reference rows against the general loop.
    auto mainloop_fixed = [&](const MTile& tile, bool active, float(&accum)[Mma::kRegs], auto split16) {
      if (!active) return release_tile();
      constexpr int S = Cfg::STAGES;
      uint32_t phase = st.phase;  // st.stage == 0 here
      float sa0, sa1, sb[Cfg::kBScales];
      pipe.consumer_wait(PipelineState<S>{0, phase});
      stage_scales(PipelineState<S>{0, phase}, tile.row_start, sa0, sa1, sb);
      for (int kb0 = 0; kb0 < num_kb; kb0 += S) {
        // static_for, not `#pragma unroll`: ptxas left the three-warpgroup kernel's loop rolled (stage at run time)
        static_for<0, S>([&](auto stage) {
          constexpr int s = decltype(stage)::value;
          // the next block's wait is compile-time certain but for the last stage of a round
          serial_block(tile, PipelineState<S>{s, phase}, PipelineState<S>{(s + 1) % S, s + 1 == S ? phase ^ 1u : phase},
                       s + 1 < S || kb0 + S < num_kb, split16, accum, sa0, sa1, sb);
        });
        phase ^= 1u;
      }
      st.phase = phase;  // as num_kb advances of st would leave it: stage 0, the phase flipped num_kb / S times
    };
    const bool fixed_stages = MEGATRON_TMA_MG_FIXED_STAGE && num_kb % Cfg::STAGES == 0;

    const int num_tiles = tile_count();
    for (int t = blockIdx.x / Cfg::kCluster; t < num_tiles; t += gridDim.x / Cfg::kCluster) {
      MTile tile;
      if constexpr (Cfg::kCluster == 2) {
        tile = pairs.own(t, cta_rank());  // one group search: the math warps need not know if B is shared
      } else {
        bool shared_b;
        tile = next_tile(t, shared_b);
      }
      const bool active = tile.rows > 64 * mwg;  // else this half holds no valid row: skip its math
      const int halves = min(H, (p.n + 127) / 128 - tile.n_block * H);  // a last tile may cover one 128-column block
#pragma unroll
      for (int h = 0; h < H; ++h)
#pragma unroll
        for (int i = 0; i < Mma::kRegs; ++i) acc[h][i] = 0.f;

      if constexpr (Cfg::kSerial) {
        if (fixed_stages) {
          if (Cfg::BLOCK_N == 128 || tile.n_block * Cfg::BLOCK_N % 128 == 0)
            mainloop_fixed(tile, active, acc[0], std::true_type{});
          else
            mainloop_fixed(tile, active, acc[0], std::false_type{});
        } else {
          mainloop_single(tile, active, acc[0]);
        }
      } else if constexpr (H == 1) {
        mainloop_pipelined(tile, active, acc[0], part);
      } else {
        for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
          pipe.consumer_wait(st);
          if (active) {
            float sa0, sa1, sb[Cfg::kBScales];
            stage_scales(st, tile.row_start, sa0, sa1, sb);
            const uint64_t da = make_kmajor_sw128_desc(smem + Cfg::OFF_A + st.stage * Cfg::A_BYTES + mwg * 64 * 128);
#pragma unroll
            for (int h = 0; h < H; ++h) {
              if (h < halves) {
                mma_block_k128<Mma>(
                    da, make_kmajor_sw128_desc(smem + Cfg::OFF_B + st.stage * Cfg::B_BYTES + h * 128 * 128), part);
                if (h == H - 1 || h + 1 == halves) pipe.consumer_release(st, lane);
                promote_row_scaled(acc[h], part, sa0, sa1, sb[h]);
              }
            }
          } else {
            pipe.consumer_release(st, lane);
          }
        }
      }

      if (!active) continue;
      // ---------------------------------------------------------------- epilogue
      // The previous tile's stores must have finished reading this warpgroup's rows of the D tile.
      if (tid == 0) tma_store_wait_read<0>();
      named_barrier_sync(1 + mwg, 128);
      uint8_t* d_tile = smem + Cfg::OFF_D;
#pragma unroll
      for (int j = 0; j < Cfg::BLOCK_N / 8; ++j) {
        const int half = j / 8, chunk = j % 8;
        uint8_t* base = d_tile + half * (Cfg::BLOCK_M * 128);
        const int row_a = 64 * mwg + r0, row_b = row_a + 8;
        const float* a = acc[j / (Mma::kRegs / 4)] + 4 * (j % (Mma::kRegs / 4));
        __nv_bfloat162 va = __floats2bfloat162_rn(a[0], a[1]);
        __nv_bfloat162 vb = __floats2bfloat162_rn(a[2], a[3]);
        *reinterpret_cast<__nv_bfloat162*>(base + sw128_offset(row_a, chunk) + 4 * (lane % 4)) = va;
        *reinterpret_cast<__nv_bfloat162*>(base + sw128_offset(row_b, chunk) + 4 * (lane % 4)) = vb;
      }
      fence_proxy_async_smem();
      named_barrier_sync(1 + mwg, 128);
      if (tid == 0) {
        const int rows = min(64, tile.rows - 64 * mwg);
        const int row0 = tile.row_start + 64 * mwg;
#pragma unroll
        for (int half = 0; half < Cfg::D_HALVES; ++half) {
          const int col = tile.n_block * Cfg::BLOCK_N + 64 * half;
          if (col < p.n)
            residual_store_2d(p.d_pool, d_tile + half * (Cfg::BLOCK_M * 128) + 64 * mwg * 128, rows, col, row0);
        }
        tma_store_commit();
      }
    }
    if (tid == 0) tma_store_wait_all();
  }
  // No CTA leaves while its peer may still arrive on its barriers.
  if constexpr (Cfg::kCluster == 2) {
    __syncwarp();
    cluster_sync();
  }
}

}  // namespace megatron_tma
