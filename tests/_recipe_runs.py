"""Running `recipes/moe_gpt.py` under torchrun from the GPU tests (``from _recipe_runs import ...``): the small model
they train, a run whose result must pass the recipe's own checks, and a run killed after a step, for resume tests."""
import glob
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "moe_gpt.py")
# Megatron-LM's --gradient-accumulation-fusion (Apex's fused_weight_gradient_mlp_cuda), with a shared expert so
# that the local spec has dense MLP linears beside attention's
APEX_FUSION = ("--gradient-accumulation-fusion", "--shared-expert-ffn", "256")
SMALL = ["--layers", "2", "--hidden", "256", "--heads", "4", "--experts", "8", "--expert-ffn", "256",
         "--seq-len", "128", "--micro-batch-size", "4", "--lr", "2e-3", "--log-every", "8"]


def torchrun(gpus):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]


def run(cmd):
    """subprocess.run, with its wall time printed (seen with pytest -s: recipe runs dominate these tests' time)."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(f"\n[{time.perf_counter() - t0:.1f} s] {' '.join(cmd[4:])[:200]}", flush=True)
    return done


def recipe(tmp_path, *args, gpus=1):
    """Train SMALL with `args` into tmp_path; (the result's path, the result), which must have no failures."""
    done = run([*torchrun(gpus), RECIPE, *SMALL, "--out", str(tmp_path), *args])
    assert done.returncode == 0, f"recipe failed (rc {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    (path,) = glob.glob(str(tmp_path / "moe_gpt-*.json"))
    with open(path) as f:
        result = json.load(f)
    assert result["failures"] == []
    return path, result


def killed_run(tmp_path, *args, kill_after_step):
    """Train SMALL with `args` into tmp_path / "killed" until the recipe kills itself (SIGKILL) after step
    `kill_after_step`; (return code, stdout, stderr). Output goes to files, not pipes, in a session of its own:
    Megatron's checkpoint writer starts a multiprocessing Manager (a spawned server process), which outlives a killed
    rank and would hold a pipe open forever; the session's leftovers are killed once torchrun has returned."""
    cmd = [*torchrun(1), RECIPE, *SMALL, "--out", str(tmp_path / "killed"), *args,
           "--kill-after-step", str(kill_after_step)]
    t0 = time.perf_counter()
    with open(tmp_path / "killed.out", "w+") as out, open(tmp_path / "killed.err", "w+") as err:
        killed = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, start_new_session=True)
        try:
            rc = killed.wait(timeout=600)
        finally:
            try:
                os.killpg(killed.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    print(f"\n[{time.perf_counter() - t0:.1f} s] killed run, rc {rc}", flush=True)
    return rc, stdout, stderr


def apex_missing():
    """Why the Apex pieces megatron-core takes do not import here (one line), or None."""
    if importlib.util.find_spec("apex") is None:
        return "apex is not installed"
    for name in ("apex.optimizers", "apex.normalization", "fused_weight_gradient_mlp_cuda"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - not installed, or built against another torch / CUDA
            return f"{name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None
