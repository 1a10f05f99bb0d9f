"""MultiHeadAttention: wiring, masking, fast (SDPA) vs eager paths, torch parity, user extensions."""

import math
import uuid

import helpers
import pytest
import torch
from conftest import SDPACalls
from helpers import grid, score_cases
from torch import nn

import attnlab

pytestmark = pytest.mark.usefixtures("single_thread")

B, L, D_MODEL, H, D_K, D_V = 2, 5, 6, 2, 4, 3

# (id, score name, score params): every registered built-in with its test parameters (helpers.TEST_PARAMS: settings
# chosen so clipping / log buckets are exercised at L = 5..7), then other settings of the scores that take some.
SCORES = [
    *score_cases(),
    ("additive_chunk2", "additive", {"d_attn": 3, "chunk_size": 2}),
    ("shaw_value", "relative_position", {"clip": 2, "value_term": True}),
    (
        "t5_causal_scaled",
        "t5_bias",
        {"num_buckets": 8, "max_distance": 16, "bidirectional": False, "scale": True},
    ),
]
SCORE_IDS = [s[0] for s in SCORES]
# every other case (a new built-in too) must take SDPA; linear: a softmax over φ(q)·φ(k) (no O(L) form) is eager
NOT_SDPA = ["additive", "additive_chunk2", "shaw_value", "linear"]
SDPA_SCORES = [s for s in SCORES if s[0] not in NOT_SDPA]
NON_SDPA_SCORES = [s for s in SCORES if s[0] in NOT_SDPA]

MASKS = [
    "none",
    "causal",
    "sliding_window2",
    "padding",
    "causal&padding",
    "causal_2d_tensor",
    "per_head",
    "empty_rows",
]


def make_mask(kind, lq=L, lk=L):
    """(mask passed to MHA, reference bool mask broadcastable to (B, H, Lq, Lk)) built independently."""
    if kind == "none":
        return None, None
    if kind == "causal":
        return attnlab.build_mask("causal"), grid(lq, lk, lambda i, j: j <= i)
    if kind == "sliding_window2":
        return attnlab.build_mask("sliding_window", window=2), grid(lq, lk, lambda i, j: abs(i - j) < 2)
    lengths = [lk, lk - 2]
    pad = torch.tensor([[j < n for j in range(lk)] for n in lengths])[:, None, None, :]  # (B, 1, 1, Lk)
    if kind == "padding":
        return pad, pad
    if kind == "causal&padding":
        m = grid(lq, lk, lambda i, j: j <= i)[None, None] & pad
        return m, m
    if kind == "causal_2d_tensor":
        m = grid(lq, lk, lambda i, j: j <= i)
        return m, m
    if kind == "per_head":
        gen = torch.Generator().manual_seed(7)
        m = torch.rand(B, H, lq, lk, generator=gen) < 0.5
        m[..., 0] = True
        return m, m
    if kind == "empty_rows":
        m = torch.ones(B, 1, lq, lk, dtype=torch.bool)
        m[0, 0, 2, :] = False  # one blind query row in sequence 0
        m[1, 0, :, 1:] = False
        m[1, 0, 3, :] = False  # sequence 1: rows see only key 0, row 3 sees nothing
        return m, m
    raise AssertionError(kind)


def mha_case(case, seed=0, bias=True, d_model=D_MODEL, num_heads=H, d_k=D_K, d_v=D_V, **kw):
    _, name, params = case
    return helpers.make_mha(d_model, num_heads, d_k, d_v, seed=seed, score=name, bias=bias, **params, **kw)


def reference(mha, case, x, ref, key_value=None, mask=None, num_heads=H):
    _, name, params = case

    def logits_fn(q, k):
        return ref.score_logits(name, params, mha.score, q, k, bias=mha.position_bias)

    value_fn = None
    if params.get("value_term"):

        def value_fn(w):
            return ref.shaw_value_term(w, mha.position_bias.rel_v, params["clip"])

    return ref.mha_reference(mha, x, num_heads, logits_fn, key_value=key_value, mask=mask, value_fn=value_fn)


ATOL = 1e-10


# ---------------------------------------------------------------- wiring
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("case", SCORES, ids=SCORE_IDS)
def test_attend_logits_match_reference_from_projected_q_k(case, cross, ref):
    """attend().logits are the raw score of q = x Wq^T + bq, k = kv Wk^T + bk split into heads."""
    mha = mha_case(case, seed=1)
    x = ref.randn(B, 4 if cross else L, D_MODEL, seed=2, requires_grad=True)
    kv = ref.randn(B, 7, D_MODEL, seed=3, requires_grad=True) if cross else None
    res = mha.attend(x, key_value=kv)
    out, weights, logits = res
    assert res.out is out and res.weights is weights and res.logits is logits
    lq, lk = x.shape[1], (kv if cross else x).shape[1]
    q, k = ref.project_qk(mha, x, H, key_value=kv)
    expected = ref.score_logits(case[1], case[2], mha.score, q, k, bias=mha.position_bias)
    assert logits.shape == (B, H, lq, lk)
    torch.testing.assert_close(logits, expected, rtol=ATOL, atol=ATOL)
    exp_out, exp_w, _ = reference(mha, case, x, ref, key_value=kv)
    torch.testing.assert_close(weights, exp_w, rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(out, exp_out, rtol=ATOL, atol=ATOL)
    inputs = [x] + ([kv] if cross else []) + list(mha.parameters())
    for got, want in zip(ref.grads(logits, inputs), ref.grads(expected, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=ATOL, atol=ATOL)


def test_projection_shapes_follow_d_k_and_d_v_not_d_model():
    mha = attnlab.MultiHeadAttention(8, 3, 5, d_v=2)
    assert mha.q_proj.weight.shape == (15, 8)
    assert mha.k_proj.weight.shape == (15, 8)
    assert mha.v_proj.weight.shape == (6, 8)
    assert mha.out_proj.weight.shape == (8, 6)
    out, w = mha(torch.randn(2, 4, 8), need_weights=True)
    assert out.shape == (2, 4, 8)
    assert w.shape == (2, 3, 4, 4)
    out, w = mha(torch.randn(2, 4, 8), key_value=torch.randn(2, 6, 8))
    assert out.shape == (2, 4, 8)
    assert w is None


def test_d_v_defaults_to_d_k_and_bias_flag():
    mha = attnlab.MultiHeadAttention(8, 2, 3, bias=False)
    assert mha.v_proj.weight.shape == (6, 8)
    assert mha.out_proj.weight.shape == (8, 6)
    for lin in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
        assert lin.bias is None
    assert isinstance(mha.score, attnlab.Score)


# ---------------------------------------------------------------- fast vs eager
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("case", SCORES, ids=SCORE_IDS)
def test_fast_and_eager_paths_agree_with_reference_outputs_and_gradients(case, mask_kind, ref):
    mha = mha_case(case, seed=3)
    x = ref.randn(B, L, D_MODEL, seed=4, requires_grad=True)
    mask, ref_mask = make_mask(mask_kind)
    out_fast, w_fast = mha(x, mask=mask, need_weights=False)
    out_eager, w_eager = mha(x, mask=mask, need_weights=True)
    assert w_fast is None
    exp_out, exp_w, _ = reference(mha, case, x, ref, mask=ref_mask)
    torch.testing.assert_close(out_fast, exp_out, rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(out_eager, exp_out, rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(w_eager, exp_w, rtol=ATOL, atol=ATOL)
    inputs = [x, *mha.parameters()]
    g_fast, g_eager, g_ref = (ref.grads(o, inputs) for o in (out_fast, out_eager, exp_out))
    for name, gf, ge, gr in zip(["x"] + [n for n, _ in mha.named_parameters()], g_fast, g_eager, g_ref, strict=True):
        assert torch.isfinite(gf).all() and torch.isfinite(ge).all(), name
        torch.testing.assert_close(gf, ge, rtol=ATOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(ge, gr, rtol=ATOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", SCORES, ids=SCORE_IDS)
def test_cross_attention_with_key_padding_paths_agree_with_reference(case, ref):
    mha = mha_case(case, seed=5)
    x = ref.randn(B, 4, D_MODEL, seed=6, requires_grad=True)
    kv = ref.randn(B, 6, D_MODEL, seed=7, requires_grad=True)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])[:, None, None, :]
    out_fast, _ = mha(x, key_value=kv, mask=mask)
    out_eager, w = mha(x, key_value=kv, mask=mask, need_weights=True)
    exp_out, exp_w, _ = reference(mha, case, x, ref, key_value=kv, mask=mask)
    torch.testing.assert_close(out_fast, exp_out, rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(out_eager, exp_out, rtol=ATOL, atol=ATOL)
    torch.testing.assert_close(w, exp_w, rtol=ATOL, atol=ATOL)
    inputs = [x, kv, *mha.parameters()]
    for gf, gr in zip(ref.grads(out_fast, inputs), ref.grads(exp_out, inputs), strict=True):
        torch.testing.assert_close(gf, gr, rtol=ATOL, atol=ATOL)


@pytest.mark.usefixtures("without_tiled")  # (the tiled kernel takes the biased ones first)
@pytest.mark.parametrize("case", SDPA_SCORES, ids=[s[0] for s in SDPA_SCORES])
def test_sdpa_family_uses_sdpa_only_without_weights(case, ref):
    """The comparison above is only meaningful if need_weights=False really takes the SDPA path."""
    mha = mha_case(case)
    x = ref.randn(B, L, D_MODEL, seed=1)
    for mask in (None, attnlab.build_mask("causal")):
        with SDPACalls() as spy:
            mha(x, mask=mask, need_weights=False)
        assert len(spy.kwargs) >= 1
        with SDPACalls() as spy:
            mha(x, mask=mask, need_weights=True)
            mha.attend(x, mask=mask)
        assert spy.kwargs == []


@pytest.mark.parametrize("case", NON_SDPA_SCORES, ids=[s[0] for s in NON_SDPA_SCORES])
def test_non_sdpa_scores_give_eager_result_without_weights(case, ref):
    """additive, Shaw-with-value-term and linear cannot use SDPA, but need_weights=False must still be correct."""
    mha = mha_case(case)
    x = ref.randn(B, L, D_MODEL, seed=1)
    with SDPACalls() as spy:
        out, w = mha(x, need_weights=False)
    assert w is None
    assert spy.kwargs == []
    torch.testing.assert_close(out, reference(mha, case, x, ref)[0], rtol=ATOL, atol=ATOL)


def test_shaw_value_term_output_matches_loop_reference(ref):
    """out = out_proj(concat_h sum_j w_ij (v_j + rel_v[clamp(j-i)+clip])), computed with explicit loops."""
    clip = 1
    mha = attnlab.MultiHeadAttention(
        D_MODEL, H, D_K, d_v=D_V, score="relative_position", clip=clip, value_term=True
    ).double()
    ref.randomize_(mha, seed=11, scale=0.5)
    assert mha.position_bias.has_value_term is True
    assert mha.position_bias.rel_v.shape == (2 * clip + 1, D_V)
    x = ref.randn(1, 4, D_MODEL, seed=12)
    causal = attnlab.build_mask("causal")
    with torch.no_grad():
        q, k = ref.project_qk(mha, x, H)
        v = ref.split_heads(ref.linear(mha.v_proj, x), H)
        rel_k, rel_v = mha.position_bias.rel_k.detach(), mha.position_bias.rel_v.detach()
    heads = torch.zeros(1, H, 4, D_V, dtype=torch.float64)
    for h in range(H):
        for i in range(4):
            logits = []
            for j in range(i + 1):
                r = min(max(j - i, -clip), clip) + clip
                logits.append(float(q[0, h, i] @ (k[0, h, j] + rel_k[r])) / math.sqrt(D_K))
            ws = [math.exp(z - max(logits)) for z in logits]
            ws = [w / sum(ws) for w in ws]
            for j, w in enumerate(ws):
                r = min(max(j - i, -clip), clip) + clip
                heads[0, h, i] += w * (v[0, h, j] + rel_v[r])
    expected = ref.linear(mha.out_proj, heads.transpose(1, 2).reshape(1, 4, H * D_V))
    with torch.no_grad():
        for need_weights in (False, True):
            out, _ = mha(x, mask=causal, need_weights=need_weights)
            torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- masking properties
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("case", SCORES, ids=SCORE_IDS)
def test_masked_keys_get_zero_weight_and_visible_rows_sum_to_one(case, mask_kind, ref):
    mha = mha_case(case, seed=8)
    x = ref.randn(B, L, D_MODEL, seed=9)
    mask, ref_mask = make_mask(mask_kind)
    visible = torch.ones(B, H, L, L, dtype=torch.bool) if ref_mask is None else ref_mask.expand(B, H, L, L)
    with torch.no_grad():
        _, w = mha(x, mask=mask, need_weights=True)
        w_attend = mha.attend(x, mask=mask).weights
    for weights in (w, w_attend):
        assert not torch.isnan(weights).any()
        assert torch.all(weights[~visible] == 0)
        has_key = visible.any(-1)
        sums = weights.sum(-1)
        torch.testing.assert_close(sums[has_key], torch.ones_like(sums[has_key]), rtol=0, atol=1e-12)
        assert torch.all(weights[~has_key] == 0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", SCORES, ids=SCORE_IDS)
def test_fully_masked_query_row_gives_zero_attention_and_finite_gradients(case, need_weights, bias, ref):
    """A blind row's attention output is 0 before out_proj, so out equals out_proj.bias (or 0)."""
    mha = mha_case(case, seed=10, bias=bias)
    x = ref.randn(B, L, D_MODEL, seed=11, requires_grad=True)
    mask = torch.ones(B, 1, L, L, dtype=torch.bool)
    mask[0, 0, 1, :] = False
    mask[1] = False  # every row of sequence 1 is blind
    out, w = mha(x, mask=mask, need_weights=need_weights)
    assert not torch.isnan(out).any()
    blind = [out[0, 1], *out[1]]
    expected = torch.zeros(D_MODEL, dtype=torch.float64) if not bias else mha.out_proj.bias
    for row in blind:
        torch.testing.assert_close(row, expected, rtol=0, atol=1e-12)
    if need_weights:
        assert torch.all(w[0, :, 1] == 0) and torch.all(w[1] == 0)
    inputs = [x, *mha.parameters()]
    gs = ref.grads(out, inputs)
    for g in gs:
        assert torch.isfinite(g).all()
    # the blind rows depend on nothing, so only sequence 0 (rows other than 1) carries gradient to x
    assert torch.all(gs[0][1] == 0)


@pytest.mark.parametrize("mask_form", ["mask_object", "bool_tensor"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", SCORES, ids=SCORE_IDS)
def test_causal_mask_blocks_future_gradients(case, need_weights, mask_form, ref):
    """d out[:, i] / d x[:, j] is exactly zero for j > i, nonzero for j <= i, and zero across the batch."""
    mha = mha_case(case, seed=12)
    x = ref.randn(B, L, D_MODEL, seed=13, requires_grad=True)
    mask = attnlab.build_mask("causal") if mask_form == "mask_object" else grid(L, L, lambda i, j: j <= i)
    out, _ = mha(x, mask=mask, need_weights=need_weights)
    for i in range(L):
        c = ref.randn(D_MODEL, seed=20 + i)
        (g,) = torch.autograd.grad((out[0, i] * c).sum(), x, retain_graph=True)
        assert torch.all(g[0, i + 1 :] == 0), f"row {i} sees the future"
        assert torch.all(g[1] == 0), "batch elements leak into each other"
        for j in range(i + 1):
            assert g[0, j].abs().sum() > 0, f"row {i} ignores key {j}"


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", SCORES, ids=SCORE_IDS)
def test_dropout_is_inactive_in_eval_mode(case, need_weights, ref):
    plain = mha_case(case, seed=14)
    dropped = mha_case(case, seed=14, dropout=0.5)
    x = ref.randn(B, L, D_MODEL, seed=15)
    with torch.no_grad():
        torch.testing.assert_close(
            dropped.eval()(x, need_weights=need_weights)[0],
            plain(x, need_weights=need_weights)[0],
            rtol=ATOL,
            atol=ATOL,
        )


# ---------------------------------------------------------------- torch parity
def torch_pair(ref, seed=0):
    ours = attnlab.MultiHeadAttention(D_MODEL, 3, D_MODEL // 3, score="scaled_dot", bias=True).double()
    ref.randomize_(ours, seed=seed, scale=0.5)
    theirs = nn.MultiheadAttention(D_MODEL, 3, batch_first=True).double()
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    return ours.eval(), theirs.eval()


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("masking", ["none", "key_padding", "attn_mask", "both"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_scaled_dot_matches_torch_multihead_attention(cross, masking, need_weights, ref):
    ours, theirs = torch_pair(ref, seed=3)
    x = ref.randn(B, 4, D_MODEL, seed=1)
    kv = ref.randn(B, 6, D_MODEL, seed=2) if cross else x
    lk = kv.shape[1]
    key_padding = torch.tensor([[False] * lk, [False] * 2 + [True] * (lk - 2)])  # torch: True = ignore
    blocked = grid(4, lk, lambda i, j: j > i + 1)  # torch: True = not allowed
    kpm = key_padding if masking in ("key_padding", "both") else None
    am = blocked if masking in ("attn_mask", "both") else None
    ours_mask = None
    if kpm is not None:
        ours_mask = ~kpm[:, None, None, :]
    if am is not None:
        ours_mask = ~am if ours_mask is None else ours_mask & ~am
    t_out, t_w = theirs(x, kv, kv, key_padding_mask=kpm, attn_mask=am, need_weights=True, average_attn_weights=False)
    _, t_w_avg = theirs(x, kv, kv, key_padding_mask=kpm, attn_mask=am, need_weights=True)
    o_out, o_w = ours(x, key_value=kv if cross else None, mask=ours_mask, need_weights=need_weights)
    torch.testing.assert_close(o_out, t_out, rtol=1e-10, atol=1e-10)
    if need_weights:
        torch.testing.assert_close(o_w, t_w, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(o_w.mean(1), t_w_avg, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- user extensions
def register_cosine():
    name = f"test_cosine_{uuid.uuid4().hex[:8]}"

    @attnlab.register_score(name)
    def cosine(q, k, scale=5.0):
        qn = q / q.norm(dim=-1, keepdim=True)
        kn = k / k.norm(dim=-1, keepdim=True)
        return scale * qn @ kn.transpose(-1, -2)

    return name


def cosine_reference(q, k, scale=5.0):
    num = torch.einsum("bhid,bhjd->bhij", q, k)
    return scale * num / (q.pow(2).sum(-1).sqrt()[..., :, None] * k.pow(2).sum(-1).sqrt()[..., None, :])


def register_dilated():
    name = f"test_dilated_{uuid.uuid4().hex[:8]}"

    @attnlab.register_mask(name)
    def dilated(q_idx, kv_idx):
        return (q_idx - kv_idx) % 2 == 0

    return name


@pytest.mark.parametrize("need_weights", [False, True])
def test_user_function_score_and_mask_work_end_to_end(need_weights, ref):
    score_name, mask_name = register_cosine(), register_dilated()
    mha = attnlab.MultiHeadAttention(D_MODEL, H, D_K, score=score_name, scale=3.0).double()
    ref.randomize_(mha, seed=2, scale=0.5)
    x = ref.randn(B, L, D_MODEL, seed=3, requires_grad=True)
    mask = attnlab.build_mask(mask_name)
    out, w = mha(x, mask=mask, need_weights=need_weights)
    ref_mask = grid(L, L, lambda i, j: (i - j) % 2 == 0)
    exp_out, exp_w, _ = ref.mha_reference(mha, x, H, lambda q, k: cosine_reference(q, k, 3.0), mask=ref_mask)
    torch.testing.assert_close(out, exp_out, rtol=ATOL, atol=ATOL)
    if need_weights:
        torch.testing.assert_close(w, exp_w, rtol=ATOL, atol=ATOL)
        assert torch.all(w[..., ~ref_mask] == 0)
    inputs = [x, *mha.parameters()]
    for g, gr in zip(ref.grads(out, inputs), ref.grads(exp_out, inputs), strict=True):
        torch.testing.assert_close(g, gr, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("need_weights", [False, True])
def test_user_module_score_parameter_trains_through_mha(need_weights, ref):
    name = f"test_headtemp_{uuid.uuid4().hex[:8]}"

    @attnlab.register_score(name)
    class HeadTemperature(nn.Module):
        def __init__(self, d_k, num_heads, init=1.0):
            super().__init__()
            self.temp = nn.Parameter(torch.full((num_heads,), float(init)))

        def forward(self, q, k):
            return self.temp[:, None, None] * (q @ k.transpose(-1, -2))

    mha = attnlab.MultiHeadAttention(D_MODEL, H, D_K, d_v=D_V, score=name, init=0.3).double()
    ref.randomize_(mha, seed=4, scale=0.5)
    assert isinstance(mha.score, HeadTemperature)
    assert any(p is mha.score.temp for p in mha.parameters())
    x = ref.randn(B, L, D_MODEL, seed=5, requires_grad=True)
    causal = attnlab.build_mask("causal")
    out, _ = mha(x, mask=causal, need_weights=need_weights)

    def logits_fn(q, k):
        return mha.score.temp[:, None, None] * torch.einsum("bhid,bhjd->bhij", q, k)

    exp_out, _, _ = ref.mha_reference(mha, x, H, logits_fn, mask=grid(L, L, lambda i, j: j <= i))
    torch.testing.assert_close(out, exp_out, rtol=ATOL, atol=ATOL)
    inputs = [x, mha.score.temp, *mha.parameters()]
    gs, grs = ref.grads(out, inputs), ref.grads(exp_out, inputs)
    assert gs[1].abs().sum() > 0
    for g, gr in zip(gs, grs, strict=True):
        torch.testing.assert_close(g, gr, rtol=ATOL, atol=ATOL)
