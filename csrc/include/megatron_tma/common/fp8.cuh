// FP8 e4m3 block quantization numerics: the device-side copy of the scale formula (docs/design.md §3,
// docs/layouts.md). megatron_tma/reference.py (`block_scale`, `fp8_e4m3_satfinite`) is the torch copy;
// tests/test_quant_gpu.py pins the two equal bit for bit, so change both or neither.
//
// A block with amax a (max |x| in FP32) gets a dequantization scale s and a multiplier m, and every
// element is quantized as q = satfinite_rn_e4m3(x * m), one FP32 multiply:
//   a == 0          s = 1, m = 0 (q = +-0: the sign of an input zero survives, -0 -> 0x80)
//   0 < a < 2^-119  a is raised to 2^-119 first (below 448 / FLT_MAX the literal 448 / a is Inf and
//                   the block's zeros would become 0 * Inf = NaN)
//   FP32 mode       s = a / 448, m = 448 / a: two correctly rounded divisions (__fdiv_rn: no
//                   reciprocal approximation, no fast-math; __fmul_rn keeps x * m from being contracted)
//   pow2 mode       s = 2^E, E = ceil(log2(fp32(a / 448))) taken exactly from the quotient's bits
//                   (denormal quotients included), m = 2^-E. s lies in [2^-127, 2^120], so m is a
//                   normal float and x * m == x / s exactly (UE8M0-compatible scales).
//   a = +Inf        s = Inf, m = 0: finite x -> +-0, +-Inf -> 0 * Inf = NaN (falls out of the arithmetic)
//   a = NaN         s = NaN, m = NaN: the whole block is NaN
// satfinite: |v| > 448 clamps to +-448, rounding to nearest even, NaN -> NaN (0x7F: the GPU's FP32
// multiply returns the canonical positive NaN, which cvt.satfinite encodes as 0x7F).
//
// The amax is an unsigned integer max over the bit patterns of |x|: that order is the numeric order
// of |x| with every NaN above +Inf above every finite value, so the max propagates NaN for free and
// works on packed 16-bit halves (two bf16/fp16 values per 32-bit register) without conversions.
#pragma once
#include <cstdint>

namespace megatron_tma {
namespace fp8 {

constexpr float kE4M3Max = 448.0f;
constexpr uint32_t kAmaxFloorBits = (127u - 119u) << 23;  // 2^-119
constexpr uint32_t kInfBits = 0x7f800000u;

struct BlockScale {
  float scale;  // FP32 dequantization factor: x ~ q * scale (what the scale tensors hold)
  float mul;    // quantization multiplier: q = satfinite_rn(x * mul)
};

// Scale and multiplier of a block whose amax, as the FP32 bit pattern of |x| (sign bit clear), is
// `amax_bits`. Warp-uniform callers pay two divisions per block, never per element.
template <bool kPow2>
__device__ __forceinline__ BlockScale block_scale(uint32_t amax_bits) {
  if (amax_bits == 0) return {1.0f, 0.0f};
  const float a = __uint_as_float(amax_bits < kAmaxFloorBits ? kAmaxFloorBits : amax_bits);  // NaN stays
  if constexpr (!kPow2) {
    return {__fdiv_rn(a, kE4M3Max), __fdiv_rn(kE4M3Max, a)};
  } else {
    const float r = __fdiv_rn(a, kE4M3Max);
    const uint32_t rb = __float_as_uint(r);
    if (rb >= kInfBits) return {r, __fdiv_rn(1.0f, r)};  // Inf -> m = 0, NaN -> NaN
    const int e = static_cast<int>(rb >> 23);
    const uint32_t mant = rb & 0x7fffffu;
    // r >= 2^-119 / 448 > 2^-128, so a denormal r has mant > 0 and E >= -127.
    // Normal r = 1.mant * 2^(e-127): E = e - 127, plus one unless r is a power of two.
    // Denormal r = mant * 2^-149: E = ceil(log2(mant)) - 149.
    const int E = e != 0 ? e - 127 + (mant != 0u) : (32 - __clz(static_cast<int>(mant - 1u))) - 149;
    const float s = E >= -126 ? __uint_as_float(static_cast<uint32_t>(E + 127) << 23)
                              : __uint_as_float(1u << (E + 149));
    return {s, __uint_as_float(static_cast<uint32_t>(127 - E) << 23)};
  }
}

// Four FP32 values (already multiplied) -> four e4m3 bytes, v0 in the lowest byte.
// cvt.rn.satfinite.e4m3x2.f32 d, a, b puts a in the upper and b in the lower byte of d.
__device__ __forceinline__ uint32_t cvt_e4m3x4(float v0, float v1, float v2, float v3) {
  uint32_t out;
  asm("{\n\t.reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}"
      : "=r"(out)
      : "f"(v0), "f"(v1), "f"(v2), "f"(v3));
  return out;
}

// q bytes of four inputs under one block scale.
__device__ __forceinline__ uint32_t quantize4(float x0, float x1, float x2, float x3, float mul) {
  return cvt_e4m3x4(__fmul_rn(x0, mul), __fmul_rn(x1, mul), __fmul_rn(x2, mul), __fmul_rn(x3, mul));
}

}  // namespace fp8
}  // namespace megatron_tma
