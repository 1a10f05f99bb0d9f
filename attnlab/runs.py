"""The run folder: its layout, the summary's schema, and the only functions that read and write them.

A run folder is what a researcher keeps, copies, compares and resumes::

    config.yaml       the fully resolved config; written once when the run starts, never rewritten
    summary.json      status, key settings, final metrics, and one segment per start (see :class:`Summary`)
    metrics.jsonl     every logged metric, one JSON object per line
    train.log         the run's own log (start, validations, end, errors)
    checkpoints/      best.ckpt (best val/acc, used for the test) and last.ckpt (every validation)
    attention/        attention maps saved at the end (maps.png)
    pruning.json      head importance and pruning curves, written at the end (see :func:`check_pruning`)
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
import errno
import functools
import json
import math
import os
import re
import secrets
import socket
import stat
import time
import types
import typing
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
    "PRUNING_FILE",
    "SCHEMA_VERSION",
    "SUMMARY_FILE",
    "SWEEP_FILE",
    "LoadedRun",
    "MetricsFile",
    "RunFileError",
    "RunFolder",
    "RunFolderBusy",
    "Segment",
    "Summary",
    "SweepJournal",
    "atomic_open",
    "check_pruning",
    "config_defaults",
    "csv_safe",
    "find_runs",
    "flatten_config",
    "is_neutral",
    "is_odd",
    "is_wandb_id",
    "iter_metrics",
    "load_run",
    "load_yaml_untrusted",
    "nofollow_opener",
    "read_bytes",
    "read_json",
    "read_metrics",
    "read_text",
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
PRUNING_FILE = "pruning.json"
MAX_PRUNING_BYTES = 8_000_000  # a pruning.json larger than this is not read (4,096 heads and 64 orders fit in less)
SCHEMA_VERSION = 5
"""2: ``schema_version``, ``segments``, paths relative to the folder. Version 1 (no ``schema_version``) stored
absolute paths; :meth:`Summary.from_dict` reads it. 3: ``settings``, ``attention``, ``pattern``, ``layers``,
``backends``. 4: ``state_size``. 5: ``params_non_embedding``, ``flops_per_token``, ``tokens_per_step``,
``tokens_seen``, ``step_time_s``, ``max_tokens``, ``matched`` (null in an older summary)."""

LOCK_WAIT_S = 2.0  # how long a second writer waits for the lock (a dashboard may probe it for a moment)
# the files and folders that make up a run (what overwrite=true removes); anything else in the folder is left alone
RUN_FILES = {
    ".": (CONFIG_FILE, SUMMARY_FILE, METRICS_FILE, LOG_FILE, WANDB_ID_FILE, PRUNING_FILE, "attention_maps.png"),
    CHECKPOINT_DIR: ("best.ckpt", "last.ckpt"),
    ATTENTION_DIR: ("maps.png",),
    "csv": ("metrics.csv", "hparams.yaml"),  # Lightning's CSVLogger (logger=csv)
    ".hydra": ("config.yaml", "hydra.yaml", "overrides.yaml"),  # runs of attnlab before output_subdir: null
    "wandb": ("latest-run", "debug.log", "debug-internal.log"),  # W&B's pointers; its run folders go by id
}
"""What a run writes, by folder: what overwrite=true removes (and nothing else)."""
RUN_ENTRIES = (*RUN_FILES["."], *(name for name in RUN_FILES if name != "."))
"""The run's own entries in its folder: its files and its folders."""


NEUTRAL_KEYS = (
    "logger",
    "threads",
    "results_table",
    "resume",
    "ckpt_path",
    "overwrite",
    "diagnostics.heatmaps",
    "diagnostics.importance",
    "diagnostics.random_orders",
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
def attention_sources() -> dict[str, str]:
    """Each :class:`~attnlab.config.AttentionConfig` field → the config key it comes from, read from the
    interpolations of ``conf/config.yaml``'s ``attention:`` node (``score_params`` → ``variant.params``); a field
    set there as a plain value comes from ``attention.<field>``. Error messages, and the dashboard for a run older
    than the ``attention`` node, read these keys."""
    import re

    from omegaconf import OmegaConf

    from attnlab.config import FIELDS

    path = Path(__file__).resolve().parents[1] / "conf" / "config.yaml"
    node = OmegaConf.load(path).get("attention") if path.is_file() else None
    raw = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else {}
    out = {}
    for name in FIELDS:
        value = raw.get(name)
        match = re.fullmatch(r"\$\{([\w.]+)\}", value) if isinstance(value, str) else None
        out[name] = match.group(1) if match else f"attention.{name}"
    out["rope"] = "model.rope"
    return out


@functools.cache
def config_defaults() -> dict[str, Any]:
    """The plain (not nested) top-level values of ``conf/config.yaml`` (``compile: false``, ``lr: 0.003``, ...), the
    leaves of its ``match`` and ``diagnostics`` nodes (``match.by: null``, ``diagnostics.heads: true``) and
    the plain leaves of ``conf/model/default.yaml`` (``model.pattern: null``, ``model.rope.spectrum: full``) and the
    ``attention`` node's own plain fields (``attention.output_gate: null``, ``attention.backend: auto``): what a
    run of an older attnlab, whose config lacks a key added since, ran with. Empty when ``conf/`` is not beside the
    package."""
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf"
    if not (conf / "config.yaml").is_file():
        return {}
    values = OmegaConf.to_container(OmegaConf.load(conf / "config.yaml"))
    out = {k: v for k, v in values.items() if isinstance(k, str) and not isinstance(v, (dict, list))}
    for node in ("match", "diagnostics"):  # nodes of plain leaves with keys added since (0.5, 0.6): ``match.by``
        if isinstance(values.get(node), dict):
            out |= {f"{node}.{k}": v for k, v in flatten_config(values[node]).items()}
    attention = OmegaConf.to_container(OmegaConf.load(conf / "config.yaml").get("attention") or {}, resolve=False)
    for k, v in (attention if isinstance(attention, dict) else {}).items():  # the node's own plain fields (0.7:
        if k != "_target_" and not isinstance(v, (dict, list)) and not (isinstance(v, str) and "${" in v):
            out[f"attention.{k}"] = v  # attention.output_gate: null)
    if (conf / "model" / "default.yaml").is_file():
        model = flatten_config(OmegaConf.to_container(OmegaConf.load(conf / "model" / "default.yaml")))
        out |= {f"model.{k}": v for k, v in model.items() if not (isinstance(v, str) and "${" in v)}
    return out


class RunFileError(Exception):
    """A run file that is missing, empty or not what it should be. The message is one line naming the file."""


class RunFolderBusy(Exception):
    """Another process holds the run folder's lock. The message names the holder."""


def is_wandb_id(value: Any) -> bool:
    """Whether ``value`` is a W&B run id as attnlab draws them (letters, digits, ``_`` and ``-``, at most 64): an id
    read from a folder names folders W&B creates, so anything else (``../x``) is refused."""
    return isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value) is not None


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


def nofollow_opener(path: str | os.PathLike[str], flags: int) -> int:
    """An ``opener`` for :func:`open` that opens only a regular file, never through a symbolic link at ``path``
    (``O_NOFOLLOW``: ``ELOOP``) and never a FIFO or device, which could block a reader forever (opened
    non-blocking, then checked: ``EINVAL``)."""
    fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    if hasattr(os, "O_NONBLOCK"):
        os.set_blocking(fd, True)
    return fd


def is_odd(path: Path) -> bool:
    """Whether ``path`` is a symbolic link, or something other than a regular file or a folder (a FIFO would block
    a reader): what a run or a sweep never reads or writes."""
    return path.is_symlink() or (path.exists() and not (path.is_file() or path.is_dir()))


def _file_error(path: Path, exc: OSError) -> RunFileError:
    """An OSError on one of a run's files as a :class:`RunFileError`, naming a symbolic link as such."""
    if path.is_symlink():
        return RunFileError(f"{path} is a symbolic link: a run folder's files are never read or written through links")
    if exc.errno == errno.EINVAL and exc.strerror == "not a regular file":
        return RunFileError(f"{path} is not a regular file (a FIFO, socket or device): not read")
    return RunFileError(f"{path} cannot be used ({exc.strerror or exc})")


def read_bytes(path: str | Path) -> bytes:
    """A run file's bytes, never through a symbolic link; :class:`RunFileError` (one line naming the file) when it
    cannot be read or is a link."""
    path = Path(path)
    try:
        with open(path, "rb", opener=nofollow_opener) as f:
            return f.read()
    except OSError as exc:
        raise _file_error(path, exc) from None


def read_text(path: str | Path) -> str:
    """A run file's text, never through a symbolic link; :class:`RunFileError` (one line naming the file) when it
    cannot be read, is a link, or is not UTF-8."""
    path = Path(path)
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RunFileError(f"{path} is not UTF-8 text (byte {exc.start})") from None


def read_json(path: str | Path) -> Any:
    """A run or sweep folder's JSON file (summary.json, tuned.json, pruning.json), never through a link, as untrusted
    input: :class:`RunFileError` (one line naming the file) when it cannot be read, is empty, is not JSON, holds a
    number Python will not convert, or is nested too deeply for the parser (a ``[[[[...`` of any depth costs that
    line, never a RecursionError)."""
    return _read_json(Path(path))


MAX_YAML_NODES = 100_000
"""The most nodes a YAML file of a run or sweep folder may hold once its aliases are expanded (a resolved config has
a few hundred): :func:`load_yaml_untrusted` refuses a file past it, such as the "billion laughs" (10 levels of 10
aliases, 1 KB on disk, 10¹⁰ nodes for any reader that walks it)."""


def _no_alias_bomb_loader() -> type:
    """A ``yaml.SafeLoader`` that counts, while it composes, the nodes of each node with its aliases expanded, and
    stops (``yaml.YAMLError``) as soon as a node passes :data:`MAX_YAML_NODES` or an alias refers to a node that
    contains it (a recursive structure). Composing never expands an alias, so the count costs one integer per node:
    time and memory stay proportional to the file, never to its expansion."""
    import yaml

    class Loader(yaml.SafeLoader):
        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self._expanded: dict[int, int] = {}  # id(node) -> its node count with aliases expanded

        def compose_node(self, parent: Any, index: Any) -> Any:
            alias = self.check_event(yaml.AliasEvent)
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            if alias:
                if id(node) not in self._expanded:  # an alias to a node that is still being composed: a cycle
                    raise yaml.YAMLError(f"an alias refers to a node that contains it (line {mark.line + 1})")
                return node
            if isinstance(node, yaml.SequenceNode):
                size = 1 + sum(self._expanded[id(child)] for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                size = 1 + sum(self._expanded[id(k)] + self._expanded[id(v)] for k, v in node.value)
            else:
                size = 1
            if size > MAX_YAML_NODES:
                raise yaml.YAMLError(
                    f"its aliases (*name) expand to more than {MAX_YAML_NODES:,} nodes (at line {mark.line + 1}): "
                    "an alias bomb, not a config"
                )
            self._expanded[id(node)] = size
            return node

    return Loader


@functools.lru_cache(maxsize=1)
def _yaml_loader() -> type:
    return _no_alias_bomb_loader()


def load_yaml_untrusted(source: str | Path, text: str | None = None) -> Any:
    """A YAML file of a run or sweep folder (config.yaml, ``.hydra/*.yaml``, ``multirun.yaml``) read as untrusted
    data: ``source`` is the file's path, read never through a link (:func:`read_text`) unless ``text`` gives its
    content (``source`` then only names it). Only plain YAML types are built (``yaml.safe_load``); anchors and
    aliases are allowed up to :data:`MAX_YAML_NODES` nodes expanded. :class:`RunFileError`, one line naming the
    file, for a file that cannot be read, is not YAML, is nested too deeply, or whose aliases expand past the bound
    or into a cycle. The package's own ``conf/`` files are trusted and read with OmegaConf, not here."""
    import yaml

    path = Path(source)
    if text is None:
        text = read_text(path)
    try:
        return yaml.load(text, Loader=_yaml_loader())  # (a SafeLoader subclass)
    except RecursionError:
        raise RunFileError(f"{path} is nested too deeply to be read") from None
    except yaml.YAMLError as exc:
        if type(exc) is yaml.YAMLError:  # ours: already one plain sentence
            raise RunFileError(f"{path} is refused: {exc}") from None
        raise RunFileError(f"{path} is not valid YAML ({' '.join(str(exc).split())})") from None


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(text: str) -> str:
    """A text cell for a CSV file that a spreadsheet may open: text starting with ``=``, ``+``, ``-``, ``@`` (or a
    tab or carriage return) gets a leading ``'``, so that a run name or config value such as ``=HYPERLINK(...)`` or
    ``-2+3`` is shown as text, never evaluated as a formula (OWASP's "CSV injection"). Other text is returned as is;
    write numbers as numbers (they are never passed here)."""
    return "'" + text if text.startswith(_FORMULA_START) else text


def _read_json(path: Path) -> Any:
    text = read_text(path)
    if not text.strip():
        raise RunFileError(f"{path} is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunFileError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise RunFileError(f"{path} cannot be read as JSON ({' '.join(str(exc).split())[:120]})") from None
    except RecursionError:
        raise RunFileError(f"{path} is nested too deeply to be read") from None


# ---------------------------------------------------------------------------------------------------- pruning

MAX_PRUNED_HEADS = 4096
MAX_PRUNING_ORDERS = 64


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_pruning(data: Any, source: str | Path = PRUNING_FILE) -> dict[str, Any]:
    """pruning.json (read as untrusted input) checked and reduced to what readers use, or :class:`RunFileError`
    naming the first problem.

    The file (:func:`attnlab.training.heads.prune_heads` writes it): ``metric`` (``acc`` or ``bpc``), ``num_layers``
    and ``num_heads`` (at most :data:`MAX_PRUNED_HEADS` heads in all), ``importance`` (layers × heads finite
    numbers), and ``curves``: ``{"importance": [curve], "random": [curve, ...]}`` (at most
    :data:`MAX_PRUNING_ORDERS` curves), each curve the points k = 0 … layers·heads, point k an object with
    ``removed`` = k and a finite value of the metric. Returns ``{metric, higher_is_better, num_layers, num_heads,
    importance, curves: {order: [[value at k = 0, 1, ...], ...]}}``."""

    def bad(what: str) -> RunFileError:
        return RunFileError(f"{source}: {what}")

    if not isinstance(data, dict):
        raise bad("not a JSON object")
    metric = data.get("metric")
    if metric not in ("acc", "bpc"):
        raise bad(f"metric must be acc or bpc, got {str(metric)[:40]!r}")
    layers, heads = data.get("num_layers"), data.get("num_heads")
    for name, value in (("num_layers", layers), ("num_heads", heads)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_PRUNED_HEADS:
            raise bad(f"{name} must be an integer from 1 to {MAX_PRUNED_HEADS}")
    if layers * heads > MAX_PRUNED_HEADS:
        raise bad(f"{layers} × {heads} heads: more than {MAX_PRUNED_HEADS}")
    importance = data.get("importance")
    if (
        not isinstance(importance, list)
        or len(importance) != layers
        or not all(isinstance(row, list) and len(row) == heads and all(map(_finite_number, row)) for row in importance)
    ):
        raise bad(f"importance must be {layers} lists of {heads} finite numbers")
    curves = data.get("curves")
    if not isinstance(curves, dict) or "importance" not in curves or not set(curves) <= {"importance", "random"}:
        raise bad("curves must be an object with the orders importance (and random)")
    out: dict[str, list[list[float]]] = {}
    for order, listed in curves.items():
        if not isinstance(listed, list) or not 1 <= len(listed) <= MAX_PRUNING_ORDERS:
            raise bad(f"curves.{order} must be a list of 1 to {MAX_PRUNING_ORDERS} curves")
        out[order] = []
        for n, curve in enumerate(listed):
            if not isinstance(curve, list) or len(curve) != layers * heads + 1:
                raise bad(f"curves.{order}[{n}] must have {layers * heads + 1} points (0 to {layers * heads} removed)")
            values = []
            for k, point in enumerate(curve):
                if not isinstance(point, dict) or point.get("removed") != k or not _finite_number(point.get(metric)):
                    raise bad(f"curves.{order}[{n}][{k}] must be an object with removed = {k} and a finite {metric}")
                values.append(float(point[metric]))
            out[order].append(values)
    return {
        "metric": metric,
        "higher_is_better": metric == "acc",
        "num_layers": layers,
        "num_heads": heads,
        "importance": [[float(v) for v in row] for row in importance],
        "curves": out,
    }


# ---------------------------------------------------------------------------------------------------- summary


def _conforms(value: Any, kind: Any) -> bool:
    """Whether a JSON value has the type ``kind`` (a field's annotation): ``int`` excludes booleans, ``float``
    takes any number (NaN and infinities too, as Python's json reads them), containers are checked element by
    element, and a dataclass (a segment) must be an object, whose fields its own reader checks."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if kind is Any:
        return True
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if origin is dict:
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()
        )
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if dataclasses.is_dataclass(kind):
        return isinstance(value, dict)  # checked field by field by its own reader
    return isinstance(value, kind)


def _typed_fields(cls: type, data: dict[str, Any], where: str, problems: list[str] | None) -> dict[str, Any]:
    """The entries of ``data`` that are fields of the dataclass ``cls`` and have its types. A wrong one raises
    :class:`RunFileError` (``problems`` None) or is left out with a problem appended."""
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            continue
        if not _conforms(value, hints[key]):
            text = json.dumps(value, default=str)
            text = text if len(text) <= 40 else text[:37] + "..."
            message = f"{where}: {key} is {text}, which is not {_type_name(hints[key])}"
            if problems is None:
                raise RunFileError(message)
            problems.append(message + "; ignored")
            continue
        out[key] = value
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(kind: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(kind))
    if typing.get_origin(kind) is dict:
        return f"an object of {_type_name(typing.get_args(kind)[1])}"
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        return "a list of objects" if dataclasses.is_dataclass(item) else f"a list of {_type_name(item)}"
    return names.get(kind, getattr(kind, "__name__", str(kind)))


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
    target_steps: int | None = None  # the max_steps this start set out to reach (an interrupted extension's aim)


@dataclass
class Summary:
    """summary.json. ``status``: running | ok | failed | interrupted (``reason`` says why when not ok).

    The key settings come from the config when the run starts: ``model`` is the run's model name (a comparison's
    model, the ``variant=`` choice, else ``variant.name``: :func:`attnlab.training.compare.model_name`; null in a
    summary written before it), ``variant`` the form's score; ``settings`` holds every field of layer 1's
    :class:`~attnlab.config.AttentionConfig` (a preset expanded; a summary of schema 2 kept six of them at the top
    level, and reads into ``settings``), ``attention`` the one
    line that describes the layers' configured attention (every field that differs from the defaults), ``pattern``
    the per-layer pattern (``LG``; null when every layer is alike), ``layers`` each layer's fields that differ from
    the defaults (with a pattern), ``backends`` what computes each layer's training step, and ``state_size`` the
    floats per sequence that each layer's token-by-token form carries at the task's longest sequence
    (:meth:`~attnlab.attention.MultiHeadAttention.state_size`: linear attention's state, softmax's key/value
    cache; empty for a summary before schema 4); ``metrics`` are the
    final values (train/val/test and the attention diagnostics ``attn/*``); ``attn_init`` the step-0 diagnostics;
    ``chance_accuracy`` the accuracy of guessing (the task's, e.g. 1/num_pairs for MQAR; else 1/classes);
    ``headline_metric`` the one metric the task is compared by (:meth:`attnlab.tasks.SequenceTask.headline_metric`:
    ``test/acc``, or ``test/acc@128`` for a state-tracking task tested beyond its training length; null in a
    summary written before it).
    ``wall_time_s`` is the sum over ``segments``. ``best_checkpoint`` and ``resumed_from`` are relative to the
    run folder (or as given, for a ``ckpt_path`` outside it).

    Compute (:mod:`attnlab.compute`; null in a summary before schema 5): ``params`` counts every parameter,
    ``params_non_embedding`` all but the token embedding and a learned absolute position table (Kaplan et al.'s N);
    ``flops_per_token`` the FLOPs of one training step, forward and backward (matrix products, 2 per multiply-add),
    per token position of the step (B·L, pads included); ``tokens_per_step`` B·L·(accumulated batches)·
    ``world_size`` and ``tokens_seen`` ``steps`` times that; ``step_time_s`` the median wall time of a training step
    (from the start of a batch to its end, optimizer step included) in the last process that trained one.
    ``max_tokens`` is the token budget that set ``max_steps`` (null: none), ``matched`` what ``match`` sized:
    ``{by, width, value, target, achieved, reference}`` (the key searched, the value found, the count aimed at, the
    count reached, the reference variant or null), null when nothing was matched.
    """

    status: str = "running"
    reason: str | None = None
    model: str | None = None
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
    settings: dict[str, Any] = field(default_factory=dict)
    attention: str | None = None
    pattern: str | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    state_size: list[int] = field(default_factory=list)
    smoke: bool = False
    chance_accuracy: float | None = None
    headline_metric: str | None = None
    params: int | None = None
    params_non_embedding: int | None = None
    flops_per_token: float | None = None
    tokens_per_step: int | None = None
    tokens_seen: int | None = None
    step_time_s: float | None = None
    max_tokens: int | None = None
    matched: dict[str, Any] | None = None
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
    def from_dict(cls, data: Any, problems: list[str] | None = None, source: str = SUMMARY_FILE) -> Summary:
        """Read a summary of any schema version; unknown keys are dropped, version 1 paths made relative.

        Every field is checked against its type (summary.json is untrusted input: a copied or downloaded folder may
        hold anything). With ``problems=None`` a wrong field raises :class:`RunFileError` naming it (a resume
        refuses); with a list, the field keeps its default and a one-line problem is appended (the dashboard
        warns and goes on), but a wrong ``status`` reads as ``failed``. ``source`` names the file in messages."""
        if not isinstance(data, dict):
            raise RunFileError(f"{source} must be a JSON object, got {type(data).__name__}")
        if "settings" not in data:  # schema 2 and before: some attention fields at the top level
            from attnlab.config import FIELDS

            data = {**data, "settings": {k: data[k] for k in FIELDS if k in data}}
        kwargs = _typed_fields(cls, data, source, problems)
        if "status" in data and "status" not in kwargs:
            kwargs.update(status="failed", reason=f"{source}: unreadable status")
        segments = []
        for i, seg in enumerate(kwargs.get("segments") or []):
            if isinstance(seg, dict) and {"kind", "started", "from_step"} <= seg.keys():
                fields = _typed_fields(Segment, seg, f"{source} segments[{i}]", problems)
                if {"kind", "started", "from_step"} <= fields.keys():
                    segments.append(Segment(**fields))
        kwargs["segments"] = segments
        for key in ("best_checkpoint", "resumed_from"):  # version 1 stored absolute paths
            if isinstance(kwargs.get(key), str) and Path(kwargs[key]).is_absolute() and data.get("run_dir"):
                with contextlib.suppress(ValueError, TypeError):
                    kwargs[key] = Path(kwargs[key]).relative_to(data["run_dir"]).as_posix()
        kwargs["schema_version"] = SCHEMA_VERSION
        return cls(**kwargs)

    def clear_mistyped(self) -> None:
        """Put every field (``segments`` aside) whose value is not of the field's type back to its default: a
        summary written for a config that failed validation (``lr=abc``) stays readable as its type says."""
        defaults = Summary()
        for name, kind in _hints(Summary).items():
            if name != "segments" and not _conforms(getattr(self, name), kind):
                setattr(self, name, getattr(defaults, name))

    @property
    def finished(self) -> bool:
        """Whether the run completed (status ok)."""
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------------- metrics


def iter_metrics(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (or of a run folder's), one at a time, read as a stream (a file of any
    size costs one line's memory); blank, torn (a killed writer's last line) and non-object lines are skipped, a
    byte that is not UTF-8 is replaced. A missing file has no rows; a symbolic link is never followed
    (:class:`RunFileError`)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    try:
        f = open(path, encoding="utf-8", errors="replace", opener=nofollow_opener)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _file_error(path, exc) from None
    with f:
        try:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):  # torn, or hostile: too long a number, too deep a nesting
                    continue
                if isinstance(row, dict):
                    yield row
        except OSError as exc:  # (a read error part-way: the rows so far were given)
            raise _file_error(path, exc) from None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a ``metrics.jsonl`` file, as :func:`iter_metrics` reads them."""
    return list(iter_metrics(path))


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
            self._file = open(self.path, "a", buffering=1, encoding="utf-8", opener=nofollow_opener)
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
        return any(os.path.lexists(p) for p in files) or any(self.checkpoint_dir.glob("*.ckpt"))

    def is_run(self) -> bool:
        """Whether the folder holds a run that attnlab recognises as its own: a readable summary.json (not a link)
        whose object has ``schema_version`` (or, written by attnlab before version 2, ``status`` and ``run_dir``)."""
        try:
            data = _read_json(self.summary_path)
        except RunFileError:
            return False
        return isinstance(data, dict) and (
            isinstance(data.get("schema_version"), int) or {"status", "run_dir"} <= data.keys()
        )

    def has_entries(self) -> bool:
        """Whether any file or folder that a run writes (:data:`RUN_ENTRIES`) exists here."""
        return any(os.path.lexists(self.path / name) for name in RUN_ENTRIES)

    def odd_entries(self) -> list[Path]:
        """The run's files that are symbolic links or not regular files (a FIFO would block a reader): its own
        entries (``wandb/`` itself included), anything under ``checkpoints/``, ``attention/``, ``csv/`` and
        ``.hydra/``, and the lock files. Inside ``wandb/``, W&B keeps links of its own (``latest-run``,
        ``debug.log``, ``logs/debug-core.log`` into ``~/.cache/wandb``), which it replaces rather than writes
        through, and each start writes a new W&B run folder: those are not counted."""
        found = []
        for name in (*RUN_ENTRIES, LOCK_FILE, HOLDER_FILE):
            path = self.path / name
            if is_odd(path):
                found.append(path)
            elif path.is_dir() and name != "wandb":
                for dirpath, dirnames, filenames in os.walk(path):
                    found += [Path(dirpath) / e for e in (*dirnames, *filenames) if is_odd(Path(dirpath) / e)]
        return found

    def check_entries(self) -> None:
        """:class:`RunFileError` naming the first of :meth:`odd_entries`: attnlab never reads or writes a run's
        files through a link, which could lead anywhere, nor reads a FIFO or device."""
        odd = self.odd_entries()
        if odd:
            path, more = odd[0], f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
            if path.is_symlink():
                raise RunFileError(
                    f"{path} is a symbolic link (to {os.readlink(path)}){more}: attnlab never reads or writes a run's "
                    "files through links; remove it, or copy the folder with its links resolved (cp -rL)"
                )
            raise RunFileError(f"{path} is not a regular file or folder{more}: remove it")

    def read_config(self) -> dict[str, Any]:
        """config.yaml as a plain dict (read by :func:`load_yaml_untrusted`: no alias bomb); :class:`RunFileError`
        when it is missing, empty, not a mapping, or refused."""
        data = load_yaml_untrusted(self.config_path)
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

    def read_summary(self, problems: list[str] | None = None) -> Summary | None:
        """summary.json (None when there is none); :class:`RunFileError` when it is empty, corrupt, a link, or (with
        ``problems`` None) has a field of the wrong type (see :meth:`Summary.from_dict`)."""
        if not os.path.lexists(self.summary_path):
            return None
        return Summary.from_dict(_read_json(self.summary_path), problems, source=str(self.summary_path))

    def write_summary(self, summary: Summary) -> None:
        """Replace summary.json atomically."""
        write_json_atomic(self.summary_path, summary.to_dict())

    def metrics(self) -> MetricsFile:
        """metrics.jsonl, for appending."""
        return MetricsFile(self.metrics_path)

    @property
    def pruning_path(self) -> Path:
        return self.path / PRUNING_FILE

    def write_pruning(self, pruning: dict[str, Any]) -> None:
        """Replace pruning.json atomically (checked first: what is written reads back)."""
        check_pruning(_json_safe(pruning), self.pruning_path)
        write_json_atomic(self.pruning_path, pruning)

    def read_pruning(self) -> dict[str, Any] | None:
        """pruning.json, checked (:func:`check_pruning`), or None when there is none; :class:`RunFileError` (one
        line) when it is a link, too large, corrupt or not what attnlab writes."""
        path = self.pruning_path
        if not os.path.lexists(path):
            return None
        if not path.is_symlink() and path.is_file() and path.stat().st_size > MAX_PRUNING_BYTES:
            raise RunFileError(f"{path} is larger than {MAX_PRUNING_BYTES:,} bytes: not read")
        return check_pruning(_read_json(path), path)

    # ------------------------------------------------------------------------ writers
    @contextlib.contextmanager
    def lock(self, command: str = "") -> Iterator[None]:
        """Hold the folder's lock for the block (creating the folder); :class:`RunFolderBusy` if another process
        holds it. The holder (pid, host, start time, command) is written beside the lock while it is held."""
        from filelock import FileLock, Timeout

        self.path.mkdir(parents=True, exist_ok=True)
        for name in (LOCK_FILE, HOLDER_FILE):  # (filelock opens with O_NOFOLLOW today; an older one did not)
            if (self.path / name).is_symlink():
                raise RunFileError(f"{self.path / name} is a symbolic link: never written through links")
        lock = FileLock(str(self.path / LOCK_FILE), timeout=LOCK_WAIT_S)
        try:
            lock.acquire()
        except Timeout:
            raise RunFolderBusy(self.busy_message()) from None
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

    def busy_message(self) -> str:
        """Why a run cannot start here while another process holds the lock (:class:`RunFolderBusy`'s message, also
        what a dry run says of such a folder)."""
        return f"run folder {self.path} is in use by {self._holder()}; wait for it to end, or use another folder"

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
        """Delete what a run wrote (``overwrite=true``), and nothing else: its files, its two checkpoints, its maps,
        the CSV logger's two files, its own W&B runs (by the id it recorded) and W&B's pointers to them; a folder it
        made is removed when that leaves it empty. Links are removed, never followed. Only for a folder that
        :meth:`is_run`."""
        import shutil

        wandb_id = self._wandb_id()
        for sub, names in RUN_FILES.items():
            folder = self.path / sub
            if folder.is_symlink() or not folder.is_dir():
                continue
            doomed = [folder / name for name in names]
            if sub == "wandb" and wandb_id:
                doomed += [p for p in folder.iterdir() if p.name.endswith(f"-{wandb_id}") and "run-" in p.name]
            for path in doomed:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif os.path.lexists(path):
                    path.unlink()
            if sub != ".":
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when empty

    def _wandb_id(self) -> str | None:
        """The W&B run id this run recorded (summary.json, else wandb_id.txt), when it is a plain id."""
        candidates = []
        with contextlib.suppress(RunFileError, TypeError):
            candidates.append(_read_json(self.summary_path).get("wandb_id"))
        with contextlib.suppress(RunFileError):
            candidates.append(read_text(self.wandb_id_path).strip())
        return next((c for c in candidates if is_wandb_id(c)), None)

    def remove_partial_files(self) -> None:
        """Delete the temporary files that a killed writer of the run's own files left (``.<name>.<pid>.<hex>.tmp``,
        :func:`atomic_open`); nobody else's."""
        for sub, names in {**RUN_FILES, ".": (*RUN_FILES["."], HOLDER_FILE)}.items():
            folder = self.path / sub
            for name in names:
                for tmp in folder.glob(f".{name}.*.tmp"):
                    if re.fullmatch(rf"\.{re.escape(name)}\.\d+\.[0-9a-f]{{6}}\.tmp", tmp.name):
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


def load_run(path: str | Path, rows: bool = True) -> LoadedRun:
    """Read one run folder without failing: every file of it is untrusted, and a missing, empty, corrupt, linked or
    mistyped file or field becomes a one-line problem of the run (naming the file and the field).

    A corrupt summary.json reads as ``status: failed`` with the reason; a field of the wrong type keeps its default;
    a summary that says ``running`` while no process holds the folder (the run was killed) reads as
    ``interrupted``. ``rows=False`` leaves ``rows`` empty (a reader that streams :func:`iter_metrics` itself).
    """
    folder = RunFolder(path)
    problems: list[str] = []
    config: dict[str, Any] = {}
    if os.path.lexists(folder.config_path):
        try:
            config = folder.read_config()
        except RunFileError as exc:
            problems.append(str(exc))
    summary: dict[str, Any] | None = None
    try:
        loaded = folder.read_summary(problems)
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
    metric_rows: list[dict[str, Any]] = []
    if rows:
        try:
            metric_rows = read_metrics(folder.metrics_path)
        except RunFileError as exc:
            problems.append(str(exc))
    return LoadedRun(folder.path, config, summary, metric_rows, problems)


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

    def start(self, jobs: int | None, estimates: dict[str, float] | None = None) -> None:
        """Begin the journal (a sweep started again into the same folder appends a new header); ``estimates``:
        each job's estimated seconds by job number (:mod:`attnlab.training.plan`), for the "left" line and the
        closing report."""
        row: dict[str, Any] = {"jobs": jobs, "started": time.time()}
        if estimates:
            row["estimates"] = estimates
        self._append(row)

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
        lock = FileLock(str(self.path.with_name(f".{SWEEP_FILE}.lock")))
        try:
            with lock, open(self.path, "a", encoding="utf-8", opener=nofollow_opener) as f:
                f.write(json.dumps(_json_safe(row)) + "\n")
        except OSError as exc:
            raise _file_error(self.path, exc) from None
