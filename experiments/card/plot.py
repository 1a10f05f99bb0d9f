"""The capability card as a figure: variant × task heatmap of the mean test accuracy, ± the 95 % interval in each
cell, ★ on a task's winner and = on its ties, chance under each task's name.

    python experiments/card/plot.py experiments/card/card.csv -o experiments/card/card.png
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = list(csv.DictReader(args.csv.open()))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["task"], r["variant"]): r for r in rows}
    grid = [[float(by[t, v]["test_acc"]) if (t, v) in by and by[t, v]["test_acc"] else float("nan") for t in tasks]
            for v in variants]  # fmt: skip
    fig, ax = plt.subplots(figsize=(1.9 * len(tasks) + 1.5, 0.8 * len(variants) + 1.6))
    ax.imshow(grid, cmap="Greens", vmin=0.5, vmax=1, aspect="auto")  # (the card's cells lie between chance and 1)
    for i, v in enumerate(variants):
        for j, t in enumerate(tasks):
            r = by.get((t, v))
            if r is None or not r["test_acc"]:
                continue
            half = f" ± {100 * min(float(r['half_width']), 1):.1f}" if r["half_width"] else ""
            mark = {"win": " ★", "tie": " ="}.get(r["verdict"], "")
            colour = "white" if float(r["test_acc"]) > 0.9 else "black"
            ax.text(j, i, f"{100 * float(r['test_acc']):.1f}{half}{mark}", ha="center", va="center", color=colour,
                    fontsize=9)  # fmt: skip
    chance = {t: next((r["chance"] for r in rows if r["task"] == t and r["chance"]), "") for t in tasks}
    labels = [f"{t}\n(chance {100 * float(chance[t]):.0f} %)" if chance[t] else t for t in tasks]
    ax.set_xticks(range(len(tasks)), labels, fontsize=9)
    ax.set_yticks(range(len(variants)), variants)
    ax.set_title(
        "Capability card: test accuracy (%), mean ± 95 % interval over seeds, each at its tuned lr", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
