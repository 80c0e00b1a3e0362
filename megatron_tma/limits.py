"""The kernels' group limits, in one place, and the check that applies them on every backend.

The CUDA kernels keep each call's group table in shared memory, so they take a bounded number of groups; the
torch reference takes any. So that code that runs on the CPU runs on the GPU, the Python API applies these limits
on every backend: at construction (`megatron_tma.mlp`'s FP8 modules) and at entry (the GEMMs, the quantizers,
`fp8_grouped_linear`). tests/test_group_limits.py reads the C++ constants named below and checks these against
them.
"""

__all__ = [
    "M_GROUPED_MAX_GROUPS",
    "K_GROUPED_MAX_GROUPS",
    "QUANTIZE_GROUPED_MAX_GROUPS",
    "PAD_GATHER_MAX_GROUPS",
    "MAX_EXPERTS",
    "check_num_groups",
    "check_num_experts",
]

# m_grouped_fp8_gemm (forward and dgrad): MGroupedGemmConfig::kMaxGroups, csrc/include/megatron_tma/kernels/
# m_grouped_fp8_gemm.cuh (the binding's m_grouped_fp8_gemm_max_groups()).
M_GROUPED_MAX_GROUPS = 2048
# k_grouped_fp8_gemm (wgrad): KGroupedGemmConfig::kMaxGroups, kernels/k_grouped_fp8_gemm.cuh.
K_GROUPED_MAX_GROUPS = 1024
# quantize_grouped_128x1 and quantize_1x128_and_grouped_128x1: kQuantizeGroupedMaxGroups, host/quantize.h.
QUANTIZE_GROUPED_MAX_GROUPS = 8192
# The padded path's gather kernels (megatron_tma.padding): kPadGatherMaxGroups, host/pad_gather.h.
PAD_GATHER_MAX_GROUPS = 8192
# Experts (groups) of a trainable FP8 grouped linear or expert MLP: its forward and dgrad run the M-grouped GEMM,
# its wgrad the K-grouped one.
MAX_EXPERTS = min(M_GROUPED_MAX_GROUPS, K_GROUPED_MAX_GROUPS)

# (a dict, not globals(): the checks run inside code that torch.compile traces, which cannot call globals())
_LIMITS = {"M_GROUPED_MAX_GROUPS": M_GROUPED_MAX_GROUPS, "K_GROUPED_MAX_GROUPS": K_GROUPED_MAX_GROUPS,
           "QUANTIZE_GROUPED_MAX_GROUPS": QUANTIZE_GROUPED_MAX_GROUPS, "PAD_GATHER_MAX_GROUPS": PAD_GATHER_MAX_GROUPS}


def check_num_groups(num_groups: int, limit: str, what: str) -> None:
    """ValueError naming `what` (the op) and the limit (the name of one of the constants above), if num_groups
    exceeds it."""
    value = _LIMITS[limit]
    if num_groups > value:
        raise ValueError(f"{what}: {num_groups} groups, more than the CUDA kernel takes "
                         f"(megatron_tma.limits.{limit} = {value}; the same limit on every backend)")


def check_num_experts(num_experts: int, what: str = "num_experts") -> None:
    """At construction of a trainable FP8 grouped linear or expert MLP: ValueError if it has more experts than its
    weight-gradient GEMM takes (TypeError / ValueError if it is not an int >= 1)."""
    from ._validate import check_int

    check_int(num_experts, what, 1)
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"{what}={num_experts} is more than {MAX_EXPERTS}, the groups the FP8 GEMMs take in training "
            f"(megatron_tma.limits.K_GROUPED_MAX_GROUPS: the weight-gradient GEMM's; the same limit on every "
            f"backend): spread the experts over more expert-parallel ranks"
        )
