"""The expert layer (`GroupedFP8MLP`) forward + backward under `torch.compile(fullgraph=True)` gives the eager bits:
the output, the input's and the probs' gradients and every weight gradient, `torch.equal`.

What makes it traceable as one graph: every quantizer, GEMM, activation and combine is a `torch.library` op with a
fake kernel (megatron_tma.ops), called from autograd Functions that torch.compile traces through; nothing on the path
reads a tensor on the host (the group sizes' value checks and the weight cache stay out of traced code). The CPU
variant runs the ops' reference kernels inside inductor's default backend (gcc compiles the rest of the graph); the
CUDA variant (skipped without a Hopper GPU and the built extension) runs the CUDA kernels. The second call gives the
graph other group sizes (an empty group each time): they are tensor values, so the graph does not bake them in."""
import pytest
import torch

from megatron_tma import _ext
from megatron_tma.mlp import GroupedFP8MLP
from megatron_tma.permutation import permutation_from_routing_map

G, H, F, T, TOPK = 4, 128, 128, 48, 2

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not _ext.cuda_kernels_available(),
                                                  reason="needs an sm_90 GPU and the built extension")),
]


def _batch(variant, seed, device):
    """(x, tokens per expert, probs, permutation or None, output gradient), expert 1 with no rows."""
    gen = torch.Generator().manual_seed(seed)
    if variant == "permutation":  # routed tokens in their own order, top-2 routing that never picks expert 1
        scores = torch.rand(T, G, generator=gen)
        scores[:, 1] = -1
        routing_map = torch.zeros(T, G, dtype=torch.bool).scatter_(1, scores.topk(TOPK, dim=1).indices, True)
        permutation, sizes, probs = permutation_from_routing_map(routing_map, TOPK, torch.rand(T, G, generator=gen))
        permutation = type(permutation)(*(t.to(device) for t in permutation))
        rows = T
    else:
        sizes = torch.tensor([40, 0, 60, 28] if seed == 0 else [7, 0, 120, 1])
        permutation, rows = None, int(sizes.sum())
        probs = torch.rand(rows, generator=gen)
    x = torch.randn(rows, H, generator=gen).bfloat16()
    dy = torch.randn(rows, H, generator=gen).bfloat16()
    return x.to(device), sizes.to(device), probs.to(device), permutation, dy.to(device)


def _step(layer, module, batch):
    """Forward + backward on fresh leaves: [out, dx, dprobs, *weight grads]."""
    x, sizes, probs, permutation, dy = batch
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    for w in module.parameters():
        w.grad = None
    out, _ = layer(x, sizes, probs, permutation)
    out.backward(dy)
    return [out, x.grad, probs.grad] + [w.grad.clone() for w in module.parameters()]


@pytest.mark.parametrize("variant", ["plain", "permutation", "recompute_activation"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_expert_layer_gives_the_eager_bits(device, variant):
    torch.manual_seed(0)
    module = GroupedFP8MLP(G, H, F, "swiglu", recompute_activation=variant == "recompute_activation", device=device)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)  # a graph break would raise
    for seed in (0, 1):
        batch = _batch(variant, seed, device)
        eager = _step(module, module, batch)
        got = _step(compiled, module, batch)
        names = ["out", "dx", "dprobs", "fc1 dW", "fc2 dW"]
        assert all(t.abs().sum() > 0 for t in eager)  # (a layer whose results are all zeros would prove nothing)
        for name, e, c in zip(names, eager, got, strict=True):
            assert torch.equal(c, e), f"{variant}, call {seed}: the compiled {name} differs from the eager one"
