"""Statistics over seeds: the mean and 95 % t interval per configuration, series against a swept key, curves with
bands, and the headline table that names the winner.

Every interval in attnlab is the mean over seeds ± the half-width ``t_{0.975, n-1} · s / sqrt(n)`` (sample
standard deviation ``s``, ``n`` seeds); with one seed there is no interval. Only finished (``ok``) runs count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnlab.dashboard.dims import Dimension, Sweep, numeric_x
from attnlab.dashboard.load import Run, finite
from attnlab.dashboard.metrics import MetricSpec, spec_for

__all__ = [
    "Cell",
    "Curve",
    "Headline",
    "Point",
    "Series",
    "aggregate",
    "best_run",
    "best_runs",
    "curves",
    "headline",
    "mean_ci",
    "t_critical",
]

MAX_CURVE_POINTS = 200  # a curve with more steps is thinned evenly (first and last step kept)

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
    xs = np.asarray([v for v in (finite(v) for v in values) if v is not None], dtype=float)
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

    def interval(self, spec: MetricSpec) -> tuple[float, float] | None:
        """(low, high) of the 95 % interval, clipped to the metric's range; None for one seed."""
        if self.half_width is None:
            return None
        low, high = self.mean - self.half_width, self.mean + self.half_width
        if spec.low is not None:
            low = max(low, spec.low)
        if spec.high is not None:
            high = min(high, spec.high)
        return low, high


@dataclass(frozen=True)
class Series:
    """One line: the runs that share every value of the series dimensions, pooled over seeds at each x."""

    label: str
    key: tuple[Any, ...]
    points: tuple[Point, ...]


def _points(by_x: dict[float, list[float]]) -> tuple[Point, ...]:
    points = []
    for xv in sorted(by_x):
        mean, half, n = mean_ci(by_x[xv])
        points.append(Point(x=xv, mean=mean, half_width=half, n=n, values=tuple(by_x[xv])))
    return tuple(points)


def x_position(dim: Dimension | None, value: Any) -> float | None:
    """Where a run sits on the x axis: the value for a numeric key, the value's index for a categorical one, 0
    without a key."""
    if dim is None:
        return 0.0
    if dim.numeric:
        return numeric_x(value)
    return float(dim.values.index(value)) if value in dim.values else None


def grouped(runs: Sequence[Run], sweep: Sweep, dims: Sequence[Dimension]) -> list[tuple[str, tuple, list[Run]]]:
    """``runs`` pooled by their values of ``dims``: (label, key, members), in the order of the values."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(sweep.key_of(run, dims), []).append(run)
    order = {d.key: {v: i for i, v in enumerate(d.values)} for d in dims}
    ranked = sorted(groups, key=lambda k: [order[d.key].get(v, -1) for d, v in zip(dims, k, strict=True)])
    return [(sweep.label(groups[k][0], dims), k, groups[k]) for k in ranked]


def aggregate(
    runs: Sequence[Run],
    sweep: Sweep,
    metric: str,
    x: Dimension | None,
    series_dims: Sequence[Dimension],
    value: Callable[[Run, str], float | None] | None = None,
) -> list[Series]:
    """Mean and 95 % CI across seeds of ``metric`` (each run's final value, or ``value(run, metric)``) against
    the swept key ``x``, one series per combination of ``series_dims``. Only finished runs with a finite value."""
    value = value or (lambda run, name: run.final(name))
    out = []
    for label, key, members in grouped([r for r in runs if r.ok], sweep, series_dims):
        by_x: dict[float, list[float]] = {}
        for run in members:
            xv, v = x_position(x, run.value(x.key) if x else None), value(run, metric)
            if xv is not None and v is not None:
                by_x.setdefault(xv, []).append(v)
        if by_x:
            out.append(Series(label, key, _points(by_x)))
    return out


def aggregate_lengths(runs: Sequence[Run], sweep: Sweep, metric: str, series_dims: Sequence[Dimension]) -> list[Series]:
    """``<metric>@<L>`` against the test length ``L``, one series per combination of ``series_dims``, mean and 95 %
    CI across seeds; only finished runs that report the metric at some length."""
    out = []
    for label, key, members in grouped([r for r in runs if r.ok], sweep, series_dims):
        by_x: dict[float, list[float]] = {}
        for run in members:
            for length, v in run.by_length(metric).items():
                by_x.setdefault(float(length), []).append(v)
        if by_x:
            out.append(Series(label, key, _points(by_x)))
    return out


@dataclass(frozen=True)
class Curve:
    """A training curve pooled over seeds: at each step the mean, the 95 % band (NaN for one seed) and n."""

    label: str
    key: tuple[Any, ...]
    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    n: np.ndarray


def curves(runs: Sequence[Run], sweep: Sweep, metric: str, series_dims: Sequence[Dimension]) -> list[Curve]:
    """One :class:`Curve` of ``metric`` per combination of ``series_dims`` (finished and failed runs alike: a
    failed run's curve shows where it went wrong), the band clipped to the metric's range."""
    spec = spec_for(metric)
    out = []
    for label, key, members in grouped(runs, sweep, series_dims):
        at: dict[float, list[float]] = {}
        stride = max(run.curve_stride(metric) for run in members)  # long curves are thinned: pool on shared steps
        for run in members:
            steps, values = run.curve(metric, stride)
            for s, v in zip(steps, values, strict=True):
                if math.isfinite(v):
                    at.setdefault(float(s), []).append(float(v))
        if not at:
            continue
        steps = np.array(sorted(at))
        if steps.size > MAX_CURVE_POINTS:
            steps = steps[np.unique(np.linspace(0, steps.size - 1, MAX_CURVE_POINTS).round().astype(int))]
        stats = [mean_ci(at[s]) for s in steps]
        mean = np.array([m for m, _, _ in stats])
        half = np.array([math.nan if h is None else h for _, h, _ in stats])
        low, high = mean - half, mean + half
        if spec.low is not None:
            low = np.maximum(low, spec.low)
        if spec.high is not None:
            high = np.minimum(high, spec.high)
        out.append(Curve(label, key, steps, mean, low, high, np.array([n for _, _, n in stats])))
    return out


# ---------------------------------------------------------------------------------------------------- headline
@dataclass(frozen=True)
class Cell:
    """One configuration at one value of the main key: mean, 95 % half-width (None for one seed), seeds, params."""

    mean: float
    half_width: float | None
    n: int
    params: tuple[int, ...] = ()

    def half_text(self, spec: MetricSpec) -> str:
        """`` ± 1.2``: the half-width in the metric's display unit (points for a percentage); "" for one seed."""
        return "" if self.half_width is None else f" ± {self.half_width * spec.scale():.{2 if spec.percent else 3}g}"

    def text(self, spec: MetricSpec) -> str:
        """``87.5 % ± 1.2 (2)``: the mean ± the half-width (in the metric's display unit) and the seeds."""
        return f"{spec.format(self.mean)}{self.half_text(spec)} ({self.n})"

    def bounds(self) -> tuple[float, float] | None:
        return None if self.half_width is None else (self.mean - self.half_width, self.mean + self.half_width)


@dataclass
class Headline:
    """The headline table of one metric: one row per configuration (every dimension but the main key), one
    column per value of the main key, the best cell of each column, and the sentence that names the winner."""

    metric: str
    spec: MetricSpec
    column: Dimension | None
    columns: list[Any]
    rows: list[tuple[str, tuple[Any, ...]]]
    cells: dict[tuple[tuple[Any, ...], Any], Cell] = field(default_factory=dict)
    best: dict[Any, tuple[Any, ...]] = field(default_factory=dict)

    def column_label(self, value: Any) -> str:
        return self.column.label(value) if self.column is not None else "all runs"

    def _better(self, a: Cell, b: Cell) -> bool:
        return a.mean > b.mean if self.spec.higher_is_better else a.mean < b.mean

    def winner(self) -> tuple[tuple[Any, ...], Any] | None:
        """(row key, column value) of the best cell overall; None without a direction or a cell."""
        if self.spec.higher_is_better is None or not self.cells:
            return None
        best = None
        for (row, col), cell in self.cells.items():
            if best is None or self._better(cell, self.cells[best]):
                best = (row, col)
        return best

    def is_best(self, row: tuple[Any, ...], col: Any) -> bool:
        """Whether the cell is the best of its column or tied with it (ties are all marked)."""
        cell, best = self.cells.get((row, col)), self.best.get(col)
        return cell is not None and best is not None and abs(cell.mean - self.cells[best, col].mean) <= 1e-12

    def row_label(self, row: tuple[Any, ...]) -> str:
        return next(label for label, key in self.rows if key == row)

    def sentence(self) -> str:
        """The winner, its margin over the runner-up at the same value of the main key, and whether their 95 %
        intervals overlap, in one or two plain sentences."""
        name, spec = self.metric, self.spec
        won = self.winner()
        if won is None:
            if not self.cells:
                return f"No finished run reports {name}."
            return f"{name} has no better direction, so no winner is named."
        row, col = won
        cell = self.cells[row, col]
        where = f" at {self.column_label(col)}" if self.column is not None and len(self.columns) > 1 else ""
        text = f"Best {name}: {self.row_label(row)}{where}, {cell.text(spec)}."
        rivals = [(r, c) for (r, c) in self.cells if c == col and r != row]
        if not rivals:
            return text + " It is the only configuration there."
        runner = rivals[0]
        for other in rivals[1:]:
            if self._better(self.cells[other], self.cells[runner]):
                runner = other
        second = self.cells[runner]
        if abs(cell.mean - second.mean) <= 1e-12:
            return text + f" Tied with {self.row_label(runner[0])}, {second.text(spec)}: no winner at this scale."
        margin = spec.format_margin(abs(cell.mean - second.mean))
        text += f" Runner-up: {self.row_label(runner[0])}, {second.text(spec)}, {margin} behind"
        a, b = cell.bounds(), second.bounds()
        if a is None or b is None:
            text += "; with one seed there is no interval, so the margin is untested (add seeds: seed=0,1,2)."
        elif a[0] <= b[1] and b[0] <= a[1]:
            text += "; the 95 % intervals overlap, so the difference is within seed noise."
        else:
            text += "; the 95 % intervals do not overlap."
        wins = {self.best[c] for c in self.columns if c in self.best}
        if self.column is not None and len(self.columns) > 1 and wins == {row}:
            text += f" It is best at every {self.column.name}."
        return text


def headline(runs: Sequence[Run], sweep: Sweep, metric: str, column: Dimension | None) -> Headline:
    """The :class:`Headline` of ``metric`` over the finished runs, columns by ``column`` (None: one column)."""
    spec = spec_for(metric)
    row_dims = sweep.series_dims(column)
    columns = list(column.values) if column is not None else [None]
    table = Headline(metric, spec, column, columns, rows=[])
    for label, key, members in grouped([r for r in runs if r.ok], sweep, row_dims):
        by_col: dict[Any, list[Run]] = {}
        for run in members:
            if run.final(metric) is not None:
                by_col.setdefault(run.value(column.key) if column else None, []).append(run)
        if not by_col:
            continue
        table.rows.append((label, key))
        for col, group in by_col.items():
            mean, half, n = mean_ci(run.final(metric) for run in group)
            params = tuple(sorted({run.params for run in group if run.params is not None}))
            table.cells[key, col] = Cell(mean, half, n, params)
    table.columns = [c for c in columns if any(col == c for _, col in table.cells)]
    if spec.higher_is_better is not None:
        for col in table.columns:
            here = [(row, cell) for (row, c), cell in table.cells.items() if c == col]
            best_row, best_cell = here[0]
            for row, cell in here[1:]:
                if table._better(cell, best_cell):
                    best_row, best_cell = row, cell
            table.best[col] = best_row
    return table


def best_run(runs: Sequence[Run], metric: str) -> Run | None:
    """The finished run with the best value of ``metric`` (see :func:`best_runs`); None when none reports it."""
    ranked = best_runs(runs, metric, lambda run: None)
    return ranked[None][0] if ranked else None


def best_runs(runs: Sequence[Run], metric: str, by: Callable[[Run], Any]) -> dict[Any, list[Run]]:
    """The finished runs with a value of ``metric`` grouped by ``by(run)``, best first within each group (by the
    metric's direction; higher first when it has none)."""
    lower = spec_for(metric).higher_is_better is False
    out: dict[Any, list[Run]] = {}
    for run in runs:
        if run.ok and run.final(metric) is not None:
            out.setdefault(by(run), []).append(run)
    for members in out.values():
        members.sort(key=lambda r: r.final(metric) if lower else -r.final(metric))
    return out
