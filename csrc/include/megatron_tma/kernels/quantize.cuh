// Block FP8 quantizers (DESIGN.md §3, byte layouts in docs/layouts.md). All three are memory-bound
// streams: 16-byte loads with several in flight per thread, 16-byte coalesced stores, the amax reduced
// with warp shuffles / shared memory, and the scale formula of common/fp8.cuh. Inputs are 16-bit
// (bf16 or fp16, `In` below), row-major with 16-byte aligned rows (K % 16 == 0).
//
//  quantize_1x128_kernel          x [M, K] -> q [M, K], one scale per row per 128 columns.
//  quantize_128x128_kernel        w [G, N, K] -> q [G, N, K] and qt = q^T [G, K, N] in one pass, one
//                                 scale per 128x128 block (s and its transpose st).
//  quantize_grouped_128x1_kernel  x [M, K] -> qt = q^T [K, M_pitch], one scale per column per
//                                 128-token block of each group (blocks start at a group's first row);
//                                 optionally also the 1x128 q and scales of the same x in the same pass
//                                 (a backward quantizes dY once for dgrad and wgrad).
//
// The two transposing kernels share one tile idea: a CTA owns 128 x 128 tiles, each thread an 8 x 8
// sub-tile loaded as eight 16-byte row pieces (a warp reads two 256-byte row segments per load), whose
// quantized bytes go to a transposed shared-memory tile from which whole output rows are stored with
// 16-byte vectors; both are persistent over tiles. The 128x128 kernel (256 threads, rg = 2 * warp +
// lane / 16, kc = lane % 16) loads the next tile into its dead input registers before storing the
// current one. The grouped kernel, whose tiles start at arbitrary rows, has its own scheme: see its
// section below.
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

// Two lanes (even, odd: lane and lane ^ lane_mask) hold the 8-byte halves (lo, hi) of two 16-byte
// output chunks A and B: even holds A.lo and B.lo, odd holds A.hi and B.hi. One exchange gives even all
// of A and odd all of B, so each stores 16 bytes. The choice between a thread's own values is a byte
// permute rather than `?:` on the array elements, which the compiler would turn into a dynamic
// (local-memory) index.
__device__ __forceinline__ uint4 pair_exchange(const uint2& a, const uint2& b, bool odd, int lane_mask = 1) {
  const uint32_t sel = odd ? 0x7654u : 0x3210u;  // __byte_perm(x, y, sel) == (odd ? y : x)
  const uint2 other = shfl_xor2(make_uint2(__byte_perm(b.x, a.x, sel), __byte_perm(b.y, a.y, sel)), lane_mask);
  return make_uint4(__byte_perm(a.x, other.x, sel), __byte_perm(a.y, other.y, sel),
                    __byte_perm(other.x, b.x, sel), __byte_perm(other.y, b.y, sel));
}

// Bytes [lo, hi) of the 16-byte value v to dst (16-byte aligned), 0 <= lo <= hi <= 16, as naturally
// aligned 1/2/4/8-byte stores (at most 7, straight-line): pieces growing up to the first 8-byte boundary,
// then shrinking towards hi. For chunks shared with another CTA's token block or the qt pitch padding,
// whose other bytes must not be touched. The per-tile callers keep lo and hi warp-uniform (no divergence).
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint4& v, int lo, int hi) {
  if (lo == 0 && hi == 16) {
    store16(dst, v);
    return;
  }
  const uint64_t half0 = (uint64_t(v.y) << 32) | v.x, half1 = (uint64_t(v.w) << 32) | v.z;
  int pos = lo;
  auto piece = [&](int width) {  // `width` bytes at pos, pos a multiple of width
    const uint64_t bits = (pos < 8 ? half0 : half1) >> ((pos & 7) * 8);
    if (width == 8) *reinterpret_cast<uint64_t*>(dst + pos) = bits;
    if (width == 4) *reinterpret_cast<uint32_t*>(dst + pos) = static_cast<uint32_t>(bits);
    if (width == 2) *reinterpret_cast<uint16_t*>(dst + pos) = static_cast<uint16_t>(bits);
    if (width == 1) dst[pos] = static_cast<uint8_t>(bits);
    pos += width;
  };
#pragma unroll
  for (int width = 1; width <= 8; width *= 2)
    if ((pos & width) != 0 && pos + width <= hi) piece(width);
#pragma unroll
  for (int width = 8; width >= 1; width /= 2)
    if (pos + width <= hi) piece(width);
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
// A tile is one token block (<= 128 rows of one group, starting at an arbitrary row0) x 128 columns.
// The kernel is persistent (kGroupedCtasPerSm CTAs per SM; tiles t = b * kbs + kb strided over the grid,
// column block fastest, so concurrent CTAs read neighbouring pieces of the same rows) and built around
// three costs of the transposed output:
//
//  * Loads in flight. Each thread copies its own 8 row pieces of a tile with cp.async into a
//    kGroupedStages-deep shared-memory ring, kGroupedStages - 1 tiles ahead, so loads stay in flight
//    through every compute phase and barrier: 2 tiles x 32 KB per CTA, 128 KB per SM. (A register
//    prefetch, issued once the registers are free after quantizing, leaves nothing in flight meanwhile.)
//  * Group starts. Rows [row0, row0 + rows) are placed in a 144-row span starting at R0 = row0 rounded
//    down to 16, so that the transposed tile lines up with qt's 16-byte chunks: rows outside the block
//    read as zeros (the amax ignores them) and their bytes are never stored. A transposed row is then
//    whole aligned 16-byte stores, except the chunk a block shares with its neighbour at each end
//    (`store_bytes`, with bounds uniform per warp). 288 threads = 18 row groups x 16 column groups of
//    8 x 8 cover the span.
//  * Shared-memory banks. Lane mapping kc = lane / 2, row group = 2 warp + lane % 2, with the stage and
//    transposed-tile swizzles below, makes every shared-memory access conflict-free per quarter warp
//    (16-byte) / half warp (8-byte).
//
// Per tile: wait for the tile's copies; read them to registers; column amax (registers, one shuffle,
// shared memory) | barrier | issue the copies of the tile kGroupedStages - 1 ahead into the previous
// tile's stage; 128 threads turn the column amaxes into scales | barrier | quantize straight into
// transposed byte order, written over the tile's own (consumed) stage | barrier | store qt rows.
constexpr int kGroupedThreads = 288;
constexpr int kGroupedWarps = kGroupedThreads / 32;
constexpr int kGroupedRowGroups = kGroupedThreads / 16;  // 18 groups of 8 rows: the 144-row span
constexpr int kGroupedChunks = 9;                          // 16-byte chunks of a transposed row (144 bytes)
constexpr int kGroupedStages = 3;
constexpr int kGroupedCtasPerSm = 2;                       // 2 x (96 KB + 3 KB + groups) of shared memory
constexpr int kGroupedMaxGroups = 8192;                    // two int arrays of G+1 in shared memory (64 KB at the limit)
constexpr int kGroupedStageBytes = kBlock * kBlock * 2;   // <= 128 rows x 128 16-bit columns
static_assert(kGroupedRowGroups * 8 == kGroupedChunks * 16, "the row span must be whole 16-byte chunks");
static_assert(kGroupedChunks * kBlock * 16 <= kGroupedStageBytes, "the transposed tile must fit in its stage");
static_assert(kGroupedChunks * kBlock % kGroupedThreads == 0, "the store loop assumes whole rounds");

// Dynamic shared memory (the kernel has no static shared memory, so the host can tell how many CTAs
// fit from this alone): the stage ring, then small per-tile arrays, then the group offsets.
struct GroupedSmem {
  static constexpr int kColAmax = kGroupedStages * kGroupedStageBytes;  // uint4 [kGroupedWarps][16]
  static constexpr int kColMul = kColAmax + kGroupedWarps * 16 * 16;    // float [kBlock]
  static constexpr int kScan = kColMul + kBlock * 4;                    // long long [32]: scan scratch
  static constexpr int kGroups = kScan + 32 * 8;                        // int off[G+1], blk[G+1]
};
__host__ __device__ constexpr int grouped_smem_bytes(int num_groups) {
  return GroupedSmem::kGroups + 2 * (num_groups + 1) * 4;
}

// Stage: block row l at l * 256 bytes, its 16-byte piece kc at position kc ^ (4 * ((l / 8) % 2)). A
// quarter warp touches pieces 4i..4i+3 of rows l and l + 8, which the swizzle puts in opposite halves
// of the banks. StageRows gives the offsets of the thread's rows l0 + j, j = 0..7, as one of two bases
// plus j * 256: bit 3 of l0 + j flips once, where (l0 % 8) + j reaches 8 (l0 may be < 0).
struct StageRows {
  int before, after, wrap;
  __device__ __forceinline__ StageRows(int l0, int kc)
      : before(l0 * 256 + ((kc ^ ((l0 >> 1) & 4)) << 4)), after(before ^ 64), wrap(8 - (l0 & 7)) {}
  __device__ __forceinline__ int offset(int j) const { return (j >= wrap ? after : before) + j * 256; }
};

// Transposed tile (in the consumed stage): row r (column k0 + r) x 9 chunks of 16 bytes (span rows
// 16c..16c+15), chunk-major, each 8-row slab rotated: row r at position (r + c + r / 8) % 8 of its slab.
// The 8-byte writes of a half warp (rows 8kc + i of 8 consecutive kc, both halves of one chunk) and the
// 16-byte reads of the store loop (consecutive chunks of consecutive rows: the position advances by one
// either way) each cover all 32 banks once.
__device__ __forceinline__ int transposed_offset(int r, int c) {
  return (c * kBlock + (r & ~7) + ((r + c + (r >> 3)) & 7)) << 4;
}
// The writer's rows 8kc + i (i = 0..7) of chunk c: one of two bases plus 16 i (the rotation wraps once).
struct TransposedRows {
  int before, wrap;
  __device__ __forceinline__ TransposedRows(int kc, int c) {
    const int rot = (c + kc) & 7;  // position of i = 0
    before = (c * kBlock + 8 * kc + rot) << 4;
    wrap = 8 - rot;
  }
  __device__ __forceinline__ int offset(int i) const { return (i >= wrap ? before - 128 : before) + 16 * i; }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared if `pred`, asynchronous, L2 only (each byte is read once), whole 256-byte
// L2 lines. The predicate is inside the asm so that the copy is one predicated instruction, not a branch.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* src, bool pred) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "setp.ne.b32 p, %2, 0;\n\t"
      "@p cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n\t}" ::"r"(smem_addr(smem_dst)),
      "l"(src), "r"(static_cast<int>(pred))
      : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Until at most N of this thread's most recent groups are pending: its older copies are visible to it.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

struct QuantizeGroupedParams {
  const void* x;    // [m, k] 16-bit, row-major, 16-byte aligned
  uint8_t* qt;      // e4m3 storage [k, qt_ld], 16-byte aligned; columns m..qt_ld-1 are written as 0
  float* s;         // [mb_max, k]: the scale of column c over token block b at s[b * k + c]
  GroupsArg groups;
  int m, k;         // k multiple of 16
  int64_t qt_ld;    // multiple of 16, >= m
  int mb_max;       // m / 128 + G: rows of s; rows past the used blocks are written as 0
  // The fused 1x128 outputs (kAlso1x128 only), as in Quantize1x128Params.
  uint8_t* q;       // e4m3 [m, k]
  float* s1;        // storage [ceil(k/128), s1_ld], entries m..s1_ld-1 written as 1.0
  int s1_ld;
};

struct TokenBlock {
  int row0;  // first row of the block
  int rows;  // 1..128
};

// Token block b < blk[num_groups] (group g owns blocks [blk[g], blk[g+1]), block j of it starts at
// off[g] + 128 j), found by walking the group index forward from `group`, the group of a block at or
// before b: a CTA's block indices only grow, so its walks cost G + its tiles steps in all (empty groups
// are stepped over like any other).
__device__ __forceinline__ TokenBlock find_token_block(const int* off, const int* blk, int& group, int b) {
  while (blk[group + 1] <= b) ++group;
  const int row0 = off[group] + kBlock * (b - blk[group]);
  return {row0, min(kBlock, off[group + 1] - row0)};
}

// A tile in flight: token block b (its rows) x columns [k0, k0 + 128). b >= the used blocks: none.
struct GroupedTile {
  int b, k0;
  TokenBlock tb;
};

// The thread's 8 x 8 piece of the tile: rows R0 + 8 rg + j of the span (j = 0..7), columns
// k0 + 8 kc .. +7; block row l = 8 rg + j - a (a = row0 % 16) exists for 0 <= l < rows.
struct GroupedThread {
  int lane, warp, kc, rg;
  __device__ __forceinline__ GroupedThread()
      : lane(threadIdx.x & 31), warp(threadIdx.x >> 5), kc(lane >> 1), rg(2 * warp + (lane & 1)) {}
  __device__ __forceinline__ int first_block_row(const TokenBlock& tb) const { return 8 * rg - (tb.row0 & 15); }
};
// 0 <= l < rows as one unsigned compare (l < 0 wraps to a huge value).
__device__ __forceinline__ bool in_block(int l, int rows) { return static_cast<unsigned>(l) < static_cast<unsigned>(rows); }

// Copies the thread's pieces of tile `tile` into `stage` (one commit group, empty past the last tile).
__device__ __forceinline__ void issue_tile_copies(const GroupedTile& tile, int used, const GroupedThread& th,
                                                  const QuantizeGroupedParams& p, uint8_t* stage) {
  const int col = tile.k0 + 8 * th.kc;
  if (tile.b < used && col < p.k) {
    const int l0 = th.first_block_row(tile.tb);
    const uint16_t* src = static_cast<const uint16_t*>(p.x) + int64_t(tile.tb.row0 + l0) * p.k + col;
    const StageRows rows(l0, th.kc);
#pragma unroll
    for (int j = 0; j < 8; ++j, src += p.k)
      cp_async_16(stage + rows.offset(j), src, in_block(l0 + j, tile.tb.rows));
  }
  cp_async_commit();
}

// The 1x128 half of the fused kernel: every row of a token block lies in exactly one tile per column
// block, so the tile's block rows x 128 columns are exactly the 1x128 blocks of those rows. Row amax
// over the 16 lanes of equal parity (one row group); lane kc computes the scale of row kc % 8 (two
// divisions per lane rather than sixteen) and shares its multiplier by shuffle; lanes kc < 8 store the
// scales. Rows outside the block (zeros) are neither stored nor given a scale.
template <class In, bool kPow2>
__device__ __forceinline__ void quantize_rows_1x128(const uint4 (&v)[8], const GroupedThread& th,
                                                    const QuantizeGroupedParams& p, const GroupedTile& tile) {
  uint32_t amax[4];  // rows 2i (low half) and 2i+1 (high half)
#pragma unroll
  for (int i = 0; i < 4; ++i) amax[i] = amax8(v[2 * i]) | (amax8(v[2 * i + 1]) << 16);
#pragma unroll
  for (int off = 2; off < 32; off <<= 1)
#pragma unroll
    for (int i = 0; i < 4; ++i) amax[i] = max2(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], off));

  const int j = th.kc & 7;
  const uint32_t pair = (j & 4) ? ((j & 2) ? amax[3] : amax[2]) : ((j & 2) ? amax[1] : amax[0]);
  const fp8::BlockScale bs = fp8::block_scale<kPow2>(In::widen_abs((pair >> (16 * (j & 1))) & 0xffffu));
  const int l0 = th.first_block_row(tile.tb);
  const int row0 = tile.tb.row0 + l0;  // global row of j = 0
  if (th.kc < 8 && in_block(l0 + j, tile.tb.rows))
    p.s1[int64_t(tile.k0 / kBlock) * p.s1_ld + row0 + j] = bs.scale;

  uint2 qrow[8];
#pragma unroll
  for (int jj = 0; jj < 8; ++jj)
    qrow[jj] = quantize8<In>(v[jj], __shfl_sync(0xffffffffu, bs.mul, (jj << 1) | (th.lane & 1)));

  // Lanes kc = 2i, 2i+1 (lanes l, l ^ 2) hold the halves of a 16-byte row chunk: see pair_exchange.
  const int odd = th.kc & 1;
  const int col = tile.k0 + 8 * (th.kc & ~1);
#pragma unroll
  for (int jj = 0; jj < 8; jj += 2) {
    const uint4 out = pair_exchange(qrow[jj], qrow[jj + 1], odd, 2);
    if (in_block(l0 + jj + odd, tile.tb.rows) && col < p.k) store16(p.q + int64_t(row0 + jj + odd) * p.k + col, out);
  }
}

// Everything no token block covers: the qt pitch columns m..qt_ld-1 (0), the s rows of unused block
// indices (0) and the 1x128 scale padding m..s1_ld-1 (1.0), spread over the whole grid.
template <bool kAlso1x128>
__device__ __forceinline__ void write_grouped_padding(const QuantizeGroupedParams& p, int used) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, nthreads = int64_t(gridDim.x) * blockDim.x;
  const int64_t c_first = p.m >> 4, c_count = (p.qt_ld >> 4) - c_first;  // 16-byte chunks holding padding
  for (int64_t i = tid; i < p.k * c_count; i += nthreads) {
    const int64_t row = i / c_count, c = c_first + (i - row * c_count);
    store_bytes(p.qt + row * p.qt_ld + 16 * c, make_uint4(0u, 0u, 0u, 0u), static_cast<int>(max(int64_t(0), p.m - 16 * c)), 16);
  }
  for (int64_t i = int64_t(used) * p.k + tid; i < int64_t(p.mb_max) * p.k; i += nthreads) p.s[i] = 0.0f;
  if constexpr (kAlso1x128) {
    const int pad = p.s1_ld - p.m, kbs = (p.k + kBlock - 1) / kBlock;
    for (int64_t i = tid; i < int64_t(kbs) * pad; i += nthreads)
      p.s1[(i / pad) * p.s1_ld + p.m + i % pad] = 1.0f;
  }
}

template <class In, bool kPow2, bool kAlso1x128>
__global__ void __launch_bounds__(kGroupedThreads, kGroupedCtasPerSm) quantize_grouped_128x1_kernel(const QuantizeGroupedParams p) {
  extern __shared__ __align__(16) uint8_t grouped_smem[];
  uint4* col_amax = reinterpret_cast<uint4*>(grouped_smem + GroupedSmem::kColAmax);  // [warp][16]: packed 16-bit |x| maxima
  float* col_mul = reinterpret_cast<float*>(grouped_smem + GroupedSmem::kColMul);
  const int G = p.groups.num_groups;
  int* off = reinterpret_cast<int*>(grouped_smem + GroupedSmem::kGroups);  // off[G+1] (row offsets)
  int* blk = off + G + 1;                                                  // blk[G+1] (token-block offsets)
  const GroupedThread th;

  // Group offsets (clamped to m: malformed sizes cannot address rows past x), then token-block offsets
  // from the clamped sizes (so their total never exceeds m/128 + G).
  const GroupsArg groups = p.groups;
  int* scan_scratch = reinterpret_cast<int*>(grouped_smem + GroupedSmem::kScan);
  block_exclusive_scan(G, [groups](int g) { return groups_size(groups, g); }, off, p.m, scan_scratch);
  block_exclusive_scan(G, [off](int g) { return (off[g + 1] - off[g] + kBlock - 1) / kBlock; }, blk, p.mb_max,
                       scan_scratch);
  const int used = blk[G];

  // Tiles t = b * kbs + kb, this CTA's t = blockIdx.x + i * gridDim.x, walked as an incremental (b, kb)
  // cursor: no division per tile, and no linear tile index (which could exceed int).
  const int kbs = (p.k + kBlock - 1) / kBlock;
  const int step_b = gridDim.x / kbs, step_kb = gridDim.x - step_b * kbs;
  int next_b = blockIdx.x / kbs, next_kb = blockIdx.x - next_b * kbs, next_group = 0;
  auto take_tile = [&]() {
    GroupedTile tile{next_b, next_kb * kBlock, {0, 0}};
    if (tile.b < used) tile.tb = find_token_block(off, blk, next_group, tile.b);
    next_kb += step_kb;
    next_b += step_b + (next_kb >= kbs);
    if (next_kb >= kbs) next_kb -= kbs;
    return tile;
  };

  // The store loop: thread i stores chunk i % 9 of transposed rows i / 9 + 32 k (k = 0..3; 288 = 32 x 9
  // threads cover 32 whole rows per round), every tile. Row r + 32 k sits at transposed_offset(r, c) + 512 k
  // with the position (bits 4..6) moved by 4 for odd k: 32 rows are 4 slabs, each rotating one further.
  constexpr int kStoreRounds = kGroupedChunks * kBlock / kGroupedThreads;
  static_assert(kGroupedThreads % kGroupedChunks == 0 && kGroupedThreads / kGroupedChunks == 32,
                "store rounds advance by 32 rows");
  const int store_row = threadIdx.x / kGroupedChunks, store_chunk = threadIdx.x % kGroupedChunks;
  const int store_smem = transposed_offset(store_row, store_chunk);

  static_assert(kGroupedStages == 3, "the ring below holds the current tile and two in flight");
  GroupedTile cur = take_tile();
  issue_tile_copies(cur, used, th, p, grouped_smem);
  GroupedTile next = take_tile();
  issue_tile_copies(next, used, th, p, grouped_smem + kGroupedStageBytes);
  write_grouped_padding<kAlso1x128>(p, used);  // under the first copies' latency

  for (int stage = 0; cur.b < used; stage = stage == kGroupedStages - 1 ? 0 : stage + 1) {
    uint8_t* buf = grouped_smem + stage * kGroupedStageBytes;
    const int k0 = cur.k0, kvalid = min(kBlock, p.k - k0);
    const int l0 = th.first_block_row(cur.tb);
    const bool col_ok = k0 + 8 * th.kc < p.k;

    cp_async_wait<kGroupedStages - 2>();  // this thread's copies of `cur` (it reads nothing else)
    const StageRows rows(l0, th.kc);
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      v[j] = col_ok && in_block(l0 + j, cur.tb.rows) ? *reinterpret_cast<const uint4*>(buf + rows.offset(j))
                                                      : make_uint4(0u, 0u, 0u, 0u);

    // Column amax: over the thread's 8 rows, the lane pair of the warp's two row groups, then the warps.
    uint4 a = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      a.x = max2(a.x, abs2(v[j].x));
      a.y = max2(a.y, abs2(v[j].y));
      a.z = max2(a.z, abs2(v[j].z));
      a.w = max2(a.w, abs2(v[j].w));
    }
    a.x = max2(a.x, __shfl_xor_sync(0xffffffffu, a.x, 1));
    a.y = max2(a.y, __shfl_xor_sync(0xffffffffu, a.y, 1));
    a.z = max2(a.z, __shfl_xor_sync(0xffffffffu, a.z, 1));
    a.w = max2(a.w, __shfl_xor_sync(0xffffffffu, a.w, 1));
    if ((th.lane & 1) == 0) col_amax[th.warp * 16 + th.kc] = a;
    __syncthreads();  // also: every thread is past the previous tile's stores and has read `buf`

    // The stage the previous tile used is free: copy the tile kGroupedStages - 1 ahead into it.
    const GroupedTile after = take_tile();
    issue_tile_copies(after, used, th, p, grouped_smem + (stage == 0 ? kGroupedStages - 1 : stage - 1) * kGroupedStageBytes);

    if (threadIdx.x < kBlock) {
      const int c = threadIdx.x;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(col_amax + (c >> 3)) + ((c & 7) >> 1);
      uint32_t a16 = 0;
#pragma unroll
      for (int w = 0; w < kGroupedWarps; ++w) a16 = max(a16, (words[w * 16 * 4] >> (16 * (c & 1))) & 0xffffu);
      const fp8::BlockScale bs = fp8::block_scale<kPow2>(In::widen_abs(a16));
      col_mul[c] = bs.mul;
      if (c < kvalid) p.s[int64_t(cur.b) * p.k + k0 + c] = bs.scale;
    }
    __syncthreads();

    // Quantize straight into the transposed byte order: cols[i] = column 8kc+i over the 8 span rows,
    // bytes 8(rg%2)..+7 of chunk rg/2 of transposed row 8kc+i.
    {
      const float4 m0 = *reinterpret_cast<const float4*>(&col_mul[8 * th.kc]);
      const float4 m1 = *reinterpret_cast<const float4*>(&col_mul[8 * th.kc + 4]);
      const float mul[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
      const TransposedRows trows(th.kc, th.rg >> 1);
      uint8_t* half = buf + ((th.rg & 1) << 3);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float f[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t word = reinterpret_cast<const uint32_t*>(&v[j])[i >> 1];  // constant after unrolling
          f[j] = (i & 1) ? In::hi(word) : In::lo(word);
        }
        *reinterpret_cast<uint2*>(half + trows.offset(i)) =
            make_uint2(fp8::quantize4(f[0], f[1], f[2], f[3], mul[i]), fp8::quantize4(f[4], f[5], f[6], f[7], mul[i]));
      }
    }
    if constexpr (kAlso1x128) quantize_rows_1x128<In, kPow2>(v, th, p, cur);
    __syncthreads();  // the transposed tile is complete

    // qt rows k0 + r, bytes [R0, R0 + span): chunks [c_full0, c_full1) hold only this block's bytes;
    // the first and last may be shared with the neighbouring blocks (or the pitch padding).
    const int a_off = cur.tb.row0 & 15, span = a_off + cur.tb.rows;
    const int c_full0 = a_off != 0, c_full1 = span >> 4;
    uint8_t* dst = p.qt + int64_t(k0) * p.qt_ld + (cur.tb.row0 - a_off);
    if (store_chunk >= c_full0 && store_chunk < c_full1) {
      uint8_t* out = dst + store_row * p.qt_ld + 16 * store_chunk;
#pragma unroll
      for (int k = 0; k < kStoreRounds; ++k, out += 32 * p.qt_ld)
        if (store_row + 32 * k < kvalid)
          store16(out, *reinterpret_cast<const uint4*>(buf + ((store_smem ^ ((k & 1) << 6)) + 512 * k)));
    }
    // Partial chunks, bounds uniform per warp: warps 0-3 chunk 0 of rows 0..127, bytes [a, min(16, span))
    // unless it is full; warps 4-7 the last chunk, bytes [0, span % 16), unless it is full or chunk 0.
    if (th.warp < 8) {
      const bool last = th.warp >= 4;
      const int r = threadIdx.x & (kBlock - 1);
      const int c = last ? (span - 1) >> 4 : 0;
      const bool partial = last ? (span & 15) != 0 && c > 0 : a_off != 0 || span < 16;
      if (partial && r < kvalid)
        store_bytes(dst + r * p.qt_ld + 16 * c, *reinterpret_cast<const uint4*>(buf + transposed_offset(r, c)),
                    last ? 0 : a_off, last ? span & 15 : min(16, span));
    }

    cur = next;
    next = after;
  }
}

}  // namespace quant
}  // namespace megatron_tma
