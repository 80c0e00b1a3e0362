"""`python -m megatron_tma`: the installation report and its exit status. On the CPU the GPU cases are simulated
(a visible sm_90 GPU without the extension is the silent ~10x slow path it exists to flag); `--check` runs the
reference backend on the CPU where the kernels cannot run, the kernels on the H200."""
import subprocess
import sys

import pytest
import torch

from megatron_tma import __main__ as cli
from megatron_tma import _ext


def test_without_a_gpu_check_runs_the_reference_and_says_why_there_are_no_kernels(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_gpus", lambda: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "megatron_tma " in out and "torch " in out
    assert "CUDA kernels: not available here: no GPU visible (torch " in out
    assert "checks the reference backend on the CPU only" in out
    for op in ("quantize_1x128", "quantize_128x128", "quantize_grouped_128x1", "m_grouped_fp8_gemm",
               "k_grouped_fp8_gemm"):
        assert f"--check {op} (cpu): diff vs float64" in out
    assert out.count("(ok)") == 5 and "bits equal to the padded path" in out


def test_without_check_nothing_is_computed(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_gpus", lambda: [])
    monkeypatch.setattr(cli, "_check", lambda device: pytest.fail("ran a check"))
    assert cli.main([]) == 0
    assert "--check" not in capsys.readouterr().out


def test_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "Exit status:" in out and "  1  a GPU is visible" in out and "  2  --check found a wrong result" in out


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
    assert cli.main(["--check"]) == 1  # the reference checks pass on the CPU, but the GPU cannot run the kernels
    out = capsys.readouterr().out
    assert "cuda:0 Some GPU" in out and why in out and "runs the torch reference" in out
    assert "--check m_grouped_fp8_gemm (cpu)" in out and "(cuda:0)" not in out


@pytest.mark.parametrize("gpu", [True, False])
def test_a_wrong_result_fails_the_check(capsys, monkeypatch, gpu):
    monkeypatch.setattr(cli, "_gpus", lambda: [(0, "NVIDIA H200", (9, 0))] if gpu else [])
    monkeypatch.setattr(_ext, "cuda_kernels_available", lambda device=None: True)
    seen = []
    monkeypatch.setattr(cli, "_check", lambda device: seen.append(device) or {
        "quantize_1x128": (3e-4, cli.QUANT_TOLERANCE, None), "m_grouped_fp8_gemm": (2e-6, cli.GEMM_TOLERANCE, True),
        "k_grouped_fp8_gemm": (0.3, cli.GEMM_TOLERANCE, None)})
    assert cli.main(["--check"]) == 2
    assert seen == (["cuda:0"] if gpu else ["cpu"])
    out = capsys.readouterr().out
    assert "m_grouped_fp8_gemm" in out and "diff vs float64 2.00e-06, bits equal to the padded path (ok)" in out
    assert "k_grouped_fp8_gemm" in out and "WRONG: over 0.001" in out


def test_bits_that_differ_from_the_padded_path_fail_the_check(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_gpus", lambda: [])
    monkeypatch.setattr(cli, "_check", lambda device: {"m_grouped_fp8_gemm": (2e-6, cli.GEMM_TOLERANCE, False)})
    assert cli.main(["--check"]) == 2
    assert "bits DIFFER from the padded path (WRONG: bits differ)" in capsys.readouterr().out


@pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")
def test_check_passes_on_the_gpu(capsys):
    assert cli.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert out.count("(ok)") == 5 and out.count("(cuda:0)") == 5


@pytest.mark.skipif(_ext.has_extension(), reason="the extension is built here")
def test_a_pure_python_install_is_named_as_such():
    # Python's own message for the missing compiled module blames a circular import
    assert "pure-Python install" in str(_ext.extension_error())
