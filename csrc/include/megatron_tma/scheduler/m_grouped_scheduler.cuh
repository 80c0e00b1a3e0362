// Persistent tile scheduler for M-grouped GEMMs over real tiles only.
//
// Group g holds rows [row_off[g], row_off[g+1]) and ceil(M_g / BLOCK_M) row tiles; tiles never straddle
// groups and empty groups own none, so sum_g ceil(M_g/BLOCK_M) * n_blocks tiles exist (at most
// (M_total/BLOCK_M + G) * n_blocks). The offsets live in shared memory, built per CTA from the device
// group tensor (common/groups.cuh). CTAs walk tile indices blockIdx.x, +gridDim.x, ... so the group cursor
// only moves forward.
//
// Inside a group, tiles are rasterised in panels of kPanel N blocks: a wave of CTAs then shares a few
// A row blocks and a few B column blocks in L2 instead of streaming all of B_g once per row block.
#pragma once
#include <cstdint>

// Build option for device A/B runs: the panel width. 8, 16 and 4 measured the same on the H200 (benchmarks/NOTES.md,
// branch panel-ab); not measured on an H100, where the big rows trail DeepGEMM.
#ifndef MEGATRON_TMA_MG_PANEL
#define MEGATRON_TMA_MG_PANEL 8
#endif

namespace megatron_tma {

struct MTile {
  int group;      // expert index
  int row_start;  // first global row of the tile (inside the group)
  int rows;       // valid rows, 1..BLOCK_M
  int n_block;    // output column block
};

template <int BLOCK_M, int kPanel = MEGATRON_TMA_MG_PANEL>
struct MGroupedScheduler {
  const int* row_off;    // [G+1] clamped row offsets
  const int* mtile_off;  // [G+1] exclusive scan of ceil(M_g / BLOCK_M)
  int num_groups;
  int n_blocks;
  int group = 0;

  __device__ __forceinline__ int num_tiles() const { return mtile_off[num_groups] * n_blocks; }

  // Tile indices passed in must not decrease between calls.
  __device__ __forceinline__ MTile get(int t) {
    while (mtile_off[group + 1] * n_blocks <= t) ++group;
    const int m_tiles = mtile_off[group + 1] - mtile_off[group];
    const int local = t - mtile_off[group] * n_blocks;
    const int panel = local / (kPanel * m_tiles);
    const int in_panel = local - panel * kPanel * m_tiles;
    const int width = min(kPanel, n_blocks - panel * kPanel);
    const int m = in_panel / width;
    MTile tile;
    tile.group = group;
    tile.n_block = panel * kPanel + (in_panel - m * width);
    tile.row_start = row_off[group] + m * BLOCK_M;
    tile.rows = min(BLOCK_M, row_off[group + 1] - tile.row_start);
    return tile;
  }
};

}  // namespace megatron_tma
