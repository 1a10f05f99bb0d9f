"""The transition record (:mod:`attnlab.transition`): linear attention, per-head decay and per-key-channel decay, each
with and without the delta rule's β, in its four forms (``step``, ``recurrent``, ``chunked``, ``effective_matrix``),
against a reference written here from the papers' formula (an explicit state matrix updated one token at a time),
in float64, values and gradients w.r.t. q, k, v, log α and β; β up to 2 (Grazzi et al. 2025) with KDA's order (the
per-channel decay first, then the delta write on the decayed state), chunk sizes 1 … 64, L = 0 and 1; the halving
blocks of the per-channel P and G (``_lower_channels``) against Σ_c x_ic y_jc exp(b_ic − b_jc) at every leaf size;
very strong per-channel decay (no overflow); L = 8192 in float32 against a float64 loop (with its adjoint written
out); the formerly reserved fields (DeltaProduct's steps, the low-rank term: in full in test_transition_rich.py)
and the shape errors.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnlab.transition as transition_module
from attnlab.transition import Transition, chunked, effective_matrix, recurrent, step

pytestmark = pytest.mark.usefixtures("single_thread")

B, H, L, DK, DV = 2, 2, 11, 4, 3
DECAYS = ("none", "head", "channel")
TOL = {"rtol": 1e-9, "atol": 1e-11}


# --------------------------------------------------------------------------------------------- the plain reference


def loop(q, k, v, log_decay=None, beta=None):
    """The recurrence written from its definition, over an explicit state M (d_k × d_v, the papers' Sᵀ) from 0:

        M_t = (I − β_t k_t k_tᵀ) diag(α_t) M_{t−1} + β_t k_t v_tᵀ     (delta rule; Yang et al. 2025, Kimi 2025 KDA)
        M_t = diag(α_t) M_{t−1} + k_t v_tᵀ                             (without β; Katharopoulos 2020, RetNet, GLA)
        o_t = M_tᵀ q_t

    α_t = exp(log α_t): a scalar per head ((B, H, L)) or a vector over the key channels ((B, H, L, d_k)), α ≡ 1
    when ``log_decay`` is None. q, k (B, H, L, d_k), v (B, H, L, d_v) → (o (B, H, L, d_v), the last M). Calls
    nothing of attnlab."""
    Bn, Hn, Ln, dk = q.shape
    dv = v.shape[-1]
    eye = torch.eye(dk, dtype=q.dtype)
    M = torch.zeros(Bn, Hn, dk, dv, dtype=q.dtype)
    outs = []
    for t in range(Ln):
        if log_decay is None:
            alpha = torch.ones(Bn, Hn, dk, dtype=q.dtype)
        elif log_decay.dim() == 3:
            alpha = torch.exp(log_decay[:, :, t]).unsqueeze(-1).expand(Bn, Hn, dk)
        else:
            alpha = torch.exp(log_decay[:, :, t])
        D = torch.diag_embed(alpha)  # (B, H, d_k, d_k)
        kt, vt, qt = k[:, :, t], v[:, :, t], q[:, :, t]
        outer = kt.unsqueeze(-1) @ vt.unsqueeze(-2)  # k vᵀ (B, H, d_k, d_v)
        if beta is None:
            M = D @ M + outer
        else:
            bt = beta[:, :, t][..., None, None]
            M = (eye - bt * (kt.unsqueeze(-1) @ kt.unsqueeze(-2))) @ D @ M + bt * outer
        outs.append((M.transpose(-1, -2) @ qt.unsqueeze(-1)).squeeze(-1))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(Bn, Hn, 0, dv)
    return o, M


def inputs(decay, use_beta, seed, length=L, scale=1.0, beta_range=1.0, beta_shift=0.0):
    """Fresh random float64 leaves: q, k (L2-normalised under the delta rule), v, log α (per head, per channel or
    None) and β = beta_range · σ(z + beta_shift), z ~ N(0, 1) (or None)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = rnd(B, H, length, DK), rnd(B, H, length, DK), rnd(B, H, length, DV)
    if use_beta:
        k = F.normalize(k, dim=-1)
    log_decay = None
    if decay == "head":
        log_decay = scale * F.logsigmoid(rnd(B, H, length) + 1.5)
    elif decay == "channel":
        log_decay = scale * F.logsigmoid(rnd(B, H, length, DK) + 1.5)
    beta = beta_range * torch.sigmoid(rnd(B, H, length) + beta_shift) if use_beta else None
    return [None if t is None else t.requires_grad_() for t in (q, k, v, log_decay, beta)]


def grads(out, leaves, seed=7):
    """Gradients of <out, c> for a fixed random cotangent c w.r.t. the leaves that are not None."""
    c = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    wrt = [t for t in leaves if t is not None]
    return torch.autograd.grad(out, wrt, grad_outputs=c, retain_graph=True)


def assert_matches_loop(out, leaves, **tol):
    tol = tol or TOL
    q, k, v, log_decay, beta = leaves
    expected, _ = loop(q, k, v, log_decay, beta)
    torch.testing.assert_close(out, expected, **tol)
    for got, want in zip(grads(out, leaves), grads(expected, leaves), strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **tol)


both = pytest.mark.parametrize("use_beta", [False, True], ids=["sum", "delta"])
decays = pytest.mark.parametrize("decay", DECAYS)


# --------------------------------------------------------------------------------------------- the forms


@decays
@both
def test_recurrent_equals_the_loop(decay, use_beta):
    leaves = inputs(decay, use_beta, seed=1)
    q, k, v, log_decay, beta = leaves
    assert_matches_loop(recurrent(q, k, v, Transition(log_decay, beta)), leaves)


@decays
@both
@pytest.mark.parametrize("chunk_size", [1, 4, 11, 64], ids=["C1", "C4-not-dividing", "C=L", "C>L"])
def test_chunked_equals_the_loop(decay, use_beta, chunk_size):
    leaves = inputs(decay, use_beta, seed=2 + chunk_size)
    q, k, v, log_decay, beta = leaves
    assert_matches_loop(chunked(q, k, v, Transition(log_decay, beta), chunk_size=chunk_size), leaves)


@decays
@both
def test_effective_matrix_times_v_equals_the_loop(decay, use_beta):
    leaves = inputs(decay, use_beta, seed=3)
    q, k, v, log_decay, beta = leaves
    A = effective_matrix(q, k, Transition(log_decay, beta))
    assert A.shape == (B, H, L, L)
    assert torch.equal(A.detach().triu(1), torch.zeros_like(A.detach()))  # causal: lower-triangular
    assert_matches_loop(A @ v, leaves)


@decays
@both
def test_step_carries_the_state_of_the_loop(decay, use_beta):
    q, k, v, log_decay, beta = (None if t is None else t.detach() for t in inputs(decay, use_beta, seed=4))
    record = Transition(log_decay, beta)
    state, outs = None, []
    for t in range(L):
        o, state = step(state, q[:, :, t], k[:, :, t], v[:, :, t], record.at(t))
        outs.append(o)
    expected, last = loop(q, k, v, log_decay, beta)
    torch.testing.assert_close(torch.stack(outs, dim=2), expected, **TOL)
    torch.testing.assert_close(state, last, **TOL)


@both
@pytest.mark.parametrize(
    "gate", ["strong", "mixed"], ids=["log-alpha-about-minus-50", "log-alpha-0-or-minus-80-by-channel"]
)
def test_chunked_with_very_strong_per_channel_decay_is_finite_and_equals_the_loop(use_beta, gate):
    length = 256
    leaves = inputs("none", use_beta, seed=5, length=length)
    g = torch.Generator().manual_seed(6)
    if gate == "strong":
        log_decay = -50.0 * (1.0 + 0.2 * torch.rand(B, H, length, DK, generator=g, dtype=torch.float64))
    else:
        log_decay = torch.zeros(B, H, length, DK, dtype=torch.float64)
        log_decay[..., 1::2] = -80.0
    leaves[3] = log_decay.requires_grad_()
    q, k, v, log_decay, beta = leaves
    out = chunked(q, k, v, Transition(log_decay, beta), chunk_size=64)
    assert torch.isfinite(out).all()
    assert_matches_loop(out, leaves, rtol=1e-8, atol=1e-10)


def test_linear_attention_is_the_default_transition():
    q, k, v, _, _ = (None if t is None else t.detach() for t in inputs("none", False, seed=8))
    expected, _ = loop(q, k, v)
    for out in (recurrent(q, k, v), chunked(q, k, v, chunk_size=3), effective_matrix(q, k) @ v):
        torch.testing.assert_close(out, expected, **TOL)


@decays
@both
def test_empty_sequence_gives_empty_outputs(decay, use_beta):
    q, k, v, log_decay, beta = inputs(decay, use_beta, seed=9, length=0)
    tr = Transition(log_decay, beta)
    assert recurrent(q, k, v, tr).shape == (B, H, 0, DV)
    assert chunked(q, k, v, tr).shape == (B, H, 0, DV)
    assert effective_matrix(q, k, tr).shape == (B, H, 0, 0)


# --------------------------------------------------------------------------------------------- β up to 2, KDA's order

# β = r·σ(z + shift): in (0, 1) (the papers'), across (0, 2) (Grazzi et al. 2025: I − β k kᵀ has the eigenvalue 1 − β
# ∈ (−1, 1)), and near 2 (1 − β ≈ −1: a near-reflection, which forgets nothing)
BETAS = {"beta_0_1": (1.0, 0.0), "beta_0_2": (2.0, 0.0), "beta_near_2": (2.0, 6.0)}
betas = pytest.mark.parametrize("beta_kind", list(BETAS))
MID = 40  # long enough for chunks of 33 to leave a remainder
# chunk sizes that divide MID (1, 2, 4), that do not (3, 7, 16, 33), and one above it (64)
CHUNKS = [1, 2, 3, 4, 7, 16, 33, 64]


def test_per_channel_decay_acts_before_the_delta_write():
    """KDA's order (Kimi Team 2025): M_t = (I − β k kᵀ) diag(α) M_{t−1} + β k vᵀ, the delta write reading the decayed
    state; the other order, diag(α) (I − β k kᵀ) M_{t−1} + β k vᵀ, differs for these inputs (so the test tells them
    apart) and ``step`` must not give it. β = 1.7 (beyond 1)."""
    g = torch.Generator().manual_seed(20)
    q = torch.randn(2, 1, DK, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(2, 1, DK, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(2, 1, DV, generator=g, dtype=torch.float64)
    M = torch.randn(2, 1, DK, DV, generator=g, dtype=torch.float64)
    log_decay = torch.tensor([-0.1, -3.0, -0.5, -1.5], dtype=torch.float64).expand(2, 1, DK)
    beta = torch.full((2, 1), 1.7, dtype=torch.float64)
    D = torch.diag_embed(log_decay.exp())
    kkT = k.unsqueeze(-1) @ k.unsqueeze(-2)
    eye = torch.eye(DK, dtype=torch.float64)
    write = beta[..., None, None] * (k.unsqueeze(-1) @ v.unsqueeze(-2))
    kda = (eye - beta[..., None, None] * kkT) @ D @ M + write
    other = D @ (eye - beta[..., None, None] * kkT) @ M + write
    assert (kda - other).abs().max() > 1e-2, "the two orders coincide for these inputs: the test would not tell"
    o, state = step(M, q, k, v, Transition(log_decay, beta))
    torch.testing.assert_close(state, kda, **TOL)
    torch.testing.assert_close(o, (kda.transpose(-1, -2) @ q.unsqueeze(-1)).squeeze(-1), **TOL)


@functools.cache
def beta_case(decay, beta_kind):
    """The inputs of one (decay, β) case (L = 40), with the loop's output and gradients (:func:`grads`), computed
    once for all the chunk sizes."""
    r, shift = BETAS[beta_kind]
    leaves = inputs(decay, True, seed=21, length=MID, beta_range=r, beta_shift=shift)
    expected, _ = loop(*leaves)
    return leaves, expected.detach(), [g.detach() for g in grads(expected, leaves)]


@decays
@betas
@pytest.mark.parametrize("chunk_size", CHUNKS, ids=lambda c: f"C{c}")
def test_chunked_with_beta_up_to_two_equals_the_loop(decay, beta_kind, chunk_size):
    """The chunked form with β in (0, 1), across (0, 2) and near 2, at chunk sizes that divide L = 40 (1, 2, 4),
    that do not (3, 7, 16, 33) and one above it (64): values and gradients w.r.t. q, k, v, log α and β equal the
    loop's (per channel: KDA; per head: Gated DeltaNet; none: DeltaNet)."""
    leaves, expected, expected_grads = beta_case(decay, beta_kind)
    q, k, v, log_decay, beta = leaves
    if beta_kind == "beta_0_2":
        assert beta.min() < 0.5 and beta.max() > 1.5, "β does not reach across (0, 2)"
    elif beta_kind == "beta_near_2":
        assert beta.min() > 1.8, "β is not near 2"
    out = chunked(q, k, v, Transition(log_decay, beta), chunk_size=chunk_size)
    torch.testing.assert_close(out, expected, **TOL)
    names = [n for n, t in zip(("q", "k", "v", "log α", "β"), leaves, strict=True) if t is not None]
    for name, got, want in zip(names, grads(out, leaves), expected_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"d/d{n}: {m}")


@decays
@betas
def test_recurrent_and_the_effective_matrix_with_beta_up_to_two_equal_the_loop(decay, beta_kind):
    """recurrent and effective_matrix · v (the signed matrix), β up to 2: values and gradients as the loop's."""
    r, shift = BETAS[beta_kind]
    leaves = inputs(decay, True, seed=22, length=MID, beta_range=r, beta_shift=shift)
    q, k, v, log_decay, beta = leaves
    record = Transition(log_decay, beta)
    assert_matches_loop(recurrent(q, k, v, record), leaves)
    A = effective_matrix(q, k, record)
    assert torch.equal(A.detach().triu(1), torch.zeros_like(A.detach()))
    assert (A.detach() < 0).any(), "the delta rule's effective matrix is signed"
    assert_matches_loop(A @ v, leaves)


def one_token_forms(q, k, v, record):
    """The outputs of one token's q, k, v (B, H, 1, ·) through every form: recurrent, chunked (chunks of 1 and 64)
    and the effective matrix times v."""
    return (
        recurrent(q, k, v, record),
        chunked(q, k, v, record, chunk_size=1),
        chunked(q, k, v, record, chunk_size=64),
        effective_matrix(q, k, record) @ v,
    )


@decays
@betas
def test_one_token_and_no_token_with_beta_up_to_two(decay, beta_kind):
    """L = 1: the three forms (chunk sizes 1 and 64) give the loop's β (q·k) v, values and gradients; L = 0: empty
    outputs of the right shapes."""
    r, shift = BETAS[beta_kind]
    leaves = inputs(decay, True, seed=23, length=1, beta_range=r, beta_shift=shift)
    q, k, v, log_decay, beta = leaves
    record = Transition(log_decay, beta)
    with torch.no_grad():
        torch.testing.assert_close(loop(q, k, v, log_decay, beta)[0], beta[..., None] * (q * k).sum(-1, True) * v)
    for out in one_token_forms(q, k, v, record):
        assert_matches_loop(out, leaves)
    q, k, v, log_decay, beta = inputs(decay, True, seed=24, length=0, beta_range=r, beta_shift=shift)
    record = Transition(log_decay, beta)
    assert recurrent(q, k, v, record).shape == chunked(q, k, v, record, chunk_size=3).shape == (B, H, 0, DV)
    assert effective_matrix(q, k, record).shape == (B, H, 0, 0)


@functools.cache
def decay_case(decay):
    """The inputs of one decay without β (L = 40: GLA's per-head or per-channel gate), the loop's output and
    gradients, computed once for all the chunk sizes."""
    leaves = inputs(decay, False, seed=26, length=MID)
    expected, _ = loop(*leaves)
    return leaves, expected.detach(), [g.detach() for g in grads(expected, leaves)]


@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("chunk_size", CHUNKS, ids=lambda c: f"C{c}")
def test_chunked_decay_without_beta_at_every_chunk_size_equals_the_loop(decay, chunk_size):
    """GLA's decay without the delta rule (per head; per key channel: the original GLA) in chunks that divide L = 40
    (1, 2, 4), that do not (3, 7, 16, 33) and one above it (64): values and gradients w.r.t. q, k, v and log α equal
    the loop's."""
    leaves, expected, expected_grads = decay_case(decay)
    q, k, v, log_decay, _ = leaves
    out = chunked(q, k, v, Transition(log_decay), chunk_size=chunk_size)
    torch.testing.assert_close(out, expected, **TOL)
    for name, got, want in zip(("q", "k", "v", "log α"), grads(out, leaves), expected_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"d/d{n}: {m}")


@decays
@betas
def test_step_with_beta_up_to_two_carries_the_loops_outputs_state_and_gradients(decay, beta_kind):
    """Decoding (``step`` from no state, token after token, each token's record from ``Transition.at``), β up to 2
    and KDA's order per channel: each output and the last state equal the loop's, and so do their gradients
    w.r.t. q, k, v, log α and β (the state's: k, v, log α and β)."""
    r, shift = BETAS[beta_kind]
    n = 9
    leaves = inputs(decay, True, seed=27, length=n, beta_range=r, beta_shift=shift)
    q, k, v, log_decay, beta = leaves
    record = Transition(log_decay, beta)
    state, outs = None, []
    for t in range(n):
        o, state = step(state, q[:, :, t], k[:, :, t], v[:, :, t], record.at(t))
        assert o.shape == (B, H, DV) and state.shape == (B, H, DK, DV)
        outs.append(o)
    assert_matches_loop(torch.stack(outs, dim=2), leaves)
    _, last = loop(*leaves)
    torch.testing.assert_close(state, last, **TOL)
    no_q = [None, *leaves[1:]]  # the state does not depend on q
    for got, want in zip(grads(state, no_q), grads(last, no_q), strict=True):
        torch.testing.assert_close(got, want, **TOL)


@decays
def test_one_token_without_beta_is_q_dot_k_times_v_whatever_the_decay(decay):
    """L = 1 without β: every form gives (q·k) v (the first token's decay acts on the empty state, so d/d log α
    is 0), values and gradients as the loop's."""
    leaves = inputs(decay, False, seed=28, length=1)
    q, k, v, log_decay, _ = leaves
    record = Transition(log_decay)
    with torch.no_grad():
        torch.testing.assert_close(loop(q, k, v, log_decay)[0], (q * k).sum(-1, True) * v, **TOL)
    for out in one_token_forms(q, k, v, record):
        assert_matches_loop(out, leaves)
        if log_decay is not None:
            (g,) = torch.autograd.grad(out, log_decay, torch.ones_like(out), retain_graph=True, allow_unused=True)
            assert g is None or not g.any()


@pytest.mark.parametrize("leaf", [2, 4, 8])
def test_the_per_channel_forms_do_not_depend_on_the_leaf_size(monkeypatch, leaf):
    """With CHANNEL_LEAF (the size of the diagonal blocks done directly) 2, 4 or 8 instead of 1, the per-channel
    chunked form (chunk sizes 16 and 33) and the effective matrix still equal the loop, β up to 2."""
    monkeypatch.setattr(transition_module, "CHANNEL_LEAF", leaf)
    leaves = inputs("channel", True, seed=25, length=MID, beta_range=2.0)
    q, k, v, log_decay, beta = leaves
    record = Transition(log_decay, beta)
    for out in (chunked(q, k, v, record, chunk_size=16), chunked(q, k, v, record, chunk_size=33)):
        assert_matches_loop(out, leaves)
    assert_matches_loop(effective_matrix(q, k, record) @ v, leaves)


# --------------------------------------------------------------------------------------------- the halving blocks


def lower_channels_reference(x, y, b, diagonal):
    """Σ_c x_ic y_jc exp(b_ic − b_jc) for j ≤ i + ``diagonal``, 0 for the other j, one row i at a time (the leading
    axes of x, y and b broadcast): (…, n, d_k) → (…, n, n)."""
    n = x.shape[-2]
    lead = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2], b.shape[:-2])
    rows = []
    for i in range(n):
        m = max(0, min(n, i + diagonal + 1))  # the columns j ≤ i + diagonal
        terms = x[..., i : i + 1, :] * y[..., :m, :] * torch.exp(b[..., i : i + 1, :] - b[..., :m, :])
        row = terms.sum(-1).expand(*lead, m)
        rows.append(torch.cat([row, torch.zeros(*lead, n - m, dtype=x.dtype)], dim=-1))
    return torch.stack(rows, dim=-2)


@pytest.mark.parametrize("diagonal", [0, -1])
@pytest.mark.parametrize("n", [1, 2, 5, 16, 37])
def test_lower_channels_is_the_plain_sum_at_every_leaf_size(monkeypatch, n, diagonal):
    """``_lower_channels`` (the halving blocks) equals Σ_c x_ic y_jc exp(b_ic − b_jc) on and below the diagonal
    (0: P; −1: G strictly below it), for n a power of two or not, x alone or stacked on a leading axis that
    broadcasts against y and b, and CHANNEL_LEAF 1, 2, 4, 8 alike: values and gradients w.r.t. x, y and b (b
    nonincreasing, some channels decaying by e^−30 per step, so that the factors of the halving underflow)."""
    g = torch.Generator().manual_seed(30 + n)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    d = 5
    log_alpha = F.logsigmoid(rnd(B, H, n, d) + 1.0)
    log_alpha[..., 0] = -30.0  # a channel that forgets at once
    b = log_alpha.cumsum(-2).requires_grad_()
    x, y = rnd(2, B, H, n, d).requires_grad_(), rnd(B, H, n, d).requires_grad_()
    expected = lower_channels_reference(x, y, b, diagonal)
    assert expected.shape == (2, B, H, n, n)
    for leaf in (1, 2, 4, 8):
        monkeypatch.setattr(transition_module, "CHANNEL_LEAF", leaf)
        for got, want, wrt in (
            (transition_module._lower_channels(x, y, b, diagonal), expected, (x, y, b)),
            (transition_module._lower_channels(x[1], y, b, diagonal), expected[1], (x, y, b)),
        ):
            assert got.shape == want.shape, f"leaf {leaf}"
            msg = lambda m, leaf=leaf: f"CHANNEL_LEAF={leaf}: {m}"  # noqa: E731
            torch.testing.assert_close(got, want, **TOL, msg=msg)
            for gg, gw in zip(grads(got, wrt), grads(want, wrt), strict=True):
                torch.testing.assert_close(gg, gw, **TOL, msg=msg)


# --------------------------------------------------------------------------------------------- L = 8192 in float32


def numpy_loop(q, k, v, log_decay, beta, cotangent):
    """The per-channel recurrence in float64 NumPy, one token at a time, and its adjoint (the reverse-mode gradient
    written out: autograd through 8192 tiny steps takes tens of seconds): q, k (n, L, d_k), v (n, L, d_v),
    log α (n, L, d_k), β (n, L) or None, the cotangent c (n, L, d_v) → o (n, L, d_v) and the gradients of <o, c>
    w.r.t. q, k, v, log α and β (None without β). With A_t = I − β_t k_t k_tᵀ (I without β) and D_t = diag(α_t):

        M_t = A_t D_t M_{t−1} + β_t k_t v_tᵀ,  o_t = M_tᵀ q_t                                      (forward, t ↑)
        G_t = ∂/∂M_t = q_t c_tᵀ + D_{t+1} A_{t+1}ᵀ G_{t+1}                                          (adjoint, t ↓)
        ∂q_t = M_t c_t,  ∂v_t = β_t G_tᵀ k_t,  ∂log α_tc = α_tc Σ_v (A_tᵀ G_t)_cv (M_{t−1})_cv,
        with E = G_t (D_t M_{t−1})ᵀ: ∂β_t = k_tᵀ G_t v_t − k_tᵀ E k_t,  ∂k_t = β_t G_t v_t − β_t (E + Eᵀ) k_t

    Only the two recurrences run token by token; the rest is vectorised over t (checked against autograd of
    :func:`loop` in ``test_the_numpy_oracle_is_the_loop_and_its_gradient``)."""
    q, k, v, log_decay, c = (np.moveaxis(t, 1, 0) for t in (q, k, v, log_decay, cotangent))  # (L, n, ·)
    length, n, dk = q.shape
    alpha = np.exp(log_decay)
    b = np.ones((length, n)) if beta is None else np.moveaxis(beta, 1, 0)
    A = np.broadcast_to(np.eye(dk), (length, n, dk, dk))
    if beta is not None:
        A = A - b[..., None, None] * k[..., :, None] * k[..., None, :]
    write = b[..., None, None] * k[..., :, None] * v[..., None, :]  # β_t k_t v_tᵀ
    states = np.zeros((length + 1, n, dk, v.shape[-1]))  # M_0 = 0, M_1, …, M_L
    for t in range(length):
        states[t + 1] = A[t] @ (alpha[t, :, :, None] * states[t]) + write[t]
    o = np.einsum("tnkv,tnk->tnv", states[1:], q)
    read = q[..., :, None] * c[..., None, :]  # q_t c_tᵀ
    G = np.empty(states[1:].shape)
    G[-1] = read[-1]
    for t in reversed(range(length - 1)):
        G[t] = read[t] + alpha[t + 1, :, :, None] * (A[t + 1].swapaxes(-1, -2) @ G[t + 1])
    decayed = alpha[..., None] * states[:-1]  # D_t M_{t−1}
    E = G @ decayed.swapaxes(-1, -2)
    Gv = np.einsum("tnkv,tnv->tnk", G, v)
    dq = np.einsum("tnkv,tnv->tnk", states[1:], c)
    dv = b[..., None] * np.einsum("tnkv,tnk->tnv", G, k)
    dlog = alpha * ((A.swapaxes(-1, -2) @ G) * states[:-1]).sum(-1)
    if beta is None:
        dk_, dbeta = Gv, None
    else:
        dbeta = np.moveaxis((k * Gv).sum(-1) - np.einsum("tnk,tnkj,tnj->tn", k, E, k), 0, 1)
        dk_ = b[..., None] * (Gv - np.einsum("tnkj,tnj->tnk", E + E.swapaxes(-1, -2), k))
    o, dq, dk_, dv, dlog = (np.moveaxis(t, 0, 1) for t in (o, dq, dk_, dv, dlog))
    return o, (dq, dk_, dv, dlog, dbeta)


@pytest.mark.parametrize("use_beta", [False, True], ids=["sum", "delta"])
def test_the_numpy_oracle_is_the_loop_and_its_gradient(use_beta):
    """The float64 NumPy loop and its written-out adjoint equal :func:`loop` and autograd's gradients through it
    (per-channel decay, β across (0, 2)), so that the long test below compares with the recurrence itself."""
    leaves = inputs("channel", use_beta, seed=40, length=9, beta_range=2.0)
    q, k, v, log_decay, beta = leaves
    expected, _ = loop(q, k, v, log_decay, beta)
    cot = torch.randn(expected.shape, generator=torch.Generator().manual_seed(41), dtype=torch.float64)
    wanted = torch.autograd.grad(expected, [t for t in leaves if t is not None], cot)

    def flat(t):  # (B, H, L, ·) → (B·H, L, ·) NumPy
        return None if t is None else t.detach().reshape(B * H, *t.shape[2:]).numpy()

    o, got = numpy_loop(*(flat(t) for t in (q, k, v, log_decay, beta, cot)))
    np.testing.assert_allclose(o, flat(expected), rtol=1e-12, atol=1e-13)
    for g_np, want in zip((t for t in got if t is not None), wanted, strict=True):
        np.testing.assert_allclose(g_np, flat(want), rtol=1e-12, atol=1e-13)


LONG, LONG_DK = 8192, 4
LONG_GATES = ("near_0", "near_1", "mixed")  # log α ≈ −50, ≈ −10⁻⁴, or −50 and −10⁻⁴ on alternate channels
LONG_BETAS = ("no_delta", "beta_near_0", "beta_near_2")
# the effective matrix is O(L²) and the recurrent form a Python loop: checked on the first tokens (o_t depends on the
# tokens up to t only, so the reference is the long loop's first outputs)
PREFIX = {"effective": 512, "recurrent": 2048}


def long_inputs(rng, gate, beta_kind):
    """One sequence (L = 8192, d_k = d_v = 4) of the long test, float64 NumPy: q, k (unit keys under the delta
    rule, k/2 otherwise), v (L, d), log α (L, d_k) by ``gate``, β (L,) by ``beta_kind`` (or None) and a cotangent
    (L, d)."""
    q, k, v, cot = (rng.standard_normal((LONG, LONG_DK)) for _ in range(4))
    k = k / 2.0 if beta_kind == "no_delta" else k / np.linalg.norm(k, axis=-1, keepdims=True)
    u = rng.random((LONG, LONG_DK))
    near_0, near_1 = -50.0 * (1.0 + 0.2 * u), -1e-4 * (1.0 + u)
    log_decay = {"near_0": near_0, "near_1": near_1, "mixed": np.where(np.arange(LONG_DK) % 2 == 0, near_0, near_1)}
    ub = rng.random(LONG)
    beta = {"no_delta": None, "beta_near_0": 1e-3 * ub, "beta_near_2": 2.0 - 1e-3 * ub}[beta_kind]
    return q, k, v, log_decay[gate], beta, cot


@pytest.fixture(scope="module")
def long_runs():
    """Every (gate, β) of the long test as one sequence of a batch (one head), those without β in one batch, those
    with it in another: the float64 NumPy loop's outputs and gradients (:func:`numpy_loop`) and, in float32, the
    chunked form's outputs and gradients (chunk size 64), the recurrent form's and the effective matrix's outputs on
    the first tokens (:data:`PREFIX`); computed once for the module. → {(gate, β): {name: (float32 result, float64
    reference or None)}}."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = np.random.default_rng(50)
    runs = {}
    for batch in (("no_delta",), ("beta_near_0", "beta_near_2")):
        cases = [(gate, beta_kind) for beta_kind in batch for gate in LONG_GATES]
        drawn = [long_inputs(rng, *case) for case in cases]
        q, k, v, log_decay, beta, cot = (None if a[0] is None else np.stack(a) for a in zip(*drawn, strict=True))
        o64, g64 = numpy_loop(q, k, v, log_decay, beta, cot)
        leaves = [
            None if a is None else torch.tensor(a, dtype=torch.float32)[:, None].requires_grad_()
            for a in (q, k, v, log_decay, beta)
        ]
        wrt = [t for t in leaves if t is not None]
        out = chunked(*leaves[:3], Transition(*leaves[3:]))
        g32 = torch.autograd.grad(out, wrt, torch.tensor(cot, dtype=torch.float32)[:, None])
        with torch.no_grad():
            first = {name: [None if t is None else t[:, :, :m] for t in leaves] for name, m in PREFIX.items()}
            rec = recurrent(*first["recurrent"][:3], Transition(*first["recurrent"][3:]))
            A = effective_matrix(*first["effective"][:2], Transition(*first["effective"][3:]))
            eff = A @ first["effective"][2]
        names = ["d/dq", "d/dk", "d/dv", "d/dlog_decay", "d/dbeta"][: len(wrt)]
        for i, case in enumerate(cases):
            run = {
                "chunked": (out[i, 0], o64[i]),
                "recurrent": (rec[i, 0], o64[i, : PREFIX["recurrent"]]),
                "effective matrix": (A[i, 0], None),
                "effective matrix · v": (eff[i, 0], o64[i, : PREFIX["effective"]]),
            }
            for name, got, want in zip(names, g32, (g for g in g64 if g is not None), strict=True):
                run[f"chunked {name}"] = (got[i, 0], want[i])
            runs[case] = run
    torch.set_num_threads(previous)
    return runs


@pytest.mark.parametrize("beta_kind", LONG_BETAS)
@pytest.mark.parametrize("gate", LONG_GATES)
def test_a_long_per_channel_sequence_in_float32_is_finite_and_near_the_float64_loop(long_runs, gate, beta_kind):
    """L = 8192 in float32, per-channel log α ≈ −50 (gates near 0: e^−50 is below float32's e^−23 floor), ≈ −10⁻⁴
    (near 1: a memory longer than the sequence) or both on alternate channels, β near 0 (~10⁻³), near 2 (1 − β ≈ −1)
    or none (GLA's per-channel gate): the chunked form's output and gradients (w.r.t. q, k, v, log α, β), the
    recurrent form's output (first 2048 tokens) and the effective matrix and its output (first 512 tokens) are finite
    and within 10⁻⁴ of the largest entry of the float64 loop's (each gradient: of its own largest entry), + 10⁻¹²
    absolute: d/d log α at log α ≈ −50 is ≈ e^−50 exactly, 0 in float32, below anything float32 resolves.

    The tolerance: float32 rounds at ε = 6·10⁻⁸; where α ≈ 1 and β ≈ 2, I − β k kᵀ is nearly a reflection (norm 1),
    so the rounding of every token is carried, not forgotten, and adds up like a random walk over L tokens:
    √8192 · 6·10⁻⁸ ≈ 5·10⁻⁶ of the state's scale, a few times that through a chunk's sums (up to 1.7·10⁻⁵ of the
    largest output and of the largest gradient are measured there; 10⁻⁷ – 10⁻⁶ elsewhere). 10⁻⁴ leaves a margin
    of about six, and fails an error of a hundredth of a percent of the scale."""
    for name, (got, want) in long_runs[gate, beta_kind].items():
        assert torch.isfinite(got).all(), f"{name}: {(~torch.isfinite(got)).sum()} non-finite entries"
        if want is None:
            continue
        want = torch.from_numpy(want)
        atol = 1e-4 * float(want.abs().max()) + 1e-12
        torch.testing.assert_close(got.double(), want, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------------------------- the record


def test_at_and_padded_give_a_token_record_and_a_longer_one():
    _, _, _, per_head, beta = inputs("head", True, seed=10)
    per_channel = inputs("channel", False, seed=10)[3]
    assert Transition(per_channel).per_channel and not Transition(per_head, beta).per_channel
    assert not Transition().per_channel
    assert Transition(per_channel, beta).at(3).log_decay.shape == (B, H, DK)
    token = Transition(per_head, beta).at(3)
    assert token.log_decay.shape == token.beta.shape == (B, H)
    padded = Transition(per_channel, beta).padded(5)
    assert padded.log_decay.shape == (B, H, L + 5, DK) and padded.beta.shape == (B, H, L + 5)
    assert torch.equal(padded.log_decay[:, :, L:], torch.zeros(B, H, 5, DK, dtype=torch.float64))
    assert torch.equal(padded.beta[:, :, L:], torch.zeros(B, H, 5, dtype=torch.float64))
    assert Transition(per_head).padded(2).log_decay.shape == (B, H, L + 2)


def _one_token(q, k, v, n=1):
    """Token 0's q (B, H, d_k), k and v ((B, H, ·), or its n steps' (B, H, n, ·) with ``householder_steps`` n)."""
    if n == 1:
        return q[:, :, 0], k[:, :, 0], v[:, :, 0]
    return q[:, :, 0], k[:, :, :n], v[:, :, :n]


def _token_record(tr):
    """Token 0's record, sliced by hand (``at`` checks the record first): log α (B, H) or (B, H, d_k), β (B, H) or
    its n steps' (B, H, n), low_rank's a and b (B, H, d_k)."""
    n = tr.householder_steps
    log_decay = None if tr.log_decay is None else tr.log_decay[:, :, 0]
    beta = None if tr.beta is None else (tr.beta[:, :, 0] if n == 1 else tr.beta[:, :, :n])
    low_rank = None if tr.low_rank is None else tuple(t[:, :, 0] for t in tr.low_rank)
    return Transition(log_decay, beta, low_rank=low_rank, householder_steps=n)


def _first_step(q, k, v, tr):
    """``step`` on token 0 from no state: its output as (B, H, 1, d_v)."""
    o, _ = step(None, *_one_token(q, k, v, tr.householder_steps), _token_record(tr))
    return o[:, :, None]


CALLS = {
    "step": _first_step,
    "recurrent": lambda q, k, v, tr: recurrent(q, k, v, tr),
    "chunked": lambda q, k, v, tr: chunked(q, k, v, tr, chunk_size=4),
    "effective_matrix": lambda q, k, v, tr: effective_matrix(q, k, tr),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("field", ["low_rank", "householder_steps"])
def test_the_formerly_reserved_fields_are_computed(call, field):
    """``low_rank`` (RWKV-7's diagonal plus low rank) and ``householder_steps`` = 2 (DeltaProduct), once refused with
    NotImplementedError, are computed by every form: the output (``effective_matrix`` times v) is finite, has the
    shape of the record without the field, differs from that record's output, and equals the recurrent form's
    (``step``: on token 0). Their values against plain loops: tests/test_transition_rich.py."""
    q, k, v, log_decay, beta = (None if t is None else t.detach() for t in inputs("head", True, seed=11))
    plain = Transition(log_decay, beta)
    if field == "low_rank":  # RWKV-7's a = −κ̂, b = κ̂ ⊙ iclr (iclr 0.5)
        kappa = F.normalize(k.roll(1, dims=2), dim=-1)
        k2, v2, tr = k, v, Transition(log_decay, low_rank=(-kappa, 0.5 * kappa))
    else:  # two steps a token, (B, H, 2L, ·): token t's own k, v, β, then token t − 1's again

        def steps(t):
            return torch.stack([t, t.roll(1, dims=2)], dim=3).flatten(2, 3)

        k2, v2, tr = steps(k), steps(v), Transition(log_decay, steps(beta.unsqueeze(-1)).squeeze(-1), None, 2)
    out, without = CALLS[call](q, k2, v2, tr), CALLS[call](q, k, v, plain)
    if call == "effective_matrix":
        assert out.shape == (B, H, L, k2.shape[2])
        out, without = out @ v2, without @ v
    assert out.shape == without.shape and torch.isfinite(out).all()
    assert (out - without).abs().max() > 1e-3, "the field changes nothing"
    expected = recurrent(q, k2, v2, tr)[:, :, : out.shape[2]]
    torch.testing.assert_close(out, expected, **TOL)


SHAPE_ERRORS = {
    "log_decay": (lambda q, k, v: ((q, k, v), Transition(log_decay=torch.zeros(B, H, L + 1))), "(B, H, L) = "),
    "log_decay-channels": (lambda q, k, v: ((q, k, v), Transition(torch.zeros(B, H, L, DK + 1))), "d_k) = "),
    "beta": (lambda q, k, v: ((q, k, v), Transition(beta=torch.zeros(B, H, L, 1))), "transition.beta"),
    "k": (lambda q, k, v: ((q, k[..., :-1], v), Transition()), "k must have q's shape"),
    "v": (lambda q, k, v: ((q, k, v[:, :, :-1]), Transition()), "v must be (B, H, L, d_v)"),
    "q": (lambda q, k, v: ((q[0], k[0], v[0]), Transition()), "q must be (B, H, L, d_k)"),
}


@pytest.mark.parametrize(
    ("form", "case"),
    [
        (form, case)
        for form in ("recurrent", "chunked", "effective_matrix")
        for case in SHAPE_ERRORS
        if not (form == "effective_matrix" and case == "v")  # it takes no v
    ],
)
def test_shape_errors_are_one_line_naming_the_expected_shape(form, case):
    q, k, v, _, _ = (None if t is None else t.detach() for t in inputs("none", False, seed=12))
    make, expected = SHAPE_ERRORS[case]
    (q, k, v), tr = make(q, k, v)
    with pytest.raises(ValueError) as err:
        CALLS[form](q, k, v, tr)
    message = str(err.value)
    assert "\n" not in message and expected in message, message


def test_step_shape_errors_are_one_line():
    q, k, v = (t.detach() for t in inputs("none", False, seed=13)[:3])
    qt, kt, vt = _one_token(q, k, v)
    cases = [
        ((None, qt, kt, vt, Transition(torch.zeros(B, H + 1))), "transition.log_decay must have shape (B, H)"),
        ((None, qt, kt, vt, Transition(beta=torch.zeros(B, H, 1))), "transition.beta must have shape (B, H)"),
        ((torch.zeros(B, H, DK, DV + 1), qt, kt, vt, None), "state must be (B, H, d_k, d_v)"),
        ((None, q, k, v, None), "q must be one token's (B, H, d_k)"),
    ]
    for args, expected in cases:
        with pytest.raises(ValueError) as err:
            step(*args)
        assert "\n" not in str(err.value) and expected in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
        chunked(q, k, v, chunk_size=0)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("use_beta", [False, True], ids=["sum", "delta"])
def test_a_gate_of_exactly_zero_forgets_everything_before_it_and_is_not_nan(per_channel, use_beta):
    """log α = −∞ at one token (α = 0: the state is wiped there) gives the loop's numbers, not −∞ − (−∞) = NaN in the
    cumulative sums of the chunked form and the effective matrix (float64)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 16, 3, generator=g, dtype=torch.float64) for _ in range(3))
    k = F.normalize(k, dim=-1)
    shape = (1, 2, 16, 3) if per_channel else (1, 2, 16)
    log_decay = -torch.rand(*shape, generator=g, dtype=torch.float64)
    log_decay[:, :, 5] = -float("inf")
    beta = torch.rand(1, 2, 16, generator=g, dtype=torch.float64) if use_beta else None
    expected = loop(q, k, v, log_decay, beta)[0]
    record = Transition(log_decay, beta)
    for out in (chunked(q, k, v, record, chunk_size=8), effective_matrix(q, k, record) @ v):
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_float16_sums_of_very_strong_gates_stay_finite():
    """log α = −1600 a token in float16 (a chunk's sum of them would pass float16's 65504): the chunked form stays
    finite and equals what the loop gives there to float16's resolution: each token forgets all before it,
    o_t = (q_t·k_t) v_t."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 1, 128, 4, generator=g) for _ in range(3))
    log_decay = torch.full((1, 1, 128, 4), -1600.0)
    out = chunked(q.half(), k.half(), v.half(), Transition(log_decay.half()))
    expected = (q * k).sum(-1, keepdim=True) * v
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
