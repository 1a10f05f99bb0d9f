"""Registry behaviour: listing, building, unknown names, duplicates, and user registrations."""

import math
import uuid

import pytest
import torch
from helpers import SCORES, params_of
from torch import nn

import attnlab

pytestmark = pytest.mark.usefixtures("single_thread")

# built-ins that must stay registered (the tests that iterate take every built-in from the registry: helpers.SCORES)
BUILTIN_SCORES = ["dot", "scaled_dot", "general", "additive", "relative_position", "t5_bias", "alibi"]
BUILTIN_MASKS = ["none", "padding", "causal", "sliding_window", "and", "or"]


def unique(prefix):
    return f"test_{prefix}_{uuid.uuid4().hex[:10]}"


def test_list_scores_returns_strings_including_builtins():
    names = attnlab.list_scores()
    assert isinstance(names, list)
    assert all(isinstance(n, str) for n in names)
    assert set(BUILTIN_SCORES) <= set(names)


def test_list_masks_returns_strings_including_builtins():
    names = attnlab.list_masks()
    assert isinstance(names, list)
    assert all(isinstance(n, str) for n in names)
    assert set(BUILTIN_MASKS) <= set(names)


@pytest.mark.parametrize("name", SCORES)
def test_build_score_gives_score_module_with_logits_shape(name):
    score = attnlab.build_score(name, d_k=4, num_heads=2, **params_of("score", name))
    assert isinstance(score, attnlab.Score)
    assert isinstance(score, nn.Module)
    assert score.has_value_term is False
    q, k = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 5, 4)
    assert score(q, k).shape == (2, 2, 3, 5)


@pytest.mark.parametrize("name", ["none", "causal"])
def test_build_mask_gives_mask_instance(name):
    assert isinstance(attnlab.build_mask(name), attnlab.Mask)


def test_unknown_name_error_is_a_value_error():
    assert issubclass(attnlab.UnknownNameError, ValueError)


def test_unknown_score_suggests_close_name_and_lists_registered():
    with pytest.raises(attnlab.UnknownNameError) as info:
        attnlab.build_score("adittive", d_k=4, num_heads=2)
    msg = str(info.value)
    assert "did you mean 'additive'?" in msg
    for name in SCORES:
        assert name in msg


def test_unknown_score_catchable_as_value_error():
    with pytest.raises(ValueError):
        attnlab.build_score("definitely_not_a_score", d_k=4, num_heads=2)


def test_unknown_score_far_from_any_name_has_no_suggestion():
    with pytest.raises(attnlab.UnknownNameError) as info:
        attnlab.build_score("qqqqqqqqqqqq", d_k=4, num_heads=2)
    assert "did you mean" not in str(info.value)
    assert "scaled_dot" in str(info.value)


def test_unknown_mask_suggests_close_name_and_lists_registered():
    with pytest.raises(attnlab.UnknownNameError) as info:
        attnlab.build_mask("casual")
    msg = str(info.value)
    assert "did you mean 'causal'?" in msg
    for name in ["none", "padding", "causal", "sliding_window"]:
        assert name in msg


def test_registering_builtin_score_name_again_raises_and_keeps_original():
    with pytest.raises(ValueError):

        @attnlab.register_score("dot")
        def fake_dot(q, k):
            return torch.zeros((*q.shape[:-1], k.shape[-2]))

    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    torch.testing.assert_close(attnlab.build_score("dot", d_k=4, num_heads=1)(q, k), q @ k.transpose(-1, -2))


def test_registering_same_new_score_name_twice_raises():
    name = unique("dup_score")

    @attnlab.register_score(name)
    def first(q, k):
        return q @ k.transpose(-1, -2)

    with pytest.raises(ValueError):

        @attnlab.register_score(name)
        def second(q, k):
            return -(q @ k.transpose(-1, -2))


def test_registering_same_mask_name_twice_raises():
    name = unique("dup_mask")

    @attnlab.register_mask(name)
    def first(q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(ValueError):

        @attnlab.register_mask(name)
        def second(q_idx, kv_idx):
            return q_idx <= kv_idx

    with pytest.raises(ValueError):

        @attnlab.register_mask("causal")
        def third(q_idx, kv_idx):
            return q_idx <= kv_idx


def test_function_score_is_built_into_module_and_receives_params():
    """A plain fn(q, k, **params) becomes a score module; build kwargs other than d_k/num_heads reach fn."""
    name = unique("cosine")

    @attnlab.register_score(name)
    def cosine(q, k, temperature=5.0):
        qn = q / q.norm(dim=-1, keepdim=True)
        kn = k / k.norm(dim=-1, keepdim=True)
        return temperature * qn @ kn.transpose(-1, -2)

    assert name in attnlab.list_scores()
    score = attnlab.build_score(name, d_k=3, num_heads=2, temperature=3.0)
    assert isinstance(score, nn.Module)
    assert score.has_value_term is False
    q = torch.randn(1, 2, 2, 3, dtype=torch.float64)
    k = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    expected = torch.empty(1, 2, 2, 4, dtype=torch.float64)
    for h in range(2):
        for i in range(2):
            for j in range(4):
                a, b = q[0, h, i], k[0, h, j]
                expected[0, h, i, j] = 3.0 * float(a @ b) / math.sqrt(float(a @ a) * float(b @ b))
    torch.testing.assert_close(score(q, k), expected)


def test_module_score_is_constructed_with_d_k_num_heads_and_params():
    name = unique("head_temp")

    @attnlab.register_score(name)
    class HeadTemperature(nn.Module):
        def __init__(self, d_k, num_heads, init=2.0):
            super().__init__()
            self.seen = (d_k, num_heads)
            self.temp = nn.Parameter(torch.full((num_heads,), float(init)))

        def forward(self, q, k):
            return self.temp[:, None, None] * (q @ k.transpose(-1, -2))

    score = attnlab.build_score(name, d_k=4, num_heads=3, init=0.5)
    assert isinstance(score, HeadTemperature)
    assert score.seen == (4, 3)
    q, k = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 5, 4)
    out = score(q, k)
    torch.testing.assert_close(out, 0.5 * (q @ k.transpose(-1, -2)))
    (g,) = torch.autograd.grad(out.sum(), [score.temp])
    torch.testing.assert_close(g, (q @ k.transpose(-1, -2)).sum(dim=(0, 2, 3)))


def test_function_mask_receives_index_shapes_and_params():
    name = unique("dilated")
    seen = {}

    @attnlab.register_mask(name)
    def dilated(q_idx, kv_idx, step=2):
        seen["q"], seen["kv"] = tuple(q_idx.shape), tuple(kv_idx.shape)
        seen["dtype"] = q_idx.dtype
        return (q_idx - kv_idx) % step == 0

    assert name in attnlab.list_masks()
    m = attnlab.build_mask(name, step=3)
    assert isinstance(m, attnlab.Mask)
    dense = m.materialize(5, 6)
    assert seen == {"q": (5, 1), "kv": (1, 6), "dtype": torch.long}
    expected = torch.tensor([[(i - j) % 3 == 0 for j in range(6)] for i in range(5)])
    assert dense.dtype == torch.bool
    assert dense.shape == (1, 1, 5, 6)
    assert torch.equal(dense[0, 0], expected)


def test_mask_subclass_registration_builds_with_params():
    """Mask subclasses implement ``mask_mod(q_idx, kv_idx, tokens, lengths)`` (attnlab.masks docstring)."""
    name = unique("band")

    @attnlab.register_mask(name)
    class Lookback(attnlab.Mask):
        def __init__(self, back=1):
            self.back = back

        def mask_mod(self, q_idx, kv_idx, tokens, lengths):
            return (kv_idx <= q_idx) & (kv_idx >= q_idx - self.back)

    m = attnlab.build_mask(name, back=2)
    assert isinstance(m, Lookback)
    expected = torch.tensor([[i - 2 <= j <= i for j in range(5)] for i in range(5)])
    assert torch.equal(m.materialize(5, 5)[0, 0], expected)
    both = m & attnlab.build_mask("sliding_window", window=2)
    assert torch.equal(
        both.materialize(5, 5)[0, 0],
        expected & torch.tensor([[abs(i - j) < 2 for j in range(5)] for i in range(5)]),
    )
