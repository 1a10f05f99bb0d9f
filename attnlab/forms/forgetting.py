"""Forgetting attention (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate", ICLR 2025,
§2, eqs. 5–7): causal softmax attention whose logits carry a data-dependent decay, the forget gates of a linear RNN::

    f_t = σ(x_t w_h + b_h)                       one forget gate per token and head           (eq. 5)
    c_t = Σ_{l ≤ t} log f_l                      their cumulative log                         (B, H, L)
    D_ij = Σ_{l=j+1..i} log f_l = c_i − c_j       (j ≤ i; ≤ 0)                                 (eq. 7)
    o_i = Σ_j softmax_j(q_i·k_j / √d_k + D_ij) v_j                                              (eq. 6)

so a key's weight decays by the gates of the tokens between it and the query: a recency bias learned from the
content, with no position encoding (FoX uses none). D is built from the (B, H, L) cumulative sum, never stored as a
parameter, and is exact at any length (c_i − c_j, both sums of gates ≤ 0). A padded token (one that cannot see its own
key) forgets nothing, f = 1, so that padding anywhere in a sequence changes no real token (FoX pads at the ends).

Backends:

* ``sdpa`` (the CPU's choice): D_ij = c_i − c_j is a sum of products, so it is two more dimensions of q and k
  (:meth:`ForgettingAttention.fold_bias`): q' = [q/√d_k ; 1 ; c_i], k' = [k ; −c_j ; 1], through SDPA's fused kernel
  with scale 1, no (L, L) tensor. c grows with the position (|c_L| ≤ L·max|log f|), so in float32 a logit carries an
  absolute rounding error of about |c_L|·6·10⁻⁸ (3·10⁻⁵ at L 512 with every gate at ½); the eager path, which
  subtracts first, has none. Denormal floats are flushed to zero around the call (the smooth bias puts a band of
  each row's exponentials below float32's smallest normal, where the cores compute in microcode).
* ``flex`` (CUDA): the bias as a ``score_mod``, score + c[b, h, i] − c[b, h, j], fused by FlexAttention.
* ``eager``: the logits plus D (B, H, Lq, Lk): the reference and the weights the diagnostics read.

FoX's "Pro" block (output gate, QK-norm and a short convolution; FoX's own output norm and key/value shift are
not reproduced) is :data:`FOX_PRO`, and ``variant=forgetting_pro`` on the command line (``attention.output_gate=
elementwise``, ``qk_norm=rmsnorm``, ``model.short_conv=4`` around this form). Causal only (the gates run over the
sequence in order; a call's mask is made causal, :func:`~attnlab.masks.with_causal`); differential maps are refused.
Decoding is not implemented (``decode_reason``). Selective attention (``selective``) takes its penalty from head 0's
score logits, before D is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.forms.base import FormInputs, FormOutput, LayerOptionError, LayerSizes, knobs, register_form
from attnlab.forms.softmax import SoftmaxForm
from attnlab.masks import PreparedMask, with_causal
from attnlab.transition import Transition

if TYPE_CHECKING:
    from attnlab.config import AttentionConfig

__all__ = ["FOX_PRO", "ForgettingAttention", "cumulative_log_forget", "forget_bias"]

FOX_PRO: dict[str, Any] = {"output_gate": "elementwise", "qk_norm": "rmsnorm", "short_conv": 4}
"""The layer options of FoX's "Pro" block around forgetting attention (Lin et al. 2025, §3): an elementwise output
gate σ(x W_g), QK-norm (RMSNorm) and a short convolution of width 4 on q, k and v:
``MultiHeadAttention(d_model, num_heads, score="forgetting", mask="causal", **FOX_PRO)``; on the command line
``variant=forgetting_pro`` (``conf/variant/forgetting_pro.yaml``)."""


def cumulative_log_forget(record: Transition) -> Tensor:
    """c (B, H, L) float32 (float64 stays float64), c_t = Σ_{l ≤ t} log f_l, from the record's log f (B, H, L)."""
    log_f = record.log_decay
    return log_f.cumsum(-1) if log_f.dtype == torch.float64 else log_f.float().cumsum(-1)


def forget_bias(record: Transition, num_queries: int, num_keys: int) -> Tensor:
    """D (B, H, Lq, Lk), D_ij = c_i − c_j for j ≤ i (queries aligned with the last Lq keys), 0 above the diagonal
    (keys a causal mask hides): float32, or float64 for float64 gates."""
    c = cumulative_log_forget(record)  # (B, H, L)
    return (c[..., -num_queries:, None] - c[..., None, :num_keys]).clamp_max_(0.0)


@register_form("forgetting")
class ForgettingAttention(SoftmaxForm):
    """Forgetting attention (module docstring): the softmax form plus D_ij = c_i − c_j from per-head forget gates.

    ``forget_proj`` d_model → H gives the gates' logits x_t w_h + b_h; :meth:`prepare` records log f_t in a
    :class:`~attnlab.transition.Transition` (``log_decay`` (B, H, L)), the backends read it from there."""

    tags = frozenset({"softmax", "forgetting"})
    implements = knobs({k: v for k, v in SoftmaxForm.implements.items() if k != "differential"})
    refusals = knobs(differential="one forget bias per head")
    layer_kind = "F"  # model.pattern=…F
    computed_as = "softmax"  # softmax's backends, those that declare the forget bias (feature "forgetting")
    inner_score = "scaled_dot"
    causal_only = True

    def __init__(
        self,
        sizes: LayerSizes,
        config: AttentionConfig,
        score: nn.Module | None = None,
        position_bias: nn.Module | None = None,
        normalizer: nn.Module | None = None,
    ) -> None:
        if config.score_params:
            raise ValueError(f"variant forgetting has no parameter '{sorted(config.score_params)[0]}'; it takes none")
        if config.differential:
            raise LayerOptionError(
                "variant forgetting has no differential maps (one forget bias per head): leave differential off"
            )
        super().__init__(sizes, config, score, position_bias, normalizer)
        self.forget_proj = nn.Linear(sizes.d_model, sizes.num_heads)  # f_t = σ(x_t w_h + b_h)

    def features(self) -> frozenset[str]:
        return super().features() | {"forgetting"}

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: PreparedMask | None) -> FormInputs:
        """x (B, L, d_model) → log f (B, H, L) in the inputs' transition record (0 for a padded token); the mask made
        causal (:func:`~attnlab.masks.with_causal`: the form is causal whatever mask a call passes)."""
        log_f = F.logsigmoid(self.forget_proj(x)).transpose(1, 2)  # (B, H, L)
        mask = with_causal(mask, q.shape[2], k.shape[2], q.device)
        if mask.form != "causal" and q.shape[2] == k.shape[2]:  # a padded token (own key hidden) forgets nothing
            own = mask.allowed.diagonal(dim1=-2, dim2=-1)  # (B or 1, H or 1, L)
            log_f = log_f.masked_fill(~own, 0.0)
        return FormInputs(q, k, v, mask, Transition(log_decay=log_f))

    def fold_bias(self, q: Tensor, k: Tensor, record: Transition) -> tuple[Tensor, Tensor]:
        """q (B, H, Lq, d) already scaled, k (B, H, Lk, d) (one key head per query head) → q' = [q ; 1 ; c_i],
        k' = [k ; −c_j ; 1] (…, d + 2), so that q'·k' = q·k + c_i − c_j: the logits plus D, exactly (so a sink
        logit appended after them stays comparable with them)."""
        c = cumulative_log_forget(record).to(k.dtype)  # (B, H, L)
        Lq, Lk = q.shape[2], k.shape[2]
        ones_q, ones_k = q.new_ones(*q.shape[:-1], 1), k.new_ones(*k.shape[:-1], 1)
        q = torch.cat([q, ones_q, c[..., Lk - Lq : Lk, None]], dim=-1)
        return q, torch.cat([k, -c[..., :Lk, None], ones_k], dim=-1)

    def parallel(self, inputs: FormInputs, dropout: float = 0.0) -> FormOutput:
        q, k, v, pm = inputs.q, inputs.k, inputs.v, inputs.mask
        logits = self.select(self.logits(q, k), pm)  # (B, H, Lq, Lk); selective: F from head 0's, before D
        if logits.dtype in (torch.float16, torch.bfloat16):  # D in float32: in bf16 a bias of −5 is off by 0.02
            logits = logits.float()
        logits = logits + forget_bias(inputs.transition, q.shape[2], k.shape[2]).to(logits.dtype)
        weights = self.normalize(logits, pm, v.dtype)
        dropped = F.dropout(weights, dropout) if dropout > 0 else weights
        return FormOutput(self.mix_values(dropped, v), weights, logits)

    def decode_reason(self) -> str | None:
        return "forgetting attention has no token-by-token form here (its cache would also keep each key's c_j)"
