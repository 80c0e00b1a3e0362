"""The benchmarks refuse to run where megatron_tma's CUDA kernels cannot: no GPU, the extension not built (after a
failed build a benchmark timed the torch reference and printed timings 200x its roofline), or a GPU that is not
sm_90. The GPU cases are simulated; the last test runs the four benchmarks here, where the kernels cannot run."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from megatron_tma import _ext

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_common_refusal", os.path.join(_ROOT, "benchmarks", "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
BENCHMARKS = ("bench_m_grouped", "bench_k_grouped", "bench_quant", "bench_mlp_layer")


@pytest.fixture
def gpu(monkeypatch):
    """A visible GPU, as the benchmarks' checks see it: set `state` to what the machine has."""
    state = {"built": True, "kernels": True, "capability": (9, 0), "name": "NVIDIA H200"}
    monkeypatch.setattr(common, "_KERNELS_CHECKED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: state["name"])
    monkeypatch.setattr(_ext, "has_extension", lambda: state["built"])
    monkeypatch.setattr(_ext, "cuda_kernels_available", lambda device=None: state["built"] and state["kernels"])
    return state


def test_no_gpu_refuses(monkeypatch):
    monkeypatch.setattr(common, "_KERNELS_CHECKED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="refusing to run: no CUDA GPU is visible"):
        common.measure_ceilings()  # before it allocates anything on a GPU


def test_a_gpu_without_the_extension_refuses_before_timing_anything(gpu):
    gpu["built"] = False
    calls = []
    with pytest.raises(SystemExit, match="refusing to run: megatron_tma's CUDA extension is not built") as e:
        common._time_once(lambda: calls.append(1), flush=False)
    assert calls == [] and "torch reference, not of the kernels" in str(e.value)
    with pytest.raises(SystemExit, match="extension is not built"):
        common.measure_ceilings()


def test_a_gpu_that_is_not_hopper_refuses(gpu):
    gpu.update(kernels=False, capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit, match=r"need an sm_90 \(Hopper\) GPU, NVIDIA A100-SXM4-80GB is sm_80"):
        common.require_kernels()


def test_hopper_with_the_kernels_runs_and_checks_once(gpu, monkeypatch):
    common.require_kernels()
    assert common.kernels_problem() is None
    monkeypatch.setattr(common, "kernels_problem", lambda device=None: pytest.fail("checked again"))
    common.require_kernels()  # once per process: _time_once calls it before every timing


@pytest.mark.skipif(common.kernels_problem() is None, reason="the kernels run here: the benchmarks would run")
def test_each_benchmark_refuses_here():
    script = ("import runpy, sys\n"
              "for name in sys.argv[1:]:\n"
              "    sys.argv = [name + '.py', '--quick']\n"
              "    try:\n"
              "        runpy.run_path(f'benchmarks/{name}.py', run_name='__main__')\n"
              "        print(name, 'RAN')\n"
              "    except SystemExit as e:\n"
              "        print(name, 'EXIT', e.code)\n")
    run = subprocess.run([sys.executable, "-c", script, *BENCHMARKS], cwd=_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    for name in BENCHMARKS:
        line = next(ln for ln in lines if ln.startswith(name + " "))
        assert line.startswith(f"{name} EXIT benchmarks: refusing to run: "), line
