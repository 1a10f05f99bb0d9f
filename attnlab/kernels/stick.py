"""Stick-breaking attention's weights over the rows of attention logits, on the CPU (Tan et al. 2025, "Scaling
Stick-Breaking Attention", eq. 3), forward and backward, one pass over a row each way.

The kernel is C (``stick.c`` beside this file), built on first use by :mod:`attnlab.kernels.build`. Per row of
logits z over the keys K(i) it sees (the allowed mask, without the query's own key unless ``attend_current``), the
nearest key first::

    w_j = σ(z_j) Π_{k ∈ K(i), k > j} (1 − σ(z_k)),   log w_j = log σ(z_j) + Σ_{k > j} log σ(−z_k)

the sum carried from the last key down (no product underflows, no cancellation). Backward, with g_j = ∂L/∂w_j · w_j:
∂L/∂z_j = g_j (1 − σ(z_j)) − σ(z_j) Σ_{k ∈ K(i), k < j} g_k. :class:`StickRowOp` is the
:class:`~attnlab.kernels.rows.RowOp` for the fused ``normalized`` backend (out of place: the backward pass reads the
logits); :func:`stick_breaking` the differentiable function for the normalizer's eager path. Where the kernel cannot
be built, :func:`available` is False and :func:`unavailable_reason` says why; the normalizer then uses its PyTorch
code (:func:`attnlab.normalizers.stick_breaking_weights`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnlab.kernels.build import DTYPES, Library
from attnlab.kernels.sparse import _check, _mask_args, _ptr, supports_tensors

__all__ = ["StickRowOp", "available", "stick_breaking", "supports", "unavailable_reason"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.attnlab_stick_forward.argtypes = [c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, c_int, c_int]
    lib.attnlab_stick_backward.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, c_int, c_int]
    lib.attnlab_stick_forward.restype = lib.attnlab_stick_backward.restype = c_int


_LIBRARY = Library(Path(__file__).with_name("stick.c"), _declare)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _LIBRARY.get() is not None


def unavailable_reason() -> str | None:
    """One line saying why the kernel is not available, or None when it is."""
    return _LIBRARY.error


def supports(logits: Tensor, allowed: Tensor | None = None) -> bool:
    """Whether :func:`stick_breaking` can take these: float32/64 on the CPU, eager, and the kernel available."""
    return supports_tensors(logits, allowed) and available()


class StickRowOp:
    """Stick-breaking (``attend_current``: whether a query's own key is in its row) as a
    :class:`~attnlab.kernels.rows.RowOp`, out of place: ``forward(logits, allowed, out=None)`` → (weights, state),
    the state (logits, allowed) read again by ``backward(d_weights, weights, state, out=None)`` (d_weights
    overwritten unless ``out``). float32 or float64, contiguous, on the CPU; the kernel must be :func:`available`."""

    name = "stickbreaking"
    prefers_out = True
    """in place it would have to copy the logits its backward pass reads; given ``out=`` it keeps them instead."""

    def __init__(self, attend_current: bool = False) -> None:
        self.attend_current = bool(attend_current)

    def forward(self, logits: Tensor, allowed: Tensor | None, out: Tensor | None = None) -> tuple[Tensor, Any]:
        if logits.dtype not in DTYPES or not logits.is_contiguous() or logits.dim() != 4:
            raise TypeError(f"stick-breaking kernel: logits must be contiguous 4-d float32/64, got {logits.dtype}")
        if out is None:  # the logits are the state: the weights go to a new tensor
            out = torch.empty_like(logits)
        if logits.numel() == 0:  # (no row: nothing to do, and the kernel refuses an empty tensor's null pointers)
            return out, (logits, allowed)
        B, H, Lq, Lk = logits.shape
        mask, strides = _mask_args(allowed, logits.shape)
        status = _LIBRARY.require().attnlab_stick_forward(
            DTYPES[logits.dtype], logits.data_ptr(), out.data_ptr(), _ptr(mask), _ptr(strides), B, H, Lq, Lk,
            int(self.attend_current), torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "stick-breaking")
        return out, (logits, allowed)

    def backward(self, d_weights: Tensor, weights: Tensor, state: Any, out: Tensor | None = None) -> Tensor:
        logits, allowed = state
        if not (d_weights.is_contiguous() and weights.is_contiguous()) or d_weights.dtype != weights.dtype:
            raise TypeError("stick-breaking kernel: d_weights and weights must be contiguous, of one dtype")
        d = d_weights if out is None else out
        if weights.numel() == 0:
            return d
        B, H, Lq, Lk = weights.shape
        mask, strides = _mask_args(allowed, weights.shape)
        status = _LIBRARY.require().attnlab_stick_backward(
            DTYPES[weights.dtype], d_weights.data_ptr(), d.data_ptr(), weights.data_ptr(), logits.data_ptr(),
            _ptr(mask), _ptr(strides), B, H, Lq, Lk, int(self.attend_current), torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "stick-breaking")
        return d

    def __repr__(self) -> str:
        return f"StickRowOp(attend_current={self.attend_current})"


class _StickFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, allowed: Tensor | None, op: StickRowOp) -> Tensor:
        x = logits.contiguous()
        weights, _ = op.forward(x, allowed)
        ctx.op, ctx.allowed = op, allowed
        ctx.save_for_backward(weights, x)
        return weights

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        weights, logits = ctx.saved_tensors
        g = grad.to(weights.dtype).contiguous()
        return ctx.op.backward(g, weights, (logits, ctx.allowed), out=torch.empty_like(weights)), None, None


def stick_breaking(logits: Tensor, allowed: Tensor | None = None, attend_current: bool = False) -> Tensor:
    """Stick-breaking weights (B, H, Lq, Lk) of logits (B, H, Lq, Lk) float32/64 on the CPU, allowed bool
    broadcastable to (B, H, Lq, Lk) (True = may attend) or None; differentiable in the logits (once). See
    :func:`supports`."""
    return _StickFunction.apply(logits, allowed, StickRowOp(attend_current))
