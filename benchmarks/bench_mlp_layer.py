"""Expert-MLP layer benchmark (issue 5; protocol of docs/design.md §5): one training step of fc1 -> SwiGLU * probs -> fc2,
forward + backward (gradients for x, probs and every expert weight), time and peak memory, in one process on the
same inputs:

    ours          GroupedFP8MLP, unpadded FP8 grouped GEMMs
    padded_path   GroupedFP8MLP(pad_to=128): pad every expert's rows with zero rows, the same kernels, un-pad
    bf16          GroupedBF16MLP: the same layer on BF16 torch._grouped_mm (PyTorch's autograd)

All three run the same fused activation kernel (megatron_tma.activation), so the comparison measures the GEMMs,
quantization and padding, not the activation. Steps are timed in blocks of one method (common.bench_blocks): a step
timed right after another method's step inherits that method's clock state (measured: the FP8 step ~10% slower
after the BF16 step), and in training a step follows a step of the same layer.

All three modules have one parameter layout (`--weight-layout`, recorded per row): by default the modules' own,
one `[G, N, K]` weight per linear; `per_expert` gives G `[N, K]` parameters (Transformer Engine's names), whose
per-weight autograd bookkeeping makes the many-expert rows host-bound.

Each timed step re-quantizes the FP8 weights (a training step changes them; `--cached-weights` measures later
micro-batches, which reuse the copies). `--optimizer-write` starts every method's step with a mixed-precision
optimizer's write of its weights from FP32 masters (the weight refresh timed wherever it runs, in every twin: BF16
copies for the BF16 twin and the FP8 modules, re-quantized after); `--release-bf16-weights` (implies it) gives the FP8
modules `release_bf16_weights=True`, whose write makes their FP8 copies straight from the masters
(megatron_tma.released_weights). `<method>_peak_mb` is every byte of the layer at its peak: the parameters and FP8
copies it holds between steps plus the step's peak (torch.cuda.max_memory_allocated over one step minus what was
allocated before it) with x and dY handed over as in a model, so that only the layer keeps x (the BF16 GEMMs save it,
ours keeps its FP8 columns); `<method>_step_peak_mb` is the step's own peak with the caller holding x, y and dY.
Rows of the six configurations measured with Transformer Engine 2.20 (GroupedLinear + blockwise FP8 behind
Fp8Padding, Megatron's Hopper FP8 expert path) carry those QUOTED numbers from issue 5 as `te_fp8_ms_reported` /
`te_bf16_ms_reported`, on an H200 only (the GPU they come from): they were not measured by this script.
Every method's step is also captured whole in a CUDA graph and timed replayed (`<method>_graph_ms`; the layer is
sync-free, so forward + backward capture; with re-quantized weights the graph contains the weight quantization),
which takes the host out of the step: `<method>_host_ms` is the host time to enqueue one eager step. `graph_bitexact`:
our graphed step gives the eager step's bits and the graphed padded twin's.
Writes benchmarks/results/mlp_layer-<stamp>.json (`mlp_layer_micro_batches-<stamp>.json` with --micro-batches > 1) and a
PNG; the table prints last.

    python benchmarks/bench_mlp_layer.py [--quick] [--cached-weights] [--weight-layout per_expert] [--no-graphs]
                                         [--optimizer-write | --release-bf16-weights] [--micro-batches N]
                                         [--iters N] [--out DIR]
"""
import argparse
import gc
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from megatron_tma import testing  # noqa: E402
from megatron_tma.groups import make_group_sizes  # noqa: E402
from megatron_tma import weight_refresh  # noqa: E402
from megatron_tma.mlp import WEIGHT_LAYOUTS, GroupedBF16MLP, GroupedFP8MLP  # noqa: E402
from megatron_tma.released_weights import held_copies, write_weights_from_masters  # noqa: E402

MODELS = {  # name: (hidden H, expert ffn F, local experts G)
    "deepseek_v3": (7168, 2048, (8, 32)),
    "mixtral": (4096, 14336, (8,)),
    "qwen3_30b_a3b": (2048, 768, (32, 128)),
}
TOKENS = (8192, 32768)
DISTS = ("paper", "skewed")
METHODS = ("ours", "padded_path", "bf16")
DEV = "cuda"
# Issue 5: TE 2.20 GroupedLinear (blockwise FP8 behind Fp8Padding) and TE BF16, H200, paper sizes, fwd + bwd, ms.
# Ratios against them are only formed on the GPU they were quoted from (an H100 has 0.7x the H200's memory bandwidth).
TE_REPORTED_GPU = "H200"
TE_REPORTED = {
    ("deepseek_v3", 8, 32768): (13.9, 15.1),
    ("deepseek_v3", 32, 8192): (17.4, 10.2),
    ("deepseek_v3", 32, 32768): (21.1, 17.5),
    ("mixtral", 8, 32768): (53.9, 65.8),
    ("qwen3_30b_a3b", 32, 32768): (18.0, 9.1),
    ("qwen3_30b_a3b", 128, 32768): (62.5, 28.7),
}


def te_reported_comparable(gpu_name=None) -> bool:
    """Whether this GPU is the one TE_REPORTED was measured on, so that a ratio against those numbers means something."""
    return TE_REPORTED_GPU in (gpu_name if gpu_name is not None else torch.cuda.get_device_name())


def configs(quick):
    if quick:
        return [(model, G, M, "paper") for (model, G, M) in TE_REPORTED]
    return [(model, G, M, dist) for model, (_, _, gs) in MODELS.items() for G in gs for M in TOKENS for dist in DISTS]


def te_rows():
    """(model, G, M, seed) of the six paper-distribution rows with quoted Transformer Engine numbers, each with its
    seed in the full grid (row i has seed 2000 + i), for the experiments that time those rows."""
    grid = configs(quick=False)
    return [(model, G, M, 2000 + grid.index((model, G, M, "paper"))) for model, G, M in TE_REPORTED]


class _HandedInput(torch.autograd.Function):
    """x as a model hands it to its experts: a fresh tensor made by the op before (the token dispatch), which no one
    but the layer keeps after the layer's forward; its gradient flows on to the leaf."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dx):
        return dx


class _ConsumedOutput(torch.autograd.Function):
    """The op after the layer (the token combine) as far as memory goes: it reads y and keeps nothing of it, and its
    backward hands the layer a fresh dY (a copy of `dy`) that only autograd holds, freed once the layer's last node
    that reads it is done."""

    @staticmethod
    def forward(ctx, y, dy):
        ctx.dy = dy
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.dy.clone(), None


class Step:
    """One training step of one module on fixed inputs; the gradients it makes replace the previous ones.
    `handed=True` (`peak_mb`'s layer peak only, never timed): x, y and dY live as in a model (`_HandedInput`,
    `_ConsumedOutput`), so that a layer pays for the inputs it keeps (the BF16 GEMMs' autograd saves x; the FP8
    layer keeps x's FP8 columns), not for the caller's."""

    def __init__(self, module, x, sizes, probs, dy, requantize, optimizer_write=False):
        self.module, self.x, self.sizes, self.probs, self.dy = module, x, sizes, probs, dy
        self.requantize = requantize and hasattr(module, "invalidate_weight_cache")
        # optimizer_write: each step starts with a mixed-precision optimizer's write of the weights from FP32 masters
        # held here (outside the layer's bytes, as an optimizer's masters are for every method): the BF16 weights
        # copied from them, or for layers that release theirs the FP8 copies written from them
        self.masters = [p.detach().float() for p in module.parameters()] if optimizer_write else None

    def reset(self):
        self.x.grad = self.probs.grad = None
        self.module.zero_grad(set_to_none=True)
        if self.masters is not None:
            rest = write_weights_from_masters(list(self.module.parameters()), self.masters)
            with torch.no_grad():
                for p, m in rest:
                    p.copy_(m)
        if self.requantize:  # (a no-op for copies just written from the masters)
            self.module.invalidate_weight_cache()

    def __call__(self, handed=False):
        self.reset()
        return self.forward_backward(handed)

    def forward_backward(self, handed=False):
        """One forward + backward on the inputs: the output, or None when `handed` (no name holds y then: it is
        freed once the op after has read it)."""
        if handed:
            _ConsumedOutput.apply(self.module(_HandedInput.apply(self.x), self.sizes, self.probs)[0],
                                  self.dy).backward()
            return None
        out, _ = self.module(self.x, self.sizes, self.probs)
        out.backward(self.dy)
        return out

    def results(self):
        out = self()
        return [out.detach(), self.x.grad, self.probs.grad] + [w.grad for w in self.module.parameters()]

    def resident_bytes(self):
        """What the layer holds between steps, after `reset`: its parameters, and the FP8 weight copies its caches
        keep (none when the step re-quantizes; with cached weights, W's and, unless `keep_transposed_weight=False`,
        W^T's)."""
        # the parameters' memory as allocated (released BF16 weights hold none), each storage once
        held = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in self.module.parameters()}.values())
        held += sum(p.main_grad.numel() * 4 for p in self.module.parameters() if hasattr(p, "main_grad"))
        for m in self.module.modules():
            value = held_copies(m.weight_cache) if hasattr(m, "weight_cache") else None
            held += sum(t.numel() * t.element_size() for t in (value or ()) if t is not None)
        return held

    def _step_peak(self, handed):
        self.reset()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self(handed=handed)
        torch.cuda.synchronize()
        step = torch.cuda.max_memory_allocated() - base
        self.reset()
        return step

    def peak_mb(self):
        """(the layer's peak: the step's peak with the inputs handed over as in a model (`handed`) plus what the layer
        holds before the step, so that no form of the weights and no kept input drops out; the step's own peak:
        max_memory_allocated over one step minus what was allocated before it, the inputs held by the caller), MB."""
        self.reset()  # (what the layer holds between steps: after the reset, no copy a re-quantizing cache drops)
        resident = self.resident_bytes()
        return (self._step_peak(True) + resident) / 2**20, self._step_peak(False) / 2**20


class AccumulatingStep(Step):
    """A training step of `micro_batches` forward + backward passes on the same inputs, the weight gradients
    accumulated into FP32 `main_grad`s as under Megatron's DDP: the FP8 modules' GEMM accumulates into them (with
    `defer_wgrad`, one flush after the last micro-batch), the BF16 module's `.grad` is added into them after each
    micro-batch (DDP's hook for weights without fused accumulation). The weights are re-quantized at the step's first
    micro-batch only (later ones reuse the copies, as Megatron's experts do)."""

    def __init__(self, module, x, sizes, probs, dy, requantize, micro_batches, optimizer_write=False):
        super().__init__(module, x, sizes, probs, dy, requantize, optimizer_write)
        self.micro_batches = micro_batches
        self.params = list(module.parameters())
        for w in self.params:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        self.deferred = getattr(getattr(module, "linear_fc1", None), "wgrad_deferral", None) is not None

    def reset(self):
        super().reset()
        for w in self.params:
            w.main_grad.zero_()

    def __call__(self, handed=False):
        self.reset()
        for _ in range(self.micro_batches):
            out = self.forward_backward(handed)
            for w in self.params:
                if w.grad is not None:  # the BF16 module's; the FP8 ones' went into main_grad
                    w.main_grad.add_(w.grad)
                    w.grad = None
        if self.deferred:
            self.module.flush_wgrad()
        return out

    def results(self):
        out = self()
        return [out.detach(), self.x.grad, self.probs.grad] + [w.main_grad for w in self.params]


def warm_up_and_capture(step, forward, warmup, backward=True):
    """(a CUDA graph of `forward()` and, with `backward`, its output's backward with `step.dy`; the output): `step` run
    `warmup` times first on a side stream (autograd and the libraries warm up off the capture stream), then reset."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    step.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
        if backward:
            out.backward(step.dy)
    return graph, out


class GraphStep:
    """The same training step captured once in a CUDA graph and replayed: what a step costs without the host (the
    layer is sync-free, so the whole forward + backward captures; the group sizes are read on the device, so a
    replay with new sizes in the same buffers is right: tests/test_mlp_gpu.py). With re-quantized weights the
    capture includes the weight quantization (as every capture of the FP8 linears does by default), so every replay
    re-quantizes; with cached weights the linears are told to read the copies the warm-up made
    (`graph_reuses_cached_weights`). The gradients are the graph's own buffers."""

    def __init__(self, step: Step, warmup: int = 2):
        if not step.requantize:  # the cached-weights regime: the graph reads the copies (by default it quantizes)
            for m in step.module.modules():
                if hasattr(m, "graph_reuses_cached_weights"):
                    m.graph_reuses_cached_weights = True
        self.graph, out = warm_up_and_capture(step, lambda: step.module(step.x, step.sizes, step.probs)[0], warmup)
        self.outputs = [out.detach(), step.x.grad, step.probs.grad] + [w.grad for w in step.module.parameters()]
        self.module = step.module

    def __call__(self):
        self.graph.replay()

    def results(self):
        self()
        return self.outputs


class GraphedMicroBatches:
    """An AccumulatingStep from a CUDA graph: one micro-batch (forward, backward, the weight gradients into
    `main_grad`) captured once; a step zeroes `main_grad`, signals an optimizer step when the step re-quantizes (the
    device counter that step-refreshed weights read: megatron_tma.weight_refresh) and replays the graph once per
    micro-batch. The default FP8 module's graph re-quantizes its weights in every replay (a capture cannot hold the
    host cache); with `step_refreshed_weights=True` only the first replay after the signal does."""

    def __init__(self, step: AccumulatingStep, warmup: int = 2):
        self.step = step

        def micro_batch():
            out, _ = step.module(step.x, step.sizes, step.probs)
            out.backward(step.dy)
            for w in step.params:
                if w.grad is not None:  # the BF16 module's (DDP's hook); the FP8 ones' went into main_grad
                    w.main_grad.add_(w.grad)
            return out

        # (the eager warm-up also makes the step-refreshed weights' buffers, which a capture cannot)
        self.graph, self.out = warm_up_and_capture(step, micro_batch, warmup, backward=False)

    def __call__(self):
        for w in self.step.params:
            w.main_grad.zero_()
        if self.step.requantize:
            weight_refresh.note_optimizer_step()
        for _ in range(self.step.micro_batches):
            self.graph.replay()
        return self.out

    def results(self):
        """(the last micro-batch's output, then every main_grad): x.grad is the graph's own buffer, one micro-batch's."""
        self()
        return [self.out.detach()] + [w.main_grad for w in self.step.params]


def host_ms(fn, calls: int = 5) -> float:
    """Median host time to enqueue one step (the call returns before the GPU finishes: nothing in it syncs), each
    call made with the GPU idle, so that a full launch queue does not stall it."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return statistics.median(times)


def layer_inputs(model, G, M, dist, seed, dev=DEV):
    """(H, F, sizes [G] on the host, x, probs, dy) of one layer row, drawn from `seed` (x and probs are leaves that
    want gradients); also seeds torch's generator for the modules the caller builds next, so every script that
    times a row (this one, the experiments, the profilers) builds the same layer from the same seed."""
    H, F, _ = MODELS[model]
    sizes = make_group_sizes(M, G, dist, seed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(M, H, generator=gen, device=dev).bfloat16().requires_grad_()
    probs = torch.rand(M, generator=gen, device=dev).requires_grad_()
    dy = torch.randn(M, H, generator=gen, device=dev).bfloat16()
    torch.manual_seed(seed)
    return H, F, sizes, x, probs, dy


def run_config(model, G, M, dist, seed, iters, requantize, weight_layout="stacked", graphs=True,
               keep_transposed_weight=True, micro_batches=1, defer_wgrad=False, release_bf16_weights=False,
               optimizer_write=False, planned_step=True):
    dev = DEV
    H, F, sizes, x, probs, dy = layer_inputs(model, G, M, dist, seed, dev)
    fp8 = {"weight_layout": weight_layout, "device": dev, "keep_transposed_weight": keep_transposed_weight,
           "defer_wgrad": defer_wgrad, "release_bf16_weights": release_bf16_weights}
    ours = GroupedFP8MLP(G, H, F, "swiglu", **fp8)
    padded = GroupedFP8MLP(G, H, F, "swiglu", pad_to=128, **fp8)
    ours.planned_step = padded.planned_step = planned_step
    bf16 = GroupedBF16MLP(G, H, F, "swiglu", weight_layout=weight_layout, device=dev)
    padded.load_state_dict(ours.state_dict())
    bf16.load_state_dict(ours.state_dict())
    groups = sizes.to(dev)
    graphed_micro_batches = micro_batches > 1 and graphs and not defer_wgrad  # (the flush's lists are host state)
    if micro_batches > 1:  # a step of micro-batches into main_grad (GraphedMicroBatches below, not GraphStep)
        steps = {name: AccumulatingStep(m, x, groups, probs, dy, requantize, micro_batches, optimizer_write)
                 for name, m in zip(METHODS, (ours, padded, bf16))}
        graphs = False
    else:
        steps = {name: Step(m, x, groups, probs, dy, requantize, optimizer_write)
                 for name, m in zip(METHODS, (ours, padded, bf16))}

    padded_rows = int((-(-sizes // 128) * 128).sum())
    # fc1 (2F outputs) + fc2 (F inputs), each forward, dgrad and wgrad, per micro-batch
    flops = micro_batches * 3 * 2.0 * M * H * (3 * F)
    row = {"model": model, "G": G, "M": M, "H": H, "F": F, "dist": dist, "seed": seed,
           "pad_rows_pct": round(100.0 * (padded_rows - M) / M, 2), "max_group": int(sizes.max()),
           "empty_groups": int((sizes == 0).sum()), "weights_requantized_per_step": requantize,
           "weight_layout": weight_layout, "keep_transposed_weight": keep_transposed_weight,
           "planned_step": planned_step,
           "micro_batches": micro_batches, "defer_wgrad": defer_wgrad, "release_bf16_weights": release_bf16_weights,
           "optimizer_write_in_step": optimizer_write}

    times = common.bench_blocks(steps, iters=iters)  # each step timed after its own kind (see bench_blocks)
    for name in METHODS:
        if isinstance(times[name], str):
            row[f"{name}_error"] = times[name]
            continue
        row[f"{name}_ms"] = round(times[name], 4)
        row[f"{name}_tflops"] = round(flops / times[name] / 1e9, 1)
        layer_mb, step_mb = steps[name].peak_mb()
        row[f"{name}_peak_mb"], row[f"{name}_step_peak_mb"] = round(layer_mb, 1), round(step_mb, 1)

    for name in METHODS:
        if f"{name}_ms" in row:
            row[f"{name}_host_ms"] = round(host_ms(steps[name]), 4)

    # The twins' results, compared before any graph replays into their gradients: x and probs are leaves shared by
    # the twins (their gradients cloned, the next twin's step overwrites them); each twin's weight gradients are its
    # own (not cloned: at DeepSeek-V3's G = 32 they are 5.6 GB in FP32)
    a = steps["ours"].results()
    a = [t.clone() for t in a[:3]] + a[3:]
    b = steps["padded_path"].results()
    row["bitexact"] = all(torch.equal(u, v) for u, v in zip(a, b))
    if "bf16_ms" in row:
        row["max_diff_vs_bf16"] = max(testing.diff(u, v) for u, v in zip(a, steps["bf16"].results())
                                      if v.abs().sum() > 0)
    del a, b
    if graphs:  # the same steps replayed from CUDA graphs: no host time; same bits as eager
        graphed = time_graphs(row, {name: steps[name] for name in METHODS if f"{name}_ms" in row}, GraphStep, iters)
        for name in graphed:
            if f"{name}_graph_ms" in row:
                row[f"{name}_graph_host_ms"] = round(host_ms(graphed[name]), 4)
        if "ours" in graphed and "padded_path" in graphed:
            eager = steps["ours"].results()  # the eager step again, after the captures (their inputs unchanged)
            row["graph_bitexact"] = all(torch.equal(u, v) for u, v in zip(graphed["ours"].results(), eager)) and all(
                torch.equal(u, v) for u, v in zip(graphed["ours"].results(), graphed["padded_path"].results()))
        if "ours_graph_ms" in row and "bf16_graph_ms" in row:
            row["graph_speedup_vs_bf16"] = round(row["bf16_graph_ms"] / row["ours_graph_ms"], 4)
        if "ours_graph_ms" in row and "padded_path_graph_ms" in row:
            row["graph_speedup_vs_padded_path"] = round(row["padded_path_graph_ms"] / row["ours_graph_ms"], 4)
        del graphed
    if graphed_micro_batches:
        graph_micro_batches(row, steps, fp8, G, H, F, iters)
    if "ours_ms" in row:
        for base in ("padded_path", "bf16"):
            if f"{base}_ms" in row:
                row[f"speedup_vs_{base}"] = round(row[f"{base}_ms"] / row["ours_ms"], 4)
        te = TE_REPORTED.get((model, G, M)) if dist == "paper" and te_reported_comparable() else None
        if te:
            row["te_fp8_ms_reported"], row["te_bf16_ms_reported"] = te
            row["speedup_vs_te_fp8_reported"] = round(te[0] / row["ours_ms"], 4)
    del steps, ours, padded, bf16
    gc.collect()
    torch.cuda.empty_cache()
    return row


def time_graphs(row, steps, capture, iters):
    """{name: capture(step)} for each of `steps` that captures, timed in blocks into `row[<name>_graph_ms]`; a capture
    or replay that raises is recorded as `<name>_graph_error`, as a method that cannot run."""
    graphed = {}
    for name, step in steps.items():
        try:
            graphed[name] = capture(step)
        except Exception as e:  # noqa: BLE001 - recorded, as a method that cannot run
            row[f"{name}_graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    for name, ms in common.bench_blocks(graphed, iters=iters).items():
        if isinstance(ms, str):
            row[f"{name}_graph_error"] = ms
        else:
            row[f"{name}_graph_ms"] = round(ms, 4)
    return graphed


def graph_micro_batches(row, steps, fp8, G, H, F, iters):
    """The micro-batch step from CUDA graphs (GraphedMicroBatches): ours as a graph captures it by default (the
    weights re-quantized in every replay), ours with step-refreshed weights (once a step) and the BF16 twin;
    `<name>_graph_ms` per step, `graph_bitexact`: the refreshed graph's output and main_grads equal the eager step's."""
    ours = steps["ours"].module
    refreshed = GroupedFP8MLP(G, H, F, "swiglu", step_refreshed_weights=True, **fp8)
    refreshed.load_state_dict(ours.state_dict())
    s = steps["ours"]
    eager = {"ours": s, "ours_refreshed": AccumulatingStep(refreshed, s.x, s.sizes, s.probs, s.dy, s.requantize,
                                                           s.micro_batches), "bf16": steps["bf16"]}
    graphed = time_graphs(row, eager, GraphedMicroBatches, iters)
    if "ours_refreshed" in graphed:
        want = s.results()
        want = [want[0]] + want[3:]  # the output and the main_grads (x.grad sums the micro-batches eagerly)
        row["graph_bitexact"] = all(torch.equal(u, v) for u, v in zip(graphed["ours_refreshed"].results(), want))
    for name in ("ours", "bf16"):
        if f"{name}_graph_ms" in row and "ours_refreshed_graph_ms" in row:
            row[f"refreshed_graph_speedup_vs_{name}_graph"] = round(
                row[f"{name}_graph_ms"] / row["ours_refreshed_graph_ms"], 4)
    if "ours_ms" in row and "ours_refreshed_graph_ms" in row:
        row["refreshed_graph_speedup_vs_eager"] = round(row["ours_ms"] / row["ours_refreshed_graph_ms"], 4)
    del graphed, eager, refreshed


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(rows):
    not_run = [f"{r['model']} G={r['G']} M={r['M']} {r['dist']}: {r['error']}" for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    if not rows:  # (no row ran: nothing is bit-exact or at or below a peak)
        return {"rows_not_run": not_run, "all_bitexact": None}
    te = [r["speedup_vs_te_fp8_reported"] for r in rows if "speedup_vs_te_fp8_reported" in r]
    mem_rows = [r for r in rows if "ours_peak_mb" in r and "padded_path_peak_mb" in r]
    return {
        "geomean_vs_padded_path": geomean([r.get("speedup_vs_padded_path") for r in rows]),  # target >= 1.15
        "geomean_vs_bf16_m32768": geomean([r.get("speedup_vs_bf16") for r in rows if r["M"] == 32768]),  # >= 1.4
        "min_vs_te_fp8_reported": min(te) if te else None,  # target >= 1.3
        "geomean_vs_te_fp8_reported": geomean(te) if te else None,  # target >= 2.5
        "peak_mb_at_or_below_padded_everywhere": all(r["ours_peak_mb"] <= r["padded_path_peak_mb"] for r in mem_rows),
        "peak_mb_below_padded_where_padding_adds_rows": all(
            r["ours_peak_mb"] < r["padded_path_peak_mb"] for r in mem_rows if r["pad_rows_pct"] > 0),
        "all_bitexact": all(r["bitexact"] for r in rows),
        # everything the layer holds across a step (parameters, FP8 copies, gradients, kept inputs, the step's
        # memory): ours / BF16
        "max_peak_vs_bf16": max((r["ours_peak_mb"] / r["bf16_peak_mb"] for r in rows
                                 if "ours_peak_mb" in r and "bf16_peak_mb" in r), default=None),
        # CUDA-graphed steps (no host time): ours vs the BF16 layer, graphed too, at M = 32768
        "graph_geomean_vs_bf16_m32768": geomean([r.get("graph_speedup_vs_bf16") for r in rows if r["M"] == 32768]),
        "graph_all_bitexact": all(r.get("graph_bitexact", True) for r in rows),
        "rows_not_run": not_run,  # every row of the grid runs unless it is listed here
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the six rows with quoted Transformer Engine numbers")
    ap.add_argument("--cached-weights", action="store_true",
                    help="reuse the FP8 weight copies across steps (later micro-batches) instead of re-quantizing")
    ap.add_argument("--weight-layout", choices=WEIGHT_LAYOUTS, default="stacked",
                    help="the parameter layout of all three modules: one [G, N, K] weight per linear (default) or "
                         "G [N, K] ones (Transformer Engine's GroupedLinear names; ~6 us more host time per expert "
                         "weight per step)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="time the eager steps only (by default each method's step is also captured in a CUDA graph "
                         "and timed replayed: `<method>_graph_ms`; graphs hold their own gradient buffers)")
    ap.add_argument("--transpose-in-backward", action="store_true",
                    help="the FP8 modules keep W's copy only and make W^T's in backward (keep_transposed_weight="
                         "False: the same bits, less held across the step)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="a step of this many forward + backward passes, weight gradients accumulated into FP32 "
                         "main_grads as under Megatron's DDP (no CUDA graphs then)")
    ap.add_argument("--defer-wgrad", action="store_true",
                    help="with --micro-batches: the FP8 modules compute their weight gradients once a step "
                         "(defer_wgrad=True, one flush after the last micro-batch)")
    ap.add_argument("--optimizer-write", action="store_true",
                    help="every method's step starts with a mixed-precision optimizer's write of its weights from "
                         "FP32 masters (the BF16 weights copied from them; the FP8 ones re-quantized after): the "
                         "weight refresh timed wherever it runs, in every twin. Eager only (no graphs)")
    ap.add_argument("--release-bf16-weights", action="store_true",
                    help="the FP8 modules free their BF16 weights after the step's first forward has quantized them "
                         "(release_bf16_weights=True, megatron_tma.released_weights), and the optimizer's write gives "
                         "them FP8 copies straight from the FP32 masters instead; implies --optimizer-write unless "
                         "--cached-weights (then the FP8 copies are all the layer holds)")
    ap.add_argument("--composed-step", action="store_true",
                    help="the FP8 modules call their linears and activation through the public entries "
                         "(planned_step=False) instead of the planned step: the same bits, the host time of before "
                         "(A/B runs)")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None,
                    help="only these models' rows (each keeps its seed in the full grid)")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default=None, help="also copy the JSON and PNG here")
    args = ap.parse_args()
    if args.micro_batches < 1 or (args.defer_wgrad and args.micro_batches < 2):
        ap.error("--micro-batches must be >= 1, and --defer-wgrad needs >= 2 of them (one step's weight gradients)")
    if args.optimizer_write and args.cached_weights:
        ap.error("--optimizer-write: cached weights are the later micro-batches of a step, which no optimizer write "
                 "precedes; leave out --cached-weights (or use --micro-batches)")
    # released weights change only through the optimizer's write (with --cached-weights: none, the copies held)
    args.optimizer_write = args.optimizer_write or (args.release_bf16_weights and not args.cached_weights)
    if (args.optimizer_write or args.release_bf16_weights) and not args.no_graphs:
        ap.error("--optimizer-write / --release-bf16-weights: the optimizer's write is host code a graph does not hold "
                 "(and a layer that frees its weights is not captured); add --no-graphs")
    ceilings = common.measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    rows = []
    todo = [(i, c) for i, c in enumerate(configs(args.quick)) if args.models is None or c[0] in args.models]
    for n, (i, (model, G, M, dist)) in enumerate(todo):  # a row keeps its seed when --models leaves others out
        try:
            row = run_config(model, G, M, dist, seed=2000 + i, iters=args.iters,
                             requantize=not args.cached_weights, weight_layout=args.weight_layout,
                             graphs=not args.no_graphs, keep_transposed_weight=not args.transpose_in_backward,
                             micro_batches=args.micro_batches, defer_wgrad=args.defer_wgrad,
                             release_bf16_weights=args.release_bf16_weights, optimizer_write=args.optimizer_write,
                             planned_step=not args.composed_step)
        except torch.OutOfMemoryError as e:
            # a row whose three twins (and, with --optimizer-write, their FP32 masters) do not fit this GPU together:
            # recorded as not run, the grid goes on (the summary lists it; no ratio stands in for it)
            row = {"model": model, "G": G, "M": M, "dist": dist, "seed": 2000 + i,
                   "error": f"OutOfMemoryError: {str(e).splitlines()[0][:200]}"}
        # the row's modules and tensors freed before the next row allocates (out of the except block: its exception's
        # traceback held run_config's frame, the row's tensors)
        gc.collect()
        torch.cuda.empty_cache()
        if "error" in row:
            rows.append(row)
            print(f"[{n + 1}/{len(todo)}] {model} G={G} M={M} {dist}: not run, {row['error']}", flush=True)
            continue
        rows.append(row)
        print(f"[{n + 1}/{len(todo)}] {model} G={G} M={M} {dist}: ours {row.get('ours_ms')} ms, "
              f"x{row.get('speedup_vs_padded_path')} vs padded, x{row.get('speedup_vs_bf16')} vs bf16, "
              f"bitexact={row['bitexact']}; host {row.get('ours_host_ms')} ms; graphed: ours {row.get('ours_graph_ms')} "
              f"ms, x{row.get('graph_speedup_vs_bf16')} vs bf16 graphed, bitexact={row.get('graph_bitexact')}",
              flush=True)
    summary = summarize(rows)
    command = "python benchmarks/bench_mlp_layer.py" + (" --quick" if args.quick else "") + (
        " --cached-weights" if args.cached_weights else "") + (
        f" --weight-layout {args.weight_layout}" if args.weight_layout != "stacked" else "") + (
        " --no-graphs" if args.no_graphs else "") + (
        " --transpose-in-backward" if args.transpose_in_backward else "") + (
        f" --micro-batches {args.micro_batches}" if args.micro_batches > 1 else "") + (
        " --defer-wgrad" if args.defer_wgrad else "") + (
        " --optimizer-write" if args.optimizer_write and not args.release_bf16_weights else "") + (
        " --release-bf16-weights" if args.release_bf16_weights else "") + (
        " --composed-step" if args.composed_step else "") + (
        f" --models {' '.join(args.models)}" if args.models else "")
    # A step of several micro-batches is another regime than the issues' one-pass rows: its own series of results
    name = "mlp_layer_micro_batches" if args.micro_batches > 1 else "mlp_layer"
    path = common.write_result(name, rows, ceilings, command=command, out_dir=args.out, extra={
        "summary": summary,
        "weight_layout": args.weight_layout,
        "peak_mb_definition": "every byte of the layer at its peak: what it holds before the step (its parameters "
                              "and the FP8 weight copies its caches keep: none when re-quantized, W and W^T when "
                              "cached, W only with --transpose-in-backward) plus the step's peak with its inputs "
                              "handed over as in a model (x made by the op before and kept only by the layer, y read "
                              "by the op after and dropped, dY made by autograd: the BF16 GEMMs' saved x counts, "
                              "the caller's copies do not)",
        "step_peak_mb_definition": "max_memory_allocated over one fwd+bwd step minus memory_allocated before it, the "
                                   "caller holding x, y and dY (weights and inputs allocated; gradients and FP8 "
                                   "weight copies not); result files without this field call it `<method>_peak_mb` "
                                   "(and the step's peak plus what the layer holds `<method>_layer_peak_mb`)",
        "te_reported_source": "issue 5: Transformer Engine 2.20 GroupedLinear, blockwise FP8 recipe behind "
                              "Fp8Padding, fc1 -> SwiGLU*probs -> fc2, fwd+bwd, paper sizes, H200; quoted, "
                              "not measured by this script",
        "te_reported_comparable": te_reported_comparable(),  # False: no speedup_vs_te_fp8_reported on another GPU
    })
    plot(rows, path.replace(".json", ".png"), args.out)
    print_table(rows, summary)
    print(f"wrote {path}")


def plot(rows, png, out_dir):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG (the JSON has every number)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - the log axis' plain-number labels

    rows = [r for r in rows if "error" not in r]  # (rows not run: the JSON's summary lists them)
    labels = [f"{r['model']}\nG{r['G']} M{r['M'] // 1024}k\n{r['dist']}" for r in rows]
    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(10, 0.7 * len(rows)), 5.5))
    ax.bar([x - 0.2 for x in xs], [r.get("speedup_vs_padded_path", 0) for r in rows], 0.4, label="vs padded path")
    ax.bar([x + 0.2 for x in xs], [r.get("speedup_vs_bf16", 0) for r in rows], 0.4, label="vs BF16 _grouped_mm")
    graphed = [(x, r["graph_speedup_vs_bf16"]) for x, r in zip(xs, rows) if "graph_speedup_vs_bf16" in r]
    if graphed:
        ax.scatter([x + 0.2 for x, _ in graphed], [v for _, v in graphed], color="tab:red", marker="_", s=300,
                   zorder=3, label="vs BF16, both CUDA-graphed")
    te = [(x, r["speedup_vs_te_fp8_reported"]) for x, r in zip(xs, rows) if "speedup_vs_te_fp8_reported" in r]
    if te:
        ax.scatter([x for x, _ in te], [v for _, v in te], color="k", marker="D", zorder=3,
                   label="vs TE FP8 (quoted numbers)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")  # the quoted TE ratios reach x20; the ratios around 1 must stay readable
    ax.set_yticks([0.5, 0.8, 1, 1.25, 1.5, 2, 3, 5, 10, 20])
    ax.get_yaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("speedup of ours, fwd+bwd (x)")
    ax.set_title(f"Unpadded FP8 expert MLP (fc1 -> SwiGLU*probs -> fc2) on {common.gpu_label()} (higher is better)")
    ax.legend()
    common.save_figure(fig, png, out_dir)


def print_table(rows, summary):
    nan = float("nan")
    print("\nForward + backward of one expert MLP step (median ms, CUDA events, L2 flushed); the layer's peak MB;"
          "\nte_fp8 = Transformer Engine's number QUOTED from issue 5 (not measured here)")
    head = (f"{'model':>14} {'G':>3} {'M':>6} {'dist':>6} {'pad%':>5} {'ours':>8} {'padded':>8} {'bf16':>8} "
            f"{'xpad':>6} {'xbf16':>6} {'te_fp8':>7} {'xte':>6} {'ours_MB':>8} {'pad_MB':>8} {'bf16_MB':>8} exact")
    print(head)
    for r in rows:
        if "error" in r:  # a row that did not run (summary's rows_not_run)
            print(f"{r['model']:>14} {r['G']:>3} {r['M']:>6} {r['dist']:>6} not run: {r['error']}")
            continue
        print(f"{r['model']:>14} {r['G']:>3} {r['M']:>6} {r['dist']:>6} {r['pad_rows_pct']:5.1f} "
              f"{r.get('ours_ms', nan):8.3f} {r.get('padded_path_ms', nan):8.3f} {r.get('bf16_ms', nan):8.3f} "
              f"{r.get('speedup_vs_padded_path', nan):6.3f} {r.get('speedup_vs_bf16', nan):6.3f} "
              f"{r.get('te_fp8_ms_reported', nan):7.1f} {r.get('speedup_vs_te_fp8_reported', nan):6.3f} "
              f"{r.get('ours_peak_mb', nan):8.0f} {r.get('padded_path_peak_mb', nan):8.0f} "
              f"{r.get('bf16_peak_mb', nan):8.0f} {r['bitexact']}")
        for name in METHODS:
            if f"{name}_error" in r:
                print(f"    {name}: {r[name + '_error']}")
    print("\nThe same steps replayed from CUDA graphs (ms), and the host time to enqueue an eager step (ms)")
    print(f"{'model':>14} {'G':>3} {'M':>6} {'dist':>6} {'ours':>8} {'padded':>8} {'bf16':>8} {'xpad':>6} {'xbf16':>6} "
          f"{'host_ours':>9} {'host_pad':>9} {'host_bf16':>9} exact")
    for r in (r for r in rows if "error" not in r):
        print(f"{r['model']:>14} {r['G']:>3} {r['M']:>6} {r['dist']:>6} {r.get('ours_graph_ms', nan):8.3f} "
              f"{r.get('padded_path_graph_ms', nan):8.3f} {r.get('bf16_graph_ms', nan):8.3f} "
              f"{r.get('graph_speedup_vs_padded_path', nan):6.3f} {r.get('graph_speedup_vs_bf16', nan):6.3f} "
              f"{r.get('ours_host_ms', nan):9.3f} {r.get('padded_path_host_ms', nan):9.3f} "
              f"{r.get('bf16_host_ms', nan):9.3f} {r.get('graph_bitexact')}")
        for name in METHODS:
            if f"{name}_graph_error" in r:
                print(f"    {name} graphed: {r[name + '_graph_error']}")
    print("summary:", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})


if __name__ == "__main__":
    main()
