"""Scoring functions, the content term of the logits: q (B, H, Lq, d_k), k (B, H, Lk, d_k) → logits (B, H, Lq, Lk).

Every **score** (the content term of the logits) is an ``nn.Module`` registered by name
(``@register_score("name")``) and built with ``build_score(name, d_k=..., num_heads=..., **params)``. Plain
functions ``fn(q, k, **params) -> logits`` can be registered too; they are wrapped in a parameter-free module.

Position biases (Shaw, T5, ALiBi), which attention adds to any score, live in :mod:`attnlab.position_bias`; the
variants ``relative_position``, ``t5_bias`` and ``alibi`` are **presets**: names a score field may take that stand
for a score plus a position bias (:func:`register_preset`). Their registry lives here, beside the scores, so that
:func:`build_score` and :func:`list_scores` take them without importing :mod:`attnlab.config` (which sits above this
module, re-exports the preset verbs and expands a preset in :meth:`~attnlab.config.AttentionConfig.resolved`).

Two optional hooks extend the plain ``forward``:

* **Dot-product family** (:class:`DotProductScore`): logits = ``scale · φ(q) · ψ(k)ᵀ + bias``, where ``φ`` is
  :meth:`DotProductScore.query_map` (identity except Luong's *general* and *cosine*), ``ψ`` is
  :meth:`DotProductScore.key_map` (identity except *cosine*) and ``bias`` is :meth:`DotProductScore.bias`, an
  additive (…, H, Lq, Lk) term (none for the built-in scores). Such scores can run in
  ``torch.nn.functional.scaled_dot_product_attention`` with the bias as a float mask: the fast path.
* **Value-side term** (:meth:`Score.value_term`): a score or bias whose attention also contributes to the output
  (Shaw's a^V) sets ``has_value_term = True`` and returns (B, H, Lq, d_v), added to ``weights @ v``. Such scores
  take the eager path.

Positions are 0-based; for self-attention query i and key j are the same sequence positions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab.checks import check_choice, check_int, check_number
from attnlab.compat import forward
from attnlab.kernels import additive as fused_additive
from attnlab.position_bias import build_position_bias as _build_position_bias
from attnlab.registry import Registry, UnknownNameError, build_with_sizes, check_params, unknown_name_message

__all__ = [
    "AdditiveScore",
    "CosineScore",
    "DotProductScore",
    "DotScore",
    "GeneralScore",
    "LinearScore",
    "ScaledDotScore",
    "Score",
    "ScoreWithBias",
    "build_score",
    "is_preset",
    "list_presets",
    "list_scores",
    "register_preset",
    "register_score",
]

# the position biases lived here before 0.3 (attnlab.position_bias now): they read through attnlab.compat's table,
# each with a DeprecationWarning
__getattr__ = forward(__name__)


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

    def position_term(self) -> Any:
        """None, or ``self`` for a score that overrides :meth:`bias` (an opaque additive term)."""
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


def _wrap_score(name: str, obj: Any, kwargs: dict[str, Any]) -> nn.Module:
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return obj(**build_with_sizes("score", name, obj, kwargs))
    kwargs = dict(kwargs)
    for required in ("d_k", "num_heads"):
        if required not in kwargs:
            raise ValueError(f"build_score('{name}') needs {required}=")
    d_k, num_heads = kwargs.pop("d_k"), kwargs.pop("num_heads")
    kwargs.pop("d_v", None)
    kwargs.pop("d_model", None)
    check_params("score", name, obj, kwargs, ("q", "k"))
    return FunctionScore(name, obj, d_k, num_heads, **kwargs)


_SCORES: Registry[nn.Module] = Registry("score", _wrap_score)


def register_score(name: str) -> Callable[[Any], Any]:
    """Decorator registering a score class (``__init__(d_k, num_heads, [d_v], **params)``) or a function
    ``fn(q, k, **params) -> logits`` under ``name``."""
    return _SCORES.register(name)


def build_score(name: str, **kwargs: Any) -> nn.Module:
    """Build the score ``name``: ``build_score("additive", d_k=16, num_heads=4)``. A preset (``alibi``,
    ``t5_bias``, ``relative_position``: :mod:`attnlab.config`) builds a :class:`ScoreWithBias`, its score plus its
    position bias, as one logits module."""
    if not is_preset(name):
        if name not in _SCORES:  # the message names the presets too: build_score takes them
            raise UnknownNameError(unknown_name_message("score", name, list_scores()))
        return _SCORES.build(name, **kwargs)
    sizes = {k: kwargs.pop(k) for k in ("d_k", "num_heads", "d_v") if k in kwargs}
    kwargs.pop("d_model", None)  # (a preset's score and bias are built from the sizes alone)
    changes = _PRESETS.build(name, **kwargs)
    score = _SCORES.build(changes.get("score", "scaled_dot"), **sizes, **changes.get("score_params", {}))
    bias = _build_position_bias(changes.get("position_bias"), **sizes, **changes.get("position_bias_params", {}))
    return score if bias is None else ScoreWithBias(score, bias)


class ScoreWithBias(Score):
    """A score plus a position bias as one logits module (what :func:`build_score` gives for a preset):
    logits = score(q, k) + position_bias(q, Lk). ``score`` and ``position_bias`` are its two children.
    :class:`~attnlab.attention.MultiHeadAttention` builds the two as separate stages instead."""

    def __init__(self, score: nn.Module, position_bias: nn.Module) -> None:
        super().__init__(score.d_k, score.num_heads, getattr(position_bias, "d_v", None))
        self.score, self.position_bias = score, position_bias
        self.has_value_term = bool(getattr(position_bias, "has_value_term", False))

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return self.score(q, k) + self.position_bias(q, k.shape[-2])

    def value_term(self, weights: Tensor) -> Tensor | None:
        return self.position_bias.value_term(weights)


def list_scores() -> list[str]:
    """Names of the registered scores and presets (what ``variant=`` and ``MultiHeadAttention(score=)`` take)."""
    return sorted([*_SCORES.names(), *list_presets()])


# --------------------------------------------------------------------------------------------- presets


def _wrap_preset(name: str, fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    check_params("variant", name, fn, kwargs, ())
    changes = fn(**kwargs)
    if not isinstance(changes, Mapping) or not all(isinstance(key, str) for key in changes):
        raise ValueError(f"preset '{name}' must return a mapping of attention fields, got {changes!r}")
    return dict(changes)


_PRESETS: Registry[dict[str, Any]] = Registry("preset", _wrap_preset)


def register_preset(name: str) -> Callable[[Any], Any]:
    """Decorator registering a preset: a function of the preset's parameters returning the
    :class:`~attnlab.config.AttentionConfig` fields it stands for (``{"score": "scaled_dot", "position_bias":
    "alibi"}``). The name is then accepted wherever a score is (``variant=name``, ``MultiHeadAttention(score=name)``,
    :func:`build_score`). :func:`attnlab.config.build_preset` gives its changes, checked against the fields."""
    return _PRESETS.register(name)


def list_presets() -> list[str]:
    """Names of the registered presets."""
    return _PRESETS.names()


def is_preset(name: object) -> bool:
    """Whether ``name`` is a registered preset."""
    return name in _PRESETS


@register_preset("alibi")
def alibi() -> dict[str, Any]:
    """Press et al. 2022 (ALiBi): q·k/√d_k − m_h·|j − i|: ``scaled_dot`` + ``position_bias=alibi``."""
    return {"score": "scaled_dot", "position_bias": "alibi"}


@register_preset("t5_bias")
def t5_bias(
    num_buckets: int = 32, max_distance: int = 128, bidirectional: bool | None = None, scale: bool = False
) -> dict[str, Any]:
    """Raffel et al. 2020 (T5): q·k (unscaled: T5 folds the scale into W_q's initialisation; ``scale=True``
    divides by √d_k) + b_h[bucket(j − i)]: ``dot`` (or ``scaled_dot``) + ``position_bias=t5``."""
    if not isinstance(scale, bool):
        raise ValueError(f"scale must be true or false, got {scale!r}")
    params = {"num_buckets": num_buckets, "max_distance": max_distance, "bidirectional": bidirectional}
    return {"score": "scaled_dot" if scale else "dot", "position_bias": "t5", "position_bias_params": params}


@register_preset("relative_position")
def relative_position(clip: int = 16, value_term: bool = False) -> dict[str, Any]:
    """Shaw et al. 2018: q_i·(k_j + a^K_{ij})/√d_k with a^K_{ij} = w^K_{clip(j − i, k)} (and a^V with
    ``value_term``): ``scaled_dot`` + ``position_bias=shaw``."""
    return {
        "score": "scaled_dot",
        "position_bias": "shaw",
        "position_bias_params": {"clip": clip, "value_term": value_term},
    }


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


# --------------------------------------------------------------------------------------------- linear


@register_score("linear")
class LinearScore(Score):
    """Linear attention (Katharopoulos et al. 2020): logits = φ(q) · φ(k)ᵀ with a feature map φ
    (:mod:`attnlab.feature_maps`: ``elu`` by default, ``taylor``, ``performer``, ...), (B, H, Lq, Lk), ≥ 0 for the
    built-in maps. Paired with the ``rowsum`` normalizer (weights = logits / their row sum; ``variant=linear``
    selects both) it is linear attention, which the ``chunked``, ``recurrent`` and ``global`` backends compute in
    O(L) from the features (:meth:`features`), never forming the (Lq, Lk) logits.

    Args:
        feature_map: a registered feature map.
        **params: the feature map's parameters (``feature_dim`` for taylor, ``num_features`` for performer ...).
    """

    def __init__(self, d_k: int, num_heads: int, feature_map: str = "elu", **params: Any) -> None:
        super().__init__(d_k, num_heads)
        from attnlab.feature_maps import build_feature_map

        self.feature_map_name = feature_map
        self.feature_map = build_feature_map(feature_map, d_k, num_heads, **params)

    @property
    def feature_dim(self) -> int:
        """d_φ, the size of the features."""
        return self.feature_map.feature_dim

    def features(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, H, Lq, d_k), k (B, H, Lk, d_k) → φ(q) (B, H, Lq, d_φ), φ(k) (B, H, Lk, d_φ). A training call
        first lets the map take its step (Performer's redraws)."""
        if self.training:
            self.feature_map.step()
        if self.feature_map.positional:
            length = max(q.shape[-2], k.shape[-2])
            return self.feature_map(q, length), self.feature_map(k, length)
        return self.feature_map(q), self.feature_map(k)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        phi_q, phi_k = self.features(q, k)
        return torch.matmul(phi_q, phi_k.transpose(-2, -1))  # (B, H, Lq, Lk)

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_heads={self.num_heads}, feature_map={self.feature_map_name}"
