"""`python -m megatron_tma`: the installation report and its exit status. On the CPU the GPU cases are simulated
(a visible sm_90 GPU without the extension is the silent ~10x slow path it exists to flag); `--check` runs on the
H200 (skipped elsewhere)."""
import subprocess
import sys

import pytest
import torch

from megatron_tma import __main__ as cli
from megatron_tma import _ext


def test_reports_and_exits_zero_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_gpus", lambda: [])
    assert cli.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "megatron_tma " in out and "torch " in out and "GPUs: none visible" in out and "nothing to check" in out


def test_module_runs_as_a_command():
    run = subprocess.run([sys.executable, "-m", "megatron_tma"], capture_output=True, text=True, timeout=120)
    assert run.returncode == (1 if torch.cuda.is_available() and not _ext.cuda_kernels_available() else 0), run
    assert "CUDA extension:" in run.stdout


@pytest.mark.parametrize("built, capability, why", [
    (False, (9, 0), "the CUDA extension is not built"),
    (True, (8, 0), "need an sm_90 (Hopper) GPU, this one is sm_80"),
])
def test_a_gpu_the_kernels_cannot_use_is_flagged(capsys, monkeypatch, built, capability, why):
    monkeypatch.setattr(cli, "_gpus", lambda: [(0, "Some GPU", capability)])
    monkeypatch.setattr(_ext, "has_extension", lambda: built)
    monkeypatch.setattr(_ext, "cuda_kernels_available", lambda device=None: built and capability == (9, 0))
    assert cli.main(["--check"]) == 1  # and no check runs: there is nothing to run it on
    out = capsys.readouterr().out
    assert "cuda:0 Some GPU" in out and why in out and "runs the torch reference" in out and "--check m_" not in out


def test_a_wrong_result_fails_the_check(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_gpus", lambda: [(0, "NVIDIA H200", (9, 0))])
    monkeypatch.setattr(_ext, "cuda_kernels_available", lambda device=None: True)
    monkeypatch.setattr(cli, "_check", lambda device: {"m_grouped_fp8_gemm": 2e-6, "k_grouped_fp8_gemm": 0.3})
    assert cli.main(["--check"]) == 2
    out = capsys.readouterr().out
    assert "m_grouped_fp8_gemm: diff vs float64 2.00e-06 (ok)" in out and "k_grouped_fp8_gemm" in out and "WRONG" in out


@pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")
def test_check_passes_on_the_gpu(capsys):
    assert cli.main(["--check"]) == 0
    assert capsys.readouterr().out.count("(ok)") == 2


@pytest.mark.skipif(_ext.has_extension(), reason="the extension is built here")
def test_a_pure_python_install_is_named_as_such():
    # Python's own message for the missing compiled module blames a circular import
    assert "pure-Python install" in str(_ext.extension_error())
