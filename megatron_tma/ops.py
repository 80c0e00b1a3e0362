"""The package's torch ops, `torch.ops.megatron_tma.<name>`: one schema per op, defined here, and a kernel per device.

* CPU: the plain-torch reference (megatron_tma.reference, the numerics oracle), registered here as the op's CPU kernel.
* CUDA: the extension's kernels (csrc/binding/*.cpp, `TORCH_LIBRARY_IMPL(megatron_tma, CUDA, m)`: they implement these
  schemas and define none). An install without the extension registers the reference as the CUDA kernel too, so the
  same call runs everywhere (slowly on a GPU: `backend="cuda"` makes that an error, megatron_tma._ext.check_backend).
* Meta: a fake kernel per op (shapes, dtypes and strides only, mirroring the bindings' allocations), always
  registered, so that torch.compile traces through every op whether or not the extension is built.

So PyTorch's dispatcher picks the kernel from the tensors' device: the Python API validates its arguments once and
calls the op once (megatron_tma.quant, .gemm, .activation, .permutation, .padding). The one switch left is
`backend="reference"`, which runs the reference on tensors of any device (the tests check the CUDA kernels against
it on the GPU): `kernel(name, reference=True)` hands back the CPU kernel itself, to call directly.

The schemas are the bindings' C++ signatures. The ops that fill a caller's buffer (`*_out`, `unpad_rows_bf16`,
`quantize_128x128_refresh`) mark it `Tensor(a!)` and return nothing, so torch.compile functionalizes them. No op reads a device tensor on the host on
the CUDA path; the reference kernels do read the group sizes (on the CPU that is free), which is also where they
check them. The two tile queries (`m_grouped_fp8_gemm_tile`, `k_grouped_fp8_gemm_tile`: host ints in and out, the
launchers' choice) are no device ops: the extension defines and implements them itself.
"""
from typing import Callable, Dict

import torch

from . import _ext
from . import reference as R
from .groups import Groups, padded_row_count_upper_bound, wgrad_pitch

__all__ = ["kernel", "reference_runs_on"]

FP8 = torch.float8_e4m3fn

_LIB = torch.library.Library("megatron_tma", "FRAGMENT")  # kept alive: the registrations live as long as it does
_OPS: Dict[str, Callable] = {}  # name -> torch.ops.megatron_tma.<name>.default
_REFERENCE: Dict[str, Callable] = {}  # name -> its CPU kernel


def _define(schema: str, cpu: Callable, fake: Callable) -> None:
    name = schema[: schema.index("(")]
    _LIB.define(schema)
    # The reference kernels read the group sizes on the host: eager code, never traced. Disabled for dynamo, so that
    # a compiled region's eager fallback (after a graph break) runs them as plain Python (torch 2.11's dynamo failed
    # converting a frame under `host_group_sizes` there: tests/test_autograd.py::test_torch_compile_forward).
    cpu_kernel = torch.compiler.disable(cpu)
    _LIB.impl(name, cpu_kernel, "CPU")
    if not _ext.has_extension():
        _LIB.impl(name, cpu_kernel, "CUDA")
    torch.library.register_fake(f"megatron_tma::{name}", fake, lib=_LIB)
    _OPS[name] = getattr(torch.ops.megatron_tma, name).default  # the overload: no attribute chain per call
    _REFERENCE[name] = cpu_kernel  # (disabled too: backend="reference" under torch.compile runs it opaque)


def kernel(name: str, reference: bool = False) -> Callable:
    """The op `name` (its overload: the dispatcher picks the device's kernel), or with `reference` its CPU kernel, the
    plain-torch reference, to run on tensors of any device (`backend="reference"`)."""
    return _REFERENCE[name] if reference else _OPS[name]


def reference_runs_on(device: torch.device) -> bool:
    """Whether the ops' kernel on `device` is the reference, which reads the group sizes on the host (CPU tensors, or
    a GPU without the extension): then a caller may size buffers exactly instead of by their upper bound."""
    return device.type != "cuda" or not _ext.has_extension()


def _cdiv(a, b):
    return (a + b - 1) // b


def _groups(groups: torch.Tensor, num_groups: int) -> Groups:
    """An op's group tensor as the reference takes it: sizes [G] or offsets [G+1] by its length, as the CUDA kernels
    read it. The Python API checked it already (a `Groups` is not checked twice); the reference still checks the
    values against the data it is given (free on the CPU), which keeps a direct `torch.ops` call safe."""
    return Groups(groups, num_groups, groups.numel() == num_groups + 1, None)


# ------------------------------------------------------------------------------------------------------------------
# Quantizers (csrc/binding/quantize.cpp): every output allocated by the op, in docs/layouts.md's layouts
# ------------------------------------------------------------------------------------------------------------------
def _fake_quantize_1x128(x, pow2=False):
    m, k = x.shape
    q = x.new_empty((m, k), dtype=FP8)
    s = x.new_empty((_cdiv(k, 128), _cdiv(m, 4) * 4), dtype=torch.float32)
    return q, s[:, :m].t()


def _fake_quantize_128x128(w, pow2=False):
    g, n, k = w.shape
    nb, kb = _cdiv(n, 128), _cdiv(k, 128)
    return (
        w.new_empty((g, n, k), dtype=FP8),
        w.new_empty((g, nb, kb), dtype=torch.float32),
        w.new_empty((g, k, n), dtype=FP8),
        w.new_empty((g, kb, nb), dtype=torch.float32),
    )


def _fake_transpose_128x128(q, s):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1])), s.new_empty((s.shape[0], s.shape[2], s.shape[1]))


def _fake_quantize_grouped_128x1(x, groups, num_groups, pow2=False):
    m, k = x.shape
    qt = x.new_empty((k, wgrad_pitch(m, num_groups)), dtype=FP8)  # contiguous [K, P]
    return qt, x.new_empty((m // 128 + num_groups, k), dtype=torch.float32)


def _fake_quantize_1x128_and_grouped_128x1(x, groups, num_groups, pow2=False):
    return _fake_quantize_1x128(x) + _fake_quantize_grouped_128x1(x, groups, num_groups)


def _fake_gather_quantize_1x128_and_grouped_128x1(x, rows, groups, num_groups, pow2=False):
    gathered = x.new_empty((rows.shape[0], x.shape[1]))
    return _fake_quantize_1x128_and_grouped_128x1(gathered, groups, num_groups)


def _quantize_128x128_refresh(w, pow2, q, s, qt, st, version, done):
    # A host read: free on the CPU; on a GPU tensor (backend="reference") a sync, which no CUDA graph can capture.
    # The CUDA kernel decides on the device.
    if int(version) == int(done):
        return
    for out, new in zip((q, s, qt, st), R.quantize_128x128(w, pow2)):
        if out is not None:
            bits = torch.uint8 if out.dtype == FP8 else out.dtype  # (byte copies on every torch build)
            out.view(bits).copy_(new.view(bits))
    done.copy_(version)


def _quantize_grouped_128x1(x, groups, num_groups, pow2=False):
    return R.quantize_grouped_128x1(x, _groups(groups, num_groups), pow2, num_groups=num_groups)


def _quantize_1x128_and_grouped_128x1(x, groups, num_groups, pow2=False):
    return R.quantize_1x128(x, pow2) + _quantize_grouped_128x1(x, groups, num_groups, pow2)


def _gather_quantize_1x128_and_grouped_128x1(x, rows, groups, num_groups, pow2=False):
    return _quantize_1x128_and_grouped_128x1(x.index_select(0, rows), groups, num_groups, pow2)


_define("quantize_1x128(Tensor x, bool pow2=False) -> (Tensor, Tensor)", R.quantize_1x128, _fake_quantize_1x128)
_define("quantize_128x128(Tensor w, bool pow2=False) -> (Tensor, Tensor, Tensor, Tensor)", R.quantize_128x128,
        _fake_quantize_128x128)
_define("transpose_128x128(Tensor q, Tensor s) -> (Tensor, Tensor)", R.transpose_128x128, _fake_transpose_128x128)
_define("quantize_128x128_from_master(Tensor master, bool pow2=False) -> (Tensor, Tensor, Tensor, Tensor)",
        R.quantize_128x128_from_master, _fake_quantize_128x128)
_define("quantize_128x128_refresh(Tensor w, bool pow2, Tensor(a!) q, Tensor(b!) s, Tensor(c!)? qt, Tensor(d!)? st, "
        "Tensor version, Tensor(e!) done) -> ()", _quantize_128x128_refresh, lambda *args: None)
_define("quantize_grouped_128x1(Tensor x, Tensor groups, int num_groups, bool pow2=False) -> (Tensor, Tensor)",
        _quantize_grouped_128x1, _fake_quantize_grouped_128x1)
_define("quantize_1x128_and_grouped_128x1(Tensor x, Tensor groups, int num_groups, bool pow2=False) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        _quantize_1x128_and_grouped_128x1, _fake_quantize_1x128_and_grouped_128x1)
_define("gather_quantize_1x128_and_grouped_128x1(Tensor x, Tensor rows, Tensor groups, int num_groups, "
        "bool pow2=False) -> (Tensor, Tensor, Tensor, Tensor)",
        _gather_quantize_1x128_and_grouped_128x1, _fake_gather_quantize_1x128_and_grouped_128x1)


# ------------------------------------------------------------------------------------------------------------------
# GEMMs (csrc/binding/{m,k}_grouped_fp8_gemm.cpp): they write into the caller's `out`
# ------------------------------------------------------------------------------------------------------------------
def _m_grouped_fp8_gemm_out(a, a_scales, b, b_scales, groups, out, block_n=0, block_m=0):
    # (the tile is the kernels' business: every tile gives the same bits)
    out.copy_(R.m_grouped_fp8_gemm(a, a_scales, b, b_scales, _groups(groups, b.shape[0])))


def _k_grouped_fp8_gemm_out(dy_t, dy_t_scales, x_t, x_t_scales, groups, out, accumulate, block_m=0):
    result = R.k_grouped_fp8_gemm(dy_t, dy_t_scales, x_t, x_t_scales, _groups(groups, out.shape[0]),
                                  out=out if accumulate else None,
                                  accumulate=accumulate, num_groups=out.shape[0])
    if result is not out:
        out.copy_(result)


def _fake_writes_out(*args, **kwargs):  # the op only writes its `out` argument
    return None


_define("m_grouped_fp8_gemm_out(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, Tensor groups, "
        "Tensor(a!) out, int block_n=0, int block_m=0) -> ()",
        _m_grouped_fp8_gemm_out, _fake_writes_out)
_define("k_grouped_fp8_gemm_out(Tensor dy_t, Tensor dy_t_scales, Tensor x_t, Tensor x_t_scales, Tensor groups, "
        "Tensor(a!) out, bool accumulate, int block_m=0) -> ()",
        _k_grouped_fp8_gemm_out, _fake_writes_out)


# ------------------------------------------------------------------------------------------------------------------
# The activation times the probs (csrc/binding/activation.cpp); `activation` is the index into R.ACTIVATIONS
# ------------------------------------------------------------------------------------------------------------------
def _act_times_probs_forward(h, probs, activation):
    return R.act_times_probs_forward(h, probs, R.ACTIVATIONS[activation])


def _act_times_probs_backward(dz, h, probs, activation, need_dprobs):
    # as the CUDA kernel: dh always, dprobs FP32 [T] (from the FP32 probs the caller passes) or empty [0]
    dh, dprobs = R.act_times_probs_backward(dz, h, probs, R.ACTIVATIONS[activation], True, need_dprobs)
    return dh, dprobs if dprobs is not None else h.new_empty(0, dtype=torch.float32)


def _fake_act_times_probs_forward(h, probs, activation):
    f = h.shape[1] // 2 if R.ACTIVATIONS[activation] in R.GATED else h.shape[1]
    return h.new_empty(h.shape[0], f)


def _fake_act_times_probs_backward(dz, h, probs, activation, need_dprobs):
    return torch.empty_like(h), h.new_empty(h.shape[0] if need_dprobs else 0, dtype=torch.float32)


_define("act_times_probs_forward(Tensor h, Tensor? probs, int activation) -> Tensor",
        _act_times_probs_forward, _fake_act_times_probs_forward)
_define("act_times_probs_backward(Tensor dz, Tensor h, Tensor? probs, int activation, bool need_dprobs) -> "
        "(Tensor, Tensor)",
        _act_times_probs_backward, _fake_act_times_probs_backward)


# ------------------------------------------------------------------------------------------------------------------
# The permutation's combine (csrc/binding/combine_rows.cpp)
# ------------------------------------------------------------------------------------------------------------------
def _fake_combine_rows(y, token_rows):
    return y.new_empty((token_rows.shape[0], y.shape[1]))


_define("combine_rows(Tensor y, Tensor token_rows) -> Tensor", R.combine_rows, _fake_combine_rows)


# ------------------------------------------------------------------------------------------------------------------
# The padded baseline's row gathers (csrc/binding/pad_gather.cpp)
# ------------------------------------------------------------------------------------------------------------------
def _fake_pad_rows_fp8(a, a_scales, groups, num_groups, align):
    m, k = a.shape
    m_pad = padded_row_count_upper_bound(m, num_groups, align)
    storage = a_scales.new_empty(((k + 127) // 128, m_pad))
    return a.new_empty((m_pad, k)), storage.t(), groups.new_empty((num_groups + 1,), dtype=torch.int32)


def _unpad_rows_bf16(y_pad, groups, padded_offsets, out):
    R.unpad_rows_bf16(y_pad, groups, padded_offsets, out)


_define("pad_rows_fp8(Tensor a, Tensor a_scales, Tensor groups, int num_groups, int align) -> (Tensor, Tensor, Tensor)",
        R.pad_rows_fp8, _fake_pad_rows_fp8)
_define("unpad_rows_bf16(Tensor y_pad, Tensor groups, Tensor padded_offsets, Tensor(a!) out) -> ()",
        _unpad_rows_bf16, _fake_writes_out)
