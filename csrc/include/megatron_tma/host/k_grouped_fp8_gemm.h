// Torch-free host entry point of the K-grouped (weight-gradient) FP8 GEMM.
#pragma once
#include <cuda_runtime.h>
#include "megatron_tma/common/groups_arg.h"
#include "megatron_tma/scheduler/k_grouped_tile_choice.h"

namespace megatron_tma {

struct KGroupedGemmArgs {
  const void* a;          // dY^T e4m3 [n, p_tokens] (tokens contiguous, group g at columns a_g = sum round_up(M_h, 128))
  const float* a_scales;  // fp32 [num_blocks_max, n]
  const void* b;          // X^T e4m3 [k, p_tokens]
  const float* b_scales;  // fp32 [num_blocks_max, k]
  int p_tokens;           // P: columns of a and b (a multiple of 16)
  int pitch;              // row pitch of a and b in elements (a multiple of 16, >= p_tokens)
  int num_blocks_max;     // rows of the scale tensors (M_total / 128 + G)
  void* d;                // [G, n, k] contiguous, fp32 or bf16, element-aligned
  int out_bf16, accumulate;
  int n, k;
  GroupsArg groups;
  int block_m;            // output tile rows: 0 the default (k_grouped_fp8_gemm_block_m), 128, or 192 (three math
                          // warpgroups; 128 where the groups do not fit its shared memory)
};

cudaError_t k_grouped_fp8_gemm(const KGroupedGemmArgs& args, cudaStream_t stream);
int k_grouped_fp8_gemm_max_groups();
// The tile rows (128 or 192; tiles are 128 wide) a call with these arguments launches: the forced block_m, or with
// 0 the default of scheduler/k_grouped_tile_choice.h for this device's SM count; 128 where the 192-row tile's
// shared memory does not fit G's offsets. 0 for an invalid block_m.
int k_grouped_fp8_gemm_block_m(long long n, long long k, int num_groups, bool out_bf16, int block_m);

}  // namespace megatron_tma
