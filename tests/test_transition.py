"""The transition record (:mod:`attnlab.transition`): linear attention, per-head decay and per-key-channel decay, each
with and without the delta rule's β, in its four forms (``step``, ``recurrent``, ``chunked``, ``effective_matrix``),
against a reference written here from the papers' formula (an explicit state matrix updated one token at a time),
in float64, values and gradients w.r.t. q, k, v, log α and β; very strong per-channel decay (no overflow); the
reserved fields and the shape errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


def inputs(decay, use_beta, seed, length=L, scale=1.0):
    """Fresh random float64 leaves: q, k (L2-normalised under the delta rule), v, log α (per head, per channel or
    None) and β (or None)."""
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
    beta = torch.sigmoid(rnd(B, H, length)) if use_beta else None
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


def _one_token(q, k, v):
    return q[:, :, 0], k[:, :, 0], v[:, :, 0]


def _token_record(tr):
    """Token 0's record, keeping the reserved fields (``at`` itself refuses them)."""
    first = [None if t is None else t[:, :, 0] for t in (tr.log_decay, tr.beta)]
    return Transition(*first, low_rank=tr.low_rank, householder_steps=tr.householder_steps)


CALLS = {
    "step": lambda q, k, v, tr: step(None, *_one_token(q, k, v), _token_record(tr)),
    "recurrent": lambda q, k, v, tr: recurrent(q, k, v, tr),
    "chunked": lambda q, k, v, tr: chunked(q, k, v, tr, chunk_size=4),
    "effective_matrix": lambda q, k, v, tr: effective_matrix(q, k, tr),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("field", ["low_rank", "householder_steps"])
def test_reserved_fields_raise_not_implemented(call, field):
    q, k, v, log_decay, beta = (None if t is None else t.detach() for t in inputs("head", True, seed=11))
    extra = {"low_rank": (k, k)} if field == "low_rank" else {"householder_steps": 2}
    tr = Transition(log_decay, beta, **extra)
    with pytest.raises(NotImplementedError) as err:
        CALLS[call](q, k, v, tr)
    assert "\n" not in str(err.value) and ("RWKV-7" in str(err.value) or "DeltaProduct" in str(err.value))
    for method in (lambda: tr.at(0), lambda: tr.padded(1)):
        with pytest.raises(NotImplementedError):
            method()


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
