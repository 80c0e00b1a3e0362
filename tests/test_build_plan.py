"""The install's one decision (_build_backend.cuda_build_plan): build the sm_90a kernels where a Hopper GPU is visible
(then anything missing is an error), else the pure-Python package with the reason; and what the build environment is
asked to hold. nvidia-smi and the CUDA toolkit are simulated."""
import importlib.util
import os
import shutil
import subprocess

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("megatron_tma_build_backend", os.path.join(_ROOT, "_build_backend.py"))
backend = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(backend)

H200 = "0, GPU-aaaa, NVIDIA H200, 9.0"
A100 = "1, GPU-bbbb, NVIDIA A100-SXM4-80GB, 8.0"


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine whose nvidia-smi prints `state["smi"]` (None: no nvidia-smi) and whose CUDA toolkit at
    tmp_path/cuda has `state["toolkit"]` ("full", "no-headers", or None: no nvcc)."""
    state = {"smi": None, "smi_rc": 0, "toolkit": "full"}
    for var in ("MEGATRON_TMA_NO_CUDA", "CUDA_VISIBLE_DEVICES", "CUDA_PATH", "CUTLASS_INCLUDE_DIR"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "cuda"
    monkeypatch.setenv("CUDA_HOME", str(home))

    def which(name):
        return "/usr/bin/nvidia-smi" if name == "nvidia-smi" and state["smi"] is not None else None

    def run(cmd, **kwargs):
        assert cmd[0] == "/usr/bin/nvidia-smi" and "--query-gpu=index,uuid,name,compute_cap" in cmd
        return subprocess.CompletedProcess(cmd, state["smi_rc"], stdout=state["smi"], stderr="")

    monkeypatch.setattr(backend.shutil, "which", which)
    monkeypatch.setattr(backend.subprocess, "run", run)

    def lay_toolkit():
        shutil.rmtree(home, ignore_errors=True)
        if state["toolkit"] is not None:
            (home / "bin").mkdir(parents=True, exist_ok=True)
            (home / "bin" / "nvcc").write_text("")
        if state["toolkit"] == "full":
            (home / "include").mkdir(parents=True, exist_ok=True)
            (home / "include" / "cuda_runtime.h").write_text("")

    def plan():
        lay_toolkit()
        return backend.cuda_build_plan(run)

    state["plan"] = plan
    return state


def test_no_gpu_is_a_pure_python_install_whatever_the_toolkit(machine):
    for toolkit in ("full", "no-headers", None):
        machine["toolkit"] = toolkit
        build, why = machine["plan"]()
        assert not build and why.startswith("no GPU visible (nvidia-smi not found)") and "MEGATRON_TMA_NO_CUDA=0" in why


def test_a_failing_nvidia_smi_or_hidden_gpus_mean_no_gpu(machine, monkeypatch):
    machine.update(smi="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", smi_rc=9)
    build, why = machine["plan"]()
    assert not build and "no GPU visible (nvidia-smi failed: NVIDIA-SMI has failed" in why
    machine.update(smi=H200, smi_rc=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    build, why = machine["plan"]()
    assert not build and "no GPU visible (CUDA_VISIBLE_DEVICES='')" in why


def test_gpus_that_are_not_hopper_give_the_pure_python_package(machine, monkeypatch):
    machine["smi"] = A100
    build, why = machine["plan"]()
    assert not build and "no Hopper (sm_90) GPU visible (GPU 1 NVIDIA A100-SXM4-80GB (sm_80))" in why
    machine["smi"] = H200 + "\n" + A100
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the H200 is not this process's
    assert not machine["plan"]()[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert machine["plan"]()[0]


def test_a_visible_hopper_gpu_builds_the_kernels(machine):
    machine["smi"] = H200 + "\n" + A100
    build, why = machine["plan"]()
    assert build and why.startswith("GPU 0 NVIDIA H200 (sm_90) visible; CUDA toolkit ")
    machine["smi"] = "0, GPU-cccc, NVIDIA H100 80GB HBM3, [N/A]"  # a driver without compute_cap: the name tells
    assert machine["plan"]()[0]


@pytest.mark.parametrize("toolkit, message", [
    ("no-headers", "lacks its headers: no "),
    (None, "but no CUDA toolkit: nvcc is not on PATH and CUDA_HOME is "),
])
def test_a_hopper_gpu_with_a_toolkit_that_cannot_build_stops_with_the_error(machine, toolkit, message):
    machine.update(smi=H200, toolkit=toolkit)
    with pytest.raises(SystemExit) as e:
        machine["plan"]()
    text = str(e.value)
    assert text.startswith("[megatron_tma] cannot build the CUDA kernels: GPU 0 NVIDIA H200 (sm_90) visible, but")
    assert message in text and "MEGATRON_TMA_NO_CUDA=1 installs the pure-Python package" in text


def test_the_switch_wins_both_ways(machine, monkeypatch):
    machine["smi"] = H200
    monkeypatch.setenv("MEGATRON_TMA_NO_CUDA", "1")
    assert machine["plan"]() == (False, "MEGATRON_TMA_NO_CUDA=1")
    machine["smi"] = None
    monkeypatch.setenv("MEGATRON_TMA_NO_CUDA", "0")  # a build host without the GPU
    assert machine["plan"]()[0]
    machine["toolkit"] = None
    with pytest.raises(SystemExit, match="MEGATRON_TMA_NO_CUDA=0, but no CUDA toolkit"):
        machine["plan"]()


def test_the_build_environment_gets_torch_and_cutlass_only_for_the_kernels(machine, monkeypatch):
    if backend._setuptools is None:
        pytest.skip("setuptools is not installed here (the build backend's hooks need it)")
    assert backend.get_requires_for_build_editable() == ["wheel"]  # no GPU: no torch in the build environment
    machine["smi"] = H200
    assert machine["plan"]()[0]  # and the toolkit is laid
    monkeypatch.setattr(backend, "_target_has_torch", lambda: True)  # the build imports that one
    assert backend.get_requires_for_build_wheel() == ["wheel", backend.CUTLASS_REQUIREMENT]
    monkeypatch.setattr(backend, "_target_has_torch", lambda: False)
    monkeypatch.setenv("CUTLASS_INCLUDE_DIR", "/somewhere/include")
    assert backend.get_requires_for_build_editable() == ["wheel", "torch>=2.4"]


def test_the_torch_installed_where_the_package_goes_is_found():
    import torch

    site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    assert backend._target_has_torch() == (site in backend.target_site_packages())
