"""``--dry-run``: the plan of a run, a sweep and a tuned sweep with each job's steps, tokens, FLOPs and estimated
time, written nowhere; the estimate's formula; the sweep's "left" line and its closing estimated-against-actual line
from the per-job estimates; the head step's ``auto`` default (issue 40)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers import run_cli, run_train
from omegaconf import OmegaConf

TINY = ("d_model=16", "num_heads=2", "num_layers=1", "debug=fast", "logger=none", "diagnostics.heatmaps=false")


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _rows(stdout: str) -> list[list[str]]:
    """The table's body rows as cells (rich's box-drawing table; a cell folded over several lines joined)."""
    rows: list[list[str]] = []
    for line in stdout.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            if rows and not cells[0]:  # a folded cell's next line
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
            else:
                rows.append(cells)
    return rows


def test_a_single_run_dry_run_prints_its_steps_tokens_flops_and_minutes_and_writes_nothing(tmp_path):
    proc = run_cli(*TINY, "--dry-run", cwd=tmp_path, returncode=0, ATTNLAB_CACHE_DIR=str(tmp_path / "cache"))
    assert "dry run: python train.py" in proc.stdout and "a single run of 1 job(s)" in proc.stdout
    assert "nothing was run or written" in proc.stdout
    (row,) = _rows(proc.stdout)
    number, label, steps, tokens, flops, step_s, est = row
    assert number == "0" and steps == "5" and "d_model=16" in label  # debug=fast: 5 steps of batch 16, 64 pixels
    assert re.fullmatch(r"[\d.]+M", flops)  # the training step's FLOPs, counted as a run counts them
    assert tokens == "5.12k"  # 5 · 16 · 64
    assert float(step_s) > 0 and re.fullmatch(r"\d+:\d\d", est)
    assert re.search(r"estimated: \d+:\d\d in all", proc.stdout)
    assert _files(tmp_path) == ["cache", "cache/step_times.json"]  # the step-time cache, and nothing else


def test_a_sweep_dry_run_lists_every_job_with_its_varying_keys_uncut(tmp_path):
    long_value = "a_label_long_enough_that_a_narrow_table_would_cut_it_if_it_could_" * 2
    proc = run_cli(
        "-m",
        *TINY,
        "variant=dot,scaled_dot",
        "d_k=4,8",
        f"+tag={long_value}",
        "--dry-run",
        cwd=tmp_path,
        returncode=0,
        ATTNLAB_CACHE_DIR=str(tmp_path / "cache"),
        COLUMNS="80",
    )
    rows = _rows(proc.stdout)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]  # Hydra's order: the last key varies fastest
    labels = " | ".join(r[1] for r in rows)
    for expected in ("variant=dot d_k=4", "variant=dot d_k=8", "variant=scaled_dot d_k=4", "variant=scaled_dot d_k=8"):
        assert expected in labels
    assert "+tag" not in labels  # the same in every job: not a varying key
    assert "a sweep of 4 job(s)" in proc.stdout and not (tmp_path / "multirun").exists()


def test_a_tuned_sweep_dry_run_shows_the_grid_the_seeds_and_the_seed_jobs(tmp_path):
    proc = run_cli(
        "-m",
        "hydra/sweeper=tuned",
        *TINY,
        "variant=dot,scaled_dot",
        "hydra.sweeper.grid.lr=[1e-3,1e-2]",
        "hydra.sweeper.seeds=[0,1,2]",
        "--dry-run",
        cwd=tmp_path,
        returncode=0,
        ATTNLAB_CACHE_DIR=str(tmp_path / "cache"),
    )
    assert "a tuned sweep of 8 job(s)" in proc.stdout  # 2 configurations × (2 grid points + 2 seeds; seed 0 reused)
    assert "on seed 0" in proc.stdout and "on seeds [0, 1, 2]" in proc.stdout
    stages = [r[2] for r in _rows(proc.stdout)]
    assert stages == ["tune"] * 4 + ["seeds"] * 4
    assert not (tmp_path / "multirun").exists()


def test_a_dry_run_of_a_job_that_would_be_refused_says_why_in_one_line(tmp_path):
    proc = run_cli(*TINY, "d_k=0", "--dry-run", cwd=tmp_path, returncode=2, ATTNLAB_CACHE_DIR=str(tmp_path / "c"))
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: ") and "d_k" in proc.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("dry", [True, False])
def test_a_sweep_whose_fixed_override_needs_a_swept_group_is_refused_in_one_line(tmp_path, dry):
    """Hydra builds a sweep's config from its fixed overrides with the swept groups at their defaults: a fixed key of
    the swept variants that the default variant lacks fails there (several lines of Hydra's) although every job
    composes. attnlab refuses it first, in one line, for the sweep and its dry run alike; sweeping the key passes."""
    bad = ("-m", "variant=deltanet,gated_deltanet", "variant.params.beta_range=2", *TINY)
    proc = run_cli(*bad, *(["--dry-run"] if dry else []), cwd=tmp_path, returncode=2, ATTNLAB_CACHE_DIR=str(tmp_path))
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: the sweep cannot start")
    assert "variant=deltanet,gated_deltanet" in proc.stderr and "beta_range" in proc.stderr
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()
    from attnlab.training.plan import check_sweep_config

    check_sweep_config(["variant=deltanet,gated_deltanet", "variant.params.beta_range=1,2"])  # swept too: composes
    check_sweep_config(["variant=deltanet", "variant.params.beta_range=2", "d_k=8,16"])  # the variant fixed


def test_the_estimate_is_the_documented_sum():
    """steps · t + evaluations · (val batches + 1) · t_eval + test batches · t_eval + the head step + t_job."""
    from attnlab.training.plan import EVAL_FRACTION, JOB_OVERHEAD_S, estimate_job

    class Data:
        batch_size, num_val, num_test = 16, 100, 50

    cfg = OmegaConf.create(
        {
            "max_steps": 300,
            "eval_every": 100,
            "num_heads": 4,
            "num_layers": 2,
            "smoke": False,
            "trainer": {"limit_val_batches": None, "limit_test_batches": 2},
            "diagnostics": {"enabled": True, "importance": "auto", "random_orders": 1},
        }
    )
    t = 0.02
    evals, val, test = 4, 7, 2  # ceil(300/100) + the step-0 probe; ceil(100/16); the trainer's limit
    without = 300 * t + evals * (val + 1) * t * EVAL_FRACTION + test * t * EVAL_FRACTION + JOB_OVERHEAD_S
    assert math.isclose(estimate_job(cfg, Data(), t, multirun=True), without)  # auto: no head step in a sweep
    head = val * t + (1 + 8) * 2 * test * t * EVAL_FRACTION
    assert math.isclose(estimate_job(cfg, Data(), t, multirun=False), without + head)


def test_the_left_line_and_the_closing_line_use_the_per_job_estimates():
    from attnlab.training.sweep import _estimate_line, _estimated_left

    estimates = {"0": 10.0, "1": 100.0, "2": 30.0}
    done = [{"job": "0_variant=dot", "wall_time_s": 12.0}]
    assert _estimated_left(estimates, done) == 130.0  # not 2 × the mean of the finished jobs (24 s)
    assert _estimated_left(None, done) is None
    assert _estimated_left({"0": "x", "1": -1, "2": float("nan")}, done) is None  # a hand-edited header: nothing
    done += [{"job": "1_variant=x", "wall_time_s": 90.0}, {"job": "tune/2_lr=0.1", "wall_time_s": 33.0}]
    line = _estimate_line({"estimates": estimates}, done)
    assert line == "time: estimated 2:20 for the 3 job(s), took 2:15 (0.96× the estimate)"


def test_the_head_step_is_off_by_default_in_sweeps_and_smoke_runs_and_says_how_to_turn_it_on():
    from attnlab.training.plan import head_step_on

    cfg = OmegaConf.create({"smoke": False, "diagnostics": {"enabled": True, "importance": "auto"}})
    assert head_step_on(cfg, multirun=False) and not head_step_on(cfg, multirun=True)
    cfg.smoke = True
    assert not head_step_on(cfg, multirun=False)
    cfg.diagnostics.importance = True
    assert head_step_on(cfg, multirun=True)


@pytest.mark.slow
def test_a_real_sweep_reports_its_estimate_and_no_head_step_by_default(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m", *TINY, "variant=dot,scaled_dot", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
        ATTNLAB_CACHE_DIR=str(tmp_path / "cache"), ATTNLAB_SWEEP_ESTIMATE="1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "head importance and pruning: off in a sweep (diagnostics.importance=true turns it on)" in proc.stdout
    assert re.search(r"job 1/2 done \(ok\), \d+:\d\d elapsed, ~\d+:\d\d left \(estimated\)", proc.stdout)
    assert re.search(
        r"time: estimated \d+:\d\d for the 2 job\(s\), took \d+:\d\d \([\d.]+× the estimate\)", proc.stdout
    )
    header = json.loads((sweep / "sweep.jsonl").read_text().splitlines()[0])
    assert set(header["estimates"]) == {"0", "1"}
    assert not list(sweep.rglob("pruning.json"))


def test_a_sweeps_jobs_table_shows_the_varying_keys_first_variant_first_and_never_cuts_them(tmp_path, capsys):
    from attnlab.runs import SweepJournal
    from attnlab.training import sweep

    names = [
        f"{n}_d_k={dk},max_steps=200,variant={v}"
        for n, (v, dk) in enumerate([("gated_deltanet", 16), ("scaled_dot", 64)])
    ]
    assert sweep._varying(names) == [("0", "variant=gated_deltanet d_k=16"), ("1", "variant=scaled_dot d_k=64")]
    journal = SweepJournal(tmp_path)
    journal.start(2)
    for name in names:
        journal.record(name, "ok", None, 1.0)
    import os

    os.environ["COLUMNS"] = "50"  # a narrow terminal: cells fold, none is cut with an ellipsis
    try:
        sweep._report(tmp_path)
    finally:
        del os.environ["COLUMNS"]
    out = capsys.readouterr().out
    assert "…" not in out
    flat = "".join(line.strip("│┃ ") for line in out.splitlines())
    assert "gated_deltanet" in flat.replace("│", "").replace(" ", "")
