"""Backends: every registered backend computes what the eager path computes, wherever it says it can (for the
configuration and the mask's form); the choice is one ordered lookup, reported; a forced backend is refused in one
line where it cannot compute the layer, and a backend given a mask it cannot compute refuses it in one line."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.backends import (
    _BACKENDS,
    _INSTANCES,
    ORDER,
    Backend,
    Conditions,
    build_backend,
    list_backends,
    register_backend,
)
from attnlab.config import AttentionConfig
from attnlab.masks import build_mask, prepare_mask

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {
    "scaled_dot": AttentionConfig(),
    "t5": AttentionConfig(score="t5_bias"),
    "shaw_gqa": AttentionConfig(score="relative_position", score_params={"clip": 2}, num_kv_heads=2),
    "alibi_sink": AttentionConfig(score="alibi", normalizer="sink"),
    "t5_softmax1": AttentionConfig(position_bias="t5", normalizer="softmax1"),
    "diff_shaw": AttentionConfig(position_bias="shaw", differential=True),
    "cosine_rope": AttentionConfig(score="cosine", rope={}, qk_norm="rmsnorm"),
    "additive": AttentionConfig(score="additive"),
    "softcap": AttentionConfig(softcap=5.0),
    # linear attention (the O(L) backends compute these under the mask forms they support)
    "linear_rowsum": AttentionConfig(score="linear", normalizer="rowsum"),
    "linear_taylor_none": AttentionConfig(score="linear", score_params={"feature_map": "taylor"}, normalizer="none"),
    "linear_conv_gqa": AttentionConfig(score="linear", normalizer="rowsum", short_conv=3, num_kv_heads=2),
}
LINEAR = ["linear_rowsum", "linear_taylor_none", "linear_conv_gqa"]
L = 6
# key padding (B, 1, 1, L): sequence 1 pads its first and last two tokens (under causal, its row 0 sees no key)
PAD = torch.tensor([[True] * L, [False, True, True, True, False, False]])[:, None, None, :]
MASKS = {
    "none": None,
    "causal": "causal",
    "window": {"name": "sliding_window", "window": 2},
    "padding": PAD,
    "causal+padding": "causal+padding",
}
FORMS = {
    "none": "none",
    "causal": "causal",
    "window": "other",
    "padding": "padding",
    "causal+padding": "causal+padding",
}


def make_mask(kind):
    """The mask ``kind`` as attention takes it: None, a Mask, a bool tensor or (causal AND key padding, its parts
    recorded, as the encoder builds it) a PreparedMask."""
    spec = MASKS[kind]
    if spec is None or isinstance(spec, torch.Tensor):
        return spec
    if spec == "causal+padding":
        return build_mask("causal").prepare(L, L).with_key_padding(PAD)
    return build_mask(spec)


def form_of(kind):
    pm = prepare_mask(make_mask(kind), L, L)
    return "none" if pm is None else pm.form


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_automatic_order_puts_the_most_specific_first_and_eager_last():
    assert ORDER == ["tiled", "relative", "biased_softmax", "flex", "sdpa", "chunked", "global", "normalized", "eager"]
    assert list_backends() == [*ORDER, "recurrent"]  # then those that run only when forced


def training_step(mask: str = "none") -> Conditions:
    """A CPU float64 training step with a mask of this form."""
    return Conditions("cpu", torch.float64, need_weights=False, training=True, grad=True, mask=mask)


def _supported() -> list[tuple[str, str, str]]:
    """(backend, config, mask) for every triple where the backend says it computes the config under a mask of that
    form (a CPU float64 training step): each is checked below, the others are refused (see the refusal tests)."""
    triples = []
    for name, config in CONFIGS.items():
        mha = attnlab.MultiHeadAttention(16, 4, 4, config=config)
        for mask in MASKS:
            when = training_step(FORMS[mask])
            triples += [(b, name, mask) for b in list_backends() if build_backend(b).supports(mha, when) is None]
    return triples


def _refused_masks() -> list[tuple[str, str, str]]:
    """(backend, config, mask) where the backend computes the config but not a mask of that form."""
    triples = []
    for name, config in CONFIGS.items():
        mha = attnlab.MultiHeadAttention(16, 4, 4, config=config)
        for mask in MASKS:
            for b in list_backends():
                backend = build_backend(b)
                if backend.config_reason(mha) is None and backend.mask_reason(FORMS[mask]) is not None:
                    triples.append((b, name, mask))
    return triples


def test_the_test_masks_have_the_forms_they_are_paired_by():
    assert {kind: form_of(kind) for kind in MASKS} == FORMS


def test_every_backend_and_every_configuration_are_checked():
    """The triples below cover every backend and every configuration (eager computes all of them, under every
    mask); each O(L) backend computes every linear configuration under each mask form it supports."""
    triples = _supported()
    # flex cannot run a CPU training step (CPU FlexAttention is forward-only): tests/test_flex.py checks it
    assert {b for b, _, _ in triples} == set(list_backends()) - {"flex"}
    assert {(n, m) for b, n, m in triples if b == "eager"} == {(n, m) for n in CONFIGS for m in MASKS}
    linear = {(b, n, m) for b, n, m in triples if b in ("chunked", "recurrent", "global")}
    expected_masks = {"chunked": ["causal", "causal+padding"], "recurrent": ["causal", "causal+padding"]}
    expected_masks["global"] = ["none", "padding"]
    assert linear == {(b, n, m) for b, masks in expected_masks.items() for n in LINEAR for m in masks}
    assert {b for b, _, _ in _refused_masks()} == {"chunked", "recurrent", "global"}


@pytest.mark.parametrize(("backend", "name", "mask"), _supported())
def test_every_backend_equals_eager_where_it_supports_the_layer(backend, name, mask):
    """Outputs and the gradients of the input and every parameter, float64, fresh random inputs."""
    torch.manual_seed(7)
    mha = attnlab.MultiHeadAttention(16, 4, 4, config=CONFIGS[name]).double()
    x = randn(2, L, 16, seed=1).requires_grad_()
    m = make_mask(mask)
    c = randn(2, L, 16, seed=2)
    params = [x, *mha.parameters()]
    got, _ = build_backend(backend).attend(mha, x, None, m)
    got_grads = torch.autograd.grad((got * c).sum(), params, allow_unused=True)
    ref = mha.attend(x, mask=m).out
    ref_grads = torch.autograd.grad((ref * c).sum(), params, allow_unused=True)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for g, r in zip(got_grads, ref_grads, strict=True):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("backend", "name", "mask"), _refused_masks())
def test_a_backend_given_a_mask_it_cannot_compute_refuses_it_in_one_line(backend, name, mask):
    mha = attnlab.MultiHeadAttention(16, 4, 4, config=CONFIGS[name]).double()
    with pytest.raises(ValueError) as info:
        build_backend(backend).attend(mha, randn(2, L, 16, seed=1), None, make_mask(mask))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"attention backend {backend}: it computes mask=")
    assert msg.endswith(f"not {FORMS[mask]}; use backend=eager (or auto) for this mask")


@pytest.mark.parametrize(
    ("name", "training_step", "inference"),
    [
        ("scaled_dot", "sdpa", "sdpa"),
        ("t5", "tiled", "tiled"),
        ("alibi_sink", "tiled", "tiled"),
        ("t5_softmax1", "tiled", "tiled"),
        ("diff_shaw", "tiled", "tiled"),
        ("additive", "eager", "eager"),
        ("softcap", "tiled", "tiled"),  # (flex computes it too, on CUDA only)
        ("linear_rowsum", "global", "global"),  # no mask: every key visible
        ("linear_taylor_none", "global", "global"),
    ],
)
def test_the_choice_follows_the_configuration_and_the_call(name, training_step, inference):
    mha = attnlab.MultiHeadAttention(16, 4, 4, config=CONFIGS[name])
    assert mha.backend_for("cpu", torch.float32) == training_step
    assert mha.backend_for("cpu", torch.float32, training=False, grad=False) == inference
    assert mha.backend_for("cpu", need_weights=True) == "eager"  # the diagnostics read the weights


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (AttentionConfig(score="additive", backend="sdpa"), r"sdpa cannot .*dot-product scores only, not additive$"),
        (AttentionConfig(softcap=5.0, backend="sdpa"), r"sdpa cannot compute this layer: it has no soft-capping$"),
        (AttentionConfig(backend="relative"), r"relative cannot .*exactly one relative-position table"),
        (AttentionConfig(score="alibi", backend="biased_softmax"), r"biased_softmax cannot .*learned position bias"),
        (
            AttentionConfig(score="linear", normalizer="rowsum", mask="causal", backend="global"),
            r"global cannot compute this layer: it computes mask=none or padding only, not causal$",
        ),
        (
            AttentionConfig(score="linear", mask="causal", backend="chunked"),
            r"chunked cannot compute this layer: it normalizes by the row sum or not at all .*not softmax$",
        ),
    ],
)
def test_a_forced_backend_that_cannot_compute_the_layer_is_refused_in_one_line(config, message):
    with pytest.raises(ValueError, match=r"^attention\.backend=" + message):
        attnlab.MultiHeadAttention(16, 4, 4, config=config)


def test_a_forced_backend_runs_and_one_that_cannot_run_under_a_call_says_why():
    torch.manual_seed(0)
    forced = attnlab.MultiHeadAttention(16, 4, 4, config=AttentionConfig(score="t5_bias", backend="eager")).double()
    assert forced.backend_for("cpu", torch.float64) == "eager"
    relative = attnlab.MultiHeadAttention(16, 4, 4, config=AttentionConfig(score="t5_bias", backend="relative"))
    with pytest.raises(RuntimeError, match=r"^attention.backend=relative cannot run here: it computes float32"):
        relative(torch.randn(1, 3, 16).bfloat16())
    relative.eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"it is for training \(gradients on\)"):
        relative(torch.randn(1, 3, 16))


def test_a_registered_backend_joins_the_automatic_order_before_eager():
    calls = []

    @register_backend("test_backend_counting")
    class Counting(Backend):
        computes = frozenset({"form:softmax", "score:AdditiveScore"})

        def compute(self, spec, inputs, dropout):
            calls.append(inputs.q.shape[2])
            return spec.form.parallel(inputs, dropout)

    try:
        assert ORDER[-2:] == ["test_backend_counting", "eager"]
        mha = attnlab.MultiHeadAttention(16, 4, 4, score="additive")
        mha(torch.randn(1, 3, 16))
        assert calls == [3] and mha.backend_for() == "test_backend_counting"
        assert attnlab.MultiHeadAttention(16, 4, 4).backend_for() == "sdpa"
    finally:
        ORDER.remove("test_backend_counting")
        _BACKENDS._entries.pop("test_backend_counting", None)  # list_backends() also lists forced-only backends
        _INSTANCES.pop("test_backend_counting", None)
