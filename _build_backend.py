"""The build backend (pyproject.toml names it): setuptools', plus one decision, made before anything is installed:
build the sm_90a CUDA kernels, or install the pure-Python package (reference backend only)?

- MEGATRON_TMA_NO_CUDA=1: pure Python. MEGATRON_TMA_NO_CUDA=0: build the kernels even with no Hopper GPU visible
  (a build host without the GPU); a missing piece is then an error.
- Otherwise the kernels are built when an sm_90 (Hopper) GPU is visible (nvidia-smi, honouring CUDA_VISIBLE_DEVICES).
  No GPU, or none of sm_90, gives the pure-Python package, whatever toolkit is installed: the kernels could not run
  there, and a toolkit on such a machine is often incomplete (nvcc without the CUDA headers).
- With a Hopper GPU visible the user wants the kernels: a missing nvcc, missing CUDA headers, a CPU build of torch or
  a failed compile stops the install with the error, rather than install a package whose backend="auto" would run
  the torch reference on that GPU, ~10x slower. MEGATRON_TMA_NO_CUDA=1 is the way to install without them.

Under pip's build isolation the build environment holds only what the build asks for: setuptools and wheel always,
and, only when the kernels are to be built, the CuTe/CUTLASS headers (the nvidia-cutlass wheel) and torch: the one
already installed where the package goes, so that the extension matches it (setup.py imports it from there), else
the newest from the index, as the install itself resolves. A CPU install so never downloads a CUDA torch for its
build. setup.py calls `cuda_build_plan`
again to decide what it builds, and writes the reason for a pure-Python install into the package
(`megatron_tma/_no_kernels.txt`), where `python -m megatron_tma` and the test header read it.
"""
import os
import shutil
import subprocess
import sys
import sysconfig

try:
    from setuptools import build_meta as _setuptools
    from setuptools.build_meta import *  # noqa: F401,F403  (every hook not redefined below)
except ImportError:  # imported for cuda_build_plan alone (the tests, `python _build_backend.py`) without setuptools
    _setuptools = None

CUTLASS_REQUIREMENT = "nvidia-cutlass==4.2.0.0"  # its headers only (cutlass_library/source/include)
TORCH_REQUIREMENT = "torch>=2.4"
HOPPER_NAMES = ("H100", "H200", "H800", "H20", "GH200")  # for drivers whose nvidia-smi lacks compute_cap


class CannotBuild(SystemExit):
    """A Hopper GPU is visible (or MEGATRON_TMA_NO_CUDA=0 asks for the kernels) but they cannot be built."""

    def __init__(self, what: str):
        super().__init__(f"[megatron_tma] cannot build the CUDA kernels: {what}. MEGATRON_TMA_NO_CUDA=1 installs the "
                         "pure-Python package (reference backend only) instead.")


def find_cuda_home():
    """The CUDA toolkit torch's extension builder will use: $CUDA_HOME, $CUDA_PATH, the folder above nvcc's on PATH,
    else /usr/local/cuda (torch.utils.cpp_extension's own order)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return "/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else None


def _cuda_visible_filter():
    """(None: every GPU nvidia-smi lists | set of indices or UUID prefixes | "none") from CUDA_VISIBLE_DEVICES."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or items[0] in ("-1", "none", "NoDevFiles"):
        return "none"
    return set(items)


def visible_gpus(run=None):
    """([(index, name, (major, minor) or None)], why-none) for the GPUs this process may use, from nvidia-smi."""
    wanted = _cuda_visible_filter()
    if wanted == "none":
        return [], f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
    run = run or subprocess.run
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "nvidia-smi not found"
    try:
        res = run([smi, "--query-gpu=index,uuid,name,compute_cap", "--format=csv,noheader"],
                  capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return [], f"nvidia-smi failed: {e}"
    if res.returncode != 0:
        first = (res.stderr or res.stdout or "").strip().splitlines()
        return [], f"nvidia-smi failed: {first[0] if first else f'exit status {res.returncode}'}"
    gpus = []
    for line in res.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        index, uuid, name, cap = parts[0], parts[1], ", ".join(parts[2:-1]), parts[-1]
        if wanted is not None and index not in wanted and not any(uuid.startswith(w) for w in wanted):
            continue
        try:
            major, minor = (int(v) for v in cap.split("."))
            capability = (major, minor)
        except ValueError:  # "[N/A]" from an old driver
            capability = None
        gpus.append((index, name, capability))
    return gpus, ("" if gpus else "nvidia-smi lists none")


def _is_hopper(gpu) -> bool:
    _, name, capability = gpu
    if capability is not None:
        return capability == (9, 0)
    return any(h in name for h in HOPPER_NAMES)


def _describe(gpu) -> str:
    index, name, capability = gpu
    return f"GPU {index} {name} (sm_{capability[0]}{capability[1]})" if capability else f"GPU {index} {name}"


def cuda_build_plan(run=None):
    """(build, reason). build: True to build the sm_90a kernels. reason: one line, for the build log and, on a
    pure-Python install, for `python -m megatron_tma`. Raises CannotBuild when the kernels are wanted (a Hopper GPU
    is visible, or MEGATRON_TMA_NO_CUDA=0) and a piece the build needs is missing."""
    switch = os.environ.get("MEGATRON_TMA_NO_CUDA", "").strip()
    if switch == "1":
        return False, "MEGATRON_TMA_NO_CUDA=1"
    if switch == "0":
        why = "MEGATRON_TMA_NO_CUDA=0"
    else:
        gpus, none_why = visible_gpus(run)
        if not gpus:
            return False, (f"no GPU visible ({none_why}); the kernels need a Hopper GPU "
                           "(MEGATRON_TMA_NO_CUDA=0 builds them anyway)")
        hopper = [g for g in gpus if _is_hopper(g)]
        if not hopper:
            return False, (f"no Hopper (sm_90) GPU visible ({', '.join(_describe(g) for g in gpus)}); the kernels are "
                           "sm_90a only (MEGATRON_TMA_NO_CUDA=0 builds them anyway)")
        why = f"{_describe(hopper[0])} visible"
    home = find_cuda_home()
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    if nvcc is None or not os.path.exists(nvcc):
        raise CannotBuild(f"{why}, but no CUDA toolkit: nvcc is not on PATH and CUDA_HOME is "
                          f"{'unset' if home is None else f'{home}, without bin/nvcc'}")
    if not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        hint = ""
        for other in ("/usr/local/cuda", os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))):
            if other != home and os.path.exists(os.path.join(other, "include", "cuda_runtime.h")):
                hint = f" (CUDA_HOME={other} has them)"
                break
        raise CannotBuild(f"{why}, but the CUDA toolkit at {home} (found from nvcc) lacks its headers: "
                          f"no {os.path.join(home, 'include', 'cuda_runtime.h')}{hint}")
    return True, f"{why}; CUDA toolkit {home}"


def target_site_packages():
    """The site-packages of the environment the package is being installed into (pip's build isolation hides them
    from sys.path; the interpreter is the same)."""
    paths = sysconfig.get_paths()
    found = {paths["purelib"], paths["platlib"]}
    cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    try:  # a venv made with --system-site-packages sees its base's packages too
        with open(cfg) as f:
            shares = any(line.replace(" ", "").strip().lower() == "include-system-site-packages=true" for line in f)
    except OSError:
        shares = False
    if shares:
        base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
        found |= {base["purelib"], base["platlib"]}
    return sorted(found)


def _target_has_torch() -> bool:
    try:
        from importlib import metadata

        return any((d.metadata["Name"] or "").lower() == "torch"
                   for d in metadata.distributions(path=target_site_packages()))
    except Exception:  # noqa: BLE001 - anything odd: let the build environment bring its own torch
        return False


def import_torch_for_the_build():
    """torch for building the extension: the build environment's, else the one installed where the package goes
    (the extension must match the torch it runs with, and that one may come from an index the build does not see)."""
    try:
        import torch
    except ImportError:
        sys.path.extend(p for p in target_site_packages() if p not in sys.path)
        import torch
    return torch


def _cuda_build_requirements():
    if not cuda_build_plan()[0]:
        return []
    reqs = [] if _target_has_torch() else [TORCH_REQUIREMENT]  # none installed: the newest, as the install resolves
    if not os.environ.get("CUTLASS_INCLUDE_DIR"):
        reqs.append(CUTLASS_REQUIREMENT)
    return reqs


# setuptools' own get_requires hooks run setup.py, which needs torch when building the kernels: it is not in the
# build environment yet at that point, and setup.py asks for nothing more, so the hooks answer without running it.
def get_requires_for_build_wheel(config_settings=None):
    return ["wheel"] + _cuda_build_requirements()


def get_requires_for_build_editable(config_settings=None):
    return ["wheel"] + _cuda_build_requirements()


def get_requires_for_build_sdist(config_settings=None):
    return _setuptools.get_requires_for_build_sdist(config_settings)


if __name__ == "__main__":  # `python _build_backend.py`: what an install here would do, and why
    try:
        build, reason = cuda_build_plan()
    except CannotBuild as e:
        print(e, file=sys.stderr)
        sys.exit(1)
    print(("builds the sm_90a kernels: " if build else "pure-Python install: ") + reason)
