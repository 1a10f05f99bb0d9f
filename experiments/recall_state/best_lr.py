"""The learning-rate grid's verdict: for each model of experiments/recall_state, the grid point (one seed) with the
highest val/acc_best, ties broken by fewer steps to 99 % val accuracy, then by the smaller learning rate. A failed
run counts as the worst value, never as the best.

    python experiments/recall_state/best_lr.py RUNS/grid_*      # prints LR_<model>=<lr> lines for run.sh's eval
    python experiments/recall_state/best_lr.py --merge RUNS/grid_kda ...   # only these models' rows replaced

Writes experiments/recall_state/lr_grid.csv (every grid point, the chosen one marked); with ``--merge``, the rows
of the models found in the folders replace theirs and the other models' rows are kept."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def model_label(summary: dict) -> str:
    """The study's name for a run's model: based, window, linear_<map> or the variant."""
    if summary.get("pattern") == "TW":
        return "based"
    if summary.get("pattern") == "L":
        return "window"
    if summary["variant"] == "linear":
        return f"linear_{summary['variant_params'].get('feature_map', 'elu')}"
    if summary["variant"] == "gla" and (summary.get("variant_params") or {}).get("gate") == "channel":
        return "gla_channel"
    return summary["variant"]


FIELDS = ["model", "lr", "status", "val/acc_best", "train/steps_to_99", "chosen"]


def main(folders: list[str]) -> None:
    merge = "--merge" in folders
    folders = [f for f in folders if f != "--merge"]
    points = []
    for folder in folders:
        for path in sorted(Path(folder).glob("*/summary.json")):
            s = json.loads(path.read_text())
            ok = s["status"] == "ok"
            acc = s["metrics"].get("val/acc_best") if ok else None
            steps = s["metrics"].get("train/steps_to_99") if ok else None
            points.append(
                {
                    "model": model_label(s),
                    "lr": s["lr"],
                    "status": s["status"],
                    "val/acc_best": acc,
                    "train/steps_to_99": steps,
                }
            )
    best: dict[str, dict] = {}
    for p in points:
        key = (
            -1.0 if p["val/acc_best"] is None else p["val/acc_best"],
            -(p["train/steps_to_99"] if p["train/steps_to_99"] is not None else math.inf),
            -p["lr"],
        )
        if p["model"] not in best or key > best[p["model"]]["key"]:
            best[p["model"]] = {**p, "key": key}
    rows = [{**p, "chosen": best[p["model"]]["lr"] == p["lr"]} for p in points]
    if merge and (HERE / "lr_grid.csv").exists():
        with (HERE / "lr_grid.csv").open(newline="") as f:
            rows += [r for r in csv.DictReader(f) if r["model"] not in best]
    with (HERE / "lr_grid.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in sorted(rows, key=lambda r: (r["model"], float(r["lr"]))):
            writer.writerow(row)
    for model, p in sorted(best.items()):
        print(f"LR_{model}={p['lr']:g}")


if __name__ == "__main__":
    main(sys.argv[1:])
