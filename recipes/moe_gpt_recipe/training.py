"""The GPU job's training loop: one mode's run (its records: losses, grad norms, times, digests of the weights),
the evaluation after the last step, the per-rank bookkeeping."""
import gc
import hashlib
import math
import os
import signal
import time

import torch
import torch.distributed as dist

from megatron_tma.mcore import (
    checkpoint, experts as mcore_experts, invalidate_fp8_weights, keep_token_counts_on_device, permute_in_experts)
from megatron_tma.mcore.device_token_counts import refusal as host_counts_refusal
from megatron_tma.mcore.held_memory import PARTS, held_bytes
from megatron_tma.released_weights import materialize_bf16_weights

from . import megatron_core as mc
from .checkpoints import check_save_target, optim_format, resume, training_args
from .data import data_iterators
from .model import build, canonical_weights, experts_against_megatron, named_parameters, norm_classes, optimizer_class
from .options import MEGATRONS_OWN, graphed
from .timing import ExpertsTimer, device_busy_ms


def digests(named_tensors):
    """{name: SHA-256 of shape, dtype and bytes}: equal digests mean equal bits. One host copy at a time, so that
    whole models can be compared across modes and processes without keeping them."""
    out = {}
    for name, t in named_tensors:
        h = hashlib.sha256(f"{tuple(t.shape)} {t.dtype}".encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def gathered(obj):
    """Every rank's `obj`, in rank order (each rank holds its own experts)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s] per token

    def loss_func(output):
        loss = output.float().mean()
        # a copy: the schedule divides the returned loss by the number of micro-batches in place
        return loss, {"lm loss": loss.detach().clone()}

    return losses, loss_func


def train(args, mode, rank, batches, eager=False):
    """One mode's run: a record of per-step losses, grad norms and times, the digests of every rank's initial
    weights (canonical names) and final parameters, and (mode `megatron`) megatron_tma's experts against Megatron's.
    With --cuda-graph-impl full_iteration megatron_tma's modes train from Megatron's full-iteration CUDA graph
    (`eager`: the same model without it, the head-to-head's twin)."""
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()  # count this mode's own bytes (the first leaves workspaces and buffers)
    torch.cuda.reset_peak_memory_stats()
    models, optimizer = build(args, mode)
    counts_on_device = device_token_counts(args, mode, models, rank)
    if graphed(args, mode):
        # what the graph needs is the counts on the GPU, not the permutation in the experts (the BF16 experts keep
        # Megatron's permutation, on counts that stay on the GPU)
        host_reads = {f"chunk{i}.{name}": reason for i, model in enumerate(models)
                      for name, module in model.named_modules() if hasattr(module, "token_dispatcher")
                      for reason in [host_counts_refusal(module)] if reason is not None}
        if host_reads:
            raise SystemExit(f"{mode}: --cuda-graph-impl full_iteration needs every MoE layer's counts on the GPU (a "
                             f"host read cannot be captured); not taken: {host_reads}")
    steps_counted = mcore_experts._optimizer_steps
    start, progress = resume(args, mode, models, optimizer)
    if not eager:  # (the eager twin saves nothing)
        check_save_target(args, mode, start)
    if progress is None:
        progress = {"losses": [], "grad_norms": [], "times": [], "train_args": training_args(args),
                    "init_digests": gathered(digests(canonical_weights(models))),
                    "experts_diff_vs_megatron": (experts_against_megatron(models[0].module.module, args.seed)
                                                 if mode in MEGATRONS_OWN else None)}
    losses, grad_norms, times = progress["losses"], progress["grad_norms"], progress["times"]
    shares = progress.setdefault("experts_share", [])
    data = data_iterators(models, batches[start * args.micro_batches:])
    fwd_bwd = mc.get_forward_backward_func()
    graph = graphed(args, mode) and not eager
    if graph:  # its graphs and step count are class state: a fresh start for every mode of the job
        fwd_bwd = mc.FullCudaGraphWrapper(fwd_bwd, cuda_graph_warmup_steps=args.cuda_graph_warmup_steps)
        fwd_bwd.reset_cuda_graph()
    timer = ExpertsTimer(models)
    for step in range(start, args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        # no CUDA events inside a replay; nor in the eager twin of a graphed mode, whose times it is compared with
        timer.start(step >= args.steps - args.experts_share_steps and not graphed(args, mode))
        profiler = None
        if step == args.profile_step:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        for model in models:
            model.zero_grad_buffer()  # Megatron's per-iteration reset (also the experts' signal to re-quantize)
        optimizer.zero_grad()
        out = fwd_bwd(forward_step_func=forward_step, data_iterator=data, model=models,
                      num_microbatches=args.micro_batches, seq_length=args.seq_len,
                      micro_batch_size=args.micro_batch_size, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if profiler is not None:
            torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            progress["gpu_busy"] = {"step": step, "busy_ms": device_busy_ms(profiler)}
            if rank == 0:  # where the GPU's time went, then the host's (a host-bound step waits on the latter)
                averages = profiler.key_averages()
                print(f"[{mode}] step {step} profile:\n" + averages.table(
                    sort_by="self_device_time_total", row_limit=15, max_name_column_width=60), flush=True)
                print(f"[{mode}] step {step} host profile:\n" + averages.table(
                    sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)
        share = timer.stop()
        loss = step_loss(out)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
        if share is not None:
            shares.append(share())
        if not ok or not math.isfinite(loss):
            raise RuntimeError(f"{mode}: step {step} failed (update ok={ok}, loss={loss})")
        grad_norm = float(grad_norm)  # a tensor under TE's FusedAdam, a float under torch's Adam
        losses.append(loss)
        grad_norms.append(grad_norm)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[{mode:9s}] step {step:4d}  loss {loss:.5f}  grad norm {grad_norm:.4f}  {times[-1]:.1f} ms",
                  flush=True)
        if args.save and (step + 1) % args.save_interval == 0 and not eager:  # (the twin: the graphed run saved)
            path = checkpoint.save_checkpoint(os.path.join(args.save, mode), step + 1, models, optimizer,
                                              optim_format=optim_format(args), progress=progress)
            if rank == 0:
                print(f"[{mode:9s}] saved {path}", flush=True)
        if args.kill_after_step == step + 1:
            if rank == 0:
                print(f"[{mode:9s}] killed after step {step} (--kill-after-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if graph:
        fwd_bwd.reset_cuda_graph()  # the graph and its pool go with the mode
    peak = torch.tensor(float(torch.cuda.max_memory_allocated() - mem0) / 2**20, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    # what the state held between steps is, by part (this rank's), beside what the allocator counts
    held = {part: b / 2**20 for part, b in held_bytes(models, optimizer).items()}
    held["allocated"] = (torch.cuda.memory_allocated() - mem0) / 2**20
    # what the parts do not name (workspaces, buffers, Transformer Engine's private FP8 copies)
    held["unattributed"] = held["allocated"] - sum(held[part] for part in PARTS)
    # Megatron's evaluation comes right after a step, without the per-iteration reset of DDP's flag: it must run on
    # the stepped weights. Evaluated as is, then again with the FP8 copies forcibly re-made: the same loss.
    eval_loss = evaluate(args, models, batches)
    for model in models:  # (--release-bf16-expert-weights: the BF16 weights written back from the FP32 masters)
        materialize_bf16_weights(model.parameters())
    found = sum(invalidate_fp8_weights(model) for model in models)
    eval_requantized = evaluate(args, models, batches) if found else eval_loss
    param_digests = gathered(digests(named_parameters(models)))
    return {**progress, "param_digests": param_digests, "peak_mb": float(peak), "held_mb": held,
            "resumed_from_step": start,
            "start_allocated_bytes": mem0,
            "eval_loss": eval_loss, "eval_loss_requantized": eval_requantized, "eval_exact": not args.nondeterministic,
            # the torch optimizer Megatron's optimizer steps: TE's FusedAdam where TE is installed, else Apex's or torch's
            "optimizer_class": optimizer_class(optimizer),
            "norm_classes": norm_classes(models),  # Apex's FusedLayerNorm in the local spec where Apex imports
            # the torch optimizer steps the experts' hook counted during the run (Megatron's optimizer steps one)
            "optimizer_steps_counted": mcore_experts._optimizer_steps - steps_counted,
            "device_token_counts": counts_on_device,
            "cuda_graph": "full_iteration" if graph else None}


def device_token_counts(args, mode, models, rank):
    """--device-token-counts / --permute-in-experts: {MoE layer: None where its counts stay on the GPU (and, with the
    second, its experts permute their own tokens), else why not} over the model chunks (None without either option;
    Megatron's own experts need the counts on the host and are never changed)."""
    if not (args.device_token_counts or args.permute_in_experts):
        return None
    patch = permute_in_experts if args.permute_in_experts else keep_token_counts_on_device
    what = "experts permute their own tokens" if args.permute_in_experts else "token counts on the GPU"
    report = {}
    for i, model in enumerate(models):
        report.update({f"chunk{i}.{name}": reason for name, reason in patch(model).items()})
    if rank == 0:
        kept = sum(reason is None for reason in report.values())
        reasons = sorted({reason for reason in report.values() if reason is not None})
        print(f"[{mode:9s}] {what} in {kept} of {len(report)} MoE layers"
              + (f"; the others: {'; '.join(reasons)}" if reasons else ""), flush=True)
    return report


def release(start_bytes):
    """Free a finished mode's model before the next one is built; return what stayed allocated beyond what the process
    held when the mode started (MB, most over ranks). The model is in reference cycles (Megatron's config holds
    the DDP wrapper's `no_sync`, the modules hold the config), which only the cyclic collector frees, and it may
    not run on its own before the next mode allocates (without this call, a finished mode's model stayed allocated)."""
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.tensor(float(torch.cuda.memory_allocated() - start_bytes) / 2**20, device="cuda")
    dist.all_reduce(left, op=dist.ReduceOp.MAX)
    return float(left)


def evaluate(args, models, batches):
    """The loss of the first batch (the first --pp batches when interleaving) in evaluation, as Megatron's
    `evaluate()` computes it: eval mode, the schedule's forward only (no zero_grad_buffer), mean over the
    data-parallel ranks. With the parameter all-gather overlapped, Megatron-LM evaluates with the forward pre-hooks
    off and the parameters all-gathered first; so does this."""
    for model in models:
        if args.overlap_param_gather:
            model.disable_forward_pre_hook()  # param_sync=True: a synchronous all-gather of every bucket
        model.eval()
    # the interleaved schedule runs micro-batches in groups of --pp (Megatron refuses fewer)
    micro_batches = args.pp if args.vpp else 1
    with torch.no_grad():
        out = mc.get_forward_backward_func()(forward_step_func=forward_step,
                                             data_iterator=data_iterators(models, batches), model=models,
                                             num_microbatches=micro_batches, seq_length=args.seq_len,
                                             micro_batch_size=args.micro_batch_size, forward_only=True)
    for model in models:
        model.train()
        if args.overlap_param_gather:
            model.enable_forward_pre_hook()
    return step_loss(out)


def step_loss(out):
    """The mean micro-batch loss of a schedule's outputs, on every rank: the pipeline's last stage computes it (the
    schedule returns the losses there only) and sends it to the other stages, then the mean over data-parallel
    ranks."""
    if mc.parallel_state.is_pipeline_last_stage():
        loss = torch.stack([o["lm loss"] for o in out]).mean()
    else:
        loss = torch.zeros((), dtype=torch.float32, device="cuda")
    if mc.parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(loss, src=mc.parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=mc.parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(loss, group=mc.parallel_state.get_data_parallel_group())
    return loss.item() / mc.parallel_state.get_data_parallel_world_size()
