"""Second-order gradients (issue 55 item 2) on the CUDA kernels: the same checks as tests/test_double_backward.py.
On the GPU the permutation's gather gradient is the combine kernel, which built no graph before. Skipped without a
Hopper GPU + extension."""
import pytest
from _double_backward import CASES, WAYS, check_double_backward_is_refused, check_gather_and_combine_twice

from megatron_tma import _ext

pytestmark = pytest.mark.skipif(not _ext.cuda_kernels_available(), reason="needs an sm_90 GPU and the built extension")


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's note on .grad cycles
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_double_backward_through_an_fp8_linear_is_refused(case, way, gen):
    check_double_backward_is_refused(case, way, gen, "cuda", "cuda")


def test_gather_and_combine_are_twice_differentiable(gen):
    check_gather_and_combine_twice(gen, "cuda", "cuda")
