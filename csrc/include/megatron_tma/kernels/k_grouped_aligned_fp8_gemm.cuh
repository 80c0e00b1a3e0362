// EXPERIMENT (issue 4's layout question): the K-grouped (wgrad) FP8 GEMM for groups that start on a 16-token
// boundary of the token-contiguous operands. Not DESIGN.md §4's contract, under which a group may start at any
// token; benchmarks/NOTES.md (K-grouped section, item 5) has the question and the measured bound this answers.
//
// With every group start a multiple of 16 tokens, every 128-token block [o_g + 128j, ...) starts 16-byte aligned,
// so TMA loads it straight into its 128B-swizzled operand tile at its exact K positions: no realignment in shared
// memory, the main cost of k_grouped_fp8_gemm.cuh. The rest is the M-grouped kernel's 128 x 128 pipeline
// (two partial fragments per warpgroup, so block j+1 runs on the tensor cores while block j is promoted) over the
// K-grouped scheduler's tiles (group, N block, K block), with the wgrad promotion acc = fma(sa[n] * sb[k], p, acc).
// The last block of a group may be partial: its box runs into the next group's tokens, so the math warps zero
// the tokens past the group's end in both operand tiles before its wgmma (the products there are then 0 * 0, as
// in the padded layout), which keeps the bits equal to the padded path's (DESIGN.md §3).
// Output: BF16 only, through shared memory and the residual-store pool (rows past N are not written).
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

#include "megatron_tma/common/groups.cuh"
#include "megatron_tma/common/mbarrier.cuh"
#include "megatron_tma/common/pipeline.cuh"
#include "megatron_tma/common/promotion.cuh"
#include "megatron_tma/common/residual_store.cuh"
#include "megatron_tma/common/tma.cuh"
#include "megatron_tma/common/wgmma.cuh"
#include "megatron_tma/scheduler/k_grouped_scheduler.cuh"

namespace megatron_tma {

constexpr int kAlignedStorePool = 7;  // box heights 1 .. 64 rows (one math warpgroup's half tile)

struct KGroupedAlignedParams {
  CUtensorMap a;         // dY^T e4m3: dims (M_total, N), row pitch, box (128 tokens, 128 rows), SW128
  CUtensorMap b;         // X^T  e4m3: dims (M_total, K), box (128, 128), SW128
  CUtensorMap a_scales;  // fp32 [MB_max, N]: dims (N, MB_max), box (128, 1)
  CUtensorMap b_scales;  // fp32 [MB_max, K]: dims (K, MB_max), box (128, 1)
  CUtensorMap d_pool[kAlignedStorePool];  // bf16 [G, N, K]: dims (K, N, G), box (64, 2^k, 1), SW128
  GroupsArg groups;
  int m_total, n, k;
};

template <int STAGES_>
struct KGroupedAlignedConfig {
  static constexpr int BLOCK_M = 128, BLOCK_N = 128, BLOCK_K = 128, STAGES = STAGES_;  // N rows x K cols x tokens
  static constexpr int kMathWarpgroups = 2, kThreads = 128 * (1 + kMathWarpgroups);
  static constexpr int kProducerRegs = 40, kMathRegs = 232;
  static_assert(128 * kProducerRegs + 128 * kMathWarpgroups * kMathRegs <= kThreads * ((65536 / kThreads) & ~7),
                "the math warpgroups' setmaxnreg.inc must be covered by the producer's dec");
  static constexpr int A_BYTES = BLOCK_M * BLOCK_K, B_BYTES = BLOCK_N * BLOCK_K;
  static constexpr int S_BYTES = (BLOCK_M + BLOCK_N) * 4;  // the block's row scales sa[n], then sb[k]
  static constexpr int D_BYTES = BLOCK_M * BLOCK_N * 2;     // BF16 tile, two 64-column halves
  static constexpr int OFF_A = 0;
  static constexpr int OFF_B = OFF_A + STAGES * A_BYTES;
  static constexpr int OFF_D = OFF_B + STAGES * B_BYTES;
  static constexpr int OFF_S = OFF_D + D_BYTES;
  static constexpr int OFF_BAR = OFF_S + STAGES * S_BYTES;
  static constexpr int OFF_SCRATCH = OFF_BAR + 2 * STAGES * 8;
  static constexpr int OFF_GROUPS = OFF_SCRATCH + 256;
  static constexpr int kMaxGroups = 1024;
  static size_t smem_bytes(int num_groups) { return 1024 + OFF_GROUPS + 2 * (num_groups + 1) * sizeof(int); }
  static_assert(OFF_B % 1024 == 0 && OFF_D % 1024 == 0, "128B-swizzled tiles need 1024-byte alignment");
  static_assert(1024 + OFF_GROUPS + 2 * (kMaxGroups + 1) * 4 <= 227 * 1024, "fits the SM90 shared memory");
};

// Zero the bytes of tokens [valid, 128) in one 128-byte row of a 128B-swizzled operand tile.
__device__ __forceinline__ void zero_row_tail(uint8_t* tile, int row, int valid) {
  const int r7 = row & 7;
  for (int piece = valid >> 4; piece < 8; ++piece) {
    uint4* p = reinterpret_cast<uint4*>(tile + row * 128 + ((piece ^ r7) << 4));
    const int keep = valid - 16 * piece;  // bytes of this piece that are real tokens (0..15)
    if (keep <= 0) {
      *p = make_uint4(0u, 0u, 0u, 0u);
    } else {
      uint4 v = *p;
      uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int k = keep - 4 * i;
        w[i] = k >= 4 ? w[i] : (k <= 0 ? 0u : (w[i] & ((1u << (8 * k)) - 1u)));
      }
      *p = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    k_grouped_aligned_fp8_gemm_kernel(const __grid_constant__ KGroupedAlignedParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Cfg::OFF_BAR);
  const Pipeline<Cfg::STAGES> pipe{full_bar, full_bar + Cfg::STAGES};
  int* scratch = reinterpret_cast<int*>(smem + Cfg::OFF_SCRATCH);
  const int G = p.groups.num_groups;
  int* token_off = reinterpret_cast<int*>(smem + Cfg::OFF_GROUPS);
  int* block_off = token_off + G + 1;
  if (threadIdx.x == 0) {
    pipe.init(Cfg::kMathWarpgroups * 4);
    tma_prefetch_descriptor(&p.a);
    tma_prefetch_descriptor(&p.b);
    tma_prefetch_descriptor(&p.a_scales);
    tma_prefetch_descriptor(&p.b_scales);
  }
  block_exclusive_scan(G, [&](int i) { return groups_size(p.groups, i); }, token_off, p.m_total, scratch);
  block_exclusive_scan(G, [&](int i) { return (token_off[i + 1] - token_off[i] + 127) / 128; }, block_off, 0x7fffffff,
                       scratch);
  const KGroupedScheduler sched{token_off, block_off, G, (p.n + Cfg::BLOCK_M - 1) / Cfg::BLOCK_M,
                                (p.k + Cfg::BLOCK_N - 1) / Cfg::BLOCK_N};
  const int num_tiles = sched.num_tiles();
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (warpgroup == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      PipelineState<Cfg::STAGES> st;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const KTile tile = sched.get(t);
        const int n0 = tile.n_block * Cfg::BLOCK_M, k0 = tile.k_block * Cfg::BLOCK_N;
        const int blocks = (tile.tokens + 127) / 128;
        for (int j = 0; j < blocks; ++j, st.advance()) {
          uint64_t* bar = pipe.producer_acquire(st, Cfg::A_BYTES + Cfg::B_BYTES + Cfg::S_BYTES);
          const int tok = tile.token_start + 128 * j;  // 16-aligned: the caller's promise
          tma_load_2d(&p.a, bar, smem + Cfg::OFF_A + st.stage * Cfg::A_BYTES, tok, n0);
          tma_load_2d(&p.b, bar, smem + Cfg::OFF_B + st.stage * Cfg::B_BYTES, tok, k0);
          uint8_t* s = smem + Cfg::OFF_S + st.stage * Cfg::S_BYTES;
          tma_load_2d(&p.a_scales, bar, s, n0, tile.block_base + j);
          tma_load_2d(&p.b_scales, bar, s + Cfg::BLOCK_M * 4, k0, tile.block_base + j);
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kMathRegs>();
    const int mwg = warpgroup - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int mtid = threadIdx.x - 128;  // 0..255 over both math warpgroups
    const int r0 = 16 * warp + lane / 4;
    using Mma = WgmmaFp8<Cfg::BLOCK_N>;
    constexpr int R = Mma::kRegs;
    float acc[R], part0[R], part1[R];
    PipelineState<Cfg::STAGES> st;
    const KmajorSw128Desc da0{__shfl_sync(0xffffffffu, KmajorSw128Desc::at(smem + Cfg::OFF_A + mwg * 64 * 128).lo, 0)};
    const KmajorSw128Desc db0{__shfl_sync(0xffffffffu, KmajorSw128Desc::at(smem + Cfg::OFF_B).lo, 0)};
    auto issue = [&](float(&frag)[R], const PipelineState<Cfg::STAGES>& at) {
      const KmajorSw128Desc da = da0.plus_units(at.stage * (Cfg::A_BYTES >> 4));
      const KmajorSw128Desc db = db0.plus_units(at.stage * (Cfg::B_BYTES >> 4));
      fence_regs(frag);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) Mma::mma(da.plus_bytes(32 * k).value(), db.plus_bytes(32 * k).value(), frag, k > 0);
      wgmma_commit();
    };
    // The tile's last block when the group ends inside it: both warpgroups zero the tokens past the end (thread
    // mtid owns row mtid % 128 of operand mtid / 128), then meet before either issues its wgmma.
    auto wait_block = [&](const PipelineState<Cfg::STAGES>& at, int valid) {
      pipe.consumer_wait(at);
      if (valid < 128) {  // uniform over the CTA
        uint8_t* tile = smem + (mtid < 128 ? Cfg::OFF_A + at.stage * Cfg::A_BYTES : Cfg::OFF_B + at.stage * Cfg::B_BYTES);
        zero_row_tail(tile, mtid & 127, valid);
        fence_proxy_async_smem();
        named_barrier_sync(3, 256);
      }
    };
    auto promote = [&](const float(&frag)[R], const PipelineState<Cfg::STAGES>& at) {
      const float* s = reinterpret_cast<const float*>(smem + Cfg::OFF_S + at.stage * Cfg::S_BYTES);
      promote_row_col_scaled(acc, frag, s[64 * mwg + r0], s[64 * mwg + r0 + 8], s + Cfg::BLOCK_M + 2 * (lane % 4));
    };

    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const KTile tile = sched.get(t);
      const int blocks = (tile.tokens + 127) / 128;
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] = 0.f;
      if (blocks > 0) {
        wait_block(st, min(128, tile.tokens));
        issue(part0, st);
        auto step = [&](int j, float(&cur)[R], float(&nxt)[R]) {
          PipelineState<Cfg::STAGES> next = st;
          next.advance();
          wait_block(next, min(128, tile.tokens - 128 * (j + 1)));
          issue(nxt, next);
          wgmma_wait<1>();  // block j is complete; j+1 may still run
          fence_regs(cur);
          promote(cur, st);  // reads block j's column scales from its slot: release after
          pipe.consumer_release(st, lane);
          st.advance();
        };
        auto last = [&](float(&cur)[R]) {
          wgmma_wait<0>();
          fence_regs(cur);
          promote(cur, st);
          pipe.consumer_release(st, lane);
          st.advance();
        };
        two_fragment_pipeline(blocks, part0, part1, step, last);
      }

      // Epilogue: BF16 through the shared tile and the residual-store pool; rows past N are not stored.
      const int n0 = tile.n_block * Cfg::BLOCK_M + 64 * mwg, k0 = tile.k_block * Cfg::BLOCK_N;
      if (tid == 0) tma_store_wait_read<0>();  // the previous tile's stores have read this warpgroup's rows
      named_barrier_sync(1 + mwg, 128);
      uint8_t* d_tile = smem + Cfg::OFF_D;
      stage_bf16_fragment<Cfg::BLOCK_M * 128>(d_tile, acc, 64 * mwg + r0, lane);
      fence_proxy_async_smem();
      named_barrier_sync(1 + mwg, 128);
      if (tid == 0) {
        const int rows = min(64, p.n - n0);
        if (rows > 0) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (k0 + 64 * h < p.k)
              residual_store_3d(p.d_pool, d_tile + h * (Cfg::BLOCK_M * 128) + 64 * mwg * 128, rows, k0 + 64 * h, n0,
                                tile.group);
        }
        tma_store_commit();
      }
    }
    if (tid == 0) tma_store_wait_all();
  }
}

}  // namespace megatron_tma
