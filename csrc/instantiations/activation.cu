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

// CTAs of `kernel` resident per SM (registers differ per activation: 24-46), from the occupancy calculator;
// 1 if it fails (the launch then reports any real problem).
template <class Kernel>
int resident_per_sm(Kernel kernel, int threads) {
  int n = 0;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0) == cudaSuccess && n > 0 ? n : 1;
}

// One wave: as many CTAs as can be resident at once (the kernels grid-stride), never more than the work.
cudaError_t one_wave(int per_sm, int64_t work, int* grid) {
  cudaError_t err;
  int dev = 0, sms = 0;
  if ((err = cudaGetDevice(&dev)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return err;
  const int64_t resident = int64_t(sms) * per_sm;
  *grid = static_cast<int>(work < resident ? work : resident);
  return cudaSuccess;
}

template <Act A>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  int grid = 0;
  const int64_t blocks = (p.rows * (p.f / kVec) + kForwardThreads - 1) / kForwardThreads;
  static const int per_sm = resident_per_sm(act_times_probs_forward_kernel<A>, kForwardThreads);  // once
  const cudaError_t err = one_wave(per_sm, blocks, &grid);
  if (err != cudaSuccess) return err;
  act_times_probs_forward_kernel<A><<<grid, kForwardThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <Act A>
cudaError_t launch_backward(const BackwardParams& p, cudaStream_t stream) {
  int grid = 0;
  static const int per_sm = resident_per_sm(act_times_probs_backward_kernel<A>, kRowThreads);  // once
  const cudaError_t err = one_wave(per_sm, p.rows, &grid);
  if (err != cudaSuccess) return err;
  act_times_probs_backward_kernel<A><<<grid, kRowThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t act_times_probs_forward(int act, const void* h, const float* probs, void* z, int64_t rows, int64_t f,
                                    cudaStream_t stream) {
  if (!geometry_ok(act, rows, f)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(h) || !aligned16(z)) return cudaErrorInvalidValue;
  const ForwardParams p{static_cast<const __nv_bfloat16*>(h), probs, static_cast<__nv_bfloat16*>(z), rows,
                        static_cast<int>(f)};
  switch (static_cast<Act>(act)) {
    case Act::kSwiGLU: return launch_forward<Act::kSwiGLU>(p, stream);
    case Act::kGELU: return launch_forward<Act::kGELU>(p, stream);
    case Act::kGeGLU: return launch_forward<Act::kGeGLU>(p, stream);
    default: return launch_forward<Act::kSquaredReLU>(p, stream);
  }
}

cudaError_t act_times_probs_backward(int act, const void* h, const void* dz, const float* probs, void* dh,
                                     float* dprobs, int64_t rows, int64_t f, cudaStream_t stream) {
  if (!geometry_ok(act, rows, f) || (dprobs != nullptr && probs == nullptr)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!aligned16(h) || !aligned16(dz) || !aligned16(dh)) return cudaErrorInvalidValue;
  const BackwardParams p{static_cast<const __nv_bfloat16*>(h), static_cast<const __nv_bfloat16*>(dz), probs,
                         static_cast<__nv_bfloat16*>(dh), dprobs, rows, static_cast<int>(f)};
  switch (static_cast<Act>(act)) {
    case Act::kSwiGLU: return launch_backward<Act::kSwiGLU>(p, stream);
    case Act::kGELU: return launch_backward<Act::kGELU>(p, stream);
    case Act::kGeGLU: return launch_backward<Act::kGeGLU>(p, stream);
    default: return launch_backward<Act::kSquaredReLU>(p, stream);
  }
}

}  // namespace megatron_tma
