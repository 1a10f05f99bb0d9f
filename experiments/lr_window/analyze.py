"""The learning-rate-window study's tables, paired differences and figure, from its summary.csv:

    python experiments/lr_window/analyze.py     # Markdown to stdout, figure.png beside this file

Every model ran at every learning rate of the grid on seeds 0–3 (a plain sweep, one per model, named by its
variant). Seed 0 is the tuning seed: it chooses each model's best learning rate (the best ``val/acc_best``, ties to
the smaller rate), as ``hydra/sweeper=tuned`` does; seeds 1–3, never used to choose, give the curves, their
intervals and every comparison. Two statistics:

* **at the best learning rate**: test accuracy over seeds 1–3, softmax − each model paired by seed;
* **the window**: for each seed, the number of grid points at which a model solves the task (test accuracy ≥
  ``SOLVED``); softmax − each model paired by seed. The grid's points are about 2.3× apart (log-spaced, 1-2-5), so
  a window of w points spans a factor of roughly 2.3^(w−1) in learning rate.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import tuned_study as ts  # noqa: E402

MODELS = ["scaled_dot", "linear", "gla", "gated_deltanet", "kda"]
LABEL = {
    "scaled_dot": "softmax",
    "linear": "linear (elu)",
    "gla": "GLA",
    "gated_deltanet": "Gated DeltaNet",
    "kda": "KDA",
}
TUNE_SEED = 0
SOLVED = 0.9  # test accuracy at which MQAR counts as solved (chance is 1/32)
CHANCE = 1 / 32

Table = dict[str, dict[float, dict[int, dict[str, float]]]]  # model -> lr -> seed -> metric -> value


def load(path: Path) -> Table:
    """{model: {lr: {seed: {metric: value}}}} of the runs (:func:`tuned_study.load`; a failed run's metrics are
    NaN), the model being the sweep (the variant)."""
    out: Table = defaultdict(lambda: defaultdict(dict))
    for row in ts.load(path, lambda r: r["sweep"], lambda r: "mqar"):
        out[row["model"]][row["lr"]][row["seed"]] = {k: ts.number(row, k) for k in ("test/acc", "val/acc_best")}
    return out


def lrs(table: Table) -> list[float]:
    return sorted({lr for by_lr in table.values() for lr in by_lr})


def curve(table: Table, model: str, lr: float) -> dict[int, float]:
    """{seed: test accuracy} of the comparison seeds (not the tuning seed) at one learning rate."""
    runs = table[model].get(lr, {})
    return {s: m["test/acc"] for s, m in runs.items() if s != TUNE_SEED and math.isfinite(m["test/acc"])}


def best_lr(table: Table, model: str) -> float | None:
    """The learning rate with the best val/acc_best on the tuning seed (ties: the smaller rate)."""
    scored = [(m[TUNE_SEED]["val/acc_best"], -lr, lr) for lr, m in table[model].items() if TUNE_SEED in m]
    scored = [s for s in scored if math.isfinite(s[0])]
    return max(scored)[2] if scored else None


def window(table: Table, model: str) -> dict[int, float]:
    """{seed: the number of grid points at which the model solves the task}, over the comparison seeds."""
    seeds = {s for lr in table[model] for s in curve(table, model, lr)}
    return {s: float(sum(curve(table, model, lr).get(s, 0.0) >= SOLVED for lr in lrs(table))) for s in seeds}


def tables(table: Table) -> str:
    grid = lrs(table)
    body = []
    for m in MODELS:
        cells = []
        for lr in grid:
            mean, half, n = ts.mean_ci(list(curve(table, m, lr).values()))
            cells.append("—" if n == 0 else f"{100 * mean:.0f}" + ("" if half is None else f" ± {100 * half:.0f}"))
        body.append([LABEL[m], *cells])
    out = ["Test accuracy (%) at each learning rate, mean ± 95 % t-interval over seeds 1–3\n"]
    out.append(ts.markdown(["model", *[f"{lr:g}" for lr in grid]], body))
    out.append("")
    body = []
    for m in MODELS:
        lr = best_lr(table, m)
        mean, half, n = ts.mean_ci(list(curve(table, m, lr).values())) if lr is not None else (math.nan, None, 0)
        w = window(table, m)
        wm, wh, wn = ts.mean_ci(list(w.values()))
        solved = [f"{g:g}" for g in grid if ts.mean_ci(list(curve(table, m, g).values()))[0] >= SOLVED]
        body.append(
            [
                LABEL[m],
                f"{lr:g}" if lr is not None else "—",
                "—" if n == 0 else f"{100 * mean:.1f}" + ("" if half is None else f" ± {100 * half:.1f}"),
                "—" if wn == 0 else f"{wm:.1f}" + ("" if wh is None else f" ± {wh:.1f}"),
                ", ".join(solved) or "none",
            ]
        )
    header = ["model", "best lr (seed 0)", "test acc % there", f"window (points ≥ {SOLVED:.0%})", "solved on mean"]
    out.append(ts.markdown(header, body))
    return "\n".join(out)


def comparisons(table: Table) -> str:
    family = []
    soft_lr = best_lr(table, "scaled_dot")
    for m in MODELS[1:]:
        lr = best_lr(table, m)
        if soft_lr is not None and lr is not None:
            d = ts.paired_difference(curve(table, "scaled_dot", soft_lr), curve(table, m, lr))
            family.append((f"test acc at the best lr: softmax − {LABEL[m]}", d, 100.0, " points"))
    for m in MODELS[1:]:
        d = ts.paired_difference(window(table, "scaled_dot"), window(table, m))
        family.append((f"window: softmax − {LABEL[m]}", d, 1.0, " grid points"))
    adjusted = ts.holm_table([(what, d) for what, d, *_ in family])
    body = [
        [what, ts.difference_text(d, scale, 1) + unit, "—" if p is None else f"{p:.2g}"]
        for (what, d, scale, unit), (_, _, p) in zip(family, adjusted, strict=True)
    ]
    return f"Paired by seed (1–3), Holm over the {len(family)}\n\n" + ts.markdown(
        ["difference", "mean ± 95 % (p)", "Holm p"], body
    )


def figure(table: Table, path: Path) -> None:
    grid = lrs(table)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for j, m in enumerate(MODELS):
        means, lows, highs = [], [], []
        for lr in grid:
            mean, half, _ = ts.mean_ci(list(curve(table, m, lr).values()))
            half = half or 0.0
            means.append(100 * mean)
            lows.append(100 * max(mean - half, 0.0))
            highs.append(100 * min(mean + half, 1.0))
        ax.plot(grid, means, marker="os^Dv"[j], color=f"C{j}", label=LABEL[m])
        ax.fill_between(grid, lows, highs, color=f"C{j}", alpha=0.15, linewidth=0)
        lr = best_lr(table, m)
        if lr is not None:
            ax.plot(
                [lr],
                [100 * ts.mean_ci(list(curve(table, m, lr).values()))[0]],
                marker="*",
                markersize=14,
                color=f"C{j}",
                markeredgecolor="black",
                linestyle="none",
            )
    ax.axhline(100 * SOLVED, color="black", linestyle=":", linewidth=1, label=f"solved ({SOLVED:.0%})")
    ax.axhline(100 * CHANCE, color="grey", linestyle="--", linewidth=0.8, label="chance")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("test accuracy (%), seeds 1–3")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left")
    ax.set_title("MQAR (8 pairs): accuracy against learning rate; ★ = the lr seed 0 chose")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def longer(path: Path) -> str:
    """The further checks of longer.sh (one seed each), from longer.csv."""
    body = []
    for row in ts.load(path, lambda r: r["variant"], lambda r: r["sweep"]):
        conv = row.get("model.short_conv", "4")  # the column is empty for null (the run had none)
        acc = ts.number(row, "test/acc")
        body.append(
            [
                row["sweep"],
                LABEL.get(row["model"], row["model"]),
                conv or "none",
                f"{row['lr']:g}",
                row.get("max_steps") or "300",
                f"{100 * acc:.1f}" if math.isfinite(acc) else row.get("status", "—"),
            ]
        )
    header = ["check", "model", "short conv", "lr", "steps", "test acc %"]
    return "Further checks (longer.sh), seed 1\n\n" + ts.markdown(header, body)


def main() -> None:
    table = load(HERE / "summary.csv")
    ts.report(HERE, [tables(table), comparisons(table)], lambda path: figure(table, path), longer)


if __name__ == "__main__":
    main()
