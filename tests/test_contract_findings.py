"""The findings of issue 60's adversarial pass, each pinned: a knob a form accepted and did not compute, a mask a
layer named and did not apply, an empty string taken for "off". Each of these tests fails on the code before the
capability check (:func:`attnlab.forms.base.refuse_unimplemented`)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import registered_here, run_cli

import attnlab
from attnlab.config import AttentionConfig
from attnlab.forms import LayerOptionError, form_class, form_names_with

RECURRENT = form_names_with("recurrent")


@pytest.mark.parametrize("form", RECURRENT)
def test_selective_attention_is_refused_on_every_recurrent_form(form):
    """``attention.selective=true`` changed nothing on linear, retnet, … rwkv7 while the summary said "selective";
    for linear attention the chunked backend dropped it where eager applied it (outputs 86 % apart)."""
    config = form_class(form).base_config().replace(selective=True, mask="causal")
    with pytest.raises(LayerOptionError, match=rf"^variant {form} does not compute attention\.selective=true: "):
        attnlab.MultiHeadAttention(16, 2, config=config)


def test_selective_attention_on_the_command_line_is_one_line_and_exit_2():
    """As a researcher ran it: ``variant=kda attention.selective=true``."""
    result = run_cli("variant=kda", "attention.selective=true", "debug=fast", "logger=none", returncode=2)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "variant kda does not compute attention.selective=true" in lines[0], result.stderr


def test_mla_refuses_the_layers_rotary_knob_and_takes_its_own_base():
    """``variant=mla`` took ``rope`` (the layer's rotary knob) and its output did not change: its rotary positions
    are its decoupled key's, always on. The knob is refused with a pointer; ``rope_base`` sets their base."""
    with pytest.raises(LayerOptionError, match=r"variant mla does not compute model\.pos_encoding=rope: .*rope_dim"):
        attnlab.MultiHeadAttention(24, 2, config=AttentionConfig(score="mla", rope={}))
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    layers = []
    for base in (None, 100.0):
        torch.manual_seed(0)
        params = {} if base is None else {"rope_base": base}
        layers.append(attnlab.MultiHeadAttention(24, 2, config=AttentionConfig(score="mla", score_params=params)))
    a, b = (layer.double()(x)[0] for layer in layers)
    assert (a - b).abs().max() > 1e-4  # the base is computed
    assert layers[1].form.rotary.base == 100.0


def test_stickbreaking_refuses_a_non_causal_mask():
    """``variant=stickbreaking mask=none`` ran non-causally although the form is causal (Tan et al. 2025)."""
    with pytest.raises(ValueError, match=r"normalizer stickbreaking is causal .*mask=causal"):
        attnlab.MultiHeadAttention(16, 2, normalizer="stickbreaking")
    result = run_cli("variant=stickbreaking", "mask=none", "debug=fast", "logger=none", returncode=2)
    assert re.match(r"^error: normalizer(\.name)? stickbreaking is causal .*mask=causal", result.stderr)


@pytest.mark.parametrize(
    "options",
    [
        {"mask": "causal"},
        {"mask": "causal", "selective": True},
        {"mask": "causal", "normalizer": "stickbreaking"},
        {"score": "kda", "normalizer": "none", "mask": "causal"},
        {"score": "forgetting", "mask": "causal"},
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_a_layer_applies_its_configured_mask_when_called_without_one(options):
    """A ``mask="causal"`` layer called without a mask let row 0 read the last token (softmax forms) or was
    refused (kda): the configured mask is applied, so no output depends on a later token."""
    torch.manual_seed(0)
    layer = attnlab.MultiHeadAttention(16, 2, **options).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)[0]
    for i in range(5):
        (grad,) = torch.autograd.grad(out[0, i].sum(), x, retain_graph=True)
        assert grad[0, i + 1 :].abs().max() == 0, f"output {i} reads a later token"
    # the same as passing the mask explicitly
    explicit = layer(x, mask=attnlab.masks.build_mask("causal"))[0]
    torch.testing.assert_close(out, explicit)


@pytest.mark.parametrize("form", ["mla", "forgetting", "mta"])
def test_a_softmax_subclass_is_computed_as_softmax_only_when_it_says_so(form):
    """A form inherited its parent's backend grants: a softmax-family form that does not override ``features()``
    was computed as plain softmax by ``tiled`` and ``sdpa``. ``computed_as`` is not inherited."""
    cls = form_class(form)
    expected = "form:softmax" if cls.__dict__.get("computed_as") == "softmax" else f"form:{form}"
    config = cls.base_config()
    layer = attnlab.MultiHeadAttention(24, 2, config=config)
    assert expected in layer.spec.features

    class Plain(cls):  # a user's subclass that declares nothing
        pass

    assert Plain.computed_as is None and Plain.implements == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"output_gate": ""}, r"output_gate must be null, headwise or elementwise, got ''"),
        ({"position_bias": ""}, r"position_bias must be a registered name or null"),
    ],
)
def test_an_empty_string_is_a_value_not_off(options, message):
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**options)


def test_an_empty_canon_string_is_refused_on_the_command_line():
    result = run_cli("model.canon=''", "debug=fast", "logger=none", returncode=2)
    assert "model.canon must be null or a subset of ABCD" in result.stderr


def test_d_k_given_twice_and_different_is_refused():
    """The layer's ``d_k=`` silently won over ``config.d_k``."""
    with pytest.raises(ValueError, match=r"d_k=4 given to the layer and config\.d_k=6: give one of them"):
        attnlab.MultiHeadAttention(8, 2, 4, config=AttentionConfig(d_k=6))
    assert attnlab.MultiHeadAttention(8, 2, config=AttentionConfig(d_k=6)).d_k == 6


def test_a_users_subclass_keeps_its_parents_knobs_only_when_it_says_so():
    """``implements`` is not inherited: a user's subclass of a transition form that declares nothing computes no
    knob, and the refusal says how to keep the parent's."""
    from attnlab.forms import register_form
    from attnlab.forms.transitions import RetNet

    with registered_here():

        @register_form("test_plain_retnet")
        class PlainRetNet(RetNet):
            pass

        config = AttentionConfig(score="test_plain_retnet", normalizer="none", mask="causal")
        with pytest.raises(LayerOptionError, match=r"implements = RetNet\.implements"):
            attnlab.MultiHeadAttention(16, 2, config=config)
        PlainRetNet.implements = RetNet.implements
        attnlab.MultiHeadAttention(16, 2, config=config)
