"""`python -m megatron_tma [--check]`: what this installation can run, and why not when it cannot.

Prints the package, torch and GPU facts and whether the CUDA kernels run on each visible GPU. The case it exists
for is the silent one: on a GPU, `backend="auto"` falls back to the torch reference when the extension was not built
(e.g. built before the CuTe/CUTLASS headers were installed), which gives the right numbers ~10x slower.
`--check` also runs each GEMM once on the first GPU against the float64 reference (the diff of docs/design.md §3).

Exit status: 0 when the kernels run on every visible GPU, or when there is no GPU (the reference backend is then
the one there is); 1 when a GPU is visible and the kernels cannot run on it; 2 when `--check` finds a wrong result.
"""
import argparse
import importlib.util
import sys

import torch

from . import __version__, _ext

CHECK_TOLERANCE = 1e-3  # docs/design.md §3's accuracy bound against the float64 reference of the dequantized operands


def _gpus():
    """[(index, name, capability)] of the visible GPUs."""
    if not torch.cuda.is_available():
        return []
    return [(i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())]


def _why_not(capability) -> str:
    why = _ext.why_kernels_cannot_run(capability)
    if not _ext.has_extension():  # and how to mend it
        why += ("; reinstall with a CUDA build of torch, nvcc and the nvidia-cutlass headers present: "
                "pip install nvidia-cutlass==4.2.0.0 && pip install --no-build-isolation -e .")
    return why


def _check(device: str) -> dict:
    """{GEMM: diff against float64} for one small call of each GEMM (uneven groups, an empty one)."""
    from . import reference as R
    from .gemm import k_grouped_fp8_gemm, m_grouped_fp8_gemm

    gen = torch.Generator(device=device).manual_seed(0)
    sizes = torch.tensor([100, 0, 129, 27], device=device)
    m, n, k = int(sizes.sum()), 256, 256
    x = torch.randn(m, k, generator=gen, device=device).bfloat16()
    w = (0.05 * torch.randn(4, n, k, generator=gen, device=device)).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=device).bfloat16()
    aq, a_s = R.quantize_1x128(x)
    wq, ws, _, _ = R.quantize_128x128(w)
    y = m_grouped_fp8_gemm(aq, a_s, wq, ws, sizes, backend="cuda")
    xt, xs = R.quantize_grouped_128x1(x, sizes)
    dyt, dys = R.quantize_grouped_128x1(dy, sizes)
    dw = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, backend="cuda", num_groups=4)
    torch.cuda.synchronize(device)
    return {"m_grouped_fp8_gemm": R.diff(y.double(), R.m_grouped_ref64(aq, a_s, wq, ws, sizes)),
            "k_grouped_fp8_gemm": R.diff(dw.double(), R.k_grouped_ref64(dyt, dys, xt, xs, sizes))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_tma", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="also run each GEMM once on the first GPU against "
                                                             "the float64 reference")
    args = parser.parse_args(argv)
    print(f"megatron_tma {__version__} ({__file__.rsplit('/', 1)[0]})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}")
    mcore = importlib.util.find_spec("megatron") is not None
    print(f"megatron-core: {'importable' if mcore else 'not installed (megatron_tma.mcore needs it)'}")
    built = _ext.has_extension()
    print(f"CUDA extension: {'built' if built else f'not built ({_ext.extension_error()})'}")
    gpus = _gpus()
    if not gpus:
        print("GPUs: none visible; every op runs the torch reference (backend='auto' or 'reference')")
        if args.check:
            print("--check: no GPU, nothing to check")
        return 0
    status = 0
    for index, name, capability in gpus:
        runs = _ext.cuda_kernels_available(f"cuda:{index}")
        print(f"cuda:{index} {name} (sm_{capability[0]}{capability[1]}): "
              + ("the CUDA kernels run" if runs else
                 f"the CUDA kernels cannot run: {_why_not(capability)}; backend='auto' runs the torch reference, "
                 "right but ~10x slower"))
        status = status if runs else 1
    if args.check and status == 0:
        for op, d in _check("cuda:0").items():
            ok = d < CHECK_TOLERANCE
            print(f"--check {op}: diff vs float64 {d:.2e} ({'ok' if ok else f'WRONG: over {CHECK_TOLERANCE}'})")
            status = status if ok else 2
    return status


if __name__ == "__main__":
    sys.exit(main())
