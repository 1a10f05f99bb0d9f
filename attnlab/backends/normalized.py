"""The ``normalized`` backend: dot-product attention with soft-capping or a normalizer other than softmax, in one
autograd function whose normalizer is a row operation (:class:`~attnlab.kernels.rows.RowOp`):

    z = N(cap(scale · q kᵀ + bias)) v,    cap(e) = c · tanh(e / c)  (when ``softcap=c``)

The logits are built in one (B, H, Lq, Lk) buffer (q pre-multiplied by the scale, the bias added in place), the
row operation turns them into the weights in place, and z = W v; the backward pass keeps q, k, v, the weights and
the row operation's state (the softmax's row log-sum-exp (B, H, Lq)), and computes dV = Wᵀ dZ, dW = dZ vᵀ, the row
operation's backward in place (→ dS), dq = scale · dS k, dk = scale · dSᵀ q and the bias's gradient (dS summed over
the dimensions it broadcasts along). Autograd through the eager stages keeps a (B, H, Lq, Lk) tensor at each of
c·tanh(e/c), the masked logits and the weights, and torch's CPU softmax costs about 3–4 ns an element here.

* softmax (``normalizer.is_softmax``), soft-capped: :class:`~attnlab.kernels.softmax.SoftcapSoftmax`, attnlab's C
  row kernel, which applies the cap itself (its derivative is recovered from the weights and the row's lse).
  Plain softmax without a cap is refused: ``relative``, ``biased_softmax`` and ``sdpa`` compute it.
* any other normalizer that offers a row operation (``normalizer.row_op()`` → a RowOp, or None when it cannot:
  sparsemax, entmax15, softpick): the row operation; with a soft-cap, the cap is applied here with torch ops before
  it (t = tanh(e / c) kept for the backward pass: dE = dS ⊙ (1 − t²)). A normalizer without one is refused.

The mask goes to the row operation as ``allowed`` (masked keys exactly 0, a row that sees no key all 0), never as
−inf in the logits (the cap would turn −inf into −c). Grouped heads are expanded; differential attention runs both
maps in one call and combines them after (as ``sdpa`` does). Refused: other scores, value-side terms (Shaw's a^V),
dropout on the weights in training, devices but the CPU, dtypes but float32/64. It runs with gradients off too (a
forward pass still writes fewer (B, H, Lq, Lk) tensors than the eager stages). Under ``torch.compile`` the
softmax runs as the ``attnlab::softcap_softmax`` operator between torch's matrix products, and another row operation
falls back to ``eager``. Under CPU autocast (bfloat16) the call's compute dtype is bfloat16
(:func:`~attnlab.backends.compute_dtype`), which the kernels lack: ``auto`` takes ``eager`` (whose normalizer runs
in float32) and a forced ``normalized`` raises its one line.
"""

from __future__ import annotations

from typing import Any

import torch

from attnlab.backends.base import (
    Conditions,
    LayerSpec,
    build_backend,
    compute_dtype,
    dtype_reason,
    register_backend,
    spec_of,
)
from attnlab.backends.rowwise import POOL, BufferPool, NormalizedAttention
from attnlab.backends.sdpa import SOFTMAX_STAGES, FusedSoftmax, visible_rows
from attnlab.forms import FormInputs, FormOutput, expand_heads
from attnlab.kernels import softmax as softmax_kernel
from attnlab.kernels.rows import RowOp
from attnlab.scores import DotProductScore

__all__ = ["POOL", "BufferPool", "NormalizedAttention", "row_op_of"]


def row_op_of(form: Any) -> tuple[RowOp | None, float | None]:
    """The row operation that computes the softmax form's normalizer (with its soft-cap, for the softmax) and the cap
    that is left to apply before it (None when the row operation applies it or there is none); (None, None) when
    the normalizer offers none here."""
    form = getattr(form, "form", form)
    normalizer = form.normalizer
    if getattr(normalizer, "is_softmax", False):
        return softmax_kernel.SoftcapSoftmax(form.softcap), None
    make = getattr(normalizer, "row_op", None)
    op = make() if callable(make) else None
    return (op, form.softcap) if op is not None else (None, None)


@register_backend("normalized")
class Normalized(FusedSoftmax):
    """Soft-capped softmax (attnlab's C row kernel) or a normalizer with a row operation, in one autograd function
    (see the module's docstring)."""

    computes = SOFTMAX_STAGES | {"softcap"}

    def config_reason(self, layer: Any) -> str | None:
        spec = spec_of(layer)
        reason = super().config_reason(spec)
        if reason is not None:
            return reason
        form = spec.form
        if getattr(form.normalizer, "is_softmax", False):
            if form.softcap is None:
                return "it is for soft-capping or a normalizer other than softmax (sdpa computes plain softmax)"
            return None
        if row_op_of(form)[0] is None:
            return f"normalizer={spec.config.normalizer} has no row operation here (row_op)"
        return None

    def call_reason(self, layer: Any, when: Conditions) -> str | None:
        spec = spec_of(layer)
        if when.device != "cpu":
            return f"it runs on the CPU only, not {when.device}"
        reason = dtype_reason(when)  # (under CPU autocast the logits are bfloat16: auto takes eager)
        if reason is not None:
            return reason
        if when.training and spec.dropout > 0:
            return "it applies no dropout to the weights"
        if getattr(spec.form.normalizer, "is_softmax", False) and not softmax_kernel.available():
            return f"the softmax kernel could not be built here: {softmax_kernel.unavailable_reason()}"
        return None

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        form = spec.form
        q, k, v, pm = inputs.q, inputs.k, inputs.v, inputs.mask
        row_op, cap = row_op_of(form)
        compiling = torch.compiler.is_compiling()
        # (called directly, not through choose_backend: a compute dtype the kernels lack goes to eager too)
        fallback = row_op is None or compute_dtype(q.dtype, q.device) not in (torch.float32, torch.float64)
        if fallback or (compiling and not isinstance(row_op, softmax_kernel.SoftcapSoftmax)):
            return build_backend("eager").compute(spec, inputs, dropout)
        if form.differential:
            v = v.repeat(1, 2, 1, 1)  # (B, 2G, Lk, d_v): both maps of a head read the same values
        score: DotProductScore = form.score
        bias, _ = form.position_logits(q, k.shape[2])
        q, k = score.query_map(q), score.key_map(k)
        heads = q.shape[1]
        k, v = expand_heads(k, heads), expand_heads(v, heads)
        allowed = None if pm is None else pm.allowed
        if compiling:  # torch's matrix products around the softmax operator, which the graph holds as one node
            logits = torch.matmul(q * score.scale, k.transpose(-1, -2))
            logits = logits if bias is None else logits + bias
            z = torch.matmul(softmax_kernel.softcap_softmax(logits, allowed, form.softcap), v)
        else:
            with torch.profiler.record_function("attnlab::normalized_attention"):
                z = NormalizedAttention.apply(q, k, v, bias, allowed, score.scale, row_op, cap)
        return FormOutput(visible_rows(z, pm))
