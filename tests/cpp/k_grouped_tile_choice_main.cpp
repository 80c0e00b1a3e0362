// Driver for tests/test_k_grouped_tile_choice.py: reads "block_m n k num_groups out_bf16 num_sms max_groups_192"
// lines from stdin and prints the tile rows per line, as scheduler/k_grouped_tile_choice.h chooses them.
#include <cstdio>

#include "megatron_tma/scheduler/k_grouped_tile_choice.h"

int main() {
  long long n, k, g, max_g;
  int block_m, bf16, sms;
  while (std::scanf("%d %lld %lld %lld %d %d %lld", &block_m, &n, &k, &g, &bf16, &sms, &max_g) == 7)
    std::printf("%d\n", megatron_tma::choose_k_grouped_block_m(block_m, n, k, g, bf16 != 0, sms, max_g));
  return 0;
}
