"""The FP8 grouped-linear Function and the expert MLP on the CPU (reference backend).

Accuracy has two references, both float64 autograd:
* a quantization-aware twin that quantizes exactly the tensors the FP8 path quantizes (x and the weights for the
  forward, dY as 1x128 rows for dgrad and as per-group 128x1 columns for wgrad together with X) and rounds to BF16
  where the FP8 path stores BF16, but multiplies the dequantized operands in float64 (docs/design.md §3's float64
  product of the dequantized operands, extended through the layer). What is left is FP32 against
  float64 accumulation and activation math, which only now and then flips one BF16 or FP8 rounding: measured
  diff <= 1e-9 with torch 2.13 (the output is equal) and up to 2.2e-6 with torch 2.11 (the H200 machine; its
  GELU flips more roundings). TWIN_TOL = 5e-6 leaves that margin and still catches a single 128-element block
  with a wrong scale, transpose, token block or group boundary (one FP8 step is 2^-4 relative: >= 1e-5).
* the unquantized layer. The difference is the FP8 e4m3 noise of the recipe itself: each quantized GEMM operand
  adds ~2.7% RMS relative error, and the layer chains two GEMMs (SwiGLU multiplies two noisy fc1 outputs), so on
  Gaussian data the diff is 1.3e-3 - 2.1e-3 (measured; SwiGLU and power-of-two scales are the upper end, ~2e-3).
  FP8_NOISE_TOL = 3e-3.
"""
import io

import pytest
import torch
from _activation64 import act64

from megatron_tma import quant
from megatron_tma import reference as R
from megatron_tma import testing as T
from megatron_tma.autograd import FP8WeightCache, fp8_grouped_linear, stacked_view
from megatron_tma.groups import make_group_sizes
from megatron_tma.mlp import ACTIVATIONS, GroupedBF16MLP, GroupedFP8MLP, activation_times_probs

TWIN_TOL = 5e-6
FP8_NOISE_TOL = 3e-3
BF16_TOL = 1e-4

G, H, FFN = 4, 256, 128


def _mlp(activation="swiglu", pad_to=None, pow2=False, seed=0, cls=GroupedFP8MLP, **kw):
    torch.manual_seed(seed)
    if cls is GroupedFP8MLP:
        kw.update(pad_to=pad_to, backend="reference", pow2_scales=pow2)
    return cls(G, H, FFN, activation, **kw)


def _inputs(sizes, gen, probs=True):
    t = int(sum(sizes))
    x = torch.randn(t, H, generator=gen).bfloat16().requires_grad_()
    p = torch.rand(t, generator=gen).requires_grad_() if probs else None
    return x, torch.as_tensor(sizes, dtype=torch.int64), p


def _run(module, x, sizes, p, dy):
    """Forward + backward on fresh leaves; returns (out, dx, dprobs, [fc1 grads], [fc2 grads])."""
    x = x.detach().clone().requires_grad_()
    p = None if p is None else p.detach().clone().requires_grad_()
    for w in module.parameters():
        w.grad = None
    out, bias = module(x, sizes, p)
    assert bias is None
    out.backward(dy)
    return (out.detach(), x.grad, None if p is None else p.grad,
            module.linear_fc1.expert_grads(), module.linear_fc2.expert_grads())


# ----------------------------------------------------------------------------------------------------------------
# float64 references
# ----------------------------------------------------------------------------------------------------------------


def _bf16(t):
    return t.to(torch.bfloat16).to(torch.float64)


class _TwinLinear(torch.autograd.Function):
    """float64 grouped linear on the dequantized operands the FP8 path uses, BF16 roundings where it has them."""

    @staticmethod
    def forward(ctx, x, sizes, pow2, *ws):
        xb = x.to(torch.bfloat16)
        xd = R.dequantize_1x128(*R.quantize_1x128(xb, pow2), torch.float64)
        wd = [R.dequantize_128x128(*R.quantize_128x128(w.to(torch.bfloat16), pow2)[:2], torch.float64) for w in ws]
        ctx.sizes, ctx.pow2, ctx.wd = sizes, pow2, wd
        ctx.save_for_backward(xb)
        return _bf16(torch.cat([xd[r] @ wd[g].t() for g, r in _rows(sizes)]))

    @staticmethod
    def backward(ctx, dy):
        (xb,) = ctx.saved_tensors
        sizes, pow2, wd = ctx.sizes, ctx.pow2, ctx.wd
        dyb = dy.to(torch.bfloat16)
        dyd = R.dequantize_1x128(*R.quantize_1x128(dyb, pow2), torch.float64)
        dx = _bf16(torch.cat([dyd[r] @ wd[g] for g, r in _rows(sizes)]))
        st = torch.tensor(sizes)
        dy_col = R.dequantize_grouped_128x1(*R.quantize_grouped_128x1(dyb, st, pow2), st, torch.float64)
        x_col = R.dequantize_grouped_128x1(*R.quantize_grouped_128x1(xb, st, pow2), st, torch.float64)
        dws = [_bf16(dy_col[r].t() @ x_col[r]) for _, r in _rows(sizes)]
        return (dx, None, None, *dws)


def _rows(sizes):
    start = 0
    for g, s in enumerate(sizes):
        yield g, slice(start, start + s)
        start += s


def _float64_mlp(module, x, sizes, p, dy, quantized, pow2=False):
    """float64 autograd of the layer: the quantization-aware twin (quantized=True) or the plain math."""
    sizes = [int(s) for s in sizes]
    x = x.detach().double().requires_grad_()
    p = None if p is None else p.detach().double().requires_grad_()
    w1 = [w.detach().double().requires_grad_() for w in module.linear_fc1.expert_weights()]
    w2 = [w.detach().double().requires_grad_() for w in module.linear_fc2.expert_weights()]

    def linear(a, ws):
        if quantized:
            return _TwinLinear.apply(a, sizes, pow2, *ws)
        return torch.cat([a[r] @ ws[g].t() for g, r in _rows(sizes)])

    z = act64(linear(x, w1), module.activation)
    if p is not None:
        z = z * p.unsqueeze(1)
    out = linear(z, w2)
    out.backward(dy.double())
    return out.detach(), x.grad, None if p is None else p.grad, [w.grad for w in w1], [w.grad for w in w2]


def _diffs(ours, ref):
    """docs/design.md §3 diff per result; weight grads of empty groups are exactly zero in both (checked, skipped)."""
    names = ("out", "dx", "dprobs")
    out = {n: T.diff(a, b) for n, a, b in zip(names, ours[:3], ref[:3]) if a is not None}
    for fc, gs, rs in (("fc1", ours[3], ref[3]), ("fc2", ours[4], ref[4])):
        for i, (a, b) in enumerate(zip(gs, rs)):
            if b.abs().sum() == 0:
                assert a.abs().sum() == 0, f"{fc}.weight{i} of an empty group has a non-zero gradient"
            else:
                out[f"{fc}.weight{i}"] = T.diff(a, b)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Accuracy
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation,pow2", [("swiglu", False), ("swiglu", True), ("gelu", False),
                                             ("squared_relu", False)])
def test_matches_quantization_aware_float64_twin(gen, activation, pow2):
    module = _mlp(activation, pow2=pow2)
    x, sizes, p = _inputs([150, 0, 129, 21], gen)
    dy = torch.randn(x.shape[0], H, generator=gen).bfloat16()
    diffs = _diffs(_run(module, x, sizes, p, dy), _float64_mlp(module, x, sizes, p, dy, quantized=True, pow2=pow2))
    assert len(diffs) == 3 + 2 * 3
    assert all(d < TWIN_TOL for d in diffs.values()), diffs


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_close_to_the_unquantized_layer(gen, activation):
    module = _mlp(activation)
    x, sizes, p = _inputs(make_group_sizes(512, G, "paper", seed=3).tolist(), gen)
    dy = torch.randn(x.shape[0], H, generator=gen).bfloat16()
    diffs = _diffs(_run(module, x, sizes, p, dy), _float64_mlp(module, x, sizes, p, dy, quantized=False))
    assert all(0 < d < FP8_NOISE_TOL for d in diffs.values()), diffs


def test_bf16_baseline_is_the_same_layer(gen):
    """GroupedBF16MLP loads the FP8 module's checkpoint and computes the same layer in BF16."""
    fp8 = _mlp()
    bf16 = _mlp(cls=GroupedBF16MLP, seed=1)
    bf16.load_state_dict(fp8.state_dict())
    x, sizes, p = _inputs([100, 0, 60, 96], gen)
    dy = torch.randn(x.shape[0], H, generator=gen).bfloat16()
    diffs = _diffs(_run(bf16, x, sizes, p, dy), _float64_mlp(fp8, x, sizes, p, dy, quantized=False))
    assert all(d < BF16_TOL for d in diffs.values()), diffs


# ----------------------------------------------------------------------------------------------------------------
# Padded twin == unpadded, bit for bit
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad_to", [16, 128])
@pytest.mark.parametrize("activation,probs", [("swiglu", True), ("gelu", True), ("squared_relu", True),
                                              ("swiglu", False)])
def test_padded_twin_is_bit_exact(one_thread, gen, pad_to, activation, probs):
    ours = _mlp(activation)
    padded = _mlp(activation, pad_to=pad_to, seed=1)
    padded.load_state_dict(ours.state_dict())
    # empty first/last groups, a single row, one short of / exactly / one past a 128-row block
    x, sizes, p = _inputs([0, 1, 127, 129] if pad_to == 128 else [0, 128, 17, 0], gen, probs)
    dy = torch.randn(x.shape[0], H, generator=gen).bfloat16()
    a, b = _run(ours, x, sizes, p, dy), _run(padded, x, sizes, p, dy)
    for name, u, v in zip(("out", "dx", "dprobs"), a[:3], b[:3]):
        assert (u is None and v is None) or torch.equal(u, v), name
    for i, (u, v) in enumerate(zip(a[3] + a[4], b[3] + b[4])):
        assert torch.equal(u, v), f"weight grad {i}"


@pytest.mark.parametrize("dist", ["paper", "skewed", "one_group"])
def test_padded_twin_is_bit_exact_on_distributions(one_thread, gen, dist):
    ours = _mlp()
    padded = _mlp(pad_to=128, seed=1)
    padded.load_state_dict(ours.state_dict())
    x, sizes, p = _inputs(make_group_sizes(400, G, dist, seed=7).tolist(), gen)
    dy = torch.randn(x.shape[0], H, generator=gen).bfloat16()
    a, b = _run(ours, x, sizes, p, dy), _run(padded, x, sizes, p, dy)
    assert all(torch.equal(u, v) for u, v in zip(a[:3] + tuple(a[3] + a[4]), b[:3] + tuple(b[3] + b[4])))


def test_activation_rows_do_not_depend_on_other_rows(one_thread, gen):
    """The probs gradient's row sums follow a fixed order: a row gives the same bits among 3 or 300 rows."""
    h = torch.randn(300, 2 * 272, generator=gen).bfloat16().requires_grad_()
    p = torch.rand(300, generator=gen).requires_grad_()
    dz = torch.randn(300, 272, generator=gen).bfloat16()
    activation_times_probs(h, p, "swiglu").backward(dz)
    h3, p3 = h.detach()[:3].clone().requires_grad_(), p.detach()[:3].clone().requires_grad_()
    activation_times_probs(h3, p3, "swiglu").backward(dz[:3])
    assert torch.equal(p3.grad, p.grad[:3]) and torch.equal(h3.grad, h.grad[:3])
    ref = (dz.double() * act64(h.detach().double(), "swiglu")).sum(1)
    assert torch.allclose(p.grad.double(), ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# The Function: weight layouts, gradient routing, cache
# ----------------------------------------------------------------------------------------------------------------


def _linear_case(gen, m=300, n=256, k=384, g=3):
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(g, n, k, generator=gen) * 0.05).bfloat16()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    return x, w, torch.tensor([120, 0, m - 120]), dy


def _linear_grads(x, weights, groups, dy, **kw):
    x = x.clone().requires_grad_()
    y = fp8_grouped_linear(x, weights, groups, backend="reference", **kw)
    y.backward(dy)
    return y.detach(), x.grad


def test_stacked_separate_and_adjacent_weights_agree(gen):
    x, w, sizes, dy = _linear_case(gen)
    stacked = w.clone().requires_grad_()
    separate = [w[i].clone().requires_grad_() for i in range(3)]  # three storages: stacked by a copy
    adjacent = [torch.nn.Parameter(t) for t in w.clone()]  # slices of one storage: a free view
    assert stacked_view(separate) is None and stacked_view(adjacent) is not None
    y0, dx0 = _linear_grads(x, stacked, sizes, dy)
    for ws in (separate, adjacent):
        y, dx = _linear_grads(x, ws, sizes, dy)
        assert torch.equal(y, y0) and torch.equal(dx, dx0)
        assert all(torch.equal(wi.grad, stacked.grad[i]) for i, wi in enumerate(ws))
        assert all(wi.grad.dtype == torch.bfloat16 for wi in ws)


def test_groups_as_offsets(gen):
    x, w, sizes, dy = _linear_case(gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).int()
    a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
    ya, dxa = _linear_grads(x, a, sizes, dy)
    yb, dxb = _linear_grads(x, b, offsets, dy)
    assert torch.equal(ya, yb) and torch.equal(dxa, dxb) and torch.equal(a.grad, b.grad)
    # The wgrad GEMM is told G (offsets [G+1] alone would read as G+1 sizes): FP32 main_grad accumulated in place,
    # BF16 main_grad through an FP32 temporary, and weight gradients only (dY's columns quantized alone).
    for dtype in (torch.float32, torch.bfloat16):
        mains = []
        for groups in (sizes, offsets):
            weight = w.clone().requires_grad_()
            weight.main_grad = torch.full(w.shape, 0.5, dtype=dtype)
            _linear_grads(x, weight, groups, dy)
            mains.append(weight.main_grad)
        assert torch.equal(*mains)
    frozen_x = []
    for groups in (sizes, offsets):
        weight = w.clone().requires_grad_()
        fp8_grouped_linear(x, weight, groups, backend="reference").backward(dy)
        frozen_x.append(weight.grad)
    assert torch.equal(frozen_x[0], a.grad) and torch.equal(frozen_x[1], a.grad)


def _megatron_ddp_hook(w, i, fired):
    """What Megatron-core's DDP runs on a weight's AccumulateGrad node (`_make_backward_post_hook`), with
    overlap_grad_reduce=True: a gradient must be there; it is added to main_grad unless the layer already did."""

    def hook(*_):
        assert w.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
        if not w.grad_added_to_main_grad:
            w.main_grad.add_(w.grad)
        w.grad = None
        fired.append(i)

    return hook


def test_main_grad_without_megatrons_flag_leaves_grad_none(gen):
    """A `main_grad` outside Megatron's DDP (no grad_added_to_main_grad): accumulated there, `.grad` stays None."""
    x, w, sizes, dy = _linear_case(gen)
    weight = w.clone().requires_grad_()
    weight.main_grad = torch.zeros(w.shape)
    _linear_grads(x, weight, sizes, dy)
    assert weight.grad is None and weight.main_grad.abs().sum() > 0


@pytest.mark.parametrize("layout", ["stacked", "adjacent", "separate"])
def test_main_grad_accumulates_and_grad_stays_none(gen, layout):
    x, w, sizes, dy = _linear_case(gen)
    dy2 = torch.randn(dy.shape, generator=gen).bfloat16()
    if layout == "stacked":
        weights = [w.clone().requires_grad_()]
        buffers = [torch.full(w.shape, 0.5)]
    else:
        weights = [torch.nn.Parameter(t) for t in (w.clone() if layout == "adjacent" else [t.clone() for t in w])]
        big = torch.full(w.shape, 0.5)
        buffers = list(big.unbind(0)) if layout == "adjacent" else [torch.full(w.shape[1:], 0.5) for _ in range(3)]
        assert (stacked_view(buffers) is None) == (layout == "separate")  # in-place GEMM vs temporary + add
    for wi, b in zip(weights, buffers):
        wi.main_grad = b
        wi.grad_added_to_main_grad = False
    fired, grad_accs = [], []  # (DDP keeps the AccumulateGrad nodes alive, or their hooks go with them)
    for i, wi in enumerate(weights):  # Megatron DDP's backward post-hook, as with overlap_grad_reduce=True
        grad_accs.append(wi.expand_as(wi).grad_fn.next_functions[0][0])
        grad_accs[-1].register_hook(_megatron_ddp_hook(wi, i, fired))

    arg = weights[0] if layout == "stacked" else weights
    _linear_grads(x, arg, sizes, dy)
    _linear_grads(x, arg, sizes, dy2)
    assert all(wi.grad is None and wi.grad_added_to_main_grad for wi in weights)
    assert sorted(fired) == sorted(list(range(len(weights))) * 2), "the AccumulateGrad hooks must fire"

    # Expected: 0.5 + dW1 + dW2 with each dW the FP32 K-grouped result (D = C + A.B in FP32, in call order).
    expected = torch.full(w.shape, 0.5)
    for d in (dy, dy2):
        xt, xs = R.quantize_grouped_128x1(x, sizes)
        dt, ds = R.quantize_grouped_128x1(d, sizes)
        expected = R.k_grouped_fp8_gemm(dt, ds, xt, xs, sizes, out=expected, accumulate=True)
    # (the separate layout goes through an FP32 temporary and a foreach add: the same FP32 sums)
    assert torch.equal(buffers[0] if layout == "stacked" else torch.stack(buffers), expected)


def test_main_grad_validation(gen):
    x, w, sizes, dy = _linear_case(gen)
    weights = [torch.nn.Parameter(t) for t in w.clone()]
    weights[0].main_grad = torch.zeros(w.shape[1:])
    with pytest.raises(ValueError, match="every weight .* main_grad .* or none"):
        _linear_grads(x, weights, sizes, dy)
    for wi in weights:
        wi.main_grad = torch.zeros(w.shape[1:], dtype=torch.float16)
    with pytest.raises(TypeError, match="main_grad of weight 0 must have dtype float32 or bfloat16"):
        _linear_grads(x, weights, sizes, dy)
    for wi in weights:
        wi.main_grad = torch.zeros(w.shape[2:])
    with pytest.raises(ValueError, match=r"main_grad of weight 0 must have the weight's shape \(256, 384\)"):
        _linear_grads(x, weights, sizes, dy)


def test_bf16_main_grad(gen):
    """Megatron without grad_reduce_in_fp32 keeps BF16 main_grads: the FP32 gradient is added with one rounding."""
    x, w, sizes, dy = _linear_case(gen)
    weights = [torch.nn.Parameter(t) for t in w.clone()]
    start = torch.randn(w.shape, generator=gen).bfloat16()
    for wi, b in zip(weights, start.clone().unbind(0)):
        wi.main_grad = b
    _linear_grads(x, weights, sizes, dy)
    xt, xs = R.quantize_grouped_128x1(x, sizes)
    dt, ds = R.quantize_grouped_128x1(dy, sizes)
    expected = (start.float() + R.k_grouped_fp8_gemm(dt, ds, xt, xs, sizes)).bfloat16()
    assert torch.equal(torch.stack([wi.main_grad for wi in weights]), expected)
    assert all(wi.grad is None for wi in weights)


def test_no_wgrad_operands_without_weight_grads(gen, monkeypatch):
    """X^T is quantized (and saved) only when a weight needs a gradient, and then in the same pass as the X rows;
    the W^T copy only feeds dgrad; a backward that needs both gradients quantizes dY once, in the fused pass."""
    calls = []
    for name in ("run_1x128", "run_grouped_128x1", "run_1x128_and_grouped_128x1"):  # what the Function runs
        real = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    x, w, sizes, dy = _linear_case(gen)
    with torch.no_grad():
        fp8_grouped_linear(x, w.clone().requires_grad_(), sizes, backend="reference")
    assert calls == ["run_1x128"]  # inference: X rows only
    calls.clear()
    y, dx = _linear_grads(x, w, sizes, dy)  # frozen weights: dgrad only
    assert calls == ["run_1x128", "run_1x128"] and dx is not None  # X rows, dY rows
    calls.clear()
    _linear_grads(x, w.clone().requires_grad_(), sizes, dy)
    # forward: X rows and X^T columns from one pass; backward: dY rows and columns from one pass
    assert calls == ["run_1x128_and_grouped_128x1", "run_1x128_and_grouped_128x1"]


def test_backward_frees_dy_columns_before_dgrad_allocates(gen, monkeypatch):
    """Backward runs the weight gradient first and drops dY's token columns before the dgrad GEMM allocates dX: the
    backward's peak holds one of them, not both (same bits in either order: the GEMMs are independent)."""
    import weakref

    from megatron_tma import autograd, gemm

    columns, order = [], []
    real_quant, real_m, real_k = quant.run_1x128_and_grouped_128x1, gemm.run_m_grouped, gemm.run_k_grouped

    def both(*a, **k):
        out = real_quant(*a, **k)
        columns.append(weakref.ref(out[2]))
        return out

    def m_grouped(*a, **k):
        if len(columns) == 2:  # backward's dgrad: dY's columns (the second quantizer call's) must be gone
            order.append(("dgrad", columns[1]() is None))
        return real_m(*a, **k)

    monkeypatch.setattr(quant, "run_1x128_and_grouped_128x1", both)
    monkeypatch.setattr(autograd.gemm, "run_m_grouped", m_grouped)
    monkeypatch.setattr(autograd.gemm, "run_k_grouped", lambda *a, **k: order.append(("wgrad",)) or real_k(*a, **k))
    x, w, sizes, dy = _linear_case(gen)

    def grads():
        weight = w.clone().requires_grad_()
        return _linear_grads(x, weight, sizes, dy) + (weight.grad,)

    patched = grads()
    assert order == [("wgrad",), ("dgrad", True)]
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(patched, grads()))  # (the patches only watch)


def test_an_output_gradient_at_any_offset_is_taken(gen, quantizer_preconditions):
    """The quantizers read 16-byte vectors; a dY view that starts off that boundary is copied, not refused (before
    the Function ran its quantizers on the operands it made, the public quantizer's rule refused it). The fixture
    holds the quantizer calls to what the GPU ops accept."""
    x, w, sizes, dy = _linear_case(gen)
    odd = torch.empty(dy.numel() + 1, dtype=dy.dtype)[1:].view_as(dy)
    odd.copy_(dy)
    assert odd.data_ptr() % 16 != 0
    w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
    y1, dx1 = _linear_grads(x, w1, sizes, dy)
    y2, dx2 = _linear_grads(x, w2, sizes, odd)
    assert torch.equal(dx1, dx2) and torch.equal(w1.grad, w2.grad)
    assert len(quantizer_preconditions) == 4  # X forward, dY backward, twice


def test_a_misaligned_input_is_refused_at_the_entry(gen, quantizer_preconditions):
    """The entry check refuses what the quantizers could not read, before any backend is chosen (so the same error
    on every backend)."""
    x, w, sizes, _ = _linear_case(gen)
    odd = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view_as(x)
    odd.copy_(x)
    with pytest.raises(ValueError, match=r"x must start 16-byte aligned \(the quantizers read rows as 16-byte"):
        fp8_grouped_linear(odd, w, sizes, backend="reference")
    assert quantizer_preconditions == []


def test_main_grad_on_another_device_is_refused(gen):
    x, w, sizes, dy = _linear_case(gen)
    w = w.clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape, device="meta")
    y = fp8_grouped_linear(x.requires_grad_(), w, sizes, backend="reference")
    with pytest.raises(ValueError, match="main_grad of weight 0 must be on cpu, got meta"):
        y.backward(dy)


@pytest.mark.parametrize("weight_layout", ["stacked", "per_expert"])
def test_weight_cache_follows_versions(gen, monkeypatch, weight_layout):
    calls = []
    real = quant.quantize_128x128
    monkeypatch.setattr(quant, "quantize_128x128", lambda *a, **k: calls.append(1) or real(*a, **k))
    module = _mlp(weight_layout=weight_layout)
    x, sizes, p = _inputs([50, 30, 0, 20], gen)
    y1, _ = module(x, sizes, p)
    y2, _ = module(x, sizes, p)
    assert len(calls) == 2 and torch.equal(y1, y2)  # fc1 and fc2 once each, then hits
    with torch.no_grad():
        module.linear_fc2.expert_weights()[1].mul_(2.0)  # an optimizer-style in-place update bumps the version
    y3, _ = module(x, sizes, p)
    assert len(calls) == 3  # only fc2 re-quantized
    fresh = _mlp(seed=5, weight_layout=weight_layout)
    fresh.load_state_dict(module.state_dict())
    assert torch.equal(y3, fresh(x, sizes, p)[0]) and not torch.equal(y3, y1)

    calls.clear()
    module.linear_fc2.expert_weights()[1].data.mul_(0.5)  # invisible to the version counter: a stale hit ...
    assert len(calls) == 0 and torch.equal(module(x, sizes, p)[0], y3)
    for lin in module.modules():  # ... until Megatron's per-step flag (set_is_first_microbatch) re-quantizes
        if hasattr(lin, "is_first_microbatch"):
            lin.is_first_microbatch = True
    y4, _ = module(x, sizes, p)
    assert len(calls) == 2 and torch.equal(y4, y1)
    module.invalidate_weight_cache()
    module(x, sizes, p)
    assert len(calls) == 4


def test_weight_cache_pins_replaced_weights(gen):
    """A weight replaced by a new tensor must miss, even if the allocator could reuse its address."""
    cache = FP8WeightCache()
    w = (torch.randn(2, 128, 128, generator=gen) * 0.1).bfloat16()
    first = cache.get([w])
    w2 = w.clone().mul_(2)
    assert cache.get([w]) is first
    second = cache.get([w2])
    assert second is not first and torch.equal(second.s, first.s * 2)
    assert cache.get([w2], pow2=True) is not second  # the scale mode is part of the key



def test_weight_cache_pins_the_weights_memory(gen):
    """What the cache keeps alive so that no new tensor can take a cached weight's address: one alias of the
    weights' storage when they lie back to back (a stacked view), every weight when they must be copied."""
    storage = (torch.randn(3, 128, 128, generator=gen) * 0.1).bfloat16()
    adjacent = list(storage.unbind(0))
    cache = FP8WeightCache()
    cache.get(adjacent)
    assert len(cache._aliases) == 1
    assert cache._aliases[0].untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    scattered = [(torch.randn(128, 128, generator=gen) * 0.1).bfloat16() for _ in range(3)]
    cache.get(scattered)
    assert [a.data_ptr() for a in cache._aliases] == [w.data_ptr() for w in scattered]


# ----------------------------------------------------------------------------------------------------------------
# Edge cases, validation, torch.compile
# ----------------------------------------------------------------------------------------------------------------


def test_no_tokens(gen):
    module = _mlp()
    padded = _mlp(pad_to=16)
    for m in (module, padded):
        out = _run(m, *_inputs([0, 0, 0, 0], gen), torch.zeros(0, H, dtype=torch.bfloat16))
        assert out[0].shape == (0, H) and out[1].shape == (0, H) and out[2].shape == (0,)
        assert all(g is not None and g.abs().sum() == 0 for g in out[3] + out[4])


X = torch.zeros(8, H, dtype=torch.bfloat16)
SIZES = torch.tensor([2, 2, 0, 4])
S2 = torch.tensor([3, 5])  # for G = 2


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((X.float(), SIZES), TypeError, "hidden_states must have dtype bfloat16"),
        ((X[:, :128].contiguous(), SIZES), ValueError, r"hidden_states must be \[T, 256\]"),
        ((X, [2, 2, 0, 4]), TypeError, "tokens_per_expert must be a device int tensor"),
        ((X, SIZES.float()), TypeError, "int32 or int64"),
        ((X, SIZES[:3]), ValueError, "num_experts=4 sizes, got 3"),
        ((X, torch.tensor([2, 2, 0, 3])), ValueError, "sum to 7, but the data has M_total=8"),
        ((X, torch.tensor([2, 2, -1, 5])), ValueError, "negative"),
        ((X, SIZES, torch.rand(7)), ValueError, r"permuted_probs must be \[T\] = \[8\]"),
        ((X, SIZES, torch.rand(8).double()), TypeError, "permuted_probs must have dtype float32 or bfloat16"),
    ],
)
@pytest.mark.parametrize("pad_to", [None, 128])
def test_module_validation(args, exc, match, pad_to):
    with pytest.raises(exc, match=match):
        _mlp(pad_to=pad_to)(*args)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda w: fp8_grouped_linear(X, w, S2, backend="tpu"), ValueError, "backend must be"),
        (lambda w: fp8_grouped_linear(X, w.float(), S2), TypeError, "weight must have dtype bfloat16"),
        (lambda w: fp8_grouped_linear(X.half(), w, S2), TypeError, "x must have dtype bfloat16"),
        (lambda w: fp8_grouped_linear(X.t(), w, S2), ValueError, "x must be contiguous"),
        (lambda w: fp8_grouped_linear(X, [], S2), ValueError, "non-empty sequence"),
        (lambda w: fp8_grouped_linear(X, [w[0], w[1, :128].contiguous()], S2), ValueError, "one shape"),
        (lambda w: fp8_grouped_linear(X[:, :128].contiguous(), w, S2), ValueError, "K differs"),
        (lambda w: fp8_grouped_linear(X, w[:, :144].contiguous(), S2), ValueError, "multiples of 128 .* N=144"),
        (lambda w: fp8_grouped_linear(X, w, SIZES), ValueError, "G sizes or G\\+1 offsets"),
        (lambda w: fp8_grouped_linear(X, w, S2 - 1), ValueError, "sum to 6, but the data has M_total=8"),
        (lambda w: fp8_grouped_linear(X, w, S2.float()), TypeError, "int32 or int64"),
        (lambda w: fp8_grouped_linear(X, w, S2, pow2_scales=1), TypeError, "pow2_scales must be a bool"),
        (lambda w: fp8_grouped_linear(X, w, S2, backend="cuda"), ValueError, "needs CUDA tensors"),
    ],
)
def test_function_validation(call, exc, match):
    with pytest.raises(exc, match=match):
        call(torch.zeros(2, 256, H, dtype=torch.bfloat16))


def test_module_constructor_validation():
    with pytest.raises(ValueError, match="activation must be one of"):
        GroupedFP8MLP(2, 128, 128, "relu")
    with pytest.raises(ValueError, match="pad_to must be None, 16 or 128"):
        GroupedFP8MLP(2, 128, 128, pad_to=64)
    with pytest.raises(ValueError, match="backend must be"):
        GroupedFP8MLP(2, 128, 128, backend="triton")
    with pytest.raises(ValueError, match="multiples of 128 .* got 128 and 200"):
        GroupedFP8MLP(2, 128, 200)
    for cls in (GroupedFP8MLP, GroupedBF16MLP):
        with pytest.raises(ValueError, match="weight_layout must be 'stacked' or 'per_expert', got 'flat'"):
            cls(2, 128, 128, weight_layout="flat")


def test_parameter_names_and_shapes():
    stacked, per_expert = _mlp(), _mlp(weight_layout="per_expert")
    shapes = {n: tuple(p.shape) for n, p in stacked.named_parameters()}
    assert shapes == {"linear_fc1.weight": (G, 2 * FFN, H), "linear_fc2.weight": (G, H, FFN)}
    shapes = {n: tuple(p.shape) for n, p in per_expert.named_parameters()}
    assert shapes == {**{f"linear_fc1.weight{i}": (2 * FFN, H) for i in range(G)},
                      **{f"linear_fc2.weight{i}": (H, FFN) for i in range(G)}}
    assert stacked_view(per_expert.linear_fc1.weights) is not None  # one storage: the FP8 path stacks for free
    assert _mlp("gelu", weight_layout="per_expert").linear_fc1.weight0.shape == (FFN, H)
    assert _mlp("gelu").linear_fc1.weight.shape == (G, FFN, H)
    assert "weight_layout='per_expert'" in repr(per_expert)
    # one seed, one set of weights: both layouts initialize expert by expert
    for a, b in zip(stacked.parameters(), [torch.stack(per_expert.linear_fc1.weights),
                                           torch.stack(per_expert.linear_fc2.weights)]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [GroupedFP8MLP, GroupedBF16MLP])
def test_state_dicts_are_per_expert_in_both_layouts(gen, cls):
    """Both layouts save and load Transformer Engine's keys (`weight{i}` [N, K]), so a checkpoint of either loads
    into the other (also through torch.save), and both modules then compute the same thing."""
    stacked, per_expert = _mlp(seed=1, cls=cls), _mlp(seed=2, cls=cls, weight_layout="per_expert")
    te_keys = {f"linear_fc1.weight{i}": (2 * FFN, H) for i in range(G)}
    te_keys.update({f"linear_fc2.weight{i}": (H, FFN) for i in range(G)})
    for module in (stacked, per_expert):
        assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == te_keys
    buf = io.BytesIO()
    torch.save(stacked.state_dict(), buf)
    buf.seek(0)
    per_expert.load_state_dict(torch.load(buf))
    for lin_s, lin_p in ((stacked.linear_fc1, per_expert.linear_fc1), (stacked.linear_fc2, per_expert.linear_fc2)):
        assert all(torch.equal(a, b) for a, b in zip(lin_s.expert_weights(), lin_p.expert_weights()))
    with torch.no_grad():
        per_expert.linear_fc2.weight3.mul_(3.0)
    stacked.load_state_dict(per_expert.state_dict())
    assert torch.equal(stacked.linear_fc2.weight[3], per_expert.linear_fc2.weight3)
    x, sizes, p = _inputs([50, 0, 70, 36], gen)
    assert torch.equal(stacked(x, sizes, p)[0], per_expert(x, sizes, p)[0])


def test_stacked_layout_load_errors():
    """A stacked module reports a checkpoint's missing, unexpected and mis-shaped expert weights as nn.Module does,
    and loads a linear all or nothing."""
    module, good = _mlp(seed=1), _mlp(seed=2).state_dict()
    before = module.linear_fc1.weight.detach().clone()
    partial = {k: v for k, v in good.items() if k != "linear_fc1.weight2"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "linear_fc1\.weight2"'):
        module.load_state_dict(partial)
    result = module.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["linear_fc1.weight2"] and not result.unexpected_keys
    assert torch.equal(module.linear_fc1.weight, before)  # fc1 untouched ...
    assert torch.equal(module.linear_fc2.weight[1], good["linear_fc2.weight1"])  # ... fc2 loaded
    extra = dict(good, **{f"linear_fc1.weight{G}": good["linear_fc1.weight0"], "linear_fc2.weight": before,
                          "linear_fc2.w.x": before})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "linear_fc1\.weight4", '
                                           r'"linear_fc2\.weight", "linear_fc2\.w\.x"'):
        module.load_state_dict(extra)
    per_expert = _mlp(seed=3, weight_layout="per_expert")  # the same report from nn.Module itself
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "linear_fc1\.weight4", '
                                           r'"linear_fc2\.weight", "linear_fc2\.w\.x"'):
        per_expert.load_state_dict(extra)
    bad = dict(good, **{"linear_fc2.weight1": torch.zeros(H, FFN + 1)})
    with pytest.raises(RuntimeError, match=r"size mismatch for linear_fc2\.weight1: copying a param with shape "
                                           r"torch\.Size\(\[256, 129\]\) from checkpoint, the shape in current "
                                           r"model is torch\.Size\(\[256, 128\]\)"):
        module.load_state_dict(bad)


@pytest.mark.parametrize("weight_layout", ["stacked", "per_expert"])
def test_load_pre_hooks_see_per_expert_keys(weight_layout):
    """A load_state_dict pre-hook (e.g. one that migrates old key names) runs in both layouts and sees the
    per-expert keys."""
    module, source = _mlp(seed=1, weight_layout=weight_layout), _mlp(seed=2)
    old_names = {k.replace(".weight", ".expert_w"): v for k, v in source.state_dict().items()}
    seen = []

    def migrate(mod, state_dict, prefix, *_):
        seen.append(prefix)
        for i in range(mod.num_groups):
            if f"{prefix}expert_w{i}" in state_dict:
                state_dict[f"{prefix}weight{i}"] = state_dict.pop(f"{prefix}expert_w{i}")

    for lin in (module.linear_fc1, module.linear_fc2):
        lin.register_load_state_dict_pre_hook(migrate)
    module.load_state_dict(old_names)
    assert seen == ["linear_fc1.", "linear_fc2."]
    for lin_m, lin_s in ((module.linear_fc1, source.linear_fc1), (module.linear_fc2, source.linear_fc2)):
        assert all(torch.equal(a, b) for a, b in zip(lin_m.expert_weights(), lin_s.expert_weights()))


def _accumulate_grad_leaves(out):
    """The leaves the autograd engine will visit (its AccumulateGrad nodes) in the graph behind `out`."""
    seen, stack, leaves = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":
            leaves.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


@pytest.mark.parametrize("g", [4, 16])
def test_stacked_layout_has_one_autograd_leaf_per_linear(gen, g):
    """Why the stacked layout is the default: the engine visits one AccumulateGrad node per linear, not one per
    expert (each costs host time every step; `lab/probe_step_host_cpu.py` measures it)."""
    x = torch.randn(64 * g, H, generator=gen).bfloat16().requires_grad_()
    sizes = torch.full((g,), 64, dtype=torch.int64)
    for layout, weights_per_linear in (("stacked", 1), ("per_expert", g)):
        torch.manual_seed(0)
        module = GroupedFP8MLP(g, H, FFN, backend="reference", weight_layout=layout)
        out, _ = module(x, sizes)
        params = {id(p) for p in module.parameters()}
        leaves = [v for v in _accumulate_grad_leaves(out) if id(v) in params]
        assert len(leaves) == 2 * weights_per_linear == len(params)


def test_weight_layouts_give_the_same_gradients(one_thread, gen):
    """One [G, N, K] parameter or G [N, K] ones: the same Function on the same bytes, the same bits."""
    stacked, per_expert = _mlp(), _mlp(weight_layout="per_expert")
    x, sizes, p = _inputs([90, 0, 129, 37], gen)
    dy = torch.randn(x.shape[0], H, generator=gen).bfloat16()
    a, b = _run(stacked, x, sizes, p, dy), _run(per_expert, x, sizes, p, dy)
    assert all(torch.equal(u, v) for u, v in zip(a[:3], b[:3]))
    for ga, gb in zip(a[3:], b[3:]):
        assert len(ga) == len(gb) == G and all(torch.equal(u, v) for u, v in zip(ga, gb))


def test_torch_compile_forward(gen):
    """torch.compile (graph breaks allowed) runs the module's forward and gives the eager bits."""
    import torch._dynamo

    module = _mlp()
    x, sizes, p = _inputs([40, 0, 60, 28], gen)
    eager, _ = module(x, sizes, p)
    torch._dynamo.reset()
    compiled, _ = torch.compile(module, fullgraph=False, backend="aot_eager")(x, sizes, p)
    assert torch.equal(compiled, eager)
