"""Multi-head latent attention (``score=mla``, :mod:`attnlab.forms.mla`; DeepSeek-V2 §2.1.2-2.1.3): the layer against
DeepSeek-V2's equations written out here (its own RMSNorm, its own rotary loop over pairs, one head at a time,
only the layer's parameter tensors), values and gradients, through the eager and the sdpa backends, with and without
a query latent and a decoupled rotary key; masks (a row that sees nothing, causality, key padding); the weights it
reports; decoding from the latent cache (what the forward gives, kv_rank + rope_dim floats per token, the absorbed
query's logits); the layer options it refuses in one line; Kimi Linear's 3:1 KDA:MLA hybrid; and the command line.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import linear, masked_softmax
from helpers import randomize_, run_train

from attnlab.attention import MultiHeadAttention
from attnlab.config import AttentionConfig, default_layer_kinds, layer_configs
from attnlab.decode import decode, encoder_step, init_cache
from attnlab.encoder import Encoder
from attnlab.forms.mla import LatentCache, MultiHeadLatentAttention
from attnlab.masks import build_mask

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: threads only add overhead on a busy machine

D_MODEL, H, D_K = 12, 2, 6
BASE = 10000.0
EPS = 1e-6

# (id, score_params, d_v): the query through its own latent or not, no rotary key, the defaults, a value size of its own
PARAM_SETS = [
    ("direct_q_rope4", {"kv_rank": 5, "rope_dim": 4}, None),
    ("q_rank7_rope4", {"kv_rank": 5, "q_rank": 7, "rope_dim": 4}, None),
    ("direct_q_rope0", {"kv_rank": 5, "rope_dim": 0}, None),
    ("q_rank7_rope0_dv5", {"kv_rank": 5, "q_rank": 7, "rope_dim": 0}, 5),
    ("defaults", {}, None),
    ("q_rank3_rope2_dv4", {"kv_rank": 3, "q_rank": 3, "rope_dim": 2}, 4),
]
PARAM_IDS = [p[0] for p in PARAM_SETS]


# ---------------------------------------------------------------------------------------------- the reference


def rms_norm(x, weight, eps=EPS):
    """x / √(mean(x²) + eps) ⊙ weight over the last dimension."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rope(x, base=BASE):
    """RoFormer's rotary positions written out: x (…, L, r), pair (x_2i, x_2i+1) at position m turned by m·θ_i,
    θ_i = base^(−2i/r), positions 0 … L − 1."""
    L, r = x.shape[-2], x.shape[-1]
    m = torch.arange(L, dtype=torch.float64)
    columns = []
    for i in range(r // 2):
        angle = m * base ** (-2.0 * i / r)  # (L,)
        cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        x0, x1 = x[..., 2 * i : 2 * i + 1], x[..., 2 * i + 1 : 2 * i + 2]
        columns += [x0 * cos - x1 * sin, x0 * sin + x1 * cos]
    return torch.cat(columns, dim=-1) if columns else x


def mla_reference(layer, x, visible=None, scale=None, base=BASE):
    """DeepSeek-V2's eqs. 9-18 head by head from the layer's parameter tensors: x (B, L, d_model), ``visible`` bool
    broadcastable to (B, H, L, L) or None → (out (B, L, d_model), weights (B, H, L, L)). Each head's query and key
    have the layer's d_k = d_h + rope_dim dimensions ([content ; rotary]). ``scale`` replaces 1/√d_k (to show that a
    wrong one is caught); ``base`` the rotary base."""
    f = layer.form
    B, L, _ = x.shape
    d_k, r, d_v, kv_rank = layer.d_k, f.rope_dim, layer.d_v, f.kv_rank
    d_h = d_k - r
    if f.q_rank is None:
        q = linear(f.q_proj, x)  # h W^Q
    else:
        q = rms_norm(linear(f.q_down, x), f.q_latent_norm.weight) @ f.q_up.weight.T  # c^Q W^UQ
    q = q.view(B, L, layer.num_heads, d_h + r)
    kv = linear(f.kv_down, x)  # [c ; k̂] = h W^DKV
    c = rms_norm(kv[..., :kv_rank], f.kv_norm.weight)  # (B, L, kv_rank)
    k_rope = rope(kv[..., kv_rank:], base)  # (B, L, r): one for every head
    scale = 1 / math.sqrt(d_k) if scale is None else scale
    if visible is None:
        visible = torch.ones(L, L, dtype=torch.bool)
    zs, weights = [], []
    for i in range(layer.num_heads):
        q_c, q_r = q[:, :, i, :d_h], rope(q[:, :, i, d_h:], base)
        k_c = c @ f.k_up.weight[i * d_h : (i + 1) * d_h].T  # W^UK_i c_j (B, L, d_h)
        v = c @ f.v_up.weight[i * d_v : (i + 1) * d_v].T  # W^UV_i c_j (B, L, d_v)
        logits = (q_c @ k_c.transpose(1, 2) + q_r @ k_rope.transpose(1, 2)) * scale  # [q^C; q^R]·[k^C; k^R]
        vis = visible.expand(B, layer.num_heads, L, L)[:, i]
        w = masked_softmax(logits, vis)  # (B, L, L)
        weights.append(w)
        zs.append(w @ v)
    return linear(layer.out_proj, torch.cat(zs, dim=-1)), torch.stack(weights, dim=1)


def mla_layer(params, d_v=None, mask=None, backend="auto", seed=0, **options):
    cfg = AttentionConfig(score="mla", score_params=dict(params), mask=mask, backend=backend, **options)
    torch.manual_seed(seed)
    layer = MultiHeadAttention(D_MODEL, H, D_K, d_v=d_v, config=cfg).double().eval()
    return randomize_(layer, seed, scale=0.5)


def given_mask(mask):
    """The mask a layer is called with: a layer applies the mask it is given (its config's mask is what the encoder
    builds for it, and what decoding checks)."""
    return None if mask is None else build_mask(mask)


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def checked_parameters(layer):
    f = layer.form
    q = f.q_proj.weight if f.q_rank is None else f.q_up.weight
    extra = [f.q_down.weight, f.q_latent_norm.weight] if f.q_rank is not None else []
    return [f.kv_down.weight, f.kv_down.bias, f.kv_norm.weight, f.k_up.weight, f.v_up.weight, q, *extra,
            layer.out_proj.weight]  # fmt: skip


def assert_values_and_gradients(out, expected, inputs, atol=1e-10):
    torch.testing.assert_close(out, expected, rtol=atol, atol=atol)
    cot = rand(*out.shape, seed=99)
    got = torch.autograd.grad(out, inputs, cot, retain_graph=True)
    want = torch.autograd.grad(expected, inputs, cot, retain_graph=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=atol, atol=atol)


# ---------------------------------------------------------------------------------------------- the equations


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("mask", [None, "causal"], ids=["no_mask", "causal"])
@pytest.mark.parametrize(("params", "d_v"), [p[1:] for p in PARAM_SETS], ids=PARAM_IDS)
def test_mla_matches_the_papers_equations(params, d_v, mask, backend):
    layer = mla_layer(params, d_v, mask=mask, backend=backend)
    x = rand(2, 5, D_MODEL).requires_grad_(True)
    out, _ = layer(x, mask=given_mask(mask))
    visible = None if mask is None else torch.ones(5, 5, dtype=torch.bool).tril()
    expected, _ = mla_reference(layer, x, visible)
    assert_values_and_gradients(out, expected, [x, *checked_parameters(layer)])


def test_the_equations_test_would_catch_a_scale_of_one_over_root_d_k():
    """The reference with the scale 1/√d_h (the content part only) differs from the layer: the test above can
    fail."""
    layer = mla_layer({"kv_rank": 5, "rope_dim": 4})
    x = rand(2, 5, D_MODEL)
    wrong, _ = mla_reference(layer, x, scale=1 / math.sqrt(D_K - 4))
    assert not torch.allclose(layer(x)[0], wrong, atol=1e-6)
    unrotated = layer.form.rotary
    layer.form.rotary = None  # (no rotation of q^R and k̂: the positions are lost)
    try:
        assert not torch.allclose(layer(x)[0], mla_reference(layer, x)[0], atol=1e-6)
    finally:
        layer.form.rotary = unrotated


def test_rope_base_sets_the_decoupled_rotary_base_and_the_content_parts_stay_unrotated():
    """``variant.params.rope_base`` sets the base of the decoupled rotary key and query; the layer itself applies no
    rotary positions (they would turn the content parts), and its own rotary knob is refused (issue 60: ``rope={}``
    was taken and changed nothing)."""
    layer = mla_layer({"kv_rank": 5, "rope_dim": 4, "rope_base": 100.0})
    assert layer.rope is None and layer.form.rotary.base == 100.0
    x = rand(2, 6, D_MODEL).requires_grad_(True)
    out, _ = layer(x)
    expected, _ = mla_reference(layer, x, base=100.0)
    assert_values_and_gradients(out, expected, [x, *checked_parameters(layer)])
    assert not torch.allclose(out, mla_reference(layer, x)[0], atol=1e-6)
    with pytest.raises(ValueError, match=r"variant mla does not compute model\.pos_encoding=rope"):
        Encoder(30, D_MODEL, H, 1, d_k=D_K, pos_encoding="rope", rope={"base": 100.0}, score="mla")


def test_the_form_owns_the_latent_projections_at_the_documented_sizes_and_defaults():
    layer = mla_layer({"kv_rank": 5, "q_rank": 7, "rope_dim": 4}, d_v=3)
    f = layer.form
    assert isinstance(f, MultiHeadLatentAttention)
    assert f.kv_down.weight.shape == (5 + 4, D_MODEL) and f.kv_down.bias is not None
    assert f.k_up.weight.shape == (H * (D_K - 4), 5) and f.k_up.bias is None  # d_h = d_k − rope_dim
    assert f.v_up.weight.shape == (H * 3, 5) and f.v_up.bias is None
    assert f.q_down.weight.shape == (7, D_MODEL) and f.q_up.weight.shape == (H * D_K, 7) and f.q_up.bias is None
    assert f.kv_norm.eps == f.q_latent_norm.eps == 1e-6
    assert f.rotary.dim == 4 and f.rotary.base == BASE
    assert not {"q_proj", "k_proj", "v_proj"} & set(layer._modules)  # the form projects
    defaults = mla_layer({}).form
    rope_dim = D_K // 6 * 2  # d_k / 3 rounded down to even
    assert (defaults.kv_rank, defaults.q_rank, defaults.rope_dim) == (4 * (D_K - rope_dim), None, rope_dim)
    assert defaults.q_proj.weight.shape == (H * D_K, D_MODEL)


# ---------------------------------------------------------------------------------------------- masks and weights


def test_a_row_that_sees_no_key_gives_zeros_not_nan():
    layer = mla_layer({"kv_rank": 5, "rope_dim": 4})
    x = rand(2, 4, D_MODEL).requires_grad_(True)
    visible = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    visible[0, 0, 2] = False  # row 2 of sequence 0 sees nothing
    o = layer.attend(x, mask=visible)
    assert torch.isfinite(o.out).all() and torch.isfinite(o.weights).all()
    assert (o.weights[0, :, 2] == 0).all()
    torch.testing.assert_close(o.out[0, 2], layer.out_proj.bias.detach().expand(D_MODEL), rtol=0, atol=1e-12)
    o.out.sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())
    expected, weights = mla_reference(layer, x, visible)
    torch.testing.assert_close(o.out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o.weights, weights, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize(("params", "d_v"), [p[1:] for p in PARAM_SETS[:3]], ids=PARAM_IDS[:3])
def test_under_a_causal_mask_no_output_depends_on_a_later_input(params, d_v, backend):
    layer = mla_layer(params, d_v, mask="causal", backend=backend)
    L = 5
    x = rand(1, L, D_MODEL)
    causal = build_mask("causal")
    jac = torch.autograd.functional.jacobian(lambda t: layer(t, mask=causal)[0], x)[0, :, :, 0]  # (L, d, L, d)
    for i in range(L):
        for j in range(L):
            block = jac[i, :, j]
            if j > i:
                assert (block == 0).all(), (i, j)
            else:
                assert block.abs().max() > 1e-8, (i, j)  # earlier tokens do reach it


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_changing_padded_tokens_does_not_change_the_other_rows(backend):
    layer = mla_layer({"kv_rank": 5, "q_rank": 7, "rope_dim": 4}, backend=backend)
    L = 6
    keys = torch.ones(2, 1, 1, L, dtype=torch.bool)
    keys[0, ..., 4:] = False  # sequence 0: its last two tokens are padding
    keys[1, ..., 1] = False  # sequence 1: token 1 is
    x = rand(2, L, D_MODEL)
    y = x.clone()
    y[0, 4:] = rand(2, D_MODEL, seed=5)
    y[1, 1] = rand(D_MODEL, seed=6)
    a, b = layer(x, mask=keys)[0], layer(y, mask=keys)[0]
    real = keys[:, 0, 0]  # (B, L)
    torch.testing.assert_close(a[real], b[real], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[~real], b[~real])  # a padded query still reads its own input
    expected, _ = mla_reference(layer, x, keys)
    torch.testing.assert_close(a, expected, rtol=1e-10, atol=1e-10)


def test_an_encoders_pad_id_hides_the_padding_from_the_other_tokens():
    """With pad_id (no causal mask), the real tokens of a padded batch give what the unpadded sequence gives."""
    cfg = AttentionConfig(score="mla", score_params={"kv_rank": 5, "rope_dim": 4})
    torch.manual_seed(0)
    encoder = randomize_(Encoder(20, D_MODEL, H, 2, pad_id=0, pos_encoding="none", attention=cfg).double().eval())
    tokens = torch.tensor([[3, 7, 5, 9, 0, 0]])
    with torch.no_grad():
        padded, alone = encoder(tokens), encoder(tokens[:, :4])
    torch.testing.assert_close(padded[:, :4], alone, rtol=1e-10, atol=1e-10)
    other = torch.tensor([[3, 7, 5, 9, 4, 4]])  # the same tokens, no padding: the last two now count
    with torch.no_grad():
        assert not torch.allclose(encoder(other)[:, :4], alone)


@pytest.mark.parametrize("mask", [None, "causal"], ids=["no_mask", "causal"])
def test_the_weights_are_the_reference_softmax_and_sum_to_one_over_visible_keys(mask):
    layer = mla_layer({"kv_rank": 5, "rope_dim": 4}, mask=mask)
    x = rand(2, 5, D_MODEL)
    o = layer.attend(x, mask=given_mask(mask))
    visible = torch.ones(5, 5, dtype=torch.bool)
    if mask == "causal":
        visible = visible.tril()
    _, expected = mla_reference(layer, x, visible)
    assert o.weights.shape == (2, H, 5, 5)
    torch.testing.assert_close(o.weights, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o.weights.sum(-1), torch.ones(2, H, 5, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (o.weights[..., ~visible] == 0).all()


# ---------------------------------------------------------------------------------------------- decoding


def mla_encoder(params, d_v=None, layers=2):
    cfg = AttentionConfig(score="mla", score_params=dict(params), mask="causal", d_v=d_v)
    torch.manual_seed(0)
    encoder = Encoder(30, D_MODEL, H, layers, d_k=D_K, pos_encoding="none", attention=cfg).double().eval()
    return randomize_(encoder, 0, scale=0.5)


@pytest.mark.parametrize(("params", "d_v"), [p[1:] for p in PARAM_SETS], ids=PARAM_IDS)
def test_decoding_from_the_latent_cache_gives_the_forward(params, d_v):
    encoder = mla_encoder(params, d_v)
    tokens = torch.randint(0, 30, (3, 19), generator=torch.Generator().manual_seed(1))  # past the cache's first 16
    with torch.no_grad():
        torch.testing.assert_close(decode(encoder, tokens), encoder(tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "options",
    [
        {"output_gate": "elementwise"},
        {"output_gate": "headwise", "softcap": 2.0},
        {"normalizer": "softmax1"},
        {"mask": {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 3}]}},
    ],
    ids=["elementwise_gate", "headwise_gate_softcap", "softmax1", "causal_window3"],
)
def test_decoding_gives_the_forward_with_a_gate_a_softcap_a_sink_or_a_window(options):
    cfg = AttentionConfig(score="mla", score_params={"kv_rank": 5, "rope_dim": 4}, **{"mask": "causal", **options})
    torch.manual_seed(0)
    encoder = Encoder(30, D_MODEL, H, 2, d_k=D_K, pos_encoding="none", attention=cfg).double().eval()
    randomize_(encoder, 0, scale=0.5)
    tokens = torch.randint(0, 30, (2, 18), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(decode(encoder, tokens), encoder(tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("params", "d_v"), [p[1:] for p in PARAM_SETS], ids=PARAM_IDS)
def test_the_cache_holds_kv_rank_plus_rope_dim_floats_per_token(params, d_v, dtype):
    encoder = mla_encoder(params, d_v).to(dtype)
    form = encoder.layers[0].self_attn.form
    per_token = form.kv_rank + form.rope_dim
    B, cache = 3, init_cache(encoder)
    with torch.no_grad():
        for t in range(1, 21):
            encoder_step(encoder, torch.tensor([t % 30, (t + 3) % 30, (t + 7) % 30]), cache)
            for layer, c in zip(encoder.layers, cache, strict=True):
                assert isinstance(c.state, LatentCache) and c.state.length == t
                assert c.state.latent.shape[-1] == per_token and c.state.latent.dtype == dtype
                assert c.nbytes() / (B * t) == per_token * (8 if dtype == torch.float64 else 4)
                assert layer.self_attn.state_size(t) == t * per_token
    assert encoder.layers[0].self_attn.state_size(0) == 0


@pytest.mark.parametrize(("params", "d_v"), [p[1:] for p in PARAM_SETS], ids=PARAM_IDS)
def test_the_absorbed_query_against_the_latent_key_gives_the_expanded_logits(params, d_v):
    layer = mla_layer(params, d_v, mask="causal")
    f = layer.form
    x = rand(2, 5, D_MODEL)
    with torch.no_grad():
        q, k, v = f.project(x, x, 0, decoding=False)
        q_abs, latent, c = f.project(x, x, 0, decoding=True)
    assert q_abs.shape == (2, H, 5, f.kv_rank + f.rope_dim) and latent.shape == (2, 1, 5, f.kv_rank + f.rope_dim)
    torch.testing.assert_close(q_abs @ latent.transpose(-1, -2), q @ k.transpose(-1, -2), rtol=1e-10, atol=1e-10)
    # each piece on its own, from the equations: q̃ = [W^UK_iᵀ q^C_i ; RoPE(q^R_i)], latent = [c ; RoPE(k̂)]
    q_full = (
        linear(f.q_proj, x)
        if f.q_rank is None
        else rms_norm(linear(f.q_down, x), f.q_latent_norm.weight) @ (f.q_up.weight.T)
    )
    q_full = q_full.view(2, 5, H, D_K).transpose(1, 2).detach()
    kv = linear(f.kv_down, x).detach()
    c_ref = rms_norm(kv[..., : f.kv_rank], f.kv_norm.weight.detach())
    d_h = D_K - f.rope_dim
    for i in range(H):
        w_uk = f.k_up.weight[i * d_h : (i + 1) * d_h].detach()  # (d_h, kv_rank)
        want = torch.cat([q_full[:, i, :, :d_h] @ w_uk, rope(q_full[:, i, :, d_h:])], dim=-1)
        torch.testing.assert_close(q_abs[:, i], want, rtol=1e-10, atol=1e-10)
        w_uv = f.v_up.weight[i * layer.d_v : (i + 1) * layer.d_v].detach()
        torch.testing.assert_close(v[:, i], c_ref @ w_uv.T, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(latent[:, 0], torch.cat([c_ref, rope(kv[..., f.kv_rank :])], -1), rtol=1e-10, atol=0)
    torch.testing.assert_close(c[:, 0], c_ref, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"score_params": {"kvrank": 8}}, r"^variant mla has no parameter 'kvrank'; parameters: kv_rank, q_rank, "),
        ({"score_params": {"rope_dim": 3}}, r"^rope_dim must be even .*got 3$"),
        ({"score_params": {"rope_dim": 6}}, r"^rope_dim must be below d_k=6 .*got 6$"),
        ({"qk_norm": "rmsnorm"}, r"^variant mla does not compute qk_norm=rmsnorm: it projects .* one latent"),
        ({"short_conv": 4}, r"^variant mla does not compute model\.short_conv=4: it projects"),
        ({"num_kv_heads": 1}, r"^variant mla does not compute num_kv_heads=1: its heads share one latent"),
        ({"differential": True}, r"^variant mla does not compute model\.differential=true: "),
        ({"rope": {}}, r"^variant mla does not compute model\.pos_encoding=rope: .*variant\.params\.rope_base"),
    ],
    ids=[
        "unknown_param",
        "odd_rope_dim",
        "rope_dim_of_all_d_k",
        "qk_norm",
        "short_conv",
        "num_kv_heads",
        "differential",
        "rope",
    ],
)
def test_what_a_latent_projection_does_not_take_is_refused_in_one_line(changes, match):
    cfg = AttentionConfig(**{"score": "mla", "score_params": {}, **changes})
    with pytest.raises(ValueError, match=match) as err:
        MultiHeadAttention(D_MODEL, H, D_K, config=cfg)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- Kimi Linear's hybrid


def test_a_kda_mla_3_to_1_hybrid_trains_and_decodes_as_it_runs_forward():
    assert default_layer_kinds()["M"]["score"] == "mla"
    base = AttentionConfig(score="kda", normalizer="none", mask="causal", short_conv=4)
    configs = layer_configs(base, 4, pattern="GGGM")
    assert [c.score for c in configs] == ["kda", "kda", "kda", "mla"]
    assert configs[3].short_conv is None and configs[3].normalizer == "softmax" and configs[3].mask == "causal"
    torch.manual_seed(0)
    encoder = Encoder(30, D_MODEL, H, 4, d_k=D_K, pos_encoding="none", attention=configs).double()
    forms = [type(layer.self_attn.form).__name__ for layer in encoder.layers]
    assert forms[3] == "MultiHeadLatentAttention" and "MultiHeadLatentAttention" not in forms[:3]
    tokens = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(2))
    h = encoder(tokens)
    assert torch.isfinite(h).all()
    (h * rand(*h.shape, seed=3)).sum().backward()
    mla = encoder.layers[3].self_attn
    for p in [mla.form.kv_down.weight, mla.form.k_up.weight, mla.form.v_up.weight, mla.form.q_proj.weight]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0
    assert encoder.layers[0].self_attn.q_proj.weight.grad.abs().max() > 0
    encoder.eval()
    with torch.no_grad():
        torch.testing.assert_close(decode(encoder, tokens), encoder(tokens), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------- the command line


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [["variant=mla"], ["variant=kda", "num_layers=4", "model.pattern=GGGM"]],
    ids=["mla", "kda_gggm"],
)
def test_the_command_line_trains_mla_and_the_kda_mla_hybrid(tmp_path, overrides):
    run_train(*overrides, "debug=fast", "logger=none", f"hydra.run.dir={tmp_path}", returncode=0)


@pytest.mark.slow
def test_the_command_line_refuses_qk_norm_with_mla_in_one_line(tmp_path):
    proc = run_train("variant=mla", "qk_norm=rmsnorm", "logger=none", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "qk_norm" in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
