"""Python API of the quantizers on the CPU (reference backend): dispatch, argument validation messages, and
the fake (meta) implementations that torch.compile uses against the reference layouts."""
import pytest
import torch
from _dists import double_rounding_block, group_tensor, random_rows

from megatron_tma import ops
from megatron_tma import reference as R
from megatron_tma.groups import aligned_token_offsets
from megatron_tma.quant import (quantize_1x128, quantize_1x128_and_grouped_128x1, quantize_128x128,
                                quantize_128x128_from_master, quantize_grouped_128x1)


def same_layout(a, b):
    """Same dtype, shape and strides (those of size-1 dims are meaningless and not compared)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1))


def _same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return same_layout(a, b) and torch.equal(a, b)


def _all_same(got, want):
    got, want = tuple(got), tuple(want)
    return len(got) == len(want) and all(map(_same, got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_runs_the_reference(gen, dtype):
    x = random_rows(200, 272, gen, dtype)
    assert _all_same(quantize_1x128(x, True), R.quantize_1x128(x, True))
    w = random_rows(288, 144, gen, dtype).view(2, 144, 144)
    assert _all_same(quantize_128x128(w), R.quantize_128x128(w))
    assert _all_same(quantize_128x128(w[0]), R.quantize_128x128(w[0]))
    sizes = [70, 0, 130]
    assert _all_same(quantize_grouped_128x1(x, torch.tensor(sizes)), R.quantize_grouped_128x1(x, torch.tensor(sizes)))
    offsets = group_tensor(sizes, ("offsets", torch.int32))
    assert _all_same(quantize_grouped_128x1(x, offsets, num_groups=3, backend="reference"),
                     R.quantize_grouped_128x1(x, torch.tensor(sizes)))
    both = R.quantize_1x128(x, True) + R.quantize_grouped_128x1(x, torch.tensor(sizes), True)
    assert _all_same(quantize_1x128_and_grouped_128x1(x, offsets, True, num_groups=3), both)


@pytest.mark.parametrize("fmt", [("sizes", torch.int32), ("sizes", torch.int64), ("offsets", torch.int32),
                                 ("offsets", torch.int64)])
def test_grouped_qt_is_the_aligned_layout(gen, fmt):
    """The public quantizers return the contiguous [K, P] qt of the 128-aligned layout, for every group format."""
    sizes = [0, 1, 15, 16, 17, 127, 128, 129]
    m, g = sum(sizes), len(sizes)
    x = random_rows(m, 32, gen)
    groups = group_tensor(sizes, fmt)
    num_groups = g if fmt[0] == "offsets" else None
    qt, s = quantize_grouped_128x1(x, groups, num_groups=num_groups)
    assert qt.shape == (32, -(-m // 128) * 128 + 128 * g) and qt.is_contiguous() and s.shape == (m // 128 + g, 32)
    assert _all_same((qt, s), R.quantize_grouped_128x1(x, torch.tensor(sizes)))
    *_, qt2, s2 = quantize_1x128_and_grouped_128x1(x, groups, num_groups=num_groups)
    assert _same(qt2, qt) and _same(s2, s)
    starts = aligned_token_offsets(groups, num_groups).tolist()
    written = torch.zeros(qt.shape[1], dtype=torch.bool)
    for a, size in zip(starts, sizes):
        written[a: a + size] = True
    assert not qt.view(torch.uint8)[:, ~written].any()  # gaps and tail are zero


X = torch.zeros(4, 32, dtype=torch.bfloat16)
W = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
SIZES = torch.tensor([1, 3])


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: quantize_1x128(X.float()), TypeError, "x must have dtype bfloat16 or float16, got float32"),
        (lambda: quantize_1x128(X[0]), ValueError, "x must be 2-D"),
        (lambda: quantize_1x128(torch.zeros(32, 4, dtype=torch.bfloat16).t()), ValueError, "x must be contiguous"),
        (lambda: quantize_1x128(torch.zeros(4, 24, dtype=torch.bfloat16)), ValueError, "K .* must be a multiple of 16, got 24"),
        (lambda: quantize_1x128(X, 1), TypeError, "pow2 must be a bool"),
        (lambda: quantize_1x128(X, backend="tpu"), ValueError, "backend must be"),
        (lambda: quantize_1x128(X, backend="cuda"), ValueError, "backend='cuda' needs CUDA tensors"),
        (lambda: quantize_128x128(W.double()), TypeError, "w must have dtype bfloat16 or float16"),
        (lambda: quantize_128x128(W[None]), ValueError, r"w must be \[N, K\] or \[G, N, K\]"),
        (lambda: quantize_128x128(torch.zeros(1, 24, 32, dtype=torch.bfloat16)), ValueError, "N .* multiple of 16, got 24"),
        (lambda: quantize_128x128(torch.zeros(1, 32, 40, dtype=torch.bfloat16)), ValueError, "K .* multiple of 16, got 40"),
        (lambda: quantize_128x128(W.transpose(1, 2)), ValueError, "w must be contiguous"),
        (lambda: quantize_128x128_from_master(W.bfloat16()), TypeError, "master must have dtype float32"),
        (lambda: quantize_128x128_from_master(W.float()[0]), ValueError, "master must be 3-D"),
        (lambda: quantize_128x128_from_master(torch.zeros(1, 24, 32)), ValueError, "N .* multiple of 16, got 24"),
        (lambda: quantize_128x128_from_master(W.float().transpose(1, 2)), ValueError, "master must be contiguous"),
        (lambda: quantize_grouped_128x1(X.half().float(), SIZES), TypeError, "x must have dtype"),
        (lambda: quantize_grouped_128x1(torch.zeros(4, 8, dtype=torch.bfloat16), SIZES), ValueError, "multiple of 16, got 8"),
        (lambda: quantize_grouped_128x1(X, SIZES.float()), TypeError, "int32 or int64"),
        (lambda: quantize_grouped_128x1(X, SIZES[None]), ValueError, "must be 1-D"),
        (lambda: quantize_grouped_128x1(X, torch.tensor([1, 2])), ValueError, "sum to 3, but the data has M_total=4"),
        (lambda: quantize_grouped_128x1(X, torch.tensor([5, -1])), ValueError, "must be >= 0"),
        (lambda: quantize_grouped_128x1(X, torch.tensor([0, 1, 2, 3, 4]), num_groups=3), ValueError, "G sizes or G\\+1 offsets"),
        (lambda: quantize_grouped_128x1(X, torch.tensor([0, 3, 2]), num_groups=2), ValueError, "non-decreasing"),
        (lambda: quantize_grouped_128x1(X, SIZES.to("meta")), ValueError, "must be on the data's device"),
        (lambda: quantize_grouped_128x1(X, torch.zeros(8193, dtype=torch.int64).index_fill_(0, torch.tensor([0]), 4)),
         ValueError, "at most 8192 groups"),
        (lambda: quantize_grouped_128x1(X, SIZES, 0), TypeError, "pow2 must be a bool"),
        (lambda: quantize_1x128_and_grouped_128x1(X, torch.tensor([1, 2])), ValueError, "sum to 3"),
        (lambda: quantize_1x128_and_grouped_128x1(torch.zeros(4, 40, dtype=torch.half), SIZES), ValueError,
         "quantize_1x128_and_grouped_128x1: K .* multiple of 16, got 40"),
    ],
)
def test_validation_messages(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_from_master_is_the_quantization_of_the_bf16_rounding(gen):
    """The master weights' op on the CPU: quantize_128x128 of their BF16 rounding, byte for byte, which differs from
    quantizing the FP32 values themselves where the rounding matters (the CUDA kernel is held to the same:
    tests/test_quant_gpu.py)."""
    master = torch.randn(3, 144, 272, generator=gen) * 7
    for got, want in zip(quantize_128x128_from_master(master), quantize_128x128(master.bfloat16())):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.dtype != torch.float32 else \
            torch.equal(got, want)
    for pow2 in (False, True):
        q = quantize_128x128_from_master(double_rounding_block(), pow2)[0]
        assert float(q[0, 1, 1]) == 1.0 and float(R.quantize_128x128(double_rounding_block(), pow2)[0][0, 1, 1]) == 1.125


@pytest.mark.parametrize("m,k", [(0, 128), (1, 16), (5, 272), (130, 128)])
def test_fake_1x128_matches_reference_layout(m, k):
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    (fq, fs), (rq, rs) = ops._fake_quantize_1x128(x.to("meta")), R.quantize_1x128(x)
    assert same_layout(fq, rq) and same_layout(fs, rs)
    assert fs.untyped_storage().nbytes() == rs.untyped_storage().nbytes()  # the pad entries


@pytest.mark.parametrize("shape", [(1, 16, 16), (2, 144, 272)])
def test_fake_128x128_matches_reference_layout(shape):
    w = torch.zeros(shape, dtype=torch.bfloat16)
    for f, r in zip(ops._fake_quantize_128x128(w.to("meta")), R.quantize_128x128(w), strict=True):
        assert same_layout(f, r)


@pytest.mark.parametrize("sizes", [[0, 0, 0], [1], [15], [16], [17], [127, 128, 129], [300, 0, 5],
                                   [0, 1, 15, 16, 17, 127, 128, 129]])
def test_fake_grouped_matches_reference_layout(sizes):
    x = torch.zeros(sum(sizes), 48, dtype=torch.bfloat16)
    fake = ops._fake_quantize_grouped_128x1(x.to("meta"), torch.tensor(sizes).to("meta"), len(sizes))
    for f, r in zip(fake, R.quantize_grouped_128x1(x, torch.tensor(sizes)), strict=True):
        assert same_layout(f, r) and f.is_contiguous()
        assert f.untyped_storage().nbytes() == r.untyped_storage().nbytes()
    m, g = sum(sizes), len(sizes)
    assert fake[0].shape == (48, -(-m // 128) * 128 + 128 * g)  # qt [K, P], P = round_up(M, 128) + 128 G


def test_fake_fused_is_the_two_fakes():
    x, sizes = torch.zeros(300, 48, dtype=torch.bfloat16), torch.tensor([0, 299, 1])
    fake = ops._fake_quantize_1x128_and_grouped_128x1(x.to("meta"), sizes.to("meta"), 3)
    ref = R.quantize_1x128(x) + R.quantize_grouped_128x1(x, sizes)
    assert len(fake) == 4 and all(same_layout(f, r) for f, r in zip(fake, ref))
