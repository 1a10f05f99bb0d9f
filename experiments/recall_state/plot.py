"""The recall-state study's figures, from its summary.csv:

    python experiments/recall_state/plot.py      # frontier.png and pairs.png beside this file

- ``frontier.png``: per rung (pairs, length), test accuracy against the state per sequence (both layers, floats,
  log axis), one point per model and width (mean ± 95 % t-interval over seeds, clipped to 0–100 %), a model's
  widths joined; the
  recall-state frontier (the best accuracy reached at or below each state size) drawn in grey.
- ``pairs.png``: test accuracy against the number of pairs at each width, one line per model.
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from attnlab.dashboard import mean_ci  # noqa: E402

ORDER = [
    "scaled_dot",
    "window",
    "linear_elu",
    "linear_taylor",
    "based",
    "retnet",
    "gla",
    "deltanet",
    "gated_deltanet",
    "gla_channel",
    "kda",
    "deltaproduct",
]
# colour cycle C0–C9, then black and crimson (an 11th model would repeat C0 = scaled_dot); a marker each
STYLE = {m: (([f"C{i}" for i in range(10)] + ["k", "crimson"])[i], "os^vDP*Xhp<>"[i]) for i, m in enumerate(ORDER)}


def model(row: dict[str, str]) -> str:
    """The study's name for a row's model (as best_lr.py names it)."""
    if row.get("pattern") == "TW":
        return "based"
    if row.get("pattern") == "L":
        return "window"
    params = json.loads(row["variant_params"] or "{}")
    if row["variant"] == "linear":
        return "linear_" + params.get("feature_map", "elu")
    if row["variant"] == "gla" and params.get("gate") == "channel":
        return "gla_channel"
    return row["variant"]


def points(rows: list[dict[str, str]]) -> dict[tuple[str, int, int], tuple[float, float, float | None, int]]:
    """(model, pairs, d_model) → (state, mean test acc %, CI half-width, n)."""
    groups: dict[tuple[str, int, int], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        groups[(model(r), int(r["task.datamodule.num_pairs"]), int(r["d_model"]))].append(r)
    out = {}
    for key, rs in groups.items():
        accs = [100 * float(r["test/acc"]) for r in rs if r["status"] == "ok" and r["test/acc"]]
        mean, half, n = mean_ci(accs)
        out[key] = (float(rs[0]["state_size"]), mean, half, n)
    return out


def clipped(line: list[tuple[float, float, float | None, int]]) -> list[list[float]]:
    """The 95 % intervals as (below, above) error bars, clipped to 0 … 100 % (as experiments/plot.py does)."""
    return [[min(h or 0, a) for _, a, h, _ in line], [min(h or 0, 100 - a) for _, a, h, _ in line]]


def main() -> None:
    rows = list(csv.DictReader((HERE / "summary.csv").open()))
    pts = points(rows)
    rungs = sorted({p for _, p, _ in pts})
    widths = sorted({d for _, _, d in pts})
    models = [m for m in ORDER if any(k[0] == m for k in pts)]

    fig, axes = plt.subplots(1, len(rungs), figsize=(5 * len(rungs), 4.2), sharey=True)
    for ax, pairs in zip(axes, rungs, strict=True):
        frontier = sorted((s, a) for (m, p, _), (s, a, _, _) in pts.items() if p == pairs)
        best, xs, ys = -1.0, [], []
        for s, a in frontier:
            best = max(best, a)
            xs.append(s)
            ys.append(best)
        ax.step(xs, ys, where="post", color="0.8", lw=4, zorder=0, label="frontier")
        for m in models:
            line = [pts[(m, pairs, d)] for d in widths if (m, pairs, d) in pts]
            color, marker = STYLE[m]
            ax.errorbar(
                [s for s, *_ in line],
                [a for _, a, _, _ in line],
                yerr=clipped(line),
                color=color,
                marker=marker,
                capsize=3,
                label=m,
            )
        ax.set_xscale("log")
        ax.set_ylim(-3, 103)
        ax.set_title(f"{pairs} pairs, {3 * pairs} tokens")
        ax.set_xlabel("state per sequence (floats, 2 layers)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"MQAR recall against state (d_model {', '.join(map(str, widths))}; mean ± 95 % CI, 3 seeds)")
    fig.tight_layout()
    fig.savefig(HERE / "frontier.png", dpi=110)

    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 4.2), sharey=True)
    for ax, d in zip(axes, widths, strict=True):
        for m in models:
            line = [(p, pts[(m, p, d)]) for p in rungs if (m, p, d) in pts]
            color, marker = STYLE[m]
            ax.errorbar(
                [p for p, _ in line],
                [v[1] for _, v in line],
                yerr=clipped([v for _, v in line]),
                color=color,
                marker=marker,
                capsize=3,
                label=m,
            )
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_xticks(rungs, [str(p) for p in rungs])
        ax.set_title(f"d_model {d}")
        ax.set_xlabel("key-value pairs (sequence length 3 × pairs)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(HERE / "pairs.png", dpi=110)
    print(f"wrote {HERE / 'frontier.png'} and {HERE / 'pairs.png'}")


if __name__ == "__main__":
    main()
