"""Multi-head attention with a pluggable score and mask, and a per-head key size d_k independent of d_model.

    q = x W_Q, k = x W_K, v = x W_V                       (B, H, L, d_k), (B, H, L, d_k), (B, H, L, d_v)
    e = score(q, k)                                       (B, H, Lq, Lk)
    α = safe_softmax(e masked)                            rows with no visible key → all zeros
    z = α v (+ score.value_term(α))                       (B, H, Lq, d_v)
    out = concat_h(z) W_O                                 (B, Lq, d_model)

When the weights are not requested and the score is in the dot-product family without a value term, the
computation dispatches to ``torch.nn.functional.scaled_dot_product_attention`` (the fast path), with the score's
position bias and the mask folded into one additive float mask (or passed as a bool mask when there is no bias).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.checks import check_int, check_prob
from attnlab.masks import Causal, Mask
from attnlab.scores import DotProductScore, Score, build_score

__all__ = ["AttentionOutput", "MultiHeadAttention", "PreparedMask", "prepare_mask"]


class AttentionOutput(NamedTuple):
    """out (B, Lq, d_model); weights α (B, H, Lq, Lk); logits e, the raw score outputs (B, H, Lq, Lk)."""

    out: Tensor
    weights: Tensor
    logits: Tensor


class PreparedMask(NamedTuple):
    """A bool mask ready for attention, all broadcastable to (B, H, Lq, Lk).

    ``allowed``: True = may attend. ``safe``: ``allowed`` with rows that see nothing opened up entirely (so the
    softmax never meets a row of −inf). ``visible``: (…, Lq, 1), False for those rows, whose output is then zeroed.
    """

    allowed: Tensor
    safe: Tensor
    visible: Tensor


class _StaticMask(PreparedMask):
    """A :class:`PreparedMask` of a position-only :class:`Mask`, built once per (Lq, Lk, device) and cached on the
    mask, with two facts found once at build time: ``causal`` (exactly j ≤ i with Lq = Lk: the fast path then
    passes ``is_causal=True`` to SDPA instead of a mask tensor) and ``all_visible`` (no row is fully hidden: the
    fast path skips zeroing the output of such rows)."""

    causal: bool = False
    all_visible: bool = False
    hidden: Tensor | None = None  # ~safe, built once


def _masked_bias(bias: Tensor, pm: PreparedMask, static_bias: bool) -> Tensor:
    """The additive float mask: ``bias`` (…, Lq, Lk) with the hidden positions at −inf. With a cached prepared
    mask and a score whose bias is a cached constant (``static_bias``, e.g. ALiBi), the result is cached on the
    mask too, so that no step allocates it again."""
    hidden = getattr(pm, "hidden", None)
    if hidden is None:
        return bias.masked_fill(~pm.safe, float("-inf"))
    if not static_bias or bias.requires_grad:
        return bias.masked_fill(hidden, float("-inf"))
    cache = pm.__dict__.setdefault("_masked_bias", {})
    entry = cache.get(id(bias))
    if entry is None or entry[0] is not bias:
        if len(cache) > 16:
            cache.clear()
        entry = cache[id(bias)] = (bias, bias.masked_fill(hidden, float("-inf")))
    return entry[1]


def _prepare_tensor(mask: Tensor) -> PreparedMask:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(
            f"mask must be a bool tensor (True = may attend), an attnlab Mask or None, got "
            f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}"
        )
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    visible = mask.any(dim=-1, keepdim=True)  # (…, Lq, 1)
    return PreparedMask(allowed=mask, safe=mask | ~visible, visible=visible)


def prepare_mask(
    mask: Tensor | Mask | PreparedMask | None, num_queries: int, num_keys: int, device: torch.device
) -> PreparedMask | None:
    """Turn a bool tensor (True = may attend) or a position-only :class:`Mask` into a :class:`PreparedMask`.

    A position-only Mask's PreparedMask is built once per (Lq, Lk, device) and cached on the mask (treat it as
    read-only)."""
    if mask is None or isinstance(mask, PreparedMask):
        return mask
    if isinstance(mask, Mask):
        if mask.is_trivial:
            return None
        if not mask.position_only:
            return _prepare_tensor(mask.dense(num_queries, num_keys, device))
        device = torch.device(device)
        cache = mask.__dict__.setdefault("_prepared_cache", {})
        key = (num_queries, num_keys, device)
        prepared = cache.get(key)
        if prepared is None:
            if len(cache) > 16:
                cache.clear()
            prepared = _StaticMask(*_prepare_tensor(mask.dense(num_queries, num_keys, device)))
            prepared.causal = type(mask) is Causal and num_queries == num_keys
            prepared.all_visible = bool(prepared.visible.all())  # one host sync per shape, at build time
            prepared.hidden = ~prepared.safe
            cache[key] = prepared
        return prepared
    return _prepare_tensor(mask)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, §3.2.2) with any registered score.

    Args:
        d_model: model width.
        num_heads: H.
        d_k: per-head query/key size, free of d_model and H: ``q_proj``/``k_proj`` map d_model → H·d_k.
        d_v: per-head value size (default d_k): ``v_proj`` maps d_model → H·d_v, ``out_proj`` H·d_v → d_model.
        score: a registered score name, or a built score module.
        bias: biases in the four projections.
        dropout: dropout on the attention weights (training only).
        **score_params: passed to the score (``clip=4`` for relative_position, ...).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_k: int,
        d_v: int | None = None,
        score: str | nn.Module = "scaled_dot",
        bias: bool = True,
        dropout: float = 0.0,
        **score_params: Any,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.d_k = check_int("d_k", d_k, minimum=1)
        self.d_v = self.d_k if d_v is None else check_int("d_v", d_v, minimum=1)
        self.dropout = check_prob("dropout", dropout, high_open=True)
        self.q_proj = nn.Linear(d_model, num_heads * self.d_k, bias=bias)
        self.k_proj = nn.Linear(d_model, num_heads * self.d_k, bias=bias)
        self.v_proj = nn.Linear(d_model, num_heads * self.d_v, bias=bias)
        self.out_proj = nn.Linear(num_heads * self.d_v, d_model, bias=bias)
        if isinstance(score, str):
            score = build_score(score, d_k=self.d_k, num_heads=num_heads, d_v=self.d_v, **score_params)
        elif score_params:
            raise ValueError("score_params are only used when score is given by name")
        self.score = score

    @property
    def uses_fast_path(self) -> bool:
        """Whether ``forward(need_weights=False)`` dispatches to SDPA."""
        return isinstance(self.score, DotProductScore) and not self.score.has_value_term

    def _project(self, x: Tensor, key_value: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        kv = x if key_value is None else key_value
        B, Lq, _ = x.shape
        Lk = kv.shape[1]
        H = self.num_heads
        q = self.q_proj(x).view(B, Lq, H, self.d_k).transpose(1, 2)  # (B, H, Lq, d_k)
        k = self.k_proj(kv).view(B, Lk, H, self.d_k).transpose(1, 2)  # (B, H, Lk, d_k)
        v = self.v_proj(kv).view(B, Lk, H, self.d_v).transpose(1, 2)  # (B, H, Lk, d_v)
        return q, k, v

    def _merge(self, z: Tensor) -> Tensor:
        B, _, Lq, _ = z.shape
        return self.out_proj(z.transpose(1, 2).reshape(B, Lq, self.num_heads * self.d_v))  # (B, Lq, d_model)

    def forward(
        self,
        x: Tensor,
        key_value: Tensor | None = None,
        mask: Tensor | Mask | PreparedMask | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, Lq, d_model), key_value (B, Lk, d_model) or None for self-attention, mask bool broadcastable to
        (B, H, Lq, Lk) with True = may attend (or a position-only Mask) → (out (B, Lq, d_model), weights
        (B, H, Lq, Lk) if ``need_weights`` else None)."""
        if need_weights or not self.uses_fast_path:
            o = self.attend(x, key_value, mask)
            return o.out, (o.weights if need_weights else None)
        q, k, v = self._project(x, key_value)
        pm = prepare_mask(mask, q.shape[2], k.shape[2], x.device)
        score: DotProductScore = self.score  # type: ignore[assignment]
        bias = score.bias(q, k.shape[2])
        causal = bias is None and getattr(pm, "causal", False)
        if bias is None:
            attn_mask = None if pm is None or causal else pm.safe
        else:
            attn_mask = bias if pm is None else _masked_bias(bias, pm, score.static_bias)
        z = F.scaled_dot_product_attention(
            score.query_map(q),
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=score.scale,
        )  # (B, H, Lq, d_v)
        if pm is not None and not getattr(pm, "all_visible", False):
            z = z * pm.visible  # rows with no visible key: zero output
        return self._merge(z), None

    def attend(
        self, x: Tensor, key_value: Tensor | None = None, mask: Tensor | Mask | PreparedMask | None = None
    ) -> AttentionOutput:
        """The eager path, returning the output with the weights and the pre-softmax logits."""
        q, k, v = self._project(x, key_value)
        pm = prepare_mask(mask, q.shape[2], k.shape[2], x.device)
        logits = self.score(q, k)  # (B, H, Lq, Lk)
        e = logits if pm is None else logits.masked_fill(~pm.safe, float("-inf"))
        low_precision = e.dtype in (torch.float16, torch.bfloat16)
        weights = torch.softmax(e.float() if low_precision else e, dim=-1).to(v.dtype)
        if pm is not None:
            weights = weights * pm.visible  # rows with no visible key: all zeros
        dropped = F.dropout(weights, self.dropout) if self.training and self.dropout > 0 else weights
        z = torch.matmul(dropped, v)  # (B, H, Lq, d_v)
        if isinstance(self.score, Score) and self.score.has_value_term:
            z = z + self.score.value_term(dropped)
        return AttentionOutput(self._merge(z), weights, logits)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}, d_v={self.d_v}"
