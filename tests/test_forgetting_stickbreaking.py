"""Forgetting attention (``score=forgetting``, :mod:`attnlab.forms.forgetting`; Lin et al. 2025, eqs. 5-7) and
stick-breaking attention (normalizer ``stickbreaking``, :mod:`attnlab.normalizers` and the C kernel
:mod:`attnlab.kernels.stick`; Tan et al. 2025, eq. 3) against the papers' formulas written out here with loops.

Forgetting: f_t = σ(x_t w_h + b_h) from the layer's ``forget_proj`` tensors, D_ij = Σ_{l=j+1..i} log f_l summed
term by term for every (i, j), o_i = Σ_j softmax_j(q_i·k_j/√d_k + D_ij) v_j over j ≤ i, head by head; through the
eager, sdpa, auto and (forward only, float32) flex backends; with grouped keys, the "Pro" block (QK-norm, short
convolution, output gate) and a sink logit (softmax1, sink); values and gradients (x and the parameters) in
float64; masks (causal whatever the call passes, key padding, a row that sees no key, a later token never reaching
an earlier output); float32 at L 64 with strong forgetting; what is refused in one line; the command line.

Stick-breaking: β_ij = σ(z_ij), w_ij = β_ij Π_{k ∈ K(i), k > j} (1 − β_ik) as a product over the keys each row sees
(the query's own key left out unless ``attend_current``), for the C kernel and the PyTorch code, values and
gradients, broadcast and per-row masks, rows that see nothing, fewer queries than keys, extreme logits, float32; the
layer (eager and the fused ``normalized`` backend) against o_i = Σ_j w_ij v_j, its weights' leftover mass, its first
token, causality, padding, decoding token by token, and the backend it refuses.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import linear, masked_softmax, split_heads
from helpers import conv_loop, randomize_, run_cli

from attnlab.attention import MultiHeadAttention
from attnlab.config import AttentionConfig
from attnlab.decode import decode
from attnlab.encoder import Encoder
from attnlab.forms.base import LayerOptionError
from attnlab.forms.forgetting import FOX_PRO, ForgettingAttention
from attnlab.kernels import stick as stick_kernel
from attnlab.masks import build_mask
from attnlab.normalizers import build_normalizer, stick_breaking_weights

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: threads only add overhead on a busy machine

D_MODEL, H = 16, 2
D_K = D_MODEL // H


def rand(*shape, seed=1, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def sigmoid(z):
    """σ(z) = 1 / (1 + e^{−z}) (float64: finite for |z| ≤ 700)."""
    return 1 / (1 + torch.exp(-z))


def rms_norm(x, weight):
    """x / √(mean(x²) + eps) ⊙ weight over the last dimension (torch's RMSNorm default eps: the dtype's epsilon)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps) * weight


def assert_values_and_gradients(out, expected, inputs, atol=1e-10):
    torch.testing.assert_close(out, expected, rtol=atol, atol=atol)
    cot = rand(*out.shape, seed=99, dtype=out.dtype)
    got = torch.autograd.grad(out, inputs, cot, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(expected, inputs, cot, retain_graph=True, allow_unused=True)
    for g, w, t in zip(got, want, inputs, strict=True):
        g = torch.zeros_like(t) if g is None else g
        w = torch.zeros_like(t) if w is None else w
        torch.testing.assert_close(g, w, rtol=atol, atol=atol)


def one_line(err):
    text = str(err.value)
    assert text and "\n" not in text, text
    return text


# ============================================================================================== forgetting attention


def forget_gates(layer, x):
    """f (B, H, L): f_t = σ(x_t w_h + b_h), one gate per token and head from ``forget_proj``'s tensors."""
    return sigmoid(linear(layer.form.forget_proj, x)).transpose(1, 2)


def decay_bias(f):
    """D (B, H, L, L): D_ij = Σ_{l=j+1..i} log f_l for j ≤ i (a sum of the gates' logs for every pair), 0 for j > i
    (keys a causal row never sees)."""
    B, Hh, L = f.shape
    log_f = torch.log(f)
    zero = torch.zeros(B, Hh, dtype=f.dtype)
    rows = []
    for i in range(L):
        rows.append(torch.stack([log_f[:, :, j + 1 : i + 1].sum(-1) if j <= i else zero for j in range(L)], -1))
    return torch.stack(rows, dim=-2)


def softmax_rows(logits, visible, sink=None):
    """Softmax over the visible keys; with a ``sink`` logit b (a 0-d tensor) one more always visible logit b whose
    value is 0: e^{s_j} / (e^b + Σ_k e^{s_k}) (softmax1: b = 0). A row that sees no key (and has no sink) is all
    zero."""
    if sink is None:
        return masked_softmax(logits, visible)
    column = sink.expand(*logits.shape[:-1], 1)
    ones = torch.ones(*logits.shape[:-1], 1, dtype=torch.bool)
    return masked_softmax(torch.cat([logits, column], -1), torch.cat([visible.expand_as(logits), ones], -1))[..., :-1]


def fox_reference(layer, x, visible=None, bias=True):
    """Forgetting attention from the paper head by head with the layer's tensors: x (B, L, d_model), ``visible``
    bool broadcastable to (B, H, L, L) or None (ANDed with causal) → (out (B, L, d_model), weights (B, H, L, L)).
    The layer's options, when it has them: the short convolution (a loop), QK-norm (RMSNorm), grouped keys, the
    elementwise output gate, a sink logit (softmax1: 0; sink: the learned b_h). ``bias=False`` leaves D out (to
    show that the comparison can fail)."""
    B, L, _ = x.shape
    q, k, v = linear(layer.q_proj, x), linear(layer.k_proj, x), linear(layer.v_proj, x)
    if layer.short_conv is not None:
        q, k, v = (
            conv_loop(q, layer.q_conv.conv.weight),
            conv_loop(k, layer.k_conv.conv.weight),
            conv_loop(v, layer.v_conv.conv.weight),
        )
    G = layer.num_kv_heads
    q, k, v = split_heads(q, H), split_heads(k, G), split_heads(v, G)
    if layer.qk_norm is not None:
        assert layer.qk_norm == "rmsnorm"
        q, k = rms_norm(q, layer.q_norm.weight), rms_norm(k, layer.k_norm.weight)
    D = decay_bias(forget_gates(layer, x))
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    vis = causal if visible is None else causal & visible
    vis = vis.expand(B, H, L, L)
    name = layer.config.normalizer
    assert name in ("softmax", "softmax1", "sink")
    zs, weights = [], []
    for h in range(H):
        g = h // (H // G)  # the key/value head of query head h
        logits = q[:, h] @ k[:, g].transpose(1, 2) / math.sqrt(D_K)
        if bias:
            logits = logits + D[:, h]
        sink = {"softmax": None, "softmax1": torch.zeros((), dtype=x.dtype)}.get(name)
        if name == "sink":
            sink = layer.form.normalizer.sink_logit[h]
        w = softmax_rows(logits, vis[:, h], sink)
        z = w @ v[:, g]
        if layer.output_gate is not None:
            assert layer.output_gate == "elementwise"
            z = z * sigmoid(linear(layer.g_proj, x))[..., h * D_K : (h + 1) * D_K]
        zs.append(z)
        weights.append(w)
    return linear(layer.out_proj, torch.cat(zs, -1)), torch.stack(weights, 1)


def fox_layer(backend="eager", seed=0, **options):
    torch.manual_seed(seed)
    layer = MultiHeadAttention(D_MODEL, H, score="forgetting", mask="causal", backend=backend, **options)
    return randomize_(layer.double().eval(), seed, scale=0.5)


def fox_parameters(layer):
    ps = [layer.form.forget_proj.weight, layer.form.forget_proj.bias, layer.q_proj.weight, layer.k_proj.weight,
          layer.v_proj.weight, layer.out_proj.weight]  # fmt: skip
    if layer.short_conv is not None:
        ps += [layer.q_conv.conv.weight, layer.k_conv.conv.weight, layer.v_conv.conv.weight]
    if layer.qk_norm is not None:
        ps += [layer.q_norm.weight, layer.k_norm.weight]
    if layer.output_gate is not None:
        ps += [layer.g_proj.weight]
    if layer.config.normalizer == "sink":
        ps += [layer.form.normalizer.sink_logit]
    return ps


FOX_OPTIONS = [
    ("plain", {}),
    ("grouped_keys", {"num_kv_heads": 1}),
    ("pro_block", dict(FOX_PRO)),
]
FOX_IDS = [o[0] for o in FOX_OPTIONS]
BACKENDS = ["eager", "sdpa", "auto"]


def test_the_form_has_one_forget_gate_per_head_with_a_bias_and_the_pro_block_is_its_three_options():
    layer = fox_layer()
    assert isinstance(layer.form, ForgettingAttention)
    fp = layer.form.forget_proj
    assert fp.weight.shape == (H, D_MODEL) and fp.bias is not None and fp.bias.shape == (H,)
    assert FOX_PRO == {"output_gate": "elementwise", "qk_norm": "rmsnorm", "short_conv": 4}
    pro = fox_layer(**FOX_PRO)
    assert isinstance(pro.form, ForgettingAttention)
    assert (pro.qk_norm, pro.short_conv, pro.output_gate) == ("rmsnorm", 4, "elementwise")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [o[1] for o in FOX_OPTIONS], ids=FOX_IDS)
def test_forgetting_attention_matches_the_papers_equations(options, backend):
    layer = fox_layer(backend, **options)
    x = rand(2, 7, D_MODEL).requires_grad_(True)
    out, _ = layer(x)  # no mask: the form is causal by itself
    expected, _ = fox_reference(layer, x)
    assert_values_and_gradients(out, expected, [x, *fox_parameters(layer)])


def test_the_equations_test_can_fail_without_the_forget_bias_or_with_the_wrong_gates():
    """The bias matters at these sizes: the reference without D, or with the gates σ(−(x w + b)), is far off."""
    layer = fox_layer()
    x = rand(2, 7, D_MODEL)
    out = layer(x)[0]
    assert (out - fox_reference(layer, x, bias=False)[0]).abs().max() > 1e-2
    with torch.no_grad():
        layer.form.forget_proj.weight.neg_()
        layer.form.forget_proj.bias.neg_()
    assert (out - fox_reference(layer, x)[0]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "given",
    [
        lambda L: build_mask("causal"),
        lambda L: torch.ones(L, L, dtype=torch.bool).tril(),
        lambda L: torch.ones(1, 1, 1, L, dtype=torch.bool),
    ],
    ids=["causal_mask", "causal_tensor", "all_visible_padding"],
)
def test_whatever_mask_a_call_passes_the_form_is_causal(given, backend):
    layer = fox_layer(backend)
    L = 6
    x = rand(2, L, D_MODEL).requires_grad_(True)
    out, _ = layer(x, mask=given(L))
    expected, _ = fox_reference(layer, x)
    assert_values_and_gradients(out, expected, [x, layer.form.forget_proj.weight])


@pytest.mark.parametrize("normalizer", ["softmax1", "sink"])
@pytest.mark.parametrize("backend", ["eager", "sdpa", "auto"])
def test_a_sink_logit_counts_against_the_forget_biased_logits(backend, normalizer):
    """softmax1: w_ij = e^{s_ij + D_ij} / (1 + Σ_k e^{s_ik + D_ik}), the sink's logit (0; sink: a learned b_h)
    beside the biased logits, unbiased itself."""
    layer = fox_layer(backend, normalizer=normalizer)
    with torch.no_grad():
        layer.form.forget_proj.bias.fill_(-1.0)  # forget: |c_i| grows with i
    x = rand(2, 7, D_MODEL).requires_grad_(True)
    out, _ = layer(x)
    expected, _ = fox_reference(layer, x)
    assert_values_and_gradients(out, expected, [x, *fox_parameters(layer)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padded_token_in_the_middle_forgets_nothing_so_it_reaches_no_real_token(backend):
    """A token that cannot see its own key (padding) has f = 1: its input reaches no real row, neither as a key nor
    through its gate (with the gate counted, D_ij of a real row i across it would change with its input)."""
    layer = fox_layer(backend)
    L = 7
    keys = torch.ones(2, 1, 1, L, dtype=torch.bool)
    keys[:, ..., 3] = False  # token 3 is padding in both sequences
    x = rand(2, L, D_MODEL)
    y = x.clone()
    y[:, 3] = 5 * rand(2, D_MODEL, seed=7)
    with torch.no_grad():
        a, b = layer(x, mask=keys)[0], layer(y, mask=keys)[0]
    real = keys[:, 0, 0]
    torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-12)
    # the same rows against the paper's formula with token 3's gate set to 1 (log f = 0)
    with torch.no_grad():
        layer_gate = layer.form.forget_proj
        expected, _ = fox_reference(layer, x, keys)
        logf = torch.log(sigmoid(linear(layer_gate, x)))  # (B, L, H)
        assert logf[:, 3].abs().min() > 1e-3  # the gate would have counted
    rows_before = a[:, :3]
    torch.testing.assert_close(rows_before, expected[:, :3], rtol=0, atol=1e-10)  # before the pad: as the paper


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_padding_is_anded_with_causal_and_a_row_that_sees_no_key_gives_zeros(backend):
    layer = fox_layer(backend)
    L = 7
    keys = torch.ones(2, 1, 1, L, dtype=torch.bool)
    keys[0, ..., :2] = False  # sequence 0: left padding (its rows 0 and 1 see no key)
    keys[1, ..., 5:] = False  # sequence 1: right padding
    x = rand(2, L, D_MODEL).requires_grad_(True)
    out, _ = layer(x, mask=keys)
    expected, _ = fox_reference(layer, x, keys)
    assert_values_and_gradients(out, expected, [x, *fox_parameters(layer)])
    assert torch.isfinite(out).all()
    bias = layer.out_proj.bias.detach()
    torch.testing.assert_close(out[0, :2].detach(), bias.expand(2, D_MODEL), rtol=0, atol=1e-12)
    (gx,) = torch.autograd.grad(out[0, :2].sum(), x)
    assert torch.isfinite(gx).all() and (gx == 0).all()  # nothing reaches a row that sees nothing
    # the padded tokens' inputs do not reach the real rows (neither as keys nor through their gates: left padding
    # lies before every real key, right padding after every real query)
    y = x.detach().clone()
    y[0, :2] = rand(2, D_MODEL, seed=5)
    y[1, 5:] = rand(2, D_MODEL, seed=6)
    with torch.no_grad():
        a, b = layer(x.detach(), mask=keys)[0], layer(y, mask=keys)[0]
    real = keys[:, 0, 0]
    torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-12)
    assert not torch.allclose(a[1, 5:], b[1, 5:])  # a padded query still reads its own input


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [o[1] for o in FOX_OPTIONS], ids=FOX_IDS)
def test_a_later_token_never_changes_an_earlier_output(options, backend):
    layer = fox_layer(backend, **options)
    L = 6
    x = rand(1, L, D_MODEL)
    with torch.no_grad():
        base = layer(x)[0]
        for t in range(L):
            y = x.clone()
            y[:, t] += rand(D_MODEL, seed=10 + t)
            out = layer(y)[0]
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
            assert (out[:, t:] - base[:, t:]).abs().amax(-1).min() > 1e-8  # it reaches itself and every later row


def test_the_weights_are_the_reference_and_each_row_sums_to_one_over_the_earlier_keys():
    layer = fox_layer("sdpa")  # need_weights runs eager whatever the backend
    L = 6
    x = rand(2, L, D_MODEL)
    with torch.no_grad():
        _, w = layer(x, need_weights=True)
        _, expected = fox_reference(layer, x)
    torch.testing.assert_close(w, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, H, L, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (w[..., ~torch.ones(L, L, dtype=torch.bool).tril()] == 0).all()


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_float32_with_strong_forgetting_at_length_64_stays_close_to_float64(backend):
    """Gates σ(≈ −1): log f ≈ −1.3, |c_64| ≈ 85. The sdpa path adds −c_j to the logits, in float32 a rounding of
    about |c_L|·6e-8 ≈ 5e-6 per logit; the outputs stay within 1e-4 of float64 (measured: 1.5e-5 sdpa, 1.3e-5 eager)."""
    layer = fox_layer(backend)
    with torch.no_grad():
        layer.form.forget_proj.weight.mul_(0.1)
        layer.form.forget_proj.bias.fill_(-1.0)
    L = 64
    x = rand(2, L, D_MODEL)
    with torch.no_grad():
        expected, _ = fox_reference(layer, x)
        c = torch.log(forget_gates(layer, x)).sum(-1)
        assert c.max() < -60  # strong forgetting, as intended
        out = layer.float()(x.float())[0]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_bf16_autocast_with_strong_forgetting_at_length_256_stays_within_bf16_rounding(backend):
    """|c_256| ≈ 330: rounded to bfloat16 (spacing 2 there) the bias would be off by ±1 per logit, e^1 in a weight.
    Under CPU bf16 autocast both paths add D in float32 (sdpa: the call in float32; eager: the logits promoted), so
    the output stays within bf16's rounding of q·k and v (~2⁻⁸) of the float64 formula."""
    layer = fox_layer(backend)
    with torch.no_grad():
        layer.form.forget_proj.weight.mul_(0.1)
        layer.form.forget_proj.bias.fill_(-1.0)
    L = 256
    x = rand(1, L, D_MODEL)
    with torch.no_grad():
        expected, _ = fox_reference(layer, x)
        assert torch.log(forget_gates(layer, x)).sum(-1).max() < -250  # strong forgetting, as intended
        layer.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x.float())[0]
    error = (out.double() - expected).norm() / expected.norm()
    assert error < 2e-2, error


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_on_the_cpu_forward_only_matches_the_reference_and_refuses_gradients_in_one_line():
    ref = fox_layer("eager")
    torch.manual_seed(0)
    flex = MultiHeadAttention(
        D_MODEL, H, score="forgetting", mask="causal", backend="flex", backend_params={"compile": False}
    ).eval()
    flex.load_state_dict(ref.state_dict())  # (float64 → float32)
    L = 7
    x = rand(2, L, D_MODEL)
    keys = torch.ones(2, 1, 1, L, dtype=torch.bool)
    keys[1, ..., 5:] = False
    with torch.no_grad():
        for mask in (None, keys):
            expected, _ = fox_reference(ref, x, mask)
            out = flex(x.float(), mask=mask)[0]
            torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    with pytest.raises(RuntimeError) as err:
        flex(x.float())
    assert "no_grad" in one_line(err)


@pytest.mark.parametrize("backend", ["biased_softmax", "normalized", "relative"])
def test_a_backend_that_cannot_compute_the_forget_bias_is_refused_at_build_in_one_line(backend):
    with pytest.raises(ValueError) as err:
        MultiHeadAttention(D_MODEL, H, score="forgetting", mask="causal", backend=backend)
    text = one_line(err)
    assert text.startswith(f"attention.backend={backend} ") and "forgetting" in text


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"differential": True}, LayerOptionError, "differential"),
        ({"foo": 1}, ValueError, "'foo'"),
        ({"mask": None}, ValueError, "causal"),
    ],
    ids=["differential", "unknown_param", "no_causal_mask"],
)
def test_what_forgetting_attention_does_not_take_is_refused_in_one_line(options, error, words):
    assert issubclass(error, ValueError)
    with pytest.raises(error) as err:
        MultiHeadAttention(D_MODEL, H, **{"score": "forgetting", "mask": "causal", **options})
    assert words in one_line(err)


def test_cross_attention_and_decoding_are_refused_in_one_line():
    layer = fox_layer()
    with pytest.raises(ValueError) as err:
        layer(rand(1, 3, D_MODEL), key_value=rand(1, 4, D_MODEL))
    assert "self-attention only" in one_line(err)
    cfg = AttentionConfig(score="forgetting", mask="causal")
    encoder = Encoder(30, D_MODEL, H, 1, pos_encoding="none", attention=cfg)
    with pytest.raises(ValueError) as err:
        decode(encoder, torch.zeros(1, 3, dtype=torch.long))
    assert "forgetting" in one_line(err)


# ============================================================================================== stick-breaking


def stick_reference(logits, allowed=None, attend_current=False):
    """Tan et al. 2025, eq. 3, as products: w_ij = β_ij Π_{k ∈ K(i), k > j} (1 − β_ik), β = σ(z), over the keys
    K(i) that row i sees (``allowed``, and not its own key i + Lk − Lq unless ``attend_current``); 0 elsewhere."""
    B, Hh, Lq, Lk = logits.shape
    allowed = torch.ones(Lq, Lk, dtype=torch.bool) if allowed is None else allowed
    allowed = allowed.expand(B, Hh, Lq, Lk)
    beta = sigmoid(logits)
    one, zero = torch.ones((), dtype=logits.dtype), torch.zeros((), dtype=logits.dtype)
    rows = []
    for i in range(Lq):
        own = i + Lk - Lq
        sees = [allowed[:, :, i, j] & (attend_current or j != own) for j in range(Lk)]  # (B, H) each
        row = []
        for j in range(Lk):
            w = beta[:, :, i, j]
            for k in range(j + 1, Lk):
                w = w * torch.where(sees[k], 1 - beta[:, :, i, k], one)
            row.append(torch.where(sees[j], w, zero))
        rows.append(torch.stack(row, -1))
    return torch.stack(rows, -2)


def stick_leftover(logits, allowed=None, attend_current=False):
    """Π_{k ∈ K(i)} (1 − β_ik) (B, H, Lq): the mass a row leaves."""
    B, Hh, Lq, Lk = logits.shape
    allowed = (torch.ones(Lq, Lk, dtype=torch.bool) if allowed is None else allowed).expand(B, Hh, Lq, Lk)
    beta = sigmoid(logits)
    rows = []
    for i in range(Lq):
        p = torch.ones(B, Hh, dtype=logits.dtype)
        for k in range(Lk):
            if attend_current or k != i + Lk - Lq:
                p = p * torch.where(allowed[:, :, i, k], 1 - beta[:, :, i, k], torch.ones((), dtype=logits.dtype))
        rows.append(p)
    return torch.stack(rows, -1)


def need_kernel():
    if not stick_kernel.available():
        pytest.skip(f"stick-breaking kernel not built: {stick_kernel.unavailable_reason()}")


def via_module(logits, allowed, attend_current):
    need_kernel()
    assert stick_kernel.supports(logits, allowed)  # (so the module runs the C kernel, not the PyTorch code)
    return build_normalizer("stickbreaking", attend_current=attend_current)(logits, allowed)


def via_kernel(logits, allowed, attend_current):
    need_kernel()
    return stick_kernel.stick_breaking(logits, allowed, attend_current)


IMPLEMENTATIONS = {"module_kernel": via_module, "c_kernel": via_kernel, "pytorch": stick_breaking_weights}


def stick_mask(kind, B, Hh, Lq, Lk):
    """None, key padding (B, 1, 1, Lk), per-row (B, H, Lq, Lk) with one row that sees nothing, causal (Lq, Lk)
    (queries aligned with the last keys)."""
    if kind == "none":
        return None
    if kind == "padding":
        keys = torch.ones(B, 1, 1, Lk, dtype=torch.bool)
        keys[0, ..., -2:] = False
        keys[-1, ..., 1] = False
        return keys
    if kind == "per_row":
        m = torch.rand(B, Hh, Lq, Lk, generator=torch.Generator().manual_seed(3)) < 0.7
        m[0, 1, 1] = False
        return m
    return torch.tensor([[j <= i + Lk - Lq for j in range(Lk)] for i in range(Lq)])


@pytest.mark.parametrize("shape", [(2, 2, 5, 5), (2, 2, 3, 7)], ids=["square", "fewer_queries"])
@pytest.mark.parametrize("mask", ["none", "padding", "per_row", "causal"])
@pytest.mark.parametrize("attend_current", [False, True], ids=["own_key_out", "own_key_in"])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_stick_breaking_weights_are_the_papers_products(impl, attend_current, mask, shape):
    logits = (2 * rand(*shape, seed=4)).requires_grad_(True)
    allowed = stick_mask(mask, *shape)
    w = IMPLEMENTATIONS[impl](logits, allowed, attend_current)
    expected = stick_reference(logits, allowed, attend_current)
    assert_values_and_gradients(w, expected, [logits], atol=1e-12)
    assert (w.sum(-1) <= 1 + 1e-12).all()
    leftover = stick_leftover(logits, allowed, attend_current)
    torch.testing.assert_close(1 - w.sum(-1), leftover, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_a_row_that_sees_no_key_is_zero_with_zero_gradient_and_the_others_are_untouched(impl):
    B, Hh, Lq, Lk = 2, 2, 4, 4
    logits = rand(B, Hh, Lq, Lk, seed=7).requires_grad_(True)
    allowed = torch.ones(B, Hh, Lq, Lk, dtype=torch.bool).tril()  # causal: row 0 sees only its own key...
    allowed[1, 0, 2] = False  # ...and this row sees nothing at all
    w = IMPLEMENTATIONS[impl](logits, allowed, False)
    assert (w[:, :, 0] == 0).all() and (w[1, 0, 2] == 0).all()
    (g,) = torch.autograd.grad((w * rand(*w.shape, seed=8)).sum(), logits)
    assert torch.isfinite(g).all() and (g[:, :, 0] == 0).all() and (g[1, 0, 2] == 0).all()
    assert (g[..., ~allowed.tril(-1)] == 0).all()  # hidden keys and the own key get no gradient
    torch.testing.assert_close(w, stick_reference(logits, allowed), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_extreme_logits_give_finite_weights_in_0_1_and_finite_gradients(impl, dtype):
    base = rand(2, 2, 5, 6, seed=9)
    logits64 = torch.where(base > 0.5, 60.0, torch.where(base < -0.5, -60.0, base))
    logits = logits64.to(dtype).requires_grad_(True)
    allowed = stick_mask("padding", 2, 2, 5, 6)
    w = IMPLEMENTATIONS[impl](logits, allowed, False)
    assert w.dtype == dtype and torch.isfinite(w).all() and (w >= 0).all() and (w <= 1).all()
    assert (w.sum(-1) <= 1 + 1e-6).all()
    cot = rand(*w.shape, seed=8)
    (g,) = torch.autograd.grad(w, logits, cot.to(dtype))
    assert torch.isfinite(g).all()
    ref_logits = logits64.clone().requires_grad_(True)
    expected = stick_reference(ref_logits, allowed)
    (g_ref,) = torch.autograd.grad(expected, ref_logits, cot)
    atol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(w.double(), expected, rtol=0, atol=atol)
    torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_saturated_logits_give_the_nearest_seen_key_everything_or_nothing(impl, dtype):
    """z = +1e4 everywhere: β = 1, so the nearest key a row sees (the last one in K(i)) takes the whole stick and
    the others 0; z = −1e4: β = 0, every weight 0. Exactly, with finite gradients (past where the float64 reference
    itself overflows)."""
    B, Hh, Lq, Lk = 2, 2, 4, 6
    allowed = stick_mask("padding", B, Hh, Lq, Lk)
    for sign in (1.0, -1.0):
        logits = torch.full((B, Hh, Lq, Lk), sign * 1e4, dtype=dtype, requires_grad=True)
        w = IMPLEMENTATIONS[impl](logits, allowed, False)
        expected = torch.zeros(B, Hh, Lq, Lk, dtype=dtype)
        for b in range(B):
            for i in range(Lq):
                seen = [j for j in range(Lk) if allowed[b, 0, 0, j] and j != i + Lk - Lq]
                if seen and sign > 0:
                    expected[b, :, i, max(seen)] = 1.0
        torch.testing.assert_close(w.detach(), expected, rtol=0, atol=0)
        (g,) = torch.autograd.grad(w, logits, rand(*w.shape, seed=13).to(dtype))
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_float32_stays_within_1e_6_of_the_float64_reference(impl):
    logits64 = 3 * rand(2, 2, 6, 9, seed=11)
    allowed = stick_mask("causal", 2, 2, 6, 9)
    logits = logits64.float().requires_grad_(True)
    w = IMPLEMENTATIONS[impl](logits, allowed, True)
    cot = rand(*w.shape, seed=12)
    (g,) = torch.autograd.grad(w, logits, cot.float())
    ref_logits = logits64.clone().requires_grad_(True)
    expected = stick_reference(ref_logits, allowed, True)
    (g_ref,) = torch.autograd.grad(expected, ref_logits, cot)
    torch.testing.assert_close(w.double(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(g.double(), g_ref, rtol=0, atol=2e-6)


# ---------------------------------------------------------------------------------------------- the layer


def stick_layer(backend="auto", attend_current=False, seed=0):
    torch.manual_seed(seed)
    layer = MultiHeadAttention(
        D_MODEL,
        H,
        normalizer="stickbreaking",
        normalizer_params={"attend_current": attend_current},
        mask="causal",
        backend=backend,
    )
    return randomize_(layer.double().eval(), seed, scale=0.5)


def stick_layer_reference(layer, x, visible, attend_current):
    """o_i = Σ_j w_ij v_j per head with the loop weights of q_i·k_j/√d_k (the layer's projections), then out_proj;
    → (out, weights, logits)."""
    B, L, _ = x.shape
    q, k, v = (split_heads(linear(p, x), H) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    logits = q @ k.transpose(-1, -2) / math.sqrt(D_K)
    w = stick_reference(logits, visible, attend_current)
    out = linear(layer.out_proj, (w @ v).transpose(1, 2).reshape(B, L, H * D_K))
    return out, w, logits


def stick_parameters(layer):
    return [layer.q_proj.weight, layer.q_proj.bias, layer.k_proj.weight, layer.v_proj.weight, layer.out_proj.weight]


STICK_BACKENDS = ["eager", "normalized", "auto"]


@pytest.mark.parametrize("backend", STICK_BACKENDS)
@pytest.mark.parametrize("attend_current", [False, True], ids=["own_key_out", "own_key_in"])
@pytest.mark.parametrize("given", ["causal_mask", "causal_tensor", "causal_and_padding"])
def test_the_stickbreaking_layer_is_the_weighted_sum_of_values(given, attend_current, backend):
    if backend != "eager":
        need_kernel()
    layer = stick_layer(backend, attend_current)
    L = 6
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    keys = torch.ones(2, 1, 1, L, dtype=torch.bool)
    keys[0, ..., 4:] = False
    keys[1, ..., 2] = False
    mask = {"causal_mask": build_mask("causal"), "causal_tensor": causal, "causal_and_padding": causal & keys}[given]
    visible = causal & keys if given == "causal_and_padding" else causal
    x = rand(2, L, D_MODEL).requires_grad_(True)
    out, _ = layer(x, mask=mask)
    expected, _, _ = stick_layer_reference(layer, x, visible, attend_current)
    assert_values_and_gradients(out, expected, [x, *stick_parameters(layer)])


def test_stickbreaking_picks_the_fused_row_kernel_on_the_cpu_and_refuses_sdpa_in_one_line():
    need_kernel()
    from attnlab.backends import Conditions, choose_backend
    from attnlab.masks import prepare_mask

    layer = stick_layer()
    x = rand(1, 4, D_MODEL)
    chosen = choose_backend(layer.spec, Conditions.of(x, False, prepare_mask(build_mask("causal"), 4, 4)))
    assert chosen.name == "normalized"
    with pytest.raises(ValueError) as err:
        MultiHeadAttention(D_MODEL, H, normalizer="stickbreaking", mask="causal", backend="sdpa")
    assert "stickbreaking" in one_line(err)
    with pytest.raises(ValueError) as err:
        MultiHeadAttention(D_MODEL, H, normalizer="stickbreaking", normalizer_params={"foo": 1})
    assert "'foo'" in one_line(err)


@pytest.mark.parametrize("backend", STICK_BACKENDS)
def test_the_first_token_sees_no_key_so_its_output_is_the_out_proj_bias(backend):
    layer = stick_layer(backend)
    x = rand(2, 5, D_MODEL).requires_grad_(True)
    out, _ = layer(x, mask=build_mask("causal"))
    torch.testing.assert_close(out[:, 0].detach(), layer.out_proj.bias.detach().expand(2, D_MODEL), rtol=0, atol=0)
    (gx,) = torch.autograd.grad(out[:, 0].sum(), x)
    assert (gx == 0).all()
    own = stick_layer(backend, attend_current=True)  # its own key in: token 0 reads itself
    assert not torch.allclose(own(x, mask=build_mask("causal"))[0][:, 0], own.out_proj.bias.expand(2, D_MODEL))


@pytest.mark.parametrize("attend_current", [False, True], ids=["own_key_out", "own_key_in"])
def test_the_weights_rows_sum_to_at_most_one_and_leave_the_products_of_one_minus_beta(attend_current):
    layer = stick_layer("normalized", attend_current)
    L = 6
    x = rand(2, L, D_MODEL)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    with torch.no_grad():
        _, w = layer(x, mask=build_mask("causal"), need_weights=True)
        _, expected, logits = stick_layer_reference(layer, x, causal, attend_current)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    assert (w.sum(-1) <= 1 + 1e-12).all() and (w[..., ~causal] == 0).all()
    torch.testing.assert_close(1 - w.sum(-1), stick_leftover(logits, causal, attend_current), rtol=0, atol=1e-12)
    if not attend_current:
        assert (w.diagonal(dim1=-2, dim2=-1) == 0).all()


@pytest.mark.parametrize("backend", STICK_BACKENDS)
def test_stickbreaking_a_later_token_never_changes_an_earlier_output(backend):
    layer = stick_layer(backend)
    L = 6
    x = rand(1, L, D_MODEL)
    with torch.no_grad():
        base = layer(x, mask=build_mask("causal"))[0]
        for t in range(1, L):
            y = x.clone()
            y[:, t] += rand(D_MODEL, seed=20 + t)
            out = layer(y, mask=build_mask("causal"))[0]
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
            assert (out[:, t:] - base[:, t:]).abs().amax(-1).min() > 1e-8


@pytest.mark.parametrize("backend", STICK_BACKENDS)
def test_stickbreaking_padded_tokens_do_not_reach_the_real_rows(backend):
    layer = stick_layer(backend, attend_current=True)
    L = 6
    keys = torch.ones(2, 1, 1, L, dtype=torch.bool)
    keys[0, ..., 4:] = False
    keys[1, ..., 2] = False  # padding in the middle: a hidden key is left out of every product
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    x = rand(2, L, D_MODEL)
    y = x.clone()
    y[0, 4:] = rand(2, D_MODEL, seed=5)
    y[1, 2] = rand(D_MODEL, seed=6)
    with torch.no_grad():
        a, b = layer(x, mask=causal & keys)[0], layer(y, mask=causal & keys)[0]
        expected = stick_layer_reference(layer, x, causal & keys, True)[0]
    real = keys[:, 0, 0]
    torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(a, expected, rtol=1e-10, atol=1e-10)


def test_a_float32_layer_stays_close_to_the_float64_reference():
    need_kernel()
    layer = stick_layer()
    L = 10
    x = rand(2, L, D_MODEL)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    with torch.no_grad():
        expected = stick_layer_reference(layer, x, causal, False)[0]
        out = layer.float()(x.float(), mask=build_mask("causal"))[0]
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attend_current", [False, True], ids=["own_key_out", "own_key_in"])
def test_an_encoder_decodes_stickbreaking_token_by_token_as_it_runs_forward(attend_current):
    cfg = AttentionConfig(
        normalizer="stickbreaking", normalizer_params={"attend_current": attend_current}, mask="causal"
    )
    torch.manual_seed(0)
    encoder = Encoder(30, D_MODEL, H, 2, pos_encoding="none", attention=cfg).double().eval()
    randomize_(encoder, 0, scale=0.5)
    tokens = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(decode(encoder, tokens), encoder(tokens), rtol=1e-10, atol=1e-10)


# ============================================================================================== the command line


@pytest.mark.slow
@pytest.mark.usefixtures("restore_process_state")
def test_the_command_line_trains_forgetting_forgetting_pro_and_stickbreaking_for_two_steps(tmp_path):
    """In process (:func:`helpers.run_cli`: ``train.py``'s code path without a fresh interpreter per variant)."""
    import json

    expected = {
        "forgetting": {"score": "forgetting"},
        "forgetting_pro": {"score": "forgetting", "qk_norm": "rmsnorm", "short_conv": 4, "output_gate": "elementwise"},
        "stickbreaking": {"score": "scaled_dot", "normalizer": "stickbreaking"},
    }
    for variant, settings in expected.items():
        folder = tmp_path / variant
        run_cli(f"variant={variant}", "debug=fast", "max_steps=2", "eval_every=2", "logger=none",
                f"hydra.run.dir={folder}", returncode=0)  # fmt: skip
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["steps"] == 2, summary
        assert {k: summary["settings"][k] for k in settings} == settings
        assert all(math.isfinite(v) for v in summary["metrics"].values() if isinstance(v, float))
