"""The M-grouped GEMM's tile schedulers on the CPU (tests/cpp/m_grouped_schedulers_main.cpp compiles the device
headers as plain C++): scheduler/m_grouped_scheduler.cuh (one CTA per tile) and scheduler/m_grouped_pair_scheduler.cuh
(2-CTA clusters, the build option MEGATRON_TMA_MG_CLUSTER). Every row of every group is computed once per column
block, by the same row tiles under both schedulers (so the cluster kernel gives the same bits), and the two CTAs of a
cluster share a weight tile only when both their row tiles lie in one group."""
import random
import subprocess

import pytest

PANEL = 8  # MEGATRON_TMA_MG_PANEL's default


@pytest.fixture(scope="module")
def schedule(cpp_driver):
    exe = cpp_driver("m_grouped_schedulers_main")

    def run(block_m, n_blocks, sizes):
        text = f"{block_m} {n_blocks} {len(sizes)} " + " ".join(map(str, sizes)) + "\n"
        lines = subprocess.run([exe], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
        head, n = lines[0].split()
        assert head == "single"
        single = [tuple(map(int, ln.split())) for ln in lines[1:1 + int(n)]]
        rest = lines[1 + int(n):]
        head, p = rest[0].split()
        assert head == "pairs", rest[0]
        pairs = [tuple(map(int, ln.split())) for ln in rest[1:1 + int(p)]]
        assert len(pairs) == int(p), rest[-1]
        return single, pairs

    return run


def expected_tiles(block_m, n_blocks, sizes):
    """{(group, row_start, rows, n_block)}: each group's rows cut into block_m-row tiles, never across groups."""
    tiles, start = set(), 0
    for g, s in enumerate(sizes):
        for r in range(start, start + s, block_m):
            for nb in range(n_blocks):
                tiles.add((g, r, min(block_m, start + s - r), nb))
        start += s
    return tiles


def check(schedule, block_m, n_blocks, sizes):
    single, pairs = schedule(block_m, n_blocks, sizes)
    want = expected_tiles(block_m, n_blocks, sizes)
    assert len(single) == len(want) and set(single) == want
    got = []
    row_tiles = sum(-(-s // block_m) for s in sizes)
    order = sorted({(g, r) for g, r, _, _ in want}, key=lambda t: t[1])  # row tiles in global order
    index = {t: i for i, t in enumerate(order)}
    assert len(pairs) == (row_tiles + 1) // 2 * n_blocks
    for shared, g0, rs0, r0, g1, rs1, r1, nb in pairs:
        assert r0 > 0, "rank 0 always holds a row tile"
        got.append((g0, rs0, r0, nb))
        if r1 > 0:
            got.append((g1, rs1, r1, nb))
            assert index[(g1, rs1)] == index[(g0, rs0)] + 1, "rank 1 takes the next row tile"
            assert index[(g0, rs0)] % 2 == 0, "pairs start on even row tiles"
        assert bool(shared) == (r1 > 0 and g0 == g1)
    assert len(got) == len(want) and set(got) == want, "every row tile once per column block"
    idle = sum(1 for p in pairs if p[6] == 0)
    assert idle == (n_blocks if row_tiles % 2 else 0), "rank 1 idles only in the last pair of an odd tile count"
    return pairs


@pytest.mark.parametrize("block_m", [128, 192])
def test_fixed_cases(schedule, block_m):
    for sizes in ([200, 0, 300], [1], [block_m], [block_m + 1], [0, 0, 5], [100, 100], [127, 128, 129, 0, 1],
                  [block_m * 3] * 4, [0]):
        for n_blocks in (1, 3, PANEL, PANEL + 3, 2 * PANEL + 1):
            if sum(sizes) == 0:
                single, pairs = schedule(block_m, n_blocks, sizes)
                assert single == [] and pairs == []
                continue
            check(schedule, block_m, n_blocks, sizes)


def test_pairs_across_a_group_boundary_load_their_own_weights(schedule):
    # two one-tile groups: one pair, two groups, no shared weight tile; both CTAs compute
    pairs = check(schedule, 128, 2, [100, 100])
    assert [(p[0], p[1], p[4]) for p in pairs] == [(0, 0, 1)] * 2
    # a group of three tiles then one of one: the second pair straddles the boundary
    pairs = check(schedule, 128, 1, [384, 50])
    assert [p[0] for p in pairs] == [1, 0]


@pytest.mark.parametrize("seed", range(12))
def test_random_groups(schedule, seed):
    rng = random.Random(seed)
    block_m = rng.choice([128, 192])
    G = rng.choice([1, 2, 3, 8, 33, 200])
    sizes = [rng.choice([0, 1, 127, 128, 129, 191, 192, 193, rng.randrange(0, 5000)]) for _ in range(G)]
    if sum(sizes) == 0:
        sizes[0] = 1
    check(schedule, block_m, rng.randrange(1, 3 * PANEL), sizes)
