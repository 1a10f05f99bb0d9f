"""Tiled softmax attention with a score modifier, forward and backward, on the CPU: the FlashAttention-2 algorithm.

    x_ij = scale · q_i · k_j + T[b, h, i][clamp(j − i, lo, hi) − lo]       (a bias table read at the offset)
    x_ij ← c · tanh(x_ij / c)                                             (soft-capping, Gemma 2)
    w_ij = e^{x_ij} / (e^{s_h} + Σ_visible e^{x})   or   σ(x_ij + b_i)    (softmax, softmax1, sink; sigmoid)
    z_i  = Σ_j w_ij v_j

Dao 2023 (FlashAttention-2), Algorithms 1 (forward: blocks of queries and keys, the online softmax with the row's
running maximum and sum, the log-sum-exp kept) and 2 (backward: each tile's weights recomputed from the
log-sum-exp, D_i = dO_i · z_i). The C file (``tiled.c``, built by :mod:`attnlab.kernels.build`) works on (BQ, BK)
tiles and never holds an (Lq, Lk) tensor; its block products call the BLAS ``sgemm_``/``dgemm_`` that PyTorch itself
links (MKL in the CPU wheels; found with ctypes in ``libtorch_cpu``), one thread each inside the kernel's parallel
region, or the kernel's own loops where PyTorch exports no BLAS (``blas=False``; ``ATTNLAB_TILED_BLAS=0``).

The mask is structure, not a tensor: a key interval [lo_i, hi_i) per query row (causal, sliding windows, any
position-only mask whose rows are intervals) and the key padding (B, Lk); whole key blocks outside them are
skipped. A bias table covers any bias that depends only on j − i per head (T5's buckets gathered over the offsets,
ALiBi's −m_h·|j − i|: lo = −(Lq − 1), hi = Lk − 1) and Shaw's key term q_i · w^K_{clip(j − i, k)} (one table row per
query row, lo = −k, hi = k).

Registered with ``torch.library`` as ``attnlab::tiled_attention`` (and its backward), which ``torch.compile`` and
the FLOP counter see as one operator; eager mode calls the same code through a plain autograd function.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attnlab.kernels.build import DTYPES, Library

__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "KeyRange",
    "OffsetTable",
    "available",
    "blas_available",
    "tiled_attention",
    "tiled_differential",
    "unavailable_reason",
]

BLOCK_Q = 64
"""Query rows per tile (FlashAttention-2's B_r)."""
BLOCK_K = 128
"""Keys per tile (B_c)."""

_SOFTMAX, _SIGMOID = 0, 1


class _Args(ctypes.Structure):
    """tiled.c's ``Args``, field for field."""

    _fields_ = [
        ("dtype", ctypes.c_int),
        ("normalizer", ctypes.c_int),
        *((name, ctypes.c_int64) for name in ("B", "H", "G", "Lq", "Lk", "d", "dv", "BQ", "BK")),
        ("scale", ctypes.c_double),
        ("cap", ctypes.c_double),
        *((name, ctypes.c_void_p) for name in ("q", "k", "v", "z", "lse", "table")),
        ("ts", ctypes.c_int64 * 3),
        ("clo", ctypes.c_int64),
        ("chi", ctypes.c_int64),
        ("sink", ctypes.c_void_p),
        ("row_bias", ctypes.c_void_p),
        ("rbs", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("lo", "hi", "keys", "kcount", "dz", "delta")),
        *((name, ctypes.c_void_p) for name in ("dq", "dk", "dvv", "dtable")),
        ("dts", ctypes.c_int64 * 3),
        ("sgemm", ctypes.c_void_p),
        ("dgemm", ctypes.c_void_p),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    lib.attnlab_tiled_args_size.restype = ctypes.c_int64
    if lib.attnlab_tiled_args_size() != ctypes.sizeof(_Args):
        raise AttributeError("tiled.c's Args and attnlab.kernels.tiled._Args differ")  # (a build out of step)
    for name in ("attnlab_tiled_forward", "attnlab_tiled_backward"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_Args), ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    lib.attnlab_tiled_backward_pair.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_Args), ctypes.c_double,
                                                ctypes.c_int]  # fmt: skip
    lib.attnlab_tiled_backward_pair.restype = ctypes.c_int


_LIBRARY = Library(Path(__file__).with_name("tiled.c"), _declare)


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _LIBRARY.get() is not None


def unavailable_reason() -> str | None:
    """One line saying why the kernel is not available, or None when it is."""
    return _LIBRARY.error


_GEMM: dict[str, int | None] = {}


def _blas() -> tuple[int | None, int | None]:
    """The addresses of PyTorch's own Fortran ``sgemm_`` and ``dgemm_`` (MKL in the CPU wheels), or None."""
    if not _GEMM:
        found: dict[str, int | None] = {"sgemm_": None, "dgemm_": None}
        if os.environ.get("ATTNLAB_TILED_BLAS", "1") != "0":
            lib_dir = Path(torch.__file__).parent / "lib"
            for path in [*sorted(lib_dir.glob("libtorch_cpu.*")), None]:
                try:
                    handle = ctypes.CDLL(str(path) if path else None)
                except OSError:
                    continue
                for name in found:
                    if found[name] is None:
                        try:
                            found[name] = ctypes.cast(getattr(handle, name), ctypes.c_void_p).value
                        except AttributeError:
                            pass
                if all(found.values()):
                    break
        _GEMM.update(found)
    return _GEMM["sgemm_"], _GEMM["dgemm_"]


def blas_available() -> bool:
    """Whether the block products go through PyTorch's BLAS (else through the kernel's own loops)."""
    return all(_blas())


@dataclass(frozen=True)
class OffsetTable:
    """A bias that depends on the offset j − i (and on b, h, i through the table's leading dimensions):
    ``bias[b, h, i, j] = table[b, h, i, clamp(j − i, low, high) − low]``.

    ``table`` is broadcastable to (B, H, R, high − low + 1), R = 1 (one row for every query: T5, ALiBi) or Lq
    (Shaw's per-row q · w^K); its gradient flows back through the kernel."""

    table: Tensor
    low: int
    high: int

    @classmethod
    def over_offsets(cls, table: Tensor, num_queries: int, num_keys: int) -> OffsetTable:
        """A per-head table over every offset −(Lq − 1) … Lk − 1: (H, Lq + Lk − 1) or (1, Lq + Lk − 1)."""
        return cls(table[None, :, None, :], -(num_queries - 1), num_keys - 1)

    @classmethod
    def clipped(cls, table: Tensor, clip: int) -> OffsetTable:
        """A per-row table over the clipped offsets −k … k: (B, H, Lq, 2k + 1) (Shaw)."""
        return cls(table, -clip, clip)


@dataclass(frozen=True)
class KeyRange:
    """The mask as structure: the visible keys of query row i are [lo[i], hi[i]) (None: all) that are real keys
    (``keys`` (B, Lk) bool, None: all)."""

    lo: Tensor | None = None
    hi: Tensor | None = None
    keys: Tensor | None = None


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _prepare_table(table: Tensor | None, B: int, H: int, dtype: torch.dtype) -> tuple[Tensor | None, tuple[int, ...]]:
    if table is None:
        return None, (0, 0, 0)
    t = table.to(dtype)
    while t.dim() < 4:
        t = t.unsqueeze(0)
    t = t.expand(B, H, t.shape[2], t.shape[3])
    if t.stride(-1) != 1:
        t = t.contiguous()
    rows = t.shape[2]
    return t, (t.stride(0), t.stride(1), t.stride(2) if rows > 1 else 0)


def _kernel_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor | None,
    lo: Tensor | None,
    hi: Tensor | None,
    keys: Tensor | None,
    sink: Tensor | None,
    low: int,
    high: int,
    scale: float,
    softcap: float,
    sigmoid: bool,
    sigmoid_bias: float | None,
    block_q: int,
    block_k: int,
    blas: bool,
) -> tuple[_Args, list[Tensor | None], Tensor | None]:
    """The kernel's ``Args`` for q, k, v and the rest in the forms it reads (contiguous, its dtype), the tensors it
    points into (keep them alive for the call), and the table expanded to (B, H, R, W) (None without one)."""
    B, H, Lq, d = q.shape
    a = _Args()
    a.dtype, a.normalizer = DTYPES[q.dtype], _SIGMOID if sigmoid else _SOFTMAX
    a.B, a.H, a.G, a.Lq, a.Lk, a.d, a.dv = B, H, k.shape[1], Lq, k.shape[2], d, v.shape[-1]
    a.BQ, a.BK, a.scale, a.cap = int(block_q), int(block_k), float(scale), float(softcap)
    a.q, a.k, a.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    t, a.ts[:] = _prepare_table(table, B, H, q.dtype)
    if t is not None:
        a.table, a.clo, a.chi = t.data_ptr(), low, high
    kcount = None
    if keys is not None:
        keys = keys.reshape(B, -1).to(torch.bool).contiguous().view(torch.uint8)
        kcount = torch.zeros(B, keys.shape[1] + 1, dtype=torch.int64)
        torch.cumsum(keys, 1, out=kcount[:, 1:])
    if lo is not None:
        lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    row_bias = None
    if sigmoid:
        if sigmoid_bias is not None:
            row_bias = torch.full((1, Lq), float(sigmoid_bias), dtype=q.dtype)
        else:  # −log n, n the keys row i sees
            lo_r = torch.zeros(Lq, dtype=torch.int64) if lo is None else lo
            hi_r = torch.full((Lq,), a.Lk, dtype=torch.int64) if hi is None else hi
            if kcount is not None:
                n = kcount[:, hi_r.clamp(min=0)] - kcount[:, lo_r.clamp(min=0)]
                n = torch.where(hi_r > lo_r, n, torch.zeros_like(n))  # (B, Lq)
            else:
                n = (hi_r - lo_r).clamp(min=0)[None]  # (1, Lq)
            row_bias = -torch.log(n.clamp(min=1).to(q.dtype))
        row_bias = row_bias.contiguous()
        a.rbs = row_bias.stride(0) if row_bias.shape[0] > 1 else 0
    sink = None if sink is None else sink.to(q.dtype).contiguous()
    a.sink, a.row_bias = _ptr(sink), _ptr(row_bias)
    a.lo, a.hi, a.keys, a.kcount = _ptr(lo), _ptr(hi), _ptr(keys), _ptr(kcount)
    if blas:
        a.sgemm, a.dgemm = _blas()
    return a, [t, sink, row_bias, lo, hi, keys, kcount], t


def _call(name: str, *args: Any) -> None:
    """Run the kernel's entry point ``name`` on torch's thread count; MemoryError when it ran out of memory."""
    if getattr(_LIBRARY.require(), name)(*args, torch.get_num_threads()):
        raise MemoryError("the tiled attention kernel ran out of memory")


def _backward_buffers(
    a: _Args, t: Tensor | None, z: Tensor, lse: Tensor, dz: Tensor, delta: Tensor, dq: Tensor, dk: Tensor,
    dv: Tensor, table_grad: bool,
) -> Tensor:  # fmt: skip
    """Point ``a`` at a backward pass's inputs and (zeroed) outputs → the table's gradient it accumulates into,
    (B, H, R, W) zeros like ``t`` (each (b, h) written by one thread), or an empty tensor without ``table_grad``."""
    a.z, a.lse, a.dz, a.delta = z.data_ptr(), lse.data_ptr(), dz.data_ptr(), delta.data_ptr()
    a.dq, a.dk, a.dvv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    if not table_grad or t is None:
        return dz.new_empty(0)
    d_table = torch.zeros(t.shape, dtype=dz.dtype)
    a.dtable = d_table.data_ptr()
    a.dts[:] = (d_table.stride(0), d_table.stride(1), d_table.stride(2) if t.shape[2] > 1 else 0)
    return d_table


def _fake_table_grad(q: Tensor, table: Tensor | None, table_grad: bool) -> Tensor:
    """The fake kernels' table gradient: (B, H, R, W) for a (…, R, W) table, or empty."""
    if not table_grad or table is None:
        return q.new_empty(0)
    return q.new_empty(q.shape[0], q.shape[1], table.shape[-2] if table.dim() == 4 else 1, table.shape[-1])


def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor | None,
    lo: Tensor | None,
    hi: Tensor | None,
    keys: Tensor | None,
    sink: Tensor | None,
    low: int,
    high: int,
    scale: float,
    softcap: float,
    sigmoid: bool,
    sigmoid_bias: float | None,
    block_q: int,
    block_k: int,
    blas: bool,
) -> tuple[Tensor, Tensor]:
    """z (B, H, Lq, d_v) and the rows' log-sum-exp (B, H, Lq) (0 for sigmoid and for a row that sees no key)."""
    B, H, Lq, _ = q.shape
    a, _keep, _ = _kernel_args(
        q, k, v, table, lo, hi, keys, sink, low, high, scale, softcap, sigmoid, sigmoid_bias, block_q, block_k, blas
    )
    z = q.new_empty(B, H, Lq, v.shape[-1])
    lse = q.new_empty(B, H, Lq)
    a.z, a.lse = z.data_ptr(), lse.data_ptr()
    _call("attnlab_tiled_forward", ctypes.byref(a))
    return z, lse


_forward_op = torch.library.custom_op("attnlab::tiled_attention", mutates_args=(), device_types="cpu")(_forward_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, table, lo, hi, keys, sink, low, high, scale, softcap, sigmoid, sigmoid_bias, *blocks):
    B, H, Lq, _ = q.shape
    return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq)


def _backward_impl(
    dz: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    z: Tensor,
    lse: Tensor,
    table: Tensor | None,
    lo: Tensor | None,
    hi: Tensor | None,
    keys: Tensor | None,
    sink: Tensor | None,
    low: int,
    high: int,
    scale: float,
    softcap: float,
    sigmoid: bool,
    sigmoid_bias: float | None,
    block_q: int,
    block_k: int,
    blas: bool,
    table_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, the table's gradient (B, H, R, W) (empty without ``table_grad``) and D = Σ dz·z (B, H, Lq), from
    which the sink's gradient follows."""
    a, _keep, t = _kernel_args(
        q, k, v, table, lo, hi, keys, sink, low, high, scale, softcap, sigmoid, sigmoid_bias, block_q, block_k, blas
    )
    dz = dz.contiguous()
    delta = (dz * z).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_table = _backward_buffers(a, t, z, lse, dz, delta, dq, dk, dv, table_grad)
    _call("attnlab_tiled_backward", ctypes.byref(a))
    return dq, dk, dv, d_table, delta


_backward_op = torch.library.custom_op("attnlab::tiled_attention_backward", mutates_args=(), device_types="cpu")(
    _backward_impl
)


@_backward_op.register_fake
def _backward_fake(dz, q, k, v, z, lse, table, lo, hi, keys, sink, *rest):
    d_table = _fake_table_grad(q, table, rest[-1])
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_table, q.new_empty(q.shape[:3])


def _gradients(
    ctx: Any, dz: Tensor, q: Tensor, k: Tensor, v: Tensor, z: Tensor, lse: Tensor, table: Tensor | None,
    sink: Tensor | None, backward: Any,
) -> tuple[Tensor | None, ...]:  # fmt: skip
    lo, hi, keys = ctx.mask
    want_table = table is not None and ctx.needs_input_grad[3]
    dq, dk, dv, d_table, delta = backward(dz, q, k, v, z, lse, table, lo, hi, keys, sink, *ctx.scalars, want_table)
    d_tab = _table_grad(d_table, table) if want_table else None
    d_sink = None
    if sink is not None and ctx.needs_input_grad[7]:  # its weight p₀ = e^{s_h − lse}, its value 0: ∂/∂s_h = −Σ p₀ D
        d_sink = -(torch.exp(sink.to(lse.dtype).view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sink.dtype)
    return dq, dk, dv, d_tab, None, None, None, d_sink, *(None,) * len(ctx.scalars)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, table, lo, hi, keys, sink, *scalars = inputs
    z, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, z, lse, table, sink)
    ctx.mask, ctx.scalars = (lo, hi, keys), tuple(scalars)


def _autograd_backward(ctx: Any, dz: Tensor, _d_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, z, lse, table, sink = ctx.saved_tensors
    return _gradients(ctx, dz, q, k, v, z, lse, table, sink, _backward_op)


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _TiledFunction(torch.autograd.Function):
    """The same operator for eager mode, without the custom operator's dispatch overhead."""

    @staticmethod
    def forward(ctx: Any, q, k, v, table, lo, hi, keys, sink, *scalars):
        z, lse = _forward_impl(q, k, v, table, lo, hi, keys, sink, *scalars)
        ctx.save_for_backward(q, k, v, z, lse, table, sink)
        ctx.mask, ctx.scalars = (lo, hi, keys), scalars
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, z, lse, table, sink = ctx.saved_tensors
        return _gradients(ctx, dz, q, k, v, z, lse, table, sink, _backward_impl)


def _check_inputs(name: str, q: Tensor, k: Tensor, v: Tensor, normalizer: str) -> None:
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{name} takes float32 or float64, got {q.dtype}, {k.dtype}, {v.dtype}")
    if normalizer not in ("softmax", "sigmoid"):
        raise ValueError(f"{name}: normalizer must be softmax or sigmoid, got {normalizer!r}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"{name}: {q.shape[1]} query heads do not group over {k.shape[1]} key heads")


def _scalars(
    bias: OffsetTable | None, scale: float, softcap: float | None, normalizer: str, sigmoid_bias: float | None,
    block_q: int, block_k: int, blas: bool,
) -> tuple[Any, ...]:  # fmt: skip
    """The operators' trailing scalar arguments: low, high, scale, softcap, sigmoid, sigmoid_bias, the blocks, blas."""
    return (
        0 if bias is None else int(bias.low), 0 if bias is None else int(bias.high), float(scale),
        0.0 if softcap is None else float(softcap), normalizer == "sigmoid",
        None if sigmoid_bias is None else float(sigmoid_bias), int(block_q), int(block_k), bool(blas),
    )  # fmt: skip


def _use_operator() -> bool:
    """Whether to call the registered operator (compiling, or under a dispatch mode such as the FLOP counter, which
    then sees it) rather than the plain autograd function."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    bias: OffsetTable | None = None,
    keys: KeyRange | None = None,
    softcap: float | None = None,
    normalizer: str = "softmax",
    sink: Tensor | None = None,
    sigmoid_bias: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    blas: bool = True,
) -> Tensor:
    """q (B, H, Lq, d), k (B, G, Lk, d), v (B, G, Lk, d_v) (G divides H: grouped heads), CPU, float32 or float64 →
    z (B, H, Lq, d_v), differentiable (once) in q, k, v, the bias table and the sink.

    ``bias``: an :class:`OffsetTable`; ``keys``: the visible keys as a :class:`KeyRange` (None: all); ``softcap``:
    c of c·tanh(x / c) (None: none); ``normalizer``: ``softmax`` (with ``sink`` (H,) the sink logits: softmax1 is a
    sink of 0) or ``sigmoid`` (σ(x + b) with b = ``sigmoid_bias``, None: −log of the keys the row sees). A row that
    sees no key gives 0."""
    _check_inputs("tiled_attention", q, k, v, normalizer)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kr = keys or KeyRange()
    table = None if bias is None else bias.table
    scalars = _scalars(bias, scale, softcap, normalizer, sigmoid_bias, block_q, block_k, blas)
    args = (q, k, v, table, kr.lo, kr.hi, kr.keys, sink, *scalars)
    if _use_operator():
        return _forward_op(*args)[0]
    with torch.profiler.record_function("attnlab::tiled_attention"):  # named in profiles
        return _TiledFunction.apply(*args)


# ------------------------------------------------------------------------------ differential attention, two maps


def _pair_forward_impl(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    v: Tensor,
    lam: Tensor,
    table1: Tensor | None,
    table2: Tensor | None,
    lo: Tensor | None,
    hi: Tensor | None,
    keys: Tensor | None,
    sink: Tensor | None,
    low: int,
    high: int,
    scale: float,
    softcap: float,
    sigmoid: bool,
    sigmoid_bias: float | None,
    block_q: int,
    block_k: int,
    blas: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """z = z1 − λ z2 (B, H, Lq, d_v), then z1, z2 and the two maps' log-sum-exp (B, H, Lq), kept for the backward."""
    sink1, sink2 = _map_sinks(sink, q1.shape[1])
    rest = (low, high, scale, softcap, sigmoid, sigmoid_bias, block_q, block_k, blas)
    z1, lse1 = _forward_impl(q1, k1, v, table1, lo, hi, keys, sink1, *rest)
    z2, lse2 = _forward_impl(q2, k2, v, table2, lo, hi, keys, sink2, *rest)
    return z1 - lam.to(z1.dtype) * z2, z1, z2, lse1, lse2


_pair_forward_op = torch.library.custom_op("attnlab::tiled_differential", mutates_args=(), device_types="cpu")(
    _pair_forward_impl
)


@_pair_forward_op.register_fake
def _pair_forward_fake(q1, k1, q2, k2, v, *rest):
    B, H, Lq, _ = q1.shape
    z = q1.new_empty(B, H, Lq, v.shape[-1])
    return z, z.new_empty(z.shape), z.new_empty(z.shape), q1.new_empty(B, H, Lq), q1.new_empty(B, H, Lq)


def _pair_backward_impl(
    dz: Tensor,
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    v: Tensor,
    lam: Tensor,
    z1: Tensor,
    z2: Tensor,
    lse1: Tensor,
    lse2: Tensor,
    table1: Tensor | None,
    table2: Tensor | None,
    lo: Tensor | None,
    hi: Tensor | None,
    keys: Tensor | None,
    sink: Tensor | None,
    low: int,
    high: int,
    scale: float,
    softcap: float,
    sigmoid: bool,
    sigmoid_bias: float | None,
    block_q: int,
    block_k: int,
    blas: bool,
    table_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq1, dk1, dq2, dk2, dv, the two tables' gradients (empty without ``table_grad``) and each map's D = Σ dz_m·z_m
    (B, H, Lq), dz_1 = dz and dz_2 = −λ dz: one pass of the kernel over both maps."""
    sink1, sink2 = _map_sinks(sink, q1.shape[1])
    rest = (low, high, scale, softcap, sigmoid, sigmoid_bias, block_q, block_k, blas)
    a1, _keep1, t1 = _kernel_args(q1, k1, v, table1, lo, hi, keys, sink1, *rest)
    a2, _keep2, t2 = _kernel_args(q2, k2, v, table2, lo, hi, keys, sink2, *rest)
    dz = dz.contiguous()
    delta1 = (dz * z1).sum(-1)
    delta2 = -lam.to(dz.dtype) * (dz * z2).sum(-1)
    dq1, dk1, dq2, dk2, dv = (torch.zeros_like(t) for t in (q1, k1, q2, k2, v))
    dt1 = _backward_buffers(a1, t1, z1, lse1, dz, delta1, dq1, dk1, dv, table_grad)
    dt2 = _backward_buffers(a2, t2, z2, lse2, dz, delta2, dq2, dk2, dv, table_grad)  # (its dv unread: a1's)
    _call("attnlab_tiled_backward_pair", ctypes.byref(a1), ctypes.byref(a2), float(lam))
    return dq1, dk1, dq2, dk2, dv, dt1, dt2, delta1, delta2


_pair_backward_op = torch.library.custom_op(
    "attnlab::tiled_differential_backward", mutates_args=(), device_types="cpu"
)(_pair_backward_impl)


@_pair_backward_op.register_fake
def _pair_backward_fake(dz, q1, k1, q2, k2, v, lam, z1, z2, lse1, lse2, table1, table2, lo, hi, keys, sink, *rest):
    d_tables = (_fake_table_grad(q1, table1, rest[-1]), _fake_table_grad(q1, table2, rest[-1]))
    grads = tuple(t.new_empty(t.shape) for t in (q1, k1, q2, k2, v))
    return *grads, *d_tables, lse1.new_empty(lse1.shape), lse2.new_empty(lse2.shape)


def _map_sinks(sink: Tensor | None, heads: int) -> tuple[Tensor | None, Tensor | None]:
    """The two maps' sink logits (H,) each: a (2H,) sink is the maps' own (component-major, as q: a learned sink
    per map and head); an (H,) one serves both."""
    if sink is None or sink.numel() != 2 * heads:
        return sink, sink
    return sink[:heads], sink[heads:]


def _table_grad(d_table: Tensor, table: Tensor) -> Tensor:
    full = (1,) * (4 - table.dim()) + tuple(table.shape)
    return d_table.sum_to_size(full).reshape(table.shape)


def _pair_gradients(ctx: Any, dz: Tensor, saved: tuple[Tensor, ...], backward: Any) -> tuple[Tensor | None, ...]:
    q1, k1, q2, k2, v, lam, z1, z2, lse1, lse2, table1, table2, sink = saved
    lo, hi, keys = ctx.mask
    needs = ctx.needs_input_grad
    want = (table1 is not None and needs[6]) or (table2 is not None and needs[7])
    dq1, dk1, dq2, dk2, dv, dt1, dt2, delta1, delta2 = backward(
        dz, q1, k1, q2, k2, v, lam, z1, z2, lse1, lse2, table1, table2, lo, hi, keys, sink, *ctx.scalars, want
    )
    d_t1 = _table_grad(dt1, table1) if table1 is not None and needs[6] else None
    d_t2 = _table_grad(dt2, table2) if table2 is not None and needs[7] else None
    d_lam = -(dz * z2).sum().to(lam.dtype).reshape(lam.shape) if needs[5] else None
    d_sink = None
    if sink is not None and needs[11]:  # each map's sink weight p₀ = e^{s_h − lse}: −Σ p₀ D (over both maps, shared)
        s1, s2 = (s.to(lse1.dtype).view(1, -1, 1) for s in _map_sinks(sink, q1.shape[1]))
        g1 = -(torch.exp(s1 - lse1) * delta1).sum((0, 2))
        g2 = -(torch.exp(s2 - lse2) * delta2).sum((0, 2))
        d_sink = (torch.cat((g1, g2)) if sink.numel() == 2 * q1.shape[1] else g1 + g2).to(sink.dtype)
    return dq1, dk1, dq2, dk2, dv, d_lam, d_t1, d_t2, None, None, None, d_sink, *(None,) * len(ctx.scalars)


def _pair_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q1, k1, q2, k2, v, lam, table1, table2, lo, hi, keys, sink, *scalars = inputs
    _, z1, z2, lse1, lse2 = output
    ctx.mark_non_differentiable(z1, z2, lse1, lse2)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q1, k1, q2, k2, v, lam, z1, z2, lse1, lse2, table1, table2, sink)
    ctx.mask, ctx.scalars = (lo, hi, keys), tuple(scalars)


def _pair_autograd_backward(ctx: Any, dz: Tensor, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    return _pair_gradients(ctx, dz, ctx.saved_tensors, _pair_backward_op)


_pair_forward_op.register_autograd(_pair_autograd_backward, setup_context=_pair_setup_context)


class _PairFunction(torch.autograd.Function):
    """The differential operator for eager mode (as :class:`_TiledFunction`)."""

    @staticmethod
    def forward(ctx: Any, q1, k1, q2, k2, v, lam, table1, table2, lo, hi, keys, sink, *scalars):
        z, z1, z2, lse1, lse2 = _pair_forward_impl(q1, k1, q2, k2, v, lam, table1, table2, lo, hi, keys, sink, *scalars)
        ctx.save_for_backward(q1, k1, q2, k2, v, lam, z1, z2, lse1, lse2, table1, table2, sink)
        ctx.mask, ctx.scalars = (lo, hi, keys), scalars
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        return _pair_gradients(ctx, dz, ctx.saved_tensors, _pair_backward_impl)


def tiled_differential(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    v: Tensor,
    lam: Tensor,
    scale: float,
    bias1: OffsetTable | None = None,
    bias2: OffsetTable | None = None,
    keys: KeyRange | None = None,
    softcap: float | None = None,
    normalizer: str = "softmax",
    sink: Tensor | None = None,
    sigmoid_bias: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    blas: bool = True,
) -> Tensor:
    """Differential attention's two maps over the same values (Ye et al. 2024, eq. 1), z = z1 − λ·z2 with
    z_m = tiled_attention(q_m, k_m, v, bias_m, …) (B, H, Lq, d_v): q1, q2 (B, H, Lq, d), k1, k2 (B, G, Lk, d) (the same
    tensor where the maps share their keys), v (B, G, Lk, d_v), λ a 0-dim tensor; differentiable (once) in all of
    them, the tables and the sink. The forward is the two maps' passes; the backward is one pass over both, which
    shares the products with the values (dV += (P1 − λP2)ᵀ dZ, dP = dZ Vᵀ): 8 block products instead of 10.
    ``sink``: (H,) both maps' sink logits, or (2H,) each map's own (map 1's heads first, as q)."""
    _check_inputs("tiled_differential", q1, k1, v, normalizer)
    _check_inputs("tiled_differential", q2, k2, v, normalizer)
    if q1.shape != q2.shape or k1.shape != k2.shape:
        raise ValueError(f"tiled_differential: the maps differ in shape: {tuple(q1.shape)}, {tuple(q2.shape)}")
    if (bias1 is None) != (bias2 is None) or (
        bias1 is not None and bias2 is not None and (bias1.low, bias1.high) != (bias2.low, bias2.high)
    ):
        raise ValueError("tiled_differential: both maps take a bias table over the same offsets, or neither does")
    q1, k1, q2, k2, v = (t.contiguous() for t in (q1, k1, q2, k2, v))
    kr = keys or KeyRange()
    lam = lam.reshape(()).to(q1.dtype)
    t1 = None if bias1 is None else bias1.table
    t2 = None if bias2 is None else bias2.table
    scalars = _scalars(bias1, scale, softcap, normalizer, sigmoid_bias, block_q, block_k, blas)
    args = (q1, k1, q2, k2, v, lam, t1, t2, kr.lo, kr.hi, kr.keys, sink, *scalars)
    if _use_operator():
        return _pair_forward_op(*args)[0]
    with torch.profiler.record_function("attnlab::tiled_differential"):
        return _PairFunction.apply(*args)
