"""Selective attention's penalty on the CPU (Leviathan et al. 2025; ``select.c`` beside this file): the bias −F
(B, 1, Lq, Lk) from the selecting head's logits, forward and backward, each one pass over the queries.

F_ij = Σ_{k<i} S_kj with S_kj = ReLU(e_kj) for a visible key 0 < j < k (k the query's token), the PyTorch form of
which is :func:`attnlab.forms.softmax.selection_penalty` (the reference, and what runs where this kernel does not:
CUDA, bfloat16, ``torch.compile``, the FLOP counter). PyTorch's cumulative sum along the query axis (strided) and
its backward (a flip, a cumulative sum, a flip) took 5.6 ms each on (8, 1, 512, 512) here; the kernel carries a row
of running sums down the queries with the keys contiguous, and the backward pass carries the gradient's up."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnlab.kernels.build import DTYPES, Library
from attnlab.kernels.sparse import _check, _mask_args, _ptr, supports_tensors

__all__ = ["available", "selection_bias", "supports", "unavailable_reason"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.attnlab_select_forward.argtypes = [c_int, ptr, ptr, ptr, ptr, i64, i64, i64, c_int]
    lib.attnlab_select_backward.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, c_int]
    lib.attnlab_select_forward.restype = lib.attnlab_select_backward.restype = c_int


_LIBRARY = Library(Path(__file__).with_name("select.c"), _declare)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _LIBRARY.get() is not None


def unavailable_reason() -> str | None:
    """One line saying why the kernel is not available, or None when it is."""
    return _LIBRARY.error


def supports(logits: Tensor, allowed: Tensor | None = None) -> bool:
    """Whether :func:`selection_bias` can take these: (B, 1, Lq, Lk) float32/64 on the CPU, eager, the kernel built."""
    return logits.dim() == 4 and logits.shape[1] == 1 and supports_tensors(logits, allowed) and available()


class _SelectionBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, allowed: Tensor | None) -> Tensor:
        e = logits.contiguous()
        B, _, Lq, Lk = e.shape
        out = torch.empty_like(e)
        mask, strides = _mask_args(allowed, e.shape)
        status = _LIBRARY.require().attnlab_select_forward(
            DTYPES[e.dtype], e.data_ptr(), out.data_ptr(), _ptr(mask), _ptr(strides), B, Lq, Lk,
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "selective attention")
        ctx.save_for_backward(e)
        ctx.allowed = allowed
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (e,) = ctx.saved_tensors
        g = grad.to(e.dtype).contiguous()
        B, _, Lq, Lk = e.shape
        out = torch.empty_like(e)
        mask, strides = _mask_args(ctx.allowed, e.shape)
        status = _LIBRARY.require().attnlab_select_backward(
            DTYPES[e.dtype], g.data_ptr(), e.data_ptr(), out.data_ptr(), _ptr(mask), _ptr(strides), B, Lq, Lk,
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "selective attention")
        return out, None


def selection_bias(logits: Tensor, allowed: Tensor | None = None) -> Tensor:
    """−F (B, 1, Lq, Lk) from the selecting head's logits (B, 1, Lq, Lk) and the mask (bool broadcastable to
    (B, 1, Lq, Lk), True = visible; None = all), differentiable (once) in the logits. See :func:`supports`."""
    return _SelectionBias.apply(logits, allowed)
