"""Shared fixtures: a generator seeded per test, group-size distributions and group formats, Megatron on the CPU,
the host-compiled drivers of the plain-C++ scheduler headers."""
import os
import shutil
import subprocess
import tempfile
import zlib

import pytest
import torch
from _dists import DISTRIBUTIONS, EDGE_GROUPINGS, GROUP_FORMATS

from megatron_tma.groups import set_debug_checks


def pytest_terminal_summary(terminalreporter):
    """One line at the end, also under -q: whether the CUDA kernels were tested here, and if not, why not."""
    from megatron_tma import _ext

    why = _ext.kernels_unavailable()
    if why is None:
        terminalreporter.write_line(f"megatron_tma: the CUDA kernels were tested on {torch.cuda.get_device_name()}")
    else:
        terminalreporter.write_line(f"megatron_tma: the CUDA kernels are not available here, so the GPU tests "
                                    f"skipped: {why}", yellow=True)


@pytest.fixture
def gen(request) -> torch.Generator:
    """CPU generator seeded from the test id: fresh data per test, reproducible across runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=DISTRIBUTIONS)
def dist(request) -> str:
    return request.param


@pytest.fixture(params=sorted(EDGE_GROUPINGS))
def edge_grouping(request):
    return EDGE_GROUPINGS[request.param]


@pytest.fixture(params=GROUP_FORMATS, ids=lambda f: f"{f[0]}-{str(f[1]).replace('torch.', '')}")
def groups_format(request):
    return request.param


@pytest.fixture
def one_thread():
    """ATen's CPU elementwise kernels run SLEEF vector math on the body of each thread's chunk and libm on its
    tail, and the chunking follows the tensor size; with one thread and rows of multiples of 16 floats every
    element takes the vector path in both layouts. (CUDA kernels apply one formula to every element.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def debug_checks():
    """Host validation of device group tensors on for one test, then back to the environment's choice."""
    set_debug_checks(True)
    yield
    set_debug_checks(None)


@pytest.fixture(scope="module")
def cpp_driver(tmp_path_factory):
    """build(main) -> the path of tests/cpp/<main>.cpp compiled with the host compiler against csrc/include (the
    torch- and CUDA-free headers, e.g. the tile choices), warnings as errors."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert cxx, "a host C++ compiler (g++) is needed: nvcc needs one too"

    def build(main: str) -> str:
        exe = str(tmp_path_factory.mktemp(main) / main)
        subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I",
                        os.path.join(root, "csrc", "include"), os.path.join(root, "tests", "cpp", f"{main}.cpp"),
                        "-o", exe], check=True)
        return exe

    return build


@pytest.fixture(scope="module")
def megatron_cpu(tmp_path_factory):
    """A one-rank gloo process group and Megatron's parallel state, for building Megatron modules on the CPU."""
    import torch.distributed as dist
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl|DEPRECATED).*")
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0,
                                world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def quantizer_preconditions(monkeypatch):
    """The C++ quantizers' preconditions on their data input (contiguous, 16-byte aligned), asserted on the CPU: the
    package's internal `quant.run_*` calls skip the public rules, so whatever reaches them must already satisfy what
    the ops refuse on a GPU (csrc/binding/quantize.cpp). Returns the list of the inputs' (name, strides) seen."""
    from megatron_tma import quant

    seen = []
    for name in ("run_1x128", "run_grouped_128x1", "run_1x128_and_grouped_128x1"):
        real = getattr(quant, name)

        def checked(x, *args, _real=real, _name=name, **kwargs):
            seen.append((_name, x.stride()))
            assert x.is_contiguous(), f"{_name}: the op refuses a non-contiguous x (strides {x.stride()})"
            assert x.numel() == 0 or x.data_ptr() % 16 == 0, f"{_name}: the op refuses an x off a 16-byte boundary"
            return _real(x, *args, **kwargs)

        monkeypatch.setattr(quant, name, checked)
    return seen



@pytest.fixture
def another_job_saving():
    """Start another process that holds a save directory's lock (megatron_tma.mcore.checkpoint.hold_save_lock, as a
    live job saving there does): call it with the directory, get the process; it is killed at the test's end."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    started = []

    def start(directory):
        code = ("import sys, time; from megatron_tma.mcore import checkpoint; checkpoint.hold_save_lock(sys.argv[1]); "
                "print('held', flush=True); time.sleep(600)")
        proc = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": root}, cwd=root)
        started.append(proc)
        assert proc.stdout.readline().strip() == "held", "the lock-holding process did not start"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank (the CPU tests of in-place collectives on the weights)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
