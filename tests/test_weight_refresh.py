"""StepRefreshedWeights on the CPU (reference kernels): the refresh op writes the quantizer's bytes into the given
buffers unless `done` already equals the step counter; every torch optimizer step moves the counter; eager calls also
see in-place writes through the parameters (versions), `invalidate()` what neither sees; a layer built with
`step_refreshed_weights=True` trains bit for bit like the default one. CUDA graphs: tests/test_weight_refresh_gpu.py."""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_tma import ops
from megatron_tma import reference as R
from megatron_tma.mlp import GroupedFP8MLP
from megatron_tma.weight_refresh import StepRefreshedWeights, optimizer_step_counter

refresh = ops.kernel("quantize_128x128_refresh")


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_quantized(value, w):
    for got, want in zip(value, R.quantize_128x128(w)):
        if got is not None:
            assert torch.equal(_bytes(got), _bytes(want))


def test_the_op_skips_when_done_equals_the_counter(gen):
    w = torch.randn(2, 256, 384, generator=gen).bfloat16()
    q, s, qt, st = (torch.zeros_like(t) for t in R.quantize_128x128(w))
    counter, done = torch.tensor(7), torch.tensor(7)
    refresh(w, False, q, s, qt, st, counter, done)
    assert not s.any() and not q.view(torch.uint8).any()  # nothing written
    done.fill_(-1)
    refresh(w, False, q, s, qt, st, counter, done)
    assert int(done) == 7
    _assert_quantized((q, s, qt, st), w)
    refresh(w, False, q, s, None, None, torch.tensor(8), done)  # W's copy only
    assert int(done) == 8


def test_an_optimizer_step_moves_the_counter():
    counter = optimizer_step_counter(torch.device("cpu"))
    before = int(counter)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    torch.optim.SGD([p], lr=0.1).step()
    assert int(counter) == before + 1


def test_refreshed_after_steps_and_writes(gen):
    w = torch.nn.Parameter(torch.randn(2, 256, 128, generator=gen).bfloat16())
    cache = StepRefreshedWeights()
    first = cache.get((w,))
    buffers = [t.data_ptr() for t in first]
    _assert_quantized(first, w.detach())

    w.grad = torch.randn(w.shape, generator=gen).bfloat16()
    torch.optim.SGD([w], lr=1.0).step()  # a step: refreshed, in the same buffers
    second = cache.get((w,))
    assert [t.data_ptr() for t in second] == buffers
    _assert_quantized(second, w.detach())

    with torch.no_grad():
        w.mul_(0.5)  # in place through the parameter: its version moves, an eager call sees it
    _assert_quantized(cache.get((w,)), w.detach())

    scales = cache.get((w,)).s.clone()
    w.data.mul_(2.0)  # invisible to versions and to the counter: the copies stay, until invalidate()
    assert torch.equal(cache.get((w,)).s, scales)
    cache.invalidate()
    value = cache.get((w,))
    assert torch.equal(value.s, 2 * scales)
    _assert_quantized(value, w.detach())


def test_w_copy_only_and_new_shapes(gen):
    cache = StepRefreshedWeights()
    w = torch.randn(2, 128, 256, generator=gen).bfloat16()
    value = cache.get((w,), keep_transposed=False)
    assert value.qt is None and value.st is None
    _assert_quantized(value, w)
    other = torch.randn(3, 256, 128, generator=gen).bfloat16()  # another shape: new buffers
    _assert_quantized(cache.get((other,)), other)


def test_a_copy_starts_empty(gen):
    cache = StepRefreshedWeights()
    cache.get((torch.randn(1, 128, 128, generator=gen).bfloat16(),))
    assert copy.deepcopy(cache)._buffers is None


@pytest.mark.parametrize("keep_transposed", [True, False])
def test_a_layer_trains_the_same_bits(gen, keep_transposed):
    """Three optimizer steps of two micro-batches each: outputs, input and weight gradients, and the weights, equal
    to the default layer's (FP8WeightCache) at every step."""
    torch.manual_seed(0)
    plain = GroupedFP8MLP(4, 256, 128, backend="reference", keep_transposed_weight=keep_transposed)
    refreshed = GroupedFP8MLP(4, 256, 128, backend="reference", keep_transposed_weight=keep_transposed,
                              step_refreshed_weights=True)
    refreshed.load_state_dict(plain.state_dict())
    assert isinstance(refreshed.linear_fc1.weight_cache, StepRefreshedWeights)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, refreshed)]
    sizes = torch.tensor([40, 0, 70, 18])
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        for micro in range(2):
            x = torch.randn(128, 256, generator=gen).bfloat16()
            p, dy = torch.rand(128, generator=gen), torch.randn(128, 256, generator=gen).bfloat16()
            outs = []
            for m in (plain, refreshed):
                xi = x.clone().requires_grad_()
                out, _ = m(xi, sizes, p)
                out.backward(dy)
                outs.append((out, xi.grad))
            assert all(torch.equal(u, v) for u, v in zip(*outs)), (step, micro)
        for opt in opts:
            opt.step()
        assert all(torch.equal(u, v) for u, v in zip(plain.parameters(), refreshed.parameters())), step


def _refreshed(cache, w):
    """Whether `get` re-quantized: the scales are zeroed first (a skipped refresh leaves them zero)."""
    cache._buffers.s.zero_()
    return bool(cache.get((w,)).s.any())


def test_an_in_place_collective_on_the_weights_is_seen_eagerly(gen, world_of_one):
    """c10d collectives move no version counter and no step counter: the eager check watches the weights' memory as
    FP8WeightCache does (megatron_tma._collective_writes), so the next call re-quantizes."""
    w = torch.nn.Parameter(torch.randn(2, 128, 128, generator=gen).bfloat16())
    cache = StepRefreshedWeights()
    cache.get((w,))
    assert not _refreshed(cache, w)  # nothing changed: the refresh exits
    with torch.no_grad():
        dist.broadcast(w, 0)
    assert w._version == 0  # (the premise: nothing moved the counter)
    assert _refreshed(cache, w)
    assert not _refreshed(cache, w)  # and watched again


def test_weights_made_under_inference_mode_are_refreshed_every_call(gen):
    with torch.inference_mode():
        w = torch.randn(1, 128, 128, generator=gen).bfloat16()  # an inference tensor: no version counter
    cache = StepRefreshedWeights()
    _assert_quantized(cache.get((w,)), w)
    assert _refreshed(cache, w) and _refreshed(cache, w)


def test_weights_that_are_no_stacked_view_warn_once(gen):
    ws = [torch.randn(128, 128, generator=gen).bfloat16() for _ in range(3)]  # three separate storages
    cache = StepRefreshedWeights()
    with pytest.warns(UserWarning, match="do not lie back to back"):
        _assert_quantized(cache.get(ws), torch.stack(ws))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.get(ws)


def test_buffers_a_graph_holds_outlive_a_new_shape(gen):
    cache = StepRefreshedWeights()
    cache.get((torch.randn(1, 128, 128, generator=gen).bfloat16(),))
    old = cache._buffers
    cache._captured = True  # (what a capture of a forward sets)
    cache.get((torch.randn(2, 128, 256, generator=gen).bfloat16(),))
    assert cache._buffers is not old and cache._retired == [old]
