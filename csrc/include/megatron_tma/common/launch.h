// Host-side launch helpers shared by the kernel launchers (torch-free).
#pragma once
#include <cuda_runtime.h>
#include <atomic>
#include <cstddef>

namespace megatron_tma {

// Per-device caches: a process may drive several GPUs from several threads, so nothing here is keyed on
// "the first device seen". Devices past kMaxDevices are served uncached.
constexpr int kMaxDevices = 64;

inline int current_device() {
  int dev = 0;
  cudaGetDevice(&dev);
  return dev;
}

// Multiprocessors of the current device (persistent grids launch one CTA per SM).
inline int sm_count() {
  static std::atomic<int> cached[kMaxDevices] = {};
  const int dev = current_device();
  if (dev < kMaxDevices) {
    if (const int n = cached[dev].load(std::memory_order_relaxed)) return n;
  }
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (dev < kMaxDevices && n > 0) cached[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Raise `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per device and size seen.
// `Tag` keys the cache: kernels of different configurations can share one function type. The attribute is per
// device, so the grant is remembered per device; concurrent callers may both set it (harmless, idempotent).
template <class Tag, class Kernel>
cudaError_t ensure_smem_limit(Kernel kernel, size_t bytes) {
  static std::atomic<size_t> granted[kMaxDevices] = {};
  const int dev = current_device();
  if (dev < kMaxDevices && bytes <= granted[dev].load(std::memory_order_acquire)) return cudaSuccess;
  // The runtime API form (what cuda_runtime.h's template overload calls), so that host-only tests can compile it.
  const cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess && dev < kMaxDevices) {
    size_t prev = granted[dev].load(std::memory_order_relaxed);
    while (prev < bytes && !granted[dev].compare_exchange_weak(prev, bytes, std::memory_order_release)) {
    }
  }
  return err;
}

}  // namespace megatron_tma
