// quantize_128x128_kernel: weights w [G, N, K] -> q [G, N, K] and qt = q^T [G, K, N] in one pass, one
// scale per 128x128 block (s and its transpose st).
// Shared tile scheme, input types and vector helpers: common/quant_tile.cuh. Host launcher:
// csrc/instantiations/quantize.cu.
#pragma once
#include <type_traits>

#include "megatron_tma/common/quant_tile.cuh"

namespace megatron_tma {
namespace quant {

// ================================================================================================
// 128x128: weights, with the transposed copy
// ================================================================================================
// 3 CTAs/SM cap registers at 80 (65536 / 768, rounded down to the allocation unit; no spills) and keep
// 3 x 32 KB of loads in flight per SM, about 3x what HBM bandwidth x latency asks for.
constexpr int k128x128CtasPerSm = 3;
// FP32 masters (Fp32MasterIn) load twice the bytes per sub-tile: 2 CTAs/SM give them 128 registers (80 spill).
template <class In>
constexpr int k128x128CtasPerSmOf = std::is_same<In, Fp32MasterIn>::value ? 2 : k128x128CtasPerSm;

struct Quantize128x128Params {
  const void* w;  // [g, n, k] 16-bit (FP32 for Fp32MasterIn), 16-byte aligned
  uint8_t* q;     // e4m3 [g, n, k]
  float* s;       // [g, ceil(n/128), ceil(k/128)]
  uint8_t* qt;    // e4m3 [g, k, n]; nullptr: no transposed copy (nor st)
  float* st;      // [g, ceil(k/128), ceil(n/128)]
  int g, n, k;    // n, k multiples of 16
  // The refresh (kRefresh, quantize_128x128_refresh): the whole launch does nothing when *version == *done, i.e. the
  // outputs already hold the weights of that optimizer step. Read on the device, so a CUDA graph that holds the launch
  // re-quantizes on replay only after a step (the launcher copies version into done after it).
  const int64_t* version = nullptr;
  const int64_t* done = nullptr;
};

// kRefresh: the refresh variant (the version check; qt may be nullptr). The plain instances compile without either,
// to the code they had before the variant existed.
template <class In, bool kPow2, bool kRefresh = false>
__global__ void __launch_bounds__(kThreads, k128x128CtasPerSmOf<In>) quantize_128x128_kernel(const Quantize128x128Params p) {
  __shared__ __align__(16) uint8_t tile[TransposedTile::kBytes];
  __shared__ uint32_t warp_amax[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SubTile sub;
  const int nbs = (p.n + kBlock - 1) / kBlock, kbs = (p.k + kBlock - 1) / kBlock;
  const int64_t tiles = int64_t(p.g) * nbs * kbs;
  const typename In::Elem* w = static_cast<const typename In::Elem*>(p.w);
  if constexpr (kRefresh) {
    if (*p.version == *p.done) return;  // uniform over the grid: no CTA reaches a barrier
  }
  const bool transposed = !kRefresh || p.qt != nullptr;

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

    if (transposed) {
      uint2 cols[8];
      transpose8x8(rows, cols);
      TransposedTile::write(tile, sub, cols);
    }
    // v and the quantized bytes are dead: prefetch the next tile, whose latency the qt stores hide.
    if (t + gridDim.x < tiles) load(t + gridDim.x, v);
    if (threadIdx.x == 0) {
      p.s[(gi * nbs + nb) * kbs + kb] = bs.scale;
      if (transposed) p.st[(gi * kbs + kb) * nbs + nb] = bs.scale;
    }
    __syncthreads();  // the transposed tile is complete; warp_amax may be rewritten
    if (!transposed) continue;

    TransposedTile::store(tile, p.qt + gi * p.k * p.n, k0, n0, p.k, p.n);  // qt, whole 16-byte vectors
  }
}

}  // namespace quant
}  // namespace megatron_tma
