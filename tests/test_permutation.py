"""The experts' own MoE permutation (megatron_tma.permutation) on the CPU: the plan in Megatron's permuted order
(against megatron-core's `permute` where it is installed), the combine's fixed FP32 order, the argument errors,
and the expert MLPs with a permutation equal bit for bit to gather -> MLP -> combine, values and gradients, on the
reference backend (the padded twins and the recomputed activation too)."""
import pytest
import torch
from _dists import random_rows
from _permutation_steps import (ENTRIES, MALFORMED, ROW_RULES, assert_same_steps,
                                check_gather_gradient_from_a_misaligned_view, check_malformed_permutation_is_refused,
                                check_row_rule, mlp_step, routing)

from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP
from megatron_tma.permutation import (Permutation, check_permutation, combine_rows, gather_rows,
                                      permutation_from_routing_map)

try:
    from megatron.core.transformer.moe.moe_utils import permute as megatron_permute
except Exception:  # noqa: BLE001 - megatron-core needs Python >= 3.12
    megatron_permute = None


@pytest.mark.parametrize("tokens,experts,topk", [(1, 1, 1), (37, 8, 2), (64, 16, 8), (5, 4, 4)])
def test_plan_is_megatrons_permuted_order(tokens, experts, topk, gen):
    routing_map, probs = routing(tokens, experts, topk, gen)
    perm, sizes, permuted_probs = permutation_from_routing_map(routing_map, topk, probs)
    # by definition: expert by expert, tokens ascending within an expert
    want = [t for e in range(experts) for t in range(tokens) if routing_map[t, e]]
    assert perm.rows.dtype == torch.int32 and perm.rows.tolist() == want
    assert torch.equal(sizes, routing_map.sum(0))
    want_probs = torch.stack([probs[t, e] for e in range(experts) for t in range(tokens) if routing_map[t, e]])
    assert torch.equal(permuted_probs, want_probs)
    # token_rows: each token's rows, ascending, and they point back at the token
    assert perm.token_rows.shape == (tokens, topk)
    for t in range(tokens):
        rows_t = perm.token_rows[t].tolist()
        assert rows_t == sorted(rows_t) and all(perm.rows[r] == t for r in rows_t)
    if megatron_permute is not None:
        x = random_rows(tokens, 16, gen)
        mx, mprobs, sorted_indices, _, _ = megatron_permute(x, routing_map, probs=probs,
                                                            num_out_tokens=tokens * topk)
        assert torch.equal(sorted_indices.int(), perm.rows)
        assert torch.equal(mprobs, permuted_probs)
        assert torch.equal(mx, x.index_select(0, perm.rows))


def test_combine_adds_in_fixed_fp32_order(gen):
    # three rows whose sum depends on the order in FP32: 2^24 + 1 - 2^24 is 0 or 1
    y = torch.tensor([[2.0 ** 24], [1.0], [-(2.0 ** 24)]]).expand(3, 8).contiguous().bfloat16()
    perm = Permutation(torch.zeros(3, dtype=torch.int32), torch.tensor([[0, 1, 2]], dtype=torch.int32))
    out = combine_rows(y, perm, backend="reference")
    assert torch.equal(out, torch.zeros(1, 8, dtype=torch.bfloat16))  # (2^24 + 1) rounds to 2^24 first
    # FP32 sums, one rounding at the end: 1 + 2^-8 + 2^-8 = 1 + 2^-7 (a BF16 value), where adding in BF16 would
    # round 1 + 2^-8 back to 1 twice
    y = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8]]).expand(3, 8).contiguous().bfloat16()
    out = combine_rows(y, perm, backend="reference")
    assert torch.equal(out, torch.full((1, 8), 1 + 2.0 ** -7).bfloat16())
    # -0 rows combine to +0 (the sum starts from +0)
    out = combine_rows(torch.full((3, 8), -0.0).bfloat16(), perm, backend="reference")
    assert not torch.signbit(out.float()).any()


def test_gather_and_combine_are_each_others_gradient(gen):
    routing_map, _ = routing(20, 6, 3, gen)
    perm, _, _ = permutation_from_routing_map(routing_map, 3)
    x = random_rows(20, 32, gen).requires_grad_()
    g = gather_rows(x, perm, backend="reference")
    assert torch.equal(g, x.detach().index_select(0, perm.rows))
    dg = random_rows(60, 32, gen)
    g.backward(dg)
    assert torch.equal(x.grad, combine_rows(dg, perm, backend="reference"))
    y = dg.clone().requires_grad_()
    out = combine_rows(y, perm, backend="reference")
    dout = random_rows(20, 32, gen)
    out.backward(dout)
    assert torch.equal(y.grad, dout.index_select(0, perm.rows))


def test_argument_errors(gen):
    routing_map, probs = routing(10, 4, 2, gen)
    with pytest.raises(TypeError, match="routing_map must have dtype bool"):
        permutation_from_routing_map(routing_map.int(), 2)
    with pytest.raises(ValueError, match="topk must be an int"):
        permutation_from_routing_map(routing_map, 0)
    with pytest.raises(ValueError, match="exceeds the routing map's 4 experts"):
        permutation_from_routing_map(routing_map, 5)
    with pytest.raises(ValueError, match="probs must be"):
        permutation_from_routing_map(routing_map, 2, probs[:5])
    perm, sizes, pp = permutation_from_routing_map(routing_map, 2, probs)
    x = random_rows(10, 128, gen)
    with pytest.raises(TypeError, match="must be a megatron_tma.permutation.Permutation"):
        check_permutation((perm.rows, perm.token_rows), None, x)
    with pytest.raises(ValueError, match="does not fit: 9 tokens"):
        check_permutation(perm, None, x[:9])
    with pytest.raises(TypeError, match="permutation.rows must have dtype int32"):
        check_permutation(Permutation(perm.rows.long(), perm.token_rows), None, x)
    with pytest.raises(ValueError, match="y must have the permutation's 20 rows"):
        combine_rows(random_rows(19, 128, gen), perm, backend="reference")
    with pytest.raises(ValueError, match="multiple of 8"):
        combine_rows(random_rows(20, 12, gen), perm, backend="reference")
    mlp = GroupedFP8MLP(4, 128, 128, backend="reference")
    with pytest.raises(ValueError, match="tokens_per_expert"):
        mlp(x, sizes - 1, pp, permutation=perm)  # the sizes must describe the 20 permuted rows
    with pytest.raises(ValueError, match=r"permuted_probs must be \[T\] = \[20\]"):
        mlp(x, sizes, pp[:10], permutation=perm)
    with pytest.raises(ValueError, match="with an activation .* takes no permutation or combine"):
        mlp.linear_fc2(x, sizes, pp, "swiglu", permutation=perm)


@pytest.mark.parametrize("make", [
    lambda: GroupedFP8MLP(4, 256, 128, backend="reference"),
    lambda: GroupedFP8MLP(4, 256, 128, backend="reference", pad_to=16),
    lambda: GroupedFP8MLP(4, 256, 128, backend="reference", pad_to=128),
    lambda: GroupedFP8MLP(4, 256, 128, backend="reference", recompute_activation=True),
    lambda: GroupedFP8MLP(4, 256, 128, "gelu", backend="reference", weight_layout="per_expert"),
    lambda: GroupedBF16MLP(4, 256, 128, backend="reference"),
], ids=["unpadded", "padded16", "padded128", "recompute", "gelu-per-expert", "bf16"])
def test_mlp_with_permutation_equals_gather_mlp_combine(make, gen):
    routing_map, probs = routing(45, 4, 2, gen)
    perm, sizes, permuted_probs = permutation_from_routing_map(routing_map, 2, probs)
    x, dout = random_rows(45, 256, gen), random_rows(45, 256, gen)
    torch.manual_seed(3)
    mlp = make()
    got = mlp_step(mlp, x, sizes, permuted_probs, perm, dout, fused=True)
    assert got["out"].shape == (45, 256)
    assert_same_steps(got, mlp_step(mlp, x, sizes, permuted_probs, perm, dout, fused=False))


def test_twins_equal_with_permutation(gen):
    routing_map, probs = routing(70, 4, 2, gen)
    perm, sizes, permuted_probs = permutation_from_routing_map(routing_map, 2, probs)
    x, dout = random_rows(70, 256, gen), random_rows(70, 256, gen)
    results = []
    for pad_to in (None, 16, 128):
        torch.manual_seed(5)
        results.append(mlp_step(GroupedFP8MLP(4, 256, 128, backend="reference", pad_to=pad_to), x, sizes,
                                permuted_probs, perm, dout, fused=True))
    for other in results[1:]:
        assert_same_steps(other, results[0])


# ----------------------------------------------------------------------------------------------------------------
# Issue 55 items 3 and 4: a malformed Permutation, and the GPU's rules for gather_rows / combine_rows on the CPU
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_malformed_permutation_is_refused_in_one_line(entry, case, gen):
    """Before: an index out of range ended in torch's "index out of range in self" on the CPU (the CUDA kernels
    clamp it), and rows that disagree with token_rows were taken (the input gradient then not the forward's)."""
    check_malformed_permutation_is_refused(entry, case, gen)


def test_permutation_values_are_not_read_off_the_host(gen):
    """Device tensors are read only under the debug checks: meta tensors (no data to read) pass the shape checks with
    the checks off and fail the read with them on."""
    from megatron_tma.groups import set_debug_checks

    perm = Permutation(torch.empty(20, dtype=torch.int32, device="meta"),
                       torch.empty(10, 2, dtype=torch.int32, device="meta"))
    check_permutation(perm, 20, None, device=torch.device("meta"))
    set_debug_checks(True)
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever torch raises for reading a meta tensor
            check_permutation(perm, 20, None, device=torch.device("meta"))
    finally:
        set_debug_checks(None)


@pytest.mark.parametrize("case", sorted(ROW_RULES))
def test_gather_and_combine_apply_the_gpu_rules_on_the_cpu(case, gen):
    check_row_rule(case, gen)


def test_gather_gradient_from_a_misaligned_view_is_combined(gen):
    check_gather_gradient_from_a_misaligned_view(gen)
