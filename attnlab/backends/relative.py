"""The ``relative`` backend: attnlab's fused C kernel (:mod:`attnlab.kernels.relative`) for a dot-product score
with one learned relative-position table (Shaw's a^K, T5's buckets) as its only additive term: the logits and their
gradient are never materialised as (B, H, Lq, Lk) tensors of the table's size."""

from __future__ import annotations

from typing import Any

import torch

from attnlab.backends.base import Conditions, LayerSpec, build_backend, dtype_reason, register_backend, spec_of
from attnlab.backends.sdpa import FusedSoftmax, softmax_reason, visible_rows
from attnlab.forms import FormInputs, FormOutput, expand_heads
from attnlab.kernels import relative as relative_kernel
from attnlab.position_bias import PositionBias


def _table_term(form: Any) -> Any:
    """The one additive logit term (the score's own or the position-bias stage), when there is exactly one and it
    is a table read through a relative-position index (:meth:`~attnlab.position_bias.PositionBias.table_bias`)."""
    terms = [b for b in (form.score.position_term(), form.position_bias) if b is not None]
    if len(terms) != 1 or getattr(terms[0], "table_bias", None) is None:
        return None
    return terms[0]


@register_backend("relative")
class Relative(FusedSoftmax):
    def config_reason(self, layer: Any) -> str | None:
        spec = spec_of(layer)
        reason = super().config_reason(spec) or softmax_reason(spec)
        if reason is not None:
            return reason
        term = _table_term(spec.form)
        if term is None or type(term).table_bias is PositionBias.table_bias:
            return "it needs exactly one relative-position table (position_bias=shaw or t5, or their presets)"
        if spec.form.extra_logit() is not None:
            return f"it has no sink logit (normalizer={spec.config.normalizer})"
        return None

    def call_reason(self, layer: Any, when: Conditions) -> str | None:
        if when.device != "cpu":
            return f"it runs on the CPU only, not {when.device}"
        reason = dtype_reason(when)  # (under CPU autocast q and k are bfloat16: auto takes biased_softmax)
        if reason is not None:
            return reason
        if not when.grad:
            return "it is for training (gradients on); without gradients sdpa is as fast"
        if when.training and spec_of(layer).dropout > 0:
            return "it applies no dropout to the weights"
        if not relative_kernel.available():
            return "the kernel could not be built here (no C compiler?)"
        return None

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        form = spec.form
        q, k, v, pm = inputs.q, inputs.k, inputs.v, inputs.mask
        if form.differential:
            v = v.repeat(1, 2, 1, 1)  # (B, 2G, Lk, d_v): both maps of a head read the same values
        term = _table_term(form)
        found = term.table_bias(q, k.shape[2])
        if found is None:  # a table term that declines at this shape: the same numbers through SDPA
            fallback = "biased_softmax" if torch.is_grad_enabled() else "sdpa"
            return build_backend(fallback).compute(spec, inputs, dropout)
        table, runs = found
        heads = q.shape[1]
        k, v = expand_heads(k, heads), expand_heads(v, heads)
        score = form.score
        q, k = score.query_map(q), score.key_map(k)
        z = relative_kernel.relative_attention(q, k, v, table, runs, None if pm is None else pm.hidden, score.scale)
        return FormOutput(visible_rows(z, pm))
