"""Softmax over the rows of attention logits, with optional soft-capping, fused on the CPU.

    w = softmax_allowed(c · tanh(s / c))    (w = softmax_allowed(s) without a cap)

over the last dimension (keys) of logits s (B, H, Lq, Lk): masked keys get exactly 0, a row that sees no key all 0.
The C kernel (``softmax.c``, built by :mod:`attnlab.kernels.build`) caps, normalizes and writes the weights in one
call, in place when asked (exp and log vectorised by libmvec; float32's tanh a rational minimax fit, within 3.8e-7
relative of tanh, 0.3 ns an element; the capped forward costs about 0.9 ns an element on one core, the backward
0.7; autograd's chain c·tanh(s/c) → masked_fill → softmax keeps a (B, H, Lq, Lk) tensor at each step).
Besides the weights P it keeps each row's log-sum-exp of the capped logits, lse (B, H, Lq): the backward pass

    dS = P ⊙ (dP − rowsum(dP ⊙ P)) ⊙ (1 − t²),    t = tanh(s / c) = (log P + lse) / c

recovers t from P (where P = 0 the term is 0 anyway), so nothing else of size (B, H, Lq, Lk) is kept; one log an
element costs less than storing t and reading it back.

:class:`SoftcapSoftmax` is this as a :class:`~attnlab.kernels.rows.RowOp` (in place both ways), for the
``normalized`` backend (:mod:`attnlab.backends.normalized`). :func:`softcap_softmax` is the differentiable,
out-of-place function. Registered with ``torch.library`` as ``attnlab::softcap_softmax`` (and its backward), which
``torch.compile`` sees as one operator; eager mode calls the same code through a plain autograd function (less
overhead per call), except under a dispatch mode (``torch.utils.flop_counter.FlopCounterMode``), which sees the
operator. Where the kernel cannot be built, :func:`available` is False and callers use PyTorch.
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

__all__ = [
    "SoftcapSoftmax",
    "available",
    "softcap_softmax",
    "softcap_softmax_",
    "softcap_softmax_backward_",
    "unavailable_reason",
]


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int, c_double = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    lib.attnlab_softmax_forward.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, c_double, c_int]
    lib.attnlab_softmax_backward.argtypes = [c_int, ptr, ptr, ptr, i64, i64, i64, i64, c_double, c_int]
    lib.attnlab_softmax_forward.restype = lib.attnlab_softmax_backward.restype = c_int


_LIBRARY = Library(Path(__file__).with_name("softmax.c"), _declare)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _LIBRARY.get() is not None


def unavailable_reason() -> str | None:
    """One line saying why the kernel is not available, or None when it is."""
    return _LIBRARY.error


def _check(logits: Tensor, cap: float | None) -> None:
    if logits.dtype not in DTYPES:
        raise TypeError(f"softcap_softmax takes float32 or float64, got {logits.dtype}")
    if logits.dim() != 4 or logits.device.type != "cpu":
        raise ValueError(
            f"softcap_softmax takes CPU logits (B, H, Lq, Lk), got {tuple(logits.shape)} on {logits.device}"
        )
    if cap is not None and not cap > 0:
        raise ValueError(f"softcap_softmax: the cap must be > 0 or None, got {cap}")


def _allowed_args(allowed: Tensor | None, shape: torch.Size) -> tuple[Tensor | None, Tensor | None]:
    """``allowed`` (bool broadcastable to ``shape``) as a uint8 view of the broadcast tensor and its strides."""
    if allowed is None:
        return None, None
    a = allowed.expand(shape)
    if a.dtype != torch.bool:
        a = a != 0  # a full-size copy, with its own strides
    return a.view(torch.uint8), torch.tensor(a.stride(), dtype=torch.int64)


def _run_forward(src: Tensor, dst: Tensor, allowed: Tensor | None, cap: float | None) -> Tensor:
    """Kernel call: dst (contiguous, may be src) ← the weights; → lse (B, H, Lq)."""
    B, H, Lq, Lk = src.shape
    lse = torch.empty(B, H, Lq, dtype=src.dtype)
    mask, strides = _allowed_args(allowed, src.shape)
    status = _LIBRARY.require().attnlab_softmax_forward(
        DTYPES[src.dtype], src.data_ptr(), dst.data_ptr(), lse.data_ptr(),
        None if mask is None else mask.data_ptr(), None if strides is None else strides.data_ptr(),
        B, H, Lq, Lk, float(cap or 0.0), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("the softmax kernel ran out of memory")
    return lse


def _run_backward(grad: Tensor, weights: Tensor, lse: Tensor, cap: float | None) -> None:
    """Kernel call: grad (contiguous, dP) ← dS in place."""
    B, H, Lq, Lk = grad.shape
    status = _LIBRARY.require().attnlab_softmax_backward(
        DTYPES[grad.dtype], grad.data_ptr(), weights.data_ptr(), lse.data_ptr(), B, H, Lq, Lk, float(cap or 0.0),
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("the softmax kernel ran out of memory")


def softcap_softmax_(logits: Tensor, allowed: Tensor | None = None, cap: float | None = None) -> tuple[Tensor, Tensor]:
    """In place where it can: logits (B, H, Lq, Lk) float32/64 (overwritten when contiguous), allowed bool
    broadcastable to (B, H, Lq, Lk) (True = may attend) or None, ``cap`` c > 0 or None → (weights (B, H, Lq, Lk):
    ``logits`` itself when it was contiguous, lse (B, H, Lq): each row's log-sum-exp of the capped logits over its
    allowed keys, 0 for a row with none). Not differentiable (see :func:`softcap_softmax`)."""
    _check(logits, cap)
    weights = logits if logits.is_contiguous() else logits.contiguous()
    return weights, _run_forward(weights, weights, allowed, cap)


def softcap_softmax_backward_(d_weights: Tensor, weights: Tensor, lse: Tensor, cap: float | None = None) -> Tensor:
    """In place where it can: d_weights (B, H, Lq, Lk) (overwritten when contiguous), the forward pass's weights and
    lse → d_logits (B, H, Lq, Lk) (``d_weights`` itself when it was contiguous), 0 at masked keys."""
    _check(d_weights, cap)
    grad = d_weights if d_weights.is_contiguous() else d_weights.contiguous()
    _run_backward(grad, weights.contiguous(), lse.contiguous(), cap)
    return grad


# ---------------------------------------------------------------------------------- the differentiable function


def _forward_impl(logits: Tensor, allowed: Tensor | None, cap: float | None) -> tuple[Tensor, Tensor]:
    _check(logits, cap)
    src = logits.contiguous()
    weights = torch.empty_like(src)
    return weights, _run_forward(src, weights, allowed, cap)


_forward_op = torch.library.custom_op("attnlab::softcap_softmax", mutates_args=(), device_types="cpu")(_forward_impl)


@_forward_op.register_fake
def _forward_fake(logits, allowed, cap):
    return logits.new_empty(logits.shape), logits.new_empty(logits.shape[:-1])


def _backward_impl(d_weights: Tensor, weights: Tensor, lse: Tensor, cap: float | None) -> Tensor:
    grad = d_weights.contiguous().clone() if d_weights.is_contiguous() else d_weights.contiguous()
    _run_backward(grad, weights.contiguous(), lse.contiguous(), cap)
    return grad


_backward_op = torch.library.custom_op("attnlab::softcap_softmax_backward", mutates_args=(), device_types="cpu")(
    _backward_impl
)


@_backward_op.register_fake
def _backward_fake(d_weights, weights, lse, cap):
    return weights.new_empty(weights.shape)


def _setup_context(ctx, inputs, output) -> None:
    _, _, cap = inputs
    weights, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(weights, lse)
    ctx.cap = cap


def _autograd_backward(ctx, d_weights: Tensor | None, _d_lse: Tensor | None) -> tuple[Tensor | None, None, None]:
    if d_weights is None:
        return None, None, None
    weights, lse = ctx.saved_tensors
    return _backward_op(d_weights, weights, lse, ctx.cap), None, None


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _SoftcapSoftmaxFunction(torch.autograd.Function):
    """The same operator for eager mode, without the custom operator's dispatch overhead."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, allowed: Tensor | None, cap: float | None) -> Tensor:
        weights, lse = _forward_impl(logits, allowed, cap)
        ctx.save_for_backward(weights, lse)
        ctx.cap = cap
        return weights

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_weights: Tensor) -> tuple[Tensor | None, None, None]:
        weights, lse = ctx.saved_tensors
        return _backward_impl(d_weights, weights, lse, ctx.cap), None, None


def softcap_softmax(logits: Tensor, allowed: Tensor | None = None, cap: float | None = None) -> Tensor:
    """logits (B, H, Lq, Lk) float32/64 on the CPU, allowed bool broadcastable to (B, H, Lq, Lk) (True = may attend)
    or None, ``cap`` c > 0 or None → weights (B, H, Lq, Lk) = softmax over the allowed keys of c·tanh(logits / c),
    0 at the other keys and in rows with none; differentiable in the logits (once)."""
    cap = None if cap is None else float(cap)
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return _forward_op(logits, allowed, cap)[0]
    return _SoftcapSoftmaxFunction.apply(logits, allowed, cap)


# ---------------------------------------------------------------------------------- the row operation


class SoftcapSoftmax:
    """The softmax (soft-capped when ``cap`` is given) as a :class:`~attnlab.kernels.rows.RowOp`: ``forward``
    overwrites the logits (B, H, Lq, Lk) with the weights and keeps lse (B, H, Lq); ``backward`` overwrites
    dP (B, H, Lq, Lk) with the logits' gradient (the cap's derivative included)."""

    def __init__(self, cap: float | None = None) -> None:
        if cap is not None and not cap > 0:
            raise ValueError(f"SoftcapSoftmax: the cap must be > 0 or None, got {cap}")
        self.cap = None if cap is None else float(cap)
        self.name = "softmax" if cap is None else f"softcap{self.cap:g}_softmax"

    def forward(self, logits: Tensor, allowed: Tensor | None) -> tuple[Tensor, Tensor]:
        """logits (B, H, Lq, Lk), overwritten → (weights (B, H, Lq, Lk), lse (B, H, Lq))."""
        return softcap_softmax_(logits, allowed, self.cap)

    def backward(self, d_weights: Tensor, weights: Tensor, state: Tensor) -> Tensor:
        """d_weights (B, H, Lq, Lk), overwritten, the weights and lse (``state``) → d_logits (B, H, Lq, Lk)."""
        return softcap_softmax_backward_(d_weights, weights, state, self.cap)

    def __repr__(self) -> str:
        return f"SoftcapSoftmax(cap={self.cap})"
