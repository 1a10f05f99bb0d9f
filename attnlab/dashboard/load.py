"""Reading run folders for the dashboard: :class:`Run` (one folder's config, summary and metric rows) and the search.

Everything goes through :mod:`attnlab.runs`, the one module that knows the run-folder layout; a missing, empty or
corrupt file is one of the run's ``problems``, never an error.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.runs import ATTENTION_DIR, config_defaults, find_runs, flatten_config
from attnlab.runs import load_run as read_run_folder

__all__ = ["MISSING", "NO_SUMMARY", "Run", "find_run_dirs", "finite", "load_run", "load_runs", "natural_key"]

NO_SUMMARY = "failed (no summary)"
MISSING = "—"
"""The value of a config key that a run does not have (e.g. ``variant.params.d_attn`` for a dot-product run)."""

_HEAD_KEY = re.compile(r"^attn/L(\d+)H(\d+)/(\w+)$")


def finite(value: Any) -> float | None:
    """``value`` as a float, or None for null / NaN / inf / booleans / non-numbers."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _int(value: Any) -> int | None:
    x = finite(value)
    return None if x is None else int(x)


def natural_key(text: Any) -> list[Any]:
    """Sort key that orders ``2_a`` before ``10_a`` and ignores case."""
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", str(text))]


def _dig(mapping: Any, dotted: str) -> Any:
    """``mapping["a"]["b"]`` for ``"a.b"``, or None when a level is missing or not a mapping."""
    node = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


@dataclass
class Run:
    """One run folder: its resolved config, its summary (None when the run never wrote one) and its metric rows."""

    path: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    # -------------------------------------------------------------------------------- identity
    def setting(self, summary_key: str, config_key: str | None = None) -> Any:
        """The summary's value, else the config's (``config_key`` dotted, or a plain top-level value)."""
        if self.summary is not None and self.summary.get(summary_key) is not None:
            return self.summary[summary_key]
        value = _dig(self.config, config_key or summary_key)
        top = self.config.get(summary_key)  # an old config's plain value (``variant: additive``)
        return top if value is None and top is not None and not isinstance(top, dict) else value

    @functools.cached_property
    def flat(self) -> dict[str, Any]:
        """The config's leaves by dotted key (``{"variant.name": "dot", "d_k": 64, ...}``); lists as tuples (they
        are compared and grouped), an empty mapping as :data:`MISSING`."""
        leaves = flatten_config(self.config) if self.config else {}
        return {k: MISSING if v == {} else tuple(v) if isinstance(v, list) else v for k, v in leaves.items()}

    def value(self, key: str) -> Any:
        """A config leaf by dotted key; :data:`MISSING` when the run's config has no such key, but a top-level key
        that a run of an older attnlab lacks reads as its default (``compile: false``): it ran so."""
        if key in self.flat:
            return self.flat[key]
        if self.config and "." not in key:
            return config_defaults().get(key, MISSING)
        return MISSING

    @property
    def status(self) -> str:
        """``ok``, ``failed``, ``running``, ``interrupted`` (as the summary says), or ``failed (no summary)``."""
        if self.summary is None:
            return NO_SUMMARY
        return str(self.summary.get("status") or "unknown")

    @property
    def ok(self) -> bool:
        """Whether the run finished (only finished runs enter the comparisons)."""
        return self.status == "ok"

    @property
    def reason(self) -> str | None:
        """Why the run failed, when it did."""
        if self.summary is None:
            return "config.yaml without summary.json: the run is unfinished or crashed"
        reason = self.summary.get("reason")
        return None if reason is None else str(reason)

    @property
    def variant(self) -> str:
        """The attention score's name."""
        return str(self.setting("variant", "variant.name") or "?")

    @property
    def mask(self) -> str:
        """The structural mask's name."""
        return str(self.setting("mask", "mask.name") or "?")

    @property
    def task(self) -> str:
        """The task's name."""
        return str(self.setting("task", "task.name") or "?")

    @property
    def num_heads(self) -> int | None:
        """Heads per layer."""
        return _int(self.setting("num_heads"))

    @property
    def d_model(self) -> int | None:
        """Model width."""
        return _int(self.setting("d_model"))

    @property
    def d_k(self) -> int | None:
        """The per-head key size, resolved (``d_model // num_heads`` when the config has null)."""
        value = _int(self.setting("d_k"))
        if value is None and self.d_model and self.num_heads:
            return self.d_model // self.num_heads
        return value

    @property
    def seed(self) -> int | None:
        """The run's seed."""
        return _int(self.setting("seed"))

    @property
    def params(self) -> int | None:
        """Trainable parameters (from the summary)."""
        return _int(self.summary.get("params")) if self.summary else None

    @property
    def wall_time_s(self) -> float | None:
        """Wall time in seconds (from the summary)."""
        return finite(self.summary.get("wall_time_s")) if self.summary else None

    @property
    def chance(self) -> float | None:
        """The task's chance accuracy (the summary's ``chance_accuracy``; None for runs older than it)."""
        return finite(self.summary.get("chance_accuracy")) if self.summary else None

    @property
    def optimized_metric(self) -> str | None:
        """The config's ``optimized_metric`` (what a sweeper optimises), when it names one."""
        value = self.config.get("optimized_metric")
        return value if isinstance(value, str) and value else None

    # -------------------------------------------------------------------------------- metrics
    def final(self, metric: str) -> float | None:
        """The final value of ``metric``: the summary's, else the last finite value in ``metrics.jsonl``."""
        metrics = _dig(self.summary, "metrics") if self.summary is not None else None
        if isinstance(metrics, dict) and finite(metrics.get(metric)) is not None:
            return finite(metrics[metric])
        for row in reversed(self.rows):
            value = finite(row.get(metric))
            if value is not None:
                return value
        return None

    @functools.cached_property
    def metric_names(self) -> frozenset[str]:
        """Every metric name in the summary's ``metrics`` or in a ``metrics.jsonl`` row."""
        metrics = _dig(self.summary, "metrics") if self.summary is not None else None
        keys = set(metrics) if isinstance(metrics, dict) else set()
        for row in self.rows:
            keys.update(row)
        keys.discard("step")
        keys.discard("epoch")
        return frozenset(keys)

    def by_length(self, metric: str) -> dict[int, float]:
        """``{L: final value of "<metric>@<L>"}`` (e.g. ``test/acc@64``) for each test length the run reports with a
        finite value, sorted by ``L``; empty when the run had no ``test_lengths``."""
        found = {}
        for key in self.metric_names:
            head, _, length = key.rpartition("@")
            if head == metric and length.isdigit():
                value = self.final(key)
                if value is not None:
                    found[int(length)] = value
        return dict(sorted(found.items()))

    @property
    def train_length(self) -> int | None:
        """The training sequence length from config.yaml: ``task.datamodule.seq_len``, else ``max_length`` (the
        longest training sequence of a task of varying length), else, for ``associative_recall`` with ``seq_len:
        null``, its shortest length (pairs, one token each when fused, plus queries); None when unknown."""
        datamodule = _dig(self.config, "task.datamodule")
        if not isinstance(datamodule, dict):
            return None
        for key in ("seq_len", "max_length"):
            if _int(datamodule.get(key)):
                return _int(datamodule[key])
        pairs = _int(datamodule.get("num_pairs"))
        if self.task == "associative_recall" and pairs:
            queries = _int(datamodule.get("num_queries")) or pairs
            return pairs * (1 if datamodule.get("fused_pairs") is True else 2) + queries
        return None

    def init(self, metric: str) -> float | None:
        """The step-0 value of a diagnostic: the summary's ``attn_init``, else the step-0 row of ``metrics.jsonl``."""
        init = _dig(self.summary, "attn_init") if self.summary else None
        if isinstance(init, dict) and finite(init.get(metric)) is not None:
            return finite(init[metric])
        for row in self.rows:
            if row.get("step") == 0 and finite(row.get(metric)) is not None:
                return finite(row[metric])
        return None

    def curve(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of ``metric`` over training, NaN where a row has null; rows without the key are skipped."""
        steps, values = [], []
        for row in self.rows:
            if metric in row and finite(row.get("step")) is not None:
                steps.append(float(row["step"]))
                value = finite(row[metric])
                values.append(math.nan if value is None else value)
        return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)

    def head_grid(self, metric: str) -> np.ndarray | None:
        """A (layers, heads) array of ``attn/L{l}H{h}/{metric}`` from the last row with per-head diagnostics."""
        for row in reversed(self.rows):
            cells = {}
            for key, value in row.items():
                match = _HEAD_KEY.match(key)
                if match and match.group(3) == metric:
                    cells[(int(match.group(1)), int(match.group(2)))] = finite(value)
            if cells:
                layers = 1 + max(layer for layer, _ in cells)
                heads = 1 + max(head for _, head in cells)
                grid = np.full((layers, heads), np.nan)
                for (layer, head), value in cells.items():
                    grid[layer, head] = np.nan if value is None else value
                return grid
        return None

    def images(self) -> list[Path]:
        """Saved attention-map images: ``attention_maps.png`` (older runs) first, then ``attention/**/*.png``."""
        found = [self.path / "attention_maps.png"] if (self.path / "attention_maps.png").is_file() else []
        folder = self.path / ATTENTION_DIR
        if folder.is_dir():
            found += sorted(p for p in folder.rglob("*.png") if p.is_file())
        return found


def find_run_dirs(root: str | Path) -> list[Path]:
    """Run folders under ``root`` (``root`` itself included; see :func:`attnlab.runs.find_runs`), sorted
    naturally (``2_...`` before ``10_...``)."""
    root = Path(root)
    return sorted(find_runs(root), key=lambda p: natural_key(p.relative_to(root).as_posix()))


def load_run(path: str | Path, root: str | Path | None = None) -> Run:
    """Read one run folder through :func:`attnlab.runs.load_run`; its name is the path relative to ``root`` (or the
    folder's name)."""
    path = Path(path)
    name = path.name
    if root is not None:
        rel = path.resolve().relative_to(Path(root).resolve()).as_posix()
        name = Path(root).resolve().name if rel == "." else rel
    loaded = read_run_folder(path)
    return Run(path, name, loaded.config, loaded.summary, loaded.rows, loaded.problems)


def load_runs(root: str | Path, runs: Sequence[Path] | None = None) -> list[Run]:
    """Every run under ``root`` (see :func:`find_run_dirs`), or the given run folders."""
    return [load_run(p, root) for p in (find_run_dirs(root) if runs is None else runs)]
