"""A study's results table from its summary.csv, in the project's one interval convention: each cell is the mean
over seeds ± the half-width of its 95 % t-interval, with the number of seeds n (the dashboard and the study
figures use the same ``mean_ci``).

    python experiments/table.py experiments/dk_saturation/summary.csv --rows variant d_k \
        --metrics test/acc:pct init/attn/saturation:3 attn/entropy_norm:2

A metric is ``name:pct`` (a fraction shown in %, one decimal) or ``name:<decimals>``; a row key may be a key inside
the ``variant_params`` JSON column (``variant_params.clip``). Rows keep the order in which they first appear.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from attnlab.dashboard import mean_ci


def _value(row: dict[str, str], column: str) -> str:
    if column.startswith("variant_params."):
        return str(json.loads(row["variant_params"] or "{}").get(column.split(".", 1)[1], ""))
    return row[column]


def _cell(values: list[float], kind: str) -> str:
    mean, half, _ = mean_ci(values)
    scale, digits = (100.0, 1) if kind == "pct" else (1.0, int(kind))
    text = f"{scale * mean:.{digits}f}"
    return text if half is None else f"{text} ± {scale * half:.{digits}f}"


def table(rows: list[dict[str, str]], keys: list[str], metrics: list[str]) -> str:
    """The markdown table: one line per distinct ``keys``, a column per metric, and n."""
    groups: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for row in rows:
        groups.setdefault(tuple(_value(row, k) for k in keys), []).append(row)
    names = [m.split(":")[0] for m in metrics]
    lines = ["| " + " | ".join([*keys, *names, "n"]) + " |", "|" + " --- |" * (len(keys) + len(names) + 1)]
    for group, members in groups.items():
        cells = []
        for metric in metrics:
            name, kind = metric.split(":") if ":" in metric else (metric, "3")
            cells.append(_cell([float(r[name]) for r in members if r.get(name, "") != ""], kind))
        lines.append("| " + " | ".join([*group, *cells, str(len(members))]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--rows", nargs="+", required=True, help="columns that name a row")
    parser.add_argument("--metrics", nargs="+", required=True, help="name:pct or name:<decimals>")
    args = parser.parse_args(argv)
    rows = [r for r in csv.DictReader(args.csv.open()) if r["status"] == "ok"]
    print(table(rows, args.rows, args.metrics))


if __name__ == "__main__":
    main()
