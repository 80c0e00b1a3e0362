"""Megatron-LM's switch, with no change to Megatron-LM:

    torchrun ... pretrain_gpt.py <the usual MoE arguments> --spec megatron_tma.mcore.megatron_lm unpadded

(or `padded16` / `padded128`, the padded twins, or `bf16`). Megatron-LM's GPT builder imports the module named by
`--spec` and takes the named attribute of it as the layer spec (`megatron.core.transformer.spec_utils.import_module`),
after the arguments are parsed and the parallel state is set up. So this module, when imported, builds from those
arguments the spec that builder would have chosen for the MoE model (`spec.megatron_lm_spec`) with megatron_tma's
experts, as the attribute named by the mode. Everything else (attention, the router, the token dispatcher, the
dense layers, Transformer Engine or local modules, FP8 of the dense layers through `--fp8`) stays as the arguments say.

Import it only from Megatron-LM's builder: it reads Megatron-LM's global arguments (`megatron.training.get_args`),
which needs Python >= 3.12 like `megatron.training` itself. Elsewhere use `megatron_lm_spec` or
`use_megatron_tma_experts`.
"""
from megatron.training import get_args
from megatron.training.arguments import core_transformer_config_from_args

from .config import MODES
from .spec import megatron_lm_spec


def _specs():
    """{mode: spec}: the mode `--spec` names when it names this module, else every mode."""
    args = get_args()  # raises unless Megatron-LM has parsed its arguments
    named = list(args.spec or [])
    modes = [named[1]] if len(named) == 2 and named[0] == __name__ else list(MODES)
    if len(named) != 2 and named[:1] == [__name__]:
        raise ValueError(f"--spec {__name__} MODE: name one mode of {', '.join(MODES)}")
    config = core_transformer_config_from_args(args)
    return {mode: megatron_lm_spec(args, config, mode) for mode in modes}


globals().update(_specs())
