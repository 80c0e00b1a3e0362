"""The expert MLP's activation times the routing probs: `z = act(h) * probs[:, None]`, FP32 math from the BF16 h,
one rounding back to BF16, with gradients for h and the probs.

Two kernels of the ops `torch.ops.megatron_tma.act_times_probs_{forward,backward}` (megatron_tma.ops):
* CUDA (csrc/include/megatron_tma/kernels/activation.cuh): one pass over memory each way; the probs gradient
  of a row is one CTA's fixed-order sum.
* the reference (megatron_tma.reference, the CPU kernel; `backend="reference"` runs it on any device, and "auto"
  on a GPU tensor that the CUDA kernel does not take): torch ops on FP32 copies, the probs gradient by a pairwise
  halving.
Both compute every element from its own row only, and each sums a row's probs gradient in an order fixed by F,
so a row's results never depend on the other rows: what the padded twin's bit-exactness needs. They agree to FP32
rounding (expf / erff / division may differ in the last bit between the CUDA math library and torch's kernels),
not bit for bit; the CUDA kernel is checked against float64 and against the torch formulas in the GPU tests.
"""
from typing import Optional

import torch

from . import _ext, ops
from ._validate import misalignment16, not_twice_differentiable
from .reference import ACTIVATIONS, GATED

__all__ = ["ACTIVATIONS", "GATED", "activation_times_probs", "act_times_probs_forward", "act_times_probs_backward",
           "check_activation_args", "resolve_kernel"]


def _kernel_probs(probs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if probs is None else probs.float().contiguous()


def act_times_probs_forward(h: torch.Tensor, probs: Optional[torch.Tensor], activation: str,
                            use_kernel: bool) -> torch.Tensor:
    """z = act(h) * probs[:, None] in FP32 from the BF16 h, one rounding to h's dtype; no autograd. `use_kernel`
    (as `resolve_kernel` decides it): the op, whose kernel h's device picks, else the reference directly.
    Deterministic: called twice on the same h and probs it gives the same bits, which is what lets a backward
    recompute z instead of keeping it (megatron_tma.activation_linear)."""
    return ops.kernel("act_times_probs_forward", not use_kernel)(h, _kernel_probs(probs), ACTIVATIONS.index(activation))


def act_times_probs_backward(dz: torch.Tensor, h: torch.Tensor, probs: Optional[torch.Tensor], activation: str,
                             use_kernel: bool, need_dh: bool = True, need_dprobs: bool = True):
    """(dh or None, dprobs or None) of z = act(h) * probs[:, None] for the upstream gradient dz; no autograd."""
    need_dprobs = need_dprobs and probs is not None
    dz = dz.contiguous()
    if not _aligned16(dz):  # a view into another buffer: the CUDA kernel reads 16-byte vectors
        dz = dz.clone()
    dh, dprobs = ops.kernel("act_times_probs_backward", not use_kernel)(dz, h, _kernel_probs(probs),
                                                                         ACTIVATIONS.index(activation), need_dprobs)
    return (dh if need_dh else None), (dprobs.to(probs.dtype) if need_dprobs else None)


class _ActivationTimesProbs(torch.autograd.Function):
    """z = act(h) * probs[:, None] in FP32 from the BF16 h, one rounding to BF16. Saves only h and probs: the
    backward recomputes the activation (memory of one BF16 [T, 2F] tensor instead of FP32 intermediates)."""

    @staticmethod
    def forward(ctx, h, probs, activation, use_kernel):
        ctx.activation, ctx.use_kernel = activation, use_kernel
        ctx.save_for_backward(h, probs)
        return act_times_probs_forward(h, probs, activation, use_kernel)

    @staticmethod
    @not_twice_differentiable("activation_times_probs")  # the kernel path has no double backward
    def backward(ctx, dz):
        h, probs = ctx.saved_tensors
        dh, dprobs = act_times_probs_backward(dz, h, probs, ctx.activation, ctx.use_kernel,
                                              ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dh, dprobs, None, None


def _aligned16(t: torch.Tensor) -> bool:
    """16-byte aligned start (under torch.compile taken as true: megatron_tma._validate.misalignment16 says why; the
    binding checks the address)."""
    return misalignment16(t) == 0


def _kernel_fits(h: torch.Tensor, activation: str) -> bool:
    """What the CUDA kernel takes: contiguous BF16 h, 16-byte aligned, F a multiple of 8."""
    f = h.shape[1] // 2 if activation in GATED else h.shape[1]
    return h.dtype == torch.bfloat16 and h.is_contiguous() and _aligned16(h) and f % 8 == 0


def check_activation_args(h: torch.Tensor, probs: Optional[torch.Tensor], activation: str) -> None:
    """The checks of `activation_times_probs`' arguments (ValueError naming the argument)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be a 2-D tensor [T, W], got {getattr(h, 'shape', type(h).__name__)}")
    if activation in GATED and h.shape[1] % 2:
        raise ValueError(f"{activation} needs h = [gate | up] with an even width, got {list(h.shape)}")
    if h.shape[1] == 0:
        raise ValueError(f"h must have at least one column per activation output, got {list(h.shape)}")
    if probs is not None and (probs.dim() != 1 or probs.shape[0] != h.shape[0]):
        raise ValueError(f"probs must be [T] = [{h.shape[0]}], got {list(probs.shape)}")


def resolve_kernel(h: torch.Tensor, activation: str, backend: str) -> bool:
    """Whether `backend` runs the op on this h (its device's kernel) rather than the reference directly: "auto" does
    unless h is a GPU tensor the CUDA kernel does not take (it needs a contiguous 16-byte aligned BF16 h with
    F % 8 == 0), "cuda" insists on the CUDA kernel (ValueError if h does not fit), "reference" never."""
    _ext.check_backend(backend, h.device)
    if backend == "reference":
        return False
    if h.device.type == "cuda" and not _kernel_fits(h, activation):
        if backend == "cuda":
            raise ValueError(
                "backend='cuda' needs a contiguous, 16-byte aligned bfloat16 h whose activation has a multiple of "
                f"8 outputs per row, got {h.dtype} {list(h.shape)}"
            )
        return False
    return True


def activation_times_probs(h: torch.Tensor, probs: Optional[torch.Tensor], activation: str,
                           backend: str = "auto") -> torch.Tensor:
    """`act(h) * probs[:, None]` (probs None: `act(h)`), computed in FP32 and returned in h's dtype.

    h: `[T, 2F]` for "swiglu" / "geglu" (gate half first) or `[T, F]` for "gelu" / "squared_relu"; probs: `[T]` (FP32 or
    BF16; its gradient comes back in its dtype). Every element is computed on its own and the probs gradient by a
    fixed-order row sum, so a row's results do not depend on the other rows (what the padded twin's bit-exactness
    needs). backend: "auto" runs the op (on a GPU the CUDA kernel, for a contiguous BF16 h with F % 8 == 0; anything
    else takes the torch reference), "cuda" insists on the CUDA kernel, "reference" is torch.
    """
    check_activation_args(h, probs, activation)
    return _ActivationTimesProbs.apply(h, probs, activation, resolve_kernel(h, activation, backend))
