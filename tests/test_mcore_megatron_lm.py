"""Megatron-LM's switch `--spec megatron_tma.mcore.megatron_lm MODE` on the CPU: Megatron-LM's own argument parser
and validation, its own `--spec` importer, and the GPT model built from what it returns, trained for a step on the
reference backend. Needs megatron-core with `megatron.training` (Python >= 3.12); skipped otherwise."""
import functools
import importlib
import os
import sys
import warnings

import pytest
import torch

from megatron_tma import mcore
from megatron_tma.mcore import megatron_experts

try:
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl|DEPRECATED|deprecated).*")
    from megatron.training import global_vars
    from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
except Exception as e:  # noqa: BLE001 (not installed, or Python < 3.12: typing.override)
    if os.environ.get("MEGATRON_TMA_REQUIRE_MEGATRON_LM") == "1":  # CI's Python 3.12 step: a skip would hide it
        raise
    pytest.skip(f"megatron.training is not importable: {e}", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("megatron_cpu")  # Megatron-LM builds the spec with the parallel state set up
MODULE = "megatron_tma.mcore.megatron_lm"
# a small MoE GPT as Megatron-LM's pretrain_gpt.py would be launched for it
ARGV = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "128", "--moe-grouped-gemm", "--swiglu", "--disable-bias-linear", "--bf16",
        "--transformer-impl", "local", "--moe-token-dispatcher-type", "allgather", "--normalization", "RMSNorm",
        "--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
        "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]


@pytest.fixture
def megatron_lm_args(monkeypatch):
    """Parse and validate `ARGV + extra` with Megatron-LM's own function, which makes them its global arguments."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))  # --moe-grouped-gemm asks
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")

    def parse(*extra, drop=()):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *[a for a in ARGV if a not in drop], *extra])
        return parse_and_validate_args()  # also sets Megatron-LM's globals: the arguments, the tokenizer, ...

    yield parse
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    destroy_num_microbatches_calculator()  # Megatron-LM sets these up once per process
    global_vars.unset_global_variables()
    sys.modules.pop(MODULE, None)  # the module builds its specs when imported


def _moe_experts(spec):
    return [layer.submodules.mlp.keywords["submodules"].experts for layer in spec.layer_specs]


def test_spec_is_megatron_lms_block_spec_with_megatron_tma_experts(megatron_lm_args):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    args = megatron_lm_args()
    config = core_transformer_config_from_args(args)
    spec = mcore.megatron_lm_spec(args, config, "padded16")
    theirs = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    assert len(spec.layer_specs) == len(theirs.layer_specs) == 2
    for experts in _moe_experts(spec):
        assert isinstance(experts, functools.partial) and experts.func is megatron_experts
        assert experts.keywords == {"mode": "padded16", "backend": "auto"}
    for ours, base in zip(spec.layer_specs, theirs.layer_specs):  # everything but the experts is Megatron-LM's
        assert ours.submodules.self_attention == base.submodules.self_attention
        assert ours.submodules.mlp.keywords["submodules"].router == base.submodules.mlp.keywords["submodules"].router
    assert spec.layer_norm == theirs.layer_norm


@pytest.mark.parametrize("args_change, config_change, mode, message", [
    ({}, {}, "fp8", "MODE must be one of"),
    ({"num_experts": None}, {}, "unpadded", "need an MoE model"),
    ({"add_bias_linear": True}, {"add_bias_linear": True}, "unpadded", "add_bias_linear"),
    ({"virtual_pipeline_model_parallel_size": 2}, {"moe_layer_freq": [0, 1]}, "unpadded", "--moe-layer-freq"),
])
def test_spec_refusals_name_the_argument(megatron_lm_args, args_change, config_change, mode, message):
    args = megatron_lm_args()
    config = core_transformer_config_from_args(args)
    vars(args).update(args_change)  # after Megatron-LM's own validation, which refuses some of these itself
    vars(config).update(config_change)
    with pytest.raises(ValueError, match=message):
        mcore.megatron_lm_spec(args, config, mode)


def test_spec_with_virtual_pipeline_stages_is_a_layer_spec(megatron_lm_args, monkeypatch):
    """With virtual pipeline stages the builder's block spec depends on the model chunk, and `--spec` gives one
    object: a layer spec (every layer the same), which TransformerBlock repeats for each chunk's own layers, with the
    final norm the builder's block spec names. Refused where it would not build what the builder builds."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_layer import TransformerLayer

    args = megatron_lm_args()
    config = core_transformer_config_from_args(args)
    args.virtual_pipeline_model_parallel_size = 2  # after Megatron-LM's validation, which needs 2+ pipeline ranks
    if transformer_block.LayerNormImpl is not gpt_layer_specs.LNImpl:
        # Transformer Engine importable: TransformerBlock's final norm for a layer spec is TENorm, while Megatron-LM's
        # local builder names its own norm; a layer spec would build another model, so it is refused, naming both
        with pytest.raises(ValueError, match=f"final norm {transformer_block.LayerNormImpl.__name__}, Megatron-LM's "
                                             f"builder {gpt_layer_specs.LNImpl.__name__}"):
            mcore.megatron_lm_spec(args, config, "padded16")
        return
    spec = mcore.megatron_lm_spec(args, config, "padded16")
    assert spec.module is TransformerLayer
    assert spec.submodules.mlp.keywords["submodules"].experts.keywords["mode"] == "padded16"
    theirs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm")[0]
    for name in ("input_layernorm", "self_attention", "pre_mlp_layernorm"):  # all but the experts are the builder's
        assert getattr(spec.submodules, name) == getattr(theirs.submodules, name)
    assert spec.submodules.mlp.keywords["submodules"].router == theirs.submodules.mlp.keywords["submodules"].router
    monkeypatch.setattr(transformer_block, "LayerNormImpl", type("OtherNorm", (), {}))
    with pytest.raises(ValueError, match="final norm OtherNorm"):
        mcore.megatron_lm_spec(args, config, "padded16")


def test_spec_flag_through_megatron_lms_importer_builds_trainable_experts(megatron_lm_args):
    """What Megatron-LM's GPT builder does with `--spec M NAME`: `import_module(args.spec)`, then GPTModel."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import import_module

    args = megatron_lm_args("--spec", MODULE, "unpadded")
    spec = import_module(args.spec)
    assert spec is not None and [e.keywords["mode"] for e in _moe_experts(spec)] == ["unpadded", "unpadded"]
    assert not hasattr(sys.modules[MODULE], "padded16")  # only the mode --spec names is built
    config = core_transformer_config_from_args(args)
    config.perform_initialization = False  # it draws under Megatron's CUDA RNG tracker, which needs a GPU; set below
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                   max_sequence_length=args.max_position_embeddings)
    experts = [layer.mlp.experts for layer in gpt.decoder.layers]
    assert all(isinstance(e, mcore.MegatronFP8Experts) for e in experts)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    # Megatron's attention and router need a GPU (the global memory buffer, the router's CUDA RNG), so the experts
    # run alone here, on Megatron's forward contract (the reference backend on the CPU); the GPU tests run the model
    sizes = torch.tensor([50, 0, 77, 1])
    x = torch.randn(128, 256, generator=gen).bfloat16().requires_grad_()
    probs = torch.rand(128, generator=gen)
    loss = sum(e(x, sizes, probs)[0].float().square().mean() for e in experts)
    loss.backward()
    assert torch.isfinite(loss) and x.grad is not None and x.grad.abs().sum() > 0
    for e in experts:  # the FP8 weight gradients reached the expert weights
        grads = [p.grad for p in e.parameters()]
        assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_spec_imported_before_the_parallel_state_is_a_callable_for_the_builder(megatron_lm_args, monkeypatch):
    """megatron-core 0.19's pretrain_gpt.py imports `--spec` in `gpt_config_from_args`, before `initialize_megatron`
    sets up the parallel state that a block spec needs: the module then gives the callable `GPTModelBuilder` calls per
    model chunk, `(model_config, vp_stage=...)`, after running the refusals. (tests/test_megatron_lm_patch.py builds
    the model through that builder.)"""
    import inspect
    import types

    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import import_module

    args = megatron_lm_args("--spec", MODULE, "unpadded")
    with monkeypatch.context() as m:
        m.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
        spec = import_module(args.spec)
    assert callable(spec) and "vp_stage" in inspect.signature(spec).parameters
    config = core_transformer_config_from_args(args)
    built = spec(types.SimpleNamespace(transformer=config), vp_stage=None)
    assert [e.keywords["mode"] for e in _moe_experts(built)] == ["unpadded", "unpadded"]
    assert len(built.layer_specs) == len(mcore.megatron_lm_spec(args, config, "unpadded").layer_specs)
    sys.modules.pop(MODULE)
    args.spec = [MODULE, "fp8"]  # refused at the import, as before
    with monkeypatch.context() as m, pytest.raises(ValueError, match="MODE must be one of"):
        m.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
        importlib.import_module(MODULE)


def test_spec_names_one_mode(megatron_lm_args):
    megatron_lm_args("--spec", MODULE)
    with pytest.raises(ValueError, match="name one mode"):
        importlib.import_module(MODULE)



TE_FP8 = ("--transformer-impl", "transformer_engine", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_megatron_lm_model_unpadded_equals_padded16_on_the_gpu(megatron_lm_args, monkeypatch, impl):
    """The whole GPT Megatron-LM builds from `--spec megatron_tma.mcore.megatron_lm MODE`, on the GPU with the CUDA
    kernels: a forward and backward step of the unpadded experts equals the padded16 twin's bit for bit (loss and
    every gradient), from the same weights on the same tokens (top-2: Megatron's combine is exact in any order).
    `transformer_engine`: TE's layer spec with TE FP8 blockwise around the experts (issue 33; skipped without TE)."""
    from megatron_tma._ext import cuda_kernels_available

    if not cuda_kernels_available():
        pytest.skip("needs an sm_90 GPU with the extension built")
    te_args = ()
    if impl == "transformer_engine":
        pytest.importorskip("transformer_engine.pytorch")
        monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # TE's attention: deterministic kernels
        te_args = TE_FP8
    # Megatron-LM's fused masked softmax is a CUDA extension of its own (not built here): the torch softmax runs.
    # No dropout: the two modes' steps must see the same function (the RNG is also re-seeded before each).
    args = megatron_lm_args("--no-masked-softmax-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
                            *te_args, drop=("--use-cpu-initialization",) if te_args else ())  # TE's modules: on the GPU
    results, state = {}, None
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the recipe: the rest of the model must not vary
    try:
        for mode in ("unpadded", "padded16"):
            results[mode], state = _megatron_lm_step(args, mode, state)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    (loss_u, grads_u), (loss_p, grads_p) = results["unpadded"], results["padded16"]
    assert torch.isfinite(loss_u) and torch.equal(loss_u, loss_p)
    assert grads_u.keys() == grads_p.keys() and any("experts" in n for n in grads_u)
    for name in grads_u:
        assert torch.equal(grads_u[name], grads_p[name]), name


def _megatron_lm_step(args, mode, state):
    """One forward and backward of the GPT Megatron-LM builds with `mode`'s experts: (loss, grads), weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    model_parallel_cuda_manual_seed(1234)  # Megatron's CUDA RNG tracker (attention forks it), as pretrain_gpt.py sets up
    config = core_transformer_config_from_args(args)
    config.perform_initialization = False  # the weights are set below, the same in both modes
    gpt = GPTModel(config=config, transformer_layer_spec=mcore.megatron_lm_spec(args, config, mode),
                   vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings)
    if state is None:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in gpt.parameters():
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        state = gpt.state_dict()
    else:
        gpt.load_state_dict(state)
    model = Float16Module(config, gpt.cuda())
    assert isinstance(gpt.decoder.layers[0].mlp.experts, mcore.MegatronFP8Experts)
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, 512, (2, 64), generator=gen).cuda()
    position_ids = torch.arange(64, device="cuda").expand(2, -1)
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    grads = {n: p.grad for n, p in gpt.named_parameters() if p.grad is not None}
    return (loss.detach(), grads), state


@pytest.mark.parametrize("ffn, message", [("256", None), ("128", "each rank holds 64 of the FFN columns")])
def test_spec_with_expert_tensor_parallelism(megatron_lm_args, monkeypatch, ffn, message):
    """`--expert-tensor-parallel-size 2` (validated by Megatron-LM as for 2 ranks): the spec builds when each rank's
    share of the expert FFN is a multiple of 128, and is refused, naming the sizes, when it is not."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = megatron_lm_args("--expert-tensor-parallel-size", "2", "--moe-ffn-hidden-size", ffn)
    config = core_transformer_config_from_args(args)
    assert config.expert_tensor_parallel_size == 2
    if message is None:
        assert len(_moe_experts(mcore.megatron_lm_spec(args, config, "unpadded"))) == 2
    else:
        with pytest.raises(ValueError, match=message):
            mcore.megatron_lm_spec(args, config, "unpadded")
