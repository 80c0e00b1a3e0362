"""The padded path's gather kernels on a Hopper GPU: bit-equal to the torch reference on whole buffers,
capturable in a CUDA graph with new sizes on replay, free of host synchronisation, near copy bandwidth."""
import itertools
import zlib

import pytest
import torch

import megatron_tma
from megatron_tma.padding import (
    pad_rows_fp8,
    pad_rows_fp8_reference,
    padded_m_grouped_fp8_gemm,
    padded_row_count_upper_bound,
    unpad_rows,
    unpad_rows_reference,
)

pytestmark = pytest.mark.skipif(
    not megatron_tma._ext.cuda_kernels_available(),
    reason="needs a Hopper (sm_90) GPU and the built megatron_tma._C extension",
)

FP8 = torch.float8_e4m3fn
DEV = "cuda"


def seeded(*key):
    return torch.Generator(device=DEV).manual_seed(zlib.crc32(repr(key).encode()))


def random_fp8(m, k, gen):
    """Every byte pattern, NaNs included: the kernels move bytes and must keep them."""
    return torch.randint(0, 256, (m, k), dtype=torch.uint8, device=DEV, generator=gen).view(FP8)


def quantized_fp8(m, k, gen):
    """Finite FP8 values (for paths that convert the data)."""
    return (torch.randn(m, k, device=DEV, generator=gen) * 100).clamp(-448, 448).to(FP8)


def strided_scales(m, k, gen):
    """1x128 scales in the layout of docs/layouts.md: storage [ceil(K/128), ceil(M/4)*4], pad entries 1.0."""
    kb, m4 = (k + 127) // 128, (m + 3) // 4 * 4
    storage = torch.ones(kb, m4, device=DEV)
    storage[:, :m] = torch.rand(kb, m, device=DEV, generator=gen) * 10 + 0.01
    return storage[:, :m].t()


def groups_tensor(sizes, kind):
    """sizes as an int32/int64 sizes [G] or offsets [G+1] device tensor; returns (tensor, num_groups kwarg)."""
    dtype = torch.int32 if kind.endswith("32") else torch.int64
    if kind.startswith("sizes"):
        return torch.tensor(sizes, dtype=dtype, device=DEV), None
    return torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=dtype, device=DEV), len(sizes)


def poison_allocations(*nbytes):
    """Fill caching-allocator blocks of these sizes with 0x7f bytes (FP8 NaN, scale 3.4e38) and free them, so
    the kernel's outputs of the same sizes most likely reuse them: a row or scale the kernel forgets to write
    then differs from the reference."""
    blocks = [torch.full((n,), 0x7F, dtype=torch.uint8, device=DEV) for n in nbytes if n > 0]
    del blocks


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def case_sizes(name, gen):
    if name == "g256":
        sizes = torch.randint(0, 200, (256,), device=DEV, generator=gen)
        sizes[torch.rand(256, device=DEV, generator=gen) < 0.2] = 0
        return sizes.tolist()
    return {
        "edges": [0, 1, 127, 128, 129],
        "leading_big": [129, 0, 0, 1, 255, 256, 257],
        "single": [300],
        "tiny": [3, 0, 2],
        "one_empty": [0],
        "all_empty": [0, 0, 0],
    }[name]


CASES = ["edges", "leading_big", "single", "tiny", "one_empty", "all_empty", "g256"]


def assert_pad_equal(got, ref):
    (a_pad, s_pad, off), (ra, rs, ro) = got, ref
    assert a_pad.shape == ra.shape and a_pad.stride() == ra.stride()
    assert torch.equal(bits(a_pad), bits(ra))
    assert s_pad.shape == rs.shape and s_pad.stride() == rs.stride()
    assert torch.equal(bits(s_pad), bits(rs))
    assert off.dtype == ro.dtype and torch.equal(off, ro)


@pytest.mark.parametrize("k", [16, 48, 384])
@pytest.mark.parametrize("kind", ["sizes32", "sizes64", "offsets32", "offsets64"])
@pytest.mark.parametrize("align", [128, 16])
@pytest.mark.parametrize("case", CASES)
def test_pad_kernel_matches_reference(case, align, kind, k):
    gen = seeded(case, align, kind, k)
    sizes = case_sizes(case, gen)
    m, num_groups = sum(sizes), len(sizes)
    a, a_scales = random_fp8(m, k, gen), strided_scales(m, k, gen)
    groups, ng = groups_tensor(sizes, kind)
    m_pad, kb = padded_row_count_upper_bound(m, num_groups, align), (k + 127) // 128
    poison_allocations(m_pad * k, kb * m_pad * 4, (num_groups + 1) * 4)
    got = pad_rows_fp8(a, a_scales, groups, align, num_groups=ng)
    assert_pad_equal(got, pad_rows_fp8_reference(a, a_scales, groups, align, num_groups=ng))


@pytest.mark.parametrize("k", [7168, 128])
def test_pad_kernel_matches_reference_large(k):
    gen = seeded("large", k)
    sizes = torch.randint(0, 2 * 16384 // 32, (32,), device=DEV, generator=gen).tolist()
    m = sum(sizes)
    a, a_scales = random_fp8(m, k, gen), strided_scales(m, k, gen)
    groups = torch.tensor(sizes, dtype=torch.int64, device=DEV)
    got = pad_rows_fp8(a, a_scales, groups)
    assert_pad_equal(got, pad_rows_fp8_reference(a, a_scales, groups))


@pytest.mark.parametrize("n", [8, 24, 4096])
@pytest.mark.parametrize("kind", ["sizes32", "offsets64"])
@pytest.mark.parametrize("align", [128, 16])
@pytest.mark.parametrize("case", CASES)
def test_unpad_kernel_matches_reference(case, align, kind, n):
    gen = seeded(case, align, kind, n)
    sizes = case_sizes(case, gen)
    m, num_groups = sum(sizes), len(sizes)
    groups, ng = groups_tensor(sizes, kind)
    _, _, offsets = pad_rows_fp8_reference(random_fp8(m, 16, gen), strided_scales(m, 16, gen), groups, align,
                                           num_groups=ng)
    m_pad = padded_row_count_upper_bound(m, num_groups, align)
    y_pad = torch.empty(m_pad, n, dtype=torch.int16, device=DEV).random_(-(2**15), 2**15, generator=gen)
    y_pad = y_pad.view(torch.bfloat16)  # every bit pattern, NaNs included
    ref = unpad_rows_reference(y_pad, groups, offsets, m)

    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert unpad_rows(y_pad, groups, offsets, m, out=out) is out
    assert torch.equal(bits(out), bits(ref))
    poison_allocations(m * n * 2)
    assert torch.equal(bits(unpad_rows(y_pad, groups, offsets, m)), bits(ref))


def test_kernels_clamp_malformed_sizes():
    """Sizes the kernels cannot check (no host read) never make them access memory outside the tensors."""
    gen = seeded("malformed")
    m, k, n = 300, 256, 64
    a, a_scales = random_fp8(m, k, gen), strided_scales(m, k, gen)
    for given, clamped in [([m - 10, 50], [m - 10, 10]), ([-5, 100, 200], [0, 100, 200]), ([2**30, 7], [m, 0])]:
        got = pad_rows_fp8(a, a_scales, torch.tensor(given, dtype=torch.int32, device=DEV))
        assert_pad_equal(got, pad_rows_fp8_reference(a, a_scales, torch.tensor(clamped, device=DEV)))

    # sizes summing below M: out rows no group covers are zeros
    groups = torch.tensor([100, 50], dtype=torch.int32, device=DEV)
    _, _, offsets = pad_rows_fp8_reference(a[:150], a_scales[:150], groups)
    y_pad = torch.randn(padded_row_count_upper_bound(150, 2, 128), n, device=DEV, generator=gen).bfloat16()
    out = unpad_rows(y_pad, groups, offsets, m)
    assert torch.equal(out[:150], unpad_rows_reference(y_pad, groups, offsets, 150))
    assert not out[150:].any()


def test_graph_capture_with_new_sizes():
    gen = seeded("graph")
    m, k, num_groups = 1000, 256, 8
    a, a_scales = quantized_fp8(m, k, gen), strided_scales(m, k, gen)
    sizes = torch.tensor([125] * num_groups, dtype=torch.int32, device=DEV)

    def step():
        a_pad, s_pad, offsets = pad_rows_fp8(a, a_scales, sizes)
        y = unpad_rows(a_pad.to(torch.bfloat16), sizes, offsets, m)  # an identity "GEMM": y must equal a
        return a_pad, s_pad, offsets, y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    for new in ([1000, 0, 0, 0, 0, 0, 0, 0], [0, 1, 127, 128, 129, 0, 300, 315], [0] * 7 + [1000], [3] * 7 + [979]):
        sizes.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_pad_equal(captured[:3], pad_rows_fp8_reference(a, a_scales, sizes))
        assert torch.equal(captured[3], a.to(torch.bfloat16))


def test_no_host_synchronisation():
    gen = seeded("sync")
    m, k, n, num_groups = 700, 256, 128, 4
    a, a_scales = quantized_fp8(m, k, gen), strided_scales(m, k, gen)
    b = quantized_fp8(num_groups * n, k, gen).view(num_groups, n, k)
    b_scales = torch.ones(num_groups, 1, k // 128, device=DEV)
    sizes = torch.tensor([0, 200, 1, 499], dtype=torch.int64, device=DEV)

    def device_only_gemm(a_pad, s_pad, b_, bs_, padded_offsets):
        return a_pad.to(torch.bfloat16) @ b_[0].to(torch.bfloat16).t()

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode does catch a host read
            sizes.sum().item()
        a_pad, _, offsets = pad_rows_fp8(a, a_scales, sizes)
        unpad_rows(a_pad.to(torch.bfloat16), sizes, offsets, m)
        padded_m_grouped_fp8_gemm(a, a_scales, b, b_scales, sizes, gemm=device_only_gemm)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_ops_pass_opcheck():
    gen = seeded("opcheck")
    sizes = [0, 1, 129, 40]
    m, k, n = sum(sizes), 256, 64
    a, a_scales = random_fp8(m, k, gen), strided_scales(m, k, gen)
    groups = torch.tensor(sizes, dtype=torch.int32, device=DEV)
    ops = megatron_tma._ext.ops()
    # test_schema compares mutated inputs with arithmetic that FP8 tensors do not support; the fake-tensor
    # and registration checks are what torch.compile relies on.
    utils = ("test_faketensor", "test_autograd_registration")
    torch.library.opcheck(ops.pad_rows_fp8.default, (a, a_scales, groups, len(sizes), 128), test_utils=utils)
    _, _, offsets = pad_rows_fp8(a, a_scales, groups)
    y_pad = torch.randn(padded_row_count_upper_bound(m, len(sizes), 128), n, device=DEV, generator=gen).bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    torch.library.opcheck(ops.unpad_rows_bf16.default, (y_pad, groups, offsets, out))  # BF16: all checks


def test_kernel_errors():
    gen = seeded("errors")
    a, a_scales = random_fp8(64, 128, gen), strided_scales(64, 128, gen)
    groups = torch.tensor([64], dtype=torch.int32, device=DEV)
    misaligned = torch.empty(64 * 128 + 1, dtype=torch.uint8, device=DEV)[1:].view(64, 128).view(FP8)
    with pytest.raises(ValueError, match="16-byte aligned"):
        pad_rows_fp8(misaligned, a_scales, groups)
    with pytest.raises(ValueError, match="device"):
        pad_rows_fp8(a, a_scales, groups.cpu())
    y = torch.zeros(128, 16, dtype=torch.bfloat16, device=DEV)
    _, _, offsets = pad_rows_fp8(a, a_scales, groups)
    with pytest.raises(ValueError, match="overlap"):
        unpad_rows(y, groups, offsets, 64, out=y[64:])


@pytest.mark.parametrize("sizes", [[0, 1, 127, 128, 129, 0, 300, 64], [1000], [0, 5]])
@pytest.mark.parametrize("align", [128, 16])
def test_padded_path_matches_the_unpadded_gemm(sizes, align):
    """docs/design.md §3: the valid rows of the padded path equal the unpadded GEMM bit for bit."""
    from megatron_tma import gemm
    gen = seeded("gemm", tuple(sizes), align)
    m, g, n, k = sum(sizes), len(sizes), 256, 512
    a, a_scales = quantized_fp8(m, k, gen), strided_scales(m, k, gen)
    b = quantized_fp8(g * n, k, gen).view(g, n, k)
    b_scales = torch.rand(g, n // 128, k // 128, device=DEV, generator=gen) + 0.5
    groups = torch.tensor(sizes, dtype=torch.int32, device=DEV)
    expected = gemm.m_grouped_fp8_gemm(a, a_scales, b, b_scales, groups)
    got = padded_m_grouped_fp8_gemm(a, a_scales, b, b_scales, groups, align=align)
    assert torch.equal(got, expected)
