"""Megatron-core integration (megatron_tma.mcore) on the CPU: the config mapping and its refusals, the experts
modules on the reference backend (Megatron's forward contract, parameter marks, state-dict keys, the FP8 weight
cache's invalidation by Megatron's per-iteration signal), and, where megatron-core is installed, the spec switch.
The whole Megatron model runs on the GPU (tests/test_mcore_gpu.py, recipes/moe_gpt.py)."""
import contextlib
import importlib.util
import os
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_tma import mcore
from megatron_tma.activation import GATED
from megatron_tma.mcore import expert_mlp_args, megatron_experts, pad_to_of

HAVE_MEGATRON = (importlib.util.find_spec("megatron") is not None
                 and importlib.util.find_spec("megatron.core") is not None)


def squared_relu(x):  # the name Megatron's megatron.core.activations.squared_relu has
    return torch.relu(x).square()


def make_config(**kw):
    """An object with the TransformerConfig fields the experts read (CPU: no Megatron RNG tracker, CPU weights)."""
    base = dict(num_moe_experts=4, hidden_size=256, ffn_hidden_size=1024, moe_ffn_hidden_size=128,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, params_dtype=torch.bfloat16,
                expert_model_parallel_size=1, expert_tensor_parallel_size=1, tensor_model_parallel_size=1,
                use_cpu_initialization=True, perform_initialization=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("kw, activation", [
    (dict(gated_linear_unit=True, activation_func=F.silu), "swiglu"),
    (dict(gated_linear_unit=True, activation_func=F.gelu), "geglu"),
    (dict(gated_linear_unit=False, activation_func=F.gelu), "gelu"),
    (dict(gated_linear_unit=False, activation_func=squared_relu), "squared_relu"),
])
def test_config_maps_activations(kw, activation):
    args = expert_mlp_args(make_config(**kw))
    assert args == (256, 128, activation)


def test_config_ffn_falls_back_to_ffn_hidden_size():
    assert expert_mlp_args(make_config(moe_ffn_hidden_size=None, ffn_hidden_size=384)).ffn_hidden_size == 384


@pytest.mark.parametrize("kw, field", [
    (dict(num_moe_experts=None), "num_moe_experts"),
    (dict(add_bias_linear=True), "add_bias_linear"),
    (dict(moe_latent_size=64), "moe_latent_size"),
    (dict(moe_apply_probs_on_input=True, moe_router_topk=2), "moe_apply_probs_on_input=True needs moe_router_topk=1"),
    (dict(expert_tensor_parallel_size=2), "each rank holds 64 of the FFN columns"),
    (dict(activation_func_clamp_value=7.0), "activation_func_clamp_value"),
    (dict(glu_linear_offset=1.0), "glu_linear_offset"),
    (dict(moe_mlp_glu_interleave_size=32), "moe_mlp_glu_interleave_size"),
    (dict(params_dtype=torch.float32), "params_dtype"),
    (dict(expert_gtp_weight_remat_size=2), "expert_gtp_weight_remat_size"),
    # Megatron's config leaves expert TP None to mean "as TP": 128 FFN columns over 2 ranks do not fit
    (dict(expert_tensor_parallel_size=None, tensor_model_parallel_size=2), "expert_tensor_parallel_size=2 ranks"),
    (dict(delay_wgrad_compute=True), "delay_wgrad_compute"),
    (dict(overlap_dispatch_backward_with_experts_wgrad=True), "overlap_dispatch_backward_with_experts_wgrad"),
    (dict(hidden_size=200), "hidden_size"),
    (dict(moe_ffn_hidden_size=96), "moe_ffn_hidden_size"),
    (dict(gated_linear_unit=True, activation_func=F.relu), "gated_linear_unit=True, activation_func=relu"),
    (dict(gated_linear_unit=False, activation_func=F.silu), "gated_linear_unit=False, activation_func=silu"),
])
def test_config_refusals_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        expert_mlp_args(make_config(**kw))


def test_sequential_mlp_keys_map_to_transformer_engines():
    f = mcore.from_sequential_mlp_key
    assert f("local_experts.3.linear_fc1.weight") == "linear_fc1.weight3"
    assert f("decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.weight") == \
        "decoder.layers.0.mlp.experts.linear_fc2.weight12"
    for other in ("local_experts.3.linear_fc1._extra_state", "decoder.layers.0.mlp.router.weight",
                  "xlocal_experts.3.linear_fc1.weight", "local_experts.3.linear_fc3.weight"):
        assert f(other) is None, other


def test_modes_and_pad_to():
    assert [pad_to_of(m) for m in mcore.MODES] == [None, 16, 128, None]
    with pytest.raises(ValueError, match="experts mode must be one of"):
        pad_to_of("padded64")


def _routed(t=50, hidden=256, sizes=(20, 0, 17, 13), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
    probs = torch.rand(t, generator=g)
    return x, torch.tensor(sizes), probs


@pytest.mark.parametrize("mode", mcore.MODES)
def test_experts_follow_megatrons_contract(mode):
    cfg = make_config()
    experts = megatron_experts(4, cfg, pg_collection=None, name="decoder.layers.0.mlp.experts", mode=mode,
                               backend="reference")
    assert isinstance(experts, mcore.MegatronBF16Experts if mode == "bf16" else mcore.MegatronFP8Experts)
    assert experts.config is cfg
    assert experts.linear_fc1.weight.shape == (4, 256, 256) and experts.linear_fc2.weight.shape == (4, 256, 128)
    x, sizes, probs = _routed()
    x.requires_grad_(True)
    out, bias = experts(x, sizes, probs)
    assert bias is None and out.shape == x.shape and out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert x.grad is not None and experts.linear_fc1.weight.grad.shape == (4, 256, 256)
    # Transformer Engine's state-dict keys, one per local expert
    assert sorted(experts.state_dict()) == sorted(f"linear_fc{i}.weight{e}" for i in (1, 2) for e in range(4))
    for p in experts.parameters():
        assert p.allreduce is True  # EP = 1 and expert TP = TP: reduced with the dense layers
    # marked as split over (expert) tensor-parallel ranks, as Megatron's expert linears are at any size
    assert experts.linear_fc1.weight.tensor_model_parallel and experts.linear_fc1.weight.partition_dim == 1
    assert experts.linear_fc2.weight.tensor_model_parallel and experts.linear_fc2.weight.partition_dim == 2


@pytest.mark.parametrize("probs_on_input", [False, True])
def test_padded_modes_equal_unpadded_on_the_reference(probs_on_input):
    results = []
    for mode in ("unpadded", "padded16", "padded128"):
        torch.manual_seed(3)  # same initial weights (default init draws the same numbers)
        experts = megatron_experts(4, make_config(moe_apply_probs_on_input=probs_on_input, moe_router_topk=1),
                                   mode=mode, backend="reference")
        x, sizes, probs = _routed(seed=5)
        x.requires_grad_()
        probs.requires_grad_()
        out = experts(x, sizes, probs)[0]
        out.float().square().sum().backward()
        results.append([out.detach(), x.grad, probs.grad] + [p.grad for p in experts.parameters()])
    for other in results[1:]:
        assert all(torch.equal(u, v) for u, v in zip(results[0], other))


def test_expert_parallel_marks_parameters_for_the_expert_dp_group():
    experts = megatron_experts(4, make_config(expert_model_parallel_size=2), backend="reference")
    assert all(p.allreduce is False for p in experts.parameters())
    # expert TP (1) different from TP (2) also means Megatron's expert process groups
    experts = megatron_experts(4, make_config(tensor_model_parallel_size=2), backend="reference")
    assert all(p.allreduce is False for p in experts.parameters())


def test_unsupported_forward_arguments_and_methods_are_refused():
    experts = megatron_experts(4, make_config(), backend="reference")
    x, sizes, probs = _routed()
    with pytest.raises(NotImplementedError, match="output_buffer"):
        experts(x, sizes, probs, output_buffer=torch.empty_like(x))
    out_none, _ = experts(x, sizes, probs, output_buffer=None)  # Megatron passes None when it is unset
    assert out_none.shape == x.shape
    with pytest.raises(NotImplementedError, match="delay_wgrad_compute"):
        experts.backward_dw()


def test_fp8_cache_follows_megatrons_iteration_signal():
    """Megatron's optimizer writes the weights through `.data` (no version counter moves). The experts re-quantize
    when DDP's per-iteration reset left `grad_added_to_main_grad` False, and keep the FP8 copies once a backward
    set it True."""
    experts = megatron_experts(4, make_config(), backend="reference")
    weights = [experts.linear_fc1.weight, experts.linear_fc2.weight]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False  # what zero_grad_buffer() sets at the start of an iteration
    x, sizes, probs = _routed()
    out0, _ = experts(x, sizes, probs)
    out0.float().sum().backward()
    assert all(w.grad_added_to_main_grad is True for w in weights)  # set by the backward (main_grad path)
    assert all(w.main_grad.abs().sum() > 0 for w in weights)

    with torch.no_grad():  # "the optimizer step": through .data, invisible to the version counter
        for w in weights:
            w.data.mul_(-1.0)
    # Same iteration (flag True): the cached FP8 copies are used, i.e. the old weights.
    assert torch.equal(experts(x, sizes, probs)[0], out0)
    # Next iteration: DDP resets the flag, the experts re-quantize and see the new weights.
    for w in weights:
        w.grad_added_to_main_grad = False
    out1, _ = experts(x, sizes, probs)
    assert not torch.equal(out1, out0)
    torch.manual_seed(0)
    fresh = megatron_experts(4, make_config(), backend="reference")
    with torch.no_grad():
        fresh.linear_fc1.weight.copy_(weights[0])
        fresh.linear_fc2.weight.copy_(weights[1])
    assert torch.equal(fresh(x, sizes, probs)[0], out1)


def test_a_forward_under_graph_capture_quantizes_inside_the_graph(monkeypatch):
    """Megatron's CUDA graphs replay the experts without their host-side cache checks, so a forward under capture
    must put the weight quantization in the graph: it re-quantizes even where an eager forward keeps the copies (the
    same iteration, after a backward). Capture is stood in for on the CPU (the check the experts make)."""
    from megatron_tma import mlp

    experts = megatron_experts(4, make_config(), backend="reference")
    weights = [experts.linear_fc1.weight, experts.linear_fc2.weight]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    x, sizes, probs = _routed()
    out0, _ = experts(x, sizes, probs)
    out0.float().sum().backward()
    with torch.no_grad():  # a weight update no version counter sees, within the iteration
        for w in weights:
            w.data.mul_(-1.0)
    assert torch.equal(experts(x, sizes, probs)[0], out0)  # eager: the copies are kept
    monkeypatch.setattr(mlp, "capturing", lambda: True)
    assert not torch.equal(experts(x, sizes, probs)[0], out0)  # captured: quantized from the weights now


def test_fp8_cache_follows_optimizer_steps_for_evaluation():
    """Megatron's evaluation runs right after a training step: DDP's flag is still True (no zero_grad_buffer()), and
    the step wrote the weights through .data (a torch optimizer on FP32 master copies, then a copy into the
    parameters, as Megatron's mixed-precision optimizer does). The next forward must see the new weights."""
    experts = megatron_experts(4, make_config(), backend="reference")
    weights = [experts.linear_fc1.weight, experts.linear_fc2.weight]
    masters = [w.detach().float().clone().requires_grad_() for w in weights]
    optimizer = torch.optim.SGD(masters, lr=1.0)
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    x, sizes, probs = _routed()
    out0, _ = experts(x, sizes, probs)
    out0.float().square().sum().backward()
    assert all(w.grad_added_to_main_grad is True for w in weights)
    for m, w in zip(masters, weights):
        m.grad = w.main_grad.clone()
    optimizer.step()
    with torch.no_grad():
        for m, w in zip(masters, weights):
            w.data.copy_(m)  # Megatron's _copy_main_params_to_model_params: no version counter moves
    with torch.no_grad():  # evaluation: flags still True
        out1, _ = experts(x, sizes, probs)
        again, _ = experts(x, sizes, probs)  # no step since: the copies made for out1 are reused
    torch.manual_seed(0)
    fresh = megatron_experts(4, make_config(), backend="reference")
    with torch.no_grad():
        fresh.linear_fc1.weight.copy_(weights[0])
        fresh.linear_fc2.weight.copy_(weights[1])
        assert not torch.equal(out1, out0) and torch.equal(fresh(x, sizes, probs)[0], out1)
    assert torch.equal(again, out1)


def _megatron_iterations(eval_mode, iterations=3):
    """Megatron-style iterations of the experts (flags reset, forward, backward into main_grad, a step on FP32 masters
    copied in through .data), with a forward under `eval_mode` after every step (None: none): every output and
    main_grad. The step's update is the gradient scaled to at most 0.005 per weight (weights ~N(0, 0.02)), so that it
    moves the BF16 weights whatever the draw: the same seeds give other values on the H200 host (torch 2.11), where
    the output after a plain SGD step of lr 0.1 was bit for bit the one before it."""
    torch.manual_seed(0)
    experts = megatron_experts(4, make_config(), backend="reference")
    weights = _ddp_weights(experts)
    masters = [w.detach().float().clone().requires_grad_() for w in weights]
    optimizer = torch.optim.SGD(masters, lr=0.005)
    x, sizes, probs = _routed()
    seen = []
    for _ in range(iterations):
        for w in weights:
            w.main_grad.zero_()
            w.grad_added_to_main_grad = False
        out, _ = experts(x, sizes, probs)
        out.float().square().mean().backward()
        seen += [out.detach()] + [w.main_grad.clone() for w in weights]
        for m, w in zip(masters, weights):
            m.grad = w.main_grad / w.main_grad.abs().max()
        optimizer.step()
        with torch.no_grad():
            for m, w in zip(masters, weights):
                w.data.copy_(m)
        if eval_mode is not None:
            with eval_mode():
                experts(x, sizes, probs)
    return seen


@pytest.mark.parametrize("eval_mode", [torch.inference_mode, torch.no_grad], ids=["inference_mode", "no_grad"])
def test_an_evaluation_between_iterations_changes_nothing_in_training(eval_mode):
    """Issue 34 item 1, Megatron's experts: an evaluation under inference_mode after a step left inference-mode FP8
    copies that the next training forward saved for backward (RuntimeError). With an evaluation under inference_mode
    or no_grad after every step, training computes the same bits as without."""
    plain = _megatron_iterations(None)
    evaluated = _megatron_iterations(eval_mode)
    assert all(t.isfinite().all() for t in plain) and not torch.equal(plain[0], plain[3])  # it trains
    assert len(plain) == len(evaluated) and all(torch.equal(a, b) for a, b in zip(plain, evaluated))


def _ddp_weights(experts):
    """The experts' weights with the attributes Megatron's DDP gives them, flag reset as at an iteration's start."""
    weights = list(experts.parameters())
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    return weights


def _saved_storages(experts, x, sizes, probs):
    """(output, the storages the forward saved for backward) of one forward with gradients."""
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = experts(x.clone().requires_grad_(), sizes, probs)
    return out, saved


def test_pipeline_warm_up_and_recompute_share_one_fp8_copy(monkeypatch):
    """A pipeline's warm-up runs several micro-batch forwards before the first backward, and Megatron's `moe` / full
    recompute runs the forward again inside the backward; DDP's flag is False all that time. The weights cannot have
    changed then, so the FP8 copies are made once and every micro-batch in flight saves the same ones (re-making them
    would keep one W^T copy alive per micro-batch). After the iteration (a backward, then DDP's reset), they are
    made again."""
    from megatron_tma import quant

    calls = []
    real = quant.quantize_128x128
    monkeypatch.setattr(quant, "quantize_128x128", lambda *a, **k: calls.append(1) or real(*a, **k))
    experts = megatron_experts(4, make_config(), backend="reference")
    weights = _ddp_weights(experts)
    x, sizes, probs = _routed()
    outs = [_saved_storages(experts, x, sizes, probs) for _ in range(3)]  # warm-up: three forwards
    assert len(calls) == 2  # fc1 and fc2, once
    shared = outs[0][1] & outs[1][1] & outs[2][1]
    fp8 = {t.untyped_storage().data_ptr() for lin in (experts.linear_fc1, experts.linear_fc2)
           for t in lin.weight_cache._value}
    assert fp8 & shared and len(fp8 & shared) == len(fp8 & outs[0][1])  # the same W^T copies saved by all three
    with torch.no_grad():  # a recompute's first pass (no autograd), then its forward again in backward
        experts(x, sizes, probs)
    out, _ = experts(x.clone().requires_grad_(), sizes, probs)
    assert len(calls) == 2
    out.float().sum().backward()  # the first backward: flags True
    for o, _ in outs:
        o.float().sum().backward()
    assert all(w.grad_added_to_main_grad is True for w in weights) and len(calls) == 2
    experts(x, sizes, probs)  # steady state, same iteration: still the same copies
    assert len(calls) == 2
    for w in weights:  # the next iteration: DDP's reset (the weights may have been written through .data)
        w.grad_added_to_main_grad = False
    experts(x, sizes, probs)
    assert len(calls) == 4


def test_invalidate_fp8_weights_finds_every_fp8_module():
    model = torch.nn.ModuleList([megatron_experts(4, make_config(), backend="reference"),
                                 megatron_experts(4, make_config(), mode="bf16", backend="reference"),
                                 megatron_experts(4, make_config(), mode="padded16", backend="reference")])
    x, sizes, probs = _routed()
    before = model[0](x, sizes, probs)[0]
    with torch.no_grad():
        model[0].linear_fc1.weight.data.mul_(2.0)  # no version bump, no Megatron flag: only the explicit call helps
    assert torch.equal(model[0](x, sizes, probs)[0], before)
    assert mcore.invalidate_fp8_weights(model) == 2
    assert not torch.equal(model[0](x, sizes, probs)[0], before)


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
def test_spec_switch_replaces_only_the_experts():
    import functools
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl).*")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)
    new = mcore.use_megatron_tma_experts(spec, "padded16", backend="reference")
    experts = new.submodules.mlp.keywords["submodules"].experts
    assert isinstance(experts, functools.partial) and experts.func is megatron_experts
    assert experts.keywords == {"mode": "padded16", "backend": "reference"}
    old_subs = spec.submodules.mlp.keywords["submodules"]
    new_subs = new.submodules.mlp.keywords["submodules"]
    assert new_subs.router is old_subs.router and new_subs.shared_experts is old_subs.shared_experts
    assert spec.submodules.mlp.keywords["submodules"].experts is not experts  # the input spec is not modified
    assert new.submodules.self_attention is spec.submodules.self_attention
    assert mcore.use_megatron_tma_experts(spec, None) is spec
    with pytest.raises(ValueError, match="moe_megatron_tma_experts must be None or one of"):
        mcore.use_megatron_tma_experts(spec, "fp8")
    with pytest.raises(ValueError, match="no MoE layer"):
        mcore.use_megatron_tma_experts(get_gpt_layer_local_spec(), "unpadded")
    cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=4,
                            moe_ffn_hidden_size=128, gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16)
    assert mcore.layer_spec_from_config(spec, cfg) is spec  # flag unset: Megatron's experts
    setattr(cfg, mcore.CONFIG_FLAG, "unpadded")
    assert mcore.layer_spec_from_config(spec, cfg).submodules.mlp.keywords["submodules"].experts.keywords["mode"] == \
        "unpadded"
    assert expert_mlp_args(cfg) == (256, 128, "swiglu")  # a real TransformerConfig through the mapping


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
@pytest.mark.parametrize("probs_on_input, activation", [(False, "swiglu"), (True, "swiglu"), (False, "geglu")])
def test_experts_compute_megatrons_experts_function(megatron_cpu, probs_on_input, activation):
    """Given the weights of Megatron's own experts (SequentialMLP of the local spec), megatron_tma's BF16 experts
    compute the same function (SwiGLU with the gate half first, probs after the activation, or on the input with
    `moe_apply_probs_on_input` at top-1): the diff of docs/design.md §3 at BF16 rounding level; the FP8 experts within the FP8
    recipe's noise. State-dict keys map one to one."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=4,
                            moe_router_topk=1 if probs_on_input else 2, moe_ffn_hidden_size=256, gated_linear_unit=True,
                            activation_func=F.silu if activation == "swiglu" else F.gelu, add_bias_linear=False,
                            moe_token_dispatcher_type="allgather",
                            use_cpu_initialization=True, perform_initialization=False, bf16=True,
                            params_dtype=torch.bfloat16, moe_apply_probs_on_input=probs_on_input,
                            moe_router_pre_softmax=probs_on_input)  # Megatron asks for it at top-1
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True),
                   vocab_size=512, max_sequence_length=64)
    seq = gpt.decoder.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    state = {mcore.from_sequential_mlp_key(k): v for k, v in seq.state_dict().items()
             if mcore.from_sequential_mlp_key(k)}
    x, sizes, probs = _routed(t=158, sizes=(50, 0, 77, 31), seed=12)
    with torch.no_grad():
        ref = seq(x, sizes, probs)[0].double()
        for mode, tol in (("bf16", 1e-4), ("unpadded", 3e-3)):
            ours = megatron_experts(4, cfg, mode=mode, backend="reference")
            ours.load_state_dict(state)  # strict: the keys map one to one
            out = ours(x, sizes, probs)[0].double()
            diff = float(1 - 2 * (out * ref).sum() / ((out * out).sum() + (ref * ref).sum()))
            assert 0 <= diff < tol and (diff > 0 or mode == "bf16"), (mode, diff)  # FP8 must differ


def _small_gpt(mode, activation="swiglu"):
    """A 2-layer MoE GPT on the CPU (4 experts), with Megatron's experts (mode None) or megatron_tma's."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(DEPRECATED|deprecated).*")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, num_moe_experts=4,
                            moe_router_topk=2, moe_ffn_hidden_size=128, gated_linear_unit=activation in GATED,
                            activation_func=F.silu if activation == "swiglu" else F.gelu, add_bias_linear=False,
                            moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
                            perform_initialization=False, bf16=True, params_dtype=torch.bfloat16)
    spec = mcore.use_megatron_tma_experts(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True), mode,
                                          backend="reference")
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=512, max_sequence_length=64)


def _randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


def _weights(model):
    """Every weight under megatron_tma's keys (Megatron's per-expert MLPs renamed), without `_extra_state`."""
    return {mcore.from_sequential_mlp_key(k) or k: v for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")}


def _load_weights(model, weights):
    """`model.load_state_dict(weights)`, strict about every tensor but not about `_extra_state`, which `_weights`
    leaves out: with Transformer Engine installed Megatron builds TE modules (the final layernorm) even in the local
    spec, and their extra state is no weight."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


def _expert_shards(sharded_state_dict):
    """The experts' entries of a Megatron sharded state dict as {(key, global offset): (global shape, axis
    fragmentations, replica id, data)}, factories (SwiGLU's fc1) expanded into the shards they write."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = {}
    for v in sharded_state_dict.values():
        shards = nested_values(v.build()) if isinstance(v, ShardedTensorFactory) else [v]
        for sh in shards:
            if ".experts." not in sh.key:
                continue
            if isinstance(sh, ShardedTensor):
                out[(sh.key, sh.global_offset)] = (sh.global_shape, sh.axis_fragmentations, sh.replica_id, sh.data)
            elif isinstance(sh, ShardedObject):  # the linears' _extra_state
                out[(sh.key, sh.global_offset)] = (sh.global_shape, None, sh.replica_id, sh.data)
    return out


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "geglu"])
def test_distributed_checkpoint_layout_is_megatrons_with_singleton_shards(megatron_cpu, activation):
    """Megatron's `singleton_local_shards` layout (one key per global expert, `experts.<e>.linear_fc1.weight`, and
    SwiGLU's halves as `_w` / `_v` keys): the same entries as SequentialMLP's (optimizer states go through the same
    build function with another tensor: test_distributed_checkpoint_with_optimizer_state)."""
    theirs, ours = _small_gpt(None, activation), _small_gpt("unpadded", activation)
    _randomize(theirs, 23)
    _load_weights(ours, _weights(theirs))
    metadata = {"singleton_local_shards": True}
    a = _expert_shards(theirs.sharded_state_dict(metadata=metadata))
    b = _expert_shards(ours.sharded_state_dict(metadata=metadata))
    assert a.keys() == b.keys() and any(".experts.3." in key for key, _ in a)
    for k in a:
        (shape_a, frag_a, rep_a, data_a), (shape_b, frag_b, rep_b, data_b) = a[k], b[k]
        assert (shape_a, frag_a, rep_a) == (shape_b, frag_b, rep_b), k
        assert (data_a is None and data_b is None) or torch.equal(data_a, data_b), k


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "geglu"])
def test_distributed_checkpoint_layout_is_megatrons(megatron_cpu, activation):
    """The experts' sharded state dict writes what Megatron's own experts (SequentialMLP) write: the same tensor and
    object keys, global shapes, offsets along the global expert axis, fragmentation, replica ids and data, so that
    checkpoints go both ways (next test)."""
    def build(mode):
        return _small_gpt(mode, activation)

    theirs, ours = build(None), build("unpadded")
    _randomize(theirs, 21)
    _load_weights(ours, _weights(theirs))
    a, b = _expert_shards(theirs.sharded_state_dict()), _expert_shards(ours.sharded_state_dict())
    # layers x experts x ((gate, up) or fc1, fc2 weight shards + two _extra_state objects)
    assert len(a) == 2 * 4 * ((3 if activation in GATED else 2) + 2)
    assert a.keys() == b.keys()
    for k in a:
        (shape_a, frag_a, rep_a, data_a), (shape_b, frag_b, rep_b, data_b) = a[k], b[k]
        assert (shape_a, frag_a, rep_a) == (shape_b, frag_b, rep_b), k
        assert (data_a is None and data_b is None) or torch.equal(data_a, data_b), k
    sd = ours.sharded_state_dict()
    # one factory per weight parameter (Megatron's optimizers find a parameter's entry by its identity), whose data
    # is the parameter; the linears' _extra_state objects per expert
    assert {k for k in sd if ".experts." in k} == {
        f"decoder.layers.{layer}.mlp.experts.linear_fc{i}.{what}"
        for layer in range(2) for i in (1, 2) for what in ["weight"] + [f"_extra_state{e}" for e in range(4)]}
    experts = ours.decoder.layers[0].mlp.experts
    assert sd["decoder.layers.0.mlp.experts.linear_fc1.weight"].data is experts.linear_fc1.weight


def test_expert_tensor_parallel_shards_compute_slices_of_the_whole_experts():
    """What ETP = 2 computes, on the reference backend: each rank's experts hold a shard of every expert (fc1's gate
    and up rows r*F/2.., fc2's columns r*F/2..) and see every token of the group (Megatron's dispatcher gathers
    them). Every shard boundary falls on a 128-block of the FP8 scaling, so each rank's fc1 output columns, their
    activation and every weight gradient are bit for bit the matching slices of the whole experts' (ETP = 1); the
    fc2 output and dx are partial sums over F that Megatron's dispatcher adds up across the two ranks (BF16
    rounding of two partials instead of one sum)."""
    from megatron_tma import testing as T

    ffn, half = 512, 256
    whole = megatron_experts(4, make_config(moe_ffn_hidden_size=ffn), backend="reference")
    _randomize(whole, 51)
    with torch.no_grad():
        for p in whole.parameters():
            p.mul_(0.05)
    x, sizes, probs = _routed(seed=7)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).bfloat16()

    def step(module):
        xx = x.clone().requires_grad_()
        out, _ = module(xx, sizes, probs)
        out.backward(dy)
        return out.detach(), xx.grad, module.linear_fc1.weight.grad, module.linear_fc2.weight.grad

    out, dx, dw1, dw2 = step(whole)
    w1, w2 = whole.linear_fc1.weight.detach(), whole.linear_fc2.weight.detach()
    outs, dxs = [], []
    for r in range(2):
        rows = torch.cat([torch.arange(r * half, (r + 1) * half), ffn + torch.arange(r * half, (r + 1) * half)])
        shard = megatron_experts(4, make_config(moe_ffn_hidden_size=ffn, expert_tensor_parallel_size=2),
                                 backend="reference")
        with torch.no_grad():
            shard.linear_fc1.weight.copy_(w1[:, rows])  # [gate rows of rank r; up rows of rank r]
            shard.linear_fc2.weight.copy_(w2[:, :, r * half:(r + 1) * half])
        o, d, g1, g2 = step(shard)
        assert torch.equal(g1, dw1[:, rows]) and torch.equal(g2, dw2[:, :, r * half:(r + 1) * half]), r
        outs.append(o.float())
        dxs.append(d.float())
    assert T.diff(outs[0] + outs[1], out) < 1e-4 and T.diff(dxs[0] + dxs[1], dx) < 1e-4


class _Group:
    """A process group as Megatron's experts and checkpoint code ask it: its size and this rank's place in it."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
@pytest.mark.parametrize("etp_rank", [0, 1])
def test_expert_tensor_parallel_shards_are_megatrons(megatron_cpu, etp_rank):
    """Expert tensor parallelism (ETP = 2), as each of the two ranks sees it: the experts hold Megatron's shard of
    every expert (fc1's gate and up halves split along their outputs, fc2 along its inputs: the shapes of
    SequentialMLP's local linears) and write the distributed checkpoint entries SequentialMLP writes on that rank
    (the same keys, global shapes, offsets, fragmentation, replica ids and data)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=4,
                            moe_ffn_hidden_size=512, gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
                            perform_initialization=False, moe_grouped_gemm=True, expert_tensor_parallel_size=2)
    groups = types.SimpleNamespace(ep=_Group(1, 0), expt_tp=_Group(2, etp_rank), expt_dp=_Group(1, 0), tp=_Group(1, 0))
    theirs = SequentialMLP(4, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                           pg_collection=groups)
    ours = megatron_experts(4, cfg, pg_collection=groups, mode="unpadded", backend="reference")
    assert ours.linear_fc1.weight.shape == (4, 512, 256) and ours.linear_fc2.weight.shape == (4, 256, 256)
    assert theirs.local_experts[0].linear_fc1.weight.shape == (512, 256)  # 2 x 512 / 2 rows, as ours
    _randomize(theirs, 41 + etp_rank)
    ours.load_state_dict({mcore.from_sequential_mlp_key(k): v for k, v in theirs.state_dict().items()
                          if not k.endswith("_extra_state")})
    prefix = "decoder.layers.0.mlp.experts."
    a, b = _expert_shards(theirs.sharded_state_dict(prefix=prefix)), _expert_shards(ours.sharded_state_dict(prefix))
    assert len(a) == 4 * (3 + 2) and a.keys() == b.keys()  # per expert: gate, up, fc2 shards + two _extra_state
    for k in a:
        (shape_a, frag_a, rep_a, data_a), (shape_b, frag_b, rep_b, data_b) = a[k], b[k]
        assert (shape_a, frag_a, rep_a) == (shape_b, frag_b, rep_b), k
        assert (data_a is None and data_b is None) or torch.equal(data_a, data_b), k
    fc2 = next(v for (key, offset), v in b.items() if key.endswith("linear_fc2.weight") and offset[0] == 0)
    assert fc2[0] == (4, 256, 512) and fc2[1] == (4, 1, 2)  # the whole fc2 of 512 inputs, in two ETP shards


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
def test_distributed_checkpoint_save_and_load(megatron_cpu, tmp_path, monkeypatch):
    """Megatron's `torch_dist` checkpoint through `dist_checkpointing.save` / `load` and `load_state_dict`: one of
    Megatron's own experts loads into megatron_tma's (every weight equal), megatron_tma's round-trips, and loads into
    Megatron's experts. Megatron's
    writer synchronises and broadcasts on the current CUDA device; without a GPU those two calls are stood in for (a
    no-op sync, the host as the device), nothing else. With one, it runs as it is (the weights stay on the host)."""
    from megatron.core import dist_checkpointing

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    theirs, ours, other = _small_gpt(None), _small_gpt("unpadded"), _small_gpt("unpadded")
    _randomize(theirs, 31)
    _randomize(other, 32)
    (tmp_path / "megatron").mkdir()
    (tmp_path / "ours").mkdir()
    dist_checkpointing.save(theirs.sharded_state_dict(), str(tmp_path / "megatron"))
    ours.load_state_dict(dist_checkpointing.load(ours.sharded_state_dict(), str(tmp_path / "megatron")))
    a, b = _weights(theirs), _weights(ours)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    dist_checkpointing.save(other.sharded_state_dict(), str(tmp_path / "ours"))
    ours.load_state_dict(dist_checkpointing.load(ours.sharded_state_dict(), str(tmp_path / "ours")))
    a, b = _weights(other), _weights(ours)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and back: megatron_tma's checkpoint into Megatron's experts (their linears' _extra_state objects are there)
    theirs.load_state_dict(dist_checkpointing.load(theirs.sharded_state_dict(), str(tmp_path / "ours")))
    a, b = _weights(other), _weights(theirs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _megatron_adam(model):
    """Megatron's FP32Optimizer around torch's Adam over `model` (Megatron's Adam state initializer), built without
    its one CUDA tensor (the loss scale, which its checkpoint does not hold), so that it runs on the CPU."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    def init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, torch.optim.Adam(model.parameters(), lr=1e-2), OptimizerConfig(lr=1e-2),
                               init_state_fn)
    opt.is_stub_optimizer = False
    return opt


def _adam_steps(model, opt, seed, steps=2):
    """`steps` Adam steps on seeded random gradients (every parameter gets one, so every one has state)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.optimizer.step()


def _optimizer_states(model, opt):
    """{(canonical parameter name, state key): tensor}: Megatron's per-expert names mapped to megatron_tma's keys, a
    stacked parameter's states split per expert as its state dict splits it."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, state in opt.optimizer.state.items():
        name = names[id(p)]
        for key, value in state.items():
            per_expert = p.dim() == 3  # a stacked [G, N, K] weight: its states per expert (the step shared)
            pieces = ({f"{name}{i}": (value if key == "step" else v) for i, v in enumerate(value.unbind(0) if
                       key != "step" else [value] * p.shape[0])} if per_expert else {name: value})
            for n, v in pieces.items():
                out[(mcore.from_sequential_mlp_key(n) or n, key)] = v
    return out


def _save_with_optimizer(model, opt, path):
    from megatron.core import dist_checkpointing

    path.mkdir()
    dist_checkpointing.save({"model": model.sharded_state_dict(),
                             "optimizer": opt.sharded_state_dict(model.sharded_state_dict())}, str(path))


def _load_with_optimizer(model, opt, path):
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(),
                                      "optimizer": opt.sharded_state_dict(model.sharded_state_dict(), is_loading=True)},
                                     str(path))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def _assert_same_training_state(a, opt_a, b, opt_b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = _optimizer_states(a, opt_a), _optimizer_states(b, opt_b)
    assert sa.keys() == sb.keys() and len(sa) > 0
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])]


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_distributed_checkpoint_with_optimizer_state(megatron_cpu, tmp_path, monkeypatch, activation):
    """Issue 26 item 2 on the CPU: Megatron's optimizer finds each parameter's checkpoint entry by the identity of the
    parameter tensor. A `torch_dist` checkpoint of model + optimizer state (Adam's moments and step) saves and loads
    back into a fresh model and optimizer with every weight and state equal, and both then take the same next step to
    the same bits; it goes both ways between Megatron's experts (SequentialMLP) and megatron_tma's. (The experts'
    per-expert views of the stacked weight in their sharded state dict made the optimizer's checkpoint fail: 'Param id
    ... does not match any model sharded param'.)"""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")

    def trained(mode, seed):
        model = _small_gpt(mode, activation)
        _randomize(model, seed)
        opt = _megatron_adam(model)
        _adam_steps(model, opt, seed)
        return model, opt

    ours, opt = trained("unpadded", 41)
    _save_with_optimizer(ours, opt, tmp_path / "ours")
    resumed, opt_resumed = trained("unpadded", 42)  # other weights and states, all overwritten by the load
    _load_with_optimizer(resumed, opt_resumed, tmp_path / "ours")
    _assert_same_training_state(ours, opt, resumed, opt_resumed)
    _adam_steps(ours, opt, 7, steps=1)
    _adam_steps(resumed, opt_resumed, 7, steps=1)
    _assert_same_training_state(ours, opt, resumed, opt_resumed)

    # Megatron's own experts' checkpoint (weights and Adam states) into megatron_tma's, and megatron_tma's back
    theirs, opt_theirs = trained(None, 43)
    _save_with_optimizer(theirs, opt_theirs, tmp_path / "megatron")
    _load_with_optimizer(resumed, opt_resumed, tmp_path / "megatron")
    _assert_same_training_state(theirs, opt_theirs, resumed, opt_resumed)
    back, opt_back = trained(None, 44)
    _save_with_optimizer(ours, opt, tmp_path / "ours-stepped")
    _load_with_optimizer(back, opt_back, tmp_path / "ours-stepped")
    _assert_same_training_state(ours, opt, back, opt_back)


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
def test_run_checkpoint_saves_and_resumes(megatron_cpu, tmp_path, monkeypatch):
    """megatron_tma.mcore.checkpoint (the recipe's --save / --load) on the CPU: a run's model, optimizer state, RNG
    states and progress saved at an iteration and loaded into a fresh model and optimizer; the tracker file names
    the newest complete checkpoint; a checkpoint is never written over."""
    from megatron_tma.mcore import checkpoint

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    model = _small_gpt("unpadded")
    _randomize(model, 51)
    opt = _megatron_adam(model)
    _adam_steps(model, opt, 51)
    progress = {"losses": [3.5, 3.25], "note": "two steps"}
    torch.manual_seed(5)
    path = checkpoint.save_checkpoint(str(tmp_path), 2, [model], opt, progress=progress)
    assert path == str(tmp_path / "iter_0000002") and checkpoint.latest_iteration(str(tmp_path)) == 2
    expected_draw = torch.rand(4)  # what the run draws next
    with pytest.raises(FileExistsError):
        checkpoint.save_checkpoint(str(tmp_path), 2, [model], opt)
    # issue 34 item 3: nor an earlier iteration (a second run into the same directory): the tracker never moves back
    with pytest.raises(FileExistsError, match="move its tracker back"):
        checkpoint.save_checkpoint(str(tmp_path), 1, [model], opt)
    assert checkpoint.latest_iteration(str(tmp_path)) == 2 and not (tmp_path / "iter_0000001").exists()

    resumed = _small_gpt("unpadded")
    _randomize(resumed, 52)
    opt_resumed = _megatron_adam(resumed)
    _adam_steps(resumed, opt_resumed, 52)
    torch.manual_seed(6)
    iteration, loaded = checkpoint.load_checkpoint(str(tmp_path), [resumed], opt_resumed)
    assert (iteration, loaded) == (2, progress)
    assert torch.equal(torch.rand(4), expected_draw)  # the RNG state came back
    _assert_same_training_state(model, opt, resumed, opt_resumed)
    with pytest.raises(ValueError, match="optim_format"):
        checkpoint.save_checkpoint(str(tmp_path), 3, [model], opt, optim_format="fully_sharded_model_space")
    # what a run killed while saving leaves: a directory the tracker never named, written over when the run gets there
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "iter_0000005" / "half-written").write_text("x")
    checkpoint.save_checkpoint(str(tmp_path), 5, [model], opt, progress=progress)
    assert checkpoint.latest_iteration(str(tmp_path)) == 5 and not (tmp_path / "iter_0000005" / "half-written").exists()
    # Megatron-LM's metadata: no per-sub-optimizer key prefix, no singleton shards, no distributed-optimizer format
    # for a plain optimizer
    metadata = checkpoint._metadata(opt, "dp_reshardable")
    assert metadata["chained_optim_avoid_prefix"] is True and metadata["singleton_local_shards"] is False
    assert "distrib_optim_sharding_type" not in metadata and "dp_cp_group" in metadata


@contextlib.contextmanager
def _megatron_optimizer_on_the_cpu():
    """Megatron's mixed-precision optimizer built and stepped on the CPU: its CUDA-only pieces (the unity loss scale
    tensor it makes on 'cuda', the parameter type check that wants CUDA BF16 tensors) pointed at the CPU."""
    from unittest import mock

    real_tensor, real_type = torch.tensor, torch.Tensor.type

    def tensor(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real_tensor(*args, **kwargs)

    def tensor_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and ".cuda." not in name else name

    with mock.patch.object(torch, "tensor", tensor), mock.patch.object(torch.Tensor, "type", tensor_type):
        yield


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
def test_megatrons_mixed_precision_optimizer_writes_released_expert_weights(gen):
    """megatron_tma.released_weights.attach_optimizer on Megatron's own Float16OptimizerWithFloat16Params (its
    step: the main grads, Adam on the FP32 masters, its copy into the model): the released experts' FP8 copies written
    from the masters, their BF16 memory never back, another BF16 parameter of the same optimizer copied by Megatron's
    own copy; three steps train the bits of the same optimizer over experts that keep their BF16 weights."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_tma import released_weights
    from megatron_tma.mlp import GroupedFP8MLP

    def build(release):
        torch.manual_seed(0)
        experts = GroupedFP8MLP(4, 256, 128, backend="reference", release_bf16_weights=release)
        other = torch.nn.Parameter(torch.randn(64).bfloat16())
        params = [*experts.parameters(), other]
        for p in params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        with _megatron_optimizer_on_the_cpu():
            opt = Float16OptimizerWithFloat16Params(torch.optim.Adam(params, lr=1e-2),
                                                    OptimizerConfig(lr=1e-2, bf16=True, clip_grad=0.0), None,
                                                    lambda o, c=None: None)
        return experts, other, opt

    runs = [build(False), build(True)]
    sizes = torch.tensor([10, 0, 40, 14])
    x = torch.randn(64, 256, generator=gen).bfloat16().requires_grad_()
    with pytest.raises(RuntimeError, match="optimizer over these expert weights is not attached"):
        runs[1][0](x, sizes)  # (its step would copy the masters into freed memory)
    assert not any(released_weights.is_released(p) for p in runs[1][0].parameters())
    assert released_weights.attach_optimizer(runs[1][2]) == 1
    for step in range(3):
        x, dy = torch.randn(64, 256, generator=gen).bfloat16(), torch.randn(64, 256, generator=gen).bfloat16()
        outs = []
        for experts, other, opt in runs:
            xi = x.clone().requires_grad_()
            out, _ = experts(xi, sizes)
            out.backward(dy)
            other.main_grad.copy_(torch.linspace(-1, 1, 64))
            with _megatron_optimizer_on_the_cpu():
                assert opt.step()[0]
            for p in [*experts.parameters(), other]:
                p.main_grad.zero_()
            outs.append([out, xi.grad, other.detach().clone()])
        assert all(torch.equal(u, v) for u, v in zip(*outs)), step
        assert [p.untyped_storage().nbytes() for p in runs[1][0].parameters()] == [0, 0]
    plain, released = runs[0][0].state_dict(), runs[1][0].state_dict()
    assert all(torch.equal(plain[k], released[k]) for k in plain)


def test_rng_tracker_states_round_trip_as_bytes():
    """The checkpoint's RNG tracker states (megatron_tma.mcore.checkpoint): a graph-safe tracker's generators (what a
    CUDA-graphed run seeds) saved as byte states, loaded back into a graph-safe tracker's generators in place (the
    objects a graph registers stay) or into a plain tracker as bytes, and a plain tracker's bytes into generators:
    each draws on as the saved one would. CPU generators stand in for Megatron's CUDA ones (the same Generator API)."""
    from megatron_tma.mcore import checkpoint

    class Tracker:  # Megatron's CudaRNGStatesTracker's get_states / set_states
        def __init__(self, states):
            self.states_ = states

        def get_states(self):
            return dict(self.states_)

        def set_states(self, states):
            self.states_ = states

    def generator(seed):
        return torch.Generator().manual_seed(seed)

    names = ("model-parallel-rng", "expert-parallel-rng")
    graphed = Tracker({n: generator(i) for i, n in enumerate(names)})
    torch.rand(3, generator=graphed.states_[names[0]])  # a drawn-from state, not a fresh seed
    saved = checkpoint.portable_tracker_states(graphed.get_states())
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in saved.values())
    want = {n: torch.rand(4, generator=graphed.states_[n]) for n in names}  # what the saved states draw next

    other = Tracker({n: generator(9) for n in names})
    objects = dict(other.states_)
    checkpoint.restore_tracker_states(other, saved)
    assert all(other.states_[n] is objects[n] for n in names)
    assert all(torch.equal(torch.rand(4, generator=other.states_[n]), want[n]) for n in names)

    plain = Tracker({n: torch.zeros(1, dtype=torch.uint8) for n in names})
    checkpoint.restore_tracker_states(plain, saved)
    for n in names:
        g = torch.Generator()
        g.set_state(plain.states_[n])
        assert torch.equal(torch.rand(4, generator=g), want[n])
    again = Tracker({n: generator(7) for n in names})  # a plain tracker's bytes into a graph-safe one
    checkpoint.restore_tracker_states(again, plain.get_states())
    assert all(torch.equal(torch.rand(4, generator=again.states_[n]), want[n]) for n in names)
    with pytest.raises(RuntimeError, match=r"RNG tracker states \['expert-parallel-rng'\]"):
        checkpoint.restore_tracker_states(Tracker({names[0]: generator(1)}), saved)


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed (the GPU machine carries it)")
def test_run_checkpoint_saves_only_under_its_directorys_lock(megatron_cpu, tmp_path, monkeypatch, another_job_saving):
    """Issue 55 item 5 for megatron_tma.mcore.checkpoint: a second job saving into one directory deleted the first
    one's half-written iteration (never named by the tracker) as a killed run's leftovers. While another live process
    holds the directory's lock the save is refused (SaveDirLocked naming the holder's pid, raised alike on every
    rank) and deletes nothing; the tracker goes through a unique temporary file, never a link planted at the old
    fixed `.tmp` name; a tracker breaking its rule is one line naming it."""
    from megatron_tma.mcore import checkpoint

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    model = _small_gpt("unpadded")
    opt = _megatron_adam(model)
    save = tmp_path / "save"
    holder = another_job_saving(save)
    (save / "iter_0000003").mkdir()
    (save / "iter_0000003" / "half-written").write_text("the other job's")
    with pytest.raises(checkpoint.SaveDirLocked, match=f"pid {holder.pid}"):
        checkpoint.save_checkpoint(str(save), 3, [model], opt)
    assert (save / "iter_0000003" / "half-written").read_text() == "the other job's"
    holder.kill()
    holder.wait()
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    os.symlink(outside, save / (checkpoint.TRACKER_FILE + ".tmp"))
    checkpoint.save_checkpoint(str(save), 3, [model], opt)  # the holder is gone: its leftovers are written over
    assert checkpoint.latest_iteration(str(save)) == 3 and not (save / "iter_0000003" / "half-written").exists()
    assert outside.read_text() == "precious"
    (save / checkpoint.TRACKER_FILE).write_text("\u00b3")
    with pytest.raises(checkpoint.CheckpointFileError, match="ASCII digits"):
        checkpoint.save_checkpoint(str(save), 4, [model], opt)
    checkpoint.release_save_lock(str(save))  # held by this process since its first save; let other tests' go


def test_reference_fallback_on_a_gpu_is_announced(monkeypatch):
    # On the H200 a recipe ran ~10x slow on the reference backend for a build that had silently skipped the extension
    from megatron_tma import _ext

    monkeypatch.setattr(_ext, "cuda_kernels_available", lambda device=None: False)
    with pytest.warns(RuntimeWarning, match="runs the torch reference"):
        assert _ext.warn_if_reference_on_gpu("auto", "cuda:0")
    monkeypatch.setattr(_ext, "cuda_kernels_available", lambda device=None: True)
    assert not _ext.warn_if_reference_on_gpu("auto", "cuda:0")  # the kernels run
    monkeypatch.setattr(_ext, "cuda_kernels_available", lambda device=None: False)
    for backend, device in (("reference", "cuda:0"), ("auto", "cpu"), ("cuda", "cuda:0")):
        assert not _ext.warn_if_reference_on_gpu(backend, device)  # asked for, on the CPU, or an error later


@pytest.mark.parametrize("kw, message", [
    # Megatron's own alternative to Fp8Padding: it routes extra tokens so that counts are multiples of 16/32
    (dict(moe_router_padding_for_quantization=True), "need no padding"),
    (dict(moe_router_padding_for_fp8=True), "need no padding"),
    # memory savings Megatron's own experts implement and these do not
    (dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]), "'expert_fc1'"),
    # settings whose results are not checked: the FP8 weight cache is host logic, CUDA graphs replay without it
    (dict(cuda_graph_impl="local", cuda_graph_modules=[]), "captures megatron_tma's FP8 experts"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn", "moe"]), "cuda_graph_impl"),
    (dict(cuda_graph_impl="full_iteration", cuda_graph_modules=[]), "untested"),
])
def test_settings_that_would_do_nothing_are_flagged(kw, message):
    with pytest.warns(UserWarning, match=message):
        megatron_experts(4, make_config(**kw), mode="unpadded", backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        megatron_experts(4, make_config(), mode="unpadded", backend="reference")
        if "moe_router_padding_for_quantization" in kw:  # BF16 experts: not FP8's padding
            megatron_experts(4, make_config(**kw), mode="bf16", backend="reference")
        megatron_experts(4, make_config(recompute_granularity="selective", recompute_modules=["core_attn"],
                                        fine_grained_activation_offloading=True, offload_modules=["attn_norm"]),
                         mode="unpadded", backend="reference")
        for modules in (["attn"], ["attn", "moe_router", "moe_preprocess"]):  # graphs that stop before the experts
            megatron_experts(4, make_config(cuda_graph_impl="local", cuda_graph_modules=modules), mode="unpadded",
                             backend="reference")
        megatron_experts(4, make_config(cuda_graph_impl="local", cuda_graph_modules=[]), mode="bf16",
                         backend="reference")  # no FP8 weight cache


def test_moe_act_recompute_is_the_fp8_experts_recompute_activation():
    moe_act = dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe_act"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # implemented by the FP8 experts: nothing to warn about
        for mode in ("unpadded", "padded16"):
            assert megatron_experts(4, make_config(**moe_act), mode=mode, backend="reference").recompute_activation
        for kw in (dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
                   dict(recompute_granularity="full", recompute_modules=["moe_act"]), {}):
            assert not megatron_experts(4, make_config(**kw), mode="unpadded", backend="reference").recompute_activation
    with pytest.warns(UserWarning, match="BF16 experts do not implement"):
        megatron_experts(4, make_config(**moe_act), mode="bf16", backend="reference")


def test_deferred_expert_wgrads_are_flushed_before_megatrons_finalize():
    """defer_expert_wgrads outside Megatron's DDP buckets: the experts' backward leaves main_grad alone until
    Megatron's finalize_model_grads_func runs, which first computes every micro-batch's weight gradient in one GEMM
    per linear: the twin's bits, within FP32 rounding of the undeferred experts'; refused without a finalize, and
    beside an overlapped reduction without DDP's bucket groups to tell the last micro-batch."""
    from megatron_tma import testing as T

    calls = []

    def run(mode, defer):
        torch.manual_seed(0)
        config = make_config(finalize_model_grads_func=lambda *a, **k: calls.append(a))
        experts = megatron_experts(4, config, mode=mode, backend="reference")
        chunk = torch.nn.Sequential(experts)
        weights = _ddp_weights(experts)
        if defer:
            assert mcore.defer_expert_wgrads([chunk], config) == 1
            assert mcore.defer_expert_wgrads([chunk], config) == 1  # again: one wrapper, not two
        gen = torch.Generator().manual_seed(1)
        for sizes in ([40, 0, 31, 9], [1, 130, 0, 64]):
            t = sum(sizes)
            x = torch.randn(t, 256, generator=gen).bfloat16().requires_grad_()
            probs = torch.rand(t, generator=gen)
            experts(x, torch.tensor(sizes), probs)[0].backward(torch.randn(t, 256, generator=gen).bfloat16())
        assert all(w.main_grad.any() != defer for w in weights)  # deferred: nothing before the finalize
        n = len(calls)
        config.finalize_model_grads_func([chunk], 1)
        assert len(calls) == n + 1  # Megatron's own finalize still runs, once
        return [w.main_grad.clone() for w in weights]

    plain, deferred, twin = run("unpadded", False), run("unpadded", True), run("padded16", True)
    assert all(torch.equal(u, v) for u, v in zip(deferred, twin))
    assert all(T.diff(u, v) < 1e-10 and not torch.equal(u, v) for u, v in zip(deferred, plain))
    experts = megatron_experts(4, make_config(), backend="reference")
    with pytest.raises(ValueError, match="finalize_model_grads_func, which is not set"):
        mcore.defer_expert_wgrads([experts], make_config(finalize_model_grads_func=None))
    overlapped = torch.nn.Sequential(experts)
    overlapped.ddp_config = types.SimpleNamespace(overlap_grad_reduce=True)
    with pytest.raises(ValueError, match="with overlap_grad_reduce need Megatron's DDP bucket groups"):
        mcore.defer_expert_wgrads([overlapped], make_config(finalize_model_grads_func=print))
    assert mcore.defer_expert_wgrads([torch.nn.Linear(2, 2)], make_config()) == 0


def test_deferred_expert_wgrads_complete_in_megatrons_last_micro_batch():
    """Under Megatron's DDP (its bucket groups' is_last_microbatch, which no_sync clears): the earlier micro-batches
    hand DDP's hooks a dummy already marked added and leave main_grad alone; the last one's backward computes every
    pending gradient before handing its own over, so main_grad is whole when DDP's hook for it runs (an overlapped
    reduction starts there), with the bits the finalize path gives."""
    def run(with_buckets):
        torch.manual_seed(0)
        config = make_config(finalize_model_grads_func=lambda *a, **k: None)
        experts = megatron_experts(4, config, mode="unpadded", backend="reference")
        chunk = torch.nn.Sequential(experts)
        weights = _ddp_weights(experts)
        group = types.SimpleNamespace(is_last_microbatch=True)
        if with_buckets:
            chunk.param_to_bucket_group = {w: group for w in weights}
            chunk.ddp_config = types.SimpleNamespace(overlap_grad_reduce=True)
        mcore.defer_expert_wgrads([chunk], config)
        seen = []  # (grad handed over, flag, main_grad non-zero) at each weight's hook, as DDP's hook sees them
        for w in weights:
            w.register_post_accumulate_grad_hook(
                lambda p: seen.append((p.grad is not None, p.grad_added_to_main_grad, bool(p.main_grad.any()))))
        gen = torch.Generator().manual_seed(1)
        batches = ([40, 0, 31, 9], [1, 130, 0, 64], [7, 7, 7, 7])
        for i, sizes in enumerate(batches):
            group.is_last_microbatch = i == len(batches) - 1  # DDP's no_sync around all but the last
            t = sum(sizes)
            x = torch.randn(t, 256, generator=gen).bfloat16().requires_grad_()
            experts(x, torch.tensor(sizes), torch.rand(t, generator=gen))[0].backward(
                torch.randn(t, 256, generator=gen).bfloat16())
            for w in weights:
                w.grad = None
        config.finalize_model_grads_func([chunk], 1)
        return seen, [w.main_grad.clone() for w in weights]

    seen, in_backward = run(True)
    assert seen[:4] == [(True, True, False)] * 4  # micro-batches 1, 2: a dummy, main_grad untouched
    assert seen[4:] == [(True, True, True)] * 2  # the last: main_grad whole when the hook runs
    _, at_finalize = run(False)
    assert all(torch.equal(u, v) for u, v in zip(in_backward, at_finalize))


def test_the_transpose_flag_reaches_the_fp8_linears():
    """config.moe_megatron_tma_transpose_weights_in_backward (unset: False) -> keep_transposed_weight of both FP8
    linears, in every FP8 mode; anything but a bool is refused with the field named."""
    for mode in ("unpadded", "padded128"):
        plain = megatron_experts(4, make_config(), mode=mode, backend="reference")
        assert plain.linear_fc1.keep_transposed_weight and plain.linear_fc2.keep_transposed_weight
        config = make_config()
        setattr(config, mcore.TRANSPOSE_FLAG, True)
        experts = megatron_experts(4, config, mode=mode, backend="reference")
        assert not experts.linear_fc1.keep_transposed_weight and not experts.linear_fc2.keep_transposed_weight
    setattr(config, mcore.TRANSPOSE_FLAG, 1)
    with pytest.raises(TypeError, match="moe_megatron_tma_transpose_weights_in_backward must be a bool"):
        megatron_experts(4, config, backend="reference")


def test_the_refresh_flag_gives_step_refreshed_weights_with_the_same_bits(gen):
    """config.moe_megatron_tma_step_refreshed_weights (unset: False) -> both FP8 linears keep their copies in
    StepRefreshedWeights; a forward + backward, an optimizer step and another give the default experts' bits."""
    from megatron_tma.weight_refresh import StepRefreshedWeights

    config = make_config()
    plain = megatron_experts(4, config, backend="reference")
    with torch.no_grad():
        for w in plain.parameters():
            w.normal_(0.0, 0.05, generator=gen)
    setattr(config, mcore.REFRESH_FLAG, True)
    refreshed = megatron_experts(4, config, backend="reference")
    assert isinstance(refreshed.linear_fc1.weight_cache, StepRefreshedWeights)
    assert isinstance(refreshed.linear_fc2.weight_cache, StepRefreshedWeights)
    refreshed.load_state_dict(plain.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, refreshed)]
    h = config.hidden_size
    sizes = torch.tensor([30, 0, 50, 20])
    for _ in range(2):
        x = torch.randn(100, h, generator=gen).bfloat16()
        probs, dy = torch.rand(100, generator=gen), torch.randn(100, h, generator=gen).bfloat16()
        outs = []
        for m, opt in zip((plain, refreshed), opts):
            opt.zero_grad()
            xi = x.clone().requires_grad_()
            out, _ = m(xi, sizes, probs)
            out.backward(dy)
            opt.step()
            outs.append([out, xi.grad] + [w.clone() for w in m.parameters()])
        assert all(torch.equal(u, v) for u, v in zip(*outs))
    setattr(config, mcore.REFRESH_FLAG, "yes")
    with pytest.raises(TypeError, match="moe_megatron_tma_step_refreshed_weights must be a bool"):
        megatron_experts(4, config, backend="reference")


def test_the_release_flag_gives_released_bf16_weights(gen):
    """config.moe_megatron_tma_release_bf16_weights (unset: False) -> both FP8 linears free their BF16 weights after
    a training forward (megatron_tma.released_weights); the experts' output is the default experts' bits, and
    together with the refresh flag it is refused by the module with both names."""
    from megatron_tma import released_weights

    config = make_config()
    plain = megatron_experts(4, config, backend="reference")
    setattr(config, mcore.RELEASE_FLAG, True)
    released = megatron_experts(4, config, backend="reference")
    assert isinstance(released.linear_fc1.weight_cache, released_weights.ReleasedBF16Weights)
    released.load_state_dict(plain.state_dict())
    x = torch.randn(100, config.hidden_size, generator=gen).bfloat16()
    sizes, probs = torch.tensor([30, 0, 50, 20]), torch.rand(100, generator=gen)
    outs = []
    for m in (plain, released):
        xi = x.clone().requires_grad_()
        out, _ = m(xi, sizes, probs)
        out.sum().backward()
        outs.append([out, xi.grad])
    assert all(torch.equal(u, v) for u, v in zip(*outs))
    assert all(released_weights.is_released(w) for w in released.parameters())
    assert not any(released_weights.is_released(w) for w in plain.parameters())
    setattr(config, mcore.REFRESH_FLAG, True)
    with pytest.raises(ValueError, match="release_bf16_weights and step_refreshed_weights exclude each other"):
        megatron_experts(4, config, backend="reference")
    setattr(config, mcore.RELEASE_FLAG, "yes")
    with pytest.raises(TypeError, match="moe_megatron_tma_release_bf16_weights must be a bool"):
        megatron_experts(4, config, backend="reference")


@pytest.mark.skipif(not __import__("megatron_tma")._ext.cuda_kernels_available(),
                    reason="needs an sm_90 GPU and the built extension")
def test_pipeline_warm_up_holds_one_fp8_copy_on_the_gpu():
    """On the kernels: three warm-up forwards (DDP's flag False, no backward yet) add only their activations to the
    memory in use, not a W^T copy each (each Function keeps the copy it was given for its dgrad)."""
    experts = megatron_experts(8, make_config(hidden_size=1024, moe_ffn_hidden_size=512, use_cpu_initialization=False),
                               backend="cuda")
    _ddp_weights(experts)
    for w in experts.parameters():
        w.main_grad = w.main_grad.cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.tensor([40, 0, 31, 9, 64, 1, 50, 61], device="cuda")
    x = torch.randn(int(sizes.sum()), 1024, generator=g, device="cuda").bfloat16().requires_grad_()
    probs = torch.rand(x.shape[0], generator=g, device="cuda")
    outs = [experts(x, sizes, probs)[0]]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outs += [experts(x, sizes, probs)[0] for _ in range(2)]
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    qt_bytes = sum(w.numel() for w in experts.parameters())  # one FP8 byte per weight for each W^T copy (12.6 MB)
    # Two forwards' saved activations: 6.4 MB on the H200 (their wgrad operands padded to 128-token group starts,
    # docs/design.md §4); a W^T copy kept per forward would add 2 x 12.6 MB on top
    assert grown < qt_bytes, (grown, qt_bytes)
    sum(o.float().sum() for o in outs).backward()


def test_distributed_optimizer_load_keeps_each_adam_step(monkeypatch):
    """The loader's guard around megatron-core 0.19's DistributedOptimizer.load_state_dict with torch's Adam
    (megatron_tma.mcore.checkpoint), on a stand-in with its load's behaviour: the step from the param groups put
    into every state as ONE shared tensor, then the per-parameter setter copying the checkpoint entries' `step` (a
    stale non-persistent 0 in dp_reshardable, absent in fully_reshardable) over it. On the H200 the unguarded
    dp_reshardable resume parted from the uninterrupted run at its first step. After the guarded load every state
    holds the checkpoint's step in a tensor of its own (torch's Adam adds 1 to each in place)."""
    from megatron_tma.mcore import checkpoint

    if HAVE_MEGATRON:  # megatron-core's torch-Adam branch, also where Transformer Engine is installed (GPU machines)
        from megatron.core.optimizer import distrib_optimizer

        monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]

    class DistributedOptimizer:  # the name the guard recognises
        def __init__(self):
            self.optimizer = torch.optim.Adam(params)
            self.model_param_group_index_map = {i: (0, i) for i in range(3)}

        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            main = self.optimizer.param_groups[0]["params"][model_param]
            for key, dst in self.optimizer.state[main].items():
                dst.copy_(tensors[key])  # KeyError where an entry has no step, as megatron-core's setter

        def load_state_dict(self, entries):
            shared = torch.tensor(6.0)  # the param groups' step, one tensor for all states
            for p in params:
                self.optimizer.state[p] = {"step": shared, "exp_avg": torch.zeros(4)}
            for i, entry in enumerate(entries):
                self._set_main_param_and_optimizer_states(i, entry)

    stale = [{"step": torch.tensor(0.0), "exp_avg": torch.full((4,), float(i))} for i in range(3)]
    for entries in (stale, [{"exp_avg": e["exp_avg"]} for e in stale]):  # dp_reshardable, fully_reshardable
        opt = DistributedOptimizer()
        with checkpoint._torch_adam_steps_survive_the_load(opt):
            opt.load_state_dict(entries)
        steps = [opt.optimizer.state[p]["step"] for p in params]
        assert all(float(s) == 6.0 for s in steps)
        assert len({id(s) for s in steps}) == 3  # not shared
        assert all(torch.equal(opt.optimizer.state[p]["exp_avg"], stale[i]["exp_avg"]) for i, p in enumerate(params))
        assert "_set_main_param_and_optimizer_states" not in vars(opt)  # the class's setter again
    if HAVE_MEGATRON:  # with Apex or Transformer Engine, megatron-core's fused Adams keep no step per state: no guard
        monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
        assert checkpoint._distributed_optimizers(DistributedOptimizer()) == []
