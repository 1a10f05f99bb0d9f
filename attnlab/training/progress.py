"""The progress of training: one bar over the run's optimizer steps and a line per validation.

On a terminal the bar is live (Rich); elsewhere (a file, a pipe, a SLURM log) there is no bar and no ANSI codes,
only the lines, which also go to train.log. In a multirun, the bar and each line begin with the job's number
(``#3``, as Hydra numbers the jobs and their folders), so that the interleaved lines of jobs that run at once
(joblib) say whose they are. :class:`StepTimer` times the training steps (the summary's ``step_time_s``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar

from attnlab.training.console import RunLog, clock

__all__ = ["StepProgress", "StepTimer", "job_tag"]


def job_tag() -> str:
    """``#k`` for the job numbered k of the current multirun (the number its folder's name begins with), else ""."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return ""
    hc = HydraConfig.get()
    num = hc.job.get("num") if hc.mode == RunMode.MULTIRUN else None
    return "" if num is None else f"#{num}"


class StepProgress(ProgressBar):
    """One bar over the run's optimizer steps (Lightning's per-epoch bar reads "Epoch 3/-2" when training is
    bounded by steps), live on a terminal only, and at every validation one line: step k/N, train loss, val
    accuracy (best so far), elapsed and estimated time left."""

    def __init__(self, log: RunLog, max_steps: int, live: bool = True) -> None:
        super().__init__()
        self.runlog = log
        self.max_steps = max_steps
        self._enabled = live
        self._bar: Any = None
        self._task: Any = None
        self._start = (0.0, 0)
        self.tag = job_tag()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = (time.perf_counter(), trainer.global_step)
        if self._enabled and self.runlog.enabled and self.runlog.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"{self.tag} train".lstrip()),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.runlog.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.max_steps, completed=trainer.global_step, info="")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._bar is not None:
            loss = trainer.callback_metrics.get("train/loss")
            info = f"loss {float(loss):.3f}" if loss is not None else ""
            self._bar.update(self._task, completed=trainer.global_step, info=info)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.runlog.enabled:
            return
        step, metrics = trainer.global_step, trainer.callback_metrics
        parts = [self.tag] if self.tag else []
        parts.append(f"step {step}/{self.max_steps}")
        if "train/loss" in metrics:
            parts.append(f"train loss {float(metrics['train/loss']):.4f}")
        if "val/acc" in metrics:
            best = metrics.get("val/acc_best")
            parts.append(
                f"val acc {100 * float(metrics['val/acc']):.1f}%"
                + (f" (best {100 * float(best):.1f}%)" if best is not None else "")
            )
        started, first = self._start
        elapsed, done = time.perf_counter() - started, step - first
        timing = f"{clock(elapsed)} elapsed"
        if 0 < done and step < self.max_steps:
            timing += f", ~{clock(elapsed / done * (self.max_steps - step))} left"
        self.runlog.info(" · ".join([*parts, timing]))

    def _stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()
        self.runlog.finished = True  # (a broken stdout no longer stops the run: see RunLog)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()


class StepTimer(L.Callback):
    """The wall time of each training step of this process, from ``on_train_batch_start`` to
    ``on_train_batch_end`` (forward, backward and optimizer step; as the first callback, the others' work at the
    end of a batch, a checkpoint or the diagnostics, falls outside). On a GPU each end waits for its kernels. Keeps
    no state in checkpoints and draws no random numbers."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._started: float | None = None

    def _sync(self, trainer: L.Trainer) -> None:
        import torch

        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._sync(trainer)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._started is not None:
            self._sync(trainer)
            self.times.append(time.perf_counter() - self._started)
            self._started = None

    def median(self) -> float | None:
        """The median step time in seconds, or None when no step was timed."""
        return statistics.median(self.times) if self.times else None
