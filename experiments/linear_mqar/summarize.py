"""The linear-attention MQAR table: experiments/mqar/summarize.py's rows (one per run) with each model's recurrent
state (``state_size`` of summary.json, summed over the layers: floats per sequence), and a mean over seeds.

    python experiments/linear_mqar/summarize.py outputs/linear_mqar --csv experiments/linear_mqar/summary.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mqar"))
from summarize import COLUMNS, rows  # noqa: E402

from attnlab.runs import find_runs, load_run  # noqa: E402

FIELDS = (*COLUMNS, "state_size")


def with_state(roots: list[str]) -> list[dict]:
    """The rows, each with its run's total state size."""
    sizes = {}
    for root in roots:
        for folder in find_runs(root):
            s = load_run(folder).summary or {}
            key = (s.get("seed"), s.get("wall_time_s"))
            sizes[key] = sum(s.get("state_size") or []) or None
    return [{**r, "state_size": sizes.get((r["seed"], r["wall_time_s"]))} for r in rows(roots)]


def means(table: list[dict]) -> str:
    """A markdown table: per (pairs, label), the mean test accuracy, the seeds that reached 99 % and their mean
    steps to 99 %, and the state size."""
    groups: dict[tuple, list[dict]] = {}
    for r in table:
        groups.setdefault((r["num_pairs"], r["seq_len"], r["label"]), []).append(r)
    lines = [
        "| pairs (tokens) | variant | state (floats/seq) | test acc (mean, per seed) | reached 99 % | steps to 99 % |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (pairs, length, name), rs in sorted(groups.items()):
        accs = [100 * r["test_acc"] for r in rs]
        hit = [r["steps_to_99"] for r in rs if r["steps_to_99"] is not None]
        steps = f"{statistics.mean(hit):.0f}" if hit else "—"
        per = ", ".join(f"{a:.1f}" for a in accs)
        state = f"{rs[0]['state_size']:,}" if rs[0]["state_size"] else "—"
        lines.append(
            f"| {pairs} ({length}) | {name} | {state} | {statistics.mean(accs):.1f} % ({per}) | "
            f"{len(hit)}/{len(rs)} | {steps} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="run or sweep folders")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    table = with_state(args.roots)
    if not table:
        print(f"error: no finished runs under {', '.join(args.roots)}", file=sys.stderr)
        return 1
    print(means(table))
    if args.csv:
        with Path(args.csv).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
