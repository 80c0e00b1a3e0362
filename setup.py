"""Build megatron_tma: the sm_90a CUDA extension `megatron_tma._C` where it can run, else the pure-Python package.

Whether to build the kernels is decided by `_build_backend.cuda_build_plan` (read its docstring): a visible Hopper
GPU (or MEGATRON_TMA_NO_CUDA=0) builds them, and then anything missing stops the install with the error; no such GPU
(or MEGATRON_TMA_NO_CUDA=1) installs the pure-Python package (reference backend only), with one line saying why,
which is also kept in the package for `python -m megatron_tma`. CuTe/CUTLASS headers come from the `nvidia-cutlass`
wheel (only its headers are used) or $CUTLASS_INCLUDE_DIR.
"""
import glob
import os
import shlex
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)  # `python setup.py build_ext --inplace` too, not only pip (pyproject.toml's backend-path)
from _build_backend import CannotBuild, cuda_build_plan, import_torch_for_the_build  # noqa: E402

NO_KERNELS_FILE = os.path.join(ROOT, "megatron_tma", "_no_kernels.txt")  # why this install has no kernels


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
    """(build, reason), with the torch and CUTLASS checks that need the build environment's torch."""
    build, why = cuda_build_plan()
    if not build:
        return False, why
    try:
        torch = import_torch_for_the_build()
    except ImportError:
        raise CannotBuild(f"{why}, but torch is not importable (with --no-build-isolation, install torch first)") \
            from None
    if torch.version.cuda is None:
        raise CannotBuild(f"{why}, but torch {torch.__version__} is a CPU build: install a CUDA build of torch")
    if cutlass_include_dir() is None:
        raise CannotBuild(f"{why}, but the CuTe/CUTLASS headers are not here: pip install --no-deps "
                          "nvidia-cutlass==4.2.0.0 (or set CUTLASS_INCLUDE_DIR)")
    return True, f"{why}; torch {torch.__version__} (CUDA {torch.version.cuda})"


def record_no_kernels(reason):
    """Keep the reason for a pure-Python install in the package (None: this build has the kernels)."""
    if reason is None:
        if os.path.exists(NO_KERNELS_FILE):
            os.remove(NO_KERNELS_FILE)
        return
    with open(NO_KERNELS_FILE, "w") as f:
        f.write(reason + "\n")


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
    record_no_kernels(None)
    print(f"[megatron_tma] building the CUDA extension for sm_90a: {why}", file=sys.stderr)
else:
    record_no_kernels(why)
    print(f"[megatron_tma] PURE-PYTHON INSTALL, no CUDA kernels (reference backend only): {why}", file=sys.stderr)

TEST_REQUIRES = [
    "pytest>=7", "pytest-timeout", "psutil", "matplotlib", "numpy",
    'megatron-core==0.19.2; python_version >= "3.12"',  # the version the integration is tested with; needs 3.12
]

setup(
    name="megatron_tma",
    version="0.1.0",
    description="Unpadded FP8 grouped GEMMs (TMA-adaptive) for MoE training on Hopper",
    packages=find_packages(include=["megatron_tma", "megatron_tma.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    # "te": Transformer Engine for the recipe's --transformer-impl transformer_engine (GPU machines only; it builds
    # its PyTorch extension with nvcc). Never needed by the CPU install or the CPU tests; TE's tests skip without it.
    extras_require={"test": TEST_REQUIRES, "te": ['transformer-engine[pytorch]==2.20.2; python_version >= "3.12"']},
    package_data={"megatron_tma": ["_no_kernels.txt"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
