// Host launchers and instances of the FP8 block quantizers (kernels/quantize_{1x128,128x128,grouped_128x1}.cuh, and
// kernels/transpose_128x128.cuh, the weight copy's transpose): every quantizer for
// {bf16, fp16} inputs and {FP32, pow2} scales, picked at run time; the grouped kernel also fused with 1x128.
#include <climits>
#include <cstdlib>
#include <mutex>

#include "megatron_tma/host/quantize.h"
#include "megatron_tma/kernels/quantize_128x128.cuh"
#include "megatron_tma/kernels/quantize_1x128.cuh"
#include "megatron_tma/kernels/quantize_grouped_128x1.cuh"
#include "megatron_tma/kernels/transpose_128x128.cuh"

namespace megatron_tma {
namespace {

using namespace quant;

static_assert(kQuantizeGroupedMaxGroups == kGroupedMaxGroups, "host and kernel group limits differ");

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// kernel<In, pow2> for the run-time input format and scale mode.
template <template <class, bool> class Kernel>
auto pick(QuantInput in, bool pow2) {
  if (in == QuantInput::kBf16) return pow2 ? Kernel<Bf16In, true>::fn : Kernel<Bf16In, false>::fn;
  return pow2 ? Kernel<Fp16In, true>::fn : Kernel<Fp16In, false>::fn;
}
template <class In, bool kPow2> struct K1x128 { static constexpr auto fn = quantize_1x128_kernel<In, kPow2>; };
template <class In, bool kPow2> struct K128x128 { static constexpr auto fn = quantize_128x128_kernel<In, kPow2>; };
template <class In, bool kPow2> struct K128x128Refresh {
  static constexpr auto fn = quantize_128x128_kernel<In, kPow2, true>;
};
template <class In, bool kPow2> struct KGrouped { static constexpr auto fn = quantize_grouped_128x1_kernel<In, kPow2, false>; };
template <class In, bool kPow2> struct KFused { static constexpr auto fn = quantize_grouped_128x1_kernel<In, kPow2, true>; };
template <class In, bool kPow2> struct KFusedGather {
  static constexpr auto fn = quantize_grouped_128x1_kernel<In, kPow2, true, true>;
};

bool input_ok(QuantInput in) { return in == QuantInput::kBf16 || in == QuantInput::kFp16; }

// The weight quantizer also reads FP32 master weights (as their BF16 rounding).
template <template <class, bool> class Kernel>
auto pick_weights(QuantInput in, bool pow2) {
  if (in == QuantInput::kFp32Master) return pow2 ? Kernel<Fp32MasterIn, true>::fn : Kernel<Fp32MasterIn, false>::fn;
  return pick<Kernel>(in, pow2);
}

// Persistent grid: the CTAs that the launch bounds fit on every SM (ctas_per_sm), never more than there are
// tiles. With very many groups shared memory may fit fewer; the rest then run as a short second wave.
// Raises the dynamic shared-memory limit when static + dynamic shared memory exceeds the 48 KB that needs
// no opt-in (the grouped kernels' group arrays grow with G, 12 bytes each; the static part alone is ~35 KB,
// so G > ~1000 already needs it). Raised under a lock and never lowered, since launches with other group
// counts may run concurrently. Attribute calls only, no stream work and no occupancy query per call: cheap
// and capture safe.
template <class Params>
cudaError_t persistent_grid(void (*kernel)(Params), int ctas_per_sm, int smem, int64_t tiles, int* grid) {
  cudaError_t err;
  int dev = 0, sms = 0;
  if ((err = cudaGetDevice(&dev)) != cudaSuccess) return err;
  if (smem > 0) {
    static std::mutex raise_mutex;
    const std::lock_guard<std::mutex> lock(raise_mutex);
    cudaFuncAttributes attr;
    if ((err = cudaFuncGetAttributes(&attr, kernel)) != cudaSuccess) return err;
    if (attr.sharedSizeBytes + smem > 48 * 1024 && smem > attr.maxDynamicSharedSizeBytes &&
        (err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess)
      return err;
  }
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return err;
  const int64_t resident = int64_t(sms) * ctas_per_sm;
  *grid = static_cast<int>(tiles < resident ? tiles : resident);
  return cudaSuccess;
}

}  // namespace

cudaError_t quantize_1x128(const void* x, QuantInput in, int64_t m, int64_t k, bool pow2, void* q, float* s,
                           int64_t s_ld, cudaStream_t stream) {
  if (!input_ok(in) || m < 0 || m > INT_MAX || k < 0 || k > INT_MAX || k % 16 != 0) return cudaErrorInvalidValue;
  if (m == 0 || k == 0) return cudaSuccess;  // no data and no scale entries
  if (s_ld < m || s_ld > INT_MAX || s_ld % 4 != 0 || !aligned16(x) || !aligned16(q)) return cudaErrorInvalidValue;
  const int64_t units = m * cdiv(k, k1x128Span);  // one warp each
  const int64_t blocks = cdiv(units, kWarps);
  if (blocks > INT_MAX) return cudaErrorInvalidValue;

  Quantize1x128Params p;
  p.x = x;
  p.q = static_cast<uint8_t*>(q);
  p.s = s;
  p.m = m;
  p.k = static_cast<int>(k);
  p.s_ld = static_cast<int>(s_ld);
  pick<K1x128>(in, pow2)<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

namespace {

cudaError_t launch_128x128(const void* w, QuantInput in, int64_t g, int64_t n, int64_t k, bool pow2, void* q, float* s,
                           void* qt, float* st, const int64_t* version, const int64_t* done, cudaStream_t stream) {
  if (!(input_ok(in) || in == QuantInput::kFp32Master) || g < 0 || g > INT_MAX || n < 0 || n > INT_MAX ||
      n % 16 != 0 || k < 0 || k > INT_MAX || k % 16 != 0)
    return cudaErrorInvalidValue;
  if (g == 0 || n == 0 || k == 0) return cudaSuccess;
  if (!aligned16(w) || !aligned16(q) || (qt != nullptr && !aligned16(qt))) return cudaErrorInvalidValue;

  Quantize128x128Params p;
  p.w = w;
  p.q = static_cast<uint8_t*>(q);
  p.s = s;
  p.qt = static_cast<uint8_t*>(qt);
  p.st = st;
  p.g = static_cast<int>(g);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.version = version;
  p.done = done;
  const auto kernel = version != nullptr ? pick_weights<K128x128Refresh>(in, pow2) : pick_weights<K128x128>(in, pow2);
  int grid = 0;
  const int ctas_per_sm = in == QuantInput::kFp32Master ? k128x128CtasPerSmOf<Fp32MasterIn> : k128x128CtasPerSm;
  const cudaError_t err = persistent_grid(kernel, ctas_per_sm, 0, g * cdiv(n, kBlock) * cdiv(k, kBlock), &grid);
  if (err != cudaSuccess) return err;
  kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize_128x128(const void* w, QuantInput in, int64_t g, int64_t n, int64_t k, bool pow2, void* q,
                             float* s, void* qt, float* st, cudaStream_t stream) {
  if (qt == nullptr || st == nullptr) return cudaErrorInvalidValue;
  return launch_128x128(w, in, g, n, k, pow2, q, s, qt, st, nullptr, nullptr, stream);
}

cudaError_t quantize_128x128_refresh(const void* w, QuantInput in, int64_t g, int64_t n, int64_t k, bool pow2, void* q,
                                     float* s, void* qt, float* st, const int64_t* version, int64_t* done,
                                     cudaStream_t stream) {
  if (version == nullptr || done == nullptr || (qt == nullptr) != (st == nullptr)) return cudaErrorInvalidValue;
  cudaError_t err = launch_128x128(w, in, g, n, k, pow2, q, s, qt, st, version, done, stream);
  if (err != cudaSuccess) return err;
  // after the kernel, in stream order: the outputs now hold step *version (a device-to-device copy: capturable)
  return cudaMemcpyAsync(done, version, sizeof(int64_t), cudaMemcpyDeviceToDevice, stream);
}

cudaError_t transpose_128x128(const void* q, const float* s, int64_t g, int64_t n, int64_t k, void* qt, float* st,
                              cudaStream_t stream) {
  if (g < 0 || g > INT_MAX || n < 0 || n > INT_MAX || n % 16 != 0 || k < 0 || k > INT_MAX || k % 16 != 0)
    return cudaErrorInvalidValue;
  if (g == 0 || n == 0 || k == 0) return cudaSuccess;
  if (!aligned16(q) || !aligned16(qt)) return cudaErrorInvalidValue;

  Transpose128x128Params p;
  p.q = static_cast<const uint8_t*>(q);
  p.s = s;
  p.qt = static_cast<uint8_t*>(qt);
  p.st = st;
  p.g = static_cast<int>(g);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  int grid = 0;
  const cudaError_t err = persistent_grid(transpose_128x128_kernel, kTranspose128x128CtasPerSm, 0,
                                          g * cdiv(n, kBlock) * cdiv(k, kBlock), &grid);
  if (err != cudaSuccess) return err;
  transpose_128x128_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

namespace {

// Slots per work unit of the grouped quantizer: long runs split fewer 128-byte lines between two CTAs (only
// a run's two ends do) but leave fewer units to balance over the CTAs; keep at least 4 units per CTA.
// MEGATRON_TMA_QUANT_RUN overrides it (tests reach the multi-slot runs on small inputs with it; tuning
// experiments), clamped to [1, slots].
int grouped_run(int64_t slots, int64_t tiles, int64_t grid_ctas) {
  const char* env = std::getenv("MEGATRON_TMA_QUANT_RUN");  // read per call: tests switch it
  const int64_t forced = env != nullptr ? std::atoll(env) : 0;
  const int64_t run = forced > 0 ? forced : tiles / (4 * grid_ctas);
  const int64_t cap = forced > 0 ? slots : kGroupedMaxRun;
  return static_cast<int>(run < 1 ? 1 : run > cap ? cap : run);
}

// Shared by the grouped quantizer and its fused 1x128 variant (q == nullptr: grouped only), with or without a row
// gather (fused variant only).
cudaError_t launch_grouped(const void* x, QuantInput in, int64_t m, int64_t k, GroupsArg groups, bool pow2, void* qt,
                           float* s, void* q, float* s1, int64_t s1_ld, cudaStream_t stream, RowGather gather = {}) {
  const int G = groups.num_groups;
  // Rows and qt columns stay in int on the device, rows with room for a whole block past the end.
  if (!input_ok(in) || groups.ptr == nullptr || G < 1 || G > kGroupedMaxGroups || m < 0 || m > INT_MAX - kBlock ||
      k < 0 || k > INT_MAX || k % 16 != 0 || wgrad_pitch(m, G) > INT_MAX)
    return cudaErrorInvalidValue;
  const int64_t ld = wgrad_pitch(m, G), mb_max = m / kBlock + G;
  if (k == 0) return cudaSuccess;  // every output is empty
  // m == 0 still launches: qt [k, 128 G] and s [G, k] are zeros to write (x is never read).
  if ((m > 0 && !aligned16(x)) || !aligned16(qt) || mb_max >= INT_MAX) return cudaErrorInvalidValue;
  if (q != nullptr && (s1_ld < m || s1_ld > INT_MAX || s1_ld % 4 != 0 || (m > 0 && !aligned16(q))))
    return cudaErrorInvalidValue;
  const bool gathered = gather.rows != nullptr;
  if (gathered && (q == nullptr || gather.src_rows < (m > 0 ? 1 : 0) || gather.src_rows > INT_MAX))
    return cudaErrorInvalidValue;

  QuantizeGroupedParams p;
  p.x = x;
  p.qt = static_cast<uint8_t*>(qt);
  p.s = s;
  p.groups = groups;
  p.m = static_cast<int>(m);
  p.k = static_cast<int>(k);
  p.ld = static_cast<int>(ld);
  p.mb_max = static_cast<int>(mb_max);
  p.q = static_cast<uint8_t*>(q);
  p.s1 = s1;
  p.s1_ld = static_cast<int>(q != nullptr ? s1_ld : 0);
  p.rows = gather.rows;
  p.src_rows = static_cast<int>(gather.src_rows);
  const int64_t kbs = cdiv(k, kBlock), slots = mb_max + 1;  // the token blocks' scale rows + the last tail slot
  if (slots * kbs > int64_t(UINT32_MAX)) return cudaErrorInvalidValue;  // unit indices are 32-bit on the device
  const auto kernel = gathered ? pick<KFusedGather>(in, pow2) : q != nullptr ? pick<KFused>(in, pow2)
                                                                           : pick<KGrouped>(in, pow2);
  const int smem = grouped_dynamic_smem(G);
  int grid = 0;  // first the persistent grid for one slot per unit, then for the units
  const cudaError_t err = persistent_grid(kernel, kGroupedCtasPerSm, smem, slots * kbs, &grid);
  if (err != cudaSuccess) return err;
  p.run = grouped_run(slots, slots * kbs, grid);
  const int64_t units = cdiv(slots, p.run) * kbs;
  grid = static_cast<int>(units < grid ? units : grid);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t quantize_grouped_128x1(const void* x, QuantInput in, int64_t m, int64_t k, GroupsArg groups, bool pow2,
                                   void* qt, float* s, cudaStream_t stream) {
  return launch_grouped(x, in, m, k, groups, pow2, qt, s, nullptr, nullptr, 0, stream);
}

cudaError_t quantize_1x128_and_grouped_128x1(const void* x, QuantInput in, int64_t m, int64_t k, GroupsArg groups,
                                             bool pow2, void* q, float* s, int64_t s_ld, void* qt, float* s_t,
                                             cudaStream_t stream, RowGather gather) {
  if (q == nullptr && m > 0 && k > 0) return cudaErrorInvalidValue;
  if (m == 0 || k == 0) {  // no 1x128 entry to write; qt's zeros and the grouped scales' zero rows still are
    return launch_grouped(x, in, m, k, groups, pow2, qt, s_t, nullptr, nullptr, 0, stream);
  }
  return launch_grouped(x, in, m, k, groups, pow2, qt, s_t, q, s, s_ld, stream, gather);
}

}  // namespace megatron_tma
