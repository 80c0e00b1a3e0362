"""`keep_transposed_weight=False` (issue 54 item 3) on the CPU (reference backend): W^T's FP8 copy made in backward by
transposing W's is what the quantizer writes, bit for bit, so every output and gradient equals the layer that keeps
W^T from the forward (plain, activation recomputed, permuted, padded twin); the cache then holds W's copy only, and
nothing of W^T is saved for backward. The kernels: tests/test_mlp_gpu.py."""
import pytest
import torch

from megatron_tma import quantize_128x128
from megatron_tma.autograd import FP8WeightCache, fp8_grouped_linear, transposed_weights
from megatron_tma.mlp import GroupedFP8Linear, GroupedFP8MLP

G, H, FFN = 4, 256, 128


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(3, 256, 384), (1, 128, 128), (2, 384, 256)])
def test_the_transposed_copy_is_the_quantizers(gen, shape, pow2):
    w = (torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, 1, generator=gen) * 4).bfloat16()
    q, s, qt, st = quantize_128x128(w, pow2, backend="reference")
    qt2, st2 = transposed_weights(q, s)
    assert qt2.is_contiguous() and st2.is_contiguous()
    assert torch.equal(qt2.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(st2, st)


def _step(module, x, sizes, p, dy, permutation=None):
    x = x.detach().clone().requires_grad_()
    p = None if p is None else p.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, _ = module(x, sizes, p, permutation)
    out.backward(dy)
    return (out.detach(), x.grad, None if p is None else p.grad, *module.linear_fc1.expert_grads(),
            *module.linear_fc2.expert_grads())


def _pair(**kw):
    torch.manual_seed(0)
    kept = GroupedFP8MLP(G, H, FFN, "swiglu", backend="reference", **kw)
    transposing = GroupedFP8MLP(G, H, FFN, "swiglu", backend="reference", keep_transposed_weight=False, **kw)
    transposing.load_state_dict(kept.state_dict())
    return kept, transposing


@pytest.mark.parametrize("kw", [{}, {"recompute_activation": True}, {"pad_to": 16}, {"weight_layout": "per_expert"},
                                {"pow2_scales": True}])
def test_same_bits_as_keeping_the_transposed_copy(one_thread, gen, kw):
    kept, transposing = _pair(**kw)
    sizes = [0, 1, 127, 129]  # an empty group, a single row, one short of and one past a 128-row block
    t = sum(sizes)
    x, p = torch.randn(t, H, generator=gen).bfloat16(), torch.rand(t, generator=gen)
    dy = torch.randn(t, H, generator=gen).bfloat16()
    for _ in range(2):  # the second step reads the cached copies
        a, b = _step(kept, x, torch.tensor(sizes), p, dy), _step(transposing, x, torch.tensor(sizes), p, dy)
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"result {i} differs"
    for linear in (transposing.linear_fc1, transposing.linear_fc2):
        value = linear.weight_cache._value
        assert value.q is not None and value.qt is None and value.st is None  # the cache holds W's copy only
    assert kept.linear_fc1.weight_cache._value.qt is not None


def test_same_bits_with_a_permutation(one_thread, gen):
    from megatron_tma.permutation import permutation_from_routing_map

    kept, transposing = _pair()
    tokens, topk = 90, 2
    picks = torch.stack([torch.randperm(G, generator=gen)[:topk] for _ in range(tokens)])
    routing_map = torch.zeros(tokens, G, dtype=torch.bool).scatter_(1, picks, True)
    perm, sizes, _ = permutation_from_routing_map(routing_map, topk)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    p = torch.rand(tokens * topk, generator=gen)
    dy = torch.randn(tokens, H, generator=gen).bfloat16()  # the output is the tokens, each its rows' sum
    a, b = _step(kept, x, sizes, p, dy, perm), _step(transposing, x, sizes, p, dy, perm)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_nothing_of_the_transposed_copy_is_saved(gen):
    """Saved for backward: W's copy (which the cache holds anyway), never a W^T-shaped FP8 tensor."""
    linear = GroupedFP8Linear(G, H, 384, backend="reference", keep_transposed_weight=False)
    x = torch.randn(200, H, generator=gen).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear(x, torch.tensor([50, 50, 0, 100]))
    fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert [tuple(t.shape) for t in fp8 if t.dim() == 3] == [(G, 384, H)]  # q [G, N, K], no qt [G, K, N]
    y.float().sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


def test_the_option_is_a_bool(gen):
    for bad in (0, "no", None):
        with pytest.raises(TypeError, match="keep_transposed_weight must be a bool"):
            GroupedFP8MLP(G, H, FFN, keep_transposed_weight=bad)
        with pytest.raises(TypeError, match="keep_transposed_weight must be a bool"):
            fp8_grouped_linear(torch.zeros(4, H).bfloat16(), torch.zeros(G, 128, H).bfloat16(),
                               torch.tensor([4, 0, 0, 0]), backend="reference", keep_transposed_weight=bad)


def test_a_cache_entry_is_per_setting(gen):
    """A cache asked with the other setting quantizes again rather than hand a copy without W^T to a caller that
    needs it."""
    w = torch.randn(G, 128, H, generator=gen).bfloat16()
    cache = FP8WeightCache()
    assert cache.get((w,), backend="reference", keep_transposed=False).qt is None
    assert cache.get((w,), backend="reference").qt is not None


@pytest.mark.parametrize("planned", [True, False])
def test_the_backward_makes_w_t_after_the_weight_gradient_and_frees_it_with_the_dgrad(gen, monkeypatch, planned):
    """Each linear's backward transposes W's copy just before its dgrad GEMM (after the weight gradient), so the
    made W^T never shares memory with the weight gradient's result, and is freed once the dgrad is done: the order of
    fc2's and fc1's GEMMs and transposes is wgrad, transpose, dgrad, each, and no transposed copy outlives the
    backward. (Fails on a backward that transposes first.)"""
    import weakref

    from megatron_tma import autograd, gemm

    _, transposing = _pair()
    transposing.planned_step = planned
    x = torch.randn(300, H, generator=gen).bfloat16()
    sizes, p = torch.tensor([100, 0, 150, 50]), torch.rand(300, generator=gen)
    dy = torch.randn(300, H, generator=gen).bfloat16()
    events, made = [], []
    real_t, real_k, real_m = autograd.transposed_weights, gemm.run_k_grouped, gemm.run_m_grouped

    def transpose(*a):
        events.append("transpose")
        out = real_t(*a)
        made.extend(weakref.ref(t) for t in out)
        return out

    monkeypatch.setattr(autograd, "transposed_weights", transpose)
    monkeypatch.setattr(gemm, "run_k_grouped", lambda *a, **k: events.append("wgrad") or real_k(*a, **k))
    monkeypatch.setattr(gemm, "run_m_grouped", lambda *a, **k: events.append("m_grouped") or real_m(*a, **k))
    _step(transposing, x, sizes, p, dy)
    backward = events[events.index("wgrad"):]
    assert backward == ["wgrad", "transpose", "m_grouped"] * 2
    assert made and all(r() is None for r in made)
