"""The one recurrence behind linear attention, decay and the delta rule: a :class:`Transition` record and its forms.

Every recurrent variant of the bench carries one state M (B, H, d_k, d_v) along the sequence (the transpose of the
papers' S = Mᵀ) and reads it with the query. They differ only in what carries M from token t−1 to t, recorded
by a :class:`Transition`: a decay α_t ∈ (0, 1] (``log_decay``, log α ≤ 0, one per head or one per key channel, or
None for α ≡ 1) and a writing strength β_t (``beta``, or None for the plain sum):

    M_t = diag(α_t) M_{t−1} + k_t v_tᵀ                                   (decay; α ≡ 1: linear attention)
    M_t = (I − β_t k_t k_tᵀ) diag(α_t) M_{t−1} + β_t k_t v_tᵀ             (delta rule)
    o_t = M_tᵀ q_t

The decay acts first, then the delta rule writes on the decayed state: with M' = diag(α_t) M_{t−1},
u_t = β_t (v_t − M'ᵀ k_t) and M_t = M' + k_t u_tᵀ. With a per-head α (a scalar per token and head) diag(α_t)
commutes with everything and this is the papers' α_t (I − β_t k_t k_tᵀ) M_{t−1} + β_t k_t v_tᵀ; a per-channel α
scales the rows of M (the key dimension), Kimi Delta Attention's order.

================================  ============================================  =======================  =========
setting                           paper                                         log_decay                beta
================================  ============================================  =======================  =========
linear attention                  Katharopoulos et al. 2020                     None                     None
RetNet (retention)                Sun et al. 2023                               per head, constant       None
GLA, scalar gate ("simple GLA")   Yang et al. 2024 (GLA); Mamba-2, Dao & Gu     per head (B, H, L)       None
GLA, per-channel gate             Yang et al. 2024, "Gated Linear Attention"    per channel (B,H,L,d_k)  None
DeltaNet                          Schlag et al. 2021; Yang et al. 2024          None                     (B, H, L)
Gated DeltaNet                    Yang et al. 2025, "Gated Delta Networks"      per head (B, H, L)       (B, H, L)
Kimi Delta Attention (KDA)        Kimi Team 2025, "Kimi Linear"                 per channel (B,H,L,d_k)  (B, H, L)
DeltaProduct (n steps a token)    Siems et al. 2025                             per head or channel      (B,H,L·n)
RWKV-7 (+ ``low_rank`` (a, b))    Peng et al. 2025, "RWKV-7 Goose"              per channel (B,H,L,d_k)  None
================================  ============================================  =======================  =========

With the cumulative log-decays b_t = Σ_{m≤t} log α_m (per head, or per channel (L, d_k)) and u_t the delta rule's
new value (u_t = v_t without it), unrolling gives o = P U with the lower-triangular

    P_tj = Σ_c q_tc k_jc exp(b_tc − b_jc)   (j ≤ t),     per head: P = Q Kᵀ ⊙ Γ, Γ_tj = exp(b_t − b_j)
    U = T diag(β) V,   T = (I + strictly_lower(diag(β) G))⁻¹,   G_tj = Σ_c k_tc k_jc exp(b_tc − b_jc)   (WY/UT form)

so the **effective attention matrix** from v to the output is P (decay) or P T diag(β) (delta rule, signed).
Four functions compute the same numbers:

* :func:`step`: one token (the form that decodes); :func:`recurrent`: :func:`step` over the sequence.
* :func:`chunked`: chunks of C tokens, the quadratic form within a chunk on chunk-local decays (a batched
  unit-triangular solve for the delta rule), the state across chunks; O(L·C) memory. Every exponent is a difference
  b̃_t − b̃_j, j ≤ t, inside one chunk, a chunk-local b̃_t ≤ 0 or b̃_C − b̃_t ≤ 0, so no product of gates overflows
  whatever L. A per-channel P and G are made by halving blocks (:func:`_lower_channels`): each block below the
  diagonal is a matrix product of factors e^{b̃_i − b̃_r} and e^{b̃_r − b̃_j}, both ≤ 1, with r between j and i, never a
  product e^{b̃} · e^{−b̃} and never the (C, C, d_k) tensor of differences (O(C² + C·d_k·log C) memory a chunk).
  Factors are at least e^{log(eps) − 7} (:func:`_decay_exp`: no subnormal arithmetic). Linear attention
  (no decay, no β) is :class:`_CausalLinear`, the masked form with a backward pass written by hand (no second
  derivative).
* :func:`effective_matrix`: the (L, L) matrix, :func:`chunked` applied to the identity V = I (column j of the output
  is the matrix's column j), so its numbers are the chunked form's, every exponent chunk-local; O(L² (C + d_k)) work.

β may lie in (0, 2) (Grazzi et al. 2025: I − β k kᵀ with ‖k‖ = 1 has the eigenvalue 1 − β ∈ (−1, 1)); nothing here
assumes β ≤ 1. Two richer transitions (:class:`Transition`'s ``householder_steps`` and ``low_rank``):

* **DeltaProduct** (Siems et al. 2025): n Householder steps per token, each with its own key, value and β. It is
  the delta rule over the L·n steps, the decay at each token's first, the output read at its last; the chunked form
  and the effective matrix keep P's read rows only (C rows against a chunk's C·n steps; with a per-head decay or
  none they are the only rows computed, with a per-channel one the halving blocks make the steps' square first).
* **Diagonal plus low rank** (RWKV-7, Peng et al. 2025): M_t = (diag(α_t) + b_t a_tᵀ) M_{t−1} + k_t v_tᵀ. With
  u_t = a_tᵀ M_{t−1} (the state before the decay), a chunk is U = (I − A_ab)⁻¹ (A_ak V + (a ⊙ e^{b̃_{t−1}}) M₀),
  O = (q ⊙ e^{b̃}) M₀ + P_qb U + P_qk V, the four per-channel matrices by the halving route (every factor ≤ 1)
  (:func:`_low_rank_chunked`; the effective matrix P_qk + P_qb (I − A_ab)⁻¹ A_ak is its map from V).
This module is the bottom layer: it imports torch and :mod:`attnlab.checks` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnlab.checks import check_int

__all__ = ["Transition", "chunked", "effective_matrix", "recurrent", "step"]


# ---------------------------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Transition:
    """What carries the state M (B, H, d_k, d_v) from token t−1 to t (M is the transpose of the papers' S):

        M_t = (I − β_t k_t k_tᵀ) diag(α_t) M_{t−1} + β_t k_t v_tᵀ     (delta rule)
        M_t = diag(α_t) M_{t−1} + k_t v_tᵀ                             (without β)
        M_t = (diag(α_t) + b_t a_tᵀ) M_{t−1} + k_t v_tᵀ                (``low_rank`` (a, b): diagonal plus low rank)
        o_t = M_tᵀ q_t

    i.e. the decay first (M' = diag(α_t) M_{t−1}, the rows of M, the key dimension), then the delta rule's write on
    the decayed state, u_t = β_t (v_t − M'ᵀ k_t), M_t = M' + k_t u_tᵀ (for a per-head α, the same as the papers'
    α_t (I − β_t k_t k_tᵀ) M_{t−1} + β_t k_t v_tᵀ).

    log_decay: log α ≤ 0, per head (B, H, L) or per key channel (B, H, L, d_k), or None (α ≡ 1: linear attention);
        a token's record (:meth:`at`) holds (B, H) or (B, H, d_k).
    beta: writing strength β (B, H, L·n) (a token's: (B, H), or (B, H, n) when n > 1), or None (the plain sum).
    low_rank: (a, b), each (B, H, L, d_k) (a token's: (B, H, d_k)), or None: the diagonal-plus-low-rank transition
        diag(α_t) + b_t a_tᵀ, which reads the state before the decay, u_t = a_tᵀ M_{t−1}, and writes b_t u_t (the
        transpose of RWKV-7's and fla's ``generalized_delta_rule`` S_t = S_{t−1} (diag(w_t) + a_tᵀ b_t) + v_tᵀ k_t;
        RWKV-7's a = −κ̂, b = κ̂ ⊙ a_t, Peng et al. 2025). With β None and n = 1 only (the delta rule is its case
        a = −α ⊙ k, b = β k).
    householder_steps: n ≥ 1 generalized Householder steps per token (DeltaProduct, Siems et al. 2025): k and v
        hold n keys and values per token, (B, H, L·n, ·) with token t's step s at t·n + s (a token's: (B, H, n, ·)),
        and β one per step; the decay acts once per token, before its steps:

            M ← diag(α_t) M;   M ← M + k_{t,s} (β_{t,s} (v_{t,s} − Mᵀ k_{t,s}))ᵀ for s = 1 … n;   o_t = Mᵀ q_t

        n = 1 is the delta rule. q holds one query per token, (B, H, L, d_k).
    """

    log_decay: Tensor | None = None
    beta: Tensor | None = None
    low_rank: tuple[Tensor, Tensor] | None = None
    householder_steps: int = 1

    @property
    def per_channel(self) -> bool:
        """Whether the decay is per key channel: ``log_decay`` (B, H, L, d_k) in a sequence's record. (A token's
        record (B, H, d_k) has as many axes as a sequence's per-head one; :func:`step` tells them apart by q.)"""
        return self.log_decay is not None and self.log_decay.dim() == 4

    def _check_fields(self) -> None:
        n = self.householder_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"transition.householder_steps must be an integer >= 1, got {n!r}")
        if n > 1 and (self.beta is None or self.low_rank is not None):
            raise ValueError(
                f"transition.householder_steps={n} takes a beta (one per step) and no low_rank (DeltaProduct's steps "
                "are delta-rule steps)"
            )
        if self.low_rank is not None:
            pair = self.low_rank
            if not (isinstance(pair, tuple) and len(pair) == 2):
                shown = f"a tuple of {len(pair)}" if isinstance(pair, tuple) else type(pair).__name__
                raise ValueError(f"transition.low_rank must be a pair (a, b) of Tensors, got {shown}")
            for i, t in enumerate(pair):
                if not isinstance(t, Tensor):
                    raise ValueError(
                        f"transition.low_rank[{i}] must be a Tensor (low_rank is a pair (a, b) of Tensors), got "
                        f"{type(t).__name__}"
                    )
            if self.beta is not None:
                raise ValueError(
                    "transition.low_rank takes no beta: the delta rule is its case a = -alpha * k, b = beta * k"
                )

    def at(self, t: int) -> Transition:
        """Token t's record: log_decay (B, H) or (B, H, d_k), beta (B, H) (n = 1) or (B, H, n), low_rank's a and b
        (B, H, d_k)."""
        self._check_fields()
        n = self.householder_steps
        beta = self.beta
        if beta is not None:
            beta = beta[:, :, t] if n == 1 else beta[:, :, t * n : (t + 1) * n]
        return Transition(
            None if self.log_decay is None else self.log_decay[:, :, t],
            beta,
            None if self.low_rank is None else (self.low_rank[0][:, :, t], self.low_rank[1][:, :, t]),
            n,
        )

    def padded(self, n: int) -> Transition:
        """The record with L padded by ``n`` tokens of log α = 0, β = 0 and a = b = 0 (they leave the state as it
        was when their k is 0)."""
        self._check_fields()
        log_decay = self.log_decay
        if log_decay is not None:
            log_decay = F.pad(log_decay, (0, 0, 0, n) if self.per_channel else (0, n))
        beta = None if self.beta is None else F.pad(self.beta, (0, n * self.householder_steps))
        low_rank = None if self.low_rank is None else tuple(F.pad(t, (0, 0, 0, n)) for t in self.low_rank)
        return Transition(log_decay, beta, low_rank, self.householder_steps)  # type: ignore[arg-type]

    def check(self, q: Tensor, k: Tensor) -> None:
        """One-line ``ValueError`` unless the record fits q, k: (B, H, L, d_k) for a sequence (k (B, H, L·n, d_k)),
        with log_decay (B, H, L) or (B, H, L, d_k), beta (B, H, L·n), low_rank's a, b (B, H, L, d_k); or
        (B, H, d_k) for one token (k (B, H, n, d_k) when n > 1), with log_decay (B, H) or (B, H, d_k), beta (B, H)
        or (B, H, n), a, b (B, H, d_k)."""
        self._check_fields()
        n = self.householder_steps
        if q.dim() not in (3, 4):
            raise ValueError(f"q must be (B, H, L, d_k) or one token's (B, H, d_k), got shape {tuple(q.shape)}")
        names = "(B, H, L" if q.dim() == 4 else "(B, H"
        lead = tuple(q.shape[:-1])
        if n == 1:
            k_shape, beta_shape, k_names = tuple(q.shape), lead, f"q's shape {names}, d_k)"
        elif q.dim() == 4:
            k_shape = (*lead[:2], lead[2] * n, q.shape[-1])
            beta_shape, k_names = k_shape[:-1], f"(B, H, L·n, d_k) with n = householder_steps = {n}"
        else:
            k_shape = (*lead, n, q.shape[-1])
            beta_shape, k_names = k_shape[:-1], f"one token's (B, H, n, d_k) with n = householder_steps = {n}"
        if tuple(k.shape) != k_shape:
            raise ValueError(f"k must have {k_names} = {k_shape}, got {tuple(k.shape)}")
        beta_names = f"{names})" if n == 1 else ("(B, H, L·n)" if q.dim() == 4 else "(B, H, n)")
        fields: list[tuple[str, Any, tuple[tuple[int, ...], ...], str]] = [
            (
                "log_decay",
                self.log_decay,
                (lead, tuple(q.shape)),
                f"{names}) = {lead} per head or {names}, d_k) = {tuple(q.shape)} per key channel",
            ),
            ("beta", self.beta, (beta_shape,), f"{beta_names} = {beta_shape}"),
        ]
        if self.low_rank is not None:
            fields += [
                (f"low_rank[{i}]", t, (tuple(q.shape),), f"{names}, d_k) = {tuple(q.shape)}")
                for i, t in enumerate(self.low_rank)
            ]
        for name, value, allowed, expected in fields:
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise ValueError(f"transition.{name} must be a Tensor or None, got {type(value).__name__}")
            if tuple(value.shape) not in allowed:
                raise ValueError(f"transition.{name} must have shape {expected}, got {tuple(value.shape)}")


def _resolve(transition: Transition | None) -> Transition:
    if transition is None:
        return Transition()
    if not isinstance(transition, Transition):
        raise ValueError(f"transition must be a Transition or None, got {type(transition).__name__}")
    return transition


def _check_v(k: Tensor, v: Tensor) -> None:
    if v.dim() != k.dim() or tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        names = {4: "(B, H, L, d_v)", 3: "(B, H, d_v)"}.get(v.dim(), "k's shape with d_v last")
        raise ValueError(f"v must be {names} with k's {tuple(k.shape[:-1])} before d_v, got {tuple(v.shape)}")


def _check_sequence(q: Tensor, k: Tensor, v: Tensor | None, transition: Transition) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H, L, d_k), got shape {tuple(q.shape)}")
    transition.check(q, k)
    if v is not None:
        _check_v(k, v)


# ---------------------------------------------------------------------------------------------- one token


def _delta(state: Tensor, k: Tensor, v: Tensor, beta: Tensor | None) -> Tensor:
    """M + k (β (v − Mᵀ k))ᵀ, or M + k vᵀ without β: state (B, H, d_k, d_v), k (B, H, d_k), v (B, H, d_v)."""
    u = v if beta is None else beta.unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    return state + k.unsqueeze(-1) * u.unsqueeze(-2)


def _step(state: Tensor | None, q: Tensor, k: Tensor, v: Tensor, record: Transition) -> tuple[Tensor, Tensor]:
    if state is None:
        state = q.new_zeros(*q.shape, v.shape[-1])
    log_decay = record.log_decay
    read = None
    if record.low_rank is not None:  # u = aᵀ M_{t−1}: read before the decay
        read = torch.einsum("bhk,bhkv->bhv", record.low_rank[0], state)
    if log_decay is not None:
        if log_decay.dim() == q.dim():  # per key channel (B, H, d_k): the rows of M
            state = state * log_decay.exp()[..., None]
        else:
            state = state * log_decay.exp()[..., None, None]
    if read is not None:
        state = state + record.low_rank[1].unsqueeze(-1) * read.unsqueeze(-2)  # + b (aᵀ M_{t−1})
    if record.householder_steps == 1:
        state = _delta(state, k, v, record.beta)
    else:  # DeltaProduct: the token's n steps in order
        for s in range(record.householder_steps):
            state = _delta(state, k[:, :, s], v[:, :, s], record.beta[:, :, s])
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def step(
    state: Tensor | None, q: Tensor, k: Tensor, v: Tensor, transition_t: Transition | None = None
) -> tuple[Tensor, Tensor]:
    """One token (the form that decodes): state M (B, H, d_k, d_v) or None (the start, zeros), the token's q
    (B, H, d_k), k (B, H, d_k) and v (B, H, d_v) (with n = ``householder_steps`` > 1: k (B, H, n, d_k),
    v (B, H, n, d_v)) and record (:meth:`Transition.at`) → (o (B, H, d_v), the new M):

        with low_rank: u = aᵀ M;  M ← diag(α) M;  with low_rank: M ← M + b u;
        then M ← M + k vᵀ, or with β: M ← M + k (β (v − Mᵀ k))ᵀ, n times with n steps;  o = Mᵀ q

    (Katharopoulos et al. 2020; Sun et al. 2023; Yang et al. 2024, GLA; Schlag et al. 2021 and Yang et al. 2024,
    DeltaNet; Yang et al. 2025, Gated DeltaNet; Kimi Team 2025, KDA; Siems et al. 2025, DeltaProduct; Peng et al.
    2025, RWKV-7)."""
    record = _resolve(transition_t)
    if q.dim() != 3:
        raise ValueError(f"q must be one token's (B, H, d_k), got shape {tuple(q.shape)}")
    record.check(q, k)
    _check_v(k, v)
    if state is not None and tuple(state.shape) != (*q.shape, v.shape[-1]):
        raise ValueError(
            f"state must be (B, H, d_k, d_v) = {(*q.shape, v.shape[-1])} or None, got {tuple(state.shape)}"
        )
    return _step(state, q, k, v, record)


def recurrent(q: Tensor, k: Tensor, v: Tensor, transition: Transition | None = None) -> Tensor:
    """The form one token at a time (:func:`step` over the sequence), the reference of the others: q
    (B, H, L, d_k), k (B, H, L·n, d_k), v (B, H, L·n, d_v) (n = ``householder_steps``, 1 but for DeltaProduct),
    transition (:class:`Transition`) → o (B, H, L, d_v)."""
    transition = _resolve(transition)
    _check_sequence(q, k, v, transition)
    B, H, L, _ = q.shape
    n = transition.householder_steps
    if n > 1:
        k, v = k.unflatten(2, (L, n)), v.unflatten(2, (L, n))  # (B, H, L, n, ·)
    state, outs = None, []
    for t in range(L):
        o, state = _step(state, q[:, :, t], k[:, :, t], v[:, :, t], transition.at(t))
        outs.append(o)
    return torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1])


# ---------------------------------------------------------------------------------------------- the matrices


def _decay_exp(e: Tensor, hide: Tensor | None = None) -> Tensor:
    """exp of log-decay differences e ≤ 0 (0 where ``hide``, a bool mask, is True), with every e raised to
    log(eps) − 7 of the dtype at least (−22.9 in float32, −43 in float64): such a factor, e^{−22.9} ≈ 1e-10 in place
    of a smaller one, is below what the dtype resolves beside the diagonal's e⁰ = 1, and no factor, nor a product of
    two, lands among the subnormal numbers, whose arithmetic is tens of times slower on x86 CPUs (a KDA training step
    took 2.2× softmax's with them, 1.5× without, L 4096). The mask is applied before exp (an exponent above it may be
    positive and would overflow)."""
    e = e.clamp_min(_log_floor(e.dtype))
    return (e if hide is None else e.masked_fill(hide, float("-inf"))).exp()


def _log_floor(dtype: torch.dtype) -> float:
    """log(eps) − 7 of ``dtype``: the least exponent :func:`_decay_exp` takes."""
    return math.log(torch.finfo(dtype).eps) - 7.0


def _bounded(transition: Transition) -> Transition:
    """The record with each token's log α raised to :func:`_log_floor` at least: the same numbers (a factor across
    such a token is at the floor either way), but the cumulative sums stay finite: a gate of exactly 0 (log α = −∞)
    would give −∞ − (−∞) = NaN, and float16's sums of very strong gates would overflow."""
    if transition.log_decay is None:
        return transition
    return replace(transition, log_decay=transition.log_decay.clamp_min(_log_floor(transition.log_decay.dtype)))


def _tril(n: int, device: torch.device, diagonal: int = 0) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(diagonal)


def _decay_matrix(b: Tensor, diagonal: int = 0) -> Tensor:
    """b (…, n) cumulative log-decays → Γ (…, n, n), exp(b_i − b_j) on and below the ``diagonal``, 0 elsewhere
    (the exponent is masked before exp, so nothing above it overflows)."""
    n = b.shape[-1]
    diff = b.unsqueeze(-1) - b.unsqueeze(-2)  # (…, n, n): b_i − b_j
    return _decay_exp(diff, ~_tril(n, b.device, diagonal))


def _lower(t: Tensor, b: Tensor | None, diagonal: int = 0) -> Tensor:
    """t (…, n, n) on and below the ``diagonal``, 0 above it; times Γ = exp(b_i − b_j) when the cumulative
    log-decays b (…, n) are given (:func:`_decay_matrix`)."""
    if b is None:
        return t.masked_fill(~_tril(t.shape[-1], t.device, diagonal), 0.0)
    return t * _decay_matrix(b, diagonal)


def _channel_decay_matrix(b: Tensor, diagonal: int = 0) -> Tensor:
    """b (…, n, d_k) cumulative log-decays per key channel → Γ (…, n, n, d_k), exp(b_ic − b_jc) for j on and below
    the ``diagonal``, 0 elsewhere (masked before exp: every exponent taken is ≤ 0 when log α ≤ 0)."""
    n = b.shape[-2]
    diff = b.unsqueeze(-2) - b.unsqueeze(-3)  # (…, n, n, d_k): b_ic − b_jc
    return _decay_exp(diff, ~_tril(n, b.device, diagonal).unsqueeze(-1))


CHANNEL_LEAF = 1
"""The size of the diagonal blocks :func:`_lower_channels` computes from the masked (n, n, d_k) differences (the rest
is matrix products). 1 (the diagonal is Σ_c x_ic y_ic) was the fastest, forward and backward, on a 2-core CPU at
C 64, d_k 32: 42, 51, 57, 89, 209 ms for 1, 2, 4, 8, 16, 875 ms for the whole (C, C, d_k) tensor (L 4096, 4 heads)."""


def _lower_channels_direct(x: Tensor, y: Tensor, b: Tensor, diagonal: int = 0) -> Tensor:
    """:func:`_lower_channels` from the masked (…, n, n, d_k) differences (:func:`_channel_decay_matrix`): for
    small n (the diagonal blocks)."""
    return torch.einsum("...ic,...ijc,...jc->...ij", x, _channel_decay_matrix(b, diagonal), y)


def _lower_channels(x: Tensor, y: Tensor, b: Tensor, diagonal: int = 0) -> Tensor:
    """x, y (…, n, d_k), b (…, n, d_k) nonincreasing along n (cumulative log-decays; the leading axes broadcast, so
    x may stack several left factors that share y and b) → (…, n, n):
    Σ_c x_ic y_jc exp(b_ic − b_jc) on and below the ``diagonal``, 0 above it (GLA's and KDA's per-channel P and G).

    Exact without an (n, n, d_k) tensor and without a factor above 1: the blocks of size ≤ :data:`CHANNEL_LEAF` on
    the diagonal from the masked differences (:func:`_lower_channels_direct`); every other block by halving: for
    rows i in the lower half of a block of 2s and columns j in its upper half, with r the last row of the upper
    half (j ≤ r < i),

        exp(b_ic − b_jc) = exp(b_ic − b_rc) · exp(b_rc − b_jc),   both exponents ≤ 0,

    so the block is a matrix product (x ⊙ e^{b − b_r}) (y ⊙ e^{b_r − b})ᵀ of factors in [0, 1]: nothing overflows
    at any gate, and a factor that underflows to 0 stands for a product that is smaller still (Yang et al. 2024,
    GLA §4.2, split the chunk likewise with a reference point, without keeping it between j and i). O(n² + n d_k
    log n) memory, O(n² d_k) work."""
    n, d = x.shape[-2:]
    if n <= CHANNEL_LEAF:
        return _lower_channels_direct(x, y, b, diagonal)
    size = CHANNEL_LEAF
    while size < n:
        size *= 2
    if size > n:  # pad with x = y = 0 and b held at its last value (log α = 0): they add nothing
        x, y = (F.pad(t, (0, 0, 0, size - n)) for t in (x, y))
        b = torch.cat([b, b[..., -1:, :].expand(*b.shape[:-2], size - n, d)], dim=-2)
    s = CHANNEL_LEAF
    blocks = _lower_channels_direct(*(t.reshape(*t.shape[:-2], size // s, s, d) for t in (x, y, b)), diagonal)
    while s < size:  # blocks (…, G, s, s) on the diagonal → (…, G/2, 2s, 2s)
        G = size // (2 * s)
        # halves taken with unbind (whose backward stacks; indexing one would write a zero tensor of both)
        x_low = x.reshape(*x.shape[:-2], G, 2, s, d).unbind(-3)[1]
        y_up = y.reshape(*y.shape[:-2], G, 2, s, d).unbind(-3)[0]
        b_up, b_low = b.reshape(*b.shape[:-2], G, 2, s, d).unbind(-3)
        ref = b_up[..., s - 1 :, :]  # (…, G, 1, d): b at the last row of each upper half
        rows = x_low * _decay_exp(b_low - ref)  # i in the lower half: b_i − b_r ≤ 0
        cols = y_up * _decay_exp(ref - b_up)  # j in the upper half: b_r − b_j ≤ 0
        if s == 1:  # (…, G, 1, 1): a dot product, cheaper than a batch of 1 × 1 matrix products
            below = (rows * cols).sum(-1, keepdim=True)
        else:  # (…, G, s, s); einsum folds a stacked x's extra axes into the rows (one product, no broadcast)
            below = torch.einsum("...id,...jd->...ij", rows, cols)
        upper, lower = blocks.reshape(*blocks.shape[:-3], G, 2, s, s).unbind(-3)
        top = torch.cat([upper, torch.zeros_like(upper)], dim=-1)
        blocks = torch.cat([top, torch.cat([below, lower], dim=-1)], dim=-2)
        s *= 2
    return blocks.reshape(*blocks.shape[:-3], size, size)[..., :n, :n]


def _solve_unit_lower(a: Tensor, rhs: Tensor) -> Tensor:
    """(I + a)⁻¹ rhs for a strictly lower-triangular a (…, n, n), rhs (…, n, m); half precision is solved in
    float32 (no half-precision triangular solve on the CPU) and returned in its own dtype."""
    if a.dtype in (torch.float16, torch.bfloat16):
        return _solve_unit_lower(a.float(), rhs.float()).to(a.dtype)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)


EFFECTIVE_CHUNK = 64
"""The chunk size :func:`effective_matrix` runs :func:`chunked` with (the chunked backend's default)."""


def effective_matrix(
    q: Tensor, k: Tensor, transition: Transition | None = None, chunk_size: int = EFFECTIVE_CHUNK
) -> Tensor:
    """The lower-triangular map from v to the output: q (B, H, L, d_k), k (B, H, L·n, d_k), transition
    (:class:`Transition`) → A (B, H, L, L·n), o = A v (n = ``householder_steps``, 1 but for DeltaProduct, whose A maps
    the L·n values): A = P per head (Q Kᵀ ⊙ Γ; Sun et al. 2023; Yang et al. 2024, GLA) or per channel (P_ij =
    Σ_c q_ic k_jc exp(b_ic − b_jc); GLA; Kimi Team 2025, KDA), times T diag(β) under the delta rule (Yang et al. 2024,
    DeltaNet's WY/UT form; Yang et al. 2025, Gated DeltaNet), signed; P_qk + P_qb (I − A_ab)⁻¹ A_ak with a low-rank
    term (Peng et al. 2025, RWKV-7).

    It is :func:`chunked` (chunks of C = ``chunk_size`` tokens) applied to the identity, V = I (B, H, L·n, L·n):
    column j of the output is the map's column j, with the chunked form's numbers, so that every exponent is a
    chunk-local difference ≤ 0 and the delta rule a unit-triangular solve per chunk (not one of L × L). The matrix
    on the whole sequence's cumulative log-decay b lost float32's precision as the gates forget: b_i − b_j, two sums
    of order L·|log α|, keeps few digits of their difference (values 1.4e-5, gradients 6e-5 off the float64 loop at
    L 4096 with log α ∈ (−20, −5), B 1, H 2, d_k 16, unit q and k; chunk-local 3e-7 and 1.7e-6). What remains is the
    chunk's share, of order C·|log α|·eps (chunk-local b̃ up to C·|log α|). O(L² (C + d_k)) work, a few
    (B, H, L, L·n) tensors of memory. Linear attention (no decay, no β) has no decay to lose and is the masked
    Q Kᵀ (exact, and twice differentiable, unlike :class:`_CausalLinear`)."""
    transition = _resolve(transition)
    _check_sequence(q, k, None, transition)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    if transition.log_decay is None and transition.beta is None and transition.low_rank is None:
        return _lower(torch.matmul(q, k.transpose(-1, -2)), None)  # linear attention: (B, H, L, L)
    B, H, steps = k.shape[:3]
    identity = torch.eye(steps, dtype=k.dtype, device=k.device).expand(B, H, steps, steps)
    return chunked(q, k, identity, transition, chunk_size)


# ---------------------------------------------------------------------------------------------- richer transitions


def _step_record(transition: Transition) -> Transition:
    """DeltaProduct's record as the delta rule's over its L·n steps: each token's log α at its first step and 0
    (α = 1) at the others, β as it is (one per step)."""
    n = transition.householder_steps
    log_decay = transition.log_decay
    if log_decay is not None:
        first = log_decay.unsqueeze(3)  # (B, H, L, 1) or (B, H, L, 1, d_k)
        rest = log_decay.new_zeros(*first.shape[:3], n - 1, *first.shape[4:])
        log_decay = torch.cat([first, rest], dim=3).flatten(2, 3)
    return Transition(log_decay, transition.beta)


def _at_last_step(q: Tensor, n: int) -> Tensor:
    """q (…, L, d) → (…, L·n, d): each token's q at its last step, 0 at its others."""
    zeros = q.new_zeros(*q.shape[:-1], n - 1, q.shape[-1])
    return torch.cat([zeros, q.unsqueeze(-2)], dim=-2).flatten(-3, -2)


def _channel_log_decay(transition: Transition, q: Tensor) -> Tensor:
    """log α per key channel (B, H, L, d_k): a per-head decay repeated over d_k; 0 without one."""
    log_decay = transition.log_decay
    if log_decay is None:
        return torch.zeros_like(q)
    return log_decay if transition.per_channel else log_decay.unsqueeze(-1).expand_as(q).contiguous()


def _low_rank_blocks(q: Tensor, k: Tensor, a: Tensor, b: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four matrices of the diagonal-plus-low-rank form on cumulative log-decays g (…, n, d_k) (every
    exponent a difference g_rc − g_jc ≤ 0, by :func:`_lower_channels`):

        P_qk[t, j] = Σ_c q_tc k_jc e^{g_tc − g_jc},       P_qb[t, j] = Σ_c q_tc b_jc e^{g_tc − g_jc}       (j ≤ t)
        A_ak[t, j] = Σ_c a_tc k_jc e^{g_{t−1,c} − g_jc},  A_ab[t, j] = Σ_c a_tc b_jc e^{g_{t−1,c} − g_jc}  (j < t)

    (a reads the state before token t's decay, hence g_{t−1}: the rows of a shifted up by one token, taken on and
    below the diagonal, then moved back down)."""
    a_next = torch.cat([a[..., 1:, :], torch.zeros_like(a[..., :1, :])], dim=-2)
    P_qk, P_qb, A_ak, A_ab = _lower_channels(torch.stack([q, q, a_next, a_next]), torch.stack([k, b, k, b]), g)
    shift = (0, 0, 1, 0)  # row t ← row t − 1, row 0 ← 0
    A_ak, A_ab = (F.pad(m[..., :-1, :], shift) for m in (A_ak, A_ab))
    return P_qk, P_qb, A_ak, A_ab


def _low_rank_chunked(q: Tensor, k: Tensor, v: Tensor, transition: Transition, chunk_size: int) -> Tensor:
    """:func:`chunked` for a low-rank record: within chunk n, with chunk-local cumulative log-decays g̃ (per
    channel), g̃_{t−1} = g̃_t − log α_t, the state M₀ before the chunk and u_t = a_tᵀ M_{t−1}:

        U = (I − A_ab)⁻¹ (A_ak V + (a ⊙ e^{g̃_{t−1}}) M₀)           (a unit-triangular solve, batched)
        O = (q ⊙ e^{g̃}) M₀ + P_qb U + P_qk V
        M ← e^{g̃_C} ⊙ M₀ + (b ⊙ e^{g̃_C − g̃})ᵀ U + (k ⊙ e^{g̃_C − g̃})ᵀ V

    with the matrices of :func:`_low_rank_blocks` (every exponent ≤ 0): the generalized delta rule's chunk form
    (Peng et al. 2025, RWKV-7; fla's ``dplr``), of which only the state's passage runs chunk by chunk."""
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    C = max(1, min(chunk_size, L))
    pad = -L % C
    a, b = transition.low_rank
    log_decay = _channel_log_decay(transition, q)
    if pad:
        q, k, v, a, b, log_decay = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, a, b, log_decay))
    N = (L + pad) // C
    qc, kc, ac, bc = (t.reshape(B, H, N, C, Dk) for t in (q, k, a, b))
    vc = v.reshape(B, H, N, C, Dv)
    ldc = log_decay.reshape(B, H, N, C, Dk)
    g = ldc.cumsum(-2)  # chunk-local g̃ (B, H, N, C, d_k)
    P_qk, P_qb, A_ak, A_ab = _low_rank_blocks(qc, kc, ac, bc, g)
    rhs = torch.cat([torch.matmul(A_ak, vc), ac * _decay_exp(g - ldc)], dim=-1)  # (B, H, N, C, d_v + d_k)
    W = _solve_unit_lower(-A_ab, rhs)
    W_v, W_k = W[..., :Dv].unbind(2), W[..., Dv:].unbind(2)  # N × (B, H, C, ·) (unbind: see chunked)
    out = torch.matmul(P_qk, vc)  # (B, H, N, C, d_v): the keys' own part, batched
    q_in = (qc * _decay_exp(g)).unbind(2)
    to_end = _decay_exp(g[..., -1:, :] - g)
    b_out = (bc * to_end).transpose(-1, -2).unbind(2)
    writes_v = torch.matmul((kc * to_end).transpose(-1, -2), vc).unbind(2)  # N × (B, H, d_k, d_v)
    carries = _decay_exp(g[..., -1, :]).unsqueeze(-1).unbind(2)  # N × (B, H, d_k, 1)
    P_qb = P_qb.unbind(2)
    M = None
    outs = []
    for i in range(N):
        if M is None:
            u = W_v[i]
            o = torch.matmul(P_qb[i], u)
        else:
            u = W_v[i] + torch.matmul(W_k[i], M)
            o = torch.matmul(q_in[i], M) + torch.matmul(P_qb[i], u)
        outs.append(o)
        if i < N - 1:
            write = torch.matmul(b_out[i], u) + writes_v[i]
            M = write if M is None else carries[i] * M + write
    out = out + torch.stack(outs, dim=2)
    return out.reshape(B, H, N * C, Dv)[:, :, :L]


# ---------------------------------------------------------------------------------------------- linear attention


def _exclusive_cumsum(t: Tensor, dim: int) -> Tensor:
    """Σ over the entries before each one along ``dim`` (0 for the first)."""
    total = t.cumsum(dim).narrow(dim, 0, t.shape[dim] - 1)
    return torch.cat([torch.zeros_like(t.narrow(dim, 0, 1)), total], dim)


def _causal_chunks(q: Tensor, k: Tensor, v: Tensor, C: int) -> Tensor:
    """The un-normalised causal form o_i = Σ_{j≤i} (q_i·k_j) v_j in chunks of C tokens (L a multiple of C):
    q, k (B, H, L, F), v (B, H, L, D) → (B, H, L, D). Within a chunk the masked quadratic form, across chunks the
    running state Σ k_j v_jᵀ (an exclusive prefix sum over chunks)."""
    B, H, L, Fd = q.shape
    D, N = v.shape[-1], L // C
    if N == 1:  # one chunk: the masked quadratic form alone (no state before it)
        return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).tril_(), v)
    qc, kc, vc = q.view(B, H, N, C, Fd), k.view(B, H, N, C, Fd), v.view(B, H, N, C, D)
    states = _exclusive_cumsum(torch.matmul(kc.transpose(-1, -2), vc), dim=2)  # (B, H, N, F, D): before chunk n
    scores = torch.matmul(qc, kc.transpose(-1, -2)).tril_()  # (B, H, N, C, C): within the chunk, j ≤ i
    return torch.baddbmm(torch.matmul(qc, states).view(-1, C, D), scores.view(-1, C, C), vc.reshape(-1, C, D)).view(
        B, H, L, D
    )


class _CausalLinear(torch.autograd.Function):
    """o = causal_linear(q, k, v), o_i = Σ_{j≤i} (q_i·k_j) v_j, keeping only q, k and v for the backward pass,
    which is three more passes of the same chunked form (nothing of size (C, C) or (F, D) per chunk is kept):

        ∂q_i = Σ_{j≤i} (g_i·v_j) k_j      = causal_linear(g, v, k)
        ∂k_j = Σ_{i≥j} (g_i·v_j) q_i      = reversed causal_linear(v, g, q)
        ∂v_j = Σ_{i≥j} (q_i·k_j) g_i      = reversed causal_linear(k, q, g)
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, chunk: int) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.chunk = chunk
        return _causal_chunks(q, k, v, chunk)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        C = ctx.chunk
        g = g.contiguous()

        def reverse(t: Tensor) -> Tensor:
            return t.flip(2)

        dq = _causal_chunks(g, v, k, C)
        dk = reverse(_causal_chunks(reverse(v), reverse(g), reverse(q), C))
        dv = reverse(_causal_chunks(reverse(k), reverse(q), reverse(g), C))
        return dq, dk, dv, None


# ---------------------------------------------------------------------------------------------- the chunked form


def chunked(q: Tensor, k: Tensor, v: Tensor, transition: Transition | None = None, chunk_size: int = 64) -> Tensor:
    """The form in chunks of C = min(``chunk_size``, L) tokens (the last chunk padded with k = 0, which writes
    nothing): q (B, H, L, d_k), k (B, H, L·n, d_k), v (B, H, L·n, d_v) (n = ``householder_steps``, 1 but for
    DeltaProduct), transition (:class:`Transition`: log_decay (B, H, L) or (B, H, L, d_k), beta (B, H, L·n),
    low_rank) → o (B, H, L, d_v); L = 0 gives (B, H, 0, d_v). A low-rank record is :func:`_low_rank_chunked`;
    DeltaProduct's n steps are the delta rule over the L·n steps, read at each token's last (:func:`_chunks`).

    Linear attention (no decay, no β; Katharopoulos et al. 2020) is :class:`_CausalLinear` (the un-normalised
    causal form, a hand-written backward, no second derivative). Otherwise, within chunk n, with the chunk-local
    cumulative log-decays b̃ (b̃_t ≤ 0; per head, or per channel (C, d_k)) and the state M₀ before the chunk:

        U = W_v − W_k M₀,  W_v = T diag(β) V,  W_k = T diag(β) (K ⊙ e^{b̃})      (U = V without the delta rule)
        O = (Q ⊙ e^{b̃}) M₀ + P U,   M ← diag(e^{b̃_C}) M₀ + (K ⊙ e^{b̃_C − b̃})ᵀ U

    with P, T as in the module docstring on b̃ (RetNet, Sun et al. 2023; GLA, Yang et al. 2024; DeltaNet's WY/UT
    form, Yang et al. 2024; Gated DeltaNet, Yang et al. 2025; KDA, Kimi Team 2025). Everything but the state's
    passage from chunk to chunk is batched over the chunks; every exponent is ≤ 0."""
    transition = _resolve(transition)
    _check_sequence(q, k, v, transition)
    transition = _bounded(transition)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    B, H, L, _ = q.shape
    Dv = v.shape[-1]
    if L == 0:
        return v.new_zeros(B, H, 0, Dv)
    n = transition.householder_steps
    C = max(1, min(chunk_size, L))
    if n > 1:  # DeltaProduct: the delta rule over the L·n steps, read at each token's last
        return _chunks(q, k, v, _step_record(transition), C, n)
    if transition.low_rank is not None:
        return _low_rank_chunked(q, k, v, transition, chunk_size)
    pad = -L % C
    if transition.log_decay is None and transition.beta is None:  # linear attention
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        return _CausalLinear.apply(q.contiguous(), k.contiguous(), v.contiguous(), C)[:, :, :L]
    return _chunks(q, k, v, transition, C)


def _read_mask(C: int, n: int, device: torch.device) -> Tensor:
    """(C, C·n) bool: True where step j is at or before token i's last step i·n + n − 1."""
    return torch.arange(C * n, device=device)[None, :] <= torch.arange(C, device=device)[:, None] * n + n - 1


def _chunks(q: Tensor, k: Tensor, v: Tensor, transition: Transition, C: int, n: int = 1) -> Tensor:
    """The decay and delta-rule forms in chunks of C tokens (:func:`chunked`'s formulas), with n steps per token
    (k, v (B, H, L·n, ·) and a record over the L·n steps: DeltaProduct as the delta rule over its steps, the
    output read at each token's last step, so that P has C rows for a chunk's C·n steps: with a per-head decay or
    none the rows of the other steps, whose output no one reads, are never computed; a per-channel P is made on the
    steps' square by the halving blocks, then its read rows taken)."""
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    pad = -L % C
    channels = transition.per_channel
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        k, v = (F.pad(t, (0, 0, 0, pad * n)) for t in (k, v))
        transition = transition.padded(pad * n)
    log_decay, beta = transition.log_decay, transition.beta
    N, S = (L + pad) // C, C * n  # chunks; steps a chunk
    qc, kc, vc = q.reshape(B, H, N, C, Dk), k.reshape(B, H, N, S, Dk), v.reshape(B, H, N, S, Dv)
    if log_decay is None:
        b = None
    elif channels:
        b = log_decay.reshape(B, H, N, S, Dk).cumsum(-2)  # chunk-local b̃ (B, H, N, S, d_k)
    else:
        b = log_decay.reshape(B, H, N, S).cumsum(-1)  # chunk-local b̃ (B, H, N, S)
    reads = slice(n - 1, None, n)  # the steps whose output is read: each token's last
    b_read = None if b is None else (b if n == 1 else b[..., reads, :] if channels else b[..., reads])
    if channels:
        # q at each token's last step, 0 at the others (the per-channel P is made on the steps' square)
        q_steps = qc if n == 1 else _at_last_step(qc, n)
        if beta is not None:  # P and G in one pass (they share k's factors): (2, B, H, N, S, S)
            P, kk = _lower_channels(torch.stack([q_steps, kc]), kc, b).unbind(0)
            kk = kk.tril(-1)
        else:
            P = _lower_channels(q_steps, kc, b)  # (B, H, N, S, S)
        P = P if n == 1 else P[..., reads, :]  # (B, H, N, C, S)
    elif n == 1:
        P = _lower(torch.matmul(qc, kc.transpose(-1, -2)), b)  # (B, H, N, C, C)
    else:  # (B, H, N, C, S): token i against the steps j ≤ i·n + n − 1
        hide = ~_read_mask(C, n, q.device)
        scores = torch.matmul(qc, kc.transpose(-1, -2))
        if b is None:
            P = scores.masked_fill(hide, 0.0)
        else:
            P = scores * _decay_exp(b_read.unsqueeze(-1) - b.unsqueeze(-2), hide)
    if b is None:
        q_in, k_out, carry = qc, kc, None
    elif channels:
        q_in = qc * _decay_exp(b_read)  # q ⊙ e^b̃ (at each token's last step)
        k_out = kc * _decay_exp(b[..., -1:, :] - b)  # k ⊙ e^(b̃_S − b̃)
        carry = _decay_exp(b[..., -1, :])  # (B, H, N, d_k): e^(b̃_S)
    else:
        q_in = qc * _decay_exp(b_read).unsqueeze(-1)  # e^b̃ q
        k_out = kc * _decay_exp(b[..., -1:] - b).unsqueeze(-1)  # e^(b̃_S − b̃) k
        carry = _decay_exp(b[..., -1])  # (B, H, N): e^(b̃_S)

    def rows(c: Tensor) -> Tensor:  # the carry as a factor of M's rows: (…, d_k, 1) per channel, (…, 1, 1) per head
        return c[..., None] if channels else c[..., None, None]

    if beta is None:
        U = vc
        # states before each chunk: M_n = carry_{n−1} M_{n−1} + k_outᵀ V of chunk n−1
        # (chunks are taken with unbind, whose backward stacks the chunks' gradients once: indexing one chunk per
        # step would make each step's backward write a zero tensor of all N chunks, O(N²) in all)
        writes = torch.matmul(k_out.transpose(-1, -2), vc).unbind(2)  # N × (B, H, d_k, d_v)
        carries = None if carry is None else rows(carry).unbind(2)  # N × (B, H, 1 or d_k, 1)
        states = [q.new_zeros(B, H, Dk, Dv)]
        for i in range(N - 1):
            M = states[-1] if carries is None else carries[i] * states[-1]
            states.append(M + writes[i])
        M_before = torch.stack(states, dim=2)  # (B, H, N, d_k, d_v)
    else:
        bc = beta.reshape(B, H, N, S)
        if channels:
            decayed_k = kc * _decay_exp(b)
        else:
            kk = _lower(torch.matmul(kc, kc.transpose(-1, -2)), b, -1)
            decayed_k = kc if b is None else kc * _decay_exp(b).unsqueeze(-1)
        rhs = torch.cat([vc, decayed_k], dim=-1) * bc.unsqueeze(-1)  # (B, H, N, S, d_v + d_k)
        W = _solve_unit_lower(bc.unsqueeze(-1) * kk, rhs)
        W_v, W_k = W[..., :Dv].unbind(2), W[..., Dv:].unbind(2)  # N × (B, H, S, ·) (unbind: see above)
        k_outs = k_out.transpose(-1, -2).unbind(2)  # N × (B, H, d_k, S)
        carries = None if carry is None else rows(carry).unbind(2)
        M = None
        us, states = [], []
        for i in range(N):
            if M is None:
                u = W_v[i]
                states.append(q.new_zeros(B, H, Dk, Dv))
            else:
                u = W_v[i] - torch.matmul(W_k[i], M)
                states.append(M)
            us.append(u)
            if i < N - 1:
                write = torch.matmul(k_outs[i], u)
                M = write if M is None else (M if carries is None else carries[i] * M) + write
        U = torch.stack(us, dim=2)  # (B, H, N, S, d_v)
        M_before = torch.stack(states, dim=2)
    out = torch.matmul(q_in, M_before) + torch.matmul(P, U)  # (B, H, N, C, d_v)
    return out.reshape(B, H, N * C, Dv)[:, :, :L]
