"""Megatron-core end to end on the H200: `recipes/moe_gpt.py` under torchrun, a small MoE GPT trained with each
experts mode through Megatron's DDP, mixed-precision Adam and schedule. The unpadded FP8 experts must train exactly
like their padded twins (every step's loss and grad norm, every parameter at the end: bit for bit), every mode must
start from the same weights, and the FP8 loss curve must fall and stay near the BF16 ones (megatron_tma's BF16
experts and Megatron's own SequentialMLP, whose function megatron_tma's experts compute). Skipped without a Hopper
GPU + extension, or without megatron-core (the device session installs it from the carried wheel)."""
import glob
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from _recipe_runs import APEX_FUSION, ROOT, apex_missing, killed_run, recipe

from megatron_tma import _ext

pytestmark = [
    pytest.mark.recipe_run,
    pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]


def _assert_same_bits(a, b, modes, context=""):
    """`recipes/moe_gpt.py --same-bits A B`: the two results trained the same bits (every step's loss and grad norm,
    every final parameter) in each of their `modes` shared modes."""
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "moe_gpt.py"), "--same-bits", a, b]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.count("the same bits") == modes, (context, run.stdout + run.stderr)


def test_recipe_with_overlapped_gradient_reduction(tmp_path):
    """Megatron DDP's overlap_grad_reduce: its hooks require a gradient per weight (the experts hand a dummy)."""
    _, result = recipe(tmp_path, "--steps", "8", "--overlap-grad-reduce", "--modes", "unpadded", "padded16")
    row = result["summary"]["padded16"]
    assert row["bitexact_losses"] and row["bitexact_grad_norms"] and row["bitexact_params"]


def test_recipe_with_megatrons_recompute_trains_the_same_bits(tmp_path):
    """Megatron's recompute options change memory, not numbers: `moe_act` (the FP8 experts recompute their
    activation in backward), `moe` (the whole MoE layer under Megatron's checkpoint: the experts' forward runs once
    without autograd, then again in backward) and full recompute (every layer). Every training run (losses, grad
    norms, final parameters) is the same bits as without recompute."""
    args = ("--steps", "8", "--modes", "unpadded", "padded16")
    plain, _ = recipe(tmp_path / "plain", *args)
    for name, option in (("moe_act", ("--recompute-modules", "moe_act")), ("moe", ("--recompute-modules", "moe")),
                         ("full", ("--recompute-full",)),
                         # not recomputes, the same promise: W^T made in each backward instead of kept; the FP8
                         # copies in fixed buffers refreshed on the device after each step
                         ("transposed", ("--transpose-weights-in-backward",)),
                         ("refreshed", ("--step-refreshed-weights",))):
        path, result = recipe(tmp_path / name, *args, *option)
        assert result["summary"]["padded16"]["bitexact_params"], name
        _assert_same_bits(plain, path, 2, name)


def test_recipe_with_released_bf16_expert_weights(tmp_path):
    """--release-bf16-expert-weights (megatron_tma.released_weights) under Megatron's own mixed-precision optimizer
    (ChainedOptimizer of Float16OptimizerWithFloat16Params, the BF16 expert weights freed from each step's first
    forward to its copy of the FP32 main params) over 3 micro-batches: the same training bits as without, in both
    modes, and no more peak memory (the peak may lie at the optimizer step, where both hold the BF16 weights)."""
    args = ("--steps", "6", "--micro-batches", "3", "--modes", "unpadded", "padded16")
    plain, plain_result = recipe(tmp_path / "plain", *args)
    path, result = recipe(tmp_path / "released", *args, "--release-bf16-expert-weights")
    assert result["summary"]["padded16"]["bitexact_params"]
    _assert_same_bits(plain, path, 2, "released")
    for mode in ("unpadded", "padded16"):
        assert result["summary"][mode]["peak_mb"] <= plain_result["summary"][mode]["peak_mb"], mode


@pytest.mark.parametrize("overlap", [False, True])
def test_recipe_with_deferred_expert_wgrads(tmp_path, overlap):
    """--defer-expert-wgrad: the experts' weight gradients of 3 micro-batches in one GEMM per linear in the last
    micro-batch's backward, with DDP's reduction overlapped or not; the twins still train bit for bit, both ways give
    the same bits (the same GEMM, only the reduction's timing differs), and the run learns."""
    args = ("--steps", "8", "--micro-batches", "3", "--defer-expert-wgrad", "--modes", "unpadded", "padded16")
    path, result = recipe(tmp_path / "a", *args, *(("--overlap-grad-reduce",) if overlap else ()))
    row = result["summary"]["padded16"]
    assert row["bitexact_losses"] and row["bitexact_grad_norms"] and row["bitexact_params"]
    losses = [r["loss"] for r in result["rows"] if r["mode"] == "unpadded"]
    assert losses[-1] < losses[0]
    if overlap:
        plain, _ = recipe(tmp_path / "b", *args)
        _assert_same_bits(plain, path, 2, "overlapped")


@pytest.mark.parametrize("refreshed", [False, True], ids=["requantized", "step-refreshed"])
def test_recipe_from_the_full_iteration_cuda_graph(tmp_path, refreshed):
    """--cuda-graph-impl full_iteration (issue 53): megatron_tma's modes train from Megatron's full-iteration CUDA
    graph, dropless, the counts on the GPU and the experts permuting their own tokens; the unpadded graph trains the
    eager run's bits (the head-to-head run in the same job: every loss, grad norm and final parameter), the twins
    stay bit for bit, and the FP8 weight copies are right after every step (the evaluation with them re-made agrees:
    summarize's check), re-quantized in every replay or, with --step-refreshed-weights, once a step."""
    args = ["--steps", "8", "--micro-batches", "3", "--modes", "unpadded", "padded16", "--permute-in-experts",
            "--cuda-graph-impl", "full_iteration", *(["--step-refreshed-weights"] if refreshed else [])]
    _, result = recipe(tmp_path, *args)
    assert result["config"]["cuda_graph_impl"] == "full_iteration"
    assert all(record["cuda_graph"] == "full_iteration" for record in result["records"].values())
    row = result["summary"]["padded16"]
    assert row["bitexact_losses"] and row["bitexact_grad_norms"] and row["bitexact_params"]
    head = result["head_to_head"]["graphed_vs_eager"]
    assert head["bitexact"], head
    losses = [r["loss"] for r in result["rows"] if r["mode"] == "unpadded"]
    assert losses[-1] < losses[0]


def test_recipe_with_token_counts_on_the_gpu_trains_the_same_bits(tmp_path):
    """--device-token-counts (Megatron's all-to-all dispatcher without its host copy, sync and identity sorts in
    every MoE layer of megatron_tma's modes): the same training bits as without it, in every mode, and the result
    names each layer it took; Megatron's own experts keep the host counts, with the reason recorded."""
    args = ("--steps", "8", "--modes", "unpadded", "bf16", "megatron")
    plain, _ = recipe(tmp_path / "plain", *args)
    path, result = recipe(tmp_path / "device", *args, "--device-token-counts")
    for mode in ("unpadded", "bf16"):
        layers = result["records"][mode]["device_token_counts"]
        assert len(layers) == 2 and all(reason is None for reason in layers.values()), (mode, layers)
    megatrons = result["records"]["megatron"]["device_token_counts"].values()
    assert len(megatrons) == 2 and all("need the counts on the host" in r for r in megatrons)
    _assert_same_bits(plain, path, 3)


def test_recipe_with_experts_permuting_their_tokens_trains_the_same_bits(tmp_path):
    """--permute-in-experts (the experts gather their rows inside their quantizers and combine their output rows
    per token; Megatron's permuted BF16 copies never made): at the recipe's top-2, where Megatron's torch
    un-permutation adds two BF16 rows exactly, the same training bits as Megatron's permutation in our FP8 modes, the
    twins still equal to each other; the BF16 experts are refused (their counts still stay on the GPU)."""
    args = ("--steps", "8", "--modes", "unpadded", "padded16", "bf16")
    plain, _ = recipe(tmp_path / "plain", *args)
    path, result = recipe(tmp_path / "permuted", *args, "--permute-in-experts")
    for mode in ("unpadded", "padded16"):
        layers = result["records"][mode]["device_token_counts"]
        assert len(layers) == 2 and all(reason is None for reason in layers.values()), (mode, layers)
    bf16 = result["records"]["bf16"]["device_token_counts"].values()
    assert len(bf16) == 2 and all("BF16 experts" in reason for reason in bf16), bf16
    assert result["summary"]["padded16"]["bitexact_params"]
    _assert_same_bits(plain, path, 3)


HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
TE_FP8 = ("--transformer-impl", "transformer_engine", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise")


@pytest.mark.parametrize("optimizer", ["plain", "distributed", "distributed-fully-reshardable", "plain-te",
                                       "distributed-te", "plain-apex", "distributed-apex", "plain-released",
                                       "plain-graphed"])
def test_recipe_resumes_bit_exact_after_a_kill(tmp_path, optimizer):
    """Issue 26 item 2: save during training, kill, resume: the resumed run trains the same bits as an uninterrupted
    one, for Megatron's mixed-precision optimizer and for its distributed optimizer in both its checkpoint formats
    (dp_reshardable, fully_reshardable). The first run is killed (SIGKILL on every rank) in mode unpadded after
    step 7 of 10, so its checkpoint at step 6 counts and mode padded16 never started. The resumed run continues
    unpadded from step 6 and trains padded16 from scratch, uninterrupted, in the same process; the recipe's own check
    that every step's loss and grad norm and every final parameter of unpadded equal padded16's bit for bit is then
    the check that the resumed run equals the uninterrupted one (unpadded == padded16 uninterrupted: every other
    recipe test). One process per run (~1 min each on the H200), so no third, uninterrupted unpadded run."""
    # -te: with TE's layer spec and FP8 around the experts (issue 33); where TE is installed Megatron's optimizer
    # steps TE's FusedAdam (in every variant), whose step sits in the param groups: the torch-Adam guards of
    # megatron_tma.mcore.checkpoint stay off
    # -apex: in an Apex environment (test_apex_gpu.py), with --gradient-accumulation-fusion: Apex's FusedAdam (where
    # TE is absent), its step in the param groups, and the dense layers' fused main_grad accumulation
    if optimizer.endswith("-te") and not HAVE_TE:
        pytest.skip("Transformer Engine is not installed")
    if optimizer.endswith("-apex") and apex_missing():
        pytest.skip(f"Apex's extensions do not import ({apex_missing()})")
    opts = {"plain": (), "distributed": ("--distributed-optimizer",),
            "distributed-fully-reshardable": ("--distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"),
            "plain-te": TE_FP8, "distributed-te": ("--distributed-optimizer", *TE_FP8),
            "plain-apex": APEX_FUSION, "distributed-apex": ("--distributed-optimizer", *APEX_FUSION),
            # the experts' BF16 weights released, their FP8 copies written from the masters (issue 54): the checkpoint
            # writes the weights back from the masters, the resumed run quantizes them and releases them again
            "plain-released": ("--release-bf16-expert-weights",),
            # from Megatron's full-iteration CUDA graph (issue 53): the graph-safe RNG trackers' states round trip as
            # bytes; the resumed run warms up eagerly and captures again; its eager twin resumes from the same save
            "plain-graphed": ("--permute-in-experts", "--cuda-graph-impl", "full_iteration")}
    common = ("--steps", "10", "--modes", "unpadded", "padded16", *opts[optimizer])
    ckpt = tmp_path / "ckpt"
    rc, stdout, stderr = killed_run(tmp_path, *common, "--save", str(ckpt), "--save-interval", "3", kill_after_step=7)
    assert rc != 0 and "killed after step 6" in stdout, stdout[-3000:] + stderr[-3000:]
    assert not glob.glob(str(tmp_path / "killed" / "moe_gpt-*.json"))  # it died before writing a result
    assert (ckpt / "unpadded" / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert not (ckpt / "padded16").exists()
    _, result = recipe(tmp_path / "resumed", *common, "--load", str(ckpt))
    assert result["records"]["unpadded"]["resumed_from_step"] == 6
    assert result["records"]["padded16"]["resumed_from_step"] == 0
    if optimizer.endswith("-apex") and not HAVE_TE:  # megatron-core prefers TE's FusedAdam where TE imports
        assert result["records"]["unpadded"]["optimizer_class"] == "apex.optimizers.fused_adam.FusedAdam", result
    row = result["summary"]["padded16"]
    assert row["same_initial_weights"]  # the initial weights' digests come back with the checkpoint's records
    assert row["bitexact_losses"] and row["bitexact_grad_norms"] and row["bitexact_params"]
    if optimizer == "plain-graphed":
        assert result["head_to_head"]["graphed_vs_eager"]["bitexact"], result["head_to_head"]


def _check_parallel_run(summary):
    """The checks of a parallel recipe run of modes unpadded, padded16 and megatron: the same initial weights in
    every mode, unpadded == padded16 bit for bit, megatron_tma's experts computing Megatron's experts' function, and
    an evaluation after the last step in every mode (the recipe fails itself if it ran on stale FP8 copies)."""
    assert all(row["same_initial_weights"] for row in summary.values())
    assert summary["padded16"]["bitexact_losses"] and summary["padded16"]["bitexact_params"]
    diffs = summary["megatron"]["experts_diff_vs_megatron"]
    assert 0 <= diffs["bf16"] < 1e-4 and 0 < diffs["unpadded"] < 3e-3, diffs
    assert all("eval_loss" in row for row in summary.values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert tensor parallelism over 2 GPUs needs 2 GPUs")
def test_recipe_with_expert_tensor_parallelism(tmp_path):
    """Every expert split over 2 GPUs (ETP = 2; Megatron's dispatcher gathers the tokens and adds up the partial
    outputs): unpadded == padded16 bit for bit, the same initial weights as Megatron's own experts at ETP = 2, and
    megatron_tma's experts compute their function (the first layer's shards on the same routed tokens)."""
    _, result = recipe(tmp_path, "--steps", "8", "--etp", "2", "--modes", "unpadded", "padded16", "megatron", gpus=2)
    _check_parallel_run(result["summary"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two pipeline stages need 2 GPUs")
def test_recipe_with_pipeline_parallelism(tmp_path):
    """Two pipeline stages (Megatron's 1F1B schedule; 4 micro-batches, so the first stage runs a warm-up forward
    before its first backward, and the experts see forwards with DDP's flag still False): unpadded == padded16 bit
    for bit, the same initial weights in every mode, megatron_tma's experts compute Megatron's experts' function on
    each stage, and the evaluation after the last step runs on the stepped weights."""
    _, result = recipe(tmp_path, "--steps", "8", "--pp", "2", "--micro-batches", "4", "--modes", "unpadded",
                        "padded16", "megatron", gpus=2)
    _check_parallel_run(result["summary"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two pipeline stages need 2 GPUs")
def test_recipe_with_interleaved_pipeline(tmp_path):
    """Two pipeline stages of two model chunks each (Megatron's interleaved 1F1B, 4 layers, 4 micro-batches): each
    chunk's experts see warm-up forwards of several micro-batches before their first backward, interleaved with the
    other chunk's. Unpadded == padded16 bit for bit, the same initial weights in every mode (Megatron's experts
    redrawn chunk by chunk), megatron_tma's experts compute Megatron's experts' function, and the evaluation after
    the last step runs on the stepped weights."""
    _, result = recipe(tmp_path, "--steps", "8", "--layers", "4", "--pp", "2", "--vpp", "2", "--micro-batches", "4",
                        "--modes", "unpadded", "padded16", "megatron", gpus=2)
    _check_parallel_run(result["summary"])


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="a distributed optimizer over 2 data-parallel ranks needs 2 GPUs")
def test_recipe_with_distributed_optimizer_and_overlapped_param_gather(tmp_path):
    """Megatron's distributed optimizer over 2 data-parallel ranks with the experts replicated (EP = 1): each rank
    updates half of every expert weight and all-gathers the other half. Unpadded == padded16 bit for bit; and with
    the all-gather overlapped with the next forward (buckets of 100K elements, so every stacked expert weight has a
    bucket of its own whose all-gather the owning module's forward pre-hook waits for) the same bits again: the FP8
    experts quantize their weights only after that wait. Read before it, a rank would quantize the other rank's
    half as it was before the step, and the two runs would part after the first step."""
    common = ("--steps", "8", "--ep", "1", "--modes", "unpadded", "padded16", "--distributed-optimizer",
              "--overlap-grad-reduce", "--ddp-bucket-size", "100000")
    synced, result = recipe(tmp_path / "synced", *common, gpus=2)
    overlapped, result_overlapped = recipe(tmp_path / "overlapped", *common, "--overlap-param-gather", gpus=2)
    for r in (result, result_overlapped):
        row = r["summary"]["padded16"]
        assert row["bitexact_losses"] and row["bitexact_grad_norms"] and row["bitexact_params"]
        assert all("eval_loss" in row for row in r["summary"].values())
    _assert_same_bits(synced, overlapped, 2)


def test_recipe_frees_each_modes_model_before_the_next(tmp_path):
    """A finished mode's model (DDP wrapper and buffers, GPTModel, FP8 weight copies, optimizer states: over 100 MB
    here) is freed before the next mode is built. The first mode leaves library workspaces (cuBLAS's, ...) and
    Megatron's global buffer for the local attention's scores behind; after it, nothing more stays allocated."""
    _, result = recipe(tmp_path, "--steps", "2", "--expert-ffn", "1024", "--modes", "unpadded", "padded16", "bf16")
    summary = result["summary"]
    assert all(row["peak_mb"] > 100 for row in summary.values()), summary  # what a kept model would leave
    for mode in ("padded16", "bf16"):
        assert abs(summary[mode]["left_allocated_mb"]) < 16, (mode, summary[mode])


def test_recipe_unpadded_trains_bit_exactly_like_padded(tmp_path):
    steps = 24
    path, result = recipe(tmp_path, "--steps", str(steps))
    summary = result["summary"]
    assert set(summary) == {"unpadded", "padded16", "padded128", "bf16", "megatron"}
    assert all(row["same_initial_weights"] for row in summary.values())
    diffs = summary["megatron"]["experts_diff_vs_megatron"]
    assert 0 <= diffs["bf16"] < 1e-4 and 0 < diffs["unpadded"] < 3e-3, diffs
    for mode in ("padded16", "padded128"):
        assert summary[mode]["bitexact_losses"] and summary[mode]["bitexact_grad_norms"]
        assert summary[mode]["bitexact_params"]
    losses = {m: [r["loss"] for r in result["rows"] if r["mode"] == m] for m in summary}
    assert all(len(v) == steps for v in losses.values())
    first, last = losses["unpadded"][0], summary["unpadded"]["final_window_mean_loss"]
    assert last < first - 0.2, f"the FP8 run did not learn: {first:.3f} -> {last:.3f}"
    for ref in ("bf16", "megatron"):  # megatron_tma's BF16 experts, and Megatron's own (SequentialMLP)
        gap = abs(summary["unpadded"][f"final_window_gap_vs_{ref}"])
        assert gap < 0.02 * last, f"FP8 experts' loss {last:.4f} is {gap:.4f} from the {ref} experts' one"
    # megatron_tma's BF16 experts compute what Megatron's own experts compute (same weights, same data)
    assert abs(summary["bf16"]["final_window_gap_vs_megatron"]) < 0.01 * last
    assert os.path.exists(path[:-5] + ".png")
    # Megatron's optimizer steps a torch optimizer, which the experts' hook counts (their signal for evaluation);
    # the evaluation after the last step ran on the stepped weights (summarize() would have failed otherwise)
    assert all(result["records"][m]["optimizer_steps_counted"] >= steps for m in summary if m != "megatron")
    assert all("eval_loss" in summary[m] for m in summary)
