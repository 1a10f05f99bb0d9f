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

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn

import attnlab.masks as masks
import attnlab.stages as stages
from attnlab.backends import Backend, Conditions, LayerSpec, build_backend, check_backend_params, choose_backend
from attnlab.checks import check_int, check_prob, default_d_k
from attnlab.compat import FormAttributes, forward, rename_old_keys
from attnlab.config import AttentionConfig
from attnlab.config import _mask_text as mask_text
from attnlab.forms import FormOutput, LayerSizes, build_form, form_class, form_for, form_output
from attnlab.forms.base import refuse_unimplemented
from attnlab.masks import Mask, build_mask, mask_form, position_part
from attnlab.positions import RotaryEmbedding
from attnlab.stages import claims_of

if TYPE_CHECKING:
    from attnlab.masks import PreparedMask

__all__ = ["AttentionOutput", "MultiHeadAttention"]

__getattr__ = forward(__name__)  # the names that moved (attnlab.compat)


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


class MultiHeadAttention(FormAttributes, nn.Module):
    """Multi-head attention (Vaswani et al. 2017, §3.2.2) with every stage pluggable.

    What the layer computes is one :class:`~attnlab.config.AttentionConfig` (``config=``), or, as before, the
    keyword arguments below, which build one (a thin shim for users' scripts). Either way ``self.config`` is the
    resolved config (a preset expanded into its score and bias), ``self.form`` the token mixer it computes
    (:mod:`attnlab.forms`, chosen by :func:`~attnlab.forms.form_for`) and ``self.backend`` the backend the layer
    asked for. Every config field is computed or refused in one line when the layer is built
    (:func:`~attnlab.forms.base.refuse_unimplemented`); the configured mask applies to a call that passes none.

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

    The stage options are listed at :func:`~attnlab.stages.config_from_options`.
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
            config = stages.config_from_options(score, d_v, options, built)
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
        if d_k is not None and config.d_k is not None and d_k != config.d_k:
            raise ValueError(f"d_k={d_k} given to the layer and config.d_k={config.d_k}: give one of them")
        self.d_k = check_int("d_k", d_k, minimum=1) if d_k is not None else default_d_k(d_model, H, config.d_k)
        self.d_v = self.d_k if config.d_v is None else config.d_v
        self.dropout = check_prob("dropout", dropout, high_open=True)
        self.num_kv_heads = G = H if config.num_kv_heads is None else config.num_kv_heads
        if H % G:
            raise ValueError(f"num_kv_heads ({G}) must divide num_heads ({H}): 1 (multi-query), a divisor, or null")
        self.layer = check_int("layer", layer, minimum=1)
        form_name = form_for(config)
        kind = form_class(form_name)  # differential attention: two maps per head; DeltaProduct: n keys and values
        refuse_unimplemented(kind, config, claims_of(kind))  # every knob computed, or one line
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
        self.q_norm, self.k_norm = (stages.QK_NORMS[config.qk_norm](self.d_k) if config.qk_norm else None for _ in "qk")
        rope = built.get("rope") or (None if config.rope is None else RotaryEmbedding(self.d_k, **config.rope))
        self.rope = None if kind.projects else rope  # (a form that projects applies its own rotary positions)

        # short convolutions on the projections (causal, depthwise; with a residual: Canon-B)
        self.short_conv = config.short_conv
        if self.short_conv is not None:
            residual = config.short_conv_residual
            self.q_conv = stages.ShortConvolution(self.query_heads * self.d_k, self.short_conv, residual)
            self.k_conv = stages.ShortConvolution(self.key_heads * self.d_k, self.short_conv, residual)
            self.v_conv = stages.ShortConvolution(self.value_heads * self.d_v, self.short_conv, residual)

        # the configured mask's positional part (key padding needs the tokens), for a call that passes none
        self.structural_mask: Mask | None = position_part(None if config.mask is None else build_mask(config.mask))
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
        self._register_load_state_dict_pre_hook(rename_old_keys, with_module=True)

    # ------------------------------------------------------------------------------------------ the record

    @property
    def spec(self) -> LayerSpec:
        """The frozen record a backend computes from (:class:`~attnlab.backends.LayerSpec`): the form, the config,
        the features the layer needs and its sizes; made once (again if the dropout changes)."""
        spec = self.__dict__.get("_spec")
        if spec is None or spec.dropout != self.dropout or spec.form is not self.form:
            features = self.form.features()  # (every config field is claimed: refuse_unimplemented, at build)
            spec = LayerSpec(
                self.form, self.config, features, self.num_heads, self.num_kv_heads, self.d_k, self.d_v,
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
        return choose_backend(self.spec, when).name

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
        pm = masks.prepare_mask(self.structural_mask if mask is None else mask, x.shape[1], num_keys, x.device)
        backend = choose_backend(self.spec, Conditions.of(x, need_weights, pm, self.training))
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
        pm = masks.prepare_mask(self.structural_mask if mask is None else mask, q.shape[2], k.shape[2], x.device)
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
