"""The page's charts as plotly figure dicts (``{"data": [...], "layout": {...}}``), drawn in the browser by page.js.

Building plain dicts instead of ``plotly.graph_objects`` keeps a 300-run page fast to write. Conventions shared by
every chart:

* small multiples: panels in a grid at most :data:`MAX_COLS` wide (each at least 300 px at a 1400 px window), one
  row per metric and one panel per value of the facet key;
* one legend on top, names built from the varying keys only (``additive · heads=1``), plain text; a line keeps its
  colour (by the first key, usually the variant) and dash in every panel, and clicking its name hides it everywhere;
* points are the mean over seeds with the 95 % t interval as error bars, clipped to the metric's range, and
  shifted sideways a little per line so that the intervals at one x do not hide each other;
* log x for keys spanning a factor of 8 or more (d_k, lr, test lengths), a dashed line at the task's chance
  accuracy, y-axis titles with units.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attnlab.dashboard.dims import Dimension, Sweep, format_value, wide_range
from attnlab.dashboard.load import Run, natural_key
from attnlab.dashboard.stats import (
    Curve,
    Series,
    aggregate,
    aggregate_lengths,
    best_run,
    curves,
    note_of,
    pareto_front,
    pareto_points,
    x_position,
)
from attnlab.stats import MetricSpec, parse_metric, spec_for

if TYPE_CHECKING:
    from attnlab.dashboard.tuned import TunedSweep

__all__ = [
    "MAX_COLS",
    "PROBABILITY_METRICS",
    "Style",
    "comparison_figure",
    "curves_figure",
    "head_figure",
    "length_figure",
    "pareto_figure",
    "plain",
    "search_figure",
    "sensitivity_figure",
    "signed_layers",
    "signed_note",
    "unnormalised",
]

MAX_COLS = 3
ROW_HEIGHT = 270  # px per row of panels
PALETTE = (
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363",
)  # fmt: skip
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star", "triangle-down")
GRID_COLOUR = "#eaeaea"


def plain(text: Any) -> str:
    """Text for a plotly label: plotly reads ``<...>`` as markup, so ``<`` and ``>`` become ``‹`` and ``›``."""
    return str(text).replace("<", "‹").replace(">", "›")


class Style:
    """Colour, dash and marker of each line: colour by the value of the first key its label names, dash and marker
    by the values of the others, the same in every chart of the page (a line's style follows its label: a run knob
    that labels leave out changes neither)."""

    def __init__(self, sweep: Sweep, series_dims: Sequence[Dimension], context: Sequence[Dimension] = ()) -> None:
        self.dims = list(series_dims)
        named = sweep.label_dims(self.dims, context)
        self.index = [self.dims.index(d) for d in named]  # where the named keys sit in a series' key
        first = named[0] if named else None
        self.colour = {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(first.values)} if first else {}
        rest = named[1:]
        self.rest = rest  # the keys that dash and marker tell apart
        combos = sorted({tuple(run.value(d.key) for d in rest) for run in sweep.runs}, key=lambda t: natural_key(t))
        self.dash = {c: DASHES[i % len(DASHES)] for i, c in enumerate(combos)}
        self.symbol = {c: SYMBOLS[(i // len(DASHES)) % len(SYMBOLS)] for i, c in enumerate(combos)}
        self.point_symbol = {c: SYMBOLS[i % len(SYMBOLS)] for i, c in enumerate(combos)}  # (points without lines)

    def _parts(self, key: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        named = tuple(key[i] for i in self.index)
        return (named[0] if named else None), named[1:]

    def line(self, key: tuple[Any, ...]) -> dict[str, Any]:
        first, rest = self._parts(key)
        return {"color": self.colour.get(first, PALETTE[0]), "dash": self.dash.get(rest, "solid")}

    def marker(self, key: tuple[Any, ...]) -> dict[str, Any]:
        return {"symbol": self.symbol.get(self._parts(key)[1], "circle"), "size": 7}

    def point_label(self, key: tuple[Any, ...]) -> str:
        """What :meth:`point`'s symbol stands for: the values of the keys after the first (``heads=2 · lr=0.01``)."""
        return " · ".join(d.label(v) for d, v in zip(self.rest, self._parts(key)[1], strict=True))

    def point(self, key: tuple[Any, ...]) -> str:
        """The marker symbol of a point drawn without a line (the Pareto view): one per combination of the keys
        after the first, where :meth:`marker` leaves that to the dash."""
        return self.point_symbol.get(self._parts(key)[1], "circle")


# ---------------------------------------------------------------------------------------------------- layout
def _axis(i: int) -> str:
    return "" if i == 0 else str(i + 1)


def _grid(rows: int, cols: int, titles: Sequence[str], legend_entries: Sequence[str] = ()) -> dict[str, Any]:
    """A layout with ``rows`` x ``cols`` panels (panel i at row i // cols), their titles, and room for a legend of
    ``legend_entries`` on top."""
    gap_x, gap_y_px = 0.07, 90
    legend_rows = _legend_rows(legend_entries)
    top = 40 + 22 * legend_rows
    height = rows * ROW_HEIGHT + (rows - 1) * gap_y_px + top + 60
    plot_h = height - top - 60
    layout: dict[str, Any] = {
        "height": height,
        "margin": {"l": 70, "r": 20, "t": top, "b": 60},
        "template": None,
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "hovermode": "closest",
        "showlegend": bool(legend_entries),
        "legend": {
            "orientation": "h",
            "x": 0,
            "xanchor": "left",
            "y": 1.0 + 30 / plot_h,  # above the panel titles
            "yanchor": "bottom",
            "font": {"size": 12},
        },
        "annotations": [],
        "shapes": [],
        "font": {"family": "system-ui, -apple-system, Segoe UI, sans-serif", "size": 12},
    }
    width = (1 - gap_x * (cols - 1)) / cols
    row_h = ROW_HEIGHT / plot_h
    gap_y = gap_y_px / plot_h
    for i, title in enumerate(titles):
        r, c = divmod(i, cols)
        x0 = c * (width + gap_x)
        y1 = 1 - r * (row_h + gap_y)
        n = _axis(i)
        layout[f"xaxis{n}"] = {
            "domain": [x0, x0 + width],
            "anchor": f"y{n}",
            "gridcolor": GRID_COLOUR,
            "zeroline": False,
            "showline": True,
            "linecolor": "#999",
            "automargin": True,
        }
        layout[f"yaxis{n}"] = {
            "domain": [max(0.0, y1 - row_h), y1],
            "anchor": f"x{n}",
            "gridcolor": GRID_COLOUR,
            "zeroline": False,
            "showline": True,
            "linecolor": "#999",
            "automargin": True,
        }
        layout["annotations"].append(
            {
                "text": plain(title),
                "x": x0 + width / 2,
                "y": y1,
                "xref": "paper",
                "yref": "paper",
                "xanchor": "center",
                "yanchor": "bottom",
                "yshift": 4,
                "showarrow": False,
                "font": {"size": 13},
            }
        )
    return layout


def _legend_rows(entries: Sequence[str], width_px: int = 1250) -> int:
    """How many rows a horizontal legend of ``entries`` takes (about 7 px a character plus the symbol)."""
    if not entries:
        return 0
    rows, used = 1, 0
    for entry in entries:
        w = 7 * len(entry) + 50
        if used + w > width_px and used:
            rows, used = rows + 1, 0
        used += w
    return rows


def _x_axis(layout: dict[str, Any], i: int, dim: Dimension | None, xs: Sequence[float], title: str | None = None):
    """Ticks at the values drawn; log for a key spanning a factor of 8 or more; names for a categorical key."""
    axis = layout[f"xaxis{_axis(i)}"]
    axis["title"] = {"text": plain(title or (dim.name if dim else "")), "standoff": 4}
    if dim is None:
        axis.update(tickvals=[0], ticktext=["all runs"], range=[-0.5, 0.5])
    elif not dim.numeric:
        axis.update(tickvals=list(range(len(dim.values))), ticktext=[plain(dim.format(v)) for v in dim.values])
        axis["range"] = [-0.5, len(dim.values) - 0.5]
    else:
        ticks = sorted(set(xs))
        axis.update(tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])
        if dim.log:
            axis["type"] = "log"


def _y_axis(layout: dict[str, Any], i: int, spec: MetricSpec, metric: str, values: Sequence[float] = ()) -> None:
    """The y title with its unit; autorange kept near the metric's range unless some of ``values`` lie outside it
    (a bounded metric's signed values, as differential attention's ``first_mass``)."""
    axis = layout[f"yaxis{_axis(i)}"]
    axis["title"] = {"text": plain(spec.axis_title(metric)), "standoff": 4, "font": {"size": 11}}
    if spec.percent:
        axis["tickformat"] = ".0%"
    inside = spec.clip(-math.inf, math.inf, values) == (spec.low, spec.high)
    if spec.low is not None and spec.high is not None and inside:  # autorange, but never far outside the values
        pad = 0.05 * (spec.high - spec.low)
        axis["autorangeoptions"] = {"minallowed": spec.low - pad, "maxallowed": spec.high + pad}
    if spec.log_y:
        axis["type"] = "log"


def _offsets(count: int, dim: Dimension | None, xs: Sequence[float], log: bool) -> list[Callable[[float], float]]:
    """A sideways shift per line so that the intervals at one x stand apart: a fraction of the gap between ticks
    (of a decade's fraction on a log axis), centred on the true x."""
    if count <= 1:
        return [lambda x: x] * count  # no line (an empty panel): no shift
    ticks = sorted(set(xs))
    if log:
        span = min((math.log10(b / a) for a, b in itertools.pairwise(ticks)), default=1.0)
        step = 0.35 * span / count
        return [(lambda x, k=k: x * 10 ** (step * (k - (count - 1) / 2))) for k in range(count)]
    gap = min((b - a for a, b in itertools.pairwise(ticks)), default=1.0)
    step = 0.5 * gap / count
    return [(lambda x, k=k: x + step * (k - (count - 1) / 2)) for k in range(count)]


CHANCE_NAMES = {
    "associative_recall": (
        "1/num_pairs",
        "the task's chance_accuracy: a guess among the num_pairs values the context holds (a model that knows the "
        "values but not which key each belongs to), not a uniform guess over the values (1/vocab_values)",
    ),
    "noisy_recall": (
        "1/num_pairs",
        "the task's chance_accuracy: a guess among the num_pairs values the context holds, not a uniform guess over "
        "the values (1/vocab_values)",
    ),
}
"""Tasks whose ``chance_accuracy`` is not a uniform guess over the classes: ``task → (short label, what it is)``;
the chance line is labelled with the short label (its hover says what it is) instead of "chance"."""


def _chance_shape(layout: dict[str, Any], i: int, chance: float, task: str | None = None) -> None:
    n = _axis(i)
    label, meaning = CHANCE_NAMES.get(task or "", ("chance", "the task's chance accuracy (summary.json)"))
    layout["shapes"].append(
        {
            "type": "line",
            "xref": f"x{n} domain",
            "x0": 0,
            "x1": 1,
            "yref": f"y{n}",
            "y0": chance,
            "y1": chance,
            "line": {"dash": "dash", "color": "#777", "width": 1.2},
        }
    )
    layout["annotations"].append(
        {
            "text": f"{label} {100 * chance:.3g} %",
            "hovertext": plain(f"{label} = {100 * chance:.3g} %: {meaning}"),
            "xref": f"x{n} domain",
            "x": 1,
            "yref": f"y{n}",
            "y": chance,
            "xanchor": "right",
            "yanchor": "bottom",
            "showarrow": False,
            "font": {"size": 10, "color": "#666"},
        }
    )


def _chances(runs: Sequence[Run]) -> list[tuple[float, str | None]]:
    """The distinct chance accuracies of the finished runs (at most 3), each with its task where one task has it."""
    found: dict[float, set[str]] = {}
    for run in runs:
        if run.ok and run.chance is not None:
            found.setdefault(round(run.chance, 6), set()).add(run.task)
    return [(c, next(iter(t)) if len(t) == 1 else None) for c, t in sorted(found.items())[:3]]


def _series_traces(
    series: Sequence[Series],
    i: int,
    spec: MetricSpec,
    metric: str,
    x: Dimension | None,
    style: Style,
    shown: set[str],
    log: bool,
    categorical: bool = False,
) -> list[dict[str, Any]]:
    """One trace per series in panel ``i``: means with the clipped 95 % interval as error bars, shifted apart;
    joined by lines along a numeric x, points only where x is ``categorical`` (a line between two models says
    nothing)."""
    xs = [p.x for s in series for p in s.points]
    apart = len({p.x for s in series for p in s.points}) == sum(len(s.points) for s in series)  # (one point per x)
    shifts = _offsets(1 if apart else len(series), x, xs, log) * (len(series) if apart else 1)
    traces = []
    for s, shift in zip(series, shifts, strict=True):
        hi, lo, hover = [], [], []
        for p in s.points:
            bounds = p.interval(spec)
            hi.append(None if bounds is None else bounds[1] - p.mean)
            lo.append(None if bounds is None else p.mean - bounds[0])
            where = f"{x.name}={x.format(x.values[int(p.x)]) if not x.numeric else f'{p.x:g}'}" if x else "all runs"
            ci = (
                f"<br>95 % CI [{spec.format(bounds[0])}, {spec.format(bounds[1])}]"
                if bounds
                else "<br>one seed: no interval"
            )
            hover.append(f"{plain(s.label)}<br>{plain(where)}<br>{metric} = {spec.format(p.mean)}{ci} (n={p.n})")
        n = _axis(i)
        traces.append(
            {
                "type": "scatter",
                "x": [shift(p.x) for p in s.points],
                "y": [p.mean for p in s.points],
                "xaxis": f"x{n}",
                "yaxis": f"y{n}",
                "mode": "markers" if categorical else "lines+markers",
                "name": plain(s.label),
                "legendgroup": plain(s.label),
                "showlegend": s.label not in shown,
                "line": {**style.line(s.key), "width": 1.6},
                "marker": {"symbol": style.point(s.key), "size": 9, "color": style.line(s.key)["color"]}
                if categorical else style.marker(s.key),
                "error_y": {"type": "data", "symmetric": False, "array": hi, "arrayminus": lo, "thickness": 1.3,
                            "width": 3, "visible": True},
                "hovertext": hover,
                "hoverinfo": "text",
            }
        )  # fmt: skip
        shown.add(s.label)
    return traces


def _facet_grid(metrics: Sequence[str], facet: Dimension | None, cols: int) -> tuple[list[tuple[str, Any]], list[str]]:
    """Panels ``(metric, facet value)`` and their titles: with a facet, one row (or more, ``cols`` wide) per metric
    and one panel per facet value, padded with empty panels ``("", None)``; without, the metrics in a grid."""
    panels: list[tuple[str, Any]] = []
    titles: list[str] = []
    for metric in metrics:
        for value in facet.values if facet is not None else [None]:
            panels.append((metric, value))
            titles.append(f"{metric} · {facet.label(value)}" if facet is not None else metric)
        while facet is not None and len(panels) % cols:
            panels.append(("", None))
            titles.append("")
    return panels, titles


def _hide(layout: dict[str, Any], i: int) -> None:
    """Hide the axes of an empty panel."""
    layout[f"xaxis{_axis(i)}"]["visible"] = False
    layout[f"yaxis{_axis(i)}"]["visible"] = False


def _facet_runs(runs: Sequence[Run], facet: Dimension | None, value: Any) -> list[Run]:
    return list(runs) if facet is None else [r for r in runs if r.value(facet.key) == value]


def _figure(data: list[dict[str, Any]], layout: dict[str, Any]) -> dict[str, Any]:
    return {"data": data, "layout": layout}


# ---------------------------------------------------------------------------------------------------- charts
def comparison_figure(
    runs: Sequence[Run],
    sweep: Sweep,
    metrics: Sequence[str],
    x: Dimension | None,
    facet: Dimension | None,
    init: bool = False,
) -> dict[str, Any]:
    """Each metric (final value, or the step-0 value with ``init``) against ``x``: one row of panels per metric
    (one panel per value of ``facet``), one line per combination of the other keys; where ``x`` is categorical
    (a sweep over models) or None, points with their error bars, never lines. A metric's panels share their y
    axis."""
    series_dims = sweep.series_dims(x, facet)
    if x is not None and not x.numeric and not series_dims:  # a sweep over models: a point (and a name) per model
        series_dims = [x]
    context = [facet] if facet is not None else []
    style = Style(sweep, series_dims, context)
    cols = min(MAX_COLS, len(facet.values) if facet is not None else len(metrics))
    panels, titles = _facet_grid(metrics, facet, cols)
    rows = math.ceil(len(panels) / cols)
    value_of = (lambda run, name: run.init(name)) if init else None
    all_series = {}
    labels: list[str] = []
    for i, (metric, value) in enumerate(panels):
        if metric:
            members = _facet_runs(runs, facet, value)
            all_series[i] = aggregate(members, sweep, metric, x, series_dims, value=value_of, context=context)
            labels += [s.label for s in all_series[i] if s.label not in labels]
    layout = _grid(rows, cols, titles, legend_entries=labels if series_dims else ())
    data: list[dict[str, Any]] = []
    shown: set[str] = set()
    for i, (metric, value) in enumerate(panels):
        if not metric:
            _hide(layout, i)
            continue
        spec = spec_for(metric)
        xs = [p.x for s in all_series[i] for p in s.points]
        log = bool(x is not None and x.numeric and x.log)
        categorical = x is None or not x.numeric
        data += _series_traces(all_series[i], i, spec, metric, x, style, shown, log, categorical)
        _x_axis(layout, i, x, xs)
        _y_axis(layout, i, spec, metric, [v for s in all_series[i] for p in s.points for v in p.values])
        if spec.chance and not init:
            for chance, task in _chances(_facet_runs(runs, facet, value)):
                _chance_shape(layout, i, chance, task)
    _share_y(layout, panels)
    return _figure(data, layout)


def _share_y(layout: dict[str, Any], panels: Sequence[tuple[str, Any]]) -> None:
    """The panels of one metric (a row of facets) share the first one's y axis: their values compare by eye."""
    first: dict[str, int] = {}
    for i, (metric, _) in enumerate(panels):
        if not metric:
            continue
        j = first.setdefault(metric, i)
        if j != i:
            layout[f"yaxis{_axis(i)}"]["matches"] = f"y{_axis(j)}"


def length_figure(runs: Sequence[Run], sweep: Sweep) -> dict[str, Any] | None:
    """Length generalisation: per task a row with test accuracy against the test length ``L`` and, where the runs
    report them, bits per byte (language modelling) or else test loss; the training length as a dashed line. None
    when no finished run reports ``test/acc@L``."""
    tasks = sorted({r.task for r in runs if r.ok and r.by_length("test/acc")}, key=natural_key)
    if not tasks:
        return None
    task_dim = next((d for d in sweep.dims if d.key == "task.name"), None)
    series_dims = sweep.series_dims(task_dim)
    context = [task_dim] if task_dim is not None else []
    style = Style(sweep, series_dims, context)
    panels: list[tuple[str, str]] = []
    for task in tasks:
        members = [r for r in runs if r.task == task]
        other = next((m for m in ("test/bpc", "test/loss") if any(r.by_length(m) for r in members if r.ok)), None)
        panels += [(task, "test/acc"), (task, other or "")]
    titles = [f"{task}: {metric}@L" if metric else "" for task, metric in panels]
    series = {}
    labels: list[str] = []
    for i, (task, metric) in enumerate(panels):
        if metric:
            series[i] = aggregate_lengths([r for r in runs if r.task == task], sweep, metric, series_dims, context)
            labels += [s.label for s in series[i] if s.label not in labels]
    layout = _grid(len(tasks), 2, titles, legend_entries=labels if series_dims else ())
    data: list[dict[str, Any]] = []
    shown: set[str] = set()
    for i, (task, metric) in enumerate(panels):
        if not metric:
            _hide(layout, i)
            continue
        members = [r for r in runs if r.ok and r.task == task and r.by_length("test/acc")]
        trained = sorted({r.train_length for r in members} - {None})
        lengths = sorted({p.x for s in series[i] for p in s.points} | {float(t) for t in trained})
        log = wide_range(lengths)
        spec = spec_for(metric)
        data += _series_traces(series[i], i, spec, f"{metric}@L", None, style, shown, log)
        n = _axis(i)
        for t in data[-len(series[i]) :] if series[i] else []:
            t["hovertext"] = [h.replace("all runs", f"L={x:g}") for h, x in zip(t["hovertext"], t["x"], strict=True)]
        layout[f"xaxis{n}"].update(
            title={"text": "test length L", "standoff": 4},
            tickvals=lengths,
            ticktext=[f"{v:g}" for v in lengths],
            type="log" if log else "linear",
        )
        _y_axis(layout, i, spec, f"{metric}@L", [v for s in series[i] for p in s.points for v in p.values])
        for length in trained:
            layout["shapes"].append(
                {
                    "type": "line",
                    "xref": f"x{n}",
                    "x0": length,
                    "x1": length,
                    "yref": f"y{n} domain",
                    "y0": 0,
                    "y1": 1,
                    "line": {"dash": "dash", "color": "#888", "width": 1.2},
                }
            )
            layout["annotations"].append(
                {
                    "text": f"train L={length}",
                    "xref": f"x{n}",
                    "x": math.log10(length) if log else length,  # annotations on a log axis take log10 positions
                    "yref": f"y{n} domain",
                    "y": 1,
                    "xanchor": "left",
                    "yanchor": "top",
                    "showarrow": False,
                    "font": {"size": 10, "color": "#666"},
                }
            )
        if spec.chance:
            for chance, task in _chances(members):
                _chance_shape(layout, i, chance, task)
    return _figure(data, layout)


def curves_figure(
    runs: Sequence[Run], sweep: Sweep, metrics: Sequence[str], facet: Dimension | None
) -> dict[str, Any] | None:
    """Training curves: one row per metric (one panel per value of ``facet``, a numeric main key, their y axes
    shared; without, one panel per metric: every configuration on one axis), one line per configuration with the
    mean over seeds and a band for the 95 % interval, step 0 included. None without rows."""
    series_dims = sweep.series_dims(facet)
    context = [facet] if facet is not None else []
    style = Style(sweep, series_dims, context)
    cols = min(MAX_COLS, len(facet.values)) if facet is not None else min(2, len(metrics))
    panels, titles = _facet_grid(metrics, facet, cols)
    found: dict[int, list[Curve]] = {}
    labels: list[str] = []
    for i, (metric, value) in enumerate(panels):
        if metric:
            found[i] = curves(_facet_runs(runs, facet, value), sweep, metric, series_dims, context)
            labels += [c.label for c in found[i] if c.label not in labels]
    if not any(found.values()):
        return None
    layout = _grid(math.ceil(len(panels) / cols), cols, titles, legend_entries=labels if series_dims else ())
    data: list[dict[str, Any]] = []
    shown: set[str] = set()
    for i, (metric, _) in enumerate(panels):
        n = _axis(i)
        if not metric:
            _hide(layout, i)
            continue
        spec = spec_for(metric)
        for c in found[i]:
            line = style.line(c.key)
            steps = c.steps.tolist()
            band = ~np.isnan(c.low)
            if band.any():
                xs = [s for s, b in zip(steps, band, strict=True) if b]
                upper = [float(v) for v, b in zip(c.high, band, strict=True) if b]
                lower = [float(v) for v, b in zip(c.low, band, strict=True) if b]
                data.append(
                    {
                        "type": "scatter",
                        "x": xs + xs[::-1],
                        "y": upper + lower[::-1],
                        "xaxis": f"x{n}",
                        "yaxis": f"y{n}",
                        "fill": "toself",
                        "fillcolor": _rgba(line["color"], 0.15),
                        "mode": "lines",  # (no mode: plotly draws markers on a trace of fewer than 20 points)
                        "line": {"width": 0},
                        "hoverinfo": "skip",
                        "legendgroup": plain(c.label),
                        "showlegend": False,
                        "name": plain(c.label),
                    }
                )
            data.append(
                {
                    "type": "scatter",
                    "x": steps,
                    "y": [None if math.isnan(v) else float(v) for v in c.mean],
                    "xaxis": f"x{n}",
                    "yaxis": f"y{n}",
                    "mode": "lines+markers" if len(steps) <= 12 else "lines",
                    "marker": {"size": 4},
                    "line": {**line, "width": 1.5},
                    "name": plain(c.label),
                    "legendgroup": plain(c.label),
                    "showlegend": c.label not in shown,
                    "customdata": c.n.tolist(),
                    "hovertemplate": f"{plain(c.label)}<br>step %{{x}}: %{{y:.4g}} (n=%{{customdata}})<extra></extra>",
                }
            )
            shown.add(c.label)
        layout[f"xaxis{n}"]["title"] = {"text": "step", "standoff": 4}
        _y_axis(layout, i, spec, metric, [float(v) for c in found[i] for v in c.mean if not math.isnan(v)])
    _share_y(layout, panels)
    return _figure(data, layout)


ROW_MASS_TOLERANCE = 0.01  # a row mass this far from 1 (or any negative weight): not a distribution


PROBABILITY_METRICS = ("entropy", "entropy_norm", "max_prob", "saturation")
"""The statistics that read a row as a probability distribution (:data:`attnlab.metrics.PROBABILITY_STATS`): none
for a layer whose weights are signed."""

SIGNED_CELL = "signed"
"""What a per-head heatmap of an entropy-like statistic shows in a layer whose weights are signed."""


def _layer_finals(run: Run, name: str) -> dict[int, float]:
    """The run's final ``attn/L{l}/{name}`` by layer l (the layers that logged a finite value)."""
    out = {}
    for metric in run.metric_names:
        kind, base, where = parse_metric(metric)
        if kind == "layer" and base == f"attn/{name}":
            value = run.final(metric)
            if value is not None:
                out[where["layer"]] = value
    return dict(sorted(out.items()))


def signed_layers(run: Run) -> tuple[tuple[int, ...], int] | None:
    """(the layers whose weights are signed, the number of layers) from the run's ``attn/L{l}/signed`` (1 where the
    layer's form says its weights may be negative: differential attention, the decay and delta-rule forms, RWKV-7,
    MTA); such a layer logs no entropy, ``max_prob`` or saturation. None for a run that logged no such marker (one
    from before it was logged)."""
    marks = _layer_finals(run, "signed")
    if not marks:
        return None
    return tuple(layer for layer, value in marks.items() if value > 0.5), len(marks)


def signed_note(run: Run) -> str | None:
    """Why the run has no entropy-like statistic for some layers (``signed weights in layer 1 of 2: no entropy or
    saturation there; ...``), or None when every layer has them (or the run logged no marker)."""
    found = signed_layers(run)
    if found is None or not found[0]:
        return None
    layers, total = found
    if len(layers) == total:
        return "signed weights in every layer: no entropy or saturation"
    named = ", ".join(map(str, layers))
    return (
        f"signed weights in layer{'s' if len(layers) > 1 else ''} {named} of {total}: no entropy or saturation there; "
        "the model's are of the other layers"
    )


def unnormalised(run: Run) -> str | None:
    """Why the run's attention rows, where it reports an entropy, are no distribution, or None when they are: its
    final ``attn/row_mass`` is not 1 (linear attention without a normaliser, sigmoid, softmax1: ``row mass 0.62``),
    or it has weight below 0 (``attn/negative_mass``). Its ``entropy_norm``, ``max_prob`` and ``saturation`` are
    then statistics of each row's nonnegative part renormalised to 1 (:mod:`attnlab.metrics`), not of the weights.

    A run that marks its signed layers (``attn/L{l}/signed``, :func:`signed_layers`) has no entropy for them, so only
    its other layers are read here (their row masses; they never log weight below 0): a run whose every layer is
    signed gives None (:func:`signed_note` says why it has no entropy). An older run is read from its model means
    (its signed layers, differential attention's, were scored on their nonnegative part)."""
    found = signed_layers(run)
    if found is not None:
        layers = found[0]
        masses = [m for layer, m in _layer_finals(run, "row_mass").items() if layer not in layers]
        if not masses:
            return None
        mass = sum(masses) / len(masses)
        if abs(mass - 1.0) > ROW_MASS_TOLERANCE:
            return f"rows that do not sum to 1 (row mass {mass:.3g})"
        return None
    negative = run.final("attn/negative_mass")
    mass = run.final("attn/row_mass")
    if negative is not None and negative > 1e-6:
        return f"signed weights (weight below 0: {negative:.3g} per row)"
    if mass is not None and abs(mass - 1.0) > ROW_MASS_TOLERANCE:
        return f"rows that do not sum to 1 (row mass {mass:.3g})"
    return None


def head_figure(run: Run, metrics: Sequence[str]) -> dict[str, Any] | None:
    """The run's final per-layer x per-head values of ``metrics`` (``entropy_norm``, ``saturation``) as heatmaps
    with a shared 0..1 colour bar; None when the run logged no per-head diagnostics. In a panel of an entropy-like
    statistic (:data:`PROBABILITY_METRICS`), a layer whose weights are signed (:func:`signed_layers`) has no values:
    its cells say ``signed`` and its row label ``(signed)``, and a note under the figure names those layers."""
    grids = [(m, run.head_grid(m)) for m in metrics]
    grids = [(m, g) for m, g in grids if g is not None]
    if not grids:
        return None
    why = unnormalised(run)
    found = signed_layers(run)
    signed = set(found[0]) if found is not None else set()
    layout = _grid(1, len(grids), [f"final {m}" + (" (renormalised rows)" if why else "") for m, _ in grids])
    layers, _heads = grids[0][1].shape
    notes = []
    if why:  # said on the figure: these are not the entropy of the weights
        notes.append(f"Not a distribution: {why}. These are of each row's nonnegative part, renormalised.")
    if signed and any(m in PROBABILITY_METRICS for m, _ in grids):
        named = ", ".join(map(str, sorted(signed)))
        several = len(signed) > 1
        notes.append(
            f"Signed weights: no entropy or saturation in layer{'s' if several else ''} {named} "
            f"({'their forms' if several else 'its form'} may give negative weights: no distributions)."
        )
    for k, text in enumerate(notes):
        layout["annotations"].append(
            {
                "text": plain(text),
                "xref": "paper",
                "yref": "paper",
                "x": 0,
                "y": 0,
                "yshift": -40 - 18 * k,
                "xanchor": "left",
                "yanchor": "top",
                "showarrow": False,
                "font": {"size": 11, "color": "#a33"},
            }
        )
    layout["height"] = 130 + max(150, 48 * layers)
    layout["margin"]["t"] = 40
    if notes:  # room for the notes under the x axis title
        layout["margin"]["b"] += 12 + 18 * len(notes)
        layout["height"] += 12 + 18 * len(notes)
    for i in range(len(grids)):
        layout[f"yaxis{_axis(i)}"]["domain"] = [0, 1]
    layout["coloraxis"] = {
        "colorscale": "Viridis",
        "cmin": 0.0,
        "cmax": 1.0,
        "colorbar": {"title": {"text": "value", "side": "right"}, "thickness": 14},
    }
    data = []
    for i, (metric, grid) in enumerate(grids):
        n = _axis(i)
        marked = signed if metric in PROBABILITY_METRICS else set()
        trace = {
            "type": "heatmap",
            "z": [[None if math.isnan(v) else round(float(v), 4) for v in row] for row in grid],
            "x": list(range(grid.shape[1])),
            "y": list(range(grid.shape[0])),
            "xaxis": f"x{n}",
            "yaxis": f"y{n}",
            "coloraxis": "coloraxis",
            "texttemplate": "%{z:.2f}",
            "hovertemplate": f"{metric} layer %{{y}} head %{{x}}: %{{z:.3f}}<extra></extra>",
        }
        if marked:  # the signed layers' cells say so (their values are NaN: no colour, no number)
            trace["text"] = [
                [SIGNED_CELL if layer in marked else ("" if math.isnan(v) else f"{v:.2f}") for v in row]
                for layer, row in enumerate(grid)
            ]
            trace["customdata"] = [
                [
                    f"signed weights, no {metric}" if layer in marked else ("-" if math.isnan(v) else f"{v:.3f}")
                    for v in row
                ]
                for layer, row in enumerate(grid)
            ]
            trace["texttemplate"] = "%{text}"
            trace["hovertemplate"] = f"{metric} layer %{{y}} head %{{x}}: %{{customdata}}<extra></extra>"
        data.append(trace)
        layout[f"xaxis{n}"].update(title={"text": "head", "standoff": 4}, tickvals=list(range(grid.shape[1])))
        layout[f"yaxis{n}"].update(
            title={"text": "layer", "standoff": 4}, tickvals=list(range(grid.shape[0])), autorange="reversed"
        )
        if marked:
            layout[f"yaxis{n}"]["ticktext"] = [
                f"{layer} ({SIGNED_CELL})" if layer in marked else str(layer) for layer in range(grid.shape[0])
            ]
    return _figure(data, layout)


def search_figure(runs: Sequence[Run], sweep: Sweep, metric: str) -> dict[str, Any] | None:
    """The search view: ``metric`` of every finished run (one point each) against each swept key, the best run
    marked with a star. None when no finished run reports the metric."""
    done = [r for r in runs if r.ok and r.final(metric) is not None]
    if not done or not sweep.dims:
        return None
    spec = spec_for(metric)
    best = best_run(runs, metric)
    dims = sweep.label_dims(sweep.dims)  # (a run knob only where it tells configurations apart)
    cols = min(MAX_COLS, len(dims))
    layout = _grid(math.ceil(len(dims) / cols), cols, [f"{metric} vs {d.name}" for d in dims])
    data = []
    for i, dim in enumerate(dims):
        n = _axis(i)
        xs, ys, hover = [], [], []
        for run in done:
            xv = x_position(dim, run.value(dim.key))
            if xv is None:
                continue
            xs.append(xv)
            ys.append(run.final(metric))
            settings = sweep.label(run, dims)
            hover.append(f"{plain(run.name)}<br>{plain(settings)}<br>{metric} = {spec.format(run.final(metric))}")
        data.append(
            {
                "type": "scatter",
                "x": xs,
                "y": ys,
                "xaxis": f"x{n}",
                "yaxis": f"y{n}",
                "mode": "markers",
                "marker": {"size": 7, "color": PALETTE[0], "opacity": 0.7},
                "hovertext": hover,
                "hoverinfo": "text",
                "showlegend": i == 0,
                "legendgroup": "runs",
                "name": "runs",
            }
        )
        bx = x_position(dim, best.value(dim.key))
        if bx is not None:
            data.append(
                {
                    "type": "scatter",
                    "x": [bx],
                    "y": [best.final(metric)],
                    "xaxis": f"x{n}",
                    "yaxis": f"y{n}",
                    "mode": "markers",
                    "marker": {"size": 16, "symbol": "star", "color": "#d62728", "line": {"width": 1, "color": "#222"}},
                    "name": "best run",
                    "legendgroup": "best run",
                    "showlegend": i == 0,
                    "hovertext": [f"best: {plain(best.name)}"],
                    "hoverinfo": "text",
                }
            )
        _x_axis(layout, i, dim, xs)
        _y_axis(layout, i, spec, metric, ys)
    layout["showlegend"] = True
    return _figure(data, layout)


def _rgba(colour: str, alpha: float) -> str:
    colour = colour.lstrip("#")
    r, g, b = (int(colour[k : k + 2], 16) for k in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


# ---------------------------------------------------------------------------------------------------- tuned sweeps
FRONTIER_COLOUR = "#444"
FAILED_SYMBOL = "x-thin-open"


def _grid_axis(key: str, values: Sequence[Any]) -> tuple[Callable[[Any], float], bool]:
    """Where a grid value sits on the x axis (the number, or its index for words) and whether the axis is log: a
    numeric key of positive values spanning a factor of 8 or more, or a learning rate (``lr``, ``*.lr``)."""
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not numeric:
        return (lambda v: float(next(i for i, g in enumerate(values) if g == v and type(g) is type(v)))), False
    positive = all(v > 0 for v in values)
    log = positive and len(values) > 1 and (wide_range(values) or key.rsplit(".", 1)[-1] == "lr")
    return (lambda v: float(v)), log


def sensitivity_figure(tuned: TunedSweep) -> dict[str, Any] | None:
    """The tuning runs of a tuned sweep: its metric (on ``tune_seed``) against each grid key, one panel per key
    (the other keys at each configuration's best point), one line per configuration; a failed point is an x at
    the panel's worst edge (the bottom where higher wins, the top where lower wins; hover "failed"), the chosen
    point a star. None without a tuning job."""
    sweep = tuned.sweep or Sweep([])
    configs = [c for c in tuned.ordered() if c.tune]
    if not configs:
        return None
    metric, spec = tuned.metric, spec_for(tuned.metric)
    keys = list(tuned.grid)
    style = Style(sweep, sweep.dims)
    cols = min(MAX_COLS, len(keys))
    titles = [f"{metric} vs {k.rsplit('.', 1)[-1]} (seed {tuned.tune_seed})" for k in keys]
    labels = list(dict.fromkeys(c.label for c in configs))
    layout = _grid(math.ceil(len(keys) / cols), cols, titles, legend_entries=[*labels, "failed", "chosen"])
    layout["showlegend"] = True
    data: list[dict[str, Any]] = []
    shown: set[str] = set()
    for i, key in enumerate(keys):
        n = _axis(i)
        values = tuned.grid[key]
        where, log = _grid_axis(key, values)
        words = not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        panel = []  # (configuration, its jobs along this key in grid order)
        for c in configs:
            anchor = c.best or _anchor(c, tuned.maximize)
            along = [job for job in c.tune if all(job.point[k] == anchor[k] for k in keys if k != key)]
            along.sort(key=lambda job: where(job.point[key]))
            panel.append((c, along))
        finite = [job.value for _, along in panel for job in along if not job.failed and job.value is not None]
        worst = _worst_edge(finite, spec, tuned.maximize)
        failed_x, failed_y, failed_colour, failed_hover = [], [], [], []
        best_x, best_y, best_colour, best_hover = [], [], [], []
        for c, along in panel:
            colour = style.line(c.key)["color"]
            hover = []
            for job in along:
                shown_value = spec.format(job.value) if job.value is not None else "-"
                state = "failed" if job.failed else "not run yet" if job.value is None else shown_value
                where_text = plain(f"{key}={format_value(job.point[key])}")
                hover.append(f"{plain(c.label)}<br>{where_text}: {plain(metric)} = {state}")
                if job.failed:
                    failed_x.append(where(job.point[key]))
                    failed_y.append(worst)
                    failed_colour.append(colour)
                    reason = job.run.reason if job.run is not None and job.run.reason else job.status
                    failed_hover.append(f"{plain(c.label)}<br>{where_text}: failed ({plain(reason)})")
            data.append(
                {
                    "type": "scatter",
                    "x": [where(job.point[key]) for job in along],
                    "y": [None if job.failed else job.value for job in along],
                    "xaxis": f"x{n}",
                    "yaxis": f"y{n}",
                    "mode": "markers" if words else "lines+markers",  # (no line between two words)
                    "name": plain(c.label),
                    "legendgroup": plain(c.label),
                    "showlegend": c.label not in shown,
                    "line": {**style.line(c.key), "width": 1.6},
                    "marker": style.marker(c.key),
                    "hovertext": hover,
                    "hoverinfo": "text",
                }
            )
            shown.add(c.label)
            chosen = c.best_job
            on_panel = chosen is not None and any(job is chosen for job in along)
            if on_panel and not chosen.failed and chosen.value is not None:
                best_x.append(where(chosen.point[key]))
                best_y.append(chosen.value)
                best_colour.append(colour)
                point = plain(", ".join(f"{k}={format_value(v)}" for k, v in chosen.point.items()))
                best_hover.append(f"{plain(c.label)}: chosen {point}, {plain(metric)} = {spec.format(chosen.value)}")
        if failed_x:
            data.append(
                {
                    "type": "scatter",
                    "x": failed_x,
                    "y": failed_y,
                    "xaxis": f"x{n}",
                    "yaxis": f"y{n}",
                    "mode": "markers",
                    "marker": {"symbol": FAILED_SYMBOL, "size": 12, "color": failed_colour, "line": {"width": 2.5}},
                    "name": "failed",
                    "legendgroup": "failed",
                    "showlegend": "failed" not in shown,
                    "hovertext": failed_hover,
                    "hoverinfo": "text",
                }
            )
            shown.add("failed")
        if best_x:
            data.append(
                {
                    "type": "scatter",
                    "x": best_x,
                    "y": best_y,
                    "xaxis": f"x{n}",
                    "yaxis": f"y{n}",
                    "mode": "markers",
                    "marker": {
                        "symbol": "star",
                        "size": 17,
                        "color": best_colour,
                        "line": {"width": 1, "color": "#222"},
                    },
                    "name": "chosen",
                    "legendgroup": "chosen",
                    "showlegend": "chosen" not in shown,
                    "hovertext": best_hover,
                    "hoverinfo": "text",
                }
            )
            shown.add("chosen")
        axis = layout[f"xaxis{n}"]
        ticks = [where(v) for v in values]
        axis["title"] = {"text": plain(key), "standoff": 4}
        axis.update(tickvals=ticks, ticktext=[plain(format_value(v)) for v in values])
        if log:
            axis["type"] = "log"
        elif all(isinstance(v, str | bool) or v is None for v in values):
            axis["range"] = [-0.5, len(values) - 0.5]
        _y_axis(layout, i, spec, metric, [*finite, *([worst] if failed_x else [])])
    return _figure(data, layout)


def _anchor(config: Any, maximize: bool) -> dict[str, Any]:
    """Where the other grid keys stand in a panel when the configuration has no best point yet: at its best
    finished point, else at its first."""
    done = [job for job in config.tune if not job.failed and job.value is not None]
    if done:
        return max(done, key=lambda job: job.value if maximize else -job.value).point
    return config.tune[0].point


def _worst_edge(values: Sequence[float], spec: MetricSpec, maximize: bool) -> float:
    """Where a failed point is drawn: the worst end of the values drawn (the metric's bound where it has one on
    that side: 0 for an accuracy), 10 % of their spread beyond them otherwise."""
    bound = spec.low if maximize else spec.high
    if bound is not None:
        return bound
    if not values:
        return 0.0
    low, high = min(values), max(values)
    pad = 0.1 * (high - low) or 0.1 * abs(high) or 1.0
    return low - pad if maximize else high + pad


def pareto_figure(
    runs: Sequence[Run], sweep: Sweep, metrics: Sequence[str], costs: Sequence[str], notes: Sequence[str] = ()
) -> dict[str, Any] | None:
    """Each metric against each cost (``flops_per_token``, ``params``, ``state_size``, ``wall_time_s``: the ``cost``
    view), log x: one point per configuration (every dimension of ``sweep``) at its mean cost, the mean metric
    over its seeds with the 95 % t interval (clipped to the metric's range) as error bars, and the Pareto
    frontier (better metric for less cost, by the metric's direction) as a dashed step line. A row of panels per
    metric (two rows of two for four costs).

    The legend names the first key that labels name (the variant: a colour), one trace per value in each panel;
    the other keys are each point's marker symbol, with a legend entry per symbol (``marker: heads=2``, drawn in
    grey), and its hover, which names the whole configuration and ``notes`` (a tuned sweep's grid keys: the point
    each configuration ran at). The frontier has no legend entry (the page's note says what it is). None without a
    point."""
    style = Style(sweep, sweep.dims)
    named = sweep.label_dims(sweep.dims)
    first = named[0] if named else None
    at = sweep.dims.index(first) if first is not None else None
    cols = 2 if len(costs) == 4 else min(MAX_COLS, len(costs))
    panels: list[tuple[str, str]] = []
    for metric in metrics:
        panels += [(metric, cost) for cost in costs]
        while len(panels) % cols:
            panels.append(("", ""))
    found = {i: pareto_points(runs, sweep, m, c) for i, (m, c) in enumerate(panels) if m}
    if not any(found.values()):
        return None

    def group(key: tuple[Any, ...]) -> str:
        return first.label(key[at]) if first is not None and at is not None else "all runs"

    present = {group(key) for points in found.values() for _, key, *_ in points}
    ordered = [first.label(v) for v in first.values] if first is not None else ["all runs"]
    names = [name for name in dict.fromkeys(ordered) if name in present]  # (in the order of the key's values)
    symbols: dict[str, str] = {}  # the marker legend: what each symbol stands for (the keys after the first)
    if style.rest:
        for points in found.values():
            for _, key, *_ in points:
                symbols.setdefault(style.point_label(key), style.point(key))
        symbols = {k: symbols[k] for k in sorted(symbols, key=natural_key)}
    titles = [f"{m} vs {c}" if m else "" for m, c in panels]
    layout = _grid(math.ceil(len(panels) / cols), cols, titles, legend_entries=[*names, *symbols])
    layout["showlegend"] = True
    data: list[dict[str, Any]] = []
    for label, symbol in symbols.items():  # legend entries only: no point of their own
        data.append(
            {
                "type": "scatter",
                "x": [None],
                "y": [None],
                "mode": "markers",
                "marker": {"symbol": symbol, "size": 9, "color": "#777"},
                "name": plain(f"marker: {label}"),
                "legendgroup": plain(f"marker: {label}"),
                "showlegend": True,
                "hoverinfo": "skip",
            }
        )
    shown: set[str] = set()
    for i, (metric, cost) in enumerate(panels):
        n = _axis(i)
        if not metric or not found[i]:
            _hide(layout, i)
            continue
        spec, cost_spec = spec_for(metric), spec_for(cost)
        points = found[i]
        for name in names:
            mine = [(label, key, members, p) for label, key, members, p in points if group(key) == name]
            if not mine:
                continue
            up, down, hover = [], [], []
            for label, _key, members, p in mine:
                bounds = p.interval(spec)
                up.append(None if bounds is None else bounds[1] - p.mean)
                down.append(None if bounds is None else p.mean - bounds[0])
                note = note_of(members, notes)
                ci = f"<br>95 % CI [{spec.format(bounds[0])}, {spec.format(bounds[1])}]" if bounds else ""
                hover.append(
                    f"{plain(label)}{f' ({plain(note)})' if note else ''}<br>{cost} = {cost_spec.format(p.x)}"
                    f"<br>{metric} = {spec.format(p.mean)}{ci} (n={p.n})"
                )
            colour = style.line(mine[0][1])["color"]
            data.append(
                {
                    "type": "scatter",
                    "x": [p.x for *_, p in mine],
                    "y": [p.mean for *_, p in mine],
                    "xaxis": f"x{n}",
                    "yaxis": f"y{n}",
                    "mode": "markers",
                    "name": plain(name),
                    "legendgroup": plain(name),
                    "showlegend": name not in shown,
                    "marker": {"symbol": [style.point(key) for _, key, *_ in mine], "size": 9,
                               "color": colour},
                    "error_y": {"type": "data", "symmetric": False, "array": up, "arrayminus": down,
                                "thickness": 1.3, "width": 3, "visible": True, "color": colour},
                    "hovertext": hover,
                    "hoverinfo": "text",
                }
            )  # fmt: skip
            shown.add(name)
        higher = spec.higher_is_better is not False
        front = [points[k][3] for k in pareto_front([(p.x, p.mean) for *_, p in points], higher)]
        data.append(
            {
                "type": "scatter",
                "x": [p.x for p in front],
                "y": [p.mean for p in front],
                "xaxis": f"x{n}",
                "yaxis": f"y{n}",
                "mode": "lines",
                "line": {"shape": "hv", "color": FRONTIER_COLOUR, "dash": "dash", "width": 1.4},
                "name": "Pareto frontier",
                "legendgroup": "Pareto frontier",
                "showlegend": False,
                "hoverinfo": "skip",
            }
        )
        axis = layout[f"xaxis{n}"]
        axis.update(type="log", title={"text": plain(cost_spec.axis_title(cost)), "standoff": 4})
        _y_axis(layout, i, spec, metric, [v for *_, p in points for v in p.values])
    return _figure(data, layout)
