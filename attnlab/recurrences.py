"""Decay and delta-rule attention: RetNet, gated linear attention, DeltaNet and Gated DeltaNet.

Each is causal attention whose weights are a structured lower-triangular matrix, with a recurrent form that carries
one state M (d_k × d_v per head) along the sequence (the transpose of the papers' S = Mᵀ):

    M_t = α_t M_{t−1} + k_t v_tᵀ                               (decay: RetNet, GLA; α ≡ 1 is linear attention)
    M_t = α_t (I − β_t k_t k_tᵀ) M_{t−1} + β_t k_t v_tᵀ         (delta rule: DeltaNet α ≡ 1, Gated DeltaNet)
    o_t = M_tᵀ q_t

with a decay α_t ∈ (0, 1] given as log α_t ≤ 0 (``log_alpha``, (B, H, L), or None for α ≡ 1) and a writing
strength β_t ∈ (0, 1) (``beta``, (B, H, L), or None for the plain sum). Writing u_t = β_t (v_t − α_t M_{t−1}ᵀ k_t)
(the delta rule's new value; u_t = v_t without it), M_t = α_t M_{t−1} + k_t u_tᵀ, so with b_t = Σ_{m≤t} log α_m and
Γ_tj = exp(b_t − b_j) for j ≤ t (0 above the diagonal):

    o = (Q Kᵀ ⊙ Γ) U,      U = V                                         (decay)
    U = T diag(β) V,       T = (I + strictly_lower(diag(β) (K Kᵀ ⊙ Γ)))⁻¹   (delta rule: the WY/UT form)

so the **effective attention matrix**, the (L, L) lower-triangular map from v to the output that the diagnostics
read, is (Q Kᵀ ⊙ Γ) for the decay forms and (Q Kᵀ ⊙ Γ) T diag(β) for the delta rule (signed: T has negative
entries). Three functions compute the same numbers:

* :func:`recurrent_form`: one token at a time (:func:`state_step`, the form that decodes); the reference.
* :func:`chunked_form`: chunks of C tokens: within a chunk the quadratic form above on chunk-local decays (a
  batched unit-triangular solve for the delta rule), across chunks the state M, O(L·C) memory. Every exponent is a
  difference b_t − b_j with j ≤ t inside one chunk, or a chunk-local b_t ≤ 0, so no product of gates overflows or
  underflows to NaN whatever L (log space, as fla's kernels do).
* :func:`effective_matrix`: the (L, L) matrix (the ``eager`` backend, O(L²); its Γ is exp of differences of the
  global cumulative log-decay, exact in float64, to float32 rounding of b in float32).

The four variants are scores (:class:`RecurrentScore`) that map the layer's q, k and input x to these inputs:

=================  ============================================  ======================  ============  ==========
variant            paper                                         decay α_t               β_t           q, k
=================  ============================================  ======================  ============  ==========
``retnet``         Sun et al. 2023, retention                    γ_h = 1 − 2^(−5−h)      —             k/√d_k
``gla``            Yang et al. 2024 (scalar gate: "simple GLA",   σ(x w_h + b_h)^(1/τ)    —             k/√d_k
                   Mamba-2's SSD, Dao & Gu 2024)
``deltanet``       Schlag et al. 2021; Yang et al. 2024           —                       σ(x w_h + b)  L2-normed
``gated_deltanet`` Yang et al. 2025                               σ(x w_h + b_h)^(1/τ)    σ(x w_h + b)  L2-normed
=================  ============================================  ======================  ============  ==========

with τ = ``gate_normalizer`` (16, GLA's). Each normalises each head's output over d_v before the output projection
(``output_norm``: ``groupnorm``, RetNet's GroupNorm with one group per head, the default of ``retnet``; ``rmsnorm``,
fla's default for the other three; or None). They are causal only: a layer refuses a mask that is not causal
(AND key padding), in one line. A padded key is written with k = 0, which leaves the state as it was.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.checks import check_choice, check_number
from attnlab.scores import Score, register_score

__all__ = [
    "DeltaNetScore",
    "GLAScore",
    "GatedDeltaNetScore",
    "RecurrentScore",
    "RetNetScore",
    "chunked_form",
    "effective_matrix",
    "recurrent_form",
    "retnet_decays",
    "state_step",
]

OUTPUT_NORMS = ("groupnorm", "rmsnorm", None)


# ---------------------------------------------------------------------------------------------- the three forms


def state_step(
    state: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor | None = None,
    beta: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One token: state M (B, H, d_k, d_v) or None (the start, zeros), the token's q, k (B, H, d_k), v (B, H, d_v),
    log α (B, H) or None, β (B, H) or None → (o (B, H, d_v), the new M):
    M ← α M; then M ← M + k vᵀ, or with β: M ← M + k (β (v − Mᵀ k))ᵀ; o = Mᵀ q."""
    if state is None:
        state = q.new_zeros(*q.shape, v.shape[-1])
    if log_alpha is not None:
        state = state * log_alpha.exp()[..., None, None]
    if beta is None:
        u = v
    else:
        u = beta.unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", k, state))  # (B, H, d_v)
    state = state + k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def recurrent_form(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor | None = None, beta: Tensor | None = None
) -> Tensor:
    """The form one token at a time (:func:`state_step` over the sequence): q, k (B, H, L, d_k), v (B, H, L, d_v),
    log_alpha, beta (B, H, L) or None → o (B, H, L, d_v)."""
    B, H, L, _ = q.shape
    state, outs = None, []
    for t in range(L):
        la = None if log_alpha is None else log_alpha[:, :, t]
        b = None if beta is None else beta[:, :, t]
        o, state = state_step(state, q[:, :, t], k[:, :, t], v[:, :, t], la, b)
        outs.append(o)
    return torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1])


def _tril(n: int, device: torch.device, diagonal: int = 0) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(diagonal)


def _decay_matrix(b: Tensor, diagonal: int = 0) -> Tensor:
    """b (…, n) cumulative log-decays → Γ (…, n, n), exp(b_i − b_j) on and below the ``diagonal``, 0 elsewhere
    (the exponent is masked before exp, so nothing above it overflows)."""
    n = b.shape[-1]
    diff = b.unsqueeze(-1) - b.unsqueeze(-2)  # (…, n, n): b_i − b_j
    return diff.masked_fill(~_tril(n, b.device, diagonal), float("-inf")).exp()


def _lower(t: Tensor, b: Tensor | None, diagonal: int = 0) -> Tensor:
    """t (…, n, n) on and below the ``diagonal``, 0 above it; times Γ = exp(b_i − b_j) when the cumulative
    log-decays b (…, n) are given (:func:`_decay_matrix`)."""
    if b is None:
        return t.masked_fill(~_tril(t.shape[-1], t.device, diagonal), 0.0)
    return t * _decay_matrix(b, diagonal)


def _solve_unit_lower(a: Tensor, rhs: Tensor) -> Tensor:
    """(I + a)⁻¹ rhs for a strictly lower-triangular a (…, n, n), rhs (…, n, m); half precision is solved in
    float32 (no half-precision triangular solve on the CPU) and returned in its own dtype."""
    if a.dtype in (torch.float16, torch.bfloat16):
        return _solve_unit_lower(a.float(), rhs.float()).to(a.dtype)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)


def effective_matrix(q: Tensor, k: Tensor, log_alpha: Tensor | None = None, beta: Tensor | None = None) -> Tensor:
    """The lower-triangular (L, L) map from v to the output: q, k (B, H, L, d_k), log_alpha, beta (B, H, L) or None
    → A (B, H, L, L), o = A v: (Q Kᵀ ⊙ Γ), times T diag(β) under the delta rule (module docstring)."""
    b = None if log_alpha is None else log_alpha.cumsum(-1)
    P = _lower(torch.matmul(q, k.transpose(-1, -2)), b)  # (B, H, L, L)
    if beta is None:
        return P
    kk = _lower(torch.matmul(k, k.transpose(-1, -2)), b, -1)  # strictly below the diagonal
    T = _solve_unit_lower(beta.unsqueeze(-1) * kk, torch.diag_embed(beta))  # T diag(β), (B, H, L, L)
    return torch.matmul(P, T)


def chunked_form(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_alpha: Tensor | None = None,
    beta: Tensor | None = None,
    chunk_size: int = 64,
) -> Tensor:
    """The form in chunks of ``chunk_size`` tokens (the last chunk padded with k = 0, which writes nothing):
    q, k (B, H, L, d_k), v (B, H, L, d_v), log_alpha, beta (B, H, L) or None → o (B, H, L, d_v).

    Within chunk n, with chunk-local cumulative log-decays b̃ (b̃_t ≤ 0) and the state M₀ before the chunk:
    U = W_v − W_k M₀ (W_v = T diag(β) V, W_k = T diag(β e^b̃) K; U = V without the delta rule),
    O = diag(e^b̃) Q M₀ + (Q Kᵀ ⊙ Γ̃) U, and M ← e^(b̃_C) M₀ + (diag(e^(b̃_C − b̃)) K)ᵀ U. Everything but the state's
    passage from chunk to chunk is batched over the chunks."""
    B, H, L, Dk = q.shape
    Dv = v.shape[-1]
    if L == 0:
        return v.new_zeros(B, H, 0, Dv)
    C = max(1, min(int(chunk_size), L))
    pad = -L % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        log_alpha = None if log_alpha is None else F.pad(log_alpha, (0, pad))
        beta = None if beta is None else F.pad(beta, (0, pad))
    N = (L + pad) // C
    qc, kc, vc = q.reshape(B, H, N, C, Dk), k.reshape(B, H, N, C, Dk), v.reshape(B, H, N, C, Dv)
    b = None if log_alpha is None else log_alpha.reshape(B, H, N, C).cumsum(-1)  # chunk-local b̃ (B, H, N, C)
    P = _lower(torch.matmul(qc, kc.transpose(-1, -2)), b)  # (B, H, N, C, C)
    if b is None:
        q_in, k_out, carry = qc, kc, None
    else:
        q_in = qc * b.exp().unsqueeze(-1)  # e^b̃ q
        k_out = kc * (b[..., -1:] - b).exp().unsqueeze(-1)  # e^(b̃_C − b̃) k
        carry = b[..., -1].exp()  # (B, H, N): e^(b̃_C)

    if beta is None:
        U = vc
        # states before each chunk: M_n = carry_{n−1} M_{n−1} + k_outᵀ V of chunk n−1
        # (chunks are taken with unbind, whose backward stacks the chunks' gradients once: indexing one chunk per
        # step would make each step's backward write a zero tensor of all N chunks, O(N²) in all)
        writes = torch.matmul(k_out.transpose(-1, -2), vc).unbind(2)  # N × (B, H, d_k, d_v)
        carries = None if carry is None else carry[..., None, None].unbind(2)  # N × (B, H, 1, 1)
        states = [q.new_zeros(B, H, Dk, Dv)]
        for n in range(N - 1):
            M = states[-1] if carries is None else carries[n] * states[-1]
            states.append(M + writes[n])
        M_before = torch.stack(states, dim=2)  # (B, H, N, d_k, d_v)
    else:
        bc = beta.reshape(B, H, N, C)
        kk = _lower(torch.matmul(kc, kc.transpose(-1, -2)), b, -1)
        decayed_k = kc if b is None else kc * b.exp().unsqueeze(-1)
        rhs = torch.cat([vc, decayed_k], dim=-1) * bc.unsqueeze(-1)  # (B, H, N, C, d_v + d_k)
        W = _solve_unit_lower(bc.unsqueeze(-1) * kk, rhs)
        W_v, W_k = W[..., :Dv].unbind(2), W[..., Dv:].unbind(2)  # N × (B, H, C, ·) (unbind: see above)
        k_outs = k_out.transpose(-1, -2).unbind(2)  # N × (B, H, d_k, C)
        carries = None if carry is None else carry[..., None, None].unbind(2)
        M = None
        us, states = [], []
        for n in range(N):
            if M is None:
                u = W_v[n]
                states.append(q.new_zeros(B, H, Dk, Dv))
            else:
                u = W_v[n] - torch.matmul(W_k[n], M)
                states.append(M)
            us.append(u)
            if n < N - 1:
                write = torch.matmul(k_outs[n], u)
                M = write if M is None else (M if carries is None else carries[n] * M) + write
        U = torch.stack(us, dim=2)  # (B, H, N, C, d_v)
        M_before = torch.stack(states, dim=2)
    out = torch.matmul(q_in, M_before) + torch.matmul(P, U)  # (B, H, N, C, d_v)
    return out.reshape(B, H, N * C, Dv)[:, :, :L]


# ---------------------------------------------------------------------------------------------- the variants


def retnet_decays(num_heads: int) -> Tensor:
    """RetNet's multi-scale decays γ_h = 1 − 2^(−5−h), h = 0 … H − 1 (Sun et al. 2023, §2.2), (H,) float64."""
    return 1.0 - 2.0 ** (-5.0 - torch.arange(num_heads, dtype=torch.float64))


class RecurrentScore(Score):
    """Base class of the decay and delta-rule forms (module docstring). Not a logit: the layer hands this score its
    q and k after projection (and rotary positions), and its input x for the gates; :meth:`inputs` gives the
    form's q, k, log α and β, which the ``chunked`` and ``recurrent`` backends run and :func:`effective_matrix`
    turns into the weights the ``eager`` backend and the diagnostics read.

    Args:
        d_k: per-head query/key size.
        num_heads: H.
        d_v: per-head value size (default d_k).
        d_model: the layer's input width (the gates read x).
        output_norm: ``groupnorm`` (LayerNorm of each head over d_v, with affine weights: GroupNorm with H groups),
            ``rmsnorm`` (RMSNorm of each head) or None, applied to the output before the output projection.
    """

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        d_v: int | None = None,
        d_model: int | None = None,
        output_norm: str | None = "rmsnorm",
    ) -> None:
        super().__init__(d_k, num_heads, d_v)
        self.d_model = d_model if d_model is not None else d_k * num_heads
        self.output_norm_name = check_choice("output_norm", output_norm, OUTPUT_NORMS)
        if output_norm == "groupnorm":
            self.output_norm: nn.Module | None = nn.LayerNorm(self.d_v)  # per head; weights shared over heads
        elif output_norm == "rmsnorm":
            self.output_norm = nn.RMSNorm(self.d_v, eps=1e-6)
        else:
            self.output_norm = None

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """The form's own maps of q and k (B, H, L, d_k): k/√d_k by default."""
        return q, k * self.d_k**-0.5

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """x (B, L, d_model) → log α (B, H, L) or None, β (B, H, L) or None."""
        return None, None

    def inputs(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """q, k (B, H, L, d_k) and x (B, L, d_model) → the form's q, k, log α and β."""
        q, k = self.prepare(q, k)
        return (q, k, *self.gates(x))

    def forward(self, q: Tensor, k: Tensor, x: Tensor) -> Tensor:
        """q, k (B, H, L, d_k), x (B, L, d_model) → the effective matrix (B, H, L, L) (:func:`effective_matrix`)."""
        return effective_matrix(*self.inputs(q, k, x))

    def norm_output(self, z: Tensor) -> Tensor:
        """z (B, H, L, d_v) → each head normalised over d_v (``output_norm``)."""
        return z if self.output_norm is None else self.output_norm(z)

    def state_size(self) -> int:
        """Floats of state per sequence: H·d_k·d_v."""
        return self.num_heads * self.d_k * self.d_v

    def extra_repr(self) -> str:
        return f"d_k={self.d_k}, num_heads={self.num_heads}, d_v={self.d_v}, output_norm={self.output_norm_name}"


class _Gate(nn.Module):
    """A per-head scalar from the input: x (B, L, d_model) → (B, H, L) pre-activations x w_h + b_h (b = 0 at
    first)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, num_heads)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).transpose(1, 2)


class _ScalarDecay:
    """GLA's scalar decay per head, shared by ``gla`` and ``gated_deltanet``: log α_t = log σ(x_t w_h + b_h) / τ
    (τ = ``gate_normalizer``), in log space."""

    d_model: int
    num_heads: int

    def _init_decay(self, gate_normalizer: float) -> None:
        self.gate_normalizer = check_number("gate_normalizer", gate_normalizer, low=1.0)
        self.alpha_gate = _Gate(self.d_model, self.num_heads)

    def log_alpha(self, x: Tensor) -> Tensor:
        """x (B, L, d_model) → log α (B, H, L) ≤ 0."""
        return F.logsigmoid(self.alpha_gate(x)) / self.gate_normalizer


@register_score("retnet")
class RetNetScore(RecurrentScore):
    """Retention (Sun et al. 2023, "Retentive Network"): o = (Q Kᵀ/√d_k ⊙ D) V with D_ij = γ_h^(i−j) (j ≤ i), a
    fixed decay per head γ_h = 1 − 2^(−5−h) (:func:`retnet_decays`), no softmax; each head's output through a
    GroupNorm (``output_norm=groupnorm``). Rotary positions (RetNet's xPos without its length extrapolation) as
    the model configures them (``model.pos_encoding=rope``). State: M_t = γ M_{t−1} + k_t v_tᵀ."""

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        d_v: int | None = None,
        d_model: int | None = None,
        output_norm: str | None = "groupnorm",
    ) -> None:
        super().__init__(d_k, num_heads, d_v, d_model, output_norm)
        # float64, not a buffer: casting the model (.float(), .bfloat16()) must not round the decays twice
        self.log_gamma = retnet_decays(num_heads).log()

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        B, L = x.shape[:2]
        return self.log_gamma.to(x.device, x.dtype)[None, :, None].expand(B, self.num_heads, L), None


@register_score("gla")
class GLAScore(_ScalarDecay, RecurrentScore):
    """Gated linear attention with a scalar gate per head (Yang et al. 2024; the scalar-gated form of Mamba-2's
    state space duality, Dao & Gu 2024, and fla's "simple GLA"): M_t = α_t M_{t−1} + k_t v_tᵀ with
    log α_t = log σ(x_t w_h + b_h) / τ, computed in log space (τ = ``gate_normalizer``, 16 as in GLA), q·k/√d_k.

    Args:
        gate_normalizer: τ ≥ 1; larger keeps α nearer 1 (longer memory).
    """

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        d_v: int | None = None,
        d_model: int | None = None,
        output_norm: str | None = "rmsnorm",
        gate_normalizer: float = 16.0,
    ) -> None:
        super().__init__(d_k, num_heads, d_v, d_model, output_norm)
        self._init_decay(gate_normalizer)

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return self.log_alpha(x), None


@register_score("deltanet")
class DeltaNetScore(RecurrentScore):
    """The delta rule (Schlag et al. 2021, "Linear Transformers Are Secretly Fast Weight Programmers"; Yang et al.
    2024, "Parallelizing Linear Transformers with the Delta Rule"): M_t = (I − β_t k_t k_tᵀ) M_{t−1} + β_t k_t v_tᵀ,
    which overwrites the value stored under k_t instead of adding to it, with q and k L2-normalised per head and
    β_t = σ(x_t w_h + b_h) per head. Chunked with the WY/UT representation (a unit-triangular solve per chunk)."""

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        d_v: int | None = None,
        d_model: int | None = None,
        output_norm: str | None = "rmsnorm",
    ) -> None:
        super().__init__(d_k, num_heads, d_v, d_model, output_norm)
        self.beta_gate = _Gate(self.d_model, num_heads)

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1)

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return None, torch.sigmoid(self.beta_gate(x))


@register_score("gated_deltanet")
class GatedDeltaNetScore(_ScalarDecay, DeltaNetScore):
    """The gated delta rule (Yang et al. 2025, "Gated Delta Networks"): M_t = α_t (I − β_t k_t k_tᵀ) M_{t−1} +
    β_t k_t v_tᵀ, DeltaNet's update with GLA's scalar decay log α_t = log σ(x_t w_h + b_h) / τ.

    Args:
        gate_normalizer: τ ≥ 1, as :class:`GLAScore`'s.
    """

    def __init__(
        self,
        d_k: int,
        num_heads: int,
        d_v: int | None = None,
        d_model: int | None = None,
        output_norm: str | None = "rmsnorm",
        gate_normalizer: float = 16.0,
    ) -> None:
        super().__init__(d_k, num_heads, d_v, d_model, output_norm)
        self._init_decay(gate_normalizer)

    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return self.log_alpha(x), torch.sigmoid(self.beta_gate(x))
