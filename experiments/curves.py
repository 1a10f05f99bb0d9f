"""Write chosen metrics over training steps, for every run of a study, to a long CSV that plot.py can draw.

    python experiments/curves.py experiments/stability/runs -o experiments/stability/curves.csv \
        --metrics attn/L0/logit_max attn/L1/logit_max train/loss

One row per run and logged step: ``run`` (the name the study's summary.csv gives the run, so plot.py joins the two on
it), ``step``, and one column per metric to 6 significant digits (empty where that step did not log it). Rows where no
chosen metric was logged are left out. Run folders are read with the dashboard's loader, so a run that failed (diverged)
keeps the steps it logged before it stopped.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from attnlab.dashboard import load_runs


def write_curves(root: Path, metrics: list[str], output: Path) -> int:
    """Write the CSV; returns the number of data rows."""
    count = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "step", *metrics])
        for run in load_runs(root):
            by_step: dict[int, dict[str, float]] = {}
            for metric in metrics:
                steps, values = run.curve(metric)
                for step, value in zip(steps, values, strict=True):
                    if math.isfinite(value):
                        by_step.setdefault(int(step), {})[metric] = float(value)
            for step in sorted(by_step):
                values = (by_step[step].get(m) for m in metrics)
                writer.writerow([run.name, step, *("" if v is None else f"{v:.6g}" for v in values)])
                count += 1
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the study's run folder (what its summary.csv was made from)")
    parser.add_argument("--metrics", nargs="+", required=True, help="metric names as in metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.runs.is_dir():
        parser.error(f"{args.runs} is not a folder of runs")
    rows = write_curves(args.runs, args.metrics, args.output)
    print(f"wrote {args.output} ({rows} rows)")


if __name__ == "__main__":
    main()
