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

// Same for a 3-D output (cols, rows, group): used by the k-grouped kernel's per-group outputs.
__device__ __forceinline__ void residual_store_3d(const CUtensorMap* pool, const uint8_t* smem_rows, int rows, int col,
                                                  int row0, int group) {
  const int k = 31 - __clz(rows);
  const int box = 1 << k;
  tma_store_3d(pool + k, smem_rows, col, row0, group);
  if (box != rows) tma_store_3d(pool + k, smem_rows + (rows - box) * kSmemRowBytes, col, row0 + rows - box, group);
}

// Byte offset of the 16-byte chunk `chunk` of 128-byte row `row` under SWIZZLE_128B (1024 B aligned base).
__device__ __forceinline__ int sw128_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

}  // namespace megatron_tma
