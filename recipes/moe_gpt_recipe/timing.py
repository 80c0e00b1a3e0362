"""Timing inside a step: the experts' share of the step (CUDA events around every MoE layer's experts) and the GPU's
busy time in a profiled step."""
import functools

import torch


def device_busy_ms(profiler):
    """The time the GPU was busy in a profiled window, in ms: the union of the device's activity intervals (kernels,
    copies, sets; overlapping streams counted once). Over an unprofiled step's time it is the step's GPU-busy
    fraction (a host-bound step leaves the GPU idle between launches); the profiler slows the host, not the kernels."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in profiler.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:  # microseconds
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy / 1e3


class _Mark(torch.autograd.Function):
    """An identity on the experts' input ("in") or output ("out") that records a CUDA event when its forward runs and
    when its backward runs: the experts' forward lies between in's and out's forward events, their backward between
    out's and in's backward events (the autograd engine runs the experts' nodes back to back: every one of them was
    made after the input mark and before the output mark)."""

    @staticmethod
    def forward(ctx, x, timer, which):
        ctx.timer, ctx.which = timer, which
        timer.record("fwd", which == "in")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.record("bwd", ctx.which == "out")
        return grad, None, None


class ExpertsTimer:
    """The experts' share of a training step, on the stream: CUDA events where the experts' forward and backward
    start and end in every MoE layer and micro-batch, against events around the whole step (forward, backward and
    optimizer step). On one GPU at EP = 1 everything runs on one stream, so the sum of the experts' intervals over
    the step's interval is the fraction of the step the experts take (host time the GPU waits for inside the experts
    included). Every experts module of the model gets the marks (`forward` wrapped on the instance), in every mode,
    so the measure is the same for Megatron's experts and megatron_tma's; off (no marks, no events) outside the
    measured steps."""

    def __init__(self, models, event=None):
        self.active, self.events, self.routing = False, [], []
        self.event = event or functools.partial(torch.cuda.Event, enable_timing=True)
        for model in models:
            for module in model.modules():
                experts = getattr(module, "experts", None)
                if isinstance(experts, torch.nn.Module) and hasattr(module, "token_dispatcher"):  # an MoELayer
                    experts.forward = self._wrap(experts.forward)

    def _wrap(self, forward):
        def marked(hidden, tokens_per_expert, *args, **kwargs):
            if not self.active:
                return forward(hidden, tokens_per_expert, *args, **kwargs)
            self.note_routing(tokens_per_expert)
            out, bias = forward(_Mark.apply(hidden, self, "in"), tokens_per_expert, *args, **kwargs)
            return _Mark.apply(out, self, "out"), bias
        return marked

    def note_routing(self, tokens_per_expert):
        """Keep what this micro-batch's routing gave the layer's experts, on the counts' device (no host read inside
        the step): how many of them got no token, and the largest count. An empty expert costs our K-grouped wgrad
        nothing (it leaves that expert's main_grad untouched) and the BF16 experts a full main_grad update, so the
        experts' times of two modes compare only alongside their routing. (Four small kernels a layer a micro-batch,
        in the measured steps only, outside the experts' intervals.)"""
        if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.numel() > 0:
            counts = tokens_per_expert.detach()
            self.routing.append((counts.numel(), (counts == 0).sum(), counts.max(), counts.sum()))

    def record(self, phase, begin):
        event = self.event()
        event.record()
        self.events.append((phase, begin, event))

    def start(self, active):
        self.active, self.events, self.routing = active, [], []
        if active:
            self.step_start = self.event()
            self.step_start.record()

    def stop(self):
        """None when the step was not measured, else a function giving its share (call it after a synchronize)."""
        if not self.active:
            return None
        self.active = False
        end = self.event()
        end.record()
        start, events, routing = self.step_start, self.events, self.routing

        def share():
            open_at, total = {}, 0.0
            for phase, begin, event in events:
                if begin:
                    open_at[phase] = event
                elif phase in open_at:
                    total += open_at.pop(phase).elapsed_time(event)
            step = start.elapsed_time(end)
            measured = {"experts_ms": total, "step_ms": step, "share": total / step if step > 0 else None}
            if routing:  # over every (MoE layer, micro-batch) of the step
                experts = sum(n for n, _, _, _ in routing)
                measured["empty_experts_fraction"] = sum(int(empty) for _, empty, _, _ in routing) / experts
                measured["largest_expert_share"] = max(int(top) / max(int(tokens), 1) for _, _, top, tokens in routing)
            return measured
        return share
