"""Transformer encoder (Vaswani et al. 2017, §3.1) on :class:`~attnlab.attention.MultiHeadAttention`.

    h_0 = Embed(tokens) + PE                                   (B, L, d_model)
    pre-LN:  h = h + Drop(MHA(LN(h)));  h = h + Drop(FFN(LN(h)))
    post-LN: h = LN(h + Drop(MHA(h)));  h = LN(h + Drop(FFN(h)))
    out = LN_final(h_N) for pre-LN (post-LN outputs are already normalised)

Canon layers (Allen-Zhu 2025, "Physics of Language Models: Part 4.1"): ``canon="ABCD"`` or any subset puts a causal
depthwise convolution of width ``canon_width`` (4) with a residual, h ← h + conv(h), at the paper's points: A on the
attention's input (after the norm, pre-LN), B on q, k and v inside the attention (the layer's short convolution with
a residual: :attr:`~attnlab.config.AttentionConfig.short_conv_residual`), C on the feed-forward's input, D inside
the feed-forward after its first linear map (before the GELU).

Positional encodings: ``sinusoidal`` (Vaswani §3.5), ``learned`` (a table of ``max_len`` vectors), ``rope``
(rotary positions applied to q and k in every layer, no absolute table) or ``none`` (for relative-position scores
and biases, which carry position themselves). Token embeddings are not scaled by √d_model: nn.Embedding starts at
unit variance, the same order as the sinusoid.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.attention import AttentionOutput, MultiHeadAttention
from attnlab.checks import check_choice, check_int, default_d_k
from attnlab.config import AttentionConfig
from attnlab.masks import AllOf, Mask, Padding, PreparedMask, build_mask, mask_form, prepare_mask
from attnlab.positions import LearnedPositionalEncoding, SinusoidalPositionalEncoding
from attnlab.stages import ShortConvolution

__all__ = [
    "CANON_POINTS",
    "POSITIONAL_ENCODINGS",
    "Encoder",
    "EncoderLayer",
    "LearnedPositionalEncoding",
    "SinusoidalPositionalEncoding",
    "as_attention_config",
]


POSITIONAL_ENCODINGS: dict[str, type[nn.Module] | None] = {
    "sinusoidal": SinusoidalPositionalEncoding,
    "learned": LearnedPositionalEncoding,
    "rope": None,  # rotary: in the attention of every layer
    "none": None,
}


AttentionLike = AttentionConfig | Mapping[str, Any]
"""One layer's attention as the encoder takes it: an :class:`~attnlab.config.AttentionConfig` or its fields."""


def _renamed(new: bool, old: bool | None, old_name: str) -> bool:
    """``need_weights``, or the value given under its former name (with a DeprecationWarning)."""
    if old is None:
        return new
    warnings.warn(f"{old_name}= is deprecated; use need_weights=", DeprecationWarning, stacklevel=3)
    return bool(old)


def _dropout(x: Tensor, p: float) -> Tensor:
    """F.dropout, skipped entirely when p = 0."""
    return F.dropout(x, p) if p > 0.0 else x


CANON_POINTS = "ABCD"
"""Canon layers' points (Allen-Zhu 2025): A before the attention, B on q/k/v, C before the MLP, D inside the MLP."""


def canon_points(canon: str | None, name: str = "canon") -> str:
    """``canon`` (a subset of ``ABCD`` in any order, or None for none) as the points in order (``"CA"`` →
    ``"AC"``); anything else, the empty string included (a value, not "off": write null), is one line naming
    ``name`` and what is allowed."""
    if canon is None:
        return ""
    if not isinstance(canon, str) or not canon or set(canon) - set(CANON_POINTS) or len(set(canon)) != len(canon):
        raise ValueError(
            f"{name} must be null or a subset of {CANON_POINTS} without repeats (A before attention, B on q/k/v, "
            f"C before the MLP, D inside it; e.g. ABCD or AC), got {canon!r}"
        )
    return "".join(p for p in CANON_POINTS if p in canon)


def with_canon_b(config: AttentionConfig, width: int, where: str = "the attention") -> AttentionConfig:
    """``config`` with Canon-B: the short convolution of width ``width`` on q, k, v with a residual. A config that
    already has it is returned as it is; one with another short convolution is refused in one line."""
    if config.short_conv == width and config.short_conv_residual:
        return config
    if config.short_conv is not None:
        residual = " (with a residual)" if config.short_conv_residual else " (without a residual)"
        raise ValueError(
            f"canon B puts a residual short convolution of width {width} on q, k, v, but {where} already has "
            f"short_conv={config.short_conv}{residual}: leave B out of canon (model.canon), or set short_conv "
            "to null (model.short_conv=null)"
        )
    return config.replace(short_conv=width, short_conv_residual=True)


def as_attention_config(attention: AttentionConfig | Mapping[str, Any]) -> AttentionConfig:
    """``attention`` as an :class:`~attnlab.config.AttentionConfig`: a config as it is, or one built from its fields
    given as a mapping (a user's script, or the hyperparameters of a saved module, which hold plain data)."""
    if isinstance(attention, AttentionConfig):
        return attention
    if isinstance(attention, Mapping):
        return AttentionConfig(**{str(k): v for k, v in attention.items()})
    raise TypeError(f"attention must be an AttentionConfig or a mapping of its fields, got {type(attention).__name__}")


class EncoderLayer(nn.Module):
    """One encoder block: self-attention and a position-wise FFN (d_model → d_ff → d_model, GELU), each with
    dropout and a residual, pre-LN (``norm_first=True``, default) or post-LN. The attention is
    ``attention`` (an :class:`~attnlab.config.AttentionConfig`, or its fields as a mapping), or built from
    ``score``, ``score_params`` and ``attention_options`` as :class:`~attnlab.attention.MultiHeadAttention`'s
    keyword arguments. :meth:`block` is the layer's wiring around any token mixer (:meth:`forward` gives it the
    attention; decoding, one token's step). ``canon``: Canon layers of width ``canon_width`` at any of the points
    A, B, C, D (module docstring): ``canon_a`` (d_model), ``canon_c`` (d_model), ``canon_d`` (d_ff), and B in the
    attention's config."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_k: int | None = None,
        d_v: int | None = None,
        d_ff: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        score: str | nn.Module | None = None,
        score_params: dict[str, Any] | None = None,
        bias: bool = True,
        *,
        attention: AttentionConfig | Mapping[str, Any] | None = None,
        layer: int = 1,
        canon: str | None = None,
        canon_width: int = 4,
        **attention_options: Any,
    ) -> None:
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else d_ff
        self.canon = canon = canon_points(canon)
        self.canon_width = width = check_int("canon_width", canon_width, minimum=1)
        if attention is None:
            d_k = default_d_k(d_model, num_heads, d_k)
            options = {**attention_options, **(score_params or {})}
            if "B" in canon:  # (refused as with attention=: another short convolution, or one without a residual)
                given = AttentionConfig(
                    short_conv=options.get("short_conv"), short_conv_residual=options.get("short_conv_residual", False)
                )
                with_canon_b(given, width, f"layer {layer}")
                options |= {"short_conv": width, "short_conv_residual": True}
            self.self_attn = MultiHeadAttention(
                d_model, num_heads, d_k, d_v, score=score, bias=bias, dropout=dropout, layer=layer, **options
            )
        else:
            if score is not None or score_params or attention_options:
                raise ValueError("give attention= (an AttentionConfig) or the attention options, not both")
            attention = as_attention_config(attention)
            if "B" in canon:
                attention = with_canon_b(attention, width, f"layer {layer}'s attention")
            d_k = attention.d_k or d_k  # a layer's own d_k first
            self.self_attn = MultiHeadAttention(
                d_model, num_heads, d_k, d_v, bias=bias, dropout=dropout, config=attention, layer=layer
            )
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff, bias=bias), nn.GELU(), nn.Linear(d_ff, d_model, bias=bias))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = float(dropout)
        self.norm_first = norm_first
        self.canon_a = ShortConvolution(d_model, width, residual=True) if "A" in canon else None
        self.canon_c = ShortConvolution(d_model, width, residual=True) if "C" in canon else None
        self.canon_d = ShortConvolution(d_ff, width, residual=True) if "D" in canon else None

    def _attn(self, h: Tensor, mask: PreparedMask | None, need_weights: bool) -> tuple[Tensor, AttentionOutput | None]:
        if need_weights:
            o = self.self_attn.attend(h, mask=mask)
            return o.out, o
        return self.self_attn(h, mask=mask)[0], None

    def forward(
        self,
        x: Tensor,
        mask: PreparedMask | Tensor | Mask | None = None,
        need_weights: bool = False,
        need_attention: bool | None = None,
    ) -> tuple[Tensor, AttentionOutput | None]:
        """x (B, L, d_model) → (x (B, L, d_model), the layer's AttentionOutput when ``need_weights``).
        ``need_attention`` is the deprecated former name of ``need_weights``."""
        need_weights = _renamed(need_weights, need_attention, "need_attention")
        records: list[AttentionOutput | None] = []

        def attend(h: Tensor) -> Tensor:
            a, record = self._attn(h, mask, need_weights)
            records.append(record)
            return a

        return self.block(x, attend), records[0]

    def block(self, x: Tensor, mix: Callable[[Tensor], Tensor], cache: Any = None) -> Tensor:
        """x (B, L, d_model) → the layer's output with ``mix`` as its token mixer: the residual wiring, norms and
        feed-forward of :meth:`forward` around ``mix`` (B, L, d_model) → (B, L, d_model), which is called once, on
        ``norm1(x)`` pre-LN and on ``x`` itself post-LN (after Canon-A when the layer has it). Dropout (on the
        mixer's output and the feed-forward's) only in training mode, as in :meth:`forward`. ``cache``: decoding
        one token (L = 1), the layer's :class:`~attnlab.decode.LayerCache`, whose ``block`` buffers the Canon
        layers' last k − 1 inputs."""
        drop = self.dropout if self.training else 0.0
        if self.norm_first:
            x = x + _dropout(mix(self._canon(self.canon_a, self.norm1(x), cache, "A")), drop)
            return x + _dropout(self.feed_forward(self._canon(self.canon_c, self.norm2(x), cache, "C"), cache), drop)
        x = self.norm1(x + _dropout(mix(self._canon(self.canon_a, x, cache, "A")), drop))
        return self.norm2(x + _dropout(self.feed_forward(self._canon(self.canon_c, x, cache, "C"), cache), drop))

    def feed_forward(self, h: Tensor, cache: Any = None) -> Tensor:
        """h (B, L, d_model) → W₂ GELU(Canon-D(W₁ h)) (B, L, d_model); Canon-D only when the layer has it."""
        up = self._canon(self.canon_d, self.ff[0](h), cache, "D")  # (B, L, d_ff)
        return self.ff[2](self.ff[1](up))

    @staticmethod
    def _canon(conv: ShortConvolution | None, h: Tensor, cache: Any, point: str) -> Tensor:
        """Canon layer ``conv`` on h (B, L, C), or h when the layer has none; decoding, one token with the cache's
        buffer for ``point``."""
        if conv is None:
            return h
        if cache is None:
            return conv(h)
        y, cache.block[point] = conv.step(h, cache.block.get(point))
        return y


def _causal_and_padding(mask: Mask) -> tuple[Mask, list[Mask]] | None:
    """(the causal part, the key-padding parts) of a structural mask that is causal, or causal AND key padding
    (:func:`~attnlab.masks.mask_form`); None for any other."""
    if mask_form(mask) not in ("causal", "causal+padding"):
        return None
    parts = mask.masks if isinstance(mask, AllOf) else [mask]
    forms = [mask_form(part) for part in parts]
    if not set(forms) <= {"causal", "padding", "none"} or "causal" not in forms:
        return None
    causal = parts[forms.index("causal")]
    if not causal.position_only:
        return None
    return causal, [part for part, form in zip(parts, forms, strict=True) if form == "padding"]


class Encoder(nn.Module):
    """Token embedding + positional encoding + ``num_layers`` :class:`EncoderLayer` + final norm.

    Each layer's attention is an :class:`~attnlab.config.AttentionConfig`: ``attention`` gives one for every layer,
    or a list of ``num_layers`` (per-layer attention: hybrids, local/global patterns, see
    :func:`~attnlab.config.layer_configs`), each with its own structural mask. Without ``attention``, one config is
    built from the keyword arguments below, as before.

    Args:
        vocab_size: number of token ids.
        d_model, num_heads, num_layers: sizes.
        d_k: per-head key size (default the config's, else d_model // num_heads); d_v: per-head value size
            (default d_k).
        d_ff: FFN width (default 4·d_model).
        attention: an AttentionConfig, or one per layer; each may also be given as its fields in a mapping
            (:func:`as_attention_config`).
        score, score_params: the attention score (a registered score or preset) and its parameters.
        mask: a structural mask (registered name, spec dict, or :class:`Mask`), applied in every layer.
        pad_id: when set, keys equal to ``pad_id`` are hidden in every layer (AND-ed with each layer's mask).
        pos_encoding: ``sinusoidal``, ``learned``, ``rope`` or ``none``; max_len: size of the positional table.
            ``rope`` adds no table (rotary positions are the attention's ``rope``, set from ``rope`` here when the
            config is built from keyword arguments).
        rope: :class:`~attnlab.positions.RotaryEmbedding` parameters (``base``, ``fraction``) for ``rope``.
        dropout: on attention weights, residual branches and the embedding.
        norm_first: pre-LN (default) or post-LN.
        canon: Canon layers at any of the points ``ABCD`` (module docstring), or None; canon_width: their width.
        **attention_options: the other attention stages, as in :class:`~attnlab.attention.MultiHeadAttention` (the
            fields of :class:`~attnlab.config.AttentionConfig`); layer l (from 1) gets ``layer=l``.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        d_k: int | None = None,
        d_v: int | None = None,
        d_ff: int | None = None,
        score: str | None = None,
        score_params: dict[str, Any] | None = None,
        mask: str | Mask | dict[str, Any] | None = None,
        pad_id: int | None = None,
        pos_encoding: str = "sinusoidal",
        max_len: int = 512,
        dropout: float = 0.0,
        norm_first: bool = True,
        bias: bool = True,
        *,
        attention: AttentionLike | Sequence[AttentionLike] | None = None,
        rope: Mapping[str, Any] | None = None,
        canon: str | None = None,
        canon_width: int = 4,
        **attention_options: Any,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("num_heads", num_heads),
            ("num_layers", num_layers),
            ("max_len", max_len),
        ):
            check_int(name, value, minimum=1)
        check_choice("pos_encoding", pos_encoding, POSITIONAL_ENCODINGS)
        self.d_model, self.num_heads, self.pad_id = d_model, num_heads, pad_id
        self.embed = nn.Embedding(vocab_size, d_model)
        pe_cls = POSITIONAL_ENCODINGS[pos_encoding]
        self.pos = pe_cls(d_model, max_len) if pe_cls is not None else None
        configs = self._layer_configs(
            num_layers, attention, score, score_params, mask, d_v, pos_encoding, rope, attention_options
        )
        self.canon = canon_points(canon)
        if "B" in self.canon:  # Canon-B is each layer's short convolution with a residual: recorded in its config
            configs = [with_canon_b(c, canon_width, f"layer {n}'s attention") for n, c in enumerate(configs, 1)]
        self.attention_configs = configs
        self.layers = nn.ModuleList(
            EncoderLayer(
                d_model, num_heads, d_k, None, d_ff, dropout, norm_first, bias=bias, attention=c, layer=n,
                canon=self.canon or None, canon_width=canon_width,
            )
            for n, c in enumerate(configs, start=1)
        )  # fmt: skip
        self.norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()
        self.dropout = float(dropout)
        self._padding = Padding(pad_id)
        self._structural: dict[str, Mask] = {}  # one structural mask per distinct spec, shared by its layers
        self._layer_mask: list[str] = []
        for c in configs:
            key = repr(c.mask)
            if key not in self._structural:
                self._structural[key] = build_mask("none") if c.mask is None else build_mask(c.mask)
            self._layer_mask.append(key)
        # a causal structural mask (AND key padding) keeps its parts, for the O(L) backends: found once, here
        self._causal_parts = {key: _causal_and_padding(m) for key, m in self._structural.items()}
        structural = self._structural[self._layer_mask[0]]
        self.mask = structural if pad_id is None else structural & self._padding  # layer 1's full mask

    @staticmethod
    def _layer_configs(
        num_layers: int,
        attention: AttentionLike | Sequence[AttentionLike] | None,
        score: str | None,
        score_params: dict[str, Any] | None,
        mask: Any,
        d_v: int | None,
        pos_encoding: str,
        rope: Mapping[str, Any] | None,
        options: dict[str, Any],
    ) -> list[AttentionConfig]:
        if attention is None:
            base = AttentionConfig(
                score="scaled_dot" if score is None else score,
                score_params=dict(score_params or {}),
                mask=mask,
                d_v=d_v,
                rope=dict(rope or {}) if pos_encoding == "rope" else None,
                **options,
            )
            return [base] * num_layers
        if score is not None or score_params or mask is not None or options or rope is not None:
            raise ValueError("give attention= (AttentionConfig, or one per layer) or the attention options, not both")
        if isinstance(attention, AttentionConfig | Mapping):
            configs = [as_attention_config(attention)] * num_layers
        else:
            configs = [as_attention_config(c) for c in attention]
        if len(configs) != num_layers:
            raise ValueError(f"attention lists {len(configs)} layer configs, but num_layers is {num_layers}")
        if d_v is not None:
            configs = [c.replace(d_v=d_v) for c in configs]
        return configs

    def build_mask(self, tokens: Tensor, lengths: Tensor | None = None) -> PreparedMask | None:
        """The prepared (B or 1, 1, L or 1, L) mask of layer 1 for a batch (:meth:`build_masks` gives every
        layer's)."""
        return self.build_masks(tokens, lengths)[0]

    def build_masks(self, tokens: Tensor, lengths: Tensor | None = None) -> list[PreparedMask | None]:
        """Each layer's prepared mask for a batch, computed once per distinct structural mask.

        A structural mask is prepared once per length and device (position-only masks are cached); per batch only
        the key padding (B, 1, 1, L) is computed, and combined with it when the structural mask is not trivial."""
        L, device = tokens.shape[1], tokens.device
        prepared: dict[str, PreparedMask | None] = {}
        padding = None
        if self.pad_id is not None or lengths is not None:
            padding = self._padding.dense(L, L, device, tokens=tokens, lengths=lengths)  # (B, 1, 1, L)
        for key, structural in self._structural.items():
            parts = self._causal_parts[key]
            if parts is not None:  # causal (AND key padding): prepared with its parts, for the O(L) backends
                causal, paddings = parts
                keys = padding
                for part in paddings:
                    dense = part.dense(L, L, device, tokens=tokens, lengths=lengths)  # (B, 1, 1, L)
                    keys = dense if keys is None else keys & dense
                alone = causal.prepare(L, L, device)
                prepared[key] = alone if keys is None else alone.with_key_padding(keys)
            elif padding is None:
                prepared[key] = prepare_mask(structural, L, L, device, tokens=tokens)
            elif structural.is_trivial:
                prepared[key] = prepare_mask(padding, L, L, device)
            else:
                allowed = padding & structural.dense(L, L, device, tokens=tokens, lengths=lengths)  # (B, 1, L, L)
                prepared[key] = prepare_mask(allowed, L, L, device)
        return [prepared[key] for key in self._layer_mask]

    def forward(
        self,
        tokens: Tensor,
        lengths: Tensor | None = None,
        need_weights: bool = False,
        return_attention: bool | None = None,
    ) -> Tensor | tuple[Tensor, list[AttentionOutput]]:
        """tokens (B, L) long, lengths (B,) or None → h (B, L, d_model); with ``need_weights`` also the per-layer
        AttentionOutput (weights (B, H, L, L) and logits), computed on the eager path. ``return_attention`` is the
        deprecated former name of ``need_weights``."""
        need_weights = _renamed(need_weights, return_attention, "return_attention")
        h = self.embed(tokens)  # (B, L, d_model)
        if self.pos is not None:
            h = h + self.pos(tokens.shape[1])
        h = _dropout(h, self.dropout if self.training else 0.0)
        masks = self.build_masks(tokens, lengths)
        records: list[AttentionOutput] = []
        for layer, mask in zip(self.layers, masks, strict=True):
            h, record = layer(h, mask, need_weights=need_weights)
            if record is not None:
                records.append(record)
        h = self.norm(h)
        return (h, records) if need_weights else h
