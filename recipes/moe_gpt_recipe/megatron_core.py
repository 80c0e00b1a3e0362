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
    global TransformerBlockSubmodules, get_num_layers_to_build, FullCudaGraphWrapper, get_shared_capture_stream
    try:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper, get_shared_capture_stream
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


def import_error(name):
    """The error importing the module `name` raises, or None: not installed, or a compiled library that does not load
    (no GPU driver, a CUDA mismatch, an extension built for another torch)."""
    try:
        importlib.import_module(name)
    except Exception as e:  # ImportError, or the OSError / RuntimeError of a library that does not load
        return e
    return None


def te_import_error():
    """Transformer Engine's PyTorch API's import error, or None. Checked before megatron-core is imported
    (megatron-core picks its TE code paths at import), only for --transformer-impl transformer_engine: TE is an
    optional extra, never needed by the local spec or the CPU job."""
    return import_error("transformer_engine.pytorch")


def extension_import_error(name):
    """`Type: first line` of `import_error(name)` (Apex's fused_weight_gradient_mlp_cuda, for one line), or None."""
    e = import_error(name)
    return None if e is None else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def environment():
    """The versions of the packages around the GPU job (None: not installed): megatron-core picks TE's modules and
    optimizer where TE imports and Apex's where only Apex does, so a result says which it ran with."""
    from importlib import metadata

    def version(*dists):
        for dist in dists:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
        return None

    apex = importlib.util.find_spec("apex") is not None
    return {"torch": torch.__version__, "megatron_core": version("megatron-core"),
            "transformer_engine": version("transformer-engine", "transformer-engine-torch"),
            "apex": apex, "apex_wgrad_fusion": apex and extension_import_error("fused_weight_gradient_mlp_cuda") is None}
