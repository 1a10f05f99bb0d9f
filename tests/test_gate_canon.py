"""The gated output (Qiu et al. 2025, ``AttentionConfig.output_gate``) and Canon layers (Allen-Zhu 2025,
``Encoder(canon=...)``), against references written plainly here, in float64, values and gradients.

* Gated output: z_h ← z_h ⊙ σ(x W_g + b)_h before ``out_proj``, headwise (column h for head h) or elementwise
  (columns h·d_v … (h+1)·d_v − 1), on softmax (eager, sdpa), linear attention and the decay/delta forms (chunked,
  recurrent, eager): the layer equals the same layer without a gate whose ``out_proj`` input is multiplied by the
  gate written out here; the gate recorded in :class:`~attnlab.attention.AttentionOutput` is σ(x W_g + b) per head;
  a query row that sees no key stays finite; causality; right padding; decoding one token at a time.
* Canon layers: y_t = x_t + Σ_{m<k} w_m ⊙ x_{t−k+1+m} (zeros before the start) at A (the attention's input), C (the
  feed-forward's input), D (after the feed-forward's first linear map) and B (q, k, v after their projections); the
  block rewritten by hand, pre-LN and post-LN; the refusals, each one line.
* :func:`attnlab.metrics.gate_stats` against a loop, and ``train.py`` with ``model.canon`` and
  ``attention.output_gate`` (slow: a subprocess).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_same, grads, randn
from helpers import randomize_, run_train

from attnlab.attention import MultiHeadAttention
from attnlab.config import AttentionConfig
from attnlab.decode import decode
from attnlab.encoder import Encoder, EncoderLayer, canon_points, with_canon_b
from attnlab.masks import build_mask
from attnlab.metrics import gate_stats

pytestmark = pytest.mark.usefixtures("single_thread")

D_MODEL, H, D_K, D_V = 8, 2, 4, 3  # d_v ≠ d_k and ≠ 1: a wrong gate layout cannot hide
GATES = ("headwise", "elementwise")

# (attention config fields, forced backend: "attend" = the eager path through layer.attend)
FORMS = {
    "softmax": {"score": "scaled_dot", "mask": "causal"},
    "softmax_nomask": {"score": "scaled_dot"},
    "linear": {"score": "linear", "normalizer": "rowsum", "mask": "causal"},
    "softmax_differential": {"score": "scaled_dot", "mask": "causal", "differential": True},
    "mla": {"score": "mla", "mask": "causal"},
    **{
        f: {"score": f, "normalizer": "none", "mask": "causal"}
        for f in ("gla", "gated_deltanet", "kda", "rwkv7", "deltanet", "retnet", "deltaproduct")
    },
}
GATED_CASES = [
    ("softmax", "attend"),
    ("softmax", "eager"),
    ("softmax", "sdpa"),
    ("softmax_nomask", "sdpa"),
    ("linear", "attend"),
    ("linear", "chunked"),
    ("gla", "attend"),
    ("gla", "chunked"),
    ("gla", "recurrent"),
    ("gated_deltanet", "chunked"),
    ("gated_deltanet", "recurrent"),
    ("kda", "chunked"),
    ("rwkv7", "attend"),
    ("rwkv7", "chunked"),
    ("deltanet", "chunked"),
    ("retnet", "chunked"),
    ("deltaproduct", "chunked"),
    ("softmax_differential", "attend"),
    ("mla", "attend"),
]


# ---------------------------------------------------------------------------------------------- references


def sigmoid_gate(x, weight, bias):
    """σ(x W_gᵀ + b) written out: x (B, L, d_model) → (B, L, n_out)."""
    logits = torch.einsum("bld,od->blo", x, weight)
    if bias is not None:
        logits = logits + bias
    return 1.0 / (1.0 + torch.exp(-logits))


def gate_columns(kind, num_heads, d_v):
    """The gate's output column for each column of ``out_proj``'s input (head h's channel c is column h·d_v + c):
    h headwise, h·d_v + c elementwise."""
    return [h if kind == "headwise" else h * d_v + c for h in range(num_heads) for c in range(d_v)]


def canon_conv(x, weight):
    """A Canon layer written out: y_t = x_t + Σ_{m<k} w[c, 0, m] · x_{t−k+1+m} per channel c, zeros before the
    start; x (B, L, C), weight (C, 1, k)."""
    _, L, _ = x.shape
    k = weight.shape[-1]
    rows = []
    for t in range(L):
        acc = x[:, t]
        for m in range(k):
            s = t - k + 1 + m
            if s >= 0:
                acc = acc + weight[:, 0, m] * x[:, s]
        rows.append(acc)
    return torch.stack(rows, dim=1)


def one_line(exc_info):
    message = str(exc_info.value)
    assert message and "\n" not in message, message
    return message


def gated_layer(form, gate, backend="auto", seed=0):
    """A float64 layer of ``form`` with ``gate``, every parameter drawn from N(0, 0.5²), and the same layer without
    the gate sharing every other parameter's values."""
    options = dict(FORMS[form])
    mask = options.get("mask")
    config = AttentionConfig(**options, output_gate=gate, backend=backend)
    layer = randomize_(MultiHeadAttention(D_MODEL, H, D_K, D_V, config=config).double(), seed, scale=0.5)
    plain = MultiHeadAttention(D_MODEL, H, D_K, D_V, config=config.replace(output_gate=None)).double()
    missing, unexpected = plain.load_state_dict(layer.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == sorted(n for n in layer.state_dict() if n.startswith("g_proj."))
    return layer, plain, (None if mask is None else build_mask(mask))


# ---------------------------------------------------------------------------------------------- the gated output


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize(("form", "backend"), GATED_CASES, ids=[f"{f}-{b}" for f, b in GATED_CASES])
def test_gated_output_matches_the_ungated_layer_times_the_written_out_gate(form, backend, gate):
    layer, plain, mask = gated_layer(form, gate, "auto" if backend == "attend" else backend)
    x = randn(2, 6, D_MODEL, seed=1, requires_grad=True)
    g_params = [p for n, p in layer.named_parameters() if n.startswith("g_proj.")]
    assert tuple(g_params[0].shape) == (H * (D_V if gate == "elementwise" else 1), D_MODEL)
    assert layer.output_gate == gate and plain.output_gate is None

    def run(m):
        return m.attend(x, mask=mask).out if backend == "attend" else m(x, mask=mask)[0]

    g = layer.g_proj
    columns = gate_columns(gate, H, D_V)

    def multiply_by_gate(module, args):
        (z,) = args  # (B, L, H·d_v): the heads side by side
        return (z * sigmoid_gate(x, g.weight, g.bias)[..., columns],)

    hook = plain.out_proj.register_forward_pre_hook(multiply_by_gate)
    try:
        expected = run(plain)
    finally:
        hook.remove()
    out = run(layer)
    # values, and gradients w.r.t. x, the gate's parameters and every parameter the two layers share
    shared = [n for n, _ in plain.named_parameters()]
    ours, theirs = dict(layer.named_parameters()), dict(plain.named_parameters())
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    got = grads(out, [x, *g_params, *(ours[n] for n in shared)])
    want = grads(expected, [x, *g_params, *(theirs[n] for n in shared)])
    for name, a, b in zip(["x", *(f"g_proj.{i}" for i in range(len(g_params))), *shared], got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"grad of {name}: {m}")
    assert g_params[0].grad is None and got[1].abs().sum() > 0  # the gate's weight is trained
    # the gate changes the output (the test could fail)
    assert not torch.allclose(out, run(plain))


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("form", ["softmax", "gla", "rwkv7"])
def test_recorded_gate_is_the_sigmoid_of_the_layers_input_per_head(form, gate):
    layer, plain, mask = gated_layer(form, gate, seed=3)
    x = randn(2, 5, D_MODEL, seed=4)
    o = layer.attend(x, mask=mask)
    width = 1 if gate == "headwise" else D_V
    assert o.gate.shape == (2, H, 5, width)
    W, b = layer.g_proj.weight, layer.g_proj.bias
    expected = torch.empty(2, H, 5, width, dtype=torch.float64)
    for bi in range(2):
        for h in range(H):
            for i in range(5):
                for c in range(width):
                    col = h if gate == "headwise" else h * D_V + c
                    a = (x[bi, i] * W[col]).sum() + (0.0 if b is None else b[col])
                    expected[bi, h, i, c] = 1.0 / (1.0 + torch.exp(-a))
    torch.testing.assert_close(o.gate, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.gate_values(x), expected, rtol=1e-12, atol=1e-12)
    assert plain.attend(x, mask=mask).gate is None and plain.gate_values(x) is None


def test_encoder_records_each_layers_gate():
    torch.manual_seed(0)
    enc = Encoder(20, D_MODEL, H, 2, mask="causal", output_gate="elementwise").double()
    tokens = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0))
    _, records = enc(tokens, need_weights=True)
    assert len(records) == 2
    for record in records:
        assert record.gate.shape == (2, H, 5, D_MODEL // H)
        assert ((record.gate > 0) & (record.gate < 1)).all()


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("path", ["attend", "forward"])
def test_a_query_row_that_sees_no_key_gives_finite_output_and_gradients(gate, path):
    layer, _, _ = gated_layer("softmax_nomask", gate, seed=5)
    x = randn(2, 5, D_MODEL, seed=6, requires_grad=True)
    allowed = torch.ones(5, 5, dtype=torch.bool)
    allowed[2] = False  # query 2 sees no key
    allowed[4, 1] = False
    out = layer.attend(x, mask=allowed).out if path == "attend" else layer(x, mask=allowed)[0]
    assert torch.isfinite(out).all()
    # no key: z = 0, and the gated z too, so the row is out_proj's bias
    torch.testing.assert_close(out[:, 2], layer.out_proj.bias.expand(2, -1), rtol=0, atol=1e-12)
    gx, gw = torch.autograd.grad(out.square().sum(), [x, layer.g_proj.weight])
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()


@pytest.mark.parametrize("gate", GATES)
def test_a_gated_layer_takes_the_empty_sequence_as_an_ungated_one_does(gate):
    layer, plain, _ = gated_layer("softmax_nomask", gate)
    x = torch.zeros(2, 0, D_MODEL, dtype=torch.float64)
    assert plain(x)[0].shape == (2, 0, D_MODEL)  # (the ungated layer takes it)
    assert layer(x)[0].shape == (2, 0, D_MODEL)


def causal_jacobian_check(f, x):
    """d f(x)_i / d x_j is 0 for every j > i (x (1, L, d)), and not everywhere 0 for j < i."""
    J = torch.autograd.functional.jacobian(f, x)  # (1, L, d, 1, L, d)
    L = x.shape[1]
    for i in range(L):
        for j in range(L):
            block = J[0, i, :, 0, j, :]
            if j > i:
                assert block.abs().max() == 0, f"output {i} depends on input {j}"
    assert J[0, L - 1, :, 0, 0, :].abs().max() > 0  # the last row reads the first token


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("form", ["softmax", "linear", "gla", "gated_deltanet", "kda", "rwkv7"])
def test_gated_layer_is_causal(form, gate):
    layer, _, mask = gated_layer(form, gate, seed=7)
    x = randn(1, 5, D_MODEL, seed=8)
    causal_jacobian_check(lambda t: layer(t, mask=mask)[0], x)
    causal_jacobian_check(lambda t: layer.attend(t, mask=mask).out, x)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("gate", GATES)
def test_canon_abcd_encoder_with_a_gate_is_causal(gate, norm_first):
    torch.manual_seed(1)
    enc = Encoder(20, D_MODEL, H, 2, d_ff=12, mask="causal", canon="ABCD", canon_width=3, output_gate=gate)
    enc = randomize_(enc.double(), seed=2, scale=0.5)
    tokens = torch.randint(1, 20, (1, 6), generator=torch.Generator().manual_seed(3))
    masks = enc.build_masks(tokens)

    def layers(h):
        for layer, m in zip(enc.layers, masks, strict=True):
            h = layer(h, m)[0]
        return enc.norm(h)

    causal_jacobian_check(layers, randn(1, 6, D_MODEL, seed=4))
    # end to end: changing a later token changes nothing before it
    out = enc(tokens)
    later = tokens.clone()
    later[0, 4] = (later[0, 4] % 19) + 1
    changed = enc(later)
    torch.testing.assert_close(changed[:, :4], out[:, :4], rtol=0, atol=0)
    assert not torch.allclose(changed[:, 4:], out[:, 4:])


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize(
    ("variant", "mask"),
    [("softmax", "causal"), ("softmax", None), ("gated_deltanet", "causal")],  # (a delta form is causal only)
)
def test_right_padding_leaves_the_real_positions_of_a_canon_encoder_unchanged(variant, mask, gate):
    torch.manual_seed(2)
    extra = {} if variant == "softmax" else {"score": variant, "normalizer": "none"}
    enc = Encoder(20, D_MODEL, H, 2, d_ff=12, pad_id=0, mask=mask, canon="ABCD", output_gate=gate, **extra)
    enc = randomize_(enc.double(), seed=3, scale=0.5)
    gen = torch.Generator().manual_seed(4)
    real = torch.randint(1, 20, (2, 4), generator=gen)
    padded = torch.cat([real, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    alone = enc(real)
    torch.testing.assert_close(enc(padded)[:, :4], alone, rtol=1e-10, atol=1e-10)
    garbage = torch.cat([real, torch.randint(1, 20, (2, 3), generator=gen)], dim=1)
    if mask == "causal":  # what comes after the real tokens, pad or not, is never read
        torch.testing.assert_close(enc(garbage)[:, :4], alone, rtol=1e-10, atol=1e-10)
    else:  # without the causal mask later real tokens are read: the padding mask is what hides the pads
        assert not torch.allclose(enc(garbage)[:, :4], alone)


DECODE_CASES = {
    "softmax_headwise": ({"mask": "causal", "output_gate": "headwise"}, True),
    "softmax_elementwise": ({"mask": "causal", "output_gate": "elementwise"}, True),
    "softmax_elementwise_post_ln": ({"mask": "causal", "output_gate": "elementwise"}, False),
    "gated_deltanet_elementwise": (
        {
            "attention": AttentionConfig(
                score="gated_deltanet", normalizer="none", mask="causal", output_gate="elementwise"
            )
        },
        True,
    ),
    "gla_headwise": (
        {"attention": AttentionConfig(score="gla", normalizer="none", mask="causal", output_gate="headwise")},
        True,
    ),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decoding_a_gated_canon_abcd_encoder_gives_the_parallel_forward(case):
    options, norm_first = DECODE_CASES[case]
    torch.manual_seed(3)
    enc = Encoder(20, D_MODEL, H, 2, d_ff=12, max_len=32, canon="ABCD", norm_first=norm_first, **options)
    enc = randomize_(enc.double(), seed=5, scale=0.5).eval()
    assert all(layer.self_attn.output_gate is not None for layer in enc.layers)
    tokens = torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(decode(enc, tokens), enc(tokens), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------- Canon layers


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_ln", "post_ln"])
@pytest.mark.parametrize("canon", ["ACD", "ABCD", "D", "CA"])
def test_canon_block_matches_the_block_written_by_hand(canon, norm_first):
    k, d_ff = 3, 12
    layer = EncoderLayer(
        D_MODEL, H, d_ff=d_ff, norm_first=norm_first, canon=canon, canon_width=k, mask="causal", output_gate="headwise"
    )
    layer = randomize_(layer.double(), seed=7, scale=0.5)
    points = canon_points(canon)
    for point, conv, channels in (
        ("A", layer.canon_a, D_MODEL),
        ("C", layer.canon_c, D_MODEL),
        ("D", layer.canon_d, d_ff),
    ):
        if point in points:
            assert conv.conv.weight.shape == (channels, 1, k) and conv.residual
        else:
            assert conv is None
    mask = build_mask("causal")
    x = randn(2, 6, D_MODEL, seed=8, requires_grad=True)

    def attn(h):
        return layer.self_attn(h, mask=mask)[0]

    def point(name, h):
        conv = {"A": layer.canon_a, "C": layer.canon_c, "D": layer.canon_d}[name]
        return canon_conv(h, conv.conv.weight) if name in points else h

    def ff(h):
        return layer.ff[2](layer.ff[1](point("D", layer.ff[0](h))))

    if norm_first:
        h = x + attn(point("A", layer.norm1(x)))
        expected = h + ff(point("C", layer.norm2(h)))
    else:
        h = layer.norm1(x + attn(point("A", x)))
        expected = layer.norm2(h + ff(point("C", h)))
    out = layer(x, mask=mask)[0]
    convs = [c.conv.weight for c in (layer.canon_a, layer.canon_c, layer.canon_d) if c is not None]
    assert_same(out, expected, [x, *convs, layer.ff[0].weight, layer.self_attn.g_proj.weight])
    # each Canon layer changes the block (the test could fail): the same block without it differs
    with torch.no_grad():
        for c in convs:
            saved = c.clone()
            c.zero_()
            assert not torch.allclose(layer(x, mask=mask)[0], out)
            c.copy_(saved)


def canon_b_layers():
    width = 3
    yield "keywords", EncoderLayer(D_MODEL, H, canon="B", canon_width=width, mask="causal")
    yield "config", EncoderLayer(D_MODEL, H, canon="AB", canon_width=width, attention=AttentionConfig(mask="causal"))
    yield "encoder", Encoder(20, D_MODEL, H, 1, mask="causal", canon="BD", canon_width=width).layers[0]
    # a config that already has Canon-B's convolution is taken as it is
    same = AttentionConfig(short_conv=width, short_conv_residual=True)
    yield "already_b", EncoderLayer(D_MODEL, H, canon="B", canon_width=width, attention=same)


@pytest.mark.parametrize("which", ["keywords", "config", "encoder", "already_b"])
def test_canon_b_adds_a_residual_causal_convolution_to_the_projections(which):
    layer = dict(canon_b_layers())[which]
    attn = randomize_(layer.self_attn.double(), seed=9, scale=0.5)
    assert attn.config.short_conv == 3 and attn.config.short_conv_residual
    assert attn.rope is None and attn.q_norm is None
    x = randn(2, 6, D_MODEL, seed=10, requires_grad=True)
    q, k, v = attn.project(x)

    def expected(proj, conv, d):
        p = x @ proj.weight.T + proj.bias  # (B, L, H·d)
        y = canon_conv(p, conv.conv.weight)
        return y.reshape(2, 6, H, d).transpose(1, 2)

    weights = [attn.q_conv.conv.weight, attn.k_conv.conv.weight, attn.v_conv.conv.weight]
    d_k, d_v = attn.d_k, attn.d_v
    for got, want in zip(
        (q, k, v),
        (
            expected(attn.q_proj, attn.q_conv, d_k),
            expected(attn.k_proj, attn.k_conv, d_k),
            expected(attn.v_proj, attn.v_conv, d_v),
        ),
        strict=True,
    ):
        assert_same(got, want, [x, *weights])


# ---------------------------------------------------------------------------------------------- refusals


def loop_conv(x, w, residual):
    """y_t = r·x_t + Σ_m w[c, m]·x_{t−k+1+m} by loops (x (B, L, C), w (C, k))."""
    L, k = x.shape[1], w.shape[1]
    rows = []
    for t in range(L):
        y = x[:, t] if residual else torch.zeros_like(x[:, t])
        for m in range(k):
            s = t - k + 1 + m
            if s >= 0:
                y = y + w[:, m] * x[:, s]
        rows.append(y)
    return torch.stack(rows, dim=1) if rows else x * 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kernel", [True, False], ids=["c_kernel", "tensor_ops"])
@pytest.mark.parametrize(("B", "L", "C", "k"), [(2, 9, 5, 4), (1, 2, 3, 4), (3, 1, 4, 2), (2, 7, 6, 1), (1, 0, 3, 4)])
def test_causal_conv_kernel_and_its_fallback_match_the_loops(B, L, C, k, kernel, dtype, monkeypatch):
    """attnlab.kernels.conv.causal_conv, through the C kernel and through the tensor operations (the kernel turned
    off), equals the convolution written as loops, values and both gradients, with and without the residual; rows
    shorter than the kernel (L < k), one row, and more threads than rows (B·L = 2 on 2 threads) included."""
    from attnlab.kernels import conv

    if kernel and conv._LIBRARY.get() is None:
        pytest.skip(f"the conv kernel is not available: {conv._LIBRARY.error}")
    if not kernel:
        monkeypatch.setattr(conv, "_kernel_for", lambda x: None)
    gen = torch.Generator().manual_seed(B * 100 + L * 10 + C)
    for residual in (False, True):
        x = torch.randn(B, L, C, generator=gen, dtype=dtype, requires_grad=True)
        w = torch.randn(C, k, generator=gen, dtype=dtype, requires_grad=True)
        g = torch.randn(B, L, C, generator=gen, dtype=dtype)
        y, want = conv.causal_conv(x, w, residual), loop_conv(x, w, residual)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
        torch.testing.assert_close(y, want, **tol)
        got = torch.autograd.grad(y, (x, w), g, allow_unused=True)
        ref = torch.autograd.grad(want, (x, w), g, allow_unused=True)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a if b is not None else None, b, **tol)


@pytest.mark.parametrize("canon", ["ABE", "AA", "abcd", "ABCDA"])
def test_canon_points_outside_abcd_or_repeated_are_refused_in_one_line(canon):
    with pytest.raises(ValueError) as exc:
        EncoderLayer(D_MODEL, H, canon=canon)
    assert "canon" in one_line(exc) and repr(canon) in str(exc.value)
    with pytest.raises(ValueError) as exc:
        Encoder(20, D_MODEL, H, 1, canon=canon)
    one_line(exc)
    with pytest.raises(ValueError) as exc:
        canon_points(canon, "model.canon")
    assert one_line(exc).startswith("model.canon")


def test_canon_points_are_put_in_order():
    assert canon_points("DCA") == "ACD" and canon_points(None) == ""
    with pytest.raises(ValueError, match=r"got ''$"):  # an empty string is a value, not "off" (issue 60)
        canon_points("")
    layer = EncoderLayer(D_MODEL, H, canon=None)
    assert layer.canon_a is None and layer.canon_c is None and layer.canon_d is None
    assert layer.self_attn.short_conv is None


def test_canon_b_over_another_short_convolution_is_refused_in_one_line():
    with pytest.raises(ValueError) as exc:
        with_canon_b(AttentionConfig(short_conv=2), 4)
    assert "short_conv=2" in one_line(exc)
    with pytest.raises(ValueError) as exc:
        with_canon_b(AttentionConfig(short_conv=4), 4)  # the same width without a residual is not Canon-B
    one_line(exc)
    with pytest.raises(ValueError) as exc:
        EncoderLayer(D_MODEL, H, canon="B", short_conv=2)
    one_line(exc)
    with pytest.raises(ValueError) as exc:
        EncoderLayer(D_MODEL, H, canon="B", attention=AttentionConfig(short_conv=2))
    one_line(exc)
    with pytest.raises(ValueError) as exc:
        Encoder(20, D_MODEL, H, 1, canon="AB", attention=AttentionConfig(short_conv=2))
    one_line(exc)
    assert with_canon_b(AttentionConfig(), 4) == AttentionConfig(short_conv=4, short_conv_residual=True)


def test_a_residual_short_convolution_needs_one_and_a_bad_gate_is_refused_in_one_line():
    with pytest.raises(ValueError) as exc:
        AttentionConfig(short_conv_residual=True)
    assert "short_conv" in one_line(exc)
    for bad in ("yes", "head", True):
        with pytest.raises(ValueError) as exc:
            AttentionConfig(output_gate=bad)
        assert "output_gate" in one_line(exc)
    with pytest.raises(ValueError) as exc:
        MultiHeadAttention(D_MODEL, H, output_gate="yes")
    assert "output_gate" in one_line(exc)
    with pytest.raises(ValueError) as exc:
        EncoderLayer(D_MODEL, H, canon="A", canon_width=0)
    one_line(exc)


# ---------------------------------------------------------------------------------------------- diagnostics


@pytest.mark.parametrize("width", [1, D_V])
def test_gate_stats_is_the_mean_over_kept_rows_and_channels(width):
    gen = torch.Generator().manual_seed(11)
    gate = torch.rand(3, H, 5, width, generator=gen, dtype=torch.float64)
    keep = torch.rand(3, 5, generator=gen) > 0.4
    keep[0, 0] = True
    keep[1] = False  # a sequence with no kept row
    got = gate_stats(gate, keep)["gate_mean"]
    plain = gate_stats(gate)["gate_mean"]
    for h in range(H):
        total, count, every = 0.0, 0, 0.0
        for b in range(3):
            for i in range(5):
                row = sum(float(gate[b, h, i, c]) for c in range(width)) / width
                every += row
                if keep[b, i]:
                    total, count = total + row, count + 1
        assert float(got[h]) == pytest.approx(total / count, rel=1e-12)
        assert float(plain[h]) == pytest.approx(every / 15, rel=1e-12)
    assert torch.isnan(gate_stats(gate, torch.zeros(3, 5, dtype=torch.bool))["gate_mean"]).all()


# ---------------------------------------------------------------------------------------------- train.py


@pytest.mark.slow
def test_train_py_with_canon_and_a_gate_logs_the_gate_mean(tmp_path):
    run = tmp_path / "run"
    args = ("debug=fast", "model.canon=ABCD", "attention.output_gate=headwise", "mask=causal", "logger=csv")
    run_train(*args, f"hydra.run.dir={run}", returncode=0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any("attn/L0H0/gate_mean" in row for row in rows)
    values = [row["attn/L0H0/gate_mean"] for row in rows if "attn/L0H0/gate_mean" in row]
    assert all(0.0 < v < 1.0 for v in values)


@pytest.mark.slow
def test_train_py_refuses_bad_canon_points_in_one_line(tmp_path):
    proc = run_train("model.canon=ABE", "logger=none", f"hydra.run.dir={tmp_path / 'run'}", returncode=2)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.canon" in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
