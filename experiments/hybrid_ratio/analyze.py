"""The hybrid-ratio study's tables, paired differences and figure, from its summary.csv:

    python experiments/hybrid_ratio/analyze.py     # Markdown to stdout, figure.png beside this file

A model is a linear form and a layer pattern (``gated_deltanet:GGGS``: three Gated DeltaNet layers, then a softmax
layer, over the 4 layers); the task is the sweep's prefix (``mqar``, ``comp``: compositional MQAR). Only the seed stage
(seeds 1–3, each model at the learning rate its grid chose) is compared. Two claims (Wang et al. 2025):

* **the ratio**: recall rises sharply once the linear:softmax ratio falls to about 3:1; the paired differences are
  between neighbouring ratios (none → 3:1 → 1:1 → all softmax; the 7:1 rung needs 8 layers: longer.sh);
* **the ranking**: a form's standalone recall (all 4 layers linear) does not predict how good a hybrid partner it is
  (the 3:1 hybrid): GLA, Gated DeltaNet and KDA ranked both ways on MQAR.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import tuned_study as ts  # noqa: E402

PATTERNS = ["G", "GGGS", "GS", "S"]  # no softmax layer ... every layer softmax
TASKS = {"mqar": "MQAR, 12 pairs", "comp": "compositional MQAR, 4 × 3 keys"}
CHANCE = {"mqar": 1 / 12, "comp": 1 / 12}
FORMS = ["gla", "gated_deltanet", "kda"]
LABEL = {"gla": "GLA", "gated_deltanet": "Gated DeltaNet", "kda": "KDA"}


def ratio(pattern: str) -> str:
    """How often a layer pattern (repeated over the layers) is softmax: ``GGGS`` → ``1 in 4 (3:1)``."""
    softmax = pattern.count("S")
    if softmax == 0:
        return "none (GDN only)"
    if softmax == len(pattern):
        return "all"
    every = len(pattern) // softmax
    return f"1 in {every} ({every - 1}:1)"


def model_of(row: ts.Row) -> str:
    return f"{row['variant']}:{row['model.pattern']}"


def task_of(row: ts.Row) -> str:
    return row["sweep"].split("_", 1)[0]


def ratio_tables(rows: list[ts.Row]) -> str:
    body = []
    for p in PATTERNS:
        m = f"gated_deltanet:{p}"
        cells = []
        for task in TASKS:
            params = sorted({r["param_count"] for r in rows if r["model"] == m and r["task"] == task})
            cells += ["/".join(params), f"{ts.chosen_lr(rows, m, task) or '—'}", ts.cell(rows, m, task, "test/acc")]
        body.append([ratio(p), p, *cells])
    header = [
        "softmax layers",
        "pattern",
        "params (MQAR)",
        "lr (MQAR)",
        "test acc % (MQAR)",
        "params (comp.)",
        "lr (comp.)",
        "test acc % (comp.)",
    ]
    out = ["Gated DeltaNet hybrids, 4 layers: test accuracy (%), mean ± 95 % t-interval over seeds 1–3\n"]
    out.append(ts.markdown(header, body))
    for task, name in TASKS.items():
        family = [
            (
                f"{ratio(b)} − {ratio(a)}",
                ts.difference(rows, f"gated_deltanet:{b}", f"gated_deltanet:{a}", task, "test/acc"),
            )
            for a, b in itertools.pairwise(PATTERNS)
        ]
        body = [[w, ts.difference_text(d), "—" if p is None else f"{p:.2g}"] for w, d, p in ts.holm_table(family)]
        out += ["", f"**{name}**: neighbouring ratios, paired by seed (points; Holm over the {len(family)})\n"]
        out.append(ts.markdown(["difference", "mean ± 95 % (p)", "Holm p"], body))
    return "\n".join(out)


def per_seed(rows: list[ts.Row]) -> str:
    """Each seed's test accuracy: at this budget a run's accuracy depends strongly on whether and when its seed leaves
    the plateau, which a mean and a 3-seed interval summarise poorly."""
    body = []
    models = [f"gated_deltanet:{p}" for p in PATTERNS] + [f"{f}:{p}" for f in ("gla", "kda") for p in ("G", "GGGS")]
    for task, name in TASKS.items():
        for m in models:
            got = ts.values(rows, m, task, "test/acc")
            if got:
                form, pattern = m.split(":")
                accs = [f"{100 * got[s]:.1f}" if s in got else "—" for s in (1, 2, 3)]
                body.append([name, LABEL[form], pattern, *accs])
    header = ["task", "form", "pattern", "seed 1", "seed 2", "seed 3"]
    return "Test accuracy (%) of each seed\n\n" + ts.markdown(header, body)


def ranking(rows: list[ts.Row]) -> str:
    body = []
    for f in FORMS:
        body.append(
            [LABEL[f]]
            + [
                x
                for p in ("G", "GGGS")
                for x in (
                    f"{ts.chosen_lr(rows, f'{f}:{p}', 'mqar') or '—'}",
                    ts.cell(rows, f"{f}:{p}", "mqar", "test/acc"),
                )
            ]
        )
    header = ["form", "lr (alone)", "test acc % (alone, 4 linear layers)", "lr (3:1)", "test acc % (3:1 hybrid)"]
    out = ["Standalone against hybrid partner, MQAR: test accuracy (%), mean ± 95 % over seeds 1–3\n"]
    out.append(ts.markdown(header, body))
    for p, name in (("G", "alone"), ("GGGS", "in the 3:1 hybrid")):
        means = {f: ts.mean_and_half(rows, f"{f}:{p}", "mqar", "test/acc")[0] for f in FORMS}
        order = sorted(FORMS, key=lambda f: -means[f])
        out.append(f"\nRanking {name}: " + " > ".join(f"{LABEL[f]} ({100 * means[f]:.1f})" for f in order))
    family = []
    for p, name in (("G", "alone"), ("GGGS", "3:1")):
        for a, b in (("gated_deltanet", "gla"), ("kda", "gla"), ("kda", "gated_deltanet")):
            family.append(
                (f"{name}: {LABEL[a]} − {LABEL[b]}", ts.difference(rows, f"{a}:{p}", f"{b}:{p}", "mqar", "test/acc"))
            )
    body = [[w, ts.difference_text(d), "—" if p is None else f"{p:.2g}"] for w, d, p in ts.holm_table(family)]
    out += ["", f"Between forms, paired by seed (points; Holm over the {len(family)})\n"]
    out.append(ts.markdown(["difference", "mean ± 95 % (p)", "Holm p"], body))
    return "\n".join(out)


def figure(rows: list[ts.Row], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for j, (task, name) in enumerate(TASKS.items()):
        xs, ys, lo, hi = [], [], [], []
        for i, p in enumerate(PATTERNS):
            mean, half = ts.mean_and_half(rows, f"gated_deltanet:{p}", task, "test/acc")
            xs.append(i + (j - 0.5) * 0.12)
            got = ts.values(rows, f"gated_deltanet:{p}", task, "test/acc").values()
            left.scatter([xs[-1] + 0.04] * len(got), [100 * v for v in got], s=12, color=f"C{j}", alpha=0.5)
            ys.append(100 * mean)
            lo.append(100 * min(half, max(mean, 0.0)))
            hi.append(100 * min(half, max(1 - mean, 0.0)))
        left.errorbar(xs, ys, yerr=[lo, hi], fmt="-" + "os"[j], color=f"C{j}", capsize=3, label=name)
        left.axhline(100 * CHANCE[task], color=f"C{j}", linestyle="--", linewidth=0.8)
    left.set_xticks(range(len(PATTERNS)))
    left.set_xticklabels([f"{ratio(p)}\n{p}" for p in PATTERNS], fontsize=8)
    left.set_xlabel("softmax layers among the 4 (the rest Gated DeltaNet)")
    left.set_ylabel("test accuracy (%)")
    left.set_ylim(-2, 102)
    left.grid(axis="y", alpha=0.3)
    left.legend(fontsize=8, loc="upper left")
    left.set_title("Hybrid ratio at matched parameters (dots: seeds; dashed: chance)")
    for k, (p, name) in enumerate((("G", "alone (4 linear layers)"), ("GGGS", "3:1 hybrid"))):
        ts.draw_models(
            right,
            rows,
            [f"{f}:{p}" for f in FORMS],
            "mqar",
            "test/acc",
            (k - 0.5) * 0.25,
            fmt="os"[k],
            color=f"C{k + 2}",
            capsize=3,
            label=name,
        )
    right.set_xticks(range(len(FORMS)))
    right.set_xticklabels([LABEL[f] for f in FORMS])
    right.set_ylim(-2, 102)
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=8)
    right.set_title("MQAR: standalone against hybrid partner")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def longer(path: Path) -> str:
    """The further checks of longer.sh (seed 1, one run each, Gated DeltaNet hybrids on MQAR), from longer.csv."""
    body = []
    for row in ts.load(path, model_of, lambda r: r["sweep"]):
        acc = ts.number(row, "test/acc")
        pattern = row["model.pattern"]
        body.append(
            [
                row["sweep"],
                row.get("num_layers") or "4",
                pattern,
                ratio(pattern),
                row["param_count"],
                f"{row['lr']:g}",
                row.get("max_steps") or "600",
                f"{100 * acc:.1f}" if math.isfinite(acc) else row.get("status", "—"),
            ]
        )
    header = ["check", "layers", "pattern", "softmax layers", "params", "lr", "steps", "test acc %"]
    return "Further checks (longer.sh), Gated DeltaNet hybrids on MQAR, seed 1\n\n" + ts.markdown(header, body)


def main() -> None:
    rows = ts.load(HERE / "summary.csv", model_of, task_of)
    ts.report(HERE, [ratio_tables(rows), ranking(rows), per_seed(rows)], lambda path: figure(rows, path), longer)


if __name__ == "__main__":
    main()
