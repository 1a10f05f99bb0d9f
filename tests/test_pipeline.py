"""The attention pipeline's stages, each against a reference written out here from its paper's formula.

Stages: grouped key/value heads (GQA / MQA), QK-norm, rotary positions (RoPE), the cosine score, a position bias on
any score, soft-capping, the normalizers and differential attention; then every stage under every mask (masked keys
get weight 0, blind rows give zero output, no NaN, no gradient from the future under a causal mask), the SDPA fast
path against the eager path, and the one name ``need_weights`` for the weights. Everything runs in float64 with
every parameter randomized (no term hides behind its initial value); outputs and gradients are compared.
"""

from __future__ import annotations

import cmath
import math
import warnings

import helpers
import pytest
import torch
from conftest import SDPACalls, assert_same, grads, randn
from conftest import randomize_ as _randomize
from helpers import POSITION_BIASES, grid, params_of

import attnlab
from attnlab.config import AttentionConfig

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-10
B, L, D_MODEL, H, D_K, D_V = 2, 6, 8, 4, 4, 3
VOCAB = 11
LN_EPS = 1e-5  # nn.LayerNorm's default
RMS_EPS = torch.finfo(torch.float64).eps  # nn.RMSNorm's default (eps=None) in float64
DIFF_NORM_EPS = 1e-5  # differential attention's sub-norm
NORMALIZERS = [name for name in helpers.NORMALIZERS if name != "softmax"]  # every registered built-in but softmax
T5_PARAMS = {"num_buckets": 8, "max_distance": 16}


# ---------------------------------------------------------------------------------------------- helpers


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter N(0, 0.5²)."""
    return _randomize(module, seed, scale=0.5)


def pipeline_mha(
    seed: int = 0, num_heads: int = H, d_k: int = D_K, d_v: int = D_V, **options
) -> attnlab.MultiHeadAttention:
    return helpers.make_mha(D_MODEL, num_heads, d_k, d_v, seed=seed, **options)


def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


def heads(layer: torch.nn.Linear, x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, L, d_model) → the projection split into n heads, (B, n, L, d)."""
    y = linear(layer, x)
    return y.reshape(y.shape[0], y.shape[1], n, -1).transpose(1, 2)


def merge(mha: attnlab.MultiHeadAttention, z: torch.Tensor) -> torch.Tensor:
    """z (B, H, L, d_v) → concat_h z_h W_O + b_O."""
    return linear(mha.out_proj, z.transpose(1, 2).reshape(z.shape[0], z.shape[2], -1))


def group_of(h: int, num_heads: int, num_kv_heads: int) -> int:
    return h // (num_heads // num_kv_heads)


def padding_tensor() -> torch.Tensor:
    """(B, 1, L, L) bool: padded keys in both sequences and one query row per sequence that sees no key."""
    m = torch.ones(B, 1, L, L, dtype=torch.bool)
    m[0, :, :, 4:] = False  # sequence 0: keys 4, 5 are padding
    m[1, :, :, :2] = False  # sequence 1: keys 0, 1 hidden
    m[0, :, 1, :] = False  # blind rows
    m[1, :, 3, :] = False
    return m


MASKS = {
    "none": lambda: None,
    "causal": lambda: attnlab.build_mask("causal"),
    "sliding_window": lambda: attnlab.build_mask("sliding_window", window=2),
    "padding_tensor": padding_tensor,
    "causal&window": lambda: attnlab.build_mask("causal") & attnlab.build_mask("sliding_window", window=2),
}


def dense(kind: str) -> torch.Tensor:
    """The mask ``kind`` as a (B, 1, L, L) bool tensor, written from the definitions."""
    if kind == "padding_tensor":
        return padding_tensor()
    pred = {
        "none": lambda i, j: True,
        "causal": lambda i, j: j <= i,
        "sliding_window": lambda i, j: abs(i - j) < 2,
        "causal&window": lambda i, j: j <= i and i - j < 2,
    }[kind]
    return grid(L, L, pred).expand(B, 1, L, L)


# ---------------------------------------------------------------------------------------------- RoPE


def rope_complex(x: torch.Tensor, base: float, rotated: int) -> torch.Tensor:
    """RoFormer with complex numbers: pair p of the vector at position m, x_{2p} + i·x_{2p+1}, times e^{i·m·θ_p} with
    θ_p = base^(−2p/d) for the first rotated/2 pairs; the other dimensions as they are. x (…, L, d)."""
    d = x.shape[-1]
    rows = []
    for m in range(x.shape[-2]):
        cols = []
        for p in range(rotated // 2):
            z = torch.complex(x[..., m, 2 * p], x[..., m, 2 * p + 1]) * cmath.exp(1j * m * base ** (-2 * p / d))
            cols += [z.real, z.imag]
        cols += [x[..., m, c] for c in range(rotated, d)]
        rows.append(torch.stack(cols, dim=-1))
    return torch.stack(rows, dim=-2)


ROPE_CASES = [  # d, base, fraction, rotated = 2·⌊fraction·d/2⌋
    (8, 10000.0, 1.0, 8),
    (8, 100.0, 0.5, 4),
    (10, 500.0, 0.6, 6),
    (6, 3.0, 0.7, 4),
]


@pytest.mark.parametrize(("d", "base", "fraction", "rotated"), ROPE_CASES)
def test_rope_matches_the_complex_formula(d, base, fraction, rotated):
    rope = attnlab.RotaryEmbedding(d, base=base, fraction=fraction)
    x = randn(2, 3, 7, d, seed=1).requires_grad_()
    out = rope(x)
    assert_same(out, rope_complex(x, base, rotated), [x])
    assert torch.equal(out[..., rotated:], x[..., rotated:])  # the unrotated dimensions are untouched


@pytest.mark.parametrize("base", [10000.0, 10.0, 2.5])
@pytest.mark.parametrize(("fraction", "rotated"), [(1.0, 8), (0.5, 4), (0.25, 2)])
def test_rope_rotates_pair_p_at_position_m_by_m_times_base_to_the_minus_2p_over_d(base, fraction, rotated):
    """R_m, read off the images of the basis vectors, is block-diagonal: a 2×2 rotation by m·base^(−2p/d) for each
    rotated pair p, the identity on the rest."""
    d, length = 8, 5
    rope = attnlab.RotaryEmbedding(d, base=base, fraction=fraction)
    basis = torch.eye(d, dtype=torch.float64)[:, None, :].expand(d, length, d)  # e_c at every position
    out = rope(basis)  # out[c, m] = R_m e_c
    for m in range(length):
        expected = torch.eye(d, dtype=torch.float64)
        for p in range(rotated // 2):
            a = m * base ** (-2 * p / d)
            expected[2 * p : 2 * p + 2, 2 * p : 2 * p + 2] = torch.tensor(
                [[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64
            )
        torch.testing.assert_close(out[:, m].T, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("d", "fraction", "rotated"),
    [
        (8, 0.25, 2),
        (10, 0.6, 6),
        (12, 0.5, 6),
        (20, 0.3, 6),
        (64, 0.75, 48),
        (100, 0.29, 28),
        (100, 0.58, 58),  # 0.58 · 100 = 57.99999999999999 in floating point
    ],
)
def test_partial_rope_rotates_2_floor_fraction_d_over_2_dims_and_leaves_the_rest_untouched(d, fraction, rotated):
    rope = attnlab.RotaryEmbedding(d, fraction=fraction)
    assert rope.rotated == rotated
    x = randn(3, 5, d, seed=2)
    out = rope(x)
    assert torch.equal(out[..., rotated:], x[..., rotated:])
    assert (out[:, 1:, :rotated] - x[:, 1:, :rotated]).abs().amax(dim=-1).gt(0).all()  # every position m ≥ 1 moves


def test_rope_angles_stay_exact_when_the_module_is_cast_to_bfloat16():
    """Casting the module changes the precision of its inputs and outputs, not θ_p: up to bf16 rounding of the
    result, the rotation at position m is by m·base^(−2p/d) even at m = 2047."""
    d, length = 64, 2048
    x = randn(1, length, d, seed=3).clamp(-3, 3)
    expected = attnlab.RotaryEmbedding(d).double()(x)
    got = attnlab.RotaryEmbedding(d).bfloat16()(x.bfloat16()).double()
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05)


def test_rope_fraction_rotating_no_pair_raises():
    with pytest.raises(ValueError, match="fraction"):
        attnlab.RotaryEmbedding(8, fraction=0.2)  # 2·⌊1.6 / 2⌋ = 0


@pytest.mark.parametrize(
    ("rope", "base", "rotated"), [(True, 10000.0, D_K), ({"base": 7.0, "fraction": 0.5}, 7.0, 2)], ids=["full", "half"]
)
def test_mha_rope_logits_match_the_complex_formula_on_the_projected_q_and_k(rope, base, rotated):
    mha = pipeline_mha(rope=rope)
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    q = rope_complex(heads(mha.q_proj, x, H), base, rotated)
    k = rope_complex(heads(mha.k_proj, x, H), base, rotated)
    logits = q @ k.transpose(-2, -1) / math.sqrt(D_K)
    w = torch.softmax(logits.masked_fill(~dense("causal"), float("-inf")), dim=-1)
    out = merge(mha, w @ heads(mha.v_proj, x, H))
    o = mha.attend(x, mask=attnlab.build_mask("causal"))
    assert_same(o.logits, logits, inputs)
    assert_same(o.out, out, inputs)
    assert_same(mha(x, mask=attnlab.build_mask("causal"))[0], out, inputs)  # the fast path too


@pytest.mark.parametrize(
    ("rope", "base", "rotated"), [(True, 10000.0, D_K), ({"base": 3.0, "fraction": 0.5}, 3.0, 2)], ids=["full", "half"]
)
def test_rope_logits_of_a_repeated_vector_depend_only_on_j_minus_i(rope, base, rotated):
    """The same q at every query position and the same k at every key position: e_ij = f(j − i) (Toeplitz), with
    f(n) = (Σ_p Re(q̃_p conj(k̃_p) e^{−i·n·θ_p}) + Σ_{c ≥ r} q_c k_c) / √d_k for the complex pairs q̃_p, k̃_p."""
    mha = pipeline_mha(rope=rope)
    lq, lk = 5, 7
    x = randn(1, 1, D_MODEL, seed=1).repeat(1, lq, 1)
    kv = randn(1, 1, D_MODEL, seed=2).repeat(1, lk, 1)
    e = mha.attend(x, key_value=kv).logits[0].detach()  # (H, lq, lk)
    q, k = heads(mha.q_proj, x[:, :1], H)[0, :, 0].detach(), heads(mha.k_proj, kv[:, :1], H)[0, :, 0].detach()

    def f(h: int, n: int) -> float:
        total = sum(float(q[h, c] * k[h, c]) for c in range(rotated, D_K))
        for p in range(rotated // 2):
            qp, kp = complex(q[h, 2 * p], q[h, 2 * p + 1]), complex(k[h, 2 * p], k[h, 2 * p + 1])
            total += (qp * kp.conjugate() * cmath.exp(-1j * n * base ** (-2 * p / D_K))).real
        return total / math.sqrt(D_K)

    expected = torch.tensor(
        [[[f(h, j - i) for j in range(lk)] for i in range(lq)] for h in range(H)], dtype=torch.float64
    )
    torch.testing.assert_close(e, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(e[:, 1:, 1:], e[:, :-1, :-1], rtol=1e-12, atol=1e-12)  # Toeplitz
    assert (e[:, 0, 1:] - e[:, 0, :1]).abs().amax() > 1e-3  # and not constant: the positions matter


# ---------------------------------------------------------------------------------------------- QK-norm


def layer_norm_ref(t: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    mean = t.mean(dim=-1, keepdim=True)
    var = ((t - mean) ** 2).mean(dim=-1, keepdim=True)  # biased
    return (t - mean) / torch.sqrt(var + LN_EPS) * norm.weight + norm.bias


def rms_norm_ref(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return t / torch.sqrt((t**2).mean(dim=-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize(
    ("qk_norm", "num_kv_heads", "rope"),
    [("layernorm", H, False), ("rmsnorm", H, False), ("layernorm", 1, True), ("rmsnorm", 2, True)],
)
def test_qk_norm_normalizes_each_head_of_q_and_k_with_its_own_learned_weights(qk_norm, num_kv_heads, rope, ref):
    """QK-norm over d_k per head (q with q_norm's weights, k with k_norm's), then RoPE, then the scaled dot."""
    mha = pipeline_mha(qk_norm=qk_norm, num_kv_heads=num_kv_heads, rope=rope or None)
    assert mha.q_norm is not mha.k_norm
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    q, k, v = heads(mha.q_proj, x, H), heads(mha.k_proj, x, num_kv_heads), heads(mha.v_proj, x, num_kv_heads)
    if qk_norm == "layernorm":
        q, k = layer_norm_ref(q, mha.q_norm), layer_norm_ref(k, mha.k_norm)
    else:
        q, k = rms_norm_ref(q, mha.q_norm.weight, RMS_EPS), rms_norm_ref(k, mha.k_norm.weight, RMS_EPS)
    if rope:
        q, k = rope_complex(q, 10000.0, D_K), rope_complex(k, 10000.0, D_K)
    group = [group_of(h, H, num_kv_heads) for h in range(H)]
    logits = q @ k[:, group].transpose(-2, -1) / math.sqrt(D_K)
    mask = padding_tensor()
    w = ref.masked_softmax(logits, mask)
    out = merge(mha, w @ v[:, group])
    o = mha.attend(x, mask=mask)
    assert_same(o.logits, logits, inputs)
    assert_same(o.out, out, inputs)
    assert_same(mha(x, mask=mask)[0], out, inputs)


# ---------------------------------------------------------------------------------------------- cosine


def test_cosine_score_is_the_capped_temperature_times_the_cosine_of_q_and_k():
    """e_hij = τ_h · q_i·k_j / (|q_i| |k_j|), τ_h = exp(min(log_scale_h, log max_scale)); a head above the cap gets
    no gradient on its log_scale."""
    max_scale = 20.0
    mha = pipeline_mha(score="cosine", max_scale=max_scale)
    with torch.no_grad():
        mha.score.log_scale.copy_(torch.tensor([math.log(50.0), math.log(3.0), -0.7, 1.3]))  # head 0 over the cap
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    q, k, v = heads(mha.q_proj, x, H), heads(mha.k_proj, x, H), heads(mha.v_proj, x, H)
    cap = torch.tensor(math.log(max_scale), dtype=torch.float64)
    vals = []
    for b in range(B):
        for h in range(H):
            tau = torch.exp(torch.minimum(mha.score.log_scale[h], cap))
            for i in range(L):
                for j in range(L):
                    qi, kj = q[b, h, i], k[b, h, j]
                    vals.append(tau * (qi @ kj) / (torch.sqrt(qi @ qi) * torch.sqrt(kj @ kj)))
    logits = torch.stack(vals).reshape(B, H, L, L)
    out = merge(mha, torch.softmax(logits, dim=-1) @ v)
    o = mha.attend(x)
    assert_same(o.logits, logits, inputs)
    assert_same(o.out, out, inputs)
    assert_same(mha(x)[0], out, inputs)
    g = grads(o.out, [mha.score.log_scale])[0]
    assert g[0] == 0 and (g[1:] != 0).all()


# ---------------------------------------------------------------------------------------------- softcap


@pytest.mark.parametrize(("score", "position_bias"), [("scaled_dot", None), ("dot", "alibi")])
def test_softcap_is_c_tanh_of_the_logits_before_the_mask(score, position_bias):
    c = 0.7
    mha = pipeline_mha(score=score, position_bias=position_bias, softcap=c)
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    q, k, v = heads(mha.q_proj, x, H), heads(mha.k_proj, x, H), heads(mha.v_proj, x, H)
    e = q @ k.transpose(-2, -1) / (math.sqrt(D_K) if score == "scaled_dot" else 1.0)
    if position_bias == "alibi":
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
        distance = torch.tensor([[abs(j - i) for j in range(L)] for i in range(L)], dtype=torch.float64)
        e = e - slopes[:, None, None] * distance  # ALiBi: −m_h |j − i|, m_h = 2^(−8h/H)
    capped = c * torch.tanh(e / c)
    w = torch.softmax(capped.masked_fill(~dense("causal"), float("-inf")), dim=-1)
    out = merge(mha, w @ v)
    o = mha.attend(x, mask=attnlab.build_mask("causal"))
    assert_same(o.logits, capped, inputs)  # every logit capped, masked ones included
    assert o.logits.abs().max() <= c
    assert_same(o.out, out, inputs)
    assert_same(mha(x, mask=attnlab.build_mask("causal"))[0], out, inputs)


# ---------------------------------------------------------------------------------------------- GQA / MQA


def test_kv_projections_have_num_kv_heads_heads_and_num_kv_heads_must_divide_num_heads():
    for num_kv_heads in (1, 2, 4):
        for differential in (False, True):
            mha = attnlab.MultiHeadAttention(D_MODEL, H, D_K, D_V, num_kv_heads=num_kv_heads, differential=differential)
            maps = 2 if differential else 1
            assert mha.q_proj.out_features == maps * H * D_K
            assert mha.k_proj.out_features == maps * num_kv_heads * D_K
            assert mha.v_proj.out_features == num_kv_heads * D_V
            assert mha.out_proj.in_features == H * D_V
    for bad in (3, 8):
        with pytest.raises(ValueError, match="num_kv_heads"):
            attnlab.MultiHeadAttention(D_MODEL, H, D_K, D_V, num_kv_heads=bad)


def repeat_kv_rows(t: torch.Tensor, num_kv_heads: int, d: int) -> torch.Tensor:
    """(G·d, …) rows of a k/v projection → (H·d, …): head h gets the rows of kv head h // (H / G)."""
    blocks = t.unflatten(0, (num_kv_heads, d))
    return blocks[[group_of(h, H, num_kv_heads) for h in range(H)]].flatten(0, 1)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding_tensor"])
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_gqa_equals_multi_head_attention_with_each_kv_head_repeated_for_its_group(num_kv_heads, mask_kind):
    G = num_kv_heads
    gqa = pipeline_mha(num_kv_heads=G)
    full = attnlab.MultiHeadAttention(D_MODEL, H, D_K, D_V).double().eval()
    with torch.no_grad():
        for name in ("q_proj", "out_proj"):
            getattr(full, name).load_state_dict(getattr(gqa, name).state_dict())
        for name, d in (("k_proj", D_K), ("v_proj", D_V)):
            getattr(full, name).weight.copy_(repeat_kv_rows(getattr(gqa, name).weight, G, d))
            getattr(full, name).bias.copy_(repeat_kv_rows(getattr(gqa, name).bias, G, d))
    mask = MASKS[mask_kind]()
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    for path in ("fast", "eager"):
        if path == "fast":
            a, b = gqa(x, mask=mask)[0], full(x, mask=mask)[0]
        else:
            (a, wa), (b, wb) = gqa(x, mask=mask, need_weights=True), full(x, mask=mask, need_weights=True)
            torch.testing.assert_close(wa, wb, rtol=ATOL, atol=ATOL)
        assert_same(a, b, [x])
        ga = dict(zip([n for n, _ in gqa.named_parameters()], grads(a, list(gqa.parameters())), strict=True))
        gb = dict(zip([n for n, _ in full.named_parameters()], grads(b, list(full.parameters())), strict=True))
        for name in ("q_proj.weight", "q_proj.bias", "out_proj.weight", "out_proj.bias"):
            torch.testing.assert_close(ga[name], gb[name], rtol=ATOL, atol=ATOL)
        for name, d in (("k_proj", D_K), ("v_proj", D_V)):
            for part in ("weight", "bias"):  # a shared kv head's gradient sums its group's
                summed = gb[f"{name}.{part}"].unflatten(0, (G, H // G, d)).sum(1).flatten(0, 1)
                torch.testing.assert_close(ga[f"{name}.{part}"], summed, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_gqa_matches_a_per_head_loop_reference(num_kv_heads, ref):
    """Query head h reads key/value head g = h // (H / G), written out with the projection rows of each head."""
    G = num_kv_heads
    mha = pipeline_mha(num_kv_heads=G)
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    mask = padding_tensor()[:, 0]
    zs, ws = [], []
    for h in range(H):
        g = group_of(h, H, G)
        rows_q, rows_k, rows_v = (
            slice(h * D_K, (h + 1) * D_K),
            slice(g * D_K, (g + 1) * D_K),
            slice(g * D_V, (g + 1) * D_V),
        )
        q = x @ mha.q_proj.weight[rows_q].T + mha.q_proj.bias[rows_q]
        k = x @ mha.k_proj.weight[rows_k].T + mha.k_proj.bias[rows_k]
        v = x @ mha.v_proj.weight[rows_v].T + mha.v_proj.bias[rows_v]
        w = ref.masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(D_K), mask)
        ws.append(w)
        zs.append(w @ v)
    out = torch.cat(zs, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias
    got, weights = mha(x, mask=padding_tensor(), need_weights=True)
    assert_same(got, out, inputs)
    torch.testing.assert_close(weights, torch.stack(ws, dim=1), rtol=ATOL, atol=ATOL)
    assert_same(mha(x, mask=padding_tensor())[0], out, inputs)


# ---------------------------------------------------------------------------------------------- position bias stage


def alibi_ref(ref, num_heads: int, lq: int, lk: int) -> torch.Tensor:
    slopes = torch.tensor(ref.alibi_slopes(num_heads), dtype=torch.float64)
    dist = torch.tensor([[abs(j - i) for j in range(lk)] for i in range(lq)], dtype=torch.float64)
    return -slopes[:, None, None] * dist  # (H, Lq, Lk)


def t5_ref(ref, rel_bias: torch.Tensor, lq: int, lk: int, bidirectional: bool = True) -> torch.Tensor:
    buckets = torch.tensor([[ref.t5_bucket(j - i, bidirectional, **T5_PARAMS) for j in range(lk)] for i in range(lq)])
    return rel_bias[buckets].permute(2, 0, 1)  # (H, Lq, Lk)


BIAS_ON = {"alibi": "additive", "shaw": "dot", "t5": "general"}  # a score under each bias (others: scaled_dot)
POSITION_BIAS_CASES = [(BIAS_ON.get(b, "scaled_dot"), b, params_of("position_bias", b)) for b in POSITION_BIASES]


@pytest.mark.parametrize(("score", "position_bias", "params"), POSITION_BIAS_CASES)
def test_position_bias_stage_adds_its_reference_bias_to_any_score(score, position_bias, params, ref):
    """Every registered position bias (with its test parameters) against a reference written here: a new one
    without a reference fails, by name."""
    mha = pipeline_mha(score=score, position_bias=position_bias, position_bias_params=params)
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    q, k, v = heads(mha.q_proj, x, H), heads(mha.k_proj, x, H), heads(mha.v_proj, x, H)
    content = ref.score_logits(score, {}, mha.score, q, k)
    if position_bias == "none":
        bias = torch.zeros(())
    elif position_bias == "alibi":
        bias = alibi_ref(ref, H, L, L)
    elif position_bias == "shaw":
        rel = mha.position_bias.rel_k[ref.rel_index(L, L, params["clip"])]  # (L, L, d_k)
        bias = torch.einsum("bhid,ijd->bhij", q, rel) / math.sqrt(D_K)
    elif position_bias == "t5":
        bias = t5_ref(ref, mha.position_bias.rel_bias, L, L)
    else:
        raise AssertionError(f"built-in position bias '{position_bias}' has no reference in this test")
    logits = content + bias
    mask = padding_tensor()
    w = ref.masked_softmax(logits, mask)
    out = merge(mha, w @ v)
    o = mha.attend(x, mask=mask)
    assert_same(o.logits, logits, inputs)
    assert_same(o.out, out, inputs)
    assert_same(mha(x, mask=mask)[0], out, inputs)


PRESET_PAIRS = [  # (score, position bias, its params spelt out) == (preset, its params)
    ("scaled_dot", "alibi", {}, "alibi", {}),
    ("scaled_dot", "shaw", {"clip": 2, "value_term": False}, "relative_position", {"clip": 2}),
    ("scaled_dot", "shaw", {"clip": 2, "value_term": True}, "relative_position", {"clip": 2, "value_term": True}),
    ("dot", "t5", {**T5_PARAMS, "bidirectional": None}, "t5_bias", T5_PARAMS),
    ("scaled_dot", "t5", {**T5_PARAMS, "bidirectional": None}, "t5_bias", {**T5_PARAMS, "scale": True}),
]


@pytest.mark.parametrize(
    ("score", "position_bias", "params", "preset", "preset_params"),
    PRESET_PAIRS,
    ids=["alibi", "shaw", "shaw_value", "t5", "t5_scaled"],
)
def test_a_preset_resolves_to_its_score_plus_position_bias_and_computes_the_same(
    score, position_bias, params, preset, preset_params
):
    """A preset is a name for a score plus a position bias: its layer has the explicit layer's resolved config,
    modules and parameters, and (given the same parameter values) the same outputs, weights and gradients, on the
    fast and the eager path."""
    staged = pipeline_mha(score=score, position_bias=position_bias, position_bias_params=params)
    from_preset = attnlab.MultiHeadAttention(D_MODEL, H, D_K, D_V, score=preset, **preset_params).double().eval()
    expected = AttentionConfig(score=score, position_bias=position_bias, position_bias_params=params, d_v=D_V)
    assert staged.config == expected
    assert from_preset.config == expected
    assert type(from_preset.score) is type(staged.score)
    assert type(from_preset.position_bias) is type(staged.position_bias)
    assert repr(from_preset) == repr(staged)
    assert list(from_preset.state_dict()) == list(staged.state_dict())
    from_preset.load_state_dict(staged.state_dict(), strict=True)
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    pairs = [[x, *staged.parameters()], [x, *from_preset.parameters()]]
    causal = attnlab.build_mask("causal")
    for a, b in (
        (staged(x, mask=causal)[0], from_preset(x, mask=causal)[0]),
        (staged.attend(x, mask=causal).out, from_preset.attend(x, mask=causal).out),
    ):
        torch.testing.assert_close(a, b, rtol=ATOL, atol=ATOL)
        for ga, gb in zip(grads(a, pairs[0]), grads(b, pairs[1]), strict=True):
            torch.testing.assert_close(ga, gb, rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(staged.attend(x).weights, from_preset.attend(x).weights, rtol=ATOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------- T5 direction


@pytest.mark.parametrize("where", ["score", "position_bias"])
@pytest.mark.parametrize(
    ("mask", "bidirectional", "expected"),
    [
        ("causal", None, False),
        ({"name": "and", "masks": ["causal", "none"]}, None, False),
        ("causal", True, True),
        (None, None, True),
        (None, False, False),
        ({"name": "sliding_window", "window": 2}, None, True),
        ({"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 2}]}, None, False),
    ],
    ids=[
        "causal",
        "causal&none",
        "causal_explicit_bidirectional",
        "no_mask",
        "no_mask_explicit_causal",
        "window",
        "causal&window",
    ],
)
def test_encoder_t5_buckets_are_one_directional_under_a_causal_mask_unless_told(
    where, mask, bidirectional, expected, ref
):
    params = dict(T5_PARAMS) if bidirectional is None else {**T5_PARAMS, "bidirectional": bidirectional}
    if where == "score":
        enc = attnlab.Encoder(
            VOCAB, D_MODEL, H, 2, score="t5_bias", score_params=params, mask=mask, pos_encoding="none"
        )
    else:
        enc = attnlab.Encoder(VOCAB, D_MODEL, H, 2, position_bias="t5", position_bias_params=params, mask=mask)
    enc.double()
    for layer in enc.layers:
        attn = layer.self_attn
        assert attn.config.position_bias == "t5"  # the preset too: its bias is the layer's position-bias stage
        module = attn.position_bias
        assert module.bidirectional is expected
        randomize_(module, seed=4)
        q = randn(1, H, L, D_K, seed=5)
        bias = module(q, L)
        torch.testing.assert_close(bias[0], t5_ref(ref, module.rel_bias, L, L, expected), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- differential


def diff_reference(ref, mha: attnlab.MultiHeadAttention, x: torch.Tensor, mask: torch.Tensor, layer: int):
    """Ye et al. 2024, written out: two softmax maps per head from the two halves (component-major: q head c·H + h,
    k head c·G + g), λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, z_h = RMSNorm((A1 − λ A2) v_g)·(1 − λ_init)
    with one RMSNorm weight for every head. Returns (out, signed weights (B, H, L, L))."""
    G = mha.num_kv_heads
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
    lam = torch.exp(mha.lambda_q1 @ mha.lambda_k1) - torch.exp(mha.lambda_q2 @ mha.lambda_k2) + lam_init  # a scalar
    q, k, v = heads(mha.q_proj, x, 2 * H), heads(mha.k_proj, x, 2 * G), heads(mha.v_proj, x, G)
    zs, ws = [], []
    for h in range(H):
        g = group_of(h, H, G)
        m = mask[:, h if mask.shape[1] > 1 else 0]  # head h's mask, for both of its maps
        a1 = ref.masked_softmax(q[:, h] @ k[:, g].transpose(-2, -1) / math.sqrt(D_K), m)
        a2 = ref.masked_softmax(q[:, H + h] @ k[:, G + g].transpose(-2, -1) / math.sqrt(D_K), m)
        w = a1 - lam * a2
        z = w @ v[:, g]
        z = z / torch.sqrt((z**2).mean(dim=-1, keepdim=True) + DIFF_NORM_EPS) * mha.sub_norm.weight
        zs.append(z * (1 - lam_init))
        ws.append(w)
    out = torch.cat(zs, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias
    return out, torch.stack(ws, dim=1)


@pytest.mark.parametrize(
    ("num_kv_heads", "layer", "mask_kind"), [(4, 1, "causal"), (2, 3, "padding_tensor"), (1, 2, "none")]
)
def test_differential_attention_matches_the_papers_formulas(num_kv_heads, layer, mask_kind, ref):
    mha = pipeline_mha(differential=True, num_kv_heads=num_kv_heads, layer=layer)
    with torch.no_grad():  # random λ vectors with λ ≈ e − 1 + λ_init > 0, so that w₁ − λ w₂ has negative entries
        u, w2 = randn(D_K, seed=7), randn(D_K, seed=8)
        mha.lambda_q1.copy_(u / u.norm() * 1.25)
        mha.lambda_k1.copy_(u / u.norm() * 0.8)
        mha.lambda_q2.copy_(w2 * 0.1)
        mha.lambda_k2.copy_(randn(D_K, seed=9) * 0.1)
    assert mha.sub_norm.weight.shape == (D_V,)  # one weight shared by the heads
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    mask = MASKS[mask_kind]()
    out, w = diff_reference(ref, mha, x, dense(mask_kind), layer)
    got, weights = mha(x, mask=mask, need_weights=True)
    assert_same(got, out, inputs)
    torch.testing.assert_close(weights, w, rtol=ATOL, atol=ATOL)
    assert (weights < 0).any()  # signed weights
    assert_same(mha(x, mask=mask)[0], out, inputs)  # the fast path


def test_differential_attention_takes_a_per_head_mask_for_both_maps_of_each_head(ref):
    mha = pipeline_mha(differential=True, num_kv_heads=2)
    mask = torch.rand(B, H, L, L, generator=torch.Generator().manual_seed(3)) < 0.6
    mask[..., 0] = True
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    out, w = diff_reference(ref, mha, x, mask, layer=1)
    got, weights = mha(x, mask=mask, need_weights=True)
    assert_same(got, out, [x, *mha.parameters()])
    torch.testing.assert_close(weights, w, rtol=ATOL, atol=ATOL)
    assert_same(mha(x, mask=mask)[0], out, [x, *mha.parameters()])


def test_differential_lambda_init_depends_on_the_layer():
    expected = {1: 0.2, 2: 0.8 - 0.6 * math.exp(-0.3), 3: 0.8 - 0.6 * math.exp(-0.6)}
    assert expected[2] == pytest.approx(0.355509, abs=1e-6) and expected[3] == pytest.approx(0.470713, abs=1e-6)
    for layer, value in expected.items():
        assert attnlab.MultiHeadAttention(D_MODEL, H, D_K, differential=True, layer=layer).lambda_init == pytest.approx(
            value, rel=1e-14
        )
    enc = attnlab.Encoder(VOCAB, D_MODEL, H, 3, differential=True)
    assert [layer.self_attn.layer for layer in enc.layers] == [1, 2, 3]
    assert [layer.self_attn.lambda_init for layer in enc.layers] == pytest.approx(list(expected.values()), rel=1e-14)


# ---------------------------------------------------------------------------------------------- every choice × mask


CHOICES = {
    "rope": {"rope": True},
    "rope_partial": {"rope": {"base": 50.0, "fraction": 0.5}},
    "qk_layernorm": {"qk_norm": "layernorm"},
    "qk_rmsnorm": {"qk_norm": "rmsnorm"},
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "differential": {"differential": True},
    "differential_sparsemax": {"differential": True, "normalizer": "sparsemax"},
    "softcap": {"softcap": 1.5},
    "cosine": {"score": "cosine"},
    "shaw_value_on_dot": {
        "score": "dot",
        "position_bias": "shaw",
        "position_bias_params": {"clip": 2, "value_term": True},
    },
    "t5_on_general": {"score": "general", "position_bias": "t5", "position_bias_params": T5_PARAMS},
    "alibi_on_additive": {"score": "additive", "position_bias": "alibi"},
    **{f"normalizer_{n}": {"normalizer": n} for n in NORMALIZERS},
    "normalizer_stickbreaking": {"normalizer": "stickbreaking", "mask": "causal"},  # causal only
    "everything": {
        "rope": True,
        "qk_norm": "rmsnorm",
        "num_kv_heads": 2,
        "differential": True,
        "position_bias": "t5",
        "position_bias_params": T5_PARAMS,
        "softcap": 3.0,
        "normalizer": "entmax15",
    },
}


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("choice", list(CHOICES))
def test_masked_keys_get_zero_weight_and_blind_rows_zero_output_without_nan_for_every_new_choice(choice, mask_kind):
    if choice == "normalizer_stickbreaking" and mask_kind not in ("causal", "causal&window"):
        pytest.skip("stick-breaking is causal: a non-causal mask is refused (tests/test_contract_findings.py)")
    mha = pipeline_mha(**CHOICES[choice])
    mask, allowed = MASKS[mask_kind](), dense(mask_kind)
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    out_w, weights = mha(x, mask=mask, need_weights=True)
    out_f, _ = mha(x, mask=mask)
    hidden = ~allowed.expand_as(weights)
    assert torch.equal(weights[hidden], torch.zeros_like(weights[hidden]))  # exactly 0
    assert weights[~hidden].ne(0).any()
    blind = ~allowed[:, 0].any(dim=-1)  # (B, L)
    assert bool(blind.any()) == (mask_kind == "padding_tensor")
    for out in (out_w, out_f):
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(g).all() for g in grads(out, inputs))
        torch.testing.assert_close(
            out[blind], mha.out_proj.bias.expand(int(blind.sum()), D_MODEL), rtol=ATOL, atol=ATOL
        )  # z = 0: the output is out_proj's bias
    torch.testing.assert_close(out_f, out_w, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("mask_kind", ["causal", "causal&window"])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_causal_mask_blocks_future_gradients_for_every_new_choice(choice, mask_kind):
    """d out_i / d x_j = 0 exactly for every j > i, on the fast path and the eager one; and ≠ 0 for j = i (but for
    stick-breaking's first row, which leaves its own key out and so sees no key: Tan et al. 2025's convention)."""
    mha = pipeline_mha(**CHOICES[choice])
    mask = MASKS[mask_kind]()
    x = randn(1, L, D_MODEL, seed=1).requires_grad_()
    first_blind = choice == "normalizer_stickbreaking"
    for out in (mha(x, mask=mask)[0], mha.attend(x, mask=mask).out):
        for i in range(L):
            (g,) = torch.autograd.grad(out[0, i], x, grad_outputs=randn(D_MODEL, seed=i), retain_graph=True)
            assert torch.equal(g[0, i + 1 :], torch.zeros_like(g[0, i + 1 :])), f"row {i} reads the future"
            assert (g[0, i].abs().sum() > 0) is not (first_blind and i == 0)


# ---------------------------------------------------------------------------------------------- fast path


class LearnedSlopeScore(attnlab.DotProductScore):
    """q·k/√d_k − s_h·|j − i| with a learned slope s_h per head: a dot-product score with its own additive term."""

    def __init__(self, d_k: int, num_heads: int) -> None:
        super().__init__(d_k, num_heads, scale=d_k**-0.5)
        self.slope = torch.nn.Parameter(torch.rand(num_heads))

    def bias(self, q: torch.Tensor, num_keys: int) -> torch.Tensor:
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(num_keys)[None, :]
        return -self.slope.to(q.dtype)[:, None, None] * (j - i).abs().to(q.dtype)  # (H, Lq, Lk)


FAST_CHOICES = {
    **{
        name: CHOICES[name]
        for name in ("rope", "rope_partial", "qk_layernorm", "qk_rmsnorm", "gqa", "mqa", "cosine", "differential")
    },
    "differential_gqa": {"differential": True, "num_kv_heads": 2},
    "shaw_on_dot": {"score": "dot", "position_bias": "shaw", "position_bias_params": {"clip": 2}},
    "t5_on_general": CHOICES["t5_on_general"],
    "alibi_on_scaled_dot": {"position_bias": "alibi"},
    "alibi_on_cosine_mqa": {"score": "cosine", "position_bias": "alibi", "num_kv_heads": 1},
    # a score with an additive term of its own plus a position-bias stage: the two terms summed into one bias
    # (a preset plus a stage, e.g. alibi + t5, is refused since presets are a score plus their bias)
    "t5_on_a_biased_score": {
        "score": lambda: LearnedSlopeScore(D_K, H),
        "position_bias": "t5",
        "position_bias_params": T5_PARAMS,
    },
    "rope+qk_norm+gqa+diff": {"rope": True, "qk_norm": "rmsnorm", "num_kv_heads": 2, "differential": True},
    "softmax1": CHOICES["normalizer_softmax1"],  # one extra key carries the sink logit
    "sink_gqa_alibi": {"normalizer": "sink", "num_kv_heads": 2, "position_bias": "alibi"},
    "sink_diff_rope": {"normalizer": "sink", "differential": True, "rope": True},
    "rope+layernorm+mqa+cosine+diff+t5": {
        "rope": {"fraction": 0.5},
        "qk_norm": "layernorm",
        "num_kv_heads": 1,
        "score": "cosine",
        "differential": True,
        "position_bias": "t5",
        "position_bias_params": T5_PARAMS,
    },
}


@pytest.mark.usefixtures("without_tiled")  # (the tiled kernel takes the biased ones first: tests/test_tiled.py)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding_tensor"])
@pytest.mark.parametrize("choice", list(FAST_CHOICES))
def test_fast_path_calls_sdpa_and_equals_the_eager_path(choice, mask_kind):
    mha = pipeline_mha(**{k: v() if callable(v) else v for k, v in FAST_CHOICES[choice].items()})
    assert mha.uses_fast_path
    mask = MASKS[mask_kind]()
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    with SDPACalls() as spy:
        fast, no_weights = mha(x, mask=mask)
    assert no_weights is None
    calls = spy.kwargs
    per_map = mha.differential and calls[0].get("kernel") != "relative"  # SDPA, biased_softmax: a call per map
    assert len(calls) == (2 if per_map else 1)
    for call in calls:
        if call.get("kernel") is None:  # SDPA; the fused relative kernel and biased_softmax take the heads expanded
            assert call["enable_gqa"] is (mha.num_kv_heads < mha.num_heads)
    with SDPACalls() as spy:
        eager, _ = mha(x, mask=mask, need_weights=True)
    assert spy.kwargs == []  # the weights come from the eager path
    assert_same(fast, eager, [x, *mha.parameters()])
    assert_same(fast, mha.attend(x, mask=mask).out, [x, *mha.parameters()])


NOT_FAST = {
    "softcap": {"softcap": 2.0},
    "softcap_rope_gqa": {"softcap": 2.0, "rope": True, "num_kv_heads": 2},
    **{f"normalizer_{n}": {"normalizer": n} for n in NORMALIZERS if n not in ("softmax1", "sink")},
    "normalizer_stickbreaking": {"normalizer": "stickbreaking", "mask": "causal"},  # causal only
    "differential_softpick": {"differential": True, "normalizer": "softpick"},
    "alibi_on_additive": {"score": "additive", "position_bias": "alibi"},
    "shaw_value_on_dot": {
        "score": "dot",
        "position_bias": "shaw",
        "position_bias_params": {"clip": 2, "value_term": True},
    },
}


@pytest.mark.parametrize("choice", list(NOT_FAST))
def test_softcap_and_non_softmax_normalizers_do_not_call_sdpa(choice):
    mha = pipeline_mha(**NOT_FAST[choice])
    assert not mha.uses_fast_path
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    with SDPACalls() as spy:
        out, _ = mha(x, mask=attnlab.build_mask("causal"))
    assert spy.kwargs == []
    assert_same(out, mha.attend(x, mask=attnlab.build_mask("causal")).out, [x, *mha.parameters()])


# ---------------------------------------------------------------------------------------------- need_weights


def test_encoder_need_weights_returns_per_layer_records_and_return_attention_is_deprecated():
    enc = randomize_(attnlab.Encoder(VOCAB, D_MODEL, H, 2, mask="causal", num_kv_heads=2).double().eval())
    tokens = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(0))
    plain = enc(tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new name warns about nothing
        h, records = enc(tokens, need_weights=True)
    torch.testing.assert_close(h, plain, rtol=ATOL, atol=ATOL)
    assert len(records) == 2 and all(isinstance(r, attnlab.AttentionOutput) for r in records)
    assert all(r.weights.shape == (B, H, L, L) and r.logits.shape == (B, H, L, L) for r in records)
    assert all(
        torch.equal(
            r.weights[..., ~grid(L, L, lambda i, j: j <= i)], torch.zeros(B, H, L * (L - 1) // 2, dtype=torch.float64)
        )
        for r in records
    )
    with pytest.warns(DeprecationWarning, match="need_weights"):
        h_old, records_old = enc(tokens, return_attention=True)
    torch.testing.assert_close(h_old, h, rtol=0, atol=0)
    for new, old in zip(records, records_old, strict=True):
        torch.testing.assert_close(old.weights, new.weights, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="need_weights"):
        only_h = enc(tokens, return_attention=False)
    torch.testing.assert_close(only_h, plain, rtol=0, atol=0)


def test_encoder_layer_need_attention_is_the_deprecated_name_of_need_weights():
    layer = randomize_(attnlab.EncoderLayer(D_MODEL, H, differential=True).double().eval())
    x = randn(B, L, D_MODEL, seed=1)
    y, record = layer(x, need_weights=True)
    y_plain, none = layer(x)
    assert none is None and isinstance(record, attnlab.AttentionOutput)
    torch.testing.assert_close(y, y_plain, rtol=ATOL, atol=ATOL)
    with pytest.warns(DeprecationWarning, match="need_weights"):
        y_old, record_old = layer(x, need_attention=True)
    torch.testing.assert_close(y_old, y, rtol=0, atol=0)
    torch.testing.assert_close(record_old.weights, record.weights, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="need_weights"):
        assert layer(x, need_attention=False)[1] is None
