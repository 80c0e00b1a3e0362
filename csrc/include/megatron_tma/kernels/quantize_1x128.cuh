// quantize_1x128_kernel: activations x [M, K] -> q [M, K], one scale per row per 128 columns.
// Shared tile scheme, input types and vector helpers: common/quant_tile.cuh. Host launcher:
// csrc/instantiations/quantize.cu.
#pragma once
#include "megatron_tma/common/quant_tile.cuh"

namespace megatron_tma {
namespace quant {

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

}  // namespace quant
}  // namespace megatron_tma
