// Torch-free host entry point of the M-grouped FP8 GEMM (csrc/instantiations/m_grouped_fp8_gemm.cu).
#pragma once
#include <cuda_runtime.h>
#include "megatron_tma/common/groups_arg.h"
#include "megatron_tma/scheduler/m_grouped_tile_choice.h"

namespace megatron_tma {

struct MGroupedGemmArgs {
  const void* a;          // e4m3 [m_total, k], row-major, 16 B aligned
  const float* a_scales;  // fp32 storage [k/128, a_scales_ld] (M contiguous): scale of row m, block kb at [kb*ld + m]
  int a_scales_ld;        // >= m_total, multiple of 4
  const void* b;          // e4m3 [num_groups, n, k]
  const float* b_scales;  // fp32 [num_groups, ceil(n/128), k/128]
  void* d;                // bf16 [m_total, n] with row stride d_ld (elements)
  int d_ld;
  int m_total, n, k;
  GroupsArg groups;       // device sizes [G] or offsets [G+1]
  int block_m;            // tile height: 128 (two math warpgroups, any block_n), 192 (three math warpgroups,
                          // block_n 0 or 128), or 0 with block_n 0: the default (m_grouped_fp8_gemm_tile)
  int block_n;            // tile width: 0 (128, or the default with block_m 0), 128, 192 or 256 (the last two
                          // with block_m 128)
};

// Validates geometry it can see (returns cudaErrorInvalidValue with nothing launched) and launches on `stream`.
// No host synchronisation, no device reads: safe under CUDA-graph capture.
cudaError_t m_grouped_fp8_gemm(const MGroupedGemmArgs& args, cudaStream_t stream);

// The tile a call with these arguments launches: the explicit block_m/block_n, or with (0, 0) the default of
// scheduler/m_grouped_tile_choice.h for this device's SM count; 128 x 128 where the tile's shared memory does
// not fit beside G groups' offsets. {0, 0} for an invalid block_m/block_n.
MGroupedTileShape m_grouped_fp8_gemm_tile(long long m_total, long long n, int num_groups, int block_m, int block_n);

// Largest G the kernel accepts (group offsets live in shared memory).
int m_grouped_fp8_gemm_max_groups();

}  // namespace megatron_tma
