"""Plot a study's summary.csv: each metric against one column, one line per group, mean ± 95 % CI over seeds.

    python experiments/plot.py experiments/dk_saturation/summary.csv --x d_k --group variant --logx \
        --metrics test/acc init/attn/saturation attn/saturation -o experiments/dk_saturation/figure.png

- ``--x`` is a column (or ``variant_params.<key>``, a key inside that JSON column), or ``length``: then each metric
  ``m`` is read from the columns ``m@L`` (``test/acc@64``) and drawn against the test length L. A column whose values
  are not all numbers (or any column, with ``--categorical``) is drawn as categories, in the order they first
  appear (sorted, when they are numbers). Accuracies (``*/acc``, ``*/acc_best``, ``*/acc@L``) are drawn in %.
- ``--where KEY=VALUE`` keeps only the rows whose column matches (numbers compare as numbers: ``lr=0.1`` matches
  ``1e-1``; ``KEY=A,B`` takes either value; ``run=A_heads/*`` is a glob); several are all required.
- A line's name is its group values joined by " · " (empty ones left out); ``--rename "OLD:NEW"`` replaces one.
- Error bars are the 95 % t-interval over seeds, clipped to the metric's range (``attnlab.dashboard.spec_for``: an
  accuracy stays within 0..100 %); on a categorical x the lines are set side by side.
- Runs that failed (a diverged training) are not averaged; where a point has some, a red ✕ at the top of the panel
  gives their count, so the plot never hides them.
- A panel whose values are all positive and span more than a factor of 100 gets a log y axis.
- ``--curves curves.csv`` (from experiments/curves.py) adds a second row: each of its metrics over steps, one thin
  line per run (a run that diverged ends in a ✕), for the runs that ``--curve-where`` keeps.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.transforms import blended_transform_factory
from study_csv import check_metrics, matches, number, read_rows, value

from attnlab.dashboard import mean_ci, spec_for


def _label(row: dict[str, str], group: list[str], renames: dict[str, str]) -> str:
    label = " · ".join(v for v in (value(row, g) for g in group) if v)
    return renames.get(label, label)


def _points(rows: list[dict[str, str]], x: str, metric: str) -> list[tuple[str, dict[str, str], float | None]]:
    """(x value, row, metric value or None) for each row, one per test length when ``x`` is ``length``."""
    out = []
    for row in rows:
        if x == "length":
            for column, text in row.items():
                base, _, length = column.rpartition("@")
                if base == metric and length.isdigit():
                    out.append((length, row, number(text or None)))
        else:
            out.append((value(row, x), row, number(row.get(metric) or None)))
    return [p for p in out if p[0] is not None]


def _percent(metric: str) -> bool:
    """Accuracies are drawn in %."""
    return metric.rpartition("@")[0 if "@" in metric else 2].split("/")[-1] in ("acc", "acc_best")


def _auto_logy(ax, ys: list[float]) -> None:
    """A log y axis for positive values spanning more than a factor of 100 (attention logits from 5 to 1000)."""
    if ys and min(ys) > 0 and max(ys) / min(ys) > 100:
        ax.set_yscale("log")


def _draw_metric(
    ax, rows, x: str, metric: str, group: list[str], renames: dict[str, str], options: argparse.Namespace
) -> None:
    """One panel: ``metric`` against ``x``, a line per group (mean and clipped 95 % interval), failed runs counted."""
    points = _points(rows, x, metric)
    scale = 100.0 if _percent(metric) else 1.0
    xs = [p[0] for p in points]
    all_numbers = all(number(v) is not None for v in xs)
    numeric = all_numbers and not options.categorical
    order = sorted(set(xs), key=float) if all_numbers else list(dict.fromkeys(xs))
    position = {v: (float(v) if numeric else i) for i, v in enumerate(order)}
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    failed: dict[str, int] = defaultdict(int)
    for xv, row, y in points:
        if row["status"] == "ok" and y is not None and math.isfinite(y):
            values[_label(row, group, renames)][xv].append(scale * y)
        elif row["status"] != "ok":
            failed[xv] += 1
    spec = spec_for(metric)
    low = -math.inf if spec.low is None else scale * spec.low
    high = math.inf if spec.high is None else scale * spec.high
    for k, (label, by_x) in enumerate(values.items()):
        keys = [v for v in order if v in by_x]
        stats = [mean_ci(by_x[v]) for v in keys]
        means = [mean for mean, _, _ in stats]
        halves = [half or 0.0 for _, half, _ in stats]
        dodge = 0.0 if numeric else 0.1 * (k - (len(values) - 1) / 2)  # categories: lines side by side
        ax.errorbar(
            [position[v] + dodge for v in keys],
            means,
            yerr=[  # the 95 % interval, clipped to what the metric can be (an accuracy stays in 0..100 %)
                [m - max(m - h, low) for m, h in zip(means, halves, strict=True)],
                [min(m + h, high) - m for m, h in zip(means, halves, strict=True)],
            ],
            marker="o",
            markersize=4,
            capsize=3,
            label=label,
        )
    _auto_logy(ax, [y for by_x in values.values() for ys in by_x.values() for y in ys])
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for xv, count in failed.items():
        ax.plot(position[xv], 0.97, "x", color="red", transform=top, markersize=7, clip_on=False)
        ax.text(position[xv], 0.91, str(count), color="red", transform=top, ha="center", va="top", fontsize=7)
    if not numeric:
        ax.set_xticks(range(len(order)), order, rotation=30 if max(map(len, order), default=0) > 4 else 0, ha="right")
    elif options.logx:
        ax.set_xscale("log", base=2 if all(float(v).is_integer() for v in order) else 10)
        ax.set_xticks([position[v] for v in order], [f"{float(v):g}" for v in order])
        ax.minorticks_off()
    ax.set_xlabel("test length" if x == "length" else x)
    ax.set_title(metric + (" (%)" if scale == 100.0 else ""), fontsize=10)
    ax.grid(alpha=0.3)


def _draw_curves(ax, curves, summary, metric: str, group: list[str], renames: dict[str, str], colors) -> None:
    drawn: list[float] = []
    for run, points in curves.items():
        row = summary.get(run)
        if row is None:
            continue
        steps = [s for s, v in points if metric in v]
        ys = [v[metric] for s, v in points if metric in v]
        if not steps:
            continue
        color = colors(_label(row, group, renames))
        ax.plot(steps, ys, color=color, linewidth=0.9, alpha=0.75)
        drawn += ys
        if row["status"] != "ok":
            ax.plot(steps[-1], ys[-1], "x", color="red", markersize=7)
    _auto_logy(ax, drawn)
    ax.set_xlabel("step")
    ax.set_title(metric, fontsize=10)
    ax.grid(alpha=0.3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--x", required=True, help="column on the x axis, variant_params.<key>, or 'length'")
    parser.add_argument("--group", nargs="+", default=["variant"], help="columns that name a line")
    parser.add_argument("--metrics", nargs="+", required=True)
    parser.add_argument("--where", nargs="*", default=[], help="KEY=VALUE filters on the rows")
    parser.add_argument("--rename", nargs="*", default=[], help="'OLD:NEW' line names")
    parser.add_argument("--logx", action="store_true")
    parser.add_argument("--categorical", action="store_true", help="draw a numeric x as evenly spaced categories")
    parser.add_argument("--curves", type=Path, default=None, help="curves.csv from experiments/curves.py")
    parser.add_argument("--curve-where", nargs="*", default=[], help="KEY=VALUE filters on the curves' runs")
    parser.add_argument("--title", default=None)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    renames = dict(r.split(":", 1) for r in args.rename)

    rows = read_rows(args.csv, args.where)
    if not rows:
        raise SystemExit(f"no row of {args.csv} matches {' '.join(args.where) or 'anything'}")
    check_metrics(rows, args.metrics, lengths=args.x == "length")
    curves: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
    curve_metrics: list[str] = []
    if args.curves is not None:
        reader = csv.DictReader(args.curves.open())
        curve_metrics = [c for c in reader.fieldnames or [] if c not in ("run", "step")]
        for r in reader:
            curves[r["run"]].append((float(r["step"]), {m: float(r[m]) for m in curve_metrics if r[m] != ""}))
    ncols = max(len(args.metrics), len(curve_metrics))
    nrows = 2 if curve_metrics else 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.0 * ncols, 3.4 * nrows), squeeze=False)
    for ax, metric in zip(axes[0], args.metrics, strict=False):
        _draw_metric(ax, rows, args.x, metric, args.group, renames, args)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if curve_metrics:
        color_of = {label: h.lines[0].get_color() for h, label in zip(handles, labels, strict=True)}
        summary = {r["run"]: r for r in rows if matches(r, args.curve_where)}
        for ax, metric in zip(axes[1], curve_metrics, strict=False):
            _draw_curves(ax, curves, summary, metric, args.group, renames, lambda lab: color_of.get(lab, "gray"))
        where = " ".join(args.curve_where)
        axes[1][0].annotate(
            f"over training steps, {where} (one line per run)", (0, 1.12), xycoords="axes fraction", fontsize=9
        )
    for r, used in enumerate([len(args.metrics), len(curve_metrics)][:nrows]):
        for ax in axes[r][used:]:
            ax.set_visible(False)
    if args.title:
        fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    if labels:  # one legend for all panels, right of them (the saved image grows to hold it)
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.savefig(args.output, dpi=90, bbox_inches="tight")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
