"""The K-grouped GEMM's default tile rows (csrc/include/megatron_tma/scheduler/k_grouped_tile_choice.h), checked on
the CPU: the header is plain C++, compiled here with the host compiler into a small driver
(tests/cpp/k_grouped_tile_choice_main.cpp). The expected tiles on the benchmark grid are the measured ones of the
grid at 92cd967 (benchmarks/results/k_grouped-20261203-1954.json: ours (128 rows) and ours_m192 on every row)."""
import itertools
import random
import subprocess

import pytest

H200_SMS = 132
MAX_GROUPS_192 = 975  # KGroupedGemmConfig<*, 3>::kTileMaxGroups (tests/test_k_grouped_tiles_gpu.py checks 975 / 976)


@pytest.fixture(scope="module")
def choose(cpp_driver):
    exe = cpp_driver("k_grouped_tile_choice_main")

    def run(cases):
        """[(n, k, num_groups, out_bf16)] or [(block_m, n, k, num_groups, out_bf16, num_sms, max_groups_192)]
        -> [block_m chosen]"""
        full = [c if len(c) == 7 else (0, *c, H200_SMS, MAX_GROUPS_192) for c in cases]
        text = "".join(" ".join(str(int(v)) for v in c) + "\n" for c in full)
        out = subprocess.run([exe], input=text, capture_output=True, text=True, check=True).stdout.split()
        assert len(out) == len(cases)
        return [int(v) for v in out]

    return run


# (G, N, K) of the grid (M does not enter the choice): 192 rows measured faster on every row of both output kinds
# (BF16 out x1.08-1.16) except three FP32-accumulate rows of G=32, N=3072, K=8192 (groups of 512 tokens), where
# the main_grad read and write dominate and the two tiles are within 1.5% either way (x0.985-1.015).
GRID = [(8, 4096, 4096), (16, 7168, 4096), (32, 3072, 8192), (8, 6144, 5120), (32, 4096, 7168), (4, 3072, 3072),
        (4, 8192, 8192), (16, 5120, 6144), (32, 4096, 7168), (8, 3072, 6144)]


def test_grid_rows_take_the_192_row_tile(choose):
    cases = [(n, k, g, bf16) for g, n, k in GRID for bf16 in (True, False)]
    for case, bm in zip(cases, choose(cases)):
        assert bm == 192, f"(N, K, G, bf16) = {case}: chose {bm}, the grid measured 192 rows faster"


def tiles(n, k, g, block_m):
    return g * -(-n // block_m) * -(-k // 128)


def test_one_round_of_tiles_takes_128_rows(choose):
    # One round of 192-row tiles is slower than one round of 128-row tiles: each CTA runs one tile.
    cases = [(n, k, g, bf16) for n, k, g in [(128, 128, 1), (256, 2048, 4), (1024, 1024, 2), (4096, 512, 1),
                                             (768, 2048, 2), (2048, 7168, 1)] for bf16 in (True, False)]
    cases = [c for c in cases if tiles(*c[:3], 128) <= H200_SMS]
    assert len(cases) >= 8
    assert choose(cases) == [128] * len(cases)


def test_192_rows_only_past_one_round_and_when_cheaper(choose):
    rng = random.Random(4321)
    cases = []
    for _ in range(500):
        cases.append((0, 16 * rng.randrange(1, 640), 16 * rng.randrange(1, 640), rng.choice([1, 2, 4, 8, 32, 128, 256]),
                      rng.random() < 0.5, rng.choice([78, 114, 132]), MAX_GROUPS_192))
    chose = choose(cases)
    assert 128 in chose and 192 in chose
    for (_, n, k, g, bf16, sms, _), bm in zip(cases, chose):
        assert bm in (128, 192)
        rounds = {b: -(-tiles(n, k, g, b) // sms) for b in (128, 192)}
        rate = 1.13 if bf16 else 1.05
        cheaper_192 = rounds[192] * 192 / rate < rounds[128] * 128
        assert bm == (192 if cheaper_192 else 128), (n, k, g, bf16, sms, rounds)
        if bm == 192:
            assert tiles(n, k, g, 128) > sms


def test_forced_rows_and_the_shared_memory_limit(choose):
    big = (8192, 8192, 8)
    assert choose([(128, *big, 1, H200_SMS, MAX_GROUPS_192), (192, 128, 128, 1, 1, H200_SMS, MAX_GROUPS_192),
                   (0, 384, 128, 975, 0, H200_SMS, MAX_GROUPS_192), (0, 384, 128, 976, 0, H200_SMS, MAX_GROUPS_192),
                   (192, 256, 128, 976, 1, H200_SMS, MAX_GROUPS_192)]) == [128, 192, 192, 128, 128]


def test_layer_shapes(choose):
    # The expert MLP's wgrads (fc1: N = 2 ffn, K = hidden; fc2: N = hidden, K = ffn) on the benchmark's models.
    models = {"deepseek_v3_g8": (8, 7168, 2048), "deepseek_v3_g32": (32, 7168, 2048),
              "mixtral": (8, 4096, 14336), "qwen3_g128": (128, 2048, 768)}
    for name, (g, h, f) in models.items():
        got = choose([(n, k, g, bf16) for n, k in ((2 * f, h), (h, f)) for bf16 in (True, False)])
        assert got == [192] * 4, (name, got)


def test_each_choice_depends_only_on_its_own_case(choose):
    """The driver answers a batch of cases: no state may leak from one case to the next (the batch reversed gives
    the answers reversed; the first and last case alone give their batch answers)."""
    cases = [(n, k, g, bf16) for n, k, g, bf16 in itertools.product((256, 1024, 4096), (128, 2048, 7168), (1, 8, 128),
                                                                    (True, False))]
    got = choose(cases)
    assert choose(cases[::-1]) == got[::-1]
    assert choose(cases[:1]) + choose(cases[-1:]) == [got[0], got[-1]]
