"""Conventions said out loud (issue 60): where a layer could differ from its authors' in a way that changes the
numbers, the choice is pinned here against a reference written plainly in the test, from the layer's own weights.

* The delta-rule layers (``deltanet``, ``gated_deltanet``, ``kda``, ``deltaproduct``) read with the L2-normalised
  query scaled by 1/√d_k, q ← q / (‖q‖ √d_k), k ← k / ‖k‖, as flash-linear-attention's kernels do (``scale``
  defaults to ``K ** -0.5`` in ``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda`` and
  ``chunk_gated_delta_product``, applied after ``use_qk_l2norm_in_kernel``; its naive reference ``q * d_k**-0.5``).
  The papers write o_t = M_tᵀ q_t with the unit q; the per-head output norm hides the factor (up to its ε), so only
  ``output_norm=None`` shows it, as √d_k.
* DeltaProduct's β projection is read step-major, as fla's ``GatedDeltaProduct`` (``rearrange(beta, '... t (n h)
  -> ... (t n) h')``): output s·H + h is head h's β at step s, the same layout as its n·G key and value heads.
* ``conf/config.yaml``'s comments name every built-in backend and normalizer.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from helpers import randomize_

import attnlab
from attnlab.backends.base import _BACKENDS
from attnlab.config import AttentionConfig
from attnlab.masks import build_mask
from attnlab.normalizers import _NORMALIZERS

pytestmark = pytest.mark.usefixtures("single_thread")

REPO = Path(__file__).resolve().parents[1]
D_MODEL, HEADS, D_K, D_V, L = 8, 2, 4, 3, 6  # d_k = 4: the factor √d_k = 2 is plain to see

# name → (variant params, Householder steps n); every one with output_norm=None, so nothing hides a factor
DELTA_LAYERS = {
    "deltanet": ({}, 1),
    "gated_deltanet": ({}, 1),
    "kda": ({}, 1),
    "deltaproduct": ({"householder_steps": 3}, 3),
}


def delta_layer(name, seed=0):
    params, _ = DELTA_LAYERS[name]
    config = AttentionConfig(score=name, score_params={**params, "output_norm": None}, normalizer="none", mask="causal")
    torch.manual_seed(seed)
    mha = attnlab.MultiHeadAttention(D_MODEL, HEADS, D_K, d_v=D_V, config=config)
    return randomize_(mha.double(), seed=seed, scale=0.5)


def sigmoid(z):
    return 1 / (1 + torch.exp(-z))


def softplus(z):
    return torch.log1p(torch.exp(z))


def hand_gates(mha, name, x):
    """log α (B, H, L) per head, (B, H, L, d_k) per key channel, or None; β (B, H, L, n): written out from the
    layer's gate weights. β of head h at step s is output s·H + h of ``beta_gate.proj`` (fla's step-major layout)."""
    form, B = mha.form, x.shape[0]
    _, n = DELTA_LAYERS[name]
    w, b = form.beta_gate.proj.weight, form.beta_gate.proj.bias  # (H·n, d_model), (H·n,)
    beta = torch.zeros(B, HEADS, L, n, dtype=x.dtype)
    for h in range(HEADS):
        for s in range(n):
            beta[:, h, :, s] = sigmoid(x @ w[s * HEADS + h] + b[s * HEADS + h])
    log_alpha = None
    if name in ("gated_deltanet", "deltaproduct"):  # gate=head: log σ(x w_h + b_h) / 16
        lin = form.alpha_gate.proj
        log_alpha = torch.stack([-softplus(-(x @ lin.weight[h] + lin.bias[h])) / 16.0 for h in range(HEADS)], 1)
    elif name == "kda":  # gate=kda: −exp(A_log_h) softplus(x W₁ W₂ + dt_bias_hc), one per key channel
        z = (x @ form.alpha_gate.down.weight.T @ form.alpha_gate.up.weight.T).view(B, L, HEADS, D_K)
        log_alpha = -form.A_log.exp()[:, None, None] * softplus(z.transpose(1, 2) + form.dt_bias[:, None, :])
    return log_alpha, beta


def hand_layer(mha, name, x):
    """The whole layer (output_norm=None) as a loop over tokens and steps, with an explicit state per (b, h):
    M ← Diag(α_t) M, then for each step s: M ← M + β k (vᵀ − kᵀ M), then o_t = Mᵀ q̂_t, q̂ = q / (‖q‖ √d_k)."""
    _, n = DELTA_LAYERS[name]
    B = x.shape[0]
    q = (x @ mha.q_proj.weight.T + mha.q_proj.bias).view(B, L, HEADS, D_K)
    k = (x @ mha.k_proj.weight.T + mha.k_proj.bias).view(B, L, n, HEADS, D_K)  # step-major heads: s·H + h
    v = (x @ mha.v_proj.weight.T + mha.v_proj.bias).view(B, L, n, HEADS, D_V)
    log_alpha, beta = hand_gates(mha, name, x)
    z = torch.zeros(B, L, HEADS, D_V, dtype=x.dtype)
    for bi in range(B):
        for h in range(HEADS):
            M = torch.zeros(D_K, D_V, dtype=x.dtype)
            for t in range(L):
                if log_alpha is not None:
                    a = log_alpha[bi, h, t].exp()
                    M = (a[:, None] if a.dim() == 1 else a) * M
                for s in range(n):
                    kk = k[bi, t, s, h] / k[bi, t, s, h].norm()
                    M = M + beta[bi, h, t, s] * torch.outer(kk, v[bi, t, s, h] - kk @ M)
                qq = q[bi, t, h] / q[bi, t, h].norm() / math.sqrt(D_K)
                z[bi, t, h] = M.T @ qq
    return z.reshape(B, L, HEADS * D_V) @ mha.out_proj.weight.T + mha.out_proj.bias


@pytest.mark.parametrize("name", list(DELTA_LAYERS))
def test_a_delta_rule_layer_reads_with_the_unit_query_over_sqrt_d_k(name):
    """fla's convention, q / (‖q‖ √d_k): the layer (output_norm=None, every backend) equals the hand loop, and its
    form maps q so; with the unit query alone (the papers' formula as written) the output would be √d_k = 2 times
    this one."""
    mha = delta_layer(name)
    x = torch.randn(2, L, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q = torch.randn(2, HEADS, L, D_K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    k = torch.randn(2, HEADS, L, D_K, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    q2, k2 = mha.form.maps(q, k)
    torch.testing.assert_close(q2, q / q.norm(dim=-1, keepdim=True) / math.sqrt(D_K), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(k2, k / k.norm(dim=-1, keepdim=True), rtol=1e-14, atol=1e-15)
    expected = hand_layer(mha, name, x)
    causal = build_mask("causal")
    for backend in ("chunked", "recurrent", "eager"):
        mha.config = mha.config.replace(backend=backend)
        out = mha(x, mask=causal)[0]
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12, msg=f"{name}, backend {backend}")


def test_deltaproduct_reads_its_beta_projection_step_major_as_fla():
    """β of head h at token t's step s is σ(x_t w_{s·H+h} + b_{s·H+h}) (fla: ``'... t (n h) -> ... (t n) h'``), the
    layout of the layer's n·G key and value heads, not h·n + s."""
    mha = delta_layer("deltaproduct")
    n = DELTA_LAYERS["deltaproduct"][1]
    x = torch.randn(2, L, D_MODEL, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    beta = mha.form.gates(x)[1]  # (B, H, L·n): token t's step s at t·n + s
    w, b = mha.form.beta_gate.proj.weight, mha.form.beta_gate.proj.bias
    for h in range(HEADS):
        for t in range(L):
            for s in range(n):
                expected = sigmoid(x[:, t] @ w[s * HEADS + h] + b[s * HEADS + h])
                torch.testing.assert_close(beta[:, h, t * n + s], expected, rtol=1e-14, atol=1e-15)


# --------------------------------------------------------------------------------------------- stale text


def comment_block(key):
    """The comments of conf/config.yaml's line that sets ``key`` (``key:`` or ``- key:``) and of the comment-only
    lines that continue it."""
    lines = (REPO / "conf" / "config.yaml").read_text().splitlines()
    pattern = re.compile(rf"^\s*(-\s+)?{re.escape(key)}:")
    start = next(i for i, line in enumerate(lines) if pattern.match(line))
    text = [lines[start].partition("#")[2]]
    for line in lines[start + 1 :]:
        if not line.strip().startswith("#"):
            break
        text.append(line.strip()[1:])
    return " ".join(text)


def built_in(registry):
    """The names registered by attnlab itself (not by a test or a user's module)."""
    return [n for n in registry.names() if getattr(registry.get(n), "__module__", "").startswith("attnlab.")]


@pytest.mark.parametrize(
    ("key", "names"),
    [("backend", built_in(_BACKENDS)), ("normalizer", built_in(_NORMALIZERS))],
    ids=["backends", "normalizers"],
)
def test_config_yaml_comments_name_every_built_in_backend_and_normalizer(key, names):
    assert names, key
    said = set(re.findall(r"\w+", comment_block(key)))
    missing = [n for n in names if n not in said]
    assert not missing, f"conf/config.yaml's comment on {key} does not name {missing}: add them"
    assert set(names) <= set(attnlab.backends.list_backends() if key == "backend" else attnlab.list_normalizers())


def test_the_forms_package_docstring_keeps_no_table_of_forms():
    """The forms are listed by attnlab.forms.list_forms() and the docs' generated table, not by hand."""
    doc = attnlab.forms.__doc__
    assert "list_forms" in doc
    assert not re.search(r"^=+\s+=+", doc, flags=re.M), "a hand-written table in attnlab/forms/__init__.py"
