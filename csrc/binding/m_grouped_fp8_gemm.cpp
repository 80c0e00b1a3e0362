// torch binding of the M-grouped FP8 GEMM: checks what the kernel assumes, then launches. The Python wrapper
// (megatron_tma/gemm.py) holds the argument rules and gives the users' errors first, on every backend; these
// checks keep the op safe where no Python runs (torch.compile graphs, direct torch.ops calls) and raise the same
// Python types (TypeError / ValueError).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "megatron_tma/host/m_grouped_fp8_gemm.h"

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

megatron_tma::GroupsArg groups_arg(const at::Tensor& groups, int64_t num_groups) {
  TORCH_CHECK_TYPE(groups.scalar_type() == at::kInt || groups.scalar_type() == at::kLong,
                   "groups must be int32 or int64, got ", groups.scalar_type());
  TORCH_CHECK_VALUE(groups.is_cuda() && groups.dim() == 1 && groups.is_contiguous(),
                    "groups must be a contiguous 1-D CUDA tensor");
  TORCH_CHECK_VALUE(groups.numel() == num_groups || groups.numel() == num_groups + 1, "groups must hold G=",
                    num_groups, " sizes or G+1 offsets, got ", groups.numel(), " entries");
  return {groups.data_ptr(), static_cast<int>(num_groups), groups.scalar_type() == at::kLong ? 1 : 0,
          groups.numel() == num_groups + 1 ? 1 : 0};
}

void m_grouped_fp8_gemm_out(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b,
                            const at::Tensor& b_scales, const at::Tensor& groups, at::Tensor& out, int64_t block_n,
                            int64_t block_m) {
  TORCH_CHECK_TYPE(a.scalar_type() == at::kFloat8_e4m3fn && b.scalar_type() == at::kFloat8_e4m3fn,
                   "a and b must be float8_e4m3fn, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK_TYPE(a_scales.scalar_type() == at::kFloat && b_scales.scalar_type() == at::kFloat,
                   "a_scales and b_scales must be float32");
  TORCH_CHECK_TYPE(out.scalar_type() == at::kBFloat16, "out must be bfloat16, got ", out.scalar_type());
  TORCH_CHECK_VALUE(a.is_cuda() && a.dim() == 2 && a.is_contiguous(), "a must be a contiguous [M, K] CUDA tensor");
  TORCH_CHECK_VALUE(b.is_cuda() && b.dim() == 3 && b.is_contiguous(), "b must be a contiguous [G, N, K] CUDA tensor");
  const int64_t M = a.size(0), K = a.size(1), G = b.size(0), N = b.size(1);
  TORCH_CHECK_VALUE(b.size(2) == K, "b's K (", b.size(2), ") differs from a's K (", K, ")");
  TORCH_CHECK_VALUE(K % 128 == 0 && K > 0, "K must be a positive multiple of 128, got ", K);
  TORCH_CHECK_VALUE(N % 16 == 0 && N > 0, "N must be a positive multiple of 16, got ", N);
  TORCH_CHECK_VALUE(G <= megatron_tma::m_grouped_fp8_gemm_max_groups(), "at most ",
                    megatron_tma::m_grouped_fp8_gemm_max_groups(), " groups are supported, got ", G);
  TORCH_CHECK_VALUE(a_scales.is_cuda() && a_scales.dim() == 2 && a_scales.size(0) == M && a_scales.size(1) == K / 128 &&
                        (a_scales.stride(0) == 1 || M <= 1) && a_scales.stride(1) >= M &&
                        a_scales.stride(1) % 4 == 0 && aligned16(a_scales),
                    "a_scales must be the [M, K/128] M-contiguous view from quantize_1x128");
  TORCH_CHECK_VALUE(b_scales.is_cuda() && b_scales.is_contiguous() && b_scales.dim() == 3 && b_scales.size(0) == G &&
                        b_scales.size(1) == (N + 127) / 128 && b_scales.size(2) == K / 128,
                    "b_scales must be a contiguous [G, ceil(N/128), K/128] tensor");
  TORCH_CHECK_VALUE(out.is_cuda() && out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.stride(1) == 1 &&
                        out.stride(0) % 8 == 0 && aligned16(out),
                    "out must be an [M, N] tensor with unit column stride and 16-byte aligned rows");
  TORCH_CHECK_VALUE(aligned16(a) && aligned16(b), "a and b must be 16-byte aligned");
  TORCH_CHECK_VALUE(block_n == 0 || block_n == 128 || block_n == 192 || block_n == 256,
                    "block_n must be 0 (auto), 128, 192 or 256, got ", block_n);
  TORCH_CHECK_VALUE(block_m == 0 || block_m == 128 || block_m == 192, "block_m must be 0 (auto), 128 or 192, got ",
                    block_m);
  TORCH_CHECK_VALUE(block_m != 192 || block_n == 0 || block_n == 128, "block_m=192 tiles are 128 wide, got block_n=",
                    block_n);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&a_scales, &b, &b_scales, &groups, &out})
    TORCH_CHECK_VALUE(t->device() == a.device(), "all tensors must be on one device (", a.device(), " and ",
                      t->device(), ")");
  c10::cuda::CUDAGuard guard(a.device());
  megatron_tma::MGroupedGemmArgs args{};
  args.a = a.data_ptr();
  args.a_scales = a_scales.data_ptr<float>();
  args.a_scales_ld = static_cast<int>(a_scales.stride(1));
  args.b = b.data_ptr();
  args.b_scales = b_scales.data_ptr<float>();
  args.d = out.data_ptr();
  args.d_ld = static_cast<int>(out.stride(0));
  args.m_total = static_cast<int>(M);
  args.n = static_cast<int>(N);
  args.k = static_cast<int>(K);
  args.groups = groups_arg(groups, G);
  args.block_n = static_cast<int>(block_n);
  args.block_m = static_cast<int>(block_m);
  const cudaError_t err = megatron_tma::m_grouped_fp8_gemm(args, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "m_grouped_fp8_gemm launch failed: ", cudaGetErrorString(err));
}

// [block_m, block_n] of the tile m_grouped_fp8_gemm_out launches for these sizes (on the current device).
std::vector<int64_t> m_grouped_fp8_gemm_tile(int64_t m_total, int64_t n, int64_t num_groups, int64_t block_n,
                                             int64_t block_m) {
  TORCH_CHECK_VALUE(m_total >= 0 && n > 0 && num_groups >= 1, "m_total >= 0, n > 0 and num_groups >= 1 are required");
  const megatron_tma::MGroupedTileShape t = megatron_tma::m_grouped_fp8_gemm_tile(
      m_total, n, static_cast<int>(num_groups), static_cast<int>(block_m), static_cast<int>(block_n));
  TORCH_CHECK_VALUE(t.block_m != 0, "no such tile: block_m=", block_m, ", block_n=", block_n);
  return {t.block_m, t.block_n};
}

}  // namespace

// m_grouped_fp8_gemm_out's schema is megatron_tma/ops.py's (with the CPU and fake kernels): its CUDA kernel is
// registered below. The tile query (host ints in and out, the launcher's choice) is no device op: defined here.
TORCH_LIBRARY_FRAGMENT(megatron_tma, m) {
  m.def("m_grouped_fp8_gemm_tile(int m_total, int n, int num_groups, int block_n=0, int block_m=0) -> int[]",
        &m_grouped_fp8_gemm_tile);
}

TORCH_LIBRARY_IMPL(megatron_tma, CUDA, m) { m.impl("m_grouped_fp8_gemm_out", &m_grouped_fp8_gemm_out); }
