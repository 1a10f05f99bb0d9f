"""The tuned sweeper: every configuration of a sweep at its own best settings, then on several seeds.

    python train.py -m hydra/sweeper=tuned variant=scaled_dot,additive,linear

A shared learning rate makes a comparison a statement about that learning rate (Narang et al. 2021: most
Transformer modifications do not transfer once re-tuned). The protocol, after MAD (Poli et al. 2024) and Zoology
(Arora et al. 2023), with seed intervals at the tuned point added:

1. **tune**: each configuration (a point of the command line's sweep) runs every point of ``grid`` (default
   ``lr: [1e-3, 3e-3, 1e-2]``; weight decay and any other key may be added) on ``tune_seed``. The best point is the
   one with the best ``metric`` (default ``optimized_metric``, ``val/acc_best``; ``direction`` maximize or
   minimize) read from each job's summary.json. A job that failed, or whose metric is missing or not finite, ranks
   last, never first; ties go to the first point in grid order.
2. **seeds**: each configuration runs at its best point on every seed of ``seeds`` (default 1, 2, 3: not the tuning
   seed, so that the comparison's runs were not selected on their own validation metric). A seed equal to
   ``tune_seed`` reuses the tuning run instead of running it again. The comparison is then made on these runs'
   test metric (``python -m attnlab.dashboard <sweep>`` reads the sweep this way).

The sweep folder holds ``tune/<n>_<overrides>`` and ``seeds/<n>_<overrides>`` run folders and ``tuned.json`` (the
plan, every grid point's value and status, each configuration's best point and its seed runs), rewritten after
each stage. A tuned sweep started again with the same command and ``hydra.sweep.dir=<its folder>`` resumes: a job
whose folder holds a finished run is not run again (a failed one neither: it ranks last as before), and one that was
interrupted continues from its last checkpoint (``resume=true``). The jobs go through the configured launcher
(local, joblib, SLURM), a stage at a time.

Hydra finds the sweeper through the shim in ``hydra_plugins/attnlab_tuned_sweeper`` (Hydra instantiates sweepers
only from its ``hydra_plugins`` package); the config is ``conf/hydra/sweeper/tuned.yaml``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["TUNED_FILE", "TunedSweeper", "grid_points", "plan_count", "rank_value", "read_plan"]

log = logging.getLogger(__name__)

TUNED_FILE = "tuned.json"
FORMAT = 1
_SAFE = re.compile(r"[^A-Za-z0-9._=+,:@-]")


class TunedError(ValueError):
    """A tuned sweep that cannot be planned (one line)."""


def _as_list(value: Any, key: str) -> list[Any]:
    if isinstance(value, ListConfig | list | tuple):
        values = list(OmegaConf.to_container(value) if isinstance(value, ListConfig) else value)
    elif isinstance(value, str):
        values = [v.strip() for v in value.split(",") if v.strip()]
    else:
        values = [value]
    if not values:
        raise TunedError(f"hydra.sweeper.grid.{key} is empty: give at least one value")
    return values


def _text(value: Any) -> str:
    """A value as an override writes it (``0.001``, ``null``, ``true``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return format(value, "g")
    return str(value)


def grid_points(grid: dict[str, Any]) -> list[dict[str, Any]]:
    """The grid's points, the first key varying slowest: ``{lr: [a, b], wd: [0, 1]}`` → ``[{lr: a, wd: 0}, ...]``."""
    keys = list(grid)
    values = [_as_list(grid[k], k) for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def rank_value(value: Any, direction: str) -> float:
    """A job's metric as a number to maximise: a missing or non-finite value (a failed job) is -inf, so it ranks
    last in either direction."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return -math.inf
    if not math.isfinite(x):
        return -math.inf
    return x if direction == "maximize" else -x


def _folder_name(stage: str, num: int, overrides: Sequence[str]) -> str:
    """``tune/3_lr=0.001,variant=dot``: the stage, the job number, and the overrides made safe for a folder name and
    for Hydra's override grammar (quoted; no quote, ``$`` or backslash inside)."""
    from attnlab.training.config import job_dir_name

    name = _SAFE.sub("_", job_dir_name(",".join(sorted(overrides)), limit=150))
    return f"{stage}/{num}_{name}"


def read_plan(sweep_dir: str | Path) -> dict[str, Any] | None:
    """``tuned.json`` of a sweep folder (None when it has none or it cannot be read as a JSON object)."""
    from attnlab.runs import RunFileError, read_text

    path = Path(sweep_dir) / TUNED_FILE
    try:
        data = json.loads(read_text(path))
    except (RunFileError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _job_status(sweep_dir: Path, job: str) -> tuple[str | None, dict[str, Any]]:
    """(status, metrics) of the run in ``sweep_dir/job``: (None, {}) when there is none."""
    from attnlab.runs import RunFileError, RunFolder

    try:
        summary = RunFolder(sweep_dir / job).read_summary(problems=[])
    except (RunFileError, OSError):
        return "failed", {}
    if summary is None:
        return None, {}
    return summary.status, dict(summary.metrics)


def plan_count(config: DictConfig) -> int | None:
    """How many jobs a tuned sweep will launch (for the "job k/N" lines): grid × configurations plus the seed
    runs, less those whose folders already hold a finished or failed run."""
    try:
        sweeper = TunedSweeper(**{k: v for k, v in config.hydra.sweeper.items() if k != "_target_"})
        sweeper.config = config
        configs = sweeper._configurations(list(config.hydra.overrides.task))
    except Exception:
        return None
    sweep_dir = Path(str(config.hydra.sweep.dir))
    points = grid_points(sweeper.grid)
    total = 0
    for i, overrides in enumerate(configs):
        for j, point in enumerate(points):
            job = sweeper._tune_job(i, j, overrides, point, len(points))
            total += _job_status(sweep_dir, job[1])[0] in (None, "running", "interrupted")
    return total + len(configs) * len([s for s in sweeper.seeds if s != sweeper.tune_seed])


class TunedSweeper(Sweeper):
    """Hydra sweeper: tune each configuration on ``grid`` with ``tune_seed``, then run its best point on ``seeds``
    (see the module docstring). ``max_batch_size``: jobs handed to the launcher at once (None: a whole stage)."""

    def __init__(
        self,
        grid: dict[str, Any] | None = None,
        seeds: Sequence[int] = (1, 2, 3),
        tune_seed: int = 0,
        metric: str | None = None,
        direction: str = "maximize",
        max_batch_size: int | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.grid = dict(
            OmegaConf.to_container(grid)
            if isinstance(grid, DictConfig)
            else {"lr": [1e-3, 3e-3, 1e-2]}
            if grid is None
            else grid
        )
        self.seeds = [int(s) for s in (OmegaConf.to_container(seeds) if isinstance(seeds, ListConfig) else seeds)]
        self.tune_seed = int(tune_seed)
        self.metric = metric
        self.direction = str(direction)
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.config: DictConfig | None = None
        self.swept: set[str] = set()
        self.launcher: Any = None
        self.hydra_context: Any = None

    def validate(self) -> None:
        """:class:`TunedError` (one line) for a plan that cannot be run."""
        if self.direction not in ("maximize", "minimize"):
            raise TunedError(f"hydra.sweeper.direction={self.direction!r}: must be maximize or minimize")
        if not self.grid:
            raise TunedError("hydra.sweeper.grid is empty: give at least one key to tune (lr: [1e-3, 3e-3, 1e-2])")
        if not self.seeds:
            raise TunedError("hydra.sweeper.seeds is empty: give at least one seed for the comparison")
        if "seed" in self.grid:
            raise TunedError("hydra.sweeper.grid cannot tune seed: the seeds come from tune_seed and seeds")

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        _one_line(self.validate)
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        if self.metric is None:
            self.metric = str(config.get("optimized_metric") or "val/acc_best")

    # ------------------------------------------------------------------------------------------------- planning

    def _configurations(self, arguments: list[str]) -> list[list[str]]:
        """The command line's sweep as one list of overrides per configuration (Hydra's basic sweeper's product)."""
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        given = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        parsed = OverridesParser.create().parse_overrides(given)
        for override in parsed:
            key = override.get_key_element().lstrip("+~")
            if key == "seed":
                raise TunedError(
                    "a tuned sweep sets seed itself (tune_seed, then seeds): leave seed off the command line"
                )
            if key in self.grid:
                raise TunedError(
                    f"{key} is tuned (hydra.sweeper.grid.{key}), so it cannot also be given on the command line: "
                    f"set the grid with hydra.sweeper.grid.{key}=[...]"
                )
        self.swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
        (configs,) = BasicSweeper.split_arguments(parsed, None)
        return configs

    def _named(self, overrides: Sequence[str]) -> list[str]:
        """The overrides that name a job's folder: not those Hydra leaves out of ``override_dirname``
        (``debug``, ``logger``, ... in conf/hydra/default.yaml)."""
        excluded = set(OmegaConf.select(self.config, "hydra.job.config.override_dirname.exclude_keys") or [])
        return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in excluded]

    def _label(self, overrides: Sequence[str]) -> str:
        """A configuration's name: its swept overrides (all of them when nothing is swept)."""
        swept = [o for o in overrides if o.split("=", 1)[0] in self.swept]
        return ",".join(swept or self._named(overrides))

    def _tune_job(
        self, i: int, j: int, overrides: list[str], point: dict[str, Any], n_points: int
    ) -> tuple[list[str], str]:
        grid = [f"{k}={_text(v)}" for k, v in point.items()]
        num = i * n_points + j
        return [*overrides, *grid, f"seed={self.tune_seed}"], _folder_name(
            "tune", num, self._named([*overrides, *grid])
        )

    # ---------------------------------------------------------------------------------------------------- sweep

    def sweep(self, arguments: list[str]) -> Any:
        from attnlab.runs import write_json_atomic

        assert self.config is not None and self.launcher is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        configs = _one_line(self._configurations, arguments)
        points = grid_points(self.grid)
        plan: dict[str, Any] = {
            "format": FORMAT,
            "metric": self.metric,
            "direction": self.direction,
            "grid": {k: _as_list(v, k) for k, v in self.grid.items()},
            "tune_seed": self.tune_seed,
            "seeds": self.seeds,
            "stage": "tune",
            "configurations": [],
        }
        tune_jobs: list[tuple[list[str], str]] = []
        for i, overrides in enumerate(configs):
            entry: dict[str, Any] = {"overrides": overrides, "label": self._label(overrides), "tune": [], "best": None}
            for j, point in enumerate(points):
                job = self._tune_job(i, j, overrides, point, len(points))
                tune_jobs.append(job)
                entry["tune"].append({"point": point, "job": job[1], "status": None, "value": None})
            plan["configurations"].append(entry)
        write_json_atomic(sweep_dir / TUNED_FILE, plan)
        returns = [self._launch(sweep_dir, tune_jobs, 0)]

        # the best point of each configuration, from the summaries the jobs wrote
        seed_jobs: list[tuple[list[str], str]] = []
        num = len(tune_jobs)
        for entry in plan["configurations"]:
            for item in entry["tune"]:
                status, metrics = _job_status(sweep_dir, item["job"])
                item["status"], item["value"] = status, metrics.get(self.metric)
            ranked = [
                rank_value(item["value"] if item["status"] == "ok" else None, self.direction) for item in entry["tune"]
            ]
            best = max(range(len(ranked)), key=lambda k: (ranked[k], -k))
            entry["best"] = entry["tune"][best]["point"] if math.isfinite(ranked[best]) else None
            entry["seeds"] = []
            if entry["best"] is None:
                log.warning("tuned sweep: every grid point of %s failed; its seeds are not run", entry["label"])
                continue
            grid = [f"{k}={_text(v)}" for k, v in entry["best"].items()]
            for seed in self.seeds:
                if seed == self.tune_seed:
                    entry["seeds"].append({"seed": seed, "job": entry["tune"][best]["job"], "reused": True})
                    continue
                overrides = [*entry["overrides"], *grid, f"seed={seed}"]
                job = _folder_name("seeds", num, self._named([*entry["overrides"], *grid, f"seed={seed}"]))
                num += 1
                seed_jobs.append((overrides, job))
                entry["seeds"].append({"seed": seed, "job": job})
        plan["stage"] = "seeds"
        write_json_atomic(sweep_dir / TUNED_FILE, plan)
        returns.append(self._launch(sweep_dir, seed_jobs, len(tune_jobs)))
        for entry in plan["configurations"]:
            for item in entry.get("seeds", []):
                item["status"] = _job_status(sweep_dir, item["job"])[0]
        plan["stage"] = "done"
        write_json_atomic(sweep_dir / TUNED_FILE, plan)
        _print_plan(plan, sweep_dir)
        return returns

    def _launch(self, sweep_dir: Path, jobs: list[tuple[list[str], str]], first: int) -> list[Any]:
        """Launch the jobs whose folders hold no finished or failed run (an interrupted one resumes), in batches of
        ``max_batch_size``; a job's number is its place in the plan."""
        from attnlab.training.sweep import signalled

        todo: list[tuple[int, list[str]]] = []
        for k, (overrides, job) in enumerate(jobs):
            status, _ = _job_status(sweep_dir, job)
            if status in ("ok", "failed"):
                continue
            extra = ["resume=true"] if status is not None else []
            todo.append((first + k, [*overrides, *extra, f"hydra.sweep.subdir='{job}'"]))
        results: list[Any] = []
        size = self.max_batch_size or len(todo) or 1
        for start in range(0, len(todo), size):
            if signalled():
                break
            batch = todo[start : start + size]
            # (a launcher numbers a batch's jobs from its first index on; the folder names carry the plan's numbers)
            results.extend(self.launcher.launch([o for _, o in batch], initial_job_idx=batch[0][0]))
        return results


def _one_line(function: Any, *args: Any) -> Any:
    """``function(*args)``; a :class:`TunedError` ends the sweep with one line and exit code 2, before any job."""
    import sys

    try:
        return function(*args)
    except TunedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _print_plan(plan: dict[str, Any], sweep_dir: Path) -> None:
    """The tuned sweep's outcome: each configuration's best point, its tuning value and its seeds' test accuracy."""
    from rich.table import Table

    from attnlab.console import plain_console
    from attnlab.dashboard.stats import mean_ci

    table = Table(
        title=f"tuned sweep {sweep_dir}: best {plan['metric']} on seed {plan['tune_seed']}", title_justify="left"
    )
    for col in ("configuration", "best", plan["metric"], "test acc (seeds)"):
        table.add_column(col, justify="left" if col in ("configuration", "best") else "right")
    for entry in plan["configurations"]:
        best = entry.get("best")
        value = next((t["value"] for t in entry["tune"] if t["point"] == best), None) if best else None
        tests = [_job_status(sweep_dir, s["job"])[1].get("test/acc") for s in entry.get("seeds", [])]
        mean, half, n = mean_ci(tests)
        shown = (
            "-" if n == 0 else f"{100 * mean:.1f}%" + (f" ± {100 * half:.1f}" if half is not None else "") + f" (n={n})"
        )
        table.add_row(
            entry["label"] or "(base)",
            ", ".join(f"{k}={_text(v)}" for k, v in best.items()) if best else "all failed",
            f"{value:.4g}" if isinstance(value, int | float) else "-",
            shown,
        )
    plain_console().print(table)
