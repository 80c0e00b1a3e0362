"""Host time of one expert-MLP training step on the CUDA code path, measured on a CPU machine: every op of the
package is replaced by a CPU fake that only allocates its outputs (the ops' own fake kernels, megatron_tma.ops), so
what is timed is the package's Python (argument checks, weight cache, autograd Functions, module code) plus torch's
autograd engine, not kernel launches. It answers "how much host time does a step spend outside the ops" without
device time; on the GPU, `lab/probe_step_host.py` and `lab/profile_mlp_layer.py` time the real thing.

    python lab/probe_step_host_cpu.py [--G 32] [--layout stacked|per_expert] [--steps 50] [--profile] [--composed]

Shapes are Qwen3-like (H=2048, F=768) with M=2048 tokens (the fakes do not touch the data, so sizes matter only
through allocation). --profile prints cProfile's top entries by own time.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
import bench_mlp_layer as bml  # noqa: E402

from megatron_tma import _ext, groups, ops  # noqa: E402
from megatron_tma.mlp import GroupedFP8MLP  # noqa: E402


def _fake_ops():
    def m_grouped_out(a, a_scales, b, b_scales, groups, out, block_n=0, block_m=0):
        return None

    checked = []

    def k_grouped_out(dy_t, dy_t_scales, x_t, x_t_scales, groups, out, accumulate=False, *rest):
        # The op writes `out` in place. Its operands are the quantizer fakes' wgrad columns, dy_t [N, P] and
        # x_t [K, P] with the same P (docs/design.md §4: P = round_up(M, 128) + 128 G), and out is [G, N, K] with
        # G <= the scales' rows: checked on the first call only, so that the timed steps carry no work the real
        # op's Python side does not do.
        if not checked:
            n, p = dy_t.shape
            k, p2 = x_t.shape
            mb = dy_t_scales.shape[0]
            ok = (p2 == p and tuple(out.shape[1:]) == (n, k) and out.shape[0] <= mb
                  and tuple(dy_t_scales.shape) == (mb, n) and tuple(x_t_scales.shape) == (mb, k))
            if not ok:
                raise AssertionError(f"k_grouped op handed dy_t {tuple(dy_t.shape)}, x_t {tuple(x_t.shape)}, scales "
                                     f"{tuple(dy_t_scales.shape)} / {tuple(x_t_scales.shape)}, out {tuple(out.shape)}")
            checked.append(True)
        return None

    def act_forward(h, probs, act):
        return h.new_empty(h.shape[0], h.shape[1] // 2 if act == 0 else h.shape[1])

    def act_backward(dz, h, probs, act, *rest):
        return torch.empty_like(h), h.new_empty(h.shape[0], dtype=torch.float32)

    return types.SimpleNamespace(
        quantize_1x128=ops._fake_quantize_1x128,
        quantize_128x128=ops._fake_quantize_128x128,
        quantize_grouped_128x1=ops._fake_quantize_grouped_128x1,
        quantize_1x128_and_grouped_128x1=ops._fake_quantize_1x128_and_grouped_128x1,
        m_grouped_fp8_gemm_out=m_grouped_out,
        k_grouped_fp8_gemm_out=k_grouped_out,
        act_times_probs_forward=act_forward,
        act_times_probs_backward=act_backward,
    )


def _memoized(fake):
    """The fake's outputs made once per argument shapes and handed back on every later call: a CPU allocation of
    megabytes costs ~10 us here, where the GPU's caching allocator costs ~1, so allocating would time this machine's
    malloc, not the package."""
    made = {}

    def call(*args):
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        if key not in made:
            made[key] = fake(*args)
        return made[key]
    return call


def install_fake_ops(memoize: bool = True):
    """Route every op the package calls (`ops.kernel(name)`) to the CPU fakes (this process only). memoize: each
    fake's outputs are made once per shapes (`_memoized`), and the group values are not read on the host (the CPU
    tensors' free check, which the CUDA path never runs): what is left is the host work of the CUDA path minus the
    ops' C++ side."""
    for name, fake in vars(_fake_ops()).items():
        ops._OPS[name] = _memoized(fake) if memoize and name not in ("m_grouped_fp8_gemm_out",
                                                                     "k_grouped_fp8_gemm_out") else fake
    _ext.cuda_kernels_available = lambda device=None: True
    if memoize:
        groups.check_groups_values = lambda *args, **kwargs: None


def make_step(G, layout, M=2048, H=2048, F=768):
    """The layer benchmark's step (fresh gradients, weights re-quantized) on CPU tensors."""
    torch.manual_seed(0)
    module = GroupedFP8MLP(G, H, F, "swiglu", weight_layout=layout)
    sizes = torch.full((G,), M // G, dtype=torch.int64)
    sizes[-1] += M - int(sizes.sum())
    x = torch.randn(M, H).bfloat16().requires_grad_()
    probs = torch.rand(M).requires_grad_()
    dy = torch.randn(M, H).bfloat16()
    return bml.Step(module, x, sizes, probs, dy, requantize=True)


def host_ms_per_step(step, steps, reps=7):
    """Best of `reps` batches of `steps` steps, ms per step."""
    for _ in range(5):
        step()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t0) / steps)
    return 1e3 * best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--G", type=int, default=32)
    ap.add_argument("--layout", choices=("stacked", "per_expert"), default="stacked")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--allocate", action="store_true", help="every fake allocates its outputs at every call, and the "
                    "CPU group tensors' values are checked (the probe before memoized fakes)")
    ap.add_argument("--composed", action="store_true", help="the public entries (GroupedFP8MLP.planned_step = "
                    "False) instead of the planned step")
    args = ap.parse_args()
    install_fake_ops(memoize=not args.allocate)
    step = make_step(args.G, args.layout)
    step.module.planned_step = not args.composed
    print(f"G={args.G} {args.layout}: {host_ms_per_step(step, args.steps):.3f} ms of host time per step "
          "(fake ops, best of 7)")
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [step() for _ in range(args.steps)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
