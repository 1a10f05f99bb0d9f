"""Reading run folders for the dashboard: :class:`Run` (one folder's config, summary and metrics) and the search.

Everything goes through :mod:`attnlab.runs`, the one module that knows the run-folder layout; a missing, empty or
corrupt file is one of the run's ``problems``, never an error. ``metrics.jsonl`` is read as a stream into a
:class:`MetricLog`, which keeps only what the page shows (final, step-0 and last per-head values, curves thinned to
:data:`CURVE_POINTS` points): a run's memory does not grow with the number of rows.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import attnlab.stats as core_stats
from attnlab.compat import forward
from attnlab.runs import (
    ATTENTION_DIR,
    RunFileError,
    RunFolder,
    attention_sources,
    config_defaults,
    find_runs,
    flatten_config,
    iter_metrics,
)
from attnlab.runs import load_run as read_run_folder

__all__ = [
    "COMPUTE_FIELDS",
    "CURVE_POINTS",
    "MISSING",
    "NO_SUMMARY",
    "RESOLVED_KEYS",
    "MetricLog",
    "Run",
    "find_run_dirs",
    "load_run",
    "load_runs",
    "natural_key",
    "task_headline",
]

# finite lived here before attnlab.stats: it reads through attnlab.compat's table, with a DeprecationWarning
__getattr__ = forward(__name__)

NO_SUMMARY = "failed (no summary)"
RESOLVED_KEYS = {
    "d_k": "d_k",
    "attention.d_k": "d_k",
    "num_kv_heads": "num_kv_heads",
    "attention.num_kv_heads": "num_kv_heads",
    "model.d_v": "d_v",
    "attention.d_v": "d_v",
}
"""Config keys whose null means "derived from another" (``d_k: null`` = ``d_model // num_heads``, ``num_kv_heads:
null`` = ``num_heads``, ``d_v: null`` = ``d_k``): :meth:`Run.value` reads them as the value the run used (from the
summary), :attr:`Run.raw_value` as written."""
COMPUTE_FIELDS = {
    "params": int,
    "params_non_embedding": int,
    "flops_per_token": float,
    "state_size": int,
    "tokens_per_step": int,
    "tokens_seen": int,
    "step_time_s": float,
    "wall_time_s": float,
}
"""summary.json's compute fields (:class:`attnlab.runs.Summary`, schema 5; ``params``, ``state_size`` and
``wall_time_s`` are older) and their types: :meth:`Run.final` reads them by name (``state_size`` summed over the
layers), so that the metric registry (:mod:`attnlab.dashboard.metrics`) lists them like any metric."""
MISSING = "—"
"""The value of a config key that a run does not have (e.g. ``variant.params.d_attn`` for a dot-product run)."""

_HEAD_KEY = re.compile(r"^attn/L(\d{1,3})H(\d{1,3})/(\w+)$")  # (a bound: a grid is allocated from the numbers)

CURVE_POINTS = 2000
"""The most (step, value) points a run keeps of one metric's curve (16 bytes each: at most 32 KB per metric, whatever
the length of ``metrics.jsonl``). A longer curve is thinned evenly as it is read, its first and last points kept;
the page draws at most :data:`attnlab.dashboard.stats.MAX_CURVE_POINTS` (200) steps per curve anyway."""


def _int(value: Any) -> int | None:
    x = core_stats.finite(value)
    return None if x is None else int(x)


def natural_key(text: Any) -> list[Any]:
    """Sort key that orders ``2_a`` before ``10_a`` and ignores case."""
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", str(text))]


def _dig(mapping: Any, dotted: str) -> Any:
    """``mapping["a"]["b"]`` for ``"a.b"``, or None when a level is missing or not a mapping."""
    node = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


class _Series:
    """What a :class:`MetricLog` keeps of one key: its last finite value, its first finite value at step 0 and its
    curve, thinned as it grows: the points whose index is a multiple of ``stride`` (a power of two), and the last."""

    __slots__ = ("count", "final", "head", "init", "last_step", "last_value", "steps", "stride", "values")

    def __init__(self, key: Any) -> None:
        self.final: float | None = None
        self.init: float | None = None
        self.steps = array("d")
        self.values = array("d")
        self.stride = 1
        self.count = 0  # the curve's points so far, kept or not
        self.last_step = self.last_value = math.nan
        match = _HEAD_KEY.match(key) if isinstance(key, str) else None
        self.head = (match.group(3), int(match.group(1)), int(match.group(2))) if match else None

    def append(self, step: float, value: float) -> None:
        """Add the curve's next point; when the kept points and the last would pass :data:`CURVE_POINTS`, every
        other kept point goes and the stride doubles (so the kept points stay evenly spread, the first among them)."""
        index = self.count
        self.count = index + 1
        self.last_step = step
        self.last_value = value
        if index % self.stride == 0:
            self.steps.append(step)
            self.values.append(value)
            if len(self.steps) > CURVE_POINTS:
                self._thin()
        elif len(self.steps) == CURVE_POINTS:  # the kept points and the last one would pass the bound
            self._thin()

    def _thin(self) -> None:
        self.steps, self.values = self.steps[::2], self.values[::2]
        self.stride *= 2

    def curve(self, stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
        stride = max(stride, self.stride)
        if stride % self.stride:
            raise ValueError(f"stride {stride} is not a multiple of the curve's stride {self.stride}")
        every = stride // self.stride
        steps = np.array(self.steps[::every], dtype=float)
        values = np.array(self.values[::every], dtype=float)
        if self.count and (self.count - 1) % stride:  # the last point, when the stride did not keep it
            steps, values = np.append(steps, self.last_step), np.append(values, self.last_value)
        return steps, values


class MetricLog:
    """What the dashboard keeps of a run's ``metrics.jsonl``, taken in one row at a time (:meth:`add`, :meth:`read`).

    Per key: the last finite value (:meth:`final`), the first finite value in a row with ``step`` 0 (:meth:`init`)
    and the curve over the rows with a finite ``step`` (:meth:`curve`), NaN where the value is null, thinned to at
    most :data:`CURVE_POINTS` points. Per per-head metric (``attn/L{l}H{h}/{metric}``): the values of the last row
    that has it (:meth:`head_grid`). Memory is at most about 32 KB per distinct key, whatever the number of rows.
    """

    def __init__(self, rows: Iterable[dict[str, Any]] = ()) -> None:
        self._series: dict[str, _Series] = {}
        self._heads: dict[str, tuple[int, dict[tuple[int, int], float | None]]] = {}  # metric: (row, cells)
        self.row_count = 0
        """The rows taken in."""
        for row in rows:
            self.add(row)

    def add(self, row: dict[str, Any]) -> None:
        """Take in one row."""
        self.row_count += 1
        raw_step = row.get("step")
        step = core_stats.finite(raw_step)
        at_zero = raw_step == 0
        for key, raw in row.items():
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series(key)
            value = raw if type(raw) is float and raw - raw == 0.0 else core_stats.finite(raw)  # the common case first
            if value is not None:
                series.final = value
                if at_zero and series.init is None:
                    series.init = value
            if step is not None:
                series.append(step, math.nan if value is None else value)
            if series.head is not None:
                metric, layer, head = series.head
                seen = self._heads.get(metric)
                if seen is None or seen[0] != self.row_count:  # the first cell of this metric in this row
                    seen = self._heads[metric] = (self.row_count, {})
                seen[1][layer, head] = value

    def read(self, path: str | Path) -> None:
        """Take in the rows of a ``metrics.jsonl`` file, streamed by :func:`attnlab.runs.iter_metrics` (raising
        its :class:`attnlab.runs.RunFileError`; the rows before an error stay taken in)."""
        for row in iter_metrics(path):
            self.add(row)

    @property
    def keys(self) -> frozenset[str]:
        """Every key of every row (``step`` included)."""
        return frozenset(self._series)

    def final(self, key: str) -> float | None:
        """The last finite value of ``key``."""
        series = self._series.get(key)
        return None if series is None else series.final

    def init(self, key: str) -> float | None:
        """The first finite value of ``key`` in a row whose ``step`` is 0."""
        series = self._series.get(key)
        return None if series is None else series.init

    def curve(self, key: str, stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of ``key`` over the rows with a finite step, NaN where the value is not a finite number;
        every point when there are at most :data:`CURVE_POINTS`, else an even subset with the first and last.

        ``stride`` (a multiple of :meth:`stride`'s): only the points whose index is a multiple of it, and the last.
        """
        series = self._series.get(key)
        return (np.array([], dtype=float), np.array([], dtype=float)) if series is None else series.curve(stride)

    def stride(self, key: str) -> int:
        """How far apart ``key``'s kept points are, counted in points (1: all kept; else a power of two)."""
        series = self._series.get(key)
        return 1 if series is None else series.stride

    def head_grid(self, metric: str) -> np.ndarray | None:
        """A (layers, heads) array of ``attn/L{l}H{h}/{metric}`` from the last row that has any of them, NaN for a
        head that row lacks or has null; None when no row has one."""
        seen = self._heads.get(metric)
        if seen is None:
            return None
        cells = seen[1]
        grid = np.full((1 + max(layer for layer, _ in cells), 1 + max(head for _, head in cells)), np.nan)
        for (layer, head), value in cells.items():
            grid[layer, head] = np.nan if value is None else value
        return grid


@dataclass
class Run:
    """One run folder: its resolved config, its summary (None when the run never wrote one) and what the dashboard
    keeps of its ``metrics.jsonl`` (:class:`MetricLog`: bounded memory, however long the file).

    ``rows``, when given, are taken into ``metric_log`` (a run built in memory); they are not kept.
    """

    path: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    rows: InitVar[Iterable[dict[str, Any]] | None] = None
    problems: list[str] = field(default_factory=list)
    metric_log: MetricLog = field(default_factory=MetricLog, repr=False, compare=False)

    def __post_init__(self, rows: Iterable[dict[str, Any]] | None) -> None:
        for row in rows or ():
            self.metric_log.add(row)

    # -------------------------------------------------------------------------------- identity
    def setting(self, summary_key: str, config_key: str | None = None) -> Any:
        """The summary's value (or its ``settings``' ), else the config's (``config_key`` dotted, or a plain
        top-level value)."""
        if self.summary is not None and self.summary.get(summary_key) is not None:
            return self.summary[summary_key]
        settings = self.summary.get("settings") if self.summary is not None else None
        if isinstance(settings, dict) and settings.get(summary_key) is not None:
            return settings[summary_key]  # a field of layer 1's AttentionConfig
        value = _dig(self.config, config_key or summary_key)
        top = self.config.get(summary_key)  # an old config's plain value (``variant: additive``)
        return top if value is None and top is not None and not isinstance(top, dict) else value

    @functools.cached_property
    def flat(self) -> dict[str, Any]:
        """The config's leaves by dotted key (``{"variant.name": "dot", "d_k": 64, ...}``); lists as tuples (they
        are compared and grouped), an empty mapping as :data:`MISSING`. ``variant.name`` is the variant the run was
        started with (:attr:`variant_choice`: ``rope``, where the config holds its score, ``scaled_dot``)."""
        config = self.config
        if config and "attention" not in config:  # a run older than the attention node: its fields as they were
            config = {**config, "attention": _attention_node(config)}
        elif config and isinstance(config["attention"], dict):  # a field added since (0.4: short_conv) as it ran
            config = {**config, "attention": {**_attention_node(config), **config["attention"]}}
        leaves = flatten_config(config) if config else {}
        flat = {k: MISSING if v == {} else _hashable(v) for k, v in leaves.items()}
        choice = self.model_choice
        if choice is not None and "variant.name" in flat:  # variant=rope: the preset's name, not its score's
            flat["variant.name"] = choice
        return flat

    def value(self, key: str) -> Any:
        """A config leaf by dotted key; :data:`MISSING` when the run's config has no such key, but a top-level or
        ``model.*`` key that a run of an older attnlab lacks reads as its default (``compile: false``,
        ``model.pattern: null``): it ran so. A null of :data:`RESOLVED_KEYS` reads as the value the run used
        (:meth:`resolved`; still null when the run does not say)."""
        value = self.raw_value(key)
        if value is None and key in RESOLVED_KEYS:
            resolved = self.resolved(RESOLVED_KEYS[key])
            return value if resolved is None else resolved
        return value

    def raw_value(self, key: str) -> Any:
        """A config leaf as :meth:`value` reads it, but a null left as null."""
        if key in self.flat:
            return self.flat[key]
        if self.config:
            return config_defaults().get(key, MISSING)
        return MISSING

    def resolved(self, name: str) -> int | None:
        """The value the run used for a setting its config may leave null: ``d_k`` (the summary's, resolved, else
        ``d_model // num_heads``), ``num_kv_heads`` (the summary's ``settings``, else ``num_heads``: multi-head),
        ``d_v`` (the settings', else ``d_k``)."""
        if name == "d_k":
            return self.d_k
        if name == "num_kv_heads":
            return _int(self.setting("num_kv_heads")) or self.num_heads
        if name == "d_v":
            return _int(self.setting("d_v", "model.d_v")) or self.d_k
        raise ValueError(f"no resolved value for {name!r}")

    @property
    def variant_choice(self) -> str | None:
        """The variant the run was started with (``variant=rope`` in the summary's ``overrides``), where it names a
        preset whose score has another name (rope, diff: ``scaled_dot``); None otherwise, and when the command line
        also set ``variant.name`` (``variant=custom variant.name=my_score``: the score's name is the choice)."""
        overrides = self.summary.get("overrides") if self.summary else None
        choice = None
        for item in overrides if isinstance(overrides, list) else []:
            key, _, value = str(item).partition("=")
            key = key.lstrip("+~")
            if key == "variant.name":
                return None
            if key == "variant" and re.fullmatch(r"[\w.-]+", value):
                choice = value
        return choice

    @property
    def model_choice(self) -> str | None:
        """The named model the run is: summary.json's ``model`` where it has one (the ``variant=`` choice, recorded
        by the run), else :attr:`variant_choice`; None when neither names one (``variant=custom
        variant.name=mine``: the score's name, ``variant.name``, names it). A ``model`` of ``custom`` names no
        model (every custom score is one), nor one that is not a plain name."""
        named = self.summary.get("model") if self.summary else None
        if isinstance(named, str) and named != "custom" and re.fullmatch(r"[\w.-]{1,100}", named):
            return named
        return self.variant_choice

    @property
    def model(self) -> str:
        """The run's model: :attr:`model_choice`, else the attention score's name (:attr:`variant`). A model is
        one configuration: what its preset sets (``model.short_conv``, ``normalizer``, ``mask``) are its attributes
        (:class:`attnlab.dashboard.dims.Sweep`)."""
        return self.model_choice or self.variant

    @property
    def test_lengths(self) -> tuple[int, ...]:
        """The run's extra test lengths (``task.datamodule.test_lengths`` in config.yaml, else the lengths its
        ``test/acc@L`` metrics name), ascending; empty for a run without them."""
        given = _dig(self.config, "task.datamodule.test_lengths")
        if isinstance(given, list) and given and all(_int(n) is not None and _int(n) > 0 for n in given):
            return tuple(sorted({_int(n) for n in given}))
        return tuple(self.by_length("test/acc"))

    @functools.cached_property
    def headline_metric(self) -> str:
        """The metric the run's task declares as its headline: summary.json's ``headline_metric`` where the run
        recorded one, else the task's :meth:`~attnlab.tasks.base.SequenceTask.headline_metric` for the run's
        test lengths and ``task.datamodule`` options (:func:`task_headline`): ``test/acc``, ``test/bpc`` for
        language modelling, ``test/acc@<longest>`` for a state-tracking task with ``test_lengths``."""
        recorded = self.summary.get("headline_metric") if self.summary else None
        if isinstance(recorded, str) and re.fullmatch(r"[\w./@-]{1,100}", recorded):
            return recorded
        datamodule = _dig(self.config, "task.datamodule")
        options = {
            k: v
            for k, v in (datamodule or {}).items()
            if isinstance(k, str) and k.isidentifier() and k not in ("_target_", "test_lengths")
        }
        return task_headline(self.task, self.test_lengths, options)

    @property
    def status(self) -> str:
        """``ok``, ``failed``, ``running``, ``interrupted`` (as the summary says), or ``failed (no summary)``."""
        if self.summary is None:
            return NO_SUMMARY
        return str(self.summary.get("status") or "unknown")

    @property
    def ok(self) -> bool:
        """Whether the run finished (only finished runs enter the comparisons)."""
        return self.status == "ok"

    @property
    def reason(self) -> str | None:
        """Why the run failed, when it did."""
        if self.summary is None:
            return "config.yaml without summary.json: the run is unfinished or crashed"
        reason = self.summary.get("reason")
        return None if reason is None else str(reason)

    @property
    def variant(self) -> str:
        """The attention score's name."""
        return str(self.setting("variant", "variant.name") or "?")

    @property
    def mask(self) -> str:
        """The structural mask's name."""
        return str(self.setting("mask", "mask.name") or "?")

    @property
    def task(self) -> str:
        """The task's name."""
        return str(self.setting("task", "task.name") or "?")

    @property
    def num_heads(self) -> int | None:
        """Heads per layer."""
        return _int(self.setting("num_heads"))

    @property
    def d_model(self) -> int | None:
        """Model width."""
        return _int(self.setting("d_model"))

    @property
    def d_k(self) -> int | None:
        """The per-head key size, resolved (``d_model // num_heads`` when the config has null)."""
        value = _int(self.setting("d_k"))
        if value is None and self.d_model and self.num_heads:
            return self.d_model // self.num_heads
        return value

    @property
    def seed(self) -> int | None:
        """The run's seed."""
        return _int(self.setting("seed"))

    @property
    def params(self) -> int | None:
        """Trainable parameters (from the summary)."""
        return _int(self.summary.get("params")) if self.summary else None

    @property
    def state_size(self) -> int | None:
        """The floats per sequence its layers' token-by-token forms carry (the sum of summary.json's
        ``state_size``: linear attention's state, softmax's key/value cache); None for a run before schema 4."""
        sizes = self.summary.get("state_size") if self.summary else None
        if not isinstance(sizes, list) or not sizes or not all(_int(s) is not None for s in sizes):
            return None
        return sum(_int(s) for s in sizes)

    @property
    def wall_time_s(self) -> float | None:
        """Wall time in seconds (from the summary)."""
        return core_stats.finite(self.summary.get("wall_time_s")) if self.summary else None

    @property
    def chance(self) -> float | None:
        """The task's chance accuracy (the summary's ``chance_accuracy``; None for runs older than it)."""
        return core_stats.finite(self.summary.get("chance_accuracy")) if self.summary else None

    @property
    def optimized_metric(self) -> str | None:
        """The config's ``optimized_metric`` (what a sweeper optimises), when it names one."""
        value = self.config.get("optimized_metric")
        return value if isinstance(value, str) and value else None

    # -------------------------------------------------------------------------------- metrics
    def compute(self, name: str) -> float | int | None:
        """A compute field of summary.json (:data:`COMPUTE_FIELDS`: ``flops_per_token``, ``params``, ...; the
        ``state_size`` summed over the layers), an int for a count; None where the summary lacks it (older than
        schema 5) or it is not a finite number."""
        if self.summary is None or name not in COMPUTE_FIELDS:
            return None
        if name == "state_size":
            return self.state_size
        value = core_stats.finite(self.summary.get(name))
        return None if value is None else COMPUTE_FIELDS[name](value)

    def final(self, metric: str) -> float | None:
        """The final value of ``metric``: the summary's, else the last finite value in ``metrics.jsonl``; for a
        compute field (:data:`COMPUTE_FIELDS`), the summary's (:meth:`compute`)."""
        if metric in COMPUTE_FIELDS:
            return self.compute(metric)
        metrics = _dig(self.summary, "metrics") if self.summary is not None else None
        if isinstance(metrics, dict) and core_stats.finite(metrics.get(metric)) is not None:
            return core_stats.finite(metrics[metric])
        return self.metric_log.final(metric)

    @functools.cached_property
    def metric_names(self) -> frozenset[str]:
        """Every metric name in the summary's ``metrics`` or in a ``metrics.jsonl`` row."""
        metrics = _dig(self.summary, "metrics") if self.summary is not None else None
        keys = set(metrics) if isinstance(metrics, dict) else set()
        keys.update(self.metric_log.keys)
        keys.discard("step")
        keys.discard("epoch")
        return frozenset(keys)

    def by_length(self, metric: str) -> dict[int, float]:
        """``{L: final value of "<metric>@<L>"}`` (e.g. ``test/acc@64``) for each test length the run reports with a
        finite value, sorted by ``L``; empty when the run had no ``test_lengths``."""
        found = {}
        for key in self.metric_names:
            head, _, length = key.rpartition("@")
            if head == metric and length.isdigit():
                value = self.final(key)
                if value is not None:
                    found[int(length)] = value
        return dict(sorted(found.items()))

    @property
    def train_length(self) -> int | None:
        """The training sequence length from config.yaml: ``task.datamodule.seq_len``, else ``max_length`` (the
        longest training sequence of a task of varying length), else, for ``associative_recall`` with ``seq_len:
        null``, its shortest length (pairs, one token each when fused, plus queries); None when unknown."""
        datamodule = _dig(self.config, "task.datamodule")
        if not isinstance(datamodule, dict):
            return None
        for key in ("seq_len", "max_length"):
            if _int(datamodule.get(key)):
                return _int(datamodule[key])
        pairs = _int(datamodule.get("num_pairs"))
        if self.task == "associative_recall" and pairs:
            queries = _int(datamodule.get("num_queries")) or pairs
            return pairs * (1 if datamodule.get("fused_pairs") is True else 2) + queries
        return None

    def init(self, metric: str) -> float | None:
        """The step-0 value of a diagnostic: the summary's ``attn_init``, else the step-0 row of ``metrics.jsonl``."""
        init = _dig(self.summary, "attn_init") if self.summary else None
        if isinstance(init, dict) and core_stats.finite(init.get(metric)) is not None:
            return core_stats.finite(init[metric])
        return self.metric_log.init(metric)

    def curve(self, metric: str, stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of ``metric`` over training, NaN where a row has null; rows without the key are skipped.
        At most :data:`CURVE_POINTS` points: a longer curve is thinned evenly, its first and last points kept.

        Runs of different lengths are thinned with different strides (:meth:`curve_stride`); ``stride``, a power of
        two, keeps only the points whose index is a multiple of it (and the last), so that runs logged at the same
        steps share their steps when read at the largest of their strides."""
        return self.metric_log.curve(metric, stride)

    def curve_stride(self, metric: str) -> int:
        """The stride (in points) to which ``metric``'s curve was thinned: 1 for a curve of at most
        :data:`CURVE_POINTS` points, else a power of two."""
        return self.metric_log.stride(metric)

    def head_grid(self, metric: str) -> np.ndarray | None:
        """A (layers, heads) array of ``attn/L{l}H{h}/{metric}`` from the last row with per-head diagnostics."""
        return self.metric_log.head_grid(metric)

    @functools.cached_property
    def pruning(self) -> dict[str, Any] | None:
        """The run's ``pruning.json``, checked (:meth:`attnlab.runs.RunFolder.read_pruning`): head importance and the
        pruning curves; None when there is none, or when it cannot be used (then one line in :attr:`problems`)."""
        if not self.path.is_dir():
            return None
        try:
            return RunFolder(self.path).read_pruning()
        except RunFileError as exc:
            self.problems.append(str(exc))
            return None

    def images(self) -> list[Path]:
        """Saved attention-map images: ``attention_maps.png`` (older runs) first, then ``attention/**/*.png``. A
        symbolic link (file or folder) is left out, and noted once in :attr:`problems`: the page never embeds what
        a link points to."""
        found, links = [], []
        old = self.path / "attention_maps.png"
        (links if old.is_symlink() else found).extend([old] if old.is_symlink() or old.is_file() else [])
        folder = self.path / ATTENTION_DIR
        if folder.is_symlink():
            links.append(folder)
        elif folder.is_dir():
            for dirpath, dirnames, filenames in os.walk(folder):  # (does not enter linked folders)
                for entry in sorted([*dirnames, *filenames]):
                    path = Path(dirpath) / entry
                    if path.is_symlink():
                        links.append(path)
                    elif entry.endswith(".png") and entry in filenames:
                        found.append(path)
        for link in links:
            problem = f"{link} is a symbolic link: not shown (a run's files are never read through links)"
            if problem not in self.problems:
                self.problems.append(problem)
        return found


def task_headline(task: str, test_lengths: Sequence[int] = (), options: dict[str, Any] | None = None) -> str:
    """The headline metric that the task registered as ``task`` declares
    (:meth:`attnlab.tasks.base.SequenceTask.headline_metric`) for these test lengths and ``task.datamodule``
    options; for a name the registry does not know (a task of the user's own module, which the dashboard never
    imports: run folders are untrusted), or options the declaration refuses, the base class's answer."""
    lengths = tuple(sorted({int(n) for n in test_lengths}))
    try:
        frozen = tuple(sorted((k, _frozen(v)) for k, v in (options or {}).items()))
    except TypeError:  # (a value that cannot be compared: the options are left out)
        frozen = ()
    return _task_headline(str(task), lengths, frozen)


@functools.lru_cache(maxsize=256)
def _task_headline(task: str, lengths: tuple[int, ...], options: tuple[tuple[str, Any], ...]) -> str:
    from attnlab.tasks import task_class  # (Lightning: imported only once a run's headline is asked)
    from attnlab.tasks.base import SequenceTask

    try:
        cls = task_class(task)
    except ValueError:  # UnknownNameError: not a built-in task
        cls = SequenceTask
    try:
        return cls.headline_metric(lengths, **dict(options))
    except Exception:  # (a declaration that fails on odd options from a run folder: the default rule)
        return SequenceTask.headline_metric(lengths)


def _frozen(value: Any) -> Any:
    """A config value as a hashable one (lists as tuples, mappings as sorted item tuples)."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    hash(value)
    return value


def find_run_dirs(root: str | Path) -> list[Path]:
    """Run folders under ``root`` (``root`` itself included; see :func:`attnlab.runs.find_runs`), sorted
    naturally (``2_...`` before ``10_...``)."""
    root = Path(root)
    return sorted(find_runs(root), key=lambda p: natural_key(p.relative_to(root).as_posix()))


def load_run(path: str | Path, root: str | Path | None = None) -> Run:
    """Read one run folder through :func:`attnlab.runs.load_run`; its name is the path relative to ``root`` (or the
    folder's name). ``metrics.jsonl`` is streamed once into the run's :class:`MetricLog`: the peak memory is about a
    line of the file plus the log's bound (at most ~32 KB per distinct metric), not the file's size."""
    path = Path(path)
    name = path.name
    if root is not None:
        rel = path.resolve().relative_to(Path(root).resolve()).as_posix()
        name = Path(root).resolve().name if rel == "." else rel
    loaded = read_run_folder(path, rows=False)
    _check_compute(loaded.summary, RunFolder(loaded.path).summary_path, loaded.problems)
    log = MetricLog()
    metrics_path = RunFolder(loaded.path).metrics_path
    try:
        log.read(metrics_path)
    except RunFileError as exc:  # a link, a FIFO, or a read failing part-way (the rows before it stay)
        loaded.problems.append(str(exc))
    return Run(path, name, loaded.config, loaded.summary, problems=loaded.problems, metric_log=log)


def _check_compute(summary: dict[str, Any] | None, source: Path, problems: list[str]) -> None:
    """summary.json's compute fields (:data:`COMPUTE_FIELDS`: ``params``, ``flops_per_token``, ...) are counts and
    amounts: one that is negative or not finite (``NaN``, ``Infinity``, ``-5``: the folder is untrusted data, and
    Python's JSON reads them) is a problem of the run, in the words of a mistyped field, and is ignored (read as
    missing, never plotted or compared). A field of the wrong type is :mod:`attnlab.runs`' to report."""
    if not summary:
        return
    for name in COMPUTE_FIELDS:
        value = summary.get(name)
        items = value if name == "state_size" and isinstance(value, list) else [value]
        numbers = [v for v in items if isinstance(v, int | float) and not isinstance(v, bool)]
        if all(math.isfinite(v) and v >= 0 for v in numbers):
            continue
        text = json.dumps(value, default=str)
        text = text if len(text) <= 40 else text[:37] + "..."
        problems.append(f"{source}: {name} is {text}, which is not a finite number >= 0; ignored")
        summary[name] = None


def load_runs(root: str | Path, runs: Sequence[Path] | None = None) -> list[Run]:
    """Every run under ``root`` (see :func:`find_run_dirs`), or the given run folders."""
    return [load_run(p, root) for p in (find_run_dirs(root) if runs is None else runs)]


def _attention_node(config: dict[str, Any]) -> dict[str, Any]:
    """The ``attention`` node of a config written before it existed, from the keys its fields come from."""
    node: dict[str, Any] = {"_target_": "attnlab.config.AttentionConfig", "backend": "auto"}
    defaults = config_defaults()
    for name, key in attention_sources().items():
        if key.startswith("attention."):  # a field of the node itself: the default it ran with (0.7: output_gate)
            if name not in node and not isinstance(defaults.get(key, {}), dict):
                node[name] = defaults[key]
            continue
        value = _dig(config, key)
        if value is None and key.startswith("model."):
            value = config_defaults().get(key)  # a model key added since (model.short_conv), as the run ran
        if name == "rope":
            value = value if _dig(config, "model.pos_encoding") == "rope" else None
        if value is not None or name not in node:
            node[name] = value
    return node


def _hashable(value: Any) -> Any:
    """A config leaf as a value that can be compared and grouped: lists as tuples, mappings inside them (a list of
    mask specs) as their sorted JSON text."""
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, default=str)
    return value
