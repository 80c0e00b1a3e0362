// The M-grouped GEMM's default output tile, chosen on the host from what it knows without reading the groups
// (M_total, N, G and the number of SMs): no sync, so the choice is CUDA-graph safe. Plain C++ (no CUDA, no
// torch), so that tests/test_m_grouped_tile_choice.py can compile and check it on a CPU machine.
//
// The model: every candidate tile has a measured throughput relative to 128 x 128 on full tiles (rate). A
// persistent grid runs ceil(tiles / SMs) rounds of tiles, so
//     time ~ ceil(expected_tiles / num_sms) * BLOCK_M * BLOCK_N / rate,
// with expected_tiles = (M_total / BLOCK_M + G / 2) * ceil(N / BLOCK_N): on average each group ends in half a
// tile, and columns past N in the last column block are paid for. The round count is what makes small
// problems take small tiles (one round of big tiles is slower than one round of small ones) and what breaks
// near-ties by wave quantization.
//
// 192 x 128 (three math warpgroups, serial promotion) is a candidate only when groups average >= 2048 rows: a
// group's last tile may leave one or two warpgroups idle, and a lone warpgroup cannot hide its promotion, a
// loss the tile count does not see (measured up to -17% on balanced groups of 256-1024 rows).
//
// Rates, from the grid at 05067f9 (benchmarks/results/m_grouped-20261129-1918.json, in git history; the ours_m128 /
// ours_m192 / ours_bn192 columns on rows whose groups average >= 4096 rows, medians): 192 x 128 x1.10, 128 x 192 x1.08.
// benchmarks/NOTES.md has the per-row numbers behind them.
#pragma once

namespace megatron_tma {

struct MGroupedTileShape {
  int block_m;
  int block_n;
};

struct MGroupedTileCandidate {
  MGroupedTileShape tile;
  double rate;              // full-tile throughput relative to 128 x 128
  long long min_avg_rows;   // the average group size (M_total / G) from which the tile is a candidate
};

constexpr long long kM192MinRowsPerGroup = 2048;

// In order of preference on equal cost.
constexpr MGroupedTileCandidate kMGroupedTileCandidates[] = {
    {{128, 128}, 1.00, 0},
    {{128, 192}, 1.08, 0},
    {{192, 128}, 1.10, kM192MinRowsPerGroup},
};

// Modelled time of one candidate (arbitrary units), or a negative number when it is not a candidate here.
inline double m_grouped_tile_cost(const MGroupedTileCandidate& c, long long m_total, long long n,
                                  long long num_groups, int num_sms) {
  if (num_groups < 1 || m_total < c.min_avg_rows * num_groups) return -1.0;
  const double row_tiles = static_cast<double>(m_total) / c.tile.block_m + 0.5 * static_cast<double>(num_groups);
  const long long col_tiles = (n + c.tile.block_n - 1) / c.tile.block_n;
  const double tiles = row_tiles * static_cast<double>(col_tiles);
  long long rounds = static_cast<long long>(tiles / num_sms);
  if (rounds * num_sms < tiles) ++rounds;
  if (rounds < 1) rounds = 1;
  return static_cast<double>(rounds) * c.tile.block_m * c.tile.block_n / c.rate;
}

inline MGroupedTileShape choose_m_grouped_tile(long long m_total, long long n, long long num_groups, int num_sms) {
  MGroupedTileShape best = kMGroupedTileCandidates[0].tile;
  double best_cost = -1.0;
  for (const MGroupedTileCandidate& c : kMGroupedTileCandidates) {
    const double cost = m_grouped_tile_cost(c, m_total, n, num_groups, num_sms);
    if (cost >= 0.0 && (best_cost < 0.0 || cost < best_cost)) {
      best = c.tile;
      best_cost = cost;
    }
  }
  return best;
}

}  // namespace megatron_tma
