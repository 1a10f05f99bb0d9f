"""Tuned sweeps as the dashboard reads them: ``tuned.json`` (:mod:`attnlab.training.tuned`) matched to run folders.

A tuned sweep tunes each configuration on a grid (``lr: [1e-3, 3e-3, 1e-2]``) on ``tune_seed``, then runs each
configuration's best point on ``seeds``. Its folder holds ``tune/<n>_...`` and ``seeds/<n>_...`` run folders and
``tuned.json``, the plan: every grid point's job, each configuration's best point and its seed jobs. The dashboard
compares configurations on the seed runs only (each at its own best point), and draws the tuning runs as a
sensitivity chart (:func:`attnlab.dashboard.figures.sensitivity_figure`).

``tuned.json`` is untrusted input, like every file of a run folder: :func:`find_tuned` checks every field's type
and that every job names a folder inside the sweep (a relative path without ``..``), and matches jobs only to
the run folders already found under the page's folder, by path: a job is never opened. A plan that fails a check
is ignored with one warning (:attr:`Tuned.problems`), and its runs show as an ordinary sweep.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import attnlab.stats as core_stats
from attnlab.compat import forward
from attnlab.dashboard.dims import Sweep, format_value
from attnlab.dashboard.load import Run
from attnlab.runs import RunFileError, read_json

__all__ = [
    "SeedJob",
    "TuneJob",
    "Tuned",
    "TunedConfiguration",
    "TunedSweep",
    "find_tuned",
    "job_folder",
]

# grid_edges lived here before attnlab.stats (the tuned sweeper uses it too): it reads through attnlab.compat's
# table, with a DeprecationWarning
__getattr__ = forward(__name__)

TUNED_FILE = "tuned.json"  # (attnlab.training.tuned.TUNED_FILE; not imported: that module imports Hydra)
STAGES = ("tune", "seeds", "done")


class _Bad(ValueError):
    """A field of tuned.json that fails a check (its message names the field)."""


@dataclass(frozen=True)
class TuneJob:
    """One grid point of one configuration on the tuning seed: ``point`` (``{"lr": 0.001}``), the job's folder
    (relative to the sweep), its run (None when no run folder was found there), its status and the tuning metric's
    value (the run's, else what tuned.json recorded)."""

    point: dict[str, Any]
    job: str
    run: Run | None
    status: str | None
    value: float | None

    @property
    def failed(self) -> bool:
        """Whether the job failed, or finished without a finite value of the metric (the sweeper ranked it last);
        a job not run yet (no status), running or interrupted has not."""
        if self.status == "ok":
            return self.value is None
        return self.status is not None and self.status.startswith("failed")


@dataclass(frozen=True)
class SeedJob:
    """One seed run of a configuration at its best point (``reused``: the tuning run, on a seed equal to
    ``tune_seed``)."""

    seed: int
    job: str
    reused: bool
    run: Run | None


@dataclass
class TunedConfiguration:
    """One configuration of a tuned sweep: its grid points, its best point (None while unknown, or when every
    point failed) and its seed runs. ``label`` is the dashboard's name for it (the keys that tell configurations
    apart), ``plan_label`` tuned.json's."""

    plan_label: str
    tune: list[TuneJob]
    best: dict[str, Any] | None
    seeds: list[SeedJob]
    label: str = ""
    key: tuple[Any, ...] = ()

    @property
    def runs(self) -> list[Run]:
        """Every run of the configuration that was found (tuning and seed runs, each once)."""
        found = [job.run for job in self.tune if job.run is not None]
        found += [job.run for job in self.seeds if job.run is not None and not job.reused]
        return found

    def edges(self, grid: dict[str, list[Any]]) -> list[str]:
        """The grid keys whose chosen value is the smallest or the largest of the grid's (numeric keys with at least
        two distinct values): the best may lie beyond, so the grid should be widened there. Computed from ``grid``
        and :attr:`best` (an older tuned.json has no ``edge`` field; a newer one's is not trusted over this)."""
        return core_stats.grid_edges(grid, self.best)

    @property
    def best_job(self) -> TuneJob | None:
        """The tuning job at the best point."""
        return next((job for job in self.tune if self.best is not None and job.point == self.best), None)


@dataclass
class TunedSweep:
    """A tuned sweep: its folder, the plan's settings, its configurations and the runs found for them.

    ``sweep``: the dimensions of its runs with the grid keys left out (each configuration ran at its own point,
    which names no configuration); ``runs``: every run folder inside the sweep's folder (the plan's or not)."""

    path: Path
    name: str
    metric: str
    direction: str
    grid: dict[str, list[Any]]
    tune_seed: int
    seeds: list[int]
    stage: str
    configurations: list[TunedConfiguration]
    runs: list[Run] = field(default_factory=list)
    sweep: Sweep | None = None

    @property
    def seed_runs(self) -> list[Run]:
        """The runs that the comparison uses: each configuration's seed runs (a reused tuning run included)."""
        return [job.run for c in self.configurations for job in c.seeds if job.run is not None]

    @property
    def tune_runs(self) -> list[Run]:
        """The tuning runs found."""
        return [job.run for c in self.configurations for job in c.tune if job.run is not None]

    @property
    def maximize(self) -> bool:
        return self.direction == "maximize"

    def ordered(self) -> list[TunedConfiguration]:
        """The configurations in the headline's order (by the values of the keys that name them; those without a
        run found last)."""
        dims = self.sweep.dims if self.sweep is not None else []
        order = {d.key: {v: i for i, v in enumerate(d.values)} for d in dims}

        def rank(c: TunedConfiguration) -> tuple[bool, list[int]]:
            return not c.key, [order[d.key].get(v, -1) for d, v in zip(dims, c.key, strict=False)]

        return sorted(self.configurations, key=rank)

    def protocol(self) -> str:
        """``each variant at its own best lr by val/acc_best on seed 0; grid lr 0.001, 0.003, 0.01; compared on
        seeds 1, 2, 3``."""
        dims = self.sweep.label_dims(self.sweep.dims) if self.sweep is not None else []
        what = dims[0].name if len(dims) == 1 else "configuration"
        keys = " and ".join(k.rsplit(".", 1)[-1] for k in self.grid)
        grid = "; ".join(
            f"grid {k.rsplit('.', 1)[-1]} {', '.join(format_value(v) for v in values)}"
            for k, values in self.grid.items()
        )
        seeds = ", ".join(str(s) for s in self.seeds)
        better = "higher" if self.maximize else "lower"
        text = (
            f"each {what} at its own best {keys} by {self.metric} ({better} is better) on seed {self.tune_seed}; "
            f"{grid}; compared on seed{'s' if len(self.seeds) != 1 else ''} {seeds}"
        )
        if self.tune_seed in self.seeds:
            text += f" (seed {self.tune_seed}: the tuning run at the best point, reused)"
        return text


@dataclass
class Tuned:
    """The tuned sweeps under a folder (:func:`find_tuned`), and one line per ``tuned.json`` that was ignored."""

    sweeps: list[TunedSweep] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- reading
def find_tuned(runs: Sequence[Run], root: str | Path | None = None, config_keys: Sequence[str] | None = None) -> Tuned:
    """The tuned sweeps among ``runs``: every folder from ``root`` (default: the runs' common folder) down to the
    runs' parents that holds a ``tuned.json``, read, checked (see the module docstring) and matched to ``runs`` by
    the path of each job. Nothing above ``root`` is read, nor any job's folder. ``config_keys``: the keys that
    define a configuration (the dashboard's ``--config-keys``) in each sweep's :class:`Sweep`."""
    found = Tuned()
    if not runs:
        return found
    paths = [_abs(run.path) for run in runs]
    top = _abs(root) if root is not None else os.path.commonpath(paths)
    folders: set[str] = set()
    for path in paths:
        folder = os.path.dirname(path)
        while _within(folder, top) and folder not in folders:
            folders.add(folder)
            if folder == top:
                break
            folder = os.path.dirname(folder)
    by_path = dict(zip(paths, runs, strict=True))
    for folder in sorted(folders):
        if not os.path.lexists(os.path.join(folder, TUNED_FILE)):
            continue
        where = os.path.join(folder, TUNED_FILE)
        name = os.path.relpath(folder, top) if folder != top else os.path.basename(top)
        try:
            tuned = _read(folder, name, by_path)
            if not tuned.tune_runs and not tuned.seed_runs:
                raise _Bad("none of its jobs is a run folder found here (moved, or another sweep's?)")
        except _Bad as exc:
            found.problems.append(f"{where}: {exc}: ignored (its runs show as an ordinary sweep)")
        else:
            found.sweeps.append(tuned)
    for tuned in found.sweeps:
        tuned.runs = [run for path, run in by_path.items() if _within(path, _abs(tuned.path))]
        configured = [run for c in tuned.configurations for run in c.runs]
        tuned.sweep = Sweep(configured or tuned.runs, exclude=tuned.grid, config_keys=config_keys, strict=False)
        dims = tuned.sweep.dims
        for c in tuned.configurations:
            first = next(iter(c.runs), None)
            if first is not None:
                c.label, c.key = tuned.sweep.label(first, dims), tuned.sweep.key_of(first, dims)
            else:
                c.label = c.plan_label or "(no run found)"
    return found


def _read(folder: str, name: str, by_path: dict[str, Run]) -> TunedSweep:
    """The plan in ``folder``, checked and matched to the runs (:class:`_Bad` naming the field that fails)."""
    try:  # (never through a link; a file nested too deeply for the parser is one line, not a RecursionError)
        data = read_json(os.path.join(folder, TUNED_FILE))
    except RunFileError as exc:  # (its message begins with the path, which the warning names already)
        raise _Bad(f"not a readable JSON object: it {str(exc).split(TUNED_FILE + ' ', 1)[-1]}") from None
    if not isinstance(data, dict):
        raise _Bad("not a readable JSON object")
    if _integer(data.get("format"), "format") != 1:
        raise _Bad(f"format {data['format']!r} is not 1 (written by a newer attnlab?)")
    metric = _text(data.get("metric"), "metric")
    direction = data.get("direction")
    if direction not in ("maximize", "minimize"):
        raise _Bad(f"direction is {_show(direction)}, not maximize or minimize")
    grid_raw = data.get("grid")
    if not isinstance(grid_raw, dict) or not grid_raw:
        raise _Bad(f"grid is {_show(grid_raw)}, not a mapping of keys to lists of values")
    grid: dict[str, list[Any]] = {}
    for key, values in grid_raw.items():
        if not key or len(key) > 200 or not all(part.isidentifier() for part in key.split(".")):
            raise _Bad(f"grid key {_show(key)} is not a config key")
        if not isinstance(values, list) or not values or not all(_scalar(v) for v in values):
            raise _Bad(f"grid.{key} is {_show(values)}, not a list of numbers or words")
        grid[key] = values
    tune_seed = _integer(data.get("tune_seed"), "tune_seed")
    seeds = data.get("seeds")
    if not isinstance(seeds, list) or not all(_is_int(s) for s in seeds):
        raise _Bad(f"seeds is {_show(seeds)}, not a list of integers")
    stage = data.get("stage")
    if stage not in STAGES:
        raise _Bad(f"stage is {_show(stage)}, not one of {', '.join(STAGES)}")
    entries = data.get("configurations")
    if not isinstance(entries, list):
        raise _Bad(f"configurations is {_show(entries)}, not a list")
    base = _abs(folder)
    jobs: set[str] = set()
    configurations = []
    for i, entry in enumerate(entries):
        where = f"configurations[{i}]"
        if not isinstance(entry, dict):
            raise _Bad(f"{where} is {_show(entry)}, not an object")
        overrides = entry.get("overrides", [])
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise _Bad(f"{where}.overrides is {_show(overrides)}, not a list of strings")
        label = entry.get("label", "")
        if not isinstance(label, str):
            raise _Bad(f"{where}.label is {_show(label)}, not a string")
        tune_raw = entry.get("tune")
        if not isinstance(tune_raw, list):
            raise _Bad(f"{where}.tune is {_show(tune_raw)}, not a list")
        tune = []
        for j, item in enumerate(tune_raw):
            at = f"{where}.tune[{j}]"
            if not isinstance(item, dict):
                raise _Bad(f"{at} is {_show(item)}, not an object")
            point = _point(item.get("point"), grid, f"{at}.point")
            job = job_folder(item.get("job"), f"{at}.job")
            if job in jobs:
                raise _Bad(f"{at}.job {_show(job)} is listed twice")
            jobs.add(job)
            status, value = item.get("status"), item.get("value")
            if status is not None and not isinstance(status, str):
                raise _Bad(f"{at}.status is {_show(status)}, not a string or null")
            if value is not None and (not _number(value) or core_stats.finite(value) is None):
                raise _Bad(f"{at}.value is {_show(value)}, not a finite number or null")
            run = by_path.get(os.path.join(base, *job.split("/")))
            if run is not None:  # the run folder is the truth; tuned.json's record where it is missing
                status, value = run.status, run.final(metric) if run.ok else None
            tune.append(TuneJob(point, job, run, status, None if value is None else float(value)))
        best = entry.get("best")
        if best is not None:
            best = _point(best, grid, f"{where}.best")
            if not any(job.point == best for job in tune):
                raise _Bad(f"{where}.best {_show(best)} is none of its grid points")
        seeds_raw = entry.get("seeds", [])
        if not isinstance(seeds_raw, list):
            raise _Bad(f"{where}.seeds is {_show(seeds_raw)}, not a list")
        seed_jobs = []
        for j, item in enumerate(seeds_raw):
            at = f"{where}.seeds[{j}]"
            if not isinstance(item, dict):
                raise _Bad(f"{at} is {_show(item)}, not an object")
            seed = item.get("seed")
            if not _is_int(seed):
                raise _Bad(f"{at}.seed is {_show(seed)}, not an integer")
            job = job_folder(item.get("job"), f"{at}.job")
            reused = item.get("reused", False)
            if not isinstance(reused, bool):
                raise _Bad(f"{at}.reused is {_show(reused)}, not true or false")
            if reused and (best is None or job != next(t.job for t in tune if t.point == best)):
                raise _Bad(f"{at}.job {_show(job)} is reused but is not the tuning job at the best point")
            if not reused:
                if job in jobs:
                    raise _Bad(f"{at}.job {_show(job)} is listed twice")
                jobs.add(job)
            seed_jobs.append(SeedJob(seed, job, reused, by_path.get(os.path.join(base, *job.split("/")))))
        configurations.append(TunedConfiguration(label, tune, best, seed_jobs))
    return TunedSweep(Path(folder), name, metric, direction, grid, tune_seed, list(seeds), stage, configurations)


def _point(value: Any, grid: dict[str, list[Any]], where: str) -> dict[str, Any]:
    """A grid point: a value of each grid key, from its list."""
    if not isinstance(value, dict) or set(value) != set(grid):
        raise _Bad(f"{where} is {_show(value)}, not a value of each of {', '.join(grid)}")
    for key, v in value.items():
        if not _scalar(v) or not any(_same(v, g) for g in grid[key]):
            raise _Bad(f"{where}.{key} is {_show(v)}, not a value of grid.{key}")
    return {key: value[key] for key in grid}


def job_folder(value: Any, where: str = "job") -> str:
    """A job's folder, relative to the sweep's: words separated by ``/``, none of them empty, ``.`` or ``..``;
    never absolute. A ValueError naming ``where`` otherwise (``tuned.json`` is untrusted: its jobs are never
    followed out of the sweep folder)."""
    if not isinstance(value, str) or not value or len(value) > 1000:
        raise _Bad(f"{where} is {_show(value)}, not a folder name")
    parts = value.split("/")
    if value.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in value or "\x00" in value:
        raise _Bad(f"{where} {_show(value)} is not a folder inside the sweep's (never followed)")
    return value


def _integer(value: Any, where: str) -> int:
    if not _is_int(value):
        raise _Bad(f"{where} is {_show(value)}, not an integer")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 200:
        raise _Bad(f"{where} is {_show(value)}, not a metric's name")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | bool) or (_number(value) and math.isfinite(value))


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same kind (``1`` and ``True`` are not the same grid value)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _abs(path: str | Path) -> str:
    return os.path.abspath(path)


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
