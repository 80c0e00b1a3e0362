// Host launcher and instances of the MoE un-permutation (kernels/combine_rows.cuh): the common top-k values get a
// kernel whose k loads are unrolled; any other k up to kCombineMaxRowsPerToken runs the generic loop.
#include <climits>

#include "megatron_tma/common/launch.h"
#include "megatron_tma/host/combine_rows.h"
#include "megatron_tma/kernels/combine_rows.cuh"

namespace megatron_tma {

static_assert(kCombineMaxRowsPerToken == combine::kMaxK, "host and kernel limits differ");

cudaError_t combine_rows_bf16(const void* y, int64_t y_rows, const int32_t* token_rows, int64_t tokens, int64_t k,
                              int64_t h, void* out, cudaStream_t stream) {
  using namespace combine;
  if (tokens < 0 || h < 0 || h % 8 != 0 || k < 1 || k > kMaxK || y_rows < 0 || y_rows > INT_MAX ||
      tokens > INT64_MAX / kMaxK)
    return cudaErrorInvalidValue;
  if (tokens == 0 || h == 0) return cudaSuccess;
  if (y_rows < 1 || token_rows == nullptr || reinterpret_cast<uintptr_t>(y) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out) % 16 != 0)
    return cudaErrorInvalidValue;
  CombineParams p;
  p.y = static_cast<const uint16_t*>(y);
  p.token_rows = token_rows;
  p.out = static_cast<uint16_t*>(out);
  p.tokens = tokens;
  p.chunks = h / 8;
  p.y_rows = static_cast<int>(y_rows);
  p.k = static_cast<int>(k);
  // Grid-stride: enough CTAs to fill every SM several times over, never more than there are chunks.
  const int sms = sm_count();
  if (sms < 1) return cudaErrorInvalidDevice;  // the device query failed
  const int64_t blocks_needed = (tokens * p.chunks + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(sms) * 8;
  const int grid = static_cast<int>(blocks_needed < cap ? blocks_needed : cap);
  switch (k) {
    case 1: combine_rows_kernel<1><<<grid, kThreads, 0, stream>>>(p); break;
    case 2: combine_rows_kernel<2><<<grid, kThreads, 0, stream>>>(p); break;
    case 4: combine_rows_kernel<4><<<grid, kThreads, 0, stream>>>(p); break;
    case 6: combine_rows_kernel<6><<<grid, kThreads, 0, stream>>>(p); break;
    case 8: combine_rows_kernel<8><<<grid, kThreads, 0, stream>>>(p); break;
    default: combine_rows_kernel<0><<<grid, kThreads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

}  // namespace megatron_tma
