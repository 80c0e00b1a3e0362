// K-grouped FP8 GEMM (weight gradient) without padding: dW[g] = dY_g^T . X_g, contracting over each group's
// own tokens, whatever their count.
//
// Operands (docs/design.md §4, docs/layouts.md): token-contiguous dY^T [N, P] and X^T [K, P]; group g's tokens sit at
// columns [a_g, a_g + M_g), a_g = sum_{h<g} round_up(M_h, 16), with zeros in the <= 15 columns after each group;
// one FP32 scale per row per 128-token block counted from the group's first token (rows B_g + j of the scales).
//
// Why the 16-token group starts: TMA needs the innermost start coordinate of a box 16-byte aligned, and here the
// innermost dimension is the token. With every group starting on a 16-token boundary, each block
// [a_g + 128 j, ...) starts aligned, so TMA loads it straight into its 128B-swizzled operand tile at its exact K
// positions (the tensor cores' k32 partial sums depend on which tokens share a step: that is what makes the bits
// those of the 128-padded layout). A group's last block may be partial; its box runs into the zero gap and the
// next group's tokens, so the math warps zero the tokens past the group's end in both operand tiles before its
// wgmma: every product there is then exactly 0 * 0, as in the padded layout (docs/design.md §3).
//
// Structure: the M-grouped kernel's, over the K-grouped scheduler's tiles (group, N block, K block). Persistent
// grid; warpgroup 0 = one TMA producer thread; warpgroups 1-2 = math, 64 output rows (N) each, with two partial
// fragments so that block j+1 runs on the tensor cores while block j is promoted:
// acc = fma(sa[n] * sb[k], p, acc), ascending blocks (the per-element scale product is the wgrad's extra cost
// over the M-grouped promotion: two FP32 operations per element and block instead of one).
// Output (kOut): BF16, FP32, or FP32 accumulated into C (Megatron's main_grad: D = C + A.B, one __fadd_rn per
// element after the whole contraction; an empty group leaves C untouched). When D is 16-byte aligned a tile leaves
// through a 128B-swizzled staging tile and TMA stores (whole lines; the N and K edges clipped by TMA), and C comes in
// by TMA at the start of the tile, under its whole contraction. Otherwise (D only element-aligned, e.g. a main_grad
// view at an odd float offset) the threads store from registers, every load of C issued before the first store.
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
  int tma_out;           // D 16-byte aligned: staging tile + TMA (and C by TMA); else register stores
};

template <KGroupedOut kOut_>
struct KGroupedGemmConfig {
  static constexpr KGroupedOut kOut = kOut_;
  static constexpr bool kF32 = kOut != KGroupedOut::kBf16, kAccumulate = kOut == KGroupedOut::kF32Accumulate;
  // BLOCK_M x BLOCK_N output rows (N) x columns (K), BLOCK_K tokens per block.
  static constexpr int BLOCK_M = 128, BLOCK_N = 128, BLOCK_K = 128;
  // The FP32 staging tile is twice the BF16 one: one stage fewer keeps it in shared memory.
  static constexpr int STAGES = kF32 ? 4 : 5;
  static constexpr int kMathWarpgroups = 2, kThreads = 128 * (1 + kMathWarpgroups);
  static constexpr int kProducerRegs = 24, kMathRegs = 240;
  // setmaxnreg.inc takes its registers from the CTA pool, which holds only what setmaxnreg.dec released
  // (the launch gives every thread 64K / kThreads rounded down to 8: 168): a split over that budget hangs.
  static_assert(128 * kProducerRegs + 128 * kMathWarpgroups * kMathRegs <= kThreads * ((65536 / kThreads) & ~7),
                "the math warpgroups' setmaxnreg.inc must be covered by the producer's dec");
  static constexpr int A_BYTES = BLOCK_M * BLOCK_K, B_BYTES = BLOCK_N * BLOCK_K;
  static constexpr int S_BYTES = (BLOCK_M + BLOCK_N) * 4;  // the block's row scales sa[n], then sb[k]
  // Staging: per math warpgroup 64 rows x 128 columns, as 128-byte swizzle rows: BF16 two 64-column boxes,
  // FP32 four 32-column boxes, each box 64 rows x 128 B = 8 KB.
  static constexpr int kBoxBytes = 64 * 128, kBoxes = kF32 ? 4 : 2;
  static constexpr int D_BYTES = kMathWarpgroups * kBoxes * kBoxBytes;
  static constexpr int OFF_A = 0;
  static constexpr int OFF_B = OFF_A + STAGES * A_BYTES;
  static constexpr int OFF_D = OFF_B + STAGES * B_BYTES;
  static constexpr int OFF_S = OFF_D + D_BYTES;
  static constexpr int OFF_BAR = OFF_S + STAGES * S_BYTES;
  static constexpr int OFF_CBAR = OFF_BAR + 2 * STAGES * 8;  // per math warpgroup: its C slab landed
  static constexpr int OFF_SCRATCH = OFF_CBAR + 16;
  static constexpr int OFF_GROUPS = OFF_SCRATCH + 256;
  static constexpr int kMaxGroups = 1024;
  // Group columns a_g [G+1], token counts [G] (padded to G+1), token-block offsets B_g [G+1].
  static size_t smem_bytes(int num_groups) { return 1024 + OFF_GROUPS + 3 * (num_groups + 1) * sizeof(int); }
  static_assert(OFF_B % 1024 == 0 && OFF_D % 1024 == 0, "128B-swizzled tiles need 1024-byte alignment");
  static_assert(1024 + OFF_GROUPS + 3 * (kMaxGroups + 1) * 4 <= 227 * 1024, "fits the SM90 shared memory");
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
__global__ void __launch_bounds__(Cfg::kThreads, 1) k_grouped_fp8_gemm_kernel(const __grid_constant__ KGroupedGemmParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Cfg::OFF_BAR);
  const Pipeline<Cfg::STAGES> pipe{full_bar, full_bar + Cfg::STAGES};
  uint64_t* c_bar = reinterpret_cast<uint64_t*>(smem + Cfg::OFF_CBAR);
  int* scratch = reinterpret_cast<int*>(smem + Cfg::OFF_SCRATCH);
  const int G = p.groups.num_groups;
  int* col_off = reinterpret_cast<int*>(smem + Cfg::OFF_GROUPS);  // a_g, clamped to P
  int* tokens = col_off + G + 1;                                   // M_g, clamped to the columns it owns
  int* block_off = tokens + G + 1;                                 // B_g, clamped to MB
  if (threadIdx.x == 0) {
    mbar_init(&c_bar[0], 1);
    mbar_init(&c_bar[1], 1);
    pipe.init(Cfg::kMathWarpgroups * 4);  // (its fence also publishes c_bar)
    tma_prefetch_descriptor(&p.a);
    tma_prefetch_descriptor(&p.b);
    tma_prefetch_descriptor(&p.a_scales);
    tma_prefetch_descriptor(&p.b_scales);
  }
  block_exclusive_scan(G, [&](int i) { return (groups_size(p.groups, i) + 15) & ~15; }, col_off, p.p_tokens, scratch);
  for (int i = threadIdx.x; i < G; i += blockDim.x) tokens[i] = min(groups_size(p.groups, i), col_off[i + 1] - col_off[i]);
  __syncthreads();
  block_exclusive_scan(G, [&](int i) { return (tokens[i] + 127) / 128; }, block_off, p.num_blocks_max, scratch);
  const KGroupedScheduler sched{col_off, tokens, block_off, G, (p.n + Cfg::BLOCK_M - 1) / Cfg::BLOCK_M,
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
        const int blocks = min((tile.tokens + 127) / 128, p.num_blocks_max - tile.block_base);
        for (int j = 0; j < blocks; ++j, st.advance()) {
          uint64_t* bar = pipe.producer_acquire(st, Cfg::A_BYTES + Cfg::B_BYTES + Cfg::S_BYTES);
          const int tok = tile.token_start + 128 * j;  // a multiple of 16: a legal TMA start
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
    uint8_t* const d_tile = smem + Cfg::OFF_D + mwg * Cfg::kBoxes * Cfg::kBoxBytes;  // this warpgroup's staging
    uint32_t c_parity = 0;                                                            // of its next C load

    auto issue = [&](float(&frag)[R], const PipelineState<Cfg::STAGES>& at) {
      const KmajorSw128Desc da = da0.plus_units(at.stage * (Cfg::A_BYTES >> 4));
      const KmajorSw128Desc db = db0.plus_units(at.stage * (Cfg::B_BYTES >> 4));
      fence_regs(frag);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) Mma::mma(da.plus_bytes(32 * k).value(), db.plus_bytes(32 * k).value(), frag, k > 0);
      wgmma_commit();
    };
    // A block whose group ends inside it: both warpgroups zero the tokens past the end (thread mtid owns row
    // mtid % 128 of operand mtid / 128), then meet before either issues its wgmma.
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
    // The leader's TMA boxes of this warpgroup's 64 x 128 slab: load C (accumulate) or store D. A box wholly
    // past the N or K edge is neither loaded nor stored; TMA clips the partial ones.
    auto slab_boxes = [&](const KTile& tile, bool load) {
      const int n0 = tile.n_block * Cfg::BLOCK_M + 64 * mwg, k0 = tile.k_block * Cfg::BLOCK_N;
      constexpr int kCols = Cfg::kF32 ? 32 : 64;  // columns per 128-byte box row
      if (n0 >= p.n) return;
      if (load) {
        int boxes = 0;
        for (int b = 0; b < Cfg::kBoxes; ++b) boxes += k0 + kCols * b < p.k;
        mbar_arrive_expect_tx(&c_bar[mwg], boxes * Cfg::kBoxBytes);
      }
      for (int b = 0; b < Cfg::kBoxes; ++b) {
        if (k0 + kCols * b >= p.k) continue;
        if (load)
          tma_load_3d(&p.d_tma, &c_bar[mwg], d_tile + b * Cfg::kBoxBytes, k0 + kCols * b, n0, tile.group);
        else
          tma_store_3d(&p.d_tma, d_tile + b * Cfg::kBoxBytes, k0 + kCols * b, n0, tile.group);
      }
    };

    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const KTile tile = sched.get(t);
      const int blocks = min((tile.tokens + 127) / 128, p.num_blocks_max - tile.block_base);
      if (Cfg::kAccumulate && blocks <= 0) continue;  // an empty group leaves C unchanged
      if (Cfg::kAccumulate && p.tma_out && tid == 0) {
        // C comes in under the whole contraction. The staging tile must be free: the previous tile's stores
        // have read it once wait_read returns (this warpgroup's threads wrote it before the barrier that
        // preceded those stores).
        tma_store_wait_read<0>();
        slab_boxes(tile, true);
      }
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
          promote(cur, st);  // reads block j's scales from its slot: release after
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

      // The tile again (shared-memory reads): holding its fields through the contraction would cost registers.
      const KTile et = sched.get(t);
      if (p.tma_out) {
        if (et.n_block * Cfg::BLOCK_M + 64 * mwg >= p.n) continue;  // this warpgroup's rows are all past N
        if (Cfg::kAccumulate) {
          mbar_wait(&c_bar[mwg], c_parity);
          c_parity ^= 1u;
        } else {
          if (tid == 0) tma_store_wait_read<0>();  // the previous tile's stores have read the staging tile
          named_barrier_sync(1 + mwg, 128);
        }
        if constexpr (Cfg::kF32) {
          // Element (row rr, column c) of the slab lives in box c / 32, swizzle row rr, 16-byte chunk (c % 32) / 4.
#pragma unroll
          for (int j = 0; j < R / 4; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int rr = r0 + 8 * h, c = 8 * j + 2 * (lane % 4);
              float2* slot = reinterpret_cast<float2*>(d_tile + (c >> 5) * Cfg::kBoxBytes +
                                                       sw128_offset(rr, (c & 31) >> 2) + (c & 3) * 4);
              float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
              if (Cfg::kAccumulate) {
                const float2 c_old = *slot;
                v = make_float2(__fadd_rn(c_old.x, v.x), __fadd_rn(c_old.y, v.y));
              }
              *slot = v;
            }
        } else {
          stage_bf16_fragment<Cfg::kBoxBytes>(d_tile, acc, r0, lane);
        }
        fence_proxy_async_smem();
        named_barrier_sync(1 + mwg, 128);
        if (tid == 0) {
          slab_boxes(et, false);
          tma_store_commit();
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
