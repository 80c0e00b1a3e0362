// torch binding of the FP8 block quantizers (instantiations/quantize.cu): checks what the kernels assume,
// allocates every output here in its docs/layouts.md layout (torch.empty: the kernels write all bytes,
// padding included), launches on the current stream. megatron_tma/quant.py gives the same errors first
// (megatron_tma/ops.py defines the ops and their fake kernels); these checks keep the ops safe through torch.ops.
#include <climits>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "megatron_tma/host/quantize.h"

namespace {

using megatron_tma::QuantInput;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The data input of every quantizer: a contiguous bf16/fp16 CUDA tensor of `dim` dims whose last dim
// (the contiguous one) is a multiple of 16, so that every row is a whole number of 16-byte vectors.
QuantInput check_input(const at::Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, name,
                   " must have dtype bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.is_cuda(), name, " must be a CUDA tensor, got one on ", x.device());
  TORCH_CHECK_VALUE(x.dim() == dim, name, " must be ", dim, "-D, got shape ", x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), name, " must be contiguous, got strides ", x.strides());
  TORCH_CHECK_VALUE(x.size(-1) % 16 == 0, "the last dim of ", name,
                    " must be a multiple of 16 (rows move as 16-byte vectors), got ", x.size(-1));
  TORCH_CHECK_VALUE(x.numel() == 0 || aligned16(x), name, " must be 16-byte aligned");
  return x.scalar_type() == at::kBFloat16 ? QuantInput::kBf16 : QuantInput::kFp16;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
}

// (q [M, K] e4m3, s [M, ceil(K/128)] fp32 viewing storage [ceil(K/128), ceil(M/4)*4], strides (1, M_pad))
std::tuple<at::Tensor, at::Tensor> quantize_1x128(const at::Tensor& x, bool pow2) {
  const QuantInput in = check_input(x, "x", 2);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t m_pad = cdiv(M, 4) * 4;
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor s = at::empty({cdiv(K, 128), m_pad}, x.options().dtype(at::kFloat));
  check_launch(megatron_tma::quantize_1x128(x.data_ptr(), in, M, K, pow2, q.data_ptr(), s.data_ptr<float>(), m_pad,
                                            at::cuda::getCurrentCUDAStream()),
               "quantize_1x128");
  return {q, s.narrow(1, 0, M).t()};
}

// (q [G, N, K], s [G, ceil(N/128), ceil(K/128)], qt [G, K, N], st [G, ceil(K/128), ceil(N/128)]) of w, checked.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> weights_128x128(const at::Tensor& w, QuantInput in,
                                                                           bool pow2) {
  const int64_t G = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK_VALUE(N % 16 == 0, "N (dim 1 of w) must be a multiple of 16 (the rows of the transposed copy move "
                    "as 16-byte vectors), got ", N);
  c10::cuda::CUDAGuard guard(w.device());
  const at::TensorOptions fp8 = w.options().dtype(at::kFloat8_e4m3fn), f32 = w.options().dtype(at::kFloat);
  at::Tensor q = at::empty({G, N, K}, fp8);
  at::Tensor s = at::empty({G, cdiv(N, 128), cdiv(K, 128)}, f32);
  at::Tensor qt = at::empty({G, K, N}, fp8);
  at::Tensor st = at::empty({G, cdiv(K, 128), cdiv(N, 128)}, f32);
  check_launch(megatron_tma::quantize_128x128(w.data_ptr(), in, G, N, K, pow2, q.data_ptr(), s.data_ptr<float>(),
                                              qt.data_ptr(), st.data_ptr<float>(), at::cuda::getCurrentCUDAStream()),
               "quantize_128x128");
  return {q, s, qt, st};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_128x128(const at::Tensor& w, bool pow2) {
  return weights_128x128(w, check_input(w, "w", 3), pow2);
}

// FP32 master weights [G, N, K] quantized as their BF16 rounding: quantize_128x128(master.bfloat16())'s bytes, without
// the BF16 copy (the FP8 weights a mixed-precision optimizer's step writes straight from its masters).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_128x128_from_master(const at::Tensor& master,
                                                                                       bool pow2) {
  TORCH_CHECK_TYPE(master.scalar_type() == at::kFloat, "master must have dtype float32, got ", master.scalar_type());
  TORCH_CHECK_VALUE(master.is_cuda(), "master must be a CUDA tensor, got one on ", master.device());
  TORCH_CHECK_VALUE(master.dim() == 3, "master must be 3-D, got shape ", master.sizes());
  TORCH_CHECK_VALUE(master.is_contiguous(), "master must be contiguous, got strides ", master.strides());
  TORCH_CHECK_VALUE(master.size(-1) % 16 == 0, "the last dim of master must be a multiple of 16, got ",
                    master.size(-1));
  TORCH_CHECK_VALUE(master.numel() == 0 || aligned16(master), "master must be 16-byte aligned");
  return weights_128x128(master, QuantInput::kFp32Master, pow2);
}

void check_buffer(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
                  const at::Tensor& w) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == w.device() && t.is_contiguous() && t.sizes() == shape, name,
                    " must be a contiguous ", shape, " tensor on ", w.device(), ", got ", t.sizes(), " on ", t.device());
  TORCH_CHECK_VALUE(dtype != at::kFloat8_e4m3fn || t.numel() == 0 || aligned16(t), name, " must be 16-byte aligned");
}

// quantize_128x128 into the caller's buffers unless `done` already equals `version` (decided on the device; then
// done = version): the FP8 weight copies a CUDA graph holds, refreshed on replay only after an optimizer step.
void quantize_128x128_refresh(const at::Tensor& w, bool pow2, const at::Tensor& q, const at::Tensor& s,
                              const std::optional<at::Tensor>& qt, const std::optional<at::Tensor>& st,
                              const at::Tensor& version, const at::Tensor& done) {
  const QuantInput in = check_input(w, "w", 3);
  const int64_t G = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK_VALUE(N % 16 == 0, "N (dim 1 of w) must be a multiple of 16, got ", N);
  TORCH_CHECK_VALUE(qt.has_value() == st.has_value(), "qt and st are given together or not at all");
  check_buffer(q, "q", at::kFloat8_e4m3fn, {G, N, K}, w);
  check_buffer(s, "s", at::kFloat, {G, cdiv(N, 128), cdiv(K, 128)}, w);
  if (qt.has_value()) {
    check_buffer(*qt, "qt", at::kFloat8_e4m3fn, {G, K, N}, w);
    check_buffer(*st, "st", at::kFloat, {G, cdiv(K, 128), cdiv(N, 128)}, w);
  }
  check_buffer(version, "version", at::kLong, {}, w);
  check_buffer(done, "done", at::kLong, {}, w);
  c10::cuda::CUDAGuard guard(w.device());
  check_launch(megatron_tma::quantize_128x128_refresh(
                   w.data_ptr(), in, G, N, K, pow2, q.data_ptr(), s.data_ptr<float>(),
                   qt.has_value() ? qt->data_ptr() : nullptr, st.has_value() ? st->data_ptr<float>() : nullptr,
                   version.data_ptr<int64_t>(), done.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream()),
               "quantize_128x128_refresh");
}

// (qt [G, K, N] e4m3, st [G, ceil(K/128), ceil(N/128)] fp32) from quantize_128x128's (q, s): its qt and st bytes.
std::tuple<at::Tensor, at::Tensor> transpose_128x128(const at::Tensor& q, const at::Tensor& s) {
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat8_e4m3fn, "q must have dtype float8_e4m3fn, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.is_cuda() && q.dim() == 3 && q.is_contiguous(), "q must be a contiguous 3-D CUDA tensor, got ",
                    q.sizes(), " on ", q.device());
  const int64_t G = q.size(0), N = q.size(1), K = q.size(2);
  TORCH_CHECK_VALUE(N % 16 == 0 && K % 16 == 0, "N and K (dims 1, 2 of q) must be multiples of 16, got ", N, ", ", K);
  TORCH_CHECK_VALUE(q.numel() == 0 || aligned16(q), "q must be 16-byte aligned");
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "s must have dtype float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE(s.device() == q.device() && s.is_contiguous() &&
                        s.sizes() == at::IntArrayRef({G, cdiv(N, 128), cdiv(K, 128)}),
                    "s must be a contiguous [G, ceil(N/128), ceil(K/128)] = [", G, ", ", cdiv(N, 128), ", ",
                    cdiv(K, 128), "] tensor on ", q.device(), ", got ", s.sizes(), " on ", s.device());
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor qt = at::empty({G, K, N}, q.options());
  at::Tensor st = at::empty({G, cdiv(K, 128), cdiv(N, 128)}, s.options());
  check_launch(megatron_tma::transpose_128x128(q.data_ptr(), s.data_ptr<float>(), G, N, K, qt.data_ptr(),
                                               st.data_ptr<float>(), at::cuda::getCurrentCUDAStream()),
               "transpose_128x128");
  return {qt, st};
}

megatron_tma::GroupsArg check_groups(const at::Tensor& groups, int64_t num_groups, const at::Tensor& x) {
  TORCH_CHECK_VALUE(num_groups >= 1 && num_groups <= megatron_tma::kQuantizeGroupedMaxGroups,
                    "the number of groups must be in [1, ", megatron_tma::kQuantizeGroupedMaxGroups, "], got ",
                    num_groups);
  TORCH_CHECK_TYPE(groups.scalar_type() == at::kInt || groups.scalar_type() == at::kLong,
                   "groups must be int32 or int64, got ", groups.scalar_type());
  TORCH_CHECK_VALUE(groups.device() == x.device() && groups.dim() == 1 && groups.is_contiguous(),
                    "groups must be a contiguous 1-D tensor on ", x.device());
  TORCH_CHECK_VALUE(groups.numel() == num_groups || groups.numel() == num_groups + 1, "groups must hold G=",
                    num_groups, " sizes or G+1 offsets, got ", groups.numel(), " entries");
  return {groups.data_ptr(), static_cast<int>(num_groups), groups.scalar_type() == at::kLong ? 1 : 0,
          groups.numel() == num_groups + 1 ? 1 : 0};
}

// qt's row pitch P = round_up(M, 128) + 128 G (docs/design.md §4), from M and G alone: no host read of the groups.
int64_t checked_wgrad_pitch(int64_t M, int64_t num_groups) {
  const int64_t P = megatron_tma::wgrad_pitch(M, num_groups);
  TORCH_CHECK_VALUE(P <= INT_MAX, "round_up(M, 128) + 128 G (the qt row pitch) must fit in int32, got ", P);
  return P;
}

// (qt [K, P] e4m3 contiguous, group g's tokens at columns [a_g, a_g + M_g), the rest 0; s [M/128 + G, K] fp32)
std::tuple<at::Tensor, at::Tensor> quantize_grouped_128x1(const at::Tensor& x, const at::Tensor& groups,
                                                          int64_t num_groups, bool pow2) {
  const QuantInput in = check_input(x, "x", 2);
  const megatron_tma::GroupsArg desc = check_groups(groups, num_groups, x);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t P = checked_wgrad_pitch(M, num_groups);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor qt = at::empty({K, P}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor s = at::empty({M / 128 + num_groups, K}, x.options().dtype(at::kFloat));
  check_launch(megatron_tma::quantize_grouped_128x1(x.data_ptr(), in, M, K, desc, pow2, qt.data_ptr(),
                                                    s.data_ptr<float>(), at::cuda::getCurrentCUDAStream()),
               "quantize_grouped_128x1");
  return {qt, s};
}

// The rows + columns pass over M rows of x (all of them, or those `gather` names): (q, s, qt, s_t), the layouts of
// quantize_1x128 and quantize_grouped_128x1.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rows_and_columns(
    const at::Tensor& x, const QuantInput& in, int64_t M, const at::Tensor& groups, int64_t num_groups, bool pow2,
    const megatron_tma::RowGather& gather, const char* name) {
  const megatron_tma::GroupsArg desc = check_groups(groups, num_groups, x);
  const int64_t K = x.size(1), m_pad = cdiv(M, 4) * 4, P = checked_wgrad_pitch(M, num_groups);
  c10::cuda::CUDAGuard guard(x.device());
  const at::TensorOptions fp8 = x.options().dtype(at::kFloat8_e4m3fn), f32 = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty({M, K}, fp8);
  at::Tensor s = at::empty({cdiv(K, 128), m_pad}, f32);
  at::Tensor qt = at::empty({K, P}, fp8);
  at::Tensor s_t = at::empty({M / 128 + num_groups, K}, f32);
  check_launch(megatron_tma::quantize_1x128_and_grouped_128x1(x.data_ptr(), in, M, K, desc, pow2, q.data_ptr(),
                                                              s.data_ptr<float>(), m_pad, qt.data_ptr(),
                                                              s_t.data_ptr<float>(), at::cuda::getCurrentCUDAStream(),
                                                              gather),
               name);
  return {q, s.narrow(1, 0, M).t(), qt, s_t};
}

// quantize_1x128(x) and quantize_grouped_128x1(x, groups) in one pass: (q, s, qt, s_t), same layouts.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_1x128_and_grouped_128x1(
    const at::Tensor& x, const at::Tensor& groups, int64_t num_groups, bool pow2) {
  const QuantInput in = check_input(x, "x", 2);
  return rows_and_columns(x, in, x.size(0), groups, num_groups, pow2, megatron_tma::RowGather{},
                          "quantize_1x128_and_grouped_128x1");
}

// The same of the rows of x that `rows` names (row r of the result = x row rows[r]): the MoE permutation fused into
// the quantizer's read. M = rows.numel(); groups describe those M rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gather_quantize_1x128_and_grouped_128x1(
    const at::Tensor& x, const at::Tensor& rows, const at::Tensor& groups, int64_t num_groups, bool pow2) {
  const QuantInput in = check_input(x, "x", 2);
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kInt, "rows must be int32, got ", rows.scalar_type());
  TORCH_CHECK_VALUE(rows.device() == x.device() && rows.dim() == 1 && rows.is_contiguous(),
                    "rows must be a contiguous 1-D tensor on ", x.device());
  TORCH_CHECK_VALUE(rows.numel() == 0 || x.size(0) > 0, "rows name rows of x, which has none");
  TORCH_CHECK_VALUE(x.size(0) <= INT_MAX, "x must have at most INT_MAX rows, got ", x.size(0));
  return rows_and_columns(x, in, rows.numel(), groups, num_groups, pow2,
                          megatron_tma::RowGather{rows.data_ptr<int32_t>(), x.size(0)},
                          "gather_quantize_1x128_and_grouped_128x1");
}

}  // namespace

// The schemas are megatron_tma/ops.py's (with the CPU and fake kernels): this file registers the CUDA kernels only.
TORCH_LIBRARY_IMPL(megatron_tma, CUDA, m) {
  m.impl("quantize_1x128", &quantize_1x128);
  m.impl("quantize_128x128", &quantize_128x128);
  m.impl("quantize_128x128_from_master", &quantize_128x128_from_master);
  m.impl("transpose_128x128", &transpose_128x128);
  m.impl("quantize_128x128_refresh", &quantize_128x128_refresh);
  m.impl("quantize_grouped_128x1", &quantize_grouped_128x1);
  m.impl("quantize_1x128_and_grouped_128x1", &quantize_1x128_and_grouped_128x1);
  m.impl("gather_quantize_1x128_and_grouped_128x1", &gather_quantize_1x128_and_grouped_128x1);
}
