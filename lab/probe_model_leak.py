"""Why a finished mode's Megatron model stays allocated in recipes/moe_gpt.py (docs/megatron.md: "not freed
in-process, cause not found"). Runs the recipe's build() and a few training steps for one mode, drops every local
reference, and if the DDP model (or its GPTModel) survives gc, prints the chains of objects that still refer to it,
up to a module global or a root that gc does not track.

    torchrun --nproc-per-node 1 lab/probe_model_leak.py [--mode unpadded] [--steps 2] [recipe options]
"""
import gc
import importlib.util
import os
import sys
import types
import weakref

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "recipes")]
importlib.import_module("moe_gpt_recipe.launch")  # the recipe's package, every module of it
recipe = importlib.import_module("moe_gpt_recipe")
recipe.megatron_core.import_megatron()  # the recipe imports megatron-core for its GPU job only


def describe(o):
    if isinstance(o, dict):
        return f"dict({len(o)} keys: {', '.join(map(str, list(o)[:6]))})"
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_name} ({o.f_code.co_filename}:{o.f_lineno})"
    if isinstance(o, (list, tuple, set)):
        return f"{type(o).__name__}[{len(o)}]"
    if isinstance(o, types.MethodType):
        return f"bound method {o.__func__.__qualname__}"
    if isinstance(o, types.FunctionType):
        return f"function {o.__qualname__}"
    if isinstance(o, types.CellType):
        return "cell"
    return type(o).__module__ + "." + type(o).__qualname__


def chains(target, ignore, depth=8, width=4):
    """Referrer chains from target upwards (breadth-limited), skipping this function's own lists."""
    seen = {id(target)}
    level, paths = [target], [[describe(target)]]
    modules = {id(vars(m)): m.__name__ for m in list(sys.modules.values()) if m is not None and hasattr(m, "__dict__")}
    for _ in range(depth):
        ignore.update((id(level), id(paths)))
        nxt, nxt_paths = [], []
        ignore.update((id(nxt), id(nxt_paths)))
        for i in range(len(level)):
            obj, path = level[i], paths[i]
            refs = gc.get_referrers(obj)
            ignore.add(id(refs))
            refs = [r for r in refs if id(r) not in ignore and id(r) not in seen and not isinstance(r, types.FrameType)]
            ignore.add(id(refs))
            if not refs:
                print("  held by something gc does not track:", " <- ".join(path))
            for r in refs[:width]:
                seen.add(id(r))
                if id(r) in modules:
                    key = next((k for k, v in r.items() if v is obj), "?")
                    print("  " + " <- ".join(path) + f" <- module global {modules[id(r)]}.{key}")
                    continue
                nxt.append(r)
                nxt_paths.append(path + [describe(r)])
        level, paths = nxt, nxt_paths
    for path in paths[:8]:
        print("  (depth limit)", " <- ".join(path))


def main():
    argv = sys.argv[1:]
    mode = "unpadded"
    if "--mode" in argv:
        i = argv.index("--mode")
        mode = argv[i + 1]
        del argv[i:i + 2]
    args = recipe.options.parse_args(["--steps", "2", "--log-every", "1", "--out", "/tmp/probe_leak", *argv])
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    args.ep = args.ep or dist.get_world_size()
    recipe.megatron_core.parallel_state.initialize_model_parallel(expert_model_parallel_size=args.ep)
    batches, _ = recipe.data.chain_batches(args, recipe.megatron_core.parallel_state.get_data_parallel_rank())
    made = []
    build = recipe.training.build

    def recording_build(a, m):
        model, optimizer = build(a, m)
        made.append((weakref.ref(model), weakref.ref(model.module.module), weakref.ref(optimizer)))
        return model, optimizer

    recipe.training.build = recording_build
    before = torch.cuda.memory_allocated()
    recipe.training.train(args, mode, dist.get_rank(), batches)
    gc.collect()
    torch.cuda.synchronize()
    ddp, gpt, opt = made[0]
    print(f"[{mode}] after train() and gc: DDP {'alive' if ddp() else 'freed'}, GPTModel "
          f"{'alive' if gpt() else 'freed'}, optimizer {'alive' if opt() else 'freed'}; "
          f"{(torch.cuda.memory_allocated() - before) / 2**20:.0f} MB still allocated", flush=True)
    for name, ref in (("optimizer", opt), ("DDP", ddp), ("GPTModel", gpt)):
        if ref() is not None:
            print(f"who holds the {name}:")
            chains(ref(), ignore={id(made), id(sys._getframe().f_locals)})
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
