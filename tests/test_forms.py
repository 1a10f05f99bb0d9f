"""Forms (:mod:`attnlab.forms`), tested from the registry: every form tagged ``recurrent`` (parametrized from
:func:`~attnlab.forms.list_forms` and the tags when this file is collected) computes the same layer on every backend
that takes it, eagerly and token by token (float64, outputs and every gradient), with a state whose size does not
grow with the length. An :class:`~attnlab.config.AttentionConfig` field that no one owns is refused by every backend
that was not taught it. A user's form in one module (tests/user_form_example.py) is registered by importing it,
computed by a layer that names it, and picked up by these registry-driven tests."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest
import torch
from conftest import randn
from helpers import randomize_

import attnlab.forms
from attnlab.attention import LAYER_FIELDS, MultiHeadAttention
from attnlab.backends import Conditions, build_backend, list_backends, missing_feature
from attnlab.config import AttentionConfig
from attnlab.decode import LayerCache
from attnlab.forms import form_class, form_names_with, list_forms
from attnlab.masks import build_mask

pytestmark = pytest.mark.usefixtures("single_thread")

RECURRENT = [name for name in list_forms() if "recurrent" in form_class(name).tags]
D_MODEL, HEADS, D_K, L = 8, 2, 3, 9
CAUSAL = build_mask("causal")
ATOL = 1e-10
USER_MODULE, USER_FORM = "user_form_example", "test_user_decay"


def config_of(name: str, **changes) -> AttentionConfig:
    """The causal config of form ``name``: ``score=<name>`` (which the form claims), the row-sum normalizer for linear
    attention, none for the others (a decay or delta-rule form computes its own weights)."""
    normalizer = "rowsum" if "linear" in form_class(name).tags else "none"
    return AttentionConfig(score=name, normalizer=normalizer, mask="causal", **changes)


def layer_of(name: str, backend: str = "auto", seed: int = 0) -> MultiHeadAttention:
    """A float64 layer of form ``name`` (``backend`` forced unless auto; chunks of 4 tokens), every parameter drawn
    from N(0, 0.5²) (the same for every backend)."""
    params = {"chunk_size": 4} if backend in ("auto", "chunked") else {}
    torch.manual_seed(seed)
    layer = MultiHeadAttention(D_MODEL, HEADS, D_K, config=config_of(name, backend=backend, backend_params=params))
    assert layer.form.name == name
    return randomize_(layer.double(), seed, scale=0.5)


def backends_for(layer: MultiHeadAttention) -> list[str]:
    """The registered backends that compute ``layer`` in a float64 CPU training step with its causal mask."""
    when = Conditions("cpu", torch.float64, mask="causal")
    return [b for b in list_backends() if build_backend(b).supports(layer, when) is None]


def decoded(layer: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """x (B, L, d_model) through ``layer.step``, one token at a time from an empty cache."""
    cache = LayerCache()
    return torch.cat([layer.step(x[:, t : t + 1], cache) for t in range(x.shape[1])], dim=1)


def grads_of(layer: MultiHeadAttention, out: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """d<out, c>/d(x and each named parameter) for a fixed random cotangent c."""
    names, params = zip(*layer.named_parameters(), strict=True)
    c = randn(*out.shape, seed=123)
    gs = torch.autograd.grad(out, [x, *params], grad_outputs=c, allow_unused=True, retain_graph=True)
    return {n: torch.zeros_like(p) if g is None else g for n, p, g in zip(["x", *names], [x, *params], gs, strict=True)}


def assert_agree(name: str) -> None:
    """Form ``name``: the eager output (``layer.attend``), each backend that takes the layer (forced) and
    token-by-token decoding give the same outputs and gradients (of x and every parameter)."""
    eager = layer_of(name, backend="eager")
    x = randn(2, L, D_MODEL, seed=1).requires_grad_()
    expected = eager.attend(x, mask=CAUSAL).out
    expected_grads = grads_of(eager, expected, x)
    backends = backends_for(layer_of(name))
    assert {"chunked", "recurrent", "eager"} <= set(backends), f"{name} (tagged recurrent) is not computed in O(L)"
    assert layer_of(name).backend_for(mask="causal") != "eager", f"auto runs {name} on eager"
    assert eager.form.decode_reason() is None
    paths = {b: (layer, layer(x, mask=CAUSAL)[0]) for b in backends for layer in [layer_of(name, backend=b)]}
    paths["decode"] = (eager, decoded(eager, x))
    for path, (layer, out) in paths.items():
        torch.testing.assert_close(out, expected, rtol=ATOL, atol=ATOL, msg=lambda m, p=path: f"{name}, {p}: {m}")
        for n, g in grads_of(layer, out, x).items():
            torch.testing.assert_close(
                g, expected_grads[n], rtol=ATOL, atol=ATOL, msg=lambda m, p=path, n=n: f"{name}, {p}, d/d{n}: {m}"
            )


@pytest.fixture
def user_form():
    """tests/user_form_example.py imported (its form registered) inside the test, and the registry, and
    ``sys.modules``, put back afterwards."""
    assert USER_FORM not in list_forms() and USER_MODULE not in sys.modules
    before = list_forms()
    try:
        yield importlib.import_module(USER_MODULE)
    finally:
        for name in [n for n in list_forms() if n not in before]:
            attnlab.forms._FORMS._entries.pop(name, None)
            attnlab.forms._ORDER.remove(name)
        sys.modules.pop(USER_MODULE, None)
    assert list_forms() == before


# --------------------------------------------------------------------------------------------- every recurrent form


def test_the_registry_tags_the_builtin_recurrent_forms():
    assert RECURRENT == form_names_with("recurrent")
    assert {"linear", "retnet", "gla", "deltanet", "gated_deltanet"} <= set(RECURRENT)
    assert "softmax" not in RECURRENT


@pytest.mark.parametrize("name", RECURRENT)
def test_eager_every_backend_and_decoding_agree(name):
    assert_agree(name)


@pytest.mark.parametrize("name", RECURRENT)
def test_the_state_size_does_not_grow_with_the_length(name):
    layer = layer_of(name)
    sizes = {layer.form.state_size(length) for length in (0, 1, L, 100_000)}
    assert len(sizes) == 1 and sizes.pop() > 0
    assert len({layer.state_size(length) for length in (1, L, 100_000)}) == 1


# --------------------------------------------------------------------------------------------- a new config field

# Configs that the backends compute, the first one a backend takes standing for it.
PLAIN_CONFIGS = [
    AttentionConfig(),
    AttentionConfig(position_bias="t5"),
    AttentionConfig(position_bias="shaw"),
    AttentionConfig(softcap=30.0),
    AttentionConfig(normalizer="sparsemax"),
    AttentionConfig(score="linear", normalizer="rowsum"),
    *(config_of(name) for name in RECURRENT),
]
GatedConfig = dataclasses.make_dataclass(
    "GatedConfig", [("output_gate", bool, dataclasses.field(default=False))], bases=(AttentionConfig,), frozen=True
)
"""AttentionConfig with one more field, ``output_gate``: a setting no backend (and no form) was taught."""


def gated(config: AttentionConfig, on: bool) -> AttentionConfig:
    return GatedConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, output_gate=on)


def small_layer(config: AttentionConfig) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(D_MODEL, HEADS, D_K, config=config)


@pytest.mark.parametrize("backend", [b for b in list_backends() if "*" not in build_backend(b).computes])
def test_a_new_config_field_is_refused_by_every_backend_not_taught_it(backend):
    """``output_gate=True`` is a feature of the layer (``config.output_gate``: neither the layer nor the form owns
    the field) that the backend refuses in one line naming it, for a config it computes otherwise; built with
    the backend forced, the layer is refused; ``auto`` falls back on a backend that computes everything. At its
    default the field changes nothing."""
    assert "output_gate" not in LAYER_FIELDS
    chosen = build_backend(backend)
    plain = next((c for c in PLAIN_CONFIGS if chosen.config_reason(small_layer(c)) is None), None)
    if plain is None:  # a backend none of the configs above reaches: its refusal of its own features plus the field
        features = frozenset(chosen.computes) | {"config.output_gate"}
        reason = missing_feature(features, chosen.computes)
        assert reason is not None and "output_gate" in reason
        return
    base = small_layer(plain)
    off, on = small_layer(gated(plain, False)), small_layer(gated(plain, True))
    assert isinstance(on.config, GatedConfig) and on.config.output_gate
    assert off.spec.features == base.spec.features  # at its default: nothing changes
    assert chosen.config_reason(off) is None
    assert on.spec.features == base.spec.features | {"config.output_gate"}
    reason = chosen.config_reason(on)
    assert reason is not None and "output_gate" in reason and "\n" not in reason, reason
    with pytest.raises(ValueError, match="output_gate") as err:
        small_layer(gated(plain, True).replace(backend=backend))
    assert "\n" not in str(err.value)
    star = [b for b in list_backends() if "*" in build_backend(b).computes]
    assert on.backend_for(mask=on.mask_form) in star
    x = randn(2, 5, D_MODEL, seed=2).float()
    off.load_state_dict(base.state_dict())
    torch.testing.assert_close(off(x)[0], base(x)[0], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------- a user's form


def test_a_users_form_in_one_module_is_registered_computed_and_tested(user_form):
    """Importing the module registers its form (last, tagged recurrent and decay: the registry-driven tests of this
    file, tests/test_recurrences.py, the bench and the card take it); a layer with ``score=<name>`` computes it,
    and the chunked, recurrent and eager backends and decoding agree."""
    assert list_forms()[-1] == USER_FORM and form_class(USER_FORM) is user_form.UserDecay
    assert USER_FORM in form_names_with("recurrent") and USER_FORM in form_names_with("decay")
    layer = layer_of(USER_FORM)
    assert isinstance(layer.form, user_form.UserDecay) and layer.form.name == USER_FORM
    assert layer.spec.features == frozenset({"form:recurrent"})
    assert_agree(USER_FORM)
    from attnlab.bench.cases import DECODE_MODELS, LINEAR_MODELS, RECURRENT_FORMS
    from attnlab.card import default_variants

    assert RECURRENT_FORMS[-1] == USER_FORM and USER_FORM in LINEAR_MODELS and USER_FORM in DECODE_MODELS
    assert USER_FORM in default_variants()
