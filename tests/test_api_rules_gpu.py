"""Issue 55 item 7 on the GPU: the CPU's one-line errors (tests/test_argument_errors.py) for the same arguments on
CUDA tensors, the CUDA backend: accumulate that is not a bool, an out= or b of another group count, a Permutation
look-alike, a bogus backend. Skipped without a Hopper GPU + extension."""
import pytest
from _api_rules import (ACCUMULATE_NOT_BOOL, BOGUS_BACKEND_CALLS, PERMUTATION_LOOKALIKES,
                        check_accumulate_must_be_a_bool, check_b_with_another_group_count, check_bogus_backend,
                        check_out_with_another_group_count, check_permutation_lookalike)

from megatron_tma import _ext

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")

DEV = "cuda"


@pytest.mark.parametrize("accumulate", ACCUMULATE_NOT_BOOL, ids=repr)
def test_k_grouped_accumulate_must_be_a_bool(accumulate):
    check_accumulate_must_be_a_bool(accumulate, DEV, "cuda")


@pytest.mark.parametrize("g_out", [2, 4])
def test_k_grouped_out_with_another_group_count_says_so(g_out, debug_checks):
    """The values of device groups are read only under the debug checks: then the CPU's error."""
    check_out_with_another_group_count(g_out, DEV, "cuda")


def test_m_grouped_b_with_another_group_count_says_so(debug_checks):
    check_b_with_another_group_count(DEV, "cuda")


@pytest.mark.parametrize("form", PERMUTATION_LOOKALIKES)
@pytest.mark.parametrize("op", ["combine_rows", "gather_rows"])
def test_permutation_that_is_not_one_is_named(op, form):
    check_permutation_lookalike(op, form, DEV, "cuda")


@pytest.mark.parametrize("name", BOGUS_BACKEND_CALLS)
def test_a_bogus_backend_is_refused_at_entry(name):
    check_bogus_backend(name, DEV)
