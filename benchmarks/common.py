"""Measurement protocol shared by every benchmark (docs/design.md §5).

CUDA events around each call, an L2 flush (a >= 256 MB write) before each timed call, warm-up first, the
median of >= 20 timings. Ceilings (device-to-device copy bandwidth, dense FP8 GEMM rate) are measured in the
same process so that ratios are side by side. Results go to benchmarks/results/<name>-<YYYYMMDD-HHMM>.json in
one shape: {benchmark, commit, gpu, date, command, ceilings, rows, ...}.
"""
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys

import torch

# Benchmarks run from a source checkout with the extension built in place (setup.py build_ext --inplace):
# make the checkout's package importable whatever the caller's working directory or PYTHONPATH.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(1, _REPO_ROOT)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_FLUSH = None
_KERNELS_CHECKED = False


def kernels_problem(device=None):
    """None when this process can benchmark megatron_tma's CUDA kernels; else why it cannot, in one line."""
    from megatron_tma import _ext

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if not _ext.has_extension():
        return f"megatron_tma's CUDA extension is not built ({_ext.extension_error()})"
    if not _ext.cuda_kernels_available(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"the kernels need an sm_90 (Hopper) GPU, {torch.cuda.get_device_name(device)} is sm_{major}{minor}"
    return None


def require_kernels(device=None) -> None:
    """Refuse to benchmark where the kernels cannot run: backend="auto" would time the torch reference instead (after
    a failed build a benchmark printed timings 200x its roofline). Called before the first timing and by
    measure_ceilings, which every benchmark calls first."""
    global _KERNELS_CHECKED
    if _KERNELS_CHECKED:
        return
    problem = kernels_problem(device)
    if problem is not None:
        raise SystemExit(f"benchmarks: refusing to run: {problem}. The timings would be of the torch reference, not "
                         "of the kernels. `python -m megatron_tma --check` says more; the kernels build with "
                         "`pip install -e .` on a machine with a Hopper GPU and the CUDA toolkit.")
    _KERNELS_CHECKED = True


def flush_l2():
    """Evict L2 by writing 256 MB (H200's L2 is 60 MB)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    _FLUSH.fill_(1)


def _time_once(fn, flush: bool) -> float:
    require_kernels()
    if flush:
        flush_l2()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def bench(fn, iters: int = 25, warmup: int = 5, flush: bool = True) -> float:
    """Median milliseconds of `fn()` over `iters` calls, each timed alone with CUDA events after an L2 flush."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_time_once(fn, flush) for _ in range(iters))


def _warm_up(fns: dict, calls: int):
    """({name: error text} for the callables that raise, {name: callable} for the rest), each called `calls` times."""
    errors, live = {}, dict(fns)
    for name, fn in list(live.items()):
        try:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run here is recorded, not fatal
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            del live[name]
    return errors, live


def bench_interleaved(fns: dict, iters: int = 25, warmup: int = 5) -> dict:
    """Median milliseconds of each named callable, timed round-robin (one call of each per round, each after
    an L2 flush), so that clock and power drift over the run falls on every method alike. The rounds follow
    `carryover_balanced_orders`: over a design's rounds each method directly follows each other method equally
    often, so a neighbour's effect on the clock (an FP8 GEMM timed right after a dense cuBLAS GEMM runs slower) falls
    on every method alike too. A plain rotation does not do that: it keeps the cyclic order, so a method follows the
    same one in almost every round (in m_grouped-20261203-1749, `ours`, after `dense_cublas` in 22 of 25 rounds,
    took up to 9% longer than the identical forced-tile call). For long, power-hungry calls use bench_blocks: a call
    inherits the clock state its predecessor left (the Mixtral-sized FP8 layer step: 53 ms after itself, 59 ms
    after the BF16 step). A callable that raises is reported as the exception's text instead of a time."""
    results, live = _warm_up(fns, warmup)
    times = {name: [] for name in live}
    for name in interleaved_schedule(list(live), iters):
        times[name].append(_time_once(live[name], flush=True))
    results.update({name: statistics.median(t) for name, t in times.items()})
    return results


def carryover_balanced_orders(n: int) -> list:
    """Orders of range(n) (a Williams design: a Latin square balanced for first-order carry-over) in which every
    ordered pair (a, b), a != b, stands next to each other, b right after a, equally often: once over the n orders
    for even n, twice over the 2n orders for odd n. Every position holds every item equally often too."""
    if n <= 2:
        return [list(range(n))] if n < 2 else [[0, 1], [1, 0]]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(v + r) % n for v in first] for r in range(n)]
    return orders if n % 2 == 0 else orders + [o[::-1] for o in orders]


def interleaved_schedule(names: list, iters: int) -> list:
    """The timed calls of bench_interleaved in order: `iters` rounds, round r in the carry-over-balanced order
    r mod the design's length (the balance is exact when iters is a multiple of it: len(names), or twice that
    for an odd count)."""
    orders = carryover_balanced_orders(len(names))
    return [names[i] for r in range(iters) for i in orders[r % len(orders)]] if names else []


def bench_blocks(fns: dict, iters: int = 25, warmup: int = 3, rounds: int = 5) -> dict:
    """Median milliseconds of each named callable, timed in blocks: `rounds` rounds, each running every method
    (in an order rotated per round) for `warmup` untimed calls and then iters / rounds timed ones (each after
    an L2 flush). So every timed call follows a call of the same method, as a training step follows the
    previous step of the same layer, while clock drift over the run still falls on every method alike.
    Why not one call per method per round: on the H200 a long FP8 layer step timed right after the BF16
    step runs ~10% slower and the BF16 step ~5% faster than after their own kind (lab/profile_mlp_layer.py,
    Mixtral-sized layer: ours 53.0 ms after itself or after the padded twin, 59.1 after the BF16 step), so
    alternating methods measures the neighbour as much as the method. A callable that raises is reported as
    the exception's text instead of a time."""
    results, live = _warm_up(fns, 1)  # the schedule warms each method up again at every round
    times = {name: [] for name in live}
    for name, timed in block_schedule(list(live), iters, warmup, rounds):
        if timed:
            times[name].append(_time_once(live[name], flush=True))
        else:
            live[name]()
    results.update({name: statistics.median(t) for name, t in times.items()})
    return results


def block_schedule(names: list, iters: int, warmup: int, rounds: int) -> list:
    """The call sequence of bench_blocks: (name, timed) pairs. Round r runs the methods in the order rotated by r,
    each `warmup` untimed calls and then ceil(iters / rounds) timed ones, so every timed call directly follows a
    call of the same method."""
    per_round = -(-iters // rounds)
    seq = []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seq += [(name, False)] * warmup + [(name, True)] * per_round
    return seq


def time_methods(row: dict, fns: dict, flops: float, iters: int = 25) -> None:
    """Time `fns` interleaved and record `<name>_ms` and `<name>_tflops` (useful FLOPs) in `row`, or
    `<name>_error` for a method that cannot run here."""
    for name, res in bench_interleaved(fns, iters=iters).items():
        if isinstance(res, str):
            row[f"{name}_error"] = res
        else:
            row[f"{name}_ms"] = round(res, 5)
            row[f"{name}_tflops"] = round(flops / res / 1e9, 1)


def save_figure(fig, png: str, out_dir: str = None) -> None:
    """Write a matplotlib figure next to its JSON (and a copy into out_dir)."""
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    if out_dir:
        fig.savefig(os.path.join(out_dir, os.path.basename(png)), dpi=120)


def measure_ceilings(iters: int = 20) -> dict:
    """Copy bandwidth (bytes read + written per second) and dense FP8 GEMM rate, measured now."""
    require_kernels()
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    src.random_()
    dst = torch.empty_like(src)
    ms = bench(lambda d=dst, s=src: d.copy_(s), iters=iters, flush=False)  # bound now: both are deleted below
    copy_tbps = 2 * src.numel() / (ms * 1e-3) / 1e12
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), iters=iters)
    return {"copy_tbps": round(copy_tbps, 3), "dense_fp8_tflops": round(2 * n**3 / (ms * 1e-3) / 1e12, 1)}


def gpu_label() -> str:
    """The GPU's name for plot titles ("H100 80GB HBM3"), the vendor prefix dropped."""
    name = torch.cuda.get_device_name()
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name


def git_commit() -> str:
    env = os.environ.get("MEGATRON_TMA_COMMIT")
    if env:
        return env
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(RESULTS_DIR), text=True).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD", "--", "csrc", "megatron_tma"],
                                cwd=os.path.dirname(RESULTS_DIR)) != 0
        return sha + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - a copy without .git
        return "unknown"


def write_result(benchmark: str, rows, ceilings: dict, command: str, extra: dict = None, out_dir: str = None) -> str:
    """Write the docs/design.md §5 JSON; returns its path under benchmarks/results (and copies it to out_dir)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    doc = {
        "benchmark": benchmark,
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name(),
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "torch": torch.__version__,
        "ceilings": ceilings,
        "rows": rows,
    }
    doc.update(extra or {})
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{benchmark}-{now.strftime('%Y%m%d-%H%M')}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        shutil.copy(path, out_dir)
    return path
