// torch binding of the MoE un-permutation (instantiations/combine_rows.cu): checks what the kernel assumes,
// allocates the output, launches on the current stream. megatron_tma/permutation.py gives the same errors first and
// registers the fake (meta) implementation.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "megatron_tma/host/combine_rows.h"

namespace {

// out [T, H] bf16: row t = the FP32 sum of rows token_rows[t, 0..k-1] of y, in that order, rounded once.
at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& token_rows) {
  TORCH_CHECK_TYPE(y.scalar_type() == at::kBFloat16, "y must be bfloat16, got ", y.scalar_type());
  TORCH_CHECK_VALUE(y.is_cuda() && y.dim() == 2 && y.is_contiguous(), "y must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK_VALUE(y.size(1) % 8 == 0, "the last dim of y must be a multiple of 8 (16-byte rows), got ", y.size(1));
  TORCH_CHECK_VALUE(y.numel() == 0 || reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0,
                    "y must be 16-byte aligned");
  TORCH_CHECK_TYPE(token_rows.scalar_type() == at::kInt, "token_rows must be int32, got ", token_rows.scalar_type());
  TORCH_CHECK_VALUE(token_rows.device() == y.device() && token_rows.dim() == 2 && token_rows.is_contiguous(),
                    "token_rows must be a contiguous [T, k] tensor on ", y.device());
  const int64_t T = token_rows.size(0), k = token_rows.size(1), H = y.size(1);
  TORCH_CHECK_VALUE(k >= 1 && k <= megatron_tma::kCombineMaxRowsPerToken, "token_rows must have 1..",
                    megatron_tma::kCombineMaxRowsPerToken, " rows per token, got ", k);
  TORCH_CHECK_VALUE(T == 0 || y.size(0) > 0, "token_rows name rows of y, which has none");
  c10::cuda::CUDAGuard guard(y.device());
  at::Tensor out = at::empty({T, H}, y.options());
  const cudaError_t err = megatron_tma::combine_rows_bf16(y.data_ptr(), y.size(0), token_rows.data_ptr<int32_t>(), T,
                                                          k, H, out.data_ptr(), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "combine_rows launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

// The schema is megatron_tma/ops.py's (with the CPU and fake kernels): this file registers the CUDA kernel only.
TORCH_LIBRARY_IMPL(megatron_tma, CUDA, m) { m.impl("combine_rows", &combine_rows); }
