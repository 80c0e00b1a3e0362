// K-grouped FP8 GEMM (weight gradient) without padding: dW[g] = dY_g^T . X_g, contracting over each
// group's own tokens, whatever their count.
//
// Operands are token-contiguous: dY^T [N, M_total] and X^T [K, M_total] (row pitch <= M_total + 15), with
// one FP32 scale per row per 128-token block counted from the group's first token (docs/layouts.md).
// A tile loads 128 tokens from o_g + 128j with ordinary TMA; in a group's last, partial block the tokens
// past the group's end belong to the next group, so both operand tiles have those columns zeroed in shared
// memory before the tensor cores read them (products there are then exactly 0 * 0, as in the padded
// layout). Nothing is padded in memory and nothing is read on the host.
//
// Numerics (DESIGN.md §3): per token block, p = FP8 tensor-core partial sum in a zeroed FP32 fragment;
// acc = fma(sa[n] * sb[k], p, acc) in ascending block order; out = acc, or C + acc when accumulating
// (Megatron's main_grad). Deterministic: every output element is owned by one thread of one CTA.
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
  CUtensorMap a;         // dY^T e4m3: dims (M_total, N), row pitch, box (128 tokens, 128 rows), SW128
  CUtensorMap b;         // X^T  e4m3: dims (M_total, K), box (128, 128), SW128
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
  static constexpr int A_BYTES = BLOCK_M * BLOCK_K, B_BYTES = BLOCK_N * BLOCK_K;
  static constexpr int SA_BYTES = BLOCK_M * 4, SB_BYTES = BLOCK_N * 4;
  static constexpr int OFF_A = 0;
  static constexpr int OFF_B = OFF_A + STAGES * A_BYTES;
  static constexpr int OFF_SA = OFF_B + STAGES * B_BYTES;
  static constexpr int OFF_SB = OFF_SA + STAGES * SA_BYTES;
  static constexpr int OFF_BAR = OFF_SB + STAGES * SB_BYTES;
  static constexpr int OFF_SCRATCH = OFF_BAR + 2 * STAGES * 8;
  static constexpr int OFF_GROUPS = OFF_SCRATCH + 256;
  static constexpr int kMaxGroups = 2048;
  static size_t smem_bytes(int num_groups) { return 1024 + OFF_GROUPS + 2 * (num_groups + 1) * sizeof(int); }
};

// Zero token columns [valid, 128) of one 128-byte swizzled tile row (TMA SWIZZLE_128B, 1024 B aligned tile).
__device__ __forceinline__ void zero_row_tail_sw128(uint8_t* tile, int row, int valid) {
  uint8_t* r = tile + row * 128;
  const int first = valid >> 4;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    if (c < first) continue;
    uint8_t* chunk = r + ((c ^ (row & 7)) << 4);
    if (c == first && (valid & 15)) {
      for (int b = valid & 15; b < 16; ++b) chunk[b] = 0;
    } else {
      *reinterpret_cast<uint4*>(chunk) = make_uint4(0, 0, 0, 0);
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) k_grouped_fp8_gemm_kernel(const __grid_constant__ KGroupedGemmParams p) {
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment (128B-swizzle atoms), derived from the __shared__ array so that the compiler keeps
  // shared-memory instructions (STS/LDS) instead of generic ones.
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

  if (warpgroup == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      PipelineState<Cfg::STAGES> st;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const KTile tile = sched.get(t);
        const int n0 = tile.n_block * Cfg::BLOCK_M, k0 = tile.k_block * Cfg::BLOCK_N;
        const int blocks = (tile.tokens + 127) / 128;
        for (int j = 0; j < blocks; ++j, st.advance()) {
          uint64_t* bar = pipe.producer_acquire(st, Cfg::A_BYTES + Cfg::B_BYTES + Cfg::SA_BYTES + Cfg::SB_BYTES);
          const int tok = tile.token_start + 128 * j;
          tma_load_2d(&p.a, bar, smem + Cfg::OFF_A + st.stage * Cfg::A_BYTES, tok, n0);
          tma_load_2d(&p.b, bar, smem + Cfg::OFF_B + st.stage * Cfg::B_BYTES, tok, k0);
          tma_load_2d(&p.a_scales, bar, smem + Cfg::OFF_SA + st.stage * Cfg::SA_BYTES, n0, tile.block_base + j);
          tma_load_2d(&p.b_scales, bar, smem + Cfg::OFF_SB + st.stage * Cfg::SB_BYTES, k0, tile.block_base + j);
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kMathRegs>();
    const int mwg = warpgroup - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int r0 = 16 * warp + lane / 4;
    using Mma = WgmmaFp8<Cfg::BLOCK_N>;
    float acc[Mma::kRegs], part[Mma::kRegs];
    PipelineState<Cfg::STAGES> st;

    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const KTile tile = sched.get(t);
      const int blocks = (tile.tokens + 127) / 128;
      if (blocks == 0 && p.accumulate) continue;  // an empty group leaves C unchanged
#pragma unroll
      for (int i = 0; i < Mma::kRegs; ++i) acc[i] = 0.f;

      for (int j = 0; j < blocks; ++j, st.advance()) {
        pipe.consumer_wait(st);
        uint8_t* a_tile = smem + Cfg::OFF_A + st.stage * Cfg::A_BYTES;
        uint8_t* b_tile = smem + Cfg::OFF_B + st.stage * Cfg::B_BYTES;
        const int valid = min(128, tile.tokens - 128 * j);
        if (valid < 128) {
          // Tokens past the group's end: zero them in both operands (this warpgroup's 64 A rows and half of
          // B), make the writes visible to the tensor cores, and wait for the other math warpgroup.
          zero_row_tail_sw128(tid < 64 ? a_tile : b_tile, 64 * mwg + (tid & 63), valid);
          fence_proxy_async_smem();
          named_barrier_sync(3, 256);
        }
        const float* sa = reinterpret_cast<const float*>(smem + Cfg::OFF_SA + st.stage * Cfg::SA_BYTES) + 64 * mwg;
        const float* sb = reinterpret_cast<const float*>(smem + Cfg::OFF_SB + st.stage * Cfg::SB_BYTES);
        const float sa0 = sa[r0], sa1 = sa[r0 + 8];
        mma_block_k128<Mma>(make_kmajor_sw128_desc(a_tile + mwg * 64 * 128), make_kmajor_sw128_desc(b_tile), part);
        promote_row_col_scaled(acc, part, sa0, sa1, sb + 2 * (lane % 4));
        pipe.consumer_release(st, lane);  // after the column scales were read from this stage
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
