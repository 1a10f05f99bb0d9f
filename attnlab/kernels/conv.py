"""The causal depthwise convolution of the short convolution and Canon layers, as two custom operators
(``attnlab::causal_conv`` and its backward) with their FLOPs registered in :mod:`attnlab.compute`.

For x (B, L, C) and w (C, k), y_t = r·x_t + Σ_{m<k} w_m ⊙ x_{t−k+1+m} (zeros before the start; r = 1 with a
residual, Allen-Zhu 2025's Canon layers, else 0), computed as k multiply-adds of shifted slices of the contiguous
(B, L, C) tensor; the backward is written out: ∂x_t = r·g_t + Σ_m w_m ⊙ g_{t+k−1−m}, ∂w_m = Σ_{b,t} g_t ⊙
x_{t−k+1+m}. PyTorch's depthwise ``conv1d`` on the CPU, reached through two transposes and a padded copy, costs
about 2.5× this (docs/performance.md, *Around the attention*). Plain tensor operations: every device, every dtype
(w is cast to x's; ∂w is summed in float32 for a half-precision x). On the CPU in float32 and float64 a C kernel
(``conv.c``, built by :mod:`attnlab.kernels.build`) does each direction in one pass over the rows (the k rows a row
reads stay in the cache), about 3× faster again; where it cannot be built, the tensor operations run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attnlab.kernels.build import DTYPES, Library

__all__ = ["causal_conv", "causal_conv_flops"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.attnlab_conv_forward.argtypes = [c_int, ptr, ptr, ptr, i64, i64, i64, i64, c_int, c_int]
    lib.attnlab_conv_backward.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, c_int, c_int]
    lib.attnlab_conv_forward.restype = lib.attnlab_conv_backward.restype = c_int


_LIBRARY = Library(Path(__file__).with_name("conv.c"), _declare)


def _kernel_for(x: Tensor) -> ctypes.CDLL | None:
    """The C kernel when it applies to x (CPU, float32 or float64) and is built, else None."""
    if x.device.type != "cpu" or x.dtype not in DTYPES:
        return None
    return _LIBRARY.get()


def _forward_impl(x: Tensor, w: Tensor, residual: bool) -> Tensor:
    lib = _kernel_for(x)
    if lib is not None:
        B, L, C = x.shape
        x = x.contiguous()
        y = torch.empty_like(x)
        wT = w.to(x.dtype).t().contiguous()  # (k, C)
        status = lib.attnlab_conv_forward(
            DTYPES[x.dtype], x.data_ptr(), wT.data_ptr(), y.data_ptr(), B, L, C, w.shape[1], int(residual),
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("the causal convolution kernel ran out of memory")
        return y
    k, L = w.shape[1], x.shape[1]
    w = w.to(x.dtype)
    y = x * (w[:, k - 1] + 1.0 if residual else w[:, k - 1])  # (B, L, C): the current token's tap
    for m in range(k - 1):
        shift = k - 1 - m
        if shift < L:
            y[:, shift:].addcmul_(x[:, : L - shift], w[:, m])  # tap m reads x_{t − shift}
    return y


_forward_op = torch.library.custom_op("attnlab::causal_conv", mutates_args=())(_forward_impl)


@_forward_op.register_fake
def _forward_fake(x: Tensor, w: Tensor, residual: bool) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _backward_impl(g: Tensor, x: Tensor, w: Tensor, residual: bool) -> tuple[Tensor, Tensor]:
    k, L = w.shape[1], x.shape[1]
    g = g.contiguous()
    lib = _kernel_for(x)
    if lib is not None and g.dtype == x.dtype:
        B, _, C = x.shape
        threads = max(1, min(torch.get_num_threads(), B * L))
        x = x.contiguous()
        dx = torch.empty_like(x)
        parts = torch.zeros(threads, k, C, dtype=x.dtype)  # each thread's partial ∂wᵀ
        wT = w.to(x.dtype).t().contiguous()
        status = lib.attnlab_conv_backward(
            DTYPES[x.dtype], g.data_ptr(), x.data_ptr(), wT.data_ptr(), dx.data_ptr(), parts.data_ptr(), B, L, C, k,
            int(residual), threads,
        )  # fmt: skip
        if status:
            raise MemoryError("the causal convolution kernel ran out of memory")
        return dx, parts.sum(0).t().to(w.dtype).contiguous()
    wx = w.to(x.dtype)
    dx = g * (wx[:, k - 1] + 1.0 if residual else wx[:, k - 1])
    for m in range(k - 1):
        shift = k - 1 - m
        if shift < L:
            dx[:, : L - shift].addcmul_(g[:, shift:], wx[:, m])
    dw = torch.zeros(w.shape, dtype=torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype,
                     device=w.device)  # fmt: skip
    for m in range(k):
        shift = k - 1 - m
        if shift < L:
            dw[:, m] = (g[:, shift:] * x[:, : L - shift]).sum(dim=(0, 1), dtype=dw.dtype)
    return dx, dw.to(w.dtype)


_backward_op = torch.library.custom_op("attnlab::causal_conv_backward", mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _backward_fake(g: Tensor, x: Tensor, w: Tensor, residual: bool) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w)


def _setup_context(ctx: object, inputs: tuple[Tensor, Tensor, bool], output: Tensor) -> None:
    x, w, residual = inputs
    ctx.save_for_backward(x, w)  # type: ignore[attr-defined]
    ctx.residual = residual  # type: ignore[attr-defined]


def _autograd_backward(ctx: object, g: Tensor) -> tuple[Tensor, Tensor, None]:
    x, w = ctx.saved_tensors  # type: ignore[attr-defined]
    dx, dw = _backward_op(g, x, w, ctx.residual)  # type: ignore[attr-defined]
    return dx, dw, None


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _CausalConvFunction(torch.autograd.Function):
    """The same computation as the operator, through a plain autograd function: less overhead a call in eager mode
    (about 0.5 ms less a backward call than the operator's generated autograd)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, residual: bool) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.residual = residual
        return _forward_impl(x, w, residual)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        x, w = ctx.saved_tensors
        dx, dw = _backward_impl(g, x, w, ctx.residual)
        return dx, dw, None


def causal_conv(x: Tensor, w: Tensor, residual: bool = False) -> Tensor:
    """x (B, L, C), w (C, k) → y (B, L, C), y_t = r·x_t + Σ_{m<k} w_m ⊙ x_{t−k+1+m} (module docstring);
    differentiable in x and w (once). Under ``torch.compile`` or a dispatch mode (``FlopCounterMode``: its FLOPs
    are counted) the ``attnlab::causal_conv`` operator, in eager mode the same code through an autograd function."""
    x = x.contiguous()
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return _forward_op(x, w, bool(residual))
    return _CausalConvFunction.apply(x, w, bool(residual))


def causal_conv_flops(x_shape: torch.Size | tuple[int, ...], w_shape: torch.Size | tuple[int, ...]) -> int:
    """A depthwise convolution's forward as ``FlopCounterMode`` counts ``conv1d``'s: 2·B·L·C·k (the residual's
    add is elementwise, free); its backward (∂x and ∂w) twice that."""
    B, L, C = x_shape
    return 2 * B * L * C * w_shape[1]
