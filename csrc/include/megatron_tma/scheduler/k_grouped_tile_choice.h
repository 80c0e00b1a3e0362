// The K-grouped GEMM's default output tile rows (192 or 128; every tile is 128 columns wide), chosen on the host
// from what it knows without reading the groups (N, K, G, the output kind and the number of SMs): no sync, so
// the choice is CUDA-graph safe. Plain C++ (no CUDA, no torch), so that tests/test_k_grouped_tile_choice.py can
// compile and check it on a CPU machine.
//
// The model is the M-grouped one (m_grouped_tile_choice.h) with the tile count exact: the output [G, N, K] has
// G * ceil(N / BLOCK_M) * ceil(K / 128) tiles whatever the group sizes (a group's tokens are its reduction
// dimension). A persistent grid runs ceil(tiles / SMs) rounds, so
//     time ~ ceil(tiles / num_sms) * BLOCK_M / rate,
// where rate is the 192-row tile's measured throughput relative to 128 x 128 on full rounds. The round count
// is what gives small problems (one round or a few) the 128-row tiles: one round of 192-row tiles is slower
// than one round of 128-row tiles, and rows past N in the last row block are paid for.
//
// The 192-row tile (three math warpgroups) keeps per-group token offsets in shared memory beside four
// pipeline stages, so it takes at most max_groups_192 groups (the kernel config's kTileMaxGroups); beyond
// that the 128-row tile runs.
//
// Rates, from the grid at 92cd967 (benchmarks/results/k_grouped-20261203-1954.json, ours / ours_m192 on all 30
// rows of each output kind, medians): BF16 out x1.13 (x1.08-1.16), FP32 accumulate x1.05 (x0.99-1.09: its
// main_grad read and write make the small-group rows memory-bound, so the faster tile helps less there). The
// FP32 output without accumulate has no column in the grid; it takes the FP32-accumulate rate.
#pragma once

namespace megatron_tma {

constexpr double kK192RateBf16 = 1.13;
constexpr double kK192RateF32 = 1.05;

// Modelled time of one tile height (arbitrary units).
inline double k_grouped_tile_cost(int block_m, double rate, long long n, long long k, long long num_groups,
                                  int num_sms) {
  const long long tiles = num_groups * ((n + block_m - 1) / block_m) * ((k + 127) / 128);
  long long rounds = (tiles + num_sms - 1) / num_sms;
  if (rounds < 1) rounds = 1;
  return static_cast<double>(rounds) * block_m / rate;
}

// block_m: 0 for the default (the cheaper tile by the model; 128 on equal cost), or 128 / 192 to force one (192
// falls back to 128 beyond max_groups_192 groups).
inline int choose_k_grouped_block_m(int block_m, long long n, long long k, long long num_groups, bool out_bf16,
                                    int num_sms, long long max_groups_192) {
  if (num_groups > max_groups_192 || block_m == 128) return 128;
  if (block_m == 192) return 192;
  const double rate = out_bf16 ? kK192RateBf16 : kK192RateF32;
  return k_grouped_tile_cost(192, rate, n, k, num_groups, num_sms) <
                 k_grouped_tile_cost(128, 1.0, n, k, num_groups, num_sms)
             ? 192
             : 128;
}

}  // namespace megatron_tma
