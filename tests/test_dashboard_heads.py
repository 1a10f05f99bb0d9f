"""The dashboard's view of what the heads do (attnlab.dashboard.heads): the head atlas, the pruning curves and rank
collapse against depth, on run folders written here with known values, and in headless Chromium."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from test_dashboard import _probe

from attnlab import dashboard
from attnlab.dashboard.heads import atlas, pruning_figure, rank_figure
from attnlab.dashboard.load import load_runs
from attnlab.stats import mean_ci

LAYERS, HEADS = 2, 2
# the final scores of each head: (0, 0) previous token, (0, 1) induction, (1, 0) local only, (1, 1) nothing
FINAL = {
    (0, 0): {"prev_token": 0.9, "duplicate": 0.02, "induction": 0.03, "local": 0.95},
    (0, 1): {"prev_token": 0.1, "duplicate": 0.2, "induction": 0.7, "local": 0.1},
    (1, 0): {"prev_token": 0.3, "duplicate": 0.05, "induction": 0.05, "local": 0.8},
    (1, 1): {"prev_token": 0.1, "duplicate": 0.1, "induction": 0.2, "local": 0.3},
}
IMPORTANCE = [[0.5, 2.0], [0.25, 0.0]]


def _rows(seed: int) -> list[dict]:
    """Diagnostics at steps 0, 10, ..., 50: each score grows linearly from 0 to its final value at step 50 (so
    it reaches 0.4 at the step 50 · 0.4 / final, rounded up to the next probe), then importance at step 50."""
    rows = []
    for step in range(0, 51, 10):
        row = {"step": step}
        for (layer, head), scores in FINAL.items():
            for name, value in scores.items():
                row[f"attn/L{layer}H{head}/{name}"] = value * step / 50
        for layer in range(LAYERS):
            row[f"attn/L{layer}/rank_residual"] = 0.9 - 0.3 * layer - 0.01 * seed
            row[f"attn/L{layer}/rank_residual_attn"] = 0.5 - 0.1 * layer + 0.02 * seed
        rows.append(row)
    rows.append({"step": 50, "test/acc": 0.8 + 0.01 * seed})
    rows.append(
        {"step": 50, **{f"attn/L{l}H{h}/importance": IMPORTANCE[l][h] for l in range(LAYERS) for h in range(HEADS)}}
    )
    return rows


def _curve(start: float, step: float) -> list[dict]:
    return [{"removed": k, "acc": round(start - step * k, 6), "loss": 1.0} for k in range(LAYERS * HEADS + 1)]


def write_heads_run(folder: Path, variant: str, seed: int, pruning: str | None = "ok") -> Path:
    """A finished run with per-head scores over training, rank collapse per layer and (``pruning``: ok, spoilt or
    None) a pruning.json whose importance curve drops 0.05 and random curves 0.1 and 0.2 per head removed."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(
        f"variant:\n  name: {variant}\n  params: {{}}\ntask:\n  name: associative_recall\n  datamodule: {{}}\n"
        f"d_model: 16\nnum_heads: {HEADS}\nnum_layers: {LAYERS}\nseed: {seed}\nlr: 0.003\n"
    )
    summary = {
        "schema_version": 5,
        "status": "ok",
        "variant": variant,
        "task": "associative_recall",
        "num_heads": HEADS,
        "num_layers": LAYERS,
        "d_model": 16,
        "seed": seed,
        "steps": 50,
        "metrics": {"test/acc": 0.8 + 0.01 * seed, "val/acc_best": 0.8},
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(seed)))
    if pruning == "ok":
        start = 0.8 + 0.01 * seed
        data = {
            "schema_version": 1,
            "metric": "acc",
            "num_layers": LAYERS,
            "num_heads": HEADS,
            "importance": IMPORTANCE,
            "curves": {"importance": [_curve(start, 0.05)], "random": [_curve(start, 0.1), _curve(start, 0.2)]},
        }
        (folder / "pruning.json").write_text(json.dumps(data))
    elif pruning == "spoilt":
        (folder / "pruning.json").write_text('{"metric": "<script>", "curves": 3}')
    return folder


@pytest.fixture(scope="module")
def heads_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scaled_dot and linear, seeds 0 and 1, and a third linear run whose pruning.json is spoilt."""
    root = tmp_path_factory.mktemp("heads") / "sweep"
    job = 0
    for variant in ("scaled_dot", "linear"):
        for seed in (0, 1):
            write_heads_run(root / f"{job}_variant={variant},seed={seed}", variant, seed)
            job += 1
    write_heads_run(root / f"{job}_variant=linear,seed=2", "linear", 2, pruning="spoilt")
    return root


def test_atlas_names_each_head_with_its_importance_and_the_step_its_type_formed(heads_sweep: Path) -> None:
    run = load_runs(heads_sweep)[0]
    cells = atlas(run)
    got = {(c.layer, c.head): (c.type, c.score, c.importance, c.formed_at) for row in cells for c in row}
    # the score reaches 0.4 at step 50·0.4/final: 0.9 → 22.2 (probe 30), 0.7 → 28.6 (probe 30), 0.8 → 25 (probe 30)
    assert got[0, 0] == ("prev_token", pytest.approx(0.9), 0.5, 30.0)
    assert got[0, 1] == ("induction", pytest.approx(0.7), 2.0, 30.0)
    assert got[1, 0] == ("local", pytest.approx(0.8), 0.25, 30.0)
    assert got[1, 1][0] == "none" and got[1, 1][3] is None
    assert atlas(run, threshold=0.85)[0][0].formed_at == 50.0


def test_pruning_chart_averages_seeds_and_random_orders(heads_sweep: Path) -> None:
    runs = load_runs(heads_sweep)
    from attnlab.dashboard.dims import Sweep

    fig = pruning_figure(runs, Sweep(runs))
    traces = {t["name"]: t for t in fig["data"]}
    assert set(traces) == {"scaled_dot", "scaled_dot · random", "linear", "linear · random"}
    start = (0.80 + 0.81) / 2
    assert traces["scaled_dot"]["x"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert traces["scaled_dot"]["y"] == pytest.approx([start - 0.05 * k for k in range(5)])
    assert traces["scaled_dot · random"]["y"] == pytest.approx([start - 0.15 * k for k in range(5)])
    assert traces["linear"]["customdata"][0] == 2  # the run with a spoilt pruning.json is left out
    assert traces["scaled_dot · random"]["line"]["dash"] == "dot"
    spoilt = next(r for r in runs if r.seed == 2)
    assert spoilt.pruning is None and any("metric must be acc or bpc" in p for p in spoilt.problems)


def test_rank_chart_is_the_mean_over_seeds_against_depth(heads_sweep: Path) -> None:
    runs = load_runs(heads_sweep)
    from attnlab.dashboard.dims import Sweep

    fig = rank_figure(runs, Sweep(runs))
    after = next(t for t in fig["data"] if t["xaxis"] == "x" and t["name"] == "scaled_dot")
    alone = next(t for t in fig["data"] if t["xaxis"] == "x2" and t["name"] == "scaled_dot")
    assert after["x"] == [1, 2]
    assert after["y"] == pytest.approx([0.895, 0.595])
    assert alone["y"] == pytest.approx([0.51, 0.41])
    assert after["error_y"]["array"][0] == pytest.approx(mean_ci([0.9, 0.89])[1])
    linear = next(t for t in fig["data"] if t["xaxis"] == "x" and t["name"] == "linear")
    assert linear["customdata"] == [3, 3]  # the spoilt pruning.json does not hide its rank collapse


def test_page_has_the_heads_section_and_names_a_spoilt_pruning_file(heads_sweep: Path, tmp_path: Path) -> None:
    out = dashboard.write_dashboard(heads_sweep, tmp_path / "page.html")
    html = out.read_text()
    assert '<section id="atlas"><h2>What the heads do</h2>' in html
    assert 'id="fig-pruning"' in html and 'id="fig-rank"' in html
    assert len(re.findall(r'data-target="atlas-\d+"', html)) == 2  # one atlas per variant, with a run selector
    assert "<script>" not in html.split('id="atlas"')[1].split("</section>")[0].replace("<script type=", "")


def test_runs_without_head_scores_say_why(tmp_path: Path) -> None:
    from test_dashboard import write_run

    write_run(tmp_path / "sweep" / "0_run", "scaled_dot", 16, 0)
    html = dashboard.write_dashboard(tmp_path / "sweep", tmp_path / "page.html").read_text()
    section = html.split('<section id="atlas">')[1].split("</section>")[0]
    # nothing to show: the section is one line (issue 61), naming what is missing
    assert section.startswith('<p class="empty"><b>What the heads do</b>: no run logged head-type scores')
    assert "pruning.json" in section and "rank collapse" in section and "<h2>" not in section


@pytest.mark.slow
def test_head_atlas_renders_in_headless_chromium(heads_sweep: Path, tmp_path: Path) -> None:
    """The atlas, the pruning chart and the rank chart in a real browser: each gets its SVG and its traces, the
    atlas shows its type labels, no JS error."""
    html = dashboard.write_dashboard(heads_sweep, tmp_path / "page.html").read_text()
    got, dom = _probe(html, tmp_path)
    figures = {f["id"]: f for f in got["figures"]}
    atlases = [f for name, f in figures.items() if name.startswith("atlas-")]
    assert len(atlases) == 2 and all(f["svg"] and f["traces"] == 1 for f in atlases)
    assert figures["fig-pruning"]["svg"] and figures["fig-pruning"]["traces"] == 4
    assert figures["fig-rank"]["svg"] and figures["fig-rank"]["traces"] == 4
    labels = re.findall(r'<g class="heatmap-label">.*?</text>', dom, re.S)  # the atlas's, and the heatmaps' above
    texts = [t for t in labels if "imp " in t]  # the atlas's: one per head of each variant, drawn in the SVG
    assert len(texts) == 2 * LAYERS * HEADS
    shown = " ".join(re.sub(r"<[^>]+>", " ", t) for t in texts)
    for label in ("previous token 0.9", "induction 0.7", "local 0.8", "imp 2"):
        assert label in shown, shown[:500]
    assert not math.isnan(figures["fig-pruning"]["widths"][0])
