// The producer/consumer ring shared by the grouped GEMM kernels: STAGES shared-memory slots, each with a
// "full" mbarrier (one producer arrival + TMA transaction bytes) and an "empty" mbarrier (one arrival per
// consumer warp, of every CTA of the cluster when CLUSTER > 1). Both sides walk the ring with the same (stage,
// phase) state.
#pragma once
#include <cstdint>
#include <type_traits>
#include "megatron_tma/common/cluster.cuh"
#include "megatron_tma/common/mbarrier.cuh"

namespace megatron_tma {

// f(std::integral_constant<int, I>{}) for I = BEGIN .. END-1, in order: a loop whose index is a compile-time
// constant in every step (a ring stage whose barrier, descriptor and slot addresses fold to immediates), where
// `#pragma unroll` is only a request ptxas may turn down under register pressure.
template <int BEGIN, int END, class F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (BEGIN < END) {
    f(std::integral_constant<int, BEGIN>{});
    static_for<BEGIN + 1, END>(f);
  }
}

template <int STAGES>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) stage = 0, phase ^= 1;
  }
};

// CLUSTER > 1: the CTAs of a cluster fill each other's slots (a multicast TMA load), so a slot is free only once the
// consumers of every CTA have released it: each consumer warp arrives on the empty barrier of every CTA, and
// init's count is the cluster's consumer warps.
template <int STAGES, int CLUSTER = 1>
struct Pipeline {
  uint64_t* full;   // [STAGES]
  uint64_t* empty;  // [STAGES]

  // One thread, before any use; consumer_warps arrivals release a slot.
  __device__ __forceinline__ void init(int consumer_warps) const {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumer_warps);
    }
    mbar_fence_init();
  }
  // Producer: wait for a free slot, announce the bytes its TMA loads will deliver.
  __device__ __forceinline__ uint64_t* producer_acquire(const PipelineState<STAGES>& st, uint32_t tx_bytes) const {
    producer_wait(st);
    return producer_arrive(st, tx_bytes);
  }
  // The same in two steps, for a producer that also writes the slot with plain stores in between: the arrival
  // releases them to the consumers, whose wait acquires them.
  __device__ __forceinline__ void producer_wait(const PipelineState<STAGES>& st) const {
    mbar_wait(&empty[st.stage], st.phase ^ 1);  // a fresh barrier's "previous" phase counts as complete
  }
  __device__ __forceinline__ uint64_t* producer_arrive(const PipelineState<STAGES>& st, uint32_t tx_bytes) const {
    mbar_arrive_expect_tx(&full[st.stage], tx_bytes);
    return &full[st.stage];
  }
  // Consumer: wait until the slot's loads have landed.
  __device__ __forceinline__ void consumer_wait(const PipelineState<STAGES>& st) const {
    mbar_wait(&full[st.stage], st.phase);
    __syncwarp();  // reconverge before the warpgroup-wide wgmma
  }
  // Consumer warp: hand the slot back once every read of it (wgmma included) is complete.
  __device__ __forceinline__ void consumer_release(const PipelineState<STAGES>& st, int lane) const {
    __syncwarp();
    if constexpr (CLUSTER == 1) {
      if (lane == 0) mbar_arrive(&empty[st.stage]);
    } else {
      if (lane < CLUSTER) mbar_arrive_cluster(&empty[st.stage], static_cast<uint32_t>(lane));
    }
  }
};

}  // namespace megatron_tma
