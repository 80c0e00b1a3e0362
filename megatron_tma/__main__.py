"""`python -m megatron_tma [--check]`: what this installation can run, and why not when it cannot.

Prints the package, torch and GPU facts, and whether the CUDA kernels run on each visible GPU, or why they are not
available (no GPU visible, not a Hopper GPU, the extension not built and why). The case it exists for is the silent
one: on a GPU, backend="auto" falls back to the torch reference when the kernels cannot run, which gives the right
numbers ~10x slower.

--check also runs one small call of each quantizer and GEMM (uneven groups, an empty one) and compares it with
float64 (the GEMMs) or the input (the quantizers, dequantized), and the M-grouped GEMM with the padded path, bit for
bit: on the first GPU through the CUDA kernels where they run, else on the CPU through the reference backend.

Exit status:
  0  the kernels run on every visible GPU, or no GPU is visible (the reference backend is then the one there is);
     and with --check, every result is right
  1  a GPU is visible and the kernels cannot run on it (backend="auto" would run the torch reference there)
  2  --check found a wrong result
"""
import argparse
import importlib.util
import sys

import torch

from . import __version__, _ext

GEMM_TOLERANCE = 1e-3  # docs/design.md §3's accuracy bound against the float64 reference of the dequantized operands
QUANT_TOLERANCE = 5e-3  # e4m3 keeps 3 mantissa bits: ~1e-3 of rounding error in this metric, anything broken is >0.1


def _gpus():
    """[(index, name, capability)] of the visible GPUs."""
    if not torch.cuda.is_available():
        return []
    return [(i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())]


def _why_not(capability) -> str:
    why = _ext.why_kernels_cannot_run(capability)
    if not _ext.has_extension():  # and how to mend it
        why += "; reinstall on this machine (pip install -e .): a visible Hopper GPU builds the kernels"
    return why


def _check(device: str) -> dict:
    """{name: (diff, tolerance, bits_equal or None)} for one small call of each quantizer and GEMM on `device`:
    the CUDA kernels on a GPU, the reference backend on the CPU."""
    from . import reference as R
    from . import testing as T
    from .gemm import k_grouped_fp8_gemm, m_grouped_fp8_gemm
    from .padding import padded_m_grouped_fp8_gemm
    from .quant import quantize_1x128, quantize_128x128, quantize_grouped_128x1

    backend = "reference" if device == "cpu" else "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    sizes = torch.tensor([100, 0, 129, 27], device=device)
    m, n, k = int(sizes.sum()), 256, 256
    x = torch.randn(m, k, generator=gen, device=device).bfloat16()
    w = (0.05 * torch.randn(4, n, k, generator=gen, device=device)).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=device).bfloat16()
    aq, a_s = quantize_1x128(x, backend=backend)
    wq, ws, wqt, _ = quantize_128x128(w, backend=backend)
    xt, xs = quantize_grouped_128x1(x, sizes, backend=backend)
    dyt, dys = quantize_grouped_128x1(dy, sizes, backend=backend)
    y = m_grouped_fp8_gemm(aq, a_s, wq, ws, sizes, backend=backend)
    y_padded = padded_m_grouped_fp8_gemm(aq, a_s, wq, ws, sizes)  # the same backend: "auto" picks it here
    dw = k_grouped_fp8_gemm(dyt, dys, xt, xs, sizes, backend=backend, num_groups=4)
    if device != "cpu":
        torch.cuda.synchronize(device)
    x64, w64 = x.double(), w.double()
    return {
        "quantize_1x128": (T.diff(R.dequantize_1x128(aq, a_s, torch.float64), x64), QUANT_TOLERANCE, None),
        "quantize_128x128": (T.diff(R.dequantize_128x128(wq, ws, torch.float64), w64), QUANT_TOLERANCE,
                             torch.equal(wqt.view(torch.uint8), wq.view(torch.uint8).transpose(1, 2))),
        "quantize_grouped_128x1": (T.diff(R.dequantize_grouped_128x1(xt, xs, sizes, torch.float64), x64),
                                   QUANT_TOLERANCE, None),
        "m_grouped_fp8_gemm": (T.diff(y.double(), T.m_grouped_ref64(aq, a_s, wq, ws, sizes)), GEMM_TOLERANCE,
                               torch.equal(y, y_padded)),
        "k_grouped_fp8_gemm": (T.diff(dw.double(), T.k_grouped_ref64(dyt, dys, xt, xs, sizes)), GEMM_TOLERANCE, None),
    }


_BITS_WHAT = {"quantize_128x128": "its transposed copy", "m_grouped_fp8_gemm": "the padded path"}


def _report_check(device: str) -> int:
    """Run `_check(device)` and print one line per op; 2 when a result is wrong, else 0."""
    status = 0
    for op, (d, tolerance, same) in _check(device).items():
        ok = d < tolerance and same is not False  # NaN fails the comparison, as it must
        bits = "" if same is None else f", bits {'equal to' if same else 'DIFFER from'} {_BITS_WHAT[op]}"
        verdict = "ok" if ok else ("WRONG: bits differ" if same is False else f"WRONG: over {tolerance:g}")
        print(f"--check {op} ({device}): diff vs float64 {d:.2e}{bits} ({verdict})")
        status = status if ok else 2
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_tma", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__[__doc__.index("Exit status:"):],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="also run one small call of each quantizer and GEMM against float64 and the padded "
                             "path: on the first GPU with the CUDA kernels where they run, else on the CPU with the "
                             "reference backend")
    args = parser.parse_args(argv)
    print(f"megatron_tma {__version__} ({__file__.rsplit('/', 1)[0]})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}")
    mcore = importlib.util.find_spec("megatron") is not None
    print(f"megatron-core: {'importable' if mcore else 'not installed (megatron_tma.mcore needs it)'}")
    built = _ext.has_extension()
    print(f"CUDA extension: {'built' if built else f'not built ({_ext.extension_error()})'}")
    gpus = _gpus()
    status = 0
    if not gpus:
        print(f"CUDA kernels: not available here: {_ext.kernels_unavailable(extension=False)}; every op runs the "
              "torch reference (backend='auto' or 'reference')")
    for index, name, capability in gpus:
        runs = _ext.cuda_kernels_available(f"cuda:{index}")
        print(f"cuda:{index} {name} (sm_{capability[0]}{capability[1]}): "
              + ("the CUDA kernels run" if runs else
                 f"the CUDA kernels cannot run: {_why_not(capability)}; backend='auto' runs the torch reference, "
                 "right but ~10x slower"))
        status = status if runs else 1
    if args.check:
        if gpus and status == 0:
            device = "cuda:0"
        else:
            device = "cpu"
            print("--check: the CUDA kernels are not available (above), so this checks the reference backend on the "
                  "CPU only")
        status = max(status, _report_check(device))
    return status


if __name__ == "__main__":
    sys.exit(main())
