"""The induction study's summary.csv and figure.png from its run folders.

    python experiments/induction/analyze.py outputs/induction experiments/induction

One row per run: task, variant, num_layers, seed, status, test/acc (and test/bpc for the LM), the strongest head's
induction score (``attn/induction_max``) at step 0, at its peak and at the end, the layer that holds the most
induction-like head at the end, the strongest previous-token head's score at the end and its layer, and two
**jump steps**, each the first diagnostics step at which a curve has covered
half of its rise from its step-0 value to where it ends (:func:`jump_step`):

* ``induction_jump``: of ``attn/induction_max`` (None when it never rises by :data:`MIN_INDUCTION_RISE`);
* ``metric_jump``: of ``val/acc`` on MQAR, from the task's chance accuracy (None when it ends less than
  :data:`MIN_ACC_RISE` above it), of ``val/loss`` (its fall) on the LM;
* ``jump_gap``: metric_jump − induction_jump, in steps (0: the same probe; the probes are every 25 steps on MQAR,
  every 50 on the LM).

figure.png: per task and variant, ``attn/induction_max`` (solid) and val/acc (MQAR) or val/loss (LM) (dashed, right
axis) over training, one line per seed, two layers in colour and one layer in grey.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np

from attnlab.dashboard import load_runs

MIN_INDUCTION_RISE = 0.05  # an induction score that rises less than this has not jumped (uniform rows score ~0.04)
MIN_ACC_RISE = 0.10  # nor has a validation accuracy that rises less than 10 points
COLUMNS = [
    "run",
    "task",
    "variant",
    "num_layers",
    "seed",
    "status",
    "test/acc",
    "test/bpc",
    "induction_init",
    "induction_peak",
    "induction_final",
    "induction_layer",
    "prev_token_final",
    "prev_token_layer",
    "induction_jump",
    "metric_jump",
    "jump_gap",
]


def jump_step(
    steps: np.ndarray, values: np.ndarray, minimum_rise: float, falling: bool = False, floor: float | None = None
) -> float | None:
    """The first step at which ``values`` has covered half its rise from its start to where it ends (the mean of its
    last 3 values: a transient bump is no jump), or of its fall with ``falling``; the start is its first value, or
    ``floor`` when that is higher (an accuracy rises from the task's chance level, which a model reaches by learning
    what a sequence holds, before it recalls anything). None when the rise is below ``minimum_rise``."""
    keep = np.isfinite(values)
    steps, values = steps[keep], values[keep]
    if values.size == 0:
        return None
    if falling:
        values = -values
    start = values[0] if floor is None else max(values[0], floor)
    end = values[-3:].mean()
    if end - start < minimum_rise:
        return None
    return float(steps[np.argmax(values >= start + (end - start) / 2)])


def _layer_of_best(run, score: str) -> int | None:
    """The layer (from 0) of the head with the highest final ``score``."""
    grid = run.head_grid(score)
    if grid is None or not np.isfinite(grid).any():
        return None
    return int(np.unravel_index(np.nanargmax(grid), grid.shape)[0])


def summarize(root: Path) -> list[dict[str, object]]:
    rows = []
    for run in load_runs(root):
        steps, induction = run.curve("attn/induction_max")
        text = run.task == "text"
        metric_steps, metric = run.curve("val/loss" if text else "val/acc")
        if text:
            metric_jump = jump_step(metric_steps, metric, 0.0, falling=True)
        else:
            metric_jump = jump_step(metric_steps, metric, MIN_ACC_RISE, floor=run.chance)
        induction_jump = jump_step(steps, induction, MIN_INDUCTION_RISE)
        finite = induction[np.isfinite(induction)]
        gap = None if induction_jump is None or metric_jump is None else metric_jump - induction_jump
        rows.append(
            {
                "run": run.name,
                "task": "MQAR" if run.task == "associative_recall" else run.task,
                "variant": run.variant,
                "num_layers": run.value("num_layers"),
                "seed": run.seed,
                "status": run.status,
                "test/acc": run.final("test/acc"),
                "test/bpc": run.final("test/bpc"),
                "induction_init": float(finite[0]) if finite.size else None,
                "induction_peak": float(finite.max()) if finite.size else None,
                "induction_final": float(finite[-1]) if finite.size else None,
                "induction_layer": _layer_of_best(run, "induction"),
                "prev_token_final": run.final("attn/prev_token_max"),
                "prev_token_layer": _layer_of_best(run, "prev_token"),
                "induction_jump": induction_jump,
                "metric_jump": metric_jump,
                "jump_gap": gap,
            }
        )
    return rows


def _text(value: object) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_csv(rows: list[dict[str, object]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for row in sorted(rows, key=lambda r: (r["task"], r["variant"], r["num_layers"], r["seed"])):
            writer.writerow([_text(row[c]) for c in COLUMNS])


def plot(root: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in load_runs(root) if r.ok]
    tasks = sorted({r.task for r in runs}, key=lambda t: t != "associative_recall")
    variants = ["scaled_dot", "linear", "gla"]
    fig, axes = plt.subplots(len(tasks), len(variants), figsize=(13, 3.6 * len(tasks)), squeeze=False)
    colours = ["#1f77b4", "#d62728", "#2ca02c"]
    for r, task in enumerate(tasks):
        metric = "val/loss" if task == "text" else "val/acc"
        for c, variant in enumerate(variants):
            ax = axes[r][c]
            right = ax.twinx()
            for run in sorted((x for x in runs if x.task == task and x.variant == variant), key=lambda x: x.seed):
                two = run.value("num_layers") == 2
                colour = colours[(run.seed or 0) % 3] if two else "#aaaaaa"
                steps, values = run.curve("attn/induction_max")
                ax.plot(steps, values, color=colour, lw=1.6 if two else 1.0)
                steps, values = run.curve(metric)
                right.plot(steps, values, color=colour, lw=1.0, ls="--")
            name = "MQAR" if task == "associative_recall" else "byte-level LM"
            ax.set_title(f"{name} · {variant}", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylim(0, 1 if task == "associative_recall" else 0.3)
            if c == 0:
                ax.set_ylabel("induction score, best head (solid)")
            if c == len(variants) - 1:
                right.set_ylabel(f"{metric} (dashed)")
            if task == "associative_recall":
                right.set_ylim(0, 1)
    fig.suptitle("Induction score and validation metric over training: 2 layers (one colour per seed), 1 layer (grey)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the study's run folders (outputs/induction)")
    parser.add_argument("out", type=Path, help="where summary.csv and figure.png go (experiments/induction)")
    args = parser.parse_args(argv)
    rows = summarize(args.runs)
    write_csv(rows, args.out / "summary.csv")
    plot(args.runs, args.out / "figure.png")
    print(f"wrote {args.out / 'summary.csv'} ({len(rows)} runs) and {args.out / 'figure.png'}")


if __name__ == "__main__":
    main()
