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
import os
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl).*")
# cuBLAS needs a fixed workspace to be deterministic (torch.use_deterministic_algorithms, set in main)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
