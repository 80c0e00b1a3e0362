"""patches/: Megatron-LM's `--moe-experts-impl` flag for megatron-core 0.19.

* The patch applies to the files of the megatron-core 0.19 wheel (which ships `megatron/training`: the argument
  parser, `gpt_config_from_args`, `GPTModelBuilder`, the files the patch touches), through `patches/apply.sh`, and
  comes out again; other versions and changed files are refused. Needs only those files (any Python).
* The hook the patched builder calls (`megatron_tma.mcore.experts_impl`) on megatron-core's own specs: block, layer
  and multi-token-prediction specs. Needs megatron-core.
* On the patched copy, in a process of its own, what pretrain_gpt.py does up to the model: the flag parses (and a
  wrong value is refused by argparse), reaches the model config, and the built GPT's MoE layers hold megatron_tma's
  experts in the named mode (the multi-token-prediction layer's too), Megatron's own without it; `--spec
  megatron_tma.mcore.megatron_lm MODE` keeps working in that flow. Needs `megatron.training` (Python >= 3.12); CI's
  Python 3.12 step runs it with MEGATRON_TMA_REQUIRE_MEGATRON_LM=1, where a skip is an error.
"""
import difflib
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_tma.mcore import experts_impl, megatron_experts

REPO = Path(__file__).resolve().parent.parent
APPLY = REPO / "patches" / "apply.sh"
PATCH = REPO / "patches" / "megatron-lm-0.19.2-moe-experts-impl.patch"
PATCHED = ("megatron/training/arguments.py", "megatron/training/argument_utils.py", "megatron/training/models/gpt.py")
REQUIRED = os.environ.get("MEGATRON_TMA_REQUIRE_MEGATRON_LM") == "1"  # CI's Python 3.12 step


def _skip_or_fail(why: str):
    if REQUIRED:
        pytest.fail(why)
    pytest.skip(why)


def _megatron_root():
    """The folder holding the installed megatron-core's `megatron/` (CI: .ci-megatron/site), and its version."""
    spec = importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core")
    if not spec or not spec.origin:
        return None, None
    root = Path(spec.origin).parent.parent.parent
    info = (root / "megatron/core/package_info.py").read_text()
    version = ".".join(re.search(rf"^{k} = (\d+)", info, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    return root, version


@pytest.fixture(scope="module")
def megatron_root():
    root, version = _megatron_root()
    if root is None:
        _skip_or_fail("megatron-core is not installed (CI unpacks its 0.19.2 wheel under .ci-megatron/site)")
    if not version.startswith("0.19.") or not all((root / f).is_file() for f in PATCHED):
        _skip_or_fail(f"megatron-core {version} at {root}: the patch is for 0.19.x, whose wheel ships megatron/training")
    return root


def _apply(*args, env=None):
    return subprocess.run(["bash", str(APPLY), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def _copy_files(src: Path, dst: Path):
    for f in (*PATCHED, "megatron/core/package_info.py"):
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / f, dst / f)


def test_patch_applies_to_megatron_core_0_19_files_and_comes_out_again(megatron_root, tmp_path):
    _copy_files(megatron_root, tmp_path)
    run = _apply("--check", tmp_path)
    assert run.returncode == 0 and "applies cleanly to megatron-core 0.19" in run.stdout, run.stdout + run.stderr
    assert all((tmp_path / f).read_bytes() == (megatron_root / f).read_bytes() for f in PATCHED)  # --check: no write
    run = _apply(tmp_path)
    assert run.returncode == 0 and "applied to megatron-core 0.19" in run.stdout, run.stdout + run.stderr
    added = 0
    for f in PATCHED:  # the patch only adds lines, in each of the three files
        before = (megatron_root / f).read_text().splitlines()
        after = (tmp_path / f).read_text().splitlines()
        diff = [d for d in difflib.ndiff(before, after) if d[:1] in "+-"]
        assert diff and all(d.startswith("+ ") for d in diff), f
        added += len(diff)
    assert added < 30  # a few lines: the logic lives in megatron_tma.mcore.experts_impl
    run = _apply(tmp_path)  # twice: says so, changes nothing
    assert run.returncode == 0 and "already applied" in run.stdout
    run = _apply("--reverse", tmp_path)
    assert run.returncode == 0, run.stderr
    assert all((tmp_path / f).read_bytes() == (megatron_root / f).read_bytes() for f in PATCHED)


def test_apply_refuses_other_versions_and_changed_files(megatron_root, tmp_path):
    _copy_files(megatron_root, tmp_path)
    info = tmp_path / "megatron/core/package_info.py"
    pristine_info = info.read_text()
    info.write_text(re.sub(r"^MINOR = \d+", "MINOR = 18", pristine_info, flags=re.M))
    run = _apply(tmp_path)
    assert run.returncode == 1 and "made for 0.19.x" in run.stderr
    info.write_text(pristine_info)
    gpt = tmp_path / "megatron/training/models/gpt.py"  # a changed line where a hunk goes: nothing is written
    gpt.write_text(gpt.read_text().replace("mtp_spec = mtp_block_spec(", "mtp_spec = mtp_block_spec_v2("))
    run = _apply(tmp_path)
    assert run.returncode == 1 and "does not apply" in run.stderr
    for f in PATCHED[:2]:
        assert (tmp_path / f).read_bytes() == (megatron_root / f).read_bytes()
    assert _apply(tmp_path / "megatron").returncode == 1  # not a Megatron-LM root


def test_patch_choices_are_the_hooks():
    """The argument's choices and default in the patch are `experts_impl`'s, and its field name is the hook's."""
    text = PATCH.read_text()
    choices = re.search(r"--moe-experts-impl', type=str, default='(\w+)',\n\+\s+choices=\[([^\]]*)\]", text)
    assert choices and choices.group(1) == experts_impl.DEFAULT
    assert tuple(re.findall(r"'([^']+)'", choices.group(2))) == experts_impl.CHOICES
    assert f'kwargs["{experts_impl.FIELD}"]' in text and f"{experts_impl.FIELD}: str = \"megatron\"" in text
    assert "from megatron_tma.mcore.experts_impl import gpt_builder_hook" in text
    assert experts_impl.mode_of("megatron") is None and experts_impl.mode_of("megatron_tma-padded128") == "padded128"
    with pytest.raises(ValueError, match="must be one of"):
        experts_impl.mode_of("megatron_tma-fp4")


# The hook on megatron-core's own specs (in this process: megatron-core, not megatron.training)

HAVE_MEGATRON_CORE = _megatron_root()[0] is not None


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_moe_experts=4, moe_ffn_hidden_size=128,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bf16=True,
                params_dtype=torch.bfloat16, use_cpu_initialization=True, perform_initialization=False)
    base.update(kw)
    return TransformerConfig(**base)


def _mode(moe_spec):
    """The mode of an MoE layer spec's experts builder (None: Megatron's own)."""
    experts = moe_spec.keywords["submodules"].experts if isinstance(moe_spec, functools.partial) else \
        moe_spec.submodules.experts
    ok = isinstance(experts, functools.partial) and experts.func is megatron_experts
    return experts.keywords["mode"] if ok else None


@pytest.mark.skipif(not HAVE_MEGATRON_CORE, reason="megatron-core is not installed")
def test_hook_swaps_the_experts_of_every_moe_layer_and_nothing_else(megatron_cpu):
    warnings.filterwarnings("ignore", message=".*(DEPRECATED|deprecated).*")
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)

    config = _config(moe_layer_freq=[0, 1], mtp_num_layers=1)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    model_config = types.SimpleNamespace(transformer=config, moe_experts_impl="megatron")
    assert experts_impl.gpt_builder_hook(model_config, block, mtp) == (block, mtp)  # the default: the same objects
    model_config.moe_experts_impl = "megatron_tma-padded16"
    new_block, new_mtp = experts_impl.gpt_builder_hook(model_config, block, mtp)
    dense, moe = new_block.layer_specs
    assert dense is block.layer_specs[0]  # the dense layer is shared, not copied
    assert _mode(moe.submodules.mlp) == "padded16" and _mode(block.layer_specs[1].submodules.mlp) is None
    assert moe.submodules.self_attention is block.layer_specs[1].submodules.self_attention
    assert moe.submodules.mlp.keywords["submodules"].router is block.layer_specs[1].submodules.mlp.keywords[
        "submodules"].router
    mtp_layer = new_mtp.layer_specs[0].submodules.mtp_model_layer  # the MTP layer: the decoder's last layer's spec
    assert _mode(mtp_layer.submodules.mlp) == "padded16"
    assert _mode(mtp.layer_specs[0].submodules.mtp_model_layer.submodules.mlp) is None  # inputs unchanged

    layer = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)  # a layer spec (e.g. from --spec)
    new_layer, none = experts_impl.gpt_builder_hook(model_config, layer)
    assert none is None and _mode(new_layer.submodules.mlp) == "padded16"
    again, _ = experts_impl.gpt_builder_hook(model_config, new_layer)  # --spec gave the mode the flag names: fine
    assert _mode(again.submodules.mlp) == "padded16"
    model_config.moe_experts_impl = "megatron_tma-unpadded"  # --spec gave padded16, the flag another mode
    with pytest.raises(ValueError, match="already has megatron_tma's padded16 experts"):
        experts_impl.gpt_builder_hook(model_config, new_layer)
    with pytest.raises(ValueError, match="the layer spec has no MoE layer"):
        experts_impl.gpt_builder_hook(model_config, get_gpt_layer_local_spec())


@pytest.mark.skipif(not HAVE_MEGATRON_CORE, reason="megatron-core is not installed")
@pytest.mark.parametrize("change, message", [
    (dict(num_moe_experts=None, moe_ffn_hidden_size=None), "--num-experts is not set"),
    (dict(add_bias_linear=True), "config.add_bias_linear"),
])
def test_hook_refuses_before_building(megatron_cpu, change, message):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model_config = types.SimpleNamespace(transformer=_config(**change), moe_experts_impl="megatron_tma-unpadded")
    with pytest.raises(ValueError, match=message):
        experts_impl.gpt_builder_hook(model_config, get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True))


# The flag through Megatron-LM's own code, patched (a process of its own: this one may hold the unpatched modules)

def _scenarios():
    from test_mcore_megatron_lm import ARGV  # the small MoE GPT as pretrain_gpt.py would be launched for it

    flag = "--moe-experts-impl"
    mtp = ["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-rope-fusion"]
    spec = ["--spec", "megatron_tma.mcore.megatron_lm", "padded16"]
    no_moe, skip = [], 0  # without the MoE arguments (and their values)
    for i, a in enumerate(ARGV):
        if skip:
            skip -= 1
        elif a.startswith("--moe-") or a == "--num-experts":
            skip = int(i + 1 < len(ARGV) and not ARGV[i + 1].startswith("--"))
        else:
            no_moe.append(a)
    return {
        "default": dict(argv=ARGV),
        "unpadded": dict(argv=[*ARGV, flag, "megatron_tma-unpadded"], step=True),
        "padded16": dict(argv=[*ARGV, flag, "megatron_tma-padded16"]),
        "padded128": dict(argv=[*ARGV, flag, "megatron_tma-padded128"]),
        "bf16": dict(argv=[*ARGV, flag, "megatron_tma-bf16"], step=True),
        "wrong": dict(argv=[*ARGV, flag, "megatron_tma-fp8"]),
        "mtp": dict(argv=[*ARGV, *mtp, flag, "megatron_tma-unpadded"]),
        "mtp_default": dict(argv=[*ARGV, *mtp]),
        "spec": dict(argv=[*ARGV, *spec]),
        "spec_and_flag": dict(argv=[*ARGV, *spec, flag, "megatron_tma-padded16"]),
        "spec_and_other_flag": dict(argv=[*ARGV, *spec, flag, "megatron_tma-unpadded"]),
        "no_moe": dict(argv=[*no_moe, flag, "megatron_tma-unpadded"]),
        "hybrid": dict(argv=[*ARGV, flag, "megatron_tma-unpadded"], config="hybrid"),
        "other_builder": dict(argv=[*ARGV, flag, "megatron_tma-unpadded"], config="other_builder"),
        "other_builder_default": dict(argv=ARGV, config="other_builder"),
    }


@pytest.fixture(scope="module")
def patched_run(megatron_root, tmp_path_factory):
    """Every scenario through a patched copy of the megatron-core 0.19 files, in one fresh process."""
    try:
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl|DEPRECATED|deprecated).*")
        import megatron.training.arguments  # noqa: F401 (Python >= 3.12: typing.override)
    except Exception as e:  # noqa: BLE001
        _skip_or_fail(f"megatron.training is not importable: {e}")
    root = tmp_path_factory.mktemp("megatron-lm")
    shutil.copytree(megatron_root / "megatron", root / "megatron")
    applied = _apply(root)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    scenarios = _scenarios()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    run = subprocess.run([sys.executable, str(REPO / "tests" / "_megatron_lm_flag_probe.py"),
                          json.dumps(list(scenarios.values()))], capture_output=True, text=True, env=env, timeout=600)
    line = [x for x in run.stdout.splitlines() if x.startswith("MEGATRON_LM_FLAG_PROBE ")]
    assert run.returncode == 0 and line, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(line[0].split(" ", 1)[1])
    assert Path(out["arguments_py"]).resolve() == (root / "megatron/training/arguments.py").resolve()
    return dict(zip(scenarios, out["results"]))


MEGATRON_TMA = "megatron_tma.mcore.experts"


@pytest.mark.parametrize("mode, cls, pad_to", [("unpadded", "MegatronFP8Experts", None),
                                               ("padded16", "MegatronFP8Experts", 16),
                                               ("padded128", "MegatronFP8Experts", 128),
                                               ("bf16", "MegatronBF16Experts", None)])
def test_flag_parses_and_reaches_the_experts(patched_run, mode, cls, pad_to):
    result = patched_run[mode]
    assert "error" not in result, result
    assert result["impl"] == result["config_impl"] == f"megatron_tma-{mode}"
    assert result["spec"] == "NoneType"  # the builder's own spec for the arguments, experts swapped in it
    assert result["experts"] == [{"class": cls, "module": MEGATRON_TMA, "pad_to": pad_to}] * 2
    if mode in ("unpadded", "bf16"):
        assert result["step"] is True  # they train: a forward and backward on the reference backend


def test_without_the_flag_megatrons_own_experts(patched_run):
    result = patched_run["default"]
    assert result["impl"] == result["config_impl"] == "megatron"
    assert [e["module"].startswith("megatron.core.transformer.moe") for e in result["experts"]] == [True, True]
    assert result["experts"][0]["class"] == "SequentialMLP"  # what this local spec builds


def test_wrong_value_is_refused_by_the_parser(patched_run):
    assert patched_run["wrong"] == {"exit": 2}  # argparse: invalid choice


def test_flag_reaches_the_multi_token_prediction_layer(patched_run):
    result, default = patched_run["mtp"], patched_run["mtp_default"]
    assert "error" not in result, result
    assert result["mtp_experts"] == [{"class": "MegatronFP8Experts", "module": MEGATRON_TMA, "pad_to": None}]
    assert default["mtp_experts"][0]["class"] == "SequentialMLP"


def test_spec_switch_keeps_working_in_the_builder_flow(patched_run):
    """pretrain_gpt.py imports `--spec` in gpt_config_from_args, before the parallel state: the module hands the
    builder a callable, which builds the spec per model chunk. The flag naming the same mode is accepted; another
    mode is refused, naming both."""
    for name in ("spec", "spec_and_flag"):
        result = patched_run[name]
        assert "error" not in result, result
        assert result["spec"] == "function"
        assert result["experts"] == [{"class": "MegatronFP8Experts", "module": MEGATRON_TMA, "pad_to": 16}] * 2
    assert "already has megatron_tma's padded16 experts" in patched_run["spec_and_other_flag"]["error"]


def test_flag_without_moe_layers_is_refused(patched_run):
    assert "--num-experts is not set" in patched_run["no_moe"]["error"]


def test_flag_is_refused_where_the_hook_is_not_called(patched_run):
    """pretrain_hybrid.py's model config, and a GPT model config whose builder is not GPTModelBuilder (ModelOpt's),
    refuse the flag instead of ignoring it; without the flag they are as before."""
    assert "GPT models only" in patched_run["hybrid"]["error"]
    assert "only GPTModelBuilder applies it, not elsewhere.OtherGPTModelBuilder" in patched_run["other_builder"]["error"]
    assert "error" not in patched_run["other_builder_default"], patched_run["other_builder_default"]
