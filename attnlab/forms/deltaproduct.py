"""DeltaProduct (Siems et al. 2025): n generalized Householder steps per token, a form in one file.

Gated DeltaNet (:class:`~attnlab.forms.transitions.GatedDeltaNet`) multiplies the state by one generalized
Householder matrix I − β k kᵀ per token, whose eigenvalues are 1 (d_k − 1 times) and 1 − β: a diagonal-like
transition that cannot compose permutations (Merrill et al. 2024; Grazzi et al. 2025). DeltaProduct takes n of them
per token, each with its own key, value and β, so that a token's transition is a product of n generalized
Householder factors; with β ∈ (0, 2) (``beta_range=2``: reflections at β = 2) a product of n of them can represent
any permutation of n + 1 elements (Siems et al. 2025, §3). The transition
record is :class:`~attnlab.transition.Transition` with ``householder_steps = n``; :mod:`attnlab.transition`
computes it exactly, chunked, as the delta rule over the L·n steps read at each token's last.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from attnlab.checks import check_choice, check_int
from attnlab.config import AttentionConfig
from attnlab.forms.base import register_form
from attnlab.forms.transitions import BETA_RANGES, GATES, GatedDeltaNet, _Gate
from attnlab.transition import Transition

__all__ = ["DeltaProduct"]


def _householder_steps(config: AttentionConfig) -> int:
    return check_int("householder_steps", config.score_params.get("householder_steps", 2), minimum=1)


@register_form("deltaproduct")
class DeltaProduct(GatedDeltaNet):
    """Gated DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder
    Products", eq. 4 with the gate of §3.3): with n = ``householder_steps`` keys k_{t,s}, values v_{t,s} and
    β_{t,s} per token (the layer projects n·G key and value heads and H·n β outputs, all step-major as fla's
    ``GatedDeltaProduct``: :meth:`gates`; k L2-normalised per step, q as
    :meth:`~attnlab.forms.transitions.DeltaNet.maps`),

        M_t = (Π_{s=n..1} (I − β_{t,s} k_{t,s} k_{t,s}ᵀ)) Diag(α_t) M_{t−1}
              + Σ_s (Π_{s' = n..s+1} (I − β_{t,s'} k_{t,s'} k_{t,s'}ᵀ)) β_{t,s} k_{t,s} v_{t,s}ᵀ,     o_t = M_tᵀ q_t,

    i.e. the decay, then n delta-rule steps in order (with a per-head gate Diag(α_t) is the paper's scalar α_t, which
    commutes with the product). n = 1 is Gated DeltaNet (same parameters, same output), and
    the decay is optional (``gate=none``: DeltaProduct without the gate).

    Args:
        householder_steps: n ≥ 1 (default 2, the paper's n_h = 2).
        gate: the decay's gate as :class:`GatedDeltaNet`'s (``head`` by default, ``mamba2``, ``channel``, ``kda``),
            or ``none`` (α ≡ 1).
        gate_normalizer, gate_rank: as :class:`GatedDeltaNet`'s.
        beta_range: 1 (β ∈ (0, 1)) or 2 (β = 2σ(·) ∈ (0, 2): negative eigenvalues, Grazzi et al. 2025; the paper's
            state-tracking runs use 2).
    """

    tags = frozenset({"recurrent", "decay", "delta"})
    implements = GatedDeltaNet.implements
    settings: ClassVar[dict[str, dict[str, Any]]] = {"beta2": {"beta_range": 2}}

    @classmethod
    def key_maps(cls, config: AttentionConfig) -> int:
        return _householder_steps(config)

    @classmethod
    def value_maps(cls, config: AttentionConfig) -> int:
        return _householder_steps(config)

    def build(  # type: ignore[override]
        self,
        householder_steps: int = 2,
        gate: str | None = None,
        gate_normalizer: float = 16.0,
        gate_rank: int | None = None,
        beta_range: int = 1,
    ) -> None:
        self.householder_steps = check_int("householder_steps", householder_steps, minimum=1)
        self.beta_range = check_choice("beta_range", beta_range, BETA_RANGES)
        self.beta_gate = _Gate(self.d_model, self.num_heads * self.householder_steps)
        gate = check_choice("gate", "head" if gate is None else gate, (*GATES, "none"))
        if gate == "none":
            self.gate = "none"
        else:
            self.build_decay(gate, gate_normalizer, gate_rank)

    def per_step(self, t: Tensor) -> Tensor:
        """(B, n·G, L, d), the layer's heads step-major (step s, head g at s·G + g) → (B, G, L·n, d), token t's step
        s at t·n + s."""
        n = self.householder_steps
        if n == 1:
            return t
        B, heads, L, d = t.shape
        return t.view(B, n, heads // n, L, d).permute(0, 2, 3, 1, 4).reshape(B, heads // n, L * n, d)

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """log α (B, H, L) or (B, H, L, d_k), or None (``gate=none``); β (B, H, L·n), one per step, token t's step s
        at t·n + s. ``beta_gate.proj``'s H·n outputs are read step-major, output s·H + h being head h's β at step s:
        flash-linear-attention's layout (``GatedDeltaProduct``: ``'... t (n h) -> ... (t n) h'``) and that of the
        layer's n·G key and value heads (:meth:`per_step`). (Before issue 60 they were read head-major, h·n + s: a
        checkpoint saved then with n > 1 and H > 1 loads, but its β rows land on other heads and steps.)"""
        B, L = x.shape[:2]
        n = self.householder_steps
        beta = torch.sigmoid(self.beta_gate.proj(x)).view(B, L, n, self.num_heads).permute(0, 3, 1, 2)  # (B,H,L,n)
        beta = beta.reshape(B, self.num_heads, L * n)
        if self.beta_range != 1:
            beta = self.beta_range * beta
        return (None if self.gate == "none" else self.log_alpha(x)), beta

    def inputs(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Transition]:
        q, k = self.maps(q, k)
        log_decay, beta = self.gates(x)
        return q, k, Transition(log_decay, beta, None, self.householder_steps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, householder_steps={self.householder_steps}, gate={self.gate}"
