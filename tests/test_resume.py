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
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hydra import compose

import attnlab.callbacks
from attnlab import training as T
from attnlab.callbacks import DivergenceGuard
from attnlab.runs import METRICS_FILE, SUMMARY_FILE, load_run, read_metrics
from attnlab.training.loggers import JsonlLogger

REPO = Path(__file__).resolve().parents[1]

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
)


pytestmark = pytest.mark.usefixtures("restore_process_state")


def summary_of(folder: Path) -> dict:
    return json.loads((folder / SUMMARY_FILE).read_text())


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights_of(a), weights_of(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ: {different[:5]}"


def assert_same_run(ref: Path, resumed: Path) -> None:
    """Two run folders that must agree exactly (apart from timings and paths)."""
    a, b = summary_of(ref), summary_of(resumed)
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


class _CrashAt(DivergenceGuard):
    """Raises just before the optimizer step after ``step`` steps (the run ends failed, as if killed)."""

    steps: ClassVar[list[int]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.steps and trainer.global_step == self.steps[0]:
            raise RuntimeError(f"simulated crash at step {self.steps.pop(0)}")


# ------------------------------------------------------------------------------------ determinism


def test_same_seed_same_metrics_other_seed_other_metrics(hydra_ctx: None, tmp_path: Path) -> None:
    overrides = ["debug=fast", "logger=none", "results_table=false", "max_steps=20", "eval_every=10"]
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        T.run(compose("config", overrides=[*overrides, f"seed={seed}"]), tmp_path / name)
    a, b, c = (summary_of(tmp_path / n) for n in "abc")
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
    assert summary_of(out)["status"] == "ok"
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
    crashed = summary_of(out)
    assert crashed["status"] == "failed" and "simulated crash at step 15" in crashed["reason"]
    rows_at_crash = read_metrics(out / METRICS_FILE)
    assert max(r["step"] for r in rows_at_crash) > 12  # rows logged after the checkpoint, to be dropped

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        T.run(compose("config", overrides=[*SMALL, "resume=true"]), out)
    second = summary_of(out)
    assert second["status"] == "failed" and "simulated crash at step 26" in second["reason"]
    assert second["resumed_at_step"] == 12
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "not resumable" in m or "weights_only" in m], messages

    T.run(compose("config", overrides=[*SMALL, "ckpt_path=last"]), out)
    assert summary_of(out)["resumed_at_step"] == 24
    assert_same_run(reference, out)
    final = summary_of(out)["metrics"]
    assert final["val/acc"] < final["val/acc_best"]  # the best came before the last resume, which restored it


def test_resume_of_a_folder_without_a_run_is_refused_and_leaves_nothing(
    hydra_ctx: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    value = T.run(compose("config", overrides=[*SMALL, "resume=true"]), out)
    assert math.isnan(value)
    assert not out.exists()  # the folder made for the refused run is gone again
    assert f"error: nothing to resume in {out}: it holds no run" in capsys.readouterr().err


def test_checkpoints_load_with_weights_only(reference: Path) -> None:
    for name in ("best.ckpt", "last.ckpt"):
        ckpt = torch.load(reference / "checkpoints" / name, map_location="cpu", weights_only=True)
        assert ckpt["hyper_parameters"]["score"] == "scaled_dot"
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
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNLAB_UID", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline")
    return env


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300
    )


def _checkpoint_step(path: Path) -> int:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])
    except Exception:  # not there yet
        return -1


def _wandb_run_ids(run: Path) -> list[str]:
    """The run id of every offline W&B run folder in a run folder (``offline-run-<time>-<id>``)."""
    return [p.name.rsplit("-", 1)[1] for p in sorted((run / "wandb").glob("offline-run-*"))]


@pytest.mark.slow
def test_killed_run_resumes_at_the_same_step_with_the_same_result(tmp_path: Path) -> None:
    """``python train.py`` killed with SIGKILL once last.ckpt holds step >= 20, then the same command with
    ``resume=true``: same final weights and metrics as an uninterrupted run, metrics.jsonl without duplicated or
    lost rows, and the same W&B run."""
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "train.py", *KILL_ARGS, f"hydra.run.dir={run}"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline and _checkpoint_step(last) < 20:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.communicate()[1][-3000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    killed_at = _checkpoint_step(last)
    assert 20 <= killed_at < 100
    killed = load_run(run)  # killed: the summary still says running, and readers see that nobody runs it
    assert summary_of(run)["status"] == "running" and killed.summary["status"] == "interrupted"
    wandb_id = (run / "wandb_id.txt").read_text().strip()

    resumed = _train(*KILL_ARGS, f"hydra.run.dir={run}", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "weights_only" not in resumed.stderr and "not resumable" not in resumed.stderr, resumed.stderr[-3000:]
    summary = summary_of(run)
    assert summary["resumed_at_step"] >= killed_at  # the last checkpoint (a later one may have landed)
    assert summary["steps"] == 100

    reference = tmp_path / "reference"
    ref = _train(*KILL_ARGS, f"hydra.run.dir={reference}")
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_same_run(reference, run)

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
