"""megatron_tma.mcore.held_memory: what each byte of a training state is, on Megatron's own mixed-precision optimizer
(CPU, its CUDA-only pieces pointed at the CPU as in tests/test_mcore.py): the expert and other parts' weights,
gradients, FP8 copies, FP32 masters and Adam moments, byte for byte from the shapes; a released expert's BF16 weight
counts nothing; a view of a shared gradient buffer counts its own bytes once."""
import pytest
import torch

from megatron_tma.mcore.held_memory import PARTS, held_bytes
from megatron_tma.mlp import GroupedFP8MLP

try:
    import megatron.core  # noqa: F401
    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

G, H, F = 4, 256, 128


class _Layer(torch.nn.Module):
    """Megatron's names: the expert MLP under `mlp.experts`, a norm beside it."""

    def __init__(self, release):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = GroupedFP8MLP(G, H, F, backend="reference", release_bf16_weights=release)
        self.norm = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16))


def _fp8_copy_bytes(n, k):
    """W and W^T of one [G, n, k] weight in 128x128 blocks: the bytes and their FP32 scales (docs/layouts.md)."""
    blocks = -(-n // 128) * -(-k // 128)
    return 2 * (G * n * k + 4 * G * blocks)


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
@pytest.mark.parametrize("release", [False, True])
def test_each_byte_of_a_stepped_state(release):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_tma import released_weights
    from test_mcore import _megatron_optimizer_on_the_cpu

    torch.manual_seed(0)
    layer = _Layer(release)
    params = list(layer.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)  # DDP's one gradient buffer
    start = 0
    for p in params:
        p.main_grad = buffer[start:start + p.numel()].view(p.shape)
        start += p.numel()
    with _megatron_optimizer_on_the_cpu():
        opt = Float16OptimizerWithFloat16Params(torch.optim.Adam(params, lr=1e-2),
                                                OptimizerConfig(lr=1e-2, bf16=True, clip_grad=0.0), None,
                                                lambda o, c=None: None)
    if release:
        released_weights.attach_optimizer(opt)
    sizes = torch.tensor([10, 0, 40, 14])
    out, _ = layer.mlp.experts(torch.randn(64, H).bfloat16(), sizes)
    out.backward(torch.randn(64, H).bfloat16())
    with _megatron_optimizer_on_the_cpu():
        assert opt.step()[0]

    held = held_bytes([layer], opt)
    assert set(held) == set(PARTS)
    n_experts = sum(p.numel() for p in layer.mlp.experts.parameters())
    step_tensors = sum(t.numel() * t.element_size() for s in opt.optimizer.state.values() for k, t in s.items()
                       if k == "step")  # Adam's step counters, a few bytes a parameter tensor
    copies = _fp8_copy_bytes(2 * F, H) + _fp8_copy_bytes(H, F)
    assert held["expert_weights"] == (0 if release else 2 * n_experts)
    assert held["expert_fp8_copies"] == copies  # cached after the forward, or written from the masters by the step
    assert held["expert_grads"] == 4 * n_experts and held["other_grads"] == 4 * H
    assert held["expert_masters"] == 4 * n_experts and held["other_masters"] == 4 * H
    assert held["expert_optimizer_state"] + held["other_optimizer_state"] == 8 * (n_experts + H) + step_tensors
    assert held["other_weights"] == 2 * H
    assert held["unpaired_masters"] == held["unpaired_optimizer_state"] == 0


def test_no_optimizer_and_an_fp32_model():
    """Without an optimizer only the model's parts count; an FP32 parameter stepped by a plain torch optimizer is its
    own master (its bytes once, as weights) and its moments are paired through it."""
    model = torch.nn.Linear(128, 64)
    assert held_bytes([model])["other_weights"] == 4 * (128 * 64 + 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 128)).sum().backward()
    opt.step()
    held = held_bytes([model], opt)
    n = 128 * 64 + 64
    assert held["other_weights"] == 4 * n and held["other_grads"] == 4 * n and held["other_masters"] == 0
    assert held["other_optimizer_state"] >= 8 * n and held["unpaired_optimizer_state"] == 0


def test_overlapping_views_count_once_and_shards_pair_with_their_parameters():
    """Megatron's distributed optimizer's layout (its attribute names, a stand-in object: building the real one needs
    a process group and DDP's buffers): BF16 parameters whose `main_grad`s are views of one FP32 buffer, FP32 master
    shards paired with their parameters by `model_float16_groups` / `shard_fp32_from_float16_groups`, each shard's
    `.grad` a view of that same buffer (counted once, with the gradients), Adam's moments per shard."""
    import types

    experts = torch.nn.Module()
    experts.experts = torch.nn.Module()
    experts.experts.w = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    experts.norm = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
    params = [experts.experts.w, experts.norm]
    buffer = torch.zeros(64 * 32 + 32)
    experts.experts.w.main_grad = buffer[:2048].view(64, 32)
    experts.norm.main_grad = buffer[2048:]
    # this rank's shards: the first half of the expert weight, all of the norm
    shards = [experts.experts.w.detach()[:32].float(), experts.norm.detach().float()]
    shards[0].grad = buffer[:1024].view(32, 32)
    shards[1].grad = buffer[2048:]
    inner = torch.optim.Adam(shards)
    for s in shards:
        inner.state[s] = {"exp_avg": torch.zeros_like(s), "exp_avg_sq": torch.zeros_like(s)}
    dist_opt = types.SimpleNamespace(optimizer=inner, model_float16_groups=[params],
                                     shard_fp32_from_float16_groups=[shards])
    held = held_bytes([experts], types.SimpleNamespace(chained_optimizers=[dist_opt]))
    assert held["expert_weights"] == 2 * 2048 and held["other_weights"] == 2 * 32
    assert held["expert_grads"] == 4 * 2048 and held["other_grads"] == 4 * 32  # the shards' grads: no byte twice
    assert held["expert_masters"] == 4 * 1024 and held["other_masters"] == 4 * 32
    assert held["expert_optimizer_state"] == 8 * 1024 and held["other_optimizer_state"] == 8 * 32
    assert held["unpaired_masters"] == held["unpaired_grads"] == held["unpaired_optimizer_state"] == 0
    # an unpaired master (no pairing lists) and a rank whose chained optimizer holds none
    lone = torch.zeros(16, requires_grad=True)
    lone.grad = torch.zeros(16)
    held = held_bytes([], torch.optim.SGD([lone], lr=0.1))
    assert held["unpaired_masters"] == 64 and held["unpaired_grads"] == 64
    assert sum(held_bytes([], types.SimpleNamespace(chained_optimizers=[])).values()) == 0
    # gradients that overlap in part (and a strided view inside them): their union, 75 floats
    buffer = torch.zeros(100)
    a, b = torch.zeros(50, requires_grad=True), torch.zeros(50, requires_grad=True)
    a.grad, b.grad = buffer[:50], buffer[25:75]
    c = torch.zeros(5, 2, requires_grad=True)
    c.grad = buffer[:50].view(10, 5)[::2, :2]
    assert held_bytes([], torch.optim.SGD([a, b, c], lr=0.1))["unpaired_grads"] == 4 * 75
