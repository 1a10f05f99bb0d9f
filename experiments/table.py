"""A study's results table from its summary.csv, in the project's one interval convention: each cell is the mean
over seeds ± the half-width of its 95 % t-interval, with the number of seeds n (the dashboard and the study
figures use the same ``mean_ci``).

    python experiments/table.py experiments/dk_saturation/summary.csv --rows variant d_k \
        --metrics test/acc:pct init/attn/saturation:3 attn/entropy_norm:2

A metric is ``name:pct`` (a fraction shown in %, one decimal) or ``name:<decimals>``; a row key may be a key inside
the ``variant_params`` JSON column (``variant_params.clip``). Rows keep the order in which they first appear.
``--where KEY=VALUE`` keeps only matching runs. Cells average the runs that finished; runs that failed (a diverged
training) are counted in a ``failed`` column instead, which appears when there are any.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from study_csv import check_metrics, read_rows, value

from attnlab.dashboard import mean_ci


def _cell(values: list[float], kind: str) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "—"
    mean, half, _ = mean_ci(values)
    scale, digits = (100.0, 1) if kind == "pct" else (1.0, int(kind))
    text = f"{scale * mean:.{digits}f}"
    return text if half is None else f"{text} ± {scale * half:.{digits}f}"


def table(rows: list[dict[str, str]], keys: list[str], metrics: list[str]) -> str:
    """The markdown table: one line per distinct ``keys``, a column per metric over the runs that finished (status
    ok), and their number n; when some runs failed (diverged), a ``failed`` column counts them per line."""
    groups: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for row in rows:
        groups.setdefault(tuple(value(row, k) or "" for k in keys), []).append(row)
    names = [m.split(":")[0] for m in metrics]
    failed = any(r["status"] != "ok" for r in rows)
    head = [*keys, *names, "n", *(["failed"] if failed else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for group, members in groups.items():
        ok = [r for r in members if r["status"] == "ok"]
        cells = []
        for metric in metrics:
            name, kind = metric.split(":") if ":" in metric else (metric, "3")
            cells.append(_cell([float(r[name]) for r in ok if r.get(name, "") != ""], kind))
        counts = [str(len(ok)), *([str(len(members) - len(ok))] if failed else [])]
        lines.append("| " + " | ".join([*group, *cells, *counts]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--rows", nargs="+", required=True, help="columns that name a row")
    parser.add_argument("--metrics", nargs="+", required=True, help="name:pct or name:<decimals>")
    parser.add_argument("--where", nargs="*", default=[], help="KEY=VALUE filters on the rows")
    args = parser.parse_args(argv)
    rows = read_rows(args.csv, args.where)
    check_metrics(rows, [m.split(":")[0] for m in args.metrics])
    print(table(rows, args.rows, args.metrics))


if __name__ == "__main__":
    main()
