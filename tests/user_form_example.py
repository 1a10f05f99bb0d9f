"""A user's form in one file, as ``imports=[user_form_example]`` would load it: a Mamba-2-style scalar decay.

Mamba-2's state space duality (Dao & Gu 2024) with a scalar A per head is a decay form: the state
M_t = α_t M_{t−1} + k_t v_tᵀ, read as o_t = M_tᵀ q_t, with

    log α_t = −softplus(a_h) · softplus(x_t w_h + b_h)        (A = −softplus(a) < 0, Δ_t = softplus(x w + b) > 0)

so α_t = exp(Δ_t A) ∈ (0, 1), one per token and head. Everything else (q·k/√d_k, the output norm, the chunked and
recurrent backends, decoding, the effective matrix the diagnostics read) is :class:`TransitionForm`'s. Importing
this module registers the form as ``test_user_decay``; a layer with ``score="test_user_decay"`` (normalizer none,
mask causal) computes it. The tests that import it remove it from the registry again (tests/test_forms.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.forms import register_form
from attnlab.forms.transitions import TransitionForm

NAME = "test_user_decay"


@register_form(NAME)
class UserDecay(TransitionForm):
    """log α_t = −softplus(a_h) · softplus(x_t w_h + b_h), per head; no delta rule (β)."""

    tags = frozenset({"recurrent", "decay"})
    implements = TransitionForm.implements  # what it computes: its parent's knobs (declared, never inherited)

    def build(self) -> None:
        self.dt_proj = nn.Linear(self.d_model, self.num_heads)  # Δ's pre-activation x w_h + b_h
        self.a = nn.Parameter(torch.zeros(self.num_heads))  # −A = softplus(a) = log 2 at first

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        dt = F.softplus(self.dt_proj(x)).transpose(1, 2)  # (B, H, L)
        return -F.softplus(self.a)[:, None] * dt, None
