"""Decoding one token at a time: the recurrent forms' state update against softmax attention's key/value cache.

A causal :class:`~attnlab.encoder.Encoder` (every layer's mask causal, or a causal sliding window) can be run token by
token: :func:`init_cache` makes an empty cache for a batch, :func:`encoder_step` feeds one token per sequence and
returns its hidden state, and :func:`decode` runs a whole sequence so (the check that the token-by-token form gives
what the parallel forward gives). Each layer keeps what its form needs (:meth:`~attnlab.forms.Form.step`; the
layer's projection is the same as in its forward pass, :meth:`~attnlab.attention.MultiHeadAttention.step`):

=========================================  =====================================================  ============
layer                                      cache                                                  memory
=========================================  =====================================================  ============
decay and delta-rule forms (every form     the state M (B, H, d_k, d_v), updated per token         constant
tagged decay or delta)                     (:func:`~attnlab.transition.step`)
linear attention (``linear``, rowsum or    [S z] (B, H, d_φ, d_v + 1)                             constant
none)                                      (:class:`~attnlab.forms.linear.LinearForm`)
softmax (any normalizer) on any score      k (B, Gk, t, d_k) and v (B, G, t, d_v) of every token  grows with t
without a position bias                    so far (preallocated, doubled when full); a causal
                                           window reads the keys of its window
=========================================  =====================================================  ============

plus, with ``short_conv=k``, the last k − 1 projections of q, k and v, and with Canon layers (``canon``), the last
k − 1 inputs of each. Refused in one line: a position bias or a
score with a value term (their per-query tables), differential attention, positional feature maps (cosformer),
and a mask that is not causal (or a causal window); so are tokens of another shape than (B,) per step or (B, L) per
sequence, a cache fed another batch size than it holds, a cache made by a layer of another form or size (another
encoder's), and a cache whose tensors are of another dtype or on another device than the encoder's. Decoding runs
without gradients' bookkeeping where you call it under ``torch.no_grad()``; nothing here changes the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnlab.attention import MultiHeadAttention

__all__ = ["LayerCache", "decode", "decode_reason", "encoder_step", "init_cache", "layer_step"]


@dataclass
class LayerCache:
    """One layer's decoding cache (:meth:`~attnlab.attention.MultiHeadAttention.step`)."""

    state: Any = None  # the form's state: M, [S z], or a KVCache (attnlab.forms.softmax)
    length: int = 0  # tokens seen
    conv: list[Tensor] = field(default_factory=list)  # the last k − 1 projections of q, k, v (B, k − 1, channels)
    batch_size: int | None = None  # the sequences it holds (B), from its first token on
    block: dict[str, Tensor] = field(default_factory=dict)  # the Canon layers' last k − 1 inputs (A, C, D)
    form: str | None = None  # the layer that filled it (:func:`_layer_kind`), from its first token on

    def tensors(self) -> list[Tensor]:
        """Every tensor this cache holds: the form's state (a tensor, a tuple of them, or an object of tensors such
        as a key/value cache), the short convolution's and the Canon layers' buffers."""
        state = self.state
        if isinstance(state, Tensor):
            found = [state]
        elif isinstance(state, tuple | list):
            found = [t for t in state if isinstance(t, Tensor)]
        elif state is not None and hasattr(state, "__dict__"):
            found = [t for t in vars(state).values() if isinstance(t, Tensor)]
        else:
            found = []
        return [*found, *(t for t in self.conv if t is not None), *self.block.values()]

    def nbytes(self) -> int:
        """Bytes this cache holds now (a key/value cache counts the tokens seen, not its spare capacity)."""
        state = self.state
        total = state.nbytes() if hasattr(state, "nbytes") and not isinstance(state, Tensor) else 0
        tensors = list(state) if isinstance(state, tuple) else [state] if isinstance(state, Tensor) else []
        for t in [*tensors, *self.conv, *self.block.values()]:
            if t is not None:
                total += t.numel() * t.element_size()
        return total


def decode_reason(attn: MultiHeadAttention) -> str | None:
    """None when :meth:`~attnlab.attention.MultiHeadAttention.step` can decode ``attn`` one token at a time, else
    why not (one line): the form's :meth:`~attnlab.forms.Form.decode_reason`."""
    return attn.form.decode_reason()


def layer_step(attn: MultiHeadAttention, x: Tensor, cache: LayerCache) -> Tensor:
    """One token through one attention layer: x (B, 1, d_model) → out (B, 1, d_model); ``cache`` is updated
    (:meth:`~attnlab.attention.MultiHeadAttention.step`)."""
    return attn.step(x, cache)


def init_cache(encoder: Any) -> list[LayerCache]:
    """An empty cache for each layer of ``encoder``, after checking that every layer decodes (one line if not)."""
    for n, layer in enumerate(encoder.layers, start=1):
        reason = decode_reason(layer.self_attn)
        if reason is not None:
            raise ValueError(f"layer {n} cannot decode one token at a time: {reason}")
    return [LayerCache() for _ in encoder.layers]


def _layer_kind(attn: MultiHeadAttention) -> str:
    """What a layer's cache is made for, as a message names it: its form and sizes (``softmax, 2 heads, d_k 8,
    d_v 8``)."""
    form = attn.form
    name = getattr(form, "name", "") or type(form).__name__
    return f"{name}, {attn.num_heads} heads, d_k {attn.d_k}, d_v {attn.d_v}"


def _reference(encoder: Any) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device the encoder computes in (its embedding's, else its first parameter's)."""
    weight = getattr(getattr(encoder, "embed", None), "weight", None)
    if not isinstance(weight, Tensor):
        weight = next(iter(encoder.parameters()), None)
    return (weight.dtype, weight.device) if isinstance(weight, Tensor) else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_cache(encoder: Any, cache: list[LayerCache]) -> None:
    """Each layer's cache is a :class:`LayerCache` filled (if at all) by a layer of this layer's form and sizes, its
    tensors of the encoder's dtype (or autocast's) and on its device: else one line (ValueError) naming the layer
    and the mismatch. Nothing is changed."""
    reference = _reference(encoder)
    for n, (layer, layer_cache) in enumerate(zip(encoder.layers, cache, strict=True), start=1):
        if not isinstance(layer_cache, LayerCache):
            raise ValueError(
                f"encoder_step needs the cache of this encoder (from init_cache(encoder)), got "
                f"{type(layer_cache).__name__} for layer {n} instead of a LayerCache"
            )
        kind = _layer_kind(layer.self_attn)
        if layer_cache.form is not None and layer_cache.form != kind:
            raise ValueError(
                f"the cache of layer {n} was filled by another form ({layer_cache.form}), but layer {n} of this "
                f"encoder is {kind}: decode with the encoder the cache was made for, or start a cache with "
                "init_cache(encoder)"
            )
        if reference is None:
            continue
        dtype, device = reference
        allowed = {dtype}
        if torch.is_autocast_enabled(device.type):  # (autocast computes the projections in its own dtype)
            allowed.add(torch.get_autocast_dtype(device.type))
        for t in layer_cache.tensors():
            if t.device != device:
                raise ValueError(
                    f"the cache of layer {n} is on {t.device}, but the encoder is on {device}: move the cache with "
                    "the encoder, or start a cache with init_cache(encoder) after moving it"
                )
            if t.dtype.is_floating_point and t.dtype not in allowed:
                raise ValueError(
                    f"the cache of layer {n} holds {_name(t.dtype)} tensors, but the encoder computes in "
                    f"{_name(dtype)}: start a cache with init_cache(encoder) after changing its dtype (or convert "
                    "the cache)"
                )


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

    Refused in one line (ValueError), the cache unchanged: tokens that are not (B,) integer ids, a cache of another
    encoder (another number of layers, or a layer of another form or size), a cache that holds another batch size
    than ``tokens``, and a cache whose tensors are of another dtype or on another device than the encoder's."""
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
    _check_cache(encoder, cache)
    for layer, layer_cache in zip(encoder.layers, cache, strict=True):
        layer_cache.batch_size = batch
        layer_cache.form = _layer_kind(layer.self_attn)
    position = cache[0].length
    h = encoder.embed(tokens.unsqueeze(1))  # (B, 1, d_model)
    if encoder.pos is not None:
        h = h + encoder.pos(position + 1)[position:]
    for layer, layer_cache in zip(encoder.layers, cache, strict=True):
        h = layer.block(h, lambda u, attn=layer.self_attn, c=layer_cache: attn.step(u, c), cache=layer_cache)
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
