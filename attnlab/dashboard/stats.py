"""Statistics over seeds: the mean and 95 % t interval per configuration, series against a swept key, curves with
bands, and the headline table that names the winner and tests it against every rival.

Every interval in attnlab is the mean over seeds ± the half-width ``t_{0.975, n-1} · s / sqrt(n)`` (sample
standard deviation ``s``, ``n`` seeds); with one seed there is no interval. Intervals are clipped to the metric's
range (:meth:`attnlab.stats.MetricSpec.clip`). Only finished (``ok``) runs count.

The headline's winner is compared with every other configuration at the same value of the main key. Runs with the
same seed see the same data (initialisation, batches), so the comparison is *paired* over the seeds both have
(:func:`paired_difference`): with ``d_i = a_i − b_i`` over the ``n`` common seeds,

    mean  d̄ = (1/n) Σ d_i,     s_d² = Σ (d_i − d̄)² / (n − 1),     se = s_d / sqrt(n),
    95 % interval  d̄ ± t_{0.975, n−1} · se,     t = d̄ / se,     p = 2 · P(T_{n−1} > |t|)   (two-sided).

Only when the two share no seed is it Welch's unpaired comparison (:func:`welch_difference`): ``d̄ = ā − b̄``,
``se² = s_a²/n_a + s_b²/n_b``, ``df = se⁴ / ((s_a²/n_a)²/(n_a−1) + (s_b²/n_b)²/(n_b−1))``. A claim that the
winner beats ``m`` rivals is corrected for the ``m`` tests by Holm's step-down method (:func:`holm`): with the
p-values sorted ``p_(1) <= ... <= p_(m)``, ``p̃_(i) = max_{j<=i} min(1, (m − j + 1) · p_(j))``; the winner beats a
rival when its adjusted ``p̃ < 0.05`` and the difference is in the winner's favour. This keeps the chance of any
false "beats" at 5 % or less whatever the dependence between the tests (Holm 1979, *A simple sequentially
rejective multiple test procedure*, Scand. J. Statist. 6: 65-70). An untestable comparison (fewer than two
pairs, or fewer than two seeds on a side for Welch) counts in ``m`` with p = 1.

Quantiles and p-values come from ``scipy.stats.t`` (:func:`t_critical`, :func:`t_two_sided_p`). These functions
(and :func:`mean_ci`, :func:`interval_text`) live in :mod:`attnlab.stats`, below training and the dashboard both;
this module applies them to runs (their names here before that read through :mod:`attnlab.compat`).

Every interval is printed by :func:`~attnlab.stats.interval_text` (the page's cells and verdicts, and any terminal
report): ``87.5 % ± 1.2 (n=3)``, or ``± > 100`` where the half-width is at least the metric's whole range, never
both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import attnlab.stats as core_stats
from attnlab.compat import forward
from attnlab.dashboard.dims import Dimension, Sweep, format_value, numeric_x
from attnlab.dashboard.load import Run, natural_key
from attnlab.stats import MetricSpec, spec_for

__all__ = [
    "ALPHA",
    "Cell",
    "Comparison",
    "Curve",
    "Headline",
    "Point",
    "Series",
    "aggregate",
    "best_run",
    "best_runs",
    "curves",
    "headline",
    "pareto_front",
    "pareto_points",
]

# the statistics lived here before attnlab.stats (training prints intervals too, and never imports the dashboard):
# they read through attnlab.compat's table, each with a DeprecationWarning
__getattr__ = forward(__name__)

MAX_CURVE_POINTS = 200  # a curve with more steps is thinned evenly (first and last step kept)
ALPHA = 0.05  # the headline's winner beats a rival when its Holm-adjusted p is below this


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
        return spec.clip(self.mean - self.half_width, self.mean + self.half_width, self.values)


@dataclass(frozen=True)
class Series:
    """One line: the runs that share every value of the series dimensions, pooled over seeds at each x."""

    label: str
    key: tuple[Any, ...]
    points: tuple[Point, ...]


def _points(by_x: dict[float, list[float]]) -> tuple[Point, ...]:
    points = []
    for xv in sorted(by_x):
        mean, half, n = core_stats.mean_ci(by_x[xv])
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


def grouped(
    runs: Sequence[Run], sweep: Sweep, dims: Sequence[Dimension], context: Sequence[Dimension] = ()
) -> list[tuple[str, tuple, list[Run]]]:
    """``runs`` pooled by their values of ``dims``: (label, key, members), in the order of the values; labels by
    :meth:`Sweep.label` with ``context``, the keys shown otherwise (a chart's panels)."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(sweep.key_of(run, dims), []).append(run)
    order = {d.key: {v: i for i, v in enumerate(d.values)} for d in dims}
    ranked = sorted(groups, key=lambda k: [order[d.key].get(v, -1) for d, v in zip(dims, k, strict=True)])
    return [(sweep.label(groups[k][0], dims, context), k, groups[k]) for k in ranked]


def aggregate(
    runs: Sequence[Run],
    sweep: Sweep,
    metric: str,
    x: Dimension | None,
    series_dims: Sequence[Dimension],
    value: Callable[[Run, str], float | None] | None = None,
    context: Sequence[Dimension] = (),
) -> list[Series]:
    """Mean and 95 % CI across seeds of ``metric`` (each run's final value, or ``value(run, metric)``) against
    the swept key ``x``, one series per combination of ``series_dims`` (labelled with ``context``, the keys of the
    panels: :meth:`Sweep.label`). Only finished runs with a finite value."""
    value = value or (lambda run, name: run.final(name))
    out = []
    for label, key, members in grouped([r for r in runs if r.ok], sweep, series_dims, context):
        by_x: dict[float, list[float]] = {}
        for run in members:
            xv, v = x_position(x, run.value(x.key) if x else None), value(run, metric)
            if xv is not None and v is not None:
                by_x.setdefault(xv, []).append(v)
        if by_x:
            out.append(Series(label, key, _points(by_x)))
    return out


def aggregate_lengths(
    runs: Sequence[Run],
    sweep: Sweep,
    metric: str,
    series_dims: Sequence[Dimension],
    context: Sequence[Dimension] = (),
) -> list[Series]:
    """``<metric>@<L>`` against the test length ``L``, one series per combination of ``series_dims`` (labelled with
    ``context``), mean and 95 % CI across seeds; only finished runs that report the metric at some length."""
    out = []
    for label, key, members in grouped([r for r in runs if r.ok], sweep, series_dims, context):
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


def curves(
    runs: Sequence[Run],
    sweep: Sweep,
    metric: str,
    series_dims: Sequence[Dimension],
    context: Sequence[Dimension] = (),
) -> list[Curve]:
    """One :class:`Curve` of ``metric`` per combination of ``series_dims`` (labelled with ``context``; finished and
    failed runs alike: a failed run's curve shows where it went wrong), the band clipped to the metric's range."""
    spec = spec_for(metric)
    out = []
    for label, key, members in grouped(runs, sweep, series_dims, context):
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
        stats = [core_stats.mean_ci(at[s]) for s in steps]
        mean = np.array([m for m, _, _ in stats])
        bands = [
            (math.nan, math.nan) if h is None else spec.clip(m - h, m + h, at[s])
            for s, (m, h, _) in zip(steps, stats, strict=True)
        ]
        low, high = np.array([lo for lo, _ in bands]), np.array([hi for _, hi in bands])
        out.append(Curve(label, key, steps, mean, low, high, np.array([n for _, _, n in stats])))
    return out


# ---------------------------------------------------------------------------------------------------- headline
@dataclass(frozen=True)
class Cell:
    """One configuration at one value of the main key: mean, 95 % half-width (None for one seed), seeds, the
    parameter counts of its runs, each run's ``(seed, value)`` (what the paired comparisons pair on), and a note
    naming its runs' values of keys that no row or column shows (a tuned sweep's chosen point: ``lr=0.003``)."""

    mean: float
    half_width: float | None
    n: int
    params: tuple[int, ...] = ()
    seeds: tuple[tuple[Any, float], ...] = ()
    note: str = ""

    def half_text(self, spec: MetricSpec) -> str:
        """`` ± 1.2``: the half-width in the metric's display unit (points for a percentage; ``± > 100`` when it
        is wider than the metric's range, :meth:`MetricSpec.format_half`); "" for one seed."""
        return "" if self.half_width is None else f" {core_stats.half_width_text(self.half_width, spec)}"

    def text(self, spec: MetricSpec) -> str:
        """``87.5 % ± 1.2 (n=2)``: the mean ± the half-width (in the metric's display unit) and the seeds
        (:func:`interval_text`)."""
        return core_stats.interval_text(self.mean, self.half_width, spec, self.n)

    def bounds(self, spec: MetricSpec | None = None) -> tuple[float, float] | None:
        """The 95 % interval, clipped to ``spec``'s range when given; None for one seed."""
        if self.half_width is None:
            return None
        low, high = self.mean - self.half_width, self.mean + self.half_width
        return (low, high) if spec is None else spec.clip(low, high, [v for _, v in self.seeds])

    def by_seed(self) -> dict[Any, float]:
        """``{seed: value}`` (the mean where two runs share a seed; a run without a seed never pairs)."""
        pooled: dict[Any, list[float]] = {}
        for seed, value in self.seeds:
            pooled.setdefault(seed if seed is not None else object(), []).append(value)
        return {seed: sum(values) / len(values) for seed, values in pooled.items()}


@dataclass(frozen=True)
class Comparison:
    """The headline's winner against one rival at the winner's value of the main key.

    Attributes:
        rival: the rival's row key; ``label`` its name.
        difference: winner − rival (:func:`paired_difference`: paired over their common seeds, Welch without one).
        p_holm: the Holm-adjusted p-value over all the winner's comparisons (1.0 when untested).
        wins: whether ``p_holm`` < :data:`ALPHA` and the difference is in the winner's favour.
    """

    rival: tuple[Any, ...]
    label: str
    difference: core_stats.Difference
    p_holm: float
    wins: bool


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
    attributes: dict[tuple[Any, ...], str] = field(default_factory=dict)
    """Per row: what its model's preset set (:meth:`Sweep.attributes_text`: ``normalizer=none ·
    short_conv=4``), shown beside the row; empty where the sweep has no attributes."""

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

    def cell_label(self, row: tuple[Any, ...], col: Any) -> str:
        """The row's name, with the cell's note where it has one: ``dot (lr=0.003)``."""
        cell = self.cells.get((row, col))
        note = cell.note if cell is not None else ""
        return f"{self.row_label(row)} ({note})" if note else self.row_label(row)

    def comparisons(self, alpha: float = ALPHA) -> list[Comparison]:
        """The winner against every other configuration at its value of the main key, in the rows' order:
        :func:`paired_difference` (winner − rival) and the Holm adjustment (:func:`holm`) over all of them, an
        untested comparison counting with p = 1. Empty without a winner."""
        won = self.winner()
        if won is None:
            return []
        row, col = won
        mine = self.cells[row, col].by_seed()
        rivals = [key for _, key in self.rows if key != row and (key, col) in self.cells]
        diffs = [core_stats.paired_difference(mine, self.cells[key, col].by_seed()) for key in rivals]
        adjusted = core_stats.holm([1.0 if d.p is None else d.p for d in diffs])
        sign = 1.0 if self.spec.higher_is_better else -1.0
        return [
            Comparison(key, self.cell_label(key, col), d, p, d.p is not None and p < alpha and sign * d.mean > 0)
            for key, d, p in zip(rivals, diffs, adjusted, strict=True)
        ]

    def method(self, comparisons: Sequence[Comparison] | None = None) -> str:
        """How the comparisons were made, e.g. "paired t over 3 seeds, Holm-corrected over 5 comparisons" (a range
        of seeds where the rivals share different numbers; Welch's t where a rival shares none)."""
        comps = self.comparisons() if comparisons is None else comparisons
        paired = sorted({c.difference.n for c in comps if c.difference.paired})
        welch = sum(not c.difference.paired for c in comps)
        parts = []
        if paired:
            seeds = f"{paired[0]}" if len(paired) == 1 else f"{paired[0]}–{paired[-1]}"
            parts.append(f"paired t over {seeds} {'seed' if paired == [1] else 'seeds'}")
        if welch:
            parts.append(f"Welch's t for {welch} without a common seed" if paired else "Welch's t (no common seed)")
        m = len(comps)
        return f"{' and '.join(parts)}, Holm-corrected over {m} comparison{'s' if m != 1 else ''}"

    def sentence(self, alpha: float = ALPHA) -> str:
        """The winner, its margin over the runner-up at the same value of the main key (paired over their common
        seeds, with its 95 % half-width), and how many of the other configurations there it beats (paired t tests,
        Holm-corrected: :meth:`comparisons`), in two or three plain sentences."""
        name, spec = self.metric, self.spec
        won = self.winner()
        if won is None:
            if not self.cells:
                return f"No finished run reports {name}."
            return f"{name} has no better direction, so no winner is named."
        row, col = won
        cell = self.cells[row, col]
        where = f" at {self.column_label(col)}" if self.column is not None and len(self.columns) > 1 else ""
        text = f"Best {name}: {self.cell_label(row, col)}{where}, {cell.text(spec)}."
        rivals = [(r, c) for (r, c) in self.cells if c == col and r != row]
        if not rivals:
            return text + " It is the only configuration there."
        runner = rivals[0]
        for other in rivals[1:]:
            if self._better(self.cells[other], self.cells[runner]):
                runner = other
        second = self.cells[runner]
        if abs(cell.mean - second.mean) <= 1e-12:
            return text + f" Tied with {self.cell_label(*runner)}, {second.text(spec)}: no winner at this scale."
        comps = self.comparisons(alpha)
        d = next(c.difference for c in comps if c.rival == runner[0])
        sign = 1.0 if spec.higher_is_better else -1.0
        margin = spec.format_margin(sign * d.mean)  # paired over the common seeds (Welch: the difference of means)
        half = "" if d.half_width is None else f"{core_stats.half_width_text(d.half_width, spec)}, "
        if not d.paired:
            how = f" ({half}Welch: no common seed)"
        elif d.half_width is not None:
            how = f" ({half}paired over {d.n} seeds)"
        else:  # one common seed: said only where they ran more
            how = "" if cell.n == second.n == 1 else " (on their one common seed)"
        text += f" Runner-up: {self.cell_label(*runner)}, {second.text(spec)}, {margin} behind{how}."
        tested = [c for c in comps if c.difference.tested]
        m = len(comps)
        if not tested:
            text += " With one seed there is no interval, so the margins are untested (add seeds: seed=0,1,2)."
        else:
            won_over = [c for c in comps if c.wins]
            lost = [c for c in comps if not c.wins]
            method = self.method(comps)
            text += f" {method[0].upper()}{method[1:]}: "
            if len(won_over) == m:
                text += f"it beats {'the other' if m == 1 else f'all {m} others'} (adjusted p < {alpha:g})."
            else:

                def why(c: Comparison) -> str:
                    if not c.difference.tested:
                        return "untested"
                    if c.p_holm < alpha:  # a significant difference the other way (over their common seeds)
                        return f"better on their common seeds, adjusted p = {c.p_holm:.2g}"
                    return f"adjusted p = {c.p_holm:.2g}"

                shown = ", ".join(f"{c.label} ({why(c)})" for c in lost[:3])
                more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
                beats = "none" if not won_over else f"{len(won_over)}"
                noise = any(c.difference.tested and c.p_holm >= alpha for c in lost)
                text += f"it beats {beats} of the {m} other{'s' if m != 1 else ''}; not {shown}{more}" + (
                    ": within seed noise at this many seeds." if noise else "."
                )
        wins = {self.best[c] for c in self.columns if c in self.best}
        if self.column is not None and len(self.columns) > 1 and wins == {row}:
            text += f" It is best at every {self.column.name}."
        return text


def headline(
    runs: Sequence[Run], sweep: Sweep, metric: str, column: Dimension | None, notes: Sequence[str] = ()
) -> Headline:
    """The :class:`Headline` of ``metric`` over the finished runs, columns by ``column`` (None: one column).

    ``notes``: config keys that no row or column shows (a tuned sweep's grid keys, left out of ``sweep``'s
    dimensions): each cell's :attr:`Cell.note` names its runs' values of them (``lr=0.003``; ``lr=0.001/0.003``
    where they differ)."""
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
        attributes = sweep.attributes_text(members)
        if attributes:
            table.attributes[key] = attributes
        for col, group in by_col.items():
            mean, half, n = core_stats.mean_ci(run.final(metric) for run in group)
            params = tuple(sorted({run.params for run in group if run.params is not None}))
            seeds = tuple((run.seed, run.final(metric)) for run in group)
            table.cells[key, col] = Cell(mean, half, n, params, seeds, note_of(group, notes))
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


def note_of(runs: Sequence[Run], keys: Sequence[str]) -> str:
    """``lr=0.003, weight_decay=0``: the runs' values of ``keys`` (each key by its last part; ``a/b`` where the runs
    differ); "" without keys."""
    parts = []
    for key in keys:
        values = sorted({format_value(run.value(key)) for run in runs}, key=natural_key)
        parts.append(f"{key.rsplit('.', 1)[-1]}={'/'.join(values)}")
    return ", ".join(parts)


def pareto_points(
    runs: Sequence[Run], sweep: Sweep, metric: str, cost: str
) -> list[tuple[str, tuple[Any, ...], list[Run], Point]]:
    """One point per configuration (every dimension of ``sweep``) of the finished runs that report both ``metric``
    and a positive ``cost`` (:meth:`Run.final`: a compute field such as ``flops_per_token``): ``(label, key, runs,
    point)``, the point's ``x`` the mean cost over those runs and its mean, half-width and n the metric's over
    them (:func:`mean_ci`)."""
    out = []
    for label, key, members in grouped([r for r in runs if r.ok], sweep, sweep.dims):
        used = [r for r in members if r.final(metric) is not None and (r.final(cost) or 0) > 0]
        if not used:
            continue
        values = [r.final(metric) for r in used]
        mean, half, n = core_stats.mean_ci(values)
        x = sum(r.final(cost) for r in used) / len(used)
        out.append((label, key, used, Point(x=x, mean=mean, half_width=half, n=n, values=tuple(values))))
    return out


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool = True) -> list[int]:
    """The indices of the points ``(cost, value)`` on the Pareto frontier, by ascending cost: those whose value is
    strictly better than that of every point of lower or equal cost (of equal costs, only the best; the first of
    equal ones)."""
    sign = 1.0 if higher_is_better else -1.0
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -sign * points[i][1], i))
    front: list[int] = []
    for i in order:
        if not front or sign * points[i][1] > sign * points[front[-1]][1]:  # (of equal costs the best comes first)
            front.append(i)
    return front


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
