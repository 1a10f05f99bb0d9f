"""The ``linear`` form: linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"):

    out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + ε)          (without the denominator for ``none``)

the ``linear`` score (φ(q)·φ(k), :class:`~attnlab.scores.LinearScore`, any feature map) with the ``rowsum`` (or
``none``) normalizer, no position bias, soft-cap or differential maps. Its quadratic form is the softmax form's
pipeline with that score and normalizer (the reference, and what the diagnostics read); its O(L) forms are the
transition record's no-decay case (:mod:`attnlab.transition`: M_t = M_{t−1} + φ(k_t) v_tᵀ, as fla's linear attention
calls its simple-GLA kernel) with the row-sum normaliser as one more value column of ones: the state is
[S z] (d_φ × (d_v + 1) per head) and out_i = φ(q_i) S_i / (φ(q_i)·z_i + ε). Key padding hides a key by zeroing its
features, which is exactly what the masked quadratic form computes; a row that sees no key gets 0 (0 / ε).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import attnlab.transition as transition
from attnlab.config import AttentionConfig
from attnlab.forms.base import FormInputs, expand_heads, knobs, register_form
from attnlab.forms.softmax import SoftmaxForm

__all__ = ["LinearForm", "linear_attention_global"]


def linear_attention_global(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Linear attention with every key visible: φ(Q) (φ(K)ᵀ V). phi_q (B, H, Lq, F), phi_k (B, H, Lk, F),
    v (B, H, Lk, D) → (B, H, Lq, D)."""
    out = torch.matmul(phi_q, torch.matmul(phi_k.transpose(-1, -2), v))  # (B, H, Lq, D)
    if normalize:
        out = out / (torch.matmul(phi_q, phi_k.sum(-2).unsqueeze(-1)) + eps)
    return out


@register_form("linear")
class LinearForm(SoftmaxForm):
    """Linear attention (module docstring): the ``linear`` score with ``rowsum`` or ``none``."""

    tags = frozenset({"linear", "recurrent"})
    implements = knobs(normalizer=("rowsum", "none"), normalizer_params=None)
    refusals = knobs(
        selective="selective attention is a softmax mechanism (it subtracts from the softmax logits; linear "
        "attention's O(L) forms have none)",
        position_bias="linear attention's O(L) forms have no logits to bias (the softmax form computes a linear "
        "score with a bias quadratically: variant.name=linear normalizer=softmax)",
        softcap="linear attention's O(L) forms have no logits to cap",
        differential="linear attention has one feature map per head",
    )

    @classmethod
    def reason(cls, config: AttentionConfig) -> str | None:
        """None when ``config`` is linear attention (this form claims it), else the first stage that is not, in one
        line (what the O(L) backends give when they refuse another form)."""
        from attnlab.normalizers import _NORMALIZERS
        from attnlab.scores import _SCORES, LinearScore

        score = _SCORES.get(config.score) if config.score in _SCORES else None
        if not (isinstance(score, type) and issubclass(score, LinearScore)):
            return f"it computes linear attention only (variant=linear), not {config.score}"
        normalizer = _NORMALIZERS.get(config.normalizer) if config.normalizer in _NORMALIZERS else None
        if not getattr(normalizer, "is_linear", False):
            return f"it normalizes by the row sum or not at all (normalizer=rowsum|none), not {config.normalizer}"
        if config.position_bias is not None:
            return "it has no position bias"
        if config.softcap is not None:
            return "it has no soft-capping"
        if config.differential:
            return "it has no differential attention"
        return None

    @classmethod
    def claims(cls, config: AttentionConfig) -> bool:
        return cls.reason(config) is None

    def features(self) -> frozenset[str]:
        return frozenset({"form:linear"})

    @property
    def normalize_rows(self) -> bool:
        return bool(self.normalizer.normalize_rows)

    def feature_inputs(self, inputs: FormInputs) -> tuple[Tensor, Tensor, Tensor]:
        """→ φ(q) (B, H, Lq, F), φ(k) (B, H, Lk, F) with hidden (padded) keys zeroed, v (B, H, Lk, d_v)."""
        pm = inputs.mask
        phi_q, phi_k = self.score.features(inputs.q, expand_heads(inputs.k, self.query_heads))
        if pm is not None and pm.keys is not None:
            phi_k = phi_k * pm.keys.transpose(-1, -2).to(phi_k.dtype)  # (B, 1, Lk, 1): padded keys add nothing
        return phi_q, phi_k, expand_heads(inputs.v, self.num_heads)

    def _with_ones(self, v: Tensor) -> Tensor:
        return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if self.normalize_rows else v  # (B, H, L, D + 1)

    def _divide(self, out: Tensor, d_v: int) -> Tensor:
        if not self.normalize_rows:
            return out
        return out[..., :d_v] / (out[..., d_v:] + float(self.normalizer.eps))

    def chunked(self, inputs: FormInputs, chunk_size: int) -> Tensor:
        phi_q, phi_k, v = self.feature_inputs(inputs)
        if phi_q.shape[2] == 0:
            return v.new_zeros(*v.shape)
        out = transition.chunked(phi_q, phi_k, self._with_ones(v), None, chunk_size)
        return self._divide(out, v.shape[-1])

    def recurrent(self, inputs: FormInputs) -> Tensor:
        phi_q, phi_k, v = self.feature_inputs(inputs)
        return self._divide(transition.recurrent(phi_q, phi_k, self._with_ones(v), None), v.shape[-1])

    def bidirectional(self, inputs: FormInputs) -> Tensor:
        """Every key visible (or key padding only): φ(Q) (φ(K)ᵀ V) (:func:`linear_attention_global`)."""
        phi_q, phi_k, v = self.feature_inputs(inputs)
        return linear_attention_global(phi_q, phi_k, v, self.normalize_rows, float(self.normalizer.eps))

    def decode_reason(self) -> str | None:
        if getattr(self.score.feature_map, "positional", False):
            return f"the {self.score.feature_map_name} feature map reads the sequence length"
        return super().decode_reason()

    def step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, x: Tensor, position: int) -> tuple[Tensor, Any]:
        """The state [S z] (B, H, F, d_v + 1): S ← S + φ(k) vᵀ, z ← z + φ(k), out = φ(q) S / (φ(q)·z + ε)."""
        phi_q, phi_k, v = self.feature_inputs(FormInputs(q, k, v))
        o, state = transition.step(state, phi_q[:, :, 0], phi_k[:, :, 0], self._with_ones(v)[:, :, 0], None)
        return self._divide(o, v.shape[-1]).unsqueeze(2), state  # (B, H, 1, d_v)

    def prefill(
        self, batch: int, length: int, generator: torch.Generator, device: torch.device, dtype: torch.dtype
    ) -> Tensor:
        """[S z]: S random / d_φ, z ones (B, H, d_φ, d_v + 1)."""
        F = self.score.feature_dim
        S = torch.randn(batch, self.num_heads, F, self.d_v, generator=generator) / F
        return self._with_ones(S).to(device, dtype)

    def state_size(self, length: int) -> int:
        """H·(d_φ·d_v + d_φ) (S and z; H·d_φ·d_v without the row-sum normaliser), whatever the length."""
        return self.num_heads * self.score.feature_dim * (self.d_v + (1 if self.normalize_rows else 0))
