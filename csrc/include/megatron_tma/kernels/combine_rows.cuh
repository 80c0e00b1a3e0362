// combine_rows_kernel: the MoE un-permutation. out[t] = sum over j < k of y[token_rows[t, j]], each token's k
// expert rows added in FP32 in the order j = 0..k-1 (from +0), rounded to BF16 once.
//
// What it replaces: Megatron's un-permutation of the experts' output (a scatter-add of BF16 rows: with atomics
// the order, hence the bits, vary from run to run) and the backward of its permutation (the same sum, over the
// input gradient's rows). One fixed order makes the sum deterministic, so two expert paths that produce the
// same rows (the unpadded experts and their padded twins) also produce the same combined bits.
//
// Memory-bound: a thread owns one 16-byte chunk (8 columns) of one token; its k loads are independent and issued
// together, and the chunks of a warp are consecutive columns of one or two tokens (the index loads broadcast).
#pragma once
#include <cstdint>

#include <cuda_bf16.h>

namespace megatron_tma {
namespace combine {

constexpr int kThreads = 256;
constexpr int kMaxK = 32;  // the most rows per token (Megatron's top-k) accepted

struct CombineParams {
  const uint16_t* y;       // bf16 [y_rows, h], 16-byte aligned rows
  const int* token_rows;   // int32 [tokens, k]: the rows of y that belong to each token (an index outside
                           // [0, y_rows) is clamped into it: a wrong row, never a read outside y)
  uint16_t* out;           // bf16 [tokens, h]
  int64_t tokens, chunks;  // chunks: h / 8 per row
  int y_rows, k;
};

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // round to nearest even, as torch's .to(bfloat16)
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int kK>
__global__ void __launch_bounds__(kThreads) combine_rows_kernel(const CombineParams p) {
  const int64_t total = p.tokens * p.chunks;
  const int k = kK > 0 ? kK : p.k;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / p.chunks, c = i - t * p.chunks;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    uint4 v[kK > 0 ? kK : 1];
    if constexpr (kK > 0) {
#pragma unroll
      for (int j = 0; j < kK; ++j) {
        const int r = min(max(__ldg(p.token_rows + t * kK + j), 0), p.y_rows - 1);
        v[j] = __ldg(reinterpret_cast<const uint4*>(p.y + int64_t(r) * p.chunks * 8) + c);
      }
    }
    for (int j = 0; j < k; ++j) {
      uint4 w;
      if constexpr (kK > 0) {
        w = v[j];
      } else {
        const int r = min(max(__ldg(p.token_rows + t * k + j), 0), p.y_rows - 1);
        w = __ldg(reinterpret_cast<const uint4*>(p.y + int64_t(r) * p.chunks * 8) + c);
      }
      acc[0] += bf16_lo(w.x);
      acc[1] += bf16_hi(w.x);
      acc[2] += bf16_lo(w.y);
      acc[3] += bf16_hi(w.y);
      acc[4] += bf16_lo(w.z);
      acc[5] += bf16_hi(w.z);
      acc[6] += bf16_lo(w.w);
      acc[7] += bf16_hi(w.w);
    }
    const uint4 o = make_uint4(pack_bf16(acc[0], acc[1]), pack_bf16(acc[2], acc[3]), pack_bf16(acc[4], acc[5]),
                               pack_bf16(acc[6], acc[7]));
    reinterpret_cast<uint4*>(p.out + t * p.chunks * 8)[c] = o;
  }
}

}  // namespace combine
}  // namespace megatron_tma
