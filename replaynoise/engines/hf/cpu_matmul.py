"""fp32 GEMMs for bf16 models on CPU: speed without changing what a pass means.

PyTorch's CPU bf16 GEMM runs at about 15 GFLOP/s on a CPU without AVX512-BF16/AMX whatever the batch (measured on
the 2-core test machine), while its fp32 GEMM reaches 80-90 GFLOP/s from 32 rows on. Linear layers then compute
the bf16 inputs and weights in float32 and round the output to bf16: fp32 accumulation, as GPU tensor cores do.
The numbers differ from the native bf16 kernel's in the last bit of about 1e-4 of outputs; every step of a
configuration (rollout, verification probe, every pass) uses the same kernels, so exact resume stays bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Fp32Linear(torch.nn.Module):
    """A bf16/fp16 linear layer computed as a float32 GEMM (weights upcast once), output in the input's dtype."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.inner = linear  # keeps the original parameters (state_dict, tied weights) untouched
        self.register_buffer("weight32", linear.weight.detach().float(), persistent=False)
        bias = linear.bias
        self.register_buffer("bias32", None if bias is None else bias.detach().float(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight32, self.bias32).to(x.dtype)


def use_fp32_matmul(model: torch.nn.Module) -> int:
    """Swap every half-precision ``nn.Linear`` of ``model`` for its fp32-GEMM form; returns how many. The layers
    already swapped keep their original inside (``inner``), which is skipped: two engines on one model (the
    precision controls build a second) would otherwise wrap it again, each time with another fp32 weight copy."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        if not isinstance(parent, Fp32Linear)
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and child.weight.dtype in (torch.bfloat16, torch.float16)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, Fp32Linear(child))
    return len(swaps)
