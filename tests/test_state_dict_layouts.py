"""Loading checkpoints into the expert MLP: both weight layouts behave the same (issue 26, item 3). CPU."""
import pytest
import torch

from megatron_tma.mlp import GroupedBF16MLP, GroupedFP8MLP

G, H, FFN = 4, 128, 128
LAYOUTS = ["stacked", "per_expert"]


def _mlp(weight_layout, seed=0, cls=GroupedFP8MLP, device=None):
    torch.manual_seed(seed)
    kw = dict(backend="reference") if cls is GroupedFP8MLP else {}
    return cls(G, H, FFN, "swiglu", weight_layout=weight_layout, device=device, **kw)


def _experts(module):
    return {f"{name}.weight{i}": w.detach().clone()
            for name, lin in (("linear_fc1", module.linear_fc1), ("linear_fc2", module.linear_fc2))
            for i, w in enumerate(lin.expert_weights())}


def _inputs(gen, sizes=(30, 0, 17, 53)):
    return torch.randn(sum(sizes), H, generator=gen).bfloat16(), torch.tensor(sizes)


@pytest.mark.parametrize("cls", [GroupedFP8MLP, GroupedBF16MLP])
@pytest.mark.parametrize("source_layout", LAYOUTS)
@pytest.mark.parametrize("weight_layout", LAYOUTS)
def test_assign_loads_a_meta_module(gen, weight_layout, source_layout, cls):
    """assign=True on a module built on the meta device: its parameters become the checkpoint's tensors (their
    device and dtype, their values), in both layouts; the stacked layout stayed on meta (a copy into meta)."""
    source = _mlp(source_layout, seed=1, cls=cls)
    with torch.device("meta"):
        module = _mlp(weight_layout, cls=cls)
    assert all(p.is_meta for p in module.parameters())
    result = module.load_state_dict(source.state_dict(), assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, p in module.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16 and p.requires_grad, name
        assert isinstance(p, torch.nn.Parameter)
    want = _experts(source)
    assert all(torch.equal(want[k], v) for k, v in _experts(module).items())
    x, sizes = _inputs(gen)
    assert torch.equal(module(x, sizes)[0], source(x, sizes)[0])


@pytest.mark.parametrize("weight_layout", LAYOUTS)
def test_assign_takes_the_checkpoints_dtype_and_requires_grad(weight_layout):
    source = {k: v.float() for k, v in _mlp("stacked", seed=1).state_dict().items()}
    module = _mlp(weight_layout)
    module.linear_fc2.requires_grad_(False)
    module.load_state_dict(source, assign=True)
    for name, p in module.named_parameters():
        assert p.dtype == torch.float32 and p.requires_grad == name.startswith("linear_fc1"), name
    assert all(torch.equal(source[k], v) for k, v in _experts(module).items())


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("weight_layout", LAYOUTS)
def test_missing_expert_is_reported_and_leaves_the_linear_unchanged(weight_layout, assign):
    """strict=False with one expert missing: the key is reported and that linear is left as it was (no half-loaded
    linear), the other linear loads; strict=True raises naming the key. The per-expert layout used to load the
    other experts of the linear, the stacked one none."""
    module, good = _mlp(weight_layout, seed=1), _mlp("stacked", seed=2).state_dict()
    before = _experts(module)
    params_before = {n: p for n, p in module.named_parameters()}
    partial = {k: v for k, v in good.items() if k != "linear_fc1.weight2"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "linear_fc1\.weight2"\.'):
        module.load_state_dict(partial, assign=assign)
    result = module.load_state_dict(partial, strict=False, assign=assign)
    assert result.missing_keys == ["linear_fc1.weight2"] and result.unexpected_keys == []
    after = _experts(module)
    for k in after:
        want = before[k] if k.startswith("linear_fc1.") else good[k]
        assert torch.equal(after[k], want), k
    for n, p in module.named_parameters():
        if n.startswith("linear_fc1."):
            assert p is params_before[n], n  # not replaced either


@pytest.mark.parametrize("weight_layout", LAYOUTS)
def test_bad_expert_entry_leaves_the_linear_unchanged(weight_layout):
    """A mis-shaped or non-tensor expert entry: the same error in both layouts, and that linear left as it was."""
    module, good = _mlp(weight_layout, seed=1), _mlp("stacked", seed=2).state_dict()
    before = _experts(module)
    bad = dict(good, **{"linear_fc2.weight1": torch.zeros(H, FFN + 1)})
    with pytest.raises(RuntimeError, match=r"size mismatch for linear_fc2\.weight1: copying a param with shape "
                                           r"torch\.Size\(\[128, 129\]\) from checkpoint, the shape in current "
                                           r"model is torch\.Size\(\[128, 128\]\)"):
        module.load_state_dict(bad, strict=False)
    after = _experts(module)
    for k in after:
        assert torch.equal(after[k], before[k] if k.startswith("linear_fc2.") else good[k]), k
    with pytest.raises(RuntimeError, match=r'While copying the parameter named "linear_fc2\.weight3", expected '
                                           r"torch\.Tensor or Tensor-like object from checkpoint but received"):
        module.load_state_dict(dict(good, **{"linear_fc2.weight3": [1.0]}))
