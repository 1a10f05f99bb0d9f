"""The run folder: its layout, the summary's schema, and the only functions that read and write them.

A run folder is what a researcher keeps, copies, compares and resumes::

    config.yaml       the fully resolved config; written once when the run starts, never rewritten
    summary.json      status, key settings, final metrics, and one segment per start (see :class:`Summary`)
    metrics.jsonl     every logged metric, one JSON object per line
    train.log         the run's own log (start, validations, end, errors)
    checkpoints/      best.ckpt (best val/acc, used for the test) and last.ckpt (every validation)
    attention/        attention maps saved at the end (maps.png)
    wandb/            the W&B run, with logger=wandb (its id in wandb_id.txt)
    .attnlab.lock     held (flock, through ``filelock``) while a process writes the folder

Every path stored in summary.json is relative to the folder, so a copied or moved folder is self-contained.
Files are replaced atomically (a temporary file in the same folder, then a rename) and created with the user's
umask. Readers never fail on one bad run: :func:`load_run` reports a missing, empty or corrupt file as a
problem of that run, and the caller goes on with the others.

A sweep folder holds one run folder per job and ``sweep.jsonl``: a header line (jobs expected, start time) and
one line per finished job (:class:`SweepJournal`).

This module imports neither torch nor Lightning, so that readers (dashboard, experiments) stay light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

__all__ = [
    "ATTENTION_DIR",
    "CHECKPOINT_DIR",
    "CONFIG_FILE",
    "LOG_FILE",
    "METRICS_FILE",
    "NEUTRAL_KEYS",
    "SCHEMA_VERSION",
    "SUMMARY_FILE",
    "LoadedRun",
    "MetricsFile",
    "RunFileError",
    "RunFolder",
    "RunFolderBusy",
    "Segment",
    "Summary",
    "SweepJournal",
    "atomic_open",
    "config_defaults",
    "find_runs",
    "flatten_config",
    "is_neutral",
    "load_run",
    "read_metrics",
    "utc_now",
    "write_json_atomic",
]

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"
CHECKPOINT_DIR = "checkpoints"
ATTENTION_DIR = "attention"
WANDB_ID_FILE = "wandb_id.txt"
LOCK_FILE = ".attnlab.lock"
HOLDER_FILE = ".attnlab.lock.json"
SWEEP_FILE = "sweep.jsonl"
SCHEMA_VERSION = 2
"""2: ``schema_version``, ``segments``, paths relative to the folder. Version 1 (no ``schema_version``) stored
absolute paths; :meth:`Summary.from_dict` reads it."""

LOCK_WAIT_S = 2.0  # how long a second writer waits for the lock (a dashboard may probe it for a moment)
# the files and folders that make up a run (what overwrite=true removes); anything else in the folder is left alone
RUN_ENTRIES = (CONFIG_FILE, SUMMARY_FILE, METRICS_FILE, LOG_FILE, CHECKPOINT_DIR, ATTENTION_DIR, "attention_maps.png")
RUN_ENTRIES += ("wandb", WANDB_ID_FILE, "csv", ".hydra")


NEUTRAL_KEYS = (
    "logger",
    "threads",
    "results_table",
    "resume",
    "ckpt_path",
    "overwrite",
    "diagnostics.heatmaps",
    "trainer.enable_progress_bar",
)
"""config.yaml keys (and everything under them) that cannot change a run's numbers: a resume may change them, and
the dashboard never compares runs by them."""


def is_neutral(key: str) -> bool:
    """Whether the dotted config ``key`` is one of :data:`NEUTRAL_KEYS` or lies under one."""
    return any(key == root or key.startswith(root + ".") for root in NEUTRAL_KEYS)


def flatten_config(node: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a nested config as ``{"a.b": value}``; an empty mapping is a leaf (``{}``)."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten_config(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


@functools.cache
def config_defaults() -> dict[str, Any]:
    """The plain (not nested) top-level values of ``conf/config.yaml`` (``compile: false``, ``lr: 0.003``, ...):
    what a run of an older attnlab, whose config lacks a key added since, ran with. Empty when ``conf/`` is not
    beside the package."""
    from omegaconf import OmegaConf

    path = Path(__file__).resolve().parents[1] / "conf" / "config.yaml"
    if not path.is_file():
        return {}
    values = OmegaConf.to_container(OmegaConf.load(path))
    return {k: v for k, v in values.items() if isinstance(k, str) and not isinstance(v, (dict, list))}


class RunFileError(Exception):
    """A run file that is missing, empty or not what it should be. The message is one line naming the file."""


class RunFolderBusy(Exception):
    """Another process holds the run folder's lock. The message names the holder."""


def utc_now() -> str:
    """The current time as ISO 8601 UTC, to the second."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


# ---------------------------------------------------------------------------------------------------- atomic files


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing and, if the block ends without an exception, flush it
    to disk and rename it over ``path``: readers see the old file or the new one, never half of one, and a crash
    leaves at most a hidden ``.<name>.*.tmp`` behind. The file gets the user's umask (``mkstemp`` would give 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
    try:
        with open(tmp, "x" + mode.replace("w", "")) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically (:func:`atomic_open`); NaN and inf become null."""
    with atomic_open(path) as f:
        json.dump(_json_safe(data), f, indent=2, default=str)
        f.write("\n")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise RunFileError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if not text.strip():
        raise RunFileError(f"{path} is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunFileError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


# ---------------------------------------------------------------------------------------------------- summary


@dataclass
class Segment:
    """One start of a run: the first (``new``), a continuation after a crash or kill (``resume``), or a
    continuation past the original ``max_steps`` (``extend``)."""

    kind: str
    started: str
    from_step: int
    overrides: list[str] = field(default_factory=list)
    status: str = "running"
    reason: str | None = None
    to_step: int | None = None
    wall_time_s: float | None = None
    results: dict[str, float] = field(default_factory=dict)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    compiled: bool | None = None  # compile=true: whether this part trained compiled (False: it fell back to eager)


@dataclass
class Summary:
    """summary.json. ``status``: running | ok | failed | interrupted (``reason`` says why when not ok).

    The key settings (variant ... differential) come from the config when the run starts; ``metrics`` are the
    final values (train/val/test and the attention diagnostics ``attn/*``); ``attn_init`` the step-0 diagnostics;
    ``chance_accuracy`` the accuracy of guessing (the task's, e.g. 1/num_pairs for MQAR; else 1/classes).
    ``wall_time_s`` is the sum over ``segments``. ``best_checkpoint`` and ``resumed_from`` are relative to the
    run folder (or as given, for a ``ckpt_path`` outside it).
    """

    status: str = "running"
    reason: str | None = None
    variant: str | None = None
    mask: str | None = None
    task: str | None = None
    d_k: int | None = None
    num_heads: int | None = None
    d_model: int | None = None
    num_layers: int | None = None
    seed: int | None = None
    lr: float | None = None
    batch_size: int | None = None
    max_steps: int | None = None
    pos_encoding: str | None = None
    variant_params: dict[str, Any] = field(default_factory=dict)
    normalizer: str | None = None
    position_bias: str | None = None
    num_kv_heads: int | None = None
    qk_norm: str | None = None
    softcap: float | None = None
    differential: bool | None = None
    smoke: bool = False
    chance_accuracy: float | None = None
    params: int | None = None
    steps: int | None = None
    metrics: dict[str, float | None] = field(default_factory=dict)
    attn_init: dict[str, float | None] = field(default_factory=dict)
    best_checkpoint: str | None = None
    resumed_from: str | None = None
    resumed_at_step: int | None = None
    wall_time_s: float | None = None
    threads: int | None = None
    device: str | None = None
    world_size: int | None = None
    torch: str | None = None
    launch_id: str | None = None
    wandb_id: str | None = None
    overrides: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    metrics_rows_floor: int = 0
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (status first)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        """Read a summary of any schema version; unknown keys are dropped, version 1 paths made relative."""
        if not isinstance(data, dict):
            raise RunFileError(f"a summary must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        seg_names = {f.name for f in dataclasses.fields(Segment)}
        segments = []
        for seg in data.get("segments") or []:
            if isinstance(seg, dict) and {"kind", "started", "from_step"} <= seg.keys():
                segments.append(Segment(**{k: v for k, v in seg.items() if k in seg_names}))
        kwargs["segments"] = segments
        for key in ("best_checkpoint", "resumed_from"):  # version 1 stored absolute paths
            if isinstance(kwargs.get(key), str) and Path(kwargs[key]).is_absolute() and data.get("run_dir"):
                with contextlib.suppress(ValueError):
                    kwargs[key] = Path(kwargs[key]).relative_to(data["run_dir"]).as_posix()
        kwargs["schema_version"] = SCHEMA_VERSION
        return cls(**kwargs)

    @property
    def finished(self) -> bool:
        """Whether the run completed (status ok)."""
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------------- metrics


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (or of a run folder's); blank, torn (a killed writer's last line) and
    non-object lines are skipped; a missing file has no rows."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows: list[dict[str, Any]] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return rows
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class MetricsFile:
    """``metrics.jsonl``, appended one row at a time (flushed at once) and cut back on resume.

    ``rows`` counts the complete rows. Every checkpoint records it; a resumed run first cuts the file back to
    that many rows (:meth:`truncate`), so the rows logged between the checkpoint and the interruption are
    logged once, by the resumed run.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._rows: int | None = None

    @property
    def rows(self) -> int:
        """Complete rows in the file (0 before the first)."""
        if self._rows is None:
            self._rows = len(read_metrics(self.path))
        return self._rows

    def append(self, row: dict[str, Any]) -> None:
        """Write one row (NaN and inf become null)."""
        rows = self.rows  # counted before the first append
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        self._file.write(json.dumps(_json_safe(row)) + "\n")
        self._rows = rows + 1

    def truncate(self, rows: int) -> None:
        """Keep the first ``rows`` complete rows (and drop a torn last line); ``truncate(0)`` empties the file."""
        self._rewrite(read_metrics(self.path)[: max(0, rows)])

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        self.close()
        with atomic_open(self.path) as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        self._rows = len(rows)

    def close(self) -> None:
        """Close the file (it reopens on the next append)."""
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------------------------- the folder


class RunFolder:
    """One run folder: where each file lives, and the only code that reads or writes them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    # ------------------------------------------------------------------------ layout
    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def log_path(self) -> Path:
        return self.path / LOG_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / CHECKPOINT_DIR

    @property
    def attention_dir(self) -> Path:
        return self.path / ATTENTION_DIR

    @property
    def wandb_id_path(self) -> Path:
        return self.path / WANDB_ID_FILE

    def checkpoint(self, name: str) -> Path:
        """``checkpoints/<name>.ckpt`` (``best`` or ``last``)."""
        return self.checkpoint_dir / f"{name}.ckpt"

    def relative(self, path: str | Path | None) -> str | None:
        """``path`` relative to the folder when it lies inside it, else as given."""
        if path is None:
            return None
        try:
            return Path(path).resolve().relative_to(self.path.resolve()).as_posix()
        except ValueError:
            return str(path)

    # ------------------------------------------------------------------------ state
    def holds_run(self) -> bool:
        """Whether a run has started here (config.yaml, summary.json, metrics.jsonl or a checkpoint exists)."""
        files = (self.config_path, self.summary_path, self.metrics_path)
        return any(p.exists() for p in files) or any(self.checkpoint_dir.glob("*.ckpt"))

    def read_config(self) -> dict[str, Any]:
        """config.yaml as a plain dict; :class:`RunFileError` when it is missing, empty or not a mapping."""
        import yaml

        try:
            text = self.config_path.read_text()
        except OSError as exc:
            raise RunFileError(f"{self.config_path} cannot be read ({exc.strerror or exc})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RunFileError(f"{self.config_path} is not valid YAML ({' '.join(str(exc).split())})") from None
        if not isinstance(data, dict):
            raise RunFileError(f"{self.config_path} is {'empty' if data is None else 'not a mapping'}")
        return data

    def write_config(self, config: dict[str, Any]) -> None:
        """Write config.yaml, once: a run's config is never rewritten (:class:`FileExistsError` if it exists)."""
        import yaml

        if self.config_path.exists():
            raise FileExistsError(f"{self.config_path} exists: a run's config is never rewritten")
        with atomic_open(self.config_path) as f:
            yaml.safe_dump(config, f, sort_keys=False)

    def read_summary(self) -> Summary | None:
        """summary.json (None when there is none); :class:`RunFileError` when it is empty or corrupt."""
        if not self.summary_path.exists():
            return None
        return Summary.from_dict(_read_json(self.summary_path))

    def write_summary(self, summary: Summary) -> None:
        """Replace summary.json atomically."""
        write_json_atomic(self.summary_path, summary.to_dict())

    def metrics(self) -> MetricsFile:
        """metrics.jsonl, for appending."""
        return MetricsFile(self.metrics_path)

    # ------------------------------------------------------------------------ writers
    @contextlib.contextmanager
    def lock(self, command: str = "") -> Iterator[None]:
        """Hold the folder's lock for the block (creating the folder); :class:`RunFolderBusy` if another process
        holds it. The holder (pid, host, start time, command) is written beside the lock while it is held."""
        from filelock import FileLock, Timeout

        self.path.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.path / LOCK_FILE), timeout=LOCK_WAIT_S)
        try:
            lock.acquire()
        except Timeout:
            raise RunFolderBusy(
                f"run folder {self.path} is in use by {self._holder()}; wait for it to end, or use another folder"
            ) from None
        holder = self.path / HOLDER_FILE
        try:
            write_json_atomic(
                holder, {"pid": os.getpid(), "host": socket.gethostname(), "since": utc_now(), "command": command}
            )
            yield
        finally:
            holder.unlink(missing_ok=True)
            lock.release()

    def _holder(self) -> str:
        try:
            info = json.loads((self.path / HOLDER_FILE).read_text())
            text = f"pid {info['pid']} on {info['host']} since {info['since']}"
            return text + (f" ({info['command']})" if info.get("command") else "")
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def is_active(self) -> bool | None:
        """Whether a process holds the lock now (None when that cannot be told: no lock file, as in folders of
        older versions, or a read-only copy)."""
        from filelock import FileLock, Timeout

        if not (self.path / LOCK_FILE).exists():
            return None
        lock = FileLock(str(self.path / LOCK_FILE), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            return True
        except OSError:
            return None
        lock.release()
        return False

    def remove_run(self) -> None:
        """Delete the run's files (``overwrite=true``); other files in the folder are left alone."""
        import shutil

        for name in RUN_ENTRIES:
            path = self.path / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    def remove_partial_files(self) -> None:
        """Delete the temporary files that a killed writer left (``.<name>.*.tmp``)."""
        for folder in (self.path, self.checkpoint_dir):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------- readers


@dataclass
class LoadedRun:
    """A run folder as read by :func:`load_run`: ``config`` and ``summary`` are plain dicts ({} / None when
    missing or unreadable), ``problems`` the one-line reasons why a file could not be used."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    rows: list[dict[str, Any]]
    problems: list[str]


def load_run(path: str | Path) -> LoadedRun:
    """Read one run folder without failing: a missing, empty or corrupt file becomes a problem of the run.

    A corrupt summary.json reads as ``status: failed`` with the reason; a summary that says ``running`` while no
    process holds the folder (the run was killed) reads as ``interrupted``.
    """
    folder = RunFolder(path)
    problems: list[str] = []
    config: dict[str, Any] = {}
    if folder.config_path.exists():
        try:
            config = folder.read_config()
        except RunFileError as exc:
            problems.append(str(exc))
    summary: dict[str, Any] | None = None
    try:
        loaded = folder.read_summary()
    except RunFileError as exc:
        problems.append(str(exc))
        summary = {"status": "failed", "reason": f"unreadable summary.json: {exc}"}
    else:
        if loaded is not None:
            summary = loaded.to_dict()
            if loaded.status == "running" and folder.is_active() is False:
                summary.update(status="interrupted", reason="the process ended without finishing (killed?)")
        elif folder.config_path.exists():
            problems.append(f"{folder.summary_path} is missing: the run never started, or is from an older attnlab")
    if summary is not None and (summary.get("steps") or 0) > 0 and not folder.metrics_path.exists():
        problems.append(f"{folder.metrics_path} is missing: no curves for this run")
    return LoadedRun(folder.path, config, summary, read_metrics(folder.metrics_path), problems)


SKIP_DIRS = frozenset({"wandb", CHECKPOINT_DIR, ATTENTION_DIR, "csv", "__pycache__"})


def find_runs(root: str | Path) -> list[Path]:
    """Run folders under ``root`` (``root`` included): folders holding summary.json or config.yaml. Hidden
    folders and a run's own subfolders are not searched."""
    root = Path(root)
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        if SUMMARY_FILE in filenames or CONFIG_FILE in filenames:
            found.append(Path(dirpath))
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS]
    return found


# ---------------------------------------------------------------------------------------------------- sweeps


class SweepJournal:
    """``sweep.jsonl`` in a sweep folder: a header ``{"jobs": N or null, "started": <epoch s>}`` written when the
    sweep starts, then one line per finished job ``{"job": <folder name>, "status": ..., "reason": ...,
    "wall_time_s": ...}``, appended under a lock by whichever process ran the job (joblib workers included)."""

    def __init__(self, sweep_dir: str | Path) -> None:
        self.path = Path(sweep_dir) / SWEEP_FILE

    def start(self, jobs: int | None) -> None:
        """Begin the journal (a sweep started again into the same folder appends a new header)."""
        self._append({"jobs": jobs, "started": time.time()})

    def record(self, job: str, status: str, reason: str | None, wall_time_s: float | None) -> None:
        """Add one finished job."""
        self._append({"job": job, "status": status, "reason": reason, "wall_time_s": wall_time_s})

    def read(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the last header, the jobs recorded after it)."""
        header: dict[str, Any] = {}
        jobs: list[dict[str, Any]] = []
        for row in read_metrics(self.path):
            if "job" in row:
                jobs.append(row)
            else:
                header, jobs = row, []
        return header, jobs

    def _append(self, row: dict[str, Any]) -> None:
        from filelock import FileLock

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path.with_name(f".{SWEEP_FILE}.lock"))), open(self.path, "a") as f:
            f.write(json.dumps(_json_safe(row)) + "\n")
