"""Group-size distributions and random data shared by the tests (``from _dists import ...``).

The size generator itself lives in ``megatron_tma.groups.make_group_sizes`` because the benchmarks use
it too; this module adds the hand-picked edge cases and the tensor builders.
"""
import torch

from megatron_tma.groups import DISTRIBUTIONS, make_group_sizes  # noqa: F401  (re-exported)

# Sizes around one 128-row block: empty, single row, one short of / exactly / one past a block.
EDGE_SIZES = (0, 1, 127, 128, 129)

# Groupings that stress the boundaries: empty first/last groups, M_total < 128, one block exactly.
EDGE_GROUPINGS = {
    "edges": [0, 1, 127, 128, 129],
    "edges_shuffled": [129, 0, 128, 1, 0, 127, 0],
    "single_row": [1],
    "tiny_total": [3, 0, 5],
    "one_block": [128],
    "empty_then_one": [0, 0, 0, 129],
}

# (what the tensor holds, its dtype): every kernel entry point must accept all four.
GROUP_FORMATS = (
    ("sizes", torch.int32),
    ("sizes", torch.int64),
    ("offsets", torch.int32),
    ("offsets", torch.int64),
)


def group_tensor(sizes, fmt=("sizes", torch.int64), device="cpu") -> torch.Tensor:
    """Sizes [G] or offsets [G+1] (per ``fmt``) as a tensor on ``device``."""
    kind, dtype = fmt
    sizes = torch.as_tensor(list(sizes) if not isinstance(sizes, torch.Tensor) else sizes, dtype=torch.int64)
    if kind == "offsets":
        sizes = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    return sizes.to(dtype=dtype, device=device)


def random_rows(m: int, k: int, gen: torch.Generator, dtype=torch.bfloat16, spread: int = 8) -> torch.Tensor:
    """Gaussian rows, each scaled by its own power of two in [2^-spread, 2^spread], so that scales
    differ from row to row and block to block (a layout mix-up then shows)."""
    x = torch.randn(m, k, generator=gen)
    exps = torch.randint(-spread, spread + 1, (m, 1), generator=gen).float()
    return (x * torch.exp2(exps)).to(dtype)


def double_rounding_block(g=1):
    """FP32 masters whose BF16 rounding changes their FP8 byte: in a block of amax 448 (scale 1), 1.0625 + 2^-12
    rounds to 1.0625 in BF16, an e4m3 tie that goes to the even 1.0, where the FP32 value itself rounds to 1.125."""
    master = torch.zeros(g, 128, 128)
    master[:, 0, 0] = 448.0
    master[:, 1, 1] = 1.0625 + 2.0 ** -12
    return master
