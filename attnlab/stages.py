"""The layer's own stages, below the forms: the short convolution, QK-norm, and what the layer computes itself.

:class:`~attnlab.attention.MultiHeadAttention` owns the projections, the short convolution (Zoology, Based, fla;
Canon-B with its residual), QK-norm and rotary positions on q and k, the output gate, the mask and the choice of
backend; everything between the projections and the merge is its form's (:mod:`attnlab.forms`). What each stage
computes is declared here (:data:`LAYER_STAGES`), as a form declares its own (:attr:`~attnlab.forms.Form.implements`):
a field of :class:`~attnlab.config.AttentionConfig` set away from its default that neither claims is refused when
the layer is built (:func:`~attnlab.forms.base.refuse_unimplemented`), whatever the backend. A form that projects
its own q, k and v (multi-head latent attention) has none of the projection stages (:data:`PROJECTION_FIELDS`):
it claims them itself or they are refused.

Also here: :func:`config_from_options`, the keyword form of the layer (``MultiHeadAttention(d_model, H, d_k,
normalizer="sigmoid", softcap=30, ...)``), which builds the one :class:`~attnlab.config.AttentionConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.config import AttentionConfig
from attnlab.kernels.conv import causal_conv

__all__ = [
    "LAYER_STAGES",
    "PROJECTION_FIELDS",
    "QK_NORMS",
    "ShortConvolution",
    "claims_of",
    "config_from_options",
    "layer_claims",
]

QK_NORMS: dict[str, type[nn.Module]] = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}
"""QK-norm (Dehghani et al. 2023): each head's q and k normalised over d_k before rope."""

LAYER_STAGES: Mapping[str, tuple[Any, ...] | None] = {
    "d_k": None,  # the projections' sizes: q_proj d_model → Hq·d_k, v_proj d_model → Gv·d_v
    "d_v": None,
    "num_kv_heads": None,  # G key/value heads (multi-query, grouped-query attention)
    "qk_norm": None,  # layernorm or rmsnorm (QK_NORMS: the config checks the name)
    "rope": None,  # rotary positions on q and k (attnlab.positions.RotaryEmbedding's parameters)
    "short_conv": None,
    "short_conv_residual": None,
    "output_gate": None,  # headwise or elementwise: z_h ← z_h ⊙ σ(x W_g) before out_proj, every form (Qiu et al.)
    "mask": None,  # applied by the layer on every call (the form checks its kind: Form.check_mask)
    "backend": None,  # how, not what
    "backend_params": None,
}
"""The :class:`~attnlab.config.AttentionConfig` fields the layer's own stages compute: field → the values they
compute (None: any value the field takes)."""

PROJECTION_FIELDS = frozenset({"num_kv_heads", "qk_norm", "rope", "short_conv", "short_conv_residual"})
"""The stages of the layer's own projection: a form that projects its own inputs
(:attr:`~attnlab.forms.Form.projects`) has none of them unless it claims them."""


def claims_of(form: Any) -> dict[str, tuple[Any, ...] | None]:
    """Every field a layer of the form class ``form`` computes: the form's own (:attr:`~attnlab.forms.Form.
    implements`) and the layer's stages' (:func:`layer_claims`), field → the values (None for any)."""
    return {**form.implements, **layer_claims(form.projects)}


def layer_claims(projects: bool) -> Mapping[str, tuple[Any, ...] | None]:
    """What the layer's stages compute (:data:`LAYER_STAGES`), for a form that projects its own inputs without
    the projection's stages."""
    if not projects:
        return LAYER_STAGES
    return {k: v for k, v in LAYER_STAGES.items() if k not in PROJECTION_FIELDS}


class ShortConvolution(nn.Module):
    """A depthwise causal convolution of width k over the sequence, one filter per channel, no bias (the short
    convolution that Zoology, Based and fla put on q, k and v): x (B, L, C) → y (B, L, C) with
    y_t = Σ_{m<k} w_m ⊙ x_{t−k+1+m} (``conv.weight`` (C, 1, k) is w; zeros before the start), so output t reads
    inputs t−k+1 … t only. ``residual``: y_t = x_t + Σ_m w_m ⊙ x_{t−k+1+m}, a Canon layer (Allen-Zhu 2025, "Physics
    of Language Models: Part 4.1", §3: kernel 4, residual, no activation, no bias)."""

    def __init__(self, channels: int, width: int, residual: bool = False) -> None:
        super().__init__()
        self.width = width
        self.residual = bool(residual)
        self.conv = nn.Conv1d(channels, channels, width, groups=channels, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, L, C) → (B, L, C) (L = 0 gives the empty sequence back)."""
        if x.shape[1] == 0:  # (conv1d refuses an input shorter than its kernel, which k − 1 zeros are at L = 0)
            return x
        return causal_conv(x, self.conv.weight[:, 0], self.residual)  # (B, L, C)

    def step(self, x: Tensor, buffer: Tensor | None) -> tuple[Tensor, Tensor]:
        """One new input x (B, 1, C), given the last k − 1 (B, k − 1, C) or None (the start) → (y (B, 1, C), the
        new buffer)."""
        if buffer is None:
            buffer = x.new_zeros(x.shape[0], self.width - 1, x.shape[-1])
        window = torch.cat([buffer, x], dim=1)  # (B, k, C)
        y = torch.einsum("bkc,ck->bc", window, self.conv.weight[:, 0]).unsqueeze(1)
        return (x + y if self.residual else y), window[:, 1:]

    def extra_repr(self) -> str:
        return "residual" if self.residual else ""


_OPTION_DEFAULTS: dict[str, Any] = {
    "num_kv_heads": None,
    "rope": None,
    "qk_norm": None,
    "softcap": None,
    "position_bias": None,
    "position_bias_params": None,
    "normalizer": "softmax",
    "normalizer_params": None,
    "differential": False,
    "selective": False,
    "short_conv": None,
    "short_conv_residual": False,
    "output_gate": None,
    "mask": None,
    "backend": "auto",
    "backend_params": None,
}


def config_from_options(
    score: str | nn.Module | None, d_v: int | None, options: dict[str, Any], built: dict[str, nn.Module]
) -> AttentionConfig:
    """The :class:`AttentionConfig` that :class:`MultiHeadAttention`'s keyword arguments describe (the keyword
    form, kept for users' scripts); built modules (a score, position bias, normalizer or rotary module) go to
    ``built`` and the config records their class name.

    The stage options:

    * ``num_kv_heads``: G key/value heads, a divisor of H (default H); ``k_proj`` maps d_model → G·d_k.
    * ``rope``: rotary positions on q and k: True, or a dict of :class:`~attnlab.positions.RotaryEmbedding`
      parameters (``base``, ``fraction``, ``spectrum``), or a built module; None (default) = off.
    * ``qk_norm``: ``layernorm`` or ``rmsnorm`` of each head's q and k over d_k (Dehghani et al. 2023), before rope.
    * ``softcap``: c > 0: logits ← c·tanh(logits / c) before the mask (Gemma 2 uses 50); None = off.
    * ``position_bias``: a registered position bias (``shaw``, ``t5``, ``alibi``) added to any score, or None
      (or a built module); ``position_bias_params`` its parameters.
    * ``normalizer``: a registered normalizer (default ``softmax``) or a built one, ``normalizer_params`` its
      parameters.
    * ``differential``: differential attention (Ye et al. 2024): two maps per head, w = w₁ − λ w₂, with
      λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, then a per-head RMSNorm of z and the factor (1 − λ_init);
      q_proj and k_proj then have 2·H·d_k and 2·G·d_k outputs.
    * ``selective``: selective attention (Leviathan et al. 2025): head 0's ReLU'd logits, summed over the later
      queries, subtracted from every head's logits (:func:`~attnlab.forms.softmax.selection_penalty`); causal.
    * ``short_conv``: k ≥ 1, a causal depthwise convolution of width k on q, k and v after their projections;
      ``short_conv_residual``: it adds its input back (Canon-B).
    * ``output_gate``: ``headwise`` or ``elementwise``: z_h ← z_h ⊙ σ(x W_g) before ``out_proj`` (Qiu et al. 2025).
    * ``backend``: ``auto`` or a registered backend (:mod:`attnlab.backends`), refused in one line where it cannot
      compute this configuration.

    A score or position bias that takes ``bidirectional`` (T5's buckets) and leaves it unset gets False when the
    config's mask hides every later key (causal, causal & window: T5's decoder bucketing) and True otherwise.
    """
    opts = {**_OPTION_DEFAULTS, **{k: v for k, v in options.items() if k in _OPTION_DEFAULTS}}
    score_params = {k: v for k, v in options.items() if k not in _OPTION_DEFAULTS}
    score = "scaled_dot" if score is None else score
    if isinstance(score, nn.Module):
        if score_params:
            raise ValueError("score_params are only used when score is given by name")
        built["score"] = score
        score = type(score).__name__
    for key in ("position_bias", "normalizer", "rope"):
        if isinstance(opts[key], nn.Module):
            built[key] = opts[key]
            opts[key] = type(opts[key]).__name__ if key != "rope" else {}
    return AttentionConfig(
        score=score,
        score_params=score_params,
        position_bias=opts["position_bias"],
        position_bias_params=opts["position_bias_params"] or {},
        rope=opts["rope"],
        qk_norm=opts["qk_norm"],
        softcap=opts["softcap"],
        normalizer=opts["normalizer"],
        normalizer_params=opts["normalizer_params"] or {},
        num_kv_heads=opts["num_kv_heads"],
        d_v=d_v,
        differential=opts["differential"],
        selective=opts["selective"],
        short_conv=opts["short_conv"],
        short_conv_residual=opts["short_conv_residual"],
        output_gate=opts["output_gate"],
        mask=opts["mask"],
        backend=opts["backend"],
        backend_params=opts["backend_params"] or {},
    )
