"""megatron-core's modules for the GPU job, imported only by it (`import_megatron`, from the launch's checks):
the CPU job, --plot, --compare and --same-bits run without megatron-core. The modules that build and train
read them as this module's attributes (`mc.GPTModel`), which exist once `import_megatron()` ran."""
import importlib
import importlib.util

import torch


def import_megatron():
    """Import the megatron-core modules the GPU job uses, as this module's globals; the import's error, or None.
    Only the GPU job imports them (preflight), so the CPU job (--cpu), --plot, --compare and --same-bits run without
    megatron-core, and a missing one stops the GPU job with one line before any distributed set-up."""
    global parallel_state, DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads, GPTModel
    global get_gpt_layer_local_spec, OptimizerConfig, get_megatron_optimizer, get_forward_backward_func
    global get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name, model_parallel_cuda_manual_seed
    global Float16Module, TransformerConfig, layer_spec_from_config, gpt_layer_specs
    global TransformerBlockSubmodules, get_num_layers_to_build
    try:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name, model_parallel_cuda_manual_seed)
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron_tma.mcore import layer_spec_from_config
    except Exception as e:  # not installed, a missing dependency (psutil), or a Python it does not run on
        return e
    return None


MEGATRON_PYTHON = (3, 12)  # megatron-core 0.19's requires-python


def te_import_error():
    """The error importing Transformer Engine's PyTorch API raises, or None. Checked before megatron-core is imported
    (megatron-core picks its TE code paths at import), only for --transformer-impl transformer_engine: TE is an
    optional extra, never needed by the local spec or the CPU job."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # not installed, or its library does not load (no GPU driver, a CUDA mismatch)
        return e
    return None


def extension_import_error(name):
    """`Type: first line` of the error importing the module `name`, or None (a compiled extension such as Apex's
    fused_weight_gradient_mlp_cuda: missing, or built for another torch)."""
    try:
        importlib.import_module(name)
    except Exception as e:  # ImportError, or the OSError / RuntimeError of a library that does not load
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None


def environment():
    """The versions of the packages around the GPU job (None: not installed): megatron-core picks TE's modules and
    optimizer where TE imports and Apex's where only Apex does, so a result says which it ran with."""
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    apex = importlib.util.find_spec("apex") is not None
    return {"torch": torch.__version__, "megatron_core": version("megatron-core"),
            "transformer_engine": version("transformer-engine") or version("transformer_engine")
            or (te_version() if te_import_error() is None else None),
            "apex": apex, "apex_wgrad_fusion": apex and extension_import_error("fused_weight_gradient_mlp_cuda") is None}


def te_version():
    import transformer_engine

    return getattr(transformer_engine, "__version__", "unknown")
