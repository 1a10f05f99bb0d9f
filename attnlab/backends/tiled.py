"""The ``tiled`` backend: softmax attention with a score modifier through attnlab's tiled C kernel
(:mod:`attnlab.kernels.tiled`, FlashAttention-2 on the CPU): no (B, H, Lq, Lk) tensor, forward or backward.

It computes a dot-product score (scale · φ(q) · ψ(k)ᵀ, grouped heads as they are) with

* at most one position term that offers :meth:`~attnlab.position_bias.PositionBias.offset_table` (T5, ALiBi, Shaw's
  key term; ``rope`` + ``t5`` too, rotary being part of q and k);
* soft-capping; the normalizers ``softmax``, ``softmax1``, ``sink`` (the learned sink's gradient too) and
  ``sigmoid`` (its bias, −log n by default, from the mask's structure);
* differential attention: both maps in one operator (:func:`~attnlab.kernels.tiled.tiled_differential`: a pass per
  map forward, one pass over both backward, sharing the products with the values);
* the mask as structure: no mask, causal, a position-only mask whose rows are intervals (sliding windows, causal
  windows: found once per shape), key padding, and any of these with key padding. Whole key blocks outside them
  are skipped.

A plain softmax with no mask or a causal one (no bias, no cap) is left to ``sdpa`` (PyTorch's flash kernel, the
reference the bench measures every variant against): ``tiled`` takes it only when forced. A mask it cannot read as
intervals (a per-batch mask other than key padding, a row that is not an interval) is computed by the next backend
of the automatic order that applies. Refused: other scores, Shaw's value term, dropout on the weights in training,
other devices than the CPU, dtypes other than float32/64 (CPU autocast's bfloat16 too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.backends.base import (
    ORDER,
    Conditions,
    LayerSpec,
    build_backend,
    dtype_reason,
    register_backend,
    spec_of,
)
from attnlab.backends.sdpa import SOFTMAX_STAGES, FusedSoftmax, visible_rows
from attnlab.forms import FormInputs, FormOutput
from attnlab.kernels import tiled as tiled_kernel
from attnlab.kernels.tiled import KeyRange, OffsetTable
from attnlab.masks import KeyPaddedMask, PreparedMask
from attnlab.normalizers import Sigmoid

__all__ = ["key_range", "normalizer_kind"]


def _terms(form: Any) -> list[Any]:
    return [t for t in (form.score.position_term(), form.position_bias) if t is not None]


def normalizer_kind(form: Any) -> str | None:
    """``softmax``, ``sink`` (softmax1, sink: a sink logit) or ``sigmoid``: the normalizer as the kernel computes
    it; None when it cannot."""
    normalizer = form.normalizer
    if form.extra_logit() is not None:
        return "sink"
    if getattr(normalizer, "is_softmax", False):
        return "softmax"
    if type(normalizer) is Sigmoid:
        return "sigmoid"
    return None


def _intervals(allowed: Tensor) -> tuple[Tensor, Tensor] | None:
    """(lo, hi) (Lq,) with row i's allowed keys exactly [lo_i, hi_i) for a position-only (…, Lq, Lk) mask, or None
    when a row is not an interval. A row with no key gets lo = hi = 0."""
    a = allowed.reshape(allowed.shape[-2], allowed.shape[-1]).to("cpu")
    Lk = a.shape[-1]
    count = a.sum(-1)
    j = torch.arange(Lk)
    lo = torch.where(a, j, Lk).amin(-1)
    hi = torch.where(a, j + 1, 0).amax(-1)
    if bool(((hi - lo).clamp(min=0) != count).any()):
        return None
    empty = count == 0
    return lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)


def _causal(num_queries: int, num_keys: int) -> tuple[Tensor, Tensor]:
    i = torch.arange(num_queries)
    return torch.zeros(num_queries, dtype=torch.int64), (i + 1).clamp(max=num_keys)


def key_range(pm: PreparedMask | None, num_queries: int, num_keys: int) -> KeyRange | None:
    """The prepared mask as the kernel reads it (:class:`~attnlab.kernels.tiled.KeyRange`: a key interval per query
    row and the key padding), found once per mask and shape; None when it is not of that form."""
    if pm is None:
        return KeyRange()
    keys = None if pm.keys is None else pm.keys.reshape(-1, num_keys)
    if pm.structure == "none":
        return KeyRange(keys=keys)
    if pm.structure == "causal":  # (a KeyPaddedMask's base holds the cached causal mask: the intervals once)
        base = getattr(pm, "base", pm)
        key = ("tiled_causal", num_queries, num_keys)
        lo, hi = base.derived.get_or_make(key, lambda: _causal(num_queries, num_keys))
        return KeyRange(lo, hi, keys)
    allowed = pm.allowed
    if isinstance(pm, KeyPaddedMask) or allowed.dim() < 2:
        return None
    lead = allowed.shape[:-2]
    if any(s != 1 for s in lead):  # per batch or per head: other than key padding
        return None
    found = pm.derived.get_or_make(("tiled_intervals", num_queries, num_keys), lambda: _intervals(allowed) or ())
    return KeyRange(*found) if found else None


@register_backend("tiled")
class Tiled(FusedSoftmax):
    computes = SOFTMAX_STAGES | {"softcap"}

    def config_reason(self, layer: Any) -> str | None:
        spec = spec_of(layer)
        reason = super().config_reason(spec)
        if reason is not None:
            return reason
        form = spec.form
        if normalizer_kind(form) is None:
            normalizer = spec.config.normalizer
            return f"it computes the softmax, softmax1, sink and sigmoid normalizers, not normalizer={normalizer}"
        terms = _terms(form)
        if len(terms) > 1:
            return "it takes one position term, not a score's own bias and a position bias"
        if terms and not getattr(terms[0], "has_offset_table", False):
            return f"the position bias {type(terms[0]).__name__} is not a table over offsets (offset_table)"
        return None

    def call_reason(self, layer: Any, when: Conditions) -> str | None:
        spec = spec_of(layer)
        if when.device != "cpu":
            return f"it runs on the CPU only, not {when.device}"
        reason = dtype_reason(when)
        if reason is not None:
            return reason
        if when.training and spec.dropout > 0:
            return "it applies no dropout to the weights"
        if not spec.forced and self._plain(spec) and when.mask in ("none", "causal"):
            return "a plain softmax with no mask or a causal one is sdpa's (PyTorch's flash kernel)"
        if not tiled_kernel.available():
            return "the kernel could not be built here (no C compiler?)"
        return None

    @staticmethod
    def _plain(spec: LayerSpec) -> bool:
        form = spec.form
        plain = not _terms(form) and form.softcap is None and normalizer_kind(form) == "softmax"
        return plain and not spec.config.differential

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        form = spec.form
        q, k, v, pm = inputs.q, inputs.k, inputs.v, inputs.mask
        Lq, Lk = q.shape[2], k.shape[2]
        if Lq == 0 or Lk == 0:  # nothing to tile (no offsets for a bias table either): the eager path's empty/zero z
            return build_backend("eager").compute(spec, inputs, dropout)
        keys = key_range(pm, Lq, Lk)
        if keys is None:  # a mask that is not intervals and key padding: the next backend that computes it
            return self._next(spec, inputs, dropout, q)
        score = form.score
        terms = _terms(form)
        bias: OffsetTable | None = terms[0].offset_table(q, Lk) if terms else None
        q, k = score.query_map(q), score.key_map(k)
        kind = normalizer_kind(form)
        sink = None
        if kind == "sink":
            sink = form.extra_logit().to(q.dtype).expand(q.shape[1])  # (Hq,): differential attention's 2H, a map's own
        normalizer = "sigmoid" if kind == "sigmoid" else "softmax"
        sigmoid_bias = getattr(form.normalizer, "bias", None) if kind == "sigmoid" else None

        options = dict(keys=keys, softcap=form.softcap, normalizer=normalizer, sink=sink, sigmoid_bias=sigmoid_bias)
        if not spec.config.differential:
            return FormOutput(
                visible_rows(tiled_kernel.tiled_attention(q, k, v, score.scale, bias=bias, **options), pm)
            )
        H, G = spec.num_heads, spec.num_kv_heads
        b1 = b2 = bias
        if bias is not None and bias.table.dim() >= 3 and bias.table.shape[-3] == 2 * H:
            t = bias.table
            b1 = OffsetTable(t[..., :H, :, :], bias.low, bias.high)
            b2 = OffsetTable(t[..., H:, :, :], bias.low, bias.high)
        k1, k2 = (k[:, :G], k[:, G:]) if k.shape[1] == 2 * G else (k, k)
        lam = form.differential_lambda()
        z = tiled_kernel.tiled_differential(q[:, :H], k1, q[:, H:], k2, v, lam, score.scale, b1, b2, **options)
        return FormOutput(visible_rows(z, pm))  # z₁ − λ z₂ (B, H, Lq, d_v), sub-normed by the form

    def _next(self, spec: LayerSpec, inputs: FormInputs, dropout: float, q: Tensor) -> FormOutput:
        when = Conditions(q.device.type, q.dtype, False, True, torch.is_grad_enabled(), "other")
        for name in ORDER[ORDER.index(self.name) + 1 :]:
            backend = build_backend(name)
            if backend.config_reason(spec) is None and backend.call_reason(spec, when) is None:
                return backend.compute(spec, inputs, dropout)
        return build_backend("eager").compute(spec, inputs, dropout)
