"""The experts' own MoE permutation on the H200 (megatron_tma.permutation): the gather fused into the row + column
quantizer equal byte for byte to quantizing the gathered rows, the combine kernel equal bit for bit to the FP32
reference sum, and the FP8 expert MLP with a permutation equal bit for bit to gather -> MLP -> combine and to its
padded twins, values and gradients. Skipped without a Hopper GPU + extension."""
import pytest
import torch
from _dists import EDGE_GROUPINGS, random_rows

from megatron_tma import _ext
from megatron_tma.groups import check_groups
from megatron_tma.mlp import GroupedFP8MLP
from megatron_tma.permutation import combine_rows, gather_rows, permutation_from_routing_map
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
    got = _ext.op("combine_rows")(y, token_rows)
    assert_bits(got, ref.to(torch.bfloat16))


def _routing(tokens, experts, topk, gen):
    logits = torch.randn(tokens, experts, generator=gen)
    chosen = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    return routing_map.to(DEV), torch.softmax(logits, 1).to(DEV)


def _step(mlp, x, sizes, probs, perm, dout, fused):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    for p in mlp.parameters():
        p.grad = None
    if fused:
        out, _ = mlp(x, sizes, probs, permutation=perm)
    else:
        # gather_rows, not index_select: index_select's backward adds the k rows of a token in BF16 with atomics
        # (order-dependent from top-3 on); gather_rows' backward is combine_rows' FP32 sum, as the fused path's.
        y, _ = mlp(gather_rows(x, perm), sizes, probs)
        out = combine_rows(y, perm)
    out.backward(dout)
    results = {"out": out, "x.grad": x.grad, "probs.grad": probs.grad}
    results.update({f"{n}.grad": p.grad.clone() for n, p in mlp.named_parameters()})
    return results


@pytest.mark.parametrize("tokens,experts,topk,hidden,ffn", [(1000, 8, 2, 512, 256), (4096, 32, 8, 1024, 256)])
def test_mlp_with_permutation_bits(tokens, experts, topk, hidden, ffn, gen):
    routing_map, probs = _routing(tokens, experts, topk, gen)
    perm, sizes, permuted_probs = permutation_from_routing_map(routing_map, topk, probs)
    x, dout = random_rows(tokens, hidden, gen).to(DEV), random_rows(tokens, hidden, gen).to(DEV)
    results = {}
    for name, kw in [("unpadded", {}), ("padded16", dict(pad_to=16)), ("padded128", dict(pad_to=128)),
                     ("recompute", dict(recompute_activation=True))]:
        torch.manual_seed(11)
        mlp = GroupedFP8MLP(experts, hidden, ffn, backend="cuda", device=DEV, **kw)
        results[name] = _step(mlp, x, sizes, permuted_probs, perm, dout, fused=True)
        if name == "unpadded":  # the fused gather and combine against Megatron's order of operations
            unfused = _step(mlp, x, sizes, permuted_probs, perm, dout, fused=False)
            assert unfused.keys() == results[name].keys()
            for what, a in results[name].items():
                assert torch.equal(a, unfused[what]), what
    for name, got in results.items():
        assert got.keys() == results["unpadded"].keys(), name
        for what, a in got.items():
            assert torch.equal(a, results["unpadded"][what]), (name, what)
    assert torch.isfinite(results["unpadded"]["out"].float()).all()
