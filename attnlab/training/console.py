"""What a run says: one start line, a progress bar over the real step total, a line per validation, the results
table and the run folder at the end; all of it (bar aside) also in the run's ``train.log``. Libraries' routine
messages (GPU/TPU availability, tips, checkpoint restores) are kept out of the output.

On a terminal the bar is live (Rich); elsewhere (a file, a pipe, a SLURM log) there is no bar and no ANSI codes,
only the lines.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from rich.console import Console
from rich.table import Table

from attnlab.runs import Summary
from attnlab.training.sweep import clock

__all__ = ["RunLog", "StepProgress", "quiet_libraries", "results_line", "results_table"]

LOG = logging.getLogger("attnlab")

# routine warnings of the libraries that a user can do nothing about
_QUIET_WARNINGS = (
    r".*treespec.*",  # Lightning's use of torch's pytree API
    r".*self\.log\('val/acc_best', \.\.\., sync_dist=True\).*",  # a MaxMetric's compute() is already reduced
    r"Checkpoint directory .* exists and is not empty\.",  # a resumed run writes into its own checkpoints/
    r".*does not have many workers which may be a bottleneck.*",  # the tasks live in memory
    r"The number of training batches .* is smaller than the logging interval.*",
)


def quiet_libraries() -> None:
    """Silence Lightning's informational messages and routine warnings (errors and other warnings still show)."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


class RunLog:
    """The run's voice: lines on stdout (errors on stderr) and, once :meth:`open`, in ``train.log``.

    Only the process that writes the run folder (rank 0) speaks; the others are created with ``enabled=False``.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.console = Console(highlight=False, soft_wrap=True)
        if not self.console.is_terminal:  # a log file: room for the results table (Rich would assume 80 columns)
            self.console.width = 120
        self._handler: logging.Handler | None = None

    def open(self, path: Path) -> None:
        """Append the run's lines to ``path`` (train.log), with timestamps."""
        if not self.enabled or self._handler is not None:
            return
        self._handler = logging.FileHandler(path, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        LOG.addHandler(self._handler)
        LOG.setLevel(logging.INFO)
        LOG.propagate = False

    def close(self) -> None:
        if self._handler is not None:
            LOG.removeHandler(self._handler)
            self._handler.close()
            self._handler = None

    def info(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False)
            LOG.info(message)

    def error(self, message: str) -> None:
        """``error: <message>`` on stderr (and in train.log when it is open)."""
        print(f"error: {message}", file=sys.stderr, flush=True)
        if self._handler is not None:
            LOG.error(message)

    def table(self, table: Table, text: str = "") -> None:
        """Print ``table``; train.log gets ``text`` instead (one line)."""
        if self.enabled:
            self.console.print(table)
            if text:
                LOG.info(text)


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

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = (time.perf_counter(), trainer.global_step)
        if self._enabled and self.runlog.enabled and self.runlog.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("train"),
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
        parts = [f"step {step}/{self.max_steps}"]
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

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()


def _pct(metrics: dict[str, Any], key: str) -> str:
    value = metrics.get(key)
    return "-" if value is None else f"{100 * value:.1f}%"


def results_line(summary: Summary) -> str:
    """The results in one line (for train.log)."""
    m = summary.metrics
    line = f"{summary.status}: best val acc {_pct(m, 'val/acc_best')}, test acc {_pct(m, 'test/acc')}"
    return (
        line + f", {summary.steps} steps, {summary.wall_time_s or 0:.1f} s" + (" (smoke run)" if summary.smoke else "")
    )


def results_table(summary: Summary) -> Table:
    """The short results table printed at the end of a run (and for a complete run asked to resume)."""
    caption = "SMOKE RUN (debug=fast): a handful of steps on tiny data to check that it runs, not a result"
    table = Table(
        title=f"attnlab · {summary.task} · {summary.status}",
        title_justify="left",
        caption=caption if summary.smoke else None,
        caption_justify="left",
    )
    for col in ("variant", "d_k", "heads", "params", "steps", "best val acc", "test acc", "wall time"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    table.add_row(
        str(summary.variant),
        str(summary.d_k),
        str(summary.num_heads),
        f"{summary.params or 0:,}",
        str(summary.steps),
        _pct(summary.metrics, "val/acc_best"),
        _pct(summary.metrics, "test/acc"),
        f"{summary.wall_time_s or 0:.1f} s",
    )
    return table
