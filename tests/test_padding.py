"""The padded path on the reference backend (any machine): layouts, the row bound, errors, the wiring."""
import itertools
import random
import zlib

import pytest
import torch

from megatron_tma import padding
from megatron_tma.padding import (
    pad_rows_fp8_reference,
    padded_m_grouped_fp8_gemm,
    padded_row_count_upper_bound,
    unpad_rows_reference,
)

FP8 = torch.float8_e4m3fn


def random_fp8(m, k, gen):
    """Every byte pattern, NaNs included: the padding moves bytes and must keep them."""
    return torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=gen).view(FP8)


def strided_scales(m, k, gen):
    """1x128 scales in the layout of docs/layouts.md: storage [ceil(K/128), ceil(M/4)*4], pad entries 1.0."""
    kb, m4 = (k + 127) // 128, (m + 3) // 4 * 4
    storage = torch.ones(kb, m4)
    storage[:, :m] = torch.rand(kb, m, generator=gen) * 10 + 0.01
    return storage[:, :m].t()


def groups_tensor(sizes, kind):
    """sizes as an int32/int64 sizes [G] or offsets [G+1] tensor; returns (tensor, num_groups kwarg)."""
    dtype = torch.int32 if kind.endswith("32") else torch.int64
    if kind.startswith("sizes"):
        return torch.tensor(sizes, dtype=dtype), None
    offsets = [0] + list(itertools.accumulate(sizes))
    return torch.tensor(offsets, dtype=dtype), len(sizes)


def seeded(*key):
    """A generator seeded from the test's parameters (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def round_up(x, a):
    return (x + a - 1) // a * a


SIZE_CASES = {
    "edges": [0, 1, 127, 128, 129],
    "leading_big": [129, 0, 0, 1, 255, 256, 257],
    "single": [300],
    "one_empty": [0],
    "all_empty": [0, 0, 0],
    "g256": None,  # 256 random sizes, some empty
}


def case_sizes(name, gen):
    if name == "g256":
        sizes = torch.randint(0, 40, (256,), generator=gen)
        sizes[torch.rand(256, generator=gen) < 0.2] = 0
        return sizes.tolist()
    return SIZE_CASES[name]


# ---------------------------------------------------------------------------------------------------------
# the row bound
# ---------------------------------------------------------------------------------------------------------


def weak_compositions(total, parts):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in weak_compositions(total - first, parts - 1):
            yield (first,) + rest


@pytest.mark.parametrize("align", [16, 48, 128])
@pytest.mark.parametrize("num_groups", [1, 2, 3])
def test_upper_bound_is_the_exact_maximum(align, num_groups):
    for m in range(0, 3 * align + 2, 1 if align == 16 else 7):
        worst = max(sum(round_up(s, align) for s in c) for c in weak_compositions(m, num_groups))
        bound = padded_row_count_upper_bound(m, num_groups, align)
        assert bound == worst, (m, num_groups, align)
        assert bound <= round_up(m, align) + align * num_groups


def test_upper_bound_values():
    assert padded_row_count_upper_bound(0, 256) == 0
    assert padded_row_count_upper_bound(1, 256) == 128
    assert padded_row_count_upper_bound(16384, 8) == 16384 + 7 * 128  # M aligned: one group cannot waste
    assert padded_row_count_upper_bound(16384, 8, 16) == 16384 + 7 * 16
    assert padded_row_count_upper_bound(100, 256, 16) == 100 * 16  # every row its own group


@pytest.mark.parametrize("args,match", [((-1, 4, 128), "m_total must be >= 0, got -1"),
                                        ((10, 0, 128), "num_groups must be >= 1, got 0"),
                                        ((10, 4, 0), "align must be >= 1, got 0")])
def test_upper_bound_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        padded_row_count_upper_bound(*args)


# ---------------------------------------------------------------------------------------------------------
# pad layout
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [384, 48])
@pytest.mark.parametrize("kind", ["sizes32", "sizes64", "offsets32", "offsets64"])
@pytest.mark.parametrize("align", [128, 16])
@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_pad_layout(case, align, kind, k):
    gen = seeded(case, align, kind, k)
    sizes = case_sizes(case, gen)
    m, num_groups = sum(sizes), len(sizes)
    a, a_scales = random_fp8(m, k, gen), strided_scales(m, k, gen)
    groups, ng = groups_tensor(sizes, kind)

    a_pad, s_pad, offsets = padding.pad_rows_fp8(a, a_scales, groups, align, num_groups=ng)

    m_pad, kb = padded_row_count_upper_bound(m, num_groups, align), (k + 127) // 128
    assert a_pad.dtype == FP8 and tuple(a_pad.shape) == (m_pad, k) and a_pad.is_contiguous()
    assert s_pad.dtype == torch.float32 and tuple(s_pad.shape) == (m_pad, kb)
    assert s_pad.t().is_contiguous()  # storage [KB, M_pad], M contiguous
    assert offsets.dtype == torch.int32 and tuple(offsets.shape) == (num_groups + 1,)

    data, src = a_pad.view(torch.uint8), a.view(torch.uint8)
    row, pad_row = 0, 0
    for g, size in enumerate(sizes):
        assert offsets[g].item() == pad_row
        assert pad_row % align == 0
        end = pad_row + round_up(size, align)
        assert torch.equal(data[pad_row : pad_row + size], src[row : row + size])
        assert torch.equal(s_pad[pad_row : pad_row + size], a_scales[row : row + size])
        assert not data[pad_row + size : end].any()
        assert torch.all(s_pad[pad_row + size : end] == 1.0)
        row, pad_row = row + size, end
    assert offsets[num_groups].item() == pad_row
    assert not data[pad_row:].any()  # past the real padded total, up to the bound
    assert torch.all(s_pad[pad_row:] == 1.0)


def test_pad_accepts_a_larger_scale_pitch():
    # a_scales with a larger pitch than ceil(M/4)*4 is still the M-contiguous layout
    gen = torch.Generator().manual_seed(1)
    a = random_fp8(5, 256, gen)
    storage = torch.rand(2, 64, generator=gen)
    a_scales = storage[:, :5].t()
    a_pad, s_pad, _ = pad_rows_fp8_reference(a, a_scales, torch.tensor([2, 3]), 16)
    assert torch.equal(s_pad[16:19], a_scales[2:5]) and torch.equal(s_pad[0:2], a_scales[0:2])


# ---------------------------------------------------------------------------------------------------------
# unpad
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sizes32", "offsets64"])
@pytest.mark.parametrize("align", [128, 16])
@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_unpad_gathers_the_valid_rows(case, align, kind):
    gen = seeded(case, align, kind)
    sizes = case_sizes(case, gen)
    m, n = sum(sizes), 24
    groups, ng = groups_tensor(sizes, kind)
    _, _, offsets = pad_rows_fp8_reference(random_fp8(m, 16, gen), strided_scales(m, 16, gen), groups, align,
                                           num_groups=ng)
    m_pad = padded_row_count_upper_bound(m, len(sizes), align)
    y_pad = torch.randint(-(2**15), 2**15, (m_pad, n), dtype=torch.int16, generator=gen).view(torch.bfloat16)

    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    got = padding.unpad_rows(y_pad, groups, offsets, m, out=out)
    assert got is out
    fresh = unpad_rows_reference(y_pad, groups, offsets, m)

    row = 0
    for g, size in enumerate(sizes):
        p = offsets[g].item()
        assert torch.equal(out.view(torch.int16)[row : row + size], y_pad.view(torch.int16)[p : p + size])
        row += size
    assert torch.equal(fresh.view(torch.int16), out.view(torch.int16))


def test_unpad_of_pad_is_identity():
    gen = torch.Generator().manual_seed(7)
    sizes = [3, 0, 130, 1]
    m = sum(sizes)
    x = torch.randn(m, 128, generator=gen).clamp(-448, 448).to(FP8)
    groups = torch.tensor(sizes)
    a_pad, _, offsets = padding.pad_rows_fp8(x, strided_scales(m, 128, gen), groups)
    y = padding.unpad_rows(a_pad.to(torch.bfloat16), groups, offsets, m)
    assert torch.equal(y, x.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------
# the padded path's wiring (a GEMM stand-in that is exact, so the comparison can be bit for bit)
# ---------------------------------------------------------------------------------------------------------


def exact_grouped_gemm(a, a_scales, b, b_scales, groups):
    """Dequantized per-group GEMM in float64 (exact for the small-integer data below), bf16 output.

    Reads the groups on the host (a test stand-in); rows no group covers are left as NaN, so the padded
    path must never un-pad them."""
    m, k = a.shape
    num_groups, n, _ = b.shape
    values = groups.tolist()
    offsets = values if len(values) == num_groups + 1 else [0] + list(itertools.accumulate(values))
    a_deq = a.double() * a_scales.double().repeat_interleave(128, dim=1)[:, :k]
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    for g in range(num_groups):
        w = b[g].double() * b_scales[g].double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        out[offsets[g] : offsets[g + 1]] = (a_deq[offsets[g] : offsets[g + 1]] @ w.t()).to(torch.bfloat16)
    return out


def small_integer_problem(sizes, n, k, gen):
    m, num_groups = sum(sizes), len(sizes)
    a = torch.randint(-4, 5, (m, k), generator=gen).float().to(FP8)
    b = torch.randint(-4, 5, (num_groups, n, k), generator=gen).float().to(FP8)
    kb = k // 128
    storage = torch.ones(kb, (m + 3) // 4 * 4)
    storage[:, :m] = 2.0 ** torch.randint(-2, 3, (kb, m), generator=gen).float()
    a_scales = storage[:, :m].t()
    b_scales = 2.0 ** torch.randint(-2, 3, (num_groups, (n + 127) // 128, kb), generator=gen).float()
    return a, a_scales, b, b_scales


@pytest.mark.parametrize("align", [128, 16])
@pytest.mark.parametrize("sizes", [[0, 1, 127, 128, 129], [0], [5, 0]])
def test_padded_gemm_matches_the_unpadded_gemm(sizes, align):
    gen = torch.Generator().manual_seed(3)
    a, a_scales, b, b_scales = small_integer_problem(sizes, n=32, k=256, gen=gen)
    groups = torch.tensor(sizes, dtype=torch.int32)
    seen = {}

    def gemm(a_pad, s_pad, b_, bs_, padded_groups):
        seen.update(rows=a_pad.shape[0], groups=padded_groups)
        return exact_grouped_gemm(a_pad, s_pad, b_, bs_, padded_groups)

    out = torch.full((sum(sizes), 32), float("nan"), dtype=torch.bfloat16)  # poisoned: every row must be written
    got = padded_m_grouped_fp8_gemm(a, a_scales, b, b_scales, groups, out=out, gemm=gemm, align=align)
    assert got is out
    assert torch.equal(got, exact_grouped_gemm(a, a_scales, b, b_scales, groups))
    # the reference backend hands the GEMM exactly the real padded rows (the CUDA path: the bound)
    assert seen["rows"] == sum(round_up(s, align) for s in sizes)
    assert seen["groups"].dtype == torch.int32 and seen["groups"].numel() == len(sizes) + 1


@pytest.mark.parametrize("kind", ["sizes32", "offsets64"])
@pytest.mark.parametrize("align", [128, 16])
def test_padded_path_with_the_default_gemm(align, kind):
    """Through megatron_tma.gemm (its reference backend here): padded path == unpadded GEMM, bit for bit."""
    from megatron_tma.gemm import m_grouped_fp8_gemm

    sizes = [0, 1, 127, 128, 129, 3]
    gen = seeded(align, kind)
    a, a_scales, b, b_scales = small_integer_problem(sizes, n=32, k=256, gen=gen)
    a = (torch.randn(a.shape, generator=gen) * 30).clamp(-448, 448).to(FP8)  # general values: the reference is
    groups, _ = groups_tensor(sizes, kind)  # row-independent, so padding cannot change a row
    assert torch.equal(padded_m_grouped_fp8_gemm(a, a_scales, b, b_scales, groups, align=align),
                       m_grouped_fp8_gemm(a, a_scales, b, b_scales, groups))


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------


def _pad_inputs(m=6, k=256):
    gen = torch.Generator().manual_seed(0)
    return random_fp8(m, k, gen), strided_scales(m, k, gen), torch.tensor([2, 4], dtype=torch.int32)


def _pad_error_cases():
    a, s, g = _pad_inputs()
    row_major = s.contiguous()
    return [
        ("a dtype", lambda: pad_rows_fp8_reference(a.view(torch.uint8), s, g), TypeError, "a must have dtype"),
        ("a dim", lambda: pad_rows_fp8_reference(a.view(-1), s, g), ValueError, "a must be 2-D"),
        ("a contiguity", lambda: pad_rows_fp8_reference(a[:, ::2], s[:, :1], g), ValueError, "contiguous"),
        ("K % 16", lambda: pad_rows_fp8_reference(a[:, :40].contiguous(), s[:, :1], g), ValueError, "multiple of 16"),
        ("scales dtype", lambda: pad_rows_fp8_reference(a, s.double(), g), TypeError, "a_scales must have dtype"),
        ("scales shape", lambda: pad_rows_fp8_reference(a, s[:, :1], g), ValueError, r"\[M, ceil\(K/128\)\]"),
        ("scales row-major", lambda: pad_rows_fp8_reference(a, row_major, g), ValueError, "M-contiguous"),
        ("groups dtype", lambda: pad_rows_fp8_reference(a, s, g.float()), TypeError, "groups must have dtype"),
        ("groups dim", lambda: pad_rows_fp8_reference(a, s, g.view(1, 2)), ValueError, "groups must be 1-D"),
        ("groups device", lambda: pad_rows_fp8_reference(a, s, g.to("meta")), ValueError, "data's device"),
        ("groups type", lambda: pad_rows_fp8_reference(a, s, [2, 4]), TypeError, "groups must be a torch.Tensor"),
        ("no group", lambda: pad_rows_fp8_reference(a, s, g[:0]), ValueError, "expected G >= 1"),
        ("num_groups", lambda: pad_rows_fp8_reference(a, s, g, num_groups=5), ValueError, "G\\+1 offsets with G=5"),
        ("align 0", lambda: pad_rows_fp8_reference(a, s, g, 0), ValueError, "multiple of 16"),
        ("align 24", lambda: pad_rows_fp8_reference(a, s, g, 24), ValueError, "multiple of 16"),
        ("sum", lambda: pad_rows_fp8_reference(a, s, torch.tensor([2, 5])), ValueError,
         "sum to 7, but the data has M_total=6"),
        ("negative", lambda: pad_rows_fp8_reference(a, s, torch.tensor([-1, 7])), ValueError, ">= 0"),
        ("offsets start", lambda: pad_rows_fp8_reference(a, s, torch.tensor([1, 2, 6]), num_groups=2), ValueError,
         "start at 0"),
        ("offsets order", lambda: pad_rows_fp8_reference(a, s, torch.tensor([0, 7, 6]), num_groups=2), ValueError,
         "non-decreasing"),
        ("public api", lambda: padding.pad_rows_fp8(a, row_major, g), ValueError, "M-contiguous"),
    ]


@pytest.mark.parametrize("name,call,exc,match", _pad_error_cases(), ids=[c[0] for c in _pad_error_cases()])
def test_pad_errors(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _unpad_error_cases():
    a, s, g = _pad_inputs()
    _, _, offsets = pad_rows_fp8_reference(a, s, g, 16)
    y = torch.zeros(padded_row_count_upper_bound(6, 2, 16), 16, dtype=torch.bfloat16)
    return [
        ("y dtype", lambda: unpad_rows_reference(y.float(), g, offsets, 6), TypeError, "y_pad must have dtype"),
        ("N % 8", lambda: unpad_rows_reference(y[:, :12].contiguous(), g, offsets, 6), ValueError, "multiple of 8"),
        ("offsets dtype", lambda: unpad_rows_reference(y, g, offsets.long(), 6), TypeError, "padded_offsets must"),
        ("offsets length", lambda: unpad_rows_reference(y, g, offsets[:1], 6), ValueError, "G\\+1 >= 2"),
        ("groups length", lambda: unpad_rows_reference(y, g[:1], offsets, 6), ValueError, "with G=2"),
        ("m_total", lambda: unpad_rows_reference(y, g, offsets, 6.0), ValueError, "m_total must be an int"),
        ("sum", lambda: unpad_rows_reference(y, g, offsets, 7), ValueError, "sum to 6, but the data has M_total=7"),
        ("out shape", lambda: unpad_rows_reference(y, g, offsets, 6, out=y[:5]), ValueError, "out must have shape"),
        ("out dtype", lambda: unpad_rows_reference(y, g, offsets, 6, out=y[:6].float()), TypeError, "out must have"),
        ("overlap", lambda: unpad_rows_reference(y, g, offsets, 6, out=y[:6]), ValueError, "overlap"),
        ("short padding", lambda: unpad_rows_reference(y, g, torch.tensor([0, 1, 16], dtype=torch.int32), 6),
         ValueError, "group 0 1 rows but it has 2"),
        ("offsets order", lambda: unpad_rows_reference(y, g, torch.tensor([0, 16, 8], dtype=torch.int32), 6),
         ValueError, "padded_offsets: offsets must be non-decreasing"),
        ("past y_pad", lambda: unpad_rows_reference(y[:20], g, offsets, 6), ValueError, "y_pad has 20 rows"),
        ("public api", lambda: padding.unpad_rows(y, g, offsets.long(), 6), TypeError, "padded_offsets must"),
    ]


@pytest.mark.parametrize("name,call,exc,match", _unpad_error_cases(), ids=[c[0] for c in _unpad_error_cases()])
def test_unpad_errors(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_padded_gemm_checks_b():
    a, s, g = _pad_inputs()
    with pytest.raises(TypeError, match="b must have dtype"):
        padded_m_grouped_fp8_gemm(a, s, torch.zeros(2, 16, 256, dtype=torch.bfloat16), None, g, gemm=exact_grouped_gemm)
    b3 = torch.zeros(3, 16, 256, dtype=torch.uint8).view(FP8)
    with pytest.raises(ValueError, match="with G=3"):  # G comes from b
        padded_m_grouped_fp8_gemm(a, s, b3, None, g, gemm=exact_grouped_gemm)


def test_unpad_inverts_pad_on_random_sizes():
    """Many random size vectors (incl. empty groups and M < 128) through pad then unpad."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        num_groups = rng.choice([1, 2, 7, 33])
        sizes = [rng.choice([0, 1, rng.randint(0, 300)]) for _ in range(num_groups)]
        m = sum(sizes)
        a = random_fp8(m, 32, gen)
        a_pad, _, offsets = pad_rows_fp8_reference(a, strided_scales(m, 32, gen), torch.tensor(sizes), 16)
        y = unpad_rows_reference(a_pad.view(torch.uint8).view(torch.int16).view(torch.bfloat16), torch.tensor(sizes),
                                 offsets, m)
        assert torch.equal(y.view(torch.uint8), a.view(torch.uint8))
