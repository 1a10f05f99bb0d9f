"""Merge a partial run of the recall-state study into its summary.csv: the rows of the named models are taken from
the new CSV (and theirs in summary.csv dropped), every other model's rows are kept; the columns are the union, in
summary.csv's order, then the new ones. A new row without its learning rate (the dashboard's CSV leaves out a column
that is the same in every run, as one model's rate is) takes the rate its grid chose (lr_grid.csv).

    python experiments/recall_state/merge.py experiments/recall_state/summary.new.csv kda gla_channel

(run.sh does this when MODELS is set; the new CSV is removed afterwards)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from plot import model  # noqa: E402


def chosen_lr() -> dict[str, str]:
    """model → the learning rate its grid chose (lr_grid.csv's ``chosen`` rows)."""
    path = HERE / "lr_grid.csv"
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        return {r["model"]: r["lr"] for r in csv.DictReader(f) if r["chosen"] == "True"}


def main(new_csv: str, models: list[str]) -> None:
    summary = HERE / "summary.csv"
    with summary.open(newline="") as f:
        old = csv.DictReader(f)
        fields, old_rows = list(old.fieldnames or []), list(old)
    with Path(new_csv).open(newline="") as f:
        new = csv.DictReader(f)
        fields += [c for c in new.fieldnames or [] if c not in fields]
        new_rows = [r for r in new if model(r) in models]
    if not new_rows:
        sys.exit(f"merge.py: {new_csv} has no rows of {', '.join(models)}; summary.csv left as it was")
    chosen = chosen_lr()
    for r in new_rows:  # the dashboard's CSV leaves out a column that is the same in every run (one model's lr)
        if not r.get("lr") and model(r) in chosen:
            r["lr"] = chosen[model(r)]
    kept = [r for r in old_rows if model(r) not in models]
    with summary.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(kept + new_rows)
    Path(new_csv).unlink()
    print(f"summary.csv: {len(kept)} rows kept, {len(new_rows)} of {', '.join(models)} merged")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
