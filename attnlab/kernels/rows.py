"""Row operations: a normalizer (and the soft-cap before it) as one forward and one backward pass over the rows of
the logits, for the fused eager backend (:mod:`attnlab.backends.normalized`).

A :class:`RowOp` turns logits (B, H, Lq, Lk) into weights in place, keeping what its backward pass needs, and turns
the weights' gradient into the logits' gradient in place. A normalizer offers one through ``row_op()`` (None when it
cannot: no kernel built here, a parameter the kernel does not take); the backend then computes
``z = N(scale · q kᵀ + bias) v`` with the (B, H, Lq, Lk) tensors written once and overwritten, instead of autograd's
chain of saved intermediates. Guarantees, as for every normalizer: a masked key gets exactly 0 in values and
gradients, and a row that sees no key gets all zeros, never NaN.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["RowOp"]


@runtime_checkable
class RowOp(Protocol):
    """Logits → weights along the last dimension (keys), in one pass each way.

    ``forward(logits, allowed)``: logits (B, H, Lq, Lk), contiguous, float32 or float64, owned by the caller and free
    to be overwritten; allowed: bool broadcastable to (B, H, Lq, Lk), True = may attend, or None → (weights
    (B, H, Lq, Lk), state), where ``state`` is whatever :meth:`backward` needs (tensors; weights may be
    ``logits`` itself, overwritten). ``backward(d_weights, weights, state)``: d_weights (B, H, Lq, Lk), contiguous,
    free to be overwritten → d_logits (B, H, Lq, Lk) (may be ``d_weights`` itself), 0 at masked keys.

    Optional: ``prefers_out = True`` says that ``forward(logits, allowed, out=buffer)`` (the weights written into a
    buffer of the logits' shape, the logits left as they are and kept in the state) is cheaper than in place, where
    the operation would have to allocate a copy of what its backward pass reads (softpick)."""

    name: str

    def forward(self, logits: Tensor, allowed: Tensor | None) -> tuple[Tensor, Any]: ...

    def backward(self, d_weights: Tensor, weights: Tensor, state: Any) -> Tensor: ...
