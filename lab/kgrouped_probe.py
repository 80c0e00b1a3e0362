"""Lab probe (not part of the product): the K-grouped kernel on the 128-aligned wgrad layout, driven through the op
directly with operands built in torch (independent of the quantizers and the reference). Checks bits against the
128-padded layout (same op), FP32 / BF16 / accumulate, an element-offset main_grad, an fp64 accuracy check, then
times the kernel against a dense FP8 cuBLAS GEMM of the same FLOPs (ratios in one run).

    python lab/kgrouped_probe.py [--time] [--shapes G:M:N:K,...]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import common  # noqa: E402

from megatron_tma import _ext  # noqa: E402
from megatron_tma.groups import make_group_sizes  # noqa: E402

FP8 = torch.float8_e4m3fn
DISTS = ("balanced", "paper")
OP = None


def layout(sizes, align):
    """Column start of each group (groups start on `align`-token boundaries) and the total width P."""
    starts, a = [], 0
    for s in sizes:
        starts.append(a)
        a += -(-s // align) * align
    return starts, a


def operands(sizes, rows, gen, starts, P, MB):
    """Token-contiguous FP8 [rows, P] with each group's columns filled (zeros elsewhere) and [MB, rows] scales."""
    dev = "cuda"
    q = torch.zeros(rows, P, dtype=torch.uint8, device=dev)
    data = (torch.randn(rows, sum(sizes), generator=gen, device=dev) * 100).clamp(-448, 448).to(FP8).view(torch.uint8)
    o = 0
    for s, a in zip(sizes, starts):
        q[:, a:a + s] = data[:, o:o + s]
        o += s
    nb = sum(-(-s // 128) for s in sizes)
    sc = torch.zeros(MB, rows, device=dev)
    sc[:nb] = torch.rand(nb, rows, generator=gen, device=dev) * 0.01 + 1e-4
    return q.view(FP8), sc


def regather(q, sizes, starts_from, starts_to, P_to):
    out = torch.zeros(q.shape[0], P_to, dtype=torch.uint8, device=q.device)
    for s, a, b in zip(sizes, starts_from, starts_to):
        out[:, b:b + s] = q.view(torch.uint8)[:, a:a + s]
    return out.view(FP8)


def bits_equal(x, y):
    """Bit-for-bit equality (NaN payloads included)."""
    iv = {4: torch.int32, 2: torch.int16}[x.element_size()]
    return torch.equal(x.contiguous().view(iv), y.contiguous().view(iv))


def case(sizes, N, K, seed=0, check64=False):
    G, M = len(sizes), sum(sizes)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    MB = M // 128 + G
    s16, _ = layout(sizes, 128)  # the group starts of the operands (docs/design.md §4: 128-token starts)
    P = -(-M // 128) * 128 + 128 * G
    dy, dys = operands(sizes, N, gen, s16, P, MB)
    x, xs = operands(sizes, K, gen, s16, P, MB)
    s128, P128 = layout(sizes, 128)
    Mp = P128
    Pp = Mp + 128 * G
    MBp = Mp // 128 + G
    dyp, xp = regather(dy, sizes, s16, s128, Pp), regather(x, sizes, s16, s128, Pp)
    dysp = torch.zeros(MBp, N, device="cuda"); dysp[:MB] = dys
    xsp = torch.zeros(MBp, K, device="cuda"); xsp[:MB] = xs
    g = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    gp = torch.tensor([-(-s // 128) * 128 for s in sizes], dtype=torch.int32, device="cuda")
    res = {}
    for name, dt, acc in (("f32", torch.float32, False), ("bf16", torch.bfloat16, False), ("acc", torch.float32, True)):
        c0 = torch.randn(G, N, K, device="cuda")
        o1 = c0.clone() if acc else torch.full((G, N, K), float("nan"), device="cuda").to(dt)
        o2 = c0.clone() if acc else torch.full((G, N, K), float("nan"), device="cuda").to(dt)
        OP(dy, dys, x, xs, g, o1, acc)
        OP(dyp, dysp, xp, xsp, gp, o2, acc)
        res[name] = bits_equal(o1, o2)
        if not res[name]:
            d = (o1.float() - o2.float()).abs()
            res[name + "_maxdiff"] = float(d.nan_to_num(1e30).max())
    # element-offset (4-byte) main_grad: the register epilogue, same bits
    buf = torch.randn(G * N * K + 1, device="cuda")
    view = buf[1:].view(G, N, K)
    ref = view.clone()
    OP(dy, dys, x, xs, g, view, True)
    OP(dyp, dysp, xp, xsp, gp, ref, True)
    res["acc_offset4"] = bits_equal(view, ref)
    # offsets instead of sizes, int64
    offs = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0).tolist()), dtype=torch.int64, device="cuda")
    o3 = torch.empty(G, N, K, device="cuda")
    OP(dy, dys, x, xs, offs, o3, False)
    o4 = torch.empty(G, N, K, device="cuda")
    OP(dy, dys, x, xs, g, o4, False)
    res["offsets"] = bits_equal(o3, o4)
    if check64:
        o = torch.empty(G, N, K, device="cuda")
        OP(dy, dys, x, xs, g, o, False)
        bi = 0
        worst = 0.0
        for gi, (s, a) in enumerate(zip(sizes, s16)):
            r = torch.zeros(N, K, dtype=torch.float64, device="cuda")
            for t0 in range(0, s, 128):
                t1 = min(s, t0 + 128)
                A = dy[:, a + t0:a + t1].double() * dys[bi].double()[:, None]
                B = x[:, a + t0:a + t1].double() * xs[bi].double()[:, None]
                r += A @ B.t()
                bi += 1
            if s:
                y = o[gi].double()
                dd = 1 - 2 * (y * r).sum() / ((y * y).sum() + (r * r).sum())
                worst = float("nan") if dd != dd else max(worst, float(dd))
            else:
                worst = max(worst, float(o[gi].abs().max()))
            if worst != worst:
                break
        res["diff64_worst"] = worst
    return res


def timing(shapes, iters):
    ceil = common.measure_ceilings()
    print("ceilings", ceil, flush=True)
    for (G, M0, N, K) in shapes:
        for dist in DISTS:
            if dist.startswith("each"):  # every group the same given size, e.g. each2040
                sizes = [int(dist[4:])] * G
            else:
                sizes = make_group_sizes(M0, G, dist, 7).tolist()
            M = sum(sizes)
            gen = torch.Generator(device="cuda").manual_seed(1)
            MB = M // 128 + G
            s16, _ = layout(sizes, 128)
            P = -(-M // 128) * 128 + 128 * G
            dy, dys = operands(sizes, N, gen, s16, P, MB)
            x, xs = operands(sizes, K, gen, s16, P, MB)
            g = torch.tensor(sizes, dtype=torch.int32, device="cuda")
            mg = torch.zeros(G, N, K, device="cuda")
            ob = torch.empty(G, N, K, device="cuda", dtype=torch.bfloat16)
            a_d = torch.randn(N, M, device="cuda").to(FP8)
            b_d = torch.randn(K, M, device="cuda").to(FP8).t()
            one = torch.ones((), device="cuda")
            fns = {"acc": lambda: OP(dy, dys, x, xs, g, mg, True),
                   "bf16": lambda: OP(dy, dys, x, xs, g, ob, False),
                   "dense": lambda: torch._scaled_mm(a_d, b_d, one, one, out_dtype=torch.bfloat16)}
            t = common.bench_interleaved(fns, iters=iters)
            fl = 2.0 * M * N * K
            roof_f = fl / (ceil["dense_fp8_tflops"] * 1e9)
            byt_acc = (N + K) * M + MB * (N + K) * 4 + 8 * G * N * K
            roof_acc = max(roof_f, byt_acc / (ceil["copy_tbps"] * 1e9))
            byt_bf = (N + K) * M + MB * (N + K) * 4 + 2 * G * N * K
            roof_bf = max(roof_f, byt_bf / (ceil["copy_tbps"] * 1e9))
            print(f"RESULT G={G} M={M} N={N} K={K} {dist}: acc {t['acc']:.3f} ms ({t['acc'] / roof_acc:.2f}x roof, "
                  f"{fl / t['acc'] / 1e9:.0f} TF) bf16 {t['bf16']:.3f} ({t['bf16'] / roof_bf:.2f}x, "
                  f"{fl / t['bf16'] / 1e9:.0f} TF) dense {t['dense']:.3f} ({fl / t['dense'] / 1e9:.0f} TF)", flush=True)


def main():
    global OP
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dists", default="balanced,paper", help="also eachN: every group N tokens")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness cases (profiling)")
    ap.add_argument("--shapes", default="8:16384:4096:4096,4:32768:8192:8192,8:65536:6144:5120,32:8192:4096:7168,"
                    "8:32768:4096:7168,8:32768:2048:7168,128:32768:1536:2048")
    args = ap.parse_args()
    OP = _ext.ops().k_grouped_fp8_gemm_out
    global DISTS
    DISTS = tuple(args.dists.split(","))
    ok = True
    cases = [([0, 1, 15, 16, 17, 127, 128, 129, 300, 0], 272, 400), ([5], 128, 128), ([0], 16, 16),
             ([3000, 0, 127, 1, 4096], 256, 384), ([256] * 32, 512, 256), ([1000, 24, 2000, 7], 4096, 2048)]
    for i, (sizes, N, K) in enumerate([] if args.no_check else cases):
        r = case(sizes, N, K, seed=i, check64=i < 4)
        good = all(v for k, v in r.items() if isinstance(v, bool)) and r.get("diff64_worst", 0) < 1e-3
        ok &= good
        print(f"case {i} sizes={sizes if len(sizes) < 12 else str(len(sizes)) + ' groups'} N={N} K={K}: {r} "
              f"{'OK' if good else 'FAIL'}", flush=True)
    print("ALL OK" if ok else "SOME FAILED", flush=True)
    if args.time:
        timing([tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")], args.iters)


if __name__ == "__main__":
    main()
