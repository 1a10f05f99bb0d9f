"""The run folder module (attnlab.runs): atomic writes with the user's umask, the summary's schema and its reading
of version-1 files, tolerant readers, the metrics file's row count, the folder lock, the sweep journal."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from attnlab.runs import (
    SCHEMA_VERSION,
    MetricsFile,
    RunFileError,
    RunFolder,
    RunFolderBusy,
    Segment,
    Summary,
    SweepJournal,
    atomic_open,
    load_run,
    read_metrics,
    write_json_atomic,
)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_writes_follow_the_umask_and_leave_no_temporary_file(tmp_path: Path, umask_022: None) -> None:
    write_json_atomic(tmp_path / "summary.json", {"a": 1.0, "b": float("nan")})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"a": 1.0, "b": None}
    assert mode(tmp_path / "summary.json") == 0o644  # mkstemp would give 0600
    os.umask(0o077)
    write_json_atomic(tmp_path / "private.json", {})
    assert mode(tmp_path / "private.json") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["private.json", "summary.json"]


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_open(path) as f:
        f.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_summary_round_trip_and_schema(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    summary = Summary(status="ok", variant="dot", metrics={"test/acc": 0.5}, best_checkpoint="checkpoints/best.ckpt")
    summary.segments.append(Segment("new", "2026-01-01T00:00:00+00:00", 0, ["lr=0.1"], status="ok", to_step=10))
    folder.write_summary(summary)
    data = json.loads(folder.summary_path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["segments"][0]["overrides"] == ["lr=0.1"]
    assert folder.read_summary() == summary


def test_a_version_1_summary_reads_with_relative_paths(tmp_path: Path) -> None:
    old = {
        "status": "ok",
        "run_dir": "/somewhere/else/run",
        "best_checkpoint": "/somewhere/else/run/checkpoints/best.ckpt",
        "resumed_from": "/somewhere/else/run/checkpoints/last.ckpt",
        "metrics": {"test/acc": 0.25},
        "an_old_key": 3,
    }
    summary = Summary.from_dict(old)
    assert summary.best_checkpoint == "checkpoints/best.ckpt" and summary.resumed_from == "checkpoints/last.ckpt"
    assert summary.schema_version == SCHEMA_VERSION and summary.metrics == {"test/acc": 0.25}


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("summary.json", "", r"summary.json is empty"),
        ("summary.json", '{"status": "ok", ', r"summary.json is not valid JSON"),
        ("summary.json", "[1, 2]", r"summary.json must be a JSON object"),
        ("config.yaml", "", r"config.yaml is empty"),
        ("config.yaml", "a: [1, 2", r"config.yaml is not valid YAML"),
    ],
)
def test_load_run_turns_a_bad_file_into_a_problem_of_that_run(
    tmp_path: Path, name: str, content: str, problem: str
) -> None:
    if name == "config.yaml":
        RunFolder(tmp_path).write_summary(Summary(status="ok", steps=2))
    (tmp_path / name).write_text(content)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 2}\n{"step": 2, "x"')
    run = load_run(tmp_path)
    assert len(run.problems) == 1 and __import__("re").search(problem, run.problems[0]), run.problems
    assert run.rows == [{"step": 1, "x": 2}]  # the torn last line is skipped
    if name == "summary.json":
        assert run.summary["status"] == "failed" and "unreadable summary.json" in run.summary["reason"]
    with pytest.raises(RunFileError):
        (RunFolder(tmp_path).read_summary if name == "summary.json" else RunFolder(tmp_path).read_config)()


def test_metrics_file_counts_rows_and_cuts_back(tmp_path: Path) -> None:
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    for step in range(5):
        metrics.append({"step": step, "x": float(step)})
    assert metrics.rows == 5
    metrics.close()
    with open(metrics.path, "a") as f:
        f.write('{"step": 5, "x": ')  # torn by a kill
    metrics = MetricsFile(metrics.path)
    assert metrics.rows == 5
    metrics.truncate(3)
    metrics.append({"step": 9, "x": float("inf")})
    assert [r["step"] for r in read_metrics(metrics.path)] == [0, 1, 2, 9] and metrics.rows == 4
    assert read_metrics(metrics.path)[-1]["x"] is None


def test_a_held_folder_refuses_a_second_writer_and_names_the_holder(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    with folder.lock("train.py lr=0.1"):
        assert folder.is_active() is True
        with pytest.raises(RunFolderBusy, match=rf"in use by pid {os.getpid()} on .* \(train\.py lr=0\.1\)"):
            with RunFolder(tmp_path / "run").lock():
                pass
    assert folder.is_active() is False
    with folder.lock():  # released: it can be taken again
        pass
    assert sorted(p.name for p in folder.path.iterdir()) == [".attnlab.lock"]  # the holder note is gone


def test_a_summary_left_running_reads_as_interrupted_once_nobody_holds_the_folder(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    with folder.lock():
        folder.write_summary(Summary(status="running"))
        assert load_run(tmp_path).summary["status"] == "running"
    loaded = load_run(tmp_path)
    assert loaded.summary["status"] == "interrupted" and "killed" in loaded.summary["reason"]


def test_overwrite_removes_what_the_run_wrote_and_nothing_else(tmp_path: Path) -> None:
    """The run's files, its two checkpoints, its maps, the CSV logger's files and its own W&B run (by its id) go;
    a user's files beside them, another W&B run and a link's target stay; emptied folders go."""
    folder = RunFolder(tmp_path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("keep")
    (tmp_path / "summary.json").write_text(json.dumps({"schema_version": 2, "status": "ok", "wandb_id": "ab12"}))
    written = ["config.yaml", "metrics.jsonl", "train.log", "wandb_id.txt", "checkpoints/best.ckpt"]
    written += ["checkpoints/last.ckpt", "attention/maps.png", "csv/metrics.csv", "csv/hparams.yaml"]
    written += ["wandb/offline-run-20260101_000000-ab12/run-ab12.wandb"]
    mine = ["notes.txt", "checkpoints/my_model.pt", "wandb/offline-run-20250101_000000-zz99/run-zz99.wandb"]
    for name in written + mine:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "wandb" / "latest-run").symlink_to(outside)
    assert folder.holds_run() and folder.is_run()
    folder.remove_run()
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(mine) and not folder.holds_run()
    assert not (tmp_path / "attention").exists() and not (tmp_path / "csv").exists()
    assert outside.read_text() == "keep"


def test_sweep_journal_counts_jobs_after_the_last_header(tmp_path: Path) -> None:
    journal = SweepJournal(tmp_path)
    journal.start(3)
    journal.record("0_a", "ok", None, 1.0)
    journal.start(2)  # the same sweep folder started again
    journal.record("0_a", "failed", "boom", 2.0)
    header, jobs = journal.read()
    assert header["jobs"] == 2 and [(j["job"], j["status"], j["reason"]) for j in jobs] == [("0_a", "failed", "boom")]


def test_load_run_names_missing_files(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("variant: dot\n")
    assert [p.split(": ")[0] for p in load_run(tmp_path).problems] == [str(tmp_path / "summary.json") + " is missing"]
    RunFolder(tmp_path).write_summary(Summary(status="ok", steps=10))
    (problem,) = load_run(tmp_path).problems
    assert problem.startswith(f"{tmp_path / 'metrics.jsonl'} is missing")


def test_csv_safe_keeps_text_from_starting_a_formula() -> None:
    """Issue 40: a run name or config value written to a CSV never starts a spreadsheet formula."""
    from attnlab.runs import csv_safe

    for text in ('=HYPERLINK("http://x")', "+1+1", "-2+3", "@SUM(A1)", "\t=1", "\r=1"):
        assert csv_safe(text) == "'" + text
    for text in ("dot", "lr=0.003", "", "a=b", "0.5", " =1"):
        assert csv_safe(text) == text


def test_load_yaml_untrusted_reads_plain_yaml_and_anchors_and_refuses_what_is_not(tmp_path: Path) -> None:
    from attnlab.runs import RunFileError, load_yaml_untrusted

    path = tmp_path / "config.yaml"
    path.write_text("base: &b {x: 1}\nother: *b\nmerged: {<<: *b, y: 2}\n")
    assert load_yaml_untrusted(path) == {"base": {"x": 1}, "other": {"x": 1}, "merged": {"x": 1, "y": 2}}
    assert load_yaml_untrusted(tmp_path / "named.yaml", text="a: 1\n") == {"a": 1}
    for text, what in (
        ("a: &a [*a]\n", "an alias refers to a node that contains it"),
        ("a: !!python/object/apply:os.system [echo]\n", "is not valid YAML"),
        ("a: [1\n", "is not valid YAML"),
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    ):
        with pytest.raises(RunFileError) as err:
            load_yaml_untrusted(path, text=text)
        assert str(err.value).startswith(f"{path} ") and what in str(err.value) and "\n" not in str(err.value)
