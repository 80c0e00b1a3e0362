"""The experts' own MoE permutation on the H200 (megatron_tma.permutation): the gather fused into the row + column
quantizer equal byte for byte to quantizing the gathered rows, the combine kernel equal bit for bit to the FP32
reference sum, and the FP8 expert MLP with a permutation equal bit for bit to gather -> MLP -> combine and to its
padded twins, values and gradients. Skipped without a Hopper GPU + extension."""
import pytest
import torch
from _dists import EDGE_GROUPINGS, random_rows
from _permutation_steps import (ENTRIES, MALFORMED, ROW_RULES, assert_same_steps,
                                check_gather_gradient_from_a_misaligned_view, check_malformed_permutation_is_refused,
                                check_row_rule, mlp_step, permutation_entries, routing, valid_permutation)

from megatron_tma import _ext
from megatron_tma.groups import check_groups
from megatron_tma.mlp import GroupedFP8MLP
from megatron_tma.permutation import permutation_from_routing_map
from megatron_tma.quant import run_1x128_and_grouped_128x1, run_gather_1x128_and_grouped_128x1

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")

DEV = "cuda"


def poison(*nbytes):
    blocks = [torch.full((n,), 0x7F, dtype=torch.uint8, device=DEV) for n in nbytes if n > 0]
    del blocks


def assert_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() or a.numel() == 0, (a.shape, b.shape)
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("grouping", ["edges", "edges_shuffled", "single_row", "random"])
@pytest.mark.parametrize("k", [128, 272])
def test_gather_quantizer_equals_quantizing_the_gathered_rows(dtype, pow2, grouping, k, gen):
    sizes = (torch.randint(0, 300, (6,), generator=gen).tolist() if grouping == "random"
             else EDGE_GROUPINGS[grouping])
    m = sum(sizes)
    tokens = max(1, m // 3 + 1)
    x = random_rows(tokens, k, gen, dtype).to(DEV)
    rows = torch.randint(0, tokens, (m,), generator=gen, dtype=torch.int32).to(DEV)  # repeats, any order
    groups = check_groups(torch.tensor(sizes, device=DEV), len(sizes), m_total=m)
    want = run_1x128_and_grouped_128x1(x.index_select(0, rows), groups, pow2, "cuda")
    poison(*[t.numel() * t.element_size() for t in want])
    got = run_gather_1x128_and_grouped_128x1(x, rows, groups, pow2, "cuda")
    for a, b in zip(got, want):
        assert_bits(a, b)


@pytest.mark.parametrize("k", [1, 2, 3, 6, 8, 32])
@pytest.mark.parametrize("tokens,h", [(0, 64), (1, 8), (257, 136), (1000, 2048)])
def test_combine_kernel_equals_fp32_reference(k, tokens, h, gen):
    rows_total = max(1, tokens * k)
    y = random_rows(rows_total, h, gen).to(DEV)
    token_rows = torch.randint(0, rows_total, (tokens, k), generator=gen, dtype=torch.int32).to(DEV)
    ref = torch.zeros(tokens, h, dtype=torch.float32, device=DEV)
    for j in range(k):
        ref += y.index_select(0, token_rows[:, j].long()).float()
    poison(tokens * h * 2)
    got = _ext.ops().combine_rows(y, token_rows)
    assert_bits(got, ref.to(torch.bfloat16))


@pytest.mark.parametrize("tokens,experts,topk,hidden,ffn", [(1000, 8, 2, 512, 256), (4096, 32, 8, 1024, 256)])
def test_mlp_with_permutation_bits(tokens, experts, topk, hidden, ffn, gen):
    routing_map, probs = routing(tokens, experts, topk, gen, DEV)
    perm, sizes, permuted_probs = permutation_from_routing_map(routing_map, topk, probs)
    x, dout = random_rows(tokens, hidden, gen).to(DEV), random_rows(tokens, hidden, gen).to(DEV)
    results = {}
    for name, kw in [("unpadded", {}), ("padded16", dict(pad_to=16)), ("padded128", dict(pad_to=128)),
                     ("recompute", dict(recompute_activation=True))]:
        torch.manual_seed(11)
        mlp = GroupedFP8MLP(experts, hidden, ffn, backend="cuda", device=DEV, **kw)
        results[name] = mlp_step(mlp, x, sizes, permuted_probs, perm, dout, fused=True)
        if name == "unpadded":  # the gather and combine fused into the experts against the same steps around them
            assert_same_steps(results[name], mlp_step(mlp, x, sizes, permuted_probs, perm, dout, fused=False))
    for name, got in results.items():
        assert_same_steps(got, results["unpadded"], name)
    assert torch.isfinite(results["unpadded"]["out"].float()).all()


# ----------------------------------------------------------------------------------------------------------------
# Issue 55 items 3 and 4: the CPU's errors on the GPU
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_malformed_permutation_is_refused_under_the_debug_checks(entry, case, gen, debug_checks):
    """Under the debug checks the device plan is read (a sync) and refused with the CPU's error; before, the kernels
    clamped an index out of range and read a wrong row, and a plan whose rows disagree was taken."""
    check_malformed_permutation_is_refused(entry, case, gen, DEV, "cuda")


def test_a_valid_permutation_costs_no_sync_without_the_debug_checks(gen):
    """Without the debug checks nothing reads the plan on the host: every entry runs under CUDA's sync detector."""
    perm, sizes = valid_permutation(gen, DEV)
    entries = permutation_entries(gen, DEV, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name in ("gather_rows", "combine_rows", "fp8_grouped_linear-permutation", "fp8_grouped_linear-combine"):
            entries[name](perm, sizes)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("case", sorted(ROW_RULES))
def test_gather_and_combine_rules_are_the_cpus(case, gen):
    """The same errors as on the CPU, from the Python check before the kernel (the binding's own is a backstop)."""
    check_row_rule(case, gen, DEV, "cuda")


def test_gather_gradient_from_a_misaligned_view_is_combined(gen):
    """Before, the combine kernel refused the misaligned gradient view in backward."""
    check_gather_gradient_from_a_misaligned_view(gen, DEV, "cuda")
