"""Scoring functions and position biases: q (B, H, Lq, d_k), k (B, H, Lk, d_k) → logits (B, H, Lq, Lk).

Every **score** (the content term of the logits) is an ``nn.Module`` registered by name
(``@register_score("name")``) and built with ``build_score(name, d_k=..., num_heads=..., **params)``. Plain
functions ``fn(q, k, **params) -> logits`` can be registered too; they are wrapped in a parameter-free module.

Every **position bias** (none, shaw, t5, alibi) is a :class:`PositionBias` registered with
``@register_position_bias("name")``: ``bias(q, num_keys)`` returns an additive (…, H, Lq, Lk) term that attention
adds to any score, the additive one included, and an optional value-side term. The score presets
``relative_position``, ``t5_bias`` and ``alibi`` are scaled (T5: unscaled) dot products with their bias built in.

Two optional hooks extend the plain ``forward``:

* **Dot-product family** (:class:`DotProductScore`): logits = ``scale · φ(q) · ψ(k)ᵀ + bias``, where ``φ`` is
  :meth:`DotProductScore.query_map` (identity except Luong's *general* and *cosine*), ``ψ`` is
  :meth:`DotProductScore.key_map` (identity except *cosine*) and ``bias`` is :meth:`DotProductScore.bias`, an
  additive (…, H, Lq, Lk) term (the presets' position bias). Such scores can run in
  ``torch.nn.functional.scaled_dot_product_attention`` with the bias as a float mask: the fast path.
* **Value-side term** (:meth:`Score.value_term`): a score or bias whose attention also contributes to the output
  (Shaw's a^V) sets ``has_value_term = True`` and returns (B, H, Lq, d_v), added to ``weights @ v``. Such scores
  take the eager path.

Positions are 0-based; for self-attention query i and key j are the same sequence positions.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab.checks import check_choice, check_int, check_number
from attnlab.kernels import additive as fused_additive
from attnlab.kernels import relative as relative_kernel
from attnlab.registry import BoundedCache, Registry, check_params

__all__ = [
    "AdditiveScore",
    "AlibiBias",
    "AlibiScore",
    "CosineScore",
    "DotProductScore",
    "DotScore",
    "GeneralScore",
    "PositionBias",
    "RelativePositionScore",
    "ScaledDotScore",
    "Score",
    "ShawBias",
    "T5Bias",
    "T5BiasScore",
    "alibi_slopes",
    "build_position_bias",
    "build_score",
    "list_position_biases",
    "list_scores",
    "register_position_bias",
    "register_score",
    "t5_relative_bucket",
]


class Score(nn.Module):
    """Base class of scoring functions.

    Args:
        d_k: per-head query/key size.
        num_heads: number of heads H (scores with per-head parameters keep one set per head).
        d_v: per-head value size; only scores with a value-side term use it.
    """

    has_value_term: bool = False

    def __init__(self, d_k: int, num_heads: int, d_v: int | None = None) -> None:
        super().__init__()
        self.d_k = d_k
        self.num_heads = num_heads
        self.d_v = d_k if d_v is None else d_v

    def forward(self, q: Tensor, k: Tensor) -> Tensor:  # pragma: no cover - abstract
        """q (B, H, Lq, d_k), k (B, H, Lk, d_k) → logits (B, H, Lq, Lk)."""
        raise NotImplementedError

    def value_term(self, weights: Tensor) -> Tensor | None:
        """weights (B, H, Lq, Lk) → extra output (B, H, Lq, d_v) added to ``weights @ v``, or None."""
        return None

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_heads={self.num_heads}"


class DotProductScore(Score):
    """logits = scale · query_map(q) · key_map(k)ᵀ + bias(q, Lk). Eligible for the SDPA fast path.

    ``static_bias``: the bias depends on positions only (no parameters, no q) and ``bias`` returns the same cached
    tensor for the same shapes, so the fast path may cache its combination with a cached mask too (ALiBi).
    """

    static_bias: bool = False

    def __init__(self, d_k: int, num_heads: int, d_v: int | None = None, scale: float = 1.0) -> None:
        super().__init__(d_k, num_heads, d_v)
        self.scale = float(scale)

    def query_map(self, q: Tensor) -> Tensor:
        """φ(q), (B, H, Lq, d_k) → (B, H, Lq, d_k). Identity unless overridden."""
        return q

    def key_map(self, k: Tensor) -> Tensor:
        """ψ(k), (B, H, Lk, d_k) → (B, H, Lk, d_k). Identity unless overridden (applied per key/value head)."""
        return k

    def position_term(self) -> PositionBias | None:
        """The position bias whose :meth:`PositionBias.bias` is this score's :meth:`bias` (the presets), or None;
        a score that overrides :meth:`bias` some other way returns ``self`` (an opaque term)."""
        return None if type(self).bias is DotProductScore.bias else self

    def bias(self, q: Tensor, num_keys: int) -> Tensor | None:
        """Additive logit term broadcastable to (B, H, Lq, Lk), already scaled, or None."""
        return None

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        phi = self.query_map(q)
        if self.scale != 1.0:
            phi = phi * self.scale  # on (B, H, Lq, d_k), not on the Lk-times larger logits
        logits = torch.matmul(phi, self.key_map(k).transpose(-2, -1))  # (B, H, Lq, Lk)
        b = self.bias(q, k.shape[-2])
        return logits if b is None else logits + b


# --------------------------------------------------------------------------------------------- registry


class FunctionScore(Score):
    """Wraps a registered plain function ``fn(q, k, **params) -> logits``. Parameter-free."""

    def __init__(self, name: str, fn: Callable[..., Tensor], d_k: int, num_heads: int, **params: Any) -> None:
        super().__init__(d_k, num_heads)
        self.name, self.fn, self.params = name, fn, params

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return self.fn(q, k, **self.params)

    def extra_repr(self) -> str:
        return f"{self.name}, {self.params}"


def _build_with_sizes(kind: str, name: str, obj: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The build kwargs for a registered class: d_k and num_heads are required, d_v is passed only when the class
    takes it, and any other parameter must be one the class takes."""
    kwargs = dict(kwargs)
    for required in ("d_k", "num_heads"):
        if required not in kwargs:
            raise ValueError(f"build_{kind.replace(' ', '_')}('{name}') needs {required}=")
    sizes = ("d_k", "num_heads", "d_v")
    check_params(kind, name, obj, {k: v for k, v in kwargs.items() if k not in sizes}, sizes)
    sig = inspect.signature(obj)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    if "d_v" not in sig.parameters and not takes_any:
        kwargs.pop("d_v", None)
    return kwargs


def _wrap_score(name: str, obj: Any, kwargs: dict[str, Any]) -> nn.Module:
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return obj(**_build_with_sizes("score", name, obj, kwargs))
    kwargs = dict(kwargs)
    for required in ("d_k", "num_heads"):
        if required not in kwargs:
            raise ValueError(f"build_score('{name}') needs {required}=")
    d_k, num_heads = kwargs.pop("d_k"), kwargs.pop("num_heads")
    kwargs.pop("d_v", None)
    check_params("score", name, obj, kwargs, ("q", "k"))
    return FunctionScore(name, obj, d_k, num_heads, **kwargs)


_SCORES: Registry[nn.Module] = Registry("score", _wrap_score)


def register_score(name: str) -> Callable[[Any], Any]:
    """Decorator registering a score class (``__init__(d_k, num_heads, [d_v], **params)``) or a function
    ``fn(q, k, **params) -> logits`` under ``name``."""
    return _SCORES.register(name)


def build_score(name: str, **kwargs: Any) -> nn.Module:
    """Build the score ``name``: ``build_score("alibi", d_k=16, num_heads=4)``."""
    return _SCORES.build(name, **kwargs)


def list_scores() -> list[str]:
    """Names of the registered scores."""
    return _SCORES.names()


@register_score("dot")
class DotScore(DotProductScore):
    """Luong et al. 2015, *dot*: logits = q · kᵀ (unscaled; Var = d_k for unit-variance q, k)."""

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__(d_k, num_heads, scale=1.0)


@register_score("scaled_dot")
class ScaledDotScore(DotProductScore):
    """Vaswani et al. 2017, eq. 1: logits = q · kᵀ / √d_k."""

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__(d_k, num_heads, scale=d_k**-0.5)


@register_score("general")
class GeneralScore(DotProductScore):
    """Luong et al. 2015, *general*: logits = q W_h kᵀ with a learned W_h (d_k, d_k) per head, unscaled.

    ``weight`` (H, d_k, d_k) is initialised N(0, 1/d_k), so φ(q) = q W keeps q's variance and the logits start with
    the same spread as *dot*.
    """

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__(d_k, num_heads, scale=1.0)
        self.weight = nn.Parameter(torch.randn(num_heads, d_k, d_k) * d_k**-0.5)

    def query_map(self, q: Tensor) -> Tensor:
        return torch.matmul(q, self.weight)  # (B, H, Lq, d_k) @ (H, d_k, d_k) → (B, H, Lq, d_k)


# --------------------------------------------------------------------------------------------- Bahdanau


def _default_chunk(batch_heads: int, num_queries: int, num_keys: int, d_attn: int, budget: int) -> int:
    per_row = max(1, batch_heads * num_keys * d_attn)
    return max(1, min(num_queries, budget // per_row))


def _per_head_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x (B, H, L, d) @ w (H, d, a) → (B, H, L, a) as one (B·L, d) @ (d, a) product per head. (``torch.matmul``
    would broadcast w to (B, H, d, a): B products per head, and a (B, H, d, a) gradient summed over B, which at
    d = a = 512 made it most of the additive score's step.)"""
    B, H, L, d = x.shape
    out = torch.matmul(x.transpose(0, 1).reshape(H, B * L, d), w)  # (H, B·L, a)
    return out.view(H, B, L, w.shape[-1]).transpose(0, 1)


class _AdditiveLogits(torch.autograd.Function):
    """logits[b,h,i,j] = Σ_a v[h,a] tanh(wq[b,h,i,a] + uk[b,h,j,a]), over chunks of query rows.

    The (B, H, Lq, Lk, d_a) activation t = tanh(·) is needed again in the backward pass. When it fits in
    ``save_elements`` it is kept (fast); otherwise only the (B, H, ·, d_a) inputs are kept and the backward pass
    recomputes t chunk by chunk, so peak memory is one chunk (B, H, chunk, Lk, d_a) instead of the whole.

    Backward, with g = ∂L/∂logits and t² summed against g (no (·, d_a) temporaries beyond one chunk):
        ∂L/∂v_a    = Σ_{b,i,j} g_ij t_ija
        ∂L/∂wq_ia  = v_a (Σ_j g_ij − Σ_j g_ij t²_ija)
        ∂L/∂uk_ja  = v_a (Σ_i g_ij − Σ_i g_ij t²_ija)
    """

    @staticmethod
    def forward(ctx: Any, wq: Tensor, uk: Tensor, v: Tensor, chunk: int, save_elements: int) -> Tensor:
        B, H, Lq, A = wq.shape
        Lk = uk.shape[2]
        out = wq.new_empty(B, H, Lq, Lk)
        keep = B * H * Lq * Lk * A <= save_elements
        saved: list[Tensor] = []
        v_col = v.view(1, H, A, 1)
        for s in range(0, Lq, chunk):
            t = torch.add(wq[:, :, s : s + chunk, None, :], uk[:, :, None, :, :]).tanh_()  # (B, H, c, Lk, A)
            c = t.shape[2]
            out[:, :, s : s + chunk] = torch.matmul(t.view(B, H, c * Lk, A), v_col).view(B, H, c, Lk)
            if keep:
                saved.append(t)
        ctx.save_for_backward(wq, uk, v, *saved)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        wq, uk, v, *saved = ctx.saved_tensors
        B, H, Lq, A = wq.shape
        Lk = uk.shape[2]
        chunk = ctx.chunk
        grad = grad.contiguous()
        g_wq = torch.empty_like(wq)
        g_uk = torch.zeros_like(uk)
        g_v = torch.zeros(B, H, 1, A, dtype=v.dtype, device=v.device)
        for n, s in enumerate(range(0, Lq, chunk)):
            if saved:
                t = saved[n]
            else:
                t = torch.add(wq[:, :, s : s + chunk, None, :], uk[:, :, None, :, :]).tanh_()
            c = t.shape[2]
            g = grad[:, :, s : s + chunk]  # (B, H, c, Lk)
            g_v += torch.matmul(g.reshape(B, H, 1, c * Lk), t.view(B, H, c * Lk, A))  # Σ g t
            gt2 = torch.mul(t, t).mul_(g.unsqueeze(-1))  # g t², (B, H, c, Lk, A)
            g_wq[:, :, s : s + chunk] = g.sum(3, keepdim=True) - gt2.sum(3)
            g_uk += g.sum(2).unsqueeze(-1) - gt2.sum(2)
        v_row = v.view(1, H, 1, A)
        return g_wq.mul_(v_row), g_uk.mul_(v_row), g_v.sum(0).view(H, A), None, None


@register_score("additive")
class AdditiveScore(Score):
    """Bahdanau et al. 2015 (eq. in §A.1.2): logits = vᵀ tanh(W q + U k), per head.

    Parameters ``w_q``, ``w_k`` (H, d_k, d_a) and ``v`` (H, d_a), with the attention dimension d_a = ``d_attn``
    (default d_k).

    ``kernel``: ``fused`` is the C kernel of :mod:`attnlab.kernels.additive` (CPU): tanh straight into the sums,
    no (B, H, Lq, Lk, d_a) activation in either pass. ``chunked`` is plain PyTorch, for any device: queries in
    chunks of ``chunk_size`` rows (default: as many as fit ``chunk_elements`` elements); the activation is kept
    for the backward pass only when it has at most ``save_elements`` elements (128 MB in float32), else it is
    recomputed chunk by chunk, so memory stays bounded at long L. ``auto`` (default) is ``fused`` on the CPU when
    the kernel builds, else ``chunked`` (saying once why). All equal the naive form.
    """

    KERNELS = ("auto", "fused", "chunked")

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        d_attn: int | None = None,
        chunk_size: int | None = None,
        chunk_elements: int = 1 << 22,
        save_elements: int = 1 << 25,
        kernel: str = "auto",
    ) -> None:
        super().__init__(d_k, num_heads)
        self.kernel = check_choice("kernel", kernel, self.KERNELS)
        self.d_attn = d_k if d_attn is None else check_int("d_attn", d_attn, minimum=1)
        self.chunk_size = None if chunk_size is None else check_int("chunk_size", chunk_size, minimum=1)
        self.chunk_elements = check_int("chunk_elements", chunk_elements, minimum=1)
        self.save_elements = int(save_elements)
        self.w_q = nn.Parameter(torch.randn(num_heads, d_k, self.d_attn) * d_k**-0.5)
        self.w_k = nn.Parameter(torch.randn(num_heads, d_k, self.d_attn) * d_k**-0.5)
        self.v = nn.Parameter(torch.randn(num_heads, self.d_attn) * self.d_attn**-0.5)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        wq = _per_head_matmul(q, self.w_q)  # (B, H, Lq, d_a)
        uk = _per_head_matmul(k, self.w_k)  # (B, H, Lk, d_a)
        if self.kernel != "chunked" and self._use_fused(wq):
            return fused_additive.additive_logits(wq, uk, self.v)
        B, H, Lq, _ = wq.shape
        chunk = self.chunk_size or _default_chunk(B * H, Lq, uk.shape[2], self.d_attn, self.chunk_elements)
        return _AdditiveLogits.apply(wq, uk, self.v, chunk, self.save_elements)

    def _use_fused(self, wq: Tensor) -> bool:
        if fused_additive.supports(wq):
            return True
        if self.kernel == "fused":
            reason = fused_additive.unavailable_reason() or f"inputs on {wq.device.type}, the kernel is CPU-only"
            raise RuntimeError(f"additive kernel=fused cannot run: {reason}; use kernel=auto or kernel=chunked")
        _note_fallback(wq)
        return False

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_heads={self.num_heads}, d_attn={self.d_attn}, kernel={self.kernel}"


_FALLBACK_NOTED: set[str] = set()


def _note_fallback(wq: Tensor) -> None:
    """Logs once per process and device type why the additive score uses its chunked kernel."""
    device = wq.device.type
    if device in _FALLBACK_NOTED:
        return
    _FALLBACK_NOTED.add(device)
    reason = fused_additive.unavailable_reason() if device == "cpu" else f"the fused kernel is CPU-only ({device})"
    logging.getLogger("attnlab").warning("additive: using the chunked PyTorch kernel: %s", reason)


# --------------------------------------------------------------------------------------------- cosine


@register_score("cosine")
class CosineScore(DotProductScore):
    """Cosine attention: logits = τ_h · q̂ · k̂ᵀ, with q and k l2-normalised per head (Henry et al. 2020, QKNorm;
    Liu et al. 2022, Swin Transformer v2) and a learned temperature per head τ_h = exp(min(log_scale_h,
    log max_scale)), initialised at ``init_scale`` (10, as Swin v2) and capped at ``max_scale`` (100).

    Logits are bounded by τ_h whatever d_k is, so the softmax cannot saturate from the size of q · k alone.
    """

    def __init__(self, d_k: int, num_heads: int, init_scale: float = 10.0, max_scale: float = 100.0) -> None:
        super().__init__(d_k, num_heads, scale=1.0)
        init_scale = check_number("init_scale", init_scale, low=0.0, low_open=True)
        max_scale = check_number("max_scale", max_scale, low=init_scale)
        self.log_scale = nn.Parameter(torch.full((num_heads,), math.log(init_scale)))
        self.max_log_scale = math.log(max_scale)

    def temperature(self) -> Tensor:
        """τ_h, (H,)."""
        return self.log_scale.clamp(max=self.max_log_scale).exp()

    def query_map(self, q: Tensor) -> Tensor:
        return F.normalize(q, dim=-1) * self.temperature().to(q.dtype).view(-1, 1, 1)  # (B, H, Lq, d_k)

    def key_map(self, k: Tensor) -> Tensor:
        return F.normalize(k, dim=-1)


# --------------------------------------------------------------------------------------------- position biases


class PositionBias(nn.Module):
    """Base class of position biases: ``bias(q, num_keys)`` → an additive (…, H, Lq, Lk) logit term, already
    scaled, that attention adds to the score's logits. It may read q (Shaw) or only positions (T5, ALiBi).

    ``has_value_term`` / :meth:`value_term`: as for scores (Shaw's a^V). ``static_bias``: the bias depends on
    positions only and ``bias`` returns the same cached tensor for the same shapes (ALiBi), so that the fast path
    may cache its combination with a cached mask.
    """

    has_value_term: bool = False
    static_bias: bool = False

    def __init__(self, d_k: int, num_heads: int, d_v: int | None = None) -> None:
        super().__init__()
        self.d_k = d_k
        self.num_heads = num_heads
        self.d_v = d_k if d_v is None else d_v
        self._tables = BoundedCache()

    def bias(self, q: Tensor, num_keys: int) -> Tensor:  # pragma: no cover - abstract
        """q (B, H, Lq, d_k) → additive logits broadcastable to (B, H, Lq, Lk)."""
        raise NotImplementedError

    def table_bias(self, q: Tensor, num_keys: int) -> tuple[Tensor, relative_kernel.Runs] | None:
        """The bias as a table read through a relative-position index, for the fused kernel of
        :mod:`attnlab.kernels.relative`: (table, runs of the (Lq, Lk) column index), the table (B, H, Lq, C) (a row
        per query) or (H, C) (a row per head), such that ``bias[…, i, j] = table[row, c(i, j)]``; None (default)
        when the bias is not of that form."""
        return None

    def value_term(self, weights: Tensor) -> Tensor | None:
        """weights (B, H, Lq, Lk) → extra output (B, H, Lq, d_v) added to ``weights @ v``, or None."""
        return None

    def forward(self, q: Tensor, num_keys: int) -> Tensor:
        return self.bias(q, num_keys)

    def relative_positions(self, num_queries: int, num_keys: int, device: torch.device) -> Tensor:
        """(Lq, Lk) long tensor of key − query positions, cached."""

        def make() -> Tensor:
            i = torch.arange(num_queries, device=device)
            j = torch.arange(num_keys, device=device)
            return j[None, :] - i[:, None]

        return self._tables.get_or_make(("rel", num_queries, num_keys, device), make)

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_heads={self.num_heads}"


def _wrap_bias(name: str, obj: Any, kwargs: dict[str, Any]) -> nn.Module:
    if not (isinstance(obj, type) and issubclass(obj, PositionBias)):
        raise TypeError(f"position bias '{name}' must be registered on a PositionBias subclass, got {obj!r}")
    return obj(**_build_with_sizes("position bias", name, obj, kwargs))


_POSITION_BIASES: Registry[nn.Module] = Registry("position bias", _wrap_bias)


def register_position_bias(name: str) -> Callable[[Any], Any]:
    """Decorator registering a :class:`PositionBias` subclass (``__init__(d_k, num_heads, [d_v], **params)``)."""
    return _POSITION_BIASES.register(name)


def build_position_bias(name: str | None, **kwargs: Any) -> nn.Module | None:
    """Build the position bias ``name``: ``build_position_bias("alibi", d_k=16, num_heads=4)``; ``"none"`` or
    None gives None (no bias)."""
    if name is None or name == "none":
        return None
    return _POSITION_BIASES.build(name, **kwargs)


def list_position_biases() -> list[str]:
    """Names of the registered position biases, and ``none``."""
    return sorted([*_POSITION_BIASES.names(), "none"])


@register_position_bias("shaw")
class ShawBias(PositionBias):
    """Shaw et al. 2018: the bias q_i · a^K_{ij} / √d_k with a^K_{ij} = w^K_{clip(j − i, k)}.

    ``rel_k`` (2·clip + 1, d_k) holds w^K_{−k..k}, shared across heads as in the paper. The bias is computed as
    q · w^Kᵀ over the 2k + 1 distances, then gathered: no (Lq, Lk, d_k) tensor is built.

    ``value_term=True`` adds Shaw's value-side a^V: z_i = Σ_j α_ij (v_j + w^V_{clip(j − i, k)}), with
    ``rel_v`` (2·clip + 1, d_v). Off by default: the paper's ablation found a^K alone sufficient.
    """

    def __init__(
        self, d_k: int, num_heads: int, d_v: int | None = None, clip: int = 16, value_term: bool = False
    ) -> None:
        super().__init__(d_k, num_heads, d_v)
        self.clip = check_int("clip", clip, minimum=0)
        self.scale = d_k**-0.5
        self.has_value_term = bool(value_term)
        self.rel_k = nn.Parameter(torch.randn(2 * clip + 1, d_k) * d_k**-0.5)
        self.rel_v = nn.Parameter(torch.randn(2 * clip + 1, self.d_v) * self.d_v**-0.5) if value_term else None

    def distance_index(self, num_queries: int, num_keys: int, device: torch.device) -> Tensor:
        """(Lq, Lk) long tensor clip(j − i, k) + k ∈ [0, 2k], cached."""
        return self._tables.get_or_make(
            ("idx", num_queries, num_keys, device),
            lambda: self.relative_positions(num_queries, num_keys, device).clamp(-self.clip, self.clip) + self.clip,
        )

    def bias(self, q: Tensor, num_keys: int) -> Tensor:
        Lq = q.shape[-2]
        idx = self.distance_index(Lq, num_keys, q.device)  # (Lq, Lk)
        qa = torch.matmul(q, self.rel_k.t() * self.scale)  # (B, H, Lq, 2k+1)
        # gather along the last dimension (its backward is one scatter-add; advanced indexing's is 3x slower)
        return torch.gather(qa, -1, idx.expand(*qa.shape[:-1], num_keys))  # (B, H, Lq, Lk)

    def table_bias(self, q: Tensor, num_keys: int) -> tuple[Tensor, relative_kernel.Runs]:
        Lq = q.shape[-2]
        runs = self._tables.get_or_make(
            ("runs", Lq, num_keys), lambda: relative_kernel.Runs(self.distance_index(Lq, num_keys, torch.device("cpu")))
        )
        return torch.matmul(q, self.rel_k.t() * self.scale), runs  # (B, H, Lq, 2k+1)

    def value_term(self, weights: Tensor) -> Tensor | None:
        if self.rel_v is None:
            return None
        Lq, Lk = weights.shape[-2:]
        idx = self.distance_index(Lq, Lk, weights.device).expand_as(weights)
        per_distance = weights.new_zeros(*weights.shape[:-1], 2 * self.clip + 1)
        per_distance.scatter_add_(-1, idx, weights)  # (B, H, Lq, 2k+1): Σ of weights at each clipped distance
        return torch.matmul(per_distance, self.rel_v)  # (B, H, Lq, d_v)

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, clip={self.clip}, value_term={self.has_value_term}"


def t5_relative_bucket(
    relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket of each relative position (key − query), Raffel et al. 2020, as in Mesh TensorFlow.

    Half the buckets (per direction when bidirectional) are exact for small distances; the rest grow
    logarithmically up to ``max_distance``, beyond which everything shares the last bucket. With
    ``bidirectional=False`` (causal), keys after the query all fall in bucket 0.
    """
    n = -relative_position
    ret = torch.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = (
        max_exact
        + (
            torch.log(n.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return ret + torch.where(is_small, n, large)


@register_position_bias("t5")
class T5Bias(PositionBias):
    """Raffel et al. 2020 (T5): the bias b_h[bucket(j − i)], a learned scalar per bucket and head.

    ``rel_bias`` (num_buckets, H). ``bidirectional``: separate buckets for keys before and after the query (T5's
    encoder); False puts every later key in bucket 0 and spends all buckets on the past (T5's decoder). None
    (default) is True here; the encoder resolves it to False under a causal mask.
    """

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool | None = None,
    ) -> None:
        super().__init__(d_k, num_heads)
        self.num_buckets = check_int("num_buckets", num_buckets, minimum=2)
        self.max_distance = check_int("max_distance", max_distance, minimum=2)
        self.bidirectional = True if bidirectional is None else bool(bidirectional)
        self.rel_bias = nn.Parameter(torch.randn(num_buckets, num_heads) * 0.1)

    def buckets(self, num_queries: int, num_keys: int, device: torch.device) -> Tensor:
        """(Lq, Lk) long bucket index, cached."""
        return self._tables.get_or_make(
            ("bucket", num_queries, num_keys, device),
            lambda: t5_relative_bucket(
                self.relative_positions(num_queries, num_keys, device),
                self.bidirectional,
                self.num_buckets,
                self.max_distance,
            ),
        )

    def bias(self, q: Tensor, num_keys: int) -> Tensor:
        Lq = q.shape[-2]
        idx = self.buckets(Lq, num_keys, q.device).view(1, Lq * num_keys)
        # a gather per head row of rel_bias (H, buckets) gives a contiguous (H, Lq·Lk); its backward is one
        # scatter-add (indexing rel_bias[idx] gives (Lq, Lk, H), read strided, and a slower backward)
        table = self.rel_bias.t().to(q.dtype)  # (H, num_buckets)
        return torch.gather(table, 1, idx.expand(self.num_heads, -1)).view(1, self.num_heads, Lq, num_keys)

    def table_bias(self, q: Tensor, num_keys: int) -> tuple[Tensor, relative_kernel.Runs]:
        Lq = q.shape[-2]
        runs = self._tables.get_or_make(
            ("runs", Lq, num_keys), lambda: relative_kernel.Runs(self.buckets(Lq, num_keys, torch.device("cpu")))
        )
        return self.rel_bias.t().to(q.dtype), runs  # (H, num_buckets)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi head slopes (Press et al. 2022): the geometric sequence 2^(−8/n · h), h = 1..n, for n a power of two.

    Otherwise, the slopes of the closest lower power of two, then every other slope of the next power of two.
    """
    check_int("num_heads", num_heads, minimum=1)

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (h + 1) for h in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


@register_position_bias("alibi")
class AlibiBias(PositionBias):
    """Press et al. 2022 (ALiBi): the bias −m_h · |j − i| with fixed slopes m_h (:func:`alibi_slopes`).

    The paper's causal bias m_h · (j − i) for j ≤ i is extended symmetrically to the bidirectional encoder; under a
    causal mask the two agree.
    """

    static_bias = True

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__(d_k, num_heads)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)  # float64: exact slopes

    def bias(self, q: Tensor, num_keys: int) -> Tensor:
        Lq = q.shape[-2]

        def make() -> Tensor:
            distance = self.relative_positions(Lq, num_keys, q.device).abs().to(q.dtype)
            return (-self.slopes.to(q.dtype)[:, None, None] * distance).unsqueeze(0)  # (1, H, Lq, Lk)

        return self._tables.get_or_make(("alibi", Lq, num_keys, q.device, q.dtype), make)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


# --------------------------------------------------------------------------------------------- presets


class PresetScore(DotProductScore):
    """A dot product with a position bias built in: ``relative_position``, ``t5_bias`` and ``alibi``.

    The bias is the child module ``position_bias``; its attributes read through (``score.rel_k``,
    ``score.buckets(...)``, ``score.slopes``). A checkpoint made before the bias was its own module (parameters at
    the score's level) still loads.
    """

    def __init__(self, d_k: int, num_heads: int, d_v: int | None, scale: float, position_bias: PositionBias) -> None:
        super().__init__(d_k, num_heads, d_v, scale=scale)
        self.position_bias = position_bias
        self.has_value_term = position_bias.has_value_term
        self.static_bias = position_bias.static_bias
        self._register_load_state_dict_pre_hook(self._upgrade_state_dict)

    def position_term(self) -> PositionBias:
        return self.position_bias

    def bias(self, q: Tensor, num_keys: int) -> Tensor:
        return self.position_bias.bias(q, num_keys)

    def value_term(self, weights: Tensor) -> Tensor | None:
        return self.position_bias.value_term(weights)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            bias = self.__dict__.get("_modules", {}).get("position_bias")
            if bias is None:
                raise
            return getattr(bias, name)

    def _upgrade_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, _ in self.position_bias.named_parameters(recurse=False):
            old, new = prefix + name, f"{prefix}position_bias.{name}"
            if old in state_dict and new not in state_dict:
                state_dict[new] = state_dict.pop(old)

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_heads={self.num_heads}, scale={self.scale:.4g}"


@register_score("relative_position")
class RelativePositionScore(PresetScore):
    """Shaw et al. 2018: e_ij = q_i · (k_j + a^K_{ij}) / √d_k, with a^K_{ij} = w^K_{clip(j − i, k)}: scaled dot plus
    :class:`ShawBias` (``clip``, ``value_term``)."""

    def __init__(
        self, d_k: int, num_heads: int, d_v: int | None = None, clip: int = 16, value_term: bool = False
    ) -> None:
        super().__init__(d_k, num_heads, d_v, d_k**-0.5, ShawBias(d_k, num_heads, d_v, clip, value_term))


@register_score("t5_bias")
class T5BiasScore(PresetScore):
    """Raffel et al. 2020 (T5): logits = q · kᵀ (· 1/√d_k when ``scale``) + b_h[bucket(j − i)]: plus :class:`T5Bias`.

    T5 itself does not scale by √d_k (it folds the scale into W_q's initialisation), so ``scale`` defaults to False.
    """

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool | None = None,
        scale: bool = False,
    ) -> None:
        bias = T5Bias(d_k, num_heads, num_buckets, max_distance, bidirectional)
        super().__init__(d_k, num_heads, None, d_k**-0.5 if scale else 1.0, bias)


@register_score("alibi")
class AlibiScore(PresetScore):
    """Press et al. 2022 (ALiBi): logits = q · kᵀ / √d_k − m_h · |j − i|: scaled dot plus :class:`AlibiBias`."""

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__(d_k, num_heads, None, d_k**-0.5, AlibiBias(d_k, num_heads))


def resolve_direction(
    kind: str, name: str | nn.Module | None, params: Mapping[str, Any] | None, causal: bool
) -> dict[str, Any]:
    """``params`` with ``bidirectional`` set to ``not causal`` when the registered score or position bias ``name``
    (``kind``: ``"score"`` or ``"position bias"``) takes that parameter and it is unset or None: T5's buckets under
    a causal mask are T5's decoder buckets."""
    params = dict(params or {})
    registry = _SCORES if kind == "score" else _POSITION_BIASES
    if not isinstance(name, str) or name not in registry or params.get("bidirectional") is not None:
        return params
    if "bidirectional" in inspect.signature(registry.get(name)).parameters:
        params["bidirectional"] = not causal
    return params
