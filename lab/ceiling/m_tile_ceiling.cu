// Tile-shape ceiling study for the M-grouped kernel (benchmarks/NOTES.md, "Where the 128-wide kernel stands").
//
// A dense FP8 GEMM D[M, N] = A[M, K] . B[N, K]^T with the M-grouped kernel's machinery (persistent grid, one TMA
// producer thread, two math warpgroups of 64 rows each, STAGES-deep mbarrier ring, 128B-swizzled tiles, BLOCK_K
// 128, panel rasterisation) and only the math loop varied, to separate what the tile shape costs from what the
// per-block FP32 promotion (docs/design.md §3) costs:
//   pipe128   the production scheme: 128x128, two partial fragments, block kb+1 issued before kb is promoted
//   serial<N> DeepGEMM's scheme: 128xN, one partial fragment, wait_group 0 after each block, then promote
//   x3        three math warpgroups (192-row tiles, 160 registers each), serial or none only
//   none<N>   no promotion at all (the tensor cores accumulate across K, one group kept in flight): the shape's
//             ceiling, what a tensorwise-scaled GEMM (cuBLAS) could reach with this pipeline
//   -tma      the production epilogue: the BF16 tile through shared memory, one TMA store per 64 columns
//   -nost     no stores at all (the most that hiding the epilogue could give); otherwise plain BF16 global stores
//   prod-like pipe128-tma + the per-stage A-scale TMA (rows + 4 floats) and 2 LDS per block: the production kernel's choices
//   prod-serial<..> the serial loops with those scales, fetched a block ahead as in the production kernel
//   prod-like-la   prod-like with the stage's A scales read after the wgmma issue instead of before
//   -fd       a stage's wgmma descriptors as stage 0's plus one add, not rebuilt from the address per block
// Every variant that promotes gives pipe128's bits (all scales are 1); the tool prints the comparison.
// The numbers are only timing: all scales are 1 (bits are compared only where two variants must agree), and the
// variants are timed interleaved in one process. Not part of the package; results in benchmarks/NOTES.md.
//   build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
//          -I csrc/include -I <cutlass>/include lab/ceiling/m_tile_ceiling.cu -o /tmp/m_tile_ceiling
//   run:   /tmp/m_tile_ceiling [M N K [--only <variant>]]   (default 16384 4096 4096; --only: one variant, twice)
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "megatron_tma/common/mbarrier.cuh"
#include "megatron_tma/common/pipeline.cuh"
#include "megatron_tma/common/promotion.cuh"
#include "megatron_tma/common/residual_store.cuh"
#include "megatron_tma/common/tma.cuh"
#include "megatron_tma/common/wgmma.cuh"

namespace mt = megatron_tma;

template <int N>
struct Wgmma;
template <>
struct Wgmma<128> : mt::WgmmaFp8<128> {};
#define DEFINE_WGMMA(NN, OP)                                                                                   \
  template <>                                                                                                 \
  struct Wgmma<NN> {                                                                                          \
    using Op = cute::SM90::GMMA::OP<>;                                                                        \
    static constexpr int kRegs = NN / 2;                                                                      \
    template <size_t... I>                                                                                    \
    __device__ __forceinline__ static void call(uint64_t da, uint64_t db, float* d, bool acc,                 \
                                                std::index_sequence<I...>) {                                  \
      Op::fma(da, db, d[I]..., acc ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);      \
    }                                                                                                         \
    __device__ __forceinline__ static void mma(uint64_t da, uint64_t db, float (&d)[kRegs], bool acc) {       \
      call(da, db, d, acc, std::make_index_sequence<kRegs>{});                                                \
    }                                                                                                         \
  };
DEFINE_WGMMA(192, MMA_64x192x32_F32E4M3E4M3_SS_TN)
DEFINE_WGMMA(256, MMA_64x256x32_F32E4M3E4M3_SS_TN)

enum Mode { kPipe = 0, kSerial = 1, kNone = 2 };
// A scales (template SA): constants in registers; or, as the production kernel, a per-stage TMA of 132 floats and
// two shared-memory reads per block, before or after the block's wgmma issue.
enum ScaleMode { kNoScales = 0, kScales = 1, kScalesAfterIssue = 2 };
constexpr int kNoStore = 8;  // mode flag: skip the epilogue's stores (what a fully hidden epilogue could give)
constexpr int kTmaStore = 16;  // mode flag: the production epilogue (BF16 tile in shared memory, TMA store)
constexpr int kFastDesc = 32;  // mode flag: stage descriptors by one add from stage 0's (see issue())
// mode flag: three math warpgroups (192-row tiles, 64 rows each) at 160 registers, the producer at 24: the serial
// scheme then has two other warpgroups' wgmma to hide each warpgroup's promotion behind
constexpr int kMath3 = 64;

template <int BN, int STAGES, int MODE, int SA>
struct Cfg {
  static constexpr int MW = (MODE & kMath3) ? 3 : 2, BLOCK_M = 64 * MW, THREADS = 128 * (1 + MW);
  // setmaxnreg budget: the pool holds what the producer's dec frees (launch: 64K / THREADS per thread)
  static constexpr int REG_PRODUCER = MW == 3 ? 24 : 40, REG_MATH = MW == 3 ? 160 : 232;
  static_assert(128 * REG_PRODUCER + 128 * MW * REG_MATH <= THREADS * ((65536 / THREADS) & ~7), "register pool");
  static constexpr int A_BYTES = BLOCK_M * 128, B_BYTES = BN * 128, STAGE = A_BYTES + B_BYTES;
  // the production kernel's A-scale box (the tile's rows + 4, aligned over-fetch) and its 128-byte slot
  static constexpr int SA_BYTES = (BLOCK_M + 4) * 4, SA_SLOT = (SA_BYTES + 127) / 128 * 128;
  static constexpr int OFF_SA = STAGES * STAGE;
  // the 128B-swizzled staging tile of the TMA store needs a 1024-aligned base (the scale slots are 640 B each)
  static constexpr int OFF_D = (OFF_SA + (SA != kNoScales ? STAGES * SA_SLOT : 0) + 1023) / 1024 * 1024;
  static constexpr int D_BYTES = BLOCK_M * BN * 2;
  static constexpr int OFF_BAR = OFF_D + D_BYTES;
  static constexpr int SMEM = 1024 + OFF_BAR + 2 * STAGES * 8 + 1024;  // + BLOCK_M row scales
};

struct Params {
  CUtensorMap a, b, sa;  // sa: FP32 [K/128, M] (M contiguous), box (132, 1)
  CUtensorMap d_map;     // D bf16 [M, N]: box (64 columns, 64 rows), SW128
  __nv_bfloat16* d;
  const float* b_scales;  // [N/128, K/128]
  int m, n, k;
};

template <int BN, int STAGES, int MODE_FLAGS, int SA>
__global__ void __launch_bounds__(Cfg<BN, STAGES, MODE_FLAGS, SA>::THREADS, 1) ceiling_kernel(const __grid_constant__ Params p) {
  constexpr int MODE = MODE_FLAGS & 3;  // the other bits are flags
  using C = Cfg<BN, STAGES, MODE_FLAGS, SA>;
  static_assert(C::MW == 2 || MODE != kPipe, "three warpgroups: serial or none");
  static_assert(MODE != kSerial || SA != kScalesAfterIssue, "serial with scales: kScales (read a block ahead)");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (mt::smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::OFF_BAR);
  float* row_scale = reinterpret_cast<float*>(smem + C::OFF_BAR + 2 * STAGES * 8);
  const mt::Pipeline<STAGES> pipe{full, full + STAGES};
  if (threadIdx.x == 0) pipe.init(4 * C::MW);
  if (threadIdx.x < C::BLOCK_M) row_scale[threadIdx.x] = 1.0f;  // as the A scales in global memory: bits comparable
  __syncthreads();
  const int num_kb = p.k / 128, m_blocks = p.m / C::BLOCK_M, n_blocks = p.n / BN, tiles = m_blocks * n_blocks;
  constexpr int kPanel = 8;
  auto tile_of = [&](int t, int& mb, int& nb) {  // panels of kPanel N blocks, M blocks fastest inside a panel
    const int panel = t / (kPanel * m_blocks), in = t - panel * kPanel * m_blocks;
    const int width = min(kPanel, n_blocks - panel * kPanel);
    mb = in / width;
    nb = panel * kPanel + in % width;
  };
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    mt::setmaxnreg_dec<C::REG_PRODUCER>();
    if (threadIdx.x == 0) {
      mt::PipelineState<STAGES> st;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int mb, nb;
        tile_of(t, mb, nb);
        for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
          uint64_t* bar = pipe.producer_acquire(st, C::STAGE + (SA != kNoScales ? C::SA_BYTES : 0));
          mt::tma_load_2d(&p.a, bar, smem + st.stage * C::STAGE, kb * 128, mb * C::BLOCK_M);
          if constexpr (SA != kNoScales)
            mt::tma_load_2d(&p.sa, bar, smem + C::OFF_SA + st.stage * C::SA_SLOT, mb * C::BLOCK_M, kb);
          mt::tma_load_2d(&p.b, bar, smem + st.stage * C::STAGE + C::A_BYTES, kb * 128, nb * BN);
        }
      }
    }
    return;
  }
  mt::setmaxnreg_inc<C::REG_MATH>();
  const int mwg = wg - 1, tid = threadIdx.x % 128, lane = tid % 32, r0 = 16 * (tid / 32) + lane / 4;
  using Mma = Wgmma<BN>;
  constexpr int R = Mma::kRegs;
  float sa0 = row_scale[64 * mwg + r0], sa1 = row_scale[64 * mwg + r0 + 8];
  auto stage_scales = [&](const mt::PipelineState<STAGES>& at, float& s0, float& s1) {
    if constexpr (SA != kNoScales) {
      const float* sa = reinterpret_cast<const float*>(smem + C::OFF_SA + at.stage * C::SA_SLOT) + 64 * mwg;
      s0 = sa[r0], s1 = sa[r0 + 8];
    }
  };
  float acc[R];
  mt::PipelineState<STAGES> st;
  // kFastDesc: stage 0's descriptors built once; a stage's are theirs plus stage * STAGE / 16 in the 14-bit
  // address field (shared memory < 256 KB: no carry out of it), instead of a full build per block.
  const uint64_t da0 = mt::make_kmajor_sw128_desc(smem + mwg * 64 * 128);
  const uint64_t db0 = mt::make_kmajor_sw128_desc(smem + C::A_BYTES);
  auto issue = [&](float(&frag)[R], const mt::PipelineState<STAGES>& at, bool accumulate_first) {
    uint64_t da, db;
    if constexpr ((MODE_FLAGS & kFastDesc) != 0) {
      const uint64_t off = static_cast<uint64_t>(at.stage * (C::STAGE >> 4));
      da = da0 + off, db = db0 + off;
    } else {
      da = mt::make_kmajor_sw128_desc(smem + at.stage * C::STAGE + mwg * 64 * 128);
      db = mt::make_kmajor_sw128_desc(smem + at.stage * C::STAGE + C::A_BYTES);
    }
    mt::fence_regs(frag);
    mt::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) Mma::mma(mt::desc_advance(da, 32 * k), mt::desc_advance(db, 32 * k), frag, k > 0 || accumulate_first);
    mt::wgmma_commit();
  };
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int mb, nb;
    tile_of(t, mb, nb);
    const float* bs = p.b_scales + static_cast<size_t>(nb * BN / 128) * num_kb;
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
    if constexpr (MODE == kNone) {
      pipe.consumer_wait(st);
      issue(acc, st, false);
      for (int kb = 1; kb < num_kb; ++kb) {
        mt::PipelineState<STAGES> next = st;
        next.advance();
        pipe.consumer_wait(next);
        issue(acc, next, true);
        mt::wgmma_wait<1>();
        pipe.consumer_release(st, lane);
        st = next;
      }
      mt::wgmma_wait<0>();
      mt::fence_regs(acc);
      pipe.consumer_release(st, lane);
      st.advance();
    } else if constexpr (MODE == kSerial && SA == kNoScales) {
      float part[R];
      for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
        const float sb = __ldg(bs + kb);
        pipe.consumer_wait(st);
        issue(part, st, false);
        mt::wgmma_wait<0>();
        mt::fence_regs(part);
        pipe.consumer_release(st, lane);
        mt::promote_row_scaled(acc, part, sa0, sa1, sb);
      }
    } else if constexpr (MODE == kSerial) {
      // as the production kernel's serial loop: block kb+1's scales (B from global memory, A from its stage once
      // it has landed) fetched while block kb runs, so no wgmma issue waits on a load
      float part[R];
      float sb = __ldg(bs);
      pipe.consumer_wait(st);
      stage_scales(st, sa0, sa1);
      for (int kb = 0; kb < num_kb; ++kb) {
        issue(part, st, false);
        mt::PipelineState<STAGES> next = st;
        next.advance();
        float nsa0 = 0.f, nsa1 = 0.f, nsb = 0.f;
        if (kb + 1 < num_kb) {
          nsb = __ldg(bs + kb + 1);
          pipe.consumer_wait(next);
          stage_scales(next, nsa0, nsa1);
        }
        mt::wgmma_wait<0>();
        mt::fence_regs(part);
        pipe.consumer_release(st, lane);
        mt::promote_row_scaled(acc, part, sa0, sa1, sb);
        sa0 = nsa0, sa1 = nsa1, sb = nsb;
        st = next;
      }
    } else {
      float part0[R], part1[R];
      float sb = __ldg(bs);
      pipe.consumer_wait(st);
      stage_scales(st, sa0, sa1);
      issue(part0, st, false);
      auto step = [&](int kb, float(&cur)[R], float(&nxt)[R]) {
        mt::PipelineState<STAGES> next = st;
        next.advance();
        const float nsb = __ldg(bs + kb + 1);
        float nsa0 = sa0, nsa1 = sa1;
        pipe.consumer_wait(next);
        if constexpr (SA != kScalesAfterIssue) stage_scales(next, nsa0, nsa1);
        issue(nxt, next, false);
        if constexpr (SA == kScalesAfterIssue) stage_scales(next, nsa0, nsa1);  // the issue's fence need not wait
        mt::wgmma_wait<1>();
        mt::fence_regs(cur);
        pipe.consumer_release(st, lane);
        mt::promote_row_scaled(acc, cur, sa0, sa1, sb);
        sb = nsb, sa0 = nsa0, sa1 = nsa1;
        st.advance();
      };
      auto last = [&](float(&cur)[R]) {
        mt::wgmma_wait<0>();
        mt::fence_regs(cur);
        pipe.consumer_release(st, lane);
        mt::promote_row_scaled(acc, cur, sa0, sa1, sb);
        st.advance();
      };
      mt::two_fragment_pipeline(num_kb, part0, part1, step, last);
    }
    if constexpr ((MODE_FLAGS & kNoStore) != 0) {  // keep acc live without storing it (no dead-code removal)
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < R; ++i) sum += acc[i];
      if (sum == 12345.f) p.d[threadIdx.x] = __float2bfloat16(sum);
      continue;
    }
    if constexpr ((MODE_FLAGS & kTmaStore) != 0) {  // as the production kernel's epilogue
      if (tid == 0) mt::tma_store_wait_read<0>();
      mt::named_barrier_sync(1 + mwg, 128);
      uint8_t* d_tile = smem + C::OFF_D;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        uint8_t* base = d_tile + (j / 8) * (C::BLOCK_M * 128);
        const int row_a = 64 * mwg + r0, row_b = row_a + 8;
        *reinterpret_cast<__nv_bfloat162*>(base + mt::sw128_offset(row_a, j % 8) + 4 * (lane % 4)) =
            __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
        *reinterpret_cast<__nv_bfloat162*>(base + mt::sw128_offset(row_b, j % 8) + 4 * (lane % 4)) =
            __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
      }
      mt::fence_proxy_async_smem();
      mt::named_barrier_sync(1 + mwg, 128);
      if (tid == 0) {
#pragma unroll
        for (int h = 0; h < BN / 64; ++h)
          mt::tma_store_2d(&p.d_map, d_tile + h * (C::BLOCK_M * 128) + 64 * mwg * 128, nb * BN + 64 * h,
                           mb * C::BLOCK_M + 64 * mwg);
        mt::tma_store_commit();
      }
      continue;
    }
    // plain BF16 stores: rows r0, r0 + 8 of this warpgroup's 64, columns 8j + 2 (lane % 4)
    __nv_bfloat16* d = p.d + static_cast<size_t>(mb * C::BLOCK_M + 64 * mwg + r0) * p.n + nb * BN + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < R / 4; ++j) {
      *reinterpret_cast<__nv_bfloat162*>(d + 8 * j) = __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
      *reinterpret_cast<__nv_bfloat162*>(d + 8 * static_cast<size_t>(p.n) + 8 * j) =
          __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
  if constexpr ((MODE_FLAGS & kTmaStore) != 0)
    if (tid == 0) mt::tma_store_wait_all();
}

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e = (x);                                                                  \
    if (e != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

struct Variant {
  const char* name;
  int bn, stages;
  std::function<void()> launch;  // one call of the kernel on the shared operands
  std::vector<float> ms;
};

template <int BN, int STAGES, int MODE, int SA = kNoScales>
void add(std::vector<Variant>& vs, const char* name, void* a, void* b, const float* bs, const float* sa,
         __nv_bfloat16* d, int m, int n, int k) {
  using C = Cfg<BN, STAGES, MODE, SA>;
  if (n % BN || m % C::BLOCK_M) return;
  Params p{};
  {
    const uint64_t dims[2] = {(uint64_t)k, (uint64_t)m}, strides[1] = {(uint64_t)k};
    const uint32_t box[2] = {128, (uint32_t)C::BLOCK_M};
    CHECK(mt::encode_tma(&p.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B));
  }
  {
    const uint64_t dims[2] = {(uint64_t)k, (uint64_t)n}, strides[1] = {(uint64_t)k};
    const uint32_t box[2] = {128, (uint32_t)BN};
    CHECK(mt::encode_tma(&p.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, b, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B));
  }
  {
    const uint64_t dims[2] = {(uint64_t)m, (uint64_t)(k / 128)}, strides[1] = {(uint64_t)m * 4};
    const uint32_t box[2] = {(uint32_t)C::BLOCK_M + 4, 1};
    CHECK(mt::encode_tma(&p.sa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, sa, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE));
  }
  {
    const uint64_t dims[2] = {(uint64_t)n, (uint64_t)m}, strides[1] = {(uint64_t)n * 2};
    const uint32_t box[2] = {64, 64};
    CHECK(mt::encode_tma(&p.d_map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, d, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B));
  }
  p.d = d, p.b_scales = bs, p.m = m, p.n = n, p.k = k;
  auto kernel = ceiling_kernel<BN, STAGES, MODE, SA>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int tiles = (m / C::BLOCK_M) * (n / BN), grid = tiles < sms ? tiles : sms;
  vs.push_back({name, BN, STAGES, [=] { kernel<<<grid, C::THREADS, C::SMEM>>>(p); }, {}});
}

// Every variant once per round, in an order rotated each round, each call after an L2 flush: clock and power
// drift over the run falls on all variants alike (timed one variant at a time, the same variant moved by up to
// 10% between blocks at M = 65536).
void time_interleaved(std::vector<Variant>& vs, int rounds) {
  void* flush;
  CHECK(cudaMalloc(&flush, 256 << 20));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (auto& v : vs)
    for (int i = 0; i < 3; ++i) v.launch();
  CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < rounds; ++r)
    for (size_t j = 0; j < vs.size(); ++j) {
      Variant& v = vs[(j + r) % vs.size()];
      CHECK(cudaMemsetAsync(flush, r, 256 << 20));
      cudaEventRecord(e0);
      v.launch();
      cudaEventRecord(e1);
      CHECK(cudaEventSynchronize(e1));
      float t;
      cudaEventElapsedTime(&t, e0, e1);
      v.ms.push_back(t);
    }
  CHECK(cudaGetLastError());
  cudaFree(flush);
}

int main(int argc, char** argv) {
  const int m = argc > 3 ? atoi(argv[1]) : 16384, n = argc > 3 ? atoi(argv[2]) : 4096, k = argc > 3 ? atoi(argv[3]) : 4096;
  if (m % 128 || n % 128 || k % 128) {
    fprintf(stderr, "M, N and K must be multiples of 128 (variants whose tile width does not divide N are skipped)\n");
    return 1;
  }
  std::vector<uint8_t> ha(static_cast<size_t>(m) * k), hb(static_cast<size_t>(n) * k);
  srand(1);
  for (auto& x : ha) x = static_cast<uint8_t>(rand() % 0x70) | (rand() & 0x80);  // finite e4m3, both signs
  for (auto& x : hb) x = static_cast<uint8_t>(rand() % 0x70) | (rand() & 0x80);
  std::vector<float> hs(static_cast<size_t>(n / 128) * (k / 128), 1.0f), hsa(static_cast<size_t>(m) * (k / 128), 1.0f);
  void *a, *b;
  float *bs, *sa;
  __nv_bfloat16* d;
  CHECK(cudaMalloc(&a, ha.size()));
  CHECK(cudaMalloc(&b, hb.size()));
  CHECK(cudaMalloc(&bs, hs.size() * 4));
  CHECK(cudaMalloc(&sa, hsa.size() * 4));
  CHECK(cudaMemcpy(sa, hsa.data(), hsa.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&d, static_cast<size_t>(m) * n * 2));
  CHECK(cudaMemcpy(a, ha.data(), ha.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(b, hb.data(), hb.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(bs, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  printf("dense FP8 GEMM M=%d N=%d K=%d, median of 25 (L2 flushed)\n", m, n, k);
  std::vector<Variant> vs;
  add<128, 6, kPipe>(vs, "pipe128", a, b, bs, sa, d, m, n, k);
  add<128, 5, kPipe | kTmaStore>(vs, "pipe128-tma", a, b, bs, sa, d, m, n, k);
  add<128, 6, kPipe | kNoStore>(vs, "pipe128-nost", a, b, bs, sa, d, m, n, k);
  add<128, 5, kPipe | kTmaStore, kScales>(vs, "prod-like", a, b, bs, sa, d, m, n, k);
  add<128, 5, kPipe | kTmaStore, kScalesAfterIssue>(vs, "prod-like-la", a, b, bs, sa, d, m, n, k);
  add<128, 5, kPipe | kTmaStore | kFastDesc, kScales>(vs, "prod-like-fd", a, b, bs, sa, d, m, n, k);
  add<128, 5, kPipe | kTmaStore | kFastDesc, kScalesAfterIssue>(vs, "prod-like-fd-la", a, b, bs, sa, d, m, n, k);
  add<128, 6, kSerial>(vs, "serial128", a, b, bs, sa, d, m, n, k);
  // DeepGEMM's shape of the math with everything the production kernel learned since (one-add descriptors, TMA
  // store): is serial promotion on 192-wide tiles faster once the descriptor rebuild is off its critical path?
  add<128, 5, kPipe | kTmaStore | kFastDesc>(vs, "pipe128-tma-fd", a, b, bs, sa, d, m, n, k);
  add<128, 5, kSerial | kTmaStore | kFastDesc>(vs, "serial128-tma-fd", a, b, bs, sa, d, m, n, k);
  add<192, 4, kSerial | kTmaStore | kFastDesc>(vs, "serial192-tma-fd", a, b, bs, sa, d, m, n, k);
  add<192, 4, kNone | kTmaStore | kFastDesc>(vs, "none192-tma-fd", a, b, bs, sa, d, m, n, k);
  add<128, 4, kSerial | kTmaStore | kFastDesc | kMath3>(vs, "serial128x3-tma-fd", a, b, bs, sa, d, m, n, k);
  add<128, 4, kNone | kTmaStore | kFastDesc | kMath3>(vs, "none128x3-tma-fd", a, b, bs, sa, d, m, n, k);
  // the production kernels' per-block scales (A: per-stage TMA + 2 LDS, B: LDG), fetched a block ahead
  add<128, 4, kSerial | kTmaStore | kFastDesc | kMath3, kScales>(vs, "prod-serial128x3", a, b, bs, sa, d, m, n, k);
  add<192, 4, kSerial | kTmaStore | kFastDesc, kScales>(vs, "prod-serial192", a, b, bs, sa, d, m, n, k);
  add<128, 5, kNone | kTmaStore>(vs, "none128-tma", a, b, bs, sa, d, m, n, k);
  add<256, 3, kNone | kTmaStore>(vs, "none256-tma", a, b, bs, sa, d, m, n, k);
  if (argc > 5 && std::string(argv[4]) == "--only") {  // one variant, launched twice (for ncu: --launch-skip 1)
    for (auto& v : vs)
      if (v.name == std::string(argv[5])) {
        v.launch();
        v.launch();
        CHECK(cudaDeviceSynchronize());
        printf("ran %s twice\n", v.name);
        return 0;
      }
    fprintf(stderr, "no variant named %s\n", argv[5]);
    return 1;
  }
  // every variant that promotes (all scales are 1) must give the bits of pipe128; "none" ones accumulate differently
  std::vector<uint16_t> ref(static_cast<size_t>(m) * n), got(ref.size());
  vs[0].launch();
  CHECK(cudaMemcpy(ref.data(), d, ref.size() * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 1; i < vs.size(); ++i) {
    if (std::string(vs[i].name).rfind("none", 0) == 0 || std::string(vs[i].name).find("nost") != std::string::npos) continue;
    CHECK(cudaMemset(d, 0, got.size() * 2));
    vs[i].launch();
    CHECK(cudaMemcpy(got.data(), d, got.size() * 2, cudaMemcpyDeviceToHost));
    printf("%-16s == pipe128 bits: %s\n", vs[i].name, got == ref ? "yes" : "NO");
  }
  time_interleaved(vs, 25);
  for (auto& v : vs) {
    std::sort(v.ms.begin(), v.ms.end());
    const double med = v.ms[v.ms.size() / 2];
    printf("%-18s BN=%3d stages=%d  %8.3f ms  %7.1f TFLOPS\n", v.name, v.bn, v.stages, med, 2.0 * m * n * k / (med * 1e-3) / 1e12);
  }
  return 0;
}
