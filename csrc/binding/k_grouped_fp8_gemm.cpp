// torch binding of the K-grouped (weight-gradient) FP8 GEMM: checks what the kernel assumes, then launches. The
// Python wrapper (megatron_tma/gemm.py) holds the argument rules and gives the users' errors first, on every
// backend; these checks keep the op safe where no Python runs (torch.compile graphs, direct torch.ops calls) and
// raise the same Python types (TypeError / ValueError).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "megatron_tma/host/k_grouped_fp8_gemm.h"

namespace {

void check_token_major(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat8_e4m3fn, name, " must be float8_e4m3fn, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_cuda() && t.dim() == 2, name, " must be a 2-D CUDA tensor [rows, P]");
  TORCH_CHECK_VALUE(t.size(0) > 0 && t.size(1) >= 16 && t.size(1) % 16 == 0 && t.stride(1) == 1 &&
                        t.stride(0) % 16 == 0 && t.stride(0) >= t.size(1),
                    name, " must be the token-contiguous [rows, P] operand of quantize_grouped_128x1 (P a positive "
                    "multiple of 16, row pitch a multiple of 16 and >= P), got shape ", t.sizes(), " and strides ",
                    t.strides());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

void k_grouped_fp8_gemm_out(const at::Tensor& dy_t, const at::Tensor& dy_t_scales, const at::Tensor& x_t,
                            const at::Tensor& x_t_scales, const at::Tensor& groups, at::Tensor& out,
                            bool accumulate, int64_t block_m) {
  TORCH_CHECK_VALUE(block_m == 0 || block_m == 128 || block_m == 192, "block_m must be 0 (auto), 128 or 192, got ",
                    block_m);
  check_token_major(dy_t, "dy_t");
  check_token_major(x_t, "x_t");
  const int64_t N = dy_t.size(0), P = dy_t.size(1), K = x_t.size(0);
  TORCH_CHECK_VALUE(x_t.size(1) == P && x_t.stride(0) == dy_t.stride(0),
                    "dy_t and x_t must have the same columns and pitch");
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
                   "out must be float32 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.is_cuda() && out.is_contiguous() && out.dim() == 3 && out.size(1) == N && out.size(2) == K,
                    "out must be a contiguous [G, N, K] tensor");
  TORCH_CHECK_TYPE(!accumulate || out.scalar_type() == at::kFloat, "accumulate=True needs an FP32 out");
  const int64_t G = out.size(0);
  TORCH_CHECK_VALUE(G >= 1 && G <= megatron_tma::k_grouped_fp8_gemm_max_groups(), "G must be in [1, ",
                    megatron_tma::k_grouped_fp8_gemm_max_groups(), "], got ", G);
  TORCH_CHECK_VALUE(N % 16 == 0 && K % 16 == 0, "N and K must be positive multiples of 16");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&dy_t_scales, &x_t, &x_t_scales, &groups, &out})
    TORCH_CHECK_VALUE(t->device() == dy_t.device(), "all tensors must be on one device (", dy_t.device(), " and ",
                      t->device(), ")");
  const int64_t MB = dy_t_scales.dim() == 2 ? dy_t_scales.size(0) : -1;
  for (auto* s : {&dy_t_scales, &x_t_scales}) {
    TORCH_CHECK_TYPE(s->scalar_type() == at::kFloat, "token-block scales must be float32, got ", s->scalar_type());
    TORCH_CHECK_VALUE(s->is_contiguous() && s->dim() == 2 && s->size(0) == MB && MB >= G,
                      "token-block scales must be contiguous [M_total // 128 + G, rows]");
  }
  TORCH_CHECK_VALUE(dy_t_scales.size(1) == N && x_t_scales.size(1) == K, "scale widths must be N and K");
  TORCH_CHECK_VALUE(P >= 128 * MB, "the operands' ", P, " columns cannot hold M_total >= ", 128 * (MB - G),
                    " tokens of ", G, " groups starting on 128-token boundaries (P >= 128 MB: quantize_grouped_128x1 "
                    "allocates P = round_up(M_total, 128) + 128 G and MB = M_total // 128 + G)");
  TORCH_CHECK_TYPE(groups.scalar_type() == at::kInt || groups.scalar_type() == at::kLong,
                   "groups must be int32 or int64, got ", groups.scalar_type());
  TORCH_CHECK_VALUE(groups.is_cuda() && groups.dim() == 1 && groups.is_contiguous() &&
                        (groups.numel() == G || groups.numel() == G + 1),
                    "groups must be a contiguous CUDA tensor of G sizes or G+1 offsets");
  TORCH_CHECK_VALUE(P <= INT32_MAX && dy_t.stride(0) <= INT32_MAX && MB <= INT32_MAX, "too many tokens");
  c10::cuda::CUDAGuard guard(dy_t.device());
  megatron_tma::KGroupedGemmArgs args{};
  args.a = dy_t.data_ptr();
  args.a_scales = dy_t_scales.data_ptr<float>();
  args.b = x_t.data_ptr();
  args.b_scales = x_t_scales.data_ptr<float>();
  args.p_tokens = static_cast<int>(P);
  args.pitch = static_cast<int>(dy_t.stride(0));
  args.num_blocks_max = static_cast<int>(MB);
  args.d = out.data_ptr();
  args.out_bf16 = out.scalar_type() == at::kBFloat16;
  args.accumulate = accumulate;
  args.n = static_cast<int>(N);
  args.k = static_cast<int>(K);
  args.groups = {groups.data_ptr(), static_cast<int>(G), groups.scalar_type() == at::kLong ? 1 : 0,
                 groups.numel() == G + 1 ? 1 : 0};
  args.block_m = static_cast<int>(block_m);
  const cudaError_t err = megatron_tma::k_grouped_fp8_gemm(args, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "k_grouped_fp8_gemm launch failed: ", cudaGetErrorString(err));
}

// [block_m, block_n] of the tile k_grouped_fp8_gemm_out launches for these sizes (on the current device).
std::vector<int64_t> k_grouped_fp8_gemm_tile(int64_t n, int64_t k, int64_t num_groups, bool out_bf16,
                                             int64_t block_m) {
  TORCH_CHECK_VALUE(n > 0 && k > 0 && num_groups >= 1, "n > 0, k > 0 and num_groups >= 1 are required");
  const int bm = megatron_tma::k_grouped_fp8_gemm_block_m(n, k, static_cast<int>(num_groups), out_bf16,
                                                          static_cast<int>(block_m));
  TORCH_CHECK_VALUE(bm != 0, "block_m must be 0 (auto), 128 or 192, got ", block_m);
  return {bm, 128};
}

}  // namespace

// k_grouped_fp8_gemm_out's schema is megatron_tma/ops.py's (with the CPU and fake kernels): its CUDA kernel is
// registered below. The tile query (host ints in and out, the launcher's choice) is no device op: defined here.
TORCH_LIBRARY_FRAGMENT(megatron_tma, m) {
  m.def("k_grouped_fp8_gemm_tile(int n, int k, int num_groups, bool out_bf16=False, int block_m=0) -> int[]",
        &k_grouped_fp8_gemm_tile);
}

TORCH_LIBRARY_IMPL(megatron_tma, CUDA, m) { m.impl("k_grouped_fp8_gemm_out", &k_grouped_fp8_gemm_out); }
