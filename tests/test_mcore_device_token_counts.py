"""`megatron_tma.mcore.keep_token_counts_on_device`: Megatron's all-to-all dispatcher without its host sync.

On the CPU, with megatron-core: a real `MoELayer` (alltoall dispatcher, EP = 1, megatron_tma experts on the
reference backend). Megatron's dispatcher asks CUDA for a side stream, an event and its sync; here those calls go to
a recorder, so that the unchanged layer runs on the CPU and the test sees each one it makes."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from megatron_tma import mcore
from megatron_tma.mcore import device_token_counts

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (Python >= 3.12)")


class _CudaCalls:
    """Stands in for the CUDA stream calls of megatron-core's all-to-all dispatcher and counts them."""

    def __init__(self):
        self.calls = []

    def note(self, what, result=None):
        self.calls.append(what)
        return result

    # the side stream (`MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`)
    def wait_stream(self, stream):
        self.note("wait_stream")

    def record_event(self):
        return self.note("record_event", self)

    def synchronize(self):  # the event's: the host waits for the device-to-host copy
        self.note("synchronize")


@pytest.fixture
def cuda_calls(megatron_cpu, monkeypatch):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    calls = _CudaCalls()
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", calls)  # else __init__ makes a CUDA stream
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: calls.note("current_stream", "main stream"))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: calls.note("stream", contextlib.nullcontext()))
    return calls


@pytest.fixture
def sorts(monkeypatch):
    """Every call of megatron-core's chunk sort by local expert, recorded (and still made)."""
    from megatron.core.transformer.moe import token_dispatcher

    seen = []
    real = token_dispatcher.sort_chunks_by_idxs

    def recorded(*args, **kwargs):
        seen.append(args[2].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(token_dispatcher, "sort_chunks_by_idxs", recorded)
    return seen


def _gpt(mode="unpadded", experts=4, dispatcher="alltoall", device="cpu", **config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config.setdefault("moe_router_topk", min(2, experts))
    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_moe_experts=experts,
                            moe_ffn_hidden_size=128, gated_linear_unit=True,
                            activation_func=F.silu,
                            add_bias_linear=False, moe_token_dispatcher_type=dispatcher, use_cpu_initialization=True,
                            perform_initialization=False, bf16=True, params_dtype=torch.bfloat16,
                            moe_router_pre_softmax=experts == 1, **config)  # Megatron asks for it at top-1
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=True)
    if mode is not None:
        spec = mcore.use_megatron_tma_experts(spec, mode, backend="reference" if device == "cpu" else "auto")
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=512, max_sequence_length=64).to(device)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    for layer in gpt.decoder.layers:
        # Megatron's router gate moves its weight to the GPU; the same logits on the CPU (routing is not under test)
        router = layer.mlp.router
        router.gating = lambda x, router=router: F.linear(x, router.weight.to(x.dtype))
    return gpt


def _input(seed=3, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 4, 256, generator=gen).to(device, torch.bfloat16)


def _step(layer, x=None):
    """One forward and backward of an MoE layer on `x` (default: `_input()`): (output, input gradient, parameter
    gradients), and the `tokens_per_expert` its experts were called with."""
    x = (_input() if x is None else x).detach().requires_grad_()
    handed = []
    hook = layer.experts.register_forward_pre_hook(lambda m, args: handed.append(args[1]))
    try:
        out = layer(x)[0]
    finally:
        hook.remove()
    out.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad()
    return out.detach(), x.grad, grads, handed


def _step_without_syncs(layer, x):
    """`_step` after a warm-up one (first-call allocations and lazy initializations), under torch's sync debug mode
    "error": any synchronizing call in the layer's forward or backward fails it."""
    _step(layer, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return _step(layer, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", ["unpadded", "bf16"])
@pytest.mark.parametrize("experts", [4, 1])
def test_same_bits_without_the_host_copy_the_sync_or_the_sort(cuda_calls, sorts, monkeypatch, mode, experts):
    gpt = _gpt(mode, experts=experts)
    report = mcore.keep_token_counts_on_device(gpt, enable=False)
    assert list(report) == ["decoder.layers.0.mlp", "decoder.layers.1.mlp"]
    layer = gpt.decoder.layers[0].mlp

    megatrons = _step(layer)
    assert "synchronize" in cuda_calls.calls and "record_event" in cuda_calls.calls  # Megatron's host copy and wait
    # the sort at EP = 1 is the identity permutation, run in the forward and in the combine
    assert sorts == ([list(range(experts))] * 2 if experts > 1 else [])

    assert mcore.keep_token_counts_on_device(gpt) == {"decoder.layers.0.mlp": None, "decoder.layers.1.mlp": None}
    cuda_calls.calls.clear()
    sorts.clear()
    computed = []
    real_preprocess = layer.token_dispatcher.preprocess
    monkeypatch.setattr(layer.token_dispatcher, "preprocess", lambda m: computed.append(real_preprocess(m)) or
                        computed[-1])
    ours = _step(layer)
    assert cuda_calls.calls == [] and sorts == []
    assert layer.token_dispatcher.tokens_per_expert is None  # not held past the layer (Megatron's method drops it too)
    # the experts get the counts preprocess computed, where it computed them (the hidden states' device)
    assert len(ours[3]) == 1 and ours[3][0] is computed[0]
    assert ours[3][0].device == ours[0].device and ours[3][0].dtype == torch.long
    assert torch.equal(ours[3][0], megatrons[3][0].to(ours[3][0].device))
    assert int(ours[3][0].sum()) == 16 * 4 * min(2, experts) and megatrons[3][0].device.type == "cpu"
    for a, b in zip(megatrons[:3], ours[:3]):
        if isinstance(a, dict):
            assert a.keys() == b.keys() and len(a) > 0
            assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
        else:
            assert torch.equal(a, b)

    # enable=False gives Megatron's methods back: the host copy and the sync again
    assert set(mcore.keep_token_counts_on_device(gpt, enable=False).values()) == {"not enabled"}
    assert not any(m in layer.token_dispatcher.__dict__ for m in device_token_counts._PATCHED)
    again = _step(layer)
    assert "synchronize" in cuda_calls.calls and torch.equal(again[0], megatrons[0])


def test_applying_twice_is_applying_once(cuda_calls):
    gpt = _gpt()
    first = mcore.keep_token_counts_on_device(gpt)
    methods = {m: gpt.decoder.layers[0].mlp.token_dispatcher.__dict__[m] for m in device_token_counts._PATCHED}
    assert mcore.keep_token_counts_on_device(gpt) == first
    again = gpt.decoder.layers[0].mlp.token_dispatcher.__dict__
    assert all(again[m].__func__ is methods[m].__func__ for m in methods)


@pytest.mark.parametrize("change, reason", [
    (lambda layer: setattr(layer.token_dispatcher, "ep_size", 2), "expert parallel size 2"),
    (lambda layer: setattr(layer.token_dispatcher, "tp_size", 2), "expert tensor parallel size 2"),
    (lambda layer: setattr(layer.token_dispatcher, "drop_and_pad", True), "token dropping"),
    (lambda layer: setattr(layer.token_dispatcher.config, "moe_expert_capacity_factor", 1.0), "token dropping"),
    (lambda layer: setattr(layer.token_dispatcher.config, "moe_router_padding_for_quantization", True),
     "moe_router_padding_for_quantization"),
    (lambda layer: setattr(layer.token_dispatcher.config, "cuda_graph_impl", "local"), "cuda_graph_impl='local'"),
    (lambda layer: setattr(layer, "_inference_token_dispatcher", layer.token_dispatcher), "inference-optimized"),
    (lambda layer: setattr(layer.token_dispatcher, "sort_input_by_local_experts", torch.tensor([1, 0, 2, 3])),
     "not the identity"),
    (lambda layer: setattr(layer.token_dispatcher, "restore_output_by_local_experts", torch.tensor([0, 1, 3, 2])),
     "not the identity"),
])
def test_each_refusal_leaves_megatrons_methods(cuda_calls, change, reason):
    gpt = _gpt()
    layer = gpt.decoder.layers[0].mlp
    assert device_token_counts.refusal(layer) is None
    change(layer)
    got = mcore.keep_token_counts_on_device(gpt)
    assert reason in got["decoder.layers.0.mlp"]
    assert not any(m in layer.token_dispatcher.__dict__ for m in device_token_counts._PATCHED)


def test_a_full_iteration_graph_keeps_the_counts_on_the_gpu(cuda_calls):
    """cuda_graph_impl="full_iteration": the counts are made and read inside one graph, so the layers take it (the
    per-layer graphs "local" and "transformer_engine" do not: refused above)."""
    gpt = _gpt()
    for layer in gpt.decoder.layers:
        layer.mlp.token_dispatcher.config.cuda_graph_impl = "full_iteration"
    got = mcore.keep_token_counts_on_device(gpt)
    assert got and all(reason is None for reason in got.values()), got


def test_megatrons_own_experts_and_other_dispatchers_are_left_alone(cuda_calls):
    gpt = _gpt(mode=None)  # Megatron's experts (SequentialMLP in the local spec): counts on the host
    got = mcore.keep_token_counts_on_device(gpt)
    assert all("need the counts on the host" in r for r in got.values()) and len(got) == 2
    gpt = _gpt(dispatcher="allgather")
    got = mcore.keep_token_counts_on_device(gpt)
    assert all("MoEAllGatherTokenDispatcher" in r for r in got.values()) and len(got) == 2


@pytest.mark.skipif(not __import__("megatron_tma")._ext.cuda_kernels_available(),
                    reason="needs an sm_90 GPU and the built extension")
@pytest.mark.parametrize("mode", ["unpadded", "bf16"])
def test_on_the_gpu_the_counts_stay_there_and_nothing_syncs(megatron_cpu, mode):
    """On the GPU: Megatron's dispatcher hands the experts host counts; with the change they are the GPU tensor
    preprocess computed, the layer's forward and backward make no synchronizing call (torch's sync debug mode), and
    output and gradients are the same bits."""
    gpt = _gpt(mode, device="cuda")
    layer = gpt.decoder.layers[0].mlp
    x = _input(device="cuda")  # made before the sync check: the host-to-device copy of its values syncs
    megatrons = _step(layer, x)
    assert megatrons[3][0].device.type == "cpu"
    mcore.keep_token_counts_on_device(gpt)
    ours = _step_without_syncs(layer, x)
    assert ours[3][0].device.type == "cuda"
    assert torch.equal(ours[3][0].cpu(), megatrons[3][0])
    assert torch.equal(ours[0], megatrons[0]) and torch.equal(ours[1], megatrons[1])
    assert ours[2].keys() == megatrons[2].keys() and all(torch.equal(ours[2][k], megatrons[2][k]) for k in ours[2])
