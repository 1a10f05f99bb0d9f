"""The ``eager`` backend: the form's quadratic form, materialising (B, H, Lq, Lk)
(:meth:`~attnlab.forms.Form.parallel`): the reference every other backend is tested against, the one that returns
the weights the diagnostics read, and the one that computes every feature of every form."""

from __future__ import annotations

from typing import Any

from attnlab.backends.base import Backend, LayerSpec, register_backend
from attnlab.forms import FormInputs, FormOutput


@register_backend("eager")
class Eager(Backend):
    """Any configuration, any device: :meth:`~attnlab.forms.Form.parallel`."""

    computes = frozenset({"*"})

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        return spec.form.parallel(inputs, dropout)

    def call_reason(self, layer: Any, when: Any) -> str | None:
        return None
