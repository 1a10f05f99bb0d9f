"""Forms: what a token mixer computes from the layer's projected inputs, one registered class per family.

:class:`~attnlab.attention.MultiHeadAttention` is the same pipeline for every family::

    out = out_proj( head_gate · form.output( backend(form.prepare(project(x))) ) )

* ``project`` (the layer's): q, k, v (H query heads, G key/value heads), the short convolution, QK-norm, rope.
* ``form.prepare``: the form's own inputs from q, k, v and x (a transition form's gates, β), the mask checked and
  shaped for its heads, the padded keys hidden: a :class:`FormInputs`.
* a **backend** (:mod:`attnlab.backends`) computes z from those inputs: ``eager`` through :meth:`Form.parallel`
  (the quadratic form, always there, the reference and what the diagnostics read), the O(L) backends through
  :meth:`Form.chunked` / :meth:`Form.recurrent`, the fused softmax backends from the softmax form's stages. What a
  backend computes is opt-in: :meth:`Form.features` names what the layer needs and a backend that does not declare
  every one of them refuses, in one line (:func:`attnlab.backends.missing_feature`).
* ``form.output``: the per-head output transform (a transition form's output norm, differential attention's
  sub-norm), then the layer's head gate and ``out_proj``.
* decoding: :meth:`Form.step`, one token with the form's state (:meth:`Form.state_size` floats per sequence).

The registered forms are :func:`list_forms` (registration order; :func:`form_names_with` by tag, :func:`form_settings`
with their named settings), one module of this package each family: ``softmax`` (every score and normalizer,
:mod:`attnlab.forms.softmax`), ``linear`` (feature-map attention), the decay and delta-rule forms of
:mod:`attnlab.forms.transitions` and their neighbours (one transition record each, :mod:`attnlab.transition`), and
the softmax forms with a memory of order or their own projections. What each computes, its tags, O(L) path and
decoding state is the table of docs/variants.md#forms, generated from this registry when the site is built, so no
list is kept here by hand.

A layer's form is chosen by its :class:`~attnlab.config.AttentionConfig` (:func:`form_for`): the form that
:meth:`Form.claims` the config, newest registration first (a decay or delta-rule form claims ``score=<its name>``,
which is what ``variant=<name>`` sets), else ``softmax``. Register your own with ``@register_form("name")`` on a
:class:`Form` subclass, in a module named by ``imports=[...]``: it is then ``variant=custom variant.name=<name>``
(a built-in form in this package adds its ``conf/variant/<name>.yaml`` and is ``variant=<name>``), tested by the suite's
registry-driven tests, benched and listed (its ``tags``).
"""

from attnlab.forms.base import (  # noqa: F401  (for code that reads them here)
    _FORMS,
    _ORDER,
    Form,
    FormInputs,
    FormOutput,
    FormSetting,
    LayerOptionError,
    LayerSizes,
    build_form,
    expand_heads,
    form_class,
    form_for,
    form_names_with,
    form_output,
    form_settings,
    list_forms,
    register_form,
)

__all__ = [
    "Form",
    "FormInputs",
    "FormOutput",
    "FormSetting",
    "LayerOptionError",
    "LayerSizes",
    "build_form",
    "expand_heads",
    "form_class",
    "form_for",
    "form_names_with",
    "form_output",
    "form_settings",
    "list_forms",
    "register_form",
]


def _register_builtins() -> None:
    """Import every module of this package (each registers its forms): a built-in form is one file here, with no
    edit anywhere else. ``softmax`` first (``linear`` builds on it), the rest in name order."""
    import importlib
    import pkgutil

    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base")
    for name in sorted(names, key=lambda n: (n != "softmax", n != "linear", n != "transitions", n)):
        importlib.import_module(f"{__name__}.{name}")


_register_builtins()
