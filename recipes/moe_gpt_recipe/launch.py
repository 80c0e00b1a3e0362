"""The recipe's entry: the checks before any work (preflight), then the job: the GPU job, the CPU job (--cpu),
--plot, --compare or --same-bits."""
import contextlib
import importlib.util
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from megatron_tma._ext import cuda_kernels_available, extension_error
from megatron_tma.mcore import checkpoint

from . import megatron_core as mc
from .checkpoints import check_resume, check_save_target, training_args
from .data import chain_batches
from .options import MEGATRONS_OWN, fail, parse_args
from .plots import plot
from .results import compare, graphed_vs_eager, read_result, same_bits, summarize, write_results
from .training import digests, release, train


def check_dir(option, directory, what):
    """Stop with one line unless `what` can be written into `directory` (made if missing), the value of `option`:
    checked before any training, not found out after every mode has trained (--out) or at the first save (--save)."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".moe_gpt-write-check-"):
            pass
    except OSError as e:
        fail(f"{option} {directory} cannot take {what} ({type(e).__name__}: {e.strerror or e}); pass a writable "
             "directory")


def preflight(args):
    """Stop with one line, before any distributed set-up, when a piece the run needs is missing: matplotlib (--plot,
    --cpu), one process (--cpu); for the GPU job a visible GPU, Python >= 3.12, Transformer Engine (--transformer-impl
    transformer_engine), Apex's wgrad extension (--gradient-accumulation-fusion) and megatron-core, megatron_tma's CUDA kernels on this rank's GPU, torchrun."""
    if args.plot or args.cpu:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            fail(f"matplotlib is missing ({e}), and it draws the loss plot: pip install matplotlib "
                 "(pip install -e '.[test]' brings it)")
    if args.load and not (args.plot or args.compare or args.same_bits) and not os.path.isdir(args.load):
        fail(f"--load {args.load}: no such directory (nothing to resume from; leave --load out to train from scratch)")
    if not args.same_bits and not args.plot:  # (--plot checks its own target, never over a plot)
        check_dir("--out", args.out, "the results")
    if args.save and not (args.plot or args.compare or args.same_bits):
        check_dir("--save", args.save, "the checkpoints")
    if args.cpu:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != 1:
            fail(f"the CPU job runs in one process, this is one of {world}: torchrun --nproc-per-node 1 "
                 "recipes/moe_gpt.py --cpu")
        return
    if args.plot or args.compare or args.same_bits:
        return
    if not torch.cuda.is_available():
        fail("no CUDA GPU is visible, and this job trains with megatron_tma's FP8 kernels (Hopper); on a CPU run "
             "the CPU job: torchrun --nproc-per-node 1 recipes/moe_gpt.py --cpu")
    if sys.version_info[:2] < mc.MEGATRON_PYTHON:
        fail(f"megatron-core 0.19 needs Python >= {'.'.join(map(str, mc.MEGATRON_PYTHON))}, this is "
             f"{sys.version.split()[0]}: run the job with a newer Python (--cpu runs without Megatron)")
    # the options that need Transformer Engine, each with the way to run without it
    needs_te = [(option, instead) for option, instead, asked in (
        ("--transformer-impl transformer_engine", "with --transformer-impl local",
         args.transformer_impl == "transformer_engine"),
        ("--moe-permute-fusion", "without --moe-permute-fusion", args.moe_permute_fusion)) if asked]
    if needs_te:
        error = mc.te_import_error()
        if error is not None:
            why = (str(error).splitlines() or [""])[0]
            fail(f"{' and '.join(o for o, _ in needs_te)} need{'s' if len(needs_te) == 1 else ''} Transformer "
                 f"Engine, which cannot be imported ({type(error).__name__}: {why}): pip install -e '.[te]' on the "
                 f"GPU machine (or scripts/te_device_steps.md), or run {' and '.join(i for _, i in needs_te)}")
    if args.gradient_accumulation_fusion:
        # Megatron's output layer is its own ColumnParallelLinear in either spec, which then needs Apex's extension
        error = mc.extension_import_error("fused_weight_gradient_mlp_cuda")
        if error is not None:
            fail("--gradient-accumulation-fusion needs Apex's fused_weight_gradient_mlp_cuda (Megatron's output "
                 f"layer adds its weight gradient with it in either spec), which cannot be imported ({error}): build "
                 "Apex with its CUDA extensions (--cpp_ext --cuda_ext), or leave the option out")
    if args.transformer_impl == "transformer_engine":
        if not args.nondeterministic:  # before TE is imported: its attention reads it (config.deterministic_mode)
            os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    error = mc.import_megatron()
    if error is not None:
        why = (str(error).splitlines() or [""])[0]
        fail(f"megatron-core cannot be imported ({type(error).__name__}: {why}): pip install "
             "megatron-core==0.19.2 psutil (--cpu runs without it)")
    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if any(m not in MEGATRONS_OWN for m in args.modes) and not cuda_kernels_available(local):
        # the experts would fall back to the torch reference: right bits, ~10x the step time, nothing to compare
        fail(f"megatron_tma's CUDA kernels cannot run here ({extension_error() or 'not an sm_90 GPU'}); "
             "build the extension with the CuTe/CUTLASS headers on the path (nvidia-cutlass) first")
    if "RANK" not in os.environ:
        fail("the GPU job runs under torchrun: torchrun --nproc-per-node N recipes/moe_gpt.py ...")


def redraw(args):
    """--plot: the PNG of a result into --out, never over an existing file (a committed plot)."""
    path = os.path.join(args.out, os.path.splitext(os.path.basename(args.plot))[0] + ".png")
    if os.path.exists(path):
        fail(f"{path} exists; --plot draws into --out and never over a plot: pass another --out")
    result = read_result(args.plot, "--plot")
    os.makedirs(args.out, exist_ok=True)
    plot(result, path)
    return 0


def cpu_job(args):
    """--cpu: every mode trained on the CPU through megatron_tma's own modules (recipes/moe_gpt_cpu.py), the same
    checks (summarize) and results as the GPU job."""
    spec = importlib.util.spec_from_file_location(
        "moe_gpt_cpu", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moe_gpt_cpu.py"))
    cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu)
    torch.use_deterministic_algorithms(not args.nondeterministic, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    if "OMP_NUM_THREADS" not in os.environ:
        # the ops are small: on 2 cores (shared with other jobs) one thread took ~0.1 s per step, two 0.9-4 s (their
        # join at every op); OMP_NUM_THREADS=N asks for N
        torch.set_num_threads(1)
    print(f"CPU job: {', '.join(args.modes)}, {args.steps} steps each, megatron_tma's modules on the reference "
          f"backend ({torch.get_num_threads()} threads)", flush=True)
    batches, loss_floor = chain_batches(args, 0)
    runs = {mode: cpu.train(args, mode, batches, digests, check_resume=check_resume,
                            check_save_target=check_save_target, training_args=training_args)
            for mode in args.modes}
    report, failures = summarize(runs)
    write_results(args, runs, report, failures, 1, loss_floor)
    twins = [m for m in args.modes if m.startswith("padded")]
    if "unpadded" in runs and twins:
        same = all(report[m]["bitexact_losses"] and report[m]["bitexact_grad_norms"] and report[m]["bitexact_params"]
                   for m in twins)
        print(f"{'bit for bit' if same else 'NOT bit for bit'}: unpadded {'==' if same else 'vs'} "
              f"{' == '.join(twins)} (every step's loss and grad norm, every parameter at the end)")
    return 1 if failures else 0


def main(argv=None):
    args = parse_args(argv)
    preflight(args)
    with contextlib.ExitStack() as job:
        job.enter_context(stdout_may_close())
        if args.save and not (args.plot or args.compare or args.same_bits) and int(os.environ.get("RANK", "0")) == 0:
            # one job saves into a --save directory at a time: a second one is refused here, before any work, not
            # left to delete the first one's half-written checkpoint (checkpoint.hold_save_lock); rank 0 holds it for
            # the job (the other ranks' saves go through rank 0's)
            try:
                job.enter_context(checkpoint.save_lock(args.save))
            except (checkpoint.SaveDirLocked, checkpoint.CheckpointFileError) as e:
                fail(f"--save: {e}")
        try:
            return run_job(args)
        except (checkpoint.CheckpointFileError, checkpoint.SaveDirLocked) as e:  # a checkpoint file breaking its rule
            fail(str(e))


@contextlib.contextmanager
def stdout_may_close():
    """Keep the job going when its stdout is closed under it (`... | head`: the reader exits, the next print raises
    BrokenPipeError, since Python ignores SIGPIPE): stdout's file descriptor is pointed at /dev/null there, so the
    rest of the printing (and the flush at exit) goes nowhere, and the run trains on and writes its result. torchrun
    hands its workers its own stdout (no --redirects / --tee), so each rank meets the closed pipe itself; the
    agent's own messages go to stderr."""
    stream = sys.stdout

    class Guarded:
        def __getattr__(self, name):
            return getattr(stream, name)

        def _guard(self, op, *a):
            try:
                return op(*a)
            except BrokenPipeError:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, stream.fileno())
                os.close(devnull)
                return op(*a)  # the same bytes, now into /dev/null (the stream's buffer still holds them)

        def write(self, text):
            return self._guard(stream.write, text)

        def flush(self):
            return self._guard(stream.flush)

    sys.stdout = Guarded()
    try:
        yield
    finally:
        sys.stdout = stream


def run_job(args):
    """The job the options ask for (parse_args lets one through): its exit status."""
    if args.plot:
        return redraw(args)
    if args.cpu:
        return cpu_job(args)
    if args.compare:
        return compare(args.compare, args.out)
    if args.same_bits:
        return same_bits(*args.same_bits)
    return gpu_job(args)


def gpu_job(args):
    """Every mode trained with Megatron-core on the GPUs of this torchrun (one rank a process), the checks
    (summarize), the result written by rank 0."""
    # Bit-exact comparisons need the rest of the model deterministic too: Megatron sums a token's top-k expert
    # outputs with scatter_add (atomics) unless torch's deterministic algorithms are on (at top-4, unpadded and
    # padded16 differed from step 0 without them). warn_only: ops without a deterministic kernel warn.
    torch.use_deterministic_algorithms(not args.nondeterministic, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # no NaN fill of every torch.empty in the timings
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if args.layers % (args.pp * (args.vpp or 1)):
        raise SystemExit(f"--layers {args.layers} must be divisible by --pp {args.pp} x --vpp {args.vpp or 1}")
    args.ep = args.ep or max(1, world // (args.etp * args.pp))
    mc.parallel_state.initialize_model_parallel(pipeline_model_parallel_size=args.pp,
                                                virtual_pipeline_model_parallel_size=args.vpp,
                                                expert_model_parallel_size=args.ep,
                                                expert_tensor_parallel_size=args.etp)
    # one data stream per data-parallel rank: the stages of a pipeline must see the same batches
    batches, loss_floor = chain_batches(args, mc.parallel_state.get_data_parallel_rank())
    runs = {}
    for mode in args.modes:
        runs[mode] = train(args, mode, rank, batches)
        runs[mode]["left_allocated_mb"] = release(runs[mode].pop("start_allocated_bytes"))
    extra = {}
    if args.cuda_graph_impl != "none" and "unpadded" in runs:  # our graphed step against our eager step
        eager = train(args, "unpadded", rank, batches, eager=True)
        release(eager.pop("start_allocated_bytes"))
        extra["graphed_vs_eager"] = graphed_vs_eager(runs["unpadded"], eager)
    report, failures = summarize(runs)
    if extra.get("graphed_vs_eager") and not extra["graphed_vs_eager"]["bitexact"]:
        failures.append(f"unpadded from the CUDA graph differs from unpadded eager: {extra['graphed_vs_eager']}")
    if rank == 0:
        write_results(args, runs, report, failures, world, loss_floor, extra_head_to_head=extra)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0
