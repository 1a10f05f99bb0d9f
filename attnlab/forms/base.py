"""The base of the forms: :class:`Form`, its inputs and outputs, and the registry (see :mod:`attnlab.forms`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from attnlab.registry import Registry, UnknownNameError, unknown_name_message

if TYPE_CHECKING:
    from attnlab.config import AttentionConfig
    from attnlab.masks import PreparedMask
    from attnlab.transition import Transition

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
    "knobs",
    "list_forms",
    "refuse_unimplemented",
    "register_form",
]


def knobs(fields: Mapping[str, Any] | None = None, /, **more: Any) -> Mapping[str, Any]:
    """A read-only mapping for :attr:`Form.implements` (field → the values computed, None for any) or
    :attr:`Form.refusals` (field → why not): a subclass building on its parent's cannot change the parent's."""
    return MappingProxyType({**(fields or {}), **more})


_UNDECLARED = knobs()  # what a form class that declares no ``implements`` of its own gets


class LayerOptionError(ValueError):
    """A layer option (``qk_norm``, ``model.short_conv`` …, not one of the form's own ``variant.params``) that a form
    does not take: one line, which a run's config check reports as it is."""


def expand_heads(t: Tensor, heads: int) -> Tensor:
    """(B, G', L, d) → (B, heads, L, d): each key/value head repeated for the query heads of its group."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


@dataclass(frozen=True)
class LayerSizes:
    """The sizes a form is built for: H query heads, G key/value heads, per-head d_k and d_v, the layer's d_model,
    its depth (1, 2, …), attention dropout, and whether the layer's projections have biases (a form that projects
    its own inputs follows it)."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    d_k: int
    d_v: int
    layer: int = 1
    dropout: float = 0.0
    bias: bool = True


@dataclass(frozen=True)
class FormInputs:
    """What a backend computes z from: q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k), v (B, Gv, Lk, d_v) as the form
    prepared them (a transition form's: H heads each, its maps applied, padded keys zeroed), the prepared mask,
    and a transition form's :class:`~attnlab.transition.Transition` (decay, β)."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: PreparedMask | None = None
    transition: Transition | None = None

    def float(self) -> FormInputs:
        """The inputs in float32, the transition record's tensors too (every field kept)."""

        record = self.transition
        if record is not None:
            record = replace(
                record,
                log_decay=None if record.log_decay is None else record.log_decay.float(),
                beta=None if record.beta is None else record.beta.float(),
                low_rank=None if record.low_rank is None else tuple(t.float() for t in record.low_rank),
            )
        return FormInputs(self.q.float(), self.k.float(), self.v.float(), self.mask, record)


@dataclass(frozen=True)
class FormOutput:
    """z (B, H, Lq, d_v), or (B, Hq, Lq, d_v) with both maps of differential attention; ``z2``: the second map's
    output when a backend computed the maps apart (z then holds the first's); ``weights`` (B, H, Lq, Lk) and
    ``logits`` (B, Hq, Lq, Lk) from :meth:`Form.parallel`, else None."""

    z: Tensor
    weights: Tensor | None = None
    logits: Tensor | None = None
    z2: Tensor | None = None


class Form(nn.Module):
    """A token mixer's computation from the layer's projected q, k, v (module docstring).

    Subclasses set ``tags`` and implement :meth:`prepare`, :meth:`parallel`, :meth:`features`, and where they have
    them :meth:`chunked`, :meth:`recurrent` and :meth:`step`. Built by :func:`build_form` with the layer's
    :class:`LayerSizes` and its resolved :class:`~attnlab.config.AttentionConfig`."""

    name: str = ""
    tags: ClassVar[frozenset[str]] = frozenset()
    """what the family is: ``softmax``, ``linear``, ``decay``, ``delta``; ``recurrent`` when it has an O(L) form
    and a fixed-size state. Tests, bench, card and docs take their families from these."""
    causal_only: ClassVar[bool] = False
    """whether it computes causal self-attention only (a state that runs over the sequence in order)."""
    settings: ClassVar[dict[str, dict[str, Any]]] = {}
    """named settings of the form's parameters (``variant.params``) that the tests, the bench and the card cover
    beside its defaults, e.g. ``{"channel": {"gate": "channel"}}`` on ``gla``: each is the row
    ``<form>_<setting>`` (:func:`form_settings`)."""
    projects: ClassVar[bool] = False
    """whether the form projects its own q, k, v from x (:meth:`project`: multi-head latent attention's latent);
    then the layer has no ``q_proj``, ``k_proj``, ``v_proj``, short convolution, QK-norm or rotary positions of its
    own."""
    implements: ClassVar[Mapping[str, tuple[Any, ...] | None]] = _UNDECLARED
    """The :class:`~attnlab.config.AttentionConfig` fields this form computes, beyond the layer's own stages
    (:data:`attnlab.stages.LAYER_STAGES`): field → the values it computes (None: every value the field takes).
    A field set away from its default that neither this form nor the layer claims is refused when the layer is
    built, in one line (:func:`refuse_unimplemented`), whatever the backend. ``score`` and ``score_params`` are
    always the form's (its name and parameters, which its constructor checks). **Not inherited**: a subclass that
    declares none computes none of them (``implements = Parent.implements`` keeps a parent's), so a form whose
    own code drops a knob never claims it by accident."""
    layer_kind: ClassVar[str | None] = None
    """A letter that ``model.pattern`` may name for a layer of this form at its defaults (``M``: multi-head latent
    attention, Kimi Linear's ``variant=kda model.pattern=GGGM``); :func:`attnlab.config.default_layer_kinds`
    reads it."""
    refusals: ClassVar[Mapping[str, str]] = knobs()
    """Why this form does not compute a field (field → a clause), for the refusal's one line (inherited)."""
    computed_as: ClassVar[str | None] = None
    """The form whose fast backends compute this one from its stages (``softmax``: ``sdpa``, ``tiled`` … compute
    the softmax form's score, bias, cap and normalizer and never call :meth:`parallel`): :meth:`features` is then
    ``form:<computed_as>``, else ``form:<name>`` (``eager`` only, until a backend declares it). **Not inherited**:
    a subclass of the softmax form that computes plain softmax (MLA's scores) says so; one that does not
    (MTA's convolutions) is not computed as plain softmax by accident."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, empty in (("implements", _UNDECLARED), ("computed_as", None)):
            if attr not in cls.__dict__:
                setattr(cls, attr, empty)

    def __init__(self, sizes: LayerSizes, config: AttentionConfig) -> None:
        super().__init__()
        self.sizes = sizes
        self.config = config
        self.num_heads, self.d_k, self.d_v = sizes.num_heads, sizes.d_k, sizes.d_v

    @classmethod
    def base_config(cls) -> AttentionConfig:
        """The plainest config this form computes, on which the combination test sets each knob: ``score`` = its
        name, the first normalizer it computes where it computes only some (:attr:`implements`), ``mask=causal``
        for a causal-only form."""
        from attnlab.config import AttentionConfig

        normalizers = cls.implements.get("normalizer", ())
        normalizer = normalizers[0] if normalizers else "softmax"
        return AttentionConfig(score=cls.name, normalizer=normalizer, mask="causal" if cls.causal_only else None)

    @classmethod
    def claims(cls, config: AttentionConfig) -> bool:
        """Whether this form computes ``config`` (default: ``config.score`` is the form's name)."""
        return config.score == cls.name

    # ---------------------------------------------------------------------------------------------- projection

    @classmethod
    def query_maps(cls, config: AttentionConfig) -> int:
        """How many query and key heads the layer projects per head (differential attention's 2; default 1)."""
        return 1

    @classmethod
    def key_maps(cls, config: AttentionConfig) -> int:
        """How many key heads the layer projects per key/value head (default :meth:`query_maps`; DeltaProduct's n
        keys per token)."""
        return cls.query_maps(config)

    @classmethod
    def value_maps(cls, config: AttentionConfig) -> int:
        """How many value heads the layer projects per key/value head (default 1; DeltaProduct's n values per
        token)."""
        return 1

    @property
    def query_heads(self) -> int:
        """Hq, the query heads the layer projects (2H for differential attention)."""
        return self.num_heads

    @property
    def key_heads(self) -> int:
        """Gk, the key heads the layer projects (:meth:`key_maps` per key/value head)."""
        return type(self).key_maps(self.config) * self.sizes.num_kv_heads

    def project(
        self, x: Tensor, key_value: Tensor, offset: int = 0, decoding: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """A form that :attr:`projects`: x (B, Lq, d_model), key_value (B, Lk, d_model) (x itself for
        self-attention), ``offset`` (the tokens before these) → q (B, Hq, Lq, ·), k (B, Gk, Lk, ·), v (B, Gv, Lk,
        d_v), which :meth:`prepare` and the backends take as the layer's; ``decoding``: what :meth:`step` takes
        instead (the form's own decoding inputs)."""
        raise NotImplementedError(f"form {self.name} does not project its own inputs")

    def check_mask(self, form: str, shown: str) -> None:
        """Raise ValueError (one line) when the layer's configured mask (``form``: none, causal, padding,
        causal+padding, other; ``shown`` as the user wrote it) is one this form cannot compute."""
        if self.causal_only and form not in ("causal", "causal+padding"):
            raise ValueError(
                f"variant {self.name} is causal only (its state runs over the sequence in order): set mask=causal "
                f"(AND key padding at most), not mask={shown}"
            )

    def prepare(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, mask: PreparedMask | None) -> FormInputs:
        """The layer's q (B, Hq, Lq, d_k), k (B, Gk, Lk, d_k), v (B, Gv, Lk, d_v), its input x (B, Lq, d_model)
        and the prepared mask → this form's inputs. Default: as they are."""
        return FormInputs(q, k, v, mask)

    def features(self) -> frozenset[str]:
        """What a backend must compute for this layer (:func:`attnlab.backends.missing_feature`): ``form:recurrent``
        for a form with an O(L) form (tag ``recurrent``: the ``chunked`` and ``recurrent`` backends call its
        :meth:`chunked` and :meth:`recurrent`), else ``form:<computed_as>`` (:attr:`computed_as`) or
        ``form:<name>`` (``eager`` only, until a backend declares it)."""
        if "recurrent" in self.tags:
            return frozenset({"form:recurrent"})
        return frozenset({f"form:{self.computed_as or self.name}"})

    # ---------------------------------------------------------------------------------------------- the forms

    def parallel(self, inputs: FormInputs, dropout: float = 0.0) -> FormOutput:
        """The quadratic form, materialising (B, H, Lq, Lk): z, the weights the diagnostics read and the logits.
        ``dropout``: the probability of dropping a weight (training)."""
        raise NotImplementedError

    def chunked(self, inputs: FormInputs, chunk_size: int) -> Tensor:
        """The O(L) form in chunks of ``chunk_size`` tokens → z (B, H, L, d_v); forms without one do not offer it
        (:attr:`tags` lacks ``recurrent``)."""
        raise NotImplementedError(f"form {self.name} has no chunked form")

    def recurrent(self, inputs: FormInputs) -> Tensor:
        """The form one token at a time → z (B, H, L, d_v): the reference of :meth:`chunked`."""
        raise NotImplementedError(f"form {self.name} has no recurrent form")

    def weights_signed(self) -> bool:
        """Whether the weights :meth:`parallel` gives may be negative (differential attention, the delta rule,
        MTA's head mixing): the diagnostics then score no entropy or saturation for them."""
        return False

    # ---------------------------------------------------------------------------------------------- after

    def output(self, out: FormOutput, inputs: FormInputs | None = None) -> Tensor:
        """z → each head's output before the head gate and ``out_proj`` (B, H, Lq, d_v). Default: z. ``inputs``:
        what a backend computed z from (None when decoding: a form whose output transform reads its inputs, like
        RWKV-7's bonus, applies it in :meth:`step`). An override may take ``out`` alone, as before 0.9
        (:func:`form_output` passes the inputs only to one that takes them)."""
        return out.z

    # ---------------------------------------------------------------------------------------------- decoding

    def decode_reason(self) -> str | None:
        """None when :meth:`step` decodes this layer one token at a time, else why not (one line)."""
        return None

    def step(self, state: Any, q: Tensor, k: Tensor, v: Tensor, x: Tensor, position: int) -> tuple[Tensor, Any]:
        """One token: the state (None at the start), q (B, Hq, 1, d_k), k (B, Gk, 1, d_k), v (B, G, 1, d_v) after
        the layer's projection and transforms, x (B, 1, d_model), the token's position → (z (B, H, 1, d_v), the
        new state)."""
        raise NotImplementedError(f"form {self.name} has no token-by-token form")

    def state_size(self, length: int) -> int:
        """Floats per sequence that decoding carries after ``length`` tokens (without the short convolution's)."""
        raise NotImplementedError(f"form {self.name} does not say its state size (Form.state_size)")

    def prefill(
        self, batch: int, length: int, generator: torch.Generator, device: torch.device, dtype: torch.dtype
    ) -> Any:
        """A decoding state as if ``length`` tokens had been decoded, random but scaled like a real one (the
        bench's decode section times the tokens after it)."""
        raise NotImplementedError(f"form {self.name} has no token-by-token form")


def form_output(form: Form, out: FormOutput, inputs: FormInputs | None = None) -> Tensor:
    """``form.output(out, inputs)``, or ``form.output(out)`` for a form whose override takes no ``inputs`` (a
    user's form written for ``output(out)``)."""
    return form.output(out, inputs) if _output_takes_inputs(type(form)) else form.output(out)


@functools.cache
def _output_takes_inputs(cls: type[Form]) -> bool:
    return "inputs" in inspect.signature(cls.output).parameters


# ---------------------------------------------------------------------------------------------- the registry


def _wrap(name: str, obj: Any, kwargs: dict[str, Any]) -> Form:
    sizes, config = kwargs.pop("sizes"), kwargs.pop("config")
    return obj(sizes, config, **kwargs)


_FORMS: Registry[Form] = Registry("form", _wrap)
_ORDER: list[str] = []


def register_form(name: str) -> Callable[[type[Form]], type[Form]]:
    """Decorator registering a :class:`Form` subclass as ``name`` (its ``name`` attribute is set)."""
    register = _FORMS.register(name)

    def decorator(cls: type[Form]) -> type[Form]:
        if not (isinstance(cls, type) and issubclass(cls, Form)):
            raise TypeError(f"register_form('{name}') takes a Form subclass, got {cls!r}")
        cls.name = name
        register(cls)
        if name not in _ORDER:
            _ORDER.append(name)
        return cls

    return decorator


def list_forms() -> list[str]:
    """The registered forms, in registration order."""
    return list(_ORDER)


def form_class(name: str) -> type[Form]:
    """The class registered as ``name`` (:class:`~attnlab.registry.UnknownNameError` naming the choices)."""
    if name not in _FORMS:
        raise UnknownNameError(unknown_name_message("form", name, list_forms()))
    return _FORMS.get(name)


def form_names_with(tag: str) -> list[str]:
    """The registered forms whose :attr:`Form.tags` hold ``tag`` (``recurrent``, ``decay``, ``softmax`` …)."""
    return [n for n in list_forms() if tag in form_class(n).tags]


@dataclass(frozen=True)
class FormSetting:
    """One row of the tests, the bench and the card: ``label`` (the form's name, or ``<form>_<setting>``), the
    ``form`` and its ``params`` (``variant.params``: {} for its defaults)."""

    label: str
    form: str
    params: dict[str, Any]


def form_settings(tag: str | None = None) -> list[FormSetting]:
    """Every registered form (those whose tags hold ``tag``, when given) at its defaults, each followed by its named
    :attr:`Form.settings`, in registration order."""
    rows = []
    for name in form_names_with(tag) if tag is not None else list_forms():
        rows.append(FormSetting(name, name, {}))
        rows += [FormSetting(f"{name}_{key}", name, dict(p)) for key, p in form_class(name).settings.items()]
    return rows


def form_for(config: AttentionConfig) -> str:
    """The form that computes ``config``: the newest registered form that :meth:`Form.claims` it, else
    ``softmax``."""
    for name in reversed(list_forms()):
        if name != "softmax" and form_class(name).claims(config):
            return name
    return "softmax"


def build_form(name: str, sizes: LayerSizes, config: AttentionConfig, **built: nn.Module) -> Form:
    """The form ``name`` built for a layer of ``sizes`` computing ``config``; ``built``: stage modules given ready
    (the softmax form's ``score``, ``position_bias``, ``normalizer``, from the keyword form of the layer)."""
    form_class(name)
    return _FORMS.build(name, sizes=sizes, config=config, **built)


def _shown(value: Any) -> str:
    if value is True or value is False:
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value) if value == "" else value
    return str(value)


def refuse_unimplemented(
    form: type[Form], config: AttentionConfig, claims: Mapping[str, tuple[Any, ...] | None]
) -> None:
    """Raise :class:`LayerOptionError` (one line) for the first field of ``config`` set away from its default that
    no part of the layer claims (``claims``: field → the values computed, None for any; the form's and the layer's
    stages', :func:`attnlab.stages.claims_of`), or set to a value none computes: the one capability check, made when
    a layer is built, whatever the backend."""
    import dataclasses

    from attnlab.config import FIELDS, field_info

    def cli_of(name: str) -> str:
        return field_info(name)["cli"] if name in known else name

    def role_of(name: str) -> str:
        return field_info(name)["role"] if name in known else "what"

    known = set(FIELDS)  # AttentionConfig's own (a subclass may add fields)
    for f in dataclasses.fields(config):  # (a subclass's new field too: refused until something computes it)
        name = f.name
        value = getattr(config, name)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        if name in ("score", "score_params") or value == default:
            continue
        cli = f.metadata.get("cli", name)
        shown = f"{cli}={_shown(value)}" if "=" not in cli else cli
        if name not in claims:
            why = form.refusals.get(name, f"it is not among what variant {form.name} computes")
            parent = next((c for c in form.__mro__[1:] if name in getattr(c, "implements", {})), None)
            if parent is not None and form.implements is _UNDECLARED:
                why = (
                    f"{form.__name__} declares no implements of its own (it is not inherited: write "
                    f"implements = {parent.__name__}.implements to compute what its parent does)"
                )
            takes = sorted(cli_of(c) for c in claims if role_of(c) == "what")
            raise LayerOptionError(
                f"variant {form.name} does not compute {shown}: {why}; leave it at its default "
                f"({_shown(default)}). It takes: {', '.join(takes) or 'none of the options'}"
            )
        allowed = claims[name]
        if allowed is not None and value not in allowed:
            why = form.refusals.get(name, "")
            raise LayerOptionError(
                f"variant {form.name} computes {cli} = {' or '.join(_shown(a) for a in allowed)} only, not "
                f"{_shown(value)}{': ' + why if why else ''}"
            )
