// Host launcher and instantiation of the M-grouped FP8 GEMM kernel (kernels/m_grouped_fp8_gemm.cuh).
#include "megatron_tma/common/launch.h"
#include "megatron_tma/host/m_grouped_fp8_gemm.h"
#include "megatron_tma/kernels/m_grouped_fp8_gemm.cuh"
#include "megatron_tma/scheduler/m_grouped_tile_choice.h"

namespace megatron_tma {
namespace {

using ConfigN128 = MGroupedGemmConfig</*BLOCK_N=*/128, /*STAGES=*/5>;
using ConfigN192 = MGroupedGemmConfig</*BLOCK_N=*/192, /*STAGES=*/4>;
using ConfigM192 = MGroupedGemmConfig</*BLOCK_N=*/128, /*STAGES=*/4, /*MATH_WG=*/3>;  // 192 x 128 tiles
using ConfigN256 = MGroupedGemmConfig</*BLOCK_N=*/256, /*STAGES=*/3>;
constexpr int kMaxSmem = 232448;  // sm_90 dynamic shared memory per block

}  // namespace

int m_grouped_fp8_gemm_max_groups() { return ConfigN128::kMaxGroups; }

template <class Config>
cudaError_t launch(const MGroupedGemmArgs& args, cudaStream_t stream);

// Tiles, all giving the same bits: 128 x 128 (two math warpgroups, two partial fragments each: promotion
// overlapped with the next K block), 192 x 128 (three math warpgroups, serial promotion hidden behind the other
// two), 128 x 192 (two warpgroups, serial: DeepGEMM's scheme) and, for comparison only, 128 x 256 (two halves).
// (0, 0) is the default of scheduler/m_grouped_tile_choice.h. A tile whose shared memory does not fit beside the
// group table (thousands of groups) falls back to 128 x 128. {0, 0} for an invalid request.
MGroupedTileShape m_grouped_fp8_gemm_tile(long long m_total, long long n, int num_groups, int block_m, int block_n) {
  if ((block_m != 0 && block_m != 128 && block_m != 192) ||
      (block_n != 0 && block_n != 128 && block_n != 192 && block_n != 256) ||
      (block_m == 192 && block_n != 0 && block_n != 128))
    return {0, 0};
  const int num_sms = sm_count();
  MGroupedTileShape t{block_m == 0 ? 128 : block_m, block_n == 0 ? 128 : block_n};
  if (block_m == 0 && block_n == 0) t = choose_m_grouped_tile(m_total, n, num_groups, num_sms);
  const bool fits = t.block_m == 192   ? ConfigM192::smem_bytes(num_groups) <= kMaxSmem
                    : t.block_n == 192 ? ConfigN192::smem_bytes(num_groups) <= kMaxSmem
                    : t.block_n == 256 ? ConfigN256::smem_bytes(num_groups) <= kMaxSmem
                                       : true;
  return fits ? t : MGroupedTileShape{128, 128};
}

cudaError_t m_grouped_fp8_gemm(const MGroupedGemmArgs& args, cudaStream_t stream) {
  const MGroupedTileShape t =
      m_grouped_fp8_gemm_tile(args.m_total, args.n, args.groups.num_groups, args.block_m, args.block_n);
  if (t.block_m == 192) return launch<ConfigM192>(args, stream);
  if (t.block_n == 192) return launch<ConfigN192>(args, stream);
  if (t.block_n == 256) return launch<ConfigN256>(args, stream);
  if (t.block_n == 128) return launch<ConfigN128>(args, stream);
  return cudaErrorInvalidValue;
}

template <class Config>
cudaError_t launch(const MGroupedGemmArgs& args, cudaStream_t stream) {
  const int G = args.groups.num_groups;
  if (args.k <= 0 || args.k % Config::BLOCK_K != 0 || args.n <= 0 || args.n % 16 != 0 || G < 1 ||
      G > Config::kMaxGroups || args.m_total < 0 || args.a_scales_ld < args.m_total || args.a_scales_ld % 4 != 0 ||
      args.d_ld < args.n || args.d_ld % 8 != 0)
    return cudaErrorInvalidValue;
  if (args.m_total == 0) return cudaSuccess;  // nothing to write

  MGroupedGemmParams p{};
  cudaError_t err;
  {
    const uint64_t dims[2] = {(uint64_t)args.k, (uint64_t)args.m_total};
    const uint64_t strides[1] = {(uint64_t)args.k};
    const uint32_t box[2] = {Config::BLOCK_K, Config::BLOCK_M};
    if ((err = encode_tma(&p.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, args.a, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_128B)) != cudaSuccess)
      return err;
  }
  {
    const uint64_t dims[3] = {(uint64_t)args.k, (uint64_t)args.n, (uint64_t)G};
    const uint64_t strides[2] = {(uint64_t)args.k, (uint64_t)args.n * args.k};
    const uint32_t box[3] = {Config::BLOCK_K, Config::B_BOX_N, 1};  // half the tile in 2-CTA clusters
    if ((err = encode_tma(&p.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, args.b, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_128B)) != cudaSuccess)
      return err;
  }
  {
    const uint64_t dims[2] = {(uint64_t)args.m_total, (uint64_t)(args.k / 128)};
    const uint64_t strides[1] = {(uint64_t)args.a_scales_ld * 4};
    const uint32_t box[2] = {Config::SA_BOX, 1};
    if ((err = encode_tma(&p.a_scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, args.a_scales, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_NONE)) != cudaSuccess)
      return err;
  }
  for (int k = 0; k < kStorePoolSize; ++k) {
    const uint64_t dims[2] = {(uint64_t)args.n, (uint64_t)args.m_total};
    const uint64_t strides[1] = {(uint64_t)args.d_ld * 2};
    const uint32_t box[2] = {64, 1u << k};
    if ((err = encode_tma(&p.d_pool[k], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, args.d, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_128B)) != cudaSuccess)
      return err;
  }
  p.b_scales = args.b_scales;
  p.groups = args.groups;
  p.m_total = args.m_total;
  p.n = args.n;
  p.k = args.k;

  auto kernel = m_grouped_fp8_gemm_kernel<Config>;
  const size_t smem = Config::smem_bytes(G);
  if ((err = ensure_smem_limit<Config>(kernel, smem)) != cudaSuccess) return err;
  const int num_sms = sm_count();
  // Real tiles are known only on the device; launch one CTA per SM, capped by the upper bound on tiles (in
  // clusters: on pairs of row tiles, two CTAs each).
  const long long n_blocks = (args.n + Config::BLOCK_N - 1) / Config::BLOCK_N;
  const long long row_tiles = static_cast<long long>(args.m_total) / Config::BLOCK_M + G;  // >= sum ceil(M_g / BM)
  const long long max_ctas =
      (Config::kCluster == 1 ? row_tiles : (row_tiles + 1) / 2 * Config::kCluster) * n_blocks;
  if constexpr (Config::kCluster == 1) {
    const int grid = static_cast<int>(max_ctas < num_sms ? max_ctas : num_sms);
    kernel<<<grid, Config::kThreads, smem, stream>>>(p);
    return cudaGetLastError();
  } else {
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = Config::kCluster;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg{};
    cfg.blockDim = dim3(Config::kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &cluster;
    cfg.numAttrs = 1;
    // A persistent grid must be resident at once: a cluster that waited for a free pair of SMs in one GPC would
    // start its share of the tiles only when another had finished all of its own. So no more clusters than fit.
    static std::atomic<int> resident[kMaxDevices] = {};
    const int dev = current_device();
    int clusters = dev < kMaxDevices ? resident[dev].load(std::memory_order_relaxed) : 0;
    if (clusters == 0) {
      cfg.gridDim = dim3(num_sms / Config::kCluster * Config::kCluster);
      const cudaError_t pending = cudaPeekAtLastError();
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0) {
        if (dev < kMaxDevices) resident[dev].store(clusters, std::memory_order_relaxed);
      } else {  // one cluster per SM pair, this call only; clear the query's error, not one the caller has yet to see
        if (pending == cudaSuccess) cudaGetLastError();
        clusters = num_sms / Config::kCluster;
      }
    }
    const long long cap = static_cast<long long>(clusters) * Config::kCluster;
    cfg.gridDim = dim3(static_cast<unsigned>(max_ctas < cap ? max_ctas : cap));
    return cudaLaunchKernelEx(&cfg, kernel, p);
  }
}

}  // namespace megatron_tma
