"""Normalizers (logits → attention weights) against references written plainly here, row by row.

The references never call attnlab: softmax, softmax1, sink, sigmoid and softpick are their textbook formulas with
``exp``; rowsum (s_j / (Σ s + ε)) and none (s_j) are linear attention's, fed non-negative logits; sparsemax is the
sort-and-threshold rule of Martins & Astudillo (2016, Alg. 1); entmax15 finds τ by a plain bisection on
Σ_j max(x_j/2 − τ, 0)² = 1. Each reference is written once over Python numbers, so the same loops run on floats
(values) and on 0-d float64 tensors (gradients, through autograd; for entmax15 τ is then taken in closed form on the
support the bisection found).
"""

import math

import pytest
import torch
from helpers import NORMALIZERS
from torch import nn

from attnlab.normalizers import (
    _NORMALIZERS,
    Normalizer,
    build_normalizer,
    entmax15,
    list_normalizers,
    register_normalizer,
    sparsemax,
)
from attnlab.registry import UnknownNameError

pytestmark = pytest.mark.usefixtures("single_thread")

NAMES = list(NORMALIZERS)  # every registered built-in
SHAPES = [(2, 3, 4, 5), (1, 2, 3, 1), (2, 1, 5, 3), (1, 1, 1, 4)]
MASKS = ["none", "random", "padding", "causal"]
EPS = 1e-6  # softpick's and rowsum's default ε
# Normalizers of linear attention (rowsum, none) are defined for non-negative logits only (they normalise the
# similarities φ(q)·φ(k) ≥ 0 of a feature map): every test here feeds them |logits| (see logits_for).
NONNEGATIVE = {name for name in NAMES if build_normalizer(name, num_heads=1).is_linear}


# --------------------------------------------------------------------------------------------- references


def num(x):
    """A Python float of a float or 0-d tensor (used only to take decisions: signs, sorting, supports)."""
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def stable_sigmoid(x, exp):
    if num(x) >= 0:
        return 1 / (1 + exp(-x))
    e = exp(x)
    return e / (1 + e)


def sparsemax_tau(z):
    """Martins & Astudillo (2016): sort z descending, k(z) = max{k : 1 + k z_(k) > Σ_{j≤k} z_(j)},
    τ = (Σ_{j≤k(z)} z_(j) − 1) / k(z). Works on floats and on 0-d tensors (τ then carries the gradient)."""
    zs = sorted(z, key=num, reverse=True)
    cum, best_k, best_cum = 0, 0, 0
    for k, v in enumerate(zs, start=1):
        cum = cum + v
        if 1 + k * num(v) > num(cum):
            best_k, best_cum = k, cum
    return (best_cum - 1) / best_k


def entmax15_tau_bisection(x):
    """τ with Σ_j max(x_j/2 − τ, 0)² = 1, by bisection on [max x/2 − 1, max x/2] (the sum falls from ≥ 1 to 0)."""
    h = [v / 2 for v in x]
    lo, hi = max(h) - 1, max(h)
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(max(v - mid, 0.0) ** 2 for v in h) >= 1:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def reference_row(name, s, visible, *, exp=math.exp, sqrt=math.sqrt, sink=0.0, bias=None, eps=EPS):
    """Weights of one row: ``s`` the logits (floats or 0-d tensors), ``visible`` bools; masked keys get 0.0."""
    keys = [j for j, v in enumerate(visible) if v]
    out = [0.0] * len(s)
    if not keys:
        return out
    vs = [s[j] for j in keys]
    if name == "softmax":
        e = [exp(v) for v in vs]
        w = [x / sum(e) for x in e]
    elif name == "softmax1":
        e = [exp(v) for v in vs]
        w = [x / (1 + sum(e)) for x in e]
    elif name == "sink":
        e = [exp(v) for v in vs]
        w = [x / (exp(sink) + sum(e)) for x in e]
    elif name == "sigmoid":
        b = -math.log(len(keys)) if bias is None else bias
        w = [stable_sigmoid(v + b, exp) for v in vs]
    elif name == "softpick":
        d = [exp(v) - 1 for v in vs]
        denom = sum(abs(x) for x in d) + eps
        w = [(x if num(x) > 0 else 0.0) / denom for x in d]
    elif name == "stickbreaking":  # Tan et al. 2025, eq. 3: β_j Π_{k > j} (1 − β_k), the nearest visible key first
        beta = [stable_sigmoid(v, exp) for v in vs]
        w = []
        for a, b in enumerate(beta):
            for later in beta[a + 1 :]:
                b = b * (1 - later)
            w.append(b)
    elif name == "rowsum":  # Katharopoulos et al. 2020, eq. 6: the similarities over their row sum
        denom = sum(vs) + eps
        w = [v / denom for v in vs]
    elif name == "none":
        w = list(vs)
    elif name == "sparsemax":
        tau = sparsemax_tau(vs)
        w = [v - tau if num(v) > num(tau) else 0.0 for v in vs]
    elif name == "entmax15":
        tau_f = entmax15_tau_bisection([num(v) for v in vs])
        h = [v / 2 for v in vs]
        tau = tau_f
        if isinstance(vs[0], torch.Tensor):  # differentiable τ: solve k τ² − 2aτ + q − 1 = 0 on the support
            sup = [x for x in h if num(x) > tau_f]
            k, a, q = len(sup), sum(sup), sum(x * x for x in sup)
            tau = (a - sqrt(a * a - k * (q - 1))) / k
        w = [(x - tau) ** 2 if num(x) > tau_f else 0.0 for x in h]
    else:  # pragma: no cover
        raise AssertionError(name)
    for j, x in zip(keys, w, strict=True):
        out[j] = x
    return out


def full_mask(allowed, shape):
    return torch.ones(shape, dtype=torch.bool) if allowed is None else allowed.expand(shape)


def row_visible(name, mask, b, h, i):
    """The keys row (b, h, i) sees: the mask's, and for stick-breaking (the paper's convention) not the query's own
    key i + Lk − Lq."""
    visible = mask[b, h, i].tolist()
    own = i + mask.shape[-1] - mask.shape[-2]
    if name == "stickbreaking" and 0 <= own < len(visible):
        visible[own] = False
    return visible


def reference(name, logits, allowed, sink=None, **params):
    """Reference weights (float64) with plain floats: a loop over the rows (b, h, i)."""
    B, H, Lq, Lk = logits.shape
    mask = full_mask(allowed, logits.shape)
    out = torch.zeros(B, H, Lq, Lk, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                extra = {} if sink is None else {"sink": float(sink[h])}
                row = reference_row(name, logits[b, h, i].tolist(), row_visible(name, mask, b, h, i), **extra, **params)
                out[b, h, i] = torch.tensor(row, dtype=torch.float64)
    return out


def reference_autograd(name, logits, allowed, sink=None, **params):
    """The same reference on 0-d tensors, so that autograd differentiates it (w.r.t. logits and ``sink`` (H,))."""
    B, H, Lq, Lk = logits.shape
    mask = full_mask(allowed, logits.shape)
    rows = []
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                extra = {} if sink is None else {"sink": sink[h]}
                row = reference_row(
                    name, list(logits[b, h, i].unbind()), row_visible(name, mask, b, h, i), exp=torch.exp,
                    sqrt=torch.sqrt,
                    **extra, **params,
                )  # fmt: skip
                rows.append(torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in row]))
    return torch.stack(rows).reshape(B, H, Lq, Lk)


# --------------------------------------------------------------------------------------------- inputs


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_logits(shape, seed, scale=2.0):
    return scale * torch.randn(shape, generator=gen(seed), dtype=torch.float64)


def logits_for(name, shape, seed, scale=2.0):
    """Random logits for normalizer ``name``: non-negative (|logits|) for the normalizers of linear attention,
    whose contract is for non-negative similarities."""
    logits = random_logits(shape, seed, scale)
    return logits.abs() if name in NONNEGATIVE else logits


def make_mask(kind, shape, seed=0):
    """``random``: full shape, some keys hidden, the first query row of every (b, h) fully hidden; ``padding``:
    (B, 1, 1, Lk), the last batch element hides every key; ``causal``: (Lq, Lk), j ≤ i."""
    B, _, Lq, Lk = shape
    if kind == "none":
        return None
    if kind == "random":
        m = torch.rand(shape, generator=gen(1000 + seed)) < 0.6
        m[:, :, 0, :] = False
        return m
    if kind == "padding":
        lengths = [max(Lk - 1 - b, 1) for b in range(B - 1)] + [0]
        return torch.tensor([[[[j < n for j in range(Lk)]]] for n in lengths])
    if kind == "causal":
        return torch.tensor([[j <= i for j in range(Lk)] for i in range(Lq)])
    raise AssertionError(kind)


def kink_free(name, logits, allowed, margin=1e-2):
    """True when no visible logit sits near a kink: 0 for softpick, τ for sparsemax / entmax15 (also no ties)."""
    mask = full_mask(allowed, logits.shape)
    rows, masks = logits.reshape(-1, logits.shape[-1]).tolist(), mask.reshape(-1, logits.shape[-1]).tolist()
    for row, vis in zip(rows, masks, strict=True):
        vs = [v for v, ok in zip(row, vis, strict=True) if ok]
        if not vs:
            continue
        if name == "softpick" and min(abs(v) for v in vs) < margin:
            return False
        if name == "sparsemax" and min(abs(v - sparsemax_tau(vs)) for v in vs) < margin:
            return False
        if name == "entmax15" and min(abs(v / 2 - entmax15_tau_bisection(vs)) for v in vs) < margin:
            return False
        if len(set(vs)) < len(vs):
            return False
    return True


def smooth_logits(name, shape, allowed, seed):
    """Fresh random logits away from every kink of ``name`` (the first seed from ``seed`` on that gives some)."""
    for s in range(seed, seed + 200):
        logits = logits_for(name, shape, s)
        if kink_free(name, logits, allowed):
            return logits
    raise AssertionError("no kink-free logits found")  # pragma: no cover


def build(name, num_heads, seed=0, **params):
    """Built in float64; a sink gets random per-head logits, so that it is not softmax1 in disguise."""
    norm = build_normalizer(name, num_heads=num_heads, **params).double()
    if name == "sink":
        with torch.no_grad():
            norm.sink_logit.copy_(torch.randn(num_heads, generator=gen(500 + seed), dtype=torch.float64))
    return norm


def sink_of(norm):
    return norm.sink_logit.detach() if hasattr(norm, "sink_logit") else None


def cotangent(shape, seed=7):
    return torch.randn(shape, generator=gen(seed), dtype=torch.float64)


# --------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", NAMES)
def test_normalizer_matches_the_plain_reference(name, shape, mask_kind):
    for seed in range(2):
        logits = logits_for(name, shape, seed=seed)
        allowed = make_mask(mask_kind, shape, seed)
        norm = build(name, shape[1], seed)
        got = norm(logits, allowed)
        assert got.shape == shape and got.dtype == torch.float64
        torch.testing.assert_close(got, reference(name, logits, allowed, sink_of(norm)), rtol=1e-10, atol=1e-12)


def test_sparsemax_matches_the_known_vector():
    x = torch.tensor([-2.0, 0.0, 0.5], dtype=torch.float64)
    expected = torch.tensor([0.0, 0.25, 0.75], dtype=torch.float64)
    torch.testing.assert_close(sparsemax(x), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(build_normalizer("sparsemax")(x.view(1, 1, 1, 3)), expected.view(1, 1, 1, 3))
    # a masked key in between, with a logit that would otherwise take everything, changes nothing
    x4, allowed = torch.tensor([[[[-2.0, 0.0, 99.0, 0.5]]]]), torch.tensor([True, True, False, True])
    torch.testing.assert_close(sparsemax(x4, allowed)[..., [0, 1, 3]], expected.float().view(1, 1, 1, 3))
    assert sparsemax(x4, allowed)[..., 2].item() == 0.0


def test_entmax15_matches_the_known_vector():
    x = torch.tensor([-2.0, 0.0, 0.5], dtype=torch.float64)
    expected = torch.tensor([0.0, 0.3260, 0.6740], dtype=torch.float64)
    torch.testing.assert_close(entmax15(x), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(
        build_normalizer("entmax15")(x.view(1, 1, 1, 3)), expected.view(1, 1, 1, 3), atol=1e-4, rtol=0
    )
    assert entmax15(x)[0].item() == 0.0
    x4, allowed = torch.tensor([[[[-2.0, 0.0, 99.0, 0.5]]]]), torch.tensor([True, True, False, True])
    torch.testing.assert_close(
        entmax15(x4, allowed)[..., [0, 1, 3]], expected.float().view(1, 1, 1, 3), atol=1e-4, rtol=0
    )
    assert entmax15(x4, allowed)[..., 2].item() == 0.0


@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_sparse_normalizers_sum_to_one_over_visible_keys_with_exact_zeros(name):
    shape = (3, 2, 4, 8)
    logits, allowed = random_logits(shape, seed=11, scale=3.0), make_mask("random", shape, seed=3)
    w = build_normalizer(name)(logits, allowed)
    mask = full_mask(allowed, shape)
    visible_rows = mask.any(-1)
    torch.testing.assert_close(w.sum(-1)[visible_rows], torch.ones(int(visible_rows.sum()), dtype=torch.float64))
    ref = reference(name, logits, allowed)
    outside_support = mask & (ref == 0)
    assert int(outside_support.sum()) > 5  # the input does leave visible keys out of the support
    assert (w[outside_support] == 0).all()
    assert (w[~mask] == 0).all()
    assert (w[mask & (ref > 0)] > 0).all()


def test_softmax_equals_torch_softmax_over_the_visible_keys():
    shape = (2, 3, 5, 6)
    logits, allowed = random_logits(shape, seed=4), make_mask("random", shape, seed=4)
    w = build_normalizer("softmax")(logits, allowed)
    torch.testing.assert_close(build_normalizer("softmax")(logits, None), torch.softmax(logits, dim=-1))
    for b in range(2):
        for h in range(3):
            for i in range(5):
                vis = allowed[b, h, i]
                if vis.any():
                    torch.testing.assert_close(w[b, h, i, vis], torch.softmax(logits[b, h, i, vis], dim=0))
                assert (w[b, h, i, ~vis] == 0).all()


@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_softmax1_rows_sum_below_one(mask_kind):
    shape = (2, 3, 4, 5)
    logits, allowed = random_logits(shape, seed=5, scale=4.0), make_mask(mask_kind, shape, seed=5)
    sums = build_normalizer("softmax1")(logits, allowed).sum(-1)
    assert (sums < 1).all()
    assert (sums > 0).any()
    # e.g. one key at logit 0: 1 / (1 + 1)
    assert build_normalizer("softmax1")(torch.zeros(1, 1, 1, 1)).item() == pytest.approx(0.5)


@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_softpick_gives_exact_zeros_for_nonpositive_logits_and_rows_summing_to_at_most_one(mask_kind):
    shape = (2, 3, 4, 6)
    logits = random_logits(shape, seed=6)
    logits[..., 0] = 0.0  # exactly zero: e^0 − 1 = 0
    allowed = make_mask(mask_kind, shape, seed=6)
    w = build_normalizer("softpick")(logits, allowed)
    assert int((logits < 0).sum()) > 10
    assert (w[logits <= 0] == 0).all()
    assert (w[(logits > 0) & full_mask(allowed, shape)] > 0).all()
    assert (w.sum(-1) <= 1).all()
    # a row with a single positive key: (e^s − 1) / (e^s − 1 + Σ_{s_j<0} (1 − e^{s_j}) + ε) < 1
    row = torch.tensor([[[[1.0, -1.0, -2.0]]]], dtype=torch.float64)
    e = math.exp(1) - 1
    expected = e / (e + (1 - math.exp(-1)) + (1 - math.exp(-2)) + EPS)
    assert build_normalizer("softpick")(row)[0, 0, 0, 0].item() == pytest.approx(expected, rel=1e-12)


def test_softpick_eps_is_a_parameter():
    logits = random_logits((1, 2, 3, 4), seed=8)
    w = build_normalizer("softpick", eps=0.5)(logits)
    torch.testing.assert_close(w, reference("softpick", logits, None, eps=0.5))
    with pytest.raises(ValueError, match="eps"):
        build_normalizer("softpick", eps=0.0)


@pytest.mark.parametrize("mask_kind", ["random", "padding", "causal"])
def test_sigmoid_default_bias_is_minus_log_of_the_visible_keys_of_each_row(mask_kind):
    shape = (2, 3, 4, 5)
    logits, allowed = random_logits(shape, seed=9), make_mask(mask_kind, shape, seed=9)
    w = build_normalizer("sigmoid")(logits, allowed)
    mask = full_mask(allowed, shape)
    for b in range(2):
        for h in range(3):
            for i in range(4):
                n = sum(bool(mask[b, h, i, j]) for j in range(5))
                for j in range(5):
                    s = float(logits[b, h, i, j])
                    expected = 1 / (1 + math.exp(-(s - math.log(n)))) if mask[b, h, i, j] else 0.0
                    assert float(w[b, h, i, j]) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # no mask: n = Lk
    expected = 1 / (1 + torch.exp(-(logits - math.log(5))))
    torch.testing.assert_close(build_normalizer("sigmoid")(logits, None), expected)


@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_sigmoid_fixed_bias_does_not_depend_on_the_number_of_keys(mask_kind):
    shape = (2, 2, 3, 4)
    logits, allowed = random_logits(shape, seed=10), make_mask(mask_kind, shape, seed=10)
    w = build_normalizer("sigmoid", bias=0.75)(logits, allowed)
    mask = full_mask(allowed, shape)
    expected = torch.where(mask, 1 / (1 + torch.exp(-(logits + 0.75))), torch.zeros(()))
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(w, reference("sigmoid", logits, allowed, bias=0.75))


def test_sink_has_one_learned_logit_per_head_initialised_at_init():
    norm = build_normalizer("sink", num_heads=4)
    assert isinstance(norm.sink_logit, nn.Parameter) and norm.sink_logit.requires_grad
    assert norm.sink_logit.shape == (4,)
    assert (norm.sink_logit == 0).all()
    assert [n for n, _ in norm.named_parameters()] == ["sink_logit"]
    assert (build_normalizer("sink", num_heads=3, init=-1.5).sink_logit == -1.5).all()
    for name in NAMES:
        if name != "sink":
            assert list(build_normalizer(name, num_heads=4).parameters()) == []


@pytest.mark.parametrize("mask_kind", ["none", "random", "padding"])
def test_sink_at_zero_equals_softmax1(mask_kind):
    shape = (2, 3, 4, 5)
    logits, allowed = random_logits(shape, seed=12), make_mask(mask_kind, shape, seed=12)
    got = build_normalizer("sink", num_heads=3)(logits, allowed)
    torch.testing.assert_close(got, build_normalizer("softmax1")(logits, allowed), rtol=0, atol=0)
    torch.testing.assert_close(got, reference("softmax1", logits, allowed))
    # and a sink at −∞ would be softmax: a very negative one comes close
    deep = build_normalizer("sink", num_heads=3, init=-60.0)(logits, allowed)
    torch.testing.assert_close(deep, build_normalizer("softmax")(logits, allowed))


def test_sink_with_the_wrong_head_count_raises_a_clear_error():
    norm = build_normalizer("sink", num_heads=2)
    with pytest.raises(ValueError, match=r"sink normalizer has 2 heads, logits have 3"):
        norm(torch.zeros(1, 3, 2, 2))
    with pytest.raises(ValueError, match=r"build_normalizer\('sink'\) needs num_heads="):
        build_normalizer("sink")


def test_only_softmax_declares_itself_softmax_for_the_fast_path():
    flags = {name: build_normalizer(name, num_heads=2).is_softmax for name in NAMES}
    assert flags == {name: name == "softmax" for name in NAMES}


def test_only_rowsum_and_none_declare_themselves_linear_and_only_rowsum_normalizes_rows():
    """The O(L) backends of linear attention compute exactly the normalizers that say ``is_linear``."""
    assert NONNEGATIVE == {"rowsum", "none"}
    assert build_normalizer("rowsum").normalize_rows is True and build_normalizer("rowsum").eps == EPS
    assert build_normalizer("none").normalize_rows is False


@pytest.mark.parametrize("mask_kind", ["none", "random", "causal"])
def test_rowsum_rows_sum_to_one_up_to_eps_and_its_eps_is_a_parameter(mask_kind):
    shape = (2, 3, 4, 5)
    logits, allowed = logits_for("rowsum", shape, seed=13), make_mask(mask_kind, shape, seed=13)
    mask = full_mask(allowed, shape)
    sums = build_normalizer("rowsum")(logits, allowed).sum(-1)
    row_sums = (logits * mask).sum(-1)
    torch.testing.assert_close(sums, row_sums / (row_sums + EPS), rtol=1e-12, atol=0)
    assert (sums[mask.any(-1)] > 1 - 1e-5).all() and (sums[~mask.any(-1)] == 0).all()
    w = build_normalizer("rowsum", eps=0.5)(logits, allowed)
    torch.testing.assert_close(w, reference("rowsum", logits, allowed, eps=0.5), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="eps"):
        build_normalizer("rowsum", eps=-1.0)


def test_none_gives_the_masked_logits_themselves():
    shape = (2, 3, 4, 5)
    logits, allowed = logits_for("none", shape, seed=14), make_mask("random", shape, seed=14)
    w = build_normalizer("none")(logits, allowed)
    torch.testing.assert_close(w, torch.where(allowed, logits, torch.zeros(())), rtol=0, atol=0)
    assert torch.equal(build_normalizer("none")(logits, None), logits)


# --------------------------------------------------------------------------------------------- gradients


def with_params(norm, logits, allowed, sink=None):
    if sink is None:
        return norm(logits, allowed)
    return torch.func.functional_call(norm, {"sink_logit": sink}, (logits, allowed))


@pytest.mark.parametrize("mask_kind", ["none", "random"])
@pytest.mark.parametrize("name", NAMES)
def test_normalizer_passes_gradcheck(name, mask_kind):
    shape = (2, 2, 3, 4)
    allowed = make_mask(mask_kind, shape, seed=20)
    logits = smooth_logits(name, shape, allowed, seed=20).requires_grad_()
    norm = build(name, 2, seed=20)
    if name == "sink":
        sink = norm.sink_logit.detach().clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda s, b: with_params(norm, s, allowed, b), (logits, sink))
    else:
        assert torch.autograd.gradcheck(lambda s: norm(s, allowed), (logits,))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 2, 3, 1)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask_kind", ["none", "random", "causal"])
@pytest.mark.parametrize("name", NAMES)
def test_normalizer_gradient_matches_the_reference(name, mask_kind, shape):
    allowed = make_mask(mask_kind, shape, seed=30)
    logits = smooth_logits(name, shape, allowed, seed=30)
    norm = build(name, shape[1], seed=30)
    s1, s2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = norm(s1, allowed)
    sink = norm.sink_logit.detach().clone().requires_grad_() if name == "sink" else None
    ref = reference_autograd(name, s2, allowed, sink)
    torch.testing.assert_close(got, ref.detach(), rtol=1e-10, atol=1e-12)
    c = cotangent(shape)
    (g_got,) = torch.autograd.grad(got, s1, c)
    (g_ref,) = torch.autograd.grad(ref, s2, c, retain_graph=sink is not None)
    if not (shape[-1] == 1 and name in ("softmax", "sparsemax", "entmax15")):  # w ≡ 1 there: a zero gradient
        assert g_ref.abs().sum() > 0
    torch.testing.assert_close(g_got, g_ref, rtol=1e-9, atol=1e-12)
    if sink is not None:
        got = norm(s1, allowed)
        (g_sink,) = torch.autograd.grad(got, norm.sink_logit, c)
        (g_sink_ref,) = torch.autograd.grad(ref, sink, c)
        assert g_sink_ref.abs().sum() > 0
        torch.testing.assert_close(g_sink, g_sink_ref, rtol=1e-9, atol=1e-12)


def test_sink_logit_gradient_matches_the_closed_form():
    """∂/∂b_h Σ c·w with w_j = e^{s_j} / (e^{b} + Σ e^{s}) is Σ over the rows of head h of
    −e^{b} / (e^{b} + Σ e^{s}) · Σ_j c_j w_j."""
    shape = (2, 3, 2, 4)
    logits, allowed = random_logits(shape, seed=31), make_mask("random", shape, seed=31)
    norm = build("sink", 3, seed=31)
    c = cotangent(shape, seed=32)
    (grad,) = torch.autograd.grad((norm(logits, allowed) * c).sum(), norm.sink_logit)
    b = norm.sink_logit.tolist()
    expected = [0.0] * 3
    for bb in range(2):
        for h in range(3):
            for i in range(2):
                vis = [j for j in range(4) if allowed[bb, h, i, j]]
                denom = math.exp(b[h]) + sum(math.exp(float(logits[bb, h, i, j])) for j in vis)
                cw = sum(float(c[bb, h, i, j]) * math.exp(float(logits[bb, h, i, j])) / denom for j in vis)
                expected[h] += -math.exp(b[h]) / denom * cw
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------- masks and empty rows


@pytest.mark.parametrize("name", NAMES)
def test_every_normalizer_gives_zero_weight_to_masked_keys_and_no_nan_for_empty_rows(name):
    cases = [
        ((2, 3, 4, 5), make_mask("random", (2, 3, 4, 5), seed=40)),
        ((2, 3, 4, 5), make_mask("padding", (2, 3, 4, 5))),
        ((2, 3, 4, 5), torch.zeros(2, 3, 4, 5, dtype=torch.bool)),  # nothing visible anywhere
        ((2, 3, 4, 1), torch.tensor([[[[True]], [[False]], [[True]]], [[[False]], [[False]], [[True]]]])),  # Lk = 1
    ]
    for shape, allowed in cases:
        norm = build(name, shape[1], seed=40)
        logits = logits_for(name, shape, seed=41, scale=3.0).requires_grad_()
        w = norm(logits, allowed)
        mask = full_mask(allowed, shape)
        empty = ~mask.any(-1)
        assert (w[~mask] == 0).all()
        assert (w[empty] == 0).all()
        assert torch.isfinite(w).all()
        grads = torch.autograd.grad(w, [logits, *norm.parameters()], cotangent(shape))
        assert all(torch.isfinite(g).all() for g in grads)
        assert (grads[0][~mask] == 0).all()  # masked logits get no gradient
        assert (grads[0][empty] == 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_every_normalizer_ignores_the_logits_of_masked_keys(name):
    shape = (2, 3, 4, 5)
    allowed = make_mask("random", shape, seed=42)
    logits = logits_for(name, shape, seed=42)
    norm = build(name, 3, seed=42)
    wild = logits.masked_fill(~allowed, 1e4)  # a masked key that would take all the weight if it were seen
    torch.testing.assert_close(norm(wild, allowed), norm(logits, allowed), rtol=0, atol=0)


@pytest.mark.parametrize(
    "mask_shape", [(2, 1, 1, 5), (1, 1, 4, 5), (4, 5), (2, 1, 4, 1), (1, 1, 1, 1)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("name", NAMES)
def test_every_normalizer_treats_a_broadcast_mask_as_its_expanded_form(name, mask_shape):
    shape = (2, 3, 4, 5)
    allowed = torch.rand(mask_shape, generator=gen(43)) < 0.7
    if allowed.numel() == 1:
        allowed[...] = True
    logits = logits_for(name, shape, seed=43)
    norm = build(name, 3, seed=43)
    expanded = allowed.expand(shape).clone()
    torch.testing.assert_close(norm(logits, allowed), norm(logits, expanded), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(norm(logits, allowed), reference(name, logits, allowed, sink_of(norm)))


# --------------------------------------------------------------------------------------------- numerical stability

# rows: [1e4, −1e4, 0, 5], [−1e4] * 4, [1e4, 1e4, −1e4, 0]
HUGE = [[1e4, -1e4, 0.0, 5.0], [-1e4] * 4, [1e4, 1e4, -1e4, 0.0]]
QUARTER = 1 / (1 + 4)  # σ(0 − log 4)
SIG5 = 1 / (1 + math.exp(-5))  # σ(5)
LIMITS = {
    "softmax": [[1, 0, 0, 0], [0.25] * 4, [0.5, 0.5, 0, 0]],
    "softmax1": [[1, 0, 0, 0], [0] * 4, [0.5, 0.5, 0, 0]],
    "sink": [[1, 0, 0, 0], [0] * 4, [0.5, 0.5, 0, 0]],
    "sigmoid": [[1, 0, QUARTER, 1 / (1 + 4 * math.exp(-5))], [0] * 4, [1, 1, 0, QUARTER]],
    "softpick": [[1, 0, 0, 0], [0] * 4, [0.5, 0.5, 0, 0]],
    "sparsemax": [[1, 0, 0, 0], [0.25] * 4, [0.5, 0.5, 0, 0]],
    "entmax15": [[1, 0, 0, 0], [0.25] * 4, [0.5, 0.5, 0, 0]],
    # linear attention's normalizers get |HUGE|: [1e4, 1e4, 0, 5], [1e4] * 4, [1e4, 1e4, 1e4, 0] (ε is negligible)
    "rowsum": [[1e4 / 20005, 1e4 / 20005, 0, 5 / 20005], [0.25] * 4, [1 / 3, 1 / 3, 1 / 3, 0]],
    "none": [[1e4, 1e4, 0, 5], [1e4] * 4, [1e4, 1e4, 1e4, 0]],
    # row i leaves out its own key i + 1 (Lq = 3, Lk = 4); the nearest visible key takes its share first
    "stickbreaking": [[0.5 * (1 - SIG5), 0, 0.5 * (1 - SIG5), SIG5], [0] * 4, [0, 1, 0, 0]],
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_every_normalizer_stays_finite_on_huge_logits(name, dtype):
    logits = torch.tensor([[HUGE, [[-x for x in row] for row in HUGE]]], dtype=dtype)  # (1, 2, 3, 4)
    if name in NONNEGATIVE:  # defined for non-negative logits only: both heads then see |HUGE|
        logits = logits.abs()
    norm = build_normalizer(name, num_heads=2).to(dtype)
    for allowed in (None, torch.tensor([True, True, False, True]), make_mask("random", (1, 2, 3, 4), seed=50)):
        s = logits.clone().requires_grad_()
        w = norm(s, allowed)
        assert torch.isfinite(w).all()
        grads = torch.autograd.grad(w, [s, *norm.parameters()], cotangent(w.shape).to(dtype))
        assert all(torch.isfinite(g).all() for g in grads)
        if allowed is None:
            expected = torch.tensor(LIMITS[name], dtype=dtype)
            torch.testing.assert_close(w[0, 0], expected, rtol=0, atol=1e-6)
        else:
            assert (w[~full_mask(allowed, w.shape)] == 0).all()


# --------------------------------------------------------------------------------------------- registry


@pytest.fixture
def scratch_names():
    """Names registered by a test, removed from the registry afterwards."""
    names = []
    yield names
    for name in names:
        _NORMALIZERS._entries.pop(name, None)


def test_list_normalizers_contains_the_seven_builtins():
    names = list_normalizers()
    assert isinstance(names, list) and all(isinstance(n, str) for n in names)
    assert {"softmax", "softmax1", "sink", "sigmoid", "sparsemax", "entmax15", "softpick"} <= set(names)


def test_every_builtin_normalizer_has_a_reference_and_pinned_values():
    """The reference (reference_row), the limits on huge logits (LIMITS) and the allowed parameters (ALLOWED) cover
    every registered built-in: a new normalizer without them fails here, by name, instead of being skipped."""
    missing = []
    for name in NAMES:
        try:
            reference_row(name, [0.0, 1.0], [True, True])
        except AssertionError:
            missing.append(f"{name} (reference_row)")
        missing += [
            f"{name} ({table})" for table, pins in (("LIMITS", LIMITS), ("ALLOWED", ALLOWED)) if name not in pins
        ]
    assert not missing, f"built-in normalizers without a reference here: {missing}"


@pytest.mark.parametrize("typo,closest", [("sofmax", "softmax"), ("entmax", "entmax15"), ("sparsmax", "sparsemax")])
def test_unknown_normalizer_suggests_the_closest_name(typo, closest):
    with pytest.raises(UnknownNameError) as info:
        build_normalizer(typo, num_heads=2)
    msg = str(info.value)
    assert f"did you mean '{closest}'?" in msg
    assert "\n" not in msg
    for name in NAMES:
        assert name in msg


ALLOWED = {
    "softmax": "(none)",
    "softmax1": "(none)",
    "sink": "init",
    "sigmoid": "bias",
    "sparsemax": "(none)",
    "entmax15": "(none)",
    "softpick": "eps",
    "rowsum": "eps",
    "none": "(none)",
    "stickbreaking": "attend_current",
}


@pytest.mark.parametrize("name", NAMES)
def test_unknown_parameter_gives_a_one_line_value_error_naming_the_allowed_ones(name):
    with pytest.raises(ValueError) as info:
        build_normalizer(name, num_heads=2, temperature=2.0)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == f"normalizer '{name}' does not take parameter 'temperature'; allowed: {ALLOWED[name]}"


def test_num_heads_is_accepted_by_every_builtin_and_a_module_is_returned_as_is():
    for name in NAMES:
        assert isinstance(build_normalizer(name, num_heads=3), Normalizer)
    norm = build_normalizer("sink", num_heads=3)
    assert build_normalizer(norm) is norm


def test_a_builtin_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="already registered"):
        register_normalizer("softmax")(lambda logits, allowed: logits)
    assert build_normalizer("softmax").is_softmax


def test_a_user_registered_normalizer_class_can_be_built_and_used(scratch_names):
    name = "test_scaled_softmax_class"
    scratch_names.append(name)

    @register_normalizer(name)
    class ScaledSoftmax(Normalizer):
        def __init__(self, num_heads, temperature=1.0):
            super().__init__()
            self.scale = nn.Parameter(torch.full((num_heads,), 1.0 / temperature, dtype=torch.float64))

        def forward(self, logits, allowed=None):
            s = logits * self.scale.view(1, -1, 1, 1)
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            return torch.softmax(s, dim=-1)

    assert name in list_normalizers()
    norm = build_normalizer(name, num_heads=3, temperature=2.0)
    assert isinstance(norm, ScaledSoftmax) and norm.scale.shape == (3,)
    logits = random_logits((1, 3, 2, 4), seed=60)
    torch.testing.assert_close(norm(logits), reference("softmax", logits / 2, None))
    with pytest.raises(ValueError, match="needs num_heads="):
        build_normalizer(name)
    with pytest.raises(ValueError, match=r"allowed: temperature$"):
        build_normalizer(name, num_heads=3, bias=1.0)


def test_a_user_registered_normalizer_function_can_be_built_and_used(scratch_names):
    name = "test_relu_norm_function"
    scratch_names.append(name)

    @register_normalizer(name)
    def relu_norm(logits, allowed, power=1.0):
        w = torch.relu(logits) ** power
        if allowed is not None:
            w = w.masked_fill(~allowed, 0.0)
        return w / (w.sum(-1, keepdim=True) + 1.0)

    assert name in list_normalizers()
    norm = build_normalizer(name, num_heads=2, power=2.0)
    assert isinstance(norm, nn.Module) and not norm.is_softmax
    logits = random_logits((1, 2, 2, 3), seed=61)
    allowed = make_mask("causal", (1, 2, 2, 3))
    got = norm(logits, allowed)
    for h in range(2):
        for i in range(2):
            r = [max(float(logits[0, h, i, j]), 0.0) ** 2 if j <= i else 0.0 for j in range(3)]
            expected = [x / (sum(r) + 1) for x in r]
            torch.testing.assert_close(got[0, h, i], torch.tensor(expected, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"does not take parameter 'temperature'; allowed: power$"):
        build_normalizer(name, temperature=1.0)


@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_sparse_thresholds_from_the_top_k_match_the_reference_on_long_rows(name):
    """Rows longer than the first top-k (64) whose supports are small, around 64, 128 and the whole row: the
    threshold found from the top k values (k doubled where the support reaches k) is the full row's."""
    Lk = 300
    # logit scales: the smaller, the wider the support (sparsemax: about 200, 126, 85, 39, 9 keys; entmax15 wider)
    rows = [0.005, 0.01, 0.02, 0.05, 0.3, 3.0]
    logits = torch.stack([s * torch.randn(Lk, generator=gen(90 + i), dtype=torch.float64) for i, s in enumerate(rows)])
    logits = logits.view(1, 1, len(rows), Lk)
    allowed = torch.rand(1, 1, len(rows), Lk, generator=gen(99)) < 0.9
    for mask in (None, allowed):
        got = build_normalizer(name)(logits, mask)
        torch.testing.assert_close(got, reference(name, logits, mask), rtol=1e-9, atol=1e-12)
    supports = (build_normalizer(name)(logits) > 0).sum(-1).flatten().tolist()
    assert min(supports) < 64 and max(supports) > 128, supports  # every refinement step is exercised
