// transpose_128x128_kernel: a 128x128-block FP8 weight copy (q [G, N, K], s [G, N/128, K/128]) -> its transpose
// (qt [G, K, N], st [G, K/128, N/128]): the bytes quantize_128x128 writes as qt/st, made from q/s alone. With one
// scale per 128x128 block the transpose of the quantized weight is the quantized transpose, so dgrad's operand can
// be made in backward from the forward's copy instead of being kept from the forward (keep_transposed_weight=False)
// for 2 bytes of traffic per weight: read q once, write qt once.
// Same tile scheme as quantize_128x128 (common/quant_tile.cuh): a thread's 8x8 byte sub-tile transposed in
// registers, the 128x128 tile through the swizzled shared-memory TransposedTile, whole 16-byte vectors stored.
// Host launcher: csrc/instantiations/quantize.cu.
#pragma once
#include "megatron_tma/common/quant_tile.cuh"

namespace megatron_tma {
namespace quant {

// 8 KB of loads in flight per CTA (8 bytes x 8 rows x 256 threads) and 16 KB of shared memory: 6 CTAs per SM keep
// ~48 KB in flight, about what HBM bandwidth x latency asks for.
constexpr int kTranspose128x128CtasPerSm = 6;

struct Transpose128x128Params {
  const uint8_t* q;  // e4m3 [g, n, k], 16-byte aligned
  const float* s;    // [g, ceil(n/128), ceil(k/128)]
  uint8_t* qt;       // e4m3 [g, k, n]
  float* st;         // [g, ceil(k/128), ceil(n/128)]
  int g, n, k;       // n, k multiples of 16
};

// 8 bytes of a row piece, read once (no L1 allocation).
__device__ __forceinline__ uint2 load_stream8(const void* ptr) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}

__global__ void __launch_bounds__(kThreads, kTranspose128x128CtasPerSm)
    transpose_128x128_kernel(const Transpose128x128Params p) {
  __shared__ __align__(16) uint8_t tile[TransposedTile::kBytes];
  const SubTile sub;
  const int nbs = (p.n + kBlock - 1) / kBlock, kbs = (p.k + kBlock - 1) / kBlock;
  const int64_t tiles = int64_t(p.g) * nbs * kbs;

  // Tile t = (group, nb, kb), kb fastest (as the quantizer): concurrent CTAs read neighbouring blocks of the same rows.
  auto load = [&](int64_t t, uint2(&rows)[8]) {
    const int kb = static_cast<int>(t % kbs), nb = static_cast<int>((t / kbs) % nbs);
    const int64_t gi = t / (int64_t(kbs) * nbs);
    const int row = nb * kBlock + 8 * sub.rg, col = kb * kBlock + 8 * sub.kc;
    // k % 16 == 0: an 8-byte piece starting inside a row lies wholly inside it. Outside the matrix: zeros, which
    // land only on qt bytes past the matrix, never stored.
    const uint8_t* src = p.q + (gi * p.n + row) * p.k + col;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      rows[j] = (col < p.k && row + j < p.n) ? load_stream8(src + int64_t(j) * p.k) : make_uint2(0u, 0u);
  };

  uint2 rows[8];
  if (blockIdx.x < tiles) load(blockIdx.x, rows);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int kb = static_cast<int>(t % kbs), nb = static_cast<int>((t / kbs) % nbs);
    const int64_t gi = t / (int64_t(kbs) * nbs);
    const int n0 = nb * kBlock, k0 = kb * kBlock;
    uint2 cols[8];
    transpose8x8(rows, cols);
    __syncthreads();  // every thread finished reading the previous tile's shared tile
    TransposedTile::write(tile, sub, cols);
    if (t + gridDim.x < tiles) load(t + gridDim.x, rows);  // rows are dead: the next tile's latency hides behind the stores
    if (threadIdx.x == 0) p.st[(gi * kbs + kb) * nbs + nb] = p.s[(gi * nbs + nb) * kbs + kb];
    __syncthreads();  // the transposed tile is complete

    TransposedTile::store(tile, p.qt + gi * p.k * p.n, k0, n0, p.k, p.n);  // qt, whole 16-byte vectors
  }
}

}  // namespace quant
}  // namespace megatron_tma
