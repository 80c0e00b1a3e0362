"""Loads the CUDA extension if it was built: it registers the CUDA kernels of the ops that megatron_tma.ops defines
(`torch.ops.megatron_tma.*`)."""
import functools
import importlib.util
import os
import warnings
from typing import Optional

import torch


def _no_kernels_reason() -> str:
    """Why the install has no compiled extension: the reason setup.py recorded, else what is known."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_no_kernels.txt")) as f:
            return "a pure-Python install, whose build said: " + f.read().strip()
    except OSError:
        return ("no compiled megatron_tma._C here: a pure-Python install or an unbuilt source tree; pip install -e . "
                "on a machine with a Hopper GPU and the CUDA toolkit builds it")


try:
    from . import _C  # noqa: F401  (registers the CUDA kernels of torch.ops.megatron_tma.*)

    _EXT_ERROR = None
except ImportError as e:  # pure-Python install, or a build for another torch
    _C = None
    # Without the compiled file Python's message blames a circular import; say what it is instead.
    _EXT_ERROR = e if importlib.util.find_spec(f"{__package__}._C") is not None else ImportError(_no_kernels_reason())


def has_extension() -> bool:
    return _C is not None


def extension_error():
    return _EXT_ERROR


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def is_hopper(device=None) -> bool:
    """sm_90 check, cached per device (it sits on every call's path: host time matters)."""
    if not torch.cuda.is_available():
        return False
    if device is None:
        index = torch.cuda.current_device()
    else:
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) == (9, 0)


def cuda_kernels_available(device=None) -> bool:
    """True when the extension is built and the device is an sm_90 GPU."""
    return has_extension() and is_hopper(device)


def ops():
    """`torch.ops.megatron_tma` with the extension's CUDA kernels; an error naming why when it was not built."""
    if _C is None:
        raise RuntimeError(
            "megatron_tma was installed without its CUDA extension "
            f"({_EXT_ERROR}); reinstall on a machine with a Hopper GPU and the CUDA toolkit "
            "(pip install -e .), or use the reference backend"
        )
    return torch.ops.megatron_tma


BACKENDS = ("auto", "cuda", "reference")


@functools.lru_cache(maxsize=None)
def _kernels_on(device: torch.device) -> bool:
    return device.type == "cuda" and cuda_kernels_available(device)


def check_backend(backend, device: Optional[torch.device] = None) -> None:
    """ValueError unless `backend` is one of BACKENDS: every public entry calls it first, so that a wrong value is
    refused at the call, not when some later op (a backward, the first non-empty input) resolves it. With `device`
    (the call's tensors', once they are checked), also that "cuda" can run there: the ops themselves dispatch on the
    tensors' device (megatron_tma.ops), "auto" runs the op whose kernel the device picks, "reference" runs the
    plain-torch reference on any device, and "cuda" insists on the extension's kernels on an sm_90 GPU (a clear
    error in place of a silently slow reference)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'cuda' or 'reference', got {backend!r}")
    if backend == "cuda" and device is not None and not _kernels_on(device):
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got tensors on {device}")
        ops()  # raises the "extension not built" error if that is the cause
        raise RuntimeError("backend='cuda' needs an sm_90 (Hopper) GPU")


def why_kernels_cannot_run(capability=None) -> str:
    """Why the CUDA kernels cannot run here: the extension's import error, or the GPU's architecture (its compute
    capability, when the caller knows it). One wording for the warning below and `python -m megatron_tma`."""
    if not has_extension():
        return f"the CUDA extension is not built: {_EXT_ERROR}"
    this = f", this one is sm_{capability[0]}{capability[1]}" if capability else ""
    return f"the kernels need an sm_90 (Hopper) GPU{this}"


def kernels_unavailable(device=None, extension: bool = True):
    """None when the CUDA kernels run on `device` (default: the current GPU); else why not, in one line: no GPU
    visible (and why torch sees none), the GPU's architecture, and (`extension`) the extension's state, each that
    applies."""
    why = []
    if not torch.cuda.is_available():
        why.append(f"no GPU visible (torch {torch.__version__} is a CPU build)" if torch.version.cuda is None else
                   f"no GPU visible (torch {torch.__version__} sees no CUDA device)")
    elif not is_hopper(device):
        major, minor = torch.cuda.get_device_capability(device)
        why.append(f"the kernels need an sm_90 (Hopper) GPU, {torch.cuda.get_device_name(device)} is sm_{major}{minor}")
    if extension and not has_extension():
        why.append(f"the CUDA extension is not built: {_EXT_ERROR}")
    return "; ".join(why) or None


def warn_if_reference_on_gpu(backend: str, device) -> bool:
    """`backend="auto"` runs the torch reference when the CUDA kernels cannot run. On a GPU that is easy to miss and
    ~10x slower (Megatron recipe, default size: ~1 s per step against ~0.1 s, seen on the H200 when the extension had
    been built without CuTe/CUTLASS headers and so was not built at all), so say it. True when it warned."""
    if backend != "auto" or torch.device(device).type != "cuda" or cuda_kernels_available(device):
        return False
    warnings.warn(f"megatron_tma: the CUDA kernels cannot run ({why_kernels_cannot_run()}); backend='auto' runs the "
                  "torch reference backend, which is correct but ~10x slower. Pass backend='cuda' to make this an "
                  "error.",
                  RuntimeWarning, stacklevel=3)
    return True
