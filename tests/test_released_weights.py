"""release_bf16_weights (megatron_tma.released_weights), on the CPU's reference kernels and on the GPU's: a layer that
frees its BF16 weights after the first training forward of a step, and whose FP8 copies the optimizer step then writes
straight from the FP32 masters (one `[G, N, K]` parameter) or whose BF16 memory it gives back and rewrites (G
parameters), trains the same bits as one that keeps them, under an optimizer with FP32 masters shaped like Megatron's
`Float16OptimizerWithFloat16Params` (whose CUDA-only constructor the GPU recipe test runs: tests/test_mcore_gpu.py);
checkpoints see the BF16 weights; what would read the freed memory is refused with a clear error."""
import pytest
import torch

from megatron_tma import _ext, quant
from megatron_tma import released_weights as rw
from megatron_tma.mlp import GroupedFP8MLP

G, H, F = 4, 256, 128
SIZES = torch.tensor([10, 0, 25, 5])
# the reference kernels on the CPU, and the CUDA kernels where there are some (a GPU frees and re-allocates through
# the caching allocator: the addresses change, which the FP8 cache's key must see)
PLACES = [("cpu", "reference"),
          pytest.param(("cuda", "auto"), marks=pytest.mark.skipif(
              not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension"))]


class MixedPrecisionOptimizer:
    """Megatron's Float16OptimizerWithFloat16Params' part that `attach_optimizer` touches: FP32 masters made from the
    BF16 parameters, an inner torch optimizer on the masters, and the copies between them (the names Megatron's)."""

    def __init__(self, params, lr=1e-2):
        self.float16_groups = [list(params)]
        self.fp32_from_float16_groups = [[p.detach().float() for p in self.float16_groups[0]]]
        self.optimizer = torch.optim.Adam(self.fp32_from_float16_groups[0], lr=lr)

    def _copy_main_params_to_model_params(self):
        for model, main in zip(self.float16_groups[0], self.fp32_from_float16_groups[0]):
            model.data.copy_(main)

    def _copy_model_params_to_main_params(self, state_dict=None):
        for model, main in zip(self.float16_groups[0], self.fp32_from_float16_groups[0]):
            main.data.copy_(model)

    def step(self, skip=False):
        for model, main in zip(self.float16_groups[0], self.fp32_from_float16_groups[0]):
            main.grad = model.main_grad.clone()
            model.main_grad.zero_()
        if skip:  # Megatron's step on a non-finite gradient: no update, no copy
            return
        self.optimizer.step()
        self._copy_main_params_to_model_params()


def _mlp(release, place=PLACES[0], **kw):
    device, backend = place
    torch.manual_seed(0)
    mlp = GroupedFP8MLP(G, H, F, backend=backend, device=device, release_bf16_weights=release, **kw)
    for p in mlp.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    return mlp


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _storage_bytes(mlp):
    return [p.untyped_storage().nbytes() for p in mlp.parameters()]


def _micro_batch(mlp, x, probs, dy):
    device = mlp.linear_fc1.weights[0].device
    xi = x.to(device).requires_grad_()
    out, _ = mlp(xi, SIZES.to(device), None if probs is None else probs.to(device))
    out.backward(dy.to(device))
    return [out, xi.grad]


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("place", PLACES, ids=lambda p: p[0])
def test_a_released_layer_trains_the_same_bits(gen, place, layout):
    """Stacked: every step writes the FP8 copies from the masters and the BF16 weights never come back (a state dict
    writes them back from the masters: the plain layer's bits). Per expert: the step gives the memory back and
    copies into it, as Megatron's copy does."""
    plain, released = _mlp(False, place, weight_layout=layout), _mlp(True, place, weight_layout=layout)
    opts = [MixedPrecisionOptimizer(m.parameters()) for m in (plain, released)]
    assert rw.attach_optimizer(opts[1]) == 1
    weight_bytes = sum(p.numel() * 2 for p in released.parameters())
    storages = 2 if layout == "stacked" else 2 * G
    for step in range(3):
        for micro in range(2):
            x, dy = torch.randn(40, H, generator=gen).bfloat16(), torch.randn(40, H, generator=gen).bfloat16()
            probs = torch.rand(40, generator=gen)
            got = [_micro_batch(m, x, probs, dy) for m in (plain, released)]
            assert all(torch.equal(u, v) for u, v in zip(*got)), (step, micro)
            # from the first forward on, the BF16 memory is gone and the FP8 copies (W, W^T) are what the layer holds
            assert _storage_bytes(released) == [0] * storages and rw.released_bytes(released) == weight_bytes
            assert all(rw.is_released(p) for p in released.parameters())
        for p, q in zip(plain.parameters(), released.parameters()):
            assert torch.equal(p.main_grad, q.main_grad)
        for opt in opts:
            opt.step()
        if layout == "per_expert":  # the optimizer's copy gave the memory back and wrote the new weights into it
            assert _storage_bytes(released) == _storage_bytes(plain) and rw.released_bytes(released) == 0
            assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), released.parameters()))
            assert released.linear_fc1.weight_cache._value is None  # the FP8 copies dropped at the step
            continue
        # still released; the copies written from the masters are the quantizer's bytes of the new BF16 weights
        assert _storage_bytes(released) == [0, 0] and rw.released_bytes(released) == weight_bytes
        for a, b in ((plain.linear_fc1, released.linear_fc1), (plain.linear_fc2, released.linear_fc2)):
            want = quant.quantize_128x128(a.weight.detach(), backend=place[1])
            assert all(torch.equal(_bytes(u), _bytes(v)) for u, v in zip(b.weight_cache._value, want))
    # a checkpoint's BF16 weights: the plain layer's, bit for bit (stacked: made from the masters, still released)
    state, want = released.state_dict(), {k: v.clone() for k, v in plain.state_dict().items()}
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    assert all(rw.is_released(p) for p in released.parameters()) == (layout == "stacked")
    got = [_micro_batch(m, x, probs, dy) for m in (plain, released)]  # and the layer trains on
    assert all(torch.equal(u, v) for u, v in zip(*got))
    for opt in opts:
        opt.step()
    # the state dict taken before is tensors of its own: the training since (memory freed, copies rewritten) left it
    assert all(torch.equal(state[k], want[k]) for k in want)
    if layout == "stacked":  # Megatron's sharded checkpoint reads the parameters themselves: written back
        kept, want = released.state_dict(keep_vars=True), plain.state_dict()
        assert all(torch.equal(kept[k], want[k]) for k in want)
        assert not any(rw.is_released(p) for p in released.parameters())


@pytest.mark.parametrize("place", PLACES, ids=lambda p: p[0])
def test_evaluation_keeps_the_weights_and_a_skipped_step_the_copies(gen, place):
    plain, released = _mlp(False, place), _mlp(True, place)
    opts = [MixedPrecisionOptimizer(m.parameters()) for m in (plain, released)]
    rw.attach_optimizer(opts[1])
    x, dy = torch.randn(40, H, generator=gen).bfloat16(), torch.randn(40, H, generator=gen).bfloat16()
    with torch.no_grad():
        released(x.to(place[0]), SIZES.to(place[0]))
    assert not any(rw.is_released(p) for p in released.parameters())  # no training forward: nothing released
    for skip in (True, False, False):
        got = [_micro_batch(m, x, None, dy) for m in (plain, released)]
        assert all(torch.equal(u, v) for u, v in zip(*got))
        # Megatron's first-micro-batch flag, set while released: the held copies are still the weights
        released.linear_fc1.is_first_microbatch = released.linear_fc2.is_first_microbatch = True
        got = [_micro_batch(m, x, None, dy) for m in (plain, released)]
        assert all(torch.equal(u, v) for u, v in zip(*got))
        held = released.linear_fc1.weight_cache._value
        for opt in opts:
            opt.step(skip=skip)
        # a skipped step writes nothing (the copies stay); a step writes new ones from the masters
        assert rw.is_released(released.linear_fc1.weight)
        assert (released.linear_fc1.weight_cache._value is held) == skip


def test_what_would_read_the_freed_memory_is_refused(gen):
    released = _mlp(True)
    opt = MixedPrecisionOptimizer(released.parameters())
    rw.attach_optimizer(opt)
    x, dy = torch.randn(40, H, generator=gen).bfloat16(), torch.randn(40, H, generator=gen).bfloat16()
    _micro_batch(released, x, None, dy)
    with pytest.raises(RuntimeError, match="no FP32 master wrote their copies"):
        released.state_dict()
    sgd = torch.optim.SGD(released.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"SGD.step\(\) on expert weights whose BF16 memory is released"):
        sgd.step()
    with pytest.raises(RuntimeError, match="cannot be reloaded from expert weights"):
        opt._copy_model_params_to_main_params()
    # a checkpoint load gives the memory back and writes it: the next forward quantizes what was loaded
    plain = _mlp(False)
    released.load_state_dict(plain.state_dict())
    assert not rw.is_released(released.linear_fc1.weight)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), released.parameters()))
    assert all(torch.equal(u, v) for u, v in zip(_micro_batch(plain, x, None, dy), _micro_batch(released, x, None, dy)))
    assert rw.restore_bf16_weights(released.parameters()) == 2  # by hand: both linears


def test_the_settings_it_cannot_serve_are_refused(gen):
    with pytest.raises(ValueError, match="release_bf16_weights and step_refreshed_weights exclude each other"):
        GroupedFP8MLP(G, H, F, backend="reference", release_bf16_weights=True, step_refreshed_weights=True)
    with pytest.raises(TypeError, match="release_bf16_weights"):
        GroupedFP8MLP(G, H, F, backend="reference", release_bf16_weights=1)
    with pytest.raises(TypeError, match="not Megatron's Float16OptimizerWithFloat16Params"):
        rw.attach_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    distributed = type("DistributedOptimizer", (MixedPrecisionOptimizer,), {})([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(TypeError, match="DistributedOptimizer is not"):
        rw.attach_optimizer(type("ChainedOptimizer", (), {"chained_optimizers": [distributed]})())
    # weights inside a larger buffer (Megatron's distributed optimizer's parameter buffer): freeing it would free more
    released = _mlp(True)
    for p in released.parameters():
        buffer = torch.empty(p.numel() + 128, dtype=p.dtype)
        buffer[:p.numel()].copy_(p.detach().flatten())
        p.data = buffer[:p.numel()].view(p.shape)
    x, dy = torch.randn(40, H, generator=gen).bfloat16(), torch.randn(40, H, generator=gen).bfloat16()
    with pytest.raises(RuntimeError, match="the only tensors in their storage"):
        _micro_batch(released, x, None, dy)
    with pytest.raises(RuntimeError, match="nn.DataParallel's replicas share the weights"):
        _mlp(True).linear_fc1._replicate_for_data_parallel()


def test_what_can_go_wrong_leaves_the_layer_whole(gen, monkeypatch):
    """Weights that do not all train are never released (an optimizer leaves frozen ones unwritten); a failed write
    from the masters (out of memory at the step's peak, say) leaves the layer with its BF16 weights as the
    optimizer's copy makes them; a failed load leaves the layer as it was; weights replaced while released are
    refused; Megatron's layer-wise distributed optimizer is refused and its empty stub optimizers skipped."""
    x, dy = torch.randn(40, H, generator=gen).bfloat16(), torch.randn(40, H, generator=gen).bfloat16()
    frozen = _mlp(True, weight_layout="per_expert")
    frozen.linear_fc1.weight1.requires_grad_(False)
    _micro_batch(frozen, x, None, dy)
    assert not rw.is_released(frozen.linear_fc1.weight0) and rw.is_released(frozen.linear_fc2.weight0)

    plain, released = _mlp(False), _mlp(True)
    opts = [MixedPrecisionOptimizer(m.parameters()) for m in (plain, released)]
    rw.attach_optimizer(opts[1])
    for m in (plain, released):
        _micro_batch(m, x, None, dy)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(quant, "quantize_128x128_from_master", out_of_memory)
    opts[0].step()
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        opts[1].step()
    monkeypatch.undo()
    assert not rw.is_released(released.linear_fc1.weight)  # the first layer written back in BF16, then the error
    assert torch.equal(released.linear_fc1.weight, plain.linear_fc1.weight)

    released = _mlp(True)
    opt = MixedPrecisionOptimizer(released.parameters())
    rw.attach_optimizer(opt)
    out = _micro_batch(released, x, None, dy)[0]
    held = released.linear_fc1.weight_cache._value
    bad = _mlp(False).state_dict()  # assign=True from experts of two dtypes: refused (no one [G, N, K] of them)
    bad["linear_fc1.weight0"] = bad["linear_fc1.weight0"].double()
    with pytest.raises(RuntimeError, match="differ in dtype or device"):
        released.load_state_dict(bad, assign=True)
    assert rw.is_released(released.linear_fc1.weight) and released.linear_fc1.weight_cache._value is held
    assert torch.equal(_micro_batch(released, x, None, dy)[0], out)
    # replaced while released and the old weight still held (an optimizer's groups would hold it): refused; once
    # nothing holds it, nothing can write it either, and the layer quantizes the new weights
    old = released.linear_fc2.weight
    released.linear_fc2.weight = torch.nn.Parameter(torch.zeros(old.shape, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="replaced while released"):
        _micro_batch(released, x, None, dy)
    del old
    assert not _micro_batch(released, x, None, dy)[0].any()  # fc2's weights are zeros now

    stub = type("StubOptimizer", (), {"is_stub_optimizer": True})()
    assert rw.attach_optimizer(type("ChainedOptimizer", (), {"chained_optimizers": [stub, opt]})()) == 1
    with pytest.raises(TypeError, match="LayerWiseDistributedOptimizer copies other ranks"):
        rw.attach_optimizer(type("LayerWiseDistributedOptimizer", (), {"chained_optimizers": [opt]})())


@pytest.mark.parametrize("place", PLACES, ids=lambda p: p[0])
def test_a_dropped_released_layer_frees_everything(gen, place):
    """A released layer that goes out of scope leaves nothing alive: its parameters, FP8 copies and the master its
    copies were last written from (the registry of released parameters is weak both ways; a strong owner held its own
    key alive, which ran a GPU grid of layers out of memory)."""
    import gc
    import weakref

    mlp = _mlp(True, place)
    x, probs, dy = (torch.randn(40, H, generator=gen).bfloat16(), torch.rand(40, generator=gen),
                    torch.randn(40, H, generator=gen).bfloat16())
    masters = [p.detach().float() for p in mlp.parameters()]  # (an optimizer's, made before the release)
    _micro_batch(mlp, x, probs, dy)
    assert rw.write_weights_from_masters(list(mlp.parameters()), masters) == []  # both written from their masters
    assert all(rw.is_released(p) for p in mlp.parameters())
    alive = [weakref.ref(t) for t in [mlp, *mlp.parameters(), *masters,
                                      *(t for m in (mlp.linear_fc1, mlp.linear_fc2) for t in m.weight_cache._value
                                        if t is not None)]]
    del mlp, masters
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive)


def test_a_parameter_outliving_its_layer_stays_released(gen):
    """A released parameter still held elsewhere (an optimizer's groups) after its layer is dropped is still known as
    released: a torch optimizer stepping on it is refused instead of writing into its freed memory."""
    import gc

    mlp = _mlp(True)
    _micro_batch(mlp, torch.randn(40, H, generator=gen).bfloat16(), torch.rand(40, generator=gen),
                 torch.randn(40, H, generator=gen).bfloat16())
    params = list(mlp.parameters())
    del mlp
    gc.collect()
    assert all(rw.is_released(p) for p in params)
    with pytest.raises(RuntimeError, match="BF16 memory is released"):
        torch.optim.SGD(params, lr=0.1).step()
