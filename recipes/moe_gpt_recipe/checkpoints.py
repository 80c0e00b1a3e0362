"""The recipe's checkpoints around megatron_tma.mcore.checkpoint: the training settings saved with each, the checks
of a resume and of the --save directory, and the GPU job's resume."""
import os

import torch.distributed as dist

from megatron_tma.mcore import checkpoint

from .options import fail


# The options that do not change what a run trains (where it reads and writes, what it prints, when it stops or saves,
# which modes): every other option must be the checkpoint's for a resume (check_resume).
NOT_TRAINING = ("modes", "out", "log_every", "save", "save_interval", "load", "kill_after_step", "plot", "compare",
                "same_bits", "profile_step", "dist_ckpt_optim_fully_reshardable", "preset", "experts_share_steps",
                "device_token_counts", "transpose_weights_in_backward")  # the last two: the same bits either way
# Training options added after checkpoints had been saved (issue 33), with the value those checkpoints trained with.
ADDED_OPTIONS = {"transformer_impl": "local", "fp8_format": None, "fp8_recipe": "blockwise", "shared_expert_ffn": None,
                 "moe_permute_fusion": False, "gradient_accumulation_fusion": False, "defer_expert_wgrad": False,
                 "normalization": "RMSNorm", "permute_in_experts": False,
                 # the model presets' attention options (issue 52)
                 "num_query_groups": None, "kv_channels": None, "qk_layernorm": False}


def training_args(args):
    """The run's training settings (every option but NOT_TRAINING's), as saved with each checkpoint."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in NOT_TRAINING}


def check_resume(args, progress, where):
    """Stop, naming every differing option, unless the checkpoint at `where` was trained with this run's settings: a
    resume trains the checkpoint's settings, and the result must not be labelled with others (--steps included: the
    data of every step is drawn for the whole run)."""
    saved = progress.get("train_args") if isinstance(progress, dict) else None
    if saved is None:
        fail(f"{where} holds no record of the settings it was trained with (saved before they were recorded), so a "
             "resume from it cannot be checked: train from scratch")
    now = training_args(args)
    # options added after a checkpoint was saved: it trained with their defaults
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k, ADDED_OPTIONS.get(k)) != now.get(k)]
    if differ:
        fail(f"{where} was trained with other settings than this run's: "
             + "; ".join(f"--{k.replace('_', '-')} {saved.get(k, ADDED_OPTIONS.get(k))!r} there, {now.get(k)!r} here"
                         for k in differ)
             + " (a resume trains the checkpoint's settings: run it with them, or without --load)")


def check_save_target(args, mode, start):
    """Stop before training if this mode's saves would write over a complete checkpoint in --save or move its
    tracker back (a run into a --save directory holding a newer run than the one it starts from)."""
    if not args.save:
        return
    first = (start // args.save_interval + 1) * args.save_interval  # the first step this run saves
    if first > args.steps:
        return
    refusal = checkpoint.save_refusal(os.path.join(args.save, mode), first)
    if refusal is not None:
        fail(f"--save: {refusal}")


def optim_format(args):
    """The distributed optimizer's checkpoint format (ignored by the plain optimizer)."""
    return "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable"


def resume(args, mode, models, optimizer):
    """(first step, the run's records so far) from the mode's newest checkpoint under --load; (0, None) without one."""
    if not args.load:
        return 0, None
    directory = os.path.join(args.load, mode)
    if checkpoint.latest_iteration(directory) is None:
        if dist.get_rank() == 0:
            print(f"[{mode:9s}] no checkpoint in {directory}: training from scratch", flush=True)
        return 0, None
    step, progress = checkpoint.load_checkpoint(directory, models, optimizer)
    check_resume(args, progress, checkpoint.checkpoint_dir(directory, step))
    if step > args.steps or len(progress["losses"]) != step:
        raise SystemExit(f"moe_gpt.py: {directory} holds step {step} with {len(progress['losses'])} recorded steps; "
                         f"this run trains {args.steps}")
    if dist.get_rank() == 0:
        print(f"[{mode:9s}] resumed from {checkpoint.checkpoint_dir(directory, step)}", flush=True)
    return step, progress
