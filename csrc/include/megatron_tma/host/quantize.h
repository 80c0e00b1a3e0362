// Torch-free host entry points of the FP8 block quantizers (csrc/instantiations/quantize.cu; kernels in
// kernels/quantize_*.cuh, numerics in common/fp8.cuh, byte layouts in docs/layouts.md). Plain C++: the
// torch binding includes it with the host compiler.
//
// Every function checks the geometry it can see and returns cudaErrorInvalidValue with nothing launched
// when it does not hold, launches on `stream` otherwise (returning the launch status), and never
// synchronises or reads device memory on the host: all are safe under CUDA-graph capture. Inputs are
// bf16 or fp16, row-major, 16-byte aligned, with K (the contiguous dimension) a multiple of 16; every
// output byte of the documented layout is written (padding included), so outputs need no initialisation.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "megatron_tma/common/groups_arg.h"

namespace megatron_tma {

// kFp32Master: FP32 master weights quantized as their BF16 rounding (quantize_128x128 only: the bytes of quantizing
// the BF16 copy a mixed-precision optimizer would write, without that copy).
enum class QuantInput : int { kBf16 = 0, kFp16 = 1, kFp32Master = 2 };

// Largest G quantize_grouped_128x1 accepts (group, column and token-block offsets live in shared memory).
constexpr int kQuantizeGroupedMaxGroups = 8192;

// Row pitch P of the wgrad operand qt [k, P] (docs/design.md §4): round_up(m, 128) + 128 G, the upper bound of the
// 128-token group starts' a_G, known on the host from m and G alone; a multiple of 128, so that every token block
// of every row is one whole 128-byte line.
constexpr int kWgradAlign = 128;
constexpr int64_t wgrad_pitch(int64_t m, int64_t num_groups) {
  return (m + kWgradAlign - 1) / kWgradAlign * kWgradAlign + kWgradAlign * num_groups;
}

// x [m, k] -> q e4m3 [m, k] and 1x128 scales: the scale of row r, column block kb (k/128 rounded up)
// at s[kb * s_ld + r]. s_ld >= m, a multiple of 4; entries m..s_ld-1 of each block row are set to 1.0.
cudaError_t quantize_1x128(const void* x, QuantInput in, int64_t m, int64_t k, bool pow2, void* q, float* s,
                           int64_t s_ld, cudaStream_t stream);

// w [g, n, k] -> q e4m3 [g, n, k], s [g, ceil(n/128), ceil(k/128)], qt = q^T e4m3 [g, k, n] and
// st = s^T [g, ceil(k/128), ceil(n/128)], all contiguous, in one pass. n % 16 == 0 as well.
cudaError_t quantize_128x128(const void* w, QuantInput in, int64_t g, int64_t n, int64_t k, bool pow2, void* q,
                             float* s, void* qt, float* st, cudaStream_t stream);

// quantize_128x128 into given buffers, for CUDA graphs that hold the weights' FP8 copies across micro-batches:
// nothing is done when *version == *done (read on the device), else the copies are written and then version is copied
// into done (in stream order). version: the device's optimizer-step counter; done: the step the buffers hold (-1:
// none). qt and st may both be nullptr (W's copy only). Capturable: the decision is made at each replay.
cudaError_t quantize_128x128_refresh(const void* w, QuantInput in, int64_t g, int64_t n, int64_t k, bool pow2, void* q,
                                     float* s, void* qt, float* st, const int64_t* version, int64_t* done,
                                     cudaStream_t stream);

// The transposed copy alone, from the copy: q e4m3 [g, n, k] and s [g, ceil(n/128), ceil(k/128)] (quantize_128x128's q
// and s) -> qt [g, k, n] and st [g, ceil(k/128), ceil(n/128)], the bytes quantize_128x128 writes as qt and st.
// n, k multiples of 16; q and qt 16-byte aligned.
cudaError_t transpose_128x128(const void* q, const float* s, int64_t g, int64_t n, int64_t k, void* qt, float* st,
                              cudaStream_t stream);

// x [m, k] -> qt e4m3 [k, P] contiguous, P = wgrad_pitch(m, G): group g's tokens at columns
// [a_g, a_g + M_g), a_g = sum_{h<g} round_up(M_h, 128) (qt[c * P + a_g + t] = q(x[o_g + t, c])), every other
// column set to 0; and s [m/128 + G, k] (row b = the b-th 128-token block, counting each group's blocks from
// its first row; rows past the last used block set to 0). P <= INT_MAX. `groups` is the device sizes [G] or
// offsets [G+1] tensor, 1 <= G <= kQuantizeGroupedMaxGroups. m == 0 is a launch too (qt all zero, s zero).
cudaError_t quantize_grouped_128x1(const void* x, QuantInput in, int64_t m, int64_t k, GroupsArg groups, bool pow2,
                                   void* qt, float* s, cudaStream_t stream);

// A row gather fused into a quantizer's read: the matrix quantized is [m, k] with row r = x row rows[r], x being
// [src_rows, k] (the MoE permutation: x the routed tokens in their own order, rows[r] the token of permuted row
// r). rows: int32 [m] on the device, each in [0, src_rows) (an index outside is clamped into it: never a read
// outside x). rows == nullptr: no gather (x is [m, k] itself).
struct RowGather {
  const int32_t* rows = nullptr;
  int64_t src_rows = 0;
};

// Both quantize_1x128 (q, s, s_ld) and quantize_grouped_128x1 (qt, s_t) of the same x in one pass: x is read
// once instead of twice (the backward quantizes dY for dgrad and wgrad). Same outputs, same rules; with `gather`,
// of the gathered matrix (m its rows), the same bytes as gathering first.
cudaError_t quantize_1x128_and_grouped_128x1(const void* x, QuantInput in, int64_t m, int64_t k, GroupsArg groups,
                                             bool pow2, void* q, float* s, int64_t s_ld, void* qt, float* s_t,
                                             cudaStream_t stream, RowGather gather = {});

}  // namespace megatron_tma
