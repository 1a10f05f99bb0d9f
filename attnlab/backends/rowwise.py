"""The ``normalized`` backend's autograd function, :class:`NormalizedAttention`: z = N(cap(scale · q kᵀ + bias)) v
with N a row operation (:class:`~attnlab.kernels.rows.RowOp`), and the pool of (B, H, Lq, Lk) buffers it uses. In a
module of its own (below :mod:`attnlab.backends.sdpa` and :mod:`attnlab.backends.normalized`, which both use it:
``biased_softmax`` runs selective attention's bias through it with the C softmax row kernel)."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnlab.kernels.rows import RowOp

__all__ = ["POOL", "BufferPool", "NormalizedAttention"]


class BufferPool:
    """Idle (B, H, Lq, Lk) buffers, reused from call to call.

    A fresh tensor this large comes from the C allocator as new pages of the OS (glibc maps anything over 32 MiB),
    and writing it first costs a page fault per 4 KiB: here more than the matrix product that fills it. The
    function below takes its buffers from this pool and gives them back once nothing can read them any more: the
    backward pass's buffer at its end, the forward pass's when the autograd node that keeps it is freed (a
    :class:`_Lease` on the node's context; at once under ``torch.no_grad``). At most ``limit`` buffers are kept."""

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self._idle: list[Tensor] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An idle buffer of this shape and dtype (contents undefined), or a new one."""
        shape = tuple(shape)
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if buffer.shape == shape and buffer.dtype == dtype:
                    return self._idle.pop(i)
        return torch.empty(shape, dtype=dtype)

    def give(self, buffer: Tensor) -> None:
        """Keep ``buffer`` (nothing else may hold it) for a later :meth:`take`; the oldest goes past ``limit``."""
        with self._lock:
            self._idle.append(buffer)
            del self._idle[: max(0, len(self._idle) - self.limit)]

    def clear(self) -> None:
        """Drop every idle buffer."""
        with self._lock:
            self._idle.clear()


POOL = BufferPool()
"""The buffers of :class:`NormalizedAttention`."""


class _Lease:
    """Gives its buffers back to the pool when it is freed (with the autograd context that holds it)."""

    def __init__(self, *buffers: Tensor) -> None:
        self.buffers = buffers

    def __del__(self) -> None:
        for buffer in self.buffers:
            POOL.give(buffer)


class NormalizedAttention(torch.autograd.Function):
    """z = N(cap(scale · q kᵀ + bias)) v with N a :class:`~attnlab.kernels.rows.RowOp`.

    q (B, H, Lq, d), k (B, H, Lk, d), v (B, H, Lk, d_v) (heads expanded), bias broadcastable to (B, H, Lq, Lk) or
    None (finite: the mask is ``allowed``), allowed bool broadcastable to (B, H, Lq, Lk) (True = may attend) or None,
    ``scale``, the row operation, ``cap`` c > 0 to apply before it or None → z (B, H, Lq, d_v). Differentiable in
    q, k, v and the bias (once). The (B, H, Lq, Lk) buffers come from :data:`POOL`."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        allowed: Tensor | None,
        scale: float,
        row_op: RowOp,
        cap: float | None,
    ) -> Tensor:
        shape = (*q.shape[:-1], k.shape[-2])  # (B, H, Lq, Lk)
        logits = torch.matmul(q * scale, k.transpose(-1, -2), out=POOL.take(shape, q.dtype))
        buffers = [logits]
        if bias is not None:
            logits.add_(bias)
        t = None
        if cap is not None:  # a row operation that does not cap: c·tanh(e / c) here, t kept for the backward pass
            t = logits.div_(cap).tanh_()
            logits = torch.mul(t, cap, out=POOL.take(shape, q.dtype))
            buffers.append(logits)
        if getattr(row_op, "prefers_out", False):  # it would keep a copy of the logits: keep the logits instead
            weights = POOL.take(shape, q.dtype)
            buffers.append(weights)
            weights, state = row_op.forward(logits, allowed, out=weights)
        else:
            weights, state = row_op.forward(logits, allowed)
        del logits
        z = torch.matmul(weights, v)
        ctx.save_for_backward(q, k, v)
        # intermediates, on the context: their buffers go back to the pool when it is freed
        ctx.weights, ctx.t, ctx.state, ctx.lease = weights, t, state, _Lease(*buffers)
        ctx.row_op, ctx.scale, ctx.cap = row_op, scale, cap
        ctx.bias_shape = None if bias is None else bias.shape
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        weights, t = ctx.weights, ctx.t
        needs = ctx.needs_input_grad
        # Wᵀ dZ as (dZᵀ W)ᵀ and dSᵀ q as (qᵀ dS)ᵀ: the same products, the (Lq, Lk) operand untransposed (BLAS on
        # a transposed (Lk, Lq) left operand took twice as long here)
        dv = torch.matmul(dz.transpose(-1, -2), weights).transpose(-1, -2) if needs[2] else None
        buffer = POOL.take(weights.shape, weights.dtype)
        d_logits = torch.matmul(dz, v.transpose(-1, -2), out=buffer)  # dW, then in place dS
        d_logits = ctx.row_op.backward(d_logits, weights, ctx.state)
        if t is not None:
            d_logits.mul_(torch.mul(t, t).neg_().add_(1.0))  # the cap's derivative 1 − t²
        dq = torch.matmul(d_logits, k).mul_(ctx.scale) if needs[0] else None
        dk = torch.matmul(q.transpose(-1, -2), d_logits).transpose(-1, -2).mul_(ctx.scale) if needs[1] else None
        d_bias = None
        shape = ctx.bias_shape
        if shape is not None and needs[3]:
            lead = d_logits.dim() - len(shape)
            dims = [d for d in range(d_logits.dim()) if d < lead or (shape[d - lead] == 1 and d_logits.shape[d] != 1)]
            d_bias = d_logits.sum(dims, keepdim=True).view(shape) if dims else d_logits.clone()
        del d_logits
        POOL.give(buffer)
        return dq, dk, dv, d_bias, None, None, None, None
