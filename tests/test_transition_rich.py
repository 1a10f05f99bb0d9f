"""The richer transitions of :mod:`attnlab.transition`: DeltaProduct's several Householder steps per token
(``householder_steps`` = n, Siems et al. 2025) and RWKV-7's diagonal-plus-low-rank transition (``low_rank`` = (a, b),
Peng et al. 2025), in their four forms (``step``, ``recurrent``, ``chunked``, ``effective_matrix``).

Each is compared with a reference written here from its definition, one token at a time over an explicit state
matrix M (d_k × d_v, the papers' Sᵀ) built from explicit d_k × d_k matrices (calling nothing of attnlab):

    DeltaProduct:  M ← diag(α_t) M,  then M ← (I − β_{t,s} k_{t,s} k_{t,s}ᵀ) M + β_{t,s} k_{t,s} v_{t,s}ᵀ, s = 1 … n
    low rank:      M ← (diag(α_t) + b_t a_tᵀ) M + k_t v_tᵀ          (a reads the state before the decay)
    o_t = Mᵀ q_t

in float64, values and gradients (of a random projection of the output) w.r.t. q, k, v, log α, β, a and b: n = 1, 2,
3 with no decay, a per-head and a per-channel decay, β across (0, 2); RWKV-7's a = −κ̂, b = κ̂ ⊙ iclr with each decay,
and a generic (a, b); chunk sizes 1 … 64 on L = 37; L = 1 and L = 0; the decoding chain of ``step``. Then identities
with the delta rule and the decay alone (a DeltaProduct step with β = 0 does nothing; the delta rule is the low-rank
case a = −α ⊙ k, b = β k with v scaled by β), tokens that leave the state as it was (padding), L = 8192 in float32
at extreme gates (log α ≈ −20, −10³, −∞ and ≈ −10⁻⁶), β near 0 and 2, iclr near 0 and 1 against float64, and the
one-line ``ValueError`` of every invalid record.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from attnlab.transition import Transition, chunked, effective_matrix, recurrent, step

pytestmark = pytest.mark.usefixtures("single_thread")

B, H, L, DK, DV = 2, 2, 37, 4, 3
TOL = {"rtol": 1e-10, "atol": 1e-10}
CHUNKS = [1, 2, 3, 5, 7, 16, 64]  # 37 is prime: no chunk size but 1 divides it, and 64 is above it

# id → (family, n = householder_steps, decay): "householder" (DeltaProduct, β across (0, 2), unit keys), "rwkv7"
# (a = −κ̂, b = κ̂ ⊙ iclr, κ̂ unit, iclr in (0, 1) per channel), "low_rank" (a, b any: 0.3 · N(0, 1) each)
KINDS = {
    **{
        f"householder-n{n}-{name}": ("householder", n, decay)
        for n in (1, 2, 3)
        for decay, name in (("none", "no-decay"), ("head", "per-head"), ("channel", "per-channel"))
    },
    "rwkv7-per-channel": ("rwkv7", 1, "channel"),
    "rwkv7-per-head": ("rwkv7", 1, "head"),
    "rwkv7-no-decay": ("rwkv7", 1, "none"),
    "low_rank-generic-per-channel": ("low_rank", 1, "channel"),
}
LOW_RANK_KINDS = [kind for kind, (family, _, _) in KINDS.items() if family != "householder"]
kinds = pytest.mark.parametrize("kind", list(KINDS))
decays = pytest.mark.parametrize("decay", ["none", "head", "channel"], ids=["no-decay", "per-head", "per-channel"])


# --------------------------------------------------------------------------------------------- the plain references


def alpha_at(log_decay, t, like):
    """α_t as a vector over the key channels (B, H, d_k): exp of a per-head log α repeated, of a per-channel one as
    it is, or ones without a decay. ``like``: a (B, H, d_k) tensor of the token."""
    if log_decay is None:
        return torch.ones_like(like)
    if log_decay.dim() == 3:
        return torch.exp(log_decay[:, :, t]).unsqueeze(-1).expand_as(like)
    return torch.exp(log_decay[:, :, t])


def householder_loop(q, k, v, log_decay, beta, n):
    """DeltaProduct (Siems et al. 2025) from its definition: for each token t, M ← diag(α_t) M, then for each of its n
    steps s (k, v, β at index t·n + s) M ← (I − β k kᵀ) M + β k vᵀ with the Householder-like matrix written out, then
    o_t = Mᵀ q_t. q (B, H, L, d_k), k (B, H, L·n, d_k), v (B, H, L·n, d_v), log α (B, H, L) or (B, H, L, d_k) or
    None, β (B, H, L·n) → (o (B, H, L, d_v), the last M)."""
    Bn, Hn, Ln, dk = q.shape
    eye = torch.eye(dk, dtype=q.dtype)
    M = torch.zeros(Bn, Hn, dk, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(Ln):
        M = torch.diag_embed(alpha_at(log_decay, t, q[:, :, t])) @ M
        for s in range(n):
            i = t * n + s
            kc = k[:, :, i].unsqueeze(-1)  # (B, H, d_k, 1)
            bt = beta[:, :, i][..., None, None]
            householder = eye - bt * (kc @ kc.transpose(-1, -2))  # I − β k kᵀ
            M = householder @ M + bt * (kc @ v[:, :, i].unsqueeze(-2))
        outs.append((M.transpose(-1, -2) @ q[:, :, t].unsqueeze(-1)).squeeze(-1))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(Bn, Hn, 0, v.shape[-1])
    return o, M


def low_rank_loop(q, k, v, log_decay, a, b):
    """The diagonal-plus-low-rank recurrence (RWKV-7, Peng et al. 2025, in M = Sᵀ's orientation) from its definition:
    M_t = G_t M_{t−1} + k_t v_tᵀ with the transition matrix G_t = diag(α_t) + b_t a_tᵀ (d_k × d_k) written out,
    o_t = M_tᵀ q_t. q, k, a, b (B, H, L, d_k), v (B, H, L, d_v), log α per head, per channel or None."""
    Bn, Hn, Ln, dk = q.shape
    M = torch.zeros(Bn, Hn, dk, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(Ln):
        G = torch.diag_embed(alpha_at(log_decay, t, q[:, :, t])) + b[:, :, t].unsqueeze(-1) @ a[:, :, t].unsqueeze(-2)
        M = G @ M + k[:, :, t].unsqueeze(-1) @ v[:, :, t].unsqueeze(-2)
        outs.append((M.transpose(-1, -2) @ q[:, :, t].unsqueeze(-1)).squeeze(-1))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(Bn, Hn, 0, v.shape[-1])
    return o, M


def reference(kind, leaves):
    """The loop of ``kind`` on ``leaves`` → (o, last M)."""
    family, n, _ = KINDS[kind]
    get = leaves.get
    if family == "householder":
        return householder_loop(get("q"), get("k"), get("v"), get("log_decay"), get("beta"), n)
    return low_rank_loop(get("q"), get("k"), get("v"), get("log_decay"), get("a"), get("b"))


# --------------------------------------------------------------------------------------------- inputs and records


def make(kind, seed, length=L, batch=B):
    """Fresh random float64 leaves of ``kind`` (requiring grad), as a dict q, k, v[, log_decay][, beta][, a, b]: unit
    keys and β = 2 σ(z) (across (0, 2)) for DeltaProduct; log α = logσ(z + 1.5) per head or per channel."""
    family, n, decay = KINDS[kind]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    steps = length * n
    leaves = {"q": rnd(batch, H, length, DK), "k": rnd(batch, H, steps, DK), "v": rnd(batch, H, steps, DV)}
    if decay == "head":
        leaves["log_decay"] = F.logsigmoid(rnd(batch, H, length) + 1.5)
    elif decay == "channel":
        leaves["log_decay"] = F.logsigmoid(rnd(batch, H, length, DK) + 1.5)
    if family == "householder":
        leaves["k"] = F.normalize(leaves["k"], dim=-1)
        leaves["beta"] = 2.0 * torch.sigmoid(rnd(batch, H, steps))
    elif family == "rwkv7":
        kappa = F.normalize(rnd(batch, H, length, DK), dim=-1)
        iclr = torch.sigmoid(rnd(batch, H, length, DK))
        leaves["a"], leaves["b"] = -kappa, kappa * iclr
    else:
        leaves["a"], leaves["b"] = 0.3 * rnd(batch, H, length, DK), 0.3 * rnd(batch, H, length, DK)
    return {name: t.requires_grad_() for name, t in leaves.items()}


def record(kind, leaves):
    """The :class:`Transition` of ``kind`` on ``leaves``."""
    _, n, _ = KINDS[kind]
    low_rank = (leaves["a"], leaves["b"]) if "a" in leaves else None
    return Transition(leaves.get("log_decay"), leaves.get("beta"), low_rank=low_rank, householder_steps=n)


def grads(out, leaves, seed=7):
    """Gradients of <out, c> for a fixed random cotangent c w.r.t. every leaf of the dict (zeros where unused)."""
    c = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    wrt = list(leaves.values())
    got = torch.autograd.grad(out, wrt, grad_outputs=c, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(t) if d is None else d for d, t in zip(got, wrt, strict=True)]


def assert_same(out, expected, leaves, expected_grads=None, tol=None):
    """Equal values, and equal gradients w.r.t. each leaf (those of ``expected`` unless given), each named."""
    tol = tol or TOL
    torch.testing.assert_close(out, expected, **tol)
    if expected_grads is None:
        expected_grads = grads(expected, leaves)
    for name, got, want in zip(leaves, grads(out, leaves), expected_grads, strict=True):
        assert torch.isfinite(got).all(), f"d/d{name} is not finite"
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"d/d{n}: {m}")


@functools.cache
def case(kind, length=L):
    """The leaves of ``kind`` (seeded by the kind and the length), the loop's output and gradients (computed once
    for every form and chunk size)."""
    leaves = make(kind, seed=list(KINDS).index(kind) + 100 * length, length=length)
    expected, _ = reference(kind, leaves)
    return leaves, expected.detach(), [d.detach() for d in grads(expected, leaves)]


def token_inputs(q, k, v, t, n):
    """Token t's q (B, H, d_k), k and v ((B, H, ·), or (B, H, n, ·) for n > 1 steps)."""
    if n == 1:
        return q[:, :, t], k[:, :, t], v[:, :, t]
    return q[:, :, t], k[:, :, t * n : (t + 1) * n], v[:, :, t * n : (t + 1) * n]


# --------------------------------------------------------------------------------------------- the forms


@kinds
def test_recurrent_equals_the_loop(kind):
    leaves, expected, expected_grads = case(kind)
    out = recurrent(leaves["q"], leaves["k"], leaves["v"], record(kind, leaves))
    assert out.shape == (B, H, L, DV)
    assert_same(out, expected, leaves, expected_grads)


@kinds
@pytest.mark.parametrize("chunk_size", CHUNKS, ids=lambda c: f"C{c}")
def test_chunked_equals_the_loop(kind, chunk_size):
    """Chunk sizes in tokens (a DeltaProduct chunk of C tokens holds C·n steps), none of them dividing L = 37 but 1,
    and one above it: values and gradients w.r.t. every leaf equal the loop's."""
    leaves, expected, expected_grads = case(kind)
    out = chunked(leaves["q"], leaves["k"], leaves["v"], record(kind, leaves), chunk_size=chunk_size)
    assert out.shape == (B, H, L, DV)
    assert_same(out, expected, leaves, expected_grads)


@kinds
def test_effective_matrix_times_v_equals_the_loop(kind):
    """effective_matrix is (B, H, L, L·n), zero where the value's token is after the output's (causal), and
    A @ v equals the loop, values and gradients."""
    _, n, _ = KINDS[kind]
    leaves, expected, expected_grads = case(kind)
    A = effective_matrix(leaves["q"], leaves["k"], record(kind, leaves))
    assert A.shape == (B, H, L, L * n)
    later = torch.arange(L * n).div(n, rounding_mode="floor") > torch.arange(L).unsqueeze(-1)  # (L, L·n)
    assert not A.detach()[..., later].any(), "the effective matrix reads values of later tokens"
    assert_same(A @ leaves["v"], expected, leaves, expected_grads)


@kinds
def test_step_chain_carries_the_loops_outputs_and_state(kind):
    """Decoding: ``step`` from no state, token after token on ``Transition.at(t)`` (k, v (B, H, n, ·) with n > 1
    steps): each output and the last state equal the loop's, and so do their gradients (the state's w.r.t. all but
    q)."""
    _, n, _ = KINDS[kind]
    length = 9
    leaves = make(kind, seed=60 + list(KINDS).index(kind), length=length)
    rec = record(kind, leaves)
    token = rec.at(4)
    if n > 1:
        assert token.beta.shape == (B, H, n)
    if token.low_rank is not None:
        assert token.low_rank[0].shape == token.low_rank[1].shape == (B, H, DK)
    state, outs = None, []
    for t in range(length):
        o, state = step(state, *token_inputs(leaves["q"], leaves["k"], leaves["v"], t, n), rec.at(t))
        assert o.shape == (B, H, DV) and state.shape == (B, H, DK, DV)
        outs.append(o)
    expected, last = reference(kind, leaves)
    assert_same(torch.stack(outs, dim=2), expected, leaves)
    no_q = {name: t for name, t in leaves.items() if name != "q"}  # the state does not depend on q
    assert_same(state, last, no_q)


def one_token_forms(q, k, v, rec):
    return {
        "recurrent": recurrent(q, k, v, rec),
        "chunked C1": chunked(q, k, v, rec, chunk_size=1),
        "chunked C64": chunked(q, k, v, rec, chunk_size=64),
        "effective_matrix @ v": effective_matrix(q, k, rec) @ v,
    }


@kinds
def test_one_token_equals_the_loop(kind):
    leaves, expected, expected_grads = case(kind, length=1)
    for name, out in one_token_forms(leaves["q"], leaves["k"], leaves["v"], record(kind, leaves)).items():
        assert out.shape == (B, H, 1, DV), name
        assert_same(out, expected, leaves, expected_grads)


@kinds
def test_no_token_gives_empty_outputs(kind):
    leaves = make(kind, seed=70, length=0)
    q, k, v, rec = leaves["q"], leaves["k"], leaves["v"], record(kind, leaves)
    assert recurrent(q, k, v, rec).shape == (B, H, 0, DV)
    for chunk_size in (1, 5, 64):
        assert chunked(q, k, v, rec, chunk_size=chunk_size).shape == (B, H, 0, DV)


@pytest.mark.parametrize("kind", KINDS)
def test_no_token_gives_an_empty_effective_matrix(kind):
    leaves = make(kind, seed=71, length=0)
    assert effective_matrix(leaves["q"], leaves["k"], record(kind, leaves)).shape == (B, H, 0, 0)


def test_at_and_padded_slice_and_extend_the_new_fields():
    """``at(t)``: β (B, H, n) (token t's steps, t·n … t·n + n − 1), a and b (B, H, d_k); ``padded(p)``: β
    (B, H, (L + p)·n) and a, b (B, H, L + p, d_k), zeros in the padding."""
    leaves = {name: t.detach() for name, t in make("householder-n3-per-channel", seed=72).items()}
    rec = record("householder-n3-per-channel", leaves)
    assert torch.equal(rec.at(5).beta, leaves["beta"][:, :, 15:18])
    padded = rec.padded(4)
    assert padded.beta.shape == (B, H, (L + 4) * 3) and not padded.beta[:, :, L * 3 :].any()
    assert padded.log_decay.shape == (B, H, L + 4, DK) and padded.householder_steps == 3
    leaves = {name: t.detach() for name, t in make("rwkv7-per-head", seed=73).items()}
    rec = record("rwkv7-per-head", leaves)
    token = rec.at(5)
    assert torch.equal(token.low_rank[0], leaves["a"][:, :, 5]) and torch.equal(token.low_rank[1], leaves["b"][:, :, 5])
    assert token.log_decay.shape == (B, H) and token.beta is None
    padded = rec.padded(4)
    for t, name in zip(padded.low_rank, "ab", strict=True):
        assert t.shape == (B, H, L + 4, DK) and not t[:, :, L:].any(), name
        assert torch.equal(t[:, :, :L], leaves[name])


# --------------------------------------------------------------------------------------------- identities


def run_forms(q, k, v, rec):
    """The output through every form: recurrent, chunked (chunk sizes 1, 5 and 64) and effective_matrix @ v."""
    return {
        "recurrent": recurrent(q, k, v, rec),
        "chunked C1": chunked(q, k, v, rec, chunk_size=1),
        "chunked C5": chunked(q, k, v, rec, chunk_size=5),
        "chunked C64": chunked(q, k, v, rec, chunk_size=64),
        "effective_matrix @ v": effective_matrix(q, k, rec) @ v,
    }


# the delta rule's inputs (one step a token, β across (0, 2)) for each decay
DELTA_KIND = {
    decay: f"householder-n1-{name}"
    for decay, name in (("none", "no-decay"), ("head", "per-head"), ("channel", "per-channel"))
}


@decays
def test_delta_product_with_one_step_is_the_delta_rule_record_exactly(decay):
    leaves = {name: t.detach() for name, t in make(DELTA_KIND[decay], seed=80).items()}
    q, k, v, log_decay, beta = (leaves.get(name) for name in ("q", "k", "v", "log_decay", "beta"))
    one_step = run_forms(q, k, v, Transition(log_decay, beta, householder_steps=1))
    delta = run_forms(q, k, v, Transition(log_decay, beta))
    for name in one_step:
        assert torch.equal(one_step[name], delta[name]), name


@decays
@pytest.mark.parametrize("zero", ["second", "first"], ids=["second-step-beta-0", "first-step-beta-0"])
def test_delta_product_step_with_beta_zero_does_nothing(decay, zero):
    """n = 2 where one step of each token has β = 0 (and any k, v): every form equals the delta rule
    ``Transition(log α, β)`` on the other steps (the decay acts once per token, before its steps), values and
    gradients w.r.t. q, the kept steps' k, v, β, and log α."""
    leaves = make(DELTA_KIND[decay], seed=81)
    q, k, v, log_decay, beta = (leaves.get(name) for name in ("q", "k", "v", "log_decay", "beta"))
    g = torch.Generator().manual_seed(82)
    other_k = F.normalize(torch.randn(B, H, L, DK, generator=g, dtype=torch.float64), dim=-1)
    other_v = torch.randn(B, H, L, DV, generator=g, dtype=torch.float64)

    def interleave(kept, other):  # token t's steps (kept, other) or (other, kept) at 2t, 2t + 1
        pair = (kept, other) if zero == "second" else (other, kept)
        return torch.stack(pair, dim=3).flatten(2, 3)

    k2, v2 = interleave(k, other_k), interleave(v, other_v)
    beta2 = interleave(beta.unsqueeze(-1), torch.zeros(B, H, L, 1, dtype=torch.float64)).squeeze(-1)
    product = run_forms(q, k2, v2, Transition(log_decay, beta2, householder_steps=2))
    delta = run_forms(q, k, v, Transition(log_decay, beta))
    for name in product:
        assert_same(product[name], delta[name], leaves)


@decays
@pytest.mark.parametrize("zero", ["a", "b"], ids=["a-zero", "b-zero"])
def test_low_rank_with_a_or_b_zero_is_the_decay_alone(decay, zero):
    """a = 0 or b = 0 (b aᵀ = 0): every form equals ``Transition(log α)``, values and gradients w.r.t. q, k, v and
    log α; the other factor's gradient is 0."""
    kind = {"none": "rwkv7-no-decay", "head": "rwkv7-per-head", "channel": "rwkv7-per-channel"}[decay]
    leaves = make(kind, seed=83)
    leaves[zero] = torch.zeros(B, H, L, DK, dtype=torch.float64, requires_grad=True)
    q, k, v, log_decay = (leaves.get(name) for name in ("q", "k", "v", "log_decay"))
    low_rank = run_forms(q, k, v, Transition(log_decay, low_rank=(leaves["a"], leaves["b"])))
    decay_alone = run_forms(q, k, v, Transition(log_decay))
    other = "b" if zero == "a" else "a"
    compared = {name: t for name, t in leaves.items() if name != zero}  # d/d(the zero factor) is not 0
    for name in low_rank:
        assert_same(low_rank[name], decay_alone[name], compared)  # d/d(the other factor) compared with zeros
        assert not grads(low_rank[name], {other: leaves[other]})[0].any(), name


@decays
def test_the_delta_rule_is_the_low_rank_case_a_minus_alpha_k_b_beta_k(decay):
    """The delta rule M_t = (I − β k kᵀ) diag(α) M_{t−1} + β k vᵀ reads the decayed state; the low-rank term reads
    the state before the decay, so the delta rule is the low-rank record with a_t = −α_t ⊙ k_t, b_t = β_t k_t and the
    written value β_t v_t (the low-rank write is k vᵀ, unscaled). Every form of each equals the other's, values
    and gradients w.r.t. q, k, v, log α and β (through a, b and β v)."""
    leaves = make(DELTA_KIND[decay], seed=84)
    q, k, v, log_decay, beta = (leaves.get(name) for name in ("q", "k", "v", "log_decay", "beta"))
    if log_decay is None:
        alpha = torch.ones_like(k)
    elif log_decay.dim() == 3:
        alpha = log_decay.exp().unsqueeze(-1).expand_as(k)
    else:
        alpha = log_decay.exp()
    a, b = -(alpha * k), beta.unsqueeze(-1) * k
    low_rank = run_forms(q, k, beta.unsqueeze(-1) * v, Transition(log_decay, low_rank=(a, b)))
    delta = run_forms(q, k, v, Transition(log_decay, beta))
    for name in low_rank:
        assert_same(low_rank[name], delta[name], leaves)


# --------------------------------------------------------------------------------------------- padding tokens

PAD_LENGTH = 12


@kinds
@pytest.mark.parametrize("where", [0, PAD_LENGTH // 2, PAD_LENGTH], ids=["start", "middle", "end"])
def test_a_padding_token_leaves_the_state_unchanged(kind, where):
    """A token with k = 0 (all its n steps), log α = 0, a = b = 0 and any v and β (1.3) inserted at the start, the
    middle or the end: every form gives the outputs of the sequence without it at the other tokens, and at the
    padding token itself the previous token's state read by its query (given the previous token's q: the previous
    output; 0 at the start)."""
    _, n, _ = KINDS[kind]
    leaves = {name: t.detach() for name, t in make(kind, seed=90, length=PAD_LENGTH).items()}
    expected, _ = reference(kind, leaves)
    g = torch.Generator().manual_seed(91)

    def insert(t, filler, per_step=False):  # filler: the padding token's entries (n of them when per_step)
        at = where * n if per_step else where
        return torch.cat([t[:, :, :at], filler.to(t.dtype), t[:, :, at:]], dim=2)

    q_pad = torch.randn(B, H, 1, DK, generator=g, dtype=torch.float64)
    if where:
        q_pad = leaves["q"][:, :, where - 1 : where]
    padded = {
        "q": insert(leaves["q"], q_pad),
        "k": insert(leaves["k"], torch.zeros(B, H, n, DK), per_step=True),
        "v": insert(leaves["v"], torch.randn(B, H, n, DV, generator=g, dtype=torch.float64), per_step=True),
    }
    if "log_decay" in leaves:
        padded["log_decay"] = insert(leaves["log_decay"], torch.zeros(B, H, 1, *leaves["log_decay"].shape[3:]))
    if "beta" in leaves:
        padded["beta"] = insert(leaves["beta"], torch.full((B, H, n), 1.3), per_step=True)
    if "a" in leaves:
        padded["a"] = insert(leaves["a"], torch.zeros(B, H, 1, DK))
        padded["b"] = insert(leaves["b"], torch.zeros(B, H, 1, DK))
    at_pad = expected[:, :, where - 1] if where else torch.zeros(B, H, DV, dtype=torch.float64)
    rec = record(kind, padded)
    for name, out in run_forms(padded["q"], padded["k"], padded["v"], rec).items():
        assert out.shape == (B, H, PAD_LENGTH + 1, DV), name
        kept = torch.cat([out[:, :, :where], out[:, :, where + 1 :]], dim=2)
        torch.testing.assert_close(kept, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(out[:, :, where], at_pad, **TOL, msg=lambda m, n=name: f"{n}, padding token: {m}")


# --------------------------------------------------------------------------------------------- L = 8192 in float32

LONG, LONG_H, LONG_D = 8192, 2, 16
PREFIX = 256  # the float64 chunked form is also checked against the loop on the first tokens
LONG_KINDS = {
    "householder-n2-per-channel": ("householder", 2, "channel"),
    "householder-n2-per-head": ("householder", 2, "head"),
    "rwkv7-per-channel": ("rwkv7", 1, "channel"),
    "rwkv7-per-head": ("rwkv7", 1, "head"),
}


def long_inputs(kind, edge):
    """One sequence (B = 1, H = 2, L = 8192, d_k = d_v = 16) in float64 with extreme gates, as a dict of leaves.

    Per channel: channels 0-7 near 1 (log α ≈ −10⁻⁶), 8-11 near 0 (≈ −20 … −24), 12-13 at −10³, 14-15 near 1 but
    exactly −∞ every 97th token. Per head: head 0 near 1 with −∞ every 97th token and −10³ every 89th, head 1 ≈ −20.
    Every channel and head is −∞ at token 4000 (a full reset). ``edge`` "low": β ≈ 10⁻³ (DeltaProduct, unit keys) or
    iclr ≈ 10⁻³ (RWKV-7); "high": β ≈ 2 − 10⁻³ (1 − β ≈ −1: near-reflections, which forget nothing) or
    iclr ≈ 1 − 10⁻³ (I − κ̂ κ̂ᵀ, a projection, where α ≈ 1). RWKV-7's iclr here is one per token (a scalar times
    κ̂), so that G = diag(α) − iclr κ̂ κ̂ᵀ is symmetric with eigenvalues in [−1, 1] whatever α: the state stays
    bounded over 8192 tokens."""
    family, n, decay = LONG_KINDS[kind]
    g = torch.Generator().manual_seed(100 + list(LONG_KINDS).index(kind) + (0 if edge == "low" else 50))

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def uniform(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    steps = LONG * n
    leaves = {"q": rnd(1, LONG_H, LONG, LONG_D), "k": rnd(1, LONG_H, steps, LONG_D), "v": rnd(1, LONG_H, steps, LONG_D)}
    inf = float("inf")
    if decay == "channel":
        u = uniform(1, LONG_H, LONG, LONG_D)
        log_decay = -1e-6 * (1.0 + u)
        log_decay[..., 8:12] = -20.0 * (1.0 + 0.2 * u[..., 8:12])
        log_decay[..., 12:14] = -1e3
        log_decay[:, :, ::97, 14:] = -inf
    else:
        u = uniform(1, LONG_H, LONG)
        log_decay = torch.stack([-1e-6 * (1.0 + u[:, 0]), -20.0 * (1.0 + 0.2 * u[:, 1])], dim=1)
        log_decay[:, 0, ::97] = -inf
        log_decay[:, 0, ::89] = -1e3
    log_decay[:, :, 4000] = -inf
    leaves["log_decay"] = log_decay
    if family == "householder":
        leaves["k"] = F.normalize(leaves["k"], dim=-1)
        small = 1e-3 * uniform(1, LONG_H, steps)
        leaves["beta"] = small if edge == "low" else 2.0 - small
    else:
        kappa = F.normalize(rnd(1, LONG_H, LONG, LONG_D), dim=-1)
        small = 1e-3 * uniform(1, LONG_H, LONG, 1)
        iclr = small if edge == "low" else 1.0 - small
        leaves["a"], leaves["b"] = -kappa, kappa * iclr
    return leaves


def long_record(kind, leaves):
    _, n, _ = LONG_KINDS[kind]
    low_rank = (leaves["a"], leaves["b"]) if "a" in leaves else None
    return Transition(leaves["log_decay"], leaves.get("beta"), low_rank=low_rank, householder_steps=n)


@pytest.mark.parametrize("edge", ["low", "high"], ids=["beta-or-iclr-near-0", "beta-near-2-or-iclr-near-1"])
@pytest.mark.parametrize("kind", list(LONG_KINDS))
def test_a_long_sequence_in_float32_is_finite_and_near_float64(kind, edge):
    """L = 8192 (DeltaProduct: 16384 steps) at extreme gates (:func:`long_inputs`), chunk size 64: the float32
    chunked form's output and gradients w.r.t. q, k, v, log α, β, a, b are finite and within 10⁻⁴ of the largest
    entry of the float64 chunked form's (each gradient: of its own largest entry); the float64 run is itself finite,
    and on the first 256 tokens (the −∞ and −10³ gates among them) it, the recurrent form and the effective matrix
    equal the float64 loop.

    The tolerance: float32 rounds at 6·10⁻⁸; carried over 8192 tokens by transitions of norm ≤ 1 this adds up like
    a random walk, √8192 · 6·10⁻⁸ ≈ 5·10⁻⁶ of the scale; at most 3.3·10⁻⁶ is measured (per head, iclr near 1), so
    10⁻⁴ leaves a margin of about thirty."""
    family, n, _ = LONG_KINDS[kind]
    leaves64 = long_inputs(kind, edge)
    cot = torch.randn(1, LONG_H, LONG, LONG_D, generator=torch.Generator().manual_seed(101), dtype=torch.float64)
    results = {}
    for dtype in (torch.float32, torch.float64):
        leaves = {name: t.to(dtype).requires_grad_() for name, t in leaves64.items()}
        out = chunked(leaves["q"], leaves["k"], leaves["v"], long_record(kind, leaves), chunk_size=64)
        d = torch.autograd.grad(out, list(leaves.values()), cot.to(dtype))
        results[dtype] = {"output": out.detach(), **{f"d/d{name}": t for name, t in zip(leaves, d, strict=True)}}
    for name, got in results[torch.float32].items():
        want = results[torch.float64][name]
        assert torch.isfinite(want).all(), f"float64 {name}: {(~torch.isfinite(want)).sum()} non-finite entries"
        assert torch.isfinite(got).all(), f"float32 {name}: {(~torch.isfinite(got)).sum()} non-finite entries"
        atol = 1e-4 * float(want.abs().max()) + 1e-12
        torch.testing.assert_close(got.double(), want, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    first = {
        name: t[:, :, : PREFIX * (n if name in ("k", "v", "beta") else 1)] for name, t in leaves64.items()
    }  # the output at t depends on the tokens up to t only
    if family == "householder":
        expected, _ = householder_loop(first["q"], first["k"], first["v"], first["log_decay"], first["beta"], n)
    else:
        expected, _ = low_rank_loop(first["q"], first["k"], first["v"], first["log_decay"], first["a"], first["b"])
    torch.testing.assert_close(results[torch.float64]["output"][:, :, :PREFIX], expected, **TOL)
    rec = long_record(kind, first)
    with torch.no_grad():
        for name, out in (
            ("recurrent", recurrent(first["q"], first["k"], first["v"], rec)),
            ("effective_matrix @ v", effective_matrix(first["q"], first["k"], rec) @ first["v"]),
        ):
            torch.testing.assert_close(out, expected, **TOL, msg=lambda m, n=name: f"float64 {n}: {m}")


# --------------------------------------------------------------------------------------------- refusals

RL = 5  # a short sequence for the refusals


def refusal_inputs():
    g = torch.Generator().manual_seed(110)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": rnd(B, H, RL, DK),
        "k": rnd(B, H, RL, DK),
        "v": rnd(B, H, RL, DV),
        "k2": rnd(B, H, 2 * RL, DK),  # two steps a token
        "v2": rnd(B, H, 2 * RL, DV),
        "beta": torch.rand(B, H, RL, generator=g, dtype=torch.float64),
        "beta2": torch.rand(B, H, 2 * RL, generator=g, dtype=torch.float64),
        "a": rnd(B, H, RL, DK),
        "b": rnd(B, H, RL, DK),
    }


# householder_steps that are not an integer >= 1
BAD_STEPS = {"0": 0, "minus-1": -1, "1.5": 1.5, "float-2.0": 2.0, "True": True, "string-2": "2", "None": None}
# id → (make(inputs) → (q, k, v, record), what the message names). Records that are invalid whatever the shapes.
INVALID_RECORDS = {
    "beta-with-low_rank": (lambda x: (x["q"], x["k"], x["v"], Transition(None, x["beta"], (x["a"], x["b"]))), "beta"),
    "steps-2-without-beta": (
        lambda x: (x["q"], x["k2"], x["v2"], Transition(householder_steps=2)),
        "householder_steps",
    ),
    "steps-2-with-low_rank": (
        lambda x: (x["q"], x["k2"], x["v2"], Transition(None, x["beta2"], (x["a"], x["b"]), 2)),
        "householder_steps",
    ),
    **{
        f"steps-{name}": (
            lambda x, value=value: (x["q"], x["k"], x["v"], Transition(beta=x["beta"], householder_steps=value)),
            "householder_steps",
        )
        for name, value in BAD_STEPS.items()
    },
    "low_rank-a-tensor": (lambda x: (x["q"], x["k"], x["v"], Transition(low_rank=x["a"])), "low_rank"),
    "low_rank-one-tensor": (lambda x: (x["q"], x["k"], x["v"], Transition(low_rank=(x["a"],))), "low_rank"),
    "low_rank-a-list": (lambda x: (x["q"], x["k"], x["v"], Transition(low_rank=[x["a"], x["b"]])), "low_rank"),
    "low_rank-three": (lambda x: (x["q"], x["k"], x["v"], Transition(low_rank=(x["a"], x["b"], x["a"]))), "low_rank"),
}
# shapes that do not fit (the sequence forms; ``step`` has its own below)
SHAPE_REFUSALS = {
    "low_rank-a-d_k": (
        lambda x: (x["q"], x["k"], x["v"], Transition(low_rank=(x["a"][..., :-1], x["b"]))),
        "transition.low_rank[0]",
    ),
    "low_rank-b-length": (
        lambda x: (x["q"], x["k"], x["v"], Transition(low_rank=(x["a"], x["b"][:, :, :-1]))),
        "transition.low_rank[1]",
    ),
    "low_rank-b-not-a-tensor": (
        lambda x: (x["q"], x["k"], x["v"], Transition(low_rank=(x["a"], x["b"].tolist()))),
        "transition.low_rank[1]",
    ),
    "low_rank-per-step-log_decay": (
        lambda x: (x["q"], x["k"], x["v"], Transition(torch.zeros(B, H, RL + 1), low_rank=(x["a"], x["b"]))),
        "transition.log_decay",
    ),
    "steps-2-k-one-per-token": (
        lambda x: (x["q"], x["k"], x["v2"], Transition(beta=x["beta2"], householder_steps=2)),
        "k must have (B, H, L·n, d_k)",
    ),
    "steps-2-v-one-per-token": (
        lambda x: (x["q"], x["k2"], x["v"], Transition(beta=x["beta2"], householder_steps=2)),
        "v must be",
    ),
    "steps-2-beta-one-per-token": (
        lambda x: (x["q"], x["k2"], x["v2"], Transition(beta=x["beta"], householder_steps=2)),
        "transition.beta",
    ),
    "steps-2-log_decay-per-step": (
        lambda x: (x["q"], x["k2"], x["v2"], Transition(torch.zeros(B, H, 2 * RL), x["beta2"], householder_steps=2)),
        "transition.log_decay",
    ),
    "steps-2-log_decay-per-step-and-channel": (
        lambda x: (
            x["q"],
            x["k2"],
            x["v2"],
            Transition(torch.zeros(B, H, 2 * RL, DK), x["beta2"], householder_steps=2),
        ),
        "transition.log_decay",
    ),
    **{
        f"low_rank-{which}-None": (
            lambda x, which=which: (
                x["q"],
                x["k"],
                x["v"],
                Transition(low_rank=(None, x["b"]) if which == "a" else (x["a"], None)),
            ),
            "low_rank",
        )
        for which in "ab"
    },
}
SEQUENCE_FORMS = {
    "recurrent": lambda q, k, v, rec: recurrent(q, k, v, rec),
    "chunked": lambda q, k, v, rec: chunked(q, k, v, rec, chunk_size=2),
    "effective_matrix": lambda q, k, v, rec: effective_matrix(q, k, rec),
}


def token_record(rec):
    """Token 0's record, sliced by hand (``Transition.at`` refuses an invalid record itself)."""
    n = rec.householder_steps if isinstance(rec.householder_steps, int) and rec.householder_steps > 1 else 1
    log_decay = None if rec.log_decay is None else rec.log_decay[:, :, 0]
    beta = None if rec.beta is None else (rec.beta[:, :, 0] if n == 1 else rec.beta[:, :, :n])
    low_rank = rec.low_rank
    if isinstance(low_rank, tuple) and all(isinstance(t, torch.Tensor) for t in low_rank):
        low_rank = tuple(t[:, :, 0] for t in low_rank)
    return Transition(log_decay, beta, low_rank, rec.householder_steps), n


def assert_one_line_value_error(call, names):
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and names in message, message


@pytest.mark.parametrize("case", list(INVALID_RECORDS))
def test_an_invalid_record_is_a_one_line_value_error_naming_the_field(case):
    """Every form, ``step`` on the token's record, and ``Transition.at`` / ``padded`` refuse it."""
    make_case, names = INVALID_RECORDS[case]
    q, k, v, rec = make_case(refusal_inputs())
    for form in SEQUENCE_FORMS.values():
        assert_one_line_value_error(lambda form=form: form(q, k, v, rec), names)
    token, n = token_record(rec)
    assert_one_line_value_error(lambda: step(None, *token_inputs(q, k, v, 0, n), token), names)
    assert_one_line_value_error(lambda: rec.at(0), names)
    assert_one_line_value_error(lambda: rec.padded(1), names)


@pytest.mark.parametrize(
    ("form", "case"),
    [
        pytest.param(form, case)
        for form in SEQUENCE_FORMS
        for case in SHAPE_REFUSALS
        if not (form == "effective_matrix" and case.startswith("steps-2-v"))  # it takes no v
    ],
)
def test_a_record_that_does_not_fit_is_a_one_line_value_error_naming_the_field(form, case):
    make_case, names = SHAPE_REFUSALS[case]
    q, k, v, rec = make_case(refusal_inputs())
    assert_one_line_value_error(lambda: SEQUENCE_FORMS[form](q, k, v, rec), names)


def test_step_refuses_token_inputs_that_do_not_fit_the_new_fields():
    x = refusal_inputs()
    q, k2, v2 = x["q"][:, :, 0], x["k2"][:, :, :2], x["v2"][:, :, :2]
    two_steps = Transition(beta=x["beta2"][:, :, :2], householder_steps=2)
    lr = (x["a"][:, :, 0], x["b"][:, :, 0])
    cases = [
        ((None, q, k2[:, :, 0], v2, two_steps), "k must have one token's (B, H, n, d_k)"),
        ((None, q, k2, v2[:, :, 0], two_steps), "v must be"),
        ((None, q, k2, v2, Transition(beta=x["beta2"][:, :, 0], householder_steps=2)), "transition.beta"),
        ((None, q, k2[:, :, 0], v2[:, :, 0], Transition(low_rank=(lr[0][..., :-1], lr[1]))), "transition.low_rank[0]"),
        ((None, q, k2[:, :, 0], v2[:, :, 0], Transition(low_rank=(x["a"], lr[1]))), "transition.low_rank[0]"),
    ]
    for args, names in cases:
        assert_one_line_value_error(lambda args=args: step(*args), names)
