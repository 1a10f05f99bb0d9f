"""Every performance shortcut equals its eager reference, in float64, for outputs and gradients.

The shortcuts: SDPA with ``is_causal=True`` instead of a causal mask tensor; prepared position-only masks cached
per shape (with their causal / all-visible facts); the encoder's key-padding mask built per batch while the
structural mask is cached; T5's and Shaw's biases gathered along the last dimension; dropout calls skipped at
p = 0. References are written out here from the formulas (loops, dense masks), not from attnlab's fast path.
"""

from __future__ import annotations

import math

import helpers
import pytest
import torch
import torch.nn.functional as F
from conftest import SDPACalls, assert_same, randn
from conftest import randomize_ as _randomize
from helpers import grid, score_cases

import attnlab
from attnlab.masks import prepare_mask

# the sdpa fast path and its biases: without the tiled kernel, which takes every biased softmax first
pytestmark = pytest.mark.usefixtures("single_thread", "without_tiled")

ATOL = 1e-10
B, L, D_MODEL, H = 2, 7, 12, 3
NOT_SDPA = ("additive", "linear")  # every other built-in (a new one too) must take SDPA
SDPA_SCORES = [(name, params) for _, name, params in score_cases() if name not in NOT_SDPA]


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter N(0, 0.5²)."""
    return _randomize(module, seed, scale=0.5)


def fastpath_mha(score: str, params: dict, d_k: int = 4, seed: int = 0) -> attnlab.MultiHeadAttention:
    return helpers.make_mha(D_MODEL, H, d_k, 5, seed=seed, score=score, **params)


# ---------------------------------------------------------------- causal: is_causal=True instead of a mask


@pytest.mark.parametrize(("score", "params"), SDPA_SCORES, ids=[s for s, _ in SDPA_SCORES])
def test_causal_mask_fast_path_equals_eager_and_dense_mask(score, params):
    """Causal as a Mask object (the is_causal shortcut for bias-free scores) = the same mask as a dense tensor =
    the eager path, outputs and gradients; with d_k (4) ≠ d_model / H (4 · 3 ≠ 12 is not required)."""
    mha = fastpath_mha(score, params)
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    inputs = [x, *mha.parameters()]
    causal = attnlab.build_mask("causal")
    with SDPACalls() as spy:
        fast, _ = mha(x, mask=causal)
    dense, _ = mha(x, mask=grid(L, L, lambda i, j: j <= i))
    eager = mha.attend(x, mask=causal).out
    assert_same(fast, eager, inputs)
    assert_same(dense, eager, inputs)
    (call,) = spy.kwargs
    has_bias = score in ("relative_position", "t5_bias", "alibi")  # the presets: a score plus a position bias
    assert (mha.position_bias is not None) is has_bias
    assert call["is_causal"] is (not has_bias)
    assert (call["attn_mask"] is None) is (not has_bias)


def test_causal_shortcut_not_taken_for_cross_attention_of_other_length():
    mha = fastpath_mha("scaled_dot", {})
    x, kv = randn(B, 4, D_MODEL, seed=1).requires_grad_(), randn(B, 6, D_MODEL, seed=2).requires_grad_()
    causal = attnlab.build_mask("causal")
    with SDPACalls() as spy:
        fast, _ = mha(x, key_value=kv, mask=causal)
    assert spy.kwargs[0]["is_causal"] is False
    assert_same(fast, mha.attend(x, key_value=kv, mask=causal).out, [x, kv, *mha.parameters()])


def test_alibi_bias_combined_with_a_cached_mask_is_cached_and_equals_eager():
    """ALiBi's constant bias + a cached causal mask: the −inf-filled bias is built once, later calls reuse it, and
    both calls equal the eager path (values and gradients)."""
    mha = fastpath_mha("alibi", {})
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    causal = attnlab.build_mask("causal")
    first, _ = mha(x, mask=causal)
    pm = prepare_mask(causal, L, L, torch.device("cpu"))
    (entry,) = pm.derived.values()
    second, _ = mha(x, mask=causal)
    (again,) = pm.derived.values()
    assert again[1] is entry[1]
    eager = mha.attend(x, mask=causal).out
    assert_same(first, eager, [x, *mha.parameters()])
    assert_same(second, eager, [x, *mha.parameters()])


# ---------------------------------------------------------------- cached prepared masks


def test_position_only_masks_are_prepared_once_per_shape_and_device():
    causal = attnlab.build_mask("causal")
    a = prepare_mask(causal, 5, 5, torch.device("cpu"))
    assert prepare_mask(causal, 5, 5, torch.device("cpu")) is a
    assert prepare_mask(causal, 6, 6, torch.device("cpu")) is not a
    assert a.is_causal and a.all_visible
    torch.testing.assert_close(a.allowed[0, 0], grid(5, 5, lambda i, j: j <= i))
    window = prepare_mask(attnlab.build_mask("sliding_window", window=2), 5, 5, torch.device("cpu"))
    assert not window.is_causal and window.all_visible
    both = prepare_mask(attnlab.build_mask("causal") & attnlab.build_mask("sliding_window", window=2), 5, 5, "cpu")
    assert not both.is_causal  # causal and windowed is not j <= i


def test_a_composed_or_user_written_causal_mask_gets_sdpas_is_causal():
    """``Mask.is_causal`` is a property of composed masks, and any position-only mask whose tensor is j <= i is
    found to be causal when prepared, so SDPA gets ``is_causal=True`` (and equals the eager path)."""

    class MyCausal(attnlab.Mask):
        def mask_mod(self, q_idx, kv_idx, tokens, lengths):
            return kv_idx <= q_idx

    composed = attnlab.build_mask("causal") & attnlab.build_mask("none")
    assert composed.is_causal and not MyCausal().is_causal
    assert not (attnlab.build_mask("causal") & attnlab.build_mask("sliding_window", window=2)).is_causal
    mha = fastpath_mha("scaled_dot", {})
    x = randn(B, L, D_MODEL, seed=1).requires_grad_()
    for mask in (composed, MyCausal()):
        assert prepare_mask(mask, L, L, "cpu").is_causal
        with SDPACalls() as spy:
            fast, _ = mha(x, mask=mask)
        assert spy.kwargs[0]["is_causal"] is True and spy.kwargs[0]["attn_mask"] is None
        assert_same(fast, mha.attend(x, mask=grid(L, L, lambda i, j: j <= i)).out, [x, *mha.parameters()])


def test_cached_mask_with_blind_rows_still_zeroes_them():
    """A position-only mask whose first query row sees nothing: all_visible is False, and the fast path gives that
    row a zero output, equal to the eager path (values and gradients)."""

    class BlindFirstRow(attnlab.Mask):
        def mask_mod(self, q_idx, kv_idx, tokens, lengths):
            return (q_idx > 0) & (kv_idx <= q_idx)

    mask = BlindFirstRow()
    assert not prepare_mask(mask, L, L, torch.device("cpu")).all_visible
    for score, params in SDPA_SCORES:
        mha = fastpath_mha(score, params)
        x = randn(B, L, D_MODEL, seed=1).requires_grad_()
        fast, _ = mha(x, mask=mask)
        eager = mha.attend(x, mask=mask).out
        assert_same(fast, eager, [x, *mha.parameters()])
        # a blind row's attention output is zero, so its projected output is out_proj's bias
        torch.testing.assert_close(fast[:, 0], mha.out_proj.bias.expand(B, D_MODEL), rtol=ATOL, atol=ATOL)


# ---------------------------------------------------------------- the encoder's masks


VOCAB = 11


def encoder_tokens() -> torch.Tensor:
    t = torch.randint(1, VOCAB, (B, L), generator=torch.Generator().manual_seed(0))
    t[0, 5:] = 0
    t[1, 2] = 0  # a pad in the middle
    return t


def dense_reference_mask(kind: str, tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, L, L) bool written from the definitions with loops: True = may attend."""
    m = torch.ones(B, 1, L, L, dtype=torch.bool)
    for b in range(B):
        for i in range(L):
            for j in range(L):
                ok = tokens[b, j] != 0
                if lengths is not None:
                    ok = ok and j < int(lengths[b])
                if "causal" in kind:
                    ok = ok and j <= i
                if "window" in kind:
                    ok = ok and abs(i - j) < 2
                m[b, 0, i, j] = bool(ok)
    return m


def encoder_with_dense_mask(enc: attnlab.Encoder, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The encoder's forward with a given dense mask in every layer (fast path)."""
    h = enc.embed(tokens)
    if enc.pos is not None:
        h = h + enc.pos(tokens.shape[1])
    for layer in enc.layers:
        h, _ = layer(h, mask)
    return enc.norm(h)


MASK_KINDS = {
    "padding": None,
    "causal": "causal",
    "window": {"name": "sliding_window", "window": 2},
    "causal&window": {"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 2}]},
}


@pytest.mark.parametrize("use_lengths", [False, True], ids=["pad_id", "pad_id+lengths"])
@pytest.mark.parametrize("kind", list(MASK_KINDS))
@pytest.mark.parametrize(("score", "params"), SDPA_SCORES, ids=[s for s, _ in SDPA_SCORES])
def test_encoder_masks_fast_path_equals_dense_reference_and_eager(score, params, kind, use_lengths):
    """Padding (+ lengths) combined with causal / sliding-window masks, d_k = 5 ≠ d_model / H = 4: the encoder's
    fast path equals the same layers run with a dense loop-built mask, and its eager path, values and gradients."""
    torch.manual_seed(0)
    enc = attnlab.Encoder(
        VOCAB, D_MODEL, H, 2, d_k=5, score=score, score_params=params, mask=MASK_KINDS[kind], pad_id=0
    ).double()
    randomize_(enc, seed=3)
    enc.eval()
    tokens = encoder_tokens()
    lengths = torch.tensor([L, L - 1]) if use_lengths else None
    params_ = list(enc.parameters())
    fast = enc(tokens, lengths=lengths)
    eager, _ = enc(tokens, lengths=lengths, return_attention=True)
    ref = encoder_with_dense_mask(enc, tokens, dense_reference_mask(kind, tokens, lengths))
    assert_same(fast, ref, params_)
    assert_same(eager, ref, params_)


def test_encoder_causal_without_padding_takes_is_causal_and_caches_the_mask():
    enc = attnlab.Encoder(VOCAB, D_MODEL, H, 2, mask="causal").double().eval()
    randomize_(enc)
    tokens = encoder_tokens().clamp(min=1)
    assert enc.build_mask(tokens) is enc.build_mask(tokens)
    with SDPACalls() as spy:
        fast = enc(tokens)
    assert [c["is_causal"] for c in spy.kwargs] == [True, True]
    ref = encoder_with_dense_mask(enc, tokens, grid(L, L, lambda i, j: j <= i))
    assert_same(fast, ref, list(enc.parameters()))


def test_key_padding_mask_is_built_per_batch_in_its_small_shape():
    enc = attnlab.Encoder(VOCAB, D_MODEL, H, 1, pad_id=0)
    pm = enc.build_mask(encoder_tokens())
    assert pm.allowed.shape == (B, 1, 1, L)
    torch.testing.assert_close(pm.allowed[:, 0, 0], encoder_tokens() != 0)


# ---------------------------------------------------------------- gathered position biases


def test_shaw_bias_gather_equals_loop_reference_values_and_gradients():
    clip, d_k, lq, lk = 2, 4, 5, 8  # Lq ≠ Lk: cross-attention shapes too
    shaw = attnlab.build_score("relative_position", d_k=d_k, num_heads=H, clip=clip).position_bias.double()
    randomize_(shaw)
    q = randn(B, H, lq, d_k, seed=1).requires_grad_()
    bias = shaw.bias(q, lk)
    rows = []
    for i in range(lq):
        row = [q[:, :, i] @ shaw.rel_k[min(max(j - i, -clip), clip) + clip] / math.sqrt(d_k) for j in range(lk)]
        rows.append(torch.stack(row, dim=-1))
    ref = torch.stack(rows, dim=-2)
    assert_same(bias, ref, [q, shaw.rel_k])


def test_t5_bias_gather_equals_table_lookup_values_and_gradients():
    t5 = attnlab.build_score("t5_bias", d_k=4, num_heads=H, num_buckets=8, max_distance=16).position_bias.double()
    randomize_(t5)
    q = randn(1, H, 6, 4, seed=1)
    bias = t5.bias(q, 9)
    buckets = t5.buckets(6, 9, q.device)
    ref = torch.stack([torch.stack([t5.rel_bias[buckets[i, j]] for j in range(9)]) for i in range(6)])  # (6, 9, H)
    assert_same(bias, ref.permute(2, 0, 1)[None], [t5.rel_bias])
    assert bias.is_contiguous()


@pytest.mark.parametrize("name", ["t5_bias", "alibi", "relative_position"])
def test_position_caches_hit_on_the_second_call(name):
    bias = attnlab.build_score(name, d_k=4, num_heads=H).position_bias
    q = torch.randn(1, H, 6, 4)
    bias.bias(q, 6)
    cached = dict(bias._tables)
    assert cached
    bias.bias(q, 6)
    assert bias._tables.keys() == cached.keys()
    assert all(bias._tables[k] is cached[k] for k in cached)


# ---------------------------------------------------------------- dropout at p = 0


def test_zero_dropout_is_not_called_in_training(monkeypatch):
    calls = []
    original = F.dropout
    monkeypatch.setattr(F, "dropout", lambda *a, **k: calls.append(1) or original(*a, **k))
    enc = attnlab.Encoder(VOCAB, D_MODEL, H, 2, dropout=0.0).double().train()
    tokens = encoder_tokens().clamp(min=1)
    out = enc(tokens)
    assert calls == []
    enc_drop = attnlab.Encoder(VOCAB, D_MODEL, H, 2, dropout=0.1).train()
    enc_drop(tokens)
    assert calls  # the p > 0 path still drops
    torch.testing.assert_close(out, enc.eval()(tokens), rtol=ATOL, atol=ATOL)
