"""Reading a study's summary.csv, shared by table.py and plot.py: a column's value (or a key of the JSON
``variant_params`` column, ``variant_params.clip``), numbers, and ``KEY=VALUE`` row filters."""

from __future__ import annotations

import csv
import fnmatch
import json
from pathlib import Path


def value(row: dict[str, str], column: str) -> str | None:
    """A CSV column, or a key inside the JSON ``variant_params`` column (``variant_params.clip``, spelled as JSON:
    ``4``, ``true``); None if empty."""
    if column.startswith("variant_params."):
        params = json.loads(row.get("variant_params") or "{}")
        found = params.get(column.split(".", 1)[1])
        return None if found is None else found if isinstance(found, str) else json.dumps(found)
    if column not in row:
        raise SystemExit(f"no column {column!r} in the CSV; it has: {', '.join(row)}")
    return row[column] or None


def number(text: str | None) -> float | None:
    """``text`` as a float, or None when it is empty or not a number."""
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def matches(row: dict[str, str], conditions: list[str]) -> bool:
    """Whether the row meets every ``KEY=VALUE`` (numbers compare as numbers: ``lr=0.1`` matches ``0.1``);
    ``KEY=A,B`` accepts either value, and a value with ``*`` is a glob (``run=A_heads/*``)."""
    for condition in conditions:
        key, sep, wanted = condition.partition("=")
        if not sep:
            raise SystemExit(f"--where takes KEY=VALUE, got {condition!r}")
        found = value(row, key)
        if not any(_same(found, option) for option in wanted.split(",")):
            return False
    return True


def _same(found: str | None, wanted: str) -> bool:
    if "*" in wanted:  # a glob on the text: run=A_heads/* (the runs of one sweep)
        return fnmatch.fnmatchcase(found or "", wanted)
    a, b = number(found), number(wanted)
    return a == b if a is not None and b is not None else (found or "") == wanted


def read_rows(path: Path, where: list[str] | None = None) -> list[dict[str, str]]:
    """The CSV's rows that match ``where`` (all runs, failed ones included)."""
    with path.open() as f:
        return [r for r in csv.DictReader(f) if matches(r, where or [])]


def check_metrics(rows: list[dict[str, str]], metrics: list[str], lengths: bool = False) -> None:
    """Exit with a message when a metric is no column of the CSV (with ``lengths``: has no ``<metric>@L`` column)."""
    columns = list(rows[0]) if rows else []
    for metric in metrics:
        found = any(c.rpartition("@")[0] == metric for c in columns) if lengths else metric in columns
        if not found:
            kind = f"no {metric}@<length> column" if lengths else f"no column {metric!r}"
            raise SystemExit(f"{kind} in the CSV; metrics it has: {', '.join(c for c in columns if '/' in c)}")
