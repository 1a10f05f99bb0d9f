"""What a run says: one start line, a line per validation (:mod:`attnlab.training.progress`), the results table
and the run folder at the end; all of it also in the run's ``train.log``. Libraries' routine messages (GPU/TPU
availability, tips, checkpoint restores) are kept out of the output. Nothing here imports Lightning when imported
(the results table asks the task registry for the task's headline metric, :func:`headline_metric`, when it is
printed, where the summary does not record it).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from rich.table import Table

from attnlab.console import plain_console, printable
from attnlab.runs import Summary, nofollow_opener

__all__ = [
    "RunLog",
    "bpc",
    "clock",
    "compact",
    "headline_metric",
    "quiet_libraries",
    "results_line",
    "results_table",
    "stdout_gone",
]

LOG = logging.getLogger("attnlab")

# routine warnings of the libraries that a user can do nothing about
_QUIET_WARNINGS = (
    r".*treespec.*",  # Lightning's use of torch's pytree API
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


def stdout_gone() -> None:
    """After a write to stdout failed because its reader has gone (``| head``): point stdout at os.devnull, as
    Python's signal docs advise ("Note on SIGPIPE"), so that no later write, nor the flush at exit, fails again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class _NoFollowFileHandler(logging.FileHandler):
    """A log file opened without following a symbolic link (a linked train.log is refused, never appended to)."""

    def _open(self) -> Any:
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors, opener=nofollow_opener)


class RunLog:
    """The run's voice: lines on stdout (errors on stderr) and, once :meth:`open`, in ``train.log``.

    Only the process that writes the run folder (rank 0) speaks; the others are created with ``enabled=False``.

    When stdout's reader has gone (``| head``), stdout goes to os.devnull from then on and train.log still gets
    every line. Until training ends, that ends the run as interrupted (resumable, exit 130), as Ctrl-C would; once
    it has ended (:attr:`finished`, set by the progress callback; the test prints nothing) it changes nothing: the
    run is tested and recorded, and the command ends as it would have.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.console = plain_console()  # names and values are printed as text, never as markup
        self.console.on_broken_pipe = self._stdout_gone  # (Rich calls it on BrokenPipeError)
        self._handler: logging.Handler | None = None
        self.finished = False

    def open(self, path: Path) -> None:
        """Append the run's lines to ``path`` (train.log), with timestamps."""
        if not self.enabled or self._handler is not None:
            return
        self._handler = _NoFollowFileHandler(path, encoding="utf-8")
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
            LOG.info(message)
            self.console.print(message)

    def error(self, message: str) -> None:
        """``error: <message>`` on stderr (and in train.log when it is open)."""
        print(f"error: {printable(message)}", file=sys.stderr, flush=True)
        if self._handler is not None:
            LOG.error(message)

    def table(self, table: Table, text: str = "") -> None:
        """Print ``table`` (the results: the run has finished); train.log gets ``text`` instead (one line)."""
        self.finished = True
        if self.enabled:
            if text:
                LOG.info(text)
            self.console.print(table)

    def _stdout_gone(self) -> None:
        self.console.quiet = True
        stdout_gone()
        if not self.finished:
            raise SystemExit(1)  # (what Rich does)


def clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) for a duration in seconds."""
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


def _pct(metrics: dict[str, Any], key: str) -> str:
    value = metrics.get(key)
    return "-" if value is None else f"{100 * value:.1f}%"


def bpc(metrics: dict[str, Any], key: str) -> str:
    """Bits per byte (``val/bpc``, ``test/bpc``), or "-"."""
    value = metrics.get(key)
    return "-" if value is None else f"{value:.3f}"


def compact(n: float | None) -> str:
    """A count in at most 3 significant figures with k, M, G, T, P (``1.2M``, ``950k``, ``12``); ``-`` for None."""
    if n is None or not math.isfinite(n):
        return "-"
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 999.5:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


def headline_metric(summary: Summary) -> str:
    """The metric the run's task declares as its headline (:meth:`attnlab.tasks.base.SequenceTask.headline_metric`):
    the summary's ``headline_metric`` where it records one, else the registered task's for the test lengths its
    ``test/acc@L`` metrics name (``test/acc``; ``test/bpc`` for language modelling; ``test/acc@<longest>`` for a
    state-tracking task with ``test_lengths``); the base class's rule for a task the registry does not know."""
    recorded = getattr(summary, "headline_metric", None)
    if isinstance(recorded, str) and recorded:
        return recorded
    from attnlab.tasks import task_class
    from attnlab.tasks.base import SequenceTask

    lengths = sorted(
        {int(length) for key in summary.metrics for head, _, length in [key.rpartition("@")] if length.isdigit()}
    )
    try:
        cls = task_class(summary.task) if summary.task else SequenceTask
    except ValueError:  # (UnknownNameError: a task of a module not imported here)
        cls = SequenceTask
    try:
        return cls.headline_metric(lengths)
    except Exception:  # (a declaration that breaks must not cost the results table)
        return SequenceTask.headline_metric(lengths)


def _metric_text(metrics: dict[str, Any], key: str) -> str:
    """A metric as the results show it: bits per byte with three decimals, an accuracy as a percentage."""
    return bpc(metrics, key) if key.split("@")[0].endswith("bpc") else _pct(metrics, key)


def _column_name(key: str) -> str:
    """``test acc@64`` for ``test/acc@64``."""
    return key.replace("/", " ", 1)


def results_line(summary: Summary) -> str:
    """The results in one line (for train.log): best val acc, test acc (and test bpc), then the task's headline
    metric where it is another (``test acc@64 51.2% (headline)``: a state-tracking task with test lengths)."""
    m = summary.metrics
    line = f"{summary.status}: best val acc {_pct(m, 'val/acc_best')}, test acc {_pct(m, 'test/acc')}"
    if m.get("test/bpc") is not None:  # a language-modelling task (task=text)
        line += f", test bpc {bpc(m, 'test/bpc')}"
    headline = headline_metric(summary)
    if headline not in ("test/acc", "test/bpc") and m.get(headline) is not None:
        line += f", {_column_name(headline)} {_metric_text(m, headline)} (headline)"
    return (
        line + f", {summary.steps} steps, {summary.wall_time_s or 0:.1f} s" + (" (smoke run)" if summary.smoke else "")
    )


def results_table(summary: Summary) -> Table:
    """The short results table printed at the end of a run (and for a complete run asked to resume); ``FLOPs/tok``
    is the summary's ``flops_per_token`` (a training step's, forward and backward), ``-`` when not counted.

    The title names the task's headline metric (:func:`headline_metric`), the one a comparison is read by; where it
    is none of the usual columns (``test acc@64``: a state-tracking task's longest test length), it is the first
    metric column, marked ``★``."""
    caption = "SMOKE RUN (debug=fast): a handful of steps on tiny data to check that it runs, not a result"
    m = summary.metrics
    headline = headline_metric(summary)
    table = Table(
        title=f"attnlab · {summary.task} · {summary.status} · headline: {_column_name(headline)}",
        title_justify="left",
        caption=caption if summary.smoke else None,
        caption_justify="left",
    )
    bits = m.get("test/bpc") is not None  # a language-modelling task (task=text)
    extra = headline not in ("test/acc", "test/bpc", "val/acc_best")  # (a test length's metric: a column first)
    columns = ["attention", "d_k", "heads", "params", "FLOPs/tok", "steps"]
    columns += [f"★ {_column_name(headline)}"] * extra
    columns += ["best val acc", "test acc"] + ["test bpc"] * bits
    for col in [*columns, "time"]:
        table.add_column(col, justify="left" if col == "attention" else "right", no_wrap=col != "attention")
    pattern = f" · pattern {summary.pattern}" if summary.pattern else ""
    row = [f"{summary.attention or summary.variant}{pattern}", str(summary.d_k), str(summary.num_heads)]
    row += [f"{summary.params or 0:,}", compact(summary.flops_per_token), str(summary.steps)]
    row += [_metric_text(m, headline)] * extra
    row += [_pct(m, "val/acc_best"), _pct(m, "test/acc")]
    row += [bpc(m, "test/bpc")] * bits
    table.add_row(*row, f"{summary.wall_time_s or 0:.1f} s")
    return table
