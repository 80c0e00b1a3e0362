"""Run by tests/test_megatron_lm_patch.py in a process of its own, with a patched copy of Megatron-LM's files first
on PYTHONPATH: what pretrain_gpt.py (megatron-core 0.19) does up to the model, once per scenario. Megatron-LM's
parser and validation (`parse_and_validate_args`), the model config (`gpt_config_from_args`, which imports `--spec`
before the parallel state exists, as pretrain_gpt.py calls it), the parallel state, then `GPTModelBuilder.build_model`.
Prints one JSON line: the arguments.py it ran, and per scenario the parsed flag, the config field, the experts each
layer got, or the error.

    python tests/_megatron_lm_flag_probe.py '[{"argv": [...], "step": false}, ...]'
"""
import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MARK = "MEGATRON_LM_FLAG_PROBE "


def _describe(experts) -> dict:
    kind = type(experts)
    return {"class": kind.__name__, "module": kind.__module__, "pad_to": getattr(experts, "pad_to", None)}


def _step(experts) -> bool:
    """A forward and backward of one layer's experts on Megatron's forward contract (the reference backend on the
    CPU): finite, and every weight got a gradient."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    x = torch.randn(128, 256, generator=gen).bfloat16().requires_grad_()
    out = experts(x, torch.tensor([50, 0, 77, 1]), torch.rand(128, generator=gen))[0]
    out.float().square().mean().backward()
    return bool(torch.isfinite(out).all()) and all(p.grad is not None and p.grad.abs().sum() > 0
                                                   for p in experts.parameters())


def _run(scenario: dict) -> dict:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import global_vars
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    sys.argv = ["pretrain_gpt.py", *scenario["argv"]]
    out = {}
    try:
        args = parse_and_validate_args()
    except SystemExit as e:  # argparse refused the command line
        return {"exit": e.code}
    try:
        out["impl"] = args.moe_experts_impl
        if scenario.get("config") == "hybrid":  # pretrain_hybrid.py's model config
            from megatron.training.argument_utils import hybrid_config_from_args

            hybrid_config_from_args(args)
            return out
        if scenario.get("config") == "other_builder":  # a model config whose builder is not GPTModelBuilder
            import dataclasses
            from typing import ClassVar

            from megatron.training.models.gpt import GPTModelConfig

            other = dataclasses.dataclass(kw_only=True)(type("OtherGPTModelConfig", (GPTModelConfig,), {
                "__annotations__": {"builder": ClassVar[str]}, "builder": "elsewhere.OtherGPTModelBuilder"}))
            gpt_config_from_args(args, model_config_cls=other)
            return out
        config = gpt_config_from_args(args)  # before the parallel state, as pretrain_gpt.py
        out["config_impl"] = config.moe_experts_impl
        out["spec"] = type(config.transformer_layer_spec).__name__
        parallel_state.initialize_model_parallel()  # pretrain(): initialize_megatron, then the model
        config.transformer.perform_initialization = False  # Megatron's CUDA RNG tracker needs a GPU
        model = GPTModelBuilder(config).build_model(ProcessGroupCollection.use_mpu_process_groups())
        out["experts"] = [_describe(layer.mlp.experts) for layer in model.decoder.layers]
        mtp = getattr(model, "mtp", None)
        if mtp is not None:
            out["mtp_experts"] = [_describe(layer.mtp_model_layer.mlp.experts) for layer in mtp.layers]
        if scenario.get("step"):
            out["step"] = _step(model.decoder.layers[0].mlp.experts)
    except Exception as e:  # noqa: BLE001 (the test asserts on the message)
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        destroy_num_microbatches_calculator()
        global_vars.unset_global_variables()
        sys.modules.pop("megatron_tma.mcore.megatron_lm", None)  # it builds its specs when imported
    return out


def main() -> None:
    scenarios = json.loads(sys.argv[1])
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # --moe-grouped-gemm asks for Hopper
    os.environ.update(WORLD_SIZE="1", RANK="0")
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    try:
        results = [_run(s) for s in scenarios]
    finally:
        dist.destroy_process_group()
    import megatron.training.arguments

    print(MARK + json.dumps({"arguments_py": megatron.training.arguments.__file__, "results": results}), flush=True)


if __name__ == "__main__":
    main()
