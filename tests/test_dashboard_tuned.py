"""The dashboard on tuned sweeps (tuned.json) and on summary.json's compute fields: synthetic run folders written
here (no training), every expected number computed by hand; one page opened in headless Chromium."""

from __future__ import annotations

import copy
import csv
import html as html_lib
import itertools
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import t as student_t

from attnlab import dashboard
from attnlab.dashboard import build_html, load_runs
from attnlab.dashboard import figures as figures_module
from attnlab.dashboard.metrics import metrics_in
from attnlab.dashboard.tuned import find_tuned
from attnlab.stats import si_number, spec_for

GRID = [0.001, 0.003, 0.01]
# val/acc_best of each configuration's tuning run (seed 0) at each lr; None: the run failed
TUNE = {
    "scaled_dot": [0.80, 0.90, 0.85],
    "dot": [0.70, 0.75, 0.78],
    "additive": [0.60, 0.55, None],
}
BEST = {"scaled_dot": 0.003, "dot": 0.01, "additive": 0.001}
SEEDS = [0, 1, 2]  # seed 0 is the tuning seed: its run at the best point is reused
# test/acc and test/bpc of each configuration's seed runs (at its best lr), by seed
TEST_ACC = {"scaled_dot": [0.91, 0.93, 0.92], "dot": [0.80, 0.98, 0.79], "additive": [0.62, 0.60, 0.65]}
TEST_BPC = {"scaled_dot": [1.2, 1.25, 1.18], "dot": [1.5, 1.45, 1.55], "additive": [1.1, 1.05, 1.12]}
OFF_BEST_ACC = 0.99  # every tuning run off its best point: pooled into a headline cell, it would win
# compute fields per configuration
FLOPS = {"scaled_dot": 2e6, "dot": 1e6, "additive": 4e6}
PARAMS = {"scaled_dot": 1000, "dot": 900, "additive": 1500}
STATE = {"scaled_dot": [4000, 4000], "dot": [4000, 4000], "additive": [8000, 8000]}


# ---------------------------------------------------------------------------------------------------- fixtures
def write_run(
    folder: Path,
    variant: str,
    lr: float,
    seed: int,
    *,
    val: float | None,
    acc: float,
    bpc: float,
    status: str = "ok",
    compute: bool = True,
    extra: dict[str, Any] | None = None,
) -> Path:
    """One synthetic run folder (config.yaml, summary.json with the compute fields of schema 5, metrics.jsonl)."""
    folder.mkdir(parents=True)
    config = {
        "variant": {"name": variant, "params": {}},
        "task": {"name": "digits", "datamodule": {}},
        "d_model": 64,
        "num_heads": 4,
        "lr": lr,
        "seed": seed,
        "optimized_metric": "val/acc_best",
        **(extra or {}),
    }
    (folder / "config.yaml").write_text(json.dumps(config))  # (JSON is YAML)
    metrics = {} if status != "ok" else {"val/acc_best": val, "test/acc": acc, "test/bpc": bpc}
    summary: dict[str, Any] = {
        "status": status,
        "reason": "NaN loss at step 12" if status == "failed" else None,
        "variant": variant,
        "task": "digits",
        "seed": seed,
        "lr": lr,
        "overrides": [f"variant={variant}", f"lr={lr:g}", f"seed={seed}"],
        "metrics": metrics,
        "chance_accuracy": 0.1,
        "params": PARAMS.get(variant, 100),
        "wall_time_s": 10.0 + seed + (5.0 if variant == "additive" else 0.0),
        "schema_version": 5,
    }
    if compute:
        summary.update(
            params_non_embedding=PARAMS.get(variant, 100) - 100,
            flops_per_token=FLOPS.get(variant, 1e5),
            state_size=STATE.get(variant, [10, 10]),
            tokens_per_step=1024,
            tokens_seen=1024 * 100,
            step_time_s=0.05 * (2 if variant == "additive" else 1),
        )
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = [{"step": 0, "train/loss": 2.3}, {"step": 100, "train/loss": 1.0, **metrics}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def write_tuned_sweep(root: Path) -> Path:
    """A tuned sweep as ``hydra/sweeper=tuned variant=scaled_dot,dot,additive`` leaves it: 3 configurations x 3 lr
    on seed 0 (additive at lr 0.01 failed), then each at its best lr on seeds 0 (reused), 1 and 2; tuned.json."""
    plan: dict[str, Any] = {
        "format": 1,
        "metric": "val/acc_best",
        "direction": "maximize",
        "grid": {"lr": GRID},
        "tune_seed": 0,
        "seeds": SEEDS,
        "stage": "done",
        "configurations": [],
    }
    num = 0
    for variant, values in TUNE.items():  # the tuning stage: jobs 0-8
        entry: dict[str, Any] = {"overrides": [f"variant={variant}"], "label": f"variant={variant}", "tune": []}
        plan["configurations"].append(entry)
        for lr, value in zip(GRID, values, strict=True):
            job = f"tune/{num}_lr={lr:g},variant={variant}"
            num += 1
            at_best = lr == BEST[variant]
            write_run(root / job, variant, lr, 0, val=value, status="ok" if value is not None else "failed",
                      acc=TEST_ACC[variant][0] if at_best else OFF_BEST_ACC,
                      bpc=TEST_BPC[variant][0] if at_best else 0.5)  # fmt: skip
            entry["tune"].append({"point": {"lr": lr}, "job": job, "status": "ok" if value else "failed",
                                  "value": value})  # fmt: skip
    for variant, entry in zip(TUNE, plan["configurations"], strict=True):  # the seeds stage: jobs 9-14
        entry["best"] = {"lr": BEST[variant]}
        entry["seeds"] = []
        for seed in SEEDS:
            if seed == 0:
                best_job = next(t["job"] for t in entry["tune"] if t["point"]["lr"] == BEST[variant])
                entry["seeds"].append({"seed": 0, "job": best_job, "reused": True})
                continue
            job = f"seeds/{num}_lr={BEST[variant]:g},seed={seed},variant={variant}"
            num += 1
            write_run(root / job, variant, BEST[variant], seed, val=0.5, acc=TEST_ACC[variant][seed],
                      bpc=TEST_BPC[variant][seed])  # fmt: skip
            entry["seeds"].append({"seed": seed, "job": job, "status": "ok"})
    (root / "tuned.json").write_text(json.dumps(plan, indent=2))
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


@pytest.fixture(scope="module")
def tuned_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tuned_sweep(tmp_path_factory.mktemp("tuned") / "sweep")


@pytest.fixture(scope="module")
def tuned_html(tuned_sweep: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = dashboard.write_dashboard(tuned_sweep, tmp_path_factory.mktemp("tuned_page") / "dashboard.html")
    return out.read_text()


def _section(html: str, anchor: str) -> str:
    start = html.index(f'<section id="{anchor}">')
    return html[start : html.index("</section>", start)]


def _figure(html: str, anchor: str) -> dict:
    section = _section(html, anchor)
    div = re.search(r'data-figure="([\w-]+-json)"', section).group(1)
    return json.loads(re.search(rf'<script type="application/json" id="{div}">(.*?)</script>', html, re.S).group(1))


def hand_ci(values: list[float]) -> tuple[float, float]:
    """Mean and 95 % t half-width, by the textbook: t_{0.975, n-1} * s / sqrt(n), s with n - 1."""
    n = len(values)
    mean = sum(values) / n
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, student_t.ppf(0.975, n - 1) * s / math.sqrt(n)


def hand_frontier(points: dict[str, tuple[float, float]], higher: bool) -> list[str]:
    """The Pareto frontier, plainly: a configuration is on it when no other configuration costs as little or less
    and scores at least as well (of exact ties in both, the first named); listed by cost."""
    front = []
    for name, (cost, value) in points.items():
        dominated = False
        for other, (c, v) in points.items():
            if other == name:
                continue
            as_good = v >= value if higher else v <= value
            strictly = c < cost or (v > value if higher else v < value)
            tie_first = (c, v) == (cost, value) and list(points).index(other) < list(points).index(name)
            if c <= cost and as_good and (strictly or tie_first):
                dominated = True
        if not dominated:
            front.append(name)
    return sorted(front, key=lambda name: points[name][0])


# ---------------------------------------------------------------------------------------------------- headline
def test_the_headline_uses_only_the_seed_runs_and_names_the_protocol(tuned_html: str) -> None:
    section = _section(tuned_html, "headline")
    text = html_lib.unescape(re.sub(r"<[^>]+>", " ", section))
    protocol = html_lib.unescape(re.search(r'<p class="protocol">(.*?)</p>', section).group(1))
    assert (
        "each variant at its own best lr by val/acc_best (higher is better) on seed 0; grid lr 0.001, 0.003, 0.01; "
        "compared on seeds 0, 1, 2 (seed 0: the tuning run at the best point, reused)" in protocol
    )
    assert "only the 9 seed runs" in protocol and "the 6 other tuning runs" in protocol
    # each configuration's chosen point and its tuning value (in the order of the headline's rows)
    chosen = re.findall(r'<tr><td class="t">(\w+)</td><td class="t">([^<]+)</td><td>([^<]+)</td>', section)
    assert chosen == [
        ("additive", "lr=0.001 (at the grid&#x27;s edge: widen it)", "60.0 %"),
        ("dot", "lr=0.01 (at the grid&#x27;s edge: widen it)", "78.0 %"),
        ("scaled_dot", "lr=0.003", "90.0 %"),
    ]
    # the test/acc table: one row per variant (not per lr), one column, cells over the three seed runs only
    table = section[section.index('<table class="headline" data-metric="test/acc"') :]
    table = table[: table.index("</table>")]
    assert "<th>all runs</th>" in table and "lr=0.001</th>" not in table
    for variant, values in TEST_ACC.items():
        mean, half = hand_ci(values)
        row = re.search(rf'<tr><td class="t">{variant}</td>(.*?)</tr>', table).group(1)
        assert f'{100 * mean:.1f} % ± {100 * half:.2g} <span class="n">(3)</span>' in row, row
        assert f'<span class="pt">at lr={BEST[variant]:g}</span>' in row
    assert "99.0 %" not in table  # the off-best tuning runs never pool into a cell
    # the winner, its paired margin over the runner-up, Holm over the two rivals
    verdict = html_lib.unescape(re.findall(r'<p class="verdict">(.*?)</p>', section)[0])  # (the headline first)
    best, _ = hand_ci(TEST_ACC["scaled_dot"])
    assert verdict.startswith(f"Best test/acc: scaled_dot (lr=0.003), {100 * best:.1f} %")
    diffs = [a - b for a, b in zip(TEST_ACC["scaled_dot"], TEST_ACC["dot"], strict=True)]
    margin, half = hand_ci(diffs)
    assert "Runner-up: dot (lr=0.01), " in verdict and f"{100 * margin:.1f} points behind" in verdict
    assert "paired t over 3 seeds, Holm-corrected over 2 comparisons" in text.replace("Paired", "paired")


def test_the_headline_cells_by_hand_through_the_api(tuned_sweep: Path) -> None:
    """The same through :func:`find_tuned` and :func:`headline`: the seed runs are the plan's (a reused tuning run
    included), each cell pools exactly its three seeds, and the note is the chosen lr."""
    from attnlab.dashboard.stats import headline

    runs = load_runs(tuned_sweep)
    (tuned,) = find_tuned(runs, tuned_sweep).sweeps
    assert sorted(r.name for r in tuned.seed_runs) == sorted(
        [f"tune/{i}_lr={BEST[v]:g},variant={v}" for i, v in ((1, "scaled_dot"), (5, "dot"), (6, "additive"))]
        + [r.name for r in runs if r.name.startswith("seeds/")]
    )
    assert [d.key for d in tuned.sweep.dims] == ["variant.name"]  # lr, the tuned key, names no configuration
    table = headline(tuned.seed_runs, tuned.sweep, "test/acc", None, notes=list(tuned.grid))
    for variant, values in TEST_ACC.items():
        cell = table.cells[(variant,), None]
        assert sorted(cell.by_seed().items()) == list(enumerate(values)) and cell.note == f"lr={BEST[variant]:g}"


# ---------------------------------------------------------------------------------------------------- tuning
def test_the_sensitivity_chart_draws_each_configuration_against_the_grid(tuned_html: str) -> None:
    fig = _figure(tuned_html, "tuning")
    lines = [t for t in fig["data"] if t["mode"] == "lines+markers"]
    assert [t["name"] for t in lines] == sorted(TUNE)  # (in the order of the headline's rows)
    for trace in lines:
        assert trace["x"] == GRID and trace["y"] == TUNE[trace["name"]], trace["name"]  # failed: a gap
    (failed,) = [t for t in fig["data"] if t["name"] == "failed"]
    assert failed["x"] == [0.01] and failed["y"] == [0.0]  # at the bottom (accuracy: its lower bound)
    assert "x" in failed["marker"]["symbol"] and failed["mode"] == "markers"
    assert "additive" in failed["hovertext"][0] and "failed (NaN loss at step 12)" in failed["hovertext"][0]
    (chosen,) = [t for t in fig["data"] if t["name"] == "chosen"]
    assert chosen["marker"]["symbol"] == "star"
    expected = [(BEST[v], TUNE[v][GRID.index(BEST[v])]) for v in sorted(TUNE)]
    assert list(zip(chosen["x"], chosen["y"], strict=True)) == expected
    axis = fig["layout"]["xaxis"]
    assert axis["type"] == "log" and axis["tickvals"] == GRID and axis["title"]["text"] == "lr"
    assert fig["layout"]["yaxis"]["title"]["text"] == "val/acc_best: accuracy (%)"


def test_two_grid_keys_get_a_panel_each_the_other_key_at_its_best(tmp_path: Path) -> None:
    """grid lr x weight_decay, one configuration, best (lr 0.01, wd 0.1): the lr panel is at wd 0.1, the wd panel
    at lr 0.01; lr has only a factor 3 between its values and is still on a log axis, wd (with 0) is not."""
    values = {(0.003, 0.0): 0.5, (0.003, 0.1): 0.6, (0.01, 0.0): 0.7, (0.01, 0.1): 0.8}
    plan = {"format": 1, "metric": "val/acc_best", "direction": "maximize",
            "grid": {"lr": [0.003, 0.01], "weight_decay": [0.0, 0.1]}, "tune_seed": 0, "seeds": [1],
            "stage": "tune", "configurations": [{"overrides": [], "label": "", "tune": [], "best": None}]}  # fmt: skip
    for i, ((lr, wd), value) in enumerate(values.items()):
        job = f"tune/{i}_lr={lr},weight_decay={wd}"
        write_run(tmp_path / job, "dot", lr, 0, val=value, acc=0.5, bpc=1.0, extra={"weight_decay": wd})
        plan["configurations"][0]["tune"].append({"point": {"lr": lr, "weight_decay": wd}, "job": job})
    (tmp_path / "tuned.json").write_text(json.dumps(plan))
    (tuned,) = find_tuned(load_runs(tmp_path), tmp_path).sweeps
    fig = figures_module.sensitivity_figure(tuned)
    lines = [t for t in fig["data"] if t["mode"] == "lines+markers"]
    assert [(t["xaxis"], t["x"], t["y"]) for t in lines] == [("x", [0.003, 0.01], [0.6, 0.8]),
                                                             ("x2", [0.0, 0.1], [0.7, 0.8])]  # fmt: skip
    assert not [t for t in fig["data"] if t["name"] == "chosen"]  # stage tune: no best point yet
    assert fig["layout"]["xaxis"]["type"] == "log" and "type" not in fig["layout"]["xaxis2"]


def test_a_failed_point_sits_at_the_worst_edge() -> None:
    """At the metric's bound on the losing side (0 for an accuracy), else 10 % of the values' spread beyond the
    worst of them (a loss, where lower wins: above the highest)."""
    worst = figures_module._worst_edge
    assert worst([0.5, 0.9], spec_for("val/acc_best"), maximize=True) == 0.0
    assert worst([1.0, 2.0], spec_for("val/loss"), maximize=False) == pytest.approx(2.1)
    assert worst([1.0, 2.0], spec_for("val/loss"), maximize=True) == 0.0  # (a loss maximised: its bound, 0)


# ---------------------------------------------------------------------------------------------------- cost
def test_the_pareto_view_by_hand(tuned_html: str) -> None:
    """Per metric and cost, one point per configuration at its mean cost and mean metric over its seed runs, the
    95 % t interval clipped to the metric's range, and the frontier (higher accuracy, lower bpc wins)."""
    assert metrics_in("cost") == ["flops_per_token", "params", "state_size", "wall_time_s"]
    fig = _figure(tuned_html, "pareto")
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    costs = {
        "flops_per_token": {v: FLOPS[v] for v in TUNE},
        "params": {v: PARAMS[v] for v in TUNE},
        "state_size": {v: sum(STATE[v]) for v in TUNE},
        "wall_time_s": {v: sum(10.0 + s + (5.0 if v == "additive" else 0.0) for s in SEEDS) / 3 for v in TUNE},
    }
    for row, (metric, values, higher, low, high) in enumerate(
        [("test/acc", TEST_ACC, True, 0.0, 1.0), ("test/bpc", TEST_BPC, False, 0.0, math.inf)]
    ):
        for col, (cost, by_variant) in enumerate(costs.items()):
            panel = 4 * row + col
            axis = "x" if panel == 0 else f"x{panel + 1}"
            assert titles[panel] == f"{metric} vs {cost}"
            assert fig["layout"][f"xaxis{'' if panel == 0 else panel + 1}"]["type"] == "log"
            traces = {t["name"]: t for t in fig["data"] if t["xaxis"] == axis}
            points = {}
            for variant, seeds in values.items():
                mean, half = hand_ci(seeds)
                trace = traces[variant]
                assert trace["x"] == [pytest.approx(by_variant[variant])] and trace["y"] == [pytest.approx(mean)]
                up, down = min(mean + half, high) - mean, mean - max(mean - half, low)
                assert trace["error_y"]["array"] == [pytest.approx(up)], (metric, cost, variant)
                assert trace["error_y"]["arrayminus"] == [pytest.approx(down)], (metric, cost, variant)
                points[variant] = (by_variant[variant], mean)
            front = hand_frontier(points, higher)
            frontier = traces["Pareto frontier"]
            assert frontier["line"]["shape"] == "hv" and frontier["mode"] == "lines"
            assert frontier["x"] == [pytest.approx(points[v][0]) for v in front], (metric, cost, front)
            assert frontier["y"] == [pytest.approx(points[v][1]) for v in front], (metric, cost, front)
    # (hand-checked: accuracy by FLOPs: dot then scaled_dot; by state size, a tie in cost: scaled_dot alone;
    # bits per byte by FLOPs: all three, each cheaper one worse)
    flops = {t["name"]: t for t in fig["data"] if t["xaxis"] == "x"}["Pareto frontier"]["x"]
    assert flops == [1e6, 2e6]
    bpc = {t["name"]: t for t in fig["data"] if t["xaxis"] == "x5"}["Pareto frontier"]["x"]
    assert bpc == [1e6, 2e6, 4e6]


def test_no_pareto_view_without_the_compute_fields(tmp_path: Path) -> None:
    for i, variant in enumerate(("dot", "scaled_dot")):
        write_run(tmp_path / f"{i}_{variant}", variant, 0.003, 0, val=0.5, acc=0.5, bpc=1.0, compute=False)
    html = build_html(load_runs(tmp_path))
    assert '<section id="pareto">' not in html and '<section id="tuning">' not in html
    assert '<section id="headline">' in html


# ---------------------------------------------------------------------------------------------------- untrusted
def _plan(tuned_sweep: Path) -> dict:
    return json.loads((tuned_sweep / "tuned.json").read_text())


def _rename_every_job(plan: dict) -> None:
    for entry in plan["configurations"]:
        for item in [*entry["tune"], *entry["seeds"]]:
            item["job"] = item["job"].replace("/", "/gone_")


BAD_PLANS = [
    ("configurations[0].tune[0].job", lambda p: p["configurations"][0]["tune"][0].update(job="../../etc")),
    ("configurations[1].seeds[1].job", lambda p: p["configurations"][1]["seeds"][1].update(job="/etc/passwd")),
    ("configurations[0].tune[1].job", lambda p: p["configurations"][0]["tune"][1].update(job="tune/../seeds/7_x")),
    ("configurations[0].tune[2].value", lambda p: p["configurations"][0]["tune"][2].update(value="0.9")),
    ("seeds", lambda p: p.update(seeds="1,2")),
    ("configurations", lambda p: p.update(configurations={"a": 1})),
    ("tune_seed", lambda p: p.update(tune_seed=True)),
    ("grid.lr", lambda p: p.update(grid={"lr": [{"a": 1}]})),
    ("configurations[2].best.lr", lambda p: p["configurations"][2].update(best={"lr": 5})),
    ("configurations[1].seeds[0].job", lambda p: p["configurations"][1]["seeds"][0].update(job="seeds/4_x")),
    ("format", lambda p: p.update(format=2)),
    ("not a readable JSON object", lambda p: "[1, 2]"),
    ("none of its jobs is a run folder found here", _rename_every_job),
]


@pytest.mark.parametrize(("field", "spoil"), BAD_PLANS, ids=[f for f, _ in BAD_PLANS])
def test_a_spoilt_tuned_json_is_ignored_with_a_problem_naming_the_field(tuned_sweep: Path, field, spoil) -> None:
    plan = copy.deepcopy(_plan(tuned_sweep))
    text = spoil(plan) or json.dumps(plan)
    runs = load_runs(tuned_sweep)
    original = (tuned_sweep / "tuned.json").read_text()
    try:
        (tuned_sweep / "tuned.json").write_text(text)
        found = find_tuned(runs, tuned_sweep)
    finally:
        (tuned_sweep / "tuned.json").write_text(original)
    assert found.sweeps == []
    (problem,) = found.problems
    assert problem.startswith(f"{tuned_sweep / 'tuned.json'}: ") and field in problem and "ignored" in problem


def test_a_job_outside_the_sweep_is_never_followed(tuned_sweep: Path, tmp_path: Path, capsys) -> None:
    """``job: ../../etc`` points at a real run folder outside the page's folder: the plan is ignored with one
    warning (on stderr and on the page), that folder is never read, and the sweep's runs show as an ordinary
    sweep."""
    root = tmp_path / "root"
    shutil.copytree(tuned_sweep, root / "sweep")
    write_run(tmp_path / "etc", "decoy", 0.003, 0, val=1.0, acc=1.0, bpc=0.1)
    plan = _plan(root / "sweep")
    plan["configurations"][0]["tune"][0]["job"] = "../../etc"
    (root / "sweep" / "tuned.json").write_text(json.dumps(plan))
    assert dashboard.main([str(root), "-o", str(tmp_path / "page.html")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab-dashboard: warning: ") and "tuned.json" in err[0]
    assert "configurations[0].tune[0].job '../../etc' is not a folder inside the sweep's" in err[0]
    html = (tmp_path / "page.html").read_text()
    assert "decoy" not in html and '<p class="protocol">' not in html and '<section id="tuning">' not in html
    assert '<p class="meta warn">Warning: ' in html and "15 runs" in html


def test_a_folder_with_a_tuned_sweep_and_an_ordinary_one(tuned_sweep: Path, tmp_path: Path) -> None:
    """The tuned sweep's headline uses its seed runs; the other sweep's runs get a headline of their own."""
    shutil.copytree(tuned_sweep, tmp_path / "tuned")
    for i, (variant, acc) in enumerate([("dot", 0.4), ("dot", 0.5), ("rope", 0.6), ("rope", 0.7)]):
        write_run(tmp_path / "plain" / f"{i}_{variant}", variant, 0.003, i % 2, val=acc, acc=acc, bpc=1.0)
    html = build_html(load_runs(tmp_path), root=tmp_path)
    section = _section(html, "headline")
    assert section.index("<h3>Tuned sweep tuned</h3>") < section.index("<h3>Other runs (not tuned)</h3>")
    other = section[section.index("Other runs") :]
    assert "Best val/acc_best: rope, 65.0 %" in html_lib.unescape(other)
    assert "scaled_dot" not in other
    assert _section(html, "pareto").count('class="plot"') == 2


# ---------------------------------------------------------------------------------------------------- CLI
def test_csv_and_terminal_table_have_the_compute_columns(tuned_sweep: Path, tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "old", "dot", 0.003, 0, val=0.5, acc=0.5, bpc=1.0, compute=False)
    runs = [*load_runs(tuned_sweep), *load_runs(tmp_path / "old")]
    out = dashboard.write_csv(runs, tmp_path / "runs.csv")
    header = next(csv.reader(out.open()))
    start = header.index("params")
    assert header[start : start + 7] == ["params", "state_size", "params_non_embedding", "flops_per_token",
                                         "tokens_seen", "step_time_s", "status"]  # fmt: skip
    rows = {r["run"]: r for r in csv.DictReader(out.open())}
    row = rows["seeds/9_lr=0.003,seed=1,variant=scaled_dot"]
    assert (row["params"], row["state_size"], row["params_non_embedding"]) == ("1000", "8000", "900")
    assert (float(row["flops_per_token"]), row["tokens_seen"], float(row["step_time_s"])) == (2e6, "102400", 0.05)
    assert [rows["old"][k] for k in ("flops_per_token", "tokens_seen", "step_time_s", "state_size")] == [""] * 4
    dashboard.print_table(runs)
    lines = capsys.readouterr().out.splitlines()
    header_line = next(line for line in lines if "FLOPs/tok" in line)
    assert header_line.split()[-3:] == ["FLOPs/tok", "status", "time"]
    assert any(line.split()[:1] == ["scaled_dot"] and " 2M " in line for line in lines)
    assert any(line.split()[:1] == ["dot"] and " 1M " in line for line in lines)
    assert si_number(704572.0) == "705k" and spec_for("flops_per_token").format(1.2e9) == "1.2G"


# ---------------------------------------------------------------------------------------------------- browser
PROBE = """window.addEventListener('load', function () {
  var out = [];
  function texts(div, selector) {
    return Array.prototype.map.call(div.querySelectorAll(selector), function (n) { return n.textContent; });
  }
  document.querySelectorAll('section#tuning div.plot, section#pareto div.plot').forEach(function (div) {
    out.push({section: div.closest('section').id, svg: !!div.querySelector('svg.main-svg'),
      names: (div.data || []).map(function (t) { return t.name; }),
      points: div.querySelectorAll('.scatterlayer .point').length,
      frontier: div.querySelectorAll('.scatterlayer .js-line').length,
      xtitles: texts(div, '[class^="g-x"][class$="title"]'), ytitles: texts(div, '[class^="g-y"][class$="title"]'),
      types: Object.keys(div._fullLayout).filter(function (k) { return /^xaxis\\d*$/.test(k); }).sort()
        .map(function (k) { return div._fullLayout[k].type; })});
  });
  document.body.setAttribute('data-probe', JSON.stringify(out));
});"""


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
def test_the_tuning_and_pareto_charts_render_in_headless_chromium(tuned_html: str, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium not installed: apt-get install chromium")
    probe = tmp_path / "probe.html"
    probe.write_text(tuned_html.replace("</body>", f"<script>{PROBE}</script></body>"))
    started = time.perf_counter()
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=10000", "--window-size=1400,1000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    assert time.perf_counter() - started < 60
    errors = re.search(r'<div id="js-errors">(.*?)</div>', proc.stdout, re.S)  # errors.js: errors, CSP violations
    assert errors is not None and errors.group(1).strip() == "", errors.group(1) if errors else proc.stdout[:500]
    assert "Uncaught" not in proc.stderr and "Content Security Policy" not in proc.stderr, proc.stderr[-2000:]
    got = json.loads(html_lib.unescape(re.search(r'<body[^>]*data-probe="([^"]*)"', proc.stdout).group(1)))
    tuning, pareto = got
    assert tuning["section"] == "tuning" and pareto["section"] == "pareto"
    assert tuning["svg"] and tuning["types"] == ["log"] and tuning["xtitles"] == ["lr"]
    assert tuning["names"] == [*sorted(TUNE), "failed", "chosen"] and tuning["points"] == 8 + 1 + 3
    assert tuning["ytitles"] == ["val/acc_best: accuracy (%)"]
    assert pareto["svg"] and pareto["types"] == ["log"] * 8
    assert pareto["names"] == [*sorted(TUNE), "Pareto frontier"] * 8 and pareto["points"] == 3 * 8
    assert pareto["frontier"] == 8  # (a frontier's line: the only line in these panels)
    assert pareto["xtitles"][:4] == [
        "flops_per_token: training FLOPs per token (FLOPs)",
        "params: trainable parameters",
        "state_size: state per sequence, all layers (floats)",
        "wall_time_s: wall time (s)",
    ]
    assert set(pareto["ytitles"]) == {"test/acc: accuracy (%)", "test/bpc: bits per byte (bits/byte)"}


# ---------------------------------------------------------------------------------------------------- issue 40
def test_a_tuned_json_nested_200000_deep_costs_one_warning(tuned_sweep: Path, tmp_path: Path, capsys) -> None:
    root = tmp_path / "sweep"
    shutil.copytree(tuned_sweep, root)
    (root / "tuned.json").write_text("[" * 200_000 + "]" * 200_000)
    found = find_tuned(load_runs(root), root)
    (problem,) = found.problems
    assert problem.startswith(f"{root / 'tuned.json'}: ") and "nested too deeply" in problem and not found.sweeps
    assert dashboard.main([str(root), "-o", str(tmp_path / "page.html")]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("attnlab-dashboard: warning: ") and "tuned.json" in line and "nested too deeply" in line


def test_a_chosen_point_at_the_grids_edge_is_flagged(tuned_html: str) -> None:
    """dot's best lr (0.01) is the grid's largest and additive's (0.001) its smallest: both flagged; scaled_dot's
    (0.003) lies inside. Computed from grid and best: this tuned.json has no "edge" field."""
    from attnlab.stats import grid_edges

    rows = re.findall(r"<tr><td class=\"t\">(\w+)</td><td class=\"t\">(.*?)</td>", _section(tuned_html, "headline"))
    points = {name: html_lib.unescape(point) for name, point in rows}
    assert points["dot"] == "lr=0.01 (at the grid's edge: widen it)"
    assert points["additive"] == "lr=0.001 (at the grid's edge: widen it)"
    assert points["scaled_dot"] == "lr=0.003"
    grid = {"lr": [0.001, 0.003, 0.01], "wd": [0.0, 0.1], "act": ["relu", "gelu"], "one": [5]}
    assert grid_edges(grid, {"lr": 0.003, "wd": 0.1, "act": "gelu", "one": 5}) == ["wd"]
    assert grid_edges(grid, {"lr": 0.001, "wd": 0.0, "act": "relu", "one": 5}) == ["lr", "wd"]
    assert grid_edges(grid, None) == [] and grid_edges({"flag": [True, False]}, {"flag": True}) == []


def _pruning(value: float) -> dict[str, Any]:
    """A valid pruning.json of a 1-layer, 2-head model whose test accuracy is ``value`` before pruning."""
    curve = [{"removed": k, "acc": value - 0.1 * k} for k in range(3)]
    return {"metric": "acc", "num_layers": 1, "num_heads": 2, "importance": [[0.2, 0.1]],
            "curves": {"importance": [curve], "random": [curve]}}  # fmt: skip


def test_the_pruning_chart_of_a_tuned_sweep_shows_only_its_seed_runs(tuned_sweep: Path, tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    shutil.copytree(tuned_sweep, root)
    for summary in root.rglob("summary.json"):
        run = summary.parent
        config = json.loads((run / "config.yaml").read_text())
        at_best = config["lr"] == BEST[config["variant"]["name"]]
        (run / "pruning.json").write_text(json.dumps(_pruning(0.9 if at_best else 0.3)))
    html = build_html(load_runs(root), root=root)
    fig = _figure_by_id(html, "fig-pruning")
    names = {trace["name"].removesuffix(" · random") for trace in fig["data"]}
    assert names == {"scaled_dot · lr=0.003", "dot · lr=0.01", "additive · lr=0.001"}  # each at its chosen lr
    firsts = {trace["y"][0] for trace in fig["data"] if trace.get("y")}
    assert firsts == {0.9}  # no tuning run off its best point (0.3) is drawn
    assert "only the seed runs, at each configuration's chosen point" in html


def _figure_by_id(html: str, div: str) -> dict:
    found = re.search(rf'<script type="application/json" id="{div}-json">(.*?)</script>', html, re.S)
    return json.loads(found.group(1))


def test_the_pareto_markers_have_a_legend(tmp_path: Path) -> None:
    """Variant (colour) x heads (marker): each marker symbol has a legend entry saying which heads it stands for."""
    for i, (variant, heads) in enumerate(itertools.product(("dot", "additive"), (2, 4))):
        for seed in (0, 1):
            write_run(tmp_path / f"{i}_{seed}", variant, 0.003, seed, val=0.5, acc=0.5 + 0.1 * i + 0.01 * seed,
                      bpc=1.0, extra={"num_heads": heads})  # fmt: skip
    runs = load_runs(tmp_path)
    sweep = dashboard.Sweep(runs)
    fig = figures_module.pareto_figure(runs, sweep, ["test/acc"], ["flops_per_token"])
    legend = {t["name"]: t["marker"]["symbol"] for t in fig["data"] if t["name"].startswith("marker: ")}
    assert set(legend) == {"marker: heads=2", "marker: heads=4"} and len(set(legend.values())) == 2
    for trace in fig["data"]:
        if trace["name"] in ("dot", "additive"):
            for symbol, text in zip(trace["marker"]["symbol"], trace["hovertext"], strict=True):
                assert legend[f"marker: heads={'2' if 'heads=2' in text else '4'}"] == symbol
