"""The benchmarks' call schedules (benchmarks/common.py): the layer benchmark's blocks (every timed step follows a
step of the same method, every method gets its timed calls, the order rotates so that no method always runs first),
and the GEMM benchmarks' interleaved rounds (each method follows each other equally often)."""
import importlib.util
import os

import pytest
from _fake_timer import recording_timer

_spec = importlib.util.spec_from_file_location(
    "bench_common", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


@pytest.mark.parametrize("iters,warmup,rounds", [(25, 3, 5), (20, 1, 4), (7, 2, 3)])
def test_every_timed_call_follows_its_own_kind(iters, warmup, rounds):
    names = ["ours", "padded_path", "bf16"]
    seq = common.block_schedule(names, iters, warmup, rounds)
    for (prev, _), (name, timed) in zip(seq, seq[1:]):
        if timed:
            assert prev == name
    assert seq[0][1] is False  # a method's first call in a round is never timed
    timed = {n: sum(1 for m, t in seq if m == n and t) for n in names}
    assert all(v >= iters and v == timed["ours"] for v in timed.values())
    firsts = [seq[i][0] for i in range(0, len(seq), len(seq) // rounds)]
    assert len(set(firsts)) == min(rounds, len(names))  # the order rotates per round


@pytest.mark.parametrize("n", range(1, 14))
def test_carryover_balanced_orders(n):
    """A Williams design: every order a permutation, every item in every position equally often, and every ordered
    pair (a, b) of distinct items adjacent, b right after a, equally often (once for even n, twice for odd n)."""
    orders = common.carryover_balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    for pos in range(n):
        assert sorted(o[pos] for o in orders) == sorted(list(range(n)) * (len(orders) // n))
    follows = {}
    for o in orders:
        for a, b in zip(o, o[1:]):
            follows[a, b] = follows.get((a, b), 0) + 1
    want = 1 if n % 2 == 0 else 2
    assert follows == {(a, b): want for a in range(n) for b in range(n) if a != b}


def test_interleaved_schedule_balances_predecessors():
    """bench_interleaved's timed calls: `iters` rounds of one call per method; over a whole design every method's
    predecessor within a round is each other method equally often, where a rotation (the old schedule) always gave
    it the same one."""
    names = ["ours", "ours_m128", "padded_gemm", "deepgemm", "torch_rowwise", "bf16", "dense_cublas"]  # odd: 14 rounds
    seq = common.interleaved_schedule(names, 14)
    assert len(seq) == 14 * len(names)
    rounds = [seq[i:i + len(names)] for i in range(0, len(seq), len(names))]
    assert all(sorted(r) == sorted(names) for r in rounds)
    before_ours = [r[r.index("ours") - 1] for r in rounds if r[0] != "ours"]
    assert sorted(set(before_ours)) == sorted(set(names) - {"ours"})
    assert len(set(before_ours.count(m) for m in set(before_ours))) == 1
    assert len(common.interleaved_schedule(names, 25)) == 25 * len(names) and common.interleaved_schedule([], 5) == []


def test_bench_interleaved_times_in_the_schedules_order(monkeypatch):
    fns = {name: (lambda: None) for name in ("a", "b", "c", "d", "e")}
    timed = []
    monkeypatch.setattr(common, "_warm_up", lambda f, calls: ({}, dict(f)))
    monkeypatch.setattr(common, "_time_once", lambda fn, flush: timed.append(
        next(n for n, f in fns.items() if f is fn)) or float(len(timed)))
    result = common.bench_interleaved(fns, iters=10)
    assert timed == common.interleaved_schedule(list(fns), 10) and set(result) == set(fns)


def test_one_method_schedule():
    seq = common.block_schedule(["only"], iters=10, warmup=2, rounds=5)
    assert seq == ([("only", False)] * 2 + [("only", True)] * 2) * 5


# --------------------------------------------------------------------------------------------------------------
# benchmarks/bench_k_grouped.py: the layout bookkeeping, the roofline per output kind, the row schema and the
# summary's filters (pure Python; the GPU part of the benchmark cannot run here).
# --------------------------------------------------------------------------------------------------------------
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCH = os.path.join(_ROOT, "benchmarks")


def _load_bench_k_grouped():
    import sys
    if _BENCH not in sys.path:
        sys.path.insert(0, _BENCH)
    import bench_k_grouped
    return bench_k_grouped


bkg = _load_bench_k_grouped()

SIZE_CASES = [[0, 1, 127, 128, 129], [129, 0, 128, 1, 0, 127, 0], [1], [3, 0, 5], [128], [0, 0, 0, 129],
              [15, 16, 17, 31, 32, 33], [100, 0, 129, 27], [765, 4000, 2301, 1], [0]]


def _our_layout(sizes, k=3):
    """[k, P] int tensor laid out as the spec says, token t of group g holding (its global index + 1) * (row + 1)."""
    import torch
    m, g = sum(sizes), len(sizes)
    a = bkg.group_starts(sizes, bkg.WGRAD_ALIGN)
    qt = torch.zeros(k, bkg.wgrad_pitch(m, g), dtype=torch.int64)
    tok = 0
    for gi, s in enumerate(sizes):
        for t in range(s):
            qt[:, a[gi] + t] = (tok + 1) * torch.arange(1, k + 1)
            tok += 1
    return qt


@pytest.mark.parametrize("sizes", SIZE_CASES, ids=lambda s: "-".join(map(str, s)))
def test_k_grouped_layout_bookkeeping(sizes):
    import torch
    m, g = sum(sizes), len(sizes)
    p = bkg.wgrad_pitch(m, g)
    al = bkg.WGRAD_ALIGN
    assert p == -(-m // al) * al + al * g and p % al == 0
    a = bkg.group_starts(sizes, al)
    assert a[0] == 0 and all(x % al == 0 for x in a) and a[-1] <= p - g  # the tail always holds a zero column
    cols = bkg.token_columns(sizes)
    assert len(cols) == m and len(set(cols)) == m and max(cols, default=0) < p - 1
    ours = _our_layout(sizes)
    assert int((ours[:, cols] == 0).sum()) == 0 and int(ours.ne(0).sum()) == 3 * m  # zero outside the groups
    # the padded layout: every group round_up(M_g, 128) tokens; real tokens first, zero rows after
    psizes = bkg.padded_sizes(sizes)
    assert all(q % 128 == 0 and q - s < 128 for q, s in zip(psizes, sizes))
    idx = bkg.padded_column_index(sizes)
    assert len(idx) == bkg.wgrad_pitch(sum(psizes), g)
    expected = torch.zeros(3, len(idx), dtype=torch.int64)
    start, tok = 0, 0
    for s, q in zip(sizes, psizes):
        for t in range(s):
            expected[:, start + t] = (tok + 1) * torch.arange(1, 4)
            tok += 1
        start += q
    assert torch.equal(ours[:, torch.tensor(idx, dtype=torch.int64)], expected)
    # rows scattered into groups of dst_sizes: group g's tokens at the start of its destination group
    dest = bkg.scatter_rows(sizes, psizes)
    assert len(dest) == m and dest == [c for c, v in enumerate(expected[0].tolist()) if v]


def _quantize_columns(x, sizes):
    """The reference's wgrad column quantizer: contiguous [K, P], group g at columns a_g."""
    import torch
    from megatron_tma import reference as R
    return R.quantize_grouped_128x1(x, torch.tensor(sizes))


def test_k_grouped_gather_equals_quantizing_the_padded_input():
    """What the benchmark asserts on the GPU, on the CPU reference: our qt's columns gathered by
    padded_column_index are the quantizer's output on the zero-padded x with sizes round_up(M_g, 128)."""
    import torch
    gen = torch.Generator().manual_seed(7)
    sizes = [0, 1, 127, 128, 129, 17, 0, 300]
    m, k = sum(sizes), 32
    x = torch.randn(m, k, generator=gen).bfloat16()
    qt, s = _quantize_columns(x, sizes)
    psizes = bkg.padded_sizes(sizes)
    x_pad = torch.zeros(sum(psizes), k, dtype=x.dtype)
    x_pad[torch.tensor(bkg.scatter_rows(sizes, psizes))] = x
    rq, rs = _quantize_columns(x_pad, psizes)
    gathered = qt.view(torch.uint8)[:, torch.tensor(bkg.padded_column_index(sizes))]
    assert torch.equal(gathered, rq.view(torch.uint8))
    s_pad = torch.zeros_like(rs)
    s_pad[:s.shape[0]] = s
    assert torch.equal(s_pad, rs)
    outside = torch.ones(qt.shape[1], dtype=torch.bool)
    outside[torch.tensor(bkg.token_columns(sizes))] = False
    assert not bool(qt.view(torch.uint8)[:, outside].any())


CEIL = {"copy_tbps": 4.0, "dense_fp8_tflops": 1000.0}


def test_k_grouped_roofline_per_out_kind():
    G, M, N, K = 8, 16384, 4096, 4096
    operands = (N + K) * M + (M // 128 + G) * (N + K) * 4
    assert bkg.roofline_bytes(G, M, N, K, "bf16") == operands + 2 * G * N * K  # BF16 written
    assert bkg.roofline_bytes(G, M, N, K, "fp32_acc") == operands + 8 * G * N * K  # FP32 read + written
    compute = 2.0 * M * N * K / (CEIL["dense_fp8_tflops"] * 1e9)
    assert bkg.roofline_ms(G, M, N, K, "bf16", CEIL) == pytest.approx(max(compute, (operands + 2 * G * N * K) / 4e9))
    # small groups, FP32 accumulate: the output traffic bounds it
    G, M, N, K = 32, 8192, 4096, 7168
    assert bkg.roofline_ms(G, M, N, K, "fp32_acc", CEIL) == pytest.approx(bkg.roofline_bytes(G, M, N, K, "fp32_acc")
                                                                        / 4e9)
    with pytest.raises(KeyError):
        bkg.roofline_bytes(G, M, N, K, "fp16")


def test_k_grouped_timing_plan_and_call_count():
    from bench_m_grouped import DISTS, MORE, TABLE
    full = [(c, d) for c in TABLE + MORE for d in DISTS]
    plan = bkg.timing_plan(full)
    assert len(full) == 30 and len(plan) == 30
    shapes = {(M, N, K) for (G, M, N, K), _ in full}
    assert sum(n.count("dense_cublas@bf16") for n in plan) == len(shapes)  # once per (M, N, K)
    for names in plan:
        assert {n for n in names if not n.startswith("dense_cublas")} == {
            f"{m}@{k}" for k in bkg.OUT_KINDS for m in bkg.METHODS[k] + bkg.TILE_METHODS[k] if m != "dense_cublas"}
    assert bkg.timed_calls(full, 25) == 25 * (30 * 13 + len(shapes)) == 10000
    assert bkg.timed_calls([(c, "paper") for c in TABLE], 25) == 25 * 5 * 14


def _rows_of(G, M, results, bitexact=(True, True)):
    rows = {kind: {"G": G, "M": M, "N": 4096, "K": 4096, "dist": "paper", "out": kind, "tokens_per_group": M / G,
                   "roofline_ms": 1.0} for kind in bkg.OUT_KINDS}
    bkg.assign_timings(rows, results, flops=2.0 * M * 4096 * 4096)
    for kind, ok in zip(bkg.OUT_KINDS, bitexact):
        rows[kind]["bitexact"] = ok
    return [bkg.finish_row(rows[kind]) for kind in bkg.OUT_KINDS]


def test_k_grouped_row_schema():
    results = {"ours@bf16": 1.0, "padded_path@bf16": 2.0, "padded_gemm@bf16": 1.5, "torch_rowwise@bf16": 1.25,
               "bf16@bf16": 2.5, "dense_cublas@bf16": 0.5, "ours@fp32_acc": 2.0, "padded_path@fp32_acc": 3.0,
               "padded_gemm@fp32_acc": "RuntimeError: no", "bf16_fp32_acc@fp32_acc": 4.0}
    bf, fa = _rows_of(8, 16384, results)
    assert bf["out"] == "bf16" and fa["out"] == "fp32_acc"
    assert bf["ours_ms"] == 1.0 and bf["ours_over_roofline"] == 1.0 and fa["ours_over_roofline"] == 2.0
    assert bf["speedup_vs_bf16"] == 2.5 and bf["speedup_vs_torch_rowwise"] == 1.25
    assert bf["speedup_vs_padded_path"] == 2.0 and bf["speedup_vs_dense_cublas"] == 0.5
    assert fa["speedup_vs_padded_path"] == 1.5 and fa["speedup_vs_bf16_fp32_acc"] == 2.0
    assert fa["padded_gemm_error"] == "RuntimeError: no" and "speedup_vs_padded_gemm" not in fa
    # check-targets' torch-rowwise ratio reads every row that has torch_rowwise_ms, its bf16 ratio the BF16 rows
    assert not any(key in fa for key in ("torch_rowwise_ms", "bf16_ms", "speedup_vs_torch_rowwise",
                                         "speedup_vs_bf16"))
    assert bf["ours_tflops"] == pytest.approx(2.0 * 16384 * 4096 * 4096 / 1e9, rel=1e-3)


def _synthetic_run():
    rows = []
    # (G, M, ours bf16, ours fp32_acc): 2048 and 4096 tokens per group count as big groups, 512 not
    for G, M, o_bf, o_fa in ((8, 16384, 1.0, 1.2), (4, 16384, 1.25, 1.0), (32, 16384, 2.0, 4.0)):
        rows += _rows_of(G, M, {"ours@bf16": o_bf, "padded_path@bf16": 2.0, "padded_gemm@bf16": 1.5,
                                "torch_rowwise@bf16": 2.5, "bf16@bf16": 4.0, "ours@fp32_acc": o_fa,
                                "padded_path@fp32_acc": 3.0, "padded_gemm@fp32_acc": 2.0,
                                "bf16_fp32_acc@fp32_acc": 5.0})
    return rows


def test_k_grouped_summary_filters():
    import math
    rows = _synthetic_run()
    s = bkg.summarize(rows)
    assert s["max_ours_over_roofline_bf16"] == 2.0 and s["max_ours_over_roofline_fp32_acc"] == 4.0
    assert s["max_ours_over_roofline"] == 4.0
    big = [1.0, 1.2, 1.25, 1.0]  # the G=32, M=16384 rows (512 tokens per group) are left out
    assert s["geomean_ours_over_roofline_big_groups"] == pytest.approx(math.prod(big) ** 0.25, abs=1e-4)
    assert s["geomean_ours_over_roofline_big_groups_bf16"] == pytest.approx((1.0 * 1.25) ** 0.5, abs=1e-4)
    assert s["geomean_vs_torch_rowwise"] == pytest.approx((2.5 * 2.0 * 1.25) ** (1 / 3), abs=1e-4)
    assert s["min_vs_torch_rowwise"] == 1.25 and s["min_vs_bf16"] == 2.0
    assert s["geomean_vs_bf16"] == pytest.approx((4.0 * 3.2 * 2.0) ** (1 / 3), abs=1e-4)
    assert s["all_bitexact"] is True
    rows[3]["bitexact"] = False
    assert bkg.summarize(rows)["all_bitexact"] is False
    assert bkg.summarize([])["geomean_vs_bf16"] is None
    assert s["min_ours_vs_best_tile"] is None and s["all_tiles_bitexact"] is None  # no tile columns in these rows


def test_k_grouped_tile_columns():
    # the default (ours) against each forced tile: 192 rows faster on the first row, 128 on the second, where the
    # default took the slower tile (ours_vs_best_tile < 1)
    rows = []
    for ours, m128, m192 in ((0.9, 1.0, 0.9), (1.1, 1.0, 1.1)):
        rows += _rows_of(8, 16384, {"ours@bf16": ours, "ours_m128@bf16": m128, "ours_m192@bf16": m192,
                                    "ours@fp32_acc": 2.0, "ours_m128@fp32_acc": 2.0, "ours_m192@fp32_acc": 2.0})
    assert [r["ours_m192_vs_m128"] for r in rows] == [1.1111, 1.0, 0.9091, 1.0]
    assert [r["ours_vs_best_tile"] for r in rows] == [1.0, 1.0, 0.9091, 1.0]
    for r in rows:
        r["m128_bitexact"] = r["m192_bitexact"] = True
    s = bkg.summarize(rows)
    assert s["min_ours_vs_best_tile"] == 0.9091 and s["all_tiles_bitexact"] is True
    assert s["max_ours_vs_same_tile"] is None  # the rows do not say which tile the default took
    for r, bm in zip(rows, (192, 128, 128, 192)):  # the default's tile: ours against that very call forced
        r["ours_block_m"] = bm
        bkg.finish_row(r)
    assert [r["ours_vs_same_tile"] for r in rows] == [1.0, 1.0, 1.1, 1.0]
    assert bkg.summarize(rows)["max_ours_vs_same_tile"] == 1.1
    assert s["geomean_ours_m192_vs_m128_bf16"] == pytest.approx((1.1111 * 0.9091) ** 0.5, abs=1e-4)
    assert s["geomean_ours_m192_vs_m128_fp32_acc"] == 1.0
    rows[3]["m192_bitexact"] = False
    assert bkg.summarize(rows)["all_tiles_bitexact"] is False


def test_k_grouped_rows_read_by_check_targets(tmp_path, monkeypatch):
    """The project's targets checker (a Python script outside this repository, named by MEGATRON_TMA_CHECK_TARGETS)
    reads the same figures from the rows as summarize() writes."""
    import importlib.machinery
    import importlib.util
    import json
    path = os.environ.get("MEGATRON_TMA_CHECK_TARGETS", "")
    if not os.path.isfile(path):
        pytest.skip("MEGATRON_TMA_CHECK_TARGETS does not name the targets checker")
    loader = importlib.machinery.SourceFileLoader("check_targets_for_test", path)
    ct = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(ct)
    rows = _synthetic_run()
    s = bkg.summarize(rows)
    (tmp_path / "k.json").write_text(json.dumps({"benchmark": "k_grouped", "date": "2099", "rows": rows}))
    monkeypatch.chdir(tmp_path)
    fails = []
    figure = ct.check_k_grouped(fails)
    assert f"worst {s['max_ours_over_roofline']:.2f}x roofline" in figure
    assert f"(big groups {s['geomean_ours_over_roofline_big_groups']:.2f})" in figure
    assert f"x{s['geomean_vs_torch_rowwise']:.3f} vs torch rowwise" in figure
    assert f"x{s['geomean_vs_bf16']:.3f} vs bf16" in figure
    assert not any("bit-exact" in f for f in fails)


@pytest.mark.parametrize("dist", ["paper", "skewed"])
def test_k_grouped_run_config_dry_run_on_the_cpu(monkeypatch, dist):
    """run_config end to end on the CPU reference (tiny shape, timing faked: every method called once): the
    layout and padded-layout checks pass, both rows come out with their schema and bit-exact, dense_cublas is
    reused for the next distribution of the same shape."""
    calls = {}

    monkeypatch.setattr(bkg.common, "bench_interleaved", recording_timer(calls))
    configs = [((5, 700, 32, 48), dist), ((5, 700, 32, 48), "balanced")]
    plan = bkg.timing_plan(configs)
    cache = {}
    rows = []
    for i, (((G, M, N, K), d), names) in enumerate(zip(configs, plan)):
        rows += bkg.run_config(G, M, N, K, d, 2000 + i, 3, CEIL, names, cache, dev="cpu")
    assert [r["out"] for r in rows] == ["bf16", "fp32_acc"] * 2
    assert calls["dense_cublas@bf16"] == 1 and (700, 32, 48) in cache
    for r in rows:
        assert r["bitexact"] is True, r
        assert r["tokens_per_group"] == 140 and r["roofline_ms"] > 0 and r["ours_over_roofline"] > 0
        assert "speedup_vs_padded_path" in r and "speedup_vs_padded_gemm" in r
        assert r["m128_bitexact"] is True and r["m192_bitexact"] is True
        assert r["ours_m128_ms"] > 0 and r["ours_m192_ms"] > 0 and r["ours_m192_vs_m128"] > 0
        assert r["ours_vs_best_tile"] == round(min(r["ours_m128_ms"], r["ours_m192_ms"]) / r["ours_ms"], 4)
        if r["out"] == "bf16":
            assert "bf16_ms" in r and "speedup_vs_bf16" in r and "dense_cublas_ms" in r
            assert "torch_rowwise_ms" in r or "torch_rowwise_error" in r  # no _scaled_grouped_mm on the CPU
        else:
            assert "bf16_fp32_acc_ms" in r and not any(k.startswith(("torch_rowwise", "bf16_ms", "speedup_vs_bf16_"))
                                                       and k != "speedup_vs_bf16_fp32_acc" for k in r)
    assert rows[2]["dense_cublas_ms"] == rows[0]["dense_cublas_ms"]


def test_k_grouped_layout_check_catches_a_bad_quantizer(monkeypatch):
    """The benchmark refuses operands with a non-zero byte outside the groups' columns."""
    import torch
    good = bkg.quant.quantize_grouped_128x1

    def dirty(x, groups, *a, **kw):
        qt, s = good(x, groups, *a, **kw)
        qt = qt.clone()
        qt.view(torch.uint8)[:, -1] = 1  # the last column is always outside the groups
        return qt, s

    monkeypatch.setattr(bkg.quant, "quantize_grouped_128x1", dirty)
    with pytest.raises(AssertionError, match="outside the groups"):
        bkg.run_config(4, 300, 32, 32, "paper", 1, 3, CEIL, bkg.timing_plan([((4, 300, 32, 32), "paper")])[0], {},
                       dev="cpu")


def test_m_grouped_same_tile_ratio_reads_the_rotation_bias_off_a_results_file():
    """bench_m_grouped's schedule check: `ours` against the identical call forced to the default's tile. On the grid
    timed with the old rotated rounds (where `ours` always followed `dense_cublas`) it reads what benchmarks/NOTES.md
    quotes: median x1.007, up to x1.090."""
    import json

    from bench_m_grouped import same_tile_ratio, schedule_summary
    with open(os.path.join(_ROOT, "benchmarks", "results", "m_grouped-20261203-1749.json")) as f:
        rows = json.load(f)["rows"]
    for row in rows:
        row["ours_vs_same_tile"] = same_tile_ratio(row)
    assert all(r["ours_vs_same_tile"] is not None for r in rows) and len(rows) == 30
    summary = schedule_summary(rows)
    assert round(summary["median_ours_vs_same_tile"], 3) == 1.007 and round(summary["max_ours_vs_same_tile"], 2) == 1.09
    assert same_tile_ratio({"ours_tile": "192x128", "ours_ms": 1.0}) is None  # no twin timed: no ratio
    assert schedule_summary([{}]) == {"median_ours_vs_same_tile": None, "max_ours_vs_same_tile": None}


# --------------------------------------------------------------------------------------------------------------
# What the results name: the GPU in the plot titles, and the quoted Transformer Engine numbers only beside the GPU
# they were measured on (an H100 run once divided its own times into the H200's quoted ones).
def test_gpu_label_names_the_gpu_the_run_saw(monkeypatch):
    import torch
    for name, label in [("NVIDIA H100 80GB HBM3", "H100 80GB HBM3"), ("NVIDIA H200", "H200"), ("Other GPU", "Other GPU")]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert common.gpu_label() == label


def test_plot_titles_take_the_gpu_from_the_run():
    for name in ("bench_m_grouped", "bench_k_grouped", "bench_mlp_layer", "bench_quant"):
        src = open(os.path.join(_BENCH, name + ".py")).read()
        titles = [line for line in src.splitlines() if "set_title(" in line]
        assert titles and all("gpu_label()" in t for t in titles), (name, titles)
        assert "H200" not in "".join(titles) and "H100" not in "".join(titles)


def test_quoted_te_numbers_pair_only_with_an_h200():
    import bench_mlp_layer
    assert bench_mlp_layer.te_reported_comparable("NVIDIA H200")
    assert not bench_mlp_layer.te_reported_comparable("NVIDIA H100 80GB HBM3")
    assert not bench_mlp_layer.te_reported_comparable("NVIDIA H100 PCIe")


def _small_layer_inputs(seed):
    """(G, H, F, sizes, x, probs, dy) of a small expert-MLP step for bench_mlp_layer's steps on the CPU (x and probs
    are leaves that want gradients; an empty group among them)."""
    import torch

    g, h, f = 4, 256, 128
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, h, generator=gen).bfloat16().requires_grad_()
    probs = torch.rand(128, generator=gen).requires_grad_()
    dy = torch.randn(128, h, generator=gen).bfloat16()
    return g, h, f, torch.tensor([40, 0, 70, 18]), x, probs, dy


def test_the_optimizer_write_runs_in_every_twins_step():
    """bench_mlp_layer --optimizer-write / --release-bf16-weights on the CPU's reference kernels: each step starts with
    the write of the weights from FP32 masters in every method (a master changed between steps reaches every twin's
    next step), the released FP8 layer gets its copies from the masters with its BF16 memory kept freed (the layer's
    bytes count none of it), and its step gives the plain FP8 layer's bits."""
    import torch

    import bench_mlp_layer as bml
    from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP

    g, h, f, sizes, x, probs, dy = _small_layer_inputs(seed=0)
    plain = GroupedFP8MLP(g, h, f, backend="reference")
    released = GroupedFP8MLP(g, h, f, backend="reference", release_bf16_weights=True)
    bf16 = GroupedBF16MLP(g, h, f)
    released.load_state_dict(plain.state_dict())
    bf16.load_state_dict(plain.state_dict())
    steps = [bml.Step(m, x, sizes, probs, dy, True, optimizer_write=True) for m in (plain, released, bf16)]
    for round in range(2):
        results = [[t.clone() for t in s.results()] for s in steps]
        assert all(torch.equal(u, v) for u, v in zip(results[0], results[1])), round
        assert [p.untyped_storage().nbytes() for p in released.parameters()] == [0, 0]
        plain_bytes, released_bytes = steps[0].resident_bytes(), steps[1].resident_bytes()
        weight_bytes = sum(p.numel() * 2 for p in plain.parameters())
        assert plain_bytes - released_bytes == weight_bytes  # after reset: no FP8 copies, BF16 only in the plain one
        for s in steps:  # an optimizer's update of the masters, seen by each method's next step
            for m in s.masters:
                m.mul_(0.5)
    steps[2].reset()
    assert torch.equal(bf16.linear_fc1.weight, steps[2].masters[0].bfloat16())


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_handed_step_of_the_layer_peak_is_the_same_step(micro_batches):
    """The layer peak's step (`handed=True`: x made by an op before the layer, y consumed by one after it, dY made by
    autograd) computes what the timed step does, bit for bit, for every twin (CPU reference kernels); only who holds
    x, y and dY differs: by the backward's start no name holds y, and x's copy only where the layer saved it."""
    import weakref

    import torch

    import bench_mlp_layer as bml
    from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP

    g, h, f, sizes, x, probs, dy = _small_layer_inputs(seed=1)
    for module in (GroupedFP8MLP(g, h, f, backend="reference"), GroupedBF16MLP(g, h, f)):
        step = (bml.Step(module, x, sizes, probs, dy, True) if micro_batches == 1 else
                bml.AccumulatingStep(module, x, sizes, probs, dy, True, micro_batches))
        grads = [lambda: x.grad, lambda: probs.grad] + [
            (lambda w=w: w.main_grad if micro_batches > 1 else w.grad) for w in module.parameters()]
        step()
        plain = [t().clone() for t in grads]
        step(handed=True)
        assert all(torch.equal(u, t()) for u, t in zip(plain, grads)), type(module).__name__
        for w in module.parameters():
            if micro_batches > 1:
                del w.main_grad
    # what the handed step leaves alive: at the backward's start, the BF16 layer still keeps x's copy (its GEMM's
    # saved input), ours does not; y is gone for both (the op after read it and no name holds it)
    seen = {}
    real_in, real_back = bml._HandedInput.forward, bml._ConsumedOutput.backward

    def handed_in(ctx, t):
        seen["x"] = weakref.ref(out := real_in(ctx, t))
        return out

    def consumed_backward(ctx, grad):
        seen["alive"] = (seen["x"]() is not None, seen["y"]() is not None)
        return real_back(ctx, grad)

    def watched(module):  # the layer's output as its caller gets it
        forward = module.forward

        def run(*args, **kwargs):
            result = forward(*args, **kwargs)
            seen["y"] = weakref.ref(result[0])
            return result
        module.forward = run
        return module

    for module, keeps_x in ((watched(GroupedFP8MLP(g, h, f, backend="reference")), False),
                            (watched(GroupedBF16MLP(g, h, f)), True)):
        bml._HandedInput.forward = staticmethod(handed_in)
        bml._ConsumedOutput.backward = staticmethod(consumed_backward)
        try:
            bml.Step(module, x, sizes, probs, dy, True)(handed=True)
        finally:
            bml._HandedInput.forward = staticmethod(real_in)
            bml._ConsumedOutput.backward = staticmethod(real_back)
        assert seen["alive"] == (keeps_x, False), type(module).__name__


def test_the_layer_peak_counts_no_copy_a_requantizing_cache_drops(monkeypatch):
    """`peak_mb`'s resident part is taken after the step's reset: a layer that re-quantizes every step holds its
    parameters between steps, not the copies its cache kept from the step timed before (those are made, and counted,
    inside the step). The allocator's counters are stubbed to 0 here (CPU), leaving the resident part alone."""
    import torch

    import bench_mlp_layer as bml
    from megatron_tma.mlp import GroupedFP8MLP

    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    g, h, f, sizes, x, probs, dy = _small_layer_inputs(seed=2)
    module = GroupedFP8MLP(g, h, f, backend="reference")
    step = bml.Step(module, x, sizes, probs, dy, True)
    step()  # (the cache now holds this step's copies, as after the timed blocks)
    layer_mb, step_mb = step.peak_mb()
    assert layer_mb * 2**20 == sum(p.numel() * 2 for p in module.parameters()) and step_mb == 0


def test_layer_rows_that_did_not_fit_are_listed_not_averaged():
    """A grid row that ran out of GPU memory is recorded with its error: the summary lists it under rows_not_run and
    takes its ratios, bits and peaks from the rows that ran only (an empty list when every row ran)."""
    import bench_mlp_layer as bml

    ran = {"model": "qwen3_30b_a3b", "G": 32, "M": 32768, "dist": "paper", "pad_rows_pct": 1.0, "bitexact": True,
           "speedup_vs_padded_path": 1.2, "speedup_vs_bf16": 1.1, "ours_peak_mb": 9.0, "padded_path_peak_mb": 11.0,
           "bf16_peak_mb": 10.0}
    failed = {"model": "deepseek_v3", "G": 32, "M": 32768, "dist": "skewed", "seed": 2019,
              "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB."}
    s = bml.summarize([ran, failed])
    assert s["rows_not_run"] == ["deepseek_v3 G=32 M=32768 skewed: OutOfMemoryError: CUDA out of memory. Tried to "
                                 "allocate 896.00 MiB."]
    assert s["all_bitexact"] is True and s["geomean_vs_bf16_m32768"] == 1.1 and s["max_peak_vs_bf16"] == 0.9
    assert bml.summarize([ran])["rows_not_run"] == []
    assert bml.summarize([dict(ran, bitexact=False), failed])["all_bitexact"] is False
    # no row ran: nothing is called bit-exact
    assert bml.summarize([failed]) == {"rows_not_run": s["rows_not_run"], "all_bitexact": None}


def test_the_layer_table_prints_a_row_that_did_not_run(capsys):
    """The printed table (after the JSON and the plot) shows a row that ran out of memory as not run, with its
    error, and every row that ran as before (it read every row's bits and padding, and stopped the script there)."""
    import bench_mlp_layer as bml

    ran = {"model": "qwen3_30b_a3b", "G": 32, "M": 32768, "dist": "paper", "pad_rows_pct": 1.0, "bitexact": True,
           "ours_ms": 1.5, "graph_bitexact": True}
    failed = {"model": "deepseek_v3", "G": 32, "M": 32768, "dist": "skewed", "seed": 2019,
              "error": "OutOfMemoryError: CUDA out of memory."}
    bml.print_table([ran, failed], bml.summarize([ran, failed]))
    out = capsys.readouterr().out
    assert "deepseek_v3  32  32768 skewed not run: OutOfMemoryError: CUDA out of memory." in out
    assert out.count("qwen3_30b_a3b") == 2 and out.count("deepseek_v3") == 2  # the table, the graphed table; summary
