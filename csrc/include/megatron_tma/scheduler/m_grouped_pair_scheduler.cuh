// Persistent tile scheduler for M-grouped GEMMs run in 2-CTA clusters (kernels/m_grouped_fp8_gemm.cuh, kCluster == 2).
//
// The row tiles are m_grouped_scheduler.cuh's (ceil(M_g / BLOCK_M) per group, never straddling a group), numbered
// globally 0 .. T-1 in group order (mtile_off). A cluster takes pairs: row tiles 2p and 2p + 1 with one column block;
// CTA rank r computes row tile 2p + r. When both row tiles belong to one group they share the weight tile (each CTA
// loads half of it and multicasts it into both); across a group boundary each loads its own. Only when T is odd does
// rank 1 hold no tile, in the last pair of each column block. (Pairs inside groups instead, 2 x BLOCK_M-row tiles, left
// rank 1 idle through the last tile of every group whose last tile held at most BLOCK_M rows: 3-11% more CTA tiles at
// 2048-512 rows per group.)
//
// Rasterisation: panels of kPanel column blocks over all pairs of all groups, pair-major inside a panel, so a wave
// of clusters shares a few row tiles and a few weight column blocks in L2, as m_grouped_scheduler.cuh's panels do.
// A row tile's group is found by binary search over mtile_off (the pair index restarts with every panel).
#pragma once
#include "megatron_tma/scheduler/m_grouped_scheduler.cuh"

namespace megatron_tma {

template <int BLOCK_M, int kPanel = MEGATRON_TMA_MG_PANEL>
struct MGroupedPairScheduler {
  const int* row_off;    // [G+1] clamped row offsets
  const int* mtile_off;  // [G+1] exclusive scan of ceil(M_g / BLOCK_M)
  int num_groups;
  int n_blocks;

  __device__ __forceinline__ int num_row_tiles() const { return mtile_off[num_groups]; }
  __device__ __forceinline__ int num_tiles() const { return (num_row_tiles() + 1) / 2 * n_blocks; }

  // Row tile m (0 <= m < T) of column block n_block: the group g with mtile_off[g] <= m < mtile_off[g + 1], i.e. the
  // last g with mtile_off[g] <= m (empty groups before it share its offset and are skipped by taking the last).
  __device__ __forceinline__ MTile row_tile(int m, int n_block) const {
    int lo = 0, hi = num_groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (mtile_off[mid] <= m) lo = mid;
      else hi = mid - 1;
    }
    MTile tile;
    tile.group = lo;
    tile.n_block = n_block;
    tile.row_start = row_off[lo] + (m - mtile_off[lo]) * BLOCK_M;
    tile.rows = min(BLOCK_M, row_off[lo + 1] - tile.row_start);
    return tile;
  }

  // Pair tile t: its pair index and column block.
  __device__ __forceinline__ void locate(int t, int& pair, int& n_block) const {
    const int pairs = (num_row_tiles() + 1) / 2;
    const int panel = t / (kPanel * pairs);
    const int in_panel = t - panel * kPanel * pairs;
    const int width = min(kPanel, n_blocks - panel * kPanel);
    pair = in_panel / width;
    n_block = panel * kPanel + (in_panel - pair * width);
  }

  // Pair tile t's row tile of CTA `rank` alone (rows = 0 when it holds none): one group search, for the math warps,
  // which need not know whether the weight tile is shared.
  __device__ __forceinline__ MTile own(int t, int rank) const {
    int pair, n_block;
    locate(t, pair, n_block);
    const int m = 2 * pair + rank;
    if (m < num_row_tiles()) return row_tile(m, n_block);
    MTile none = row_tile(m - 1, n_block);
    none.rows = 0;
    return none;
  }

  // Pair tile t: the row tile of CTA `rank` (rows = 0 when it holds none) and whether the pair shares one weight
  // tile (both row tiles exist and lie in one group). Both CTAs of a cluster get the same `shared`.
  __device__ __forceinline__ MTile get(int t, int rank, bool& shared) const {
    int pair, n_block;
    locate(t, pair, n_block);
    const int m0 = 2 * pair, m1 = m0 + 1;
    const MTile t0 = row_tile(m0, n_block);
    if (m1 >= num_row_tiles()) {  // odd T: the last pair has one row tile
      shared = false;
      if (rank == 0) return t0;
      MTile none = t0;
      none.rows = 0;
      return none;
    }
    const MTile t1 = row_tile(m1, n_block);
    shared = t0.group == t1.group;
    return rank == 0 ? t0 : t1;
  }
};

}  // namespace megatron_tma
