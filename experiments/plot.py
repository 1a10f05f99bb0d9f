"""Plot a study's summary.csv: each metric against one column, one line per group, mean ± 95 % CI over seeds.

    python experiments/plot.py experiments/dk_saturation/summary.csv --x d_k --group variant --logx \
        --metrics test/acc init/attn/saturation attn/saturation -o experiments/dk_saturation/figure.png
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from attnlab.dashboard import mean_ci


def _value(row: dict[str, str], column: str) -> str | None:
    """A CSV column, or a key inside the JSON ``variant_params`` column (``variant_params.clip``)."""
    if column.startswith("variant_params."):
        params = json.loads(row["variant_params"] or "{}")
        return params.get(column.split(".", 1)[1])
    return row[column] or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--x", required=True, help="column on the x axis (or variant_params.<key>)")
    parser.add_argument("--group", nargs="+", default=["variant"], help="columns that name a line")
    parser.add_argument("--metrics", nargs="+", required=True)
    parser.add_argument("--logx", action="store_true")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)

    rows = [r for r in csv.DictReader(args.csv.open()) if r["status"] == "ok"]
    fig, axes = plt.subplots(1, len(args.metrics), figsize=(4.2 * len(args.metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], args.metrics, strict=True):
        lines: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            x = _value(r, args.x)
            if r.get(metric, "") != "" and x is not None:
                label = " ".join(r[g] for g in args.group if r[g])
                lines[label][float(x)].append(float(r[metric]))
        for label, points in sorted(lines.items()):
            xs = sorted(points)
            stats = [mean_ci(points[x]) for x in xs]
            ax.errorbar(
                xs, [m for m, _, _ in stats], yerr=[h or 0 for _, h, _ in stats], marker="o", capsize=3, label=label
            )
        ax.set_xlabel(args.x)
        ax.set_title(metric)
        if args.logx:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=90)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
