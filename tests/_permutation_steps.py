"""Shared by the permutation tests (CPU and GPU): random top-k routing, and one forward + backward of an expert MLP
with the experts permuting their own tokens (`fused`) or around it (gather_rows -> MLP -> combine_rows: the same
sums, so the same bits; torch's index_select would add each token's row gradients in BF16 instead); and the
malformed plans and bad rows that every entry must refuse with the same error on both backends (issue 55)."""
import torch
from _dists import random_rows

from megatron_tma.permutation import combine_rows, gather_rows


def routing(num_tokens, num_experts, topk, gen, device="cpu"):
    """(routing map bool [T, E] with topk experts a token, softmax probs [T, E]) on `device`."""
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    chosen = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, chosen, True)
    return routing_map.to(device), torch.softmax(logits, 1).to(device)


def mlp_step(mlp, x, sizes, probs, perm, dout, fused):
    """{"out", "x.grad", "probs.grad", "<param>.grad"...} of one step of `mlp` on the routed tokens x."""
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    for p in mlp.parameters():
        p.grad = None
    if fused:
        out, _ = mlp(x, sizes, probs, permutation=perm)
    else:
        y, _ = mlp(gather_rows(x, perm, backend=mlp.backend), sizes, probs)
        out = combine_rows(y, perm, backend=mlp.backend)
    out.backward(dout)
    results = {"out": out, "x.grad": x.grad, "probs.grad": probs.grad}
    results.update({f"{n}.grad": p.grad.clone() for n, p in mlp.named_parameters()})
    return results


def assert_same_steps(got, want, what=""):
    """Every tensor of two `mlp_step` results equal bit for bit (the same keys)."""
    assert got.keys() == want.keys(), what
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), (what, name)


# ----------------------------------------------------------------------------------------------------------------
# Issue 55 items 3 and 4 (CPU and GPU): a malformed Permutation at every entry that takes one, and the GPU's rules
# for the rows gather_rows and combine_rows take
# ----------------------------------------------------------------------------------------------------------------

T_TOKENS, TOPK = 10, 2


def valid_permutation(gen, device="cpu"):
    """(a valid Permutation of T_TOKENS tokens, top-TOPK of 4 experts, on `device`; the tokens per expert)."""
    from megatron_tma.permutation import Permutation, permutation_from_routing_map

    routing_map, _ = routing(T_TOKENS, 4, TOPK, gen)
    perm, sizes, _ = permutation_from_routing_map(routing_map, TOPK)
    return Permutation(perm.rows.to(device), perm.token_rows.to(device)), sizes.to(device)


def _swap_rows(perm):
    """rows swapped between two permuted rows of different tokens: in range, but token_rows no longer agree."""
    rows = perm.rows.cpu()
    b = next(i for i, t in enumerate(rows.tolist()) if t != rows[0].item())
    swapped = rows.clone()
    swapped[0], swapped[b] = rows[b], rows[0]
    return perm._replace(rows=swapped.to(perm.rows.device))


def _set(perm, field, index, value):
    t = getattr(perm, field).clone()
    t[index] = value
    return perm._replace(**{field: t})


# (how to break a valid plan, the error's words (a regex)): rows out of [0, T), token_rows out of [0, T k), the two
# disagreeing, a row named twice by token_rows.
MALFORMED = {
    "rows-too-large": (lambda p: _set(p, "rows", 3, T_TOKENS),
                       rf"permutation.rows must hold token indices in \[0, {T_TOKENS}\) .*got rows\[3\]={T_TOKENS}"),
    "rows-negative": (lambda p: _set(p, "rows", 0, -1), r"permutation.rows must hold token indices in \[0, 10\)"),
    "token_rows-too-large": (lambda p: _set(p, "token_rows", (1, 0), 2 ** 30),
                             r"permutation.token_rows must hold permuted-row indices in \[0, 20\) .*"
                             r"token_rows\[1, 0\]=1073741824"),
    "token_rows-negative": (lambda p: _set(p, "token_rows", (2, 1), -5),
                            r"permutation.token_rows must hold permuted-row indices in \[0, 20\) .*=-5"),
    "disagree": (_swap_rows, r"permutation.rows and permutation.token_rows disagree: token_rows\[\d+, \d\]=\d+ "
                             r"names a row of token \d+, but rows\[\d+\]=\d+"),
    "row-named-twice": (lambda p: _set(p, "token_rows", (4, 1), p.token_rows[4, 0].item()),
                        r"permutation.token_rows must name each of the 20 permuted rows in \[0, 20\) once, got row "
                        r"\d+ (2|0) times"),
}

ENTRIES = ("gather_rows", "combine_rows", "fp8_grouped_linear-permutation", "fp8_grouped_linear-combine",
           "GroupedFP8MLP", "GroupedBF16MLP")


def permutation_entries(gen, device="cpu", backend="reference"):
    """Every entry that takes a Permutation, as {name: call(perm, tokens per expert)}."""
    from megatron_tma.autograd import fp8_grouped_linear
    from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP

    x = random_rows(T_TOKENS, 128, gen).to(device).requires_grad_()
    y = random_rows(T_TOKENS * TOPK, 128, gen).to(device)
    w = (torch.randn(4, 128, 128, generator=gen) * 0.05).bfloat16().to(device)
    torch.manual_seed(0)
    fp8 = GroupedFP8MLP(4, 128, 128, backend=backend, device=device)
    bf16 = GroupedBF16MLP(4, 128, 128, backend=backend, device=device)
    return {
        "gather_rows": lambda p, s: gather_rows(x, p, backend=backend),
        "combine_rows": lambda p, s: combine_rows(y, p, backend=backend),
        "fp8_grouped_linear-permutation": lambda p, s: fp8_grouped_linear(x, w, s, permutation=p, backend=backend),
        "fp8_grouped_linear-combine": lambda p, s: fp8_grouped_linear(y, w, s, combine=p, backend=backend),
        "GroupedFP8MLP": lambda p, s: fp8(x, s, permutation=p),
        "GroupedBF16MLP": lambda p, s: bf16(x, s, permutation=p),
    }


def check_malformed_permutation_is_refused(entry, case, gen, device="cpu", backend="reference"):
    """The valid plan runs; the broken one raises a one-line ValueError naming rows / token_rows and the range."""
    import re

    import pytest

    perm, sizes = valid_permutation(gen, device)
    call = permutation_entries(gen, device, backend)[entry]
    call(perm, sizes)
    breaks, words = MALFORMED[case]
    if entry == "fp8_grouped_linear-combine":
        words = words.replace("permutation", "combine")
    with pytest.raises(ValueError) as e:
        call(breaks(perm), sizes)
    assert "\n" not in str(e.value) and re.search(words, str(e.value)), str(e.value)


def misaligned_rows(rows, width, gen, device="cpu"):
    """A contiguous bf16 [rows, width] view 2 bytes past a 16-byte boundary."""
    base = random_rows(rows * width + 8, 1, gen).reshape(-1).to(device)
    return base[1: 1 + rows * width].view(rows, width)


# The GPU's rules for the rows of gather_rows (its input: its backward combines BF16 rows) and combine_rows
# (csrc/binding/combine_rows.cpp): {case: (call(perm, gen, device, backend), exception, words)}.
ROW_RULES = {
    "gather-fp32": (lambda p, g, d, b: gather_rows(random_rows(T_TOKENS, 16, g).float().to(d).requires_grad_(), p,
                                                   backend=b), TypeError, "x must have dtype bfloat16, got float32"),
    "gather-width-12": (lambda p, g, d, b: gather_rows(random_rows(T_TOKENS, 12, g).to(d), p, backend=b),
                        ValueError, "the last dim of x must be a multiple of 8"),
    "combine-fp32": (lambda p, g, d, b: combine_rows(random_rows(T_TOKENS * TOPK, 16, g).float().to(d), p,
                                                     backend=b), TypeError, "y must have dtype bfloat16, got float32"),
    "combine-width-12": (lambda p, g, d, b: combine_rows(random_rows(T_TOKENS * TOPK, 12, g).to(d), p, backend=b),
                         ValueError, "the last dim of y must be a multiple of 8"),
    "combine-misaligned": (lambda p, g, d, b: combine_rows(misaligned_rows(T_TOKENS * TOPK, 16, g, d), p, backend=b),
                           ValueError, "y must start 16-byte aligned"),
}


def check_row_rule(case, gen, device="cpu", backend="reference"):
    import pytest

    perm, _ = valid_permutation(gen, device)
    call, exc, words = ROW_RULES[case]
    with pytest.raises(exc, match=words) as e:
        call(perm, gen, device, backend)
    assert "\n" not in str(e.value)


def check_gather_gradient_from_a_misaligned_view(gen, device="cpu", backend="reference"):
    """The combine in gather_rows' backward takes the gradient autograd hands it, which may be a view at any offset:
    it is copied to an aligned buffer (the kernel's rule), the same sums."""
    perm, _ = valid_permutation(gen, device)
    x = random_rows(T_TOKENS, 16, gen).to(device).requires_grad_()
    dy = misaligned_rows(T_TOKENS * TOPK, 16, gen, device)
    gather_rows(x, perm, backend=backend).backward(dy)
    assert torch.equal(x.grad, combine_rows(dy.clone(), perm, backend=backend))
