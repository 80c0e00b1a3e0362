"""Shared by the permutation tests (CPU and GPU): random top-k routing, and one forward + backward of an expert MLP
with the experts permuting their own tokens (`fused`) or around it (gather_rows -> MLP -> combine_rows: the same
sums, so the same bits; torch's index_select would add each token's row gradients in BF16 instead)."""
import torch

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
