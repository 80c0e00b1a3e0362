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
as Megatron-LM does.

The files this module handles for a save directory (the recipe's CPU job writes its own checkpoints through the same
functions): the tracker is read as ASCII digits and nothing else (`CheckpointFileError`, one line naming the file and
the rule); every small file is written whole through a temporary file of a unique name created exclusively without
following links, then renamed (`write_atomic`: a link planted in the directory is replaced, never written through);
a directory is saved into only by the process holding its lock (`hold_save_lock`, an `fcntl.flock` on
`<dir>/.megatron_tma_save.lock`, held from the first save to the process's end, released by the kernel however
the process ends), so an iteration directory the tracker does not name is a dead run's leftovers, never a live
job's half-written save (`SaveDirLocked` names the holder's pid otherwise)."""
import contextlib
import errno
import fcntl
import os
import random
import re
import secrets
import shutil
import stat
import warnings
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["OPTIM_FORMATS", "TRACKER_FILE", "LOCK_FILE", "CheckpointFileError", "SaveDirLocked", "checkpoint_dir",
           "latest_iteration", "write_tracker", "save_refusal", "read_ascii", "write_atomic", "hold_save_lock",
           "release_save_lock", "save_lock", "fresh_iteration_dir", "save_checkpoint", "load_checkpoint"]

OPTIM_FORMATS = ("dp_reshardable", "fully_reshardable")  # the distributed optimizer's formats megatron-core 0.19 saves
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's name
LOCK_FILE = ".megatron_tma_save.lock"  # in a save directory: who saves into it (hold_save_lock)


class CheckpointFileError(ValueError):
    """A file of a save directory that breaks its rule (unreadable, not text, not what it should hold): one line
    naming the file and the rule."""


class SaveDirLocked(RuntimeError):
    """Another live process saves into the directory (one line naming it, the lock file and the holder's pid)."""


def checkpoint_dir(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"iter_{iteration:07d}")


def read_ascii(path: str, rule: str, limit: int = 4096) -> str:
    """The text of the small file `path` (a tracker, a checksum), which must be ASCII: CheckpointFileError naming the
    file and `rule` (what it must hold) if it is not a readable file or holds other bytes; FileNotFoundError if it is
    missing (the caller decides what a missing file means). At most `limit` bytes are read: these files hold a line."""
    try:
        # O_NONBLOCK: a FIFO planted at the name would block a plain open until someone writes to it; opened this way
        # it is found by the fstat below (the open and the check name the same file, whatever is swapped in between)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:  # a permission, a device error
        raise CheckpointFileError(f"{path} cannot be read ({type(e).__name__}: {e.strerror or e}); it must be a "
                                  f"file holding {rule}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise CheckpointFileError(f"{path} cannot be read (IsADirectoryError: a directory); it must be a file "
                                      f"holding {rule}")
        raise CheckpointFileError(f"{path} is not a regular file (a FIFO, socket or device); it must be a file "
                                  f"holding {rule}")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:  # a device error
            raise CheckpointFileError(f"{path} cannot be read ({type(e).__name__}: {e.strerror or e}); it must be a "
                                      f"file holding {rule}") from None
    if len(data) > limit:
        raise CheckpointFileError(f"{path} holds more than {limit} bytes; it must hold {rule}")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError as e:
        raise CheckpointFileError(f"{path} holds a byte that is not ASCII ({data[e.start]:#04x} at offset {e.start}); "
                                  f"it must hold {rule}") from None


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration of the newest complete checkpoint in `directory`, or None if there is none.
    CheckpointFileError (one line) if the tracker is not a file of ASCII digits: `str.isdigit` and `int` take other
    scripts' digits ('³', '٣'), which Megatron-LM's loader does not, so the rule is the ASCII one."""
    path = os.path.join(directory, TRACKER_FILE)
    rule = "an iteration number in ASCII digits (Megatron-LM's tracker)"
    try:
        text = read_ascii(path, rule).strip()
    except FileNotFoundError:
        return None
    if not re.fullmatch(r"[0-9]+", text):
        raise CheckpointFileError(f"{path} holds {text[:40]!r}, not an iteration number: it must hold {rule}")
    return int(text)


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` as the file `path`, whole or not at all: into a temporary file of a unique name in the same
    directory, created exclusively and without following a link (O_CREAT | O_EXCL | O_NOFOLLOW: a name planted there
    beforehand, a symlink included, is never opened), synced, then renamed over `path` (the rename replaces a link at
    `path` itself, never its target) and the directory synced, so the new name survives a crash. The file gets the
    usual permissions (0666 less the umask; mkstemp's 0600 would make a tracker unreadable to the group)."""
    directory, name = os.path.split(os.path.abspath(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:  # a name someone already holds (even a link): draw another
            continue
    else:
        raise FileExistsError(errno.EEXIST, f"no unused temporary name for {path} after 100 tries", directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename's durability; not every file system opens directories
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_tracker(directory: str, iteration: int) -> None:
    """Name `iteration` the newest complete checkpoint in `directory` (write_atomic: never a half-written tracker,
    never through a link)."""
    write_atomic(os.path.join(directory, TRACKER_FILE), str(iteration).encode("ascii"))


# The save locks this process holds: real path of the directory -> the open lock file (its flock lives as long as
# the descriptor; flock locks belong to the open file, so a second open in this process would conflict with the first)
_HELD_LOCKS = {}


def hold_save_lock(directory: str) -> None:
    """Make this process the one that saves into `directory` (created if missing) until it ends or calls
    `release_save_lock`: an exclusive `fcntl.flock` on `<directory>/.megatron_tma_save.lock`, which holds the
    holder's pid. Taking it again in the holding process does nothing. SaveDirLocked (one line: the directory and the
    holder's pid) if another live process holds it. The kernel releases the lock however its holder ends (SIGKILL
    included), so a killed run never leaves a stale one; on network file systems flock is as good as their locking
    (NFS maps it onto its byte-range locks)."""
    os.makedirs(directory, exist_ok=True)
    key = os.path.realpath(directory)
    if key in _HELD_LOCKS:
        return
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:  # a link planted there (ELOOP: never followed), a directory, a permission
        raise CheckpointFileError(f"{path} cannot be opened as the directory's save lock ({type(e).__name__}: "
                                  f"{e.strerror or e}); it must be a plain file (a link there is never followed)") \
            from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise SaveDirLocked(f"{directory} is being saved into by another live job (pid {holder}, holding {path}): "
                            "one job saves into a directory at a time; pass another --save or wait for it to end") \
            from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    _HELD_LOCKS[key] = fd


def release_save_lock(directory: str) -> None:
    """Let other processes save into `directory` again (nothing if this process does not hold its lock)."""
    fd = _HELD_LOCKS.pop(os.path.realpath(directory), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor of the open file releases its flock


@contextlib.contextmanager
def save_lock(directory: str):
    """`hold_save_lock(directory)` for the `with` block; released at its end unless it was held before."""
    held = os.path.realpath(directory) in _HELD_LOCKS
    hold_save_lock(directory)
    try:
        yield
    finally:
        if not held:
            release_save_lock(directory)


def fresh_iteration_dir(directory: str, iteration: int) -> str:
    """An empty `directory`/iter_<iteration> for a save, made under the directory's save lock (taken here if this
    process does not hold it yet). Whatever is there is removed first: the tracker never named it (save_refusal is
    asked before) and no live process writes it (the lock), so it is what a run killed while saving left behind; a
    link is removed itself, never followed."""
    hold_save_lock(directory)
    path = checkpoint_dir(directory, iteration)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):  # a link, a file
        os.unlink(path)
    os.mkdir(path)
    return path


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


def portable_tracker_states(states: dict) -> dict:
    """Megatron's model-parallel RNG tracker states as the checkpoint keeps them: byte tensors. A graph-safe tracker's
    (`use_cudagraphable_rng`, what CUDA graphs need) are torch Generators, which graphs register: their byte state
    (`get_state()`, the format of `torch.cuda.get_rng_state()`) instead, so that a checkpoint of a graphed run loads
    into an eager one and the other way round."""
    return {name: s.get_state() if isinstance(s, torch.Generator) else s for name, s in states.items()}


def restore_tracker_states(tracker, saved: dict) -> None:
    """The saved byte states back into `tracker`: a graph-safe tracker's generators take them in place (the objects
    stay: a CUDA graph captured later registers these), a plain tracker's states are the bytes themselves."""
    current = tracker.get_states()
    graph_safe = any(isinstance(s, torch.Generator) for s in current.values())
    if not graph_safe:
        tracker.set_states({name: s.get_state() if isinstance(s, torch.Generator) else s for name, s in saved.items()})
        return
    missing = sorted(set(saved) - set(current))
    if missing:
        raise RuntimeError(f"the checkpoint has RNG tracker states {missing} that this run's graph-safe tracker does not "
                           "(the model was built with other parallel settings?)")
    for name, s in saved.items():
        current[name].set_state(s.get_state() if isinstance(s, torch.Generator) else s)
    tracker.set_states(current)


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
                                "tracker": portable_tracker_states(get_cuda_rng_tracker().get_states())}
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
    path. The tracker file names it only after every rank has written its part. Rank 0 takes the directory's save lock
    at the first save and holds it to the end of the process (SaveDirLocked on every rank if another job holds it)."""
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(directory, iteration)
    # rank 0 decides, every rank raises alike (a refusal on one rank would hang the others); rank 0 holds the
    # directory's save lock for the job (fresh_iteration_dir)
    refusal = [None]
    if dist.get_rank() == 0:
        try:
            why = save_refusal(directory, iteration)
            if why is not None:
                refusal = [("FileExistsError", why)]
            else:
                fresh_iteration_dir(directory, iteration)
        except (CheckpointFileError, SaveDirLocked) as e:
            refusal = [(type(e).__name__, str(e))]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        kind, why = refusal[0]
        raise {"FileExistsError": FileExistsError, "CheckpointFileError": CheckpointFileError,
               "SaveDirLocked": SaveDirLocked}[kind](why)
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
    restore_tracker_states(get_cuda_rng_tracker(), rng["tracker"])
    return iteration, state["progress"]
