"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): the feature maps, the O(L) backends
(``chunked``, ``recurrent``, ``global``), the short convolution and the state size, against references written
plainly here (the textbook formulas, explicit loops over i and j), in float64, values and gradients.

The quadratic form that the O(L) backends must equal is attnlab's eager path (``mha.attend``), itself checked here
against a plain loop over (b, h, i, j) for a whole layer (short convolution included).
"""

from __future__ import annotations

import copy
import math
from unittest import mock

import pytest
import torch
from conftest import assert_same, randn
from helpers import conv_loop, randomize_

import attnlab
import attnlab.backends.linear as linear_backends
from attnlab import transition
from attnlab.backends import build_backend
from attnlab.config import AttentionConfig
from attnlab.feature_maps import build_feature_map, list_feature_maps
from attnlab.forms.linear import LinearForm, linear_attention_global
from attnlab.masks import build_mask, prepare_mask
from attnlab.registry import UnknownNameError
from attnlab.stages import ShortConvolution

pytestmark = pytest.mark.usefixtures("single_thread")

B, H, L, D_K = 2, 3, 5, 4  # feature-map inputs (B, H, L, D_K)
D_MODEL, HEADS, HEAD_DIM = 8, 2, 4  # layers
ATOL = 1e-10
CAUSAL = build_mask("causal")


def qk(seed, length=L, d=D_K, scale=1.0):
    """Fresh random q, k (B, H, length, d), float64, with gradients."""
    q = (scale * randn(B, H, length, d, seed=seed)).requires_grad_()
    k = (scale * randn(B, H, length, d, seed=seed + 1)).requires_grad_()
    return q, k


def pairwise(phi_q, phi_k):
    """φ(q_i)·φ(k_j) for every (b, h, i, j)."""
    return torch.einsum("bhif,bhjf->bhij", phi_q, phi_k)


def dot(q, k):
    """q_i·k_j for every (b, h, i, j)."""
    return torch.einsum("bhid,bhjd->bhij", q, k)


def fmap(name, d_k=D_K, heads=H, **params):
    return build_feature_map(name, d_k, heads, **params).double()


# --------------------------------------------------------------------------------------------- feature maps


def test_every_feature_map_is_registered():
    expected = {"elu", "relu", "taylor", "square", "performer", "cosformer", "hedgehog", "rebased"}
    assert expected <= set(list_feature_maps())


def test_elu_map_is_elu_plus_one():
    x = (2 * randn(B, H, L, D_K, seed=1)).requires_grad_()
    fm = fmap("elu")
    expected = torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))  # elu(x) + 1
    assert fm.feature_dim == D_K
    assert_same(fm(x), expected, [x], atol=ATOL)
    assert (fm(x) > 0).all()


def test_relu_map_is_the_positive_part():
    x = (2 * randn(B, H, L, D_K, seed=2)).requires_grad_()
    expected = torch.where(x > 0, x, torch.zeros_like(x))
    assert_same(fmap("relu")(x), expected, [x], atol=ATOL)


@pytest.mark.parametrize("name", ["taylor", "square"])
@pytest.mark.parametrize("feature_dim", [None, D_K], ids=["feature_dim=None", "feature_dim=d_k"])
def test_taylor_map_gives_the_second_order_expansion_of_exp(name, feature_dim):
    """φ(q)·φ(k) = 1 + q·k/√d + (q·k)²/(2d) exactly (Arora et al. 2024), without a projection."""
    q, k = qk(3)
    fm = fmap(name, feature_dim=feature_dim)
    assert fm.proj is None and fm.feature_dim == 1 + D_K + D_K**2
    s = dot(q, k)
    expected = 1 + s / math.sqrt(D_K) + s**2 / (2 * D_K)
    assert_same(pairwise(fm(q), fm(k)), expected, [q, k], atol=ATOL)
    assert (pairwise(fm(q), fm(k)) >= 0.5 - 1e-12).all()  # 1 + t + t²/2 ≥ ½


@pytest.mark.parametrize("name", ["taylor", "square"])
def test_taylor_map_with_a_projection_gives_the_expansion_of_the_projected_vectors(name):
    torch.manual_seed(0)
    fm = fmap(name, feature_dim=3)
    assert fm.proj.shape == (H, D_K, 3) and fm.feature_dim == 1 + 3 + 9
    q, k = qk(4)
    pq = torch.einsum("bhld,hda->bhla", q, fm.proj)  # x projected per head: x P_h
    pk = torch.einsum("bhld,hda->bhla", k, fm.proj)
    s = dot(pq, pk)
    expected = 1 + s / math.sqrt(3) + s**2 / (2 * 3)
    assert_same(pairwise(fm(q), fm(k)), expected, [q, k, fm.proj], atol=ATOL)


def test_square_is_another_name_for_taylor():
    assert type(fmap("square")) is type(fmap("taylor"))


def test_cosformer_refuses_a_sequence_longer_than_its_max_len_in_one_line():
    """Beyond M the cosine weights turn negative (and the row sum can vanish): refused, not computed."""
    q, _ = qk(5, length=6)
    with pytest.raises(ValueError, match=r"^cosformer max_len \(3\) must be at least the sequence length \(6\)"):
        fmap("cosformer", max_len=3)(q)


@pytest.mark.parametrize("max_len", [None, 8, 6])
def test_cosformer_reweights_relu_similarities_by_the_cosine_of_the_distance(max_len):
    """φ(q_i)·φ(k_j) = relu(q_i)·relu(k_j)·cos(π(i − j)/(2M)), M = L by default (Qin et al. 2022)."""
    q, k = qk(5, length=6)
    fm = fmap("cosformer", max_len=max_len)
    assert fm.feature_dim == 2 * D_K
    M = 6 if max_len is None else max_len
    rq, rk = torch.clamp(q, min=0), torch.clamp(k, min=0)
    expected = torch.zeros(B, H, 6, 6, dtype=torch.float64)
    for i in range(6):
        for j in range(6):
            expected[:, :, i, j] = (rq[:, :, i] * rk[:, :, j]).sum(-1) * math.cos(math.pi * (i - j) / (2 * M))
    assert_same(pairwise(fm(q), fm(k)), expected, [q, k], atol=ATOL)


def test_cosformer_cross_attention_measures_distances_on_the_longer_sequence():
    """With Lq ≠ Lk (and no max_len) the linear score maps queries and keys with one M = max(Lq, Lk), so that the
    weight of (i, j) is cos(π(i − j)/2M) (mapping each sequence with its own length would not be a function of
    i − j)."""
    q, _ = qk(21, length=2)
    _, k = qk(23, length=4)
    score = attnlab.build_score("linear", d_k=D_K, num_heads=H, feature_map="cosformer").double()
    rq, rk = torch.clamp(q, min=0), torch.clamp(k, min=0)
    expected = torch.zeros(B, H, 2, 4, dtype=torch.float64)
    for i in range(2):
        for j in range(4):
            expected[:, :, i, j] = (rq[:, :, i] * rk[:, :, j]).sum(-1) * math.cos(math.pi * (i - j) / (2 * 4))
    assert_same(score(q, k), expected, [q, k], atol=ATOL)


def softmax_last(z):
    """e^{z_a} / Σ_b e^{z_b} over the last dimension (the maximum taken out)."""
    e = torch.exp(z - z.amax(-1, keepdim=True).detach())
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("weights", ["identity", "random"])
def test_hedgehog_map_is_two_softmaxes_of_plus_and_minus_a_per_head_affine_map(weights):
    """φ(x) = [softmax(x W_h + b_h), softmax(−x W_h − b_h)], each over its d features, W_h = I and b_h = 0 at init
    (Zhang et al. 2024; their code's SoftmaxDim)."""
    fm = fmap("hedgehog")
    assert fm.feature_dim == 2 * D_K
    assert torch.equal(fm.weight.detach(), torch.eye(D_K, dtype=torch.float64).repeat(H, 1, 1))
    assert not fm.bias.detach().any()
    if weights == "random":
        randomize_(fm, seed=6)
    x = randn(B, H, L, D_K, seed=7).requires_grad_()
    heads = []
    for h in range(H):
        y = x[:, h] @ fm.weight[h] + fm.bias[h]  # (B, L, d)
        heads.append(torch.cat([softmax_last(y), softmax_last(-y)], dim=-1))
    assert_same(fm(x), torch.stack(heads, dim=1), [x, fm.weight, fm.bias], atol=ATOL)


def layer_norm_plain(x, eps=1e-5):
    """(x − mean) / √(var + ε) over the last dimension, biased variance (torch's layer norm, its default ε)."""
    mean = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    return (x - mean) / torch.sqrt(var + eps)


@pytest.mark.parametrize("feature_dim", [None, 16], ids=["no_projection", "projected_to_16"])
@pytest.mark.parametrize("affine", ["init", "random"])
def test_rebased_similarity_is_the_square_of_normalised_dot_products(affine, feature_dim):
    """φ(q)·φ(k) = (y_q·y_k)², y = γ·layernorm(x) + β (γ = 1, β = 0 at init; Aksenov et al. 2024)."""
    torch.manual_seed(1)
    fm = fmap("rebased", feature_dim=feature_dim)
    d = D_K if feature_dim is None else feature_dim
    assert fm.feature_dim == d * d
    assert (fm.gamma == 1).all() and (fm.beta == 0).all() and fm.gamma.shape == (H, 1, d)
    if affine == "random":
        with torch.no_grad():
            fm.gamma.copy_(1 + 0.5 * randn(H, 1, d, seed=8))
            fm.beta.copy_(0.5 * randn(H, 1, d, seed=9))
    q, k = qk(10)

    def y(x):
        if fm.proj is not None:
            x = torch.einsum("bhld,hda->bhla", x, fm.proj)
        return fm.gamma * layer_norm_plain(x) + fm.beta  # (H, 1, d) broadcast over (B, H, L, d)

    expected = dot(y(q), y(k)) ** 2
    params = [q, k, fm.gamma, fm.beta, *([] if fm.proj is None else [fm.proj])]
    assert_same(pairwise(fm(q), fm(k)), expected, params, atol=ATOL)


def test_performer_features_are_positive_random_features_of_orthogonal_directions():
    """φ(x)_r = exp(ω_r·x' − |x'|²/2)/√m, x' = x/d^¼ (Choromanski et al. 2021): shape, positivity, the formula
    with the map's ω, and ω's blocks of d orthogonal directions."""
    torch.manual_seed(2)
    m = 10
    fm = fmap("performer", num_features=m)
    assert fm.feature_dim == m and fm.omega.shape == (m, D_K)
    x = randn(B, H, L, D_K, seed=11).requires_grad_()
    phi = fm(x)
    assert phi.shape == (B, H, L, m) and (phi > 0).all()
    xs = x / D_K**0.25
    expected = torch.stack(
        [torch.exp((xs * fm.omega[r]).sum(-1) - (xs * xs).sum(-1) / 2) / math.sqrt(m) for r in range(m)], dim=-1
    )
    assert_same(phi, expected, [x], atol=ATOL)
    for start in range(0, m, D_K):  # each block: orthogonal rows
        block = fm.omega[start : start + D_K]
        unit = block / block.norm(dim=1, keepdim=True)
        torch.testing.assert_close(unit @ unit.T, torch.eye(len(block), dtype=torch.float64), atol=1e-6, rtol=0)
    huge = fm(1e3 * randn(B, H, L, D_K, seed=12))  # ω·x' − |x'|²/2 ≤ |ω|²/2: finite, never inf or NaN
    assert torch.isfinite(huge).all() and (huge >= 0).all()


def test_performer_estimates_the_softmax_kernel_within_its_standard_error():
    """The mean over m features of exp(ω·q')·exp(ω·k')·e^{−|q'|²/2 − |k'|²/2} is unbiased for exp(q·k/√d).

    One term T has variance Var T = exp(|q'|² + |k'|² + 4 q'·k') − exp(2 q'·k'); with m i.i.d. directions the
    estimate's standard error is √(Var T / m), and orthogonal blocks only lower it (Choromanski et al. 2021,
    Thm. 2). Tolerance: 5 standard errors (a normal deviate beyond 5σ has probability < 10⁻⁶; the draw is seeded).
    """
    torch.manual_seed(3)
    m, d = 32768, D_K
    fm = fmap("performer", heads=1, num_features=m)
    q = 0.4 * randn(1, 1, 8, d, seed=13)  # |q'|², |k'|² ≈ 0.16: Var T stays small
    k = 0.4 * randn(1, 1, 8, d, seed=14)
    with torch.no_grad():
        estimate = (fm(q) * fm(k)).sum(-1)[0, 0]  # pair i: φ(q_i)·φ(k_i)
    qs, ks = q[0, 0] / d**0.25, k[0, 0] / d**0.25
    target = torch.exp((q[0, 0] * k[0, 0]).sum(-1) / math.sqrt(d))
    var_t = torch.exp((qs * qs).sum(-1) + (ks * ks).sum(-1) + 4 * (qs * ks).sum(-1)) - target**2
    tolerance = 5 * torch.sqrt(var_t / m)
    assert (tolerance < 0.1 * target).all()  # the test is sharp: within 10 %
    z = (estimate - target) / (tolerance / 5)
    assert (z.abs() < 5).all(), f"the estimate is off by {z.abs().max():.1f} standard errors: {z}"
    wrong = torch.exp((q[0, 0] * k[0, 0]).sum(-1))  # the kernel without 1/√d: told apart
    assert ((wrong - target).abs() > tolerance).any()


def test_performer_directions_are_marginally_standard_normal():
    """Unbiasedness needs every row ω_r ~ N(0, I_d) (its direction uniform on the sphere, its norm χ(d)): over
    m rows the mean of each coordinate is within 5/√m of 0 (within a block the rows are uncorrelated: a Haar
    orthogonal matrix is invariant under sign flips), whichever row of its block a direction is."""
    torch.manual_seed(15)
    m = 16384
    omega = fmap("performer", heads=1, num_features=m).omega
    assert (omega.mean(0).abs() < 5 / math.sqrt(m)).all(), f"mean of ω: {omega.mean(0)}"
    by_row = omega.view(m // D_K, D_K, D_K).mean(0)  # [r, c]: coordinate c of the r-th row of the blocks
    assert (by_row.abs() < 5 / math.sqrt(m // D_K)).all(), f"mean of the r-th row of the blocks:\n{by_row}"
    torch.testing.assert_close(omega.T @ omega / m, torch.eye(D_K, dtype=torch.float64), atol=0.05, rtol=0)


def test_performer_redraws_the_same_features_after_a_resume():
    """redraw=2: draw i uses seed + i and the counts are buffers, so a map loaded from a checkpoint (built under
    another global seed) draws exactly what the uninterrupted one draws, step after step."""
    torch.manual_seed(4)
    a = fmap("performer", num_features=6, redraw=2).train()
    for _ in range(3):
        a.step()
    state = copy.deepcopy(a.state_dict())
    torch.manual_seed(5)
    b = fmap("performer", num_features=6, redraw=2).train()
    assert not torch.equal(a.omega, b.omega)
    b.load_state_dict(state)
    assert torch.equal(a.omega, b.omega)
    redraws = 0
    for _ in range(6):
        before = a.omega.clone()
        a.step()
        b.step()
        assert torch.equal(a.omega, b.omega)
        redraws += not torch.equal(before, a.omega)
    assert redraws == 3  # forwards 4, 6 and 8


def test_performer_without_redraw_never_changes_its_features():
    torch.manual_seed(6)
    fm = fmap("performer", num_features=6).train()
    omega = fm.omega.clone()
    for _ in range(5):
        fm.step()
    assert torch.equal(fm.omega, omega) and int(fm.draws) == 0


def test_a_training_forward_of_the_layer_steps_the_performer_once_and_an_eval_forward_does_not():
    torch.manual_seed(7)
    config = AttentionConfig(
        score="linear", score_params={"feature_map": "performer", "redraw": 1}, normalizer="rowsum"
    )
    mha = attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_DIM, config=config).double()
    fm = mha.score.feature_map
    x = randn(1, 4, D_MODEL, seed=15)
    mha(x)
    mha(x, mask=CAUSAL)
    mha.attend(x)
    assert int(fm.draws) == 3
    mha.eval()
    mha(x)
    assert int(fm.draws) == 3


# --------------------------------------------------------------------------------------------- the plain functions


def loop_reference(phi_q, phi_k, v, causal, normalize, eps):
    """out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / (Σ_j φ(q_i)·φ(k_j) + ε) over the keys j the row sees (j ≤ i when causal),
    written as a double loop over i and j for every (b, h)."""
    Bn, Hn, Lq, _ = phi_q.shape
    Lk = phi_k.shape[2]
    rows = []
    for b in range(Bn):
        for h in range(Hn):
            for i in range(Lq):
                num = torch.zeros(v.shape[-1], dtype=v.dtype)
                den = torch.zeros((), dtype=v.dtype)
                for j in range(Lk):
                    if causal and j > i:
                        continue
                    s = (phi_q[b, h, i] * phi_k[b, h, j]).sum()
                    num = num + s * v[b, h, j]
                    den = den + s
                rows.append(num / (den + eps) if normalize else num)
    return torch.stack(rows).reshape(Bn, Hn, Lq, v.shape[-1])


def positive_features(seed, length, f=3, d=2):
    phi_q = torch.rand(2, 2, length, f, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1
    phi_k = torch.rand(2, 2, length, f, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) + 0.1
    v = randn(2, 2, length, d, seed=seed + 2)
    return phi_q.requires_grad_(), phi_k.requires_grad_(), v.requires_grad_()


NORMALIZE = [(True, 1e-6), (True, 0.5), (False, 0.0)]
NORMALIZE_IDS = ["rowsum", "rowsum_eps0.5", "none"]


def with_ones(v, normalize=True):
    """v (…, D) with the row-sum normaliser as one more value column of ones (…, D + 1): the transition record's
    no-decay form then carries the state [S z] (what :class:`LinearForm` computes)."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if normalize else v


def divided(out, d_v, normalize, eps):
    """out[..., :D] / (out[..., D] + ε): the numerator over the normaliser column (out[..., :D] without one)."""
    return out[..., :d_v] / (out[..., d_v:] + eps) if normalize else out[..., :d_v]


@pytest.mark.parametrize(("normalize", "eps"), NORMALIZE, ids=NORMALIZE_IDS)
def test_the_recurrent_form_equals_the_causal_double_loop(normalize, eps):
    phi_q, phi_k, v = positive_features(20, 7)
    got = divided(transition.recurrent(phi_q, phi_k, with_ones(v, normalize)), v.shape[-1], normalize, eps)
    assert_same(got, loop_reference(phi_q, phi_k, v, True, normalize, eps), [phi_q, phi_k, v], atol=ATOL)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
@pytest.mark.parametrize(("normalize", "eps"), NORMALIZE, ids=NORMALIZE_IDS)
def test_the_chunked_form_equals_the_causal_double_loop_for_any_chunk_size(normalize, eps, chunk):
    phi_q, phi_k, v = positive_features(21, 7)
    out = transition.chunked(phi_q, phi_k, with_ones(v, normalize), None, chunk)
    got = divided(out, v.shape[-1], normalize, eps)
    assert_same(got, loop_reference(phi_q, phi_k, v, True, normalize, eps), [phi_q, phi_k, v], atol=ATOL)


@pytest.mark.parametrize(("normalize", "eps"), NORMALIZE, ids=NORMALIZE_IDS)
def test_the_global_function_equals_the_double_loop_over_every_key(normalize, eps):
    phi_q, _, _ = positive_features(22, 4)
    _, phi_k, v = positive_features(23, 6)  # cross: 4 queries, 6 keys
    got = linear_attention_global(phi_q, phi_k, v, normalize=normalize, eps=eps)
    assert_same(got, loop_reference(phi_q, phi_k, v, False, normalize, eps), [phi_q, phi_k, v], atol=ATOL)


# --------------------------------------------------------------------------------------------- layers


def linear_config(normalizer="rowsum", feature_map="elu", mask="causal", chunk=None, **kw):
    """A linear-attention AttentionConfig (``chunk``: the chunked backend's chunk size)."""
    params = {"feature_map": feature_map, **kw.pop("score_params", {})}
    backend_params = kw.pop("backend_params", {} if chunk is None else {"chunk_size": chunk})
    return AttentionConfig(
        score="linear", score_params=params, normalizer=normalizer, mask=mask, backend_params=backend_params, **kw
    )


def linear_mha(seed=0, dropout=0.0, **kw):
    """A float64 linear-attention layer (D_MODEL, HEADS, HEAD_DIM), every parameter drawn from N(0, 0.5²) (the
    feature map's too)."""
    torch.manual_seed(seed)
    mha = attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_DIM, dropout=dropout, config=linear_config(**kw))
    return randomize_(mha.double(), seed, scale=0.5)


def paths(mha, x, mask):
    """The layer's output on the eager (quadratic) path and on each O(L) backend that computes ``mask``."""
    prepared = prepare_mask(mask, x.shape[1], x.shape[1])
    form = "none" if prepared is None else prepared.form
    out = {"eager": mha.attend(x, mask=mask).out}
    for name in ("chunked", "recurrent", "global"):
        backend = build_backend(name)
        if backend.config_reason(mha) is None and backend.mask_reason(form) is None:
            out[name] = backend.attend(mha, x, None, mask)[0]
    return out


@pytest.mark.parametrize(("length", "chunk"), [(10, 2), (10, 3), (10, 4), (10, 64), (1, 1), (1, 64)])
@pytest.mark.parametrize("normalizer", ["rowsum", "none"])
def test_recurrent_chunked_and_quadratic_forms_agree_under_a_causal_mask(normalizer, length, chunk):
    """Chunk sizes that divide L and that do not, larger than L, and L = 1: outputs and the gradients of the input
    and of every parameter."""
    mha = linear_mha(normalizer=normalizer, chunk=chunk, seed=1)
    x = randn(2, length, D_MODEL, seed=30).requires_grad_()
    inputs = [x, *mha.parameters()]
    eager = mha.attend(x, mask=CAUSAL).out
    for name in ("chunked", "recurrent"):
        got, weights = build_backend(name).attend(mha, x, None, CAUSAL)
        assert weights is None
        assert_same(got, eager, inputs, atol=ATOL)
    forced = linear_mha(normalizer=normalizer, chunk=chunk, seed=1, backend="chunked")
    assert_same(forced(x, mask=CAUSAL)[0], eager, [x], atol=ATOL)


MAP_CASES = [
    ("elu", "rowsum", {}),
    ("relu", "none", {}),  # relu rows can see only zero similarities: un-normalised
    ("taylor", "rowsum", {}),
    ("taylor_no_projection", "rowsum", {"feature_dim": None}),
    ("performer", "rowsum", {"num_features": 8}),
    ("cosformer", "none", {}),
    ("cosformer_max_len", "none", {"max_len": 16}),
    ("hedgehog", "rowsum", {}),
    ("rebased", "rowsum", {"feature_dim": 3}),
]


@pytest.mark.parametrize(("case", "normalizer", "params"), MAP_CASES, ids=[c[0] for c in MAP_CASES])
def test_every_feature_map_gives_the_same_causal_output_on_every_path(case, normalizer, params):
    name = case.split("_")[0]
    mha = linear_mha(normalizer=normalizer, feature_map=name, chunk=3, seed=2, score_params=params)
    x = randn(2, 7, D_MODEL, seed=31).requires_grad_()
    inputs = [x, *mha.parameters()]
    eager = mha.attend(x, mask=CAUSAL).out
    for backend in ("chunked", "recurrent"):
        assert_same(build_backend(backend).attend(mha, x, None, CAUSAL)[0], eager, inputs, atol=ATOL)
    # the same weights without a mask (a layer configured causal applies its mask to a call that passes none)
    bidirectional = linear_mha(normalizer=normalizer, feature_map=name, chunk=3, seed=2, score_params=params, mask=None)
    bidirectional.load_state_dict(mha.state_dict())
    unmasked = bidirectional.attend(x).out
    inputs = [x, *bidirectional.parameters()]
    assert_same(build_backend("global").attend(bidirectional, x, None, None)[0], unmasked, inputs, atol=ATOL)


def linear_layer_reference(mha, x, visible, eps=1e-6, normalize=True):
    """The whole layer written out: projections, the short convolutions (if any), φ = elu + 1, then for every
    (b, h, i) the loop over the keys j with ``visible(b, i, j)``: Σ s_ij v_j / (Σ s_ij + ε), and the output
    projection."""
    q, k, v = (x @ lin.weight.T + lin.bias for lin in (mha.q_proj, mha.k_proj, mha.v_proj))
    if mha.short_conv is not None:
        q = conv_loop(q, mha.q_conv.conv.weight)
        k = conv_loop(k, mha.k_conv.conv.weight)
        v = conv_loop(v, mha.v_conv.conv.weight)
    Bn, Ln, _ = x.shape

    def split(t):  # (B, L, H·d) → (B, H, L, d)
        return t.reshape(Bn, Ln, HEADS, -1).transpose(1, 2)

    def phi(t):  # elu(t) + 1
        return torch.where(t > 0, t + 1, torch.exp(torch.clamp(t, max=0)))

    q, k, v = split(q), split(k), split(v)
    pq, pk = phi(q), phi(k)
    rows = []
    for b in range(Bn):
        for h in range(HEADS):
            for i in range(Ln):
                num, den = torch.zeros(v.shape[-1], dtype=x.dtype), torch.zeros((), dtype=x.dtype)
                for j in range(Ln):
                    if visible(b, i, j):
                        s = (pq[b, h, i] * pk[b, h, j]).sum()
                        num, den = num + s * v[b, h, j], den + s
                rows.append(num / (den + eps) if normalize else num)
    heads = torch.stack(rows).reshape(Bn, HEADS, Ln, -1)
    return heads.transpose(1, 2).reshape(Bn, Ln, -1) @ mha.out_proj.weight.T + mha.out_proj.bias


LAYER_CASES = {"rowsum": ("rowsum", None), "short_conv3": ("rowsum", 3), "none": ("none", None)}


@pytest.mark.parametrize(("normalizer", "short_conv"), list(LAYER_CASES.values()), ids=list(LAYER_CASES))
def test_a_causal_linear_layer_equals_its_plain_reference(normalizer, short_conv):
    mha = linear_mha(seed=3, normalizer=normalizer, short_conv=short_conv, chunk=4)
    x = randn(2, 6, D_MODEL, seed=32).requires_grad_()
    expected = linear_layer_reference(mha, x, lambda b, i, j: j <= i, normalize=normalizer == "rowsum")
    computed = paths(mha, x, CAUSAL)
    assert set(computed) == {"eager", "chunked", "recurrent"}
    for got in computed.values():
        assert_same(got, expected, [x, *mha.parameters()], atol=ATOL)
    assert_same(mha(x, mask=CAUSAL)[0], expected, [x, *mha.parameters()], atol=ATOL)


# --------------------------------------------------------------------------------------------- global, padding


def pad_mask(lengths, length):
    """(B, 1, 1, L): key j of sequence b is real iff j < lengths[b]."""
    return torch.tensor([[j < n for j in range(length)] for n in lengths])[:, None, None, :]


def test_global_equals_the_quadratic_form_without_a_mask_and_with_key_padding():
    mha = linear_mha(seed=4, mask=None)
    x = randn(3, 6, D_MODEL, seed=33).requires_grad_()
    inputs = [x, *mha.parameters()]
    keys = pad_mask([6, 4, 0], 6)  # the last sequence hides every key: its rows see nothing
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 0, 0], [0] * 6])
    prepared = build_mask("padding", pad_id=0).prepare(6, 6, tokens=tokens)
    assert prepared.form == "padding"
    for mask in (None, keys, prepared):
        with mock.patch.object(LinearForm, "bidirectional", autospec=True, side_effect=LinearForm.bidirectional) as spy:
            got, _ = mha(x, mask=mask)
        assert spy.call_count == 1
        assert_same(got, mha.attend(x, mask=mask).out, inputs, atol=ATOL)
        visible = (lambda b, i, j: True) if mask is None else (lambda b, i, j: bool(keys[b, 0, 0, j]))
        assert_same(got, linear_layer_reference(mha, x, visible), inputs, atol=ATOL)
    out, _ = mha(x, mask=keys)
    torch.testing.assert_close(out[2], mha.out_proj.bias.expand(6, D_MODEL), rtol=0, atol=0)  # sees nothing: 0


def test_global_cross_attention_with_key_padding_equals_the_quadratic_form():
    mha = linear_mha(seed=5, mask=None)
    x = randn(2, 4, D_MODEL, seed=34).requires_grad_()
    kv = randn(2, 6, D_MODEL, seed=35).requires_grad_()
    keys = pad_mask([6, 3], 6)
    inputs = [x, kv, *mha.parameters()]
    with mock.patch.object(LinearForm, "bidirectional", autospec=True, side_effect=LinearForm.bidirectional) as spy:
        got, _ = mha(x, key_value=kv, mask=keys)
    assert spy.call_count == 1
    assert_same(got, mha.attend(x, key_value=kv, mask=keys).out, inputs, atol=ATOL)


@pytest.mark.parametrize("backend", ["eager", "chunked", "recurrent"])
def test_a_row_that_sees_no_key_under_causal_and_padding_gives_zero_and_finite_gradients(backend):
    """Sequence 1 pads its first two tokens: under causal, its rows 0 and 1 see no key (0 / ε = 0, never NaN)."""
    mha = linear_mha(seed=6, chunk=2)
    x = randn(2, 6, D_MODEL, seed=36).requires_grad_()
    keys = torch.tensor([[True] * 6, [False, False, True, True, True, False]])[:, None, None, :]
    mask = CAUSAL.prepare(6, 6).with_key_padding(keys)
    assert mask.form == "causal+padding"
    out = build_backend(backend).attend(mha, x, None, mask)[0]
    torch.testing.assert_close(out[1, :2], mha.out_proj.bias.expand(2, D_MODEL), rtol=0, atol=0)
    expected = linear_layer_reference(mha, x, lambda b, i, j: j <= i and bool(keys[b, 0, 0, j]))
    assert_same(out, expected, [x, *mha.parameters()], atol=ATOL)
    gs = torch.autograd.grad(out.sum(), [x, *mha.parameters()])
    assert all(torch.isfinite(g).all() for g in gs)


def test_the_encoder_computes_causal_linear_attention_with_padding_in_chunks_as_the_eager_path():
    torch.manual_seed(8)
    options = {"score": "linear", "normalizer": "rowsum", "mask": "causal", "backend_params": {"chunk_size": 2}}
    enc = attnlab.Encoder(11, D_MODEL, HEADS, 2, pad_id=0, **options).double()
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 0, 5, 6, 0, 7, 8]])  # sequence 1: pads first, and inside
    masks = enc.build_masks(tokens)
    assert [m.form for m in masks] == ["causal+padding"] * 2
    assert enc.layers[0].self_attn.backend_for(mask="causal+padding") == "chunked"
    with mock.patch.object(LinearForm, "chunked", autospec=True, side_effect=LinearForm.chunked) as spy:
        out = enc(tokens)
    assert spy.call_count == 2  # both layers
    eager, _ = enc(tokens, need_weights=True)  # the weights: every layer on the eager path
    assert torch.isfinite(out).all()
    assert_same(out, eager, list(enc.parameters()), atol=ATOL)


# --------------------------------------------------------------------------------------------- no leak of the future


def assert_causal(fn, x):
    """d out_i / d x_j is exactly 0 for j > i (and across the batch), nonzero for j = i."""
    out = fn(x)
    for i in range(x.shape[1]):
        c = randn(out.shape[-1], seed=100 + i)
        (g,) = torch.autograd.grad((out[0, i] * c).sum(), x, retain_graph=True)
        assert (g[0, i + 1 :] == 0).all(), f"row {i} sees the future"
        assert (g[1] == 0).all(), "batch elements leak into each other"
        assert g[0, i].abs().sum() > 0


@pytest.mark.parametrize("short_conv", [None, 3], ids=["no_conv", "short_conv3"])
@pytest.mark.parametrize("path", ["eager", "chunked", "recurrent", "forward"])
def test_no_causal_linear_path_leaks_the_future(path, short_conv):
    mha = linear_mha(seed=9, chunk=3, short_conv=short_conv)
    x = randn(2, 8, D_MODEL, seed=37).requires_grad_()
    if path == "eager":
        assert_causal(lambda t: mha.attend(t, mask=CAUSAL).out, x)
    elif path == "forward":
        assert mha.backend_for() == "chunked"
        assert_causal(lambda t: mha(t, mask=CAUSAL)[0], x)
    else:
        assert_causal(lambda t: build_backend(path).attend(mha, t, None, CAUSAL)[0], x)


@pytest.mark.parametrize("need_weights", [False, True])
def test_a_softmax_layer_with_a_short_convolution_does_not_leak_the_future(need_weights):
    torch.manual_seed(10)
    mha = attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_DIM, config=AttentionConfig(mask="causal", short_conv=4))
    mha = randomize_(mha.double(), 10, scale=0.5)
    x = randn(2, 8, D_MODEL, seed=38).requires_grad_()
    assert_causal(lambda t: mha(t, mask=CAUSAL, need_weights=need_weights)[0], x)


# --------------------------------------------------------------------------------------------- refusals


REFUSED = {
    "chunked_no_mask": (
        linear_config(mask=None, backend="chunked"),
        r"chunked cannot .*: it computes mask=causal or causal\+padding only, not none$",
    ),
    "chunked_window": (
        linear_config(mask={"name": "sliding_window", "window": 3}, backend="chunked"),
        r"chunked cannot .*: it computes mask=causal or causal\+padding only, not mask=sliding_window\(window=3\)$",
    ),
    "global_causal": (
        linear_config(mask="causal", backend="global"),
        r"global cannot .*: it computes mask=none or padding only, not causal$",
    ),
    "chunked_softmax": (
        linear_config(backend="chunked", normalizer="softmax"),
        r"chunked cannot .*: it normalizes by the row sum or not at all \(normalizer=rowsum\|none\), not softmax$",
    ),
    "recurrent_taylor_softmax": (
        linear_config(backend="recurrent", feature_map="taylor", normalizer="softmax"),
        r"recurrent cannot .*: it normalizes by the row sum or not at all .*, not softmax$",
    ),
    "chunked_scaled_dot": (
        AttentionConfig(normalizer="rowsum", mask="causal", backend="chunked"),
        r"chunked cannot .*: it computes linear attention only \(variant=linear\), not scaled_dot$",
    ),
    "chunked_position_bias": (
        linear_config(position_bias="alibi", backend="chunked"),
        r"chunked cannot .*: it has no position bias$",
    ),
    "chunked_softcap": (linear_config(softcap=5.0, backend="chunked"), r"chunked cannot .*: it has no soft-capping$"),
}


@pytest.mark.parametrize(("config", "message"), list(REFUSED.values()), ids=list(REFUSED))
def test_a_forced_linear_backend_that_cannot_compute_the_layer_is_refused_in_one_line(config, message):
    with pytest.raises(ValueError, match=r"^attention\.backend=" + message) as info:
        attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_DIM, config=config)
    assert "\n" not in str(info.value)


def test_a_forced_linear_backend_called_with_a_mask_it_cannot_compute_says_why_in_one_line():
    mha = linear_mha(seed=11, backend="chunked")
    x = randn(2, 5, D_MODEL, seed=39)
    with pytest.raises(RuntimeError, match=r"^attention\.backend=chunked cannot run here: .* not padding$") as info:
        mha(x, mask=pad_mask([5, 3], 5))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^attention backend global: .* not causal; use backend=eager \(or auto\)"):
        build_backend("global").attend(mha, x, None, CAUSAL)
    dropped = linear_mha(seed=11, backend="chunked", dropout=0.1)
    with pytest.raises(RuntimeError, match=r"cannot run here: it has no dropout on the weights"):
        dropped.train()(x, mask=CAUSAL)
    dropped.eval()(x, mask=CAUSAL)  # no dropout in eval: runs


def test_unknown_backend_params_and_bad_short_conv_are_refused_in_one_line():
    typo = (
        r"^attention\.backend_params: no backend takes 'chunk_siz'; allowed: compile \(flex\), chunk_size \(chunked\)$"
    )
    with pytest.raises(ValueError, match=typo):
        attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_DIM, config=linear_config(backend_params={"chunk_siz": 3}))
    with pytest.raises(ValueError, match=r"^attention\.backend_params: no backend global takes 'chunk_size'"):
        attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_DIM, config=linear_config(mask=None, backend="global", chunk=3))
    for bad in (0, -2, 1.5, "a"):
        with pytest.raises(ValueError, match=r"^attention\.backend_params\.chunk_size must be an integer >= 1, got "):
            attnlab.MultiHeadAttention(
                D_MODEL, HEADS, HEAD_DIM, config=linear_config(backend_params={"chunk_size": bad})
            )
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match=r"^short_conv must be an integer >= 1, got ") as info:
            AttentionConfig(short_conv=bad)
        assert "\n" not in str(info.value)
    assert AttentionConfig(short_conv=0).short_conv is None  # 0: off


def test_an_unknown_feature_map_is_refused_in_one_line_with_a_suggestion():
    with pytest.raises(UnknownNameError) as info:
        attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_DIM, config=linear_config(feature_map="eluu"))
    msg = str(info.value)
    assert "\n" not in msg and "unknown feature map 'eluu'; did you mean 'elu'?" in msg
    with pytest.raises(ValueError, match=r"does not take parameter 'num_features'") as info:
        fmap("elu", num_features=3)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------- the automatic choice


def test_the_automatic_choice_takes_the_o_of_l_backend_the_mask_allows():
    causal = linear_mha(seed=12)
    assert "linear" in causal.form.tags and causal.mask_form == "causal"
    assert causal.backend_for() == "chunked"
    assert causal.backend_for(mask="causal+padding") == "chunked"
    assert causal.backend_for(mask="padding") == "global"
    assert causal.backend_for(mask="other") == "eager"
    assert causal.backend_for(need_weights=True) == "eager"
    assert causal.backend_for(training=False, grad=False) == "chunked"
    assert linear_mha(seed=12, mask=None).backend_for() == "global"
    window = {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 3}]}
    assert linear_mha(seed=12, mask=window).mask_form == "other"
    assert linear_mha(seed=12, mask=window).backend_for() == "eager"
    dropped = linear_mha(seed=12, dropout=0.1)
    assert dropped.backend_for() == "eager" and dropped.backend_for(training=False) == "chunked"
    softmax = linear_mha(seed=12, normalizer="softmax")
    assert "linear" not in softmax.form.tags and softmax.backend_for() == "eager"


def test_a_causal_call_on_a_layer_configured_without_a_mask_runs_chunked_or_eager_correctly():
    mha = linear_mha(seed=13, mask=None, chunk=3)
    x = randn(2, 7, D_MODEL, seed=40).requires_grad_()
    inputs = [x, *mha.parameters()]
    expected = mha.attend(x, mask=CAUSAL).out
    with mock.patch.object(LinearForm, "chunked", autospec=True, side_effect=LinearForm.chunked) as spy:
        got, _ = mha(x, mask=CAUSAL)  # a causal Mask: chunked
    assert spy.call_count == 1
    assert_same(got, expected, inputs, atol=ATOL)
    dense = torch.tensor([[j <= i for j in range(7)] for i in range(7)])  # a bool tensor: form "other", eager
    with mock.patch.object(LinearForm, "chunked", autospec=True, side_effect=LinearForm.chunked) as spy:
        got, _ = mha(x, mask=dense)
    assert spy.call_count == 0
    assert_same(got, expected, inputs, atol=ATOL)


# --------------------------------------------------------------------------------------------- state size


def test_state_size_of_linear_attention_is_its_recurrent_state_whatever_the_length():
    """H·(d_φ·d_v + d_φ) floats (S and z) with the row-sum normaliser, H·d_φ·d_v without."""
    for length in (1, 10, 1000):
        assert linear_mha(normalizer="rowsum").state_size(length) == HEADS * (HEAD_DIM * HEAD_DIM + HEAD_DIM)
        assert linear_mha(normalizer="none").state_size(length) == HEADS * HEAD_DIM * HEAD_DIM
    taylor = linear_mha(feature_map="taylor", score_params={"feature_dim": 3})
    d_phi = 1 + 3 + 9
    assert taylor.state_size(50) == HEADS * (d_phi * HEAD_DIM + d_phi)
    performer = linear_mha(feature_map="performer", normalizer="none", score_params={"num_features": 7})
    assert performer.state_size(50) == HEADS * 7 * HEAD_DIM


def softmax_mha(**kw):
    return attnlab.MultiHeadAttention(16, 4, 4, config=AttentionConfig(**kw))


def test_state_size_of_softmax_attention_is_its_key_value_cache():
    """L·(G·d_k + G·d_v) for a causal layer; a causal window caches the window; GQA counts G heads."""
    assert softmax_mha(mask="causal").state_size(10) == 10 * (4 * 4 + 4 * 4)
    window = {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 4}]}
    assert softmax_mha(mask=window).state_size(10) == 4 * (4 * 4 + 4 * 4)
    assert softmax_mha(mask=window).state_size(3) == 3 * (4 * 4 + 4 * 4)
    assert softmax_mha(mask="causal", num_kv_heads=2).state_size(10) == 10 * (2 * 4 + 2 * 4)
    assert softmax_mha(mask="causal", num_kv_heads=1, d_v=3).state_size(10) == 10 * (1 * 4 + 1 * 3)
    assert softmax_mha().state_size(10) == 10 * (4 * 4 + 4 * 4)  # no mask: every key


def test_a_short_convolution_adds_its_last_inputs_to_the_state():
    """(k − 1) inputs of each channel of q, k and v: (k − 1)·(H·d_k + G·d_k + G·d_v)."""
    assert softmax_mha(mask="causal", short_conv=3).state_size(10) == 10 * 32 + 2 * (16 + 16 + 16)
    assert softmax_mha(mask="causal", short_conv=3, num_kv_heads=2).state_size(10) == 10 * 16 + 2 * (16 + 8 + 8)
    linear = linear_mha(short_conv=4)
    assert linear.state_size(10) == HEADS * (HEAD_DIM**2 + HEAD_DIM) + 3 * (3 * HEADS * HEAD_DIM)
    assert softmax_mha(mask="causal", short_conv=1).state_size(10) == 10 * 32  # width 1 keeps nothing


# --------------------------------------------------------------------------------------------- short convolution


@pytest.mark.parametrize(("width", "length"), [(1, 5), (3, 6), (4, 6), (4, 2)])
def test_the_short_convolution_equals_its_causal_loop(width, length):
    conv = randomize_(ShortConvolution(5, width).double(), seed=width)
    assert conv.conv.weight.shape == (5, 1, width)
    x = randn(2, length, 5, seed=41).requires_grad_()
    assert_same(conv(x), conv_loop(x, conv.conv.weight), [x, conv.conv.weight], atol=ATOL)


def test_the_layer_puts_a_short_convolution_on_each_of_q_k_and_v():
    mha = linear_mha(seed=14, short_conv=3, num_kv_heads=1)
    assert mha.q_conv.conv.weight.shape == (HEADS * HEAD_DIM, 1, 3)
    assert mha.k_conv.conv.weight.shape == (HEAD_DIM, 1, 3) and mha.v_conv.conv.weight.shape == (HEAD_DIM, 1, 3)
    x = randn(2, 5, D_MODEL, seed=42)
    q, k, v = mha.project(x)
    ref_q = conv_loop(x @ mha.q_proj.weight.T + mha.q_proj.bias, mha.q_conv.conv.weight)
    ref_v = conv_loop(x @ mha.v_proj.weight.T + mha.v_proj.bias, mha.v_conv.conv.weight)
    torch.testing.assert_close(q, ref_q.reshape(2, 5, HEADS, HEAD_DIM).transpose(1, 2), rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(v, ref_v.reshape(2, 5, 1, HEAD_DIM).transpose(1, 2), rtol=ATOL, atol=ATOL)
    assert k.shape == (2, 1, 5, HEAD_DIM)


@pytest.mark.parametrize("normalize", [True, False])
def test_decoding_one_token_at_a_time_gives_the_chunked_outputs(normalize):
    """The recurrent step, fed one token at a time and its state carried, is the causal form: what a decoder
    computes equals what training computed."""
    phi_q, phi_k = (
        torch.rand(B, H, 9, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    )
    v = randn(B, H, 9, 4, seed=3)
    state, outs = None, []
    for t in range(9):
        out, state = transition.step(state, phi_q[:, :, t], phi_k[:, :, t], with_ones(v)[:, :, t])
        outs.append(divided(out, 4, normalize, 1e-6))
    chunked = divided(transition.chunked(phi_q, phi_k, with_ones(v), None, 4), 4, normalize, 1e-6)
    torch.testing.assert_close(torch.stack(outs, 2), chunked)
    S, z = state[..., :4], state[..., 4]  # the state [S z] after the sequence: Σ φ(k_j) v_jᵀ and Σ φ(k_j)
    torch.testing.assert_close(S, torch.einsum("bhlf,bhld->bhfd", phi_k, v))
    torch.testing.assert_close(z, phi_k.sum(2))


def test_a_configured_causal_and_padding_composition_runs_chunked_as_the_eager_path():
    """``mask: {name: and, masks: [causal, padding]}`` (padding reads the tokens) keeps its parts in the encoder,
    so the layer runs on ``chunked`` as its start line says, and equals the eager path; the dense (B, 1, L, L)
    mask is never made for it."""
    torch.manual_seed(0)
    mask = {"name": "and", "masks": ["causal", {"name": "padding", "pad_id": 5}]}
    enc = attnlab.Encoder(20, D_MODEL, HEADS, 2, attention=linear_config(mask=mask), pad_id=0).double()
    tokens = torch.randint(1, 20, (3, 9), generator=torch.Generator().manual_seed(1))
    tokens[0, 6:], tokens[1, :2], tokens[2, 3] = 0, 0, 5
    (prepared, *_) = enc.build_masks(tokens)
    assert prepared.form == "causal+padding" and "allowed" not in vars(prepared)  # nothing dense made yet
    assert enc.layers[0].self_attn.backend_for() == "chunked"
    with mock.patch.object(linear_backends.Chunked, "compute", wraps=linear_backends.Chunked().compute) as compute:
        out = enc(tokens)
    assert compute.call_count == 2 and "allowed" not in vars(prepared)
    expected, _ = enc(tokens, need_weights=True)  # the eager path, with the dense mask
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    keys = torch.ones(3, 9, dtype=torch.bool)
    keys[0, 6:], keys[1, :2], keys[2, 3] = False, False, False
    dense = torch.ones(9, 9, dtype=torch.bool).tril() & keys[:, None, None, :]
    assert torch.equal(prepared.allowed, dense)


def test_state_size_needs_no_dense_mask_and_is_zero_at_length_zero():
    window = {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 8}]}
    mha = attnlab.MultiHeadAttention(D_MODEL, HEADS, HEAD_DIM, config=AttentionConfig(mask=window))
    assert mha.state_size(0) == 0
    assert mha.state_size(1 << 20) == 8 * HEADS * 2 * HEAD_DIM  # a million tokens: the window, computed from one row
