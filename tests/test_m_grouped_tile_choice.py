"""The M-grouped GEMM's default tile (csrc/include/megatron_tma/scheduler/m_grouped_tile_choice.h), checked on the
CPU: the header is plain C++, compiled here with the host compiler into a small driver
(tests/cpp/m_grouped_tile_choice_main.cpp). The expected tiles on the paper's grid are the measured winners of
the grid at 05067f9 (benchmarks/results/m_grouped-20261129-1918.json, in git history; ours_m128 / ours_m192 /
ours_bn192)."""
import itertools
import random
import subprocess

import pytest

H200_SMS = 132


@pytest.fixture(scope="module")
def choose(cpp_driver):
    exe = cpp_driver("m_grouped_tile_choice_main")

    def run(cases):
        """[(m_total, n, num_groups, num_sms)] -> [(block_m, block_n)]"""
        text = "".join(f"{m} {n} {g} {s}\n" for m, n, g, s in cases)
        out = subprocess.run([exe], input=text, capture_output=True, text=True, check=True).stdout.split()
        return [(int(out[2 * i]), int(out[2 * i + 1])) for i in range(len(cases))]

    return run


# (G, M, N): the measured winner on the paper's grid (all three distributions unless noted).
GRID_WINNERS = [
    ((8, 16384, 4096), (192, 128)),    # m192 x1.04-1.07 over 128 x 128, 128 x 192 x1.03-1.05
    ((16, 32768, 7168), (192, 128)),   # x1.06-1.10 vs x1.05-1.06
    ((8, 65536, 6144), (192, 128)),
    ((4, 32768, 8192), (192, 128)),
    ((32, 65536, 4096), (192, 128)),
    ((8, 32768, 3072), (192, 128)),
    ((32, 16384, 3072), (128, 192)),   # groups of 512: 128 x 192 x1.06-1.12, 192 x 128 down to x0.96
    ((16, 16384, 5120), (128, 192)),   # groups of 1024: 128 x 192 x1.04-1.07, 192 x 128 down to x0.95
    ((32, 8192, 4096), (128, 192)),    # groups of 256: 128 x 192 x1.03-1.05, 192 x 128 down to x0.83
    ((4, 8192, 3072), (128, 192)),     # 8 rounds of 128 x 192 tiles against 7.6 of 192 x 128: x1.06-1.09 vs 0.96-1.07
]


def test_grid_rows_get_the_measured_winner(choose):
    got = choose([(m, n, g, H200_SMS) for (g, m, n), _ in GRID_WINNERS])
    for ((g, m, n), want), tile in zip(GRID_WINNERS, got):
        assert tile == want, f"G={g} M={m} N={n}: chose {tile}, the grid measured {want} fastest"


def expected_tiles(m, n, g, block_m, block_n):
    return (m / block_m + g / 2) * -(-n // block_n)


def test_less_than_one_round_of_tiles_takes_the_smallest_tile(choose):
    # One round of bigger tiles is slower than one round of 128 x 128 tiles: each CTA runs one tile.
    cases = [(m, n, g, s) for m, n, g in [(0, 768, 1), (1, 128, 1), (64, 768, 1), (256, 2048, 8), (1024, 1408, 8),
                                          (2048, 4096, 2), (512, 7168, 4)] for s in (66, 132)]
    cases = [c for c in cases if expected_tiles(*c[:3], 128, 128) <= c[3]]
    assert len(cases) >= 8
    for case, tile in zip(cases, choose(cases)):
        assert tile == (128, 128), (case, tile)


def test_192_row_tiles_only_for_large_groups(choose):
    rng = random.Random(1234)
    cases = []
    for _ in range(400):
        g = rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256])
        cases.append((rng.randrange(0, 1 << 17), 16 * rng.randrange(1, 1024), g, rng.choice([78, 114, 132])))
    for (m, n, g, sms), (bm, bn) in zip(cases, choose(cases)):
        assert (bm, bn) in ((128, 128), (128, 192), (192, 128)), (m, n, g, sms, bm, bn)
        if bm == 192:
            assert m >= 2048 * g, f"192-row tiles for groups averaging {m // g} rows (M={m} G={g})"


def test_wider_tiles_need_columns_that_fill_them(choose):
    # N = 640: 4 column blocks of 192 cover 768 columns (20% wasted), 5 blocks of 128 waste none, and the
    # 8% faster tile does not pay for that. N = 768 fills 4 blocks of 192 exactly.
    assert choose([(65536, 640, 64, H200_SMS), (65536, 768, 64, H200_SMS)]) == [(128, 128), (128, 192)]


def test_layer_shapes(choose):
    # The expert MLP's GEMMs (forward fc1/fc2, dgrad fc2/fc1) on the benchmark's models at M = 32768.
    models = {"deepseek_v3_g8": (8, 7168, 2048), "deepseek_v3_g32": (32, 7168, 2048),
              "mixtral": (8, 4096, 14336), "qwen3_g128": (128, 2048, 768)}
    m = 32768
    for name, (g, h, f) in models.items():
        tiles = choose([(m, n, g, H200_SMS) for n in (2 * f, h, f, h)])
        if m >= 2048 * g:
            assert all(t[0] == 192 or t == (128, 192) for t in tiles), (name, tiles)
        else:
            assert all(t == (128, 192) for t in tiles), (name, tiles)


def test_each_choice_depends_only_on_its_own_case(choose):
    """The driver answers a batch of cases: no state may leak from one case to the next (the batch reversed gives
    the answers reversed; the first and last case alone give their batch answers)."""
    cases = [(m, n, g, s) for m, n, g, s in itertools.product((128, 1024, 8192, 65536), (768, 4096), (1, 8, 128),
                                                                (66, 132))]
    got = choose(cases)
    assert choose(cases[::-1]) == got[::-1]
    assert choose(cases[:1]) + choose(cases[-1:]) == [got[0], got[-1]]
