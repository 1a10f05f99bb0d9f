"""The studies' committed tables are what experiments/table.py makes from their committed summary.csv, in the
project's interval convention (mean ± 95 % t half-width, with n), checked by hand for one cell."""

from __future__ import annotations

import csv
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
T975 = {1: 12.706204736, 2: 4.302652730}  # two-sided 95 % t quantiles


def test_a_table_cell_is_the_mean_and_the_95_percent_t_half_width() -> None:
    rows = [r for r in csv.DictReader((REPO / "experiments/dk_saturation/summary.csv").open()) if r["status"] == "ok"]
    accs = [100 * float(r["test/acc"]) for r in rows if (r["variant"], r["d_k"]) == ("dot", "512")]
    assert len(accs) == 3
    half = T975[2] * statistics.stdev(accs) / math.sqrt(3)
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        import table
    finally:
        sys.path.pop(0)
    text = table.table(rows, ["variant", "d_k"], ["test/acc:pct"])
    assert f"| dot | 512 | {statistics.mean(accs):.1f} ± {half:.1f} | 3 |" in text


@pytest.mark.parametrize(
    ("study", "rows", "metrics"),
    [
        (
            "dk_saturation",
            ["variant", "d_k"],
            "test/acc:pct init/attn/saturation:3 init/attn/max_prob:2 init/attn/logit_std:2 attn/saturation:3 "
            "attn/entropy_norm:2".split(),
        ),
        (
            "relative_position",
            ["variant", "variant_params.clip", "pos_encoding"],
            "val/acc_best:pct test/acc:pct attn/attn_distance:1 attn/entropy_norm:2".split(),
        ),
    ],
)
def test_the_committed_results_table_matches_the_committed_csv(study: str, rows: list[str], metrics: list[str]):
    made = subprocess.run(
        [
            sys.executable,
            "experiments/table.py",
            f"experiments/{study}/summary.csv",
            "--rows",
            *rows,
            "--metrics",
            *metrics,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[2:]  # the body; the README names the columns in words
    readme = (REPO / "experiments" / study / "README.md").read_text()
    for line in made:
        assert line in readme, line
    assert not re.search(r"standard deviation", readme)
