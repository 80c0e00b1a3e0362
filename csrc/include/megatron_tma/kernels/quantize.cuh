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
// The two transposing kernels share one tile scheme: a CTA of 256 threads owns a 128 x 128 tile, each
// thread an 8 x 8 sub-tile (rows 8*rg..8*rg+7, columns 8*kc..8*kc+7 with kc = lane % 16,
// rg = 2 * warp + lane / 16), loaded as eight 16-byte row pieces: a warp reads two 256-byte row segments
// per load instruction. The quantized bytes go to a transposed shared-memory tile (see TransposedTile)
// from which whole output rows are stored with 16-byte vectors. Both kernels are persistent over tiles
// and load the next tile into the (then dead) input registers before storing the current one, so the
// store phase overlaps the next tile's DRAM latency. The grouped kernel's token blocks start at arbitrary
// rows, so its transposed rows are unaligned; a CTA walks runs of consecutive blocks so that it can store
// the 16-byte chunks straddling two blocks whole (store_token_rows).
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

// Bytes [lo, hi) of the 16-byte value v to dst (16-byte aligned), 0 <= lo < hi <= 16: for the head and
// tail of a token range, whose neighbouring bytes belong to another CTA. Naturally aligned pieces, growing
// from lo while lo's low bits allow, then shrinking to hi; at most nine predicated stores and no loop, so
// lanes that share lo and hi never diverge.
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint4& v, int lo, int hi) {
  const uint64_t h0 = (uint64_t(v.y) << 32) | v.x, h1 = (uint64_t(v.w) << 32) | v.z;
  auto bits = [&](int pos) { return (pos < 8 ? h0 : h1) >> ((pos & 7) * 8); };
  int p = lo;
  if ((p & 1) && p + 1 <= hi) { dst[p] = static_cast<uint8_t>(bits(p)); p += 1; }
  if ((p & 2) && p + 2 <= hi) { *reinterpret_cast<uint16_t*>(dst + p) = static_cast<uint16_t>(bits(p)); p += 2; }
  if ((p & 4) && p + 4 <= hi) { *reinterpret_cast<uint32_t*>(dst + p) = static_cast<uint32_t>(bits(p)); p += 4; }
  if ((p & 8) && p + 8 <= hi) { *reinterpret_cast<uint64_t*>(dst + p) = bits(p); p += 8; }
  if (p + 8 <= hi) { *reinterpret_cast<uint64_t*>(dst + p) = bits(p); p += 8; }
  if (p + 8 <= hi) { *reinterpret_cast<uint64_t*>(dst + p) = bits(p); p += 8; }
  if (p + 4 <= hi) { *reinterpret_cast<uint32_t*>(dst + p) = static_cast<uint32_t>(bits(p)); p += 4; }
  if (p + 2 <= hi) { *reinterpret_cast<uint16_t*>(dst + p) = static_cast<uint16_t>(bits(p)); p += 2; }
  if (p + 1 <= hi) dst[p] = static_cast<uint8_t>(bits(p));
}

// Bytes [sh, sh + 16) of the 32-byte concatenation lo|hi, 0 < sh < 16 (sh uniform across the CTA, so
// the word selection is branch-free and divergence-free).
__device__ __forceinline__ uint4 byte_window(const uint4& lo, const uint4& hi, int sh) {
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const int q = sh >> 2, r = (sh & 3) * 8;
  uint32_t s[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) s[i] = q == 0 ? w[i] : q == 1 ? w[i + 1] : q == 2 ? w[i + 2] : w[i + 3];
  return make_uint4(__funnelshift_r(s[0], s[1], r), __funnelshift_r(s[1], s[2], r),
                    __funnelshift_r(s[2], s[3], r), __funnelshift_r(s[3], s[4], r));
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
constexpr int kGroupedCtasPerSm = 3;  // as k128x128CtasPerSm (80 registers, fused variant included)
constexpr int kGroupedMaxGroups = 8192;
constexpr int kGroupedMaxRun = 8;        // token blocks per work unit, at most (host heuristic)  // two int arrays of G+1 in shared memory (64 KB at the limit)

__host__ __device__ constexpr int grouped_dynamic_smem(int num_groups) { return 2 * (num_groups + 1) * 4; }

struct QuantizeGroupedParams {
  const void* x;    // [m, k] 16-bit, row-major, 16-byte aligned
  uint8_t* qt;      // e4m3 storage [k, qt_ld], 16-byte aligned; columns m..qt_ld-1 are written as 0
  float* s;         // [mb_max, k]: the scale of column c over token block b at s[b * k + c]
  GroupsArg groups;
  int m, k;         // k multiple of 16
  int64_t qt_ld;    // multiple of 16, >= m
  int mb_max;       // m / 128 + G: rows of s; rows past the used blocks are written as 0
  int run;          // token blocks per work unit (>= 1): a CTA quantizes blocks b..b+run-1 of one column block
  int line_stores;  // qt rows are 128-byte aligned: store whole 128-byte lines (store_token_lines)
  // The fused 1x128 outputs (kAlso1x128 only), as in Quantize1x128Params.
  uint8_t* q;       // e4m3 [m, k]
  float* s1;        // storage [ceil(k/128), s1_ld], entries m..s1_ld-1 written as 1.0
  int s1_ld;
};

struct TokenBlock {
  int row0;  // first row of the block
  int rows;  // 1..128, or 0 for a block index past the last used block
};

// Work unit u -> column block kb and its first token block b0: units are runs of `run` consecutive token
// blocks of one column block, token runs fastest. Consecutive blocks are contiguous in tokens (across group
// boundaries too), so one CTA sees each boundary between the blocks of its run and can store the 16-byte
// chunk that straddles it whole (see store_token_rows); and the CTAs resident at any time write long runs
// of the same qt rows rather than ~1 KB pieces of thousands of rows.
struct GroupedUnits {
  uint32_t runs_per_col, run, mb;
  __device__ __forceinline__ void coords(uint32_t u, int& kb, int& b0, int& len) const {
    const uint32_t q = u / runs_per_col;
    kb = static_cast<int>(q);
    b0 = static_cast<int>((u - q * runs_per_col) * run);
    len = static_cast<int>(min(run, mb - static_cast<uint32_t>(b0)));
  }
};

// Token block b: group g owns blocks [blk[g], blk[g+1]), block j of it starts at off[g] + 128 j. `group`
// is the group of the previous lookup: the blocks of a run mostly stay in it, so it is checked first; the
// search otherwise keeps blk[lo] <= b < blk[hi], which skips empty groups.
__device__ __forceinline__ TokenBlock find_token_block(const int* off, const int* blk, int num_groups, int b, int& group) {
  if (b >= blk[num_groups]) return {0, 0};
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
  const int row0 = off[lo] + kBlock * (b - blk[lo]);
  return {row0, min(kBlock, off[lo + 1] - row0)};
}

// Bytes [0, n) of `keep` and [n, 16) of `rest`, 0 <= n <= 16 (n uniform).
__device__ __forceinline__ uint4 merge_bytes(const uint4& keep, const uint4& rest, int n) {
  const auto word = [n](uint32_t k, uint32_t r, int w) {
    const int nb = min(max(n - 4 * w, 0), 4);
    const uint32_t mask = nb == 4 ? 0xffffffffu : (1u << (8 * nb)) - 1u;
    return (k & mask) | (r & ~mask);
  };
  return make_uint4(word(keep.x, rest.x, 0), word(keep.y, rest.y, 1), word(keep.z, rest.z, 2), word(keep.w, rest.w, 3));
}

// The whole 16-byte destination chunks c0 .. c0+nfull-1 of every tile row: chunk c is tile bytes
// [16c - a, 16c - a + 16), i.e. bytes [16 - a, 32 - a) of tile chunks c-1 | c, a funnel shift by r bits of
// the words starting at word kQ (kQ = (16 - a) / 4 as a template parameter, so no word select at run time;
// kQ < 0: a == 0, a plain copy). Warp w owns rows 16w..16w+15, four per step, eight lanes per row (lane j:
// chunk c0 + j); a quarter warp reads one row's eight chunks, which the swizzle keeps conflict-free.
template <int kQ>
__device__ __forceinline__ void store_whole_chunks(const uint8_t* tile, uint8_t* base, int64_t ld, int kvalid, int c0,
                                                   int nfull, int r) {
  constexpr int kRowsPerWarp = kBlock / kWarps;  // 16
  static_assert(kRowsPerWarp % 4 == 0, "four rows per warp step");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = c0 + (lane & 7);
  if ((lane & 7) >= nfull) return;
#pragma unroll
  for (int step = 0; step < kRowsPerWarp / 4; ++step) {
    const int t = kRowsPerWarp * warp + 4 * step + (lane >> 3);
    if (t >= kvalid) break;
    const uint4 cur = TransposedTile::read(tile, t, c);
    uint4 out = cur;
    if constexpr (kQ >= 0) {
      const uint4 prev = TransposedTile::read(tile, t, c - 1);
      const uint32_t w[8] = {prev.x, prev.y, prev.z, prev.w, cur.x, cur.y, cur.z, cur.w};
      out = make_uint4(__funnelshift_r(w[kQ], w[kQ + 1], r), __funnelshift_r(w[kQ + 1], w[kQ + 2], r),
                       __funnelshift_r(w[kQ + 2], w[kQ + 3], r), __funnelshift_r(w[kQ + 3], w[kQ + 4], r));
    }
    store16(base + t * ld + 16 * c, out);
  }
}

// Stores rows [0, kvalid) of the transposed tile: bytes 0..rows-1 of tile row t go to
// dst_row0 + t * ld + [row0, row0 + rows). row0 is arbitrary, so the destination is cut into the 16-byte
// aligned chunks c = 0..nch-1 that the range touches (nch <= 9), chunk c holding tile bytes
// [16c - a, 16c - a + 16), a = row0 % 16. All threads store the whole chunks (store_whole_chunks); then
// threads 0..127 take one row each for its head chunk (bytes [a, 16) of chunk 0, when a != 0) and its tail
// chunk (the last one, when the block does not end on a chunk boundary), so that the byte-sized stores of
// these partial chunks never diverge a warp.
// A chunk shared with the neighbouring block cannot be stored whole by either block alone, and byte-sized
// stores are slow (on the H200 they took a quarter of the kernel's time), so inside a run of blocks the
// partial tail chunk is parked in shared memory (`carry_out`, when `keep_tail`) and the next block merges
// its head bytes into it: only the two ends of a run store partial chunks. `carry_lo` >= 0 says that
// `carry_in` holds bytes [carry_lo, a) of this block's head chunk; the return value says the same of
// `carry_out` for the next block (-1: nothing parked). Every branch is uniform across the CTA.
__device__ __forceinline__ int store_token_rows(const uint8_t* tile, uint8_t* dst_row0, int64_t ld, int kvalid,
                                                int row0, int rows, int carry_lo, const uint4* carry_in,
                                                bool keep_tail, uint4* carry_out) {
  const int a = row0 & 15, end = a + rows;
  const int nch = (end + 15) >> 4;
  uint8_t* base = dst_row0 + (row0 - a);
  const int c0 = a != 0 ? 1 : 0, nfull = (end >> 4) - c0;
  const int sh = 16 - a, r = (sh & 3) * 8;
  switch (a == 0 ? -1 : sh >> 2) {
    case -1: store_whole_chunks<-1>(tile, base, ld, kvalid, c0, nfull, r); break;
    case 0: store_whole_chunks<0>(tile, base, ld, kvalid, c0, nfull, r); break;
    case 1: store_whole_chunks<1>(tile, base, ld, kvalid, c0, nfull, r); break;
    case 2: store_whole_chunks<2>(tile, base, ld, kvalid, c0, nfull, r); break;
    default: store_whole_chunks<3>(tile, base, ld, kvalid, c0, nfull, r); break;
  }

  const bool head_is_tail = a != 0 && nch == 1;
  const bool tail_partial = (end & 15) != 0;
  const bool park_tail = keep_tail && tail_partial;
  const int head_lo = carry_lo >= 0 ? carry_lo : a, head_hi = min(16, end);
  // Row t per thread, ordered so that the eight threads of a quarter warp read eight different
  // swizzle positions of chunk 0 (conflict-free): t = 8 * (i % 8) + (i / 8) % 8 + (i & 64).
  const int i = threadIdx.x;
  const int t = ((i & 7) << 3) + ((i >> 3) & 7) + (i & 64);
  if (i >= kBlock || t >= kvalid) return park_tail ? (head_is_tail ? head_lo : 0) : -1;
  uint8_t* dst = base + t * ld;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  if (a != 0) {
    uint4 out = byte_window(zero, TransposedTile::read(tile, t, 0), sh);
    if (carry_lo >= 0) out = merge_bytes(carry_in[t], out, a);
    if (head_is_tail && park_tail) carry_out[t] = out;
    else if (head_lo == 0 && head_hi == 16) store16(dst, out);
    else store_bytes(dst, out, head_lo, head_hi);
  }
  if (tail_partial && !head_is_tail) {
    const int ct = nch - 1;  // >= 1 when a != 0
    const uint4 cur = ct < 8 ? TransposedTile::read(tile, t, ct) : zero;
    const uint4 out = a == 0 ? cur : byte_window(TransposedTile::read(tile, t, ct - 1), cur, sh);
    if (park_tail) carry_out[t] = out;
    else store_bytes(dst + 16 * ct, out, 0, end & 15);
  }
  return park_tail ? (head_is_tail ? head_lo : 0) : -1;
}

// ---- Line-aligned variant (qt rows 128-byte aligned in memory: qt_ld % 128 == 0) -----------------------
// Tile row t's chunk pair (k-1, k) shifted to destination alignment: tile bytes [16k - a_lo, 16k - a_lo + 16)
// (kQ = (16 - a_lo) / 4 as a template parameter, r = 8 * ((16 - a_lo) % 4); kQ < 0: a_lo == 0, chunk k).
// Chunks outside the tile read as zero (their bytes are never stored).
template <int kQ>
__device__ __forceinline__ uint4 shifted_chunk(const uint8_t* tile, int t, int k, int r) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const uint4 cur = (k >= 0 && k < 8) ? TransposedTile::read(tile, t, min(max(k, 0), 7)) : zero;
  if constexpr (kQ < 0) {
    return cur;
  } else {
    const uint4 prev = (k >= 1 && k <= 8) ? TransposedTile::read(tile, t, min(max(k - 1, 0), 7)) : zero;
    const uint32_t w[8] = {prev.x, prev.y, prev.z, prev.w, cur.x, cur.y, cur.z, cur.w};
    return make_uint4(__funnelshift_r(w[kQ], w[kQ + 1], r), __funnelshift_r(w[kQ + 1], w[kQ + 2], r),
                      __funnelshift_r(w[kQ + 2], w[kQ + 3], r), __funnelshift_r(w[kQ + 3], w[kQ + 4], r));
  }
}

// Bytes [lo, hi) of a 16-byte chunk (clamped to [0, 16); nothing when empty), whole when they cover it.
__device__ __forceinline__ void store_chunk_range(uint8_t* dst, const uint4& v, int lo, int hi) {
  lo = min(max(lo, 0), 16);
  hi = min(max(hi, 0), 16);
  if (hi <= lo) return;
  if (lo == 0 && hi == 16) store16(dst, v); else store_bytes(dst, v, lo, hi);
}

// store_token_rows for 128-byte aligned qt rows: the destination is cut into whole 128-byte lines instead of
// 16-byte chunks. Partial line writes are what the chunk scheme still leaves at every block edge (a block's
// 128 tokens straddle two lines), and writing part of a line costs more than writing it whole once L2
// keeps lines compressed (PyTorch's allocations here are compressible memory: ncu shows every write going
// through the L2 compression unit). A block starting at a = row0 % 128 completes line A (bytes [a, 128),
// the first a bytes coming from the previous block of the run, parked in `carry`) and parks the head of
// line B (bytes [0, a + rows - 128)) for the next block, so inside a run every store is a whole line: lane j
// of a row's eight lanes owns chunk j of both lines and carry[t][j] (read before it is rewritten, so one
// buffer suffices). A block that ends inside line A parks line A itself. Only a run's ends write partial
// lines. `carry_lo`: as in store_token_rows, for line A.
template <int kQ>
__device__ __forceinline__ int store_token_lines(const uint8_t* tile, uint8_t* dst_row0, int64_t ld, int kvalid,
                                                 int row0, int rows, int carry_lo, uint4* carry, bool keep_tail,
                                                 int r) {
  const int a = row0 & 127, end = a + rows, a_hi = a >> 4;
  uint8_t* base = dst_row0 + (row0 - a);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, j = lane & 7;
  const int lo = carry_lo >= 0 ? carry_lo : a;
  const int n_prev = min(max(a - 16 * j, 0), 16);  // bytes of line-A chunk j before the block (from carry)
  const bool a_done = end >= 128, has_b = end > 128;
  constexpr int kRowsPerWarp = kBlock / kWarps;
#pragma unroll
  for (int step = 0; step < kRowsPerWarp / 4; ++step) {
    const int t = kRowsPerWarp * warp + 4 * step + (lane >> 3);
    if (t >= kvalid) break;
    uint8_t* dst = base + t * ld + 16 * j;
    uint4& parked = carry[t * 8 + j];
    uint4 va = shifted_chunk<kQ>(tile, t, j - a_hi, r);
    if (carry_lo >= 0 && n_prev > 0) va = merge_bytes(parked, va, n_prev);
    if (a_done) {
      store_chunk_range(dst, va, lo - 16 * j, 16);
      if (has_b) {
        const uint4 vb = shifted_chunk<kQ>(tile, t, 8 + j - a_hi, r);
        if (keep_tail) parked = vb;
        else store_chunk_range(dst + 128, vb, 0, end - 128 - 16 * j);
      }
    } else if (keep_tail) {
      parked = va;
    } else {
      store_chunk_range(dst, va, lo - 16 * j, end - 16 * j);
    }
  }
  if (!keep_tail) return -1;
  return a_done ? (has_b ? 0 : -1) : lo;
}

__device__ __forceinline__ int store_token_lines_any(const uint8_t* tile, uint8_t* dst_row0, int64_t ld, int kvalid,
                                                     int row0, int rows, int carry_lo, uint4* carry, bool keep_tail) {
  const int a_lo = row0 & 15, sh = 16 - a_lo, r = (sh & 3) * 8;
  switch (a_lo == 0 ? -1 : sh >> 2) {
    case -1: return store_token_lines<-1>(tile, dst_row0, ld, kvalid, row0, rows, carry_lo, carry, keep_tail, r);
    case 0: return store_token_lines<0>(tile, dst_row0, ld, kvalid, row0, rows, carry_lo, carry, keep_tail, r);
    case 1: return store_token_lines<1>(tile, dst_row0, ld, kvalid, row0, rows, carry_lo, carry, keep_tail, r);
    case 2: return store_token_lines<2>(tile, dst_row0, ld, kvalid, row0, rows, carry_lo, carry, keep_tail, r);
    default: return store_token_lines<3>(tile, dst_row0, ld, kvalid, row0, rows, carry_lo, carry, keep_tail, r);
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
  extern __shared__ int smem_groups[];  // off[G+1] (row offsets), blk[G+1] (token-block offsets)
  __shared__ __align__(16) uint8_t tile[TransposedTile::kBytes];
  __shared__ uint4 col_amax[kWarps][16];     // per warp: 16-bit |x| maxima of the 128 columns, packed
  __shared__ __align__(16) float col_mul[kBlock];
  __shared__ long long scan_scratch[32];
  // A run's parked bytes: 16-byte tail chunks [2][kBlock] (store_token_rows, double-buffered), or whole
  // 128-byte line heads [kBlock][8] (store_token_lines).
  __shared__ uint4 carry[kBlock * 8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SubTile sub;
  const int G = p.groups.num_groups;
  int* off = smem_groups;
  int* blk = smem_groups + G + 1;

  // Group offsets (clamped to m: malformed sizes cannot address rows past x), then token-block offsets
  // from the clamped sizes (so their total never exceeds m/128 + G).
  const GroupsArg groups = p.groups;
  block_exclusive_scan(G, [groups](int g) { return groups_size(groups, g); }, off, p.m,
                       reinterpret_cast<int*>(scan_scratch));
  block_exclusive_scan(G, [off](int g) { return (off[g + 1] - off[g] + kBlock - 1) / kBlock; }, blk, p.mb_max,
                       reinterpret_cast<int*>(scan_scratch));

  const int kbs = (p.k + kBlock - 1) / kBlock;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);

  // Work units (runs of token blocks of one column block, see GroupedUnits); blocks past the used ones
  // only write zeros.
  auto load = [&](int kb, const TokenBlock& tb, uint4(&v)[8]) {
    const int col = kb * kBlock + 8 * sub.kc;
    load_subtile(v, x + int64_t(tb.row0 + 8 * sub.rg) * p.k + col, p.k, tb.rows - 8 * sub.rg, col < p.k);
  };
  const GroupedUnits units{static_cast<uint32_t>((p.mb_max + p.run - 1) / p.run), static_cast<uint32_t>(p.run),
                           static_cast<uint32_t>(p.mb_max)};
  const uint32_t num_units = units.runs_per_col * static_cast<uint32_t>(kbs);

  // This CTA's tiles: blocks b0..b0+len-1 of unit u in order, then unit u + gridDim.x.
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
  TokenBlock next = find_token_block(off, blk, G, cur.b0, group);
  load(cur.kb, next, v);
  int carry_lo = -1;
  while (cur.u < num_units) {
    const TokenBlock tb = next;
    const int b = cur.b0 + cur.j, k0 = cur.kb * kBlock;
    const int kvalid = min(kBlock, p.k - k0);
    const Cursor nxt = advance(cur);

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
    __syncthreads();  // also: the previous tile's store phase is over (tile and col_mul are free)

    if (threadIdx.x < kBlock) {
      const int c = threadIdx.x;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(&col_amax[0][c >> 3]) + ((c & 7) >> 1);
      uint32_t a16 = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) a16 = max(a16, (words[w * 16 * 4] >> (16 * (c & 1))) & 0xffffu);
      const fp8::BlockScale bs = fp8::block_scale<kPow2>(In::widen_abs(a16));
      col_mul[c] = bs.mul;
      if (c < kvalid) p.s[int64_t(b) * p.k + k0 + c] = tb.rows > 0 ? bs.scale : 0.0f;
    }
    __syncthreads();

    // Quantize straight into the transposed byte order: cols[i] = column 8kc+i over the 8 rows.
    if (tb.rows > 0) {
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
        cols[i] = make_uint2(fp8::quantize4(f[0], f[1], f[2], f[3], mul[i]),
                             fp8::quantize4(f[4], f[5], f[6], f[7], mul[i]));
      }
      TransposedTile::write(tile, sub, cols);
      if constexpr (kAlso1x128) quantize_rows_1x128<In, kPow2>(v, sub, p, tb.row0, tb.rows, k0);
    }
    // v and the quantized bytes are dead: prefetch the next tile, whose latency the stores hide.
    if (nxt.u < num_units) {
      next = find_token_block(off, blk, G, nxt.b0 + nxt.j, group);
      load(nxt.kb, next, v);
    }
    __syncthreads();

    uint8_t* qt_rows = p.qt + int64_t(k0) * p.qt_ld;
    if (tb.rows > 0)
      carry_lo = p.line_stores
                     ? store_token_lines_any(tile, qt_rows, p.qt_ld, kvalid, tb.row0, tb.rows, carry_lo, carry,
                                             nxt.u == cur.u && next.rows > 0)
                     : store_token_rows(tile, qt_rows, p.qt_ld, kvalid, tb.row0, tb.rows, carry_lo,
                                        carry + (cur.j & 1) * kBlock, nxt.u == cur.u && next.rows > 0,
                                        carry + ((cur.j + 1) & 1) * kBlock);
    // Padding that belongs to no token block (the qt pitch columns m..qt_ld-1, the 1x128 scale entries
    // m..s1_ld-1): the tiles of the last block index, one per column block, write it.
    if (b == p.mb_max - 1) {
      if (threadIdx.x < kvalid)
        for (int64_t c0 = p.m & ~15; c0 < p.qt_ld; c0 += 16)
          store_bytes(qt_rows + threadIdx.x * p.qt_ld + c0, make_uint4(0u, 0u, 0u, 0u),
                      static_cast<int>(max(int64_t(0), p.m - c0)), static_cast<int>(min(int64_t(16), p.qt_ld - c0)));
      if constexpr (kAlso1x128)
        if (p.m + static_cast<int>(threadIdx.x) < p.s1_ld) p.s1[int64_t(k0 / kBlock) * p.s1_ld + p.m + threadIdx.x] = 1.0f;
    }
    cur = nxt;
  }
}

}  // namespace quant
}  // namespace megatron_tma
