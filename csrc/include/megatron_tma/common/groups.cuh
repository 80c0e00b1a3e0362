// Group description shared by every kernel: a device array of sizes [G] or offsets [G+1], int32 or
// int64. Each CTA turns it into clamped int32 offsets in shared memory itself, so no kernel needs a
// preparation launch and nothing is read on the host (CUDA-graph safe: replays see new sizes).
#pragma once
#include <cstdint>
#include "megatron_tma/common/groups_arg.h"

namespace megatron_tma {


__device__ __forceinline__ long long groups_read(const GroupsArg& g, int i) {
  return g.is_int64 ? reinterpret_cast<const long long*>(g.ptr)[i]
                    : static_cast<long long>(reinterpret_cast<const int*>(g.ptr)[i]);
}

// Size of group i as given (sizes) or as a difference of offsets; negative values count as 0.
__device__ __forceinline__ int groups_size(const GroupsArg& g, int i) {
  long long s = g.is_offsets ? groups_read(g, i + 1) - groups_read(g, i) : groups_read(g, i);
  return s < 0 ? 0 : (s > 0x7fffffffLL ? 0x7fffffff : static_cast<int>(s));
}

// Block-wide exclusive scan of per-group counts into s_out[0..G]; s_out[G] is the total.
// `count(i)` maps group i to its count (rows, tiles, token blocks...). Every thread of the block must
// call it; it ends with __syncthreads(). Totals are clamped to `limit` so that malformed sizes (sum
// above M_total) can never address memory outside the tensors: a group past the limit becomes empty.
template <typename CountFn>
__device__ void block_exclusive_scan(int G, CountFn count, int* s_out, int limit, int* s_warp_sums) {
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int per_thread = (G + nthreads - 1) / nthreads;
  const int begin = min(G, tid * per_thread), end = min(G, begin + per_thread);
  long long local = 0;
  for (int i = begin; i < end; ++i) local += count(i);
  // inclusive scan of `local` over the block: warp shuffle, then across warps
  long long v = local;
  const int lane = tid & 31, warp = tid >> 5, nwarps = (nthreads + 31) >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    long long o = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += o;
  }
  long long* warp_sums = reinterpret_cast<long long*>(s_warp_sums);  // needs 32 * 8 bytes
  if (lane == 31 || tid == nthreads - 1) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    long long w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      long long o = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += o;
    }
    if (lane < nwarps) warp_sums[lane] = w;
  }
  __syncthreads();
  long long run = v - local + (warp > 0 ? warp_sums[warp - 1] : 0);  // exclusive prefix of this thread
  for (int i = begin; i < end; ++i) {
    s_out[i] = static_cast<int>(run < limit ? run : limit);
    run += count(i);
  }
  if (tid == nthreads - 1) s_out[G] = static_cast<int>(run < limit ? run : limit);
  __syncthreads();
}

}  // namespace megatron_tma
