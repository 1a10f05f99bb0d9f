"""Forms (:mod:`attnlab.forms`), tested from the registry: every form tagged ``recurrent`` at its defaults and at
each of its named settings (:func:`~attnlab.forms.form_settings`: gla, gla_channel, gla_mamba2, deltanet,
deltanet_beta2, ..., kda, kda_beta2, each setting's ``params`` the layer's ``score_params``; parametrized when this
file is collected) computes the same layer on every backend that takes it, eagerly and token by token (float64,
outputs and every gradient), and a decay or delta-rule form's layer equals its plain recurrence (an explicit state
matrix updated one token at a time, written here); each named setting changes the layer it names; the state size
does not grow with the length and is what decoding carries. An :class:`~attnlab.config.AttentionConfig` field that
no one claims is refused when the layer is built, whatever the backend. A user's form in one module
(tests/user_form_example.py) is registered by importing it, computed by a layer that names it, and picked up by
these registry-driven tests."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest
import torch
from conftest import randn
from helpers import randomize_

import attnlab.forms
from attnlab.attention import MultiHeadAttention
from attnlab.backends import Conditions, build_backend, list_backends
from attnlab.config import AttentionConfig
from attnlab.decode import LayerCache
from attnlab.forms import FormInputs, FormOutput, FormSetting, form_class, form_names_with, form_settings, list_forms
from attnlab.masks import build_mask
from attnlab.stages import LAYER_STAGES

pytestmark = pytest.mark.usefixtures("single_thread")

RECURRENT = [name for name in list_forms() if "recurrent" in form_class(name).tags]
SETTINGS = form_settings("recurrent")  # every recurrent form at its defaults, then each of its named settings
NAMED = [s for s in SETTINGS if s.params]  # the named settings only (gla_channel, deltanet_beta2, ...)
D_MODEL, HEADS, D_K, L = 8, 2, 3, 9
D_V = 5  # a d_v unlike d_k (grouped heads with a short convolution, and the state size)
CAUSAL = build_mask("causal")
ATOL = 1e-10
USER_MODULE, USER_FORM = "user_form_example", "test_user_decay"
# the layer options each setting is checked under: none, and a short convolution with one key/value head for two
# query heads (grouped heads: the form repeats the key/value head) and d_v ≠ d_k (a d_k × d_v state)
OPTIONS = {"plain": {}, "short_conv_gqa_dv": {"short_conv": 3, "num_kv_heads": 1, "d_v": D_V}}


def label(setting: FormSetting) -> str:
    return setting.label


def config_of(setting: FormSetting | str, **changes) -> AttentionConfig:
    """The causal config of a form setting (or a form's name: its defaults): ``score=<form>`` (which the form
    claims) with the setting's params as ``score_params``, the row-sum normalizer for linear attention, none for the
    others (a decay or delta-rule form computes its own weights)."""
    if isinstance(setting, str):
        setting = FormSetting(setting, setting, {})
    normalizer = "rowsum" if "linear" in form_class(setting.form).tags else "none"
    return AttentionConfig(
        score=setting.form, score_params=dict(setting.params), normalizer=normalizer, mask="causal", **changes
    )


def layer_of(setting: FormSetting | str, backend: str = "auto", seed: int = 0, **options) -> MultiHeadAttention:
    """A float64 layer of a form setting (``backend`` forced unless auto; chunks of 4 tokens; ``options``: layer
    fields), every parameter drawn from N(0, 0.5²) (the same for every backend)."""
    params = {"chunk_size": 4} if backend in ("auto", "chunked") else {}
    torch.manual_seed(seed)
    config = config_of(setting, backend=backend, backend_params=params, **options)
    layer = MultiHeadAttention(D_MODEL, HEADS, D_K, config=config)
    assert layer.form.name == config.score and layer.config.score_params == config.score_params
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


class PlainRecurrence:
    """A backend written here from the recurrence's definition, for a form whose inputs carry a transition record
    (decay α_t per head or per key channel, writing strength β_t, a low-rank pair (a_t, b_t), n Householder steps
    per token): for each token t, over an explicit state matrix M (d_k × d_v per head) that starts at 0,

        M_t = (I − β_t k_t k_tᵀ) diag(α_t) M_{t−1} + β_t k_t v_tᵀ     (without β: M_t = diag(α_t) M_{t−1} + k_t v_tᵀ)
        M_t = (diag(α_t) + b_t a_tᵀ) M_{t−1} + k_t v_tᵀ               (a low-rank pair: RWKV-7)
        M ← diag(α_t) M, then M ← (I − β_s k_s k_sᵀ) M + β_s k_s v_sᵀ for each of the token's n steps (DeltaProduct)
        z_t = M_tᵀ q_t

    (α ≡ 1 without a decay; a per-head α is α·I). It reads the form's prepared q, k, v and record (the maps and
    gates), and calls nothing of attnlab's recurrences."""

    def compute(self, spec, inputs: FormInputs, dropout: float = 0.0) -> FormOutput:
        q, k, v, record = inputs.q, inputs.k, inputs.v, inputs.transition
        assert record is not None and dropout == 0.0
        B, H, n, d_k = q.shape
        steps = record.householder_steps
        eye = torch.eye(d_k, dtype=q.dtype)
        M = q.new_zeros(B, H, d_k, v.shape[-1])
        outs = []
        for t in range(n):
            G = eye.expand(B, H, d_k, d_k)
            if record.log_decay is not None:
                alpha = record.log_decay[:, :, t].exp()  # (B, H) or (B, H, d_k)
                G = alpha[..., None] * eye if alpha.dim() == 3 else alpha[..., None, None] * eye
            if record.low_rank is not None:
                a, b = record.low_rank[0][:, :, t], record.low_rank[1][:, :, t]
                G = G + torch.einsum("bhi,bhj->bhij", b, a)
            M = G @ M
            for s in range(steps):
                i = t * steps + s
                kt, vt = k[:, :, i], v[:, :, i]  # (B, H, d_k), (B, H, d_v)
                write = torch.einsum("bhi,bhj->bhij", kt, vt)
                if record.beta is None:
                    M = M + write
                else:
                    beta = record.beta[:, :, i, None, None]
                    M = (eye - beta * torch.einsum("bhi,bhj->bhij", kt, kt)) @ M + beta * write
            outs.append(torch.einsum("bhij,bhi->bhj", M, q[:, :, t]))
        return FormOutput(torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1]))


def assert_agree(setting: FormSetting, **options) -> None:
    """A form setting: the eager output (``layer.attend``), each backend that takes the layer (forced) and
    token-by-token decoding give the same outputs and gradients (of x and every parameter), and, for a form with a
    transition record, the same as :class:`PlainRecurrence` through the same layer."""
    name = setting.label
    eager = layer_of(setting, backend="eager", **options)
    x = randn(2, L, D_MODEL, seed=1).requires_grad_()
    expected = eager.attend(x, mask=CAUSAL).out
    expected_grads = grads_of(eager, expected, x)
    backends = backends_for(layer_of(setting, **options))
    assert {"chunked", "recurrent", "eager"} <= set(backends), f"{name} (tagged recurrent) is not computed in O(L)"
    assert layer_of(setting, **options).backend_for(mask="causal") != "eager", f"auto runs {name} on eager"
    assert eager.form.decode_reason() is None
    paths = {b: (layer, layer(x, mask=CAUSAL)[0]) for b in backends for layer in [layer_of(setting, b, **options)]}
    paths["decode"] = (eager, decoded(eager, x))
    plain = layer_of(setting, backend="eager", **options)
    if plain.form.prepare(*plain.project(x), x, CAUSAL.prepare(L, L, x.device)).transition is not None:
        paths["plain recurrence"] = (plain, plain.compute(PlainRecurrence(), x, None, CAUSAL).out)
    elif "linear" not in form_class(setting.form).tags:
        raise AssertionError(f"{name}: a recurrent form that is not linear attention has no transition record")
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


def test_the_registry_tags_the_builtin_recurrent_forms_and_names_their_settings():
    assert RECURRENT == form_names_with("recurrent") == list(dict.fromkeys(s.form for s in SETTINGS))
    assert {"linear", "retnet", "gla", "deltanet", "gated_deltanet", "kda"} <= set(RECURRENT)
    assert "softmax" not in RECURRENT
    labels = [s.label for s in SETTINGS]
    assert len(set(labels)) == len(labels)
    assert {"gla_channel", "gla_mamba2", "deltanet_beta2", "gated_deltanet_beta2", "kda_beta2"} <= set(labels)
    for s in SETTINGS:  # each form at its defaults (label = form, no params), then each named setting
        assert (s.label == s.form and not s.params) or (s.label.startswith(f"{s.form}_") and s.params), s
    params = {s.label: s.params for s in NAMED}
    assert params["gla_channel"] == {"gate": "channel"} and params["gla_mamba2"] == {"gate": "mamba2"}
    assert params["deltanet_beta2"] == params["gated_deltanet_beta2"] == params["kda_beta2"] == {"beta_range": 2}


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("setting", SETTINGS, ids=label)
def test_eager_every_backend_decoding_and_the_plain_recurrence_agree(setting, options):
    assert_agree(setting, **options)


@pytest.mark.parametrize("setting", NAMED, ids=label)
def test_each_named_setting_changes_the_layer(setting):
    """The setting's params reach the form: with the same parameters drawn, the layer's output differs from the
    form's at its defaults (a setting whose params were dropped would give the defaults' output)."""
    x = randn(2, L, D_MODEL, seed=4)
    with torch.no_grad():
        out, default = layer_of(setting)(x, mask=CAUSAL)[0], layer_of(setting.form)(x, mask=CAUSAL)[0]
    assert (out - default).abs().max() > 1e-3, f"{setting.label} computes what {setting.form} computes"


@pytest.mark.parametrize("setting", SETTINGS, ids=label)
def test_the_state_size_does_not_grow_with_the_length_and_is_what_decoding_carries(setting):
    """The form's and the layer's state sizes (floats per sequence; the layer's with its short convolution's
    buffers) are the same at every length, and are the floats the decoding cache holds after each token; a decay
    or delta-rule form's is H·d_k·d_v (one state matrix per head). d_v ≠ d_k and one key/value head for two query
    heads, so that a size counting d_k for d_v, or H heads for G, is wrong."""
    layer = layer_of(setting, short_conv=3, d_v=D_V, num_kv_heads=1)
    sizes = {layer.form.state_size(length) for length in (0, 1, L, 100_000)}
    assert len(sizes) == 1 and sizes.pop() > 0
    reported = {layer.state_size(length) for length in (1, L, 100_000)}
    assert len(reported) == 1
    if {"decay", "delta"} & form_class(setting.form).tags:
        n = setting.params.get("householder_steps", 2) if setting.form == "deltaproduct" else 1  # keys, values a token
        conv = 2 * (HEADS * D_K + n * D_K + n * D_V)  # (k − 1) × the q (H·d_k), k (n·G·d_k) and v (n·G·d_v) channels
        assert reported == {HEADS * D_K * D_V + conv} and layer.form.state_size(L) == HEADS * D_K * D_V
    x, cache = randn(3, L, D_MODEL, seed=5), LayerCache()
    with torch.no_grad():
        for t in range(L):
            layer.step(x[:, t : t + 1], cache)
            assert cache.nbytes() == 3 * 8 * layer.state_size(t + 1), (setting.label, t)


# --------------------------------------------------------------------------------------------- a new config field

# Configs that the backends compute, the first one a backend takes standing for it.
PLAIN_CONFIGS = [
    AttentionConfig(),
    AttentionConfig(position_bias="t5"),
    AttentionConfig(position_bias="shaw"),
    AttentionConfig(softcap=30.0),
    AttentionConfig(normalizer="sparsemax"),
    AttentionConfig(score="linear", normalizer="rowsum"),
    *(config_of(setting) for setting in SETTINGS),
]
FutureConfig = dataclasses.make_dataclass(
    "FutureConfig", [("future_stage", bool, dataclasses.field(default=False))], bases=(AttentionConfig,), frozen=True
)
"""AttentionConfig with one more field, ``future_stage``: a setting no backend (and no form) was taught."""


def with_future(config: AttentionConfig, on: bool) -> AttentionConfig:
    return FutureConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, future_stage=on)


def small_layer(config: AttentionConfig) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(D_MODEL, HEADS, D_K, config=config)


@pytest.mark.parametrize("backend", ["auto", *list_backends()])
def test_a_new_config_field_is_refused_by_every_backend_until_something_computes_it(backend):
    """``future_stage=True``, a field that neither the layer's stages nor any form claims, is refused when the
    layer is built, in one line naming it, whatever the backend (``eager`` included: issue 60, the capability
    check); at its default the field changes nothing."""
    assert "future_stage" not in LAYER_STAGES
    plain = PLAIN_CONFIGS[0]
    base = small_layer(plain)
    off = small_layer(with_future(plain, False))
    assert off.spec.features == base.spec.features  # at its default: nothing changes
    with pytest.raises(ValueError, match=r"does not compute future_stage=true") as err:
        small_layer(with_future(plain, True).replace(backend=backend))
    assert "\n" not in str(err.value)
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
    assert form_settings("recurrent")[-1] == FormSetting(USER_FORM, USER_FORM, {})  # (no named settings)
    layer = layer_of(USER_FORM)
    assert isinstance(layer.form, user_form.UserDecay) and layer.form.name == USER_FORM
    assert layer.spec.features == frozenset({"form:recurrent"})
    assert_agree(form_settings("recurrent")[-1])
    from attnlab.bench.cases import DECODE_MODELS, LINEAR_MODELS, RECURRENT_FORMS
    from attnlab.card import default_variants

    assert RECURRENT_FORMS[-1] == USER_FORM and USER_FORM in LINEAR_MODELS and USER_FORM in DECODE_MODELS
    assert USER_FORM in default_variants()


def test_a_users_form_whose_output_takes_out_alone_still_runs():
    """``Form.output(out)`` as user forms wrote it before the hook took the inputs (RWKV-7's bonus reads them): the
    layer passes ``inputs`` only to an override that takes them, so an old form's output transform still runs."""
    from attnlab.forms import Form, register_form

    class Halved(Form):
        """Every visible key alike, then its output halved by the old-style hook."""

        def parallel(self, inputs: FormInputs, dropout: float = 0.0) -> FormOutput:
            w = torch.ones(*inputs.q.shape[:3], inputs.k.shape[2], dtype=inputs.q.dtype)
            w = w / w.shape[-1]
            return FormOutput(torch.matmul(w, inputs.v), w, w)

        def output(self, out: FormOutput) -> torch.Tensor:  # the pre-inputs signature
            return out.z / 2

        def state_size(self, length: int) -> int:
            return 0

    try:
        register_form("test_halved_output")(Halved)
        layer = MultiHeadAttention(8, 2, config=AttentionConfig(score="test_halved_output")).double()
        x = randn(1, 5, 8, seed=3)
        v = layer.project(x)[2]
        expected = layer.merge(v.mean(dim=2, keepdim=True).expand(-1, -1, 5, -1) / 2)
        torch.testing.assert_close(layer(x)[0], expected)
    finally:
        attnlab.forms._FORMS._entries.pop("test_halved_output", None)
        attnlab.forms._ORDER.remove("test_halved_output")
