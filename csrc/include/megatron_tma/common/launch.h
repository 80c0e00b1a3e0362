// Host-side launch helpers shared by the kernel launchers (torch-free).
#pragma once
#include <cuda_runtime.h>
#include <cstddef>

namespace megatron_tma {

// Multiprocessors of the current device (persistent grids launch one CTA per SM).
inline int sm_count() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

// Raise `kernel`'s dynamic shared-memory limit to `bytes`, once per size seen. `Tag` keys the cache:
// kernels of different configurations can share one function type.
template <class Tag, class Kernel>
cudaError_t ensure_smem_limit(Kernel kernel, size_t bytes) {
  static size_t granted = 0;
  if (bytes <= granted) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess) granted = bytes;
  return err;
}

}  // namespace megatron_tma
