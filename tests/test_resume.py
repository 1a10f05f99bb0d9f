"""Reliability of a run: the same seed gives the same metrics, and an interrupted run resumed from its last
checkpoint ends exactly where an uninterrupted run of the same seed ends (weights, metrics, metrics.jsonl rows,
W&B run id), whether it was killed mid-epoch or at an epoch's end, once or twice.

In-process runs crash on purpose (a callback raises at a given step); the slow test kills a real ``python train.py``
with SIGKILL. Every run folder goes to tmp_path.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from helpers import REPO, read_summary, run_train, train_cmd, train_env
from hydra import compose
from omegaconf import OmegaConf

import attnlab.callbacks
from attnlab import training as T
from attnlab.callbacks import DivergenceGuard
from attnlab.runs import METRICS_FILE, SUMMARY_FILE, load_run, read_metrics
from attnlab.training.loggers import JsonlLogger

# 128 training sequences in batches of 16 = 8 batches per epoch; validation (and last.ckpt) every 6 steps, so the
# checkpoints fall mid-epoch (6, 12, 18) and at an epoch's end (24). With this lr and seed the validation accuracy
# peaks at step 18 and is lower at 24 and 30, so a resume from 24 must restore the best-so-far.
SMALL = (
    "debug=fast",
    "d_model=32",
    "logger=none",
    "results_table=false",
    "lr=3e-2",
    "seed=0",
    "task.datamodule.num_train=128",
    "task.datamodule.num_val=64",
    "trainer.limit_val_batches=1.0",
    "max_steps=30",
    "eval_every=6",
    "diagnostics.every_n_steps=5",
    "threads=1",  # two threads per run on top of two test workers on two cores: each step waits for a thread
    "diagnostics.heatmaps=false",  # the maps' plot (most of a short run's time) cannot change a number
)


pytestmark = pytest.mark.usefixtures("restore_process_state")


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights_of(a), weights_of(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ: {different[:5]}"


def assert_same_run(ref: Path, resumed: Path) -> None:
    """Two run folders that must agree exactly (apart from timings and paths)."""
    a, b = read_summary(ref), read_summary(resumed)
    assert a["status"] == b["status"] == "ok", (a.get("reason"), b.get("reason"))
    assert a["steps"] == b["steps"]
    assert a["metrics"] == b["metrics"]  # exact: CPU training is deterministic and the resume replays the data order
    assert a["attn_init"] == b["attn_init"]
    rows_a, rows_b = read_metrics(ref / METRICS_FILE), read_metrics(resumed / METRICS_FILE)
    keys = [(r["step"], k) for r in rows_b for k in r if k not in ("step", "epoch")]
    assert len(keys) == len(set(keys)), "a (step, metric) pair is logged twice"
    assert rows_a == rows_b
    # the summary reports the diagnostics of the end of training (not those of a checkpoint loaded later)
    assert b["metrics"]["attn/entropy"] == [r for r in rows_b if "attn/entropy" in r][-1]["attn/entropy"]
    assert_same_weights(ref / "checkpoints" / "last.ckpt", resumed / "checkpoints" / "last.ckpt")
    # one best checkpoint, whatever the number of starts (Lightning's version counter would add best-v1.ckpt)
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]


class _CrashAt(DivergenceGuard):
    """Raises just before the optimizer step after ``step`` steps (the run ends failed, as if killed)."""

    steps: ClassVar[list[int]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.steps and trainer.global_step == self.steps[0]:
            raise RuntimeError(f"simulated crash at step {self.steps.pop(0)}")


# ------------------------------------------------------------------------------------ determinism


def test_same_seed_same_metrics_other_seed_other_metrics(hydra_ctx: None, tmp_path: Path) -> None:
    overrides = ["debug=fast", "logger=none", "results_table=false", "max_steps=20", "eval_every=10", "threads=1"]
    overrides.append("diagnostics.heatmaps=false")
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        T.run(compose("config", overrides=[*overrides, f"seed={seed}"]), tmp_path / name)
    a, b, c = (read_summary(tmp_path / n) for n in "abc")
    assert a["status"] == b["status"] == c["status"] == "ok"
    assert a["metrics"] == b["metrics"] and a["attn_init"] == b["attn_init"] and a["params"] == b["params"]
    assert read_metrics(tmp_path / "a" / METRICS_FILE) == read_metrics(tmp_path / "b" / METRICS_FILE)
    assert_same_weights(tmp_path / "a" / "checkpoints" / "last.ckpt", tmp_path / "b" / "checkpoints" / "last.ckpt")
    assert a["metrics"]["train/loss"] != c["metrics"]["train/loss"]
    assert a["attn_init"] != c["attn_init"]


# ------------------------------------------------------------------------------------ resume in process


@pytest.fixture(scope="module")
def reference(hydra_ctx: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("reference") / "run"
    T.run(compose("config", overrides=list(SMALL)), out)
    assert read_summary(out)["status"] == "ok"
    return out


def test_run_crashed_twice_resumes_to_the_uninterrupted_result(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash at step 15 (last checkpoint at 12, mid-epoch), resume, crash at 26 (last checkpoint at 24, an epoch's
    end), resume: the result is the reference run's, exactly."""
    out = tmp_path / "run"
    monkeypatch.setattr(attnlab.callbacks, "DivergenceGuard", _CrashAt)
    monkeypatch.setattr(_CrashAt, "steps", [15, 26])
    value = T.run(compose("config", overrides=list(SMALL)), out)
    assert math.isnan(value)
    crashed = read_summary(out)
    assert crashed["status"] == "failed" and "simulated crash at step 15" in crashed["reason"]
    rows_at_crash = read_metrics(out / METRICS_FILE)
    assert max(r["step"] for r in rows_at_crash) > 12  # rows logged after the checkpoint, to be dropped

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        T.run(compose("config", overrides=[*SMALL, "resume=true"]), out)
    second = read_summary(out)
    assert second["status"] == "failed" and "simulated crash at step 26" in second["reason"]
    assert second["resumed_at_step"] == 12
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "not resumable" in m or "weights_only" in m], messages

    T.run(compose("config", overrides=[*SMALL, "ckpt_path=last"]), out)
    assert read_summary(out)["resumed_at_step"] == 24
    assert_same_run(reference, out)
    final = read_summary(out)["metrics"]
    assert final["val/acc"] < final["val/acc_best"]  # the best came before the last resume, which restored it


def test_resume_of_a_folder_without_a_run_is_refused_and_leaves_nothing(
    hydra_ctx: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    value = T.run(compose("config", overrides=[*SMALL, "resume=true"]), out)
    assert math.isnan(value)
    assert not out.exists()  # the folder made for the refused run is gone again
    assert f"error: nothing to resume in {out}: it holds no run" in capsys.readouterr().err


def _crashed_run(out: Path, monkeypatch: pytest.MonkeyPatch, step: int = 15) -> None:
    monkeypatch.setattr(attnlab.callbacks, "DivergenceGuard", _CrashAt)
    monkeypatch.setattr(_CrashAt, "steps", [step])
    T.run(compose("config", overrides=list(SMALL)), out)
    monkeypatch.undo()
    assert read_summary(out)["status"] == "failed"


def test_a_copied_run_folder_resumes_from_its_own_checkpoints(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash, copy the folder, ruin the original's checkpoints: the copy resumes to the uninterrupted result, and
    its summary names no file outside it."""
    import shutil

    original, copy = tmp_path / "original", tmp_path / "moved" / "copy"
    _crashed_run(original, monkeypatch, step=26)  # after the best validation (18): the copy must keep its best.ckpt
    ckpt = torch.load(original / "checkpoints" / "last.ckpt", weights_only=True)
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("RunCheckpoint")]
    assert (state["dirpath"], state["best_model_path"]) == (".", "best.ckpt")  # names relative to the folder
    shutil.copytree(original, copy)
    for ckpt in (original / "checkpoints").iterdir():
        ckpt.write_bytes(b"garbage")
    T.run(compose("config", overrides=[*SMALL, "resume=true"]), copy)
    assert_same_run(reference, copy)
    text = (copy / SUMMARY_FILE).read_text()
    assert str(original) not in text and str(tmp_path) not in text
    summary = read_summary(copy)
    assert summary["best_checkpoint"] == "checkpoints/best.ckpt" and summary["resumed_from"] == "checkpoints/last.ckpt"


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_the_start(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    _crashed_run(out, monkeypatch, step=3)  # the first validation (and checkpoint) is at step 6
    assert not (out / "checkpoints" / "last.ckpt").exists()
    T.run(compose("config", overrides=[*SMALL, "resume=true"]), out)
    assert_same_run(reference, out)
    assert [(s["kind"], s["from_step"]) for s in read_summary(out)["segments"]] == [("new", 0), ("resume", 0)]


def test_a_signal_inside_a_checkpoint_save_ends_the_run_as_interrupted_and_it_resumes(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C inside ``torch.save`` leaves its zip writer half-way, whose closing raises a RuntimeError (the
    KeyboardInterrupt its context): the run was interrupted, not failed (the card's SIGTERM once landed there), and
    resumes to the uninterrupted result."""
    import io

    class Interrupting(io.BytesIO):
        def write(self, data: bytes) -> int:  # (the signal, as Python raises it at the next bytecode)
            if self.tell() > 0:
                raise KeyboardInterrupt
            return super().write(data)

    save = torch.save

    def interrupted_save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "state_dict" in obj:  # the first checkpoint
            save(obj, Interrupting(), *args, **kwargs)
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", interrupted_save)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt) as raised:
        T.run(compose("config", overrides=list(SMALL)), out)
    monkeypatch.undo()
    assert isinstance(raised.value.__cause__, RuntimeError)  # what torch.save raised on its way out
    summary = read_summary(out)
    assert summary["status"] == "interrupted", summary
    said = capsys.readouterr()
    assert "stopped by a signal; on the way out: RuntimeError" in said.out + said.err  # (said, not hidden)
    T.run(compose("config", overrides=[*SMALL, "resume=true"]), out)
    assert_same_run(reference, out)


def test_a_failed_start_leaves_the_run_as_it_was(hydra_ctx: None, tmp_path: Path, monkeypatch, capsys, snapshot):
    """A crashed run whose last.ckpt is corrupt (or was cut off): the resume is refused in one line and not a byte
    of the folder changes; the same for a finished run asked to start again without resume=true."""
    out = tmp_path / "run"
    _crashed_run(out, monkeypatch)
    last = out / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    before = snapshot(out)
    assert math.isnan(T.run(compose("config", overrides=[*SMALL, "resume=true"]), out))
    assert re.search(rf"error: checkpoint {last} cannot be read \(", capsys.readouterr().err)
    assert snapshot(out) == before
    last.write_bytes(b"")
    assert math.isnan(T.run(compose("config", overrides=[*SMALL, "resume=true"]), out))
    assert f"error: checkpoint {last} is empty (0 bytes)" in capsys.readouterr().err
    assert read_summary(out)["status"] == "failed" and "simulated crash" in read_summary(out)["reason"]


def test_overwrite_replaces_a_run_and_resume_with_overwrite_is_refused(
    reference: Path, tmp_path: Path, capsys, snapshot
):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "notes.txt").write_text("mine")
    cfg = compose("config", overrides=[*SMALL, "resume=true", "overwrite=true"])
    assert math.isnan(T.run(cfg, out))
    assert "resume=true and overwrite=true contradict each other" in capsys.readouterr().err
    before = snapshot(out)
    inside = f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}"
    assert math.isnan(T.run(compose("config", overrides=[*SMALL, "overwrite=true", inside]), out))
    assert "ckpt_path=" in capsys.readouterr().err and snapshot(out) == before  # would delete its own checkpoint
    T.run(compose("config", overrides=[*SMALL, "max_steps=6", "eval_every=6", "overwrite=true"]), out)
    summary = read_summary(out)
    assert summary["status"] == "ok" and summary["steps"] == 6 and len(summary["segments"]) == 1
    assert max(r["step"] for r in read_metrics(out / METRICS_FILE)) == 6  # nothing of the replaced run
    assert (out / "notes.txt").read_text() == "mine"  # files that are not the run's stay


def test_extending_a_finished_run_keeps_its_results_and_its_schedule(hydra_ctx: None, tmp_path: Path) -> None:
    """resume=true with a larger max_steps: a second segment, the first one's results kept (its summary segment and
    its test rows), and the learning rate stays at the end of the original schedule (0.1 x lr)."""
    out = tmp_path / "run"
    short = [*SMALL, "max_steps=12", "eval_every=6"]
    T.run(compose("config", overrides=short), out)
    first = read_summary(out)
    T.run(compose("config", overrides=[*short, "resume=true", "max_steps=18"]), out)
    summary = read_summary(out)
    assert summary["status"] == "ok" and summary["steps"] == 18 and summary["max_steps"] == 18
    assert [(s["kind"], s["from_step"], s["to_step"]) for s in summary["segments"]] == [
        ("new", 0, 12),
        ("extend", 12, 18),
    ]
    assert summary["segments"][0]["results"] == {k: first["metrics"][k] for k in ("val/acc_best", "test/acc")}
    tests = [r["step"] for r in read_metrics(out / METRICS_FILE) if "test/acc" in r]
    assert tests == [12, 18]
    assert OmegaConf.load(out / "config.yaml").max_steps == 12  # config.yaml is never rewritten
    lr = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"][0]
    assert lr["lr"] == pytest.approx(0.1 * 3e-2)


def test_checkpoints_load_with_weights_only(reference: Path) -> None:
    for name in ("best.ckpt", "last.ckpt"):
        ckpt = torch.load(reference / "checkpoints" / name, map_location="cpu", weights_only=True)
        layers = ckpt["hyper_parameters"]["attention"]  # each layer's AttentionConfig, as plain data
        assert layers and all(layer["score"] == "scaled_dot" for layer in layers)
    assert torch.load(reference / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 30


def test_jsonl_logger_truncate_counts_rows(tmp_path: Path) -> None:
    log = JsonlLogger(tmp_path)
    for step in range(5):
        log.log_metrics({"x": float(step)}, step=step)
    assert log.rows == 5
    log.finalize("success")
    with open(log.path, "a") as f:
        f.write('{"step": 5, "x": ')  # a row torn by a kill
    log = JsonlLogger(tmp_path)
    assert log.rows == 5
    log.truncate(3)
    log.log_metrics({"x": 9.0}, step=9)
    log.finalize("success")
    assert [r["step"] for r in read_metrics(log.path)] == [0, 1, 2, 9]
    assert log.rows == 4
    log.truncate(0)
    assert log.path.read_text() == "" and log.rows == 0


# ------------------------------------------------------------------------------------ a real kill (slow)


KILL_ARGS = (
    "d_model=16",
    "num_heads=2",
    "num_layers=1",
    "seed=3",
    "task.datamodule.num_train=128",
    "task.datamodule.num_val=64",
    "task.datamodule.num_test=64",
    "max_steps=100",
    "eval_every=10",
    "diagnostics.every_n_steps=10",
    "trainer.log_every_n_steps=5",
    "logger=wandb",
    "results_table=false",
    "diagnostics.heatmaps=false",
)


def _checkpoint_step(path: Path) -> int:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])
    except Exception:  # not there yet
        return -1


def _wandb_run_ids(run: Path) -> list[str]:
    """The run id of every offline W&B run folder in a run folder (``offline-run-<time>-<id>``)."""
    return [p.name.rsplit("-", 1)[1] for p in sorted((run / "wandb").glob("offline-run-*"))]


@pytest.fixture(scope="module")
def kill_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run that every killed-and-resumed run below must end as."""
    out = tmp_path_factory.mktemp("kill") / "reference"
    ref = run_train(*KILL_ARGS, f"hydra.run.dir={out}")
    assert ref.returncode == 0, ref.stderr[-3000:]
    return out


def _default_sigint() -> None:
    """In the child, before exec: SIGINT back to its default (a suite started in the background, e.g. with ``&``,
    runs with SIGINT ignored, which children inherit, and the SIGINT test would then signal a deaf process)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        train_cmd(*args),
        cwd=REPO,
        env=env or train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def _signal_after_checkpoint(proc: subprocess.Popen, run: Path, sig: int, step: int = 20) -> tuple[str, str]:
    """Send ``sig`` once last.ckpt holds ``step`` or later; the process's (stdout, stderr)."""
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline and _checkpoint_step(last) < step:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be signalled:\n{proc.communicate()[1][-3000:]}"
        proc.send_signal(sig)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_killed_run_resumes_at_the_same_step_with_the_same_result(kill_reference: Path, tmp_path: Path) -> None:
    """``python train.py`` killed with SIGKILL once last.ckpt holds step >= 20, then ``resume=true``: same final
    weights and metrics as an uninterrupted run, metrics.jsonl without duplicated or lost rows, the same W&B run."""
    run = tmp_path / "killed"
    _signal_after_checkpoint(_start(*KILL_ARGS, f"hydra.run.dir={run}"), run, signal.SIGKILL)
    killed_at = _checkpoint_step(run / "checkpoints" / "last.ckpt")
    assert 20 <= killed_at < 100
    killed = load_run(run)  # killed: the summary still says running, and readers see that nobody runs it
    assert read_summary(run)["status"] == "running" and killed.summary["status"] == "interrupted"
    wandb_id = (run / "wandb_id.txt").read_text().strip()

    resumed = run_train(*KILL_ARGS, f"hydra.run.dir={run}", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "weights_only" not in resumed.stderr and "not resumable" not in resumed.stderr, resumed.stderr[-3000:]
    summary = read_summary(run)
    assert summary["resumed_at_step"] >= killed_at  # the last checkpoint (a later one may have landed)
    assert summary["steps"] == 100
    assert [(s["kind"], s["status"]) for s in summary["segments"]] == [("new", "interrupted"), ("resume", "ok")]
    assert_same_run(kill_reference, run)

    # the W&B run went on under the same id: the killed part and the resumed part are two offline folders of it
    assert summary["wandb_id"] == wandb_id
    assert _wandb_run_ids(run) == [wandb_id, wandb_id]
    wandb_cli = Path(sys.executable).parent / "wandb"
    resumed_dir = sorted((run / "wandb").glob("offline-run-*"))[-1]
    records = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(resumed_dir)], capture_output=True, text=True, check=True
    ).stdout
    (run_record,) = [json.loads(line)["run"] for line in records.splitlines() if '"type":"run"' in line]
    assert run_record["run_id"] == wandb_id


@pytest.mark.slow
def test_sigint_ends_the_run_as_interrupted_and_the_printed_command_resumes_it(
    kill_reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "interrupted"
    out, err = _signal_after_checkpoint(_start(*KILL_ARGS, f"hydra.run.dir={run}"), run, signal.SIGINT)
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["reason"].startswith("interrupted at step ")
    assert summary["segments"][-1]["status"] == "interrupted"
    command = f"python train.py resume=true hydra.run.dir={run}"
    assert command in out, out[-2000:]
    assert "Traceback" not in out + err

    resumed = run_train(*command.split()[2:])  # exactly the printed command: the run's own overrides come back
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(kill_reference, run)


KILLER = """
import io, os, signal

import torch

import attnlab.module

WHERE, _, AT = os.environ.get("ATTNLAB_TEST_KILL", "").partition(":")
if WHERE == "checkpoint":  # SIGKILL half-way through writing last.ckpt at step AT
    save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("global_step") == int(AT) and "last.ckpt" in str(getattr(f, "name", "")):
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *args, **kwargs)

    torch.save = torch_save
elif WHERE == "test":  # SIGKILL at test batch AT
    test_step = attnlab.module.EncoderModule.test_step

    def killing_test_step(self, batch, batch_idx):
        if batch_idx == int(AT):
            os.kill(os.getpid(), signal.SIGKILL)
        return test_step(self, batch, batch_idx)

    attnlab.module.EncoderModule.test_step = killing_test_step
"""


# the same run without W&B (a logger is one of runs.NEUTRAL_KEYS: it cannot change a run's numbers, so the reference
# with W&B still holds); W&B across a kill and a resume is tested by test_killed_run_resumes_at_the_same_step_...
AWKWARD_ARGS = tuple("logger=none" if arg == "logger=wandb" else arg for arg in KILL_ARGS)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["checkpoint:30", "test:1"], ids=["during-a-checkpoint-write", "during-the-test"])
def test_a_kill_at_an_awkward_moment_resumes_to_the_uninterrupted_result(
    kill_reference: Path, tmp_path: Path, where: str
) -> None:
    """SIGKILL half-way through writing last.ckpt (the previous one stays whole) or in the middle of the test
    phase (training had ended): the resume ends exactly as the uninterrupted run."""
    assert "logger=none" in AWKWARD_ARGS
    (tmp_path / "attnlab_test_killer.py").write_text(KILLER)
    env = {**train_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    run = tmp_path / "run"
    args = (*AWKWARD_ARGS, "imports=[attnlab_test_killer]", f"hydra.run.dir={run}")
    killed = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        env={**env, "ATTNLAB_TEST_KILL": where},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    step = _checkpoint_step(run / "checkpoints" / "last.ckpt")
    if where.startswith("checkpoint"):
        assert step == 20  # the torn write never replaced the previous checkpoint
        assert list((run / "checkpoints").glob(".last.ckpt.*.tmp")), "the torn temporary file is there"
    else:
        assert step == 100 and read_summary(run)["status"] == "running"
        assert any("test/acc" in r for r in read_metrics(run / METRICS_FILE)) is False

    resumed = subprocess.run(  # (a resume imports a folder's modules only when the command line names them)
        [sys.executable, "train.py", "resume=true", "imports=[attnlab_test_killer]", f"hydra.run.dir={run}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list((run / "checkpoints").glob(".*.tmp"))
    assert_same_run(kill_reference, run)
