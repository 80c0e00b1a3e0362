"""The FP8 weight cache (megatron_tma.autograd.FP8WeightCache) against every way torch updates weights, and under
threads (issue 26, items 1 and 4). CPU, reference backend."""
import threading
import time

import pytest
import torch

from megatron_tma import autograd
from megatron_tma import reference as R
from megatron_tma.mlp import GroupedFP8MLP

G, H, FFN = 4, 128, 128


def _mlp(weight_layout="stacked", seed=0):
    torch.manual_seed(seed)
    return GroupedFP8MLP(G, H, FFN, "swiglu", backend="reference", weight_layout=weight_layout)


def _batch(gen, sizes=(40, 24, 0, 31)):
    x = torch.randn(sum(sizes), H, generator=gen).bfloat16()
    target = torch.randn(sum(sizes), H, generator=gen).bfloat16()
    return x, torch.tensor(sizes), target


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _fresh(module) -> bool:
    """Whether every linear's FP8 copies (what its next forward multiplies with) are the quantization of its
    weights as they are now."""
    for lin in (module.linear_fc1, module.linear_fc2):
        w = torch.stack([e.detach() for e in lin.expert_weights()])
        got = lin.weight_cache.get(tuple(lin.weights), lin.pow2_scales, lin.backend)
        want = R.quantize_128x128(w, lin.pow2_scales)
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want)):
            return False
    return True


def _train(module, step, gen, steps=4):
    """`steps` steps of MSE training; `step()` updates the weights. Returns the losses and, after each step,
    whether the FP8 copies were fresh."""
    x, sizes, target = _batch(gen)
    losses, fresh = [], []
    for _ in range(steps):
        out, _ = module(x, sizes)
        loss = (out.float() - target.float()).pow(2).mean()
        losses.append(loss.item())
        for p in module.parameters():
            p.grad = None
        loss.backward()
        step()
        fresh.append(_fresh(module))
    return losses, fresh


class _DataSGD(torch.optim.Optimizer):
    """A user's optimizer that writes the new weights through `.data` (no version counter sees it)."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])


# (SGD(fused=True) is left out: on the CPU with torch 2.13 it leaves BF16 / FP16 parameters unchanged.)
OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=5.0, foreach=False),
    "data-sgd": lambda ps: _DataSGD(ps, lr=5.0),
}


def test_fused_optimizers_leave_versions_alone():
    """The premise: on the CPU, fused optimizers do not move parameter version counters (nor do .data writes)."""
    p = torch.nn.Parameter(torch.randn(16, 16).bfloat16())
    p.grad = torch.randn(16, 16).bfloat16()
    torch.optim.AdamW([p], lr=1e-2, fused=True).step()
    p.data.add_(1.0)
    assert p._version == 0


@pytest.mark.parametrize("weight_layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_requantizes_after_every_optimizer_step(gen, name, weight_layout):
    """Issue 26 item 1: with AdamW(fused=True) the loss stayed flat (the FP8 copies of the initial weights)."""
    module = _mlp(weight_layout)
    opt = OPTIMIZERS[name](list(module.parameters()))
    losses, fresh = _train(module, opt.step, gen)
    assert len(set(losses)) == len(losses), losses  # every step changed the loss
    assert losses[-1] < losses[0], losses
    assert all(fresh), fresh


def test_any_optimizer_step_is_seen_by_a_bare_cache(gen):
    """The cache itself (not only the modules) misses after a step of any optimizer, here one that writes
    through `.data` a weight the cache was never told about."""
    from megatron_tma.autograd import FP8WeightCache

    w = torch.nn.Parameter((torch.randn(2, 128, 128, generator=gen) * 0.1).bfloat16())
    cache = FP8WeightCache()
    first = cache.get([w], backend="reference")
    assert cache.get([w], backend="reference") is first
    w.grad = torch.ones_like(w)
    _DataSGD([w], lr=0.01).step()
    second = cache.get([w], backend="reference")
    assert second is not first
    assert torch.equal(_bits(second.q), _bits(R.quantize_128x128(w.detach())[0]))


# ----------------------------------------------------------------------------------------------------------------
# Threads (issue 26 item 4)
# ----------------------------------------------------------------------------------------------------------------


def _yield_inside_the_cache(frame, event, arg):
    """A thread trace function that hands the GIL over at every line of FP8WeightCache.get / invalidate, so that the
    threads interleave inside them on every call instead of once in thousands."""
    code = frame.f_code
    if code.co_filename == autograd.__file__ and code.co_name in ("get", "invalidate"):
        return _yield_on_each_line
    return None


def _yield_on_each_line(frame, event, arg):
    if event == "line":
        time.sleep(0)
    return _yield_on_each_line


def test_get_and_invalidate_from_many_threads(gen):
    """Threads asking one cache for the copies of three weight sets while another invalidates it: every answer is
    the quantization of the weights it was asked for (it used to be None, or another set's copies)."""
    sets = [(torch.randn(2, 128, 128, generator=gen) * s).bfloat16() for s in (0.1, 3.0)]
    sets.append(sets[0][1:].clone())  # another shape too
    want = [R.quantize_128x128(w)[1] for w in sets]  # the scales tell the sets apart
    cache = autograd.FP8WeightCache()
    bad, calls, stop = [], [0], threading.Event()

    def ask(seed):
        rng = torch.Generator().manual_seed(seed)
        for _ in range(300):
            i = int(torch.randint(len(sets), (1,), generator=rng))
            got = cache.get([sets[i]], backend="reference")
            calls[0] += 1
            if got is None or not torch.equal(got.s, want[i]):
                bad.append(i)

    def invalidate():
        while not stop.is_set():
            cache.invalidate()

    threading.settrace(_yield_inside_the_cache)
    try:
        killer = threading.Thread(target=invalidate)
        askers = [threading.Thread(target=ask, args=(seed,)) for seed in range(6)]
        killer.start()
        for t in askers:
            t.start()
        for t in askers:
            t.join()
        stop.set()
        killer.join()
    finally:
        threading.settrace(None)
    assert not bad, f"{len(bad)} wrong answers in {calls[0]} calls"


@pytest.mark.parametrize("weight_layout", ["stacked", "per_expert"])
def test_data_parallel_replicas_get_their_own_caches(weight_layout):
    """nn.DataParallel's replicas (`_replicate_for_data_parallel`, a shallow copy of each module) must not share the
    FP8 weight cache: each replica holds other weights (its device's copies) and runs in its own thread."""
    module = _mlp(weight_layout)
    for lin in (module.linear_fc1, module.linear_fc2):
        lin.weight_cache.get(tuple(lin.weights), backend="reference")
        replica = lin._replicate_for_data_parallel()
        assert replica.weight_cache is not lin.weight_cache
        assert replica.weight_cache._value is None  # starts empty: nothing of the original's
        assert lin.weight_cache._value is not None  # the original keeps its own


def test_a_forward_under_graph_capture_quantizes_inside_the_graph(gen, monkeypatch):
    """A CUDA graph replays without the cache's host-side checks, so a forward under capture quantizes the weights
    inside the graph (the copies a replay reads are then those of the weights at that replay), even where an eager
    forward keeps valid-looking copies; `graph_reuses_cached_weights` makes a capture read the cached copies instead.
    Capture is stood in for on the CPU (the check the linears make)."""
    from megatron_tma import mlp as mlp_module

    module = _mlp()
    x, sizes, _ = _batch(gen)
    before = module(x, sizes)[0]
    with torch.no_grad():  # an update no signal sees (a .data write outside any optimizer step)
        module.linear_fc1.weight.data.mul_(-1.0)
    assert torch.equal(module(x, sizes)[0], before)  # eager: the cached copies
    monkeypatch.setattr(mlp_module, "capturing", lambda: True)
    for lin in (module.linear_fc1, module.linear_fc2):
        lin.graph_reuses_cached_weights = True
    assert torch.equal(module(x, sizes)[0], before)  # asked for: the cached copies again
    for lin in (module.linear_fc1, module.linear_fc2):
        lin.graph_reuses_cached_weights = False
    assert not torch.equal(module(x, sizes)[0], before) and _fresh(module)  # captured: today's weights


# ----------------------------------------------------------------------------------------------------------------
# Evaluation between training steps, copies and pickles (issue 34, items 1 and 5)
# ----------------------------------------------------------------------------------------------------------------


def _steps_with_evals(weight_layout, recompute, gen_seed, eval_mode, steps=3):
    """Losses and final weights of `steps` AdamW steps, with a forward under `eval_mode` (None: none) before every
    step's training forward (after the previous step: the cache then misses inside the eval)."""
    torch.manual_seed(1)
    module = GroupedFP8MLP(G, H, FFN, "swiglu", backend="reference", weight_layout=weight_layout,
                           recompute_activation=recompute)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    x, sizes, target = _batch(torch.Generator().manual_seed(gen_seed))
    probs = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(gen_seed))
    losses = []
    for _ in range(steps):
        if eval_mode is not None:
            with eval_mode():
                module(x, sizes, probs)
        out, _ = module(x, sizes, probs)
        loss = (out.float() - target.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute_activation"])
@pytest.mark.parametrize("weight_layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("eval_mode", [torch.inference_mode, torch.no_grad], ids=["inference_mode", "no_grad"])
def test_an_eval_between_steps_changes_nothing_in_training(eval_mode, weight_layout, recompute):
    """Issue 34 item 1: a forward under inference_mode between two steps left inference-mode FP8 copies in the cache,
    and the next training forward raised 'Inference tensors cannot be saved for backward'. With an eval under
    inference_mode or no_grad before every step, training computes the same bits as without."""
    plain_losses, plain_params = _steps_with_evals(weight_layout, recompute, 7, None)
    losses, params = _steps_with_evals(weight_layout, recompute, 7, eval_mode)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_a_model_built_under_inference_mode_runs_and_is_not_cached(gen):
    """Inference tensors carry no version counter (the cache key read it and raised): such weights are quantized on
    every call, and a write to them in inference mode is seen."""
    x, sizes, _ = _batch(gen)
    with torch.inference_mode():
        module = _mlp()
        first = module(x, sizes)[0]
        assert torch.equal(module(x, sizes)[0], first)
        module.linear_fc1.weight.mul_(-1.0)
        assert not torch.equal(module(x, sizes)[0], first)


def _tensor_at(memory: torch.Tensor, version: int) -> torch.Tensor:
    """A new tensor object over `memory`'s bytes (another version counter), moved to `version` by no-op writes: what a
    later allocation that lands on freed memory looks like to a cache key (pointer and version)."""
    t = torch.empty(0, dtype=memory.dtype).set_(memory.untyped_storage(), memory.storage_offset(), memory.shape,
                                                memory.stride())
    with torch.no_grad():
        while t._version < version:
            t.add_(0)
    assert t.data_ptr() == memory.data_ptr() and t._version == version
    return t


def test_a_deep_copied_cache_is_not_satisfied_by_another_tensor_at_the_old_address(gen):
    """Issue 34 item 5: a deep copy of a cache kept the original's key (pointers, versions) with copies of the memory
    behind it; a tensor that later lay at the original's address with the same version count hit that key and got the
    original's FP8 copies. Here the original's bytes change and a new tensor at its address with its version asks."""
    import copy

    w = (torch.randn(2, 128, 128, generator=gen) * 0.1).bfloat16()
    w.add_(0).add_(0)  # version 2: a tensor set_ over its memory starts at 1
    cache = autograd.FP8WeightCache()
    cache.get([w], backend="reference")
    copied = copy.deepcopy(cache)
    version = w._version
    with torch.no_grad():
        w.data.mul_(-2.0)  # the memory now holds other weights (the original's entry is not what is asked below)
    other = _tensor_at(w, version)
    got = copied.get([other], backend="reference")
    assert torch.equal(_bits(got.q), _bits(R.quantize_128x128(other)[0]))
    # and a hand-made entry whose aliases are not the memory at its key's pointers is not a hit either
    stale = autograd.FP8WeightCache()
    stale.get([w.clone()], backend="reference")
    entry = stale._entry
    stale._entry = entry._replace(key=entry.key[:4] + ((other.data_ptr(),), (other._version,)) + entry.key[6:])
    got = stale.get([other], backend="reference")
    assert torch.equal(_bits(got.q), _bits(R.quantize_128x128(other)[0]))


@pytest.mark.parametrize("weight_layout", ["stacked", "per_expert"])
def test_deep_copies_and_pickles_of_a_layer_compute_with_their_own_weights(gen, weight_layout):
    """Issue 34 item 5: a deep copy or an unpickled copy of a layer (after its first forward) starts with an empty
    cache and computes with its own weights, also after it loads other weights with assign=True."""
    import copy
    import pickle

    x, sizes, _ = _batch(gen)
    module = _mlp(weight_layout)
    module(x, sizes)
    other = _mlp(weight_layout, seed=5)
    want = other(x, sizes)[0]
    for make in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        clone = make(module)
        for lin in (clone.linear_fc1, clone.linear_fc2):
            assert lin.weight_cache._entry is None
        assert torch.equal(clone(x, sizes)[0], module(x, sizes)[0])
        clone.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
        assert torch.equal(clone(x, sizes)[0], want)
