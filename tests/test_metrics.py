"""Tests for attnlab.metrics against hand-computed numbers and a plain-Python reference loop."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.metrics import attention_stats, flatten_stats, summarize

LN2, LN3 = math.log(2.0), math.log(3.0)


def _t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def _close(actual: torch.Tensor, expected, tol: float = 1e-12) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol, equal_nan=True)


DIST_KEYS = ("entropy", "entropy_norm", "max_prob", "saturation", "attn_distance")


def reference_stats(weights, logits=None, key_mask=None, threshold=0.99, signed=None):
    """Plain-Python loop over rows: the definition of each metric, written out independently.

    Distribution metrics use the row's nonnegative part renormalised to sum 1, over the rows that have one;
    row_mass, support and negative_mass use the raw visible weights of every row with a visible key."""
    w = weights.double()
    B, H, Lq, Lk = w.shape
    mask = torch.ones(B, H, Lq, Lk, dtype=torch.bool) if key_mask is None else key_mask.expand(B, H, Lq, Lk)
    if signed is None:
        signed = any(
            float(w[b, h, i, j]) < 0
            for b in range(B)
            for h in range(H)
            for i in range(Lq)
            for j in range(Lk)
            if bool(mask[b, h, i, j])
        )
    out = {}
    for h in range(H):
        acc = {k: [] for k in (*DIST_KEYS, "row_mass", "support", "first_mass", "negative_mass", "std")}
        lmax = -math.inf
        for b in range(B):
            for i in range(Lq):
                keys = [j for j in range(Lk) if bool(mask[b, h, i, j])]
                if not keys:
                    continue
                ws = [float(w[b, h, i, j]) for j in keys]
                acc["row_mass"].append(sum(ws))
                acc["support"].append(sum(1 for x in ws if x != 0) / len(keys))
                acc["negative_mass"].append(sum(-x for x in ws if x < 0))
                if i >= 1 and keys[0] == 0:
                    acc["first_mass"].append(float(w[b, h, i, 0]))
                if logits is not None:
                    ss = [float(logits[b, h, i, j]) for j in keys]
                    mu = sum(ss) / len(ss)
                    acc["std"].append(math.sqrt(sum((s - mu) ** 2 for s in ss) / len(ss)))
                    lmax = max(lmax, *ss)
                pos_mass = sum(x for x in ws if x > 0)
                if pos_mass == 0:
                    continue  # no distribution: out of the five distribution metrics only
                ps = [max(x, 0.0) / pos_mass for x in ws]
                ent = -sum(p * math.log(p) for p in ps if p > 0)
                acc["entropy"].append(ent)
                if len(keys) >= 2:
                    acc["entropy_norm"].append(ent / math.log(len(keys)))
                acc["max_prob"].append(max(ps))
                acc["saturation"].append(1.0 if max(ps) > threshold else 0.0)
                acc["attn_distance"].append(sum(p * abs(i - j) for p, j in zip(ps, keys, strict=True)))

        def mean(xs):
            return sum(xs) / len(xs) if xs else math.nan

        for k in (*DIST_KEYS, "row_mass", "support", "first_mass", *(("negative_mass",) if signed else ())):
            out.setdefault(k, []).append(mean(acc[k]))
        if logits is not None:
            out.setdefault("logit_std", []).append(mean(acc["std"]))
            out.setdefault("logit_max", []).append(lmax if lmax > -math.inf else math.nan)
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def _masked_softmax(logits, mask):
    masked = logits.masked_fill(~mask, -math.inf)
    w = torch.softmax(masked, dim=-1)
    return torch.nan_to_num(w, nan=0.0)  # fully masked rows -> all zero


# ---------------------------------------------------------------- hand values


def test_hand_computed_rows():
    # head 0: three hand-picked rows; head 1: uniform rows over 3 keys.
    head0 = [[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.0, 0.0, 1.0]]
    head1 = [[1 / 3] * 3] * 3
    w = _t([[head0, head1]])  # (1, 2, 3, 3)
    st = attention_stats(w)
    assert set(st) == {*DIST_KEYS, "row_mass", "support", "first_mass"}  # no negative_mass: every weight is >= 0
    for v in st.values():
        assert v.shape == (2,)

    h_row0 = 1.5 * LN2  # 0.5 ln 2 + 2 * 0.25 ln 4
    h_row1 = 0.2 * math.log(10.0) + 0.8 * math.log(1.25)  # -(2 * 0.1 ln 0.1 + 0.8 ln 0.8)
    h_row2 = 0.0  # one-hot, 0 log 0 = 0
    _close(st["entropy"], [(h_row0 + h_row1 + h_row2) / 3, LN3])
    _close(st["entropy_norm"], [(h_row0 + h_row1 + h_row2) / (3 * LN3), 1.0])
    _close(st["max_prob"], [(0.5 + 0.8 + 1.0) / 3, 1 / 3])
    _close(st["saturation"], [1 / 3, 0.0])
    # distances: query 0 -> 0.25*1 + 0.25*2 = 0.75; query 1 -> 0.1 + 0.1 = 0.2; query 2 -> 0 (attends itself)
    # uniform head: (0+1+2)/3 = 1, (1+0+1)/3 = 2/3, (2+1+0)/3 = 1 -> mean 8/9
    _close(st["attn_distance"], [(0.75 + 0.2 + 0.0) / 3, 8 / 9])
    # the threshold is strict and configurable: 0.8 and 1.0 exceed 0.75
    _close(attention_stats(w, threshold=0.75)["saturation"], [2 / 3, 0.0])
    _close(attention_stats(w, threshold=0.8)["saturation"], [1 / 3, 0.0])
    _close(st["row_mass"], [1.0, 1.0])
    _close(st["support"], [(1 + 1 + 1 / 3) / 3, 1.0])  # the one-hot row has 1 of 3 keys nonzero
    _close(st["first_mass"], [(0.1 + 0.0) / 2, 1 / 3])  # rows 1 and 2 only: row 0's weight on key 0 is left out


def test_first_mass_under_a_causal_mask_and_a_window():
    # causal: row 0 sees only key 0 and is left out; a sliding window that hides key 0 from row 3 leaves it out too
    w = _t([[[[1.0, 0, 0, 0], [0.7, 0.3, 0, 0], [0.2, 0.4, 0.4, 0], [0.0, 0.5, 0.25, 0.25]]]])
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    _close(attention_stats(w, key_mask=causal)["first_mass"], [(0.7 + 0.2 + 0.0) / 3])
    window = causal & ~torch.tensor([[False] * 4] * 3 + [[True, False, False, False]])
    _close(attention_stats(w, key_mask=window)["first_mass"], [(0.7 + 0.2) / 2])
    _close(attention_stats(w[..., :1, :])["first_mass"], [math.nan])  # one query: no row i >= 1


def test_attn_distance_hand_example_with_offsets():
    # 1 head, 3 queries, 4 keys; query i at position i, key j at position j.
    w = _t([[[[0.0, 0.0, 0.0, 1.0], [0.25, 0.75, 0.0, 0.0], [0.5, 0.0, 0.0, 0.5]]]])
    # query 0 -> key 3: 3; query 1: 0.25*1 + 0.75*0 = 0.25; query 2: 0.5*2 + 0.5*1 = 1.5
    _close(attention_stats(w)["attn_distance"], [(3 + 0.25 + 1.5) / 3])


def test_uniform_rows_normalised_entropy_is_one():
    for lk in (2, 7, 64):
        w = torch.full((2, 3, 5, lk), 1.0 / lk, dtype=torch.float32)
        st = attention_stats(w)
        torch.testing.assert_close(st["entropy_norm"], torch.ones(3), rtol=0, atol=1e-6)
        torch.testing.assert_close(st["entropy"], torch.full((3,), math.log(lk)), rtol=1e-6, atol=1e-6)
        assert torch.all(st["saturation"] == 0)


def test_one_hot_rows():
    idx = torch.tensor([[0, 3, 1, 2, 4]])  # arbitrary attended key per query
    w = torch.nn.functional.one_hot(idx, 5).to(torch.float32).expand(2, 3, 5, 5).contiguous()
    st = attention_stats(w)
    assert torch.all(st["entropy"] == 0)
    assert torch.all(st["entropy_norm"] == 0)
    assert torch.all(st["max_prob"] == 1)
    assert torch.all(st["saturation"] == 1)
    _close(st["attn_distance"], [(0 + 2 + 1 + 1 + 0) / 5] * 3, tol=1e-6)


# ---------------------------------------------------------------- masks


def test_padding_mask_hand_values():
    # example 0 sees 3 keys, example 1 has the last key padded away (weight 0 there).
    w = _t([[[[0.5, 0.5, 0.0]]], [[[0.5, 0.5, 0.0]]]])  # (2, 1, 1, 3)
    key_mask = torch.tensor([[True, True, True], [True, True, False]]).view(2, 1, 1, 3)
    st = attention_stats(w, key_mask=key_mask)
    _close(st["entropy"], [LN2])
    # normalised by log 3 (3 visible) and log 2 (2 visible) respectively
    _close(st["entropy_norm"], [(LN2 / LN3 + 1.0) / 2])
    _close(st["max_prob"], [0.5])


def test_padding_mask_matches_reference_loop():
    g = torch.Generator().manual_seed(1)
    B, H, L = 3, 2, 6
    logits = torch.randn(B, H, L, L, generator=g, dtype=torch.float64) * 3
    lengths = torch.tensor([6, 4, 2])
    key_mask = (torch.arange(L)[None, :] < lengths[:, None]).view(B, 1, 1, L)
    mask = key_mask.expand(B, H, L, L)
    w = _masked_softmax(logits, mask)
    logits_inf = logits.masked_fill(~mask, -math.inf)
    st = attention_stats(w, logits=logits_inf, key_mask=key_mask, threshold=0.6)
    ref = reference_stats(w, logits=logits, key_mask=key_mask, threshold=0.6)
    assert set(st) == set(ref)
    for k in ref:
        _close(st[k], ref[k], tol=1e-10)


def test_causal_mask_hand_values():
    # uniform over the visible prefix: row i has i+1 keys, entropy ln(i+1), normalised entropy 1.
    L = 4
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    w = causal.double() / causal.sum(-1, keepdim=True)
    st = attention_stats(w.view(1, 1, L, L), key_mask=causal)
    _close(st["entropy"], [(0 + LN2 + LN3 + math.log(4)) / 4])
    # row 0 (one key) is excluded: the 0/0 would otherwise pull this away from 1
    _close(st["entropy_norm"], [1.0])
    _close(st["max_prob"], [(1 + 1 / 2 + 1 / 3 + 1 / 4) / 4])
    _close(st["saturation"], [1 / 4])  # only row 0 (weight 1 on its single key)
    # distances: row i uniform over 0..i -> mean of (i, i-1, ..., 0) = i/2
    _close(st["attn_distance"], [(0 + 0.5 + 1.0 + 1.5) / 4])


def test_causal_mask_matches_reference_loop():
    g = torch.Generator().manual_seed(2)
    B, H, L = 2, 3, 7
    logits = torch.randn(B, H, L, L, generator=g, dtype=torch.float64) * 2
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    w = _masked_softmax(logits, causal.expand(B, H, L, L))
    # masked logits arbitrary (not -inf) must be ignored too
    junk = logits.masked_fill(~causal, 1e6)
    st = attention_stats(w, logits=junk, key_mask=causal)
    ref = reference_stats(w, logits=logits, key_mask=causal)
    for k in ref:
        _close(st[k], ref[k], tol=1e-10)
    # explicitly: row i normalised by log(i + 1), row 0 left out
    row_h = -(w * torch.where(w > 0, w.log(), torch.zeros_like(w))).sum(-1)  # (B, H, L)
    norms = torch.log(torch.arange(1, L + 1, dtype=torch.float64))
    expected = (row_h[..., 1:] / norms[1:]).mean(dim=(0, 2))
    _close(st["entropy_norm"], expected, tol=1e-10)


def test_fully_masked_rows_excluded_and_nan_free():
    g = torch.Generator().manual_seed(3)
    B, H, L = 2, 2, 5
    logits = torch.randn(B, H, L, L, generator=g, dtype=torch.float64)
    key_mask = torch.ones(B, 1, L, L, dtype=torch.bool)
    key_mask[0, 0, 1] = False  # query 1 of example 0 sees nothing
    key_mask[1, 0, 3:] = False  # queries 3, 4 of example 1 see nothing
    mask = key_mask.expand(B, H, L, L)
    w = _masked_softmax(logits, mask)
    assert torch.all(w[~mask.any(-1)] == 0)
    st = attention_stats(w, logits=logits.masked_fill(~mask, -math.inf), key_mask=key_mask)
    for k, v in st.items():
        assert torch.isfinite(v).all(), k
    ref = reference_stats(w, logits=logits, key_mask=key_mask)
    for k in ref:
        _close(st[k], ref[k], tol=1e-10)
    # same as dropping those rows by hand: example 0 keeps queries {0,2,3,4}, example 1 keeps {0,1,2}
    keep_w = torch.cat([w[0, :, [0, 2, 3, 4]], w[1, :, :3]], dim=1)  # (H, 7, L)
    max_prob = keep_w.amax(-1).mean(-1)
    _close(st["max_prob"], max_prob, tol=1e-12)


def test_rows_with_one_key_and_heads_with_no_rows():
    # Lk = 1: every row has one visible key -> entropy_norm undefined (NaN), the rest well defined.
    st = attention_stats(torch.ones(2, 3, 4, 1), logits=torch.randn(2, 3, 4, 1))
    assert torch.isnan(st["entropy_norm"]).all()
    assert torch.all(st["entropy"] == 0) and torch.all(st["max_prob"] == 1)
    assert torch.all(st["saturation"] == 1)
    assert torch.all(st["logit_std"] == 0)
    # a head whose rows are all fully masked gets NaN for its averages; other heads unaffected
    w = torch.full((1, 2, 3, 4), 0.25)
    w[:, 1] = 0.0
    key_mask = torch.tensor([True, False]).view(1, 2, 1, 1)
    st = attention_stats(w, logits=torch.zeros(1, 2, 3, 4), key_mask=key_mask)
    for k, v in st.items():
        assert torch.isfinite(v[0]), k
        assert torch.isnan(v[1]), k


# ---------------------------------------------------------------- logits


def test_logit_std_and_max_hand_values():
    # head 0 rows: [1, 3 | masked 100], [2, 2, 2], [0, 4 | masked -inf]
    # head 1 rows: [-1, 1, 3], [7, 9, 11], fully masked row of -inf
    logits = _t(
        [
            [
                [[1.0, 3.0, 100.0], [2.0, 2.0, 2.0], [0.0, 4.0, -math.inf]],
                [[-1.0, 1.0, 3.0], [7.0, 9.0, 11.0], [-math.inf, -math.inf, -math.inf]],
            ]
        ]
    )
    key_mask = torch.tensor(
        [
            [[True, True, False], [True, True, True], [True, True, False]],
            [[True, True, True], [True, True, True], [False, False, False]],
        ]
    ).view(1, 2, 3, 3)
    w = _masked_softmax(logits.masked_fill(~key_mask, -math.inf), key_mask)
    st = attention_stats(w, logits=logits, key_mask=key_mask)
    # head 0: stds 1, 0, 2 -> mean 1; max over visible = 4 (100 is masked)
    # head 1: [-1, 1, 3] and [7, 9, 11] both have population std sqrt(8/3); third row excluded; max 11
    _close(st["logit_std"], [1.0, math.sqrt(8 / 3)])
    _close(st["logit_max"], [4.0, 11.0])


def test_logit_max_is_over_batch_and_rows():
    logits = torch.zeros(3, 2, 4, 5, dtype=torch.float64)
    logits[2, 0, 3, 1] = 7.5
    logits[0, 1, 0, 4] = -0.5  # head 1 max stays 0
    w = torch.softmax(logits, -1)
    _close(attention_stats(w, logits=logits)["logit_max"], [7.5, 0.0])


def test_logits_with_two_maps_per_head_are_component_major():
    # differential attention: weights (B, H, Lq, Lk), logits (B, 2H, Lq, Lk), map c of head h at index c*H + h
    logits = torch.zeros(1, 4, 2, 3, dtype=torch.float64)
    logits[0, :, 0, 0] = torch.tensor([1.0, 2.0, 30.0, 4.0])  # head 0: maps 1 and 30; head 1: maps 2 and 4
    logits[0, 2, 1] = torch.tensor([0.0, 2.0, 99.0])  # head 0, map 1, query 1: key 2 (99) is masked
    key_mask = torch.tensor([[True, True, True], [True, True, False]])
    w = torch.full((1, 2, 2, 3), 1 / 3, dtype=torch.float64)
    w[..., 1, :] = torch.tensor([0.5, 0.5, 0.0])
    st = attention_stats(w, logits=logits, key_mask=key_mask)
    _close(st["logit_max"], [30.0, 4.0])
    # head 0 rows: map 0 [1, 0, 0], [0, 0]; map 1 [30, 0, 0], [0, 2]; head 1: [2, 0, 0], [0, 0], [4, 0, 0], [0, 0]
    std3 = lambda a: math.sqrt(2 * a * a / 9)  # noqa: E731  population std of [a, 0, 0]
    _close(st["logit_std"], [(std3(1) + 0 + std3(30) + 1) / 4, (std3(2) + std3(4)) / 4])
    # random: the same as the two maps stacked as extra batch elements
    g = torch.Generator().manual_seed(27)
    B, H, L = 2, 3, 6
    logits = torch.randn(B, 2 * H, L, L, generator=g, dtype=torch.float64) * 2
    mask = _mixed_mask(B, H, L, g)
    w = _masked_softmax(logits[:, :H], mask) - 0.5 * _masked_softmax(logits[:, H:], mask)
    st = attention_stats(w, logits=logits, key_mask=mask)
    ref = reference_stats(
        torch.cat([w, w]), logits=torch.cat([logits[:, :H], logits[:, H:]]), key_mask=mask.repeat(2, 1, 1, 1)
    )
    assert set(st) == set(ref)
    for k in ref:
        _close(st[k], ref[k], tol=1e-10)
    with pytest.raises(ValueError, match="logits shape"):
        attention_stats(w, logits=logits[:, :5], key_mask=mask)
    with pytest.raises(ValueError, match="logits shape"):
        attention_stats(w, logits=logits[:, :, :, :5], key_mask=mask)


# ---------------------------------------------------------------- dtypes


def test_bf16_inputs_and_detached_float_outputs():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 8, 8, generator=g) * 2
    causal = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    w32 = _masked_softmax(logits, causal.expand(2, 3, 8, 8))
    w16 = w32.to(torch.bfloat16).requires_grad_()
    l16 = logits.masked_fill(~causal, -math.inf).to(torch.bfloat16).requires_grad_()
    st16 = attention_stats(w16, logits=l16, key_mask=causal)
    ref = reference_stats(w32, logits=logits, key_mask=causal)
    for k, v in st16.items():
        assert v.dtype == torch.float32, k
        assert not v.requires_grad, k
        assert torch.isfinite(v).all(), k
        # bf16 has ~3 significant digits
        torch.testing.assert_close(v.double(), ref[k], rtol=2e-2, atol=2e-2)
    assert attention_stats(w32)["entropy"].dtype == torch.float32
    assert attention_stats(w32.double())["entropy"].dtype == torch.float64


# ---------------------------------------------------------------- other normalizers


def _softmax1(logits, mask):
    """exp(s_j) / (1 + sum_k exp(s_k)) over visible keys (softmax with an extra zero logit): rows sum to < 1."""
    s = logits.masked_fill(~mask, -math.inf)
    m = s.amax(-1, keepdim=True).clamp_min(0.0)  # the extra logit is 0; fully masked rows get m = 0
    e = torch.exp(s - m)
    return e / (torch.exp(-m) + e.sum(-1, keepdim=True))


def _sparse(logits, mask):
    """Softmax with every weight below 1/n_visible set to exactly 0, renormalised: exact zeros, rows sum to 1."""
    w = _masked_softmax(logits, mask)
    n = mask.sum(-1, keepdim=True).clamp_min(1)
    w = torch.where(w >= 1.0 / n, w, torch.zeros_like(w))
    return w / w.sum(-1, keepdim=True).clamp_min(1e-300)


def _softpick(logits, mask):
    """relu(exp(s) - 1) / sum |exp(s) - 1| over visible keys: exact zeros, rows sum to < 1, or are all 0."""
    e = torch.where(mask, torch.expm1(logits), torch.zeros_like(logits))
    return torch.relu(e) / (e.abs().sum(-1, keepdim=True) + 1e-6)


def _sigmoid(logits, mask):
    """Elementwise sigmoid, left nonzero at masked keys too (those entries must be ignored)."""
    del mask
    return torch.sigmoid(logits)


def _differential(logits, mask, lam=0.8):
    """softmax(s) - lam * softmax(s'), with s' a reshuffle of s: signed weights, rows sum to 1 - lam."""
    other = logits.flip(-1).roll(1, dims=-2)
    return _masked_softmax(logits, mask) - lam * _masked_softmax(other, mask)


NORMALIZERS = {
    "softmax1": _softmax1,
    "sparse": _sparse,
    "softpick": _softpick,
    "sigmoid": _sigmoid,
    "differential": _differential,
}


def _mixed_mask(B, H, L, generator):
    """Causal & padding, with a few fully masked rows; (B, H, L, L) bool."""
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    lengths = torch.randint(2, L + 1, (B,), generator=generator)
    padding = (torch.arange(L)[None, :] < lengths[:, None]).view(B, 1, 1, L)
    mask = (causal & padding).expand(B, H, L, L).clone()
    mask[0, 0, 2] = False
    mask[-1, -1, -1] = False
    return mask


@pytest.mark.parametrize("name", sorted(NORMALIZERS))
def test_other_normalizers_match_reference_loop(name):
    g = torch.Generator().manual_seed(10 + sorted(NORMALIZERS).index(name))
    B, H, L = 3, 2, 7
    logits = torch.randn(B, H, L, L, generator=g, dtype=torch.float64) * 2
    logits[1, 0, 4:] = -logits[1, 0, 4:].abs() - 0.1  # some rows with every logit < 0 (all-zero softpick rows)
    mask = _mixed_mask(B, H, L, g)
    w = NORMALIZERS[name](logits, mask)
    st = attention_stats(w, logits=logits.masked_fill(~mask, -math.inf), key_mask=mask, threshold=0.6)
    ref = reference_stats(w, logits=logits, key_mask=mask, threshold=0.6)
    assert set(st) == set(ref)
    for k in ref:
        _close(st[k], ref[k], tol=1e-10)
    # the inputs really are of the kind named
    mass = torch.where(mask, w, torch.zeros_like(w)).sum(-1)[mask.any(-1)]
    if name in ("softmax1", "softpick"):
        assert (mass < 1 - 1e-3).any() and (mass < 1 + 1e-12).all()
    if name in ("sparse", "softpick"):
        assert ((w == 0) & mask).any()
        assert (st["support"] < 1).all()
    if name == "softpick":
        assert (mass == 0).any()
    assert ("negative_mass" in st) == (name == "differential")


def test_row_mass_below_one_keeps_the_distribution_of_the_row():
    g = torch.Generator().manual_seed(20)
    B, H, L = 2, 3, 6
    logits = torch.randn(B, H, L, L, generator=g, dtype=torch.float64) * 3
    mask = _mixed_mask(B, H, L, g)
    soft = _masked_softmax(logits, mask)
    st_soft = attention_stats(soft, key_mask=mask)
    # softmax1 renormalised is the softmax of the same logits; 0.5 * softmax renormalised is softmax
    for w in (_softmax1(logits, mask), 0.5 * soft):
        st = attention_stats(w, key_mask=mask, threshold=0.9)
        for k in DIST_KEYS:
            _close(st[k], attention_stats(soft, key_mask=mask, threshold=0.9)[k], tol=1e-12)
        expected = [
            sum(float(w[b, h, i][mask[b, h, i]].sum()) for b in range(B) for i in range(L) if mask[b, h, i].any())
            / int(mask[:, h].any(-1).sum())
            for h in range(H)
        ]
        _close(st["row_mass"], expected, tol=1e-12)
        assert (st["row_mass"] < 1 - 1e-3).all()
    _close(attention_stats(0.5 * soft, key_mask=mask)["row_mass"], [0.5] * H, tol=1e-12)
    _close(st_soft["row_mass"], [1.0] * H, tol=1e-12)
    # hand rows: [0.25, 0.25] has mass 0.5 and the distribution [0.5, 0.5]; a sink row [0.45, 0] is one-hot
    w = _t([[[[0.25, 0.25], [0.45, 0.0]]]])
    st = attention_stats(w, threshold=0.99)
    _close(st["row_mass"], [(0.5 + 0.45) / 2])
    _close(st["entropy"], [LN2 / 2])
    _close(st["entropy_norm"], [0.5])
    _close(st["max_prob"], [(0.5 + 1.0) / 2])
    _close(st["saturation"], [0.5])  # the sink row is saturated although its largest raw weight is 0.45
    _close(st["attn_distance"], [(0.5 * 1 + 1.0 * 1) / 2])  # query 0: 0.5*|0-1|; query 1 -> key 0: 1


def test_support_counts_exact_zeros_among_visible_keys():
    # 1 head, 4 keys: [0.5, 0.5, 0, 0] -> 2 of 4; [0.25]*4 -> 1
    w = _t([[[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]]])
    _close(attention_stats(w)["support"], [(0.5 + 1.0) / 2])
    # hiding key 3 of row 0 (weight 0) leaves 2 of 3; a nonzero weight at a masked key is not counted
    w_junk = w.clone()
    w_junk[0, 0, 0, 3] = 7.0
    key_mask = torch.tensor([[True, True, True, False], [True, True, True, True]]).view(1, 1, 2, 4)
    st = attention_stats(w_junk, key_mask=key_mask)
    _close(st["support"], [(2 / 3 + 1.0) / 2])
    _close(st["row_mass"], [1.0])
    _close(st["entropy"], [(LN2 + math.log(4)) / 2])
    # random sparse rows against the loop
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64) * 2
    mask = _mixed_mask(2, 3, 8, g)
    w = _sparse(logits, mask)
    st = attention_stats(w, key_mask=mask)
    ref = reference_stats(w, key_mask=mask)
    _close(st["support"], ref["support"], tol=1e-12)
    assert (st["support"] < 1).all() and (st["support"] > 0).all()


def test_negative_mass_of_signed_weights():
    # query 1 of [0.6, -0.2, 0.6]: mass 1, negative mass 0.2, distribution [0.5, 0, 0.5]
    w = _t([[[[1.0, 0.0, 0.0], [0.6, -0.2, 0.6]]]])
    st = attention_stats(w)
    assert "negative_mass" in st
    _close(st["negative_mass"], [0.1])
    _close(st["row_mass"], [1.0])
    _close(st["support"], [(1 / 3 + 1.0) / 2])
    _close(st["entropy"], [LN2 / 2])  # with the -0.2 kept in (or the row left unrenormalised) this differs
    _close(st["max_prob"], [(1.0 + 0.5) / 2])
    _close(st["attn_distance"], [(0.0 + 1.0) / 2])
    # random differential rows against the loop, signed=None and signed=True alike
    g = torch.Generator().manual_seed(22)
    logits = torch.randn(3, 2, 6, 6, generator=g, dtype=torch.float64) * 2
    mask = _mixed_mask(3, 2, 6, g)
    w = _differential(logits, mask, lam=0.7)
    ref = reference_stats(w, key_mask=mask)
    for signed in (None, True):
        st = attention_stats(w, key_mask=mask, signed=signed)
        assert set(st) == set(ref)
        for k in ref:
            _close(st[k], ref[k], tol=1e-10)
    assert (ref["negative_mass"] > 0.05).all()


def test_negative_mass_absent_for_nonnegative_weights_or_signed_false():
    g = torch.Generator().manual_seed(23)
    logits = torch.randn(2, 2, 5, 5, generator=g, dtype=torch.float64)
    mask = _mixed_mask(2, 2, 5, g)
    for w in (_sparse(logits, mask), _softmax1(logits, mask)):
        assert "negative_mass" not in attention_stats(w, key_mask=mask)
        assert "negative_mass" not in attention_stats(w, key_mask=mask, signed=False)
    # signed weights with signed=False: no key, everything else as with signed=None
    w = _differential(logits, mask)
    assert (w < 0).any()
    st_none = attention_stats(w, key_mask=mask)
    st_false = attention_stats(w, key_mask=mask, signed=False)
    assert set(st_none) - set(st_false) == {"negative_mass"}
    for k in st_false:
        _close(st_false[k], st_none[k], tol=0.0)
    # a negative weight at a masked key does not make the weights signed
    w = _masked_softmax(logits, mask)
    w[~mask] = -1.0
    assert "negative_mass" not in attention_stats(w, key_mask=mask)
    _close(attention_stats(w, key_mask=mask, signed=True)["negative_mass"], [0.0, 0.0])
    with pytest.raises(TypeError):
        attention_stats(w, key_mask=mask, signed="yes")


def test_negative_mass_present_with_signed_true_even_if_nonnegative():
    g = torch.Generator().manual_seed(24)
    w = torch.softmax(torch.randn(2, 3, 4, 4, generator=g), dim=-1)
    st = attention_stats(w, signed=True)
    assert st["negative_mass"].shape == (3,)
    assert st["negative_mass"].dtype == torch.float32
    assert torch.all(st["negative_mass"] == 0)
    # a head with no valid row gets NaN, as every other row mean
    st = attention_stats(w, key_mask=torch.tensor([True, False, True]).view(1, 3, 1, 1), signed=True)
    _close(st["negative_mass"], [0.0, math.nan, 0.0])


def test_rows_of_zero_mass_excluded_from_distribution_stats_only():
    # head 0: [0.2, 0.2, 0] (distribution [0.5, 0.5, 0]); [0, 0, 0] (softpick: nothing); [-0.1, 0, 0] (signed,
    # nothing nonnegative). head 1: three all-zero rows -> no distribution at all.
    w = _t([[[[0.2, 0.2, 0.0], [0.0, 0.0, 0.0], [-0.1, 0.0, 0.0]], [[0.0] * 3] * 3]])
    st = attention_stats(w)
    assert set(st) == {*DIST_KEYS, "row_mass", "support", "first_mass", "negative_mass"}
    _close(st["row_mass"], [(0.4 + 0.0 - 0.1) / 3, 0.0])
    _close(st["support"], [(2 / 3 + 0 + 1 / 3) / 3, 0.0])
    _close(st["negative_mass"], [0.1 / 3, 0.0])
    # only row 0 of head 0 has a distribution
    _close(st["entropy"], [LN2, math.nan])
    _close(st["entropy_norm"], [LN2 / LN3, math.nan])
    _close(st["max_prob"], [0.5, math.nan])
    _close(st["saturation"], [0.0, math.nan])
    _close(st["attn_distance"], [0.5, math.nan])  # query 0: 0.5 * |0 - 1|
    for k, v in attention_stats(w.float()).items():
        assert not torch.isnan(v[0]), k  # NaN only where there is nothing to average


def test_fully_masked_rows_excluded_from_row_mass_and_support():
    # sigmoid weights are nonzero everywhere, also in rows with no visible key and at masked keys
    g = torch.Generator().manual_seed(25)
    B, H, L = 2, 2, 4
    w = torch.sigmoid(torch.randn(B, H, L, L, generator=g, dtype=torch.float64))
    key_mask = torch.ones(B, 1, L, L, dtype=torch.bool)
    key_mask[0, 0, 1] = False  # query 1 of example 0 sees nothing
    key_mask[1, 0, 2:] = False  # queries 2, 3 of example 1 see nothing
    key_mask[:, :, :, 3] = False  # key 3 is padding everywhere
    st = attention_stats(w, key_mask=key_mask)
    keep = torch.cat([w[0, :, [0, 2, 3], :3], w[1, :, :2, :3]], dim=1)  # (H, 5, 3)
    _close(st["row_mass"], keep.sum(-1).mean(-1), tol=1e-12)
    _close(st["support"], [1.0, 1.0])
    ref = reference_stats(w, key_mask=key_mask)
    for k in ref:
        _close(st[k], ref[k], tol=1e-12)


def test_bf16_signed_weights():
    g = torch.Generator().manual_seed(26)
    logits = torch.randn(2, 3, 8, 8, generator=g) * 2
    mask = _mixed_mask(2, 3, 8, g)
    w16 = _differential(logits, mask).to(torch.bfloat16).requires_grad_()
    st = attention_stats(w16, key_mask=mask)
    ref = reference_stats(w16.detach(), key_mask=mask)  # the same bf16 values, in float64
    assert set(st) == set(ref)
    for k, v in st.items():
        assert v.dtype == torch.float32 and not v.requires_grad, k
        torch.testing.assert_close(v.double(), ref[k], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- anchors


@pytest.mark.parametrize("scaled", [False, True])
def test_init_anchors_dot_product_saturation(scaled):
    """Var(q.k) = d_k for q, k ~ N(0, 1): unscaled logits have std sqrt(512) ~ 22.6, so softmax over 64 keys
    is nearly one-hot (Vaswani et al. 2017, §3.2.1); dividing by sqrt(d_k) restores unit-variance logits and
    a broad distribution. Measured with seed 0: unscaled max_prob 0.930, saturation 0.607; scaled max_prob
    0.108, saturation 0."""
    g = torch.Generator().manual_seed(0)
    B, H, L, d_k = 4, 4, 64, 512
    q = torch.randn(B, H, L, d_k, generator=g)
    k = torch.randn(B, H, L, d_k, generator=g)
    logits = q @ k.transpose(-1, -2)
    if scaled:
        logits = logits / math.sqrt(d_k)
    st = attention_stats(torch.softmax(logits, dim=-1), logits=logits)
    s = summarize(st)
    if scaled:
        assert 0.07 <= s["max_prob"] <= 0.16
        assert s["saturation"] == 0.0
        assert 0.8 <= s["logit_std"] <= 1.2
    else:
        assert 0.88 <= s["max_prob"] <= 0.97
        assert 0.45 <= s["saturation"] <= 0.75
        assert 0.8 * math.sqrt(d_k) <= s["logit_std"] <= 1.2 * math.sqrt(d_k)


# ---------------------------------------------------------------- reductions


def test_summarize_ignores_nan():
    stats = {"a": torch.tensor([1.0, math.nan, 3.0]), "b": torch.tensor([math.nan, math.nan])}
    s = summarize(stats)
    assert s["a"] == pytest.approx(2.0)
    assert math.isnan(s["b"])
    assert all(isinstance(v, float) for v in s.values())


def test_flatten_stats_names_and_means():
    per_layer = [
        {"entropy": torch.tensor([1.0, 2.0]), "entropy_norm": torch.tensor([0.5, math.nan])},
        {"entropy": torch.tensor([3.0, 6.0]), "entropy_norm": torch.tensor([0.25, 1.0])},
    ]
    out = flatten_stats(per_layer)
    expected = {
        "attn/L0H0/entropy": 1.0,
        "attn/L0H1/entropy": 2.0,
        "attn/L1H0/entropy": 3.0,
        "attn/L1H1/entropy": 6.0,
        "attn/L0/entropy": 1.5,
        "attn/L1/entropy": 4.5,
        "attn/entropy": 3.0,
        "attn/L0H0/entropy_norm": 0.5,
        "attn/L1H0/entropy_norm": 0.25,
        "attn/L1H1/entropy_norm": 1.0,
        "attn/L0/entropy_norm": 0.5,
        "attn/L1/entropy_norm": 0.625,
        # pooled over the 3 non-NaN heads (0.5 + 0.25 + 1) / 3, not the mean of layer means 0.5625
        "attn/entropy_norm": 1.75 / 3,
    }
    assert set(out) == set(expected) | {"attn/L0H1/entropy_norm"}
    assert math.isnan(out["attn/L0H1/entropy_norm"])
    for k, v in expected.items():
        assert out[k] == pytest.approx(v), k
    assert set(flatten_stats(per_layer[:1], prefix="val/attn")) == {
        "val/attn/L0H0/entropy",
        "val/attn/L0H1/entropy",
        "val/attn/L0/entropy",
        "val/attn/entropy",
        "val/attn/L0H0/entropy_norm",
        "val/attn/L0H1/entropy_norm",
        "val/attn/L0/entropy_norm",
        "val/attn/entropy_norm",
    }


def test_flatten_stats_end_to_end():
    w = torch.full((2, 3, 4, 4), 0.25)
    out = flatten_stats([attention_stats(w), attention_stats(w)])
    assert out["attn/entropy_norm"] == pytest.approx(1.0)
    assert out["attn/L1H2/entropy"] == pytest.approx(math.log(4))
    assert out["attn/saturation"] == 0.0
