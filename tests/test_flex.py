"""The ``flex`` backend (FlexAttention): its translation of a layer into a score_mod and a BlockMask equals the eager
path, on every machine.

On the CPU FlexAttention runs forward only (torch 2.13), so these tests run it under ``torch.no_grad()`` in float32
and compare with the eager backend of the same layer (``MultiHeadAttention.attend``, tested elsewhere) at
atol 1e-5, rtol 1e-4 (measured: at most ~2e-7 apart, compiled or not). Every combination runs through
FlexAttention's unfused reference (``backend_params.compile=false``: dynamo traces the same score_mod and mask_mod,
fullgraph, without Inductor's kernel), which costs ~0.5 s a combination; one combination that exercises every kind
of term at once (Shaw's table, soft-cap, GQA, a composed user mask with a row that sees no key) is compiled by
Inductor into the fused CPU kernel (a compile is 10–45 s on a 2-core CPU, so it is one, shared by the checks that
need it). On a CUDA device, forward + backward are compared with eager, values and gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

import attnlab
import attnlab.backends.flex as flex
from attnlab.config import AttentionConfig
from attnlab.masks import FunctionMask, build_mask
from attnlab.position_bias import PositionBias, ScoreMod

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch._dynamo"),
]

ATOL, RTOL = 1e-5, 1e-4
B, L, D_MODEL, H, D_K = 2, 12, 32, 4, 8  # one shape everywhere: compiles are shared
# key padding (B, 1, 1, L): sequence 1 pads its first three and last two keys
PAD = torch.tensor([[True] * L, [False] * 3 + [True] * (L - 5) + [False] * 2])[:, None, None, :]


def _band_without_row_5(q_idx: Tensor, kv_idx: Tensor, width: int) -> Tensor:
    """A user mask: |i − j| < width, and query 5 sees no key."""
    return ((q_idx - kv_idx).abs() < width) & (q_idx != 5)


USER = FunctionMask("band_without_row_5", _band_without_row_5, width=3)
CAUSAL = build_mask("causal")
WINDOW = build_mask({"name": "sliding_window", "window": 3})


class OffsetBias(PositionBias):
    """A user position bias with the score_mod hook: w_h · (j − i)."""

    def __init__(self, d_k: int, num_heads: int, declines: bool = False) -> None:
        super().__init__(d_k, num_heads)
        self.weight = nn.Parameter(torch.randn(num_heads) * 0.3)
        self.declines = declines

    def bias(self, q: Tensor, num_keys: int) -> Tensor:
        offsets = self.relative_positions(q.shape[-2], num_keys, q.device).to(q.dtype)
        return self.weight.to(q.dtype)[:, None, None] * offsets  # (H, Lq, Lk)

    def score_mod(self, q: Tensor, num_keys: int) -> ScoreMod | None:
        if self.declines:  # no closed form here: the backend reads bias() by index
            return None
        weight = self.weight.to(q.dtype)

        def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + weight[h] * (kv_idx - q_idx)

        return mod


class NoHookBias(OffsetBias):
    score_mod = PositionBias.score_mod  # no score_mod of its own


def key_padded_causal():
    """Causal AND key padding, its parts kept (as the encoder prepares it): row 0..2 of sequence 1 see no key."""
    return CAUSAL.prepare(L, L).with_key_padding(PAD)


def per_head_mask() -> Tensor:
    """A random per-(batch, head) bool mask (B, H, L, L), row 4 of (0, 1) seeing no key."""
    allowed = torch.rand(B, H, L, L, generator=torch.Generator().manual_seed(3)) > 0.4
    allowed[0, 1, 4] = False
    return allowed


# (name, layer options, mask); every feature once and a few combinations
COMBINATIONS = [
    ("scaled_dot", {}, None),
    ("dot_causal", {"score": "dot"}, CAUSAL),
    ("general_window", {"score": "general"}, WINDOW),
    ("cosine_rope_qknorm_padding", {"score": "cosine", "rope": True, "qk_norm": "rmsnorm"}, PAD),
    ("alibi_causal_window", {"position_bias": "alibi"}, CAUSAL & WINDOW),
    ("alibi_softcap_padding", {"position_bias": "alibi", "softcap": 2.0}, PAD),
    ("t5_causal", {"position_bias": "t5", "position_bias_params": {"num_buckets": 8, "max_distance": 16}}, CAUSAL),
    ("t5_window_or_user", {"position_bias": "t5"}, WINDOW | USER),
    ("shaw_gqa", {"position_bias": "shaw", "position_bias_params": {"clip": 3}, "num_kv_heads": 2}, None),
    ("shaw_softcap_user", {"position_bias": "shaw", "position_bias_params": {"clip": 2}, "softcap": 3.0}, USER),
    ("softcap_causal_padding", {"softcap": 1.5}, "key_padded_causal"),
    ("mqa_per_head_mask", {"num_kv_heads": 1, "softcap": 4.0}, "per_head"),
    ("differential_t5_causal", {"position_bias": "t5", "differential": True}, CAUSAL),
    ("user_bias_with_score_mod", {"position_bias": "offset"}, CAUSAL),
    ("user_bias_read_by_index", {"position_bias": "offset_declines", "softcap": 2.0}, WINDOW),
    ("forgetting_causal", {"score": "forgetting", "mask": "causal"}, CAUSAL),  # D_ij = c_i − c_j (issue 45)
    (
        "forgetting_gqa_softcap_padding",
        {"score": "forgetting", "mask": "causal", "num_kv_heads": 2, "softcap": 2.0},
        "key_padded_causal",
    ),
]


def make_layer(options: dict, seed: int = 0, compile_: bool = False, d_k: int = D_K) -> attnlab.MultiHeadAttention:
    torch.manual_seed(seed)
    options = dict(options)
    if options.get("position_bias") in ("offset", "offset_declines"):
        heads = H * (2 if options.get("differential") else 1)
        options["position_bias"] = OffsetBias(d_k, heads, declines=options["position_bias"] == "offset_declines")
    if options.pop("rope", False):
        options["rope"] = {}
    layer = attnlab.MultiHeadAttention(D_MODEL, H, d_k, backend="flex", backend_params={"compile": compile_}, **options)
    return layer.eval()


def make_mask(mask):
    if mask == "key_padded_causal":
        return key_padded_causal()
    if mask == "per_head":
        return per_head_mask()
    return mask


def inputs(seed: int = 1) -> Tensor:
    return torch.randn(B, L, D_MODEL, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def flex_calls(monkeypatch):
    """The FlexAttention calls the backend makes (so a test knows flex ran, not a fallback)."""
    calls = []
    real = flex.flex_attention

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(flex, "flex_attention", counting)
    return calls


@pytest.mark.parametrize(("options", "mask"), [c[1:] for c in COMBINATIONS], ids=[c[0] for c in COMBINATIONS])
def test_flex_equals_eager(options, mask, flex_calls):
    """Unfused FlexAttention (dynamo-traced score_mod and mask_mod, no Inductor kernel), float32, no_grad."""
    layer, x, m = make_layer(options), inputs(), make_mask(mask)
    with torch.no_grad():
        got, _ = layer(x, mask=m)
        ref = layer.attend(x, mask=m).out
    assert len(flex_calls) == 1
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_cross_attention_with_more_keys_than_queries(flex_calls):
    torch.manual_seed(0)
    layer = make_layer({"position_bias": "shaw", "position_bias_params": {"clip": 2}, "softcap": 2.0})
    x, kv = inputs(1), torch.randn(B, L + 5, D_MODEL)
    with torch.no_grad():
        got, _ = layer(x, kv, mask=WINDOW)
        ref = layer.attend(x, kv, mask=WINDOW).out
    assert len(flex_calls) == 1
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_a_row_that_sees_no_key_gives_zero():
    """The output before out_proj is 0 on such a row: the layer's output there is out_proj's bias alone."""
    layer, x = make_layer({"position_bias": "t5"}), inputs()
    with torch.no_grad():
        got, _ = layer(x, mask=USER)
    torch.testing.assert_close(got[:, 5], layer.out_proj.bias.expand(B, -1), atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_compiled_flex_equals_eager_and_compiles_once(monkeypatch):
    """The Inductor-compiled kernel, for one combination of every kind of term (Shaw's table, soft-cap, GQA, a
    composed user mask whose row 5 sees no key): equal to eager; a second layer of the same configuration (other
    weights, same shapes) reuses the compiled kernel and the cached BlockMask."""
    from torch._dynamo.utils import counters

    builds = []
    real = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **k: builds.append(a[1:]) or real(*a, **k))
    options = {"position_bias": "shaw", "position_bias_params": {"clip": 3}, "softcap": 2.0, "num_kv_heads": 2}
    mask = CAUSAL & USER
    x = inputs()
    graphs = counters["stats"]["unique_graphs"]
    for seed in (0, 1):
        layer = make_layer(options, seed=seed, compile_=True)
        with torch.no_grad():
            got, _ = layer(x, mask=mask)
            ref = layer.attend(x, mask=mask).out
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got[:, 5], layer.out_proj.bias.expand(B, -1), atol=ATOL, rtol=RTOL)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # one compile for both layers
    assert len(builds) == 1  # one BlockMask for the mask at this shape


def test_the_block_mask_is_cached_per_mask_and_shape_and_made_per_call_for_padding(monkeypatch):
    builds = []
    real = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **k: builds.append(a[1:]) or real(*a, **k))
    layer = make_layer({})
    mask = CAUSAL & WINDOW  # position-only: prepared once per (Lq, Lk, device), its BlockMask with it
    with torch.no_grad():
        for _ in range(2):
            layer(inputs(), mask=mask)
        assert builds == [(None, None, L, L)]  # broadcast over batch and heads
        layer(torch.randn(B, L - 4, D_MODEL), mask=mask)  # another shape: another BlockMask
        assert builds[1:] == [(None, None, L - 4, L - 4)]
        for _ in range(2):
            layer(inputs(), mask=PAD)  # per batch: one per call
    assert builds[2:] == [(B, None, L, L)] * 2


def test_auto_never_chooses_flex_on_the_cpu_and_on_cuda_takes_what_sdpa_would_materialise(flex_calls):
    configs = {
        "softcap": AttentionConfig(softcap=5.0),
        "t5": AttentionConfig(position_bias="t5"),
        "shaw": AttentionConfig(position_bias="shaw"),
        "alibi_window": AttentionConfig(score="alibi", mask={"name": "sliding_window", "window": 3}),
        "window": AttentionConfig(mask={"name": "sliding_window", "window": 3}),
        "scaled_dot": AttentionConfig(),
        "causal": AttentionConfig(mask="causal"),
        "padding": AttentionConfig(mask="padding"),
        "forgetting": AttentionConfig(score="forgetting", mask="causal"),  # its bias: a score_mod on CUDA
    }
    on_sdpa = ("scaled_dot", "causal", "padding")  # SDPA's fused kernels compute these without a (L, L) tensor
    for name, config in configs.items():
        layer = attnlab.MultiHeadAttention(64, 4, 16, config=config)
        for training in (True, False):
            for grad in (True, False):
                for dtype in (torch.float32, torch.bfloat16):
                    assert layer.backend_for("cpu", dtype, training=training, grad=grad) != "flex", name
        expected = "sdpa" if name in on_sdpa else "flex"  # a bias, a soft-cap or a window: flex on CUDA
        assert layer.backend_for("cuda", torch.bfloat16) == expected, name
        assert layer.backend_for("cuda", torch.float32, training=False, grad=False) == expected, name
        layer.eval()
        with torch.no_grad():
            layer(torch.randn(1, 5, 64))
    assert flex_calls == []
    small = attnlab.MultiHeadAttention(32, 4, 8, softcap=5.0)
    assert small.backend_for("cuda") != "flex"  # head size 8 < 16: Triton's tl.dot cannot


def test_a_forced_flex_call_on_the_cpu_with_gradients_is_refused_in_one_line():
    layer = attnlab.MultiHeadAttention(D_MODEL, H, D_K, softcap=5.0, backend="flex")
    with pytest.raises(RuntimeError) as info:
        layer(inputs())
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("attention.backend=flex cannot run here: CPU FlexAttention is forward-only")
    assert "torch.no_grad()" in msg and "CUDA" in msg
    with pytest.raises(RuntimeError, match=r"^attention.backend=flex cannot run here: FlexAttention computes float32"):
        with torch.no_grad():
            layer.double()(inputs().double())


def test_under_the_flop_counter_flex_steps_aside_and_the_products_are_counted():
    """FlexAttention cannot run under a dispatch mode (torch 2.11 on an H100, 2026-11-28: the compiled call traced
    its dense path and stopped the benchmark): a forced flex says so in one line; the FLOPs of the same layer come
    from the backend auto takes instead, the products q·kᵀ and P·v of the layer (2·B·H·L·L·(d_k + d_v))."""
    from torch.utils.flop_counter import FlopCounterMode

    from attnlab.compute import count_flops

    layer = make_layer({"softcap": 5.0})
    with torch.no_grad(), FlopCounterMode(display=False):
        with pytest.raises(RuntimeError, match=r"^attention.backend=flex cannot run here: .*dispatch mode[^\n]*$"):
            layer(inputs())
    auto = attnlab.MultiHeadAttention(D_MODEL, H, D_K, softcap=5.0).eval()
    with torch.no_grad():
        total = count_flops(lambda: auto(inputs()))
    projections = 2 * B * L * D_MODEL * (3 * H * D_K) + 2 * B * L * (H * D_K) * D_MODEL
    assert total - projections == 2 * B * H * L * L * (D_K + D_K)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"normalizer": "sparsemax"}, "it computes the softmax only, not normalizer=sparsemax"),
        ({"normalizer": "sink"}, r"it has no sink logit \(normalizer=sink\); softmax only"),
        ({"score": "additive"}, "it computes dot-product scores only, not additive"),
        (
            {"position_bias": "shaw", "position_bias_params": {"value_term": True}},
            r"it has no value-side term \(Shaw's value_term\)",
        ),
        ({"position_bias": "no_hook"}, r"position_bias=NoHookBias offers no FlexAttention score_mod"),
    ],
)
def test_a_configuration_flex_cannot_express_is_refused_in_one_line(options, message):
    if options.get("position_bias") == "no_hook":
        options = {"position_bias": NoHookBias(D_K, H)}
    with pytest.raises(ValueError, match=r"^attention\.backend=flex cannot compute this layer: " + message) as info:
        attnlab.MultiHeadAttention(D_MODEL, H, D_K, backend="flex", **options)
    assert "\n" not in str(info.value)


def test_the_compile_parameter_is_checked():
    with pytest.raises(ValueError, match=r"^attention.backend_params.compile must be true .* got 'yes'$"):
        attnlab.MultiHeadAttention(D_MODEL, H, D_K, backend="flex", backend_params={"compile": "yes"})


def test_the_position_biases_say_their_score_mod_exactly():
    """Each built-in score_mod adds exactly bias(q, Lk), read at every (b, h, i, j), Lk ≠ Lq."""
    q = torch.randn(B, H, 5, D_K)
    Lk = 7
    b, h, i, j = (t.flatten() for t in torch.meshgrid(*map(torch.arange, (B, H, 5, Lk)), indexing="ij"))
    for name, params in (("shaw", {"clip": 2}), ("t5", {"num_buckets": 8, "max_distance": 16}), ("alibi", {})):
        bias = attnlab.build_position_bias(name, d_k=D_K, num_heads=H, **params)
        assert bias.has_score_mod
        mod = bias.score_mod(q, Lk)
        with torch.no_grad():
            got = torch.stack([mod(torch.zeros(()), *idx) for idx in zip(b, h, i, j, strict=True)])
            want = bias(q, Lk).expand(B, H, 5, Lk).flatten()
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("options", "mask"),
    [
        ({"softcap": 3.0, "position_bias": "t5"}, CAUSAL),
        ({"position_bias": "shaw", "position_bias_params": {"clip": 4}, "num_kv_heads": 2}, CAUSAL & WINDOW),
        ({"position_bias": "alibi", "softcap": 2.0}, PAD),
        ({"position_bias": "t5", "differential": True, "softcap": 5.0}, USER),
        ({"softcap": 2.0}, "key_padded_causal"),
        ({"score": "forgetting", "mask": "causal", "softcap": 3.0}, CAUSAL),
    ],
    ids=[
        "t5_softcap_causal",
        "shaw_gqa_causal_window",
        "alibi_softcap_padding",
        "diff_t5_user",
        "causal_padding",
        "forgetting_softcap_causal",
    ],
)
def test_flex_forward_and_backward_equal_eager_on_cuda(options, mask):
    """Compiled FlexAttention on CUDA, float32 (TF32 off), forward + backward: the output and the gradients of the
    input and of every parameter equal the eager path's."""
    device = torch.device("cuda")
    layer = make_layer(options, compile_=True, d_k=16).to(device).train()
    m = make_mask(mask)
    m = m.to(device) if isinstance(m, Tensor) else m
    if mask == "key_padded_causal":
        m = CAUSAL.prepare(L, L, device).with_key_padding(PAD.to(device))
    x = inputs().to(device).requires_grad_()
    c = torch.randn(B, L, D_MODEL, device=device)
    params = [x, *layer.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _ = layer(x, mask=m)
    assert layer.backend_for(device) == "flex"
    got_grads = torch.autograd.grad((got * c).sum(), params, allow_unused=True)
    ref = layer.attend(x, mask=m).out
    ref_grads = torch.autograd.grad((ref * c).sum(), params, allow_unused=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-3)
    for g, r in zip(got_grads, ref_grads, strict=True):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-3)
