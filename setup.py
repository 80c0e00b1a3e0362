"""Build megatron_tma.

`pip install -e .` builds the CUDA extension `megatron_tma._C` for sm_90a when a CUDA build of torch
and nvcc are both present; otherwise it installs the pure-Python package (reference backend only) and
says so. CuTe/CUTLASS headers come from the `nvidia-cutlass` wheel (only its headers are used).
"""
import glob
import os
import shlex
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def cutlass_include_dir():
    """Locate CuTe/CUTLASS headers: $CUTLASS_INCLUDE_DIR, else the nvidia-cutlass wheel's copy."""
    env = os.environ.get("CUTLASS_INCLUDE_DIR")
    if env:
        return env
    try:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
        if spec and spec.origin:
            path = os.path.join(os.path.dirname(spec.origin), "source", "include")
            if os.path.isdir(os.path.join(path, "cute")):
                return path
    except Exception:  # noqa: BLE001 - any import trouble means "not found"
        pass
    return None


def want_cuda():
    if os.environ.get("MEGATRON_TMA_NO_CUDA") == "1":
        return False, "MEGATRON_TMA_NO_CUDA=1"
    try:
        import torch
    except ImportError:
        return False, "torch is not importable at build time"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is None:
        return False, "nvcc not found (CUDA_HOME unset)"
    if cutlass_include_dir() is None:
        return False, "CuTe/CUTLASS headers not found (pip install --no-deps nvidia-cutlass)"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda})"


ext_modules, cmdclass = [], {}
build_cuda, why = want_cuda()
if build_cuda:
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    sources = sorted(glob.glob(os.path.join("csrc", "binding", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "instantiations", "*.cu")))
    includes = [os.path.join(ROOT, "csrc", "include"), cutlass_include_dir()]
    nvcc_flags = [
        "-O3", "-gencode=arch=compute_90a,code=sm_90a",
        "--expt-relaxed-constexpr", "--expt-extended-lambda", "-lineinfo",
        "-DNDEBUG", "-Xptxas=-v" if os.environ.get("MEGATRON_TMA_PTXAS_V") else "-Xptxas=-O3",
    ]
    # experiments only (benchmarks/tune_ffma_hints.sh): extra nvcc flags, e.g. "-Xptxas=--register-usage-level=10"
    nvcc_flags += shlex.split(os.environ.get("MEGATRON_TMA_NVCC_EXTRA", ""))
    ext_modules.append(
        CUDAExtension(
            "megatron_tma._C",
            sources,
            include_dirs=includes,
            extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},  # -std comes from torch
        )
    )
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)
    print(f"[megatron_tma] building the CUDA extension for sm_90a: {why}", file=sys.stderr)
else:
    print(f"[megatron_tma] pure-Python install (reference backend only): {why}", file=sys.stderr)

setup(
    name="megatron_tma",
    version="0.1.0",
    description="Unpadded FP8 grouped GEMMs (TMA-adaptive) for MoE training on Hopper",
    packages=find_packages(include=["megatron_tma", "megatron_tma.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
