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

What this layer computes is one :class:`~attnlab.config.AttentionConfig`; what computes it is a backend
(:mod:`attnlab.backends`): ``eager`` runs the stages below in turn, ``sdpa``, ``biased_softmax`` and ``relative``
compute the same numbers in one fused call where the configuration allows, chosen per call by
:func:`~attnlab.backends.choose_backend` (or forced with ``backend=``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab.backends import Backend, Conditions, build_backend, check_backend_params, choose_backend
from attnlab.checks import check_int, check_prob, default_d_k
from attnlab.config import AttentionConfig
from attnlab.masks import Mask, PreparedMask, build_mask, hides_later_keys, mask_form, prepare_mask
from attnlab.normalizers import build_normalizer
from attnlab.position_bias import build_position_bias, resolve_direction
from attnlab.positions import RotaryEmbedding
from attnlab.recurrences import RecurrentScore, effective_matrix
from attnlab.scores import DotProductScore, build_score

__all__ = [
    "QK_NORMS",
    "AttentionOutput",
    "DifferentialHeads",
    "MultiHeadAttention",
    "PreparedMask",
    "ShortConvolution",
    "prepare_mask",
]

QK_NORMS: dict[str, type[nn.Module]] = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


class ShortConvolution(nn.Module):
    """A depthwise causal convolution of width k over the sequence, one filter per channel, no bias (the short
    convolution that Zoology, Based and fla put on q, k and v): x (B, L, C) → y (B, L, C) with
    y_t = Σ_{m<k} w_m ⊙ x_{t−k+1+m} (``conv.weight`` (C, 1, k) is w; zeros before the start), so output t reads
    inputs t−k+1 … t only."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.conv = nn.Conv1d(channels, channels, width, groups=channels, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, L, C) → (B, L, C)."""
        y = self.conv(F.pad(x.transpose(1, 2), (self.width - 1, 0)))  # left padding only: causal
        return y.transpose(1, 2)


class DifferentialHeads(torch.autograd.Function):
    """Differential attention's heads from its two maps' outputs, in one step with a written-out backward:
    z₁, z₂ (B, H, Lq, d_v), λ (a 0-d tensor), the sub-norm's weight g (d_v,), its eps, and the scale s = 1 − λ_init
    → y = s · g ⊙ u / rms(u), u = z₁ − λ z₂, rms(u) = √(mean(u²) + eps) over d_v (``nn.RMSNorm``).

    Autograd through ``combine_maps`` and ``nn.RMSNorm`` (whose CPU form is composite: pow, mean, rsqrt, two
    products) writes about 15 (B, H, Lq, d_v) tensors forward and backward; this writes about 8, keeping u and
    1/rms(u) (B, H, Lq, 1) for the backward pass:
    ∂u = r (ĝ − u r² mean(ĝ ⊙ u)), ĝ = s g ⊙ ∂y, r = 1/rms(u); ∂z₁ = ∂u, ∂z₂ = −λ ∂u, ∂λ = −Σ ∂u ⊙ z₂,
    ∂g = s Σ ∂y ⊙ u r."""

    @staticmethod
    def forward(
        ctx: Any, z1: Tensor, z2: Tensor, lam: Tensor, weight: Tensor, eps: float | None, scale: float
    ) -> Tensor:
        u = torch.addcmul(z1, z2, lam, value=-1.0)  # z₁ − λ z₂
        eps = torch.finfo(u.dtype).eps if eps is None else eps
        r = torch.linalg.vector_norm(u, dim=-1, keepdim=True).square_().div_(u.shape[-1]).add_(eps).rsqrt_()
        gain = weight.to(u.dtype) * scale  # (d_v,)
        ctx.save_for_backward(z2, lam, weight, u, r)
        ctx.scale = scale
        return (u * r).mul_(gain)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        z2, lam, weight, u, r = ctx.saved_tensors
        scale = ctx.scale
        d = u.shape[-1]
        dweight = None
        if ctx.needs_input_grad[3]:
            dims = tuple(range(dy.dim() - 1))
            dweight = (dy * u).mul_(r).sum(dims).mul_(scale).to(weight.dtype)
        g_hat = dy * (weight.to(dy.dtype) * scale)  # ĝ
        dot = (g_hat * u).sum(-1, keepdim=True)  # Σ ĝ ⊙ u, (B, H, Lq, 1)
        du = torch.addcmul(g_hat.mul_(r), u, r.pow(3).mul_(dot).div_(d), value=-1.0)
        dlam = -(du * z2).sum() if ctx.needs_input_grad[2] else None
        dz2 = du * (-lam) if ctx.needs_input_grad[1] else None
        return du, dz2, dlam, dweight, None, None


class AttentionOutput(NamedTuple):
    """out (B, Lq, d_model); weights w (B, H, Lq, Lk), signed for differential attention; logits e (B, Hq, Lq, Lk),
    what the normalizer sees (score + position bias, soft-capped); Hq = 2H for differential attention."""

    out: Tensor
    weights: Tensor
    logits: Tensor


def lambda_init(layer: int) -> float:
    """Differential attention's λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) for layer l = 1, 2, … (Ye et al. 2024)."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


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
    "short_conv": None,
    "mask": None,
    "backend": "auto",
    "backend_params": None,
}


def renamed_state_key(key: str, ours: Mapping[str, Any] | Any) -> str:
    """A checkpoint's state-dict key as this version names it (``ours``: this model's keys). The preset variants'
    bias parameters lived in the score (0.1: ``…score.rel_k``; 0.2: ``…score.position_bias.rel_k``); since 0.3
    they are the layer's position-bias stage (``…position_bias.rel_k``)."""
    if key in ours or ".score." not in f".{key}":
        return key
    head, _, rest = f".{key}".rpartition(".score.")
    moved = f"{head}.position_bias.{rest.removeprefix('position_bias.')}".lstrip(".")
    return moved if moved in ours else key


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, §3.2.2) with every stage pluggable.

    What the layer computes is one :class:`~attnlab.config.AttentionConfig` (``config=``), or, as before, the
    keyword arguments below, which build one. Either way ``self.config`` is the resolved config (a preset expanded
    into its score and bias) and ``self.backend`` the backend the layer asked for.

    Args:
        d_model: model width.
        num_heads: H.
        d_k: per-head query/key size, free of d_model and H: ``q_proj`` maps d_model → H·d_k; default
            ``config.d_k``, else d_model // H.
        d_v: per-head value size (default d_k): ``v_proj`` maps d_model → G·d_v, ``out_proj`` H·d_v → d_model.
        score: a registered score or preset name, or a built score module.
        bias: biases in the four projections.
        dropout: dropout on the attention weights (training only).
        config: an :class:`~attnlab.config.AttentionConfig`; then ``score`` and ``options`` stay unset.
        layer: this layer's depth l = 1, 2, … (differential attention's λ_init).
        **options: the other stages, as :class:`~attnlab.config.AttentionConfig` fields (listed below), and the
            score's parameters (``clip=4`` for relative_position, ...).

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
    * ``backend``: ``auto`` or a registered backend (:mod:`attnlab.backends`), refused in one line where it cannot
      compute this configuration.

    A score or position bias that takes ``bidirectional`` (T5's buckets) and leaves it unset gets False when the
    config's mask hides every later key (causal, causal & window: T5's decoder bucketing) and True otherwise.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_k: int | None = None,
        d_v: int | None = None,
        score: str | nn.Module | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        *,
        config: AttentionConfig | None = None,
        layer: int = 1,
        **options: Any,
    ) -> None:
        super().__init__()
        built: dict[str, nn.Module] = {}
        if config is None:
            config = self._config_from_options(score, d_v, options, built)
        elif score is not None or options:
            given = sorted([*options, *(["score"] if score is not None else [])])
            raise ValueError(f"give config= or the attention options, not both (also given: {', '.join(given)})")
        elif d_v is not None:
            config = config.replace(d_v=d_v)
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        self.config = config = config.resolved()

        self.d_model = check_int("d_model", d_model, minimum=1)
        self.num_heads = H = check_int("num_heads", num_heads, minimum=1)
        self.d_k = check_int("d_k", d_k, minimum=1) if d_k is not None else default_d_k(d_model, H, config.d_k)
        self.d_v = self.d_k if config.d_v is None else config.d_v
        self.dropout = check_prob("dropout", dropout, high_open=True)
        self.num_kv_heads = G = H if config.num_kv_heads is None else config.num_kv_heads
        if H % G:
            raise ValueError(
                f"num_kv_heads ({G}) must divide num_heads ({H}): 1 (multi-query), a divisor (GQA), or null (= {H})"
            )
        self.differential = config.differential
        maps = 2 if self.differential else 1
        self.query_heads, self.key_heads = maps * H, maps * G  # Hq, Gk
        causal = config.mask is not None and hides_later_keys(build_mask(config.mask))

        # projections
        self.q_proj = nn.Linear(d_model, self.query_heads * self.d_k, bias=bias)
        self.k_proj = nn.Linear(d_model, self.key_heads * self.d_k, bias=bias)
        self.v_proj = nn.Linear(d_model, G * self.d_v, bias=bias)
        self.out_proj = nn.Linear(H * self.d_v, d_model, bias=bias)

        # score and position bias, over the Hq query heads
        sizes = {"d_k": self.d_k, "num_heads": self.query_heads, "d_v": self.d_v}
        if "score" in built:
            self.score = built["score"]
        else:
            params = resolve_direction("score", config.score, config.score_params, causal) if causal else None
            self.score = build_score(config.score, **sizes, d_model=d_model, **(params or config.score_params))
        if "position_bias" in built:
            self.position_bias = built["position_bias"]
        else:
            params = config.position_bias_params
            if config.mask is not None:
                params = resolve_direction("position bias", config.position_bias, params, causal)
            self.position_bias = build_position_bias(config.position_bias, **sizes, **params)

        # q/k transforms
        self.qk_norm = config.qk_norm
        self.q_norm = QK_NORMS[config.qk_norm](self.d_k) if config.qk_norm is not None else None
        self.k_norm = QK_NORMS[config.qk_norm](self.d_k) if config.qk_norm is not None else None
        self.rope = built.get("rope") or (None if config.rope is None else RotaryEmbedding(self.d_k, **config.rope))

        # short convolutions on the projections (causal, depthwise)
        self.short_conv = config.short_conv
        if self.short_conv is not None:
            self.q_conv = ShortConvolution(self.query_heads * self.d_k, self.short_conv)
            self.k_conv = ShortConvolution(self.key_heads * self.d_k, self.short_conv)
            self.v_conv = ShortConvolution(G * self.d_v, self.short_conv)

        # logit transform and normalizer
        self.softcap = config.softcap
        self.normalizer = built.get("normalizer") or build_normalizer(
            config.normalizer, num_heads=self.query_heads, **config.normalizer_params
        )

        # differential attention's λ and per-head norm
        self.layer = check_int("layer", layer, minimum=1)
        if self.differential:
            self.lambda_init = lambda_init(self.layer)
            self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
                nn.Parameter(torch.randn(self.d_k) * 0.1) for _ in range(4)
            )
            self.sub_norm = nn.RMSNorm(self.d_v, eps=1e-5)

        if self.is_recurrent:
            self._check_recurrent()

        # the backend: a forced one must support this configuration and its mask
        self.backend: Backend | None = None if config.backend == "auto" else build_backend(config.backend)
        if self.backend is not None:
            form = self.mask_form
            shown = None
            if form == "other":  # name the mask itself
                from attnlab.config import _mask_text

                shown = f"mask={_mask_text(config.mask)}"
            reason = self.backend.config_reason(self) or self.backend.mask_reason(form, shown)
            if reason is not None:
                raise ValueError(f"attention.backend={config.backend} cannot compute this layer: {reason}")
        check_backend_params(config.backend_params, config.backend)
        self.head_gate: Tensor | None = None
        """(H,) or None: each head's output is multiplied by its gate before ``out_proj`` (every backend; set for a
        block by :func:`attnlab.heads.head_gates`: head importance and pruning). Not a parameter or buffer."""
        self._register_load_state_dict_pre_hook(self._rename_old_keys)

    def _check_recurrent(self) -> None:
        """A decay or delta-rule form (:mod:`attnlab.recurrences`) computes its own causal weights: refuse, in one
        line, a normalizer, a mask that is not causal, and the stages it has no form for."""
        config, name = self.config, self.config.score
        if config.normalizer != "none":
            raise ValueError(
                f"variant {name} computes its own weights (a decayed or delta-rule state, no normalizer): "
                f"set normalizer=none (the variant's config does), not normalizer={config.normalizer}"
            )
        if self.mask_form not in ("causal", "causal+padding"):
            from attnlab.config import _mask_text

            shown = "none (every key visible)" if config.mask is None else _mask_text(config.mask)
            raise ValueError(
                f"variant {name} is causal only (its state runs over the sequence in order): set mask=causal "
                f"(AND key padding at most), not mask={shown}"
            )
        for stage, on in (
            ("position_bias", self.position_bias is not None),
            ("softcap", self.softcap is not None),
            ("differential", self.differential),
        ):
            if on:
                raise ValueError(f"variant {name} has no form with {stage}: leave {stage} unset for it")

    @staticmethod
    def _config_from_options(
        score: str | nn.Module | None, d_v: int | None, options: dict[str, Any], built: dict[str, nn.Module]
    ) -> AttentionConfig:
        """The :class:`AttentionConfig` that keyword arguments describe; built modules (a score, position bias,
        normalizer or rotary module) go to ``built`` and the config records their class name."""
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
            short_conv=opts["short_conv"],
            mask=opts["mask"],
            backend=opts["backend"],
            backend_params=opts["backend_params"] or {},
        )

    def _rename_old_keys(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A checkpoint of an earlier version loads: the presets' bias parameters move to this layer's
        position-bias stage (:func:`renamed_state_key`)."""
        ours = {prefix + k for k in self.state_dict()}
        for key in [k for k in state_dict if k.startswith(prefix + "score.")]:
            new = renamed_state_key(key, ours)
            if new != key and new not in state_dict:
                state_dict[new] = state_dict.pop(key)

    # ------------------------------------------------------------------------------------------ stages

    def project(self, x: Tensor, key_value: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, Lq, d_model), key_value (B, Lk, d_model) or None → q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k),
        v (B, G, Lk, d_v), with q and k transformed (:meth:`transform_qk`)."""
        kv = x if key_value is None else key_value
        B, Lq, _ = x.shape
        Lk = kv.shape[1]
        q, k, v = self.q_proj(x), self.k_proj(kv), self.v_proj(kv)  # (B, L, channels)
        if self.short_conv is not None:
            q, k, v = self.q_conv(q), self.k_conv(k), self.v_conv(v)
        q = q.view(B, Lq, self.query_heads, self.d_k).transpose(1, 2)  # (B, Hq, Lq, d_k)
        k = k.view(B, Lk, self.key_heads, self.d_k).transpose(1, 2)  # (B, Gk, Lk, d_k)
        v = v.view(B, Lk, self.num_kv_heads, self.d_v).transpose(1, 2)  # (B, G, Lk, d_v)
        return (*self.transform_qk(q, k), v)

    def transform_qk(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        """QK-norm, then rotary positions (query i at position offset + i, key j at offset + j; ``offset``: the
        tokens before these, when decoding one at a time)."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
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

    def recurrent_inputs(
        self, x: Tensor, key_value: Tensor | None = None, mask: Tensor | Mask | PreparedMask | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, PreparedMask]:
        """A decay or delta-rule form's inputs (:meth:`~attnlab.recurrences.RecurrentScore.inputs`):
        x (B, L, d_model) → q, k (B, H, L, d_k), v (B, H, L, d_v) (key/value heads repeated for their query heads),
        log α and β (B, H, L) or None, and the prepared mask, which must be causal (AND key padding: a padded key
        is written with k = 0, which leaves the state as it was)."""
        name = self.config.score
        if key_value is not None:
            raise ValueError(f"variant {name} is self-attention only: its state runs over x itself (no key_value)")
        q, k, v = self.project(x)
        pm = self.mask_for_heads(mask, x.shape[1], x.shape[1], x.device)
        form = "none" if pm is None else pm.form
        if form == "other" and pm.allowed.shape[:2] == (1, 1):  # a bool tensor: causal if it is exactly j ≤ i
            L = x.shape[1]
            if torch.equal(pm.allowed[0, 0], torch.ones(L, L, dtype=torch.bool, device=x.device).tril()):
                form = "causal"
        if pm is None or form not in ("causal", "causal+padding"):
            raise ValueError(
                f"variant {name} is causal only: call it with a causal mask (an attnlab causal Mask, AND key "
                f"padding at most), not mask={form}"
            )
        q, k, log_alpha, beta = self.score.inputs(q, self.expand_heads(k, self.num_heads), x)
        if pm.keys is not None:
            k = k * pm.keys.transpose(-1, -2).to(k.dtype)  # (B, 1, L, 1): a padded key writes nothing
        return q, k, self.expand_heads(v, self.num_heads), log_alpha, beta, pm

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

    def merge_maps(self, z1: Tensor, z2: Tensor) -> Tensor:
        """Differential attention's two outputs z₁ = w₁ v and z₂ = w₂ v (B, H, Lq, d_v) → (B, Lq, d_model): the
        heads (z₁ − λ z₂), normed and scaled as :meth:`merge` does, in one fused step (:class:`DifferentialHeads`:
        the same values as ``merge(combine_maps(cat(z₁, z₂)))``, in fewer passes over (B, H, Lq, d_v))."""
        norm = self.sub_norm
        heads = DifferentialHeads.apply(
            z1, z2, self.differential_lambda().to(z1.dtype), norm.weight, norm.eps, 1 - self.lambda_init
        )
        return self.merge(heads, normed=True)

    def merge(self, z: Tensor, normed: bool = False) -> Tensor:
        """z (B, H, Lq, d_v) → (B, Lq, d_model); differential attention first norms each head and scales it by
        (1 − λ_init) (unless ``normed``: :meth:`merge_maps` did); a decay or delta-rule form norms each head (its
        ``output_norm``); a head gate (:attr:`head_gate`, (H,)) then scales each head."""
        if self.differential and not normed:
            z = self.sub_norm(z) * (1 - self.lambda_init)
        if self.is_recurrent:
            z = self.score.norm_output(z)
        if self.head_gate is not None:  # Michel et al. 2019's ξ_h (attnlab.heads.head_gates): 0 removes head h
            z = z * self.head_gate.to(device=z.device, dtype=z.dtype).view(1, -1, 1, 1)
        B, _, Lq, _ = z.shape
        return self.out_proj(z.transpose(1, 2).reshape(B, Lq, self.num_heads * self.d_v))  # (B, Lq, d_model)

    def extra_logit(self) -> Tensor | None:
        """The normalizer's sink logit (softmax1, sink), or None."""
        extra = getattr(self.normalizer, "extra_logit", None)
        return extra() if extra is not None else None

    def position_logits(self, q: Tensor, num_keys: int) -> tuple[Tensor | None, bool]:
        """The additive logit terms beside q·k (a score's own bias and the position-bias stage), summed, and
        whether the result is a static (cacheable) tensor; (None, False) when there are none."""
        score = self.score
        parts = [(score.bias(q, num_keys), score.static_bias)] if isinstance(score, DotProductScore) else []
        if self.position_bias is not None:
            parts.append((self.position_bias(q, num_keys), self.position_bias.static_bias))
        parts = [(b, s) for b, s in parts if b is not None]
        if not parts:
            return None, False
        if len(parts) == 1:
            return parts[0]
        return parts[0][0] + parts[1][0], False

    # ------------------------------------------------------------------------------------------ forward

    def backend_for(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        need_weights: bool = False,
        training: bool = True,
        grad: bool = True,
        mask: str | None = None,
    ) -> str:
        """The name of the backend a call under these conditions runs (:func:`~attnlab.backends.choose_backend`);
        by default, a training step on the CPU in float32 with this layer's configured mask (``mask``: a
        :attr:`~attnlab.masks.PreparedMask.form`, ``causal+padding`` ...)."""
        form = self.mask_form if mask is None else mask
        when = Conditions(torch.device(device).type, dtype, need_weights, training, grad, form)
        return choose_backend(self, when).name

    @property
    def mask_form(self) -> str:
        """The configured mask's form (:func:`~attnlab.masks.mask_form`): ``none``, ``causal``, ``padding``,
        ``causal+padding`` or ``other``."""
        return mask_form(None if self.config.mask is None else build_mask(self.config.mask))

    @property
    def is_linear(self) -> bool:
        """Whether this layer is linear attention that the O(L) backends compute (a ``linear`` score with the
        ``rowsum`` or ``none`` normalizer, no position bias, soft-cap or differential maps)."""
        from attnlab.backends.linear import linear_reason

        return linear_reason(self) is None

    @property
    def is_recurrent(self) -> bool:
        """Whether this layer is a decay or delta-rule form (:mod:`attnlab.recurrences`: retnet, gla, deltanet,
        gated_deltanet), which the ``chunked`` and ``recurrent`` backends compute in O(L)."""
        return isinstance(self.score, RecurrentScore)

    def state_size(self, length: int) -> int:
        """The floats per sequence that this layer's recurrent (token-by-token) form carries after ``length``
        tokens: linear attention's state H·(d_φ·d_v + d_φ) (S and z; H·d_φ·d_v without the row-sum normaliser)
        and a decay or delta-rule form's H·d_k·d_v (M), whatever the length; any other layer's key/value cache,
        (Gk·d_k + G·d_v) per cached key, where a causal
        sliding window caches the window and any other mask every key; plus the short convolutions' last k − 1
        inputs."""
        if self.is_recurrent:
            size = self.score.state_size()  # H·d_k·d_v
        elif self.is_linear:
            phi = self.score.feature_dim
            size = self.num_heads * phi * (self.d_v + (1 if self.normalizer.normalize_rows else 0))
        else:
            size = self._cached_keys(length) * (self.key_heads * self.d_k + self.num_kv_heads * self.d_v)
        if self.short_conv is not None:
            channels = (self.query_heads + self.key_heads) * self.d_k + self.num_kv_heads * self.d_v
            size += (self.short_conv - 1) * channels
        return int(size)

    def _cached_keys(self, length: int) -> int:
        """How many keys a token-by-token form must keep after ``length`` tokens: under a position-only mask that
        hides later keys, those the last query sees (a causal window: the window), else ``length``."""
        mask = None if self.config.mask is None else build_mask(self.config.mask)
        if length <= 0 or mask is None or not mask.position_only or not hides_later_keys(mask):
            return max(length, 0)
        last = torch.tensor([[length - 1]])  # (1, 1): one query row, not the (L, L) mask
        return int(torch.as_tensor(mask.mask_mod(last, torch.arange(length)[None, :], None, None)).sum())

    @property
    def uses_fast_path(self) -> bool:
        """Whether ``forward(need_weights=False)`` computes the layer in one fused call (SDPA or a fused kernel)
        rather than stage by stage: the ``sdpa`` backend supports this configuration."""
        return build_backend("sdpa").config_reason(self) is None

    def forward(
        self,
        x: Tensor,
        key_value: Tensor | None = None,
        mask: Tensor | Mask | PreparedMask | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, Lq, d_model), key_value (B, Lk, d_model) or None for self-attention, mask bool broadcastable to
        (B, H, Lq, Lk) with True = may attend (or a Mask, or a PreparedMask) → (out (B, Lq, d_model), weights
        (B, H, Lq, Lk) if ``need_weights`` else None). The backend is chosen per call
        (:func:`~attnlab.backends.choose_backend`); asking for the weights runs ``eager``."""
        num_keys = x.shape[1] if key_value is None else key_value.shape[1]
        pm = prepare_mask(mask, x.shape[1], num_keys, x.device)
        backend = choose_backend(self, Conditions.of(self, x, need_weights, pm))
        out, weights = backend.attend(self, x, key_value, pm)
        return out, (weights if need_weights else None)

    def attend(
        self, x: Tensor, key_value: Tensor | None = None, mask: Tensor | Mask | PreparedMask | None = None
    ) -> AttentionOutput:
        """The eager path, every stage in turn, returning the output with the weights and the logits. A decay or
        delta-rule form's logits and weights are its effective matrix (:func:`~attnlab.recurrences.effective_matrix`:
        the lower-triangular map from v to the output, signed for the delta rule)."""
        if self.is_recurrent:
            q, k, v, log_alpha, beta, pm = self.recurrent_inputs(x, key_value, mask)
            logits = effective_matrix(q, k, log_alpha, beta)  # (B, H, L, L)
            weights = self.normalize(logits, pm, v.dtype)  # normalizer none: only the mask
            dropped = F.dropout(weights, self.dropout) if self.training and self.dropout > 0 else weights
            return AttentionOutput(self.merge(torch.matmul(dropped, v)), weights, logits)
        q, k, v = self.project(x, key_value)
        pm = self.mask_for_heads(mask, q.shape[2], k.shape[2], x.device)
        logits = self.logits(q, k)  # (B, Hq, Lq, Lk)
        weights = self.combine_maps(self.normalize(logits, pm, v.dtype))  # (B, H, Lq, Lk)
        dropped = F.dropout(weights, self.dropout) if self.training and self.dropout > 0 else weights
        z = self.mix_values(dropped, v)  # (B, H, Lq, d_v)
        return AttentionOutput(self.merge(z), weights, logits)

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
        if self.short_conv is not None:
            extra.append(f"short_conv={self.short_conv}")
        if self.config.backend != "auto":
            extra.append(f"backend={self.config.backend}")
        return ", ".join(extra)


# moved to attnlab.backends.sdpa (0.3); importable from here as before
from attnlab.backends.sdpa import BiasedSoftmaxAttention, scaled_dot_product_attention  # noqa: E402, F401
