// FP32 promotion of one K block's tensor-core partial sums into the running accumulator (docs/design.md §3):
// acc = fma(sa * sb, p, acc) with the scale product rounded first. The wgmma m64nN fragment gives each
// thread rows r0 and r0 + 8 and, for j = 0..N/8-1, columns 8j + 2(lane%4) + {0, 1}, in registers
// {4j, 4j+1} (row r0) and {4j+2, 4j+3} (row r0+8).
#pragma once

namespace megatron_tma {

// One B scale for the whole fragment (128x128 weight blocks: M-grouped GEMM).
template <int R>
__device__ __forceinline__ void promote_row_scaled(float (&acc)[R], const float (&part)[R], float sa0, float sa1, float sb) {
  const float s0 = __fmul_rn(sa0, sb), s1 = __fmul_rn(sa1, sb);
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
    acc[4 * j + 0] = __fmaf_rn(s0, part[4 * j + 0], acc[4 * j + 0]);
    acc[4 * j + 1] = __fmaf_rn(s0, part[4 * j + 1], acc[4 * j + 1]);
    acc[4 * j + 2] = __fmaf_rn(s1, part[4 * j + 2], acc[4 * j + 2]);
    acc[4 * j + 3] = __fmaf_rn(s1, part[4 * j + 3], acc[4 * j + 3]);
  }
}

// Two B scales split at fragment column block kSplitJ (8 columns each), for a tile whose columns straddle two
// 128-wide weight-scale blocks (BLOCK_N = 192): columns 8j.. with j < kSplitJ take sb_lo, the rest sb_hi. Each
// element gets exactly the scale product a 128-wide tile gives it, so the bits agree.
template <int kSplitJ, int R>
__device__ __forceinline__ void promote_row_scaled_split(float (&acc)[R], const float (&part)[R], float sa0, float sa1,
                                                         float sb_lo, float sb_hi) {
  const float l0 = __fmul_rn(sa0, sb_lo), l1 = __fmul_rn(sa1, sb_lo);
  const float h0 = __fmul_rn(sa0, sb_hi), h1 = __fmul_rn(sa1, sb_hi);
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
    const float s0 = j < kSplitJ ? l0 : h0, s1 = j < kSplitJ ? l1 : h1;  // resolved at compile time
    acc[4 * j + 0] = __fmaf_rn(s0, part[4 * j + 0], acc[4 * j + 0]);
    acc[4 * j + 1] = __fmaf_rn(s0, part[4 * j + 1], acc[4 * j + 1]);
    acc[4 * j + 2] = __fmaf_rn(s1, part[4 * j + 2], acc[4 * j + 2]);
    acc[4 * j + 3] = __fmaf_rn(s1, part[4 * j + 3], acc[4 * j + 3]);
  }
}

// A per-column B scale (token-block scales of X^T: K-grouped GEMM). `sb_cols` points at the fragment's
// column scales in shared memory, already offset by 2 * (lane % 4).
template <int R>
__device__ __forceinline__ void promote_row_col_scaled(float (&acc)[R], const float (&part)[R], float sa0, float sa1,
                                                       const float* sb_cols) {
#pragma unroll
  for (int j = 0; j < R / 4; ++j) {
    const float2 sb = *reinterpret_cast<const float2*>(sb_cols + 8 * j);
    acc[4 * j + 0] = __fmaf_rn(__fmul_rn(sa0, sb.x), part[4 * j + 0], acc[4 * j + 0]);
    acc[4 * j + 1] = __fmaf_rn(__fmul_rn(sa0, sb.y), part[4 * j + 1], acc[4 * j + 1]);
    acc[4 * j + 2] = __fmaf_rn(__fmul_rn(sa1, sb.x), part[4 * j + 2], acc[4 * j + 2]);
    acc[4 * j + 3] = __fmaf_rn(__fmul_rn(sa1, sb.y), part[4 * j + 3], acc[4 * j + 3]);
  }
}

}  // namespace megatron_tma
