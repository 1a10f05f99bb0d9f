"""The ``normalized`` backend and its softmax row kernel (:mod:`attnlab.kernels.softmax`): outputs and gradients
equal the eager stages and a textbook reference written out here (c·tanh(s/c), softmax as exp / sum), float64,
fresh random inputs, under masks (causal, padding, a row that sees no key), grouped heads, a learned position bias
with a soft-cap, differential attention; and the choice: it takes soft-capped or row-op layers, never plain softmax."""

from __future__ import annotations

import math
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import attnlab
from attnlab.backends import Conditions, build_backend
from attnlab.backends.normalized import POOL, NormalizedAttention, row_op_of
from attnlab.kernels import softmax as softmax_kernel
from attnlab.kernels.rows import RowOp
from attnlab.normalizers import Normalizer

pytestmark = [
    pytest.mark.skipif(not softmax_kernel.available(), reason="the softmax kernel cannot be built here"),
    pytest.mark.usefixtures("without_tiled"),  # (the tiled kernel takes a soft-capped softmax first)
]

B, L, D, H, DK = 2, 7, 16, 4, 4


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def textbook_weights(s, allowed, cap):
    """softmax over the allowed keys of c·tanh(s / c), by exp and sum; 0 elsewhere and in rows with no key."""
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if allowed is not None:
        s = torch.where(allowed, s, torch.full_like(s, -math.inf))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(e))


def padding_mask():
    """(B, 1, Lq, Lk): sequence 1 pads its last two keys, and its query row 3 sees no key at all."""
    allowed = torch.ones(B, 1, L, L, dtype=torch.bool)
    allowed[1, :, :, -2:] = False
    allowed[1, :, 3, :] = False
    return allowed


MASKS = {
    "none": lambda: None,
    "causal": lambda: torch.ones(L, L, dtype=torch.bool).tril(),
    "padding": padding_mask,
    "causal+padding": lambda: torch.ones(L, L, dtype=torch.bool).tril() & padding_mask(),
}


# ------------------------------------------------------------------------------------------------ the row kernel


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_row_op_equals_the_textbook_softmax_forward_and_backward_in_place(cap, dtype):
    s = randn(B, H, L, L + 2, seed=1, dtype=dtype) * 6
    allowed = torch.rand(B, 1, L, L + 2, generator=torch.Generator().manual_seed(2)) > 0.3
    allowed[0, 0, 4] = False  # a row that sees no key
    dw = randn(B, H, L, L + 2, seed=3, dtype=dtype)
    leaf = s.clone().requires_grad_()
    expected = textbook_weights(leaf, allowed, cap)
    (expected_grad,) = torch.autograd.grad((expected * dw).sum(), leaf)

    op = softmax_kernel.SoftcapSoftmax(cap)
    assert isinstance(op, RowOp)
    logits, d = s.clone(), dw.clone()
    weights, lse = op.forward(logits, allowed)
    assert weights.data_ptr() == logits.data_ptr() and lse.shape == (B, H, L)  # in place
    grad = op.backward(d, weights, lse)
    assert grad.data_ptr() == d.data_ptr()
    tol = {"rtol": 1e-12, "atol": 1e-13} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    torch.testing.assert_close(weights, expected.detach(), **tol)
    torch.testing.assert_close(grad, expected_grad, **tol)
    assert not weights[0, :, 4].any() and not grad[0, :, 4].any()  # the empty row: zeros, never NaN
    assert not weights.masked_select(~allowed.expand_as(weights)).any()
    assert not grad.masked_select(~allowed.expand_as(grad)).any()


def test_the_row_kernel_reads_a_mask_of_any_strides_and_keeps_extreme_logits_finite():
    s = randn(1, 2, 5, 9, seed=4) * 1e3  # far beyond the cap and exp's range
    allowed = (torch.rand(9, 5, generator=torch.Generator().manual_seed(5)) > 0.4).t()  # key stride 5, not 1
    for cap in (None, 2.0):
        w = softmax_kernel.softcap_softmax(s, allowed, cap)
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w, textbook_weights(s, allowed, cap), rtol=1e-12, atol=1e-13)


def test_the_differentiable_function_and_its_operator_pass_torch_s_checks():
    s = (randn(1, 2, 3, 5, seed=6) * 3).requires_grad_()
    allowed = torch.tensor([True, True, False, True, True])
    assert torch.autograd.gradcheck(lambda t: softmax_kernel.softcap_softmax(t, allowed, 2.5), (s,))
    torch.library.opcheck(torch.ops.attnlab.softcap_softmax.default, (s, allowed, 2.5))


# ------------------------------------------------------------------------------------------------ the backend


def textbook_layer(mha, x, allowed, bias=None):
    """The layer written out plainly from its parameters: projections, c·tanh(q kᵀ/√d_k + bias), the masked
    softmax by exp and sum, heads repeated for their groups, output projection."""
    G = mha.num_kv_heads
    q = F.linear(x, mha.q_proj.weight, mha.q_proj.bias).view(B, L, H, DK).transpose(1, 2)
    k = F.linear(x, mha.k_proj.weight, mha.k_proj.bias).view(B, L, G, DK).transpose(1, 2)
    v = F.linear(x, mha.v_proj.weight, mha.v_proj.bias).view(B, L, G, DK).transpose(1, 2)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(DK)
    if bias is not None:
        s = s + bias
    w = textbook_weights(s, allowed, mha.softcap)
    z = (w @ v).transpose(1, 2).reshape(B, L, H * DK)
    return F.linear(z, mha.out_proj.weight, mha.out_proj.bias)


def t5_bias(mha):
    """T5's (1, H, L, L) bias, read from its table by the bucket index."""
    table = mha.position_bias.rel_bias  # (num_buckets, H)
    return table[mha.position_bias.buckets(L, L, torch.device("cpu"))].permute(2, 0, 1).unsqueeze(0)


def check_against(mha, mask, reference=None):
    """normalized vs eager (and ``reference(mha, x)`` when given): outputs and the gradients of x and every
    parameter."""
    x = randn(B, L, D, seed=11).requires_grad_()
    c = randn(B, L, D, seed=12)
    params = [x, *mha.parameters()]
    with mock.patch.object(NormalizedAttention, "apply", wraps=NormalizedAttention.apply) as spy:
        got, _ = build_backend("normalized").attend(mha, x, None, mask)
    assert spy.call_count == 1  # the fused function ran (not a fallback to eager)
    got_grads = torch.autograd.grad((got * c).sum(), params, allow_unused=True)
    refs = [mha.attend(x, mask=mask).out]
    if reference is not None:
        refs.append(reference(mha, x))
    for ref in refs:
        ref_grads = torch.autograd.grad((ref * c).sum(), params, allow_unused=True)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
        for g, r in zip(got_grads, ref_grads, strict=True):
            if r is None:
                assert g is None or not g.any()
            else:
                torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_softcapped_layers_equal_eager_and_the_textbook_layer(mask, kv_heads):
    torch.manual_seed(0)
    mha = attnlab.MultiHeadAttention(D, H, DK, softcap=2.0, num_kv_heads=kv_heads).double()
    allowed = MASKS[mask]()
    check_against(mha, allowed, lambda m, x: textbook_layer(m, x, allowed))


@pytest.mark.parametrize("mask", ["none", "padding"])
def test_a_learned_t5_bias_with_a_softcap_gets_its_table_gradient(mask):
    torch.manual_seed(1)
    mha = attnlab.MultiHeadAttention(D, H, DK, softcap=1.5, position_bias="t5").double()
    with torch.no_grad():
        mha.position_bias.rel_bias.mul_(20)  # large enough that the cap bends it
    allowed = MASKS[mask]()
    check_against(mha, allowed, lambda m, x: textbook_layer(m, x, allowed, t5_bias(m)))
    assert mha.backend_for("cpu", torch.float64) == "normalized"


@pytest.mark.parametrize("config", [{"score": "alibi"}, {"differential": True}, {"qk_norm": "rmsnorm", "rope": True}])
def test_other_stages_with_a_softcap_equal_eager(config):
    torch.manual_seed(2)
    mha = attnlab.MultiHeadAttention(D, H, DK, softcap=2.0, **config).double()
    check_against(mha, MASKS["causal+padding"]())


class _PlainSoftmaxWithRowOp(Normalizer):
    """A normalizer that is not ``is_softmax`` but offers a row op (the kernel's uncapped softmax): the backend then
    applies the soft-cap itself, before the row op."""

    def forward(self, logits, allowed=None):
        return textbook_weights(logits, allowed, None)

    def row_op(self):
        return softmax_kernel.SoftcapSoftmax(None)


@pytest.mark.parametrize("mask", ["none", "causal+padding"])
def test_a_row_op_normalizer_gets_the_softcap_applied_before_it(mask):
    torch.manual_seed(3)
    mha = attnlab.MultiHeadAttention(D, H, DK, softcap=2.0, num_kv_heads=2).double()
    mha.normalizer = _PlainSoftmaxWithRowOp()
    op, cap = row_op_of(mha)
    assert op.cap is None and cap == 2.0
    allowed = MASKS[mask]()
    check_against(mha, allowed, lambda m, x: textbook_layer(m, x, allowed))


@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", "softpick"])
def test_the_normalizers_row_ops_equal_eager_where_they_offer_one(normalizer):
    torch.manual_seed(4)
    mha = attnlab.MultiHeadAttention(D, H, DK, softcap=3.0, normalizer=normalizer).double()
    if row_op_of(mha)[0] is None:
        pytest.skip(f"normalizer={normalizer} offers no row op here")
    assert mha.backend_for("cpu", torch.float64) == "normalized"
    check_against(mha, MASKS["causal+padding"]())


# ------------------------------------------------------------------------------------------------ the choice


def test_it_takes_softcapped_softmax_layers_and_never_plain_softmax():
    backend = build_backend("normalized")
    capped = attnlab.MultiHeadAttention(D, H, DK, softcap=5.0)
    assert capped.backend_for("cpu", torch.float32) == "normalized"
    assert capped.backend_for("cpu", torch.float32, training=False, grad=False) == "normalized"
    assert capped.backend_for("cpu", need_weights=True) == "eager"
    for plain in (
        attnlab.MultiHeadAttention(D, H, DK),
        attnlab.MultiHeadAttention(D, H, DK, position_bias="t5"),
        attnlab.MultiHeadAttention(D, H, DK, score="alibi"),
    ):
        reason = backend.config_reason(plain)
        assert reason is not None and "\n" not in reason and "sdpa" in reason
        assert plain.backend_for("cpu", torch.float32) != "normalized"


@pytest.mark.parametrize(
    ("options", "when", "pattern"),
    [
        ({"softcap": 5.0, "score": "additive"}, None, r"dot-product scores only, not additive"),
        ({"softcap": 5.0, "position_bias": "shaw", "position_bias_params": {"value_term": True}}, None, "value"),
        ({"softcap": 5.0, "normalizer": "softmax1"}, None, r"normalizer=softmax1 has no row operation"),
        ({"softcap": 5.0, "dropout": 0.1}, Conditions(), r"no dropout"),
        ({"softcap": 5.0}, Conditions("cuda"), r"CPU only, not cuda"),
        ({"softcap": 5.0}, Conditions(dtype=torch.bfloat16), r"float32 and float64, not torch.bfloat16"),
    ],
)
def test_what_it_cannot_compute_is_refused_in_one_line(options, when, pattern):
    """A configuration it cannot compute is refused when a layer forcing it is built; a call's conditions, at the
    call."""
    mha = attnlab.MultiHeadAttention(D, H, DK, **options)
    reason = build_backend("normalized").supports(mha, when)
    assert reason is not None and "\n" not in reason
    assert re.search(pattern, reason), reason
    if when is None:
        with pytest.raises(ValueError, match=r"^attention.backend=normalized cannot compute this layer: [^\n]*$"):
            attnlab.MultiHeadAttention(D, H, DK, backend="normalized", **options)


def test_a_forward_pass_without_gradients_and_the_flop_count_equal_eager():
    torch.manual_seed(5)
    mha = attnlab.MultiHeadAttention(D, H, DK, softcap=2.0).double()
    x = randn(B, L, D, seed=13)
    with torch.no_grad():
        got, _ = build_backend("normalized").attend(mha, x, None, MASKS["causal"]())
        torch.testing.assert_close(got, mha.attend(x, mask=MASKS["causal"]()).out, rtol=1e-10, atol=1e-12)
    counts = []
    for run in (lambda: build_backend("normalized").attend(mha, x, None, None)[0], lambda: mha.attend(x).out):
        with FlopCounterMode(display=False) as counter:
            run().sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_its_buffers_are_reused_and_a_retained_graph_gives_the_same_gradients_twice():
    torch.manual_seed(6)
    mha = attnlab.MultiHeadAttention(D, H, DK, softcap=2.0, position_bias="t5").double()
    x = randn(B, L, D, seed=14).requires_grad_()
    POOL.clear()
    out, _ = build_backend("normalized").attend(mha, x, None, MASKS["causal"]())
    first = torch.autograd.grad(out.sum(), [x, *mha.parameters()], retain_graph=True)
    second = torch.autograd.grad(out.sum(), [x, *mha.parameters()])
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(POOL._idle) == 1  # the backward pass's buffer; the forward pass's is still held by the graph
    del out
    assert len(POOL._idle) == 2  # freed with the graph
    with torch.no_grad():
        build_backend("normalized").attend(mha, x, None, None)
    assert len(POOL._idle) == 2  # taken and given back at once
