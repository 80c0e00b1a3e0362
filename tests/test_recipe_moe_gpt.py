"""recipes/moe_gpt.py's bookkeeping on the CPU: digests, the checks of summarize() (what makes the recipe fail), and
`--compare`, which merges runs made in separate processes (one per mode, for models too large to hold several).
The training itself runs on the GPU (tests/test_mcore_gpu.py). The bookkeeping needs no megatron-core (the recipe
imports it only for the GPU job); the test of that import does."""
import importlib.util
import json
import os
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed")


@pytest.fixture(scope="module")
def recipe():
    """The recipe's package (recipes/moe_gpt_recipe), every module of it imported (launch imports the others)."""
    import sys
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl).*")
    if os.path.join(ROOT, "recipes") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "recipes"))
    importlib.import_module("moe_gpt_recipe.launch")
    return importlib.import_module("moe_gpt_recipe")


def test_digests_see_bits_shape_and_dtype(recipe):
    a = torch.randn(4, 6, dtype=torch.bfloat16)
    b = a.clone()
    c = a.clone()
    c.view(torch.int16).view(-1)[5] += 1  # one element, one ulp
    d = recipe.training.digests([("w", a), ("v", b), ("c", c), ("t", a.t()), ("f", a.float()), ("r", a.reshape(6, 4))])
    assert d["w"] == d["v"] and d["w"] != d["c"]
    assert len({d["w"], d["t"], d["f"], d["r"]}) == 4  # transposed bits, another dtype, another shape


def _run(losses, norms, params="p", init="i", diffs=None, peak_mb=1000.0, evals=(2.5, 2.5)):
    return {"losses": list(losses), "grad_norms": list(norms), "times": [100.0] * len(losses),
            "init_digests": [{"w": init}], "param_digests": [{"w": params}], "experts_diff_vs_megatron": diffs,
            "peak_mb": peak_mb, "eval_loss": evals[0], "eval_loss_requantized": evals[1]}


def test_summarize_passes_equal_twins_and_fails_every_difference(recipe):
    base = dict(losses=[7.0, 5.0, 3.0], norms=[2.0, 1.0, 0.5])
    good = {"unpadded": _run(**base), "padded16": _run(**base), "bf16": _run([7.0, 5.1, 3.2], [2.0, 1.1, 0.6]),
            "megatron": _run([7.0, 5.1, 3.1], [2.0, 1.1, 0.6], diffs={"bf16": 8e-6, "unpadded": 2e-3})}
    report, failures = recipe.results.summarize(good)
    assert failures == []
    assert report["padded16"]["bitexact_losses"] and report["padded16"]["bitexact_params"]
    assert report["unpadded"]["final_window_gap_vs_bf16"] == pytest.approx(-0.2)
    assert report["unpadded"]["max_abs_loss_gap_vs_megatron"] == pytest.approx(0.1)
    bad = [
        ({"padded16": _run([7.0, 5.0, 3.0000001], base["norms"])}, "first differing step 2"),
        ({"padded16": _run(base["losses"], [2.0, 1.0, 0.50001])}, "grad norms equal: False"),
        ({"padded16": _run(**base, params="q")}, "parameters equal: False"),
        ({"padded16": _run(**base, init="j")}, "did not start from the first mode's weights"),
        ({"megatron": _run(**base, diffs={"bf16": 2e-4, "unpadded": 2e-3})}, "do not compute Megatron's experts"),
        ({"unpadded": _run(**base, evals=(2.5, 2.4999998))}, "with the FP8 weights re-quantized"),
    ]
    nondeterministic = {**good, "unpadded": {**_run(**base, evals=(2.5, 2.4999998)), "eval_exact": False}}
    assert recipe.results.summarize(nondeterministic)[1] == []  # atomics may move it: reported, not a failure
    for change, message in bad:
        _, failures = recipe.results.summarize({**good, **change})
        assert len(failures) == 1 and message in failures[0], (change, failures)


def _result(recipe, runs, modes, tmp_path, name, **config_change):
    config = {"steps": 3, "hidden": 1024, "modes": modes, **config_change}
    result = {"benchmark": "moe_gpt", "commit": "abc1234", "gpu": "NVIDIA H200", "date": "2026-11-29T23:00:00",
              "command": f"torchrun recipes/moe_gpt.py --modes {' '.join(modes)}", "world_size": 1,
              "loss_floor": 2.0, "config": config, "summary": {}, "failures": [],
              "rows": [{"mode": m, "step": i, "loss": l, "grad_norm": n, "ms": 100.0}
                       for m in modes for i, (l, n) in enumerate(zip(runs[m]["losses"], runs[m]["grad_norms"]))],
              "records": {m: {k: runs[m][k] for k in ("init_digests", "param_digests", "experts_diff_vs_megatron",
                                                       "peak_mb", "eval_loss", "eval_loss_requantized")}
                          for m in modes}}
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return str(path)


def test_compare_merges_processes_and_checks_them_as_one_run(recipe, tmp_path):
    base = dict(losses=[7.0, 5.0, 3.0], norms=[2.0, 1.0, 0.5])
    runs = {"unpadded": _run(**base, peak_mb=900.0), "padded16": _run(**base), "padded128": _run(**base, params="q")}
    a = _result(recipe, runs, ["unpadded"], tmp_path, "a.json")
    b = _result(recipe, runs, ["padded16"], tmp_path, "b.json")
    c = _result(recipe, runs, ["padded128"], tmp_path, "c.json")
    out = tmp_path / "merged"
    assert recipe.results.compare([a, b], str(out)) == 0
    (merged,) = [json.load(open(p)) for p in out.glob("moe_gpt-*.json")]
    assert merged["failures"] == [] and merged["config"]["modes"] == ["unpadded", "padded16"]
    assert merged["summary"]["padded16"]["bitexact_params"] and len(merged["rows"]) == 6
    assert merged["summary"]["unpadded"]["peak_mb"] == 900.0 and merged["summary"]["padded16"]["peak_mb"] == 1000.0
    assert recipe.results.compare([a, c], str(tmp_path / "merged2")) == 1  # padded128's parameters differ
    e = _result(recipe, {"padded128": _run(**base)}, ["padded128"], tmp_path, "e.json")
    merged = str(next(out.glob("moe_gpt-*.json")))
    assert recipe.results.compare([merged, e], str(tmp_path / "nested")) == 0  # of a merge
    (nested,) = [json.load(open(p)) for p in (tmp_path / "nested").glob("moe_gpt-*.json")]
    assert [m["command"] for m in nested["merged_from"]] == [
        "torchrun recipes/moe_gpt.py --modes unpadded", "torchrun recipes/moe_gpt.py --modes padded16",
        "torchrun recipes/moe_gpt.py --modes padded128"]
    d = _result(recipe, runs, ["padded16"], tmp_path, "d.json", hidden=2048)
    with pytest.raises(SystemExit, match="different settings"):
        recipe.results.compare([a, d], str(tmp_path / "merged3"))
    with pytest.raises(SystemExit, match="more than one result"):
        recipe.results.compare([a, a], str(tmp_path / "merged4"))


def test_step_time_is_the_median_of_the_second_half(recipe):
    # Megatron's own experts took ~15 steps to settle at DeepSeek-V3-like size (1190 -> 420 ms): warm-up is not speed
    run = _run([7.0] * 6, [1.0] * 6)
    run["times"] = [1190.0, 650.0, 580.0, 430.0, 420.0, 425.0]
    report, _ = recipe.results.summarize({"megatron": run})
    assert report["megatron"]["ms_per_step_median"] == 425.0


def test_same_bits_compares_two_runs_mode_by_mode(recipe, tmp_path, capsys):
    """`--same-bits A B`: an option that must not change the numbers (here: a config change) left every shared mode's
    initial weights, losses, grad norms and final parameters as they were; any one difference fails it."""
    base = dict(losses=[7.0, 5.0, 3.0], norms=[2.0, 1.0, 0.5])
    runs = {"unpadded": _run(**base), "bf16": _run([7.0, 5.1, 3.2], [2.0, 1.1, 0.6])}
    a = _result(recipe, runs, ["unpadded", "bf16"], tmp_path, "a.json")
    b = _result(recipe, {"unpadded": _run(**base)}, ["unpadded"], tmp_path, "b.json", recompute_modules=["moe_act"])
    assert recipe.results.same_bits(a, b) == 0 and "unpadded: 3 / 3 steps, the same bits" in capsys.readouterr().out
    for change, what in ((dict(params="q"), "param_digests"), (dict(init="j"), "init_digests"),
                         (dict(losses=[7.0, 5.0, 3.0000002]), "losses"), (dict(norms=[2.0, 1.0, 0.6]), "grad_norms")):
        c = _result(recipe, {"unpadded": _run(**{**base, **change})}, ["unpadded"], tmp_path, "c.json")
        assert recipe.results.same_bits(a, c) == 1 and f"differs: unpadded: {what}" in capsys.readouterr().out
    d = _result(recipe, {"padded16": _run(**base)}, ["padded16"], tmp_path, "d.json")
    with pytest.raises(SystemExit, match="no mode in common"):
        recipe.results.same_bits(a, d)


def test_recompute_options_are_megatrons_config_fields(recipe):
    settings = lambda *argv: recipe.model.recompute_settings(recipe.options.parse_args(list(argv)))  # noqa: E731
    assert settings() == {}
    assert settings("--recompute-modules", "moe_act", "core_attn") == dict(
        recompute_granularity="selective", recompute_modules=["moe_act", "core_attn"])
    assert settings("--recompute-full")["recompute_granularity"] == "full"
    with pytest.raises(SystemExit):  # one or the other
        recipe.options.parse_args(["--recompute-full", "--recompute-modules", "moe"])


def test_data_parallel_options_are_megatrons_config_fields(recipe):
    plain = recipe.model.ddp_settings(recipe.options.parse_args([]))
    assert plain == dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
                         overlap_param_gather=False)
    overlapped = recipe.model.ddp_settings(recipe.options.parse_args([
        "--distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "100000"]))
    assert overlapped == dict(grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
                              overlap_param_gather=True, bucket_size=100000)
    # Megatron-LM's own argument rules: the overlapped all-gather is the distributed optimizer's, after an
    # overlapped reduce-scatter
    for missing in (["--overlap-grad-reduce"], ["--distributed-optimizer"]):
        with pytest.raises(SystemExit):
            recipe.options.parse_args(["--overlap-param-gather", *missing])


def test_cuda_graph_options(recipe, capsys):
    """--cuda-graph-impl full_iteration: megatron_tma's modes from the graph, Megatron's own eager; refused where a
    step could not be captured (the dispatcher's host read of the counts) or is not tried yet, each in one line."""
    parse = recipe.options.parse_args
    args = parse(["--cuda-graph-impl", "full_iteration", "--permute-in-experts"])
    assert [m for m in args.modes if recipe.options.graphed(args, m)] == ["unpadded", "padded16", "padded128", "bf16"]
    assert not recipe.options.graphed(parse([]), "unpadded")
    assert parse(["--cuda-graph-impl", "full_iteration", "--device-token-counts"]).cuda_graph_warmup_steps == 2
    for bad, why in ((["--cuda-graph-impl", "full_iteration"], "add --device-token-counts or --permute-in-experts"),
                     (["--cuda-graph-impl", "full_iteration", "--permute-in-experts", "--defer-expert-wgrad"],
                      "does not take --defer-expert-wgrad yet"),
                     (["--cuda-graph-impl", "full_iteration", "--permute-in-experts", "--cuda-graph-warmup-steps",
                       "0"], "must be >= 1"),
                     (["--cuda-graph-impl", "full_iteration", "--permute-in-experts", "--steps", "2"],
                      "leaves no graphed step")):
        with pytest.raises(SystemExit) as e:
            parse(bad)
        assert e.value.code == 2 and why in capsys.readouterr().err, bad


def test_release_option_refuses_what_it_cannot_serve(recipe, capsys):
    """--release-bf16-expert-weights: only with the plain optimizer, eagerly, without the refreshed buffers; each
    refusal one line naming the other option."""
    parse = recipe.options.parse_args
    assert parse(["--release-bf16-expert-weights"]).release_bf16_expert_weights
    for other in (["--distributed-optimizer"], ["--step-refreshed-weights"],
                  ["--cuda-graph-impl", "full_iteration", "--permute-in-experts"]):
        with pytest.raises(SystemExit) as e:
            parse(["--release-bf16-expert-weights", *other])
        assert e.value.code == 2 and f"does not take {other[0]}" in capsys.readouterr().err, other


def test_graphed_vs_eager_head_to_head(recipe):
    run = lambda times, losses: {"times": times, "losses": losses, "grad_norms": [1.0] * len(losses),  # noqa: E731
                                 "param_digests": {"w": "x"}, "peak_mb": 10.0}
    row = recipe.results.graphed_vs_eager(run([9, 9, 2, 2], [3.0, 2.0, 1.0, 0.5]),
                                          run([9, 9, 3, 3], [3.0, 2.0, 1.0, 0.5]))
    assert row["speedup"] == 1.5 and row["bitexact"] and row["ms_per_step_median"] == {"graphed": 2, "eager": 3}
    assert not recipe.results.graphed_vs_eager(run([2, 2], [1.0, 0.4]), run([3, 3], [1.0, 0.5]))["bitexact"]


def test_head_to_head_names_the_held_bytes_that_differ(recipe):
    """The head-to-head carries, beside the peak ratio, which parts of the state held between steps differ (ours
    minus theirs, megatron_tma.mcore.held_memory's parts, MB); parts equal in both are left out."""
    def run(held, ms):
        return {"times": [ms] * 4, "losses": [1.0] * 4, "grad_norms": [1.0] * 4, "peak_mb": 100.0, "held_mb": held,
                "init_digests": [{"w": "x"}], "param_digests": [{"w": "y"}]}

    runs = {"unpadded": run({"expert_weights": 0.0, "expert_fp8_copies": 20.0, "expert_grads": 40.0}, 2),
            "bf16": run({"expert_weights": 20.0, "expert_fp8_copies": 0.0, "expert_grads": 40.0}, 3)}
    row = recipe.results.head_to_head(runs, recipe.results.summarize(runs)[0])["unpadded_vs_bf16"]
    assert row["held_mb_difference"] == {"expert_weights": -20.0, "expert_fp8_copies": 20.0}
    assert row["peak_ratio"] == 1.0 and row["speedup"] == 1.5


def test_virtual_pipeline_chunks_are_named_apart(recipe):
    """With --vpp every chunk's weights get their own prefix, so that digests of two chunks' equally named layers
    stay apart; a single chunk keeps Megatron's names. --vpp without pipeline stages is refused."""
    one, two = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert [n for n, _ in recipe.model.named_parameters([one])] == ["weight", "bias"]
    assert [n for n, _ in recipe.model.named_parameters([one, two])] == [
        "chunk0.weight", "chunk0.bias", "chunk1.weight", "chunk1.bias"]
    assert [n for n, _ in recipe.model.canonical_weights([one, two])][2:] == ["chunk1.weight", "chunk1.bias"]
    assert recipe.options.parse_args(["--pp", "2", "--vpp", "2"]).vpp == 2
    for bad in (["--vpp", "2"], ["--pp", "2", "--vpp", "0"]):
        with pytest.raises(SystemExit):
            recipe.options.parse_args(bad)


@needs_megatron
def test_megatron_is_imported_for_the_gpu_job_only(recipe):
    """The GPU job's megatron-core modules become attributes of the recipe's megatron_core module when preflight
    imports them (the CPU job, --plot, --compare and --same-bits never import megatron-core); every `mc.<name>` the
    recipe's modules read is one of them."""
    import glob
    import re

    mc = recipe.megatron_core
    assert mc.import_megatron() is None
    assert mc.GPTModel.__name__ == "GPTModel" and mc.parallel_state.__name__ == "megatron.core.parallel_state"
    for name in ("DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads",
                 "get_gpt_layer_local_spec", "OptimizerConfig", "get_megatron_optimizer", "get_forward_backward_func",
                 "get_cuda_rng_tracker", "get_expert_parallel_rng_tracker_name", "model_parallel_cuda_manual_seed",
                 "Float16Module", "TransformerConfig", "layer_spec_from_config"):
        assert callable(getattr(mc, name)), name
    read = {name for path in glob.glob(os.path.join(ROOT, "recipes", "moe_gpt_recipe", "*.py"))
            for name in re.findall(r"\bmc\.(\w+)", open(path).read())}
    assert "GPTModel" in read and [name for name in sorted(read) if not hasattr(mc, name)] == []


@needs_megatron
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_local_spec_chunks_end_in_their_layers_norm(recipe, megatron_cpu, monkeypatch, normalization):
    """Handed a layer spec, Megatron's TransformerBlock builds its final norm from its module's LayerNormImpl: Apex's
    FusedLayerNorm wherever Apex imports, which refuses RMSNorm (Megatron-LM issue #1658), so the recipe's RMSNorm
    model could not be built beside Apex. The recipe hands each local-spec chunk its layers' own norm as the final
    one; checked with LayerNormImpl replaced by a stand-in that refuses to be built, as FusedLayerNorm does."""
    import torch.nn.functional as F
    from megatron.core.transformer import transformer_block

    class RefusedNorm(torch.nn.Module):
        def __init__(self, config, *args, **kwargs):
            raise AssertionError(f"({config.normalization}) is not supported in this stand-in for FusedLayerNorm")

    monkeypatch.setattr(transformer_block, "LayerNormImpl", RefusedNorm)
    mc = recipe.megatron_core
    assert mc.import_megatron() is None
    args = recipe.options.parse_args(["--layers", "2", "--hidden", "128", "--heads", "4", "--experts", "4",
                                      "--expert-ffn", "128", "--qk-layernorm", "--normalization", normalization])
    config = mc.TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_moe_experts=4,
                                  moe_ffn_hidden_size=128, gated_linear_unit=True, activation_func=F.silu,
                                  add_bias_linear=False, normalization=normalization, qk_layernorm=True,
                                  moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
                                  perform_initialization=False, bf16=True, params_dtype=torch.bfloat16)
    layer_spec = recipe.model.base_layer_spec(args)
    build = lambda spec: mc.GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64,  # noqa: E731
                                     max_sequence_length=32)
    with pytest.raises(AssertionError, match="stand-in"):
        build(layer_spec)  # what the recipe built before: TransformerBlock's own pick of the final norm
    gpt = build(recipe.model.chunk_spec(args, config, layer_spec, None))
    norms = {type(gpt.decoder.final_layernorm), type(gpt.decoder.layers[1].input_layernorm)}
    expected = torch.nn.RMSNorm if normalization == "RMSNorm" else torch.nn.LayerNorm  # torch's, no Apex here
    assert norms == {expected} and len(gpt.decoder.layers) == 2
    assert recipe.model.norm_classes([gpt]) == sorted({f"torch.nn.modules.normalization.{expected.__name__}"})


def test_checkpoint_options_are_megatron_lms(recipe):
    """--save / --save-interval / --load / --dist-ckpt-optim-fully-reshardable as Megatron-LM names them, refused
    where they would do nothing."""
    args = recipe.options.parse_args(["--save", "d", "--save-interval", "5", "--distributed-optimizer",
                              "--dist-ckpt-optim-fully-reshardable"])
    assert (args.save, args.save_interval, recipe.checkpoints.optim_format(args)) == ("d", 5, "fully_reshardable")
    assert recipe.checkpoints.optim_format(recipe.options.parse_args([])) == "dp_reshardable"
    for bad in (["--save", "d"], ["--save-interval", "5"], ["--save", "d", "--save-interval", "0"],
                ["--dist-ckpt-optim-fully-reshardable"], ["--cpu", "--save", "d"]):
        with pytest.raises(SystemExit):
            recipe.options.parse_args(bad)


def test_checkpoint_tracker_names_the_newest_complete_checkpoint(tmp_path):
    from megatron_tma.mcore import checkpoint

    assert checkpoint.latest_iteration(str(tmp_path)) is None  # nothing saved: train from scratch
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12")
    assert checkpoint.latest_iteration(str(tmp_path)) == 12
    assert checkpoint.checkpoint_dir(str(tmp_path), 12) == str(tmp_path / "iter_0000012")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ValueError, match="not an iteration number"):
        checkpoint.latest_iteration(str(tmp_path))


def test_tokens_per_second_per_gpu(recipe):
    """The step's tokens over every data-parallel rank (world size / pipeline stages of them) per second of the median
    step time, per GPU: what scaling runs compare across expert-parallel sizes."""
    run = _run([7.0] * 4, [1.0] * 4)
    run["times"] = [900.0, 800.0, 500.0, 500.0]  # median of the second half: 500 ms
    report, _ = recipe.results.summarize({"unpadded": run})
    config = {"micro_batches": 2, "micro_batch_size": 4, "seq_len": 1024, "pp": 2}
    recipe.results.add_throughput(report, config, world=8)
    # 4 data-parallel ranks x 2 x 4 x 1024 tokens = 32768 per step, in 0.5 s, over 8 GPUs
    assert report["unpadded"]["tokens_per_s_per_gpu"] == 8192.0
    bare = recipe.results.summarize({"unpadded": run})[0]
    recipe.results.add_throughput(bare, {"steps": 3}, world=1)  # a result without the batch settings: nothing made up
    assert "tokens_per_s_per_gpu" not in bare["unpadded"]


@pytest.mark.parametrize("nproc", [4, 8])
def test_scaling_runs_are_valid_recipe_runs(recipe, nproc):
    """scripts/recipe_scaling.sh (issue 27's expert-parallel runs): every run's arguments parse as the recipe's, and
    each parallel layout fits NPROC GPUs as Megatron lays it out (EP x ETP x PP <= N, EP dividing the data-parallel
    ranks, layers split evenly over the stages)."""
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "recipe_scaling.sh"), str(nproc), "unused"],
                         env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == [f"ep{nproc}", f"ep{nproc}-distopt", f"ep{nproc // 2}-pp2",
                                                   f"ep{nproc // 2}-etp2"]
    for line in lines:
        args = recipe.options.parse_args(line.split()[1:])
        assert args.topk == 8 and args.experts == 64 and args.experts % args.ep == 0
        assert args.ep * args.etp * args.pp <= nproc and (nproc // args.pp) % (args.ep * args.etp) == 0
        assert args.layers % args.pp == 0 and "unpadded" in args.modes and "padded16" in args.modes


# --------------------------------------------------------------------------------------------------------------
# Issue 55 item 5: the files of a save directory (megatron_tma.mcore.checkpoint; both jobs write through it)
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, rule", [
    (b"\xff\xfe1\x002\x00", "not ASCII"),  # UTF-16, as an editor may save it
    ("\u00b3".encode(), "not ASCII"),  # '³': str.isdigit() takes it, int() does not
    ("1\u0663".encode(), "not ASCII"),  # an Arabic-Indic 3, which int() takes
    (b"12 13", "not an iteration number"),
    (b"", "not an iteration number"),
    (b"1" * 5000, "more than 4096 bytes"),
])
def test_a_tracker_breaking_its_rule_is_one_line_naming_it(tmp_path, content, rule):
    """Issue 55 item 5: a tracker with non-UTF-8 bytes or a non-ASCII digit ended in a UnicodeDecodeError or an int()
    traceback that named no file."""
    from megatron_tma.mcore import checkpoint

    tracker = tmp_path / checkpoint.TRACKER_FILE
    tracker.write_bytes(content)
    with pytest.raises(checkpoint.CheckpointFileError) as e:
        checkpoint.latest_iteration(str(tmp_path))
    text = str(e.value)
    assert "\n" not in text and str(tracker) in text and rule in text and "ASCII digits" in text, text
    assert isinstance(e.value, ValueError)  # what latest_iteration raised for a bad tracker before


def test_a_tracker_that_is_a_directory_is_one_line_naming_it(tmp_path):
    from megatron_tma.mcore import checkpoint

    (tmp_path / checkpoint.TRACKER_FILE).mkdir()
    with pytest.raises(checkpoint.CheckpointFileError, match=r"latest_checkpointed_iteration\.txt cannot be read "
                                                             r"\(IsADirectoryError.*it must be a file holding") as e:
        checkpoint.latest_iteration(str(tmp_path))
    assert "\n" not in str(e.value)


def test_the_tracker_is_never_written_through_a_link(tmp_path):
    """Issue 55 item 5: the tracker went through a fixed `<tracker>.tmp` opened with open(..., "w"), which follows a
    symlink planted under that name: a save wrote a file outside the save directory. Links planted at the old
    temporary name and at the tracker's own name are left alone / replaced, never written through."""
    from megatron_tma.mcore import checkpoint

    save = tmp_path / "save"
    save.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    tracker = save / checkpoint.TRACKER_FILE
    os.symlink(outside, str(tracker) + ".tmp")
    checkpoint.write_tracker(str(save), 7)
    assert outside.read_text() == "precious"
    assert not tracker.is_symlink() and tracker.read_text() == "7"
    os.unlink(tracker)
    os.symlink(outside, tracker)  # the tracker itself a link: the link is replaced, the target untouched
    checkpoint.write_tracker(str(save), 8)
    assert outside.read_text() == "precious" and not tracker.is_symlink() and tracker.read_text() == "8"
    umask = os.umask(0)
    os.umask(umask)
    assert tracker.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as any file, not mkstemp's 0600
    # nothing left behind but the planted link (unique temporary names, renamed away)
    assert sorted(p.name for p in save.iterdir()) == sorted([checkpoint.TRACKER_FILE, checkpoint.TRACKER_FILE + ".tmp"])


def test_an_iteration_directory_planted_as_a_link_is_replaced_not_followed(tmp_path):
    from megatron_tma.mcore import checkpoint

    save, elsewhere = tmp_path / "save", tmp_path / "elsewhere"
    save.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    os.symlink(elsewhere, save / "iter_0000003")
    path = checkpoint.fresh_iteration_dir(str(save), 3)
    assert os.path.isdir(path) and not os.path.islink(path) and os.listdir(path) == []
    assert (elsewhere / "keep").read_text() == "x"


def test_one_job_saves_into_a_directory_at_a_time(tmp_path, another_job_saving):
    """Issue 55 item 5: a second job saving into the same directory took the first one's half-written iteration for a
    killed run's leftovers and deleted it. Whoever holds the directory's lock (the first job) saves; the second is
    refused in one line naming the directory and the holder's pid, and deletes nothing."""
    from megatron_tma.mcore import checkpoint

    save = tmp_path / "save"
    holder = another_job_saving(save)
    (save / "iter_0000004").mkdir()
    (save / "iter_0000004" / "half-written").write_text("the other job's")
    for attempt in (lambda: checkpoint.hold_save_lock(str(save)),
                    lambda: checkpoint.fresh_iteration_dir(str(save), 4)):
        with pytest.raises(checkpoint.SaveDirLocked) as e:
            attempt()
        text = str(e.value)
        assert "\n" not in text and str(save) in text and f"pid {holder.pid}" in text, text
    assert (save / "iter_0000004" / "half-written").read_text() == "the other job's"
    holder.kill()  # the kernel releases a killed holder's lock: no stale lock
    holder.wait()
    with checkpoint.save_lock(str(save)):
        assert (save / checkpoint.LOCK_FILE).read_text().strip() == str(os.getpid())
        checkpoint.hold_save_lock(str(save))  # again in the holding process: nothing
        path = checkpoint.fresh_iteration_dir(str(save), 4)  # a dead job's leftovers now: removed
        assert os.listdir(path) == []
    another_job_saving(save).kill()  # released at the end of the with block: another process takes it
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(tmp_path / "outside.lock", other / checkpoint.LOCK_FILE)  # a link at the lock's name: not followed
    with pytest.raises(checkpoint.CheckpointFileError, match=r"\.megatron_tma_save\.lock cannot be opened .*a link "
                                                             "there is never followed"):
        checkpoint.hold_save_lock(str(other))
    assert not (tmp_path / "outside.lock").exists()
