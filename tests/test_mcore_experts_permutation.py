"""`megatron_tma.mcore.permute_in_experts`: Megatron's all-to-all dispatcher handing the experts the tokens as they
are, the experts gathering and combining the rows themselves.

On the CPU, with megatron-core: a real `MoELayer` (EP = 1, megatron_tma experts on the reference backend; the
dispatcher's CUDA stream calls recorded as in test_mcore_device_token_counts). Megatron's torch un-permutation adds
each token's rows in row order from zero, as the experts' combine does, and at top-2 the BF16 sum of two BF16 values
is their exact sum rounded once: so here the patched layer must give Megatron's bits."""
import pytest
import torch
from test_mcore_device_token_counts import (HAVE_MEGATRON, _gpt, _input, _step, _step_without_syncs,  # noqa: F401
                                            cuda_calls)

from megatron_tma import mcore
from megatron_tma.mcore import device_token_counts, experts_permutation

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (Python >= 3.12)")


def _shapes_handed(layer):
    shapes = []
    hook = layer.experts.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    return shapes, hook


@pytest.mark.parametrize("mode", ["unpadded", "padded16"])
def test_same_bits_as_megatrons_permutation(cuda_calls, mode):  # noqa: F811
    gpt = _gpt(mode)
    layer = gpt.decoder.layers[0].mlp
    megatrons = _step(layer)
    report = mcore.permute_in_experts(gpt)
    assert report == {"decoder.layers.0.mlp": None, "decoder.layers.1.mlp": None}
    assert all(m in layer.token_dispatcher.__dict__ for m in experts_permutation._METHODS)
    assert all(m in layer.token_dispatcher.__dict__ for m in device_token_counts._PATCHED)  # included
    cuda_calls.calls.clear()
    shapes, hook = _shapes_handed(layer)
    try:
        ours = _step(layer)
    finally:
        hook.remove()
    assert shapes == [(16 * 4, 256)]  # the tokens as they are, not the 128 permuted rows
    assert cuda_calls.calls == []  # and the counts stayed where preprocess made them
    assert layer.experts._pending_permutation is None  # consumed by the one forward
    assert torch.equal(ours[0], megatrons[0]) and torch.equal(ours[1], megatrons[1])
    assert ours[2].keys() == megatrons[2].keys() and len(ours[2]) > 0
    assert all(torch.equal(ours[2][k], megatrons[2][k]) for k in ours[2]), [
        k for k in ours[2] if not torch.equal(ours[2][k], megatrons[2][k])]

    assert set(mcore.permute_in_experts(gpt, enable=False).values()) == {"not enabled"}
    assert not any(m in layer.token_dispatcher.__dict__ for m in experts_permutation._METHODS)
    assert not any(m in layer.token_dispatcher.__dict__ for m in device_token_counts._PATCHED)
    assert torch.equal(_step(layer)[0], megatrons[0])


def test_twins_stay_equal_with_top4(cuda_calls):  # noqa: F811
    """At top-4 the combine's FP32 sum is not Megatron's BF16 one; the twins still agree bit for bit."""
    results = []
    for mode in ("unpadded", "padded16", "padded128"):
        gpt = _gpt(mode, experts=8, moe_router_topk=4)
        mcore.permute_in_experts(gpt)
        results.append(_step(gpt.decoder.layers[0].mlp))
    for other in results[1:]:
        assert torch.equal(results[0][0], other[0]) and torch.equal(results[0][1], other[1])
        assert all(torch.equal(results[0][2][k], other[2][k]) for k in results[0][2])


def test_refusals(cuda_calls):  # noqa: F811
    gpt = _gpt(experts=1, moe_apply_probs_on_input=True)
    got = mcore.permute_in_experts(gpt)
    assert all("moe_apply_probs_on_input" in r for r in got.values()) and len(got) == 2
    assert not any(m in gpt.decoder.layers[0].mlp.token_dispatcher.__dict__ for m in experts_permutation._METHODS)
    gpt = _gpt(mode=None)
    got = mcore.permute_in_experts(gpt)
    assert all("need the counts on the host" in r for r in got.values())
    gpt = _gpt(mode="bf16")  # refused, but its counts stay on the GPU
    got = mcore.permute_in_experts(gpt)
    assert all("BF16 experts read the permuted rows" in r for r in got.values())
    dispatcher = gpt.decoder.layers[0].mlp.token_dispatcher.__dict__
    assert not any(m in dispatcher for m in experts_permutation._METHODS)
    assert all(m in dispatcher for m in device_token_counts._PATCHED)


@pytest.mark.skipif(not __import__("megatron_tma")._ext.cuda_kernels_available(),
                    reason="needs an sm_90 GPU and the built extension")
@pytest.mark.parametrize("mode", ["unpadded", "padded16"])
def test_on_the_gpu_same_bits_and_no_sync(megatron_cpu, mode):
    """On the GPU with the kernels (the gather in the quantizer, the combine kernel): at top-2 the same bits as the
    same experts behind Megatron's own permutation (whose BF16 adds of two rows round as the combine's FP32 sum
    does), and no synchronizing call in forward or backward."""
    x = _input(device="cuda")  # made before the sync check: the host-to-device copy of its values syncs
    megatrons = _step(_gpt(mode, device="cuda").decoder.layers[0].mlp, x)
    gpt = _gpt(mode, device="cuda")
    assert set(mcore.permute_in_experts(gpt).values()) == {None}
    ours = _step_without_syncs(gpt.decoder.layers[0].mlp, x)
    assert torch.equal(ours[0], megatrons[0]) and torch.equal(ours[1], megatrons[1])
    assert ours[2].keys() == megatrons[2].keys() and len(ours[2]) > 0
    assert all(torch.equal(ours[2][k], megatrons[2][k]) for k in ours[2])
