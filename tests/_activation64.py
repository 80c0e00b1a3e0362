"""The expert MLP's activations in plain torch (float64 in the tests): the oracle the activation tests compare with."""
import torch
import torch.nn.functional as F


def act64(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h): SwiGLU or GeGLU with the gate half first, the exact (erf) GELU, or squared ReLU."""
    if activation == "swiglu":
        f = h.shape[1] // 2
        return F.silu(h[:, :f]) * h[:, f:]
    if activation == "geglu":
        f = h.shape[1] // 2
        return F.gelu(h[:, :f]) * h[:, f:]
    if activation == "gelu":
        return F.gelu(h)
    return torch.relu(h) ** 2
