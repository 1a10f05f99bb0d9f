"""The command line as users type it: one-line errors for bad input that leave nothing behind, a run folder that a
second command cannot damage, a diverging job that fails cleanly while the sweep goes on (and the sweep's exit code
says so), quiet output, and the Python examples of the README and the docs pages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, read_summary, run_cli, run_train, train_env

BAD_INPUTS = [
    (["variant=adittive"], r"unknown variant 'adittive'; did you mean 'additive'\?.*scaled_dot"),
    (["mask=causl"], r"unknown mask 'causl'; did you mean 'causal'\?"),
    (["task=listop"], r"unknown task 'listop'; did you mean 'listops'\?"),
    (["d_k=0"], r"d_k must be an integer >= 1, got 0"),
    (["num_heads=-2"], r"num_heads must be an integer >= 1, got -2"),
    (["d_model=0"], r"d_model must be an integer >= 1, got 0"),
    (["d_model=30", "num_heads=4"], r"d_model \(30\) is not divisible by num_heads \(4\)"),
    (["lr=-0.1"], r"lr must be a finite number >= 0, got -0.1"),
    (["mask=sliding_window", "mask.window=0"], r"window must be an integer >= 1, got 0"),
    (["variant=relative_position", "variant.params.clip=-1"], r"clip must be an integer >= 0"),
    (["batch_size=5000"], r"batch_size \(5000\) is larger than the training set \(1257\)"),
    (["variant=custom", "variant.name=cosyne"], r"unknown variant 'cosyne'.*variant=custom variant.name=<name>"),
    (["mask=dilated"], r"unknown mask 'dilated'.*mask=custom mask.name=dilated 'imports=\[your_module\]'"),
    (["model.dropot=0.1"], r"unknown config key 'model.dropot'; did you mean 'model.dropout'\?.*\+model.dropot=0.1"),
    (["eval_every=0"], r"eval_every must be an integer >= 1, got 0"),
    (["eval_every=500"], r"max_steps \(300\) must be a multiple of eval_every \(500\)"),
    (["trainer.max_steps=10"], r"trainer.max_steps \(10\) follows max_steps: set max_steps instead"),
    (["seed=4294967296"], r"seed must be an integer in \[0, 4294967295\], got 4294967296"),
    (["variant=custom"], r"variant.name is not set \(\?\?\?\): variant=custom needs variant.name=<your registered"),
    (["threads=0"], r"threads must be auto or an integer from 1 to \d+ \(4 per core here\), got 0"),
    (["threads=abc"], r"threads must be auto or an integer from 1 to \d+ \(4 per core here\), got 'abc'"),
    # values that escaped validation (issue 25, finding 8): a crash, tracebacks, a failed or empty run folder
    (["threads=1000000"], r"threads must be auto or an integer from 1 to \d+ \(4 per core here\), got 1000000"),
    (["lr=${undefined_key}"], r"^error: lr: Interpolation key 'undefined_key' not found$"),
    (["lr=${oc.env:NONEXISTENT}"], r"^error: lr: .*Environment variable 'NONEXISTENT' not found"),
    (["trainer.val_check_interval=0"], r"trainer.val_check_interval \(0\) follows eval_every \(100\): set eval_every"),
    (["model.d_ff=100000000000"], r"model.d_ff=100000000000: the model needs about [\d.]+ TiB for [\d,]+ parameters"),
    (["model.dropout=1.5"], r"model.dropout must be a finite number in \[0, 1\), got 1.5"),
    (["diagnostics.threshold=2"], r"diagnostics.threshold must be a finite number in \(0, 1\), got 2"),
    (
        ["task=associative_recall", "task.datamodule.seq_len=100000"],
        r"task.datamodule.seq_len=100000: sequences of 100000 tokens need about [\d.]+ TiB .* more than the",
    ),
    (["imports=[no_such_module_xyz]"], r"imports: cannot import 'no_such_module_xyz': ModuleNotFoundError"),
    (["variant=alibi", "+variant.params.clip=3"], r"variant.params: variant 'alibi' does not take parameter 'clip'"),
]
if not torch.cuda.is_available():
    BAD_INPUTS.append((["trainer=gpu"], r"trainer.accelerator=gpu but torch sees no CUDA GPU"))
if not os.environ.get("WANDB_API_KEY") and not (Path.home() / ".netrc").exists():
    BAD_INPUTS.append((["logger=wandb", "logger.mode=online"], r"logger.mode=online needs W&B credentials"))


# the bad inputs also run as real commands: one refused before Hydra starts (a group choice), one refused by the
# run after Hydra made the default run folder (which must go again), and one that imports the user's code
REAL_COMMANDS = (["variant=adittive"], ["d_k=0"], ["imports=[no_such_module_xyz]"])


def _ids(value) -> str:
    return "_".join(value) if isinstance(value, list) else ""


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "message"), BAD_INPUTS, ids=_ids)
def test_bad_input_prints_one_line_exits_2_and_leaves_no_run_folder(tmp_path, overrides, message):
    """Started in an empty folder with the default (relative) run folder outputs/<date>/<time>_<id>: Hydra makes
    it, and it must be gone again, with its parents. The command line runs in this process (:func:`run_cli`: the
    same ``main``, exit code and output); a few run as real commands below."""
    proc = run_cli("logger=none", *overrides, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert_one_error_line(proc, message)
    assert list(tmp_path.iterdir()) == [], sorted(str(p) for p in tmp_path.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "message"), [b for b in BAD_INPUTS if b[0] in REAL_COMMANDS], ids=_ids)
def test_bad_input_as_a_real_command_prints_one_line_exits_2_and_leaves_no_run_folder(tmp_path, overrides, message):
    proc = run_train("logger=none", *overrides, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert_one_error_line(proc, message)
    assert list(tmp_path.iterdir()) == [], sorted(str(p) for p in tmp_path.rglob("*"))


def test_the_real_commands_are_among_the_bad_inputs():
    assert len([b for b in BAD_INPUTS if b[0] in REAL_COMMANDS]) == len(REAL_COMMANDS)


@pytest.mark.slow
def test_the_in_process_command_line_shows_what_a_process_would_and_leaves_this_one_as_it_was(tmp_path, monkeypatch):
    """:func:`run_cli` is a stand-in for ``python train.py`` only if it shows what the process would: a warning that
    a fresh interpreter prints (here from the user's module, imported by ``imports``) is a line on its stderr; and
    it leaves the test process as it found it (working directory, argv, environment, logging)."""
    import logging

    (tmp_path / "noisy_user_module.py").write_text("import warnings\n\nwarnings.warn('user module says hi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cwd, argv, env, handlers = os.getcwd(), list(sys.argv), dict(os.environ), logging.getLogger().handlers[:]
    proc = run_cli("logger=none", "imports=[noisy_user_module]", "d_k=0", cwd=tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "error: d_k must be an integer >= 1, got 0" in lines, proc.stderr
    assert any("UserWarning: user module says hi" in line for line in lines), proc.stderr
    with pytest.raises(AssertionError):  # so a bad input's check would see it
        assert_one_error_line(proc, "d_k must be")
    assert (os.getcwd(), sys.argv, dict(os.environ), logging.getLogger().handlers) == (cwd, argv, env, handlers)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__")
    assert left == ["noisy_user_module.py"]  # the run folder that Hydra made is gone again


def assert_one_error_line(proc: subprocess.CompletedProcess, message: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and len(lines[0]) < 500, lines[0]
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


@pytest.mark.slow
def test_full_error_shows_the_traceback(tmp_path):
    proc = run_train("d_k=0", "logger=none", f"hydra.run.dir={tmp_path}", full_error=True)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


@pytest.mark.slow
def test_failed_jobs_are_recorded_the_sweep_goes_on_and_exits_non_zero(tmp_path):
    """Diverging jobs and jobs with a bad value (num_heads=0): all recorded as failed with their one line, the good
    job runs, the final table says 1 ok and 3 failed, and the exit code is 1."""
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "lr=1e12,1e-3",
        "num_heads=0,4",
        "debug=fast",
        "results_table=false",
        "diagnostics.heatmaps=false",  # (the attention maps' plot: not what is tested here)
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # every job ran, and the exit code says some failed
    jobs = sorted((p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("_")[0]))
    assert len(jobs) == 4
    bad, diverged, bad_too, ok = (read_summary(j) for j in jobs)
    assert diverged["lr"] == 1e12 and diverged["status"] == "failed"
    assert re.match(r"training diverged at step \d+: (loss|gradient) is (nan|inf)", diverged["reason"])
    for refused in (bad, bad_too):
        assert refused["status"] == "failed" and refused["reason"] == "num_heads must be an integer >= 1, got 0"
        assert refused["num_heads"] == 0 and refused["d_k"] is None  # settings recorded as far as they make sense
    assert ok["status"] == "ok"
    assert re.search(r"job 1/4 done \(failed\), .* elapsed", proc.stdout) and "job 4/4 done (ok)" in proc.stdout
    assert "1 ok, 3 failed" in proc.stdout
    assert "training diverged" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    # the failed job's W&B run was finished and marked failed (exit code 1), the good one with 0
    wandb_cli = Path(sys.executable).parent / "wandb"
    for job, code in zip([jobs[1], jobs[3]], (1, 0), strict=True):
        (run_dir,) = (job / "wandb").glob("offline-run-*")
        records = subprocess.run(
            [str(wandb_cli), "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True, check=True
        ).stdout
        exits = [json.loads(line)["exit"] for line in records.splitlines() if '"type":"exit"' in line]
        assert exits and exits[-1].get("exit_code", 0) == code


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


# the README and every docs page with Python in it: slow, an interpreter each
EXAMPLE_PAGES = [
    pytest.param(page, id=page.relative_to(REPO).as_posix(), marks=pytest.mark.slow)
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
    if _python_blocks(page)
]


def test_the_pages_with_python_examples_are_found():
    assert {p.values[0].name for p in EXAMPLE_PAGES} >= {"README.md", "library.md", "add-your-own.md"}


@pytest.mark.parametrize("page", EXAMPLE_PAGES)
def test_python_examples_run(tmp_path, page):
    """Every ```python block of the README, and of each docs page, runs as written (a fresh interpreter per page,
    its blocks in order)."""
    script = tmp_path / "examples.py"
    script.write_text("\n\n".join(_python_blocks(page)))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# ------------------------------------------------------------------------------------ the run folder is safe


@pytest.mark.slow
def test_a_finished_run_cannot_be_damaged_from_the_command_line(tmp_path, snapshot):
    """Re-running into a finished folder, resuming it, resuming it with other settings: no file changes.

    The run is trained by a real ``python train.py`` (its summary records the command line's overrides); the
    commands that follow run in this process (:func:`run_cli`: the same ``main``, exit code, output and files)."""
    run = tmp_path / "run"
    args = ("debug=fast", "d_model=32", "logger=none", "diagnostics.heatmaps=false")  # (no plot: none is looked at)
    first = run_train(*args, f"hydra.run.dir={run}")
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(run)

    again = run_cli(*args, f"hydra.run.dir={run}")  # resume=true forgotten
    assert again.returncode == 2
    assert_one_error_line(
        again, rf"{run} already holds a run \(ok, step 5\); to continue it: python train.py resume=true hydra.run.dir="
    )
    assert snapshot(run) == before

    resumed = run_cli("resume=true", f"hydra.run.dir={run}")  # the run's own overrides are put back
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "is complete (5 steps); nothing to do, nothing changed" in resumed.stdout
    assert snapshot(run) == before

    changed = run_cli("resume=true", "lr=1e-3", "d_k=32", f"hydra.run.dir={run}")
    assert changed.returncode == 2
    assert_one_error_line(changed, r"cannot resume .* with other settings .*: d_k: None → 32, lr: 0.003 → 0.001")
    assert snapshot(run) == before

    # extended, then resumed with the folder alone: complete at its new length (the extension's max_steps is
    # put back), and shortening is refused
    extended = run_cli("resume=true", "max_steps=10", f"hydra.run.dir={run}")
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert read_summary(run)["steps"] == 10
    after = snapshot(run)
    resumed = run_cli("resume=true", f"hydra.run.dir={run}")
    assert resumed.returncode == 0 and "is complete (10 steps)" in resumed.stdout, resumed.stderr[-3000:]
    shorter = run_cli("resume=true", "max_steps=5", f"hydra.run.dir={run}")
    assert shorter.returncode == 2
    assert_one_error_line(shorter, r"max_steps 10 → 5: a run cannot be shortened")
    assert snapshot(run) == after

    # its checkpoint does not fit a model of another width: one line naming the settings, nothing written
    other = tmp_path / "other"
    foreign = run_cli(
        "debug=fast", "logger=none", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={other}"
    )
    assert foreign.returncode == 2
    assert_one_error_line(foreign, r"does not fit this model: it was saved with other settings: d_model 32 → 64")
    assert not other.exists()


@pytest.mark.slow
def test_checkpoint_and_folder_problems_cost_one_line_before_the_first_step(tmp_path):
    """Each command runs in this process (:func:`run_cli`: the same ``main``, exit code, output and files)."""
    empty = tmp_path / "empty.ckpt"
    empty.touch()
    proc = run_cli("debug=fast", "logger=none", f"ckpt_path={empty}", f"hydra.run.dir={tmp_path / 'a'}")
    assert proc.returncode == 2
    assert_one_error_line(proc, rf"checkpoint {empty} is empty \(0 bytes\)")
    assert not (tmp_path / "a").exists()

    # checkpoints/ cannot be written: refused before training (root ignores permission bits: a file in its place;
    # a link there is refused as a link, see test_untrusted.py)
    run = tmp_path / "b"
    (run).mkdir()
    if os.geteuid() != 0:
        (run / "checkpoints").mkdir()
        (run / "checkpoints").chmod(0o555)
    else:
        (run / "checkpoints").write_text("not a folder")
    proc = run_cli("debug=fast", "logger=none", f"hydra.run.dir={run}")
    assert proc.returncode == 2
    assert_one_error_line(proc, rf"cannot write checkpoints to {run / 'checkpoints'}: ")
    assert not (run / "metrics.jsonl").exists() and not (run / "summary.json").exists()

    # the output folder cannot be made: one line, not Hydra's traceback
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = run_cli("debug=fast", "logger=none", f"hydra.run.dir={blocker / 'run'}")
    assert proc.returncode == 2
    assert_one_error_line(proc, rf"cannot create the output folder {blocker / 'run'}: {blocker} is not writable")


@pytest.mark.slow
def test_a_second_process_on_a_held_run_folder_is_refused_with_the_holder(tmp_path):
    from attnlab.runs import RunFolder

    run = tmp_path / "run"
    with RunFolder(run).lock("train.py seed=1"):
        proc = run_train("debug=fast", "logger=none", "seed=2", f"hydra.run.dir={run}")
    assert proc.returncode == 2
    assert_one_error_line(proc, rf"run folder {run} is in use by pid {os.getpid()} on .* \(train.py seed=1\)")
    assert sorted(p.name for p in run.iterdir()) == [".attnlab.lock"]  # nothing of the second run


# ------------------------------------------------------------------------------------ quiet output


NOISE = (
    "Epoch",  # Lightning's per-epoch bar ("Epoch 3/-2" when training is bounded by steps)
    "GPU available",
    "TPU available",
    "Tip:",
    "litlogger",
    "wandb:",
    "anonymous",
    "alembic",
    "A new study created",
    "Restoring states",
    "Warning",
    "\x1b[",  # ANSI codes in a log
)


@pytest.mark.slow
def test_a_sweep_prints_no_noise_and_writes_only_under_multirun(tmp_path):
    """An Optuna sweep of one job with the default logger (W&B, offline), started in an empty folder: the output
    holds the start line with the run folder, a line per validation, the results, the job count and the final
    table, and none of the libraries' noise; only multirun/ appears; files get the user's umask."""
    proc = run_train("-m", "hparams_search=optuna", "hydra.sweeper.n_trials=1", "debug=fast", cwd=tmp_path, wandb=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    for noise in NOISE:
        assert noise not in output, (noise, output)
    assert proc.stderr == ""
    assert re.search(r"^run multirun/\S+/0_\S+ \(new run\) · scaled_dot · digits · ", proc.stdout, re.M)
    assert re.search(r" params, backend sdpa, state [\d,]+ floats/seq · ", proc.stdout)  # what computes the layers
    assert "step 5/5 · train loss" in proc.stdout and "SMOKE RUN (debug=fast)" in proc.stdout
    assert re.search(r"^run folder: multirun/", proc.stdout, re.M)
    assert "job 1/1 done (ok)" in proc.stdout and "1 ok, 0 failed" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]
    (run,) = [p.parent for p in tmp_path.rglob("summary.json")]
    log = (run / "train.log").read_text()
    assert "(new run)" in log and "step 5/5" in log and "ok: best val acc" in log
    umask = os.umask(0)
    os.umask(umask)
    for name in ("summary.json", "config.yaml", "metrics.jsonl", "checkpoints/best.ckpt", "checkpoints/last.ckpt"):
        assert (run / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
