"""The fused activation-times-probs kernels (kernels/activation.cuh) on the H200: against float64, against the torch
reference path (within one bf16 rounding), rows independent of the other rows (the padded twin's bit-exactness),
zero rows give zero gradients, NaN stays in its element, nothing written outside the output, capturable.
Skipped without a Hopper GPU + extension."""
import pytest
import torch
from _activation64 import act64

from megatron_tma import _ext
from megatron_tma.activation import ACTIVATIONS, GATED, activation_times_probs

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")

DEV = "cuda"


def inputs(t, f, activation, seed, probs_dtype=torch.float32):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = 2 * f if activation in GATED else f
    h = (torch.randn(t, w, generator=gen, device=DEV) * 3).bfloat16()
    p = torch.rand(t, generator=gen, device=DEV).to(probs_dtype)
    dz = torch.randn(t, f, generator=gen, device=DEV).bfloat16()
    return h, p, dz


def run(h, p, dz, activation, backend):
    h = h.clone().requires_grad_()
    p = p.clone().requires_grad_() if p is not None else None
    z = activation_times_probs(h, p, activation, backend=backend)
    z.backward(dz)
    return z.detach(), h.grad, (p.grad if p is not None else None)


def within_one_rounding(x, ref):
    """x (bf16) is ref (float64) rounded once to bf16 after FP32 math: relative error <= 2^-8 (plus FP32 noise
    for values near zero: silu's and GELU's tails come out of an exp that is itself rounded)."""
    return bool(((x.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-12).all())


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("t,f", [(1, 8), (300, 768), (64, 14336), (1000, 136)])
@pytest.mark.parametrize("probs", ["fp32", "bf16", None])
def test_against_float64(activation, t, f, probs):
    h, p, dz = inputs(t, f, activation, seed=t + f, probs_dtype=torch.bfloat16 if probs == "bf16" else torch.float32)
    p = p if probs else None
    z, dh, dp = run(h, p, dz, activation, "cuda")
    h64 = h.double().requires_grad_()
    p64 = p.double().requires_grad_() if p is not None else None
    z64 = act64(h64, activation) * (p64[:, None] if p is not None else 1.0)
    z64.backward(dz.double())
    assert within_one_rounding(z, z64.detach())
    assert within_one_rounding(dh, h64.grad)
    if p is not None:
        assert dp.dtype == p.dtype
        scale = (dz.double() * act64(h.double(), activation)).abs().sum(1)
        tol = 1e-5 if p.dtype == torch.float32 else 2**-8
        assert ((dp.double() - p64.grad).abs() <= tol * scale + 1e-30).all()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_close_to_the_torch_path(activation):
    """The kernel and the torch reference path differ at most by one bf16 rounding step (expf, erff and division
    may differ in the last FP32 bit)."""
    h, p, dz = inputs(512, 1024, activation, seed=5)
    (z, dh, dp), (rz, rdh, rdp) = run(h, p, dz, activation, "cuda"), run(h, p, dz, activation, "reference")
    for a, b in ((z, rz), (dh, rdh)):
        # one bf16 step of the larger of the two, or FP32 noise for values near zero (GELU's tail: the kernel's
        # erfc form keeps bits that torch's 1 + erf loses)
        ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(a.double().abs(), b.double().abs())
        assert ((a.double() - b.double()).abs() <= ulp + 1e-6).all()
    # the probs gradient is a row sum with cancellation: compare against the sum of the magnitudes
    scale = (dz.double() * act64(h.double(), activation)).abs().sum(1)
    assert ((dp.double() - rdp.double()).abs() <= 1e-5 * scale).all()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_rows_do_not_depend_on_other_rows(activation):
    """What the padded twin needs: a row gives the same bits among 3 or 3000 rows, and zero rows (padding) give
    zero outputs and zero gradients."""
    h, p, dz = inputs(3000, 768, activation, seed=9)
    z, dh, dp = run(h, p, dz, activation, "cuda")
    z3, dh3, dp3 = run(h[:3], p[:3], dz[:3], activation, "cuda")
    assert torch.equal(z3, z[:3]) and torch.equal(dh3, dh[:3]) and torch.equal(dp3, dp[:3])
    # rows a CTA reaches on its 2nd, 3rd, ... grid-stride pass (the other warp-sum buffer), alone
    for r in (2500, 2999):
        zr, dhr, dpr = run(h[r:r + 1], p[r:r + 1], dz[r:r + 1], activation, "cuda")
        assert torch.equal(zr, z[r:r + 1]) and torch.equal(dhr, dh[r:r + 1]) and torch.equal(dpr, dp[r:r + 1])
    hp = torch.cat([h[:2], torch.zeros_like(h[:5]), h[2:4]])
    pp = torch.cat([p[:2], torch.zeros_like(p[:5]), p[2:4]])
    dzp = torch.cat([dz[:2], torch.zeros_like(dz[:5]), dz[2:4]])
    zp, dhp, dpp = run(hp, pp, dzp, activation, "cuda")
    assert torch.equal(zp[[0, 1, 7, 8]], z[:4]) and torch.equal(dpp[[0, 1, 7, 8]], dp[:4])
    assert torch.equal(dhp[[0, 1, 7, 8]], dh[:4])
    assert not zp[2:7].any() and not dhp[2:7].any() and not dpp[2:7].any()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_probs_without_their_gradient(activation):
    """probs scale dh but need no gradient (the kernel skips the row sums): dh is the same as with them."""
    h, p, dz = inputs(300, 256, activation, seed=21)
    _, dh_ref, _ = run(h, p, dz, activation, "cuda")
    hl = h.clone().requires_grad_()
    activation_times_probs(hl, p, activation, backend="cuda").backward(dz)  # p does not require grad
    assert torch.equal(hl.grad, dh_ref)


def test_unaligned_gradient_view():
    """dz may be a view starting mid-vector (e.g. a slice of a larger buffer): copied, not refused."""
    h, p, dz = inputs(64, 128, "swiglu", seed=22)
    big = torch.zeros(64 * 128 + 3, dtype=torch.bfloat16, device=DEV)
    dz_view = big[3:].view(64, 128)
    dz_view.copy_(dz)
    _, dh_ref, dp_ref = run(h, p, dz, "swiglu", "cuda")
    _, dh, dp = run(h, p, dz_view, "swiglu", "cuda")
    assert torch.equal(dh, dh_ref) and torch.equal(dp, dp_ref)


def test_repeatable_and_nan_stays_local():
    h, p, dz = inputs(257, 512, "swiglu", seed=3)
    first = run(h, p, dz, "swiglu", "cuda")
    assert all(torch.equal(a, b) for a, b in zip(first, run(h, p, dz, "swiglu", "cuda")))
    h[7, 5] = float("nan")
    z, dh, dp = run(h, p, dz, "swiglu", "cuda")
    assert z[7, 5].isnan() and z.isnan().sum() == 1 and dp[7].isnan() and dp.isnan().sum() == 1
    assert not dh[:7].isnan().any() and not dh[8:].isnan().any()


def test_empty_and_errors():
    h = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    p = torch.zeros(0, device=DEV, requires_grad=True)
    z = activation_times_probs(h, p, "swiglu", backend="cuda")
    z.backward(torch.zeros(0, 32, dtype=torch.bfloat16, device=DEV))
    assert z.shape == (0, 32) and h.grad.shape == (0, 64) and p.grad.shape == (0,)
    with pytest.raises(ValueError, match="backend='cuda' needs a contiguous, 16-byte aligned bfloat16 h"):
        activation_times_probs(torch.zeros(4, 24, dtype=torch.bfloat16, device=DEV), None, "swiglu", backend="cuda")
    with pytest.raises(ValueError, match="backend='cuda' needs a contiguous"):
        activation_times_probs(torch.zeros(4, 32, device=DEV), None, "gelu", backend="cuda")
    # "auto" falls back to the torch path for what the kernel does not take
    assert activation_times_probs(torch.ones(4, 24, dtype=torch.bfloat16, device=DEV), None, "swiglu").shape == (4, 12)
    ops = _ext.ops()
    with pytest.raises(ValueError, match="activation must be 0 \\(swiglu\\), 1 \\(gelu\\), 2 \\(squared_relu\\) or 3"):
        ops.act_times_probs_forward(torch.zeros(4, 32, dtype=torch.bfloat16, device=DEV), None, 4)
    with pytest.raises(ValueError, match="the probs gradient needs probs"):
        ops.act_times_probs_backward(torch.zeros(4, 16, dtype=torch.bfloat16, device=DEV),
                                     torch.zeros(4, 32, dtype=torch.bfloat16, device=DEV), None, 0, True)


def test_captures_in_a_graph_and_replays_on_new_data():
    h, p, dz = inputs(1000, 256, "swiglu", seed=4)
    static_h = h.clone().requires_grad_()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the default stream, as graph capture wants
        activation_times_probs(static_h, p, "swiglu").backward(dz)
    torch.cuda.current_stream().wait_stream(s)
    static_h.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        z = activation_times_probs(static_h, p, "swiglu")
        z.backward(dz)
    for seed in (11, 12):
        h2, p2, dz2 = inputs(1000, 256, "swiglu", seed=seed)
        with torch.no_grad():
            static_h.copy_(h2)
            p.copy_(p2)
            dz.copy_(dz2)
        graph.replay()
        z_ref, dh_ref, _ = run(h2, p2, dz2, "swiglu", "cuda")
        assert torch.equal(z, z_ref) and torch.equal(static_h.grad, dh_ref)


def test_ops_pass_opcheck():
    """Schemas, fake (meta) implementations and dispatch of both ops agree with what the kernels do (what
    torch.compile and CUDA graphs rely on)."""
    ops = _ext.ops()
    h, p, dz = inputs(40, 64, "swiglu", seed=30)
    torch.library.opcheck(ops.act_times_probs_forward.default, (h, p, 0))
    torch.library.opcheck(ops.act_times_probs_forward.default, (h[:, :64].contiguous(), None, 1))
    torch.library.opcheck(ops.act_times_probs_backward.default, (dz, h, p, 0, True))
    torch.library.opcheck(ops.act_times_probs_backward.default, (dz, h[:, :64].contiguous(), None, 2, False))
