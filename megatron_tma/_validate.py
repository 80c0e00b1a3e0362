"""Argument checks shared by the Python API: one wording for every error the user can hit."""
import functools
from typing import Iterable, Optional

import torch

FP8 = torch.float8_e4m3fn


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    t,
    name: str,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    dim: Optional[int] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = True,
) -> None:
    """Raise TypeError/ValueError with a message naming `name` and what was expected."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_fmt_dtypes(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")


def check_same_device(**tensors) -> torch.device:
    """The one device of the given tensors (None values skipped); ValueError listing them all if there are two."""
    first = None
    for v in tensors.values():
        if isinstance(v, torch.Tensor):
            if first is None:
                first = v.device
            elif v.device != first:
                listing = ", ".join(f"{n} on {t.device}" for n, t in tensors.items() if isinstance(t, torch.Tensor))
                raise ValueError(f"all tensors must be on one device, got {listing}")
    return first


def misalignment16(t: torch.Tensor) -> int:
    """Bytes past a 16-byte boundary at which t starts: the real address. Code that torch.compile traces can read
    neither `data_ptr()` nor `storage_offset()` (both graph breaks, torch 2.13), so there it is taken as 0: inside a
    compiled graph the CUDA bindings' own address checks are the guard (a clear error, never a misaligned read), and
    the reference kernels take any address."""
    if torch.compiler.is_compiling():
        return 0
    return t.data_ptr() % 16


def any_misaligned16(*tensors) -> bool:
    """Whether any of the tensors (None skipped) starts off a 16-byte boundary: one test for a call's operands, whose
    error `check_aligned16` then words."""
    if torch.compiler.is_compiling():
        return False  # (as misalignment16)
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    return bits % 16 != 0


def check_aligned16(t: torch.Tensor, name: str, why: str) -> None:
    """ValueError unless t starts 16-byte aligned (what TMA and the kernels' 16-byte vectors need), on every backend,
    so that code tested on the CPU runs on the GPU."""
    off = misalignment16(t)
    if off:
        raise ValueError(f"{name} must start 16-byte aligned ({why}), got an address {off} bytes past that")


def check_multiple(value: int, of: int, what: str) -> None:
    if value % of != 0:
        raise ValueError(f"{what} must be a multiple of {of}, got {value}")


def check_int(value, name: str, minimum: Optional[int] = None) -> None:
    """TypeError unless `value` is an int (a bool or a tensor is not), ValueError if it is below `minimum`: one line
    naming the argument, before a float or a tensor reaches a shape or a comparison."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_bool(value, name: str) -> None:
    """TypeError unless `value` is a bool (a truthy tensor or string would silently pick a code path)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def not_twice_differentiable(what: str):
    """Decorator for an autograd Function's backward that has no double backward (FP8 GEMMs on quantized copies, CUDA
    kernels): refuse a backward under `create_graph=True` (the engine runs backward with grad mode on exactly then)
    with one line, before any work. `torch.autograd.function.once_differentiable` is not enough: it errs only at a
    second backward that reaches it, and only if the incoming gradient requires grad; otherwise (`loss = y.sum()`) the
    gradient comes back detached and a penalty built on it silently contributes nothing."""

    def wrap(backward):
        @functools.wraps(backward)
        def run(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(f"{what} is not twice differentiable: its backward builds no graph, so a backward "
                                   "with create_graph=True through it (torch.autograd.grad(..., create_graph=True), "
                                   "e.g. for a gradient penalty) would return a detached gradient; it is refused")
            return backward(ctx, *grads)

        return run

    return wrap
