"""Weight gradients deferred over micro-batches (megatron_tma.wgrad_deferral, `defer_wgrad=True`) on the CPU
(reference backend): the combined operands are a permutation of the micro-batches' bytes (every expert's blocks of
every micro-batch in order, zeros elsewhere), one GEMM over them is the sum of the micro-batches' products, the
deferred layer's input gradients are the undeferred layer's bits and its weight gradients within FP32 rounding of
them, and the deferred unpadded layer equals its deferred padded twin bit for bit."""
import pytest
import torch

from megatron_tma import k_grouped_fp8_gemm, quantize_grouped_128x1
from megatron_tma.gemm import run_k_grouped
from megatron_tma import testing as T
from megatron_tma.groups import Groups, aligned_token_offsets
from megatron_tma.mlp import GroupedFP8MLP
from megatron_tma.wgrad_deferral import PendingWgrad, WgradDeferral, combine_wgrad_operands

G, H, FFN = 4, 256, 128
MICRO_BATCHES = ([0, 1, 127, 129], [300, 0, 5, 128], [64, 64, 0, 0])  # empty groups, partial and whole blocks


def _sources(gen, n=256, k=384):
    out = []
    for sizes in MICRO_BATCHES:
        t = torch.tensor(sizes)
        m = int(t.sum())
        dy = torch.randn(m, n, generator=gen).bfloat16()
        x = torch.randn(m, k, generator=gen).bfloat16()
        dyt, dyt_s = quantize_grouped_128x1(dy, t, backend="reference")
        xt, xt_s = quantize_grouped_128x1(x, t, backend="reference")
        out.append(PendingWgrad(dyt, dyt_s, xt, xt_s, Groups(t, G, False, m)))
    return out


def test_the_combined_operands_are_the_sources_blocks_in_order(gen):
    sources = _sources(gen)
    c = combine_wgrad_operands(list(sources))  # (it empties the list it is given)
    assert c.dyt.shape == (256, sum(p.dyt.shape[1] for p in sources))
    assert c.dyt_s.shape == (sum(p.dyt_s.shape[0] for p in sources), 256)
    start = aligned_token_offsets(c.groups.tensor)
    block_start = start // 128
    for g in range(G):
        cols, rows = [], []
        for p in sources:
            a = aligned_token_offsets(p.groups.tensor)
            b = a // 128
            cols.append(p.xt.view(torch.uint8)[:, a[g]:a[g + 1]])
            rows.append(p.xt_s[b[g]:b[g + 1]])
        assert torch.equal(c.xt.view(torch.uint8)[:, start[g]:start[g + 1]], torch.cat(cols, 1)), g
        assert torch.equal(c.xt_s[block_start[g]:block_start[g + 1]], torch.cat(rows, 0)), g
    assert not c.xt.view(torch.uint8)[:, start[G]:].any() and not c.xt_s[block_start[G]:].any()  # the tails: zero
    assert c.groups.tensor.tolist() == [sum(-(-m[g] // 128) * 128 for m in MICRO_BATCHES) for g in range(G)]


def test_one_gemm_over_them_is_the_sum_of_the_micro_batches(gen):
    sources = _sources(gen)
    c = combine_wgrad_operands(list(sources))  # (it empties the list it is given)
    # (the layer's own call: the public entry also holds the operands' width to the sizes' exact wgrad_pitch, which a
    # combined layout sized on the host, without reading the sizes, exceeds; the kernels need P >= 128 MB only)
    one = run_k_grouped(c.dyt, c.dyt_s, c.xt, c.xt_s, c.groups, backend="reference")
    exact = sum(T.k_grouped_ref64(p.dyt, p.dyt_s, p.xt, p.xt_s, p.groups.tensor) for p in sources)
    assert T.diff(one, exact) < 1e-12
    per_micro_batch = sum(k_grouped_fp8_gemm(p.dyt, p.dyt_s, p.xt, p.xt_s, p.groups.tensor, backend="reference")
                          for p in sources)
    assert T.diff(one, per_micro_batch) < 1e-12 and not torch.equal(one, per_micro_batch)  # another FP32 order


def _mlp(defer, pad_to=None, **kw):
    torch.manual_seed(0)
    return GroupedFP8MLP(G, H, FFN, "swiglu", backend="reference", pad_to=pad_to, defer_wgrad=defer, **kw)


def _micro_batches(module, gen_seed, main_grad):
    """Forward + backward of each micro-batch; (input gradients of each, the weights' gradients after the step)."""
    gen = torch.Generator().manual_seed(gen_seed)
    if main_grad:
        for w in module.parameters():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    input_grads = []
    for sizes in MICRO_BATCHES:
        t = sum(sizes)
        x = torch.randn(t, H, generator=gen).bfloat16().requires_grad_()
        p = torch.rand(t, generator=gen).requires_grad_()
        out, _ = module(x, torch.tensor(sizes), p)
        out.backward(torch.randn(t, H, generator=gen).bfloat16())
        input_grads += [out.detach(), x.grad, p.grad]
    if module.linear_fc1.wgrad_deferral is not None:
        assert all(w.grad is None for w in module.parameters())  # nothing computed before the flush
        if main_grad:
            assert all(not w.main_grad.any() for w in module.parameters())
        assert module.flush_wgrad() == len(MICRO_BATCHES)
        assert module.flush_wgrad() == 0  # nothing left
    weight_grads = [w.main_grad if main_grad else w.grad for w in module.parameters()]
    return input_grads, weight_grads


@pytest.mark.parametrize("main_grad", [True, False])
@pytest.mark.parametrize("kw", [{}, {"recompute_activation": True}, {"weight_layout": "per_expert"}])
def test_deferred_layer_against_the_undeferred_one_and_its_twin(one_thread, main_grad, kw):
    plain_in, plain_w = _micro_batches(_mlp(False, **kw), 5, main_grad)
    deferred_in, deferred_w = _micro_batches(_mlp(True, **kw), 5, main_grad)
    twin_in, twin_w = _micro_batches(_mlp(True, pad_to=16, **kw), 5, main_grad)
    assert all(torch.equal(u, v) for u, v in zip(deferred_in, plain_in))  # dgrad untouched
    assert all(torch.equal(u, v) for u, v in zip(deferred_in, twin_in))
    assert all(torch.equal(u, v) for u, v in zip(deferred_w, twin_w))  # the twin, deferred alike: the same bits
    for u, v in zip(deferred_w, plain_w):  # one FP32 chain instead of a sum per micro-batch
        assert T.diff(u.double(), v.double()) < (1e-10 if main_grad else 1e-5)


def test_flush_rules():
    with pytest.raises(RuntimeError, match="computes its weight gradients in backward"):
        _mlp(False).flush_wgrad()
    assert _mlp(True).flush_wgrad() == 0
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="defer_wgrad must be a bool"):
            GroupedFP8MLP(G, H, FFN, defer_wgrad=bad)
    with pytest.raises(RuntimeError, match="no weight gradient is pending"):
        WgradDeferral().take()


def test_a_deferral_holds_one_linear(gen):
    d = WgradDeferral()
    a, b = _sources(gen)[:2]
    d.add(a, (True,))
    with pytest.raises(ValueError, match="must share N, K, G"):
        d.add(PendingWgrad(b.dyt[:128], b.dyt_s[:, :128], b.xt, b.xt_s, b.groups), (True,))


def test_the_flush_drops_each_micro_batch_once_copied(gen, monkeypatch):
    """The flush's peak: the combined pair and at most the micro-batches not yet copied, each dropped after its
    copy (not every micro-batch's operands beside the combined ones to the end)."""
    import weakref

    sources = _sources(gen)
    alive = [weakref.ref(p.dyt) for p in sources]
    pending, seen = list(sources), []
    del sources
    copy = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_",
                        lambda self, *a: seen.append(sum(r() is not None for r in alive)) or copy(self, *a))
    combine_wgrad_operands(pending)
    assert seen == [3] * 4 + [2] * 4 + [1] * 4 and pending == []
    assert all(r() is None for r in alive)
