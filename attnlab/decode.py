"""Decoding one token at a time: the recurrent forms' state update against softmax attention's key/value cache.

A causal :class:`~attnlab.encoder.Encoder` (every layer's mask causal, or a causal sliding window) can be run token by
token: :func:`init_cache` makes an empty cache for a batch, :func:`encoder_step` feeds one token per sequence and
returns its hidden state, and :func:`decode` runs a whole sequence so (the check that the token-by-token form gives
what the parallel forward gives). Each layer keeps what its form needs:

=========================================  =====================================================  ============
layer                                      cache                                                  memory
=========================================  =====================================================  ============
decay and delta-rule forms (retnet, gla,   the state M (B, H, d_k, d_v), updated per token         constant
deltanet, gated_deltanet)                  (:func:`~attnlab.recurrences.state_step`)
linear attention (``linear``, rowsum or    S (B, H, d_φ, d_v) and z (B, H, d_φ)                   constant
none)                                      (:func:`~attnlab.backends.linear.recurrent_step`)
softmax (any normalizer) on any score      k (B, Gk, t, d_k) and v (B, G, t, d_v) of every token  grows with t
without a position bias                    so far (preallocated, doubled when full); a causal
                                           window reads the keys of its window
=========================================  =====================================================  ============

plus, with ``short_conv=k``, the last k − 1 projections of q, k and v. Refused in one line: a position bias or a
score with a value term (their per-query tables), differential attention, positional feature maps (cosformer),
and a mask that is not causal (or a causal window); so are tokens of another shape than (B,) per step or (B, L) per
sequence, and a cache fed another batch size than it holds. Decoding runs without gradients' bookkeeping where you
call it under ``torch.no_grad()``; nothing here changes the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnlab.attention import MultiHeadAttention
from attnlab.backends.linear import recurrent_step
from attnlab.masks import PreparedMask, build_mask, hides_later_keys
from attnlab.recurrences import state_step

__all__ = ["LayerCache", "decode", "decode_reason", "encoder_step", "init_cache", "layer_step"]


@dataclass
class LayerCache:
    """One layer's decoding cache (:func:`layer_step`)."""

    state: Any = None  # M, or (S, z) for linear attention
    k: Tensor | None = None  # (B, Gk, capacity, d_k)
    v: Tensor | None = None  # (B, G, capacity, d_v)
    length: int = 0  # tokens seen
    conv: list[Tensor] = field(default_factory=list)  # the last k − 1 projections of q, k, v (B, k − 1, channels)
    batch_size: int | None = None  # the sequences it holds (B), from its first token on

    def nbytes(self) -> int:
        """Bytes this cache holds now (a key/value cache counts the tokens seen, not its spare capacity)."""
        total = 0
        tensors = list(self.state) if isinstance(self.state, tuple) else [self.state]
        for t in [*tensors, *self.conv]:
            if t is not None:
                total += t.numel() * t.element_size()
        for t in (self.k, self.v):
            if t is not None:
                total += t[:, :, : self.length].numel() * t.element_size()
        return total


def decode_reason(attn: MultiHeadAttention) -> str | None:
    """None when :func:`layer_step` can decode ``attn`` one token at a time, else why not (one line)."""
    if attn.is_recurrent:
        return None
    if attn.differential:
        return "differential attention has no token-by-token form here"
    if attn.position_bias is not None or getattr(attn.score, "has_value_term", False):
        return f"a position bias ({attn.config.position_bias or attn.config.score}) has no token-by-token form here"
    if attn.is_linear and getattr(attn.score.feature_map, "positional", False):
        return f"the {attn.score.feature_map_name} feature map reads the sequence length"
    mask = None if attn.config.mask is None else build_mask(attn.config.mask)
    if mask is None or not mask.position_only or not hides_later_keys(mask):
        return "only a causal layer (mask=causal, or a causal window) decodes one token at a time"
    return None


def _conv_step(conv: Any, buffer: Tensor | None, x: Tensor) -> tuple[Tensor, Tensor]:
    """A short convolution on one new projection x (B, 1, C), given the last k − 1 (B, k − 1, C) → (y, buffer)."""
    if buffer is None:
        buffer = x.new_zeros(x.shape[0], conv.width - 1, x.shape[-1])
    window = torch.cat([buffer, x], dim=1)  # (B, k, C)
    y = torch.einsum("bkc,ck->bc", window, conv.conv.weight[:, 0]).unsqueeze(1)
    return y, window[:, 1:]


def layer_step(attn: MultiHeadAttention, x: Tensor, cache: LayerCache) -> Tensor:
    """One token through one attention layer: x (B, 1, d_model) → out (B, 1, d_model); ``cache`` is updated."""
    B = x.shape[0]
    t = cache.length
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)  # (B, 1, channels)
    if attn.short_conv is not None:
        buffers = cache.conv or [None, None, None]
        (q, bq), (k, bk), (v, bv) = (
            _conv_step(c, b, p)
            for c, b, p in zip((attn.q_conv, attn.k_conv, attn.v_conv), buffers, (q, k, v), strict=True)
        )
        cache.conv = [bq, bk, bv]
    q = q.view(B, 1, attn.query_heads, attn.d_k).transpose(1, 2)  # (B, Hq, 1, d_k)
    k = k.view(B, 1, attn.key_heads, attn.d_k).transpose(1, 2)
    v = v.view(B, 1, attn.num_kv_heads, attn.d_v).transpose(1, 2)
    q, k = attn.transform_qk(q, k, offset=t)
    if attn.is_recurrent:
        q, k, log_alpha, beta = attn.score.inputs(q, attn.expand_heads(k, attn.num_heads), x)
        la = None if log_alpha is None else log_alpha[:, :, 0]
        b = None if beta is None else beta[:, :, 0]
        v = attn.expand_heads(v, attn.num_heads)
        z, cache.state = state_step(cache.state, q[:, :, 0], k[:, :, 0], v[:, :, 0], la, b)
        z = z.unsqueeze(2)  # (B, H, 1, d_v)
    elif attn.is_linear:
        phi_q, phi_k = attn.score.features(q, attn.expand_heads(k, attn.query_heads))
        v = attn.expand_heads(v, attn.num_heads)
        z, cache.state = recurrent_step(
            cache.state,
            phi_q[:, :, 0],
            phi_k[:, :, 0],
            v[:, :, 0],
            attn.normalizer.normalize_rows,
            float(attn.normalizer.eps),
        )
        z = z.unsqueeze(2)
    else:
        if cache.k is None or t == cache.k.shape[2]:  # grow the preallocated cache (doubling)
            capacity = max(16, 2 * t)
            grown_k = k.new_zeros(B, attn.key_heads, capacity, attn.d_k)
            grown_v = v.new_zeros(B, attn.num_kv_heads, capacity, attn.d_v)
            if cache.k is not None:
                grown_k[:, :, :t], grown_v[:, :, :t] = cache.k[:, :, :t], cache.v[:, :, :t]
            cache.k, cache.v = grown_k, grown_v
        cache.k[:, :, t : t + 1] = k
        cache.v[:, :, t : t + 1] = v
        keys, values = cache.k[:, :, : t + 1], cache.v[:, :, : t + 1]
        mask = build_mask(attn.config.mask)
        row = torch.as_tensor(
            mask.mask_mod(torch.tensor([[t]], device=x.device), torch.arange(t + 1, device=x.device)[None], None, None)
        )  # (1, t + 1): the keys this query sees
        logits = attn.logits(q, keys)  # (B, Hq, 1, t + 1)
        weights = attn.normalize(logits, PreparedMask.from_tensor(row.view(1, 1, 1, t + 1)), values.dtype)
        z = attn.mix_values(weights, values)  # (B, H, 1, d_v)
    cache.length = t + 1
    return attn.merge(z)


def init_cache(encoder: Any) -> list[LayerCache]:
    """An empty cache for each layer of ``encoder``, after checking that every layer decodes (one line if not)."""
    for n, layer in enumerate(encoder.layers, start=1):
        reason = decode_reason(layer.self_attn)
        if reason is not None:
            raise ValueError(f"layer {n} cannot decode one token at a time: {reason}")
    return [LayerCache() for _ in encoder.layers]


def _check_tokens(tokens: Any, dims: int, shape: str, what: str) -> None:
    """``tokens`` an integer tensor of ``dims`` dimensions (``shape``), else one line naming what was expected."""
    if not isinstance(tokens, Tensor):
        raise ValueError(f"{what} takes tokens as a tensor {shape} of token ids, got {type(tokens).__name__}")
    if tokens.dim() != dims:
        other = (
            "; for a whole sequence (B, L) use decode(encoder, tokens)"
            if dims == 1 and tokens.dim() == 2
            else "; for one token per sequence use encoder_step(encoder, tokens[:, i], cache)"
            if dims == 2 and tokens.dim() == 1
            else ""
        )
        raise ValueError(f"{what} takes tokens {shape}, got shape {tuple(tokens.shape)}{other}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        dtype = str(tokens.dtype).removeprefix("torch.")
        raise ValueError(f"{what} takes integer token ids {shape}, got dtype {dtype}")


def encoder_step(encoder: Any, tokens: Tensor, cache: list[LayerCache]) -> Tensor:
    """One token per sequence through the whole encoder: tokens (B,) long at position ``cache[0].length`` →
    h (B, d_model) (after the final norm), with ``cache`` updated. Dropout is off (use ``encoder.eval()``).

    Refused in one line (ValueError): tokens that are not (B,) integer ids, a cache of another encoder (another
    number of layers), and a cache that holds another batch size than ``tokens``."""
    _check_tokens(tokens, 1, "(B,), one per sequence", "encoder_step")
    if not isinstance(cache, list | tuple) or len(cache) != len(encoder.layers):
        held = f"a cache of {len(cache)} layer(s)" if isinstance(cache, list | tuple) else type(cache).__name__
        raise ValueError(
            f"encoder_step needs the cache of this encoder ({len(encoder.layers)} layers, from init_cache(encoder)), "
            f"got {held}"
        )
    batch = int(tokens.shape[0])
    held = cache[0].batch_size
    if held is not None and held != batch:
        raise ValueError(
            f"the cache holds {held} sequences (batch size {held}, {cache[0].length} token(s) each), but tokens "
            f"has {batch}: feed tokens of shape ({held},), or start a cache for {batch} with init_cache(encoder)"
        )
    for layer_cache in cache:
        layer_cache.batch_size = batch
    position = cache[0].length
    h = encoder.embed(tokens.unsqueeze(1))  # (B, 1, d_model)
    if encoder.pos is not None:
        h = h + encoder.pos(position + 1)[position:]
    for layer, layer_cache in zip(encoder.layers, cache, strict=True):
        if layer.norm_first:
            h = h + layer_step(layer.self_attn, layer.norm1(h), layer_cache)
            h = h + layer.ff(layer.norm2(h))
        else:
            h = layer.norm1(h + layer_step(layer.self_attn, h, layer_cache))
            h = layer.norm2(h + layer.ff(h))
    return encoder.norm(h)[:, 0]


def decode(encoder: Any, tokens: Tensor) -> Tensor:
    """Every token of ``tokens`` (B, L) one at a time (:func:`encoder_step`) → h (B, L, d_model): what
    ``encoder(tokens)`` gives for a causal encoder, computed in the token-by-token form; an empty sequence (L = 0)
    gives (B, 0, d_model), as the forward does. Tokens that are not (B, L) integer ids: one line (ValueError)."""
    _check_tokens(tokens, 2, "(B, L)", "decode")
    cache = init_cache(encoder)
    if tokens.shape[1] == 0:
        return encoder.norm(encoder.embed(tokens))  # (B, 0, d_model), in the encoder's dtype and device
    return torch.stack([encoder_step(encoder, tokens[:, i], cache) for i in range(tokens.shape[1])], dim=1)
