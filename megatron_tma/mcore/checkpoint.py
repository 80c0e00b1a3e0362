"""Save and resume a Megatron-core training run: model chunks, optimizer state, RNG states and the caller's progress,
in Megatron's distributed checkpoint format (`torch_dist`), laid out as Megatron-LM lays its checkpoints out
(`<dir>/iter_<7 digits>/`, `<dir>/latest_checkpointed_iteration.txt`).

For runs built from megatron-core without Megatron-LM's `training` loop (recipes/moe_gpt.py). The model and optimizer
entries are the ones Megatron-LM's own `--save` writes (the same `sharded_state_dict` methods with the same
metadata); the RNG and progress entries are this module's (Megatron-LM keys its RNG by pipeline and tensor rank, and
keeps its iteration and arguments in its own objects). What is saved:
* every model chunk's `sharded_state_dict()` (`model`, or `model0`, `model1`, ... with virtual pipeline stages);
  megatron_tma's experts write the entries Megatron's own experts write (megatron_tma.mcore.experts), so a
  checkpoint of either loads into the other;
* the optimizer's `sharded_state_dict(...)`: Megatron's mixed-precision optimizer (FP32 master weights, Adam's
  moments, the step), or its distributed optimizer in `optim_format` `"dp_reshardable"` (Megatron-LM's default: the
  optimizer's own buffers, reshardable along data parallelism only) or `"fully_reshardable"` (Megatron-LM's
  `--dist-ckpt-optim-fully-reshardable`: per-parameter states). The deprecated `fully_sharded_model_space` writes
  flattened shards, which megatron-core 0.19's ShardedTensor refuses for every model;
* each rank's RNG states (Python, torch CPU and CUDA, Megatron's CUDA RNG tracker), one object per global rank;
* `progress`: any picklable object the caller keeps with the checkpoint (the same on every rank; rank 0's is saved).
A checkpoint counts once `latest_checkpointed_iteration.txt` names it, which rank 0 writes after every rank finished
its part: a run killed while saving resumes from the checkpoint before, and the unfinished directory it left is
written over when the run gets there again (a complete checkpoint never is, and the tracker never moves back:
`save_refusal`). The entries are built with the
metadata Megatron-LM passes (`_metadata`). Per-rank RNG states are restored at the same world size only; the
optimizer formats themselves reshard along data parallelism.
With the distributed optimizer's parameter all-gather overlapped, the stepped parameters are gathered before saving,
as Megatron-LM does."""
import contextlib
import os
import random
import shutil
import warnings
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["OPTIM_FORMATS", "TRACKER_FILE", "checkpoint_dir", "latest_iteration", "write_tracker", "save_refusal",
           "save_checkpoint", "load_checkpoint"]

OPTIM_FORMATS = ("dp_reshardable", "fully_reshardable")  # the distributed optimizer's formats megatron-core 0.19 saves
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's name


def checkpoint_dir(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"iter_{iteration:07d}")


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration of the newest complete checkpoint in `directory`, or None if there is none."""
    try:
        with open(os.path.join(directory, TRACKER_FILE)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"{os.path.join(directory, TRACKER_FILE)} holds {text!r}, not an iteration number")
    return int(text)


def write_tracker(directory: str, iteration: int) -> None:
    """Name `iteration` the newest complete checkpoint in `directory` (atomic: never a half-written tracker)."""
    tmp = os.path.join(directory, TRACKER_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
    os.replace(tmp, os.path.join(directory, TRACKER_FILE))


def save_refusal(directory: str, iteration: int) -> Optional[str]:
    """Why `iteration` must not be saved into `directory` (None: it may): a complete checkpoint there at the same or a
    later iteration, which the save would write over or whose tracker it would move back. Both recipe jobs ask this
    before saving (a second run into a --save directory it did not resume from)."""
    latest = latest_iteration(directory)
    if latest is None or iteration > latest:
        return None
    return (f"{directory} holds a complete checkpoint at iteration {latest}; saving iteration {iteration} there would "
            f"{'write over it' if iteration == latest else 'move its tracker back'}: a complete checkpoint is never "
            "written over and a tracker never moves back (resume from it with --load, or save elsewhere)")


def _model_keys(models) -> List[str]:
    return ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]


def _unwrapped(model):
    """The module under Megatron's wrappers (DDP, Float16Module): what owns `sharded_state_dict`."""
    while type(model).__name__ in ("DistributedDataParallel", "Float16Module"):
        model = model.module
    return model


def _is_distributed(optimizer) -> bool:
    return any(type(opt).__name__ == "DistributedOptimizer"
               for opt in getattr(optimizer, "chained_optimizers", [optimizer]))


def _metadata(optimizer, optim_format: str) -> dict:
    """The `sharded_state_dict` metadata Megatron-LM passes to the model and the optimizer
    (`_build_sharded_state_dict_metadata`), so that the entries are the ones its checkpoints hold: no per-sub-optimizer
    key prefix, no singleton shards, the distributed optimizer's format only with a distributed optimizer."""
    from megatron.core import parallel_state

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if _is_distributed(optimizer):
        metadata["distrib_optim_sharding_type"] = optim_format
    return metadata


def _state(models, optimizer, optim_format: str, progress, *, loading: bool, with_rng: bool = True):
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if optim_format not in OPTIM_FORMATS:
        raise ValueError(f"optim_format must be one of {OPTIM_FORMATS}, got {optim_format!r}")
    metadata = _metadata(optimizer, optim_format)
    state = {key: _unwrapped(m).sharded_state_dict(metadata=metadata) for key, m in zip(_model_keys(models), models)}
    state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=loading, metadata=metadata)
    rng = None if loading else {"python": random.getstate(), "torch": torch.get_rng_state(),
                                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                                "tracker": get_cuda_rng_tracker().get_states()}
    rank, world = dist.get_rank(), dist.get_world_size()
    if with_rng:  # one object per global rank: restored only at the same world size (load_checkpoint)
        state["rng_state"] = ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0)
    state["progress"] = progress
    state["optim_format"] = optim_format
    state["world_size"] = world
    return state


def _distributed_optimizers(optimizer):
    """The distributed sub-optimizers whose load needs the guards below: only where megatron-core takes its torch-Adam
    branch (neither Apex nor Transformer Engine installed; their fused Adams keep the step in the param groups)."""
    try:
        from megatron.core.optimizer import distrib_optimizer
    except ImportError:  # no megatron-core: nothing to guard (stand-ins in tests take torch Adam's branch)
        distrib_optimizer = None
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False):
        return []
    return [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if type(opt).__name__ == "DistributedOptimizer" and getattr(opt, "optimizer", None) is not None]


def _give_fresh_states_a_step(optimizer) -> None:
    """Make a never-stepped distributed optimizer loadable. megatron-core 0.19's `DistributedOptimizer.state_dict()`,
    which its `sharded_state_dict(..., is_loading=True)` calls first, asserts that every torch optimizer state has a
    `step` when neither Apex nor Transformer Engine is installed; a freshly built optimizer has no state at all. So
    its states are initialized (Megatron's own `init_state_fn`: zero moments) with torch Adam's initial step, 0; the
    load then replaces every one of them with the checkpoint's."""
    for opt in _distributed_optimizers(optimizer):
        inner, init = opt.optimizer, getattr(opt, "init_state_fn", None)
        if init is None:
            continue
        init(inner, getattr(opt, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if state and "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)


@contextlib.contextmanager
def _torch_adam_steps_survive_the_load(optimizer):
    """Defects of megatron-core 0.19's `DistributedOptimizer.load_state_dict` with torch's own Adam (no Apex or
    Transformer Engine), which keeps its step as a tensor in every parameter's state; each breaks a resume. The
    checkpoint's step is the one in its param groups (no format persists a per-parameter step), which the loader first
    puts into every state, and then:
    * `fully_reshardable`: its per-parameter setter copies every tensor of a state from the checkpoint's entries,
      which hold no `step` (KeyError);
    * `dp_reshardable`: the entries' `step` is a non-persistent object, i.e. the state's step as it was when the
      sharded state dict was built (before the load: 0), and the setter copies it over the loaded step (measured on
      the H200: the resumed run parted from the uninterrupted one at its first step);
    * every state gets the same step tensor, and torch's Adam adds 1 to each parameter's step in place, so one more
      step puts the count off by the number of parameters.
    So while loading, the setter is handed each state's own (loaded) step for `step`, and afterwards every state gets
    its own copy of it."""
    patched = []
    for opt in _distributed_optimizers(optimizer):
        setter = opt._set_main_param_and_optimizer_states

        def with_step(model_param, tensors, opt=opt, setter=setter):
            group, order = opt.model_param_group_index_map[model_param]
            step = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]].get("step")
            if isinstance(step, torch.Tensor):
                tensors = {**tensors, "step": step}  # a copy onto itself: the step the load put there stays
            return setter(model_param, tensors)

        opt._set_main_param_and_optimizer_states = with_step
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # the class's method again
    for opt in patched:
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _gather_updated_params(models, optimizer) -> None:
    """With the distributed optimizer's parameter all-gather overlapped with the next forward, the parameters other
    ranks updated are not gathered yet right after a step: gather them now, as Megatron-LM does before it saves
    (`force_param_sync`), so that the checkpoint's weights are the stepped ones on every rank."""
    if not any(getattr(getattr(m, "ddp_config", None), "overlap_param_gather", False) for m in models):
        return
    optimizer.prepare_model_params_for_param_sync()
    for model in models:
        model.start_param_sync(force_sync=True)


def save_checkpoint(directory: str, iteration: int, models, optimizer, *, optim_format: str = "dp_reshardable",
                    progress: Any = None) -> str:
    """Save the run at `iteration` into `directory`/iter_<iteration> on every rank (a collective); returns that
    path. The tracker file names it only after every rank has written its part."""
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(directory, iteration)
    refusal = [None]  # rank 0 decides, every rank raises alike (a refusal on one rank would hang the others)
    if dist.get_rank() == 0:
        refusal = [save_refusal(directory, iteration)]
        if refusal[0] is None:
            if os.path.exists(path) and os.listdir(path):  # the tracker never named it: a run killed while saving
                shutil.rmtree(path)
            os.makedirs(path, exist_ok=True)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise FileExistsError(refusal[0])
    _gather_updated_params(models, optimizer)
    dist_checkpointing.save(_state(models, optimizer, optim_format, progress, loading=False), path)
    dist.barrier()
    if dist.get_rank() == 0:
        write_tracker(directory, iteration)
    dist.barrier()
    return path


def load_checkpoint(directory: str, models, optimizer, *, iteration: Optional[int] = None) -> Tuple[int, Any]:
    """Load the newest complete checkpoint in `directory` (or `iteration`'s) into the built models and optimizer and
    restore this rank's RNG states; returns (iteration, the progress object saved with it). Loads what the
    checkpoint holds: the distributed optimizer's format is read from it."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    if iteration is None:
        iteration = latest_iteration(directory)
        if iteration is None:
            raise FileNotFoundError(f"no checkpoint in {directory} (no {TRACKER_FILE})")
    path = checkpoint_dir(directory, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    same_world = common.get("world_size") == dist.get_world_size()
    if not same_world:
        warnings.warn(f"{path} was saved by {common.get('world_size')} ranks, this run has {dist.get_world_size()}: "
                      "the per-rank RNG states are not restored", UserWarning, stacklevel=2)
    _give_fresh_states_a_step(optimizer)
    state = dist_checkpointing.load(_state(models, optimizer, common["optim_format"], None, loading=True,
                                           with_rng=same_world), path)
    for key, model in zip(_model_keys(models), models):
        _unwrapped(model).load_state_dict(state[key], strict=True)
    with _torch_adam_steps_survive_the_load(optimizer):
        optimizer.load_state_dict(state["optimizer"])
    if not same_world:
        return iteration, state["progress"]
    rng = state["rng_state"]
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
    return iteration, state["progress"]
