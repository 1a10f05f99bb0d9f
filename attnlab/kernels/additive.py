"""Fused additive (Bahdanau) attention logits on the CPU.

    logits[b, h, i, j] = Σ_a v[h, a] · tanh(wq[b, h, i, a] + uk[b, h, j, a])      wq (B, H, Lq, d_a), uk (B, H, Lk, d_a)

The kernel is C (``additive.c`` beside this file), built on first use by :mod:`attnlab.kernels.build` (tanh is
vectorised by glibc's libmvec). Forward and backward never write a (·, Lk, d_a) activation: tanh is evaluated
once per element in each pass, straight into the sums. Both are registered with ``torch.library`` as the operators
``attnlab::additive_logits`` and ``attnlab::additive_logits_backward``, which ``torch.compile`` sees as one
opaque operator; eager mode calls the same code through a plain autograd function (less overhead per call), except
under a dispatch mode (``torch.utils.flop_counter.FlopCounterMode``, a profiler's mode), which sees only operators:
there eager mode calls the operator, whose FLOP formula :mod:`attnlab.compute` registers.

Where it cannot be built (no compiler, Windows), :func:`available` is False, :func:`unavailable_reason` says why in
one line, and :class:`attnlab.scores.AdditiveScore` falls back to its chunked PyTorch kernel (logging that line
once).

Results are bitwise independent of the thread count (each backward thread owns whole (b, h) slices).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attnlab.kernels.build import DTYPES, KernelBuildError, Library

__all__ = [
    "KernelBuildError",
    "additive_logits",
    "available",
    "supports",
    "unavailable_reason",
]


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.attnlab_additive_forward.argtypes = [c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, c_int]
    lib.attnlab_additive_backward.argtypes = [c_int, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, c_int]
    lib.attnlab_additive_forward.restype = lib.attnlab_additive_backward.restype = c_int


_LIBRARY = Library(Path(__file__).with_name("additive.c"), _declare)


def available() -> bool:
    """Whether the fused CPU kernel is built and loaded (building it on first call)."""
    return _LIBRARY.get() is not None


def unavailable_reason() -> str | None:
    """One line saying why the fused kernel is not available, or None when it is."""
    return _LIBRARY.error


def supports(*tensors: Tensor) -> bool:
    """Whether the fused kernel can take these tensors: on the CPU, and the kernel is available."""
    return all(t.device.type == "cpu" for t in tensors) and available()


def _lib() -> ctypes.CDLL:
    return _LIBRARY.require()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in DTYPES else torch.float32  # half precision (autocast) is computed in float32


def _check(status: int, what: str) -> None:
    if status != 0:
        raise MemoryError(f"the fused additive kernel's {what} pass ran out of memory")


def _forward_impl(wq: Tensor, uk: Tensor, v: Tensor) -> Tensor:
    B, H, Lq, A = wq.shape
    Lk = uk.shape[2]
    dtype = _compute_dtype(wq.dtype)
    wq_c = wq.to(dtype).contiguous()
    ukT = uk.to(dtype).transpose(-1, -2).contiguous()  # (B, H, d_a, Lk): keys contiguous for the inner loop
    v_c = v.to(dtype).contiguous()
    out = torch.empty(B, H, Lq, Lk, dtype=dtype)
    status = _lib().attnlab_additive_forward(
        DTYPES[dtype], wq_c.data_ptr(), ukT.data_ptr(), v_c.data_ptr(), out.data_ptr(),
        B * H, H, Lq, Lk, A, torch.get_num_threads(),
    )  # fmt: skip
    _check(status, "forward")
    return out.to(wq.dtype)


_forward_op = torch.library.custom_op("attnlab::additive_logits", mutates_args=(), device_types="cpu")(_forward_impl)


@_forward_op.register_fake
def _forward_fake(wq: Tensor, uk: Tensor, v: Tensor) -> Tensor:
    return wq.new_empty(*wq.shape[:3], uk.shape[2])


def _backward_impl(grad: Tensor, wq: Tensor, uk: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B, H, Lq, A = wq.shape
    Lk = uk.shape[2]
    dtype = _compute_dtype(wq.dtype)
    wq_c = wq.to(dtype).contiguous()
    ukT = uk.to(dtype).transpose(-1, -2).contiguous()
    g = grad.to(dtype).contiguous()
    g_wq = torch.empty(B, H, Lq, A, dtype=dtype)
    g_ukT = torch.zeros(B, H, A, Lk, dtype=dtype)
    g_v = torch.zeros(B, H, A, dtype=dtype)
    status = _lib().attnlab_additive_backward(
        DTYPES[dtype], wq_c.data_ptr(), ukT.data_ptr(), g.data_ptr(), g_wq.data_ptr(), g_ukT.data_ptr(),
        g_v.data_ptr(), B * H, H, Lq, Lk, A, torch.get_num_threads(),
    )  # fmt: skip
    _check(status, "backward")
    v_row = v.to(dtype).view(1, H, 1, A)
    return (
        g_wq.mul_(v_row).to(wq.dtype),
        g_ukT.transpose(-1, -2).contiguous().mul_(v_row).to(uk.dtype),  # contiguous, as the fake kernel says
        g_v.sum(0).to(v.dtype),
    )


_backward_op = torch.library.custom_op("attnlab::additive_logits_backward", mutates_args=(), device_types="cpu")(
    _backward_impl
)


@_backward_op.register_fake
def _backward_fake(grad: Tensor, wq: Tensor, uk: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # contiguous outputs, as the real kernel's (empty_like would copy the strides of a transposed input)
    return wq.new_empty(wq.shape), uk.new_empty(uk.shape), v.new_empty(v.shape)


def _setup_context(ctx: object, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]


def _autograd_backward(ctx: object, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    wq, uk, v = ctx.saved_tensors  # type: ignore[attr-defined]
    return _backward_op(grad, wq, uk, v)


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _AdditiveFunction(torch.autograd.Function):
    """The same operator for eager mode, without the custom operator's dispatch (about 0.2 ms a call, which
    matters at the small sizes of most runs)."""

    @staticmethod
    def forward(ctx: Any, wq: Tensor, uk: Tensor, v: Tensor) -> Tensor:
        ctx.save_for_backward(wq, uk, v)
        return _forward_impl(wq, uk, v)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _backward_impl(grad, *ctx.saved_tensors)


def additive_logits(wq: Tensor, uk: Tensor, v: Tensor) -> Tensor:
    """wq (B, H, Lq, d_a), uk (B, H, Lk, d_a), v (H, d_a) → logits (B, H, Lq, Lk) = Σ_a v_a tanh(wq_ia + uk_ja),
    differentiable in all three (once: there is no double backward). CPU only; float32 and float64 are computed
    as such, other dtypes in float32. Raises :class:`KernelBuildError` when the kernel is not available."""
    _lib()
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return _forward_op(wq, uk, v)  # (a dispatch mode, e.g. the FLOP counter, sees the operator)
    with torch.profiler.record_function("attnlab::additive_logits"):  # named in profiles (the bench's kernel)
        return _AdditiveFunction.apply(wq, uk, v)
