"""The launchers' per-device caches (csrc/include/megatron_tma/common/launch.h: SM count, shared-memory opt-in),
checked on the CPU against a fake CUDA runtime (tests/cpp/launch_cache_main.cpp). A process-wide cache launched a
second GPU with the first one's settings (its kernels then failed to launch for want of the opt-in)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cuda_include():
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and os.path.isfile(os.path.join(base, "include", "cuda_runtime.h")):
            return os.path.join(base, "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        inc = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")
        if os.path.isfile(os.path.join(inc, "cuda_runtime.h")):
            return inc
    return None


def test_sm_count_and_smem_opt_in_are_per_device(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    inc = _cuda_include()
    if not cxx or not inc:
        pytest.skip("needs a host C++ compiler and the CUDA toolkit's headers (cuda_runtime.h)")
    exe = str(tmp_path / "launch_cache")
    subprocess.run([cxx, "-std=c++17", "-O1", "-pthread", "-I", os.path.join(ROOT, "csrc", "include"), "-I", inc,
                    os.path.join(ROOT, "tests", "cpp", "launch_cache_main.cpp"), "-o", exe], check=True)
    out = subprocess.run([exe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
