# Host time of one quantize_128x128 call (GPU idle before each call): is it the op itself, or the context?
import statistics, time, torch
from megatron_tma import quant
for shape in [(8, 28672, 4096), (8, 4096, 14336), (128, 1536, 2048), (8, 256, 256)]:
    w = torch.randn(*shape, device="cuda").bfloat16()
    for _ in range(3): quant.quantize_128x128(w)
    torch.cuda.synchronize()
    res = {}
    for name, fn in [("quant.quantize_128x128", lambda: quant.quantize_128x128(w)),
                     ("torch.ops direct", lambda: torch.ops.megatron_tma.quantize_128x128(w, False)),
                     ("4x torch.empty", lambda: [torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2)] + [torch.empty(shape[0], shape[1] // 128, shape[2] // 128, device="cuda") for _ in range(2)])]:
        ts = []
        for _ in range(15):
            torch.cuda.synchronize(); t0 = time.perf_counter(); out = fn(); ts.append(1e3 * (time.perf_counter() - t0)); del out
        res[name] = round(statistics.median(ts), 4)
    # GPU busy: a long matmul queued first
    a = torch.randn(8192, 8192, device="cuda")
    ts = []
    for _ in range(10):
        torch.cuda.synchronize(); _ = a @ a; _ = a @ a; t0 = time.perf_counter(); out = quant.quantize_128x128(w); ts.append(1e3 * (time.perf_counter() - t0)); del out
    res["after 2 matmuls queued"] = round(statistics.median(ts), 4)
    print(shape, "host ms:", res, flush=True)
