// K-grouped FP8 GEMM (weight gradient) without padding: dW[g] = dY_g^T . X_g, contracting over each
// group's own tokens, whatever their count and wherever they start.
//
// Operands are token-contiguous: dY^T [N, M_total] and X^T [K, M_total] (row pitch <= M_total + 15), with
// one FP32 scale per row per 128-token block counted from the group's first token (docs/layouts.md).
//
// Why a realignment step: TMA requires the innermost start coordinate of a box to be 16-byte aligned, and
// here the innermost dimension is the token, so a block starting at token o_g + 128j (any value) cannot be
// loaded straight into the operand tile. FP8 wgmma needs K-major operands, and the tensor cores' FP32
// partial sums depend on which tokens share a k32 step, so the block's token t must sit at K position t
// exactly (that is what makes the result bit-identical to the 128-padded layout). So:
//   1. the producer TMA-loads an aligned staging window [a, a + 144) with a = (o_g + 128j) & ~15, for
//      128 rows of each operand (no swizzle), plus the block's row and column scales;
//   2. the math warpgroups copy bytes [shift, shift + 128) of every staging row into the 128B-swizzled
//      operand tiles (funnel shifts of 4-byte words), writing zeros for tokens past the group's end
//      (they belong to the next group: products there are exactly 0 * 0, as in the padded layout);
//   3. wgmma on the tiles, then promotion acc = fma(sa[n] * sb[k], p, acc) in ascending block order.
// The operand tiles are double-buffered so that block j+1 is realigned while block j's wgmma runs.
// Nothing is padded in memory and nothing is read on the host. out = acc, or C + acc when accumulating
// (Megatron's main_grad). Deterministic: each output element is owned by one thread of one CTA.
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

struct KGroupedGemmParams {
  CUtensorMap a;         // dY^T e4m3: dims (M_total, N), row pitch, box (144 tokens, 128 rows), no swizzle
  CUtensorMap b;         // X^T  e4m3: dims (M_total, K), box (144, 128)
  CUtensorMap a_scales;  // fp32 [MB_max, N]: dims (N, MB_max), box (128, 1)
  CUtensorMap b_scales;  // fp32 [MB_max, K]: dims (K, MB_max), box (128, 1)
  void* d;               // [G, N, K] fp32 (or bf16), contiguous
  GroupsArg groups;
  int m_total, n, k;
  int accumulate;        // d = d + A.B (fp32 only)
  int out_bf16;
};

template <int STAGES_>
struct KGroupedGemmConfig {
  static constexpr int BLOCK_M = 128, BLOCK_N = 128, BLOCK_K = 128, STAGES = STAGES_;
  static constexpr int kMathWarpgroups = 2, kThreads = 128 * (1 + kMathWarpgroups);
  static constexpr int kProducerRegs = 40, kMathRegs = 232;
  static constexpr int STAGE_ROW = BLOCK_K + 16;              // aligned window: 16 B of slack for the shift
  static constexpr int STAGE_BYTES = 128 * STAGE_ROW;         // one operand's staging tile
  static constexpr int TILE_BYTES = 128 * BLOCK_K;            // one operand's swizzled wgmma tile
  static constexpr int SCALE_BYTES = 128 * 4;
  static constexpr int TX_BYTES = 2 * STAGE_BYTES + 2 * SCALE_BYTES;
  static constexpr int OFF_TILES = 0;                         // 2 buffers x [A tile, B tile]
  static constexpr int OFF_SCALES = OFF_TILES + 4 * TILE_BYTES;  // 2 buffers x [sa, sb], beside the tiles
  static constexpr int OFF_STAGE = OFF_SCALES + 4 * SCALE_BYTES;  // ring: [A stage, B stage, sa, sb] per stage
  static constexpr int STAGE_SLOT = 2 * STAGE_BYTES + 2 * SCALE_BYTES;
  static constexpr int OFF_BAR = OFF_STAGE + STAGES * STAGE_SLOT;
  static constexpr int OFF_SCRATCH = OFF_BAR + 2 * STAGES * 8;
  static constexpr int OFF_GROUPS = OFF_SCRATCH + 256;
  static constexpr int kMaxGroups = 1024;
  static size_t smem_bytes(int num_groups) { return 1024 + OFF_GROUPS + 2 * (num_groups + 1) * sizeof(int); }
  static_assert(STAGE_SLOT % 128 == 0, "staging slots keep 128-byte alignment");
};

// Copy tokens [shift, shift + 128) of one staging row into 16-byte chunk `chunk` of a 128B-swizzled tile
// row, zeroing tokens at or past `valid`. Q = shift / 4 is a template parameter so that the word selection
// is static; the two 16-byte loads of a quarter-warp cover one contiguous 128-byte row segment (no bank
// conflicts), as do the swizzled 16-byte stores.
template <int Q>
__device__ __forceinline__ void realign_chunk(const uint8_t* stage_row, uint8_t* tile, int row, int chunk,
                                              uint32_t bits, int valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  const int first = 16 * chunk;
  if (first < valid) {
    const uint4 lo = *reinterpret_cast<const uint4*>(stage_row + first);
    const uint4 hi = *reinterpret_cast<const uint4*>(stage_row + first + 16);
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    v.x = __funnelshift_r(w[Q + 0], w[Q + 1], bits);
    v.y = __funnelshift_r(w[Q + 1], w[Q + 2], bits);
    v.z = __funnelshift_r(w[Q + 2], w[Q + 3], bits);
    v.w = __funnelshift_r(w[Q + 3], w[Q + 4], bits);
    const int keep = valid - first;  // bytes of this chunk that are real tokens
    if (keep < 16) {
      uint32_t* u = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int k = keep - 4 * i;  // bytes to keep in word i
        u[i] = k >= 4 ? u[i] : (k <= 0 ? 0u : (u[i] & ((1u << (8 * k)) - 1u)));
      }
    }
  }
  *reinterpret_cast<uint4*>(tile + sw128_offset(row, chunk)) = v;
}

// One block's realignment by the 256 math threads: 2 operands x 128 rows x 8 chunks.
template <int Q, class Cfg>
__device__ __forceinline__ void realign_block(const uint8_t* stage, uint8_t* tiles, int mtid, uint32_t bits, int valid) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int idx = mtid + 256 * i, op = idx >> 10, row = (idx >> 3) & 127, chunk = idx & 7;
    realign_chunk<Q>(stage + op * Cfg::STAGE_BYTES + row * Cfg::STAGE_ROW, tiles + op * Cfg::TILE_BYTES, row, chunk,
                     bits, valid);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) k_grouped_fp8_gemm_kernel(const __grid_constant__ KGroupedGemmParams p) {
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
  const int warpgroup = threadIdx.x / 128;
  auto stage_ptr = [&](int stage) { return smem + Cfg::OFF_STAGE + stage * Cfg::STAGE_SLOT; };

  if (warpgroup == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      PipelineState<Cfg::STAGES> st;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const KTile tile = sched.get(t);
        const int n0 = tile.n_block * Cfg::BLOCK_M, k0 = tile.k_block * Cfg::BLOCK_N;
        const int blocks = (tile.tokens + 127) / 128;
        for (int j = 0; j < blocks; ++j, st.advance()) {
          uint64_t* bar = pipe.producer_acquire(st, Cfg::TX_BYTES);
          const int aligned = (tile.token_start + 128 * j) & ~15;  // TMA: 16-byte aligned inner coordinate
          uint8_t* s = stage_ptr(st.stage);
          tma_load_2d(&p.a, bar, s, aligned, n0);
          tma_load_2d(&p.b, bar, s + Cfg::STAGE_BYTES, aligned, k0);
          tma_load_2d(&p.a_scales, bar, s + 2 * Cfg::STAGE_BYTES, n0, tile.block_base + j);
          tma_load_2d(&p.b_scales, bar, s + 2 * Cfg::STAGE_BYTES + Cfg::SCALE_BYTES, k0, tile.block_base + j);
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
    float acc[Mma::kRegs], part[Mma::kRegs];
    PipelineState<Cfg::STAGES> st;
    // Move one block out of its staging slot: realign its bytes into tile buffer `buf` (visible to the
    // tensor cores), copy its row/column scales beside it, and hand the slot back to the producer, so that
    // loads run up to STAGES blocks ahead of the math.
    auto unstage = [&](const PipelineState<Cfg::STAGES>& at, int buf, int shift, int valid) {
      const uint8_t* s = stage_ptr(at.stage);
      uint8_t* tiles = smem + Cfg::OFF_TILES + buf * 2 * Cfg::TILE_BYTES;
      const uint32_t bits = 8u * (shift & 3);
      switch (shift >> 2) {  // uniform over the CTA: one branch per group
        case 0: realign_block<0, Cfg>(s, tiles, mtid, bits, valid); break;
        case 1: realign_block<1, Cfg>(s, tiles, mtid, bits, valid); break;
        case 2: realign_block<2, Cfg>(s, tiles, mtid, bits, valid); break;
        default: realign_block<3, Cfg>(s, tiles, mtid, bits, valid); break;
      }
      reinterpret_cast<float*>(smem + Cfg::OFF_SCALES + buf * 2 * Cfg::SCALE_BYTES)[mtid] =
          reinterpret_cast<const float*>(s + 2 * Cfg::STAGE_BYTES)[mtid];  // sa then sb: 256 floats
      fence_proxy_async_smem();
      pipe.consumer_release(at, lane);
    };

    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const KTile tile = sched.get(t);
      const int blocks = (tile.tokens + 127) / 128;
      if (blocks == 0 && p.accumulate) continue;  // an empty group leaves C unchanged
#pragma unroll
      for (int i = 0; i < Mma::kRegs; ++i) acc[i] = 0.f;
      const int shift = tile.token_start & 15;  // the same for every block of the group
      if (blocks > 0) {
        pipe.consumer_wait(st);
        unstage(st, 0, shift, min(128, tile.tokens));
        named_barrier_sync(3, 256);
      }

      for (int j = 0; j < blocks; ++j, st.advance()) {
        const int buf = j & 1;
        const uint8_t* tiles = smem + Cfg::OFF_TILES + buf * 2 * Cfg::TILE_BYTES;
        const float* sa = reinterpret_cast<const float*>(smem + Cfg::OFF_SCALES + buf * 2 * Cfg::SCALE_BYTES);
        const float* sb = sa + 128;
        const float sa0 = sa[64 * mwg + r0], sa1 = sa[64 * mwg + r0 + 8];
        // Issue block j on the tensor cores ...
        const uint64_t da = make_kmajor_sw128_desc(tiles + mwg * 64 * 128);
        const uint64_t db = make_kmajor_sw128_desc(tiles + Cfg::TILE_BYTES);
        fence_regs(part);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) Mma::mma(desc_advance(da, 32 * k), desc_advance(db, 32 * k), part, k > 0);
        wgmma_commit();
        // ... and move block j+1 into the other buffers meanwhile (block j-1's wgmma and promotion, their
        // last readers, finished before the previous barrier).
        if (j + 1 < blocks) {
          PipelineState<Cfg::STAGES> next = st;
          next.advance();
          pipe.consumer_wait(next);
          unstage(next, buf ^ 1, shift, min(128, tile.tokens - 128 * (j + 1)));
        }
        wgmma_wait<0>();
        fence_regs(part);
        promote_row_col_scaled(acc, part, sa0, sa1, sb + 2 * (lane % 4));
        // Both warpgroups are done with buffers `buf` and have filled buffers `buf ^ 1`.
        named_barrier_sync(3, 256);
      }

      // Epilogue: straight from registers; each warp store covers whole 32-byte sectors (4 lanes x 8 B per row).
      const int n_a = tile.n_block * Cfg::BLOCK_M + 64 * mwg + r0, n_b = n_a + 8;
      const size_t group_base = static_cast<size_t>(tile.group) * p.n * p.k;
#pragma unroll
      for (int j = 0; j < Mma::kRegs / 4; ++j) {
        const int col = tile.k_block * Cfg::BLOCK_N + 8 * j + 2 * (lane % 4);
        if (col >= p.k) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = h ? n_b : n_a;
          if (row >= p.n) continue;
          const size_t idx = group_base + static_cast<size_t>(row) * p.k + col;
          float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
          if (p.out_bf16) {
            *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.d) + idx) = __floats2bfloat162_rn(v.x, v.y);
          } else {
            float2* dst = reinterpret_cast<float2*>(static_cast<float*>(p.d) + idx);
            if (p.accumulate) {
              const float2 c = *dst;
              v.x = __fadd_rn(c.x, v.x);
              v.y = __fadd_rn(c.y, v.y);
            }
            *dst = v;
          }
        }
      }
    }
  }
}

}  // namespace megatron_tma
