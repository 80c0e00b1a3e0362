"""Transformer Engine around megatron_tma's experts (issue 33), on the CPU without TE:
* what megatron-core 0.19.2 does for FP8 experts because `fp8` is set, and that none of it reaches ours (no
  `Fp8Padding`, no routing-map padding unless asked for, which warns; the flex dispatcher's own FP8 padding warns);
* TE's layer spec (a stand-in `TESpecProvider`, since TE cannot be imported here) gets our experts in place of
  `TEGroupedMLP` with everything else shared, by the config flag and by the Megatron-LM flag's hook;
* the FP8 weight cache re-made after a step of a fused multi-tensor Adam like TE's `FusedAdam` (in-place updates no
  version counter sees), also when a Megatron-like wrapper then copies FP32 main weights in through `.data`.
TE itself on the GPU: tests/test_te_gpu.py."""
import functools
import importlib.util
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_tma.autograd import quantize_weights
from megatron_tma.mcore import megatron_experts
from megatron_tma.mcore.experts import MegatronFP8Experts
from megatron_tma.mlp import GroupedFP8MLP

HAVE_MEGATRON = (importlib.util.find_spec("megatron") is not None
                 and importlib.util.find_spec("megatron.core") is not None)
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (Python >= 3.12)")


def fp8_config(**kw):
    """The TransformerConfig fields the experts read, with Megatron's FP8 of a TE run set (--fp8-format e4m3
    --fp8-recipe blockwise) and the alltoall dispatcher."""
    base = dict(num_moe_experts=4, hidden_size=256, ffn_hidden_size=1024, moe_ffn_hidden_size=128,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, params_dtype=torch.bfloat16,
                expert_model_parallel_size=1, expert_tensor_parallel_size=1, tensor_model_parallel_size=1,
                use_cpu_initialization=True, perform_initialization=False, fp8="e4m3", fp8_recipe="blockwise",
                transformer_impl="transformer_engine", moe_token_dispatcher_type="alltoall",
                moe_router_padding_for_quantization=False, moe_router_padding_for_fp8=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("mode", ["unpadded", "padded16", "padded128", "bf16"])
def test_fp8_set_changes_nothing_in_our_experts(mode):
    """With Megatron's fp8 set, our experts build silently, hold no padding module (Fp8Padding lives in
    TEGroupedMLP.__init__ only) and compute the same bits as without it (they quantize themselves and read no FP8
    setting of the config)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = megatron_experts(4, fp8_config(), mode=mode, backend="reference")
    plain = megatron_experts(4, fp8_config(fp8=None, fp8_recipe=None, transformer_impl="local"), mode=mode,
                             backend="reference")
    plain.load_state_dict(ours.state_dict())
    assert not any("padding" in name.lower() for name, _ in ours.named_modules())
    assert not hasattr(ours, "quantization_padding")
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([5, 0, 17, 2])
    x = torch.randn(24, 256, generator=g).bfloat16()
    probs = torch.rand(24, generator=g)
    assert torch.equal(ours(x, sizes, probs)[0], plain(x, sizes, probs)[0])


@pytest.mark.parametrize("kw, warns", [
    (dict(moe_router_padding_for_quantization=True), "moe_router_padding_for_quantization"),
    (dict(moe_router_padding_for_fp8=True), "moe_router_padding_for_quantization"),
    (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep"), "flex_dispatcher_backend"),
    (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep"), "flex_dispatcher_backend"),
    (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"), None),  # pads only when asked
    (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep", fp8=None), None),
])
def test_what_pads_for_fp8_in_megatron_is_flagged(kw, warns):
    """megatron-core 0.19.2 pads for FP8 outside the experts in two places: the routing map when
    moe_router_padding_for_quantization (alias moe_router_padding_for_fp8) is set (MoEAlltoAllTokenDispatcher.
    dispatch_preprocess: pad_routing_map; _DeepepManager._pad_routing_map), and the flex dispatcher's HybridEP /
    NCCL-EP packing whenever fp8 is set. Our FP8 experts would compute the padding rows as tokens: warned, named."""
    if warns is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            megatron_experts(4, fp8_config(**kw), mode="unpadded", backend="reference")
        return
    with pytest.warns(UserWarning, match=warns):
        megatron_experts(4, fp8_config(**kw), mode="unpadded", backend="reference")
    if "flex" not in str(kw):  # the router padding is FP8's: nothing to say to the BF16 experts
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            megatron_experts(4, fp8_config(**kw), mode="bf16", backend="reference")


# ---------------------------------------------------------------------------------------------------------------
# The FP8 weight cache under a fused multi-tensor Adam (TE's FusedAdam: Megatron's optimizer when TE is installed)
# ---------------------------------------------------------------------------------------------------------------


class MultiTensorAdamLike(torch.optim.Optimizer):
    """What TE's FusedAdam does to the parameters, on the CPU: a subclass of torch.optim.Optimizer (so torch's global
    optimizer hooks run around its step, as they do around FusedAdam.step) that updates every parameter in place
    with one multi-tensor call on their storage (tex.multi_tensor_adam; here torch._foreach_add_ on `.data`), which
    moves no version counter."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            torch._foreach_add_([p.data for p in params], [p.grad.data.sign() for p in params], alpha=-group["lr"])


class MegatronLikeOptimizer:
    """Megatron's mixed-precision optimizer around it: the inner optimizer steps FP32 main weights, then the new
    weights are copied into the BF16 model parameters through `.data` (after the inner step's hooks ran)."""

    def __init__(self, params):
        self.params = list(params)
        self.main = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = MultiTensorAdamLike(self.main)

    def step(self):
        for m, p in zip(self.main, self.params):
            m.grad = p.grad.float()
        self.optimizer.step()
        for m, p in zip(self.main, self.params):
            p.data.copy_(m.data)  # what _copy_main_params_to_model_params does (multi_tensor_scale on .data)


def _train_step(module, gen):
    sizes = torch.tensor([7, 0, 12, 3])
    x = torch.randn(22, 256, generator=gen).bfloat16()
    out, _ = module(x, sizes, torch.rand(22, generator=gen))
    out.float().square().mean().backward()


@pytest.mark.parametrize("wrapped", [False, True], ids=["fused-adam-like", "megatron-wrapper"])
@pytest.mark.parametrize("cls", ["GroupedFP8MLP", "MegatronFP8Experts"])
def test_weight_cache_follows_a_multi_tensor_adam_that_moves_no_version(wrapped, cls):
    gen = torch.Generator().manual_seed(1)
    if cls == "GroupedFP8MLP":
        module = GroupedFP8MLP(4, 256, 128, backend="reference")
    else:
        module = megatron_experts(4, fp8_config(fp8=None), mode="unpadded", backend="reference")
        assert isinstance(module, MegatronFP8Experts)
    params = list(module.parameters())
    opt = MegatronLikeOptimizer(params) if wrapped else MultiTensorAdamLike(params)
    caches = [module.linear_fc1.weight_cache, module.linear_fc2.weight_cache]
    for step in range(3):
        _train_step(module, gen)
        versions = [p._version for p in params]
        before = [p.detach().clone() for p in params]
        used = [c._value.q.clone() for c in caches]
        opt.step()
        for p in params:
            p.grad = None
        assert [p._version for p in params] == versions  # the premise: no version counter saw the update
        assert not all(torch.equal(a, p) for a, p in zip(before, params))  # and the weights did change
        _train_step(module, gen)  # the next forward must quantize the new weights
        for cache, linear, old in zip(caches, (module.linear_fc1, module.linear_fc2), used):
            # the copies the forward used are a fresh quantization of the new weights
            assert torch.equal(cache._value.q, quantize_weights(linear.weights, backend="reference").q), step
            assert not torch.equal(cache._value.q, old), step


def test_a_data_write_outside_any_optimizer_step_needs_explicit_invalidation():
    """The one update path no signal sees (documented): a `.data` write with no optimizer step; after it,
    `invalidate_fp8_weights(model)` makes the next forward re-quantize."""
    from megatron_tma.mcore import invalidate_fp8_weights

    gen = torch.Generator().manual_seed(2)
    module = GroupedFP8MLP(4, 256, 128, backend="reference")
    _train_step(module, gen)
    stale = module.linear_fc1.weight_cache._value.q.clone()
    module.linear_fc1.weight.data.mul_(-1.0)
    _train_step(module, gen)
    assert torch.equal(module.linear_fc1.weight_cache._value.q, stale)  # stale: nothing announced the write
    assert invalidate_fp8_weights(torch.nn.Sequential(module)) == 1
    _train_step(module, gen)
    assert torch.equal(module.linear_fc1.weight_cache._value.q,
                       quantize_weights(module.linear_fc1.weights, backend="reference").q)


# ---------------------------------------------------------------------------------------------------------------
# TE's layer spec, with a stand-in for TE's spec provider
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def te_spec(monkeypatch):
    """megatron-core's `get_gpt_layer_with_transformer_engine_spec` / `get_gpt_decoder_block_spec(use_transformer_
    engine=True)` with a stand-in `TESpecProvider`: the local provider's modules (TE's are None without TE) except
    the experts, which are TEGroupedMLP's builder as TE's provider makes it (partial(TEGroupedMLP, GroupedMLPSubmodules
    (...))), and a marker that the TE path was taken."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl|DEPRECATED|deprecated).*")
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    class TEGroupedLinearStandIn:
        pass

    class TESpecProviderStandIn(LocalSpecProvider):
        def grouped_mlp_modules(self, moe_use_grouped_gemm):
            assert moe_use_grouped_gemm
            return functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
                linear_fc1=TEGroupedLinearStandIn, linear_fc2=TEGroupedLinearStandIn, activation_func=None))

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", TESpecProviderStandIn)
    return types.SimpleNamespace(specs=gpt_layer_specs, TEGroupedMLP=TEGroupedMLP)


def _experts(layer_spec):
    return layer_spec.submodules.mlp.keywords["submodules"].experts


@needs_megatron
@pytest.mark.parametrize("mode", ["unpadded", "padded16", "padded128", "bf16"])
def test_our_modes_drop_into_te_spec_by_the_same_switch(te_spec, mode):
    from megatron_tma.mcore import layer_spec_from_config

    spec = te_spec.specs.get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True)
    assert _experts(spec).func is te_spec.TEGroupedMLP  # mode te: the spec's own experts, the config flag unset
    config = types.SimpleNamespace(moe_megatron_tma_experts=None)
    assert layer_spec_from_config(spec, config) is spec
    config.moe_megatron_tma_experts = mode
    ours = layer_spec_from_config(spec, config)
    assert _experts(ours).func is megatron_experts and _experts(ours).keywords["mode"] == mode
    # everything else is TE's spec, shared: attention, norms, router, shared experts
    assert ours.submodules.self_attention is spec.submodules.self_attention
    assert ours.submodules.pre_mlp_layernorm is spec.submodules.pre_mlp_layernorm
    theirs_moe, ours_moe = spec.submodules.mlp.keywords["submodules"], ours.submodules.mlp.keywords["submodules"]
    assert ours_moe.shared_experts is theirs_moe.shared_experts and ours_moe.router is theirs_moe.router


@needs_megatron
def test_megatron_lm_flag_hook_swaps_te_experts(te_spec, megatron_cpu, monkeypatch):
    """The Megatron-LM patch's hook (`--moe-experts-impl`) on the block spec Megatron-LM builds for
    `--transformer-impl transformer_engine`: every MoE layer's TEGroupedMLP becomes ours, dense layers are shared."""
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tma.mcore import experts_impl

    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *a, **k: True)  # TE's version checks
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_moe_experts=4,
                               moe_ffn_hidden_size=128, moe_router_topk=2, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                               moe_grouped_gemm=True, moe_layer_freq=[0, 1], fp8="e4m3", fp8_recipe="blockwise",
                               transformer_impl="transformer_engine", moe_token_dispatcher_type="alltoall",
                               use_cpu_initialization=True, perform_initialization=False)
    assert not config.moe_router_padding_for_quantization  # fp8 alone does not turn on the routing-map padding
    block = te_spec.specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
    dense, moe = block.layer_specs
    assert _experts(moe).func is te_spec.TEGroupedMLP
    model_config = types.SimpleNamespace(transformer=config, moe_experts_impl="megatron_tma-unpadded")
    new_block, _ = experts_impl.gpt_builder_hook(model_config, block)
    assert new_block.layer_specs[0] is dense
    assert _experts(new_block.layer_specs[1]).keywords["mode"] == "unpadded"
    assert new_block.layer_specs[1].submodules.self_attention is moe.submodules.self_attention
    # and the experts it builds from this FP8 config are ours, unpadded, with no padding anywhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = megatron_experts(4, config, mode="unpadded", backend="reference")
    assert isinstance(module, MegatronFP8Experts) and module.pad_to is None


@needs_megatron
def test_te_paths_of_megatron_core_that_pad_are_where_we_say(te_spec):
    """The source facts docs/megatron.md cites (megatron-core 0.19.2), so that a megatron-core upgrade that moves them
    fails here: Fp8Padding is built in TEGroupedMLP.__init__ when fp8/fp4 is set (align 256 with TE's op fuser);
    the alltoall dispatcher pads the routing map only under moe_router_padding_for_quantization;
    get_align_size_for_quantization gives the alignment; the config alias turns the padding on."""
    import inspect

    from megatron.core.transformer.moe import experts, moe_utils, token_dispatcher
    from megatron.core.transformer import transformer_config

    init = inspect.getsource(experts.TEGroupedMLP.__init__)
    assert "Fp8Padding(self.num_local_experts" in init and "256 if self._with_fused_impl" in init
    assert "Fp8Padding" not in inspect.getsource(experts.SequentialMLP)
    pre = inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher.dispatch_preprocess)
    assert "if self.config.moe_router_padding_for_quantization:" in pre and "pad_routing_map" in pre
    assert "def get_align_size_for_quantization" in inspect.getsource(moe_utils)
    post = inspect.getsource(transformer_config.TransformerConfig.__post_init__)
    assert "self.moe_router_padding_for_quantization = True" in post  # moe_router_padding_for_fp8's alias
