// Block FP8 quantizers (docs/design.md §3, byte layouts in docs/layouts.md). All three are memory-bound
// streams: 16-byte loads with several in flight per thread, 16-byte coalesced stores, the amax reduced
// with warp shuffles / shared memory, and the scale formula of common/fp8.cuh. Inputs are 16-bit
// (bf16 or fp16, `In` below), row-major with 16-byte aligned rows (K % 16 == 0).
//
//  quantize_1x128_kernel          x [M, K] -> q [M, K], one scale per row per 128 columns.
//  quantize_128x128_kernel        w [G, N, K] -> q [G, N, K] and qt = q^T [G, K, N] in one pass, one
//                                 scale per 128x128 block (s and its transpose st).
//  quantize_grouped_128x1_kernel  x [M, K] -> qt [K, P], each group's tokens transposed from a 16-aligned
//                                 column, one scale per column per 128-token block of each group (blocks
//                                 start at a group's first row);
//                                 optionally also the 1x128 q and scales of the same x in the same pass
//                                 (a backward quantizes dY once for dgrad and wgrad).
//
// The two transposing kernels share one tile scheme: a CTA of 256 threads owns a 128 x 128 tile, each
// thread an 8 x 8 sub-tile (rows 8*rg..8*rg+7, columns 8*kc..8*kc+7 with kc = lane % 16,
// rg = 2 * warp + lane / 16), loaded as eight 16-byte row pieces: a warp reads two 256-byte row segments
// per load instruction. The quantized bytes go to a transposed shared-memory tile (see TransposedTile)
// from which whole output rows are stored with 16-byte vectors. Both kernels are persistent over tiles
// and load the next tile into the (then dead) input registers before storing the current one, so the
// store phase overlaps the next tile's DRAM latency. The grouped kernel's token blocks start on 16-byte
// chunks of the qt rows but rarely on 128-byte lines; a CTA walks runs of consecutive blocks so that it can
// store the lines straddling two blocks whole (store_slot).
#pragma once
#include <cstdint>

#include <cuda_fp16.h>

#include "megatron_tma/common/fp8.cuh"
#include "megatron_tma/common/groups.cuh"

namespace megatron_tma {
namespace quant {

constexpr int kThreads = 256;  // a multiple of 32 (block_exclusive_scan); the tile scheme assumes 256
constexpr int kWarps = kThreads / 32;
constexpr int kBlock = 128;     // quantization block edge

// ------------------------------------------------------------------------------------------------
// Input formats: two 16-bit elements per 32-bit word (element 0 in the low half).
// ------------------------------------------------------------------------------------------------
struct Bf16In {
  static __device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
  // 16-bit pattern of |x| -> FP32 bit pattern of |x| (exact; NaN stays NaN)
  static __device__ __forceinline__ uint32_t widen_abs(uint32_t h) { return h << 16; }
};

struct Fp16In {
  static __device__ __forceinline__ float lo(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  }
  static __device__ __forceinline__ float hi(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ uint32_t widen_abs(uint32_t h) { return __float_as_uint(lo(h)); }
};

// |x| of both halves as ordered unsigned patterns (see fp8.cuh), and their per-half maximum.
__device__ __forceinline__ uint32_t abs2(uint32_t w) { return w & 0x7fff7fffu; }
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }

// 16-bit |x| pattern of the largest of the 8 elements of a 16-byte vector.
__device__ __forceinline__ uint32_t amax8(const uint4& v) {
  const uint32_t m = max2(max2(abs2(v.x), abs2(v.y)), max2(abs2(v.z), abs2(v.w)));
  return max(m & 0xffffu, m >> 16);
}

// Quantize the 8 elements of a 16-byte vector with one multiplier: 8 bytes, element 0 lowest.
template <class In>
__device__ __forceinline__ uint2 quantize8(const uint4& v, float mul) {
  return make_uint2(fp8::quantize4(In::lo(v.x), In::hi(v.x), In::lo(v.y), In::hi(v.y), mul),
                    fp8::quantize4(In::lo(v.z), In::hi(v.z), In::lo(v.w), In::hi(v.w), mul));
}

// ------------------------------------------------------------------------------------------------
// Memory helpers
// ------------------------------------------------------------------------------------------------
// The input is read exactly once: bypass L1 and let L2 fetch whole 256-byte lines.
__device__ __forceinline__ uint4 load_stream(const void* ptr) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

__device__ __forceinline__ void store16(void* ptr, const uint4& v) { *reinterpret_cast<uint4*>(ptr) = v; }

__device__ __forceinline__ uint2 shfl_xor2(const uint2& v, int mask) {
  return make_uint2(__shfl_xor_sync(0xffffffffu, v.x, mask), __shfl_xor_sync(0xffffffffu, v.y, mask));
}

// Two lanes (even, odd) hold the 8-byte halves (lo, hi) of two 16-byte output chunks A and B: even
// holds A.lo and B.lo, odd holds A.hi and B.hi. One exchange gives even all of A and odd all of B, so
// each stores 16 bytes. The choice between a thread's own values is a byte permute rather than `?:` on
// the array elements, which the compiler would turn into a dynamic (local-memory) index.
__device__ __forceinline__ uint4 pair_exchange(const uint2& a, const uint2& b, bool odd) {
  const uint32_t sel = odd ? 0x7654u : 0x3210u;  // __byte_perm(x, y, sel) == (odd ? y : x)
  const uint2 other = shfl_xor2(make_uint2(__byte_perm(b.x, a.x, sel), __byte_perm(b.y, a.y, sel)), 1);
  return make_uint4(__byte_perm(a.x, other.x, sel), __byte_perm(a.y, other.y, sel),
                    __byte_perm(other.x, b.x, sel), __byte_perm(other.y, b.y, sel));
}

// ------------------------------------------------------------------------------------------------
// Thread sub-tiles and the transposed shared-memory tile
// ------------------------------------------------------------------------------------------------
// A 4x4 byte transpose: word r holds row r (byte c = column c); out word c holds column c.
__device__ __forceinline__ void transpose4x4(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3, uint32_t& c0,
                                             uint32_t& c1, uint32_t& c2, uint32_t& c3) {
  const uint32_t t0 = __byte_perm(r0, r1, 0x5140), t1 = __byte_perm(r0, r1, 0x7362);
  const uint32_t t2 = __byte_perm(r2, r3, 0x5140), t3 = __byte_perm(r2, r3, 0x7362);
  c0 = __byte_perm(t0, t2, 0x5410);
  c1 = __byte_perm(t0, t2, 0x7632);
  c2 = __byte_perm(t1, t3, 0x5410);
  c3 = __byte_perm(t1, t3, 0x7632);
}

// rows[j] = 8 bytes of row j (x: columns 0-3, y: 4-7) -> cols[i] = 8 bytes of column i (x: rows 0-3).
__device__ __forceinline__ void transpose8x8(const uint2 (&rows)[8], uint2 (&cols)[8]) {
  transpose4x4(rows[0].x, rows[1].x, rows[2].x, rows[3].x, cols[0].x, cols[1].x, cols[2].x, cols[3].x);
  transpose4x4(rows[4].x, rows[5].x, rows[6].x, rows[7].x, cols[0].y, cols[1].y, cols[2].y, cols[3].y);
  transpose4x4(rows[0].y, rows[1].y, rows[2].y, rows[3].y, cols[4].x, cols[5].x, cols[6].x, cols[7].x);
  transpose4x4(rows[4].y, rows[5].y, rows[6].y, rows[7].y, cols[4].y, cols[5].y, cols[6].y, cols[7].y);
}

struct SubTile {
  int kc, rg;  // column group (8 columns) and row group (8 rows) of this thread in the 128x128 tile
  __device__ __forceinline__ SubTile() : kc(threadIdx.x & 15), rg(threadIdx.x >> 4) {}
};

// Loads the thread's 8 row pieces: row j at src + j * ld (16-bit elements); rows >= rows_left and a
// column group past the matrix read as zeros, which leave every amax unchanged.
__device__ __forceinline__ void load_subtile(uint4 (&v)[8], const uint16_t* src, int64_t ld, int rows_left,
                                             bool col_ok) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
    v[j] = (col_ok && j < rows_left) ? load_stream(src + j * ld) : make_uint4(0u, 0u, 0u, 0u);
}

// Shared-memory tile holding the transpose of a 128x128 byte tile: row t (a column of the source
// tile) is 128 bytes = 8 chunks of 16 bytes, chunk c stored at position c ^ ((t / 8) % 8). A warp's
// 8-byte writes (16 column groups x 2 row groups) then hit 8 distinct chunks twice: 2 wavefronts, the
// minimum for 256 bytes; the 16-byte reads of 8 consecutive chunks of one row are conflict-free.
struct TransposedTile {
  static constexpr int kBytes = kBlock * kBlock;
  static __device__ __forceinline__ int offset(int t, int chunk) { return t * kBlock + ((chunk ^ ((t >> 3) & 7)) << 4); }

  // cols[i] = bytes of source column 8*kc + i over source rows 8*rg..8*rg+7.
  static __device__ __forceinline__ void write(uint8_t* tile, const SubTile& st, const uint2 (&cols)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      *reinterpret_cast<uint2*>(tile + offset(8 * st.kc + i, st.rg >> 1) + ((st.rg & 1) << 3)) = cols[i];
  }
  static __device__ __forceinline__ uint4 read(const uint8_t* tile, int t, int chunk) {
    return *reinterpret_cast<const uint4*>(tile + offset(t, chunk));
  }
};

// ================================================================================================
// 1x128: activations
// ================================================================================================
// A warp quantizes k1x128Span consecutive columns of one row: k1x128Loads 16-byte loads per lane, each
// covering 256 columns = two 128-column blocks, one per half-warp.
constexpr int k1x128Loads = 4;
constexpr int k1x128Span = k1x128Loads * 256;

struct Quantize1x128Params {
  const void* x;  // [m, k] 16-bit, row-major, 16-byte aligned
  uint8_t* q;     // e4m3 [m, k]
  float* s;       // storage [ceil(k/128), s_ld]: the scale of (row, kb) at s[kb * s_ld + row]
  int64_t m;
  int k;          // multiple of 16
  int s_ld;       // ceil(m/4)*4: entries m..s_ld-1 of each storage row are padding, written as 1.0
};

template <class In, bool kPow2>
__global__ void __launch_bounds__(kThreads) quantize_1x128_kernel(const Quantize1x128Params p) {
  const int lane = threadIdx.x & 31;
  const int spans = (p.k + k1x128Span - 1) / k1x128Span;
  const int64_t unit = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (unit >= p.m * spans) return;  // warp-uniform
  const int64_t row = unit / spans;
  const int col0 = static_cast<int>(unit - row * spans) * k1x128Span;
  const uint16_t* xrow = static_cast<const uint16_t*>(p.x) + row * p.k;
  uint8_t* qrow = p.q + row * p.k;

  uint4 v[k1x128Loads];
#pragma unroll
  for (int i = 0; i < k1x128Loads; ++i) {
    const int col = col0 + 256 * i + 8 * lane;
    v[i] = col < p.k ? load_stream(xrow + col) : make_uint4(0u, 0u, 0u, 0u);
  }

  // Block amax over the 16 lanes of each half-warp; two loads' 16-bit amaxes share a register, so one
  // butterfly serves both (the xor offsets < 16 never cross the half-warp).
  uint32_t amax[k1x128Loads / 2];
#pragma unroll
  for (int i = 0; i < k1x128Loads / 2; ++i) amax[i] = amax8(v[2 * i]) | (amax8(v[2 * i + 1]) << 16);
#pragma unroll
  for (int off = 8; off > 0; off >>= 1)
#pragma unroll
    for (int i = 0; i < k1x128Loads / 2; ++i) amax[i] = max2(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], off));

  uint2 qv[k1x128Loads];
#pragma unroll
  for (int i = 0; i < k1x128Loads; ++i) {
    const uint32_t a16 = (amax[i / 2] >> (16 * (i & 1))) & 0xffffu;
    const fp8::BlockScale bs = fp8::block_scale<kPow2>(In::widen_abs(a16));
    qv[i] = quantize8<In>(v[i], bs.mul);
    const int kb = (col0 + 256 * i) / kBlock + (lane >> 4);
    if ((lane & 15) == 0 && kb * kBlock < p.k) {
      float* srow = p.s + int64_t(kb) * p.s_ld;
      srow[row] = bs.scale;
      if (row == p.m - 1)
        for (int r = static_cast<int>(p.m); r < p.s_ld; ++r) srow[r] = 1.0f;
    }
  }

  // Lane 2j holds bytes 16j..16j+7 and lane 2j+1 bytes 16j+8..16j+15 of every load's 256-byte output:
  // the pair exchanges halves so that the even lane stores 16 bytes of load i, the odd lane of load i+1.
  const int odd = lane & 1;
#pragma unroll
  for (int i = 0; i < k1x128Loads; i += 2) {
    const uint4 out = pair_exchange(qv[i], qv[i + 1], odd);
    const int col = col0 + 256 * (i + odd) + 8 * (lane & ~1);
    if (col < p.k) store16(qrow + col, out);  // k % 16 == 0: the 16 bytes are all in or all out
  }
}

// ================================================================================================
// 128x128: weights, with the transposed copy
// ================================================================================================
// 3 CTAs/SM cap registers at 80 (65536 / 768, rounded down to the allocation unit; no spills) and keep
// 3 x 32 KB of loads in flight per SM, about 3x what HBM bandwidth x latency asks for.
constexpr int k128x128CtasPerSm = 3;

struct Quantize128x128Params {
  const void* w;  // [g, n, k] 16-bit, 16-byte aligned
  uint8_t* q;     // e4m3 [g, n, k]
  float* s;       // [g, ceil(n/128), ceil(k/128)]
  uint8_t* qt;    // e4m3 [g, k, n]
  float* st;      // [g, ceil(k/128), ceil(n/128)]
  int g, n, k;    // n, k multiples of 16
};

template <class In, bool kPow2>
__global__ void __launch_bounds__(kThreads, k128x128CtasPerSm) quantize_128x128_kernel(const Quantize128x128Params p) {
  __shared__ __align__(16) uint8_t tile[TransposedTile::kBytes];
  __shared__ uint32_t warp_amax[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SubTile sub;
  const int nbs = (p.n + kBlock - 1) / kBlock, kbs = (p.k + kBlock - 1) / kBlock;
  const int64_t tiles = int64_t(p.g) * nbs * kbs;
  const uint16_t* w = static_cast<const uint16_t*>(p.w);

  // Tile t = (group, nb, kb) with kb fastest: concurrent CTAs read neighbouring blocks of the same rows.
  auto load = [&](int64_t t, uint4(&v)[8]) {
    const int kb = static_cast<int>(t % kbs), nb = static_cast<int>((t / kbs) % nbs);
    const int64_t gi = t / (int64_t(kbs) * nbs);
    const int row = nb * kBlock + 8 * sub.rg, col = kb * kBlock + 8 * sub.kc;
    load_subtile(v, w + (gi * p.n + row) * p.k + col, p.k, p.n - row, col < p.k);
  };

  uint4 v[8];
  if (blockIdx.x < tiles) load(blockIdx.x, v);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int kb = static_cast<int>(t % kbs), nb = static_cast<int>((t / kbs) % nbs);
    const int64_t gi = t / (int64_t(kbs) * nbs);
    const int n0 = nb * kBlock, k0 = kb * kBlock;

    // Block amax: thread (packed halves) -> warp (redux) -> CTA (shared memory).
    uint32_t a2 = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) a2 = max2(a2, max2(max2(abs2(v[j].x), abs2(v[j].y)), max2(abs2(v[j].z), abs2(v[j].w))));
    const uint32_t a16 = __reduce_max_sync(0xffffffffu, max(a2 & 0xffffu, a2 >> 16));
    if (lane == 0) warp_amax[warp] = a16;
    __syncthreads();  // also: every thread finished reading the previous tile's transposed tile
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) amax = max(amax, warp_amax[i]);
    const fp8::BlockScale bs = fp8::block_scale<kPow2>(In::widen_abs(amax));

    uint2 rows[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) rows[j] = quantize8<In>(v[j], bs.mul);

    // q, row-major: lanes kc = 2i, 2i+1 hold the two 8-byte halves of a 16-byte row chunk; they
    // exchange so that the even lane stores row j and the odd lane row j+1 whole.
    const int odd = sub.kc & 1;
    const int col = k0 + 8 * (sub.kc & ~1);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const uint4 out = pair_exchange(rows[j], rows[j + 1], odd);
      const int row = n0 + 8 * sub.rg + j + odd;
      if (row < p.n && col < p.k) store16(p.q + (gi * p.n + row) * p.k + col, out);
    }

    uint2 cols[8];
    transpose8x8(rows, cols);
    TransposedTile::write(tile, sub, cols);
    // v and the quantized bytes are dead: prefetch the next tile, whose latency the qt stores hide.
    if (t + gridDim.x < tiles) load(t + gridDim.x, v);
    if (threadIdx.x == 0) {
      p.s[(gi * nbs + nb) * kbs + kb] = bs.scale;
      p.st[(gi * kbs + kb) * nbs + nb] = bs.scale;
    }
    __syncthreads();  // the transposed tile is complete; warp_amax may be rewritten

    // qt: 128 rows (k) x 8 chunks of 16 bytes (n); 8 consecutive threads store one 128-byte row piece.
#pragma unroll
    for (int r = 0; r < TransposedTile::kBytes / 16 / kThreads; ++r) {
      const int idx = threadIdx.x + r * kThreads;
      const int tr = idx >> 3, chunk = idx & 7;
      const int kk = k0 + tr, nn = n0 + 16 * chunk;
      if (kk < p.k && nn < p.n) store16(p.qt + (gi * p.k + kk) * p.n + nn, TransposedTile::read(tile, tr, chunk));
    }
  }
}

// ================================================================================================
// Per-group 128x1 token blocks: wgrad operands
// ================================================================================================
// Layout (docs/design.md §4): qt is [k, ld], ld = round_up(m, 16) + 16 G. Group g's tokens sit at columns
// [a_g, a_g + M_g), a_g = sum_{h<g} round_up(M_h, 16); every other column is zero.
//
// Work is cut into slots, mb_max + 1 per column block, each owning a run of whole 16-byte chunks of every qt
// row. Slot b below the used token blocks is token block b (block j of group g: x rows off_g + 128 j.., qt
// columns a_g + 128 j..) and owns round_up(rows, 16) columns, so a group's last block also owns the zero gap
// up to the next group's start (its tile holds zeros there). The slots past the used blocks own the tail
// [a_G, ld) in 128-column pieces, the last one (index mb_max, which has no scale row) all that is left.
// Together the slots of a column block cover every qt row [0, ld) once, in order, and every slot starts
// 16-byte aligned: the stores are whole chunks, never shifted or split into bytes.
constexpr int kGroupedCtasPerSm = 3;  // as k128x128CtasPerSm (80 registers, fused variant included)
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
  int ld;         // round_up(m, 16) + 16 G (the host checks that it fits an int)
  int mb_max;     // m / 128 + G: rows of s; rows past the used blocks are written as 0
  int run;        // slots per work unit (>= 1): a CTA quantizes slots b..b+run-1 of one column block
  // The fused 1x128 outputs (kAlso1x128 only), as in Quantize1x128Params.
  uint8_t* q;     // e4m3 [m, k]
  float* s1;      // storage [ceil(k/128), s1_ld], entries m..s1_ld-1 written as 1.0
  int s1_ld;
};

struct Slot {
  int row0;    // first x row of the token block
  int rows;    // its tokens, 1..128; 0 for the tail slots (zeros only)
  int col;     // first qt column, a multiple of 16
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
// slots before it, ld - col[G] - 128 U = (round_up(m, 16) - 128 (m / 128)) + sum_g (128 ceil(M_g / 128) -
// round_up(M_g, 16) - 112), where the first term is <= 128 and every summand <= 0 (M_g as clamped to m).
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
  return {row0, rows, col[lo] + kBlock * j, (rows + 15) >> 4};
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
// over the 16 lanes that share the row group; every lane derives the 8 row scales itself (no runtime
// register indexing), the lane kc == j stores row j's scale.
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
  float* srow = p.s1 + int64_t(k0 / kBlock) * p.s1_ld + row0 + local0;
  uint2 qrow[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const fp8::BlockScale bs = fp8::block_scale<kPow2>(In::widen_abs((amax[j >> 1] >> (16 * (j & 1))) & 0xffffu));
    qrow[j] = quantize8<In>(v[j], bs.mul);
    if (sub.kc == j && local0 + j < rows) srow[j] = bs.scale;
  }
  const int odd = sub.kc & 1;
  const int col = k0 + 8 * (sub.kc & ~1);
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const uint4 out = pair_exchange(qrow[j], qrow[j + 1], odd);
    const int local = local0 + j + odd;
    if (local < rows && col < p.k) store16(p.q + int64_t(row0 + local) * p.k + col, out);
  }
}

template <class In, bool kPow2, bool kAlso1x128>
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
  block_exclusive_scan(G, [off](int g) { return (off[g + 1] - off[g] + 15) & ~15; }, col, p.ld,
                       reinterpret_cast<int*>(scan_scratch));
  block_exclusive_scan(G, [off](int g) { return (off[g + 1] - off[g] + kBlock - 1) / kBlock; }, blk, p.mb_max,
                       reinterpret_cast<int*>(scan_scratch));

  const int kbs = (p.k + kBlock - 1) / kBlock;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);

  // Rows past a token block (or all of a tail slot's) load as zeros: no memory access.
  auto load = [&](int kb, const Slot& sl, uint4(&v)[8]) {
    const int c = kb * kBlock + 8 * sub.kc;
    load_subtile(v, x + int64_t(sl.row0 + 8 * sub.rg) * p.k + c, p.k, sl.rows - 8 * sub.rg, c < p.k);
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
