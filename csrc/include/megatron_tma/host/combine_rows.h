// Torch-free host entry point of the MoE un-permutation (kernels/combine_rows.cuh, csrc/instantiations/combine_rows.cu).
// Plain C++ (no device code), so the torch binding can include it with the host compiler.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace megatron_tma {

// Largest number of rows per token (Megatron's top-k) combine_rows accepts.
constexpr int kCombineMaxRowsPerToken = 32;

// out (bf16 [tokens, h]) row t = the FP32 sum, in the order j = 0..k-1 from +0, of rows token_rows[t * k + j] of y
// (bf16 [y_rows, h]), rounded to BF16 once. token_rows: int32 [tokens, k] on the device, each in [0, y_rows)
// (an index outside is clamped into it). Requires h % 8 == 0 (16-byte rows), 16-byte aligned y and out,
// 1 <= k <= kCombineMaxRowsPerToken and y_rows >= 1 when tokens > 0. Returns cudaErrorInvalidValue (nothing
// launched) on bad geometry; no host synchronisation and no device reads: safe under CUDA-graph capture.
cudaError_t combine_rows_bf16(const void* y, int64_t y_rows, const int32_t* token_rows, int64_t tokens, int64_t k,
                              int64_t h, void* out, cudaStream_t stream);

}  // namespace megatron_tma
