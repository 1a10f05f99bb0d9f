"""AttentionConfig: one description of a layer's attention, its presets, and what a run records from it."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.config import FIELDS, AttentionConfig, build_preset
from attnlab.scores import list_presets, register_preset

pytestmark = pytest.mark.usefixtures("single_thread")


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_every_keyword_of_multi_head_attention_is_a_field_of_the_config():
    """The old keyword route and the config route build the same layer: same parameters, same outputs."""
    options = {
        "num_kv_heads": 2,
        "rope": {"base": 100.0},
        "qk_norm": "rmsnorm",
        "softcap": 20.0,
        "position_bias": "t5",
        "position_bias_params": {"num_buckets": 8},
        "normalizer": "sink",
        "normalizer_params": {"init": 0.5},
    }
    torch.manual_seed(0)
    old = attnlab.MultiHeadAttention(16, 4, 8, 6, score="additive", d_attn=5, **options).double()
    torch.manual_seed(0)
    config = AttentionConfig(score="additive", score_params={"d_attn": 5}, d_v=6, **options)
    new = attnlab.MultiHeadAttention(16, 4, 8, config=config).double()
    assert old.config == new.config
    assert old.state_dict().keys() == new.state_dict().keys()
    for key, value in old.state_dict().items():
        torch.testing.assert_close(value, new.state_dict()[key], rtol=0, atol=0)
    x = randn(2, 7, 16, seed=1)
    torch.testing.assert_close(old(x)[0], new(x)[0], rtol=0, atol=0)


def test_config_and_options_together_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^give config= or the attention options, not both \(also given: qk_norm\)$"):
        attnlab.MultiHeadAttention(16, 4, 4, config=AttentionConfig(), qk_norm="rmsnorm")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("qk_norm", "batchnorm", r"^qk_norm must be null, layernorm or rmsnorm, got 'batchnorm'$"),
        ("softcap", 0, r"^softcap must be a finite number > 0, got 0$"),
        ("num_kv_heads", 0, r"^num_kv_heads must be an integer >= 1, got 0$"),
        ("differential", "yes", r"^differential must be true or false, got 'yes'$"),
        ("rope", 3, r"^rope must be null or a mapping"),
        ("score_params", [1], r"^score_params must be a mapping"),
    ],
)
def test_a_bad_field_is_one_line_naming_it(field, value, message):
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**{field: value})


def test_replace_refuses_an_unknown_field_and_lists_the_fields():
    with pytest.raises(ValueError, match=r"^attention has no field 'qknorm'; fields: score, score_params"):
        AttentionConfig().replace(qknorm="rmsnorm")


@pytest.mark.parametrize(
    ("preset", "params", "expected"),
    [
        ("alibi", {}, {"score": "scaled_dot", "position_bias": "alibi"}),
        ("t5_bias", {}, {"score": "dot", "position_bias": "t5"}),
        ("t5_bias", {"scale": True, "num_buckets": 8}, {"score": "scaled_dot", "position_bias": "t5"}),
        ("relative_position", {"clip": 3, "value_term": True}, {"score": "scaled_dot", "position_bias": "shaw"}),
    ],
)
def test_a_preset_resolves_to_a_score_plus_a_position_bias(preset, params, expected):
    resolved = AttentionConfig(score=preset, score_params=params).resolved()
    assert {"score": resolved.score, "position_bias": resolved.position_bias} == expected
    assert resolved.score_params == {}
    if preset == "relative_position":
        assert resolved.position_bias_params == {"clip": 3, "value_term": True}
    if preset == "t5_bias":
        assert resolved.position_bias_params["num_buckets"] == params.get("num_buckets", 32)


def test_a_preset_layer_equals_its_explicit_score_and_bias_and_records_what_it_is():
    """``score="relative_position"`` builds the same layer as ``scaled_dot`` + ``position_bias=shaw``: same
    parameter names, same numbers; its config says so."""
    torch.manual_seed(0)
    preset = attnlab.MultiHeadAttention(16, 4, 4, score="relative_position", clip=2, value_term=True).double()
    torch.manual_seed(0)
    explicit = attnlab.MultiHeadAttention(
        16, 4, 4, position_bias="shaw", position_bias_params={"clip": 2, "value_term": True}
    ).double()
    assert preset.config == explicit.config
    assert preset.config.score == "scaled_dot" and preset.config.position_bias == "shaw"
    assert "form.position_bias.rel_k" in dict(preset.named_parameters())
    x = randn(2, 6, 16, seed=3)
    torch.testing.assert_close(preset(x)[0], explicit(x)[0], rtol=0, atol=0)


def test_a_preset_with_a_second_position_bias_is_refused():
    with pytest.raises(ValueError, match=r"variant alibi is scaled_dot with position_bias=alibi built in"):
        attnlab.MultiHeadAttention(16, 4, 4, score="alibi", position_bias="t5")


def test_a_checkpoint_of_a_preset_from_0_1_and_0_2_loads_into_the_position_bias_stage():
    """0.1 kept Shaw's table at ``score.rel_k``, 0.2 at ``score.position_bias.rel_k``; both load into 0.3's
    ``position_bias.rel_k`` (strict), with the saved values."""
    mha = attnlab.MultiHeadAttention(16, 4, 4, score="relative_position", clip=2)
    state = mha.state_dict()
    table = torch.randn_like(state["form.position_bias.rel_k"])
    for old_key in ("score.rel_k", "score.position_bias.rel_k"):
        old = {k: v for k, v in state.items() if k != "form.position_bias.rel_k"} | {old_key: table}
        fresh = attnlab.MultiHeadAttention(16, 4, 4, score="relative_position", clip=2)
        fresh.load_state_dict(old, strict=True)
        torch.testing.assert_close(fresh.position_bias.rel_k, table, rtol=0, atol=0)


def test_a_registered_preset_is_accepted_wherever_a_score_is():
    @register_preset("test_cfg_alibi_capped")
    def capped(cap: float = 10.0):
        return {"score": "scaled_dot", "position_bias": "alibi", "softcap": cap}

    assert "test_cfg_alibi_capped" in list_presets() and "test_cfg_alibi_capped" in attnlab.list_scores()
    mha = attnlab.MultiHeadAttention(16, 4, 4, score="test_cfg_alibi_capped", cap=5.0)
    assert (mha.config.score, mha.config.position_bias, mha.softcap) == ("scaled_dot", "alibi", 5.0)
    with pytest.raises(ValueError, match=r"variant 'test_cfg_alibi_capped' does not take parameter 'clip'"):
        build_preset("test_cfg_alibi_capped", clip=3)


def test_changes_and_describe_show_every_setting_that_differs_from_the_defaults():
    config = AttentionConfig(
        score="additive",
        score_params={"d_attn": None, "kernel": "auto"},  # the score's own defaults: not a change worth showing
        position_bias="alibi",
        qk_norm="rmsnorm",
        softcap=50.0,
        rope={},
        num_kv_heads=1,
        normalizer="softmax1",
        mask={"name": "and", "masks": ["causal", {"name": "sliding_window", "window": 8}]},
        backend="eager",
    )
    assert set(config.changes()) == {
        "score",
        "score_params",
        "position_bias",
        "qk_norm",
        "softcap",
        "rope",
        "num_kv_heads",
        "normalizer",
        "mask",
        "backend",
    }
    assert config.describe() == (
        "additive · position_bias=alibi · rope · qk_norm=rmsnorm · softcap=50 · "
        "mask=causal & sliding_window(window=8) · normalizer=softmax1 · num_kv_heads=1 · backend=eager"
    )
    assert AttentionConfig().describe() == "scaled_dot"
    assert AttentionConfig(mask={"name": "none"}).mask is None  # no mask, however it is spelled


def test_to_dict_round_trips_and_has_every_field():
    config = AttentionConfig(score="cosine", score_params={"init_scale": 5.0}, mask="causal", softcap=3.0)
    data = config.to_dict()
    assert tuple(data) == FIELDS
    assert AttentionConfig(**data) == config


def test_a_causal_mask_in_the_config_gives_t5_one_directional_buckets():
    """T5's ``bidirectional=None`` follows the layer's own mask: causal → decoder buckets."""
    causal = attnlab.MultiHeadAttention(16, 4, 4, config=AttentionConfig(score="t5_bias", mask="causal"))
    free = attnlab.MultiHeadAttention(16, 4, 4, config=AttentionConfig(score="t5_bias"))
    assert causal.position_bias.bidirectional is False and free.position_bias.bidirectional is True


def test_partial_rotary_offers_both_published_spectra():
    """``full`` (p-RoPE) keeps θ_i = base^(−2i/d) for the rotated pairs; ``rotated`` (GPT-NeoX) spreads
    θ_i = base^(−2i/r) over the r rotated dimensions. Checked against the formulas and by rotating a vector."""
    d, r, base = 16, 8, 100.0
    full = attnlab.RotaryEmbedding(d, base=base, fraction=0.5)
    neox = attnlab.RotaryEmbedding(d, base=base, fraction=0.5, spectrum="rotated")
    for i in range(r // 2):
        assert math.isclose(float(full.inv_freq[i]), base ** (-2 * i / d), rel_tol=1e-15)
        assert math.isclose(float(neox.inv_freq[i]), base ** (-2 * i / r), rel_tol=1e-15)
    x = randn(1, 3, d, seed=5)
    y = neox(x)
    m, i = 2, 3  # position 2, pair 3: rotated by m·θ_3 = 2·base^(−6/8)
    angle = m * base ** (-2 * i / r)
    x0, x1 = x[0, m, 2 * i], x[0, m, 2 * i + 1]
    torch.testing.assert_close(y[0, m, 2 * i], x0 * math.cos(angle) - x1 * math.sin(angle))
    torch.testing.assert_close(y[0, m, 2 * i + 1], x0 * math.sin(angle) + x1 * math.cos(angle))
    torch.testing.assert_close(y[..., r:], x[..., r:], rtol=0, atol=0)
    assert torch.equal(attnlab.RotaryEmbedding(d, spectrum="rotated").inv_freq, attnlab.RotaryEmbedding(d).inv_freq)
    with pytest.raises(ValueError, match=r"^rope.spectrum must be full \(p-RoPE\) or rotated"):
        attnlab.RotaryEmbedding(d, spectrum="neox")
