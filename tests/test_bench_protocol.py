"""The layer benchmark's block schedule (benchmarks/common.py): every timed step follows a step of the same method,
every method gets its timed calls, and the order rotates so that no method always runs first."""
import importlib.util
import os

import pytest

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


def test_one_method_schedule():
    seq = common.block_schedule(["only"], iters=10, warmup=2, rounds=5)
    assert seq == ([("only", False)] * 2 + [("only", True)] * 2) * 5
