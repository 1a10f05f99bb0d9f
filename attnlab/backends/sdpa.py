"""The ``sdpa`` and ``biased_softmax`` backends: dot-product attention through one fused call.

Both compute a layer whose stages SDPA computes exactly: a dot-product score (:class:`~attnlab.scores.DotProductScore`,
scale · φ(q) · ψ(k)ᵀ) without value term, a position bias without value term, the softmax (or a softmax with a sink
logit: one more key), no soft-capping. q and k go through their transforms (QK-norm, rotary), then the position bias
and the mask are folded into one additive float mask (or ``is_causal=True``, or a bool mask when there is no bias),
grouped heads go through ``enable_gqa``, and differential attention runs one call per map (both read the same v):
(w₁ − λ w₂) v = w₁ v − λ w₂ v.

``sdpa`` calls ``torch.nn.functional.scaled_dot_product_attention``. ``biased_softmax`` is for a learned bias on
the CPU, whose gradient SDPA can only compute with its math kernel (which keeps more for the backward pass than it
needs and scans every row for −inf): :class:`BiasedSoftmaxAttention` computes the same values in fewer passes.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attnlab.backends.base import Backend, Conditions, LayerSpec, register_backend, spec_of
from attnlab.backends.rowwise import NormalizedAttention
from attnlab.forms import FormInputs, FormOutput, expand_heads
from attnlab.forms.softmax import selection_penalty
from attnlab.kernels import select as select_kernel
from attnlab.kernels import softmax as softmax_kernel
from attnlab.kernels.denormals import flush_denormals
from attnlab.masks import PreparedMask
from attnlab.scores import DotProductScore

__all__ = [
    "SOFTMAX_STAGES",
    "BiasedSoftmaxAttention",
    "FusedSoftmax",
    "scaled_dot_product_attention",
    "softmax_reason",
    "visible_rows",
]


SOFTMAX_STAGES = frozenset({"form:softmax", "score:dot", "position_bias", "differential"})
"""What the fused dot-product backends compute: a dot-product score, an additive position bias, differential maps.
``sdpa`` and ``biased_softmax`` also compute selective attention's penalty (a (B, 1, Lq, Lk) bias from head 0's
logits), and ``sdpa`` forgetting attention."""


class FusedSoftmax(Backend):
    """Shared by the fused backends of the softmax form: what they refuse of another form."""

    computes = SOFTMAX_STAGES

    def form_reason(self, spec: LayerSpec) -> str:
        return f"it computes dot-product scores only, not {spec.config.score}"


def softmax_reason(spec: LayerSpec) -> str | None:
    """None when the softmax form's normalizer is the softmax (or a softmax with a sink logit), else why not."""
    form = spec.form
    if not getattr(form.normalizer, "is_softmax", False) and form.extra_logit() is None:
        return f"it computes the softmax only, not normalizer={spec.config.normalizer}"
    return None


def _learned_bias(form: Any) -> bool:
    """Whether the additive logit terms are learned (they need their gradient): any term but a static one (ALiBi),
    or selective attention's penalty (from head 0's logits)."""
    if getattr(form, "selective", False):
        return True
    terms = [(form.score, form.score.static_bias)] if form.score.position_term() is not None else []
    if form.position_bias is not None:
        terms.append((form.position_bias, form.position_bias.static_bias))
    return any(not static for _, static in terms)


def visible_rows(z: Tensor, pm: PreparedMask | None) -> Tensor:
    """z (B, Hq, Lq, d_v) of a fused call with the rows that see no key zeroed (the eager path's 0, never NaN)."""
    if pm is not None and not pm.all_visible:
        z = z * pm.visible  # rows with no visible key: zero output
    return z


def _halves(t: Tensor | None, heads: int) -> tuple[Tensor | None, Tensor | None]:
    """A (…, 2·heads, Lq, Lk) tensor (component-major, as q) → its two maps' halves; one broadcast over the heads
    (…, 1, Lq, Lk), or None, serves both."""
    if t is None or t.dim() < 3 or t.shape[-3] != 2 * heads:
        return t, t
    return t[..., :heads, :, :], t[..., heads:, :, :]


def _row_kernel_applies(q: Tensor, spec: LayerSpec) -> bool:
    """Whether the C softmax row kernel (:class:`~attnlab.backends.rowwise.NormalizedAttention`) can compute this
    call: one map (no differential attention), float32/64 on the CPU, eager, the kernel built."""
    return (
        not spec.config.differential
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
        and softmax_kernel.available()
    )


def _fused(spec: LayerSpec, inputs: FormInputs, dropout: float, biased: bool) -> FormOutput:
    """The form through one SDPA call (``biased``: :class:`BiasedSoftmaxAttention` for the learned bias);
    differential attention through one call per map, both reading the same values (no copy of v for the second
    map), its two outputs left apart for :meth:`~attnlab.forms.softmax.SoftmaxForm.output`."""
    form = spec.form
    q, k, v, pm = inputs.q, inputs.k, inputs.v, inputs.mask
    score: DotProductScore = form.score
    scale = score.scale
    bias, static = form.position_logits(q, k.shape[2])
    q, k = score.query_map(q), score.key_map(k)
    selective = "selective" in spec.features
    if selective:  # − F of head 0's logits, a (B, 1, Lq, Lk) bias with its gradient
        head0 = torch.matmul(q[:, :1] * scale, k[:, :1].transpose(-1, -2))
        if bias is not None:
            head0 = head0 + bias[:, :1]
        allowed0 = None if pm is None else pm.allowed[:, :1]
        if select_kernel.supports(head0, allowed0):  # −F in one pass each way (attnlab.kernels.select)
            minus_f = select_kernel.selection_bias(head0, allowed0)
        else:
            minus_f = -selection_penalty(head0, allowed0)
        bias, static = (minus_f if bias is None else bias + minus_f), False
    extra = form.extra_logit()
    # selective attention's (B, 1, Lq, Lk) bias with the C softmax row kernel, the mask as the allowed keys (no −inf)
    row_kernel = biased and selective and extra is None and _row_kernel_applies(q, spec)
    raw_bias = bias
    causal = bias is None and pm is not None and pm.is_causal
    if bias is None:
        attn_mask = None if pm is None or causal else pm.safe
    elif row_kernel:
        attn_mask = None  # (the row kernel takes the bias and the allowed keys apart)
    else:
        attn_mask = bias if pm is None else _masked_bias(bias, pm, static)
    out_dtype, precise = v.dtype, False
    if "forgetting" in spec.features:  # the forget gates' bias folded into two more dimensions of q and k
        if q.dtype in (torch.float16, torch.bfloat16):  # c reaches hundreds: bf16 would round it by ±1 or more
            q, k, v, precise = q.float(), k.float(), v.float(), True  # (and the call outside autocast, below)
            if attn_mask is not None and attn_mask.dtype != torch.bool:  # a bias in bf16: SDPA wants q's dtype
                attn_mask = attn_mask.float()
        q, k, scale = *form.fold_bias(q * scale, expand_heads(k, q.shape[1]), inputs.transition), 1.0
    if extra is not None:  # softmax1, sink: one more key whose logit is the sink and whose value is 0
        if causal:
            attn_mask, causal = pm.safe, False
        q, k, v, attn_mask = _with_sink_key(q, k, v, attn_mask, extra / scale)

    def call(q: Tensor, k: Tensor, attn_mask: Tensor | None, v: Tensor = v) -> Tensor:
        if biased:
            heads = q.shape[1]
            k, v = expand_heads(k, heads), expand_heads(v, heads)
            if row_kernel:
                allowed = None if pm is None else pm.allowed
                return NormalizedAttention.apply(
                    q, k, v, raw_bias, allowed, scale, softmax_kernel.SoftcapSoftmax(), None
                )
            return BiasedSoftmaxAttention.apply(q, k, v, attn_mask, scale)
        return scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout,
            is_causal=causal,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1],
        )

    if not spec.config.differential and spec.features & {"forgetting", "selective"}:
        # their logits span hundreds (the forget gates' bias, the accumulated selection): the weights of a band of
        # keys would be denormal floats, which the kernels and matrix products compute in microcode
        with torch.autocast(q.device.type, enabled=False) if precise else nullcontext():
            z = flush_denormals(lambda q, k, v: call(q, k, attn_mask, v), q, k, v)
        return FormOutput(visible_rows(z[..., : spec.d_v].to(out_dtype), pm))
    if not spec.config.differential:
        return FormOutput(visible_rows(call(q, k, attn_mask)[..., : spec.d_v], pm))  # (the sink key's padding cut)
    H = spec.num_heads
    (q1, q2), (k1, k2), (m1, m2) = _halves(q, H), _halves(k, spec.num_kv_heads), _halves(attn_mask, H)
    z1, z2 = call(q1, k1, m1)[..., : spec.d_v], call(q2, k2, m2)[..., : spec.d_v]
    if pm is not None and not pm.all_visible:
        visible = _halves(pm.visible, H)[0]  # both maps of a head see the same keys
        z1, z2 = z1 * visible, z2 * visible
    return FormOutput(z1, z2=z2)


@register_backend("biased_softmax")
class BiasedSoftmax(FusedSoftmax):
    computes = SOFTMAX_STAGES | {"selective"}

    def config_reason(self, layer: Any) -> str | None:
        spec = spec_of(layer)
        reason = super().config_reason(spec) or softmax_reason(spec)
        if reason is not None:
            return reason
        if not _learned_bias(spec.form):
            return "it is for a learned position bias (position_bias=shaw or t5, or their presets); there is none"
        return None

    def call_reason(self, layer: Any, when: Conditions) -> str | None:
        if when.device != "cpu":
            return f"it is for the CPU (on {when.device} SDPA computes a bias gradient itself)"
        if not when.grad:
            return "it is for training (gradients on)"
        if when.training and spec_of(layer).dropout > 0:
            return "it applies no dropout to the weights"
        return None

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        return _fused(spec, inputs, dropout, biased=True)


@register_backend("sdpa")
class Sdpa(FusedSoftmax):
    computes = SOFTMAX_STAGES | {"selective", "forgetting"}
    """… and selective attention, and forgetting attention, its bias c_i − c_j folded into two more dimensions of q
    and k (:meth:`~attnlab.forms.forgetting.ForgettingAttention.fold_bias`): SDPA's fused kernel, no (L, L) tensor."""

    def config_reason(self, layer: Any) -> str | None:
        spec = spec_of(layer)
        return super().config_reason(spec) or softmax_reason(spec)

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        return _fused(spec, inputs, dropout, biased=False)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``: the ``sdpa`` backend's one call (a module-level name,
    so that tests can watch it). q (B, Hq, Lq, d), k (B, Gk, Lk, d), v (B, G, Lk, d_v) → (B, Hq, Lq, d_v).

    On the CPU, PyTorch's flash kernel needs d_v = d and otherwise falls back on the math kernel, which materialises
    (B, H, Lq, Lk) (2.3× the step at L 512 with d = 48, d_v = 32: multi-head latent attention's [content ; rotary]
    keys): there the smaller of v and (q, k) is padded with zeros to the other's size, which changes neither q·k nor
    the weighted sum, and the output is cut back to d_v."""
    d, d_v = q.shape[-1], v.shape[-1]
    if d != d_v and q.device.type == "cpu":
        scale = d**-0.5 if scale is None else scale
        if d_v < d:
            v = F.pad(v, (0, d - d_v))
        else:
            q, k = F.pad(q, (0, d_v - d)), F.pad(k, (0, d_v - d))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
        return out[..., :d_v]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


class BiasedSoftmaxAttention(torch.autograd.Function):
    """z = softmax(scale · q kᵀ + bias) v for a bias that needs its gradient (a learned position bias).

    q (B, H, Lq, d), k (B, H, Lk, d), v (B, H, Lk, d_v), bias broadcastable to (B, H, Lq, Lk) (hidden keys at −inf;
    no row entirely hidden) → z (B, H, Lq, d_v). Equal to SDPA's math kernel, with less memory traffic: the logits
    are built in place, and the backward pass keeps only the weights P and the output, using
    dS = P ⊙ (dP − rowsum(dO ⊙ z)) (dP = dO vᵀ) for the logits' gradient, which is the bias's gradient (summed
    over the dimensions the bias broadcasts along).
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
        logits = torch.matmul(q * scale, k.transpose(-1, -2)).add_(bias)  # (B, H, Lq, Lk)
        weights = torch.softmax(logits, dim=-1)
        del logits
        z = torch.matmul(weights, v)
        ctx.save_for_backward(q, k, v, weights, z)
        ctx.scale, ctx.bias_shape = scale, bias.shape
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, weights, z = ctx.saved_tensors
        dv = torch.matmul(dz.transpose(-1, -2), weights).transpose(-1, -2)  # Wᵀ dZ, untransposed W (faster)
        d_logits = torch.matmul(dz, v.transpose(-1, -2))  # dP, then in place dS
        d_logits.sub_((dz * z).sum(-1, keepdim=True)).mul_(weights)
        dq = torch.matmul(d_logits, k).mul_(ctx.scale)
        dk = torch.matmul(q.transpose(-1, -2), d_logits).transpose(-1, -2).mul_(ctx.scale)
        shape = ctx.bias_shape
        lead = d_logits.dim() - len(shape)
        dims = [d for d in range(d_logits.dim()) if d < lead or (shape[d - lead] == 1 and d_logits.shape[d] != 1)]
        d_bias = d_logits.sum(dims, keepdim=True).view(shape) if dims else d_logits
        return dq, dk, dv, d_bias, None


def _with_sink_key(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, sink: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """SDPA inputs for a softmax with a sink logit b_h, exactly: q gains a last dimension b_h / scale, every key a
    0 there, and one more key (0, …, 0, 1) with value 0 is appended, so its logit is b_h and its weight is dropped
    from the output. ``sink`` (Hq,) or a scalar, already divided by the score's scale; the mask gets a visible
    column (a row that sees no key then gives 0 / e^b = 0, as the eager path). q, k and v are zero-padded to one
    size (the output's extra columns are cut off by the caller)."""
    B, Hq, Lq, _ = q.shape
    Gk = k.shape[1]
    column = sink.to(q.dtype).expand(Hq).view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
    q = torch.cat((q, column), dim=-1)  # (B, Hq, Lq, d_k + 1)
    k = F.pad(k, (0, 1))  # (B, Gk, Lk, d_k + 1), 0 in the last dimension
    sink_key = torch.zeros(B, Gk, 1, k.shape[-1], dtype=k.dtype, device=k.device)
    sink_key[..., -1] = 1.0
    k = torch.cat((k, sink_key), dim=2)  # (B, Gk, Lk + 1, d_k + 1)
    v = F.pad(v, (0, 0, 0, 1))  # (B, G, Lk + 1, d_v), value 0 for the sink
    size = max(q.shape[-1], v.shape[-1])  # equal q/k and v sizes let SDPA use its fused kernel: pad with zeros
    q, k, v = (F.pad(t, (0, size - t.shape[-1])) for t in (q, k, v))
    if attn_mask is not None:
        attn_mask = F.pad(attn_mask, (0, 1), value=True if attn_mask.dtype == torch.bool else 0.0)
    return q, k, v, attn_mask


def _masked_bias(bias: Tensor, pm: PreparedMask, static: bool) -> Tensor:
    """The additive float mask: ``bias`` (…, Lq, Lk) with the hidden positions at −inf. A static bias (a cached
    constant, e.g. ALiBi) is combined with a cached mask once and the result cached with the mask."""
    if not static or bias.requires_grad:
        return bias.masked_fill(pm.hidden, float("-inf"))
    key = ("masked_bias", id(bias))
    entry = pm.derived.get(key)
    if entry is None or entry[0] is not bias:  # a new tensor that reuses a freed one's id
        pm.derived.pop(key, None)
        entry = pm.derived.get_or_make(key, lambda: (bias, bias.masked_fill(pm.hidden, float("-inf"))))
    return entry[1]
