// FP8 warpgroup MMA (wgmma) on K-major, 128B-swizzled shared-memory tiles.
// A BLOCK_K = 128 slab of e4m3 is exactly one 128-byte swizzle row, so a tile of R rows is R x 128 B with
// 8-row core groups 1024 B apart; the four k32 steps of a K block advance the descriptor by 32 B.
#pragma once
#include <cstdint>
#include <utility>
#include <cute/arch/mma_sm90_gmma.hpp>

namespace megatron_tma {

// Shared-memory matrix descriptor for a K-major tile with 128-byte swizzle (tile base 1024 B aligned).
__device__ __forceinline__ uint64_t make_kmajor_sw128_desc(const void* smem) {
  const uint64_t addr = static_cast<uint64_t>(static_cast<uint32_t>(__cvta_generic_to_shared(smem)));
  uint64_t desc = 0;
  desc |= (addr & 0x3FFFFull) >> 4;       // start address, 16 B units
  desc |= (uint64_t)(1024 >> 4) << 32;    // stride byte offset: 8 rows x 128 B
  desc |= (uint64_t)1 << 62;              // layout: SWIZZLE_128B
  return desc;                            // leading byte offset unused for swizzled K-major
}

// Advance a descriptor by `bytes` along K inside the swizzle row (bytes a multiple of 16).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// The same descriptor kept as its low word: the high word (stride byte offset, SWIZZLE_128B) is a constant of
// the layout, so moving a descriptor (stage, k32 step) is a 32-bit add on the start address. As a 64-bit value
// the compiler cannot know the add never carries into the high word: it did every move as a 64-bit add in
// per-thread registers and copied both words to uniform registers for each wgmma (~40 instructions per K
// block of the M-grouped kernel, against ~10 this way). Shared memory is below 256 KB, so the 14-bit start
// field never overflows.
struct KmajorSw128Desc {
  static constexpr uint32_t kHi = (1024u >> 4) | (1u << 30);  // bits 32-45 and 62-63 of the descriptor
  uint32_t lo;                                                 // start address in 16-byte units
  __device__ __forceinline__ static KmajorSw128Desc at(const void* smem) {
    return {(static_cast<uint32_t>(__cvta_generic_to_shared(smem)) & 0x3FFFFu) >> 4};
  }
  __device__ __forceinline__ KmajorSw128Desc plus_bytes(uint32_t bytes) const { return {lo + (bytes >> 4)}; }
  __device__ __forceinline__ KmajorSw128Desc plus_units(uint32_t units16) const { return {lo + units16}; }
  __device__ __forceinline__ uint64_t value() const { return (static_cast<uint64_t>(kHi) << 32) | lo; }
};

// The cute op of one m64nNk32 e4m3 x e4m3 -> f32 wgmma with both operands in shared memory.
template <int N>
struct WgmmaFp8Op;
template <>
struct WgmmaFp8Op<128> {
  using type = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct WgmmaFp8Op<192> {
  using type = cute::SM90::GMMA::MMA_64x192x32_F32E4M3E4M3_SS_TN<>;
};

template <int N>
struct WgmmaFp8 {
  using Op = typename WgmmaFp8Op<N>::type;
  static constexpr int kRegs = N / 2;  // 64 x N FP32 over 128 threads
  template <size_t... I>
  __device__ __forceinline__ static void call(uint64_t da, uint64_t db, float* d, bool accumulate,
                                              std::index_sequence<I...>) {
    Op::fma(da, db, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
  }
  // D(64xN, fp32) (+)= A(64x32) . B(Nx32)^T
  __device__ __forceinline__ static void mma(uint64_t da, uint64_t db, float (&d)[kRegs], bool accumulate) {
    call(da, db, d, accumulate, std::make_index_sequence<kRegs>{});
  }
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Drive a two-fragment software pipeline over `count` >= 1 K blocks: step(i, cur, nxt) launches block i+1
// into `nxt` and retires block i from `cur`; last(cur) retires the final block. The fragments alternate by
// unrolling two steps, so every wgmma issue is straight-line code: ptxas serialises wgmma issued under a
// branch (warning C7518) and cannot track fragments selected at run time.
template <int R, class Step, class Last>
__device__ __forceinline__ void two_fragment_pipeline(int count, float (&f0)[R], float (&f1)[R], Step&& step,
                                                      Last&& last) {
  int i = 0;
  for (; i + 2 < count; i += 2) {
    step(i, f0, f1);
    step(i + 1, f1, f0);
  }
  if (i + 1 < count) {  // two blocks left
    step(i, f0, f1);
    last(f1);
  } else {
    last(f0);
  }
}

// Keep the compiler from moving accumulator reads/writes across wgmma issue/wait.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace megatron_tma

namespace megatron_tma {

// The tensor-core half of one BLOCK_K = 128 step: four k32 wgmma into a zero-initialised FP32 fragment
// (the first uses scale-d = 0), waited for completion so the caller may promote and release the stage.
template <class Mma>
__device__ __forceinline__ void mma_block_k128(uint64_t desc_a, uint64_t desc_b, float (&part)[Mma::kRegs]) {
  fence_regs(part);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k) Mma::mma(desc_advance(desc_a, 32 * k), desc_advance(desc_b, 32 * k), part, k > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(part);
}

}  // namespace megatron_tma
