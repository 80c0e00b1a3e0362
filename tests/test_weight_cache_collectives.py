"""The FP8 weight cache against in-place collectives on the weights (issue 55 item 1): c10d's collectives move no
version counter and no optimizer step runs around them, so before megatron_tma._collective_writes a forward after
`dist.broadcast(p, 0)` / `dist.all_reduce(p)` multiplied with the FP8 copies of the old weights. Real gloo process
groups on the CPU (reference backend): two processes where the weights must change, one where only the cache's
bookkeeping is looked at (a collective of one rank writes the same values, so only a miss or a hit tells)."""
import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_tma import _collective_writes
from megatron_tma import reference as R
from megatron_tma.autograd import FP8WeightCache
from megatron_tma.mlp import GroupedFP8MLP

G, H, FFN = 4, 128, 128
SIZES = (40, 24, 0, 31)

def _all_reduce_in_inference_mode(p):
    with torch.inference_mode():  # (an eval loop's sync: the parameter is no inference tensor, so it is seen)
        dist.all_reduce(p.data)


# Ways a job rewrites the weights with a collective, under no_grad, between two forwards.
COLLECTIVES = {
    "all_reduce-in-inference-mode": _all_reduce_in_inference_mode,
    "broadcast": lambda p: dist.broadcast(p, 0),
    "broadcast-data": lambda p: dist.broadcast(p.data, 0),
    "all_reduce": lambda p: dist.all_reduce(p),
    "all_reduce-async": lambda p: dist.all_reduce(p, async_op=True).wait(),
    "all_reduce-of-a-view": lambda p: dist.all_reduce(p.view(-1)),
    "process-group-broadcast": lambda p: dist.group.WORLD.broadcast([p.data]).wait(),
}


def _mlp(weight_layout, seed):
    torch.manual_seed(seed)
    return GroupedFP8MLP(G, H, FFN, "swiglu", backend="reference", weight_layout=weight_layout)


def _forward(module, x):
    with torch.no_grad():
        out, _ = module(x, torch.tensor(SIZES))
    return out


def _fresh_forward(module, x):
    """The forward with FP8 copies quantized now from the weights as they are (the cache dropped first)."""
    module.invalidate_weight_cache()
    return _forward(module, x)


def _two_rank_worker(rank, store, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        x = torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(7)).bfloat16()
        lines = []
        for name, collective in COLLECTIVES.items():
            for layout in ("stacked", "per_expert"):
                module = _mlp(layout, seed=rank)  # the ranks start from different weights
                module.linear_fc1.is_first_microbatch = module.linear_fc2.is_first_microbatch = False
                before = _forward(module, x)  # caches the FP8 copies of this rank's weights
                with torch.no_grad():
                    for p in module.parameters():
                        collective(p)
                after = _forward(module, x)
                want = _fresh_forward(module, x)
                changed = not torch.equal(before, want)
                lines.append(f"{name} {layout} changed={changed} same={torch.equal(after, want)}")
        with open(f"{results}.{rank}", "w") as f:
            f.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


def test_a_forward_after_a_collective_on_the_weights_uses_the_new_weights(tmp_path):
    """Two gloo ranks with different weights; after each collective the forward must equal one with freshly
    quantized weights, and (so that the test can fail) the collective must have changed rank 1's output."""
    results = tmp_path / "result"
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), str(results)), nprocs=2, join=True)
    for rank in (0, 1):
        lines = (tmp_path / f"result.{rank}").read_text().splitlines()
        assert len(lines) == 2 * len(COLLECTIVES)
        for line in lines:
            assert line.endswith("same=True"), f"rank {rank}: {line} (stale FP8 weights after the collective)"
            if rank == 1 or "all_reduce" in line:  # rank 0 broadcasts its own weights: unchanged there
                assert "changed=True" in line, f"rank {rank}: {line}"


# ----------------------------------------------------------------------------------------------------------------
# One rank: which entries a collective marks (the bookkeeping, not the values)
# ----------------------------------------------------------------------------------------------------------------


def _weights(gen, storage=None, offset=0):
    w = (torch.randn(2, 128, 128, generator=gen) * 0.1).bfloat16()
    if storage is None:
        return torch.nn.Parameter(w)
    view = storage[offset: offset + w.numel()].view(2, 128, 128)
    view.copy_(w)
    return view


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_a_collective_on_the_weights_makes_the_next_get_quantize(gen, world_of_one, name):
    w = _weights(gen)
    cache = FP8WeightCache()
    first = cache.get([w], backend="reference")
    with torch.no_grad():
        COLLECTIVES[name](w)
    assert w._version == 0 or name == "all_reduce-of-a-view"  # (the premise: nothing moved the counter)
    second = cache.get([w], backend="reference")
    assert second is not first
    assert cache.get([w], backend="reference") is second  # and it is cached again


@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated")  # (torch >= 2.13)
def test_collectives_on_other_memory_keep_the_copies(gen, world_of_one):
    """Micro-batches 2..N: collectives on activations (all-to-alls, all-reduces of outputs) re-quantize nothing."""
    w = _weights(gen)
    cache = FP8WeightCache()
    first = cache.get([w], backend="reference")
    act = torch.randn(64, 128)
    out = torch.empty(64, 128)
    dist.all_reduce(act)
    dist.broadcast(act, 0)
    dist.all_to_all_single(out, act)
    dist.all_gather_into_tensor(out, act)
    assert cache.get([w], backend="reference") is first


def test_a_collective_on_one_layers_part_of_a_shared_buffer_requantizes_that_layer_only(gen, world_of_one):
    """Megatron's parameter buffer holds every layer's weights (views of one storage, sharing one version counter);
    a collective on one bucket of it writes only that bucket, and only the layers whose weights lie there quantize
    again (a broadcast and an all-reduce here: they move no version counter, so only the watch can tell)."""
    n = 2 * 128 * 128
    buffer = torch.zeros(3 * n, dtype=torch.bfloat16)
    w1, w2 = _weights(gen, buffer, 0), _weights(gen, buffer, n)
    c1, c2 = FP8WeightCache(), FP8WeightCache()
    v1, v2 = c1.get([w1], backend="reference"), c2.get([w2], backend="reference")
    dist.broadcast(buffer[n: 2 * n], 0)
    assert c1.get([w1], backend="reference") is v1
    assert c2.get([w2], backend="reference") is not v2
    # The last element of w1 and nothing else: w1 only.
    v2 = c2.get([w2], backend="reference")
    dist.all_reduce(buffer[n - 1: n])
    assert c1.get([w1], backend="reference") is not v1 and c2.get([w2], backend="reference") is v2
    # The buffer's tail (no layer there) touches neither.
    v1 = c1.get([w1], backend="reference")
    dist.all_reduce(buffer[2 * n:])
    assert c1.get([w1], backend="reference") is v1 and c2.get([w2], backend="reference") is v2


def test_separate_expert_weights_are_watched_one_by_one(gen, world_of_one):
    """G weights that are not back to back (stacked by copy): a collective on any one of them is seen."""
    ws = [torch.nn.Parameter((torch.randn(128, 128, generator=gen) * 0.1).bfloat16()) for _ in range(3)]
    cache = FP8WeightCache()
    first = cache.get(ws, backend="reference")
    dist.broadcast(ws[2].data, 0)
    second = cache.get(ws, backend="reference")
    assert second is not first
    stacked = torch.stack([w.detach() for w in ws])
    assert torch.equal(second.q.view(torch.uint8), R.quantize_128x128(stacked)[0].view(torch.uint8))


def test_a_dropped_entry_leaves_the_registry(gen, world_of_one):
    """The watched ranges go with the cache entry: the registry does not grow with the steps of a run."""
    w = _weights(gen)
    key = _collective_writes._storage_key(w)
    cache = FP8WeightCache()
    for _ in range(5):
        cache.get([w], backend="reference")
        dist.all_reduce(w)  # every get misses
    gc.collect()
    assert len(_collective_writes._ranges[key]) == 1
    cache.invalidate()
    gc.collect()
    assert key not in _collective_writes._ranges


@pytest.mark.filterwarnings("error")
def test_collectives_on_fake_tensors_read_no_pointer(gen, world_of_one):
    """A collective under FakeTensorMode (torch.compile's tracing) has no memory to write: the hook skips its fake
    tensors instead of reading their data pointers (torch warns about that, and will refuse it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = _weights(gen)
    cache = FP8WeightCache()
    first = cache.get([w], backend="reference")  # (something watched: the hook looks at every written tensor)
    with FakeTensorMode():
        dist.all_reduce(torch.empty(4))
    assert cache.get([w], backend="reference") is first
