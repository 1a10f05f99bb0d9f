"""Softmax attention with a learned relative-position bias table (Shaw, T5), fused on the CPU.

    z = softmax(scale · q kᵀ + bias) v,    bias[b, h, i, j] = T[row, c(i, j)]

with a small table T and a column index c(i, j) that is constant along runs of consecutive keys:

* Shaw et al. 2018: one table row per query row, T = q · w^Kᵀ / √d_k (B, H, Lq, 2k + 1), c = clip(j − i, k) + k;
* T5: one table row per head, T = the bucket biases (H, num_buckets), c = bucket(j − i).

The matrix products are PyTorch's; the C kernel (``relative.c``, built by :mod:`attnlab.kernels.build`) adds the
bias and takes the softmax in place (exp vectorised by libmvec; PyTorch's CPU softmax costs about 4 ns an element
here, several times SDPA's), and in the backward pass turns dP into the logits' gradient in place while summing it
over each run into the table's gradient: no (B, H, Lq, Lk) bias is built and no scatter is needed. The weights and
the output are all that is kept for the backward pass.

Registered with ``torch.library`` as ``attnlab::relative_attention`` (and its backward), which ``torch.compile``
sees as one operator; eager mode calls the same code through a plain autograd function (less overhead per call),
except under a dispatch mode (``torch.utils.flop_counter.FlopCounterMode``), which then sees the operator (whose FLOP
formula :mod:`attnlab.compute` registers) and not the matrix products inside it.
Where the kernel cannot be built, :func:`available` is False and the caller uses PyTorch (``MultiHeadAttention``
then builds the bias and calls SDPA or its own biased softmax).
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

__all__ = ["Runs", "available", "relative_attention", "unavailable_reason"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.attnlab_relative_threads.argtypes = [i64, c_int]
    lib.attnlab_relative_threads.restype = c_int
    lib.attnlab_relative_forward.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.attnlab_relative_forward.argtypes += [c_int, c_int]
    lib.attnlab_relative_backward.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.attnlab_relative_backward.argtypes += [c_int, c_int]
    lib.attnlab_relative_forward.restype = lib.attnlab_relative_backward.restype = c_int


_LIBRARY = Library(Path(__file__).with_name("relative.c"), _declare)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _LIBRARY.get() is not None


def unavailable_reason() -> str | None:
    """One line saying why the kernel is not available, or None when it is."""
    return _LIBRARY.error


class Runs:
    """The runs of a (Lq, Lk) column index c(i, j): for query row i, runs ``ptr[i] .. ptr[i + 1]``, each starting at
    key ``starts[r]`` with column ``cols[r]`` and ending where the next starts (the last at Lk)."""

    def __init__(self, index: Tensor) -> None:
        index = index.to("cpu", torch.int64)
        Lq, Lk = index.shape
        change = torch.ones(Lq, Lk, dtype=torch.bool)
        change[:, 1:] = index[:, 1:] != index[:, :-1]
        rows, starts = change.nonzero(as_tuple=True)  # row-major: runs in order
        self.ptr = torch.zeros(Lq + 1, dtype=torch.int64)
        self.ptr[1:] = torch.bincount(rows, minlength=Lq).cumsum(0)
        self.starts = starts.to(torch.int32).contiguous()
        self.cols = index[rows, starts].to(torch.int32).contiguous()
        self.shape = (Lq, Lk)
        self.num_columns = int(index.max()) + 1 if index.numel() else 0


def _hidden_args(hidden: Tensor | None, shape: tuple[int, int, int, int]) -> tuple[Tensor | None, Tensor | None]:
    if hidden is None:
        return None, None
    h = hidden.expand(shape)
    if h.dtype != torch.bool:
        h = h != 0  # a full-size copy, with its own strides
    return h.view(torch.uint8), torch.tensor(h.stride(), dtype=torch.int64)


def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    ptr: Tensor,
    starts: Tensor,
    cols: Tensor,
    hidden: Tensor | None,
    scale: float,
    per_row: bool,
) -> tuple[Tensor, Tensor]:
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    weights = torch.matmul(q * scale, k.transpose(-1, -2)).contiguous()  # (B, H, Lq, Lk): the logits, then in place
    t = table.to(q.dtype).contiguous()
    mask, strides = _hidden_args(hidden, (B, H, Lq, Lk))
    status = _LIBRARY.require().attnlab_relative_forward(
        DTYPES[q.dtype], weights.data_ptr(), t.data_ptr(), ptr.data_ptr(), starts.data_ptr(), cols.data_ptr(),
        None if mask is None else mask.data_ptr(), None if strides is None else strides.data_ptr(),
        B, H, Lq, Lk, t.shape[-1], int(per_row), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("the relative attention kernel ran out of memory")
    return torch.matmul(weights, v), weights


_forward_op = torch.library.custom_op("attnlab::relative_attention", mutates_args=(), device_types="cpu")(_forward_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, table, ptr, starts, cols, hidden, scale, per_row):
    B, H, Lq, _ = q.shape
    return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, k.shape[2])


def _backward_impl(
    dz: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weights: Tensor,
    z: Tensor,
    table: Tensor,
    ptr: Tensor,
    starts: Tensor,
    cols: Tensor,
    scale: float,
    per_row: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    lib = _LIBRARY.require()
    dz = dz.contiguous()
    # Wᵀ dZ and dSᵀ q with the (L, L) operand untransposed (faster), made contiguous as the operator's outputs
    dv = torch.matmul(dz.transpose(-1, -2), weights).transpose(-1, -2).contiguous()
    d_logits = torch.matmul(dz, v.transpose(-1, -2)).contiguous()  # dP, then in place dS
    row_dot = (dz * z).sum(-1).contiguous()  # D_i = Σ_j P_ij dP_ij
    C = table.shape[-1]
    threads = torch.get_num_threads()
    if per_row:
        d_table = torch.zeros(B * H * Lq, C, dtype=q.dtype)
    else:
        d_table = torch.zeros(lib.attnlab_relative_threads(B * H * Lq, threads), H, C, dtype=q.dtype)
    status = lib.attnlab_relative_backward(
        DTYPES[q.dtype], d_logits.data_ptr(), weights.data_ptr(), row_dot.data_ptr(), d_table.data_ptr(),
        ptr.data_ptr(), starts.data_ptr(), cols.data_ptr(), B, H, Lq, Lk, C, int(per_row), threads,
    )  # fmt: skip
    if status:
        raise MemoryError("the relative attention kernel ran out of memory")
    dq = torch.matmul(d_logits, k).mul_(scale)
    dk = torch.matmul(q.transpose(-1, -2), d_logits).transpose(-1, -2).contiguous().mul_(scale)
    d_table = d_table.view(table.shape) if per_row else d_table.sum(0)
    return dq, dk, dv, d_table.to(table.dtype)


_backward_op = torch.library.custom_op("attnlab::relative_attention_backward", mutates_args=(), device_types="cpu")(
    _backward_impl
)


@_backward_op.register_fake
def _backward_fake(dz, q, k, v, weights, z, table, ptr, starts, cols, scale, per_row):
    # contiguous outputs, as the real kernel's (empty_like would copy the strides of a transposed input)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), table.new_empty(table.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, table, ptr, starts, cols, _, scale, per_row = inputs
    z, weights = output
    ctx.mark_non_differentiable(weights)  # an output only so that the backward pass can have it
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, weights, z, table, ptr, starts, cols)
    ctx.scale, ctx.per_row = scale, per_row


def _autograd_backward(ctx, dz: Tensor, _d_weights: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, weights, z, table, ptr, starts, cols = ctx.saved_tensors
    dq, dk, dv, d_table = _backward_op(dz, q, k, v, weights, z, table, ptr, starts, cols, ctx.scale, ctx.per_row)
    return dq, dk, dv, d_table, None, None, None, None, None, None


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _RelativeFunction(torch.autograd.Function):
    """The same operator for eager mode, without the custom operator's dispatch overhead."""

    @staticmethod
    def forward(ctx: Any, q, k, v, table, ptr, starts, cols, hidden, scale, per_row):
        z, weights = _forward_impl(q, k, v, table, ptr, starts, cols, hidden, scale, per_row)
        ctx.save_for_backward(q, k, v, weights, z, table, ptr, starts, cols)
        ctx.scale, ctx.per_row = scale, per_row
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, weights, z, table, ptr, starts, cols = ctx.saved_tensors
        dq, dk, dv, d_table = _backward_impl(dz, q, k, v, weights, z, table, ptr, starts, cols, ctx.scale, ctx.per_row)
        return dq, dk, dv, d_table, None, None, None, None, None, None


def relative_attention(
    q: Tensor, k: Tensor, v: Tensor, table: Tensor, runs: Runs, hidden: Tensor | None, scale: float
) -> Tensor:
    """q (B, H, Lq, d), k (B, H, Lk, d), v (B, H, Lk, d_v), ``table`` (B, H, Lq, C) (one row per query row: Shaw)
    or (H, C) (one per head: T5), ``runs`` of the (Lq, Lk) column index, ``hidden`` bool broadcastable to
    (B, H, Lq, Lk) (True = the key is hidden; no row entirely hidden) or None → z (B, H, Lq, d_v). float32 or
    float64, CPU; differentiable in q, k, v and the table (once)."""
    if q.dtype not in DTYPES:
        raise TypeError(f"relative_attention takes float32 or float64, got {q.dtype}")
    per_row = table.dim() == 4
    args = (q, k, v, table, runs.ptr, runs.starts, runs.cols, hidden, float(scale), per_row)
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return _forward_op(*args)[0]  # (a dispatch mode, e.g. the FLOP counter, sees the operator)
    with torch.profiler.record_function("attnlab::relative_attention"):  # named in profiles (the bench's kernel)
        return _RelativeFunction.apply(*args)
