// quantize_grouped_128x1_kernel: wgrad operands x [M, K] -> qt [K, P], each group's tokens transposed
// from a 128-aligned column, one scale per column per 128-token block of each group; optionally also the 1x128
// q and scales of the same x in the same pass.
// Shared tile scheme, input types and vector helpers: common/quant_tile.cuh. Host launcher:
// csrc/instantiations/quantize.cu.
#pragma once
#include "megatron_tma/common/quant_tile.cuh"

namespace megatron_tma {
namespace quant {

// ================================================================================================
// Per-group 128x1 token blocks: wgrad operands
// ================================================================================================
// Layout (docs/design.md §4): qt is [k, ld], ld = round_up(m, 128) + 128 G. Group g's tokens sit at columns
// [a_g, a_g + M_g), a_g = sum_{h<g} round_up(M_h, 128); every other column is zero (the GEMM reads a group's
// partial last block whole and relies on it).
//
// Work is cut into slots, mb_max + 1 per column block, each owning a run of whole 16-byte chunks of every qt
// row. Slot b below the used token blocks is token block b (block j of group g: x rows off_g + 128 j.., qt
// columns a_g + 128 j..) and owns 128 columns, so a group's last block also owns the zero gap up to the next
// group's start (its tile holds zeros there). The slots past the used blocks own the tail
// [a_G, ld) in 128-column pieces, the last one (index mb_max, which has no scale row) all that is left.
// Together the slots of a column block cover every qt row [0, ld) once, in order, and every slot starts
// 16-byte aligned: the stores are whole chunks, never shifted or split into bytes.
#ifndef MEGATRON_TMA_QUANT_GROUPED_CTAS  // experiments only (lab/ab_quant.sh): resident CTAs per SM
#define MEGATRON_TMA_QUANT_GROUPED_CTAS 3
#endif
constexpr int kGroupedCtasPerSm = MEGATRON_TMA_QUANT_GROUPED_CTAS;  // 3: as k128x128CtasPerSm (80 registers)
constexpr int kGroupedMaxGroups = 8192;
constexpr int kGroupedMaxRun = 8;     // slots per work unit, at most (host heuristic)

// Three int arrays of G+1 in shared memory (96 KB at the limit): row offsets, column offsets a_g, token-block
// offsets.
__host__ __device__ constexpr int grouped_dynamic_smem(int num_groups) { return 3 * (num_groups + 1) * 4; }

struct QuantizeGroupedParams {
  const void* x;  // [m, k] 16-bit, row-major, 16-byte aligned
  uint8_t* qt;    // e4m3 [k, ld], 16-byte aligned; every byte is written
  float* s;       // [mb_max, k]: the scale of column c over token block b at s[b * k + c]
  GroupsArg groups;
  int m, k;       // k multiple of 16
  int ld;         // round_up(m, 128) + 128 G (the host checks that it fits an int)
  int mb_max;     // m / 128 + G: rows of s; rows past the used blocks are written as 0
  int run;        // slots per work unit (>= 1): a CTA quantizes slots b..b+run-1 of one column block
  // The fused 1x128 outputs (kAlso1x128 only), as in Quantize1x128Params.
  uint8_t* q;     // e4m3 [m, k]
  float* s1;      // storage [ceil(k/128), s1_ld], entries m..s1_ld-1 written as 1.0
  int s1_ld;
  // kGather only: x is [src_rows, k] and row r of the quantized matrix is x row rows[r] (int32 [m]). An index
  // outside [0, src_rows) is clamped into it: a bad index reads a wrong row, never memory outside x.
  const int* rows;
  int src_rows;
};

struct Slot {
  int row0;    // first x row of the token block
  int rows;    // its tokens, 1..128; 0 for the tail slots (zeros only)
  int col;     // first qt column, a multiple of 128
  int chunks;  // 16-byte chunks of each qt row it owns, 0..8
};

// Work unit u -> column block kb and its first slot b0: units are runs of `run` consecutive slots of one column
// block, slots fastest. Consecutive slots own consecutive qt columns, so one CTA can finish the 128-byte lines
// that straddle two slots of its run (see store_slot); and the CTAs resident at any time write long runs of
// the same qt rows rather than ~1 KB pieces of thousands of rows.
struct GroupedUnits {
  uint32_t runs_per_col, run, slots;
  __device__ __forceinline__ void coords(uint32_t u, int& kb, int& b0, int& len) const {
    const uint32_t q = u / runs_per_col;
    kb = static_cast<int>(q);
    b0 = static_cast<int>((u - q * runs_per_col) * run);
    len = static_cast<int>(min(run, slots - static_cast<uint32_t>(b0)));
  }
};

// Slot b: group g owns token blocks [blk[g], blk[g+1]). `group` is the group of the previous lookup: the blocks
// of a run mostly stay in it, so it is checked first; the search otherwise keeps blk[lo] <= b < blk[hi], which
// skips empty groups. The last slot's piece of the tail is at most 128 columns: with U = mb_max - blk[G] tail
// slots before it, col[G] = 128 blk[G] and ld - col[G] - 128 U = round_up(m, 128) - 128 (m / 128) <= 128.
__device__ __forceinline__ Slot find_slot(const int* off, const int* col, const int* blk, int num_groups, int ld,
                                          int mb_max, int b, int& group) {
  const int used = blk[num_groups];
  if (b >= used) {
    const int64_t c0 = min(int64_t(ld), col[num_groups] + int64_t(kBlock) * (b - used));
    const int64_t c1 = b == mb_max ? int64_t(ld) : min(int64_t(ld), c0 + kBlock);
    return {0, 0, static_cast<int>(c0), static_cast<int>(c1 - c0) >> 4};
  }
  int lo = group;
  if (b < blk[lo] || b >= blk[lo + 1]) {
    lo = 0;
    int hi = num_groups;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (blk[mid] <= b) lo = mid; else hi = mid;
    }
    group = lo;
  }
  const int j = b - blk[lo];
  const int row0 = off[lo] + kBlock * j;
  const int rows = min(kBlock, off[lo + 1] - row0);
  return {row0, rows, col[lo] + kBlock * j, kBlock / 16};  // the whole block: tokens, then the gap's zeros
}

// The store phase of one slot: its chunks [col, col + 16 chunks) of tile rows [0, kvalid) to qt rows
// qt_rows + t * ld.
// Whole lines: a write that covers part of a 128-byte line costs more than one that covers it whole (the
// allocations are compressible memory, where a partial write is a read-modify-write; benchmarks/NOTES.md,
// quantization), and a slot's chunks straddle two lines of a row unless it starts on one. So each row's
// unfinished line waits in shared memory ("pending": chunk positions [lo, s) of it, collected from the run's
// earlier slots) until a slot of the same run completes it; inside a run every store is a whole line, only a
// run's first and last line are shared with the neighbouring runs. Row r's line grid starts at chunk
// (qt / 16 + r * ld / 16) mod 8 (ld is a multiple of 16, of 128 only for some shapes), so where a slot sits
// in its lines is worked out per row.
// Lane p % 8 of four rows per step takes chunk position p of line A (the line holding the slot's first
// chunk: positions [s, min(e, 8)) are the slot's, [lo, s) pending) and of line B (positions [0, e - 8)).
// `run_col`: the first column of the run's first slot (its line-A position is the run's lo; later lines have
// lo = 0). `keep`: the next slot continues the run, so an unfinished line waits; else it is stored as far as
// it goes. `zero`: a tail slot, whose chunks are zeros (the tile is not read).
// Every (row, position) belongs to one fixed thread, which alone reads and writes its pending chunk: no
// barrier is needed between slots. A warp step reads 4 rows, 8 distinct chunks each (a rotation of the tile
// row, or pending's same-row chunks: a row that mixes the two may put two chunks on one bank group), and
// stores 4 lines.
__device__ __forceinline__ void store_slot(uint8_t* stage, uint8_t* qt_rows, int64_t ld, int kvalid, int col,
                                           int chunks, int run_col, bool zero, bool keep) {
  constexpr int kRowsPerWarp = kBlock / kWarps;  // 16
  static_assert(kRowsPerWarp % 4 == 0, "four rows per warp step");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, p = lane & 7;
  const uint32_t phase0 = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(qt_rows) >> 4);
  const uint32_t ld16 = static_cast<uint32_t>(ld >> 4);
  const uint4 zero16 = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int step = 0; step < kRowsPerWarp / 4; ++step) {
    const int t = kRowsPerWarp * warp + 4 * step + (lane >> 3);
    if (t >= kvalid) break;  // kvalid is a multiple of 16: whole warps
    const int phase = static_cast<int>((phase0 + static_cast<uint32_t>(t) * ld16) & 7u);
    const int pos = phase + (col >> 4), run_pos = phase + (run_col >> 4);  // chunks on the row's line grid
    const int s = pos & 7, e = s + chunks;  // e <= 15
    const int lo = (run_pos >> 3) == (pos >> 3) ? (run_pos & 7) : 0;
    uint8_t* line = qt_rows + t * ld + (col - 16 * s);  // line A
    const int pend = TransposedTile::kBytes + 16 * (8 * t + p);
    uint4 va = *reinterpret_cast<const uint4*>(
        stage + (p < s || zero ? pend : TransposedTile::offset(t, (p - s) & 7)));
    if (zero && p >= s) va = zero16;
    if (p >= lo && p < e) {
      if (e >= 8 || !keep) store16(line + 16 * p, va);
      else if (p >= s) *reinterpret_cast<uint4*>(stage + pend) = va;
    }
    if (p < e - 8) {  // only positions p < s: their pending chunk was read above
      const uint4 vb = zero ? zero16 : TransposedTile::read(stage, t, 8 - s + p);
      if (keep) *reinterpret_cast<uint4*>(stage + pend) = vb;
      else store16(line + 128 + 16 * p, vb);
    }
  }
}

// The 1x128 half of the fused kernel for one tile: every row of a token block lies in exactly one tile per
// column block, so the tile's rows x 128 columns are exactly the 1x128 blocks of those rows. Row amax
// over the 16 lanes that share the row group. Each scale costs two correctly rounded divisions (~20
// instructions), so a row's scale is derived once per 8 lanes rather than by all 16: lane kc works out row
// kc % 8 and the row group's lanes take the 8 multipliers by shuffle; lane kc == j < 8 stores row j's scale.
template <class In, bool kPow2>
__device__ __forceinline__ void quantize_rows_1x128(const uint4 (&v)[8], const SubTile& sub, const QuantizeGroupedParams& p,
                                                    int row0, int rows, int k0) {
  uint32_t amax[4];  // rows 2i (low half) and 2i+1 (high half)
#pragma unroll
  for (int i = 0; i < 4; ++i) amax[i] = amax8(v[2 * i]) | (amax8(v[2 * i + 1]) << 16);
#pragma unroll
  for (int off = 8; off > 0; off >>= 1)
#pragma unroll
    for (int i = 0; i < 4; ++i) amax[i] = max2(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], off));
  const int local0 = 8 * sub.rg;
  const int own = sub.kc & 7;  // the row whose scale this lane derives; selects, not a runtime array index
  const uint32_t w01 = (own & 2) ? amax[1] : amax[0], w23 = (own & 2) ? amax[3] : amax[2];
  const fp8::BlockScale bs = fp8::block_scale<kPow2>(In::widen_abs((((own & 4) ? w23 : w01) >> (16 * (own & 1))) & 0xffffu));
  if (sub.kc < 8 && local0 + own < rows) p.s1[int64_t(k0 / kBlock) * p.s1_ld + row0 + local0 + own] = bs.scale;
  const int lane_base = threadIdx.x & 16;  // the row group's first lane: kc = 0
  uint2 qrow[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) qrow[j] = quantize8<In>(v[j], __shfl_sync(0xffffffffu, bs.mul, lane_base | j));
  const int odd = sub.kc & 1;
  const int col = k0 + 8 * (sub.kc & ~1);
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const uint4 out = pair_exchange(qrow[j], qrow[j + 1], odd);
    const int local = local0 + j + odd;
    if (local < rows && col < p.k) store16(p.q + int64_t(row0 + local) * p.k + col, out);
  }
}

template <class In, bool kPow2, bool kAlso1x128, bool kGather = false>
__global__ void __launch_bounds__(kThreads, kGroupedCtasPerSm) quantize_grouped_128x1_kernel(const QuantizeGroupedParams p) {
  extern __shared__ int smem_groups[];  // off[G+1] (x rows), col[G+1] (qt columns a_g), blk[G+1] (token blocks)
  // The transposed tile, then the pending line chunks [kBlock][8] of store_slot: one array, so that picking a
  // chunk's source is an offset select feeding one load.
  __shared__ __align__(16) uint8_t stage[2 * TransposedTile::kBytes];
  __shared__ uint4 col_amax[kWarps][16];     // per warp: 16-bit |x| maxima of the 128 columns, packed
  __shared__ __align__(16) float col_mul[kBlock];
  __shared__ long long scan_scratch[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SubTile sub;
  const int G = p.groups.num_groups;
  int* off = smem_groups;
  int* col = smem_groups + G + 1;
  int* blk = smem_groups + 2 * (G + 1);

  // Group row offsets (clamped to m: malformed sizes cannot address rows past x), then from the clamped sizes
  // the column offsets a_g and the token-block offsets (their totals never exceed ld and m/128 + G).
  const GroupsArg groups = p.groups;
  block_exclusive_scan(G, [groups](int g) { return groups_size(groups, g); }, off, p.m,
                       reinterpret_cast<int*>(scan_scratch));
  block_exclusive_scan(G, [off](int g) { return (off[g + 1] - off[g] + kBlock - 1) / kBlock * kBlock; }, col, p.ld,
                       reinterpret_cast<int*>(scan_scratch));
  block_exclusive_scan(G, [off](int g) { return (off[g + 1] - off[g] + kBlock - 1) / kBlock; }, blk, p.mb_max,
                       reinterpret_cast<int*>(scan_scratch));

  const int kbs = (p.k + kBlock - 1) / kBlock;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);

  // Rows past a token block (or all of a tail slot's) load as zeros: no memory access.
  auto load = [&](int kb, const Slot& sl, uint4(&v)[8]) {
    const int c = kb * kBlock + 8 * sub.kc;
    if constexpr (kGather) {
      // The 16 lanes of a row group read the same 8 indices (one broadcast load each), all issued before the
      // data loads that depend on them.
      const int r0 = sl.row0 + 8 * sub.rg, left = sl.rows - 8 * sub.rg;
      int src[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) src[j] = j < left ? min(max(__ldg(p.rows + r0 + j), 0), p.src_rows - 1) : 0;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        v[j] = (c < p.k && j < left) ? load_stream(x + int64_t(src[j]) * p.k + c) : make_uint4(0u, 0u, 0u, 0u);
    } else {
      load_subtile(v, x + int64_t(sl.row0 + 8 * sub.rg) * p.k + c, p.k, sl.rows - 8 * sub.rg, c < p.k);
    }
  };
  const int slots = p.mb_max + 1;
  const GroupedUnits units{static_cast<uint32_t>((slots + p.run - 1) / p.run), static_cast<uint32_t>(p.run),
                           static_cast<uint32_t>(slots)};
  const uint32_t num_units = units.runs_per_col * static_cast<uint32_t>(kbs);

  // This CTA's slots: b0..b0+len-1 of unit u in order, then unit u + gridDim.x.
  struct Cursor {
    uint32_t u;
    int kb, b0, len, j;
  };
  Cursor cur{blockIdx.x, 0, 0, 0, 0};
  if (cur.u >= num_units) return;
  units.coords(cur.u, cur.kb, cur.b0, cur.len);
  const auto advance = [&](Cursor c) {
    if (++c.j == c.len) {
      c.u += gridDim.x;
      c.j = 0;
      if (c.u < num_units) units.coords(c.u, c.kb, c.b0, c.len);
    }
    return c;
  };

  uint4 v[8];
  int group = 0;
  Slot next = find_slot(off, col, blk, G, p.ld, p.mb_max, cur.b0, group);
  load(cur.kb, next, v);
  int run_col = 0;
  while (cur.u < num_units) {
    const Slot sl = next;
    const int b = cur.b0 + cur.j, k0 = cur.kb * kBlock;
    const int kvalid = min(kBlock, p.k - k0);
    if (cur.j == 0) run_col = sl.col;
    const Cursor nxt = advance(cur);

    // A tail slot has no tile: it skips the barriers too (the tile and col_amax / col_mul are next touched
    // after the next token block's first barrier, which every thread reaches only after this store phase).
    if (sl.rows > 0) {
      // Column amax: over the thread's 8 rows, the warp's two row groups (shuffle), then the 8 warps.
      uint4 a = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        a.x = max2(a.x, abs2(v[j].x));
        a.y = max2(a.y, abs2(v[j].y));
        a.z = max2(a.z, abs2(v[j].z));
        a.w = max2(a.w, abs2(v[j].w));
      }
      a.x = max2(a.x, __shfl_xor_sync(0xffffffffu, a.x, 16));
      a.y = max2(a.y, __shfl_xor_sync(0xffffffffu, a.y, 16));
      a.z = max2(a.z, __shfl_xor_sync(0xffffffffu, a.z, 16));
      a.w = max2(a.w, __shfl_xor_sync(0xffffffffu, a.w, 16));
      if (lane < 16) col_amax[warp][lane] = a;
      __syncthreads();  // also: the previous tile's store phase is over (the tile and col_mul are free)

      if (threadIdx.x < kBlock) {
        const int c = threadIdx.x;
        const uint32_t* words = reinterpret_cast<const uint32_t*>(&col_amax[0][c >> 3]) + ((c & 7) >> 1);
        uint32_t a16 = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) a16 = max(a16, (words[w * 16 * 4] >> (16 * (c & 1))) & 0xffffu);
        const fp8::BlockScale bs = fp8::block_scale<kPow2>(In::widen_abs(a16));
        col_mul[c] = bs.mul;
        if (c < kvalid) p.s[int64_t(b) * p.k + k0 + c] = bs.scale;
      }
      __syncthreads();

      // Quantize straight into the transposed byte order: cols[i] = column 8kc+i over the 8 rows. Rows past
      // the block are masked to zero bytes: they are the gap before the next group (a NaN block's multiplier
      // would turn their zeros into NaN).
      const int valid = sl.rows - 8 * sub.rg;
      const uint32_t mask_lo = valid >= 4 ? ~0u : valid <= 0 ? 0u : (1u << (8 * valid)) - 1u;
      const uint32_t mask_hi = valid >= 8 ? ~0u : valid <= 4 ? 0u : (1u << (8 * (valid - 4))) - 1u;
      const float4 m0 = *reinterpret_cast<const float4*>(&col_mul[8 * sub.kc]);
      const float4 m1 = *reinterpret_cast<const float4*>(&col_mul[8 * sub.kc + 4]);
      const float mul[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
      uint2 cols[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float f[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t word = reinterpret_cast<const uint32_t*>(&v[j])[i >> 1];  // constant after unrolling
          f[j] = (i & 1) ? In::hi(word) : In::lo(word);
        }
        cols[i] = make_uint2(fp8::quantize4(f[0], f[1], f[2], f[3], mul[i]) & mask_lo,
                             fp8::quantize4(f[4], f[5], f[6], f[7], mul[i]) & mask_hi);
      }
      TransposedTile::write(stage, sub, cols);
      if constexpr (kAlso1x128) quantize_rows_1x128<In, kPow2>(v, sub, p, sl.row0, sl.rows, k0);
    } else if (b < p.mb_max && static_cast<int>(threadIdx.x) < kvalid) {
      p.s[int64_t(b) * p.k + k0 + threadIdx.x] = 0.0f;  // scale rows past the used blocks
    }
    // v and the quantized bytes are dead: prefetch the next slot, whose latency the stores hide.
    if (nxt.u < num_units) {
      next = find_slot(off, col, blk, G, p.ld, p.mb_max, nxt.b0 + nxt.j, group);
      load(nxt.kb, next, v);
    }
    if (sl.rows > 0) __syncthreads();  // the tile is complete

    store_slot(stage, p.qt + int64_t(k0) * p.ld, p.ld, kvalid, sl.col, sl.chunks, run_col, sl.rows == 0,
               nxt.u == cur.u);
    // The 1x128 scale padding (entries m..s1_ld-1) belongs to no token block: the last slot of each column
    // block writes it.
    if constexpr (kAlso1x128)
      if (b == p.mb_max && p.m + static_cast<int>(threadIdx.x) < p.s1_ld)
        p.s1[int64_t(k0 / kBlock) * p.s1_ld + p.m + threadIdx.x] = 1.0f;
    cur = nxt;
  }
}

}  // namespace quant
}  // namespace megatron_tma
