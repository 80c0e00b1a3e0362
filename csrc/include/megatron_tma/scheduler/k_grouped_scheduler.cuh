// Persistent tile scheduler for K-grouped (weight-gradient) GEMMs: one output tile per
// (group, N block, K block); its contraction runs over the group's token blocks
// [a_g + 128j, min(a_g + 128(j+1), a_g + M_g)), a_g the group's first column in the token-contiguous operands.
// The tile count G * n_blocks * k_blocks is known on the host; the token extents come from shared-memory
// arrays built per CTA (common/groups.cuh). Tiles of one group are consecutive, K blocks fastest, so the CTAs
// running at one time share dY^T rows in L2.
#pragma once

namespace megatron_tma {

struct KTile {
  int group;
  int n_block, k_block;
  int token_start;  // a_g: the group's first column (a multiple of 128)
  int tokens;       // M_g (0 for an empty group)
  int block_base;   // B_g: index of the group's first token block in the scale tensors
};

struct KGroupedScheduler {
  const int* token_off;  // [G+1] a_g
  const int* tokens;     // [G] M_g
  const int* block_off;  // [G+1] exclusive scan of ceil(M_g / 128)
  int num_groups, n_blocks, k_blocks;

  __device__ __forceinline__ int num_tiles() const { return num_groups * n_blocks * k_blocks; }

  __device__ __forceinline__ KTile get(int t) const {
    KTile tile;
    const int per_group = n_blocks * k_blocks;
    tile.group = t / per_group;
    const int local = t - tile.group * per_group;
    tile.n_block = local / k_blocks;
    tile.k_block = local - tile.n_block * k_blocks;
    tile.token_start = token_off[tile.group];
    tile.tokens = tokens[tile.group];
    tile.block_base = block_off[tile.group];
    return tile;
  }
};

}  // namespace megatron_tma
