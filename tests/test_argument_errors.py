"""One-line errors that name the argument and the rule, raised before any work starts (issue 34 item 7): arguments
of the wrong type reached torch (AttributeError, NotImplementedError, TypeError from `torch.empty`); and (issue 55
item 7) arguments that were taken for something else, and $MEGATRON_TMA_DEBUG_CHECKS. CPU only."""
import pytest
import torch
from _api_rules import (ACCUMULATE_NOT_BOOL, BOGUS_BACKEND_CALLS, PERMUTATION_LOOKALIKES,
                        check_accumulate_must_be_a_bool, check_b_with_another_group_count, check_bogus_backend,
                        check_out_with_another_group_count, check_permutation_lookalike, one_line)

from megatron_tma.autograd import fp8_grouped_linear
from megatron_tma.groups import check_groups
from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8Linear, GroupedFP8MLP


def test_a_weight_that_is_not_a_tensor_is_named():
    w0 = torch.randn(128, 128).bfloat16()
    x = torch.randn(4, 128).bfloat16()
    with pytest.raises(TypeError) as e:
        fp8_grouped_linear(x, [w0, None], torch.tensor([2, 2]), backend="reference")
    one_line(e, "weight 1", "torch.Tensor", "NoneType")


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_groups=torch.tensor(2)), "num_groups"),
    (dict(num_groups=2.0), "num_groups"),
    (dict(num_groups=2, m_total=torch.tensor(4)), "m_total"),
    (dict(num_groups=2, m_total=4.0), "m_total"),
])
def test_check_groups_counts_must_be_ints(kwargs, name):
    with pytest.raises(TypeError) as e:
        check_groups(torch.tensor([2, 2]), **kwargs)
    one_line(e, name, "must be an int")


@pytest.mark.parametrize("make, name", [
    (lambda: GroupedFP8MLP(2.5, 128, 128, backend="reference"), "num_experts"),
    (lambda: GroupedFP8MLP(True, 128, 128, backend="reference"), "num_experts"),
    (lambda: GroupedFP8MLP(2, 128.0, 128, backend="reference"), "hidden_size"),
    (lambda: GroupedFP8MLP(2, 128, 256.0, backend="reference"), "ffn_hidden_size"),
    (lambda: GroupedBF16MLP(2.5, 128, 128, backend="reference"), "num_experts"),
    (lambda: GroupedBF16MLP(2, 128, 128.0, backend="reference"), "ffn_hidden_size"),
    (lambda: GroupedFP8Linear(2, 128.0, 128, backend="reference"), "in_features"),
    (lambda: GroupedFP8Linear(torch.tensor(2), 128, 128, backend="reference"), "num_groups"),
])
def test_layer_sizes_must_be_ints(make, name):
    with pytest.raises(TypeError) as e:
        make()
    one_line(e, name, "must be an int")


def test_layer_sizes_below_one_are_named():
    with pytest.raises(ValueError) as e:
        GroupedBF16MLP(0, 128, 128, backend="reference")
    one_line(e, "num_experts", ">= 1")


# ----------------------------------------------------------------------------------------------------------------
# Issue 55 item 7: arguments that were taken for something else (the GPU variants: tests/test_api_rules_gpu.py)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", ACCUMULATE_NOT_BOOL, ids=repr)
def test_k_grouped_accumulate_must_be_a_bool(accumulate):
    """`accumulate="no"` accumulated (a truthy string); every non-bool is refused, whatever its truth."""
    check_accumulate_must_be_a_bool(accumulate, "cpu", "reference")


@pytest.mark.parametrize("g_out", [2, 4])
def test_k_grouped_out_with_another_group_count_says_so(g_out):
    """Sizes [3] with an `out` of 2 groups were read as offsets [G+1] and refused as "offsets must start at 0";
    the error now says why they were read as offsets (or that out's G differs)."""
    check_out_with_another_group_count(g_out, "cpu", "reference")


def test_m_grouped_b_with_another_group_count_says_so():
    check_b_with_another_group_count("cpu", "reference")


@pytest.mark.parametrize("form", PERMUTATION_LOOKALIKES)
@pytest.mark.parametrize("op", ["combine_rows", "gather_rows"])
def test_permutation_that_is_not_one_is_named(op, form):
    """`combine_rows(y, (rows, token_rows))` raised AttributeError: a TypeError naming the argument now, as
    gather_rows already gave."""
    check_permutation_lookalike(op, form, "cpu", "reference")


@pytest.mark.parametrize("name", BOGUS_BACKEND_CALLS)
def test_a_bogus_backend_is_refused_at_entry(name):
    check_bogus_backend(name, "cpu")


@pytest.mark.parametrize("value", ["2", "true", "on", "yes", "-1", "1 1", "O"])
def test_debug_checks_variable_other_than_0_or_1_is_refused(monkeypatch, value):
    """`MEGATRON_TMA_DEBUG_CHECKS=2` meant off, silently; any value but 0/1 (empty or unset: off) is refused, in
    one line naming the variable and the values it takes."""
    from megatron_tma.groups import debug_checks_enabled, set_debug_checks

    monkeypatch.setenv("MEGATRON_TMA_DEBUG_CHECKS", value)
    try:
        with pytest.raises(ValueError) as e:
            set_debug_checks(None)
        one_line(e, "MEGATRON_TMA_DEBUG_CHECKS must be 1", "0 / empty / unset", repr(value.strip()))
    finally:
        monkeypatch.delenv("MEGATRON_TMA_DEBUG_CHECKS")
        set_debug_checks(None)
    assert not debug_checks_enabled()


@pytest.mark.parametrize("value, on", [("", False), ("0", False), (" 0 ", False), ("1", True), (" 1\n", True)])
def test_debug_checks_variable_values(monkeypatch, value, on):
    from megatron_tma.groups import debug_checks_enabled, set_debug_checks

    monkeypatch.setenv("MEGATRON_TMA_DEBUG_CHECKS", value)
    try:
        set_debug_checks(None)
        assert debug_checks_enabled() is on
    finally:
        monkeypatch.delenv("MEGATRON_TMA_DEBUG_CHECKS")
        set_debug_checks(None)


def test_debug_checks_variable_is_refused_at_import():
    """The variable is read when the package loads: a bad value stops the import with the one-line error."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MEGATRON_TMA_DEBUG_CHECKS": "2"}
    proc = subprocess.run([sys.executable, "-c", "import megatron_tma.gemm"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == ("ValueError: MEGATRON_TMA_DEBUG_CHECKS must be 1 (debug checks "
                                                     "on) or 0 / empty / unset (off), got '2'")
