"""The recipe's results: the checks and report of summarize, the head-to-head, the result JSON, and the jobs that
read results back (--compare, --same-bits)."""
import datetime
import json
import os
import subprocess
import sys

import torch

from . import megatron_core as mc
from .options import fail
from .plots import plot


def upper_median(xs):
    """The median of a non-empty list, the upper middle one of an even count (the one value every result's medians
    use)."""
    return sorted(xs)[len(xs) // 2]


def summarize(runs):
    """(report per mode, failures) from the runs' records, in this process or merged from several (`--compare`).
    Failures: a mode that did not start from the first mode's weights; megatron_tma's experts not computing Megatron's
    experts' function; a padded mode whose losses, grad norms or final parameters differ from the unpadded mode's;
    an evaluation after the last step that changes when the FP8 weight copies are re-made (stale copies)."""
    failures, report = [], {}
    first = next(iter(runs.values()))
    ref = runs.get("unpadded")
    for mode, run in runs.items():
        losses, norms, times = run["losses"], run["grad_norms"], run["times"]
        tail = max(1, len(losses) // 10)
        timed = times[len(times) // 2:]  # the second half: Megatron's own experts warm up for ~15 steps
        row = {"final_loss": losses[-1], "final_window_mean_loss": sum(losses[-tail:]) / tail,
               "ms_per_step_median": upper_median(timed), "peak_mb": run.get("peak_mb"),
               "left_allocated_mb": run.get("left_allocated_mb"),
               "same_initial_weights": run["init_digests"] == first["init_digests"]}
        if not row["same_initial_weights"]:
            failures.append(f"{mode} did not start from the first mode's weights (the comparison is void)")
        diffs = run.get("experts_diff_vs_megatron")
        if diffs is not None:  # Megatron's own experts against megatron_tma's, same weights and tokens
            row["experts_diff_vs_megatron"] = diffs
            # against SequentialMLP (BF16): BF16 at rounding level, FP8 within its noise (3e-3). Against TEGroupedMLP
            # under TE's FP8 recipe (mode te) the reference is itself FP8: ours in BF16 measures TE's own noise, and
            # the diff of two independent errors is about the sum of their diffs, so ours in FP8 may add its own
            # noise to that (measured on the dsv3-like preset: bf16 2.19e-3, unpadded 4.19e-3).
            bf16_limit = 3e-3 if mode == "te" else 1e-4
            fp8_limit = diffs["bf16"] + 3e-3 if mode == "te" else 3e-3
            if not (diffs["bf16"] < bf16_limit and diffs["unpadded"] < fp8_limit):
                failures.append(f"megatron_tma's experts do not compute Megatron's experts' function ({mode}): "
                                f"{diffs}")
        measured = [m["share"] for m in run.get("experts_share") or [] if m.get("share") is not None]
        if measured:
            row["experts_share_of_step"] = upper_median(measured)
            row["experts_ms_per_step"] = upper_median([m["experts_ms"] for m in run["experts_share"]])
            empty = [m["empty_experts_fraction"] for m in run["experts_share"] if "empty_experts_fraction" in m]
            if empty:  # the routing of those steps (ExpertsTimer.note_routing: empty experts cost modes differently)
                row["empty_experts_fraction"] = upper_median(empty)
                row["largest_expert_share"] = upper_median([m["largest_expert_share"] for m in run["experts_share"]
                                                            if "largest_expert_share" in m])
        busy = run.get("gpu_busy")
        if busy and row["ms_per_step_median"]:  # over an unprofiled step (the profiler slows the host, not the GPU)
            row["gpu_busy_ms"] = busy["busy_ms"]
            row["gpu_busy_fraction"] = busy["busy_ms"] / row["ms_per_step_median"]
        if run.get("eval_loss") is not None:
            row["eval_loss"] = run["eval_loss"]
            row["eval_loss_requantized"] = run["eval_loss_requantized"]
            # unequal: stale FP8 weight copies after the last step (or, without deterministic algorithms, atomics)
            if run["eval_loss"] != run["eval_loss_requantized"] and run.get("eval_exact", True):
                failures.append(f"{mode}: evaluation after the last step gave {run['eval_loss']!r}, "
                                f"{run['eval_loss_requantized']!r} with the FP8 weights re-quantized")
        if ref is not None and mode.startswith("padded"):
            same_loss, same_norm = losses == ref["losses"], norms == ref["grad_norms"]
            same_params = run["param_digests"] == ref["param_digests"]
            row.update(bitexact_losses=same_loss, bitexact_grad_norms=same_norm, bitexact_params=same_params)
            if not (same_loss and same_norm and same_params):
                step = next((i for i, (x, y) in enumerate(zip(losses, ref["losses"])) if x != y), None)
                failures.append(f"{mode} differs from unpadded (losses equal: {same_loss}, first differing step "
                                f"{step}; grad norms equal: {same_norm}; parameters equal: {same_params})")
        for other in ("bf16", "megatron", "te"):  # the references: megatron_tma's BF16 experts, Megatron's own
            if other in runs and mode != other:
                b = runs[other]["losses"]
                row[f"max_abs_loss_gap_vs_{other}"] = max(abs(x - y) for x, y in zip(losses, b))
                row[f"final_window_gap_vs_{other}"] = row["final_window_mean_loss"] - sum(b[-tail:]) / tail
        report[mode] = row
    return report, failures


# The head-to-head's targets (issue 33): the whole model's tokens/s with megatron_tma's unpadded experts over the same
# model's with each other experts mode, and its peak memory at or below theirs ("te" only); the mean loss of the last
# 100 steps within 1% of theirs, judged on runs of 300 steps or more (a shorter run's window holds the steep start of
# training, where the modes' curves cross at different steps: the gap would say nothing about the numerics).
HEAD_TO_HEAD_TARGETS = {"te": {"speedup": 1.2, "peak_at_or_below": True}, "bf16": {"speedup": 1.1}}
LOSS_WINDOW, LOSS_TOLERANCE, LOSS_MIN_STEPS = 100, 0.01, 300


def head_to_head(runs, report):
    """{f"unpadded_vs_{other}": ratios and targets} for `other` in te / bf16 where both ran: speed-up (their median
    step time over ours: = our tokens/s over theirs, the same tokens per step), peak memory ours / theirs (and where
    the bytes held between steps differ, by part: `held_mb_difference`, ours minus theirs), the last
    LOSS_WINDOW steps' mean loss, relative gap, and whether each target is met (the loss target None, "not judged",
    on runs shorter than LOSS_MIN_STEPS). A measurement: reported, never a failure of the run (the bit-for-bit
    checks are)."""
    if "unpadded" not in report:
        return {}
    ours, out = report["unpadded"], {}
    window = lambda m: runs[m]["losses"][-LOSS_WINDOW:]  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for other, targets in HEAD_TO_HEAD_TARGETS.items():
        if other not in report:
            continue
        theirs = report[other]
        row = {"speedup": theirs["ms_per_step_median"] / ours["ms_per_step_median"],
               "timed_steps": len(runs["unpadded"]["times"]) - len(runs["unpadded"]["times"]) // 2,
               "loss_window_steps": len(window("unpadded")),
               "loss_window_mean": mean(window("unpadded")), f"loss_window_mean_{other}": mean(window(other))}
        row["loss_window_rel_gap"] = (row["loss_window_mean"] - row[f"loss_window_mean_{other}"]) / row[
            f"loss_window_mean_{other}"]
        if ours.get("peak_mb") and theirs.get("peak_mb"):
            row["peak_ratio"] = ours["peak_mb"] / theirs["peak_mb"]
        held = (runs["unpadded"].get("held_mb"), runs[other].get("held_mb"))
        if all(held):  # which bytes of the state between steps differ (megatron_tma.mcore.held_memory), MB
            row["held_mb_difference"] = {part: held[0][part] - held[1][part] for part in held[0]
                                         if part in held[1] and held[0][part] != held[1][part]}
        for key in ("experts_share_of_step",):
            if key in ours and key in theirs:
                row[key] = {"unpadded": ours[key], other: theirs[key]}
        row.update(split_by_experts(runs["unpadded"], runs[other], other))
        steps = min(len(runs["unpadded"]["losses"]), len(runs[other]["losses"]))
        met = {"speedup": row["speedup"] >= targets["speedup"],
               "loss_within_1pct": abs(row["loss_window_rel_gap"]) <= LOSS_TOLERANCE if steps >= LOSS_MIN_STEPS else None}
        if steps < LOSS_MIN_STEPS:
            row["loss_not_judged"] = f"{steps} steps: the loss target is judged on runs of >= {LOSS_MIN_STEPS} steps"
        if targets.get("peak_at_or_below") and "peak_ratio" in row:
            met["peak_at_or_below"] = row["peak_ratio"] <= 1.0
        row["targets"] = {"speedup_at_least": targets["speedup"], "met": met}
        out[f"unpadded_vs_{other}"] = row
    return out


def split_by_experts(ours_run, theirs_run, other):
    """Where a speed-up comes from, over the steps whose experts were timed (`--experts-share-steps`: the last K
    steps, each with its own CUDA events for the step and for the experts, so every number here is from the same
    steps): the experts' own ratio (`experts_speedup`), each mode's rest of the step (median over those steps of step
    minus experts' ms), the step ratio over those steps (`window_speedup`; the marks slow each of these steps a
    little, more where the host is the bottleneck), and `speedup_with_rest_equal`, the step ratio had both modes spent
    the mean of the two rests outside the experts. It tells what the experts gave from a difference outside them:
    run-to-run noise (clocks, host jitter) or the experts' effect on their surroundings (host time a mode's experts
    spend shows up there too). {} where either mode has no timed step."""
    def window(run):
        rows = [r for r in run.get("experts_share") or [] if r.get("step_ms") and r.get("experts_ms") is not None]
        if not rows:
            return None
        return {"steps": len(rows), "experts": upper_median([r["experts_ms"] for r in rows]),
                "step": upper_median([r["step_ms"] for r in rows]),
                "rest": upper_median([r["step_ms"] - r["experts_ms"] for r in rows])}
    a, b = window(ours_run), window(theirs_run)
    if a is None or b is None:
        return {}
    equal = (a["rest"] + b["rest"]) / 2
    return {"experts_window_steps": min(a["steps"], b["steps"]),
            "experts_speedup": b["experts"] / a["experts"],
            "rest_of_step_ms": {"unpadded": a["rest"], other: b["rest"]},
            "window_speedup": b["step"] / a["step"],
            "speedup_with_rest_equal": (equal + b["experts"]) / (equal + a["experts"])}


def add_throughput(report, config, world):
    """`tokens_per_s_per_gpu` per mode: the tokens of one step over all data-parallel ranks (each trains micro-batches
    x micro-batch size x sequence length; data-parallel size = world size / pipeline stages, tensor parallelism being
    1 here) per second of the median step time, divided by the GPUs. Skipped for results without those settings."""
    if not all(config.get(k) for k in ("micro_batches", "micro_batch_size", "seq_len")):
        return
    tokens = (world // (config.get("pp") or 1)) * config["micro_batches"] * config["micro_batch_size"] * config["seq_len"]
    for row in report.values():
        if row.get("ms_per_step_median"):
            row["tokens_per_s_per_gpu"] = round(tokens / (row["ms_per_step_median"] / 1e3) / world, 1)


def graphed_vs_eager(graphed, eager):
    """The head-to-head of one mode from the full-iteration CUDA graph against the same mode eager (the same model,
    data and seed): speed-up (eager's median step time over the graphed one's, both over the second half of the
    steps) and whether every step's loss and grad norm and every final parameter are the same bits."""
    half = lambda run: run["times"][len(run["times"]) // 2:]  # noqa: E731
    return {"speedup": upper_median(half(eager)) / upper_median(half(graphed)),
            "ms_per_step_median": {"graphed": upper_median(half(graphed)), "eager": upper_median(half(eager))},
            "bitexact": (graphed["losses"] == eager["losses"] and graphed["grad_norms"] == eager["grad_norms"]
                         and graphed["param_digests"] == eager["param_digests"]),
            "peak_mb": {"graphed": graphed.get("peak_mb"), "eager": eager.get("peak_mb")}}


def source_commit() -> str:
    """The commit the run's sources are (MEGATRON_TMA_COMMIT where a copy has no .git), "-dirty" when the kernels,
    the package or the recipe differ from it; "unknown" without either."""
    env = os.environ.get("MEGATRON_TMA_COMMIT")
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                                      stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    sources = ["csrc", "megatron_tma", "recipes"]
    dirty = subprocess.call(["git", "diff", "--quiet", "HEAD", "--", *sources], cwd=root,
                            stderr=subprocess.DEVNULL) != 0
    try:  # a new file that git does not ignore counts too
        dirty = dirty or bool(subprocess.check_output(["git", "ls-files", "--others", "--exclude-standard", "--",
                                                       *sources], cwd=root, text=True, stderr=subprocess.DEVNULL))
    except (OSError, subprocess.CalledProcessError):
        pass
    return sha + ("-dirty" if dirty else "")


def write_results(args, runs, report, failures, world, loss_floor, extra_head_to_head=None):
    stamp = datetime.datetime.now(datetime.timezone.utc)
    add_throughput(report, vars(args), world)
    result = {
        "benchmark": "moe_gpt", "commit": source_commit(),
        "gpu": "none (CPU job)" if args.cpu else torch.cuda.get_device_name(), "date": stamp.isoformat(),
        "world_size": world, "environment": None if args.cpu else mc.environment(),
        "command": "torchrun --nproc-per-node %d recipes/moe_gpt.py %s" % (world, " ".join(sys.argv[1:])),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "compare", "same_bits")},
        "loss_floor": loss_floor, "summary": report,
        "head_to_head": {**head_to_head(runs, report), **(extra_head_to_head or {})},
        "failures": failures,
        "rows": [{"mode": m, "step": i, "loss": l, "grad_norm": n, "ms": t}
                 for m, run in runs.items() for i, (l, n, t) in enumerate(zip(run["losses"], run["grad_norms"],
                                                                                run["times"]))],
        "records": {m: {k: run.get(k) for k in ("init_digests", "param_digests", "experts_diff_vs_megatron",
                                                 "peak_mb", "held_mb", "left_allocated_mb", "eval_loss",
                                                 "eval_loss_requantized", "eval_exact",
                                                 "optimizer_steps_counted", "resumed_from_step",
                                                 "experts_share", "optimizer_class", "norm_classes",
                                                 "device_token_counts", "cuda_graph",
                                                 "gpu_busy")}
                    for m, run in runs.items()},
    }
    save(result, args.out, stamp)


def save(result, out_dir, stamp):
    """Write the result's JSON and PNG into out_dir under a name no other result there has (two runs in one minute
    get -2, -3, ...; the JSON is created exclusively, so two processes never share a name)."""
    os.makedirs(out_dir, exist_ok=True)
    name = os.path.join(out_dir, f"moe_gpt-{stamp.strftime('%Y%m%d-%H%M')}")
    for n in range(1, 10000):
        base = name if n == 1 else f"{name}-{n}"
        if os.path.exists(base + ".png"):
            continue
        try:
            f = open(base + ".json", "x")
        except FileExistsError:
            continue
        break
    else:
        fail(f"{out_dir} holds 9999 results of {name}: pass another --out")
    with f:
        json.dump(result, f, indent=1)
    print(json.dumps({"summary": result["summary"], "head_to_head": result.get("head_to_head") or {},
                      "failures": result["failures"]}, indent=1))
    plot(result, base + ".png")


def runs_of(result, option, path):
    """The per-mode records of a result (what summarize() reads), rebuilt from its rows and records; `option` and
    `path` name the result in the one-line refusal of one that cannot be compared."""
    if not isinstance(result, dict) or not all(k in result for k in ("records", "rows", "config", "world_size",
                                                                       "loss_floor")):
        fail(f"{option} {path}: not a moe_gpt result with digests (one written before 2026-11-29 23:00, or another "
             "JSON file); run it again")
    runs = {}
    for row in result["rows"]:
        run = runs.setdefault(row["mode"], {"losses": [], "grad_norms": [], "times": []})
        run["losses"].append(row["loss"])
        run["grad_norms"].append(row["grad_norm"])
        run["times"].append(row["ms"])
    for mode, record in result["records"].items():
        runs[mode].update(record)
    return runs


def compare(paths, out_dir):
    """Merge results that ran the same settings with different modes (each process its own), check them as one."""
    results = [read_result(path, "--compare") for path in paths]
    per_result = [runs_of(r, "--compare", path) for r, path in zip(results, paths)]
    settings = [({k: v for k, v in r["config"].items() if k != "modes"}, r["world_size"], r["loss_floor"])
                for r in results]
    if any(s != settings[0] for s in settings):
        raise SystemExit("--compare: the results ran different settings (config other than --modes, world size or "
                         "data); they cannot be compared")
    runs = {}
    for result_runs in per_result:
        for mode, run in result_runs.items():
            if mode in runs:
                raise SystemExit(f"--compare: mode {mode} appears in more than one result")
            runs[mode] = run
    report, failures = summarize(runs)
    first = results[0]
    add_throughput(report, first["config"], first["world_size"])
    stamp = datetime.datetime.now(datetime.timezone.utc)
    merged = {**{k: first[k] for k in ("benchmark", "commit", "gpu", "world_size", "loss_floor")},
              "date": stamp.isoformat(), "command": "python recipes/moe_gpt.py --compare " + " ".join(paths),
              # the runs' own torchrun commands, also through merges of merges
              "merged_from": [m for r in results for m in r.get("merged_from")
                              or [{k: r[k] for k in ("commit", "date", "command")}]],
              "config": {**first["config"], "modes": list(runs)}, "summary": report,
              "head_to_head": head_to_head(runs, report), "failures": failures,
              "rows": [row for r in results for row in r["rows"]],
              "records": {m: r["records"][m] for r in results for m in r["records"]}}
    save(merged, out_dir, stamp)
    return 1 if failures else 0


def read_result(path, option):
    """The result JSON at `path`, given to `option`; stops with one line naming both if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as e:
        fail(f"{option} {path}: cannot be read ({type(e).__name__}: {e.strerror or e}); pass a result JSON")
    except ValueError as e:  # not UTF-8, not JSON
        fail(f"{option} {path}: not a result JSON ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")


def same_bits(path_a, path_b):
    """0 if every mode the two results share trained the same bits (module docstring); prints what differs."""
    runs = [runs_of(read_result(path, "--same-bits"), "--same-bits", path) for path in (path_a, path_b)]
    shared = [m for m in runs[0] if m in runs[1]]
    if not shared:
        raise SystemExit(f"--same-bits: {path_a} and {path_b} have no mode in common")
    differ = []
    for mode in shared:
        a, b = runs[0][mode], runs[1][mode]
        for key in ("init_digests", "losses", "grad_norms", "param_digests"):
            if a[key] != b[key]:
                differ.append(f"{mode}: {key}")
        print(f"{mode}: {len(a['losses'])} / {len(b['losses'])} steps, "
              f"{'the same bits' if not any(d.startswith(mode + ':') for d in differ) else 'DIFFERENT'}")
    for d in differ:
        print(f"differs: {d}")
    return 1 if differ else 0
