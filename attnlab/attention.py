"""Multi-head attention as a pipeline of named stages, each a registered or configured piece:

    x → projections          q = x W_Q, k = x W_K, v = x W_V      (B, Hq, Lq, d_k), (B, Gk, Lk, d_k), (B, G, Lk, d_v)
      → transform_qk         QK-norm (LayerNorm | RMSNorm per head), then rotary positions
      → logits               e = score(q, k) + position_bias(q)    (B, Hq, Lq, Lk)
                             e = c·tanh(e / c)                     (soft-capping, when ``softcap=c``)
      → normalize            w = normalizer(e, mask)               masked keys 0, a row that sees no key all 0
      → combine_maps         w = w₁ − λ·w₂                         (differential attention only)  (B, H, Lq, Lk)
      → mix_values           z = w v (+ value terms)               (B, H, Lq, d_v)
      → merge                out = concat_h(z) W_O                 (B, Lq, d_model)

H query heads and G key/value heads (``num_kv_heads``: G = H is multi-head, G = 1 multi-query (Shazeer 2019), a
divisor of H grouped-query attention (Ainslie et al. 2023)); query head h reads key/value head h // (H / G).
Differential attention (Ye et al. 2024) computes two maps per head: Hq = 2H query and Gk = 2G key heads, laid out
component-major (index c·H + h for component c of head h).

The fast path: when the weights are not requested and every stage is one that
``torch.nn.functional.scaled_dot_product_attention`` computes exactly (a dot-product score without value term, a
position bias without value term, the softmax, no soft-capping), q and k go through their transforms and then to
SDPA, with the position bias and the mask folded into one additive float mask (or ``is_causal=True``, or a bool
mask when there is no bias), and grouped heads through ``enable_gqa``. Differential attention runs both maps in
one SDPA call: (w₁ − λ w₂) v = w₁ v − λ w₂ v.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab.checks import check_choice, check_int, check_number, check_prob
from attnlab.kernels import relative as relative_kernel
from attnlab.masks import Mask, PreparedMask, prepare_mask
from attnlab.normalizers import build_normalizer
from attnlab.positions import RotaryEmbedding
from attnlab.scores import DotProductScore, build_position_bias, build_score

__all__ = ["QK_NORMS", "AttentionOutput", "MultiHeadAttention", "PreparedMask", "prepare_mask"]

QK_NORMS: dict[str, type[nn.Module]] = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


class AttentionOutput(NamedTuple):
    """out (B, Lq, d_model); weights w (B, H, Lq, Lk), signed for differential attention; logits e (B, Hq, Lq, Lk),
    what the normalizer sees (score + position bias, soft-capped); Hq = 2H for differential attention."""

    out: Tensor
    weights: Tensor
    logits: Tensor


def lambda_init(layer: int) -> float:
    """Differential attention's λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) for layer l = 1, 2, … (Ye et al. 2024)."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, §3.2.2) with every stage pluggable.

    Args:
        d_model: model width.
        num_heads: H.
        d_k: per-head query/key size, free of d_model and H: ``q_proj`` maps d_model → H·d_k.
        d_v: per-head value size (default d_k): ``v_proj`` maps d_model → G·d_v, ``out_proj`` H·d_v → d_model.
        score: a registered score name, or a built score module.
        bias: biases in the four projections.
        dropout: dropout on the attention weights (training only).
        num_kv_heads: G key/value heads, a divisor of H (default H); ``k_proj`` maps d_model → G·d_k.
        rope: rotary positions on q and k: True, or a dict of :class:`~attnlab.positions.RotaryEmbedding`
            parameters (``base``, ``fraction``), or a built module; None (default) = off.
        qk_norm: ``layernorm`` or ``rmsnorm`` of each head's q and k over d_k (Dehghani et al. 2023), before rope.
        softcap: c > 0: logits ← c·tanh(logits / c) before the mask (Gemma 2 uses 50); None = off.
        position_bias: a registered position bias (``shaw``, ``t5``, ``alibi``) added to any score, or None/``none``;
            ``position_bias_params`` its parameters.
        normalizer: a registered normalizer (default ``softmax``), ``normalizer_params`` its parameters.
        differential: differential attention (Ye et al. 2024): two maps per head, w = w₁ − λ w₂, with
            λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, then a per-head RMSNorm of z and the factor (1 − λ_init).
            q_proj and k_proj then have 2·H·d_k and 2·G·d_k outputs.
        layer: this layer's depth l = 1, 2, … (differential attention's λ_init).
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
        *,
        num_kv_heads: int | None = None,
        rope: bool | Mapping[str, Any] | nn.Module | None = None,
        qk_norm: str | None = None,
        softcap: float | None = None,
        position_bias: str | nn.Module | None = None,
        position_bias_params: Mapping[str, Any] | None = None,
        normalizer: str | nn.Module = "softmax",
        normalizer_params: Mapping[str, Any] | None = None,
        differential: bool = False,
        layer: int = 1,
        **score_params: Any,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model, minimum=1)
        self.num_heads = H = check_int("num_heads", num_heads, minimum=1)
        self.d_k = check_int("d_k", d_k, minimum=1)
        self.d_v = self.d_k if d_v is None else check_int("d_v", d_v, minimum=1)
        self.dropout = check_prob("dropout", dropout, high_open=True)
        self.num_kv_heads = G = H if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, minimum=1)
        if H % G:
            raise ValueError(f"num_kv_heads ({G}) must divide num_heads ({H}): 1 (multi-query), a divisor, or {H}")
        self.differential = bool(differential)
        maps = 2 if self.differential else 1
        self.query_heads, self.key_heads = maps * H, maps * G  # Hq, Gk

        # projections
        self.q_proj = nn.Linear(d_model, self.query_heads * self.d_k, bias=bias)
        self.k_proj = nn.Linear(d_model, self.key_heads * self.d_k, bias=bias)
        self.v_proj = nn.Linear(d_model, G * self.d_v, bias=bias)
        self.out_proj = nn.Linear(H * self.d_v, d_model, bias=bias)

        # score and position bias, over the Hq query heads
        if isinstance(score, str):
            score = build_score(score, d_k=self.d_k, num_heads=self.query_heads, d_v=self.d_v, **score_params)
        elif score_params:
            raise ValueError("score_params are only used when score is given by name")
        self.score = score
        if isinstance(position_bias, str) or position_bias is None:
            position_bias = build_position_bias(
                position_bias, d_k=self.d_k, num_heads=self.query_heads, d_v=self.d_v, **(position_bias_params or {})
            )
        self.position_bias = position_bias

        # q/k transforms
        self.qk_norm = None if qk_norm is None else check_choice("qk_norm", qk_norm, [*QK_NORMS, None])
        self.q_norm = QK_NORMS[qk_norm](self.d_k) if qk_norm is not None else None
        self.k_norm = QK_NORMS[qk_norm](self.d_k) if qk_norm is not None else None
        if rope is True:
            rope = RotaryEmbedding(self.d_k)
        elif isinstance(rope, Mapping):
            rope = RotaryEmbedding(self.d_k, **rope)
        self.rope = rope or None

        # logit transform and normalizer
        self.softcap = None if softcap is None else check_number("softcap", softcap, low=0.0, low_open=True)
        self.normalizer = build_normalizer(normalizer, num_heads=self.query_heads, **(normalizer_params or {}))

        # differential attention's λ and per-head norm
        self.layer = check_int("layer", layer, minimum=1)
        if self.differential:
            self.lambda_init = lambda_init(self.layer)
            self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
                nn.Parameter(torch.randn(self.d_k) * 0.1) for _ in range(4)
            )
            self.sub_norm = nn.RMSNorm(self.d_v, eps=1e-5)

    # ------------------------------------------------------------------------------------------ stages

    def project(self, x: Tensor, key_value: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, Lq, d_model), key_value (B, Lk, d_model) or None → q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k),
        v (B, G, Lk, d_v), with q and k transformed (:meth:`transform_qk`)."""
        kv = x if key_value is None else key_value
        B, Lq, _ = x.shape
        Lk = kv.shape[1]
        q = self.q_proj(x).view(B, Lq, self.query_heads, self.d_k).transpose(1, 2)  # (B, Hq, Lq, d_k)
        k = self.k_proj(kv).view(B, Lk, self.key_heads, self.d_k).transpose(1, 2)  # (B, Gk, Lk, d_k)
        v = self.v_proj(kv).view(B, Lk, self.num_kv_heads, self.d_v).transpose(1, 2)  # (B, G, Lk, d_v)
        return (*self.transform_qk(q, k), v)

    def transform_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm, then rotary positions (query i at position i, key j at position j)."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        return q, k

    def mask_for_heads(
        self, mask: Tensor | Mask | PreparedMask | None, num_queries: int, num_keys: int, device: torch.device
    ) -> PreparedMask | None:
        """The mask, prepared (:func:`attnlab.masks.prepare_mask`) for the Hq query heads: under differential
        attention a per-head mask (…, H, Lq, Lk) applies to both maps of each head."""
        pm = prepare_mask(mask, num_queries, num_keys, device)
        if pm is None or not self.differential or pm.allowed.shape[1] == 1:
            return pm
        return PreparedMask.from_tensor(pm.allowed.repeat(1, 2, 1, 1))  # component-major, like q

    def expand_heads(self, t: Tensor, heads: int) -> Tensor:
        """(B, G', L, d) → (B, heads, L, d): each key/value head repeated for the query heads of its group."""
        return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)

    def logits(self, q: Tensor, k: Tensor) -> Tensor:
        """q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k) → e (B, Hq, Lq, Lk): score + position bias, soft-capped."""
        e = self.score(q, self.expand_heads(k, self.query_heads))
        if self.position_bias is not None:
            e = e + self.position_bias(q, k.shape[2])
        if self.softcap is not None:
            e = self.softcap * torch.tanh(e / self.softcap)
        return e

    def normalize(self, logits: Tensor, mask: PreparedMask | None, dtype: torch.dtype) -> Tensor:
        """logits (B, Hq, Lq, Lk) → weights in ``dtype``; half-precision logits are normalized in float32."""
        low_precision = logits.dtype in (torch.float16, torch.bfloat16)
        weights = self.normalizer(logits.float() if low_precision else logits, None if mask is None else mask.allowed)
        return weights.to(dtype)

    def differential_lambda(self) -> Tensor:
        """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, a scalar."""
        return (
            torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
            - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
            + self.lambda_init
        )

    def combine_maps(self, t: Tensor) -> Tensor:
        """Differential attention: (B, 2H, …) component-major → t₁ − λ·t₂, (B, H, …). Identity otherwise."""
        if not self.differential:
            return t
        pair = t.unflatten(1, (2, self.num_heads))  # (B, 2, H, …)
        return pair[:, 0] - self.differential_lambda().to(t.dtype) * pair[:, 1]

    def mix_values(self, weights: Tensor, v: Tensor) -> Tensor:
        """weights (B, H, Lq, Lk) (after dropout), v (B, G, Lk, d_v) → z (B, H, Lq, d_v), plus value-side terms."""
        z = torch.matmul(weights, self.expand_heads(v, self.num_heads))  # (B, H, Lq, d_v)
        for part in (self.score, self.position_bias):
            if part is not None and getattr(part, "has_value_term", False):
                z = z + part.value_term(weights)
        return z

    def merge(self, z: Tensor) -> Tensor:
        """z (B, H, Lq, d_v) → (B, Lq, d_model); differential attention first norms each head and scales it by
        (1 − λ_init)."""
        if self.differential:
            z = self.sub_norm(z) * (1 - self.lambda_init)
        B, _, Lq, _ = z.shape
        return self.out_proj(z.transpose(1, 2).reshape(B, Lq, self.num_heads * self.d_v))  # (B, Lq, d_model)

    # ------------------------------------------------------------------------------------------ forward

    @property
    def uses_fast_path(self) -> bool:
        """Whether ``forward(need_weights=False)`` dispatches to SDPA."""
        return (
            isinstance(self.score, DotProductScore)
            and not self.score.has_value_term
            and (self.position_bias is None or not self.position_bias.has_value_term)
            and (getattr(self.normalizer, "is_softmax", False) or self._extra_logit() is not None)
            and self.softcap is None
        )

    def forward(
        self,
        x: Tensor,
        key_value: Tensor | None = None,
        mask: Tensor | Mask | PreparedMask | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, Lq, d_model), key_value (B, Lk, d_model) or None for self-attention, mask bool broadcastable to
        (B, H, Lq, Lk) with True = may attend (or a Mask, or a PreparedMask) → (out (B, Lq, d_model), weights
        (B, H, Lq, Lk) if ``need_weights`` else None)."""
        if need_weights or not self.uses_fast_path:
            o = self.attend(x, key_value, mask)
            return o.out, (o.weights if need_weights else None)
        q, k, v = self.project(x, key_value)
        pm = self.mask_for_heads(mask, q.shape[2], k.shape[2], x.device)
        z = self.combine_maps(self._sdpa(q, k, v, pm))  # (B, H, Lq, d_v)
        return self.merge(z), None

    def attend(
        self, x: Tensor, key_value: Tensor | None = None, mask: Tensor | Mask | PreparedMask | None = None
    ) -> AttentionOutput:
        """The eager path, every stage in turn, returning the output with the weights and the logits."""
        q, k, v = self.project(x, key_value)
        pm = self.mask_for_heads(mask, q.shape[2], k.shape[2], x.device)
        logits = self.logits(q, k)  # (B, Hq, Lq, Lk)
        weights = self.combine_maps(self.normalize(logits, pm, v.dtype))  # (B, H, Lq, Lk)
        dropped = F.dropout(weights, self.dropout) if self.training and self.dropout > 0 else weights
        z = self.mix_values(dropped, v)  # (B, H, Lq, d_v)
        return AttentionOutput(self.merge(z), weights, logits)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, pm: PreparedMask | None) -> Tensor:
        """The fast path: q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k), v (B, G, Lk, d_v) → z (B, Hq, Lq, d_v)."""
        score: DotProductScore = self.score  # type: ignore[assignment]
        if self.differential:
            v = v.repeat(1, 2, 1, 1)  # (B, 2G, Lk, d_v): both maps of a head read the same values
        z = self._relative_kernel(score, q, k, v, pm)
        if z is None:
            z = self._sdpa_call(score, q, k, v, pm)
        if pm is not None and not pm.all_visible:
            z = z * pm.visible  # rows with no visible key: zero output
        return z

    def _sdpa_call(self, score: DotProductScore, q: Tensor, k: Tensor, v: Tensor, pm: PreparedMask | None) -> Tensor:
        """The position terms and the mask folded into one SDPA call (a sink as one more key)."""
        bias, static = self._position_logits(score, q, k.shape[2])
        causal = bias is None and pm is not None and pm.is_causal
        if bias is None:
            attn_mask = None if pm is None or causal else pm.safe
        else:
            attn_mask = bias if pm is None else _masked_bias(bias, pm, static)
        q, k = score.query_map(q), score.key_map(k)
        extra = self._extra_logit()
        if extra is not None:  # softmax1, sink: one more key whose logit is the sink and whose value is 0
            if causal:
                attn_mask, causal = pm.safe, False
            q, k, v, attn_mask = _with_sink_key(q, k, v, attn_mask, extra / score.scale)
        z = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=score.scale,
            enable_gqa=self.key_heads != self.query_heads,
        )
        return z[..., : self.d_v]  # (B, Hq, Lq, d_v); the sink key's padding cut off

    def _relative_kernel(
        self, score: DotProductScore, q: Tensor, k: Tensor, v: Tensor, pm: PreparedMask | None
    ) -> Tensor | None:
        """The fused kernel :func:`attnlab.kernels.relative.relative_attention`, when the one additive logit term
        is a learned relative-position table (Shaw, T5: :meth:`~attnlab.scores.PositionBias.table_bias`) and
        gradients are on, on the CPU in float32/64, without dropout or a sink → z (B, Hq, Lq, d_v); else None
        (also where the kernel cannot be built: then SDPA or :class:`BiasedSoftmaxAttention` runs)."""
        terms = [b for b in (score.position_term(), self.position_bias) if b is not None]
        if len(terms) != 1:  # most models have no position term: they leave here, before any other check
            return None
        if not torch.is_grad_enabled() or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
            return None
        if (self.training and self.dropout > 0) or self._extra_logit() is not None:
            return None
        if not relative_kernel.available():
            return None
        table_bias = getattr(terms[0], "table_bias", None)
        found = None if table_bias is None else table_bias(q, k.shape[2])
        if found is None:
            return None
        table, runs = found
        heads = q.shape[1]
        k, v = self.expand_heads(k, heads), self.expand_heads(v, heads)
        q, k = score.query_map(q), score.key_map(k)
        return relative_kernel.relative_attention(q, k, v, table, runs, None if pm is None else pm.hidden, score.scale)

    def _extra_logit(self) -> Tensor | None:
        """The normalizer's sink logit (softmax1, sink), or None."""
        extra = getattr(self.normalizer, "extra_logit", None)
        return extra() if extra is not None else None

    def _position_logits(self, score: DotProductScore, q: Tensor, num_keys: int) -> tuple[Tensor | None, bool]:
        """The additive logit terms beside q·k (the score's own bias and the position-bias stage), summed, and
        whether the result is a static (cacheable) tensor."""
        parts = [(score.bias(q, num_keys), score.static_bias)]
        if self.position_bias is not None:
            parts.append((self.position_bias(q, num_keys), self.position_bias.static_bias))
        parts = [(b, s) for b, s in parts if b is not None]
        if not parts:
            return None, False
        if len(parts) == 1:
            return parts[0]
        return parts[0][0] + parts[1][0], False

    def extra_repr(self) -> str:
        extra = [f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}, d_v={self.d_v}"]
        if self.num_kv_heads != self.num_heads:
            extra.append(f"num_kv_heads={self.num_kv_heads}")
        if self.qk_norm:
            extra.append(f"qk_norm={self.qk_norm}")
        if self.softcap is not None:
            extra.append(f"softcap={self.softcap:g}")
        if self.differential:
            extra.append(f"differential, layer={self.layer}, lambda_init={self.lambda_init:.3f}")
        return ", ".join(extra)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, the fast path's one call, except for a float mask that
    needs its gradient (a learned position bias) on the CPU without dropout: SDPA can only use its math kernel for
    that, which keeps more for the backward pass than it needs and scans every row for −inf, so
    :class:`BiasedSoftmaxAttention` computes it instead (the same values, fewer passes over (B, H, Lq, Lk)). On
    CUDA, SDPA's memory-efficient kernel computes a bias gradient itself.
    q (B, Hq, Lq, d), k (B, Gk, Lk, d), v (B, G, Lk, d_v) → (B, Hq, Lq, d_v)."""
    learned_bias = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
    if learned_bias and q.device.type == "cpu" and dropout_p == 0.0 and not is_causal:
        heads = q.shape[1]
        if enable_gqa:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        s = q.shape[-1] ** -0.5 if scale is None else scale
        return BiasedSoftmaxAttention.apply(q, k, v, attn_mask, s)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


class BiasedSoftmaxAttention(torch.autograd.Function):
    """z = softmax(scale · q kᵀ + bias) v for a bias that needs its gradient (a learned position bias).

    q (B, H, Lq, d), k (B, H, Lk, d), v (B, H, Lk, d_v), bias broadcastable to (B, H, Lq, Lk) (hidden keys at −inf;
    no row entirely hidden) → z (B, H, Lq, d_v). Equal to SDPA's math kernel, with less memory traffic: the logits
    are built in place, and the backward pass keeps only the weights P and the output, using
    dS = P ⊙ (dP − rowsum(dO ⊙ z)) (dP = dO vᵀ) for the logits' gradient, which is the bias's gradient (summed
    over the dimensions the bias broadcasts along).
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
        logits = torch.matmul(q * scale, k.transpose(-1, -2)).add_(bias)  # (B, H, Lq, Lk)
        weights = torch.softmax(logits, dim=-1)
        del logits
        z = torch.matmul(weights, v)
        ctx.save_for_backward(q, k, v, weights, z)
        ctx.scale, ctx.bias_shape = scale, bias.shape
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, weights, z = ctx.saved_tensors
        dv = torch.matmul(weights.transpose(-1, -2), dz)
        d_logits = torch.matmul(dz, v.transpose(-1, -2))  # dP, then in place dS
        d_logits.sub_((dz * z).sum(-1, keepdim=True)).mul_(weights)
        dq = torch.matmul(d_logits, k).mul_(ctx.scale)
        dk = torch.matmul(d_logits.transpose(-1, -2), q).mul_(ctx.scale)
        shape = ctx.bias_shape
        lead = d_logits.dim() - len(shape)
        dims = [d for d in range(d_logits.dim()) if d < lead or (shape[d - lead] == 1 and d_logits.shape[d] != 1)]
        d_bias = d_logits.sum(dims, keepdim=True).view(shape) if dims else d_logits
        return dq, dk, dv, d_bias, None


def _with_sink_key(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, sink: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """SDPA inputs for a softmax with a sink logit b_h, exactly: q gains a last dimension b_h / scale, every key a
    0 there, and one more key (0, …, 0, 1) with value 0 is appended, so its logit is b_h and its weight is dropped
    from the output. ``sink`` (Hq,) or a scalar, already divided by the score's scale; the mask gets a visible
    column (a row that sees no key then gives 0 / e^b = 0, as the eager path). q, k and v are zero-padded to one
    size (the output's extra columns are cut off by the caller)."""
    B, Hq, Lq, _ = q.shape
    Gk = k.shape[1]
    column = sink.to(q.dtype).expand(Hq).view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
    q = torch.cat((q, column), dim=-1)  # (B, Hq, Lq, d_k + 1)
    k = F.pad(k, (0, 1))  # (B, Gk, Lk, d_k + 1), 0 in the last dimension
    sink_key = torch.zeros(B, Gk, 1, k.shape[-1], dtype=k.dtype, device=k.device)
    sink_key[..., -1] = 1.0
    k = torch.cat((k, sink_key), dim=2)  # (B, Gk, Lk + 1, d_k + 1)
    v = F.pad(v, (0, 0, 0, 1))  # (B, G, Lk + 1, d_v), value 0 for the sink
    size = max(q.shape[-1], v.shape[-1])  # equal q/k and v sizes let SDPA use its fused kernel: pad with zeros
    q, k, v = (F.pad(t, (0, size - t.shape[-1])) for t in (q, k, v))
    if attn_mask is not None:
        attn_mask = F.pad(attn_mask, (0, 1), value=True if attn_mask.dtype == torch.bool else 0.0)
    return q, k, v, attn_mask


def _masked_bias(bias: Tensor, pm: PreparedMask, static: bool) -> Tensor:
    """The additive float mask: ``bias`` (…, Lq, Lk) with the hidden positions at −inf. A static bias (a cached
    constant, e.g. ALiBi) is combined with a cached mask once and the result cached with the mask."""
    if not static or bias.requires_grad:
        return bias.masked_fill(pm.hidden, float("-inf"))
    key = ("masked_bias", id(bias))
    entry = pm.derived.get(key)
    if entry is None or entry[0] is not bias:  # a new tensor that reuses a freed one's id
        pm.derived.pop(key, None)
        entry = pm.derived.get_or_make(key, lambda: (bias, bias.masked_fill(pm.hidden, float("-inf"))))
    return entry[1]
