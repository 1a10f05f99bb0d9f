"""A run folder, a name and an override value are untrusted input (issue 25): a folder received from someone else
runs no code, no link in it is followed, ``overwrite=true`` deletes only what a run wrote, names print as text, an
interrupted extension cannot be resumed shorter, a mistyped file costs one warning, and job folders stay inside
their sweep. Each test does what the finding did (a real ``python train.py`` where the finding used one) and
asserts what the user now sees. Finding 8 (values that escaped validation) is in ``test_cli.py``'s bad inputs, and
the interrupted multirun is at the end of this file.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO, read_summary, run_cli, run_train, train_cmd, train_env
from hydra import compose

from attnlab import training as T
from attnlab.console import printable
from attnlab.dashboard.cli import main as dashboard_main
from attnlab.runs import MetricsFile, RunFileError, RunFolder, atomic_open
from attnlab.training import sweep
from attnlab.training.cli import with_run_overrides
from attnlab.training.config import ConfigError

SMALL = ("debug=fast", "d_model=16", "num_heads=2", "num_layers=1", "logger=none", "results_table=false")
NO_MAPS = "diagnostics.heatmaps=false"  # for runs whose attention maps no test looks at (the plot is most of a run)

pytestmark = pytest.mark.usefixtures("restore_process_state")


def _one_error_line(proc: subprocess.CompletedProcess | str) -> str:
    """The single ``error: ...`` line of a refused command (no traceback)."""
    err = proc if isinstance(proc, str) else proc.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in err
    return lines[0]


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every file under ``folder`` (links as their target, never read through), to show nothing changed."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[p.relative_to(folder).as_posix()] = f"-> {os.readlink(p)}"
        elif p.is_file() and not p.name.startswith(".attnlab.lock"):
            out[p.relative_to(folder).as_posix()] = p.read_bytes()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 5-step run made by ``python train.py`` (so that its summary holds its overrides); a subprocess, so
    every test that uses it is marked slow."""
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = run_train(*SMALL, f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, symlinks=True)
    return dest


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------------------- 1. a folder is data, never code


@pytest.mark.slow
def test_resume_never_imports_code_that_the_run_folder_names(finished: Path, tmp_path: Path) -> None:
    """A folder holding ``evil.py`` and ``imports=[...evil]`` in config.yaml and its last segment's overrides: the
    resume is refused in one line naming the modules, exit 2, the payload never ran and no file changed. With only
    summary.json edited, its imports are not re-applied: the finished run says it is complete, and nothing ran."""
    run = _copy(finished, tmp_path / "outputs" / "r1" / "run")
    marker = tmp_path / "payload-ran"
    (run / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    module = "outputs.r1.run.evil"
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace("imports: []", f"imports:\n- {module}"))

    def add_imports(summary: dict) -> None:
        summary["segments"][-1]["overrides"].append(f"imports=[{module}]")
        summary["overrides"].append(f"imports=[{module}]")

    _edit_json(run / "summary.json", add_imports)
    before = _snapshot(run)
    proc = run_train("resume=true", f"hydra.run.dir={run}", PYTHONPATH=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc)
    assert f"imports=[{module}]" in line and "never imports code that a run folder names" in line
    assert not marker.exists()
    assert _snapshot(run) == before

    (run / "config.yaml").write_text(config)  # only summary.json names the module now
    proc = run_train("resume=true", f"hydra.run.dir={run}", PYTHONPATH=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is complete" in proc.stdout and not marker.exists()


def test_a_resume_reapplies_only_values_from_the_folder(tmp_path: Path) -> None:
    """Of a folder's recorded overrides, a resume puts back values; ``imports`` and ``hydra.*`` never, and one that
    names code (``_target_``) is refused unless the command line itself gives that key."""
    from attnlab.runs import Segment, Summary

    folder = RunFolder(tmp_path)
    stored = ["lr=0.01", "imports=[evil]", "hydra.job.chdir=true", "+hydra.callbacks.x._target_=os.getcwd"]
    folder.write_summary(Summary(status="interrupted", segments=[Segment("new", "now", 0, stored)]))
    argv = ["resume=true", f"hydra.run.dir={tmp_path}"]
    assert with_run_overrides(argv) == ["lr=0.01", *argv]
    stored.append("trainer._target_=evil.Trainer")
    folder.write_summary(Summary(status="interrupted", segments=[Segment("new", "now", 0, stored)]))
    with pytest.raises(ConfigError, match=r"started with trainer._target_=evil.Trainer \(it names code\)"):
        with_run_overrides(argv)
    given = [*argv, "trainer._target_=lightning.Trainer"]
    assert with_run_overrides(given) == ["lr=0.01", *given]
    # an interpolation can assemble "_target_" at resolve time; a group choice can name a file outside conf/
    assembled = ["+xa=_tar", "+xb=get_", "task.datamodule=\"${oc.decode:'{${xa}${xb}: subprocess.Popen}'}\""]
    for hostile, reason in (
        (assembled, "it names code"),
        (["experiment=../../../../tmp/evil"], "is not a choice of conf/experiment"),
        (["experiment@hydra=mqar"], "it is not a plain setting"),
    ):
        folder.write_summary(Summary(status="interrupted", segments=[Segment("new", "now", 0, ["lr=0.01", *hostile])]))
        with pytest.raises(ConfigError, match=reason):
            with_run_overrides(argv)
    (tmp_path / "summary.json").write_text('{"segments": 5}')
    with pytest.raises(ConfigError, match=r"cannot use the run in .*summary.json: segments is 5"):
        with_run_overrides(argv)


def test_a_config_names_no_class_but_the_tasks_own(hydra_ctx: None) -> None:
    """Whatever composed the config, the datamodule is the class registered for the task: a ``_target_`` naming
    anything else is refused, and never imported."""
    from attnlab.training.config import validate_config

    for target in ("subprocess.Popen", "no_such_module.Digits.evil"):
        cfg = compose("config", overrides=[*SMALL, f"task.datamodule._target_={target}"])
        with pytest.raises(ConfigError, match=r"task.datamodule._target_=.* is not the class of task=digits"):
            validate_config(cfg)
    assert "no_such_module" not in sys.modules


# ------------------------------------------------------------------------------- 2. no link is followed


@pytest.mark.slow
def test_a_linked_file_in_a_run_folder_is_refused_and_its_target_never_written(finished: Path, tmp_path: Path) -> None:
    """``attention/maps.png`` linked to a file outside: a resume with a larger max_steps is refused in one line
    (exit 2) before anything is written; the outside file is unchanged byte for byte. (The command runs in this
    process: :func:`run_cli`, the same ``main``, exit code and output.)"""
    run = _copy(finished, tmp_path / "run")
    outside = tmp_path / "outside.png"
    outside.write_bytes(b"precious bytes")
    (run / "attention" / "maps.png").unlink()
    (run / "attention" / "maps.png").symlink_to(outside)
    before = _snapshot(run)
    proc = run_cli("resume=true", "max_steps=10", f"hydra.run.dir={run}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "attention/maps.png is a symbolic link" in _one_error_line(proc)
    assert outside.read_bytes() == b"precious bytes" and _snapshot(run) == before


LINKED = ["train.log", "metrics.jsonl", "summary.json", "config.yaml", "checkpoints", ".attnlab.lock"]


@pytest.mark.slow
@pytest.mark.parametrize("name", LINKED)
def test_no_file_of_a_run_is_read_or_written_through_a_link(
    hydra_ctx: None, finished: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(finished, tmp_path / "run")
    outside = tmp_path / f"outside-{name.strip('.')}"
    shutil.move(run / name, outside)
    (run / name).symlink_to(outside)
    before, target = _snapshot(run), _snapshot(tmp_path / "outside-checkpoints") if name == "checkpoints" else None
    content = outside.read_bytes() if outside.is_file() else None
    assert math.isnan(T.run(compose("config", overrides=[*SMALL, "resume=true", "max_steps=10"]), run))
    line = _one_error_line(capsys.readouterr().err)
    assert f"{run / name} is a symbolic link" in line
    assert _snapshot(run) == before
    if content is not None:
        assert outside.read_bytes() == content
    else:
        assert _snapshot(outside) == target


def test_the_writers_replace_or_refuse_a_link_and_never_write_through_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (tmp_path / "summary.json").symlink_to(outside)
    with atomic_open(tmp_path / "summary.json") as f:  # atomic writes replace the link itself
        f.write("{}")
    assert outside.read_text() == "keep" and not (tmp_path / "summary.json").is_symlink()
    (tmp_path / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(RunFileError, match="is a symbolic link"):
        MetricsFile(tmp_path / "metrics.jsonl").append({"step": 1})
    from attnlab.training.console import RunLog

    (tmp_path / "train.log").symlink_to(outside)
    with pytest.raises(OSError):
        RunLog().open(tmp_path / "train.log")
    assert outside.read_text() == "keep"


@pytest.mark.slow
def test_no_reader_blocks_on_a_fifo_in_a_run_folder(
    hydra_ctx: None, finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO in place of metrics.jsonl or summary.json would block a reader forever: the dashboard warns, a resume
    refuses, both at once."""
    root = tmp_path / "sweep"
    for name in ("metrics.jsonl", "summary.json"):
        run = _copy(finished, root / name.split(".")[0])
        (run / name).unlink()
        os.mkfifo(run / name)
    assert dashboard_main([str(root), "-o", str(tmp_path / "page.html")]) == 0
    err = capsys.readouterr().err
    assert err.count("is not a regular file") == 2, err
    assert math.isnan(T.run(compose("config", overrides=[*SMALL, "resume=true"]), root / "summary"))
    assert "summary.json is not a regular file" in _one_error_line(capsys.readouterr().err)


def test_a_sweep_never_writes_its_journal_through_a_link(tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.jsonl").symlink_to(victim)
    with pytest.raises(SystemExit) as exit_info:
        sweep._check_sweep_files(tmp_path / "sweep")
    assert exit_info.value.code == 2 and "sweep.jsonl is a symbolic link" in _one_error_line(capsys.readouterr().err)
    from attnlab.runs import SweepJournal

    with pytest.raises(RunFileError, match="is a symbolic link"):
        SweepJournal(tmp_path / "sweep").start(1)
    assert victim.read_text() == "keep"


def test_a_checkpoint_cannot_make_lightning_delete_a_users_file(tmp_path: Path) -> None:
    """A hostile last.ckpt naming ``my_model.pt`` as its best or k-th best file: the names are dropped, so the next
    best save never deletes it."""
    from attnlab.training.checkpoints import RunCheckpoint

    best = RunCheckpoint(dirpath=tmp_path, filename="best", monitor="val/acc", mode="max")
    best.load_state_dict(
        {
            "monitor": "val/acc",
            "best_model_score": 0.5,
            "best_model_path": "my_model.pt",
            "kth_best_model_path": "../../outside.pt",
            "last_model_path": "last.ckpt",
            "best_k_models": {"my_model.pt": 0.5, "best.ckpt": 0.4},
            "dirpath": ".",
            "current_score": 0.5,
            "kth_value": 0.5,
        }
    )
    assert best.best_model_path == "" and best.kth_best_model_path == ""
    assert list(best.best_k_models) == [str(tmp_path / "best.ckpt")]


@pytest.mark.slow
def test_the_dashboard_skips_linked_files_with_a_warning(finished: Path, tmp_path: Path, capsys) -> None:
    """A run whose summary.json and attention/maps.png link to a secret: the page is built, one warning names each
    link, and the secret is nowhere in the page (neither as text nor as base64)."""
    import base64

    root = tmp_path / "sweep"
    _copy(finished, root / "good")
    bad = _copy(finished, root / "bad")
    secret = tmp_path / "secret.txt"
    secret.write_text('{"status": "ok", "reason": "TOPSECRET-4711"}')
    for name in ("summary.json", "attention/maps.png"):
        (bad / name).unlink()
        (bad / name).symlink_to(secret)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (root / "dashboard.html").symlink_to(victim)  # the default output: replaced, never written through
    assert dashboard_main([str(root)]) == 0
    assert victim.read_text() == "keep" and not (root / "dashboard.html").is_symlink()
    assert dashboard_main([str(root), "-o", str(tmp_path / "page.html")]) == 0
    err = capsys.readouterr().err
    page = (tmp_path / "page.html").read_text()
    assert "TOPSECRET" not in page and base64.b64encode(secret.read_bytes()).decode()[:40] not in page
    assert f"{bad / 'summary.json'} is a symbolic link" in err
    assert f"{bad / 'attention' / 'maps.png'} is a symbolic link" in err


# ------------------------------------------------------------------------------- 3. overwrite deletes only a run


@pytest.mark.slow
def test_overwrite_removes_nothing_from_a_folder_that_holds_no_run(hydra_ctx: None, tmp_path: Path, capsys) -> None:
    """As the finding did: ``python train.py debug=fast hydra.run.dir=. overwrite=true`` in a folder of W&B runs, a
    checkpoint and a CSV of the user's (the command line run in this process: :func:`run_cli`, the same ``main``,
    exit code and output); then (``run`` in process) the same folder with a config.yaml of the user's."""
    for name in ("wandb/offline-run-old/run.wandb", "checkpoints/my_model.pt", "csv/data.csv"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("mine")
    before = _snapshot(tmp_path)
    proc = run_cli("debug=fast", "logger=none", "hydra.run.dir=.", "overwrite=true", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "holds no run that attnlab recognises" in _one_error_line(proc) and "nothing was removed" in proc.stderr
    assert _snapshot(tmp_path) == before
    (tmp_path / "config.yaml").write_text("my: own\n")
    before = _snapshot(tmp_path)
    assert math.isnan(T.run(compose("config", overrides=["debug=fast", "logger=none", "overwrite=true"]), tmp_path))
    assert "holds no run that attnlab recognises" in _one_error_line(capsys.readouterr().err)
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_overwrite_of_a_run_removes_what_it_wrote_and_keeps_the_users_files(
    hydra_ctx: None, finished: Path, tmp_path: Path
) -> None:
    run = _copy(finished, tmp_path / "run")
    mine = ["checkpoints/my_model.pt", "attention/notes.txt", "wandb/offline-run-20250101_000000-zz99/x.wandb"]
    for name in mine:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("mine")
    T.run(compose("config", overrides=[*SMALL, "overwrite=true", "seed=1"]), run)
    summary = read_summary(run)
    assert summary["status"] == "ok" and summary["seed"] == 1 and len(summary["segments"]) == 1
    assert all((run / name).read_text() == "mine" for name in mine)


# ------------------------------------------------------------------------------- 4. names print as text

MARKUP = ("[/x]", "[bold]", "[link=https://example.org]")
ESCAPE = "a\x1b[41mEVIL\x1b]0;OWNED\x07b"  # an ANSI sequence in a name: printed escaped, never sent to the terminal


@pytest.mark.slow
def test_a_score_named_with_rich_markup_trains_prints_and_resumes(tmp_path: Path) -> None:
    """A user score registered as ``[/x]``: the run ends ok and prints the name literally in its start line and
    results table; a resume of the finished run says so, exit 0."""
    (tmp_path / "markup_scores.py").write_text(
        "import attnlab\n\n\n@attnlab.register_score('[/x]')\ndef weird(q, k):\n    return q @ k.transpose(-1, -2)\n"
    )
    run = tmp_path / "run"
    args = ("imports=[markup_scores]", "variant=custom", "variant.name='[/x]'", f"hydra.run.dir={run}")
    proc = run_train(*SMALL, "results_table=true", NO_MAPS, *args, PYTHONPATH=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_summary(run)["status"] == "ok"
    assert "(new run) · [/x] · digits · " in proc.stdout and "│ [/x]" in proc.stdout
    proc = run_train("resume=true", "imports=[markup_scores]", f"hydra.run.dir={run}", PYTHONPATH=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is complete" in proc.stdout and "│ [/x]" in proc.stdout


@pytest.fixture(scope="module")
def hostile_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """A two-job multirun whose tag holds markup and ``../``: job 0 is refused (lr=-1), job 1 trains."""
    sweep_dir = tmp_path_factory.mktemp("hostile") / "multirun" / "sweep"
    args = ("lr=-1,0.003", "+tag='../../../escaped_[bold]'", f"hydra.sweep.dir={sweep_dir}")
    proc = run_train("-m", *SMALL, NO_MAPS, *args)
    return sweep_dir, proc


@pytest.mark.slow
def test_the_sweep_report_prints_names_as_text_and_a_failed_sweep_exits_1(hostile_sweep) -> None:
    sweep_dir, proc = hostile_sweep
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"sweep {sweep_dir}: 1 ok, 1 failed" in proc.stdout
    assert "escaped_[bold]" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_a_failing_sweep_report_still_counts_the_failed_jobs(tmp_path: Path, monkeypatch, capsys) -> None:
    """Whatever breaks in the end-of-sweep table, the failed count (and so exit code 1) comes from the journal."""
    from attnlab.runs import SweepJournal
    from attnlab.training import multirun

    journal = SweepJournal(tmp_path)
    journal.start(2)
    journal.record("0_a", "failed", "lr must be ...", 1.0)
    journal.record("1_[/x]", "ok", None, 2.0)

    def broken(*args, **kwargs):
        raise RuntimeError("the table broke")

    monkeypatch.setattr(multirun, "_jobs_table", broken)  # (where _report looks it up)
    sweep._report(tmp_path)
    out, err = capsys.readouterr()
    assert sweep.failed_jobs() == 1
    assert f"sweep {tmp_path}: 1 ok, 1 failed" in out and "the table broke" in err


@pytest.mark.slow
def test_every_console_path_prints_markup_as_text(finished: Path, tmp_path: Path, capsys) -> None:
    """Results table, run log, sweep report, dashboard table and the bench's errors, fed ``[/x]``, ``[bold]`` and
    ``[link=...]``: each comes out literally, and nothing raises."""
    from attnlab.bench.cli import main as bench_main
    from attnlab.runs import Summary, SweepJournal
    from attnlab.training.console import RunLog, results_table

    log = RunLog()
    for text in MARKUP:
        log.info(f"variant {text}")
        log.table(results_table(Summary(status="ok", variant=text, task=text)))
    log.error("a folder named x\x1b[2Jy\nz")  # an escape sequence from a name cannot drive the terminal
    journal = SweepJournal(tmp_path / "sweep")
    journal.start(len(MARKUP))
    for text in (*MARKUP, ESCAPE):
        journal.record(f"0_+tag={text}", "failed", f"reason {text}", 1.0)
    sweep._report(tmp_path / "sweep")
    root = tmp_path / "runs"
    for i, text in enumerate((*MARKUP, ESCAPE)):
        run = _copy(finished, root / f"r{i}")
        _edit_json(run / "summary.json", lambda s, t=text: s.update(variant=t))
        (run / "config.yaml").write_text((run / "config.yaml").read_text() + yaml.safe_dump({text: i}))
    assert dashboard_main([str(root), "-o", str(tmp_path / "page.html")]) == 0
    with pytest.raises(SystemExit):
        bench_main(["--only", "[/x],[bold]"])
    out, err = capsys.readouterr()
    for text in MARKUP:
        assert f"variant {text}" in out and f"0_+tag={text}" in out and f"reason {text}" in out
        assert out.count(text) >= 6, text  # results table (x2), sweep table and failures, dashboard (name, key)
    assert "unknown section(s) [/x], [bold]" in err
    assert "\x1b" not in out + err and f"reason {printable(ESCAPE)}" in out
    assert "error: a folder named x\\x1b[2Jy\\nz\n" in err and "\x1b" not in err


# ------------------------------------------------------------------------------- 5. extensions cannot shrink


@pytest.mark.slow
def test_an_interrupted_extension_cannot_be_resumed_shorter(hydra_ctx: None, tmp_path: Path) -> None:
    """Extend a 10-step run to 400, SIGKILL it once last.ckpt holds step >= 15, then ``max_steps=10``: refused in one
    line naming the step reached and the extension's aim; the summary records that aim, and nothing changed. (The
    kill needs a real process; the refused command runs in this one: :func:`run_cli`.)"""
    run = tmp_path / "run"
    base = (*SMALL, NO_MAPS, "max_steps=10", "eval_every=5", f"hydra.run.dir={run}")
    T.run(compose("config", overrides=list(base[:-1])), run)  # (the commands below name every override)
    assert read_summary(run)["status"] == "ok"
    proc = subprocess.Popen(
        train_cmd(*base, "resume=true", "max_steps=400"),
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    import torch

    def step() -> int:
        try:
            return int(torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"])
        except Exception:
            return -1

    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline and step() < 15:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    reached = step()
    summary = read_summary(run)
    assert summary["segments"][-1]["kind"] == "extend" and summary["segments"][-1]["target_steps"] == 400
    before = _snapshot(run)
    proc = run_cli(*base, "resume=true", "max_steps=10")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc)
    assert f"reached step {reached}" in line and "an extension to 400 was interrupted" in line
    assert "cannot be shortened" in line
    assert _snapshot(run) == before


# ------------------------------------------------------------------------------- 6. every file is untrusted

CORRUPT = {
    "non-utf8": ("summary.json", lambda p: p.write_bytes(p.read_bytes().replace(b'"ok"', b'"o\xffk"')), "UTF-8"),
    "segments-5": ("summary.json", lambda p: _edit_json(p, lambda s: s.update(segments=5)), "segments is 5"),
    "steps-abc": ("summary.json", lambda p: _edit_json(p, lambda s: s.update(steps="abc")), 'steps is "abc"'),
    "segment-step": (
        "summary.json",
        lambda p: _edit_json(p, lambda s: s["segments"][0].update(from_step=[1])),
        "segments[0]: from_step is [1]",
    ),
    "metrics-str": ("summary.json", lambda p: _edit_json(p, lambda s: s.update(metrics="x")), 'metrics is "x"'),
    "summary-list": ("summary.json", lambda p: p.write_text("[1, 2]"), "must be a JSON object"),
    "config-list": ("config.yaml", lambda p: p.write_text("- 1\n- 2\n"), "config.yaml is not a mapping"),
    "deep-json": ("summary.json", lambda p: p.write_text("[" * 100000 + "]" * 100000), "nested too deeply"),
    "alias-bomb": ("config.yaml", lambda p: p.write_text(_alias_bomb()), "alias bomb"),
    "huge-int": ("summary.json", lambda p: _huge(p), "cannot be read as JSON"),
}


def _alias_bomb(levels: int = 10, width: int = 10) -> str:
    """The "billion laughs" as YAML: level k is a list of ``width`` aliases of level k - 1, so that level 9 expands
    to 10^10 strings; about 500 bytes on disk."""
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * width)}]" for k in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_in_one_line_within_a_second_and_bounded_memory(tmp_path: Path, capsys):
    """Issue 40: a run folder's config.yaml of 10 levels x 10 aliases (1 KB, 10^10 nodes expanded) is one line
    naming the file, for every reader: RunFolder.read_config (what a resume reads, through the run's own checks),
    attnlab.runs.load_run and the dashboard (the page is still built, the run shown without its config)."""
    import tracemalloc

    run = tmp_path / "sweep" / "bomb"
    run.mkdir(parents=True)
    bomb = _alias_bomb()
    assert len(bomb.encode()) < 1024
    (run / "config.yaml").write_text(bomb)
    (run / "summary.json").write_text(json.dumps({"status": "ok", "schema_version": 5, "metrics": {"test/acc": 0.5}}))
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(RunFileError) as err:
            RunFolder(run).read_config()
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert message.startswith(f"{run / 'config.yaml'} ") and "alias bomb" in message and "\n" not in message
    assert elapsed < 1.0 and peak < 20e6, (elapsed, peak)
    from attnlab.runs import load_run

    assert load_run(run).problems == [message] and load_run(run).config == {}
    started = time.perf_counter()
    assert dashboard_main([str(tmp_path / "sweep"), "-o", str(tmp_path / "page.html")]) == 0
    assert time.perf_counter() - started < 60
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines == [f"attnlab-dashboard: warning: run bomb: {message}"]


def _huge(path: Path) -> None:
    """An integer of 5000 digits (more than Python converts by default) as one more field."""
    path.write_text(path.read_text().rstrip().removesuffix("}") + ', "x": ' + "9" * 5000 + "}")


@pytest.mark.slow
def test_the_dashboard_warns_once_per_bad_file_and_still_builds_the_page(finished: Path, tmp_path: Path, capsys):
    root = tmp_path / "sweep"
    _copy(finished, root / "good")
    for name, (file, corrupt, _) in CORRUPT.items():
        corrupt(_copy(finished, root / name) / file)
    odd = _copy(finished, root / "odd-config")  # wrong types inside config.yaml: read as data, never a crash
    text = (odd / "config.yaml").read_text().replace("d_model: 16", "d_model: abc").replace("seed: 0", "seed: [1]")
    (odd / "config.yaml").write_text(text + "'[/x]':\n  7: null\n")
    rows = (odd / "metrics.jsonl").read_text()
    hostile = '{"step": "abc", "val/acc": "x"}\n[1]\n{"step": ' + "9" * 5000 + "}\n" + "[" * 100000 + "\n"
    (odd / "metrics.jsonl").write_text(hostile + rows + '{"step": 9, "val/ac')
    assert dashboard_main([str(root), "-o", str(tmp_path / "page.html")]) == 0
    out, err = capsys.readouterr()
    page = (tmp_path / "page.html").read_text()
    for name, (file, _, field) in CORRUPT.items():
        warnings = [line for line in err.splitlines() if line.startswith(f"attnlab-dashboard: warning: run {name}:")]
        assert len(warnings) == 1 and file in warnings[0] and field in warnings[0], (name, err)
        assert name in page
    assert "good" in page and "odd-config" in page and f"attnlab · {len(CORRUPT) + 2} runs" in out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_resume_refuses_a_bad_file_in_one_line(hydra_ctx: None, finished: Path, tmp_path: Path, case: str, capsys):
    file, corrupt, field = CORRUPT[case]
    run = _copy(finished, tmp_path / "run")
    corrupt(run / file)
    before = _snapshot(run)
    assert math.isnan(T.run(compose("config", overrides=[*SMALL, "resume=true", "max_steps=10"]), run))
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot use the run in {run}" in line and field in line
    assert _snapshot(run) == before


# ------------------------------------------------------------------------------- 7. job folders stay inside


@pytest.mark.slow
def test_override_values_never_place_a_job_folder_outside_the_sweep(hostile_sweep) -> None:
    sweep_dir, _ = hostile_sweep
    jobs = sorted(p.parent for p in sweep_dir.parent.parent.rglob("summary.json"))
    assert len(jobs) == 2 and all(job.parent == sweep_dir for job in jobs), jobs
    root = sweep_dir.parents[1]  # nothing beside the sweep folder, nothing above it
    assert [p.name for p in root.iterdir()] == ["multirun"]
    assert [p.name for p in sweep_dir.parent.iterdir()] == ["sweep"]
    assert [job.name.split(",")[0] for job in jobs] == [f"{i}_+tag='.._.._.._escaped_[bold]'" for i in (0, 1)]


# ------------------------------------------------------------------------------- 8. values that escaped validation
# (threads=1000000, lr=${undefined_key}, lr=${oc.env:...}, trainer.val_check_interval=0 and model.d_ff=1e11 run as
# real commands among test_cli.py's bad inputs: one line, exit 2, no folder; the rest of the checks here)

REFUSED = [
    (["trainer.max_epochs=0"], r"trainer.max_epochs must be one of -1, None, got 0; attnlab trains for max_steps"),
    (["+trainer.max_time=5"], r"trainer.max_time is not a trainer setting attnlab takes \(.*allowed: accelerator"),
    (["trainer.limit_val_batches=0"], r"trainer.limit_val_batches must be an integer >= 1, got 0"),
    (["trainer.gradient_clip_val=-1"], r"trainer.gradient_clip_val must be a finite number >= 0, got -1"),
    (["d_k=1000000000"], r"d_k=1000000000, .*: the model needs about [\d.]+ TiB for [\d,]+ parameters with their"),
    (["imports=${undefined_key}"], r"imports: Interpolation key 'undefined_key' not found"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=lambda v: "_".join(v) if isinstance(v, list) else "")
def test_values_that_escaped_validation_are_refused_before_anything_is_written(
    hydra_ctx: None, tmp_path: Path, overrides: list[str], message: str, capsys
) -> None:
    out = tmp_path / "run"
    assert math.isnan(T.run(compose("config", overrides=[*SMALL, *overrides]), out))
    assert re.search(message, _one_error_line(capsys.readouterr().err))
    assert not out.exists()


# ------------------------------------------------------------------------------- 8. a multirun interrupted


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_multirun_prints_its_report_and_exits_130(tmp_path: Path, sig: int) -> None:
    """Job 0 finishes, job 1 is signalled while it trains: the sweep's report (``interrupted: 1 ok, 1 failed``) and
    exit code 130, no traceback; the interrupted job's summary says so."""
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen(
        train_cmd("-m", *SMALL, NO_MAPS, "max_steps=5,2000", "eval_every=5", f"hydra.sweep.dir={sweep_dir}"),
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline and not list(sweep_dir.glob("1_*/metrics.jsonl")):
            time.sleep(0.05)
        time.sleep(1.0)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err
    assert f"sweep {sweep_dir}: interrupted: 1 ok, 1 failed" in out
    (job,) = sweep_dir.glob("1_*")
    assert read_summary(job)["status"] == "interrupted"
