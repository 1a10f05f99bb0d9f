"""The ``chunked``, ``recurrent`` and ``global`` backends: the O(L) forms of linear attention and of the decay and
delta-rule forms (:mod:`attnlab.forms.linear`, :mod:`attnlab.forms.transitions`), all one transition record
(:mod:`attnlab.transition`):

============  ===================================================================================  ================
backend       computes                                                                             masks
============  ===================================================================================  ================
``recurrent`` one token at a time (:meth:`~attnlab.forms.Form.recurrent`): the reference of the     causal
              chunked form, and the form that decodes; forced only (a Python loop over L)
``chunked``   chunks of ``chunk_size`` tokens (``attention.backend_params.chunk_size``, default 64):  causal
              within a chunk the masked quadratic form, across chunks the state; O(L·C) memory, no
              (L, L) tensor (:meth:`~attnlab.forms.Form.chunked`)
``global``    linear attention with every key visible: φ(Q) (φ(K)ᵀ V) once, normaliser φ(Q) Σ_j φ(k_j)  none, padding
============  ===================================================================================  ================

Key padding (``padding``, ``causal+padding``) hides a key by zeroing its features (its k), which is exactly what the
masked quadratic form computes. Any other mask is refused in one line (``auto`` then chooses ``eager``). Attention
dropout on the weights has no O(L) form: a layer with ``dropout > 0`` trains on ``eager``. In half precision (or
under autocast) the sums run in float32. Linear attention's chunked backward pass is written by hand
(:class:`attnlab.transition._CausalLinear`), so it has no second derivative (``create_graph=True``): use ``eager``
or ``recurrent`` for that.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from attnlab.backends.base import Backend, Conditions, LayerSpec, register_backend, spec_of
from attnlab.checks import check_int
from attnlab.compat import forward
from attnlab.forms import FormInputs, FormOutput
from attnlab.forms.linear import LinearForm

__all__ = ["linear_reason"]

# the functions of linear attention that lived here before 0.7 (linear_attention_global, recurrent_step, ...) read
# through attnlab.compat's table, each with a DeprecationWarning
__getattr__ = forward(__name__)


def linear_reason(layer: Any) -> str | None:
    """None when the layer is linear attention that the O(L) backends compute, else the first stage that is not
    (one line: :meth:`LinearForm.reason`)."""
    return LinearForm.reason(spec_of(layer).config)


# ---------------------------------------------------------------------------------------------- the backends


class _Linear(Backend):
    """Shared by the three: the mask check, the float32 sums and the form's O(L) path."""

    forms: tuple[str, ...] = ()
    computes = frozenset({"form:linear", "form:recurrent"})

    def form_reason(self, spec: LayerSpec) -> str:
        if "form:recurrent" not in self.computes and "form:recurrent" in spec.features:
            return f"it has no form for variant {spec.config.score} (causal only)"
        return linear_reason(spec) or super().form_reason(spec)

    def mask_reason(self, form: str, shown: str | None = None) -> str | None:
        if form in self.forms:
            return None
        return f"it computes mask={' or '.join(self.forms)} only, not {shown or form}"

    def call_reason(self, layer: Any, when: Conditions) -> str | None:
        if when.training and spec_of(layer).dropout > 0:
            return "it has no dropout on the weights (model.dropout > 0 trains on eager)"
        return self.mask_reason(when.mask)

    def run(self, spec: LayerSpec, inputs: FormInputs) -> Tensor:
        raise NotImplementedError

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        form = "none" if inputs.mask is None else inputs.mask.form
        if isinstance(spec.form, LinearForm):  # (a transition form checked its mask when it prepared it)
            reason = self.mask_reason(form)
            if reason is not None:
                raise ValueError(f"attention backend {self.name}: {reason}; use backend=eager (or auto) for this mask")
        v = inputs.v
        device = v.device.type
        if v.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(device):
            # the running sums in float32, as the softmax normalizes half-precision logits in float32
            with torch.autocast(device, enabled=False):
                z = self.run(spec, inputs.float())
        else:
            z = self.run(spec, inputs)  # (B, H, Lq, d_v)
        return FormOutput(z.to(v.dtype))


@register_backend("chunked")
class Chunked(_Linear):
    """The forms in chunks (:meth:`~attnlab.forms.Form.chunked`)."""

    forms = ("causal", "causal+padding")
    params: ClassVar[dict[str, Any]] = {"chunk_size": 64}

    def check_params(self, params: dict[str, Any]) -> None:
        if "chunk_size" in params:
            check_int("attention.backend_params.chunk_size", params["chunk_size"], minimum=1)

    def chunk_size(self, spec: LayerSpec) -> int:
        return int(spec.config.backend_params.get("chunk_size", self.params["chunk_size"]))

    def run(self, spec: LayerSpec, inputs: FormInputs) -> Tensor:
        return spec.form.chunked(inputs, self.chunk_size(spec))


@register_backend("global")
class Global(_Linear):
    """Linear attention with every key visible, or key padding only (:meth:`LinearForm.bidirectional`)."""

    forms = ("none", "padding")
    computes = frozenset({"form:linear"})

    def run(self, spec: LayerSpec, inputs: FormInputs) -> Tensor:
        return spec.form.bidirectional(inputs)


@register_backend("recurrent", auto=False)
class Recurrent(_Linear):
    """The forms one token at a time (:meth:`~attnlab.forms.Form.recurrent`): forced only."""

    forms = ("causal", "causal+padding")

    def run(self, spec: LayerSpec, inputs: FormInputs) -> Tensor:
        return spec.form.recurrent(inputs)
