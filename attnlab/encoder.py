"""Transformer encoder (Vaswani et al. 2017, §3.1) on :class:`~attnlab.attention.MultiHeadAttention`.

    h_0 = Embed(tokens) + PE                                   (B, L, d_model)
    pre-LN:  h = h + Drop(MHA(LN(h)));  h = h + Drop(FFN(LN(h)))
    post-LN: h = LN(h + Drop(MHA(h)));  h = LN(h + Drop(FFN(h)))
    out = LN_final(h_N) for pre-LN (post-LN outputs are already normalised)

Positional encodings: ``sinusoidal`` (Vaswani §3.5), ``learned`` (a table of ``max_len`` vectors), ``rope``
(rotary positions applied to q and k in every layer, no absolute table) or ``none`` (for relative-position scores
and biases, which carry position themselves). Token embeddings are not scaled by √d_model: nn.Embedding starts at
unit variance, the same order as the sinusoid.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.attention import AttentionOutput, MultiHeadAttention
from attnlab.checks import check_choice, check_int, default_d_k
from attnlab.masks import Mask, Padding, PreparedMask, build_mask, prepare_mask
from attnlab.positions import LearnedPositionalEncoding, SinusoidalPositionalEncoding
from attnlab.scores import resolve_direction

__all__ = [
    "POSITIONAL_ENCODINGS",
    "Encoder",
    "EncoderLayer",
    "LearnedPositionalEncoding",
    "SinusoidalPositionalEncoding",
]


POSITIONAL_ENCODINGS: dict[str, type[nn.Module] | None] = {
    "sinusoidal": SinusoidalPositionalEncoding,
    "learned": LearnedPositionalEncoding,
    "rope": None,  # rotary: in the attention of every layer
    "none": None,
}


def _hides_later_keys(mask: Mask) -> bool:
    """Whether every key after the query is hidden: a causal mask, or a position-only one (causal & window) whose
    64 × 64 tensor has nothing above the diagonal. Decides T5's one-directional buckets."""
    if mask.is_causal:
        return True
    if mask.is_trivial or not mask.position_only:
        return False
    return not bool(mask.dense(64, 64)[0, 0].triu(1).any())


def _renamed(new: bool, old: bool | None, old_name: str) -> bool:
    """``need_weights``, or the value given under its former name (with a DeprecationWarning)."""
    if old is None:
        return new
    warnings.warn(f"{old_name}= is deprecated; use need_weights=", DeprecationWarning, stacklevel=3)
    return bool(old)


def _dropout(x: Tensor, p: float) -> Tensor:
    """F.dropout, skipped entirely when p = 0."""
    return F.dropout(x, p) if p > 0.0 else x


class EncoderLayer(nn.Module):
    """One encoder block: self-attention and a position-wise FFN (d_model → d_ff → d_model, GELU), each with
    dropout and a residual, pre-LN (``norm_first=True``, default) or post-LN. ``attention_options`` go to
    :class:`~attnlab.attention.MultiHeadAttention` (``num_kv_heads``, ``rope``, ``normalizer``, ``layer`` ...)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_k: int | None = None,
        d_v: int | None = None,
        d_ff: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        score: str | nn.Module = "scaled_dot",
        score_params: dict[str, Any] | None = None,
        bias: bool = True,
        **attention_options: Any,
    ) -> None:
        super().__init__()
        d_k = default_d_k(d_model, num_heads, d_k)
        d_ff = 4 * d_model if d_ff is None else d_ff
        self.self_attn = MultiHeadAttention(
            d_model,
            num_heads,
            d_k,
            d_v,
            score=score,
            bias=bias,
            dropout=dropout,
            **attention_options,
            **(score_params or {}),
        )
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff, bias=bias), nn.GELU(), nn.Linear(d_ff, d_model, bias=bias))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = float(dropout)
        self.norm_first = norm_first

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
        drop = self.dropout if self.training else 0.0
        if self.norm_first:
            a, record = self._attn(self.norm1(x), mask, need_weights)
            x = x + _dropout(a, drop)
            x = x + _dropout(self.ff(self.norm2(x)), drop)
        else:
            a, record = self._attn(x, mask, need_weights)
            x = self.norm1(x + _dropout(a, drop))
            x = self.norm2(x + _dropout(self.ff(x), drop))
        return x, record


class Encoder(nn.Module):
    """Token embedding + positional encoding + ``num_layers`` :class:`EncoderLayer` + final norm.

    Args:
        vocab_size: number of token ids.
        d_model, num_heads, num_layers: sizes.
        d_k: per-head key size (default d_model // num_heads); d_v: per-head value size (default d_k).
        d_ff: FFN width (default 4·d_model).
        score, score_params: the attention score, by registered name, and its parameters.
        mask: a structural mask (registered name, spec dict, or :class:`Mask`), applied in every layer.
        pad_id: when set, keys equal to ``pad_id`` are hidden in every layer (AND-ed with ``mask``).
        pos_encoding: ``sinusoidal``, ``learned``, ``rope`` or ``none``; max_len: size of the positional table.
        rope: :class:`~attnlab.positions.RotaryEmbedding` parameters (``base``, ``fraction``) for ``rope``.
        dropout: on attention weights, residual branches and the embedding.
        norm_first: pre-LN (default) or post-LN.
        num_kv_heads, qk_norm, softcap, normalizer, normalizer_params, position_bias, position_bias_params,
        differential: the attention stages, as in :class:`~attnlab.attention.MultiHeadAttention`; layer l (from 1)
        gets ``layer=l``.

    A score or position bias that takes ``bidirectional`` (T5's buckets) and leaves it unset gets False under a
    mask that hides every later key (causal, causal & window: T5's decoder bucketing, all buckets go to the past)
    and True otherwise.
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
        score: str = "scaled_dot",
        score_params: dict[str, Any] | None = None,
        mask: str | Mask | dict[str, Any] | None = None,
        pad_id: int | None = None,
        pos_encoding: str = "sinusoidal",
        max_len: int = 512,
        dropout: float = 0.0,
        norm_first: bool = True,
        bias: bool = True,
        *,
        rope: Mapping[str, Any] | None = None,
        num_kv_heads: int | None = None,
        qk_norm: str | None = None,
        softcap: float | None = None,
        normalizer: str = "softmax",
        normalizer_params: Mapping[str, Any] | None = None,
        position_bias: str | None = None,
        position_bias_params: Mapping[str, Any] | None = None,
        differential: bool = False,
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
        structural = build_mask("none") if mask is None else build_mask(mask)
        causal = _hides_later_keys(structural)
        attention = {
            "num_kv_heads": num_kv_heads,
            "rope": dict(rope or {}) if pos_encoding == "rope" else None,
            "qk_norm": qk_norm,
            "softcap": softcap,
            "normalizer": normalizer,
            "normalizer_params": normalizer_params,
            "position_bias": position_bias,
            "position_bias_params": resolve_direction("position bias", position_bias, position_bias_params, causal),
            "differential": differential,
        }
        score_params = resolve_direction("score", score, score_params, causal)
        self.layers = nn.ModuleList(
            EncoderLayer(
                d_model, num_heads, d_k, d_v, d_ff, dropout, norm_first, score, score_params, bias, layer=n, **attention
            )
            for n in range(1, num_layers + 1)
        )
        self.norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()
        self.dropout = float(dropout)
        self.mask = structural if pad_id is None else structural & Padding(pad_id)
        self._structural = structural
        self._padding = Padding(pad_id)

    def build_mask(self, tokens: Tensor, lengths: Tensor | None = None) -> PreparedMask | None:
        """The prepared (B or 1, 1, L or 1, L) mask for a batch, shared by all layers.

        The structural mask is prepared once per length and device (position-only masks are cached); per batch only
        the key padding (B, 1, 1, L) is computed, and combined with it when the structural mask is not trivial."""
        L, device = tokens.shape[1], tokens.device
        structural = self._structural
        if self.pad_id is None and lengths is None:
            return prepare_mask(structural, L, L, device, tokens=tokens)
        allowed = self._padding.dense(L, L, device, tokens=tokens, lengths=lengths)  # (B, 1, 1, L)
        if not structural.is_trivial:
            allowed = allowed & structural.dense(L, L, device, tokens=tokens, lengths=lengths)  # (B, 1, L, L)
        return prepare_mask(allowed, L, L, device)

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
        mask = self.build_mask(tokens, lengths)
        records: list[AttentionOutput] = []
        for layer in self.layers:
            h, record = layer(h, mask, need_weights=need_weights)
            if record is not None:
                records.append(record)
        h = self.norm(h)
        return (h, records) if need_weights else h
