"""One-line errors that name the argument and the rule, raised before any work starts (issue 34 item 7): arguments
of the wrong type reached torch (AttributeError, NotImplementedError, TypeError from `torch.empty`). CPU only."""
import pytest
import torch

from megatron_tma.autograd import fp8_grouped_linear
from megatron_tma.groups import check_groups
from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8Linear, GroupedFP8MLP


def _one_line(excinfo, *words):
    text = str(excinfo.value)
    assert "\n" not in text, text
    for word in words:
        assert word in text, text


def test_a_weight_that_is_not_a_tensor_is_named():
    w0 = torch.randn(128, 128).bfloat16()
    x = torch.randn(4, 128).bfloat16()
    with pytest.raises(TypeError) as e:
        fp8_grouped_linear(x, [w0, None], torch.tensor([2, 2]), backend="reference")
    _one_line(e, "weight 1", "torch.Tensor", "NoneType")


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_groups=torch.tensor(2)), "num_groups"),
    (dict(num_groups=2.0), "num_groups"),
    (dict(num_groups=2, m_total=torch.tensor(4)), "m_total"),
    (dict(num_groups=2, m_total=4.0), "m_total"),
])
def test_check_groups_counts_must_be_ints(kwargs, name):
    with pytest.raises(TypeError) as e:
        check_groups(torch.tensor([2, 2]), **kwargs)
    _one_line(e, name, "must be an int")


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
    _one_line(e, name, "must be an int")


def test_layer_sizes_below_one_are_named():
    with pytest.raises(ValueError) as e:
        GroupedBF16MLP(0, 128, 128, backend="reference")
    _one_line(e, "num_experts", ">= 1")
