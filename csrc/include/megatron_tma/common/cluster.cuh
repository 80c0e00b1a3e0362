// Thread-block-cluster primitives for kernels whose CTAs share a TMA load: a CTA's rank in its cluster, the
// cluster-wide barrier, an mbarrier arrival on a peer CTA's barrier, and a TMA load multicast into several CTAs.
// A multicast lands at the same shared-memory offset in every CTA of the mask and completes the transaction bytes
// on the mbarrier at the same offset in each, so the CTAs of a cluster must lay out shared memory identically.
#pragma once
#include <cstdint>
#include "megatron_tma/common/tma.cuh"

namespace megatron_tma {

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));  // not volatile: a constant of the CTA, free to reuse
  return r;
}

// Every thread of every CTA of the cluster: nothing after it runs before everything before it, cluster-wide
// (barrier initialisation before a peer may arrive on or multicast into this CTA; no CTA leaves while a peer may
// still arrive on its barriers).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrive on the mbarrier at `bar`'s offset in the shared memory of cluster CTA `cta` (this CTA's own included).
// The arrival's default semantics (release at CTA scope), as CUTLASS's ClusterBarrier: what it orders before the
// peer's TMA overwrites the slot are wgmma reads, complete once wgmma.wait_group returned; `.release.cluster`
// compiled to a MEMBAR per release.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(cta)
      : "memory");
}

// tma_load_3d into every CTA of `cta_mask` (bit i: cluster rank i), each completing on its own barrier at `bar`'s
// offset.
__device__ __forceinline__ void tma_load_3d_multicast(const CUtensorMap* map, uint64_t* bar, void* smem, int c0,
                                                      int c1, int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5, %6}], [%2], %3;" ::"r"(smem_u32(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "h"(cta_mask), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

}  // namespace megatron_tma
