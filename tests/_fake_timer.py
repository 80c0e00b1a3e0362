"""A stand-in for benchmarks/common.bench_interleaved in the benchmarks' CPU dry runs (``from _fake_timer import
recording_timer``): every method is called once instead of timed, and gets a made-up time, or, like the real
timer's warm-up, the text of the exception it raised."""


def recording_timer(calls: dict):
    """bench_interleaved's signature; counts each method's calls in `calls` (name -> count)."""

    def fake_bench(fns, iters=25, warmup=5):
        out = {}
        for i, (name, fn) in enumerate(fns.items()):
            try:
                fn()
                out[name] = 1.0 + 0.5 * i
            except Exception as e:  # noqa: BLE001 - as common._warm_up: a baseline that cannot run is recorded
                out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            calls[name] = calls.get(name, 0) + 1
        return out

    return fake_bench
