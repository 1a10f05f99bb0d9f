"""The MQAR results table: one row per run folder under the given roots, with the variant's label, the difficulty
(pairs, length), the test accuracy, when val/acc left chance (``train/plateau_steps``) and reached 99 %
(``train/steps_to_99``; "—" = never), and the wall time. Also writes the rows as CSV with ``--csv``.

    python experiments/mqar/summarize.py outputs/mqar_ladder --csv experiments/mqar/ladder.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from attnlab.runs import find_runs, load_run

COLUMNS = ("label", "num_pairs", "seq_len", "seed", "test_acc", "plateau_steps", "steps_to_99", "wall_time_s")


def label(config: dict, summary: dict) -> str:
    """The variant as the ladder names it: the score preset plus any attention stage that is not the default."""
    parts = [str(summary.get("variant"))]
    settings = summary.get("settings") or {}  # layer 1's attention config (schema 3; older summaries read into it)
    feature_map = (settings.get("score_params") or {}).get("feature_map")
    if settings.get("score") == "linear":
        parts = [f"linear({feature_map or 'elu'})"]
    if summary.get("pos_encoding") not in (None, "sinusoidal"):
        parts.append(f"pos={summary['pos_encoding']}")
    if settings.get("differential"):
        parts.append("differential")
    if settings.get("normalizer") not in (None, "softmax", "rowsum" if settings.get("score") == "linear" else None):
        parts.append(f"normalizer={settings['normalizer']}")
    if settings.get("short_conv"):
        parts.append(f"short_conv={settings['short_conv']}")
    if settings.get("qk_norm"):
        parts.append(f"qk_norm={settings['qk_norm']}")
    if settings.get("position_bias") not in (None, "none") and summary.get("variant") not in ("alibi", "t5_bias"):
        parts.append(f"position_bias={settings['position_bias']}")
    if config.get("mask", {}).get("name") not in (None, "causal"):
        parts.append(f"mask={config['mask']['name']}")
    return " ".join(parts)


def rows(roots: list[str]) -> list[dict]:
    out = []
    for root in roots:
        for folder in find_runs(root):
            run = load_run(folder)
            s = run.summary or {}
            if s.get("status") != "ok":
                continue
            m, data = s.get("metrics") or {}, run.config.get("task", {}).get("datamodule", {})
            out.append(
                {
                    "label": label(run.config, s),
                    "num_pairs": data.get("num_pairs"),
                    "seq_len": data.get("seq_len"),
                    "seed": s.get("seed"),
                    "test_acc": m.get("test/acc"),
                    "plateau_steps": m.get("train/plateau_steps"),
                    "steps_to_99": m.get("train/steps_to_99"),
                    "wall_time_s": s.get("wall_time_s"),
                }
            )
    return sorted(out, key=lambda r: (r["num_pairs"] or 0, r["label"], r["seed"] or 0))


def markdown(table: list[dict]) -> str:
    def cell(row: dict, key: str) -> str:
        value = row[key]
        if value is None:
            return "—"
        if key == "test_acc":
            return f"{100 * value:.1f} %"
        if key == "wall_time_s":
            return f"{value:.0f} s"
        return f"{value:g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row, k) for k in COLUMNS) + " |" for row in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="run or sweep folders")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    table = rows(args.roots)
    if not table:
        print(f"error: no finished runs under {', '.join(args.roots)}", file=sys.stderr)
        return 1
    print(markdown(table))
    if args.csv:
        with Path(args.csv).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
