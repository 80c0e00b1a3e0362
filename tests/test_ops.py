"""The ops of megatron_tma.ops as torch.library sees them: each one defined once with a CPU kernel (the reference), a
CUDA kernel (the extension's, or the reference without it) and a fake kernel, and each passing `torch.library.opcheck`
on the CPU (its schema's mutations, the fake kernel's shapes, dtypes and strides against the CPU kernel's outputs,
tracing through AOT autograd with dynamic shapes)."""
import pytest
import torch

from megatron_tma import _ext, ops
from megatron_tma import reference as R
from megatron_tma.groups import padded_row_count_upper_bound


def _cases():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 256, generator=gen).bfloat16()
    sizes = torch.tensor([100, 0, 100])
    aq, a_s = R.quantize_1x128(x)
    w = torch.randn(3, 144, 272, generator=gen).bfloat16()
    b, bs, _, _ = R.quantize_128x128((torch.randn(3, 128, 256, generator=gen) * 0.05).bfloat16())
    xt, xts = R.quantize_grouped_128x1(x, sizes)
    dy = torch.randn(200, 128, generator=gen).bfloat16()
    dyt, dyts = R.quantize_grouped_128x1(dy, sizes)
    h, probs = torch.randn(200, 256, generator=gen).bfloat16(), torch.rand(200, generator=gen)
    rows = torch.randperm(200, generator=gen).int()
    m_pad = padded_row_count_upper_bound(200, 3, 128)
    return {
        "quantize_1x128": (x, False),
        "quantize_128x128": ((torch.randn(3, 144, 272, generator=gen)).bfloat16(), True),
        "transpose_128x128": (b, bs),
        "quantize_128x128_from_master": (torch.randn(3, 144, 272, generator=gen) * 3, True),
        "quantize_128x128_refresh": (w, True, *R.quantize_128x128(w, True), torch.tensor(3), torch.tensor(-1)),
        "quantize_grouped_128x1": (x, sizes, 3, False),
        "quantize_1x128_and_grouped_128x1": (x, torch.tensor([0, 100, 100, 200]), 3, True),
        "gather_quantize_1x128_and_grouped_128x1": (x, rows, sizes, 3, False),
        "m_grouped_fp8_gemm_out": (aq, a_s, b, bs, sizes, torch.empty(200, 128, dtype=torch.bfloat16), 0, 0),
        "k_grouped_fp8_gemm_out": (dyt, dyts, xt, xts, sizes, torch.zeros(3, 128, 256), True, 0),
        "act_times_probs_forward": (h, probs, 0),
        "act_times_probs_backward": (dy, h, probs, 0, True),
        "combine_rows": (dy, rows.view(100, 2)),
        "pad_rows_fp8": (aq, a_s, sizes, 3, 128),
        "unpad_rows_bf16": (torch.randn(m_pad, 128, generator=gen).bfloat16(), sizes,
                            torch.tensor([0, 128, 128, 256], dtype=torch.int32),
                            torch.empty(200, 128, dtype=torch.bfloat16)),
    }


CASES = _cases()
# opcheck's schema test runs the op under a mode that multiplies its inputs, which ATen's CPU kernels refuse for
# float8_e4m3fn: those ops take the other three tests (their `out` mutation is still declared, and functionalized by
# the AOT test).
FP8_INPUTS = {"m_grouped_fp8_gemm_out", "k_grouped_fp8_gemm_out", "pad_rows_fp8", "transpose_128x128",
              "quantize_128x128_refresh"}


def test_every_op_is_covered_here():
    assert set(CASES) == set(ops._OPS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if name not in FP8_INPUTS:
        tests = ("test_schema",) + tests
    torch.library.opcheck(getattr(torch.ops.megatron_tma, name).default, CASES[name], test_utils=tests)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_kernel_per_device_and_a_fake(name):
    """The schema is this package's, defined once (megatron_tma/ops.py); CPU and Meta kernels are its; CUDA is the
    extension's C++ kernel where it is built, else the reference."""
    table = torch._C._dispatch_dump_table(f"megatron_tma::{name}")
    kernels = dict(line.split(": ", 1) for line in table.splitlines() if ": " in line)
    assert "megatron_tma/ops.py" in kernels["CPU"] and "megatron_tma/ops.py" in kernels["Meta"]
    if _ext.has_extension():
        assert ".cpp:" in kernels["CUDA"] and "megatron_tma/ops.py" not in kernels["CUDA"], kernels["CUDA"]
    else:
        assert "megatron_tma/ops.py" in kernels["CUDA"]
    assert ops.kernel(name) is getattr(torch.ops.megatron_tma, name).default

