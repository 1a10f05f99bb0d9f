"""The state-tracking study's tables, paired differences and figure, from its summary.csv:

    python experiments/state_tracking/analyze.py     # Markdown to stdout, figure.png beside this file

Models are named by their sweep (``counting_<model>``, ``s3_<variant>``; ``s3_product`` by its number of
Householder steps); only the seed stage (seeds 1–3, each model at the learning rate its grid chose) is compared.
Accuracy at L = 32 is the test split (every position of 32-token sequences, the training length); at 64 and 128 only
the positions beyond 32 are scored (``length_labels=beyond``), so chance there is 1/|G| exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import tuned_study as ts  # noqa: E402

COUNTING = [
    "softmax",
    "softmax_nope",
    "linear",
    "gla",
    "deltanet",
    "deltanet_neg",
    "gated_deltanet",
    "gated_deltanet_neg",
    "deltaproduct",
    "rwkv7",
    "kda",
]
S3 = ["deltanet_neg", "gated_deltanet_neg", "deltaproduct_n2", "deltaproduct_n3"]
LABEL = {
    "softmax": "softmax (sinusoidal)",
    "softmax_nope": "softmax (no positions)",
    "linear": "linear (elu)",
    "gla": "GLA",
    "deltanet": "DeltaNet β∈(0,1)",
    "deltanet_neg": "DeltaNet β∈(0,2)",
    "gated_deltanet": "Gated DeltaNet β∈(0,1)",
    "gated_deltanet_neg": "Gated DeltaNet β∈(0,2)",
    "deltaproduct": "DeltaProduct n_h=2, β∈(0,2)",
    "deltaproduct_n2": "DeltaProduct n_h=2, β∈(0,2)",
    "deltaproduct_n3": "DeltaProduct n_h=3, β∈(0,2)",
    "rwkv7": "RWKV-7",
    "kda": "KDA β∈(0,1)",
}
TASKS = {"parity": ("parity", 2), "modular": ("mod 3", 3), "S3": ("S3, one layer", 6)}
METRICS = [("test/acc", "L 32"), ("test/acc@64", "L 64"), ("test/acc@128", "L 128")]


def model_of(row: ts.Row) -> str:
    sweep = row["sweep"]
    if sweep.startswith("counting_"):
        return sweep.removeprefix("counting_")
    if sweep in ("s3_deltanet", "s3_gated_deltanet"):
        return f"{sweep.removeprefix('s3_')}_neg"
    if sweep == "s3_product":
        return f"deltaproduct_n{row['params'].get('householder_steps')}"
    return sweep


def task_of(row: ts.Row) -> str:
    return "S3" if row["task"] == "permutation" else row["task"]


def tables(rows: list[ts.Row]) -> str:
    out = []
    for task, models in (("parity", COUNTING), ("modular", COUNTING), ("S3", S3)):
        body = [
            [LABEL[m], f"{ts.chosen_lr(rows, m, task) or '—'}", *(ts.cell(rows, m, task, k) for k, _ in METRICS)]
            for m in models
        ]
        out.append(f"**{TASKS[task][0]}** (test accuracy %, mean ± 95 % t-interval over seeds 1–3)\n")
        out.append(ts.markdown(["model", "lr", *(name for _, name in METRICS)], body))
        out.append("")
    return "\n".join(out)


def comparisons(rows: list[ts.Row]) -> str:
    pairs = [
        ("deltanet_neg", "deltanet", "parity"),
        ("gated_deltanet_neg", "gated_deltanet", "parity"),
        ("deltanet_neg", "deltanet", "modular"),
        ("gated_deltanet_neg", "gated_deltanet", "modular"),
        ("deltaproduct_n2", "gated_deltanet_neg", "S3"),
        ("deltaproduct_n3", "gated_deltanet_neg", "S3"),
        ("deltaproduct_n2", "deltanet_neg", "S3"),
    ]
    out = []
    for metric, name in (("test/acc", "L 32"), ("test/acc@128", "L 128")):
        family = [
            (f"{LABEL[a]} − {LABEL[b]}, {TASKS[t][0]}", ts.difference(rows, a, b, t, metric)) for a, b, t in pairs
        ]
        body = [[what, ts.difference_text(d), "—" if p is None else f"{p:.2g}"] for what, d, p in ts.holm_table(family)]
        out.append(f"**Paired differences at {name}** (points; same seed, same data; Holm over the {len(pairs)})\n")
        out.append(ts.markdown(["difference", "mean ± 95 % (p)", "Holm p"], body))
        out.append("")
    # length generalisation inside each softmax run: accuracy at 32 minus beyond-32 at 128 (same run, same seed)
    for model in ("softmax", "softmax_nope"):
        for task in ("parity", "modular"):
            short = ts.values(rows, model, task, "test/acc")
            long = ts.values(rows, model, task, "test/acc@128")
            d = ts.difference_text(ts.paired_difference(short, long))
            out.append(f"- {LABEL[model]}, {TASKS[task][0]}: L 32 − L 128 = {d} points")
    return "\n".join(out)


def figure(rows: list[ts.Row], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [11, 11, 4]}, sharey=True)
    for ax, (task, models) in zip(axes, (("parity", COUNTING), ("modular", COUNTING), ("S3", S3)), strict=True):
        title, order = TASKS[task]
        for j, (metric, name) in enumerate(METRICS):
            style = dict(fmt="os^"[j], color=f"C{j}", capsize=2, label=name)
            ts.draw_models(ax, rows, models, task, metric, (j - 1) * 0.22, **style)
        ax.axhline(100 / order, color="grey", linestyle="--", linewidth=0.8, label="chance beyond 32 (1/|G|)")
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([LABEL[m] for m in models], rotation=60, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylim(-2, 102)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("State tracking: trained on 32 tokens; at 64 and 128 only the positions beyond 32 are scored")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    rows = ts.load(HERE / "summary.csv", model_of, task_of)
    ts.report(HERE, [tables(rows), comparisons(rows)], lambda path: figure(rows, path))


if __name__ == "__main__":
    main()
