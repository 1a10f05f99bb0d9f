"""One contract for every combination (issue 60): each knob computed as asked, or refused in one line.

Generated from the registries, so a new form, field or backend is covered with no edit here: every registered form
(at :meth:`~attnlab.forms.Form.base_config`) × every :class:`~attnlab.config.AttentionConfig` field at each of its
sample values (kept beside the field's definition: ``attnlab.config.field_info``) × every backend, and every pair of
knobs on every form. Each cell is either

* refused when the layer is built, in one line that names the knob (a ValueError), or
* (a) equal to ``eager`` in float64, in values and in the gradients of the input and of every parameter, with the
  parameters drawn away from their initial values, and (b) different from the same form without the knob (for a
  knob that chooses what is computed: ``role == "what"``).

And the refusals are the capability check's, not luck: a knob that neither the form
(:attr:`~attnlab.forms.Form.implements`) nor the layer (:data:`attnlab.stages.LAYER_STAGES`) claims must be refused
whatever the backend, and one that is claimed must be built unless the refusal names it (a mask a causal-only form
cannot compute, a backend that has no kernel for it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import zlib

import pytest
import torch

import attnlab
from attnlab.backends import Backend, Conditions, build_backend, list_backends
from attnlab.config import FIELDS, AttentionConfig, field_default, field_info
from attnlab.forms import form_class, form_for, list_forms
from attnlab.stages import claims_of

B, L, D_MODEL, H = 2, 8, 8, 2  # d_k = d_model / H = 4 unless a config sets it


def knob_samples() -> list[tuple[str, object]]:
    """(field, sample) for every field whose role is not the form's own (``score``, ``score_params``)."""
    return [(f, s) for f in FIELDS if field_info(f)["role"] != "form" for s in field_info(f)["samples"]]


def with_knob(base: AttentionConfig, name: str, value: object) -> tuple[AttentionConfig, AttentionConfig] | None:
    """(the config with the sample's requirements alone, the config with the sample too); None when the sample
    is no change on this base (the base's own mask)."""
    info = field_info(name)
    without = base.replace(**{k: v for k, v in info["requires"].items() if getattr(base, k) == field_default(k)})
    with_ = without.replace(**{name: value})
    return None if with_ == without else (without, with_)


def seeded_(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn from N(0, 0.5²), seeded by its name: two layers that share a parameter's name and
    shape get the same values (so a layer with a knob and one without differ by the knob alone)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return module


def build(config: AttentionConfig) -> attnlab.MultiHeadAttention:
    return seeded_(attnlab.MultiHeadAttention(D_MODEL, H, config=config).double().train())


def claimed(config: AttentionConfig, name: str) -> bool:
    """Whether the form of ``config`` or the layer claims ``name`` at its value (the capability declarations)."""
    cls = form_class(form_for(config))
    claims = claims_of(cls)
    allowed = claims.get(name, ())
    return name in claims and (allowed is None or getattr(config, name) in allowed)


def names_knob(message: str, name: str, value: object) -> bool:
    """Whether a refusal names the knob: its field, its command-line key (or the key's stage: ``normalizer`` of
    ``normalizer.params``), its value, or a field the sample requires (``position_bias`` of its parameters)."""
    info = field_info(name)
    cli = info["cli"].split("=")[0]
    words = {name, cli, cli.split(".")[0], str(value), *info["requires"]}
    words |= {"mask", "causal"} if name == "mask" else set()
    return any(w and w in message for w in words)


@functools.cache
def inputs() -> torch.Tensor:
    return torch.randn(B, L, D_MODEL, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def run(
    layer: attnlab.MultiHeadAttention, backend: Backend | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The layer's output on the shared input (through ``backend``, default the one ``auto`` chooses), and the
    gradients of a fixed random loss w.r.t. the input and every parameter."""
    x = inputs().clone().requires_grad_(True)
    out = layer(x)[0] if backend is None else layer.compute(backend, x, None, None).out
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(11), dtype=out.dtype)
    (out * weight).sum().backward()
    grads = {"input": x.grad}
    grads |= {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), grads


_OUTPUTS: dict[str, torch.Tensor | str] = {}


def output_of(config: AttentionConfig) -> torch.Tensor | str:
    """The eager output of a freshly built (seeded) layer of ``config``, or its refusal; computed once per config
    (the configs without a knob are shared by many cells)."""
    key = repr(config)
    if key not in _OUTPUTS:
        layer = try_build(config)
        _OUTPUTS[key] = layer if isinstance(layer, str) else run(layer, build_backend("eager"))[0]
    return _OUTPUTS[key]


def fast_backends(layer: attnlab.MultiHeadAttention) -> list[tuple[Backend, bool]]:
    """The backends but eager that would compute this layer if forced (what building it with ``backend=`` checks:
    its configuration and mask, :meth:`~attnlab.backends.Backend.config_reason` and ``mask_reason``), each with
    whether it runs a float64 training step with gradients here (else: values under no_grad, or not at all)."""
    found = []
    for name in list_backends():
        backend = build_backend(name)
        if name == "eager" or backend.config_reason(layer.spec) or backend.mask_reason(layer.mask_form):
            continue
        when = Conditions("cpu", torch.float64, False, True, True, layer.mask_form)
        if backend.call_reason(layer.spec, when) is None:
            found.append((backend, True))
        elif backend.call_reason(layer.spec, dataclasses.replace(when, grad=False)) is None:
            found.append((backend, False))
    return found


def assert_backends_equal_eager(layer: attnlab.MultiHeadAttention, config: AttentionConfig) -> None:
    """Every backend that computes the layer gives eager's values and gradients (float64)."""
    out, grads = run(layer, build_backend("eager"))
    for backend, with_grad in fast_backends(layer):
        if with_grad:
            got, got_grads = run(layer, backend)
        else:
            with torch.no_grad():
                got, got_grads = layer.compute(backend, inputs(), None, None).out, {}
        where = f"{backend.name}, {config.describe()}"
        torch.testing.assert_close(got, out, atol=1e-8, rtol=1e-7, msg=lambda m, w=where: f"{w}: {m}")
        for key, g in got_grads.items():
            torch.testing.assert_close(
                g, grads[key], atol=1e-7, rtol=1e-6, msg=lambda m, w=where, key=key: f"{w}, grad {key}: {m}"
            )


def try_build(config: AttentionConfig) -> attnlab.MultiHeadAttention | str:
    """The layer, or the refusal's message (which must be one line)."""
    try:
        return build(config)
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message.strip(), f"a refusal of {config.describe()} is more than one line: {message}"
        return message


def check_cell(config: AttentionConfig, without: list[AttentionConfig], knobs: list[tuple[str, object]]) -> str:
    """One cell: refused (one line naming one of its knobs), or equal to eager on every backend and different from
    each of ``without`` (the configs with one knob fewer). Returns what happened (for the count)."""
    layer = try_build(config)
    if isinstance(layer, str):
        assert any(names_knob(layer, n, v) for n, v in knobs), f"{config.describe()}: a refusal naming none: {layer}"
        for name, _ in knobs:
            if claimed(config, name) and f"does not compute {field_info(name)['cli'].split('=')[0]}" in layer:
                pytest.fail(f"{config.describe()}: {name} is claimed but refused as not computed: {layer}")
        return "refused"
    for name, value in knobs:
        assert claimed(config, name), (
            f"{config.describe()}: {name}={value!r} was accepted although neither variant {layer.form.name} nor "
            f"the layer claims it (the capability check let it through)"
        )
    out = output_of(config)
    assert torch.isfinite(out).all(), f"{config.describe()}: eager gives non-finite values"
    if all(field_info(n)["role"] == "what" for n, _ in knobs):
        for base in without:
            ref = output_of(base)
            if isinstance(ref, str):
                continue  # the knob is what makes the other one computable (a requirement)
            assert (out - ref).abs().max() > 1e-6, (
                f"{config.describe()}: {knobs} accepted and changes nothing against {base.describe()}"
            )
    assert_backends_equal_eager(layer, config)
    return "computed"


FORMS = list_forms()


@pytest.fixture(autouse=True)
def one_thread(single_thread):
    """Tiny shapes: one thread is faster (and the C kernels' results do not depend on it)."""


@pytest.mark.parametrize("form", FORMS)
def test_every_knob_on_every_backend_is_computed_or_refused(form):
    """Each single knob, on every backend."""
    base = form_class(form).base_config()
    assert form_for(base) == form, f"{form}.base_config() is computed by {form_for(base)}"
    outcomes = []
    for name, value in knob_samples():
        pair = with_knob(base, name, value)
        if pair is not None:
            outcomes.append(check_cell(pair[1], [pair[0]], [(name, value)]))
    # the layer's own stages compute on every form (a matrix that refuses everything proves nothing)
    assert outcomes.count("computed") >= 8, f"{form}: only {outcomes.count('computed')} knobs computed"


@pytest.mark.parametrize("form", FORMS)
def test_every_pair_of_knobs_is_computed_or_refused(form):
    """Each pair of knobs (the first sample of each field), on every backend: computed, and different from either
    knob alone, or refused in one line naming one of them."""
    base = form_class(form).base_config()
    singles = [(f, field_info(f)["samples"][0]) for f in FIELDS if field_info(f)["role"] == "what"]
    for (f1, s1), (f2, s2) in itertools.combinations(singles, 2):
        one, two = with_knob(base, f1, s1), with_knob(base, f2, s2)
        if one is None or two is None or f2 in field_info(f1)["requires"] or f1 in field_info(f2)["requires"]:
            continue
        try:
            both = one[1].replace(**{k: v for k, v in field_info(f2)["requires"].items()}, **{f2: s2})
        except ValueError:
            continue  # two requirements that contradict
        if both not in (one[1], two[1]):
            check_cell(both, [one[1], two[1]], [(f1, s1), (f2, s2)])


def test_every_field_has_samples_and_a_command_line_name():
    """A new field cannot land without what the matrix needs: its samples (or a role that needs none) and the key
    a refusal names."""
    for f in dataclasses.fields(AttentionConfig):
        info = field_info(f.name)
        assert info["cli"], f.name
        assert info["role"] in ("what", "how", "form"), f.name
        if info["role"] == "what":
            assert info["samples"], f"AttentionConfig.{f.name} has no samples for the combination test"
            for sample in info["samples"]:
                assert sample != field_default(f.name), f"{f.name}: a sample equal to the default tests nothing"


REFUSED = {  # the decisions of docs/variants.md ("What each form computes of the layer's knobs"), pinned
    "softmax": "",
    "linear": "position_bias position_bias_params softcap differential selective",
    "forgetting": "differential",
    "mla": "rope qk_norm num_kv_heads differential short_conv short_conv_residual",
    "mta": "differential",
    **dict.fromkeys(
        ("retnet", "gla", "deltanet", "gated_deltanet", "kda", "deltaproduct", "rwkv7"),
        "position_bias position_bias_params softcap normalizer_params differential selective",
    ),
}


@pytest.mark.parametrize("form", [f for f in FORMS if f in REFUSED])
def test_a_built_in_forms_refusals_are_the_documented_ones(form):
    """What a built-in form refuses is a decision, not an accident: a knob dropped from (or added to) a form's
    declarations fails here until the table above and the docs say so (the matrix alone accepts a refusal)."""
    cls = form_class(form)
    claims = claims_of(cls)
    knobs = [f for f in FIELDS if field_info(f)["role"] == "what"]
    assert sorted(f for f in knobs if f not in claims) == sorted(REFUSED[form].split())


def test_the_check_is_the_capability_mechanism(monkeypatch):
    """Without the capability check (a form claiming every field, as inheritance used to), the matrix fails:
    selective attention on KDA is accepted and changes nothing."""
    from attnlab.forms import base as form_base

    monkeypatch.setattr(form_base, "refuse_unimplemented", lambda *a, **k: None)
    monkeypatch.setattr(attnlab.attention, "refuse_unimplemented", lambda *a, **k: None)
    config = form_class("kda").base_config()
    with pytest.raises(AssertionError, match="neither variant kda nor the layer claims it"):
        check_cell(config.replace(selective=True), [config], [("selective", True)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", FORMS)
def test_every_knob_on_cuda_equals_the_cpu(form):
    """The same matrix on CUDA against the CPU's eager, float64, values and gradients, through the backend
    ``auto`` chooses there."""
    base = form_class(form).base_config()
    for name, value in knob_samples():
        pair = with_knob(base, name, value)
        layer = None if pair is None else try_build(pair[1])
        if layer is None or isinstance(layer, str):
            continue
        out, grads = run(layer, build_backend("eager"))
        gpu = build(pair[1]).cuda()
        gpu.load_state_dict(layer.state_dict())
        x = inputs().cuda().requires_grad_(True)
        got = gpu(x)[0]
        weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(11), dtype=got.dtype)
        (got * weight.cuda()).sum().backward()
        where = pair[1].describe()
        torch.testing.assert_close(got.detach().cpu(), out, atol=1e-8, rtol=1e-7, msg=lambda m, w=where: f"{w}: {m}")
        torch.testing.assert_close(x.grad.cpu(), grads["input"], atol=1e-7, rtol=1e-6)


def test_eager_computes_only_what_it_is_taught():
    """``eager`` is no longer a wildcard that accepts any field: an unclaimed knob is refused with it forced."""
    assert build_backend("eager")  # registered
    config = form_class("kda").base_config().replace(selective=True, backend="eager")
    with pytest.raises(ValueError, match=r"variant kda does not compute attention\.selective=true"):
        build(config)
