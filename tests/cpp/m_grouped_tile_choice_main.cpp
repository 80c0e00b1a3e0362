// Driver for tests/test_m_grouped_tile_choice.py: reads "m_total n num_groups num_sms" lines from stdin and
// prints "block_m block_n" per line, as scheduler/m_grouped_tile_choice.h chooses them.
#include <cstdio>

#include "megatron_tma/scheduler/m_grouped_tile_choice.h"

int main() {
  long long m, n, g;
  int sms;
  while (std::scanf("%lld %lld %lld %d", &m, &n, &g, &sms) == 4) {
    const megatron_tma::MGroupedTileShape t = megatron_tma::choose_m_grouped_tile(m, n, g, sms);
    std::printf("%d %d\n", t.block_m, t.block_n);
  }
  return 0;
}
