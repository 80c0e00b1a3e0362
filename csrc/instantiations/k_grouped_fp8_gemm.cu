// Host launcher and instantiation of the K-grouped FP8 GEMM kernel (kernels/k_grouped_fp8_gemm.cuh).
#include "megatron_tma/common/launch.h"
#include "megatron_tma/host/k_grouped_fp8_gemm.h"
#include "megatron_tma/kernels/k_grouped_aligned_fp8_gemm.cuh"
#include "megatron_tma/kernels/k_grouped_fp8_gemm.cuh"

#include <cstdlib>

namespace megatron_tma {
namespace {
using Config = KGroupedGemmConfig</*STAGES=*/3>;
using AlignedConfig = KGroupedAlignedConfig</*STAGES=*/5>;

cudaError_t encode_token_major(CUtensorMap* map, const void* base, int m_total, int rows, int pitch) {
  const uint64_t dims[2] = {(uint64_t)m_total, (uint64_t)rows};
  const uint64_t strides[1] = {(uint64_t)pitch};
  const uint32_t box[2] = {128, 128};  // one aligned 128-token chunk of 128 rows (realigned in shared memory)
  return encode_tma(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

cudaError_t encode_block_scales(CUtensorMap* map, const float* base, int cols, int rows) {
  const uint64_t dims[2] = {(uint64_t)cols, (uint64_t)rows};
  const uint64_t strides[1] = {(uint64_t)cols * 4};
  const uint32_t box[2] = {128, 1};
  return encode_tma(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
}
// EXPERIMENT (issue 4): MEGATRON_TMA_KGROUPED_ALIGNED16=1 runs kernels/k_grouped_aligned_fp8_gemm.cuh for BF16
// outputs. It is only correct when every group starts at a multiple of 16 tokens, which nothing here checks:
// DESIGN.md's layout does not promise it (benchmarks/kgrouped_aligned_bound.py and the aligned GPU test set it up).
bool aligned16_requested() {
  const char* e = std::getenv("MEGATRON_TMA_KGROUPED_ALIGNED16");
  return e != nullptr && e[0] == '1';
}

cudaError_t launch_aligned16(const KGroupedGemmArgs& args, cudaStream_t stream) {
  const int G = args.groups.num_groups;
  KGroupedAlignedParams p{};
  cudaError_t err;
  if ((err = encode_token_major(&p.a, args.a, args.m_total, args.n, args.pitch)) != cudaSuccess) return err;
  if ((err = encode_token_major(&p.b, args.b, args.m_total, args.k, args.pitch)) != cudaSuccess) return err;
  if ((err = encode_block_scales(&p.a_scales, args.a_scales, args.n, args.num_blocks_max)) != cudaSuccess) return err;
  if ((err = encode_block_scales(&p.b_scales, args.b_scales, args.k, args.num_blocks_max)) != cudaSuccess) return err;
  for (int k = 0; k < kAlignedStorePool; ++k) {
    const uint64_t dims[3] = {(uint64_t)args.k, (uint64_t)args.n, (uint64_t)G};
    const uint64_t strides[2] = {(uint64_t)args.k * 2, (uint64_t)args.n * args.k * 2};
    const uint32_t box[3] = {64, 1u << k, 1};
    if ((err = encode_tma(&p.d_pool[k], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, args.d, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_128B)) != cudaSuccess)
      return err;
  }
  p.groups = args.groups;
  p.m_total = args.m_total;
  p.n = args.n;
  p.k = args.k;
  auto kernel = k_grouped_aligned_fp8_gemm_kernel<AlignedConfig>;
  const size_t smem = AlignedConfig::smem_bytes(G);
  if ((err = ensure_smem_limit<AlignedConfig>(kernel, smem)) != cudaSuccess) return err;
  static const int num_sms = sm_count();
  const long long tiles = static_cast<long long>(G) * ((args.n + 127) / 128) * ((args.k + 127) / 128);
  const int grid = static_cast<int>(tiles < num_sms ? tiles : num_sms);
  kernel<<<grid, AlignedConfig::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}
}  // namespace

int k_grouped_fp8_gemm_max_groups() { return Config::kMaxGroups; }

cudaError_t k_grouped_fp8_gemm(const KGroupedGemmArgs& args, cudaStream_t stream) {
  const int G = args.groups.num_groups;
  if (G < 1 || G > Config::kMaxGroups || args.n <= 0 || args.n % 16 != 0 || args.k <= 0 || args.k % 16 != 0 ||
      args.m_total <= 0 || args.pitch < args.m_total || args.pitch % 16 != 0 ||
      (args.accumulate && args.out_bf16))
    return cudaErrorInvalidValue;
  if (args.out_bf16 && !args.accumulate && reinterpret_cast<uintptr_t>(args.d) % 16 == 0 &&
      G <= AlignedConfig::kMaxGroups && aligned16_requested())
    return launch_aligned16(args, stream);
  KGroupedGemmParams p{};
  cudaError_t err;
  // (m_total == 0 is the caller's: the output is zeros or C, and TMA cannot describe an empty tensor.)
  if ((err = encode_token_major(&p.a, args.a, args.m_total, args.n, args.pitch)) != cudaSuccess) return err;
  if ((err = encode_token_major(&p.b, args.b, args.m_total, args.k, args.pitch)) != cudaSuccess) return err;
  if ((err = encode_block_scales(&p.a_scales, args.a_scales, args.n, args.num_blocks_max)) != cudaSuccess) return err;
  if ((err = encode_block_scales(&p.b_scales, args.b_scales, args.k, args.num_blocks_max)) != cudaSuccess) return err;
  p.d = args.d;
  p.groups = args.groups;
  p.m_total = args.m_total;
  p.n = args.n;
  p.k = args.k;
  p.accumulate = args.accumulate;
  p.out_bf16 = args.out_bf16;
  // Tiles leave through shared memory and TMA stores, and C (when accumulating) comes in by TMA, when D is
  // 16-byte aligned (K % 16 == 0, checked above, makes the row pitch a multiple of 16 bytes, as TMA needs);
  // otherwise the math threads move them from registers. A box is one 128-byte swizzle row wide.
  if (reinterpret_cast<uintptr_t>(args.d) % 16 == 0) {
    const uint64_t elem = args.out_bf16 ? 2 : 4;
    const uint64_t dims[3] = {(uint64_t)args.k, (uint64_t)args.n, (uint64_t)G};
    const uint64_t strides[2] = {(uint64_t)args.k * elem, (uint64_t)args.n * args.k * elem};
    const uint32_t box[3] = {static_cast<uint32_t>(128 / elem), 64, 1};
    if ((err = encode_tma(&p.d_tma, args.out_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                          3, args.d, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B)) != cudaSuccess)
      return err;
    p.tma_out = 1;
  }

  auto kernel = k_grouped_fp8_gemm_kernel<Config>;
  const size_t smem = Config::smem_bytes(G);
  if ((err = ensure_smem_limit<Config>(kernel, smem)) != cudaSuccess) return err;
  static const int num_sms = sm_count();
  const long long tiles = static_cast<long long>(G) * ((args.n + 127) / 128) * ((args.k + 127) / 128);
  const int grid = static_cast<int>(tiles < num_sms ? tiles : num_sms);
  kernel<<<grid, Config::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace megatron_tma
