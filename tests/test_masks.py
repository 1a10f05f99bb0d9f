"""Masks against dense references built with plain Python loops (True = may attend)."""

import pytest
import torch
from helpers import grid, mask_cases

import attnlab

pytestmark = pytest.mark.usefixtures("single_thread")


def keys_visible(lq, visible_per_batch):
    """(B, 1, Lq, Lk) reference for a key-only mask: each query row repeats the per-key visibility."""
    return torch.tensor([[[list(v) for _ in range(lq)]] for v in visible_per_batch])


SHAPES = [(5, 5), (3, 6), (6, 3), (1, 4)]


@pytest.mark.parametrize("lq,lk", SHAPES)
def test_none_mask_allows_everything(lq, lk):
    m = attnlab.build_mask("none").materialize(lq, lk)
    assert m.dtype == torch.bool
    assert m.shape == (1, 1, lq, lk)
    assert bool(m.all())


@pytest.mark.parametrize("lq,lk", SHAPES)
def test_causal_mask_allows_only_past_and_present(lq, lk):
    m = attnlab.build_mask("causal").materialize(lq, lk)
    assert m.dtype == torch.bool
    assert m.shape == (1, 1, lq, lk)
    assert torch.equal(m[0, 0], grid(lq, lk, lambda i, j: j <= i))


@pytest.mark.parametrize("lq,lk", SHAPES)
@pytest.mark.parametrize("window", [1, 2, 3, 10])
def test_sliding_window_is_symmetric_band(window, lq, lk):
    m = attnlab.build_mask("sliding_window", window=window).materialize(lq, lk)
    assert m.shape == (1, 1, lq, lk)
    assert torch.equal(m[0, 0], grid(lq, lk, lambda i, j: abs(i - j) < window))


def test_sliding_window_of_one_is_self_only():
    m = attnlab.build_mask("sliding_window", window=1).materialize(4, 4)
    assert torch.equal(m[0, 0], torch.eye(4, dtype=torch.bool))


@pytest.mark.parametrize("window", [0, -1])
def test_sliding_window_below_one_raises(window):
    with pytest.raises(ValueError):
        attnlab.build_mask("sliding_window", window=window).materialize(4, 4)


@pytest.mark.parametrize("window", [1, 2, 3])
def test_causal_and_sliding_window_is_left_band(window):
    m = attnlab.build_mask("causal") & attnlab.build_mask("sliding_window", window=window)
    assert isinstance(m, attnlab.Mask)
    assert torch.equal(m.materialize(6, 6)[0, 0], grid(6, 6, lambda i, j: i - window < j <= i))


def test_causal_or_sliding_window_is_union():
    m = attnlab.build_mask("causal") | attnlab.build_mask("sliding_window", window=2)
    assert isinstance(m, attnlab.Mask)
    assert torch.equal(m.materialize(5, 5)[0, 0], grid(5, 5, lambda i, j: j <= i or abs(i - j) < 2))


TOKENS = torch.tensor([[5, 3, 0, 7, 0, 0], [0, 1, 2, 3, 4, 5]])


@pytest.mark.parametrize("pad_id", [0, 3])
def test_padding_from_tokens_hides_only_pad_keys(pad_id):
    kwargs = {} if pad_id == 0 else {"pad_id": pad_id}
    m = attnlab.build_mask("padding", **kwargs).materialize(4, 6, tokens=TOKENS)
    assert m.dtype == torch.bool
    assert m.shape == (2, 1, 4, 6)
    expected = keys_visible(4, [[t != pad_id for t in row] for row in TOKENS.tolist()])
    assert torch.equal(m, expected)


def test_padding_query_rows_of_pad_tokens_still_see_real_keys():
    m = attnlab.build_mask("padding").materialize(6, 6, tokens=TOKENS)
    # query 2 of sequence 0 is a pad token: it still sees keys 0, 1, 3
    assert m[0, 0, 2].tolist() == [True, True, False, True, False, False]
    assert m[0, 0, 5].tolist() == [True, True, False, True, False, False]


@pytest.mark.parametrize("lengths", [[4, 1], [6, 0], [2, 6]])
def test_padding_from_lengths_hides_keys_beyond_length(lengths):
    m = attnlab.build_mask("padding").materialize(3, 6, lengths=torch.tensor(lengths))
    assert m.shape == (2, 1, 3, 6)
    assert torch.equal(m, keys_visible(3, [[j < n for j in range(6)] for n in lengths]))


def test_padding_without_tokens_or_lengths_raises():
    with pytest.raises(ValueError):
        attnlab.build_mask("padding").materialize(3, 3)


def test_causal_and_padding_with_operator():
    m = attnlab.build_mask("causal") & attnlab.build_mask("padding")
    got = m.materialize(6, 6, tokens=TOKENS)
    expected = torch.stack([grid(6, 6, lambda i, j, b=b: j <= i and TOKENS[b, j] != 0) for b in range(2)])
    assert got.shape == (2, 1, 6, 6)
    assert torch.equal(got[:, 0], expected)


def test_build_and_mask_from_names_and_dicts():
    m = attnlab.build_mask("and", masks=["causal", {"name": "padding", "pad_id": 0}])
    assert isinstance(m, attnlab.Mask)
    got = m.materialize(6, 6, tokens=TOKENS)
    expected = torch.stack([grid(6, 6, lambda i, j, b=b: j <= i and TOKENS[b, j] != 0) for b in range(2)])
    assert torch.equal(got[:, 0], expected)


def test_build_or_mask_from_names_and_dicts():
    m = attnlab.build_mask("or", masks=["causal", {"name": "padding", "pad_id": 0}])
    got = m.materialize(6, 6, tokens=TOKENS)
    expected = torch.stack([grid(6, 6, lambda i, j, b=b: j <= i or TOKENS[b, j] != 0) for b in range(2)])
    assert got.shape == (2, 1, 6, 6)
    assert torch.equal(got[:, 0], expected)


def test_build_and_mask_with_lengths_and_window():
    m = attnlab.build_mask("and", masks=[{"name": "sliding_window", "window": 2}, "padding"])
    got = m.materialize(5, 5, lengths=torch.tensor([5, 3]))
    expected = torch.stack([grid(5, 5, lambda i, j, n=n: abs(i - j) < 2 and j < n) for n in [5, 3]])
    assert torch.equal(got[:, 0], expected)


def test_nested_composition_or_of_and():
    causal = attnlab.build_mask("causal")
    window = attnlab.build_mask("sliding_window", window=2)
    m = (causal & window) | attnlab.build_mask("padding")
    got = m.materialize(6, 6, tokens=TOKENS)
    expected = torch.stack([grid(6, 6, lambda i, j, b=b: (i - 2 < j <= i) or TOKENS[b, j] != 0) for b in range(2)])
    assert torch.equal(got[:, 0], expected)


# every built-in mask built with its test parameters (helpers.TEST_PARAMS) as (b, i, j) -> visible, on TOKENS
REFERENCES = {
    "none": lambda b, i, j: True,
    "causal": lambda b, i, j: j <= i,
    "sliding_window": lambda b, i, j: abs(i - j) < 2,
    "and": lambda b, i, j: j <= i and abs(i - j) < 2,  # causal & sliding_window(2)
    "or": lambda b, i, j: j <= i or abs(i - j) < 2,  # causal | sliding_window(2)
    "padding": lambda b, i, j: TOKENS[b, j] != 0,
}


@pytest.mark.parametrize("name,params", mask_cases())
def test_every_builtin_mask_matches_its_reference(name, params):
    """Every registered built-in, against a reference written here: a new mask without one fails, by name."""
    assert name in REFERENCES, f"built-in mask '{name}' has no reference in test_masks.REFERENCES"
    got = attnlab.build_mask(name, **params).materialize(6, 6, tokens=TOKENS)
    expected = torch.stack([grid(6, 6, lambda i, j, b=b: REFERENCES[name](b, i, j)) for b in range(2)])
    assert torch.equal(got[:, 0].expand(2, 6, 6), expected)


POSITION_MASKS = [(name, params) for name, params in mask_cases() if attnlab.build_mask(name, **params).position_only]


@pytest.mark.parametrize("name,params", POSITION_MASKS)
def test_position_mask_materialize_is_repeatable(name, params):
    """Cached or not, repeated calls (and different sizes in between) return the right tensor."""
    m = attnlab.build_mask(name, **params)
    first = m.materialize(4, 5).clone()
    other = m.materialize(3, 3)
    assert other.shape == (1, 1, 3, 3)
    again = m.materialize(4, 5)
    assert torch.equal(first, again)
    assert torch.equal(m.materialize(4, 5, device="cpu"), first)


def test_user_function_mask_composes_with_builtin():
    import uuid

    name = f"test_dilated_{uuid.uuid4().hex[:8]}"

    @attnlab.register_mask(name)
    def dilated(q_idx, kv_idx):
        return (q_idx - kv_idx) % 2 == 0

    m = attnlab.build_mask(name) & attnlab.build_mask("causal")
    assert torch.equal(m.materialize(5, 5)[0, 0], grid(5, 5, lambda i, j: (i - j) % 2 == 0 and j <= i))
    m2 = attnlab.build_mask("and", masks=[name, {"name": "padding"}])
    got = m2.materialize(6, 6, tokens=TOKENS)
    expected = torch.stack([grid(6, 6, lambda i, j, b=b: (i - j) % 2 == 0 and TOKENS[b, j] != 0) for b in range(2)])
    assert torch.equal(got[:, 0], expected)
