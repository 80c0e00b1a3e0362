"""What the expert MLP keeps from its forward for its backward, byte for byte (docs/megatron.md, "What the layer
holds"): every saved tensor accounted for by the layouts of docs/layouts.md, nothing in BF16 that the backward
re-quantizes, and fewer activation bytes per routed token than the BF16 layer keeps. CPU reference kernels: the
CUDA kernels allocate the same layouts (their fake kernels mirror the bindings: tests/test_quant_api.py)."""
import pytest
import torch

from megatron_tma.groups import wgrad_pitch
from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP

G, H, F = 4, 256, 128


def _cdiv(a, b):
    return -(-a // b)


def _saved(module, sizes):
    """{storage pointer: (bytes, dtype)} of what a forward saves for backward, the parameters left out (they are the
    layer's own, saved by reference)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = (storage.nbytes(), t.dtype)
        return t

    t = int(sum(sizes))
    x = torch.randn(t, H).bfloat16().requires_grad_()
    probs = torch.rand(t).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda v: v):
        out, _ = module(x, torch.tensor(sizes), probs)
    del out
    return seen


def _fp8_layer_bytes(t, g, h, f, recompute=False):
    """The FP8 layer's saved bytes by docs/layouts.md: per routed token, X's FP8 token columns (fc1's wgrad), h in
    BF16 (the activation's backward reads it in FP32), act(h) * probs' FP8 token columns (fc2's wgrad; with the
    activation recomputed, h feeds fc2's backward instead), the probs in FP32; per weight, both linears' W^T copies
    with their 128x128 scales (dgrad; the layer's cache holds them anyway); the group sizes."""
    p, mb = wgrad_pitch(t, g), t // 128 + g  # the token-column operand's pitch and its 128-token blocks
    columns = lambda k: k * p + 4 * mb * k  # noqa: E731  (FP8 [K, P] + FP32 scales [MB, K])
    wt = lambda n, k: g * n * k + 4 * g * _cdiv(n, 128) * _cdiv(k, 128)  # noqa: E731  (W^T [G, K, N] + scales)
    total = columns(h) + 2 * t * 2 * f + 4 * t + wt(2 * f, h) + wt(h, f) + 8 * g
    return total if recompute else total + columns(f)


@pytest.mark.parametrize("sizes", [[300, 0, 129, 77], [1, 1, 1, 1], [1024, 0, 0, 0]])
@pytest.mark.parametrize("recompute", [False, True])
def test_every_saved_byte_is_a_documented_one(sizes, recompute):
    module = GroupedFP8MLP(G, H, F, "swiglu", backend="reference", recompute_activation=recompute)
    saved = _saved(module, sizes)
    assert sum(b for b, _ in saved.values()) == _fp8_layer_bytes(int(sum(sizes)), G, H, F, recompute)
    # the only 16-bit tensor kept is h ([T, 2F], the activation's input): X and act(h) * probs only as FP8 columns
    t = int(sum(sizes))
    assert [b for b, dtype in saved.values() if dtype == torch.bfloat16] == [2 * t * 2 * F]


def test_fewer_activation_bytes_per_token_than_the_bf16_layer():
    """Per routed token the BF16 layer keeps X (2H), h (4F), act(h) * probs (2F) and the probs; ours X's FP8 columns
    (H), h (4F), act(h) * probs' FP8 columns (F), the probs, and per 128-token block their scales: 8.7 KB against 6.0
    KB per token at Qwen3-30B-A3B's H = 2048, F = 768. Measured here on a long group (the per-group padding columns
    and the W^T copies are per layer, not per token)."""
    small, large = [128, 0, 0, 0], [128 * 9, 0, 0, 0]
    per_token = {}
    for cls in (GroupedFP8MLP, GroupedBF16MLP):
        kw = {"backend": "reference"} if cls is GroupedFP8MLP else {}
        a = sum(b for b, _ in _saved(cls(G, H, F, "swiglu", **kw), small).values())
        b = sum(b for b, _ in _saved(cls(G, H, F, "swiglu", **kw), large).values())
        per_token[cls] = (b - a) / (sum(large) - sum(small))
    assert per_token[GroupedBF16MLP] == 2 * H + 2 * 2 * F + 2 * F + 4
    assert per_token[GroupedFP8MLP] == H + 2 * 2 * F + F + 4 + 4 * (H + F) / 128
    assert per_token[GroupedFP8MLP] < 0.75 * per_token[GroupedBF16MLP]
