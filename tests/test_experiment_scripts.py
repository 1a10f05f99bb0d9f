"""The study helper scripts in experiments/ on small hand-made inputs (no training): study_csv.py (reading and
filtering a study's summary.csv), table.py (the markdown results table), plot.py (the figure, checked through the
data it draws) and curves.py (metrics over steps from run folders, joined to summary.csv by run name)."""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.util
import json
import math
import statistics
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from attnlab.dashboard import load_runs
from attnlab.dashboard import main as dashboard_main

REPO = Path(__file__).resolve().parents[1]
T975 = {1: 12.706204736, 2: 4.302652730}  # two-sided 95 % t quantiles by degrees of freedom
COLUMNS = ["run", "status", "variant", "variant_params", "d_k", "lr", "seed", "task", "reason", "test/acc",
           "test/acc@64", "test/acc@128", "attn/entropy_norm"]  # fmt: skip


def _script(name: str) -> ModuleType:
    """Import ``experiments/<name>.py`` the way the scripts import each other (experiments/ on the path)."""
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


study_csv = _script("study_csv")
table = _script("table")
plot = _script("plot")
curves = _script("curves")


def half_width(values: list[float]) -> float:
    """The 95 % t half-width of the mean, written out: t_{0.975, n-1} * s / sqrt(n)."""
    return T975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))


def row(run: str, status: str = "ok", **cells: Any) -> dict[str, str]:
    """A summary.csv row as csv.DictReader gives it: every column of COLUMNS, "" where not given
    (``test_acc`` stands for ``test/acc``, ``acc_64`` for ``test/acc@64``)."""
    names = {"test_acc": "test/acc", "acc_64": "test/acc@64", "acc_128": "test/acc@128", "entropy": "attn/entropy_norm"}
    out = dict.fromkeys(COLUMNS, "")
    out.update(run=run, status=status)
    for key, cell in cells.items():
        out[names.get(key, key)] = "" if cell is None else str(cell)
    return out


def write_csv(path: Path, rows: list[dict[str, str]]) -> Path:
    """Write ``rows`` (with the columns of the first) as a CSV."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------------------------------- study_csv


def test_value_reads_a_column_or_a_key_of_the_variant_params_json() -> None:
    r = row("a", variant="rel", variant_params=json.dumps({"clip": 4, "kind": "shaw"}), d_k=64)
    assert study_csv.value(r, "variant") == "rel"
    assert study_csv.value(r, "d_k") == "64"
    assert study_csv.value(r, "reason") is None  # an empty cell
    assert study_csv.value(r, "variant_params.clip") == "4"
    assert study_csv.value(r, "variant_params.kind") == "shaw"
    assert study_csv.value(r, "variant_params.missing") is None
    assert study_csv.value(row("b", variant_params=""), "variant_params.clip") is None  # a run without params


def test_value_of_an_unknown_column_exits_with_a_message_naming_it() -> None:
    with pytest.raises(SystemExit, match=r"no column 'dk' in the CSV; it has: run, status, variant"):
        study_csv.value(row("a"), "dk")
    with pytest.raises(SystemExit, match="'nope'"):
        study_csv.matches(row("a"), ["nope=1"])


@pytest.mark.parametrize(
    ("text", "expected"), [("0.10", 0.1), ("64", 64.0), ("1e-3", 0.001), ("-2.5", -2.5), ("dot", None), ("", None)]
)
def test_number_is_a_float_or_none(text: str, expected: float | None) -> None:
    assert study_csv.number(text) == expected
    assert study_csv.number(None) is None


def test_where_filters_compare_numbers_as_numbers_and_text_exactly() -> None:
    r = row("a", variant="dot", variant_params=json.dumps({"clip": 4}), d_k=64, lr="0.10")
    for conditions in (["lr=0.1"], ["lr=1e-1"], ["d_k=64.0"], ["variant=dot", "d_k=64"], ["variant_params.clip=4.0"]):
        assert study_csv.matches(r, conditions), conditions
    assert study_csv.matches(r, ["reason="])  # an empty cell matches an empty value
    assert study_csv.matches(r, [])
    for conditions in (["lr=0.2"], ["variant=Dot"], ["variant=dot", "d_k=8"], ["variant_params.clip=5"], ["reason=x"]):
        assert not study_csv.matches(r, conditions), conditions
    with pytest.raises(SystemExit, match="--where takes KEY=VALUE, got 'd_k'"):
        study_csv.matches(r, ["d_k"])
    assert study_csv.matches(r, ["lr=0.3,0.1"]) and study_csv.matches(r, ["variant=abs,dot"])  # either value
    assert not study_csv.matches(r, ["lr=0.3,1"]) and not study_csv.matches(r, ["variant=abs,Dot"])
    assert study_csv.matches(r, ["run=a*"]) and study_csv.matches(r, ["run=b/*,a*"])  # globs on the text
    assert not study_csv.matches(r, ["run=b*"]) and not study_csv.matches(r, ["variant=*x*"])


def test_a_json_boolean_in_variant_params_matches_its_json_spelling() -> None:
    r = row("a", variant_params=json.dumps({"causal": True}))
    assert study_csv.matches(r, ["variant_params.causal=true"])


def test_read_rows_keeps_failed_runs_and_applies_the_filters(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path / "summary.csv",
        [
            row("a", variant="dot", d_k=8, test_acc=0.5),
            row("b", "failed", variant="dot", d_k=64, reason="diverged"),
            row("c", variant="rel", d_k=64, test_acc=0.7),
        ],
    )
    assert [r["run"] for r in study_csv.read_rows(path)] == ["a", "b", "c"]
    assert [r["run"] for r in study_csv.read_rows(path, ["d_k=64"])] == ["b", "c"]
    assert [r["run"] for r in study_csv.read_rows(path, ["d_k=64", "variant=dot"])] == ["b"]
    assert study_csv.read_rows(path, ["variant=none"]) == []
    assert study_csv.read_rows(path)[2]["test/acc"] == "0.7"


# ---------------------------------------------------------------------------------------------------- table.py


def test_a_cell_is_the_mean_and_the_95_percent_t_half_width_over_the_runs() -> None:
    accs, entropies = [0.61, 0.64, 0.70], [0.812, 0.833, 0.871]
    rows = [
        row(f"d{i}", variant="dot", d_k=64, test_acc=a, entropy=e)
        for i, (a, e) in enumerate(zip(accs, entropies, strict=True))
    ]
    rows.append(row("r0", variant="rel", d_k=64, test_acc=0.4567, entropy=0.5))  # one run: no interval
    text = table.table(rows, ["variant", "d_k"], ["test/acc:pct", "attn/entropy_norm:3"])
    pct = [100 * a for a in accs]
    acc_cell = f"{statistics.mean(pct):.1f} ± {half_width(pct):.1f}"
    ent_cell = f"{statistics.mean(entropies):.3f} ± {half_width(entropies):.3f}"
    assert (acc_cell, ent_cell) == ("65.0 ± 11.4", "0.839 ± 0.074")  # by hand: s = sqrt(21) %, 4.3027 s / sqrt(3)
    assert text.splitlines() == [
        "| variant | d_k | test/acc | attn/entropy_norm | n |",
        "| --- | --- | --- | --- | --- |",
        f"| dot | 64 | {acc_cell} | {ent_cell} | 3 |",
        "| rel | 64 | 45.7 | 0.500 | 1 |",
    ]


def test_failed_runs_are_counted_in_a_failed_column_and_not_averaged() -> None:
    rows = [
        row("d0", variant="dot", test_acc=0.80),
        row("d1", "failed", variant="dot", test_acc=0.10, reason="diverged"),  # logged an accuracy before diverging
        row("d2", variant="dot", test_acc=0.90),
        row("r0", variant="rel", test_acc=0.50),
        row("a0", "failed", variant="abs", reason="diverged"),
        row("a1", "interrupted", variant="abs", test_acc=0.99),
    ]
    dot = f"{85.0:.1f} ± {T975[1] * statistics.stdev([80.0, 90.0]) / math.sqrt(2):.1f}"
    assert dot == "85.0 ± 63.5"
    assert table.table(rows, ["variant"], ["test/acc:pct"]).splitlines() == [
        "| variant | test/acc | n | failed |",
        "| --- | --- | --- | --- |",
        f"| dot | {dot} | 2 | 1 |",
        "| rel | 50.0 | 1 | 0 |",
        "| abs | — | 0 | 2 |",
    ]
    # the column is there only when the selection has a failed run
    assert "failed" not in table.table([r for r in rows if r["status"] == "ok"], ["variant"], ["test/acc:pct"])


def test_a_line_with_no_values_shows_a_dash_and_lines_keep_their_first_order() -> None:
    rows = [
        row("b0", variant="rel", variant_params=json.dumps({"clip": 8}), test_acc=0.25),
        row("a0", variant="rel", variant_params=json.dumps({"clip": 2})),  # finished, but logged no test/acc
        row("b1", variant="rel", variant_params=json.dumps({"clip": 8}), test_acc=0.35),
        row("a1", variant="rel", variant_params=json.dumps({"clip": 2})),
        row("c0", variant="dot", test_acc=0.5),
    ]
    b = f"30.0 ± {T975[1] * statistics.stdev([25.0, 35.0]) / math.sqrt(2):.1f}"
    assert table.table(rows, ["variant", "variant_params.clip"], ["test/acc:pct", "test/acc:2"]).splitlines() == [
        "| variant | variant_params.clip | test/acc | test/acc | n |",
        "| --- | --- | --- | --- | --- |",
        f"| rel | 8 | {b} | 0.30 ± {T975[1] * statistics.stdev([0.25, 0.35]) / math.sqrt(2):.2f} | 2 |",
        "| rel | 2 | — | — | 2 |",
        "| dot |  | 50.0 | 0.50 | 1 |",
    ]


def test_a_line_whose_values_are_all_nan_shows_a_dash() -> None:
    rows = [row("a", variant="dot", test_acc="nan"), row("b", variant="dot", test_acc="nan")]
    assert table.table(rows, ["variant"], ["test/acc:pct"]).splitlines()[2] == "| dot | — | 2 |"


def test_table_main_prints_the_table_of_the_rows_that_match_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_csv(
        tmp_path / "summary.csv",
        [
            row("a", variant="dot", d_k=64, test_acc=0.5),
            row("b", variant="dot", d_k=8, test_acc=0.9),
            row("c", "failed", variant="dot", d_k=8),
            row("d", variant="dot", d_k=64.0, test_acc=0.7),
        ],
    )
    table.main([str(path), "--rows", "variant", "--metrics", "test/acc:3", "--where", "d_k=64"])
    half = T975[1] * statistics.stdev([0.5, 0.7]) / math.sqrt(2)
    assert capsys.readouterr().out.splitlines() == [
        "| variant | test/acc | n |",  # the failed run is not in the selection: no failed column
        "| --- | --- | --- |",
        f"| dot | 0.600 ± {half:.3f} | 2 |",
    ]
    with pytest.raises(SystemExit, match="no column 'dk'"):
        table.main([str(path), "--rows", "dk", "--metrics", "test/acc:3"])


# ---------------------------------------------------------------------------------------------------- plot.py


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    """Close the figures a test opened (plot.main leaves its figure open)."""
    yield
    plt.close("all")


OPTIONS = argparse.Namespace(categorical=False, logx=False)


def draw(rows: list[dict[str, str]], x: str, metric: str, options: argparse.Namespace = OPTIONS) -> plt.Axes:
    """``plot._draw_metric`` on a fresh axis, lines by variant."""
    _, ax = plt.subplots()
    plot._draw_metric(ax, rows, x, metric, ["variant"], {}, options)
    return ax


def lines_of(ax: plt.Axes) -> dict[str, tuple[list[float], list[float], list[tuple[float, float]]]]:
    """{label: (xs, means, (bottom, top) of each error bar)} of the error-bar lines on ``ax``."""
    out = {}
    for container in ax.containers:
        data_line, _, (bars,) = container.lines
        ends = [(float(seg[0][1]), float(seg[1][1])) for seg in bars.get_segments()]
        out[container.get_label()] = (list(data_line.get_xdata()), list(data_line.get_ydata()), ends)
    return out


def clipped(mean: float, half: float) -> tuple[float, float]:
    """The interval mean ± half, clipped to an accuracy's 0..100 %."""
    return pytest.approx((max(mean - half, 0.0), min(mean + half, 100.0)))


def failed_marks(ax: plt.Axes) -> dict[float, str]:
    """{x: count text} of the red ✕ markers for failed runs (one marker and one count per x)."""
    crosses = [line for line in ax.lines if line.get_marker() == "x" and line.get_color() == "red"]
    texts = {t.get_position()[0]: t.get_text() for t in ax.texts if t.get_color() == "red"}
    assert sorted(x for line in crosses for x in line.get_xdata()) == sorted(texts)
    return texts


@pytest.mark.parametrize(
    ("metric", "percent"),
    [
        ("test/acc", True),
        ("test/acc@64", True),
        ("val/acc_best", True),
        ("val/acc_best@128", True),
        ("train/loss", False),
        ("test/loss@64", False),
        ("test/accuracy", False),
        ("attn/acc_proxy", False),
    ],
)
def test_accuracies_are_drawn_in_percent(metric: str, percent: bool) -> None:
    assert plot._percent(metric) is percent


def test_points_read_metric_at_length_columns_or_one_column() -> None:
    r = {"run": "a", "status": "ok", "variant": "dot", "d_k": "64", "test/acc": "0.9", "test/acc@64": "0.8",
         "test/acc@128": "", "test/acc@big": "0.1", "test/acc_best@64": "0.2", "val/acc@64": "0.3"}  # fmt: skip
    assert [(x, y) for x, _, y in plot._points([r], "length", "test/acc")] == [("64", 0.8), ("128", None)]
    assert [(x, y) for x, _, y in plot._points([r], "d_k", "test/acc")] == [("64", 0.9)]
    assert [(x, y) for x, _, y in plot._points([r], "d_k", "test/loss")] == [("64", None)]
    no_x = {**r, "d_k": ""}
    assert plot._points([no_x], "d_k", "test/acc") == []  # a row without an x value is left out
    clip = {**r, "variant_params": json.dumps({"clip": 16})}
    assert plot._points([clip, no_x], "variant_params.clip", "test/acc") == [("16", clip, 0.9)]


def test_a_numeric_x_draws_the_mean_and_ci_per_line_and_counts_failed_runs() -> None:
    rows = [
        *(row(f"d8-{i}", variant="dot", d_k=8, test_acc=a) for i, a in enumerate([0.5, 0.6, 0.7])),
        row("d64-0", variant="dot", d_k=64, test_acc=0.8),
        row("d64-1", "failed", variant="dot", d_k=64, test_acc=0.1),  # not averaged
        row("d64-2", variant="dot", d_k=64, test_acc=0.9),
        row("r64", variant="rel", d_k=64, test_acc=0.4),
        row("r8", variant="rel", d_k=8, test_acc="nan"),  # not finite: no point
        row("d512-0", "failed", variant="dot", d_k=512),
        row("d512-1", "failed", variant="rel", d_k=512, test_acc=0.3),
    ]
    ax = draw(rows, "d_k", "test/acc")
    got = lines_of(ax)
    assert list(got) == ["dot", "rel"]
    xs, means, bars = got["dot"]
    assert xs == [8.0, 64.0]
    assert means == pytest.approx([60.0, 85.0])
    # 60 ± 24.8 fits; 85 ± 63.5 (two runs: t = 12.7) is clipped to 100 % above and 21.5 % below
    assert bars == [clipped(60.0, half_width([50.0, 60.0, 70.0])), clipped(85.0, half_width([80.0, 90.0]))]
    assert bars[1][1] == pytest.approx(100.0)
    assert got["rel"] == ([64.0], [pytest.approx(40.0)], [pytest.approx((40.0, 40.0))])  # one run: no interval
    assert failed_marks(ax) == {64.0: "1", 512.0: "2"}
    assert ax.get_title() == "test/acc (%)"
    assert ax.get_xlabel() == "d_k"


def test_a_text_x_is_drawn_as_categories_in_first_order() -> None:
    rows = [
        row("r0", variant="rel", d_k=512, test_acc=0.2),
        row("d0", variant="dot", d_k=8, test_acc=0.6),
        row("d1", "failed", variant="dot", d_k=64),
        row("r1", variant="rel", d_k=64, test_acc=0.4),
    ]
    ax = draw(rows, "variant", "test/acc")
    assert {k: (x, y) for k, (x, y, _) in lines_of(ax).items()} == {  # two lines, set 0.1 apart
        "rel": ([pytest.approx(-0.05)], [pytest.approx(30.0)]),
        "dot": ([pytest.approx(1.05)], [pytest.approx(60.0)]),
    }
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rel", "dot"]
    assert failed_marks(ax) == {1: "1"}
    # a numeric x drawn as categories: sorted, evenly spaced
    ax = draw(rows, "d_k", "test/acc", argparse.Namespace(categorical=True, logx=False))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "64", "512"]
    assert {k: x for k, (x, _, _) in lines_of(ax).items()} == {
        "rel": [pytest.approx(0.95), pytest.approx(1.95)],
        "dot": [pytest.approx(0.05)],
    }
    assert failed_marks(ax) == {1: "1"}


def test_x_length_draws_each_metric_at_length_column_against_the_test_length() -> None:
    rows = [
        row("a", variant="dot", acc_64=0.9, acc_128=0.5),
        row("b", variant="dot", acc_64=0.8, acc_128=""),  # no value at 128
        row("c", "failed", variant="dot"),  # diverged before testing: counted at every length
    ]
    ax = draw(rows, "length", "test/acc")
    xs, means, bars = lines_of(ax)["dot"]
    assert (xs, means) == ([64.0, 128.0], pytest.approx([85.0, 50.0]))
    assert bars == [clipped(85.0, half_width([90, 80])), clipped(50.0, 0.0)]
    assert failed_marks(ax) == {64.0: "1", 128.0: "1"}
    assert ax.get_xlabel() == "test length"
    assert ax.get_title() == "test/acc (%)"


def test_plot_main_writes_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_csv(
        tmp_path / "summary.csv",
        [row("a", variant="dot", acc_64=0.9, acc_128=0.5), row("b", "failed", variant="rel", acc_64=0.1)],
    )
    out = tmp_path / "figure.png"
    plot.main([str(path), "--x", "length", "--metrics", "test/acc", "--logx", "-o", str(out)])
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    width, height = png_size(out)  # one 4.0 x 3.4 inch panel at 90 dpi, cropped to its content, plus the legend
    assert 250 < height <= 306 and width > height


def test_plot_main_exits_when_where_matches_no_row(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "summary.csv", [row("a", variant="dot", d_k=64, test_acc=0.5)])
    out = tmp_path / "figure.png"
    with pytest.raises(SystemExit, match=r"no row of .*summary\.csv matches variant=rel d_k=64"):
        plot.main(
            [str(path), "--x", "d_k", "--metrics", "test/acc", "--where", "variant=rel", "d_k=64", "-o", str(out)]
        )
    assert not out.exists()


def test_plot_main_draws_a_selection_where_every_run_failed(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path / "summary.csv",
        [row("a", "failed", variant="dot", d_k=64), row("b", "failed", variant="dot", d_k=8, test_acc=0.1)],
    )
    out = tmp_path / "figure.png"
    plot.main([str(path), "--x", "d_k", "--metrics", "test/acc", "-o", str(out)])
    width, height = png_size(out)  # no ok run: no line, no legend, still the panel with its ✕ counts
    assert 250 < height <= 306 and 250 < width <= 360


def test_a_categorical_panel_without_points_is_drawn_empty() -> None:
    ax = draw(
        [row("a", variant="dot", acc_64=0.9)], "length", "val/acc", argparse.Namespace(categorical=True, logx=False)
    )
    assert ax.containers == []


def test_plot_curves_add_a_second_row_with_one_line_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = write_csv(
        tmp_path / "summary.csv",
        [
            row("sweep/0", variant="dot", d_k=8, test_acc=0.6),
            row("sweep/1", "failed", variant="dot", d_k=64),
            row("sweep/2", variant="rel", d_k=8, test_acc=0.7),
        ],
    )
    curve_rows = [
        ("sweep/0", 10, 2.0, 5.0),
        ("sweep/0", 20, 1.5, ""),
        ("sweep/0", 30, 1.0, 7.0),
        ("sweep/1", 10, 3.0, 9.0),
        ("sweep/1", 20, 8.0, ""),  # diverged after step 20
        ("sweep/2", 10, 2.5, 4.0),
        ("other/0", 10, 1.0, 1.0),  # a run not in summary.csv
    ]
    curves_csv = tmp_path / "curves.csv"
    with curves_csv.open("w", newline="") as f:
        csv.writer(f).writerows([("run", "step", "train/loss", "attn/logit_max"), *curve_rows])
    drawn: dict[str, tuple[plt.Axes, list[str], dict[str, str]]] = {}
    original = plot._draw_curves

    def spy(
        ax: plt.Axes,
        curves: dict[str, list[tuple[float, dict[str, float]]]],
        summary: dict[str, dict[str, str]],
        metric: str,
        group: list[str],
        renames: dict[str, str],
        colors: Callable[[str], str],
    ) -> None:
        """Draw as plot.main asks, and keep the axis, the runs kept and the line colors."""
        original(ax, curves, summary, metric, group, renames, colors)
        drawn[metric] = (ax, sorted(summary), {label: colors(label) for label in ("dot", "rel", "abs")})

    monkeypatch.setattr(plot, "_draw_curves", spy)
    out = tmp_path / "figure.png"
    argv = [str(summary), "--x", "d_k", "--metrics", "test/acc", "--curves", str(curves_csv)]
    plot.main([*argv, "--curve-where", "variant=dot", "-o", str(out)])
    width, height = png_size(out)  # 2 x 2 panels of 4.0 x 3.4 inches at 90 dpi, cropped, plus the legend
    assert 500 < height <= 612 and width > 600
    assert list(drawn) == ["train/loss", "attn/logit_max"]
    ax, runs, colors = drawn["train/loss"]
    assert runs == ["sweep/0", "sweep/1"]  # --curve-where keeps the dot runs
    assert colors["abs"] == "gray" and colors["dot"] != colors["rel"] and "gray" not in (colors["dot"], colors["rel"])
    thin = [line for line in ax.lines if line.get_marker() != "x"]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in thin] == [
        ([10.0, 20.0, 30.0], [2.0, 1.5, 1.0]),
        ([10.0, 20.0], [3.0, 8.0]),
    ]
    assert all(line.get_color() == colors["dot"] for line in thin)
    crosses = [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines if line.get_marker() == "x"]
    assert crosses == [([20.0], [8.0])]  # the failed run ends in a red cross
    ax, _, _ = drawn["attn/logit_max"]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines if line.get_marker() != "x"] == [
        ([10.0, 30.0], [5.0, 7.0]),  # steps without the metric are skipped
        ([10.0], [9.0]),
    ]
    assert [list(line.get_xdata()) for line in ax.lines if line.get_marker() == "x"] == [[10.0]]


# ---------------------------------------------------------------------------------------------------- curves.py


def make_run(folder: Path, seed: int, status: str, rows: list[dict[str, Any]], torn: bool = False) -> Path:
    """A minimal run folder: config.yaml, summary.json (status and final metrics), metrics.jsonl (``torn`` adds a
    killed writer's half-written last line)."""
    folder.mkdir(parents=True)
    config = f"variant:\n  name: dot\n  params: {{}}\nmask:\n  name: none\ntask:\n  name: digits\nseed: {seed}\n"
    (folder / "config.yaml").write_text(config)
    summary = {"status": status, "reason": None if status == "ok" else "diverged", "seed": seed, "steps": 30}
    summary["metrics"] = {"test/acc": 0.5} if status == "ok" else {}
    (folder / "summary.json").write_text(json.dumps(summary))
    text = "".join(json.dumps(r) + "\n" for r in rows) + ('{"step": 40, "train/loss": 0.' if torn else "")
    (folder / "metrics.jsonl").write_text(text)
    return folder


def study(root: Path) -> Path:
    """Three runs in two sweeps under ``root``: one finished, one that diverged (torn last line), one that logged
    only one of the chosen metrics."""
    make_run(
        root / "sweep_a" / "0",
        0,
        "ok",
        [
            {"step": 0, "attn/entropy": 0.9},  # none of the chosen metrics: left out
            {"step": 10, "train/loss": 2.0},
            {"step": 20, "train/loss": 1.5, "val/acc": 0.4},
            {"step": 30, "train/loss": 1.0},
            {"step": 30, "val/acc": 0.6},  # the same step in two rows: one CSV row
        ],
    )
    make_run(
        root / "sweep_a" / "1",
        1,
        "failed",
        [{"step": 10, "train/loss": 3.0}, {"step": 20, "train/loss": None}, {"step": 30, "train/loss": 9.5}],
        torn=True,
    )
    make_run(root / "sweep_b" / "0", 2, "ok", [{"step": 10, "val/acc": 0.5}, {"step": 15, "train/acc": 0.2}])
    return root


def read_csv(path: Path) -> list[list[str]]:
    """A CSV's rows, header included."""
    with path.open(newline="") as f:
        return list(csv.reader(f))


def test_write_curves_writes_one_row_per_run_and_logged_step(tmp_path: Path) -> None:
    root = study(tmp_path / "runs")
    out = tmp_path / "out" / "curves.csv"
    assert curves.write_curves(root, ["train/loss", "val/acc"], out) == 6
    assert read_csv(out) == [
        ["run", "step", "train/loss", "val/acc"],
        ["sweep_a/0", "10", "2", ""],
        ["sweep_a/0", "20", "1.5", "0.4"],
        ["sweep_a/0", "30", "1", "0.6"],
        ["sweep_a/1", "10", "3", ""],  # step 20 logged only null: left out
        ["sweep_a/1", "30", "9.5", ""],  # the failed run keeps what it logged before the torn line
        ["sweep_b/0", "10", "", "0.5"],
    ]


def test_curves_name_runs_as_the_dashboard_csv_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = study(tmp_path / "runs")
    for folder in (root, root / "sweep_a", root / "sweep_b" / "0"):  # a folder of sweeps, a sweep, one run
        dashboard_csv, curves_csv = tmp_path / "runs.csv", tmp_path / "curves.csv"
        assert dashboard_main([str(folder), "-o", str(tmp_path / "dashboard.html"), "--csv", str(dashboard_csv)]) == 0
        curves.main([str(folder), "--metrics", "train/loss", "val/acc", "-o", str(curves_csv)])
        with dashboard_csv.open() as f:
            names = [r["run"] for r in csv.DictReader(f)]
        with curves_csv.open() as f:
            named = list(dict.fromkeys(r["run"] for r in csv.DictReader(f)))
        assert named == names, folder
    assert names == ["0"]  # one run folder is named by its folder
    assert [run.name for run in load_runs(root)] == ["sweep_a/0", "sweep_a/1", "sweep_b/0"]
    assert "wrote" in capsys.readouterr().out


def test_curves_main_refuses_a_path_that_is_not_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        curves.main([str(tmp_path / "missing"), "--metrics", "train/loss", "-o", str(tmp_path / "c.csv")])
    assert exited.value.code == 2
    assert "is not a folder of runs" in capsys.readouterr().err
    assert not (tmp_path / "c.csv").exists()


# ---------------------------------------------------------------------------------------------- induction, pruning


def _study_script(study: str) -> ModuleType:
    """``experiments/<study>/analyze.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"{study}_analyze", REPO / "experiments" / study / "analyze.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_jump_step_is_where_half_the_rise_to_the_end_is_covered() -> None:
    jump_step = _study_script("induction").jump_step
    steps = np.arange(0, 110, 10, dtype=float)
    rise = np.array([0.05, 0.05, 0.06, 0.05, 0.1, 0.3, 0.5, 0.55, 0.56, 0.55, 0.56])
    assert jump_step(steps, rise, 0.05) == 60.0  # start 0.05, end 0.5567: half-way is 0.303 (step 50 has 0.3)
    bump = np.array([0.05, 0.05, 0.3, 0.05, 0.05, 0.05, 0.05, 0.06, 0.05, 0.05, 0.05])
    assert jump_step(steps, bump, 0.05) is None  # a transient bump is no jump
    acc = np.array([0.02, 0.12, 0.13, 0.12, 0.5, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert jump_step(steps, acc, 0.1, floor=0.125) == 50.0  # from chance (0.125), not from 0.02: half-way 0.5625
    loss = np.array([3.0, 2.5, 2.0, 1.8, 1.7, 1.6, 1.55, 1.5, 1.5, 1.5, 1.5])
    assert jump_step(steps, loss, 0.0, falling=True) == 20.0  # half its fall, 3.0 → 1.5: 2.25


def test_removable_heads_are_those_removed_before_the_metric_leaves_the_tolerance() -> None:
    removable = _study_script("pruning").removable
    assert removable([2.0, 2.01, 2.04, 2.2, 2.05], higher_is_better=False, tolerance=0.05) == 0.5
    assert removable([0.9, 0.895, 0.85, 0.9, 0.9], higher_is_better=True, tolerance=0.01) == 0.25
    assert removable([0.9, 0.9, 0.9], higher_is_better=True, tolerance=0.01) == 1.0


# ---------------------------------------------------------------------------------------------------- tuned_study

tuned_study = _script("tuned_study")


def _tuned_csv(path: Path) -> Path:
    """A tuned study's summary.csv by hand: models a and b on one task; the tune stage (seed 0) at two rates, the
    seeds stage (1, 2, 3) at the chosen one; b's seed 3 failed."""
    rows = []
    for model, accs in (("a", [0.9, 0.8, 0.7]), ("b", [0.5, 0.6, None])):
        for lr in (0.003, 0.01):
            rows.append(row(f"m_{model}/tune/0_lr={lr}", lr=lr, seed=0, test_acc=0.99, task="parity"))
        for seed, acc in zip((1, 2, 3), accs, strict=True):
            status = "ok" if acc is not None else "diverged"
            rows.append(row(f"m_{model}/seeds/{seed}_lr=0.01", status, lr=0.01, seed=seed, test_acc=acc, task="parity"))
    return write_csv(path, [{**r, "seed": r.get("seed", "")} for r in rows])


def test_a_tuned_study_compares_only_the_seed_stage_with_paired_differences(tmp_path: Path) -> None:
    rows = tuned_study.load(
        _tuned_csv(tmp_path / "s.csv"), lambda r: r["sweep"].removeprefix("m_"), lambda r: r["task"]
    )
    assert {r["stage"] for r in rows} == {"tune", "seeds"}
    assert sorted(tuned_study.seeds(rows, "a", "parity")) == [1, 2, 3]
    assert tuned_study.chosen_lr(rows, "a", "parity") == 0.01
    a = [0.9, 0.8, 0.7]
    assert tuned_study.cell(rows, "a", "parity", "test/acc") == f"80.0 ± {100 * half_width(a):.1f}"
    assert tuned_study.cell(rows, "b", "parity", "test/acc") == f"55.0 ± {100 * half_width([0.5, 0.6]):.1f} (1 failed)"
    assert tuned_study.cell(rows, "c", "parity", "test/acc") == "—"
    d = tuned_study.difference(rows, "a", "b", "parity", "test/acc")  # seeds 1 and 2 only: 0.4 and 0.2
    assert d.n == 2 and d.mean == pytest.approx(0.3)
    assert d.half_width == pytest.approx(T975[1] * statistics.stdev([0.4, 0.2]) / math.sqrt(2))
    assert tuned_study.difference_text(d).startswith("+30.0 ± ")
    family = tuned_study.holm_table([("x", d), ("y", d), ("z", tuned_study.Difference(0.1, None, 1))])
    assert family[0][2] == pytest.approx(min(1.0, 2 * d.p)) and family[2][2] is None


@pytest.mark.parametrize("study", ["state_tracking", "forgetting_recall", "gated_output", "lr_window", "hybrid_ratio"])
def test_a_tuned_studys_readme_quotes_the_tables_its_analyze_script_prints(
    study: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Every table row analyze.py prints from the committed CSVs is in the study's README verbatim, so the README's
    numbers are the committed runs' (the figure is not redrawn here)."""
    module = _study_script(study)
    monkeypatch.setattr(module, "figure", lambda *args: None)
    module.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) >= 10
    readme = (REPO / "experiments" / study / "README.md").read_text()
    assert [row for row in rows if row not in readme] == []
