"""Transformer Engine and megatron_tma on the H200 (issue 33). Skipped without TE (an optional extra: `pip install -e
".[te]"`, or scripts/te_device_steps.md on the device machine), without a Hopper GPU and the built extension, and
(the recipe tests) without megatron-core.
* Our FP8 experts inside TE's FP8 context (`te.autocast` / Megatron's `fp8_autocast` with Float8BlockScaling) compute
  the same bits, forward and backward, as outside it: they quantize themselves and are no TE modules, so TE's
  autocast neither quantizes them again nor gives them scaling state.
* The recipe with `--transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe blockwise`: every mode from
  the same weights, unpadded == padded16 == padded128 bit for bit with TE's FP8 dense layers around them, our
  experts computing TEGroupedMLP's function, Megatron's optimizer on TE's FusedAdam, the experts' share measured."""
import importlib.util

import pytest
import torch
from _recipe_runs import recipe

from megatron_tma import _ext

te = pytest.importorskip("transformer_engine.pytorch")
from transformer_engine.common.recipe import Float8BlockScaling  # noqa: E402

from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP  # noqa: E402

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")
TE_FP8 = ["--transformer-impl", "transformer_engine", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
# on top of _recipe_runs.SMALL (later options win): top-4 and a shared expert (a TE MLP beside the experts)
TE_SIZE = ["--log-every", "4", "--topk", "4", "--shared-expert-ffn", "256"]


def te_fp8_contexts():
    """TE's FP8 contexts with DeepSeek-V3's recipe: `te.autocast` (TE 2.x) and `fp8_autocast` (what megatron-core
    0.19.2's get_fp8_context enters), where this TE has them."""
    contexts = []
    if hasattr(te, "autocast"):
        contexts.append(("autocast", lambda: te.autocast(enabled=True, recipe=Float8BlockScaling())))
    if hasattr(te, "fp8_autocast"):
        contexts.append(("fp8_autocast", lambda: te.fp8_autocast(enabled=True, fp8_recipe=Float8BlockScaling())))
    return contexts


def _step(module, x, sizes, probs):
    for p in module.parameters():
        p.grad = None
    if isinstance(module, GroupedFP8MLP):
        module.invalidate_weight_cache()  # quantize the weights again in this call (inside or outside the context)
    x = x.detach().requires_grad_()
    out, _ = module(x, sizes, probs)
    out.float().square().mean().backward()
    return [out.detach(), x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("cls,pad_to", [(GroupedFP8MLP, None), (GroupedFP8MLP, 16), (GroupedBF16MLP, None)])
def test_our_experts_compute_the_same_bits_inside_tes_fp8_context(cls, pad_to):
    ok, why = te.is_fp8_block_scaling_available(return_reason=True)
    if not ok:
        pytest.skip(f"TE's FP8 block scaling is not available: {why}")
    torch.manual_seed(0)
    kw = {"pad_to": pad_to} if cls is GroupedFP8MLP else {}
    module = cls(8, 512, 256, device="cuda", **kw)
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    assert not any(isinstance(m, TransformerEngineBaseModule) for m in module.modules())  # nothing TE would scale
    sizes = torch.tensor([300, 0, 17, 128, 1, 250, 64, 5], device="cuda")
    x = torch.randn(int(sizes.sum()), 512, device="cuda").bfloat16()
    probs = torch.rand(x.shape[0], device="cuda")
    outside = _step(module, x, sizes, probs)
    contexts = te_fp8_contexts()
    assert contexts, "this TE has neither te.autocast nor te.fp8_autocast"
    for name, context in contexts:
        with context():
            inside = _step(module, x, sizes, probs)
        for i, (a, b) in enumerate(zip(outside, inside)):
            assert torch.equal(a, b), (name, i)


def _recipe(tmp_path, *args):
    return recipe(tmp_path, *TE_SIZE, *args)[1]


@pytest.mark.recipe_run
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_recipe_with_transformer_engine_fp8_around_every_mode(tmp_path):
    steps = 8
    result = _recipe(tmp_path, *TE_FP8, "--steps", str(steps), "--experts-share-steps", "4",
                     "--modes", "unpadded", "padded16", "padded128", "bf16", "te")
    summary, records = result["summary"], result["records"]
    assert all(row["same_initial_weights"] for row in summary.values())  # te's TEGroupedMLP redrawn as ours
    for mode in ("padded16", "padded128"):  # the TE layers are the same in every mode: the twins stay bit for bit
        assert summary[mode]["bitexact_losses"] and summary[mode]["bitexact_grad_norms"], mode
        assert summary[mode]["bitexact_params"], mode
    diffs = summary["te"]["experts_diff_vs_megatron"]  # ours against TEGroupedMLP (TE FP8 blockwise), same weights
    assert 0 < diffs["bf16"] < 3e-3 and 0 < diffs["unpadded"] < diffs["bf16"] + 3e-3, diffs  # TE's noise + ours
    for mode, record in records.items():  # Megatron's default optimizer when TE is installed
        assert "transformer_engine" in record["optimizer_class"] and "FusedAdam" in record["optimizer_class"], record
        assert record["optimizer_steps_counted"] >= steps or mode in ("te", "bf16")  # our FP8 experts' signal
        assert all("eval_loss" in summary[m] for m in summary)
    for mode in summary:
        share = summary[mode]["experts_share_of_step"]
        assert 0 < share < 1, (mode, share)
    assert set(result["head_to_head"]) == {"unpadded_vs_te", "unpadded_vs_bf16"}


@pytest.mark.recipe_run
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_recipe_with_moe_permute_fusion_and_device_token_counts(tmp_path):
    """TE's fused permutation kernels in Megatron's dispatcher (--moe-permute-fusion, as a Megatron-LM run with TE
    usually has it) around every kind of experts, with our modes' token counts kept on the GPU: the twins stay bit
    for bit, and the counts stay on the GPU in every layer of ours (TEGroupedMLP needs them on the host)."""
    result = _recipe(tmp_path, *TE_FP8, "--steps", "6", "--moe-permute-fusion", "--device-token-counts",
                     "--modes", "unpadded", "padded16", "te")
    summary, records = result["summary"], result["records"]
    assert summary["padded16"]["bitexact_losses"] and summary["padded16"]["bitexact_params"]
    assert result["config"]["moe_permute_fusion"] is True
    for mode in ("unpadded", "padded16"):
        assert set(records[mode]["device_token_counts"].values()) == {None}, records[mode]
    assert all("need the counts on the host" in r for r in records["te"]["device_token_counts"].values())
