"""Multi-head attention: one pipeline for every token mixer (:mod:`attnlab.forms`),

    x → project              q = x W_Q, k = x W_K, v = x W_V      (B, Hq, Lq, d_k), (B, Gk, Lk, d_k), (B, Gv, Lk, d_v)
                             (+ short convolution), QK-norm, rotary positions
      → form.prepare         the form's inputs: its gates and transition record, the mask shaped for its heads
      → backend.compute      z from those inputs (:mod:`attnlab.backends`: eager = the form's quadratic form)
      → form.output          per-head output transform (output norm, differential sub-norm)  (B, H, Lq, d_v)
      → output gate          z_h ← z_h ⊙ σ(x W_g)_h, headwise or elementwise (Qiu et al. 2025), when configured
      → merge                out = concat_h(head_gate_h · z_h) W_O   (B, Lq, d_model)

H query heads and G key/value heads (``num_kv_heads``: G = H is multi-head, G = 1 multi-query (Shazeer 2019), a
divisor of H grouped-query attention (Ainslie et al. 2023)); query head h reads key/value head h // (H / G). The
layer owns the projections, the short convolution, the q/k transforms and the merge; the form owns everything
between (:class:`~attnlab.forms.softmax.SoftmaxForm`'s score, position bias, soft-cap, normalizer and differential
maps; a transition form's gates; a form that projects its own inputs, like multi-head latent attention, also the
projection); the backend, chosen per call by :func:`~attnlab.backends.choose_backend` (or forced
with ``backend=``), computes z from the form's inputs and a frozen :class:`~attnlab.backends.LayerSpec`. Decoding is
:meth:`MultiHeadAttention.step`: the same projection, then the form's one-token step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from attnlab.backends import Backend, Conditions, LayerSpec, build_backend, check_backend_params, choose_backend
from attnlab.checks import check_int, check_prob, default_d_k
from attnlab.config import AttentionConfig
from attnlab.config import _mask_text as mask_text
from attnlab.forms import FormOutput, LayerSizes, build_form, form_class, form_for, form_output
from attnlab.forms.softmax import DifferentialHeads, lambda_init
from attnlab.kernels.conv import causal_conv
from attnlab.masks import Mask, PreparedMask, build_mask, mask_form, prepare_mask
from attnlab.positions import RotaryEmbedding

__all__ = [
    "LAYER_FIELDS",
    "QK_NORMS",
    "AttentionOutput",
    "DifferentialHeads",
    "MultiHeadAttention",
    "PreparedMask",
    "ShortConvolution",
    "lambda_init",
    "prepare_mask",
]

QK_NORMS: dict[str, type[nn.Module]] = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}

LAYER_FIELDS = frozenset(
    {"d_k", "d_v", "num_kv_heads", "qk_norm", "rope", "short_conv", "short_conv_residual", "output_gate", "mask",
     "backend", "backend_params"}
)  # fmt: skip
"""The :class:`~attnlab.config.AttentionConfig` fields the layer itself computes (projection, q/k transforms, the
mask, the choice of backend). Every other field is the form's (:attr:`~attnlab.forms.Form.config_fields`); one that
neither owns is a feature every backend refuses until it is taught it (:class:`~attnlab.backends.LayerSpec`)."""


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


class _Output(NamedTuple):
    out: Tensor
    weights: Tensor
    logits: Tensor


class AttentionOutput(_Output):
    """out (B, Lq, d_model); weights w (B, H, Lq, Lk), signed for differential attention; logits e (B, Hq, Lq, Lk),
    what the normalizer sees (score + position bias, soft-capped); Hq = 2H for differential attention. It unpacks
    as these three (``out, weights, logits = layer.attend(x)``); ``gate``, an attribute beside them, is the output
    gate's σ(x W_g) (B, H, Lq, 1) headwise or (B, H, Lq, d_v) elementwise, None without one."""

    gate: Tensor | None = None  # (the class's default, for one made by _replace or _make)

    def __new__(cls, out: Tensor, weights: Tensor, logits: Tensor, gate: Tensor | None = None) -> AttentionOutput:
        self = super().__new__(cls, out, weights, logits)
        self.gate = gate
        return self


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


_MOVED_INTO_FORM = ("position_bias.", "normalizer.", "sub_norm.", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def renamed_state_key(key: str, ours: Mapping[str, Any] | Any) -> str:
    """A checkpoint's state-dict key as this version names it (``ours``: this model's keys). The preset variants'
    bias parameters lived in the score (0.1: ``…score.rel_k``; 0.2: ``…score.position_bias.rel_k``); from 0.3 to
    0.6 they were the layer's position-bias stage (``…position_bias.rel_k``); since 0.7 every stage between the
    projections and the merge is the form's (``…form.position_bias.rel_k``, ``…form.score.…``, a decay or
    delta-rule form's gates ``…form.alpha_gate.…``, which were its score's, differential attention's
    ``…form.lambda_q1`` and ``…form.sub_norm.…``)."""
    if key in ours:
        return key
    dotted = f".{key}"
    candidates = []
    if ".score." in dotted:
        head, _, rest = dotted.rpartition(".score.")
        bias = rest.removeprefix("position_bias.")
        candidates += [f"{head}.position_bias.{bias}", f"{head}.form.position_bias.{bias}"]
        candidates += [f"{head}.form.score.{rest}", f"{head}.form.{rest}"]
    for stage in _MOVED_INTO_FORM:
        if f".{stage}" in dotted:
            head, _, rest = dotted.rpartition(f".{stage}")
            candidates.append(f"{head}.form.{stage}{rest}")
    return next((c.lstrip(".") for c in candidates if c.lstrip(".") in ours), key)


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


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, §3.2.2) with every stage pluggable.

    What the layer computes is one :class:`~attnlab.config.AttentionConfig` (``config=``), or, as before, the
    keyword arguments below, which build one (a thin shim for users' scripts). Either way ``self.config`` is the
    resolved config (a preset expanded into its score and bias), ``self.form`` the token mixer it computes
    (:mod:`attnlab.forms`, chosen by :func:`~attnlab.forms.form_for`) and ``self.backend`` the backend the layer
    asked for. The form's stages read through the layer as before (``layer.score``, ``layer.normalizer``,
    ``layer.logits(q, k)`` …: attributes the layer lacks are looked up on its form).

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
        **options: the other stages, as :class:`~attnlab.config.AttentionConfig` fields, and the score's
            parameters (``clip=4`` for relative_position, ...).

    The stage options are listed at :func:`config_from_options`.
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
            config = config_from_options(score, d_v, options, built)
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
        self.layer = check_int("layer", layer, minimum=1)
        form_name = form_for(config)
        kind = form_class(form_name)  # differential attention: two maps per head; DeltaProduct: n keys and values
        self.query_heads, self.key_heads = kind.query_maps(config) * H, kind.key_maps(config) * G  # Hq, Gk
        self.value_heads = kind.value_maps(config) * G  # Gv

        # projections (a form that projects its own inputs, like MLA's latent, builds them itself: Form.projects)
        if not kind.projects:
            self.q_proj = nn.Linear(d_model, self.query_heads * self.d_k, bias=bias)
            self.k_proj = nn.Linear(d_model, self.key_heads * self.d_k, bias=bias)
            self.v_proj = nn.Linear(d_model, self.value_heads * self.d_v, bias=bias)
        self.out_proj = nn.Linear(H * self.d_v, d_model, bias=bias)

        # the token mixer
        sizes = LayerSizes(d_model, H, G, self.d_k, self.d_v, self.layer, self.dropout, bias)
        self.form = build_form(form_name, sizes, config, **{k: m for k, m in built.items() if k != "rope"})

        # the gated output (Qiu et al. 2025): one gate per head, or per channel, from the layer's input
        self.output_gate = config.output_gate
        if self.output_gate is not None:
            self.g_proj = nn.Linear(d_model, H * (self.d_v if self.output_gate == "elementwise" else 1), bias=bias)

        # q/k transforms
        self.qk_norm = config.qk_norm
        self.q_norm = QK_NORMS[config.qk_norm](self.d_k) if config.qk_norm is not None else None
        self.k_norm = QK_NORMS[config.qk_norm](self.d_k) if config.qk_norm is not None else None
        rope = built.get("rope") or (None if config.rope is None else RotaryEmbedding(self.d_k, **config.rope))
        self.rope = None if kind.projects else rope  # (a form that projects applies its own rotary positions)

        # short convolutions on the projections (causal, depthwise; with a residual: Canon-B)
        self.short_conv = config.short_conv
        if self.short_conv is not None:
            residual = config.short_conv_residual
            self.q_conv = ShortConvolution(self.query_heads * self.d_k, self.short_conv, residual)
            self.k_conv = ShortConvolution(self.key_heads * self.d_k, self.short_conv, residual)
            self.v_conv = ShortConvolution(self.value_heads * self.d_v, self.short_conv, residual)

        shown = "none (every key visible)" if config.mask is None else mask_text(config.mask)
        self.form.check_mask(self.mask_form, shown)
        # the backend: a forced one must support this configuration and its mask
        self.backend: Backend | None = None if config.backend == "auto" else build_backend(config.backend)
        if self.backend is not None:
            shown = f"mask={mask_text(config.mask)}" if self.mask_form == "other" else None
            reason = self.backend.config_reason(self.spec) or self.backend.mask_reason(self.mask_form, shown)
            if reason is not None:
                raise ValueError(f"attention.backend={config.backend} cannot compute this layer: {reason}")
        check_backend_params(config.backend_params, config.backend)
        self.head_gate: Tensor | None = None
        """(H,) or None: each head's output is multiplied by its gate before ``out_proj`` (every backend; set for a
        block by :func:`attnlab.heads.head_gates`: head importance and pruning). Not a parameter or buffer."""
        self._register_load_state_dict_pre_hook(self._rename_old_keys)

    def _rename_old_keys(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A checkpoint of an earlier version loads: the presets' bias parameters move to the position-bias stage
        (:func:`renamed_state_key`), and the stages that moved into the form (0.7: ``score``, ``position_bias``,
        ``normalizer``, differential attention's λ and sub-norm; a decay or delta-rule form's gates, which were its
        score's) move to ``form.``."""
        ours = {prefix + k for k in self.state_dict()}
        for key in [k for k in state_dict if k.startswith(prefix) and k not in ours]:
            new = renamed_state_key(key, ours)
            if new != key and new not in state_dict:
                state_dict[new] = state_dict.pop(key)

    def __getattr__(self, name: str) -> Any:
        """The form's stages and methods through the layer, as before 0.7 (``layer.score``, ``layer.logits`` …)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            form = self._modules.get("form")
            if form is None or name.startswith("_"):
                raise
            return getattr(form, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting one of the form's stages through the layer (``layer.normalizer = …``) sets the form's, and the
        layer's record (:attr:`spec`) and backend choice are made again."""
        form = self.__dict__.get("_modules", {}).get("form")
        if form is not None and name not in self.__dict__ and name not in self._modules and hasattr(form, name):
            setattr(form, name, value)
            self.__dict__.pop("_spec", None)
            self.__dict__.pop("_backend_candidates", None)
            return
        super().__setattr__(name, value)

    # ------------------------------------------------------------------------------------------ the record

    @property
    def spec(self) -> LayerSpec:
        """The frozen record a backend computes from (:class:`~attnlab.backends.LayerSpec`): the form, the config,
        the features the layer needs and its sizes; made once (again if the dropout changes)."""
        spec = self.__dict__.get("_spec")
        if spec is None or spec.dropout != self.dropout or spec.form is not self.form:
            features = set(self.form.features())
            owned = LAYER_FIELDS | self.form.config_fields
            for f in dataclasses.fields(self.config):
                if f.name in owned:
                    continue
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
                if getattr(self.config, f.name) != default:
                    features.add(f"config.{f.name}")
            spec = LayerSpec(
                self.form, self.config, frozenset(features), self.num_heads, self.num_kv_heads, self.d_k, self.d_v,
                self.dropout,
            )  # fmt: skip
            self.__dict__["_spec"] = spec
        return spec

    @property
    def mask_form(self) -> str:
        """The configured mask's form (:func:`~attnlab.masks.mask_form`): ``none``, ``causal``, ``padding``,
        ``causal+padding`` or ``other``."""
        return mask_form(None if self.config.mask is None else build_mask(self.config.mask))

    # ------------------------------------------------------------------------------------------ stages

    def project(
        self, x: Tensor, key_value: Tensor | None = None, offset: int = 0, cache: Any = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, Lq, d_model), key_value (B, Lk, d_model) or None → q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k),
        v (B, Gv, Lk, d_v) (Gv = G but for DeltaProduct's n·G): the projections, the short convolution (one token
        with ``cache``'s buffers when decoding), then QK-norm and rotary positions (``offset``: the tokens before
        these). A form that projects its own inputs (:attr:`~attnlab.forms.Form.projects`: multi-head latent
        attention) computes them instead (:meth:`~attnlab.forms.Form.project`; decoding, in its own form)."""
        kv = x if key_value is None else key_value
        if self.form.projects:
            return self.form.project(x, kv, offset, decoding=cache is not None)
        B, Lq, _ = x.shape
        Lk = kv.shape[1]
        q, k, v = self.q_proj(x), self.k_proj(kv), self.v_proj(kv)  # (B, L, channels)
        if self.short_conv is not None:
            convs = (self.q_conv, self.k_conv, self.v_conv)
            if cache is None:
                q, k, v = (conv(t) for conv, t in zip(convs, (q, k, v), strict=True))
            else:
                steps = [c.step(t, b) for c, t, b in zip(convs, (q, k, v), cache.conv or [None] * 3, strict=True)]
                (q, *_), (k, *_), (v, *_) = steps
                cache.conv = [buffer for _, buffer in steps]
        q = q.view(B, Lq, self.query_heads, self.d_k).transpose(1, 2)  # (B, Hq, Lq, d_k)
        k = k.view(B, Lk, self.key_heads, self.d_k).transpose(1, 2)  # (B, Gk, Lk, d_k)
        v = v.view(B, Lk, self.value_heads, self.d_v).transpose(1, 2)  # (B, Gv, Lk, d_v)
        return (*self.transform_qk(q, k, offset), v)

    def transform_qk(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        """QK-norm, then rotary positions (query i at position offset + i, key j at offset + j; ``offset``: the
        tokens before these, when decoding one at a time)."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
        return q, k

    def gate_values(self, x: Tensor) -> Tensor | None:
        """The output gate σ(x W_g) for the layer's input x (B, Lq, d_model) → (B, H, Lq, 1) headwise or
        (B, H, Lq, d_v) elementwise (head h's channels are W_g's outputs h·d_v … (h+1)·d_v − 1); None without
        one (Qiu et al. 2025, "Gated Attention for Large Language Models", eq. 5 at their position G1)."""
        if self.output_gate is None:
            return None
        B, Lq, _ = x.shape
        per_head = self.d_v if self.output_gate == "elementwise" else 1
        return torch.sigmoid(self.g_proj(x)).view(B, Lq, self.num_heads, per_head).transpose(1, 2)

    def merge(self, z: Tensor, gate: Tensor | None = None) -> Tensor:
        """z (B, H, Lq, d_v), each head after the form's output transform → (B, Lq, d_model): a head gate
        (:attr:`head_gate`, (H,)) scales each head, the output gate ``gate`` ((B, H, Lq, 1) or (B, H, Lq, d_v),
        :meth:`gate_values`) each head's output, then ``out_proj`` of the heads side by side."""
        if self.head_gate is not None:  # Michel et al. 2019's ξ_h (attnlab.heads.head_gates): 0 removes head h
            z = z * self.head_gate.to(device=z.device, dtype=z.dtype).view(1, -1, 1, 1)
        B, _, Lq, _ = z.shape
        z = z.transpose(1, 2)  # (B, Lq, H, d_v)
        if gate is not None:  # in the heads-side-by-side layout: the product writes it (no copy of its own)
            z = z * gate.transpose(1, 2)
        return self.out_proj(z.reshape(B, Lq, self.num_heads * self.d_v))  # (B, Lq, d_model)

    def state_size(self, length: int) -> int:
        """The floats per sequence that decoding carries after ``length`` tokens (:meth:`~attnlab.forms.Form.
        state_size`: a key/value cache, or a recurrent form's fixed state), plus the short convolutions' last
        k − 1 inputs."""
        size = self.form.state_size(length)
        if self.short_conv is not None and not self.form.projects:
            channels = (self.query_heads + self.key_heads) * self.d_k + self.value_heads * self.d_v
            size += (self.short_conv - 1) * channels
        return int(size)

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
    def uses_fast_path(self) -> bool:
        """Whether ``forward(need_weights=False)`` computes the layer in one fused call (SDPA or a fused kernel)
        rather than stage by stage: the ``sdpa`` backend supports this configuration."""
        return build_backend("sdpa").config_reason(self.spec) is None

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
        o = self.compute(backend, x, key_value, pm)
        return o.out, (o.weights if need_weights else None)

    def compute(
        self, backend: Backend, x: Tensor, key_value: Tensor | None, mask: Tensor | Mask | PreparedMask | None
    ) -> AttentionOutput:
        """The layer through ``backend``: project, the form's inputs, the backend's z, the form's output transform,
        merge."""
        if key_value is not None and self.form.causal_only:
            raise ValueError(
                f"variant {self.config.score} is self-attention only: its state runs over x itself (no key_value)"
            )
        q, k, v = self.project(x, key_value)  # (B, Hq, Lq, d_k), (B, Gk, Lk, d_k), (B, Gv, Lk, d_v)
        pm = prepare_mask(mask, q.shape[2], k.shape[2], x.device)
        inputs = self.form.prepare(q, k, v, x, pm)
        o = backend.compute(self.spec, inputs, self.dropout if self.training else 0.0)
        z = form_output(self.form, o, inputs)  # (B, H, Lq, d_v)
        gate = self.gate_values(x)
        return AttentionOutput(self.merge(z, gate), o.weights, o.logits, gate)

    def attend(
        self, x: Tensor, key_value: Tensor | None = None, mask: Tensor | Mask | PreparedMask | None = None
    ) -> AttentionOutput:
        """The eager path (the form's quadratic form), returning the output with the weights and the logits. A
        decay or delta-rule form's logits and weights are its effective matrix (the lower-triangular map from v to
        the output, signed for the delta rule)."""
        return self.compute(build_backend("eager"), x, key_value, mask)

    def step(self, x: Tensor, cache: Any) -> Tensor:
        """One token through the layer, decoding: x (B, 1, d_model) and the layer's cache
        (:class:`~attnlab.decode.LayerCache`: the form's state, the short convolution's buffers, the tokens seen)
        → out (B, 1, d_model); the cache is updated."""
        t = cache.length
        q, k, v = self.project(x, offset=t, cache=cache)
        z, cache.state = self.form.step(cache.state, q, k, v, x, t)  # (B, H, 1, d_v)
        cache.length = t + 1
        return self.merge(form_output(self.form, FormOutput(z)), self.gate_values(x))

    def extra_repr(self) -> str:
        extra = [f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}, d_v={self.d_v}"]
        if self.num_kv_heads != self.num_heads:
            extra.append(f"num_kv_heads={self.num_kv_heads}")
        if self.qk_norm:
            extra.append(f"qk_norm={self.qk_norm}")
        if self.short_conv is not None:
            extra.append(f"short_conv={self.short_conv}" + (" (residual)" if self.config.short_conv_residual else ""))
        if self.output_gate is not None:
            extra.append(f"output_gate={self.output_gate}")
        if self.config.backend != "auto":
            extra.append(f"backend={self.config.backend}")
        return ", ".join(extra)


# moved to attnlab.backends.sdpa (0.3); importable from here as before
from attnlab.backends.sdpa import BiasedSoftmaxAttention, scaled_dot_product_attention  # noqa: E402, F401
