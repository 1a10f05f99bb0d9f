"""The pruning study's summary.csv, curves.csv and figure.png from its run folders' pruning.json.

    python experiments/pruning/analyze.py outputs/pruning experiments/pruning

summary.csv, one row per run: variant, seed, status, the unpruned test metric (``metric_0``), the mean of the metric
over each order's curve (``auc_importance``, ``auc_random``: the random orders averaged first), the fraction of heads
that each order removes before the metric is worse than the unpruned one by more than :data:`TOLERANCE`
(``removable_importance``, ``removable_random``: the largest k / N such that every point up to k is within it), and
the metric with half of the heads removed (``half_importance``, ``half_random``). curves.csv: the mean curve of each
variant and order over its seeds (fraction removed, metric). figure.png: those curves, with every run's thin.
Printed: per variant, the paired difference auc_random − auc_importance over the seeds (positive: the importance
order keeps more of the model), its 95 % t interval and p, and Holm's adjustment over the variants.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from attnlab.dashboard import load_runs
from attnlab.stats import holm, paired_difference

TOLERANCE = {"bpc": 0.05, "acc": 0.01}
"""How much worse than unpruned still counts as "little loss": 0.05 bits per byte (about 2.5 % of the models'
2.0), or 1 point of accuracy."""
COLUMNS = [
    "run",
    "variant",
    "seed",
    "status",
    "heads",
    "metric",
    "metric_0",
    "auc_importance",
    "auc_random",
    "removable_importance",
    "removable_random",
    "half_importance",
    "half_random",
]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def removable(curve: list[float], higher_is_better: bool, tolerance: float) -> float:
    """The largest fraction k / N of heads removed with every point up to k within ``tolerance`` of point 0."""
    worse = [(curve[0] - v) if higher_is_better else (v - curve[0]) for v in curve]
    k = 0
    while k + 1 < len(curve) and worse[k + 1] <= tolerance:
        k += 1
    return k / (len(curve) - 1)


def summarize(root: Path) -> tuple[list[dict[str, object]], dict[tuple[str, str], list[list[float]]]]:
    rows, curves = [], {}
    for run in load_runs(root):
        pruning = run.pruning
        if pruning is None:
            continue
        metric, higher = pruning["metric"], pruning["higher_is_better"]
        heads = pruning["num_layers"] * pruning["num_heads"]
        importance = pruning["curves"]["importance"][0]
        if "random" not in pruning["curves"]:  # (diagnostics.random_orders=0: nothing to compare with)
            continue
        random = [_mean(list(col)) for col in zip(*pruning["curves"]["random"], strict=True)]
        for order, curve in (("importance", importance), ("random", random)):
            curves.setdefault((run.variant, order), []).append(curve)
        rows.append(
            {
                "run": run.name,
                "variant": run.variant,
                "seed": run.seed,
                "status": run.status,
                "heads": heads,
                "metric": f"test/{metric}",
                "metric_0": importance[0],
                "auc_importance": _mean(importance),
                "auc_random": _mean(random),
                "removable_importance": removable(importance, higher, TOLERANCE[metric]),
                "removable_random": removable(random, higher, TOLERANCE[metric]),
                "half_importance": importance[heads // 2],
                "half_random": random[heads // 2],
            }
        )
    return rows, curves


def _text(value: object) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write(rows: list[dict[str, object]], curves: dict[tuple[str, str], list[list[float]]], out: Path) -> None:
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for row in sorted(rows, key=lambda r: (r["variant"], r["seed"])):
            writer.writerow([_text(row[c]) for c in COLUMNS])
    with (out / "curves.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["variant", "order", "removed_fraction", "metric", "seeds"])
        for (variant, order), listed in sorted(curves.items()):
            n = len(listed[0]) - 1
            for k, col in enumerate(zip(*listed, strict=True)):
                writer.writerow([variant, order, f"{k / n:.6g}", f"{_mean(list(col)):.6g}", len(listed)])


def plot(rows: list[dict[str, object]], curves: dict[tuple[str, str], list[list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = sorted({v for v, _ in curves}, key=lambda v: (v != "scaled_dot", v))
    metric = str(rows[0]["metric"]) if rows else "test/bpc"
    fig, axes = plt.subplots(1, len(variants), figsize=(4.4 * len(variants), 3.6), squeeze=False, sharey=True)
    for ax, variant in zip(axes[0], variants, strict=True):
        for order, style in (("importance", "-"), ("random", ":")):
            listed = curves.get((variant, order), [])
            if not listed:
                continue
            n = len(listed[0]) - 1
            xs = [k / n for k in range(n + 1)]
            for curve in listed:
                ax.plot(xs, curve, style, color="#999999", lw=0.7)
            ax.plot(xs, [_mean(list(c)) for c in zip(*listed, strict=True)], style, color="#d62728", lw=2,
                    label=f"{order} order (mean of {len(listed)} seeds)")  # fmt: skip
        ax.set_title(variant, fontsize=10)
        ax.set_xlabel("fraction of the heads removed")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{metric} ({'higher' if metric.endswith('acc') else 'lower'} is better)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Pruning heads at test time: by importance (solid) and in random order (dotted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(rows: list[dict[str, object]]) -> None:
    """The paired difference auc_random − auc_importance per variant (lower bits per byte is better: a positive
    difference means the importance order keeps more; for accuracy the sign is turned), with Holm over variants."""
    variants = sorted({str(r["variant"]) for r in rows})
    found = []
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant and r["status"] == "ok"]
        lower = str(mine[0]["metric"]).endswith("bpc")
        sign = 1.0 if lower else -1.0
        a = {r["seed"]: sign * float(r["auc_random"]) for r in mine}
        b = {r["seed"]: sign * float(r["auc_importance"]) for r in mine}
        found.append((variant, paired_difference(a, b)))
    adjusted = holm([d.p if d.p is not None else 1.0 for _, d in found])
    for (variant, d), p_holm in zip(found, adjusted, strict=True):
        half = "-" if d.half_width is None else f"{d.half_width:.4f}"
        p = "-" if d.p is None else f"{d.p:.2g}"
        print(f"{variant}: random − importance {d.mean:+.4f} ± {half} (n={d.n}, p={p}, Holm p={p_holm:.2g})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the study's run folders (outputs/pruning)")
    parser.add_argument("out", type=Path, help="where summary.csv, curves.csv and figure.png go")
    args = parser.parse_args(argv)
    rows, curves = summarize(args.runs)
    if not rows:
        raise SystemExit(f"no run under {args.runs} wrote pruning.json")
    write(rows, curves, args.out)
    plot(rows, curves, args.out / "figure.png")
    report(rows)
    print(f"wrote {args.out / 'summary.csv'} ({len(rows)} runs), curves.csv and figure.png")


if __name__ == "__main__":
    main()
