"""Decay and delta-rule attention (:mod:`attnlab.forms.transitions`: RetNet, GLA, DeltaNet, Gated DeltaNet, KDA; and
the forms of :mod:`attnlab.forms`: DeltaProduct, RWKV-7): the three forms of :mod:`attnlab.transition`
(``recurrent``, ``chunked``, ``effective_matrix``), their closed forms, long sequences, and the layers built on them
(the ``chunked``, ``recurrent`` and ``eager`` backends, refusals, the state size), against references written plainly
here (an explicit state matrix updated one token at a time, explicit loops over i and j), in float64, values and
gradients.

The layers tested are every recurrent form of the registry beside linear attention, at its defaults and at each of
its named settings (:data:`SCORES`: the labels of ``form_settings("recurrent")``: gla, gla_channel, gla_mamba2,
deltanet_beta2, …, kda, kda_beta2, deltaproduct, deltaproduct_beta2, rwkv7): the built-ins' maps and gates (GLA's
per-head and per-channel gates, Mamba-2's and KDA's, β = r·σ, DeltaProduct's n keys, values and β per token,
RWKV-7's decay, in-context learning rate, removal and replacement keys, GroupNorm and bonus) are written out here
from their papers, reading the parameters from the module by name, and rotary positions likewise; a form
registered later is tested against its own maps and gates (``form.maps``, ``form.gates``) through the plain
recurrence, output norm and projection.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same, grads, randn
from helpers import RECURRENT_FORMS, RECURRENT_SETTINGS, conv_loop, randomize_

import attnlab
from attnlab import transition
from attnlab.config import AttentionConfig
from attnlab.forms import LayerSizes, build_form, form_class, form_names_with
from attnlab.forms.transitions import retnet_decays
from attnlab.masks import build_mask
from attnlab.transition import Transition

pytestmark = pytest.mark.usefixtures("single_thread")

# every recurrent form of the registry beside linear attention (tested in tests/test_linear_attention.py), at its
# defaults and at each of its named settings, by label (FormSetting: label, form, params), in registration order: the
# built-ins retnet, gla, gla_channel, gla_mamba2, deltanet, deltanet_beta2, gated_deltanet, gated_deltanet_beta2, kda,
# kda_beta2, deltaproduct, deltaproduct_beta2, rwkv7, and any form registered before collection
SETTINGS = {s.label: s for s in RECURRENT_SETTINGS if s.form not in form_names_with("linear")}
SCORES = list(SETTINGS)
# the forms whose maps and gates this file writes out (written_gates, layer_inputs_reference); any other is read from
# the form
WRITTEN_OUT = ("retnet", "gla", "deltanet", "gated_deltanet", "kda", "deltaproduct", "rwkv7")
# the forms with a decay gate: its default (deltaproduct's may also be "none": no decay)
DEFAULT_GATE = {"gla": "head", "gated_deltanet": "head", "kda": "kda", "deltaproduct": "head"}
# q/(|q|·√d_k) (fla's read scale after the L2 norm: tests/test_conventions.py), k/|k| and β = r σ(x w_h + b_h)
DELTA_FORMS = ("deltanet", "gated_deltanet", "kda", "deltaproduct")
# RWKV-7's (Peng et al. 2025) decay: log w = −e^{−0.5} σ(·), w ∈ (e^{−e^{−0.5}}, 1)
RWKV7_DECAY_SCALE = math.exp(-0.5)


def householder_steps(name, params):
    """n, the generalized Householder steps per token of the form ``name`` with the variant's ``params``
    (DeltaProduct's ``householder_steps``, 2 by default; 1 for every other form)."""
    return params.get("householder_steps", 2) if name == "deltaproduct" else 1


def build(name, d_k, heads, d_v=None, d_model=6, params=None):
    """The form ``name`` (retnet, gla, deltanet, gated_deltanet, kda, deltaproduct, rwkv7) with the variant's
    ``params`` for a layer of these sizes, causal."""
    sizes = LayerSizes(d_model, heads, heads, d_k, d_v or d_k)
    config = AttentionConfig(score=name, score_params=params or {}, normalizer="none", mask="causal")
    return build_form(name, sizes, config)


def weights_of(form, q, k, x):
    """The form's effective matrix for q, k (B, H, L, d_k) and x (B, L, d_model)."""
    q2, k2, record = form.inputs(q, k, x)
    return transition.effective_matrix(q2, k2, Transition(record.log_decay, record.beta))


# --------------------------------------------------------------------------------------------- the plain reference


def reference_form(q, k, v, log_alpha=None, beta=None, removal=None):
    """The recurrence written from its definition, for each (b, h) one token at a time, over an explicit state
    matrix M (d_k × d_v) that starts at 0:

        decay:       M_t = α_t M_{t−1} + k_t v_tᵀ
        delta rule:  M_t = α_t (I − β_t k_t k_tᵀ) M_{t−1} + β_t k_t v_tᵀ
        output:      o_t = M_tᵀ q_t

    with α_t = exp(log_alpha_t) (α ≡ 1 when ``log_alpha`` is None) and the plain sum when ``beta`` is None; a
    decay per key channel (log_alpha (B, H, L, d_k)) scales the rows of M, before the delta rule writes.
    q, k (B, H, L, d_k), v (B, H, L, d_v), log_alpha, beta (B, H, L) or None → (o (B, H, L, d_v), the last
    states (B, H, d_k, d_v)). Calls nothing of attnlab.

    DeltaProduct (Siems et al. 2025): k (B, H, L, n, d_k), v (B, H, L, n, d_v) and β (B, H, L, n) hold n keys,
    values and β per token; the decay acts once per token, then its n delta-rule steps in order:

        M ← diag(α_t) M;   M ← (I − β_{t,s} k_{t,s} k_{t,s}ᵀ) M + β_{t,s} k_{t,s} v_{t,s}ᵀ  (s = 1 … n);   o_t = Mᵀ q_t

    RWKV-7 (Peng et al. 2025, eq. 17 transposed: M = wkvᵀ), ``removal`` = (κ̂, a) (B, H, L, d_k) and no β: the
    removal reads the state before the decay,

        M_t = diag(w_t) M_{t−1} − (a_t ⊙ κ̂_t)(κ̂_tᵀ M_{t−1}) + k̃_t v_tᵀ     (k: the replacement keys k̃)."""
    Bn, Hn, Ln, dk = q.shape
    if k.dim() == 4:  # one key, value and β per token: n = 1
        k, v = k[:, :, :, None], v[:, :, :, None]
        beta = None if beta is None else beta[..., None]
    n, dv = k.shape[3], v.shape[-1]
    eye = torch.eye(dk, dtype=q.dtype)
    outs, last = [], []
    for b in range(Bn):
        for h in range(Hn):
            M = torch.zeros(dk, dv, dtype=q.dtype)
            for t in range(Ln):
                alpha = 1.0 if log_alpha is None else torch.exp(log_alpha[b, h, t])
                if log_alpha is not None and alpha.dim() == 1:  # per key channel: diag(α_t) M
                    alpha = alpha[:, None]
                if removal is None:
                    M = alpha * M
                else:  # (the right-hand side reads M_{t−1})
                    kappa, rate = removal[0][b, h, t], removal[1][b, h, t]
                    M = alpha * M - torch.outer(rate * kappa, kappa @ M)
                for s in range(n):
                    kt, vt = k[b, h, t, s], v[b, h, t, s]
                    if beta is None:
                        M = M + torch.outer(kt, vt)
                    else:
                        bt = beta[b, h, t, s]
                        M = (eye - bt * torch.outer(kt, kt)) @ M + bt * torch.outer(kt, vt)
                outs.append(M.T @ q[b, h, t])
            last.append(M)
    return torch.stack(outs).reshape(Bn, Hn, Ln, dv), torch.stack(last).reshape(Bn, Hn, dk, dv)


def reference_matrix(q, k, log_alpha=None, beta=None, removal=None):
    """The effective matrix of :func:`reference_form` (its arguments but v): the outputs are linear in the values,
    o_i = Σ_c A_ic v_c, so the outputs for the one-hot values v_c = e_c are A row by row. (B, H, L, L), or
    (B, H, L, L·n) with n steps per token (k (B, H, L, n, d_k)), token j's step s at column j·n + s."""
    Bn, Hn, Ln = q.shape[:3]
    if k.dim() == 4:
        one_hot = torch.eye(Ln, dtype=q.dtype)  # value j = e_j
    else:
        n = k.shape[3]
        one_hot = torch.eye(Ln * n, dtype=q.dtype).reshape(Ln, n, Ln * n)  # value (j, s) = e_{j·n+s}
    return reference_form(q, k, one_hot.expand(Bn, Hn, *one_hot.shape), log_alpha, beta, removal)[0]


def per_token(A, n):
    """DeltaProduct's weights: an (L, L·n) map summed over each token's n steps → (L, L)."""
    Ln = A.shape[-2]
    return torch.stack([A[..., j * n : (j + 1) * n].sum(-1) for j in range(Ln)], dim=-1)


def plain_sigmoid(z):
    return 1 / (1 + torch.exp(-z))


def plain_logsigmoid(z):
    """log σ(z) = −log(1 + e^{−z}) (the tests' pre-activations are moderate)."""
    return -torch.log1p(torch.exp(-z))


def unit(t):
    """t / |t| over the last dimension."""
    return t / torch.sqrt((t * t).sum(-1, keepdim=True))


def plain_softplus(z):
    """softplus(z) = log(1 + e^z) (moderate pre-activations)."""
    return torch.log1p(torch.exp(z))


def plain_rope(t, base=10000.0):
    """RoFormer's rotary positions (Su et al. 2021) on t (B, H, L, d) at positions 0 … L − 1: the pairs (t_2i,
    t_2i+1) at position m turned by the angle m·θ_i, θ_i = base^(−2i/d), for i < ⌊d/2⌋ (an odd d leaves its last
    dimension as it is)."""
    d, length = t.shape[-1], t.shape[-2]
    m = torch.arange(length, dtype=torch.float64)
    cols = [t[..., j] for j in range(d)]
    for i in range(d // 2):
        angle = m * base ** (-2 * i / d)
        x0, x1 = t[..., 2 * i], t[..., 2 * i + 1]
        cols[2 * i] = x0 * torch.cos(angle) - x1 * torch.sin(angle)
        cols[2 * i + 1] = x0 * torch.sin(angle) + x1 * torch.cos(angle)
    return torch.stack(cols, dim=-1)


def written_gates(form, name, params, x):
    """The gates of the form ``name`` built with the variant's ``params``, written out from the papers with its
    parameters read by name: x (B, L, d_model) → log α ((B, H, L) per head, (B, H, L, d_k) per key channel, or None),
    β (B, H, L), or (B, H, L, n) for DeltaProduct's n steps per token, or None, and the factor Δ (B, H, L) of
    Mamba-2's write on k (k ← Δ k; None elsewhere).

    * head (GLA's scalar gate; Gated DeltaNet): log α = log σ(x w_h + b_h) / τ (``alpha_gate.proj``);
    * channel (GLA, Yang et al. 2024): log α = log σ(x W₁ W₂ + b) / τ per key channel (``alpha_gate.down``, ``.up``);
    * mamba2 (Dao & Gu 2024): Δ = softplus(x w_h + dt_bias_h), log α = −exp(A_log_h) Δ (``alpha_gate``, ``dt_bias``,
      ``A_log``), and on gla (no delta rule) the write scaled by Δ: k ← Δ k (Mamba's B̄ = Δ B);
    * kda (Kimi Team 2025): log α = −exp(A_log_h) softplus(x W₁ W₂ + dt_bias_hc) per key channel;
    * none (DeltaProduct without its gate): no decay, log α None;
    * β = r σ(x w_h + b_h) (``beta_gate.proj``), r = ``beta_range`` (1, or 2: Grazzi et al. 2025); DeltaProduct's
      ``beta_gate.proj`` has H·n outputs, step-major as fla's: β_{h,t,s} = r σ(x_t w_{s·H+h} + b_{s·H+h});
    * rwkv7 (Peng et al. 2025, eq. 16): log w = −e^{−0.5} σ(w₀ + tanh(x W_w1) W_w2) per key channel
      (``w_lora.down``, ``w_lora.up`` with its bias w₀), head-major; no β (its a_t: :func:`written_rwkv7`);

    τ = ``gate_normalizer`` (16 unless the params set it); retnet: its fixed log γ_h as the form gives them (their
    values: test_retnet_effective_matrix_…)."""
    Bn, Ln, _ = x.shape
    heads, d_k = form.num_heads, form.d_k
    log_alpha = beta = k_factor = None
    if name == "retnet":
        log_alpha = form.gates(x)[0].detach()
    if name in DEFAULT_GATE:
        gate = params.get("gate", DEFAULT_GATE[name])
        tau = params.get("gate_normalizer", 16.0)
        if gate == "head":
            lin = form.alpha_gate.proj
            log_alpha = (plain_logsigmoid(x @ lin.weight.T + lin.bias) / tau).transpose(1, 2)
        elif gate == "channel":
            down, up = form.alpha_gate.down, form.alpha_gate.up
            z = x @ down.weight.T @ up.weight.T + up.bias  # (B, L, H·d_k), head by head
            log_alpha = (plain_logsigmoid(z) / tau).reshape(Bn, Ln, heads, d_k).transpose(1, 2)
        elif gate == "mamba2":
            dt = plain_softplus(x @ form.alpha_gate.weight.T + form.dt_bias).transpose(1, 2)  # (B, H, L)
            log_alpha = -torch.exp(form.A_log)[:, None] * dt
            if name == "gla":  # a delta-rule form writes with its β instead
                k_factor = dt
        elif gate == "kda":
            down, up = form.alpha_gate.down, form.alpha_gate.up
            z = (x @ down.weight.T @ up.weight.T).reshape(Bn, Ln, heads, d_k) + form.dt_bias  # dt_bias (H, d_k)
            log_alpha = -torch.exp(form.A_log)[:, None, None] * plain_softplus(z).transpose(1, 2)
        else:
            assert (name, gate) == ("deltaproduct", "none"), (name, gate)
    if name in DELTA_FORMS:
        lin = form.beta_gate.proj
        n = householder_steps(name, params)
        beta = params.get("beta_range", 1) * plain_sigmoid(x @ lin.weight.T + lin.bias)  # (B, L, H·n)
        if name == "deltaproduct":  # output s·H + h is head h's step s
            beta = torch.stack([beta[..., [s * heads + h for s in range(n)]] for h in range(heads)], dim=1)
        else:
            beta = beta.transpose(1, 2)
    if name == "rwkv7":
        down, up = form.w_lora.down, form.w_lora.up
        d = torch.tanh(x @ down.weight.T) @ up.weight.T + up.bias  # (B, L, H·d_k), head by head
        log_alpha = (-RWKV7_DECAY_SCALE * plain_sigmoid(d)).reshape(Bn, Ln, heads, d_k).transpose(1, 2)
    return log_alpha, beta, k_factor


def written_rwkv7(form, k, x):
    """RWKV-7's keys and in-context learning rate (Peng et al. 2025, §4), its parameters read by name: k
    (B, H, L, d_k) (the layer's key, its heads repeated for the query heads), x (B, L, d_model) →

    * a_t = σ(a₀ + x W_a1 W_a2) per key channel (``a_lora.down``, ``a_lora.up`` with its bias a₀; no activation);
    * κ̂_t = κ_t / |κ_t|, κ_t = k_t ⊙ ξ_h (``k_k``): the removal key;
    * k̃_t = k_t ⊙ (1 + (a_t − 1) ⊙ α_h) (``k_a``): the replacement key,

    each (B, H, L, d_k): → (k̃, κ̂, a)."""
    Bn, Ln, _ = x.shape
    heads, d_k = form.num_heads, form.d_k
    down, up = form.a_lora.down, form.a_lora.up
    a = plain_sigmoid(x @ down.weight.T @ up.weight.T + up.bias).reshape(Bn, Ln, heads, d_k).transpose(1, 2)
    kappa = unit(k * form.k_k[:, None, :])
    k_tilde = k * (1 + (a - 1) * form.k_a[:, None, :])
    return k_tilde, kappa, a


# --------------------------------------------------------------------------------------------- inputs

B, H, L, D_K, D_V = 2, 2, 12, 4, 3
ATOL = 1e-10
FORMS = {"neither": (False, False), "decay": (True, False), "delta": (False, True), "both": (True, True)}


def form_inputs(seed, length=L, decay=True, delta=True, b=B, h=H, d_k=D_K, d_v=D_V):
    """Fresh float64 leaves (q, k, v, log_alpha or None, beta or None) of the sizes given, and the list of those
    that are tensors. Keys are unit vectors under the delta rule (as DeltaNet normalises them), k/√d_k otherwise;
    log α = log σ(z + 1) (some decays strong, most mild), β = σ(z)."""
    q = randn(b, h, length, d_k, seed=seed)
    k = randn(b, h, length, d_k, seed=seed + 1)
    k = unit(k) if delta else k / math.sqrt(d_k)
    v = randn(b, h, length, d_v, seed=seed + 2)
    log_alpha = plain_logsigmoid(randn(b, h, length, seed=seed + 3) + 1.0) if decay else None
    beta = plain_sigmoid(randn(b, h, length, seed=seed + 4)) if delta else None
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (q, k, v, log_alpha, beta)]
    return (*leaves, [t for t in leaves if t is not None])


# --------------------------------------------------------------------------------------------- the three forms


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 7, 12, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("form", list(FORMS))
def test_the_three_forms_equal_the_plain_recurrence(form, chunk):
    """recurrent, chunked (chunk sizes that divide L = 12 and that do not, one larger than L) and
    effective_matrix(q, k, record) @ v all equal the reference: values and gradients w.r.t. q, k, v, log α and β."""
    decay, delta = FORMS[form]
    q, k, v, la, beta, leaves = form_inputs(10 + chunk, decay=decay, delta=delta)
    expected, _ = reference_form(q, k, v, la, beta)
    assert_same(transition.chunked(q, k, v, Transition(la, beta), chunk_size=chunk), expected, leaves, atol=ATOL)
    if chunk == 1:  # (the others do not depend on the chunk: once per form)
        assert_same(transition.recurrent(q, k, v, Transition(la, beta)), expected, leaves, atol=ATOL)
        A = transition.effective_matrix(q, k, Transition(la, beta))
        assert A.shape == (B, H, L, L)
        assert (A.triu(1) == 0).all(), "the effective matrix is not lower triangular"
        assert_same(torch.matmul(A, v), expected, leaves, atol=ATOL)


@pytest.mark.parametrize("form", list(FORMS))
def test_the_three_forms_equal_the_plain_recurrence_for_one_token(form):
    decay, delta = FORMS[form]
    q, k, v, la, beta, leaves = form_inputs(30, length=1, decay=decay, delta=delta)
    expected, _ = reference_form(q, k, v, la, beta)
    assert_same(transition.recurrent(q, k, v, Transition(la, beta)), expected, leaves, atol=ATOL)
    for chunk in (1, 64):
        assert_same(transition.chunked(q, k, v, Transition(la, beta), chunk_size=chunk), expected, leaves, atol=ATOL)
    A = transition.effective_matrix(q, k, Transition(la, beta))
    assert A.shape == (B, H, 1, 1)
    assert_same(torch.matmul(A, v), expected, leaves, atol=ATOL)


@pytest.mark.parametrize("form", list(FORMS))
def test_step_carries_the_plain_state(form):
    """step from None, token after token: the state after the last token is the reference's M_L, and each
    output its o_t."""
    decay, delta = FORMS[form]
    q, k, v, la, beta, leaves = form_inputs(40, length=7, decay=decay, delta=delta)
    expected, last = reference_form(q, k, v, la, beta)
    state, outs = None, []
    for t in range(7):
        record = Transition(None if la is None else la[:, :, t], None if beta is None else beta[:, :, t])
        o, state = transition.step(state, q[:, :, t], k[:, :, t], v[:, :, t], record)
        assert o.shape == (B, H, D_V) and state.shape == (B, H, D_K, D_V)
        outs.append(o)
    assert_same(state, last, leaves, atol=ATOL)
    assert_same(torch.stack(outs, dim=2), expected, leaves, atol=ATOL)


@pytest.mark.parametrize("form", list(FORMS))
def test_an_empty_sequence_gives_an_empty_output(form):
    decay, delta = FORMS[form]
    q, k, v, la, beta, _ = form_inputs(41, length=0, decay=decay, delta=delta)
    assert transition.recurrent(q, k, v, Transition(la, beta)).shape == (B, H, 0, D_V)
    assert transition.chunked(q, k, v, Transition(la, beta), chunk_size=4).shape == (B, H, 0, D_V)


# --------------------------------------------------------------------------------------------- closed forms


def decayed_linear_attention_loop(q, k, v, log_alpha):
    """o_i = Σ_{j≤i} exp(Σ_{j<m≤i} log α_m) (q_i·k_j) v_j, a double loop over i and j (α ≡ 1 when None)."""
    Bn, Hn, Ln, _ = q.shape
    rows = []
    for i in range(Ln):
        acc = torch.zeros(Bn, Hn, v.shape[-1], dtype=q.dtype)
        for j in range(i + 1):
            s = (q[:, :, i] * k[:, :, j]).sum(-1)  # (B, H)
            if log_alpha is not None:
                s = s * torch.exp(log_alpha[:, :, j + 1 : i + 1].sum(-1))
            acc = acc + s[..., None] * v[:, :, j]
        rows.append(acc)
    return torch.stack(rows, dim=2)


@pytest.mark.parametrize("decay", ["alpha_one", "random_decay"])
def test_the_decay_form_is_decayed_unnormalised_linear_attention(decay):
    """With log α ≡ 0 (α ≡ 1) the decay form is un-normalised causal linear attention Σ_{j≤i} (q_i·k_j) v_j (and
    equals the form without a decay); with a decay each term is weighted by Π_{j<m≤i} α_m."""
    q, k, v, la, _, leaves = form_inputs(50, decay=True, delta=False)
    if decay == "alpha_one":
        la = torch.zeros(B, H, L, dtype=torch.float64, requires_grad=True)
        leaves = [q, k, v, la]
        linear = decayed_linear_attention_loop(q, k, v, None)  # Σ_{j≤i} (q_i·k_j) v_j
        for got in (
            transition.recurrent(q, k, v, Transition(la)),
            transition.chunked(q, k, v, Transition(la), chunk_size=5),
            transition.recurrent(q, k, v),
        ):
            assert_same(got, linear, [q, k, v], atol=ATOL)
    plain = decayed_linear_attention_loop(q, k, v, la)  # (and at α ≡ 1 the gradients w.r.t. log α)
    assert_same(transition.recurrent(q, k, v, Transition(la)), plain, leaves, atol=ATOL)
    assert_same(torch.matmul(transition.effective_matrix(q, k, Transition(la)), v), plain, leaves, atol=ATOL)
    for chunk in (3, 5):
        assert_same(transition.chunked(q, k, v, Transition(la), chunk_size=chunk), plain, leaves, atol=ATOL)


def test_a_gla_score_whose_gate_is_shut_open_is_scaled_linear_attention():
    """GLA's gate at σ(50)^(1/16) is 1 in float64: its effective matrix is (q_i·k_j)/√d_k for j ≤ i, 0 above."""
    score = build("gla", D_K, H, d_model=6).double()
    with torch.no_grad():
        score.alpha_gate.proj.weight.zero_()
        score.alpha_gate.proj.bias.fill_(50.0)
    q, k, *_ = form_inputs(51, decay=False, delta=False)
    x = randn(B, L, 6, seed=52)
    expected = torch.zeros(B, H, L, L, dtype=torch.float64)
    for i in range(L):
        for j in range(i + 1):
            expected[:, :, i, j] = (q[:, :, i] * k[:, :, j]).sum(-1) / math.sqrt(D_K)
    assert_same(weights_of(score, q, k, x), expected, [q, k], atol=ATOL)


@pytest.mark.parametrize("decay", [False, True], ids=["no_decay", "decay"])
def test_the_delta_rule_with_beta_zero_writes_nothing(decay):
    q, k, v, la, _, _ = form_inputs(53, decay=decay, delta=True)
    beta = torch.zeros(B, H, L, dtype=torch.float64)
    zero = torch.zeros(B, H, L, D_V, dtype=torch.float64)
    torch.testing.assert_close(transition.recurrent(q, k, v, Transition(la, beta)), zero, rtol=0, atol=0)
    for chunk in (3, 5, 64):
        torch.testing.assert_close(
            transition.chunked(q, k, v, Transition(la, beta), chunk_size=chunk), zero, rtol=0, atol=0
        )
    torch.testing.assert_close(
        transition.effective_matrix(q, k, Transition(la, beta)), torch.zeros(B, H, L, L, dtype=torch.float64)
    )
    _, state = transition.step(None, q[:, :, 0], k[:, :, 0], v[:, :, 0], Transition(None, beta[:, :, 0]))
    assert not state.any()


@pytest.mark.parametrize("keys", ["one_key", "fresh_keys"])
@pytest.mark.parametrize("decay", [False, True], ids=["no_decay", "decay"])
def test_the_delta_rule_with_beta_one_overwrites_the_value_under_a_unit_key(decay, keys):
    """M_t = α_t (I − k kᵀ) M_{t−1} + k v_tᵀ with |k| = 1 gives M_tᵀ k = v_t exactly: the last value written under
    that key, whatever was stored before and whatever the decay; so with q_t = k_t every form outputs v_t."""
    n = 10
    _, k, v, la, _, _ = form_inputs(54, length=n, decay=decay, delta=True)
    k = k.detach()
    if keys == "one_key":
        k = k[:, :, :1].expand(B, H, n, D_K).contiguous()  # one unit key, written at every step
    beta = torch.ones(B, H, n, dtype=torch.float64)
    state = None
    for t in range(n):
        record = Transition(None if la is None else la[:, :, t], beta[:, :, t])
        _, state = transition.step(state, k[:, :, t], k[:, :, t], v[:, :, t], record)
        read = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        torch.testing.assert_close(read, v[:, :, t], rtol=0, atol=1e-12)
    v = v.detach()
    torch.testing.assert_close(transition.recurrent(k, k, v, Transition(la, beta)), v, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        torch.matmul(transition.effective_matrix(k, k, Transition(la, beta)), v), v, rtol=0, atol=1e-10
    )
    for chunk in (3, 4, 64):
        torch.testing.assert_close(
            transition.chunked(k, k, v, Transition(la, beta), chunk_size=chunk), v, rtol=0, atol=1e-10
        )


def test_retnet_decays_are_one_minus_two_to_the_minus_five_minus_h():
    expected = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(6)], dtype=torch.float64)
    assert retnet_decays(6).dtype == torch.float64
    torch.testing.assert_close(retnet_decays(6), expected, rtol=0, atol=0)


def test_retnet_effective_matrix_is_the_retention_matrix():
    """RetNet's effective matrix for (q, k, x) (x only for its shape) = γ_h^(i−j) (q_i·k_j)/√d_k for j ≤ i, 0
    above, with γ_h = 1 − 2^(−5−h), written out with loops, in float64 (a float64 form decays by the float64 γ_h)."""
    heads, length = 3, 20
    score = build("retnet", D_K, heads, d_model=5).double()
    q = randn(B, heads, length, D_K, seed=55).requires_grad_()
    k = randn(B, heads, length, D_K, seed=56).requires_grad_()
    x = torch.zeros(B, length, 5, dtype=torch.float64)
    expected = torch.zeros(B, heads, length, length, dtype=torch.float64)
    for h in range(heads):
        gamma = 1 - 2.0 ** (-5 - h)
        for i in range(length):
            for j in range(i + 1):
                expected[:, h, i, j] = gamma ** (i - j) * (q[:, h, i] * k[:, h, j]).sum(-1) / math.sqrt(D_K)
    log_alpha = score.gates(x)[0]
    assert log_alpha.shape == (B, heads, length) and log_alpha.dtype == torch.float64
    torch.testing.assert_close(
        log_alpha[0, :, 0],
        torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(heads)], dtype=torch.float64),
        rtol=1e-14,
        atol=0,
        msg=lambda m: f"a float64 RetNet's log γ_h is not log(1 − 2^(−5−h)) to float64 precision:\n{m}",
    )
    assert_same(weights_of(score, q, k, x), expected, [q, k], atol=ATOL)


# --------------------------------------------------------------------------------------------- each score's inputs


@pytest.mark.parametrize("score", SCORES)
def test_each_score_maps_q_k_and_x_to_its_documented_inputs(score):
    """retnet: k/√d_k, log γ_h; gla: k/√d_k and its gate (head: log σ(x w_h + b_h)/16; channel: log σ(x W₁ W₂ +
    b)/16 per key channel, W₁ W₂ of rank 16; mamba2: −exp(A_log_h) softplus(x w_h + dt_bias_h), and k·Δ); deltanet:
    q/(|q|√d_k), k/|k|, β = r σ(x w_h + b_h) (r = 2 for beta2); gated_deltanet: both gates; kda: deltanet's and
    −exp(A_log_h) softplus(x W₁ W₂ + dt_bias) per key channel, W₁ W₂ of rank d_v; deltaproduct: Gated DeltaNet's,
    with n keys (each normalised) and n β per token; rwkv7: r and k as they are, log w_t per key channel, k̃ and the
    low rank (−κ̂, κ̂ ⊙ a_t) (:func:`written_gates`, :func:`written_rwkv7`). Each setting keeps the state H·d_k·d_v
    and its weights are the effective matrix of its inputs (a form registered later: those two only)."""
    d_model = 6
    setting = SETTINGS[score]
    name, params = setting.form, setting.params
    n = householder_steps(name, params)
    q, k, *_ = form_inputs(60, decay=False, delta=False)
    if n > 1:  # the form reads n keys per token (the layer's per_step): token t's step s at t·n + s
        k = randn(B, H, L * n, D_K, seed=64)
    x = randn(B, L, d_model, seed=61)
    form = randomize_(build(name, D_K, H, d_v=D_V, d_model=d_model, params=params).double(), seed=62, scale=0.5)
    assert form.state_size(L) == H * D_K * D_V
    q2, k2, record = form.inputs(q, k, x)
    la, beta = record.log_decay, record.beta
    assert record.householder_steps == n
    if n == 1 and record.low_rank is None:  # (a record of log α and β alone)
        torch.testing.assert_close(
            weights_of(form, q, k, x), transition.effective_matrix(q2, k2, Transition(la, beta)), rtol=0, atol=0
        )
    if name not in WRITTEN_OUT:
        return
    expected_la, expected_beta, k_factor = written_gates(form, name, params, x)
    removal = None
    if name in DELTA_FORMS:
        torch.testing.assert_close(q2, unit(q) / math.sqrt(D_K), rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(k2, unit(k), rtol=1e-14, atol=1e-15)  # each step's key on its own
        assert beta.shape == (B, H, L * n)
        if n > 1:  # one β per step, token t's step s at t·n + s
            assert expected_beta.shape == (B, H, L, n)
            expected_beta = expected_beta.reshape(B, H, L * n)
        torch.testing.assert_close(beta, expected_beta, rtol=1e-14, atol=1e-15)
        if params.get("beta_range", 1) == 2:
            assert beta.max() > 1.0, "β = 2σ(·) never went above 1 here"
        assert record.low_rank is None
    elif name == "rwkv7":  # r and k as the layer projects them (no scaling), k̃, and the removal (−κ̂, κ̂ ⊙ a_t)
        k_tilde, kappa, rate = written_rwkv7(form, k, x)
        torch.testing.assert_close(q2, q, rtol=0, atol=0)
        torch.testing.assert_close(k2, k_tilde, rtol=1e-14, atol=1e-15)
        assert beta is None and record.low_rank is not None
        torch.testing.assert_close(record.low_rank[0], -kappa, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(record.low_rank[1], kappa * rate, rtol=1e-14, atol=1e-15)
        removal = (kappa, rate)
        assert ((rate > 0) & (rate < 1)).all()
        assert ((la < 0) & (la > -RWKV7_DECAY_SCALE)).all(), "log w_t is not in (−e^{−0.5}, 0)"
        rank = params.get("decay_rank", 32)  # max(32, …): 32 at these sizes
        assert form.w_lora.down.weight.shape == (rank, d_model) and form.w_lora.down.bias is None
        assert form.w_lora.up.weight.shape == (H * D_K, rank) and form.w_lora.up.bias is not None
        assert form.a_lora.down.weight.shape == (params.get("a_rank", 32), d_model)
        assert form.k_k.shape == form.k_a.shape == form.r_k.shape == (H, D_K)
    else:
        torch.testing.assert_close(q2, q, rtol=0, atol=0)
        scaled = k / math.sqrt(D_K) if k_factor is None else k / math.sqrt(D_K) * k_factor[..., None]
        torch.testing.assert_close(k2, scaled, rtol=1e-14, atol=1e-15)
        assert beta is None
    if expected_la is None:
        assert la is None
    else:
        assert la.shape == expected_la.shape
        torch.testing.assert_close(la, expected_la, rtol=1e-13, atol=1e-15)
    if n > 1:  # the weights: the plain recurrence's matrix of these inputs, (L, L·n) with n steps per token
        steps = unit(k).reshape(B, H, L, n, D_K)  # token t's step s (row t·n + s) at [t, s]
        expected = reference_matrix(unit(q) / math.sqrt(D_K), steps, expected_la, expected_beta.reshape(B, H, L, n))
    elif removal is not None:
        expected = reference_matrix(q, k_tilde, expected_la, None, removal)
    if n > 1 or removal is not None:
        A = transition.effective_matrix(q2, k2, record)
        assert A.shape == (B, H, L, L * n)
        torch.testing.assert_close(A, expected, rtol=1e-10, atol=1e-10)
    gate = params.get("gate", DEFAULT_GATE.get(name))
    if gate in ("channel", "kda"):  # per key channel, through a map of rank 16 (GLA) or d_v (KDA)
        assert la.shape == (B, H, L, D_K)
        rank = params.get("gate_rank", 16 if gate == "channel" else D_V)
        assert form.alpha_gate.down.weight.shape == (rank, d_model)
        assert form.alpha_gate.up.weight.shape == (H * D_K, rank)
        assert (form.alpha_gate.up.bias is not None) == (gate == "channel")  # kda's bias is dt_bias
    if gate == "kda":
        assert form.dt_bias.shape == (H, D_K) and form.A_log.shape == (H,)
    if gate == "mamba2":
        assert form.dt_bias.shape == (H,) and form.A_log.shape == (H,)


@pytest.mark.parametrize("score", [label for label in SCORES if SETTINGS[label].form in DEFAULT_GATE])
def test_the_gates_start_as_their_papers_initialise_them(score):
    """Before training: GLA's gates with a zero bias (head: b_h = 0, channel: b = 0); Mamba-2's and KDA's
    A = exp(A_log) in [1, 16]; Mamba-2's and KDA's Δ₀ = softplus(dt_bias) log-uniform in [0.001, 0.1] (KDA's per key
    channel, as fla's KDA model initialises it)."""
    setting = SETTINGS[score]
    torch.manual_seed(63)
    form = build(setting.form, D_K, 6, d_v=D_V, d_model=6, params=setting.params)
    gate = setting.params.get("gate", DEFAULT_GATE[setting.form])
    with torch.no_grad():
        if gate == "head":
            assert not form.alpha_gate.proj.bias.any()
        elif gate == "channel":
            assert not form.alpha_gate.up.bias.any()
        else:
            A = torch.exp(form.A_log)
            assert ((A >= 1 - 1e-6) & (A <= 16 + 1e-5)).all(), A
            dt0 = plain_softplus(form.dt_bias)
            assert ((dt0 >= 1e-3 * (1 - 1e-5)) & (dt0 <= 0.1 * (1 + 1e-5))).all(), dt0
            assert dt0.unique().numel() == dt0.numel()  # drawn per head (mamba2) or per key channel (kda)


REFUSED_PARAMS = {
    "gla_gate_nope": ("gla", {"gate": "nope"}, ["gate", "head", "channel", "mamba2", "kda", "nope"]),
    "kda_gate_nope": ("kda", {"gate": "nope"}, ["gate", "head", "channel", "mamba2", "kda"]),
    "gated_deltanet_gate_nope": ("gated_deltanet", {"gate": "nope"}, ["gate", "head", "channel", "mamba2", "kda"]),
    "deltanet_beta_range_3": ("deltanet", {"beta_range": 3}, ["beta_range", "1, 2", "3"]),
    "gated_deltanet_beta_range_3": ("gated_deltanet", {"beta_range": 3}, ["beta_range", "1, 2"]),
    "kda_beta_range_3": ("kda", {"beta_range": 3}, ["beta_range", "1, 2"]),
    "gla_channel_gate_rank_0": ("gla", {"gate": "channel", "gate_rank": 0}, ["gate_rank", ">= 1", "0"]),
    "kda_gate_rank_0": ("kda", {"gate_rank": 0}, ["gate_rank", ">= 1"]),
    "gla_gate_rank_not_an_integer": ("gla", {"gate": "channel", "gate_rank": 2.5}, ["gate_rank", "integer", "2.5"]),
    "gla_gate_normalizer_below_1": ("gla", {"gate_normalizer": 0.5}, ["gate_normalizer", ">= 1", "0.5"]),
    "gated_deltanet_beta_range_string": ("gated_deltanet", {"beta_range": "2"}, ["beta_range", "1, 2", "'2'"]),
    "gla_beta_range": ("gla", {"beta_range": 2}, ["beta_range", "gate", "gate_normalizer", "gate_rank"]),
    "deltanet_gate": ("deltanet", {"gate": "kda"}, ["'gate'", "beta_range"]),
    "deltaproduct_householder_steps_0": ("deltaproduct", {"householder_steps": 0}, ["householder_steps", ">= 1", "0"]),
    "deltaproduct_householder_steps_1.5": (
        "deltaproduct",
        {"householder_steps": 1.5},
        ["householder_steps", "integer", "1.5"],
    ),
    # gate=none (no decay) is one of DeltaProduct's allowed gates: the refusal has to name it with the others
    "deltaproduct_gate_bogus": (
        "deltaproduct",
        {"gate": "bogus"},
        ["gate", "none", "head", "channel", "mamba2", "kda", "'bogus'"],
    ),
    "deltaproduct_beta_range_3": ("deltaproduct", {"beta_range": 3}, ["beta_range", "1, 2", "3"]),
    "rwkv7_decay_rank_0": ("rwkv7", {"decay_rank": 0}, ["decay_rank", ">= 1", "0"]),
    "rwkv7_a_rank_0": ("rwkv7", {"a_rank": 0}, ["a_rank", ">= 1", "0"]),
    "rwkv7_gate": ("rwkv7", {"gate": "head"}, ["'gate'", "output_norm", "decay_rank", "a_rank"]),
    "rwkv7_output_norm_bogus": ("rwkv7", {"output_norm": "bogus"}, ["output_norm", "groupnorm", "rmsnorm", "bogus"]),
}


@pytest.mark.parametrize(
    ("score", "params", "words"),
    [pytest.param(*case, id=key) for key, case in REFUSED_PARAMS.items()],
)
def test_a_bad_gate_or_beta_parameter_is_refused_in_one_line_naming_the_allowed_values(score, params, words):
    with pytest.raises(ValueError) as info:
        attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_K, config=recurrent_config(score, score_params=params))
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


# --------------------------------------------------------------------------------------------- long sequences

LONG = 8192
LONG_DECAYS = {"no_decay": None, "decay_near_one": 20.0, "decay_e-30": "strong"}
LONG_BETAS = {"no_delta": None, "beta_near_zero": -12.0, "beta_near_one": 12.0}


@pytest.mark.parametrize("beta_kind", list(LONG_BETAS))
@pytest.mark.parametrize("decay_kind", list(LONG_DECAYS))
def test_a_long_sequence_in_float32_stays_finite_forward_and_backward(decay_kind, beta_kind):
    """L = 8192 in float32 with log α ≈ −2·10⁻⁹ (log σ(20)) or −30 per step, β ≈ σ(±12): the chunked form's output
    and every gradient are finite; at log α = −30 nothing older than the token survives (e^−30 ≈ 10⁻¹³), so
    o_t = β_t (q_t·k_t) v_t."""
    gen = torch.Generator().manual_seed(70)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = draw(1, 2, LONG, 8).requires_grad_()
    raw_k = draw(1, 2, LONG, 8).requires_grad_()
    v = draw(1, 2, LONG, 8).requires_grad_()
    delta = LONG_BETAS[beta_kind] is not None
    k = F.normalize(raw_k, dim=-1) if delta else raw_k / math.sqrt(8)
    leaves = [q, raw_k, v]
    la = beta = None
    decay = LONG_DECAYS[decay_kind]
    if decay == "strong":
        la_leaf = torch.full((1, 2, LONG), -30.0, requires_grad=True)
        la, leaves = la_leaf, [*leaves, la_leaf]
    elif decay is not None:
        z = (decay + 0.1 * draw(1, 2, LONG)).requires_grad_()
        la, leaves = F.logsigmoid(z), [*leaves, z]
        assert (la < 0).all() and (la > -1e-8).all()
    if delta:
        zb = (LONG_BETAS[beta_kind] + 0.1 * draw(1, 2, LONG)).requires_grad_()
        beta, leaves = torch.sigmoid(zb), [*leaves, zb]
    out = transition.chunked(q, k, v, Transition(la, beta))
    assert out.shape == (1, 2, LONG, 8) and out.dtype == torch.float32
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum()} non-finite outputs"
    gs = torch.autograd.grad((out * draw(*out.shape)).sum(), leaves)
    for name, g in zip(["q", "k", "v", "gate", "gate"], gs, strict=False):
        assert torch.isfinite(g).all(), f"{(~torch.isfinite(g)).sum()} non-finite gradients of {name}"
    if decay == "strong":
        with torch.no_grad():
            write = v if beta is None else beta[..., None] * v
            expected = (q * k).sum(-1, keepdim=True) * write
        torch.testing.assert_close(out.detach(), expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # and float32 loses nothing that matters: the float64 form, to 10⁻⁴ of its largest output
        exact = transition.chunked(
            *(t.double() for t in (q, k, v)),
            Transition(None if la is None else la.double(), None if beta is None else beta.double()),
        )
    torch.testing.assert_close(out.detach().double(), exact, rtol=0, atol=1e-4 * float(exact.abs().max()))


# --------------------------------------------------------------------------------------------- layers

D_MODEL, HEADS, HEAD_K, HEAD_V = 8, 2, 3, 5  # d_model ≠ H·d_k: the gates must read x at the layer's width
LAYER_L, CHUNK = 11, 4
CAUSAL = build_mask("causal")
PADDED_KEYS = torch.tensor(  # sequence 1 pads its first two keys (its rows 0, 1 see none), one inside, the last
    [[True] * LAYER_L, [False, False, True, True, True, False, True, True, True, True, False]]
)


def recurrent_config(score, backend="auto", chunk=CHUNK, score_params=None, **kw):
    """An AttentionConfig of a decay/delta-rule ``score`` (a form, or the label of one of its settings: its
    variant params, updated by ``score_params``): no normalizer, causal; ``chunk`` (the chunked backend's chunk size)
    only where the backend is auto or chunked."""
    setting = SETTINGS.get(score)
    form, params = (score, {}) if setting is None else (setting.form, setting.params)
    params = {**params, **(score_params or {})}
    chunking = {"chunk_size": chunk} if backend in ("auto", "chunked") and chunk is not None else {}
    return AttentionConfig(
        score=form,
        score_params=params,
        normalizer="none",
        mask="causal",
        backend=backend,
        backend_params=chunking,
        **kw,
    )


def recurrent_mha(score, seed=0, heads=HEADS, **kw):
    """A float64 layer (D_MODEL, ``heads`` query heads, HEAD_K, d_v=HEAD_V) with every parameter drawn from
    N(0, 0.5²)."""
    torch.manual_seed(seed)
    mha = attnlab.MultiHeadAttention(D_MODEL, heads, HEAD_K, d_v=HEAD_V, config=recurrent_config(score, **kw))
    return randomize_(mha.double(), seed, scale=0.5)


def causal_and_padding(keys):
    """The causal mask AND key padding ``keys`` (B, L), as attnlab prepares it (form ``causal+padding``)."""
    mask = CAUSAL.prepare(keys.shape[1], keys.shape[1]).with_key_padding(keys[:, None, None, :])
    assert mask.form == "causal+padding"
    return mask


def layer_inputs_reference(mha, x, keys=None):
    """The layer's projections (and short convolutions, rotary positions, grouped key/value heads repeated), then
    the score's maps and gates written out (:func:`written_gates`, :func:`written_rwkv7`, with the variant's params
    of the layer's config): → q', k' (with padded keys written as 0), v, log α or None, β or None (B, H, L, ·), and
    RWKV-7's removal (κ̂, a_t) (a_t = 0 at a padded token) or None. DeltaProduct: k' (B, H, L, n, d_k), v
    (B, H, L, n, d_v) and β (B, H, L, n), the layer's n·G key and value heads read step-major (head s·G + g is step s
    of key/value head g). RWKV-7: q' = r and k' = k̃ (its replacement key)."""
    name = mha.config.score
    params = mha.config.score_params
    q, k, v = (x @ lin.weight.T + lin.bias for lin in (mha.q_proj, mha.k_proj, mha.v_proj))
    if mha.short_conv is not None:  # (DeltaProduct's: over its n·G key and value heads' channels)
        q = conv_loop(q, mha.q_conv.conv.weight)
        k = conv_loop(k, mha.k_conv.conv.weight)
        v = conv_loop(v, mha.v_conv.conv.weight)
    Bn, Ln, _ = x.shape

    def split(t, d):  # (B, L, H'·d) → (B, H', L, d)
        return t.reshape(Bn, Ln, -1, d).transpose(1, 2)

    q, k, v = split(q, HEAD_K), split(k, HEAD_K), split(v, HEAD_V)
    if mha.config.rope is not None:  # (each of DeltaProduct's n keys of a token at the token's position)
        assert mha.config.rope == {}, "the plain rope is written for the defaults (base 10000, every pair)"
        q, k = plain_rope(q), plain_rope(k)
    n = householder_steps(name, params)
    if name == "deltaproduct":  # n·G heads, step-major → (B, G, L, n, ·): [.., g, t, s] = head s·G + g at token t
        G = k.shape[1] // n
        assert v.shape[1] == k.shape[1] == n * mha.num_kv_heads
        k = torch.stack([k[:, s * G : (s + 1) * G] for s in range(n)], dim=3)
        v = torch.stack([v[:, s * G : (s + 1) * G] for s in range(n)], dim=3)
    heads = mha.num_heads
    assert q.shape[1] == heads and heads % k.shape[1] == 0
    group = heads // k.shape[1]  # query heads per key/value head (GQA, Ainslie et al. 2023: consecutive groups)
    kv_head = [h // group for h in range(heads)]  # query head h reads key/value head h // group
    k, v = k[:, kv_head], v[:, kv_head]
    real = None if keys is None else keys[:, None, :].to(k.dtype)  # (B, 1, L): 1 at a real token

    def written(t):  # 0 at a padded token: t (B, H, L, ...)
        return t if real is None else t * real.reshape(*real.shape, *[1] * (t.dim() - 3))

    if name not in WRITTEN_OUT:  # a form registered later: its own maps and gates
        q, k = mha.form.maps(q, k)
        log_alpha, beta = mha.form.gates(x)
        if keys is not None:
            k = written(k)
            log_alpha = None if log_alpha is None else padded_gate(log_alpha, keys)
        return q, k, v, log_alpha, beta, None
    log_alpha, beta, k_factor = written_gates(mha.form, name, params, x)
    removal = None
    if name == "rwkv7":  # r as it is, the replacement key k̃ writes; a padded token removes nothing (a_t = 0)
        k, kappa, rate = written_rwkv7(mha.form, k, x)
        removal = (kappa, written(rate))
    elif name in DELTA_FORMS:
        q, k = unit(q) / math.sqrt(HEAD_K), unit(k)
    else:
        k = k / math.sqrt(HEAD_K)
    if k_factor is not None:  # Mamba-2's write: k ← Δ k
        k = k * k_factor[..., None]
    if keys is not None:
        k = written(k)  # a padded key writes nothing (each of its n steps)
        log_alpha = None if log_alpha is None else padded_gate(log_alpha, keys)  # and forgets nothing
    return q, k, v, log_alpha, beta, removal


def padded_gate(log_alpha, keys):
    """log α (B, H, L) or (B, H, L, d_k) with 0 (α = 1) at the padded tokens of ``keys`` (B, L): a padded token
    leaves the state as it was."""
    real = keys[:, None, :].to(log_alpha.dtype)
    return log_alpha * (real if log_alpha.dim() == 3 else real[..., None])


def layer_reference(mha, x, keys=None):
    """The whole layer written out: :func:`layer_inputs_reference`, the plain recurrence, each head's output norm
    (groupnorm, retnet's default: LayerNorm over d_v with its affine weights, ε = 1e-5; rmsnorm, the others':
    RMSNorm, ε = 1e-6; or none), the output projection. RWKV-7: its ``ln_x`` for groupnorm (its default: a GroupNorm
    with a group per head and an affine weight per channel, ε = d_v·1e-5), then the bonus (r_t · (ρ_h ⊙ k̃_t)) v_t
    after the norm (ρ: ``r_k``)."""
    q, k, v, log_alpha, beta, removal = layer_inputs_reference(mha, x, keys)
    z, _ = reference_form(q, k, v, log_alpha, beta, removal)  # (B, H, L, d_v)
    norm = mha.form.output_norm
    if mha.config.score == "rwkv7" and mha.form.output_norm_name == "groupnorm":
        assert norm is None
        ln, heads = mha.form.ln_x, mha.num_heads
        mean = z.mean(-1, keepdim=True)
        var = ((z - mean) ** 2).mean(-1, keepdim=True)
        weight, bias = ln.weight.reshape(heads, 1, HEAD_V), ln.bias.reshape(heads, 1, HEAD_V)  # head h's channels
        z = (z - mean) / torch.sqrt(var + HEAD_V * 1e-5) * weight + bias
    elif mha.form.output_norm_name == "groupnorm":
        mean = z.mean(-1, keepdim=True)
        var = ((z - mean) ** 2).mean(-1, keepdim=True)
        z = (z - mean) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
    elif mha.form.output_norm_name == "rmsnorm":
        z = z / torch.sqrt((z * z).mean(-1, keepdim=True) + 1e-6) * norm.weight
    else:
        assert norm is None
    if mha.config.score == "rwkv7":  # the bonus u_t, after the norm (k = k̃: 0 at a padded token)
        z = z + (q * k * mha.form.r_k[:, None, :]).sum(-1, keepdim=True) * v
    Bn, Ln, _ = x.shape
    return z.transpose(1, 2).reshape(Bn, Ln, -1) @ mha.out_proj.weight.T + mha.out_proj.bias


def named_grads(mha, out, x):
    """Gradients of <out, c> (a fixed random cotangent) w.r.t. x and each named parameter."""
    names = [n for n, _ in mha.named_parameters()]
    gs = grads(out, [x, *(p for _, p in mha.named_parameters())])
    return dict(zip(["x", *names], gs, strict=True))


LAYER_OPTIONS = {
    "no_conv": {},
    "short_conv4": {"short_conv": 4},
    "gqa": {"heads": 4, "num_kv_heads": 2},  # two key/value heads for four query heads: 0, 1 read 0; 2, 3 read 1
    "rope": {"rope": True},
}
# (masking, option): grouped heads and rotary positions with key padding only (they do not touch the mask)
LAYER_CASES = [
    *((m, o) for o in ("no_conv", "short_conv4") for m in ("causal", "causal+padding")),
    ("causal+padding", "gqa"),
    ("causal+padding", "rope"),
]


@pytest.mark.parametrize(("masking", "option"), LAYER_CASES, ids=[f"{m}-{o}" for m, o in LAYER_CASES])
@pytest.mark.parametrize("score", SCORES)
def test_every_backend_of_a_layer_equals_the_plain_layer(score, masking, option):
    """The automatic choice (chunked), and the forced chunked, recurrent and eager backends: the same output and
    the same gradients of the input and of every parameter, all equal to the plain layer (the recurrence over an
    explicit state, padded keys written as k = 0: at the start, inside and at the end of a sequence), with or
    without a short convolution, grouped key/value heads or rotary positions."""
    layers = {
        backend: recurrent_mha(score, seed=1, backend=backend, **LAYER_OPTIONS[option])
        for backend in ("auto", "chunked", "recurrent", "eager")
    }
    auto = layers["auto"]
    assert auto.backend_for() == "chunked"
    assert auto.backend_for(mask="causal+padding") == "chunked"
    assert auto.backend_for(need_weights=True) == "eager"
    for backend, layer in layers.items():
        for (n, p), (_, p0) in zip(layer.named_parameters(), auto.named_parameters(), strict=True):
            assert torch.equal(p, p0), f"{backend}: {n} differs"
    x = randn(2, LAYER_L, D_MODEL, seed=80).requires_grad_()
    keys = None if masking == "causal" else PADDED_KEYS
    mask = CAUSAL if keys is None else causal_and_padding(keys)
    expected = layer_reference(auto, x, keys)
    expected_grads = named_grads(auto, expected, x)
    for backend, layer in layers.items():
        out, weights = layer(x, mask=mask)
        assert weights is None
        torch.testing.assert_close(out, expected, rtol=ATOL, atol=ATOL, msg=lambda m, b=backend: f"{b}: {m}")
        for name, g in named_grads(layer, out, x).items():
            torch.testing.assert_close(
                g, expected_grads[name], rtol=ATOL, atol=ATOL, msg=lambda m, b=backend, n=name: f"{b}, d/d{n}: {m}"
            )
    if keys is not None:  # rows 0 and 1 of sequence 1 see no key: z = 0, normed (a LayerNorm gives its bias)
        out = layers["auto"](x, mask=mask)[0]
        norm = auto.form.output_norm
        if score == "rwkv7":  # its own GroupNorm ln_x, a bias per channel; no bonus (k̃ = 0 at a padded token)
            zero = auto.form.ln_x.bias
        elif auto.form.output_norm_name == "groupnorm":
            zero = norm.bias.repeat(auto.num_heads)
        else:
            zero = torch.zeros(auto.num_heads * HEAD_V, dtype=torch.float64)
        empty_row = zero @ auto.out_proj.weight.T + auto.out_proj.bias
        torch.testing.assert_close(out[1, :2], empty_row.expand(2, D_MODEL), rtol=0, atol=1e-12)


@pytest.mark.parametrize("masking", ["causal", "causal+padding"])
@pytest.mark.parametrize("score", SCORES)
def test_the_weights_a_layer_returns_are_the_effective_matrix_of_its_inputs(score, masking):
    """need_weights=True runs eager and returns (B, H, L, L) = effective_matrix of the score's q', k', log α, β
    (padded keys as k = 0); signed for the delta rule; and the output is those weights applied to v (through the
    output norm and projection). DeltaProduct's and RWKV-7's records are not of log α and β alone (n steps per
    token; a low-rank term), so their matrix is the plain recurrence's (:func:`reference_matrix`): RWKV-7's is that
    of wkv (before its GroupNorm and bonus); DeltaProduct's weights sum each token's n columns of the (L, L·n) map
    from the n values per token, which is what its output applies."""
    mha = recurrent_mha(score, seed=2)
    x = randn(2, LAYER_L, D_MODEL, seed=81).requires_grad_()
    keys = None if masking == "causal" else PADDED_KEYS
    mask = CAUSAL if keys is None else causal_and_padding(keys)
    out, weights = mha(x, mask=mask, need_weights=True)
    q, k, _, log_alpha, beta, removal = layer_inputs_reference(mha, x, keys)
    if SETTINGS[score].form in ("deltaproduct", "rwkv7"):
        expected = reference_matrix(q, k, log_alpha, beta, removal)
        if k.dim() == 5:  # (L, L·n) → (L, L)
            expected = per_token(expected, k.shape[3])
    else:
        expected = transition.effective_matrix(q, k, Transition(log_alpha, beta))
    assert weights is not None and weights.shape == (2, HEADS, LAYER_L, LAYER_L)
    assert (weights.triu(1) == 0).all()
    assert_same(weights, expected, [x, *mha.parameters()], atol=ATOL)
    if "delta" in form_class(SETTINGS[score].form).tags:
        assert (weights < 0).any(), "the delta rule's effective matrix has negative entries"
    assert_same(out, layer_reference(mha, x, keys), [x, *mha.parameters()], atol=ATOL)
    assert_same(mha(x, mask=mask)[0], out, [x, *mha.parameters()], atol=ATOL)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 11, 64])
@pytest.mark.parametrize("score", ["gated_deltanet", "gla_channel", "gla_mamba2", "kda_beta2", "deltaproduct", "rwkv7"])
def test_the_chunked_layer_does_not_depend_on_the_chunk_size(score, chunk):
    mha = recurrent_mha(score, seed=3, chunk=chunk)
    x = randn(2, LAYER_L, D_MODEL, seed=82).requires_grad_()
    assert_same(mha(x, mask=CAUSAL)[0], layer_reference(mha, x), [x, *mha.parameters()], atol=ATOL)


LAYER_VARIANTS = {
    "gqa_one_kv_head": ("gated_deltanet", {"num_kv_heads": 1}),
    "gla_tau4_no_norm": ("gla", {"score_params": {"gate_normalizer": 4.0, "output_norm": None}}),
    "retnet_rmsnorm": ("retnet", {"score_params": {"output_norm": "rmsnorm"}}),
    "deltanet_groupnorm_rope": ("deltanet", {"score_params": {"output_norm": "groupnorm"}, "rope": True}),
    "gla_channel_tau4_rank2": ("gla_channel", {"score_params": {"gate_normalizer": 4.0, "gate_rank": 2}}),
    "kda_rank2_beta2_gqa_rope_conv": (
        "kda_beta2",
        {"score_params": {"gate_rank": 2}, "num_kv_heads": 1, "rope": True, "short_conv": 3},
    ),
    "gated_deltanet_mamba2_gate": ("gated_deltanet", {"score_params": {"gate": "mamba2"}}),  # no k·Δ: β writes
    "gated_deltanet_channel_gate_beta2": ("gated_deltanet_beta2", {"score_params": {"gate": "channel"}}),
    "kda_head_gate": ("kda", {"score_params": {"gate": "head"}}),
    # DeltaProduct: three steps per token with one key/value head (the step-major layout, repeated for the query
    # heads), rotary positions on each step's key and short convolutions over the n·G heads' channels
    "deltaproduct_n3_mamba2_gqa_rope_conv": (
        "deltaproduct",
        {"score_params": {"householder_steps": 3, "gate": "mamba2"}, "num_kv_heads": 1, "rope": True, "short_conv": 3},
    ),
    "deltaproduct_kda_gate_rank2_beta2": ("deltaproduct_beta2", {"score_params": {"gate": "kda", "gate_rank": 2}}),
    "deltaproduct_channel_gate_tau4_groupnorm": (
        "deltaproduct",
        {"score_params": {"gate": "channel", "gate_normalizer": 4.0, "output_norm": "groupnorm"}},
    ),
    "deltaproduct_n1_no_gate": ("deltaproduct", {"score_params": {"householder_steps": 1, "gate": "none"}}),
    "rwkv7_rmsnorm_gqa_conv": (
        "rwkv7",
        {"score_params": {"output_norm": "rmsnorm"}, "num_kv_heads": 1, "short_conv": 2},
    ),
    "rwkv7_no_norm_ranks_2_3_rope": (
        "rwkv7",
        {"score_params": {"output_norm": None, "decay_rank": 2, "a_rank": 3}, "rope": True},
    ),
}


@pytest.mark.parametrize(("score", "options"), list(LAYER_VARIANTS.values()), ids=list(LAYER_VARIANTS))
def test_layer_options_reach_every_backend(score, options):
    """Grouped key/value heads, the score's parameters (τ, output_norm, the gate, its rank, β's range), rotary
    positions and short convolutions together: the chunked, recurrent and eager backends agree (values and every
    gradient) and equal the plain layer."""
    layers = {b: recurrent_mha(score, seed=8, backend=b, **options) for b in ("chunked", "recurrent", "eager")}
    x = randn(2, LAYER_L, D_MODEL, seed=86).requires_grad_()
    mask = causal_and_padding(PADDED_KEYS)
    expected = layers["eager"](x, mask=mask)[0]
    assert_same(expected, layer_reference(layers["eager"], x, PADDED_KEYS), [x, *layers["eager"].parameters()])
    expected_grads = named_grads(layers["eager"], expected, x)
    for backend in ("chunked", "recurrent"):
        out = layers[backend](x, mask=mask)[0]
        torch.testing.assert_close(out, expected, rtol=ATOL, atol=ATOL)
        for name, g in named_grads(layers[backend], out, x).items():
            torch.testing.assert_close(g, expected_grads[name], rtol=ATOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------------------------- DeltaProduct, RWKV-7


@pytest.mark.parametrize("gate", ["head", "mamba2"])
def test_deltaproduct_with_one_householder_step_is_gated_deltanet(gate):
    """Siems et al. 2025: n_h = 1 is Gated DeltaNet. A ``deltaproduct`` layer with householder_steps=1 has the
    parameters of a ``gated_deltanet`` layer of the same sizes (the same names and shapes: its state_dict loads
    strictly) and, loaded with them, gives exactly its output, gradients and weights on every backend (with one
    key/value head for two query heads, rotary positions, a short convolution and key padding)."""
    options = {"num_kv_heads": 1, "rope": True, "short_conv": 3}
    x = randn(2, LAYER_L, D_MODEL, seed=90).requires_grad_()
    mask = causal_and_padding(PADDED_KEYS)
    for backend in ("chunked", "recurrent", "eager"):
        gdn = recurrent_mha("gated_deltanet", seed=13, backend=backend, score_params={"gate": gate}, **options)
        torch.manual_seed(14)
        config = recurrent_config(
            "deltaproduct", backend, score_params={"householder_steps": 1, "gate": gate}, **options
        )
        dp = attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_K, d_v=HEAD_V, config=config).double()
        assert type(dp.form).__name__ == "DeltaProduct" and dp.form.householder_steps == 1
        dp.load_state_dict(gdn.state_dict())  # strict: the same parameters
        assert [n for n, _ in dp.named_parameters()] == [n for n, _ in gdn.named_parameters()]
        out, expected = dp(x, mask=mask)[0], gdn(x, mask=mask)[0]
        assert torch.equal(out, expected), f"{backend}: {(out - expected).abs().max()}"
        got_grads, expected_grads = named_grads(dp, out, x), named_grads(gdn, expected, x)
        for name, g in got_grads.items():
            assert torch.equal(g, expected_grads[name]), f"{backend}: d/d{name}"
    weights, expected_weights = dp(x, mask=mask, need_weights=True)[1], gdn(x, mask=mask, need_weights=True)[1]
    assert torch.equal(weights, expected_weights)


def test_deltaproduct_without_its_gate_has_no_decay():
    """``gate=none``: no decay parameters, a record without log α, and every backend gives the plain recurrence of
    its n delta-rule steps per token with α ≡ 1 (values and gradients, with key padding)."""
    options = {"score_params": {"gate": "none", "householder_steps": 3}}
    layers = {
        b: recurrent_mha("deltaproduct", seed=15, backend=b, **options) for b in ("chunked", "recurrent", "eager")
    }
    mha = layers["eager"]
    names = [n for n, _ in mha.named_parameters()]
    assert not [n for n in names if any(w in n for w in ("alpha_gate", "A_log", "dt_bias"))], names
    x = randn(2, LAYER_L, D_MODEL, seed=93).requires_grad_()
    mask = causal_and_padding(PADDED_KEYS)
    inputs = mha.form.prepare(*mha.project(x), x, mask)
    assert inputs.transition.log_decay is None and inputs.transition.householder_steps == 3
    _, k, v, log_alpha, beta, _ = layer_inputs_reference(mha, x, PADDED_KEYS)
    assert log_alpha is None and k.shape == (2, HEADS, LAYER_L, 3, HEAD_K) and beta.shape == (2, HEADS, LAYER_L, 3)
    assert v.shape == (2, HEADS, LAYER_L, 3, HEAD_V)
    for layer in layers.values():
        assert_same(layer(x, mask=mask)[0], layer_reference(layer, x, PADDED_KEYS), [x, *layer.parameters()], atol=ATOL)


def test_rwkv7_starts_as_its_papers_code_initialises_it():
    """RWKV-7's code (BlinkDL/RWKV-LM, RWKV-v7's time mixing ``RWKV_Tmix_x070``, its first layer: ratio_0_to_1 = 0)
    with C = H·d_k channels, linear_c = c/(C − 1) − 1/2 and zigzag_c = z|z|, z = ((c mod d_k) − (d_k − 1)/2) /
    ((d_k − 1)/2): ξ = k_k = 0.71 − 0.1·linear, α = k_a = 1.02, ρ = r_k = −0.04; the low-rank maps start at their
    biases (W₁ = 0, W₂ orthogonal with gain 0.1), w₀ = −6 + 6·c/(C − 1) + 0.5 + 2.5·zigzag and a₀ = −0.19 +
    0.3·zigzag + 0.4·linear; so at first, whatever x, the decay w_t = exp(−e^{−0.5} σ(w₀)) lies in (e^{−e^{−0.5}}, 1)
    and a_t = σ(a₀) in (0, 1). ln_x: a GroupNorm of one group per head, ε = d_v·1e-5 (the code's 64e-5 at d_v = 64),
    weight 1, bias 0."""
    heads, d_k, d_model = 3, 4, 6
    channels = heads * d_k
    torch.manual_seed(91)
    form = build("rwkv7", d_k, heads, d_v=D_V, d_model=d_model)  # float32, as built
    linear = torch.tensor([c / (channels - 1) - 0.5 for c in range(channels)], dtype=torch.float64)
    half = (d_k - 1) / 2
    zigzag = torch.tensor([((c % d_k) - half) / half for c in range(channels)], dtype=torch.float64)
    zigzag = zigzag * zigzag.abs()
    ramp = torch.tensor([c / (channels - 1) for c in range(channels)], dtype=torch.float64)
    w0, a0 = -6 + 6 * ramp + 0.5 + 2.5 * zigzag, -0.19 + 0.3 * zigzag + 0.4 * linear

    def close(got, expected):
        torch.testing.assert_close(got.detach().double(), expected, rtol=0, atol=1e-6)

    close(form.k_k, (0.71 - 0.1 * linear).reshape(heads, d_k))
    close(form.k_a, torch.full((heads, d_k), 1.02, dtype=torch.float64))
    close(form.r_k, torch.full((heads, d_k), -0.04, dtype=torch.float64))
    close(form.w_lora.up.bias, w0)
    close(form.a_lora.up.bias, a0)
    for lora in (form.w_lora, form.a_lora):
        assert not lora.down.weight.any() and lora.down.bias is None
        up = lora.up.weight.detach().double()  # (C, rank), C ≤ rank here: orthogonal rows of norm 0.1
        assert up.shape == (channels, 32)
        close(up @ up.T, 0.01 * torch.eye(channels, dtype=torch.float64))
    ln = form.ln_x
    assert form.output_norm is None and ln.num_groups == heads and ln.num_channels == heads * D_V
    assert ln.eps == pytest.approx(D_V * 1e-5)
    assert (ln.weight == 1).all() and not ln.bias.any()
    x = 3 * randn(2, 7, d_model, seed=92).float()
    r, k = randn(2, heads, 7, d_k, seed=94).float(), randn(2, heads, 7, d_k, seed=95).float()
    _, _, record = form.inputs(r, k, x)
    w = torch.exp(record.log_decay.detach().double())
    assert ((w > math.exp(-RWKV7_DECAY_SCALE)) & (w < 1)).all()
    close(w, torch.exp(-RWKV7_DECAY_SCALE * plain_sigmoid(w0)).reshape(heads, 1, d_k).expand(2, heads, 7, d_k))
    a = plain_sigmoid(a0)
    assert ((a > 0) & (a < 1)).all()
    kappa = -record.low_rank[0].detach().double()  # b = κ̂ ⊙ a_t with a_t = σ(a₀) for every x
    close(record.low_rank[1], kappa * a.reshape(heads, 1, d_k))


def test_an_encoder_with_padding_runs_the_chunked_form_as_its_eager_path():
    """Pads first and inside a sequence: the encoder's causal+padding masks run on chunked, as need_weights=True
    (eager) computes them."""
    torch.manual_seed(9)
    options = {"score": "gated_deltanet", "normalizer": "none", "mask": "causal", "backend_params": {"chunk_size": 2}}
    enc = attnlab.Encoder(11, D_MODEL, HEADS, 2, pad_id=0, **options).double()
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 0, 5, 6, 0, 7, 8]])
    assert [m.form for m in enc.build_masks(tokens)] == ["causal+padding"] * 2
    assert enc.layers[0].self_attn.backend_for(mask="causal+padding") == "chunked"
    out = enc(tokens)
    eager, _ = enc(tokens, need_weights=True)
    assert torch.isfinite(out).all()
    assert_same(out, eager, list(enc.parameters()), atol=ATOL)


HALF = {"bfloat16": (torch.bfloat16, 0.05), "float16": (torch.float16, 0.01)}


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("score", SCORES)
def test_a_half_precision_layer_runs_every_path_and_returns_its_weights(score, dtype):
    """In bfloat16 and float16 (and under CPU autocast) the chunked, recurrent and eager paths, and
    need_weights=True (the diagnostics), run and give the float32 layer's output to half-precision rounding
    (within ``tol`` of its largest entry; without the output norm, which would magnify the rounding of a row of
    nearly equal entries)."""
    dt, tol = HALF[dtype]
    no_norm = {"score_params": {"output_norm": None}}
    mha = recurrent_mha(score, seed=10, **no_norm).float()
    x = randn(2, 7, D_MODEL, seed=87).float()
    with torch.no_grad():
        exact, exact_weights = mha(x, mask=CAUSAL, need_weights=True)
        scale = float(exact.abs().max())
        half = copy.deepcopy(mha).to(dt)
        outs = {"auto": half(x.to(dt), mask=CAUSAL)[0]}
        for backend in ("recurrent", "eager"):
            forced = recurrent_mha(score, seed=10, backend=backend, **no_norm).to(dt)
            outs[backend] = forced(x.to(dt), mask=CAUSAL)[0]
        outs["need_weights"], weights = half(x.to(dt), mask=CAUSAL, need_weights=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs["autocast"] = mha(x, mask=CAUSAL)[0]
            outs["autocast_need_weights"], autocast_weights = mha(x, mask=CAUSAL, need_weights=True)
    for path, out in outs.items():
        assert torch.isfinite(out).all(), path
        atol = (HALF["bfloat16"][1] if path.startswith("autocast") else tol) * scale  # autocast: bfloat16
        torch.testing.assert_close(out.float(), exact, rtol=0, atol=atol, msg=lambda m, p=path: f"{p}: {m}")
    weight_scale = float(exact_weights.abs().max())
    torch.testing.assert_close(weights.float(), exact_weights, rtol=0, atol=tol * weight_scale)
    atol = HALF["bfloat16"][1] * weight_scale
    torch.testing.assert_close(autocast_weights.float(), exact_weights, rtol=0, atol=atol)


@pytest.mark.parametrize("score", SCORES)
def test_a_bool_tensor_causal_mask_gives_what_the_causal_mask_gives(score):
    """The (L, L) lower-triangular bool tensor (True = may attend) is the causal mask: ``attn(x, mask=causal_mask)``
    with a bool tensor gives what attnlab's causal Mask gives (a tensor mask prepares as form ``other``, so the layer
    has to recognise that it is exactly j ≤ i)."""
    mha = recurrent_mha(score, seed=4)
    x = randn(2, 6, D_MODEL, seed=83).requires_grad_()
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    assert_same(mha(x, mask=tril)[0], mha(x, mask=CAUSAL)[0], [x, *mha.parameters()], atol=ATOL)


@pytest.mark.parametrize("short_conv", [None, 4], ids=["no_conv", "short_conv4"])
@pytest.mark.parametrize("score", SCORES)
def test_no_chunked_layer_leaks_the_future(score, short_conv):
    """d out_i / d x_j = 0 for j > i and across the batch, nonzero for j = i (L = 6, chunk size 4): for each
    sequence b and row i, the gradient of <out_bi, c_bi> w.r.t. the whole input, c a random cotangent (a vector of
    Jacobian rows that is zero only where every one of those rows is, almost surely): 12 backward passes instead of
    the full Jacobian's 96."""
    mha = recurrent_mha(score, seed=5, short_conv=short_conv)
    assert mha.backend_for() == "chunked"
    x = randn(2, 6, D_MODEL, seed=84).requires_grad_()
    out = mha(x, mask=CAUSAL)[0]
    c = randn(2, 6, D_MODEL, seed=89)
    for b in range(2):
        for i in range(6):
            (g,) = torch.autograd.grad(out[b, i], x, c[b, i], retain_graph=True)
            assert (g[b, i + 1 :] == 0).all(), f"row {i} of sequence {b} sees the future"
            assert (g[1 - b] == 0).all(), "batch elements leak into each other"
            assert g[b, i].abs().sum() > 0


# --------------------------------------------------------------------------------------------- refusals

REFUSED = {
    "normalizer_softmax": ({"normalizer": "softmax"}, "normalizer"),
    "normalizer_rowsum": ({"normalizer": "rowsum"}, "normalizer"),
    "mask_none": ({"mask": None}, "mask"),
    "mask_sliding_window": ({"mask": {"name": "sliding_window", "window": 3}}, "mask"),
    "backend_global": ({"backend": "global"}, "global"),
    "position_bias": ({"position_bias": "alibi"}, "position_bias"),
    "softcap": ({"softcap": 5.0}, "softcap"),
    "differential": ({"differential": True}, "differential"),
}


@pytest.mark.parametrize(("change", "word"), list(REFUSED.values()), ids=list(REFUSED))
@pytest.mark.parametrize("score", SCORES)
def test_a_configuration_the_forms_cannot_compute_is_refused_in_one_line_at_build(score, change, word):
    setting = SETTINGS[score]
    options = {"score": setting.form, "score_params": setting.params, "normalizer": "none", "mask": "causal", **change}
    with pytest.raises(ValueError, match=word) as info:
        attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_K, config=AttentionConfig(**options))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("score", ["gla", "gated_deltanet"])
def test_a_call_with_a_mask_that_is_not_causal_is_refused_in_one_line(score):
    """The module docstring: a layer refuses a mask that is not causal (AND key padding), in one line; a
    symmetric window or key padding alone would otherwise be computed as causal. A call with no mask applies the
    layer's configured one (causal: issue 60), as passing it does."""
    mha = recurrent_mha(score, seed=6)
    x = randn(2, 6, D_MODEL, seed=85)
    window = build_mask("sliding_window", window=2)
    keys_only = PADDED_KEYS[:, None, None, :6]  # (B, 1, 1, L): key padding alone
    torch.testing.assert_close(mha(x)[0], mha(x, mask=CAUSAL)[0])
    for mask in (window, keys_only):
        for need_weights in (False, True):
            with pytest.raises((ValueError, RuntimeError)) as info:
                mha(x, mask=mask, need_weights=need_weights)
            assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="self-attention only") as info:
        mha(x, key_value=randn(2, 6, D_MODEL, seed=86), mask=CAUSAL)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------- state size


@pytest.mark.parametrize("score", SCORES)
def test_the_state_size_is_one_matrix_per_head_whatever_the_length(score):
    mha = recurrent_mha(score, seed=7)
    for length in (0, 1, LAYER_L, 100_000):
        assert mha.state_size(length) == HEADS * HEAD_K * HEAD_V == mha.form.state_size(0)
    conv = recurrent_mha(score, seed=7, short_conv=4)
    # q and k (H·d_k each), v (H·d_v); DeltaProduct's layer projects n·G key and value heads (n keys and values per
    # token), so its short convolutions carry n·H·d_k and n·H·d_v channels of k and v (its state is still one
    # matrix per head: the n steps of a token update the same M)
    setting = SETTINGS[score]
    n = householder_steps(setting.form, setting.params)
    channels = HEADS * HEAD_K + n * (HEADS * HEAD_K + HEADS * HEAD_V)
    assert conv.k_proj.out_features == n * HEADS * HEAD_K and conv.v_proj.out_features == n * HEADS * HEAD_V
    for length in (1, LAYER_L, 100_000):
        assert conv.state_size(length) == HEADS * HEAD_K * HEAD_V + 3 * channels


def test_every_registered_recurrent_form_is_tested_here():
    """The generic score tests leave out the decay and delta-rule forms (helpers.RECURRENT_FORMS); this file tests
    each one at its defaults and at each named setting (SCORES, from the registry's tags and settings), and they
    still pick every built-in and its settings."""
    assert set(RECURRENT_FORMS) <= set(SCORES)
    assert set(WRITTEN_OUT) <= set(SCORES)
    builtin = {"gla_channel", "gla_mamba2", "deltanet_beta2", "gated_deltanet_beta2", "kda", "kda_beta2"}
    builtin |= {"deltaproduct", "deltaproduct_beta2", "rwkv7"}
    assert builtin <= set(SCORES), builtin - set(SCORES)
    assert all(SETTINGS[label].form in WRITTEN_OUT for label in builtin)


@pytest.mark.parametrize("score", SCORES)
def test_what_a_padded_token_holds_changes_nothing_after_it(score):
    """A padded token inside a sequence is no token: it writes nothing (k = 0) and forgets nothing (α = 1), so the
    outputs of the real tokens after it do not depend on its input (a decay form once decayed the state there)."""
    mha = recurrent_mha(score, seed=5)
    x = randn(1, LAYER_L, D_MODEL, seed=6)
    keys = torch.ones(1, LAYER_L, dtype=torch.bool)
    keys[0, 4] = False
    other = x.clone()
    other[0, 4] = 10 * randn(D_MODEL, seed=7)
    mask = causal_and_padding(keys)
    out, out_other = mha(x, mask=mask)[0], mha(other, mask=mask)[0]
    torch.testing.assert_close(out_other[0, 5:], out[0, 5:], rtol=0, atol=1e-12)
