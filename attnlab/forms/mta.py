"""Multi-token attention (Golovneva et al. 2025, "Multi-Token Attention", §3, eqs. 3–6): softmax attention whose
weights are convolved over neighbouring queries and keys, and mixed across the heads of a group, so that a weight can
depend on several query–key pairs, not one::

    Â = QKᵀ / √d_k                                                     each head's logits (B, H, Lq, Lk)
    Ã_ij = Σ_{a=0}^{c_q−1} Σ_{j'=−⌊c_k/2⌋}^{⌈c_k/2⌉−1} θ_{a,j'} · M₀(Â)_{i−a, j−j'}      key–query convolution (eq. 4)
    A = softmax(M_{−∞}(Ã))                                             (eq. 5)
    A'_h = Σ_{h' ∈ group(h)} w_{h,h'} A_{h'}                           head mixing, groups of c_h heads (§3.2)
    o = A' V

with M₀ the causal mask filling hidden logits with 0 before the convolution and M_{−∞} filling them with −∞ after it
(the paper's masking, eq. 5; M₀ also zeroes the row of a token that cannot see its own key, a padded one), so a weight
reads only queries at or before its own (a ≥ 0: causal on the query axis) and, through M₀, only logits of keys those
queries may see: the layer stays causal. θ (H, c_q, c_k) is each head's own kernel, ``kq_kernel[h, a, b]`` with b = j' +
⌊c_k/2⌋ (key j − b + ⌊c_k/2⌋); w (H / c_h, c_h, c_h) the head mixing, ``head_kernel[g, o, i]`` the weight of the group's
head i in its head o, applied after the softmax (the paper's post-softmax variant). Both start at the identity, so a
fresh layer is scaled dot-product attention.

Parameters (``variant.params``): ``c_q`` (default 6), ``c_k`` (default 11) and ``c_h`` (default 2 for an even number
of heads, else 1), the paper's. The paper's group normalisation with depth scaling is not part of this form (any
output norm of the layer may be added).

**Eager only**: the convolution over the (B, H, Lq, Lk) logits has no fused form here, so every other backend is
refused in one line and ``auto`` chooses ``eager``. Causal only (the query axis is convolved over the past); the
differential maps and decoding are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.checks import check_int
from attnlab.forms.base import FormInputs, FormOutput, LayerOptionError, LayerSizes, knobs, register_form
from attnlab.forms.softmax import SoftmaxForm
from attnlab.masks import PreparedMask, with_causal

if TYPE_CHECKING:
    from attnlab.config import AttentionConfig

__all__ = ["MultiTokenAttention", "key_query_convolution"]

MTA_PARAMS = ("c_q", "c_k", "c_h")


def key_query_convolution(logits: Tensor, allowed: Tensor, kernel: Tensor) -> Tensor:
    """Ã = conv(M₀(Â)) (eq. 4): logits (B, H, L, L) (self-attention), allowed bool broadcastable (True = may
    attend), kernel θ (H, c_q, c_k) → (B, H, L, L); query i reads queries i − a (a = 0 … c_q − 1, zero before the
    first) and key j reads keys j − b + ⌊c_k/2⌋ (zero outside), each head with its own kernel (a depthwise 2-d
    convolution). M₀ zeroes the hidden logits, and the whole row of a token that cannot see its own key (a padded
    one: the paper has no padding), whose logits would otherwise reach the later queries through the convolution."""
    H, c_q, c_k = kernel.shape
    own = allowed.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # (…, L, 1): a token that sees its own key (not padded)
    masked = logits.masked_fill(~(allowed & own), 0.0)  # M₀, and a padded token's row 0 (it feeds later queries)
    padded = F.pad(masked, ((c_k + 1) // 2 - 1, c_k // 2, c_q - 1, 0))  # keys: ⌈c_k/2⌉ − 1 | ⌊c_k/2⌋; queries: c_q − 1
    weight = kernel.flip(1, 2).unsqueeze(1).to(logits.dtype)  # (H, 1, c_q, c_k): conv2d correlates, θ convolves
    if padded.device.type == "cpu":  # oneDNN's depthwise convolution, forward + backward: 4× faster channels-last
        padded = padded.contiguous(memory_format=torch.channels_last)  # (0.19 s against 0.75 s at (8, 4, 512, 512))
    return F.conv2d(padded, weight, groups=H).contiguous()


@register_form("mta")
class MultiTokenAttention(SoftmaxForm):
    """Multi-token attention (module docstring): the key–query convolution ``kq_kernel`` (H, c_q, c_k) before the
    softmax and the head mixing ``head_kernel`` (H / c_h, c_h, c_h) after it."""

    tags = frozenset({"softmax", "multi_token"})
    implements = knobs({k: v for k, v in SoftmaxForm.implements.items() if k != "differential"})
    refusals = knobs(differential="its head mixing is over one map per head")
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
        params = dict(config.score_params)
        unknown = sorted(set(params) - set(MTA_PARAMS))
        if unknown:
            raise ValueError(f"variant mta has no parameter '{unknown[0]}'; parameters: {', '.join(MTA_PARAMS)}")
        if config.differential:
            raise LayerOptionError("variant mta has no differential maps: leave differential off")
        H = sizes.num_heads
        c_q = check_int("c_q", 6 if params.get("c_q") is None else params["c_q"], minimum=1)
        c_k = check_int("c_k", 11 if params.get("c_k") is None else params["c_k"], minimum=1)
        c_h = params.get("c_h")
        c_h = (2 if H % 2 == 0 else 1) if c_h is None else check_int("c_h", c_h, minimum=1)
        if H % c_h:
            raise ValueError(f"c_h={c_h} must divide the number of heads ({H}): the heads are mixed in groups of c_h")
        super().__init__(sizes, config, score, position_bias, normalizer)
        self.c_q, self.c_k, self.c_h = c_q, c_k, c_h
        kq = torch.zeros(H, c_q, c_k)
        kq[:, 0, c_k // 2] = 1.0  # the identity: query i, key j
        self.kq_kernel = nn.Parameter(kq)
        self.head_kernel = nn.Parameter(torch.eye(c_h).repeat(H // c_h, 1, 1))

    def weights_signed(self) -> bool:
        return True  # the head mixing may give a weight either sign

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: PreparedMask | None) -> FormInputs:
        """The mask made causal (:func:`~attnlab.masks.with_causal`), whatever a call passes."""
        return FormInputs(q, k, v, with_causal(mask, q.shape[2], k.shape[2], q.device))

    def mix_heads(self, weights: Tensor) -> Tensor:
        """A (B, H, Lq, Lk) → A' (B, H, Lq, Lk), A'_h = Σ_{h' ∈ group(h)} w_{h,h'} A_{h'}."""
        B, H, Lq, Lk = weights.shape
        grouped = weights.view(B, H // self.c_h, self.c_h, Lq, Lk)
        return torch.einsum("goi,bgiqk->bgoqk", self.head_kernel.to(weights.dtype), grouped).reshape(B, H, Lq, Lk)

    def parallel(self, inputs: FormInputs, dropout: float = 0.0) -> FormOutput:
        q, k, v, pm = inputs.q, inputs.k, inputs.v, inputs.mask
        logits = key_query_convolution(self.logits(q, k), pm.allowed, self.kq_kernel)  # (B, H, Lq, Lk)
        logits = self.select(logits, pm)
        weights = self.mix_heads(self.normalize(logits, pm, v.dtype))
        dropped = F.dropout(weights, dropout) if dropout > 0 else weights
        return FormOutput(self.mix_values(dropped, v), weights, logits)

    def decode_reason(self) -> str | None:
        return "multi-token attention convolves over earlier queries' logits: no token-by-token form here"

    def extra_repr(self) -> str:
        return f"c_q={self.c_q}, c_k={self.c_k}, c_h={self.c_h}"
