"""The recipe's options: parse_args, the modes, presets and sizes, and the one-line refusals of options that break
a rule or do not go together (before any work)."""
import argparse
import sys

from megatron_tma.limits import MAX_EXPERTS
from megatron_tma.mcore import MODES


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
# layers, 69-70 GiB at 2, recipes/results/moe_gpt-te-*-20261206-*.json; Megatron's local spec, whose attention keeps
# [heads, 4096, 4096] scores a layer, fits qwen3-30b at 4 layers eager and 3 from the full-iteration CUDA graph:
# recipes/results/moe_gpt-local-qwen3-30b-*-20261206-*.json), one sequence a micro-batch and gradient
# accumulation over 4 micro-batches a step. The vocabulary stays the recipe's synthetic 4096: the data are drawn from
# [vocab, vocab] tables, and with a handful of a model's layers its real head (152k / 129k entries) would be a share
# of the step it is not in the whole model.
# --preset qwen3-30b: Qwen3-30B-A3B's layer: hidden 2048, 32 query heads over 4 key/value groups of head dim 128 with
# QK layer norm, 128 experts of FFN 768, top-8, no shared expert, sequence 4096 (the model has 48 such layers).
# --preset dsv3-rank: one expert-parallel rank of DeepSeek-V3 at EP = 8 (32 of its 256 experts on the rank):
# hidden 7168, 32 experts of FFN 2048, top-8 over them, one shared expert of FFN 2048, sequence 4096. Its attention
# is grouped-query attention standing in for Multi-head Latent Attention (the recipe builds a plain
# TransformerConfig; MLA's MLATransformerConfig with its low-rank projections is not wired in yet): 128
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
NORMALIZATIONS = ("RMSNorm", "LayerNorm")  # Megatron-LM's --normalization choices the recipe's model builds
RECOMPUTE_MODULES = ("moe_act", "moe", "core_attn", "layernorm", "mlp")
# The CPU job (--cpu, recipes/moe_gpt_cpu.py): megatron_tma's modes on the reference backend, without Megatron, and
# its default size (a few minutes on 2 cores; every size option overrides it as in the GPU job)
CPU_MODES = MODES
CPU_SIZE = dict(steps=150, micro_batches=1, micro_batch_size=8, seq_len=64, layers=2, hidden=128, heads=4, experts=4,
                topk=2, expert_ffn=128, vocab=128, lr=3e-3, log_every=10)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=sys.modules[__package__].__doc__.split("\n\n")[0])
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
                   + " (any size option overrides it). qwen3-30b and dsv3-rank are sized for an 80 GB GPU with "
                   "--transformer-impl transformer_engine (fused attention); with the local spec's attention "
                   "qwen3-30b fits --layers 4 (3 with --cuda-graph-impl full_iteration)")
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
    p.add_argument("--normalization", choices=NORMALIZATIONS, default="RMSNorm",
                   help="Megatron-LM's option: the layers' norm (default RMSNorm, as Qwen3 and DeepSeek-V3). In the "
                        "local spec with Apex installed, LayerNorm is Apex's FusedLayerNorm; RMSNorm stays torch's "
                        "norm there (megatron-core's FusedLayerNorm takes LayerNorm only: Megatron-LM issue #1658)")
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
    p.add_argument("--gradient-accumulation-fusion", action="store_true",
                   help="Megatron-LM's option (config.gradient_accumulation_fusion): the dense layers' weight "
                        "gradients added straight into Megatron's FP32 main_grad by the wgrad GEMM (Apex's "
                        "fused_weight_gradient_mlp_cuda in the local spec and the output layer, TE's "
                        "fuse_wgrad_accumulation in TE's modules). megatron_tma's experts always accumulate into "
                        "main_grad; needs Apex built with its CUDA extensions")
    p.add_argument("--defer-expert-wgrad", action="store_true",
                   help="megatron_tma's FP8 modes compute their weight gradients once a step, over every "
                        "micro-batch, in one GEMM per expert linear in the last micro-batch's backward "
                        "(megatron_tma.mcore.defer_expert_wgrads: one pass over main_grad a step instead of one a "
                        "micro-batch; other FP32 rounding, the twins still bit for bit)")
    p.add_argument("--transpose-weights-in-backward", action="store_true",
                   help="megatron_tma's FP8 modes keep each expert weight's FP8 copy only and make W^T's in each "
                        "backward (config.moe_megatron_tma_transpose_weights_in_backward: the same bits, one "
                        "layer's W^T copy alive at a time instead of every layer's across the step)")
    p.add_argument("--step-refreshed-weights", action="store_true",
                   help="megatron_tma's FP8 modes keep their weight copies in fixed buffers that a kernel refreshes on "
                        "the GPU after each optimizer step (config.moe_megatron_tma_step_refreshed_weights: what lets "
                        "a CUDA graph replay later micro-batches without the weight pass; the same bits)")
    p.add_argument("--release-bf16-expert-weights", action="store_true",
                   help="megatron_tma's FP8 modes free their BF16 expert weights' memory after the first forward "
                        "and hold FP8 copies only, which the optimizer writes from its FP32 main params at each step "
                        "(config.moe_megatron_tma_release_bf16_weights, megatron_tma.released_weights: 2 bytes a "
                        "weight instead of 4; the same bits). Plain optimizer only")
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
    p.add_argument("--cuda-graph-impl", choices=("none", "full_iteration"), default="none",
                   help="Megatron's full-iteration CUDA graph (config.cuda_graph_impl; megatron.core.full_cuda_graph: "
                        "every micro-batch's forward and backward of a step captured once after the warm-up steps, "
                        "then replayed) for megatron_tma's modes; Megatron's own experts (megatron, te) train eagerly "
                        "(their dispatcher reads the token counts on the host). Needs --device-token-counts or "
                        "--permute-in-experts. Adds an eager run of unpadded after the modes: the result's "
                        "head_to_head.graphed_vs_eager (speedup, bitexact)")
    p.add_argument("--cuda-graph-warmup-steps", type=int, default=2, metavar="N",
                   help="eager steps before the capture (Megatron's cuda_graph_warmup_steps; >= 1: the optimizer's "
                        "state and the FP8 experts' buffers are made eagerly)")
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
    if jobs and jobs[0] != "--cpu":  # --plot, --compare, --same-bits read results and train nothing
        training_only = [flag for flag, asked in (("--save", args.save), ("--load", args.load),
                                                  ("--kill-after-step", args.kill_after_step is not None)) if asked]
        if training_only:
            p.error(f"{jobs[0]} reads results and trains nothing: {', '.join(training_only)} would be ignored")
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
            ("--transpose-weights-in-backward", args.transpose_weights_in_backward),
            ("--step-refreshed-weights", args.step_refreshed_weights),
            ("--release-bf16-expert-weights", args.release_bf16_expert_weights),
            ("--cuda-graph-impl", args.cuda_graph_impl != "none"),
            ("--defer-expert-wgrad", args.defer_expert_wgrad),
            ("--permute-in-experts", args.permute_in_experts),
            ("--moe-permute-fusion", args.moe_permute_fusion),
            ("--gradient-accumulation-fusion", args.gradient_accumulation_fusion),
            ("--normalization LayerNorm", args.normalization != "RMSNorm")) if asked]
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
    refusal = transformer_impl_refusal(args) or cuda_graph_refusal(args) or release_refusal(args)
    if refusal:
        p.error(refusal)
    return args


def cuda_graph_refusal(args):
    """Why --cuda-graph-impl does not go with the other options (one line), or None. What a full-iteration graph
    cannot hold: a host read of the token counts in every MoE layer (Megatron's dispatcher, unless the counts stay on
    the GPU), host state that changes within a step (the deferred weight gradients' lists: not tried yet), a pipeline
    (its schedule is not what the wrapper captures here), a profiler inside the replay."""
    if args.cuda_graph_impl == "none":
        return None
    if args.cuda_graph_warmup_steps < 1:
        return "--cuda-graph-warmup-steps must be >= 1 (the first steps are eager: they make the optimizer's state)"
    if not (args.device_token_counts or args.permute_in_experts):
        return ("--cuda-graph-impl full_iteration: Megatron's dispatcher copies each MoE layer's token counts to the "
                "host and waits for them, which no graph can capture: add --device-token-counts or "
                "--permute-in-experts")
    for flag, asked in (("--defer-expert-wgrad", args.defer_expert_wgrad), ("--pp", args.pp != 1),
                        ("--ep", args.ep not in (None, 1)), ("--etp", args.etp != 1),  # (the counts go to the host)
                        ("--recompute-modules", args.recompute_modules), ("--recompute-full", args.recompute_full),
                        ("--overlap-grad-reduce", args.overlap_grad_reduce),
                        ("--overlap-param-gather", args.overlap_param_gather),
                        ("--profile-step", args.profile_step is not None)):
        if asked:
            return f"--cuda-graph-impl full_iteration does not take {flag} yet"
    if args.steps <= args.cuda_graph_warmup_steps:
        return (f"--steps {args.steps} leaves no graphed step after --cuda-graph-warmup-steps "
                f"{args.cuda_graph_warmup_steps}")
    return None


def release_refusal(args):
    """Why --release-bf16-expert-weights does not go with the other options (one line), or None."""
    if not args.release_bf16_expert_weights:
        return None
    for flag, asked in (("--distributed-optimizer", args.distributed_optimizer),  # (one shared parameter buffer)
                        ("--cuda-graph-impl", args.cuda_graph_impl != "none"),  # (the memory moves when it comes back)
                        ("--step-refreshed-weights", args.step_refreshed_weights)):
        if asked:
            return (f"--release-bf16-expert-weights does not take {flag} (megatron_tma.released_weights: freed BF16 "
                    "weights come back at the plain optimizer's copy of its FP32 main params, at a new address)")
    return None


def graphed(args, mode):
    """Whether `mode` trains from Megatron's full-iteration CUDA graph in this run (megatron_tma's modes only)."""
    return args.cuda_graph_impl == "full_iteration" and mode not in MEGATRONS_OWN


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
# The largest --seed: chain_batches seeds each rank's data with seed x 1000 + 1 + rank, which torch takes up to
# 2**64 - 1 (ranks < 1000)
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


MEGATRONS_OWN = ("megatron", "te")  # the modes that keep the spec's own experts (the config flag unset)


def fail(message):
    """Stop with one line on stderr (exit status 1)."""
    raise SystemExit(f"moe_gpt.py: {message}")
