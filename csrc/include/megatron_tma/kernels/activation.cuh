// The expert MLP's activation times routing probs, forward and backward, each in one pass over memory:
//
//   forward   z = bf16(act(h) * p)                      h bf16 [T, W], p fp32 [T] (or 1), z bf16 [T, F]
//   backward  dh = bf16(act'(h) * (dz * p)),  dp = sum_j dz[t, j] * act(h)[t, j]
//
// with W = 2F for SwiGLU (gate half first, silu(gate) * up, as Megatron) and W = F for GELU (erf) and
// squared ReLU; everything in FP32 from the BF16 inputs, rounded once. Why a kernel: done with torch ops
// the layer makes ~12 passes over FP32 copies of [T, F] (a third of a Mixtral-sized step on the H200,
// lab/profile_mlp_layer.py); here the forward reads h once and writes z, the backward reads h and dz
// once and writes dh.
//
// What the padded twin's bit-exactness needs: every output element depends only on its own row, and the
// probs gradient of a row is summed in an order fixed by F alone (one CTA per row: thread i sums the
// 8-element vectors i, i + 128, ... in order, then a fixed shuffle tree and the 4 warp sums in order), so
// a row gives the same bits wherever it sits and however many rows there are.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

namespace megatron_tma {
namespace activation {

enum class Act : int { kSwiGLU = 0, kGELU = 1, kSquaredReLU = 2, kGeGLU = 3 };

// Gated activations read h = [gate | up] (W = 2F) and multiply act(gate) by up.
template <Act A>
inline constexpr bool kIsGated = A == Act::kSwiGLU || A == Act::kGeGLU;

constexpr int kVec = 8;                  // bf16 elements per 16-byte vector
constexpr int kForwardThreads = 256;
constexpr int kRowThreads = 128;         // backward: one CTA per row

struct ForwardParams {
  const __nv_bfloat16* h;  // [rows, W], contiguous
  const float* probs;      // [rows] or nullptr (p = 1)
  __nv_bfloat16* z;        // [rows, F], contiguous
  int64_t rows;
  int f;                   // outputs per row, a multiple of kVec
};

struct BackwardParams {
  const __nv_bfloat16* h;   // [rows, W]
  const __nv_bfloat16* dz;  // [rows, F]
  const float* probs;       // [rows] or nullptr
  __nv_bfloat16* dh;        // [rows, W]
  float* dprobs;            // [rows] or nullptr (not wanted)
  int64_t rows;
  int f;
};

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// relu that keeps NaN (as torch.relu does; fmaxf would turn it into 0).
__device__ __forceinline__ float relu(float x) { return x > 0.0f || x != x ? x : 0.0f; }

// Phi(x) = (1 + erf(x / sqrt 2)) / 2, written as erfc(-x / sqrt 2) / 2: the same value without the cancellation
// of 1 + erf for negative x (where GELU's outputs are tiny and 1 + erf would keep only a few bits of them).
__device__ __forceinline__ float gelu_cdf(float x) { return 0.5f * erfcf(x * -0.70710678118654752f); }

// act(h) for one element: x is the gate (gated activations) or the input, u the up value (gated only).
template <Act A>
__device__ __forceinline__ float act_forward(float x, float u) {
  if constexpr (A == Act::kSwiGLU) {
    return x * sigmoid(x) * u;
  } else if constexpr (A == Act::kGeGLU) {
    return x * gelu_cdf(x) * u;
  } else if constexpr (A == Act::kGELU) {
    return x * gelu_cdf(x);
  } else {
    const float r = relu(x);
    return r * r;
  }
}

// The gradient of one element from da = dz * p: dx (gate / input) and du (up, gated only); a = act(h).
template <Act A>
__device__ __forceinline__ void act_backward(float x, float u, float da, float& dx, float& du, float& a) {
  if constexpr (A == Act::kSwiGLU) {
    const float s = sigmoid(x), silu = x * s;
    a = silu * u;
    dx = da * u * s * (1.0f + x * (1.0f - s));
    du = da * silu;
  } else if constexpr (A == Act::kGeGLU) {
    const float cdf = gelu_cdf(x);
    const float pdf = expf(-0.5f * x * x) * 0.39894228040143268f;  // 1 / sqrt(2 pi)
    const float gelu = x * cdf;
    a = gelu * u;
    dx = da * u * (cdf + x * pdf);
    du = da * gelu;
  } else if constexpr (A == Act::kGELU) {
    const float cdf = gelu_cdf(x);
    const float pdf = expf(-0.5f * x * x) * 0.39894228040143268f;  // 1 / sqrt(2 pi)
    a = x * cdf;
    dx = da * (cdf + x * pdf);
    du = 0.0f;
  } else {
    const float r = relu(x);
    a = r * r;
    dx = da * (2.0f * r);
    du = 0.0f;
  }
}

union Vec8 {
  uint4 raw;
  __nv_bfloat162 pair[4];
};

__device__ __forceinline__ void unpack(const uint4& raw, float (&v)[kVec]) {
  Vec8 u;
  u.raw = raw;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(u.pair[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ uint4 pack(const float (&v)[kVec]) {
  Vec8 u;
#pragma unroll
  for (int i = 0; i < 4; ++i) u.pair[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return u.raw;
}

// Grid-stride over the [rows, F / 8] vectors of z.
template <Act A>
__global__ void __launch_bounds__(kForwardThreads) act_times_probs_forward_kernel(const ForwardParams p) {
  constexpr bool kGated = kIsGated<A>;
  const int vecs_per_row = p.f / kVec;
  const int64_t w = kGated ? 2 * int64_t(p.f) : p.f;
  const int64_t total = p.rows * vecs_per_row;
  for (int64_t v = blockIdx.x * int64_t(kForwardThreads) + threadIdx.x; v < total;
       v += int64_t(gridDim.x) * kForwardThreads) {
    const int64_t t = v / vecs_per_row;
    const int c = static_cast<int>(v - t * vecs_per_row) * kVec;
    const __nv_bfloat16* row = p.h + t * w;
    float x[kVec], u[kVec], out[kVec];
    unpack(__ldg(reinterpret_cast<const uint4*>(row + c)), x);
    if constexpr (kGated) unpack(__ldg(reinterpret_cast<const uint4*>(row + p.f + c)), u);
    const float prob = p.probs != nullptr ? __ldg(p.probs + t) : 1.0f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float a = act_forward<A>(x[i], kGated ? u[i] : 0.0f);
      out[i] = p.probs != nullptr ? a * prob : a;
    }
    *reinterpret_cast<uint4*>(p.z + t * p.f + c) = pack(out);
  }
}

// One CTA per row (grid-stride over rows).
template <Act A>
__global__ void __launch_bounds__(kRowThreads) act_times_probs_backward_kernel(const BackwardParams p) {
  constexpr bool kGated = kIsGated<A>;
  constexpr int kWarps = kRowThreads / 32;
  __shared__ float warp_sums[2][kWarps];
  const int vecs_per_row = p.f / kVec;
  const int64_t w = kGated ? 2 * int64_t(p.f) : p.f;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int parity = 0;  // double-buffered warp sums: one barrier per row
  for (int64_t t = blockIdx.x; t < p.rows; t += gridDim.x, parity ^= 1) {
    const __nv_bfloat16* hrow = p.h + t * w;
    const __nv_bfloat16* dzrow = p.dz + t * p.f;
    __nv_bfloat16* dhrow = p.dh + t * w;
    const float prob = p.probs != nullptr ? __ldg(p.probs + t) : 1.0f;
    float dprob = 0.0f;
    for (int vi = threadIdx.x; vi < vecs_per_row; vi += kRowThreads) {
      const int c = vi * kVec;
      float x[kVec], u[kVec], dz[kVec], dx[kVec], du[kVec];
      unpack(__ldg(reinterpret_cast<const uint4*>(hrow + c)), x);
      if constexpr (kGated) unpack(__ldg(reinterpret_cast<const uint4*>(hrow + p.f + c)), u);
      unpack(__ldg(reinterpret_cast<const uint4*>(dzrow + c)), dz);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        float a;
        const float da = p.probs != nullptr ? dz[i] * prob : dz[i];
        act_backward<A>(x[i], kGated ? u[i] : 0.0f, da, dx[i], du[i], a);
        dprob += dz[i] * a;
      }
      *reinterpret_cast<uint4*>(dhrow + c) = pack(dx);
      if constexpr (kGated) *reinterpret_cast<uint4*>(dhrow + p.f + c) = pack(du);
    }
    if (p.dprobs == nullptr) continue;  // uniform over the grid: no barrier is skipped by part of a CTA
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dprob += __shfl_xor_sync(0xffffffffu, dprob, offset);
    if (lane == 0) warp_sums[parity][warp] = dprob;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = warp_sums[parity][0];
#pragma unroll
      for (int i = 1; i < kWarps; ++i) sum += warp_sums[parity][i];
      p.dprobs[t] = sum;
    }
  }
}

}  // namespace activation
}  // namespace megatron_tma
