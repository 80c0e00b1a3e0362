"""The recipe in an Apex environment (issue 56 item 5): megatron-core takes Apex's kernels where Transformer Engine is
absent, as NGC-style images carry them: its optimizer steps Apex's FusedAdam, the local layer spec's norms are
megatron-core's FusedLayerNorm on Apex's kernels (LayerNorm only, so the test trains with LayerNorm; an RMSNorm run gets
torch's RMSNorm there, Megatron-LM #1658), and `--gradient-accumulation-fusion` adds the dense layers' weight gradients
into the FP32 main_grad with Apex's `fused_weight_gradient_mlp_cuda`. Every mode in that environment: the twins bit
for bit and Megatron's own experts beside ours; the resume there is test_mcore_gpu's resume test (its `-apex` variants).

Skipped without Apex's compiled extensions (Apex built from source with its C++/CUDA extensions: the ones
megatron-core imports), without a Hopper GPU and the built extension, or without megatron-core. With TE also
installed, megatron-core prefers TE's FusedAdam, which the test then expects."""
import importlib.util

import pytest
from _recipe_runs import APEX_FUSION, apex_missing, recipe

from megatron_tma import _ext

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
pytestmark = [
    pytest.mark.recipe_run,
    pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(apex_missing() is not None, reason=f"Apex's extensions do not import ({apex_missing()})"),
]


def test_recipe_trains_every_mode_with_apex(tmp_path):
    steps = 12
    _, result = recipe(tmp_path, "--steps", str(steps), "--log-every", "4", "--normalization", "LayerNorm",
                       *APEX_FUSION)
    summary, records = result["summary"], result["records"]
    assert set(summary) == {"unpadded", "padded16", "padded128", "bf16", "megatron"}
    assert result["environment"]["apex"] and result["environment"]["apex_wgrad_fusion"], result["environment"]
    assert result["config"]["gradient_accumulation_fusion"] is True
    for mode in ("padded16", "padded128"):  # Apex's kernels around the experts are the same in every mode
        row = summary[mode]
        assert row["bitexact_losses"] and row["bitexact_grad_norms"] and row["bitexact_params"], mode
    assert all(row["same_initial_weights"] for row in summary.values())
    diffs = summary["megatron"]["experts_diff_vs_megatron"]  # ours against Megatron's SequentialMLP, same weights
    assert 0 <= diffs["bf16"] < 1e-4 and 0 < diffs["unpadded"] < 3e-3, diffs
    expected = "transformer_engine" if HAVE_TE else "apex.optimizers"  # megatron-core prefers TE's FusedAdam
    for mode, record in records.items():
        # the local spec's LayerNorms are megatron-core's FusedLayerNorm (Apex's kernels) wherever Apex imports (its LNImpl)
        norms = record["norm_classes"]
        assert "megatron.core.fusions.fused_layer_norm.FusedLayerNorm" in norms, (mode, norms)
        assert not any(c.startswith("torch.") for c in norms), (mode, norms)
        assert record["optimizer_class"].startswith(expected) and "FusedAdam" in record["optimizer_class"], record
    losses = [r["loss"] for r in result["rows"] if r["mode"] == "unpadded"]
    assert len(losses) == steps and summary["unpadded"]["final_window_mean_loss"] < losses[0]
