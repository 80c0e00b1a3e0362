// Host launchers of the padded-path gather kernels (kernels/pad_gather.cuh).
#include <climits>

#include "megatron_tma/host/pad_gather.h"
#include "megatron_tma/kernels/pad_gather.cuh"

namespace megatron_tma {
namespace {

using namespace pad_gather;

// Tile height: a power of two >= 32 rows (whole warps of scale stores), grown while a tile stays under
// kTileBytes, so short rows still give each CTA enough bytes per tile to amortise its two barriers.
int log2_tile_rows(int64_t row_bytes) {
  int log2 = kLog2MinTileRows;
  while ((1 << (log2 + 1)) <= kMaxTileRows && (int64_t(2) << log2) * row_bytes <= kTileBytes) ++log2;
  return log2;
}

static_assert(kPadGatherMaxRows <= INT_MAX - kMaxTileRows, "row counts must stay int after tile rounding");

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

bool groups_ok(const GroupsArg& g) {
  return g.ptr != nullptr && g.num_groups >= 1 && g.num_groups <= kPadGatherMaxGroups;
}

// Persistent grid: kMinBlocksPerSm CTAs per SM (what the launch bounds fit; with many groups shared memory
// may fit fewer, and the rest simply run as a second wave), never more than there are tiles, and at least
// one: CTA 0 also writes the padded offsets when there is no row. Raises the dynamic shared-memory limit
// when many groups need it. Only attribute calls, no stream work: capture safe.
template <typename Kernel>
cudaError_t launch_config(Kernel kernel, int smem, int64_t num_tiles, int* grid) {
  cudaError_t err;
  int dev = 0, sms = 0;
  if ((err = cudaGetDevice(&dev)) != cudaSuccess) return err;
  if (smem > 48 * 1024) {
    int optin = 0;
    if ((err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess)
      return err;
    if (smem > optin) return cudaErrorInvalidValue;
    if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess)
      return err;
  }
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return err;
  const int64_t resident = int64_t(sms) * kMinBlocksPerSm;
  *grid = static_cast<int>(num_tiles < 1 ? 1 : (num_tiles < resident ? num_tiles : resident));
  return cudaSuccess;
}

}  // namespace

cudaError_t pad_rows_fp8(const void* a, const float* a_scales, int64_t scales_ld, void* a_pad, float* a_scales_pad,
                         int32_t* padded_offsets, GroupsArg groups, int64_t m, int64_t m_pad, int64_t k,
                         int64_t align, cudaStream_t stream) {
  const int64_t scale_blocks = (k + 127) / 128;
  if (!groups_ok(groups) || m < 0 || k < 0 || k > INT_MAX || k % 16 != 0 || align < 1 || align > INT_MAX ||
      m_pad < padded_rows_upper_bound(m, groups.num_groups, align) || m_pad > kPadGatherMaxRows ||
      (scale_blocks > 1 && (scales_ld < m || scales_ld > INT_MAX)) || (m > 0 && k > 0 && !aligned16(a)) ||
      (m_pad > 0 && k > 0 && !aligned16(a_pad)))
    return cudaErrorInvalidValue;

  PadParams p;
  p.a = static_cast<const uint8_t*>(a);
  p.a_scales = a_scales;
  p.a_pad = static_cast<uint8_t*>(a_pad);
  p.a_scales_pad = a_scales_pad;
  p.padded_offsets = padded_offsets;
  p.groups = groups;
  p.m = static_cast<int>(m);
  p.m_pad = static_cast<int>(m_pad);
  p.k = static_cast<int>(k);
  p.scales_ld = static_cast<int>(scale_blocks > 1 ? scales_ld : 0);
  p.align = static_cast<int>(align);
  p.log2_tile_rows = log2_tile_rows(k);

  const int smem = smem_bytes(groups.num_groups, 1 << p.log2_tile_rows);
  const int64_t num_tiles = (m_pad + (1 << p.log2_tile_rows) - 1) >> p.log2_tile_rows;
  int grid = 0;
  cudaError_t err = launch_config(pad_rows_fp8_kernel, smem, num_tiles, &grid);
  if (err != cudaSuccess) return err;
  pad_rows_fp8_kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t unpad_rows_bf16(const void* y_pad, int64_t y_pad_rows, GroupsArg groups, const int32_t* padded_offsets,
                            void* out, int64_t m, int64_t n, cudaStream_t stream) {
  if (!groups_ok(groups) || m < 0 || m > kPadGatherMaxRows || y_pad_rows < 0 || y_pad_rows > kPadGatherMaxRows ||
      n < 8 || n % 8 != 0 || n > INT_MAX / 2 || !aligned16(out) || !aligned16(y_pad))
    return cudaErrorInvalidValue;
  if (m == 0) return cudaSuccess;  // nothing to write

  UnpadParams p;
  p.y_pad = static_cast<const uint8_t*>(y_pad);
  p.out = static_cast<uint8_t*>(out);
  p.groups = groups;
  p.padded = GroupsArg{padded_offsets, groups.num_groups, /*is_int64=*/0, /*is_offsets=*/1};
  p.m = static_cast<int>(m);
  p.y_pad_rows = static_cast<int>(y_pad_rows);
  p.row_bytes = static_cast<int>(n * 2);
  p.log2_tile_rows = log2_tile_rows(n * 2);

  const int smem = smem_bytes(groups.num_groups, 1 << p.log2_tile_rows);
  const int64_t num_tiles = (m + (1 << p.log2_tile_rows) - 1) >> p.log2_tile_rows;
  int grid = 0;
  cudaError_t err = launch_config(unpad_rows_kernel, smem, num_tiles, &grid);
  if (err != cudaSuccess) return err;
  unpad_rows_kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace megatron_tma
