// Host launchers of the fused activation-times-probs kernels (kernels/activation.cuh).
#include <climits>

#include "megatron_tma/host/activation.h"
#include "megatron_tma/kernels/activation.cuh"

namespace megatron_tma {
namespace {

using namespace activation;

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

bool geometry_ok(int act, int64_t rows, int64_t f) {
  return act >= 0 && act < kNumActivations && rows >= 0 && f > 0 && f % kVec == 0 && f <= INT_MAX / 2;
}

// Enough CTAs to fill the GPU once, never more than the work.
cudaError_t grid_for(int ctas_per_sm, int64_t work, int* grid) {
  cudaError_t err;
  int dev = 0, sms = 0;
  if ((err = cudaGetDevice(&dev)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return err;
  const int64_t resident = int64_t(sms) * ctas_per_sm;
  *grid = static_cast<int>(work < resident ? work : resident);
  return cudaSuccess;
}

template <Act A>
void launch_forward(const ForwardParams& p, int grid, cudaStream_t stream) {
  act_times_probs_forward_kernel<A><<<grid, kForwardThreads, 0, stream>>>(p);
}

template <Act A>
void launch_backward(const BackwardParams& p, int grid, cudaStream_t stream) {
  act_times_probs_backward_kernel<A><<<grid, kRowThreads, 0, stream>>>(p);
}

}  // namespace

cudaError_t act_times_probs_forward(int act, const void* h, const float* probs, void* z, int64_t rows, int64_t f,
                                    cudaStream_t stream) {
  if (!geometry_ok(act, rows, f)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(h) || !aligned16(z)) return cudaErrorInvalidValue;
  ForwardParams p{static_cast<const __nv_bfloat16*>(h), probs, static_cast<__nv_bfloat16*>(z), rows,
                  static_cast<int>(f)};
  int grid = 0;
  const int64_t blocks = (rows * (f / kVec) + kForwardThreads - 1) / kForwardThreads;
  const cudaError_t err = grid_for(kForwardCtasPerSm, blocks, &grid);
  if (err != cudaSuccess) return err;
  switch (static_cast<Act>(act)) {
    case Act::kSwiGLU: launch_forward<Act::kSwiGLU>(p, grid, stream); break;
    case Act::kGELU: launch_forward<Act::kGELU>(p, grid, stream); break;
    case Act::kSquaredReLU: launch_forward<Act::kSquaredReLU>(p, grid, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t act_times_probs_backward(int act, const void* h, const void* dz, const float* probs, void* dh,
                                     float* dprobs, int64_t rows, int64_t f, cudaStream_t stream) {
  if (!geometry_ok(act, rows, f) || (dprobs != nullptr && probs == nullptr)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(h) || !aligned16(dz) || !aligned16(dh)) return cudaErrorInvalidValue;
  BackwardParams p{static_cast<const __nv_bfloat16*>(h), static_cast<const __nv_bfloat16*>(dz), probs,
                   static_cast<__nv_bfloat16*>(dh), dprobs, rows, static_cast<int>(f)};
  int grid = 0;
  const cudaError_t err = grid_for(kBackwardCtasPerSm, rows, &grid);
  if (err != cudaSuccess) return err;
  switch (static_cast<Act>(act)) {
    case Act::kSwiGLU: launch_backward<Act::kSwiGLU>(p, grid, stream); break;
    case Act::kGELU: launch_backward<Act::kGELU>(p, grid, stream); break;
    case Act::kSquaredReLU: launch_backward<Act::kSquaredReLU>(p, grid, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace megatron_tma
