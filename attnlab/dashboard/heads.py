"""What the heads do, on the page: the head atlas, the pruning curves and rank collapse against depth.

* :func:`atlas` reads one run's last per-head scores (``attn/L{l}H{h}/{score}`` of :data:`attnlab.heads.HEAD_SCORES`),
  names each head's type (:func:`attnlab.heads.head_type`), and finds the step at which that score first reached
  the threshold in the run's curve; :func:`atlas_figure` draws it as a layer × head grid with each head's importance.
* :func:`pruning_figure`: the metric of each configuration's ``pruning.json`` against the fraction of heads removed,
  in importance order (solid) and in random order (dotted), the mean over its seeds.
* :func:`rank_figure`: ``attn/L{l}/rank_residual`` (after attention) and ``..._attn`` (the attention output alone)
  against the layer, the mean over seeds with the 95 % t interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnlab.dashboard.dims import Sweep
from attnlab.dashboard.figures import PALETTE, Style, _axis, _figure, _grid, _rgba, plain
from attnlab.dashboard.load import Run
from attnlab.dashboard.stats import grouped
from attnlab.heads import HEAD_SCORES, HEAD_THRESHOLD, HEAD_TYPES, head_type
from attnlab.stats import mean_ci, parse_metric

__all__ = ["TYPE_COLOURS", "AtlasCell", "atlas", "atlas_figure", "pruning_figure", "rank_figure"]

TYPE_COLOURS: dict[str, str] = {
    "prev_token": "#4e79a7",
    "duplicate": "#f28e2b",
    "induction": "#e15759",
    "local": "#59a14f",
    "none": "#d9d9d9",
}
"""The colour of each head type in the atlas (and its legend on the page)."""


@dataclass(frozen=True)
class AtlasCell:
    """One head: its type and the score that names it, every score, its importance (None: not measured), and the
    first step at which the naming score reached the threshold (None: never, or type ``none``)."""

    layer: int
    head: int
    type: str
    score: float
    scores: dict[str, float]
    importance: float | None
    formed_at: float | None


def _first_step(run: Run, name: str, threshold: float) -> float | None:
    steps, values = run.curve(name)
    reached = np.flatnonzero(values >= threshold) if values.size else np.array([], dtype=int)
    return float(steps[reached[0]]) if reached.size else None


def atlas(run: Run, threshold: float = HEAD_THRESHOLD) -> list[list[AtlasCell]] | None:
    """The run's heads, layer by layer (None when it logged no head-type scores: a pixel task, or a run before
    attnlab 0.6). Importance comes from ``attn/L{l}H{h}/importance``, else from ``pruning.json``."""
    grids = {name: run.head_grid(name) for name in HEAD_SCORES}
    if any(grid is None for grid in grids.values()):
        return None
    layers, heads = max(g.shape[0] for g in grids.values()), max(g.shape[1] for g in grids.values())
    importance = run.head_grid("importance")
    if importance is None and run.pruning is not None:
        importance = np.array(run.pruning["importance"], dtype=float)
    out = []
    for layer in range(layers):
        row = []
        for head in range(heads):
            scores = {
                name: float(g[layer, head]) if layer < g.shape[0] and head < g.shape[1] else math.nan
                for name, g in grids.items()
            }
            kind, score = head_type(scores, threshold)
            imp = None
            if importance is not None and layer < importance.shape[0] and head < importance.shape[1]:
                imp = float(importance[layer, head]) if math.isfinite(importance[layer, head]) else None
            formed = None if kind == "none" else _first_step(run, f"attn/L{layer}H{head}/{kind}", threshold)
            row.append(AtlasCell(layer, head, kind, score, scores, imp, formed))
        out.append(row)
    return out


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}g}"


def atlas_figure(run: Run, threshold: float = HEAD_THRESHOLD) -> dict[str, Any] | None:
    """The atlas of one run as a layer × head grid: each cell coloured by the head's type (:data:`TYPE_COLOURS`) and
    labelled with its type, the score, its importance and the step its type formed; hover for every score."""
    cells = atlas(run, threshold)
    if cells is None:
        return None
    kinds = list(TYPE_COLOURS)
    layers, heads = len(cells), len(cells[0])
    z, text, hover = [], [], []
    for row in cells:
        z.append([kinds.index(c.type) for c in row])
        text.append(
            [
                f"{HEAD_TYPES[c.type]} {_number(c.score)}<br>imp {_number(c.importance)}"
                + (f"<br>from step {c.formed_at:g}" if c.formed_at is not None else "")
                for c in row
            ]
        )
        hover.append(
            [
                f"layer {c.layer} head {c.head}: {HEAD_TYPES[c.type]}<br>"
                + "<br>".join(f"{name} {_number(v, 3)}" for name, v in c.scores.items())
                + f"<br>importance {_number(c.importance, 3)}"
                + (f"<br>{c.type} ≥ {threshold:g} from step {c.formed_at:g}" if c.formed_at is not None else "")
                for c in row
            ]
        )
    n = len(kinds)
    colourscale = []
    for i, kind in enumerate(kinds):  # a step per type: z = i is drawn in type i's colour
        colourscale += [[i / n, TYPE_COLOURS[kind]], [(i + 1) / n, TYPE_COLOURS[kind]]]
    layout = _grid(1, 1, [f"head types (threshold {threshold:g}) · importance |∂L/∂ξ|"])
    layout["height"] = 120 + max(160, 70 * layers)
    layout["margin"]["t"] = 40
    layout["yaxis"]["domain"] = [0, 1]
    layout["xaxis"].update(title={"text": "head", "standoff": 4}, tickvals=list(range(heads)))
    layout["yaxis"].update(title={"text": "layer", "standoff": 4}, tickvals=list(range(layers)), autorange="reversed")
    data = [
        {
            "type": "heatmap",
            "z": z,
            "x": list(range(heads)),
            "y": list(range(layers)),
            "zmin": -0.5,
            "zmax": n - 0.5,
            "colorscale": colourscale,
            "showscale": False,
            "text": text,
            "texttemplate": "%{text}",
            "textfont": {"size": 10},
            "hovertext": hover,
            "hoverinfo": "text",
            "xgap": 2,
            "ygap": 2,
        }
    ]
    return _figure(data, layout)


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values))


def pruning_figure(runs: Sequence[Run], sweep: Sweep) -> dict[str, Any] | None:
    """Pruning curves of a sweep on one chart: per configuration (and head count), the mean over its seeds of the
    metric after removing a fraction of the heads, in importance order (solid, markers) and in random order
    (dotted; each run's random orders averaged first). None when no finished run wrote ``pruning.json``."""
    series_dims = sweep.series_dims()
    style = Style(sweep, series_dims)
    lines: list[tuple[str, tuple[Any, ...], list[float], dict[str, list[list[float]]]]] = []
    metric = None
    for label, key, members in grouped([r for r in runs if r.ok], sweep, series_dims):
        by_size: dict[int, dict[str, list[list[float]]]] = {}
        for run in members:
            pruning = run.pruning
            if pruning is None or (metric is not None and pruning["metric"] != metric):
                continue
            metric = pruning["metric"]
            size = pruning["num_layers"] * pruning["num_heads"]
            curves = by_size.setdefault(size, {})
            for order, listed in pruning["curves"].items():
                curves.setdefault(order, []).append([_mean(col) for col in zip(*listed, strict=True)])
        for size, curves in sorted(by_size.items()):
            name = label if len(by_size) == 1 else f"{label} · {size} heads"
            lines.append((name, key, [k / size for k in range(size + 1)], curves))
    if not lines or metric is None:
        return None
    higher = metric == "acc"
    layout = _grid(1, 1, ["the test metric as heads are removed"], legend_entries=[name for name, *_ in lines])
    data = []
    for name, key, xs, curves in lines:
        line = style.line(key) if series_dims else {"color": PALETTE[0], "dash": "solid"}
        for order, dash in (("importance", "solid"), ("random", "dot")):
            if order not in curves:
                continue
            seeds = curves[order]
            ys = [_mean(col) for col in zip(*seeds, strict=True)]
            data.append(
                {
                    "type": "scatter",
                    "x": xs,
                    "y": ys,
                    "mode": "lines+markers" if order == "importance" else "lines",
                    "marker": {"size": 5},
                    "line": {"color": line["color"], "dash": dash, "width": 1.8 if order == "importance" else 1.4},
                    "name": plain(name if order == "importance" else f"{name} · random"),
                    "legendgroup": plain(name),
                    "customdata": [len(seeds)] * len(xs),
                    "hovertemplate": f"{plain(name)} ({order} order)<br>%{{x:.0%}} of the heads removed: "
                    f"{metric} %{{y:.4g}} (n=%{{customdata}})<extra></extra>",
                }
            )
    layout["xaxis"].update(title={"text": "fraction of the heads removed", "standoff": 4}, tickformat=".0%")
    title = "test accuracy" if higher else "test bits per byte"
    layout["yaxis"]["title"] = {"text": f"{title} ({'higher' if higher else 'lower'} is better)", "standoff": 4}
    if higher:
        layout["yaxis"]["tickformat"] = ".0%"
    return _figure(data, layout)


def _layer_values(run: Run, name: str) -> dict[int, float]:
    """The run's final ``attn/L{l}/{name}`` by layer l."""
    out = {}
    for metric in run.metric_names:
        kind, base, where = parse_metric(metric)
        value = run.final(metric) if kind == "layer" and base == f"attn/{name}" else None
        if value is not None:
            out[where["layer"]] = value
    return out


def rank_figure(runs: Sequence[Run], sweep: Sweep) -> dict[str, Any] | None:
    """Rank collapse against depth: the final ``attn/L{l}/rank_residual`` (the token states after layer l's
    attention) and ``rank_residual_attn`` (its attention output alone) against the layer l + 1, one line per
    configuration with the mean over seeds and its 95 % t interval. None when no finished run logged them."""
    series_dims = sweep.series_dims()
    style = Style(sweep, series_dims)
    panels = [
        ("rank_residual", "after the attention sublayer"),
        ("rank_residual_attn", "the attention output alone"),
    ]
    found: list[list[tuple[str, tuple[Any, ...], list[tuple[int, float, float | None, int]]]]] = []
    labels: list[str] = []
    for name, _ in panels:
        lines = []
        for label, key, members in grouped([r for r in runs if r.ok], sweep, series_dims):
            by_layer: dict[int, list[float]] = {}
            for run in members:
                for layer, value in _layer_values(run, name).items():
                    by_layer.setdefault(layer, []).append(value)
            if by_layer:
                points = [(layer + 1, *mean_ci(values)) for layer, values in sorted(by_layer.items())]
                lines.append((label, key, points))
                labels += [label] if label not in labels else []
        found.append(lines)
    if not any(found):
        return None
    layout = _grid(1, 2, [f"‖X − 1x̄ᵀ‖ / ‖X‖ {where}" for _, where in panels], legend_entries=labels)
    data: list[dict[str, Any]] = []
    shown: set[str] = set()
    for i, lines in enumerate(found):
        n = _axis(i)
        for label, key, points in lines:
            line = style.line(key) if series_dims else {"color": PALETTE[0], "dash": "solid"}
            half = [h if h is not None else 0.0 for _, _, h, _ in points]
            data.append(
                {
                    "type": "scatter",
                    "x": [p[0] for p in points],
                    "y": [p[1] for p in points],
                    "xaxis": f"x{n}",
                    "yaxis": f"y{n}",
                    "mode": "lines+markers",
                    "line": {**line, "width": 1.6},
                    "marker": {"size": 6},
                    "error_y": {"type": "data", "array": half, "visible": True, "thickness": 1.2, "width": 3,
                                "color": _rgba(line["color"], 0.7)},
                    "name": plain(label),
                    "legendgroup": plain(label),
                    "showlegend": label not in shown,
                    "customdata": [p[3] for p in points],
                    "hovertemplate": f"{plain(label)}<br>layer %{{x}}: %{{y:.3f}} (n=%{{customdata}})<extra></extra>",
                }
            )  # fmt: skip
            shown.add(label)
        layers = sorted({p[0] for _, _, points in lines for p in points})
        layout[f"xaxis{n}"].update(title={"text": "layer (depth)", "standoff": 4}, tickvals=layers)
        layout[f"yaxis{n}"].update(title={"text": "relative residual (0 = rank 1)", "standoff": 4}, rangemode="tozero")
    return _figure(data, layout)
