"""Megatron-LM's switch, with no change to Megatron-LM:

    torchrun ... pretrain_gpt.py <the usual MoE arguments> --spec megatron_tma.mcore.megatron_lm unpadded

(or `padded16` / `padded128`, the padded twins, or `bf16`). Megatron-LM imports the module named by `--spec` and
takes the named attribute of it as the layer spec (`megatron.core.transformer.spec_utils.import_module`), after the
arguments are parsed. So this module, when imported, gives as the attribute named by the mode the spec Megatron-LM's
GPT builder would have chosen for the MoE model (`spec.megatron_lm_spec`) with megatron_tma's experts. Everything
else (attention, the router, the token dispatcher, the dense layers, Transformer Engine or local modules, FP8 of the
dense layers through `--fp8`) stays as the arguments say.

When the import comes matters. megatron-core 0.19's `pretrain_gpt.py` imports it in `gpt_config_from_args`, before
`initialize_megatron` sets up the parallel state that a block spec needs (the layers of this pipeline stage), and
its `GPTModelBuilder` accepts a callable spec, which it calls per model chunk with `(model_config, vp_stage=...)` when
it builds the model. So with no parallel state yet the attribute is that callable (the refusals run at the import);
where the parallel state is set up (an older builder that imports `--spec` inside the model provider, or a caller
that imports it there) it is the spec itself.

Import it only from Megatron-LM's builder: it reads Megatron-LM's global arguments (`megatron.training.get_args`),
which needs Python >= 3.12 like `megatron.training` itself. Elsewhere use `megatron_lm_spec` or
`use_megatron_tma_experts`.
"""
from megatron.core import parallel_state
from megatron.training import get_args
from megatron.training.arguments import core_transformer_config_from_args

from .config import MODES
from .spec import check_megatron_lm_spec, megatron_lm_spec


def _builder_spec(args, mode: str):
    """The callable spec megatron-core 0.19's `GPTModelBuilder.build_model` calls for each model chunk."""

    def megatron_tma_spec(model_config, vp_stage=None):
        return megatron_lm_spec(args, model_config.transformer, mode, vp_stage=vp_stage)

    megatron_tma_spec.__qualname__ = f"{__name__}.{mode}"
    return megatron_tma_spec


def _specs():
    """{mode: spec}: the mode `--spec` names when it names this module, else every mode."""
    args = get_args()  # raises unless Megatron-LM has parsed its arguments
    named = list(args.spec or [])
    modes = [named[1]] if len(named) == 2 and named[0] == __name__ else list(MODES)
    if len(named) != 2 and named[:1] == [__name__]:
        raise ValueError(f"--spec {__name__} MODE: name one mode of {', '.join(MODES)}")
    config = core_transformer_config_from_args(args)
    if not parallel_state.model_parallel_is_initialized():  # megatron-core 0.19's pretrain_gpt.py: see above
        for mode in modes:
            check_megatron_lm_spec(args, config, mode)
        return {mode: _builder_spec(args, mode) for mode in modes}
    return {mode: megatron_lm_spec(args, config, mode) for mode in modes}


globals().update(_specs())
