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
//   1. the producer streams the group's tokens as 128-aligned 128-token chunks (128 rows of each operand,
//      128B-swizzled, whole L2 lines), each chunk loaded once per tile, plus each block's scales;
//   2. block j lies in chunks j and j+1 at a fixed offset (o_g mod 128); the math warpgroups copy it out
//      of the two chunks into the 128B-swizzled operand tiles (16-byte pieces and funnel shifts), writing
//      zeros for tokens past the group's end (they belong to the next group: products there are exactly
//      0 * 0, as in the padded layout);
//   3. wgmma on the tiles, then promotion acc = fma(sa[n] * sb[k], p, acc) in ascending block order.
// Three operand-tile buffers let block j+2 be realigned while block j+1 runs on the tensor cores and
// block j is promoted. Nothing is padded in memory and nothing is read on the host. out = acc, or C + acc
// when accumulating (Megatron's main_grad). Deterministic: each output element is owned by one thread.
// Output, when D is 16-byte aligned: through 128B-swizzled staging tiles in shared memory and TMA stores (whole
// lines, edges clipped), BF16 and FP32 alike; when accumulating, C comes in by TMA under the last block's
// wgmma and is added in shared memory. Otherwise (D only 4- or 8-byte aligned) from registers, every load of C
// issued before the first store. Both FP32 paths compute __fadd_rn(c, acc): the same bits.
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
  CUtensorMap a;         // dY^T e4m3: dims (M_total, N), row pitch, box (128 tokens, 128 rows), 128B swizzle
  CUtensorMap b;         // X^T  e4m3: dims (M_total, K), box (128, 128), 128B swizzle
  CUtensorMap a_scales;  // fp32 [MB_max, N]: dims (N, MB_max), box (128, 1)
  CUtensorMap b_scales;  // fp32 [MB_max, K]: dims (K, MB_max), box (128, 1)
  CUtensorMap d_tma;     // D [G, N, K]: dims (K, N, G), box (128 B of a row = 64 bf16 / 32 fp32, 64, 1), SW128
  void* d;               // [G, N, K] fp32 (or bf16), contiguous
  GroupsArg groups;
  int m_total, n, k;
  int accumulate;        // d = d + A.B (fp32 only)
  int out_bf16;
  int tma_out;           // d 16-byte aligned: tiles leave through shared memory and TMA stores (d_tma), and C
                         // comes in by TMA when accumulating; otherwise from registers
};

template <int STAGES_>
struct KGroupedGemmConfig {
  static constexpr int BLOCK_M = 128, BLOCK_N = 128, BLOCK_K = 128, STAGES = STAGES_;
  static constexpr int kMathWarpgroups = 2, kThreads = 128 * (1 + kMathWarpgroups);
  static constexpr int kProducerRegs = 24, kMathRegs = 240;
  // setmaxnreg.inc takes its registers from the CTA pool, which holds only what setmaxnreg.dec released
  // (the launch gives every thread 64K / kThreads rounded down to 8: 168): a split over that budget hangs.
  static_assert(128 * kProducerRegs + 128 * kMathWarpgroups * kMathRegs <= kThreads * ((65536 / kThreads) & ~7),
                "the math warpgroups' setmaxnreg.inc must be covered by the producer's dec");
  static constexpr int kTileBuffers = 3;                      // realign j+1 while j runs and j-1 is promoted
  static constexpr int CHUNK_BYTES = 128 * 128;               // one operand's aligned 128-token chunk
  static constexpr int TILE_BYTES = 128 * BLOCK_K;            // one operand's swizzled wgmma tile
  static constexpr int SCALE_BYTES = 128 * 4;
  static constexpr int TX_CHUNK = 2 * CHUNK_BYTES, TX_SCALES = 2 * SCALE_BYTES;
  static constexpr int OFF_TILES = 0;                         // kTileBuffers x [A tile, B tile]
  static constexpr int OFF_SCALES = OFF_TILES + kTileBuffers * 2 * TILE_BYTES;  // kTileBuffers x [sa, sb]
  static constexpr int OFF_STAGE = OFF_SCALES + kTileBuffers * 2 * SCALE_BYTES;  // ring: [A, B, sa, sb] per stage
  static constexpr int STAGE_SLOT = 2 * CHUNK_BYTES + 2 * SCALE_BYTES;
  static constexpr int OFF_BAR = OFF_STAGE + STAGES * STAGE_SLOT;
  // Per math warpgroup: an mbarrier (its C tile landed) and the parity of its next C load. The parity lives in
  // shared memory: as a register it is long-lived and rarely used, and ptxas spills it.
  static constexpr int OFF_CBAR = OFF_BAR + 2 * STAGES * 8;
  static constexpr int OFF_SCRATCH = OFF_CBAR + 32;
  static constexpr int OFF_GROUPS = OFF_SCRATCH + 256;
  static constexpr int kMaxGroups = 1024;
  static size_t smem_bytes(int num_groups) { return 1024 + OFF_GROUPS + 2 * (num_groups + 1) * sizeof(int); }
  static_assert(STAGE_SLOT % 1024 == 0 && OFF_STAGE % 1024 == 0, "128B-swizzled TMA boxes need 1024-byte alignment");
  static_assert(1024 + OFF_GROUPS + 2 * (kMaxGroups + 1) * 4 <= 227 * 1024, "fits the SM90 shared memory");
};

// Copy the 128 tokens starting at byte `off` of the 256-byte concatenation of two staged chunk rows
// (row_a ++ row_b, both 128B-swizzled) into a 128B-swizzled tile row, zeroing tokens at or past `valid`
// (kMasked: the group's last block). One thread owns the whole row and slides a 32-byte window along it:
// 9 loads of 16 B, 32 funnel shifts, 8 stores, only 8 words live (room for the two in-flight wgmma
// fragments). off = 16 * qw + 4 * Q + bits / 8; Q is a template parameter so that the word selection is
// static. Bank-conflict free: the 8 threads of a quarter-warp own 8 consecutive rows, whose swizzles put
// the same logical 16-byte piece in 8 distinct bank groups, on both sides.
template <int Q, bool kMasked>
__device__ __forceinline__ void realign_row(const uint8_t* row_a, const uint8_t* row_b, uint8_t* tile_row, int row,
                                            int qw, uint32_t bits, int valid) {
  const int r7 = row & 7;
  auto piece = [&](int k) {  // logical 16-byte piece k (0..15) of the concatenated row
    return *reinterpret_cast<const uint4*>((k < 8 ? row_a : row_b) + (((k & 7) ^ r7) << 4));
  };
  uint4 hi = piece(qw);
#pragma unroll
  for (int chunk = 0; chunk < 8; ++chunk) {
    const uint4 lo = hi;
    hi = piece(qw + chunk + 1);
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint32_t u[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) u[i] = __funnelshift_r(w[Q + i], w[Q + i + 1], bits);
    if constexpr (kMasked) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int k = valid - 16 * chunk - 4 * i;  // bytes of word i that are real tokens
        u[i] = k >= 4 ? u[i] : (k <= 0 ? 0u : (u[i] & ((1u << (8 * k)) - 1u)));
      }
    }
    *reinterpret_cast<uint4*>(tile_row + ((chunk ^ r7) << 4)) = make_uint4(u[0], u[1], u[2], u[3]);
  }
}

template <bool kMasked>
__device__ __forceinline__ void realign_row_dispatch(const uint8_t* row_a, const uint8_t* row_b, uint8_t* tile_row,
                                                     int row, int off, int valid) {
  const uint32_t bits = 8u * (off & 3);
  const int qw = off >> 4;
  switch ((off >> 2) & 3) {  // uniform over the CTA: one branch per group
    case 0: realign_row<0, kMasked>(row_a, row_b, tile_row, row, qw, bits, valid); break;
    case 1: realign_row<1, kMasked>(row_a, row_b, tile_row, row, qw, bits, valid); break;
    case 2: realign_row<2, kMasked>(row_a, row_b, tile_row, row, qw, bits, valid); break;
    default: realign_row<3, kMasked>(row_a, row_b, tile_row, row, qw, bits, valid); break;
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

  uint64_t* c_bar = reinterpret_cast<uint64_t*>(smem + Cfg::OFF_CBAR);
  if (threadIdx.x == 0) {
    mbar_init(&c_bar[0], 1);
    mbar_init(&c_bar[1], 1);
    reinterpret_cast<uint32_t*>(c_bar + 2)[0] = reinterpret_cast<uint32_t*>(c_bar + 2)[1] = 0;  // C-load parities
    pipe.init(Cfg::kMathWarpgroups * 4);  // (its fence also publishes c_bar)
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
      // The bulk L2 prefetch needs 16-byte aligned rows: K % 16 == 0 makes every C row as aligned as C's
      // start, which the API only requires to be 8-byte aligned (a pair of floats). An 8-byte offset C gets no
      // prefetch (it faulted with "misaligned address" before this check).
      const bool c_prefetch = p.accumulate && (reinterpret_cast<uintptr_t>(p.d) & 15) == 0;
      PipelineState<Cfg::STAGES> st;
      for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
        const KTile tile = sched.get(t);
        const int n0 = tile.n_block * Cfg::BLOCK_M, k0 = tile.k_block * Cfg::BLOCK_N;
        const int blocks = (tile.tokens + 127) / 128;
        const int c0 = tile.token_start >> 7, chunks = tile.tokens ? ((tile.token_start + tile.tokens + 127) >> 7) - c0 : 0;
        if (c_prefetch && chunks > 0) {
          // The epilogue reads C (main_grad) back: pull this tile of it into L2 now, blocks ahead of that
          // read, so the math warps do not stall on DRAM in their epilogue (otherwise a quarter of the time
          // on large groups).
          const float* c_tile = static_cast<const float*>(p.d) + (static_cast<size_t>(tile.group) * p.n + n0) * p.k + k0;
          const uint32_t row_bytes = 4u * min(Cfg::BLOCK_N, p.k - k0);
          for (int r = 0; r < min(Cfg::BLOCK_M, p.n - n0); ++r) prefetch_l2_bulk(c_tile + static_cast<size_t>(r) * p.k, row_bytes);
        }
        for (int i = 0; i < chunks; ++i, st.advance()) {
          const bool scales = i < blocks;  // block i's scales ride with its first chunk
          uint64_t* bar = pipe.producer_acquire(st, Cfg::TX_CHUNK + (scales ? Cfg::TX_SCALES : 0));
          uint8_t* s = stage_ptr(st.stage);
          tma_load_2d(&p.a, bar, s, 128 * (c0 + i), n0);
          tma_load_2d(&p.b, bar, s + Cfg::CHUNK_BYTES, 128 * (c0 + i), k0);
          if (scales) {
            tma_load_2d(&p.a_scales, bar, s + 2 * Cfg::CHUNK_BYTES, n0, tile.block_base + i);
            tma_load_2d(&p.b_scales, bar, s + 2 * Cfg::CHUNK_BYTES + Cfg::SCALE_BYTES, k0, tile.block_base + i);
          }
        }
      }
    }
  } else {
    setmaxnreg_inc<Cfg::kMathRegs>();
    const int mwg = warpgroup - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    const int mtid = threadIdx.x - 128;  // 0..255 over both math warpgroups
    const int r0 = 16 * warp + lane / 4;
    // Realignment ownership: thread mtid copies row (mtid % 128) of operand (mtid / 128), i.e. the first
    // math warpgroup moves the dY^T rows and the second the X^T rows.
    const int my_op = mtid >> 7, my_row = mtid & 127;
    using Mma = WgmmaFp8<Cfg::BLOCK_N>;
    constexpr int R = Mma::kRegs;
    float acc[R], part0[R], part1[R];
    PipelineState<Cfg::STAGES> st;
    auto tiles_of = [&](int buf) { return smem + Cfg::OFF_TILES + buf * 2 * Cfg::TILE_BYTES; };
    auto scales_of = [&](int buf) {
      return reinterpret_cast<float*>(smem + Cfg::OFF_SCALES + buf * 2 * Cfg::SCALE_BYTES);
    };
    auto next_buf = [](int b) { return b == Cfg::kTileBuffers - 1 ? 0 : b + 1; };
    // Move block j out of its chunks (staging slots j and j+1 of the tile): realign it into tile buffer
    // `buf` (visible to the tensor cores after the caller's barrier), copy its row/column scales beside it,
    // and hand chunk j back to the producer (block j+1 starts in chunk j+1). After the tile's last block
    // a trailing chunk is handed back too, so that loads run up to STAGES chunks ahead of the math.
    auto unstage = [&](int buf, int j, int blocks, int chunks, int off, int valid) {
      pipe.consumer_wait(st);
      PipelineState<Cfg::STAGES> nxt = st;
      nxt.advance();
      const bool two = j + 1 < chunks;  // else every byte past this chunk is masked: read any valid row
      if (two) pipe.consumer_wait(nxt);
      const uint8_t* s = stage_ptr(st.stage);
      const uint8_t* row_a = s + my_op * Cfg::CHUNK_BYTES + my_row * 128;
      const uint8_t* row_b = two ? stage_ptr(nxt.stage) + my_op * Cfg::CHUNK_BYTES + my_row * 128 : row_a;
      uint8_t* dst = tiles_of(buf) + my_op * Cfg::TILE_BYTES + my_row * 128;
      if (valid >= 128)
        realign_row_dispatch<false>(row_a, row_b, dst, my_row, off, valid);
      else
        realign_row_dispatch<true>(row_a, row_b, dst, my_row, off, valid);
      scales_of(buf)[mtid] = reinterpret_cast<const float*>(s + 2 * Cfg::CHUNK_BYTES)[mtid];  // sa then sb
      fence_proxy_async_smem();
      pipe.consumer_release(st, lane);
      st.advance();
      if (j + 1 == blocks && two) {  // the trailing chunk of the tile
        pipe.consumer_release(st, lane);
        st.advance();
      }
    };
    auto issue = [&](float(&frag)[R], int buf) {
      const uint8_t* tiles = tiles_of(buf);
      const uint64_t da = make_kmajor_sw128_desc(tiles + mwg * 64 * 128);
      const uint64_t db = make_kmajor_sw128_desc(tiles + Cfg::TILE_BYTES);
      fence_regs(frag);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) Mma::mma(desc_advance(da, 32 * k), desc_advance(db, 32 * k), frag, k > 0);
      wgmma_commit();
    };
    auto promote = [&](const float(&frag)[R], int buf) {
      const float* sa = scales_of(buf);
      promote_row_col_scaled(acc, frag, sa[64 * mwg + r0], sa[64 * mwg + r0 + 8], sa + 128 + 2 * (lane % 4));
    };

    // FP32 tiles through shared memory: this warpgroup's 64 x 128 slab is two 16 KB regions, columns 0-63 in its
    // half of the buffer that held the tile's block B-2 and columns 64-127 in its half of the buffer the next
    // tile's first block goes to (which only this warpgroup's own threads write then: warpgroup 0 realigns the
    // A rows, 1 the B rows). Each region is two 32-column TMA boxes of 64 rows x 128 B, 128B-swizzled.
    volatile uint32_t* c_phase = reinterpret_cast<uint32_t*>(c_bar + 2) + mwg;  // parity of the next C load
    auto f32_region = [&](int after_buf, int box) {  // box 0..3 = columns 32*box..; after_buf: buf after the tile
      return tiles_of(box < 2 ? next_buf(after_buf) : after_buf) + mwg * Cfg::TILE_BYTES + (box & 1) * 8192;
    };
    auto f32_pair = [&](int after_buf, int rr, int c) {  // this WG's staged (row rr, columns c, c+1), c even
      const int cb = c & 31;
      return reinterpret_cast<float2*>(f32_region(after_buf, c >> 5) + rr * 128 + (((cb >> 2) ^ (rr & 7)) << 4) +
                                       (cb & 3) * 4);
    };
    auto f32_boxes = [&](const KTile& tile, int after_buf, bool load) {  // leader: TMA load (C) or store (D)
      const int n0 = tile.n_block * Cfg::BLOCK_M + 64 * mwg, k0 = tile.k_block * Cfg::BLOCK_N;
      if (n0 >= p.n) return;
      if (load) {
        int boxes = 0;
        for (int b = 0; b < 4; ++b) boxes += k0 + 32 * b < p.k;
        mbar_arrive_expect_tx(&c_bar[mwg], boxes * 8192);
      }
      for (int b = 0; b < 4; ++b) {
        if (k0 + 32 * b >= p.k) continue;  // a box wholly past the edge is neither loaded nor stored
        if (load)
          tma_load_3d(&p.d_tma, &c_bar[mwg], f32_region(after_buf, b), k0 + 32 * b, n0, tile.group);
        else
          tma_store_3d(&p.d_tma, f32_region(after_buf, b), k0 + 32 * b, n0, tile.group);
      }
    };

    int buf = 0;  // tile buffer of the next block; rotates over every block this CTA runs, across tiles
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const KTile tile = sched.get(t);
      const int blocks = (tile.tokens + 127) / 128;
      if (blocks == 0 && p.accumulate) continue;  // an empty group leaves C unchanged
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] = 0.f;
      const int off = tile.token_start & 127;  // where every block starts in its first chunk
      const int chunks = blocks ? ((tile.token_start + tile.tokens + 127) >> 7) - (tile.token_start >> 7) : 0;
      if (blocks > 0) {
        // Block j sits in tile buffer (buf0 + j) % 3. A buffer is refilled (block j+2, during step j) only
        // after its last occupant was released before a 256-thread barrier that the writers have passed: an
        // operand block (retired by both warpgroups in step j-1, whose closing barrier orders that before any
        // refill), or a previous tile's BF16 staging tile (its TMA store has read it: each leader waits for
        // that before it reaches the next barrier 3).
        const int buf0 = buf;
        unstage(buf0, 0, blocks, chunks, off, min(128, tile.tokens));
        named_barrier_sync(3, 256);
        issue(part0, buf0);
        if (blocks > 1) unstage(next_buf(buf0), 1, blocks, chunks, off, min(128, tile.tokens - 128));
        named_barrier_sync(3, 256);
        // Step j: launch block j+1 into `nxt`, realign block j+2, retire block j from `cur` (wait_group 1
        // leaves block j+1 running on the tensor cores) and promote it. The wgmma issue is straight-line
        // code (no branch around it) so that ptxas keeps the two groups in flight.
        int cur_buf = buf0;
        auto step = [&](int j, float(&cur)[R], float(&nxt)[R]) {
          const int nxt_buf = next_buf(cur_buf);
          issue(nxt, nxt_buf);
          if (j + 2 < blocks)
            unstage(next_buf(nxt_buf), j + 2, blocks, chunks, off, min(128, tile.tokens - 128 * (j + 2)));
          wgmma_wait<1>();
          fence_regs(cur);
          promote(cur, cur_buf);
          named_barrier_sync(3, 256);
          cur_buf = nxt_buf;
        };
        auto last = [&](float(&cur)[R]) {
          // Both regions of the FP32 staging are free from here (the barrier closing step B-2 retired block
          // B-2 in both warpgroups): load C into them under the last block's wgmma and promotion.
          if (p.tma_out && p.accumulate && tid == 0) f32_boxes(tile, next_buf(cur_buf), true);
          wgmma_wait<0>();
          fence_regs(cur);
          promote(cur, cur_buf);
        };
        two_fragment_pipeline(blocks, part0, part1, step, last);
        buf = next_buf(cur_buf);
      }

      // Epilogue, straight from registers; each warp access covers whole 32-byte sectors (4 lanes x 8 B per
      // row). When accumulating, every load of C is issued before the first store: loads and stores may
      // alias as far as the compiler knows, so interleaving them serialises 32 global round trips per tile
      // (~30k cycles: the first version spent most of its time there whenever groups were small).
      const int n_a = tile.n_block * Cfg::BLOCK_M + 64 * mwg + r0;
      const size_t group_base = static_cast<size_t>(tile.group) * p.n * p.k;
      // Element offset of fragment pair (j, h) in D, or -1 past the edge of a partial tile.
      auto offset = [&](int j, int h) -> long long {
        const int col = tile.k_block * Cfg::BLOCK_N + 8 * j + 2 * (lane % 4), row = n_a + 8 * h;
        return col < p.k && row < p.n ? static_cast<long long>(group_base + static_cast<size_t>(row) * p.k + col) : -1;
      };
      float* d32 = static_cast<float*>(p.d);
      if (p.tma_out && p.out_bf16 && blocks > 0) {
        // BF16 through shared memory: each warpgroup writes its 64 rows into the 128B-swizzled staging tile
        // (two 64-column halves) and its leader stores them with TMA, which writes whole lines and clips the
        // N / K edges; only the leader's warp waits, and only until TMA has read the tile. Register stores
        // cost the kernel ~30% of its stall samples on small groups (ncu: long-scoreboard waits on the
        // per-element address arithmetic).
        // Staged in the buffer before the last block's (block B-2's, or the previous tile's last): both
        // warpgroups retired it before a barrier this warpgroup has passed, whereas the other warpgroup may
        // still run wgmma on the last block's B tile. A later tile refills it (its second block, or a first
        // block if the next tile has only one), always after a 256-thread barrier 3 that follows the
        // leaders' wait below.
        uint8_t* stage = tiles_of(next_buf(buf));
        stage_bf16_fragment<Cfg::BLOCK_M * 128>(stage, acc, 64 * mwg + r0, lane);
        fence_proxy_async_smem();
        named_barrier_sync(1 + mwg, 128);
        if (tid == 0) {
          const int n0 = tile.n_block * Cfg::BLOCK_M + 64 * mwg, k0 = tile.k_block * Cfg::BLOCK_N;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (k0 + 64 * h < p.k && n0 < p.n)  // a box wholly past the edge is not issued
              tma_store_3d(&p.d_tma, stage + h * (Cfg::BLOCK_M * 128) + 64 * mwg * 128, k0 + 64 * h, n0, tile.group);
          tma_store_commit();
          tma_store_wait_read<0>();  // before this thread reaches the next barrier 3
        }
      } else if (p.tma_out && blocks > 0) {  // FP32
        // FP32 through shared memory: out = acc, or C + acc with C loaded by TMA in the last block's shadow;
        // the same __fadd_rn(c, acc) per element as the register path, so the same bits.
        const bool rows = tile.n_block * Cfg::BLOCK_M + 64 * mwg < p.n;  // else this half is past N: nothing
        if (p.accumulate && rows) mbar_wait(&c_bar[mwg], *c_phase);
#pragma unroll
        for (int j = 0; j < R / 4; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float2* slot = f32_pair(buf, r0 + 8 * h, 8 * j + 2 * (lane % 4));
            float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            if (p.accumulate) {
              const float2 c = *slot;
              v = make_float2(__fadd_rn(c.x, v.x), __fadd_rn(c.y, v.y));
            }
            *slot = v;
          }
        fence_proxy_async_smem();
        named_barrier_sync(1 + mwg, 128);
        if (tid == 0) {  // every thread has read the parity (before the barrier above): move it on
          if (p.accumulate && rows) *c_phase ^= 1u;
          f32_boxes(tile, buf, false);
          tma_store_commit();
          tma_store_wait_read<0>();
        }
        // The next tile's first realignment, by this warpgroup's own threads, overwrites the second region.
        named_barrier_sync(1 + mwg, 128);
      } else if (p.out_bf16) {
#pragma unroll
        for (int j = 0; j < R / 4; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (const long long idx = offset(j, h); idx >= 0)
              *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.d) + idx) =
                  __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      } else if (p.accumulate) {
        float2 c[R / 2];
#pragma unroll
        for (int j = 0; j < R / 4; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const long long idx = offset(j, h);
            c[2 * j + h] = idx >= 0 ? __ldcg(reinterpret_cast<const float2*>(d32 + idx)) : make_float2(0.f, 0.f);
          }
#pragma unroll
        for (int j = 0; j < R / 4; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (const long long idx = offset(j, h); idx >= 0)
              *reinterpret_cast<float2*>(d32 + idx) = make_float2(__fadd_rn(c[2 * j + h].x, acc[4 * j + 2 * h]),
                                                                  __fadd_rn(c[2 * j + h].y, acc[4 * j + 2 * h + 1]));
      } else {
#pragma unroll
        for (int j = 0; j < R / 4; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (const long long idx = offset(j, h); idx >= 0)
              *reinterpret_cast<float2*>(d32 + idx) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
    }
    if (p.tma_out && tid == 0) tma_store_wait_all();
  }
}

}  // namespace megatron_tma
