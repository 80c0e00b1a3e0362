// What the three block FP8 quantizers share (kernels/quantize_1x128.cuh, quantize_128x128.cuh,
// quantize_grouped_128x1.cuh; docs/design.md §3, byte layouts in docs/layouts.md). All three are memory-bound
// streams: 16-byte loads with several in flight per thread, 16-byte coalesced stores, the amax reduced
// with warp shuffles / shared memory, and the scale formula of common/fp8.cuh. Inputs are 16-bit
// (bf16 or fp16, `In` below), row-major with 16-byte aligned rows (K % 16 == 0).
//
//  quantize_1x128_kernel          x [M, K] -> q [M, K], one scale per row per 128 columns.
//  quantize_128x128_kernel        w [G, N, K] -> q [G, N, K] and qt = q^T [G, K, N] in one pass, one
//                                 scale per 128x128 block (s and its transpose st).
//  quantize_grouped_128x1_kernel  x [M, K] -> qt [K, P], each group's tokens transposed from a 128-aligned
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

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "megatron_tma/common/fp8.cuh"
#include "megatron_tma/common/groups.cuh"

namespace megatron_tma {
namespace quant {

constexpr int kThreads = 256;  // a multiple of 32 (block_exclusive_scan); the tile scheme assumes 256
constexpr int kWarps = kThreads / 32;
constexpr int kBlock = 128;     // quantization block edge

// ------------------------------------------------------------------------------------------------
// Input formats: two 16-bit elements per 32-bit word (element 0 in the low half). Elem: what the input holds.
// ------------------------------------------------------------------------------------------------
struct Bf16In {
  using Elem = uint16_t;
  static __device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
  // 16-bit pattern of |x| -> FP32 bit pattern of |x| (exact; NaN stays NaN)
  static __device__ __forceinline__ uint32_t widen_abs(uint32_t h) { return h << 16; }
};

struct Fp16In {
  using Elem = uint16_t;
  static __device__ __forceinline__ float lo(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  }
  static __device__ __forceinline__ float hi(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ uint32_t widen_abs(uint32_t h) { return __float_as_uint(lo(h)); }
};

// FP32 master weights, read as their BF16 rounding (round to nearest even: the copy a mixed-precision optimizer writes
// into BF16 model weights) and packed on load (load_subtile's float overload), so that every later step works on
// Bf16In's registers and the bytes are those of the BF16 weights' quantization (quantize_128x128 only).
struct Fp32MasterIn : Bf16In {
  using Elem = float;
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

__device__ __forceinline__ uint32_t bf16x2_rn(uint32_t lo, uint32_t hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(__uint_as_float(lo), __uint_as_float(hi));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The same 8 row pieces from FP32 (Fp32MasterIn): two 16-byte loads per row, each element rounded to BF16, so that
// v holds what the 16-bit overload would read from the BF16 copy of the same rows. src counts FP32 elements.
__device__ __forceinline__ void load_subtile(uint4 (&v)[8], const float* src, int64_t ld, int rows_left, bool col_ok) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (col_ok && j < rows_left) {
      const uint4 a = load_stream(src + j * ld), b = load_stream(src + j * ld + 4);
      v[j] = make_uint4(bf16x2_rn(a.x, a.y), bf16x2_rn(a.z, a.w), bf16x2_rn(b.x, b.y), bf16x2_rn(b.z, b.w));
    } else {
      v[j] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
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
  // The complete tile of source block (n0, k0) to its place in out [k, n] (row pitch n): 128 rows (k) x 8 chunks of
  // 16 bytes (n); 8 consecutive threads store one 128-byte row piece; rows and chunks past the matrix are skipped.
  static __device__ __forceinline__ void store(const uint8_t* tile, uint8_t* out, int k0, int n0, int k, int n) {
#pragma unroll
    for (int r = 0; r < kBytes / 16 / kThreads; ++r) {
      const int idx = threadIdx.x + r * kThreads;
      const int tr = idx >> 3, chunk = idx & 7;
      const int kk = k0 + tr, nn = n0 + 16 * chunk;
      if (kk < k && nn < n) store16(out + int64_t(kk) * n + nn, read(tile, tr, chunk));
    }
  }
};

}  // namespace quant
}  // namespace megatron_tma
