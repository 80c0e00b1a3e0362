// torch binding of the padded-path gather kernels (instantiations/pad_gather.cu): checks what the kernels
// assume, allocates, launches on the current stream. The Python wrappers (megatron_tma/padding.py) give the
// same errors first; these checks keep the ops safe when called directly through torch.ops.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "megatron_tma/host/pad_gather.h"

namespace {

using megatron_tma::kPadGatherMaxRows;

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

megatron_tma::GroupsArg groups_arg(const at::Tensor& groups, int64_t num_groups, const at::Tensor& like) {
  TORCH_CHECK_VALUE(num_groups >= 1 && num_groups <= megatron_tma::kPadGatherMaxGroups,
                    "the number of groups must be in [1, ", megatron_tma::kPadGatherMaxGroups, "], got ", num_groups);
  TORCH_CHECK_TYPE(groups.scalar_type() == at::kInt || groups.scalar_type() == at::kLong,
                   "groups must be int32 or int64, got ", groups.scalar_type());
  TORCH_CHECK_VALUE(groups.device() == like.device() && groups.dim() == 1 && groups.is_contiguous(),
                    "groups must be a contiguous 1-D tensor on ", like.device());
  TORCH_CHECK_VALUE(groups.numel() == num_groups || groups.numel() == num_groups + 1, "groups must hold G=",
                    num_groups, " sizes or G+1 offsets, got ", groups.numel(), " entries");
  return {groups.data_ptr(), static_cast<int>(num_groups), groups.scalar_type() == at::kLong ? 1 : 0,
          groups.numel() == num_groups + 1 ? 1 : 0};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pad_rows_fp8(const at::Tensor& a, const at::Tensor& a_scales,
                                                            const at::Tensor& groups, int64_t num_groups,
                                                            int64_t align) {
  TORCH_CHECK_TYPE(a.scalar_type() == at::kFloat8_e4m3fn, "a must be float8_e4m3fn, got ", a.scalar_type());
  TORCH_CHECK_VALUE(a.is_cuda() && a.dim() == 2 && a.is_contiguous() && aligned16(a),
                    "a must be a contiguous, 16-byte aligned [M, K] CUDA tensor");
  const int64_t M = a.size(0), K = a.size(1), KB = (K + 127) / 128;
  TORCH_CHECK_VALUE(K % 16 == 0, "K must be a multiple of 16 (rows are copied as 16-byte vectors), got ", K);
  TORCH_CHECK_VALUE(align >= 16 && align % 16 == 0, "align must be a positive multiple of 16, got ", align);
  TORCH_CHECK_TYPE(a_scales.scalar_type() == at::kFloat, "a_scales must be float32, got ", a_scales.scalar_type());
  TORCH_CHECK_VALUE(a_scales.device() == a.device() && a_scales.dim() == 2 && a_scales.size(0) == M &&
                        a_scales.size(1) == KB,
                    "a_scales must be a [M, ceil(K/128)] = [", M, ", ", KB, "] tensor on ", a.device());
  TORCH_CHECK_VALUE((M <= 1 || a_scales.stride(0) == 1) && (KB <= 1 || a_scales.stride(1) >= M),
                    "a_scales must be M-contiguous (storage [ceil(K/128), ceil(M/4)*4], viewed transposed), got "
                    "strides ",
                    a_scales.strides());
  const megatron_tma::GroupsArg groups_desc = groups_arg(groups, num_groups, a);
  const int64_t m_pad = megatron_tma::padded_rows_upper_bound(M, num_groups, align);
  TORCH_CHECK_VALUE(m_pad <= kPadGatherMaxRows, "the padded buffers would have ", m_pad, " rows; at most ",
                    kPadGatherMaxRows, " are supported");

  c10::cuda::CUDAGuard guard(a.device());
  at::Tensor a_pad = at::empty({m_pad, K}, a.options());
  // Scale storage [KB, m_pad], M contiguous; m_pad is a multiple of align, hence of 4 (the layout's pitch).
  at::Tensor scales_storage = at::empty({KB, m_pad}, a_scales.options());
  at::Tensor padded_offsets = at::empty({num_groups + 1}, groups.options().dtype(at::kInt));
  const cudaError_t err = megatron_tma::pad_rows_fp8(
      a.data_ptr(), a_scales.data_ptr<float>(), a_scales.stride(1), a_pad.data_ptr(), scales_storage.data_ptr<float>(),
      padded_offsets.data_ptr<int32_t>(), groups_desc, M, m_pad, K, align, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "pad_rows_fp8 launch failed: ", cudaGetErrorString(err));
  return {a_pad, scales_storage.t(), padded_offsets};
}

void unpad_rows_bf16(const at::Tensor& y_pad, const at::Tensor& groups, const at::Tensor& padded_offsets,
                     const at::Tensor& out) {
  TORCH_CHECK_TYPE(y_pad.scalar_type() == at::kBFloat16, "y_pad must be bfloat16, got ", y_pad.scalar_type());
  TORCH_CHECK_VALUE(y_pad.is_cuda() && y_pad.dim() == 2 && y_pad.is_contiguous() && aligned16(y_pad),
                    "y_pad must be a contiguous, 16-byte aligned [M_pad, N] CUDA tensor");
  const int64_t N = y_pad.size(1);
  TORCH_CHECK_VALUE(N > 0 && N % 8 == 0,
                    "N must be a positive multiple of 8 (rows are copied as 16-byte vectors), got ", N);
  TORCH_CHECK_TYPE(padded_offsets.scalar_type() == at::kInt, "padded_offsets must be int32, got ",
                   padded_offsets.scalar_type());
  TORCH_CHECK_VALUE(padded_offsets.device() == y_pad.device() && padded_offsets.dim() == 1 &&
                        padded_offsets.is_contiguous() && padded_offsets.numel() >= 2,
                    "padded_offsets must be a contiguous 1-D [G+1] tensor (G >= 1) on ", y_pad.device());
  const megatron_tma::GroupsArg groups_desc = groups_arg(groups, padded_offsets.numel() - 1, y_pad);
  TORCH_CHECK_TYPE(out.scalar_type() == at::kBFloat16, "out must be bfloat16, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.device() == y_pad.device() && out.dim() == 2 && out.size(1) == N && out.is_contiguous() &&
                        aligned16(out),
                    "out must be a contiguous, 16-byte aligned [M, ", N, "] tensor on ", y_pad.device());
  at::assert_no_overlap(out, y_pad);
  TORCH_CHECK_VALUE(y_pad.size(0) <= kPadGatherMaxRows && out.size(0) <= kPadGatherMaxRows, "at most ",
                    kPadGatherMaxRows, " rows are supported");

  c10::cuda::CUDAGuard guard(y_pad.device());
  const cudaError_t err =
      megatron_tma::unpad_rows_bf16(y_pad.data_ptr(), y_pad.size(0), groups_desc, padded_offsets.data_ptr<int32_t>(),
                                    out.data_ptr(), out.size(0), N, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "unpad_rows_bf16 launch failed: ", cudaGetErrorString(err));
}

}  // namespace

// The schemas are megatron_tma/ops.py's (with the CPU and fake kernels): this file registers the CUDA kernels only.
TORCH_LIBRARY_IMPL(megatron_tma, CUDA, m) {
  m.impl("pad_rows_fp8", &pad_rows_fp8);
  m.impl("unpad_rows_bf16", &unpad_rows_bf16);
}
