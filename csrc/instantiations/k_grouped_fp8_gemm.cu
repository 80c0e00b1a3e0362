// Host launcher and instantiations of the K-grouped FP8 GEMM kernel (kernels/k_grouped_fp8_gemm.cuh): one
// kernel, instantiated per output kind (BF16, FP32, FP32 accumulate) and tile (128 x 128 with two math
// warpgroups, 192 x 128 with three).
#include "megatron_tma/common/launch.h"
#include "megatron_tma/host/k_grouped_fp8_gemm.h"
#include "megatron_tma/kernels/k_grouped_fp8_gemm.cuh"

namespace megatron_tma {
namespace {

cudaError_t encode_token_major(CUtensorMap* map, const void* base, int p_tokens, int rows, int pitch, int box_rows) {
  const uint64_t dims[2] = {(uint64_t)p_tokens, (uint64_t)rows};
  const uint64_t strides[1] = {(uint64_t)pitch};
  const uint32_t box[2] = {128, (uint32_t)box_rows};  // one 128-token block (one line per row) of a tile's rows
  return encode_tma(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

cudaError_t encode_block_scales(CUtensorMap* map, const float* base, int cols, int rows, int box_cols) {
  const uint64_t dims[2] = {(uint64_t)cols, (uint64_t)rows};
  const uint64_t strides[1] = {(uint64_t)cols * 4};
  const uint32_t box[2] = {(uint32_t)box_cols, 1};
  return encode_tma(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
}

template <KGroupedOut kOut, int kMathWarpgroups>
cudaError_t launch(const KGroupedGemmParams& p, cudaStream_t stream) {
  using Config = KGroupedGemmConfig<kOut, kMathWarpgroups>;
  auto kernel = k_grouped_fp8_gemm_kernel<Config>;
  const size_t smem = Config::smem_bytes(p.groups.num_groups);
  cudaError_t err;
  if ((err = ensure_smem_limit<Config>(kernel, smem)) != cudaSuccess) return err;
  const int num_sms = sm_count();
  const long long tiles =
      static_cast<long long>(p.groups.num_groups) * ((p.n + Config::BLOCK_M - 1) / Config::BLOCK_M) *
      ((p.k + Config::BLOCK_N - 1) / Config::BLOCK_N);
  const int grid = static_cast<int>(tiles < num_sms ? tiles : num_sms);
  kernel<<<grid, Config::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <KGroupedOut kOut>
cudaError_t launch(const KGroupedGemmParams& p, int math_warpgroups, cudaStream_t stream) {
  return math_warpgroups == 3 ? launch<kOut, 3>(p, stream) : launch<kOut, 2>(p, stream);
}

}  // namespace

int k_grouped_fp8_gemm_max_groups() { return KGroupedGemmConfig<KGroupedOut::kBf16>::kMaxGroups; }

int k_grouped_fp8_gemm_block_m(long long n, long long k, int num_groups, bool out_bf16, int block_m) {
  if (block_m != 0 && block_m != 128 && block_m != 192) return 0;
  const int max_groups_192 = out_bf16 ? KGroupedGemmConfig<KGroupedOut::kBf16, 3>::kTileMaxGroups
                                      : KGroupedGemmConfig<KGroupedOut::kF32, 3>::kTileMaxGroups;
  return choose_k_grouped_block_m(block_m, n, k, num_groups, out_bf16, sm_count(), max_groups_192);
}

cudaError_t k_grouped_fp8_gemm(const KGroupedGemmArgs& args, cudaStream_t stream) {
  const int G = args.groups.num_groups;
  if (G < 1 || G > k_grouped_fp8_gemm_max_groups() || args.n <= 0 || args.n % 16 != 0 || args.k <= 0 ||
      args.k % 16 != 0 || args.p_tokens < 16 || args.p_tokens % 16 != 0 || args.pitch < args.p_tokens ||
      args.pitch % 16 != 0 || args.num_blocks_max < G || (args.accumulate && args.out_bf16) ||
      (args.block_m != 0 && args.block_m != 128 && args.block_m != 192))
    return cudaErrorInvalidValue;
  KGroupedGemmParams p{};
  cudaError_t err;
  // One block per TMA box: the tile's rows of dY^T and of X^T (its output columns), and their scales.
  const int mwg = k_grouped_fp8_gemm_block_m(args.n, args.k, G, args.out_bf16, args.block_m) == 192 ? 3 : 2;
  const int box_m = mwg == 3 ? KGroupedGemmConfig<KGroupedOut::kF32, 3>::BLOCK_M
                              : KGroupedGemmConfig<KGroupedOut::kF32, 2>::BLOCK_M;
  const int box_n = args.out_bf16 ? KGroupedGemmConfig<KGroupedOut::kBf16>::BLOCK_N
                                  : KGroupedGemmConfig<KGroupedOut::kF32>::BLOCK_N;
  if ((err = encode_token_major(&p.a, args.a, args.p_tokens, args.n, args.pitch, box_m)) != cudaSuccess) return err;
  if ((err = encode_token_major(&p.b, args.b, args.p_tokens, args.k, args.pitch, box_n)) != cudaSuccess) return err;
  if ((err = encode_block_scales(&p.a_scales, args.a_scales, args.n, args.num_blocks_max, box_m)) != cudaSuccess)
    return err;
  if ((err = encode_block_scales(&p.b_scales, args.b_scales, args.k, args.num_blocks_max, box_n)) != cudaSuccess)
    return err;
  p.d = args.d;
  p.groups = args.groups;
  p.p_tokens = args.p_tokens;
  p.num_blocks_max = args.num_blocks_max;
  p.n = args.n;
  p.k = args.k;
  // A 16-byte aligned D (K % 16 == 0 makes every row as aligned as D's start) leaves through the staging tile and
  // TMA stores, a box being one 128-byte swizzle row wide; otherwise the math threads store from registers.
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
  if (args.out_bf16) return launch<KGroupedOut::kBf16>(p, mwg, stream);
  if (args.accumulate) return launch<KGroupedOut::kF32Accumulate>(p, mwg, stream);
  return launch<KGroupedOut::kF32>(p, mwg, stream);
}

}  // namespace megatron_tma
