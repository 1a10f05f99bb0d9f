"""The base of the backends: :class:`Backend`, :class:`LayerSpec`, the features, the registry and the chooser (see
:mod:`attnlab.backends`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from attnlab.config import AttentionConfig
from attnlab.forms import FormInputs, FormOutput
from attnlab.registry import Registry

if TYPE_CHECKING:
    from attnlab.masks import PreparedMask

__all__ = [
    "FEATURE_REASONS",
    "ORDER",
    "Backend",
    "Conditions",
    "LayerSpec",
    "build_backend",
    "check_backend_params",
    "choose_backend",
    "compute_dtype",
    "dtype_reason",
    "list_backends",
    "missing_feature",
    "precision_dtype",
    "register_backend",
    "spec_of",
]


def compute_dtype(dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype that a layer's matrix products compute in for an input of ``dtype`` on ``device``: under autocast
    on that device type, its autocast dtype (``torch.get_autocast_dtype``: bfloat16 for the CPU's, by default) for
    any input but float64 (which autocast leaves as it is), else ``dtype`` itself. What q, k and v of a call are, so
    a backend that computes float32/64 only can refuse a bf16 autocast step before its kernel sees one."""
    kind = torch.device(device).type
    if dtype != torch.float64 and dtype.is_floating_point and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return dtype


@dataclass(frozen=True)
class Conditions:
    """The conditions of one call that decide which backend may compute it."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    """the compute dtype (:func:`compute_dtype`): the autocast dtype under autocast, not the input's."""
    need_weights: bool = False
    training: bool = True
    grad: bool = True
    mask: str = "none"
    """the call's mask as :attr:`~attnlab.masks.PreparedMask.form` gives it (``none`` when there is none)."""

    @classmethod
    def of(cls, x: Tensor, need_weights: bool, mask: PreparedMask | None = None, training: bool = True) -> Conditions:
        """The conditions of calling a layer (in ``training`` mode or not) on ``x`` with the prepared ``mask``
        now."""
        form = "none" if mask is None else mask.form
        device = x.device.type
        dtype = compute_dtype(x.dtype, device)
        return cls(device, dtype, need_weights, training, torch.is_grad_enabled(), form)


FLOAT32_64 = (torch.float32, torch.float64)
"""The dtypes attnlab's C kernels compute (:data:`attnlab.kernels.build.DTYPES`)."""


def dtype_reason(when: Conditions, dtypes: tuple[torch.dtype, ...] = FLOAT32_64) -> str | None:
    """None when the call's compute dtype (:attr:`Conditions.dtype`, the autocast dtype under autocast) is one of
    ``dtypes``, else the one line a backend's :meth:`Backend.call_reason` gives for it."""
    if when.dtype in dtypes:
        return None
    names = [str(d).removeprefix("torch.") for d in dtypes]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"it computes {listed}, not {when.dtype}"


FEATURE_REASONS: dict[str, str] = {
    "score:dot": "it computes dot-product scores only, not {score}",
    "value_term": "it has no value-side term (Shaw's value_term)",
    "position_bias": "it has no position bias",
    "softcap": "it has no soft-capping",
    "differential": "it has no differential attention",
    "selective": "it has no selective attention (attention.selective)",
    "forgetting": "it has no forgetting attention (the forget gates' bias)",
}
"""The one line a backend gives for a feature of a layer it does not compute (:func:`missing_feature`); a feature
not listed here (``score:<class>``, a new form's ``form:<name>``) reads ``it does not compute <feature>``. (A config
field that nothing computes never reaches a backend: the layer refuses it when it is built,
:func:`attnlab.forms.base.refuse_unimplemented`.)"""

FEATURE_ORDER = ("form:", "score:", "value_term", "position_bias", "softcap", "differential")


def missing_feature(features: frozenset[str], computes: frozenset[str], score: str = "") -> str | None:
    """The reason (one line) a backend that computes ``computes`` refuses a layer that needs ``features``: the
    first feature it lacks (forms first, then the score, then the stages), or None when it computes them all.
    ``*`` in ``computes`` computes everything (``eager``)."""
    if "*" in computes:
        return None
    lacking = features - computes
    if not lacking:
        return None

    def rank(feature: str) -> tuple[int, str]:
        at = next((i for i, p in enumerate(FEATURE_ORDER) if feature.startswith(p)), len(FEATURE_ORDER))
        return at, feature

    first = min(lacking, key=rank)
    if first.startswith("score:") and "score:dot" in computes:
        first = "score:dot"
    if first.startswith("form:"):
        return f"it has no form {first.removeprefix('form:')} (variant {score})"
    return FEATURE_REASONS.get(first, f"it does not compute {first}").format(score=score)


@dataclass(frozen=True, eq=False)
class LayerSpec:
    """What a backend computes a layer from, besides its inputs: a frozen record of the layer, built once per layer
    (:attr:`~attnlab.attention.MultiHeadAttention.spec`).

    ``features`` are what it needs computed (:meth:`~attnlab.forms.Form.features`); ``form`` is the layer's form
    (its stages: a backend reads the softmax form's score, position bias and normalizer), ``config`` the resolved
    config."""

    form: Any
    config: AttentionConfig
    features: frozenset[str]
    num_heads: int
    num_kv_heads: int
    d_k: int
    d_v: int
    dropout: float

    @property
    def query_heads(self) -> int:
        return self.form.query_heads

    @property
    def key_heads(self) -> int:
        return self.form.key_heads

    @property
    def forced(self) -> bool:
        """Whether the layer forces a backend (``config.backend`` is not ``auto``)."""
        return self.config.backend != "auto"


def spec_of(layer: Any) -> LayerSpec:
    """The :class:`LayerSpec` of a layer (or a spec, as it is)."""
    return layer if isinstance(layer, LayerSpec) else layer.spec


class Backend:
    """A way to compute the z of a layer's form from its prepared inputs.

    Subclasses set ``name`` (by :func:`register_backend`) and ``computes``, the features they compute (opt-in: a
    layer that needs any other is refused, :func:`missing_feature`), and implement :meth:`compute`; they refine
    :meth:`config_reason` (what the layer's configuration allows beyond its features: which normalizers ...),
    :meth:`call_reason` (what a call's conditions allow) and :meth:`mask_reason`."""

    name: str = ""
    params: ClassVar[dict[str, Any]] = {}
    """the parameters it takes (``attention.backend_params``), with their defaults."""
    computes: ClassVar[frozenset[str]] = frozenset()
    """the features it computes (``*``: all)."""

    def config_reason(self, layer: Any) -> str | None:
        """None when this backend can compute the layer's configuration (a :class:`LayerSpec`, or the layer), else
        why not (one line). Default: the features it lacks."""
        spec = spec_of(layer)
        if "*" not in self.computes and any(f.startswith("form:") and f not in self.computes for f in spec.features):
            return self.form_reason(spec)
        return missing_feature(spec.features, self.computes, spec.config.score)

    def form_reason(self, spec: LayerSpec) -> str:
        """Why this backend does not compute the layer's form (one line)."""
        return missing_feature(spec.features, self.computes, spec.config.score) or ""

    def call_reason(self, layer: Any, when: Conditions) -> str | None:
        """None when this backend can compute the layer under ``when``, else why not (one line)."""
        return None

    def check_params(self, params: dict[str, Any]) -> None:
        """Raise ValueError (one line) for a value of ``params`` (``attention.backend_params``) this backend
        cannot take; the names were checked already."""

    def mask_reason(self, form: str, shown: str | None = None) -> str | None:
        """None when this backend computes a mask of this form (:attr:`~attnlab.masks.PreparedMask.form`: ``none``,
        ``causal``, ``padding``, ``causal+padding``, ``other``), else why not (one line, naming the mask as
        ``shown``, default its form). Default: any mask."""
        return None

    def supports(self, layer: Any, when: Conditions | None = None) -> str | None:
        """None when this backend can compute the layer (under ``when``, default: a CPU float32 training step
        without weights), else the reason."""
        return self.config_reason(layer) or self.call_reason(layer, when or Conditions())

    def compute(self, spec: LayerSpec, inputs: FormInputs, dropout: float) -> FormOutput:
        """The form's z from its prepared inputs (:meth:`~attnlab.forms.Form.prepare`); ``dropout``: the
        probability of dropping an attention weight in this call (0 outside training)."""
        raise NotImplementedError

    def attend(self, layer: Any, x: Tensor, key_value: Tensor | None, mask: Any) -> tuple[Tensor, Tensor | None]:
        """The whole layer through this backend: x (B, Lq, d_model) → (out (B, Lq, d_model), weights or None)."""
        o = layer.compute(self, x, key_value, mask)
        return o.out, o.weights

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _wrap(name: str, obj: Any, kwargs: dict[str, Any]) -> Backend:
    backend = obj(**kwargs) if isinstance(obj, type) else obj
    backend.name = name
    return backend


_BACKENDS: Registry[Backend] = Registry("backend", _wrap)
_INSTANCES: dict[str, Backend] = {}
ORDER: list[str] = []
"""The automatic order: ``auto`` takes the first backend here that supports a layer and a call."""


def register_backend(name: str, position: int | None = None, auto: bool = True) -> Callable[[Any], Any]:
    """Decorator registering a :class:`Backend` subclass as ``name``, at ``position`` of :data:`ORDER` (default:
    just before ``eager``, the one that always applies); ``auto=False`` keeps it out of the automatic order (it
    then runs only when forced: ``recurrent``)."""
    register = _BACKENDS.register(name)

    def decorator(cls: Any) -> Any:
        register(cls)
        if auto and name not in ORDER:
            at = position if position is not None else (ORDER.index("eager") if "eager" in ORDER else len(ORDER))
            ORDER.insert(at, name)
        return cls

    return decorator


def build_backend(name: str) -> Backend:
    """The backend registered as ``name`` (one shared instance)."""
    if name not in _INSTANCES:
        _INSTANCES[name] = _BACKENDS.build(name)
    return _INSTANCES[name]


def list_backends() -> list[str]:
    """The registered backends: the automatic order, then those that run only when forced."""
    return [*ORDER, *(n for n in _BACKENDS.names() if n not in ORDER)]


def check_backend_params(params: dict[str, Any], backend: str = "auto") -> None:
    """One line for a parameter that no registered backend takes (``backend``: ``auto``), or that the forced
    ``backend`` does not take."""
    names = list_backends() if backend == "auto" else [backend]
    takes = {p for n in names for p in build_backend(n).params}
    for key in params:
        if key not in takes:
            allowed = ", ".join(f"{p} ({n})" for n in names for p in build_backend(n).params) or "(none)"
            raise ValueError(
                f"attention.backend_params: no backend {'' if backend == 'auto' else backend + ' '}"
                f"takes '{key}'; allowed: {allowed}"
            )
    for name in names:
        backend_obj = build_backend(name)
        backend_obj.check_params({k: v for k, v in params.items() if k in backend_obj.params})


def choose_backend(spec: LayerSpec, when: Conditions) -> Backend:
    """The backend that computes the layer of frozen record ``spec`` (:attr:`~attnlab.attention.MultiHeadAttention.
    spec`) under ``when``: ``eager`` when the weights are asked for, the layer's forced backend
    (:class:`RuntimeError` in one line when it cannot run under ``when``), or the first of :data:`ORDER` that
    supports it. What a layer's configuration allows is found once per record (and again only when :data:`ORDER`
    changes); a call checks only its own conditions."""
    spec = spec_of(spec)
    if when.need_weights:
        return build_backend("eager")
    forced = spec.config.backend
    if forced != "auto":
        backend = build_backend(forced)  # (its configuration was checked when the layer was built)
        reason = backend.call_reason(spec, when)
        if reason is not None:
            raise RuntimeError(f"attention.backend={forced} cannot run here: {reason}")
        return backend
    for backend in _candidates(spec):
        if backend.call_reason(spec, when) is None:
            return backend
    raise RuntimeError("no attention backend supports this layer")  # pragma: no cover - eager always does


PRECISION_DTYPES: dict[str, torch.dtype] = {
    "64": torch.float64,
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "16": torch.float16,
}
"""A Lightning ``trainer.precision``'s leading part → the dtype its training step computes attention in (``-mixed``
through autocast, ``-true`` by casting the model)."""


def precision_dtype(precision: str | int) -> torch.dtype:
    """The compute dtype of a training step under Lightning's ``trainer.precision`` (``bf16-mixed``, ``32-true``,
    ``64``, ``16-mixed`` ...): bfloat16, float32, float64 or float16."""
    return PRECISION_DTYPES[str(precision).split("-")[0]]


def _candidates(spec: LayerSpec) -> list[Backend]:
    """The backends of :data:`ORDER` whose :meth:`Backend.config_reason` allows the layer of ``spec``, cached on
    the record (a layer makes a new one when its form or dropout changes)."""
    order = tuple(ORDER)
    cached = spec.__dict__.get("_candidates")
    if cached is None or cached[0] != order:
        allowed = [b for b in map(build_backend, order) if b.config_reason(spec) is None]
        cached = (order, allowed)
        object.__setattr__(spec, "_candidates", cached)
    return cached[1]
