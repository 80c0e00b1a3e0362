// Driver for tests/test_m_grouped_schedulers.py: runs the M-grouped tile schedulers (scheduler/m_grouped_scheduler.cuh,
// one CTA per tile; scheduler/m_grouped_pair_scheduler.cuh, 2-CTA clusters) on the host. Reads cases
// "block_m n_blocks G size_0 .. size_{G-1}" from stdin; prints per case "single T" and T lines "group row_start rows
// n_block", then "pairs P" and P lines "shared group0 row_start0 rows0 group1 row_start1 rows1 n_block" (rank 0's
// row tile, then rank 1's; rows 0: none).
#include <algorithm>
#include <cstdio>
#include <vector>

// The schedulers are device code with no device-only operation: compiled here as plain C++.
#define __device__
#define __forceinline__ inline
using std::min;
#include "megatron_tma/scheduler/m_grouped_pair_scheduler.cuh"
#include "megatron_tma/scheduler/m_grouped_scheduler.cuh"

template <int BM>
void run(int n_blocks, const std::vector<int>& sizes) {
  const int G = static_cast<int>(sizes.size());
  std::vector<int> row_off(G + 1, 0), mtile_off(G + 1, 0);
  for (int g = 0; g < G; ++g) {
    row_off[g + 1] = row_off[g] + sizes[g];
    mtile_off[g + 1] = mtile_off[g] + (sizes[g] + BM - 1) / BM;
  }
  megatron_tma::MGroupedScheduler<BM> single{row_off.data(), mtile_off.data(), G, n_blocks};
  const int T = single.num_tiles();
  std::printf("single %d\n", T);
  for (int t = 0; t < T; ++t) {
    const megatron_tma::MTile x = single.get(t);
    std::printf("%d %d %d %d\n", x.group, x.row_start, x.rows, x.n_block);
  }
  const megatron_tma::MGroupedPairScheduler<BM> pairs{row_off.data(), mtile_off.data(), G, n_blocks};
  const int P = pairs.num_tiles();
  std::printf("pairs %d\n", P);
  for (int t = 0; t < P; ++t) {
    bool s0 = false, s1 = true;
    const megatron_tma::MTile a = pairs.get(t, 0, s0), b = pairs.get(t, 1, s1);
    if (s0 != s1 || a.n_block != b.n_block) {
      std::printf("ranks disagree at tile %d\n", t);
      return;
    }
    const megatron_tma::MTile o0 = pairs.own(t, 0), o1 = pairs.own(t, 1);
    if (o0.row_start != a.row_start || o0.rows != a.rows || o0.group != a.group || o1.rows != b.rows ||
        (b.rows > 0 && (o1.row_start != b.row_start || o1.group != b.group))) {
      std::printf("own() disagrees with get() at tile %d\n", t);
      return;
    }
    std::printf("%d %d %d %d %d %d %d %d\n", s0 ? 1 : 0, a.group, a.row_start, a.rows, b.group, b.row_start, b.rows,
                a.n_block);
  }
}

int main() {
  int bm, n_blocks, G;
  while (std::scanf("%d %d %d", &bm, &n_blocks, &G) == 3) {
    std::vector<int> sizes(G);
    for (int& s : sizes)
      if (std::scanf("%d", &s) != 1) return 1;
    if (bm == 128) run<128>(n_blocks, sizes);
    else if (bm == 192) run<192>(n_blocks, sizes);
    else return 1;
  }
  return 0;
}
