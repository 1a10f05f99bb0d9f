"""Backends: what computes a layer's attention, chosen in one place.

Each backend is a registered :class:`Backend` that says whether it can compute a layer
(:meth:`Backend.supports` → None, or the reason it cannot, one line) and computes it
(:meth:`Backend.attend`: the layer's input → its output). :func:`choose_backend` picks, for a layer and the
conditions of a call (device, dtype, weights asked for, training, gradients), the layer's forced backend
(``AttentionConfig.backend``), or else the first of :data:`ORDER` that supports it:

==================  =====================================================================  ======================
backend             computes                                                               when
==================  =====================================================================  ======================
``relative``        attnlab's fused C kernel for one learned relative-position table       CPU, training, f32/64
                    (Shaw, T5) beside a dot-product score (:mod:`attnlab.kernels.relative`)
``biased_softmax``  softmax(scale·q kᵀ + bias) v with a learned bias, in fewer passes than  CPU, gradients on
                    SDPA's math kernel (:class:`~attnlab.backends.sdpa.BiasedSoftmaxAttention`)
``flex``            compiled FlexAttention: dot-product scores, a position bias as a       CUDA: a bias, a cap,
                    score_mod (Shaw, T5, ALiBi), soft-capping, any mask as a cached        other masks; CPU:
                    BlockMask, GQA (:mod:`attnlab.backends.flex`)                          forced, no_grad only
``sdpa``            ``torch.nn.functional.scaled_dot_product_attention``: dot-product       no weights asked for
                    scores, position bias and mask as one float mask, softmax (a sink as
                    one more key), grouped heads through ``enable_gqa``
``chunked``         linear attention (``linear`` score, ``rowsum``/``none``) in chunks, O(L)  causal (+ padding)
                    (:mod:`attnlab.backends.linear`)
``global``          linear attention without a mask: φ(Q) (φ(K)ᵀ V), O(L)                  none, padding
``normalized``      soft-capped softmax (attnlab's C row kernel) or a normalizer's row     CPU, f32/64, no
                    operation (sparsemax, entmax15, softpick), in one autograd function    dropout
                    (:mod:`attnlab.backends.normalized`)
``eager``           every stage in turn, materialising (B, H, Lq, Lk): the reference, and   always
                    what the diagnostics read (it returns the weights)
``recurrent``       linear attention one token at a time (forced only)                     causal (+ padding)
==================  =====================================================================  ======================

The additive score's fused C kernel is the score's own choice inside any backend (``variant.params.kernel``).
A call that asks for the weights (``need_weights=True``, the diagnostics) always runs ``eager``, whatever the
layer's backend. A forced backend that cannot compute the layer's configuration is refused when the layer is built
(one line); one that cannot run under a call's conditions (a CPU kernel on a GPU) raises at that call. A call's dtype
is the one its products compute in (:func:`compute_dtype`): under autocast (``trainer.precision=bf16-mixed``), the
autocast dtype, not the input's float32, so ``auto`` passes over the float32/64-only kernels (``relative``,
``normalized``); :func:`attnlab.training.config.validate_config` refuses a forced one before a run starts.

Register a backend with ``@register_backend("name")`` on a :class:`Backend` subclass; ``position=`` puts it into
the automatic order (before ``eager``, by default), so that ``auto`` chooses it where it applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from attnlab.registry import Registry

if TYPE_CHECKING:
    from attnlab.attention import MultiHeadAttention
    from attnlab.masks import PreparedMask

__all__ = [
    "ORDER",
    "Backend",
    "Conditions",
    "build_backend",
    "check_backend_params",
    "choose_backend",
    "compute_dtype",
    "dtype_reason",
    "list_backends",
    "precision_dtype",
    "register_backend",
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
    def of(
        cls, attn: MultiHeadAttention, x: Tensor, need_weights: bool, mask: PreparedMask | None = None
    ) -> Conditions:
        """The conditions of calling ``attn`` on ``x`` with the prepared ``mask`` now."""
        form = "none" if mask is None else mask.form
        device = x.device.type
        dtype = compute_dtype(x.dtype, device)
        return cls(device, dtype, need_weights, attn.training, torch.is_grad_enabled(), form)


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


class Backend:
    """A way to compute :class:`~attnlab.attention.MultiHeadAttention`'s forward pass.

    Subclasses set ``name`` (by :func:`register_backend`) and implement :meth:`config_reason` (what the layer's
    configuration allows), :meth:`call_reason` (what a call's conditions allow) and :meth:`attend`."""

    name: str = ""
    params: ClassVar[dict[str, Any]] = {}
    """the parameters it takes (``attention.backend_params``), with their defaults."""

    def config_reason(self, attn: MultiHeadAttention) -> str | None:
        """None when this backend can compute ``attn``'s configuration, else why not (one line)."""
        return None

    def call_reason(self, attn: MultiHeadAttention, when: Conditions) -> str | None:
        """None when this backend can compute ``attn`` under ``when``, else why not (one line)."""
        return None

    def check_params(self, params: dict[str, Any]) -> None:
        """Raise ValueError (one line) for a value of ``params`` (``attention.backend_params``) this backend
        cannot take; the names were checked already."""

    def mask_reason(self, form: str, shown: str | None = None) -> str | None:
        """None when this backend computes a mask of this form (:attr:`~attnlab.masks.PreparedMask.form`: ``none``,
        ``causal``, ``padding``, ``causal+padding``, ``other``), else why not (one line, naming the mask as
        ``shown``, default its form). Default: any mask."""
        return None

    def supports(self, attn: MultiHeadAttention, when: Conditions | None = None) -> str | None:
        """None when this backend can compute ``attn`` (under ``when``, default: a CPU float32 training step
        without weights), else the reason."""
        return self.config_reason(attn) or self.call_reason(attn, when or Conditions())

    def attend(
        self, attn: MultiHeadAttention, x: Tensor, key_value: Tensor | None, mask: Any
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, Lq, d_model) → (out (B, Lq, d_model), weights (B, H, Lq, Lk) or None)."""
        raise NotImplementedError

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


def choose_backend(attn: MultiHeadAttention, when: Conditions) -> Backend:
    """The backend that computes ``attn`` under ``when``: ``eager`` when the weights are asked for, the layer's
    forced backend (:class:`RuntimeError` in one line when it cannot run under ``when``), or the first of
    :data:`ORDER` that supports it. What a layer's configuration allows is found once per layer (and again only
    when :data:`ORDER` changes); a call checks only its own conditions."""
    if when.need_weights:
        return build_backend("eager")
    forced = attn.config.backend
    if forced != "auto":
        backend = build_backend(forced)  # (its configuration was checked when the layer was built)
        reason = backend.call_reason(attn, when)
        if reason is not None:
            raise RuntimeError(f"attention.backend={forced} cannot run here: {reason}")
        return backend
    for backend in _candidates(attn):
        if backend.call_reason(attn, when) is None:
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


def _candidates(attn: MultiHeadAttention) -> list[Backend]:
    """The backends of :data:`ORDER` whose :meth:`Backend.config_reason` allows ``attn``, cached on the layer."""
    order = tuple(ORDER)
    cached = attn.__dict__.get("_backend_candidates")
    if cached is None or cached[0] != order:
        allowed = [b for b in map(build_backend, order) if b.config_reason(attn) is None]
        cached = attn.__dict__["_backend_candidates"] = (order, allowed)
    return cached[1]


from attnlab.backends import eager, flex, linear, normalized, relative, sdpa  # noqa: E402, F401  (registration)

# the most specific first
ORDER[:] = ["relative", "biased_softmax", "flex", "sdpa", "chunked", "global", "normalized", "eager"]
