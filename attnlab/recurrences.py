"""Decay and delta-rule attention, as before 0.7: the forms are :mod:`attnlab.forms.transitions` (RetNet, GLA,
DeltaNet, Gated DeltaNet) and their math is :mod:`attnlab.transition` (one transition record). The functions here
keep their old signatures (``log_alpha`` (B, H, L) per head, or per key channel (B, H, L, d_k); ``beta``)."""

from __future__ import annotations

from torch import Tensor

from attnlab import transition
from attnlab.forms.transitions import GLA, DeltaNet, GatedDeltaNet, RetNet, TransitionForm, retnet_decays
from attnlab.transition import Transition

__all__ = [
    "GLA",
    "DeltaNet",
    "GatedDeltaNet",
    "RetNet",
    "TransitionForm",
    "chunked_form",
    "effective_matrix",
    "recurrent_form",
    "retnet_decays",
    "state_step",
]


def _record(log_alpha: Tensor | None, beta: Tensor | None) -> Transition | None:
    return None if log_alpha is None and beta is None else Transition(log_alpha, beta)


def state_step(
    state: Tensor | None, q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor | None = None, beta: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One token (:func:`attnlab.transition.step`): q, k (B, H, d_k), v (B, H, d_v), log α and β (B, H) or None."""
    return transition.step(state, q, k, v, _record(log_alpha, beta))


def recurrent_form(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor | None = None, beta: Tensor | None = None
) -> Tensor:
    """One token at a time (:func:`attnlab.transition.recurrent`)."""
    return transition.recurrent(q, k, v, _record(log_alpha, beta))


def chunked_form(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor | None = None,
    beta: Tensor | None = None,
    chunk_size: int = 64,
) -> Tensor:
    """In chunks (:func:`attnlab.transition.chunked`)."""
    return transition.chunked(q, k, v, _record(log_alpha, beta), chunk_size)


def effective_matrix(q: Tensor, k: Tensor, log_alpha: Tensor | None = None, beta: Tensor | None = None) -> Tensor:
    """The (L, L) map from v to the output (:func:`attnlab.transition.effective_matrix`)."""
    return transition.effective_matrix(q, k, _record(log_alpha, beta))
