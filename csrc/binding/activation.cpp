// torch binding of the fused activation-times-probs kernels (instantiations/activation.cu): checks what the
// kernels assume, allocates, launches on the current stream. megatron_tma/activation.py gives the same
// errors first; these checks keep the ops safe when called directly through torch.ops.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "megatron_tma/host/activation.h"

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Checks h and returns F (outputs per row).
int64_t check_h(const at::Tensor& h, int64_t activation) {
  TORCH_CHECK_VALUE(activation >= 0 && activation < megatron_tma::kNumActivations,
                    "activation must be 0 (swiglu), 1 (gelu), 2 (squared_relu) or 3 (geglu), got ", activation);
  TORCH_CHECK_TYPE(h.scalar_type() == at::kBFloat16, "h must be bfloat16, got ", h.scalar_type());
  TORCH_CHECK_VALUE(h.is_cuda() && h.dim() == 2 && h.is_contiguous() && aligned16(h),
                    "h must be a contiguous, 16-byte aligned [T, W] CUDA tensor");
  const bool gated = megatron_tma::activation_is_gated(static_cast<int>(activation));
  const int64_t w = h.size(1), f = gated ? w / 2 : w;
  TORCH_CHECK_VALUE(f > 0 && f % 8 == 0 && (!gated || w % 2 == 0),
                    "h's width must give a positive multiple of 8 outputs per row (swiglu, geglu: 2F, F % 8 == 0), "
                    "got ", w);
  return f;
}

const float* probs_ptr(const c10::optional<at::Tensor>& probs, const at::Tensor& h) {
  if (!probs.has_value()) return nullptr;
  const at::Tensor& p = *probs;
  TORCH_CHECK_TYPE(p.scalar_type() == at::kFloat, "probs must be float32, got ", p.scalar_type());
  TORCH_CHECK_VALUE(p.device() == h.device() && p.dim() == 1 && p.size(0) == h.size(0) && p.is_contiguous(),
                    "probs must be a contiguous [T] = [", h.size(0), "] tensor on ", h.device());
  return p.data_ptr<float>();
}

at::Tensor act_times_probs_forward(const at::Tensor& h, const c10::optional<at::Tensor>& probs, int64_t activation) {
  const int64_t f = check_h(h, activation);
  const float* p = probs_ptr(probs, h);
  c10::cuda::CUDAGuard guard(h.device());
  at::Tensor z = at::empty({h.size(0), f}, h.options());
  const cudaError_t err = megatron_tma::act_times_probs_forward(static_cast<int>(activation), h.data_ptr(), p,
                                                                z.data_ptr(), h.size(0), f,
                                                                at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "act_times_probs_forward launch failed: ", cudaGetErrorString(err));
  return z;
}

std::tuple<at::Tensor, at::Tensor> act_times_probs_backward(const at::Tensor& dz, const at::Tensor& h,
                                                            const c10::optional<at::Tensor>& probs,
                                                            int64_t activation, bool need_dprobs) {
  const int64_t f = check_h(h, activation);
  const float* p = probs_ptr(probs, h);
  TORCH_CHECK_VALUE(!need_dprobs || probs.has_value(), "the probs gradient needs probs");
  TORCH_CHECK_TYPE(dz.scalar_type() == at::kBFloat16, "dz must be bfloat16, got ", dz.scalar_type());
  TORCH_CHECK_VALUE(dz.device() == h.device() && dz.dim() == 2 && dz.size(0) == h.size(0) && dz.size(1) == f &&
                        dz.is_contiguous() && aligned16(dz),
                    "dz must be a contiguous, 16-byte aligned [T, F] = [", h.size(0), ", ", f, "] tensor on ",
                    h.device());
  c10::cuda::CUDAGuard guard(h.device());
  at::Tensor dh = at::empty_like(h);
  at::Tensor dprobs = at::empty({need_dprobs ? h.size(0) : 0}, h.options().dtype(at::kFloat));
  const cudaError_t err = megatron_tma::act_times_probs_backward(
      static_cast<int>(activation), h.data_ptr(), dz.data_ptr(), p, dh.data_ptr(),
      need_dprobs ? dprobs.data_ptr<float>() : nullptr, h.size(0), f, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "act_times_probs_backward launch failed: ", cudaGetErrorString(err));
  return {dh, dprobs};
}

}  // namespace

// The schemas are megatron_tma/ops.py's (with the CPU and fake kernels): this file registers the CUDA kernels only.
TORCH_LIBRARY_IMPL(megatron_tma, CUDA, m) {
  m.impl("act_times_probs_forward", &act_times_probs_forward);
  m.impl("act_times_probs_backward", &act_times_probs_backward);
}
