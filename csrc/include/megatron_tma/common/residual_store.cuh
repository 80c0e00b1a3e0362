// The paper's two-phase residual store (arXiv:2508.16584), from a TMA descriptor pool.
//
// A tile whose group ends inside it has r valid rows. The pool holds one store descriptor per box height
// 2^0 .. 2^LOG2_MAX over the same output tensor. With 2^k < r <= 2^(k+1) we issue two 2^k-row stores:
// smem rows [0, 2^k) -> global [row0, row0 + 2^k) and smem rows [r - 2^k, r) -> [row0 + r - 2^k, row0 + r).
// They overlap and write identical values; their union is exactly the r valid rows, so nothing of the next
// group is touched. A power-of-two r needs a single store.
//
// Shared-memory rows are 128 B and swizzled by address (SWIZZLE_128B XORs the 16-byte chunk with address
// bits [7,10)), so a store may start at any whole row: the shifted second store reads the same bytes the
// epilogue wrote. This is why an output row chunk must be exactly 128 B (64 BF16 columns / 32 FP32 columns).
#pragma once
#include <cuda_bf16.h>
#include <cstdint>
#include "megatron_tma/common/tma.cuh"

namespace megatron_tma {

constexpr int kSmemRowBytes = 128;

// `pool[k]` is a 2-D store descriptor (cols, rows) with box (row chunk, 2^k). Issued by one thread.
__device__ __forceinline__ void residual_store_2d(const CUtensorMap* pool, const uint8_t* smem_rows, int rows, int col,
                                                  int row0) {
  const int k = 31 - __clz(rows);  // floor(log2(rows)), rows >= 1
  const int box = 1 << k;
  tma_store_2d(pool + k, smem_rows, col, row0);
  if (box != rows) tma_store_2d(pool + k, smem_rows + (rows - box) * kSmemRowBytes, col, row0 + rows - box);
}

// Byte offset of the 16-byte chunk `chunk` of 128-byte row `row` under SWIZZLE_128B (1024 B aligned base).
__device__ __forceinline__ int sw128_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// One warpgroup's FP32 m64n128 fragment (R = 64 registers: rows row_a and row_a + 8, columns 8j + 2(lane%4) + {0,1},
// common/promotion.cuh) rounded to BF16 into a staging tile of two 64-column, 128B-swizzled halves that lie
// kHalfBytes apart: the layout the residual stores read.
template <int kHalfBytes, int R>
__device__ __forceinline__ void stage_bf16_fragment(uint8_t* tile, const float (&acc)[R], int row_a, int lane) {
  static_assert(R == 64, "an m64n128 fragment");
  const int row_b = row_a + 8;
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
    uint8_t* half = tile + (j / 8) * kHalfBytes;
    *reinterpret_cast<__nv_bfloat162*>(half + sw128_offset(row_a, j % 8) + 4 * (lane % 4)) =
        __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
    *reinterpret_cast<__nv_bfloat162*>(half + sw128_offset(row_b, j % 8) + 4 * (lane % 4)) =
        __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
  }
}

}  // namespace megatron_tma
