"""Transformer encoder (Vaswani et al. 2017, §3.1) on :class:`~attnlab.attention.MultiHeadAttention`.

    h_0 = Embed(tokens) + PE                                   (B, L, d_model)
    pre-LN:  h = h + Drop(MHA(LN(h)));  h = h + Drop(FFN(LN(h)))
    post-LN: h = LN(h + Drop(MHA(h)));  h = LN(h + Drop(FFN(h)))
    out = LN_final(h_N) for pre-LN (post-LN outputs are already normalised)

Positional encodings: ``sinusoidal`` (Vaswani §3.5), ``learned`` (a table of ``max_len`` vectors) or ``none``
(for relative-position scores, which carry position themselves). Token embeddings are not scaled by √d_model:
nn.Embedding starts at unit variance, the same order as the sinusoid.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.attention import AttentionOutput, MultiHeadAttention, PreparedMask, prepare_mask
from attnlab.checks import check_choice, check_int, default_d_k
from attnlab.masks import Mask, Padding, build_mask

__all__ = [
    "POSITIONAL_ENCODINGS",
    "Encoder",
    "EncoderLayer",
    "LearnedPositionalEncoding",
    "SinusoidalPositionalEncoding",
]


class SinusoidalPositionalEncoding(nn.Module):
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)); buffer ``pe`` (max_len, d)."""

    def __init__(self, d_model: int, max_len: int = 512) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float64)[:, None]
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * inv_freq)
        pe[:, 1::2] = torch.cos(pos * inv_freq)[:, : d_model // 2]
        self.register_buffer("pe", pe.float(), persistent=False)

    def forward(self, length: int) -> Tensor:
        """→ (length, d_model)."""
        if length > self.pe.shape[0]:
            raise ValueError(f"sequence length {length} exceeds the positional table's max_len {self.pe.shape[0]}")
        return self.pe[:length]


class LearnedPositionalEncoding(nn.Module):
    """A learned vector per absolute position (``weight`` (max_len, d_model), N(0, 0.02²) initialisation)."""

    def __init__(self, d_model: int, max_len: int = 512) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, length: int) -> Tensor:
        """→ (length, d_model)."""
        if length > self.weight.shape[0]:
            raise ValueError(f"sequence length {length} exceeds the positional table's max_len {self.weight.shape[0]}")
        return self.weight[:length]


POSITIONAL_ENCODINGS: dict[str, type[nn.Module] | None] = {
    "sinusoidal": SinusoidalPositionalEncoding,
    "learned": LearnedPositionalEncoding,
    "none": None,
}


def _dropout(x: Tensor, p: float) -> Tensor:
    """F.dropout, skipped entirely when p = 0."""
    return F.dropout(x, p) if p > 0.0 else x


class EncoderLayer(nn.Module):
    """One encoder block: self-attention and a position-wise FFN (d_model → d_ff → d_model, GELU), each with
    dropout and a residual, pre-LN (``norm_first=True``, default) or post-LN."""

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
    ) -> None:
        super().__init__()
        d_k = default_d_k(d_model, num_heads, d_k)
        d_ff = 4 * d_model if d_ff is None else d_ff
        self.self_attn = MultiHeadAttention(
            d_model, num_heads, d_k, d_v, score=score, bias=bias, dropout=dropout, **(score_params or {})
        )
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff, bias=bias), nn.GELU(), nn.Linear(d_ff, d_model, bias=bias))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = float(dropout)
        self.norm_first = norm_first

    def _attn(self, h: Tensor, mask: PreparedMask | None, need: bool) -> tuple[Tensor, AttentionOutput | None]:
        if need:
            o = self.self_attn.attend(h, mask=mask)
            return o.out, o
        return self.self_attn(h, mask=mask)[0], None

    def forward(
        self, x: Tensor, mask: PreparedMask | Tensor | Mask | None = None, need_attention: bool = False
    ) -> tuple[Tensor, AttentionOutput | None]:
        """x (B, L, d_model) → (x (B, L, d_model), the layer's AttentionOutput when ``need_attention``)."""
        drop = self.dropout if self.training else 0.0
        if self.norm_first:
            a, record = self._attn(self.norm1(x), mask, need_attention)
            x = x + _dropout(a, drop)
            x = x + _dropout(self.ff(self.norm2(x)), drop)
        else:
            a, record = self._attn(x, mask, need_attention)
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
        pos_encoding: ``sinusoidal``, ``learned`` or ``none``; max_len: size of the positional table.
        dropout: on attention weights, residual branches and the embedding.
        norm_first: pre-LN (default) or post-LN.
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
        self.layers = nn.ModuleList(
            EncoderLayer(d_model, num_heads, d_k, d_v, d_ff, dropout, norm_first, score, score_params, bias)
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()
        self.dropout = float(dropout)
        structural = build_mask("none") if mask is None else build_mask(mask)
        self.mask = structural if pad_id is None else structural & Padding(pad_id)
        self._structural = structural
        self._padding = Padding(pad_id)

    def build_mask(self, tokens: Tensor, lengths: Tensor | None = None) -> PreparedMask | None:
        """The prepared (B or 1, 1, L or 1, L) mask for a batch, shared by all layers.

        The structural mask is built once per length and device (position-only masks are cached); per batch only
        the key padding (B, 1, 1, L) is computed, and combined with it when the structural mask is not trivial."""
        L, device = tokens.shape[1], tokens.device
        structural = self._structural
        if self.pad_id is None and lengths is None:
            if structural.is_trivial:
                return None
            if structural.position_only:
                return prepare_mask(structural, L, L, device)  # cached, with its causal / all-visible facts
            return prepare_mask(structural.dense(L, L, device, tokens=tokens), L, L, device)
        allowed = self._padding.dense(L, L, device, tokens=tokens, lengths=lengths)  # (B, 1, 1, L)
        if not structural.is_trivial:
            allowed = allowed & structural.dense(L, L, device, tokens=tokens, lengths=lengths)  # (B, 1, L, L)
        return prepare_mask(allowed, L, L, device)

    def forward(
        self, tokens: Tensor, lengths: Tensor | None = None, return_attention: bool = False
    ) -> Tensor | tuple[Tensor, list[AttentionOutput]]:
        """tokens (B, L) long, lengths (B,) or None → h (B, L, d_model); with ``return_attention`` also the
        per-layer AttentionOutput (weights and logits (B, H, L, L)), computed on the eager path."""
        h = self.embed(tokens)  # (B, L, d_model)
        if self.pos is not None:
            h = h + self.pos(tokens.shape[1])
        h = _dropout(h, self.dropout if self.training else 0.0)
        mask = self.build_mask(tokens, lengths)
        records: list[AttentionOutput] = []
        for layer in self.layers:
            h, record = layer(h, mask, need_attention=return_attention)
            if record is not None:
                records.append(record)
        h = self.norm(h)
        return (h, records) if return_attention else h
