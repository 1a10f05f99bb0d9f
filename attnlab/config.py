"""One layer's attention, described once: :class:`AttentionConfig`, its presets, and per-layer patterns (hybrids).

Everything that decides what one attention layer computes is a field of :class:`AttentionConfig`: the score and
its parameters, the position bias, rotary positions, QK-norm, soft-capping, the structural mask, the normalizer,
the key/value heads, the per-head sizes, differential attention and the backend that computes it. The Hydra config
builds it (``conf/config.yaml``'s ``attention:`` node, a ``_target_`` whose fields are the familiar knobs:
``variant=``, ``normalizer=``, ``qk_norm=`` ...), :class:`~attnlab.attention.MultiHeadAttention`, the encoder and
the Lightning module take it, and the run's summary, start line, results table and dashboard record the fields
that differ from the defaults (:meth:`AttentionConfig.changes`). A new stage option is one field here and its use
in the stage.

**Presets** (``alibi``, ``t5_bias``, ``relative_position``) are names a score field may take that stand for a score
plus a position bias (:func:`register_preset`); :meth:`AttentionConfig.resolved` expands them, so that the layer
that is built, and what a run records, say what the preset is (``alibi`` = ``scaled_dot`` + ``position_bias=alibi``).
Their registry lives with the scores (:mod:`attnlab.scores`, below this module: ``build_score`` takes a preset too,
and the verbs are there: ``register_preset``, ``list_presets``, ``is_preset``); :func:`build_preset` checks a
preset's changes against the fields.

**Per-layer attention.** :func:`layer_configs` gives each of ``num_layers`` layers its own config: from a
``pattern`` of layer kinds that repeats (``"LG"``: a local layer then a global one; ``"LLLLLG"``: Gemma 3's 5:1), each
kind a set of field changes (:data:`DEFAULT_LAYER_KINDS`: ``G`` global = the base config, ``L`` local = the base
mask AND a sliding window, ``S`` a softmax layer), or an explicit list of per-layer changes.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from attnlab.compat import forward
from attnlab.normalizers import _NORMALIZERS
from attnlab.position_bias import _POSITION_BIASES
from attnlab.scores import _PRESETS, _SCORES

__all__ = [
    "DEFAULT_LAYER_KINDS",
    "FIELDS",
    "OUTPUT_GATES",
    "SETTING_FIELDS",
    "AttentionConfig",
    "build_preset",
    "default_layer_kinds",
    "field_default",
    "field_info",
    "layer_configs",
    "pattern_name",
]

__getattr__ = forward(__name__)  # the preset verbs are the scores' (attnlab.compat)


def _plain(value: Any) -> Any:
    """OmegaConf containers and tuples → plain dicts and lists (a config's fields are data)."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


OUTPUT_GATES: tuple[str, ...] = ("headwise", "elementwise")
"""The gated output's forms (:attr:`AttentionConfig.output_gate`): one gate per head and token, or per channel."""


def _registered_normalizers() -> tuple[str, ...]:
    return tuple(n for n in _NORMALIZERS.names() if n != "softmax")


def _knob(
    cli: str,
    samples: tuple[Any, ...] | Any,
    requires: dict[str, Any] | None = None,
    role: str = "what",
) -> dict[str, Any]:
    """The metadata of a field of :class:`AttentionConfig`: what the contract needs beside its definition:

    * ``cli``: the command-line key a user sets it with (what a refusal names);
    * ``samples``: non-default values the combination test (tests/test_combinations.py) sets it to on every
      form and backend: a tuple, or a function returning one (the registered normalizers); a new field cannot
      land without them;
    * ``requires``: the other fields a sample needs (``selective`` needs ``mask=causal``): the test compares the
      cell against the config with those alone;
    * ``role``: ``what`` (it changes what is computed: a cell must differ from the one without it), ``form`` (it
      chooses the form or its parameters: the form's own tests cover it) or ``how`` (it chooses how, not what:
      equal to eager, not different)."""
    return {"cli": cli, "samples": samples, "requires": dict(requires or {}), "role": role}


def field_info(name: str) -> dict[str, Any]:
    """The contract metadata of :class:`AttentionConfig` field ``name`` (:func:`_knob`), samples resolved."""
    meta = dict(next(f for f in dataclasses.fields(AttentionConfig) if f.name == name).metadata)
    if callable(meta["samples"]):
        meta["samples"] = tuple(meta["samples"]())
    return meta


def field_default(name: str) -> Any:
    """The default of :class:`AttentionConfig` field ``name``."""
    f = next(f for f in dataclasses.fields(AttentionConfig) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


@dataclass(frozen=True)
class AttentionConfig:
    """What one attention layer computes (Vaswani et al. 2017 §3.2, and every stage since), as plain data.

    Fields (the command-line key each one comes from in ``conf/config.yaml``):
        score: a registered score (``variant.name``: ``scaled_dot``, ``additive`` ...) or a preset (``alibi``,
            ``t5_bias``, ``relative_position``: a score plus a position bias, see :func:`register_preset`).
        score_params: the score's (or preset's) parameters (``variant.params``).
        position_bias: a registered position bias added to any score (``position_bias.name``: ``shaw``, ``t5``,
            ``alibi``), or None.
        position_bias_params: its parameters (``position_bias.params``).
        rope: rotary positions on q and k, a dict of :class:`~attnlab.positions.RotaryEmbedding` parameters
            (``{}`` for the defaults), or None (off) (``model.pos_encoding=rope`` and ``model.rope``).
        qk_norm: ``layernorm`` or ``rmsnorm`` of each head's q and k, or None (``qk_norm``).
        softcap: c > 0: logits ← c·tanh(logits / c); or None (``softcap``).
        mask: the structural mask, a registered name or spec dict (``mask``); None = every key visible. The task's
            padding is always applied besides.
        normalizer: a registered normalizer (``normalizer.name``), ``normalizer_params`` its parameters.
        num_kv_heads: G key/value heads, a divisor of the query heads (``num_kv_heads``); None = as many.
        d_k: per-head query/key size (``d_k``); None = d_model // num_heads. d_v: per-head value size
            (``model.d_v``); None = d_k.
        differential: differential attention, two maps per head (``model.differential``).
        selective: selective attention (Leviathan et al. 2025): the first head's ReLU'd logits, accumulated over the
            later queries, subtracted from every head's logits (``attention.selective``); softmax forms, causal.
        short_conv: k ≥ 1: a depthwise causal convolution of width k on each channel of q, k and v after their
            projections (Zoology, Based and fla give every linear mixer one), or None (off) (``model.short_conv``).
        short_conv_residual: the short convolution adds its input back, q ← q + conv(q) (and k, v): Allen-Zhu 2025's
            Canon-B, which ``model.canon`` with B sets (``attention.short_conv_residual``); needs ``short_conv``.
        output_gate: the gated output of Qiu et al. 2025 (Qwen3-Next): z_h ← z_h ⊙ σ(x W_g) after the form's output
            and before ``out_proj``, ``headwise`` (one scalar per head and token) or ``elementwise`` (one per
            channel), on every form; None (off) (``attention.output_gate``).
        backend: what computes the layer (``attention.backend``): ``auto`` (the first backend of
            :func:`~attnlab.backends.list_backends` that supports it) or a backend's name, which is then refused
            in one line where it cannot compute this configuration.
        backend_params: the backends' parameters (``attention.backend_params``: ``chunk_size`` of ``chunked``);
            each must be one a registered backend takes.
    """

    score: str = field(default="scaled_dot", metadata=_knob("variant.name", ("dot", "additive"), role="form"))
    score_params: dict[str, Any] = field(default_factory=dict, metadata=_knob("variant.params", (), role="form"))
    position_bias: str | None = field(default=None, metadata=_knob("position_bias", ("alibi", "t5", "shaw")))
    position_bias_params: dict[str, Any] = field(
        default_factory=dict,
        metadata=_knob("position_bias.params", ({"num_buckets": 4},), requires={"position_bias": "t5"}),
    )
    rope: dict[str, Any] | None = field(default=None, metadata=_knob("model.pos_encoding=rope", ({}, {"base": 100.0})))
    qk_norm: str | None = field(default=None, metadata=_knob("qk_norm", ("layernorm", "rmsnorm")))
    softcap: float | None = field(default=None, metadata=_knob("softcap", (0.5,)))
    mask: Any = field(default=None, metadata=_knob("mask", ("causal", {"name": "sliding_window", "window": 2})))
    normalizer: str = field(default="softmax", metadata=_knob("normalizer", _registered_normalizers))
    normalizer_params: dict[str, Any] = field(
        default_factory=dict, metadata=_knob("normalizer.params", ({"bias": 0.5},), requires={"normalizer": "sigmoid"})
    )
    num_kv_heads: int | None = field(default=None, metadata=_knob("num_kv_heads", (1,)))
    d_k: int | None = field(default=None, metadata=_knob("d_k", (6,)))
    d_v: int | None = field(default=None, metadata=_knob("model.d_v", (5,)))
    differential: bool = field(default=False, metadata=_knob("model.differential", (True,)))
    selective: bool = field(default=False, metadata=_knob("attention.selective", (True,), requires={"mask": "causal"}))
    short_conv: int | None = field(default=None, metadata=_knob("model.short_conv", (3,)))
    short_conv_residual: bool = field(
        default=False, metadata=_knob("attention.short_conv_residual", (True,), requires={"short_conv": 3})
    )
    output_gate: str | None = field(default=None, metadata=_knob("attention.output_gate", OUTPUT_GATES))
    backend: str = field(default="auto", metadata=_knob("attention.backend", (), role="how"))
    backend_params: dict[str, Any] = field(
        default_factory=dict, metadata=_knob("attention.backend_params", ({"chunk_size": 2},), role="how")
    )

    def __post_init__(self) -> None:
        from attnlab.checks import check_int, check_number

        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("score_params", "position_bias_params", "normalizer_params", "backend_params"):
            value = _plain(getattr(self, name))
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ValueError(f"{name} must be a mapping of parameters, got {value!r}")
            put(name, value)
        for name in ("score", "normalizer", "backend"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a registered name, got {getattr(self, name)!r}")
        if self.position_bias == "none":
            put("position_bias", None)
        if self.position_bias == "":
            raise ValueError("position_bias must be a registered name or null (an empty string is not off), got ''")
        if self.position_bias is not None and not isinstance(self.position_bias, str):
            raise ValueError(f"position_bias must be a registered name or null, got {self.position_bias!r}")
        rope = _plain(self.rope)
        if rope is True:
            rope = {}
        if rope is False:
            rope = None
        if rope is not None and not isinstance(rope, dict):
            raise ValueError(f"rope must be null or a mapping of rotary parameters (base, fraction), got {rope!r}")
        put("rope", rope)
        mask = _plain(self.mask)
        if mask in ("none", {"name": "none"}):
            mask = None  # every key visible
        put("mask", mask)
        if self.qk_norm not in (None, "layernorm", "rmsnorm"):
            raise ValueError(f"qk_norm must be null, layernorm or rmsnorm, got {self.qk_norm!r}")
        if self.softcap is not None:
            put("softcap", check_number("softcap", self.softcap, low=0.0, low_open=True))
        for name in ("num_kv_heads", "d_k", "d_v"):
            if getattr(self, name) is not None:
                put(name, check_int(name, getattr(self, name), minimum=1))
        if not isinstance(self.differential, bool):
            raise ValueError(f"differential must be true or false, got {self.differential!r}")
        if not isinstance(self.selective, bool):
            raise ValueError(f"selective must be true or false, got {self.selective!r}")
        if self.short_conv == 0:  # (and False): off
            put("short_conv", None)
        if self.short_conv is not None:
            put("short_conv", check_int("short_conv", self.short_conv, minimum=1))
        if not isinstance(self.short_conv_residual, bool):
            raise ValueError(f"short_conv_residual must be true or false, got {self.short_conv_residual!r}")
        if self.short_conv_residual and self.short_conv is None:
            raise ValueError("short_conv_residual=true needs a short convolution: set short_conv (the width, e.g. 4)")
        if self.output_gate == "none":
            put("output_gate", None)
        if self.output_gate not in (None, *OUTPUT_GATES):
            raise ValueError(f"output_gate must be null, headwise or elementwise, got {self.output_gate!r}")

    # ------------------------------------------------------------------------------------------ views

    def replace(self, **changes: Any) -> AttentionConfig:
        """A copy with ``changes`` (field → value); an unknown field is one line naming the fields."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise ValueError(f"attention has no field '{unknown[0]}'; fields: {', '.join(FIELDS)}")
        return dataclasses.replace(self, **changes)

    def resolved(self) -> AttentionConfig:
        """The config with a preset score expanded into what it stands for (``alibi`` → ``scaled_dot`` plus
        ``position_bias=alibi``); a config without a preset is returned as it is."""
        if self.score not in _PRESETS:
            return self
        changes = build_preset(self.score, **self.score_params)
        bias = changes.get("position_bias")
        if bias is not None and self.position_bias is not None:
            raise ValueError(
                f"variant {self.score} is {changes.get('score', 'a score')} with position_bias={bias} built in, so it "
                f"cannot take position_bias={self.position_bias} as well: use variant={changes.get('score')} "
                f"position_bias=... for a bias on a plain score"
            )
        changes.setdefault("score_params", {})
        return self.replace(**changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain data."""
        return {name: _plain(getattr(self, name)) for name in FIELDS}

    def changes(self, base: AttentionConfig | None = None) -> dict[str, Any]:
        """The fields that differ from ``base`` (default: the defaults), in field order."""
        reference = (base or AttentionConfig()).to_dict()
        return {k: v for k, v in self.to_dict().items() if v != reference[k]}

    def describe(self, base: AttentionConfig | None = None) -> str:
        """One short line: the score, then every other field that differs from ``base`` (default: the defaults):
        ``additive · position_bias=alibi · qk_norm=rmsnorm · softcap=50``."""
        parts = [self.score]
        for key, value in self.changes(base).items():
            if key in ("score", "d_k"):
                continue
            if key.endswith("_params"):
                owner = key.removesuffix("_params")
                value = _non_default(value, _builder(owner, getattr(self, owner)))
                if value:
                    parts.append(f"{owner}({_short(value)})")
                continue
            if key == "rope":
                from attnlab.positions import RotaryEmbedding

                value = _non_default(value, RotaryEmbedding)
                parts.append("rope" if not value else f"rope({_short(value)})")
            elif key == "mask":
                parts.append(f"mask={_mask_text(value)}")
            elif value is True:
                parts.append(key)
            else:
                parts.append(f"{key}={_short(value)}")
        return " · ".join(parts)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AttentionConfig))
"""The fields of :class:`AttentionConfig`, in order."""

SETTING_FIELDS: tuple[str, ...] = tuple(
    f for f in FIELDS if not f.endswith("_params") and f not in ("score", "mask", "rope", "d_k")
)
"""The fields that are one plain value each (the settings columns of a results CSV): the score, the mask, the
rotary parameters and d_k have columns of their own."""


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def _builder(stage: str, name: Any) -> Any:
    """The registered class or function behind a stage's name (None when unknown)."""
    try:
        if stage == "score":
            return _PRESETS.get(name) if name in _PRESETS else _SCORES.get(name)
        if stage == "position_bias":
            return _POSITION_BIASES.get(name)
        return _NORMALIZERS.get(name)
    except Exception:
        return None


def _non_default(params: dict[str, Any], target: Any) -> dict[str, Any]:
    """``params`` without those equal to ``target``'s own defaults (when it cannot be inspected, a form's
    parameters: without those left None, which a form reads as its default)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return {k: v for k, v in params.items() if v is not None}
    defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
    return {k: v for k, v in params.items() if k not in defaults or defaults[k] != v}


def _mask_text(spec: Any) -> str:
    """``causal``, ``sliding_window(window=8)``, ``causal & sliding_window(window=8)``."""
    if spec is None:
        return "none"
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        name = spec.get("name")
        if name in ("and", "or") and isinstance(spec.get("masks"), list):
            return f" {'&' if name == 'and' else '|'} ".join(_mask_text(m) for m in spec["masks"])
        params = {k: v for k, v in spec.items() if k != "name"}
        return f"{name}({_short(params)})" if params else str(name)
    return str(spec)


# ---------------------------------------------------------------------------------------------------- presets


def build_preset(name: str, **params: Any) -> dict[str, Any]:
    """The field changes the preset ``name`` (:func:`register_preset`) stands for, with its ``params``; a change of
    a field :class:`AttentionConfig` does not have is refused in one line."""
    changes = _PRESETS.build(name, **params)
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown:
        raise ValueError(f"preset '{name}' returned unknown attention field '{unknown[0]}'")
    return changes


# ---------------------------------------------------------------------------------------------------- per layer

DEFAULT_LAYER_KINDS: dict[str, dict[str, Any]] = {
    "G": {},
    "L": {"mask": {"name": "and", "masks": ["base", {"name": "sliding_window", "window": 16}]}},
    "S": {
        "score": "scaled_dot",
        "score_params": {},
        "normalizer": "softmax",
        "normalizer_params": {},
        "short_conv": None,
    },
}
"""The layer kinds a ``pattern`` names, when the config does not define its own, beside the forms' own
(:func:`default_layer_kinds`): ``G`` global (the base config), ``L`` local (the base mask AND a sliding window of 16:
causal stays causal), ``S`` softmax (a ``scaled_dot`` softmax layer whatever the base score: the global layer of a
linear hybrid). ``base`` in a kind's mask stands for the base config's mask."""


def default_layer_kinds() -> dict[str, dict[str, Any]]:
    """:data:`DEFAULT_LAYER_KINDS` and a kind for every registered form that names a letter
    (:attr:`~attnlab.forms.Form.layer_kind`), that form at its defaults (its :meth:`~attnlab.forms.Form.base_config`
    normalizer, no short convolution; the base config's mask): ``M`` multi-head latent attention (Kimi Linear's
    global layer, ``variant=kda model.pattern=GGGM``), ``F`` forgetting attention (Lin et al. 2025; causal:
    ``variant=gated_deltanet model.pattern=GGGF``)."""
    from attnlab.registry import registry_of

    forms = registry_of("form")  # (read through the registry: the config is below the forms)
    kinds = dict(DEFAULT_LAYER_KINDS)
    for name in [] if forms is None else forms.names():
        cls = forms.get(name)
        if cls.layer_kind is not None and cls.layer_kind not in kinds:
            base = cls.base_config()
            kinds[cls.layer_kind] = {
                "score": base.score, "score_params": {}, "normalizer": base.normalizer, "normalizer_params": {},
                "short_conv": None,
            }  # fmt: skip
    return kinds


def _with_base_mask(spec: Any, base_mask: Any) -> Any:
    """``spec`` with every ``"base"`` replaced by ``base_mask`` (dropped from an ``and`` when it is None)."""
    if spec == "base":
        return base_mask
    if isinstance(spec, dict):
        out = {k: _with_base_mask(v, base_mask) for k, v in spec.items()}
        if out.get("name") in ("and", "or") and isinstance(out.get("masks"), list):
            out["masks"] = [m for m in out["masks"] if m is not None]
            if len(out["masks"]) == 1:
                return out["masks"][0]
        return out
    if isinstance(spec, list):
        return [_with_base_mask(v, base_mask) for v in spec]
    return spec


def layer_configs(
    base: AttentionConfig,
    num_layers: int,
    pattern: str | None = None,
    layer_kinds: Mapping[str, Mapping[str, Any]] | None = None,
    layers: Sequence[Mapping[str, Any] | None] | None = None,
) -> list[AttentionConfig]:
    """One :class:`AttentionConfig` per layer: ``base`` for every layer, or changed per layer by

    * ``pattern``: a string of layer-kind letters, repeated and cut to ``num_layers`` (``"LG"`` over 4 layers:
      L, G, L, G); each letter a kind of ``layer_kinds`` (default :data:`DEFAULT_LAYER_KINDS`), a mapping of the
      fields it changes (``{"mask": "causal", "softcap": 50}``). A pattern longer than ``num_layers`` is refused.
    * ``layers``: an explicit list of ``num_layers`` such mappings (``{}`` or None: the base config).

    Each layer's changes replace the base's fields; a mask may name ``base``, the base config's mask."""
    if pattern is not None and layers is not None:
        raise ValueError("give model.pattern or model.layers, not both")
    if pattern is None and layers is None:
        return [base] * num_layers
    if layers is not None:
        layers = list(layers)
        if len(layers) != num_layers:
            raise ValueError(f"model.layers lists {len(layers)} layers, but num_layers is {num_layers}")
        changes = [dict(c or {}) for c in layers]
        keys = [f"model.layers[{i}]" for i in range(num_layers)]
    else:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"model.pattern must be a string of layer kinds like LG, got {pattern!r}")
        kinds = {**default_layer_kinds(), **{str(k): dict(v or {}) for k, v in _plain(layer_kinds or {}).items()}}
        unknown = sorted(set(pattern) - set(kinds))
        if unknown:
            raise ValueError(
                f"model.pattern={pattern} names layer kind '{unknown[0]}', which model.layer_kinds does not define; "
                f"defined: {', '.join(sorted(kinds))}"
            )
        if len(pattern) > num_layers:
            raise ValueError(
                f"model.pattern={pattern} has {len(pattern)} layers, more than num_layers={num_layers}: set "
                f"num_layers={len(pattern)} (or a multiple)"
            )
        letters = (pattern * num_layers)[:num_layers]
        changes = [dict(kinds[c]) for c in letters]
        keys = [f"model.layer_kinds.{c}" for c in letters]
    out = []
    for key, change in zip(keys, changes, strict=True):
        change = _plain(change)
        if "mask" in change:
            change["mask"] = _with_base_mask(change["mask"], base.mask)
        try:
            out.append(base.replace(**change) if change else base)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{key}: {' '.join(str(exc).split())}") from None
    return out


def pattern_name(configs: Sequence[AttentionConfig], pattern: str | None = None) -> str | None:
    """A name for a model's layers: ``pattern`` when given (``LG``); else None when every layer is alike, and
    otherwise one letter per distinct layer config in order of first appearance (``AAB``)."""
    if pattern:
        return pattern
    distinct: list[AttentionConfig] = []
    letters = []
    for c in configs:
        if c not in distinct:
            distinct.append(c)
        letters.append(chr(ord("A") + distinct.index(c)))
    return None if len(distinct) <= 1 else "".join(letters)


def config_signature() -> inspect.Signature:
    """The signature of :class:`AttentionConfig` (what its ``_target_`` node may set)."""
    return inspect.signature(AttentionConfig)
