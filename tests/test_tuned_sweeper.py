"""The tuned sweeper (``hydra/sweeper=tuned``): the grid stage, the best point read from the jobs' summaries, the
seeds stage at it, a failing grid point ranked last, and the resume of a half-done sweep, in a real subprocess; the
documented grid; every setting refused before anything is written; the sweep folder's lock; the exit code of a
sweep with no chosen point; the grid's edge; a job failed for a reason of the machine run again on resume."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_summary, run_cli, run_train

from attnlab.stats import grid_edges  # (the sweeper writes tuned.json's "edge" with it)
from attnlab.training.tuned import (
    TunedError,
    TunedSweeper,
    grid_points,
    infra_failure,
    rank_value,
    read_plan,
)

DOCUMENTED_GRID = "hydra.sweeper.grid={lr:[1e-3,1e-2],model.weight_decay:[0,0.1]}"
"""The grid line exactly as README.md, docs/fair.md and conf/hydra/sweeper/tuned.yaml write it."""
TINY = ("debug=fast", "max_steps=2", "eval_every=1", "diagnostics.enabled=false", "logger=none", "d_model=16",
        "num_heads=2")  # fmt: skip


def test_grid_points_first_key_slowest() -> None:
    assert grid_points({"lr": [1, 2], "wd": "0,0.1"}) == [
        {"lr": 1, "wd": "0"},
        {"lr": 1, "wd": "0.1"},
        {"lr": 2, "wd": "0"},
        {"lr": 2, "wd": "0.1"},
    ]


def test_rank_value_puts_failures_last_in_both_directions() -> None:
    assert rank_value(0.5, "maximize") > rank_value(0.1, "maximize") > rank_value(None, "maximize")
    assert rank_value(0.1, "minimize") > rank_value(0.5, "minimize") > rank_value(float("nan"), "minimize")
    assert rank_value("abc", "maximize") == -math.inf


@pytest.mark.parametrize(
    ("kwargs", "arguments", "message"),
    [
        ({"direction": "up"}, [], "must be maximize or minimize"),
        ({"grid": {}}, [], "grid is empty"),
        ({"seeds": []}, [], "seeds is empty"),
        ({"grid": {"seed": [0, 1]}}, [], "cannot tune seed"),
        ({}, ["variant=dot,additive", "seed=0,1"], "leave seed off"),
        ({}, ["lr=0.1"], "lr is tuned"),
        ({"grid": 5}, [], "not a mapping"),
        ({"grid": {"lr": []}}, [], "grid.lr is empty"),
        ({"grid": {"lr": [float("nan")]}}, [], "finite number"),
        ({"grid": {"lr": [0.1, 0.1]}}, [], "twice"),
        ({"grid": {"../x": [1]}}, [], "not a config key"),
        ({"seeds": ["abc"]}, [], "whole numbers"),
        ({"seeds": [1.5]}, [], "whole numbers"),
        ({"seeds": [1, 1]}, [], "listed twice"),
        ({"tune_seed": float("nan")}, [], "tune_seed"),
        ({"max_batch_size": "abc"}, [], "max_batch_size"),
        ({"max_batch_size": -1}, [], "max_batch_size"),
        ({"metric": "val/acc_bset"}, [], "val/acc_best"),
    ],
)
def test_bad_plans_are_refused_in_one_line(kwargs: dict, arguments: list[str], message: str) -> None:
    sweeper = TunedSweeper(**kwargs)
    with pytest.raises(TunedError, match=message) as info:
        sweeper.validate()
        sweeper._configurations(arguments)
    assert "\n" not in str(info.value)


def test_the_documented_grid_parses_and_plans(hydra_ctx) -> None:
    """The line README, docs/fair.md and tuned.yaml give composes (any key, not only lr), and plans 2 × 2 points."""
    from helpers import compose_cfg
    from omegaconf import OmegaConf

    for where in ("README.md", "docs/fair.md", "conf/hydra/sweeper/tuned.yaml"):
        assert DOCUMENTED_GRID.split("=", 1)[1] in (Path(__file__).parents[1] / where).read_text(), where
    cfg = compose_cfg("hydra/sweeper=tuned", DOCUMENTED_GRID, hydra_cfg=True)
    settings = {k: v for k, v in OmegaConf.to_container(cfg.hydra.sweeper).items() if k != "_target_"}
    sweeper = TunedSweeper(**settings)
    sweeper.validate()
    assert sweeper.grid == {"lr": [1e-3, 1e-2], "model.weight_decay": [0, 0.1]}
    assert len(grid_points(sweeper.grid)) == 4
    for given, grid in [
        ("hydra.sweeper.grid.lr=[1e-3,1e-2]", {"lr": [1e-3, 1e-2]}),  # one key of the default grid
        ("hydra.sweeper.grid={model.dropout:[0,0.1]}", {"model.dropout": [0, 0.1]}),  # a grid given whole replaces it
    ]:
        cfg = compose_cfg("hydra/sweeper=tuned", given, hydra_cfg=True)
        sweeper = TunedSweeper(**{k: v for k, v in cfg.hydra.sweeper.items() if k != "_target_"})
        sweeper.config = cfg
        sweeper.validate()
        assert sweeper.grid == grid, given


def test_grid_edges_numeric_keys_with_two_values_chosen_at_min_or_max() -> None:
    grid = {"lr": [1e-3, 3e-3, 1e-2], "wd": [0, 0.1], "one": [5], "norm": ["a", "b"], "flag": [True, False]}
    assert grid_edges(grid, {"lr": 3e-3, "wd": 0.1, "one": 5, "norm": "a", "flag": True}) == ["wd"]
    assert grid_edges(grid, {"lr": 1e-2, "wd": 0.05, "one": 5, "norm": "b", "flag": False}) == ["lr"]
    assert grid_edges(grid, {"lr": 1e-3, "wd": 0, "one": 5, "norm": "a", "flag": True}) == ["lr", "wd"]
    assert grid_edges({"lr": [1e-3, 1e-3 * 1.0]}, {"lr": 1e-3}) == []  # one distinct value
    assert grid_edges(grid, None) == []


def test_infra_failures_are_read_from_the_reason_a_run_records() -> None:
    """The reasons as the run writes them (lifecycle's one line of the exception): the disk full, out of memory and
    a kill are the machine's; a divergence or a refused setting is the configuration's."""
    from attnlab.training.lifecycle import _one_line

    disk = _one_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/checkpoints/last.ckpt"))
    assert infra_failure("failed", disk) == "disk full (ENOSPC)"
    assert infra_failure("failed", _one_line(MemoryError("the softmax kernel ran out of memory"))) == "out of memory"
    assert (
        infra_failure("failed", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB") == "out of memory"
    )
    assert infra_failure("failed", "the job was killed by signal 9 (SIGKILL)") == "killed by a signal"
    assert infra_failure("failed", "training diverged at step 3: loss is nan") is None
    assert infra_failure("failed", "lr must be a finite number >= 0, got -1") is None
    assert infra_failure("ok", disk) is None and infra_failure("failed", None) is None


def test_read_plan_survives_a_deeply_nested_file(tmp_path: Path) -> None:
    (tmp_path / "tuned.json").write_text("[" * 200_000 + "]" * 200_000)
    problems: list[str] = []
    assert read_plan(tmp_path, problems) is None
    assert len(problems) == 1 and "nested too deeply" in problems[0]


SWEEP = ("-m", "hydra/sweeper=tuned", "variant=scaled_dot,dot", *TINY)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("hydra.sweeper.grid={}", "grid is empty"),
        ("hydra.sweeper.grid=5", "grid=5 is not a mapping"),
        ("hydra.sweeper.grid={lr:[]}", "grid.lr is empty"),
        ("hydra.sweeper.grid={lr:[abc]}", "variant=scaled_dot with lr=abc: lr must be a finite number"),
        ("hydra.sweeper.grid={lr:[nan]}", "grid.lr holds nan"),
        ("hydra.sweeper.grid={lr:[0.01,-1]}", "variant=scaled_dot with lr=-1: lr must be a finite number >= 0"),
        ("hydra.sweeper.grid={model.weight_decay:[0,abc]}", "model.weight_decay=abc: model.weight_decay must be"),
        ("hydra.sweeper.grid={no_such_key:[1,2]}", "no_such_key=1: the job's config cannot be composed"),
        ("hydra.sweeper.seeds=[abc]", "seeds holds 'abc'"),
        ("hydra.sweeper.seeds=[1.5]", "seeds holds 1.5"),
        ("hydra.sweeper.seeds=[-1]", "on seed=-1: seed must be an integer"),
        ("hydra.sweeper.seeds=[]", "seeds is empty"),
        ("hydra.sweeper.tune_seed=nan", "tune_seed=nan"),
        ("hydra.sweeper.max_batch_size=abc", "max_batch_size='abc'"),
        ("hydra.sweeper.max_batch_size=-1", "max_batch_size=-1"),
        ("hydra.sweeper.direction=up", "maximize or minimize"),
        ("hydra.sweeper.metric=val/acc_bset", "not a metric a run reports: one of val/acc_best, val/acc, val/loss"),
        ("optimized_metric=val/acc_bset", "optimized_metric"),
    ],
)
def test_every_setting_is_checked_before_anything_is_written(tmp_path: Path, setting: str, message: str) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(*SWEEP, setting, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert not sweep.exists()  # no tuned.json, sweep.jsonl, lock or multirun.yaml: not even the folder


def test_a_refused_start_into_a_sweep_folder_changes_nothing_there(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.jsonl").write_text('{"jobs": 8, "started": 1}\n')
    (sweep / "tuned.json").write_text('{"format": 1}')
    before = {p.name: p.read_bytes() for p in sweep.iterdir()}
    proc = run_cli(*SWEEP, "hydra.sweeper.metric=val/acc_bset", f"hydra.sweep.dir={sweep}", returncode=2)
    assert len(proc.stderr.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in sweep.iterdir()} == before


def test_a_second_sweep_into_a_held_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    from attnlab.runs import RunFolder

    sweep = tmp_path / "sweep"
    with RunFolder(sweep).lock("train.py -m hydra/sweeper=tuned (the first sweep)"):
        proc = run_cli(*SWEEP, f"hydra.sweep.dir={sweep}", returncode=2)
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: the sweep folder {sweep} is in use by another sweep (pid {os.getpid()} ")
        assert socket.gethostname() in line and "(the first sweep)" in line
    assert not (sweep / "sweep.jsonl").exists() and not (sweep / "tuned.json").exists()
    assert not (sweep / "multirun.yaml").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_the_documented_grid_runs_its_edge_is_flagged_and_a_stale_lock_is_taken_over(
    tmp_path: Path, restore_process_state
) -> None:
    from attnlab.runs import HOLDER_FILE, LOCK_FILE

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / LOCK_FILE).write_text("")  # left by a sweep that was killed: its pid is gone
    holder = {"pid": _dead_pid(), "host": socket.gethostname(), "since": "2025-01-01T00:00:00+00:00", "command": "x"}
    (sweep / HOLDER_FILE).write_text(json.dumps(holder))
    proc = run_cli("-m", "hydra/sweeper=tuned", "variant=scaled_dot", *TINY, DOCUMENTED_GRID,
                   "hydra.sweeper.seeds=[0]", f"hydra.sweep.dir={sweep}", returncode=0)  # fmt: skip
    plan = json.loads((sweep / "tuned.json").read_text())
    assert plan["grid"] == {"lr": [0.001, 0.01], "model.weight_decay": [0, 0.1]} and plan["stage"] == "done"
    (config,) = plan["configurations"]
    points = [item["point"] for item in config["tune"]]
    assert points == [{"lr": a, "model.weight_decay": b} for a in (0.001, 0.01) for b in (0, 0.1)]
    for item in config["tune"]:  # each job ran at its point
        assert (
            f"weight_decay: {item['point']['model.weight_decay']}" in (sweep / item["job"] / "config.yaml").read_text()
        )
        assert read_summary(sweep / item["job"])["lr"] == item["point"]["lr"]
    # two values of each key: whatever point was chosen lies at the grid's edge of both
    assert config["best"] in points and config["edge"] == ["lr", "model.weight_decay"]
    chosen = [line for line in proc.stdout.splitlines() if line.startswith("tuned: variant=scaled_dot")]
    assert len(chosen) == 1 and "at the grid's edge: widen it" in chosen[0]
    assert f"lr={config['best']['lr']:g}" in chosen[0]
    assert not (sweep / HOLDER_FILE).exists()  # the lock was taken over, then let go


@pytest.mark.slow
def test_a_sweep_in_which_every_grid_point_failed_exits_1(tmp_path: Path, restore_process_state) -> None:
    sweep = tmp_path / "sweep"
    # lr=1e30 passes every check (a finite number >= 0) and diverges at the first step
    proc = run_cli("-m", "hydra/sweeper=tuned", "variant=scaled_dot", *TINY, "hydra.sweeper.grid={lr:[1e30]}",
                   "hydra.sweeper.seeds=[1]", f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every grid point failed; its seeds were not run" in proc.stderr
    plan = json.loads((sweep / "tuned.json").read_text())
    (config,) = plan["configurations"]
    assert config["best"] is None and config["seeds"] == [] and config["tune"][0]["status"] == "failed"
    assert "diverged" in config["tune"][0]["reason"]


@pytest.mark.slow
def test_a_grid_point_that_failed_for_the_machine_is_run_again_on_resume(tmp_path: Path, restore_process_state) -> None:
    """A grid point whose run failed with ENOSPC (the summary as the run writes it) is not ranked last: the resumed
    sweep names the reason and runs it again; a point that failed for its settings (a divergence) is not run again."""
    from attnlab.training.lifecycle import _one_line

    sweep = tmp_path / "sweep"
    args = ("-m", "hydra/sweeper=tuned", "variant=scaled_dot", *TINY, "hydra.sweeper.grid={lr:[0.01,1e30,0.001]}",
            "hydra.sweeper.seeds=[0]", f"hydra.sweep.dir={sweep}")  # fmt: skip
    run_cli(*args, returncode=0)
    plan = json.loads((sweep / "tuned.json").read_text())
    ok, diverged, full = plan["configurations"][0]["tune"]
    assert diverged["status"] == "failed" and ok["status"] == full["status"] == "ok"
    summary_path = sweep / full["job"] / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["status"] = "failed"
    summary["reason"] = _one_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(sweep / full["job"])))
    summary_path.write_text(json.dumps(summary))
    diverged_before = (sweep / diverged["job"] / "summary.json").read_bytes()

    proc = run_cli(*args, returncode=0)
    assert f"{full['job']}: failed: disk full (ENOSPC): running it again" in proc.stdout
    assert "job 1/1 done (ok)" in proc.stdout
    assert read_summary(sweep / full["job"])["status"] == "ok"
    assert (sweep / diverged["job"] / "summary.json").read_bytes() == diverged_before
    header, *rows = [json.loads(line) for line in (sweep / "sweep.jsonl").read_text().splitlines()][-2:]
    assert "jobs" in header and [r["job"] for r in rows] == [full["job"]]


def _journal_jobs(sweep: Path) -> list[str]:
    """The jobs recorded after the journal's last header (the last start of the sweep)."""
    jobs: list[str] = []
    for line in (sweep / "sweep.jsonl").read_text().splitlines():
        row = json.loads(line)
        jobs = [*jobs, row["job"]] if "job" in row else []
    return jobs


@pytest.mark.slow
def test_tuned_sweep_in_a_subprocess_picks_the_best_point_and_resumes(tmp_path: Path) -> None:
    sweep = tmp_path / "tuned"
    args = (
        "-m",
        "hydra/sweeper=tuned",
        "variant=scaled_dot,dot",
        "debug=fast",
        "max_steps=20",
        "eval_every=10",
        "diagnostics.enabled=false",
        "logger=none",
        "hydra.sweeper.grid={lr:[0,0.01,1e30]}",  # lr=0 does not learn; lr=1e30 diverges: a failed grid point
        "hydra.sweeper.seeds=[0,1]",
        f"hydra.sweep.dir={sweep}",
    )
    proc = run_train(*args, returncode=0)  # a failed grid point ranks last and does not fail the sweep
    assert "ranked last" in proc.stdout
    refused = run_train(*args[:3], "seed=0,1", f"hydra.sweep.dir={tmp_path / 'refused'}", returncode=2)
    assert refused.stderr.strip().splitlines() == [
        "error: a tuned sweep sets seed itself (tune_seed, then seeds): leave seed off the command line"
    ]
    plan = json.loads((sweep / "tuned.json").read_text())
    assert plan["stage"] == "done" and plan["metric"] == "val/acc_best" and plan["grid"] == {"lr": [0, 0.01, 1e30]}
    assert [c["label"] for c in plan["configurations"]] == ["variant=scaled_dot", "variant=dot"]
    for config in plan["configurations"]:
        # the best point, by hand from the summaries the tuning jobs wrote (a failed job ranks last)
        values = []
        for item in config["tune"]:
            summary = read_summary(sweep / item["job"])
            assert summary["seed"] == 0 and item["job"].startswith("tune/")
            ok = summary["status"] == "ok"
            values.append(summary["metrics"]["val/acc_best"] if ok else -1.0)
            assert item["status"] == summary["status"]
        assert read_summary(sweep / config["tune"][2]["job"])["status"] == "failed"  # lr=1e30
        best = max(range(len(values)), key=lambda k: (values[k], -k))
        assert config["best"] == config["tune"][best]["point"]
        # the chosen point, printed between the stages (before the first seed run), flagged at the grid's edge
        edge = config["best"]["lr"] in (0, 1e30)
        assert config["edge"] == (["lr"] if edge else [])
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith(f"tuned: {config['label']}: chose")]
        assert f"lr={config['best']['lr']:g}" in line and ("at the grid's edge: widen it" in line) == edge
        assert proc.stdout.index(line) < proc.stdout.index("seeds/")
        # the seeds stage ran at that point: seed 0 reuses the tuning run, seed 1 is a new job under seeds/
        assert [s["seed"] for s in config["seeds"]] == [0, 1]
        assert config["seeds"][0]["job"] == config["tune"][best]["job"]
        seed_run = read_summary(sweep / config["seeds"][1]["job"])
        assert config["seeds"][1]["job"].startswith("seeds/")
        assert seed_run["seed"] == 1 and seed_run["status"] == "ok" and seed_run["lr"] == config["best"]["lr"]
    assert len(_journal_jobs(sweep)) == 8  # 6 grid points + 2 seed runs
    assert not (sweep / ".attnlab.lock.json").exists()  # the sweep folder's lock was let go

    # half-done: one grid point and one seed run lost, one seed run interrupted
    first = plan["configurations"][0]
    shutil.rmtree(sweep / first["tune"][1]["job"])
    second = plan["configurations"][1]
    shutil.rmtree(sweep / second["seeds"][1]["job"])
    kept = sweep / first["seeds"][1]["job"] / "summary.json"
    summary = json.loads(kept.read_text())
    summary["status"] = "interrupted"
    kept.write_text(json.dumps(summary))
    untouched = sweep / second["tune"][0]["job"] / "summary.json"
    before = untouched.stat().st_mtime_ns
    proc = run_train(*args, returncode=0)
    assert "job 3/3 done" in proc.stdout, proc.stdout[-2000:]
    assert sorted(_journal_jobs(sweep)) == sorted(
        [first["tune"][1]["job"], second["seeds"][1]["job"], first["seeds"][1]["job"]]
    )
    assert untouched.stat().st_mtime_ns == before
    resumed = json.loads((sweep / "tuned.json").read_text())
    assert [c["best"] for c in resumed["configurations"]] == [c["best"] for c in plan["configurations"]]
    assert read_summary(sweep / first["seeds"][1]["job"])["status"] == "ok"
