"""megatron_tma.groups: the check, every error message, sizes/offsets/tiles, the size generator."""
import pytest
import torch
from _dists import EDGE_SIZES, group_tensor

from megatron_tma import groups as G


# ------------------------------------------------------------------------------------------------
# check_groups
# ------------------------------------------------------------------------------------------------
def test_check_groups_accepts_every_format(groups_format):
    sizes = [3, 0, 5, 1]
    t = group_tensor(sizes, groups_format)
    out, g, is_offsets, _ = G.check_groups(t, num_groups=4, m_total=9)
    assert g == 4
    assert is_offsets == (groups_format[0] == "offsets")
    assert out.dtype == groups_format[1] and torch.equal(out, t)  # dtype kept, values untouched
    assert G.host_group_sizes(t, 4, 9) == sizes


def test_check_groups_without_num_groups_means_sizes():
    out, _, is_offsets, _ = G.check_groups(torch.tensor([0, 4, 6]), m_total=10)
    assert not is_offsets and out.tolist() == [0, 4, 6]
    # the same 3 values read as offsets of G=2 groups
    is_offsets = G.check_groups(torch.tensor([0, 4, 6]), num_groups=2, m_total=6).is_offsets
    assert is_offsets


def test_check_groups_makes_strided_groups_contiguous():
    t = torch.tensor([1, 9, 2, 9, 3, 9], dtype=torch.int32)[::2]
    out = G.check_groups(t, m_total=6).tensor
    assert out.is_contiguous() and out.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "groups, kwargs, exc, match",
    [
        ([1, 2], {}, TypeError,
         r"groups must be a torch\.Tensor of group sizes \[G\] or offsets \[G\+1\].*got list"),
        (torch.tensor([1.0, 2.0]), {}, TypeError, r"groups must have dtype int32 or int64, got float32"),
        (torch.tensor([1, 2], dtype=torch.int16), {}, TypeError, r"int32 or int64, got int16"),
        (torch.tensor([[1, 2]]), {}, ValueError, r"groups must be 1-D \(sizes \[G\] or offsets \[G\+1\]\), got shape \(1, 2\)"),
        (torch.tensor(3), {}, ValueError, r"must be 1-D .*got shape \(\)"),
        (torch.tensor([1, 2, 3]), {"num_groups": 5}, ValueError,
         r"groups has 3 entries: expected G sizes or G\+1 offsets with G=5"),
        (torch.tensor([1]), {"num_groups": 0}, ValueError, r"num_groups must be >= 1, got 0"),
        (torch.zeros(0, dtype=torch.int64), {}, ValueError, r"groups is empty: expected G >= 1 group sizes"),
        (torch.tensor([1, 2]), {"device": "meta"}, ValueError, r"groups must be on the data's device meta, got cpu"),
        (torch.tensor([4, 1, -3, 5, -1]), {}, ValueError,
         r"group sizes must be >= 0, got negative sizes\[2\]=-3, sizes\[4\]=-1"),
        (torch.tensor([4, 6]), {"m_total": 12}, ValueError, r"group sizes sum to 10, but the data has M_total=12 rows"),
        (torch.tensor([1, 4, 12]), {"num_groups": 2}, ValueError, r"offsets must start at 0, got offsets\[0\]=1"),
        (torch.tensor([0, 5, 3, 2, 12]), {"num_groups": 4}, ValueError,
         r"offsets must be non-decreasing, got offsets\[1\]=5 > offsets\[2\]=3 \(2 decreasing steps in all\)"),
        (torch.tensor([0, 4, 10]), {"num_groups": 2, "m_total": 12}, ValueError,
         r"offsets must end at M_total=12 \(rows of the data\), got offsets\[2\]=10"),
    ],
)
def test_check_groups_errors(groups, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        G.check_groups(groups, **kwargs)


def test_error_messages_use_the_callers_name():
    with pytest.raises(ValueError, match=r"^tokens_per_expert: group sizes sum to 3, but the data has M_total=4"):
        G.check_groups(torch.tensor([1, 2]), m_total=4, name="tokens_per_expert")


def test_many_negative_sizes_are_summarised():
    with pytest.raises(ValueError, match=r"sizes\[0\]=-1, sizes\[1\]=-1, sizes\[2\]=-1, sizes\[3\]=-1 \(and 2 more\)"):
        G.check_groups(-torch.ones(6, dtype=torch.int64))


def test_device_groups_are_not_read_without_debug_checks(monkeypatch):
    # A meta tensor has no data: any host read raises. Malformed values could not be noticed anyway.
    monkeypatch.delenv(G.DEBUG_ENV, raising=False)
    meta = torch.empty(5, dtype=torch.int32, device="meta")
    out, _, is_offsets, _ = G.check_groups(meta, num_groups=4, m_total=100, device="meta")
    assert is_offsets and out.device.type == "meta"


def test_debug_checks_read_device_tensors(debug_checks):
    # With debug checks on, a non-CPU tensor is copied to the host and validated; a meta tensor has
    # no data, so the attempted read itself is what shows up here.
    meta = torch.empty(4, dtype=torch.int64, device="meta")
    with pytest.raises(NotImplementedError, match="meta"):
        G.check_groups(meta, m_total=10, device="meta")


def test_debug_checks_switch_and_environment(monkeypatch):
    monkeypatch.setenv(G.DEBUG_ENV, "1")
    G.set_debug_checks(None)
    assert G.debug_checks_enabled()
    G.set_debug_checks(False)
    assert not G.debug_checks_enabled()  # the explicit switch wins over the environment
    monkeypatch.setenv(G.DEBUG_ENV, "0")
    G.set_debug_checks(None)
    assert not G.debug_checks_enabled()
    G.set_debug_checks(True)
    assert G.debug_checks_enabled()
    G.set_debug_checks(None)


def test_host_group_sizes_always_validates():
    with pytest.raises(ValueError, match="sum to 3"):
        G.host_group_sizes(torch.tensor([1, 2]), m_total=5)
    assert G.host_group_sizes(torch.tensor([0, 2, 2, 7]), num_groups=3, m_total=7) == [2, 0, 5]


# ------------------------------------------------------------------------------------------------
# sizes <-> offsets, padding, token blocks, tiles (device ops: they must also run on meta tensors)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sizes_to_offsets_and_back(dtype):
    sizes = torch.tensor(list(EDGE_SIZES) + [0], dtype=dtype)
    offs = G.sizes_to_offsets(sizes)
    assert offs.dtype == torch.int32
    assert offs.tolist() == [0, 0, 1, 128, 256, 385, 385]
    assert G.offsets_to_sizes(offs).tolist() == sizes.tolist()
    assert G.group_sizes(offs, True).tolist() == sizes.tolist()
    assert G.group_sizes(sizes, False) is sizes


def test_device_helpers_never_read_values():
    meta = torch.empty(7, dtype=torch.int64, device="meta")
    assert G.sizes_to_offsets(meta).shape == (8,)
    assert G.offsets_to_sizes(G.sizes_to_offsets(meta)).shape == (7,)
    assert G.padded_sizes(meta, 128).shape == (7,)
    assert G.token_block_offsets(meta).shape == (8,)
    a = G.aligned_token_offsets(meta)
    assert a.shape == (8,) and a.dtype == torch.int64 and a.device.type == "meta"
    assert G.aligned_token_offsets(torch.empty(8, dtype=torch.int32, device="meta"), num_groups=7).shape == (8,)


def test_padded_sizes():
    sizes = torch.tensor(EDGE_SIZES)
    assert G.padded_sizes(sizes, 128).tolist() == [0, 128, 128, 128, 256]
    assert G.padded_sizes(sizes, 16).tolist() == [0, 16, 128, 128, 144]
    assert G.padded_sizes(sizes, 1).tolist() == list(EDGE_SIZES)
    with pytest.raises(ValueError, match=r"align must be >= 1, got 0"):
        G.padded_sizes(sizes, 0)


def test_token_blocks():
    sizes = torch.tensor([0, 1, 127, 128, 129, 300, -4])
    assert G.token_block_counts(sizes).tolist() == [0, 1, 1, 1, 2, 3, 0]  # negative counts as 0
    assert G.token_block_offsets(sizes).tolist() == [0, 0, 1, 2, 3, 5, 8, 8]
    assert G.token_block_counts(sizes, 64).tolist() == [0, 1, 2, 2, 3, 5, 0]


# The wgrad operands' 128-token group starts (docs/design.md §4): a_g = sum_{h<g} round_up(M_h, 128), P at its bound.
WGRAD_SIZES = [0, 1, 15, 16, 17, 127, 128, 129, 0, 256, 3]
WGRAD_STARTS = [0, 0, 128, 256, 384, 512, 640, 768, 1024, 1024, 1280, 1408]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_aligned_token_offsets(groups_format, dtype):
    t = group_tensor(WGRAD_SIZES, (groups_format[0], dtype))
    num_groups = len(WGRAD_SIZES) if groups_format[0] == "offsets" else None
    a = G.aligned_token_offsets(t, num_groups)
    assert a.dtype == torch.int64 and a.tolist() == WGRAD_STARTS
    if num_groups is None:  # G entries with num_groups = G are sizes too
        assert G.aligned_token_offsets(t, len(WGRAD_SIZES)).tolist() == WGRAD_STARTS
    # one group; negative sizes count as 0 (as in the kernels)
    assert G.aligned_token_offsets(torch.tensor([5])).tolist() == [0, 128]
    assert G.aligned_token_offsets(torch.tensor([3, -7, 200], dtype=dtype)).tolist() == [0, 128, 128, 384]


def test_aligned_token_offsets_errors():
    with pytest.raises(ValueError, match=r"groups has 3 entries: expected G sizes or G\+1 offsets with G=5"):
        G.aligned_token_offsets(torch.tensor([1, 2, 3]), 5)
    with pytest.raises(TypeError, match="int32 or int64"):
        G.aligned_token_offsets(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="groups is empty"):
        G.aligned_token_offsets(torch.zeros(0, dtype=torch.int64))


@pytest.mark.parametrize("m_total", [0, 1, 15, 16, 17, 127, 128, 129, 1000])
@pytest.mark.parametrize("num_groups", [1, 2, 9, 256])
def test_wgrad_pitch_is_the_bound_of_the_aligned_columns(m_total, num_groups):
    p = G.wgrad_pitch(m_total, num_groups)
    assert p == -(-m_total // 128) * 128 + 128 * num_groups and p % 128 == 0
    for dist in ("paper", "skewed", "with_empty", "one_group"):
        sizes = G.make_group_sizes(m_total, num_groups, dist, seed=m_total + num_groups)
        assert int(G.aligned_token_offsets(sizes)[-1]) <= p
    # the worst case: every group one past a multiple of 128
    ones = torch.tensor([1] * min(num_groups, m_total) + [0] * max(0, num_groups - m_total))
    ones[0] += m_total - int(ones.sum())
    assert int(G.aligned_token_offsets(ones)[-1]) <= p


def test_wgrad_pitch_errors():
    with pytest.raises(ValueError, match="m_total must be >= 0, got -1"):
        G.wgrad_pitch(-1, 2)
    with pytest.raises(ValueError, match="num_groups must be >= 1, got 0"):
        G.wgrad_pitch(16, 0)


def test_check_wgrad_columns():
    sizes = torch.tensor(WGRAD_SIZES)
    G.check_wgrad_columns(sizes, False, 1408, 11)  # exactly a_G columns and 11 blocks
    G.check_wgrad_columns(G.sizes_to_offsets(sizes), True, 1408, 11)
    with pytest.raises(ValueError, match=r"round_up\(M_g, 128\) = 1408 token columns, but .* P = 1280"):
        G.check_wgrad_columns(sizes, False, 1280, 11)
    with pytest.raises(ValueError, match=r"ceil\(M_g/128\) = 11 token blocks, but the token-block scales have 10 rows"):
        G.check_wgrad_columns(sizes, False, 1408, 10)
    with pytest.raises(ValueError, match=r"offsets \[G\+1\] need num_groups=G or out"):  # offsets read as sizes
        G.check_wgrad_columns(G.sizes_to_offsets(torch.tensor([40, 40])), False, 128, 4)


@pytest.mark.parametrize("block_m", [64, 128])
def test_tile_map_covers_each_group_without_straddling(dist, block_m):
    m_total, num_groups = 1000, 9
    sizes = G.make_group_sizes(m_total, num_groups, dist, seed=3)
    tiles = G.tile_map(sizes, block_m)
    assert tiles.shape[1] == 3 and tiles.dtype == torch.int64
    assert tiles.shape[0] <= G.max_tiles(m_total, num_groups, block_m)
    offs = G.sizes_to_offsets(sizes).tolist()
    covered = []
    for g, start, rows in tiles.tolist():
        assert 1 <= rows <= block_m
        assert offs[g] <= start and start + rows <= offs[g + 1]  # inside its group
        assert (start - offs[g]) % block_m == 0  # tiles start at the group's first row
        covered.extend(range(start, start + rows))
    assert covered == list(range(m_total))  # every row once, in order
    assert sorted(set(tiles[:, 0].tolist())) == [g for g in range(num_groups) if sizes[g] > 0]


def test_tile_map_edges_and_bound():
    tiles = G.tile_map(torch.tensor([0, 1, 127, 128, 129]), 128)
    assert tiles.tolist() == [[1, 0, 1], [2, 1, 127], [3, 128, 128], [4, 256, 128], [4, 384, 1]]
    assert G.tile_map(torch.tensor([0, 0]), 128).shape == (0, 3)
    # the bound M//block + G is reached: every group one row past a block
    sizes = torch.full((8,), 129)
    assert G.tile_map(sizes, 128).shape[0] == 16 <= G.max_tiles(8 * 129, 8, 128) == 16


# ------------------------------------------------------------------------------------------------
# make_group_sizes
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m_total", [0, 1, 127, 1000, 16384])
@pytest.mark.parametrize("num_groups", [1, 2, 3, 8, 32])
def test_make_group_sizes_sums_and_types(dist, m_total, num_groups):
    sizes = G.make_group_sizes(m_total, num_groups, dist, seed=7)
    assert sizes.dtype == torch.int64 and sizes.device.type == "cpu" and sizes.shape == (num_groups,)
    assert int(sizes.sum()) == m_total and bool((sizes >= 0).all())
    assert torch.equal(sizes, G.make_group_sizes(m_total, num_groups, dist, seed=7))  # deterministic


def test_make_group_sizes_shapes_of_each_distribution():
    M, num_groups = 16384, 16
    paper = [G.make_group_sizes(M, num_groups, "paper", seed=s) for s in range(4)]
    assert len({tuple(p.tolist()) for p in paper}) == 4  # the seed matters
    assert max(int(p.max()) for p in paper) < 4 * M // num_groups  # uniform on [0, 2M/G], rescaled

    bal = G.make_group_sizes(M + 5, num_groups, "balanced", seed=0)
    assert int(bal.max() - bal.min()) <= 1 and bal[:5].tolist() == [M // num_groups + 1] * 5

    one = G.make_group_sizes(M, num_groups, "one_group", seed=1)
    assert int((one > 0).sum()) == 1 and int(one.max()) == M

    skew = G.make_group_sizes(M, num_groups, "skewed", seed=2).sort(descending=True).values
    ratio = skew[0].item() / skew[1].item()
    assert 1.8 < ratio < 2.2  # Zipf 1/rank: the top group holds about twice the second

    empty = G.make_group_sizes(M, num_groups, "with_empty", seed=3)
    assert empty[0] == 0 and empty[-1] == 0 and int((empty == 0).sum()) >= 2 and int(empty.sum()) == M
    assert G.make_group_sizes(M, 2, "with_empty", seed=3).tolist() == [0, M]
    assert G.make_group_sizes(M, 1, "with_empty", seed=3).tolist() == [M]


@pytest.mark.parametrize(
    "args, match",
    [
        ((10, 4, "zipf"), r"unknown group-size distribution 'zipf'; choose one of paper, skewed, balanced"),
        ((-1, 4, "paper"), r"m_total must be >= 0, got -1"),
        ((10, 0, "paper"), r"num_groups must be >= 1, got 0"),
    ],
)
def test_make_group_sizes_errors(args, match):
    with pytest.raises(ValueError, match=match):
        G.make_group_sizes(*args)
