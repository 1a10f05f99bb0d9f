"""What a newcomer met walking through the README (issue 26): a parallel sweep's interleaved lines and its final
table, the text task's bpc in the results, W&B's config and steps, Lightning's sync_dist warning under DDP, and a
command's output piped to ``head``. Real runs throughout: training on tiny data, W&B offline read back from disk,
subprocesses for the command lines."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from helpers import read_summary, run_folders
from hydra import compose, initialize_config_dir

from attnlab.runs import RunFolder, SweepJournal, read_metrics
from attnlab.training import CONF_DIR, run, sweep

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("ATTNLAB_UID", "HYDRA_FULL_ERROR", "WANDB_MODE"):
        env.pop(key, None)
    return env


def _train(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------------------------------ parallel sweeps


def test_the_sweep_table_lists_the_jobs_in_job_order_not_finish_order(tmp_path: Path, capsys) -> None:
    journal = SweepJournal(tmp_path)
    journal.start(11)
    for job in ("10_lr=0.1", "2_lr=0.2", "0_lr=0.3", "1_lr=0.4"):  # as parallel jobs finish
        journal.record(job, "ok" if job != "2_lr=0.2" else "failed", None, 1.0)
    sweep._report(tmp_path)
    out = capsys.readouterr().out
    rows = [m.group(1) for m in re.finditer(r"^│ +(\d+) │ lr=", out, re.M)]
    assert rows == ["0", "1", "2", "10"]
    assert "3 ok, 1 failed" in out and sweep.failed_jobs() == 1


@pytest.mark.slow
def test_a_joblib_sweep_names_the_job_on_each_progress_line_and_reports_in_job_order(tmp_path: Path) -> None:
    """Two parallel jobs under hydra/launcher=joblib: each progress line names its job, the final table is in job
    order whatever order they finished in, both jobs finish in one sweep folder, share the launch id drawn by the
    parent, and split the cores between them (threads=auto).

    Which job finishes first is up to the machine (job #1 trains fewer steps, but the fixed costs of a run and the
    workers' start dominate on a loaded machine), so the table's order is checked against a journal written out of
    order in ``test_the_sweep_table_lists_the_jobs_in_job_order_not_finish_order``, not against this race."""
    proc = _train(
        "-m",
        "max_steps=30,5",
        "eval_every=5",
        "debug=fast",
        "logger=none",
        "results_table=false",
        "diagnostics.heatmaps=false",  # (the attention maps' plot: not what is tested here)
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir='{tmp_path}/sweep_${{attnlab_uid:}}'",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"^(\S*) · step (\d+)/(\d+) · ", proc.stdout, re.M)
    assert {(job, total) for job, _, total in steps} == {("#0", "30"), ("#1", "5")}
    assert len(steps) == 6 + 1
    (sweep_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("sweep_")]
    _, finished = SweepJournal(sweep_dir).read()
    assert sorted(job["job"].split("_")[0] for job in finished) == ["0", "1"]
    table = re.findall(r"^│ +(\d+) │ max_steps=\d+ +│ ok ", proc.stdout, re.M)
    assert table == ["0", "1"]
    summaries = [read_summary(f) for f in run_folders(sweep_dir)]
    assert sorted(s["steps"] for s in summaries) == [5, 30]
    for summary in summaries:
        assert summary["launch_id"] == sweep_dir.name.removeprefix("sweep_"), "a job did not inherit the launch id"
        assert summary["threads"] == max(1, (os.cpu_count() or 1) // 2)


# ------------------------------------------------------------------------------------------ results


def test_the_text_task_reports_its_bpc_in_the_results_line_and_tables(tmp_path: Path, capsys) -> None:
    job = tmp_path / "0_task=text"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["task=text", "debug=fast", "logger=none", "diagnostics.enabled=false"])
    run(cfg, job)
    summary = RunFolder(job).read_summary()
    test_bpc = f"{summary.metrics['test/bpc']:.3f}"
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "best val acc" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")][-2:] == ["test bpc", "time"]
    assert re.search(rf"│ +{re.escape(test_bpc)} │ +[\d.]+ s │", out)
    assert f", test bpc {test_bpc}, 5 steps" in (job / "train.log").read_text()  # the results line

    journal = SweepJournal(tmp_path)
    journal.start(2)
    journal.record(job.name, "ok", None, 1.0)
    journal.record("1_task=text", "failed", "a job that wrote no summary", 1.0)
    sweep._report(tmp_path)
    out = capsys.readouterr().out
    assert re.search(r"┃ job ┃ varying keys ┃ status ┃ best val acc ┃ test acc ┃ test bpc ┃ wall time ┃", out)
    assert re.search(rf"│ +0 │ task=text +│ ok +│ .* │ +{re.escape(test_bpc)} │ +1\.0 s │", out)
    assert re.search(r"│ +1 │ task=text +│ failed +│ +- │ +- │ +- │ +1\.0 s │", out)


# ------------------------------------------------------------------------------------------ set-up


def test_pyproject_declares_its_license_as_an_spdx_expression_without_a_deprecation_warning() -> None:
    pyprojecttoml = pytest.importorskip("setuptools.config.pyprojecttoml")
    from packaging.requirements import Requirement
    from packaging.version import Version
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # setuptools >= 77 warns about the TOML-table form
        dist = pyprojecttoml.apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert dist.metadata.license_expression == "MIT"
    # the build requires a setuptools that reads an SPDX expression (77, PEP 639)
    requires = pyprojecttoml.read_configuration(REPO / "pyproject.toml")["build-system"]["requires"]
    (setuptools,) = [Requirement(r) for r in requires if Requirement(r).name == "setuptools"]
    assert Version("76.1") not in setuptools.specifier and Version("77.0.0") in setuptools.specifier


# ------------------------------------------------------------------------------------------ DDP


# ------------------------------------------------------------------------------------------ W&B


def _wandb_records(run_dir: Path) -> list[dict]:
    """The records of the run's single offline W&B run, read by wandb's own reader."""
    (offline,) = sorted((run_dir / "wandb").glob("offline-run-*"))
    wandb_cli = Path(sys.executable).parent / "wandb"
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(offline)], capture_output=True, text=True, check=True
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[dict]]:
    """A digits run (validations at steps 5 and 10) with W&B offline: (its folder, its output, its W&B records)."""
    folder = tmp_path_factory.mktemp("wandb") / "run"
    overrides = ["debug=fast", "max_steps=10", "eval_every=5", "logger=wandb", "logger.mode=offline"]
    overrides.append("diagnostics.heatmaps=false")  # (the maps' plot and its W&B image: not what is tested here)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        run(cfg, folder)
    assert RunFolder(folder).read_summary().status == "ok"
    return folder, out.getvalue(), _wandb_records(folder)


@pytest.mark.slow
def test_wandb_config_is_the_hydra_config_once_with_the_tasks_chance_accuracy(wandb_run) -> None:
    folder, _, records = wandb_run
    config: dict = {}
    for record in records:  # the config given at init, then every update (Lightning's log_hyperparams: fit, test)
        update = record["run"]["config"] if record["type"] == "run" else record.get("config")
        if record["type"] in ("run", "config") and update:
            config.update(update["update"])
    config.pop("_wandb", None)
    hydra_config = yaml.safe_load((folder / "config.yaml").read_text())
    summary = RunFolder(folder).read_summary()
    assert summary.chance_accuracy == pytest.approx(0.1)  # digits: 1 / 10 classes
    assert summary.d_k == 16  # d_k: null in config.yaml, d_model // num_heads
    assert config == {**hydra_config, "d_k": summary.d_k, "chance_accuracy": summary.chance_accuracy}


@pytest.mark.slow
def test_validation_is_logged_at_the_steps_the_console_prints(wandb_run) -> None:
    folder, out, records = wandb_run
    printed = [int(step) for step in re.findall(r"^step (\d+)/10 · ", out, re.M)]
    assert printed == [5, 10]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [row["trainer/global_step"] for row in history if "val/acc" in row] == printed
    rows = read_metrics(folder / "metrics.jsonl")
    assert [row["step"] for row in rows if "val/acc" in row] == printed
    # the diagnostics and the test already counted the steps done, and still do; the training loss at step k is that
    # of the weights after k updates, from step 0
    assert [row["step"] for row in rows if "attn/entropy" in row] == [0, 10]
    assert [row["step"] for row in rows if "test/acc" in row] == [10]
    assert [row["step"] for row in rows if "train/loss" in row] == list(range(10))


# ------------------------------------------------------------------------------------------ | head


def _piped(args: list[str], until: str | None) -> tuple[int, str]:
    """Run ``args`` with stdout into a pipe whose reader goes away (as ``| head`` does) once it has read a line
    containing ``until``, or before reading anything: (exit code, stderr)."""
    proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if until is not None:
        for line in proc.stdout:
            if until in line:
                break
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    return proc.wait(timeout=600), err


def _quiet(err: str) -> bool:
    return not any(noise in err for noise in ("Traceback", "BrokenPipe", "Broken pipe", "Exception ignored"))


@pytest.mark.slow
def test_output_piped_to_head_ends_quietly_and_leaves_a_finished_run_finished(tmp_path: Path) -> None:
    # train: the reader goes after the last validation line, before the results table
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", "debug=fast", "logger=none", f"hydra.run.dir={run_dir}"]
    code, err = _piped(cmd, until="step 5/5")
    assert _quiet(err), err
    summary = RunFolder(run_dir).read_summary()
    assert (code, summary.status) == (0, "ok")  # the run was finished when its table could not be shown
    assert re.search(r"ok: best val acc .*, 5 steps", (run_dir / "train.log").read_text())

    # a sweep without results tables: the reader goes before the job's last lines (run folder, job 1/1 done)
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "debug=fast", "logger=none", "results_table=false"]
    code, err = _piped([*cmd, f"hydra.sweep.dir={sweep_dir}"], until="step 5/5")
    assert _quiet(err), err
    assert code == 0 and [job["status"] for job in SweepJournal(sweep_dir).read()[1]] == ["ok"]

    # the dashboard: its table's first line is read (| head -1); the page and the CSV are written all the same
    cmd = [sys.executable, "-m", "attnlab.dashboard", str(run_dir), "--csv", str(tmp_path / "runs.csv")]
    code, err = _piped(cmd, until="")
    assert _quiet(err), err
    assert code in (0, 1) and (run_dir / "dashboard.html").exists() and (tmp_path / "runs.csv").exists()

    # the bench: nothing is read
    cmd = [sys.executable, "-m", "attnlab.bench", "--quick", "--only", "fused", "--out", str(tmp_path / "bench")]
    code, err = _piped(cmd, until=None)
    assert _quiet(err), err
    assert code == 1 and (tmp_path / "bench" / "bench.json").exists()


@pytest.mark.slow
def test_a_run_whose_output_goes_away_during_training_ends_as_interrupted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, err = _piped([sys.executable, "train.py", "debug=fast", "logger=none", f"hydra.run.dir={run_dir}"], None)
    assert _quiet(err), err
    summary = RunFolder(run_dir).read_summary()
    assert (code, summary.status) == (130, "interrupted")  # as after Ctrl-C: resume=true continues it
    log = (run_dir / "train.log").read_text()
    assert "(new run)" in log and "resume with: python train.py resume=true" in log
