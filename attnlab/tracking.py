"""Local run files, written whatever the logger: ``metrics.jsonl`` (one JSON object per logging step) and
``summary.json`` (final metrics, key config values, parameter count, status, wall time).

The dashboard reads only these files (plus the resolved ``config.yaml``), never a W&B server.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from argparse import Namespace
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

__all__ = ["METRICS_FILE", "SUMMARY_FILE", "JsonlLogger", "read_metrics", "write_json_atomic"]

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _plain(value: Any) -> Any:
    """A JSON-safe Python number (NaN and inf become None... kept as strings would break readers)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON through a temporary file and a rename, so a reader never sees half a
    file and a crash never leaves one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` file (a torn last line, from a killed run, is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class JsonlLogger(Logger):
    """A Lightning logger that appends ``{"step": ..., "epoch": ..., <name>: <value>, ...}`` rows to
    ``<save_dir>/metrics.jsonl``, one per logging call, flushed at once.

    ``rows`` counts the rows in the file. Every checkpoint records it, and a resumed run first cuts the file back
    to that many rows (``truncate``): the rows logged between the checkpoint and the interruption go, whatever
    their step, and the resumed run logs them again, so the file has no duplicated and no lost rows. Only rank 0
    writes (distributed runs).
    """

    def __init__(self, save_dir: str | Path) -> None:
        super().__init__()
        self._save_dir = Path(save_dir)
        self._save_dir.mkdir(parents=True, exist_ok=True)
        self.path = self._save_dir / METRICS_FILE
        self._file = None
        self._rows: int | None = None

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self._save_dir)

    @property
    def log_dir(self) -> str:
        return str(self._save_dir)

    @property
    def rows(self) -> int:
        """Complete rows in ``metrics.jsonl`` (0 before the first)."""
        if self._rows is None:
            self._rows = len(read_metrics(self.path)) if self.path.exists() else 0
        return self._rows

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        self.finalize("resume")
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)
        self._rows = len(rows)

    @rank_zero_only
    def truncate(self, rows: int) -> None:
        """Keep only the first ``rows`` rows (and drop a torn last line): ``truncate(0)`` starts the file anew,
        a resumed run cuts it back to the row count recorded in its checkpoint."""
        kept = read_metrics(self.path)[: max(0, rows)] if self.path.exists() else []
        self._rewrite(kept)

    @rank_zero_only
    def truncate_from(self, step: int) -> None:
        """Drop rows with ``step >= step`` (resume from a checkpoint that has no row count)."""
        if not self.path.exists():
            return
        self._rewrite([r for r in read_metrics(self.path) if r.get("step", -1) < step])

    def _handle(self):
        if self._file is None:
            self._file = open(self.path, "a", buffering=1)
        return self._file

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters go to config.yaml and summary.json, not here."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {"step": step}
        row.update({k: _plain(v) for k, v in metrics.items()})
        rows = self.rows
        self._handle().write(json.dumps(row) + "\n")
        self._rows = rows + 1

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
