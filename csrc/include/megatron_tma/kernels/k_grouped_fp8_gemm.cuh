// K-grouped FP8 GEMM (weight gradient) without padding: dW[g] = dY_g^T . X_g, contracting over each group's
// own tokens, whatever their count.
//
// Operands (docs/design.md §4, docs/layouts.md): token-contiguous dY^T [N, P] and X^T [K, P]; group g's tokens sit at
// columns [a_g, a_g + M_g), a_g = sum_{h<g} round_up(M_h, 128), with zeros in the <= 127 columns after each group
// (written by the quantizer); one FP32 scale per row per 128-token block counted from the group's first token (rows
// B_g + j of the scales).
//
// Why 128-token group starts: every token block [a_g + 128 j, +128) is one whole 128-byte line of each operand row,
// so TMA loads it straight into its 128B-swizzled tile with no line split, and a group's partial last block is read
// whole: the tokens past its end are the quantizer's zeros, so every product there is exactly 0 * 0, as in the
// padded layout (docs/design.md §3), with no masking in the kernel. The tensor cores' k32 partial sums then see the
// same tokens at the same K positions as in the 128-padded layout: the bits are the padded GEMM's.
//
// Structure: the M-grouped kernel's, over the K-grouped scheduler's tiles (group, N block, K block). Persistent
// grid; warpgroup 0 = one TMA producer thread; warpgroups 1-2 = math, 64 output rows (N) each, with two partial
// fragments so that block j+1 runs on the tensor cores while block j is promoted (or, in the 192 x 128 tile,
// warpgroups 1-3 with one partial fragment each, promoted after each block while the other two compute):
// acc = fma(sa[n] * sb[k], p, acc), ascending blocks (the per-element scale product is the wgrad's extra cost
// over the M-grouped promotion: two FP32 operations per element and block instead of one).
// A block's operand stage is handed back as soon as its wgmma is complete, before its promotion: the scales it
// needs live in a ring of more slots than stages (2 x STAGES, or STAGES + 1 when each block is promoted before the
// next one's wait), which the producer reaches again only after the math warps have released the operand stage of
// a later block (so the promotion of block j is over by then). With two fragments the producer thus runs
// STAGES - 1 blocks ahead of the tensor cores rather than STAGES - 2.
// Output (kOut): BF16, FP32, or FP32 accumulated into C (Megatron's main_grad: D = C + A.B, one FP32 add per
// element after the whole contraction, subnormals kept; an empty group leaves C untouched). When D is 16-byte aligned a tile leaves
// through a 128B-swizzled staging tile and TMA: plain stores, or for the accumulation a TMA reduce-add, which does
// the one rounded FP32 add in L2 without C ever entering the SM. Otherwise (D only element-aligned, e.g. a
// main_grad view at an odd float offset) the threads store from registers, every load of C issued before the first
// store.
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

enum class KGroupedOut { kBf16 = 0, kF32 = 1, kF32Accumulate = 2 };

struct KGroupedGemmParams {
  CUtensorMap a;         // dY^T e4m3 [N, P]: dims (P, N), row pitch, box (128 tokens, 128 rows), SW128
  CUtensorMap b;         // X^T  e4m3 [K, P]: dims (P, K), box (128, 128), SW128
  CUtensorMap a_scales;  // fp32 [MB, N]: dims (N, MB), box (128, 1)
  CUtensorMap b_scales;  // fp32 [MB, K]: dims (K, MB), box (128, 1)
  CUtensorMap d_tma;     // D [G, N, K]: dims (K, N, G), box (one 128-byte row: 64 bf16 / 32 fp32, 64 rows, 1), SW128
  void* d;               // [G, N, K] contiguous (the register epilogue's target)
  GroupsArg groups;
  int p_tokens;          // P: columns of dY^T / X^T (group starts are clamped to it)
  int num_blocks_max;    // MB: rows of the scale tensors (token-block counts are clamped to it)
  int n, k;
  int tma_out;           // D 16-byte aligned: staging tile + TMA store / reduce-add; else register stores
};

template <KGroupedOut kOut_, int MATH_WG_ = 2>
struct KGroupedGemmConfig {
  static constexpr KGroupedOut kOut = kOut_;
  static constexpr bool kF32 = kOut != KGroupedOut::kBf16, kAccumulate = kOut == KGroupedOut::kF32Accumulate;
  // BLOCK_M x BLOCK_N output rows (N) x columns (K), BLOCK_K tokens per block, 64 rows per math warpgroup.
  // Two warpgroups (128 x 128): two partial fragments each, block j+1 on the tensor cores while block j is promoted.
  // Three (192 x 128, the M-grouped kernel's best tile on large groups): 160 registers leave room for one partial
  // fragment, retired and promoted after each block; while one warpgroup promotes, the other two keep the tensor
  // cores busy, and each X^T tile serves 192 rows instead of 128 (a sixth fewer operand bytes per MAC). (Measured
  // against DeepGEMM's choice, 160 columns with one fragment and 3 stages: 4-14% slower on groups of >= 2048
  // tokens; benchmarks/NOTES.md.)
  static constexpr int kMathWarpgroups = MATH_WG_, kThreads = 128 * (1 + kMathWarpgroups);
  static_assert(kMathWarpgroups == 2 || kMathWarpgroups == 3, "128 x 128 or 192 x 128");
  static constexpr bool kSerial = kMathWarpgroups == 3;
  static constexpr int BLOCK_M = 64 * kMathWarpgroups, BLOCK_N = 128, BLOCK_K = 128;
  // The FP32 staging tile is twice the BF16 one: one stage fewer keeps it in shared memory. At 192 rows the FP32
  // slabs leave in two passes of 64 columns (half the staging), which keeps 4 stages.
  static constexpr int STAGES = kSerial ? 4 : (kF32 ? 4 : 5);
  static constexpr int kProducerRegs = 24, kMathRegs = kSerial ? 160 : 240;
  // setmaxnreg.inc takes its registers from the CTA pool, which holds only what setmaxnreg.dec released
  // (the launch gives every thread 64K / kThreads rounded down to 8: 168 for 384 threads, 128 for 512; checked
  // in .ci/compile_kernels.sh): a split over that budget hangs.
  static_assert(128 * kProducerRegs + 128 * kMathWarpgroups * kMathRegs <= kThreads * ((65536 / kThreads) & ~7),
                "the math warpgroups' setmaxnreg.inc must be covered by the producer's dec");
  static constexpr int A_BYTES = BLOCK_M * BLOCK_K, B_BYTES = BLOCK_N * BLOCK_K;
  static constexpr int S_BYTES = (BLOCK_M + BLOCK_N) * 4;  // the block's row scales sa[n], then sb[k]
  // The scale ring outlives the early-released operand stages: the producer reaches a slot again only after the
  // math warps have released a later block's stage, by which time this block's promotion is over. With two partial
  // fragments a warpgroup releases block j + 1 before promoting block j, so that needs 2 x STAGES slots; promoting
  // each block before the next one's wait (serial), STAGES + 1.
  static constexpr int S_SLOTS = kSerial ? STAGES + 1 : 2 * STAGES;
  // Staging: per math warpgroup 64 rows x 128 columns, as 128-byte swizzle rows: BF16 two 64-column boxes,
  // FP32 four 32-column boxes, each box 64 rows x 128 B = 8 KB.
  static constexpr int kBoxBytes = 64 * 128, kBoxes = BLOCK_N / (kF32 ? 32 : 64);
  static_assert(BLOCK_N % (kF32 ? 32 : 64) == 0, "the staging tile is whole 128-byte boxes");
  static constexpr int kStagingPasses = kSerial && kF32 ? 2 : 1, kPassBoxes = kBoxes / kStagingPasses;
  static constexpr int D_BYTES = kMathWarpgroups * kPassBoxes * kBoxBytes;
  static constexpr int OFF_A = 0;
  static constexpr int OFF_B = OFF_A + STAGES * A_BYTES;
  static constexpr int OFF_D = OFF_B + STAGES * B_BYTES;
  static constexpr int OFF_S = OFF_D + D_BYTES;
  static constexpr int OFF_BAR = OFF_S + S_SLOTS * S_BYTES;
  static constexpr int OFF_SCRATCH = OFF_BAR + 2 * STAGES * 8;
  static constexpr int OFF_GROUPS = OFF_SCRATCH + 256;
  // Group columns a_g [G+1], token counts [G] (padded to G+1), token-block offsets B_g [G+1], in what is left of
  // the SM90's 227 KB: 1024 groups beside the 128 x 128 tiles, fewer beside the 192 x 128 ones.
  static constexpr int kMaxGroups = 1024;  // the GEMM's limit (megatron_tma.limits), that of the 128 x 128 tiles
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kTileMaxGroups = (kSmemLimit - 1024 - OFF_GROUPS) / 12 - 1 < kMaxGroups
                                            ? (kSmemLimit - 1024 - OFF_GROUPS) / 12 - 1 : kMaxGroups;
  static size_t smem_bytes(int num_groups) { return 1024 + OFF_GROUPS + 3 * (num_groups + 1) * sizeof(int); }
  static_assert(OFF_B % 1024 == 0 && OFF_D % 1024 == 0, "128B-swizzled tiles need 1024-byte alignment");
  static_assert(kTileMaxGroups >= 64 && 1024 + OFF_GROUPS + 3 * (kTileMaxGroups + 1) * 4 <= kSmemLimit,
                "fits the SM90 shared memory");
  static_assert(kSerial || kTileMaxGroups == kMaxGroups, "the 128 x 128 tiles take every group count allowed");
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) k_grouped_fp8_gemm_kernel(const __grid_constant__ KGroupedGemmParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Cfg::OFF_BAR);
  const Pipeline<Cfg::STAGES> pipe{full_bar, full_bar + Cfg::STAGES};
  int* scratch = reinterpret_cast<int*>(smem + Cfg::OFF_SCRATCH);
  const int G = p.groups.num_groups;
  int* col_off = reinterpret_cast<int*>(smem + Cfg::OFF_GROUPS);  // a_g, clamped to P
  int* tokens = col_off + G + 1;                                   // M_g, clamped to the columns it owns
  int* block_off = tokens + G + 1;                                 // B_g, clamped to MB
  if (threadIdx.x == 0) {
    pipe.init(Cfg::kMathWarpgroups * 4);
    tma_prefetch_descriptor(&p.a);
    tma_prefetch_descriptor(&p.b);
    tma_prefetch_descriptor(&p.a_scales);
    tma_prefetch_descriptor(&p.b_scales);
  }
  // In 64 bits: a size within 127 of INT_MAX must round up, not wrap negative (the scan clamps totals to P).
  block_exclusive_scan(G, [&](int i) { return (groups_size(p.groups, i) + 127LL) & ~127LL; }, col_off, p.p_tokens, scratch);
  // A trip count the same for every thread (the bound test inside): with `i = threadIdx.x` as the start, ptxas
  // took everything after this loop for divergent and built the math loop's wgmma descriptors in vector registers
  // (R2UR + IMAD per descriptor: 439 instructions per two blocks instead of 399, measured in the SASS).
  for (int i0 = 0; i0 < G; i0 += blockDim.x)
    if (const int i = i0 + threadIdx.x; i < G) tokens[i] = min(groups_size(p.groups, i), col_off[i + 1] - col_off[i]);
  __syncthreads();
  block_exclusive_scan(G, [&](int i) { return (tokens[i] + 127LL) / 128; }, block_off, p.num_blocks_max, scratch);
  const KGroupedScheduler sched{col_off, tokens, block_off, G, (p.n + Cfg::BLOCK_M - 1) / Cfg::BLOCK_M,
                                (p.k + Cfg::BLOCK_N - 1) / Cfg::BLOCK_N};
  const int num_tiles = sched.num_tiles();
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);

  if (warpgroup == 0) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      PipelineState<Cfg::STAGES> st;
      int slot = 0;  // of the scale ring
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const KTile tile = sched.get(t);
        const int n0 = tile.n_block * Cfg::BLOCK_M, k0 = tile.k_block * Cfg::BLOCK_N;
        const int blocks = min((tile.tokens + 127) / 128, p.num_blocks_max - tile.block_base);
        for (int j = 0; j < blocks; ++j, st.advance(), slot = slot + 1 == Cfg::S_SLOTS ? 0 : slot + 1) {
          uint64_t* bar = pipe.producer_acquire(st, Cfg::A_BYTES + Cfg::B_BYTES + Cfg::S_BYTES);
          const int tok = tile.token_start + 128 * j;  // a multiple of 128: one whole line per operand row
          tma_load_2d(&p.a, bar, smem + Cfg::OFF_A + st.stage * Cfg::A_BYTES, tok, n0);
          tma_load_2d(&p.b, bar, smem + Cfg::OFF_B + st.stage * Cfg::B_BYTES, tok, k0);
          uint8_t* s = smem + Cfg::OFF_S + slot * Cfg::S_BYTES;
          tma_load_2d(&p.a_scales, bar, s, n0, tile.block_base + j);
          tma_load_2d(&p.b_scales, bar, s + Cfg::BLOCK_M * 4, k0, tile.block_base + j);
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kMathRegs>();
    const int mwg = warpgroup - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int r0 = 16 * warp + lane / 4;
    using Mma = WgmmaFp8<Cfg::BLOCK_N>;
    constexpr int R = Mma::kRegs;
    float acc[R], part0[R];
    float part1[Cfg::kSerial ? 1 : R];  // the second partial fragment of the two-fragment pipeline
    PipelineState<Cfg::STAGES> st;
    int slot = 0;  // of the scale ring, in step with st
    const KmajorSw128Desc da0{__shfl_sync(0xffffffffu, KmajorSw128Desc::at(smem + Cfg::OFF_A + mwg * 64 * 128).lo, 0)};
    const KmajorSw128Desc db0{__shfl_sync(0xffffffffu, KmajorSw128Desc::at(smem + Cfg::OFF_B).lo, 0)};
    uint8_t* const d_tile = smem + Cfg::OFF_D + mwg * Cfg::kPassBoxes * Cfg::kBoxBytes;  // this warpgroup's staging

    auto issue = [&](float(&frag)[R], const PipelineState<Cfg::STAGES>& at) {
      const KmajorSw128Desc da = da0.plus_units(at.stage * (Cfg::A_BYTES >> 4));
      const KmajorSw128Desc db = db0.plus_units(at.stage * (Cfg::B_BYTES >> 4));
      fence_regs(frag);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) Mma::mma(da.plus_bytes(32 * k).value(), db.plus_bytes(32 * k).value(), frag, k > 0);
      wgmma_commit();
    };
    auto promote = [&](const float(&frag)[R], int at_slot) {
      const float* s = reinterpret_cast<const float*>(smem + Cfg::OFF_S + at_slot * Cfg::S_BYTES);
      promote_row_col_scaled(acc, frag, s[64 * mwg + r0], s[64 * mwg + r0 + 8], s + Cfg::BLOCK_M + 2 * (lane % 4));
    };
    // The leader's TMA boxes of this warpgroup's 64 x 128 slab (those of one staging pass): store D, or add the
    // slab into it. A box wholly past the N or K edge is not written; TMA clips the partial ones.
    auto store_slab = [&](const KTile& tile, int pass) {
      const int n0 = tile.n_block * Cfg::BLOCK_M + 64 * mwg, k0 = tile.k_block * Cfg::BLOCK_N;
      constexpr int kCols = Cfg::kF32 ? 32 : 64;  // columns per 128-byte box row
      for (int i = 0; i < Cfg::kPassBoxes; ++i) {
        const int b = pass * Cfg::kPassBoxes + i;
        if (k0 + kCols * b >= p.k) continue;
        if constexpr (Cfg::kAccumulate)
          tma_reduce_add_3d(&p.d_tma, d_tile + i * Cfg::kBoxBytes, k0 + kCols * b, n0, tile.group);
        else
          tma_store_3d(&p.d_tma, d_tile + i * Cfg::kBoxBytes, k0 + kCols * b, n0, tile.group);
      }
    };
    auto next_slot = [](int s_) { return s_ + 1 == Cfg::S_SLOTS ? 0 : s_ + 1; };

    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const KTile tile = sched.get(t);
      const int blocks = min((tile.tokens + 127) / 128, p.num_blocks_max - tile.block_base);
      if (Cfg::kAccumulate && blocks <= 0) continue;  // an empty group leaves C unchanged
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] = 0.f;
      if constexpr (Cfg::kSerial) {
        // One partial fragment: retire and promote each block before the next one's wgmma; the other two
        // warpgroups' blocks keep the tensor cores busy meanwhile.
        for (int j = 0; j < blocks; ++j) {
          pipe.consumer_wait(st);
          issue(part0, st);
          // The row scales read while the wgmma runs (two registers; the 32 column scales do not fit beside
          // the two fragments in 160 registers and are read by the promotion).
          const float* s = reinterpret_cast<const float*>(smem + Cfg::OFF_S + slot * Cfg::S_BYTES);
          const float sa0 = s[64 * mwg + r0], sa1 = s[64 * mwg + r0 + 8];
          wgmma_wait<0>();
          fence_regs(part0);
          pipe.consumer_release(st, lane);
          promote_row_col_scaled(acc, part0, sa0, sa1, s + Cfg::BLOCK_M + 2 * (lane % 4));
          st.advance();
          slot = next_slot(slot);
        }
      } else if (blocks > 0) {
        pipe.consumer_wait(st);
        issue(part0, st);
        auto step = [&](int, float(&cur)[R], float(&nxt)[R]) {
          PipelineState<Cfg::STAGES> next = st;
          next.advance();
          pipe.consumer_wait(next);
          issue(nxt, next);
          wgmma_wait<1>();  // block j is complete; j+1 may still run
          fence_regs(cur);
          pipe.consumer_release(st, lane);  // its operands are read; its scales stay in their ring slot
          promote(cur, slot);
          st.advance();
          slot = next_slot(slot);
        };
        auto last = [&](float(&cur)[R]) {
          wgmma_wait<0>();
          fence_regs(cur);
          pipe.consumer_release(st, lane);
          promote(cur, slot);
          st.advance();
          slot = next_slot(slot);
        };
        two_fragment_pipeline(blocks, part0, part1, step, last);
      }

      // The tile again (shared-memory reads): holding its fields through the contraction would cost registers.
      const KTile et = sched.get(t);
      if (p.tma_out) {
        if (et.n_block * Cfg::BLOCK_M + 64 * mwg >= p.n) continue;  // this warpgroup's rows are all past N
#pragma unroll
        for (int pass = 0; pass < Cfg::kStagingPasses; ++pass) {
          if (tid == 0) tma_store_wait_read<0>();  // the previous stores (tile or pass) have read the staging tile
          named_barrier_sync(1 + mwg, 128);
          if constexpr (Cfg::kF32) {
            // Element (row rr, column c) of the slab lives in box c / 32, swizzle row rr, 16-byte chunk
            // (c % 32) / 4; a pass stages the boxes [pass * kPassBoxes, +kPassBoxes), i.e. fragment columns
            // j in [pass * R / 4 / passes, +R / 4 / passes).
            constexpr int kJ = R / 4 / Cfg::kStagingPasses;
#pragma unroll
            for (int jj = 0; jj < kJ; ++jj)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int j = pass * kJ + jj, rr = r0 + 8 * h, c = 8 * j + 2 * (lane % 4);
                const int box = (c >> 5) - pass * Cfg::kPassBoxes;
                float2* dst = reinterpret_cast<float2*>(d_tile + box * Cfg::kBoxBytes +
                                                        sw128_offset(rr, (c & 31) >> 2) + (c & 3) * 4);
                *dst = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
              }
          } else {
            stage_bf16_fragment<Cfg::kBoxBytes>(d_tile, acc, r0, lane);
          }
          fence_proxy_async_smem();
          named_barrier_sync(1 + mwg, 128);
          if (tid == 0) {
            store_slab(et, pass);
            tma_store_commit();
          }
        }
      } else {
        // Register epilogue for a D that is not 16-byte aligned: element-wise, so any element alignment works.
        const int row_a = et.n_block * Cfg::BLOCK_M + 64 * mwg + r0;
        const size_t group_base = static_cast<size_t>(et.group) * p.n * p.k;
        auto offset = [&](int j, int h, int e) -> long long {  // element of fragment register 4j + 2h + e, or -1
          const int col = et.k_block * Cfg::BLOCK_N + 8 * j + 2 * (lane % 4) + e, row = row_a + 8 * h;
          return col < p.k && row < p.n ? static_cast<long long>(group_base + static_cast<size_t>(row) * p.k + col) : -1;
        };
        if constexpr (!Cfg::kF32) {
          __nv_bfloat16* d16 = static_cast<__nv_bfloat16*>(p.d);
#pragma unroll
          for (int i = 0; i < R; ++i)
            if (const long long idx = offset(i / 4, (i / 2) & 1, i & 1); idx >= 0) d16[idx] = __float2bfloat16_rn(acc[i]);
        } else {
          float* d32 = static_cast<float*>(p.d);
          if (Cfg::kAccumulate) {
            // C in chunks, every load of a chunk before its first store: loads and stores may alias as far as
            // the compiler knows, so one element at a time would serialise R global round trips. (A whole
            // fragment of C does not fit beside the two partial fragments.)
            constexpr int kChunk = 16;
#pragma unroll
            for (int i0 = 0; i0 < R; i0 += kChunk) {
              float c[kChunk];
#pragma unroll
              for (int i = 0; i < kChunk; ++i) {
                const long long idx = offset((i0 + i) / 4, ((i0 + i) / 2) & 1, (i0 + i) & 1);
                c[i] = idx >= 0 ? __ldcg(d32 + idx) : 0.f;
              }
#pragma unroll
              for (int i = 0; i < kChunk; ++i) {
                const long long idx = offset((i0 + i) / 4, ((i0 + i) / 2) & 1, (i0 + i) & 1);
                if (idx >= 0) d32[idx] = __fadd_rn(c[i], acc[i0 + i]);
              }
            }
          } else {
#pragma unroll
            for (int i = 0; i < R; ++i)
              if (const long long idx = offset(i / 4, (i / 2) & 1, i & 1); idx >= 0) d32[idx] = acc[i];
          }
        }
      }
    }
    if (p.tma_out && tid == 0) tma_store_wait_all();
  }
}

}  // namespace megatron_tma
