// Torch-free host entry point of the K-grouped (weight-gradient) FP8 GEMM.
#pragma once
#include <cuda_runtime.h>
#include "megatron_tma/common/groups_arg.h"

namespace megatron_tma {

struct KGroupedGemmArgs {
  const void* a;          // dY^T e4m3 [n, pitch] (tokens contiguous), pitch >= m_total, multiple of 16
  const float* a_scales;  // fp32 [num_blocks_max, n]
  const void* b;          // X^T e4m3 [k, pitch]
  const float* b_scales;  // fp32 [num_blocks_max, k]
  int pitch;              // row pitch of a and b in elements
  int num_blocks_max;     // rows of the scale tensors (m_total / 128 + G)
  void* d;                // [G, n, k] contiguous, fp32 or bf16
  int out_bf16, accumulate;
  int m_total, n, k;
  GroupsArg groups;
};

cudaError_t k_grouped_fp8_gemm(const KGroupedGemmArgs& args, cudaStream_t stream);
int k_grouped_fp8_gemm_max_groups();

}  // namespace megatron_tma
