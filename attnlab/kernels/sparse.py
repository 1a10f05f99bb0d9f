"""Sparsemax, 1.5-entmax and softpick over the rows of attention logits, on the CPU, exact and without sorting.

The kernel is C (``sparse.c`` beside this file), built on first use by :mod:`attnlab.kernels.build` (exp and sqrt
vectorised through libmvec). Per row of logits s (Lk keys, hidden keys excluded), with m the row maximum:

* ``sparsemax`` (Martins & Astudillo 2016): w = [s − τ]₊ with Σ w = 1. τ − m ∈ [−1, 0); Michelot's iteration from
  −1 (over S = {s > t}, t ← (Σ_S s − 1) / |S|) rises through lower bounds of τ and stops, exactly, when S no longer
  shrinks: S is then the support and t is τ in closed form. Backward: ∂L/∂s = 1_S ⊙ (g − mean_S g).
* ``entmax15`` (Peters et al. 2019): w = [z − τ]₊² with z = (s − m)/2 and Σ w = 1, τ ∈ [−1, 0). Newton's method
  from the left on √F(t) − 1, F(t) = Σ [z − t]₊² (convex and decreasing, so each iterate is a lower bound of τ and
  the support S = {z > t} a superset of the true one); at each iterate the quadratic Σ_S (z − τ)² = 1 is solved in
  closed form, and its root is τ as soon as it keeps every element of S: the sort-based algorithm's test on a sorted
  prefix, without the sort. Backward, with u = √w: ∂L/∂s = u ⊙ g − u · Σ u g / Σ u.
* ``softpick`` (Zuhri et al. 2025): w = ReLU(e^{s} − 1) / (Σ |e^{s} − 1| + ε), computed with m' = max(m, 0) taken out
  as :class:`attnlab.normalizers.Softpick` does (D the denominator multiplied through by e^{−m'}); keeps (m', 1/D)
  per row and, in place, R = (e^{s − m'} − e^{−m'}) / D (B, H, Lq, Lk); out of place, the backward pass reads the
  logits instead of R. Backward, with u = e^{s − m'} / D: ∂L/∂s = u ⊙ (g − Σ g w) where s > 0, u · Σ g w where
  s < 0, 0 where s = 0.

Each is a :class:`~attnlab.kernels.rows.RowOp` (:class:`SparseRowOp`, in place both ways, for the fused backend) and
an autograd function (:func:`row_normalize`, out of place, for the normalizers' eager path). Hidden keys get exactly
0 in values and gradients; a row that sees no key gets all zeros. Where the kernel cannot be built, :func:`available`
is False and :func:`unavailable_reason` says why in one line; the normalizers then use their PyTorch code.
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
    "KINDS",
    "SparseRowOp",
    "available",
    "row_normalize",
    "supports",
    "supports_tensors",
    "unavailable_reason",
]

KINDS = {"sparsemax": 0, "entmax15": 1, "softpick": 2}  # the kernel's codes


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int, c_double = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_double
    lib.attnlab_sparse_forward.argtypes = [c_int, c_int, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.attnlab_sparse_forward.argtypes += [c_double, c_int]
    lib.attnlab_sparse_backward.argtypes = [c_int, c_int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.attnlab_sparse_backward.argtypes += [c_int]
    lib.attnlab_sparse_forward.restype = lib.attnlab_sparse_backward.restype = c_int


_LIBRARY = Library(Path(__file__).with_name("sparse.c"), _declare)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _LIBRARY.get() is not None


def unavailable_reason() -> str | None:
    """One line saying why the kernel is not available, or None when it is."""
    return _LIBRARY.error


def supports(logits: Tensor, allowed: Tensor | None = None) -> bool:
    """Whether :func:`row_normalize` can take these: logits (B, H, Lq, Lk) float32/64 on the CPU, ``allowed`` None
    or on the CPU, eager (not traced by ``torch.compile`` nor under a dispatch mode), and the kernel available."""
    return supports_tensors(logits, allowed) and available()


def supports_tensors(logits: Tensor, allowed: Tensor | None = None) -> bool:
    """Whether a C row kernel can take these tensors: logits (B, H, Lq, Lk) float32/64 on the CPU, ``allowed`` None
    or on the CPU, eager (not traced by ``torch.compile`` nor under a dispatch mode: the FLOP counter)."""
    return (
        logits.dim() == 4
        and logits.dtype in DTYPES
        and logits.device.type == "cpu"
        and (allowed is None or allowed.device.type == "cpu")
        and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
    )


def _mask_args(allowed: Tensor | None, shape: torch.Size) -> tuple[Tensor | None, Tensor | None]:
    """allowed → (uint8 view broadcast to ``shape`` (B, H, Lq, Lk), its 4 strides), or (None, None)."""
    if allowed is None:
        return None, None
    a = allowed if allowed.dtype == torch.bool else allowed != 0
    a = a.expand(shape)
    return a.view(torch.uint8), torch.tensor(a.stride(), dtype=torch.int64)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(status: int, name: str) -> None:
    if status == 1:
        raise MemoryError(f"the {name} row kernel ran out of memory")
    if status:
        raise ValueError(f"the {name} row kernel refused its arguments (status {status})")


class SparseRowOp:
    """``sparsemax``, ``entmax15`` or ``softpick`` (with ``eps``) as a :class:`~attnlab.kernels.rows.RowOp`.

    ``forward(logits (B, H, Lq, Lk), allowed)`` writes the weights over the logits (or into ``out``) → (weights,
    state): None for sparsemax and entmax15 (their backward needs only the weights); for softpick (R (B, H, Lq, Lk),
    rows (B, H, Lq, 2)) in place, and out of place (rows, logits, allowed), the logits then left as they are and read
    again by the backward pass. ``backward(d_weights, weights, state)`` writes the logits' gradient over d_weights
    (or into ``out``). float32 or float64, contiguous, on the CPU; the kernel must be :func:`available`."""

    def __init__(self, name: str, eps: float = 1e-6) -> None:
        if name not in KINDS:
            raise ValueError(f"SparseRowOp: unknown normalizer '{name}' (one of {', '.join(KINDS)})")
        self.name, self.kind, self.eps = name, KINDS[name], float(eps)
        self.prefers_out = name == "softpick"
        """softpick in place must keep R (B, H, Lq, Lk) for its backward pass, a new tensor of the logits' size each
        call; given ``out=`` it writes the weights there and keeps the logits instead (its caller's buffer)."""

    def forward(self, logits: Tensor, allowed: Tensor | None, out: Tensor | None = None) -> tuple[Tensor, Any]:
        """logits (B, H, Lq, Lk) contiguous, overwritten unless ``out`` (a new tensor of the same shape and dtype)
        is given → (weights (B, H, Lq, Lk), state)."""
        if logits.dtype not in DTYPES or not logits.is_contiguous() or logits.dim() != 4:
            raise TypeError(f"{self.name} row kernel: logits must be contiguous 4-d float32/64, got {logits.dtype}")
        w = logits if out is None else out
        B, H, Lq, Lk = logits.shape
        mask, strides = _mask_args(allowed, logits.shape)
        r = rows = None
        if self.name == "softpick":
            rows = logits.new_empty(B, H, Lq, 2)
            r = torch.empty_like(logits) if out is None else None
        status = _LIBRARY.require().attnlab_sparse_forward(
            self.kind, DTYPES[logits.dtype], logits.data_ptr(), w.data_ptr(), _ptr(r), _ptr(rows), _ptr(mask),
            _ptr(strides), B, H, Lq, Lk, self.eps, torch.get_num_threads(),
        )  # fmt: skip
        _check(status, self.name)
        if rows is None:
            return w, None
        return w, ((r, rows) if r is not None else (rows, logits, allowed))

    def backward(self, d_weights: Tensor, weights: Tensor, state: Any, out: Tensor | None = None) -> Tensor:
        """d_weights (B, H, Lq, Lk) contiguous, overwritten unless ``out`` is given, the forward's weights and
        state → d_logits (B, H, Lq, Lk), 0 at hidden keys."""
        if not (d_weights.is_contiguous() and weights.is_contiguous()) or d_weights.dtype != weights.dtype:
            raise TypeError(f"{self.name} row kernel: d_weights and weights must be contiguous, of one dtype")
        d = d_weights if out is None else out
        r = rows = logits = mask = strides = None
        if state is not None and len(state) == 2:
            r, rows = state
        elif state is not None:
            rows, logits, allowed = state
            mask, strides = _mask_args(allowed, weights.shape)
        B, H, Lq, Lk = weights.shape
        status = _LIBRARY.require().attnlab_sparse_backward(
            self.kind, DTYPES[weights.dtype], d_weights.data_ptr(), d.data_ptr(), weights.data_ptr(), _ptr(r),
            _ptr(rows), _ptr(logits), _ptr(mask), _ptr(strides), B, H, Lq, Lk, torch.get_num_threads(),
        )  # fmt: skip
        _check(status, self.name)
        return d

    def __repr__(self) -> str:
        return f"SparseRowOp({self.name!r}" + (f", eps={self.eps:g})" if self.name == "softpick" else ")")


class _RowFunction(torch.autograd.Function):
    """A :class:`SparseRowOp` out of place, differentiable (once) in the logits."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, allowed: Tensor | None, op: SparseRowOp) -> Tensor:
        x = logits.contiguous()
        weights, state = op.forward(x, allowed, out=torch.empty_like(x))
        ctx.op, ctx.softpick, ctx.allowed = op, state is not None, allowed
        ctx.save_for_backward(weights, *(state[:2] if state is not None else ()))  # softpick: rows, logits
        return weights

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        weights, *state = ctx.saved_tensors
        g = grad.to(weights.dtype).contiguous()
        full = (*state, ctx.allowed) if ctx.softpick else None
        return ctx.op.backward(g, weights, full, out=torch.empty_like(weights)), None, None


def row_normalize(op: SparseRowOp, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
    """``op``'s weights (B, H, Lq, Lk) of logits (B, H, Lq, Lk) float32/64 on the CPU, allowed bool broadcastable
    to (B, H, Lq, Lk) (True = may attend) or None; differentiable in the logits (once). See :func:`supports`."""
    return _RowFunction.apply(logits, allowed, op)
