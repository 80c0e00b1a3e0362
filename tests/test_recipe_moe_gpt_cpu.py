"""recipes/moe_gpt.py's CPU job (`--cpu`, recipes/moe_gpt_cpu.py) end to end at a tiny size, and the one-line errors
the recipe stops with, before any distributed set-up, when a piece is missing. No GPU and no megatron-core needed."""
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "moe_gpt.py")
# seconds, not minutes: one layer, 2 micro-batches of 2 sequences of 32 tokens, 3 steps per mode
TINY = ["--cpu", "--steps", "3", "--layers", "1", "--seq-len", "32", "--micro-batch-size", "2", "--micro-batches", "2",
        "--vocab", "64", "--log-every", "1"]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed (the test extra has it)")


@pytest.fixture(scope="module")
def recipe():
    """The recipe's package (recipes/moe_gpt_recipe), every module of it imported (launch imports the others)."""
    if os.path.join(ROOT, "recipes") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "recipes"))
    importlib.import_module("moe_gpt_recipe.launch")
    return importlib.import_module("moe_gpt_recipe")


@pytest.fixture
def torch_settings():
    """The CPU job turns on torch's deterministic algorithms and sets the thread count, process-wide: put them back
    after an in-process run."""
    on, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill, threads = torch.utils.deterministic.fill_uninitialized_memory, torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(on, warn_only=warn)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The CPU job as a user runs it: torchrun, one process, at the tiny size."""
    out = tmp_path_factory.mktemp("cpu_job")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", RECIPE, *TINY,
           "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return run, out


@needs_matplotlib
def test_cpu_job_trains_the_twins_bit_for_bit_and_draws_the_plot(cpu_run):
    run, out = cpu_run
    assert run.returncode == 0, f"rc {run.returncode}:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert "bit for bit: unpadded == padded16 == padded128" in run.stdout
    (path,) = glob.glob(str(out / "moe_gpt-*.json"))
    result = json.load(open(path))
    assert result["failures"] == [] and result["config"]["cpu"] and result["gpu"] == "none (CPU job)"
    assert list(result["summary"]) == ["unpadded", "padded16", "padded128", "bf16"]
    for mode in ("padded16", "padded128"):
        row = result["summary"][mode]
        assert row["same_initial_weights"] and row["bitexact_losses"] and row["bitexact_grad_norms"]
        assert row["bitexact_params"] and row["eval_loss"] == row["eval_loss_requantized"]
    assert len(result["rows"]) == 4 * 3 and result["loss_floor"] > 0
    unpadded = [r["loss"] for r in result["rows"] if r["mode"] == "unpadded"]
    bf16 = [r["loss"] for r in result["rows"] if r["mode"] == "bf16"]
    assert unpadded != bf16 and abs(unpadded[-1] - bf16[-1]) < 0.05  # FP8 is not BF16, but close to it
    assert os.path.getsize(path[:-len(".json")] + ".png") > 10000


@needs_matplotlib
def test_cpu_job_fails_when_a_twin_differs_by_one_ulp(recipe, torch_settings, tmp_path, monkeypatch, capsys):
    """The checks are live on the CPU: padded16's output moved by one BF16 ulp in one row -> exit status 1."""
    from megatron_tma.mlp import GroupedFP8MLP

    forward = GroupedFP8MLP.forward

    def off_by_one_ulp(self, *args, **kwargs):
        out, bias = forward(self, *args, **kwargs)
        if self.pad_to == 16:
            out = torch.cat([(out[:1].view(torch.int16) + 1).view(torch.bfloat16), out[1:]])
        return out, bias

    monkeypatch.setattr(GroupedFP8MLP, "forward", off_by_one_ulp)
    argv = [*TINY, "--steps", "2", "--modes", "unpadded", "padded16", "--out", str(tmp_path)]
    assert recipe.launch.main(argv) == 1
    out = capsys.readouterr().out
    assert "NOT bit for bit: unpadded vs padded16" in out and "padded16 differs from unpadded" in out


@needs_matplotlib
def test_plot_draws_into_out_and_never_over_a_plot(recipe, cpu_run, tmp_path):
    _, out = cpu_run
    (path,) = glob.glob(str(out / "moe_gpt-*.json"))
    before = sorted(os.listdir(out))
    assert recipe.launch.main(["--plot", path, "--out", str(tmp_path / "redrawn")]) == 0
    assert os.listdir(tmp_path / "redrawn") == [os.path.basename(path)[:-len(".json")] + ".png"]
    assert sorted(os.listdir(out)) == before  # the result's own plot untouched
    for target in (tmp_path / "redrawn", out):  # a plot there already: refused, in one line
        with pytest.raises(SystemExit, match=r"^moe_gpt.py: .*\.png exists; --plot draws into --out") as e:
            recipe.launch.main(["--plot", path, "--out", str(target)])
        assert "\n" not in str(e.value.code)


def _job(*args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", RECIPE, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@needs_matplotlib
def test_cpu_job_resumes_bit_exact_after_a_kill(tmp_path):
    """Save during training, kill (SIGKILL), resume: the resumed run trains the bits of the uninterrupted one (every
    step's loss and grad norm, every final parameter: `--same-bits`). Killed in mode unpadded after step 3 of 4, so
    its checkpoint at step 2 counts and padded16 never started; the resumed run continues unpadded from step 2 and
    trains padded16 from scratch."""
    common = [*TINY, "--steps", "4", "--modes", "unpadded", "padded16"]
    whole = _job(*common, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    killed = _job(*common, "--out", str(tmp_path / "killed"), "--save", str(ckpt), "--save-interval", "2",
                  "--kill-after-step", "3")
    assert killed.returncode != 0 and "killed after step 2" in killed.stdout, killed.stdout[-3000:]
    assert not glob.glob(str(tmp_path / "killed" / "moe_gpt-*.json"))
    assert (ckpt / "unpadded" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ckpt / "padded16").exists()
    resumed = _job(*common, "--out", str(tmp_path / "resumed"), "--load", str(ckpt))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr
    (a,) = glob.glob(str(tmp_path / "whole" / "moe_gpt-*.json"))
    (b,) = glob.glob(str(tmp_path / "resumed" / "moe_gpt-*.json"))
    assert json.load(open(b))["records"]["unpadded"]["resumed_from_step"] == 2
    same = subprocess.run([sys.executable, RECIPE, "--same-bits", a, b], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert same.returncode == 0 and same.stdout.count("the same bits") == 2, same.stdout + same.stderr


def test_cpu_job_refuses_megatrons_options(recipe):
    for option in (["--modes", "megatron"], ["--ep", "2"], ["--pp", "2"], ["--distributed-optimizer"],
                   ["--recompute-modules", "moe_act"], ["--device-token-counts"], ["--moe-permute-fusion"],
                   ["--gradient-accumulation-fusion"], ["--normalization", "LayerNorm"], ["--defer-expert-wgrad"],
                   ["--transpose-weights-in-backward"], ["--step-refreshed-weights"]):
        with pytest.raises(SystemExit) as e:
            recipe.options.parse_args(["--cpu", *option])
        assert e.value.code == 2, option
    args = recipe.options.parse_args(["--cpu", "--steps", "7"])
    options = recipe.options
    assert args.steps == 7 and args.hidden == options.CPU_SIZE["hidden"] and args.modes == list(options.CPU_MODES)
    assert options.parse_args([]).hidden == 1024 and "megatron" in options.parse_args([]).modes  # the GPU job's


def test_device_token_counts_is_reported_per_layer_and_resumes_either_way(recipe, monkeypatch, capsys):
    """--device-token-counts: the recipe asks megatron_tma.mcore for every model chunk and prints how many layers
    took it and why the others did not; it changes no bits, so checkpoints resume with or without it."""
    asked = []

    def keep(model):
        asked.append(model)
        return {"decoder.layers.0.mlp": None, "decoder.layers.1.mlp": "the dispatcher is X"}

    monkeypatch.setattr(recipe.training, "keep_token_counts_on_device", keep)
    off, on = recipe.options.parse_args([]), recipe.options.parse_args(["--device-token-counts"])
    assert recipe.training.device_token_counts(off, "unpadded", ["chunk"], 0) is None and asked == []
    got = recipe.training.device_token_counts(on, "unpadded", ["a", "b"], 0)
    assert asked == ["a", "b"] and got == {"chunk0.decoder.layers.0.mlp": None,
                                           "chunk0.decoder.layers.1.mlp": "the dispatcher is X",
                                           "chunk1.decoder.layers.0.mlp": None,
                                           "chunk1.decoder.layers.1.mlp": "the dispatcher is X"}
    assert "token counts on the GPU in 2 of 4 MoE layers; the others: the dispatcher is X" in capsys.readouterr().out
    assert recipe.checkpoints.training_args(off) == recipe.checkpoints.training_args(on)


# --------------------------------------------------------------------------------------------------------------
# One line for each missing piece, before any distributed set-up
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_job(recipe, monkeypatch, torch_settings):
    """The GPU job's preconditions all met (monkeypatched), torchrun's environment set, and a process group that
    must not be reached: each test then takes one piece away."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(recipe.megatron_core, "MEGATRON_PYTHON", (3, 0))
    monkeypatch.setattr(recipe.megatron_core, "import_megatron", lambda: None)
    monkeypatch.setattr(recipe.launch, "cuda_kernels_available", lambda device=None: True)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, value)

    def reached(*args, **kwargs):
        raise AssertionError("the distributed set-up was reached")

    monkeypatch.setattr(recipe.launch.dist, "init_process_group", reached)
    return recipe


def _one_line(recipe, argv, message):
    with pytest.raises(SystemExit) as e:
        recipe.launch.main(argv)
    text = str(e.value.code)
    assert text.startswith("moe_gpt.py: ") and "\n" not in text and message in text, text


def test_the_gpu_job_reaches_the_distributed_set_up_when_nothing_is_missing(gpu_job, tmp_path):
    with pytest.raises(AssertionError, match="distributed set-up was reached"):
        gpu_job.launch.main(["--out", str(tmp_path)])


def test_no_gpu(gpu_job, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _one_line(gpu_job, ["--out", str(tmp_path)], "no CUDA GPU is visible")
    _one_line(gpu_job, ["--out", str(tmp_path)], "torchrun --nproc-per-node 1 recipes/moe_gpt.py --cpu")


def test_wrong_python(gpu_job, monkeypatch, tmp_path):
    newer = (sys.version_info.major, sys.version_info.minor + 1)
    monkeypatch.setattr(gpu_job.megatron_core, "MEGATRON_PYTHON", newer)
    _one_line(gpu_job, ["--out", str(tmp_path)],
              f"megatron-core 0.19 needs Python >= {newer[0]}.{newer[1]}, this is {sys.version.split()[0]}")


def test_no_megatron_core(gpu_job, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_job.megatron_core, "import_megatron",
                        lambda: ModuleNotFoundError("No module named 'megatron'"))
    _one_line(gpu_job, ["--out", str(tmp_path)],
              "megatron-core cannot be imported (ModuleNotFoundError: No module named 'megatron')")


def test_no_kernels(gpu_job, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_job.launch, "cuda_kernels_available", lambda device=None: False)
    _one_line(gpu_job, ["--out", str(tmp_path)], "megatron_tma's CUDA kernels cannot run here")
    # Megatron's own experts alone need no kernels
    with pytest.raises(AssertionError, match="distributed set-up was reached"):
        gpu_job.launch.main(["--modes", "megatron", "--out", str(tmp_path)])


def test_no_torchrun(gpu_job, monkeypatch, tmp_path):
    monkeypatch.delenv("RANK")
    _one_line(gpu_job, ["--out", str(tmp_path)], "the GPU job runs under torchrun")


def test_matplotlib_missing(gpu_job, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    result = tmp_path / "r.json"
    result.write_text("{}")
    for argv in (["--plot", str(result), "--out", str(tmp_path)], ["--cpu", "--out", str(tmp_path)]):
        _one_line(gpu_job, argv, "matplotlib is missing")


def test_cpu_job_in_one_process(gpu_job, monkeypatch, tmp_path):
    if not HAVE_MATPLOTLIB:
        monkeypatch.setitem(sys.modules, "matplotlib", type(sys)("matplotlib"))  # past the plot's check
    monkeypatch.setenv("WORLD_SIZE", "2")
    _one_line(gpu_job, ["--cpu", "--out", str(tmp_path)], "the CPU job runs in one process, this is one of 2")


def test_no_gpu_in_a_real_process_is_one_line_on_stderr(tmp_path):
    """Without the monkeypatches: the GPU job with no GPU visible (or, where the GPU shows, the first piece missing
    on this machine) stops with one line and no traceback."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, RECIPE, "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("moe_gpt.py: no CUDA GPU is visible"), run.stderr


# --------------------------------------------------------------------------------------------------------------
# Nothing lost, nothing let in (issue 34): checkpoint safety, honest resumes, files, arguments
# --------------------------------------------------------------------------------------------------------------

SHORT = [*TINY, "--steps", "2", "--modes", "unpadded"]


@pytest.fixture
def saved(recipe, torch_settings, tmp_path):
    """A complete run of SHORT that saved after each of its 2 steps into tmp_path/ckpt: (argv, the mode's dir)."""
    argv = [*SHORT, "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    assert recipe.launch.main([*argv, "--out", str(tmp_path / "first")]) == 0
    mode_dir = tmp_path / "ckpt" / "unpadded"
    assert (mode_dir / "latest_checkpointed_iteration.txt").read_text() == "2"
    return argv, mode_dir


def _resume_stops(recipe, argv, capsys, *words):
    with pytest.raises(SystemExit) as e:
        recipe.launch.main(argv)
    text = str(e.value.code)
    assert "\n" not in text and all(w in text for w in words), text
    assert "step    0" not in capsys.readouterr().out  # stopped before any training
    return text


def test_a_crafted_checkpoint_cannot_run_code(recipe, torch_settings, tmp_path, capsys):
    """Issue 34 item 2: the CPU job loaded its checkpoints with weights_only=False, so a pickled object behind a
    tracker file ran code under --load. Here the attacker also writes a matching checksum."""
    import hashlib

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    iteration = tmp_path / "ckpt" / "unpadded" / "iter_0000001"
    iteration.mkdir(parents=True)
    torch.save({"model": Payload()}, iteration / "state.pt")
    digest = hashlib.sha256((iteration / "state.pt").read_bytes()).hexdigest()
    (iteration / "state.pt.sha256").write_text(f"{digest}  state.pt\n")
    (iteration.parent / "latest_checkpointed_iteration.txt").write_text("1")
    _resume_stops(recipe, [*SHORT, "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")], capsys,
                  "weights_only=True", "state.pt")
    assert not marker.exists()


def test_a_second_run_never_writes_over_a_complete_checkpoint(recipe, saved, tmp_path, capsys):
    """Issue 34 item 3: a second run with the same --save and no --load wrote over the first run's iter_* and moved the
    tracker back to its own last step. Now it stops before training (as the GPU job's save refuses), and a save
    below the tracker is refused by save_state itself."""
    argv, mode_dir = saved
    before = {p: p.read_bytes() for p in mode_dir.rglob("*") if p.is_file()}
    _resume_stops(recipe, [*argv, "--steps", "1", "--out", str(tmp_path / "second")], capsys,
                  "holds a complete checkpoint at iteration 2", "--save")
    _resume_stops(recipe, [*argv, "--out", str(tmp_path / "second")], capsys, "holds a complete checkpoint")
    assert {p: p.read_bytes() for p in mode_dir.rglob("*") if p.is_file()} == before
    cpu = _cpu_module()
    for step in (1, 2):
        with pytest.raises(FileExistsError, match="never written over"):
            cpu.save_state(str(mode_dir), step, torch.nn.Linear(1, 1), [], torch.optim.SGD([torch.zeros(1)], lr=1),
                           {})
    assert (mode_dir / "latest_checkpointed_iteration.txt").read_text() == "2"


def _cpu_module():
    spec = importlib.util.spec_from_file_location("moe_gpt_cpu_tests", os.path.join(ROOT, "recipes", "moe_gpt_cpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_resume_with_other_training_settings_stops_and_names_each(recipe, saved, tmp_path, capsys):
    """Issue 34 item 4: --load with a changed --lr, --seed, --topk or --micro-batches exited 0, trained the checkpoint's
    settings and recorded the new ones."""
    argv, _ = saved
    load = ["--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "resumed")]
    plain = SHORT  # without the save options
    text = _resume_stops(recipe, [*plain, *load, "--lr", "0.001", "--seed", "7", "--topk", "1",
                                  "--micro-batches", "1"], capsys, "--lr", "--seed", "--topk", "--micro-batches")
    assert "iter_0000002" in text and "--vocab" not in text
    _resume_stops(recipe, [*plain, *load, "--steps", "3"], capsys, "--steps 2 there, 3 here")
    # the same settings resume (nothing left to train: the checkpoint is at the last step)
    assert recipe.launch.main([*plain, *load]) == 0
    (result,) = glob.glob(str(tmp_path / "resumed" / "moe_gpt-*.json"))
    assert json.load(open(result))["records"]["unpadded"]["resumed_from_step"] == 2


def test_load_of_a_missing_directory_says_so(recipe, torch_settings, tmp_path, capsys):
    """Issue 34 item 4: the CPU job trained from scratch silently. Both jobs stop (a missing mode in an existing
    directory is said, then trained from scratch)."""
    _resume_stops(recipe, [*SHORT, "--load", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")], capsys,
                  "--load", "nowhere", "no such directory")
    (tmp_path / "empty").mkdir()
    assert recipe.launch.main([*SHORT, "--load", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 0
    assert "no checkpoint in" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(recipe, saved, tmp_path, capsys, damage):
    """Issue 34 item 6: a bit-flipped state.pt resumed silently; a truncated one failed with no file name."""
    argv, mode_dir = saved
    state = mode_dir / "iter_0000002" / "state.pt"
    data = bytearray(state.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40  # inside the tensors' bytes
    else:
        del data[len(data) // 2:]
    state.write_bytes(bytes(data))
    plain = SHORT  # without the save options
    _resume_stops(recipe, [*plain, "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")], capsys,
                  str(state), "checksum")


def test_two_runs_into_one_out_keep_both_results(recipe, torch_settings, tmp_path, monkeypatch):
    """Issue 34 item 6: two runs within one minute wrote the same moe_gpt-<minute>.json and .png."""
    import datetime

    fixed = datetime.datetime(2026, 12, 3, 12, 0, tzinfo=datetime.timezone.utc)

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return fixed

    monkeypatch.setattr(recipe.results.datetime, "datetime", Frozen)
    argv = [*TINY, "--steps", "1", "--modes", "unpadded", "--out", str(tmp_path)]
    assert recipe.launch.main(argv) == 0 and recipe.launch.main([*argv, "--seed", "5"]) == 0
    results = sorted(glob.glob(str(tmp_path / "moe_gpt-*.json")))
    assert [os.path.basename(p) for p in results] == ["moe_gpt-20261203-1200-2.json", "moe_gpt-20261203-1200.json"]
    assert {json.load(open(p))["config"]["seed"] for p in results} == {5, recipe.options.parse_args(argv).seed}
    assert all(os.path.exists(p[:-len(".json")] + ".png") for p in results)


def test_an_unwritable_out_is_found_before_training(recipe, torch_settings, tmp_path, capsys):
    """Issue 34 item 6: the results' directory failed only after every mode had trained."""
    (tmp_path / "a_file").write_text("x")
    _resume_stops(recipe, [*SHORT, "--out", str(tmp_path / "a_file" / "out")], capsys, "--out", "a_file")


@pytest.mark.parametrize("option, rule", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--micro-batches", "0"], "--micro-batches must be >= 1"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--log-every", "0"], "--log-every must be >= 1"),
    (["--heads", "3"], "--hidden 128 must be divisible by --heads 3"),
    (["--topk", "5"], "--topk 5 must be <= --experts 4"),
    # issue 55 item 6: these were tracebacks later (the FP8 modules' rules, torch's seed range)
    (["--hidden", "192"], "--hidden must be a multiple of 128, got 192"),
    (["--expert-ffn", "64"], "--expert-ffn must be a multiple of 128, got 64"),
    (["--experts", "1025"], "--experts must be <= 1024, got 1025 (megatron_tma.limits.MAX_EXPERTS"),
    (["--seed", str(2**63)], f"--seed must be in [0, {(2**64 - 1000) // 1000}], got {2**63}"),
    (["--seed", str(2**55)], "--seed must be in [0, "),  # seed x 1000 + 1 past 2**64
    (["--seed", "-1"], "--seed must be in [0, "),
])
def test_bad_sizes_stop_in_one_line_naming_the_option(recipe, capsys, option, rule):
    """Issue 34 item 7: these reached the training loop (IndexError, ZeroDivisionError, reshape errors)."""
    with pytest.raises(SystemExit) as e:
        recipe.options.parse_args(["--cpu", *option])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and rule in err, err


def test_the_gpu_jobs_resume_checks_the_settings_too(recipe, tmp_path, monkeypatch):
    """Issue 34 item 4 for the GPU job (`resume`, recipes/moe_gpt_recipe/checkpoints.py): the same check as the CPU
    job's, on what megatron_tma.mcore.checkpoint.load_checkpoint hands back (stood in for: no Megatron or GPU here)."""
    args = recipe.options.parse_args(["--load", str(tmp_path), "--steps", "4"])
    saved = {"losses": [1.0, 0.5], "train_args": {**recipe.checkpoints.training_args(args), "lr": 1.0, "seed": 9}}
    monkeypatch.setattr(recipe.checkpoints.checkpoint, "latest_iteration", lambda directory: 2)
    monkeypatch.setattr(recipe.checkpoints.checkpoint, "load_checkpoint",
                        lambda directory, models, optimizer: (2, saved))
    monkeypatch.setattr(recipe.launch.dist, "get_rank", lambda: 0, raising=False)
    with pytest.raises(SystemExit) as e:
        recipe.checkpoints.resume(args, "unpadded", None, None)
    assert "--lr 1.0 there, 0.0003 here" in str(e.value.code) and "--seed 9 there, 1234 here" in str(e.value.code)
    saved["train_args"] = recipe.checkpoints.training_args(args)
    assert recipe.checkpoints.resume(args, "unpadded", None, None) == (2, saved)
    del saved["train_args"]
    with pytest.raises(SystemExit, match="holds no record of the settings"):
        recipe.checkpoints.resume(args, "unpadded", None, None)


# --------------------------------------------------------------------------------------------------------------
# Transformer Engine around the experts (issue 33): the options, the refusals, the one line without TE
# --------------------------------------------------------------------------------------------------------------

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
TE_FP8 = ["--transformer-impl", "transformer_engine", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]


def test_transformer_impl_options_are_megatron_lms(recipe):
    args = recipe.options.parse_args([])
    assert args.transformer_impl == "local" and args.fp8_format is None  # the default runs without TE
    assert args.modes == ["unpadded", "padded16", "padded128", "bf16", "megatron"]
    args = recipe.options.parse_args(TE_FP8)
    assert args.modes == ["unpadded", "padded16", "padded128", "bf16", "te"]  # Megatron's own experts: TEGroupedMLP
    settings = recipe.model.model_settings(args)
    assert settings["transformer_impl"] == "transformer_engine"
    assert (settings["fp8"], settings["fp8_recipe"]) == ("e4m3", "blockwise")
    assert settings["deterministic_mode"] is True  # TE's attention, deterministic (bit-for-bit twins)
    # never Megatron's routing-map padding for FP8: megatron_tma's experts need none, TEGroupedMLP pads itself
    assert not any("padding" in k for k in settings)
    assert "fp8" not in recipe.model.model_settings(recipe.options.parse_args([]))
    parse, training_args = recipe.options.parse_args, recipe.checkpoints.training_args
    assert "deterministic_mode" not in recipe.model.model_settings(parse([*TE_FP8, "--nondeterministic"]))
    assert parse(["--transformer-impl", "transformer_engine"]).modes == list(recipe.options.MODES)  # no FP8: no te
    # the options change what a run trains: a resume checks them; checkpoints saved before them trained the defaults
    assert {"transformer_impl", "fp8_format", "fp8_recipe", "shared_expert_ffn"} <= set(training_args(args))
    old = {k: v for k, v in training_args(parse([])).items() if k not in recipe.checkpoints.ADDED_OPTIONS}
    recipe.checkpoints.check_resume(recipe.options.parse_args([]), {"train_args": old}, "ckpt")  # no SystemExit


@pytest.mark.parametrize("argv, message", [
    (["--fp8-format", "e4m3"], "--fp8-format: Megatron's FP8 is Transformer Engine's"),
    (["--modes", "te"], "--modes te is Megatron's TEGroupedMLP"),
    (["--transformer-impl", "transformer_engine", "--modes", "te"], "--modes te is Megatron's TEGroupedMLP"),
    ([*TE_FP8, "--modes", "megatron"], "under --transformer-impl transformer_engine Megatron's own experts are"),
    (["--fp8-format", "hybrid"], "invalid choice"),
    (["--fp8-recipe", "delayed"], "invalid choice"),
    (["--experts-share-steps", "-1"], "--experts-share-steps must be >= 0"),
    # the attention's shape (the model presets' options)
    (["--heads", "32", "--num-query-groups", "5"], "--heads 32 must be divisible by --num-query-groups 5"),
    (["--hidden", "1024", "--heads", "24"], "or give the head dimension with --kv-channels"),
    (["--kv-channels", "0"], "--kv-channels must be >= 1"),
    (["--num-query-groups", "0"], "--num-query-groups must be >= 1"),
])
def test_transformer_impl_refusals(recipe, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        recipe.options.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cpu_job_refuses_the_transformer_engine_options(recipe, capsys):
    for option in (TE_FP8, ["--transformer-impl", "transformer_engine"], ["--shared-expert-ffn", "128"]):
        with pytest.raises(SystemExit):
            recipe.options.parse_args(["--cpu", *option])
        assert "the GPU job's options" in capsys.readouterr().err


def test_dsv3_like_preset_is_a_fine_grained_moe_and_options_override_it(recipe):
    args = recipe.options.parse_args(["--preset", "dsv3-like", *TE_FP8, "--modes", "unpadded", "te", "bf16"])
    assert args.topk >= 4 and args.experts >= 32 and args.expert_ffn < args.hidden  # fine-grained experts
    assert args.shared_expert_ffn and args.expert_ffn % 128 == 0 and args.steps >= 300
    assert args.steps - args.steps // 2 >= 50  # timed steps after warm-up (the second half)
    assert recipe.options.parse_args(["--preset", "dsv3-like", "--hidden", "1024"]).hidden == 1024
    assert recipe.options.bad_sizes(args) is None


@pytest.mark.parametrize("preset, shape", [
    # the real models' layers the presets stand for (issue 52): hidden, experts, FFN, top-k, heads, KV groups,
    # head dim, sequence, shared expert
    ("qwen3-30b", (2048, 128, 768, 8, 32, 4, 128, 4096, None)),
    ("dsv3-rank", (7168, 32, 2048, 8, 128, 8, 128, 4096, 2048)),
])
def test_model_presets_are_the_real_models_layers_with_gradient_accumulation(recipe, preset, shape):
    args = recipe.options.parse_args(["--preset", preset, *TE_FP8, "--modes", "unpadded", "te", "bf16"])
    assert (args.hidden, args.experts, args.expert_ffn, args.topk, args.heads, args.num_query_groups,
            args.kv_channels, args.seq_len, args.shared_expert_ffn) == shape
    assert args.qk_layernorm == (preset == "qwen3-30b")  # Qwen3's attention normalizes each query and key head
    assert args.micro_batches >= 4 and args.micro_batch_size == 1 and args.steps >= 300
    assert recipe.options.bad_sizes(args) is None
    settings = recipe.model.model_settings(args)  # what reaches Megatron's TransformerConfig
    assert (settings["num_query_groups"], settings["kv_channels"], settings["qk_layernorm"]) == (
        args.num_query_groups, args.kv_channels, args.qk_layernorm)
    assert recipe.options.parse_args(["--preset", preset, "--layers", "1"]).layers == 1  # options override it


def test_a_head_dimension_frees_the_heads_from_dividing_the_hidden_size(recipe):
    args = recipe.options.parse_args(["--hidden", "1024", "--heads", "24", "--kv-channels", "64"])
    assert recipe.options.bad_sizes(args) is None


def test_device_busy_is_the_union_of_the_devices_intervals(recipe):
    class Span:
        def __init__(self, start, end):
            self.start, self.end = start, end

    class Event:
        def __init__(self, start, end, device=torch.autograd.DeviceType.CUDA):
            self.time_range, self.device_type = Span(start, end), device

    class Profiler:  # overlapping streams counted once, host events and empty spans ignored; microseconds in, ms out
        def events(self):
            return [Event(0, 1000), Event(500, 1500), Event(3000, 3500), Event(0, 9000, torch.autograd.DeviceType.CPU),
                    Event(4000, 4000), Event(3100, 3200)]

    assert recipe.timing.device_busy_ms(Profiler()) == 2.0


def test_transformer_engine_missing_is_one_line_naming_the_option(gpu_job, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_job.megatron_core, "te_import_error",
                        lambda: ModuleNotFoundError("No module named 'transformer_engine'"))
    _one_line(gpu_job, ["--out", str(tmp_path), *TE_FP8],
              "--transformer-impl transformer_engine needs Transformer Engine, which cannot be imported "
              "(ModuleNotFoundError: No module named 'transformer_engine')")
    _one_line(gpu_job, ["--out", str(tmp_path), "--moe-permute-fusion"],
              "--moe-permute-fusion needs Transformer Engine, which cannot be imported")
    _one_line(gpu_job, ["--out", str(tmp_path), *TE_FP8, "--moe-permute-fusion"],
              "--transformer-impl transformer_engine and --moe-permute-fusion need Transformer Engine")
    # the local spec never asks for TE
    with pytest.raises(AssertionError, match="distributed set-up was reached"):
        gpu_job.launch.main(["--out", str(tmp_path)])


def test_moe_permute_fusion_is_megatron_lms_option(recipe):
    """--moe-permute-fusion sets Megatron's config field in every mode; it is a training setting (TE's fused
    un-permutation may sum in another order), which checkpoints saved before it trained without."""
    parse, model_settings = recipe.options.parse_args, recipe.model.model_settings
    assert model_settings(parse([*TE_FP8, "--moe-permute-fusion"]))["moe_permute_fusion"] is True
    assert "moe_permute_fusion" not in model_settings(parse(TE_FP8))
    args = parse(["--moe-permute-fusion"])
    assert recipe.checkpoints.training_args(args)["moe_permute_fusion"] is True
    old = {k: v for k, v in recipe.checkpoints.training_args(parse([])).items() if k != "moe_permute_fusion"}
    recipe.checkpoints.check_resume(parse([]), {"train_args": old}, "ckpt")  # saved before the option: no SystemExit
    with pytest.raises(SystemExit, match="--moe-permute-fusion False there, True here"):
        recipe.checkpoints.check_resume(args, {"train_args": old}, "ckpt")


def test_apex_options_are_megatron_lms(recipe, gpu_job, monkeypatch, tmp_path):
    """--gradient-accumulation-fusion and --normalization set Megatron's config fields; both are training settings
    (checkpoints saved before them trained without fusion, with RMSNorm). The fusion without Apex's extension stops
    the GPU job in one line, before any distributed set-up, in either spec (Megatron's output layer uses it)."""
    parse, model_settings = recipe.options.parse_args, recipe.model.model_settings
    assert model_settings(parse(["--gradient-accumulation-fusion"]))["gradient_accumulation_fusion"] is True
    assert "gradient_accumulation_fusion" not in model_settings(parse([]))
    assert parse([]).normalization == "RMSNorm" and parse(["--normalization", "LayerNorm"]).normalization == "LayerNorm"
    old = {k: v for k, v in recipe.checkpoints.training_args(parse([])).items()
           if k not in ("gradient_accumulation_fusion", "normalization")}
    recipe.checkpoints.check_resume(parse([]), {"train_args": old}, "ckpt")  # saved before the options
    with pytest.raises(SystemExit, match="--normalization 'RMSNorm' there, 'LayerNorm' here"):
        recipe.checkpoints.check_resume(parse(["--normalization", "LayerNorm"]), {"train_args": old}, "ckpt")
    monkeypatch.setattr(gpu_job.megatron_core, "extension_import_error",
                        lambda name: f"ModuleNotFoundError: No module named '{name}'")
    for spec in ([], TE_FP8):
        if spec:
            monkeypatch.setattr(gpu_job.megatron_core, "te_import_error", lambda: None)
        _one_line(gpu_job, ["--out", str(tmp_path), "--gradient-accumulation-fusion", *spec],
                  "--gradient-accumulation-fusion needs Apex's fused_weight_gradient_mlp_cuda")


def test_deferred_expert_wgrads_are_a_training_setting(recipe):
    for argv in (["--defer-expert-wgrad"], ["--defer-expert-wgrad", "--overlap-grad-reduce"]):
        assert recipe.options.parse_args(argv).defer_expert_wgrad
    args = recipe.options.parse_args(["--defer-expert-wgrad"])
    assert recipe.checkpoints.training_args(args)["defer_expert_wgrad"] is True  # other bits: a training setting


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed here")
def test_transformer_engine_really_missing(gpu_job, tmp_path):
    assert gpu_job.megatron_core.te_import_error() is not None
    _one_line(gpu_job, ["--out", str(tmp_path), *TE_FP8], "needs Transformer Engine")


def test_head_to_head_ratios_and_targets(recipe):
    def run(ms, peak, loss, steps=300):
        return {"losses": [loss] * steps, "grad_norms": [1.0] * steps, "times": [ms] * steps,
                "init_digests": [{}], "param_digests": [{}], "peak_mb": peak,
                "experts_share": [{"experts_ms": 0.4 * ms, "step_ms": ms, "share": 0.4}] * 3}
    runs = {"unpadded": run(100.0, 900.0, 3.00), "te": run(125.0, 1000.0, 3.02), "bf16": run(105.0, 950.0, 2.90)}
    report, failures = recipe.results.summarize(runs)
    assert failures == [] and report["unpadded"]["experts_share_of_step"] == 0.4
    h2h = recipe.results.head_to_head(runs, report)
    te, bf16 = h2h["unpadded_vs_te"], h2h["unpadded_vs_bf16"]
    assert te["speedup"] == pytest.approx(1.25) and te["peak_ratio"] == pytest.approx(0.9)
    assert te["timed_steps"] == 150 and te["loss_window_steps"] == 100
    assert te["targets"]["met"] == {"speedup": True, "loss_within_1pct": True, "peak_at_or_below": True}
    assert bf16["targets"]["met"] == {"speedup": False, "loss_within_1pct": False}  # x1.05; 3.4% off
    assert "loss_not_judged" not in te and "loss_not_judged" not in bf16
    # the experts are 40% of every timed step: 40 / 50 / 42 ms, the rest 60 / 75 / 63 ms
    assert te["experts_speedup"] == pytest.approx(50 / 40) and bf16["experts_speedup"] == pytest.approx(42 / 40)
    assert te["rest_of_step_ms"] == pytest.approx({"unpadded": 60.0, "te": 75.0})
    assert te["window_speedup"] == pytest.approx(1.25) and te["experts_window_steps"] == 3
    assert te["speedup_with_rest_equal"] == pytest.approx((67.5 + 50) / (67.5 + 40))
    assert bf16["speedup_with_rest_equal"] == pytest.approx((61.5 + 42) / (61.5 + 40))
    assert recipe.results.head_to_head({"te": runs["te"]}, {"te": report["te"]}) == {}


def test_head_to_head_splits_within_the_timed_steps(recipe):
    # the timed steps (the last K) ran slower than the median step: the split must pair each step with its own
    # experts' time, never the median of all steps with the experts' median of the last K
    def run(ms, timed):
        return {"losses": [3.0] * 300, "grad_norms": [1.0] * 300, "times": [ms] * 300,
                "init_digests": [{}], "param_digests": [{}], "peak_mb": 900.0,
                "experts_share": [{"experts_ms": e, "step_ms": t, "share": e / t} for e, t in timed]}
    runs = {"unpadded": run(100.0, [(40.0, 130.0), (44.0, 120.0), (42.0, 125.0)]),
            "bf16": run(120.0, [(50.0, 128.0), (52.0, 140.0), (51.0, 132.0)])}
    report, _ = recipe.results.summarize(runs)
    bf16 = recipe.results.head_to_head(runs, report)["unpadded_vs_bf16"]
    assert bf16["speedup"] == pytest.approx(1.2)  # the judged ratio: all timed steps of the second half
    assert bf16["rest_of_step_ms"] == pytest.approx({"unpadded": 83.0, "bf16": 81.0})  # medians of step - experts
    assert bf16["experts_speedup"] == pytest.approx(51 / 42)
    assert bf16["window_speedup"] == pytest.approx(132 / 125)
    assert bf16["speedup_with_rest_equal"] == pytest.approx((82 + 51) / (82 + 42))


def test_head_to_head_without_the_experts_timing_has_no_split(recipe):
    def run(ms):
        return {"losses": [3.0] * 300, "grad_norms": [1.0] * 300, "times": [ms] * 300,
                "init_digests": [{}], "param_digests": [{}], "peak_mb": 900.0}
    runs = {"unpadded": run(100.0), "bf16": run(110.0)}
    report, _ = recipe.results.summarize(runs)
    bf16 = recipe.results.head_to_head(runs, report)["unpadded_vs_bf16"]
    assert bf16["speedup"] == pytest.approx(1.1)
    assert not {"experts_speedup", "rest_of_step_ms", "speedup_with_rest_equal"} & set(bf16)


def test_head_to_head_does_not_judge_the_loss_of_a_short_run(recipe):
    # a 120-step throughput probe: its last 100 steps are mostly the steep start of training
    def run(ms, loss, steps):
        return {"losses": [loss] * steps, "grad_norms": [1.0] * steps, "times": [ms] * steps,
                "init_digests": [{}], "param_digests": [{}], "peak_mb": 900.0,
                "experts_share": [{"experts_ms": 0.4 * ms, "step_ms": ms, "share": 0.4}] * 3}
    runs = {"unpadded": run(100.0, 3.00, 120), "bf16": run(112.0, 2.50, 120)}
    report, _ = recipe.results.summarize(runs)
    bf16 = recipe.results.head_to_head(runs, report)["unpadded_vs_bf16"]
    assert bf16["targets"]["met"] == {"speedup": True, "loss_within_1pct": None}
    assert bf16["loss_not_judged"] == "120 steps: the loss target is judged on runs of >= 300 steps"
    assert bf16["loss_window_rel_gap"] == pytest.approx(0.2)  # still reported


class _ClockEvent:
    """A stand-in for torch.cuda.Event on the CPU: `record()` takes the next tick of a shared clock; elapsed_time is
    the ticks between two events."""
    clock = 0

    def record(self):
        _ClockEvent.clock += 1
        self.t = _ClockEvent.clock

    def elapsed_time(self, other):
        return float(other.t - self.t)


def test_experts_timer_marks_the_experts_forward_and_backward(recipe):
    """The experts' share: marks on the experts' input and output in every MoE layer (a module with `experts` and a
    `token_dispatcher`, as Megatron's MoELayer) record events in forward (in, out) and backward (out, in); the
    intervals between them are the experts' time. Off, the wrapped forward is the experts' own (no marks); on, the
    outputs and gradients are unchanged."""
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x, tokens_per_expert, probs=None):
            return x @ self.w * probs.unsqueeze(-1), None

    class MoELayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts, self.token_dispatcher, self.pre = Experts(), object(), torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.pre(x)
            out, _ = self.experts(h, torch.tensor([x.shape[0]]), torch.ones(x.shape[0]))
            return out.tanh()

    torch.manual_seed(0)
    model = torch.nn.Sequential(MoELayer(), MoELayer())
    x = torch.randn(5, 8)
    plain_out = model(x)
    plain_out.sum().backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    timer = recipe.timing.ExpertsTimer([model], event=_ClockEvent)
    for p in model.parameters():
        p.grad = None
    timer.start(False)
    assert timer.stop() is None and timer.events == []
    timer.start(True)
    out = model(x)
    out.sum().backward()
    share = timer.stop()
    assert torch.equal(out, plain_out)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads))
    # two layers: forward in, out, in, out; backward (last layer first) out, in, out, in
    assert [(phase, begin) for phase, begin, _ in timer.events] == [
        ("fwd", True), ("fwd", False), ("fwd", True), ("fwd", False),
        ("bwd", True), ("bwd", False), ("bwd", True), ("bwd", False)]
    measured = share()
    assert measured["experts_ms"] == 4.0 and measured["step_ms"] == 9.0  # 4 intervals of 1 tick, 8 events + 1
    assert measured["share"] == pytest.approx(4 / 9)
    # the routing each layer's experts got (one expert holding all 5 tokens, in both layers)
    assert measured["empty_experts_fraction"] == 0.0 and measured["largest_expert_share"] == 1.0


def test_experts_timer_notes_the_routing_without_a_host_read(recipe):
    """Empty experts cost our wgrad nothing and the BF16 experts a main_grad update each, so the timed steps record
    the routing beside the experts' time: the fraction of (layer, micro-batch) experts that got no token, the largest
    expert's share of its layer's tokens; kept as device tensors until the share is read after the step."""
    timer = recipe.timing.ExpertsTimer([], event=_ClockEvent)
    timer.start(True)
    for counts in ([0, 0, 6, 2], [1, 1, 1, 1], [0, 0, 0, 0]):
        timer.note_routing(torch.tensor(counts))
    assert all(isinstance(v, torch.Tensor) for _, *values in timer.routing for v in values)
    measured = timer.stop()()
    assert measured["empty_experts_fraction"] == 6 / 12
    assert measured["largest_expert_share"] == 6 / 8  # (an all-empty layer counts as share 0, not a division by 0)
    timer.start(True)
    assert timer.routing == [] and "empty_experts_fraction" not in timer.stop()()


# --------------------------------------------------------------------------------------------------------------
# Issue 55 items 5 and 6: checkpoint files, one job per --save, the recipe's options, a closed stdout
# --------------------------------------------------------------------------------------------------------------

def test_a_checksum_in_upper_case_hex_is_the_same_checksum(recipe, saved, tmp_path):
    """Issue 55 item 5: an intact checkpoint whose state.pt.sha256 was written in upper case was refused as
    "truncated or corrupted"."""
    argv, mode_dir = saved
    sums = mode_dir / "iter_0000002" / "state.pt.sha256"
    digest, name = sums.read_text().split()
    sums.write_text(f"{digest.upper()}  {name}\n")
    assert recipe.launch.main([*SHORT, "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "resumed")]) == 0
    (result,) = glob.glob(str(tmp_path / "resumed" / "moe_gpt-*.json"))
    assert json.load(open(result))["records"]["unpadded"]["resumed_from_step"] == 2


@pytest.mark.parametrize("where, content, words", [
    ("iter_0000002/state.pt.sha256", b"\xff\xfe" + "abc".encode("utf-16-le"), ["state.pt.sha256", "not ASCII",
                                                                              "64 hex digits"]),
    ("iter_0000002/state.pt.sha256", b"not a checksum  state.pt\n", ["state.pt.sha256", "64 hex digits"]),
    ("iter_0000002/state.pt.sha256", None, ["state.pt.sha256", "IsADirectoryError", "64 hex digits"]),
    ("latest_checkpointed_iteration.txt", b"\xff2", ["latest_checkpointed_iteration.txt", "not ASCII",
                                                     "ASCII digits"]),
    ("latest_checkpointed_iteration.txt", "\u00b3".encode(), ["latest_checkpointed_iteration.txt", "ASCII digits"]),
    ("latest_checkpointed_iteration.txt", None, ["latest_checkpointed_iteration.txt", "IsADirectoryError"]),
    # a FIFO in their place blocked the read until someone wrote to it
    ("iter_0000002/state.pt.sha256", "fifo", ["state.pt.sha256", "not a regular file", "64 hex digits"]),
    ("latest_checkpointed_iteration.txt", "fifo", ["latest_checkpointed_iteration.txt", "not a regular file"]),
])
def test_a_checkpoint_file_breaking_its_rule_stops_in_one_line(recipe, saved, tmp_path, capsys, where, content, words):
    """Issue 55 item 5: a checksum file or tracker with non-UTF-8 bytes, a tracker holding '³' (str.isdigit takes
    it), a directory in their place: tracebacks naming no file. Now one line naming the file and its rule, under
    --load (resume) and under --save (the check that the run's saves go through)."""
    argv, mode_dir = saved
    target = mode_dir / where
    target.unlink()
    if content is None:
        target.mkdir()
    elif content == "fifo":
        os.mkfifo(target)
    else:
        target.write_bytes(content)
    _resume_stops(recipe, [*SHORT, "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")], capsys,
                  *words)
    if where.startswith("latest"):
        _resume_stops(recipe, [*argv, "--steps", "3", "--out", str(tmp_path / "out")], capsys, *words)


def test_a_planted_link_never_takes_a_save_outside_save(recipe, torch_settings, tmp_path):
    """Issue 55 item 5: a symlink planted at the tracker's fixed temporary name made the CPU job's save write the file
    it points to."""
    mode_dir = tmp_path / "ckpt" / "unpadded"
    mode_dir.mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    os.symlink(outside, mode_dir / "latest_checkpointed_iteration.txt.tmp")
    os.symlink(outside, mode_dir / "iter_0000001")  # an iteration directory the tracker never named, as a link
    assert recipe.launch.main([*SHORT, "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                        "--out", str(tmp_path / "out")]) == 0
    assert outside.read_text() == "precious"
    assert (mode_dir / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (mode_dir / "iter_0000001" / "state.pt").is_file() and not (mode_dir / "iter_0000001").is_symlink()


def test_a_second_job_into_one_save_is_refused_before_any_work(recipe, torch_settings, tmp_path, capsys,
                                                               another_job_saving):
    """Issue 55 item 5: two jobs saving into one --save: one deleted the other's half-written iteration as a killed
    run's leftovers, and the other crashed after all its training. The second job now stops before training, in one
    line naming the directory and the first job's pid; the first job's files are untouched."""
    save = tmp_path / "ckpt"
    holder = another_job_saving(save)
    (save / "unpadded" / "iter_0000001").mkdir(parents=True)
    (save / "unpadded" / "iter_0000001" / "state.pt").write_text("being written")
    _resume_stops(recipe, [*SHORT, "--save", str(save), "--save-interval", "1", "--out", str(tmp_path / "out")],
                  capsys, "--save", str(save), f"pid {holder.pid}", "another live job")
    assert (save / "unpadded" / "iter_0000001" / "state.pt").read_text() == "being written"
    assert not glob.glob(str(tmp_path / "out" / "moe_gpt-*.json"))


@pytest.mark.parametrize("make, words", [
    (lambda tmp: (tmp / "a_file").write_text("x") and tmp / "a_file", ["--save", "a_file", "FileExistsError"]),
    (lambda tmp: (tmp / "a_file").write_text("x") and tmp / "a_file" / "ckpt", ["--save", "a_file",
                                                                                "NotADirectoryError"]),
])
def test_an_unusable_save_is_found_before_training(recipe, torch_settings, tmp_path, capsys, make, words):
    """Issue 55 item 6: an unusable --save (a file, a path through a file) was found at the first save, after
    training, with a traceback. Checked before any work, as --out is."""
    save = make(tmp_path)
    _resume_stops(recipe, [*SHORT, "--save", str(save), "--save-interval", "1", "--out", str(tmp_path / "out")],
                  capsys, *words)


def test_an_unusable_save_stops_the_gpu_job_before_the_distributed_set_up(gpu_job, tmp_path):
    (tmp_path / "a_file").write_text("x")
    _one_line(gpu_job, ["--save", str(tmp_path / "a_file"), "--save-interval", "5", "--out", str(tmp_path / "out")],
              "--save")


@pytest.mark.parametrize("argv, jobs", [
    (["--cpu", "--same-bits", "a.json", "b.json"], "--cpu and --same-bits"),
    (["--cpu", "--compare", "a.json"], "--cpu and --compare"),
    (["--cpu", "--plot", "a.json"], "--cpu and --plot"),
    (["--plot", "a.json", "--same-bits", "a.json", "b.json"], "--plot and --same-bits"),
    (["--compare", "a.json", "--same-bits", "a.json", "b.json"], "--compare and --same-bits"),
])
def test_conflicting_jobs_are_refused_in_one_line(recipe, capsys, argv, jobs):
    """Issue 55 item 6: `--cpu --same-bits A B` trained, wrote a result and exited 0 though A and B need not exist (a
    CI gate on --same-bits would always pass)."""
    with pytest.raises(SystemExit) as e:
        recipe.options.parse_args(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert jobs in last and "different jobs" in last, last


@pytest.mark.parametrize("argv, ignored", [
    (["--plot", "a.json", "--save", "ckpt", "--save-interval", "2"], "--save"),
    (["--compare", "a.json", "--load", "ckpt"], "--load"),
    (["--same-bits", "a.json", "b.json", "--load", "ckpt", "--kill-after-step", "3"], "--load, --kill-after-step"),
])
def test_training_options_on_a_job_that_trains_nothing_are_refused(recipe, capsys, argv, ignored):
    """--save / --load / --kill-after-step beside --plot, --compare or --same-bits (which read results) were ignored
    without a word: a resume asked for that never happens."""
    with pytest.raises(SystemExit) as e:
        recipe.options.parse_args(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert argv[0] in last and "trains nothing" in last and ignored in last, last


@pytest.mark.parametrize("argv, files, words", [
    (["--plot", "{missing}"], {}, ["--plot", "missing.json", "FileNotFoundError"]),
    (["--same-bits", "{missing}", "{good}"], {}, ["--same-bits", "missing.json", "FileNotFoundError"]),
    (["--compare", "{good}", "{missing}"], {}, ["--compare", "missing.json", "FileNotFoundError"]),
    (["--same-bits", "{good}", "{bad}"], {"bad": "[1, 2]"}, ["--same-bits", "bad.json", "not a moe_gpt result"]),
    (["--same-bits", "{good}", "{bad}"], {"bad": '{"records": {}}'}, ["--same-bits", "bad.json"]),
    (["--same-bits", "{bad}", "{good}"], {"bad": "{"}, ["--same-bits", "bad.json", "not a result JSON"]),
    (["--plot", "{bad}"], {"bad": b"\xff\xfe"}, ["--plot", "bad.json", "not a result JSON"]),
])
def test_a_missing_or_bad_result_file_is_one_line_naming_its_option(recipe, cpu_run, tmp_path, argv, files, words):
    """Issue 55 item 6: a missing file for --plot / --same-bits was a traceback, and a bad result given to
    --same-bits got a message naming --compare."""
    run, out = cpu_run
    (good,) = glob.glob(str(out / "moe_gpt-*.json"))
    for name, content in files.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    names = {"missing": str(tmp_path / "missing.json"), "good": good, "bad": str(tmp_path / "bad.json")}
    with pytest.raises(SystemExit) as e:
        recipe.launch.main([a.format(**names) for a in argv] + ["--out", str(tmp_path / "out")])
    text = str(e.value.code)
    assert text.startswith("moe_gpt.py: ") and "\n" not in text and all(w in text for w in words), text
    if "--same-bits" in argv:
        assert "--compare" not in text


@needs_matplotlib
def test_the_cpu_job_trains_on_and_writes_its_result_when_stdout_closes(tmp_path):
    """Issue 55 item 6: `torchrun ... --cpu | head` died with BrokenPipeError once head exited, and wrote no result.
    The reader here takes the first line and closes the pipe; the job must train on, exit 0 and write its result."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", RECIPE, *TINY,
           "--steps", "6", "--modes", "unpadded", "padded16", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does when it exits
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, err[-4000:]
    assert first.startswith("CPU job:"), first
    assert "BrokenPipeError" not in err, err[-4000:]
    (path,) = glob.glob(str(out / "moe_gpt-*.json"))
    assert json.load(open(path))["failures"] == []


def test_the_result_names_its_sources_commit(recipe, tmp_path, monkeypatch):
    """The result JSON's commit: MEGATRON_TMA_COMMIT where set (a copy without .git), else git's HEAD, "-dirty" when
    the kernels, the package or the recipe differ from it (a new file included), "unknown" outside a checkout."""
    import subprocess

    results = recipe.results
    monkeypatch.setenv("MEGATRON_TMA_COMMIT", "abc1234")
    assert results.source_commit() == "abc1234"
    monkeypatch.delenv("MEGATRON_TMA_COMMIT")
    root = tmp_path / "repo"
    (root / "recipes" / "moe_gpt_recipe").mkdir(parents=True)
    (root / "megatron_tma").mkdir()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.check_call(git + ["init", "-q", str(root)])
    (root / "megatron_tma" / "a.py").write_text("x = 1\n")
    subprocess.check_call(git + ["-C", str(root), "add", "-A"])
    subprocess.check_call(git + ["-C", str(root), "commit", "-qm", "c"])
    sha = subprocess.check_output(["git", "-C", str(root), "rev-parse", "HEAD"], text=True).strip()
    # source_commit finds the checkout three folders above its own file
    monkeypatch.setattr(results, "__file__", str(root / "recipes" / "moe_gpt_recipe" / "results.py"))
    assert results.source_commit() == sha
    (root / "megatron_tma" / "b.py").write_text("y = 2\n")  # untracked, not ignored
    assert results.source_commit() == sha + "-dirty"
    (root / "megatron_tma" / "b.py").unlink()
    (root / "megatron_tma" / "a.py").write_text("x = 2\n")
    assert results.source_commit() == sha + "-dirty"
    monkeypatch.setattr(results, "__file__", str(tmp_path / "elsewhere" / "x" / "y" / "results.py"))
    (tmp_path / "elsewhere").mkdir()
    assert results.source_commit() == "unknown"
