"""A self-contained results page (and a terminal table) for a run folder, a multirun folder or a folder of sweeps.

    python -m attnlab.dashboard multirun/2025-01-01/12-00-00_ab12cd        # writes <PATH>/dashboard.html
    attnlab-dashboard multirun/ -o /tmp/all_sweeps.html

It reads only local files that every run leaves behind (``config.yaml``, ``summary.json``, ``metrics.jsonl`` and
the optional ``attention_maps.png`` / ``attention/*.png``), never a W&B server, and writes ONE HTML file that opens
from disk with no network: plotly.js is embedded inline once, images are embedded as data URIs, and a
Content-Security-Policy forbids every fetch.

The page holds a sortable runs table (failed runs in red, with the reason as a tooltip); final metrics and
attention diagnostics against ``d_k`` and ``num_heads`` with the mean and a 95 % t confidence interval across
seeds; the step-0 diagnostics against ``d_k``; length generalisation (``test/acc@L`` against the test length ``L``,
when the runs were given ``task.datamodule.test_lengths``); training curves per variant; per-layer x per-head heatmaps
of the final ``entropy_norm`` and ``saturation``; and a few saved attention-map images.
"""

from __future__ import annotations

import argparse
import base64
import functools
import html
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.runs import CONFIG_FILE, SUMMARY_FILE, find_runs
from attnlab.runs import load_run as read_run_folder

__all__ = [
    "DEFAULT_OUTPUT",
    "Point",
    "Run",
    "Series",
    "aggregate",
    "aggregate_lengths",
    "build_html",
    "find_run_dirs",
    "load_run",
    "load_runs",
    "main",
    "mean_ci",
    "print_table",
    "t_critical",
    "write_dashboard",
]

DEFAULT_OUTPUT = "dashboard.html"
NO_SUMMARY = "failed (no summary)"

ACC_METRICS = ("test/acc", "val/acc_best")
DIAG_METRICS = (
    "attn/entropy_norm",
    "attn/saturation",
    "attn/max_prob",
    "attn/logit_std",
    "attn/row_mass",  # the next three only where the runs logged them (normalizers beyond softmax, diff)
    "attn/support",
    "attn/negative_mass",
)
INIT_METRICS = ("attn/entropy_norm", "attn/saturation", "attn/max_prob", "attn/logit_std", "attn/logit_max")
CURVE_METRICS = ("train/loss", "val/acc", "attn/entropy_norm", "attn/saturation")
HEAD_METRICS = ("entropy_norm", "saturation")
LENGTH_METRICS = ("test/acc", "test/loss", "test/bpc")  # reported as ``<metric>@<L>`` for each test length L
MAX_IMAGES = 8
MAX_IMAGE_BYTES = 2_000_000
MAX_HEATMAP_RUNS = 40  # per variant, in the heatmap dropdown

_HEAD_KEY = re.compile(r"^attn/L(\d+)H(\d+)/(\w+)$")
_GROUP_FIELDS = (  # what must match (besides the plotted x and the seed) for runs to be pooled into one point
    ("variant", "variant"),
    ("variant_params", "params"),
    ("mask", "mask"),
    ("task", "task"),
    ("d_k", "d_k"),
    ("num_heads", "heads"),
    ("d_model", "d_model"),
    ("num_layers", "layers"),
    ("lr", "lr"),
    ("batch_size", "batch"),
    ("max_steps", "steps"),
    ("pos_encoding", "pos"),
    ("normalizer", "norm"),
    ("position_bias", "bias"),
    ("num_kv_heads", "kv"),
    ("qk_norm", "qk_norm"),
    ("softcap", "softcap"),
    ("differential", "diff"),
)
# the length chart pools runs by the same fields and by the training length (one subplot row per task)
_LENGTH_GROUP_FIELDS = (*_GROUP_FIELDS, ("train_length", "train L"))
_CONFIG_KEYS = {  # where a run older than its summary field keeps a setting in config.yaml
    "pos_encoding": "model.pos_encoding",
    "normalizer": "normalizer.name",
    "position_bias": "position_bias.name",
    "differential": "model.differential",
}


# ---------------------------------------------------------------------------------------------------- loading
def _finite(value: Any) -> float | None:
    """``value`` as a float, or None for null / NaN / inf / non-numbers."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _dig(mapping: Any, dotted: str) -> Any:
    """``mapping["a"]["b"]`` for ``"a.b"``, or None when a level is missing or not a mapping."""
    node = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


@dataclass
class Run:
    """One run folder: its resolved config, its summary (None when the run never wrote one) and its metric rows."""

    path: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    # -------------------------------------------------------------------------------- identity
    def _get(self, summary_key: str, config_key: str | None = None) -> Any:
        """The summary's value, else the config's (``config_key`` dotted, or a plain top-level value)."""
        if self.summary is not None and self.summary.get(summary_key) is not None:
            return self.summary[summary_key]
        value = _dig(self.config, config_key or summary_key)
        top = self.config.get(summary_key)
        return top if value is None and top is not None and not isinstance(top, dict) else value

    @property
    def status(self) -> str:
        """``ok``, ``failed``, ``running`` (as the summary says), or ``failed (no summary)``."""
        if self.summary is None:
            return NO_SUMMARY
        return str(self.summary.get("status") or "unknown")

    @property
    def ok(self) -> bool:
        """Whether the run finished (only finished runs enter the comparison plots)."""
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
        return str(self._get("variant", "variant.name") or "?")

    @property
    def mask(self) -> str:
        """The structural mask's name."""
        return str(self._get("mask", "mask.name") or "?")

    @property
    def task(self) -> str:
        """The task's name."""
        return str(self._get("task", "task.name") or "?")

    @property
    def num_heads(self) -> int | None:
        """Heads per layer."""
        return _int(self._get("num_heads"))

    @property
    def d_model(self) -> int | None:
        """Model width."""
        return _int(self._get("d_model"))

    @property
    def d_k_auto(self) -> bool:
        """Whether ``d_k`` was left null in the config (then ``d_model // num_heads``, so it moves with the heads)."""
        return "d_k" in self.config and self.config["d_k"] is None

    @property
    def d_k(self) -> int | None:
        """The per-head key size, resolved (``d_model // num_heads`` when the config has null)."""
        value = _int(self._get("d_k"))
        if value is None and self.d_model and self.num_heads:
            return self.d_model // self.num_heads
        return value

    @property
    def seed(self) -> int | None:
        """The run's seed."""
        return _int(self._get("seed"))

    @property
    def params(self) -> int | None:
        """Trainable parameters (from the summary)."""
        return _int(self.summary.get("params")) if self.summary else None

    @property
    def wall_time_s(self) -> float | None:
        """Wall time in seconds (from the summary)."""
        return _finite(self.summary.get("wall_time_s")) if self.summary else None

    def field_value(self, name: str) -> Any:
        """A config value by summary key (as in ``_GROUP_FIELDS``), normalised for grouping and labels."""
        if name == "d_k":
            return "auto" if self.d_k_auto else self.d_k
        if name == "variant_params":
            params = self._get("variant_params", "variant.params") or {}
            return json.dumps(params, sort_keys=True, default=str) if params else ""
        if name in ("num_heads", "d_model", "num_layers", "batch_size", "max_steps", "seed"):
            return _int(self._get(name))
        if name in ("variant", "mask", "task", "train_length"):
            return getattr(self, name)
        if name in _CONFIG_KEYS:
            return self._get(name, _CONFIG_KEYS[name])
        return self._get(name)

    # -------------------------------------------------------------------------------- metrics
    def final(self, metric: str) -> float | None:
        """The final value of ``metric``: the summary's, else the last finite value in ``metrics.jsonl``."""
        metrics = _dig(self.summary, "metrics") if self.summary is not None else None
        if isinstance(metrics, dict) and _finite(metrics.get(metric)) is not None:
            return _finite(metrics[metric])
        for row in reversed(self.rows):
            value = _finite(row.get(metric))
            if value is not None:
                return value
        return None

    @functools.cached_property
    def _metric_keys(self) -> frozenset[str]:
        """Every metric name in the summary's ``metrics`` or in a ``metrics.jsonl`` row."""
        metrics = _dig(self.summary, "metrics") if self.summary is not None else None
        keys = set(metrics) if isinstance(metrics, dict) else set()
        for row in self.rows:
            keys.update(row)
        return frozenset(keys)

    def by_length(self, metric: str) -> dict[int, float]:
        """``{L: final value of "<metric>@<L>"}`` (e.g. ``test/acc@64``) for each test length the run reports with a
        finite value, sorted by ``L``; empty when the run had no ``test_lengths``."""
        found = {}
        for key in self._metric_keys:
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
        if isinstance(init, dict) and _finite(init.get(metric)) is not None:
            return _finite(init[metric])
        for row in self.rows:
            if row.get("step") == 0 and _finite(row.get(metric)) is not None:
                return _finite(row[metric])
        return None

    def curve(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of ``metric`` over training, NaN where a row has null; rows without the key are skipped."""
        steps, values = [], []
        for row in self.rows:
            if metric in row and _finite(row.get("step")) is not None:
                steps.append(float(row["step"]))
                value = _finite(row[metric])
                values.append(math.nan if value is None else value)
        return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)

    def head_grid(self, metric: str) -> np.ndarray | None:
        """A (layers, heads) array of ``attn/L{l}H{h}/{metric}`` from the last row with per-head diagnostics."""
        for row in reversed(self.rows):
            cells = {}
            for key, value in row.items():
                match = _HEAD_KEY.match(key)
                if match and match.group(3) == metric:
                    cells[(int(match.group(1)), int(match.group(2)))] = _finite(value)
            if cells:
                layers = 1 + max(layer for layer, _ in cells)
                heads = 1 + max(head for _, head in cells)
                grid = np.full((layers, heads), np.nan)
                for (layer, head), value in cells.items():
                    grid[layer, head] = np.nan if value is None else value
                return grid
        return None

    def images(self) -> list[Path]:
        """Saved attention-map images: ``attention_maps.png`` first, then ``attention/**/*.png``."""
        found = [self.path / "attention_maps.png"] if (self.path / "attention_maps.png").is_file() else []
        if (self.path / "attention").is_dir():
            found += sorted(p for p in (self.path / "attention").rglob("*.png") if p.is_file())
        return found

    @property
    def label(self) -> str:
        """A short readable label: variant, d_k, heads and seed."""
        return f"{self.variant} d_k={self.d_k} h={self.num_heads} seed={self.seed}"


def _int(value: Any) -> int | None:
    x = _finite(value)
    return None if x is None else int(x)


def _natural_key(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", text)]


def find_run_dirs(root: str | Path) -> list[Path]:
    """Run folders under ``root`` (``root`` itself included; see :func:`attnlab.runs.find_runs`), sorted
    naturally (``2_...`` before ``10_...``)."""
    root = Path(root)
    return sorted(find_runs(root), key=lambda p: _natural_key(p.relative_to(root).as_posix()))


def load_run(path: str | Path, root: str | Path | None = None) -> Run:
    """Read one run folder through :func:`attnlab.runs.load_run` (a missing, empty or corrupt file is one of the
    run's ``problems``, never an error); its name is the path relative to ``root`` (or the folder's name)."""
    path = Path(path)
    name = path.name
    if root is not None:
        rel = path.resolve().relative_to(Path(root).resolve()).as_posix()
        name = Path(root).resolve().name if rel == "." else rel
    loaded = read_run_folder(path)
    return Run(path, name, loaded.config, loaded.summary, loaded.rows, loaded.problems)


def load_runs(root: str | Path) -> list[Run]:
    """Every run under ``root`` (see ``find_run_dirs``)."""
    return [load_run(p, root) for p in find_run_dirs(root)]


# ---------------------------------------------------------------------------------------------------- statistics
# t_{0.975, df} for df = 1..30 (two-sided 95 %), used when scipy is not importable.
_T975 = (
    12.706204736, 4.302652730, 3.182446305, 2.776445105, 2.570581836, 2.446911851, 2.364624252, 2.306004135,
    2.262157163, 2.228138852, 2.200985160, 2.178812830, 2.160368656, 2.144786688, 2.131449546, 2.119905299,
    2.109815578, 2.100922040, 2.093024054, 2.085963447, 2.079613845, 2.073873068, 2.068657610, 2.063898562,
    2.059538553, 2.055529439, 2.051830516, 2.048407142, 2.045229642, 2.042272456,
)  # fmt: skip


@functools.lru_cache(maxsize=256)
def t_critical(df: int, use_scipy: bool = True) -> float:
    """The two-sided 95 % Student-t quantile ``t_{0.975, df}``: ``scipy.stats.t.ppf`` when scipy is importable,
    else a table (df <= 30) and the Cornish-Fisher expansion around z = 1.959964 (error < 1e-4 for df > 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if use_scipy:
        try:
            from scipy.stats import t

            return float(t.ppf(0.975, df))
        except ImportError:
            pass
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values: Iterable[float | None]) -> tuple[float, float | None, int]:
    """(mean, 95 % CI half-width, n) of the finite ``values``: half-width = t_{0.975, n-1} * s / sqrt(n) with the
    sample standard deviation s; None when n < 2. The mean is NaN when there is no finite value."""
    xs = np.asarray([v for v in (_finite(v) for v in values) if v is not None], dtype=float)
    n = int(xs.size)
    if n == 0:
        return math.nan, None, 0
    mean = float(xs.mean())
    if n < 2:
        return mean, None, n
    return mean, t_critical(n - 1) * float(xs.std(ddof=1)) / math.sqrt(n), n


@dataclass(frozen=True)
class Point:
    """One plotted point: the mean over seeds at ``x``, its CI half-width (None for one seed), n and the values."""

    x: float
    mean: float
    half_width: float | None
    n: int
    values: tuple[float, ...]


@dataclass(frozen=True)
class Series:
    """One line: the runs that share every grouping field except ``x`` and the seed."""

    label: str
    variant: str
    points: tuple[Point, ...]


def aggregate(runs: Sequence[Run], x: str, metric: str, init: bool = False) -> list[Series]:
    """Mean and 95 % CI across seeds of ``metric`` (final value, or the step-0 value with ``init``) against the run
    field ``x`` (``d_k`` or ``num_heads``), one series per combination of the other config fields. Only finished
    (``ok``) runs with a finite value count. The label names the variant and whatever else varies."""
    value_of: Callable[[Run], float | None] = (lambda r: r.init(metric)) if init else (lambda r: r.final(metric))
    usable = [r for r in runs if r.ok and _finite(_x_value(r, x)) is not None]
    # d_k groups as "auto" when the config left it null, so a heads sweep at fixed d_model pools into one line
    fields = [(key, short) for key, short in _GROUP_FIELDS if key != x]
    series = []
    for label, members in _grouped(usable, fields):
        by_x: dict[float, list[float]] = {}
        for run in members:
            value = value_of(run)
            if value is not None:
                by_x.setdefault(float(_x_value(run, x)), []).append(value)
        if by_x:
            series.append(Series(label=label, variant=members[0].variant, points=_points(by_x)))
    return sorted(series, key=lambda s: _natural_key(s.label))


def aggregate_lengths(runs: Sequence[Run], metric: str = "test/acc") -> dict[str, list[Series]]:
    """Length generalisation: per task, the mean and 95 % CI across seeds of ``<metric>@<L>`` against the test
    length ``L``, one series per combination of the grouping fields of :func:`aggregate` and the training length.
    Only finished (``ok``) runs that report ``<metric>@<L>`` count; a task without such runs is absent. A label
    names the variant and whatever else varies among the runs of one task (the task is the key, not in the label)."""
    values = {id(run): run.by_length(metric) for run in runs if run.ok}
    usable = [run for run in runs if values.get(id(run))]
    by_task: dict[str, list[Series]] = {}
    for label, members in _grouped(usable, _LENGTH_GROUP_FIELDS, within="task"):
        by_x: dict[float, list[float]] = {}
        for run in members:
            for length, value in values[id(run)].items():
                by_x.setdefault(float(length), []).append(value)
        series = Series(label=label, variant=members[0].variant, points=_points(by_x))
        by_task.setdefault(members[0].task, []).append(series)
    return {
        task: sorted(series, key=lambda s: _natural_key(s.label))
        for task, series in sorted(by_task.items(), key=lambda kv: _natural_key(kv[0]))
    }


def _grouped(
    runs: Sequence[Run], fields: Sequence[tuple[str, str]], within: str | None = None
) -> list[tuple[str, list[Run]]]:
    """``runs`` pooled by their values of ``fields`` ((key, short name) pairs), each group with its label: the
    variant and ``short=value`` for each other field that varies among ``runs`` -- or, with ``within`` (one of the
    fields, drawn as separate panels and left out of the labels), among the runs sharing a value of ``within``."""
    parts: dict[str, list[Run]] = {}
    for run in runs:
        parts.setdefault(repr(run.field_value(within)) if within else "", []).append(run)
    varying = {key for part in parts.values() for key, _ in fields if len({repr(r.field_value(key)) for r in part}) > 1}
    groups: dict[tuple[str, ...], list[Run]] = {}
    for run in runs:
        groups.setdefault(tuple(repr(run.field_value(key)) for key, _ in fields), []).append(run)
    labelled = []
    for members in groups.values():
        first = members[0]
        extra = [
            f"{short}={first.field_value(key)}"
            for key, short in fields
            if key in varying and key not in ("variant", within)
        ]
        labelled.append((" · ".join([first.variant, *extra]), members))
    return labelled


def _points(by_x: dict[float, list[float]]) -> tuple[Point, ...]:
    """One point per x (sorted): mean and 95 % CI of its values."""
    points = []
    for xv in sorted(by_x):
        mean, half, n = mean_ci(by_x[xv])
        points.append(Point(x=xv, mean=mean, half_width=half, n=n, values=tuple(by_x[xv])))
    return tuple(points)


def _x_value(run: Run, x: str) -> Any:
    return run.d_k if x == "d_k" else run.field_value(x)


# ---------------------------------------------------------------------------------------------------- figures
def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _colors(variants: Sequence[str]) -> dict[str, str]:
    from plotly.colors import qualitative

    palette = qualitative.Plotly + qualitative.D3 + qualitative.Dark24
    return {v: palette[i % len(palette)] for i, v in enumerate(sorted(set(variants), key=_natural_key))}


def _present(runs: Sequence[Run], metrics: Sequence[str], init: bool = False) -> list[str]:
    return [m for m in metrics if any((r.init(m) if init else r.final(m)) is not None for r in runs if r.ok)]


def _comparison_figure(runs: Sequence[Run], x: str, metrics: Sequence[str], colors: dict[str, str], init: bool):
    """Subplots of ``metrics`` against ``x``, one line per series, error bars = 95 % CI across seeds."""
    from plotly.subplots import make_subplots

    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig = make_subplots(
        rows=rows, cols=cols, subplot_titles=list(metrics), horizontal_spacing=0.07, vertical_spacing=0.16
    )
    shown: set[str] = set()
    dash_of: dict[str, str] = {}  # series of one variant share its colour and differ in dash
    xs_all: set[float] = set()
    for i, metric in enumerate(metrics):
        row, col = 1 + i // cols, 1 + i % cols
        for s in aggregate(runs, x, metric, init=init):
            xs_all.update(p.x for p in s.points)
            fig.add_trace(_series_trace(s, x, metric, colors, dash_of, shown), row=row, col=col)
    ticks = sorted(xs_all)
    fig.update_xaxes(
        type="log" if x == "d_k" else "linear",
        tickvals=ticks,
        ticktext=[f"{t:g}" for t in ticks],
        title_text=x,
        title_standoff=4,
    )
    fig.update_layout(
        template="plotly_white",
        height=300 * rows + 70,
        margin={"l": 50, "r": 20, "t": 50, "b": 40},
        legend={"title": {"text": "click to toggle"}},
        hovermode="closest",
    )
    return fig


_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


def _series_trace(s: Series, x: str, metric: str, colors: dict[str, str], dash_of: dict[str, str], shown: set[str]):
    """One series as a line of means with the 95 % CI as error bars (none for one seed), coloured by variant; the
    series of one variant differ in dash (kept in ``dash_of``); a label enters the legend once (``shown``)."""
    import plotly.graph_objects as go

    if s.label not in dash_of:
        siblings = sum(1 for label in dash_of if label.split(" · ")[0] == s.variant)
        dash_of[s.label] = _DASHES[siblings % len(_DASHES)]
    halves = np.array([np.nan if p.half_width is None else p.half_width for p in s.points])
    hover = [
        f"{_e(s.label)}<br>{x}={p.x:g}<br>{metric} = {p.mean:.4g}"
        + (f" ± {p.half_width:.3g} (95% CI, n={p.n} seeds)" if p.half_width is not None else f" (n={p.n} seed)")
        for p in s.points
    ]
    trace = go.Scatter(
        x=np.array([p.x for p in s.points]),
        y=np.array([p.mean for p in s.points]),
        error_y={"type": "data", "array": halves, "visible": True, "thickness": 1.2, "width": 4},
        mode="lines+markers",
        name=_e(s.label),
        legendgroup=_e(s.label),
        showlegend=s.label not in shown,
        line={"color": colors.get(s.variant), "dash": dash_of[s.label]},
        hovertext=hover,
        hoverinfo="text",
    )
    shown.add(s.label)
    return trace


def _length_figure(runs: Sequence[Run], colors: dict[str, str]):
    """Length generalisation: one row per task, test accuracy against the test length L (left) and, where the runs
    report them, test bits per byte (language modelling) or else test loss (right); one line per series (see
    :func:`aggregate_lengths`), error bars = 95 % CI across seeds, the training length as a dashed vertical line.
    The x axis is log-scaled when the lengths (training length included) span more than a factor of 4. None when no
    finished run reports ``test/acc@L``."""
    from plotly.subplots import make_subplots

    acc = aggregate_lengths(runs, "test/acc")
    if not acc:
        return None
    others = {metric: aggregate_lengths(runs, metric) for metric in ("test/bpc", "test/loss")}
    panels = {}  # task -> [(metric, series), ...]: accuracy, then bpc (LM tasks) or else loss
    for task, series in acc.items():
        panels[task] = [("test/acc", series)]
        other = next((metric for metric in ("test/bpc", "test/loss") if task in others[metric]), None)
        if other is not None:
            panels[task].append((other, others[other][task]))
    rows, cols = len(panels), max(len(p) for p in panels.values())
    titles = []
    for task, task_panels in panels.items():
        names = [f"{metric}@L" for metric, _ in task_panels] + [""] * (cols - len(task_panels))
        titles += [_e(f"{task}: {name}") if name and rows > 1 else name for name in names]
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=titles,
        horizontal_spacing=0.08,
        vertical_spacing=min(0.16, 0.9 / max(1, rows - 1)),
    )
    shown: set[str] = set()
    dash_of: dict[str, str] = {}
    for row, (task, task_panels) in enumerate(panels.items(), start=1):
        members = [r for r in runs if r.ok and r.task == task and r.by_length("test/acc")]
        trained = sorted({r.train_length for r in members} - {None})
        lengths = sorted({p.x for _, series in task_panels for s in series for p in s.points} | set(trained))
        log = max(lengths) > 4 * min(lengths)
        for col, (metric, series) in enumerate(task_panels, start=1):
            for s in series:
                fig.add_trace(_series_trace(s, "L", f"{metric}@L", colors, dash_of, shown), row=row, col=col)
            for length in trained:
                fig.add_vline(x=length, line={"dash": "dash", "color": "#888", "width": 1.2}, row=row, col=col)
                fig.add_annotation(
                    x=math.log10(length) if log else length,  # annotations on a log axis take log10 positions
                    y=1.0,
                    xref="x",
                    yref="y domain",
                    text=f"train L={length}",
                    showarrow=False,
                    xanchor="left",
                    yanchor="top",
                    font={"size": 10, "color": "#666"},
                    row=row,
                    col=col,
                )
            fig.update_xaxes(
                type="log" if log else "linear",
                tickvals=lengths,
                ticktext=[f"{t:g}" for t in lengths],
                title_text="test length L",
                title_standoff=4,
                row=row,
                col=col,
            )
            name = {"test/acc": "accuracy", "test/bpc": "bits per byte"}.get(metric, "loss")
            fig.update_yaxes(title_text=f"test {name}", title_standoff=4, row=row, col=col)
        for col in range(len(task_panels) + 1, cols + 1):  # a task without a second panel: no empty axes
            fig.update_xaxes(visible=False, row=row, col=col)
            fig.update_yaxes(visible=False, row=row, col=col)
    fig.update_layout(
        template="plotly_white",
        height=320 * rows + 70,
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        legend={"title": {"text": "click to toggle"}},
        hovermode="closest",
    )
    return fig


def _curves_figure(runs: Sequence[Run], colors: dict[str, str]):
    """Training curves over steps (step 0 included), one line per run, coloured and legend-grouped by variant."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=2, subplot_titles=list(CURVE_METRICS), horizontal_spacing=0.08)
    shown: set[str] = set()
    for i, metric in enumerate(CURVE_METRICS):
        row, col = 1 + i // 2, 1 + i % 2
        for run in runs:
            steps, values = run.curve(metric)
            if steps.size == 0:
                continue
            fig.add_trace(
                go.Scatter(
                    x=steps,
                    y=values,
                    mode="lines+markers" if steps.size <= 12 else "lines",
                    marker={"size": 4},
                    name=_e(run.variant),
                    legendgroup=_e(run.variant),
                    showlegend=run.variant not in shown,
                    line={"color": colors.get(run.variant), "width": 1.3, "dash": "solid" if run.ok else "dot"},
                    opacity=0.85,
                    hovertext=_e(f"{run.name} ({run.status})"),
                    hovertemplate="%{hovertext}<br>step %{x}: %{y:.4g}<extra></extra>",
                ),
                row=row,
                col=col,
            )
            shown.add(run.variant)
    fig.update_xaxes(title_text="step", title_standoff=4)
    fig.update_layout(
        template="plotly_white",
        height=680,
        margin={"l": 50, "r": 20, "t": 50, "b": 40},
        legend={"title": {"text": "variant (click to toggle)"}},
        hovermode="closest",
    )
    return fig


def _heatmap_figure(variant: str, runs: Sequence[Run]):
    """Final per-layer x per-head entropy_norm and saturation for the runs of one variant, a dropdown selecting the
    run (the first is shown). None when no run of the variant logged per-head diagnostics."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    grids = []
    for run in runs:
        pair = [run.head_grid(m) for m in HEAD_METRICS]
        if all(g is not None for g in pair):
            grids.append((run, pair))
        if len(grids) >= MAX_HEATMAP_RUNS:
            break
    if not grids:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=[f"final {m}" for m in HEAD_METRICS], horizontal_spacing=0.12)
    for i, (_, pair) in enumerate(grids):
        for j, grid in enumerate(pair):
            layers, heads = grid.shape
            fig.add_trace(
                go.Heatmap(
                    z=grid,
                    x=[f"H{h}" for h in range(heads)],
                    y=[f"L{layer}" for layer in range(layers)],
                    coloraxis="coloraxis",
                    texttemplate="%{z:.2f}",
                    hovertemplate=f"{HEAD_METRICS[j]} %{{y}} %{{x}}: %{{z:.3f}}<extra></extra>",
                    visible=i == 0,
                ),
                row=1,
                col=1 + j,
            )
    buttons = []
    for i, (run, _) in enumerate(grids):
        visible = [k // len(HEAD_METRICS) == i for k in range(len(grids) * len(HEAD_METRICS))]
        buttons.append({"label": _e(run.label), "method": "restyle", "args": [{"visible": visible}]})
    # the run selector sits at the right, above the subplot titles (pad b)
    menu = {"buttons": buttons, "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom", "pad": {"b": 30}}
    fig.update_yaxes(autorange="reversed", title_text="layer")
    fig.update_xaxes(title_text="head", title_standoff=4)
    fig.update_layout(
        template="plotly_white",
        height=150 + max(140, 55 * max(pair[0].shape[0] for _, pair in grids)),
        margin={"l": 50, "r": 20, "t": 100, "b": 50},
        coloraxis={"colorscale": "Viridis", "cmin": 0.0, "cmax": 1.0},
        title={"text": _e(variant), "x": 0.0, "xanchor": "left", "y": 0.98, "yanchor": "top"},
        updatemenus=[menu] if len(buttons) > 1 else [],
    )
    return fig


# ---------------------------------------------------------------------------------------------------- html
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
    "font-src data:; connect-src 'none'"
)
_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2rem 2rem;color:#222;max-width:1700px}
.scroll{overflow-x:auto}
h1{margin:.2rem 0}h2{margin-top:2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
.meta,.note{color:#666;font-size:.9rem}nav a{margin-right:1rem}
table.runs{border-collapse:collapse;font-size:.85rem;width:100%}
table.runs th,table.runs td{border-bottom:1px solid #eee;padding:.25rem .5rem;text-align:right;white-space:nowrap}
table.runs th{cursor:pointer;background:#f6f6f6;position:sticky;top:0;user-select:none}
table.runs th[data-dir=asc]::after{content:" ▲"}table.runs th[data-dir=desc]::after{content:" ▼"}
table.runs td.t,table.runs th.t{text-align:left}
tr.failed td{color:#c62828}tr.failed td.status{font-weight:600;cursor:help}tr.running td{color:#a15c00}
.figs img{max-width:100%;border:1px solid #ddd}.figs figure{display:inline-block;margin:.5rem;vertical-align:top}
figcaption{font-size:.8rem;color:#555;max-width:600px;overflow-wrap:anywhere}
#js-errors{color:#c62828;white-space:pre-wrap;font-family:monospace}#js-errors:empty{display:none}
"""
_ERROR_JS = """
(function(){var q=[];function render(){var d=document.getElementById('js-errors');if(d){d.textContent=q.join('\\n');}}
function add(m){q.push(m);render();}
window.addEventListener('error',function(e){add('Error: '+e.message+' (line '+e.lineno+')');});
window.addEventListener('unhandledrejection',function(e){add('Unhandled rejection: '+e.reason);});
document.addEventListener('securitypolicyviolation',function(e){add('CSP: '+e.violatedDirective+' '+e.blockedURI);});
document.addEventListener('DOMContentLoaded',render);})();
"""
_SORT_JS = """
document.querySelectorAll('table.sortable th').forEach(function(th,i){th.addEventListener('click',function(){
var tb=th.closest('table').tBodies[0],rows=Array.prototype.slice.call(tb.rows),asc=th.dataset.dir!=='asc';
th.closest('tr').querySelectorAll('th').forEach(function(h){delete h.dataset.dir;});th.dataset.dir=asc?'asc':'desc';
function key(r){var v=r.cells[i].dataset.v;return v===undefined?r.cells[i].textContent:v;}
rows.sort(function(a,b){var x=key(a),y=key(b);if(x===''&&y!=='')return 1;if(y===''&&x!=='')return -1;
var nx=Number(x),ny=Number(y),c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y,undefined,{numeric:true});
return asc?c:-c;});rows.forEach(function(r){tb.appendChild(r);});});});
"""


def _fmt(value: float | int | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "time":
        return f"{value:.1f} s" if value < 120 else f"{int(value // 60)}m {int(value % 60):02d}s"
    return f"{value:.3f}"


def _table_rows(run: Run) -> list[tuple[str, str, Any, str]]:
    """(header, text, sort value, css class) for each column of one run."""
    final = run.final
    return [
        ("run", run.name, run.name, "t"),
        ("variant", run.variant, run.variant, "t"),
        ("mask", run.mask, run.mask, "t"),
        ("task", run.task, run.task, "t"),
        ("d_k", _fmt(run.d_k, "int"), run.d_k, ""),
        ("heads", _fmt(run.num_heads, "int"), run.num_heads, ""),
        ("d_model", _fmt(run.d_model, "int"), run.d_model, ""),
        ("seed", _fmt(run.seed, "int"), run.seed, ""),
        ("params", _fmt(run.params, "int"), run.params, ""),
        ("best val acc", _fmt(final("val/acc_best"), "pct"), final("val/acc_best"), ""),
        ("test acc", _fmt(final("test/acc"), "pct"), final("test/acc"), ""),
        ("entropy_norm", _fmt(final("attn/entropy_norm"), "f"), final("attn/entropy_norm"), ""),
        ("saturation", _fmt(final("attn/saturation"), "f"), final("attn/saturation"), ""),
        ("status", run.status, run.status, "t status"),
        ("wall time", _fmt(run.wall_time_s, "time"), run.wall_time_s, ""),
    ]


def _runs_table(runs: Sequence[Run]) -> str:
    header = "".join(f'<th class="{cls}" data-key="{_e(h)}">{_e(h)}</th>' for h, _, _, cls in _table_rows(runs[0]))
    body = []
    for run in runs:
        row_class = "ok" if run.ok else ("running" if run.status == "running" else "failed")
        title = f' title="{_e(run.reason)}"' if run.reason and not run.ok else ""
        cells = []
        for h, text, sort_value, cls in _table_rows(run):
            v = "" if sort_value is None else sort_value
            tip = title if h == "status" else (f' title="{_e(run.path)}"' if h == "run" else "")
            cells.append(f'<td class="{cls}" data-v="{_e(v)}"{tip}>{_e(text)}</td>')
        body.append(f'<tr class="{row_class}"{title}>{"".join(cells)}</tr>')
    return (
        f'<table class="runs sortable" id="runs-table"><thead><tr>{header}</tr></thead>'
        f"<tbody>\n{chr(10).join(body)}\n</tbody></table>"
    )


def _figure_html(fig: Any, div_id: str) -> str:
    return fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        default_height=f"{fig.layout.height}px",
        config={"displaylogo": False, "responsive": True},
    )


def _images_html(runs: Sequence[Run]) -> str:
    """A few saved attention-map images: the first run of each variant that saved one, as data URIs."""
    figures, seen = [], set()
    for run in sorted(runs, key=lambda r: (not r.ok, _natural_key(r.name))):
        if run.variant in seen or len(figures) >= MAX_IMAGES:
            continue
        for image in run.images():
            data = image.read_bytes()
            if len(data) > MAX_IMAGE_BYTES:
                continue
            uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
            caption = f"{run.label} — {run.name}/{image.relative_to(run.path).as_posix()}"
            figures.append(
                f'<figure><img src="{uri}" alt="{_e(caption)}"><figcaption>{_e(caption)}</figcaption></figure>'
            )
            seen.add(run.variant)
            break
    if not figures:
        return '<p class="note">No run saved attention_maps.png or attention/*.png.</p>'
    return '<div class="figs">' + "".join(figures) + "</div>"


def build_html(runs: Sequence[Run], title: str = "attnlab results", source: str = "") -> str:
    """The whole self-contained page for ``runs`` (plotly.js inline once, every name HTML-escaped)."""
    from plotly.offline import get_plotlyjs

    if not runs:
        raise ValueError("no runs to show")
    colors = _colors([r.variant for r in runs])
    ok_runs = [r for r in runs if r.ok]
    sections: list[tuple[str, str, str]] = []  # (anchor, heading, html)

    acc = [m for m in ACC_METRICS if m in _present(runs, ACC_METRICS)]
    final_metrics = acc + _present(runs, DIAG_METRICS)
    for x, anchor, heading in (("d_k", "vs-dk", "Final metrics vs d_k"), ("num_heads", "vs-heads", "vs num_heads")):
        distinct = {_x_value(r, x) for r in ok_runs} - {None}
        if not final_metrics or len(distinct) < 2:
            body = f'<p class="note">{_e(x)} has {len(distinct)} value(s) among finished runs: nothing to compare.</p>'
        else:
            body = _figure_html(_comparison_figure(runs, x, final_metrics, colors, init=False), f"fig-{anchor}")
        sections.append((anchor, heading, body))
    init_metrics = _present(runs, INIT_METRICS, init=True)
    if init_metrics and len({r.d_k for r in ok_runs} - {None}) >= 2:
        body = _figure_html(_comparison_figure(runs, "d_k", init_metrics, colors, init=True), "fig-init")
    else:
        body = '<p class="note">No step-0 diagnostics (attn_init) for two or more d_k values.</p>'
    sections.append(("init", "At initialisation (step 0) vs d_k", body))

    length_fig = _length_figure(runs, colors)
    if length_fig is not None:  # only when some finished run reports test/acc@L (task.datamodule.test_lengths)
        trained = any(r.train_length is not None for r in ok_runs if r.by_length("test/acc"))
        note = (
            '<p class="note">Test accuracy on the extra test sets of each length L (<code>task.datamodule.'
            "test_lengths</code>; right: test loss, or bits per byte for language modelling), one line per variant "
            "and setting, mean over seeds with the 95 % t interval"
            + ("; the dashed line marks the training length.</p>" if trained else ".</p>")
        )
        sections.append(("lengths", "Length generalisation", note + _figure_html(length_fig, "fig-lengths")))

    if any(run.rows for run in runs):
        body = _figure_html(_curves_figure(runs, colors), "fig-curves")
    else:
        body = '<p class="note">No metrics.jsonl rows.</p>'
    sections.append(("curves", "Training curves", body))

    heat = []
    by_variant: dict[str, list[Run]] = {}
    for run in sorted(runs, key=lambda r: (not r.ok, _natural_key(r.name))):
        by_variant.setdefault(run.variant, []).append(run)
    for variant, members in sorted(by_variant.items(), key=lambda kv: _natural_key(kv[0])):
        fig = _heatmap_figure(variant, members)
        if fig is not None:
            heat.append(_figure_html(fig, f"fig-heads-{len(heat)}"))
    sections.append(
        (
            "heads",
            "Per layer × head (final entropy_norm, saturation)",
            "".join(heat) or '<p class="note">No per-head diagnostics (attn/L{l}H{h}/...) in metrics.jsonl.</p>',
        )
    )
    sections.append(("maps", "Attention maps", _images_html(runs)))

    counts: dict[str, int] = {}
    for run in runs:
        counts[run.status] = counts.get(run.status, 0) + 1
    meta = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    nav = "".join(f'<a href="#{a}">{_e(h)}</a>' for a, h, _ in [("runs", "Runs", ""), *sections])
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style>",
        f"<script>{_ERROR_JS}</script>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>',
        "</head><body>",
        '<div id="js-errors"></div>',
        f"<h1>{_e(title)}</h1>",
        f'<p class="meta">{_e(source)} · {len(runs)} runs ({_e(meta)}) · generated '
        f"{datetime.now().strftime('%Y-%m-%d %H:%M')}. Points are the mean over seeds; error bars the 95 % "
        "t confidence interval (shown for 2 or more seeds).</p>",
        f"<nav>{nav}</nav>",
        '<section id="runs"><h2>Runs</h2><p class="note">Click a header to sort; failed runs are red (hover '
        f'the status for the reason).</p><div class="scroll">{_runs_table(runs)}</div></section>',
    ]
    parts += [f'<section id="{a}"><h2>{_e(h)}</h2>{body}</section>' for a, h, body in sections]
    parts += [f"<script>{_SORT_JS}</script>", "</body></html>"]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------- terminal
def print_table(runs: Sequence[Run], console: Any = None) -> None:
    """A compact rich table of ``runs`` (mask and task columns only when they vary); 120 columns wide when the
    output is not a terminal (CI logs)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=120)
    extra = [name for name in ("mask", "task") if len({getattr(r, name) for r in runs}) > 1]
    table = Table(title=f"attnlab · {len(runs)} runs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ["variant", *extra, "d_k", "heads", "seed", "val best", "test", "ent_n", "sat", "status", "time"]:
        text_col = col in ("variant", "mask", "task")
        table.add_column(col, justify="left" if text_col or col == "status" else "right", no_wrap=not text_col)
    for run in runs:
        style = "" if run.ok else ("yellow" if run.status == "running" else "red")
        table.add_row(
            Text(run.variant, overflow="ellipsis"),
            *[Text(getattr(run, name), overflow="ellipsis") for name in extra],
            _fmt(run.d_k, "int"),
            _fmt(run.num_heads, "int"),
            _fmt(run.seed, "int"),
            _fmt(run.final("val/acc_best"), "pct"),
            _fmt(run.final("test/acc"), "pct"),
            _fmt(run.final("attn/entropy_norm"), "f"),
            _fmt(run.final("attn/saturation"), "f"),
            Text(run.status),
            _fmt(run.wall_time_s, "time"),
            style=style,
        )
    console.print(table)


# ---------------------------------------------------------------------------------------------------- entry points
def write_dashboard(path: str | Path, output: str | Path | None = None, runs: Sequence[Run] | None = None) -> Path:
    """Write the page for the runs under ``path`` (or the given ``runs``) to ``output`` (default
    ``<path>/dashboard.html``) and return its path.

    Raises FileNotFoundError when ``path`` is not a folder and ValueError when it holds no run."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder")
    runs = load_runs(root) if runs is None else runs
    if not runs:
        raise ValueError(f"no runs under {root} (no {SUMMARY_FILE} or {CONFIG_FILE} found)")
    out = Path(output) if output is not None else root / DEFAULT_OUTPUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_html(runs, title=f"attnlab · {root.resolve().name}", source=str(root)), encoding="utf-8")
    return out


CSV_METRICS = (
    "val/acc_best",
    "test/acc",
    "test/loss",
    "attn/entropy_norm",
    "attn/saturation",
    "attn/max_prob",
    "attn/logit_std",
    "attn/attn_distance",
    "attn/row_mass",
    "attn/support",
    "attn/negative_mass",
)
CSV_SETTINGS = ("normalizer", "position_bias", "num_kv_heads", "qk_norm", "softcap", "differential")


def write_csv(runs: Sequence[Run], path: str | Path) -> Path:
    """One row per run: identity, key config values, final metrics, step-0 (``init/...``) diagnostics, settings,
    and ``test/acc@L`` (``test/loss@L``, ``test/bpc@L``) for every test length any run reports."""
    import csv

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = ["run", "variant", "variant_params", "mask", "task", "pos_encoding", "d_k", "num_heads", "d_model"]
    columns += ["seed", "params", "status", "reason", "wall_time_s", *CSV_METRICS]
    columns += [f"init/{m}" for m in CSV_METRICS if m.startswith("attn/")]
    columns += list(CSV_SETTINGS)
    # length generalisation (task.datamodule.test_lengths): test/acc@L, then test/loss@L, then test/bpc@L
    lengths = [f"{m}@{n}" for m in LENGTH_METRICS for n in sorted({n for r in runs for n in r.by_length(m)})]
    columns += lengths
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for run in runs:
            row = [
                run.name,
                run.variant,
                run.field_value("variant_params"),
                run.mask,
                run.task,
                run.field_value("pos_encoding"),
                run.d_k,
            ]
            row += [run.num_heads, run.d_model, run.seed, run.params, run.status, run.reason or ""]
            row += [None if run.wall_time_s is None else round(run.wall_time_s, 1)]
            row += [run.final(m) for m in CSV_METRICS]
            row += [run.init(m) for m in CSV_METRICS if m.startswith("attn/")]
            row += [run.field_value(k) for k in CSV_SETTINGS]
            row += [run.final(m) for m in lengths]
            writer.writerow(["" if v is None else v for v in row])
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``attnlab-dashboard PATH [-o FILE]``: write the page and print the runs table; 2 on a bad PATH."""
    parser = argparse.ArgumentParser(prog="attnlab-dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a run folder, a multirun folder, or a folder of sweeps")
    parser.add_argument("-o", "--output", type=Path, default=None, help=f"output file (default PATH/{DEFAULT_OUTPUT})")
    parser.add_argument("--csv", type=Path, default=None, help="also write one CSV row per run to this file")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.path) if args.path.is_dir() else []
        out = write_dashboard(args.path, args.output, runs=runs)
    except (FileNotFoundError, ValueError) as err:
        print(f"attnlab-dashboard: error: {err}", file=sys.stderr)
        return 2
    for run in runs:
        for problem in run.problems:
            print(f"attnlab-dashboard: warning: run {run.name}: {problem}", file=sys.stderr)
    print_table(runs)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    if args.csv is not None:
        print(f"wrote {write_csv(runs, args.csv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
