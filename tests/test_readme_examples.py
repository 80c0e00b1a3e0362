"""The README's "Use" example runs as written and computes what its comments say: the shapes, the GEMMs' values, the
accumulation into main_grad. On a Hopper GPU with the built extension it runs on "cuda" as written; elsewhere
`device="cuda"` becomes `"cpu"` (the reference backend, then also checked bit for bit against the reference
module). The GEMMs' results are held to the float64 reference (docs/design.md §3) either way."""
import os
import re

import torch

from megatron_tma import _ext
from megatron_tma import reference as R
from megatron_tma import testing as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_example():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("\n## Use\n"):]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the README's Use section should hold one python example"
    return blocks[0]


def test_readme_use_example_runs_and_computes_what_it_says():
    code = _use_example()
    assert 'device="cuda"' in code
    on_gpu = _ext.cuda_kernels_available()
    if not on_gpu:
        code = code.replace('device="cuda"', 'device="cpu"')
    ns = {}
    torch.manual_seed(0)
    exec(compile(code, "README.md (Use)", "exec"), ns)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in ns.items()}
    sizes, y, main_grad, out = cpu["sizes"], cpu["y"], cpu["main_grad"], ns["out"]
    assert sizes.tolist() == [3000, 0, 127, 1]
    assert y.shape == (3128, 1024) and y.dtype == torch.bfloat16  # the comment's [3128, 1024] BF16
    operands = (cpu["xq"], cpu["xs"], cpu["wq"], cpu["ws"], sizes)
    wgrad_operands = (cpu["dyt"], cpu["dyts"], cpu["xt"], cpu["xts"], sizes)
    assert main_grad.shape == (4, 1024, 4096) and main_grad.dtype == torch.float32
    assert T.diff(y.double(), T.m_grouped_ref64(*operands)) < 1e-3
    assert T.diff(main_grad.double(), T.k_grouped_ref64(*wgrad_operands)) < 1e-3
    if not on_gpu:  # the public API on CPU tensors is the reference backend, to the bit
        assert torch.equal(y, R.m_grouped_fp8_gemm(*operands))
        assert torch.equal(main_grad, R.k_grouped_fp8_gemm(*wgrad_operands))  # accumulated into zeros
    assert torch.equal(main_grad[1], torch.zeros(1024, 4096))  # the empty expert gets no gradient
    assert out.shape == ns["x"].shape and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert out.requires_grad  # "... .backward() works": the layer's autograd tests check the gradients
