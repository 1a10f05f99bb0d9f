"""Every scoring function against an independent reference (outputs and gradients, float64)."""

import math

import pytest
import torch
from helpers import score_cases

import attnlab
from attnlab.position_bias import AlibiBias, ShawBias, T5Bias, alibi_slopes, t5_relative_bucket
from attnlab.scores import DotScore, ScaledDotScore, ScoreWithBias

pytestmark = pytest.mark.usefixtures("single_thread")

B, H, LQ, LK, D_K = 2, 3, 5, 7, 4

# (id, name, build params): every registered built-in with its test parameters (helpers.TEST_PARAMS: small clip /
# bucket settings so clipping and log buckets are hit at L<=7), then other settings of the scores that take some.
SCORE_CASES = [
    *score_cases(),
    ("additive_default", "additive", {}),
    ("additive_chunk2", "additive", {"d_attn": 3, "chunk_size": 2}),
    ("shaw_clip0", "relative_position", {"clip": 0}),
    ("shaw_default_clip", "relative_position", {}),
    (
        "t5_causal_scaled",
        "t5_bias",
        {"num_buckets": 8, "max_distance": 16, "bidirectional": False, "scale": True},
    ),
    ("t5_default", "t5_bias", {}),
]
SEEDS = [0, 1]


def build(name, params, num_heads=H, d_k=D_K, seed=0, ref=None):
    score = attnlab.build_score(name, d_k=d_k, num_heads=num_heads, **params).double()
    if ref is not None:
        ref.randomize_(score, seed=100 + seed)
    return score


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lq,lk", [(LQ, LK), (6, 6)])
@pytest.mark.parametrize("case", SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_score_matches_reference_values_and_gradients(case, lq, lk, seed, ref):
    """logits and d<logits, c>/d(q, k, every parameter) equal the paper formula written independently."""
    _, name, params = case
    score = build(name, params, seed=seed, ref=ref)
    q = ref.randn(B, H, lq, D_K, seed=seed, requires_grad=True)
    k = ref.randn(B, H, lk, D_K, seed=seed + 50, requires_grad=True)
    out = score(q, k)
    expected = ref.score_logits(name, params, score, q, k)
    assert out.shape == (B, H, lq, lk)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    inputs = [q, k, *score.parameters()]
    for got, want in zip(ref.grads(out, inputs), ref.grads(expected, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_every_builtin_score_has_a_reference(ref):
    """The references (conftest.score_logits) cover every registered built-in: a new score without one fails here,
    by name, instead of being left out of the reference tests."""
    missing = []
    for _, name, params in score_cases():
        q, k = ref.randn(1, H, 2, D_K, seed=1), ref.randn(1, H, 3, D_K, seed=2)
        try:
            ref.score_logits(name, params, build(name, params), q, k)
        except AssertionError as e:
            if "no reference" not in str(e):
                raise
            missing.append(name)
    assert not missing, f"built-in scores without a reference in conftest.score_logits: {missing}"


@pytest.mark.parametrize("name", ["dot", "scaled_dot", "alibi"])
def test_parameter_free_scores_have_no_parameters(name):
    assert list(attnlab.build_score(name, d_k=D_K, num_heads=H).parameters()) == []


def test_scaled_dot_divides_by_sqrt_d_k(ref):
    q, k = ref.randn(1, 2, 3, 5, seed=3), ref.randn(1, 2, 4, 5, seed=4)
    dot = attnlab.build_score("dot", d_k=5, num_heads=2)(q, k)
    scaled = attnlab.build_score("scaled_dot", d_k=5, num_heads=2)(q, k)
    torch.testing.assert_close(scaled * math.sqrt(5), dot, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dot, ref.qk(q, k), rtol=1e-12, atol=1e-12)


def test_general_weight_has_one_bilinear_map_per_head():
    score = attnlab.build_score("general", d_k=D_K, num_heads=H)
    assert score.weight.shape == (H, D_K, D_K)


def test_additive_parameter_shapes_and_default_d_attn():
    score = attnlab.build_score("additive", d_k=D_K, num_heads=H)
    assert score.w_q.shape == (H, D_K, D_K)
    assert score.w_k.shape == (H, D_K, D_K)
    assert score.v.shape == (H, D_K)
    score = attnlab.build_score("additive", d_k=D_K, num_heads=H, d_attn=6)
    assert score.w_q.shape == (H, D_K, 6)
    assert score.w_k.shape == (H, D_K, 6)
    assert score.v.shape == (H, 6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("chunk_size", [1, 2, 3, None])
def test_additive_chunking_equals_naive_5d_form(chunk_size, seed, ref):
    """Chunked evaluation over query rows (including a ragged last chunk: 3 does not divide 7) is exact."""
    score = build("additive", {"d_attn": 3, "chunk_size": chunk_size}, seed=seed, ref=ref)
    q = ref.randn(B, H, 7, D_K, seed=seed, requires_grad=True)
    k = ref.randn(B, H, 5, D_K, seed=seed + 9, requires_grad=True)
    out = score(q, k)
    expected = ref.additive_naive_5d(q, k, score.w_q, score.w_k, score.v)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    inputs = [q, k, score.w_q, score.w_k, score.v]
    for got, want in zip(ref.grads(out, inputs), ref.grads(expected, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_additive_naive_5d_reference_agrees_with_loop_reference(ref):
    """Sanity check of the two references used above against each other."""
    w_q, w_k, v = ref.randn(2, 3, 4, seed=1), ref.randn(2, 3, 4, seed=2), ref.randn(2, 4, seed=3)
    q, k = ref.randn(1, 2, 3, 3, seed=4), ref.randn(1, 2, 2, 3, seed=5)
    torch.testing.assert_close(ref.additive_naive_5d(q, k, w_q, w_k, v), ref.additive_loop(q, k, w_q, w_k, v))


@pytest.mark.parametrize(
    "name,score_cls,bias_cls",
    [
        ("relative_position", ScaledDotScore, ShawBias),
        ("t5_bias", DotScore, T5Bias),
        ("alibi", ScaledDotScore, AlibiBias),
    ],
)
def test_a_preset_builds_its_score_plus_its_position_bias(name, score_cls, bias_cls):
    """build_score of a preset: one logits module whose two children are the score and the position bias."""
    built = attnlab.build_score(name, d_k=D_K, num_heads=H)
    assert isinstance(built, ScoreWithBias)
    assert type(built.score) is score_cls
    assert type(built.position_bias) is bias_cls
    assert (built.d_k, built.num_heads) == (D_K, H)
    assert name in attnlab.list_scores()


def test_t5_bias_scale_true_is_scaled_dot_plus_the_bias():
    built = attnlab.build_score("t5_bias", d_k=D_K, num_heads=H, scale=True)
    assert type(built.score) is ScaledDotScore
    assert type(built.position_bias) is T5Bias


def test_relative_position_table_shape_and_defaults():
    score = attnlab.build_score("relative_position", d_k=D_K, num_heads=H)
    assert score.position_bias.rel_k.shape == (33, D_K)  # default clip = 16, shared across heads
    assert score.has_value_term is False
    shaw = attnlab.build_score("relative_position", d_k=D_K, num_heads=H, clip=3).position_bias
    assert shaw.rel_k.shape == (7, D_K)
    shaw = attnlab.build_score("relative_position", d_k=D_K, num_heads=H, clip=0).position_bias
    assert shaw.rel_k.shape == (1, D_K)


def test_relative_position_clip0_adds_one_shared_vector(ref):
    score = build("relative_position", {"clip": 0}, ref=ref)
    q, k = ref.randn(B, H, 3, D_K, seed=1), ref.randn(B, H, 4, D_K, seed=2)
    r = score.position_bias.rel_k[0]
    expected = (ref.qk(q, k) + (q @ r)[..., None]) / math.sqrt(D_K)
    torch.testing.assert_close(score(q, k), expected, rtol=1e-12, atol=1e-12)


def test_relative_position_distances_beyond_clip_share_an_embedding(ref):
    """With clip=1 and k = 0 only the relative term q_i . rel_k[idx] / sqrt(d_k) remains: keys 2 and 3
    steps to the right of a query read the same (clipped) row, as do keys 2 and 3 steps to the left."""
    score = build("relative_position", {"clip": 1}, ref=ref)
    q = ref.randn(1, H, 7, D_K, seed=5)
    k = torch.zeros(1, H, 7, D_K, dtype=torch.float64)
    rel = score(q, k)[0]
    torch.testing.assert_close(rel[:, 0, 2], rel[:, 0, 3], rtol=0, atol=0)
    torch.testing.assert_close(rel[:, 6, 4], rel[:, 6, 3], rtol=0, atol=0)
    assert not torch.allclose(rel[:, 3, 4], rel[:, 3, 3])
    torch.testing.assert_close(rel[:, 3, 4], q[0, :, 3] @ score.position_bias.rel_k[2] / math.sqrt(D_K))
    torch.testing.assert_close(rel[:, 3, 2], q[0, :, 3] @ score.position_bias.rel_k[0] / math.sqrt(D_K))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", [0, 2])
def test_shaw_value_term_matches_loop_reference(clip, seed, ref):
    d_v = 3
    score = attnlab.build_score("relative_position", d_k=D_K, num_heads=H, clip=clip, value_term=True, d_v=d_v)
    score = ref.randomize_(score.double(), seed=seed)
    assert score.has_value_term is True
    rel_v = score.position_bias.rel_v
    assert rel_v.shape == (2 * clip + 1, d_v)
    w = torch.softmax(ref.randn(B, H, 4, 6, seed=seed), dim=-1).requires_grad_(True)
    out = score.value_term(w)
    expected = ref.shaw_value_term(w, rel_v, clip)
    assert out.shape == (B, H, 4, d_v)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    inputs = [w, rel_v]
    for got, want in zip(ref.grads(out, inputs), ref.grads(expected, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_t5_bias_table_shape_and_defaults():
    assert attnlab.build_score("t5_bias", d_k=D_K, num_heads=H).position_bias.rel_bias.shape == (32, H)
    t5 = attnlab.build_score("t5_bias", d_k=D_K, num_heads=H, num_buckets=8).position_bias
    assert t5.rel_bias.shape == (8, H)


# rel (key - query) -> bucket, worked by hand from the Mesh TF algorithm (32 buckets, max distance 128).
BIDIRECTIONAL_PINS = {0: 0, -1: 1, 1: 17, -7: 7, -8: 8, -20: 10, -200: 15, 200: 31}
# causal: 16 exact buckets for n = -rel in [0, 16); 16 + floor(log(n/16)/log(8)*16) beyond, capped at 31.
CAUSAL_PINS = {5: 0, 300: 0, 0: 0, -1: 1, -15: 15, -16: 16, -20: 17, -40: 23, -127: 31, -128: 31, -1000: 31}


@pytest.mark.parametrize("rel,bucket", sorted(BIDIRECTIONAL_PINS.items()))
def test_reference_bucket_reproduces_hand_pins_bidirectional(rel, bucket, ref):
    assert ref.t5_bucket(rel, True, 32, 128) == bucket


@pytest.mark.parametrize("rel,bucket", sorted(CAUSAL_PINS.items()))
def test_reference_bucket_reproduces_hand_pins_causal(rel, bucket, ref):
    assert ref.t5_bucket(rel, False, 32, 128) == bucket


@pytest.mark.parametrize("bidirectional,pins", [(True, BIDIRECTIONAL_PINS), (False, CAUSAL_PINS)])
def test_t5_relative_bucket_hand_pinned_values(bidirectional, pins):
    rel = torch.tensor(list(pins))
    got = t5_relative_bucket(rel, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    assert got.dtype == torch.long
    assert got.tolist() == list(pins.values())


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 16), (16, 64)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_relative_bucket_matches_reference_over_range(bidirectional, num_buckets, max_distance, ref):
    rel = torch.arange(-300, 301)
    got = t5_relative_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    expected = [ref.t5_bucket(r, bidirectional, num_buckets, max_distance) for r in rel.tolist()]
    assert got.tolist() == expected
    # also a 2-D (Lq, Lk) input keeps its shape
    rel2 = torch.arange(5)[None, :] - torch.arange(4)[:, None]
    got2 = t5_relative_bucket(rel2, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    assert got2.shape == (4, 5)
    assert got2.flatten().tolist() == [
        ref.t5_bucket(r, bidirectional, num_buckets, max_distance) for r in rel2.flatten().tolist()
    ]


def test_t5_bias_uses_key_minus_query_direction(ref):
    """With q = 0 the logits are pure bias: logit[i, j] = rel_bias[bucket(j - i), h]; a key one step in the
    future (j = i + 1) reads bucket 17 (32-bucket bidirectional), one step in the past bucket 1."""
    score = build("t5_bias", {}, ref=ref)
    zeros = torch.zeros(1, H, 4, D_K, dtype=torch.float64)
    logits = score(zeros, zeros)[0]
    table = score.position_bias.rel_bias
    for h in range(H):
        assert logits[h, 0, 1] == table[17, h]
        assert logits[h, 1, 0] == table[1, h]
        assert logits[h, 2, 2] == table[0, h]


def test_alibi_slopes_pinned_for_8_and_12_heads():
    torch.testing.assert_close(
        alibi_slopes(8).double(), torch.tensor([2.0**-i for i in range(1, 9)], dtype=torch.float64)
    )
    expected12 = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    torch.testing.assert_close(alibi_slopes(12).double(), torch.tensor(expected12, dtype=torch.float64))


@pytest.mark.parametrize("num_heads", [*range(1, 17), 24, 32])
def test_alibi_slopes_match_press_reference(num_heads, ref):
    got = alibi_slopes(num_heads).double()
    assert got.shape == (num_heads,)
    torch.testing.assert_close(got, torch.tensor(ref.alibi_slopes(num_heads), dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("num_heads", [6, 12])
def test_alibi_logits_match_reference_in_float64_for_any_head_count(num_heads, ref):
    """12 heads needs slopes like 2^-0.5 that float32 cannot hold: a .double() score must still be exact."""
    score = attnlab.build_score("alibi", d_k=D_K, num_heads=num_heads).double()
    q = ref.randn(1, num_heads, 4, D_K, seed=1, requires_grad=True)
    k = ref.randn(1, num_heads, 6, D_K, seed=2, requires_grad=True)
    out = score(q, k)
    expected = ref.score_logits("alibi", {}, score, q, k)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(ref.grads(out, [q, k]), ref.grads(expected, [q, k]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_alibi_slopes_buffer_is_not_a_parameter():
    score = attnlab.build_score("alibi", d_k=D_K, num_heads=12)
    assert dict(score.named_buffers())["position_bias.slopes"].shape == (12,)
    torch.testing.assert_close(score.position_bias.slopes.double(), alibi_slopes(12).double())
    assert not any("slopes" in name for name, _ in score.named_parameters())


def test_alibi_penalty_is_symmetric_in_distance(ref):
    score = attnlab.build_score("alibi", d_k=D_K, num_heads=2).double()
    zeros = torch.zeros(1, 2, 5, D_K, dtype=torch.float64)
    logits = score(zeros, zeros)[0]
    for h, slope in enumerate(ref.alibi_slopes(2)):
        expected = torch.tensor([[-slope * abs(j - i) for j in range(5)] for i in range(5)], dtype=torch.float64)
        torch.testing.assert_close(logits[h], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_every_builtin_score_has_bool_has_value_term_false(case):
    _, name, params = case
    assert attnlab.build_score(name, d_k=D_K, num_heads=H, **params).has_value_term is False
