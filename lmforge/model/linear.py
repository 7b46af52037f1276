"""`Linear`: nn.Linear whose fp32 products on a CPU run on oneDNN's GEMM instead of torch's BLAS.

torch's CPU `F.linear` / `mm` in fp32 calls the BLAS it was built with (MKL on x86-64 wheels).
oneDNN (the other CPU GEMM torch ships, the one its bf16 products already use) multiplies the
same fp32 operands faster, for a training batch's thousands of rows (forward and both backward
products) and for a decode step's few rows (figures: docs/benchmarks.md, `linear_kernels`).
The arithmetic is the same IEEE fp32 multiply-add; only the order of the sums differs, as
between any two BLAS builds.

So a `Linear` on the CPU with fp32 operands calls `torch.ops.mkldnn._linear_pointwise` (the op
torch's own compiler emits for oneDNN linears) forward and, through `OneDNNLinearFn`, for the
input and weight gradients. Everything else is nn.Linear's: tiny layers (below `MIN_WEIGHT`
elements, where a call's fixed cost dominates), other dtypes and devices, tensor subclasses
(FSDP's DTensors, fake tensors) and code being traced by torch.compile / torch.export, which
picks its own kernels. `LMFORGE_ONEDNN_LINEAR=0` turns the routing off (e.g. to compare).

A decode step's few rows are another matter: its product reads every weight once for a handful
of rows, and oneDNN's GEMM ran well below the rate the weights stream from memory. A `Linear`
whose `gemv` an inference copy of the model set (lmforge.infer.quantize.inference_model: the
native GEMV, infer/native/dense_matmul.cpp) calls that for up to `gemv_rows` rows when no
gradient is wanted; training and every larger product keep oneDNN.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

MIN_WEIGHT = 1 << 16  # weights of fewer elements keep torch's kernel (its call costs less)


def onednn_available() -> bool:
    """Whether fp32 CPU linears go through oneDNN in this process."""
    return _AVAILABLE


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) on oneDNN; strided operands are fine."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _check_available() -> bool:
    wanted = os.environ.get("LMFORGE_ONEDNN_LINEAR", "1") != "0"
    if not (wanted and torch.backends.mkldnn.is_available()):
        return False
    try:  # the op exists and multiplies (ones [2, 4] @ ones [4, 3] = 4 everywhere)
        x = torch.ones(2, 4)
        return bool(torch.equal(_gemm(x, torch.ones(3, 4), None), x.new_full((2, 3), 4)))
    except (AttributeError, RuntimeError):
        return False


_AVAILABLE = _check_available()


class OneDNNLinearFn(torch.autograd.Function):
    """F.linear on 2-D fp32 CPU tensors with oneDNN products forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _gemm(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(grad, weight.t(), None)  # grad @ W
        if ctx.needs_input_grad[1]:
            grad_w = _gemm(grad.t(), x.t(), None)  # grad^T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def _routes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _AVAILABLE
        and type(x) is torch.Tensor
        and type(weight) in (nn.Parameter, torch.Tensor)
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.numel() >= MIN_WEIGHT
        and x.numel() > 0
        and not torch.compiler.is_compiling()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias), on oneDNN where that is faster (see the module docstring)."""
    if not _routes(x, weight) or (
        bias is not None and type(bias) not in (nn.Parameter, torch.Tensor)
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (
            bias is not None and bias.requires_grad)):  # fmt: skip
        out = OneDNNLinearFn.apply(flat, weight, bias)
    else:
        out = _gemm(flat, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters, state dict and initialisation) computed by `linear`, or by
    its `gemv` for a few rows without gradients (see the module docstring)."""

    # A product for few rows, kernel(x [M, K], weight [N, K]) -> [M, N], or None. Inference sets
    # it on its copy of the model (infer.quantize.inference_model), as it sets attention's
    # decode_kernel; `gemv_rows` is the most rows it gets (above, oneDNN's GEMM is faster).
    gemv = None
    gemv_rows = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and self._gemv_takes(x):
            out = self.gemv(x.reshape(-1, x.shape[-1]), self.weight)
            if self.bias is not None:
                out += self.bias
            return out.view(*x.shape[:-1], self.out_features)
        return linear(x, self.weight, self.bias)

    def _gemv_takes(self, x: torch.Tensor) -> bool:
        """Whether `gemv` computes this call: a few fp32 rows on the CPU, no gradients, plain
        contiguous weights, not inside a torch.compile / export trace."""
        weight = self.weight
        return (
            0 < x.numel() <= self.gemv_rows * x.shape[-1]
            and not torch.is_grad_enabled()
            and type(x) is torch.Tensor
            and type(weight) in (nn.Parameter, torch.Tensor)
            and x.dtype == weight.dtype == torch.float32
            and x.device.type == weight.device.type == "cpu"
            and weight.is_contiguous()
            and not torch.compiler.is_compiling()
        )


def plain_linear(module: nn.Module) -> bool:
    """Whether `module` is a plain linear layer (nn.Linear or `Linear`, not a subclass that
    quantises or adapts it): what weight conversions and loaders replace or fill in."""
    return type(module) in (nn.Linear, Linear)
