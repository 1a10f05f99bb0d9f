"""Selective attention (``attention.selective``: :func:`attnlab.forms.softmax.selection_penalty`, the fused path of
:mod:`attnlab.backends.sdpa` and its C kernels; Leviathan et al. 2025, "Selective Attention Improves Transformer", §2)
and multi-token attention (``score=mta``, :mod:`attnlab.forms.mta`; Golovneva et al. 2025, "Multi-Token Attention",
§3, eqs. 3-6), each against its paper's formula written out here (loops over the selecting tokens, queries, keys and
kernel taps; only the layer's parameter tensors), in float64 with every parameter random: values and gradients (x and
every parameter) through every backend that computes the layer (eager; biased_softmax with and without its C row
kernel; sdpa; the C and the PyTorch form of the penalty; auto with and without gradients); selective attention with
ALiBi, one key/value head, softmax1, a soft-cap and forgetting attention; masks (a row that sees no key, causality,
key padding, queries aligned with the last keys); the weights a layer reports; what each refuses in one line; and
the FLOPs multi-token attention adds.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import alibi_slopes, linear, masked_softmax, split_heads
from helpers import randomize_

import attnlab.backends.sdpa as sdpa_backend
from attnlab.attention import MultiHeadAttention
from attnlab.backends.normalized import NormalizedAttention
from attnlab.compute import count_flops
from attnlab.config import AttentionConfig
from attnlab.decode import decode_reason
from attnlab.kernels import select as select_kernel
from attnlab.kernels import softmax as softmax_kernel
from attnlab.masks import build_mask

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: threads only add overhead on a busy machine

D_MODEL = 16
ATOL = 1e-10


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def causal_visible(B, Lq, Lk, keys=None):
    """(B, Lq, Lk) bool: query i (token i + Lk − Lq) sees the keys j ≤ its token that are real (``keys`` (B, Lk))."""
    visible = torch.tensor([[j <= i + Lk - Lq for j in range(Lk)] for i in range(Lq)]).expand(B, Lq, Lk).clone()
    return visible if keys is None else visible & keys[:, None, :]


def assert_values_and_gradients(out, expected, inputs, atol=ATOL):
    torch.testing.assert_close(out, expected, rtol=atol, atol=atol)
    cot = rand(*out.shape, seed=99)
    got = torch.autograd.grad(out, inputs, cot, retain_graph=True)
    want = torch.autograd.grad(expected, inputs, cot, retain_graph=True)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=atol, atol=atol, msg=lambda m, n=n: f"input {n}: {m}")


# ---------------------------------------------------------------------------------------------- selective: reference


def head_logits(layer, x, key_value=None, alibi=False, softcap=None):
    """e (B, H, Lq, Lk) and v (B, H, Lk, d_v) per query head: e_h = q_h · k_g / √d_k with g = h // (H / G) the key
    head of h's group, plus ALiBi's m_h·(j − i) (Press et al. 2022's causal form, Lq = Lk), soft-capped
    c·tanh(e / c)."""
    H, G = layer.num_heads, layer.num_kv_heads
    kv = x if key_value is None else key_value
    q = split_heads(linear(layer.q_proj, x), H)
    k = split_heads(linear(layer.k_proj, kv), G)
    v = split_heads(linear(layer.v_proj, kv), G)
    Lq, Lk, d_k = q.shape[2], k.shape[2], q.shape[-1]
    slopes = alibi_slopes(H)
    logits, values = [], []
    for h in range(H):
        g = h // (H // G)
        e = q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(d_k)
        if alibi:
            e = e + torch.tensor([[slopes[h] * (j - i) for j in range(Lk)] for i in range(Lq)], dtype=torch.float64)
        if softcap is not None:
            e = softcap * torch.tanh(e / softcap)
        logits.append(e)
        values.append(v[:, g])
    return torch.stack(logits, 1), torch.stack(values, 1)


def selection(e0, visible, inclusive=False, first_key=1):
    """Leviathan et al.'s F (B, Lq, Lk) from the selecting head's logits e0 (B, Lq, Lk), written out:
    S_kj = ReLU(e0_kj) for a key j visible to query k with 0 < j < k, else 0, and 0 for a token k that cannot see
    its own key (a padded one: attnlab's rule, the paper has no padding); F_ij = Σ_{k<i} S_kj. ``inclusive``
    (Σ_{k≤i}: no roll by one) and ``first_key=0`` (BOS selectable) are the wrong formulas that show the tests can
    fail."""
    B, Lq, Lk = e0.shape
    zero = e0.new_zeros(B)
    S = [
        [
            torch.where(visible[:, k, j] & visible[:, k, k] & (e0[:, k, j] > 0), e0[:, k, j], zero)
            if first_key <= j < k
            else zero
            for j in range(Lk)
        ]
        for k in range(Lq)
    ]
    upto = (lambda i: i + 1) if inclusive else (lambda i: i)
    F = [[sum((S[k][j] for k in range(upto(i))), zero) for j in range(Lk)] for i in range(Lq)]
    return torch.stack([torch.stack(row, -1) for row in F], 1)


def forget_bias(layer, x, visible=None):
    """Forgetting attention's D (B, H, L, L) (Lin et al. 2025, eqs. 5-7): f_t = σ(x_t w_h + b_h),
    D_ij = Σ_{l=j+1..i} log f_l for j ≤ i (0 above the diagonal, which the causal mask hides); with ``visible``
    (B, L, L), a padded token (its own key hidden) has f = 1 (attnlab's rule)."""
    log_f = torch.log(torch.sigmoid(linear(layer.form.forget_proj, x)))  # (B, L, H)
    if visible is not None:
        log_f = log_f * torch.diagonal(visible, dim1=-2, dim2=-1)[..., None]
    B, L, H = log_f.shape
    zero = log_f.new_zeros(B, H)
    rows = [
        torch.stack([sum((log_f[:, m] for m in range(j + 1, i + 1)), zero) for j in range(L)], -1) for i in range(L)
    ]
    return torch.stack(rows, -2)


def softmax_one(logits, visible):
    """Miller 2023's softmax1 over the visible keys: e^{s_j} / (1 + Σ_visible e^{s}), hidden keys 0."""
    ex = torch.exp(logits) * visible
    return ex / (1 + ex.sum(-1, keepdim=True))


def selective_reference(
    layer, x, visible, key_value=None, alibi=False, softcap=None, sink=False, forgetting=False, **wrong
):
    """The selective layer from the paper: → (out (B, Lq, d_model), weights (B, H, Lq, Lk), e, F); every head's
    logits become e − F (F from head 0's, before forgetting attention's D), then the softmax over visible keys."""
    e, v = head_logits(layer, x, key_value, alibi, softcap)
    F = selection(e[:, 0], visible, **wrong)
    logits = e - F[:, None]
    if forgetting:
        logits = logits + forget_bias(layer, x, visible)
    vis = visible[:, None]
    weights = softmax_one(logits, vis) if sink else masked_softmax(logits, vis)
    heads = weights @ v  # (B, H, Lq, d_v)
    B, H, Lq, d_v = heads.shape
    out = linear(layer.out_proj, heads.transpose(1, 2).reshape(B, Lq, H * d_v))
    return out, weights, e, F


def selective_layer(backend="eager", num_heads=2, seed=0, **options):
    torch.manual_seed(seed)
    layer = MultiHeadAttention(D_MODEL, num_heads, selective=True, mask="causal", backend=backend, **options)
    return randomize_(layer.double(), seed, scale=0.5)


# the computing paths: a backend, and which of the fused path's C kernels is turned off
PATHS = [
    "eager",
    "biased_softmax",  # the C select kernel for −F, the C softmax row kernel
    "biased_softmax_no_row_kernel",  # ... BiasedSoftmaxAttention for the softmax
    "biased_softmax_torch_penalty",  # selection_penalty (PyTorch) for −F
    "sdpa",
    "sdpa_torch_penalty",
]


def backend_of(path, monkeypatch):
    """The backend that ``path`` names, with the C kernel its suffix names turned off (``_torch_penalty``: −F from
    :func:`selection_penalty` rather than :mod:`attnlab.kernels.select`; ``_no_row_kernel``: the softmax through
    :class:`BiasedSoftmaxAttention` rather than the C row kernel)."""
    if path.endswith("_torch_penalty"):
        monkeypatch.setattr(select_kernel, "supports", lambda *args, **kwargs: False)
    if path.endswith("_no_row_kernel"):
        monkeypatch.setattr(sdpa_backend, "_row_kernel_applies", lambda *args: False)
    return path.removesuffix("_torch_penalty").removesuffix("_no_row_kernel")


# ---------------------------------------------------------------------------------------------- selective: equations


@pytest.mark.parametrize("path", PATHS)
def test_selective_attention_matches_the_papers_formula(path, monkeypatch):
    layer = selective_layer(backend_of(path, monkeypatch))
    B, L = 2, 7
    x = rand(B, L, D_MODEL).requires_grad_(True)
    out, _ = layer(x, mask=build_mask("causal"))
    visible = causal_visible(B, L, L)
    expected, _, e, F = selective_reference(layer, x, visible)
    selectable = torch.tensor([[0 < j < i for j in range(L)] for i in range(L)])
    assert (e[:, 0][:, selectable] > 0).any() and (e[:, 0][:, selectable] < 0).any()  # the ReLU is at work
    assert F.abs().max() > 1.0  # the penalty is
    assert_values_and_gradients(out, expected, [x, *layer.parameters()])


@pytest.mark.skipif(
    not (select_kernel.available() and softmax_kernel.available()), reason="attnlab's C kernels are not built here"
)
@pytest.mark.parametrize("path", PATHS)
def test_each_path_runs_the_kernels_its_name_says(path, monkeypatch):
    """The parametrisation above is not vacuous: each path reaches the code it names."""
    calls = {}

    def spy(owner, name, static=False):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, staticmethod(wrapper) if static else wrapper)

    spy(select_kernel, "selection_bias")
    spy(sdpa_backend, "selection_penalty")
    spy(sdpa_backend, "scaled_dot_product_attention")
    spy(sdpa_backend.BiasedSoftmaxAttention, "apply", static=True)
    spy(NormalizedAttention, "apply", static=True)
    layer = selective_layer(backend_of(path, monkeypatch))
    layer(rand(2, 5, D_MODEL).requires_grad_(True), mask=build_mask("causal"))
    penalty = {"selection_penalty": 1} if path.endswith("_torch_penalty") else {"selection_bias": 1}
    expected = {
        "eager": {},
        "biased_softmax": {**penalty, "apply": 1},
        "biased_softmax_no_row_kernel": {**penalty, "apply": 1},
        "biased_softmax_torch_penalty": {**penalty, "apply": 1},
        "sdpa": {**penalty, "scaled_dot_product_attention": 1},
        "sdpa_torch_penalty": {**penalty, "scaled_dot_product_attention": 1},
    }[path]
    assert calls == expected


def test_auto_takes_biased_softmax_with_gradients_and_sdpa_without_and_both_match_the_formula():
    layer = selective_layer("auto")
    assert layer.backend_for(dtype=torch.float64) == "biased_softmax"
    assert layer.backend_for(dtype=torch.float64, grad=False) == "sdpa"
    B, L = 2, 6
    x = rand(B, L, D_MODEL, seed=3).requires_grad_(True)
    expected, _, _, _ = selective_reference(layer, x, causal_visible(B, L, L))
    out, _ = layer(x, mask=build_mask("causal"))
    assert_values_and_gradients(out, expected, [x, *layer.parameters()])
    with torch.no_grad():
        torch.testing.assert_close(layer(x, mask=build_mask("causal"))[0], expected, rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize(
    "wrong",
    [{"inclusive": True}, {"first_key": 0}, None],
    ids=["no_roll_by_one", "bos_selectable", "no_penalty"],
)
def test_the_formula_tests_would_catch_a_wrong_penalty(wrong):
    """The reference with the roll by one left out, with BOS selectable, or without F differs from the layer."""
    layer = selective_layer()
    B, L = 2, 7
    x = rand(B, L, D_MODEL)
    visible = causal_visible(B, L, L)
    out = layer(x, mask=build_mask("causal"))[0]
    if wrong is None:
        e, v = head_logits(layer, x)
        heads = masked_softmax(e, visible[:, None]) @ v
        other = linear(layer.out_proj, heads.transpose(1, 2).reshape(B, L, -1))
    else:
        other = selective_reference(layer, x, visible, **wrong)[0]
    assert (out - other).abs().max() > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_the_gradient_reaches_head_0s_query_through_the_penalty(path, monkeypatch):
    """With head 0's output cut from out_proj, the output still depends on head 0's query, through F alone: the
    gradient w.r.t. head 0's rows of q_proj is the reference's and not 0 (and it is 0 without selective)."""
    layer = selective_layer(backend_of(path, monkeypatch))
    d_k = layer.d_k
    with torch.no_grad():
        layer.out_proj.weight[:, :d_k] = 0.0  # head 0's z columns
    B, L = 2, 6
    x = rand(B, L, D_MODEL, seed=4)
    out = layer(x, mask=build_mask("causal"))[0]
    expected = selective_reference(layer, x, causal_visible(B, L, L))[0]
    cot = rand(*out.shape, seed=5)
    (got,) = torch.autograd.grad(out, layer.q_proj.weight, cot)
    (want,) = torch.autograd.grad(expected, layer.q_proj.weight, cot)
    assert want[:d_k].abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=ATOL, atol=ATOL)
    plain = MultiHeadAttention(D_MODEL, 2, mask="causal", backend="eager").double()
    plain.load_state_dict(layer.state_dict())
    (none,) = torch.autograd.grad(plain(x, mask=build_mask("causal"))[0], plain.q_proj.weight, cot)
    assert (none[:d_k] == 0).all()


# ---------------------------------------------------------------------------------------------- selective: masks


def padded_mask(B, L, padded):
    """(keys (B, L), the (B, 1, L, L) bool mask causal AND key padding), ``padded``: (b, j) pairs that are padding."""
    keys = torch.ones(B, L, dtype=torch.bool)
    for b, j in padded:
        keys[b, j] = False
    return keys, causal_visible(B, L, L, keys)[:, None]


@pytest.mark.parametrize("path", PATHS)
def test_a_row_that_sees_no_key_gives_zeros_and_padding_matches_the_formula(path, monkeypatch):
    layer = selective_layer(backend_of(path, monkeypatch))
    B, L = 2, 7
    _, mask = padded_mask(B, L, [(0, 0), (0, 1), (1, 3), (1, 5)])  # sequence 0: rows 0 and 1 see nothing
    x = rand(B, L, D_MODEL, seed=6).requires_grad_(True)
    out, _ = layer(x, mask=mask)
    expected, weights, _, _ = selective_reference(layer, x, mask[:, 0])
    assert torch.isfinite(out).all()
    bias = layer.out_proj.bias.detach().expand(2, D_MODEL)
    torch.testing.assert_close(out[0, :2], bias, rtol=0, atol=1e-12)
    assert (weights[0, :, :2] == 0).all()
    assert_values_and_gradients(out, expected, [x, *layer.parameters()])
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("path", PATHS)
def test_changing_trailing_padding_leaves_the_real_tokens_unchanged(path, monkeypatch):
    layer = selective_layer(backend_of(path, monkeypatch))
    B, L = 2, 7
    keys, mask = padded_mask(B, L, [(0, 5), (0, 6), (1, 6)])
    x = rand(B, L, D_MODEL, seed=7)
    y = x.clone()
    y[~keys] = rand(int((~keys).sum()), D_MODEL, seed=8)
    a, b = layer(x, mask=mask)[0], layer(y, mask=mask)[0]
    torch.testing.assert_close(a[keys], b[keys], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[~keys], b[~keys])  # a padded query still reads its own input
    torch.testing.assert_close(a, selective_reference(layer, x, mask[:, 0])[0], rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("path", PATHS)
def test_hiding_the_padded_rows_too_isolates_padding_anywhere(path, monkeypatch):
    """A mask that hides padded tokens as queries as well as keys: S reads only the rows that see a key, so a padded
    token anywhere (first, in the middle) reaches no real token, and its own row is 0 (out_proj's bias)."""
    layer = selective_layer(backend_of(path, monkeypatch))
    B, L = 2, 7
    keys, _ = padded_mask(B, L, [(0, 2), (1, 0), (1, 4)])
    mask = (causal_visible(B, L, L, keys) & keys[:, :, None])[:, None]
    x = rand(B, L, D_MODEL, seed=16).requires_grad_(True)
    out, _ = layer(x, mask=mask)
    assert_values_and_gradients(out, selective_reference(layer, x, mask[:, 0])[0], [x, *layer.parameters()])
    torch.testing.assert_close(out[~keys], layer.out_proj.bias.detach().expand(3, D_MODEL), rtol=0, atol=1e-12)
    y = x.detach().clone()
    y[~keys] = rand(int((~keys).sum()), D_MODEL, seed=17)
    torch.testing.assert_close(layer(y, mask=mask)[0][keys], out[keys], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_a_call_without_a_mask_applies_the_configured_one(path, monkeypatch):
    """The layer applies the mask it is given: an all-visible one lets every query see every key and S_kj covers
    0 < j < k; with none, the layer's configured (causal) mask applies (issue 60: before, a call without a mask ran
    without one, and row 0 read the last token)."""
    layer = selective_layer(backend_of(path, monkeypatch))
    B, L = 2, 6
    x = rand(B, L, D_MODEL, seed=18).requires_grad_(True)
    expected = selective_reference(layer, x, torch.ones(B, L, L, dtype=torch.bool))[0]
    every_key = torch.ones(L, L, dtype=torch.bool)
    assert_values_and_gradients(layer(x, mask=every_key)[0], expected, [x, *layer.parameters()])
    causal = selective_reference(layer, x, causal_visible(B, L, L))[0]
    assert_values_and_gradients(layer(x)[0], causal, [x, *layer.parameters()])


@pytest.mark.parametrize("path", PATHS)
def test_changing_a_padded_token_in_the_middle_leaves_the_real_tokens_unchanged(path, monkeypatch):
    """A padded token (its own key hidden) selects nothing, so its input reaches no real token."""
    layer = selective_layer(backend_of(path, monkeypatch))
    B, L = 1, 6
    keys, mask = padded_mask(B, L, [(0, 2)])
    x = rand(B, L, D_MODEL, seed=9)
    y = x.clone()
    y[0, 2] = 3 * rand(D_MODEL, seed=10)
    a, b = layer(x, mask=mask)[0], layer(y, mask=mask)[0]
    torch.testing.assert_close(a[keys], b[keys], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_under_the_causal_mask_no_output_depends_on_a_later_token(path, monkeypatch):
    layer = selective_layer(backend_of(path, monkeypatch))
    B, L = 2, 7
    x = rand(B, L, D_MODEL, seed=11)
    base = layer(x, mask=build_mask("causal"))[0]
    for t in range(1, L):
        y = x.clone()
        y[:, t:] = rand(B, L - t, D_MODEL, seed=20 + t)
        changed = layer(y, mask=build_mask("causal"))[0]
        torch.testing.assert_close(changed[:, :t], base[:, :t], rtol=1e-12, atol=1e-12)
        assert (changed[:, t:] - base[:, t:]).abs().amax(-1).min() > 1e-8, t


@pytest.mark.parametrize("path", ["eager", "biased_softmax", "sdpa"])
def test_cross_attention_is_refused_in_one_line(path, monkeypatch):
    """Selective attention is self-attention (token k selects keys away for the queries after it): keys of another
    sequence, of another length, are refused in one line on every path."""
    layer = selective_layer(backend_of(path, monkeypatch))
    x, kv = rand(2, 4, D_MODEL, seed=12), rand(2, 7, D_MODEL, seed=13)
    with pytest.raises(ValueError, match="self-attention") as err:
        layer(x, key_value=kv, mask=build_mask("causal"))
    assert "\n" not in str(err.value)


def test_the_weights_are_the_formulas_and_sum_to_one_over_the_visible_keys():
    layer = selective_layer("sdpa")  # need_weights runs eager whatever the backend
    B, L = 2, 7
    _, mask = padded_mask(B, L, [(1, 0)])
    x = rand(B, L, D_MODEL, seed=14)
    _, weights = layer(x, mask=mask, need_weights=True)
    _, expected, _, _ = selective_reference(layer, x, mask[:, 0])
    assert weights.shape == (B, 2, L, L)
    torch.testing.assert_close(weights, expected, rtol=ATOL, atol=ATOL)
    sums = weights.sum(-1)
    torch.testing.assert_close(sums[0], torch.ones_like(sums[0]), rtol=0, atol=1e-12)
    assert (sums[1, :, 0] == 0).all() and (weights[~mask.expand(B, 2, L, L)] == 0).all()


# ---------------------------------------------------------------------------------------------- selective: combinations


COMBINATIONS = [
    ("alibi", {"position_bias": "alibi"}, {"alibi": True}, ["eager", "biased_softmax", "sdpa"]),
    ("one_kv_head", {"num_kv_heads": 1, "num_heads": 4}, {}, ["eager", "biased_softmax", "sdpa"]),
    ("softmax1", {"normalizer": "softmax1"}, {"sink": True}, ["eager", "biased_softmax", "sdpa"]),
    ("forgetting", {"score": "forgetting"}, {"forgetting": True}, ["eager", "sdpa"]),
    ("softcap", {"softcap": 2.5}, {"softcap": 2.5}, ["eager"]),
]


@pytest.mark.parametrize(
    ("options", "ref_options", "backend"),
    [(o, r, b) for _, o, r, bs in COMBINATIONS for b in bs],
    ids=[f"{name}-{b}" for name, _, _, bs in COMBINATIONS for b in bs],
)
def test_selective_attention_with_other_stages_matches_the_formula(options, ref_options, backend):
    layer = selective_layer(backend, **options)
    B, L = 2, 6
    _, mask = padded_mask(B, L, [(1, 0), (1, 4)])  # sequence 1's row 0 sees no key
    x = rand(B, L, D_MODEL, seed=15).requires_grad_(True)
    out, _ = layer(x, mask=mask)
    expected, _, _, _ = selective_reference(layer, x, mask[:, 0], **ref_options)
    assert_values_and_gradients(out, expected, [x, *layer.parameters()])
    if "alibi" in ref_options:  # the bias is in head 0's logits that F reads: without it F differs
        e, _ = head_logits(layer, x)
        wrong = selection(e[:, 0], mask[:, 0])
        assert (wrong - selective_reference(layer, x, mask[:, 0], alibi=True)[3]).abs().max() > 1e-3
    if "forgetting" in ref_options:  # F is read before D is added
        e, _ = head_logits(layer, x)
        wrong = selection(e[:, 0] + forget_bias(layer, x, mask[:, 0])[:, 0], mask[:, 0])
        assert (wrong - selective_reference(layer, x, mask[:, 0], forgetting=True)[3]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------- selective: refusals


@pytest.mark.parametrize("backend", ["normalized", "relative", "flex"])
def test_a_backend_without_selective_attention_is_refused_in_one_line(backend):
    with pytest.raises(
        ValueError, match=rf"^attention.backend={backend} cannot compute this layer: .*selective"
    ) as err:
        MultiHeadAttention(D_MODEL, 2, selective=True, mask="causal", backend=backend)
    assert "\n" not in str(err.value)


WINDOW = {"name": "sliding_window", "window": 3}


@pytest.mark.parametrize(
    "mask",
    [None, WINDOW, {"name": "and", "masks": ["causal", WINDOW]}],
    ids=["none", "sliding_window", "causal_window"],
)
def test_a_mask_that_is_not_causal_is_refused_in_one_line(mask):
    with pytest.raises(ValueError, match=r"^selective attention .* needs mask=causal") as err:
        MultiHeadAttention(D_MODEL, 2, selective=True, mask=mask)
    assert "\n" not in str(err.value)


def test_selective_is_a_boolean_config_field_and_the_layer_does_not_decode():
    assert AttentionConfig(selective=True).selective is True and AttentionConfig().selective is False
    with pytest.raises(ValueError, match=r"^selective must be true or false, got 'yes'$") as err:
        AttentionConfig(selective="yes")
    assert "\n" not in str(err.value)
    layer = selective_layer()
    reason = decode_reason(layer)
    assert isinstance(reason, str) and "selective" in reason and "\n" not in reason
    assert "selective" in layer.form.features()


# ---------------------------------------------------------------------------------------------- MTA: reference


def mta_reference(layer, x, visible):
    """Golovneva et al.'s eqs. 3-6 written out from the layer's tensors: → (out (B, L, d_model), A' (B, H, L, L)).

    Â = q kᵀ/√d_k per head; M₀ puts 0 at hidden logits; Ã_ij = Σ_{a<c_q} Σ_{b<c_k} θ_h[a, b] M₀(Â)_{i−a, j−b+⌊c_k/2⌋}
    (0 outside the sequence); A = softmax of Ã over the visible keys (a row with none: 0); A'_{g·c_h+o} =
    Σ_i W[g, o, i] A_{g·c_h+i}; o = A' v."""
    form = layer.form
    theta, W = form.kq_kernel, form.head_kernel
    H, c_q, c_k = theta.shape
    c_h, half = W.shape[1], c_k // 2
    q = split_heads(linear(layer.q_proj, x), H)
    k = split_heads(linear(layer.k_proj, x), H)
    v = split_heads(linear(layer.v_proj, x), H)
    B, _, L, d_k = q.shape
    vis = visible[:, None]  # (B, 1, L, L)
    own = torch.diagonal(vis, dim1=-2, dim2=-1)[..., None]  # a padded token (own key hidden): its row is 0 in M₀
    m0 = torch.where(vis & own, q @ k.transpose(-1, -2) / math.sqrt(d_k), torch.zeros((), dtype=torch.float64))
    rows = []
    for i in range(L):
        row = []
        for j in range(L):
            acc = x.new_zeros(B, H)
            for a in range(c_q):
                for b in range(c_k):
                    ii, jj = i - a, j - b + half
                    if 0 <= ii < L and 0 <= jj < L:
                        acc = acc + theta[:, a, b] * m0[:, :, ii, jj]
            row.append(acc)
        rows.append(torch.stack(row, -1))
    A = masked_softmax(torch.stack(rows, -2), vis)
    mixed = []
    for h in range(H):
        g, o = divmod(h, c_h)
        mixed.append(sum(W[g, o, i] * A[:, g * c_h + i] for i in range(c_h)))
    A2 = torch.stack(mixed, 1)
    heads = A2 @ v
    return linear(layer.out_proj, heads.transpose(1, 2).reshape(B, L, -1)), A2


def mta_layer(num_heads, seed=0, kernels=True, **params):
    """A float64 MTA layer, every parameter random (``kernels=False``: the projections only; θ and W as built)."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(D_MODEL, num_heads, score="mta", mask="causal", **params).double()
    if kernels:
        return randomize_(layer, seed, scale=0.5)
    for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj):
        randomize_(proj, seed + 1, scale=0.5)
    return layer


MTA_PARAMS = [
    ("cq3_ck5_ch2", 4, {"c_q": 3, "c_k": 5, "c_h": 2}),
    ("cq2_ck4_ch2", 4, {"c_q": 2, "c_k": 4, "c_h": 2}),  # an even c_k
    ("cq1_ck3_ch1", 2, {"c_q": 1, "c_k": 3, "c_h": 1}),  # no query taps, no head mixing
    ("cq3_ck1_ch4", 4, {"c_q": 3, "c_k": 1, "c_h": 4}),  # query taps only, one group of every head
    ("cq4_ck6_ch2", 2, {"c_q": 4, "c_k": 6, "c_h": 2}),  # a wide even c_k
]


# ---------------------------------------------------------------------------------------------- MTA: equations


def test_a_fresh_mta_layer_is_causal_scaled_dot_attention():
    layer = mta_layer(4, kernels=False, c_q=3, c_k=5, c_h=2)
    theta, W = layer.form.kq_kernel, layer.form.head_kernel
    identity = torch.zeros(4, 3, 5, dtype=torch.float64)
    identity[:, 0, 2] = 1.0
    assert torch.equal(theta.detach(), identity) and torch.equal(W.detach(), torch.eye(2).repeat(2, 1, 1).double())
    B, L = 2, 6
    x = rand(B, L, D_MODEL, seed=30).requires_grad_(True)
    q = split_heads(linear(layer.q_proj, x), 4)
    k = split_heads(linear(layer.k_proj, x), 4)
    v = split_heads(linear(layer.v_proj, x), 4)
    w = masked_softmax(q @ k.transpose(-1, -2) / math.sqrt(layer.d_k), causal_visible(B, L, L)[:, None])
    expected = linear(layer.out_proj, (w @ v).transpose(1, 2).reshape(B, L, -1))
    out, weights = layer(x, need_weights=True)
    torch.testing.assert_close(weights, w, rtol=ATOL, atol=ATOL)
    projections = [p for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj) for p in proj.parameters()]
    assert_values_and_gradients(out, expected, [x, *projections])


@pytest.mark.parametrize(("num_heads", "params"), [p[1:] for p in MTA_PARAMS], ids=[p[0] for p in MTA_PARAMS])
def test_mta_matches_the_papers_equations_with_random_kernels(num_heads, params):
    layer = mta_layer(num_heads, **params)
    B, L = 2, 7
    x = rand(B, L, D_MODEL, seed=31).requires_grad_(True)
    out, weights = layer(x, mask=build_mask("causal"), need_weights=True)
    expected, mixed = mta_reference(layer, x, causal_visible(B, L, L))
    torch.testing.assert_close(weights, mixed, rtol=ATOL, atol=ATOL)
    tensors = list(layer.parameters())  # θ and W among them
    assert any(p is layer.form.kq_kernel for p in tensors) and any(p is layer.form.head_kernel for p in tensors)
    assert_values_and_gradients(out, expected, [x, *tensors])
    if params["c_q"] > 1 or params["c_k"] > 1:  # the taps beyond the identity are at work
        theta = layer.form.kq_kernel.detach().clone()
        with torch.no_grad():
            layer.form.kq_kernel.zero_()
            layer.form.kq_kernel[:, 0, params["c_k"] // 2] = theta[:, 0, params["c_k"] // 2]
        assert (layer(x)[0] - out).abs().max() > 1e-3


def test_mta_defaults_and_parameter_shapes():
    form = mta_layer(4).form
    assert (form.c_q, form.c_k, form.c_h) == (6, 11, 2)
    assert form.kq_kernel.shape == (4, 6, 11) and form.head_kernel.shape == (2, 2, 2)
    odd = MultiHeadAttention(12, 3, score="mta", mask="causal").form
    assert (odd.c_q, odd.c_k, odd.c_h) == (6, 11, 1) and odd.head_kernel.shape == (3, 1, 1)
    layer = mta_layer(2, kernels=True)  # the defaults, wider than the sequence, against the reference
    x = rand(1, 5, D_MODEL, seed=32).requires_grad_(True)
    expected, _ = mta_reference(layer, x, causal_visible(1, 5, 5))
    assert_values_and_gradients(layer(x)[0], expected, [x, *layer.parameters()])
    assert layer.backend_for(dtype=torch.float64) == layer.backend_for(dtype=torch.float64, grad=False) == "eager"
    reason = decode_reason(layer)
    assert isinstance(reason, str) and "\n" not in reason


# ---------------------------------------------------------------------------------------------- MTA: masks


def test_mta_makes_the_calls_mask_causal_with_padding_and_a_row_that_sees_no_key():
    layer = mta_layer(4, c_q=3, c_k=5, c_h=2)
    B, L = 2, 7
    keys = torch.ones(B, L, dtype=torch.bool)
    keys[0, 0] = keys[1, 3] = keys[1, 6] = False  # sequence 0: row 0 sees no key
    x = rand(B, L, D_MODEL, seed=33).requires_grad_(True)
    out, weights = layer(x, mask=keys[:, None, None, :], need_weights=True)  # key padding only: ANDed with causal
    expected, mixed = mta_reference(layer, x, causal_visible(B, L, L, keys))
    assert torch.isfinite(out).all() and (weights[0, :, 0] == 0).all()
    torch.testing.assert_close(out[0, 0], layer.out_proj.bias.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, mixed, rtol=ATOL, atol=ATOL)
    assert_values_and_gradients(out, expected, [x, *layer.parameters()])
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())
    # no mask, a Mask and the dense causal mask: all causal
    causal = mta_reference(layer, x, causal_visible(B, L, L))[0]
    for mask in (None, build_mask("causal"), causal_visible(B, L, L)[:, None]):
        torch.testing.assert_close(layer(x, mask=mask)[0], causal, rtol=ATOL, atol=ATOL)


def test_mta_changing_trailing_padding_leaves_the_real_tokens_unchanged():
    layer = mta_layer(4, c_q=3, c_k=5, c_h=2)
    B, L = 2, 7
    keys = torch.ones(B, L, dtype=torch.bool)
    keys[0, 5:] = keys[1, 6] = False
    x = rand(B, L, D_MODEL, seed=34)
    y = x.clone()
    y[~keys] = rand(int((~keys).sum()), D_MODEL, seed=35)
    mask = keys[:, None, None, :]
    a, b = layer(x, mask=mask)[0], layer(y, mask=mask)[0]
    torch.testing.assert_close(a[keys], b[keys], rtol=1e-12, atol=1e-12)


def test_mta_changing_a_padded_token_in_the_middle_leaves_the_real_tokens_unchanged():
    layer = mta_layer(2, c_q=3, c_k=5, c_h=2)
    B, L = 1, 6
    keys = torch.ones(B, L, dtype=torch.bool)
    keys[0, 2] = False
    x = rand(B, L, D_MODEL, seed=36)
    y = x.clone()
    y[0, 2] = 3 * rand(D_MODEL, seed=37)
    a, b = layer(x, mask=keys[:, None, None, :])[0], layer(y, mask=keys[:, None, None, :])[0]
    torch.testing.assert_close(a[keys], b[keys], rtol=1e-12, atol=1e-12)


def test_mta_no_output_depends_on_a_later_token_even_with_a_wide_kernel():
    layer = mta_layer(2, c_q=4, c_k=9, c_h=2)  # c_k wider than the sequence: the kernel reaches later keys
    B, L = 2, 6
    x = rand(B, L, D_MODEL, seed=38)
    base = layer(x)[0]
    for t in range(1, L):
        y = x.clone()
        y[:, t:] = rand(B, L - t, D_MODEL, seed=40 + t)
        changed = layer(y)[0]
        torch.testing.assert_close(changed[:, :t], base[:, :t], rtol=1e-12, atol=1e-12)
        assert (changed[:, t:] - base[:, t:]).abs().amax(-1).min() > 1e-8, t


# ---------------------------------------------------------------------------------------------- MTA: refusals, FLOPs


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"backend": "sdpa"}, r"^attention.backend=sdpa cannot compute this layer: .*mta"),
        ({"backend": "normalized"}, r"^attention.backend=normalized cannot compute this layer: .*mta"),
        ({"backend": "biased_softmax"}, r"^attention.backend=biased_softmax cannot compute this layer: .*mta"),
        ({"backend": "flex"}, r"^attention.backend=flex cannot compute this layer: .*mta"),
        ({"foo": 1}, r"^variant mta has no parameter 'foo'; parameters: c_q, c_k, c_h$"),
        ({"c_h": 3}, r"^c_h=3 must divide the number of heads \(4\)"),
        ({"differential": True}, r"^variant mta does not compute model\.differential=true: its head mixing"),
        ({"mask": None}, r"^variant mta is causal only"),
    ],
    ids=[
        "sdpa",
        "normalized",
        "biased_softmax",
        "flex",
        "unknown_param",
        "c_h_not_dividing",
        "differential",
        "no_mask",
    ],
)
def test_what_mta_does_not_take_is_refused_in_one_line(options, match):
    with pytest.raises(ValueError, match=match) as err:
        MultiHeadAttention(D_MODEL, 4, score="mta", **{"mask": "causal", **options})
    assert "\n" not in str(err.value)


def test_mta_counts_its_convolution_and_head_mixing_flops():
    """Forward, eager both: MTA adds the key-query convolution (2·B·H·L²·c_q·c_k) and the head mixing
    (2·B·H·L²·c_h) to scaled dot-product attention's count."""
    B, L, H, c_q, c_k, c_h = 2, 6, 4, 3, 5, 2
    x = rand(B, L, D_MODEL, seed=50)
    mta = mta_layer(H, c_q=c_q, c_k=c_k, c_h=c_h)
    plain = MultiHeadAttention(D_MODEL, H, mask="causal", backend="eager").double()
    with torch.no_grad():
        extra = count_flops(lambda: mta(x)) - count_flops(lambda: plain(x, mask=build_mask("causal")))
    assert extra == 2 * B * H * L * L * (c_q * c_k + c_h) > 0
