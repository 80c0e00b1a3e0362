"""Train a small MoE GPT with Megatron-core once per experts mode, on the same data from the same initial weights,
and check that the unpadded FP8 experts train exactly like their padded twins.

    torchrun --nproc-per-node 1 recipes/moe_gpt.py --cpu --out OUT_DIR            # the CPU job (below)
    torchrun --nproc-per-node 1 recipes/moe_gpt.py --out OUT_DIR                  # 5 modes x 300 steps
    torchrun --nproc-per-node 2 recipes/moe_gpt.py --ep 2 --out OUT_DIR           # experts split over 2 GPUs
    torchrun --nproc-per-node 2 recipes/moe_gpt.py --etp 2 --out OUT_DIR          # every expert split over 2 GPUs
    torchrun --nproc-per-node 2 recipes/moe_gpt.py --pp 2 --micro-batches 4 --out OUT_DIR   # 2 pipeline stages
    torchrun --nproc-per-node 2 recipes/moe_gpt.py --pp 2 --vpp 2 --micro-batches 4 --out OUT_DIR  # interleaved
    torchrun --nproc-per-node 2 recipes/moe_gpt.py --ep 1 --distributed-optimizer --overlap-grad-reduce \
        --overlap-param-gather --out OUT_DIR     # experts replicated, their weights sharded by the optimizer

Everything around the experts is Megatron's: GPTModel with the local layer spec (attention, RMSNorm, the top-k
router with its aux loss, the all-to-all token dispatcher), Float16Module, Megatron's DDP with FP32 gradient
buffers (`main_grad`, which the K-grouped GEMM accumulates into), Megatron's mixed-precision Adam (FP32 master
weights copied into the BF16 parameters through `.data`, the update no version counter sees), the no-pipelining
forward/backward schedule over `--micro-batches` micro-batches, gradient clipping, and torch's deterministic
algorithms (without them Megatron's top-k combine sums with atomics; at top-4, runs that must match differed in the
last bits). Only the MoE layers' experts are switched, by the config flag `config.moe_megatron_tma_experts`
(megatron_tma.mcore.spec):
* `unpadded`: megatron_tma's FP8 experts, no padding anywhere;
* `padded16` / `padded128`: the same FP8 Functions on every expert's tokens padded to 16 / 128 rows (what
  Transformer Engine's and DeepGEMM's FP8 expert paths need);
* `bf16`: the same MLP with BF16 GEMMs;
* `megatron`: the flag unset, i.e. Megatron's own experts of the local spec (SequentialMLP, a BF16 MLP per expert),
  given the initial weights megatron_tma's experts draw (the loss-curve reference).
Data: token sequences in which each token follows, by a fair coin, the token before it or the one two before it
through two fixed random tables (4 likely successors each), drawn on the GPU from one seed per rank, so every mode
sees the same batches; the loss can fall from ln(vocab) to the data's entropy (recorded as `loss_floor`).

Checks (the exit status is 1 if one fails): every mode starts from the same weights (dense layers and experts, under
megatron_tma's state-dict keys); megatron_tma's experts, given the weights of Megatron's own, compute their function
on the same routed tokens (the diff of docs/design.md §3: BF16 < 1e-4, FP8 < 3e-3); every padded mode's per-step losses and grad
norms equal the unpadded mode's bit for bit, and so do all parameters after the last step (`torch.equal`, every rank
its own); an evaluation after the last step (Megatron's: forward only, no per-iteration reset) gives the same loss
again once the FP8 weight copies are forcibly re-made, i.e. it ran on the stepped weights (with `--nondeterministic`
the two may differ by atomics: reported, not checked). Reported, not pass/fail: how close each curve stays to the
BF16 ones (largest gap, final-window mean gap), the median ms per step over the second half of the steps (and the
tokens per second per GPU it makes) and each mode's peak GPU memory (what it allocated beyond what the process held before it, most over ranks). Writes
`moe_gpt-<date>.json` (per-step losses, grad norms, ms per step, the checks) and a PNG of the curves and step times
to `--out` (`--plot RESULT.json --out DIR` redraws the PNG of a result into DIR, on any machine, never over an
existing file). Before any distributed set-up it stops with one line for each missing piece: a visible GPU,
Python >= 3.12 and megatron-core, megatron_tma's CUDA kernels (without them the experts would run the torch
reference), torchrun; matplotlib for `--plot` and `--cpu`.

Transformer Engine (issue 33; docs/megatron.md): `--transformer-impl transformer_engine` builds TE's layer spec
(attention, norms, dense and shared-expert MLPs are TE modules) and `--fp8-format e4m3 --fp8-recipe blockwise` trains
them in TE's FP8 under Megatron's own FP8 context; mode `te` is Megatron's TEGroupedMLP under the same recipe (the
incumbent); our modes drop into the same TE model by the same switch. `--preset dsv3-like --modes unpadded te bf16`
is the head-to-head (the result's `head_to_head`: tokens/s and peak-memory ratios, the last 100 steps' loss gap, the
experts' share of the step from `--experts-share-steps`); the README's measured one adds `--micro-batch-size 8
--moe-permute-fusion --permute-in-experts` (at the preset's size the step is host-bound). `--preset qwen3-30b` and
`--preset dsv3-rank` are real models' layers (Qwen3-30B-A3B; one EP rank of DeepSeek-V3), their head-to-heads the same
options without `--micro-batch-size`; `--profile-step` adds the step's GPU-busy fraction to the result. TE is optional: without it
`--transformer-impl transformer_engine` stops with one line.
`--cpu`: the CPU job, on one process without Megatron or a GPU (recipes/moe_gpt_cpu.py; its docstring lists what in
megatron-core 0.19.2 assumes CUDA): a tiny MoE GPT in torch around megatron_tma's own experts on the reference
backend (modes unpadded, padded16, padded128, bf16; a few minutes on 2 cores at its default size, any size option
changes it), the same bit-for-bit checks, results and plot.
Checkpoints (Megatron-LM's option names; megatron_tma.mcore.checkpoint): `--save DIR --save-interval N` writes a
`torch_dist` checkpoint of each mode (every model chunk, the optimizer state -- the mixed-precision optimizer's, or
the distributed optimizer's in `dp_reshardable` or, with `--dist-ckpt-optim-fully-reshardable`, `fully_reshardable`
format --, each rank's RNG states and the run's records so far) to DIR/<mode>/iter_<step>; `--load DIR` resumes each
mode from its newest one and trains on to `--steps`, and its result holds the whole run. A resumed run is the
uninterrupted run, bit for bit (`--same-bits`; tests/test_mcore_gpu.py kills a run with `--kill-after-step` and
resumes it). The CPU job takes the same options (its own single-file checkpoints, recipes/moe_gpt_cpu.py). One job
saves into a --save directory at a time: a second one stops before any work (megatron_tma.mcore.checkpoint's save
lock), and --save is checked writable then, as --out is.
`--same-bits A.json B.json` checks that two results trained their shared modes to the same bits (for options that
must not change the numbers, such as `--recompute-modules moe_act`, `--recompute-full`, `--overlap-grad-reduce` or
`--overlap-param-gather`).

Memory: each mode's model is freed before the next is built (`release`: Megatron's model sits in reference cycles
that only Python's cyclic collector frees), and the result records what stayed allocated after each mode
(`left_allocated_mb`; the first mode leaves library workspaces and Megatron's global buffer for the local
attention's scores behind). At DeepSeek-V3-like sizes (hidden 7168, 32 experts of FFN 2048, ~58 GB per model with
its Adam states) one mode per process is still the cleaner measurement of each mode's peak memory: run `--modes
unpadded`, `--modes padded16`, ... (`scripts/recipe_modes.sh`) and merge the results with `--compare A.json B.json
...`, which checks them as one run: the comparisons use per-tensor SHA-256 digests of every rank's weights, so no
process keeps another's model.
"""
import argparse
import contextlib
import datetime
import functools
import gc
import hashlib
import importlib.util
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl).*")
# cuBLAS needs a fixed workspace to be deterministic (torch.use_deterministic_algorithms, set in main)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tma._ext import cuda_kernels_available, extension_error  # noqa: E402
from megatron_tma.limits import MAX_EXPERTS  # noqa: E402
from megatron_tma.mcore import experts as mcore_experts  # noqa: E402
from megatron_tma.mcore import (  # noqa: E402
    CONFIG_FLAG, MODES, from_sequential_mlp_key, invalidate_fp8_weights, keep_token_counts_on_device, megatron_experts,
    permute_in_experts)
from megatron_tma.mcore import checkpoint  # noqa: E402


def import_megatron():
    """Import the megatron-core modules the GPU job uses, as this module's globals; the import's error, or None.
    Only the GPU job imports them (preflight), so the CPU job (--cpu), --plot, --compare and --same-bits run without
    megatron-core, and a missing one stops the GPU job with one line before any distributed set-up."""
    global parallel_state, DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads, GPTModel
    global get_gpt_layer_local_spec, OptimizerConfig, get_megatron_optimizer, get_forward_backward_func
    global get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name, model_parallel_cuda_manual_seed
    global Float16Module, TransformerConfig, layer_spec_from_config, gpt_layer_specs
    try:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name, model_parallel_cuda_manual_seed)
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron_tma.mcore import layer_spec_from_config
    except Exception as e:  # not installed, a missing dependency (psutil), or a Python it does not run on
        return e
    return None


MEGATRON_PYTHON = (3, 12)  # megatron-core 0.19's requires-python


def te_import_error():
    """The error importing Transformer Engine's PyTorch API raises, or None. Checked before megatron-core is imported
    (megatron-core picks its TE code paths at import), only for --transformer-impl transformer_engine: TE is an
    optional extra, never needed by the local spec or the CPU job."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # not installed, or its library does not load (no GPU driver, a CUDA mismatch)
        return e
    return None

# megatron_tma's modes, and Megatron's own experts (the config flag left unset), given the initial weights
# megatron_tma's experts draw (same initial model): "megatron", those of the local spec (SequentialMLP: one BF16 MLP
# per expert), and "te", those of Transformer Engine's spec (TEGroupedMLP: TE's GroupedLinear, under the run's FP8
# recipe behind Fp8Padding: the incumbent these experts replace).
RECIPE_MODES = MODES + ("megatron", "te")
# --transformer-impl (Megatron-LM's option): the layer spec around the experts. The default is "local" so that the
# recipe runs where Transformer Engine is not installed (it is an optional extra: `pip install -e ".[te]"` on a GPU
# machine); Megatron-LM's own default is "transformer_engine", which is what a real run uses.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_FORMATS = ("e4m3",)  # Megatron-LM's --fp8-format; only E4M3 is taken: the format of megatron_tma's own recipe
FP8_RECIPES = ("blockwise",)  # Megatron-LM's --fp8-recipe; blockwise (1x128 / 128x128) is the recipe ours computes
# Each impl's default modes: every megatron_tma mode and Megatron's own experts of that spec ("te" only under FP8).
DEFAULT_MODES = {"local": MODES + ("megatron",), "transformer_engine": MODES}
# --preset dsv3-like: a DeepSeek-V3-like MoE shrunk to one H200 at EP = 1 (fine-grained experts: 64 of FFN 640 at
# hidden 2048, top-8, one shared expert of the same FFN), big enough that the experts are a real share of the step
# and small enough that three modes of 300 steps run in one process within ten minutes. Any option overrides it.
#
# The model presets are real models' MoE layers at one GPU (EP = 1), as many layers as fit an 80 GB H100 under each
# mode with Megatron's mixed-precision Adam (the experts' parameters, FP32 gradients and optimizer state are ~18 bytes
# a parameter: ~11 GB a layer for qwen3-30b, ~25 GB for dsv3-rank; measured peaks with TE's layers: 61-62 GiB at 5
# layers, 69-70 GiB at 2, recipes/results/moe_gpt-te-*-20261206-*.json), one sequence a micro-batch and gradient
# accumulation over 4 micro-batches a step. The vocabulary stays the recipe's synthetic 4096: the data are drawn from
# [vocab, vocab] tables, and with a handful of a model's layers its real head (152k / 129k entries) would be a share
# of the step it is not in the whole model.
# --preset qwen3-30b: Qwen3-30B-A3B's layer: hidden 2048, 32 query heads over 4 key/value groups of head dim 128 with
# QK layer norm, 128 experts of FFN 768, top-8, no shared expert, sequence 4096 (the model has 48 such layers).
# --preset dsv3-rank: one expert-parallel rank of DeepSeek-V3 (EP = 8 in the real run: 32 of its 256 experts):
# hidden 7168, 32 experts of FFN 2048, top-8 over them, one shared expert of FFN 2048, sequence 4096. Its attention
# is grouped-query attention standing in for Multi-head Latent Attention (Megatron's MLA needs TE's layers): 128
# query heads of dim 128 as DeepSeek-V3's, 8 key/value groups.
PRESETS = {"dsv3-like": dict(layers=4, hidden=2048, heads=16, experts=64, topk=8, expert_ffn=640,
                             shared_expert_ffn=640, seq_len=2048, micro_batch_size=2, micro_batches=2, vocab=4096,
                             lr=3e-4),
           "qwen3-30b": dict(layers=5, hidden=2048, heads=32, num_query_groups=4, kv_channels=128, qk_layernorm=True,
                             experts=128, topk=8, expert_ffn=768, seq_len=4096, micro_batch_size=1, micro_batches=4,
                             vocab=4096, lr=3e-4),
           "dsv3-rank": dict(layers=2, hidden=7168, heads=128, num_query_groups=8, kv_channels=128,
                             experts=32, topk=8, expert_ffn=2048, shared_expert_ffn=2048, seq_len=4096,
                             micro_batch_size=1, micro_batches=4, vocab=4096, lr=3e-4)}
RECOMPUTE_MODULES = ("moe_act", "moe", "core_attn", "layernorm", "mlp")
# The CPU job (--cpu, recipes/moe_gpt_cpu.py): megatron_tma's modes on the reference backend, without Megatron, and
# its default size (a few minutes on 2 cores; every size option overrides it as in the GPU job)
CPU_MODES = MODES
CPU_SIZE = dict(steps=150, micro_batches=1, micro_batch_size=8, seq_len=64, layers=2, hidden=128, heads=4, experts=4,
                topk=2, expert_ffn=128, vocab=128, lr=3e-3, log_every=10)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="the CPU job: the same tiny MoE GPT through megatron_tma's own modules on the reference "
                        "backend, without Megatron or a GPU (recipes/moe_gpt_cpu.py says why), one process; the same "
                        "bit-for-bit checks and plot. Default size: " + ", ".join(
                            f"--{k.replace('_', '-')} {v}" for k, v in CPU_SIZE.items()))
    p.add_argument("--modes", nargs="+", default=None, choices=RECIPE_MODES,
                   help="experts modes, trained one after the other from the same weights (default: every "
                        "megatron_tma mode and Megatron's own experts of the spec: `megatron` with --transformer-impl "
                        "local, `te` with transformer_engine and --fp8-format)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a model size: " + "; ".join(f"{name}: " + ", ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in size.items()) for name, size in PRESETS.items())
                   + " (any size option overrides it)")
    p.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                   help="Megatron-LM's option: the layer spec around the experts. transformer_engine: Transformer "
                        "Engine's spec (attention, layer norms, dense and shared-expert MLPs are TE modules; "
                        "Megatron's own experts are TEGroupedMLP, mode `te`), which needs transformer_engine "
                        "installed. Default local (Megatron's local spec; Megatron-LM's default is "
                        "transformer_engine), so that the recipe runs where TE is not installed: TE is an optional "
                        "extra for GPU machines")
    p.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                   help="Megatron-LM's option: train the Transformer Engine layers in FP8 (config.fp8), under "
                        "Megatron's own FP8 context; needs --transformer-impl transformer_engine. megatron_tma's "
                        "experts quantize themselves and are the same in every case")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="blockwise",
                   help="Megatron-LM's option (config.fp8_recipe), with --fp8-format: blockwise (TE's "
                        "Float8BlockScaling, DeepSeek-V3's recipe; default here, Megatron-LM's default is delayed)")
    p.add_argument("--shared-expert-ffn", type=int, default=None, metavar="FFN",
                   help="a shared expert of this FFN size in every MoE layer (moe_shared_expert_intermediate_size; "
                        "Megatron's MLP: a TE module under --transformer-impl transformer_engine)")
    p.add_argument("--experts-share-steps", type=int, default=10, metavar="K",
                   help="measure the experts' share of the step on the last K steps: CUDA events on the stream "
                        "where the experts' forward starts and ends and where their backward starts and ends, "
                        "against the whole step (0: off)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=None, metavar="GROUPS",
                   help="Megatron-LM's option (with --group-query-attention there): grouped-query attention, the "
                        "query heads sharing this many key/value heads (default: one per query head)")
    p.add_argument("--kv-channels", type=int, default=None, metavar="DIM",
                   help="Megatron-LM's option: the attention head dimension (default --hidden / --heads)")
    p.add_argument("--qk-layernorm", action="store_true",
                   help="Megatron-LM's option: a layer norm on each query and key head (Qwen3's attention)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel size (default: the world size over --etp and --pp)")
    p.add_argument("--etp", type=int, default=1,
                   help="expert tensor-parallel size: every expert's FFN split over this many ranks, which all see "
                        "the group's tokens; Megatron's dispatcher adds up their partial outputs")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel size: the layers split over this many stages (--layers divisible by it), "
                        "Megatron's 1F1B schedule (--pp - 1 warm-up micro-batch forwards on the first stage)")
    p.add_argument("--vpp", type=int, default=None, metavar="CHUNKS",
                   help="virtual pipeline stages per pipeline rank (Megatron's interleaved 1F1B: each rank holds "
                        "CHUNKS model chunks of --layers / (--pp x CHUNKS) layers; needs --pp >= 2)")
    p.add_argument("--out", default="recipes/results")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron DDP's overlapped gradient reduction (its hooks then require a gradient per weight)")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: gradients reduce-scattered, each data-parallel rank updates "
                        "its shard of every parameter (the experts' too, over the expert data-parallel ranks), then "
                        "the parameters are all-gathered")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="the distributed optimizer's parameter all-gather overlapped with the next forward: each "
                        "module's forward pre-hook waits for its own parameters' bucket (needs "
                        "--distributed-optimizer and --overlap-grad-reduce, as in Megatron-LM)")
    p.add_argument("--ddp-bucket-size", type=int, default=None, metavar="ELEMENTS",
                   help="Megatron DDP's bucket size in elements (default: Megatron's); small buckets make the "
                        "all-gather wait per module")
    p.add_argument("--nondeterministic", action="store_true",
                   help="leave torch's deterministic algorithms off (at top-k >= 3 Megatron's combine then sums "
                        "with atomics, and modes that should match bit for bit may not)")
    p.add_argument("--moe-permute-fusion", action="store_true",
                   help="Megatron-LM's option (config.moe_permute_fusion): Transformer Engine's fused kernels for the "
                        "dispatcher's token permutation, un-permutation and chunk sort, in every mode (a Megatron-LM "
                        "run with TE usually sets it); needs Transformer Engine installed")
    p.add_argument("--device-token-counts", action="store_true",
                   help="megatron_tma's modes: Megatron's all-to-all dispatcher keeps the token counts on the GPU "
                        "(megatron_tma.mcore.keep_token_counts_on_device: no host sync and no identity chunk sort per "
                        "MoE layer at EP = 1, TP = 1; the same bits); the result's device_token_counts says which "
                        "layers it took and why others did not")
    p.add_argument("--permute-in-experts", action="store_true",
                   help="megatron_tma's modes: the dispatcher hands the experts the tokens as they are and the experts "
                        "gather the rows inside their first quantizer and combine their output per token (megatron_tma."
                        "mcore.permute_in_experts: no permuted BF16 copy either way; includes --device-token-counts); "
                        "the result's device_token_counts says which layers it took and why others did not")
    p.add_argument("--profile-step", type=int, default=None, metavar="STEP",
                   help="print torch.profiler's tables of the ops that took the most GPU time and the most host time "
                        "in this step (rank 0; that step's time then includes the profiler)")
    ckpt = p.add_argument_group("checkpoints (Megatron-LM's option names; megatron_tma.mcore.checkpoint)")
    ckpt.add_argument("--save", metavar="DIR",
                      help="save a torch_dist checkpoint of each mode (model, optimizer state, RNG states, the run's "
                           "records so far) into DIR/<mode>/iter_<step> every --save-interval steps")
    ckpt.add_argument("--save-interval", type=int, default=None, metavar="STEPS")
    ckpt.add_argument("--load", metavar="DIR",
                      help="resume each mode from its newest checkpoint in DIR/<mode> (from scratch where it has "
                           "none) and train on to --steps; the result holds the whole run, as if never interrupted")
    ckpt.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                      help="the distributed optimizer's per-parameter checkpoint format ('fully_reshardable'; "
                           "default 'dp_reshardable', as Megatron-LM)")
    ckpt.add_argument("--kill-after-step", type=int, default=None, metavar="STEP",
                      help="a test of resuming: every rank kills itself (SIGKILL: no clean-up, no result) right after "
                           "this step and its checkpoint, if one is due")
    recompute = p.add_mutually_exclusive_group()
    recompute.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, metavar="MODULE",
                           help="Megatron's selective recompute of these modules (recompute_modules): 'moe_act', the "
                                "experts' activation (the FP8 experts then keep h instead of its FP8 columns), 'moe', "
                                "the whole MoE layer under Megatron's checkpoint, or "
                                f"{', '.join(RECOMPUTE_MODULES[2:])}; the same bits either way")
    recompute.add_argument("--recompute-full", action="store_true",
                           help="Megatron's full recompute: every transformer layer under its checkpoint (uniform, "
                                "one layer per checkpoint)")
    p.add_argument("--plot", metavar="RESULT_JSON",
                   help="only redraw the PNG of a result into --out, never over an existing file (no GPU, no torchrun)")
    p.add_argument("--compare", nargs="+", metavar="RESULT_JSON",
                   help="merge results of the same run settings, each with its own modes (one process per mode, for "
                        "models too large to hold several), check them as one run and write the merged result")
    p.add_argument("--same-bits", nargs=2, metavar=("A_JSON", "B_JSON"),
                   help="check that two results (e.g. with and without an option that must not change the numbers) "
                        "trained every mode they share bit for bit: the same initial weights, per-step losses and "
                        "grad norms, and final parameters")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--cpu", action="store_true")
    pre.add_argument("--preset", choices=sorted(PRESETS))
    known = pre.parse_known_args(argv)[0]
    if known.cpu:
        p.set_defaults(modes=list(CPU_MODES), **CPU_SIZE)
    if known.preset:
        p.set_defaults(**PRESETS[known.preset])
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = list(DEFAULT_MODES[args.transformer_impl]) + (
            ["te"] if args.transformer_impl == "transformer_engine" and args.fp8_format else [])
    jobs = [flag for flag, asked in (("--cpu", args.cpu), ("--plot", args.plot), ("--compare", args.compare),
                                     ("--same-bits", args.same_bits)) if asked]
    if len(jobs) > 1:  # each is a job of its own: one would run and the others be ignored (a --same-bits gate passing)
        p.error(f"{' and '.join(jobs)} are different jobs of the recipe: pass one of them")
    if args.cpu:
        megatron_only = [flag for flag, asked in (
            ("--modes megatron", "megatron" in args.modes), ("--modes te", "te" in args.modes),
            ("--transformer-impl transformer_engine", args.transformer_impl != "local"),
            ("--fp8-format", args.fp8_format is not None), ("--shared-expert-ffn", args.shared_expert_ffn is not None),
            ("--ep", args.ep not in (None, 1)),
            ("--etp", args.etp != 1), ("--pp", args.pp != 1), ("--vpp", args.vpp is not None),
            ("--overlap-grad-reduce", args.overlap_grad_reduce),
            ("--distributed-optimizer", args.distributed_optimizer),
            ("--overlap-param-gather", args.overlap_param_gather), ("--ddp-bucket-size", args.ddp_bucket_size),
            ("--recompute-modules", args.recompute_modules), ("--recompute-full", args.recompute_full),
            ("--profile-step", args.profile_step is not None),
            ("--device-token-counts", args.device_token_counts),
            ("--permute-in-experts", args.permute_in_experts),
            ("--moe-permute-fusion", args.moe_permute_fusion)) if asked]
        if megatron_only:
            p.error(f"--cpu trains without Megatron, in one process; the GPU job's options: {', '.join(megatron_only)}")
    bad = bad_sizes(args)
    if bad:
        p.exit(2, f"moe_gpt.py: error: {bad}\n")  # one line (no usage block), before any work
    if args.vpp is not None and (args.vpp < 1 or args.pp < 2):
        p.error("--vpp needs --pp >= 2 and at least 1 chunk (Megatron interleaves the chunks of a pipeline)")
    if (args.save is None) != (args.save_interval is None) or (args.save_interval is not None
                                                                and args.save_interval < 1):
        p.error("--save DIR and --save-interval STEPS (>= 1) go together")
    if args.dist_ckpt_optim_fully_reshardable and not args.distributed_optimizer:
        p.error("--dist-ckpt-optim-fully-reshardable is a format of the distributed optimizer's checkpoint: add "
                "--distributed-optimizer")
    if args.overlap_param_gather and not (args.distributed_optimizer and args.overlap_grad_reduce):
        p.error("--overlap-param-gather needs --distributed-optimizer and --overlap-grad-reduce (as in Megatron-LM)")
    refusal = transformer_impl_refusal(args)
    if refusal:
        p.error(refusal)
    return args


def transformer_impl_refusal(args):
    """Why --transformer-impl, the FP8 options and the modes do not go together (one line), or None."""
    te = args.transformer_impl == "transformer_engine"
    if args.fp8_format and not te:
        return ("--fp8-format: Megatron's FP8 is Transformer Engine's (its FP8 layers are TE modules, the local spec "
                "has none): add --transformer-impl transformer_engine")
    if "te" in args.modes and not (te and args.fp8_format):
        return ("--modes te is Megatron's TEGroupedMLP under the run's FP8 recipe: add --transformer-impl "
                "transformer_engine --fp8-format e4m3 --fp8-recipe blockwise")
    if "megatron" in args.modes and te:
        return ("--modes megatron is Megatron's own experts of the local spec (SequentialMLP); under "
                "--transformer-impl transformer_engine Megatron's own experts are --modes te (TEGroupedMLP)")
    return None


# Options that must be positive integers (any run: a zero reached the training loop as an IndexError, a
# ZeroDivisionError or a reshape error).
POSITIVE = ("steps", "micro_batches", "micro_batch_size", "seq_len", "layers", "hidden", "heads", "experts", "topk",
            "expert_ffn", "vocab", "log_every", "etp", "pp")
NON_NEGATIVE = ("experts_share_steps",)
# The largest --seed: chain_batches seeds each rank's data with seed x 1000 + 1 + rank, which torch takes up to 2**64 - 1
# (ranks < 1000)
MAX_SEED = (2**64 - 1000) // 1000
FP8_MODES = tuple(m for m in MODES if m != "bf16")  # the modes whose experts are megatron_tma's FP8 ones


def bad_sizes(args):
    """The first size option that breaks a rule, as one line naming it and the rule; None if all hold."""
    for name in POSITIVE:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    for name in NON_NEGATIVE:
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}"
    for name in ("ep", "kill_after_step", "ddp_bucket_size", "shared_expert_ffn", "num_query_groups", "kv_channels"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.kv_channels is None and args.hidden % args.heads:
        return (f"--hidden {args.hidden} must be divisible by --heads {args.heads} (the attention heads split it), "
                "or give the head dimension with --kv-channels")
    if args.num_query_groups is not None and args.heads % args.num_query_groups:
        return (f"--heads {args.heads} must be divisible by --num-query-groups {args.num_query_groups} (each "
                "key/value group serves the same number of query heads)")
    if args.topk > args.experts:
        return f"--topk {args.topk} must be <= --experts {args.experts} (each token goes to topk distinct experts)"
    if not 0 <= args.seed <= MAX_SEED:
        return (f"--seed must be in [0, {MAX_SEED}], got {args.seed} (torch's seeds are 64-bit and each rank's data "
                "is drawn from seed x 1000 + 1 + rank)")
    fp8 = [m for m in args.modes if m in FP8_MODES]
    if fp8:  # megatron_tma's own rules (megatron_tma.mlp, megatron_tma.limits), here before any work
        for name in ("hidden", "expert_ffn"):
            if getattr(args, name) % 128:
                return (f"--{name.replace('_', '-')} must be a multiple of 128, got {getattr(args, name)} (the FP8 "
                        f"experts of --modes {' '.join(fp8)} contract over it in 128-wide scaling blocks)")
        if args.experts > MAX_EXPERTS:
            return (f"--experts must be <= {MAX_EXPERTS}, got {args.experts} (megatron_tma.limits.MAX_EXPERTS: the "
                    f"groups the FP8 GEMMs of --modes {' '.join(fp8)} take in training)")
    return None


# The options that do not change what a run trains (where it reads and writes, what it prints, when it stops or saves,
# which modes): every other option must be the checkpoint's for a resume (check_resume).
NOT_TRAINING = ("modes", "out", "log_every", "save", "save_interval", "load", "kill_after_step", "plot", "compare",
                "same_bits", "profile_step", "dist_ckpt_optim_fully_reshardable", "preset", "experts_share_steps",
                "device_token_counts")  # the last: the same bits with or without it


# Training options added after checkpoints had been saved (issue 33), with the value those checkpoints trained with.
ADDED_OPTIONS = {"transformer_impl": "local", "fp8_format": None, "fp8_recipe": "blockwise", "shared_expert_ffn": None,
                 "moe_permute_fusion": False, "permute_in_experts": False,
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


def ddp_settings(args):
    """The DistributedDataParallelConfig fields of the run's data-parallel options (the optimizer config takes
    `use_distributed_optimizer` too)."""
    settings = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
                    use_distributed_optimizer=args.distributed_optimizer,
                    overlap_param_gather=args.overlap_param_gather)
    if args.ddp_bucket_size is not None:
        settings["bucket_size"] = args.ddp_bucket_size
    return settings


def model_settings(args):
    """The TransformerConfig fields of the spec and precision options: Megatron-LM's `--transformer-impl`,
    `--fp8-format` / `--fp8-recipe` (TE FP8 of the TE layers under Megatron's FP8 context), the shared expert.
    Never `moe_router_padding_for_quantization` (alias `moe_router_padding_for_fp8`): it would pad every expert's
    routed tokens for FP8 in Megatron's dispatcher, which megatron_tma's experts do not need (docs/megatron.md), and
    TEGroupedMLP pads its own tokens (Fp8Padding)."""
    settings = dict(transformer_impl=args.transformer_impl, moe_shared_expert_intermediate_size=args.shared_expert_ffn,
                    num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
                    qk_layernorm=args.qk_layernorm)
    if args.fp8_format:
        settings.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
    if args.moe_permute_fusion:
        settings["moe_permute_fusion"] = True
    if args.transformer_impl == "transformer_engine" and not args.nondeterministic:
        # TE's attention picks deterministic kernels only so (Megatron-LM's --deterministic-mode; preflight sets
        # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, which that mode requires)
        settings["deterministic_mode"] = True
    return settings


def base_layer_spec(args):
    """The layer spec Megatron-LM's `--transformer-impl` picks for the MoE model (Megatron's own experts in it)."""
    if args.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=args.experts,
                                                                          moe_grouped_gemm=True,
                                                                          qk_layernorm=args.qk_layernorm)
    return get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=True, qk_layernorm=args.qk_layernorm)


def recompute_settings(args):
    """The TransformerConfig fields of the run's recompute options (none: Megatron's defaults, no recompute)."""
    if args.recompute_full:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if args.recompute_modules:
        return dict(recompute_granularity="selective", recompute_modules=list(args.recompute_modules))
    return {}


def _successor_table(args, g, device="cuda"):
    """[vocab, vocab] next-token distributions: 4 likely successors per row (0.55 / 0.25 / 0.15 / 0.05), 2% uniform."""
    succ = torch.randint(0, args.vocab, (args.vocab, 4), generator=g, device=device)
    weights = torch.tensor([0.55, 0.25, 0.15, 0.05], device=device).expand(args.vocab, 4)
    table = torch.zeros(args.vocab, args.vocab, device=device).scatter_add_(1, succ, weights)
    return 0.98 * table + 0.02 / args.vocab


def chain_batches(args, rank):
    """All micro-batches of the run, `[steps * micro_batches, batch, seq_len + 1]` token ids. Each next token is
    drawn, by a fair coin, from the row of the token before it in one random table (a bigram) or from the row of
    the token two before in another (a skip-bigram), so the model learns fast at first and then has to learn to
    attend one position further back. The tables are alike on every rank, the draws are per rank; made once and
    replayed for every mode. Returns (batches, the loss floor: the entropy of the next token given the two before,
    0.5 A[a] + 0.5 B[b], averaged over the run's own (a, b) pairs, in nats). On the CPU with --cpu."""
    device = "cpu" if args.cpu else "cuda"
    g = torch.Generator(device=device).manual_seed(args.seed)
    near, far = _successor_table(args, g, device), _successor_table(args, g, device)
    g.manual_seed(args.seed * 1000 + 1 + rank)
    n = args.steps * args.micro_batches * args.micro_batch_size
    tok = torch.randint(0, args.vocab, (n, args.seq_len + 1), generator=g, device=device)
    for t in range(2, args.seq_len + 1):  # all sequences advance together: seq_len launches in all
        coin = torch.rand(n, 1, generator=g, device=device) < 0.5
        rows = torch.where(coin, near[tok[:, t - 1]], far[tok[:, t - 2]])
        tok[:, t] = torch.multinomial(rows, 1, generator=g).squeeze(1)
    a, b = tok[:64, 1:-1].flatten(), tok[:64, :-2].flatten()
    p = 0.5 * near[a] + 0.5 * far[b]
    floor = float(-(p * p.log()).sum(1).mean())
    return tok.view(args.steps * args.micro_batches, args.micro_batch_size, args.seq_len + 1), floor


def replay(batches):
    pos = torch.arange(batches.shape[2] - 1, device=batches.device).expand(batches.shape[1], -1)
    for tok in batches:
        yield {"tokens": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous(), "position_ids": pos}


def build(args, mode):
    """Model chunks (GPT + Float16Module + DDP: one, or --vpp with interleaving) and the optimizer over them, with
    the experts of `mode`, from the run's seed."""
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_ffn, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, init_method_std=0.02, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        moe_grouped_gemm=True,  # as the layer spec below; read only by spec builders and the moe_act check
        **model_settings(args), **recompute_settings(args),
    )
    # the switch: Megatron's own experts of the spec ("megatron", "te") -> megatron_tma's, in either spec
    setattr(config, CONFIG_FLAG, None if mode in MEGATRONS_OWN else mode)
    spec = layer_spec_from_config(base_layer_spec(args), config)
    gpts = []
    for vp in range(args.vpp) if args.vpp else [None]:
        gpts.append(GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                             max_sequence_length=args.seq_len, position_embedding_type="rope",
                             pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                             post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                             vp_stage=vp).cuda())
    if mode in MEGATRONS_OWN:
        redraw_megatron_experts(gpts, config, args.seed)
    # as Megatron-LM: the chunks after the first keep all their parameters in one bucket
    models = [DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_settings(args)),
                                      Float16Module(config, gpt), disable_bucketing=i > 0)
              for i, gpt in enumerate(gpts)]
    config.no_sync_func = [m.no_sync for m in models] if len(models) > 1 else models[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, adam_beta2=0.95, clip_grad=1.0, bf16=True,
                        use_distributed_optimizer=args.distributed_optimizer),
        models)
    return models, optimizer


MEGATRONS_OWN = ("megatron", "te")  # the modes that keep the spec's own experts (the config flag unset)


def expert_weights_of(experts, name):
    """The per-expert `[N, K]` weights of linear `name` of Megatron's own experts, in expert order: SequentialMLP's
    `local_experts[i].<name>.weight`, TEGroupedMLP's `<name>.weight{i}` (TE's GroupedLinear)."""
    if hasattr(experts, "local_experts"):
        return [getattr(e, name).weight for e in experts.local_experts]
    linear = getattr(experts, name)
    return [getattr(linear, f"weight{i}") for i in range(experts.num_local_experts)]


def redraw_megatron_experts(gpts, config, seed):
    """Give Megatron's own experts (SequentialMLP, or TEGroupedMLP under TE's spec) the initial weights megatron_tma's
    experts draw: from the freshly seeded expert-parallel RNG state, chunk by chunk and layer by layer (the order
    they were built in), every expert's fc1 then every expert's fc2 (Megatron's experts draw expert by expert, and
    TE's GroupedLinear in its own RNG order). The dense layers are already built; re-seeding only restarts the
    tracker's streams."""
    model_parallel_cuda_manual_seed(seed)
    with torch.no_grad(), get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
        for layer in (layer for gpt in gpts for layer in gpt.decoder.layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is None:
                continue
            for w in expert_weights_of(experts, "linear_fc1"):
                config.init_method(w)
            for w in expert_weights_of(experts, "linear_fc2"):
                config.output_layer_init_method(w)


def experts_against_megatron(gpt, seed):
    """megatron_tma's experts (BF16 and unpadded FP8) given the weights of the first layer's Megatron experts
    (SequentialMLP; or TEGroupedMLP, mode `te`), on the same routed tokens: the diff of docs/design.md §3 of each
    output against Megatron's, in float64. Everything runs under Megatron's FP8 context when the config sets FP8 (as
    in training: TEGroupedMLP then computes in TE's FP8 recipe, ours are unaffected by it). Against SequentialMLP,
    BF16 must compute Megatron's function (diff at rounding level), FP8 within its recipe's noise; against TE's FP8
    experts, both within FP8 noise."""
    theirs = gpt.decoder.layers[0].mlp.experts
    state = {}
    for k, v in theirs.state_dict().items():
        key = from_sequential_mlp_key(k) or (k if re.fullmatch(r"linear_fc[12]\.weight\d+", k) else None)
        if key:  # SequentialMLP's keys renamed; TEGroupedMLP has megatron_tma's keys already (not its _extra_state)
            state[key] = v
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = theirs.num_local_experts
    sizes = torch.randint(0, 400, (n,), generator=g, device="cuda")
    x = torch.randn(int(sizes.sum()), gpt.config.hidden_size, generator=g, device="cuda").bfloat16()
    probs = torch.rand(x.shape[0], generator=g, device="cuda")
    with torch.no_grad(), fp8_context(gpt.config):
        ref = theirs(x, sizes.cpu(), probs)[0].double()
        diffs = {}
        for mode in ("bf16", "unpadded"):
            ours = megatron_experts(n, gpt.config, mode=mode)
            ours.load_state_dict(state)
            out = ours(x, sizes, probs)[0].double()
            diffs[mode] = float(1 - 2 * (out * ref).sum() / ((out * out).sum() + (ref * ref).sum()))
    return diffs


def fp8_context(config):
    """Megatron's own FP8 context for the whole model (`fp8_utils.get_fp8_context`), a null context without FP8."""
    if not getattr(config, "fp8", None):
        return contextlib.nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config)


def chunk_prefixes(models):
    """(name prefix, chunk): no prefix for a single chunk, `chunk<i>.` with virtual pipeline stages."""
    return [("" if len(models) == 1 else f"chunk{i}.", m) for i, m in enumerate(models)]


def canonical_weights(models):
    """(name, tensor) of the model chunks' weights under megatron_tma's state-dict keys (SequentialMLP's per-expert
    MLPs renamed): what every mode must start from."""
    for prefix, model in chunk_prefixes(models):
        for key, value in model.state_dict().items():
            # TE modules' `_extra_state` (their FP8 metadata, serialized) is not a weight: Megatron's own TE experts
            # have one per linear, megatron_tma's none
            if isinstance(value, torch.Tensor) and not key.endswith("_extra_state"):
                yield prefix + (from_sequential_mlp_key(key) or key), value


def named_parameters(models):
    for prefix, model in chunk_prefixes(models):
        for name, param in model.named_parameters():
            yield prefix + name, param


def data_iterators(models, batches):
    """The schedule's data: one iterator, or one per chunk (Megatron's interleaved schedule reads a chunk's own)."""
    return replay(batches) if len(models) == 1 else [replay(batches) for _ in models]


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


def train(args, mode, rank, batches):
    """One mode's run: a record of per-step losses, grad norms and times, the digests of every rank's initial
    weights (canonical names) and final parameters, and (mode `megatron`) megatron_tma's experts against Megatron's."""
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()  # count this mode's own bytes (the first leaves workspaces and buffers)
    torch.cuda.reset_peak_memory_stats()
    models, optimizer = build(args, mode)
    counts_on_device = device_token_counts(args, mode, models, rank)
    steps_counted = mcore_experts._optimizer_steps
    start, progress = resume(args, mode, models, optimizer)
    check_save_target(args, mode, start)
    if progress is None:
        progress = {"losses": [], "grad_norms": [], "times": [], "train_args": training_args(args),
                    "init_digests": gathered(digests(canonical_weights(models))),
                    "experts_diff_vs_megatron": (experts_against_megatron(models[0].module.module, args.seed)
                                                 if mode in MEGATRONS_OWN else None)}
    losses, grad_norms, times = progress["losses"], progress["grad_norms"], progress["times"]
    shares = progress.setdefault("experts_share", [])
    data = data_iterators(models, batches[start * args.micro_batches:])
    fwd_bwd = get_forward_backward_func()
    timer = ExpertsTimer(models)
    for step in range(start, args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        timer.start(step >= args.steps - args.experts_share_steps)
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
        if args.save and (step + 1) % args.save_interval == 0:
            path = checkpoint.save_checkpoint(os.path.join(args.save, mode), step + 1, models, optimizer,
                                              optim_format=optim_format(args), progress=progress)
            if rank == 0:
                print(f"[{mode:9s}] saved {path}", flush=True)
        if args.kill_after_step == step + 1:
            if rank == 0:
                print(f"[{mode:9s}] killed after step {step} (--kill-after-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    peak = torch.tensor(float(torch.cuda.max_memory_allocated() - mem0) / 2**20, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    # Megatron's evaluation comes right after a step, without the per-iteration reset of DDP's flag: it must run on
    # the stepped weights. Evaluated as is, then again with the FP8 copies forcibly re-made: the same loss.
    eval_loss = evaluate(args, models, batches)
    found = sum(invalidate_fp8_weights(model) for model in models)
    eval_requantized = evaluate(args, models, batches) if found else eval_loss
    param_digests = gathered(digests(named_parameters(models)))
    return {**progress, "param_digests": param_digests, "peak_mb": float(peak), "resumed_from_step": start,
            "start_allocated_bytes": mem0,
            "eval_loss": eval_loss, "eval_loss_requantized": eval_requantized, "eval_exact": not args.nondeterministic,
            # the torch optimizer Megatron's optimizer steps: TE's FusedAdam where TE is installed, else Apex's or torch's
            "optimizer_class": optimizer_class(optimizer),
            # the torch optimizer steps the experts' hook counted during the run (Megatron's optimizer steps one)
            "optimizer_steps_counted": mcore_experts._optimizer_steps - steps_counted,
            "device_token_counts": counts_on_device}


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


def optimizer_class(optimizer):
    """`module.Class` of the torch optimizer inside Megatron's optimizer (chained, mixed-precision or distributed)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    inner = getattr(inner, "optimizer", inner)
    return f"{type(inner).__module__}.{type(inner).__qualname__}"


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
        self.active, self.events = False, []
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
            out, bias = forward(_Mark.apply(hidden, self, "in"), tokens_per_expert, *args, **kwargs)
            return _Mark.apply(out, self, "out"), bias
        return marked

    def record(self, phase, begin):
        event = self.event()
        event.record()
        self.events.append((phase, begin, event))

    def start(self, active):
        self.active, self.events = active, []
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
        start, events = self.step_start, self.events

        def share():
            open_at, total = {}, 0.0
            for phase, begin, event in events:
                if begin:
                    open_at[phase] = event
                elif phase in open_at:
                    total += open_at.pop(phase).elapsed_time(event)
            step = start.elapsed_time(end)
            return {"experts_ms": total, "step_ms": step, "share": total / step if step > 0 else None}
        return share


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
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data_iterators(models, batches),
                                          model=models, num_microbatches=micro_batches, seq_length=args.seq_len,
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
    if parallel_state.is_pipeline_last_stage():
        loss = torch.stack([o["lm loss"] for o in out]).mean()
    else:
        loss = torch.zeros((), dtype=torch.float32, device="cuda")
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(loss, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size()


def fail(message):
    """Stop with one line on stderr (exit status 1)."""
    raise SystemExit(f"moe_gpt.py: {message}")


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
    transformer_engine) and megatron-core, megatron_tma's CUDA kernels on this rank's GPU, torchrun."""
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
    if sys.version_info[:2] < MEGATRON_PYTHON:
        fail(f"megatron-core 0.19 needs Python >= {'.'.join(map(str, MEGATRON_PYTHON))}, this is "
             f"{sys.version.split()[0]}: run the job with a newer Python (--cpu runs without Megatron)")
    # the options that need Transformer Engine, each with the way to run without it
    needs_te = [(option, instead) for option, instead, asked in (
        ("--transformer-impl transformer_engine", "with --transformer-impl local",
         args.transformer_impl == "transformer_engine"),
        ("--moe-permute-fusion", "without --moe-permute-fusion", args.moe_permute_fusion)) if asked]
    if needs_te:
        error = te_import_error()
        if error is not None:
            why = (str(error).splitlines() or [""])[0]
            fail(f"{' and '.join(o for o, _ in needs_te)} need{'s' if len(needs_te) == 1 else ''} Transformer "
                 f"Engine, which cannot be imported ({type(error).__name__}: {why}): pip install -e '.[te]' on the "
                 f"GPU machine (or scripts/te_device_steps.md), or run {' and '.join(i for _, i in needs_te)}")
    if args.transformer_impl == "transformer_engine":
        if not args.nondeterministic:  # before TE is imported: its attention reads it (config.deterministic_mode)
            os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    error = import_megatron()
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
        "moe_gpt_cpu", os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_gpt_cpu.py"))
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
    if args.plot:
        return redraw(args)
    if args.cpu:
        return cpu_job(args)
    if args.compare:
        return compare(args.compare, args.out)
    if args.same_bits:
        return same_bits(*args.same_bits)
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
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=args.pp,
                                             virtual_pipeline_model_parallel_size=args.vpp,
                                             expert_model_parallel_size=args.ep,
                                             expert_tensor_parallel_size=args.etp)
    # one data stream per data-parallel rank: the stages of a pipeline must see the same batches
    batches, loss_floor = chain_batches(args, parallel_state.get_data_parallel_rank())
    runs = {}
    for mode in args.modes:
        runs[mode] = train(args, mode, rank, batches)
        runs[mode]["left_allocated_mb"] = release(runs[mode].pop("start_allocated_bytes"))
    report, failures = summarize(runs)
    if rank == 0:
        write_results(args, runs, report, failures, world, loss_floor)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


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
    step time over ours: = our tokens/s over theirs, the same tokens per step), peak memory ours / theirs, the last
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


def write_results(args, runs, report, failures, world, loss_floor):
    stamp = datetime.datetime.now(datetime.timezone.utc)
    add_throughput(report, vars(args), world)
    result = {
        "benchmark": "moe_gpt", "commit": os.environ.get("MEGATRON_TMA_COMMIT", "unknown"),
        "gpu": "none (CPU job)" if args.cpu else torch.cuda.get_device_name(), "date": stamp.isoformat(),
        "world_size": world,
        "command": "torchrun --nproc-per-node %d recipes/moe_gpt.py %s" % (world, " ".join(sys.argv[1:])),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "compare", "same_bits")},
        "loss_floor": loss_floor, "summary": report, "head_to_head": head_to_head(runs, report),
        "failures": failures,
        "rows": [{"mode": m, "step": i, "loss": l, "grad_norm": n, "ms": t}
                 for m, run in runs.items() for i, (l, n, t) in enumerate(zip(run["losses"], run["grad_norms"],
                                                                                run["times"]))],
        "records": {m: {k: run.get(k) for k in ("init_digests", "param_digests", "experts_diff_vs_megatron",
                                                 "peak_mb", "left_allocated_mb", "eval_loss",
                                                 "eval_loss_requantized", "eval_exact",
                                                 "optimizer_steps_counted", "resumed_from_step",
                                                 "experts_share", "optimizer_class", "device_token_counts",
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


def plot(result, path):
    """The loss curves of every mode and each FP8 mode's gap to the BF16 experts, from a result (the JSON)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (redraw later with --plot RESULT.json)")
        return
    losses = {}
    for row in result["rows"]:
        losses.setdefault(row["mode"], []).append(row["loss"])
    fig, (ax, gap, cost) = plt.subplots(1, 3, figsize=(18, 4.5))
    styles = {"unpadded": ("C0", "-", 2.5), "padded16": ("C1", "--", 1.5), "padded128": ("C3", ":", 1.5),
              "bf16": ("C2", "-", 1.0), "megatron": ("k", "-", 0.8), "te": ("C4", "-", 1.5)}
    for mode, curve in losses.items():
        color, ls, lw = styles.get(mode, ("k", "-", 1))
        ax.plot(curve, color=color, ls=ls, lw=lw, label=mode)
    ax.axhline(result["loss_floor"], color="k", lw=0.5, ls="--", label="the data's entropy")
    ep = result["config"].get("ep") or result["world_size"]
    cpu = result["config"].get("cpu")
    where = "on the CPU (reference backend)" if cpu else f"on Megatron-core, {result['world_size']} GPU(s), EP={ep}"
    ax.set(xlabel="step", ylabel="LM loss", ylim=(result["loss_floor"] - 0.2, None),
           title=f"MoE GPT {where}\nloss per step")
    ax.legend()
    ref = "megatron" if "megatron" in losses else "bf16" if "bf16" in losses else None
    if ref:
        for mode, curve in losses.items():
            if mode != ref:
                color, ls, lw = styles.get(mode, ("k", "-", 1))
                gap.plot([x - y for x, y in zip(curve, losses[ref])], color=color, ls=ls, lw=lw, label=mode)
        gap.axhline(0, color="k", lw=0.5)
        names = {"megatron": "Megatron's own BF16 experts", "bf16": "megatron_tma's BF16 experts"}
        gap.set(xlabel="step", ylabel=f"loss - {ref} loss",
                title=f"against {names[ref]}\n(same data, same initial weights)")
        gap.legend()
    modes = list(losses)
    ms = [result["summary"][m]["ms_per_step_median"] for m in modes]
    bars = cost.bar(modes, ms, color=[styles.get(m, ("k",))[0] for m in modes])
    # the experts' part of each step (--experts-share-steps), hatched at the bottom: what the rest of the step costs
    # each mode is the bar above it, so a ratio made outside the experts shows
    experts = [result["summary"][m].get("experts_ms_per_step") for m in modes]
    if any(e is not None for e in experts):
        from matplotlib.patches import Patch
        cost.bar(modes, [e or 0.0 for e in experts], fill=False, hatch="//", edgecolor="white", lw=0)
        cost.legend(handles=[Patch(facecolor="0.5", edgecolor="white", hatch="//", label="the experts' part")],
                    loc="upper right", fontsize=8)
    for bar, m in zip(bars, modes):
        peak, share = result["summary"][m].get("peak_mb"), result["summary"][m].get("experts_share_of_step")
        label = " ".join(([f"{peak / 1024:.1f} GB"] if peak is not None else [])
                         + ([f"experts {100 * share:.0f}%"] if share is not None else []))
        if label:
            cost.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom", fontsize=8)
    impl = result["config"].get("transformer_impl") or "local"
    fp8 = result["config"].get("fp8_format")
    cost.set(ylabel="ms per step (median)",
             title="step time on the CPU" if cpu else
             f"step time ({impl} spec{', TE FP8 ' + str(result['config'].get('fp8_recipe')) if fp8 else ''})\n"
             "labels: peak memory, experts' share of the step (hatched)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # in-process runs (the tests) draw many
    print("wrote", path)


if __name__ == "__main__":
    sys.exit(main())
