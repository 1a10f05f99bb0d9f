"""The forgetting-recall study's tables, paired differences and figure, from its summary.csv:

    python experiments/forgetting_recall/analyze.py     # Markdown to stdout, figure.png beside this file

Models are named by their sweep (``recall_<model>``); the two rungs are ``writes_per_key`` 1 (plain MQAR: the
control, nothing to overwrite) and 3 (every key overwritten twice; the query wants the newest value). Only the seed
stage (seeds 1–3, each model at the learning rate its grid chose for that rung) is compared.
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

MODELS = ["softmax", "linear", "retnet", "gla", "deltanet", "gated_deltanet", "kda"]
LABEL = {
    "softmax": "softmax",
    "linear": "linear (elu)",
    "retnet": "RetNet",
    "gla": "GLA",
    "deltanet": "DeltaNet",
    "gated_deltanet": "Gated DeltaNet",
    "kda": "KDA",
}
DELTA = ["deltanet", "gated_deltanet", "kda"]
DECAY = ["linear", "retnet", "gla"]
RUNGS = {"w1": "1 write a key (MQAR)", "w3": "3 writes a key (forgetting)"}
CHANCE = {"w1": 1 / 8, "w3": 1 / 24}
STALE = 1 / 3


def model_of(row: ts.Row) -> str:
    return row["sweep"].removeprefix("recall_")


def task_of(row: ts.Row) -> str:
    return f"w{int(float(row['task.datamodule.writes_per_key']))}"


def tables(rows: list[ts.Row]) -> str:
    body = []
    for m in MODELS:
        state = {r["state_size"] for r in rows if r["model"] == m}
        cells = []
        for rung in RUNGS:
            cells += [f"{ts.chosen_lr(rows, m, rung) or '—'}", ts.cell(rows, m, rung, "test/acc")]
        body.append([LABEL[m], "/".join(sorted(state)), *cells])
    header = ["model", "state (floats)", "lr (w 1)", "test acc % (w 1)", "lr (w 3)", "test acc % (w 3)"]
    return "Test accuracy (%), mean ± 95 % t-interval over seeds 1–3\n\n" + ts.markdown(header, body)


def comparisons(rows: list[ts.Row]) -> str:
    out = []
    for rung in RUNGS:
        family = [
            (f"{LABEL[a]} − {LABEL[b]}", ts.difference(rows, a, b, rung, "test/acc")) for a in DELTA for b in DECAY
        ]
        family += [(f"softmax − {LABEL[b]}", ts.difference(rows, "softmax", b, rung, "test/acc")) for b in DELTA]
        body = [[what, ts.difference_text(d), "—" if p is None else f"{p:.2g}"] for what, d, p in ts.holm_table(family)]
        out.append(f"**{RUNGS[rung]}**: paired differences (points; Holm over the {len(family)})\n")
        out.append(ts.markdown(["difference", "mean ± 95 % (p)", "Holm p"], body))
        out.append("")
    # the cost of overwriting, within each model: accuracy at w 1 minus at w 3 (same seeds, different data)
    out.append("Cost of overwriting (w 1 − w 3, paired by seed):")
    for m in MODELS:
        d = ts.paired_difference(ts.values(rows, m, "w1", "test/acc"), ts.values(rows, m, "w3", "test/acc"))
        out.append(f"- {LABEL[m]}: {ts.difference_text(d)} points")
    return "\n".join(out)


def figure(rows: list[ts.Row], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for j, rung in enumerate(RUNGS):
        style = dict(fmt="os"[j], color=f"C{j}", capsize=3, label=RUNGS[rung])
        ts.draw_models(ax, rows, MODELS, rung, "test/acc", (j - 0.5) * 0.3, **style)
    ax.axhline(100 * STALE, color="C1", linestyle=":", linewidth=1, label="a key's values recalled, not the newest")
    ax.axhline(100 * CHANCE["w3"], color="grey", linestyle="--", linewidth=0.8, label="chance (3 writes)")
    ax.axvspan(0.5, 3.5, color="grey", alpha=0.08)
    ax.axvspan(3.5, 6.5, color="C2", alpha=0.08)
    ax.text(2, 3, "additive / decay", ha="center", fontsize=8)
    ax.text(5, 3, "delta rule", ha="center", fontsize=8)
    ax.set_xticks(range(len(MODELS)))
    ax.set_xticklabels([LABEL[m] for m in MODELS], rotation=30, ha="right")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 0.08))
    ax.set_title("Forgetting MQAR: 8 keys, 2 layers, d_model 32, each model at its tuned lr")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    rows = ts.load(HERE / "summary.csv", model_of, task_of)
    ts.report(HERE, [tables(rows), comparisons(rows)], lambda path: figure(rows, path))


if __name__ == "__main__":
    main()
