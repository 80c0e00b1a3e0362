"""The CPU job of recipes/moe_gpt.py (`--cpu`): the same tiny MoE GPT, trained once per experts mode on the same data
from the same weights, through megatron_tma's own modules on the reference backend, without Megatron.

Why not Megatron-core on gloo: its training path in megatron-core 0.19.2 assumes a CUDA device at these places
(with a CPU torch 2.13 on one gloo rank, where `parallel_state.initialize_model_parallel` itself works; each hit in
turn, the earlier ones stepped around to reach the next: CPU weight init without the RNG tracker, the allgather
dispatcher, `torch.cuda.current_device` patched to "cpu"; clip_grads read in the source):
* `tensor_parallel/random.py`, `CudaRNGStatesTracker.add` (from `model_parallel_cuda_manual_seed`):
  `torch.cuda.get_rng_state()` -> AssertionError "Torch not compiled with CUDA enabled";
* `transformer/moe/token_dispatcher.py`, `MoEAlltoAllTokenDispatcher.__init__`: `torch.cuda.Stream()` ->
  RuntimeError "torch.cuda.Stream requires CUDA support" (the allgather dispatcher builds);
* `models/common/embeddings/rotary_pos_embedding.py`, `RotaryEmbedding.get_emb`: `torch.cuda.current_device()`
  (the GPT's forward);
* `distributed/param_and_grad_buffer.py`, `_ParamAndGradBuffer.__init__` (Megatron's DDP):
  `device=torch.cuda.current_device()`;
* `optimizer/optimizer.py`, `MixedPrecisionOptimizer.__init__`: `torch.tensor(..., device='cuda')`, and
  `Float16OptimizerWithFloat16Params.__init__` refuses parameters whose type is not `torch.cuda.*Tensor`
  (TypeError "Wrapped parameters must be one of torch.cuda.FloatTensor, ..."); `optimizer/clip_grads.py` allocates
  the norm on 'cuda' too;
* `pipeline_parallel/schedules.py`, `forward_backward_no_pipelining`: `torch.zeros(..., device="cuda")`.
So the CPU job keeps what can be kept: the experts are megatron_tma's `GroupedFP8MLP` (unpadded, and its padded16 /
padded128 twins) and `GroupedBF16MLP`, fed as Megatron's dispatcher feeds them (tokens sorted by expert, the
tokens per expert, the routing probs); around them a small GPT in plain torch: learned positions, causal attention,
RMSNorm, a top-k router (softmax over the top-k logits, the switch load-balancing aux loss), FP32 main weights with
AdamW and gradient clipping, the new weights copied into the BF16 parameters through `.data` (as Megatron's
optimizer does, so the FP8 weight copies are re-made by the optimizer-step signal, not by version counters).
The checks are the GPU job's (`summarize`, recipes/moe_gpt_recipe/results.py): the same initial weights in every mode,
every padded mode's per-step losses, grad norms and final parameters equal to the unpadded mode's, and an evaluation
after the last step that gives the same loss again with the FP8 weight copies re-made.
Checkpoints (`--save DIR --save-interval N`, `--load DIR`, `--kill-after-step N`, as the GPU job): the module's own
`state_dict` (Transformer Engine's per-expert keys for the experts), the FP32 main weights, AdamW's state, torch's RNG
state and the run's records, one `torch.save` file per checkpoint in the GPU job's directory layout
(DIR/<mode>/iter_<step>/state.pt, its SHA-256 in state.pt.sha256, named by the tracker file once written), every file
written and every rule of the directory kept by megatron_tma.mcore.checkpoint's functions, the GPU job's (writes never
through a link, one saving process per directory, the tracker's rule). A load checks the checksum and reads with
`weights_only=True` (a crafted file cannot run code); a save never writes over a complete checkpoint nor moves the
tracker back; a resume with other training settings than the checkpoint's stops. A resumed run trains the bits of an
uninterrupted one (tests/test_recipe_moe_gpt_cpu.py kills one with SIGKILL and resumes it).
"""
import hashlib
import io
import math
import os
import re
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn

from megatron_tma.mcore.checkpoint import (CheckpointFileError, checkpoint_dir, fresh_iteration_dir, latest_iteration,
                                           read_ascii, save_refusal, write_atomic, write_tracker)
from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def _linear(n_in, n_out, std):
    layer = nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16)
    nn.init.normal_(layer.weight, std=std)
    return layer


class Attention(nn.Module):
    def __init__(self, hidden, heads, std, out_std):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = _linear(hidden, 3 * hidden, std), _linear(hidden, hidden, out_std)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))


class MoE(nn.Module):
    """Top-k router and megatron_tma's experts, the tokens handed over as Megatron's dispatcher hands them."""

    def __init__(self, args, mode, std, out_std):
        super().__init__()
        self.topk, self.experts_count = args.topk, args.experts
        self.router = nn.Parameter(torch.empty(args.experts, args.hidden, dtype=torch.float32).normal_(std=std))
        kw = dict(backend="reference", init_method=lambda w: nn.init.normal_(w, std=std))
        if mode == "bf16":
            self.experts = GroupedBF16MLP(args.experts, args.hidden, args.expert_ffn, "swiglu", **kw)
        else:
            pad_to = {"unpadded": None, "padded16": 16, "padded128": 128}[mode]
            self.experts = GroupedFP8MLP(args.experts, args.hidden, args.expert_ffn, "swiglu", pad_to=pad_to, **kw)
        with torch.no_grad():  # fc2 drawn as Megatron's output layers (std / sqrt(2 layers)), after fc1 as before
            self.experts.linear_fc2.weight.mul_(out_std / std)

    def forward(self, x):  # [b, s, h] -> (out, aux loss)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = x.float() @ self.router.t()  # [t, E], FP32
        top, experts = logits.topk(self.topk, dim=1)
        probs = top.softmax(dim=1)  # over the top-k logits (Megatron's default: no pre-softmax)
        # switch load balancing: E * sum_e (share of routed tokens to e) x (mean router prob of e)
        routed = torch.zeros_like(logits).scatter_(1, experts, 1.0).mean(0) / self.topk
        aux = self.experts_count * (routed * logits.softmax(dim=1).mean(0)).sum()
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # rows grouped by expert, each expert's tokens in token order
        token = order // self.topk
        tokens_per_expert = torch.bincount(flat, minlength=self.experts_count)
        out, _ = self.experts(x.index_select(0, token), tokens_per_expert, probs.flatten().index_select(0, order))
        combined = torch.zeros(x.shape, dtype=torch.float32).index_add_(0, token, out.float())
        return combined.to(x.dtype).view(shape), aux


class Layer(nn.Module):
    def __init__(self, args, mode, std, out_std):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(args.hidden), RMSNorm(args.hidden)
        self.attention = Attention(args.hidden, args.heads, std, out_std)
        self.mlp = MoE(args, mode, std, out_std)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        out, aux = self.mlp(self.norm2(x))
        return x + out, aux


class TinyMoEGPT(nn.Module):
    def __init__(self, args, mode, std=0.02):
        super().__init__()
        out_std = std / math.sqrt(2 * args.layers)
        self.embedding = nn.Parameter(torch.empty(args.vocab, args.hidden, dtype=torch.bfloat16).normal_(std=std))
        self.position = nn.Parameter(torch.empty(args.seq_len, args.hidden, dtype=torch.bfloat16).normal_(std=std))
        self.layers = nn.ModuleList(Layer(args, mode, std, out_std) for _ in range(args.layers))
        self.norm = RMSNorm(args.hidden)
        self.output = _linear(args.hidden, args.vocab, std)

    def forward(self, tokens, labels):
        """(mean LM loss over the tokens, sum of the layers' aux losses), both FP32."""
        x = self.embedding[tokens] + self.position[: tokens.shape[1]]
        aux = torch.zeros(())
        for layer in self.layers:
            x, layer_aux = layer(x)
            aux = aux + layer_aux
        logits = self.output(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1)), aux


def fp8_experts(model):
    return [m for m in model.modules() if isinstance(m, GroupedFP8MLP)]


def evaluate(model, batch):
    """The loss of the first batch in evaluation (no grad)."""
    model.eval()
    with torch.no_grad():
        loss, _ = model(batch[:, :-1], batch[:, 1:])
    model.train()
    return float(loss)


STATE, CHECKSUM = "state.pt", "state.pt.sha256"


def save_state(directory, step, model, main, optimizer, progress):
    """A checkpoint of the run after `step` steps; it counts once the tracker names it (every write atomic, never
    through a link: megatron_tma.mcore.checkpoint.write_atomic). Never over a complete checkpoint, never moving the
    tracker back (FileExistsError, as the GPU job's save); only by the process holding the directory's save lock
    (SaveDirLocked: another live job saves there). The file's SHA-256 goes next to it (state.pt.sha256), and the
    load checks it."""
    refusal = save_refusal(directory, step)
    if refusal is not None:
        raise FileExistsError(refusal)
    path = fresh_iteration_dir(directory, step)
    state = {"model": model.state_dict(), "main": [m.detach() for m in main], "optimizer": optimizer.state_dict(),
             "rng": torch.get_rng_state(), "progress": progress, "step": step}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    write_atomic(os.path.join(path, STATE), data)
    write_atomic(os.path.join(path, CHECKSUM), f"{hashlib.sha256(data).hexdigest()}  {STATE}\n".encode("ascii"))
    write_tracker(directory, step)
    return path


# The checksum file: sha256sum's line, `<64 hex digits>  state.pt`; the hex in either case (sha256sum and hashlib write
# lower case, other tools upper case: the same digest)
CHECKSUM_LINE = re.compile(r"([0-9a-fA-F]{64})[ \t]+\*?" + re.escape(STATE) + r"\s*")
CHECKSUM_RULE = f"one line '<SHA-256 of {STATE} in 64 hex digits>  {STATE}' (sha256sum's format)"


def read_state(path):
    """The checkpoint object in `path`/state.pt, after its SHA-256 matched the one saved with it; loaded with
    `weights_only=True` (tensors and plain containers only: a crafted file cannot run code). Stops with one line naming
    the file and its rule otherwise."""
    file, sums = os.path.join(path, STATE), os.path.join(path, CHECKSUM)
    try:
        text = read_ascii(sums, CHECKSUM_RULE)
    except CheckpointFileError as e:
        raise SystemExit(f"moe_gpt.py: {e}")
    except OSError as e:
        raise SystemExit(f"moe_gpt.py: cannot read the checksum {sums} of the checkpoint {file} "
                         f"({type(e).__name__}: {e.strerror or e})")
    line = CHECKSUM_LINE.fullmatch(text)
    if line is None:
        raise SystemExit(f"moe_gpt.py: {sums} holds {text[:80]!r}; it must hold {CHECKSUM_RULE}")
    want = line.group(1).lower()
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SystemExit(f"moe_gpt.py: cannot read the checkpoint {file} ({type(e).__name__}: {e.strerror or e})")
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise SystemExit(f"moe_gpt.py: {file} does not match its checksum ({sums} says {want[:16]}..., the file has "
                         f"{got[:16]}...): the file is truncated or corrupted; not loaded")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        why = (str(e).splitlines() or [""])[0]
        raise SystemExit(f"moe_gpt.py: {file} cannot be loaded with weights_only=True ({type(e).__name__}: {why})")


def load_state(directory, model, main, optimizer):
    """(step, progress) of the newest checkpoint in `directory`, loaded into the model, main weights and optimizer;
    (0, None) without one."""
    step = latest_iteration(directory)
    if step is None:
        return 0, None
    state = read_state(checkpoint_dir(directory, step))
    model.load_state_dict(state["model"])
    with torch.no_grad():
        for m, saved in zip(main, state["main"]):
            m.copy_(saved)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return step, state["progress"]


def train(args, mode, batches, digests, *, check_resume, check_save_target, training_args, aux_coeff=1e-2,
          clip=1.0):
    """One mode's run on the CPU: the record `summarize` (recipes/moe_gpt_recipe/results.py) reads (per-step losses,
    grad norms and times, digests of the initial weights and final parameters, the evaluation after the last step before
    and after the FP8 weight copies are re-made). `batches`: [steps * micro_batches, batch, seq_len + 1] token ids. The
    GPU job's checks of a resume and of the --save directory (recipes/moe_gpt_recipe/checkpoints.py) are passed in."""
    torch.manual_seed(args.seed)
    model = TinyMoEGPT(args, mode)
    params = list(model.parameters())
    main = [p.detach().float().clone().requires_grad_() for p in params]  # FP32 main weights, as Megatron's
    optimizer = torch.optim.AdamW(main, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    start, progress = (load_state(os.path.join(args.load, mode), model, main, optimizer) if args.load else (0, None))
    if progress is None:
        if args.load:
            print(f"[{mode:9s}] no checkpoint in {os.path.join(args.load, mode)}: training from scratch", flush=True)
        progress = {"losses": [], "grad_norms": [], "times": [], "train_args": training_args(args),
                    "init_digests": [digests(model.named_parameters())]}
    else:
        check_resume(args, progress, checkpoint_dir(os.path.join(args.load, mode), start))
        if start > args.steps or len(progress["losses"]) != start:
            raise SystemExit(f"moe_gpt.py: {args.load}/{mode} holds step {start}; this run trains {args.steps}")
        print(f"[{mode:9s}] resumed from {checkpoint_dir(os.path.join(args.load, mode), start)}", flush=True)
    check_save_target(args, mode, start)
    losses, grad_norms, times = progress["losses"], progress["grad_norms"], progress["times"]
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        for m in main:
            m.grad = torch.zeros_like(m)
        loss_sum = 0.0
        for micro in range(args.micro_batches):
            batch = batches[step * args.micro_batches + micro]
            loss, aux = model(batch[:, :-1], batch[:, 1:])
            ((loss + aux_coeff * aux) / args.micro_batches).backward()
            for p, m in zip(params, main):  # the BF16 gradients accumulate in FP32 (Megatron's main_grad)
                m.grad += p.grad.float()
                p.grad = None
            loss_sum += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(main, clip))
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, main):
                p.data.copy_(m)  # through .data, as Megatron's optimizer: the step signal re-makes the FP8 copies
        loss = loss_sum / args.micro_batches
        times.append(1e3 * (time.perf_counter() - t0))
        if not math.isfinite(loss):
            raise RuntimeError(f"{mode}: step {step} failed (loss={loss})")
        losses.append(loss)
        grad_norms.append(grad_norm)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"[{mode:9s}] step {step:4d}  loss {loss:.5f}  grad norm {grad_norm:.4f}  {times[-1]:.1f} ms",
                  flush=True)
        if args.save and (step + 1) % args.save_interval == 0:
            path = save_state(os.path.join(args.save, mode), step + 1, model, main, optimizer, progress)
            print(f"[{mode:9s}] saved {path}", flush=True)
        if args.kill_after_step == step + 1:
            print(f"[{mode:9s}] killed after step {step} (--kill-after-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    eval_loss = evaluate(model, batches[0])
    experts = fp8_experts(model)
    for e in experts:
        e.invalidate_weight_cache()
    eval_requantized = evaluate(model, batches[0]) if experts else eval_loss
    return {**progress, "param_digests": [digests(model.named_parameters())], "experts_diff_vs_megatron": None,
            "resumed_from_step": start,
            "peak_mb": None, "eval_loss": eval_loss, "eval_loss_requantized": eval_requantized, "eval_exact": True}
