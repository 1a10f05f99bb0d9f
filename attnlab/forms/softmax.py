"""The ``softmax`` form: attention through a score and a normalizer, with its stages (Vaswani et al. 2017, §3.2.2):

    e = score(q, k) + position_bias(q)        logits (B, Hq, Lq, Lk)
    e = c·tanh(e / c)                         soft-capping, when ``softcap=c`` (Gemma 2)
    e = e − F                                 selective attention, when ``selective`` (Leviathan et al. 2025)
    w = normalizer(e, mask)                   masked keys 0, a row that sees no key all 0
    w = w₁ − λ·w₂                             differential attention only (Ye et al. 2024)  (B, H, Lq, Lk)
    z = w v (+ value terms)                   (B, H, Lq, d_v)

Any registered score and normalizer (softmax by default: the name says what the fused backends compute; ``rowsum``
on a non-linear score, sparsemax, entmax … are this form too). Differential attention computes two maps per head:
Hq = 2H query and Gk = 2G key heads, laid out component-major (index c·H + h for component c of head h), and each
head's output goes through a sub-norm scaled by (1 − λ_init) (:meth:`SoftmaxForm.output`). Selective attention
(:func:`selection_penalty`) subtracts from every head's logits what the first head's logits say earlier queries
selected away. Decoding keeps every key and value so far (a causal window: those of its window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab.config import AttentionConfig
from attnlab.forms.base import Form, FormInputs, FormOutput, LayerSizes, expand_heads, knobs, register_form
from attnlab.masks import PreparedMask, build_mask, hides_later_keys, with_causal
from attnlab.normalizers import build_normalizer
from attnlab.position_bias import build_position_bias, resolve_direction
from attnlab.scores import DotProductScore, build_score

__all__ = ["DifferentialHeads", "KVCache", "SoftmaxForm", "expand_heads", "lambda_init", "selection_penalty"]


def lambda_init(layer: int) -> float:
    """Differential attention's λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) for layer l = 1, 2, … (Ye et al. 2024)."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


class DifferentialHeads(torch.autograd.Function):
    """Differential attention's heads from its two maps' outputs, in one step with a written-out backward:
    z₁, z₂ (B, H, Lq, d_v), λ (a 0-d tensor), the sub-norm's weight g (d_v,), its eps, and the scale s = 1 − λ_init
    → y = s · g ⊙ u / rms(u), u = z₁ − λ z₂, rms(u) = √(mean(u²) + eps) over d_v (``nn.RMSNorm``).

    Autograd through the combination and ``nn.RMSNorm`` (whose CPU form is composite: pow, mean, rsqrt, two
    products) writes about 15 (B, H, Lq, d_v) tensors forward and backward; this writes about 8, keeping u and
    1/rms(u) (B, H, Lq, 1) for the backward pass:
    ∂u = r (ĝ − u r² mean(ĝ ⊙ u)), ĝ = s g ⊙ ∂y, r = 1/rms(u); ∂z₁ = ∂u, ∂z₂ = −λ ∂u, ∂λ = −Σ ∂u ⊙ z₂,
    ∂g = s Σ ∂y ⊙ u r."""

    @staticmethod
    def forward(
        ctx: Any, z1: Tensor, z2: Tensor, lam: Tensor, weight: Tensor, eps: float | None, scale: float
    ) -> Tensor:
        u = torch.addcmul(z1, z2, lam, value=-1.0)  # z₁ − λ z₂
        eps = torch.finfo(u.dtype).eps if eps is None else eps
        r = torch.linalg.vector_norm(u, dim=-1, keepdim=True).square_().div_(u.shape[-1]).add_(eps).rsqrt_()
        gain = weight.to(u.dtype) * scale  # (d_v,)
        ctx.save_for_backward(z2, lam, weight, u, r)
        ctx.scale = scale
        return (u * r).mul_(gain)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        z2, lam, weight, u, r = ctx.saved_tensors
        scale = ctx.scale
        d = u.shape[-1]
        dweight = None
        if ctx.needs_input_grad[3]:
            dims = tuple(range(dy.dim() - 1))
            dweight = (dy * u).mul_(r).sum(dims).mul_(scale).to(weight.dtype)
        g_hat = dy * (weight.to(dy.dtype) * scale)  # ĝ
        dot = (g_hat * u).sum(-1, keepdim=True)  # Σ ĝ ⊙ u, (B, H, Lq, 1)
        du = torch.addcmul(g_hat.mul_(r), u, r.pow(3).mul_(dot).div_(d), value=-1.0)
        dlam = -(du * z2).sum() if ctx.needs_input_grad[2] else None
        dz2 = du * (-lam) if ctx.needs_input_grad[1] else None
        return du, dz2, dlam, dweight, None, None


def selection_penalty(logits: Tensor, allowed: Tensor | None) -> Tensor:
    """Selective attention's F (Leviathan et al. 2025, "Selective Attention Improves Transformer", §2 and its
    Fig. 2 code): the selecting head's logits (B, 1, L, L) (head 0's, after the scale, position bias and soft-cap)
    and the mask (bool broadcastable to (B, 1, L, L), True = visible; None = all) → F (B, 1, L, L), which is
    subtracted from every head's logits before the softmax:

        S_kj = ReLU(e_kj) for a visible key j with 0 < j < k (the first key, the paper's BOS, is never selected
               away, nor a token's own key), else 0;       F_ij = Σ_{k<i} S_kj

    i.e. token k's selection of key j counts for the queries after k (the paper's roll by one). Self-attention
    (query k is token k). A token that cannot see its own key, a padded one, selects nothing, so that padding
    anywhere in a sequence changes no real token (the paper has no padding). The penalty is parameter-free and
    differentiable: its gradient reaches head 0's logits."""
    L, Lk = logits.shape[-2:]
    if L != Lk:
        raise ValueError(f"selective attention is self-attention (query k is token k): got {L} queries, {Lk} keys")
    token = torch.arange(L, device=logits.device)[:, None]  # (L, 1)
    key = torch.arange(L, device=logits.device)[None, :]  # (1, L)
    keep = (key > 0) & (key < token)  # (L, L): 0 < j < k
    if allowed is not None:
        own = allowed.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # (…, L, 1): token k sees its own key (not padded)
        keep = keep & allowed & own
    selected = torch.where(keep, torch.relu(logits), logits.new_zeros(()))  # S (B, 1, L, L)
    return F.pad(selected[..., :-1, :].cumsum(-2), (0, 0, 1, 0))  # F_i = Σ_{k<i} S_k  (row 0: 0)


@dataclass
class KVCache:
    """The softmax form's decoding state: k (B, Gk, capacity, d_k) and v (B, G, capacity, d_v) of every token so
    far, preallocated and doubled when full; ``length`` tokens held."""

    k: Tensor
    v: Tensor
    length: int = 0

    def nbytes(self) -> int:
        """Bytes of the tokens held (not the spare capacity)."""
        return sum(t[:, :, : self.length].numel() * t.element_size() for t in (self.k, self.v))


@register_form("softmax")
class SoftmaxForm(Form):
    """Score → position bias → soft-cap → mask → normalizer (→ differential maps) → values (module docstring).

    Its stages are modules of their own: ``score`` (a registered score, over the Hq query heads), ``position_bias``
    (or None), ``normalizer``; differential attention adds λ's parameters and the per-head ``sub_norm``. A score or
    position bias that takes ``bidirectional`` (T5's buckets) and leaves it unset gets False when the config's mask
    hides every later key (T5's decoder bucketing) and True otherwise."""

    tags = frozenset({"softmax"})
    implements = knobs(
        position_bias=None, position_bias_params=None, softcap=None, normalizer=None, normalizer_params=None,
        differential=None, selective=None,
    )  # fmt: skip
    computed_as = "softmax"
    inner_score: ClassVar[str | None] = None
    """a form built on this one (``mla``, ``forgetting``, ``mta``): the registered score its logits use, built
    without parameters (the config's ``score`` is then the form's name and ``score_params`` the form's own); None:
    the config's score."""

    def __init__(
        self,
        sizes: LayerSizes,
        config: AttentionConfig,
        score: nn.Module | None = None,
        position_bias: nn.Module | None = None,
        normalizer: nn.Module | None = None,
    ) -> None:
        super().__init__(sizes, config)
        self.differential = config.differential
        maps = 2 if self.differential else 1
        self.maps = maps
        causal = config.mask is not None and hides_later_keys(build_mask(config.mask))
        size = {"d_k": sizes.d_k, "num_heads": maps * sizes.num_heads, "d_v": sizes.d_v}
        if score is None:
            name, own = (config.score, config.score_params) if self.inner_score is None else (self.inner_score, {})
            params = resolve_direction("score", name, own, causal) if causal else None
            score = build_score(name, **size, d_model=sizes.d_model, **(params or own))
        self.score = score
        if position_bias is None:
            params = config.position_bias_params
            if config.mask is not None:
                params = resolve_direction("position bias", config.position_bias, params, causal)
            position_bias = build_position_bias(config.position_bias, **size, **params)
        self.position_bias = position_bias
        self.softcap = config.softcap
        self.normalizer = normalizer or build_normalizer(
            config.normalizer, num_heads=maps * sizes.num_heads, **config.normalizer_params
        )
        if self.differential:
            self.lambda_init = lambda_init(sizes.layer)
            self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
                nn.Parameter(torch.randn(sizes.d_k) * 0.1) for _ in range(4)
            )
            self.sub_norm = nn.RMSNorm(sizes.d_v, eps=1e-5)
        self.mask_config = config.mask
        self.selective = config.selective

    @classmethod
    def base_config(cls) -> AttentionConfig:
        config = super().base_config()
        return config.replace(score="scaled_dot") if cls.name == "softmax" else config

    @classmethod
    def query_maps(cls, config: AttentionConfig) -> int:
        return 2 if config.differential else 1

    @property
    def query_heads(self) -> int:
        return self.maps * self.num_heads

    @property
    def key_heads(self) -> int:
        return self.maps * self.sizes.num_kv_heads

    def features(self) -> frozenset[str]:
        score = self.score
        value_term = getattr(score, "has_value_term", False) or getattr(self.position_bias, "has_value_term", False)
        found = {
            *super().features(),
            "score:dot" if isinstance(score, DotProductScore) else f"score:{type(score).__name__}",
        }
        if value_term:
            found.add("value_term")
        if self.position_bias is not None or (isinstance(score, DotProductScore) and score.position_term()):
            found.add("position_bias")
        if self.softcap is not None:
            found.add("softcap")
        if self.differential:
            found.add("differential")
        if self.selective:
            found.add("selective")
        return frozenset(found)

    def weights_signed(self) -> bool:
        return self.differential

    # ---------------------------------------------------------------------------------------------- stages

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: PreparedMask | None) -> FormInputs:
        """As they are (selective attention: self-attention only, one line otherwise); under differential
        attention a per-head mask (…, H, Lq, Lk) applies to both maps of each head (repeated component-major, like
        q)."""
        if self.selective and q.shape[2] != k.shape[2]:
            raise ValueError(
                f"selective attention is self-attention (token k selects keys away for the queries after it): got "
                f"{q.shape[2]} queries and {k.shape[2]} keys"
            )
        if getattr(self.normalizer, "causal_only", False):  # stick-breaking: causal whatever mask a call passes
            mask = with_causal(mask, q.shape[2], k.shape[2], q.device)
        if mask is not None and self.differential and mask.allowed.shape[1] != 1:
            mask = PreparedMask.from_tensor(mask.allowed.repeat(1, 2, 1, 1))
        return FormInputs(q, k, v, mask)

    def logits(self, q: Tensor, k: Tensor) -> Tensor:
        """q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k) → e (B, Hq, Lq, Lk): score + position bias, soft-capped."""
        e = self.score(q, expand_heads(k, self.query_heads))
        if self.position_bias is not None:
            e = e + self.position_bias(q, k.shape[2])
        if self.softcap is not None:
            e = self.softcap * torch.tanh(e / self.softcap)
        return e

    def select(self, logits: Tensor, mask: PreparedMask | None) -> Tensor:
        """Selective attention (:func:`selection_penalty`): logits (B, Hq, Lq, Lk) − F of head 0's; as they are
        without ``selective``."""
        if not self.selective:
            return logits
        return logits - selection_penalty(logits[:, :1], None if mask is None else mask.allowed[:, :1])

    def check_mask(self, form: str, shown: str) -> None:
        super().check_mask(form, shown)
        if getattr(self.normalizer, "causal_only", False) and form not in ("causal", "causal+padding"):
            raise ValueError(
                f"normalizer {self.config.normalizer} is causal (each key's share is what the nearer keys left), so "
                f"it needs mask=causal (AND key padding at most), not mask={shown}"
            )
        if self.selective and form not in ("causal", "causal+padding"):
            raise ValueError(
                f"selective attention masks a key for the queries after the one that selected it away, so it needs "
                f"mask=causal (AND key padding at most), not mask={shown}"
            )

    def normalize(self, logits: Tensor, mask: PreparedMask | None, dtype: torch.dtype) -> Tensor:
        """logits (B, Hq, Lq, Lk) → weights in ``dtype``; half-precision logits are normalized in float32."""
        low_precision = logits.dtype in (torch.float16, torch.bfloat16)
        weights = self.normalizer(logits.float() if low_precision else logits, None if mask is None else mask.allowed)
        return weights.to(dtype)

    def differential_lambda(self) -> Tensor:
        """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, a scalar."""
        return (
            torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
            - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
            + self.lambda_init
        )

    def combine_maps(self, t: Tensor) -> Tensor:
        """Differential attention: (B, 2H, …) component-major → t₁ − λ·t₂, (B, H, …). Identity otherwise."""
        if not self.differential:
            return t
        pair = t.unflatten(1, (2, self.num_heads))  # (B, 2, H, …)
        return pair[:, 0] - self.differential_lambda().to(t.dtype) * pair[:, 1]

    def mix_values(self, weights: Tensor, v: Tensor) -> Tensor:
        """weights (B, H, Lq, Lk) (after dropout), v (B, G, Lk, d_v) → z (B, H, Lq, d_v), plus value-side terms."""
        z = torch.matmul(weights, expand_heads(v, self.num_heads))  # (B, H, Lq, d_v)
        for part in (self.score, self.position_bias):
            if part is not None and getattr(part, "has_value_term", False):
                z = z + part.value_term(weights)
        return z

    def extra_logit(self) -> Tensor | None:
        """The normalizer's sink logit (softmax1, sink), or None."""
        extra = getattr(self.normalizer, "extra_logit", None)
        return extra() if extra is not None else None

    def position_logits(self, q: Tensor, num_keys: int) -> tuple[Tensor | None, bool]:
        """The additive logit terms beside q·k (a score's own bias and the position-bias stage), summed, and
        whether the result is a static (cacheable) tensor; (None, False) when there are none."""
        score = self.score
        parts = [(score.bias(q, num_keys), score.static_bias)] if isinstance(score, DotProductScore) else []
        if self.position_bias is not None:
            parts.append((self.position_bias(q, num_keys), self.position_bias.static_bias))
        parts = [(b, s) for b, s in parts if b is not None]
        if not parts:
            return None, False
        if len(parts) == 1:
            return parts[0]
        return parts[0][0] + parts[1][0], False

    # ---------------------------------------------------------------------------------------------- forms

    def parallel(self, inputs: FormInputs, dropout: float = 0.0) -> FormOutput:
        q, k, v, pm = inputs.q, inputs.k, inputs.v, inputs.mask
        logits = self.select(self.logits(q, k), pm)  # (B, Hq, Lq, Lk)
        weights = self.combine_maps(self.normalize(logits, pm, v.dtype))  # (B, H, Lq, Lk)
        dropped = F.dropout(weights, dropout) if dropout > 0 else weights
        return FormOutput(self.mix_values(dropped, v), weights, logits)  # z (B, H, Lq, d_v)

    def output(self, out: FormOutput, inputs: FormInputs | None = None) -> Tensor:
        """z → each head's output: differential attention's sub-norm of z₁ − λ z₂, scaled by (1 − λ_init)
        (fused, :class:`DifferentialHeads`, when the backend gave the two maps apart); z otherwise."""
        if not self.differential:
            return out.z
        if out.z2 is not None:
            norm = self.sub_norm
            lam = self.differential_lambda().to(out.z.dtype)
            return DifferentialHeads.apply(out.z, out.z2, lam, norm.weight, norm.eps, 1 - self.lambda_init)
        z = self.combine_maps(out.z) if out.z.shape[1] == self.query_heads else out.z
        return self.sub_norm(z) * (1 - self.lambda_init)

    # ---------------------------------------------------------------------------------------------- decoding

    def decode_reason(self) -> str | None:
        if self.differential:
            return "differential attention has no token-by-token form here"
        if self.selective:
            return "selective attention has no token-by-token form here (F sums over every earlier query's row)"
        if self.position_bias is not None or getattr(self.score, "has_value_term", False):
            return (
                f"a position bias ({type(self.position_bias or self.score).__name__}) has no token-by-token form here"
            )
        mask = None if self.mask_config is None else build_mask(self.mask_config)
        if mask is None or not mask.position_only or not hides_later_keys(mask):
            return "only a causal layer (mask=causal, or a causal window) decodes one token at a time"
        return None

    def step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, x: Tensor, position: int) -> tuple[Tensor, Any]:
        """The key/value cache: this token's k and v appended, its query over the keys the mask lets it see."""
        t = position
        B = q.shape[0]
        if state is None or t == state.k.shape[2]:  # grow the preallocated cache (doubling)
            capacity = max(16, 2 * t)
            grown = KVCache(
                k.new_zeros(B, k.shape[1], capacity, k.shape[-1]), v.new_zeros(B, v.shape[1], capacity, v.shape[-1]), t
            )
            if state is not None:
                grown.k[:, :, :t], grown.v[:, :, :t] = state.k[:, :, :t], state.v[:, :, :t]
            state = grown
        state.k[:, :, t : t + 1] = k
        state.v[:, :, t : t + 1] = v
        state.length = t + 1
        keys, values = state.k[:, :, : t + 1], state.v[:, :, : t + 1]
        row = self.visible_keys(t, q.device)  # (1, t + 1)
        logits = self.logits(q, keys)  # (B, Hq, 1, t + 1)
        weights = self.normalize(logits, PreparedMask.from_tensor(row.view(1, 1, 1, t + 1)), values.dtype)
        return self.mix_values(weights, values), state  # (B, H, 1, d_v)

    def visible_keys(self, position: int, device: torch.device) -> Tensor:
        """(1, position + 1) bool: the keys the query at ``position`` sees under the layer's (causal) mask."""
        mask = build_mask(self.mask_config)
        query = torch.tensor([[position]], device=device)
        return torch.as_tensor(mask.mask_mod(query, torch.arange(position + 1, device=device)[None], None, None))

    def state_size(self, length: int) -> int:
        """The key/value cache: (Gk·d_k + G·d_v) per cached key; under a position-only mask that hides later keys,
        the keys the last query sees (a causal window: the window), else every key."""
        return self._cached_keys(length) * (self.key_heads * self.d_k + self.sizes.num_kv_heads * self.d_v)

    def prefill(
        self, batch: int, length: int, generator: torch.Generator, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        """Random keys and values of ``length`` tokens, with room for 64 more."""
        room = length + 64
        k = torch.randn(batch, self.key_heads, room, self.d_k, generator=generator).to(device, dtype)
        v = torch.randn(batch, self.sizes.num_kv_heads, room, self.d_v, generator=generator).to(device, dtype)
        return KVCache(k, v, length)

    def _cached_keys(self, length: int) -> int:
        mask = None if self.mask_config is None else build_mask(self.mask_config)
        if length <= 0 or mask is None or not mask.position_only or not hides_later_keys(mask):
            return max(length, 0)
        last = torch.tensor([[length - 1]])  # (1, 1): one query row, not the (L, L) mask
        return int(torch.as_tensor(mask.mask_mod(last, torch.arange(length)[None, :], None, None)).sum())

    def extra_repr(self) -> str:
        extra = []
        if self.softcap is not None:
            extra.append(f"softcap={self.softcap:g}")
        if self.differential:
            extra.append(f"differential, lambda_init={self.lambda_init:.3f}")
        return ", ".join(extra)
