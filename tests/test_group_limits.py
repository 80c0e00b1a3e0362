"""One set of input rules on both backends (issue 26, item 7): what the CUDA ops refuse (their TORCH_CHECKs in
csrc/binding/*.cpp and the launchers' checks in csrc/instantiations/*.cu), the Python API refuses on the CPU too,
with a ValueError, at construction or at entry. CPU only: on a GPU the same calls reach the same checks."""
import pathlib
import re

import pytest
import torch

from megatron_tma import gemm, quant
from megatron_tma.autograd import fp8_grouped_linear
from megatron_tma.mlp import GroupedFP8Linear, GroupedFP8MLP

FP8 = torch.float8_e4m3fn
CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "include" / "megatron_tma"


def _cxx_constant(path, pattern):
    match = re.search(pattern, (CSRC / path).read_text())
    assert match, (path, pattern)
    return int(match.group(1))


def test_limits_are_the_kernels():
    from megatron_tma import limits

    assert limits.M_GROUPED_MAX_GROUPS == _cxx_constant("kernels/m_grouped_fp8_gemm.cuh", r"kMaxGroups = (\d+);")
    assert limits.K_GROUPED_MAX_GROUPS == _cxx_constant("kernels/k_grouped_fp8_gemm.cuh", r"kMaxGroups = (\d+);")
    assert limits.QUANTIZE_GROUPED_MAX_GROUPS == _cxx_constant("host/quantize.h",
                                                               r"kQuantizeGroupedMaxGroups = (\d+);")
    assert limits.PAD_GATHER_MAX_GROUPS == _cxx_constant("host/pad_gather.h", r"kPadGatherMaxGroups = (\d+);")
    assert limits.MAX_EXPERTS == min(limits.M_GROUPED_MAX_GROUPS, limits.K_GROUPED_MAX_GROUPS) == 1024
    assert quant.MAX_GROUPS == limits.QUANTIZE_GROUPED_MAX_GROUPS


# ----------------------------------------------------------------------------------------------------------------
# Group counts, at construction and at entry
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad_to", [None, 16])
def test_mlp_with_too_many_experts_fails_at_construction(pad_to):
    """1025 experts passed every CPU test and failed at the first backward on a GPU (the K-grouped wgrad GEMM)."""
    with pytest.raises(ValueError, match=r"num_experts=1025 .*1024.*K_GROUPED_MAX_GROUPS"):
        GroupedFP8MLP(1025, 128, 128, pad_to=pad_to, backend="reference", device="meta")
    GroupedFP8MLP(1024, 128, 128, pad_to=pad_to, backend="reference", device="meta")  # the limit itself is fine


def test_linear_with_too_many_groups_or_bad_sizes_fails_at_construction():
    with pytest.raises(ValueError, match=r"num_groups=1025 .*1024.*K_GROUPED_MAX_GROUPS"):
        GroupedFP8Linear(1025, 128, 128, backend="reference", device="meta")
    for in_f, out_f in ((100, 128), (128, 200), (0, 128)):
        with pytest.raises(ValueError, match=r"positive multiples of 128"):
            GroupedFP8Linear(2, in_f, out_f, backend="reference", device="meta")


def _weights(g, requires_grad):
    w = torch.zeros(g, 128, 128, dtype=torch.bfloat16)
    w[:, 0, 0] = 1.0
    return w.requires_grad_(requires_grad)


def test_linear_entry_checks_the_group_count():
    """Training needs the K-grouped GEMM (<= 1024 groups); inference only the M-grouped one (<= 2048)."""
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    sizes = torch.zeros(1025, dtype=torch.int64)
    sizes[0] = 3
    with pytest.raises(ValueError, match=r"1025 groups.*K_GROUPED_MAX_GROUPS = 1024"):
        fp8_grouped_linear(x, _weights(1025, True), sizes, backend="reference")
    with torch.no_grad():
        fp8_grouped_linear(x, _weights(1025, True), sizes, backend="reference")
    sizes = torch.cat([sizes, torch.zeros(2049 - 1025, dtype=torch.int64)])
    with torch.no_grad(), pytest.raises(ValueError, match=r"2049 groups.*M_GROUPED_MAX_GROUPS = 2048"):
        fp8_grouped_linear(x, _weights(2049, False), sizes, backend="reference")


def _m_grouped_operands(m=4, n=16, k=128, g=1):
    a, a_s = quant.quantize_1x128(torch.randn(m, k).bfloat16(), backend="reference")
    b = torch.zeros(g, n, k, dtype=FP8)
    b_s = torch.ones(g, (n + 127) // 128, k // 128)
    sizes = torch.zeros(g, dtype=torch.int64)
    sizes[0] = m
    return a, a_s, b, b_s, sizes


def test_m_grouped_gemm_group_limit():
    gemm.m_grouped_fp8_gemm(*_m_grouped_operands(g=2048), backend="reference")
    with pytest.raises(ValueError, match=r"2049 groups.*M_GROUPED_MAX_GROUPS = 2048"):
        gemm.m_grouped_fp8_gemm(*_m_grouped_operands(g=2049), backend="reference")


def _k_grouped_operands(m=200, n=16, k=16, g=1):
    dy = torch.randn(m, n).bfloat16()
    x = torch.randn(m, k).bfloat16()
    sizes = torch.zeros(g, dtype=torch.int64)
    sizes[0] = m
    dyt, dyt_s = quant.quantize_grouped_128x1(dy, sizes, backend="reference")
    xt, xt_s = quant.quantize_grouped_128x1(x, sizes, backend="reference")
    return dyt, dyt_s, xt, xt_s, sizes


def test_k_grouped_gemm_group_limit():
    gemm.k_grouped_fp8_gemm(*_k_grouped_operands(g=1024), backend="reference")
    with pytest.raises(ValueError, match=r"1025 groups.*K_GROUPED_MAX_GROUPS = 1024"):
        gemm.k_grouped_fp8_gemm(*_k_grouped_operands(g=1025), backend="reference")


# ----------------------------------------------------------------------------------------------------------------
# Strides and alignment the ops refuse
# ----------------------------------------------------------------------------------------------------------------


def _misaligned(t, by_elements=1):
    """A copy of t that starts `by_elements` elements past a 16-byte boundary (same shape, contiguous)."""
    flat = torch.empty(t.numel() + 16, dtype=t.dtype)
    out = flat[by_elements:by_elements + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def _as_scales_view(s, pitch):
    """The [M, KB] M-contiguous view of a scale tensor with row pitch `pitch` (storage [KB, pitch])."""
    m, kb = s.shape
    out = torch.ones((kb - 1) * pitch + m).as_strided((m, kb), (1, pitch))
    if pitch >= m:
        out.copy_(s)
    return out


def test_m_grouped_gemm_a_scales_row_pitch_with_one_k_block():
    """With K = 128 the op still needs the row pitch of a_scales >= M and a multiple of 4 (the TMA descriptor's
    stride): a contiguous [M, 1] tensor (pitch 1) or a broadcast one (pitch 0) is refused."""
    a, a_s, b, b_s, sizes = _m_grouped_operands(m=6)
    for bad in (torch.empty(6, 1).copy_(a_s), _as_scales_view(a_s, 0), _as_scales_view(a_s, 10)):
        with pytest.raises(ValueError, match=r"a_scales' row pitch must be >= M and a multiple of 4"):
            gemm.m_grouped_fp8_gemm(a, bad, b, b_s, sizes, backend="reference")
    gemm.m_grouped_fp8_gemm(a, _as_scales_view(a_s, 8), b, b_s, sizes, backend="reference")


@pytest.mark.parametrize("which", ["a", "a_scales", "b"])
def test_m_grouped_gemm_operands_must_be_16_byte_aligned(which):
    args = dict(zip(("a", "a_scales", "b", "b_scales", "groups"), _m_grouped_operands(m=8, k=256)))
    t = args[which]
    args[which] = (_misaligned(t) if which != "a_scales"
                   else _misaligned(t.t().contiguous()).t())  # the same [M, KB] view, its storage moved by 4 bytes
    with pytest.raises(ValueError, match=rf"{which} must start 16-byte aligned"):
        gemm.m_grouped_fp8_gemm(**args, backend="reference")


def test_m_grouped_gemm_out_row_pitch():
    """out's row pitch must be a multiple of 8 (M = 1 included) and >= N (a broadcast out, pitch 0, is refused)."""
    a, a_s, b, b_s, sizes = _m_grouped_operands(m=1)
    wide = torch.empty(1, 16 + 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"row pitch"):
        gemm.m_grouped_fp8_gemm(a, a_s, b, b_s, sizes, out=wide[:, :16], backend="reference")
    a, a_s, b, b_s, sizes = _m_grouped_operands(m=4)
    broadcast = torch.empty(1, 16, dtype=torch.bfloat16).expand(4, 16)
    with pytest.raises(ValueError, match=r"row pitch"):
        gemm.m_grouped_fp8_gemm(a, a_s, b, b_s, sizes, out=broadcast, backend="reference")
    ok = torch.empty(4, 24, dtype=torch.bfloat16)[:, :16]
    gemm.m_grouped_fp8_gemm(a, a_s, b, b_s, sizes, out=ok, backend="reference")


@pytest.mark.parametrize("which", ["dy_t", "x_t"])
def test_k_grouped_gemm_operands_must_be_16_byte_aligned(which):
    dyt, dyt_s, xt, xt_s, sizes = _k_grouped_operands()
    t = dyt if which == "dy_t" else xt
    storage = torch.empty(t.shape[0] * t.stride(0) + 16, dtype=FP8)
    moved = storage[1:1 + t.shape[0] * t.stride(0)].view(t.shape[0], t.stride(0))[:, :t.shape[1]]
    moved.copy_(t)
    args = (moved, dyt_s, xt, xt_s) if which == "dy_t" else (dyt, dyt_s, moved, xt_s)
    with pytest.raises(ValueError, match=rf"{which} must start 16-byte aligned"):
        gemm.k_grouped_fp8_gemm(*args, sizes, backend="reference")


@pytest.mark.parametrize("op", ["quantize_1x128", "quantize_128x128", "quantize_grouped_128x1",
                                "quantize_1x128_and_grouped_128x1"])
def test_quantizer_inputs_must_be_16_byte_aligned(op):
    x = _misaligned(torch.randn(32, 128).bfloat16())
    args = (x,) if op in ("quantize_1x128", "quantize_128x128") else (x, torch.tensor([20, 12]))
    with pytest.raises(ValueError, match=r"must start 16-byte aligned"):
        getattr(quant, op)(*args, backend="reference")
    getattr(quant, op)(*((x.clone(),) + args[1:]), backend="reference")
