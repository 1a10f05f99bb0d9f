"""Backends: every registered backend computes what the eager path computes, wherever it says it can; the choice
is one ordered lookup, reported; a forced backend is refused in one line where it cannot compute the layer."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.backends import ORDER, Backend, Conditions, build_backend, list_backends, register_backend
from attnlab.config import AttentionConfig
from attnlab.masks import build_mask

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
}
MASKS = {"none": None, "causal": "causal", "window": {"name": "sliding_window", "window": 2}}


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_automatic_order_puts_the_most_specific_first_and_eager_last():
    assert list_backends()[:4] == ["relative", "biased_softmax", "sdpa", "eager"]
    assert list_backends()[-1] == "eager"


TRAINING_STEP = Conditions("cpu", torch.float64, need_weights=False, training=True, grad=True)


def _supported() -> list[tuple[str, str]]:
    """(backend, config) for every pair where the backend says it computes the config (a CPU float64 training step):
    each is checked below, the others are refused (see the refusal tests)."""
    pairs = []
    for name, config in CONFIGS.items():
        mha = attnlab.MultiHeadAttention(16, 4, 4, config=config)
        pairs += [(b, name) for b in list_backends() if build_backend(b).supports(mha, TRAINING_STEP) is None]
    return pairs


def test_every_backend_and_every_configuration_are_checked():
    """The pairs below cover every backend and every configuration (eager computes all of them)."""
    pairs = _supported()
    assert {b for b, _ in pairs} == set(list_backends()) and {n for b, n in pairs if b == "eager"} == set(CONFIGS)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize(("backend", "name"), _supported())
def test_every_backend_equals_eager_where_it_supports_the_layer(backend, name, mask):
    """Outputs and the gradients of the input and every parameter, float64, fresh random inputs."""
    torch.manual_seed(7)
    mha = attnlab.MultiHeadAttention(16, 4, 4, config=CONFIGS[name]).double()
    x = randn(2, 6, 16, seed=1).requires_grad_()
    m = None if MASKS[mask] is None else build_mask(MASKS[mask])
    c = randn(2, 6, 16, seed=2)
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


@pytest.mark.parametrize(
    ("name", "training_step", "inference"),
    [
        ("scaled_dot", "sdpa", "sdpa"),
        ("t5", "relative", "sdpa"),
        ("alibi_sink", "sdpa", "sdpa"),
        ("t5_softmax1", "biased_softmax", "sdpa"),
        ("additive", "eager", "eager"),
        ("softcap", "eager", "eager"),
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
        def config_reason(self, attn):
            return None if attn.config.score == "additive" else "additive only"

        def attend(self, attn, x, key_value, mask):
            calls.append(x.shape)
            return attn.attend(x, key_value, mask).out, None

    try:
        assert ORDER[-2:] == ["test_backend_counting", "eager"]
        mha = attnlab.MultiHeadAttention(16, 4, 4, score="additive")
        mha(torch.randn(1, 3, 16))
        assert calls == [(1, 3, 16)] and mha.backend_for() == "test_backend_counting"
        assert attnlab.MultiHeadAttention(16, 4, 4).backend_for() == "sdpa"
    finally:
        ORDER.remove("test_backend_counting")
