"""Flushing denormal floats to zero around one computation, forward and backward (``denormals.c`` beside this file).

SDPA's CPU flash kernel ran forgetting attention's backward pass 3–4× slower than a plain causal layer's (L 512,
2026-11-28): the forget gates' bias folded into q and k spreads each row's logits over a smooth range of hundreds,
and the exp() of a band of keys lands below float32's smallest normal (1.2·10⁻³⁸), where the cores compute in
microcode. :func:`flush_denormals` (a pair of identity autograd functions) sets the cores' flush-to-zero and
denormals-are-zero modes on torch's threads while the computation runs, forward and backward, and puts the previous
modes back after each; values below 10⁻³⁸ then become 0, which changes no float32 result beyond that. Where the
kernel cannot be built or the platform has no such mode, it does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.kernels.build import Library

__all__ = ["available", "flush_denormals", "set_flush"]


def _declare(lib: ctypes.CDLL) -> None:
    lib.attnlab_denormals.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.attnlab_denormals.restype = ctypes.c_int


_LIBRARY = Library(Path(__file__).with_name("denormals.c"), _declare)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _LIBRARY.get() is not None


def set_flush(on: bool) -> int:
    """Set (or clear) flush-to-zero and denormals-are-zero on this thread and torch's OpenMP threads → the previous
    state of this thread (1 set, 0 clear), or −1 where nothing was done."""
    lib = _LIBRARY.get()
    if lib is None:
        return -1
    return int(lib.attnlab_denormals(int(on), torch.get_num_threads()))


class _Enter(torch.autograd.Function):
    """Identity on its inputs; forward sets the modes, backward (after the computation's backward) restores them."""

    @staticmethod
    def forward(ctx: Any, state: list[int], *tensors: Tensor) -> tuple[Tensor, ...]:
        state.append(set_flush(True))
        ctx.state = state
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        previous = ctx.state[-1]
        if previous == 0:
            set_flush(False)
        return (None, *grads)


class _Leave(torch.autograd.Function):
    """Identity on its input; forward restores the modes, backward (before the computation's backward) sets them."""

    @staticmethod
    def forward(ctx: Any, state: list[int], out: Tensor) -> Tensor:
        if state[-1] == 0:
            set_flush(False)
        ctx.state = state
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        set_flush(True)
        return None, grad


def flush_denormals(fn: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    """``fn(*tensors)`` with denormals flushed to zero in its forward and its backward pass (on the CPU, where the
    kernel is built, eager; anything else calls ``fn`` as it is)."""
    if torch.compiler.is_compiling() or any(t.device.type != "cpu" for t in tensors) or not available():
        return fn(*tensors)
    state: list[int] = []
    inner = _Enter.apply(state, *tensors)
    return _Leave.apply(state, fn(*inner))
