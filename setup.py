"""Build megatron_tma.

`pip install -e .` builds the CUDA extension `megatron_tma._C` for sm_90a when a CUDA build of torch
and nvcc are both present; otherwise it installs the pure-Python package (reference backend only) and
says so. CuTe/CUTLASS headers come from the `nvidia-cutlass` wheel (only its headers are used); a CUDA torch with
nvcc but without them is an error (MEGATRON_TMA_NO_CUDA=1 asks for the pure-Python package explicitly).
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
        # A CUDA torch and nvcc mean a GPU build is wanted: installing without the kernels would leave backend="auto"
        # on the torch reference, ~10x slower (seen on the H200: a Megatron recipe at ~1 s per step instead of ~0.1 s)
        raise SystemExit("[megatron_tma] a CUDA build of torch and nvcc are here, but the CuTe/CUTLASS headers are "
                         "not: pip install --no-deps nvidia-cutlass (or set CUTLASS_INCLUDE_DIR); "
                         "MEGATRON_TMA_NO_CUDA=1 installs without the CUDA kernels")
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda})"


def apply_ffma_hints(so_path):
    """Rewrite the scheduling hints of the 128-wide M-grouped kernel's promotion FFMAs in the built extension
    (scripts/ffma_yield_patch.py, mode reuse-chain: the FP32 scale stays in the operand-reuse cache across each run
    of FFMAs). Measured +3.1% geomean on the five reference rows (docs/design.md §5), same bits (benchmarks/NOTES.md, M-grouped table;
    lab/tune_ffma_hints.sh). Control bits only, never an instruction. MEGATRON_TMA_FFMA_HINTS=none skips it;
    a build whose SASS has no such runs (another compiler, a compressed fatbin) is left as it is, with a note."""
    mode = os.environ.get("MEGATRON_TMA_FFMA_HINTS", "reuse-chain")
    if mode == "none":
        return
    import importlib.util

    script = os.path.join(ROOT, "scripts", "ffma_yield_patch.py")
    if not os.path.exists(script):  # e.g. a source distribution without scripts/
        print(f"[megatron_tma] FFMA hints not applied: {script} is missing", file=sys.stderr)
        return
    spec = importlib.util.spec_from_file_location("ffma_yield_patch", script)
    patcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patcher)
    with open(so_path, "rb") as f:
        blob = bytearray(f.read())
    report = patcher.patch(blob, patcher.BUILD_KERNEL_PATTERN, mode)  # the two-fragment 128 x 128 kernel only
    rewritten = sum(n for _, _, n in report)
    if rewritten:
        with open(so_path, "wb") as f:
            f.write(blob)
    print(f"[megatron_tma] FFMA hints ({mode}): {rewritten} control words rewritten in {len(report)} M-grouped kernel(s)"
          + ("" if rewritten else " (none found, or already applied)"), file=sys.stderr)


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
    # experiments only (lab/tune_ffma_hints.sh): extra nvcc flags, e.g. "-Xptxas=--register-usage-level=10"
    nvcc_flags += shlex.split(os.environ.get("MEGATRON_TMA_NVCC_EXTRA", ""))
    ext_modules.append(
        CUDAExtension(
            "megatron_tma._C",
            sources,
            include_dirs=includes,
            extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},  # -std comes from torch
        )
    )
    class BuildExtensionWithFfmaHints(BuildExtension.with_options(use_ninja=True)):
        def build_extension(self, ext):
            super().build_extension(ext)
            apply_ffma_hints(self.get_ext_fullpath(ext.name))

    cmdclass["build_ext"] = BuildExtensionWithFfmaHints
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
