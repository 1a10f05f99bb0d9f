"""The gated-output study's tables, paired differences and figure, from its summary.csv:

    python experiments/gated_output/analyze.py     # Markdown to stdout, figure.png beside this file

Models are named by their sweep (``softmax``, ``gated_deltanet``); the gate (``attention.output_gate``: none,
headwise, elementwise) is the "task" axis of :mod:`tuned_study`, so each gate is its own configuration with its own
tuned learning rate. Only the seed stage (seeds 1–3) is compared, each gate against none of the same model, paired by
seed. Three claims (Qiu et al. 2025): the gate lowers the weight on the first token (``attn/first_mass``, softmax
only: a recurrent form has no attention row to put weight on a token), lowers the largest residual activation
(``attn/act_max``) and does not hurt bits per byte (``test/bpc``: "does not hurt" = the 95 % interval of
gate − none lies below the margin ``BPC_MARGIN``).
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

MODELS = ["softmax", "gated_deltanet"]
LABEL = {"softmax": "softmax", "gated_deltanet": "Gated DeltaNet"}
GATES = ["none", "headwise", "elementwise"]
SEQ_LEN = 128  # the LM's window
# the first key's weight in a uniform causal row, averaged as attn/first_mass is (rows 1 .. L-1; row 0 sees only it)
UNIFORM_FIRST = sum(1 / (i + 1) for i in range(1, SEQ_LEN)) / (SEQ_LEN - 1)
BPC_MARGIN = 0.02  # bits per byte: a gate "does not hurt" when gate − none stays below this at the interval's top
METRICS = {  # name: (column, scale, digits, unit)
    "bits per byte": ("test/bpc", 1.0, 3, ""),
    "first-token weight": ("attn/first_mass", 100.0, 1, " %"),
    "largest activation": ("attn/act_max", 1.0, 1, ""),
}


def model_of(row: ts.Row) -> str:
    return row["sweep"]


def task_of(row: ts.Row) -> str:
    gate = (row.get("attention.output_gate") or "").strip()
    return "none" if gate in ("", "null", "None") else gate


def tables(rows: list[ts.Row]) -> str:
    body = []
    for m in MODELS:
        for g in GATES:
            cells = [
                "—" if col == "attn/first_mass" and m != "softmax" else ts.cell(rows, m, g, col, scale, digits)
                for col, scale, digits, _ in METRICS.values()
            ]
            body.append([LABEL[m], g, f"{ts.chosen_lr(rows, m, g) or '—'}", *cells])
    header = ["model", "gate", "lr", "test bits/byte", "first-token weight %", "largest abs. activation"]
    return "Mean ± 95 % t-interval over seeds 1–3 (each configuration at its tuned lr)\n\n" + ts.markdown(header, body)


def comparisons(rows: list[ts.Row]) -> str:
    family = []
    for name, (col, scale, digits, unit) in METRICS.items():
        for m in MODELS:
            if col == "attn/first_mass" and m != "softmax":
                continue
            for g in GATES[1:]:
                d = ts.paired_difference(ts.values(rows, m, g, col), ts.values(rows, m, "none", col))
                family.append((f"{name}: {LABEL[m]} {g} − none", d, scale, digits, unit))
    adjusted = ts.holm_table([(what, d) for what, d, *_ in family])
    body = []
    for (what, d, scale, digits, unit), (_, _, p) in zip(family, adjusted, strict=True):
        top = None if d.half_width is None else d.mean + d.half_width
        extra = ""
        if what.startswith("bits per byte") and top is not None:
            extra = f"upper bound {top:+.3f}: " + ("within" if top < BPC_MARGIN else "beyond") + f" +{BPC_MARGIN}"
        text = ts.difference_text(d, scale, digits) + (" points" if scale == 100.0 else unit)
        body.append([what, text, "—" if p is None else f"{p:.2g}", extra])
    header = ["difference (paired by seed)", "mean ± 95 % (p)", "Holm p", "non-inferiority"]
    return f"Gate − none (Holm over the {len(family)})\n\n" + ts.markdown(header, body)


def figure(rows: list[ts.Row], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, (name, (col, scale, _, unit)) in zip(axes, METRICS.items(), strict=True):
        for j, m in enumerate(MODELS):
            if col == "attn/first_mass" and m != "softmax":
                continue
            xs, ys, errs = [], [], []
            for i, g in enumerate(GATES):
                mean, half = ts.mean_and_half(rows, m, g, col)
                xs.append(i + (j - 0.5) * 0.2)
                ys.append(mean * scale)
                errs.append(half * scale)
            ax.errorbar(xs, ys, yerr=errs, fmt="os"[j], color=f"C{j}", capsize=3, label=LABEL[m])
        ax.set_xticks(range(len(GATES)))
        ax.set_xticklabels(GATES)
        ax.set_title(name + (f" ({unit.strip()})" if unit else ""))
        ax.grid(axis="y", alpha=0.3)
        if col == "attn/first_mass":
            ax.axhline(100 * UNIFORM_FIRST, color="grey", linestyle="--", linewidth=0.8, label="a uniform row")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle("Gated output on the byte-level LM: 2 layers, d_model 64, each configuration at its tuned lr")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def longer(path: Path) -> str:
    """The larger-budget checks of longer.sh (softmax, seed 1), from longer.csv."""
    body = [
        [
            row["sweep"],
            row["task"],
            f"{row['lr']:g}",
            row.get("max_steps") or "1000",
            f"{ts.number(row, 'test/bpc'):.3f}",
            f"{100 * ts.number(row, 'attn/first_mass'):.1f}",
            f"{ts.number(row, 'attn/act_max'):.1f}",
        ]
        for row in ts.load(path, model_of, task_of)
    ]
    header = ["check", "gate", "lr", "steps", "test bits/byte", "first-token weight %", "largest abs. activation"]
    return "Larger-budget checks (longer.sh), softmax, seed 1\n\n" + ts.markdown(header, body)


def main() -> None:
    rows = ts.load(HERE / "summary.csv", model_of, task_of)
    ts.report(HERE, [tables(rows), comparisons(rows)], lambda path: figure(rows, path), longer)


if __name__ == "__main__":
    main()
