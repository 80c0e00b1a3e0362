"""Python API of the grouped GEMMs on the CPU (reference backend): validation messages and the reference
result through the public entry point."""
import pytest
import torch

from megatron_tma import reference as R
from megatron_tma.gemm import m_grouped_fp8_gemm


def _operands(m=200, n=256, k=256, g=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(g, n, k, generator=gen) * 0.05).bfloat16()
    aq, a_s = R.quantize_1x128(x)
    b, bs, _, _ = R.quantize_128x128(w)
    sizes = torch.tensor([m // 2, 0, m - m // 2], dtype=torch.int64)
    return aq, a_s, b, bs, sizes


def test_reference_backend_matches_reference_module():
    aq, a_s, b, bs, sizes = _operands()
    out = m_grouped_fp8_gemm(aq, a_s, b, bs, sizes)
    assert out.dtype == torch.bfloat16 and out.shape == (200, 256)
    assert torch.equal(out, R.m_grouped_fp8_gemm(aq, a_s, b, bs, sizes))
    assert R.diff(out.double(), R.m_grouped_ref64(aq, a_s, b, bs, sizes)) < 1e-3


def test_out_argument_is_filled_and_returned():
    aq, a_s, b, bs, sizes = _operands()
    out = torch.full((200, 256), float("nan"), dtype=torch.bfloat16)
    ret = m_grouped_fp8_gemm(aq, a_s, b, bs, sizes, out=out)
    assert ret is out and not out.isnan().any()


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(a=a["a"].float()), TypeError, "a must have dtype float8_e4m3fn"),
        (lambda a: a.update(b=a["b"][0]), ValueError, "b must be 3-D"),
        (lambda a: a.update(b=a["b"][:, :, :128].contiguous()), ValueError, "K differs"),
        (lambda a: a.update(b_scales=a["b_scales"][:, :1].contiguous()), ValueError, r"b_scales must be \[G, ceil\(N/128\), K/128\]"),
        (lambda a: a.update(a_scales=a["a_scales"].contiguous()), ValueError, "M-contiguous view"),
        (lambda a: a.update(groups=a["groups"].float()), TypeError, "int32 or int64"),
        (lambda a: a.update(groups=torch.tensor([1, 2], dtype=torch.int64)), ValueError, "G sizes or G\\+1 offsets"),
        (lambda a: a.update(groups=torch.tensor([100, 0, 99], dtype=torch.int64)), ValueError, "sum"),
        (lambda a: a.update(groups=torch.tensor([-1, 101, 100], dtype=torch.int64)), ValueError, "negative"),
        (lambda a: a.update(out=torch.empty(200, 256)), TypeError, "out must have dtype bfloat16"),
        (lambda a: a.update(out=torch.empty(100, 256, dtype=torch.bfloat16)), ValueError, r"out must be \[M, N\]"),
        (lambda a: a.update(out=torch.empty(200 * 256 + 8, dtype=torch.bfloat16)[4:][: 200 * 256].view(200, 256)),
         ValueError, "out must start 16-byte aligned"),
        (lambda a: a.update(backend="tpu"), ValueError, "backend must be"),
        (lambda a: a.update(block_n=64), ValueError, "block_n must be"),
        (lambda a: a.update(block_m=64), ValueError, "block_m must be"),
        (lambda a: a.update(block_m=192, block_n=256), ValueError, "block_m=192 tiles are 128 wide"),
    ],
)
def test_validation_messages(mutate, exc, match):
    aq, a_s, b, bs, sizes = _operands()
    args = dict(a=aq, a_scales=a_s, b=b, b_scales=bs, groups=sizes)
    mutate(args)
    with pytest.raises(exc, match=match):
        m_grouped_fp8_gemm(**args)


def test_k_and_n_rules():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 192, generator=gen).bfloat16()
    aq, a_s = R.quantize_1x128(x)
    b = torch.zeros(1, 256, 192, dtype=torch.float8_e4m3fn)
    bs = torch.ones(1, 2, 2)
    with pytest.raises(ValueError, match="K must be a positive multiple of 128"):
        m_grouped_fp8_gemm(aq, a_s, b, bs, torch.tensor([64]))
    x = torch.randn(64, 128, generator=gen).bfloat16()
    aq, a_s = R.quantize_1x128(x)
    b = torch.zeros(1, 40, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="N must be a positive multiple of 16"):
        m_grouped_fp8_gemm(aq, a_s, b, torch.ones(1, 1, 1), torch.tensor([64]))


def test_cuda_backend_requested_without_gpu_is_a_clear_error():
    aq, a_s, b, bs, sizes = _operands()
    with pytest.raises((ValueError, RuntimeError), match="cuda"):
        m_grouped_fp8_gemm(aq, a_s, b, bs, sizes, backend="cuda")


@pytest.mark.parametrize("dtype,offset,pair_bytes", [(torch.float32, 1, 8), (torch.bfloat16, 1, 4)])
def test_k_grouped_out_must_be_pair_aligned(dtype, offset, pair_bytes):
    """The kernels store output elements in pairs: a view that starts between two pairs is refused clearly
    (on every backend, so that code tested on the CPU behaves the same on the GPU)."""
    from megatron_tma.gemm import k_grouped_fp8_gemm

    gen = torch.Generator().manual_seed(2)
    sizes = torch.tensor([100, 0, 60], dtype=torch.int64)
    x = torch.randn(160, 128, generator=gen).bfloat16()
    dy = torch.randn(160, 64, generator=gen).bfloat16()
    xt, xs = R.quantize_grouped_128x1(x, sizes)
    dyt, dys = R.quantize_grouped_128x1(dy, sizes)
    storage = torch.zeros(3 * 64 * 128 + 4, dtype=dtype)
    out = storage[offset:][: 3 * 64 * 128].view(3, 64, 128)
    with pytest.raises(ValueError, match=f"out must be {pair_bytes}-byte aligned"):
        k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=out, out_dtype=dtype)
    aligned = storage[: 3 * 64 * 128].view(3, 64, 128)  # the same call on an aligned out works
    assert k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, out=aligned, out_dtype=dtype) is aligned


def test_m_grouped_tile_without_the_extension_says_what_it_needs():
    """The tile query reads the launcher's choice, so it needs the built extension; elsewhere a clear error
    (the choice itself is tested on the CPU in test_m_grouped_tile_choice.py, the query on the GPU)."""
    import megatron_tma
    from megatron_tma import _ext

    assert megatron_tma.m_grouped_tile is megatron_tma.gemm.m_grouped_tile
    if _ext.has_extension():
        pytest.skip("the extension is built here: tests/test_m_grouped_gpu.py covers the query")
    with pytest.raises(RuntimeError, match="needs the CUDA extension"):
        megatron_tma.m_grouped_tile(65536, 4096, 8)
