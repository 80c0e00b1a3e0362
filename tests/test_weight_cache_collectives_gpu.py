"""The FP8 weight cache against in-place collectives on the GPU (issue 55 item 1): NCCL, one rank (one GPU), CUDA
backend. The values are tested on two gloo ranks on the CPU (tests/test_weight_cache_collectives.py); here the
bookkeeping on CUDA tensors through NCCL: a collective on the weights (sync, async, through `.data`) makes the next
forward quantize again, collectives on activations do not, and marking costs no host sync. Skipped without a Hopper
GPU + extension."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_tma import _ext
from megatron_tma.autograd import FP8WeightCache

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")

DEV = "cuda"

COLLECTIVES = {
    "broadcast": lambda p: dist.broadcast(p, 0),
    "all_reduce-data": lambda p: dist.all_reduce(p.data),
    "all_reduce-async": lambda p: dist.all_reduce(p, async_op=True).wait(),
    "all_gather-into-the-weights": lambda p: dist.all_gather_into_tensor(p.view(-1), p.detach().view(-1).clone()),
}


@pytest.fixture(scope="module")
def nccl_world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1,
                                device_id=torch.device(DEV, torch.cuda.current_device()))
        try:
            yield
        finally:
            dist.destroy_process_group()


def _weights():
    gen = torch.Generator(device=DEV).manual_seed(0)
    return torch.nn.Parameter((torch.randn(2, 128, 128, generator=gen, device=DEV) * 0.1).bfloat16())


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_a_collective_on_the_weights_makes_the_next_get_quantize(nccl_world_of_one, name):
    w = _weights()
    cache = FP8WeightCache()
    first = cache.get([w], backend="cuda")
    with torch.no_grad():
        COLLECTIVES[name](w)
    second = cache.get([w], backend="cuda")
    assert second is not first
    assert cache.get([w], backend="cuda") is second


def test_collectives_on_activations_keep_the_copies_without_a_sync(nccl_world_of_one):
    w = _weights()
    cache = FP8WeightCache()
    first = cache.get([w], backend="cuda")
    act = torch.randn(64, 128, device=DEV)
    out = torch.empty(64, 128, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the marking reads pointers only
    try:
        dist.all_reduce(act)
        dist.all_to_all_single(out, act)
        assert cache.get([w], backend="cuda") is first
        dist.broadcast(w.data, 0)
        assert cache.get([w], backend="cuda") is not first
    finally:
        torch.cuda.set_sync_debug_mode("default")
