// Gather kernels of the padded-path baseline (docs/design.md §5): pad FP8 activations and their 1x128 scales
// into groups aligned to `align` rows, and un-pad the BF16 GEMM output back to the unpadded rows.
//
// Padded layout: group g owns padded rows [P_g, P_g + round_up(M_g, align)), P_g = sum_{h<g} round_up(M_h,
// align). Its first M_g rows are the group's rows [O_g, O_g + M_g) of the source, the rest are zero data
// with scale 1.0. The padded buffers have a host-known upper bound of rows (the padded total depends on the
// device sizes); rows from P_G to that bound are zero data with scale 1.0 as well, so any GEMM over them
// reads finite zeros.
//
// Both kernels are one launch, persistent over tiles of 2^log2_tile_rows destination rows. Every CTA first
// turns the device group tensor into row offsets O and padded offsets P in shared memory
// (block_exclusive_scan: no preparation launch, nothing read on the host, so CUDA-graph replays see new
// sizes). Per tile it maps each destination row to its source row (or -1: write zeros) by a binary search
// over those offsets, then streams the rows with 16-byte vectors. The copy is memory-bound; each thread
// keeps kUnroll independent 16-byte loads in flight before it stores, which is what the bandwidth needs.
#pragma once
#include <cstdint>

#include "megatron_tma/common/groups.cuh"

namespace megatron_tma {
namespace pad_gather {

constexpr int kThreads = 256;    // a multiple of 32 (block_exclusive_scan's warp shuffles)
constexpr int kUnroll = 4;       // 16-byte loads in flight per thread
// 5 CTAs/SM caps registers at 48 (no spills): 5 x 256 threads x 4 x 16 B = 80 KB of loads in flight per SM,
// well above the ~30 KB/SM that HBM bandwidth x latency asks for.
constexpr int kMinBlocksPerSm = 5;
constexpr int kLog2MinTileRows = 5;  // 32 rows: a warp stores 128 contiguous bytes of a scale column
constexpr int kMaxTileRows = 1024;
constexpr int kTileBytes = 64 * 1024;  // target data bytes per tile when rows are short

// Shared memory: 32 warp partial sums (int64) for the scan, then O[G+1], P[G+1] and the tile's row map.
__host__ __device__ constexpr int smem_bytes(int num_groups, int rows_per_tile) {
  return 32 * 8 + (2 * (num_groups + 1) + rows_per_tile) * 4;
}

struct PadParams {
  const uint8_t* a;         // e4m3 [m, k], row-major, 16-byte aligned
  const float* a_scales;    // (m, kb) at a_scales[kb * scales_ld + m]
  uint8_t* a_pad;           // e4m3 [m_pad, k], row-major, 16-byte aligned
  float* a_scales_pad;      // (p, kb) at a_scales_pad[kb * m_pad + p]
  int* padded_offsets;      // int32 [G+1]: P, written by CTA 0
  GroupsArg groups;
  int m, m_pad, k, scales_ld, align;
  int log2_tile_rows;       // tiles of 2^log2_tile_rows padded rows
};

struct UnpadParams {
  const uint8_t* y_pad;     // [y_pad_rows, row_bytes], 16-byte aligned rows
  uint8_t* out;             // [m, row_bytes]
  GroupsArg groups;         // O: the unpadded groups
  GroupsArg padded;         // P: int32 padded offsets [G+1] (as produced by the pad kernel)
  int m, y_pad_rows, row_bytes;
  int log2_tile_rows;       // tiles of 2^log2_tile_rows output rows
};

// The group g whose rows [off[g], off[g+1]) contain `row`, given off[0] <= row < off[G]. Empty groups
// (off[g] == off[g+1]) are skipped because the search keeps off[lo] <= row < off[hi].
__device__ __forceinline__ int find_group(const int* off, int num_groups, int row) {
  int lo = 0, hi = num_groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (off[mid] <= row) lo = mid; else hi = mid;
  }
  return lo;
}

// 16-byte streaming load: the source is read once, so keep it out of L1.
__device__ __forceinline__ int4 load_stream_16b(const void* ptr) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

// Copy `rows` rows of `row_bytes` (a positive multiple of 16) into dst rows [dst_row0, dst_row0 + rows):
// row r comes from src row s_src[r], or is zero when s_src[r] < 0. The block walks the tile's 16-byte
// vectors in row-major order; each thread advances its (row, column) cursor by a fixed stride, so the loop
// has no division.
__device__ __forceinline__ void gather_rows(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                            int row_bytes, const int* s_src, int dst_row0, int rows,
                                            int first_row, int first_col, int step_rows, int step_cols) {
  const int vecs_per_row = row_bytes >> 4;
  int r = first_row, c = first_col;
  while (r < rows) {
    int4 v[kUnroll];
    int vr[kUnroll], vc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      vr[u] = r;
      vc[u] = c;
      const int s = r < rows ? s_src[r] : -1;
      v[u] = s >= 0 ? load_stream_16b(src + static_cast<size_t>(s) * row_bytes + (c << 4)) : make_int4(0, 0, 0, 0);
      r += step_rows;
      c += step_cols;
      if (c >= vecs_per_row) { c -= vecs_per_row; ++r; }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (vr[u] < rows)
        *reinterpret_cast<int4*>(dst + static_cast<size_t>(dst_row0 + vr[u]) * row_bytes + (vc[u] << 4)) = v[u];
  }
}

// This thread's starting (row, column) in a tile of 16-byte vectors and its per-step advance.
struct VecCursor {
  int first_row, first_col, step_rows, step_cols;
  __device__ __forceinline__ explicit VecCursor(int row_bytes) {
    const int vecs_per_row = row_bytes >> 4;
    first_row = threadIdx.x / vecs_per_row;
    first_col = threadIdx.x % vecs_per_row;
    step_rows = kThreads / vecs_per_row;
    step_cols = kThreads % vecs_per_row;
  }
};

__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) pad_rows_fp8_kernel(const PadParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int G = p.groups.num_groups;
  int* s_warp_sums = reinterpret_cast<int*>(smem);
  int* s_off = reinterpret_cast<int*>(smem + 32 * 8);
  int* s_poff = s_off + G + 1;
  int* s_src = s_poff + G + 1;

  // O from the device groups (clamped to m, so malformed sizes stay inside `a`); P from O's clamped
  // sizes (so P_G <= the host bound m_pad; the clamp to m_pad is only a second guard).
  const GroupsArg groups = p.groups;
  const int align = p.align;
  block_exclusive_scan(G, [groups](int g) { return groups_size(groups, g); }, s_off, p.m, s_warp_sums);
  const auto padded_size = [s_off, align](int g) {  // 64-bit: size + align - 1 may pass INT_MAX
    return static_cast<int>((static_cast<long long>(s_off[g + 1] - s_off[g]) + align - 1) / align * align);
  };
  block_exclusive_scan(G, padded_size, s_poff, p.m_pad, s_warp_sums);
  if (blockIdx.x == 0)
    for (int g = threadIdx.x; g <= G; g += kThreads) p.padded_offsets[g] = s_poff[g];

  const int tile_rows = 1 << p.log2_tile_rows;
  const int num_tiles = (p.m_pad + tile_rows - 1) >> p.log2_tile_rows;
  const int scale_blocks = (p.k + 127) / 128;
  const int padded_total = s_poff[G];
  const bool has_data = p.k > 0;
  const VecCursor cur(has_data ? p.k : 16);

  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int row0 = tile << p.log2_tile_rows;
    const int rows = min(tile_rows, p.m_pad - row0);
    for (int r = threadIdx.x; r < rows; r += kThreads) {
      const int row = row0 + r;
      int src = -1;
      if (row < padded_total) {
        const int g = find_group(s_poff, G, row);
        const int local = row - s_poff[g];
        if (local < s_off[g + 1] - s_off[g]) src = s_off[g] + local;
      }
      s_src[r] = src;
    }
    __syncthreads();

    if (has_data)
      gather_rows(p.a, p.a_pad, p.k, s_src, row0, rows, cur.first_row, cur.first_col, cur.step_rows,
                  cur.step_cols);

    // Scales: entry (r, kb) of the tile, r fastest, so a warp stores 32 consecutive floats of one block
    // column (the layout is M-contiguous) and reads consecutive source rows inside a group.
    const int entries = scale_blocks << p.log2_tile_rows;
    for (int e0 = threadIdx.x; e0 < entries; e0 += kThreads * kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int e = e0 + u * kThreads, r = e & (tile_rows - 1), kb = e >> p.log2_tile_rows;
        const int s = (e < entries && r < rows) ? s_src[r] : -1;
        v[u] = s >= 0 ? __ldg(p.a_scales + static_cast<size_t>(kb) * p.scales_ld + s) : 1.0f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int e = e0 + u * kThreads, r = e & (tile_rows - 1), kb = e >> p.log2_tile_rows;
        if (e < entries && r < rows) p.a_scales_pad[static_cast<size_t>(kb) * p.m_pad + row0 + r] = v[u];
      }
    }
    __syncthreads();  // s_src is rewritten by the next tile
  }
}

__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) unpad_rows_kernel(const UnpadParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int G = p.groups.num_groups;
  int* s_warp_sums = reinterpret_cast<int*>(smem);
  int* s_off = reinterpret_cast<int*>(smem + 32 * 8);
  int* s_poff = s_off + G + 1;
  int* s_src = s_poff + G + 1;

  // Both clamped to the buffers they index: a padded group shorter than its group, or offsets past
  // y_pad's rows, yield zero rows instead of out-of-bounds reads.
  const GroupsArg groups = p.groups, padded = p.padded;
  block_exclusive_scan(G, [groups](int g) { return groups_size(groups, g); }, s_off, p.m, s_warp_sums);
  block_exclusive_scan(G, [padded](int g) { return groups_size(padded, g); }, s_poff, p.y_pad_rows, s_warp_sums);

  const int tile_rows = 1 << p.log2_tile_rows;
  const int num_tiles = (p.m + tile_rows - 1) >> p.log2_tile_rows;
  const int total = s_off[G];
  const VecCursor cur(p.row_bytes);

  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int row0 = tile << p.log2_tile_rows;
    const int rows = min(tile_rows, p.m - row0);
    for (int r = threadIdx.x; r < rows; r += kThreads) {
      const int row = row0 + r;
      int src = -1;  // rows past the groups' total (sizes summing below m) are written as zeros
      if (row < total) {
        const int g = find_group(s_off, G, row);
        const int local = row - s_off[g];
        if (local < s_poff[g + 1] - s_poff[g]) src = s_poff[g] + local;
      }
      s_src[r] = src;
    }
    __syncthreads();
    gather_rows(p.y_pad, p.out, p.row_bytes, s_src, row0, rows, cur.first_row, cur.first_col, cur.step_rows,
                cur.step_cols);
    __syncthreads();
  }
}

}  // namespace pad_gather
}  // namespace megatron_tma
