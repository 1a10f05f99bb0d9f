"""The tuned sweeper (``hydra/sweeper=tuned``): the grid stage, the best point read from the jobs' summaries, the
seeds stage at it, a failing grid point ranked last, and the resume of a half-done sweep, in a real subprocess."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import read_summary, run_train

from attnlab.training.tuned import TunedError, TunedSweeper, grid_points, rank_value


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
    ],
)
def test_bad_plans_are_refused_in_one_line(kwargs: dict, arguments: list[str], message: str) -> None:
    sweeper = TunedSweeper(**kwargs)
    with pytest.raises(TunedError, match=message) as info:
        sweeper.validate()
        sweeper._configurations(arguments)
    assert "\n" not in str(info.value)


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
        "hydra.sweeper.grid={lr:[0,0.01,-1]}",  # lr=0 does not learn; lr=-1 is refused: a failed grid point
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
    assert plan["stage"] == "done" and plan["metric"] == "val/acc_best" and plan["grid"] == {"lr": [0, 0.01, -1]}
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
        assert read_summary(sweep / config["tune"][2]["job"])["status"] == "failed"  # lr=-1
        best = max(range(len(values)), key=lambda k: (values[k], -k))
        assert config["best"] == config["tune"][best]["point"]
        # the seeds stage ran at that point: seed 0 reuses the tuning run, seed 1 is a new job under seeds/
        assert [s["seed"] for s in config["seeds"]] == [0, 1]
        assert config["seeds"][0]["job"] == config["tune"][best]["job"]
        seed_run = read_summary(sweep / config["seeds"][1]["job"])
        assert config["seeds"][1]["job"].startswith("seeds/")
        assert seed_run["seed"] == 1 and seed_run["status"] == "ok" and seed_run["lr"] == config["best"]["lr"]
    assert len(_journal_jobs(sweep)) == 8  # 6 grid points + 2 seed runs

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
