// Host test of csrc/include/megatron_tma/common/launch.h: the SM count and the shared-memory opt-in are remembered per
// device, so a process that drives several GPUs (from several threads) launches each with its own settings.
// The CUDA runtime calls launch.h makes are replaced by fakes with a per-thread current device, as CUDA's is.
// Prints "ok" or the first failed check; exit status 1 on failure. (tests/test_launch_cache.py builds and runs it.)
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

namespace {
thread_local int current = 0;
const int kSms[3] = {132, 78, 16};
std::atomic<int> attribute_queries{0};
std::atomic<int> smem_grants[3] = {};
}  // namespace

extern "C" {
cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  *device = current;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  ++attribute_queries;
  *value = attr == cudaDevAttrMultiProcessorCount ? kSms[device] : 0;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaFuncSetAttribute(const void*, enum cudaFuncAttribute, int) {
  ++smem_grants[current];
  return cudaSuccess;
}
}

#include "megatron_tma/common/launch.h"

namespace {
void fake_kernel(int) {}
struct Tag {};
int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok && failures++ == 0) std::printf("FAILED: %s\n", what);
}
}  // namespace

int main() {
  using megatron_tma::ensure_smem_limit;
  using megatron_tma::sm_count;
  current = 0;
  expect(sm_count() == 132, "device 0 has 132 SMs");
  current = 1;
  expect(sm_count() == 78, "device 1 has its own SM count, not device 0's");
  current = 0;
  expect(sm_count() == 132, "device 0 again");
  expect(attribute_queries == 2, "each device queried once");

  expect(ensure_smem_limit<Tag>(fake_kernel, 200000) == cudaSuccess && smem_grants[0] == 1, "device 0 granted");
  expect(ensure_smem_limit<Tag>(fake_kernel, 150000) == cudaSuccess && smem_grants[0] == 1, "a smaller size: cached");
  current = 1;
  expect(ensure_smem_limit<Tag>(fake_kernel, 150000) == cudaSuccess && smem_grants[1] == 1,
         "device 1 gets its own opt-in (a process-wide cache skipped it)");
  current = 0;
  expect(ensure_smem_limit<Tag>(fake_kernel, 220000) == cudaSuccess && smem_grants[0] == 2, "a larger size: granted");

  // Threads on different devices at once: each sees its device's SM count, and device 2's opt-in happens.
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 6; ++t)
    threads.emplace_back([t, &wrong] {
      current = t % 3;
      for (int i = 0; i < 20000; ++i) {
        if (sm_count() != kSms[current]) ++wrong;
        if (ensure_smem_limit<Tag>(fake_kernel, 100000) != cudaSuccess) ++wrong;
      }
    });
  for (auto& th : threads) th.join();
  expect(wrong == 0, "every thread saw its own device's settings");
  expect(smem_grants[2] >= 1, "device 2 got its opt-in");
  if (failures == 0) std::printf("ok\n");
  return failures ? 1 : 0;
}
