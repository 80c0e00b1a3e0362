"""Second-order gradients (issue 55 item 2) on the CPU, reference backend: a backward with create_graph=True through
the FP8 linears and the activation is refused in one line naming the function (before, the gradient came back
detached and a gradient penalty silently contributed nothing); the permutation's gather and combine are
differentiable twice. The CUDA variants: tests/test_double_backward_gpu.py."""
import pytest
from _double_backward import CASES, WAYS, check_double_backward_is_refused, check_gather_and_combine_twice


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's note on .grad cycles
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_double_backward_through_an_fp8_linear_is_refused(case, way, gen):
    check_double_backward_is_refused(case, way, gen, "cpu", "reference")


def test_gather_and_combine_are_twice_differentiable(gen):
    check_gather_and_combine_twice(gen, "cpu", "reference")
