// Torch-free host entry points of the fused activation-times-probs kernels (kernels/activation.cuh,
// launched by csrc/instantiations/activation.cu). Plain C++: the torch binding includes it with the host
// compiler. Each returns cudaErrorInvalidValue with nothing launched when the geometry does not hold,
// never synchronises and never reads device memory on the host (CUDA-graph safe).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace megatron_tma {

// 0: SwiGLU (h = [gate | up], W = 2F), 1: GELU (erf), 2: squared ReLU (W = F), 3: GeGLU (GELU-gated, W = 2F).
// Python: activation.ACTIVATIONS order.
constexpr int kNumActivations = 4;
constexpr bool activation_is_gated(int activation) { return activation == 0 || activation == 3; }

// z[t, :] = bf16(act(h[t, :]) * probs[t]) (probs == nullptr: p = 1). h bf16 [rows, W], z bf16 [rows, f],
// both contiguous and 16-byte aligned; f a positive multiple of 8.
cudaError_t act_times_probs_forward(int activation, const void* h, const float* probs, void* z, int64_t rows, int64_t f,
                                    cudaStream_t stream);

// dh = bf16(act'(h) * dz * p) (bf16 [rows, W]) and, when dprobs != nullptr (needs probs), the FP32 row sums
// dprobs[t] = sum_j dz[t, j] * act(h)[t, j] in a fixed order (see the kernel). Same layout rules as forward.
cudaError_t act_times_probs_backward(int activation, const void* h, const void* dz, const float* probs, void* dh,
                                     float* dprobs, int64_t rows, int64_t f, cudaStream_t stream);

}  // namespace megatron_tma
