"""Host time per grouped-GEMM call, split into its parts (issue 3's target: <= 20 us per M-grouped call).

For the M- and K-grouped GEMMs on tiny problems, 1000 calls back to back (wall time / calls, the GPU never the
bottleneck), each way of calling:
  wrapper       the public function as users call it (the argument rules, then the op)
  wrapper_groups the same with a `Groups` from check_groups (what the expert MLP passes: no group re-check)
  op            torch.ops.megatron_tma.<op> alone (C++ checks, TMA descriptors, launch)
Usage (GPU machine):
    python3 lab/probe_host_call.py [--calls 1000] [--out DIR]
"""
import argparse
import json
import os
import time

import torch


def per_call_us(fn, calls):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):  # best of three: the host, not the GPU, is measured, and other processes add noise
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return round(best, 2)


def measure(calls):
    from megatron_tma import gemm, quant
    from megatron_tma.groups import check_groups, make_group_sizes

    dev = "cuda"
    res = {}
    # M-grouped: the benchmark's host-time problem (bench_m_grouped.host_overhead_us)
    G, M, N, K = 8, 256, 256, 128
    aq, a_s = quant.quantize_1x128(torch.randn(M, K, device=dev).bfloat16())
    wq, ws, _, _ = quant.quantize_128x128(torch.randn(G, N, K, device=dev).bfloat16())
    groups = make_group_sizes(M, G, "paper", 0).to(dev)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    op = torch.ops.megatron_tma.m_grouped_fp8_gemm_out
    res["m_wrapper"] = per_call_us(lambda: gemm.m_grouped_fp8_gemm(aq, a_s, wq, ws, groups, out=out), calls)
    res["m_wrapper_alloc"] = per_call_us(lambda: gemm.m_grouped_fp8_gemm(aq, a_s, wq, ws, groups), calls)
    checked = check_groups(groups, G, m_total=M)
    res["m_wrapper_groups"] = per_call_us(lambda: gemm.m_grouped_fp8_gemm(aq, a_s, wq, ws, checked, out=out), calls)
    res["m_op"] = per_call_us(lambda: op(aq, a_s, wq, ws, groups, out, 0), calls)
    # K-grouped, FP32 out accumulated (the main_grad case)
    x = torch.randn(M, K, device=dev).bfloat16()
    dy = torch.randn(M, N, device=dev).bfloat16()
    xt, xs = quant.quantize_grouped_128x1(x, groups)
    dyt, dys = quant.quantize_grouped_128x1(dy, groups)
    c = torch.zeros(G, N, K, device=dev)
    kop = torch.ops.megatron_tma.k_grouped_fp8_gemm_out
    res["k_wrapper"] = per_call_us(lambda: gemm.k_grouped_fp8_gemm(dyt, dys, xt, xs, groups, out=c, accumulate=True), calls)
    k_checked = check_groups(groups, G)
    res["k_wrapper_groups"] = per_call_us(lambda: gemm.k_grouped_fp8_gemm(dyt, dys, xt, xs, k_checked, out=c,
                                                                          accumulate=True), calls)
    res["k_op"] = per_call_us(lambda: kop(dyt, dys, xt, xs, groups, c, True), calls)
    # for scale: an empty torch op through the dispatcher, and an allocation
    res["torch_empty"] = per_call_us(lambda: torch.empty(M, N, dtype=torch.bfloat16, device=dev), calls)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--out", default=None, help="directory for host_call.json")
    args = ap.parse_args()
    res = measure(args.calls)
    for key, us in res.items():
        print(f"{key:16s} {us:8.2f} us per call")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_call.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "us_per_call": res}, f, indent=1)


if __name__ == "__main__":
    main()
