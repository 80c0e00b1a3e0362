"""megatron_tma: unpadded FP8 grouped GEMMs (TMA-adaptive) for MoE training on Hopper.

Public API (all take device group sizes/offsets; none reads them on the host):
    quantize_1x128, quantize_128x128, quantize_grouped_128x1     (megatron_tma.quant)
    quantize_1x128_and_grouped_128x1                            (megatron_tma.quant, one read of x)
    m_grouped_fp8_gemm, k_grouped_fp8_gemm                      (megatron_tma.gemm)
    padded_m_grouped_fp8_gemm                                   (megatron_tma.padding: the padded baseline)
    m_grouped_tile, k_grouped_tile                              (megatron_tma.gemm, the tile a call would use)
    fp8_grouped_linear, FP8WeightCache                          (megatron_tma.autograd)
    GroupedFP8MLP, GroupedBF16MLP                               (megatron_tma.mlp)
    activation_times_probs                                      (megatron_tma.activation, fused on Hopper)
Every kernel is a torch op, `torch.ops.megatron_tma.*`, defined in `megatron_tma.ops` (docs/ops.md). The plain-torch
numerics oracle is `megatron_tma.reference`, the ops' CPU kernels; group bookkeeping is `megatron_tma.groups`; the
kernels' group limits, applied on every backend, are `megatron_tma.limits`.
"""
from . import ops as _ops  # noqa: F401  (defines torch.ops.megatron_tma.*: schemas, CPU and fake kernels)
from ._ext import cuda_kernels_available, has_extension  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import megatron_tma` stays cheap and works while sibling modules are being built.
    if name in ("quantize_1x128", "quantize_128x128", "quantize_grouped_128x1"):
        from . import quant

        return getattr(quant, name)
    if name in ("m_grouped_fp8_gemm", "k_grouped_fp8_gemm", "m_grouped_tile", "k_grouped_tile"):
        from . import gemm

        return getattr(gemm, name)
    if name == "padded_m_grouped_fp8_gemm":
        from . import padding

        return padding.padded_m_grouped_fp8_gemm
    if name == "quantize_1x128_and_grouped_128x1":
        from . import quant

        return quant.quantize_1x128_and_grouped_128x1
    if name in ("fp8_grouped_linear", "FP8WeightCache"):
        from . import autograd

        return getattr(autograd, name)
    if name in ("GroupedFP8MLP", "GroupedBF16MLP"):
        from . import mlp

        return getattr(mlp, name)
    if name == "activation_times_probs":
        from . import activation

        return activation.activation_times_probs
    raise AttributeError(f"module 'megatron_tma' has no attribute {name!r}")
