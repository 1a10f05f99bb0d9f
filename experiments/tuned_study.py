"""Reading a tuned study's summary.csv (``hydra/sweeper=tuned`` through ``experiments/lib.sh``'s ``tuned``), shared by
the studies' analyze.py scripts: the runs of the seed stage grouped by model and task, their cells (mean ± the
half-width of the 95 % t-interval over seeds) and paired differences between two models (same seed, same data;
``attnlab.stats.paired_difference``), each with the learning rate the grid chose.

A run's stage is the folder under its sweep (``NAME/tune/...`` or ``NAME/seeds/...``); only the seeds stage is
compared, the tuning seed (0) never is.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from attnlab.stats import Difference, holm, mean_ci, paired_difference

Row = dict[str, Any]


def recorded_model(row: Row) -> str:
    """The model name the run recorded (the CSV's ``model`` column: a comparison's model, a named setting such as
    ``gated_deltanet_beta2``, or the variant), else its ``variant`` (a CSV written before the column)."""
    return row.get("model") or row["variant"]


def load(
    path: Path, model_of: Callable[[Row], str] = recorded_model, task_of: Callable[[Row], str] = lambda r: r["task"]
) -> list[Row]:
    """The CSV's rows, each with ``model`` (``model_of``; default: the name the run recorded, :func:`recorded_model`),
    ``task``, ``stage`` (``tune``/``seeds``), ``seed`` (int), ``lr`` (float), ``ok`` (the run finished), ``params``
    (the ``variant_params`` JSON, in place of the CSV's parameter count) and ``param_count`` (that count, as text)
    added."""
    rows: list[Row] = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            row["param_count"] = row.get("params") or ""
            row["params"] = json.loads(row.get("variant_params") or "{}")
            parts = row["run"].split("/")
            row["sweep"], row["stage"] = parts[0], parts[1] if len(parts) > 2 else "seeds"
            row["seed"], row["lr"] = int(row["seed"]), float(row["lr"])
            row["ok"] = row.get("status", "ok") == "ok"
            row["model"], row["task"] = model_of(row), task_of(row)
            rows.append(row)
    if not rows:
        raise SystemExit(f"{path} has no runs")
    return rows


def number(row: Row, metric: str) -> float:
    """The row's ``metric`` as a float (NaN when empty or the run failed)."""
    text = row.get(metric) or ""
    try:
        return float(text) if row["ok"] else math.nan
    except ValueError:
        return math.nan


def seeds(rows: Sequence[Row], model: str, task: str) -> dict[int, Row]:
    """The seed-stage runs of one model on one task, by seed."""
    return {r["seed"]: r for r in rows if r["model"] == model and r["task"] == task and r["stage"] == "seeds"}


def chosen_lr(rows: Sequence[Row], model: str, task: str) -> float | None:
    """The learning rate the grid chose for a model on a task (the one its seed-stage runs used)."""
    found = {r["lr"] for r in seeds(rows, model, task).values()}
    return found.pop() if len(found) == 1 else None


def cell(rows: Sequence[Row], model: str, task: str, metric: str, scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± half-width`` over the seeds (× ``scale``: % by default); ``—`` without a finished run."""
    values = [number(r, metric) for r in seeds(rows, model, task).values()]
    mean, half, n = mean_ci(values)
    if n == 0:
        return "—"
    text = f"{mean * scale:.{digits}f}"
    failed = len(values) - n
    return (text if half is None else f"{text} ± {half * scale:.{digits}f}") + (f" ({failed} failed)" if failed else "")


def values(rows: Sequence[Row], model: str, task: str, metric: str) -> dict[int, float]:
    """``{seed: value}`` of the finished seed-stage runs."""
    out = {seed: number(r, metric) for seed, r in seeds(rows, model, task).items()}
    return {seed: v for seed, v in out.items() if math.isfinite(v)}


def difference(rows: Sequence[Row], a: str, b: str, task: str, metric: str) -> Difference:
    """The paired difference ``a − b`` of ``metric`` by seed on ``task``."""
    return paired_difference(values(rows, a, task, metric), values(rows, b, task, metric))


def difference_text(d: Difference, scale: float = 100.0, digits: int = 1) -> str:
    """``+12.3 ± 4.5 (p 0.01)``: the mean difference in points, its 95 % half-width and the paired t test's p."""
    text = f"{d.mean * scale:+.{digits}f}"
    if d.half_width is not None:
        text += f" ± {d.half_width * scale:.{digits}f}"
    if d.p is not None:
        text += f" (p {d.p:.2g})"
    return text


def holm_table(comparisons: Sequence[tuple[str, Difference]]) -> list[tuple[str, Difference, float | None]]:
    """Each comparison with its Holm-adjusted p over the family (None where untested)."""
    tested = [i for i, (_, d) in enumerate(comparisons) if d.p is not None]
    adjusted = dict(zip(tested, holm([comparisons[i][1].p for i in tested]), strict=True))  # type: ignore[misc]
    return [(name, d, adjusted.get(i)) for i, (name, d) in enumerate(comparisons)]


def markdown(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in body]
    return "\n".join(lines)


def mean_and_half(rows: Sequence[Row], model: str, task: str, metric: str) -> tuple[float, float]:
    """(mean, half-width or 0) over the seeds, for plotting; NaN mean without a finished run."""
    mean, half, _ = mean_ci(list(values(rows, model, task, metric).values()))
    return mean, half or 0.0


def draw_models(
    ax: Any, rows: Sequence[Row], models: Sequence[str], task: str, metric: str, offset: float, **style: Any
) -> None:
    """One point per model at ``x = index + offset`` on ``ax``: ``metric`` in % (mean over the seeds) with its 95 %
    interval clipped to 0–100 %, as the study figures of ``experiments/plot.py`` draw an accuracy; ``style`` goes to
    ``errorbar`` (fmt, color, label, ...)."""
    xs, ys, below, above = [], [], [], []
    for i, model in enumerate(models):
        mean, half = mean_and_half(rows, model, task, metric)
        mean, half = 100 * mean, 100 * half
        xs.append(i + offset)
        ys.append(mean)
        below.append(min(half, max(mean, 0.0)) if math.isfinite(mean) else 0.0)
        above.append(min(half, max(100 - mean, 0.0)) if math.isfinite(mean) else 0.0)
    ax.errorbar(xs, ys, yerr=[below, above], linestyle="none", **style)


def by_sweep(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """The rows grouped by their sweep (the run folder's first part)."""
    out: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        out[r["sweep"]].append(r)
    return out


def report(
    here: Path, sections: Sequence[str], figure: Callable[[Path], None], longer: Callable[[Path], str] | None = None
) -> None:
    """An analyze.py's output: its sections (Markdown) a blank line apart, then the table of ``longer(longer.csv)``
    where the study has a longer.sh and its CSV is committed, and ``figure`` drawn to ``here/figure.png``."""
    if longer is not None and (here / "longer.csv").exists():
        sections = [*sections, longer(here / "longer.csv")]
    print("\n\n".join(sections))
    figure(here / "figure.png")
    print(f"\nwrote {here / 'figure.png'}")
