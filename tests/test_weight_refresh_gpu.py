"""StepRefreshedWeights in CUDA graphs (issue 53 item 2): a graph of the layer's forward + backward re-quantizes its
weights on the device only when an optimizer step has come since, so micro-batches 2..N replay without the weight
pass, and every replay gives the bits of an eager layer (the default FP8WeightCache) -- with new group sizes, empty
experts and all tokens on one expert; a write the counter cannot see stays invisible until `invalidate_weight_cache()`
(which proves the replays skip); and a graph that also holds an optimizer step trains as the eager loop does.
Skipped without a Hopper GPU + extension."""
import pytest
import torch

from megatron_tma import _ext
from megatron_tma.groups import make_group_sizes
from megatron_tma.mlp import GroupedFP8MLP
from megatron_tma.weight_refresh import StepRefreshedWeights, optimizer_step_counter

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")

DEV = "cuda"
G, H, F, T = 8, 512, 256, 2048


def _pair(**kw):
    torch.manual_seed(0)
    eager = GroupedFP8MLP(G, H, F, device=DEV, **kw)
    graphed = GroupedFP8MLP(G, H, F, device=DEV, step_refreshed_weights=True, **kw)
    graphed.load_state_dict(eager.state_dict())
    return eager, graphed


class _Static:
    """The graph's inputs: filled in place before each replay."""

    def __init__(self):
        self.x = torch.zeros(T, H, dtype=torch.bfloat16, device=DEV, requires_grad=True)
        self.probs = torch.zeros(T, device=DEV, requires_grad=True)
        self.dy = torch.zeros(T, H, dtype=torch.bfloat16, device=DEV)
        self.sizes = make_group_sizes(T, G, "balanced").to(DEV)

    def fill(self, seed, dist):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        with torch.no_grad():
            self.x.copy_(torch.randn(T, H, generator=gen, device=DEV))
            self.probs.copy_(torch.rand(T, generator=gen, device=DEV))
            self.dy.copy_(torch.randn(T, H, generator=gen, device=DEV))
            self.sizes.copy_(make_group_sizes(T, G, dist, seed=seed))


def _eager_step(module, inputs, optimizer=None):
    """One forward + backward on fresh leaves (and the optimizer step): [out, dx, dprobs, weight grads...]."""
    x = inputs.x.detach().clone().requires_grad_()
    probs = inputs.probs.detach().clone().requires_grad_()
    if optimizer is None:
        module.zero_grad(set_to_none=True)
    out, _ = module(x, inputs.sizes.clone(), probs)
    out.backward(inputs.dy)
    if optimizer is not None:
        optimizer.step()
    return [out.detach(), x.grad, probs.grad] + [w.grad for w in module.parameters()]


def _capture(fn, warmups=1):
    """fn run eagerly `warmups` times on a side stream (the layer's FP8 buffers are made there), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _assert_equal(got, want, what):
    for i, (u, v) in enumerate(zip(got, want)):
        assert torch.equal(u, v), (what, i)


@pytest.mark.parametrize("keep_transposed", [True, False])
def test_replays_refresh_only_after_a_step(keep_transposed):
    eager, graphed = _pair(keep_transposed_weight=keep_transposed)
    assert isinstance(graphed.linear_fc1.weight_cache, StepRefreshedWeights)
    inputs = _Static()
    inputs.fill(1, "paper")

    def step():
        inputs.x.grad = inputs.probs.grad = None
        graphed.zero_grad(set_to_none=True)
        out, _ = graphed(inputs.x, inputs.sizes, inputs.probs)
        out.backward(inputs.dy)
        return out

    graph, out = _capture(step)
    static = [out, inputs.x.grad, inputs.probs.grad] + [w.grad for w in graphed.parameters()]
    sgd = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, graphed)]
    seed = 10
    for step_index in range(3):  # three optimizer steps of three micro-batches
        for dist in ("skewed", "one_group", "with_empty"):
            seed += 1
            inputs.fill(seed, dist)
            graph.replay()
            _assert_equal(static, _eager_step(eager, inputs), (step_index, dist))
        for opt in sgd:  # both from the last micro-batch's gradients (the graph's own buffers, the eager .grad)
            opt.step()
        _assert_equal(list(graphed.parameters()), list(eager.parameters()), ("params", step_index))

    inputs.fill(98, "paper")  # the replay after the last step re-quantizes
    graph.replay()
    _assert_equal(static, _eager_step(eager, inputs), "after the last step")
    # A write no optimizer step made: the replays keep the FP8 copies they hold (what the eager layer, unchanged,
    # computes), which is what proves they skip the weight pass; after invalidate_weight_cache() they re-quantize.
    with torch.no_grad():
        for w in graphed.parameters():
            w.data.mul_(2.0)
    inputs.fill(99, "paper")
    graph.replay()
    _assert_equal(static, _eager_step(eager, inputs), "stale until invalidated")
    graphed.invalidate_weight_cache()
    with torch.no_grad():
        for w in eager.parameters():
            w.mul_(2.0)
    graph.replay()
    _assert_equal(static, _eager_step(eager, inputs), "invalidated")


def test_a_graph_holding_the_optimizer_step_trains_as_the_eager_loop():
    """fwd + bwd + Adam(capturable) in one graph: the step's counter increment is captured with it, so every replay's
    forward re-quantizes the weights the previous replay's step wrote. Parameters and outputs equal the eager loop's at
    every step."""
    eager, graphed = _pair()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3, capturable=True) for m in (eager, graphed)]
    inputs = _Static()
    data = [(100 + i, ("paper", "skewed", "one_group", "with_empty")[i % 4]) for i in range(7)]
    warmups = 3

    def iteration():
        inputs.x.grad = inputs.probs.grad = None
        graphed.zero_grad(set_to_none=True)
        out, _ = graphed(inputs.x, inputs.sizes, inputs.probs)
        out.backward(inputs.dy)
        opts[1].step()
        return out

    def eager_iteration():
        opts[0].zero_grad(set_to_none=True)
        return _eager_step(eager, inputs, opts[0])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the optimizer's state and the layer's FP8 buffers are made here
        for seed, dist in data[:warmups]:
            inputs.fill(seed, dist)
            iteration()
            eager_iteration()
    torch.cuda.current_stream().wait_stream(side)
    _assert_equal(list(graphed.parameters()), list(eager.parameters()), "after the warm-up")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = iteration()
    # All replays first: no eager optimizer step in between may move the counter (the eager twin's would), so the
    # graph's own captured increment is what makes each replay re-quantize.
    counter = optimizer_step_counter(torch.device(DEV, torch.cuda.current_device()))
    got = []
    for seed, dist in data[warmups:]:
        inputs.fill(seed, dist)
        before = int(counter)
        graph.replay()
        assert int(counter) == before + 1, "the captured optimizer step increments the counter once"
        got.append((out.clone(), [w.detach().clone() for w in graphed.parameters()]))
    for (seed, dist), (out_i, params_i) in zip(data[warmups:], got):
        inputs.fill(seed, dist)
        want = eager_iteration()
        assert torch.equal(out_i, want[0]), (seed, dist)
        _assert_equal(params_i, list(eager.parameters()), (seed, dist))


def test_capturing_before_any_eager_call_is_an_error():
    _, graphed = _pair()
    inputs = _Static()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="run one eager forward"):
        with torch.cuda.graph(graph):
            graphed(inputs.x, inputs.sizes, inputs.probs)
