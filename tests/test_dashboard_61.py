"""Issue 61: the dashboard reads a comparison as the user meant it, with one headline metric.

On real runs (tiny: parity, debug=fast, d_model 16, two layers of two heads, shared by module fixtures):

* a sweep over five forms whose presets set different layer defaults (kda and deltaproduct ``model.short_conv=4``,
  rwkv7 ``2``, gated_deltanet and scaled_dot none) is one configuration per model: short_conv is an attribute of
  the model, never the main key; the headline has one column and every model is compared with the winner;
* the two ways short_conv became a dimension before: a run's command line that *restates* a preset
  (``variant=kda model.short_conv=4``, now an attribute again) and one that *changes* it
  (``variant=gated_deltanet model.short_conv=4``: a row of its own, but never the main key);
* ``--config-keys``;
* a tuned sweep: "Who wins" and "Final metrics" count the same runs (the seed runs);
* categorical x is points, numeric x lines; every configuration's validation curve on one shared axis;
* the state-tracking headline is the accuracy at the longest test length (the task declares it), in the page, the
  terminal table and the results table at the end of a run;
* a section with nothing to show is one line.
"""

from __future__ import annotations

import html as html_lib
import io
import json
import re
from pathlib import Path

import pytest
from helpers import run_train
from rich.console import Console

from attnlab import dashboard
from attnlab.dashboard import Sweep, build_html, load_runs, main
from attnlab.dashboard.load import Run, task_headline
from attnlab.dashboard.page import Options, headline_metrics
from attnlab.dashboard.stats import headline
from attnlab.runs import RunFolder
from attnlab.tasks import task_class
from attnlab.training.console import headline_metric, results_line, results_table

FORMS = ("kda", "gated_deltanet", "deltaproduct", "rwkv7", "scaled_dot")
SHORT_CONV = {"kda": 4, "gated_deltanet": None, "deltaproduct": 4, "rwkv7": 2, "scaled_dot": None}
SMALL = (
    "task=parity",
    "debug=fast",
    "d_model=16",
    "num_heads=2",
    "logger=none",
    "threads=1",
    "results_table=false",
    "diagnostics.heatmaps=false",
    "task.datamodule.test_lengths=[48,64]",
)
"""Every fixture run: parity with two test lengths beyond its training length (32), a smoke run's size."""
LONGEST = "test/acc@64"


def _train(folder: Path, *args: str) -> Path:
    run_train("-m", *args, *SMALL, f"hydra.sweep.dir='{folder}'", wandb="disabled", full_error=True, timeout=600,
              returncode=0)  # fmt: skip
    return folder


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's comparison, two seeds: ``variant=kda,gated_deltanet,deltaproduct,rwkv7,scaled_dot`` (10 runs)."""
    return _train(tmp_path_factory.mktemp("forms") / "sweep", f"variant={','.join(FORMS)}", "seed=0,1")


@pytest.fixture(scope="module")
def conv_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """``model.short_conv=4`` on the command line, seed 0: kda (its preset's value: restated) and gated_deltanet
    (none in its preset: changed); by variant."""
    folder = _train(tmp_path_factory.mktemp("conv") / "sweep", "variant=kda,gated_deltanet", "model.short_conv=4")
    return {run.model: run for run in load_runs(folder)}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tuned sweep of two forms over lr {1e-3, 3e-3} on seed 0, compared on seeds 0 (the tuning run at the best
    point, reused) and 1: 4 tuning runs and 2 seed runs."""
    return _train(
        tmp_path_factory.mktemp("tuned") / "sweep",
        "hydra/sweeper=tuned",
        "hydra.sweeper.grid={lr:[1e-3,3e-3]}",
        "hydra.sweeper.seeds=[0,1]",
        "variant=gated_deltanet,scaled_dot",
    )


@pytest.fixture(scope="module")
def forms_runs(forms: Path) -> list[Run]:
    return load_runs(forms)


@pytest.fixture(scope="module")
def forms_html(forms: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    return dashboard.write_dashboard(forms, tmp_path_factory.mktemp("forms_page") / "page.html").read_text()


@pytest.fixture(scope="module")
def tuned_html(tuned: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    return dashboard.write_dashboard(tuned, tmp_path_factory.mktemp("tuned_page") / "page.html").read_text()


def _section(html: str, anchor: str) -> str:
    start = html.index(f'<section id="{anchor}">')
    return html[start : html.index("</section>", start)]


def _figures(html: str, anchor: str) -> dict[str, dict]:
    """The figures a section draws, by div id."""
    out = {}
    for div in re.findall(r'data-figure="([\w-]+)-json"', _section(html, anchor)):
        found = re.search(rf'<script type="application/json" id="{div}-json">(.*?)</script>', html, re.S)
        out[div] = json.loads(found.group(1))
    return out


def _headline_table(html: str, metric: str) -> str:
    section = _section(html, "headline")
    start = section.index(f'<table class="headline" data-metric="{metric}">')
    return section[start : section.index("</table>", start)]


def _text(fragment: str) -> str:
    return html_lib.unescape(re.sub(r"<[^>]+>", " ", fragment))


# ---------------------------------------------------------------------------------------------------- 1. a model
def test_a_sweep_over_forms_is_one_configuration_per_model(forms_runs: list[Run]) -> None:
    """short_conv differs between the forms only because their presets set it: an attribute of each model, not
    a dimension; no main key, one headline column, every other model compared with the winner."""
    assert len(forms_runs) == 10 and all(run.ok for run in forms_runs)
    assert {run.model: run.value("model.short_conv") for run in forms_runs} == SHORT_CONV
    sweep = Sweep(forms_runs)
    assert [d.key for d in sweep.dims] == ["variant.name"]
    assert sweep.derived["model.short_conv"] == "variant.name"
    assert sweep.preset_keys == frozenset() and sweep.main_dim() is None
    assert sweep.column_dim() is None and sweep.column_dim("variant") is None  # --x variant: one column too
    table = headline(forms_runs, sweep, LONGEST, sweep.column_dim())
    assert table.columns == [None] and [label for label, _ in table.rows] == sorted(FORMS)
    assert len(table.comparisons()) == len(FORMS) - 1  # every model against the winner
    assert "only configuration" not in table.sentence()
    rwkv7 = next(key for label, key in table.rows if label == "rwkv7")
    assert "short_conv=2" in table.attributes[rwkv7]
    with pytest.raises(ValueError, match=r"'short_conv' is an attribute here \(set by each variant's preset\)"):
        sweep.main_dim("short_conv")  # (--x short_conv: says what it is and how to make it a key)
    assert Sweep(forms_runs, config_keys=["variant", "short_conv"]).main_dim("short_conv").key == "model.short_conv"


def test_the_page_shows_each_model_with_its_attributes(forms: Path, forms_html: str, tmp_path: Path) -> None:
    """The header lists each model's preset settings; the headline has one column, a row per model with what its
    preset set beside it, no short_conv column; --x variant reads the same, never "the only configuration"."""
    header = _text(forms_html[: forms_html.index("<nav>")])
    assert "Attributes of each model" in header and "rwkv7 : normalizer=none · short_conv=2" in header
    table = _headline_table(forms_html, LONGEST)
    assert re.findall(r"<th>([^<]*)</th>", table) == ["all runs"]
    rows = [html_lib.unescape(r) for r in re.findall(r'<tr><td class="t">([^<]*)</td>', table)]
    assert rows == sorted(FORMS)
    assert "short_conv=4" in re.search(r'<tr><td class="t">kda</td>(.*?)</tr>', table).group(1)
    assert "short_conv=" not in _text(re.search(r"<thead>(.*?)</thead>", table).group(1))
    out = tmp_path / "x_variant.html"
    assert main([str(forms), "-o", str(out), "--x", "variant"]) == 0
    assert "only configuration there" not in out.read_text()
    assert re.findall(r"<th>([^<]*)</th>", _headline_table(out.read_text(), LONGEST)) == ["all runs"]


def test_a_command_line_that_restates_a_preset_changes_nothing(forms_runs: list[Run], conv_runs: dict) -> None:
    """Why short_conv was a dimension before: any run whose command line set it (a folder of sweeps where one
    spelled out kda's ``model.short_conv=4``) made it a dimension of every run, and so the main key. A value equal
    to its model's preset value (in the runs that did not set it) is an attribute still."""
    runs = [*forms_runs, conv_runs["kda"]]
    sweep = Sweep(runs)
    assert [d.key for d in sweep.dims] == ["variant.name"] and "model.short_conv" in sweep.derived
    assert sweep.main_dim() is None and sweep.column_dim() is None
    kda = [r for r in runs if r.model == "kda"]
    assert len(kda) == 3 and len({sweep.key_of(r, sweep.dims) for r in kda}) == 1  # one configuration


def test_a_command_line_that_changes_a_preset_is_a_row_never_the_main_key(
    forms_runs: list[Run], conv_runs: dict
) -> None:
    """``variant=gated_deltanet model.short_conv=4`` beside the five presets: short_conv now tells two
    gated_deltanet configurations apart (a row each), but it is the presets' key: not the main key (it was: columns
    short_conv=2, 4 and null, rwkv7 alone in its column), not the columns, not the panels."""
    runs = [*forms_runs, conv_runs["gated_deltanet"]]
    sweep = Sweep(runs)
    assert [d.key for d in sweep.dims] == ["variant.name", "model.short_conv"]
    assert sweep.preset_keys == {"model.short_conv"}
    assert sweep.main_dim() is None and sweep.column_dim() is None and sweep.facet_dim(None) is None
    assert sweep.main_dim("short_conv").key == "model.short_conv"  # (asked for: it is still a key that varies)
    table = headline(runs, sweep, LONGEST, sweep.column_dim())
    labels = [label for label, _ in table.rows]
    assert "gated_deltanet · short_conv=4" in labels and "gated_deltanet · short_conv=null" in labels
    assert len(labels) == 6 and len(table.comparisons()) == 5
    html = build_html(runs)
    assert "set by each model's preset and changed on some run's command line" in _text(html[: html.index("<nav>")])


def test_config_keys_name_what_a_configuration_is(forms: Path, forms_runs, conv_runs, tmp_path, capsys) -> None:
    """``--config-keys variant``: only the model defines a configuration; the ablation's short_conv is pooled into
    gated_deltanet (and the page says so); a name that is no key, or none, is one error line (exit 2)."""
    runs = [*forms_runs, conv_runs["gated_deltanet"]]
    sweep = Sweep(runs, config_keys=["variant"])
    assert [d.key for d in sweep.dims] == ["variant.name"] and sweep.config_keys == ("variant.name",)
    assert sweep.pooled == {"model.short_conv": (2, 4, None)} and sweep.derived["normalizer.name"] == "variant.name"
    assert Sweep(runs, config_keys=["model"]).config_keys == ("variant.name",)
    assert [d.key for d in Sweep(runs, config_keys=["variant.name", "short_conv"]).dims] == [
        "variant.name",
        "model.short_conv",
    ]
    html = build_html(runs, options=Options(config_keys=("variant",)))
    assert "Pooled: with --config-keys variant.name" in _text(html[: html.index("<nav>")])
    gdn = re.search(r'<tr><td class="t">gated_deltanet</td>(.*?)</tr>', _headline_table(html, LONGEST)).group(1)
    assert '<span class="n">(3)</span>' in gdn  # its two seeds and the ablation's run
    out = tmp_path / "page.html"
    assert main([str(forms), "-o", str(out), "--config-keys", "variant"]) == 0
    capsys.readouterr()
    assert main([str(forms), "-o", str(out), "--config-keys", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nope' is not a config key" in err[0] and "allowed:" in err[0] and "variant" in err[0]
    assert main([str(forms), "-o", str(out), "--config-keys", ","]) == 2
    assert "--config-keys names no key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--config-keys" in capsys.readouterr().out
    assert "--config-keys" in (Path(__file__).parent.parent / "docs" / "dashboard.md").read_text()


def test_the_model_is_summary_json_s_model_first() -> None:
    """summary.json's ``model`` (recorded by the run) names the model before the command line's ``variant=``; a
    ``custom`` model names none (the score's name does)."""
    config = {"variant": {"name": "scaled_dot", "params": {}}, "model": {"pos_encoding": "rope"}}
    run = Run(Path("r"), "r", config, {"status": "ok", "model": "rope", "overrides": ["variant=diff"]})
    assert run.model == "rope" and run.flat["variant.name"] == "rope"
    run = Run(Path("r"), "r", config, {"status": "ok", "overrides": ["variant=rope"]})
    assert run.model == "rope"
    run = Run(Path("r"), "r", config, {"status": "ok", "model": "custom", "overrides": ["variant.name=scaled_dot"]})
    assert run.model == "scaled_dot"


# ---------------------------------------------------------------------------------------------------- 2. tuned
def test_who_wins_and_final_metrics_count_the_same_runs(tuned: Path, tuned_html: str) -> None:
    """A tuned sweep: every configuration's headline cell and its final-metrics point are the mean of the same
    runs (its seed runs: the reused tuning run on seed 0 and seed 1), the x axis is the model (lr names no
    configuration there), and the section says which runs it counts."""
    runs = load_runs(tuned)
    assert len(runs) == 6
    table = _headline_table(tuned_html, LONGEST)
    cells = {}
    for variant in ("gated_deltanet", "scaled_dot"):
        row = re.search(rf'<tr><td class="t">{variant}</td>(.*?)</tr>', table).group(1)
        cells[variant] = (re.search(r"<td[^>]*>([\d.]+) %", row).group(1), re.search(r"\((\d)\)", row).group(1))
    assert {n for _, n in cells.values()} == {"2"}
    final = _section(tuned_html, "final")
    assert "only the 4 seed runs" in _text(final) and "the 2 other tuning runs are in Tuning" in _text(final)
    fig = next(iter(_figures(tuned_html, "final").values()))
    assert fig["layout"]["xaxis"]["ticktext"] == ["gated_deltanet", "scaled_dot"]
    for trace in (t for t in fig["data"] if t["yaxis"] == "y"):  # the first panel: the headline metric
        (y,) = trace["y"]
        (hover,) = trace["hovertext"]
        assert f"{100 * y:.1f}" == cells[trace["name"]][0] and "(n=2)" in hover, (trace["name"], y, cells)


# ---------------------------------------------------------------------------------------------------- 3. points
def test_categorical_points_are_markers_and_numeric_ones_lines(forms_html: str, tmp_path: Path) -> None:
    """x = the model: points with error bars, one trace (and legend entry) per model, never joined; x = d_k:
    lines."""
    fig = next(iter(_figures(forms_html, "final").values()))
    first = [t for t in fig["data"] if t["yaxis"] == "y"]
    assert sorted(t["name"] for t in first) == sorted(FORMS)
    assert all(t["mode"] == "markers" and t["error_y"]["visible"] for t in fig["data"] if t.get("error_y"))
    from test_dashboard import write_run

    for d_k in (8, 64):
        for seed in (0, 1):
            write_run(tmp_path / "dk" / f"{d_k}_{seed}", "scaled_dot", d_k, seed)
    html = build_html(load_runs(tmp_path / "dk"))
    numeric = next(iter(_figures(html, "final").values()))
    assert {t["mode"] for t in numeric["data"] if t.get("error_y")} == {"lines+markers"}


# ---------------------------------------------------------------------------------------------------- 4. curves
def test_every_configuration_s_validation_curve_is_on_one_axis(forms_html: str) -> None:
    """The training-curves section opens with the validation curves of all five models on one shared axis per
    metric (one mean line per configuration in each panel, accuracy first); the other curves are no longer a panel
    per variant."""
    figs = _figures(forms_html, "curves")
    shared = figs["fig-validation"]
    titles = [a["text"] for a in shared["layout"]["annotations"] if a.get("text", "").startswith("val/")]
    assert titles == ["val/acc", "val/loss"]
    for axis in ("y", "y2"):
        means = [t for t in shared["data"] if t["yaxis"] == axis and t.get("fill") != "toself"]
        assert sorted(t["name"] for t in means) == sorted(FORMS)
    (others,) = [f for div, f in figs.items() if div != "fig-validation"]
    panel_titles = [a["text"] for a in others["layout"]["annotations"] if a.get("yref") == "paper"]
    assert not any(form in title for title in panel_titles for form in FORMS), panel_titles
    assert "val/acc" not in panel_titles  # (drawn once, in the shared chart)


# ---------------------------------------------------------------------------------------------------- 5. headline
def test_a_task_declares_its_headline_metric() -> None:
    """The base class's rule (the usual test metric), the state-tracking tasks' (the longest test length) and the
    dashboard's reading of it from a run's task name and config (no task built, an unknown task's default)."""
    for name in ("parity", "modular", "permutation"):
        cls = task_class(name)
        assert cls.headline_metric() == "test/acc" and cls.headline_metric([64, 256, 128]) == "test/acc@256"
    assert task_class("digits").headline_metric([64]) == "test/acc"  # (its lengths are a chart, not the result)
    assert task_class("text").headline_metric() == "test/bpc"
    assert task_headline("parity", [48, 64]) == LONGEST and task_headline("no_such_task", [48]) == "test/acc"
    assert task_headline("../../etc", [48], {"seq_len": [1, {"a": 2}]}) == "test/acc"
    summary = {"status": "ok", "task": "parity", "headline_metric": "x@1"}
    run = Run(Path("r"), "r", {"task": {"name": "parity"}}, summary)
    assert run.headline_metric == "x@1"  # recorded in summary.json: read first


def test_the_state_tracking_headline_is_the_longest_length(forms: Path, forms_runs, forms_html, capsys) -> None:
    """Parity with test lengths 48 and 64: the page leads with test/acc@64 (named the headline, with why), the
    terminal table's first metric column is it, and so is the results table's at the end of a run."""
    assert {run.headline_metric for run in forms_runs} == {LONGEST}
    assert headline_metrics(forms_runs)[:3] == [LONGEST, "val/acc_best", "test/acc"]
    section = _section(forms_html, "headline")
    first = re.search(r'<table class="headline" data-metric="([^"]+)"', section).group(1)
    assert first == LONGEST and "longest test length, L=64" in _text(section)
    assert section.index('<details class="also">') > section.index(f'data-metric="{LONGEST}"')
    assert "The headline is test/acc@64" in _text(_section(forms_html, "lengths"))
    dashboard.print_table(forms_runs)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "seed" in line)
    assert header.split()[:3] == ["variant", "seed", LONGEST] and f"headline: {LONGEST}" in out
    summary = RunFolder(forms_runs[0].path).read_summary()
    assert headline_metric(summary) == LONGEST
    text = io.StringIO()
    Console(file=text, width=250).print(results_table(summary))
    head = next(line for line in text.getvalue().splitlines() if "┃" in line)
    columns = [c.strip() for c in head.strip("┃ ").split("┃")]
    assert columns[columns.index("steps") + 1] == "★ test acc@64" and "headline: test acc@64" in text.getvalue()
    assert "test acc@64" in results_line(summary) and "(headline)" in results_line(summary)
    summary.headline_metric = "test/acc@48"  # (once summary.json records it: read first)
    assert headline_metric(summary) == "test/acc@48"


# ---------------------------------------------------------------------------------------------------- 6. empty
def test_a_section_with_nothing_to_show_is_one_line(forms_html: str) -> None:
    """No attention maps (diagnostics.heatmaps=false) and no pruning.json (a sweep): one line each, saying why;
    the section's link in the menu is muted."""
    maps = _section(forms_html, "maps")
    assert maps.startswith('<section id="maps"><p class="empty"><b>Attention maps</b>: no run saved attention maps')
    assert "<h2>" not in maps and "diagnostics.heatmaps=false" in maps
    assert '<a href="#maps" class="empty">' in forms_html
    atlas = _section(forms_html, "atlas")
    assert '<p class="empty"><b>Pruning</b>: no run wrote pruning.json' in atlas and "<h3>Pruning</h3>" not in atlas


def test_a_key_that_follows_the_model_is_never_the_main_key_whoever_set_it():
    """Three models with ``model.short_conv=4`` on their command lines beside rwkv7 at its preset's 2 (the pattern
    of experiments/state_tracking/run.sh): short_conv follows the model in every run, so a split by it would put
    rwkv7 alone in a column; it is a preset key, never the main key or the headline's columns."""
    from attnlab.dashboard.dims import Sweep

    runs = []
    for i, (variant, conv, given) in enumerate(
        [("kda", 4, True), ("deltanet", 4, True), ("scaled_dot", 4, True), ("rwkv7", 2, False)] * 2
    ):
        overrides = [f"variant={variant}", f"seed={i // 4}"] + (["model.short_conv=4"] if given else [])
        config = {"variant": {"name": variant}, "model": {"short_conv": conv}, "seed": i // 4}
        summary = {"status": "ok", "model": variant, "overrides": overrides, "metrics": {"test/acc": 0.5}}
        runs.append(Run(Path(f"r{i}"), f"r{i}", config, summary))
    sweep = Sweep(runs)
    assert "model.short_conv" in sweep.preset_keys or "model.short_conv" in sweep.derived
    assert sweep.main_dim() is None or sweep.main_dim().key != "model.short_conv"
    column = sweep.column_dim()
    assert column is None or column.key != "model.short_conv"
