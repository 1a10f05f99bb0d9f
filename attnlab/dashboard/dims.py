"""What a set of runs varies: every config key whose value differs between runs is a dimension of the comparison.

:class:`Sweep` reads the runs' ``config.yaml`` leaves (``variant.name``, ``d_k``, ``lr``, ``variant.params.d_attn``,
``task.datamodule.num_pairs``, ...). A key with one value in every run is a *constant*, shown once; a key with two
or more values is a *dimension*. Seeds are replicates, never a dimension. Keys that only repeat another are left
out, so that a sweep over ``variant`` has one dimension, not five:

* bookkeeping that differs per run without being a setting (``seed``, and :data:`attnlab.runs.NEUTRAL_KEYS`:
  ``resume``, ``threads``, ``logger.*``, ...);
* a mirror: a key whose value equals another key's in every run (``trainer.max_steps`` = ``max_steps``);
* a key inside a named group that is fixed by the group's name (``variant.params.d_attn`` once ``variant.name``
  is known, ``task.datamodule.*`` once ``task.name`` is);
* the layer kinds (``model.layer_kinds.*``) when no run has a per-layer pattern: they act only in one;
* a key that a categorical dimension fixes (``model.pos_encoding`` when only the ``alibi`` preset sets it to
  ``none``; ``model.short_conv`` when kda's preset sets 4, rwkv7's 2 and gated_deltanet's none): it is an
  *attribute* of that dimension's values, listed in :attr:`Sweep.derived`, in the page's header (each model with
  its attributes) and under the headline's row names, not in every legend. A numeric dimension never absorbs
  another, and a key that a run's command line set (summary.json's ``overrides``, e.g. an Optuna search's
  ``d_k=16``) is a dimension even where it happens to follow the variant, unless every run that set it set the
  value its model has in the runs that did not (``variant=kda model.short_conv=4`` beside plain ``variant=kda``
  runs restates kda's preset: one sweep of a folder of sweeps that spelled the preset out changes nothing).

Runs that agree on every dimension form one *configuration*; its seeds are pooled into a mean and interval. A named
model (the ``variant=`` choice, :attr:`attnlab.dashboard.load.Run.model`) is one configuration: what its preset
sets is an attribute of it. A key that is a dimension only because some run's command line changed it from its
model's preset (``variant=gated_deltanet model.short_conv=4`` beside the plain presets) tells those runs apart
(its own row, ``gated_deltanet · short_conv=4``), but it is a *preset key* (:attr:`Sweep.preset_keys`: in the runs
that did not set it, it follows a categorical dimension and takes two or more values), and a preset key is never
chosen as the main key, the headline's columns or the panels: those are keys the command lines swept. A sweep over
variants alone has no main key: the headline has one column, a row per model, and every model is compared with the
winner.

``config_keys`` (the dashboard's ``--config-keys``) names the keys that define a configuration instead: every
other key that varies is an attribute, in :attr:`Sweep.derived` where one of those keys fixes it, else in
:attr:`Sweep.pooled` (its runs are pooled whatever its value: the page's header says so).

What a run's value is: a key left null where it means "derived" (``d_k``, ``num_kv_heads``, ``d_v``) reads as the
value the run used (from its summary: ``d_k=16``, ``kv_heads=4``) once some run sets it, so that a sweep that set
``d_k=8,512`` beside one that left it to ``d_model // num_heads`` compares on one axis; left null everywhere it is
a constant. ``variant.name`` is the variant the run was started with (``variant=rope``, whose config holds its
score, ``scaled_dot``, and ``model.pos_encoding: rope``).

*Run knobs* (:data:`RUN_KNOBS`: the training budget, the evaluation cadence, the data and test-set sizes, debug
and hardware settings) set how a run was trained and evaluated, not which model or method it is. Where they vary
(a folder of a smoke sweep and a full one) they are dimensions, so that runs of different budgets never pool, and
the runs tables list them; but labels (legends, headline rows) leave them out unless they are what tells two
configurations apart (:meth:`Sweep.label_dims`), and the main key and the panels are other keys where there are.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from attnlab.dashboard.load import MISSING, RESOLVED_KEYS, Run, natural_key
from attnlab.runs import is_neutral
from attnlab.stats import finite

__all__ = [
    "IGNORED_KEYS",
    "RUN_KNOBS",
    "Dimension",
    "Sweep",
    "attribute_name",
    "format_value",
    "is_run_knob",
    "wide_range",
]

IGNORED_KEYS = (
    "seed",
    "*.seed",
    "imports",
    "smoke",
    "optimized_metric",
    "diagnostics.*",
    "hydra.*",
    "trainer.enable_*",
    "trainer.log_every_n_steps",
    "task.datamodule.test_lengths",
)
"""Config keys (``fnmatch`` patterns) that are never a dimension besides :data:`attnlab.runs.NEUTRAL_KEYS` (which
cannot change a run's numbers): replicates and bookkeeping (the test lengths are the x axis of their own chart)."""

RUN_KNOBS = (
    "max_steps",
    "max_tokens",
    "trainer.max_steps",
    "trainer.max_epochs",
    "eval_every",
    "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch",
    "trainer.limit_*",
    "trainer.overfit_batches",
    "trainer.num_sanity_val_steps",
    "trainer.accelerator",
    "trainer.devices",
    "trainer.strategy",
    "trainer.deterministic",
    "task.datamodule.num_train",
    "task.datamodule.num_val",
    "task.datamodule.num_test",
    "smoke",
    "compile",
    "results_table",
    "overwrite",
    "ckpt_path",
)
"""Config keys (``fnmatch`` patterns) that say how a run was trained and evaluated, not what: kept out of labels
unless needed (see the module docstring)."""

_ORDER = (
    "variant.name",
    "normalizer.name",
    "position_bias.name",
    "model.pos_encoding",
    "mask.name",
    "task.name",
    "d_k",
    "num_heads",
    "num_kv_heads",
    "d_model",
    "num_layers",
    "lr",
    "batch_size",
    "max_steps",
)
"""Dimensions come in this order (the first is the colour of a chart's lines), then the others alphabetically."""

_SHORT = {
    "variant.name": "variant",
    "num_heads": "heads",
    "num_kv_heads": "kv_heads",
    "num_layers": "layers",
    "model.pos_encoding": "pos",
    "batch_size": "batch",
}


def format_value(value: Any) -> str:
    """A config value as short text: ``0.003``, ``64``, ``null``, ``true``, ``[1, 2]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def is_run_knob(key: str) -> bool:
    """Whether the config key is one of :data:`RUN_KNOBS`."""
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in RUN_KNOBS)


def wide_range(values: Iterable[float]) -> bool:
    """Whether positive ``values`` span a factor of 8 or more (drawn on a log axis)."""
    xs = list(values)
    return bool(xs) and min(xs) > 0 and max(xs) >= 8 * min(xs)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _sort_key(value: Any) -> tuple[int, Any]:
    if _is_number(value):
        return (0, float(value))
    return (1, natural_key(format_value(value)))


@dataclass(frozen=True)
class Dimension:
    """A config key that varies across the runs.

    Attributes:
        key: the dotted config key (``variant.name``, ``lr``).
        name: its display name (``variant``, ``lr``, ``heads``).
        values: the distinct values, numbers ascending then text naturally.
    """

    key: str
    name: str
    values: tuple[Any, ...]

    @property
    def numeric(self) -> bool:
        """Whether at least two values are numbers and every other value is null or missing."""
        numbers = [v for v in self.values if _is_number(v)]
        return len(numbers) >= 2 and all(_is_number(v) or v is None or v == MISSING for v in self.values)

    @property
    def log(self) -> bool:
        """Whether charts put this key on a log axis: numeric, all positive, spanning a factor of 8 or more
        (d_k 8..512, lr 1e-4..1e-2, lengths 16..256; not heads 1..4)."""
        return self.numeric and wide_range(float(v) for v in self.values if _is_number(v))

    def format(self, value: Any) -> str:
        """A value of this key as text."""
        return format_value(value)

    def label(self, value: Any) -> str:
        """``heads=4`` (``additive`` for the variant, whose values name themselves)."""
        return self.format(value) if self.key == "variant.name" else f"{self.name}={self.format(value)}"


class Sweep:
    """The dimensions and constants of a set of runs (see the module docstring).

    Args:
        runs: every run to compare (failed ones included: they still have a configuration).
        exclude: config keys that are neither dimensions nor constants here (a tuned sweep's grid keys: each
            configuration ran at its own best ``lr``, which names no configuration).
        config_keys: the keys that define a configuration (``--config-keys``: dotted keys or display names,
            ``variant`` or ``model`` for the model); None: found as the module docstring says.
        strict: whether a name of ``config_keys`` that is no config key of these runs is a ValueError (a sweep of
            part of the page's runs, a tuned sweep's, passes False: the key may vary elsewhere only).
    """

    def __init__(
        self,
        runs: Sequence[Run],
        exclude: Iterable[str] = (),
        config_keys: Sequence[str] | None = None,
        strict: bool = True,
    ) -> None:
        self.runs = list(runs)
        self.exclude = frozenset(exclude)
        keys: set[str] = set()
        for run in self.runs:
            keys.update(run.flat)
        keys = {
            k
            for k in keys
            if not is_neutral(k) and k not in self.exclude and not any(fnmatch.fnmatchcase(k, p) for p in IGNORED_KEYS)
        }
        if all(run.value("model.pattern") in (None, MISSING) for run in self.runs):
            keys = {k for k in keys if not k.startswith("model.layer_kinds.")}  # layer kinds act only in a pattern
        column = {k: [_hashable(run.value(k)) for run in self.runs] for k in keys}
        for k in keys & set(RESOLVED_KEYS):  # null everywhere: a constant "derived", not the values it gave
            if all(run.raw_value(k) is None for run in self.runs):
                column[k] = [None] * len(self.runs)
        varying = sorted((k for k in keys if len(set(column[k])) > 1), key=_key_order)
        self.constants: dict[str, Any] = {k: column[k][0] for k in sorted(keys - set(varying), key=_key_order)}
        kept: list[str] = []
        self.derived: dict[str, str] = {}  # key -> the key that fixes it (pos and short_conv follow the variant)
        self.pooled: dict[str, tuple[Any, ...]] = {}  # (config_keys) key -> its values, fixed by no config key
        self.config_keys: tuple[str, ...] | None = None
        """The dotted keys of ``config_keys`` (None without): what defines a configuration here."""
        setters = [_overridden([run]) for run in self.runs]  # each run's command-line keys
        excluded = [[_hashable(run.value(k)) for run in self.runs] for k in sorted(self.exclude)]
        if config_keys is not None:
            self.config_keys = _resolve_config_keys(config_keys, keys, varying, strict)
        attributes: list[str] = []  # (config_keys) the varying keys that are not configuration keys
        for key in varying:
            if any(column[key] == column[other] for other in [*kept, *self.derived]):  # a mirror
                continue
            if any(column[key] == values for values in excluded):  # a mirror of an excluded key
                continue
            group = key.split(".")[0]
            parent = f"{group}.name"
            if key != parent and parent in varying and _function_of(column[key], column[parent]):
                continue  # fixed by its group's name
            if self.config_keys is not None:
                (kept if key in self.config_keys else attributes).append(key)
                continue  # an attribute: sorted out below, once every configuration key is known
            owner = next((k for k in kept if _categorical(column[k]) and _function_of(column[key], column[k])), None)
            if owner is not None and not _changed_by_command_line(column[key], column[owner], key, setters):
                self.derived[key] = owner  # set by a preset of a named choice (alibi: no positions)
                continue
            kept.append(key)
        for key in attributes:
            if any(column[key] == column[other] for other in [*kept, *self.derived, *self.pooled]):  # a mirror
                continue
            fixed_by = [k for k in kept if _function_of(column[key], column[k])]
            owner = next((k for k in fixed_by if _categorical(column[k])), fixed_by[0] if fixed_by else None)
            if owner is not None:
                self.derived[key] = owner
            else:
                self.pooled[key] = tuple(sorted(set(column[key]), key=_sort_key))
        self.preset_keys: frozenset[str] = frozenset(
            key for key in kept if _preset_key(key, column, kept, setters) or _follows(key, column, kept)
        )
        """The dimensions that only a run's command line changed from its model's preset (see the module
        docstring), and those whose value follows another, categorical, dimension in every run, whoever set it (a
        sweep of kda, deltanet and softmax with ``model.short_conv=4`` beside rwkv7's preset 2): never the default
        main key, headline columns or panels, since a split that follows the rows' own key compares nothing."""
        names = _display_names(kept)
        self.dims: list[Dimension] = [
            Dimension(key, names[key], tuple(sorted(set(column[key]), key=_sort_key))) for key in kept
        ]
        self.knobs: list[Dimension] = [d for d in self.dims if is_run_knob(d.key)]
        """The dimensions that are run knobs (:data:`RUN_KNOBS`)."""
        self._label_dims: dict[tuple[tuple[str, ...], tuple[str, ...]], list[Dimension]] = {}

    # -------------------------------------------------------------------------------- lookup
    def dim(self, name: str | None) -> Dimension | None:
        """The dimension with this display name or dotted key; None for None."""
        if name is None:
            return None
        for dim in self.dims:
            if name in (dim.name, dim.key):
                return dim
        allowed = ", ".join(d.name for d in self.dims) or "none: every run has the same config"
        attribute = next((k for k in [*self.derived, *self.pooled] if name in (k, attribute_name(k))), None)
        if attribute is not None:
            owner = self.derived.get(attribute)
            why = f"set by each {_SHORT.get(owner, owner)}'s preset" if owner else "pooled by --config-keys"
            raise ValueError(
                f"{name!r} is an attribute here ({why}), not a key that varies on its own (varying: {allowed}); "
                f"--config-keys {','.join(d.name for d in self.dims) or 'variant'},{name} makes it one"
            )
        raise ValueError(f"{name!r} is not a key that varies across these runs (varying: {allowed})")

    def swept_dims(self) -> list[Dimension]:
        """The dimensions that labels show (:meth:`label_dims`) and that are no preset key (:attr:`preset_keys`):
        those a main key, headline columns or panels may be."""
        return [d for d in self.label_dims(self.dims) if d.key not in self.preset_keys]

    def main_dim(self, preferred: str | None = None) -> Dimension | None:
        """The charts' x axis (and, where it is numeric, the headline's columns): ``preferred``, else the first
        numeric dimension (in the order of :data:`_ORDER`) among :meth:`swept_dims` (a run knob only where it tells
        configurations apart; never a key a model's preset set), else None."""
        if preferred is not None:
            return self.dim(preferred)
        return next((d for d in self.swept_dims() if d.numeric), None)

    def column_dim(self, preferred: str | None = None, strict: bool = True) -> Dimension | None:
        """The key of the headline's columns, or None for one column (a row per configuration, each compared with
        the winner): ``preferred`` (a ValueError where it does not vary, unless not ``strict``: then the default),
        else :meth:`main_dim`; else the first categorical one of :meth:`swept_dims` (the variant) where another of
        them tells the rows apart. A categorical key is the columns only where another swept key names the rows:
        a column per model, each with one row, compares nothing."""
        try:
            x = self.main_dim(preferred)
        except ValueError:
            if strict:
                raise
            x = self.main_dim(None)
        swept = self.swept_dims()
        if x is None:
            x = swept[0] if len(swept) > 1 else None
        if x is None or x.numeric:
            return x
        return x if any(d is not x for d in swept) else None

    def facet_dim(self, x: Dimension | None, preferred: str | None = None) -> Dimension | None:
        """The key split into side-by-side panels: ``preferred`` (``"none"`` for no panels), else, among
        :meth:`swept_dims` other than ``x`` and the first (the line colour), the one with the fewest values (2
        to 4)."""
        if preferred is not None:
            return None if preferred == "none" else self.dim(preferred)
        others = [d for d in self.label_dims(self.dims) if d is not x]
        candidates = [d for d in others[1:] if 2 <= len(d.values) <= 4 and d.key not in self.preset_keys]
        return min(candidates, key=lambda d: len(d.values), default=None)

    def series_dims(self, *exclude: Dimension | None) -> list[Dimension]:
        """The dimensions that tell lines apart once ``exclude`` (x axis, panels) are drawn otherwise."""
        return [d for d in self.dims if d not in exclude]

    def label_dims(self, dims: Sequence[Dimension], context: Sequence[Dimension] = ()) -> list[Dimension]:
        """The dimensions of ``dims`` that a label names: every one but the run knobs, and of these only those
        needed to tell apart the configurations over ``dims`` that share a value of each of ``context`` (the keys
        shown otherwise, as a chart's panels): each knob, in order, that splits some configuration the others leave
        together. So two configurations that a label must tell apart never share one."""
        cache_key = (tuple(d.key for d in dims), tuple(d.key for d in context))
        if cache_key not in self._label_dims:
            chosen = [d for d in dims if d not in self.knobs]
            knobs = [d for d in dims if d in self.knobs]
            full = len({self.key_of(run, [*context, *dims]) for run in self.runs})
            for knob in knobs:
                have = len({self.key_of(run, [*context, *chosen]) for run in self.runs})
                if have >= full:
                    break
                if len({self.key_of(run, [*context, *chosen, knob]) for run in self.runs}) > have:
                    chosen.append(knob)
            self._label_dims[cache_key] = [d for d in dims if d in chosen]
        return self._label_dims[cache_key]

    # -------------------------------------------------------------------------------- a run's place
    def key_of(self, run: Run, dims: Iterable[Dimension]) -> tuple[Any, ...]:
        """The run's values of ``dims`` (hashable)."""
        return tuple(_hashable(run.value(d.key)) for d in dims)

    def label(self, run: Run, dims: Sequence[Dimension], context: Sequence[Dimension] = ()) -> str:
        """``additive · heads=1``: the run's values of ``dims`` that labels name (:meth:`label_dims`: no run knob
        unless needed); ``all runs`` when there is none."""
        return " · ".join(d.label(run.value(d.key)) for d in self.label_dims(dims, context)) or "all runs"

    def attribute_keys(self) -> list[str]:
        """The derived keys worth naming beside a configuration (the attention node's keys mirror those shown, and
        a variant's own parameters follow its name): ``normalizer.name``, ``model.short_conv``, ``mask.name``."""
        return [k for k in self.derived if not k.startswith(("attention.", "variant.params."))]

    def attributes_text(self, runs: Sequence[Run], keys: Sequence[str] | None = None) -> str:
        """``normalizer=none · short_conv=4``: the values that ``runs`` (one configuration's) have of ``keys``
        (default :meth:`attribute_keys` and :attr:`pooled`), ``a/b`` where they differ; "" without such keys."""
        parts = []
        for key in [*self.attribute_keys(), *self.pooled] if keys is None else keys:
            found = {format_value(run.value(key)) for run in runs if run.value(key) != MISSING}
            values = sorted(found, key=natural_key)
            if values:
                parts.append(f"{attribute_name(key)}={'/'.join(values)}")
        return " · ".join(parts)

    def constants_text(self) -> tuple[list[str], list[str]]:
        """The constant settings as ``name=value``: (the main ones, for the header; every other one). A key left
        null everywhere (``d_k``) shows the value the runs used when they all used one (``d_k=16``)."""
        main, rest = [], []
        for key, value in self.constants.items():
            if value == MISSING:
                continue
            if value is None and key in RESOLVED_KEYS:
                used = {run.value(key) for run in self.runs}
                value = used.pop() if len(used) == 1 else value
            text = f"{_SHORT.get(key, key)}={format_value(value)}"
            (main if key in _ORDER else rest).append(text)
        return main, rest


def attribute_name(key: str) -> str:
    """An attribute's display name: a known short form (``pos``), ``X.name`` → ``X``, else the last part
    (``model.short_conv`` → ``short_conv``)."""
    if key in _SHORT:
        return _SHORT[key]
    return key[: -len(".name")] if key.endswith(".name") else key.rsplit(".", 1)[-1]


_ALIASES = {"variant": "variant.name", "model": "variant.name"}
"""``--config-keys`` names of the model."""


def _resolve_config_keys(names: Sequence[str], keys: set[str], varying: Sequence[str], strict: bool) -> tuple[str, ...]:
    """The dotted config keys of ``names`` (dotted keys, display names, ``variant`` or ``model``): a ValueError
    naming the keys that vary for one that is no key of these runs (only where ``strict``; else it is left out)."""
    if not names and strict:
        raise ValueError("--config-keys names no key; give the keys that define a configuration, e.g. variant,d_k")
    by_name: dict[str, str] = {}
    for key in sorted(keys, key=_key_order):
        by_name.setdefault(attribute_name(key), key)
    out: list[str] = []
    for name in names:
        key = name if name in keys else _ALIASES.get(name) if _ALIASES.get(name) in keys else by_name.get(name)
        if key is None:
            if not strict:
                continue
            why = " (seeds are replicates, never a configuration key)" if name == "seed" else ""
            shown = list(
                dict.fromkeys(attribute_name(k) for k in varying if not k.startswith(("attention.", "variant.params.")))
            )
            raise ValueError(
                f"--config-keys: {name!r} is not a config key of these runs{why}; allowed: a config key (dotted, or "
                f"its last part), variant or model; those that vary here: {', '.join(shown) or 'none'}"
            )
        if key not in out:
            out.append(key)
    return tuple(out)


def _changed_by_command_line(values: list[Any], owners: list[Any], key: str, setters: list[set[str]]) -> bool:
    """Whether some run's command line set ``key`` (its summary's ``overrides``) to a value other than the one its
    owner's value has in the runs that did not set it (a restated preset changes nothing; an Optuna trial's
    ``d_k=16``, with no run to restate, does)."""
    preset: dict[Any, set[Any]] = {}
    for value, owner, given in zip(values, owners, setters, strict=True):
        if key not in given:
            preset.setdefault(owner, set()).add(value)
    return any(
        key in given and value not in preset.get(owner, ())
        for value, owner, given in zip(values, owners, setters, strict=True)
    )


def _preset_key(key: str, column: dict[str, list[Any]], kept: Sequence[str], setters: list[set[str]]) -> bool:
    """Whether the dimension ``key`` is a preset's (see the module docstring): in the runs whose command line did
    not set it, it takes two or more values and follows another, categorical, dimension."""
    free = [i for i, given in enumerate(setters) if key not in given]
    values = [column[key][i] for i in free]
    if len(set(values)) < 2:
        return False
    return any(
        other != key and _categorical(column[other]) and _function_of(values, [column[other][i] for i in free])
        for other in kept
    )


def _follows(key: str, column: dict[str, list[Any]], kept: Sequence[str]) -> bool:
    """Whether the dimension ``key`` is a function of another kept, categorical, dimension over every run (where
    two follow each other, the one first in ``kept``'s order, the variant before the others, is not the follower)."""
    for other in kept:
        if other == key or not _categorical(column[other]) or len(set(column[other])) < 2:
            continue
        if _function_of(column[key], column[other]):
            mutual = _function_of(column[other], column[key])
            if not mutual or kept.index(other) < kept.index(key):
                return True
    return False


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _key_order(key: str) -> tuple[int, str]:
    """:data:`_ORDER`'s keys first, then the others by name, the ``attention.*`` node's last: its keys mirror the
    command-line keys they interpolate (``variant.params.d_attn`` → ``attention.score_params.d_attn``), so that
    a sweep's dimension is the key that was set."""
    if key in _ORDER:
        return (_ORDER.index(key), "")
    return (len(_ORDER) + key.startswith("attention."), key)


def _categorical(column: list[Any]) -> bool:
    return not all(_is_number(v) or v is None or v == MISSING for v in column)


def _overridden(runs: Sequence[Run]) -> set[str]:
    """The config keys that some run's command line set (summary.json's ``overrides``: ``d_k=8``, ``lr=0.001``)."""
    keys = set()
    for run in runs:
        for item in (run.summary or {}).get("overrides") or []:
            if isinstance(item, str) and "=" in item:
                keys.add(item.split("=", 1)[0].lstrip("+~"))
    return keys


def _function_of(child: list[Any], parent: list[Any]) -> bool:
    """Whether ``child``'s value is fixed by ``parent``'s (one child value per parent value)."""
    seen: dict[Any, Any] = {}
    return all(seen.setdefault(p, c) == c for p, c in zip(parent, child, strict=True))


def _display_names(keys: Sequence[str]) -> dict[str, str]:
    """Short names: a known short form, ``X.name`` → ``X``, else the last part; the full key where two collide."""
    short = {}
    for key in keys:
        if key in _SHORT:
            short[key] = _SHORT[key]
        elif key.endswith(".name"):
            short[key] = key[: -len(".name")]
        else:
            short[key] = key.rsplit(".", 1)[-1]
    counts: dict[str, int] = {}
    for name in short.values():
        counts[name] = counts.get(name, 0) + 1
    return {key: (name if counts[name] == 1 else key) for key, name in short.items()}


def numeric_x(value: Any) -> float | None:
    """A dimension value as an x position (None when it is not a number)."""
    return finite(value) if _is_number(value) else None
